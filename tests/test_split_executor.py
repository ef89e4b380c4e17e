"""The ``split`` executor: a Dynamo graph run as two half batches at once on two threads
(``autopar.codegen.batch_split``: which graphs qualify; ``autopar.runtime.executors.split``:
the runners and the rule that offers it).

The analysis and the runner's autograd are tested on uncompiled graphs (fast, float64 where
equality matters); the tests that compile with Inductor's C++ wrapper (seconds each) share
one small graph, so all but the first are cache hits. The native runner (``split.cpp``) is
held, like the Python runner, to the fp64 oracle against eager: both call the same compiled
kernels on the same halves, but at one thread each, whose rounding differs between CPUs.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from nets import BranchyNet, compile_and_land, dynamo_graph, race_side_by_side
from oracle import assert_close_to_oracle, check_training

import autopar
from autopar.codegen.batch_split import batched_inputs, split_reason
from autopar.profiling.store import ProfileStore
from autopar.runtime import native
from autopar.runtime.executors.split import NativeSplitRunner, SplitRunner, split_parts
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


def test_a_graph_that_may_not_be_split_is_not_offered_and_says_why():
    cmodel = autopar.compile(BranchyNet(), executors=("plan", "split"), background=False,
                             store=ProfileStore.memory())  # fmt: skip
    for _ in range(3):
        cmodel(torch.randn(8, 16)).sum().backward()
    status = autopar.explain(cmodel).rungs["g0"]["split"]
    assert status.startswith("not offered: ") and "in place" in status, status
    assert {u.executor for u in autopar.graphs(cmodel)} == {"plan"}


def test_the_split_executor_trains_like_eager():
    """Compiled with the C++ wrapper at one thread per half: one training step equals eager
    by the fp64 oracle, and ``explain`` shows the split."""
    compiled = {}
    make = lambda: [torch.randn(4, 3, 6, 6, requires_grad=True)]  # noqa: E731
    compile_fn = compile_and_land(make, compiled, "split")

    native.load()  # built once per torch version: the split then runs natively
    check_training(ConvBranches(), [torch.randn(4, 3, 6, 6)], compile_fn, opt_name="sgd")
    assert {u.executor for u in autopar.graphs(compiled["m"])} == {"split"}
    program = autopar.explain(compiled["m"]).graphs[0].program
    assert "batch split: inputs" in str(program)
    assert "split runner: native (split.cpp)" in program.notes, program.notes


@pytest.fixture(scope="module")
def conv_split():
    """ConvBranches' split program, compiled for a batch of 4 (a cache hit after the first
    compile), with the graph's example inputs."""
    native.load()
    torch.manual_seed(0)
    gm, args = dynamo_graph(ConvBranches(), torch.randn(4, 3, 6, 6, requires_grad=True))
    _, build, check = split_parts(gm, args, "g0")
    assert check() is None
    return build(), args, gm


def _batch(xs: list, args: list | None = None) -> torch.Tensor:
    """The batch among ``xs`` (the graph's input that is no parameter in ``args``)."""
    args = xs if args is None else args
    return next(x for x, a in zip(xs, args, strict=True) if not isinstance(a, nn.Parameter))


def _fw_bw(runner, args, seed: int = 1):
    """Outputs and every input's gradient (parameters, the batch) of one forward and
    backward through ``runner``, for a fixed output gradient; a hook on the batch's gradient
    counts its calls."""
    leaves = [a.detach().clone().requires_grad_(a.requires_grad) for a in args]
    calls = []
    _batch(leaves, args).register_hook(lambda g: calls.append(1))
    (out,) = runner(*leaves)
    out.backward(torch.randn(out.shape, generator=torch.Generator().manual_seed(seed)))
    return out, [a.grad for a in leaves], calls


def _check_against_oracle(run, args, gm) -> None:
    """``run``'s outputs and every gradient against eager's and float64's (the oracle)."""
    got, grads, calls = run
    gm64 = copy.deepcopy(gm).double()
    eager, eager_grads, _ = _fw_bw(gm, args)
    ref, ref_grads, _ = _fw_bw(gm64, [a.double() if a.is_floating_point() else a for a in args])
    assert_close_to_oracle("output", got, eager, ref)
    for i, (g, e, r) in enumerate(zip(grads, eager_grads, ref_grads, strict=True)):
        assert (g is None) == (e is None), i
        if g is not None:
            assert_close_to_oracle(f"gradient {i}", g, e, r)
    assert len(calls) == 1  # the batch's gradient hook ran once, with the whole gradient


