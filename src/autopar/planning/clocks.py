"""Vector clocks over streams: which cross-stream dependencies are already implied.

Streams run their nodes one after another, in one global order (``Plan.order``), and a
node may first wait for a node of another stream (a ``Sync``: an event wait in the
generated program). When a node starts, what its stream knows to have finished is exactly
what is reachable through stream order and those waits: Lamport's happens-before, tracked
with vector clocks (Fidge 1988, Mattern 1989).

The rules, with ``clock[s][t]`` = the index within stream ``t`` of the last node of ``t``
that stream ``s`` knows finished (-1: none), and ``index(v)`` = position of ``v`` among
its stream's nodes:

* ``run(s, v)``: ``v`` is next on ``s``: ``clock[s][s] = index(v)``; ``v`` keeps a copy of
  ``clock[s]`` (what a stream that waits for ``v`` learns).
* ``wait(s, u)``: ``clock[s] = max(clock[s], copy kept by u)``, entry by entry.
* ``knows(s, u)``: ``clock[s][stream(u)] >= index(u)``; then a node about to run on ``s``
  needs no wait for ``u``.

One implementation, three users: the planner drops implied syncs
(``partition.minimal_syncs``), codegen drops implied waits (``codegen.emit.schedule``) and
the verifier checks that every cross-stream dependency is covered (``verify.verify_plan``).

Example::

    >>> vc = VectorClocks()
    >>> vc.run(0, "a"); vc.run(1, "b")     # a on stream 0, b on stream 1
    >>> vc.knows(1, "a")
    False
    >>> vc.reduce(1, ["a"])                  # stream 1 must wait for a ...
    ['a']
    >>> vc.run(1, "c"); vc.knows(1, "a")     # ... and then knows it for good
    True
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterable

Node = Hashable


class VectorClocks:
    """The clocks of a set of streams, advanced node by node in the global order.

    Call, for each node ``v`` in order: ``reduce`` (or ``knows``/``wait``) for the waits
    ``v`` needs, then ``run`` for ``v`` itself. Producers must have been ``run`` before.
    """

    def __init__(self) -> None:
        self.stream_of: dict[Node, int] = {}
        self.index: dict[Node, int] = {}
        self._count: dict[int, int] = {}
        self._clock: dict[int, dict[int, int]] = {}
        self._after: dict[Node, dict[int, int]] = {}  # node -> its stream's clock at its run

    def run(self, stream: int, node: Node) -> None:
        """``node`` is the next node of ``stream``."""
        i = self._count.get(stream, 0)
        self._count[stream] = i + 1
        self.stream_of[node] = stream
        self.index[node] = i
        clock = self._clock.setdefault(stream, {})
        clock[stream] = i
        self._after[node] = dict(clock)

    def knows(self, stream: int, node: Node) -> bool:
        """Whether ``stream`` already knows (stream order, earlier waits) ``node`` finished."""
        return self._clock.get(stream, {}).get(self.stream_of[node], -1) >= self.index[node]

    def wait(self, stream: int, node: Node) -> None:
        """``stream`` waits for ``node``: it learns everything ``node``'s stream knew then."""
        clock = self._clock.setdefault(stream, {})
        for s, i in self._after[node].items():
            if i > clock.get(s, -1):
                clock[s] = i

    def reduce(
        self, stream: int, producers: Iterable[Node], *, keep: Callable[[Node], bool] | None = None
    ) -> list[Node]:
        """The producers a node about to run on ``stream`` must wait for, each wait applied.

        ``producers`` are tried in the order given and one already known is dropped (unless
        ``keep(p)``: a cross-device edge keeps its sync, which is also the copy). The order
        decides how many remain: a wait for a producer that ran later tends to teach more,
        so callers list the latest first.
        """
        need = []
        for p in producers:
            if (keep is None or not keep(p)) and self.knows(stream, p):
                continue
            need.append(p)
            self.wait(stream, p)
        return need
