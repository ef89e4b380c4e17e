"""The verifier rejects every kind of bad plan with a precise message."""

from __future__ import annotations

import pytest

from autopar.errors import PlanError
from autopar.planning.costmodel import MachineModel
from autopar.planning.partition import make_plan
from autopar.planning.plan import Plan, Stream, Sync
from autopar.planning.taskgraph import chain_graph, fork_join_graph
from autopar.planning.verify import verify_plan

M = MachineModel.default_cpu()
S2 = (Stream(0, "cpu", 1), Stream(1, "cpu", 1))


def _plan(**kw) -> Plan:
    """a -> b -> c with b on stream 1."""
    base = dict(
        graph_id="t",
        policy="test",
        streams=S2,
        placements=(("a", 0), ("b", 1), ("c", 0)),
        order=("a", "b", "c"),
        syncs=(Sync("a", "b", 0, 1, 8), Sync("b", "c", 1, 0, 8)),
        edges=(("a", "b", 8), ("b", "c", 8)),
    )
    base.update(kw)
    return Plan(**base)


def test_good_plan_passes():
    verify_plan(_plan())


def test_made_plans_pass_with_their_graph():
    g = fork_join_graph([[1e-3] * 3, [1e-3] * 2, [2e-3]])
    for policy in ("serial", "round_robin", "heft", "nimble", "auto"):
        verify_plan(make_plan(g, policy=policy, machine=M), g)


def test_missing_node():
    g = chain_graph([1.0, 1.0])
    p = make_plan(g, policy="serial", machine=M)
    bad = p.replace(placements=p.placements[:1], order=p.order[:1], syncs=())
    with pytest.raises(PlanError, match=r"does not place node\(s\) \['g0.fw/n1'\]"):
        verify_plan(bad, g)
    with pytest.raises(PlanError, match="absent from the graph"):
        verify_plan(p, chain_graph([1.0]))


def test_duplicates():
    with pytest.raises(PlanError, match=r"places node\(s\) \['a'\] more than once"):
        verify_plan(_plan(placements=(("a", 0), ("a", 1), ("b", 1), ("c", 0))))
    with pytest.raises(PlanError, match="more than once in order"):
        verify_plan(_plan(order=("a", "b", "b", "c")))
    with pytest.raises(PlanError, match="out of order"):
        verify_plan(_plan(order=("a", "b")))
    with pytest.raises(PlanError, match="stream id"):
        verify_plan(_plan(streams=(Stream(0), Stream(0), Stream(1))))
    with pytest.raises(PlanError, match="undeclared stream"):
        verify_plan(_plan(placements=(("a", 0), ("b", 7), ("c", 0))))


def test_missing_sync():
    with pytest.raises(PlanError, match=r"misses a sync: c \(stream 0\) reads b \(stream 1\)"):
        verify_plan(_plan(syncs=(Sync("a", "b", 0, 1, 8),)))


def test_sync_implied_by_a_chain_is_accepted():
    # a(0) -> d(1) is implied by a -> b (0 -> 1) and stream 1's order b, d
    p = _plan(
        placements=(("a", 0), ("b", 1), ("c", 0), ("d", 1)),
        order=("a", "b", "c", "d"),
        edges=(("a", "b", 8), ("b", "c", 8), ("a", "d", 8)),
    )
    verify_plan(p)


def test_cross_device_edges_need_their_own_sync():
    streams = (Stream(0, "cpu", 1), Stream(1, "cuda:0", 0))
    p = _plan(
        streams=streams,
        placements=(("a", 0), ("b", 1), ("c", 0), ("d", 1)),
        order=("a", "b", "c", "d"),
        edges=(("a", "b", 8), ("b", "c", 8), ("a", "d", 8)),
    )
    with pytest.raises(PlanError, match="without a sync"):
        verify_plan(p)


def test_wrong_sync_streams():
    with pytest.raises(PlanError, match="re-derive the syncs"):
        verify_plan(_plan(syncs=(Sync("a", "b", 1, 0, 8), Sync("b", "c", 1, 0, 8))))
    with pytest.raises(PlanError, match="within stream"):
        verify_plan(_plan(placements=(("a", 0), ("b", 0), ("c", 0)), syncs=(Sync("a", "b", 0, 0),)))


def test_cycle_is_a_deadlock():
    # stream 0 runs c before a, but c needs b which needs a
    with pytest.raises(PlanError, match="deadlocks: cycle"):
        verify_plan(_plan(order=("c", "a", "b")))
    # a sync that points backwards in order
    with pytest.raises(PlanError, match="deadlocks|not topological"):
        verify_plan(_plan(syncs=_plan().syncs + (Sync("c", "b", 0, 1),)))


def test_over_budget():
    p = _plan(predicted_peak_memory=1000)
    verify_plan(p, memory_budget=1000)
    with pytest.raises(PlanError, match="1000 bytes at peak, over the budget of 999 bytes"):
        verify_plan(p, memory_budget=999)
    with pytest.raises(PlanError, match="over the budget"):
        verify_plan(p.replace(memory_budget=10))
