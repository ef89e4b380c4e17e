"""TorchScript executor: a CPU plan's streams as scripted segments run with fork/wait.

``generate_ts(gm, plan, tag)`` returns the same :class:`autopar.codegen.emit.Program` as
``codegen.generate``: ``.source`` is exactly what runs, ``.fn(*args)`` returns what
``gm(*args)`` returns. Instead of Python worker threads calling aten ops one by one (each
call holding the GIL for part of its few microseconds), every op runs in the TorchScript
interpreter, in C++, without the GIL, and the streams run on PyTorch's inter-op thread
pool (``torch.get_num_interop_threads()``); futures replace ``threading.Event``.

Segments. The schedule is ``codegen``'s (same plan checks, RNG relocation to the main
stream, in-place ordering, vector-clock-reduced waits). Each stream's nodes, in plan order,
are cut into *segments*: a new segment starts at a node that waits for another stream and
after a node another stream waits for. A segment depends on the segments holding the nodes
it waits for and on the previous segment of its stream; it waits for all of them at its
start, so a finished segment implies that everything it depends on has finished (which is
what the vector-clock reduction assumes). Segments of the main stream run inline in the
scripted driver ``_ts_forward``, in order (so RNG ops, all on the main stream, consume the
generator in eager order); segments of the other streams are ``torch.jit.fork``-ed as soon
as the driver has run the main segments they need, and get their producers' futures as
arguments. The driver waits for every future before it returns (nothing is left running).

Overloads. TorchScript cannot call ``torch.ops.aten.add.Tensor``; it calls
``torch.ops.aten.add`` and picks the overload by schema matching. After scripting, every
emitted op is checked against the FX target's overload; the only difference accepted is a
``Scalar`` overload chosen because the graph passes a Python number where the FX overload
takes a ``Tensor`` (``add.Tensor(x, 2)`` -> ``add.Scalar``: ATen implements those by
wrapping the number, the same as the Tensor overload does with a Python number).

Intra-op threads. A forked task runs on an inter-op pool thread, whose OpenMP thread count
is copied from the process default the first time that thread runs a parallel op;
TorchScript has no op to set it per task. The Python wrapper therefore sets the process
default to the plan's per-stream thread count (the largest, if they differ) for the call,
and restores it afterwards.

Fallback. Anything TorchScript cannot express (``call_method``/``call_module``, Python
callables other than ``operator`` arithmetic and ``getitem``, a non-``None`` ``Generator``,
slices, ``Scalar`` values crossing segments, a scripting error, an overload mismatch) makes
``generate_ts`` return the Python executor's program for the whole graph, with the reason
in ``Program.notes`` (``"torchscript executor not used: ..."``). Plan errors still raise.
Errors raised inside a scripted segment surface as ``torch.jit.Error`` (a
``RuntimeError``), not with the original exception type.
"""

from __future__ import annotations

import linecache
import math
import operator
import re
import warnings
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx

from autopar.capture.backend import node_key
from autopar.codegen import emit as _cg
from autopar.codegen.python import generate_python
from autopar.errors import PlanError
from autopar.planning.plan import Plan

_INFIX = {
    operator.add: "+", operator.sub: "-", operator.mul: "*", operator.floordiv: "//",
    operator.truediv: "/", operator.mod: "%", operator.eq: "==", operator.ne: "!=",
    operator.lt: "<", operator.le: "<=", operator.gt: ">", operator.ge: ">=",
}  # fmt: skip
_TS_RESERVED = _cg.RESERVED | {"Tensor", "List", "Tuple", "Optional", "math", "forward"}
FALLBACK_NOTE = "torchscript executor not used: "


class Unsupported(Exception):
    """The graph has something the TorchScript executor cannot run (the message says what)."""


@dataclass
class _Seg:
    id: int
    stream: int
    inline: bool
    nodes: list[fx.Node] = field(default_factory=list)
    deps: dict[int, None] = field(default_factory=dict)  # segment ids, ordered


