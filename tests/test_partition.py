"""Partitioners: never worse than serial, never better than the bound, near-optimal on
small DAGs (brute force), stage DP, memory budget, syncs, big-graph planning."""

from __future__ import annotations

import itertools
import math
import random
import time

import networkx as nx
import numpy as np
import pandas as pd
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from autopar.errors import PlanError
from autopar.planning.costmodel import MachineModel, thread_layouts, transfer_time
from autopar.planning.partition import make_plan, minimal_syncs
from autopar.planning.plan import Plan, Stream
from autopar.planning.policies import POLICIES, chain_cover, stage_partition
from autopar.planning.simulate import simulate
from autopar.planning.taskgraph import (
    chain_graph,
    fork_join_graph,
    random_dag,
    synthetic_task_graph,
    task_graph_from_profile,
)
from autopar.planning.verify import verify_plan

M = MachineModel.default_cpu()
TWO = [Stream(0, "cpu", 1), Stream(1, "cpu", 1)]
EPS = 1e-12


def brute_force(g: nx.DiGraph, streams, machine=M) -> float:
    """Best simulated makespan over every assignment of nodes to streams and every
    order of each stream consistent with the dependencies (deadlocking ones skipped)."""
    closure = nx.transitive_closure_dag(g)
    nodes = list(nx.topological_sort(g))
    best = math.inf
    for assign in itertools.product(range(len(streams)), repeat=len(nodes)):
        if assign[0] != 0:  # identical streams: fix the first node's stream
            continue
        groups = [[n for n, a in zip(nodes, assign, strict=True) if a == s] for s in range(2)]
        place = dict(zip(nodes, assign, strict=True))
        seqs = [list(nx.all_topological_sorts(closure.subgraph(grp))) for grp in groups]
        for combo in itertools.product(*seqs):
            try:
                r = simulate(g, place, [n for seq in combo for n in seq], streams, machine)
            except PlanError:
                continue
            best = min(best, r.makespan)
    return best


def test_brute_force_within_1_25x():
    worst = {"auto": 1.0, "heft": 1.0}
    for seed in range(12):
        rng = random.Random(seed)
        g = random_dag(rng.randint(3, 8), rng.uniform(0.3, 0.6), seed=seed)
        opt = brute_force(g, TWO)
        for policy in worst:
            p = make_plan(g, streams=TWO, policy=policy, machine=M)
            assert p.predicted_step_time >= opt - EPS
            worst[policy] = max(worst[policy], p.predicted_step_time / opt)
    print(f"worst ratio to the brute-force optimum: {worst}")
    assert worst["auto"] <= 1.25 and worst["heft"] <= 1.25


@pytest.mark.parametrize("branches", [[[1e-3, 2e-3], [3e-3]], [[1e-3], [1e-3], [2e-3]]])
def test_exact_on_fork_join(branches):
    g = fork_join_graph(branches)
    p = make_plan(g, streams=TWO, machine=M)
    assert p.predicted_step_time == pytest.approx(brute_force(g, TWO), rel=1e-9)


def test_exact_on_chains():
    for speedup in (1.0, 1.9):
        g = chain_graph([1e-3, 2e-4, 3e-3, 5e-5], speedup=speedup)
        p = make_plan(g, machine=M)
        assert p.predicted_step_time == pytest.approx(p.lower_bound, rel=1e-9)
        assert len(p.streams) == 1 and p.syncs == ()


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    n=st.integers(1, 16),
    p=st.floats(0.0, 0.7),
    seed=st.integers(0, 10_000),
    policy=st.sampled_from(["auto", "serial", "round_robin", "heft", "nimble"]),
)
def test_plans_are_valid_bounded_and_never_worse_than_serial(n, p, seed, policy):
    g = random_dag(n, p, seed=seed)
    plan = make_plan(g, policy=policy, machine=M)
    verify_plan(plan, g)  # every node once, every dependency synchronised, acyclic
    assert plan.predicted_step_time >= plan.lower_bound - EPS
    if policy == "auto":
        assert plan.predicted_step_time <= plan.serial_time + EPS
    pos = {x: i for i, x in enumerate(plan.order)}
    assert all(pos[u] < pos[v] for u, v in g.edges())
    times = {x: (a, b) for x, a, b, _ in plan.timeline}
    assert all(times[v][0] >= times[u][1] - EPS for u, v in g.edges())


