"""Adaptive execution: monitor step times, detect drift, re-plan, cache plans per shape.

Every call of a compiled graph after its first is timed (``perf_counter`` around the
runner) and compared with the plan's prediction. Every ``sample_every``-th call of a
multi-stream CPU program also times each stream function (``_stream_<k>`` of the generated
program, wrapped for that one call), so ``stats(cmodel, per="graph")`` shows per-stream
segments. Overhead: two ``perf_counter`` calls and one tuple append per graph call.

CUDA. A CUDA call returns once its kernels are *enqueued*: ``perf_counter`` would time the
launches, and synchronising around every call would stall the host's run-ahead forever.
A CUDA graph's calls are timed by events on the caller's stream of each of its devices
(``codegen.cuda.CudaTimer``), read once the device has passed them (``Event.query`` never
waits), so a call's row may come a few calls later. Only measurement windows synchronise:
every ``sample_every``-th call of the graph, and a call finding ``MAX_PENDING`` calls
unread (a host that far ahead of its device); steady-state calls never do.

Drift. ``ratio = measured / predicted`` per graph call. The cost model is not exact, so the
first ``window`` calls after ``warmup`` set a per-graph ``baseline`` ratio; the graph has
*drifted* when the median ratio over the last ``window`` calls, divided by the baseline,
leaves ``[1/threshold, threshold]``. Run-time timing has no per-operator attribution, so a
drifted graph is re-profiled *whole*: its next call runs through the profiler (which
returns exactly what the program would; the profile re-measures every operator, ignoring
the store), operators whose time moved by more than ``threshold`` are listed and written
back to the store, then planning and codegen run in a background thread; the new program is
swapped in at the next step boundary (the start of a forward call), under the record's lock,
never during a graph call. A change of ``torch.get_num_threads()`` gets a new plan: Dynamo
guards on the thread count, so the graph is recaptured and planned (a plan-cache miss); if
a graph keeps running under another count anyway, the monitor re-profiles and re-plans it.
If a re-plan does not change the prediction (the drift is not in the operators: e.g. another
process took a core), the baseline is reset instead of re-planning again. While the
model's own background compile runs (``Pipeline.compiling``), calls are recorded but not
judged, and the baseline is taken afresh after it. A re-plan swapped in makes the judge race
the signature again (``Pipeline.replanned``).

Example::

    >>> cmodel = autopar.compile(model, adapt=AdaptOptions(window=4))  # doctest: +SKIP
    >>> for x, y in data:
    ...     loss_fn(cmodel(x), y).backward()                       # doctest: +SKIP
    >>> autopar.stats(cmodel).tail()                                # doctest: +SKIP

Test hook: ``inject_slowdown(cmodel, "aten.mm.default", factor=20)`` makes that operator
look ``factor`` times slower, deterministically, without sleeping: profiles scale its
``time_s`` / ``time_1t_s``, and each timed call adds ``baseline * (S - T)`` to the measured
time, where ``S`` and ``T`` are the simulated step times of the running plan with and
without the scaled costs (so a plan that hides the op in a parallel branch pays less).
"""

from __future__ import annotations

import logging
import statistics
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Any

import torch

from autopar.adapt.shapes import PlanCache
from autopar.codegen.cuda import CudaTimer
from autopar.codegen.emit import Boxed

log = logging.getLogger("autopar")

STEP_COLUMNS = ["step", "graphs", "shape", "predicted_s", "measured_s", "ratio", "plan", "event"]
GRAPH_COLUMNS = [
    "step", "graph", "shape", "predicted_s", "measured_s", "ratio", "plan", "streams_s", "event",
    "executor",
]  # fmt: skip
# ``executor``: what ran the call ("plan", "inductor", ...; "compile" for the first call,
# "profiler" for a re-profile). Only "plan" rows measure what ``predicted_s`` predicts.


