"""The per-model pipeline: capture, then for each graph on its first real call
profile -> plan -> codegen; later calls go through the adaptive monitor (``autopar.adapt.monitor``).

``autopar.compile`` makes one ``Pipeline`` per compiled module. Example::

    >>> from autopar.api import CompileOptions
    >>> pipe = Pipeline(CompileOptions(streams=2))
    >>> pipe.records          # filled as Dynamo/AOTAutograd capture graphs
    []
"""

from __future__ import annotations

import itertools
import os
import re
import threading
import time
import warnings

import torch
import torch.nn as nn

from autopar import compat
from autopar.adapt.monitor import AdaptOptions, Monitor
from autopar.adapt.shapes import (
    HookGuardsWhileCompiling,
    describe_key,
    dynamo_limit,
    dynamo_recompile_limit,
    input_key,
    register_cache_size,
)
from autopar.capture.backend import Capture, GraphRecord, dynamo_regions, run_serially
from autopar.codegen.emit import Boxed
from autopar.errors import traced_user_error, warn_fallback
from autopar.logs import CompileProgress
from autopar.runtime.decide import Runtime
from autopar.runtime.decisions import Decisions
from autopar.runtime.executors import ladder as make_ladder
from autopar.runtime.measure import output_meta
from autopar.runtime.native_direct import NativePaths


