"""Plan inspection: table, graph, Gantt chart, summary, JSON round trip, combine."""

from __future__ import annotations

import networkx as nx
import pandas as pd

from autopar.planning.costmodel import MachineModel
from autopar.planning.partition import make_plan
from autopar.planning.plan import Plan
from autopar.planning.report import COLUMNS, plan_dataframe, plan_gantt, plan_networkx, plan_summary
from autopar.planning.taskgraph import fork_join_graph
from autopar.planning.verify import verify_plan

M = MachineModel.default_cpu()


def _fw_bw_plan() -> Plan:
    fw = fork_join_graph([[1e-3] * 3, [1e-3] * 3])
    bw = fork_join_graph([[2e-3] * 2, [2e-3] * 2])
    for n in bw:
        bw.nodes[n].update(phase="backward", graph="g0.bw")
    bw = nx.relabel_nodes(bw, {n: n.replace("g0.fw", "g0.bw") for n in bw})
    g = nx.union(fw, bw)
    plan = make_plan(g, machine=M, graph_id="model")
    verify_plan(plan, g)
    return plan


def test_dataframe_networkx_summary():
    p = _fw_bw_plan()
    df = plan_dataframe(p)
    assert list(df.columns) == COLUMNS and len(df) == len(p.order)
    assert set(df["phase"]) == {"forward", "backward"}
    assert (df["finish"] >= df["start"]).all()
    assert p.to_dataframe().equals(df)
    g = plan_networkx(p)
    assert g.number_of_nodes() == len(p.order)
    assert all(g.edges[s.src, s.dst]["sync"] for s in p.syncs)
    assert g.nodes[p.order[0]]["stream"] == p.placement[p.order[0]]
    text = plan_summary(p)
    assert "policy=" in text and "lower bound" in text and "util" in text
    assert p.summary() == text


def test_gantt_png(tmp_path):
    p = _fw_bw_plan()
    path = plan_gantt(p, str(tmp_path / "plan.png"), title="fw+bw")
    with open(path, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    assert p.gantt(str(tmp_path / "p2.png")).endswith("p2.png")


def test_json_round_trip_and_combine():
    p = _fw_bw_plan()
    assert Plan.from_json(p.to_json()) == p
    assert p.plan_hash == Plan.from_json(p.to_json()).plan_hash
    # combine re-offsets timelines: backward starts after the forward ends
    df = plan_dataframe(p)
    fw_end = df[df.phase == "forward"]["finish"].max()
    assert df[df.phase == "backward"]["start"].min() >= fw_end - 1e-12
    assert p.predicted_step_time >= p.lower_bound
    assert isinstance(df, pd.DataFrame)
