"""Task graphs: the planner's view of a captured graph, as a ``networkx.DiGraph``.

A task graph has one node per profiled FX node, keyed by the plan-wide node key
(``"<graph_tag>/<node.name>"``, see ``autopar.capture.backend.node_key``), and one edge per data
dependency (producer -> consumer) carrying the tensor ``bytes`` that flow along it.

Node attributes (all present on every node)::

    time_s, time_1t_s, threads, flops, bytes_read, bytes_written, output_bytes,
    is_view, phase, graph, op, target

Placeholders and the output node are nodes too (with zero cost), so every FX node is
placed exactly once by the partitioner.

Example::

    >>> g = chain_graph([1e-3, 2e-3])
    >>> list(g.nodes)
    ['g0.fw/n0', 'g0.fw/n1']
    >>> g.edges['g0.fw/n0', 'g0.fw/n1']['bytes']
    4096
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterable, Sequence

import networkx as nx

#: Columns of the profile table the task graph needs (see docs/architecture.md).
REQUIRED_COLUMNS = (
    "graph",
    "phase",
    "node",
    "key",
    "op",
    "target",
    "time_s",
    "time_1t_s",
    "threads",
    "flops",
    "bytes_read",
    "bytes_written",
    "output_bytes",
    "is_view",
    "inputs",
    "input_bytes",
)

#: Default attribute values, used by ``make_node_attrs`` and for absent optional values.
_DEFAULTS = {
    "time_s": 0.0,
    "time_1t_s": 0.0,
    "threads": 1,
    "flops": 0,
    "bytes_read": 0,
    "bytes_written": 0,
    "output_bytes": 0,
    "is_view": False,
    "phase": "forward",
    "graph": "g0.fw",
    "op": "call_function",
    "target": "synthetic",
}


def _num(x, default: float = 0.0) -> float:
    """A float, with NaN/None mapped to ``default`` (pandas uses NaN for missing times)."""
    if x is None:
        return default
    try:
        v = float(x)
    except (TypeError, ValueError):
        return default
    return default if math.isnan(v) else v


def task_graph_from_profile(df) -> nx.DiGraph:
    """Build the task graph of a profile table (one row per FX node).

    Edges come from the ``inputs`` (producer node names in the same graph) and
    ``input_bytes`` columns. Missing times (NaN) become 0.0 here; the cost model then
    estimates them from ``flops`` and bytes (see ``autopar.planning.costmodel.node_times``).

    Example::

        >>> import pandas as pd
        >>> row = dict(graph="g0.fw", phase="forward", op="call_function", target="t",
        ...            time_s=1e-3, time_1t_s=2e-3, threads=2, flops=0, bytes_read=0,
        ...            bytes_written=8, output_bytes=8, is_view=False)
        >>> df = pd.DataFrame([dict(row, node="a", key="g0.fw/a", inputs=[], input_bytes=[]),
        ...                    dict(row, node="b", key="g0.fw/b", inputs=["a"], input_bytes=[8])])
        >>> sorted(task_graph_from_profile(df).edges(data="bytes"))
        [('g0.fw/a', 'g0.fw/b', 8)]
    """
    missing = [c for c in REQUIRED_COLUMNS if c not in df.columns]
    if missing:
        raise ValueError(
            f"the profile table lacks columns {missing}; make it with autopar.profiling.profiler "
            "(columns are listed in docs/architecture.md)"
        )
    g = nx.DiGraph()
    rows = list(df[list(REQUIRED_COLUMNS)].itertuples(index=False))
    for r in rows:
        if r.key in g:
            raise ValueError(
                f"the profile table has two rows for node {r.key!r}; keys must be unique"
            )
        g.add_node(
            r.key,
            time_s=_num(r.time_s),
            time_1t_s=_num(r.time_1t_s),
            threads=int(_num(r.threads, 1)) or 1,
            flops=int(_num(r.flops)),
            bytes_read=int(_num(r.bytes_read)),
            bytes_written=int(_num(r.bytes_written)),
            output_bytes=int(_num(r.output_bytes)),
            is_view=bool(r.is_view) if r.is_view == r.is_view else False,  # NaN -> False
            phase=str(r.phase),
            graph=str(r.graph),
            op=str(r.op),
            target=str(r.target),
        )
    if "device" in df.columns:  # optional: which device's cost model applies
        for key, dev in zip(df["key"], df["device"], strict=True):
            g.nodes[key]["device"] = dev if isinstance(dev, str) else ""
    for r in rows:
        inputs = list(r.inputs) if isinstance(r.inputs, Iterable) else []
        sizes = list(r.input_bytes) if isinstance(r.input_bytes, Iterable) else []
        sizes += [0] * (len(inputs) - len(sizes))
        for name, nbytes in zip(inputs, sizes, strict=True):
            src = f"{r.graph}/{name}"
            if src not in g:
                raise ValueError(
                    f"node {r.key!r} reads {name!r}, which has no row in the profile table "
                    f"(expected key {src!r}); re-profile the graph"
                )
            prev = g.edges[src, r.key]["bytes"] if g.has_edge(src, r.key) else 0
            g.add_edge(src, r.key, bytes=prev + int(_num(nbytes)))  # an input used twice
    if not nx.is_directed_acyclic_graph(g):
        cycle = nx.find_cycle(g)
        raise ValueError(f"the profile table's edges form a cycle {cycle}; re-profile the graph")
    return g


def make_node_attrs(
    time_1t_s: float,
    time_s: float | None = None,
    threads: int = 2,
    *,
    flops: int = 0,
    output_bytes: int = 4096,
    is_view: bool = False,
    op: str = "call_function",
    target: str = "synthetic",
    phase: str = "forward",
    graph: str = "g0.fw",
) -> dict:
    """Node attributes for synthetic graphs; ``time_s`` defaults to ``time_1t_s``
    (an op that gains nothing from threads).

    Example::

        >>> make_node_attrs(1e-3, 6e-4)["time_s"]
        0.0006
    """
    d = dict(_DEFAULTS)
    d.update(
        time_1t_s=float(time_1t_s),
        time_s=float(time_1t_s if time_s is None else time_s),
        threads=int(threads),
        flops=int(flops),
        bytes_read=0,
        bytes_written=0 if is_view else int(output_bytes),
        output_bytes=int(output_bytes),
        is_view=bool(is_view),
        op=op,
        target=target,
        phase=phase,
        graph=graph,
    )
    return d


def _name(i: int, graph: str = "g0.fw") -> str:
    return f"{graph}/n{i}"


def chain_graph(costs: Sequence[float], speedup: float = 1.0, edge_bytes: int = 4096):
    """A chain n0 -> n1 -> ... with single-thread times ``costs``; ``speedup`` is the
    measured 2-thread speed-up of every op (``time_s = cost / speedup``).

    Example::

        >>> chain_graph([1.0, 2.0]).number_of_edges()
        1
    """
    g = nx.DiGraph()
    for i, c in enumerate(costs):
        g.add_node(_name(i), **make_node_attrs(c, c / speedup))
        if i:
            g.add_edge(_name(i - 1), _name(i), bytes=edge_bytes)
    return g


def fork_join_graph(
    branches: Sequence[Sequence[float]], speedup: float = 1.0, edge_bytes: int = 4096
) -> nx.DiGraph:
    """A zero-cost source, independent chains with the given single-thread times, and a
    zero-cost sink joining them.

    Example::

        >>> fork_join_graph([[1.0], [2.0, 3.0]]).number_of_nodes()
        5
    """
    g = nx.DiGraph()
    src, i = _name(0), 1
    g.add_node(src, **make_node_attrs(0.0, op="placeholder", target="x"))
    tails = []
    for chain in branches:
        prev = src
        for c in chain:
            g.add_node(_name(i), **make_node_attrs(c, c / speedup))
            g.add_edge(prev, _name(i), bytes=edge_bytes)
            prev, i = _name(i), i + 1
        tails.append(prev)
    sink = _name(i)
    g.add_node(sink, **make_node_attrs(0.0, op="output", target="output", output_bytes=0))
    for t in tails:
        g.add_edge(t, sink, bytes=edge_bytes)
    return g


def random_dag(
    n: int,
    edge_prob: float = 0.3,
    *,
    seed: int = 0,
    cost_range: tuple[float, float] = (1e-4, 1e-3),
    speedup_range: tuple[float, float] = (1.0, 1.9),
    bytes_range: tuple[int, int] = (1024, 1 << 20),
) -> nx.DiGraph:
    """A random DAG: edge i -> j (i < j) with probability ``edge_prob``; random single-thread
    costs, 2-thread speed-ups and output sizes.

    Example::

        >>> nx.is_directed_acyclic_graph(random_dag(10, seed=1))
        True
    """
    rng = random.Random(seed)
    g = nx.DiGraph()
    for i in range(n):
        c = rng.uniform(*cost_range)
        g.add_node(
            _name(i),
            **make_node_attrs(
                c, c / rng.uniform(*speedup_range), output_bytes=rng.randint(*bytes_range)
            ),
        )
    for j in range(n):
        for i in range(j):
            if rng.random() < edge_prob:
                g.add_edge(_name(i), _name(j), bytes=g.nodes[_name(i)]["output_bytes"])
    return g


def synthetic_task_graph(
    n_nodes: int,
    *,
    width: int = 8,
    fan_in: int = 2,
    seed: int = 0,
    large_fraction: float = 0.1,
) -> nx.DiGraph:
    """A random layered DAG like a training graph: layers of ``width`` ops, each reading
    ``fan_in`` random ops of the previous layer. About ``large_fraction`` of the ops are
    "large GEMMs" (1-5 ms single-thread, 1.9x faster on 2 threads); the rest are small ops
    (10-100 us, no gain from threads).

    Example::

        >>> synthetic_task_graph(100, seed=3).number_of_nodes()
        100
    """
    rng = random.Random(seed)
    g = nx.DiGraph()
    layers: list[list[str]] = []
    i = 0
    while i < n_nodes:
        layer = []
        for _ in range(min(width, n_nodes - i)):
            if rng.random() < large_fraction:
                c = rng.uniform(1e-3, 5e-3)
                attrs = make_node_attrs(c, c / 1.9, flops=int(c * 5e10), target="aten.mm.default")
            else:
                c = rng.uniform(1e-5, 1e-4)
                attrs = make_node_attrs(c, c * 1.05, target="aten.add.Tensor")
            attrs["output_bytes"] = attrs["bytes_written"] = rng.randint(1 << 10, 1 << 22)
            g.add_node(_name(i), **attrs)
            if layers:
                prev = layers[-1]
                for src in rng.sample(prev, min(fan_in, len(prev))):
                    g.add_edge(src, _name(i), bytes=g.nodes[src]["output_bytes"])
            layer.append(_name(i))
            i += 1
        layers.append(layer)
    return g
