"""The shared program builder: readable names, the schedule of a plan (waits reduced with
the planner's vector clocks), statements with early ``del``, and the provenance header. The
emitters (``python``, ``cuda``, ``native``) build on it.

The graph analysis it schedules by (in-place writes, views, RNG) is
``autopar.capture.analysis``, shared with the profiler and the pipeline; its names are
re-exported here for the emitters.

Generated programs import what they call at run time themselves
(``import autopar.runtime.streams as _rt`` in their header): codegen never imports the
runtime, and the program's source is the whole story.
"""

from __future__ import annotations

import datetime
import itertools
import linecache
import math
import operator
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx

from autopar.capture.analysis import (
    buffer_analysis,
    is_rng,
    write_orderings,
)
from autopar.capture.backend import node_key
from autopar.errors import PlanError, describe_node
from autopar.planning.clocks import VectorClocks
from autopar.planning.plan import Plan

COMPUTE_OPS = ("call_function", "call_method", "call_module")
RESERVED = {"torch", "aten", "operator", "inf", "nan", "st", "v", "ev", "w", "a", "_rt", "_gm",
            "_args", "forward", "forward_boxed"}  # fmt: skip
program_counter = itertools.count()


@dataclass
class Program:
    """A generated program: ``fn(*args)`` returns what ``gm(*args)`` returns.

    Example::

        >>> prog = generate(gm, plan, "g0.fw")        # doctest: +SKIP
        >>> out = prog.fn(x); prog.save("/tmp/g0_fw.py")  # doctest: +SKIP
    """

    source: str
    fn: Callable[..., Any]
    plan: Plan
    tag: str
    filename: str
    notes: tuple[str, ...] = ()
    streams_used: tuple[int, ...] = ()
    node_at_line: dict[int, str] = field(default_factory=dict)
    executor: str = ""  # "native" for the native interpreter's programs (who made it)
    # the native interpreter's program object that ``fn`` runs (``PROGRAM`` in the source)
    interpreter: Any = None
    # ``boxed(args)``: ``fn`` taking one list, which it empties once it has unpacked it
    # (``forward_boxed`` in the source; None where the emitter writes none): see Boxed
    boxed: Callable[[list], Any] | None = None

    def __call__(self, *args: Any) -> Any:
        return self.fn(*args)

    def save(self, path: str) -> str:
        """Write the source (provenance header included) to ``path``; return ``path``."""
        with open(path, "w") as f:
            f.write(self.source)
        return path


class Boxed:
    """A graph record's runner for ``program``: ``runner(args)`` (one list, as AOTAutograd
    calls a graph) returns ``program.fn(*args)``; ``runner.program`` says what runs (the
    native direct path reads it: ``autopar.runtime.native_direct``).

    AOTAutograd's boxed calling convention: the callee empties the list it is given. The
    caller keeps no other reference to a backward's saved tensors, so once the list is
    empty each saved tensor dies at the program's ``del`` after its last use, not when the
    backward returns (a backward's peak memory is then eager's, not the sum of everything
    saved). ``program.boxed`` does that (it unpacks into its own locals, then clears);
    a program without one (the CPU worker streams, the native interpreter) gets a list
    emptied here, before it runs, and holds the tensors until it returns.
    """

    __slots__ = ("fn", "boxed", "program")

    def __init__(self, program: Any):
        self.program, self.fn = program, program.fn
        self.boxed = getattr(program, "boxed", None)

    def __call__(self, args: list) -> Any:
        if self.boxed is not None:
            return self.boxed(args)
        taken = tuple(args)
        args.clear()
        return self.fn(*taken)


# -- formatting -------------------------------------------------------------------------------
class Namer:
    """Readable names for locals and for the globals the program needs."""

    def __init__(self) -> None:
        self.globals: dict[str, Any] = {
            "torch": torch,
            "aten": torch.ops.aten,
            "operator": operator,
            "inf": math.inf,
            "nan": math.nan,
        }
        self._ids: dict[int, str] = {}

    def add_global(self, hint: str, obj: Any) -> str:
        if id(obj) in self._ids:
            return self._ids[id(obj)]
        name = "_" + re.sub(r"\W+", "_", hint).strip("_")
        base, k = name, 0
        while name in self.globals:
            k += 1
            name = f"{base}_{k}"
        self.globals[name] = obj
        self._ids[id(obj)] = name
        return name

    def target(self, node: fx.Node) -> str:
        t = node.target
        if isinstance(t, torch._ops.OpOverload):
            ns, name = t._schema.name.split("::")
            head = "aten" if ns == "aten" else f"torch.ops.{ns}"
            return f"{head}.{name}.{t._overloadname}"
        if isinstance(t, torch._ops.OpOverloadPacket):
            return f"torch.ops.{t._qualified_op_name.replace('::', '.')}"
        return self.add_global(getattr(t, "__qualname__", getattr(t, "__name__", "fn")), t)

    def const(self, c: Any) -> str:
        if c is None or isinstance(c, (bool, int, str)):
            return repr(c)
        if isinstance(c, float):
            return repr(c)  # inf / nan are globals
        if isinstance(c, (torch.dtype, torch.layout, torch.memory_format)):
            return repr(c) if repr(c).startswith("torch.") else f"torch.{c}"
        if isinstance(c, torch.device):
            return f"torch.device({str(c)!r})"
        return self.add_global(f"const_{type(c).__name__}", c)


