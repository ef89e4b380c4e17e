"""``autopar demo``: train a character-level LSTM language model with eager PyTorch and autopar.

The corpus needs no download: the Python standard library's own ``.py`` files, read from the
running interpreter (``sysconfig.get_paths()["stdlib"]``) in sorted order up to
``--corpus-kb``. Two copies of the model with identical initial weights train on identical
batches, one eagerly and one through ``autopar.compile``; the demo prints both loss curves side
by side, says whether they agree, and compares step times with autopar's prediction. It writes
the plan's Gantt chart, a loss plot, the profile table, the plan and the generated program into
``--out``.

Example::

    autopar demo                       # well under a minute on a 2-core CPU
    autopar demo --nn-lstm --steps 50  # nn.LSTM instead of an nn.LSTMCell loop
"""

from __future__ import annotations

import argparse
import copy
import glob
import os
import statistics
import sysconfig
import time
import warnings

import torch
import torch.nn as nn
import torch.nn.functional as F

from autopar.tools.args import positive_int

VOCAB = 128  # ASCII; other characters become "?"


# -- data ------------------------------------------------------------------------------------
def load_corpus(max_kb: int) -> tuple[torch.Tensor, list[str], str]:
    """The stdlib's top-level ``.py`` files in sorted order, as ASCII codes, up to ``max_kb``.

    Returns (codes as int64, the files used, the stdlib directory)."""
    root = sysconfig.get_paths()["stdlib"]
    files = sorted(glob.glob(os.path.join(root, "*.py")))
    if not files:
        raise SystemExit(f"autopar demo: no .py files in the stdlib directory {root!r}")
    parts, used, size = [], [], 0
    for path in files:
        if size >= max_kb * 1024:
            break
        try:
            with open(path, encoding="utf-8", errors="replace") as f:
                text = f.read()
        except OSError:
            continue
        text = text[: max_kb * 1024 - size]
        parts.append(text)
        used.append(os.path.basename(path))
        size += len(text)
    codes = [c if c < VOCAB else ord("?") for c in map(ord, "".join(parts))]
    return torch.tensor(codes, dtype=torch.long), used, root


def make_batches(data: torch.Tensor, steps: int, batch: int, seq_len: int, seed: int):
    """``steps`` (input, target) pairs of random windows; target is the input shifted by one."""
    if len(data) <= seq_len + 1:
        raise SystemExit(f"autopar demo: corpus of {len(data)} chars is shorter than --seq-len")
    g = torch.Generator().manual_seed(seed)
    offsets = torch.arange(seq_len + 1)
    out = []
    for _ in range(steps):
        starts = torch.randint(0, len(data) - seq_len - 1, (batch, 1), generator=g)
        window = data[starts + offsets]
        out.append((window[:, :-1].contiguous(), window[:, 1:].contiguous()))
    return out


# -- model -------------------------------------------------------------------------------------
class CharLM(nn.Module):
    """Embedding -> LSTM (``nn.LSTM``, or an ``nn.LSTMCell`` loop) -> linear over the vocabulary."""

    def __init__(self, hidden: int = 128, layers: int = 2, emb: int = 64, cell: bool = False):
        super().__init__()
        self.cell, self.hidden = cell, hidden
        self.embed = nn.Embedding(VOCAB, emb)
        if cell:
            self.cells = nn.ModuleList(
                nn.LSTMCell(emb if i == 0 else hidden, hidden) for i in range(layers)
            )
        else:
            self.rnn = nn.LSTM(emb, hidden, layers, batch_first=True)
        self.head = nn.Linear(hidden, VOCAB)

    def forward(self, x):  # x: [batch, time] int64 -> logits [batch, time, VOCAB]
        e = self.embed(x)
        if not self.cell:
            out, _ = self.rnn(e)
            return self.head(out)
        b, steps = x.shape
        h = [e.new_zeros(b, self.hidden) for _ in self.cells]
        c = [e.new_zeros(b, self.hidden) for _ in self.cells]
        outs = []
        for t in range(steps):
            inp = e[:, t]
            for i, cell in enumerate(self.cells):
                h[i], c[i] = cell(inp, (h[i], c[i]))
                inp = h[i]
            outs.append(inp)
        return self.head(torch.stack(outs, dim=1))


def _loss(model, x, y) -> torch.Tensor:
    return F.cross_entropy(model(x).reshape(-1, VOCAB), y.reshape(-1))


