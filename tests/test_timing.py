"""Measurement quality: the robust rule, the contention verdict, retries, provisional records
in the profiler, and call descriptions. Samples are faked wherever a verdict is checked: no
test depends on how busy the machine is."""

from __future__ import annotations

import copy
import importlib
import json
import math

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

from autopar.profiling.callspec import NotRebuildable, encode, rebuild
from autopar.profiling.profiler import profile_graph
from autopar.profiling.quality import disagree, is_provisional, preferred, quality
from autopar.profiling.store import ProfileStore
from autopar.profiling.timing import (
    MIN_SAMPLES,
    NodeTimes,
    RetryBudget,
    Sample,
    Timing,
    measure_op,
    summarize,
    time_calls,
)

timing = importlib.import_module("autopar.profiling.timing")


def _quiet(monkeypatch, disturbed=False):
    monkeypatch.setattr(timing, "_is_disturbed", lambda *_: disturbed)
    monkeypatch.setattr(timing, "SPREAD_LIMIT", math.inf)


# -- the robust rule ---------------------------------------------------------------------------
def test_disturbed_samples_and_slow_outliers_are_set_aside():
    samples = [Sample(1.0), Sample(1.02), Sample(0.98), Sample(1.01), Sample(30.0)]
    samples += [Sample(16.0, disturbed=True), Sample(15.0, disturbed=True)]
    t = summarize(samples, batch=4)
    assert t.time_s == pytest.approx(1.005) and t.min_s == 0.98
    assert (t.samples, t.disturbed, t.outliers, t.kept, t.batch) == (7, 2, 1, 4, 4)
    assert t.contention == pytest.approx(2 / 7) and not t.contended
    assert t.spread < 0.05


def test_mostly_disturbed_is_contended_and_all_disturbed_still_gives_a_time():
    t = summarize([Sample(0.12), Sample(8.0, True), Sample(9.0, True)], batch=1)
    assert t.contended and t.time_s == 0.12  # the clean sample is still the estimate
    t = summarize([Sample(16.0, True)] * 5, batch=1)
    assert t.contended and t.kept == 0 and t.time_s == 16.0 and t.contention == 1.0


def test_identical_samples_reject_nothing():
    t = summarize([Sample(2e-6)] * 3 + [Sample(2.03e-6)], batch=25)
    assert t.outliers == 0 and t.spread == 0.0 and not t.contended


def test_threads_waiting_for_a_cpu_disturb_a_sample():
    """An OpenMP worker descheduled before the sample began queues throughout while the
    calling thread spins at the barrier: no CPU-time deficit, no new preemption, but
    run-queue delay (timing.RunQueueClock)."""
    assert timing._is_disturbed(1e-3, 1e-3, False, queued=0.6e-3)
    assert not timing._is_disturbed(1e-3, 1e-3, False, queued=0.0)

    class Queued:  # every read says the threads waited one more second
        def __init__(self):
            self.t = 0.0

        def waited_s(self):
            self.t += 1.0
            return self.t

    x = torch.randn(8, 8)
    sample = timing.time_sample(lambda: x @ x, 1, None, Queued())
    assert sample.disturbed and "queue" in sample.signals


def test_run_queue_clock_reads_this_process():
    with timing.RunQueueClock() as clock:
        a = clock.waited_s()
        b = clock.waited_s()
    if a is None:  # no /proc/self/task/*/schedstat (not Linux): the other signals stand alone
        pytest.skip("no schedstat here")
    assert 0.0 <= a <= b
    assert clock.waited_s() is None  # closed


def test_one_slow_warmup_does_not_become_the_measurement(monkeypatch):
    """The issue's 0.848 s entry for a 4.8 ms operator: one slow call was the only sample."""
    seen = []

    def fake(call, k, cuda, queue=None):
        seen.append(k)
        return Sample(0.848 if len(seen) == 1 else 0.0048)

    monkeypatch.setattr(timing, "time_sample", fake)
    t = time_calls(lambda: None, None, warmup=1, repeats=5)
    assert t.time_s == 0.0048 and t.samples >= MIN_SAMPLES and t.outliers == 0