class Pipeline:
    """Capture, then for each graph on its first real call: profile -> plan -> codegen."""

    def __init__(self, options, name: str = "model"):
        self.options = options
        self.name = unique_name(name)  # the model in logs and the debug dir: "MLP", "MLP-2"
        adapt = getattr(options, "adapt", True)
        adapt = AdaptOptions() if adapt is True else (adapt or None)
        cache_size = getattr(options, "cache_size", 8)
        # Dynamo's settings for this module's calls (adapt.shapes): with a cache region of
        # its own (torch 2.13) only the hook guards, while compiling; else dynamo_limit().
        self.recompile_limit = max(cache_size, dynamo_recompile_limit())
        self.monitor = Monitor(self, adapt, cache_size, self.recompile_limit)
        self._hook_guards = HookGuardsWhileCompiling()
        if dynamo_regions():
            self._dynamo_settings = lambda: self._hook_guards
        else:
            register_cache_size(cache_size)
            self._dynamo_settings = dynamo_limit
        self.ladder = make_ladder(getattr(options, "executors", None))
        self.key = None  # the input signature of the step that runs now
        self._rnn_present: bool | None = None
        from autopar.rnn.cell_nodes import cell_passes

        self.capture = Capture(
            prepare=self.prepare, on_call=self.on_call,
            graph_passes=cell_passes(getattr(options, "rnn", "unroll")),
            on_graph_call=self.on_graph_call,
        )  # fmt: skip
        self._store = None
        self._runtime: Runtime | None = None
        self.compile_seconds: float | None = None  # first call: capture + profile + plan
        self._checked: set = set()  # input keys whose inputs passed the caller's check
        self.progress: CompileProgress | None = None  # the compile now or last under way
        self._next: tuple[float, str] | None = None  # (start, reason): this step may compile
        self._call: float | None = None  # start of the forward call under way (None: none)
        self._last_key = None
        self._backend = False  # backend="autopar": its Dynamo graph calls mark the steps
        self._last_group: int | None = None  # ... the Dynamo graph called last
        self._path = "plan"  # ... and the executor of that step
        self.variant: str = "plan"  # the executor of the step that runs now
        self.native_paths = NativePaths()  # graphs whose two native programs run from C++
        self._fast: set[int] = set()  # Dynamo graphs on their verdict's program, no hook

    def _has_rnn(self, model: nn.Module) -> bool:
        """Whether ``model`` holds an RNN module to rewrite; looked up once (walking every
        module on every call cost 134 us a step on BERT, which has none). A model that
        gains an RNN later runs it as Dynamo does: correct, just not rewritten."""
        if self._rnn_present is None:
            from autopar.rnn.cells import RNN_MODULE_TYPES

            self._rnn_present = any(isinstance(m, RNN_MODULE_TYPES) for m in model.modules())
        return self._rnn_present

    @property
    def records(self) -> list[GraphRecord]:
        return self.capture.records

    @property
    def store(self):
        if self._store is None:
            from autopar.profiling.store import ProfileStore

            s = self.options.store
            self._store = s if isinstance(s, ProfileStore) else ProfileStore(s)
        return self._store

    @property
    def runtime(self) -> Runtime:
        """The decisions of this model (``runtime.decide``), made on first use: the decision
        cache lives beside the profile store."""
        if self._runtime is None:
            self._runtime = Runtime(self.ladder, getattr(self.options, "background", True),
                                    Decisions(getattr(self.store, "path", None)),
                                    self.capture.group, describe_key)  # fmt: skip
        return self._runtime

    def compiling(self) -> bool:
        """A background build of this model is compiling (the machine is shared with it)."""
        return self._runtime is not None and self._runtime.builds.compiling()

    def call(self, model: nn.Module, compiled, args, kwargs, check=None):
        """One forward call: a step boundary (pending re-plans are swapped in here). The
        step runs the executor the judge chose (``runtime.decide``), eagerly included.
        ``check()`` raises a clear error for inputs the model cannot take; it runs once per
        input signature and argument layout (what it checks: arity, keywords, dtypes)."""
        first = self.compile_seconds is None
        key = input_key(model, args, kwargs)
        if check is not None:
            shape = (key, len(args), tuple(kwargs))  # keywords by name: the key has values
            if shape not in self._checked:
                check()
                self._checked.add(shape)
        self.key = key
        t0 = time.perf_counter()
        self.variant = path = self.runtime.step(key, t0)
        self._settle(key)
        if path == "eager" or _empty_batch(args, kwargs):
            return model(*args, **kwargs)
        self._next = None
        if key not in self.monitor.cache.entries:  # a new input signature: it compiles
            self._next = (t0, self._why(key, first))
        self._last_key = key
        self.native_paths.drain(self.monitor.observed)  # the last step's, before it ends
        self.monitor.begin_step(key, lambda: describe_key(key))
        # plan's steps run the native path while racing too: the judge must time what a
        # plan verdict would run (other executors' steps never call the captured runner)
        self.native_paths.refresh(self.capture.dynamo_graphs, self.capture.group,
                                  True, self.monitor.quiet)  # fmt: skip
        self._call = t0
        try:
            with self._dynamo_settings():
                if self.options.rnn == "unroll" and self._has_rnn(model):
                    from autopar.rnn.rewrite import rewrite_rnns

                    with rewrite_rnns(model):
                        out = compiled(*args, **kwargs)
                else:
                    out = compiled(*args, **kwargs)
        except Exception as exc:
            clean = traced_user_error(exc)  # a bug in the model, seen by Dynamo's trace
            if clean is None:
                raise
            raise clean from None  # one clear error; Dynamo's is clean.dynamo_error
        finally:
            self._call = None
        if first:
            self.compile_seconds = time.perf_counter() - t0
        return out

    def _settle(self, key) -> None:
        """Once ``key``'s verdict stands with nothing left to build, each of its Dynamo graphs
        runs the verdict's program with no hook around its calls (the judge has no more
        turns to give), and its recorded graphs say which program runs them."""
        rt = self.runtime
        verdict = rt.judge.verdict(key)
        if verdict is None or not rt.settled(key) or self._backend:
            return
        for graph in self.capture.dynamo_graphs:
            gs = rt.graph_state(graph)
            if gs is None or gs.key != key or id(graph) in self._fast:
                continue
            prog = gs.programs.get(verdict)
            if prog is not None and verdict not in graph.checked:
                continue  # its first call is checked first (``_first_program_call``)
            self._fast.add(id(graph))
            with graph.lock:
                graph.runner = prog.fn if prog is not None else graph.captured
                graph.executor = verdict if prog is not None else "per-graph"
                graph.on_call = None
            if prog is not None:
                for r in self.capture.group(graph.group):
                    r.advance("verdict", 0.0, rt.judge.report()[key][1],
                              program=prog.program(r.phase), executor=verdict)  # fmt: skip

    def backend(self, gm, example_inputs):
        """This model's ``torch.compile`` backend: ``Capture.backend`` (Dynamo graph ->
        AOTAutograd -> recorded graphs), with one log line for the compile it belongs to
        (its reason: the first call, a new input signature, Dynamo's recompile reason)
        and one for the capture. ``autopar.compile`` and ``backend="autopar"`` both come
        through here."""
        if self._call is not None:  # inside Pipeline.call, whose `with` block restores it
            self._hook_guards.arm()  # Dynamo builds this frame's guards after we return
        why = _dynamo_reason()
        progress = self._episode(f"Dynamo: {why}" if why else None)
        n = len(self.records)
        t0 = time.perf_counter()
        compiled = self.capture.backend(gm, example_inputs)
        new = self.records[n:]
        if new:
            k = new[0].group
            shown = ", ".join(f"{r.tag} {r.num_nodes} nodes" for r in new)
            progress.stage(f"g{k}", "capture", time.perf_counter() - t0, f"AOTAutograd: {shown}")
        return compiled

    def _episode(self, dynamo_reason: str | None = None) -> CompileProgress:
        """The compile that a Dynamo graph or a first call belongs to; a new one (logging its
        header) at a new input signature, a Dynamo recompile, or the very first graph."""
        with _episode_lock:
            if self._next is not None:  # autopar.compile: this step has a new signature
                start, why = self._next
                self._next = None
                self.progress = CompileProgress(self.name, why, start)
            elif self.progress is None:  # (Dynamo may call it a recompile: the class's
                # code was compiled before, for another model or backend)
                self.progress = CompileProgress(self.name, "first call")
            elif dynamo_reason is not None and not (
                self._call is not None and self.progress.start == self._call
            ):  # a recompile that is not part of the compile this call already started
                self.progress = CompileProgress(self.name, dynamo_reason, self._call)
            return self.progress

    def _why(self, key, first: bool) -> str:
        """Why a call with input signature ``key`` compiles (one line)."""
        if first:
            return "first call"
        new = describe_key(key)
        if key in self.monitor.cache.seen:
            return f"input signature {new} again, evicted from the plan cache"
        change = _key_change(self._last_key, key)
        return f"new input signature {new}" + (f": {change}" if change else "")

    def prepare(self, record: GraphRecord, args: list):
        """Profile (running the graph once for real), plan, generate; return (out, runner)."""
        from autopar.profiling.heal import heal
        from autopar.profiling.profiler import profile_graph

        if not self.runtime.profiles(record.group):  # plan is not a contender here
            return run_serially(record, args)
        self.runtime.judge.dirty(self.key)  # this step compiles: it does not count

        opts = self.options
        debug_dir = opts.debug_dir or os.environ.get("AUTOPAR_DEBUG_DIR")
        progress = self._episode()
        t0 = time.perf_counter()
        try:
            out, table = profile_graph(
                record.gm,
                args,
                tag=record.tag,
                phase=record.phase,
                store=self.store,
                warmup=opts.warmup,
                repeats=opts.repeats,
            )
        except Exception:
            _write_debug(record, debug_dir, self.name)  # the graph, for a bug report
            raise  # nothing ran for real yet: LazyGraph falls back to the captured graph
        # The store is checked against this run: entries it contradicts are re-measured
        # (one StoreWarning names them), so one bad sample never poisons a plan.
        # Re-measuring runs ops on fresh inputs: the user's RNG streams must not move.
        cuda = sorted({a.device.index or 0 for a in args if isinstance(a, torch.Tensor)
                       and a.is_cuda})  # fmt: skip
        with torch.random.fork_rng(devices=cuda):
            table, _ = heal(table, store=self.store)
        dt = time.perf_counter() - t0
        record.advance("profile", dt, table=table)
        attrs = getattr(table, "attrs", {})
        progress.stage(record.tag, "profile", dt, f"{attrs.get('measured', 0)} of "
                       f"{attrs.get('signatures', 0)} operator signatures timed")  # fmt: skip
        try:
            table = self.monitor.prepared(record, table)
            record.advance("monitor", table=table)
            plan, program = self.plan_and_generate(record, table)
            progress.stage(record.tag, "plan", _last(record, "plan"), _describe(plan))
            progress.stage(record.tag, "codegen", _last(record, "codegen"),
                           f"{len(program.streams_used) or 1}-stream program")
        except Exception as exc:  # noqa: BLE001
            # The profiler already ran the graph for real (buffer updates, RNG draws are
            # done): return its outputs and run the captured graph from now on. Running it
            # again here would apply those side effects twice.
            _write_debug(record, debug_dir, self.name)
            record.advance("fallback", fallback=f"{type(exc).__name__}: {exc}")
            warn_fallback(
                f"could not plan graph {record.tag} ({record.fallback})",
                getattr(exc, "node", None),
                "The graph, its profile and this error are in AUTOPAR_DEBUG_DIR when set.",
            )
            fn = record.gm.forward
            return out, (lambda a: fn(*a))
        record.advance("choose", plan=plan, program=program, executor="plan")
        record.runner = Boxed(program)
        self.monitor.compiled(record, time.perf_counter() - t0)
        _write_debug(record, debug_dir, self.name)
        return out, record.runner

    def on_graph_call(self, graph, args):
        """A call of a whole Dynamo graph while its signature is undecided: the step's
        executor (``self.variant``, the judge's choice) runs it: its built program, else the
        captured runner (``runtime.decide.Runtime.program``). A graph's first call tells the
        runtime about it (the ladder walk starts at the next step). Under
        ``torch.compile(backend="autopar")`` a graph call may start a step
        (:meth:`_backend_graph_call`); an ``eager`` step runs the graph as Dynamo captured it."""
        if self._call is None and self._backend_graph_call(graph) == "eager":
            return graph.gm(*args)
        rt = self.runtime
        if rt.graph_state(graph) is None:
            rt.graph_seen(graph, list(args), self.key)
        fn = rt.program(graph, self.variant)
        if fn is graph.captured:
            out = fn(*args)
            if graph.out_meta is None:
                graph.out_meta = output_meta(out)  # what each built program must give
            return out
        if self.variant not in graph.checked:
            return self._first_program_call(graph, self.variant, fn, args)
        return fn(*args)

    def _first_program_call(self, graph, name: str, fn, args):
        """A built program's first call of ``graph``: its outputs must have the shapes,
        dtypes and devices of the captured runner's; one that raises or gives others (a
        batch split whose graph baked in a batch size) leaves the race, with its side
        effects undone, and the captured runner runs the call: a contender never breaks
        the user's loop."""
        from autopar.runtime.measure import SideEffectGuard, output_mismatch, written_inputs

        guard = SideEffectGuard(args, written_inputs(graph.gm))
        try:
            out = fn(*args)
            why = output_mismatch(out, graph.out_meta)
        except Exception as exc:  # noqa: BLE001 - any failure: the program is not valid
            why = f"raised {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
        if why is None:
            graph.checked.add(name)
            return out
        guard.restore()
        self.runtime.reject(graph, name, why)
        return graph.captured(*args)

    def _backend_graph_call(self, graph) -> str:
        """A Dynamo graph called outside :meth:`call` (``torch.compile(backend="autopar")``,
        where no forward call of ours marks the steps); returns its step's executor. A step
        starts at a graph no later than the one called before it (the next step's first
        graph; in an inference loop, the same graph again); its signature is ``("backend",
        k)`` for the step's first graph ``g<k>``, and its eager steps run each Dynamo graph
        as Dynamo captured it (``graph.gm``: eager ops, eager autograd)."""
        self._backend = True
        prev, self._last_group = self._last_group, graph.group
        if prev is not None and prev < graph.group:
            return self._path  # the same step's next graph (after a graph break)
        self.key = ("backend", graph.group)
        self._path = self.variant = self.runtime.step(self.key, time.perf_counter())
        return self._path

    def replanned(self, record: GraphRecord, why: str) -> None:
        """The monitor swapped a re-planned program into ``record`` (sustained drift): the
        judge races its signature again, through the graph call hook."""
        key = self.runtime.reopen(record.group, why)
        if key is None:
            return
        for graph in self.capture.dynamo_graphs:
            gs = self.runtime.graph_state(graph)
            if gs is not None and gs.key == key and id(graph) in self._fast:
                self._fast.discard(id(graph))
                with graph.lock:
                    graph.runner, graph.on_call = graph.captured, self.on_graph_call

    def on_call(self, record: GraphRecord, runner, args):
        """Every call of a recorded graph after its first: the monitor times it."""
        return self.monitor.on_call(record, runner, args)

    def wait(self, timeout: float | None = None) -> bool:
        """Block until background compiles are done (each is compiled here and races from
        its graph's next step) and background re-plans are ready. True when nothing is left
        pending. Builds that wait for their signature's first verdict are not queued yet:
        the steps that give it start them."""
        t0 = time.monotonic()
        done = self._runtime is None or self._runtime.builds.wait(timeout)
        left = None if timeout is None else max(0.0, timeout - (time.monotonic() - t0))
        return self.monitor.wait(left) and done

    def _provenance(self) -> dict:
        return {"profile_store": str(getattr(self.store, "path", None))}

    def plan_and_generate(self, record: GraphRecord, table):
        """Plan ``table`` (one graph's profile) and generate its program
        (``runtime.planned.plan_and_generate``; thread-safe: the adaptive re-planner calls
        it from a background thread)."""
        from autopar.runtime.planned import plan_and_generate

        return plan_and_generate(record, table, self.options, self.store, self._provenance())


