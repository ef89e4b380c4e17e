"""Training steps as a training loop takes them: one model for a block of steps, then the
other, alternating (``autopar bench`` rotates models step by step, so every step starts with
the other models' weights in the caches).

usage: .venv/bin/python benchmarks/training_loop.py [MODEL] [--block 40] [--rounds 12]
       [--torch-compile] [--python]

MODEL is an ``autopar bench`` model (default ``towers``). Contenders: eager, autopar with
its planned programs only (``race=False, inductor=False``: on the native interpreter when
it is built), ``--python`` adds the same with ``native=False``, ``--torch-compile`` adds
torch.compile. Each round runs a block of steps of every contender (order reversed every
other round); a block's first quarter is dropped (its caches are the previous contender's);
the table gives the median block median and eager's block time over the contender's, per
round (median, min, max).

2026-12-02 evening (2-core box, QUIET, load1 0.76): towers eager 10.54 ms, autopar native
9.87 ms, 1.057x (blocks 0.98-1.21x).
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import time

import torch

import autopar
from autopar.profiling.store import ProfileStore
from autopar.tools.bench_models import BENCH_MODELS, make_loss


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", nargs="?", default="towers", choices=sorted(BENCH_MODELS))
    ap.add_argument("--block", type=int, default=40)
    ap.add_argument("--rounds", type=int, default=12)
    ap.add_argument("--torch-compile", action="store_true")
    ap.add_argument("--python", action="store_true")
    a = ap.parse_args()
    spec = BENCH_MODELS[a.model]
    torch.manual_seed(0)
    base, inputs = spec.make(), spec.make_inputs()
    with torch.no_grad():
        loss_fn = make_loss(spec, base(*inputs))
    opts = dict(race=False, inductor=False)
    makers = {"eager": lambda m: m,
              "autopar": lambda m: autopar.compile(m, store=ProfileStore.memory(), **opts)}
    if a.python:
        makers["autopar-python"] = lambda m: autopar.compile(
            m, store=ProfileStore.memory(), native=False, **opts)  # fmt: skip
    if a.torch_compile:
        makers["torch.compile"] = torch.compile
    cont = {}
    for name, make in makers.items():
        m = copy.deepcopy(base)
        cont[name] = (make(m), torch.optim.SGD(m.parameters(), lr=0.01))

    def step(name: str) -> float:
        module, opt = cont[name]
        t0 = time.perf_counter()
        opt.zero_grad()
        loss_fn(module(*inputs)).backward()
        opt.step()
        return time.perf_counter() - t0

    for name in cont:
        for _ in range(30):  # compiles, first-call measurements, warm caches
            step(name)
    blocks = {k: [] for k in cont}
    ratio = {k: [] for k in cont}
    for r in range(a.rounds):
        order = list(cont) if r % 2 == 0 else list(cont)[::-1]
        this = {}
        for name in order:
            ts = [step(name) for _ in range(a.block)]
            this[name] = statistics.median(ts[a.block // 4:])
            blocks[name].append(this[name])
        for name in cont:
            ratio[name].append(this["eager"] / this[name])
    print(f"{a.model}: blocks of {a.block} steps, {a.rounds} rounds, load1 "
          f"{os.getloadavg()[0]:.2f}")  # fmt: skip
    for name in cont:
        rs = ratio[name]
        print(f"  {name:16s} {statistics.median(blocks[name]) * 1e3:8.3f} ms  eager/x "
              f"{statistics.median(rs):.3f} ({min(rs):.3f}-{max(rs):.3f})")  # fmt: skip
    for name, (module, _) in cont.items():
        if name.startswith("autopar"):
            shown = ", ".join(f"{u.tag} {u.program.executor or 'python'} "
                              f"{len(u.program.streams_used) or 1} stream(s)"
                              for u in autopar.graphs(module))  # fmt: skip
            print(f"  {name}: {shown}")


if __name__ == "__main__":
    main()
