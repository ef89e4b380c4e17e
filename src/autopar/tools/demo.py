"""``autopar demo``: train a model with eager PyTorch and with autopar (and, on request,
``torch.compile``), then show what the compiler decided.

Models (``--model``, :mod:`autopar.tools.demo_models`): ``charlstm`` (the default), a
character-level LSTM language model on the Python standard library's own source, written as
an ``nn.LSTMCell`` loop; ``towers``, a multi-tower MLP; ``bert``, a tiny random Hugging Face
BERT (needs ``transformers``). No data is downloaded.

Every contender trains its own copy of the same initial weights on the same batches, one
step each per round, in a fixed order. The demo waits for autopar's background Inductor
compiles once they are queued (``autopar.wait``; ``--no-wait`` trains through them, at idle
priority). Training runs ``--steps`` steps, then goes on (up to ``--settle-s`` seconds)
until autopar has *settled* (its judge decided which executor runs the steps, nothing left
to build) and ``--steady-steps`` more steps ran: the steps after settling are the ones
timed. The last screen shows the executor ladder of every graph, the verdict and its step
times, and per graph predicted against measured time; the pictures (plan timeline,
predicted-vs-measured trace, loss plot, step-time bars) go into ``--out``.

Example::

    autopar demo                          # charlstm, about a minute on a 2-core CPU
    autopar demo --torch-compile          # also time torch.compile (+20-40 s of Inductor)
    autopar demo --model towers --out results/demo-towers
    autopar demo --model bert --tiny      # a few tiny steps: a smoke test
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import textwrap
import time
import warnings
from dataclasses import dataclass, field

import torch
import torch.nn as nn

from autopar.tools.args import add_store_argument, positive_int
from autopar.tools.demo_models import (
    MODELS,
    bert_available,
    build_task,
    compare_curves,
)


# -- command line --------------------------------------------------------------------------------
def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``autopar demo``.

    Example::

        >>> p = argparse.ArgumentParser(); add_arguments(p)
        >>> p.parse_args(["--model", "towers", "--tiny"]).model
        'towers'
    """
    parser.description = (
        "Train a model once with eager PyTorch and once with autopar (identical weights and "
        "batches; optionally also torch.compile), compare the loss curves and step times, and "
        "show per captured graph what autopar measured, chose and why. Writes the plan "
        "timeline, a predicted-vs-measured Perfetto trace, the loss plot and step-time bars."
    )
    parser.add_argument(
        "--model", choices=MODELS, default="charlstm",
        help="charlstm: char-level LSTM on the stdlib's source (default); towers: multi-tower "
        "MLP; bert: tiny random HF BERT (needs transformers)",
    )  # fmt: skip
    parser.add_argument(
        "--tiny", action="store_true",
        help="tiny sizes, 4 steps, no settling: a smoke test in seconds (explicit options win)",
    )  # fmt: skip
    size = "(default: the model's own, see autopar.tools.demo_models.DEFAULTS)"
    parser.add_argument("--hidden", type=positive_int, default=None, help=f"hidden size {size}")
    parser.add_argument(
        "--layers", type=positive_int, default=None, help=f"layers (towers: per tower) {size}"
    )
    parser.add_argument(
        "--emb", type=positive_int, default=None,
        help=f"charlstm: embedding size; towers: input features; bert: vocabulary {size}",
    )  # fmt: skip
    parser.add_argument(
        "--seq-len", type=positive_int, default=None, help=f"tokens per sequence {size}"
    )
    parser.add_argument("--batch", type=positive_int, default=None, help=f"batch size {size}")
    parser.add_argument("--lr", type=float, default=None, help=f"Adam learning rate {size}")
    parser.add_argument(
        "--corpus-kb", type=positive_int, default=None,
        help="charlstm: KB of stdlib source to train on (default 300)",
    )  # fmt: skip
    parser.add_argument(
        "--steps", type=positive_int, default=None, help="training steps at least (default 150)"
    )
    parser.add_argument(
        "--settle-s", type=float, default=None,
        help="after --steps, keep training up to this many seconds until autopar has settled "
        "(its judge decided, nothing left to build) and --steady-steps more steps ran "
        "(default 150)",
    )  # fmt: skip
    parser.add_argument(
        "--steady-steps", type=positive_int, default=30,
        help="steps timed after autopar settled (default 30)",
    )  # fmt: skip
    parser.add_argument(
        "--torch-compile", action="store_true",
        help="also train a torch.compile copy and time it (costs its Inductor compile, 20-40 s "
        "on a 2-core CPU; `make demo` turns it on)",
    )  # fmt: skip
    parser.add_argument(
        "--no-wait", action="store_true",
        help="train on while autopar's Inductor executors compile in the background (the "
        "default waits after step 2: the compile gets little CPU from a busy 2-core loop)",
    )  # fmt: skip
    parser.add_argument(
        "--no-autopar-inductor", action="store_true",
        help="compile autopar without its Inductor executors (inductor=False)",
    )  # fmt: skip
    parser.add_argument(
        "--streams", type=positive_int, default=None,
        help="streams autopar plans for (default: the machine's intra-op thread count)",
    )  # fmt: skip
    # charlstm is written the way many users write recurrences, as an nn.LSTMCell loop:
    # autopar fuses each layer's loop into one oneDNN LSTM layer, forward and backward; with
    # nn.LSTM both sides already run the fused kernel and autopar can only match it.
    parser.add_argument(
        "--cell", dest="cell", action="store_true", default=True,
        help="charlstm: the LSTM as an nn.LSTMCell loop (the default: autopar fuses the loop)",
    )  # fmt: skip
    parser.add_argument(
        "--nn-lstm", dest="cell", action="store_false",
        help="charlstm: nn.LSTM instead (eager already runs PyTorch's fused kernel)",
    )  # fmt: skip
    parser.add_argument(
        "--tol", type=float, default=5e-2,
        help="agreement: the first 10 steps' losses must match within tol/50, and the 10-step "
        "moving averages of the two loss curves within tol (default 0.05)",
    )  # fmt: skip
    add_store_argument(parser)
    parser.add_argument("--out", default="results/demo", help="folder for the demo's files")
    parser.add_argument("--seed", type=int, default=0, help="seed of weights and batches")
    parser.add_argument("--no-progress", action="store_true", help="no tqdm progress bar")


