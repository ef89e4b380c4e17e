"""What a fork and a join cost on this machine, and what the native interpreter's cost.

usage: .venv/bin/python benchmarks/native_fork.py [--rounds N]

1. A round trip between two threads (post work, wait for "done"): through a condition
   variable (C, pthreads), through an atomic flag polled by a spinning thread (C), and through
   Python's ``queue.SimpleQueue`` + ``threading.Event`` (what ``runtime.streams`` uses).
   The C helper is compiled with gcc into a temporary directory.
2. The native interpreter (``autopar.runtime.native``): a program of two tiny independent ops
   on two streams against the same on one stream, so the difference is its fork, its
   cross-stream event and its join; and the multi-tower MLP's forward graph (bench shape,
   batch 64) as Python and native programs, serial and on two streams.

Measured 2026-12-02 on the 2-core KVM box (AMD EPYC), quiet (``quiet-check``), two runs:
condition variable 69 / 10 us, spinning flag 0.31 / 0.38 us, Python queue + event 58 / 103
us a round trip; the interpreter's fork + join 2.8 us; the towers forward graph: Python
serial 2207 us, Python on two worker streams 2668 us, native serial 2227 us, native on two
streams 1430 us (1.54x).
"""

from __future__ import annotations

import argparse
import ctypes
import os
import queue
import statistics
import subprocess
import tempfile
import threading
import time

_C = r"""
#include <pthread.h>
#include <stdatomic.h>
#include <time.h>
static atomic_int flag = 0;
static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t cv = PTHREAD_COND_INITIALIZER;
static int state = 0, mode = 0, started[2] = {0, 0};
static void* worker(void* a) {
  int m = *(int*)a;
  for (;;) {
    if (m == 0) {
      while (atomic_load(&flag) != 1) __builtin_ia32_pause();
      atomic_store(&flag, 2);
    } else {
      pthread_mutex_lock(&mu);
      while (state != 1) pthread_cond_wait(&cv, &mu);
      state = 2; pthread_cond_broadcast(&cv); pthread_mutex_unlock(&mu);
    }
  }
  return 0;
}
static double now(void) {
  struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec * 1e6 + t.tv_nsec / 1e3;
}
double round_trip_us(int m, int n) {  /* m: 0 spinning flag, 1 condition variable */
  static int modes[2] = {0, 1};
  if (!started[m]) { pthread_t t; pthread_create(&t, 0, worker, &modes[m]); started[m] = 1; }
  double t0 = now();
  for (int i = 0; i < n; i++) {
    if (m == 0) { atomic_store(&flag, 1); while (atomic_load(&flag) != 2) __builtin_ia32_pause(); }
    else {
      pthread_mutex_lock(&mu); state = 1; pthread_cond_broadcast(&cv);
      while (state != 2) pthread_cond_wait(&cv, &mu);
      state = 0; pthread_mutex_unlock(&mu);
    }
  }
  return (now() - t0) / n;
}
"""


def c_round_trips(n: int) -> dict[str, float]:
    d = tempfile.mkdtemp(prefix="autopar-fork-")
    src, lib = os.path.join(d, "rt.c"), os.path.join(d, "rt.so")
    with open(src, "w") as f:
        f.write(_C)
    subprocess.run(["gcc", "-O2", "-shared", "-fPIC", "-o", lib, src, "-lpthread"], check=True)
    rt = ctypes.CDLL(lib)
    rt.round_trip_us.restype = ctypes.c_double
    cv = rt.round_trip_us(1, n)
    return {"condition variable": cv, "spinning flag": rt.round_trip_us(0, 20 * n)}
    # (the spinning worker keeps a core busy until the process exits: measured last)


def python_round_trip(n: int) -> float:
    q, done = queue.SimpleQueue(), threading.Event()

    def worker():
        while q.get() is not None:
            done.set()

    t = threading.Thread(target=worker, daemon=True)
    t.start()
    t0 = time.perf_counter()
    for _ in range(n):
        done.clear()
        q.put(1)
        done.wait()
    dt = (time.perf_counter() - t0) / n * 1e6
    q.put(None)
    return dt


def _median_us(fn, args, rounds: int) -> float:
    for _ in range(20):
        fn(*args)
    ts = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        fn(*args)
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts) * 1e6


def interpreter(rounds: int) -> None:
    import torch
    import torch.nn.functional as F
    from torch.fx.experimental.proxy_tensor import make_fx

    import autopar
    from autopar.capture.analysis import example_args
    from autopar.codegen.emitters import generate
    from autopar.planning.partition import make_plan
    from autopar.planning.plan import Plan, Stream, node_key
    from autopar.profiling.store import ProfileStore
    from autopar.tools.zoo import MultiTowerMLP

    gm = make_fx(lambda a, b: (a + 1, b + 1))(torch.ones(4), torch.ones(4))
    keys = [node_key("g0.fw", n.name) for n in gm.graph.nodes]
    one = Plan("g0.fw", "hand", (Stream(0, "cpu", 1),), tuple((k, 0) for k in keys),
               tuple(keys), ())  # fmt: skip
    two = one.replace(streams=(Stream(0, "cpu", 1), Stream(1, "cpu", 1)),
                      placements=tuple((k, i % 2) for i, k in enumerate(keys)))  # fmt: skip
    a = (torch.ones(4), torch.ones(4))
    p1, p2 = (generate(gm, p, "g0.fw", emitter="native") for p in (one, two))
    t1, t2 = (_median_us(p.fn, a, rounds) for p in (p1, p2))
    print(f"2. interpreter, two adds: one stream {t1:.1f} us, two streams {t2:.1f} us "
          f"(fork + join {t2 - t1:.1f} us)")  # fmt: skip

    torch.manual_seed(0)
    cm = autopar.compile(MultiTowerMLP(d_in=64, hidden=256, towers=4, depth=4), streams=2,
                         inductor=False, race=False, native=False, store=ProfileStore.memory())
    F.mse_loss(cm(torch.randn(64, 64)), torch.randn(64, 1)).backward()
    r = next(r for r in cm._autopar_pipeline.records if r.tag == "g0.fw")
    args = example_args(r.gm)
    serial = make_plan(r.table, policy="serial", graph_id=r.tag)
    heft = make_plan(r.table, streams=[Stream(0, "cpu", 1), Stream(1, "cpu", 1)],
                     policy="heft", graph_id=r.tag)  # fmt: skip
    progs = {f"{e} {n}": generate(r.gm, p, r.tag, emitter=e).fn
             for e in ("python", "native") for n, p in (("serial", serial), ("2 streams", heft))}
    res = {k: [] for k in progs}
    with torch.no_grad():
        for _ in range(5):  # rounds of every program, so drifts hit all alike
            for k, f in progs.items():
                res[k].append(_median_us(f, args, max(rounds // 50, 20)))
    shown = ", ".join(f"{k} {statistics.median(v):.0f} us" for k, v in res.items())
    print(f"3. towers forward graph (batch 64): {shown}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=2000)
    args = ap.parse_args()
    print(f"load {os.getloadavg()[0]:.2f}")
    py = python_round_trip(args.rounds)
    interpreter(args.rounds)
    c = c_round_trips(args.rounds)
    print(f"1. round trip: condition variable {c['condition variable']:.1f} us, spinning flag "
          f"{c['spinning flag']:.2f} us, Python queue + event {py:.1f} us")  # fmt: skip


if __name__ == "__main__":
    main()