@dataclass(frozen=True)
class AdaptOptions:
    """How ``autopar.compile(..., adapt=AdaptOptions(...))`` watches and re-plans.

    Example::

        >>> AdaptOptions(window=4, threshold=1.3).window
        4
    """

    window: int = 32  # graph calls in the drift window (median) and in the baseline
    threshold: float = 2.0  # drift: median ratio / baseline outside [1/threshold, threshold]
    warmup: int = 4  # calls ignored after a (re)plan is installed (caches, worker start-up)
    sample_every: int = 16  # time each stream function on every N-th call (0: never)
    max_replans: int = 3  # per graph; then it keeps its last plan (logged once)
    # hysteresis: this many consecutive, disjoint windows must all drift (the same way)
    # before a re-profile; one noisy window (a neighbour process) never churns programs
    confirm_windows: int = 2
    background: bool = True  # plan + codegen of a re-plan in a background thread
    watch_threads: bool = True  # re-plan when torch.get_num_threads() changes
    history: int = 20000  # graph-call rows kept for stats()

    def __post_init__(self):
        if self.window < 1 or self.warmup < 0 or self.max_replans < 0 or self.sample_every < 0 \
                or self.confirm_windows < 1:
            raise ValueError(f"AdaptOptions: need window >= 1 and counts >= 0, got {self}")
        if not self.threshold > 1.0:
            raise ValueError(f"AdaptOptions.threshold must be > 1.0, got {self.threshold}")


#: Unread CUDA timings per graph beyond which a call synchronises (see the docstring).
MAX_PENDING = 64


class _GraphState:
    """What the monitor knows about one graph record."""

    def __init__(self) -> None:
        self._timer: CudaTimer | None | bool = False  # False: not looked up yet
        self.reset()
        self.replans = 0
        self.baseline: float | None = None
        self.true_table = None  # last profile without injected slowdowns
        self.reason: str | None = None  # set: the next call re-profiles
        self.busy = False  # a background re-plan is in flight
        self.pending: tuple | None = None  # (table, plan, program, event) awaiting a swap
        self.event: str = ""  # shown on the next stats row of this graph
        self.fake: dict[str, float] = {}  # plan hash -> injected seconds (before baseline)
        self.gave_up = False
        self.hashed: tuple = (None, "")  # (plan, plan.plan_hash): hashing a plan is slow

    def cuda_timer(self, record) -> CudaTimer | None:
        """The event timer of a graph whose values live on CUDA (its devices found once),
        None for a CPU graph (which keeps its two ``perf_counter`` calls)."""
        if self._timer is False:
            gm = getattr(record, "gm", None)
            devices = cuda_devices(gm) if gm is not None else []
            self._timer = CudaTimer(devices) if devices else None
        return self._timer

    def plan_hash(self, plan) -> str:
        if self.hashed[0] is not plan:
            self.hashed = (plan, plan.plan_hash if plan is not None else "")
        return self.hashed[1]

    def reset(self) -> None:
        self.ratios: deque[float] = deque()
        self.drifting = 0  # consecutive drifting windows: + slower, - faster than baseline
        self.since_plan = 0
        self.threads = torch.get_num_threads()
        if self._timer:
            self._timer.clear()


def cuda_devices(gm) -> list[torch.device]:
    """The CUDA devices the values of graph ``gm`` live on (its traced ``meta["val"]``)."""
    found: dict[torch.device, None] = {}
    for n in gm.graph.nodes:
        vals = n.meta.get("val")
        for v in vals if isinstance(vals, (list, tuple)) else (vals,):
            if isinstance(v, torch.Tensor) and v.device.type == "cuda":
                found[torch.device("cuda", v.device.index or 0)] = None
    return list(found)


