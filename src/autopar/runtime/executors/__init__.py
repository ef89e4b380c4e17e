"""The executor ladder: every way a training step can run a Dynamo graph, in one table.

An *executor* runs a Dynamo graph, forward and backward. The ladder is the ordered tuple of
executors a model may use (``autopar.compile(model, executors=...)``, default
:data:`DEFAULT_LADDER`); which one runs each step is the judge's verdict
(``autopar.runtime.judge``), decided in ``autopar.runtime.decide``. This table is the
truth: a new executor is one module here and one entry in :data:`TABLE`.

| executor   | what runs the step                                                 | built      |
|------------|--------------------------------------------------------------------|------------|
| ``eager``  | the user's module, eagerly: no Dynamo, no compile (the safety net) | nothing    |
| ``plan``   | autopar's planned programs for the forward and backward graphs      | first call |
|            | (native stream interpreter or Python; ``codegen``), through        |            |
|            | AOTAutograd's runtime or autopar's ``capture.direct_autograd``      |            |
| ``inductor``| ``torch.compile``'s own pipeline for the graph (``executors.inductor``) | Inductor |
| ``split``  | two half batches on two threads (``executors.split``)               | Inductor   |

``eager`` and ``plan`` have nothing to build per graph: ``eager`` steps run the whole module
without Dynamo, and ``plan`` is what the capture itself runs (each graph is profiled,
planned and generated at its first call). Not on the ladder, ``plan``'s graphs run as
AOTAutograd captured them, op by op, and are not profiled.

Example::

    >>> ladder(("eager", "inductor"))
    ('eager', 'inductor')
    >>> TABLE["split"].builds
    True
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from autopar.runtime.executors import inductor, split


@dataclass(frozen=True)
class Executor:
    """One rung. ``why_not(graph, args, records, profile)``: why it cannot run (or cannot
    win on) a Dynamo graph, None where it may; ``parts(graph, args, profile)``: ``(warm,
    build)``, the background compile and the compile here, whose program's ``fn(*args)``
    runs the graph (differentiable). ``cost_s``: its build cost, a rough cold compile time
    per graph node on a 2-core CPU (``explain`` shows it while it compiles)."""

    name: str
    summary: str
    why_not: Callable[..., str | None] | None = None
    parts: Callable[..., Any] | None = None
    cost_s: float = 0.0

    @property
    def builds(self) -> bool:
        """Whether it compiles a program per graph (else nothing to build)."""
        return self.parts is not None


#: name -> executor, in ladder order.
TABLE: dict[str, Executor] = {
    "eager": Executor("eager", "the module run eagerly, no compile"),
    "plan": Executor("plan", "autopar's planned programs (profiled, planned, generated)"),
    "inductor": Executor("inductor", "torch.compile's pipeline (Inductor, whole graph)",
                         inductor.why_not, inductor.parts, cost_s=0.05),
    "split": Executor("split", "two half batches on two threads (Inductor, one thread each)",
                      split.why_not, split.parts, cost_s=0.06),
}  # fmt: skip
#: The ladder when neither ``executors=`` nor ``$AUTOPAR_EXECUTORS`` names one.
DEFAULT_LADDER = ("eager", "plan", "inductor", "split")
#: ``AUTOPAR_EXECUTORS=eager,plan``: the ladder of models that do not pass ``executors=``.
ENV = "AUTOPAR_EXECUTORS"


def ladder(names: Any = None) -> tuple[str, ...]:
    """The ladder ``names`` asks for (a sequence of executor names, or a comma-separated
    string), else ``$AUTOPAR_EXECUTORS``, else :data:`DEFAULT_LADDER`; in table order.
    Raises ``ValueError`` naming an unknown executor and the known ones."""
    if names is None:
        names = os.environ.get(ENV) or DEFAULT_LADDER
    if isinstance(names, str):
        names = [n.strip() for n in names.split(",") if n.strip()]
    names = tuple(names)
    unknown = [n for n in names if n not in TABLE]
    if unknown or not names:
        raise ValueError(f"executors={names!r}: unknown {unknown or 'empty ladder'}; choose "
                         f"from {', '.join(TABLE)} (default {','.join(DEFAULT_LADDER)})")
    return tuple(n for n in TABLE if n in names)
