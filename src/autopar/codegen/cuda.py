"""Codegen for CUDA plans: one function enqueues every stream's work in plan order.

Built on ``autopar.codegen.emit`` (the shared schedule and statements);
``autopar.codegen.python.generate_python`` calls ``emit_cuda`` for plans whose streams
are on a CUDA device.

Synchronisation is between *kernels*. Ops that launch no kernel -- views (``t``, ``view``,
``expand``: their schema result aliases an argument and they write nothing),
``_unsafe_view`` and ``getitem`` -- only build tensor metadata on the host, so waiting on
them, or recording an event after them, orders nothing on the device. A cross-stream
dependency on such a value becomes a wait on the event of the kernel that produced its
data (followed through the chain of views; ``autopar.capture.analysis.buffer_analysis``
tells views and in-place writes apart), metadata-only ops get no waits of their own, and
no event is recorded after them. The in-place rule of ``emit.schedule`` is kept between the
kernels that read and write a buffer; the plan's syncs are kept from the producing kernel.
Waits are reduced with the planner's vector clocks over those kernel dependencies.

Memory. A tensor used by a kernel on a stream other than the one whose allocation pool it
came from gets ``record_stream`` (so the caching allocator does not hand its memory out
while that stream may still read it). CPU tensors (lifted constants, index tensors) are
never recorded: ``record_stream`` raises on them. Codegen decides from the node's traced
value (``node.meta["val"].device``); where that is unknown the program calls
``autopar.runtime.streams.record_streams``, which skips non-CUDA tensors at run time.

CUDA graphs are not emitted here: a sound capture of a training step (static input
buffers, input mutations, RNG state, one memory pool, outputs that outlive the next
replay) is what Inductor's CUDA graph trees do; use ``torch.compile(mode="reduce-overhead")``
(``autopar.compile(..., executor="inductor")`` where the pipeline offers it).
"""

from __future__ import annotations

import operator
from collections import deque
from typing import Any

import torch
import torch.fx as fx

from autopar.capture.analysis import buffer_analysis
from autopar.codegen.emit import Stmt, call_expr, fmt, prologue, with_deletes
from autopar.planning.clocks import VectorClocks

#: What ``generate(..., cuda_graph=True)`` answers (see the module docstring).
CUDA_GRAPH_UNSUPPORTED = (
    "autopar does not capture CUDA graphs itself: a correct capture of a training step "
    "needs static input buffers, input mutations replayed, one memory pool and outputs that "
    "survive the next replay, which Inductor's CUDA graph trees provide. Use "
    'torch.compile(model, mode="reduce-overhead") for CUDA graphs, or generate without '
    "cuda_graph."
)

#: Ops with no aliasing in their schema that still only reinterpret their input's storage.
_METADATA_OPS = {torch.ops.aten._unsafe_view.default}