def test_every_policy_and_layout_names():
    g = fork_join_graph([[1e-3] * 3, [1e-3] * 3])
    assert [n for n, _ in thread_layouts(MachineModel.default_cpu(cores=4))][-1] == "2x2"
    for policy in ("serial", "round_robin", "heft", "nimble"):
        p = make_plan(g, policy=policy, machine=M)
        assert p.policy == policy
    with pytest.raises(PlanError, match="unknown policy"):
        make_plan(g, policy="magic", machine=M)
    with pytest.raises(PlanError, match="stages"):
        make_plan(g, policy="stages", machine=M)  # needs two devices
    p2 = make_plan(g, streams=2, machine=M)
    assert p2.predicted_step_time < p2.serial_time and len(p2.streams) == 2
    p1 = make_plan(g, streams=1, machine=M)
    assert len(p1.streams) == 1 and p1.streams[0].threads == M.cores
    assert "intra-op" in " ".join(p2.notes)
    assert any(k.startswith("pass:heft") for k, _ in p2.provenance)


def test_chain_cover_is_minimum_on_small_graphs():
    g = fork_join_graph([[1.0] * 2, [1.0] * 3, [1.0]])
    chains = chain_cover(g)
    assert len(chains) == 3  # the width of the DAG (Dilworth)
    assert sorted(n for c in chains for n in c) == sorted(g)
    reach = nx.transitive_closure_dag(g)
    for c in chains:
        assert all(reach.has_edge(a, b) for a, b in zip(c, c[1:], strict=False))


def test_minimal_syncs_drop_implied_ones():
    # n0 (stream 0) -> n1, n2 (stream 1), n1 -> n2: the edge n0 -> n2 is implied by the
    # n0 -> n1 sync plus stream 1's order n1, n2, so only one sync is needed.
    g = chain_graph([1.0, 1.0])
    g.add_edge("g0.fw/n0", "g0.fw/n2", bytes=8)
    g.add_node("g0.fw/n2", **dict(g.nodes["g0.fw/n1"]))
    g.add_edge("g0.fw/n1", "g0.fw/n2", bytes=8)
    place = {"g0.fw/n0": 0, "g0.fw/n1": 1, "g0.fw/n2": 1}
    syncs = minimal_syncs(g, place, ["g0.fw/n0", "g0.fw/n1", "g0.fw/n2"], TWO)
    assert [(s.src, s.dst) for s in syncs] == [("g0.fw/n0", "g0.fw/n1")]
    cross = [Stream(0, "cpu", 1), Stream(1, "cuda:0", 0)]
    syncs = minimal_syncs(g, place, ["g0.fw/n0", "g0.fw/n1", "g0.fw/n2"], cross)
    assert len(syncs) == 2  # cross-device: each edge is a copy, none dropped


def _brute_stages(c, cut, mem, k, budget, lat, bw):
    n, best, arg = len(c), math.inf, None
    for s in range(k):
        for cuts in itertools.combinations(range(1, n), s):
            bounds = [0, *cuts, n]
            worst = 0.0
            for a, b in itertools.pairwise(bounds):
                if budget is not None and sum(mem[a:b]) > budget:
                    worst = math.inf
                    break
                tr = (lat + cut[b - 1] / bw) if b < n and cut[b - 1] > 0 else 0.0
                worst = max(worst, sum(c[a:b]) + tr)
            if worst < best:
                best, arg = worst, bounds[:-1]
    return best, arg


