"""The batch-split tier: a Dynamo graph run as two half batches at once on two threads
(``autopar.codegen.batch_split``: which graphs qualify; ``autopar.runtime.split_tier``: the
runner and the candidate).

The analysis and the runner's autograd are tested on uncompiled graphs (fast, float64 where
equality matters); two tests compile with Inductor's C++ wrapper (seconds each, one small
graph, the second a cache hit).
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from nets import BranchyNet, compile_and_land, dynamo_graph, race_side_by_side
from oracle import check_training

import autopar
import autopar.runtime.tiers as tiers
from autopar.codegen.batch_split import batched_inputs, split_reason
from autopar.profiling.store import ProfileStore
from autopar.runtime.split_tier import SplitRunner
from autopar.tools import zoo


class ConvBranches(nn.Module):
    """Inception in miniature: a 1x1 and a 3x3 branch and a pooled one, concatenated."""

    def __init__(self):
        super().__init__()
        self.a = nn.Conv2d(3, 4, 1)
        self.b = nn.Sequential(nn.Conv2d(3, 4, 1), nn.ReLU(), nn.Conv2d(4, 4, 3, padding=1))
        self.c = nn.Sequential(nn.MaxPool2d(3, 1, 1), nn.Conv2d(3, 4, 1))
        self.head = nn.Linear(12, 5)

    def forward(self, x):
        y = F.relu(torch.cat([self.a(x), self.b(x), self.c(x)], dim=1))
        return self.head(y.mean(dim=(2, 3)))


class Lambda(nn.Module):
    def __init__(self, fn):
        super().__init__()
        self.fn, self.lin = fn, nn.Linear(8, 8)

    def forward(self, x):
        return self.fn(self.lin(x))


@pytest.mark.parametrize("make, shape", [
    (lambda: zoo.MLP(8, 16, 4), (6, 8)),
    (ConvBranches, (4, 3, 6, 6)),
    (lambda: zoo.MultiTowerMLP(d_in=8, hidden=16, towers=3, depth=2), (4, 8)),
    (lambda: Lambda(lambda y: y.relu().mul_(2)), (4, 8)),  # in place, into its own value
    (lambda: Lambda(lambda y: torch.stack([y, y.tanh()], dim=1)), (4, 8)),
])  # fmt: skip
def test_row_wise_graphs_may_be_split(make, shape):
    gm, args = dynamo_graph(make(), torch.randn(shape))
    rng = torch.get_rng_state()
    assert split_reason(gm, args) is None
    assert torch.equal(rng, torch.get_rng_state())  # the analysis traces on fake tensors


@pytest.mark.parametrize("fn, why", [
    (nn.Dropout(0.5), "draws random numbers"),
    (nn.BatchNorm1d(8), "rows"),  # batch statistics
    (lambda y: y - y.mean(0), "batch"),
    (lambda y: y.t() @ y, "batch"),
    (lambda y: y.sum(), "batch"),
    (lambda y: F.layer_norm(y, y.shape), "batch"),
])  # fmt: skip
def test_graphs_that_mix_rows_or_draw_random_numbers_are_not_split(fn, why):
    model = Lambda(fn).train()
    gm, args = dynamo_graph(model, torch.randn(6, 8))
    reason = split_reason(gm, args)
    assert reason is not None and (why in reason or "in place" in reason), reason


def test_only_even_batches_of_outside_inputs_are_split():
    gm, args = dynamo_graph(zoo.MLP(8, 16, 4), torch.randn(5, 8))
    assert "batch of 5" in batched_inputs(gm, args)
    gm, args = dynamo_graph(zoo.MLP(8, 16, 4), torch.randn(6, 8))
    picked, batch = batched_inputs(gm, args)
    assert batch == 6 and [tuple(args[i].shape) for i in picked] == [(6, 8)]


def test_the_runner_equals_the_whole_batch_and_sums_parameter_gradients_once():
    """Two halves on two threads, joined by one autograd.Function: float64 outputs and
    every gradient (parameters and the input) equal the whole batch's; a parameter's tensor
    hook runs once per backward, with the whole gradient."""
    torch.manual_seed(0)
    model = ConvBranches().double()
    twin = copy.deepcopy(model)
    x = torch.randn(6, 3, 5, 5, dtype=torch.float64, requires_grad=True)
    gm, args = dynamo_graph(model, x)
    picked, batch = batched_inputs(gm, args)
    runner = SplitRunner(gm.forward, picked, batch)
    hooked = []
    model.head.weight.register_hook(lambda g: hooked.append(g.clone()))
    model.zero_grad(set_to_none=True)
    (out,) = runner(*args)
    x2 = x.detach().clone().requires_grad_()
    ref = twin(x2)
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)
    out.square().sum().backward()
    ref.square().sum().backward()
    for p, q in zip(model.parameters(), twin.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(x.grad, x2.grad, rtol=1e-12, atol=1e-12)
    assert len(hooked) == 1
    torch.testing.assert_close(hooked[0], twin.head.weight.grad, rtol=1e-12, atol=1e-12)


def test_a_second_backward_through_split_outputs_says_what_to_do():
    gm, args = dynamo_graph(zoo.MLP(8, 16, 4), torch.randn(4, 8))
    picked, batch = batched_inputs(gm, args)
    (out,) = SplitRunner(gm.forward, picked, batch)(*args)
    loss = out.sum()
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="retain_graph=True"):
        loss.backward()


def test_a_graph_that_may_not_be_split_is_not_offered_and_says_why(monkeypatch):
    monkeypatch.setenv("AUTOPAR_TIERS", "split")
    cmodel = autopar.compile(BranchyNet(), inductor=True, background=False,
                             store=ProfileStore.memory())  # fmt: skip
    for _ in range(2):
        cmodel(torch.randn(8, 16)).sum().backward()
    lines = autopar.explain(cmodel).tiers
    assert any("split not offered: " in line and "in place" in line for line in lines), lines
    assert {u.executor for u in autopar.graphs(cmodel)} == {"plan"}


def test_the_split_executor_trains_like_eager(monkeypatch):
    """Compiled with the C++ wrapper at one thread per half and landed (margin forced): one
    training step equals eager by the fp64 oracle, and ``explain`` shows the split."""
    monkeypatch.setenv("AUTOPAR_TIERS", "split")
    monkeypatch.setattr(tiers, "JOINT_MARGIN", float("inf"))
    compiled = {}
    make = lambda: [torch.randn(4, 3, 6, 6, requires_grad=True)]  # noqa: E731
    compile_fn = compile_and_land(make, compiled)

    check_training(ConvBranches(), [torch.randn(4, 3, 6, 6)], compile_fn, opt_name="sgd")
    assert {u.executor for u in autopar.graphs(compiled["m"])} == {"split"}
    assert "batch split: inputs" in str(autopar.explain(compiled["m"]).graphs[0].program)


def test_split_steps_race_and_train_like_eager(monkeypatch):
    """With the race on, split steps take turns with eager and per-graph compiled steps:
    every step equals eager's and the generator moves as in eager."""
    monkeypatch.setenv("AUTOPAR_TIERS", "split")
    torch.manual_seed(0)
    model = ConvBranches()
    _, eager, _, ran = race_side_by_side(model, torch.randn(4, 3, 6, 6), 40)
    assert "split" in ran
    for p, q in zip(model.parameters(), eager.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)


