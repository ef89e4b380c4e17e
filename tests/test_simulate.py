"""Simulator: timing rules, contention, memory liveness, lower bound, invariants."""

from __future__ import annotations

import random

import networkx as nx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from autopar.errors import PlanError
from autopar.planning.costmodel import MachineModel, transfer_time
from autopar.planning.plan import Stream
from autopar.planning.simulate import critical_path, lower_bound, peak_memory, simulate
from autopar.planning.taskgraph import chain_graph, fork_join_graph, make_node_attrs, random_dag

M = MachineModel.default_cpu()
ONE = [Stream(0, "cpu", 1)]
TWO = [Stream(0, "cpu", 1), Stream(1, "cpu", 1)]


def test_chain_on_one_stream_is_the_sum_of_costs():
    g = chain_graph([1e-3, 2e-3, 3e-3])
    order = list(g)
    r = simulate(g, dict.fromkeys(order, 0), order, ONE, M)
    assert r.makespan == pytest.approx(6e-3)
    assert r.busy == {0: pytest.approx(6e-3)}
    assert [x[0] for x in r.timeline()] == order


def test_cross_stream_edge_pays_a_sync():
    g = chain_graph([1e-3, 1e-3])
    order = list(g)
    r = simulate(g, {order[0]: 0, order[1]: 1}, order, TWO, M)
    assert r.start[order[1]] == pytest.approx(1e-3 + M.sync_cost_s)


def test_cross_device_edge_pays_sync_and_transfer():
    g = chain_graph([1e-3, 1e-3], edge_bytes=1 << 20)
    order = list(g)
    streams = [Stream(0, "cpu", 1), Stream(1, "cuda:0", 0)]
    r = simulate(g, {order[0]: 0, order[1]: 1}, order, streams, M)
    expected = 1e-3 + M.sync_cost_s + transfer_time(1 << 20, M)
    assert r.start[order[1]] == pytest.approx(expected)


def test_fork_join_runs_branches_concurrently():
    g = fork_join_graph([[1e-3, 1e-3], [1e-3, 1e-3]])
    order = list(nx.topological_sort(g))
    place = {n: 0 for n in order}
    place.update({"g0.fw/n3": 1, "g0.fw/n4": 1})  # second branch on stream 1
    r = simulate(g, place, order, TWO, M)
    assert r.makespan == pytest.approx(2e-3 + 2 * M.sync_cost_s)
    assert sum(r.finish[n] > r.start[n] for n in order) == 4  # source and sink cost nothing


def test_memory_liveness_and_views():
    g = chain_graph([1.0, 1.0, 1.0])  # each output 4096 bytes
    finish = {"g0.fw/n0": 1.0, "g0.fw/n1": 2.0, "g0.fw/n2": 3.0}
    assert peak_memory(g, finish) == 8192  # n0's output lives until n1 finishes
    g.nodes["g0.fw/n1"]["is_view"] = True
    assert peak_memory(g, finish) == 4096  # a view adds nothing


def test_deadlocking_order_raises():
    g = chain_graph([1e-3, 1e-3])
    order = list(g)
    with pytest.raises(PlanError, match="deadlocks"):
        simulate(g, {order[0]: 0, order[1]: 0}, order[::-1], ONE, M)
    with pytest.raises(PlanError, match="unplaced"):
        simulate(g, {order[0]: 0}, order, ONE, M)


def test_lower_bound_counts_work_and_critical_path():
    g = fork_join_graph([[1.0], [1.0], [1.0], [1.0]])
    assert lower_bound(g, TWO, M) == pytest.approx(2.0)  # 4 s of work / 2 cores
    assert lower_bound(g, ONE, M) == pytest.approx(4.0)
    chain = chain_graph([1.0, 1.0])
    assert lower_bound(chain, TWO, M) == pytest.approx(2.0)  # critical path
    # a 2-thread stream: node takes 0.5 s but uses 2 cores -> work 1 core-second each
    fast = chain_graph([1.0, 1.0], speedup=2.0)
    assert lower_bound(fast, [Stream(0, "cpu", 2)], M) == pytest.approx(1.0)
    assert critical_path(fast, {n: 0.5 for n in fast}) == pytest.approx(1.0)


def _random_schedule(g, n_streams, seed):
    rng = random.Random(seed)
    order = list(nx.topological_sort(g))
    place = {n: rng.randrange(n_streams) for n in order}
    return place, order


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    n=st.integers(1, 14),
    p=st.floats(0.0, 0.6),
    seed=st.integers(0, 10_000),
    threads=st.sampled_from([(1, 1), (2, 1), (2, 2), (1, 1, 1)]),
)
def test_simulation_respects_dependencies_streams_and_bound(n, p, seed, threads):
    g = random_dag(n, p, seed=seed)
    streams = [Stream(i, "cpu", k) for i, k in enumerate(threads)]
    place, order = _random_schedule(g, len(streams), seed)
    r = simulate(g, place, order, streams, M)
    for u, v in g.edges():
        gap = M.sync_cost_s if place[u] != place[v] else 0.0
        assert r.start[v] >= r.finish[u] + gap - 1e-12
    for sid in range(len(streams)):
        mine = [x for x in order if place[x] == sid]
        for a, b in zip(mine, mine[1:], strict=False):
            assert r.start[b] >= r.finish[a] - 1e-12
    for x in order:  # contention can only slow a node down
        assert r.finish[x] - r.start[x] >= r.cost[x] - 1e-12
    assert r.makespan >= lower_bound(g, streams, M) - 1e-12
    assert r.peak_memory >= max((g.nodes[x]["output_bytes"] for x in g), default=0)


def test_zero_node_graph():
    g = nx.DiGraph()
    g.add_node("g0.fw/x", **make_node_attrs(0.0, op="placeholder"))
    r = simulate(g, {"g0.fw/x": 0}, ["g0.fw/x"], ONE, M)
    assert r.makespan == 0.0


def test_gil_serialises_python_dispatch_of_concurrent_streams():
    """Two independent chains of ops: without a GIL share they overlap fully; when every
    op is all dispatch (gil_s >= cost) the streams gain nothing over one stream."""
    import dataclasses

    from autopar.planning.taskgraph import fork_join_graph

    g = fork_join_graph([[1e-3] * 4, [1e-3] * 4])
    order = list(nx.topological_sort(g))
    second = {f"g0.fw/n{i}" for i in range(5, 9)}  # the second branch
    place = {n: (1 if n in second else 0) for n in order}
    streams = [Stream(0, "cpu", 1), Stream(1, "cpu", 1)]
    m0 = dataclasses.replace(MachineModel.default_cpu(), sync_cost_s=0.0)
    free = simulate(g, place, order, streams, m0).makespan
    locked = simulate(g, place, order, streams, dataclasses.replace(m0, gil_s=1.0)).makespan
    half = simulate(g, place, order, streams, dataclasses.replace(m0, gil_s=0.5e-3)).makespan
    assert free == pytest.approx(4e-3)
    assert locked == pytest.approx(8e-3)
    assert free < half < locked
    one_stream = simulate(g, dict.fromkeys(order, 0), order, streams[:1], m0).makespan
    assert one_stream == pytest.approx(8e-3)
