"""Benchmark autopar's RNN rewrite: capture cost, eager step time, CPU cell-body choices.

Run::

    .venv/bin/python benchmarks/rnn_cells.py            # the 4-layer LSTMCell loop below
    .venv/bin/python benchmarks/rnn_cells.py --quick    # smaller, for a smoke run

Model: a Python loop over 4 stacked ``nn.LSTMCell`` (input 64, hidden 256), 32 steps,
batch 16 -- the case whose capture took ~13 s unrewritten.

(a) capture: Dynamo + AOTAutograd with a trivial boxed compiler, original vs rewritten;
    wall time of the first call and forward/backward node counts.
(b) eager training step (forward + backward + SGD): original cells, rewritten cells,
    and fused ``nn.LSTM`` with the same sizes (original and rewritten).
(c) the pointwise LSTM body alone (forward + backward at [batch, 4*hidden]): the plain
    torch body autopar uses, an Inductor-compiled body, and the unfused aten ops eager
    ``nn.LSTMCell`` runs. (ATen's fused-cell helper ``_thnn_fused_lstm_cell`` is CUDA-only.)
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from functorch.compile import make_boxed_func
from torch import nn
from torch._dynamo.backends.common import aot_autograd

import autopar.rnn.cells as rnn
from autopar.rnn.rewrite import rewrite_rnns


class CellStack(nn.Module):
    """The user's loop: stacked nn.LSTMCell layers over time."""

    def __init__(self, inp: int, hidden: int, layers: int):
        super().__init__()
        self.cells = nn.ModuleList(
            nn.LSTMCell(inp if k == 0 else hidden, hidden) for k in range(layers)
        )

    def forward(self, x):
        state = [None] * len(self.cells)
        for t in range(x.size(0)):
            inp = x[t]
            for k, cell in enumerate(self.cells):
                state[k] = cell(inp, state[k])
                inp = state[k][0]
        return inp


class FusedLSTM(nn.Module):
    def __init__(self, inp: int, hidden: int, layers: int):
        super().__init__()
        self.lstm = nn.LSTM(inp, hidden, num_layers=layers)

    def forward(self, x):
        return self.lstm(x)[0][-1]


def capture(model: nn.Module, x: torch.Tensor, rewrite: bool) -> tuple[float, int, int]:
    """Seconds for the first compiled call (fw+bw capture) and (fw, bw) node counts."""
    counts = {}

    def compiler(tag):
        def fn(gm, example_inputs):
            counts[tag] = len(gm.graph.nodes)
            return make_boxed_func(gm.forward)

        return fn

    torch._dynamo.reset()
    compiled = torch.compile(
        model, backend=aot_autograd(fw_compiler=compiler("fw"), bw_compiler=compiler("bw"))
    )
    start = time.perf_counter()
    if rewrite:
        with rewrite_rnns(model, rnn_form="unrolled"):
            compiled(x).sum().backward()
    else:
        compiled(x).sum().backward()
    return time.perf_counter() - start, counts.get("fw", 0), counts.get("bw", 0)


def median_time(fn, repeats: int, warmup: int = 2) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def train_step_time(model: nn.Module, x: torch.Tensor, rewrite: bool, repeats: int) -> float:
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)

    def step():
        opt.zero_grad(set_to_none=True)
        model(x).sum().backward()
        opt.step()

    if rewrite:
        with rewrite_rnns(model, rnn_form="unrolled"):
            return median_time(step, repeats)
    return median_time(step, repeats)


# --------------------------------------------------------------------------- (c) cell bodies


def _lstm_math(ig, hg, c):
    i, f, g, o = (ig + hg).chunk(4, -1)
    c_new = torch.sigmoid(f) * c + torch.sigmoid(i) * torch.tanh(g)
    return torch.sigmoid(o) * torch.tanh(c_new), c_new


