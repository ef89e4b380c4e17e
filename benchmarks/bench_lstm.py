"""Training-step time of nn.LSTM / nn.GRU: eager (oneDNN fused) vs autopar and its RNN forms.

Run::

    .venv/bin/python benchmarks/bench_lstm.py            # all configs below
    .venv/bin/python benchmarks/bench_lstm.py --quick    # fewer reps, for a smoke run
    .venv/bin/python benchmarks/bench_lstm.py --config h128 --threads 1

Configs (input 64, 32 steps, batch 16): a 4-layer LSTM at hidden 256 and 128, a
bidirectional 2-layer LSTM at hidden 256 (4 layer-directions), and the same three as GRUs.
Variants per config: eager ``nn.LSTM`` (ATen's fused oneDNN layer loop) or ``nn.GRU``
(ATen's C++ loop of cell ops; oneDNN has no CPU GRU layer), ``autopar.compile``
with the default (measured) form choice, and autopar with each form forced through
``AUTOPAR_RNN_FORM`` (``autopar.rnn.layers``). A step is forward + backward + SGD.

Each config runs in a fresh process (Dynamo caches are per code object). Variants are
interleaved: every round times ``--steps`` steps of each variant in turn; the table shows the
median per-step time over rounds and the ratio eager / variant (> 1: faster than eager).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import torch
from torch import nn

CONFIGS = {
    "h256": dict(kind="lstm", hidden=256, layers=4, bidirectional=False),
    "h128": dict(kind="lstm", hidden=128, layers=4, bidirectional=False),
    "bidir": dict(kind="lstm", hidden=256, layers=2, bidirectional=True),
    "gru": dict(kind="gru", hidden=256, layers=4, bidirectional=False),
    "gru_h128": dict(kind="gru", hidden=128, layers=4, bidirectional=False),
    "gru_bidir": dict(kind="gru", hidden=256, layers=2, bidirectional=True),
}
FORMS = ("unrolled", "fused", "chunked:2", "chunked:4")
INPUT, STEPS, BATCH = 64, 32, 16


class Net(nn.Module):
    def __init__(self, kind: str, hidden: int, layers: int, bidirectional: bool):
        super().__init__()
        cls = nn.LSTM if kind == "lstm" else nn.GRU
        self.rnn = cls(INPUT, hidden, num_layers=layers, bidirectional=bidirectional)

    def forward(self, x):
        return self.rnn(x)[0]


def _step(model, opt, x):
    opt.zero_grad(set_to_none=True)
    model(x).square().mean().backward()
    opt.step()


def run_config(name: str, rounds: int, steps: int, threads: int | None) -> dict:
    import autopar

    if threads:
        torch.set_num_threads(threads)
    cfg = CONFIGS[name]
    torch.manual_seed(0)
    base = Net(**cfg)
    x = torch.randn(STEPS, BATCH, INPUT)
    variants = {"eager": (base, None)}
    forms = ("default",) + FORMS
    for form in forms:
        model = Net(**cfg)
        model.load_state_dict(base.state_dict())
        variants[f"autopar {form}"] = (autopar.compile(model), None if form == "default" else form)
    opts = {k: torch.optim.SGD(m.parameters(), lr=1e-3) for k, (m, _) in variants.items()}
    first = {}
    for key, (model, form) in variants.items():  # first call: capture, choice, plan
        os.environ.pop("AUTOPAR_RNN_FORM", None)
        if form:
            os.environ["AUTOPAR_RNN_FORM"] = form
        t0 = time.perf_counter()
        _step(model, opts[key], x)
        _step(model, opts[key], x)
        first[key] = time.perf_counter() - t0
    times: dict[str, list[float]] = {k: [] for k in variants}
    for _ in range(rounds):
        for key, (model, form) in variants.items():
            os.environ.pop("AUTOPAR_RNN_FORM", None)
            if form:
                os.environ["AUTOPAR_RNN_FORM"] = form
            t0 = time.perf_counter()
            for _ in range(steps):
                _step(model, opts[key], x)
            times[key].append((time.perf_counter() - t0) / steps)
    os.environ.pop("AUTOPAR_RNN_FORM", None)
    from autopar.rnn.layers import _CHOICES  # the chooser's cache

    chosen = sorted({f"{f}:{k}" if f == "chunked" else f for f, k in _CHOICES.values()})
    return {
        "median_ms": {k: statistics.median(v) * 1e3 for k, v in times.items()},
        "first_s": first,
        "choice": chosen,
        "threads": torch.get_num_threads(),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", choices=sorted(CONFIGS), action="append")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=0, help="intra-op threads (0: default)")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.quick:
        args.rounds, args.steps = 2, 1
    if args.child:
        print(json.dumps(run_config(args.child, args.rounds, args.steps, args.threads)))
        return
    for name in args.config or list(CONFIGS):
        cmd = [sys.executable, __file__, "--child", name, "--rounds", str(args.rounds)]
        cmd += ["--steps", str(args.steps), "--threads", str(args.threads)]
        res = json.loads(subprocess.run(cmd, check=True, capture_output=True).stdout)
        ms = res["median_ms"]
        cfg = CONFIGS[name]
        print(
            f"\n## {name}: {cfg['kind'].upper()} hidden {cfg['hidden']}, {cfg['layers']} layer(s)"
            f"{', bidirectional' if cfg['bidirectional'] else ''}; {res['threads']} thread(s); "
            f"default choice: {', '.join(res['choice']) or '-'}"
        )
        print(f"{'variant':<22} {'step ms':>9} {'vs eager':>9} {'first 2 steps s':>16}")
        for key, t in ms.items():
            ratio = ms["eager"] / t
            print(f"{key:<22} {t:9.2f} {ratio:8.2f}x {res['first_s'][key]:16.2f}")


if __name__ == "__main__":
    main()
