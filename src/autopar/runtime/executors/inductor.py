"""The ``inductor`` executor: a whole Dynamo graph, forward and backward together, compiled
by Inductor's own pipeline (``compile_fx``, :mod:`autopar.codegen.joint`), exactly as
``torch.compile`` compiles it. It is the judge's reference: keeping it is never slower than
``torch.compile``.

Why the whole Dynamo graph: its forward saves other tensors for its backward than autopar's
planned forward does (``torch.compile`` decomposes the joint graph and partitions it with
the min-cut partitioner), so the two halves are one executor, chosen together.

The cold compile runs in the background (the warm-up worker, :mod:`autopar.codegen.warmup`,
fills Inductor's FX graph cache); the training process then compiles at a step boundary
and hits the cache. The swap is safe between any two calls: each call's backward is the one
of the ``autograd.Function`` its own forward ran.

Example::

    >>> warm, build = parts(graph.gm, args, "g0")          # doctest: +SKIP
    >>> job = warm(); job.wait(); prog = build()           # doctest: +SKIP
    >>> out = prog.fn(*args)                               # doctest: +SKIP
"""

from __future__ import annotations

from autopar.codegen.inductor import input_meta, stand_ins
from autopar.codegen.joint import compile_joint, roles, start_joint_warmup, with_roles


def trains(records: list) -> bool:
    """Whether AOTAutograd traced this Dynamo graph for training (a ``g<k>.fw`` forward with
    a backward). An inference graph (``g<k>.inf``) keeps what captured it."""
    return any(r.tag.endswith(".fw") for r in records)


def why_not(graph, args: list, records: list, profile) -> str | None:
    """Why the ``inductor`` executor cannot run Dynamo graph ``graph`` (None: it can)."""
    if not trains(records):
        return "an inference graph (no backward to compile with it)"
    return None


def parts(graph, args: list, profile=None):
    """``(warm, build)``: the background compile and the compile here, both from stand-ins
    of ``args`` (their shapes, strides, dtypes and roles; no data is kept)."""
    gm, tag = graph.gm, graph.tag
    meta, kinds = input_meta(args), roles(args)

    def inputs() -> list:
        return with_roles(stand_ins(meta), kinds)

    return (lambda: start_joint_warmup(gm, inputs(), tag)), (
        lambda: compile_joint(gm, inputs(), tag=tag))
