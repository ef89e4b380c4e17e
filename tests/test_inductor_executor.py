"""The ``inductor`` executor: a whole Dynamo graph compiled by Inductor's own pipeline
(``compile_fx``, as ``torch.compile`` does), running both halves at once
(``autopar.runtime.executors.inductor``), built in the background and raced by the judge.

Where a test is about correctness, not about which executor is faster on this machine, the
ladder holds ``inductor`` alone (``executors=("inductor",)``): it runs from the step after
its build. The compiles are Inductor's: seconds each, so the models are small and few.
"""

from __future__ import annotations

import copy
import time

import pytest
import torch
import torch.nn as nn
from nets import BranchyNet, compile_and_land, dynamo_graph, race_side_by_side, train_side_by_side
from oracle import assert_close_to_oracle, check_training

import autopar
from autopar.codegen.joint import dynamo_meta, restore_dynamo_meta, roles, with_roles
from autopar.profiling.store import ProfileStore
from autopar.runtime import builds
from autopar.runtime.executors.inductor import trains
from autopar.tools import zoo


def _grad_inputs(inputs):
    """Inputs as the oracle passes them: floating ones require grad (one Dynamo graph)."""
    return [x.detach().clone().requires_grad_(x.is_floating_point()) for x in inputs]


@pytest.mark.parametrize("name", ["dropout", "inplace_views", "lstm_cells"])
def test_zoo_trains_like_eager_on_the_inductor_executor(name):
    """Dropout (the RNG), BatchNorm statistics and in-place views, autopar's fused LSTM
    cells (custom ops): with the inductor executor running both halves, one training step
    equals eager by the fp64 oracle."""
    model, inputs = zoo.build(name)
    compiled = {}
    compile_fn = compile_and_land(lambda: _grad_inputs(inputs), compiled)
    check_training(model, inputs, compile_fn, opt_name="sgd")
    executors = {u.tag: u.executor for u in autopar.graphs(compiled["m"])}
    assert set(executors.values()) == {"inductor"}, executors


def test_a_background_build_runs_mid_training_from_a_warm_cache():
    """Training starts at once; the compile runs in the warm-up worker and the training
    process then hits Inductor's cache at a step boundary; from then on the inductor
    program runs the steps: the run equals eager's under the same seeds, step by step,
    buffers included."""
    from torch._dynamo.utils import counters

    torch.manual_seed(0)
    model = BranchyNet()
    eager = copy.deepcopy(model)
    cmodel = autopar.compile(model, executors=("inductor",), store=ProfileStore.memory())
    hits = []

    def between(step: int) -> None:
        if step == 1:
            assert autopar.wait(cmodel, timeout=300)  # warm-up done: compiled here next
            hits.append(counters["inductor"]["fxgraph_cache_hit"])
        elif step == 2:
            hits[0] = counters["inductor"]["fxgraph_cache_hit"] - hits[0]

    seen = train_side_by_side(cmodel, eager, torch.randn(8, 16), 5, between)
    assert seen[0] == {"captured"}  # training started at once, on the captured graphs
    assert seen[-1] == {"inductor"}  # ... and the inductor program ran mid-training
    assert hits == [2], hits  # forward and backward came from the warm-up's cache
    for p, q in zip(model.parameters(), eager.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
    for b, c in zip(model.buffers(), eager.buffers(), strict=True):
        torch.testing.assert_close(b, c, rtol=1e-5, atol=1e-6)
    ex = autopar.explain(cmodel)
    assert ex.rungs["g0"]["inductor"].startswith("built") and ex.steps


def test_a_tensor_hook_runs_once_a_step_whatever_runs_the_step():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))
    calls = []
    model[0].weight.register_hook(lambda g: calls.append(1))
    cmodel = autopar.compile(model, executors=("eager", "plan", "inductor"),
                             background=False, store=ProfileStore.memory())  # fmt: skip
    for _ in range(20):
        cmodel(torch.randn(4, 8)).sum().backward()
    assert len(calls) == 20