@torch.no_grad()
def sample(model: nn.Module, prompt: str, n: int, seed: int = 0) -> str:
    """``n`` characters the (eager) model writes after ``prompt``, temperature 0.8."""
    g = torch.Generator().manual_seed(seed)
    codes = [min(ord(c), VOCAB - 1) for c in prompt]
    for _ in range(n):
        logits = model(torch.tensor([codes[-64:]]))[0, -1] / 0.8
        codes.append(int(torch.multinomial(F.softmax(logits, -1), 1, generator=g)))
    return "".join(chr(c) for c in codes)


def moving_average(xs: list[float], window: int = 10) -> list[float]:
    """Mean of each value and up to ``window - 1`` values before it."""
    return [statistics.fmean(xs[max(0, i - window + 1) : i + 1]) for i in range(len(xs))]


def compare_curves(a: list[float], b: list[float], tol: float) -> tuple[bool, str]:
    """Do two loss curves of the same training agree? Returns (verdict, explanation).

    Early on, both runs compute the same numbers up to float32 rounding, so the first 10
    losses must match within ``tol / 50``. Training then amplifies rounding differences
    (as it does between two eager runs with different thread counts), so afterwards the
    10-step moving averages must stay within ``tol``."""
    early = max(abs(x - y) for x, y in zip(a[:10], b[:10], strict=True))
    diffs = [abs(x - y) for x, y in zip(a, b, strict=True)]
    smooth = [abs(x - y) for x, y in zip(moving_average(a), moving_average(b), strict=True)]
    ok = early <= tol / 50 and max(smooth) <= tol
    text = (
        f"first {min(10, len(a))} steps within {early:.1e} (limit {tol / 50:.0e}); 10-step "
        f"moving averages within {max(smooth):.1e} (limit {tol:g}); largest single-step "
        f"|diff| {max(diffs):.1e}.\n  Float32 sums run in another order round differently, "
        "and training amplifies such differences step by step: |diff| grows from ~0."
    )
    return ok, text


