"""Partitioners: place every node on a stream, order each stream, derive the syncs.

Policies (each returns ``(placement, order)``; ``make_plan`` turns them into a ``Plan``):

* ``serial``      -- every node on the first stream, in critical-path order.
* ``round_robin`` -- node ``i`` of the critical-path order on stream ``i mod S``.
* ``heft``        -- list scheduling (Topcuoglu et al., IEEE TPDS 2002): nodes by
  decreasing upward rank, each on the stream giving the earliest finish time, with
  sync and transfer costs of its inputs included.
* ``nimble``      -- minimum chain cover (Kwon et al., "Nimble", NeurIPS 2020): a maximum
  bipartite matching on the reachability relation (Dilworth / Fulkerson) gives chains;
  chains go to streams largest-first (LPT).
* ``stages``      -- multi-device stage partitioning (PipeDream, Narayanan et al., SOSP
  2019): ``stage_partition`` splits a topological order into contiguous stages, one per
  device, minimising the bottleneck stage time plus its outgoing transfer, under a
  memory budget per device.

Thread layouts (``costmodel.thread_layouts``): on a CPU with ``C`` cores, ``auto`` tries
``1 x C`` threads (intra-op parallelism only), ``C x 1`` (inter-op only) and a mixed layout
(one ``C``-thread stream for ops that scale, ``C - 1`` single-thread streams), and keeps
what the simulator predicts fastest.

Example::

    >>> from autopar.planning.taskgraph import fork_join_graph
    >>> from autopar.planning.costmodel import MachineModel
    >>> g = fork_join_graph([[1e-3] * 4, [1e-3] * 4])
    >>> p = make_plan(g, machine=MachineModel.default_cpu())
    >>> p.predicted_step_time < p.serial_time
    True
"""

from __future__ import annotations

import time
from collections import Counter

import networkx as nx
import numpy as np

from autopar.errors import PlanError
from autopar.planning.costmodel import MachineModel, stream_layouts, wants_intra_op
from autopar.planning.plan import Plan, Stream, Sync
from autopar.planning.simulate import (
    Prepared,
    cost_table,
    edge_delay,
    lower_bound,
    prepare,
    simulate,
    stream_config,
)
from autopar.planning.verify import verify_plan

POLICIES = ("serial", "round_robin", "heft", "nimble", "stages")

#: Nimble's reachability is computed within this many positions of a topological order,
#: and each node offers at most ``NIMBLE_CANDIDATES`` successors to the matching on big
#: graphs. Both bound the bipartite graph to O(N * candidates) edges (the full transitive
#: closure of a 5,000-node graph has millions of pairs); on graphs of at most
#: ``NIMBLE_EXACT_NODES`` nodes the closure is complete and the chain cover minimum.
NIMBLE_WINDOW = 256
NIMBLE_CANDIDATES = 6
NIMBLE_EXACT_NODES = 128

_MACHINE_CACHE: dict[str, MachineModel] = {}


# -- shared helpers ----------------------------------------------------------------------
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


def serial(graph, streams, machine, costs, order, *, prep=None):
    """All nodes on ``streams[0]`` in a depth-first topological order (reverse DFS
    postorder): on one stream the order does not change the time, and depth-first keeps
    fewer intermediate tensors alive than the breadth-first critical-path order."""
    order = list(reversed(list(nx.dfs_postorder_nodes(graph))))
    return dict.fromkeys(order, streams[0].id), order


def round_robin(graph, streams, machine, costs, order, *, prep=None):
    """Node ``i`` of ``order`` on stream ``i mod len(streams)``."""
    return {n: streams[i % len(streams)].id for i, n in enumerate(order)}, order