@settings(max_examples=60, deadline=None)
@given(
    n=st.integers(1, 9),
    k=st.integers(1, 4),
    seed=st.integers(0, 10_000),
    with_budget=st.booleans(),
)
def test_stage_dp_equals_brute_force(n, k, seed, with_budget):
    rng = np.random.default_rng(seed)
    c = rng.uniform(0, 1, n)
    cut = rng.integers(0, 3, n - 1) * 1e6
    mem = rng.integers(1, 10, n)
    budget = int(rng.integers(5, 30)) if with_budget else None
    lat, bw = 0.01, 1e7
    want, _ = _brute_stages(list(c), list(cut), list(mem), k, budget, lat, bw)
    if math.isinf(want):
        with pytest.raises(PlanError, match="memory_budget"):
            stage_partition(c, cut, mem, k, memory_budget=budget, latency_s=lat, bandwidth_Bps=bw)
        return
    starts, got = stage_partition(
        c, cut, mem, k, memory_budget=budget, latency_s=lat, bandwidth_Bps=bw
    )
    assert got == pytest.approx(want, rel=1e-9, abs=1e-12)
    assert starts[0] == 0 and len(starts) <= k


def test_stages_policy_splits_across_devices():
    g = chain_graph([1e-3] * 6, edge_bytes=1 << 10)
    for n in g:
        g.nodes[n]["output_bytes"] = 100
    streams = [Stream(0, "cuda:0", 0), Stream(1, "cuda:1", 0)]
    p = make_plan(g, streams=streams, policy="stages", machine=M, memory_budget=600)
    assert p.policy == "stages"
    verify_plan(p, g)
    with pytest.raises(PlanError, match="memory_budget"):
        make_plan(g, streams=streams, policy="stages", machine=M, memory_budget=250)
    assert transfer_time(1 << 10, M) > 0


def test_memory_budget_trades_concurrency_for_memory():
    g = fork_join_graph([[1e-3] * 3, [1e-3] * 3], edge_bytes=8)
    for n in g:  # big intermediates, tiny branch results: concurrency keeps 2x alive
        tail = any(s.endswith("n7") for s in g.succ[n]) or n.endswith(("n0", "n7"))
        g.nodes[n]["output_bytes"] = 1 if tail else 1000
    fast = make_plan(g, machine=M)
    serial = make_plan(g, policy="serial", machine=M)
    assert fast.predicted_peak_memory > serial.predicted_peak_memory
    tight = make_plan(g, machine=M, memory_budget=serial.predicted_peak_memory)
    assert tight.predicted_peak_memory <= serial.predicted_peak_memory
    assert any("budget" in n for n in tight.notes)
    with pytest.raises(PlanError, match=r"memory_budget=100 bytes.*serial plan needs \d+"):
        make_plan(g, machine=M, memory_budget=100)


def _profile_df():
    rows = []
    for tag, phase in (("g0.fw", "forward"), ("g0.bw", "backward")):
        for i in range(6):
            inputs = [] if i == 0 else (["n0"] if i < 5 else ["n1", "n2", "n3", "n4"])
            rows.append(
                dict(
                    graph=tag, phase=phase, node=f"n{i}", key=f"{tag}/n{i}",
                    op="placeholder" if i == 0 else "call_function",
                    target="aten.mm.default", time_s=1e-3, time_1t_s=1.05e-3, threads=2,
                    flops=0, bytes_read=0, bytes_written=64, output_bytes=64, is_view=False,
                    inputs=inputs, input_bytes=[64] * len(inputs),
                )
            )  # fmt: skip
    return pd.DataFrame(rows)


def test_plan_from_profile_table_combines_forward_and_backward():
    df = _profile_df()
    p = make_plan(df, machine=M, graph_id="model")
    g = task_graph_from_profile(df)
    verify_plan(p, g)
    assert p.graph_id == "model" and len(p.order) == 12
    assert p.order[0].startswith("g0.fw") and p.order[-1].startswith("g0.bw")
    fw_end = max(f for n, _, f, _ in p.timeline if n.startswith("g0.fw"))
    bw_start = min(s for n, s, _, _ in p.timeline if n.startswith("g0.bw"))
    assert bw_start >= fw_end - EPS
    assert Plan.from_json(p.to_json()) == p
    assert p.predicted_step_time <= p.serial_time + EPS


def test_5000_node_graph_plans():
    g = synthetic_task_graph(5000, seed=1)
    t0 = time.perf_counter()
    p = make_plan(g, machine=M)
    dt = time.perf_counter() - t0
    print(f"\nplanned 5000 nodes in {dt:.2f} s: {p!r}")
    assert len(p.order) == 5000 and p.predicted_step_time <= p.serial_time
    assert set(POLICIES) >= {p.policy}
