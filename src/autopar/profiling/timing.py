"""Timing one operator, knowing the conditions it was timed in.

Recipe (``time_calls``): warm-up calls estimate one call's cost ``est`` (their *minimum*: a
first call that hit a page fault or another process does not set the batch size). A sample is a
batch of ``k = ceil(50 us / est)`` calls (at most 200), so that it lasts longer than the
timer's resolution and jitter. ``repeats`` samples are taken, cut so one thread setting costs
about 0.5 s, but never fewer than ``MIN_SAMPLES``: one sample cannot tell a clean measurement
from a disturbed one (the store once kept a 4.8 ms operator at 0.848 s from a single sample).
CPU samples use ``time.perf_counter``; CUDA samples use CUDA events around the batch and
synchronise on the end event.

**Contention, per sample.** Each sample also records the calling thread's CPU time
(``time.thread_time``), the process's involuntary context switches (``getrusage``: every
thread of the process, so also the OpenMP workers) and, on Linux, the time the process's
threads spent *runnable but waiting for a CPU* (``RunQueueClock``: the run-queue delay in
``/proc/self/task/*/schedstat``). A sample is *disturbed* when the calling thread ran for
less than ``1 - CPU_DEFICIT_LIMIT`` of its wall time (it was descheduled, or slept at an
OpenMP barrier waiting for a worker that was), when any of the process's threads was
preempted during it, or when its threads waited in the run queue for more than
``RUN_QUEUE_LIMIT`` of its wall time. The last one sees what the first two cannot: an
OpenMP worker descheduled *before* the sample began waits in the run queue throughout while
the calling thread spins at the barrier (full CPU time, no new preemption). Against busy
loops it flags a few more slow samples than the first two and no more fast ones
(``benchmarks/contention_signal.py``; docs/cost-model.md has the table). All three are facts
about that sample, cost a few microseconds outside the timed window, and are attributable
to the sample (a load average or a probe before and after is not). On CUDA the CPU-time rule does
not apply: the CPU may legitimately sleep in the event synchronisation.

**Robust estimate.** Disturbed samples are set aside; of the rest, samples slower than
``median + OUTLIER_MADS * 1.4826 * MAD`` are rejected (one-sided: interference only adds
time). ``time_s`` is the median of what is kept, ``min_s`` the minimum, ``spread`` the robust
relative dispersion ``1.4826 * MAD / median``. A setting is *contended* when more than
``CONTENTION_LIMIT`` of its samples were disturbed or fewer than ``MIN_SAMPLES`` were not; it
is then re-measured after a pause, at most ``RETRIES`` times within the caller's
``RetryBudget``, and the least disturbed attempt counts. A measurement still contended, or
noisier than ``SPREAD_LIMIT``, is ``provisional`` (``autopar.profiling.quality``).

Example::

    >>> import torch
    >>> x = torch.randn(64, 64)
    >>> t = time_calls(lambda: x @ x, None, warmup=1, repeats=3)
    >>> t.samples >= MIN_SAMPLES and t.time_s > 0 and t.min_s <= t.time_s
    True
"""

from __future__ import annotations

import math
import os
import statistics
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from autopar.profiling.quality import CLEAN, PROVISIONAL

try:
    import resource

    def _preemptions() -> int:
        """Involuntary context switches of this process so far (all its threads)."""
        return resource.getrusage(resource.RUSAGE_SELF).ru_nivcsw

except ImportError:  # Windows: the CPU-time rule alone

    def _preemptions() -> int:
        return 0


BATCH_TARGET_S = 50e-6  # a timed sample should last at least this long (timer jitter ~1 us)
MAX_BATCH = 200  # most calls in one sample (a 0.2 us op: 40 us per sample)
SETTING_BUDGET_S = 0.5  # about the most time spent timing one signature at one thread count
MIN_SAMPLES = 3  # fewest samples taken, and fewest clean ones a clean measurement rests on
CPU_DEFICIT_LIMIT = 0.10  # the calling thread off the CPU for > 10% of a sample: disturbed
# The process's threads waited for a CPU for > 5% of a sample: disturbed. Quiet samples read
# 0.00 (a thread waking on an idle core does not queue); contended ones 0.4-1.2 (a 2-thread
# team with one member queued reads about 1: the whole sample).
RUN_QUEUE_LIMIT = 0.05
CONTENTION_LIMIT = 0.5  # more than half the samples disturbed: the setting is contended
OUTLIER_MADS = 3.0  # reject samples slower than median + 3 robust standard deviations
SPREAD_LIMIT = 0.5  # a robust relative spread above this is too noisy to keep as clean
RETRIES = 2  # re-measurements of a contended setting
RETRY_PAUSE_S = 0.05  # wait before one (a competing burst may end)
_MAD_SIGMA = 1.4826  # MAD * this estimates the standard deviation of normal noise


