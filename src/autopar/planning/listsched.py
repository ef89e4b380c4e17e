"""List scheduling: the planner's one list scheduler, and its prediction for a small graph.

* ``rank_order`` -- the priority: nodes by decreasing HEFT upward rank (Topcuoglu et al.,
  IEEE TPDS 2002). ``make_plan`` gives it to every policy as the node order.
* ``eft_schedule`` -- the placement: each node, in that order, on the stream where it would
  finish earliest. A node's start on stream ``s`` is ``max(avail[s], max over inputs p of
  finish[p] + edge_delay(stream(p), s, bytes))``, the same communication rule
  (``simulate.edge_delay``) the discrete-event simulator applies when it runs the plan.
  The ``heft`` policy is this placement.
* ``list_schedule`` -- both, then ``simulate``: the simulator's prediction for a graph on
  given streams, without trying every policy and layout as ``make_plan`` does. Callers
  that model their own small graphs (``rnn.choice``: the pieces of a recurrent layer) use
  it, so there is one concurrency model, the simulator's.

Random ops keep graph order: they draw from one global generator, so running them in
another order than eager changes every mask (codegen refuses such a plan).
``with_rng_order`` adds an ordering edge (``bytes=0``, ``order=True``) from each random op
to the next one of the same graph; ``make_plan`` and ``list_schedule`` plan the graph with
those edges, so every order they produce (a topological order of it) keeps them in place
and the syncs, the simulator and the verifier all see the dependency.

The list scheduler itself assumes no contention (each stream at its uncontended cost); the
simulator then charges the contention the placement causes (``simulate``'s module doc).

Example::

    >>> from autopar.planning.taskgraph import fork_join_graph
    >>> from autopar.planning.costmodel import MachineModel
    >>> from autopar.planning.plan import Stream
    >>> g = fork_join_graph([[1e-3], [1e-3]])
    >>> r = list_schedule(g, [Stream(0, "cpu", 1), Stream(1, "cpu", 1)],
    ...                   MachineModel.default_cpu())
    >>> round(r.makespan * 1e3, 3)   # the branches on two streams, one sync
    1.02
"""

from __future__ import annotations

import functools
import types

import networkx as nx
import torch

from autopar import compat
from autopar.capture.analysis import is_rng
from autopar.errors import PlanError
from autopar.planning.costmodel import MachineModel
from autopar.planning.simulate import (
    Prepared,
    SimResult,
    cost_table,
    edge_delay,
    prepare,
    simulate,
    stream_config,
)


@functools.cache
def target_is_rng(target: str) -> bool:
    """Whether a profile table's ``target`` (``str(OpOverload)``, e.g.
    ``"aten.native_dropout.default"``) draws from the global random generator.

    The task graph only has the target's name, so it is resolved back to the operator and
    judged by ``capture.analysis.is_rng``, the one rule codegen also applies (a node-shaped
    stand-in: ``is_rng`` reads only ``op`` and ``target``). Names that are not
    ``namespace.op.overload`` (placeholders, ``_operator.getitem``) are not random.

    Example::

        >>> target_is_rng("aten.native_dropout.default"), target_is_rng("aten.mm.default")
        (True, False)
    """
    parts = target.split(".")
    if len(parts) != 3 or not all(p.isidentifier() for p in parts):
        return False
    try:
        op = getattr(getattr(getattr(torch.ops, parts[0]), parts[1]), parts[2])
    except (AttributeError, RuntimeError):
        return False
    if not isinstance(op, compat.OpOverload):
        return False
    return is_rng(types.SimpleNamespace(op="call_function", target=op))


def rng_nodes(graph: nx.DiGraph) -> list[str]:
    """The task graph's random ops, in graph order (the order of its nodes, which is the
    profile table's, i.e. the captured graph's). A node's ``rng`` attribute, when set,
    overrides what its ``target`` says (synthetic graphs)."""
    out = []
    for n, a in graph.nodes(data=True):
        rng = a.get("rng")
        if rng is None:
            rng = target_is_rng(str(a.get("target", "")))
        if rng:
            out.append(n)
    return out


