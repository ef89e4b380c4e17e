"""Measure what the CPU runtime can rely on: per-thread intra-op threads, overlap, handoffs.

Run::

    .venv/bin/python benchmarks/threads_probe.py [--quick]

Prints three tables:

(a) intra-op thread count semantics with PyTorch's OpenMP backend: is ``torch.set_num_threads``
    in a worker thread local to it, and does a worker set to 1 thread really run 1 thread?
(b) two Python worker threads running independent chains of ``tanh(x @ W)`` against both
    chains run serially on one thread with 2 intra-op threads, for several batch sizes.
(c) the cost of one cross-thread handoff (ping-pong round trip / 2) for
    ``threading.Event``, a spin on a Python flag, ``queue.SimpleQueue`` and
    ``threading.Lock`` hand-over.
"""

from __future__ import annotations

import argparse
import queue
import statistics
import threading
import time

import torch

aten = torch.ops.aten


def _median_time(fn, repeats: int) -> float:
    fn()  # warm-up: thread pools, allocator, lazy init
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _in_thread(fn):
    """Run ``fn`` in a fresh thread and return its result."""
    box = {}
    t = threading.Thread(target=lambda: box.setdefault("r", fn()))
    t.start()
    t.join()
    return box["r"]


# -- (a) ---------------------------------------------------------------------------------
def probe_thread_semantics(repeats: int) -> list[tuple[str, str]]:
    rows = []
    default = torch.get_num_threads()  # also lazily initialises this thread's OpenMP ICV
    rows.append(("main: get_num_threads() at start", str(default)))

    def worker_sets_one():
        torch.set_num_threads(1)
        return torch.get_num_threads()

    rows.append(("worker: set_num_threads(1); get", str(_in_thread(worker_sets_one))))
    rows.append(("main: get_num_threads() afterwards", str(torch.get_num_threads())))
    rows.append(("fresh thread: get_num_threads()", str(_in_thread(torch.get_num_threads))))
    torch.set_num_threads(default)  # restores the process-wide default new threads copy
    rows.append(("fresh thread after main re-sets default", str(_in_thread(torch.get_num_threads))))

    # Does the per-thread setting change the work actually done in parallel? A big matmul
    # takes ~2x longer on 1 thread than on 2 when the setting is honoured.
    a = torch.randn(1024, 1024)

    def mm_time(k):
        def body():
            torch.set_num_threads(k)
            return _median_time(lambda: torch.mm(a, a), repeats)

        return _in_thread(body)

    def mm_time_ctypes(k):  # autopar's way: thread-local OpenMP/MKL setters via ctypes
        from autopar.runtime.streams import set_thread_local_threads

        def body():
            set_thread_local_threads(k)
            return _median_time(lambda: torch.mm(a, a), repeats)

        return _in_thread(body)

    t1, t2 = mm_time(1), mm_time(default)
    c1, c2 = mm_time_ctypes(1), mm_time_ctypes(default)
    rows.append(("ctypes: worker mm with 1 thread (ms)", f"{c1 * 1e3:.2f}"))
    rows.append((f"ctypes: worker mm with {default} threads (ms)", f"{c2 * 1e3:.2f}"))
    rows.append(("ctypes: fresh thread afterwards", str(_in_thread(torch.get_num_threads))))
    torch.set_num_threads(default)
    rows.append(("worker mm 1024^3 with 1 thread (ms)", f"{t1 * 1e3:.2f}"))
    rows.append((f"worker mm 1024^3 with {default} threads (ms)", f"{t2 * 1e3:.2f}"))
    rows.append(("main still at", str(torch.get_num_threads())))
    return rows


# -- (b) ---------------------------------------------------------------------------------
def _chain(x, w, n):
    for _ in range(n):
        x = aten.tanh.default(aten.mm.default(x, w))
    return x


def probe_overlap(batches, n_ops: int, repeats: int) -> list[tuple]:
    default = torch.get_num_threads()
    rows = []
    w1, w2 = torch.randn(256, 256) * 0.05, torch.randn(256, 256) * 0.05
    for b in batches:
        rows.append(_overlap_one(b, w1, w2, n_ops, repeats, default))
    return rows


