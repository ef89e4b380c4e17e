"""The joint tier: a whole Dynamo graph compiled by Inductor's own pipeline (``compile_fx``,
as ``torch.compile`` does), swapped in for both halves at once, only after a measured
forward and backward (``autopar.runtime.joint_tier``).

Landing is forced here (``JOINT_MARGIN`` raised) where the test is about correctness, not
about which executor is faster on this machine. The compiles are Inductor's: seconds each,
so the models are small and few.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
from nets import BranchyNet, compile_and_land, dynamo_graph, race_side_by_side, train_side_by_side
from oracle import assert_close_to_oracle, check_training

import autopar
import autopar.runtime.tiers as tiers
from autopar.codegen.joint import dynamo_meta, restore_dynamo_meta, roles, with_roles
from autopar.profiling.store import ProfileStore
from autopar.runtime.joint_tier import time_forward_backward, trains, unmeasurable
from autopar.tools import zoo


@pytest.fixture
def joint_only(monkeypatch):
    monkeypatch.setenv("AUTOPAR_TIERS", "joint")


@pytest.fixture
def always_land(monkeypatch, joint_only):
    monkeypatch.setattr(tiers, "JOINT_MARGIN", float("inf"))


def _grad_inputs(inputs):
    """Inputs as the oracle passes them: floating ones require grad (one Dynamo graph)."""
    return [x.detach().clone().requires_grad_(x.is_floating_point()) for x in inputs]


@pytest.mark.parametrize("name", ["dropout", "inplace_views", "lstm_cells"])
def test_zoo_trains_like_eager_on_the_joint_executor(name, always_land):
    """Dropout (the RNG), BatchNorm statistics and in-place views, autopar's fused LSTM
    cells (custom ops): with the joint executor running both halves, one training step
    equals eager by the fp64 oracle."""
    model, inputs = zoo.build(name)
    compiled = {}
    compile_fn = compile_and_land(lambda: _grad_inputs(inputs), compiled)
    check_training(model, inputs, compile_fn, opt_name="sgd")
    executors = {u.tag: u.executor for u in autopar.graphs(compiled["m"])}
    assert set(executors.values()) == {"joint"}, executors


def test_background_joint_tier_lands_mid_training_from_a_warm_cache(always_land):
    """Training starts on autopar's per-graph programs; the joint compile runs in a warm-up
    process and the training process then hits Inductor's cache; the swap happens at a step
    boundary, after a forward and backward measured with dropout and BatchNorm undone: the
    run equals eager's under the same seeds, step by step, buffers included."""
    from torch._dynamo.utils import counters

    torch.manual_seed(0)
    model = BranchyNet()
    eager = copy.deepcopy(model)
    cmodel = autopar.compile(model, inductor=True, background=True, race=False,
                             store=ProfileStore.memory())  # fmt: skip
    hits = []

    def between(step: int) -> None:
        if step == 1:
            before = counters["inductor"]["fxgraph_cache_hit"]
            assert autopar.wait(cmodel, timeout=300)  # warm-up done, compiled here
            hits.append(counters["inductor"]["fxgraph_cache_hit"] - before)

    seen = train_side_by_side(cmodel, eager, torch.randn(8, 16), 5, between)
    assert seen[0] == {"plan"}  # training started at once on the planned programs
    assert seen[-1] == {"joint"}  # ... and the joint executor landed mid-training
    assert hits == [2], hits  # forward and backward came from the warm-up's cache
    for p, q in zip(model.parameters(), eager.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
    for b, c in zip(model.buffers(), eager.buffers(), strict=True):
        torch.testing.assert_close(b, c, rtol=1e-5, atol=1e-6)
    assert "joint landed" in autopar.explain(cmodel)
    assert "forward+backward" in autopar.explain(cmodel).graphs[0].provenance[-1].note


def test_a_tensor_hook_keeps_the_current_executor_and_says_why(always_land):
    """``autograd.grad`` would run a parameter's tensor hook once per timed run: the joint
    candidate is not measured, the per-graph executors stay, and the tier line says why;
    the hook ran exactly once per step."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))
    calls = []
    model[0].weight.register_hook(lambda g: calls.append(1))
    cmodel = autopar.compile(model, inductor=True, background=False, race=False,
                             store=ProfileStore.memory())  # fmt: skip
    for _ in range(3):
        cmodel(torch.randn(4, 8)).sum().backward()
    assert len(calls) == 3
    assert {u.executor for u in autopar.graphs(cmodel)} == {"plan"}
    assert "not measured (an input that requires grad has a tensor hook" in autopar.explain(
        cmodel
    )


def test_measuring_a_forward_and_backward_leaves_no_trace():
    """The timed runs restore buffers and the generator, and accumulate no ``.grad``."""
    torch.manual_seed(0)
    lin, bn = nn.Linear(4, 4), nn.BatchNorm1d(4)

    def fn(w, b, mean, var, x):
        h = torch.nn.functional.linear(x, w, b)
        h = torch.nn.functional.batch_norm(h, mean, var, training=True)
        return torch.nn.functional.dropout(h, 0.5)

    args = [lin.weight, lin.bias, bn.running_mean, bn.running_var, torch.randn(8, 4)]
    before = [a.detach().clone() for a in args]
    rng = torch.get_rng_state()
    best = time_forward_backward({"a": fn, "b": fn}, args, rounds=2)
    assert set(best) == {"a", "b"} and all(t > 0 for t in best.values())
    assert all(torch.equal(a, b) for a, b in zip(args, before, strict=True))
    assert torch.equal(torch.get_rng_state(), rng)
    assert lin.weight.grad is None and lin.bias.grad is None


def test_what_the_joint_tier_applies_to():
    class R:
        def __init__(self, tag):
            self.tag = tag

    assert trains([R("g0.fw")]) and not trains([R("g0.inf")])
    w = nn.Parameter(torch.ones(2))
    assert unmeasurable([w]) is None
    with torch.no_grad():
        assert "grad disabled" in unmeasurable([w])
    assert "no input requires grad" in unmeasurable([torch.ones(2)])
    w.register_hook(lambda g: g)
    assert "tensor hook" in unmeasurable([w])


def test_the_warm_up_job_keeps_what_aot_autograd_reads():
    """Pickling a Dynamo graph drops its sources and static-input marks, and stand-ins lose
    ``requires_grad``: both are recorded and put back, or the warm-up would partition (and
    cache) another joint graph than the training process compiles."""
    gm, args = dynamo_graph(nn.Linear(3, 2), torch.randn(4, 3))
    kinds = roles(args)
    assert sorted(k for k in kinds if k) == ["param", "param"]
    back = with_roles([torch.zeros(a.shape) for a in args], kinds)
    assert [isinstance(a, nn.Parameter) for a in back] == [isinstance(a, nn.Parameter)
                                                           for a in args]  # fmt: skip
    meta = dynamo_meta(gm)
    copy_gm = torch.fx.GraphModule(gm, copy.deepcopy(gm.graph))
    restore_dynamo_meta(copy_gm, meta)
    marks = {n.name: n.meta.get("tensor_dict") for n in copy_gm.graph.find_nodes(op="placeholder")}
    assert marks == {n.name: n.meta.get("tensor_dict")
                     for n in gm.graph.find_nodes(op="placeholder")}  # fmt: skip
    assert copy_gm.meta["dynamo_compile_id"] == gm.meta["dynamo_compile_id"]


def test_the_step_race_judges_the_joint_candidate_and_training_stays_eager_equal(joint_only):
    """With the race on, the compiled joint candidate races whole steps against the
    per-graph executors and eager (E E C C J J ...): every kind of step trains exactly as
    eager does under the same seeds (dropout, BatchNorm), and once the race decides, both
    halves say what whole steps measured."""
    torch.manual_seed(0)
    model = BranchyNet()
    # margin 10: eager never wins here, the race is between the compiled two
    cmodel, eager, pipe, ran = race_side_by_side(model, torch.randn(8, 16), 100, 10.0)
    assert [v for v, _ in pipe.race.report().values()] != [None] and not pipe._racing
    assert "joint" in ran  # joint steps ran and trained like eager
    for b, c in zip(model.buffers(), eager.buffers(), strict=True):
        torch.testing.assert_close(b, c, rtol=1e-5, atol=1e-6)
    stages = ("tier", "whole-graph")
    notes = [p.note for u in autopar.graphs(cmodel) for p in u.provenance
             if p.stage in stages and p.note.startswith("whole steps")]  # fmt: skip
    assert len(notes) == 2 and "vs joint" in notes[0], notes


def test_a_failed_warm_up_reports_its_last_line():
    """Warm-ups write stderr to a file, not a pipe that nobody reads while they run (a full
    pipe would block the child forever); a failure's last line is what the log shows."""
    from autopar.codegen.warmup import spawn_warmup, warmup_error

    proc = spawn_warmup("autopar.codegen.joint", "/nonexistent/autopar-job.pt")
    proc.wait(timeout=120)
    assert proc.returncode != 0
    assert "FileNotFoundError" in warmup_error(proc)


def test_backend_autopar_races_the_joint_tier_over_whole_steps(joint_only):
    """``torch.compile(backend="autopar")`` marks its steps at the Dynamo graph calls, and the
    joint candidate races whole steps there as under ``autopar.compile`` (E E C C J J ...):
    joint steps run, the race decides, and training stays eager's under the same seeds."""
    torch.manual_seed(0)
    model = BranchyNet()
    eager = copy.deepcopy(model)
    cmodel = torch.compile(model, backend="autopar", dynamic=False,
                           options={"inductor": True, "background": False,
                                    "store": ProfileStore.memory()})  # fmt: skip
    ran = set()

    def between(step: int) -> None:
        pipe = autopar.api._pipeline_of(cmodel, "test")
        pipe.race.margin = 10.0  # eager never wins: the race is between the compiled two
        ran.add(pipe.variant)

    train_side_by_side(cmodel, eager, torch.randn(8, 16), 100, between)
    pipe = autopar.api._pipeline_of(cmodel, "test")
    (key, (verdict, why)), = pipe.race.report().items()
    assert key == ("backend", 0) and verdict is not None and "vs joint" in why, why
    assert "joint" in ran and not pipe._racing
    for b, c in zip(model.buffers(), eager.buffers(), strict=True):
        torch.testing.assert_close(b, c, rtol=1e-5, atol=1e-6)


def test_the_joint_halves_run_through_direct_autograd_where_nothing_needs_aot(monkeypatch):
    from autopar.codegen.joint import compile_joint

    torch.manual_seed(0)
    gm, args = dynamo_graph(nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)),
                             torch.randn(5, 8))  # fmt: skip
    direct = compile_joint(gm, args, tag="g0")
    monkeypatch.setenv("AUTOPAR_DIRECT_AUTOGRAD", "0")
    aot = compile_joint(gm, args, tag="g0")
    assert direct.autograd == "direct" and aot.autograd.startswith("AOTAutograd (switched off")
    assert "autograd direct" in direct.program("forward").source
    params = [a for a in args if isinstance(a, torch.Tensor) and a.requires_grad]

    def run(fn, xs, ps):
        (out,) = fn(*xs)
        return [out, *torch.autograd.grad(out.square().sum(), ps)]

    # Both programs equal the graph run eagerly within the fp64 oracle (the graph in float64
    # on the same inputs), not bitwise: each autograd path gets its own Inductor kernels.
    eager = run(gm, args, params)
    args64 = [a.detach().double().requires_grad_(a.requires_grad)
              if isinstance(a, torch.Tensor) and a.is_floating_point() else a
              for a in args]  # fmt: skip
    ref = run(gm, args64, [a for a in args64 if isinstance(a, torch.Tensor) and a.requires_grad])
    for name, prog in (("direct", direct), ("aot", aot)):
        got = run(prog.fn, args, params)
        for i, (g, e, r) in enumerate(zip(got, eager, ref, strict=True)):
            assert_close_to_oracle(f"{name} " + ("output" if i == 0 else f"grad {i}"), g, e, r)


