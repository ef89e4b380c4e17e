"""Tiered compilation: training starts on the cheapest correct tier at once, and faster
executors land later, each only if measured faster.

Tier 0 is what the first call chose (the planned program, or the captured graph). The
later tiers are the *candidates* of :data:`TIER_CANDIDATES`, each one factory there:

- ``"remeasure"``: the planned program that the first call's measurement did not keep,
  measured again in the steady state (``runtime.remeasure_tier``);
- ``"native"``: the planned program on the native stream interpreter
  (``autopar.codegen.native``), offered while the interpreter is not built: its warm-up
  builds it (once per torch version and machine), its compile plans and generates the
  program for it (``runtime.native_tier``). Where it is built at the first call, the
  planned program is native already and this tier is not offered;
- ``"inductor"``: the whole graph compiled by Inductor (``autopar.codegen.inductor``);
- ``"segments"``: the graph cut into per-stream segments, each compiled by Inductor's C++
  wrapper and run concurrently (``autopar.codegen.segments``), offered only when the cost
  model predicts the cut at least :data:`SEGMENT_MIN_GAIN` times faster than its segments
  run one after another (``runtime.segment_runner.segment_candidate``). Opt-in
  (``AUTOPAR_TIERS=inductor,segments``): see :data:`DEFAULT_TIERS`.

Once a graph's inputs arrive in other layouts than its candidates were compiled for (an
earlier graph's tier landed: an Inductor forward may save channels-last activations), the
candidates are made again for the new layouts before they are measured (once per graph).

With ``background=True`` a candidate's cold compile runs in another process that fills
Inductor's cache; once every warm-up has finished, the graph's next call compiles the
candidates here (cache hits), times them and the current tier on the real inputs with
their side effects undone (``runtime.measure``), and keeps the fastest; a candidate must
take less than :data:`LAND_MARGIN` of the current tier's time to replace it.

Warm-ups run one at a time, in one worker process per training process
(``codegen.warmup``), from the second step on (the first call of each graph only queues
them). While one compiles, the training thread sleeps at each forward call (under
``backend="autopar"``: at each step's first forward graph) for :data:`COMPILE_SHARE` of the
wall time, and the worker (at ``SCHED_IDLE``) runs only then or when the training leaves a
core idle: the compile gets whole cores in short turns, never one an OpenMP op waits for.
HF BERT's first 90 s, fresh Inductor cache, 2-core box (``benchmarks/early_steps.py``):
4,267 steps, every tier in place 54 s after the first call (eager: about 7,000 steps).
Without the pauses the worker at ``SCHED_IDLE`` got no CPU from a training loop that keeps both cores busy: no tier landed
in 240 s. Why: on a small machine a compile process takes a core, and the first step's
profiles (the store's entries, and every plan built from them) would measure operators on a
machine that is half taken (2-thread OpenMP ops slow down 10-50x when a neighbour holds a
core). For the same reason candidates are measured only once no warm-up is left running.

The swap happens between two calls of the graph, under its lock; the module-level race is
reset so eager, too, is measured against the new tier. With ``background=False`` everything
happens at the first call (slow first step, fastest steady state from step 2).

Example::

    >>> tiers = Tiers(background=True)                  # doctest: +SKIP
    >>> tiers.start(record, args)     # at the first call, after tier 0 was chosen
    >>> tiers.maybe_land(record, args)  # at each later call
"""

from __future__ import annotations

import atexit
import logging
import os
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from autopar.codegen.emit import Boxed
from autopar.codegen.inductor import compile_inductor, input_meta, stand_ins, start_warmup
from autopar.codegen.warmup import warmup_error
from autopar.runtime.joint_tier import (
    JOINT_MARGIN,
    joint_parts,
    ready_to_measure,
    time_forward_backward,
    trains,
    unmeasurable,
)
from autopar.runtime.measure import SideEffectGuard, time_candidates, written_inputs
from autopar.runtime.native_tier import native_candidate
from autopar.runtime.remeasure_tier import remeasure_candidate
from autopar.runtime.segment_runner import (
    SEGMENT_MIN_GAIN,
    compile_segment_tier,
    segment_candidate,
    start_segment_warmup,
)
from autopar.runtime.split_tier import split_parts

