"""Discrete-event simulator of a placement: predicted step time, utilisation, peak memory.

The model (formulas in docs/cost-model.md):

* Each stream runs its nodes one at a time, in the order given by ``order``.
* A node starts when its stream is free and every producer has finished; a producer on
  another stream adds ``sync_time`` (a cross-stream wait), plus ``transfer_time(bytes)``
  when the streams are on different devices.
* A node's uncontended cost is ``costmodel.node_time`` at its stream's thread count.
* CPU contention: while the CPU ops running at once use ``X`` threads in total and
  ``X > machine.cores``, every one of them progresses at rate ``cores / X`` (processor
  sharing, as an OS scheduler time-slices oversubscribed threads); a multi-threaded op
  (an OpenMP team) then progresses at only ``OVERSUBSCRIBED_TEAM_RATE`` of that share: its
  threads meet at barriers, and a descheduled team member leaves the others spinning.
  CUDA streams are not slowed by each other (optimistic: kernels that fill the GPU do
  serialise).
* Memory: a node's output bytes (0 for views) are alive from its finish until its last
  consumer finishes (or only at its finish when nothing reads it); at equal times
  allocations count before frees, since an op's output and inputs coexist while it runs.

Example::

    >>> from autopar.planning.taskgraph import fork_join_graph
    >>> from autopar.planning.costmodel import MachineModel
    >>> from autopar.planning.plan import Stream
    >>> g = fork_join_graph([[1e-3], [1e-3]])
    >>> m = MachineModel.default_cpu()
    >>> order = list(g)
    >>> place = {n: i % 2 for i, n in enumerate(order)}
    >>> r = simulate(g, place, order, [Stream(0, "cpu", 1), Stream(1, "cpu", 1)], m)
    >>> round(r.makespan * 1e3, 3)   # two 1 ms branches in parallel + 1 sync
    1.02
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import networkx as nx
import numpy as np

from autopar.errors import PlanError
from autopar.planning.costmodel import MachineModel, node_time, sync_time, transfer_time
from autopar.planning.plan import Stream

#: Extra slowdown of a multi-threaded CPU op while the CPU is oversubscribed (its share of
#: the cores times this). Measured on the 2-core box: a 2-thread stream running chunked
#: oneDNN LSTM layers beside a 1-thread stream took 32 ms against 23 ms for the same ops
#: one after the other at 2 threads (fair processor sharing predicts about equal), and
#: 2-thread OpenMP ops stalled 10-100x while another process held a core. 0.25 makes the
#: simulator avoid overlapping a team op with other work, which is what measurements reward.
OVERSUBSCRIBED_TEAM_RATE = 0.25

#: A stream configuration: (device, intra-op threads). Streams with the same
#: configuration share a cost table.
Config = tuple[str, int]


def stream_config(stream: Stream, machine: MachineModel) -> Config:
    """``(device, threads)`` with ``threads == 0`` on CPU resolved to ``machine.cores``."""
    threads = stream.threads
    if stream.device == "cpu" and threads <= 0:
        threads = machine.cores
    return stream.device, threads


def cost_table(
    graph: nx.DiGraph, streams, machine: MachineModel, *, into: dict | None = None
) -> dict[Config, dict]:
    """Uncontended cost of every node on every stream configuration; entries already in
    ``into`` (a table from an earlier call on the same graph) are reused.

    Example::

        >>> from autopar.planning.taskgraph import chain_graph
        >>> t = cost_table(chain_graph([1.0]), [Stream(0, "cpu", 1)],
        ...                MachineModel.default_cpu())
        >>> t[("cpu", 1)]
        {'g0.fw/n0': 1.0}
    """
    out: dict[Config, dict] = {}
    for s in streams:
        cfg = stream_config(s, machine)
        if cfg in out:
            continue
        if into is not None and cfg in into:
            out[cfg] = into[cfg]
            continue
        dev, k = cfg
        out[cfg] = {n: node_time(a, k, machine, dev) for n, a in graph.nodes(data=True)}
        if into is not None:
            into[cfg] = out[cfg]
    return out


class Prepared:
    """Adjacency of a task graph as plain lists, built once and shared by the simulator,
    the bounds and the partitioners (networkx views are slow in tight loops)."""

    def __init__(self, graph: nx.DiGraph):
        self.graph = graph
        self.topo: list[str] = list(nx.topological_sort(graph))
        self.succ = {n: [(v, d.get("bytes", 0)) for v, d in graph.succ[n].items()] for n in graph}
        self.pred = {n: [(u, d.get("bytes", 0)) for u, d in graph.pred[n].items()] for n in graph}
        self.size = {
            n: 0 if a.get("is_view") else int(a.get("output_bytes", 0))
            for n, a in graph.nodes(data=True)
        }


def prepare(graph: nx.DiGraph, prep: Prepared | None = None) -> Prepared:
    """``prep`` when it was built for ``graph``, else a new ``Prepared``."""
    return prep if prep is not None and prep.graph is graph else Prepared(graph)


def edge_delay(src_stream: Stream, dst_stream: Stream, nbytes: int, machine) -> float:
    """Extra latency of a data edge between two streams: 0 on the same stream, else
    ``sync_time``, plus ``transfer_time(nbytes)`` across devices. The one communication
    rule of the planner: the simulator and the list scheduler both charge it."""
    if src_stream.id == dst_stream.id:
        return 0.0
    d = sync_time(machine)
    if src_stream.device != dst_stream.device:
        d += transfer_time(nbytes, machine)
    return d


@dataclass
class SimResult:
    """What the simulator predicts for one placement (times in seconds)."""

    makespan: float
    start: dict[str, float]
    finish: dict[str, float]
    cost: dict[str, float]
    placement: dict[str, int]
    order: list[str]
    busy: dict[int, float]
    peak_memory: int
    streams: list[Stream] = field(default_factory=list)

    def timeline(self) -> tuple[tuple[str, float, float, float], ...]:
        """``(node, start, finish, cost)`` in plan order (the ``Plan.timeline`` field)."""
        return tuple((n, self.start[n], self.finish[n], self.cost[n]) for n in self.order)


def simulate(
    graph: nx.DiGraph,
    placement: dict[str, int],
    order: list[str],
    streams: list[Stream],
    machine: MachineModel,
    *,
    costs: dict[Config, dict] | None = None,
    prep: Prepared | None = None,
) -> SimResult:
    """Simulate ``graph`` with each node on ``placement[node]``, each stream running its
    nodes in ``order``. ``costs`` (from ``cost_table``) and ``prep`` (a ``Prepared`` of
    ``graph``) save recomputing them across calls.

    Raises ``PlanError`` if the placement misses a node or the order deadlocks.
    See the module docstring for the model and an example.
    """
    smap = {s.id: s for s in streams}
    missing = [n for n in graph if n not in placement]
    if missing or len(order) != graph.number_of_nodes():
        raise PlanError(
            f"simulate: {len(missing)} node(s) unplaced (e.g. {missing[:3]}) or order has "
            f"{len(order)} entries for {graph.number_of_nodes()} nodes; place every node once"
        )
    if costs is None:
        costs = cost_table(graph, streams, machine)
    prep = prepare(graph, prep)
    succ = prep.succ
    cfg = {sid: stream_config(s, machine) for sid, s in smap.items()}
    try:
        cost = {n: costs[cfg[placement[n]]][n] for n in order}
    except KeyError as e:
        raise PlanError(f"simulate: node placed on unknown stream or missing cost: {e}") from e
    queues: dict[int, list[str]] = {sid: [] for sid in smap}
    for n in order:
        queues[placement[n]].append(n)
    npred = {n: len(prep.pred[n]) for n in order}
    ready = dict.fromkeys(order, 0.0)
    ptr = dict.fromkeys(queues, 0)
    # sid -> [node, remaining uncontended seconds of the current phase, phase]; phase is
    # "gil" (the op's Python dispatch, holding the GIL) or "run" (the kernel, GIL released)
    running: dict[int, list] = {}
    start: dict[str, float] = {}
    finish: dict[str, float] = {}
    is_cpu = {sid: s.device == "cpu" for sid, s in smap.items()}
    threads = {sid: cfg[sid][1] for sid in smap}
    cores = machine.cores
    t, done, total = 0.0, 0, len(order)
    sids = list(queues)
    # The GIL: with two or more CPU streams in use, each op's first ``gil_s`` seconds (its
    # Python-side dispatch in the generated code) hold the interpreter lock, so those parts
    # of concurrent ops run one at a time. One CPU stream runs straight-line code: no
    # contention, nothing to model.
    cpu_used = {sid for sid in queues if is_cpu[sid] and queues[sid]}
    gil = getattr(machine, "gil_s", 0.0) if len(cpu_used) > 1 else 0.0
    gil_owner: int | None = None
    gil_queue: list[int] = []

    def release(n: str) -> None:
        """``n`` finished at ``t``: each consumer is ready no earlier than ``t`` plus the
        edge's ``edge_delay`` (the rule ``listsched.eft_schedule`` places by)."""
        sn = smap[placement[n]]
        for v, nbytes in succ[n]:
            npred[v] -= 1
            d = t + edge_delay(sn, smap[placement[v]], nbytes, machine)
            if d > ready[v]:
                ready[v] = d

    def begin(sid: int, h: str) -> None:
        """Start node ``h`` on ``sid``: first its GIL phase (if modelled), then its kernel."""
        nonlocal gil_owner
        start[h] = t
        if gil > 0.0 and is_cpu[sid]:
            gil_owner = sid
            running[sid] = [h, min(gil, cost[h]), "gil"]
        else:
            running[sid] = [h, cost[h], "run"]

    while done < total:
        progressed = True
        while progressed:  # start everything that can start now; zero-cost nodes finish now
            progressed = False
            for sid in sids:
                q = queues[sid]
                if sid in running or sid in gil_queue or ptr[sid] >= len(q):
                    continue
                h = q[ptr[sid]]
                if npred[h] == 0 and ready[h] <= t:
                    if cost[h] <= 0.0:
                        ptr[sid] += 1
                        start[h] = finish[h] = t
                        done += 1
                        release(h)
                        progressed = True
                    elif gil > 0.0 and is_cpu[sid] and gil_owner is not None:
                        gil_queue.append(sid)  # waits for the interpreter lock
                    else:
                        ptr[sid] += 1
                        begin(sid, h)
        if done == total:
            break
        x = sum(
            threads[sid] if ph == "run" else 1 for sid, (_, _, ph) in running.items() if is_cpu[sid]
        )
        cpu_rate = cores / x if x > cores else 1.0

        rate = {  # an OpenMP team under oversubscription: see OVERSUBSCRIBED_TEAM_RATE
            sid: 1.0
            if not is_cpu[sid]
            else cpu_rate * OVERSUBSCRIBED_TEAM_RATE
            if cpu_rate < 1.0 and threads[sid] > 1 and ph == "run"
            else cpu_rate
            for sid, (_, _, ph) in running.items()
        }
        next_t, first = math.inf, None
        for sid, (_h, rem, _ph) in running.items():
            f = t + rem / rate[sid]
            if f < next_t:
                next_t, first = f, sid
        for sid in sids:
            if sid not in running and sid not in gil_queue and ptr[sid] < len(queues[sid]):
                h = queues[sid][ptr[sid]]
                if npred[h] == 0 and ready[h] < next_t:
                    next_t, first = ready[h], None
        if next_t == math.inf:
            heads = [queues[s][ptr[s]] for s in sids if ptr[s] < len(queues[s])]
            raise PlanError(
                f"simulate: the plan deadlocks at t={t:.6g}s: stream heads {heads[:4]} wait "
                "for producers queued behind them; make `order` a topological order"
            )
        dt = next_t - t
        t = next_t
        for sid in list(running):
            node, rem, phase = running[sid]
            rem -= dt * rate[sid]
            if sid == first or rem <= 1e-9 * cost[node]:
                if phase == "gil":  # dispatch done: release the GIL, run the kernel
                    gil_owner = None
                    rest = cost[node] - min(gil, cost[node])
                    if rest > 1e-12 * cost[node]:
                        running[sid] = [node, rest, "run"]
                        continue
                finish[node] = t
                done += 1
                del running[sid]
                release(node)
            else:
                running[sid][1] = rem
        if gil_owner is None and gil_queue:  # the next waiting stream takes the GIL
            sid = gil_queue.pop(0)
            ptr[sid] += 1
            begin(sid, queues[sid][ptr[sid] - 1])
    makespan = max(finish.values(), default=0.0)
    busy = dict.fromkeys(smap, 0.0)
    for n in order:
        busy[placement[n]] += finish[n] - start[n]
    return SimResult(
        makespan=makespan,
        start=start,
        finish=finish,
        cost=cost,
        placement=dict(placement),
        order=list(order),
        busy=busy,
        peak_memory=peak_memory(graph, finish, prep=prep),
        streams=list(streams),
    )


