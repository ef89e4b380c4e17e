"""What the compiler decided, as data: ``autopar.explain(cmodel)`` returns an
:class:`Explanation` (like ``torch._dynamo.explain``): per graph its executor, plan,
prediction, measurements, fallback and provenance; per input signature the verdict of the
eager/compiled race; the tiers that landed; graph breaks. ``print()`` gives a summary
followed by the exact source of every program that runs.

Example::

    >>> ex = autopar.explain(cmodel)                        # doctest: +SKIP
    >>> print(ex.summary())                                 # doctest: +SKIP
    >>> ex.graphs[0].executor, ex.steps                     # doctest: +SKIP
    ('inductor', {'[16, 32] float32; train, 2 threads': ('compiled', 'median step: ...')})
"""

from __future__ import annotations

from dataclasses import dataclass, field

from autopar.adapt.shapes import describe_key
from autopar.capture.backend import GraphUnit

_EMPTY = "# nothing compiled yet: call the model once (and .backward()) first\n"


@dataclass(frozen=True)
class Explanation:
    """A compiled module's decisions. ``str(ex)`` is the summary plus every program."""

    graphs: tuple[GraphUnit, ...] = ()
    steps: dict[str, tuple[str | None, str]] = field(default_factory=dict)  # signature ->
    tiers: tuple[str, ...] = ()  # one line per tier that landed, lost or failed
    compile_seconds: float | None = None  # the first call: capture + profile + plan
    graph_breaks: int = 0  # Dynamo graphs - 1 (each break splits the model's code)
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
            f"# autopar: {len(self.graphs)} graphs, {self.graph_breaks} graph breaks"
            + (f", first call {self.compile_seconds:.2f} s" if self.compile_seconds else "")
        ]
        for sig, (verdict, why) in self.steps.items():
            lines.append(f"# steps with input signature {sig}: " + (
                f"{verdict} ({why})" if verdict else why))  # fmt: skip
        for tag, how in self.autograd.items():
            lines.append(f"# {tag}: autograd " + (
                "direct (autopar's autograd.Function; AOTAutograd's runtime wrapper skipped)"
                if how == "direct" else
                "direct, native (both native programs as one C++ autograd function)"
                if how == "direct, native" else f"through {how}"))  # fmt: skip
        for u in self.graphs:
            plan = u.plan
            what = (
                f"plan {plan.policy}, predicted {plan.predicted_step_time * 1e3:.3f} ms"
                if plan is not None else "no plan"
            )  # fmt: skip
            lines.append(f"# {u.tag}: executor {u.executor}; {what}"
                         + (f"; fallback: {u.fallback}" if u.fallback else ""))  # fmt: skip
            for p in u.provenance:
                if p.stage in ("measure", "tier") and p.note:
                    lines.append(f"#   {p.stage}: {p.note}")
        lines += [f"# tier {e}" for e in self.tiers]
        return "\n".join(lines) + "\n"

    @property
    def source(self) -> str:
        """The exact source of the program each graph runs, in capture order."""
        parts = []
        for u in self.graphs:
            if u.program is not None:
                parts.append(u.program.source)
            else:
                why = u.fallback or "not run yet"
                parts.append(f"# {u.tag}: runs the captured graph as it is ({why})\n{u.gm.code}")
        return "\n\n".join(parts)

    def __str__(self) -> str:
        return self.summary() if not self.graphs else self.summary() + "\n" + self.source

    def __contains__(self, text: str) -> bool:
        return text in str(self)


def explanation(pipeline) -> Explanation:
    """The :class:`Explanation` of one model's pipeline (``autopar.pipeline.Pipeline``)."""
    units = tuple(r.unit for r in pipeline.records)
    steps = {describe_key(k): v for k, v in pipeline.race.report().items()}
    groups = {u.group for u in units}
    return Explanation(
        graphs=units,
        steps=steps,
        tiers=tuple(pipeline.tiers.events) if pipeline.tiers is not None else (),
        compile_seconds=pipeline.compile_seconds,
        graph_breaks=max(0, len(groups) - 1),
        autograd={g.tag: g.autograd + (", native" if getattr(g.runner, "native", None) else "")
                  for g in pipeline.capture.dynamo_graphs},  # fmt: skip
    )
