"""Capture: the ``torch.compile`` backend that yields forward and backward aten FX graphs.

Dynamo turns the user's Python into FX graphs (one per region between graph breaks);
AOTAutograd traces each into a functionalized aten *forward* graph and *backward* graph.
This module records them as ``GraphRecord`` objects tagged ``g<k>.fw`` / ``g<k>.bw`` and
hands each one, lazily on its first real call, to a ``prepare`` callback (profile, plan,
codegen: composed by ``autopar.api``). Capture never imports the later stages.

Example::

    >>> import torch
    >>> cap = Capture(prepare=run_serially)
    >>> f = torch.compile(torch.nn.Linear(4, 2), backend=cap.backend)
    >>> _ = f(torch.randn(3, 4)).sum().backward()
    >>> [r.tag for r in cap.records]
    ['g0.fw', 'g0.bw']

Layouts: every captured aten graph goes through :func:`autopar.capture.layout.robust_views`
first, so a ``view`` that relied on a fake kernel's stride prediction cannot fail on the
real kernel's layout (BatchNorm on a transposed input, dropout's backward).

Failure policy: if capturing or preparing a graph fails, that graph runs as Dynamo captured
it (eagerly) or as AOTAutograd captured it (the aten graph, op by op), with what the failed
attempt did to the inputs and the random generators undone first. One ``FallbackWarning``,
naming the node and the user's source line, comes only *after* that run succeeded: a warning
that promises correct results is never followed by an exception. When the fallback fails
too, its exception propagates, with a note naming the graph and the node.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import itertools
import logging
import re
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx

from autopar import compat
from autopar.capture.analysis import buffer_analysis
from autopar.capture.dynamo_graph import DynamoGraph, OnGraphCall
from autopar.capture.layout import robust_views
from autopar.errors import FallbackWarning, describe_node, node_source, warn_fallback

_log = logging.getLogger(__name__)

# The callback that turns a recorded graph into a runner, on the graph's first real call.
# It gets the record and the real (boxed) argument list, runs the graph once for real and
# returns (outputs, runner) where ``runner(args_list)`` runs it from then on.
Prepare = Callable[["GraphRecord", list], tuple[Any, Callable[[list], Any]]]
# Optional hook around every later call: ``on_call(record, runner, args) -> outputs``
# (``autopar.adapt.monitor`` times calls there, re-profiles and swaps programs).
OnCall = Callable[["GraphRecord", Callable[[list], Any], list], Any]


def node_key(graph_tag: str, node_name: str) -> str:
    """The plan-wide name of an FX node: ``"<graph_tag>/<node.name>"`` (e.g. ``"g0.fw/addmm"``).

    Made here, once, for every stage: capture stores it in ``node.meta["autopar.key"]``."""
    return f"{graph_tag}/{node_name}"


#: An FX pass run on each Dynamo graph before AOTAutograd traces it (e.g. fusing a user's
#: RNN cell loop). It edits ``gm`` in place and returns how many rewrites it made.
GraphPass = Callable[[fx.GraphModule], int]


@dataclass(frozen=True)
class Provenance:
    """One stage's stamp on a unit: what it did and how long it took."""

    stage: str  # "capture", "profile", "plan", "codegen", "verdict", "replan", ...
    seconds: float = 0.0
    note: str = ""