def test_a_joint_graph_that_mutates_a_buffer_keeps_aot_autograd():
    from autopar.codegen.joint import compile_joint

    gm, args = dynamo_graph(nn.BatchNorm1d(4), torch.randn(6, 4))
    assert compile_joint(gm, args, tag="g0").autograd == "AOTAutograd (the graph mutates an input)"


def test_a_model_trained_under_autocast_keeps_its_casts_on_the_joint_executor(always_land):
    """The joint tier compiles at a later call of the Dynamo graph than its trace; Dynamo
    guards on the autocast state, so that call runs under the trace's state and the casts
    are compiled in. Trained under CPU autocast beside eager, the joint executor's outputs
    stay bfloat16 and its gradients follow eager's; it runs through AOTAutograd's wrapper,
    which turns autocast off around the compiled halves."""
    torch.manual_seed(0)
    model, x = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4)), torch.randn(8, 16)
    eager = copy.deepcopy(model)
    cm = autopar.compile(model, inductor=True, background=False, race=False,
                         store=ProfileStore.memory())  # fmt: skip
    for step in range(4):  # the first compiles, the second measures and lands joint
        for m in (eager, cm):
            m.zero_grad()
            with torch.autocast("cpu", dtype=torch.bfloat16):
                y = m(x)
                assert y.dtype == torch.bfloat16, (step, m is cm)
            y.float().square().mean().backward()
        for pe, pc in zip(eager.parameters(), cm.parameters(), strict=True):
            torch.testing.assert_close(pc.grad, pe.grad, rtol=1.6e-2, atol=1e-2)
    assert {u.executor for u in autopar.graphs(cm)} == {"joint"}
    assert "AOTAutograd (traced under autocast)" in str(autopar.explain(cm))
