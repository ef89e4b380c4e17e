"""The batch split's two runners: the Python one against the native one (``split.cpp``).

Both run a bench model's graph as two half batches at once through the same half-batch
program (Inductor's C++ wrapper, one OpenMP thread), so the difference is what lies around
the compiled kernels: the hand-off of the second half to another thread, each half's
autograd, the joins. Contenders, each one forward and backward of the graph with a fixed
output gradient (median ms of ``--rounds`` calls after a warm-up), each in its own
process, the processes alternating ABBA (``--processes`` of each). Not in one process: the
Python runner releases the calling thread's idle OpenMP team before each call (its
spinning would take the worker's core), and the native runner's region then starts a new
team thread every call, with fresh memory:

* ``python``: ``runtime.executors.split.SplitRunner`` (a Python worker thread, one Python
  autograd function per half, Python gradient sums);
* ``native``: ``runtime.executors.split.NativeSplitRunner`` (one C++ autograd function, the
  program's C++ entry on both halves from a two-thread OpenMP region);
* ``serial``: the two halves' compiled forward and backward one after the other on the
  calling thread at one thread: half of it is what two perfectly parallel halves would take.

Each process first checks that the two runners' outputs and gradients agree (same kernels,
same halves, one thread each; to float tolerance).

Run::

    ../shared/tools/quiet-check --wait 60
    .venv/bin/python benchmarks/native_split.py [--model inception] [--rounds 200]
        [--processes 3]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time

import torch

from autopar.runtime import native
from autopar.runtime.executors.split import NativeSplitRunner, split_parts
from autopar.runtime.streams import intra_op_threads
from autopar.tools.bench_models import BENCH_MODELS


def _graph(model, x):
    """The Dynamo graph of ``model(x)`` and its example inputs, as a backend sees them."""
    seen = {}

    def backend(gm, example_inputs):
        seen["gm"], seen["args"] = gm, list(example_inputs)
        return gm.forward

    torch.compile(model, backend=backend, dynamic=False)(x)
    return seen["gm"], seen["args"]


def measure(name: str, rounds: int, only: str) -> float:
    """Median ms of contender ``only`` on model ``name`` (this process runs no other)."""
    bm = BENCH_MODELS[name]
    torch.manual_seed(0)
    model, (x,) = bm.make(), bm.make_inputs()
    gm, args = _graph(model, x)
    _, build, check = split_parts(gm, args, "g0")
    if check() is not None:
        sys.exit(f"{name}: not split: {check()}")
    program = build()  # Inductor compiles (cold: tens of seconds)
    if not isinstance(program.fn, NativeSplitRunner):
        sys.exit(f"{name}: the native runner is not used: {program.runner}")
    params = [a for a in args if a.requires_grad]
    (out,) = program.fn.python(*args)
    grad = torch.randn_like(out)
    direct, n = program.joint.fn, program.joint.fn.num_outputs

    def step(runner):
        for p in params:
            p.grad = None
        (o,) = runner(*args)
        o.backward(grad)
        return o, [p.grad for p in params]

    def serial():
        halves = program.fn.python.halves([a.detach() for a in args])
        with intra_op_threads(1):
            for k, half in enumerate(halves):
                outs = direct.forward(half)
                rows = slice(0, program.fn.python.half) if k == 0 else slice(
                    program.fn.python.half, None)  # fmt: skip
                direct.backward([*outs[n:], grad[rows].contiguous()])

    a, b = step(program.fn), step(program.fn.python)
    same = all(torch.allclose(p, q, rtol=1e-5, atol=1e-6) for p, q in zip(a[1], b[1], strict=True))
    assert torch.allclose(a[0], b[0], rtol=1e-5, atol=1e-6) and same, "the runners disagree"
    contenders = {"python": lambda: step(program.fn.python), "native": lambda: step(program.fn),
                  "serial": serial}  # fmt: skip
    fn, times = contenders[only], []
    for _ in range(20):
        fn()
    for _ in range(rounds):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="inception")
    ap.add_argument("--rounds", type=int, default=200)
    ap.add_argument("--processes", type=int, default=3, help="processes of each contender")
    ap.add_argument("--only", choices=("python", "native", "serial"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    native.load()
    if args.only:
        print(f"{measure(args.model, args.rounds, args.only):.4f}")
        return
    names = ["python", "native", "serial"]
    ms: dict[str, list[float]] = {k: [] for k in names}
    for i in range(args.processes):
        for name in names if i % 2 == 0 else names[::-1]:
            cmd = [sys.executable, __file__, "--model", args.model, "--rounds",
                   str(args.rounds), "--only", name]  # fmt: skip
            out = subprocess.run(cmd, capture_output=True, text=True, check=True,
                                 env={**os.environ, "PYTHONWARNINGS": "ignore"})  # fmt: skip
            ms[name].append(float(out.stdout.split()[-1]))
    print(f"{args.model}, torch {torch.__version__}, forward + backward, median ms per process:")
    for name in names:
        print(f"  {name:7s} " + " ".join(f"{v:.3f}" for v in ms[name]))
    py, nat = statistics.median(ms["python"]), statistics.median(ms["native"])
    print(f"  python / native {py / nat:.3f}x (medians); serial / 2 = "
          f"{statistics.median(ms['serial']) / 2:.3f} ms")  # fmt: skip


if __name__ == "__main__":
    main()