@dataclass(frozen=True)
class GraphUnit:
    """One captured aten graph and what the stages made of it: the object that flows
    capture -> profiling -> planning -> codegen. Frozen: each stage returns
    ``unit.replace(stage, seconds, note, field=value)``, which adds a provenance entry.

    Example::

        >>> u = GraphUnit("g0.fw", "forward", gm)                       # doctest: +SKIP
        >>> u = u.replace("profile", 0.2, table=table)                  # doctest: +SKIP
        >>> [p.stage for p in u.provenance], u.timings                  # doctest: +SKIP
        (['profile'], {'profile': 0.2})
    """

    tag: str  # "g0.fw", "g0.bw", ...
    phase: str  # "forward" | "backward"
    gm: fx.GraphModule = field(repr=False)
    group: int = 0  # k of the Dynamo graph it came from (g<k>.fw and g<k>.bw share it)
    capture_s: float = 0.0  # time spent tracing up to this graph (AOTAutograd included)
    table: Any = field(default=None, repr=False)  # profile DataFrame
    plan: Any = field(default=None, repr=False)  # autopar.planning.plan.Plan
    program: Any = field(default=None, repr=False)  # what runs: autopar.codegen.emit.Program
    executor: str = "captured"  # the name of what runs it (see autopar.codegen.emitters)
    fallback: str | None = None  # why this graph runs as captured, if it does
    provenance: tuple[Provenance, ...] = ()

    def replace(self, stage: str, seconds: float = 0.0, note: str = "", **changes) -> GraphUnit:
        """A copy with ``changes`` applied and ``Provenance(stage, seconds, note)`` added."""
        stamp = Provenance(stage, seconds, note)
        return dataclasses.replace(self, provenance=(*self.provenance, stamp), **changes)

    @property
    def timings(self) -> dict[str, float]:
        """Seconds per stage (summed when a stage ran more than once)."""
        out: dict[str, float] = {}
        for p in self.provenance:
            out[p.stage] = out.get(p.stage, 0.0) + p.seconds
        return out

    @property
    def num_nodes(self) -> int:
        return len(self.gm.graph.nodes)


class GraphRecord:
    """The run-time state of one captured graph: its current :class:`GraphUnit`, what runs it
    from its second call on (``runner``; None: the next call prepares it), the lock that
    guards swapping it (a swap happens between calls, never during one) and a call count.

    The unit's fields read through (``record.plan`` is ``record.unit.plan``); stages change
    them only with :meth:`advance`, which replaces the frozen unit."""

    def __init__(self, unit: GraphUnit):
        self.unit = unit
        self.runner: Callable[[list], Any] | None = None
        self.lock = threading.RLock()
        self.calls = 0  # real calls so far (the preparing call included)

    def advance(self, stage: str, seconds: float = 0.0, note: str = "", **changes) -> GraphUnit:
        """``self.unit = self.unit.replace(...)``; returns the new unit. Thread-safe (the
        adaptive re-planner stamps units from a background thread)."""
        with self.lock:
            self.unit = self.unit.replace(stage, seconds, note, **changes)
            return self.unit

    tag = property(lambda self: self.unit.tag)
    phase = property(lambda self: self.unit.phase)
    gm = property(lambda self: self.unit.gm)
    group = property(lambda self: self.unit.group)
    capture_s = property(lambda self: self.unit.capture_s)
    table = property(lambda self: self.unit.table)
    plan = property(lambda self: self.unit.plan)
    program = property(lambda self: self.unit.program)
    executor = property(lambda self: self.unit.executor)
    fallback = property(lambda self: self.unit.fallback)
    timings = property(lambda self: self.unit.timings)
    num_nodes = property(lambda self: self.unit.num_nodes)

    def __repr__(self) -> str:
        return f"GraphRecord({self.unit!r}, calls={self.calls})"


def run_serially(record: GraphRecord, args: list) -> tuple[Any, Callable[[list], Any]]:
    """The trivial ``prepare``: run the captured aten graph as it is."""
    fn = record.gm.forward
    return fn(*args), lambda a: fn(*a)


