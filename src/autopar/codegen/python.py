"""Codegen: turn one aten FX graph and its Plan into a readable Python program.

``generate(gm, plan, tag)`` returns a :class:`Program` whose ``.source`` is exactly what
runs (``.fn`` is made by ``exec`` of it; tracebacks show the generated lines).

* Serial plans (every node of the graph on one stream) give straight-line code calling the
  same aten ops as ``gm.code``, with no threading at all.
* CPU plans with several streams: stream 0 (or the first stream) runs on the calling
  thread, every other stream is a function run by a persistent worker thread
  (``autopar.runtime.streams``). A node waits only for what it needs: its data inputs, the
  ordering constraints of in-place ops (below) and the plan's syncs, reduced with vector
  clocks so a wait already implied by an earlier one is not emitted. Values crossing
  streams travel through per-call slots; every local is deleted after its last use.
* CUDA plans: streams and events, emitted by ``autopar.codegen.cuda``.

The device decides: a plan whose streams are on the CPU for a graph whose traced values
(``node.meta["val"]``) live on one CUDA device runs on CUDA streams of that device (noted),
never on CPU worker threads; a plan with CUDA streams for a graph whose values are all on
the CPU is refused (``PlanError``: re-plan on the graph's device).

Boxed entry. Serial and CUDA programs define ``forward_boxed(_args)``, which unpacks the
list into its locals and empties it (AOTAutograd's boxed calling convention, see
``codegen.emit.Boxed``), so a backward's saved tensors die at their last use;
``forward(*args)`` calls it.

In-place ops and views. A node whose aten schema writes an argument (``alias_info.is_write``,
e.g. ``copy_``, ``add_``) writes the whole buffer of that argument; views share their base's
buffer. Every node that reads the buffer keeps its graph (eager) order relative to the
write: codegen raises ``PlanError`` if the plan's order differs, and adds the cross-stream
waits that keep it.

RNG. All RNG-consuming ops (``Tag.nondeterministic_seeded``, a ``Generator`` argument, or a
known random op) share the global generator. Their relative order in the plan must equal the
graph's order (else ``PlanError``), and in CPU plans codegen *relocates* them to stream 0
(the calling thread; noted in ``Program.notes`` and the header), so the generator is
consumed in eager order and a fixed seed gives eager's results. In CUDA plans the host
enqueues everything in plan order, which is the order the generator offsets are taken in.

Example::

    >>> import torch
    >>> from torch.fx.experimental.proxy_tensor import make_fx
    >>> from autopar.planning.plan import Plan, Stream, node_key
    >>> gm = make_fx(lambda x: x.sin() + x.cos())(torch.randn(3))
    >>> keys = [node_key("g0.fw", n.name) for n in gm.graph.nodes]
    >>> plan = Plan("g0.fw", "serial", (Stream(0, "cpu", 1),),
    ...             tuple((k, 0) for k in keys), tuple(keys), ())
    >>> prog = generate_python(gm, plan, "g0.fw")
    >>> x = torch.randn(3)
    >>> torch.equal(prog.fn(x), gm(x))
    True
"""

from __future__ import annotations

import dataclasses

import torch
import torch.fx as fx

from autopar.capture.backend import node_key
from autopar.codegen.cuda import CUDA_GRAPH_UNSUPPORTED, emit_cuda
from autopar.codegen.emit import (
    COMPUTE_OPS,
    PROGRAM_IMPORTS,
    RESERVED,
    Namer,
    Program,
    Stmt,
    call_expr,
    fmt,
    load_source,
    program_counter,
    prologue,
    provenance_header,
    schedule,
    with_deletes,
)
from autopar.errors import PlanError
from autopar.planning.plan import Plan


