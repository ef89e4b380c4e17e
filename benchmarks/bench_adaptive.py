"""Adaptive execution benchmark: monitor overhead, stale vs adapted plan, peak memory.

Run from the repository root::

    .venv/bin/python benchmarks/bench_adaptive.py            # about a minute
    .venv/bin/python benchmarks/bench_adaptive.py --steps 200 --model towers

1. Overhead: two copies of one model, ``adapt=True`` (default ``AdaptOptions``) and
   ``adapt=False``, train interleaved (order alternating each round); medians of the
   forward+backward time. On a loaded machine the end-to-end difference is noise-dominated,
   so the monitor's own bookkeeping per graph call is also timed directly (``monitor us``).
2. Slowdown: a two-branch model (a matmul chain next to a conv chain) on 2 streams; after
   warm-up ``autopar.adapt.monitor.inject_slowdown(target="aten.mm.default", factor=...)`` makes the
   matmuls look slower (the documented, deterministic test hook: measured time includes the
   simulated extra cost of the running plan). The monitor detects the drift, re-profiles,
   re-plans in the background and swaps the new plan in. The table compares the stale plan
   and the adapted plan on the same (slowed) costs: measured (real + injected) and simulated.
3. Memory: the serial inference plan's predicted peak vs ``measure_peak_memory``.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time

import torch
import torch.nn as nn

import autopar
from autopar.adapt import monitor as adapt
from autopar.profiling.store import ProfileStore
from autopar.tools import zoo


class TwoBranch(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(128, 128) / 12)
        self.conv = nn.Conv1d(8, 8, 3, padding=1)

    def forward(self, x, z):
        a = x
        for _ in range(3):
            a = torch.tanh(a @ self.w)
        b = z
        for _ in range(3):
            b = torch.sigmoid(self.conv(b))
        return a.sum() + b.sum()


def _step(m, inputs) -> float:
    t0 = time.perf_counter()
    m(*inputs).sum().backward()
    return time.perf_counter() - t0


def overhead(model_name: str, steps: int, store) -> list[str]:
    model, inputs = zoo.build(model_name)
    on = autopar.compile(copy.deepcopy(model), streams=2, store=store, adapt=True)
    off = autopar.compile(copy.deepcopy(model), streams=2, store=store, adapt=False)
    for m in (on, off):
        for _ in range(3):
            _step(m, inputs)
    times: dict[str, list[float]] = {"on": [], "off": []}
    for i in range(steps):
        pair = (("on", on), ("off", off)) if i % 2 else (("off", off), ("on", on))
        for name, m in pair:
            times[name].append(_step(m, inputs))
    mon = on._autopar_pipeline.monitor
    rec = on._autopar_pipeline.records[0]
    st = adapt._GraphState()  # a scratch state: the real one keeps its history
    n = 2000
    t0 = time.perf_counter()
    for _ in range(n):  # the bookkeeping on_call adds around the runner
        mon._observe(rec, st, 1e-3, None)
    per_call = (time.perf_counter() - t0) / n
    for _ in range(n):
        mon.rows.pop()
    med_on, med_off = statistics.median(times["on"]), statistics.median(times["off"])
    book = 2 * per_call / med_off  # two graph calls per step
    return [
        f"| {model_name} | {steps} | {med_off * 1e3:.2f} | {med_on * 1e3:.2f} | "
        f"{(med_on / med_off - 1) * 100:+.1f}% | {per_call * 1e6:.1f} | {book * 100:.2f}% |"
    ]


def slowdown(factor: float, store) -> list[str]:
    from autopar.planning.partition import default_machine
    from autopar.planning.simulate import simulate
    from autopar.planning.taskgraph import task_graph_from_profile

    model = TwoBranch()
    g = torch.Generator().manual_seed(0)
    inputs = (torch.randn(64, 128, generator=g), torch.randn(16, 8, 256, generator=g))
    opts = autopar.AdaptOptions(window=4, warmup=1, threshold=2.0, max_replans=6)
    cm = autopar.compile(model, streams=2, policy="heft", store=store, adapt=opts)
    for _ in range(8):
        _step(cm, inputs)
    recs = {r.tag: r for r in cm._autopar_pipeline.records}
    stale = {t: (r.plan, r.table) for t, r in recs.items()}
    start = cm._autopar_pipeline.monitor.step + 1
    adapt.inject_slowdown(cm, "aten.mm.default", factor)
    for _ in range(40):
        _step(cm, inputs)
        adapt.wait(cm)
        if all(r.plan.plan_hash != stale[t][0].plan_hash for t, r in recs.items()):
            break
    for _ in range(10):
        _step(cm, inputs)
    rows = autopar.stats(cm, per="graph")
    rows = rows[rows.step >= start]
    machine = default_machine(store)
    out = []
    for tag, r in recs.items():
        plan0, table = stale[tag]
        slow = table.copy()
        sel = slow.target == "aten.mm.default"
        slow.loc[sel, ["time_s", "time_1t_s"]] *= factor
        tg = task_graph_from_profile(slow)
        for label, plan in (("stale", plan0), ("adapted", r.plan)):
            sim = simulate(tg, plan.placement, list(plan.order), list(plan.streams), machine)
            mine = rows[(rows.graph == tag) & (rows.plan == plan.plan_hash) & rows.ratio.notna()]
            meas = statistics.median(mine.measured_s) * 1e3 if len(mine) else float("nan")
            out.append(
                f"| {tag} | {label} | {plan.plan_hash} | {len(mine)} | {meas:.2f} | "
                f"{sim.makespan * 1e3:.2f} |"
            )
    events = [e for e in autopar.stats(cm).event if "re-planned" in e]
    out.append("")
    out += [f"event: {e}" for e in events]
    return out


def memory(store) -> list[str]:
    out = []
    for name, x in (("mlp", torch.randn(256, 32)), ("towers", torch.randn(128, 64))):
        model, _ = zoo.build(name)
        cm = autopar.compile(model, streams=1, policy="serial", store=store, adapt=False)
        with torch.no_grad():
            cm(x)
            (rec,) = cm._autopar_pipeline.records
            seen, runner = [], rec.runner
            rec.runner = lambda a, seen=seen, runner=runner: seen.append(list(a)) or runner(a)
            cm(x)
            fn, args = rec.program.fn, seen[0]
            measured = adapt.measure_peak_memory(fn, *args)
        pred = rec.plan.predicted_peak_memory
        out.append(f"| {name} {list(x.shape)} | {pred} | {measured} | {measured / pred:.2f} |")
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="bench_adaptive.py")
    ap.add_argument("--model", default="towers")
    ap.add_argument("--steps", type=int, default=120)
    ap.add_argument("--factor", type=float, default=30.0)
    a = ap.parse_args(argv)
    store = ProfileStore.memory()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} intra-op threads\n")
    print("## monitor overhead (forward+backward, median of interleaved steps)\n")
    print("| model | steps | adapt=False ms | adapt=True ms | end-to-end | monitor us/call "
          "| monitor/step |")  # fmt: skip
    print("|---|---|---|---|---|---|---|")
    print("\n".join(overhead(a.model, a.steps, store)))
    print(f"\n## injected slowdown: aten.mm.default x{a.factor:g} (measured includes it)\n")
    print("| graph | plan | id | steps | measured ms | simulated ms (slow costs) |")
    print("|---|---|---|---|---|---|")
    print("\n".join(slowdown(a.factor, store)))
    print("\n## peak memory of the serial inference plan\n")
    print("| model | predicted B | measured B | measured/predicted |")
    print("|---|---|---|---|")
    print("\n".join(memory(store)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
