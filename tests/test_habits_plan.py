"""Habits the planner and the RNN cells must keep (issue 14): random ops on independent
branches stay in graph order under every policy (so the graph gets a real plan and the same
dropout masks as eager), and ``nn.LSTMCell`` / ``nn.GRUCell`` loops run under
``torch.autocast`` as eager does."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from oracle import assert_close_to_oracle, check_training

import autopar
from autopar.capture.analysis import example_args
from autopar.codegen.emitters import generate
from autopar.errors import PlanError
from autopar.planning import policies
from autopar.planning.costmodel import MachineModel
from autopar.planning.listsched import list_schedule, rng_nodes, target_is_rng, with_rng_order
from autopar.planning.partition import make_plan
from autopar.planning.plan import Stream
from autopar.planning.taskgraph import fork_join_graph
from autopar.planning.verify import verify_plan
from autopar.profiling.store import ProfileStore
from autopar.rnn.rewrite import rewrite_rnns

M = MachineModel.default_cpu()
TWO = [Stream(0, "cpu", 1), Stream(1, "cpu", 1)]
#: The single-device policies that can use several streams.
MULTI = [n for n, p in policies.POLICIES.items() if n != "serial" and not p.multi_device]


# -- 1. random ops keep graph order -------------------------------------------------------
class TwoDrop(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)
        self.d1, self.d2 = nn.Dropout(0.5), nn.Dropout(0.5)

    def forward(self, x):
        return self.d1(self.a(x)) + self.d2(self.b(x))


def _two_random_branches():
    """Two equal branches, each ending in a random op: every multi-stream policy splits them,
    and the critical-path order puts the second branch's random op first (it is the one
    the graph lists last, at the same rank)."""
    g = fork_join_graph([[1e-3, 1e-3, 1e-4], [1e-3, 1e-3, 1e-4]])
    rng = ["g0.fw/n3", "g0.fw/n6"]
    for n in g:
        g.nodes[n]["rng"] = n in rng
    return g, rng


def test_random_targets_are_recognised():
    assert target_is_rng("aten.native_dropout.default")
    assert target_is_rng("aten.bernoulli_.float")
    assert not target_is_rng("aten.mm.default")
    assert not target_is_rng("autopar.lstm_cell.default")
    assert not target_is_rng("_operator.getitem")
    assert not target_is_rng("primals_1") and not target_is_rng("no.such.op")


def test_ordering_edges_join_consecutive_random_ops_of_one_graph():
    g, rng = _two_random_branches()
    assert rng_nodes(g) == rng
    ordered = with_rng_order(g)
    assert ordered.edges[rng[0], rng[1]] == {"bytes": 0, "order": True}
    assert not g.has_edge(*rng)  # the caller's graph is left alone
    assert with_rng_order(ordered) is ordered  # nothing missing: no copy
    plain = fork_join_graph([[1e-3], [1e-3]])
    assert with_rng_order(plain) is plain


@pytest.mark.parametrize("policy", ["auto", *MULTI])
def test_every_policy_keeps_random_ops_in_graph_order(policy):
    g, rng = _two_random_branches()
    plan = make_plan(g, policy=policy, streams=TWO, machine=M)
    verify_plan(plan, g)
    pos = {n: i for i, n in enumerate(plan.order)}
    assert pos[rng[0]] < pos[rng[1]]
    if policy != "auto":
        assert plan.policy == policy and len(plan.streams) == 2


def test_list_schedule_keeps_random_ops_in_graph_order():
    g, rng = _two_random_branches()
    r = list_schedule(g, TWO, M)
    start = {n: s for n, _, s, _ in r.timeline()}
    assert start[rng[0]] < start[rng[1]]


def test_the_verifier_rejects_random_ops_out_of_order():
    g, rng = _two_random_branches()
    plan = make_plan(g, policy="serial", machine=M)
    order = [n for n in plan.order if n != rng[0]]
    order.insert(order.index(rng[1]) + 1, rng[0])  # still topological, random ops swapped
    with pytest.raises(PlanError, match="random op"):
        verify_plan(plan.replace(order=tuple(order)), g)


def test_auto_drops_a_policy_whose_plan_fails_verification(monkeypatch):
    g, rng = _two_random_branches()

    def bad(graph, streams, machine, costs, order, **_):  # swaps the random ops
        order = [n for n in order if n != rng[0]]
        order.insert(order.index(rng[1]) + 1, rng[0])
        return {n: streams[n in ("g0.fw/n4", "g0.fw/n5", rng[1])].id for n in order}, order

    monkeypatch.setitem(policies.POLICIES, "bad", policies.Policy(bad))
    plan = make_plan(g, streams=TWO, machine=M)
    assert plan.policy != "bad"
    assert any(k.startswith("pass:bad") and "rejected" in v for k, v in plan.provenance)
    with pytest.raises(PlanError, match="random op"):
        make_plan(g, policy="bad", streams=TWO, machine=M)


def _forward_unit(cm):
    (unit,) = [u for u in autopar.graphs(cm) if u.tag.endswith(".fw")]
    return unit


@pytest.mark.parametrize("policy", ["auto", *MULTI])
def test_two_dropouts_train_as_eager_with_a_real_plan(policy):
    torch.manual_seed(0)
    model, x = TwoDrop(), torch.randn(64, 8)

    def compile_fn(m):
        return autopar.compile(m, policy=policy, streams=2, store=ProfileStore.memory(),
                               race=False, adapt=False)  # fmt: skip

    # Same seed before eager, fp64 and compiled steps: equal masks, or the oracle fails.
    cm = check_training(model, [x], compile_fn)
    assert not autopar.explain(cm).fallbacks
    unit = _forward_unit(cm)
    assert unit.executor == "plan" and unit.plan is not None
    # The policy's own multi-stream program (the first call may have kept serial after
    # measuring it): same masks and outputs as the captured graph under the same seed.
    if policy == "auto":
        return
    plan = make_plan(unit.table, policy=policy, streams=2, machine=M, graph_id=unit.tag)
    assert len(plan.streams) == 2
    program = generate(unit.gm, plan, unit.tag)
    assert len(program.streams_used) == 2  # worker streams (random ops on the calling thread)
    args = example_args(unit.gm, torch.Generator().manual_seed(1))
    torch.manual_seed(3)
    want = unit.gm(*args)
    torch.manual_seed(3)
    got = program.fn(*args)
    for w, o in zip(want, got, strict=True):
        if w.dtype == torch.bool:
            assert torch.equal(w, o)  # the dropout masks
        else:
            torch.testing.assert_close(o, w)


# -- 2. LSTMCell / GRUCell loops under autocast ---------------------------------------------
class LSTMLoop(nn.Module):
    def __init__(self):
        super().__init__()
        self.c = nn.LSTMCell(8, 8)

    def forward(self, x):
        h = c = torch.zeros(x.shape[1], 8, dtype=x.dtype)
        for t in range(x.shape[0]):
            h, c = self.c(x[t], (h, c))
        return h


class GRULoop(nn.Module):
    def __init__(self):
        super().__init__()
        self.c = nn.GRUCell(8, 8)

    def forward(self, x):
        h = torch.zeros(x.shape[1], 8, dtype=x.dtype)
        for t in range(x.shape[0]):
            h = self.c(x[t], h)
        return h


def _autocast_step(model, x, autocast: bool):
    x = x.clone().requires_grad_(True)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        y = model(x)
    y.float().sum().backward()
    grads = {n: p.grad for n, p in model.named_parameters()}
    return y, grads, x.grad


@pytest.mark.parametrize("steps", [5, 1])  # 5: the loop fuses into a layer op; 1: cell ops
@pytest.mark.parametrize("cls", [LSTMLoop, GRULoop])
def test_cell_loops_under_autocast_run_as_eager(cls, steps):
    torch.manual_seed(0)
    base, x = cls(), torch.randn(steps, 4, 8)
    ref_model = cls().double()
    ref_model.load_state_dict(base.state_dict())
    ref = _autocast_step(ref_model, x.double(), False)
    eager_model, comp_model = cls(), cls()
    eager_model.load_state_dict(base.state_dict())
    comp_model.load_state_dict(base.state_dict())
    eager = _autocast_step(eager_model, x, True)
    cm = autopar.compile(comp_model, store=ProfileStore.memory(), race=False, adapt=False)
    for _ in range(2):  # the first call plans, the second runs the plan
        comp_model.zero_grad()
        got = _autocast_step(cm, x, True)
    assert not autopar.explain(cm).fallbacks
    assert got[0].dtype == eager[0].dtype  # float32: eager promotes the state, so do the ops
    # bf16 GEMMs: as close to fp64 as eager is, within 2x and bf16's resolution
    assert_close_to_oracle("output", got[0], eager[0], ref[0], atol=1e-2)
    for n in eager[1]:
        assert got[1][n].dtype == eager[1][n].dtype
        assert_close_to_oracle(f"grad {n}", got[1][n], eager[1][n], ref[1][n], atol=1e-2)
    assert_close_to_oracle("input grad", got[2], eager[2], ref[2], atol=1e-2)


@pytest.mark.parametrize("cls", [LSTMLoop, GRULoop])
def test_rewritten_cells_run_eagerly_under_autocast(cls):
    # Outside Dynamo the rewritten cells call the bodies through an autograd.Function.
    torch.manual_seed(0)
    model, x = cls(), torch.randn(3, 4, 8)
    want = _autocast_step(model, x, True)
    model.zero_grad()
    with rewrite_rnns(model):
        got = _autocast_step(model, x, True)
    assert got[0].dtype == want[0].dtype
    torch.testing.assert_close(got[0], want[0], atol=2e-2, rtol=2e-2)
    for n in want[1]:
        assert got[1][n].dtype == want[1][n].dtype
        torch.testing.assert_close(got[1][n], want[1][n], atol=5e-2, rtol=5e-2)


@pytest.mark.parametrize("kind", ["lstm", "gru"])
def test_cell_ops_promote_mixed_dtypes_as_aten_does(kind):
    torch.manual_seed(0)
    n = 4 if kind == "lstm" else 3
    ig, hg = (torch.randn(3, n * 5, dtype=torch.bfloat16, requires_grad=True) for _ in "ih")
    state = torch.randn(3, 5, requires_grad=True)
    op = torch.ops.autopar.lstm_cell if kind == "lstm" else torch.ops.autopar.gru_cell
    out = op(ig, hg, state)
    out = out if isinstance(out, tuple) else (out,)
    assert all(o.dtype == torch.float32 for o in out)
    sum(o.sum() for o in out).backward()
    assert ig.grad.dtype == hg.grad.dtype == torch.bfloat16 and state.grad.dtype == torch.float32
    # the math is the float32 op on the promoted inputs
    args = [t.detach().float().requires_grad_() for t in (ig, hg, state)]
    want = op(*args)
    want = want if isinstance(want, tuple) else (want,)
    for o, w in zip(out, want, strict=True):
        assert torch.equal(o, w)
    sum(w.sum() for w in want).backward()
    torch.testing.assert_close(state.grad, args[2].grad)
    torch.testing.assert_close(ig.grad, args[0].grad.bfloat16())
    with pytest.raises(ValueError, match="share a"):
        op(ig.detach(), hg.detach().float(), state.detach())


def test_lower_precision_autocast_rule_casts_every_input(monkeypatch):
    # The rule the cell ops get under CUDA autocast (rnn.dtypes), tried here on CPU: every
    # floating input, the state too, in autocast's dtype, on the op and the eager path.
    from autopar.rnn import dtypes

    lib = torch.library.Library("autopar", "FRAGMENT")
    try:
        for op in (torch.ops.autopar.lstm_cell.default, torch.ops.autopar.gru_cell.default):
            dtypes.register_lower_precision_autocast(op, "cpu", lib)
        monkeypatch.setattr(dtypes, "AUTOCAST_CELL_DEVICES", ("cpu",))
        ig, hg = (torch.randn(3, 20, requires_grad=True) for _ in "ih")
        c = torch.randn(3, 5, requires_grad=True)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            h, c_new = torch.ops.autopar.lstm_cell(ig, hg, c)
        assert h.dtype == c_new.dtype == torch.bfloat16
        (h.float().sum() + c_new.float().sum()).backward()
        assert ig.grad.dtype == c.grad.dtype == torch.float32
        for cls in (LSTMLoop, GRULoop):
            torch.manual_seed(0)
            model, x = cls(), torch.randn(1, 4, 8)
            with rewrite_rnns(model):
                want = _autocast_step(model, x, True)[0]
            cm = autopar.compile(cls(), store=ProfileStore.memory(), race=False, adapt=False)
            cm.load_state_dict(model.state_dict())
            got = _autocast_step(cm, x, True)[0]
            assert want.dtype == got.dtype == torch.bfloat16
            assert not autopar.explain(cm).fallbacks
            torch.testing.assert_close(got, want, atol=2e-2, rtol=2e-2)
    finally:
        lib._destroy()
