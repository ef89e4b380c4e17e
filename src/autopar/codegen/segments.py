"""The segment executor: a multi-stream plan whose every stream runs Inductor-compiled
*segments* (maximal runs of one stream's nodes), with one synchronisation per segment
boundary instead of one per op.

Why: Inductor's C++ wrapper (``cpp_wrapper=True``) runs a whole compiled graph without
the GIL, so two compiled segments called from two Python threads really overlap (two
pointwise graphs, 1 thread each: concurrent/sequential 0.61 with the C++ wrapper, 1.05
with the Python one). The per-op worker-stream program (``codegen.python``) holds the GIL
between ops; Inductor's fused kernels are faster per op but run one graph on one thread.

Cutting (:func:`cut_segments`). Nodes are walked in plan order. A node joins the open
segment of its stream when every other-stream segment it depends on (data, the eager order
of buffer writes, plan syncs) is already ordered before that segment's start; otherwise it
opens a new segment on its stream, which waits for those segments. A segment that another
one waits for is closed (the next node of its stream opens a new one), so a wait never
covers work the plan ran after the value was needed. Segments are numbered in creation
order and every dependency points from a lower to a higher number: the segment DAG is
acyclic and the streams cannot deadlock. Waits implied by earlier ones are not emitted.

Effects. As in ``codegen.python``: random ops must keep their graph order in the plan
(``PlanError`` otherwise) and run on the calling thread's stream, so the global generator is
consumed as in eager (Inductor compiles with ``fallback_random``: eager's dropout kernel).
Nodes that write a buffer in place also run on that stream, so writes and random draws stay
on one thread in eager order; readers of a written buffer keep their eager order around the
write through segment waits. ``getitem`` nodes always join their producer's segment (a
tuple never crosses a boundary: compiled segments take and return tensors).

Compiling. Each segment becomes a sub-``GraphModule`` (inputs: the values it reads from
outside, in graph order; outputs: what anything outside reads, as a tuple) compiled by
:func:`autopar.codegen.inductor.compile_inductor` with the C++ wrapper and ``cpp.threads``
set to its stream's intra-op thread count (Inductor bakes the OpenMP thread count into its
kernels; a 2-thread kernel on a 1-thread stream would oversubscribe the core the other
stream uses). Example inputs: the parent's example args for its placeholders; for values
made by another segment, stand-ins with the strides that segment's compiled code returns
(compiled in creation order, producers first; Inductor chooses its outputs' layouts).

Planning for segments (:func:`refine_for_segments`). A per-op plan prices a cross-stream
edge at one Event handoff and often alternates parallel branches between streams op by
op; here each alternation is a boundary. The refinement moves whole segments between
streams while a segment-level simulation (:func:`segment_makespan`) says it pays.

The program (``Program.source``) is readable Python calling ``_seg<k>`` per segment:
stream 0 (or the first stream) on the calling thread, the others on persistent worker
threads (``autopar.runtime.streams.run_streams``), values crossing streams in per-call
slots, one event per segment another stream waits for.

Example::

    >>> prog = compile_segments(gm, plan, args, tag="g0.fw")   # doctest: +SKIP
    >>> out = prog.fn(*args)              # what gm(*args) returns  # doctest: +SKIP
    >>> print(prog.source)                # the segments and their waits  # doctest: +SKIP
"""

from __future__ import annotations

import inspect
import operator
import time
from dataclasses import dataclass, field

import torch
import torch.fx as fx

from autopar.capture.analysis import buffer_analysis, is_op, is_rng, write_orderings
from autopar.capture.backend import node_key
from autopar.codegen.emit import (
    PROGRAM_IMPORTS,
    RESERVED,
    Namer,
    Program,
    Stmt,
    fmt,
    load_source,
    program_counter,
    prologue,
    provenance_header,
    schedule,
    with_deletes,
)
from autopar.codegen.inductor import TensorMeta, compile_inductor, stand_ins
from autopar.errors import PlanError, describe_node
from autopar.planning.plan import Plan, Sync


