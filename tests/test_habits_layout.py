"""Layouts the fake kernels mispredict train as in eager (issue 14), and a fallback warning
never promises correct results that then fail.

BatchNorm on a transposed input and dropout's backward on a transposed gradient return a
different layout on CPU than their fake kernels predict; AOTAutograd's ``view`` on that
prediction failed. ``autopar.capture.layout.robust_views`` makes those views reshapes.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.nn as nn
from oracle import check_training
from torch.fx.experimental.proxy_tensor import make_fx

import autopar
import autopar.capture.backend as backend
from autopar.capture.backend import Capture, _WarnOnceItRan
from autopar.capture.layout import merges_dims, robust_views
from autopar.errors import FallbackWarning, node_source
from autopar.profiling.store import ProfileStore

aten = torch.ops.aten


class BNT(nn.Module):
    """BatchNorm1d over the channels of a (batch, time, channels) projection."""

    def __init__(self):
        super().__init__()
        self.l = nn.Linear(8, 8)
        self.bn = nn.BatchNorm1d(8)

    def forward(self, x):
        return self.bn(self.l(x).transpose(1, 2))


class DG(nn.Module):
    """Linear -> Dropout -> time-major GRU/LSTM (its output sequence)."""

    def __init__(self, kind):
        super().__init__()
        self.l = nn.Linear(8, 8)
        self.d = nn.Dropout(0.1)
        self.r = kind(8, 8)

    def forward(self, x):
        return self.r(self.d(self.l(x)).transpose(0, 1))[0]


def _compile(**kw):
    return lambda m: autopar.compile(m, store=ProfileStore.memory(), race=False, **kw)


def _trains_like_eager(model, compile_fn):
    """The fp64 oracle on the first step (outputs, every gradient, an SGD step), then a
    second step (the planned program, not the profiler) against an eager copy; no fallback."""
    torch.manual_seed(0)
    x = torch.randn(4, 5, 8)
    with warnings.catch_warnings():
        warnings.simplefilter("error", FallbackWarning)  # compiled, not an eager fallback
        comp = check_training(model, (x,), compile_fn)
        eager = copy.deepcopy(comp._orig_mod)
        outs = []
        for m in (eager, comp):
            m.zero_grad()
            torch.manual_seed(1)
            y = m(x)
            y.sum().backward()
            outs.append((y.detach(), [p.grad.clone() for p in m.parameters()]))
    torch.testing.assert_close(outs[1], outs[0])
    assert all(u.fallback is None for u in autopar.graphs(comp))
    return comp


@pytest.mark.parametrize("mode", ["train", "eval"])
def test_batchnorm_on_a_transposed_input_trains_like_eager(mode):
    torch.manual_seed(0)
    model = BNT().train(mode == "train")
    comp = _trains_like_eager(model, _compile())
    bw = next(u for u in autopar.graphs(comp) if u.phase == "backward")
    assert aten.reshape.default in {n.target for n in bw.gm.graph.nodes}


FORMS = ["unrolled", "fused", "chunked:2", "eager"]  # the rewrite's forms, and rnn="eager"


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("kind", [nn.GRU, nn.LSTM], ids=["GRU", "LSTM"])
def test_dropout_transpose_rnn_trains_like_eager(kind, form, monkeypatch):
    if form == "eager":
        compile_fn = _compile(rnn="eager")
    else:
        monkeypatch.setenv("AUTOPAR_RNN_FORM", form)  # read by rewrite_rnns at each call
        compile_fn = _compile()
    torch.manual_seed(0)
    comp = _trains_like_eager(DG(kind), compile_fn)
    if form != "eager":  # the form asked for is the one that ran: its custom ops
        fw = next(u for u in autopar.graphs(comp) if u.tag == "g0.fw")
        ops = [str(n.target) for n in fw.gm.graph.nodes]
        layer_ops = [t for t in ops if t.startswith("autopar.") and "_layer." in t]
        if form == "unrolled":
            assert any(t.startswith("autopar.") and "_cell." in t for t in ops)
        else:
            assert len(layer_ops) == (1 if form == "fused" else 2)


def test_no_correctness_promise_before_an_exception(monkeypatch):
    # Without the layout pass the captured backward itself fails: the fallback cannot run
    # it either, so the error must come with no "results stay correct" warning before it.
    monkeypatch.setattr(backend, "robust_views", lambda gm, phase: 0)
    torch.manual_seed(0)
    comp = _compile()(BNT())
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        with pytest.raises(RuntimeError, match="view size is not compatible") as info:
            comp(torch.randn(4, 5, 8)).sum().backward()
    promises = [w for w in seen if "results stay correct" in str(w.message)]
    assert promises == []
    notes = "\n".join(getattr(info.value, "__notes__", []))
    assert "g0.bw also failed when run as captured at node %view_2" in notes
    assert "test_habits_layout.py" in notes  # the user's line the node came from


def test_fallback_runs_once_with_effects_undone_and_names_the_source_line():
    """A ``prepare`` that ran the graph (BatchNorm statistics, dropout masks) and then
    failed: the fallback's run is eager's, and its warning names this file's line."""

    def half_done(record, args):
        record.gm.forward(*args)  # writes the statistics, draws the mask
        torch.rand(7)  # and more draws
        raise ValueError("planner broke")

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.l, self.d, self.bn = nn.Linear(8, 8), nn.Dropout(0.5), nn.BatchNorm1d(8)

        def forward(self, x):
            return self.bn(self.d(self.l(x)))

    torch.manual_seed(0)
    eager = Net()
    model = copy.deepcopy(eager)
    x = torch.randn(16, 8)
    compiled = torch.compile(model, backend=Capture(prepare=half_done).backend, dynamic=False)
    torch.manual_seed(3)
    want = eager(x)
    after_eager = torch.rand(3)
    torch.manual_seed(3)
    with pytest.warns(FallbackWarning, match="results stay correct") as seen:
        got = compiled(x)
    after_compiled = torch.rand(3)
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(after_compiled, after_eager)  # the same draws, once
    torch.testing.assert_close(model.bn.running_mean, eager.bn.running_mean)
    assert int(model.bn.num_batches_tracked) == int(eager.bn.num_batches_tracked) == 1
    assert "test_habits_layout.py" in str(seen[0].message)


