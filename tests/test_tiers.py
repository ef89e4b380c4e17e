"""The Inductor tier: the whole zoo trains like eager (fp64 oracle) with every graph run by
Inductor, and a background tier swapped in mid-training keeps training equal to eager.

These are the suite's Inductor tests (the others run with AUTOPAR_INDUCTOR=0, see
conftest.py): a cold compile costs seconds per graph, Inductor's FX graph cache makes
reruns cheap. ``LAND_MARGIN`` is raised so that the tier always lands: what is tested here
is the executor's correctness, not which executor is faster on this machine.
"""

from __future__ import annotations

import copy
import subprocess
import time
import warnings

import pytest
import torch
from nets import BranchyNet, train_side_by_side
from oracle import check_training

import autopar
import autopar.runtime.tiers as tiers
from autopar.errors import FallbackWarning
from autopar.profiling.store import ProfileStore
from autopar.tools import zoo

ZOO = ["mlp", "inception", "towers", "transformer", "inplace_views", "dropout", "lstm_cells"]


@pytest.fixture
def always_land(monkeypatch):
    monkeypatch.setattr(tiers, "LAND_MARGIN", float("inf"))


@pytest.mark.parametrize("name", ZOO)
def test_zoo_trains_like_eager_under_inductor(name, always_land):
    model, inputs = zoo.build(name)
    compiled = {}

    def compile_fn(m):
        compiled["m"] = autopar.compile(
            m, inductor=True, background=False, race=False, store=ProfileStore.memory()
        )
        return compiled["m"]

    with warnings.catch_warnings():
        warnings.simplefilter("error", FallbackWarning)
        check_training(model, inputs, compile_fn, opt_name="sgd")
    executors = {u.tag: u.executor for u in autopar.graphs(compiled["m"])}
    assert set(executors.values()) == {"inductor"}, executors


