"""The runtime's decisions (``runtime.decide``, ``runtime.builds``, ``runtime.decisions``)
driven with a synthetic clock and fake builds: no compile, no timing."""

from __future__ import annotations

import pytest
import torch
import torch.fx as fx

from autopar.runtime import builds as builds_mod
from autopar.runtime.decide import Runtime
from autopar.runtime.decisions import Decisions, graph_key
from autopar.runtime.executors import TABLE, Executor


class _Job:  # a warm-up that has finished
    returncode, error = 0, ""

    def poll(self):
        return 0

    def wait(self, timeout=None):
        return 0


class _Graph:
    def __init__(self):
        self.gm = fx.symbolic_trace(lambda x: x.relu() + 1)
        self.group, self.tag = 0, "g0"
        self.captured = object()


def _fake_inductor(why=None, compiled=None):
    def parts(graph, args, profile):
        def build():
            if compiled is not None:
                compiled.append(torch.is_grad_enabled())
            return type("Program", (), {"fn": object()})()

        return (lambda: _Job()), build

    return Executor("inductor", "fake", lambda *a: why, parts)


def _steps(rt, key, times: dict, n: int, clock: list):
    """``n`` steps of ``key``, each as long as ``times[who]``."""
    for _ in range(n):
        who = rt.step(key, clock[0])
        clock[0] += times.get(who, 1.0)


def test_a_build_compiles_only_at_a_step_of_its_own_signature():
    """A warm-up finished during a ``no_grad`` evaluation step waits for a training step:
    Inductor compiles under the step's grad mode."""
    grad_modes: list = []
    b = builds_mod.Builds(background=True)
    _, build = _fake_inductor(compiled=grad_modes).parts(None, [], None)
    b.add(builds_mod.Build(_Graph(), "inductor", "train", lambda: _Job(), build))
    with torch.no_grad():
        assert b.poll("eval") == [] and b.pending("train") == 1
    (done,) = b.poll("train")
    assert done.program is not None and grad_modes == [True]


def test_a_final_verdict_equal_to_the_first_is_remembered(monkeypatch):
    monkeypatch.setitem(TABLE, "inductor", _fake_inductor())
    rt = Runtime(("eager", "plan", "inductor"), True, Decisions(None))
    g, x, clock = _Graph(), torch.randn(4), [0.0]
    rt.step("k", 0.0)
    rt.graph_seen(g, [x], "k")
    _steps(rt, "k", {"eager": 2.0, "plan": 1.0, "inductor": 1.6}, 200, clock)
    assert rt.judge.verdict("k") == "plan" and rt.settled("k")
    assert rt.decisions.get(rt.graph_state(g).decision_key)["winner"] == "plan"


def test_signatures_that_take_turns_decide_and_a_capture_does_not_count():
    """Steps of two signatures that alternate (a loss under ``no_grad`` beside a training
    forward) hold each other's steps alike for every contender: both still decide. A new
    signature's first step (its capture) inside another's open step voids that sample."""
    rt = Runtime(("eager", "plan"), True, Decisions(None))
    g, x, clock = _Graph(), torch.randn(4), [0.0]
    rt.step("a", 0.0)
    rt.graph_seen(g, [x], "a")
    _steps(rt, "a", {"eager": 2.0, "plan": 1.0}, 3, clock)
    rt.step("c", clock[0])  # c's first step: a capture
    assert rt.judge._races["a"].dirty
    for _ in range(100):
        _steps(rt, "a", {"eager": 2.0, "plan": 1.0}, 1, clock)
        _steps(rt, "b", {}, 1, clock)
    assert rt.judge.verdict("a") == "plan"


@pytest.mark.parametrize("how", ["not offered", "failed"])
def test_a_remembered_winner_that_cannot_run_here_races_the_ladder(monkeypatch, how):
    ex = _fake_inductor(why="not today" if how == "not offered" else None)
    builds = []
    if how == "failed":
        ex = Executor("inductor", "fake", lambda *a: None,
                      lambda *a: (None, lambda: builds.append(1) / 0))  # fmt: skip
    monkeypatch.setitem(TABLE, "inductor", ex)
    ladder = ("eager", "plan", "inductor")
    g, x = _Graph(), torch.randn(4)
    decisions = Decisions(None)
    decisions.put(graph_key(g.gm, [x], ladder, "k"), "inductor", {"inductor": 1.0})
    rt = Runtime(ladder, True, decisions)
    rt.step("k", 0.0)
    rt.graph_seen(g, [x], "k")
    assert rt.graph_state(g).remembered == "inductor"
    _steps(rt, "k", {"eager": 2.0, "plan": 1.0}, 100, [1.0])
    assert any("cannot run here now" in e for e in rt.events)
    assert rt.judge.verdict("k") == "plan"
    assert len(builds) == (1 if how == "failed" else 0)  # not compiled again


def test_graph_key_tells_a_training_step_from_an_evaluation_one():
    g, x = _Graph(), torch.randn(4)
    train = (True, True, False, 2, ((4,), "float32", "cpu"))
    evaluation = (False, False, False, 2, ((4,), "float32", "cpu"))
    assert graph_key(g.gm, [x], ("plan",), train) != graph_key(g.gm, [x], ("plan",), evaluation)


def test_another_process_s_verdict_survives_this_one_s_build_note(tmp_path):
    store = str(tmp_path / "s.json")
    mine, theirs = Decisions(store), Decisions(store)
    theirs.put("k", "inductor", {"inductor": 1.0})
    mine.put("k", built=("split",))
    rec = Decisions(store).get("k")
    assert rec["winner"] == "inductor" and rec["built"] == ["split"]