# -- types and formatting -------------------------------------------------------------------
def _val_type(v: Any) -> str | None:
    if isinstance(v, torch.Tensor):
        return "Tensor"
    if isinstance(v, (bool, torch.SymBool)):
        return "bool"
    if isinstance(v, (int, torch.SymInt)):
        return "int"
    if isinstance(v, (float, torch.SymFloat)):
        return "float"
    if isinstance(v, (list, tuple)) and v and all(isinstance(x, torch.Tensor) for x in v):
        return "List[Tensor]" if isinstance(v, list) else f"Tuple[{', '.join(['Tensor'] * len(v))}]"
    return None


def _type_of(n: fx.Node, types: dict[fx.Node, str | None]) -> str | None:
    """The TorchScript annotation of ``n``'s value, or None when it has none we can write."""
    if _cg.is_op(n):
        rets = [r.type.annotation_str for r in n.target._schema.returns]
        t = rets[0] if len(rets) == 1 else f"Tuple[{', '.join(rets)}]" if rets else "NoneType"
    elif n.op == "call_function" and n.target is operator.getitem:
        src, i = n.args
        t = types.get(src) or ""
        if t.startswith("List[") and not isinstance(i, slice):
            t = t[5:-1]
        elif t.startswith("Tuple[") and isinstance(i, int):
            t = _split_types(t[6:-1])[i]
        else:
            t = None
    else:
        t = _val_type(n.meta.get("val"))
        if t is None and n.op in ("placeholder", "get_attr") and "val" not in n.meta:
            t = "Tensor"
    if t is None or "number" in t or "Scalar" in t or "Generator" in t or "Device" in t:
        return None
    return t


def _split_types(s: str) -> list[str]:
    out, depth, cur = [], 0, ""
    for ch in s:
        if ch == "," and depth == 0:
            out.append(cur.strip())
            cur = ""
            continue
        depth += ch == "["
        depth -= ch == "]"
        cur += ch
    return out + [cur.strip()] if cur.strip() else out


def _const(c: Any) -> str:
    if c is None or isinstance(c, (bool, int, str)):
        return repr(c)
    if isinstance(c, float):
        if math.isnan(c):
            return 'float("nan")'
        if math.isinf(c):
            return 'float("inf")' if c > 0 else 'float("-inf")'
        return repr(c)
    if isinstance(c, (torch.dtype, torch.layout, torch.memory_format)):
        return repr(c) if repr(c).startswith("torch.") else f"torch.{c}"
    if isinstance(c, torch.device):
        return f"torch.device({str(c)!r})"
    raise Unsupported(f"constant {c!r} of type {type(c).__name__}")


def _fmt(v: Any, ref) -> str:
    if isinstance(v, fx.Node):
        return ref(v)
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(_fmt(x, ref) for x in v) + "]"
    if isinstance(v, slice):
        raise Unsupported("a slice argument")
    return _const(v)


def _call(n: fx.Node, ref) -> str:
    if n.op != "call_function":
        raise Unsupported(f"{n.op} node {n.name} ({n.target})")
    if n.target is operator.getitem:
        if isinstance(n.args[1], slice) or n.kwargs:
            raise Unsupported(f"getitem with a slice or kwargs ({n.name})")
        return f"{ref(n.args[0])}[{_fmt(n.args[1], ref)}]"
    if n.target in _INFIX and len(n.args) == 2 and not n.kwargs:
        return f"{_fmt(n.args[0], ref)} {_INFIX[n.target]} {_fmt(n.args[1], ref)}"
    if n.target is operator.neg and len(n.args) == 1:
        return f"-{_fmt(n.args[0], ref)}"
    t = n.target
    if isinstance(t, torch._ops.OpOverload):
        for arg, val in _cg.schema_args(n):
            if "Generator" in str(arg.type) and val is not None:
                raise Unsupported(f"{n.name} ({t}) takes a Generator")
        ns, name = t._schema.name.split("::")
    elif isinstance(t, torch._ops.OpOverloadPacket):
        ns, name = t._qualified_op_name.split("::")
    else:
        raise Unsupported(f"Python callable {getattr(t, '__name__', t)!r} ({n.name})")
    args = [_fmt(a, ref) for a in n.args]
    args += [f"{k}={_fmt(x, ref)}" for k, x in n.kwargs.items()]
    return f"torch.ops.{ns}.{name}({', '.join(args)})"