@dataclass(eq=False)
class Segment:
    """One compiled unit: ``nodes`` (plan order) of stream ``stream``.

    ``waits``: the other-stream segments it waits for before it starts (implied waits
    removed); ``after``: indices of every segment ordered before it (transitively)."""

    index: int
    stream: int
    nodes: list[fx.Node] = field(default_factory=list)
    waits: list[Segment] = field(default_factory=list)
    after: set[int] = field(default_factory=set)
    inputs: list[fx.Node] = field(default_factory=list)
    outputs: list[fx.Node] = field(default_factory=list)
    program: Program | None = None


@dataclass
class Cut:
    segments: list[Segment]
    stream: dict[fx.Node, int]
    main: int
    stream_ids: list[int]  # main first, then the other streams that run a segment
    notes: list[str]


def _is_getitem_of(n: fx.Node, stream: dict) -> bool:
    return (
        n.op == "call_function" and n.target is operator.getitem
        and isinstance(n.args[0], fx.Node) and n.args[0] in stream
    )  # fmt: skip


def _dependencies(nodes, compute, base: dict, writes: dict, plan: Plan, tag: str) -> dict:
    """Each compute node's predecessors: data inputs, the eager order of the readers and
    writers of every written buffer (``schedule`` already checked the plan keeps it) and
    the plan's syncs."""
    placed = set(compute)
    deps: dict[fx.Node, set] = {n: {p for p in n.all_input_nodes if p in placed} for n in compute}
    gpos = {n: i for i, n in enumerate(nodes)}
    for first, second, _, _ in write_orderings(compute, base, writes, gpos):
        if first in deps and second in deps:
            deps[second].add(first)
    by_key = {node_key(tag, n.name): n for n in compute}
    for s in plan.syncs:
        src, dst = by_key.get(s.src), by_key.get(s.dst)
        if src is not None and dst is not None:
            deps[dst].add(src)
    return deps


def _walk_order(compute, stream: dict, deps: dict, base: dict, writes: dict) -> list:
    """Plan order, in groups that always share a segment: a node with the nodes that
    cost nothing and only relabel one input, moved next to the node that gives them a
    reason to exist and onto its stream.

    * ``getitem`` of a tuple: right after its producer (a tuple never crosses a boundary).
    * A view or alias (``t``, ``view``, ``detach``...; ``buffer_analysis`` says it shares
      its input's buffer) of a buffer nothing writes: right after its input when another
      node makes that input, else (a view of a graph input, e.g. a weight's ``t``) right
      before its first consumer. A per-op plan places such nodes wherever a stream was
      free; in a compiled segment they are free, but a view on the wrong stream costs a
      segment boundary.

    ``stream`` is updated for the moved nodes; their other dependencies must not come
    later in plan order than where they move (else they stay, or a getitem raises)."""
    pos = {n: i for i, n in enumerate(compute)}
    written = {b for bufs in writes.values() for b in bufs}
    after: dict[fx.Node, list] = {}
    before: dict[fx.Node, list] = {}
    anchor: dict[fx.Node, fx.Node] = {}
    for n in compute:
        getitem = _is_getitem_of(n, stream)
        ins = n.all_input_nodes
        view = base[n] is not n and n not in writes and base[n] not in written and len(ins) == 1
        if not (getitem or view) or is_rng(n):
            continue
        (p,) = ins
        if p in pos:
            if any(q is not p and pos[q] > pos[p] for q in deps[n]):
                if getitem:
                    raise PlanError(
                        f"{describe_node(n)} must run after a node the plan runs after its "
                        f"producer {p.name}: the segment executor keeps a getitem with its "
                        "producer. Use the python executor for this graph."
                    )
                continue
            after.setdefault(p, []).append(n)
            anchor[n] = p
            deps[p] |= deps[n] - {p}  # the producer's segment waits for what n needs
        else:
            users = sorted((u for u in n.users if u in pos), key=pos.__getitem__)
            if users and not deps[n]:
                before.setdefault(users[0], []).append(n)
                anchor[n] = users[0]

    def home(n):  # the stream of the node a moved node sits next to
        while n in anchor:
            n = anchor[n]
        return stream[n]

    def emit(n, group):
        for b in before.get(n, ()):
            emit(b, group)
        group.append(n)
        for a in after.get(n, ()):
            emit(a, group)
        return group

    groups = [emit(n, []) for n in compute if n not in anchor]
    for group in groups:
        for n in group:
            stream[n] = home(n)
    return groups