def _empty_batch(args, kwargs) -> bool:
    """An input with no elements (a batch of 0): nothing to parallelize, and eager handles
    every such edge case (an empty ``nn.LSTM`` batch, say) that tracing might not."""
    values = (*args, *kwargs.values())
    return any(isinstance(a, torch.Tensor) and a.numel() == 0 for a in values)


def _write_debug(record: GraphRecord, debug_dir: str | None, model: str = "model") -> None:
    """AUTOPAR_DEBUG_DIR: the graph, the profile, plan.json, the program and a Gantt PNG, in
    ``<debug_dir>/run-<pid>-<n>/<model>/<graph tag>/`` (:func:`run_dir`)."""
    if not debug_dir:
        return
    try:
        d = os.path.join(run_dir(debug_dir), model, record.tag)
        os.makedirs(d, exist_ok=True)
        with open(os.path.join(d, "graph.py"), "w") as f:
            f.write(record.gm.code)
        with open(os.path.join(d, "graph.txt"), "w") as f:
            f.write(str(record.gm.graph))
        if record.table is not None:
            record.table.to_csv(os.path.join(d, "profile.csv"), index=False)
        if record.plan is not None:
            with open(os.path.join(d, "plan.json"), "w") as f:
                f.write(record.plan.to_json(indent=1))
            record.plan.gantt(os.path.join(d, "gantt.png"), title=f"{model} {record.tag}")
        if record.program is not None:
            record.program.save(os.path.join(d, "program.py"))
    except Exception as exc:  # noqa: BLE001 - debug output must never break training
        warnings.warn(f"autopar: could not write debug output to {debug_dir}: {exc}", stacklevel=2)