@dataclass(frozen=True)
class Sample:
    """One timed batch: seconds per call, whether something else took the CPU meanwhile,
    and which per-sample signals said so (``"cpu"``, ``"preempt"``, ``"queue"``; see
    ``contention_signals``)."""

    seconds: float
    disturbed: bool = False
    signals: frozenset[str] = frozenset()


@dataclass(frozen=True)
class Timing:
    """The robust summary of one thread setting's samples (see the module docstring).

    Example::

        >>> t = summarize([Sample(1.0), Sample(1.1), Sample(0.9), Sample(9.0)], batch=1)
        >>> t.time_s, t.kept, t.outliers, t.contended
        (1.0, 3, 1, False)
    """

    time_s: float
    min_s: float
    spread: float
    samples: int  # taken
    kept: int  # clean and not outliers: what time_s is the median of
    disturbed: int
    outliers: int
    batch: int

    @property
    def contention(self) -> float:
        """The share of samples that were disturbed (0: none, 1: all)."""
        return self.disturbed / self.samples if self.samples else 1.0

    @property
    def contended(self) -> bool:
        """More than ``CONTENTION_LIMIT`` of the samples, or all but fewer than
        ``MIN_SAMPLES``, were disturbed."""
        clean = self.samples - self.disturbed
        return self.contention > CONTENTION_LIMIT or clean < MIN_SAMPLES

    @property
    def noisy(self) -> bool:
        return self.spread > SPREAD_LIMIT

    def fields(self, suffix: str = "") -> dict[str, Any]:
        """The record fields of this setting; ``suffix`` is ``""`` or ``"_1t"``."""
        return {
            f"time{suffix}_s": self.time_s,
            f"min{suffix}_s": self.min_s,
            f"spread{suffix}": round(self.spread, 4),
            f"samples{suffix}": self.samples,
            f"kept{suffix}": self.kept,
            f"contention{suffix}": round(self.contention, 4),
        }


def summarize(samples: list[Sample], batch: int) -> Timing:
    """Apply the robust rule to ``samples`` (not empty): set disturbed ones aside, reject slow
    outliers by the median absolute deviation, and summarise the rest.

    When every sample was disturbed, the rule runs on all of them (the best there is; the
    result is contended, hence provisional).
    """
    if not samples:
        raise ValueError("summarize needs at least one sample")
    clean = [s.seconds for s in samples if not s.disturbed]
    pool = clean or [s.seconds for s in samples]
    med = statistics.median(pool)
    mad = statistics.median(abs(x - med) for x in pool)
    # A floor on the MAD: identical samples (MAD 0) must not make every other one an outlier.
    limit = med + OUTLIER_MADS * max(_MAD_SIGMA * mad, 0.02 * med)
    kept = [x for x in pool if x <= limit]
    mid = statistics.median(kept)
    mad_kept = statistics.median(abs(x - mid) for x in kept)
    return Timing(
        time_s=mid,
        min_s=min(kept),
        spread=_MAD_SIGMA * mad_kept / mid if mid > 0 else 0.0,
        samples=len(samples),
        kept=len(kept) if clean else 0,
        disturbed=len(samples) - len(clean),
        outliers=len(pool) - len(kept),
        batch=batch,
    )


