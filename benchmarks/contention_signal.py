"""Which per-sample signal tells a disturbed timing sample from a clean one, against busy loops.

Run::

    .venv/bin/python benchmarks/contention_signal.py [--samples 400] [--size 256] \\
        [--op matmul|cat]

For each condition (``0``, ``1`` or ``2`` busy-loop processes, ``python -c "while True:
pass"``, started half a second before and killed after; 2 or 1 intra-op threads), an
operator (``matmul``: ``size``^3 fp32; ``cat``: four ``[size, size]`` fp32 tensors, a
memory-bound copy split over the OpenMP team) is timed ``--samples`` times, one call per
sample, the way
``autopar.profiling.timing.time_sample`` does. Per sample it records the three signals of
``timing._is_disturbed``:

* ``cpu``: the calling thread ran for less than 90% of the sample (``time.thread_time``);
* ``preempt``: a thread of the process was preempted during it (``getrusage`` ru_nivcsw);
* ``queue``: the process's threads waited for a CPU for more than 5% of it
  (``RunQueueClock``, ``/proc/self/task/*/schedstat``).

A sample is *slow* when it took more than 1.5x the condition's fastest one. The table gives,
per signal rule, how many slow samples it flags (should be all) and how many fast ones
(should be none), and the median of the samples the rule keeps (should be the quiet time).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time

import torch

from autopar.profiling.timing import RunQueueClock, time_sample

SIGNALS = ("cpu", "preempt", "queue")  # timing.contention_signals' names

RULES = {
    "cpu+preempt (before)": lambda s: s["cpu"] or s["preempt"],
    "queue alone": lambda s: s["queue"],
    "cpu+preempt+queue (now)": lambda s: s["cpu"] or s["preempt"] or s["queue"],
}


def samples(n: int, op) -> list[dict]:
    """``n`` one-call samples of ``op`` timed by ``timing.time_sample``, with its signals."""
    op()  # warm: the OpenMP team exists before the clock lists the threads
    with RunQueueClock() as clock:
        got = [time_sample(op, 1, None, clock) for _ in range(n)]
    return [{"wall": t.seconds, **{name: name in t.signals for name in SIGNALS}} for t in got]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--samples", type=int, default=400)
    ap.add_argument("--size", type=int, default=256)
    ap.add_argument("--op", choices=("matmul", "cat"), default="matmul")
    args = ap.parse_args(argv)
    x = torch.randn(args.size, args.size)
    xs = [torch.randn(args.size, args.size) for _ in range(4)]
    op = (lambda: x @ x) if args.op == "matmul" else (lambda: torch.cat(xs))
    default = torch.get_num_threads()
    print(f"operator: {args.op}, size {args.size}")
    print(f"load average before: {' '.join(f'{v:.2f}' for v in os.getloadavg())}")
    print("| busy loops | threads | rule | median all | median kept (kept) | slow flagged | "
          "fast flagged |\n|---|---|---|---|---|---|---|")  # fmt: skip
    for loops in (0, 1, 2):
        procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(loops)]
        try:
            time.sleep(0.5 if loops else 0.0)
            for threads in (2, 1):
                torch.set_num_threads(threads)
                got = samples(args.samples, op)
                best = min(s["wall"] for s in got)
                slow = [s for s in got if s["wall"] > 1.5 * best]
                fast = [s for s in got if s["wall"] <= 1.5 * best]
                med = statistics.median(s["wall"] for s in got) * 1e3
                for name, rule in RULES.items():
                    kept = [s["wall"] for s in got if not rule(s)]
                    km = f"{statistics.median(kept) * 1e3:.3f} ms ({len(kept)})" if kept else "-"
                    n_slow, n_fast = sum(map(rule, slow)), sum(map(rule, fast))
                    flagged = f"{n_slow}/{len(slow)} | {n_fast}/{len(fast)}"
                    print(f"| {loops} | {threads} | {name} | {med:.3f} ms | {km} | {flagged} |")
        finally:
            torch.set_num_threads(default)
            for p in procs:
                p.kill()
                p.wait()
    print(f"load average after: {' '.join(f'{v:.2f}' for v in os.getloadavg())}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
