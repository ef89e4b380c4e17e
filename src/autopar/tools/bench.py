"""``autopar bench``: time whole training steps of eager, ``torch.compile`` and autopar.

Every contender trains its own deep copy of the same model (same initial weights, same
inputs, same target, same optimizer). A training step is ``zero_grad -> forward -> loss ->
backward -> optimizer.step``. The run of one model has three phases:

1. **First steps**, one contender at a time: eager, then ``torch.compile`` (Dynamo + Inductor,
   a cold compile in a fresh Inductor cache), then autopar (capture + profile + plan; its
   Inductor executors start compiling in a background process). Each is reported as "1st
   step s", the time to first step; it is never counted in the medians.
2. **autopar settles**, alone (so that its judge times whole steps undisturbed):
   ``autopar.wait`` until the background compiles are done, then autopar-only steps until
   the judge's verdicts stand and nothing is left to build (at most ``--settle-steps``
   steps and ``--settle-s`` seconds). The table reports how long this took, which executor
   runs each graph, and the verdict.
3. **Steady state**, interleaved: ``--warmup`` untimed rounds, then rounds until
   ``--steps`` steps per contender were timed. Each round runs one step of every
   contender, in a rotating order reversed every other round (ABBA), so a slow phase of
   the machine hits all of them alike and no contender always runs right after the same
   one. ``--block N`` runs N consecutive steps of each contender per round instead and
   times all but the first (which inherits the previous contender's caches). Not the
   default: the cost model's context term is calibrated on one step per round.
   Medians, and ratios vs eager and vs the best of eager and ``torch.compile`` with a 90%
   bootstrap interval over the rounds (``tools.bench_stats``).

autopar's cost model predicts the run time of each graph's planned program. Where another
executor won, autopar no longer runs those programs, so a fourth contender,
``autopar-plans`` (autopar with ``executors=("plan",)``: its planned programs always),
trains alongside in phase 3; the cost model's error is its predicted forward + backward graph
time against the graph times its monitor measured there (median over the timed steps). It is
not a peer: it never counts as "best" (with ``--no-autopar-inductor``, autopar is it).
``--backend`` adds ``autopar-backend``, ``torch.compile(model, backend="autopar",
dynamic=False)`` with the same options, settled like autopar; also a probe, not a peer.

``--model MODULE_OR_FILE:FACTORY`` runs them on the user's own model (``FACTORY()`` returns
``(model, example_inputs)``) and ends with whether autopar is worth it there (``format_verdict``).

Example::

    autopar bench --quick                              # a smoke run, about a minute
    autopar bench --models towers,bert --steps 20
    autopar bench --model my_model.py:make             # is autopar worth it on my model?
    python benchmarks/bench_training.py --models towers --no-inductor
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import math
import os
import shutil
import statistics
import tempfile
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn as nn

from autopar import compat
from autopar.planning.policies import SINGLE_DEVICE_POLICY_NAMES
from autopar.tools.args import add_store_argument, positive_int
from autopar.tools.bench_models import BENCH_MODELS, BenchModel, choose_models, make_loss
from autopar.tools.bench_report import (  # noqa: F401 - re-exported: the bench's public names
    CSV_COLUMNS,
    _load,
    describe_state,
    format_result,
    format_summary,
    format_verdict,
    ladder_of,
    machine_state,
    meta,
    skipped_note,
    write_csv,
)
from autopar.tools.bench_settle import (
    autopar_final,
    autopar_prediction,
    autopar_settle,
    cost_model_check,
    inductor_cache,
)
from autopar.tools.bench_stats import ratio_interval
from autopar.tools.factory import METAVAR

CONTENDERS = ("eager", "torch.compile", "autopar", "autopar-plans")
#: ``--backend``: ``torch.compile(model, backend="autopar")``, after the others.
BACKEND = "autopar-backend"
#: Contenders that are references, not peers (never the "best" autopar is compared with).
PROBES = ("autopar", "autopar-plans", BACKEND)
#: ``--quick``: models, timed steps, warm-up rounds and settle steps of a smoke run.
QUICK = {"models": ["deep_mlp"], "steps": 6, "warmup": 1, "settle_steps": 25, "settle_s": 60.0,
         "block": 1}
#: 240 timed steps: identical ``torch.compile`` copies of one model, timed in rotation in one
#: process, differed by up to 2.2% in median step over 240 rounds, and twice that over 60.
#: Settling is bounded by time as well as steps: a contender built late races again.
DEFAULTS = {"steps": 240, "warmup": 3, "settle_steps": 100000, "settle_s": 300.0, "block": 1}
#: eager's interquartile range above this % of its median: a neighbour disturbed the run.
NOISY_IQR_PCT = 50


# -- command line ----------------------------------------------------------------------------
def _model_list(text: str) -> list[str]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in BENCH_MODELS]
    if unknown or not names:
        raise argparse.ArgumentTypeError(
            f"unknown benchmark model(s) {unknown or text!r}; choose from {','.join(BENCH_MODELS)}"
        )
    missing = [f"{n} needs {m.requires}" for n in names if not (m := BENCH_MODELS[n]).available]
    if missing:
        raise argparse.ArgumentTypeError(
            f"{'; '.join(missing)}: pip install 'autopar[bench]' (or drop the model)"
        )
    return names


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``autopar bench`` (also used by ``benchmarks/bench_training.py``)."""
    parser.description = (
        "Time full training steps (forward + loss + backward + optimizer step) of eager "
        "PyTorch, torch.compile (Inductor) and autopar on the same models, interleaved in one "
        "process, after autopar's background builds and its judge have settled. Prints medians, "
        "ratios vs eager and vs the best of eager/torch.compile, time to first step, when the "
        "judge settled, the executor per graph and the verdict; writes JSON and CSV."
    )
    parser.add_argument(
        "--models",
        type=_model_list,
        default=None,
        metavar="M1,M2",
        help=f"comma-separated models to run, from {','.join(BENCH_MODELS)} (default: all "
        "whose packages are installed; bert and gpt2 need transformers)",
    )
    parser.add_argument(
        "--model", default=None, metavar=METAVAR,
        help="your own model instead of the built-in ones: a callable returning (model, "
        "example_inputs), e.g. my_model.py:make; ends with whether autopar is worth it on it",
    )  # fmt: skip
    parser.add_argument(
        "--first-minute", action="store_true",
        help="time to train instead: steps in the first --seconds from the first call, one "
        "fresh process per contender, cold then warm caches (autopar.tools.first_minute)",
    )  # fmt: skip
    parser.add_argument("--seconds", type=float, default=60.0, help="--first-minute's window")
    parser.add_argument(
        "--quick",
        action="store_true",
        help=f"a smoke run: models {','.join(QUICK['models'])} unless --models, "
        f"{QUICK['steps']} steps, {QUICK['warmup']} warm-up, at most {QUICK['settle_steps']} "
        "settle steps",
    )
    parser.add_argument(
        "--steps",
        type=positive_int,
        default=None,
        help=f"timed training steps per contender; the median is reported (default "
        f"{DEFAULTS['steps']})",
    )
    parser.add_argument(
        "--warmup",
        type=int,
        default=None,
        help="untimed interleaved rounds after autopar settled, before timing (default "
        f"{DEFAULTS['warmup']})",
    )
    parser.add_argument(
        "--block",
        type=positive_int,
        default=None,
        help="consecutive steps of a contender per round, all but the first timed: a warm "
        f"steady state (default {DEFAULTS['block']}: one step per contender and round, "
        "every step timed)",
    )
    parser.add_argument(
        "--settle-steps",
        type=int,
        default=None,
        help="at most this many autopar-only steps after autopar.wait, for its builds to race "
        f"and its race to decide (default {DEFAULTS['settle_steps']}; 0: none)",
    )
    parser.add_argument(
        "--settle-s",
        type=float,
        default=None,
        help="at most this many seconds of those autopar-only steps "
        f"(default {DEFAULTS['settle_s']:g})",
    )
    parser.add_argument(
        "--wait-timeout",
        type=float,
        default=900.0,
        help="seconds autopar.wait may block for background compiles (default 900)",
    )
    parser.add_argument(
        "--wait-quiet",
        type=float,
        default=0.0,
        metavar="SECONDS",
        help="before each model, wait up to this long until no other process holds a core "
        "(three 2-thread matmul probes in a row at > 1.2x the 1-thread speed); default 0: "
        "no wait. Each model's table says how quiet the machine was before and after it",
    )
    parser.add_argument(
        "--retries",
        type=int,
        default=0,
        help="run a model again (up to this many times, each with a fresh profile store) when "
        "its run looks noisy: the machine was busy before or after it, or eager's step times "
        f"spread more than {NOISY_IQR_PCT}%% (default 0)",
    )
    parser.add_argument(
        "--streams",
        type=positive_int,
        default=None,
        help="streams autopar plans for (default: the machine's intra-op thread count)",
    )
    parser.add_argument(
        "--policy",
        default="auto",
        choices=SINGLE_DEVICE_POLICY_NAMES,
        help="autopar's partitioner (default auto: the one the simulator predicts fastest)",
    )
    parser.add_argument(
        "--no-inductor",
        action="store_true",
        help="no Inductor anywhere: skip torch.compile and compile autopar with "
        "inductor=False (Inductor's CPU compiles take tens of seconds per model)",
    )
    parser.add_argument(
        "--no-autopar-inductor",
        action="store_true",
        help="autopar without its Inductor executors (inductor=False); torch.compile still runs. "
        "Default: autopar.compile's default ladder",
    )
    parser.add_argument(
        "--no-background",
        action="store_true",
        help="autopar with background=False: its Inductor executors compile at the second step",
    )
    parser.add_argument(
        "--no-race",
        action="store_true",
        help="autopar with race=False: always the compiled path, no eager safety net",
    )
    parser.add_argument(
        "--backend",
        action="store_true",
        help=f"also time torch.compile(model, backend='autopar') as {BACKEND!r}, settled "
        "like autopar (a probe, not a peer)",
    )
    parser.add_argument(
        "--warm-cache",
        action="store_true",
        help="use Inductor's usual on-disk cache (default: a fresh empty cache per model and "
        "contender, so first steps and settle times are cold-start times)",
    )
    parser.add_argument(
        "--optimizer",
        choices=["sgd", "adam"],
        default="sgd",
        help="optimizer of every contender (default sgd, lr 0.01; adam: lr 1e-3)",
    )
    parser.add_argument(
        "--no-adapt",
        action="store_true",
        help="compile autopar with adapt=False (no drift monitor, no re-profiling mid-run)",
    )
    add_store_argument(parser)
    parser.add_argument(
        "--out",
        default="results/bench.json",
        help="write the results as JSON here (default results/bench.json; '' for none)",
    )
    parser.add_argument(
        "--csv", default=None, help="also write one CSV row per model and contender here"
    )
    parser.add_argument(
        "--seed", type=int, default=0, help="seed of weights and inputs (default 0)"
    )


