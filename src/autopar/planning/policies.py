"""The partitioning policies and their registry: one function and one table entry each.

A policy places every node of a task graph on a stream and orders each stream:
``fn(graph, streams, machine, costs, order, *, prep, memory_budget, shared)`` returns
``(placement, order)``, where ``order`` (given: ``listsched.rank_order``) is a topological
order and ``costs`` the node costs per stream configuration (``simulate.cost_table``).
``prep`` is the graph's shared adjacency (``simulate.Prepared``), ``memory_budget`` the
per-plan budget in bytes (or None), and ``shared`` a dict that lives while one graph is
planned, for work every layout can reuse. ``make_plan`` turns the result into a ``Plan``
(syncs, simulation, verification); ``"auto"`` runs every applicable policy on every layout
and keeps what the simulator predicts fastest.

* ``serial``      -- every node on the first stream, in depth-first order.
* ``round_robin`` -- node ``i`` of the critical-path order on stream ``i mod S``.
* ``heft``        -- list scheduling (Topcuoglu et al., IEEE TPDS 2002): nodes by
  decreasing upward rank, each on the stream giving the earliest finish time, with
  sync and transfer costs of its inputs included (``listsched.eft_schedule``).
* ``nimble``      -- minimum chain cover (Kwon et al., "Nimble", NeurIPS 2020): a maximum
  bipartite matching on the reachability relation (Dilworth / Fulkerson) gives chains;
  chains go to streams largest-first (LPT).
* ``stages``      -- multi-device stage partitioning (PipeDream, Narayanan et al., SOSP
  2019): ``stage_partition`` splits a topological order into contiguous stages, one per
  device, minimising the bottleneck stage time plus its outgoing transfer, under a
  memory budget per device.

Adding a policy: write its function with the signature above and add it to ``POLICIES``
(``multi_device=True`` when it only makes sense with streams on several devices).

Example::

    >>> from autopar.planning.taskgraph import fork_join_graph
    >>> from autopar.planning.costmodel import MachineModel
    >>> from autopar.planning.plan import Stream
    >>> from autopar.planning.simulate import cost_table
    >>> g, m = fork_join_graph([[1e-3], [1e-3]]), MachineModel.default_cpu()
    >>> two = [Stream(0, "cpu", 1), Stream(1, "cpu", 1)]
    >>> place, order = POLICIES["round_robin"].fn(g, two, m, cost_table(g, two, m), list(g))
    >>> sorted(set(place.values()))
    [0, 1]
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import networkx as nx
import numpy as np

from autopar.errors import PlanError
from autopar.planning.listsched import eft_schedule
from autopar.planning.plan import Stream
from autopar.planning.simulate import Prepared, prepare, stream_config

#: Nimble's reachability is computed within this many positions of a topological order,
#: and each node offers at most ``NIMBLE_CANDIDATES`` successors to the matching on big
#: graphs. Both bound the bipartite graph to O(N * candidates) edges (the full transitive
#: closure of a 5,000-node graph has millions of pairs); on graphs of at most
#: ``NIMBLE_EXACT_NODES`` nodes the closure is complete and the chain cover minimum.
NIMBLE_WINDOW = 256
NIMBLE_CANDIDATES = 6
NIMBLE_EXACT_NODES = 128


# -- the policies ------------------------------------------------------------------------
def serial(graph, streams, machine, costs, order, *, prep=None, memory_budget=None, shared=None):
    """All nodes on ``streams[0]`` in a depth-first topological order (reverse DFS
    postorder): on one stream the order does not change the time, and depth-first keeps
    fewer intermediate tensors alive than the breadth-first critical-path order."""
    order = list(reversed(list(nx.dfs_postorder_nodes(graph))))
    return dict.fromkeys(order, streams[0].id), order


def round_robin(
    graph, streams, machine, costs, order, *, prep=None, memory_budget=None, shared=None
):
    """Node ``i`` of ``order`` on stream ``i mod len(streams)``."""
    return {n: streams[i % len(streams)].id for i, n in enumerate(order)}, order


def heft(graph, streams, machine, costs, order, *, prep=None, memory_budget=None, shared=None):
    """Earliest-finish-time list scheduling over ``order`` (decreasing upward rank): the
    planner's list scheduler, ``listsched.eft_schedule``."""
    return eft_schedule(graph, streams, machine, costs, order, prep=prep), order


