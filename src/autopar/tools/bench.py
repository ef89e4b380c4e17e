"""``autopar bench``: time whole training steps of eager, ``torch.compile`` and autopar.

Every contender trains its own deep copy of the same model (same initial weights, same
inputs, same target, same optimizer) and the contenders are *interleaved*: each round runs one
training step of every contender, in a rotating order, so a slow phase of the machine (another
process, thermal throttling) hits all of them alike. A training step is
``zero_grad -> forward -> loss -> backward -> optimizer.step``; the table reports the median
over ``--steps`` rounds after ``--warmup`` rounds. The first step of a compiled contender does
its compilation (``torch.compile``: Dynamo + Inductor; autopar: capture + profile + plan +
codegen); it is reported separately as "compile" and never counted in the medians.

autopar's cost model predicts the forward + backward time of its plan; the table compares
that with autopar's measured forward + backward time (the optimizer step is not planned).

Example::

    autopar bench --models towers,inception --steps 20
    python benchmarks/bench_training.py --models towers --no-inductor
"""

from __future__ import annotations

import argparse
import copy
import csv
import json
import os
import platform
import statistics
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

from autopar.planning.policies import SINGLE_DEVICE_POLICY_NAMES
from autopar.tools import zoo
from autopar.tools.args import positive_int


# -- the models ------------------------------------------------------------------------------
@dataclass(frozen=True)
class BenchModel:
    """One benchmark model: a zoo model at a size that takes milliseconds per step here."""

    name: str
    description: str
    make: Callable[[], nn.Module]
    input_shapes: tuple[tuple[int, ...], ...]


BENCH_MODELS: dict[str, BenchModel] = {
    m.name: m
    for m in (
        BenchModel(
            "inception",
            "Inception-style CNN: 2 blocks of 4 conv branches, 16 channels each",
            lambda: zoo.InceptionCNN(c_in=3, c=16, blocks=2),
            ((16, 3, 16, 16),),
        ),
        BenchModel(
            "towers",
            "multi-tower MLP: 4 independent towers of 4x256 Linear, concatenated",
            lambda: zoo.MultiTowerMLP(d_in=64, hidden=256, towers=4, depth=4),
            ((64, 64),),
        ),
        BenchModel(
            "lstm_cells",
            "stacked nn.LSTMCell loop: 2 layers x 128 hidden, 16 time steps",
            lambda: zoo.LSTMCellStack(d_in=32, hidden=128, layers=2),
            ((16, 16, 32),),
        ),
        BenchModel(
            "transformer",
            "Transformer encoder: 2 layers, d=64, 4 heads, ff=128",
            lambda: zoo.Transformer(d=64, heads=4, layers=2, ff=128),
            ((8, 16, 64),),
        ),
        BenchModel(
            "deep_mlp",
            "plain deep MLP: 8 x 512 Linear chain (nothing runs concurrently)",
            lambda: zoo.DeepMLP(d=512, depth=8),
            ((64, 512),),
        ),
    )
}
CONTENDERS = ("eager", "torch.compile", "autopar")