def resolve_args(args) -> argparse.Namespace:
    """Fill the defaults that depend on ``--quick`` (models, steps, warm-up, settle steps) and
    the models to run (``bench_models.choose_models``: ``args.models``, ``skipped``, ``specs``)."""
    quick = getattr(args, "quick", False)
    choose_models(args, QUICK["models"] if quick else None)
    for name, default in DEFAULTS.items():
        if getattr(args, name, None) is None:
            setattr(args, name, QUICK[name] if quick else default)
    if args.warmup < 0 or args.settle_steps < 0 or args.settle_s < 0:
        raise SystemExit("autopar bench: --warmup, --settle-steps and --settle-s must be >= 0")
    optional = {"no_autopar_inductor": False, "no_background": False, "no_race": False,
                "no_adapt": False, "backend": False, "first_minute": False, "seconds": 60.0,
                "warm_cache": False, "wait_timeout": 900.0, "wait_quiet": 0.0,
                "retries": 0}  # fmt: skip
    for name, default in optional.items():
        if not hasattr(args, name):
            setattr(args, name, default)  # a Namespace built by hand (tests, scripts)
    return args


# -- one contender -----------------------------------------------------------------------------
@dataclass
class Contender:
    """One way of running the model, with its own copy of the weights and its own optimizer."""

    name: str
    module: nn.Module  # what is called: the model, torch.compile's or autopar's wrapper
    opt: torch.optim.Optimizer
    compile_s: float | None = None  # the first training step (compilation included)
    step_s: list[float] = field(default_factory=list)
    fwbw_s: list[float] = field(default_factory=list)
    losses: list[float] = field(default_factory=list)
    error: str | None = None
    notes: list[str] = field(default_factory=list)
    t_first: float = 0.0  # perf_counter at the start of the first step

    def median_ms(self, which: str = "step") -> float | None:
        xs = self.step_s if which == "step" else self.fwbw_s
        return statistics.median(xs) * 1e3 if xs else None

    def spread_pct(self) -> float | None:
        """Interquartile range of the step times, in % of their median: the run's noise."""
        if len(self.step_s) < 4:
            return None
        q1, _, q3 = statistics.quantiles(self.step_s, n=4)
        return 100.0 * (q3 - q1) / statistics.median(self.step_s)


