"""Feasibility probe: TorchScript fork/wait vs autopar's Python worker streams vs eager.

Run::

    .venv/bin/python benchmarks/ts_probe.py [--quick] [--rounds N]

Two independent chains of ``n`` x ``tanh(x[B,K] @ W[K,K])`` run
(a) serially in eager on the calling thread with the default intra-op threads,
(b) by two persistent Python worker threads with 1 intra-op thread each (autopar's current
    CPU executor: ``autopar.runtime.streams.run_streams``, Events for start/finish),
(c) in one TorchScript function that ``torch.jit.fork``-s a scripted chain (straight-line
    generated source, like codegen would emit) per chain and ``torch.jit.wait``-s both,
    with ``torch.set_num_threads(1)`` (the inter-op pool has ``get_num_interop_threads()``),
(d) (c) with the first chain run inline by the forking task, and both chains scripted
    but run one after the other (default intra-op threads); eager with 1 intra-op thread.
The ratio columns compare the best of eager 2t/1t, and Python streams, with the best TS run.
Methods are interleaved round by round; the table shows the median over rounds of each
round's median time.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from autopar.runtime import streams as rt

aten = torch.ops.aten


def _chain_source(n: int, name: str) -> str:
    body = "\n".join("    x = torch.ops.aten.tanh(torch.ops.aten.mm(x, w))" for _ in range(n))
    return f"def {name}(x, w):\n{body}\n    return x\n"


def make_ts(n: int):
    src = _chain_source(n, "chain") + (
        "\ndef two(x1, w1, x2, w2):\n"
        "    f1 = torch.jit.fork(chain, x1, w1)\n"
        "    f2 = torch.jit.fork(chain, x2, w2)\n"
        "    return torch.jit.wait(f1), torch.jit.wait(f2)\n"
        "\ndef two_inline(x1, w1, x2, w2):\n"
        "    f2 = torch.jit.fork(chain, x2, w2)\n"
        "    y1 = chain(x1, w1)\n"
        "    return y1, torch.jit.wait(f2)\n"
    )
    return torch.jit.CompilationUnit(src)


def _py_chain(x, w, n):
    for _ in range(n):
        x = aten.tanh.default(aten.mm.default(x, w))
    return x


def _time(fn, reps: int) -> float:
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def probe(b: int, k: int, n: int, rounds: int, reps: int) -> dict[str, float]:
    default = torch.get_num_threads()
    x1, x2 = torch.randn(b, k), torch.randn(b, k)
    w1, w2 = torch.randn(k, k) * 0.05, torch.randn(k, k) * 0.05
    cu = make_ts(n)

    def eager():
        return _py_chain(x1, w1, n), _py_chain(x2, w2, n)

    spec = rt.StreamSpec(
        main=lambda st: (_py_chain(x1, w1, n), rt.st_join(st), st.v[0])[::2],
        workers=((lambda st: st.v.__setitem__(0, _py_chain(x2, w2, n)), 1),),
        main_threads=1,
        stream_ids=(0, 1),
    )

    def py_streams():
        return rt.run_streams(spec, rt.CallState(1, 0, ()))

    def ts_fork():
        torch.set_num_threads(1)
        try:
            return cu.two(x1, w1, x2, w2)
        finally:
            torch.set_num_threads(default)

    def ts_inline():
        torch.set_num_threads(1)
        try:
            return cu.two_inline(x1, w1, x2, w2)
        finally:
            torch.set_num_threads(default)

    def eager1():
        torch.set_num_threads(1)
        try:
            return eager()
        finally:
            torch.set_num_threads(default)

    def ts_serial():  # both chains scripted, one after the other, default threads
        return cu.chain(x1, w1), cu.chain(x2, w2)

    methods = {
        "eager 2t": eager,
        "eager 1t": eager1,
        "py streams 2x1t": py_streams,
        "ts fork 2x1t": ts_fork,
        "ts fork+inline": ts_inline,
        "ts serial 2t": ts_serial,
    }
    ref = eager()
    for name, fn in methods.items():  # warm-up (profiling executor runs) + correctness
        for _ in range(3):
            out = fn()
        assert all(torch.allclose(a, r, atol=1e-5) for a, r in zip(out, ref, strict=True)), name
    acc: dict[str, list[float]] = {m: [] for m in methods}
    for _ in range(rounds):
        for name, fn in methods.items():
            acc[name].append(_time(fn, reps))
    return {m: statistics.median(v) for m, v in acc.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--ops", type=int, default=200, help="chain length (mm+tanh pairs)")
    args = ap.parse_args()
    sizes = [(16, 256), (64, 256)] if args.quick else [(16, 64), (16, 256), (64, 256), (256, 256)]
    print(
        f"torch {torch.__version__}, intra-op {torch.get_num_threads()}, "
        f"inter-op {torch.get_num_interop_threads()}; 2 chains x {args.ops} x tanh(mm)  (ms)"
    )
    names = None
    for b, k in sizes:
        r = probe(b, k, args.ops, args.rounds, 5)
        if names is None:
            names = list(r)
            print(
                f"{'[B,K]':>10}"
                + "".join(f"{m:>17}" for m in names)
                + f"{'eager/ts':>10}{'py/ts':>10}"
            )
        best_ts = min(r["ts fork 2x1t"], r["ts fork+inline"])
        print(
            f"{str([b, k]):>10}"
            + "".join(f"{r[m] * 1e3:>17.2f}" for m in names)
            + f"{min(r['eager 2t'], r['eager 1t']) / best_ts:>9.2f}x"
            + f"{r['py streams 2x1t'] / best_ts:>9.2f}x"
        )


if __name__ == "__main__":
    main()