def with_rng_order(graph: nx.DiGraph) -> nx.DiGraph:
    """``graph`` with an ordering edge (``bytes=0``, ``order=True``) from each random op to
    the next one of the same graph tag (see the module docstring); ``graph`` itself when
    no edge is missing (it is never modified).

    Example::

        >>> from autopar.planning.taskgraph import fork_join_graph
        >>> g = fork_join_graph([[1.0], [1.0]])
        >>> g.nodes["g0.fw/n1"]["rng"] = g.nodes["g0.fw/n2"]["rng"] = True
        >>> list(with_rng_order(g).edges("g0.fw/n1"))
        [('g0.fw/n1', 'g0.fw/n3'), ('g0.fw/n1', 'g0.fw/n2')]
    """
    last: dict[str, str] = {}
    missing = []
    for n in rng_nodes(graph):
        tag = str(graph.nodes[n].get("graph", ""))
        if tag in last and not graph.has_edge(last[tag], n):
            missing.append((last[tag], n))
        last[tag] = n
    if not missing:
        return graph
    out = graph.copy()
    out.add_edges_from(missing, bytes=0, order=True)
    if not nx.is_directed_acyclic_graph(out):
        u, v = next((u, v) for u, v in missing if nx.has_path(graph, v, u))
        raise PlanError(
            f"random op {v} comes after {u} in the task graph but feeds it: the graph's "
            "node order must be the captured graph's (build it with task_graph_from_profile)"
        )
    return out


def rank_order(graph: nx.DiGraph, streams, machine, costs, prep=None) -> list[str]:
    """Nodes by decreasing HEFT upward rank (mean cost over the streams plus the longest
    path to an exit, with the mean sync cost ``sync * (1 - 1/S)`` per edge). Ties keep a
    topological order, so the result is topological."""
    cfgs = [stream_config(s, machine) for s in streams]
    comm = machine.sync_cost_s * (1.0 - 1.0 / len(streams))
    prep = prepare(graph, prep)
    topo = prep.topo
    rank: dict[str, float] = {}
    for n in reversed(topo):
        mean = sum(costs[c][n] for c in cfgs) / len(cfgs)
        rank[n] = mean + max((rank[s] for s, _ in prep.succ[n]), default=-comm) + comm
    index = {n: i for i, n in enumerate(topo)}
    return sorted(topo, key=lambda n: (-rank[n], index[n]))


def eft_schedule(
    graph: nx.DiGraph, streams, machine, costs, order, *, prep: Prepared | None = None
) -> dict[str, int]:
    """Earliest-finish-time placement over ``order`` (a topological order).

    A stream's finish time for a node counts the stream's availability, each input's
    finish plus ``edge_delay`` (sync, transfer) and the node's cost at the stream's
    threads; ties go to the stream of the latest input (fewer syncs), then the lowest id.
    Returns ``{node: stream id}``; each stream runs its nodes in ``order``.
    """
    cfg = {s.id: stream_config(s, machine) for s in streams}
    avail = {s.id: 0.0 for s in streams}
    fin: dict[str, float] = {}
    place: dict[str, int] = {}
    smap = {s.id: s for s in streams}
    pred = prepare(graph, prep).pred
    for n in order:
        preds = pred[n]
        last = max(preds, key=lambda e: fin[e[0]], default=(None,))[0]
        best = None
        for s in streams:
            est = avail[s.id]
            for p, nbytes in preds:
                t = fin[p] + edge_delay(smap[place[p]], s, nbytes, machine)
                est = max(est, t)
            eft = est + costs[cfg[s.id]][n]
            key = (eft, 0 if last is not None and place[last] == s.id else 1, s.id)
            if best is None or key < best:
                best = key
        place[n] = best[2]
        fin[n] = best[0]
        avail[best[2]] = best[0]
    return place


def list_schedule(
    graph: nx.DiGraph,
    streams,
    machine: MachineModel,
    costs: dict | None = None,
    *,
    prep: Prepared | None = None,
) -> SimResult:
    """``graph`` placed by ``eft_schedule`` over ``rank_order`` on ``streams``, simulated,
    with its random ops kept in graph order (``with_rng_order``).

    ``costs`` (``{(device, threads): {node: seconds}}``, as ``simulate.cost_table`` makes
    them) may be given directly by a caller that measured its nodes itself; by default the
    cost model prices the graph's node attributes. See the module docstring.
    """
    streams = list(streams)
    graph = with_rng_order(graph)  # a new graph when edges were added: prep is then rebuilt
    prep = prepare(graph, prep)
    if costs is None:
        costs = cost_table(graph, streams, machine)
    order = rank_order(graph, streams, machine, costs, prep)
    place = eft_schedule(graph, streams, machine, costs, order, prep=prep)
    return simulate(graph, place, order, streams, machine, costs=costs, prep=prep)