def chain_cover(graph: nx.DiGraph, prep: Prepared | None = None) -> list[list[str]]:
    """Chains (each totally ordered by reachability) covering every node once; minimum
    (Dilworth) on graphs of at most ``NIMBLE_EXACT_NODES`` nodes, near-minimum above.

    Reachability within ``NIMBLE_WINDOW`` topological positions is kept as one bit mask per
    node (bit ``i`` = the node ``i + 1`` positions later is reachable), built in one
    reverse sweep; a maximum matching (``hopcroft_karp_matching``) on "u before v" pairs
    links the chains.

    Example::

        >>> from autopar.planning.taskgraph import fork_join_graph
        >>> sorted(len(c) for c in chain_cover(fork_join_graph([[1.0, 1.0], [1.0]])))
        [2, 3]
    """
    prep = prepare(graph, prep)
    topo = prep.topo
    n = len(topo)
    exact = n <= NIMBLE_EXACT_NODES
    window = n if exact else NIMBLE_WINDOW
    cand = n if exact else NIMBLE_CANDIDATES
    mask = (1 << window) - 1
    pos = {v: i for i, v in enumerate(topo)}
    reach = [0] * n
    for i in range(n - 1, -1, -1):
        r = 0
        for s, _ in prep.succ[topo[i]]:
            d = pos[s] - i
            if d <= window:
                r |= (1 << (d - 1)) | (reach[pos[s]] << d)
        reach[i] = r & mask
    bip = nx.Graph()
    bip.add_nodes_from(range(n))
    bip.add_nodes_from(range(n, 2 * n))
    for i in range(n):
        r, k = reach[i], 0
        while r and k < cand:
            low = r & -r
            bip.add_edge(i, n + i + low.bit_length())
            r ^= low
            k += 1
    match = nx.bipartite.hopcroft_karp_matching(bip, top_nodes=range(n))
    nxt = {i: match[i] - n for i in range(n) if i in match}
    has_prev = set(nxt.values())
    chains = []
    for i in range(n):
        if i in has_prev:
            continue
        chain, j = [], i
        while True:
            chain.append(topo[j])
            if j not in nxt:
                break
            j = nxt[j]
        chains.append(chain)
    return chains


def nimble(graph, streams, machine, costs, order, *, prep=None, memory_budget=None, shared=None):
    """Chains of ``chain_cover`` onto streams, longest first, each to the stream where
    its load would end lowest (LPT); streams run their nodes in ``order``. The chain cover
    does not depend on the streams: it is computed once per graph (kept in ``shared``)."""
    shared = {} if shared is None else shared
    if "chains" not in shared:
        shared["chains"] = chain_cover(graph, prep)
    chains = shared["chains"]
    cfg = {s.id: stream_config(s, machine) for s in streams}
    load = {s.id: 0.0 for s in streams}
    place: dict[str, int] = {}
    ref = costs[cfg[streams[0].id]]
    for chain in sorted(chains, key=lambda c: -sum(ref[v] for v in c)):
        sid = min(load, key=lambda s: (load[s] + sum(costs[cfg[s]][v] for v in chain), s))
        load[sid] += sum(costs[cfg[sid]][v] for v in chain)
        place.update(dict.fromkeys(chain, sid))
    return place, order