def emit_cuda(sched, plan, local, namer, inputs, out_node, tag):
    """One function enqueueing every stream's work in plan order (no worker threads)."""
    stream, main = sched.stream, sched.main
    sv = {sid: f"s_{i}" for i, sid in enumerate(sched.stream_ids)}  # stream variables
    device = next(s.device for s in plan.streams if s.id == main)
    if device == "cuda":
        device = "cuda:0"
    dev = device_waits(sched, plan, tag)
    ev_of = {p: i for i, p in enumerate(dev.signals)}
    ref = lambda n: local[n]
    params = [local[n] for n in inputs if n.op == "placeholder"]
    others = sched.stream_ids[1:]
    pre = [f"    {sv[main]} = torch.cuda.current_stream(torch.device({device!r}))"]
    if others:
        names = ", ".join(sv[s] for s in others)
        devs = ", ".join(repr(device) for _ in others)
        pre.append(f"    {names}, = _rt.cuda_streams(_STREAM_KEY, ({devs},))")
        pre.append(
            "    "
            + ";  ".join(f"{sv[s]}.wait_stream({sv[main]})" for s in others)
            + "  # inputs are ready on the caller's stream"
        )
    namer.globals["_STREAM_KEY"] = f"{tag}/{plan.plan_hash}"
    home = lambda p: dev.home.get(p, main)  # whose pool p's memory is from
    stmts: list[Stmt] = []
    current = main
    recorded: set[tuple[fx.Node, int]] = set()  # (storage owner, stream) already recorded
    for n in sched.compute:
        d = stream[n]
        if d != current and n not in dev.metadata:  # host-only ops run on any stream
            stmts.append(Stmt(f"torch.cuda.set_stream({sv[d]})"))
            current = d
        for p in dev.waits.get(n, ()):
            stmts.append(Stmt(f"{sv[d]}.wait_event(e_{ev_of[p]})  # after {p.name}"))
        if n not in dev.metadata:  # a view's storage is recorded where a kernel uses it
            for p in n.all_input_nodes:
                a = dev.owner.get(p, p)
                if home(p) != d and (a, d) not in recorded:
                    recorded.add((a, d))  # the allocator must not reuse it before d is done
                    text = _record(p, local[p], sv[d])
                    if text:
                        stmts.append(Stmt(text, [local[p]]))
        text = f"{local[n]} = {call_expr(n, ref, namer)}"
        if n in ev_of:
            i = ev_of[n]
            text += f";  e_{i} = torch.cuda.Event();  e_{i}.record({sv[d]})"
        stmts.append(Stmt(text, [local[p] for p in n.all_input_nodes], local[n], n))
    body = [Stmt(f"torch.cuda.set_stream({sv[main]})")] if current != main else []
    if others:
        joins = ";  ".join(f"{sv[main]}.wait_stream({sv[s]})" for s in others)
        body.append(Stmt(joins + "  # the caller's stream sees all work"))
    for p in dict.fromkeys(out_node.all_input_nodes):  # the caller uses them on its stream
        if home(p) != main and (dev.owner.get(p, p), main) not in recorded:
            recorded.add((dev.owner.get(p, p), main))
            text = _record(p, local[p], sv[main])
            if text:
                body.append(Stmt(text, [local[p]]))
    out = fmt(out_node.args[0], ref, namer)
    body.append(Stmt(f"return {out}", [local[p] for p in out_node.all_input_nodes]))
    all_stmts = with_deletes(stmts + body, set())
    lines = [f"def forward({', '.join(params)}):", *prologue(inputs, local), *pre, "    try:"]
    owners: list = [None] * len(lines)
    for s in all_stmts[: len(stmts)]:
        lines.append(f"        {s.text}")
        owners.append(s.node)
    lines += ["    finally:", f"        torch.cuda.set_stream({sv[main]})"]
    owners += [None, None]
    for s in all_stmts[len(stmts) :]:
        if not s.text.startswith("torch.cuda.set_stream"):  # done by the finally block
            lines.append(f"    {s.text}")
            owners.append(None)
    return lines, owners


def _record(node: fx.Node, name: str, stream_var: str) -> str | None:
    """The statement keeping ``node``'s memory from reuse until ``stream_var`` is done, or
    None for a CPU tensor (``record_stream`` raises on one, and its memory is not the CUDA
    caching allocator's)."""
    val = node.meta.get("val")
    if isinstance(val, torch.Tensor):
        return f"{name}.record_stream({stream_var})" if val.device.type == "cuda" else None
    return f"_rt.record_streams({name}, {stream_var})"  # unknown: checked at run time


# -- device dependencies --------------------------------------------------------------------
class DeviceWaits:
    """What the CUDA program synchronises (see the module docstring).

    ``waits[n]``: kernels whose events ``n``'s stream waits on before ``n``;
    ``signals``: kernels followed by an event record, in plan order; ``metadata``: nodes
    that launch no kernel; ``owner[n]``: the node standing for ``n``'s storage (views and
    in-place results map to the allocation they share; each ``getitem`` of a multi-output
    kernel is its own); ``home[n]``: the stream whose allocation pool that storage came
    from (graph inputs: the caller's stream).
    """

    def __init__(self, waits, signals, metadata, owner, home):
        self.waits, self.signals, self.metadata = waits, signals, metadata
        self.owner, self.home = owner, home


def is_metadata_only(n: fx.Node, base: dict, writes: dict) -> bool:
    """Whether ``n`` launches no device work: a view (aliases an argument, writes nothing),
    ``_unsafe_view`` or a ``getitem`` (picks one result of a multi-output op).

    Composite ops whose schema *may* alias (``reshape``, ``to``, ``contiguous``) copy when
    they must, so they count as kernels (post-dispatch graphs have them decomposed anyway).
    """
    if n.op != "call_function":
        return False
    if n.target is operator.getitem or n.target in _METADATA_OPS:
        return True
    if base.get(n, n) is n or n in writes:
        return False
    name = n.target.name()
    return not torch._C._dispatch_has_kernel_for_dispatch_key(name, "CompositeImplicitAutograd")


def _source(n: fx.Node, base: dict) -> fx.Node | None:
    """The input a metadata-only node reinterprets."""
    if n.target is operator.getitem or n.target in _METADATA_OPS:
        src = n.args[0]
        return src if isinstance(src, fx.Node) else None
    for arg, val in zip(n.target._schema.arguments, n.args, strict=False):
        if arg.alias_info is not None and isinstance(val, fx.Node):
            return val  # the first aliased argument, as buffer_analysis picks
    return base.get(n)