def test_both_split_runners_train_like_eager(conv_split):
    """The native runner and the Python runner each give eager's outputs and gradients
    (judged by the fp64 oracle: they run other kernels than eager, at one thread)."""
    program, args, gm = conv_split
    assert isinstance(program.fn, NativeSplitRunner), program.runner
    assert sum(a.requires_grad for a in args) > 1 and any(a.shape[0] == 4 for a in args)
    for runner in (program.fn, program.fn.python):
        _check_against_oracle(_fw_bw(runner, args), args, gm)


def test_the_native_split_keeps_autograd_semantics(conv_split):
    """retain_graph=True raises AOTAutograd's error where the compiled backward donates
    buffers (it writes into saved tensors) and otherwise gives the same gradients twice; an
    in-place change of a saved tensor raises autograd's error; a backward under
    create_graph=True gives usable results whose own backward raises the double-backward
    error."""
    program, args, _ = conv_split
    leaves = [a.detach().clone().requires_grad_(a.requires_grad) for a in args]
    assert program.joint.fn.donated  # Inductor's default (torch._functorch.config)
    (out,) = program.fn(*leaves)
    with pytest.raises(RuntimeError, match="donated buffers"):
        out.sum().backward(retain_graph=True)

    x = _batch(args).detach().requires_grad_()
    # Not from the FX graph cache: it serves the donating compile of the same graph (torch
    # 2.13: its key leaves the donated buffers out), whose backward overwrites saved tensors.
    with torch._functorch.config.patch(donated_buffer=False), \
            torch._inductor.config.patch(fx_graph_cache=False):  # fmt: skip
        _, build, _ = split_parts(*dynamo_graph(ConvBranches(), x), "g0")
        kept = build()
    assert not kept.joint.fn.donated and isinstance(kept.fn, NativeSplitRunner)
    (out,) = kept.fn(*leaves)
    out.sum().backward(retain_graph=True)
    first = [None if a.grad is None else a.grad.clone() for a in leaves]
    for a in leaves:
        a.grad = None
    out.sum().backward()
    assert all(g is None and a.grad is None or torch.equal(g, a.grad)
               for g, a in zip(first, leaves, strict=True))  # fmt: skip
    with pytest.raises(RuntimeError, match="freed by a backward already"):
        out.sum().backward()

    (out,) = kept.fn(*leaves)
    with torch.no_grad():
        for a in leaves:  # the saved tensors include parameters (the convolutions' weights)
            a.mul_(1.0)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        out.sum().backward()

    (out,) = kept.fn(*leaves)
    grads = torch.autograd.grad(out.sum(), [a for a in leaves if a.requires_grad],
                                create_graph=True)  # fmt: skip
    assert all(g.requires_grad for g in grads)
    with pytest.raises(RuntimeError, match="double backward"):
        grads[0].sum().backward()


def test_a_joint_graph_that_donates_buffers_refuses_retain_graph_as_aotautograd(conv_split):
    """The half-batch program through autopar's DirectGraph (as the inductor executor runs a
    graph): its backward writes into saved tensors, so retain_graph=True raises
    AOTAutograd's error rather than let a second backward read overwritten values."""
    program, args, _ = conv_split
    batch = _batch(args)
    half = [a.detach()[:2].requires_grad_() if a is batch else a for a in args]
    (out,) = program.joint.fn(*half)
    with pytest.raises(RuntimeError, match="donated buffers"):
        out.sum().backward(retain_graph=True)


def test_saved_tensor_hooks_see_every_saved_tensor_of_both_halves(conv_split):
    """Saved-tensor hooks are thread-local: under them both halves run on the calling
    thread (the native runner leaves such calls to the Python runner, whose worker thread
    would not see them), so the hooks see the saved tensors of the whole batch, and the
    gradients are eager's."""
    import threading

    program, args, gm = conv_split
    caller = threading.get_ident()
    packed = []

    def pack(t):
        packed.append((threading.get_ident(), tuple(t.shape)))
        return t

    for runner in (program.fn, program.fn.python):
        packed.clear()
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            run = _fw_bw(runner, args)
        assert packed and all(thread == caller for thread, _ in packed)
        halves = [shape for _, shape in packed if shape and shape[0] == 2]  # half of 4 rows
        assert halves and all(halves.count(s) % 2 == 0 for s in halves)  # one per half
        _check_against_oracle(run, args, gm)


