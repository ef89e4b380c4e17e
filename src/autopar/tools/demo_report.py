"""What ``autopar demo`` says at the end: for each captured graph, the executor candidates
that were measured and their times, the one chosen and why, predicted against measured
time, and the tiers that landed and when.

Everything comes from the public API: ``autopar.explain`` (each graph's provenance stamps:
``measure`` for the first call's multi-stream-vs-serial timing, ``tier`` for the Inductor
tier's; the race verdicts; the tier events), ``autopar.stats(per="graph")`` (every graph
call's measured time) and :class:`Watch`, which notes at which training step each decision
appeared.

Example::

    >>> watch = Watch(inductor=False)
    >>> watch.look(cmodel, step=0, seconds=2.1)                      # doctest: +SKIP
    >>> rows = graph_decisions(autopar.explain(cmodel), autopar.stats(cmodel, per="graph"),
    ...                        watch)                                # doctest: +SKIP
    >>> rows[0].chosen                                               # doctest: +SKIP
    'plan (serial)'
"""

from __future__ import annotations

import re
import statistics
from dataclasses import dataclass, field
from typing import Any

# The notes the pipeline and the tiers stamp (autopar.pipeline, autopar.runtime.tiers). If
# their wording changes, the screen shows the raw note instead of the parsed numbers.
_NUM = r"([\d.]+|inf)"
_MEASURE = re.compile(rf"measured at first call: (\S+) on (\d+) streams {_NUM} ms vs serial "
                      rf"{_NUM} ms")  # fmt: skip
_TIER = re.compile(r"(?P<cands>.+?) vs (?P<cur>\S+) (?P<cur_ms>[\d.]+|inf) ms \(ready "
                   r"(?P<ready>[\d.]+) s after the first call\): (?P<what>.+)$")  # fmt: skip
_CANDIDATE = re.compile(r"(\S+) ([\d.]+|inf) ms")


def _ms(text: str) -> float:
    return float(text)  # "inf" parses: a candidate that failed to run


def _fmt_ms(x: float | None) -> str:
    if x is None:
        return "-"
    return "failed" if x == float("inf") else f"{x:.3f} ms"


def _failed(ex, tag: str) -> str | None:
    """The tier event saying ``tag``'s Inductor compile failed, without the tag, or None."""
    return next((e.split(": ", 1)[-1] for e in ex.tiers
                 if e.startswith(f"{tag}:") and "could not compile" in e), None)  # fmt: skip


class Watch:
    """Notes, step by step, when each graph's Inductor tier was decided and when each input
    signature's race got its verdict, and says when autopar has *settled*: every race has a
    verdict and every tier has landed, lost or failed (or cannot: the race runs whole steps
    eagerly, so the graphs are no longer called).

    Example::

        >>> w = Watch(inductor=True)
        >>> w.settled                                 # nothing seen yet
        False
    """

    def __init__(self, inductor: bool):
        self.inductor = inductor
        self.tiers: dict[str, tuple[int, float]] = {}  # tag -> (step, s after 1st step)
        self.verdicts: dict[str, tuple[int, str]] = {}  # signature -> (step, verdict)
        self.settled = False
        self.events: list[str] = []  # one line per decision, as it happened

    def look(self, cmodel, step: int, seconds: float) -> list[str]:
        """Read ``cmodel``'s decisions after training step ``step`` (0-based), ``seconds``
        after autopar's first step began; returns the decisions new since the last look."""
        import autopar

        ex = autopar.explain(cmodel)
        new = []
        for u in ex.graphs:
            stamp = next((p for p in reversed(u.provenance) if p.stage == "tier"), None)
            failed = _failed(ex, u.tag)
            if u.tag not in self.tiers and (stamp is not None or failed):
                self.tiers[u.tag] = (step, seconds)
                note = stamp.note if stamp is not None else failed
                new.append(f"step {step + 1}: {u.tag}: Inductor tier {note}")
        for sig, (verdict, why) in ex.steps.items():
            if verdict is None:
                self.verdicts.pop(sig, None)  # racing (again, after a tier landed)
            elif self.verdicts.get(sig, (0, None))[1] != verdict:
                self.verdicts[sig] = (step, verdict)
                new.append(f"step {step + 1}: race {sig}: {why}")
        self.settled = self._settled(ex)
        self.events += new
        return new

    def _settled(self, ex) -> bool:
        if not ex.graphs or any(v is None for v, _ in ex.steps.values()):
            return False
        if not self.inductor or ex.steps and all(v == "eager" for v, _ in ex.steps.values()):
            return True  # eager steps never call the graphs: no tier can land any more
        return all(u.fallback or u.tag in self.tiers for u in ex.graphs)