class LazyGraph:
    """Boxed callable AOTAutograd calls; prepares its graph on the first real call.

    Later calls run ``record.runner`` (through ``on_call`` when one is given). Setting
    ``record.runner = None`` (e.g. a plan evicted from the shape cache) makes the next call
    prepare the graph again."""

    def __init__(self, record: GraphRecord, prepare: Prepare, on_call: OnCall | None = None):
        # AOTAutograd passes one list of arguments. An instance attribute, because Dynamo
        # wraps the backward with functools.wraps, which copies __dict__ but not the class.
        self._boxed_call = True
        self.record = record
        self._prepare = prepare
        self._on_call = on_call

    def __call__(self, args: list) -> Any:
        record = self.record
        runner = record.runner
        if runner is None:
            return self._first_call(args)
        record.calls += 1
        if self._on_call is None:
            return runner(args)
        return self._on_call(record, runner, args)

    def _first_call(self, args: list) -> Any:
        record = self.record
        with record.lock:  # two threads calling a fresh model: prepare once
            if record.runner is not None:
                record.calls += 1
                return record.runner(args)
            args = list(args)
            undo = _SideEffects(record.gm, args)
            try:
                with without_aot_first_call_check():
                    out, runner = self._prepare(record, args)
            except Exception as exc:  # noqa: BLE001 - any failure falls back, never wrong results
                out, runner = self._fall_back(args, exc, undo)
            record.runner = runner
            record.calls += 1
            return out

    def _fall_back(self, args: list, exc: Exception, undo: _SideEffects):
        """Run the graph as captured after ``prepare`` raised ``exc``; warn once it worked.

        ``prepare`` may have run part of the graph for real before it failed (the profiler
        runs node by node): ``undo`` puts back the written inputs and the generators first,
        so the fallback's BatchNorm statistics and dropout masks are eager's."""
        record = self.record
        gm = record.gm
        reason = f"{type(exc).__name__}: {exc}"
        undo.restore()
        fn = gm.forward
        try:
            out = fn(*args)
        except Exception as again:
            # No warning was given: one promising correct results must not precede this.
            node = failing_node(again, gm)
            where = f" at node {describe_node(node)}" if node is not None else ""
            note = (
                f"autopar: graph {record.tag} also failed when run as captured{where}, "
                f"after preparing it failed ({reason.splitlines()[0]}). Set "
                "AUTOPAR_DEBUG_DIR to keep the graph for a bug report."
            )
            if hasattr(again, "add_note"):  # Python 3.11+
                again.add_note(note)
            raise
        record.advance("fallback", fallback=reason)
        node = getattr(exc, "node", None) or failing_node(exc, gm)
        warn_fallback(
            f"could not plan graph {record.tag} ({reason}){_graph_source(gm, node)}",
            node,
            "Set AUTOPAR_DEBUG_DIR to keep the graph for a bug report.",
        )
        return out, (lambda a: fn(*a))


class _SideEffects:
    """What a first call may change before it fails: the inputs the graph writes in place
    (BatchNorm statistics; from :func:`autopar.capture.analysis.buffer_analysis`) and the
    random generators of the devices involved. ``restore`` puts them back as they were."""

    def __init__(self, gm: fx.GraphModule, args: list):
        nodes = list(gm.graph.nodes)
        _, writes = buffer_analysis(nodes)
        written = {b for bufs in writes.values() for b in bufs}
        places = [n for n in nodes if n.op == "placeholder"]
        with torch.no_grad():
            self.inputs = [
                (a, a.clone())
                for n, a in zip(places, args, strict=False)
                if n in written and isinstance(a, torch.Tensor)
            ]
        self.cuda = sorted({a.device.index or 0 for a in args
                            if isinstance(a, torch.Tensor) and a.is_cuda})  # fmt: skip
        self.cpu_rng = torch.get_rng_state()
        self.cuda_rng = [torch.cuda.get_rng_state(d) for d in self.cuda]

    def restore(self) -> None:
        with torch.no_grad():
            for a, saved in self.inputs:
                a.copy_(saved)
        torch.set_rng_state(self.cpu_rng)
        for d, state in zip(self.cuda, self.cuda_rng, strict=True):
            torch.cuda.set_rng_state(state, d)


def failing_node(exc: BaseException, gm: fx.GraphModule) -> fx.Node | None:
    """The node of ``gm`` that raised ``exc``, or None: ``exc.node`` when set, the node an
    ``fx.Interpreter`` names ("While executing %name"), or the line of ``gm``'s generated
    code in the traceback (``gm._lineno_map``: line after ``def forward`` -> node index,
    read as Dynamo reads it)."""
    node = getattr(exc, "node", None)
    if isinstance(node, fx.Node):
        return node
    nodes = list(gm.graph.nodes)
    m = re.search(r"While executing %(\w+)", str(exc))
    if m:
        hit = next((n for n in nodes if n.name == m.group(1)), None)
        if hit is not None:
            return hit
    code = getattr(getattr(type(gm), "forward", None), "__code__", None)
    lines = getattr(gm, "_lineno_map", None) or {}
    tb, found = exc.__traceback__, None
    while tb is not None and code is not None:
        if tb.tb_frame.f_code.co_filename == code.co_filename:
            found = lines.get(tb.tb_lineno - code.co_firstlineno)
        tb = tb.tb_next
    return nodes[found] if isinstance(found, int) and 0 <= found < len(nodes) else None


