"""The pictures ``autopar demo`` writes: the plan's timeline (one box per operator), a
Perfetto / Chrome trace of predicted against measured times, the loss curves and a bar
chart of step times.

The timeline and the predicted half of the trace come from the plans
(``autopar.planning.report``: ``Plan.gantt``, ``plan_chrome_trace``); the measured half from
``autopar.stats(cmodel, per="graph")``: the median call time of each graph on each executor
that ran it, and the per-stream busy times the monitor samples on multi-stream programs.

Example::

    >>> files = write_pictures(cmodel, "results/demo", title="charlstm", losses=losses,
    ...                        times=times, note="")                   # doctest: +SKIP
    >>> sorted(files)[:2]                                               # doctest: +SKIP
    ['loss plot', 'step-time bars']
"""

from __future__ import annotations

import os
import statistics
from typing import Any

#: Perfetto shows processes by pid: the measured graphs sort after the predicted ones.
MEASURED_PID = 1000
COLOURS = {"eager": "#7f7f7f", "torch.compile": "#2ca02c", "autopar": "#1f77b4"}


def _plans(cmodel):
    import autopar

    return [u.plan for u in autopar.graphs(cmodel) if u.plan is not None]


def write_timeline(cmodel, path: str, title: str) -> str | None:
    """The plans' predicted timeline (forward then backward; one panel per graph, one row
    per stream, one bordered, named box per operator) as an image; None with no plan.

    Example::

        >>> write_timeline(cmodel, "results/demo/timeline.png", "towers")  # doctest: +SKIP
        'results/demo/timeline.png'
    """
    from autopar.planning.plan import Plan

    plans = _plans(cmodel)
    if not plans:
        return None
    return Plan.combine(plans).gantt(path, title=title)


def measured_events(calls, tags: list[str]) -> list[dict[str, Any]]:
    """Trace events of what was measured, one process per graph, laid end to end in graph
    order as the step runs them: a ``call`` row per executor (the median of its last 50
    calls), and for multi-stream programs a row per stream (median busy time of the
    monitor's samples).

    Example::

        >>> import pandas as pd
        >>> calls = pd.DataFrame({"graph": ["g0.fw"] * 3, "measured_s": [1e-3, 2e-3, 3e-3],
        ...                       "executor": ["plan"] * 3, "streams_s": [None] * 3})
        >>> [(e["name"], e["dur"]) for e in measured_events(calls, ["g0.fw"]) if e["ph"] == "X"]
        [('g0.fw on plan (median of 3 calls)', 2000.0)]
    """
    events: list[dict[str, Any]] = []
    t = 0.0  # us: each graph starts where the previous one's final executor ended
    for i, tag in enumerate(tags):
        pid = MEASURED_PID + i
        rows = calls[calls["graph"] == tag] if len(calls) else calls
        if "executor" in rows:
            rows = rows[~rows["executor"].isin(["compile", "profiler"])]
        events.append({"name": "process_name", "ph": "M", "pid": pid, "tid": 0,
                       "args": {"name": f"measured: {tag}"}})  # fmt: skip
        events.append({"name": "process_sort_index", "ph": "M", "pid": pid, "tid": 0,
                       "args": {"sort_index": 2 * (i + 1) + 1}})  # fmt: skip
        groups = list(rows.groupby("executor", sort=False)) if "executor" in rows else [
            ("compiled", rows)]  # fmt: skip
        last = 0.0
        for tid, (executor, g) in enumerate(groups):
            xs = [float(x) for x in g["measured_s"].tail(50) if x == x]
            if not xs:
                continue
            last = statistics.median(xs) * 1e6
            events.append({"name": "thread_name", "ph": "M", "pid": pid, "tid": tid,
                           "args": {"name": f"call on {executor}"}})  # fmt: skip
            events.append({"name": f"{tag} on {executor} (median of {_calls(len(xs))})",
                           "cat": "measured", "ph": "X", "ts": t, "dur": last, "pid": pid,
                           "tid": tid, "args": {"calls": len(xs)}})  # fmt: skip
        samples = _multi_stream_samples(rows)
        for sid in sorted({k for s in samples for k in s}):
            busy = statistics.median(s[sid] for s in samples if sid in s) * 1e6
            tid = 100 + int(sid)
            events.append({"name": "thread_name", "ph": "M", "pid": pid, "tid": tid,
                           "args": {"name": f"stream {sid} (sampled)"}})  # fmt: skip
            events.append({"name": f"stream {sid} busy (median of {len(samples)} samples)",
                           "cat": "measured", "ph": "X", "ts": t, "dur": busy, "pid": pid,
                           "tid": tid, "args": {"samples": len(samples)}})  # fmt: skip
        t += last
    return events


def _calls(n: int) -> str:
    return f"{n} call{'s' if n != 1 else ''}"


def _multi_stream_samples(rows) -> list[dict]:
    """The per-stream samples (``streams_s`` dicts with more than one stream) of ``rows``."""
    if "streams_s" not in rows:
        return []
    return [s for s in rows["streams_s"] if isinstance(s, dict) and len(s) > 1]