def test_background_tier_swaps_mid_training_and_keeps_equivalence(always_land):
    torch.manual_seed(0)
    model = BranchyNet()
    eager = copy.deepcopy(model)
    cmodel = autopar.compile(model, inductor=True, background=True, race=False,
                             store=ProfileStore.memory())  # fmt: skip

    def between(step: int) -> None:
        if step == 1:
            assert autopar.wait(cmodel, timeout=300)

    seen = train_side_by_side(cmodel, eager, torch.randn(8, 16), 6, between)
    assert seen[0] == {"plan"}  # training started at once on the planned programs
    assert seen[-1] == {"inductor"}  # ... and the Inductor tier landed mid-training
    for p, q in zip(model.parameters(), eager.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
    for b, c in zip(model.buffers(), eager.buffers(), strict=True):
        torch.testing.assert_close(b, c, rtol=1e-5, atol=1e-6)
    assert "landed" in autopar.explain(cmodel)


def test_backward_tier_accepts_a_new_layout_from_the_forward_tier(always_land):
    """An Inductor forward may save activations in another layout (channels-last convs)
    than the planned forward did when the backward's candidates were made: the backward's
    candidates are made again for the new layouts (not measured copying their inputs),
    and both tiers land; gradients stay eager's."""
    model, (x,) = zoo.build("inception")
    eager = copy.deepcopy(model)
    cmodel = autopar.compile(model, inductor=True, background=True, race=False,
                             store=ProfileStore.memory())  # fmt: skip
    for step in range(4):
        for m in (cmodel, eager):
            m.zero_grad()
            m(x).square().mean().backward()
        if step in (0, 1):  # after step 1 (forward landed) the backward compiles again
            assert autopar.wait(cmodel, timeout=300)
    assert {u.tag: u.executor for u in autopar.graphs(cmodel)} == {
        "g0.fw": "inductor", "g0.bw": "inductor"}  # fmt: skip
    notes = [p.note for u in autopar.graphs(cmodel) for p in u.provenance if p.stage == "tier"]
    assert len(notes) == 2, notes  # each graph measured once, the backward on new layouts
    for p, q in zip(model.parameters(), eager.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-5)


def test_segment_tier_lands_and_trains_like_eager(always_land, monkeypatch):
    """The segment tier (Inductor C++-wrapper segments on two streams) as a candidate: the
    cost model's bar is lowered so that a small two-branch graph qualifies; it compiles at
    the first call (background=False), lands, and training equals eager (fp64 oracle)."""
    import autopar.runtime.segment_runner as seg

    monkeypatch.setenv("AUTOPAR_TIERS", "segments")
    monkeypatch.setattr(seg, "SEGMENT_MIN_SAVING_S", 0.0)
    monkeypatch.setattr(seg, "SEGMENT_MIN_GAIN", 1.0)
    torch.manual_seed(0)
    model = BranchyNet().eval()  # eval: no dropout draws, BatchNorm reads its statistics
    x = torch.randn(8, 16)
    compiled = {}

    def compile_fn(m):
        compiled["m"] = autopar.compile(m, inductor=True, background=False, race=False,
                                        streams=2, store=ProfileStore.memory())  # fmt: skip
        return compiled["m"]

    check_training(model, (x,), compile_fn, opt_name="sgd")
    executors = {u.tag: u.executor for u in autopar.graphs(compiled["m"])}
    assert "segments" in executors.values(), (executors, autopar.explain(compiled["m"]).tiers)


def test_unknown_tier_name_is_a_clear_error(monkeypatch):
    monkeypatch.setenv("AUTOPAR_TIERS", "inductor,warp")
    with pytest.raises(ValueError, match="unknown tier.*warp"):
        tiers.default_candidates()


def test_a_ready_tier_still_lands_after_the_race_chose_eager(always_land, monkeypatch):
    """An "eager" verdict makes no graph calls, and candidates land only at their graph's
    next call: once the warm-ups are done, one step runs compiled (uncounted), the tier
    lands, and the race starts again."""
    # No pauses for the warm-up (runtime.tiers.COMPILE_SHARE): they would only make the
    # steps before the verdict slower; what is tested is the landing after it.
    monkeypatch.setattr(tiers, "COMPILE_SHARE", 0.0)
    torch.manual_seed(0)
    model = BranchyNet().eval()
    cmodel = autopar.compile(model, inductor=True, background=True,
                             store=ProfileStore.memory())  # fmt: skip
    race = cmodel._autopar_pipeline.race
    race.samples, race.max_samples, race.margin = 2, 2, 0.0  # compiled never wins: eager
    x = torch.randn(8, 16)
    for _ in range(1 + 2 * race.samples * race.run + 3):  # the first step, the turns, spare
        cmodel(x).sum().backward()
    assert {v for v, _ in race.report().values()} == {"eager"}
    assert autopar.wait(cmodel, timeout=300)
    cmodel(x).sum().backward()  # runs compiled: the tiers are measured and land
    assert {u.executor for u in autopar.graphs(cmodel)} == {"inductor"}
    assert all({"plan", "inductor"} <= dict(u.measured).keys() for u in autopar.graphs(cmodel))
    assert {v for v, _ in race.report().values()} == {None}  # racing again


class _Running:
    """A warm-up job that has not finished."""

    def poll(self):
        return None

    def kill(self):  # the Tiers' finalizer cancels what still runs
        pass


def test_training_yields_its_share_to_a_running_warm_up_and_only_then():
    t = tiers.Tiers(background=True, candidates=())
    assert t.compile_pause(0.010) == 0.0  # nothing compiles: no pause
    t._procs.append(_Running())
    share = tiers.COMPILE_SHARE
    # the pause is share / (1 - share) of the step's own time: the warm-up gets `share` of
    # the wall time; a long step is counted as MAX_STEP_S
    assert t.compile_pause(0.010) == pytest.approx(0.010 * share / (1 - share))
    assert t.compile_pause(60.0) == pytest.approx(tiers.MAX_STEP_S * share / (1 - share))


class _Hung:
    """A warm-up job that never finishes by itself (a build waiting for a lock nobody will
    release): it ends only when killed, as a WarmupJob's worker does."""

    def __init__(self):
        self.killed = False

    def poll(self):
        return -9 if self.killed else None

    def wait(self, timeout=None):
        if not self.killed:
            time.sleep(min(timeout, 0.05) if timeout is not None else 0.05)
            raise subprocess.TimeoutExpired("hung", timeout)
        return -9

    def kill(self):
        self.killed = True


def test_a_hung_warm_up_is_stopped_at_the_limit_and_the_pauses_end(monkeypatch):
    """A warm-up that never ends must not cost the training its share of every step for
    good, nor hang ``autopar.wait``: past WARMUP_LIMIT_S it is stopped, with a tier line."""
    monkeypatch.setattr(tiers, "WARMUP_LIMIT_S", 0.3)
    t = tiers.Tiers(background=True, candidates=())
    job = _Hung()
    cand = tiers.Candidate("native", warm=lambda: job, build=lambda: None, tag="g0.fw")
    t._queue.append(cand)
    t.poll()  # a step boundary starts it
    assert t.compile_pause(0.010) > 0  # compiling: the training yields its share
    t0 = time.monotonic()
    assert t.wait([], timeout=30)  # returns once the limit stopped it, not after 30 s
    assert time.monotonic() - t0 < 10
    assert job.killed and t.compile_pause(0.010) == 0.0
    assert cand.error.startswith("warm-up stopped after")
    assert any("native warm-up stopped" in e and "WARMUP_LIMIT_S" in e for e in t.events)


def test_a_pause_for_a_warm_up_is_not_timed_by_the_race(monkeypatch):
    """The time a step waited for the background compile is not part of its race sample."""
    cmodel = autopar.compile(torch.nn.Linear(4, 4), inductor=True, store=ProfileStore.memory())
    pipe = cmodel._autopar_pipeline
    steps = []
    monkeypatch.setattr(pipe.tiers, "compile_pause", lambda step_s: steps.append(step_s) or 0.05)
    choose = pipe.race.choose
    paused = []

    def spy(key, now, pause=0.0):
        paused.append(pause)
        return choose(key, now, pause)

    monkeypatch.setattr(pipe.race, "choose", spy)
    x = torch.randn(2, 4)
    for _ in range(3):
        cmodel(x).sum().backward()
    assert len(steps) == 2 and all(s < 0.05 for s in steps[1:])  # the step's own time
    assert paused[0] == 0.0 and all(p >= 0.05 for p in paused[1:])


class _TwoGraphs(torch.nn.Module):
    """Two Dynamo graphs per forward (a graph break between them)."""

    def __init__(self):
        super().__init__()
        self.a, self.b = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)

    def forward(self, x):
        x = self.a(x)
        torch._dynamo.graph_break()
        return self.b(x)


@pytest.mark.parametrize("model", [torch.nn.Linear(4, 4), _TwoGraphs()], ids=["one", "break"])
def test_backend_autopar_yields_once_a_step_to_a_running_warm_up(model, monkeypatch):
    """``torch.compile(backend="autopar")`` has no forward call of autopar's to mark a step:
    a step starts at the Dynamo graph called after one no earlier than itself, and the
    training yields the warm-up its share there once a step (graph breaks included)."""
    monkeypatch.setattr(tiers, "default_candidates", lambda: ())  # nothing compiles for real
    torch._dynamo.reset()
    cmodel = torch.compile(model, backend="autopar", dynamic=False,
                           options={"inductor": True, "store": ProfileStore.memory()})  # fmt: skip
    x = torch.randn(2, 4)
    cmodel(x).sum().backward()  # the first call creates the pipeline
    pipe = autopar.api._pipeline_of(cmodel, "test")
    steps = []
    monkeypatch.setattr(pipe.tiers, "compile_pause", lambda step_s: steps.append(step_s) or 0.0)
    for _ in range(4):
        cmodel(x).sum().backward()
    assert len(steps) == 4  # one pause a step (the first call was the step before them)