# -- stages (multi-device) ---------------------------------------------------------------
def stage_partition(
    costs,
    cut_bytes,
    mem,
    n_stages: int,
    *,
    memory_budget: float | None = None,
    latency_s: float = 0.0,
    bandwidth_Bps: float = float("inf"),
) -> tuple[list[int], float]:
    """Split positions ``0..N-1`` (a topological order) into at most ``n_stages``
    contiguous stages minimising the bottleneck, by dynamic programming.

    Stage ``[a, b)`` takes ``sum(costs[a:b])`` plus, unless it is the last, the transfer
    of the cut after it: ``latency_s + cut_bytes[b-1] / bandwidth_Bps`` (0 when nothing
    crosses); its memory ``sum(mem[a:b])`` must stay within ``memory_budget``.
    ``F[k][b] = min_a max(F[k-1][a], stage(a, b))``, O(n_stages * N^2) vectorised.
    Returns the stage start positions (first is 0) and the bottleneck time.

    Example::

        >>> stage_partition([1, 1, 1, 1], [0, 0, 0], [0, 0, 0, 0], 2)
        ([0, 2], 2.0)
    """
    c = np.asarray(costs, dtype=float)
    n = len(c)
    if n == 0:
        return [0], 0.0
    cut = np.asarray(cut_bytes, dtype=float)
    m = np.asarray(mem, dtype=float)
    tr = np.zeros(n + 1)  # tr[b]: transfer out of a stage ending at b
    tr[1:n] = np.where(cut > 0, latency_s + cut / bandwidth_Bps, 0.0)
    pc = np.concatenate([[0.0], np.cumsum(c)])
    pm = np.concatenate([[0.0], np.cumsum(m)])
    budget = np.inf if memory_budget is None else float(memory_budget)
    f = np.full((n_stages + 1, n + 1), np.inf)
    arg = np.zeros((n_stages + 1, n + 1), dtype=int)
    f[0, 0] = 0.0
    for k in range(1, n_stages + 1):
        for b in range(1, n + 1):
            a = np.arange(b)
            stage = pc[b] - pc[a] + tr[b]
            cand = np.maximum(f[k - 1, :b], stage)
            cand[pm[b] - pm[a] > budget] = np.inf
            j = int(np.argmin(cand))
            f[k, b], arg[k, b] = cand[j], j
    k = int(np.argmin(f[1:, n])) + 1
    best = float(f[k, n])
    if not np.isfinite(best):
        raise PlanError(
            f"no split into {n_stages} stage(s) fits memory_budget={memory_budget} bytes per "
            f"device (total {int(pm[n])} bytes, largest op {int(m.max())}); raise the budget "
            "or add devices"
        )
    starts, b = [], n
    while k > 0:
        a = int(arg[k, b])
        starts.append(a)
        b, k = a, k - 1
    return sorted(starts), best


def stages(graph, streams, machine, costs, order, *, prep=None, memory_budget=None, shared=None):
    """One stage per device (its first stream), split by ``stage_partition`` over
    ``order``; a stage's memory is the output bytes of its nodes (activations stay alive
    until the backward in training)."""
    by_dev: dict[str, Stream] = {}
    for s in streams:
        by_dev.setdefault(s.device, s)
    devs = list(by_dev.values())
    pos = {v: i for i, v in enumerate(order)}
    cfgs = [stream_config(s, machine) for s in devs]
    c = [sum(costs[cf][v] for cf in cfgs) / len(cfgs) for v in order]
    diff = np.zeros(len(order) + 1)
    for u, v, b in graph.edges(data="bytes", default=0):
        diff[pos[u]] += b
        diff[pos[v]] -= b
    cut = np.cumsum(diff)[: max(len(order) - 1, 0)]
    mem = [0 if graph.nodes[v].get("is_view") else graph.nodes[v]["output_bytes"] for v in order]
    budget = memory_budget if memory_budget is not None else machine.memory_bytes
    starts, _ = stage_partition(
        c,
        cut,
        mem,
        len(devs),
        memory_budget=budget,
        latency_s=machine.transfer_latency_s,
        bandwidth_Bps=machine.transfer_bandwidth_Bps,
    )
    bounds = starts + [len(order)]
    place = {}
    for k in range(len(starts)):
        place.update(dict.fromkeys(order[bounds[k] : bounds[k + 1]], devs[k].id))
    return place, order


# -- the registry ------------------------------------------------------------------------
#: A policy function; see the module docstring for its signature.
PolicyFn = Callable[..., tuple[dict[str, int], list[str]]]


@dataclass(frozen=True)
class Policy:
    """One registered partitioner. ``multi_device``: it splits the graph across devices,
    so it applies only to layouts with streams on two or more devices."""

    fn: PolicyFn
    multi_device: bool = False


#: Every policy ``make_plan`` knows, by name, in the order ``"auto"`` tries them (``serial``
#: is always built first: it is the baseline every other candidate is compared with).
POLICIES: dict[str, Policy] = {
    "serial": Policy(serial),
    "round_robin": Policy(round_robin),
    "heft": Policy(heft),
    "nimble": Policy(nimble),
    "stages": Policy(stages, multi_device=True),
}

#: Try every applicable policy on every layout; keep what the simulator predicts fastest.
AUTO = "auto"

#: Every ``policy`` value ``make_plan`` accepts.
POLICY_NAMES: tuple[str, ...] = (AUTO, *POLICIES)

#: The ``policy`` values for planning the streams of one device (``autopar.compile``, the
#: ``plan`` and ``bench`` commands): multi-device policies need streams on several devices.
SINGLE_DEVICE_POLICY_NAMES: tuple[str, ...] = (
    AUTO,
    *(name for name, p in POLICIES.items() if not p.multi_device),
)