def peak_memory(graph: nx.DiGraph, finish: dict[str, float], *, prep=None) -> int:
    """Peak of live output bytes (module docstring rule) for given finish times.

    Example::

        >>> from autopar.planning.taskgraph import chain_graph
        >>> g = chain_graph([1.0, 1.0, 1.0])          # 4096-byte outputs
        >>> peak_memory(g, {"g0.fw/n0": 1, "g0.fw/n1": 2, "g0.fw/n2": 3})
        8192
    """
    prep = prepare(graph, prep)
    times, deltas, kinds = [], [], []
    for n, size in prep.size.items():
        if size <= 0:
            continue
        f = finish[n]
        last = max((finish[c] for c, _ in prep.succ[n]), default=f)
        times += [f, last]
        deltas += [size, -size]
        kinds += [0, 1]  # allocation before free at equal times
    if not times:
        return 0
    idx = np.lexsort((np.asarray(kinds), np.asarray(times)))
    return int(np.cumsum(np.asarray(deltas, dtype=np.int64)[idx]).max())


def critical_path(graph: nx.DiGraph, cost: dict[str, float], *, prep=None) -> float:
    """Length of the longest path with node weights ``cost`` (no communication).

    Example::

        >>> from autopar.planning.taskgraph import fork_join_graph
        >>> g = fork_join_graph([[1.0, 2.0], [4.0]])
        >>> critical_path(g, {n: g.nodes[n]["time_1t_s"] for n in g})
        4.0
    """
    prep = prepare(graph, prep)
    best: dict[str, float] = {}
    for n in prep.topo:
        best[n] = cost[n] + max((best[p] for p, _ in prep.pred[n]), default=0.0)
    return max(best.values(), default=0.0)