def fmt(value: Any, ref: Callable[[fx.Node], str], namer: Namer) -> str:
    if isinstance(value, fx.Node):
        return ref(value)
    if isinstance(value, tuple):
        inner = ", ".join(fmt(x, ref, namer) for x in value)
        return f"({inner},)" if len(value) == 1 else f"({inner})"
    if isinstance(value, list):
        return "[" + ", ".join(fmt(x, ref, namer) for x in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k!r}: {fmt(x, ref, namer)}" for k, x in value.items()) + "}"
    if isinstance(value, slice):
        parts = (value.start, value.stop, value.step)
        return "slice(" + ", ".join(fmt(x, ref, namer) for x in parts) + ")"
    return namer.const(value)


def call_expr(n: fx.Node, ref: Callable[[fx.Node], str], namer: Namer) -> str:
    args = [fmt(a, ref, namer) for a in n.args]
    args += [f"{k}={fmt(x, ref, namer)}" for k, x in n.kwargs.items()]
    if n.op == "call_function" and n.target is operator.getitem and not n.kwargs:
        return f"{args[0]}[{args[1]}]"
    if n.op == "call_method":
        return f"{args[0]}.{n.target}({', '.join(args[1:])})"
    if n.op == "call_module":
        mod = namer.add_global(f"mod_{n.target}", n.graph.owning_module.get_submodule(n.target))
        return f"{mod}({', '.join(args)})"
    return f"{namer.target(n)}({', '.join(args)})"


# -- scheduling -------------------------------------------------------------------------------
@dataclass
class Schedule:
    compute: list[fx.Node]  # in plan order
    stream: dict[fx.Node, int]
    main: int
    stream_ids: list[int]  # main first, then the other used streams in plan order
    waits: dict[fx.Node, list[fx.Node]]
    signals: list[fx.Node]
    notes: list[str]


def schedule(gm: fx.GraphModule, plan: Plan, tag: str, cuda: bool) -> Schedule:
    nodes = list(gm.graph.nodes)
    key = {n: node_key(tag, n.name) for n in nodes}
    by_key = {k: n for n, k in key.items()}
    place = plan.placement
    ids = [s.id for s in plan.streams]
    compute = [n for n in nodes if n.op in COMPUTE_OPS]
    missing = [n for n in compute if key[n] not in place]
    if missing:
        shown = "; ".join(describe_node(n) for n in missing[:3])
        raise PlanError(
            f"plan {plan.graph_id!r} places no stream for {len(missing)} node(s) of graph "
            f"{tag!r} (e.g. {shown}). Re-plan this graph, and check that the tag is the one "
            "the plan was made for (node keys are '<tag>/<node.name>')."
        )
    bad = sorted({place[key[n]] for n in compute} - set(ids))
    if bad:
        raise PlanError(f"plan places nodes on streams {bad} that plan.streams lacks {ids}")
    pos = {k: i for i, k in enumerate(plan.order)}
    unordered = [key[n] for n in compute if key[n] not in pos]
    if unordered:
        raise PlanError(f"plan.order lacks {len(unordered)} placed node(s), e.g. {unordered[:3]}")
    gpos = {n: i for i, n in enumerate(nodes)}
    compute.sort(key=lambda n: pos[key[n]])
    stream = {n: place[key[n]] for n in compute}
    only = set(stream.values())
    # one stream used: run it on the calling thread (straight-line code, no workers)
    main = only.pop() if len(only) == 1 else (0 if 0 in ids else ids[0])
    notes: list[str] = []

    deps: dict[fx.Node, set] = {n: set() for n in compute}
    for n in compute:
        for p in n.all_input_nodes:
            if p in deps:
                if pos[key[p]] > pos[key[n]]:
                    raise PlanError(
                        f"plan.order runs {key[n]} before its input {key[p]}: the order must "
                        "be topological. Re-run the planner (its verifier catches this)."
                    )
                deps[n].add(p)

    # RNG ops: eager order, and (CPU) all on the calling thread.
    rng = [n for n in compute if is_rng(n)]
    if [gpos[n] for n in rng] != sorted(gpos[n] for n in rng):
        raise PlanError(
            "plan.order reorders random ops relative to the graph "
            f"({', '.join(key[n] for n in rng[:4])}...): they share the global generator, so "
            "results would differ from eager. Keep random ops in graph order."
        )
    for n in rng:
        if not cuda and stream[n] != main:
            notes.append(f"RNG op {key[n]} moved from stream {stream[n]} to stream {main}")
            stream[n] = main

    # In-place writes: readers of the written buffer keep their eager order around the write.
    base, writes = buffer_analysis(nodes)
    for first, second, b, m in write_orderings(compute, base, writes, gpos):
        if pos[key[first]] > pos[key[second]]:
            raise PlanError(
                f"plan.order runs {key[second]} before {key[first]}, but one of them "
                f"writes in place the buffer of {b.name} the other uses "
                f"({describe_node(m)}). Keep them in graph order."
            )
        deps[second].add(first)

    for s in plan.syncs:
        src, dst = by_key.get(s.src), by_key.get(s.dst)
        if src in deps and dst in deps:
            if pos[s.src] > pos[s.dst]:
                raise PlanError(f"plan sync {s.src} -> {s.dst} points backwards in plan.order")
            deps[dst].add(src)

    # Vector clocks (planning.clocks): skip a wait already implied by stream order and the
    # earlier waits of the same stream; later producers first, their waits imply more.
    clocks = VectorClocks()
    waits: dict[fx.Node, list[fx.Node]] = {}
    signals: dict[fx.Node, None] = {}
    for n in compute:
        d = stream[n]
        need = sorted((p for p in deps[n] if stream[p] != d), key=lambda p: -pos[key[p]])
        waits[n] = clocks.reduce(d, need)
        signals.update(dict.fromkeys(waits[n]))
        clocks.run(d, n)
    active = set(stream.values())
    used = [main] + [s for s in ids if s != main and s in active]
    for n in compute:
        n.meta["autopar.stream"] = stream[n]
    return Schedule(compute, stream, main, used, waits, list(signals), notes)