def test_at_least_min_samples_even_when_one_repeat_is_asked(monkeypatch):
    _quiet(monkeypatch)
    x = torch.randn(16, 16)
    assert time_calls(lambda: x @ x, None, warmup=1, repeats=1).samples == MIN_SAMPLES


# -- the verdict and retries -----------------------------------------------------------------
def _timing(contended: bool) -> Timing:
    samples = [Sample(1e-3, contended)] * 4 + [Sample(1e-3)]
    return summarize(samples, batch=1)


def test_contended_setting_is_retried_and_a_clean_retry_counts(monkeypatch):
    script = [_timing(True), _timing(False)]
    calls = []
    monkeypatch.setattr(timing, "time_calls", lambda *a: calls.append(a) or script.pop(0))
    monkeypatch.setattr(timing, "RETRY_PAUSE_S", 0.0)
    rec = measure_op(lambda: None, None, warmup=1, repeats=5, single_thread=False,
                     budget=RetryBudget(10.0))  # fmt: skip
    assert len(calls) == 2 and rec["quality"] == "clean" and "reason" not in rec
    assert rec["contention"] == 0.0 and rec["samples"] == 5


def test_still_contended_is_provisional_with_a_reason(monkeypatch):
    calls = []
    monkeypatch.setattr(timing, "time_calls", lambda *a: calls.append(a) or _timing(True))
    monkeypatch.setattr(timing, "RETRY_PAUSE_S", 0.0)
    budget = RetryBudget(10.0)
    rec = measure_op(lambda: None, None, warmup=1, repeats=5, single_thread=False, budget=budget)
    assert len(calls) == 1 + timing.RETRIES and budget.left < 10.0
    assert rec["quality"] == "provisional" and "4/5 samples disturbed" in rec["reason"]
    calls.clear()
    measure_op(lambda: None, None, warmup=1, repeats=5, budget=RetryBudget(0.0),
               single_thread=False)  # fmt: skip
    assert len(calls) == 1  # no budget left: no retry


def test_measure_op_records_both_settings_and_restores_threads(monkeypatch):
    _quiet(monkeypatch)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        x = torch.randn(32, 32)
        rec = measure_op(lambda: x @ x, None, warmup=1, repeats=3)
        assert torch.get_num_threads() == 2 and rec["threads"] == 2
        fields = "time_s min_s spread samples kept contention time_1t_s min_1t_s samples_1t"
        for key in fields.split() + ["contention_1t", "measured_at", "quality"]:
            assert key in rec, key
        assert rec["quality"] == "clean" and rec["min_s"] <= rec["time_s"]
    finally:
        torch.set_num_threads(before)


# -- provisional records in the profiler ------------------------------------------------------
def _gm():
    x, w = torch.randn(16, 16), torch.randn(16, 16)
    return make_fx(lambda x, w: torch.relu(x @ w))(x, w), [x, w]


def test_contended_profile_is_provisional_and_measured_again(monkeypatch):
    gm, xs = _gm()
    store = ProfileStore.memory()
    monkeypatch.setattr(timing, "RETRY_PAUSE_S", 0.0)
    _quiet(monkeypatch, disturbed=True)
    _, first = profile_graph(gm, xs, store=store, warmup=1, repeats=3)
    assert first.attrs["provisional"] and all(is_provisional(store.get(s)) for s in store)
    _quiet(monkeypatch, disturbed=False)
    _, second = profile_graph(gm, xs, store=store, warmup=1, repeats=3)
    assert second.attrs["measured"] == first.attrs["measured"]  # provisional: re-measured
    assert not second.attrs["provisional"] and not any(is_provisional(store.get(s)) for s in store)
    _, third = profile_graph(gm, xs, store=store, warmup=1, repeats=3)
    assert third.attrs["measured"] == 0  # clean entries are reused


def test_a_contended_reprofile_never_overwrites_clean_entries(monkeypatch):
    """The monitor re-profiles into a memory store and puts every fresh record into the
    pipeline's store: under contention those are provisional and must not land."""
    gm, xs = _gm()
    store = ProfileStore.memory()
    _quiet(monkeypatch)
    profile_graph(gm, xs, store=store, warmup=1, repeats=3)
    clean = {s: store.get(s) for s in store}
    monkeypatch.setattr(timing, "RETRY_PAUSE_S", 0.0)
    _quiet(monkeypatch, disturbed=True)
    fresh = ProfileStore.memory()
    profile_graph(gm, xs, store=fresh, warmup=1, repeats=3)
    assert all(is_provisional(fresh.get(s)) for s in fresh)
    for sig in fresh:
        assert not store.put(sig, fresh.get(sig))
    assert {s: store.get(s) for s in store} == clean