def write_trace(cmodel, calls, path: str) -> str | None:
    """One Chrome trace-event file (open it in https://ui.perfetto.dev): the predicted
    timeline of every planned graph, one event per operator on its stream (processes
    ``g0.fw (forward), <policy>`` ...), and what was measured (processes ``measured: g0.fw``
    ..., see :func:`measured_events`). None with no plan.

    Example::

        >>> write_trace(cmodel, autopar.stats(cmodel, per="graph"), "trace.json")  # doctest: +SKIP
        'trace.json'
    """
    import autopar
    from autopar.planning.plan import Plan
    from autopar.planning.report import plan_chrome_trace, write_chrome_trace

    plans = _plans(cmodel)
    if not plans:
        return None
    trace = plan_chrome_trace(Plan.combine(plans))
    for e in trace["traceEvents"]:  # say which half is which in Perfetto's process list
        if e["ph"] == "M" and e["name"] == "process_name":
            e["args"]["name"] = "predicted: " + e["args"]["name"]
        elif e["ph"] == "M" and e["name"] == "process_sort_index":
            e["args"]["sort_index"] = 2 * e["pid"]  # graph k's measured process goes under it
    tags = [u.tag for u in autopar.explain(cmodel).graphs]
    trace["traceEvents"] += measured_events(calls, tags)
    trace["otherData"]["measured"] = "autopar.stats(cmodel, per='graph'): median call times"
    return write_chrome_trace(trace, path)


def write_loss_plot(losses: dict[str, list[float]], path: str, title: str, ylabel: str) -> str:
    """The loss curves of every contender, and below them eager's minus autopar's loss
    (float32 rounding, amplified by training).

    Example::

        >>> write_loss_plot({"eager": [2.0, 1.5], "autopar": [2.0, 1.5]}, "loss.png",
        ...                 "towers", "MSE")                            # doctest: +SKIP
        'loss.png'
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(8, 5.5), layout="constrained")
    FigureCanvasAgg(fig)  # no pyplot: the demo must not touch a global backend
    top, bottom = fig.subplots(2, 1, sharex=True, height_ratios=[3, 1])
    styles = {"eager": "-", "autopar": "--", "torch.compile": ":"}
    for name, ys in losses.items():
        top.plot(range(1, len(ys) + 1), ys, styles.get(name, "-"), label=name,
                 color=COLOURS.get(name), linewidth=1.5)  # fmt: skip
    top.set_ylabel(ylabel)
    top.set_title(f"{title}: training loss (same initial weights, same batches)")
    top.legend()
    if "eager" in losses and "autopar" in losses:
        diff = [a - b for a, b in zip(losses["eager"], losses["autopar"], strict=False)]
        bottom.plot(range(1, len(diff) + 1), diff, color="#d62728", linewidth=1)
        bottom.axhline(0.0, color="black", linewidth=0.5)
    bottom.set_ylabel("eager - autopar")
    bottom.set_xlabel("training step")
    fig.savefig(path, dpi=100)
    return path


def write_bars(times: dict[str, tuple[float, float, int] | None], path: str, title: str,
               note: str = "", window: str = "") -> str:  # fmt: skip
    """A bar chart of the median step time of each contender (``times``: name -> (median
    ms, interquartile range ms, steps), or None when not timed), ratios to eager on the
    bars; ``window`` (which steps were timed) and ``note`` (e.g. how to include
    torch.compile) under the title.

    Example::

        >>> write_bars({"eager": (50.0, 2.0, 30), "autopar": (30.0, 1.0, 30)}, "bars.png",
        ...            "charlstm")                                      # doctest: +SKIP
        'bars.png'
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(6.5, 4.5), layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.subplots()
    timed = {k: v for k, v in times.items() if v is not None}
    names = list(timed)
    meds = [timed[n][0] for n in names]
    bars = ax.bar(names, meds, yerr=[timed[n][1] / 2 for n in names], capsize=4,
                  color=[COLOURS.get(n, "#9467bd") for n in names])  # fmt: skip
    eager = timed.get("eager")
    for b, n in zip(bars, names, strict=True):
        label = f"{timed[n][0]:.2f} ms"
        if eager and n != "eager":
            label += f"\n{eager[0] / timed[n][0]:.2f}x eager"
        top = b.get_height() + timed[n][1] / 2  # above the whisker, not on it
        ax.annotate(label, (b.get_x() + b.get_width() / 2, top), ha="center",
                    va="bottom", xytext=(0, 3), textcoords="offset points")  # fmt: skip
    ax.set_ylabel("median training step (ms)")
    ax.set_ylim(0, max(meds, default=1.0) * 1.3)
    steps = "/".join(map(str, sorted({v[2] for v in timed.values()})))
    sub = f"{window or steps + ' steps'}; whiskers: interquartile range"
    ax.set_title(f"{title}: median training step\n{sub}" + (f"\n{note}" if note else ""),
                 fontsize="medium")  # fmt: skip
    fig.savefig(path, dpi=100)
    return path


def write_pictures(cmodel, out: str, *, title: str, losses, times, calls, ylabel: str,
                   note: str = "", window: str = "") -> dict[str, str]:  # fmt: skip
    """Every picture into ``out``; returns what -> path (the timeline and the trace only
    when a graph was planned).

    Example: see the module docstring."""
    os.makedirs(out, exist_ok=True)
    files = {}
    path = write_timeline(cmodel, os.path.join(out, "timeline.png"), title)
    if path:
        files["timeline (plan, one box per op)"] = path
    path = write_trace(cmodel, calls, os.path.join(out, "trace.json"))
    if path:
        files["trace (predicted vs measured)"] = path + "  (open in https://ui.perfetto.dev)"
    files["loss plot"] = write_loss_plot(losses, os.path.join(out, "loss.png"), title, ylabel)
    files["step-time bars"] = write_bars(times, os.path.join(out, "step_times.png"), title,
                                         note, window)  # fmt: skip
    return files