@dataclass
class _Prepared:
    """What every cut of one (graph, plan) shares: validated once, re-cut many times."""

    nodes: list[fx.Node]
    compute: list[fx.Node]  # plan order
    stream: dict[fx.Node, int]  # the plan's placement, random ops and writes on main
    main: int
    ids: list[int]  # the plan's stream ids
    notes: list[str]
    deps: dict[fx.Node, set]
    base: dict
    writes: dict
    pinned: set[fx.Node]  # random ops and in-place writes: always on main


def _prepare(gm: fx.GraphModule, plan: Plan, tag: str) -> _Prepared:
    sched = schedule(gm, plan, tag, cuda=False)  # validates; moves RNG ops to main
    nodes = list(gm.graph.nodes)
    stream, main, notes = dict(sched.stream), sched.main, list(sched.notes)
    base, writes = buffer_analysis(nodes)
    for n in writes:
        if n in stream and stream[n] != main and not is_rng(n):
            # in-place writes beside random draws on one thread, in eager order: a write
            # never races a read of another stream's compiled segment
            notes.append(f"in-place op {node_key(tag, n.name)} moved from stream "
                         f"{stream[n]} to stream {main}")  # fmt: skip
            stream[n] = main
    pinned = {n for n in sched.compute if is_rng(n) or n in writes}
    deps = _dependencies(nodes, sched.compute, base, writes, plan, tag)
    ids = [s.id for s in plan.streams]
    return _Prepared(nodes, sched.compute, stream, main, ids, notes, deps, base, writes, pinned)


def cut_segments(gm: fx.GraphModule, plan: Plan, tag: str) -> Cut:
    """Cut ``gm`` into segments for ``plan`` (see the module docstring for the rule).

    Raises ``PlanError`` for plans no program may run (not topological, random ops or
    buffer writes out of eager order) and for a ``getitem`` that cannot join its producer.

    Example::

        >>> cut = cut_segments(gm, plan, "g0.fw")                 # doctest: +SKIP
        >>> [(s.stream, len(s.nodes)) for s in cut.segments]      # doctest: +SKIP
        [(0, 20), (1, 19), (0, 5)]
    """
    prep = _prepare(gm, plan, tag)
    return _cut(prep, prep.stream)


def _cut(prep: _Prepared, placement: dict) -> Cut:
    stream = {n: prep.main if n in prep.pinned else placement[n] for n in prep.compute}
    deps = {n: set(d) for n, d in prep.deps.items()}  # _walk_order adds to them
    groups = _walk_order(prep.compute, stream, deps, prep.base, prep.writes)
    segs: list[Segment] = []
    open_seg: dict[int, Segment | None] = {}
    last: dict[int, Segment] = {}
    seg_of: dict[fx.Node, Segment] = {}
    for group in groups:
        s = stream[group[0]]
        need = {seg_of[p] for n in group for p in deps[n]
                if p in seg_of and seg_of[p].stream != s}  # fmt: skip
        cur = open_seg.get(s)
        if cur is None or any(P.index not in cur.after for P in need):
            prev = last.get(s)
            cur = Segment(len(segs), s)
            for P in need | ({prev} if prev else set()):
                cur.after |= P.after | {P.index}
            implied = set(prev.after) if prev else set()
            for P in need:
                implied |= P.after
            cur.waits = sorted((P for P in need if P.index not in implied),
                               key=lambda P: P.index)  # fmt: skip
            for P in need:  # closed: later work of P's stream must not delay this wait
                if open_seg.get(P.stream) is P:
                    open_seg[P.stream] = None
            open_seg[s] = last[s] = cur
            segs.append(cur)
        cur.nodes += group
        seg_of.update(dict.fromkeys(group, cur))

    gpos = {n: i for i, n in enumerate(prep.nodes)}
    for seg in segs:
        inside = set(seg.nodes)
        ins = {p for n in seg.nodes for p in n.all_input_nodes if p not in inside}
        seg.inputs = sorted(ins, key=gpos.__getitem__)
        seg.outputs = [n for n in seg.nodes if any(u not in inside for u in n.users)]
        seg.outputs.sort(key=gpos.__getitem__)
    used = {seg.stream for seg in segs}
    ids = [prep.main] + [s for s in prep.ids if s != prep.main and s in used]
    return Cut(segs, stream, prep.main, ids, list(prep.notes))


