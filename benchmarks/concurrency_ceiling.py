"""How much could branch concurrency gain on the multi-tower MLP, on this machine? (issue 12)

The towers are the one multi-branch model below its 1.15x goal. This script measures the
ceiling of every way autopar can run independent work at once on a CPU, from the bottom up:

1. **Two of autopar's worker streams** (``runtime.streams.run_streams``), eight tower layers
   each at one thread, against the sixteen one after another at two threads: right after a
   2-thread op as in training (its idle OpenMP team is released first) and back to back.
   (Runs first: threads that ran OpenMP regions and exited, as part 2's do, can leave the
   process where a later fork waits milliseconds for a core.)
2. **Intra-op scaling**: one 64x256x256 ``addmm`` (a tower layer) at 1 and 2 intra-op
   threads, and two 1-thread loops of it on two threads at once. If two 1-thread streams
   did more work per second than one 2-thread op, branch concurrency has room.
3. **Whole steps in two processes** (no GIL, no handoff: an upper bound): the training step
   at 2 threads in one process, against two 1-thread processes each stepping the whole
   model (the work of two steps: what perfect tower concurrency would reach) or each half
   the batch (what a perfect batch split would reach, before summing gradients).
Run::

    .venv/bin/python ../shared/tools/quiet-check --wait 60
    .venv/bin/python benchmarks/concurrency_ceiling.py
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import threading
import time

import torch

MODEL = "zoo.MultiTowerMLP(d_in=64, hidden=256, towers=4, depth=4)"  # the bench's towers


def median_us(fn, n: int = 300) -> float:
    for _ in range(20):
        fn()
    ts = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts) * 1e6


def intra_op_scaling() -> None:
    from autopar.runtime.streams import intra_op_threads, set_thread_local_threads

    w, b, x = torch.randn(256, 256), torch.randn(256), torch.randn(64, 256)
    op = lambda: torch.addmm(b, x, w.t())  # noqa: E731
    with intra_op_threads(1):
        one = median_us(op)
    two = median_us(op)
    n, done = 2000, {}

    def loop(i: int) -> None:
        set_thread_local_threads(1)
        t0 = time.perf_counter()
        for _ in range(n):
            op()
        done[i] = time.perf_counter() - t0

    t0 = time.perf_counter()
    threads = [threading.Thread(target=loop, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    both = time.perf_counter() - t0
    print(f"2. addmm 64x256x256: 1 thread {one:.1f} us, 2 threads {two:.1f} us "
          f"(x{one / two:.2f}); two 1-thread loops at once: {both / (2 * n) * 1e6:.1f} us "
          f"per op (x{one / (both / (2 * n) * 1e6):.2f} the 1-thread throughput)")  # fmt: skip


_STEP = f"""
import sys, time, torch
from autopar.tools import zoo
threads, batch, seconds = int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3])
torch.set_num_threads(threads)
torch.manual_seed(0)
m = {MODEL}
x = torch.randn(batch, 64)
opt = torch.optim.SGD(m.parameters(), lr=1e-3)
def step():
    opt.zero_grad(set_to_none=True)
    m(x).sum().backward()
    opt.step()
for _ in range(50):
    step()
n, t0 = 0, time.perf_counter()
while time.perf_counter() - t0 < seconds:
    step()
    n += 1
print((time.perf_counter() - t0) / n)
"""


def _steps(runs: list[tuple[int, int]], seconds: float) -> list[float]:
    """Seconds per step of each (threads, batch) process, all started at once."""
    procs = [subprocess.Popen([sys.executable, "-c", _STEP, str(t), str(b), str(seconds)],
                              stdout=subprocess.PIPE, text=True) for t, b in runs]  # fmt: skip
    return [float(p.communicate()[0]) for p in procs]


def two_processes(seconds: float, repeats: int = 2) -> None:
    rows = {"one": [], "tower": [], "split": []}
    for _ in range(repeats):  # alternated, so a slow phase of the box hits all three
        rows["one"].append(_steps([(2, 64)], seconds)[0])
        rows["tower"].append(max(_steps([(1, 64), (1, 64)], seconds)) / 2)
        rows["split"].append(max(_steps([(1, 32), (1, 32)], seconds)))
    one, tower, split = (statistics.median(rows[k]) * 1e3 for k in ("one", "tower", "split"))
    print(f"3. towers step, batch 64: one process at 2 threads {one:.3f} ms; two 1-thread "
          f"processes at once: {tower:.3f} ms per step of work (x{one / tower:.2f}: perfect "
          f"tower concurrency), half batches {split:.3f} ms (x{one / split:.2f}: a perfect "
          f"batch split, gradients not summed, the optimizer run twice)")  # fmt: skip


def fork_join() -> None:
    import autopar.runtime.streams as rt
    from autopar.runtime.streams import intra_op_threads

    w, b, x = torch.randn(256, 256), torch.randn(256), torch.randn(64, 256)

    def layers(st=None) -> None:  # eight tower layers
        for _ in range(8):
            torch.addmm(b, x, w.t())

    spec = rt.StreamSpec(main=lambda st: (layers(), rt.st_join(st)), workers=((layers, 1),),
                         main_threads=1, stream_ids=(0, 1))  # fmt: skip
    streams = lambda: rt.run_streams(spec, rt.CallState(0, 0, ()))  # noqa: E731
    a = torch.randn(256, 256)
    serial = median_us(lambda: (layers(), layers()))
    with intra_op_threads(1):
        one = median_us(layers)
    after_op = median_us(lambda: (a @ a, streams())) - median_us(lambda: a @ a)
    print(f"1. 16 tower layers (addmm 64x256x256): one after another at 2 threads {serial:.0f} "
          f"us; two worker streams of 8 at 1 thread (run_streams) {after_op:.0f} us after a "
          f"2-thread op (as in training), {median_us(streams):.0f} us back to back; 8 alone "
          f"at 1 thread {one:.0f} us")  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=6.0, help="per process run (part 3)")
    args = ap.parse_args(argv)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} intra-op threads")
    fork_join()
    intra_op_scaling()
    two_processes(args.seconds)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
