"""Looking at a Plan: a table, a graph, a Gantt chart and a text summary.

These back ``Plan.to_dataframe``, ``Plan.to_networkx``, ``Plan.gantt`` and
``Plan.summary``.

Example::

    >>> from autopar.planning.plan import Plan, Stream
    >>> p = Plan("g", "serial", (Stream(0, "cpu", 2),), (("a", 0), ("b", 0)), ("a", "b"), (),
    ...          predicted_step_time=2e-3, serial_time=2e-3, lower_bound=2e-3,
    ...          timeline=(("a", 0.0, 1e-3, 1e-3), ("b", 1e-3, 2e-3, 1e-3)))
    >>> list(plan_dataframe(p)["stream"])
    [0, 0]
"""

from __future__ import annotations

from typing import TYPE_CHECKING

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

        >>> from autopar.planning.plan import Stream, Sync
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


def plan_gantt(plan: Plan, path: str, title: str | None = None) -> str:
    """Save a Gantt chart of the simulated timeline as a PNG: one row per stream, bars
    coloured by phase (forward / backward), times in ms. Returns ``path``.

    Example::

        >>> plan_gantt(plan, "plan.png")        # doctest: +SKIP
        'plan.png'
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch

    df = plan_dataframe(plan)
    df = df[(df["finish"] > df["start"])]
    sids = [s.id for s in plan.streams]
    fig = Figure(figsize=(10, 1.0 + 0.6 * len(sids)))
    FigureCanvasAgg(fig)  # Agg canvas without touching pyplot's global backend
    ax = fig.add_subplot(1, 1, 1)
    for row, sid in enumerate(sids):
        part = df[df["stream"] == sid]
        for phase, grp in part.groupby("phase"):
            bars = list(zip(grp["start"] * 1e3, (grp["finish"] - grp["start"]) * 1e3, strict=True))
            colour = PHASE_COLOURS.get(phase, OTHER_COLOUR)
            ax.broken_barh(bars, (row - 0.4, 0.8), facecolors=colour, edgecolor="none")
    labels = []
    for s in plan.streams:
        labels.append(f"stream {s.id}\n{s.device}, {s.threads or 'default'}t")
    ax.set_yticks(range(len(sids)))
    ax.set_yticklabels(labels)
    ax.invert_yaxis()
    ax.set_xlabel("time (ms)")
    phases = [p for p in PHASE_COLOURS if p in set(df["phase"])] or list(PHASE_COLOURS)
    handles = [Patch(color=PHASE_COLOURS[p], label=p) for p in phases]
    if set(df["phase"]) - set(PHASE_COLOURS):
        handles.append(Patch(color=OTHER_COLOUR, label="other"))
    ax.legend(handles=handles, loc="upper right", fontsize="small")
    ax.set_title(
        title
        or f"{plan.graph_id}: {plan.policy}, predicted {plan.predicted_step_time * 1e3:.3f} ms "
        f"(serial {plan.serial_time * 1e3:.3f} ms)"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    return path


def plan_summary(plan: Plan) -> str:
    """A short text report: streams with node counts and utilisation, predicted time
    against serial and the lower bound, memory, policy and the planner's notes.

    Example::

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