def _check_boundaries(cut: Cut) -> None:
    for seg in cut.segments:
        for o in seg.outputs:
            if not isinstance(o.meta.get("val"), torch.Tensor):
                raise PlanError(
                    f"{describe_node(o)} (not a tensor) would cross a segment boundary; "
                    "the segment executor passes tensors only. Use the python executor."
                )


#: The segment executor's own costs, for :func:`refine_for_segments` (2-core box, torch
#: 2.13, quiet): calling a compiled C++-wrapper graph from Python costs 3.4 us (tensor
#: handles in and out); an empty two-stream ``run_streams`` with one wait 23 us. A wait
#: is priced above that: a boundary also ends Inductor's fusion across it.
SEGMENT_CALL_S = 5e-6
SEGMENT_WAIT_S = 30e-6


def segment_makespan(cut: Cut, cost: dict, call_s=SEGMENT_CALL_S, wait_s=SEGMENT_WAIT_S):
    """Predicted time of ``cut``'s program: each stream runs its segments in order, a
    segment starts when its stream is free and the segments it waits for are done (plus
    ``wait_s``), and takes ``call_s`` plus its nodes' ``cost`` (seconds; missing: 0)."""
    end: dict[int, float] = {}
    free: dict[int, float] = {}
    for seg in cut.segments:  # creation order: waited-for segments come first
        start = free.get(seg.stream, 0.0)
        for P in seg.waits:
            start = max(start, end[P.index] + wait_s)
        end[seg.index] = start + call_s + sum(cost.get(n, 0.0) for n in seg.nodes)
        free[seg.stream] = end[seg.index]
    return max(end.values(), default=0.0)


def refine_for_segments(gm: fx.GraphModule, plan: Plan, tag: str, *, max_trials: int = 400):
    """``plan`` with whole segments, and single heavy nodes, moved between streams while
    that shortens :func:`segment_makespan` (first-improvement hill climbing; the plan's
    order is kept). Returns ``(plan, note)``.

    A per-op plan (HEFT) balances eager op costs and prices a cross-stream edge at one
    Event handoff, so it often alternates parallel branches between streams op by op; for
    compiled segments each alternation is a boundary (a call, a wait, fusion lost), and
    the ops Inductor fuses away (pointwise ops, views) cost nothing: balance is decided by
    the others. Costs: the plan's simulated timeline, 0 for those fused away.

    Example::

        >>> plan2, note = refine_for_segments(gm, plan, "g0.fw")   # doctest: +SKIP
        >>> note                                                   # doctest: +SKIP
        'segments: 11 -> 3, predicted 1.71 -> 1.32 ms'
    """
    prep = _prepare(gm, plan, tag)
    key = {n: node_key(tag, n.name) for n in prep.compute}
    times = {k: c for k, _, _, c in plan.timeline}
    fused = {n for n in prep.compute if prep.base[n] is not n
             or (is_op(n) and torch.Tag.pointwise in n.target.tags)}  # fmt: skip
    cost = {n: 0.0 if n in fused else times.get(key[n], 0.0) for n in prep.compute}
    heavy = [[n] for n in sorted(prep.compute, key=lambda n: -cost[n])
             if cost[n] > 0 and n not in prep.pinned]  # fmt: skip
    place = dict(prep.stream)
    cut = _cut(prep, place)
    best = first = segment_makespan(cut, cost)
    n_first, trials, improved = len(cut.segments), 0, True
    while improved and trials < max_trials:
        improved = False
        # cheap segments first (the alternations worth removing), then single heavy nodes
        segs = sorted(cut.segments, key=lambda g: sum(cost[n] for n in g.nodes))
        for nodes in [g.nodes for g in segs] + heavy:
            for other in (s for s in prep.ids if s != cut.stream[nodes[0]]):
                trial = dict(place)
                trial.update(dict.fromkeys(nodes, other))
                trial_cut = _cut(prep, trial)
                t = segment_makespan(trial_cut, cost)
                trials += 1
                if t < best * (1 - 1e-6):
                    place, cut, best, improved = trial, trial_cut, t, True
                    break
            if improved or trials >= max_trials:
                break
    placement = dict(plan.placement)
    placement.update({key[n]: s for n, s in cut.stream.items()})
    syncs = tuple(
        Sync(key[p], key[n], cut.stream[p], cut.stream[n])
        for n in prep.compute for p in n.all_input_nodes
        if p in cut.stream and cut.stream[p] != cut.stream[n]
    )  # fmt: skip
    note = (f"segments: {n_first} -> {len(cut.segments)}, predicted "
            f"{first * 1e3:.2f} -> {best * 1e3:.2f} ms")  # fmt: skip
    refined = plan.replace(placements=tuple(sorted(placement.items())), syncs=syncs,
                           notes=plan.notes + (note,))  # fmt: skip
    return refined, note


