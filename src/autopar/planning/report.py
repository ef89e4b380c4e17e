"""Looking at a Plan: a table, a graph, a Gantt chart, a Chrome trace and a text summary.

These back ``Plan.to_dataframe``, ``Plan.to_networkx``, ``Plan.gantt``,
``Plan.to_chrome_trace`` and ``Plan.summary``.

Example::

    >>> from autopar.planning.plan import Plan, Stream
    >>> p = Plan("g", "serial", (Stream(0, "cpu", 2),), (("a", 0), ("b", 0)), ("a", "b"), (),
    ...          predicted_step_time=2e-3, serial_time=2e-3, lower_bound=2e-3,
    ...          timeline=(("a", 0.0, 1e-3, 1e-3), ("b", 1e-3, 2e-3, 1e-3)))
    >>> list(plan_dataframe(p)["stream"])
    [0, 0]
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import networkx as nx
import pandas as pd

if TYPE_CHECKING:
    from autopar.planning.plan import Plan

#: Bar colours of the Gantt chart, per phase (matplotlib's tab10 blue / orange).
PHASE_COLOURS = {"forward": "#1f77b4", "backward": "#ff7f0e"}
OTHER_COLOUR = "#7f7f7f"

COLUMNS = [
    "node",
    "phase",
    "stream",
    "device",
    "threads",
    "start",
    "finish",
    "cost",
    "flops",
    "bytes",
]


def plan_dataframe(plan: Plan) -> pd.DataFrame:
    """One row per node, in plan order: node, phase, stream, device, threads, start,
    finish, cost (seconds, from the simulator's timeline), flops, bytes (read + written).

    Example: see the module docstring.
    """
    place = plan.placement
    streams = {s.id: s for s in plan.streams}
    info = {n: (ph, fl, by) for n, ph, fl, by in plan.node_info}
    times = {n: (a, b, c) for n, a, b, c in plan.timeline}
    rows = []
    for n in plan.order:
        s = streams[place[n]]
        ph, fl, by = info.get(n, ("", 0, 0))
        st, fi, co = times.get(n, (float("nan"),) * 3)
        rows.append((n, ph, s.id, s.device, s.threads, st, fi, co, fl, by))
    return pd.DataFrame(rows, columns=COLUMNS)


def plan_networkx(plan: Plan) -> nx.DiGraph:
    """The plan as a graph: node attributes are the ``plan_dataframe`` columns; data edges
    have ``bytes`` and ``sync`` (True when a Sync guards it); stream-order edges between
    consecutive nodes of a stream that are not data edges have ``kind="stream"``.

    Example::

        >>> from autopar.planning.plan import Plan, Stream, Sync
        >>> p = Plan("g", "x", (Stream(0), Stream(1)), (("a", 0), ("b", 1)), ("a", "b"),
        ...          (Sync("a", "b", 0, 1, 8),), edges=(("a", "b", 8),))
        >>> plan_networkx(p).edges["a", "b"]["sync"]
        True
    """
    g = nx.DiGraph(graph_id=plan.graph_id, policy=plan.policy)
    df = plan_dataframe(plan)
    for row in df.to_dict("records"):
        g.add_node(row.pop("node"), **row)
    synced = {(s.src, s.dst) for s in plan.syncs}
    for u, v, b in plan.edges:
        g.add_edge(u, v, bytes=b, sync=(u, v) in synced, kind="data")
    for u, v in synced:  # a sync without a listed edge still orders the nodes
        if not g.has_edge(u, v):
            g.add_edge(u, v, bytes=0, sync=True, kind="sync")
    for nodes in plan.stream_nodes().values():
        for u, v in zip(nodes, nodes[1:], strict=False):
            if not g.has_edge(u, v):
                g.add_edge(u, v, bytes=0, sync=False, kind="stream")
    return g


# -- timelines: per-graph panels, a Gantt chart and a Chrome trace ----------------------------
#: Box borders: adjacent operators of one stream stay distinguishable.
EDGE_COLOUR = "#1a1a1a"
LABEL_FONT_PT = 7.0
# Average glyph width of the label font, in units of its size (DejaVu Sans runs ~0.55-0.6).
_CHAR_WIDTH = 0.6
_CHOSE = re.compile(r"^(?P<graph>[^\s:]+): chose (?P<policy>[^\s:]+):")


@dataclass(frozen=True, eq=False)  # rows is a DataFrame: compared by identity
class TimelinePanel:
    """The scheduled part of one graph of a plan (one forward or one backward).

    ``rows`` are that graph's nodes with a positive predicted duration (``plan_dataframe``
    rows plus ``name``, the node name without the ``"<graph>/"`` prefix); ``streams`` are the
    streams its nodes are placed on, so a combined fw+bw plan shows each graph's own streams.
    """

    graph: str
    phase: str
    policy: str
    streams: tuple[int, ...]
    rows: pd.DataFrame

    @property
    def span(self) -> tuple[float, float]:
        """(first start, last finish) in seconds, (0, 0) when nothing is scheduled."""
        if self.rows.empty:
            return 0.0, 0.0
        return float(self.rows["start"].min()), float(self.rows["finish"].max())


def timeline_panels(plan: Plan) -> list[TimelinePanel]:
    """Split a plan into one panel per graph, in plan order (forward before backward).

    A combined plan's node keys are ``"<graph>/<node>"`` (e.g. ``"g0.bw/mm_1"``); nodes without
    a prefix are grouped by phase.

    Example::

        >>> from autopar.planning.plan import Plan, Stream
        >>> p = Plan("g", "serial", (Stream(0),), (("g0.bw/b", 0), ("g0.fw/a", 0)),
        ...          ("g0.fw/a", "g0.bw/b"), (),
        ...          timeline=(("g0.fw/a", 0.0, 1.0, 1.0), ("g0.bw/b", 1.0, 3.0, 2.0)))
        >>> [(t.graph, len(t.rows)) for t in timeline_panels(p)]
        [('g0.fw', 1), ('g0.bw', 1)]
    """
    df = plan_dataframe(plan)
    graphs = [
        n.split("/", 1)[0] if "/" in n else (ph or plan.graph_id)
        for n, ph in zip(df["node"], df["phase"], strict=True)
    ]
    df = df.assign(graph=graphs, name=[n.split("/", 1)[-1] for n in df["node"]])
    chosen = {}  # a combined plan keeps each graph's choice in its notes only
    for note in plan.notes:
        m = _CHOSE.match(note)
        if m:
            chosen[m["graph"]] = m["policy"]
    single = len(set(graphs)) == 1
    panels = []
    for graph in dict.fromkeys(graphs):
        part = df[df["graph"] == graph]
        phases = [p for p in dict.fromkeys(part["phase"]) if p]
        timed = part[part["finish"] > part["start"]]  # NaN compares False: unsimulated nodes
        panels.append(
            TimelinePanel(
                graph=graph,
                phase="+".join(phases) or "other",
                policy=plan.policy if single else chosen.get(graph, ""),
                streams=tuple(sorted({int(s) for s in part["stream"]})),
                rows=timed.reset_index(drop=True),
            )
        )
    return panels


def _stream_label(plan: Plan, sid: int) -> str:
    s = next((s for s in plan.streams if s.id == sid), None)
    if s is None:
        return f"stream {sid}"
    return f"stream {s.id}\n{s.device}, {s.threads or 'default'}t"


def _figure_title(plan: Plan, title: str | None) -> str:
    t, serial = plan.predicted_step_time, plan.serial_time
    text = (
        f"{plan.graph_id} | policy {plan.policy} | predicted {t * 1e3:.3f} ms "
        f"(serial {serial * 1e3:.3f} ms, {serial / t if t > 0 else 1.0:.2f}x)"
    )
    return f"{title}: {text}" if title and title != plan.graph_id else text


def plan_figure(plan: Plan, title: str | None = None):
    """The predicted timeline as a matplotlib ``Figure``: one panel per graph (forward and
    backward apart), one row per stream that graph uses, one bordered box per operator
    (coloured by phase, named where the name fits), the legend outside the plot, and a title
    with the graph(s), policy and predicted time, prefixed by ``title`` (e.g. a model name).

    Example::

        >>> fig = plan_figure(plan, title="towers")        # doctest: +SKIP
        >>> fig.savefig("plan.svg")                         # doctest: +SKIP
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch, Rectangle

    panels = timeline_panels(plan)
    heights = [max(1, len(p.streams)) for p in panels] or [1]
    fig = Figure(figsize=(12, 1.3 + sum(0.75 + 0.5 * h for h in heights)), layout="constrained")
    FigureCanvasAgg(fig)  # Agg canvas without touching pyplot's global backend
    axes = fig.subplots(len(heights), 1, squeeze=False, height_ratios=heights)[:, 0]
    for ax, panel in zip(axes, panels, strict=False):
        rows = {sid: i for i, sid in enumerate(panel.streams)}
        for r in panel.rows.itertuples(index=False):
            ax.add_patch(
                Rectangle(
                    (r.start * 1e3, rows[r.stream] - 0.4),
                    (r.finish - r.start) * 1e3,
                    0.8,
                    facecolor=PHASE_COLOURS.get(r.phase, OTHER_COLOUR),
                    edgecolor=EDGE_COLOUR,
                    linewidth=0.6,
                )
            )
        lo, hi = panel.span
        pad = (hi - lo) * 1e3 * 0.01 or 1e-3
        ax.set_xlim(lo * 1e3 - pad, hi * 1e3 + pad)
        ax.set_ylim(len(rows) - 0.5, -0.5)  # stream 0 on top
        ax.set_yticks(range(len(rows)), [_stream_label(plan, s) for s in panel.streams])
        n = len(panel.streams)
        ax.set_title(
            f"{panel.graph} ({panel.phase})"
            + (f", {panel.policy}" if panel.policy else "")
            + f": {n} stream{'s' if n != 1 else ''}, {len(panel.rows)} operators, "
            f"{(hi - lo) * 1e3:.3f} ms",
            loc="left",
            fontsize="medium",
        )
        ax.set_xlabel("time in the step (ms)")
        if panel.rows.empty:
            ax.text(0.5, 0.5, "nothing scheduled", transform=ax.transAxes, ha="center")
    if not panels:
        axes[0].text(0.5, 0.5, "empty plan", transform=axes[0].transAxes, ha="center")
    phases = {p for panel in panels for p in panel.rows["phase"]}
    handles = [Patch(facecolor=PHASE_COLOURS[p], edgecolor=EDGE_COLOUR, label=p)
               for p in PHASE_COLOURS if p in phases]  # fmt: skip
    if phases - set(PHASE_COLOURS) or not handles:
        handles.append(Patch(facecolor=OTHER_COLOUR, edgecolor=EDGE_COLOUR, label="other"))
    fig.legend(handles=handles, loc="outside right upper", fontsize="small")
    fig.suptitle(_figure_title(plan, title))
    _label_boxes(fig, axes, panels)
    return fig