log = logging.getLogger("autopar")

#: While a warm-up compiles, the training thread sleeps at each step boundary for this
#: fraction of the wall time (a sleep of share / (1 - share) times the last step, at most
#: ``MAX_STEP_S`` of it), so the warm-up (at ``SCHED_IDLE``: ``codegen.warmup.yield_cpu``)
#: gets the whole machine then and none of it while a step runs. HF BERT (module
#: docstring): with 1/3, every tier was in place 84 s after the first call (7,860 steps in
#: 150 s); with 1/2, after 51-54 s (6,650 steps in 120 s). A compile's CPU time is paid by
#: the training either way; a half share pays it soonest without OpenMP stalls.
COMPILE_SHARE = 0.5
MAX_STEP_S = 1.0
#: A warm-up still running this long after it was started is stopped, and its candidate
#: given up with a tier line: a hung compile must not cost the training COMPILE_SHARE of
#: every step for good. The slowest whole tier on the 2-core box took 71 s (2026-12-02).
WARMUP_LIMIT_S = 600.0
#: A candidate must take at most this fraction of the current tier's time to be swapped in
#: (measurement noise must not flip executors back and forth).
LAND_MARGIN = 0.97

__all__ = ["DEFAULT_TIERS", "LAND_MARGIN", "SEGMENT_MIN_GAIN", "TIER_CANDIDATES", "Tiers",
           "default_candidates", "tier_kinds"]  # fmt: skip


@dataclass
class Candidate:
    """One executor that may replace a graph's current one: how to warm Inductor's cache
    for it in another process, and how to compile it here."""

    name: str
    warm: Callable[[], Any]  # queues the warm-up (a codegen.warmup.WarmupJob)
    build: Callable[[], Any]  # compiles here (a cache hit once warmed); a Program
    proc: Any = None  # the warm-up job (codegen.warmup.WarmupJob) while it runs
    started: float = 0.0  # when its warm-up was started (time.monotonic)
    program: Any = None  # compiled here, waiting to be measured
    error: str | None = None
    # Whether it applies, when that costs too much for a first call: None (it does) or why
    # not, asked once before its warm-up (the batch split traces its graph).
    check: Callable[[], str | None] | None = None
    tag: str = ""  # the graph's, for the "not offered" line
    executor: str = ""  # the unit's executor once it landed (default: ``name``)


def _native(record, meta: list, tiers) -> Candidate | None:
    return native_candidate(record, meta, tiers.planner, Candidate)


def _inductor(record, meta: list, tiers) -> Candidate:
    gm, tag = record.gm, record.tag
    return Candidate(
        "inductor",
        warm=lambda: start_warmup(gm, stand_ins(meta), tag),
        build=lambda: compile_inductor(gm, stand_ins(meta), tag=tag),
    )


def _segments(record, meta: list, tiers) -> Candidate | None:
    if any(getattr(m, "device", "cpu") != "cpu" for m in meta):
        return None  # CUDA graphs: streams are codegen.cuda's job
    plan = segment_candidate(record.gm, record.table, record.tag)
    if plan is None:
        return None  # one stream, or the cost model predicts no gain
    gm, tag = record.gm, record.tag
    return Candidate(
        "segments",
        warm=lambda: start_segment_warmup(gm, meta, plan, tag),
        build=lambda: compile_segment_tier(gm, meta, plan, tag),
    )


def _joint(graph, args: list) -> Candidate:
    warm, build = joint_parts(graph.gm, args, graph.tag)
    return Candidate("joint", warm=warm, build=build)


