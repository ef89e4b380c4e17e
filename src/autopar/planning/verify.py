"""The plan verifier: a plan that passes runs correctly and cannot deadlock.

``verify_plan`` checks, and raises ``PlanError`` naming the first problem and its fix:

1. streams have unique ids; every node is placed exactly once, on a declared stream;
   with ``graph`` given, the placed nodes are exactly the graph's nodes;
2. ``order`` lists every placed node exactly once;
3. with ``graph`` given, its random ops (``listsched.rng_nodes``) keep graph order in
   ``order``: they share the global generator, and another order changes every draw
   (codegen refuses such a plan, so a planner that made one would leave the graph
   unplanned);
4. every sync joins two different streams and names its nodes' streams correctly;
5. no deadlock: data edges and syncs go forward in ``order`` (each stream runs its nodes
   in ``order``, so the union of stream order, syncs and data edges is then acyclic);
   when one goes backward, the cycle (if any) is reported;
6. every cross-stream data dependency ``u -> v`` is covered: on one device, by a chain
   of syncs and stream order (checked with ``clocks.VectorClocks``: ``v``'s stream must
   know that ``u``'s stream got at least as far as ``u``); across devices, by its own sync
   (the sync is also the copy);
7. the predicted peak memory is within the budget.

Example::

    >>> from autopar.planning.plan import Plan, Stream
    >>> p = Plan("g", "serial", (Stream(0),), (("a", 0), ("b", 0)), ("a", "b"), (),
    ...          edges=(("a", "b", 8),))
    >>> verify_plan(p)       # passes silently
    >>> verify_plan(p.replace(order=("b", "a")))
    Traceback (most recent call last):
    ...
    autopar.errors.PlanError: plan 'g' deadlocks: cycle a -> b -> a ...
"""

from __future__ import annotations

from collections import Counter, defaultdict

import networkx as nx

from autopar.errors import PlanError
from autopar.planning.clocks import VectorClocks
from autopar.planning.listsched import rng_nodes
from autopar.planning.plan import Plan


def _fail(plan: Plan, what: str, fix: str) -> None:
    raise PlanError(f"plan {plan.graph_id!r} {what}; {fix}")


def _edges(plan: Plan, graph: nx.DiGraph | None) -> list[tuple[str, str]]:
    if graph is None:
        return [(u, v) for u, v, _ in plan.edges]
    return list(graph.edges())