def heft(graph, streams, machine, costs, order, *, prep=None):
    """Earliest-finish-time list scheduling over ``order`` (decreasing upward rank).

    A stream's finish time for a node counts the stream's availability, each input's
    finish plus ``edge_delay`` (sync, transfer) and the node's cost at the stream's
    threads; ties go to the stream of the latest input (fewer syncs), then the lowest id.
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
    return place, order


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


def nimble(graph, streams, machine, costs, order, *, chains=None, prep=None):
    """Chains of ``chain_cover`` onto streams, longest first, each to the stream where
    its load would end lowest (LPT); streams run their nodes in ``order``."""
    chains = chains if chains is not None else chain_cover(graph, prep)
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


def stages(graph, streams, machine, costs, order, *, memory_budget=None, prep=None):
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


_POLICY_FNS = {
    "serial": serial,
    "round_robin": round_robin,
    "heft": heft,
    "nimble": nimble,
    "stages": stages,
}


# -- syncs -------------------------------------------------------------------------------
def minimal_syncs(graph: nx.DiGraph, placement, order, streams, prep=None) -> tuple[Sync, ...]:
    """Syncs for the cross-stream data edges, dropping those already implied.

    With vector clocks (``clock[v][s]`` = how far stream ``s`` is known to have got when
    ``v`` starts, through stream order and earlier syncs), an edge ``u -> v`` on one device
    needs no sync when ``clock[v][stream(u)] >= index(u)``. Cross-device edges always keep
    their own sync (it is also the copy).

    Example::

        >>> from autopar.planning.taskgraph import chain_graph
        >>> g = chain_graph([1.0, 1.0, 1.0])
        >>> [s.dst for s in minimal_syncs(g, {"g0.fw/n0": 0, "g0.fw/n1": 1, "g0.fw/n2": 1},
        ...                               list(g), [Stream(0), Stream(1)])]
        ['g0.fw/n1']
    """
    device = {s.id: s.device for s in streams}
    col = {s: i for i, s in enumerate(sorted(device))}
    seq, counters = {}, dict.fromkeys(device, 0)
    for n in order:
        seq[n] = counters[placement[n]]
        counters[placement[n]] += 1
    known = {s: [-1] * len(col) for s in device}
    clock: dict[str, list[int]] = {}
    out = []
    pred = prepare(graph, prep).pred
    for v in order:
        sv = placement[v]
        c = list(known[sv])
        cross = [(u, b) for u, b in pred[v] if placement[u] != sv]
        cross.sort(key=lambda e: (placement[e[0]], -seq[e[0]]))
        for u, nbytes in cross:
            su = placement[u]
            if device[su] == device[sv] and c[col[su]] >= seq[u]:
                continue
            out.append(Sync(u, v, su, sv, int(nbytes)))
            c = [max(a, b) for a, b in zip(c, clock[u], strict=True)]
        c[col[sv]] = seq[v]
        clock[v] = c
        known[sv] = c
    return tuple(out)


# -- make_plan ---------------------------------------------------------------------------
def default_machine(store=None, device: str = "cpu") -> MachineModel:
    """The calibrated model of this machine's ``device``, measured once per process."""
    if device not in _MACHINE_CACHE:
        from autopar.planning.costmodel import calibrate

        _MACHINE_CACHE[device] = calibrate(store, device=device)
    return _MACHINE_CACHE[device]


def graph_device(graph: nx.DiGraph) -> str:
    """The device a task graph's tensors live on (``"cpu"`` or ``"cuda:N"``): the most
    common non-empty ``device`` attribute of its nodes."""
    devices = Counter(str(a.get("device") or "") for _, a in graph.nodes(data=True))
    devices.pop("", None)
    devices.pop("nan", None)
    return devices.most_common(1)[0][0] if devices else "cpu"


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.3f} ms"


def _split_graphs(graph: nx.DiGraph) -> list[nx.DiGraph] | None:
    """One subgraph per graph tag (in order of first appearance) when no edge crosses."""
    tags = list(dict.fromkeys(a.get("graph", "") for _, a in graph.nodes(data=True)))
    if len(tags) < 2:
        return None
    tag = nx.get_node_attributes(graph, "graph")
    if any(tag.get(u) != tag.get(v) for u, v in graph.edges()):
        return None
    return [graph.subgraph([n for n in graph if tag.get(n) == t]).copy() for t in tags]


