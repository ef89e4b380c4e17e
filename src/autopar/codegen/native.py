"""The native executor: a plan's streams as instruction lists that a C++ interpreter runs
without Python, each stream on one thread of the calling thread's OpenMP team.

Why: the CPU worker-stream program (``codegen.python``) hands work to Python threads
through a queue and events. On the 2-core VMs autopar is measured on, each wake-up of a
sleeping thread costs 30-35 us (a futex), and every op between two waits dispatches from
Python holding the GIL: a multi-tower MLP's fork and join cost more than its towers give
back (``benchmarks/concurrency_ceiling.py``). The interpreter
(``autopar/runtime/native/interp.cpp``) runs every stream in one OpenMP parallel region
of the calling thread, whose team threads are still spinning from the user's last 2-thread
op: the fork costs about a microsecond, a cross-stream edge is an atomic flag, and each op
is a boxed dispatcher call of the FX node's exact ``OpOverload`` (about 1 us of overhead
against 3-6 us from Python).

What it runs. Every compute node must be an ``OpOverload`` call or an ``operator.getitem``
of one; placeholders and ``get_attr`` values are the inputs; the outputs are nodes or
``None``. Constants are converted once, at build time, with the schema argument's type.
Anything else (``call_module``, a Python callable, a symbolic size, a constant output)
raises :class:`Unsupported` with the reason; the graph then gets the Python program, with
the reason in its notes. A plan with several streams must give each one intra-op
thread (an op inside an OpenMP parallel region runs single-threaded); a one-stream plan
runs on the calling thread outside any region, with the caller's intra-op threads.

The schedule is ``codegen``'s (``emit.schedule``): the same plan checks, random ops kept in
graph order and moved to the calling thread's stream (so the global generator is consumed
as in eager), the eager order of in-place writes, waits reduced with vector clocks. The
stream that runs on the calling thread is the interpreter's stream 0.

The program's source is what runs: per stream, a list of instructions (Python literals,
one line each, with the FX statement it runs in a comment), handed to the interpreter once
when the source is executed. A slot is cleared after its last reader when all its readers
run on its producer's stream; values that cross streams live until the call returns.

Example::

    >>> prog = generate_native(gm, plan, "g0.fw")   # doctest: +SKIP
    >>> out = prog.fn(*args)                       # what gm(*args) returns  # doctest: +SKIP
    >>> print(prog.source)                         # doctest: +SKIP
"""

from __future__ import annotations

import dataclasses
import operator
from dataclasses import dataclass, field

import torch
import torch.fx as fx

from autopar import compat
from autopar.capture.backend import node_key
from autopar.codegen.emit import (
    Namer,
    Program,
    call_expr,
    load_source,
    program_counter,
    provenance_header,
    schedule,
)
from autopar.planning.costmodel import MachineModel
from autopar.planning.plan import Plan, Stream

#: A cross-stream wait in the interpreter: an atomic flag set by one spinning core and read
#: by the other (round trip 0.3 us, 2-core VM, 2026-12-02, ``benchmarks/native_fork.py``),
#: plus the cache lines of the value handed over. The Python program's calibrated
#: ``sync_cost_s`` is a thread wake-up (20-45 us).
NATIVE_SYNC_S = 1e-6

#: argument kinds of an instruction (the C++ side's ``ArgKind``)
SLOT, CONST, SLOT_LIST, DEFAULT = 0, 1, 2, 3


class Unsupported(Exception):
    """The graph has something the native interpreter cannot run (the message says what)."""


@dataclass
class Instr:
    node: fx.Node
    key: str  # "<tag>/<node name>": the interpreter's errors name it
    stream: int  # the interpreter's stream index (0: the calling thread)
    op: str  # "aten::addmm" or "getitem"
    overload: str
    args: list  # (kind, payload) pairs, one per schema argument
    out: int
    waits: list[int] = field(default_factory=list)
    signal: int = -1
    frees: list[int] = field(default_factory=list)


