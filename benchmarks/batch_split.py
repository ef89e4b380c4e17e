"""Can splitting the batch across two threads beat one 2-thread compiled graph on 2 cores?

An upper bound for batch-split concurrency (data parallelism over CPU worker threads inside
one process): no synchronisation beyond a queue, no gradient summing, no equivalence
machinery, only the forward and backward of the model's output (the optimizer step is
left out, it would be the same for every contender).

Contenders, interleaved ABBA in one process (median, ratio = compiled / contender):

* ``compiled``: ``torch.compile(model)`` on the whole batch at the caller's intra-op
  threads (2 here): Inductor's kernels, and the oneDNN/MKL calls it makes, use both cores;
* ``split, serial``: the batch's two halves one after the other on the calling thread, each
  through a ``torch.compile`` with the C++ wrapper and one OpenMP thread (``cpp.threads=1``);
* ``split threads``: the same two halves at once on two persistent worker threads, one
  intra-op thread each (the C++ wrapper releases the GIL for the whole compiled graph).

Run::

    .venv/bin/python ../shared/tools/quiet-check --wait 60
    .venv/bin/python benchmarks/batch_split.py [--models inception,towers] [--rounds 40]
"""

from __future__ import annotations

import argparse
import queue
import statistics
import threading
import time

import torch

from autopar.runtime.streams import intra_op_threads, set_thread_local_threads
from autopar.tools.bench_models import BENCH_MODELS


def _fw_bw(fn, x) -> None:
    fn(x).square().mean().backward()


def measure(name: str, rounds: int) -> dict[str, float]:
    """Median milliseconds per forward and backward of each contender on model ``name``."""
    bm = BENCH_MODELS[name]
    torch.manual_seed(0)
    model, (x,) = bm.make(), bm.make_inputs()
    half = x.shape[0] // 2
    whole = torch.compile(model)
    split = torch.compile(model, options={"cpp_wrapper": True, "cpp.threads": 1})
    jobs: list[queue.Queue] = [queue.Queue(), queue.Queue()]
    done: queue.Queue = queue.Queue()

    def worker(q: queue.Queue) -> None:
        set_thread_local_threads(1)
        while (xs := q.get()) is not None:
            _fw_bw(split, xs)
            done.put(True)

    threads = [threading.Thread(target=worker, args=(q,), daemon=True) for q in jobs]
    for t in threads:
        t.start()

    def split_threads():
        jobs[0].put(x[:half])
        jobs[1].put(x[half:])
        done.get()
        done.get()

    def split_serial():
        with intra_op_threads(1):
            _fw_bw(split, x[:half])
            _fw_bw(split, x[half:])

    contenders = {"compiled": lambda: _fw_bw(whole, x), "split, serial": split_serial,
                  "split threads": split_threads}  # fmt: skip
    times: dict[str, list[float]] = {k: [] for k in contenders}
    for _ in range(5):  # compiles (cold: tens of seconds) and warm-up
        for fn in contenders.values():
            fn()
    order = list(contenders)
    for _ in range(rounds):
        for key in order + order[::-1]:
            t0 = time.perf_counter()
            contenders[key]()
            times[key].append(time.perf_counter() - t0)
    for q in jobs:
        q.put(None)
    model.zero_grad(set_to_none=True)
    return {k: statistics.median(v) * 1e3 for k, v in times.items()}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="inception,towers")
    ap.add_argument("--rounds", type=int, default=40)
    args = ap.parse_args(argv)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} intra-op threads; forward "
          "+ backward, median ms (ratio = compiled / contender, > 1 is faster)")  # fmt: skip
    for name in args.models.split(","):
        ms = measure(name, args.rounds)
        cells = ", ".join(f"{k} {v:.2f} ms ({ms['compiled'] / v:.2f}x)" for k, v in ms.items())
        print(f"{name}: {cells}", flush=True)


if __name__ == "__main__":
    main()
