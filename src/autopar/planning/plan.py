"""The Plan: one frozen, JSON-serialisable record passed from the planner to codegen.

A Plan says, for one captured graph (a forward or a backward), where every node runs
(device, stream, intra-op threads), in which order each stream runs its nodes, which
cross-stream dependencies need a synchronisation, and what the simulator predicted.

Example::

    >>> p = Plan(graph_id="g0/forward", policy="serial",
    ...          streams=(Stream(0, "cpu", 2),),
    ...          placements=(("a", 0), ("b", 0)), order=("a", "b"), syncs=())
    >>> Plan.from_json(p.to_json()) == p
    True

The verifier (``verify_plan``) runs after every planning pass; see ``autopar.planning.partition``.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass
from typing import Any

from autopar.capture.backend import node_key  # noqa: F401 - re-exported: plans use these keys

PLAN_FORMAT_VERSION = 1


@dataclass(frozen=True)
class Stream:
    """One execution stream: a CUDA stream, or a CPU worker thread with its own threads."""

    id: int
    device: str = "cpu"  # "cpu" or "cuda:N"
    threads: int = 1  # intra-op threads of this worker (CPU); 0 means "leave as is" (CUDA)


@dataclass(frozen=True)
class Sync:
    """A cross-stream dependency: ``dst`` on ``dst_stream`` waits for ``src`` on ``src_stream``."""

    src: str
    dst: str
    src_stream: int
    dst_stream: int
    bytes: int = 0  # tensor bytes crossing; a cross-device sync is also a copy


@dataclass(frozen=True)
class Plan:
    """Where and when every node of one graph runs.

    ``placements`` maps node name -> stream id (as sorted pairs, so the dataclass stays
    hashable); ``order`` is a topological order of all placed nodes, and each stream runs
    its own nodes in that order. ``timeline`` holds the simulator's (node, start, finish,
    cost) in seconds, for inspection.
    """

    graph_id: str
    policy: str
    streams: tuple[Stream, ...]
    placements: tuple[tuple[str, int], ...]
    order: tuple[str, ...]
    syncs: tuple[Sync, ...]
    predicted_step_time: float = 0.0
    serial_time: float = 0.0
    lower_bound: float = 0.0
    predicted_peak_memory: int = 0
    memory_budget: int | None = None
    timeline: tuple[tuple[str, float, float, float], ...] = ()
    node_info: tuple[tuple[str, str, int, int], ...] = ()  # (node, phase, flops, bytes)
    edges: tuple[tuple[str, str, int], ...] = ()  # (src, dst, bytes) data dependencies
    provenance: tuple[tuple[str, str], ...] = ()  # (key, value): passes, timings, store
    notes: tuple[str, ...] = ()  # decisions worth showing (e.g. distributed choice)
    format_version: int = PLAN_FORMAT_VERSION

    # -- accessors ---------------------------------------------------------------------
    @property
    def placement(self) -> dict[str, int]:
        return dict(self.placements)

    def stream_of(self, node: str) -> Stream:
        sid = self.placement[node]
        return next(s for s in self.streams if s.id == sid)

    def stream_nodes(self) -> dict[int, list[str]]:
        """Nodes of each stream in execution order."""
        place = self.placement
        out: dict[int, list[str]] = {s.id: [] for s in self.streams}
        for n in self.order:
            out[place[n]].append(n)
        return out

    @property
    def plan_hash(self) -> str:
        return hashlib.sha256(self.to_json().encode()).hexdigest()[:12]

    def replace(self, **changes: Any) -> Plan:
        return dataclasses.replace(self, **changes)

    # -- JSON round trip -----------------------------------------------------------------
    def to_json(self, indent: int | None = None) -> str:
        return json.dumps(dataclasses.asdict(self), indent=indent, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> Plan:
        d = json.loads(text)
        if d.get("format_version") != PLAN_FORMAT_VERSION:
            raise ValueError(
                f"plan format {d.get('format_version')!r} is not {PLAN_FORMAT_VERSION}: "
                "re-create the plan with this autopar version"
            )
        d["streams"] = tuple(Stream(**s) for s in d["streams"])
        d["syncs"] = tuple(Sync(**s) for s in d["syncs"])
        for key in ("placements", "timeline", "node_info", "edges", "provenance"):
            d[key] = tuple(tuple(x) for x in d[key])
        d["order"] = tuple(d["order"])
        d["notes"] = tuple(d["notes"])
        return cls(**d)

    # -- combining per-graph plans ----------------------------------------------------------
    @classmethod
    def combine(cls, plans, graph_id: str | None = None) -> Plan:
        """One plan for several graphs that run one after another (e.g. forward then
        backward): orders are concatenated and each timeline is offset by the predicted
        times of the graphs before it; times add up, peak memory is the largest peak.
        Streams equal in (id, device, threads) are shared; a stream id reused with other
        settings gets a fresh id.

        Example::

            >>> a = Plan("fw", "serial", (Stream(0, "cpu", 2),), (("fw/x", 0),), ("fw/x",),
            ...          (), predicted_step_time=1.0, timeline=(("fw/x", 0.0, 1.0, 1.0),))
            >>> b = Plan("bw", "heft", (Stream(0, "cpu", 1),), (("bw/y", 0),), ("bw/y",),
            ...          (), predicted_step_time=2.0, timeline=(("bw/y", 0.0, 2.0, 2.0),))
            >>> c = Plan.combine([a, b])
            >>> c.policy, [s.id for s in c.streams], c.timeline[1]
            ('serial+heft', [0, 1], ('bw/y', 1.0, 3.0, 2.0))
        """
        plans = list(plans)
        if not plans:
            raise ValueError("Plan.combine needs at least one plan")
        if len(plans) == 1 and graph_id is None:
            return plans[0]
        streams: dict[tuple[str, int, int], Stream] = {}  # (device, threads, id) -> stream
        used_ids: set[int] = set()
        placements, order, syncs, timeline = [], [], [], []
        node_info, edges, provenance, notes = [], [], [], []
        offset = 0.0
        for p in plans:
            remap: dict[int, int] = {}
            for s in p.streams:
                own = streams.get((s.device, s.threads, s.id))
                if own is None:
                    sid = s.id if s.id not in used_ids else max(used_ids) + 1
                    own = streams[(s.device, s.threads, s.id)] = Stream(sid, s.device, s.threads)
                    used_ids.add(sid)
                remap[s.id] = own.id
            placements += [(n, remap[sid]) for n, sid in p.placements]
            order += p.order
            syncs += [
                dataclasses.replace(
                    s, src_stream=remap[s.src_stream], dst_stream=remap[s.dst_stream]
                )
                for s in p.syncs
            ]
            timeline += [(n, a + offset, b + offset, c) for n, a, b, c in p.timeline]
            node_info += p.node_info
            edges += p.edges
            provenance += [(f"{p.graph_id}:{k}", v) for k, v in p.provenance]
            notes += [f"{p.graph_id}: {x}" for x in p.notes]
            offset += p.predicted_step_time
        budgets = [p.memory_budget for p in plans if p.memory_budget is not None]
        return cls(
            graph_id=graph_id or "+".join(p.graph_id for p in plans),
            policy="+".join(dict.fromkeys(p.policy for p in plans)),
            streams=tuple(sorted(streams.values(), key=lambda s: s.id)),
            placements=tuple(sorted(placements)),
            order=tuple(order),
            syncs=tuple(syncs),
            predicted_step_time=offset,
            serial_time=sum(p.serial_time for p in plans),
            lower_bound=sum(p.lower_bound for p in plans),
            predicted_peak_memory=max(p.predicted_peak_memory for p in plans),
            memory_budget=min(budgets) if budgets else None,
            timeline=tuple(timeline),
            node_info=tuple(node_info),
            edges=tuple(edges),
            provenance=tuple(provenance),
            notes=tuple(notes),
        )

    # Inspection helpers live in autopar.planning.report so this module stays dependency-free.
    def to_dataframe(self):
        from autopar.planning.report import plan_dataframe

        return plan_dataframe(self)

    def to_networkx(self):
        from autopar.planning.report import plan_networkx

        return plan_networkx(self)

    def gantt(self, path: str | None = None, title: str | None = None):
        """The Gantt chart of the predicted timeline: one panel per graph (forward,
        backward), one row per stream, one box per operator; ``title`` (e.g. the model's
        name) leads the figure's title. Without ``path`` returns the matplotlib ``Figure``;
        with ``path`` writes the image and returns ``path``.

        Example::

            >>> plan.gantt("plan.png", title="towers")      # doctest: +SKIP
            'plan.png'
            >>> fig = plan.gantt()                           # doctest: +SKIP
        """
        from autopar.planning.report import plan_gantt

        return plan_gantt(self, path, title=title)

    def to_chrome_trace(self, path: str | None = None) -> dict[str, Any]:
        """The predicted timeline as a Chrome trace-event dict (open the file in Perfetto):
        one ``"X"`` event per operator, times in microseconds, pid = graph, tid = stream.
        Also written to ``path`` when given.

        Example::

            >>> trace = plan.to_chrome_trace("plan.trace.json")   # doctest: +SKIP
            >>> trace["traceEvents"][0]["ph"]                      # doctest: +SKIP
            'M'
        """
        from autopar.planning.report import plan_chrome_trace, write_chrome_trace

        trace = plan_chrome_trace(self)
        if path is not None:
            write_chrome_trace(trace, path)
        return trace

    def summary(self) -> str:
        from autopar.planning.report import plan_summary

        return plan_summary(self)

    def __repr__(self) -> str:  # the default repr would print thousands of tuples
        return (
            f"Plan({self.graph_id!r}, policy={self.policy!r}, streams={len(self.streams)}, "
            f"nodes={len(self.order)}, syncs={len(self.syncs)}, "
            f"predicted={self.predicted_step_time * 1e3:.3f} ms, "
            f"serial={self.serial_time * 1e3:.3f} ms, bound={self.lower_bound * 1e3:.3f} ms)"
        )