def _lstm_math_bwd(gh, gc, ig, hg, c):
    i, f, g, o = (ig + hg).chunk(4, -1)
    i, f, g, o = torch.sigmoid(i), torch.sigmoid(f), torch.tanh(g), torch.sigmoid(o)
    tc = torch.tanh(f * c + i * g)
    dc = gc + gh * o * (1 - tc * tc)
    grads = (
        dc * g * i * (1 - i),
        dc * c * f * (1 - f),
        dc * i * (1 - g * g),
        gh * tc * o * (1 - o),
    )
    return torch.cat(grads, -1), dc * f


def cell_body_times(batch: int, hidden: int, repeats: int) -> dict[str, float]:
    ig, hg = torch.randn(batch, 4 * hidden), torch.randn(batch, 4 * hidden)
    c, gh, gc = torch.randn(batch, hidden), torch.randn(batch, hidden), torch.randn(batch, hidden)
    ops = torch.ops.autopar
    out = {}
    out["autopar op, plain torch body"] = median_time(
        lambda: (ops.lstm_cell(ig, hg, c), ops.lstm_cell_backward(gh, gc, ig, hg, c)), repeats
    )
    out["plain torch body, no op dispatch"] = median_time(
        lambda: (rnn._lstm_cell_impl(ig, hg, c), rnn._lstm_cell_backward_impl(gh, gc, ig, hg, c)),
        repeats,
    )
    fw_c, bw_c = (
        torch.compile(_lstm_math, dynamic=False),
        torch.compile(_lstm_math_bwd, dynamic=False),
    )
    out["Inductor-compiled body"] = median_time(
        lambda: (fw_c(ig, hg, c), bw_c(gh, gc, ig, hg, c)), repeats
    )

    args = [t.clone().requires_grad_() for t in (ig, hg, c)]

    def unfused():
        h, c_new = _lstm_math(*args)
        torch.autograd.backward((h, c_new), (gh, gc))

    out["unfused aten ops + autograd (eager cell)"] = median_time(unfused, repeats)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small sizes for a smoke run")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument(
        "--threads",
        type=int,
        default=0,
        help="intra-op threads (0: torch's default). On a shared, loaded box use 1: with "
        "more, every op's OpenMP barrier waits on descheduled threads and times explode.",
    )
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    inp, hidden, layers, steps, batch = (
        (64, 256, 4, 32, 16) if not args.quick else (16, 32, 2, 4, 4)
    )
    torch.manual_seed(0)
    x = torch.randn(steps, batch, inp)
    print(
        f"LSTMCell loop: input {inp}, hidden {hidden}, {layers} layers, {steps} steps, "
        f"batch {batch}; torch {torch.__version__}, {torch.get_num_threads()} threads\n"
    )

    print("(a) capture with aot_autograd (trivial boxed compiler)")
    print(f"  {'':28s}{'time s':>9s}{'fw nodes':>10s}{'bw nodes':>10s}")
    for name, rewrite in [("original LSTMCell loop", False), ("rewritten (autopar.rnn)", True)]:
        secs, fw, bw = capture(CellStack(inp, hidden, layers), x, rewrite)
        print(f"  {name:28s}{secs:9.2f}{fw:10d}{bw:10d}")

    print("\n(b) eager training step (fw + bw + SGD), median ms")
    rows = [
        ("LSTMCell loop, original", CellStack, False),
        ("LSTMCell loop, rewritten", CellStack, True),
        ("nn.LSTM, original (fused)", FusedLSTM, False),
        ("nn.LSTM, rewritten (hoisted)", FusedLSTM, True),
    ]
    for name, cls, rewrite in rows:
        torch.manual_seed(0)
        ms = 1e3 * train_step_time(cls(inp, hidden, layers), x, rewrite, args.repeats)
        print(f"  {name:34s}{ms:9.2f}")

    print(f"\n(c) LSTM pointwise body, fw + bw at [{batch}, 4*{hidden}], median us")
    for name, secs in cell_body_times(batch, hidden, 20 * args.repeats).items():
        print(f"  {name:42s}{1e6 * secs:9.1f}")


if __name__ == "__main__":
    main()