def verify_plan(plan: Plan, graph: nx.DiGraph | None = None, memory_budget: int | None = None):
    """Raise ``PlanError`` if ``plan`` is not runnable (see the module docstring).

    ``graph`` is the task graph the plan was made for (its nodes and edges are then the
    reference); without it the plan's own ``edges`` are used. ``memory_budget`` overrides
    ``plan.memory_budget``.
    """
    # 1. streams and placements
    sid_counts = Counter(s.id for s in plan.streams)
    dup_sids = [s for s, c in sid_counts.items() if c > 1]
    if dup_sids:
        _fail(plan, f"declares stream id(s) {dup_sids} more than once", "give each stream its id")
    names = Counter(n for n, _ in plan.placements)
    dups = [n for n, c in names.items() if c > 1]
    if dups:
        _fail(plan, f"places node(s) {dups[:5]} more than once", "place every node exactly once")
    place = plan.placement
    bad = [(n, s) for n, s in place.items() if s not in sid_counts]
    if bad:
        _fail(plan, f"places {bad[:3]} on undeclared stream(s)", "declare every stream used")
    if graph is not None:
        missing = [n for n in graph if n not in place]
        if missing:
            _fail(plan, f"does not place node(s) {missing[:5]}", "place every node of the graph")
        extra = [n for n in place if n not in graph]
        if extra:
            _fail(plan, f"places node(s) {extra[:5]} absent from the graph", "re-plan this graph")
    # 2. order
    order_counts = Counter(plan.order)
    twice = [n for n, c in order_counts.items() if c > 1]
    if twice:
        _fail(plan, f"lists node(s) {twice[:5]} more than once in order", "list each node once")
    unordered = [n for n in place if n not in order_counts]
    if unordered:
        _fail(plan, f"leaves placed node(s) {unordered[:5]} out of order", "order every node")
    unplaced = [n for n in order_counts if n not in place]
    if unplaced:
        _fail(plan, f"orders node(s) {unplaced[:5]} that are not placed", "place them")
    # 3. random ops in graph order
    if graph is not None:
        _check_rng_order(plan, graph)
    # 4. syncs
    for s in plan.syncs:
        for n in (s.src, s.dst):
            if n not in place:
                _fail(plan, f"has a sync {s.src} -> {s.dst} naming unplaced node {n!r}", "fix it")
        if place[s.src] != s.src_stream or place[s.dst] != s.dst_stream:
            _fail(
                plan,
                f"has a sync {s.src} -> {s.dst} on streams {s.src_stream} -> {s.dst_stream} "
                f"but the nodes run on {place[s.src]} -> {place[s.dst]}",
                "re-derive the syncs from the placement",
            )
        if s.src_stream == s.dst_stream:
            _fail(plan, f"has a sync {s.src} -> {s.dst} within stream {s.src_stream}", "drop it")
    # 5. deadlock freedom
    edges = _edges(plan, graph)
    pos = {n: i for i, n in enumerate(plan.order)}
    backward = [(u, v) for u, v in edges if pos[u] >= pos[v]]
    backward += [(s.src, s.dst) for s in plan.syncs if pos[s.src] >= pos[s.dst]]
    if backward:
        g = nx.DiGraph(edges)
        g.add_edges_from((s.src, s.dst) for s in plan.syncs)
        for nodes in plan.stream_nodes().values():
            g.add_edges_from(zip(nodes, nodes[1:], strict=False))
        try:
            cycle = nx.find_cycle(g)
        except nx.NetworkXNoCycle:
            u, v = backward[0]
            _fail(plan, f"order is not topological: {u} runs after its consumer {v}", "sort it")
        path = " -> ".join([cycle[0][0]] + [e[1] for e in cycle])
        _fail(
            plan,
            f"deadlocks: cycle {path} (data/sync edges and stream order)",
            "order nodes topologically and sync only forward in that order",
        )
    # 6. every cross-stream dependency is synchronised
    _check_coverage(plan, edges, place)
    # 7. memory
    budget = memory_budget if memory_budget is not None else plan.memory_budget
    if budget is not None and plan.predicted_peak_memory > budget:
        _fail(
            plan,
            f"needs {plan.predicted_peak_memory} bytes at peak, over the budget of {budget} bytes",
            "raise memory_budget or plan with less concurrency (policy='serial')",
        )


def _check_rng_order(plan: Plan, graph: nx.DiGraph) -> None:
    """Random ops of one graph tag run in graph order (module docstring, item 3)."""
    pos = {n: i for i, n in enumerate(plan.order)}
    last: dict[str, str] = {}
    for n in rng_nodes(graph):
        tag = str(graph.nodes[n].get("graph", ""))
        prev = last.get(tag)
        if prev is not None and pos[prev] > pos[n]:
            _fail(
                plan,
                f"runs random op {n} before {prev}, which precedes it in the graph: they "
                "share the global generator, so results would differ from eager",
                "keep random ops in graph order (plan with make_plan: it adds ordering edges)",
            )
        last[tag] = n


def _check_coverage(plan: Plan, edges, place: dict[str, int]) -> None:
    """Every cross-stream data edge ``u -> v`` is implied, when ``v`` starts, by stream order
    and syncs (``clocks.VectorClocks``: ``v``'s stream knows ``u`` finished); a cross-device
    edge also needs its own sync (the copy)."""
    device = {s.id: s.device for s in plan.streams}
    syncs_into = defaultdict(list)
    direct = set()
    for s in plan.syncs:
        syncs_into[s.dst].append(s.src)
        direct.add((s.src, s.dst))
    preds = defaultdict(list)
    for u, v in edges:
        if place[u] != place[v]:
            preds[v].append(u)
    clocks = VectorClocks()
    for v in plan.order:
        sv = place[v]
        for u in syncs_into.get(v, ()):
            clocks.wait(sv, u)
        for u in preds.get(v, ()):
            su = place[u]
            if device[su] != device[sv] and (u, v) not in direct:
                _fail(
                    plan,
                    f"copies {u} (stream {su}, {device[su]}) to {v} (stream {sv}, "
                    f"{device[sv]}) without a sync",
                    "add a Sync for every cross-device edge",
                )
            if not clocks.knows(sv, u):
                _fail(
                    plan,
                    f"misses a sync: {v} (stream {sv}) reads {u} (stream {su}) and nothing "
                    "makes it wait for it",
                    f"add Sync({u!r}, {v!r}, {su}, {sv})",
                )
        clocks.run(sv, v)