class Monitor:
    """Per-model monitor, shape cache and re-planner (created by ``autopar.pipeline``)."""

    def __init__(
        self,
        pipeline,
        options: AdaptOptions | None,
        cache_size: int,
        recompile_limit: int | None = None,
    ):
        self.pipeline = pipeline
        self.options = options
        self.enabled = options is not None
        self.cache = PlanCache(cache_size, self._evict, recompile_limit)
        self.rows: deque[tuple] = deque(maxlen=options.history if options else 1)
        self.step = -1
        self.key: Any = None
        self.injected: dict[str, float] = {}
        self._states: dict[int, _GraphState] = {}
        self._threads: list[threading.Thread] = []
        self._lock = threading.Lock()

    def state(self, record) -> _GraphState:
        st = self._states.get(id(record))
        if st is None:
            st = self._states.setdefault(id(record), _GraphState())
        return st

    # -- step boundary -----------------------------------------------------------------
    def begin_step(self, key, describe) -> None:
        """A forward call starts: count the step, look up the shape cache, swap programs."""
        self.step += 1
        self.key = key
        self.cache.enter(key, describe)
        if self.enabled:
            for record in list(self.pipeline.records):
                st = self._states.get(id(record))
                if st is not None and st.pending is not None:
                    self._swap(record, st)

    def _swap(self, record, st: _GraphState) -> None:
        with record.lock:
            table, plan, program, event = st.pending
            st.pending = None
            if record.runner is None:  # evicted meanwhile: the next call prepares afresh
                return
            if record.executor != "plan":  # another executor's verdict meanwhile: it stays
                return
            old = record.plan
            record.advance("replan", note=event, table=table, plan=plan, program=program)
            record.runner = Boxed(program)
            old_pred = old.predicted_step_time if old is not None else float("nan")
            if old is not None and abs(plan.predicted_step_time - old_pred) <= 0.1 * old_pred:
                st.baseline = None  # drift not explained by operator costs: re-baseline
                event += "; prediction unchanged: baseline reset"
            st.reset()
            st.event = event
        log.info("autopar: %s: %s", record.tag, event)
        self.pipeline.replanned(record, f"{record.tag} re-planned ({event})")

    # -- every graph call --------------------------------------------------------------
    def prepared(self, record, table):
        """Called by ``Pipeline.prepare`` after profiling: remember the true table, apply
        injected slowdowns, tie the record to the current shape key."""
        self.cache.add_group(self.key, record.group)
        if not self.enabled:
            return table
        st = self.state(record)
        st.event = "profiled and planned"
        st.true_table = table
        st.reset()
        return self._scaled(table)

    def compiled(self, record, seconds: float) -> None:
        """A stats row for the preparing call (profile + plan + codegen, ``seconds``)."""
        if self.enabled:
            st = self.state(record)
            plan = record.plan
            self.rows.append(
                (self.step, record.tag, self.cache.describe(self.key), plan.predicted_step_time,
                 seconds, float("nan"), plan.plan_hash, None, st.event, "compile")
            )  # fmt: skip
            st.event = ""

    def on_call(self, record, runner, args):
        """``capture.OnCall``: time the call (re-profile instead when it drifted)."""
        if self.key is not None:
            self.cache.add_group(self.key, record.group)
        if not self.enabled:
            return runner(args)
        st = self.state(record)
        opts = self.options
        if st.reason is not None and not st.busy and record.plan is not None:
            return self._reprofile(record, st, args)
        sampled = bool(opts.sample_every) and record.calls % opts.sample_every == 0
        timer = st.cuda_timer(record)
        if timer is not None:
            return self._cuda_call(record, st, runner, args, timer, sampled)
        segs = None
        if sampled:
            with record.lock:
                segs, out, dt = self._timed_call(record, st, args)
        else:
            t0 = time.perf_counter()
            out = runner(args)
            dt = time.perf_counter() - t0
        self._observe(record, st, dt, segs)
        return out

    def _cuda_call(self, record, st, runner, args, timer: CudaTimer, sampled: bool):
        """A CUDA graph's call, timed by ``timer``'s events (module docstring): what it
        observes are earlier calls the devices have finished, each with the step, shape,
        plan and executor of its own call."""
        at = (self.step, self.cache.describe(self.key), record.plan, record.executor, sampled)
        timer.start()
        out = runner(args)
        timer.stop(at)
        if sampled or len(timer.pending) >= MAX_PENDING:
            timer.sync()  # a measurement window: the only synchronisation of a CUDA graph
        for dt, at in list(timer.done()):
            self._observe(record, st, dt, {0: dt} if at[4] else None, at[:4])
        return out

    def observed(self, record, seconds: list[float]) -> None:
        """Calls that ran without :meth:`on_call` (``runtime.native_direct``: the programs
        timed themselves), as if they had: counted, timed, and drift checked."""
        for dt in seconds:
            record.calls += 1
            if self.enabled:
                every = self.options.sample_every
                sampled = every and record.calls % every == 0
                self._observe(record, self.state(record), dt, {0: dt} if sampled else None)

    def quiet(self, record) -> bool:
        """Nothing for :meth:`on_call` to do at ``record``'s next call (no re-profile due)."""
        st = self._states.get(id(record))
        return not self.enabled or st is None or (st.reason is None and not st.busy)

    def _timed_call(self, record, st, args):
        """Run once with every stream function timed (``runtime.streams.stream_timings``);
        a serial (or Inductor) CPU program is one stream: the call's time."""
        from autopar.runtime.streams import stream_timings

        with stream_timings() as segs:
            t0 = time.perf_counter()
            out = record.runner(args)
            dt = time.perf_counter() - t0
        return (dict(segs) if segs else {0: dt}), out, dt

    def _observe(self, record, st: _GraphState, dt: float, segs, at: tuple | None = None) -> None:
        """One timed call: a stats row, then the drift check. ``at``: the call's ``(step,
        shape, plan, executor)`` when it is observed later than it ran (CUDA), else now's."""
        opts = self.options
        if at is None:
            at = (self.step, self.cache.describe(self.key), record.plan, record.executor)
        step, shape, plan, executor = at
        pred = plan.predicted_step_time if plan is not None else float("nan")
        if self.injected and plan is not None:
            dt += self._fake_extra(record, st, plan) * (st.baseline or 1.0)
        ratio = dt / pred if pred > 0 else float("nan")
        event, st.event = st.event, ""
        self.rows.append(
            (step, record.tag, shape, pred, dt, ratio, st.plan_hash(plan), segs, event, executor)
        )  # fmt: skip
        if plan is None or not ratio == ratio or st.reason is not None or st.busy:
            return
        if executor != "plan":
            return  # drift and re-planning concern planned programs (not Inductor's code)
        if self.pipeline.compiling():
            # The model's own warm-up shares the machine (runtime.builds): its windows are
            # no evidence of drift, and a baseline taken meanwhile makes the machine look
            # 2x faster once the compile is done (the Inception model under
            # backend="autopar", 2026-12-02: "drifted 0.43x", re-profiled on a shared
            # machine until max_replans, then a warning). Start afresh after it.
            st.ratios.clear()
            st.baseline, st.drifting = None, 0
            return
        st.since_plan += 1
        if opts.watch_threads and torch.get_num_threads() != st.threads:
            self._drifted(record, st, f"intra-op threads {st.threads} -> {torch.get_num_threads()}")
            return
        if st.since_plan <= opts.warmup:
            return
        st.ratios.append(ratio)
        if len(st.ratios) > opts.window:
            st.ratios.popleft()
        if len(st.ratios) < opts.window:
            return
        med = statistics.median(st.ratios)
        st.ratios.clear()  # windows are disjoint: each call counts in one verdict
        if st.baseline is None:
            st.baseline = med
            return
        drift = med / st.baseline
        way = 1 if drift > opts.threshold else -1 if drift < 1.0 / opts.threshold else 0
        st.drifting = st.drifting + way if way and (st.drifting * way) >= 0 else way
        if abs(st.drifting) >= opts.confirm_windows:
            st.drifting = 0
            self._drifted(
                record, st,
                f"measured/predicted {drift:.2f}x the baseline over {opts.confirm_windows} "
                f"windows of {opts.window} calls",
            )  # fmt: skip

    def _drifted(self, record, st: _GraphState, reason: str) -> None:
        if st.replans >= self.options.max_replans:
            if not st.gave_up:
                st.gave_up = True
                log.warning(
                    "autopar: %s drifted (%s) but reached max_replans=%d; keeping plan %s",
                    record.tag, reason, self.options.max_replans, record.plan.plan_hash,
                )  # fmt: skip
            st.ratios.clear()
            return
        st.reason = reason
        log.info("autopar: %s drifted (%s): re-profiling on its next call", record.tag, reason)

    # -- re-profile and re-plan --------------------------------------------------------
    def _reprofile(self, record, st: _GraphState, args):
        """Run this call through the profiler (fresh timings), then re-plan."""
        from autopar.profiling.profiler import profile_graph
        from autopar.profiling.store import ProfileStore

        opts, pipe = self.options, self.pipeline
        reason, st.reason = st.reason, None
        st.replans += 1
        fresh = ProfileStore.memory()
        t0 = time.perf_counter()
        out, table = profile_graph(
            record.gm, list(args), tag=record.tag, phase=record.phase, store=fresh,
            warmup=pipe.options.warmup, repeats=pipe.options.repeats,
        )  # fmt: skip
        self.rows.append(
            (self.step, record.tag, self.cache.describe(self.key), float("nan"),
             time.perf_counter() - t0, float("nan"), record.plan.plan_hash, None,
             f"re-profiled ({reason})", "profiler")
        )  # fmt: skip
        for sig in fresh:  # the store keeps the latest measurement of each signature
            pipe.store.put(sig, fresh.get(sig))
        pipe.store.flush()
        st.true_table = table
        scaled = self._scaled(table)
        moved = _moved_ops(record.table, scaled, opts.threshold)
        old = record.plan.plan_hash
        what = f"re-planned ({reason}; ops moved: {', '.join(moved) or 'none'})"

        def work():
            try:
                plan, program = pipe.plan_and_generate(record, scaled)
                ev = f"{what}: plan {old} -> {plan.plan_hash}"
                st.pending = (scaled, plan, program, ev)
            except Exception as exc:  # noqa: BLE001 - keep the running plan
                log.warning("autopar: re-plan of %s failed (%s); keeping %s", record.tag, exc, old)
            finally:
                st.busy = False

        st.busy = True
        if opts.background:
            t = threading.Thread(target=work, name=f"autopar-replan-{record.tag}", daemon=True)
            with self._lock:
                self._threads = [x for x in self._threads if x.is_alive()] + [t]
            t.start()
        else:
            work()
        return out

    def wait(self, timeout: float | None = None) -> bool:
        """Block until the background re-plans are done; False if ``timeout`` passed first."""
        with self._lock:
            threads = list(self._threads)
        for t in threads:
            t.join(timeout)
        return not any(t.is_alive() for t in threads)

    def _scaled(self, table):
        if not self.injected or table is None:
            return table
        table = table.copy()
        for target, factor in self.injected.items():
            sel = table["target"] == target
            table.loc[sel, "time_s"] *= factor
            table.loc[sel, "time_1t_s"] *= factor
        return table

    def _fake_extra(self, record, st: _GraphState, plan) -> float:
        """Simulated seconds the injected slowdown adds to ``plan`` (cached per plan)."""
        h = st.plan_hash(plan)
        if h not in st.fake:
            st.fake[h] = 0.0
            if st.true_table is not None:
                from autopar.planning.partition import default_machine
                from autopar.planning.simulate import simulate
                from autopar.planning.taskgraph import task_graph_from_profile
                from autopar.runtime.planned import graph_device

                s = []
                # the model of the graph's own device (one per device, calibrated once), as
                # the planner took it (runtime.planned.graph_device)
                machine = default_machine(self.pipeline.store, graph_device(st.true_table))
                for t in (self._scaled(st.true_table), st.true_table):
                    g = task_graph_from_profile(t)
                    r = simulate(g, plan.placement, list(plan.order), list(plan.streams), machine)
                    s.append(r.makespan)
                st.fake[h] = max(0.0, s[0] - s[1])
        return st.fake[h]

    def _evict(self, groups: set[int]) -> list[str]:
        tags = []
        for record in self.pipeline.records:
            if record.group in groups and record.runner is not None:
                with record.lock:
                    record.runner = None
                    record.advance("evict", table=None, plan=None, program=None)
                self._states.pop(id(record), None)
                tags.append(record.tag)
        return tags