def generate_python(
    gm: fx.GraphModule,
    plan: Plan,
    tag: str,
    *,
    provenance: dict | None = None,
    cuda_graph: bool = False,
    timeout_s: float = 0.0,
) -> Program:
    """The Python program for ``plan``: straight-line code for one stream, CPU worker streams
    (``autopar.runtime.streams``) for several, or CUDA streams (``autopar.codegen.cuda``).
    Arguments as in :func:`autopar.codegen.emitters.generate`, which most callers use;
    ``cuda_graph=True`` raises ``ValueError``: CUDA graphs are Inductor's
    ``mode="reduce-overhead"`` (see ``autopar.codegen.cuda``)."""
    plan, moved = on_graph_device(gm, plan, tag)
    keys = {node_key(tag, n.name) for n in gm.graph.nodes if n.op in COMPUTE_OPS}
    devices = {plan.stream_of(k).device for k in keys & set(plan.placement)}
    cuda = any(d.startswith("cuda") for d in devices)
    if cuda and len(devices) > 1:
        raise PlanError(
            f"graph {tag} is placed on several devices {sorted(devices)}: codegen supports "
            "plans whose streams share one device. Re-plan with one device per graph."
        )
    if cuda_graph:  # kept in the signature so callers get this answer, not a TypeError
        raise ValueError(CUDA_GRAPH_UNSUPPORTED)
    sched = schedule(gm, plan, tag, cuda)
    if moved:
        sched.notes.insert(0, moved)
    namer = Namer()
    namer.globals["_gm"] = gm
    nodes = list(gm.graph.nodes)
    local = {n: n.name + "_" if n.name in RESERVED else n.name for n in nodes}
    inputs = [n for n in nodes if n.op in ("placeholder", "get_attr")]
    (out_node,) = [n for n in nodes if n.op == "output"]
    if len(sched.stream_ids) == 1 and not cuda:
        mode = "serial"
        (sid,) = sched.stream_ids
        threads = next((s.threads for s in plan.streams if s.id == sid), 0)
        lines, owners = _emit_serial(sched, local, namer, inputs, out_node, threads)
    elif cuda:
        mode = f"cuda, {len(sched.stream_ids)} streams"
        lines, owners = emit_cuda(sched, plan, local, namer, inputs, out_node, tag)
    else:
        mode = f"cpu, {len(sched.stream_ids)} streams"
        lines, owners = _emit_cpu(sched, plan, local, namer, inputs, out_node, timeout_s)
    boxed = mode == "serial" or cuda
    if boxed:
        params = [local[n] for n in inputs if n.op == "placeholder"]
        lines, owners = _boxed_entry(lines, owners, params)
    filename = f"<autopar {tag} {plan.plan_hash} #{next(program_counter)}>"
    head = provenance_header(plan, tag, provenance, sched.notes, mode) + PROGRAM_IMPORTS
    first = head.count("\n") + 1  # line number of lines[0]
    node_at_line = {first + i: node_key(tag, o.name) for i, o in enumerate(owners) if o is not None}
    source = head + "\n".join(lines) + "\n"
    namer.globals.update(_NODE_AT_LINE=node_at_line, _FILENAME=filename)
    load_source(source, filename, namer.globals)
    return Program(
        source, namer.globals["forward"], plan, tag, filename, tuple(sched.notes),
        tuple(sched.stream_ids), node_at_line,
        boxed=namer.globals["forward_boxed"] if boxed else None,
    )  # fmt: skip


def traced_devices(gm: fx.GraphModule) -> set[str]:
    """The devices of ``gm``'s traced tensor values (``node.meta["val"]``), e.g.
    ``{"cpu", "cuda:0"}``; empty when nothing was traced with values."""
    found: set[str] = set()
    for n in gm.graph.nodes:
        vals = n.meta.get("val")
        for v in vals if isinstance(vals, (list, tuple)) else (vals,):
            if isinstance(v, torch.Tensor):
                d = v.device
                found.add(f"cuda:{d.index or 0}" if d.type == "cuda" else d.type)
    return found


def on_graph_device(gm: fx.GraphModule, plan: Plan, tag: str) -> tuple[Plan, str]:
    """``(plan, note)``: ``plan`` on the device of ``gm``'s values (module docstring). The
    note says what moved ("" when nothing did); raises ``PlanError`` for CUDA streams over
    a graph whose every traced value is on the CPU."""
    devices = traced_devices(gm)
    cuda = sorted(d for d in devices if d.startswith("cuda"))
    on_cuda = [s for s in plan.streams if s.device.startswith("cuda")]
    if len(cuda) == 1 and not on_cuda:
        # CPU worker threads would launch the graph's kernels on per-thread default
        # streams, unordered with the caller's stream: CUDA streams of its device instead.
        streams = tuple(dataclasses.replace(s, device=cuda[0], threads=0) for s in plan.streams)
        return plan.replace(streams=streams), (
            f"plan streams on cpu run as {cuda[0]} streams: the graph's values live there"
        )
    if on_cuda and devices == {"cpu"}:
        raise PlanError(
            f"graph {tag}'s values are all on the CPU but plan {plan.graph_id!r} puts it on "
            f"{on_cuda[0].device} streams: re-plan it on the graph's device"
        )
    return plan, ""


def _boxed_entry(lines: list[str], owners: list, params: list[str]):
    """``forward(params)`` -> ``forward_boxed(_args)`` (unpacking and emptying the list)
    plus a ``forward`` calling it, with ``owners`` (source line -> node) kept aligned."""
    assert lines[0].startswith("def forward("), lines[0]
    take = f"{', '.join(params)}, = _args;  " if params else ""
    head = [
        "def forward_boxed(_args):",
        f"    {take}_args.clear()  # the caller's list: its tensors die at their last use",
    ]
    tail = ["", "", f"def forward({', '.join(params)}):",
            f"    return forward_boxed([{', '.join(params)}])"]  # fmt: skip
    return head + lines[1:] + tail, [None, None] + owners[1:] + [None] * len(tail)