def resolve_args(args) -> argparse.Namespace:
    """Fill the defaults that depend on ``--tiny`` (steps, settling).

    Example::

        >>> resolve_args(argparse.Namespace(tiny=True, steps=None, settle_s=None)).steps
        4
    """
    tiny = getattr(args, "tiny", False)
    if args.steps is None:
        args.steps = 4 if tiny else 150
    if args.settle_s is None:
        args.settle_s = 0.0 if tiny else 150.0
    return args


def inductor_on(args) -> bool:
    """Whether autopar may compile with Inductor here: off by ``--no-autopar-inductor``.

    Example::

        >>> inductor_on(argparse.Namespace(no_autopar_inductor=True))
        False
    """
    return not getattr(args, "no_autopar_inductor", False)


# -- the run ---------------------------------------------------------------------------------------
@dataclass
class Contender:
    """One way of running the model, with its own copy of the weights and its optimizer."""

    name: str
    module: nn.Module
    opt: torch.optim.Optimizer
    losses: list[float] = field(default_factory=list)
    step_s: list[float] = field(default_factory=list)  # step k's seconds (step 0 compiles)


def _step(c: Contender, task, inputs, target) -> None:
    t0 = time.perf_counter()
    c.opt.zero_grad(set_to_none=True)
    loss = task.loss(c.module(*inputs), target)
    loss.backward()
    c.opt.step()
    c.step_s.append(time.perf_counter() - t0)
    c.losses.append(loss.item())


def _contenders(task, args, inductor: bool) -> list[Contender]:
    import autopar

    eager = copy.deepcopy(task.model)
    out = [Contender("eager", eager, torch.optim.Adam(eager.parameters(), lr=task.lr))]
    if args.torch_compile:
        m = copy.deepcopy(task.model)
        out.append(Contender("torch.compile", torch.compile(m),
                             torch.optim.Adam(m.parameters(), lr=task.lr)))  # fmt: skip
    cmodel = autopar.compile(task.model, streams=args.streams, store=args.store,
                             inductor=None if inductor else False)  # fmt: skip
    out.append(Contender("autopar", cmodel, torch.optim.Adam(task.model.parameters(), lr=task.lr)))
    return out


