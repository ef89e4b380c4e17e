"""Cost model: Amdahl fit, intra-op vs concurrency decisions, communication, calibration."""

from __future__ import annotations

import math
import time

import networkx as nx
import pytest

from autopar.planning.costmodel import (
    CONTEXT_OP_S,
    MachineModel,
    calibrate,
    calibration_name,
    context_s,
    node_time,
    node_times,
    op_time,
    parallel_efficiency,
    serial_fraction,
    sync_time,
    transfer_time,
    wants_intra_op,
)
from autopar.planning.partition import make_plan
from autopar.planning.plan import Stream
from autopar.planning.simulate import OVERSUBSCRIBED_TEAM_RATE, simulate
from autopar.planning.taskgraph import make_node_attrs

M = MachineModel.default_cpu()


def test_amdahl_fit_reproduces_both_measurements():
    for t1, tT, T in [(1.0, 0.55, 2), (2e-3, 7e-4, 4), (1e-5, 1.2e-5, 2)]:
        assert op_time(t1, tT, T, 1) == pytest.approx(t1)
        assert op_time(t1, tT, T, T) == pytest.approx(tT)


def test_serial_fraction_edges():
    assert serial_fraction(1.0, 0.5, 2) == 0.0  # perfect scaling
    assert serial_fraction(1.0, 1.0, 2) == 1.0  # no scaling
    assert serial_fraction(1.0, 0.4, 2) == 0.0  # super-linear noise is clamped
    assert serial_fraction(1.0, 1.2, 2) > 1.0  # threads made it slower: kept
    assert serial_fraction(1.0, 0.5, 1) == 1.0  # no information
    assert parallel_efficiency(1.0, 0.5, 2, 2) == pytest.approx(1.0)
    assert parallel_efficiency(1.0, 1.0, 2, 2) == pytest.approx(0.5)


# Fake measurements (2-core machine): a small 64x64 matmul gains nothing from a second
# thread; a 1024x1024 GEMM runs 1.9x faster on 2 threads.
SMALL = make_node_attrs(30e-6, 29e-6, 2, flops=2 * 64**3, target="aten.mm.default")
LARGE = make_node_attrs(20e-3, 20e-3 / 1.9, 2, flops=2 * 1024**3, target="aten.mm.default")


def test_wants_intra_op_decisions():
    assert wants_intra_op(LARGE, M)
    assert not wants_intra_op(SMALL, M)
    assert not wants_intra_op(make_node_attrs(0.0, op="placeholder"), M)
    assert not wants_intra_op(LARGE, MachineModel.default_cpu(cores=1))


def _two_chains(attrs, length=10):
    g = nx.DiGraph()
    for c in range(2):
        for i in range(length):
            g.add_node(f"g0.fw/c{c}_{i}", **attrs)
            if i:
                g.add_edge(f"g0.fw/c{c}_{i - 1}", f"g0.fw/c{c}_{i}", bytes=4096)
    return g


def _layout_times(g):
    """Step time of (1 stream x 2 threads, serial) and (2 streams x 1 thread, one chain
    each)."""
    order = list(nx.topological_sort(g))
    serial = simulate(g, dict.fromkeys(order, 0), order, [Stream(0, "cpu", 2)], M)
    split = {n: int(n.split("/c")[1][0]) for n in order}
    conc = simulate(g, split, order, [Stream(0, "cpu", 1), Stream(1, "cpu", 1)], M)
    return serial.makespan, conc.makespan


def test_small_matmul_chains_run_about_2x_faster_concurrently():
    serial, concurrent = _layout_times(_two_chains(SMALL))
    assert 1.8 < serial / concurrent < 2.1
    plan = make_plan(_two_chains(SMALL), machine=M)
    assert len(plan.streams) == 2 and all(s.threads == 1 for s in plan.streams)


def test_large_gemm_gains_little_from_concurrency():
    serial, concurrent = _layout_times(_two_chains(LARGE))
    assert serial / concurrent < 1.1  # 1.9x from threads already; concurrency adds ~5%


