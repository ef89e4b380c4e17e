"""autopar's own autograd.Function around a training graph (capture.direct_autograd): which
graphs use it, and that training through it equals eager (fp64 oracle) from the second
step on, where it runs (AOTAutograd compiles the backward lazily, at the first backward)."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from oracle import check_training

import autopar
from autopar.capture import direct_autograd
from autopar.profiling.store import ProfileStore
from autopar.tools import zoo


def _compile(**kw):
    return autopar.compile(kw.pop("model"), store=ProfileStore.memory(), race=False, **kw)


def _warmed(inputs, streams=None):
    """A compile_fn for check_training: compile, then one forward and backward through
    ``autograd.grad`` (no ``.grad`` written, no parameter changed), so that the checked step
    is the second call: the one the direct function runs."""

    def compile_fn(model):
        cmodel = _compile(model=model, streams=streams)
        xs = [x.detach().clone().requires_grad_(x.is_floating_point()) for x in inputs]
        outs = [o for o in _leaves(cmodel(*xs)) if o.requires_grad]
        params = [p for p in model.parameters() if p.requires_grad]
        torch.autograd.grad([o.sum() for o in outs], params, allow_unused=True)
        return cmodel

    return compile_fn


def _leaves(out):
    if isinstance(out, torch.Tensor):
        return [out]
    return [t for o in (out.values() if isinstance(out, dict) else out) for t in _leaves(o)]


def _autograd_of(cmodel) -> list[str]:
    return [g.autograd for g in cmodel._autopar_pipeline.capture.dynamo_graphs]


@pytest.mark.parametrize("name", ["mlp", "towers", "inception", "transformer", "lstm_cells",
                                  "dropout", "graph_break"])  # fmt: skip
def test_zoo_trains_like_eager_through_the_direct_function(name):
    model, inputs = zoo.build(name)
    torch.manual_seed(0)
    cmodel = check_training(model, inputs, _warmed(inputs, streams=2))
    kinds = _autograd_of(cmodel)
    assert kinds and all(k == "direct" for k in kinds), kinds
    assert "autograd direct" in autopar.explain(cmodel)


def test_a_graph_that_mutates_an_input_keeps_aotautograd():
    model, inputs = zoo.build("inplace_views")  # BatchNorm: running statistics written
    cmodel = check_training(model, inputs, _warmed(inputs))
    kinds = _autograd_of(cmodel)
    assert any(k == "AOTAutograd (the graph mutates an input)" for k in kinds), kinds
    assert "autograd through AOTAutograd (the graph mutates an input)" in autopar.explain(cmodel)


def test_switched_off_by_the_environment(monkeypatch):
    monkeypatch.setenv("AUTOPAR_BYPASSES", "0")
    model, inputs = zoo.build("mlp")
    cmodel = check_training(model, inputs, _warmed(inputs))
    assert _autograd_of(cmodel) == ["AOTAutograd (switched off ($AUTOPAR_BYPASSES=0))"]


class _TwoHeads(nn.Module):
    """Two outputs, one of which needs no gradient, and a transposed use of the other."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(8, 6), nn.Linear(8, 6)

    def forward(self, x):
        return self.a(x), (self.b(x) > 0).float()


def _twins(model_cls=_TwoHeads, seed=0):
    torch.manual_seed(seed)
    eager = model_cls()
    twin = model_cls()
    twin.load_state_dict(eager.state_dict())
    return eager, _compile(model=twin)


def test_no_grad_outputs_and_non_contiguous_gradients_match_eager():
    eager, cmodel = _twins()
    x = torch.randn(5, 8)
    w = torch.randn(6, 5)
    for _ in range(3):  # the first step runs through AOTAutograd, the others directly
        for m in (eager, cmodel):
            y, mask = m(x)
            assert not mask.requires_grad
            (y.t() * w).sum().backward()  # y's gradient arrives transposed (non-contiguous)
    assert _autograd_of(cmodel) == ["direct"]
    for p, q in zip(eager.parameters(), cmodel.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad)


def test_retain_graph_and_create_graph_work_and_double_backward_is_a_clear_error():
    eager, cmodel = _twins()
    x = torch.randn(5, 8)
    for m in (eager, cmodel, cmodel):
        m(x)[0].sum().backward()  # the compiled twin's second step runs directly
    assert _autograd_of(cmodel) == ["direct"]
    for m in (eager, cmodel):
        m.zero_grad()
        loss = m(x)[0].pow(2).sum()
        loss.backward(retain_graph=True)
        loss.backward()  # saved tensors kept by retain_graph: twice the gradient
    for p, q in zip(eager.parameters(), cmodel.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad)
    (g,) = torch.autograd.grad(cmodel(x)[0].pow(2).sum(), [cmodel.a.weight], create_graph=True)
    (ge,) = torch.autograd.grad(eager(x)[0].pow(2).sum(), [eager.a.weight])
    torch.testing.assert_close(g, ge)
    assert g.requires_grad
    with pytest.raises(RuntimeError, match="double backward"):
        g.sum().backward()


def test_an_in_place_change_before_backward_is_autograds_usual_error():
    eager, cmodel = _twins()
    x = torch.randn(5, 8, requires_grad=True)  # x's gradient needs the weight: it is saved
    cmodel(x)[0].sum().backward()
    assert _autograd_of(cmodel) == ["direct"]
    for m in (eager, cmodel):
        y = m(x)[0]
        with torch.no_grad():
            m.a.weight.add_(1.0)  # saved for the backward: modified in place
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            (y * y).sum().backward()


class _ConvNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)

    def forward(self, x):
        return torch.relu(self.conv(x))


def test_channels_last_gradients_are_coerced_to_the_traced_layout():
    eager, cmodel = _twins(_ConvNet)
    x = torch.randn(2, 3, 8, 8).to(memory_format=torch.channels_last)
    w = torch.randn(2, 4, 8, 8)  # contiguous: the output's gradient arrives contiguous
    for _ in range(3):
        for m in (eager, cmodel):
            (m(x) * w).sum().backward()
    assert _autograd_of(cmodel) == ["direct"]
    for p, q in zip(eager.parameters(), cmodel.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-5)


def test_with_compiled_autograd_on_the_call_goes_through_aotautograd(monkeypatch):
    eager, cmodel = _twins()
    x = torch.randn(5, 8)
    cmodel(x)[0].sum().backward()  # now direct
    runner = cmodel._autopar_pipeline.capture.dynamo_graphs[0].runner
    assert isinstance(runner, direct_autograd.DirectGraph)
    calls = []
    aot = runner.aot
    monkeypatch.setattr(runner, "aot", lambda *a: calls.append(1) or aot(*a))
    monkeypatch.setattr(direct_autograd, "_compiled_autograd", lambda: True)
    cmodel(x)[0].sum().backward()
    assert calls == [1]
    monkeypatch.undo()
    cmodel(x)[0].sum().backward()
    assert calls == [1]  # the direct function again