_run_dirs: dict[tuple[int, str], str] = {}
_names: dict[str, itertools.count] = {}
_names_lock = threading.Lock()
_episode_lock = threading.RLock()


def run_dir(debug_dir: str) -> str:
    """This process's folder under ``debug_dir``: ``run-<pid>-<n>``, ``n`` the first number
    not taken (a container's pid repeats across runs), claimed once per process; mode 0700."""
    root = os.path.abspath(debug_dir)
    key = (os.getpid(), root)  # a forked child claims its own
    with _names_lock:
        if key not in _run_dirs:
            os.makedirs(root, exist_ok=True)
            for n in itertools.count():
                d = os.path.join(root, f"run-{os.getpid()}-{n}")
                try:
                    # only its user's: it holds the model's graphs, profile and errors
                    os.mkdir(d, 0o700)
                except FileExistsError:
                    continue
                _run_dirs[key] = d
                break
        return _run_dirs[key]


def unique_name(base: str) -> str:
    """``base`` the first time in this process, then ``base-2``, ``base-3``, ...: one name
    per compiled model (two MLPs do not share a debug folder or log prefix)."""
    base = "".join(c if c.isalnum() or c in "._-" else "_" for c in base) or "model"
    with _names_lock:
        n = next(_names.setdefault(base, itertools.count(1)))
    return base if n == 1 else f"{base}-{n}"