def _graph_source(gm: fx.GraphModule, node: fx.Node | None) -> str:
    """``" in graph from <file:line in fn>"`` when the failing node is unknown or has no
    source line, so a warning always names a line of the user's code when one is known."""
    if node is not None and node_source(node) != "unknown":
        return ""
    for n in gm.graph.nodes:
        if n.op == "call_function" and node_source(n) != "unknown":
            return f" in the graph from {node_source(n)}"
    return ""


class Capture:
    """Records the graphs of one compiled model; ``backend`` is given to ``torch.compile``."""

    def __init__(
        self,
        prepare: Prepare = run_serially,
        on_call: OnCall | None = None,
        graph_passes: tuple[GraphPass, ...] = (),
        on_graph_call: OnGraphCall | None = None,
    ):
        self.prepare = prepare
        self.on_call = on_call
        self.graph_passes = graph_passes
        self.on_graph_call = on_graph_call
        self.records: list[GraphRecord] = []
        self.dynamo_graphs: list[DynamoGraph] = []
        # Per Dynamo graph k: its nodes' source lines, and those of AOT's forward nodes by
        # seq_nr (a backward node carries the seq_nr of the forward op it differentiates).
        self._sources: dict[int, _Sources] = {}
        self._counter = itertools.count()
        self._lock = threading.Lock()
        # Per Dynamo graph k: its compiled halves ("fw", "bw", "inf": the LazyGraph each) and
        # AOTAutograd's metadata with the autocast state of its trace (direct_autograd).
        self._halves: dict[int, dict[str, LazyGraph]] = {}
        self._aot_meta: dict[int, tuple[Any, bool]] = {}

    def _go_direct(self, k: int) -> None:
        """Once Dynamo graph ``k`` has both halves compiled, run it through autopar's own
        ``autograd.Function`` where AOTAutograd's runtime wrapper has nothing to do
        (``autopar.capture.direct_autograd.attach``)."""
        from autopar.capture.direct_autograd import attach

        with self._lock:
            halves = dict(self._halves.get(k, {}))
            graph = next((g for g in self.dynamo_graphs if g.group == k), None)
            meta, autocast = self._aot_meta.get(k, (None, False))
        if graph is not None and "fw" in halves and "bw" in halves:
            attach(graph, halves["fw"], halves["bw"], meta, autocast)

    def graphs(self, phase: str | None = None) -> list[GraphRecord]:
        return [r for r in self.records if phase is None or r.phase == phase]

    def group(self, k: int) -> list[GraphRecord]:
        """The recorded graphs of Dynamo graph ``k`` (``g<k>.fw``, ``g<k>.bw``, ...)."""
        return [r for r in self.records if r.group == k]

    def _compiler(self, tag: str, phase: str, t0: float, group: int):
        def compile_graph(gm: fx.GraphModule, example_inputs):
            sources = self._sources.get(group)
            if sources is not None:
                sources.attach(gm)
            _make_layout_robust(gm, tag, phase)
            for node in gm.graph.nodes:
                node.meta["autopar.key"] = node_key(tag, node.name)
                node.meta["autopar.phase"] = phase
            unit = GraphUnit(tag, phase, gm, group, capture_s=time.perf_counter() - t0)
            record = GraphRecord(unit)
            lazy = LazyGraph(record, self.prepare, self.on_call)
            with self._lock:
                self.records.append(record)
                self._halves.setdefault(group, {})[tag.rsplit(".", 1)[1]] = lazy
                if tag.endswith(".fw"):
                    self._aot_meta[group] = _aot_meta()
            if tag.endswith(".bw"):  # AOTAutograd compiles the backward lazily: now
                self._go_direct(group)
            return lazy

        return compile_graph

    def backend(self, gm: fx.GraphModule, example_inputs):
        """The ``torch.compile`` backend: AOTAutograd with autopar's graph compilers."""
        k = next(self._counter)
        t0 = time.perf_counter()
        _run_graph_passes(self.graph_passes, gm, k)
        self._sources[k] = _Sources(gm)
        try:
            compiler = compat.dynamo_aot_autograd(
                fw_compiler=self._compiler(f"g{k}.fw", "forward", t0, k),
                bw_compiler=self._compiler(f"g{k}.bw", "backward", t0, k),
                inference_compiler=self._compiler(f"g{k}.inf", "forward", t0, k),
            )
            # The backward is traced with the forward (under Dynamo's compile lock), not
            # lazily in the first backward, where it would race another thread's trace:
            # both write torch.fx.traceback's process-wide node metadata.
            with compat.functorch_config().patch(force_non_lazy_backward_lowering=True):
                compiled = compiler(gm, example_inputs)
            graph = DynamoGraph(k, gm, compiled, self.on_graph_call)
            with self._lock:
                self.dynamo_graphs.append(graph)
            self._go_direct(k)  # a backward compiled at once (symbolic sizes saved)
            return graph
        except Exception as exc:  # noqa: BLE001 - AOTAutograd could not trace: run eagerly
            if isinstance(exc, compat.restart_analysis_class()):
                # Dynamo's own control flow (e.g. a float scalar input to be traced as a
                # tensor): it re-traces and calls this backend again. Not a failure.
                raise
            node = _first_call_node(gm)
            reason = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
            return _WarnOnceItRan(
                gm.forward,
                f"AOTAutograd could not trace Dynamo graph {k} ({reason})",
                node,
                "Report the op, or run this part outside the compiled model.",
            )


