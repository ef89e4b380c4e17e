"""autopar's stream assignment as Inductor's per-node stream annotation.

Inductor (torch 2.13) places a node on a side stream when its FX node carries
``node.meta["custom"]["stream"] = <index>``: ``GraphLowering._get_node_stream`` reads it
while lowering, ``Scheduler._populate_stream_assignments`` maps each distinct index to a
side stream of the generated wrapper, which fetches the stream object at run time with
``torch._dynamo.graph_bytecode_inputs.get_external_object_by_index(index)``. No annotation
(``None``) means the default (caller's) stream. So the index names a *registered stream
object*, not a stream number: whoever compiles the annotated graph registers one stream
per index (Dynamo does it for streams in user code; outside Dynamo,
``graph_bytecode_inputs.set_external_object_by_index``).

Inductor does not derive cross-stream waits from the annotation: Dynamo emits
``torch.ops.streams.record_event`` / ``wait_event`` nodes for the events of user code, and
AOTAutograd inserts them for backward nodes (``torch._functorch._aot_autograd.streams``).
:func:`annotate_streams` therefore also leaves, in ``gm.meta["autopar.stream_syncs"]``, the
kernel-to-kernel waits autopar's own CUDA program would do (``codegen.cuda.device_waits``:
views and other metadata-only ops never wait or signal), as ``(producer, consumer)``
node-name pairs, for the caller to turn into event nodes.

Example::

    >>> gm = annotate_streams(gm, plan, "g0.bw")                        # doctest: +SKIP
    >>> {n.name: n.meta["custom"]["stream"] for n in gm.graph.nodes
    ...  if "stream" in n.meta.get("custom", {})}                        # doctest: +SKIP
    {'mm_1': 0, 'relu': 0}
"""

from __future__ import annotations

from collections.abc import Mapping

import torch.fx as fx

from autopar.codegen.cuda import device_waits
from autopar.codegen.emit import schedule
from autopar.planning.plan import Plan

__all__ = ["annotate_streams"]


def annotate_streams(
    gm: fx.GraphModule, plan: Plan, tag: str, stream_index: Mapping[int, int] | None = None
) -> fx.GraphModule:
    """Annotate ``gm``'s nodes (in place; ``gm`` is returned) with ``plan``'s streams.

    Every compute node the plan puts on a stream other than the main one (the stream the
    generated program runs on the caller's stream, ``codegen.emit.schedule``'s ``main``)
    gets ``node.meta["custom"]["stream"] = stream_index[stream id]``; main-stream nodes get
    no annotation (a stale one from an earlier call is removed). ``stream_index`` maps
    plan stream ids to registry indices (default: the side streams in first-use order,
    0, 1, ...). Also sets ``gm.meta["autopar.stream_index"]`` (that mapping) and
    ``gm.meta["autopar.stream_syncs"]`` (see the module docstring). Raises
    ``PlanError`` for a plan that does not fit the graph, as codegen does.
    """
    sched = schedule(gm, plan, tag, True)
    side = sched.stream_ids[1:]
    index = dict(stream_index) if stream_index is not None else {s: i for i, s in enumerate(side)}
    missing = [s for s in side if s not in index]
    if missing:
        raise ValueError(f"annotate_streams: stream_index has no entry for streams {missing}")
    for n in sched.compute:
        custom = n.meta.get("custom")
        s = sched.stream[n]
        if s == sched.main:
            if isinstance(custom, dict):
                custom.pop("stream", None)
            continue
        if not isinstance(custom, dict):
            custom = n.meta["custom"] = dict(custom or {})
        custom["stream"] = index[s]
    dev = device_waits(sched, plan, tag)
    gm.meta["autopar.stream_index"] = {s: index[s] for s in side}
    gm.meta["autopar.stream_syncs"] = [
        (p.name, n.name) for n in sched.compute for p in dev.waits.get(n, ())
    ]
    return gm