def device_waits(sched, plan, tag: str) -> DeviceWaits:
    """Cross-stream waits between kernels for ``sched`` (a ``codegen.emit.Schedule``)."""
    from autopar.capture.backend import node_key

    compute, stream = sched.compute, sched.stream
    if not compute:
        return DeviceWaits({}, [], set(), {}, {})
    nodes = list(compute[0].graph.nodes)
    base, writes = buffer_analysis(nodes)
    metadata = {n for n in compute if is_metadata_only(n, base, writes)}

    def kernel(p):  # the kernel that produced p's data (or a graph input / non-compute)
        while p in metadata:
            p = _source(p, base)
        return p

    owner: dict[fx.Node, fx.Node] = {}
    for n in nodes:  # graph order: an input's owner is known before its users'
        if n in metadata:
            src = _source(n, base)
            if src is None or (n.target is operator.getitem and src not in metadata):
                owner[n] = n  # one result of a multi-output kernel: a storage of its own
            else:
                owner[n] = owner.get(src, src)  # a view: its input's storage
        else:
            b = base.get(n, n)  # an in-place result: the buffer it wrote
            owner[n] = n if b is n else owner.get(b, b)
    home = {n: stream.get(kernel(_source(o, base)) if o in metadata else o, sched.main)
            for n, o in owner.items()}  # fmt: skip
    kernels = [n for n in compute if n not in metadata]
    pos = {n: i for i, n in enumerate(compute)}
    gpos = {n: i for i, n in enumerate(nodes)}
    deps: dict[fx.Node, set] = {n: set() for n in kernels}
    for n in kernels:
        for p in n.all_input_nodes:
            k = kernel(p)
            if k in deps:
                deps[n].add(k)
    # In-place writes: kernels reading a buffer keep eager order around a kernel writing it
    # (emit.schedule checked the plan keeps that order; a view reads nothing itself).
    readers: dict[fx.Node, list] = {}
    for n in kernels:
        for p in n.all_input_nodes:
            readers.setdefault(base[p], []).append(n)
    for m, bufs in writes.items():
        if m not in deps:
            continue
        for b in bufs:
            for r in readers.get(b, []) + [w for w in writes if b in writes[w] and w in deps]:
                if r is not m:
                    first, second = (r, m) if gpos[r] < gpos[m] else (m, r)
                    deps[second].add(first)
    by_key = {node_key(tag, n.name): n for n in compute}
    for s in plan.syncs:  # the planner's syncs, from the kernel that made the value
        src, dst = kernel(by_key.get(s.src)), by_key.get(s.dst)
        if src in deps and dst in deps and pos[src] < pos[dst]:
            deps[dst].add(src)
    clocks = VectorClocks()
    waits: dict[fx.Node, list] = {}
    signals: dict[fx.Node, None] = {}
    for n in kernels:  # plan order; later producers first: their waits imply more
        d = stream[n]
        need = sorted((p for p in deps[n] if stream[p] != d), key=lambda p: -pos[p])
        waits[n] = clocks.reduce(d, need)
        signals.update(dict.fromkeys(waits[n]))
        clocks.run(d, n)
    ordered = sorted(signals, key=pos.__getitem__)
    return DeviceWaits(waits, ordered, metadata, owner, home)


# -- timing a program's device work ---------------------------------------------------------
class CudaTimer:
    """Times one CUDA graph's calls with event pairs, never synchronising by itself.

    ``start()`` and ``stop(at)`` record an event on the current (the caller's) stream of
    each device around a call. The programs :func:`emit_cuda` writes fork their side
    streams from that stream and join them back into it (as Inductor's do), so the pair
    brackets all of the call's device work, however many streams ran it.
    ``done()`` yields ``(seconds, at)`` for the calls whose end events the devices have
    passed, oldest first, stopping at the first that is not (``Event.query``: no wait); a
    call on several devices takes its longest device. ``sync()`` synchronises the devices:
    the monitor calls it in measurement windows only.
    """

    def __init__(self, devices: list[torch.device]):
        self.devices = devices
        self.pending: deque[tuple[list, list, Any]] = deque()
        self._open: list | None = None

    def _mark(self) -> list:
        marks = []
        for d in self.devices:
            e = torch.cuda.Event(enable_timing=True)
            e.record(torch.cuda.current_stream(d))
            marks.append(e)
        return marks

    def start(self) -> None:
        self._open = self._mark()

    def stop(self, at: Any) -> None:
        if self._open is not None:
            self.pending.append((self._open, self._mark(), at))
        self._open = None

    def done(self):
        while self.pending:
            starts, ends, at = self.pending[0]
            if not all(e.query() for e in ends):
                return
            self.pending.popleft()
            ms = max(s.elapsed_time(e) for s, e in zip(starts, ends, strict=True))
            yield ms / 1e3, at

    def sync(self) -> None:
        for d in self.devices:
            torch.cuda.synchronize(d)

    def clear(self) -> None:
        """Forget unread calls (a new program: they timed the old one)."""
        self.pending.clear()
        self._open = None