def test_a_hung_warm_up_is_stopped_at_the_limit(monkeypatch):
    """A warm-up that never ends must not hold a core for good, nor hang ``autopar.wait``:
    past WARMUP_LIMIT_S it is stopped and its build given up, with the reason."""
    import subprocess

    class Hung:
        killed = False

        def poll(self):
            return -9 if self.killed else None

        def wait(self, timeout=None):
            if not self.killed:
                time.sleep(min(timeout or 0.05, 0.05))
                raise subprocess.TimeoutExpired("hung", timeout)
            return -9

        def kill(self):
            self.killed = True

    class G:
        tag = "g0"

    monkeypatch.setattr(builds, "WARMUP_LIMIT_S", 0.3)
    b = builds.Builds(background=True)
    job = Hung()
    b.add(builds.Build(G(), "inductor", "k", lambda: job, lambda: None))
    assert b.compiling()
    t0 = time.monotonic()
    assert b.wait(timeout=30)  # returns once the limit stopped it, not after 30 s
    assert time.monotonic() - t0 < 10 and job.killed and not b.compiling()
    (done,) = b.poll()
    assert done.error.startswith("its background compile was stopped after")


def test_what_the_inductor_executor_applies_to():
    class R:
        def __init__(self, tag):
            self.tag = tag

    assert trains([R("g0.fw")]) and not trains([R("g0.inf")])


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


def test_the_warm_up_job_carries_the_graph_itself():
    """A pickled GraphModule is traced again from its code when it is unpickled, which turns
    what the graph computes from no input (``torch.arange``: GPT-2's positions) into a
    constant: another graph, another cache key, a warm-up that never serves. The job carries
    the nodes instead, subgraphs (a checkpointed body) alike, ``F.max_pool2d`` (a local
    function pickle cannot name) by name, and a ``memory_format`` argument (which
    ``torch.save``'s default protocol cannot pickle)."""
    import io

    import torch.nn.functional as F
    from torch.utils.checkpoint import checkpoint

    from autopar.codegen.joint import PROTOCOL, portable, rebuild

    class Positions(nn.Module):
        def body(self, x):
            return x * torch.arange(x.shape[-1])

        def forward(self, x):
            x = checkpoint(self.body, x.contiguous(memory_format=torch.channels_last),
                           use_reentrant=False)  # fmt: skip
            return F.max_pool2d(x + torch.arange(x.shape[-1]), 2)

    x = torch.randn(1, 2, 4, 4, requires_grad=True)
    gm, _ = dynamo_graph(Positions(), x)
    buf = io.BytesIO()
    torch.save(portable(gm), buf, pickle_protocol=PROTOCOL)
    buf.seek(0)
    back = rebuild(torch.load(buf, weights_only=False))
    codes = {n: m.code for n, m in gm.named_modules() if isinstance(m, torch.fx.GraphModule)}
    assert len(codes) == 2 and all("arange" in c for c in codes.values())
    assert {n: m.code for n, m in back.named_modules()
            if isinstance(m, torch.fx.GraphModule)} == codes  # fmt: skip
    torch.testing.assert_close(back(x)[0], gm(x)[0])


def test_a_rebuilt_graph_keeps_its_attributes_kinds():
    """A GraphModule registers every tensor it is given as a buffer; one that the graph held
    as a plain attribute stays one (AOTAutograd asserts that each buffer has a source)."""
    from autopar.codegen.joint import portable, rebuild

    gm = torch.fx.symbolic_trace(lambda x: x + torch.ones(2))  # a _tensor_constant buffer
    (name,) = [n.target for n in gm.graph.nodes if n.op == "get_attr"]
    value = getattr(gm, name)
    delattr(gm, name)
    setattr(gm, name, value)  # now a plain attribute
    back = rebuild(portable(gm))
    assert name not in dict(back.named_buffers()) and torch.equal(getattr(back, name), value)
    torch.testing.assert_close(back(torch.ones(2)), torch.full((2,), 2.0))