# -- segments -------------------------------------------------------------------------------
def _cut(sched) -> tuple[list[_Seg], dict[fx.Node, _Seg]]:
    """Cut each stream into segments (see the module docstring)."""
    segs: list[_Seg] = []
    seg_of: dict[fx.Node, _Seg] = {}
    open_: dict[int, _Seg] = {}  # the stream's segment still taking nodes
    last: dict[int, _Seg] = {}  # the stream's latest segment
    signals = set(sched.signals)
    for n in sched.compute:
        s = sched.stream[n]
        if s not in open_ or sched.waits[n]:
            seg = _Seg(len(segs), s, s == sched.main)
            if s in last:
                seg.deps[last[s].id] = None
            for p in sched.waits[n]:
                seg.deps[seg_of[p].id] = None
            segs.append(seg)
            open_[s] = last[s] = seg
        open_[s].nodes.append(n)
        seg_of[n] = open_[s]
        if n in signals:
            del open_[s]
    return segs, seg_of


def _sources(g: _Seg, seg_of) -> dict[fx.Node, None]:
    """Values ``g`` uses that it does not compute (graph inputs or other segments' values)."""
    return {
        p: None for n in g.nodes for p in n.all_input_nodes if seg_of.get(p) is not g
    }  # fmt: skip


# -- emission -------------------------------------------------------------------------------
@dataclass
class _Emitted:
    lines: list[str]
    owners: list
    segs: list[_Seg]
    inputs: list[fx.Node]
    leaves: list[fx.Node]
    local: dict[fx.Node, str]