# -- emission -------------------------------------------------------------------------------
class Stmt:
    __slots__ = ("text", "uses", "defines", "node")

    def __init__(self, text: str, uses=(), defines=None, node=None):
        self.text, self.uses, self.defines, self.node = text, list(uses), defines, node


def with_deletes(stmts: list[Stmt], keep: set[str]) -> list[Stmt]:
    """Append ``del x`` after the statement that uses local ``x`` last (frees buffers early)."""
    seen: set[str] = set(keep)
    for s in reversed(stmts):
        dead = [u for u in dict.fromkeys(s.uses + ([s.defines] if s.defines else [])) if u]
        dead = [u for u in dead if u not in seen]
        seen.update(dead)
        if dead and not s.text.startswith("return"):
            s.text += f";  del {', '.join(dead)}"
    return stmts


def provenance_header(
    plan: Plan, tag: str, provenance: dict | None, notes: list[str], mode: str
) -> str:
    prov = dict(plan.provenance)
    prov.update(provenance or {})
    streams = ", ".join(f"{s.id}: {s.device} x{s.threads}t" for s in plan.streams)
    lines = [
        f"autopar generated program for graph {tag} ({mode}) - do not edit, re-generate it",
        f"plan hash:      {plan.plan_hash}",
        f"plan graph:     {plan.graph_id}",
        f"policy:         {plan.policy}",
        f"streams:        {streams}",
        f"predicted time: {plan.predicted_step_time * 1e3:.3f} ms "
        f"(serial {plan.serial_time * 1e3:.3f} ms, bound {plan.lower_bound * 1e3:.3f} ms)",
        f"profile store:  {prov.get('store', prov.get('profile_store', 'unknown'))}",
        f"torch:          {torch.__version__}",
        f"autopar:        {getattr(sys.modules.get('autopar'), '__version__', 'unknown')}",
        f"generated:      {datetime.datetime.now().isoformat(timespec='seconds')}",
    ]
    lines += [f"{k}: {v}" for k, v in prov.items() if k not in ("store", "profile_store")]
    lines += [f"note: {x}" for x in notes]
    return "".join(f"# {ln}\n" for ln in lines)


#: The first lines of every generated program after its header: what it calls at run time.
PROGRAM_IMPORTS = "import torch\nimport autopar.runtime.streams as _rt\n\n"


def load_source(source: str, filename: str, namespace: dict) -> None:
    """``exec`` a generated program into ``namespace``, registered with ``linecache`` so
    tracebacks show its lines (mtime None: ``linecache.checkcache`` never drops it)."""
    linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)
    exec(compile(source, filename, "exec"), namespace)


def prologue(inputs, local) -> list[str]:
    """``forward``'s first lines: get_attr values are read from the module at call time."""
    return [
        f"    {local[n]} = _gm.{n.target}" for n in inputs if n.op == "get_attr"
    ]  # fmt: skip