# Pieces for random models: row-wise ones, then ones that mix rows (flip, roll, cumsum along
# the batch, statistics over it, a Gram matrix).
_ROW_WISE = [
    torch.relu, torch.tanh, lambda y: y * 2 + 1, lambda y: y.softmax(1),
    lambda y: F.layer_norm(y, y.shape[1:]), lambda y: torch.cat([y, y.sin()], 1)[:, :8],
    lambda y: y - y.mean(1, keepdim=True),
    lambda y: torch.cat([y.view(y.shape[0], 2, 4).sum(1)] * 2, 1),
]  # fmt: skip
_MIXING = [
    lambda y: y.flip(0), lambda y: y.roll(1, 0), lambda y: y.cumsum(0), lambda y: y.softmax(0),
    lambda y: y - y.mean(0), lambda y: (y.t() @ y)[: y.shape[0]],
]  # fmt: skip
_PIECES = _ROW_WISE + _MIXING


class _Random(nn.Module):
    def __init__(self, picks):
        super().__init__()
        self.picks = picks
        self.lins = nn.ModuleList(nn.Linear(8, 8) for _ in picks)

    def forward(self, x):
        for lin, k in zip(self.lins, self.picks, strict=True):
            x = _PIECES[k](lin(x))
        return x


def test_property_the_analysis_splits_exactly_the_row_wise_chains():
    """Random chains of three pieces: the analysis splits a chain exactly when it has no
    row-mixing piece, and a chain it splits is computed row by row, numerically: the halves'
    outputs, concatenated, are the whole batch's, and changing one row of the input changes
    that row of the output only."""
    gen = torch.Generator().manual_seed(0)
    split = 0
    for seed in range(24):
        picks = torch.randint(len(_PIECES), (3,), generator=gen).tolist()
        torch.manual_seed(seed)
        model = _Random(picks).double()
        x = torch.randn(8, 8, dtype=torch.float64)
        gm, args = dynamo_graph(model, x)
        reason = split_reason(gm, args)
        assert (reason is None) == all(k < len(_ROW_WISE) for k in picks), (picks, reason)
        if reason is not None:
            continue
        split += 1
        with torch.no_grad():
            whole = model(x)
            torch.testing.assert_close(torch.cat([model(x[:4]), model(x[4:])]), whole)
            poked = x.clone()
            poked[0] += 1.0
            torch.testing.assert_close(model(poked)[1:], whole[1:])
    assert split >= 3, split