@dataclass
class GraphDecision:
    """One graph's line of the final screen (see :func:`graph_decisions`)."""

    tag: str
    phase: str
    ops: int
    candidates: list[tuple[str, float | None, str]] = field(default_factory=list)
    chosen: str = ""
    why: str = ""
    predicted_ms: float | None = None
    measured: dict[str, tuple[float, str]] = field(default_factory=dict)  # executor -> ms, how
    tiers: list[str] = field(default_factory=list)


def _streams_used(plan) -> int:
    return len(set(dict(plan.placements).values())) if plan is not None else 0


def _plural(n: int, word: str) -> str:
    return f"{n} {word}{'s' if n != 1 else ''}"


@dataclass(frozen=True)
class TierVerdict:
    """A ``tier`` stamp, parsed: each background candidate's measured ms (``inductor``, ...),
    the executor it was measured against and its ms, when the candidate was ready, and which
    one landed (None: the current executor was kept).

    Example::

        >>> v = parse_tier("inductor 1.000 ms vs plan 2.000 ms (ready 9.5 s after the first "
        ...                "call): inductor landed")
        >>> v.candidates, v.current, v.landed
        ((('inductor', 1.0),), 'plan', 'inductor')
    """

    candidates: tuple[tuple[str, float], ...]
    current: str
    current_ms: float
    ready_s: float
    landed: str | None


def parse_tier(note: str | None) -> TierVerdict | None:
    """The :class:`TierVerdict` of a ``tier`` stamp's note, None if it is not one (the
    wording of ``autopar.runtime.tiers``, old and new). Example: see :class:`TierVerdict`."""
    m = _TIER.search(note or "")
    if not m:
        return None
    cands = tuple((name, _ms(ms)) for name, ms in _CANDIDATE.findall(m["cands"]))
    what = m["what"].strip()
    landed = None if what.startswith("kept") else (
        what.split()[0] if what != "landed" else cands[0][0] if cands else "inductor")  # fmt: skip
    return TierVerdict(cands, m["cur"], _ms(m["cur_ms"]), float(m["ready"]), landed)


def graph_decisions(ex, calls, watch: Watch | None = None) -> list[GraphDecision]:
    """Per graph of the :class:`~autopar.inspection.Explanation` ``ex``: candidates, choice,
    reason, prediction, measured call times (``calls`` is ``autopar.stats(cmodel,
    per="graph")``; the median of each executor's last 50 calls) and tier history.

    Example: see the module docstring."""
    eager_steps = bool(ex.steps) and all(v == "eager" for v, _ in ex.steps.values())
    out = []
    for u in ex.graphs:
        d = GraphDecision(u.tag, u.phase, sum(1 for n in u.gm.graph.nodes
                                               if n.op == "call_function"))  # fmt: skip
        plan = u.plan
        if plan is not None:
            d.predicted_ms = plan.predicted_step_time * 1e3
        measure = next((p.note for p in u.provenance if p.stage == "measure"), None)
        tier = next((p.note for p in reversed(u.provenance) if p.stage == "tier"), None)
        when = watch.tiers.get(u.tag) if watch is not None else None
        m, t = _MEASURE.search(measure or ""), parse_tier(tier)
        if m:
            d.candidates += [(f"{m[1]} plan on {m[2]} streams", _ms(m[3]), "first call"),
                             ("serial plan", _ms(m[4]), "first call")]  # fmt: skip
        elif measure:
            d.candidates.append((measure, None, "first call"))
        at = f"step {when[0] + 1}" if when else "a later call"
        if t:
            d.candidates += [(name, ms, at) for name, ms in t.candidates]
            d.candidates.append((f"{t.current} (running then)", t.current_ms, at))
        elif tier:
            d.candidates.append((tier, None, "tier"))
        if plan is not None and not d.candidates:
            d.candidates.append((f"{plan.policy} plan on "
                                 f"{_plural(_streams_used(plan), 'stream')}", None,
                                 "predicted only"))  # fmt: skip
        d.chosen = u.executor + (f" ({plan.policy} plan)" if u.executor == "plan" and plan
                                 else "")  # fmt: skip
        state = _tier_state(u, t, tier, _failed(ex, u.tag), eager_steps, watch)
        d.why = _why(u, m, measure, t, state)
        d.measured = _measured(calls, u.tag, final=u.executor)
        if t is not None and t.current not in d.measured:  # e.g. the plan, replaced at once
            d.measured[t.current] = (t.current_ms, f"timed against the tier at {at}")
        d.tiers = _tier_history(u, t, state, when)
        out.append(d)
    return out