def segment_module(gm: fx.GraphModule, seg: Segment) -> fx.GraphModule:
    """The sub-graph of ``seg``: a placeholder per input, its nodes, a tuple of outputs."""
    g = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for p in seg.inputs:
        env[p] = g.placeholder(p.name)
        env[p].meta = dict(p.meta)
    for n in seg.nodes:
        env[n] = g.node_copy(n, env.__getitem__)
    g.output(tuple(env[o] for o in seg.outputs))
    return fx.GraphModule(gm, g, f"segment{seg.index}")


def _example(p: fx.Node, parent_args: dict, made: dict) -> object:
    """An example input of a segment: the parent's for its placeholders; for a value made
    by another segment, a stand-in with the strides that segment's compiled code returns
    (``made``). Inductor's ``compile_fx_inner`` picks the layouts of a graph's outputs
    itself (only ``torch.compile``'s outer layer pins them to the fx graph's), and a
    compiled consumer checks its inputs' strides: meta["val"] is not the layout to use."""
    if p in parent_args:
        return parent_args[p]
    v = p.meta.get("val")
    if not isinstance(v, torch.Tensor):
        return v
    stride = made.get(p, tuple(v.stride()))
    return stand_ins([TensorMeta(tuple(v.shape), stride, v.dtype, str(v.device))])[0]


def _output_strides(prog: Program, seg: Segment) -> dict:
    """The strides ``prog`` (a compiled segment) returns its outputs with, as Inductor
    recorded them (static shapes: the strings are integers); {} where not recorded."""
    compiled = inspect.getclosurevars(prog.fn).nonlocals.get("compiled")
    strides = getattr(compiled, "output_strides", None) or []
    if len(strides) != len(seg.outputs):
        return {}
    return {o: tuple(int(x) for x in st) for o, st in zip(seg.outputs, strides, strict=True)
            if st is not None}  # fmt: skip


