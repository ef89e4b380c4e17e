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

import networkx as nx

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
    """``graph`` placed by ``eft_schedule`` over ``rank_order`` on ``streams``, simulated.

    ``costs`` (``{(device, threads): {node: seconds}}``, as ``simulate.cost_table`` makes
    them) may be given directly by a caller that measured its nodes itself; by default the
    cost model prices the graph's node attributes. See the module docstring.
    """
    streams = list(streams)
    prep = prepare(graph, prep)
    if costs is None:
        costs = cost_table(graph, streams, machine)
    order = rank_order(graph, streams, machine, costs, prep)
    place = eft_schedule(graph, streams, machine, costs, order, prep=prep)
    return simulate(graph, place, order, streams, machine, costs=costs, prep=prep)
