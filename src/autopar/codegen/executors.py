"""Which emitter turns a (graph, plan) into a program: one table, one entry per executor.

``generate(gm, plan, tag)`` is what the pipeline and users call. A new executor is one module
with a ``generate``-like function plus one entry in :data:`EXECUTORS`.

| executor      | program                                                             |
|---------------|---------------------------------------------------------------------|
| ``python``    | straight-line code, CPU worker streams or CUDA streams (``python``)  |
| ``torchscript`` | scripted segments with fork/wait; falls back to ``python`` with a note |
| ``auto``      | ``torchscript`` for CPU plans with several streams, else ``python``   |
| ``native``    | the C++ stream interpreter (``native``); falls back to ``python`` with a note |

Example::

    >>> prog = generate(gm, plan, "g0.fw")  # doctest: +SKIP
    >>> print(prog.source)                  # doctest: +SKIP
"""

from __future__ import annotations

import os
from collections.abc import Callable

import torch.fx as fx

from autopar.codegen.emit import Program
from autopar.codegen.native import Unsupported, generate_native
from autopar.codegen.python import generate_python
from autopar.codegen.torchscript import generate_ts, wanted
from autopar.planning.plan import Plan


def _torchscript(gm, plan, tag, *, provenance, cuda_graph, timeout_s, executor) -> Program:
    if not cuda_graph and wanted(gm, plan, tag, executor):
        return generate_ts(gm, plan, tag, provenance=provenance, timeout_s=timeout_s)
    return generate_python(
        gm, plan, tag, provenance=provenance, cuda_graph=cuda_graph, timeout_s=timeout_s
    )


def _python(gm, plan, tag, *, provenance, cuda_graph, timeout_s, executor) -> Program:
    return generate_python(
        gm, plan, tag, provenance=provenance, cuda_graph=cuda_graph, timeout_s=timeout_s
    )


def _native(gm, plan, tag, *, provenance, cuda_graph, timeout_s, executor) -> Program:
    if not cuda_graph:
        try:
            return generate_native(gm, plan, tag, provenance=provenance)
        except Unsupported as e:
            note = f"native executor not used: {e}"
    prog = generate_python(
        gm, plan, tag, provenance=provenance, cuda_graph=cuda_graph, timeout_s=timeout_s
    )
    if not cuda_graph:
        prog.notes = (*prog.notes, note)
    return prog


#: executor name -> emitter(gm, plan, tag, *, provenance, cuda_graph, timeout_s, executor)
EXECUTORS: dict[str, Callable[..., Program]] = {
    "python": _python,
    "torchscript": _torchscript,
    "auto": _torchscript,  # ``wanted`` decides: several CPU streams -> torchscript
    "native": _native,
}


def generate(
    gm: fx.GraphModule,
    plan: Plan,
    tag: str,
    *,
    provenance: dict | None = None,
    cuda_graph: bool = False,
    timeout_s: float = 0.0,
    executor: str | None = None,
) -> Program:
    """Generate the program that runs graph ``gm`` (tagged ``tag``) as ``plan`` says.

    ``provenance`` adds lines to the header (e.g. ``{"store": "profiles/x.json"}``).
    ``cuda_graph=True`` raises (use ``torch.compile(mode="reduce-overhead")``'s CUDA graph
    trees; autopar's own capture path was unsound and is removed). ``timeout_s``
    bounds one cross-stream wait (default ``autopar.runtime.streams.DEFAULT_TIMEOUT_S``).
    ``executor`` (default ``$AUTOPAR_EXECUTOR`` or ``"python"``): a key of
    :data:`EXECUTORS`.
    """
    executor = executor or os.environ.get("AUTOPAR_EXECUTOR") or "python"
    if executor not in EXECUTORS:
        raise ValueError(f"executor must be one of {sorted(EXECUTORS)}, not {executor!r}")
    return EXECUTORS[executor](
        gm, plan, tag, provenance=provenance, cuda_graph=cuda_graph, timeout_s=timeout_s,
        executor=executor,
    )  # fmt: skip
