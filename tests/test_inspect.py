"""Plan inspection: table, graph, Gantt chart, Chrome trace, summary, JSON round trip,
combine."""

from __future__ import annotations

import json

import networkx as nx
import pandas as pd
import pytest
from matplotlib.figure import Figure

from autopar.planning.costmodel import MachineModel
from autopar.planning.partition import make_plan
from autopar.planning.plan import Plan, Stream
from autopar.planning.report import (
    COLUMNS,
    plan_chrome_trace,
    plan_dataframe,
    plan_gantt,
    plan_networkx,
    plan_summary,
    timeline_panels,
)
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


def test_gantt_png_keeps_the_path_signature(tmp_path):
    p = _fw_bw_plan()
    path = plan_gantt(p, str(tmp_path / "plan.png"), title="fw+bw")
    with open(path, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    assert p.gantt(str(tmp_path / "p2.png")).endswith("p2.png")
    assert p.gantt(str(tmp_path / "p3.svg"), title="mlp") == str(tmp_path / "p3.svg")
    assert "<svg" in (tmp_path / "p3.svg").read_text()[:500]


def _timed(p: Plan, graph: str) -> list[str]:
    return [n for n, a, b, _ in p.timeline if b > a and n.startswith(graph + "/")]


def test_gantt_figure_has_a_panel_per_phase_and_a_box_per_operator():
    p = _fw_bw_plan()
    fig = p.gantt(title="toy model")
    assert isinstance(fig, Figure)
    fw_ax, bw_ax = fig.axes  # one panel per graph: forward above backward
    assert "forward" in fw_ax.get_title(loc="left") and "g0.fw" in fw_ax.get_title(loc="left")
    assert "backward" in bw_ax.get_title(loc="left")
    for ax, graph in ((fw_ax, "g0.fw"), (bw_ax, "g0.bw")):
        assert len(ax.patches) == len(_timed(p, graph)) > 0
        assert all(patch.get_edgecolor()[3] > 0 for patch in ax.patches)  # bordered boxes
        assert ax.texts  # the toy's short names fit in their boxes
        assert ax.get_legend() is None
    title = fig.get_suptitle()
    assert "toy model" in title and p.graph_id in title and p.policy in title
    (legend,) = fig.legends
    fig.canvas.draw()
    right = max(ax.get_window_extent().x1 for ax in fig.axes)
    assert legend.get_window_extent().x0 >= right  # outside the plot, covering no box


def test_gantt_streams_are_per_graph():
    """fw on two 1-thread streams, bw on one 2-thread stream: combined, the plan holds three
    streams, but each panel shows only its own graph's."""
    fw = fork_join_graph([[1e-3] * 3, [1e-3] * 3])
    bw = fork_join_graph([[2e-3] * 2, [2e-3] * 2])
    for n in bw:
        bw.nodes[n].update(phase="backward", graph="g0.bw")
    bw = nx.relabel_nodes(bw, {n: n.replace("g0.fw", "g0.bw") for n in bw})
    a = make_plan(fw, machine=M, streams=[Stream(0, "cpu", 1), Stream(1, "cpu", 1)],
                  policy="round_robin", graph_id="g0.fw")  # fmt: skip
    b = make_plan(bw, machine=M, streams=[Stream(0, "cpu", 2)], graph_id="g0.bw")
    p = Plan.combine([a, b])
    assert len(p.streams) == 3
    fw_panel, bw_panel = timeline_panels(p)
    assert len(fw_panel.streams) == 2 and len(bw_panel.streams) == 1
    fw_ax, bw_ax = p.gantt().axes
    assert len(fw_ax.get_yticks()) == 2 and len(bw_ax.get_yticks()) == 1
    assert "2 streams" in fw_ax.get_title(loc="left")
    assert "1 stream," in bw_ax.get_title(loc="left")


def test_chrome_trace_matches_the_predicted_schedule(tmp_path):
    p = _fw_bw_plan()
    path = tmp_path / "plan.trace.json"
    trace = p.to_chrome_trace(str(path))
    assert json.loads(path.read_text()) == trace  # the file holds the very dict returned
    assert json.loads(json.dumps(trace, allow_nan=False)) == trace  # strict JSON
    assert trace == plan_chrome_trace(p)
    xs = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    timed = {n: (a, b) for n, a, b, _ in p.timeline if b > a}
    assert sorted(e["args"]["node"] for e in xs) == sorted(timed)  # one event per operator
    place = p.placement
    for e in xs:
        assert set(e) >= {"name", "ph", "ts", "dur", "pid", "tid", "args"}
        start, finish = timed[e["args"]["node"]]
        assert e["ts"] == pytest.approx(start * 1e6)
        assert e["dur"] == pytest.approx((finish - start) * 1e6)
        assert e["tid"] == place[e["args"]["node"]]
    pids = {e["args"]["graph"]: e["pid"] for e in xs}
    assert set(pids) == {"g0.fw", "g0.bw"} and len(set(pids.values())) == 2
    names = {e["pid"]: e["args"]["name"] for e in trace["traceEvents"]
             if e["ph"] == "M" and e["name"] == "process_name"}  # fmt: skip
    assert "forward" in names[pids["g0.fw"]] and "backward" in names[pids["g0.bw"]]
    flows = [e for e in trace["traceEvents"] if e["ph"] in ("s", "f")]
    assert len(flows) % 2 == 0 and len(flows) <= 2 * len(p.syncs)


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
