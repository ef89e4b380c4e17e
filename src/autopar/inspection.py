"""What the compiler decided, as data: ``autopar.explain(cmodel)`` returns an
:class:`Explanation` (like ``torch._dynamo.explain``): per Dynamo graph the ladder of
executors with each one's verdict; per input signature the judge's verdict and its step
times; per recorded graph its executor, plan and provenance. ``print(ex)`` shows a short
summary; ``ex.source`` (or ``ex.text(verbose=True)``) every program that runs. In a
notebook the bare expression shows the summary.

Example::

    >>> ex = autopar.explain(cmodel)                        # doctest: +SKIP
    >>> print(ex)                                           # doctest: +SKIP
    >>> ex.graphs[0].executor, ex.steps                     # doctest: +SKIP
    ('inductor', {'[16, 32] float32; train, 2 threads': ('inductor', 'median step ...')})
"""

from __future__ import annotations

from dataclasses import dataclass, field

from autopar.adapt.shapes import describe_key
from autopar.capture.backend import GraphUnit

_EMPTY = "# nothing compiled yet: call the model once (and .backward()) first\n"
#: Lines of events the summary shows (the latest); ``ex.events`` has them all.
EVENTS_SHOWN = 6


@dataclass(frozen=True)
class Explanation:
    """A compiled module's decisions. ``str(ex)`` is the summary; ``ex.source`` the
    programs."""

    graphs: tuple[GraphUnit, ...] = ()
    steps: dict[str, tuple[str | None, str]] = field(default_factory=dict)  # signature ->
    events: tuple[str, ...] = ()  # one line per build and verdict
    compile_seconds: float | None = None  # the first call: capture + profile + plan
    graph_breaks: int = 0  # Dynamo graphs - 1 (each break splits the model's code)
    ladder: tuple[str, ...] = ()
    # Dynamo graph tag -> executor -> what became of it ("racing", "not offered: ...", ...)
    rungs: dict[str, dict[str, str]] = field(default_factory=dict)
    # Dynamo graph tag -> what runs its autograd.Function: "direct" (autopar's own,
    # ``capture.direct_autograd``), "direct, native" (its two native programs as one C++
    # autograd function: ``runtime.native_direct``) or "AOTAutograd (<why>)".
    autograd: dict[str, str] = field(default_factory=dict)

    @property
    def fallbacks(self) -> dict[str, str]:
        """Graph tag -> why it runs as captured."""
        return {u.tag: u.fallback for u in self.graphs if u.fallback}

    def summary(self) -> str:
        if not self.graphs:
            return _EMPTY
        lines = [
            f"# autopar: {len(self.rungs) or len(self.graphs)} Dynamo graph(s), "
            f"{self.graph_breaks} graph break(s)"
            + (f", first call {self.compile_seconds:.2f} s" if self.compile_seconds else ""),
            f"# ladder: {', '.join(self.ladder)}",
        ]
        for sig, (verdict, why) in self.steps.items():
            lines.append(f"# steps {sig}: " + (f"{verdict} ({why})" if verdict else why))
        for tag, rungs in self.rungs.items():
            how = self.autograd.get(tag)
            how = how if how is None or how.startswith("direct") else f"through {how}"
            lines.append(f"# {tag}" + (f" (autograd {how})" if how else "") + ":")
            lines += [f"#   {name}: {status or 'not tried'}" for name, status in rungs.items()]
        for u in self.graphs:
            plan = u.plan
            what = (f"plan {plan.policy} on {len(plan.streams) or 1} stream(s), predicted "
                    f"{plan.predicted_step_time * 1e3:.3f} ms" if plan is not None
                    else "not planned")  # fmt: skip
            lines.append(f"# {u.tag}: runs {u.executor}; {what}"
                         + (f"; fallback: {u.fallback}" if u.fallback else ""))  # fmt: skip
        shown = self.events[-EVENTS_SHOWN:]
        if len(self.events) > len(shown):
            lines.append(f"# ... {len(self.events) - len(shown)} earlier events in ex.events")
        lines += [f"# {e}" for e in shown]
        return "\n".join(lines) + "\n"

    @property
    def source(self) -> str:
        """The exact source of the program each graph runs, in capture order."""
        parts = []
        for u in self.graphs:
            if u.program is not None:
                parts.append(u.program.source)
            else:
                why = u.fallback or "not planned"
                parts.append(f"# {u.tag}: runs the captured graph as it is ({why})\n{u.gm.code}")
        return "\n\n".join(parts)

    def text(self, verbose: bool = False) -> str:
        """The summary; ``verbose``: followed by every program's source."""
        if not verbose or not self.graphs:
            return self.summary()
        return self.summary() + "\n" + self.source

    def __str__(self) -> str:
        return self.summary()

    def _repr_pretty_(self, printer, cycle) -> None:  # IPython: the summary, not a dump
        printer.text(self.summary())

    def __contains__(self, text: str) -> bool:
        return text in self.text(verbose=True)


def explanation(pipeline) -> Explanation:
    """The :class:`Explanation` of one model's pipeline (``autopar.pipeline.Pipeline``)."""
    units = tuple(r.unit for r in pipeline.records)
    rt = pipeline._runtime
    steps = {describe_key(k): v for k, v in rt.judge.report().items()} if rt else {}
    graphs = pipeline.capture.dynamo_graphs
    return Explanation(
        graphs=units,
        steps=steps,
        events=tuple(rt.events) if rt else (),
        compile_seconds=pipeline.compile_seconds,
        graph_breaks=max(0, len({u.group for u in units}) - 1),
        ladder=tuple(pipeline.ladder),
        rungs={g.tag: _rungs(rt, g) for g in graphs} if rt else {},
        autograd={g.tag: g.autograd + (", native" if getattr(g.captured, "native", None) else "")
                  for g in graphs},  # fmt: skip
    )


def _rungs(rt, graph) -> dict[str, str]:
    """Each executor of the ladder and what became of it for ``graph``: the runtime's
    status, with "racing" told as the verdict or a lost race once the judge decided."""
    gs = rt.graph_state(graph)
    if gs is None:
        return dict.fromkeys(rt.ladder, "")
    verdict = rt.judge.verdict(gs.key)
    out = {}
    for n in rt.ladder:
        status = gs.status.get(n, "")
        if verdict is not None and status.endswith("racing"):
            status = status.removesuffix("racing") + ("the verdict" if n == verdict
                                                      else "lost the race")  # fmt: skip
        out[n] = status
    return out
