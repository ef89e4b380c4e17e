"""planning.policies: one registry of partitioners; planning.listsched: the one list scheduler,
shared by the heft policy and callers that model their own graphs (rnn.choice)."""

from __future__ import annotations

import pytest

from autopar.errors import PlanError
from autopar.planning import policies
from autopar.planning.costmodel import MachineModel
from autopar.planning.listsched import list_schedule
from autopar.planning.partition import make_plan
from autopar.planning.plan import Stream
from autopar.planning.taskgraph import fork_join_graph, random_dag
from autopar.planning.verify import verify_plan

M = MachineModel.default_cpu()
TWO = [Stream(0, "cpu", 1), Stream(1, "cpu", 1)]


def test_names_come_from_the_table():
    assert policies.POLICY_NAMES == ("auto", *policies.POLICIES)
    # what autopar.compile, `autopar plan` and `autopar bench` offer (one device)
    single = ("auto", "serial", "round_robin", "heft", "nimble")
    assert policies.SINGLE_DEVICE_POLICY_NAMES == single
    assert [n for n, p in policies.POLICIES.items() if p.multi_device] == ["stages"]


def test_a_new_policy_is_one_function_and_one_entry(monkeypatch):
    def reversed_rr(graph, streams, machine, costs, order, *, prep=None, **_):
        return {n: streams[-1 - i % len(streams)].id for i, n in enumerate(order)}, order

    monkeypatch.setitem(policies.POLICIES, "reversed_rr", policies.Policy(reversed_rr))
    g = fork_join_graph([[1e-3] * 3, [1e-3] * 3])
    p = make_plan(g, policy="reversed_rr", streams=TWO, machine=M)
    assert p.policy == "reversed_rr"
    verify_plan(p, g)
    auto = make_plan(g, streams=TWO, machine=M)
    assert any(k.startswith("pass:reversed_rr") for k, _ in auto.provenance)
    with pytest.raises(PlanError, match="unknown policy"):
        make_plan(g, policy="nope", machine=M)


@pytest.mark.parametrize("seed", range(8))
def test_heft_plan_is_the_list_schedule(seed):
    g = random_dag(12, 0.3, seed=seed)
    plan = make_plan(g, policy="heft", streams=TWO, machine=M)
    assert plan.predicted_step_time == list_schedule(g, TWO, M).makespan