def _emit_serial(sched, local, namer, inputs, out_node, threads: int = 0):
    ref = lambda n: local[n]
    params = [local[n] for n in inputs if n.op == "placeholder"]
    stmts = [
        Stmt(f"{local[n]} = {call_expr(n, ref, namer)}", [local[p] for p in n.all_input_nodes],
              local[n], n)
        for n in sched.compute
    ]  # fmt: skip
    out = fmt(out_node.args[0], ref, namer)
    stmts.append(Stmt(f"return {out}", [local[p] for p in out_node.all_input_nodes]))
    stmts = with_deletes(stmts, set())
    lines = [f"def forward({', '.join(params)}):"] + prologue(inputs, local)
    owners: list = [None] * len(lines)
    indent = "    "
    if threads > 0:  # the plan's intra-op threads (a no-op when the caller has that many)
        lines.append(f"    with _rt.intra_op_threads({threads}):")
        owners.append(None)
        indent = "        "
    lines += [f"{indent}{s.text}" for s in stmts]
    owners += [s.node for s in stmts]
    return lines, owners


def _emit_cpu(sched, plan, local, namer, inputs, out_node, timeout_s):
    """Stream functions run by ``autopar.runtime.streams.run_streams``."""
    idx = {n: i for i, n in enumerate(inputs)}
    stream, main = sched.stream, sched.main
    ev_of = {p: i for i, p in enumerate(sched.signals)}
    slots: dict[tuple[fx.Node, int], int] = {}  # (value, consumer stream) -> slot
    for n in sched.compute:
        for p in n.all_input_nodes:
            if p in stream and stream[p] != stream[n]:
                slots.setdefault((p, stream[n]), len(slots))
    for p in out_node.all_input_nodes:
        if p in stream and stream[p] != main:
            slots.setdefault((p, main), len(slots))
    ref = lambda n: local[n]
    threads = {s.id: s.threads for s in plan.streams}
    lines: list[str] = []
    owners: list = []
    for sid in sched.stream_ids:
        stmts = [Stmt("v, ev, w, a = st.v, st.ev, st.wait, st.args")]
        have: set[fx.Node] = set()

        def take(p, sid=sid, stmts=stmts, have=have):
            if p in have:
                return
            have.add(p)
            if p in idx:
                stmts.append(Stmt(f"{local[p]} = a[{idx[p]}]", (), local[p]))
            elif stream[p] != sid:
                k = slots[(p, sid)]  # this stream is the slot's only reader: it clears it
                stmts.append(Stmt(f"{local[p]} = v[{k}];  v[{k}] = None", (), local[p]))

        for n in (n for n in sched.compute if stream[n] == sid):
            for p in sched.waits[n]:
                stmts.append(Stmt(f"w({ev_of[p]})  # {p.name} (stream {stream[p]})"))
            for p in n.all_input_nodes:
                take(p)
            text = f"{local[n]} = {call_expr(n, ref, namer)}"
            for d in sched.stream_ids:
                if (n, d) in slots:
                    text += f";  v[{slots[(n, d)]}] = {local[n]}"
            if n in ev_of:
                text += f";  ev[{ev_of[n]}].set()"
            stmts.append(Stmt(text, [local[p] for p in n.all_input_nodes], local[n], n))
            have.add(n)
        if sid == main:
            stmts.append(Stmt("_rt.st_join(st)  # every worker stream has finished"))
            for p in out_node.all_input_nodes:
                take(p)
            out = fmt(out_node.args[0], ref, namer)
            stmts.append(Stmt(f"return {out}", [local[p] for p in out_node.all_input_nodes]))
        lines.append(f"def _stream_{sid}(st):  # stream {sid}: {threads[sid]} intra-op threads")
        owners.append(None)
        for s in with_deletes(stmts, set()):
            lines.append(f"    {s.text}")
            owners.append(s.node)
        lines.append("")
        owners.append(None)
    workers = "".join(f"(_stream_{s}, {threads[s]}), " for s in sched.stream_ids[1:])
    params = [local[n] for n in inputs if n.op == "placeholder"]
    args = "".join(f"{local[n]}, " for n in inputs)
    tail = [
        f"_SPEC = _rt.StreamSpec(main=_stream_{main}, workers=({workers}), "
        f"main_threads={threads[main]},",
        f"                       node_at_line=_NODE_AT_LINE, filename=_FILENAME, "
        f"stream_ids={tuple(sched.stream_ids)})",
        "",
        "",
        f"def forward({', '.join(params)}):",
        *prologue(inputs, local),
        f"    st = _rt.CallState({len(slots)}, {len(ev_of)}, ({args}), {float(timeout_s)!r})",
        "    return _rt.run_streams(_SPEC, st)",
    ]
    return lines + tail, owners + [None] * len(tail)