# -- command line --------------------------------------------------------------------------------
def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``autopar demo``."""
    parser.description = (
        "Train a character-level LSTM language model on the Python standard library's source, "
        "once with eager PyTorch and once with autopar (identical weights and batches); "
        "compare the loss curves and step times and write the plan, Gantt chart and program."
    )
    parser.add_argument("--hidden", type=positive_int, default=128, help="LSTM hidden size")
    parser.add_argument("--layers", type=positive_int, default=2, help="stacked LSTM layers")
    parser.add_argument("--emb", type=positive_int, default=64, help="character embedding size")
    parser.add_argument("--seq-len", type=positive_int, default=32, help="characters per sequence")
    parser.add_argument("--batch", type=positive_int, default=32, help="sequences per batch")
    parser.add_argument("--steps", type=positive_int, default=150, help="training steps")
    parser.add_argument(
        "--streams",
        type=positive_int,
        default=None,
        help="streams autopar plans for (default: the machine's intra-op thread count)",
    )
    # The default model is written the way many users write recurrences, as an
    # nn.LSTMCell loop: autopar fuses each layer's loop into one oneDNN LSTM layer, forward
    # and backward (1.8x eager on the 2-core box); with nn.LSTM both sides already run the
    # fused kernel and autopar can only match it.
    parser.add_argument(
        "--cell",
        dest="cell",
        action="store_true",
        default=True,
        help="model the LSTM as an nn.LSTMCell loop (the default: autopar fuses the loop)",
    )
    parser.add_argument(
        "--nn-lstm",
        dest="cell",
        action="store_false",
        help="use nn.LSTM instead (eager already runs PyTorch's fused kernel)",
    )
    parser.add_argument("--lr", type=float, default=3e-3, help="Adam learning rate")
    parser.add_argument(
        "--corpus-kb", type=positive_int, default=300, help="KB of stdlib source to train on"
    )
    parser.add_argument(
        "--tol",
        type=float,
        default=5e-2,
        help="agreement: the first 10 steps' losses must match within tol/50, and the 10-step "
        "moving averages of the two loss curves within tol (default 0.05 nats)",
    )
    parser.add_argument(
        "--store",
        default=None,
        help="autopar's profile store (default ./profiles or $AUTOPAR_PROFILE_DIR)",
    )
    parser.add_argument("--out", default="results/demo", help="folder for the demo's files")
    parser.add_argument("--seed", type=int, default=0, help="seed of weights and batches")
    parser.add_argument("--no-progress", action="store_true", help="no tqdm progress bar")


# -- the run ---------------------------------------------------------------------------------------
def _step(model, opt, x, y) -> tuple[float, float, float]:
    """One training step: (step seconds, forward+backward seconds, loss)."""
    t0 = time.perf_counter()
    opt.zero_grad(set_to_none=True)
    loss = _loss(model, x, y)
    loss.backward()
    t1 = time.perf_counter()
    opt.step()
    return time.perf_counter() - t0, t1 - t0, loss.item()


def _write_outputs(cmodel, out_dir: str, eager_losses, ap_losses) -> dict[str, str]:
    """Gantt chart(s), loss plot, profile CSV, plan JSON, program source; returns name -> path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import pandas as pd

    import autopar.api
    from autopar.planning.plan import Plan

    os.makedirs(out_dir, exist_ok=True)
    files: dict[str, str] = {}
    records = autopar.api.graphs(cmodel)
    plans = [r.plan for r in records if r.plan is not None]
    if plans:  # forward and backward plans, as one plan that runs them one after another
        plan = Plan.combine(plans)
        files["Gantt chart"] = plan.gantt(os.path.join(out_dir, "gantt.png"))
        files["plan"] = os.path.join(out_dir, "plan.json")
        with open(files["plan"], "w") as f:
            f.write(plan.to_json(indent=1))
    tables = [r.table for r in records if r.table is not None]
    if tables:
        files["profile table"] = os.path.join(out_dir, "profile.csv")
        pd.concat(tables, ignore_index=True).to_csv(files["profile table"], index=False)
    files["program"] = os.path.join(out_dir, "program.py")
    with open(files["program"], "w") as f:
        f.write(str(autopar.api.explain(cmodel)))

    fig, ax = plt.subplots(figsize=(7, 4))
    steps = range(1, len(eager_losses) + 1)
    ax.plot(steps, eager_losses, label="eager", linewidth=2)
    ax.plot(steps[: len(ap_losses)], ap_losses, label="autopar", linestyle="--")
    ax.set_xlabel("training step")
    ax.set_ylabel("cross-entropy (nats/char)")
    ax.set_title("char-LSTM on the Python stdlib: eager vs autopar")
    ax.legend()
    fig.tight_layout()
    files["loss plot"] = os.path.join(out_dir, "loss.png")
    fig.savefig(files["loss plot"], dpi=100)
    plt.close(fig)

    files["losses"] = os.path.join(out_dir, "losses.csv")
    pd.DataFrame({"step": list(steps), "eager": eager_losses, "autopar": ap_losses}).to_csv(
        files["losses"], index=False
    )
    return files