def compile_segments(
    gm: fx.GraphModule,
    plan: Plan,
    example_args: list,
    *,
    tag: str,
    provenance: dict | None = None,
    timeout_s: float = 0.0,
) -> Program:
    """Compile each of ``plan``'s segments of ``gm`` with Inductor's C++ wrapper and return
    the multi-stream :class:`Program` that runs them (``fn(*args)`` returns what
    ``gm(*args)`` returns). ``example_args``: real tensors or
    ``stand_ins(input_meta(args))``, one per placeholder. Synchronous (a cold compile is
    seconds per segment); call it on the thread that runs the model."""
    from torch._inductor import config

    if any(s.device != "cpu" for s in plan.streams):  # CUDA streams: codegen.cuda's job
        raise PlanError(f"the segment executor runs CPU plans only, not {plan.streams}")
    t0 = time.perf_counter()
    cut = cut_segments(gm, plan, tag)
    _check_boundaries(cut)
    nodes = list(gm.graph.nodes)
    placeholders = [n for n in nodes if n.op == "placeholder"]
    if len(placeholders) != len(example_args):
        raise ValueError(f"{len(example_args)} example args for {len(placeholders)} inputs")
    parent = dict(zip(placeholders, example_args, strict=True))
    for n in nodes:  # get_attr values are inputs of the program (read at call time)
        if n.op == "get_attr":
            parent[n] = operator.attrgetter(n.target)(gm)
    cap = torch.get_num_threads()  # a program never uses more threads than its caller
    threads = {s.id: min(s.threads, cap) if s.threads > 0 else cap for s in plan.streams}
    made: dict[fx.Node, tuple] = {}  # segment output -> the strides its code returns
    for seg in cut.segments:  # creation order is topological: producers compile first
        sub = segment_module(gm, seg)
        args = [_example(p, parent, made) for p in seg.inputs]
        # Inductor bakes the OpenMP thread count into its kernels (num_threads(k))
        with config.patch({"cpp.threads": threads[seg.stream]}):
            try:
                seg.program = compile_inductor(sub, args, tag=f"{tag}.s{seg.index}",
                                               cpp_wrapper=True)  # fmt: skip
            except Exception as exc:  # noqa: BLE001 - see below
                # The C++ wrapper cannot emit some fallback kernels (torch 2.13:
                # ``bernoulli_.float`` loses its ``p``); Inductor's Python wrapper can, at
                # the price of holding the GIL between its kernels.
                seg.program = compile_inductor(sub, args, tag=f"{tag}.s{seg.index}")
                cut.notes.append(f"segment {seg.index}: Python wrapper (C++ wrapper "
                                 f"failed: {type(exc).__name__})")  # fmt: skip
        made.update(_output_strides(seg.program, seg))
    seconds = time.perf_counter() - t0
    return _emit(gm, plan, tag, cut, threads, provenance, timeout_s, seconds)


