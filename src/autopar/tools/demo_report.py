"""What ``autopar demo`` says at the end: for each Dynamo graph the executor ladder with
what became of each executor, the judge's verdict per input signature with the step times
it measured, and per recorded graph what runs it, predicted against measured time.

Everything comes from the public API: ``autopar.explain`` (the ladder, the verdicts and the
events), ``autopar.stats(per="graph")`` (every graph call's measured time) and
:class:`Watch`, which notes at which training step each decision appeared.

Example::

    >>> watch = Watch()
    >>> watch.look(cmodel, step=0, seconds=2.1)                      # doctest: +SKIP
    >>> rows = graph_decisions(autopar.explain(cmodel), autopar.stats(cmodel, per="graph"))
    ...                                                              # doctest: +SKIP
    >>> rows[0].chosen                                               # doctest: +SKIP
    'plan (serial)'
"""

from __future__ import annotations

import statistics
import textwrap
from dataclasses import dataclass, field
from typing import Any


class Watch:
    """Notes, step by step, each build and each verdict as it appears, and says when autopar
    has *settled*: every signature has its verdict and nothing is left to build.

    Example::

        >>> Watch().settled                           # nothing seen yet
        False
    """

    def __init__(self) -> None:
        self.verdicts: dict[str, tuple[int, str]] = {}  # signature -> (step, verdict)
        self.seen_events = 0
        self.settled = False
        self.events: list[str] = []  # one line per decision, as it happened

    def look(self, cmodel, step: int, seconds: float) -> list[str]:
        """Read ``cmodel``'s decisions after training step ``step`` (0-based), ``seconds``
        after autopar's first step began; returns the decisions new since the last look."""
        import autopar

        ex = autopar.explain(cmodel)
        new = [f"step {step + 1}, {seconds:.1f} s: {e}" for e in ex.events[self.seen_events:]]
        self.seen_events = len(ex.events)
        for sig, (verdict, _why) in ex.steps.items():
            if verdict is None:
                self.verdicts.pop(sig, None)  # racing (again: a new contender)
            elif self.verdicts.get(sig, (0, None))[1] != verdict:
                self.verdicts[sig] = (step, verdict)
        self.settled = autopar.api._pipeline_of(cmodel, "watch").runtime.settled()
        self.events += new
        return new


@dataclass
class GraphDecision:
    """One recorded graph's line of the final screen (see :func:`graph_decisions`)."""

    tag: str
    phase: str
    ops: int
    chosen: str = ""
    why: str = ""
    predicted_ms: float | None = None
    measured: dict[str, tuple[float, str]] = field(default_factory=dict)  # executor -> ms, how


def graph_decisions(ex, calls) -> list[GraphDecision]:
    """Per recorded graph of the :class:`~autopar.inspection.Explanation` ``ex``: what runs
    it and why, the plan's prediction and the measured call times (``calls`` is
    ``autopar.stats(cmodel, per="graph")``; the median of each executor's last 50 calls).

    Example: see the module docstring."""
    out = []
    for u in ex.graphs:
        d = GraphDecision(u.tag, u.phase, sum(1 for n in u.gm.graph.nodes
                                               if n.op == "call_function"))  # fmt: skip
        plan = u.plan
        if plan is not None:
            d.predicted_ms = plan.predicted_step_time * 1e3
        streams = len(set(dict(plan.placements).values())) if plan is not None else 0
        d.chosen = u.executor + (f" ({plan.policy} on {streams} stream{'s' * (streams != 1)})"
                                 if u.executor == "plan" and plan else "")  # fmt: skip
        if u.fallback:
            d.why = f"autopar could not plan it, so it runs as captured: {u.fallback}"
        elif u.executor == "plan" and plan is not None:
            d.why = (f"the planner predicted {plan.policy} on {streams} stream(s) fastest "
                     f"({plan.predicted_step_time * 1e3:.3f} ms, serial "
                     f"{plan.serial_time * 1e3:.3f} ms)")  # fmt: skip
        else:
            d.why = next((p.note for p in reversed(u.provenance) if p.stage == "verdict"),
                         f"runs {u.executor}")  # fmt: skip
        d.measured = _measured(calls, u.tag)
        out.append(d)
    return out


