"""Why two CPU streams can lose: libgomp's idle team spins right after a 2-thread op.

Times two independent fused LSTM layers (forward + backward, oneDNN; hidden ``--hidden``,
16 steps, batch 16) run one after the other at the default thread count, and run at once
on two threads at one intra-op thread each (the way autopar runs two CPU streams):

1. on their own;
2. right after a 2-thread GEMM on the calling thread (as in a training step, where eager
   ops and the previous graph run at full width): the calling thread's idle OpenMP team
   thread spin-waits (``GOMP_SPINCOUNT``) on the core the second stream needs;
3. as 2., with that idle team released first (``autopar.runtime.streams.release_idle_omp_team``,
   which ``run_streams`` calls).

Run::

    .venv/bin/python benchmarks/omp_spin_probe.py [--hidden 128]
"""

from __future__ import annotations

import argparse
import threading
import time

import torch
from torch import nn

from autopar.rnn.cells import fused_lstm_layer
from autopar.runtime.streams import (
    intra_op_threads,
    release_idle_omp_team,
    set_thread_local_threads,
)


def best_ms(fn, reps: int = 9) -> float:
    fn()
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", type=int, default=128)
    hidden = ap.parse_args().hidden
    torch.manual_seed(0)
    lstm = nn.LSTM(hidden, hidden)
    w = [p.detach().clone().requires_grad_() for p in lstm.parameters()]
    x = torch.randn(16, 16, hidden, requires_grad=True)
    h0 = torch.zeros(16, hidden)
    a = torch.randn(256, 256)

    def layer():
        out, _, _ = fused_lstm_layer(x, *w, h0, h0)
        out.sum().backward()

    def two_streams():
        def second():
            set_thread_local_threads(1)
            layer()

        worker = threading.Thread(target=second)
        worker.start()
        with intra_op_threads(1):
            layer()
        worker.join()

    def wide_op():  # a 2-thread op on the calling thread
        torch.mm(a, a)

    rows = [
        ("alone", lambda: (layer(), layer()), two_streams),
        ("after a 2-thread op", lambda: (wide_op(), layer(), layer()),
         lambda: (wide_op(), two_streams())),
        ("after it, team released", lambda: (wide_op(), layer(), layer()),
         lambda: (wide_op(), release_idle_omp_team(), two_streams())),
    ]  # fmt: skip
    print(f"hidden {hidden}, {torch.get_num_threads()} threads; best of 9, ms")
    print(f"{'':26s} {'one after other':>16s} {'two streams':>12s} {'speedup':>8s}")
    for name, serial, concurrent in rows:
        s, c = best_ms(serial), best_ms(concurrent)
        print(f"{name:26s} {s:16.2f} {c:12.2f} {s / c:7.2f}x")


if __name__ == "__main__":
    main()