def main(args) -> int:
    """Run the demo described by ``args`` (from ``add_arguments``); 0 if the losses agree."""
    from tqdm import tqdm

    import autopar.api
    from autopar.tools.bench import autopar_prediction

    data, used, root = load_corpus(args.corpus_kb)
    torch.manual_seed(args.seed)
    model = CharLM(args.hidden, args.layers, args.emb, args.cell)
    eager = copy.deepcopy(model)
    cmodel = autopar.api.compile(model, streams=args.streams, store=args.store)
    opt_e = torch.optim.Adam(eager.parameters(), lr=args.lr)
    opt_a = torch.optim.Adam(model.parameters(), lr=args.lr)
    batches = make_batches(data, args.steps, args.batch, args.seq_len, args.seed)
    rnn = f"an nn.LSTMCell loop ({args.layers} x {args.hidden})"
    if not args.cell:
        rnn = f"nn.LSTM ({args.layers} layers x {args.hidden})"
    n_params = sum(p.numel() for p in model.parameters())
    print(
        "autopar demo: a character-level language model learns to write Python.\n"
        f"  corpus : {len(data) / 1024:.0f} KB of the Python standard library's own source "
        f"({len(used)} files from {root}, {used[0]} .. {used[-1]})\n"
        f"  model  : embedding({VOCAB} chars -> {args.emb}) -> {rnn} -> linear "
        f"-> {VOCAB} chars; {n_params:,} parameters\n"
        f"  task   : predict each next character; batches of {args.batch} x {args.seq_len} "
        f"chars, Adam lr {args.lr}, {args.steps} steps\n"
        "  how    : two copies with identical initial weights see identical batches: one runs "
        "eagerly,\n           the other through autopar.compile (profile -> plan -> generated "
        "parallel program).\n"
        "           The first autopar step compiles; after that both are timed step by step.",
        flush=True,
    )

    eager_l, ap_l, t_e, t_a, fwbw_a = [], [], [], [], []
    compile_s = None
    caught: list[str] = []
    # disable=None: a progress bar on a terminal only, not in logs or pipes
    bar = tqdm(batches, desc="training", unit="step", leave=False, disable=args.no_progress or None)
    for i, (x, y) in enumerate(bar):
        order = ("eager", "autopar") if i % 2 == 0 else ("autopar", "eager")
        for who in order:
            if who == "eager":
                s, _, loss = _step(eager, opt_e, x, y)
                eager_l.append(loss)
                t_e.append(s)
                continue
            with warnings.catch_warnings(record=True) as ws:
                warnings.simplefilter("always")
                s, fb, loss = _step(cmodel, opt_a, x, y)
            caught.extend(f"{w.category.__name__}: {w.message}" for w in ws)
            ap_l.append(loss)
            if compile_s is None:
                compile_s = s
                bar.write(f"autopar compiled the model in its first step: {s:.1f} s")
            else:
                t_a.append(s)
                fwbw_a.append(fb)
        bar.set_postfix(eager=f"{eager_l[-1]:.3f}", autopar=f"{ap_l[-1]:.3f}")
    bar.close()

    every = max(1, args.steps // 10)
    print(f"\nloss (cross-entropy, nats per character) every {every} steps:")
    print(f"  {'step':>5} {'eager':>9} {'autopar':>9} {'|diff|':>9}")
    for i in sorted(set(range(0, args.steps, every)) | {args.steps - 1}):
        d = abs(eager_l[i] - ap_l[i])
        print(f"  {i + 1:>5} {eager_l[i]:9.4f} {ap_l[i]:9.4f} {d:9.2e}")
    agree, explanation = compare_curves(eager_l, ap_l, args.tol)
    print(f"\nthe loss curves {'AGREE' if agree else 'DISAGREE'}: {explanation}")

    pred = autopar_prediction(cmodel)
    breakdown = ", ".join(f"{k} {v:.2f} s" for k, v in pred["compile_breakdown_s"].items())
    print("\ntimes (median over the timed steps; a step is forward + loss + backward + Adam):")
    if t_a:
        me, ma = statistics.median(t_e[1:] or t_e), statistics.median(t_a)
        print(f"  eager   : {me * 1e3:8.2f} ms/step")
        print(f"  autopar : {ma * 1e3:8.2f} ms/step  -> speedup {me / ma:.2f}x over eager")
    else:
        print("  (too few steps to time autopar after its compiling first step)")
    print(f"  autopar compile (its first step): {compile_s:.1f} s ({breakdown})")
    if pred["predicted_s"] is not None and fwbw_a:
        m = statistics.median(fwbw_a)
        err = 100 * (pred["predicted_s"] - m) / m
        print(
            f"  cost model: predicted forward+backward {pred['predicted_s'] * 1e3:.2f} ms, "
            f"measured {m * 1e3:.2f} ms (error {err:+.1f}%); serial prediction "
            f"{pred['serial_s'] * 1e3:.2f} ms; plan policy {'/'.join(pred['policies'])} on "
            f"{pred['streams']} stream(s)"
        )
    if pred.get("replans"):
        print(
            f"  autopar re-planned {pred['replans']} time(s): measured times drifted from the "
            "prediction, so graphs were re-profiled (slower steps) and re-planned"
        )
    for tag, why in pred["fallbacks"].items():
        print(f"  NOTE: graph {tag} fell back to eager: {why}")
    for w in sorted(set(caught))[:5]:
        print(f"  warning: {w[:300]}")

    print(f'\nthe trained model writes (after "def "): {sample(eager, "def ", 80)!r}')
    files = _write_outputs(cmodel, args.out, eager_l, ap_l)
    print("\nwhat the compiler decided (autopar.explain(cmodel).summary()):")
    print(autopar.api.explain(cmodel).summary().rstrip())
    print(f"\nfiles written to {args.out}:")
    width = max(map(len, files))
    for what, path in files.items():
        print(f"  {what:<{width}} : {path}")
    return 0 if agree else 1