def _emit(gm: fx.GraphModule, sched) -> _Emitted:
    nodes = list(gm.graph.nodes)
    local = {n: n.name + "_" if n.name in _TS_RESERVED else n.name for n in nodes}
    inputs = [n for n in nodes if n.op in ("placeholder", "get_attr")]
    (out_node,) = [n for n in nodes if n.op == "output"]
    segs, seg_of = _cut(sched)
    types: dict[fx.Node, str | None] = {}
    for n in nodes:
        if n.op != "output":
            types[n] = _type_of(n, types)

    def typed(n: fx.Node) -> str:
        if types[n] is None:
            raise Unsupported(f"value {n.name} crosses segments but has no TorchScript type")
        return types[n]

    leaves = list(dict.fromkeys(out_node.all_input_nodes))
    exports: dict[int, dict[fx.Node, None]] = {g.id: {} for g in segs}
    for g in segs:
        for p in _sources(g, seg_of):
            if p in seg_of:
                exports[seg_of[p].id][p] = None
    for p in leaves:
        if p in seg_of:
            exports[seg_of[p].id][p] = None
    ret_t = {g.id: _tuple_t([typed(p) for p in exports[g.id]]) for g in segs}

    def unpack(p: fx.Node) -> str:
        d = seg_of[p].id
        return f"{local[p]} = r{d}[{list(exports[d]).index(p)}]"

    lines: list[str] = []
    owners: list = []
    params: dict[int, list[str]] = {}
    waits_in: dict[int, list[int]] = {}  # forked segment -> futures it takes and waits for
    for g in segs:
        src = _sources(g, seg_of)
        # an inline segment gets every value as an argument (the driver waited for them);
        # a forked one gets inline/graph values as arguments and futures for forked ones
        plain = [p for p in src if g.inline or p not in seg_of or seg_of[p].inline]
        futs = list(dict.fromkeys([d for d in g.deps if not segs[d].inline] + [
            seg_of[p].id for p in src if p not in plain
        ])) if not g.inline else []  # fmt: skip
        waits_in[g.id] = futs
        sig = [f"{local[p]}: {typed(p)}" for p in plain]
        sig += [f"f{d}: torch.jit.Future[{ret_t[d]}]" for d in futs]
        params[g.id] = [local[p] for p in plain] + [f"f{d}" for d in futs]
        kind = "run inline by the driver" if g.inline else "forked"
        deps = ", ".join(f"_seg_{d}" for d in g.deps) or "nothing"
        lines += [f"def _seg_{g.id}({', '.join(sig)}) -> {ret_t[g.id]}:"]
        lines += [f"    # stream {g.stream}, {kind}; runs after {deps}"]
        lines += [f"    r{d} = torch.jit.wait(f{d})" for d in futs]
        lines += [f"    {unpack(p)}" for p in src if p not in plain]
        owners += [None] * (2 + len(futs) + len(src) - len(plain))
        for n in g.nodes:
            lines.append(f"    {local[n]} = {_call(n, lambda m: local[m])}")
            owners.append(n)
        outs = [local[p] for p in exports[g.id]]
        lines += [f"    return ({', '.join(outs)}{',' if len(outs) == 1 else ''})", "", ""]
        owners += [None] * 3

    # the driver: inline segments in order, forks as early as their inputs allow
    body: list[str] = []
    done: set[int] = set()
    forked: list[int] = []
    waited: set[int] = set()
    unpacked: set[fx.Node] = set()

    def fetch(p: fx.Node) -> None:
        if p in seg_of and seg_of[p].id in forked and p not in unpacked:
            d = seg_of[p].id
            if d not in waited:
                body.append(f"    r{d} = torch.jit.wait(f{d})")
                waited.add(d)
            body.append(f"    {unpack(p)}")
            unpacked.add(p)

    def ready(g: _Seg) -> bool:
        need = set(g.deps) | {seg_of[p].id for p in _sources(g, seg_of) if p in seg_of}
        return all(d in done or (d in forked and not g.inline) for d in need)

    pending = list(segs)
    while pending:
        for g in [g for g in pending if not g.inline]:
            if ready(g):
                body.append(f"    f{g.id} = torch.jit.fork(_seg_{g.id}, {', '.join(params[g.id])})")
                forked.append(g.id)
                pending.remove(g)
        inline = [g for g in pending if g.inline]
        if not inline:
            if pending:
                raise PlanError("autopar internal error: TorchScript segments left unforked")
            break
        g = inline[0]
        for d in g.deps:
            if d in forked and d not in waited:
                body.append(f"    r{d} = torch.jit.wait(f{d})")
                waited.add(d)
        for p in _sources(g, seg_of):
            fetch(p)
        outs = [local[p] for p in exports[g.id]]
        call = f"_seg_{g.id}({', '.join(params[g.id])})"
        lhs = f"{', '.join(outs)}{',' if len(outs) == 1 else ''} = " if outs else ""
        body.append(f"    {lhs}{call}")
        done.add(g.id)
        pending.remove(g)
    for d in forked:  # nothing is left running when the driver returns
        if d not in waited:
            body.append(f"    r{d} = torch.jit.wait(f{d})")
            waited.add(d)
    for p in leaves:
        fetch(p)
    ret = ", ".join(local[p] for p in leaves)
    body.append(f"    return ({ret}{',' if len(leaves) == 1 else ''})")
    sig = ", ".join(f"{local[n]}: {typed(n)}" for n in inputs)
    lines += [f"def _ts_forward({sig}):", *body]
    owners += [None] * (len(body) + 1)
    return _Emitted(lines, owners, segs, inputs, leaves, local)


def _tuple_t(ts: list[str]) -> str:
    return f"Tuple[{', '.join(ts)}]" if ts else "Tuple[()]"