def _tier_state(u, t, tier, failed, eager_steps: bool, watch) -> str:
    """What became of the graph's background tier, as a clause (empty when one landed)."""
    if t is not None and t.landed:
        return ""
    if t is not None:
        times = ", ".join(f"{n} {_fmt_ms(ms)}" for n, ms in t.candidates)
        return (f"the background tier measured {times} against {t.current}'s "
                f"{_fmt_ms(t.current_ms)}: not faster by the landing margin, so "
                f"{t.current} stays")  # fmt: skip
    if failed:
        return f"the background tier failed: {failed}"
    if tier:
        return tier
    if watch is None or not watch.inductor:
        return "no Inductor tier (off)"
    if u.fallback:
        return ""
    if eager_steps:
        return ("its Inductor tier was never measured: the race runs whole steps eagerly, "
                "so the graph is not called any more")
    return "its Inductor tier was still compiling when the demo ended"


def _why(u, m, measure, t, state: str) -> str:
    """Why ``u`` runs on its executor, in one sentence built from its stamps."""
    if u.fallback:
        return f"autopar could not plan it, so it runs as captured: {u.fallback}"
    landed = ""
    if t is not None and t.landed and u.executor == t.landed:
        ms = dict(t.candidates).get(t.landed)
        landed = (f"the {t.landed} tier, compiled in the background, measured {_fmt_ms(ms)} "
                  f"against the {t.current} program's {_fmt_ms(t.current_ms)} on the real "
                  "inputs: faster by the landing margin, so it replaced it")  # fmt: skip
    plan = u.plan
    if plan is None:
        return landed or f"runs on {u.executor}"
    if m:
        kept = plan.policy != "serial"
        first = (f"at the first call the {m[1]} plan on {m[2]} streams measured "
                 f"{_fmt_ms(_ms(m[3]))} against serial {_fmt_ms(_ms(m[4]))}: "
                 + ("faster, so the multi-stream plan runs" if kept
                    else "not faster by the required margin, so the serial plan runs"))  # fmt: skip
    elif measure:
        first = measure
    else:
        first = (f"the planner predicted {plan.policy} on "
                 f"{_plural(_streams_used(plan), 'stream')} fastest "
                 f"({plan.predicted_step_time * 1e3:.3f} ms, serial "
                 f"{plan.serial_time * 1e3:.3f} ms), so there was no multi-stream program "
                 "to measure against")  # fmt: skip
    if landed:  # what ran before it, and why
        return f"{landed}. Before that, {first}"
    return first + (f"; {state}" if state else "")


def _measured(calls, tag: str, final: str = "") -> dict[str, tuple[float, str]]:
    """Median measured ms of ``tag``'s calls per executor, and how many calls: its last 50
    calls on each (the first call, which compiles, and re-profiles excluded). An executor
    other than ``final`` ran before a tier replaced it, while that tier compiled."""
    if calls is None or len(calls) == 0:
        return {}
    rows = calls[calls["graph"] == tag]
    if "executor" in rows:
        rows = rows[~rows["executor"].isin(["compile", "profiler"])]
        groups = {str(k): g for k, g in rows.groupby("executor", sort=False)}
    else:  # an autopar without the executor column: every timed call together
        groups = {final or "all": rows[rows["ratio"] == rows["ratio"]]}
    out = {}
    for name, g in groups.items():
        xs = [float(x) for x in g["measured_s"].tail(50) if x == x]
        if xs:
            how = f"median of {_plural(len(xs), 'call')}"
            if final and name != final:
                how += ", before it was replaced, while the tier compiled in another process"
            out[name] = (statistics.median(xs) * 1e3, how)
    return out