class RunQueueClock:
    """Seconds this process's threads have spent runnable but waiting for a CPU (the run-queue
    delay, second field of ``/proc/self/task/<tid>/schedstat``), summed over the threads that
    existed when it was made. ``None`` where the kernel does not tell (not Linux, or no
    schedstats): the other per-sample signals then stand alone.

    Example::

        >>> clock = RunQueueClock()
        >>> w = clock.waited_s()
        >>> w is None or w >= 0.0
        True
        >>> clock.close()
    """

    def __init__(self):
        self._fds: list[int] = []
        try:
            for tid in os.listdir("/proc/self/task"):
                self._fds.append(os.open(f"/proc/self/task/{tid}/schedstat", os.O_RDONLY))
        except OSError:  # no procfs, or a thread exited while listing: what opened counts
            pass

    def waited_s(self) -> float | None:
        if not self._fds:
            return None
        total = 0
        for fd in self._fds:
            try:
                total += int(os.pread(fd, 96, 0).split()[1])
            except (OSError, ValueError, IndexError):  # that thread exited: it waits no more
                continue
        return total / 1e9

    def close(self) -> None:
        for fd in self._fds:
            os.close(fd)
        self._fds = []

    def __enter__(self) -> RunQueueClock:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def contention_signals(
    wall: float, cpu: float | None, preempted: bool, queued: float = 0.0
) -> frozenset[str]:
    """The per-sample signals that fired: ``"cpu"`` (the calling thread ran for less than
    ``1 - CPU_DEFICIT_LIMIT`` of the sample; ``cpu`` is ``None`` where that does not apply,
    CUDA), ``"preempt"`` (a thread of the process was preempted), ``"queue"`` (its threads
    waited ``queued`` seconds for a CPU, more than ``RUN_QUEUE_LIMIT`` of the sample).

    Example::

        >>> sorted(contention_signals(1e-3, 0.5e-3, False, queued=0.6e-3))
        ['cpu', 'queue']
    """
    fired = (
        ("cpu", cpu is not None and cpu < (1.0 - CPU_DEFICIT_LIMIT) * wall),
        ("preempt", preempted),
        ("queue", queued > RUN_QUEUE_LIMIT * wall),
    )
    return frozenset(name for name, hit in fired if hit)


def _is_disturbed(wall: float, cpu: float | None, preempted: bool, queued: float = 0.0) -> bool:
    """The per-sample contention rule: any of ``contention_signals`` fired."""
    return bool(contention_signals(wall, cpu, preempted, queued))


def time_sample(
    call: Callable[[], Any], k: int, cuda: torch.device | None, queue: RunQueueClock | None = None
) -> Sample:
    """Time ``k`` back-to-back calls: seconds per call, and whether the sample was disturbed
    (``queue``: the run-queue clock of the process's threads; made here when not given)."""
    own = queue is None
    queue = RunQueueClock() if own else queue
    try:
        q0, csw0, cpu0 = queue.waited_s(), _preemptions(), time.thread_time()
        if cuda is not None:
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(k):
                call()
            end.record()
            end.synchronize()
            wall, cpu = start.elapsed_time(end) / 1e3, None  # elapsed_time is in milliseconds
        else:
            t0 = time.perf_counter()
            for _ in range(k):
                call()
            wall = time.perf_counter() - t0
            cpu = time.thread_time() - cpu0
        preempted, q1 = _preemptions() != csw0, queue.waited_s()
    finally:
        if own:
            queue.close()
    queued = q1 - q0 if q0 is not None and q1 is not None else 0.0
    signals = contention_signals(wall, cpu, preempted, queued)
    return Sample(wall / k, _is_disturbed(wall, cpu, preempted, queued), signals)


def time_calls(
    call: Callable[[], Any], cuda: torch.device | None, warmup: int, repeats: int
) -> Timing:
    """Time one thread setting of ``call`` (see the module docstring)."""
    if cuda is not None:
        torch.cuda.synchronize(cuda)
    est = math.inf
    for _ in range(max(1, warmup)):
        est = min(est, time_sample(call, 1, cuda).seconds)
        if est > SETTING_BUDGET_S / 4:  # an expensive op is warm after one call
            break
    k = 1  # calls per sample: enough that a sample lasts BATCH_TARGET_S
    if est < BATCH_TARGET_S:
        k = min(MAX_BATCH, math.ceil(BATCH_TARGET_S / max(est, 1e-9)))
    reps = max(MIN_SAMPLES, min(repeats, int(SETTING_BUDGET_S / max(est * k, 1e-12))))
    with RunQueueClock() as queue:  # after the warm-up: the OpenMP team exists by now
        samples = [time_sample(call, k, cuda, queue) for _ in range(reps)]
    return summarize(samples, k)


class RetryBudget:
    """Seconds one profiling run may spend re-measuring contended settings.

    Example::

        >>> b = RetryBudget(1.0)
        >>> b.spend(0.4); round(b.left, 1)
        0.6
    """

    def __init__(self, seconds: float):
        self.left = float(seconds)

    def spend(self, seconds: float) -> None:
        self.left -= seconds


