"""``make_plan``: place every node on a stream, order each stream, derive the syncs, simulate,
verify, and keep the best candidate.

The policies themselves, and their registry ``POLICIES``, are in
``autopar.planning.policies`` (re-exported here); the list scheduler they share with the
simulator's callers is ``autopar.planning.listsched``; the sync reduction uses the vector
clocks of ``autopar.planning.clocks``.

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

from autopar.errors import PlanError
from autopar.planning.clocks import VectorClocks
from autopar.planning.costmodel import MachineModel, stream_layouts, wants_intra_op
from autopar.planning.listsched import rank_order, with_rng_order
from autopar.planning.plan import Plan, Stream, Sync
from autopar.planning.policies import AUTO, POLICIES
from autopar.planning.simulate import Prepared, cost_table, lower_bound, prepare, simulate
from autopar.planning.verify import verify_plan

_MACHINE_CACHE: dict[str, MachineModel] = {}


# -- syncs -------------------------------------------------------------------------------
def minimal_syncs(graph: nx.DiGraph, placement, order, streams, prep=None) -> tuple[Sync, ...]:
    """Syncs for the cross-stream data edges, dropping those already implied.

    With vector clocks (``clocks.VectorClocks``: how far each stream is known to have got
    when ``v`` starts, through stream order and earlier syncs), an edge ``u -> v`` on one
    device needs no sync when ``v``'s stream already knows ``u`` finished. Cross-device
    edges always keep their own sync (it is also the copy).

    Example::

        >>> from autopar.planning.taskgraph import chain_graph
        >>> g = chain_graph([1.0, 1.0, 1.0])
        >>> [s.dst for s in minimal_syncs(g, {"g0.fw/n0": 0, "g0.fw/n1": 1, "g0.fw/n2": 1},
        ...                               list(g), [Stream(0), Stream(1)])]
        ['g0.fw/n1']
    """
    device = {s.id: s.device for s in streams}
    clocks = VectorClocks()
    out = []
    pred = prepare(graph, prep).pred
    for v in order:
        sv = placement[v]
        cross = [(u, b) for u, b in pred[v] if placement[u] != sv]
        late = [u for u, _ in cross if u not in clocks.index]
        if late:  # (a policy's bad order: fail as the verifier would, not with a KeyError)
            u = late[0]
            if graph.edges[u, v].get("order"):  # listsched.with_rng_order's edge
                raise PlanError(
                    f"order runs random op {v} before {u}, which precedes it in the graph; "
                    "keep random ops in graph order"
                )
            raise PlanError(f"order is not topological: {u} runs after its consumer {v}")
        # per source stream, its latest producer first: it implies the earlier ones
        cross.sort(key=lambda e: (placement[e[0]], -clocks.index[e[0]]))
        far = {u for u, _ in cross if device[placement[u]] != device[sv]}  # copies: keep
        nbytes = dict(cross)
        for u in clocks.reduce(sv, [u for u, _ in cross], keep=far.__contains__):
            out.append(Sync(u, v, placement[u], sv, int(nbytes[u])))
        clocks.run(sv, v)
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
    ``Stream`` is used as given. ``policy``: one of ``POLICY_NAMES``, i.e. a ``POLICIES``
    entry or ``"auto"`` (every applicable policy on every layout, simulated; the fastest
    that fits ``memory_budget`` wins, and serial is a candidate, so it is never predicted
    slower than serial). ``machine``: the cost model's constants (``None`` calibrates once per
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
    if policy != AUTO and policy not in POLICIES:
        raise PlanError(f"unknown policy {policy!r}; use 'auto' or one of {tuple(POLICIES)}")
    t0 = time.perf_counter()
    if isinstance(graph_or_df, nx.DiGraph):
        graph, prov = graph_or_df, []
    else:
        from autopar.planning.taskgraph import task_graph_from_profile

        graph = task_graph_from_profile(graph_or_df)
        prov = [("pass:taskgraph", _ms(time.perf_counter() - t0))]
    # Random ops keep graph order in every candidate: ordering edges between them (see
    # listsched.with_rng_order), which the policies, syncs, simulator and verifier all see.
    ordered = with_rng_order(graph)
    if ordered is not graph:
        added = ordered.number_of_edges() - graph.number_of_edges()
        prov.append(("pass:rng-order", f"{added} ordering edge(s) keep random ops in order"))
        graph = ordered
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
    shared: dict = {}  # the policies' layout-independent work (nimble's chain cover)
    candidates: list[tuple[Plan, int]] = []
    bounds = []
    prep = Prepared(graph)
    cache: dict = {}  # (device, threads) -> node costs, shared by the layouts

    def build(pol, lname, lstreams, costs, order, serial_time, lb) -> Plan | None:
        """One candidate; under auto, a policy whose plan fails (the simulator finds a
        deadlock, the verifier a fault) costs that candidate only, since serial is always
        one (a forced policy's failure, and serial's, still raise)."""
        try:
            return candidate(pol, lname, lstreams, costs, order, serial_time, lb)
        except PlanError as exc:
            if policy != AUTO or pol == "serial":
                raise
            prov.append((f"pass:{pol}[{lname}]", f"rejected: {exc}"))
            return None

    def candidate(pol, lname, lstreams, costs, order, serial_time, lb) -> Plan:
        t = time.perf_counter()
        place, order = POLICIES[pol].fn(
            graph, lstreams, machine, costs, order, prep=prep, memory_budget=budget, shared=shared
        )
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
    wanted = [policy] if policy != AUTO else [p for p in POLICIES if p != "serial"]
    multi = [len({s.device for s in ls}) > 1 for _, ls in layouts]
    if policy != AUTO and POLICIES[policy].multi_device and not any(multi):
        raise PlanError(
            f"policy={policy!r} splits the graph across devices: pass streams on two or more "
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
            if POLICIES[pol].multi_device and not multi_dev:
                continue
            if policy == AUTO and len(lstreams) == 1:  # (a multi-device layout has 2+)
                if lstreams != serial_streams and pol == wanted[0]:
                    # another single-stream layout (e.g. 1x1): its serial plan is a candidate
                    build("serial", lname, lstreams, costs, order, serial_time, bounds[-1])
                continue  # every policy is serial on one stream
            build(pol, lname, lstreams, costs, order, serial_time, bounds[-1])
    return _select(candidates, ser, policy, budget, min(bounds), serial_time, graph, machine, prov)


def _describe(s: Stream) -> str:
    return f"stream {s.id} ({s.device}, {s.threads or 'default'} thread(s))"


def _select(candidates, ser, policy, budget, bound, serial_time, graph, machine, prov) -> Plan:
    """Fastest candidate within the budget (serial included in auto); fewer streams and
    earlier candidates win ties."""
    t = time.perf_counter()
    pool = [(p, i) for p, i in candidates if policy == AUTO or p.policy == policy]
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