def _optimizer(name: str, model: nn.Module) -> torch.optim.Optimizer:
    if name == "adam":
        return torch.optim.Adam(model.parameters(), lr=1e-3)
    return torch.optim.SGD(model.parameters(), lr=0.01)


def _train_step(c: Contender, inputs, loss_fn: Callable) -> tuple[float, float, float]:
    """One training step; returns (step seconds, forward+backward seconds, loss)."""
    t0 = time.perf_counter()
    c.opt.zero_grad(set_to_none=True)
    out = c.module(*inputs)
    loss = loss_fn(out)
    loss.backward()
    t1 = time.perf_counter()
    c.opt.step()
    t2 = time.perf_counter()
    return t2 - t0, t1 - t0, loss.item()


def autopar_options(args) -> dict[str, Any]:
    """The ``autopar.compile`` keyword arguments the bench's options ask for."""
    opts: dict[str, Any] = {"streams": args.streams, "policy": args.policy, "store": args.store}
    if args.no_adapt:
        opts["adapt"] = False
    if args.no_inductor or args.no_autopar_inductor:
        opts["inductor"] = False
    if args.no_background:
        opts["background"] = False
    if args.no_race:
        opts["race"] = False
    return opts


def _make_contenders(model: nn.Module, args) -> list[Contender]:
    import autopar.api

    out = []
    for name in CONTENDERS:
        if name == "torch.compile" and args.no_inductor:
            continue
        plans_only = args.no_inductor or args.no_autopar_inductor or args.no_adapt
        if name == "autopar-plans" and plans_only:
            continue  # autopar itself runs its plans (or, without a monitor, nothing to read)
        m = copy.deepcopy(model)
        if name == "eager":
            module = m
        elif name == "torch.compile":
            module = torch.compile(m)
        elif name == "autopar":
            module = autopar.api.compile(m, **autopar_options(args))
        else:  # its planned programs always: what the cost model predicts
            module = autopar.api.compile(m, **{**autopar_options(args), "executors": ("plan",),
                                               "inductor": None, "race": True})  # fmt: skip
        out.append(Contender(name, module, _optimizer(args.optimizer, m)))
    if args.backend:
        m = copy.deepcopy(model)
        module = torch.compile(m, backend="autopar", dynamic=False, options=autopar_options(args))
        out.append(Contender(BACKEND, module, _optimizer(args.optimizer, m)))
    return out