def _moved_ops(old, new, threshold: float) -> list[str]:
    """Targets whose summed time changed by more than ``threshold`` between two profiles
    (ignoring targets under 1% of the graph's time: their timings are mostly jitter)."""
    if old is None or new is None:
        return []
    a = old.groupby("target")["time_s"].sum()
    b = new.groupby("target")["time_s"].sum()
    floor = 0.01 * max(a.sum(), b.sum())
    out = []
    for t in a.index.intersection(b.index):
        if max(a[t], b[t]) > floor and min(a[t], b[t]) > 0:
            if max(a[t] / b[t], b[t] / a[t]) > threshold:
                out.append(f"{t} {b[t] / a[t]:.2f}x")
    return out


def _monitor(cmodel) -> Monitor:
    pipe = getattr(cmodel, "_autopar_pipeline", None)
    if pipe is None:
        raise TypeError(f"expected the result of autopar.compile, got {type(cmodel).__name__}")
    paths = getattr(pipe, "native_paths", None)
    if paths is not None:  # the native programs' own times of the last step
        paths.drain(pipe.monitor.observed)
    return pipe.monitor


def stats(cmodel, per: str = "step"):
    """Measured vs predicted time: a pandas DataFrame, one row per step (``per="step"``: a
    forward call and the backward graphs run after it) or per graph call (``per="graph"``,
    with sampled per-stream seconds in ``streams_s`` and what ran the call in ``executor``).

    Columns (step): step, graphs, shape, predicted_s, measured_s, ratio, plan (plan hashes),
    event (re-plans, in the row of the first call that ran the new plan).

    Example::

        >>> df = autopar.stats(cmodel)                       # doctest: +SKIP
        >>> df[["step", "predicted_s", "measured_s", "plan"]].tail(3)   # doctest: +SKIP
    """
    import pandas as pd

    rows = pd.DataFrame(list(_monitor(cmodel).rows), columns=GRAPH_COLUMNS)
    if per == "graph":
        return rows
    if per != "step":
        raise ValueError(f"per must be 'step' or 'graph', got {per!r}")
    if rows.empty:
        return pd.DataFrame(columns=STEP_COLUMNS)
    join = lambda s: ",".join(x for x in s if x)
    df = rows.groupby("step", sort=True).agg(
        graphs=("graph", join), shape=("shape", "first"), predicted_s=("predicted_s", "sum"),
        measured_s=("measured_s", "sum"), plan=("plan", join),
        event=("event", lambda s: "; ".join(x for x in s if x)),
    ).reset_index()  # fmt: skip
    df["ratio"] = df["measured_s"] / df["predicted_s"]
    return df[STEP_COLUMNS]