def _label_boxes(fig, axes, panels: list[TimelinePanel]) -> None:
    """Write each operator's name inside its box when it fits. Sizes come from the laid-out
    axes (points per ms), so the check holds at any dpi."""
    fig.draw_without_rendering()  # runs the constrained layout: axes get their final size
    fig_w, fig_h = fig.get_size_inches()
    for ax, panel in zip(axes, panels, strict=False):
        lo, hi = ax.get_xlim()
        box = ax.get_position()
        pt_per_ms = box.width * fig_w * 72 / (hi - lo)
        row_pt = box.height * fig_h * 72 / max(1, len(panel.streams)) * 0.8
        if row_pt < LABEL_FONT_PT * 1.3:
            continue
        rows = {sid: i for i, sid in enumerate(panel.streams)}
        for r in panel.rows.itertuples(index=False):
            room = (r.finish - r.start) * 1e3 * pt_per_ms - 4  # 2 pt margin each side
            fits = int(room // (LABEL_FONT_PT * _CHAR_WIDTH))
            if fits >= len(r.name):
                label = r.name
            elif fits >= 6:  # a cut name still tells the operator ("convolution_b…")
                label = r.name[: fits - 1] + "\u2026"
            else:
                continue
            t = ax.text((r.start + r.finish) / 2 * 1e3, rows[r.stream], label,
                        ha="center", va="center", fontsize=LABEL_FONT_PT, clip_on=True)  # fmt: skip
            t.set_in_layout(False)  # labels sit inside boxes: they must not move the layout


def plan_gantt(plan: Plan, path: str | None = None, title: str | None = None):
    """``Plan.gantt``: the figure of :func:`plan_figure`, or, given ``path``, that figure
    written there (format by extension: .png, .svg, .pdf, ...) and ``path``."""
    fig = plan_figure(plan, title=title)
    if path is None:
        return fig
    fig.savefig(path, dpi=100)
    return path


def plan_chrome_trace(plan: Plan) -> dict[str, Any]:
    """The predicted timeline in Chrome's trace-event JSON format (opens in Perfetto and
    chrome://tracing): one complete event (``"ph": "X"``) per operator with a positive
    predicted duration, ``ts``/``dur`` in microseconds, ``pid`` = graph (numbered in plan
    order, named by metadata events), ``tid`` = stream id; cross-stream syncs are flow
    arrows (``"s"``/``"f"``).

    Example::

        >>> from autopar.planning.plan import Plan, Stream
        >>> p = Plan("g", "serial", (Stream(0),), (("g0.fw/a", 0),), ("g0.fw/a",), (),
        ...          timeline=(("g0.fw/a", 0.0, 2e-3, 2e-3),))
        >>> [(e["name"], e["ts"], e["dur"]) for e in plan_chrome_trace(p)["traceEvents"]
        ...  if e["ph"] == "X"]
        [('a', 0.0, 2000.0)]
    """
    events: list[dict[str, Any]] = []
    where: dict[str, tuple[int, int, float, float]] = {}  # node -> (pid, tid, start, finish)
    for pid, panel in enumerate(timeline_panels(plan), start=1):
        name = f"{panel.graph} ({panel.phase})" + (f", {panel.policy}" if panel.policy else "")
        events.append({"name": "process_name", "ph": "M", "pid": pid, "tid": 0,
                       "args": {"name": name}})  # fmt: skip
        events.append({"name": "process_sort_index", "ph": "M", "pid": pid, "tid": 0,
                       "args": {"sort_index": pid}})  # fmt: skip
        for sid in panel.streams:
            label = _stream_label(plan, sid).replace("\n", " (") + ")"
            events.append({"name": "thread_name", "ph": "M", "pid": pid, "tid": sid,
                           "args": {"name": label}})  # fmt: skip
        for r in panel.rows.itertuples(index=False):
            start, finish = float(r.start), float(r.finish)
            where[r.node] = (pid, int(r.stream), start, finish)
            events.append(
                {
                    "name": r.name,
                    "cat": r.phase or "other",
                    "ph": "X",
                    "ts": start * 1e6,
                    "dur": (finish - start) * 1e6,
                    "pid": pid,
                    "tid": int(r.stream),
                    "args": {
                        "node": r.node,
                        "graph": panel.graph,
                        "device": r.device,
                        "threads": int(r.threads),
                        "flops": int(r.flops),
                        "bytes": int(r.bytes),
                    },
                }
            )
    for i, s in enumerate(plan.syncs):
        if s.src in where and s.dst in where:
            (pa, ta, a0, _), (pb, tb, b0, _) = where[s.src], where[s.dst]
            flow = {"name": "sync", "cat": "sync", "id": i, "args": {"bytes": s.bytes}}
            events.append({**flow, "ph": "s", "pid": pa, "tid": ta, "ts": a0 * 1e6})
            events.append({**flow, "ph": "f", "bp": "e", "pid": pb, "tid": tb, "ts": b0 * 1e6})
    return {
        "traceEvents": events,
        "displayTimeUnit": "ms",
        "otherData": {
            "graph_id": plan.graph_id,
            "policy": plan.policy,
            "predicted_step_time_ms": plan.predicted_step_time * 1e3,
            "serial_time_ms": plan.serial_time * 1e3,
            "plan_hash": plan.plan_hash,
        },
    }


def write_chrome_trace(trace: dict[str, Any], path: str) -> str:
    """Write a ``plan_chrome_trace`` dict as strict JSON (no NaN); returns ``path``.

    Example::

        >>> write_chrome_trace(plan_chrome_trace(plan), "plan.trace.json")   # doctest: +SKIP
        'plan.trace.json'
    """
    with open(path, "w", encoding="utf-8") as f:
        json.dump(trace, f, allow_nan=False)
    return path


def plan_summary(plan: Plan) -> str:
    """A short text report: streams with node counts and utilisation, predicted time
    against serial and the lower bound, memory, policy and the planner's notes.

    Example::

        >>> from autopar.planning.plan import Plan
        >>> print(plan_summary(Plan("g", "serial", (), (), (), ())).splitlines()[0])
        plan 'g'  policy=serial  nodes=0  syncs=0
    """
    df = plan_dataframe(plan)
    t, lb = plan.predicted_step_time, plan.lower_bound
    lines = [
        f"plan {plan.graph_id!r}  policy={plan.policy}  nodes={len(plan.order)}  "
        f"syncs={len(plan.syncs)}",
        f"predicted {t * 1e3:.3f} ms | serial {plan.serial_time * 1e3:.3f} ms "
        f"({plan.serial_time / t if t > 0 else 1.0:.2f}x) | lower bound "
        f"{plan.lower_bound * 1e3:.3f} ms ({t / lb if lb > 0 else 1.0:.2f}x of it)",
        f"peak memory {plan.predicted_peak_memory / 2**20:.1f} MiB"
        + (
            f" (budget {plan.memory_budget / 2**20:.1f} MiB)"
            if plan.memory_budget is not None
            else ""
        ),
        f"{'stream':>6} {'device':>8} {'threads':>7} {'nodes':>6} {'busy ms':>9} {'util':>6}",
    ]
    for s in plan.streams:
        part = df[df["stream"] == s.id]
        busy = float((part["finish"] - part["start"]).sum()) if len(part) else 0.0
        util = busy / t if t > 0 else 0.0
        lines.append(
            f"{s.id:>6} {s.device:>8} {s.threads:>7} {len(part):>6} {busy * 1e3:>9.3f} {util:>6.0%}"
        )
    lines += [f"note: {n}" for n in plan.notes]
    return "\n".join(lines)