@dataclass
class Lowered:
    """A graph lowered for the interpreter: what :func:`render` prints."""

    streams: list[list[Instr]]
    order: list[Instr]  # plan order: a valid serial order of every instruction
    n_slots: int
    n_events: int
    inputs: list[fx.Node]  # placeholders, then get_attr nodes (read at call time)
    input_slots: list[int]
    outputs: list[int]  # -1: None
    output_type: type
    notes: list[str]
    stream_ids: tuple[int, ...]  # the plan's stream of each interpreter stream


def lower(gm: fx.GraphModule, plan: Plan, tag: str) -> Lowered:
    """Lower ``gm`` under ``plan`` to per-stream instruction lists (raises
    :class:`Unsupported` or ``PlanError``)."""
    threads = {s.id: s.threads for s in plan.streams}
    for s in plan.streams:
        if s.device != "cpu":
            raise Unsupported(f"stream {s.id} is on {s.device}: the interpreter runs CPU plans")
    sched = schedule(gm, plan, tag, cuda=False)
    index = {sid: i for i, sid in enumerate(sched.stream_ids)}
    if len(index) > 1:
        many = [sid for sid in sched.stream_ids if threads.get(sid, 1) != 1]
        if many:
            raise Unsupported(
                f"streams {many} have several intra-op threads: inside the interpreter's "
                "parallel region every stream runs one thread"
            )
    nodes = list(gm.graph.nodes)
    inputs = [n for n in nodes if n.op == "placeholder"]
    inputs += [n for n in nodes if n.op == "get_attr"]
    slot = {n: i for i, n in enumerate(inputs)}
    for n in sched.compute:
        _check(n)
        slot[n] = len(slot)
    events = {n: i for i, n in enumerate(sched.signals)}

    def ref(v, where: fx.Node):
        if isinstance(v, fx.Node):
            if v not in slot:
                raise Unsupported(f"{where.name} reads {v.name}, which is not a value")
            return (SLOT, slot[v])
        if isinstance(v, (list, tuple)) and any(isinstance(x, fx.Node) for x in v):
            if not all(x is None or isinstance(x, fx.Node) for x in v):
                raise Unsupported(f"{where.name} mixes values and constants in a list")
            return (SLOT_LIST, [-1 if x is None else slot[x] for x in v])
        _check_const(v, where)
        return (CONST, v)

    instrs: list[Instr] = []
    for n in sched.compute:
        s = index[sched.stream[n]]
        if n.target is operator.getitem:
            args = [ref(n.args[0], n), (CONST, n.args[1])]
            op, overload = "getitem", ""
        else:
            args = _schema_args(n, ref)
            op, overload = n.target._schema.name, n.target._schema.overload_name
        ins = Instr(n, node_key(tag, n.name), s, op, overload, args, slot[n])
        ins.waits = [events[p] for p in sched.waits[n]]
        ins.signal = events.get(n, -1)
        instrs.append(ins)
    (out_node,) = [n for n in nodes if n.op == "output"]
    result = out_node.args[0]
    if not isinstance(result, (list, tuple)):
        raise Unsupported("the graph returns a single value, not a tuple or list")
    outputs = []
    for v in result:
        if v is not None and not isinstance(v, fx.Node):
            raise Unsupported(f"the graph returns a constant ({v!r})")
        outputs.append(-1 if v is None else slot[v])
    streams: list[list[Instr]] = [[] for _ in index]
    for ins in instrs:
        streams[ins.stream].append(ins)
    _add_frees(instrs, slot, set(outputs), inputs)
    return Lowered(
        streams, instrs, len(slot), len(events), inputs, [slot[n] for n in inputs], outputs,
        type(result), list(sched.notes), tuple(sched.stream_ids),
    )  # fmt: skip