def _split(graph, args: list) -> Candidate:
    warm, build, check = split_parts(graph.gm, args, graph.tag)
    return Candidate("split", warm=warm, build=build, check=check, tag=graph.tag)


#: name -> factory(record, input_meta, tiers) -> Candidate, or None when it does not apply.
#: A new tier is one factory here (and its executor's module).
TIER_CANDIDATES: dict[str, Callable[[Any, list, Any], Candidate | None]] = {
    "remeasure": lambda rec, meta, tiers: remeasure_candidate(rec, meta, tiers.planner, Candidate),
    "native": _native,
    "inductor": _inductor,
    "segments": _segments,
}
#: The same for whole Dynamo graphs (both halves at once): name -> factory(graph, args).
GRAPH_CANDIDATES: dict[str, Callable[[Any, list], Candidate | None]] = {
    "joint": _joint,
    "split": _split,
}


#: The candidates when ``$AUTOPAR_TIERS`` is unset. Segments are opt-in: in ``autopar bench``
#: on the 2-core box (2026-11-30) they lost to whole-graph Inductor on every graph they were
#: offered (inception, towers, deep MLP, BERT, GPT-2: 1.1-2x slower), and their compiles
#: delay the landing of the Inductor tier by tens of seconds.
#: The joint tier (torch.compile's own pipeline per Dynamo graph) is on: it closed HF BERT's
#: gap to torch.compile (see docs/executors.md). The batch split is on: where a graph
#: qualifies (no random draws, no batch statistics) it can beat both on few cores.
#: The native interpreter's build comes first: it is one job for the whole process, and on
#: multi-branch models its programs are the ones that win (towers, 2026-12-02). The
#: re-measure tier needs no compile: it is measured with the others.
DEFAULT_TIERS = ("remeasure", "native", "inductor", "joint", "split")


def default_candidates() -> tuple[str, ...]:
    """``$AUTOPAR_TIERS`` (comma-separated names of :data:`TIER_CANDIDATES`), default
    :data:`DEFAULT_TIERS`."""
    text = os.environ.get("AUTOPAR_TIERS", "")
    names = tuple(n.strip() for n in text.split(",") if n.strip()) or DEFAULT_TIERS
    known = {**TIER_CANDIDATES, **GRAPH_CANDIDATES}
    unknown = [n for n in names if n not in known]
    if unknown:
        raise ValueError(
            f"AUTOPAR_TIERS={text!r}: unknown tier(s) {unknown}; choose from {','.join(known)}"
        )
    return names


def tier_kinds(inductor: bool, native: bool) -> tuple[str, ...]:
    """The tiers of :func:`default_candidates` that a model's options allow: the Inductor
    ones when ``inductor``, ``"native"`` when ``native``, ``"remeasure"`` always."""
    allowed = {"native": native, "remeasure": True}
    return tuple(k for k in default_candidates() if allowed.get(k, inductor))


@dataclass
class _Tier:
    """The candidates of one graph."""

    meta: list
    started: float
    candidates: list[Candidate] = field(default_factory=list)
    done: bool = False  # measured (landed or lost), or nothing to do
    remade: bool = False  # the candidates were made again for new input layouts