# -- overload check -------------------------------------------------------------------------
def _same_overload(n: fx.Node, ts_schema: str) -> bool:
    """Whether TorchScript's resolved overload ``ts_schema`` computes what ``n.target`` does."""
    want = n.target._schema
    if ts_schema == str(want):
        return True
    got = torch._C.parse_schema(ts_schema)
    if len(got.arguments) != len(want.arguments) or len(got.returns) != len(want.returns):
        return False
    by_name = {a.name: v for a, v in _cg.schema_args(n)}
    for a, b in zip(want.arguments, got.arguments, strict=True):
        if str(a.type) == str(b.type):
            continue
        number = isinstance(by_name.get(a.name), (int, float, bool))
        if not (str(a.type) == "Tensor" and str(b.type) in ("Scalar", "number") and number):
            return False
    return [str(r.type) for r in want.returns] == [str(r.type) for r in got.returns]


def _ts_name(tn) -> str:
    """The local a TorchScript node's result was assigned to (``""`` when unnamed)."""
    outs = list(tn.outputs())
    if len(outs) == 1:
        name = outs[0].debugName()
    else:  # a multi-output op: its results are packed by a TupleConstruct named after it
        users = [u.user for u in outs[0].uses() if u.user.kind() == "prim::TupleConstruct"]
        name = users[0].output().debugName() if users else ""
    return re.sub(r"\.\d+$", "", name) if not name.isdigit() else ""


def _check_overloads(emitted: _Emitted, fns: dict[str, Any]) -> None:
    """Every op TorchScript calls computes what the FX node does (see the module docstring).

    Scripting already ran dead-code elimination, so an op whose result nothing uses may be
    gone (it does not run: fine). Ops are matched by the local they assign, else by kind
    in order."""
    by_local = {emitted.local[n]: n for n in emitted.local}
    for g in emitted.segs:
        todo = [n for n in g.nodes if _cg.is_op(n)]
        for tn in torch.jit.script(fns[f"_seg_{g.id}"]).graph.nodes():
            candidates = [n for n in todo if n.target._schema.name == tn.kind()]
            if not candidates:
                continue
            name = _ts_name(tn)
            n = by_local.get(name)
            if n not in candidates:
                if name in by_local:  # a named value of another node (e.g. int arithmetic)
                    continue
                n = candidates[0]
            todo.remove(n)
            if not _same_overload(n, tn.schema()):
                raise Unsupported(
                    f"TorchScript resolves {n.name} ({n.target}) to {tn.schema().split('(')[0]}"
                )


# -- entry point ----------------------------------------------------------------------------
def wanted(gm: fx.GraphModule, plan: Plan, tag: str, executor: str) -> bool:
    """Whether ``codegen.generate(executor=...)`` hands this graph to :func:`generate_ts`:
    ``"torchscript"``: every CPU plan; ``"auto"``: CPU plans using several streams."""
    place, dev = plan.placement, {s.id: s.device for s in plan.streams}
    used = {
        place[k] for n in gm.graph.nodes
        if n.op in _cg.COMPUTE_OPS and (k := node_key(tag, n.name)) in place
    }  # fmt: skip
    if any(not dev.get(s, "cpu").startswith("cpu") for s in used):
        return False
    return executor == "torchscript" or len(used) > 1


def generate_ts(
    gm: fx.GraphModule,
    plan: Plan,
    tag: str,
    *,
    provenance: dict | None = None,
    timeout_s: float = 0.0,
) -> _cg.Program:
    """The TorchScript program for a CPU ``plan`` of ``gm``, or the Python one (with the reason
    in ``notes``) when the graph has something TorchScript cannot run.

    Example::

        >>> prog = generate_ts(gm, plan, "g0.fw")  # doctest: +SKIP
        >>> prog.notes                             # doctest: +SKIP
    """
    keys = {node_key(tag, n.name) for n in gm.graph.nodes if n.op in _cg.COMPUTE_OPS}
    devices = {plan.stream_of(k).device for k in keys & set(plan.placement)}
    if any(not d.startswith("cpu") for d in devices):
        return _fallback(gm, plan, tag, provenance, timeout_s, f"devices {sorted(devices)}")
    sched = _cg.schedule(gm, plan, tag, False)  # plan errors raise here, as in codegen
    try:
        return _generate(gm, plan, tag, sched, provenance)
    except Unsupported as exc:
        reason = str(exc)
    except (RuntimeError, torch.jit.frontend.FrontendError) as exc:  # scripting failed
        reason = f"TorchScript could not compile it: {str(exc).strip().splitlines()[0]}"
    return _fallback(gm, plan, tag, provenance, timeout_s, reason)