# -- command line ----------------------------------------------------------------------------
def _model_list(text: str) -> list[str]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in BENCH_MODELS]
    if unknown or not names:
        raise argparse.ArgumentTypeError(
            f"unknown benchmark model(s) {unknown or text!r}; choose from {','.join(BENCH_MODELS)}"
        )
    return names


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``autopar bench`` (also used by ``benchmarks/bench_training.py``)."""
    parser.description = (
        "Time full training steps (forward + backward + optimizer step) of eager PyTorch, "
        "torch.compile (Inductor) and autopar on the same models, interleaved in one process. "
        "Prints medians, speedups over eager and autopar's predicted vs measured time; writes "
        "JSON and CSV."
    )
    parser.add_argument(
        "--models",
        type=_model_list,
        default=list(BENCH_MODELS),
        metavar="M1,M2",
        help=f"comma-separated models to run (default: all of {','.join(BENCH_MODELS)})",
    )
    parser.add_argument(
        "--steps",
        type=positive_int,
        default=20,
        help="timed training steps per contender; the median is reported (default 20)",
    )
    parser.add_argument(
        "--warmup",
        type=int,
        default=3,
        help="untimed steps after the first (compiling) step, before timing (default 3)",
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
        help="skip torch.compile (its CPU compilation takes tens of seconds per model)",
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
    parser.add_argument(
        "--store",
        default=None,
        help="autopar's profile store (.json or directory; default ./profiles or "
        "$AUTOPAR_PROFILE_DIR)",
    )
    parser.add_argument(
        "--out",
        default="results/bench.json",
        help="write the results as JSON here (default results/bench.json)",
    )
    parser.add_argument(
        "--csv", default=None, help="also write one CSV row per model and contender here"
    )
    parser.add_argument(
        "--seed", type=int, default=0, help="seed of weights and inputs (default 0)"
    )


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


def _train_step(c: Contender, inputs, target) -> tuple[float, float, float]:
    """One training step; returns (step seconds, forward+backward seconds, loss)."""
    t0 = time.perf_counter()
    c.opt.zero_grad(set_to_none=True)
    out = c.module(*inputs)
    loss = F.mse_loss(out, target)
    loss.backward()
    t1 = time.perf_counter()
    c.opt.step()
    t2 = time.perf_counter()
    return t2 - t0, t1 - t0, loss.item()


def _make_contenders(model: nn.Module, args) -> list[Contender]:
    import autopar.api

    out = []
    for name in CONTENDERS:
        if name == "torch.compile" and args.no_inductor:
            continue
        m = copy.deepcopy(model)
        if name == "eager":
            module = m
        elif name == "torch.compile":
            module = torch.compile(m)
        else:
            extra = {"adapt": False} if getattr(args, "no_adapt", False) else {}
            module = autopar.api.compile(
                m, streams=args.streams, policy=args.policy, store=args.store, **extra
            )
        out.append(Contender(name, module, _optimizer(args.optimizer, m)))
    return out


def autopar_prediction(cmodel) -> dict[str, Any]:
    """What autopar's plans of a compiled model predict, from its captured graph records.

    Returns predicted and serial forward+backward seconds summed over the planned graphs, the
    policies and stream counts used, and the graphs that fell back to eager (not predicted)."""
    pipeline = getattr(cmodel, "_autopar_pipeline", None)
    records = list(getattr(pipeline, "records", []) or [])
    plans = [r.plan for r in records if r.plan is not None]
    states = getattr(getattr(pipeline, "monitor", None), "_states", {}) or {}
    return {
        "graphs": [r.tag for r in records],
        "planned": [r.tag for r in records if r.plan is not None],
        "fallbacks": {r.tag: r.fallback for r in records if r.fallback},
        "predicted_s": sum(p.predicted_step_time for p in plans) if plans else None,
        "serial_s": sum(p.serial_time for p in plans) if plans else None,
        "lower_bound_s": sum(p.lower_bound for p in plans) if plans else None,
        "policies": sorted({p.policy for p in plans}),
        "streams": max((len(p.streams) for p in plans), default=0),
        "replans": sum(getattr(st, "replans", 0) for st in states.values()),
        "compile_breakdown_s": {
            "capture": max((r.capture_s for r in records), default=0.0),
            **{
                stage: sum(r.timings.get(stage, 0.0) for r in records)
                for stage in ("profile", "plan", "codegen")
            },
        },
    }


# -- one model ---------------------------------------------------------------------------------
def bench_model(spec: BenchModel, args, default_threads: int) -> dict[str, Any]:
    """Interleaved training-step timing of every contender on one model; returns a result dict."""
    torch.manual_seed(args.seed)
    model = spec.make()
    inputs = tuple(torch.randn(s) for s in spec.input_shapes)
    with torch.no_grad():
        target = torch.randn_like(model(*inputs))
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
                step, fwbw, loss = _train_step(c, inputs, target)
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

    for c in contenders:  # first step: compilation (one contender at a time, not interleaved)
        run(c, record=False)
    for i in range(args.warmup + args.steps):
        k = i % len(contenders)  # rotate who goes first
        for c in contenders[k:] + contenders[:k]:
            run(c, record=i >= args.warmup)

    eager = next(c for c in contenders if c.name == "eager")
    ap = next(c for c in contenders if c.name == "autopar")
    pred = autopar_prediction(ap.module)
    measured_fwbw = ap.median_ms("fwbw")
    err = None
    if pred["predicted_s"] and measured_fwbw:
        err = 100.0 * (pred["predicted_s"] * 1e3 - measured_fwbw) / measured_fwbw
    rows = {}
    for c in contenders:
        med = c.median_ms()
        base = eager.median_ms()
        rows[c.name] = {
            "median_step_ms": med,
            "median_fwbw_ms": c.median_ms("fwbw"),
            "spread_pct": c.spread_pct(),
            "speedup_vs_eager": (base / med) if (med and base) else None,
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
            "predicted_fwbw_ms": pred["predicted_s"] * 1e3 if pred["predicted_s"] else None,
            "serial_fwbw_ms": pred["serial_s"] * 1e3 if pred["serial_s"] else None,
            "measured_fwbw_ms": measured_fwbw,
            "prediction_error_pct": err,
        },
        "warnings": sorted(set(caught)),
    }


# -- printing ------------------------------------------------------------------------------------
def _fmt(x: float | None, spec: str, none: str = "-") -> str:
    return none if x is None else format(x, spec)


def format_result(res: dict[str, Any], args) -> str:
    """The table of one model, as printed."""
    lines = [
        f"== {res['model']}: {res['description']}",
        f"   input {' + '.join('x'.join(map(str, s)) for s in res['input_shapes'])}, "
        f"{res['parameters']:,} parameters, {args.optimizer.upper()}, median of "
        f"{args.steps} interleaved steps after {args.warmup} warm-up",
        f"   {'contender':<14} {'step ms':>9} {'(IQR %)':>8} {'fw+bw ms':>9} {'eager/x':>8} "
        f"{'compile s':>10}",
    ]
    for name, r in res["contenders"].items():
        if r["error"]:
            lines.append(f"   {name:<14} FAILED: {r['error']}")
            continue
        lines.append(
            f"   {name:<14} {_fmt(r['median_step_ms'], '9.3f')} {_fmt(r['spread_pct'], '7.0f'):>8} "
            f"{_fmt(r['median_fwbw_ms'], '9.3f')} {_fmt(r['speedup_vs_eager'], '7.2f') + 'x':>8} "
            f"{_fmt(r['compile_s'], '10.1f')}"
        )
        lines.extend(f"   {'':<14} note: {n}" for n in sorted(set(r["notes"])))
    a = res["autopar"]
    if a["predicted_fwbw_ms"] is not None:
        lines.append(
            f"   autopar cost model: predicted fw+bw {a['predicted_fwbw_ms']:.3f} ms, measured "
            f"{_fmt(a['measured_fwbw_ms'], '.3f')} ms -> error "
            f"{_fmt(a['prediction_error_pct'], '+.1f')}%"
        )
        lines.append(
            f"   plan: policy {'/'.join(a['policies'])}, {a['streams']} stream(s), predicted "
            f"serial {a['serial_fwbw_ms']:.3f} ms, lower bound {a['lower_bound_s'] * 1e3:.3f} ms"
        )
    else:
        lines.append("   autopar cost model: no plan was made (see the fallbacks below)")
    if a.get("replans"):
        lines.append(
            f"   autopar re-planned {a['replans']} time(s) during the run: measured times "
            "drifted from the prediction (re-profiling steps are slower; see --no-adapt)"
        )
    for tag, why in a["fallbacks"].items():
        lines.append(f"   autopar fallback on {tag}: {why}")
    for w in res["warnings"][:5]:
        lines.append(f"   warning: {w[:200]}")
    return "\n".join(lines)


def format_summary(results: list[dict[str, Any]]) -> str:
    """One line per model: speedups over eager and the cost model's error."""
    lines = [
        "== summary: speedup over eager (eager step time / contender step time; >1 is faster)",
        f"   {'model':<12} {'torch.compile':>13} {'autopar':>8} {'cost-model error':>17}",
    ]
    for res in results:
        c = res["contenders"]

        def sp(name, c=c):
            r = c.get(name)
            if r is None:
                return "skipped"
            return "failed" if r["error"] else _fmt(r["speedup_vs_eager"], ".2f") + "x"

        err = _fmt(res["autopar"]["prediction_error_pct"], "+.1f", "n/a")
        lines.append(
            f"   {res['model']:<12} {sp('torch.compile'):>13} {sp('autopar'):>8} "
            f"{err + ('%' if err != 'n/a' else ''):>17}"
        )
    return "\n".join(lines)