def inject_slowdown(cmodel, target: str, factor: float) -> None:
    """Test hook: make operator ``target`` (e.g. ``"aten.mm.default"``) look ``factor`` times
    slower to the monitor and to re-profiles (see the module docstring). ``factor=1``
    removes it.

    Example::

        >>> inject_slowdown(cmodel, target="aten.mm.default", factor=20.0)   # doctest: +SKIP
    """
    mon = _monitor(cmodel)
    if factor == 1.0:
        mon.injected.pop(target, None)
    else:
        mon.injected[target] = float(factor)
    for st in mon._states.values():
        st.fake.clear()


def wait(cmodel, timeout: float | None = 60.0) -> None:
    """Block until background re-plans finished; they are swapped in at the next step."""
    _monitor(cmodel).wait(timeout)


def measure_peak_memory(fn, *args) -> int:
    """Peak bytes allocated above the start while ``fn(*args)`` runs.

    CUDA: ``torch.cuda.max_memory_allocated`` (exact). CPU: ``torch.profiler`` with
    ``profile_memory=True``; each operator's net allocation is counted at its start, in time
    order. Accurate for operators on the calling thread (serial programs); allocations on
    worker-stream threads are not seen, and an op's temporary workspace freed inside the op
    nets out (so it can under-estimate).

    Example::

        >>> measure_peak_memory(lambda: torch.ones(1000) * 2) >= 4000
        True
    """
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        fn(*args)
        torch.cuda.synchronize()
        return max(0, torch.cuda.max_memory_allocated() - base)
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn(*args)
    events = sorted(
        (e.time_range.start, e.self_cpu_memory_usage)
        for e in prof.events()
        if e.self_cpu_memory_usage
    )
    cur = peak = 0
    for _, m in events:
        cur += m
        peak = max(peak, cur)
    return peak


__all__ = [
    "AdaptOptions", "Monitor", "PlanCache", "inject_slowdown", "measure_peak_memory",
    "stats", "wait",
]  # fmt: skip
