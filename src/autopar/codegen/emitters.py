"""Which emitter turns a (graph, plan) into a program: one table, one entry per emitter.

``generate(gm, plan, tag)`` is what the ``plan`` executor and users call. A new emitter is
one module with a ``generate``-like function plus one entry in :data:`EMITTERS`.

| emitter   | program                                                                   |
|-----------|---------------------------------------------------------------------------|
| ``python``| straight-line Python: CPU worker streams or CUDA streams (``python``)     |
| ``native``| the C++ stream interpreter's instruction lists (``native``), CPU graphs;   |
|           | falls back to ``python`` with a note                                       |

Example::

    >>> prog = generate(gm, plan, "g0.fw")  # doctest: +SKIP
    >>> print(prog.source)                  # doctest: +SKIP
"""

from __future__ import annotations

from collections.abc import Callable

import torch.fx as fx

from autopar.codegen.emit import Program
from autopar.codegen.native import Unsupported, generate_native
from autopar.codegen.python import generate_python, traced_devices
from autopar.planning.plan import Plan


def _python(gm, plan, tag, *, provenance, cuda_graph, timeout_s) -> Program:
    return generate_python(
        gm, plan, tag, provenance=provenance, cuda_graph=cuda_graph, timeout_s=timeout_s
    )


def _native(gm, plan, tag, *, provenance, cuda_graph, timeout_s) -> Program:
    if not cuda_graph:
        try:
            return generate_native(gm, plan, tag, provenance=provenance)
        except Unsupported as e:
            note = f"native program not used: {e}"
    prog = generate_python(
        gm, plan, tag, provenance=provenance, cuda_graph=cuda_graph, timeout_s=timeout_s
    )
    if not cuda_graph:
        prog.notes = (*prog.notes, note)
    return prog


#: emitter name -> emitter(gm, plan, tag, *, provenance, cuda_graph, timeout_s)
EMITTERS: dict[str, Callable[..., Program]] = {"python": _python, "native": _native}


def generate(
    gm: fx.GraphModule,
    plan: Plan,
    tag: str,
    *,
    provenance: dict | None = None,
    cuda_graph: bool = False,
    timeout_s: float = 0.0,
    emitter: str = "python",
) -> Program:
    """Generate the program that runs graph ``gm`` (tagged ``tag``) as ``plan`` says.

    ``provenance`` adds lines to the header (e.g. ``{"store": "profiles/x.json"}``).
    ``cuda_graph=True`` raises (use ``torch.compile(mode="reduce-overhead")``'s CUDA graph
    trees; autopar's own capture path was unsound and is removed). ``timeout_s``
    bounds one cross-stream wait (default ``autopar.runtime.streams.DEFAULT_TIMEOUT_S``).
    ``emitter``: a key of :data:`EMITTERS`; a plan with a CUDA stream always gets the Python
    program (the native interpreter runs CPU streams only).
    """
    if emitter not in EMITTERS:
        raise ValueError(f"emitter must be one of {sorted(EMITTERS)}, not {emitter!r}")
    if any(getattr(s, "device", "cpu").startswith("cuda") for s in plan.streams) or any(
            d.startswith("cuda") for d in traced_devices(gm)):  # fmt: skip
        emitter = "python"  # the native interpreter runs CPU streams only
    return EMITTERS[emitter](
        gm, plan, tag, provenance=provenance, cuda_graph=cuda_graph, timeout_s=timeout_s
    )  # fmt: skip