def _check(n: fx.Node) -> None:
    if n.op != "call_function":
        raise Unsupported(f"{n.name} is a {n.op} node")
    if n.target is operator.getitem:
        if n.kwargs or not isinstance(n.args[1], int):
            raise Unsupported(f"{n.name} indexes with {n.args[1]!r}")
        return
    if not isinstance(n.target, compat.OpOverload):
        name = getattr(n.target, "__name__", repr(n.target))
        raise Unsupported(f"{n.name} calls {name}, which is not an aten-style operator")


def _check_const(v, where: fx.Node) -> None:
    if isinstance(v, (torch.SymInt, torch.SymFloat, torch.SymBool)):
        raise Unsupported(f"{where.name} has a symbolic size")
    if isinstance(v, (list, tuple)):
        for x in v:
            _check_const(x, where)
    elif isinstance(v, torch.Tensor):
        raise Unsupported(f"{where.name} has a tensor constant")


def _schema_args(n: fx.Node, ref) -> list:
    """One (kind, payload) per schema argument, in schema order: positional, keyword, or the
    schema's default (``DEFAULT``, filled in by the interpreter)."""
    out = []
    for i, a in enumerate(n.target._schema.arguments):
        if i < len(n.args):
            out.append(ref(n.args[i], n))
        elif a.name in n.kwargs:
            out.append(ref(n.kwargs[a.name], n))
        elif a.has_default_value():
            out.append((DEFAULT, None))
        else:
            raise Unsupported(f"{n.name} leaves {a.name} of {n.target} unset")
    extra = set(n.kwargs) - {a.name for a in n.target._schema.arguments}
    if extra:
        raise Unsupported(f"{n.name} passes unknown keyword(s) {sorted(extra)}")
    return out


def _add_frees(instrs: list[Instr], slot: dict, keep: set, inputs: list) -> None:
    """Clear a slot after its last reader when every reader runs on its producer's stream
    (inputs: on one stream). Cross-stream values live until the call returns."""
    readers: dict[int, list[Instr]] = {}
    for ins in instrs:
        for kind, payload in ins.args:
            used = [payload] if kind == SLOT else payload if kind == SLOT_LIST else []
            for k in used:
                if k >= 0:
                    readers.setdefault(k, []).append(ins)
    producer = {ins.out: ins.stream for ins in instrs}
    for k, rs in readers.items():
        if k in keep:
            continue
        streams = {r.stream for r in rs}
        if len(streams) != 1 or producer.get(k, next(iter(streams))) not in streams:
            continue
        last = rs[-1]  # instrs are in plan order, which is each stream's order
        if k not in last.frees:
            last.frees.append(k)


# -- planning for the interpreter ---------------------------------------------------------------
def planning_machine(machine: MachineModel) -> MachineModel:
    """``machine`` with the interpreter's costs: a wait is :data:`NATIVE_SYNC_S`, and no op
    holds the GIL (``gil_s`` 0)."""
    return dataclasses.replace(machine, sync_cost_s=NATIVE_SYNC_S, gil_s=0.0)


def planning_streams(streams: int | None, cores: int) -> list[Stream] | None:
    """The streams a multi-stream native plan may use: ``streams`` (default: one per core)
    streams of one intra-op thread each, at most one per core; ``None`` when that is one
    stream (the serial plan is then the only one)."""
    k = min(streams or cores, cores)
    return [Stream(i, "cpu", 1) for i in range(k)] if k > 1 else None


