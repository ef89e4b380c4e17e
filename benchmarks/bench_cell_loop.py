"""nn.LSTMCell / nn.GRUCell time loop: capture and training-step time, with ``autopar.rnn.fuse``.

Model: ``zoo.LSTMCellStack()`` (4 layers, hidden 256, input 64), input [16, 32, 64];
``--gru``: ``zoo.GRUCellStack()`` of the same sizes, against ``nn.GRU``.

(a) time from the first call to the first result (Dynamo + the LSTMCell loop fusion +
    AOTAutograd + profiling + planning), forward alone and forward+backward, with a cold
    and then a warm profile store (a temp dir; ``torch._dynamo.reset()`` in between);
(b) training-step medians (forward + backward + SGD step, interleaved round-robin) of the
    eager cell loop, ``nn.LSTM`` (oneDNN) with the same weights, and
    ``autopar.compile(cell loop)``.

``--unfused`` adds autopar with the fusion pass switched off (the old path: ~950 forward +
~3700 backward aten nodes; slow to capture). Timings are noisy on a shared box: compare
medians of one run, not runs. Run::

    .venv/bin/python benchmarks/bench_cell_loop.py [--steps 30] [--unfused] [--gru]
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import statistics
import sys
import tempfile
import time

import torch
import torch.nn as nn

import autopar
import autopar.rnn.fuse
from autopar.profiling.store import ProfileStore
from autopar.tools import zoo


def lstm_with_weights_of(cells: zoo.LSTMCellStack) -> nn.LSTM:
    """``nn.LSTM`` (``nn.GRU`` for GRU cells) computing the same function as ``cells``."""
    first = cells.cells[0]
    cls = nn.GRU if isinstance(first, nn.GRUCell) else nn.LSTM
    lstm = cls(first.input_size, cells.hidden, len(cells.cells), batch_first=True)
    with torch.no_grad():
        for i, cell in enumerate(cells.cells):
            for name in ("weight_ih", "weight_hh", "bias_ih", "bias_hh"):
                getattr(lstm, f"{name}_l{i}").copy_(getattr(cell, name))
    return lstm


class LSTMOut(nn.Module):
    def __init__(self, lstm: nn.LSTM):
        super().__init__()
        self.lstm = lstm

    def forward(self, x):
        return self.lstm(x)[0]


@contextlib.contextmanager
def fusion_disabled():
    saved = autopar.rnn.fuse.fuse_cell_loops
    autopar.rnn.fuse.fuse_cell_loops = lambda gm, chunks=1: 0
    try:
        yield
    finally:
        autopar.rnn.fuse.fuse_cell_loops = saved


def first_result(model, x, store_dir: str) -> tuple[float, float, nn.Module]:
    """Seconds to the first forward result and to the first gradients, on a fresh compile."""
    torch._dynamo.reset()
    cmodel = autopar.compile(model, store=ProfileStore(store_dir))
    t0 = time.perf_counter()
    out = cmodel(x)
    t_fw = time.perf_counter() - t0
    out.sum().backward()
    t_fwbw = time.perf_counter() - t0
    model.zero_grad(set_to_none=True)
    return t_fw, t_fwbw, cmodel


def breakdown(cmodel) -> str:
    """Per graph: nodes, seconds from the backend's start to AOTAutograd handing it over
    (fusion + AOTAutograd; Dynamo's own tracing comes before), and profiling seconds."""
    recs = cmodel._autopar_pipeline.records
    return "; ".join(
        f"{r.tag} {r.num_nodes} nodes, aot {r.capture_s:.1f}s, "
        f"prof {r.timings.get('profile', 0):.1f}s"
        for r in recs
    )


def train_step(model, x, grad_out, opt) -> float:
    t0 = time.perf_counter()
    opt.zero_grad(set_to_none=True)
    out = model(x)
    out.backward(grad_out)
    opt.step()
    return time.perf_counter() - t0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="bench_cell_loop.py")
    parser.add_argument("--steps", type=int, default=30, help="timed steps per variant (>= 20)")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--unfused", action="store_true", help="also autopar without fusion")
    parser.add_argument("--gru", action="store_true", help="GRUCell stack vs nn.GRU")
    args = parser.parse_args(argv)

    torch.manual_seed(0)
    base = zoo.GRUCellStack() if args.gru else zoo.LSTMCellStack()
    ref_name = "nn.GRU (ATen loop)" if args.gru else "nn.LSTM (oneDNN)"
    x = torch.randn(16, 32, 64)
    grad_out = torch.randn(16, 32, 256)
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads; "
        f"{type(base).__name__}() x{x.shape}"
    )

    # (a) first call -> first result, cold and warm store
    print("\n(a) first call -> first result [s]        forward   fwd+bwd   graphs")
    variants = [("fused", contextlib.nullcontext)]
    if args.unfused:
        variants.append(("unfused", fusion_disabled))
    compiled = {}
    for name, ctx in variants:
        with tempfile.TemporaryDirectory() as store_dir, ctx():
            for temp in ("cold", "warm"):
                model = copy.deepcopy(base)
                fw, fwbw, cmodel = first_result(model, x, store_dir)
                print(f"  autopar {name:8s} {temp} store    {fw:8.2f}  {fwbw:8.2f}   "
                      f"{breakdown(cmodel)}")  # fmt: skip
            compiled[name] = (model, cmodel)

    # (b) training steps, interleaved
    eager = copy.deepcopy(base)
    lstm = LSTMOut(lstm_with_weights_of(base))
    with torch.no_grad():
        check = (lstm(x) - eager(x)).abs().max().item()
    print(f"\n{ref_name} vs cell loop max |diff| = {check:.2e}")
    runs = {"eager cell loop": (eager, eager), ref_name: (lstm, lstm)}
    for name, (model, cmodel) in compiled.items():
        runs[f"autopar {name}"] = (model, cmodel)
    opts = {k: torch.optim.SGD(m.parameters(), lr=1e-3) for k, (m, _) in runs.items()}
    times: dict[str, list[float]] = {k: [] for k in runs}
    for i in range(args.warmup + args.steps):
        for k, (_model, fn) in runs.items():
            dt = train_step(fn, x, grad_out, opts[k])
            if i >= args.warmup:
                times[k].append(dt)
    print(f"\n(b) training step (fw+bw+SGD), median of {args.steps} interleaved steps")
    ref = statistics.median(times[ref_name])
    eager_t = statistics.median(times["eager cell loop"])
    for k, ts in times.items():
        med = statistics.median(ts)
        print(f"  {k:20s} {med * 1e3:8.2f} ms   x{med / ref:5.2f} vs {ref_name.split()[0]}   "
              f"x{eager_t / med:5.2f} speedup vs eager")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