def make_plan(
    graph_or_df,
    *,
    streams=None,
    policy: str = "auto",
    machine: MachineModel | None = None,
    memory_budget: int | None = None,
    graph_id: str = "model",
    store=None,
) -> Plan:
    """Plan a task graph (or a profile table): place, order and synchronise every node.

    ``streams``: ``None`` tries the layouts of ``costmodel.thread_layouts``; an int ``k`` plans
    for ``k`` streams (``cores // k`` threads each, plus a mixed layout); a list of
    ``Stream`` is used as given. ``policy``: one of ``POLICIES`` or ``"auto"`` (every
    applicable policy on every layout, simulated; the fastest that fits
    ``memory_budget`` wins, and serial is a candidate, so it is never predicted slower
    than serial). ``machine``: the cost model's constants (``None`` calibrates once per
    process, persisting in ``store`` when given). A table or graph holding several graph
    tags (forward and backward) is planned per graph and combined with ``Plan.combine``.

    Raises ``PlanError`` when even the serial plan exceeds ``memory_budget``.

    Example::

        >>> from autopar.planning.taskgraph import fork_join_graph
        >>> g = fork_join_graph([[1e-3] * 3, [1e-3] * 3])
        >>> p = make_plan(g, policy="heft", streams=2, machine=MachineModel.default_cpu())
        >>> len(p.streams), len(p.syncs)
        (2, 2)
    """
    if policy != "auto" and policy not in POLICIES:
        raise PlanError(f"unknown policy {policy!r}; use 'auto' or one of {POLICIES}")
    t0 = time.perf_counter()
    if isinstance(graph_or_df, nx.DiGraph):
        graph, prov = graph_or_df, []
    else:
        from autopar.planning.taskgraph import task_graph_from_profile

        graph = task_graph_from_profile(graph_or_df)
        prov = [("pass:taskgraph", _ms(time.perf_counter() - t0))]
    machine = machine or default_machine(store, graph_device(graph))
    parts = _split_graphs(graph)
    if parts is None:
        return _plan_graph(graph, streams, policy, machine, memory_budget, graph_id, prov)
    plans = [
        _plan_graph(
            g, streams, policy, machine, memory_budget, next(iter(g.nodes.values()))["graph"], []
        )
        for g in parts
    ]
    plan = Plan.combine(plans, graph_id=graph_id)
    plan = plan.replace(provenance=tuple(prov) + plan.provenance)
    verify_plan(plan, graph, memory_budget)
    return plan


def _plan_graph(graph, streams, policy, machine, budget, graph_id, prov) -> Plan:
    serial_streams, layouts = stream_layouts(streams, machine)
    if policy == "serial":
        layouts = [("serial", serial_streams)]
    node_info = tuple(
        (
            n,
            a.get("phase", ""),
            int(a.get("flops", 0)),
            int(a.get("bytes_read", 0)) + int(a.get("bytes_written", 0)),
        )
        for n, a in graph.nodes(data=True)
    )
    edges = tuple((u, v, int(b)) for u, v, b in graph.edges(data="bytes", default=0))
    chains: list | None = None
    candidates: list[tuple[Plan, int]] = []
    bounds = []
    prep = Prepared(graph)
    cache: dict = {}  # (device, threads) -> node costs, shared by the layouts

    def build(pol, lname, lstreams, costs, order, serial_time, lb, extra=None) -> Plan:
        nonlocal chains
        t = time.perf_counter()
        kw = dict(extra or {}, prep=prep)
        if pol == "nimble":
            if chains is None:
                chains = chain_cover(graph, prep)
            kw["chains"] = chains
        place, order = _POLICY_FNS[pol](graph, lstreams, machine, costs, order, **kw)
        sim = simulate(graph, place, order, list(lstreams), machine, costs=costs, prep=prep)
        used = {place[n] for n in order}
        plan = Plan(
            graph_id=graph_id,
            policy=pol,
            streams=tuple(s for s in lstreams if s.id in used),
            placements=tuple(sorted(place.items())),
            order=tuple(order),
            syncs=minimal_syncs(graph, place, order, lstreams, prep),
            predicted_step_time=sim.makespan,
            serial_time=sim.makespan if serial_time is None else serial_time,
            lower_bound=lb,
            predicted_peak_memory=sim.peak_memory,
            memory_budget=budget,
            timeline=sim.timeline(),
            node_info=node_info,
            edges=edges,
            notes=(f"layout {lname}: " + ", ".join(_describe(s) for s in lstreams),),
        )
        verify_plan(plan, graph, memory_budget=float("inf"))
        candidates.append((plan, len(candidates)))
        prov.append(
            (
                f"pass:{pol}[{lname}]",
                f"{_ms(time.perf_counter() - t)} -> "
                f"predicted {_ms(sim.makespan)}, peak {sim.peak_memory} B",
            )
        )
        return plan

    costs = cost_table(graph, serial_streams, machine, into=cache)
    sorder = rank_order(graph, serial_streams, machine, costs, prep)
    bounds.append(lower_bound(graph, serial_streams, machine, costs=costs, prep=prep))
    ser = build("serial", "serial", serial_streams, costs, sorder, None, bounds[0])
    serial_time = ser.predicted_step_time
    wanted = [policy] if policy != "auto" else [p for p in POLICIES if p != "serial"]
    if policy == "stages" and not any(len({s.device for s in ls}) > 1 for _, ls in layouts):
        raise PlanError(
            "policy='stages' splits the graph across devices: pass streams on two or more "
            "devices, e.g. [Stream(0, 'cuda:0'), Stream(1, 'cuda:1')]"
        )
    for lname, lstreams in layouts:
        if policy == "serial":
            break
        costs = cost_table(graph, lstreams, machine, into=cache)
        order = rank_order(graph, lstreams, machine, costs, prep)
        bounds.append(lower_bound(graph, lstreams, machine, costs=costs, prep=prep))
        multi_dev = len({s.device for s in lstreams}) > 1
        for pol in wanted:
            if pol == "stages" and not multi_dev:
                continue
            if pol != "stages" and policy == "auto" and len(lstreams) == 1:
                if lstreams != serial_streams and pol == wanted[0]:
                    # another single-stream layout (e.g. 1x1): its serial plan is a candidate
                    build("serial", lname, lstreams, costs, order, serial_time, bounds[-1])
                continue  # every policy is serial on one stream
            extra = {"memory_budget": budget} if pol == "stages" else None
            build(pol, lname, lstreams, costs, order, serial_time, bounds[-1], extra)
    return _select(candidates, ser, policy, budget, min(bounds), serial_time, graph, machine, prov)