# -- one model ---------------------------------------------------------------------------------
def bench_model(spec: BenchModel, args, default_threads: int) -> dict[str, Any]:
    """The three phases on one model (see the module's docstring); returns a result dict."""
    args = resolve_args(args)
    torch.manual_seed(args.seed)
    model = spec.make()
    inputs = spec.make_inputs()
    with torch.no_grad():
        loss_fn = make_loss(spec, model(*inputs))
    contenders = _make_contenders(model, args)
    caught: list[str] = []

    def run(c: Contender, record: bool) -> None:
        if c.error is not None:
            return
        if torch.get_num_threads() != default_threads:  # a contender must not leak settings
            c.notes.append(f"intra-op threads were {torch.get_num_threads()}, reset")
            torch.set_num_threads(default_threads)
        try:
            with warnings.catch_warnings(record=True) as ws:
                warnings.simplefilter("always")
                step, fwbw, loss = _train_step(c, inputs, loss_fn)
            caught.extend(f"{c.name}: {w.category.__name__}: {w.message}" for w in ws)
        except Exception as exc:  # noqa: BLE001 - one contender failing must not stop the bench
            c.error = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
            return
        if c.compile_s is None:
            c.compile_s = step
        elif record:
            c.step_s.append(step)
            c.fwbw_s.append(fwbw)
        c.losses.append(loss)

    ap = next(c for c in contenders if c.name == "autopar")
    settle: dict[str, Any] = {}
    for c in contenders:  # phase 1: first steps, one contender at a time
        label = f"{spec.name}-{c.name.replace('.', '_')}"
        with inductor_cache(args, label) if c.name != "eager" else contextlib.nullcontext():
            c.t_first = time.perf_counter()
            run(c, record=False)
            if c is ap and c.error is None:  # phase 2, in the same Inductor cache
                settle = autopar_settle(c, lambda c=c: run(c, record=False), args)
            elif c.name == BACKEND and c.error is None:  # its race verdict, in its notes
                got = autopar_settle(c, lambda c=c: run(c, record=False), args)
                c.notes.extend(f"race {r['signature']}: {r['verdict']}" for r in got["race"])
    timed_per_round = max(args.block - 1, 1)
    for i in range(args.warmup + math.ceil(args.steps / timed_per_round)):  # phase 3
        k = i % len(contenders)  # rotate who goes first; reverse every other round (ABBA)
        order = contenders[k:] + contenders[:k]
        for c in order[::-1] if i % 2 else order:
            for j in range(args.block):  # a block's first step pays for the last one's caches
                timed = i >= args.warmup and (j > 0 or args.block == 1)
                run(c, record=timed and len(c.step_s) < args.steps)
    if settle:
        settle = autopar_final(ap, settle)

    eager = next(c for c in contenders if c.name == "eager")
    probe = next((c for c in contenders if c.name == "autopar-plans"), ap)
    pred = autopar_prediction(ap.module)
    measured_fwbw = ap.median_ms("fwbw")
    check = cost_model_check(probe.module, args.steps) if probe.error is None else {}
    base = eager.median_ms()
    peers = [c for c in contenders if c.name not in PROBES and c.median_ms() is not None]
    best_c = min(peers, key=lambda c: c.median_ms(), default=None)
    best = best_c.median_ms() if best_c is not None else None
    rows = {}
    for c in contenders:
        med = c.median_ms()
        rows[c.name] = {
            "median_step_ms": med,
            "median_fwbw_ms": c.median_ms("fwbw"),
            "spread_pct": c.spread_pct(),
            "speedup_vs_eager": (base / med) if (med and base) else None,
            "speedup_vs_best": (best / med) if (med and best) else None,
            "vs_best_interval": ratio_interval(best_c.step_s, c.step_s) if best_c else None,
            "compile_s": None if c.name == "eager" else c.compile_s,
            "first_step_s": c.compile_s,
            "timed_steps": len(c.step_s),
            "final_loss": c.losses[-1] if c.losses else None,
            "error": c.error,
            "notes": c.notes,
        }
    return {
        "model": spec.name,
        "description": spec.description,
        "input_shapes": [list(s) for s in spec.input_shapes],
        "parameters": sum(p.numel() for p in model.parameters()),
        "contenders": rows,
        "autopar": {
            **pred,
            **settle,
            "serial_fwbw_ms": pred["serial_s"] * 1e3 if pred["serial_s"] else None,
            "measured_fwbw_ms": measured_fwbw,
            **check,
        },
        "warnings": sorted(set(caught)),
    }


