"""planning.clocks: the one vector-clock implementation (planner syncs, codegen waits, verifier)
agrees with happens-before computed by brute force (reachability through stream order and
syncs), and reduces waits the way its users rely on."""

from __future__ import annotations

import random

import networkx as nx
from hypothesis import given, settings
from hypothesis import strategies as st

from autopar.planning.clocks import VectorClocks


def test_knowledge_is_transitive_through_waits():
    vc = VectorClocks()
    vc.run(0, "a")
    vc.run(1, "b")
    assert vc.reduce(1, ["a"]) == ["a"]
    vc.run(1, "c")
    assert vc.reduce(2, ["c"]) == ["c"]
    vc.run(2, "d")
    assert vc.knows(2, "a") and vc.knows(2, "b")  # via c's wait for a, and stream 1's order
    assert not vc.knows(0, "b")
    assert (vc.stream_of["d"], vc.index["d"]) == (2, 0)


def test_reduce_drops_implied_producers_in_the_order_given():
    vc = VectorClocks()
    vc.run(0, "a0")
    vc.run(0, "a1")  # same stream, later: waiting for it implies a0
    assert vc.reduce(1, ["a1", "a0"]) == ["a1"]
    vc2 = VectorClocks()
    vc2.run(0, "a0")
    vc2.run(0, "a1")
    assert vc2.reduce(1, ["a0", "a1"]) == ["a0", "a1"]  # earliest first: both needed
    vc3 = VectorClocks()
    vc3.run(0, "a0")
    vc3.wait(1, "a0")
    assert vc3.reduce(1, ["a0"]) == []
    assert vc3.reduce(1, ["a0"], keep=lambda p: True) == ["a0"]  # e.g. a cross-device copy


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 10_000), n=st.integers(1, 25), streams=st.integers(1, 4))
def test_knows_is_happens_before(seed, n, streams):
    """Random nodes on random streams with random waits: ``knows(s, u)`` for the next node
    of ``s`` holds exactly when ``u`` reaches it through stream order and waits."""
    r = random.Random(seed)
    vc = VectorClocks()
    hb = nx.DiGraph()
    last: dict[int, str] = {}
    done: list[str] = []
    for i in range(n):
        v, s = f"n{i}", r.randrange(streams)
        for u in r.sample(done, k=min(len(done), r.randrange(3))):
            vc.wait(s, u)
            hb.add_edge(u, v)
        hb.add_node(v)
        if s in last:
            hb.add_edge(last[s], v)
        for u in done:
            if vc.stream_of[u] != s:
                assert vc.knows(s, u) == nx.has_path(hb, u, v), (u, v)
        vc.run(s, v)
        last[s] = v
        done.append(v)
