"""autopar's second phase in ``autopar bench``: after its first step, wait for the background
Inductor compiles, then step autopar alone until the judge's verdicts stand and nothing is
left to build (``runtime.decide``); and record what runs each graph, when it got there,
and the verdicts.

Also :func:`autopar_prediction` and :func:`cost_model_check` (what autopar's plans predict,
and the cost model against the planned programs' measured times), and
:func:`inductor_cache`, the fresh Inductor cache each contender compiles in.

Example::

    >>> settle = autopar_settle(contender, step, args)     # doctest: +SKIP
    >>> ...interleaved timed steps...
    >>> settle = autopar_final(contender, settle)          # doctest: +SKIP
    >>> settle["graphs"][0]["executor"], settle["race"][0]["verdict"]   # doctest: +SKIP
    ('inductor', 'inductor')
"""

from __future__ import annotations

import contextlib
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from typing import Any


def _verdicts(pipeline) -> list[dict[str, Any]]:
    from autopar.adapt.shapes import describe_key

    rt = pipeline._runtime
    report = rt.judge.report() if rt is not None else {}
    return [{"signature": describe_key(k), "verdict": v, "reason": why}
            for k, (v, why) in report.items()]  # fmt: skip


def _graphs(cmodel) -> list[dict[str, Any]]:
    import autopar.api

    return [{"tag": u.tag, "executor": u.executor,
             # a planned program on the native interpreter (codegen.native)
             "native": getattr(u.program, "executor", "") == "native"}
            for u in autopar.api.graphs(cmodel)]  # fmt: skip


def autopar_settle(c, step: Callable[[], None], args) -> dict[str, Any]:
    """Phase 2 for autopar: autopar-only steps until settled, with ``autopar.wait`` whenever
    builds are queued (after the first verdict)."""
    import autopar.api

    pipeline = autopar.api._pipeline_of(c.module, "autopar_settle")
    wait_s, waited = 0.0, True
    steps, t_steps = 0, time.perf_counter()
    while (not pipeline.runtime.settled() and steps < args.settle_steps and c.error is None
           and time.perf_counter() - t_steps < args.settle_s):  # fmt: skip
        if pipeline.runtime.builds.pending():  # the builds compile: give them the machine
            t0 = time.perf_counter()
            waited = autopar.api.wait(c.module, timeout=args.wait_timeout) and waited
            wait_s += time.perf_counter() - t0
        step()
        steps += 1
    settled = pipeline.runtime.settled()
    return {
        "ladder": list(pipeline.ladder),
        "first_call_s": pipeline.compile_seconds,
        "wait_s": wait_s,
        "wait_done": waited,
        "settle_steps": steps,
        "settled": settled,
        # from the first step's start until every verdict stood (None: not settled)
        "final_s": time.perf_counter() - c.t_first if settled else None,
        "events": list(pipeline.runtime.events),
        "race": _verdicts(pipeline),
    }


def autopar_final(c, settle: dict[str, Any]) -> dict[str, Any]:
    """What runs autopar's graphs at the end of the run, and the verdicts then."""
    import autopar.api

    pipeline = autopar.api._pipeline_of(c.module, "autopar_final")
    settle = dict(settle)
    settle["graphs"] = _graphs(c.module)
    settle["race"] = _verdicts(pipeline)
    settle["events"] = list(pipeline.runtime.events)
    return settle


@contextlib.contextmanager
def inductor_cache(args, label: str):
    """A fresh, empty Inductor cache directory while ``label`` compiles (unless
    ``--warm-cache``): cold-start times that do not depend on earlier runs."""
    if args.warm_cache:
        yield
        return
    from autopar import compat

    d = tempfile.mkdtemp(prefix=f"autopar-bench-{label}-")
    try:
        with compat.inductor_temporary_cache_dir(d):
            yield
    finally:
        shutil.rmtree(d, ignore_errors=True)


# -- what autopar's plans predict ----------------------------------------------------------
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


def cost_model_check(cmodel, steps: int) -> dict[str, Any]:
    """The cost model against the monitor's measurements of the planned programs.

    From ``autopar.stats(cmodel, per="graph")``: the calls run by a planned program
    (``executor == "plan"``), grouped by step; over the last ``steps`` steps in which every
    planned graph ran, the median of (sum of measured graph seconds) / (sum of predicted).
    Returns ``predicted_fwbw_ms``, ``plan_measured_fwbw_ms`` (medians over those steps) and
    ``prediction_error_pct`` (+: the model predicts too slow), or Nones without such steps.
    """
    from autopar.adapt.monitor import stats

    none = {"predicted_fwbw_ms": None, "plan_measured_fwbw_ms": None,
            "prediction_error_pct": None}  # fmt: skip
    try:
        df = stats(cmodel, per="graph")
    except TypeError:
        return none
    df = df[df["executor"] == "plan"]
    if df.empty:
        return none
    graphs = df["graph"].nunique()
    per_step = df.groupby("step").agg(n=("graph", "nunique"), predicted=("predicted_s", "sum"),
                                      measured=("measured_s", "sum"))  # fmt: skip
    per_step = per_step[per_step["n"] == graphs].tail(steps)
    if per_step.empty:
        return none
    ratio = statistics.median(per_step["measured"] / per_step["predicted"])
    return {
        "predicted_fwbw_ms": statistics.median(per_step["predicted"]) * 1e3,
        "plan_measured_fwbw_ms": statistics.median(per_step["measured"]) * 1e3,
        "prediction_error_pct": 100.0 * (1.0 / ratio - 1.0),
    }