def noisy(res: dict[str, Any]) -> str | None:
    """Why the run of one model does not look like a quiet machine's, or None."""
    for when in ("before", "after"):
        state = res.get(f"machine_{when}")
        if state and not state["quiet"]:
            return f"machine busy {when} it: {describe_state(state)}"
    spread = res["contenders"].get("eager", {}).get("spread_pct")
    if spread is not None and spread > NOISY_IQR_PCT:
        return f"eager's step times spread {spread:.0f}% (IQR / median)"
    return None


def run_model(name: str, args, default_threads: int) -> dict[str, Any]:
    """``bench_model`` on ``args.specs[name]``, waiting for a quiet machine first
    (``--wait-quiet``), and again (``--retries``, with a fresh profile store) while noisy."""
    discarded = []
    for attempt in range(args.retries + 1):
        before = machine_state(default_threads, args.wait_quiet)
        if args.wait_quiet > 0 and not before["quiet"]:
            print(f"\n   NOTE: {name}: still busy after {before['waited_s']:.0f} s: "
                  f"{describe_state(before)}", flush=True)  # fmt: skip
        run_args = args
        if attempt:
            run_args = argparse.Namespace(**vars(args))
            run_args.store = tempfile.mkdtemp(prefix="autopar-bench-store-")
        t0 = time.perf_counter()
        res = bench_model(args.specs[name], run_args, default_threads)
        res["wall_s"] = time.perf_counter() - t0
        res["machine_before"] = before
        res["machine_after"] = machine_state(default_threads)
        compat.dynamo_reset()  # drop this model's compiled graphs before the next run
        if attempt:
            shutil.rmtree(run_args.store, ignore_errors=True)
        why = noisy(res)
        res["attempt"], res["noisy"], res["discarded"] = attempt + 1, why, discarded
        if why is None or attempt == args.retries:
            return res
        print(f"\n   {name}: attempt {attempt + 1} was noisy ({why}); running it again with "
              "a fresh profile store", flush=True)  # fmt: skip
        discarded.append({"attempt": attempt + 1, "noisy": why, "wall_s": res["wall_s"]})
    raise AssertionError("unreachable")