def _last(record: GraphRecord, stage: str) -> float:
    """Seconds of ``record``'s latest ``stage`` stamp."""
    return next((p.seconds for p in reversed(record.unit.provenance) if p.stage == stage), 0.0)


def _describe(plan) -> str:
    streams = len(getattr(plan, "streams", ()) or ()) or 1
    return (f"{plan.policy} on {streams} stream{'s' if streams > 1 else ''}, predicted "
            f"{plan.predicted_step_time * 1e3:.3f} ms")  # fmt: skip


def _key_change(old, new) -> str:
    """What differs between two input signatures (``adapt.shapes.input_key``), in words:
    ``input 0 shape [4, 8] -> [6, 8]``."""
    if old is None or new is None:
        return ""
    names = ("mode", "grad mode", "autocast", "intra-op threads")
    words = {0: ("eval", "train"), 1: ("off", "on")}
    out = []
    for i, (a, b) in enumerate(zip(old[:4], new[:4], strict=True)):
        if a != b:
            a, b = (words[i][bool(a)], words[i][bool(b)]) if i in words else (a, b)
            out.append(f"{names[i]} {a} -> {b}")
    ins_a, ins_b = old[4:], new[4:]
    if len(ins_a) != len(ins_b):
        out.append(f"{len(ins_a)} -> {len(ins_b)} inputs")
    for i, (a, b) in enumerate(zip(ins_a, ins_b, strict=False)):  # counts told above
        if a == b:
            continue
        if isinstance(a, tuple) and isinstance(b, tuple) and len(a) == len(b) == 3:
            for what, x, y in zip(("shape", "dtype", "device"), a, b, strict=True):
                if x != y:
                    fmt = list if what == "shape" else str
                    out.append(f"input {i} {what} {fmt(x)} -> {fmt(y)}")
        else:
            out.append(f"input {i} {a!r} -> {b!r}")
    return ", ".join(out)


def _dynamo_reason() -> str | None:
    """Why Dynamo is compiling again (its first guard failure), when it is a recompile; None
    for a frame's first compile. Read from Dynamo's compile metrics; None when absent."""
    try:
        reason = getattr(compat.dynamo_metrics_context(), "_metrics", {}).get("recompile_reason")
    except Exception:  # noqa: BLE001 - another torch: no reason, still one line
        return None
    if not reason:
        return None
    line = " ".join(str(reason).split("\n")[0].split())  # one line, spaces collapsed
    return re.sub(r"^\d+/\d+: ", "", line)  # without the failed entry's id ("0/0: ")