def _overlap_one(b, w1, w2, n_ops, repeats, default) -> tuple:
    """(B, serial 2t, serial 1t, two workers, main + worker, speed-ups) for batch ``b``."""
    x1, x2 = torch.randn(b, 256), torch.randn(b, 256)

    def serial(k):
        torch.set_num_threads(k)
        t = _median_time(lambda: (_chain(x1, w1, n_ops), _chain(x2, w2, n_ops)), repeats)
        torch.set_num_threads(default)
        return t

    t_serial2, t_serial1 = serial(default), serial(1)

    # Two persistent workers with 1 intra-op thread each, started by events.
    go = [threading.Event(), threading.Event()]
    done = [threading.Event(), threading.Event()]
    stop = [False]

    def worker(i, x, w):
        torch.set_num_threads(1)
        while True:
            go[i].wait()
            go[i].clear()
            if stop[0]:
                return
            _chain(x, w, n_ops)
            done[i].set()

    ts = [
        threading.Thread(target=worker, args=(0, x1, w1), daemon=True),
        threading.Thread(target=worker, args=(1, x2, w2), daemon=True),
    ]
    for t in ts:
        t.start()
    torch.set_num_threads(default)  # undo the workers' change of the new-thread default

    def parallel():
        for e in go:
            e.set()
        for e in done:
            e.wait()
            e.clear()

    t_par = _median_time(parallel, repeats)

    # Main thread runs chain 1 itself (1 thread), one worker runs chain 2.
    def main_plus_worker():
        torch.set_num_threads(1)
        go[1].set()
        _chain(x1, w1, n_ops)
        done[1].wait()
        done[1].clear()
        torch.set_num_threads(default)

    t_mw = _median_time(main_plus_worker, repeats)
    stop[0] = True
    for e in go:
        e.set()
    for t in ts:
        t.join()
    return (b, t_serial2, t_serial1, t_par, t_mw, t_serial2 / t_par, t_serial2 / t_mw)


# -- (c) ---------------------------------------------------------------------------------
def probe_handoff(n: int) -> list[tuple[str, float]]:
    rows = []

    # threading.Event ping-pong
    a, b = threading.Event(), threading.Event()

    def ev_peer():
        for _ in range(n):
            a.wait()
            a.clear()
            b.set()

    t = threading.Thread(target=ev_peer)
    t.start()
    t0 = time.perf_counter()
    for _ in range(n):
        a.set()
        b.wait()
        b.clear()
    rows.append(("threading.Event set/wait", (time.perf_counter() - t0) / (2 * n)))
    t.join()

    # spin on a Python list cell (GIL-switch bound: each spin iteration yields the GIL)
    flag = [0]

    def spin_peer():
        for i in range(n):
            while flag[0] != 2 * i + 1:
                pass
            flag[0] = 2 * i + 2

    t = threading.Thread(target=spin_peer)
    t.start()
    t0 = time.perf_counter()
    for i in range(n):
        flag[0] = 2 * i + 1
        while flag[0] != 2 * i + 2:
            pass
    rows.append(("spin on Python flag", (time.perf_counter() - t0) / (2 * n)))
    t.join()

    # queue.SimpleQueue ping-pong
    q1, q2 = queue.SimpleQueue(), queue.SimpleQueue()

    def q_peer():
        for _ in range(n):
            q2.put(q1.get())

    t = threading.Thread(target=q_peer)
    t.start()
    t0 = time.perf_counter()
    for i in range(n):
        q1.put(i)
        q2.get()
    rows.append(("queue.SimpleQueue put/get", (time.perf_counter() - t0) / (2 * n)))
    t.join()
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer repeats and sizes")
    args = ap.parse_args()
    repeats = 5 if args.quick else 15
    batches = (16, 256) if args.quick else (4, 16, 64, 256, 1024)
    print(f"torch {torch.__version__}, backend: {torch.__config__.parallel_info().splitlines()[3]}")
    print(f"default intra-op threads: {torch.get_num_threads()}\n")

    print("(a) intra-op thread count semantics")
    for k, v in probe_thread_semantics(repeats):
        print(f"  {k:<44} {v}")

    print("\n(b) two independent chains of 200 x tanh(x[B,256] @ W[256,256])  (ms)")
    hdr = ("B", "serial 2t", "serial 1t", "2 workers 1t", "main+worker", "spd wk", "spd m+w")
    print("  " + "".join(f"{h:>13}" for h in hdr))
    for row in probe_overlap(batches, 200, repeats):
        b, *ts, s1, s2 = row
        cells = [f"{b:>13}"] + [f"{t * 1e3:>13.2f}" for t in ts]
        cells += [f"{s1:>12.2f}x", f"{s2:>12.2f}x"]
        print("  " + "".join(cells))

    print("\n(c) one cross-thread handoff (round trip / 2)")
    for name, t in probe_handoff(200 if args.quick else 1000):
        print(f"  {name:<30} {t * 1e6:8.1f} us")


if __name__ == "__main__":
    main()