def _measured(calls, tag: str) -> dict[str, tuple[float, str]]:
    """Median measured ms of ``tag``'s calls per executor, and how many: its last 50 calls
    on each (the first call, which compiles, and re-profiles excluded)."""
    if calls is None or len(calls) == 0:
        return {}
    rows = calls[calls["graph"] == tag]
    rows = rows[~rows["executor"].isin(["compile", "profiler"])]
    out = {}
    for name, g in rows.groupby("executor", sort=False):
        xs = [float(x) for x in g["measured_s"].tail(50) if x == x]
        if xs:
            out[str(name)] = (statistics.median(xs) * 1e3, f"median of {len(xs)} calls")
    return out


# -- the final screen --------------------------------------------------------------------------
WIDTH = 100  # characters per line of the final screen


def _wrap(label: str, text: str, indent: int = 2) -> list[str]:
    """``text`` under a 10-character ``label`` column, wrapped to :data:`WIDTH`."""
    lead = " " * indent + (f"{label:<10} " if indent else "")
    return textwrap.wrap(text, WIDTH, initial_indent=lead,
                         subsequent_indent=" " * len(lead)) or [lead]  # fmt: skip


def final_screen(ex, decisions: list[GraphDecision], info: dict[str, Any]) -> str:
    """The demo's last screen: the ladder and verdicts, per recorded graph its decision
    (:func:`graph_decisions`), then the loss agreement, the step times and the files
    written. ``info`` holds ``model``, ``agree``/``agreement``, ``times`` (contender ->
    (median ms, steps) or None; ``untimed`` says how to time the None ones), ``window``
    (which steps were timed), ``settled`` and ``files`` (what -> path).

    Example::

        >>> print(final_screen(ex, graph_decisions(ex, calls), info))  # doctest: +SKIP
    """
    bar = "=" * WIDTH
    lines = [bar, f"autopar demo ({info['model']}): what the compiler decided", bar]
    head = f"{len(ex.rungs) or 1} Dynamo graph(s), {ex.graph_breaks} graph break(s)"
    if ex.compile_seconds:
        head += f"; the first call (capture, profile, plan, codegen) took " \
                f"{ex.compile_seconds:.1f} s"
    lines.append(head + f"; executor ladder: {', '.join(ex.ladder)}")
    for sig, (verdict, why) in ex.steps.items():
        lines += _wrap("", f"whole steps {sig}: {verdict or 'still racing'} ({why}); the judge "
                       "times whole steps of each executor, interleaved, and keeps the "
                       "fastest", indent=0)  # fmt: skip
    for tag, rungs in ex.rungs.items():
        lines.append("")
        lines.append(f"{tag}: the ladder")
        for name, status in rungs.items():
            lines += _wrap(name, status or "not tried")
    for d in decisions:
        lines.append("")
        executor, _, detail = d.chosen.partition(" ")
        lines.append(f"{d.tag} ({d.phase}, {d.ops} ops)   runs: "
                     f"{executor.upper()} {detail}".rstrip())  # fmt: skip
        lines += _wrap("why", d.why)
        meas = ", ".join(f"{k} {ms:.3f} ms ({how})" for k, (ms, how) in d.measured.items())
        meas = meas or "no timed calls"
        pred = f"{d.predicted_ms:.3f} ms (the plan)" if d.predicted_ms is not None else "-"
        lines += _wrap("time", f"predicted {pred}; measured {meas}")
    lines.append("")
    lines += _wrap("", f"loss curves, eager vs autopar (same seed, same batches): "
                   f"{'AGREE' if info['agree'] else 'DISAGREE'} ({info['agreement']})", 0)
    times = info["times"]
    eager = times.get("eager")
    parts = []
    for name, v in times.items():
        if v is None:
            parts.append(f"{name} not timed" + (f" ({info['untimed']})" if info.get("untimed")
                                                 else ""))  # fmt: skip
            continue
        ratio = f", {eager[0] / v[0]:.2f}x eager" if eager and name != "eager" else ""
        parts.append(f"{name} {v[0]:.2f} ms{ratio}")
    lines += _wrap("", f"step time (median, {info['window']}): " + " | ".join(parts), 0)
    if not info.get("settled", True):
        lines += _wrap("NOTE", "autopar had not settled (builds compiling or the judge still "
                       "racing) when the demo ended: run more --steps or a larger --settle-s")
    lines.append("")
    lines.append(f"files in {info['out']}:")
    width = max(map(len, info["files"]), default=0)
    lines += [f"  {k:<{width}} : {v}" for k, v in info["files"].items()]
    lines.append(bar)
    return "\n".join(lines)
