"""Training-step time: autopar's Python worker-stream executor vs the TorchScript executor.

Run::

    .venv/bin/python benchmarks/bench_executor.py [--rounds 7] [--steps 10] [--models towers,...]

For each zoo model: eager, autopar (2 streams, HEFT) with ``executor="python"`` and with
``executor="torchscript"`` (``AUTOPAR_EXECUTOR`` set while compiling). Both autopar models
share one in-memory profile store, so the second compile reuses the first one's profile and
gets the same plans. A step is ``zero_grad; model(x).sum().backward(); SGD step``. Methods
are interleaved round by round; the table shows the median over rounds of each round's
median step time, and the speed-up over eager.
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import time
import warnings

import torch

import autopar
from autopar.profiling.store import ProfileStore
from autopar.tools import zoo

INPUTS = {"towers": lambda: (torch.randn(32, 64),)}


def _compile(model, store, executor: str, inputs):
    os.environ["AUTOPAR_EXECUTOR"] = executor
    try:
        cm = autopar.compile(model, streams=2, policy="heft", store=store)
        for _ in range(3):  # profile, plan and generate happen on the first calls
            cm(*inputs).sum().backward()
    finally:
        del os.environ["AUTOPAR_EXECUTOR"]
    records = cm._autopar_pipeline.records
    progs = [r.program for r in records if r.program is not None]
    fell = sum(any("torchscript executor not used" in n for n in p.notes) for p in progs)
    ts = sum("torch.jit.fork" in p.source for p in progs)
    return cm, f"{len(progs)} programs, {ts} forking, {fell} fallbacks"


def _step_fn(model, inputs):
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)

    def step():
        opt.zero_grad(set_to_none=True)
        model(*inputs).sum().backward()
        opt.step()

    return step


def bench(name: str, rounds: int, steps: int) -> tuple[dict[str, float], list[str]]:
    model, inputs = zoo.build(name)
    inputs = INPUTS.get(name, lambda: inputs)()
    store = ProfileStore.memory()
    py, info_py = _compile(copy.deepcopy(model), store, "python", inputs)
    ts, info_ts = _compile(copy.deepcopy(model), store, "torchscript", inputs)
    eager = _step_fn(copy.deepcopy(model), inputs)
    default = torch.get_num_threads()

    def eager_1t():
        torch.set_num_threads(1)
        try:
            eager()
        finally:
            torch.set_num_threads(default)

    methods = {
        "eager": eager,
        "eager 1t": eager_1t,
        "python": _step_fn(py, inputs),
        "torchscript": _step_fn(ts, inputs),
    }
    for fn in methods.values():
        for _ in range(3):
            fn()
    acc: dict[str, list[float]] = {m: [] for m in methods}
    for _ in range(rounds):
        for m, fn in methods.items():
            ts_ = []
            for _ in range(steps):
                t0 = time.perf_counter()
                fn()
                ts_.append(time.perf_counter() - t0)
            acc[m].append(statistics.median(ts_))
    return {m: statistics.median(v) for m, v in acc.items()}, [info_py, info_ts]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--models", default="towers,inception,transformer")
    ap.add_argument(
        "--threads", type=int, default=0, help="process intra-op threads (0: leave as is)"
    )
    args = ap.parse_args()
    if args.threads:  # on a loaded 2-core box 2 OpenMP threads can cost 100x (barrier waits)
        torch.set_num_threads(args.threads)
    warnings.simplefilter("ignore")
    print(f"torch {torch.__version__}, {os.cpu_count()} cpus, intra-op {torch.get_num_threads()}")
    hdr = f"{'model':<12}{'eager ms':>10}{'eager1t ms':>11}{'python ms':>11}{'ts ms':>9}"
    hdr += f"{'py/eager':>10}"
    print(hdr + f"{'ts/eager':>10}{'ts vs py':>10}  programs (python | torchscript)")
    for name in args.models.split(","):
        r, info = bench(name, args.rounds, args.steps)
        e1, p, t = r["eager 1t"], r["python"], r["torchscript"]
        e = min(r["eager"], e1)  # the better eager
        print(
            f"{name:<12}{r['eager'] * 1e3:>10.2f}{e1 * 1e3:>11.2f}{p * 1e3:>11.2f}{t * 1e3:>9.2f}"
            f"{e / p:>9.2f}x"
            f"{e / t:>9.2f}x{p / t:>9.2f}x  {info[0]} | {info[1]}"
        )


if __name__ == "__main__":
    main()