def test_aten_nodes_carry_the_users_source_line():
    seen = {}

    def keep(record, args):
        seen[record.tag] = record.gm
        return backend.run_serially(record, args)

    compiled = torch.compile(BNT(), backend=Capture(prepare=keep).backend, dynamic=False)
    compiled(torch.randn(4, 5, 8)).sum().backward()
    for tag in ("g0.fw", "g0.bw"):
        ops = [n for n in seen[tag].graph.nodes if n.op == "call_function"]
        assert all("test_habits_layout.py" in node_source(n) for n in ops), tag


def test_a_dynamo_graph_run_eagerly_warns_only_after_it_ran():
    def boom(x):
        raise RuntimeError("the user's own error")

    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        wrapped = _WarnOnceItRan(boom, "AOTAutograd could not trace", None, "")
        with pytest.raises(RuntimeError):
            wrapped(1)
        assert not seen
        wrapped = _WarnOnceItRan(lambda x: x + 1, "AOTAutograd could not trace", None, "")
        assert wrapped(1) == 2 and wrapped(2) == 3
    assert len(seen) == 1 and issubclass(seen[0].category, FallbackWarning)


def test_an_untraceable_dynamo_graph_runs_eagerly_then_warns(monkeypatch):
    import torch._dynamo.backends.common as common

    def refuses(**kw):
        def trace(gm, example_inputs):
            raise NotImplementedError("an op AOTAutograd cannot trace")

        return trace

    monkeypatch.setattr(common, "aot_autograd", refuses)
    torch.manual_seed(0)
    model = BNT()
    x = torch.randn(4, 5, 8)
    compiled = torch.compile(copy.deepcopy(model), backend=Capture().backend, dynamic=False)
    with pytest.warns(FallbackWarning, match="could not trace Dynamo graph") as seen:
        torch.testing.assert_close(compiled(x), model(x))
    assert "test_habits_layout.py" in str(seen[0].message)


def test_merges_dims():
    assert merges_dims((4, 5, 8), (20, 8)) and merges_dims((4, 5, 8), (4, 40))
    assert not merges_dims((20, 8), (4, 5, 8))  # a split works on any strides
    assert not merges_dims((1, 8, 1), (8,)) and not merges_dims((8,), (1, 8))
    assert merges_dims((6, 4), (4, 6))  # re-grouping straddles both dimensions
    assert not merges_dims((0, 3), (0, 5, 7)) and not merges_dims((3, 4), (3, 2, 2))


def test_robust_views_rewrites_only_views_that_can_fail():
    def f(x):
        a = x.view(6)  # a forward input: guarded strides, stays a view
        b = (x * 2).view(6)  # a kernel's output merged: a reshape
        c = (x * 2).view(2, 3, 1)  # no merge: stays a view
        return a, b, c

    gm = make_fx(f, tracing_mode="fake")(torch.ones(2, 3))
    assert robust_views(gm, phase="forward") == 1
    views = [n.target for n in gm.graph.nodes if n.op == "call_function" and "view" in n.name]
    assert views == [aten.view.default, aten.reshape.default, aten.view.default]
    gm2 = make_fx(f, tracing_mode="fake")(torch.ones(2, 3))
    assert robust_views(gm2, phase="backward") == 2  # a backward input is a prediction too
    out = gm2(torch.ones(3, 2).t())  # a layout the trace never saw: runs, same values
    torch.testing.assert_close(out[1], torch.full((6,), 2.0))


def test_robust_views_keeps_views_that_are_written_through():
    def f(x):
        v = (x * 2).view(6)
        v.add_(1)  # a write through the view: a copy would lose it
        return v

    gm = make_fx(f, tracing_mode="fake")(torch.ones(2, 3))
    assert robust_views(gm, phase="backward") == 0
