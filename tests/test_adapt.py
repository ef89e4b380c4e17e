"""Adaptive execution: the monitor, drift -> re-plan, the shape cache, memory budgets.

No test asserts on a timing: slowdowns are injected with ``autopar.adapt.monitor.inject_slowdown``
(deterministic, no sleeping) and drift thresholds are set far above timing noise.
"""

from __future__ import annotations

import copy
import logging
import re
import warnings

import pytest
import torch
import torch.nn as nn

import autopar
from autopar.adapt import monitor as adapt
from autopar.errors import FallbackWarning, PlanError
from autopar.planning.partition import default_machine, make_plan
from autopar.planning.simulate import simulate
from autopar.planning.taskgraph import task_graph_from_profile
from autopar.profiling.store import ProfileStore
from autopar.tools import zoo


class TwoBranch(nn.Module):
    """A matmul chain next to a conv chain: the planner puts them on different streams."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(128, 128) / 12)
        self.conv = nn.Conv1d(8, 8, 3, padding=1)

    def forward(self, x, z):
        a = x
        for _ in range(3):
            a = torch.tanh(a @ self.w)
        b = z
        for _ in range(3):
            b = torch.sigmoid(self.conv(b))
        return a.sum() + b.sum()


def _inputs():
    g = torch.Generator().manual_seed(0)
    return torch.randn(64, 128, generator=g), torch.randn(16, 8, 256, generator=g)


def _compile(model, **kw):
    kw.setdefault("streams", 2)
    kw.setdefault("race", False)  # these tests watch the monitor on every compiled step
    return autopar.compile(model, store=ProfileStore.memory(), **kw)


def test_stats_rows_and_stream_samples():
    model, (x,) = zoo.build("towers")
    opts = autopar.AdaptOptions(sample_every=2, threshold=50.0)
    cm = _compile(model, policy="heft", adapt=opts)
    for _ in range(4):
        cm(x).sum().backward()
    df = autopar.stats(cm)
    assert list(df.columns) == adapt.STEP_COLUMNS
    assert list(df.step) == [0, 1, 2, 3]
    assert set(df.graphs) == {"g0.fw,g0.bw"}
    assert df.event[0] == "profiled and planned; profiled and planned"
    assert (df.measured_s > 0).all() and (df.predicted_s > 0).all()
    plans = {r.plan.plan_hash for r in cm._autopar_pipeline.records}
    assert set(df.plan[1].split(",")) == plans
    per = autopar.stats(cm, per="graph")
    sampled = [s for s in per.streams_s if s]
    assert sampled and all(isinstance(v, float) for s in sampled for v in s.values())
    if any(len(r.plan.streams) > 1 for r in cm._autopar_pipeline.records):
        assert any(len(s) > 1 for s in sampled)  # each worker stream timed on its own


def test_adapt_false_records_nothing():
    model, (x,) = zoo.build("mlp")
    cm = _compile(model, adapt=False)
    cm(x).sum().backward()
    cm(x).sum().backward()
    assert autopar.stats(cm).empty
    with pytest.raises(ValueError, match="adapt must be"):
        autopar.compile(model, adapt="yes")
    with pytest.raises(ValueError, match="threshold"):
        autopar.AdaptOptions(threshold=0.5)


def _sim(plan, table):
    g = task_graph_from_profile(table)
    return simulate(g, plan.placement, list(plan.order), list(plan.streams), default_machine())


def test_injected_slowdown_replans_and_moves_work(caplog):
    model = TwoBranch()
    x, z = _inputs()
    opts = autopar.AdaptOptions(window=3, warmup=1, threshold=2.5, max_replans=6, background=True)
    eager, cm = copy.deepcopy(model), _compile(copy.deepcopy(model), policy="heft", adapt=opts)
    for _ in range(5):
        cm(x, z).backward()
    rec = {r.tag: r for r in cm._autopar_pipeline.records}["g0.fw"]
    stale = rec.plan
    caplog.set_level(logging.INFO, logger="autopar")
    adapt.inject_slowdown(cm, target="aten.mm.default", factor=100.0)
    for _ in range(12):
        cm.zero_grad()
        out = cm(x, z)
        out.backward()
        adapt.wait(cm)
        if rec.plan.plan_hash != stale.plan_hash:
            break
    new = rec.plan
    assert new.plan_hash != stale.plan_hash, autopar.stats(cm).event.tolist()
    assert any(re.search(r"ops moved: .*aten\.mm\.default \d+", m) for m in caplog.messages)
    # the new plan was made for the slow matmul: it predicts more, places differently ...
    assert new.predicted_step_time > stale.predicted_step_time
    assert new.placements != stale.placements
    # ... and on the costs it was made from it is not worse than keeping the stale
    # placement (HEFT is a heuristic and the re-profile re-measures every op on a noisy
    # machine, hence the margin; simulated, no timing asserted)
    assert _sim(new, rec.table).makespan <= _sim(stale, rec.table).makespan * 1.25
    events = autopar.stats(cm).event
    assert events.str.contains("re-planned").any()
    # still equal to eager after the swap
    eager.zero_grad()
    ye = eager(x, z)
    ye.backward()
    torch.testing.assert_close(out, ye, rtol=1e-5, atol=1e-5)
    for pe, pc in zip(eager.parameters(), cm.parameters(), strict=True):
        torch.testing.assert_close(pc.grad, pe.grad, rtol=1e-4, atol=1e-5)


def test_thread_count_change_gets_its_own_plan(caplog):
    caplog.set_level(logging.INFO, logger="autopar")
    model, (x,) = zoo.build("mlp")
    opts = autopar.AdaptOptions(warmup=0, threshold=50.0, background=False)
    eager, cm = copy.deepcopy(model), _compile(copy.deepcopy(model), adapt=opts)
    cm(x).sum().backward()
    before = torch.get_num_threads()
    target = 1 if before > 1 else 2
    try:
        torch.set_num_threads(target)
        for _ in range(3):
            y = cm(x)
            y.sum().backward()
    finally:
        torch.set_num_threads(before)
    misses = [m for m in caplog.messages if "plan cache miss" in m]
    assert len(misses) == 2 and f"{target} thread" in misses[1], misses
    threads = {int(r.table.threads.iloc[0]) for r in cm._autopar_pipeline.records}
    assert threads == {before, target}  # each thread count was profiled and planned
    torch.testing.assert_close(y, eager(x), rtol=1e-5, atol=1e-6)


def test_shape_cache_lru_misses_eviction_and_thrash(caplog):
    caplog.set_level(logging.INFO, logger="autopar")
    model, _ = zoo.build("mlp")
    eager, cm = copy.deepcopy(model), _compile(copy.deepcopy(model), cache_size=2, adapt=False)
    assert torch._dynamo.config.recompile_limit >= 2
    for b in (4, 8, 4, 16, 4, 8, 16):
        x = torch.randn(b, 32)
        torch.testing.assert_close(cm(x), eager(x), rtol=1e-5, atol=1e-6)
    misses = [m for m in caplog.messages if "plan cache miss" in m]
    # 4, 8 (4 hit), 16 evicts 8, (4 hit), 8 evicts 16, 16 evicts 4
    assert len(misses) == 5, misses
    assert "[8, 32] float32; no_grad" not in misses[1]
    assert "seen before, evicted" in misses[3]
    thrash = [m for m in caplog.messages if "dynamic-shape thrash" in m]
    assert len(thrash) == 1 and "cache_size" in thrash[0] and "bucket" in thrash[0]
    limit = cm._autopar_pipeline.recompile_limit  # past it Dynamo runs new shapes eagerly
    assert f"recompile limit ({limit}) new ones run eagerly" in thrash[0], thrash[0]
    cache = cm._autopar_pipeline.monitor.cache
    assert len(cache.entries) == 2 and cache.evictions == 3
    live = [r for r in cm._autopar_pipeline.records if r.runner is not None]
    assert len({r.group for r in live}) == 2  # the evicted shapes' plans were dropped


def test_memory_budget_trades_concurrency():
    model, (x,) = zoo.build("towers")
    table = autopar.profile(model, x, store=ProfileStore.memory())
    fw = table[table.graph == "g0.fw"]
    free = make_plan(fw, streams=4, policy="auto")
    serial = make_plan(fw, streams=4, policy="serial")
    if free.predicted_peak_memory <= serial.predicted_peak_memory:
        pytest.skip("the unconstrained plan already has the serial plan's peak")
    budget = serial.predicted_peak_memory
    tight = make_plan(fw, streams=4, policy="auto", memory_budget=budget)
    assert tight.predicted_peak_memory <= budget < free.predicted_peak_memory
    assert len(tight.streams) <= len(free.streams)
    with pytest.raises(PlanError, match="no plan fits memory_budget"):
        make_plan(fw, streams=4, policy="auto", memory_budget=16)
    # through compile: an impossible budget falls back (warned), results stay right
    cm = _compile(copy.deepcopy(model), memory_budget=16, adapt=False)
    with pytest.warns(FallbackWarning, match="memory_budget"):
        y = cm(x)
    torch.testing.assert_close(y, model(x), rtol=1e-5, atol=1e-6)


def test_predicted_vs_measured_peak_memory():
    model, (x,) = zoo.build("mlp")
    x = torch.randn(256, 32)
    cm = _compile(model, streams=1, policy="serial", adapt=False)
    with torch.no_grad():
        cm(x)  # profile + plan the inference graph
        (rec,) = cm._autopar_pipeline.records
        seen, runner = [], rec.runner
        rec.runner = lambda a: seen.append(list(a)) or runner(a)
        cm(x)
        measured = adapt.measure_peak_memory(lambda: rec.program.fn(*seen[0]))
    predicted = rec.plan.predicted_peak_memory
    assert predicted > 0 and measured > 0
    # same order of magnitude (the profiler counts allocator blocks; the plan, tensors)
    assert predicted / 4 <= measured <= predicted * 4, (predicted, measured)


def test_no_fallback_warnings_with_adapt_on():
    model, (x,) = zoo.build("inception")
    with warnings.catch_warnings():
        warnings.simplefilter("error", FallbackWarning)
        from oracle import check_training

        check_training(model, (x,), lambda m: _compile(m, adapt=autopar.AdaptOptions()))


def test_one_noisy_window_does_not_replan():
    """Hysteresis: a slowdown lasting one window (a neighbour process) changes nothing; the
    same slowdown sustained over ``confirm_windows`` windows re-profiles."""
    model = TwoBranch()
    x, z = _inputs()
    opts = autopar.AdaptOptions(window=3, warmup=1, threshold=4.0, confirm_windows=2)
    cm = _compile(copy.deepcopy(model), policy="heft", adapt=opts)
    for _ in range(5):  # warm-up and baseline
        cm(x, z).backward()
    rec = {r.tag: r for r in cm._autopar_pipeline.records}["g0.fw"]
    stale = rec.plan.plan_hash
    adapt.inject_slowdown(cm, target="aten.mm.default", factor=100.0)
    for _ in range(opts.window):  # exactly one slow window
        cm(x, z).backward()
    adapt.inject_slowdown(cm, target="aten.mm.default", factor=1.0)
    for _ in range(2 * opts.window):
        cm(x, z).backward()
        adapt.wait(cm)
    assert rec.plan.plan_hash == stale
    assert not autopar.stats(cm).event.str.contains("re-profil|re-plan").any()


def test_no_drift_is_judged_while_the_models_own_warm_up_compiles(monkeypatch):
    """A background compile of the model itself shares the machine: the monitor records the
    calls but takes no baseline and sees no drift then; once it is done, a fresh baseline."""
    model = TwoBranch()
    x, z = _inputs()
    opts = autopar.AdaptOptions(window=3, warmup=1, threshold=4.0, confirm_windows=1)
    cm = _compile(copy.deepcopy(model), policy="heft", adapt=opts)
    pipe = cm._autopar_pipeline
    compiling = [True]
    monkeypatch.setattr(pipe, "compiling", lambda: compiling[0])  # a build "runs"
    rec_fw = lambda: {r.tag: r for r in pipe.records}["g0.fw"]  # noqa: E731
    for _ in range(2 * opts.window + 2):
        cm(x, z).backward()
    st = pipe.monitor.state(rec_fw())
    assert st.baseline is None and not st.ratios  # nothing judged while it compiled
    adapt.inject_slowdown(cm, target="aten.mm.default", factor=100.0)
    for _ in range(2 * opts.window):
        cm(x, z).backward()
    assert not autopar.stats(cm).event.str.contains("re-profil").any()
    compiling[0] = False  # the compile is done: the next window is the baseline
    for _ in range(opts.window + opts.warmup + 1):
        cm(x, z).backward()
    assert pipe.monitor.state(rec_fw()).baseline is not None
    assert len(autopar.stats(cm)) > 0  # the calls were recorded all along
    assert {r.executor for r in pipe.records} == {"plan"}