def _describe(s: Stream) -> str:
    return f"stream {s.id} ({s.device}, {s.threads or 'default'} thread(s))"


def _select(candidates, ser, policy, budget, bound, serial_time, graph, machine, prov) -> Plan:
    """Fastest candidate within the budget (serial included in auto); fewer streams and
    earlier candidates win ties."""
    t = time.perf_counter()
    pool = [(p, i) for p, i in candidates if policy == "auto" or p.policy == policy]
    fits = [(p, i) for p, i in pool if budget is None or p.predicted_peak_memory <= budget]
    notes = []
    if not fits:
        if budget is not None and ser.predicted_peak_memory > budget:
            raise PlanError(
                f"no plan fits memory_budget={budget} bytes: even the serial plan needs "
                f"{ser.predicted_peak_memory} bytes at peak; raise the budget (or use "
                "activation checkpointing to shrink the graph)"
            )
        fits = [(ser, -1)]
        best_over = min(pool, key=lambda c: c[0].predicted_step_time)[0]
        notes.append(
            f"memory: {policy} needs {best_over.predicted_peak_memory} B > budget {budget} B; "
            "fell back to serial"
        )
    best = min(fits, key=lambda c: (c[0].predicted_step_time, len(c[0].streams), c[1]))[0]
    if budget is not None and len(fits) < len(pool):
        notes.append(f"memory: {len(pool) - len(fits)} candidate plan(s) over budget {budget} B")
    notes.append(
        f"chose {best.policy}: predicted {_ms(best.predicted_step_time)} vs serial "
        f"{_ms(serial_time)} ({serial_time / max(best.predicted_step_time, 1e-30):.2f}x), "
        f"lower bound {_ms(bound)}"
    )
    notes.append(_intra_op_note(best, graph, machine))
    prov.append(("pass:select", _ms(time.perf_counter() - t)))
    prov.append(
        ("machine", f"{machine.source}: {machine.cores} cores, sync {_ms(machine.sync_cost_s)}")
    )
    plan = best.replace(
        lower_bound=bound,
        notes=best.notes + tuple(notes),
        provenance=tuple(prov),
    )
    verify_plan(plan, graph, budget)
    return plan


def _intra_op_note(plan: Plan, graph, machine) -> str:
    """Which ops the cost model says want intra-op threads, and where they ended up."""
    want = [n for n, a in graph.nodes(data=True) if wants_intra_op(a, machine)]
    if not want:
        return "intra-op: no op scales well with threads; concurrency is the lever"
    threads = {s.id: s.threads for s in plan.streams}
    place = plan.placement
    on = Counter(threads[place[n]] for n in want)
    kinds = Counter(graph.nodes[n].get("target", "?") for n in want).most_common(3)
    where = ", ".join(f"{c} on {k}-thread stream(s)" for k, c in sorted(on.items()))
    what = ", ".join(f"{t} x{c}" for t, c in kinds)
    return f"intra-op: {len(want)} op(s) scale with threads ({what}); {where}"
