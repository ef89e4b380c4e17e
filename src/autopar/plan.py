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

The verifier (``verify_plan``) runs after every planning pass; see ``autopar.partition``.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass
from typing import Any

PLAN_FORMAT_VERSION = 1


@dataclass(frozen=True)
class Stream:
    """One execution stream: a CUDA stream, or a CPU worker thread with its own threads."""

    id: int
    device: str = "cpu"  # "cpu" or "cuda:N"
    threads: int = 1  # intra-op threads of this worker (CPU); 0 means "leave as is" (CUDA)


@dataclass(frozen=True)
class Sync:
    """A cross-stream dependency: ``dst`` (on ``dst_stream``) waits for ``src`` (on ``src_stream``)."""

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

    # Inspection helpers live in autopar.inspect so this module stays dependency-free.
    def to_dataframe(self):
        from autopar.inspect import plan_dataframe

        return plan_dataframe(self)

    def to_networkx(self):
        from autopar.inspect import plan_networkx

        return plan_networkx(self)

    def gantt(self, path: str, title: str | None = None) -> str:
        from autopar.inspect import plan_gantt

        return plan_gantt(self, path, title=title)

    def summary(self) -> str:
        from autopar.inspect import plan_summary

        return plan_summary(self)

    def __repr__(self) -> str:  # the default repr would print thousands of tuples
        return (
            f"Plan({self.graph_id!r}, policy={self.policy!r}, streams={len(self.streams)}, "
            f"nodes={len(self.order)}, syncs={len(self.syncs)}, "
            f"predicted={self.predicted_step_time * 1e3:.3f} ms, "
            f"serial={self.serial_time * 1e3:.3f} ms, bound={self.lower_bound * 1e3:.3f} ms)"
        )


def node_key(graph_tag: str, node_name: str) -> str:
    """The plan-wide name of an FX node: ``"<graph_tag>/<node.name>"`` (e.g. ``"g0.fw/addmm"``)."""
    return f"{graph_tag}/{node_name}"