# -- output files ----------------------------------------------------------------------------------
CSV_COLUMNS = [
    "model",
    "contender",
    "median_step_ms",
    "median_fwbw_ms",
    "spread_pct",
    "speedup_vs_eager",
    "compile_s",
    "timed_steps",
    "predicted_fwbw_ms",
    "prediction_error_pct",
    "error",
]


def write_csv(path: str, results: list[dict[str, Any]]) -> None:
    _parent(path)
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=CSV_COLUMNS)
        w.writeheader()
        for res in results:
            for name, r in res["contenders"].items():
                row = {"model": res["model"], "contender": name}
                row.update({k: r.get(k) for k in CSV_COLUMNS if k in r})
                if name == "autopar":
                    row["predicted_fwbw_ms"] = res["autopar"]["predicted_fwbw_ms"]
                    row["prediction_error_pct"] = res["autopar"]["prediction_error_pct"]
                w.writerow({k: round(v, 4) if isinstance(v, float) else v for k, v in row.items()})


def _parent(path: str) -> None:
    d = os.path.dirname(os.path.abspath(path))
    os.makedirs(d, exist_ok=True)


def _load() -> float | None:
    """The 1-minute load average, where the OS has one."""
    try:
        return os.getloadavg()[0]
    except (AttributeError, OSError):
        return None