def lower_bound(
    graph: nx.DiGraph, streams, machine: MachineModel, *, costs: dict | None = None, prep=None
) -> float:
    """``max(critical path, total work / parallel capacity)``: no plan on ``streams`` can
    be faster in the simulator.

    * Critical path: each node at its cheapest cost over the stream configurations, no
      sync or transfer.
    * Work is counted in resource-seconds: a node on a CPU stream with ``k`` threads costs
      ``k * time(k)`` core-seconds, on a CUDA stream ``time``; each node takes its minimum
      over the configurations.
    * Capacity: ``min(cores, total CPU stream threads)`` cores (under contention the CPU
      streams together never progress faster than ``cores``), plus 1 per CUDA stream.

    Example::

        >>> from autopar.planning.taskgraph import fork_join_graph
        >>> g = fork_join_graph([[1.0], [1.0], [1.0]])
        >>> lower_bound(g, [Stream(0, "cpu", 1), Stream(1, "cpu", 1)],
        ...             MachineModel.default_cpu())
        1.5
    """
    if costs is None:
        costs = cost_table(graph, streams, machine)
    cfgs = list({stream_config(s, machine) for s in streams})
    weight = {c: (c[1] if c[0] == "cpu" else 1) for c in cfgs}
    min_cost, work = {}, 0.0
    for n in graph:
        min_cost[n] = min(costs[c][n] for c in cfgs)
        work += min(costs[c][n] * weight[c] for c in cfgs)
    cpu_threads = sum(stream_config(s, machine)[1] for s in streams if s.device == "cpu")
    capacity = min(machine.cores, cpu_threads) + sum(1 for s in streams if s.device != "cpu")
    cp = critical_path(graph, min_cost, prep=prep)
    return max(cp, work / max(capacity, 1))