def _fallback(gm, plan, tag, provenance, timeout_s, reason: str) -> _cg.Program:
    prog = generate_python(gm, plan, tag, provenance=provenance, timeout_s=timeout_s)
    prog.notes = (*prog.notes, FALLBACK_NOTE + reason)
    return prog


def _generate(gm, plan: Plan, tag: str, sched, provenance) -> _cg.Program:
    for n in sched.compute:
        if _cg.is_rng(n) and not n.users:  # TorchScript's dead-code elimination drops it
            raise Unsupported(f"random op {n.name} has an unused result")
    em = _emit(gm, sched)
    threads = max(s.threads for s in plan.streams if s.id in set(sched.stream.values()))
    namer = _cg.Namer()
    namer.globals["_gm"] = gm
    ref = lambda n: em.local[n]
    out = _cg.fmt(list(gm.graph.nodes)[-1].args[0], ref, namer)
    leaves = ", ".join(em.local[p] for p in em.leaves)
    args = ", ".join(
        f"_gm.{n.target}" if n.op == "get_attr" else em.local[n] for n in em.inputs
    )  # fmt: skip
    params = ", ".join(em.local[n] for n in em.inputs if n.op == "placeholder")
    tail = [
        "",
        "",
        "_TS_FORWARD = torch.jit.script(_ts_forward)",
        "",
        "",
        f"def forward({params}):",
        f"    prev = torch.get_num_threads()  # forked tasks use the process default: {threads}",
        f"    if prev != {threads}:",
        f"        torch.set_num_threads({threads})",
        "    try:",
        f"        {leaves}{',' if len(em.leaves) == 1 else ''} = _TS_FORWARD({args})"
        if em.leaves
        else f"        _TS_FORWARD({args})",
        "    finally:",
        f"        if prev != {threads}:",
        "            torch.set_num_threads(prev)",
        f"    return {out}",
    ]
    n_fork = sum(not g.inline for g in em.segs)
    mode = (
        f"cpu torchscript, {len(sched.stream_ids)} streams, {len(em.segs)} segments "
        f"({n_fork} forked)"
    )
    filename = f"<autopar-ts {tag} {plan.plan_hash} #{next(_cg.program_counter)}>"
    header = _cg.provenance_header(plan, tag, provenance, sched.notes, mode)
    header += (
        "import torch\nfrom typing import List, Optional, Tuple\n\nTensor = torch.Tensor\n\n\n"
    )
    first = header.count("\n") + 1
    lines = em.lines + tail
    owners = em.owners + [None] * len(tail)
    node_at_line = {first + i: node_key(tag, o.name) for i, o in enumerate(owners) if o is not None}
    source = header + "\n".join(lines) + "\n"
    # torch.jit.script reads the source through linecache and needs a module name
    linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)
    namer.globals["__name__"] = f"autopar_ts_{abs(hash(filename))}"
    with warnings.catch_warnings():  # torch.jit.script warns: deprecated
        warnings.simplefilter("ignore", DeprecationWarning)
        exec(compile(source, filename, "exec"), namer.globals)
        _check_overloads(em, namer.globals)
    return _cg.Program(
        source, namer.globals["forward"], plan, tag, filename, tuple(sched.notes),
        tuple(sched.stream_ids), node_at_line,
    )  # fmt: skip