def _time_with_retries(call, cuda, warmup, repeats, budget: RetryBudget | None) -> Timing:
    best = time_calls(call, cuda, warmup, repeats)
    for _ in range(RETRIES):
        if not best.contended or budget is None or budget.left <= 0:
            break
        t0 = time.perf_counter()
        time.sleep(RETRY_PAUSE_S)
        again = time_calls(call, cuda, 1, repeats)
        budget.spend(time.perf_counter() - t0)
        if (again.contention, -again.kept) < (best.contention, -best.kept):
            best = again
    return best


def measure_op(
    call: Callable[[], Any],
    cuda: torch.device | None,
    *,
    warmup: int,
    repeats: int,
    single_thread: bool = True,
    budget: RetryBudget | None = None,
) -> dict[str, Any]:
    """The measurement record of one operator call at the current thread count and, when
    ``single_thread`` (CPU only), at 1 thread: times, dispersion, samples, contention and the
    verdict ``quality``. The intra-op thread count is restored even if a call raises.

    Example::

        >>> import torch
        >>> x = torch.randn(32, 32)
        >>> rec = measure_op(lambda: x @ x, None, warmup=1, repeats=3)
        >>> rec["quality"] in ("clean", "provisional"), rec["samples"] >= 3
        (True, True)
    """
    threads = torch.get_num_threads()
    main = _time_with_retries(call, cuda, warmup, repeats, budget)
    record: dict[str, Any] = {**main.fields(), "batch": main.batch, "threads": threads}
    settings = [(main, f"{threads} thread(s)")]
    if cuda is not None or threads == 1:
        record.update(main.fields("_1t"))  # intra-op threads are a CPU setting
    elif single_thread:
        try:
            torch.set_num_threads(1)
            one = _time_with_retries(call, None, warmup, repeats, budget)
        finally:
            torch.set_num_threads(threads)
        record.update(one.fields("_1t"))
        settings.append((one, "1 thread"))
    else:
        record["time_1t_s"] = None  # not measured; shows as NaN in the table
    why = [
        f"{t.disturbed}/{t.samples} samples disturbed at {where}"
        if t.contended
        else f"spread {t.spread:.2f} at {where}"
        for t, where in settings
        if t.contended or t.noisy
    ]
    record["repeats"] = main.samples
    record["quality"] = PROVISIONAL if why else CLEAN
    if why:
        record["reason"] = "; ".join(why)
    record["measured_at"] = round(time.time(), 3)
    return record


class NodeTimes(Mapping):
    """A read-only mapping node key -> seconds, cheap to carry in ``DataFrame.attrs``: pandas
    deep-copies ``attrs`` on every operation, and this copies as itself.

    Example::

        >>> import copy
        >>> times = NodeTimes({"g0.fw/mm": 1e-4})
        >>> copy.deepcopy(times) is times, times["g0.fw/mm"]
        (True, 0.0001)
    """

    def __init__(self, times: Mapping[str, float]):
        self._times = {str(k): float(v) for k, v in times.items()}

    def __getitem__(self, key: str) -> float:
        return self._times[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._times)

    def __len__(self) -> int:
        return len(self._times)

    def __repr__(self) -> str:
        return f"NodeTimes({len(self._times)} nodes)"

    def __deepcopy__(self, memo) -> NodeTimes:
        return self

    def __copy__(self) -> NodeTimes:
        return self


def planning_time_s(record: Mapping[str, Any]) -> float:
    """The T-thread time a plan should assume for a stored ``record``: its ``time_s``, or,
    when that setting was contended and the 1-thread one was not, at most ``time_1t_s``.

    Why: a contended T-thread sample is an OpenMP team waiting at its barriers for a member
    whose core a neighbour took (10-100x the op's time, see docs/cost-model.md), while one
    thread loses little. On a quiet machine T threads are not slower than one beyond the
    fork/join overhead, so the clean 1-thread time bounds the op. (The record stays as it
    was measured, provisional: the next profile measures it again.)

    Example::

        >>> planning_time_s({"time_s": 0.115, "contention": 0.9, "time_1t_s": 0.004,
        ...                  "contention_1t": 0.0})
        0.004
    """
    t = float(record["time_s"])
    t1 = record.get("time_1t_s")
    if (
        t1 is not None
        and float(record.get("contention", 0.0)) > CONTENTION_LIMIT
        and float(record.get("contention_1t", 1.0)) <= CONTENTION_LIMIT
    ):
        return min(t, float(t1))
    return t
