"""Per-graph time: Inductor segments on two streams vs the whole graph compiled by Inductor.

Run::

    .venv/bin/python benchmarks/bench_segments.py [--models towers,inception] [--rounds 9]

For each zoo model, its forward and backward aten graphs are captured with
``autopar.compile(model, streams=2, policy="heft")`` and planned again with HEFT on two
1-thread streams (the calibrated machine model, as the pipeline plans). Contenders, each
called on the same inputs under ``no_grad``:

| contender      | what runs                                                         |
|----------------|-------------------------------------------------------------------|
| ``eager``      | the captured aten graph (``gm(*args)``), 2 intra-op threads       |
| ``plan py``    | autopar's current executor for the plan (per-op worker streams)    |
| ``ind``        | the whole graph by Inductor, Python wrapper, 2 intra-op threads    |
| ``ind cpp``    | the whole graph by Inductor, C++ wrapper, 2 intra-op threads       |
| ``segments``   | ``compile_segments``: the plan's segments, C++ wrapper, 1 thread per stream |
| ``seg refined``| the same after ``refine_for_segments`` (segments, heavy nodes moved) |

A round runs every contender ``--calls`` times (the order rotates each round) and keeps
the median call; the table shows the median over ``--rounds`` rounds. Everything is
compiled first; each graph's timing then starts with ``quiet-check --wait 120``, whose
line is printed with it.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
import warnings

import torch

import autopar
from autopar.capture.analysis import example_args
from autopar.codegen.executors import generate
from autopar.codegen.inductor import compile_inductor
from autopar.codegen.segments import compile_segments, cut_segments, refine_for_segments
from autopar.planning.partition import make_plan
from autopar.profiling.store import ProfileStore
from autopar.tools import zoo

QUIET_CHECK = "/work/shared/tools/quiet-check"


def contenders(record, store) -> tuple[dict, str]:
    """The callables to time for one graph, and a description of its segments."""
    streams = [autopar.Stream(0, "cpu", 1), autopar.Stream(1, "cpu", 1)]
    plan = make_plan(record.table, streams=streams, policy="heft", graph_id=record.tag,
                     store=store)  # fmt: skip
    args = example_args(record.gm)
    refined, note = refine_for_segments(record.gm, plan, record.tag)
    cut = cut_segments(record.gm, plan, record.tag)
    t0 = time.perf_counter()
    seg = compile_segments(record.gm, plan, args, tag=record.tag)
    seg_s = time.perf_counter() - t0
    ref = compile_segments(record.gm, refined, args, tag=record.tag)
    ind = compile_inductor(record.gm, args, tag=record.tag)
    cpp = compile_inductor(record.gm, args, tag=record.tag, cpp_wrapper=True)
    py = generate(record.gm, plan, record.tag, executor="python")
    gm = record.gm
    fns = {
        "eager": lambda: gm(*args),
        "plan py": lambda: py.fn(*args),
        "ind": lambda: ind.fn(*args),
        "ind cpp": lambda: cpp.fn(*args),
        "segments": lambda: seg.fn(*args),
        "seg refined": lambda: ref.fn(*args),
    }
    shape = " ".join(f"{s.stream}:{len(s.nodes)}" for s in cut.segments)
    waits = sum(len(s.waits) for s in cut.segments)
    info = f"{len(cut.segments)} segs, {waits} waits, compiled {seg_s:.0f} s [{shape}]; {note}"
    return fns, info


def time_interleaved(fns: dict, rounds: int, calls: int) -> dict[str, float]:
    names = list(fns)
    with torch.no_grad():
        for fn in fns.values():  # warm up: first calls load kernels, start workers
            for _ in range(3):
                fn()
        per_round: dict[str, list[float]] = {n: [] for n in names}
        for r in range(rounds):
            for name in names[r % len(names) :] + names[: r % len(names)]:
                ts = []
                for _ in range(calls):
                    t0 = time.perf_counter()
                    fns[name]()
                    ts.append(time.perf_counter() - t0)
                per_round[name].append(statistics.median(ts))
    return {n: statistics.median(v) for n, v in per_round.items()}


def quiet_line() -> str:
    """``quiet-check --wait 120``'s line: times on a busy 2-core box mean little (a
    neighbour on one core stalls every 2-thread OpenMP barrier)."""
    if not os.path.exists(QUIET_CHECK):
        return "quiet-check: not found"
    q = subprocess.run([sys.executable, QUIET_CHECK, "--wait", "120"],
                       capture_output=True, text=True)  # fmt: skip
    return q.stdout.strip() or q.stderr.strip()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="towers,inception")
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--calls", type=int, default=20)
    a = ap.parse_args()
    warnings.simplefilter("ignore")
    print(f"torch {torch.__version__}, {os.cpu_count()} cpus, intra-op {torch.get_num_threads()}")
    graphs = []  # compile everything first: the timing below runs on a quiet machine
    for name in a.models.split(","):
        model, inputs = zoo.build(name)
        store = ProfileStore.memory()
        cm = autopar.compile(model, streams=2, policy="heft", store=store)
        cm(*inputs).sum().backward()
        for record in cm._autopar_pipeline.records:
            if record.table is not None:
                graphs.append((f"{name} {record.tag}", *contenders(record, store)))
    rows = []
    for label, fns, info in graphs:
        line = quiet_line()
        rows.append((label, time_interleaved(fns, a.rounds, a.calls), info, line))
        print(f"{label}: {line}", flush=True)
    names = list(rows[0][1])
    print(f"{'graph':<18}" + "".join(f"{n + ' ms':>14}" for n in names)
          + f"{'best ind/seg':>13}{'/refined':>9}")  # fmt: skip
    for label, t, _, _ in rows:
        best = min(t["ind"], t["ind cpp"])
        cells = "".join(f"{t[n] * 1e3:>14.3f}" for n in names)
        print(f"{label:<18}{cells}{best / t['segments']:>12.2f}x"
              f"{best / t['seg refined']:>8.2f}x")  # fmt: skip
    for label, _, info, _ in rows:
        print(f"{label:<18}{info}")


if __name__ == "__main__":
    main()