def test_the_judge_races_the_inductor_executor_and_training_stays_eager_equal():
    """The built inductor program races whole steps against the planned programs and
    eager (E E P P I I ...): every kind of step trains exactly as eager does under the same
    seeds (dropout, BatchNorm), and the judge decides. How soon it decides depends on the
    box's noise (a busy CI box can keep three contenders racing to MAX_ROUNDS), so the run
    is long enough for MAX_ROUNDS rounds of every contender plus the build steps."""
    from autopar.runtime.judge import MAX_ROUNDS, RUN

    torch.manual_seed(0)
    model = BranchyNet()
    verdicts = []
    steps = 3 * RUN * MAX_ROUNDS + 20
    cmodel, eager, pipe, ran = race_side_by_side(model, torch.randn(8, 16), steps,
                                                 verdicts=verdicts)  # fmt: skip
    assert {"eager", "plan", "inductor"} <= ran
    assert verdicts, autopar.explain(cmodel)
    for b, c in zip(model.buffers(), eager.buffers(), strict=True):
        torch.testing.assert_close(b, c, rtol=1e-5, atol=1e-6)


def test_a_failed_warm_up_reports_its_last_line():
    """Warm-ups write stderr to a file, not a pipe that nobody reads while they run (a full
    pipe would block the child forever); a failure's last line is what the log shows."""
    from autopar.codegen.warmup import spawn_warmup, warmup_error

    proc = spawn_warmup("autopar.codegen.joint", "/nonexistent/autopar-job.pt")
    proc.wait(timeout=120)
    assert proc.returncode != 0
    assert "FileNotFoundError" in warmup_error(proc)


def test_backend_autopar_races_the_inductor_executor_over_whole_steps():
    """``torch.compile(backend="autopar")`` marks its steps at the Dynamo graph calls, and
    the inductor program races whole steps there as under ``autopar.compile``: its steps
    run, the judge decides, and training stays eager's under the same seeds."""
    torch.manual_seed(0)
    model = BranchyNet()
    eager = copy.deepcopy(model)
    cmodel = torch.compile(model, backend="autopar", dynamic=False,
                           options={"executors": ("plan", "inductor"), "background": False,
                                    "store": ProfileStore.memory()})  # fmt: skip
    ran = set()

    def between(step: int) -> None:
        ran.add(autopar.api._pipeline_of(cmodel, "test").variant)

    train_side_by_side(cmodel, eager, torch.randn(8, 16), 80, between)
    pipe = autopar.api._pipeline_of(cmodel, "test")
    (key, (verdict, why)), = pipe.runtime.judge.report().items()
    assert key == ("backend", 0) and verdict is not None, why
    assert "inductor" in ran
    for b, c in zip(model.buffers(), eager.buffers(), strict=True):
        torch.testing.assert_close(b, c, rtol=1e-5, atol=1e-6)


def test_the_joint_halves_run_through_direct_autograd_where_nothing_needs_aot(monkeypatch):
    from autopar.codegen.joint import compile_joint

    torch.manual_seed(0)
    gm, args = dynamo_graph(nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)),
                             torch.randn(5, 8))  # fmt: skip
    direct = compile_joint(gm, args, tag="g0")
    monkeypatch.setenv("AUTOPAR_BYPASSES", "0")
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


def test_a_model_trained_under_autocast_keeps_its_casts_on_the_inductor_executor():
    """The inductor program is compiled at a later call of the Dynamo graph than its trace;
    Dynamo guards on the autocast state, so that call runs under the trace's state and the
    casts are compiled in. Trained under CPU autocast beside eager, its outputs stay
    bfloat16 and its gradients follow eager's; it runs through AOTAutograd's wrapper, which
    turns autocast off around the compiled halves."""
    torch.manual_seed(0)
    model, x = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4)), torch.randn(8, 16)
    eager = copy.deepcopy(model)
    cm = autopar.compile(model, executors=("inductor",), background=False,
                         store=ProfileStore.memory())  # fmt: skip
    for step in range(4):  # the first captures, the second builds and runs inductor
        for m in (eager, cm):
            m.zero_grad()
            with torch.autocast("cpu", dtype=torch.bfloat16):
                y = m(x)
                assert y.dtype == torch.bfloat16, (step, m is cm)
            y.float().square().mean().backward()
        for pe, pc in zip(eager.parameters(), cm.parameters(), strict=True):
            torch.testing.assert_close(pc.grad, pe.grad, rtol=1.6e-2, atol=1e-2)
    assert {u.executor for u in autopar.graphs(cm)} == {"inductor"}
    assert "AOTAutograd (traced under autocast)" in autopar.explain(cm)