def _aot_meta() -> tuple[Any, bool]:
    """AOTAutograd's metadata of the forward it is compiling (None outside its trace), and
    whether autocast was on (AOTAutograd then runs the graph with autocast off)."""
    ctx = compat.current_tracing_context()
    return getattr(ctx, "fw_metadata", None), compat.is_any_autocast_enabled()


class _WarnOnceItRan:
    """The Dynamo graph run as it is (eagerly), warning after its first call returned: a
    warning that results stay correct only once they did (an error of the graph itself
    propagates as it would in eager, with no warning before it)."""

    def __init__(self, fn: Callable, what: str, node: fx.Node | None, fix: str):
        self.fn, self.what, self.node, self.fix = fn, what, node, fix
        self.warned = False

    def __call__(self, *args, **kwargs):
        out = self.fn(*args, **kwargs)
        if not self.warned:
            self.warned = True
            warn_fallback(self.what, self.node, self.fix)
        return out


class _Sources:
    """Source lines for AOTAutograd's aten nodes, which torch 2.13 does not give a
    ``stack_trace`` (only ``from_node``, the Dynamo node they were traced from, and
    ``seq_nr``): copied from the Dynamo graph, so ``errors.node_source`` (fallback warnings,
    the profile table's ``source`` column) names the user's line."""

    def __init__(self, dynamo_gm: fx.GraphModule):
        self.graph_id = id(dynamo_gm.graph)
        self.by_name = {n.name: n.meta["stack_trace"] for n in dynamo_gm.graph.nodes
                        if n.meta.get("stack_trace")}  # fmt: skip
        self.by_seq: dict[int, str] = {}

    def attach(self, gm: fx.GraphModule) -> None:
        """Set ``node.meta["stack_trace"]`` where it is missing and can be found."""
        for n in gm.graph.nodes:
            trace = n.meta.get("stack_trace") or self._origin(n)
            seq = n.meta.get("seq_nr")
            if trace is None and seq is not None:
                trace = self.by_seq.get(seq)  # a backward node: its forward op's line
            if trace is None:
                continue
            n.meta["stack_trace"] = trace
            if seq is not None:
                self.by_seq.setdefault(seq, trace)

    def _origin(self, n: fx.Node) -> str | None:
        pending = list(n.meta.get("from_node") or ())
        while pending:  # the provenance chain, nearest pass first
            src = pending.pop(0)
            name = getattr(src, "name", None)
            if getattr(src, "graph_id", None) == self.graph_id and name in self.by_name:
                return self.by_name[name]
            pending.extend(getattr(src, "from_node", None) or ())
        return None


