"""runtime.native_direct: a training graph whose halves both run native programs runs them
through the C++ autograd function (interp.cpp's DirectFunction). Training through it
equals eager and the Python function within the fp64 oracle; autograd's rules hold (saved
tensors' versions, retain_graph, create_graph, non-differentiable outputs, saved-tensor
hooks); the monitor still sees every call; a swapped program ends the path."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from oracle import assert_close_to_oracle, check_training

import autopar
from autopar.codegen.emit import Boxed
from autopar.profiling.store import ProfileStore
from autopar.runtime import native
from autopar.tools import zoo


@pytest.fixture(scope="module", autouse=True)
def built():
    why = native.cannot_build()  # no C++ compiler: every test here skips, saying so
    if why is not None:
        pytest.skip(f"autopar's native interpreter cannot be built: {why}")
    native.load()  # the build, once: every test here runs the interpreter


def _compile(model, **kw):
    kw = {"store": ProfileStore.memory(), "native": True, "inductor": False, "race": False,
          "streams": 2, **kw}  # fmt: skip
    return autopar.compile(model, **kw)


def _direct(cmodel):
    (graph,) = cmodel._autopar_pipeline.capture.dynamo_graphs
    return graph.runner


def _warm(cmodel, inputs, steps=8):
    """Forward and ``autograd.grad`` (no ``.grad`` written, no parameter changed) until the
    native path is on: the backward compiles at the first backward, the builds finish after."""
    params = [p for p in cmodel.parameters() if p.requires_grad]
    for _ in range(steps):
        out = cmodel(*inputs)
        out = out[0] if isinstance(out, tuple) else out
        torch.autograd.grad(out.sum(), params, allow_unused=True)
        if getattr(_direct(cmodel), "native", None) is not None:
            return cmodel
    raise AssertionError(f"no native path: {dict(cmodel._autopar_pipeline.native_paths._why)}")


@pytest.mark.parametrize("name", ["mlp", "towers", "inception"])
def test_zoo_trains_like_eager_through_the_native_path(name):
    model, inputs = zoo.build(name)
    if name == "towers":
        inputs = (torch.randn(8, 64),)

    def compile_fn(m):
        cmodel = _compile(m)
        xs = [x.detach().clone().requires_grad_(x.is_floating_point()) for x in inputs]
        return _warm(cmodel, xs)

    cmodel = check_training(model, inputs, compile_fn)
    assert _direct(cmodel).native is not None  # the checked step ran the native path


def test_the_native_path_equals_the_python_function_within_the_fp64_oracle(monkeypatch):
    """Six SGD steps through the native path and through the Python function: parameters
    equal within the fp64 oracle (the same steps in float64), with the Python function's
    error as the bar. Not bitwise: the two paths are different code (C++ and Python) that
    may call other kernels or thread counts, and those round differently per CPU."""
    torch.manual_seed(0)
    model, (x,) = zoo.build("towers")
    y = torch.randn(x.shape[0], 1)
    ref = copy.deepcopy(model).double()
    models, steps = [], []
    for on in (True, False):
        m = copy.deepcopy(model)
        cm = _compile(m)
        cm._autopar_pipeline.native_paths.on = on
        models.append((m, cm))
        steps.append((cm, x, y, torch.optim.SGD(m.parameters(), lr=0.1)))
    steps.append((ref, x.double(), y.double(), torch.optim.SGD(ref.parameters(), lr=0.1)))
    for _ in range(6):
        for m, xs, ys, opt in steps:
            opt.zero_grad()
            F.mse_loss(m(xs), ys).backward()
            opt.step()
    (a, ca), (b, cb) = models
    assert _direct(ca).native is not None and _direct(cb).native is None
    for (n, p), q, r in zip(a.named_parameters(), b.parameters(), ref.parameters(), strict=True):
        assert_close_to_oracle(n, p, q, r)


def test_autograd_rules_hold_on_the_native_path():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    x = torch.randn(5, 8)
    cm = _warm(_compile(model), (x,))
    w = model[0].weight

    out = cm(x)  # retain_graph: the saved tensors stay for a second backward
    out.sum().backward(retain_graph=True)
    first = w.grad.clone()
    out.sum().backward()
    torch.testing.assert_close(w.grad, 2 * first)
    with pytest.raises(RuntimeError, match="backward through the graph a second time"):
        out.sum().backward()  # freed after a backward without retain_graph

    xr = x.clone()
    out = cm(xr)  # the input is saved for the backward: an in-place change is caught
    xr.add_(1)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        out.sum().backward()

    (g,) = torch.autograd.grad(cm(x).square().sum(), w, create_graph=True)
    assert g.requires_grad  # first order works under create_graph ...
    with pytest.raises(RuntimeError, match="does not currently support double backward"):
        g.sum().backward()  # ... as AOTAutograd's, differentiating again does not

    packed = []

    def pack(t):
        packed.append(t.shape)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        cm(x).sum().backward()
    assert packed  # the saved tensors went through the user's hooks
    assert _direct(cm).native is not None


class TwoOutputs(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 4)

    def forward(self, x):
        y = self.lin(x)
        return y, y.argmax(-1)  # the second needs no gradient


def test_an_output_that_needs_no_gradient_keeps_the_python_function():
    torch.manual_seed(0)
    model, x = TwoOutputs(), torch.randn(5, 8)
    eager = copy.deepcopy(model)
    cm = _compile(model)
    for _ in range(4):
        y, idx = cm(x)
        y.sum().backward()
    assert _direct(cm).native is None
    assert "needs no gradient" in cm._autopar_pipeline.native_paths._why[_direct(cm)]
    model.zero_grad()
    y, idx = cm(x)
    ye, idxe = eager(x)
    assert not idx.requires_grad and torch.equal(idx, idxe)
    y.square().sum().backward()
    ye.square().sum().backward()
    torch.testing.assert_close(model.lin.weight.grad, eager.lin.weight.grad)


def test_compiled_autograd_around_the_backward_runs_the_native_function():
    from torch._dynamo import compiled_autograd

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    eager, x = copy.deepcopy(model), torch.randn(5, 8)
    cm = _warm(_compile(model), (x,))
    model.zero_grad()
    out = cm(x)
    with compiled_autograd._enable(torch.compile(backend="eager")):
        out.square().sum().backward()
    eager(x).square().sum().backward()
    for p, q in zip(model.parameters(), eager.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad)


def test_the_monitor_sees_every_call_and_a_swapped_program_ends_the_path():
    torch.manual_seed(0)
    model, (x,) = zoo.build("towers")
    cm = _warm(_compile(model), (x,))
    pipe = cm._autopar_pipeline
    direct = _direct(cm)
    fw = next(r for r in pipe.capture.graphs() if r.tag == "g0.fw")
    autopar.stats(cm)  # hands the warm-up's last times to the monitor
    calls = fw.calls
    for _ in range(3):
        cm(x).sum().backward()
    rows = autopar.stats(cm, per="graph")  # the last step's times too
    assert fw.calls == calls + 3
    assert (rows["graph"] == "g0.bw").sum() >= 3
    old = direct.native

    fw.runner = Boxed(fw.unit.program)  # what a settled executor or a re-plan does
    out = cm(x)  # the next step boundary builds the path for the new runner
    assert direct.native is not old and direct.native.current()
    fw.runner = lambda a: fw.unit.program.fn(*a)  # a runner that is no native program
    ref = model(x)
    del old
    out.sum().backward()  # the earlier step's backward program is still alive
    out = cm(x)
    assert direct.native is None
    torch.testing.assert_close(out, ref)
    out.sum().backward()


def test_switched_off_by_the_environment(monkeypatch):
    monkeypatch.setenv("AUTOPAR_BYPASSES", "0")
    model, (x,) = zoo.build("mlp")
    cm = _compile(model)
    for _ in range(4):
        cm(x).sum().backward()
    assert getattr(_direct(cm), "native", None) is None  # AOTAutograd's runner, no path


def test_explain_says_the_native_path_runs():
    model, (x,) = zoo.build("mlp")
    cm = _warm(_compile(model), (x,))
    assert autopar.explain(cm).autograd == {"g0": "direct, native"}
    assert "(autograd direct, native)" in str(autopar.explain(cm))


def test_the_native_path_runs_plans_steps_while_the_judge_races():
    """The judge times what a ``plan`` verdict would run: while it races eager and planned
    steps, the planned ones already go through the native path."""
    model, (x,) = zoo.build("mlp")
    cm = _compile(model, race=True)
    pipe = cm._autopar_pipeline
    for _ in range(4):
        cm(x).sum().backward()
    assert pipe.runtime.judge.verdict(pipe.key) is None and _direct(cm).native is not None


def test_a_graph_settled_on_another_executor_never_runs_the_native_path():
    """The native path runs the records' planned programs: a graph whose verdict is
    ``inductor`` (whose program is a DirectGraph too) must run Inductor's program, not
    the planned ones (it did, silently, before: the bench timed plan's steps as autopar's)."""
    model, (x,) = zoo.build("mlp")
    cm = _compile(model, executors=("plan", "inductor"), race=True, inductor=None,
                  background=False)
    pipe = cm._autopar_pipeline
    for _ in range(3):
        cm(x).sum().backward()
    pipe.runtime.judge.settle(pipe.key, "inductor", "test")
    for _ in range(3):
        cm(x).sum().backward()
    (graph,) = pipe.capture.dynamo_graphs
    assert graph.runner is not graph.captured and graph.executor == "inductor"
    assert getattr(graph.runner, "native", None) is None