def _emit(gm, plan, tag, cut: Cut, threads, provenance, timeout_s, seconds) -> Program:
    namer = Namer()
    namer.globals["_gm"] = gm
    nodes = list(gm.graph.nodes)
    local = {n: n.name + "_" if n.name in RESERVED else n.name for n in nodes}
    inputs = [n for n in nodes if n.op in ("placeholder", "get_attr")]
    idx = {n: i for i, n in enumerate(inputs)}
    (out_node,) = [n for n in nodes if n.op == "output"]
    seg_of = {n: seg for seg in cut.segments for n in seg.nodes}
    ev_of: dict[Segment, int] = {}
    for seg in cut.segments:
        for P in seg.waits:
            ev_of.setdefault(P, len(ev_of))
    slots: dict[tuple[fx.Node, int], int] = {}  # (value, consumer stream) -> slot
    for seg in cut.segments:
        for p in seg.inputs:
            if p in seg_of and seg_of[p].stream != seg.stream:
                slots.setdefault((p, seg.stream), len(slots))
    for p in out_node.all_input_nodes:
        if p in seg_of and seg_of[p].stream != cut.main:
            slots.setdefault((p, cut.main), len(slots))
    ref = lambda n: local[n]
    serial = len(cut.stream_ids) == 1
    lines: list[str] = []
    owners: list = []  # the segment each line calls (tracebacks name it)
    for sid in cut.stream_ids:
        stmts = [] if serial else [Stmt("v, ev, w, a = st.v, st.ev, st.wait, st.args")]
        have: set[fx.Node] = set()

        def take(p, sid=sid, stmts=stmts, have=have):
            if p in have:
                return
            have.add(p)
            if p in idx and not serial:
                stmts.append(Stmt(f"{local[p]} = a[{idx[p]}]", (), local[p]))
            elif p in seg_of and seg_of[p].stream != sid:
                k = slots[(p, sid)]  # this stream is the slot's only reader: it clears it
                stmts.append(Stmt(f"{local[p]} = v[{k}];  v[{k}] = None", (), local[p]))

        for seg in (s for s in cut.segments if s.stream == sid):
            ops = list(dict.fromkeys(_op_name(n) for n in seg.nodes))
            ops = ", ".join(ops[:6]) + (", ..." if len(ops) > 6 else "")
            stmts.append(Stmt(f"# segment {seg.index}: {len(seg.nodes)} node(s) ({ops})"))
            for P in seg.waits:
                stmts.append(Stmt(f"w({ev_of[P]})  # segment {P.index} (stream {P.stream})"))
            for p in seg.inputs:
                take(p)
            outs = ", ".join(local[o] for o in seg.outputs)
            call = f"_seg{seg.index}({', '.join(local[p] for p in seg.inputs)})"
            text = f"{outs}, = {call}" if seg.outputs else call
            names = [local[p] for p in seg.inputs] + [local[o] for o in seg.outputs]
            stmts.append(Stmt(text, names, None, seg))
            have.update(seg.outputs)
            for o in seg.outputs:
                for d in cut.stream_ids:
                    if (o, d) in slots:
                        stmts.append(Stmt(f"v[{slots[(o, d)]}] = {local[o]}", [local[o]]))
            if seg in ev_of:
                stmts.append(Stmt(f"ev[{ev_of[seg]}].set()  # segment {seg.index} done"))
            namer.globals[f"_seg{seg.index}"] = seg.program.fn
        if sid == cut.main:
            if not serial:
                stmts.append(Stmt("_rt.st_join(st)  # every worker stream has finished"))
            for p in out_node.all_input_nodes:
                take(p)
            out = fmt(out_node.args[0], ref, namer)
            stmts.append(Stmt(f"return {out}", [local[p] for p in out_node.all_input_nodes]))
        stmts = with_deletes(stmts, set())
        body = [f"    {s.text}" for s in stmts]
        if serial:
            params = [local[n] for n in inputs if n.op == "placeholder"]
            head = [f"def forward({', '.join(params)}):", *prologue(inputs, local)]
            head.append(f"    with _rt.intra_op_threads({threads[sid]}):")
            body = ["    " + b for b in body]
        else:
            head = [f"def _stream_{sid}(st):  # stream {sid}: {threads[sid]} intra-op threads"]
        lines += head + body + ([] if serial else [""])
        owners += [None] * len(head) + [s.node for s in stmts] + ([] if serial else [None])
    if not serial:
        workers = "".join(f"(_stream_{s}, {threads[s]}), " for s in cut.stream_ids[1:])
        params = [local[n] for n in inputs if n.op == "placeholder"]
        args = "".join(f"{local[n]}, " for n in inputs)
        lines += [
            f"_SPEC = _rt.StreamSpec(main=_stream_{cut.main}, workers=({workers}), "
            f"main_threads={threads[cut.main]},",
            f"                       node_at_line=_NODE_AT_LINE, filename=_FILENAME, "
            f"stream_ids={tuple(cut.stream_ids)})",
            "",
            "",
            f"def forward({', '.join(params)}):",
            *prologue(inputs, local),
            f"    st = _rt.CallState({len(slots)}, {len(ev_of)}, ({args}), {float(timeout_s)!r})",
            "    return _rt.run_streams(_SPEC, st)",
        ]
    mode = f"inductor cpp_wrapper segments: {len(cut.segments)} on {len(cut.stream_ids)} streams"
    notes = cut.notes + [f"{len(cut.segments)} segments compiled in {seconds:.1f} s"]
    filename = f"<autopar segments {tag} {plan.plan_hash} #{next(program_counter)}>"
    head = provenance_header(plan, tag, provenance, notes, mode) + PROGRAM_IMPORTS
    first = head.count("\n") + 1  # the line number of lines[0]
    node_at_line = {
        first + i: f"{tag}/segment{g.index} ({g.nodes[0].name} .. {g.nodes[-1].name})"
        for i, g in enumerate(owners) if g is not None
    }  # fmt: skip
    source = head + "\n".join(lines) + "\n"
    namer.globals.update(_FILENAME=filename, _NODE_AT_LINE=node_at_line)
    load_source(source, filename, namer.globals)
    return Program(source, namer.globals["forward"], plan, tag, filename, tuple(notes),
                   tuple(cut.stream_ids), node_at_line)  # fmt: skip


def _op_name(n: fx.Node) -> str:
    t = n.target
    if isinstance(t, torch._ops.OpOverload):
        return t._schema.name.split("::")[-1]
    return getattr(t, "__name__", str(t))