def main(args) -> int:
    """Run the benchmark described by ``args`` (from ``add_arguments``); 0 on success."""
    args = resolve_args(args)
    if args.first_minute:
        from autopar.tools.first_minute import main as first_minute_main

        return first_minute_main(args)
    default_threads = torch.get_num_threads()
    names = ", ".join([*(c for c in CONTENDERS if not (c == "torch.compile" and args.no_inductor)),
                       *([BACKEND] if args.backend else [])])  # fmt: skip
    ladder = ",".join(ladder_of(args))
    print(
        f"autopar bench: training steps of {names} on {len(args.models)} model(s) "
        f"({','.join(args.models)}), in one process.\n"
        f"   torch {torch.__version__}, {os.cpu_count()} CPU(s), {default_threads} intra-op "
        f"threads; a 'step' is zero_grad + forward + loss + backward + "
        f"{args.optimizer.upper()} step. autopar's executors: {ladder}; Inductor cache: "
        f"{'warm (the usual one)' if args.warm_cache else 'fresh per model and contender'}.\n"
        "   '1st step s' is each contender's first step (compilation included, not in the "
        "medians); autopar then settles alone\n   (autopar.wait, then steps until its judge "
        "decided) before the interleaved timed rounds.\n"
        "   'eager/x' and 'best/x': eager's (or the faster of eager and torch.compile's) median "
        "over the contender's; > 1 is faster.\n   '(IQR %)' is the spread of the step "
        "times (interquartile range / median): large values mean a noisy measurement.",
        flush=True,
    )
    if args.skipped:  # a default run without the optional models must say so
        print(skipped_note(args.skipped), flush=True)
    load = _load()
    if load is not None and load > 0.5 * (os.cpu_count() or 1):
        print(
            f"   NOTE: the machine is busy (load average {load:.1f} on {os.cpu_count()} CPUs): "
            "other processes share the cores, so times are noisy; interleaving spreads the "
            "noise over all contenders alike.",
            flush=True,
        )
    results = []
    for name in args.models:
        res = run_model(name, args, default_threads)
        results.append(res)
        print("\n" + format_result(res, args) + f"\n   ({res['wall_s']:.0f} s)", flush=True)
    print("\n" + format_summary(results))
    if getattr(args, "model", None):  # the user's question, answered last: worth it?
        print("\n" + "\n".join(format_verdict(res) for res in results))
    doc = {"meta": meta(args, default_threads), "results": results}
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(doc, f, indent=1)
        print(f"\nresults: {args.out}")
    if args.csv:
        write_csv(args.csv, results)
        print(f"results (CSV): {args.csv}")
    failed = [
        f"{r['model']}/{n}" for r in results for n, c in r["contenders"].items() if c["error"]
    ]
    if failed:
        print(f"\nautopar bench: {len(failed)} contender run(s) failed: {', '.join(failed)}")
        return 1
    return 0