def _train(task, contenders: list[Contender], args, watch) -> tuple[int | None, list[str]]:
    """The training loop; returns (the step at which autopar settled or None, warnings)."""
    from tqdm import tqdm

    ap = contenders[-1]
    caught: list[str] = []
    settled_at = None
    t_first = time.perf_counter()
    # disable=None: a progress bar on a terminal only, not in logs or pipes
    bar = tqdm(total=args.steps, desc="training", unit="step", leave=False,
               disable=args.no_progress or None)  # fmt: skip
    step, t_done = 0, None  # t_done: when --steps were done; the settling clock starts
    while True:
        if step >= args.steps:
            t_done = t_done or time.perf_counter()
            if settled_at is not None and step - settled_at >= args.steady_steps:
                break
            if time.perf_counter() - t_done > args.settle_s:
                break
            bar.set_description("training until autopar settles")
        inputs, target = task.batch(step)
        # A fixed order: autopar's race times forward-to-forward intervals, which then hold
        # the same other contenders' steps whether autopar ran eagerly or compiled.
        for c in contenders:
            if c is ap and step == 0:
                t_first = time.perf_counter()
            with warnings.catch_warnings(record=True) as ws:
                warnings.simplefilter("always")
                _step(c, task, inputs, target)
            caught.extend(f"{w.category.__name__}: {w.message}" for w in ws)
            if step == 0 and c.name != "eager":
                bar.write(f"step 1: {c.name} compiled the model in its first step: "
                          f"{c.step_s[0]:.1f} s")  # fmt: skip
        if not args.no_wait and ap.module._autopar_pipeline.runtime.builds.pending():
            _wait_for_builds(ap.module, args, bar)  # queued after the first verdict
        for line in watch.look(ap.module, step, time.perf_counter() - t_first):
            bar.write(line[:160])
        if not watch.settled:
            settled_at = None  # e.g. a re-plan or a new contender reopened the race
        elif settled_at is None:
            settled_at = step + 1
            bar.write(f"step {step + 1}: autopar settled: the judge decided, nothing left to "
                      "build")  # fmt: skip
        bar.set_postfix({c.name: f"{c.losses[-1]:.3f}" for c in contenders})
        bar.update(1)
        step += 1
    bar.close()
    return settled_at, caught


def _wait_for_builds(cmodel, args, bar) -> None:
    """``autopar.wait`` once the Inductor builds are queued (after the first verdict). Training
    could go on while they compile in another process at idle priority (what autopar does by
    default), but a 2-core machine whose training keeps both cores busy leaves the compile
    little CPU: the demo would end before the judge saw them."""
    import autopar

    bar.write("waiting for autopar's background compiles (autopar.wait; --no-wait trains "
              "through them instead) ...")  # fmt: skip
    t0 = time.perf_counter()
    done = autopar.wait(cmodel, timeout=max(args.settle_s, 1.0))
    what = "done" if done else "NOT done (timed out)"
    bar.write(f"... {what} after {time.perf_counter() - t0:.1f} s; each build races from "
              "the next step")  # fmt: skip