def meta(args, default_threads: int) -> dict[str, Any]:
    """The conditions of the run, stored next to the numbers."""
    return {
        "torch": torch.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
        "intra_op_threads": default_threads,
        "load_average_1min_at_end": _load(),
        "optimizer": args.optimizer,
        "steps": args.steps,
        "warmup": args.warmup,
        "streams": args.streams,
        "policy": args.policy,
        "adapt": not getattr(args, "no_adapt", False),
        "inductor": not args.no_inductor,
        "time": time.strftime("%Y-%m-%d %H:%M:%S"),
    }


def main(args) -> int:
    """Run the benchmark described by ``args`` (from ``add_arguments``); 0 on success."""
    if args.warmup < 0:
        raise SystemExit("autopar bench: --warmup must be >= 0")
    default_threads = torch.get_num_threads()
    names = ", ".join(c for c in CONTENDERS if not (c == "torch.compile" and args.no_inductor))
    print(
        f"autopar bench: training steps of {names} on {len(args.models)} model(s), "
        f"interleaved round-robin in this process.\n"
        f"   torch {torch.__version__}, {os.cpu_count()} CPU(s), {default_threads} intra-op "
        f"threads; a 'step' is zero_grad + forward + MSE loss + backward + "
        f"{args.optimizer.upper()} step.\n"
        f"   'compile s' is the first step of each compiled contender (not in the medians); "
        f"'eager/x' > 1 means faster than eager;\n   '(IQR %)' is the spread of the step "
        "times (interquartile range / median): large values mean a noisy measurement.",
        flush=True,
    )
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
        t0 = time.perf_counter()
        res = bench_model(BENCH_MODELS[name], args, default_threads)
        res["wall_s"] = time.perf_counter() - t0
        results.append(res)
        print("\n" + format_result(res, args) + f"\n   ({res['wall_s']:.0f} s)", flush=True)
        torch._dynamo.reset()  # drop this model's compiled graphs before the next model
    print("\n" + format_summary(results))
    doc = {"meta": meta(args, default_threads), "results": results}
    if args.out:
        _parent(args.out)
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
