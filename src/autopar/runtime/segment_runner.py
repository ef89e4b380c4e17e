"""The segment executor as a tier candidate: plan a graph for Inductor segments, fill
Inductor's cache for them in another process, and compile them here.

A segment program (``autopar.codegen.segments``) compiles one Inductor graph per segment,
seconds each on a 2-core box: too slow for a step boundary of the training process. As
for the whole-graph tier (``codegen.inductor.start_warmup``), a separate process compiles
the same segments from the same stand-ins and plan, filling the FX graph cache; the
training process then compiles at a step boundary and hits the cache. The plan is made
here and travels as JSON: the child must cut exactly the same segments (a plan made there
would use that process's machine calibration).

Example::

    >>> gm, tag, meta = record.gm, record.tag, input_meta(args)     # doctest: +SKIP
    >>> plan = segment_plan(gm, record.table, tag)                  # doctest: +SKIP
    >>> proc = start_segment_warmup(gm, meta, plan, tag)            # doctest: +SKIP
    >>> proc.wait()                                                 # doctest: +SKIP
    >>> prog = compile_segment_tier(gm, meta, plan, tag)  # a cache hit  # doctest: +SKIP
"""

from __future__ import annotations

import dataclasses
import os
import sys
import tempfile

import torch
import torch.fx as fx

from autopar.capture.backend import node_key
from autopar.codegen.emit import Program
from autopar.codegen.inductor import stand_ins
from autopar.codegen.segments import (
    SEGMENT_CALL_S,
    compile_segments,
    cut_segments,
    refine_for_segments,
    segment_makespan,
)
from autopar.codegen.warmup import load_warmup_job, spawn_warmup
from autopar.planning.partition import make_plan
from autopar.planning.plan import Plan, Stream


def segment_plan(gm: fx.GraphModule, table, tag: str, *, store=None, streams: int = 2):
    """A plan for the segment executor, or None when it would use one stream: HEFT on
    ``streams`` 1-thread CPU streams (each segment runs single-threaded, concurrently with
    the others), refined by :func:`~autopar.codegen.segments.refine_for_segments`."""
    ones = [Stream(i, "cpu", 1) for i in range(streams)]
    plan = make_plan(table, streams=ones, policy="heft", graph_id=tag, store=store)
    refined, _ = refine_for_segments(gm, plan, tag)
    return refined if len({s for _, s in refined.placements}) > 1 else None


#: The segment tier is a candidate only when the cost model predicts its cut at least this
#: many times faster than the same segments run one after another. Below that, the waits
#: and the fusion lost at each boundary (not in the model) eat the gain, and a background
#: compile of many segments (seconds each) is not worth its core.
SEGMENT_MIN_GAIN = 1.2
#: ... and only when it saves at least this much per call (a smaller saving does not pay
#: for the wake-ups the model leaves out) with at most this many segments (each is one
#: Inductor compile: 5-15 s cold on a 2-core box, all spent by the background process).
SEGMENT_MIN_SAVING_S = 100e-6
SEGMENT_MAX_COUNT = 12


def segment_candidate(gm: fx.GraphModule, table, tag: str, *, streams: int = 2):
    """The plan the segment tier would run, or None when the cost model rules it out: a
    single stream, a predicted gain below :data:`SEGMENT_MIN_GAIN` or a saving below
    :data:`SEGMENT_MIN_SAVING_S`, or more than :data:`SEGMENT_MAX_COUNT` segments. Costs
    are the plan's simulated op times, pointwise ops at 0 (Inductor fuses them away)."""
    if table is None or len(table) == 0:
        return None
    plan = segment_plan(gm, table, tag, streams=streams)
    if plan is None:
        return None
    times = {k: c for k, _, _, c in plan.timeline}
    cut = cut_segments(gm, plan, tag)
    cost = {}
    for seg in cut.segments:
        for n in seg.nodes:
            tags = getattr(n.target, "tags", ()) if n.op == "call_function" else ()
            fused = torch.Tag.pointwise in tags
            cost[n] = 0.0 if fused else times.get(node_key(tag, n.name), 0.0)
    one_stream = sum(cost.values()) + SEGMENT_CALL_S
    makespan = segment_makespan(cut, cost)
    if len(cut.segments) > SEGMENT_MAX_COUNT or one_stream - makespan < SEGMENT_MIN_SAVING_S:
        return None
    return plan if one_stream >= SEGMENT_MIN_GAIN * makespan else None


def compile_segment_tier(gm: fx.GraphModule, meta: list, plan: Plan, tag: str) -> Program:
    """``compile_segments`` on stand-ins of ``meta`` (``codegen.inductor.input_meta``):
    the same inputs the warm-up process compiles from, so their cache keys agree."""
    return compile_segments(gm, plan, stand_ins(meta), tag=tag)


def start_segment_warmup(gm: fx.GraphModule, meta: list, plan: Plan, tag: str):
    """Queue the compile of ``plan``'s segments of ``gm`` in the warm-up process
    (``codegen.warmup``, low priority; the job is this module's ``_warmup_main``); returns
    the job's handle."""
    fd, path = tempfile.mkstemp(prefix="autopar-segments-", suffix=".pt")
    os.close(fd)
    names = [n.name for n in gm.graph.nodes]
    job = {"gm": gm, "names": names, "meta": meta, "plan": plan.to_json(), "tag": tag}
    torch.save(job, path)
    return spawn_warmup("autopar.runtime.segment_runner", path)


def _rekey(plan: Plan, key: dict) -> Plan:
    syncs = tuple(dataclasses.replace(s, src=key[s.src], dst=key[s.dst]) for s in plan.syncs)
    return plan.replace(
        placements=tuple(sorted((key.get(k, k), s) for k, s in plan.placements)),
        order=tuple(key.get(k, k) for k in plan.order), syncs=syncs,
    )  # fmt: skip


def _warmup_main(path: str, parent: int | None = None) -> int:
    import torch._higher_order_ops.triton_kernel_wrap  # noqa: F401 - see below
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.passes.fake_tensor_prop import FakeTensorProp

    job = load_warmup_job(path, parent)
    # Unpickling a make_fx graph re-traces it (with make_fx's tracer, which reads
    # triton_kernel_wrap without importing it, torch 2.13): the same nodes in the same
    # order, renamed, without meta["val"]. The plan follows the nodes by position; fake
    # propagation restores the metadata. Inductor's cache keys do not see node names
    # (``prepare`` re-traces every segment), so the keys agree with the parent's.
    gm, tag = job["gm"], job["tag"]
    nodes = list(gm.graph.nodes)  # strict: a different node count is a different graph
    key = {
        node_key(tag, a): node_key(tag, n.name) for a, n in zip(job["names"], nodes, strict=True)
    }
    FakeTensorProp(gm, FakeTensorMode(allow_non_fake_inputs=True)).propagate(
        *stand_ins(job["meta"])
    )
    compile_segment_tier(gm, job["meta"], _rekey(Plan.from_json(job["plan"]), key), tag)
    return 0


if __name__ == "__main__":
    # Through the package module, not __main__: the pickled TensorMeta names that class.
    from autopar.runtime.segment_runner import _warmup_main as main

    sys.exit(main(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else None))