def _window(n_steps: int, settled_at: int | None, steady: int) -> tuple[int, int, str]:
    """The steps to time: from autopar's settling on, else the last third (not step 1)."""
    if settled_at is not None and n_steps - settled_at >= min(steady, 5):
        return settled_at, n_steps, f"steps {settled_at + 1}-{n_steps}, after autopar settled"
    lo = max(1, n_steps - max(1, (n_steps - 1) // 3))
    if lo >= n_steps:
        return 0, n_steps, f"all {n_steps} steps, compiling first steps included"
    which = f"steps {lo + 1}-{n_steps}" if n_steps - lo > 1 else f"step {n_steps}"
    return lo, n_steps, f"{which}, the last third (autopar not settled)"


def _times(contenders, lo: int, hi: int) -> dict[str, tuple[float, float, int]]:
    out = {}
    for c in contenders:
        xs = [x * 1e3 for x in c.step_s[lo:hi]]
        iqr = 0.0
        if len(xs) >= 4:
            q1, _, q3 = statistics.quantiles(xs, n=4)
            iqr = q3 - q1
        out[c.name] = (statistics.median(xs), iqr, len(xs))
    return out


def main(args) -> int:
    """Run the demo described by ``args`` (from ``add_arguments``): 0 if the loss curves
    agree, 1 if not, 2 if ``--model bert`` lacks ``transformers``.

    Example::

        >>> from autopar.tools.cli import main as cli
        >>> cli(["demo", "--model", "towers", "--tiny", "--out", "/tmp/d"])  # doctest: +SKIP
        0
    """
    import autopar
    from autopar.tools.demo_pictures import write_pictures
    from autopar.tools.demo_report import Watch, final_screen, graph_decisions

    args = resolve_args(args)
    if args.model == "bert" and not bert_available():
        print("autopar demo: --model bert needs the transformers package (pip install "
              "transformers); --model charlstm and towers need nothing more", file=sys.stderr)
        return 2
    t_start = time.perf_counter()
    task = build_task(args)
    inductor = inductor_on(args)
    contenders = _contenders(task, args, inductor)
    cmodel = contenders[-1].module
    names = ", ".join(c.name for c in contenders)
    how = (
        f"{names}: each trains its own copy of the same initial weights on the same batches, "
        f"one step each per round; at least {args.steps} steps, then until autopar settles (at "
        f"most {args.settle_s:.0f} s more) and {args.steady_steps} steps after that, which are "
        f"the timed ones. autopar's Inductor executors: {'on' if inductor else 'off'}"
        + ("" if not inductor or args.no_wait else
           "; the demo waits for their compile (autopar.wait)") + "."
    )  # fmt: skip
    print(f"autopar demo --model {task.name}: " + task.about[0])
    for line in [*task.about[1:], "how    : " + how]:
        print(textwrap.fill(line, 100, initial_indent="  ", subsequent_indent=" " * 11,
                            break_long_words=False, break_on_hyphens=False))
    sys.stdout.flush()
    watch = Watch()
    settled_at, caught = _train(task, contenders, args, watch)
    losses = {c.name: c.losses for c in contenders}
    n = len(contenders[0].losses)
    agree, agreement = compare_curves(losses["eager"], losses["autopar"], args.tol)

    every = max(1, n // 10)
    print(f"\nloss ({task.loss_name}) every {every} steps:")
    head = " ".join(f"{c.name:>13}" for c in contenders)
    print(f"  {'step':>5} {head}  |eager-autopar|")
    for i in sorted(set(range(0, n, every)) | {n - 1}):
        vals = " ".join(f"{c.losses[i]:13.4f}" for c in contenders)
        print(f"  {i + 1:>5} {vals}  {abs(losses['eager'][i] - losses['autopar'][i]):.2e}")
    if task.sample is not None:
        text = task.sample(contenders[0].module)
        print(f'\nthe trained (eager) model writes, after "def ": {text!r}')
    for w in sorted(set(caught))[:5]:
        print(f"warning: {w[:300]}")

    lo, hi, window = _window(n, settled_at, args.steady_steps)
    times: dict = _times(contenders, lo, hi)
    note = ""
    if not args.torch_compile:
        times = {"eager": times["eager"], "torch.compile": None, "autopar": times["autopar"]}
        note = "torch.compile not timed: add --torch-compile (+20-40 s of Inductor compile)"
    calls = autopar.stats(cmodel, per="graph")
    files = write_pictures(cmodel, args.out, title=f"autopar demo --model {task.name}",
                           losses=losses, times=times, calls=calls, ylabel=task.loss_name,
                           note=note, window=window)  # fmt: skip
    ex = autopar.explain(cmodel)
    files["programs (autopar.explain)"] = os.path.join(args.out, "program.py")
    with open(files["programs (autopar.explain)"], "w") as f:
        f.write(ex.text(verbose=True))
    info = {
        "model": task.title, "agree": agree, "agreement": agreement, "window": window,
        "times": {k: (v[0], v[2]) if v else None for k, v in times.items()},
        "settled": settled_at is not None, "files": files, "out": args.out,
        "untimed": note.split(": ", 1)[-1] if note else "",
    }  # fmt: skip
    print()
    print(final_screen(ex, graph_decisions(ex, calls), info))
    print(f"(demo wall time {time.perf_counter() - t_start:.0f} s, {n} steps)")
    return 0 if agree else 1