def _make_layout_robust(gm: fx.GraphModule, tag: str, phase: str) -> None:
    """:func:`autopar.capture.layout.robust_views` on one aten graph. Best effort: each of
    its edits is valid alone, so a failure leaves a graph that runs as AOTAutograd made it."""
    try:
        n = robust_views(gm, phase)
        if n:
            _log.debug("%s: %d layout-sensitive view(s) made reshapes", tag, n)
    except Exception:  # noqa: BLE001 - a robustness pass only: never break capture
        _log.debug("%s: robust_views failed; graph unchanged", tag, exc_info=True)


def _run_graph_passes(passes: tuple[GraphPass, ...], gm: fx.GraphModule, k: int) -> None:
    """Run the pipeline's FX passes on Dynamo graph ``k`` before AOTAutograd. Best effort:
    each pass is an optimization that works on a copy and leaves ``gm`` exactly as it was
    when it fails, so a failure is logged and capture goes on."""
    for graph_pass in passes:
        name = getattr(graph_pass, "__name__", repr(graph_pass))
        try:
            n = graph_pass(gm)
            if n:
                _log.debug("Dynamo graph %d: %s made %d rewrite(s)", k, name, n)
        except Exception:  # noqa: BLE001 - an optimization only: never break capture
            _log.debug("Dynamo graph %d: %s failed; graph unchanged", k, name, exc_info=True)


def _first_call_node(gm: fx.GraphModule) -> fx.Node | None:
    """The first call of the graph, preferring one with a known source line to name."""
    calls = [n for n in gm.graph.nodes if n.op in ("call_function", "call_module")]
    return next((n for n in calls if node_source(n) != "unknown"), calls[0] if calls else None)


__all__ = [
    "Capture",
    "DynamoGraph",
    "FallbackWarning",
    "GraphPass",
    "GraphRecord",
    "GraphUnit",
    "Provenance",
    "LazyGraph",
    "OnCall",
    "OnGraphCall",
    "failing_node",
    "node_key",
    "run_serially",
]


@contextlib.contextmanager
def without_aot_first_call_check():
    """Suspend AOTAutograd's first-call analysis while a graph is profiled and planned.

    AOTAutograd runs a compiled graph's first call under ``_AnalyzeCustomOpInputOutputMode``
    (a Python ``TorchDispatchMode`` that checks custom ops for aliasing), so every operator
    of that call goes through Python: 20-25 us each, measured on the towers model, where a
    view op takes 1-2 us. The profiler times operators during exactly that call; it must see
    the operators' own cost. (The mode is
    thread-local, so worker streams never saw it: the serial program alone was penalised.)
    Only that mode, on top of the stack, is suspended; a user's own modes stay. Where this
    torch has no such mode, nothing changes.
    """
    analysis = compat.custom_op_analysis_mode_class()  # None: no first-call analysis
    stack = compat.get_current_dispatch_mode_stack()
    if analysis is None or not stack or not isinstance(stack[-1], analysis):
        yield
        return
    with compat.pop_mode_temporarily():
        yield


@functools.cache
def dynamo_regions() -> bool:
    """Whether ``torch.compile`` takes ``recompile_limit`` and ``isolate_recompiles``
    (torch 2.13): a compiled module can have its own Dynamo cache region and limit."""
    import inspect

    params = inspect.signature(torch.compile).parameters
    return "isolate_recompiles" in params and "recompile_limit" in params


def dynamo_compile(module: torch.nn.Module, capture, recompile_limit: int | None = None):
    """``torch.compile`` the module with ``capture.backend``, static shapes (a new shape
    gets its own graphs), errors raised rather than hidden so ``api`` can fall back.

    Where :func:`dynamo_regions` holds, the module gets its own Dynamo cache region
    (``isolate_recompiles``): a call looks up only this module's graphs, not those of every
    compiled instance of its class, and ``recompile_limit`` (Dynamo applies it only while
    compiling) counts this module's graphs alone."""
    if dynamo_regions():
        return torch.compile(
            module,
            backend=capture.backend,
            dynamic=False,
            fullgraph=False,
            recompile_limit=recompile_limit,
            isolate_recompiles=True,
        )
    return torch.compile(module, backend=capture.backend, dynamic=False, fullgraph=False)