def test_the_native_split_can_be_switched_off_and_says_so(conv_split, monkeypatch):
    program, args, _ = conv_split
    monkeypatch.setenv("AUTOPAR_BYPASSES", "0")
    _, build, _ = split_parts(*dynamo_graph(ConvBranches(), _batch(args).detach()), "g0")
    off = build()
    assert isinstance(off.fn, SplitRunner) and "AUTOPAR_BYPASSES" in off.runner
    assert f"split runner: {off.runner}" in off.program("forward").notes


def test_split_steps_race_and_train_like_eager():
    """Split steps take turns with eager and planned steps: every step equals eager's and
    the generator moves as in eager."""
    torch.manual_seed(0)
    model = ConvBranches()
    _, eager, _, ran = race_side_by_side(model, torch.randn(4, 3, 6, 6), 40,
                                         ("eager", "plan", "split"))  # fmt: skip
    assert "split" in ran
    for p, q in zip(model.parameters(), eager.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)


# Pieces for random models: row-wise ones, then ones that mix rows (flip, roll, cumsum along
# the batch, statistics over it, a Gram matrix) ...
_ROW_WISE = [
    torch.relu, torch.tanh, lambda y: y * 2 + 1, lambda y: y.softmax(1),
    lambda y: F.layer_norm(y, y.shape[1:]), lambda y: torch.cat([y, y.sin()], 1)[:, :8],
    lambda y: y - y.mean(1, keepdim=True),
    lambda y: torch.cat([y.view(-1, 2, 4).sum(1)] * 2, 1),
]  # fmt: skip
# ... and ones that are row-wise in eager but not in the graph: Dynamo bakes the batch size
# (``y.shape[0]``) into it as a number, wrong for a half batch.
_MIXING = [
    lambda y: y.flip(0), lambda y: y.roll(1, 0), lambda y: y.cumsum(0), lambda y: y.softmax(0),
    lambda y: y - y.mean(0), lambda y: (y.t() @ y)[: y.shape[0]],
    lambda y: torch.cat([y.view(y.shape[0], 2, 4).sum(1)] * 2, 1),
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


class BakedBatch(nn.Module):
    """``x.size(0)`` in a reshape: Dynamo bakes the batch size into the graph as a number,
    so the graph is row-wise at full batch and wrong at half batch."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(32, 32), nn.Linear(8, 4)

    def forward(self, x):
        return self.b(self.a(x).reshape(x.size(0), -1, 8).sum(1))


def test_a_batch_size_baked_into_the_graph_is_not_split():
    gm, args = dynamo_graph(BakedBatch(), torch.randn(16, 32))
    reason = split_reason(gm, args)
    assert reason is not None and "half batch" in reason, reason


def test_a_baked_batch_size_trains_like_eager_for_100_raced_steps():
    torch.manual_seed(0)
    model = BakedBatch()
    cmodel, eager, _, ran = race_side_by_side(model, torch.randn(16, 32), 100,
                                              ("eager", "plan", "split"))  # fmt: skip
    assert "split" not in ran
    (rungs,) = autopar.explain(cmodel).rungs.values()
    assert "half batch" in rungs["split"], rungs
    for p, q in zip(model.parameters(), eager.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)


def test_a_program_whose_first_call_is_wrong_leaves_the_race(monkeypatch):
    """Were the proof wrong, a built program's first call is still checked against the
    captured runner's outputs: the split of a graph that baked in its batch size gives
    other shapes, leaves the race, and training goes on equal to eager."""
    import autopar.runtime.executors.split as split

    monkeypatch.setattr(split, "split_reason", lambda gm, args: None)  # a wrong proof
    monkeypatch.setattr(split, "PREDICTED_GAIN", float("inf"))
    torch.manual_seed(0)
    model = BakedBatch()
    _, eager, pipe, ran = race_side_by_side(model, torch.randn(16, 32), 30,
                                            ("eager", "plan", "split"))  # fmt: skip
    assert any("split left the race" in e for e in pipe.runtime.events), pipe.runtime.events
    for p, q in zip(model.parameters(), eager.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