def test_contention_slows_oversubscribed_streams():
    g = _two_chains(LARGE, length=1)
    order = list(g)
    place = {n: i for i, n in enumerate(order)}
    two_by_two = simulate(g, place, order, [Stream(0, "cpu", 2), Stream(1, "cpu", 2)], M)
    # both GEMMs at 2 threads on 2 cores: 4 threads share 2 cores (half speed each), and an
    # oversubscribed OpenMP team loses more at its barriers (OVERSUBSCRIBED_TEAM_RATE)
    slowdown = 2 / OVERSUBSCRIBED_TEAM_RATE
    assert two_by_two.makespan == pytest.approx(slowdown * node_time(LARGE, 2, M))
    one_by_one = simulate(g, place, order, [Stream(0, "cpu", 1), Stream(1, "cpu", 1)], M)
    assert one_by_one.makespan < two_by_two.makespan  # 2 threads on 2 cores: no contention


def test_roofline_estimate_when_time_is_missing():
    attrs = {"op": "call_function", "flops": 2 * 1024**3, "bytes_read": 8 << 20}
    t1, tT, T = node_times(attrs, M)
    assert T == M.cores and t1 > tT > 0
    assert t1 == pytest.approx(M.dispatch_s + 2 * 1024**3 / M.peak_flops_1t)
    assert wants_intra_op(attrs, M)
    elementwise = {"op": "call_function", "flops": 0, "bytes_read": 4096, "bytes_written": 4096}
    assert not wants_intra_op(elementwise, M)
    assert node_times({"op": "output"}, M) == (0.0, 0.0, 1)


def test_communication_formulas():
    assert sync_time(M) == M.sync_cost_s
    assert transfer_time(0, M) == 0.0
    nbytes = 10 << 20
    assert transfer_time(nbytes, M) == pytest.approx(
        M.transfer_latency_s + nbytes / M.transfer_bandwidth_Bps
    )


def test_machine_model_round_trip():
    m = MachineModel(cores=8, sync_cost_s=1e-5, source="x")
    assert MachineModel.from_dict({**m.to_dict(), "unknown": 1}) == m


class FakeStore:
    def __init__(self):
        self.records = {}
        self.puts = 0

    def get_calibration(self, name):
        return self.records.get(name)

    def put_calibration(self, name, record):
        self.puts += 1
        self.records[name] = dict(record)


def test_calibrate_measures_once_then_reads_the_store():
    store = FakeStore()
    t0 = time.perf_counter()
    m = calibrate(store)
    print(f"calibration took {time.perf_counter() - t0:.3f} s: {m}")
    assert m.source == "measured" and store.puts == 1
    assert calibration_name() in store.records
    for v in (m.sync_cost_s, m.dispatch_s, m.transfer_bandwidth_Bps, m.peak_flops_1t):
        assert v > 0 and math.isfinite(v)
    assert m.context_op_s == CONTEXT_OP_S and m.context_bandwidth_Bps == m.mem_bandwidth_Bps
    again = calibrate(store)
    assert again.source == "store" and store.puts == 1
    assert again.sync_cost_s == m.sync_cost_s
    assert calibrate(None).source == "measured"


def test_training_step_context_is_added_to_measured_ops_only():
    """context_s: a measured op pays a per-op cost plus its bytes once from memory; a view
    pays the per-op cost; an unmeasured op (roofline) and a placeholder pay nothing; a
    machine without the constants (synthetic tests) models none of it."""
    m = MachineModel(context_op_s=2e-6, context_bandwidth_Bps=1e9)
    op = {"op": "call_function", "time_1t_s": 1e-3, "time_s": 1e-3, "threads": 1,
          "bytes_read": 4000, "bytes_written": 1000}  # fmt: skip
    assert context_s(op, m) == pytest.approx(2e-6 + 5e-6)
    assert node_time(op, 1, m) == pytest.approx(1e-3 + 7e-6)
    assert context_s({**op, "is_view": True}, m) == pytest.approx(2e-6)
    unmeasured = {**op, "time_s": 0.0, "time_1t_s": 0.0, "flops": 1e6}
    assert context_s(unmeasured, m) == 0.0
    assert context_s({"op": "placeholder"}, m) == 0.0
    assert context_s(op, MachineModel()) == 0.0 and node_time(op, 1, MachineModel()) == 1e-3