def test_profile_attrs_carry_this_runs_evidence(monkeypatch):
    _quiet(monkeypatch)
    gm, xs = _gm()
    store = ProfileStore.memory()
    _, first = profile_graph(gm, xs, store=store, warmup=1, repeats=3)
    comp = first[first.signature != ""]
    assert first.attrs["measured_s"] == pytest.approx(comp.time_s.sum())  # fresh: their times
    _, second = profile_graph(gm, xs, store=store, warmup=1, repeats=3)
    evidence = second.attrs["evidence"]
    assert isinstance(evidence, NodeTimes) and set(evidence) == set(comp.key)
    assert all(v > 0 for v in evidence.values())
    assert copy.deepcopy(second.attrs["evidence"]) is evidence  # cheap in DataFrame.attrs


# -- the quality rules ---------------------------------------------------------------------------
def test_quality_rules():
    clean, prov = {"time_s": 1.0, "quality": "clean"}, {"time_s": 0.1, "quality": "provisional"}
    assert quality({"time_s": 1.0}) == "clean" and quality({"quality": "odd"}) == "provisional"
    assert preferred(clean, prov) is clean and preferred(prov, clean) is clean
    assert preferred(None, prov) is prov
    assert preferred({"time_s": 1.0}, {"time_s": 2.0}) == {"time_s": 1.0}  # disagree: faster
    assert preferred({"time_s": 1.0}, {"time_s": 1.2}) == {"time_s": 1.2}  # agree: newer
    assert disagree(0.0, 1e-6) and not disagree(1.0, 1.5) and disagree(1.0, 1.51)


# -- call descriptions -------------------------------------------------------------------------
def test_call_description_round_trip():
    x = torch.randn(4, 6).t()  # strides matter
    spec = encode("aten.addmm.default", (torch.zeros(4), x, torch.randn(4, 4)), {"beta": 0.5})
    fn, device = rebuild(spec)
    out = fn()
    assert out.shape == (6, 4) and device is None
    spec = encode("aten.clamp.default", (torch.randn(3),), {"min": -math.inf, "max": 0.0})
    spec = json.loads(json.dumps(spec, allow_nan=False))  # as the store keeps it
    assert rebuild(spec)[0]().max() <= 0.0  # -inf survives JSON
    args = (torch.randn(5, 3), 0, torch.tensor([4, 2]))
    fn, _ = rebuild(encode("aten.index_select.default", args, {}))
    assert fn().shape == (2, 3)  # integer tensors are zeros: valid indices


@pytest.mark.parametrize(
    "target, args, why",
    [
        ("aten.nonzero.default", (torch.ones(3),), "values"),
        ("module:Linear(in_features=2)", (torch.ones(2),), None),
        ("aten.mm.default", (torch.ones(2, 2), object()), None),
    ],
)
def test_calls_that_cannot_be_rebuilt(target, args, why):
    assert encode(target, args, {}) is None
    with pytest.raises(NotRebuildable, match="no call description"):
        rebuild(None)
    if why:
        with pytest.raises(NotRebuildable, match=why):
            rebuild({"target": target, "args": [], "kwargs": {}})


def test_planning_time_trusts_a_clean_one_thread_time_over_a_contended_team():
    from autopar.profiling.timing import planning_time_s

    contended = {"time_s": 0.115, "contention": 0.9, "time_1t_s": 0.004, "contention_1t": 0.0}
    assert planning_time_s(contended) == 0.004
    clean = {**contended, "contention": 0.1, "time_s": 0.003}
    assert planning_time_s(clean) == 0.003  # a clean T-thread time is used as measured
    both = {**contended, "contention_1t": 0.8}
    assert planning_time_s(both) == 0.115  # nothing better to go on
    assert planning_time_s({"time_s": 0.002}) == 0.002  # CUDA / old records
