"""The decision cache: the judge's verdicts, remembered beside the profile store, so that a
model seen before on this machine starts on its winner with no race.

One JSON file next to the profile store's file (``<store>.decisions.json``: the store's
name spells the machine, the torch release and the OpenMP library, so a verdict is reused
only where it was measured). Its entries are keyed by :func:`graph_key`: a hash of the
Dynamo graph's code, its inputs' metadata and the ladder. Each holds the winner and the
median step times that made it win, and the executors compiled for the graph here (their
compile is a hit in Inductor's cache now, so a later run compiles them at once instead of in
the background); nothing else: the file is data, and an entry that names an executor the
table does not know is ignored. An in-memory store keeps its
decisions in memory.

Example::

    >>> d = Decisions(None)
    >>> d.put("abc", "inductor", {"inductor": 0.002, "plan": 0.003})
    >>> d.get("abc")["winner"]
    'inductor'
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from typing import Any

from autopar.profiling.storefiles import store_lock, write_atomically

FORMAT = "autopar-decisions"
VERSION = 1


def graph_key(gm, args: list, ladder: tuple[str, ...], signature: object) -> str:
    """What a verdict depends on besides the machine: the Dynamo graph's code, each input's
    shape, stride, dtype, device and ``requires_grad``, the ladder, and the step's
    ``signature`` (``adapt.shapes.input_key``: train or eval, grad mode, autocast, threads:
    an evaluation step under ``no_grad`` can trace the same graph code as training)."""
    import torch

    metas = [(tuple(a.shape), tuple(a.stride()), str(a.dtype), str(a.device), a.requires_grad)
             if isinstance(a, torch.Tensor) else repr(a) for a in args]  # fmt: skip
    text = repr((gm.code, metas, ladder, signature))
    return hashlib.sha1(text.encode()).hexdigest()[:20]


def _valid(rec: Any, known) -> bool:
    return (isinstance(rec, dict) and (rec.get("winner") is None or rec.get("winner") in known)
            and isinstance(rec.get("medians", {}), dict)
            and all(isinstance(k, str) and isinstance(v, (int, float)) and math.isfinite(v)
                    and v >= 0 for k, v in rec.get("medians", {}).items())
            and isinstance(rec.get("built", []), list)
            and all(b in known for b in rec.get("built", [])))  # fmt: skip


class Decisions:
    """Verdicts by :func:`graph_key`, read once and written through (locked, atomic)."""

    def __init__(self, store_path: str | None):
        from autopar.runtime.executors import TABLE

        self._known = set(TABLE)
        self.path = None if store_path is None else store_path.removesuffix(".json") + (
            ".decisions.json")
        self._entries: dict[str, dict] = self._read() if self.path else {}

    def get(self, key: str) -> dict | None:
        rec = self._entries.get(key)
        return dict(rec) if rec is not None else None

    def put(self, key: str, winner: str | None = None, medians: dict[str, float] | None = None,
            built: tuple[str, ...] = ()) -> None:
        """Remember ``winner`` for ``key`` (with the medians that made it win), or that the
        executors ``built`` were compiled for it here (Inductor's cache holds them now), and
        write."""
        rec = dict(self._entries.get(key) or {})
        if winner is not None:
            rec["winner"] = winner
            rec["medians"] = {k: float(v) for k, v in (medians or {}).items()}
        if built:
            rec["built"] = sorted({*rec.get("built", []), *built})
        if not _valid(rec, self._known):
            return
        self._entries[key] = rec
        if self.path is None:
            return
        try:
            os.makedirs(os.path.dirname(os.path.abspath(self.path)), exist_ok=True)
            with store_lock(self.path):
                merged = self._read()
                disk = merged.get(key, {})  # another process may have written key since
                built_all = sorted({*disk.get("built", []), *rec.get("built", [])})
                rec = {**(disk if winner is None else rec), "built": built_all}
                merged[key] = rec
                write_atomically(self.path, json.dumps(
                    {"format": FORMAT, "version": VERSION, "decisions": merged}, indent=1))
            self._entries.update(merged)
        except OSError:  # a cache: training goes on without it
            pass

    def _read(self) -> dict[str, dict]:
        try:
            with open(self.path, encoding="utf-8") as f:
                doc = json.load(f)
        except (OSError, ValueError):
            return {}
        if not isinstance(doc, dict) or doc.get("format") != FORMAT or doc.get(
                "version") != VERSION or not isinstance(doc.get("decisions"), dict):
            return {}
        return {k: v for k, v in doc["decisions"].items() if _valid(v, self._known)}