# -- the source -------------------------------------------------------------------------------
def render(low: Lowered, gm: fx.GraphModule, header: str) -> tuple[str, dict]:
    """The program's source and its namespace (non-literal constants are globals)."""
    namer = Namer()
    namer.globals["_gm"] = gm
    names = {}
    for n in low.inputs:
        names[n] = n.name
    for ins in low.order:
        names[ins.node] = ins.node.name
    lines = [
        header,
        "import torch",
        "import autopar.runtime.native as _nt",
        "",
        "# One instruction per line: (node key, operator, overload, arguments, output slot,",
        "# events waited for, event set after (-1: none), slots cleared after).",
        "# Arguments: S(k) slot k, C(v) constant v, L([k, ...]) a list of slots (-1: None),",
        "# D the schema's default. Slots 0.." + f"{len(low.inputs) - 1}: "
        + ", ".join(n.name for n in low.inputs),
        "S, C, L, D = _nt.S, _nt.C, _nt.L, _nt.D",
    ]
    for s, code in enumerate(low.streams):
        where = "the calling thread" if s == 0 else f"OpenMP team thread {s}"
        lines.append(f"\nSTREAM_{s} = [  # runs on {where}")
        for ins in code:
            lines.append(f"    {_instr_text(ins, namer)},  # {_stmt(ins.node, names, namer)}")
        lines.append("]")
    order = [ins.stream for ins in low.order]
    lines += [
        "",
        "# the plan's order, a valid serial order (streams' instructions interleaved)",
        f"ORDER = {order!r}",
        "PROGRAM = _nt.program(",
        f"    [{', '.join(f'STREAM_{s}' for s in range(len(low.streams)))}],",
        f"    slots={low.n_slots}, events={low.n_events},",
        f"    inputs={low.input_slots!r}, outputs={low.outputs!r}, order=ORDER,",
        ")",
        "",
    ]
    params = [n.name for n in low.inputs if n.op == "placeholder"]
    attrs = [f"_gm.{n.target}" for n in low.inputs if n.op == "get_attr"]
    call = ", ".join(params + attrs)
    wrap = "tuple" if low.output_type is tuple else ""
    lines += [
        f"def forward({', '.join(params)}):",
        f"    return {wrap}(PROGRAM.run({call}))" if wrap else f"    return PROGRAM.run({call})",
        "",
    ]
    return "\n".join(lines), namer.globals


def _instr_text(ins: Instr, namer: Namer) -> str:
    args = ", ".join(_arg_text(a, namer) for a in ins.args)
    return (
        f"({ins.key!r}, {ins.op!r}, {ins.overload!r}, [{args}], {ins.out}, "
        f"{ins.waits!r}, {ins.signal}, {ins.frees!r})"
    )


def _arg_text(a, namer: Namer) -> str:
    kind, payload = a
    if kind == SLOT:
        return f"S({payload})"
    if kind == SLOT_LIST:
        return f"L({payload!r})"
    if kind == DEFAULT:
        return "D"
    return f"C({_const(payload, namer)})"


def _const(v, namer: Namer) -> str:
    if isinstance(v, (list, tuple)):
        inner = ", ".join(_const(x, namer) for x in v)
        return f"[{inner}]"
    return namer.const(v)


def _stmt(n: fx.Node, names: dict, namer: Namer) -> str:
    return f"{names[n]} = {call_expr(n, lambda p: names.get(p, p.name), namer)}"


def generate_native(
    gm: fx.GraphModule, plan: Plan, tag: str, *, provenance: dict | None = None
) -> Program:
    """The native program for ``plan`` (raises :class:`Unsupported` when the interpreter
    cannot run the graph, ``PlanError`` for a bad plan, and whatever building the
    interpreter raises: see ``autopar.runtime.native.load``)."""
    low = lower(gm, plan, tag)
    mode = f"native, {len(low.streams)} stream{'s' if len(low.streams) > 1 else ''}"
    header = provenance_header(plan, tag, provenance, low.notes, mode).rstrip("\n")
    source, namespace = render(low, gm, header)
    filename = f"<autopar native {tag} {plan.plan_hash} #{next(program_counter)}>"
    load_source(source, filename, namespace)
    return Program(
        source, namespace["forward"], plan, tag, filename, tuple(low.notes), low.stream_ids,
        executor="native", interpreter=namespace["PROGRAM"],
    )