def _tier_history(u, t, state: str, when) -> list[str]:
    first = ("captured graph" if u.fallback else
             f"{u.plan.policy} plan" if u.plan is not None else "not planned")  # fmt: skip
    lines = [f"step 1: {first} (the first call profiles, plans, generates and measures)"]
    at = (f"step {when[0] + 1}, {when[1]:.1f} s after autopar's first step" if when
          else "a later call")  # fmt: skip
    if t is not None:
        what = f"{t.landed} landed" if t.landed else f"kept {t.current}"
        names = "/".join(n for n, _ in t.candidates) or "background"
        lines.append(f"{at}: {what} ({names} compiled in another process, ready "
                     f"{t.ready_s:.1f} s after the first call)")  # fmt: skip
    elif state and not state.startswith("no Inductor"):
        lines.append(state[0].upper() + state[1:])
    return lines


# -- the final screen --------------------------------------------------------------------------
WIDTH = 100  # characters per line of the final screen


def _wrap(label: str, text: str, indent: int = 2) -> list[str]:
    """``text`` under a 10-character ``label`` column, wrapped to :data:`WIDTH`."""
    import textwrap

    lead = " " * indent + (f"{label:<10} " if indent else "")
    return textwrap.wrap(text, WIDTH, initial_indent=lead,
                         subsequent_indent=" " * len(lead)) or [lead]  # fmt: skip


def final_screen(ex, decisions: list[GraphDecision], info: dict[str, Any]) -> str:
    """The demo's last screen: per graph its decisions (:func:`graph_decisions`), then the
    loss agreement, the step times and the files written. ``info`` holds ``model``,
    ``agree``/``agreement``, ``times`` (contender -> (median ms, steps) or None; ``untimed``
    says how to time the None ones), ``window`` (which steps were timed), ``settled`` and
    ``files`` (what -> path).

    Example::

        >>> print(final_screen(ex, graph_decisions(ex, calls, watch), info))  # doctest: +SKIP
    """
    bar = "=" * WIDTH
    lines = [bar, f"autopar demo ({info['model']}): what the compiler decided", bar]
    head = f"{len(ex.graphs)} graph(s), {ex.graph_breaks} graph break(s)"
    if ex.compile_seconds:
        head += f"; the first call (capture, profile, plan, codegen, measure) took " \
                f"{ex.compile_seconds:.1f} s"
    lines.append(head)
    for sig, (verdict, why) in ex.steps.items():
        lines += _wrap("", f"whole steps {sig}: {verdict or 'still racing'} ({why}); the race "
                       "times whole eager steps against whole compiled ones and keeps the "
                       "faster", indent=0)  # fmt: skip
    for d in decisions:
        lines.append("")
        executor, _, detail = d.chosen.partition(" ")
        lines.append(f"{d.tag} ({d.phase}, {d.ops} ops)   chosen: "
                     f"{executor.upper()} {detail}".rstrip())  # fmt: skip
        for i, (name, ms, when) in enumerate(d.candidates):
            label = "candidates" if i == 0 else ""
            lines.append(f"  {label:<10} {name:<32} {_fmt_ms(ms) if ms is not None else '':>10}"
                         f"   ({when})")  # fmt: skip
        lines += _wrap("why", d.why)
        meas = ", ".join(f"{k} {ms:.3f} ms ({how})" for k, (ms, how) in d.measured.items())
        meas = meas or "no timed calls"
        pred = f"{d.predicted_ms:.3f} ms (the plan)" if d.predicted_ms is not None else "-"
        lines += _wrap("time", f"predicted {pred}; measured {meas}")
        for i, t in enumerate(d.tiers):
            lines += _wrap("tiers" if i == 0 else "", t)
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
        lines += _wrap("NOTE", "autopar had not settled (tiers compiling or the race open) "
                       "when the demo ended: run more --steps or a larger --settle-s")  # fmt: skip
    lines.append("")
    lines.append(f"files in {info['out']}:")
    width = max(map(len, info["files"]), default=0)
    lines += [f"  {k:<{width}} : {v}" for k, v in info["files"].items()]
    lines.append(bar)
    return "\n".join(lines)