class Tiers:
    """The background compiles of one compiled model, and their landing."""

    def __init__(self, background: bool = True, candidates: tuple[str, ...] | None = None,
                 planner=None):  # fmt: skip
        self.background = background
        self.kinds = default_candidates() if candidates is None else tuple(candidates)
        # planner.plan_and_generate(record, table, executor): the native tier's compile
        self.planner = planner
        self._tiers: dict[int, _Tier] = {}
        self._graph_tiers: dict[int, _Tier] = {}  # per Dynamo graph: the joint candidates
        self.events: list[str] = []  # one line per tier that landed, lost or failed
        # Warm-ups not started yet, in first-call order; whole-graph ones after all others
        # (they are measured against the per-graph tiers, which must land first).
        self._queue: list[Candidate] = []
        self._graph_queue: list[Candidate] = []
        self.measuring = False  # a whole-graph measurement runs: graph calls are not steps
        # Only the processes go to the finalizer: candidates reach back (through their
        # records) to the pipeline that owns this object, which would then never be freed.
        self._procs: list = []
        self._warming: Candidate | None = None  # whose warm-up runs (one at a time)
        weakref.finalize(self, _stop, self._procs)

    # -- the first call ---------------------------------------------------------------
    def start(self, record, args: list) -> None:
        """Queue ``record``'s candidates (``background=False``: compile and measure now)."""
        meta = input_meta(args)
        tier = _Tier(meta, time.perf_counter(), self._make(record, meta))
        self._tiers[id(record)] = tier
        if not tier.candidates:
            tier.done = True
            return
        if not self.background:
            self._build(record, tier)
            self._land(record, tier, args)
            return
        self._queue.extend(tier.candidates)

    # -- every later call ---------------------------------------------------------------
    def maybe_land(self, record, args: list) -> None:
        """If every background compile is done, measure ``record``'s candidates and maybe
        swap the fastest in."""
        self._launch_next()
        tier = self._tiers.get(id(record))
        if tier is None or tier.done or self._queue or self._running():
            return  # still compiling elsewhere: measuring now would time a shared machine
        self._reap(record, tier)
        meta = input_meta(args)
        if meta != tier.meta and not tier.remade:
            # The inputs' layouts changed since the candidates were made: an earlier graph's
            # tier landed (an Inductor forward may save channels-last activations where the
            # planned one saved contiguous ones). Compiled for the old layouts, a candidate
            # would copy its inputs on every call and be measured unfairly: make them again.
            tier.remade, tier.meta = True, meta
            tier.candidates = self._make(record, meta)
            self._queue.extend(tier.candidates)
            tier.done = not tier.candidates
            self._launch_next()
            return
        self._build(record, tier)
        self._land(record, tier, args)

    # -- whole Dynamo graphs -------------------------------------------------------------
    def maybe_land_graph(self, graph, args: list, records: list, by_steps: bool = True) -> str:
        """At a call of Dynamo graph ``graph`` (its recorded graphs ``records``): at the first
        call of a training graph, queue its whole-graph candidates (``background=False``:
        compile them now); once every warm-up is done, both halves ran and their own tiers
        settled, compile them here. ``by_steps``: return ``"ready"`` (:meth:`ready_program`
        is then the candidate, for the step race to judge); else time a forward and backward
        of each against the current executor and maybe swap the fastest in. Returns
        ``"pending"``, ``"ready"``, ``"landed"``, ``"kept"`` (measured, not swapped) or
        ``"done"`` (nothing left for this graph)."""
        self._launch_next()
        tier = self._graph_tiers.get(id(graph))
        if tier is None:
            kinds = [k for k in self.kinds if k in GRAPH_CANDIDATES]
            if not kinds or not trains(records):
                return "done"
            cands = [c for c in (GRAPH_CANDIDATES[k](graph, list(args)) for k in kinds) if c]
            tier = _Tier(input_meta(args), time.perf_counter(), cands, done=not cands)
            self._graph_tiers[id(graph)] = tier
            if self.background:
                self._graph_queue.extend(cands)
            else:
                self._build(graph, tier)
            return "done" if tier.done else "pending"
        if tier.done:
            return "done"
        if self._queue or self._graph_queue or self._running() or not ready_to_measure(records):
            return "pending"
        if any(not self._tiers[id(r)].done for r in records if id(r) in self._tiers):
            return "pending"  # a half's own tier lands at its next call: measure after that
        self._reap(graph, tier)
        self._build(graph, tier)
        if by_steps:
            tier.done = True
            return "ready" if self.ready_programs(graph) else "done"
        return self._land_graph(graph, tier, list(args), records)

    def ready_programs(self, graph) -> dict:
        """The compiled whole-graph candidates of ``graph``, by tier name."""
        tier = self._graph_tiers.get(id(graph))
        cands = tier.candidates if tier is not None else []
        return {c.name: c.program for c in cands if c.program is not None}

    def settle_graph(self, graph, records: list, verdict: str, reason: str) -> None:
        """The step race decided between ``graph``'s runner and its candidates: swap the
        winner in (``verdict`` is its name) or keep the runner; stamp both halves."""
        progs, graph.candidates = graph.candidates, {}
        tier = self._graph_tiers.get(id(graph))
        waited = time.perf_counter() - tier.started if tier is not None else 0.0
        line = f"whole steps: {reason} (ready {waited:.1f} s after the first call)"
        if verdict not in progs:
            self._keep_graph(graph, records, line, waited)
        else:
            self._swap_graph(graph, records, progs[verdict], verdict, line, waited)

    def _keep_graph(self, graph, records: list, line: str, waited: float) -> None:
        """The whole-graph candidate lost (``line`` says how): the runner stays."""
        self._event(graph, f"{line}: kept {graph.executor}")
        for r in records:
            r.advance("whole-graph", waited, f"{line}: kept {r.executor}")

    def _swap_graph(self, graph, records: list, prog, name: str, line: str, waited: float,
                    measured: tuple = ()) -> None:  # fmt: skip
        """Candidate ``name`` won (``line`` says how): it runs both halves from the next call;
        each half's unit says so (what ``autopar.explain`` and the bench read)."""
        with graph.lock:
            graph.runner, graph.executor = prog.fn, name
        extra = {"measured": measured} if measured else {}
        for r in records:
            r.advance("tier", waited, f"{line}: {name} landed", program=prog.program(r.phase),
                      executor=name, **extra)  # fmt: skip
        self._event(graph, f"{line}: {name} landed")

    def _land_graph(self, graph, tier: _Tier, args: list, records: list) -> str:
        tier.done = True
        ready = {c.name: c.program for c in tier.candidates if c.program is not None}
        why = unmeasurable(args)
        if not ready or why:
            if ready:
                self._event(graph, f"{', '.join(ready)} not measured ({why}); kept "
                                   f"{graph.executor}")  # fmt: skip
            return "kept" if ready else "done"
        self.measuring = True
        try:
            runners = {"current": graph.runner, **{k: p.fn for k, p in ready.items()}}
            best = time_forward_backward(runners, args)
        finally:
            self.measuring = False
        inf = float("inf")
        cur = best.get("current", inf)
        name = min(ready, key=lambda k: best.get(k, inf))
        waited = time.perf_counter() - tier.started
        times = ", ".join(f"{k} {best.get(k, inf) * 1e3:.3f} ms" for k in ready)
        verdict = (f"forward+backward: {times} vs {graph.executor} {cur * 1e3:.3f} ms "
                   f"(ready {waited:.1f} s after the first call)")  # fmt: skip
        measured = ((graph.executor, cur),) + tuple((k, best.get(k, inf)) for k in ready)
        if best.get(name, inf) >= JOINT_MARGIN * cur:
            self._keep_graph(graph, records, verdict, waited)
            return "kept"
        self._swap_graph(graph, records, ready[name], name, verdict, waited, measured)
        return "landed"

    def reject(self, graph, name: str, why: str) -> None:  # its first call failed
        self._event(graph, f"{name} left the race: its first call {why}; runner kept")

    def compile_pause(self, step_s: float) -> float:
        """Seconds the training thread yields at this step boundary (a forward call
        ``step_s`` after the previous one) while a warm-up of this model compiles: its
        :data:`COMPILE_SHARE` of the machine (module docstring); 0 when none runs."""
        if not self.compiling():
            return 0.0
        return COMPILE_SHARE / (1.0 - COMPILE_SHARE) * min(step_s, MAX_STEP_S)

    def compiling(self) -> bool:
        """A warm-up of this model is compiling now: the machine is shared with it (the
        monitor takes no drift evidence meanwhile)."""
        return self._running()

    def pending(self) -> int:
        tiers = (*self._tiers.values(), *self._graph_tiers.values())
        return sum(not t.done for t in tiers)

    def poll(self) -> None:
        """A step boundary: start the next queued warm-up when none is running. (Graph calls
        do this too; a module the race sends down the eager path makes none.)"""
        self._launch_next()

    def ready(self) -> bool:
        """Every warm-up has finished and some graph's candidates wait to be measured (at
        that graph's next call)."""
        return (bool(self.pending()) and not self._queue and not self._graph_queue
                and not self._running())  # fmt: skip

    def wait(self, records, timeout: float | None = None, graphs=()) -> bool:
        """Block until every background compile has finished and been compiled here (they
        are measured and swapped at each graph's next call). True when nothing is left."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:  # the queued warm-ups, one after another
            self._launch_next()
            live = [p for p in self._procs if p.poll() is None]
            if not live:
                break
            now = time.monotonic()
            # wake at the deadline and at the warm-up limit (the next _launch_next stops an
            # overdue warm-up; past the limit, poll every 0.1 s until it has ended)
            wake = [max(deadline - now, 0.0)] if deadline is not None else []
            if self._warming is not None:
                wake.append(max(self._warming.started + WARMUP_LIMIT_S - now, 0.1))
            try:
                live[0].wait(min(wake) if wake else None)
            except Exception:  # noqa: BLE001 - subprocess.TimeoutExpired
                if deadline is not None and time.monotonic() >= deadline:
                    return False
        owners = [(r, self._tiers.get(id(r))) for r in records]
        owners += [(g, self._graph_tiers.get(id(g))) for g in graphs]
        for owner, tier in owners:
            if tier is not None and not tier.done:
                self._reap(owner, tier)
                self._build(owner, tier)
        return True

    # -- mechanics ----------------------------------------------------------------------
    def _make(self, record, meta: list) -> list[Candidate]:
        """The candidates of ``self.kinds`` that apply to ``record`` for inputs ``meta``."""
        out = []
        for kind in self.kinds:
            try:
                cand = TIER_CANDIDATES[kind](record, meta, self)
            except Exception as exc:  # noqa: BLE001 - a candidate that cannot be made is none
                log.debug("autopar: %s: no %s tier (%s)", record.tag, kind, exc)
                cand = None
            if cand is not None:
                out.append(cand)
        return out

    def _launch_next(self) -> None:
        """Start the next queued warm-up if none is running (one compile process at a time);
        whole-graph warm-ups only when no other is queued."""
        self._stop_overdue()
        if self._running():
            return
        cand = None
        while (queue := self._queue or self._graph_queue) and cand is None:
            cand = queue.pop(0)
            cand = cand if self._offered(cand) else None  # not offered: the next one
        if cand is None:
            return
        try:
            cand.proc, cand.started = cand.warm(), time.monotonic()
            self._warming = cand
            self._procs.append(cand.proc)
            _LIVE.add(cand.proc)
        except Exception as exc:  # noqa: BLE001 - no warm-up: compiled cold when measured
            log.debug("autopar: no background warm-up for %s (%s)", cand.name, exc)

    def _running(self) -> bool:
        return any(p.poll() is None for p in self._procs)

    def _stop_overdue(self) -> None:
        """Stop the warm-up running past :data:`WARMUP_LIMIT_S` (queued to the worker that
        long ago); its candidate is given up. Asked again until it has ended: a cancel that
        found the worker busy only marks the job."""
        cand = self._warming
        if cand is None:
            return
        if cand.proc is None or cand.proc.poll() is not None:
            self._warming = None
            return
        waited = time.monotonic() - cand.started
        if waited <= WARMUP_LIMIT_S:
            return
        cand.proc.kill()
        if cand.error is None:
            cand.error = f"warm-up stopped after {waited:.0f} s"
            line = (f"{cand.tag or cand.name}: {cand.name} {cand.error} (limit "
                    f"WARMUP_LIMIT_S = {WARMUP_LIMIT_S:.0f} s); tier kept")  # fmt: skip
            self.events.append(line)
            log.warning("autopar: %s", line)

    def _reap(self, record, tier: _Tier) -> None:
        for cand in tier.candidates:
            proc, cand.proc = cand.proc, None
            if proc is None:
                continue
            _LIVE.discard(proc)
            if proc in self._procs:
                self._procs.remove(proc)
            err = warmup_error(proc)
            if err:
                log.debug("autopar: %s: %s warm-up failed: %s", record.tag, cand.name, err)

    def _offered(self, cand: Candidate) -> bool:
        """Ask ``cand.check`` once; a candidate that does not apply is dropped, with a line."""
        check, cand.check = cand.check, None
        why = check() if check is not None else None
        if why is not None:
            cand.error = f"not offered: {why}"
            self._event(cand, f"{cand.name} {cand.error}")
        return cand.error is None

    def _build(self, record, tier: _Tier) -> None:
        for cand in tier.candidates:
            if cand.program is not None or cand.error is not None or not self._offered(cand):
                continue
            try:
                cand.program = cand.build()
            except Exception as exc:  # noqa: BLE001 - the current tier simply stays
                cand.error = f"{type(exc).__name__}: {exc}"
                self._event(record, f"{cand.name} could not compile it ({cand.error}); "
                                    "tier kept")  # fmt: skip

    def _land(self, record, tier: _Tier, args: list) -> None:
        tier.done = True
        ready = {c.name: c.program for c in tier.candidates if c.program is not None}
        if not ready:
            return
        current = record.runner
        if current is None:
            current = lambda a, f=record.gm.forward: f(*a)  # noqa: E731
        runners = {"current": current}
        runners.update({k: (lambda a, f=p.fn: f(*a)) for k, p in ready.items()})
        guard = SideEffectGuard(args, written_inputs(record.gm))
        best = time_candidates(runners, args, guard)
        cur = best.get("current", float("inf"))
        name = min(ready, key=lambda k: best.get(k, float("inf")))
        waited = time.perf_counter() - tier.started
        times = ", ".join(f"{k} {best.get(k, float('inf')) * 1e3:.3f} ms" for k in ready)
        verdict = (
            f"{times} vs {record.executor} {cur * 1e3:.3f} ms "
            f"(ready {waited:.1f} s after the first call)"
        )
        measured = ((record.executor, cur),) + tuple(
            (k, best.get(k, float("inf"))) for k in ready)
        if best.get(name, float("inf")) < LAND_MARGIN * cur:
            prog = ready[name]
            cand = next(c for c in tier.candidates if c.name == name)
            plan = {"plan": prog.plan} if getattr(prog, "plan", None) is not None else {}
            with record.lock:
                record.runner = Boxed(prog)
                record.advance("tier", waited, f"{verdict}: {name} landed", program=prog,
                               executor=cand.executor or name, measured=measured,
                               **plan)  # fmt: skip
            self._event(record, f"{verdict}: {name} landed")
        else:
            record.advance("tier", waited, f"{verdict}: kept {record.executor}",
                           measured=measured)
            self._event(record, f"{verdict}: kept {record.executor}")

    def _event(self, owner, text: str) -> None:
        """One line in ``events`` and the log: ``owner`` (a record, a Dynamo graph or a
        candidate) names the graph by its ``tag``."""
        line = f"{owner.tag}: {text}"
        self.events.append(line)
        log.info("autopar: %s", line)


_LIVE: set = set()  # warm-up processes still running, stopped at exit


def _stop(procs: list) -> None:
    for proc in procs:
        if proc.poll() is None:
            proc.kill()


@atexit.register
def _stop_all() -> None:
    for proc in list(_LIVE):
        if proc.poll() is None:
            proc.kill()
