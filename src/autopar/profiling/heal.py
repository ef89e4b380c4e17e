"""Self-healing profiles: when a run disagrees with the store, re-measure what explains it.

A store entry can be wrong while looking clean: measured by an older autopar, under a
disturbance no signal caught, or copied from elsewhere. The issue that motivated this module:
a 1x1 convolution stored at 24 ms (it takes 0.43 ms) made every plan predict 77 ms for a
graph that ran in 3.9 ms.

``heal(table, ...)`` runs at a graph's first call, after ``profile_graph``. It compares the
serial time the table predicts (the sum of ``time_s`` over its operators) with the time this
run measured; ``profile_graph`` leaves that in ``table.attrs``: ``measured_s``, and per node
key ``evidence`` (a stored operator's real call and one warm batched sample on the side, so a
disturbed check counts as agreement). When the two differ by more than ``ratio`` (1.5x):

1. the signatures are ranked by how much of the gap they explain: per node, the difference
   between stored and measured time, counted only where those disagree by more than
   ``ratio`` and by more than ``NOISE_FLOOR_S``. Without per-node evidence (a float
   ``measured``), by their share of the prediction;
2. the smallest set that explains the gap (at most ``MAX_OPS_PER_ROUND``) is re-measured by
   ``remeasure`` (default: ``remeasure_from_store``, which rebuilds each call from the
   description stored with it), for up to ``MAX_ROUNDS`` rounds while the gap persists;
3. a re-measured entry that disagrees with the stored one by more than ``ratio`` replaces it
   (``ProfileStore.replace``, flushed) when the new measurement is clean, or provisional but
   faster (contention only adds time); the table's rows of that signature get the new times;
4. one ``StoreWarning`` names the replaced entries with their old and new times.

``remeasure(signatures) -> {signature: record}`` may return fewer records than asked (an
operator that cannot be re-timed is left alone). ``table.attrs["heal"]`` records what was
done. ``verify_store`` is the same re-timing over a whole store (``autopar store verify``).

Example (``g`` a graph, ``xs`` its inputs, ``store`` a ``ProfileStore``)::

    >>> _, table = profile_graph(g, xs, store=store)              # doctest: +SKIP
    >>> table, warning = heal(table, store=store)                 # doctest: +SKIP
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import pandas as pd
import torch

from autopar.errors import StoreWarning
from autopar.profiling.callspec import NotRebuildable, rebuild, why_refused
from autopar.profiling.quality import CLEAN, DISAGREE_RATIO, disagree, quality
from autopar.profiling.store import ProfileStore
from autopar.profiling.timing import measure_op

HEAL_RATIO = DISAGREE_RATIO
#: A node's stored and measured times must differ by more than this to count (timer jitter).
NOISE_FLOOR_S = 5e-6
#: The graph's predicted and measured serial times must differ by more than this, too:
#: healing is for entries that would mislead a plan (a 1x1 conv stored at 24 ms), not for a
#: tiny graph whose view ops took 20 us instead of 1 us (that warned on every fresh store).
GAP_FLOOR_S = 1e-4
MAX_ROUNDS = 3
MAX_OPS_PER_ROUND = 16

Remeasure = Callable[[list[str]], Mapping[str, dict[str, Any]]]


@dataclass(frozen=True)
class Replacement:
    """One store entry replaced by ``heal`` or ``verify_store``."""

    signature: str
    target: str
    old_s: float
    new_s: float
    quality: str

    def describe(self) -> str:
        return (
            f"{self.target} [{self.signature}] {self.old_s * 1e3:.3f} ms -> "
            f"{self.new_s * 1e3:.3f} ms ({self.quality})"
        )


def accept(old: Mapping[str, Any], new: Mapping[str, Any], ratio: float = HEAL_RATIO) -> bool:
    """Whether a re-measurement ``new`` should replace the entry ``old`` that a run (or a
    verification) called into question: they disagree by more than ``ratio``, and ``new`` is
    clean, or provisional but faster.

    Example::

        >>> accept({"time_s": 24e-3}, {"time_s": 0.43e-3, "quality": "provisional"})
        True
        >>> accept({"time_s": 1e-3}, {"time_s": 9e-3, "quality": "provisional"})
        False
    """
    old_s, new_s = float(old["time_s"]), float(new["time_s"])
    if not disagree(old_s, new_s, ratio):
        return False
    return quality(dict(new)) == CLEAN or new_s < old_s


def remeasure_from_store(
    store: ProfileStore, *, warmup: int = 2, repeats: int = 5
) -> Callable[[list[str]], dict[str, dict[str, Any]]]:
    """A ``remeasure`` for ``heal``: re-times stored entries from their call descriptions
    (``autopar.profiling.callspec``) at their recorded thread count, on fresh tensors; entries
    without one, or whose call cannot be rebuilt here, are skipped.

    Example::

        >>> fresh = remeasure_from_store(store)(["354c4ce7ef420df1"])   # doctest: +SKIP
    """

    def remeasure(signatures: list[str]) -> dict[str, dict[str, Any]]:
        out = {}
        for sig in signatures:
            old = store.get(sig)
            if old is None:
                continue
            try:
                out[sig] = retime(old, warmup=warmup, repeats=repeats)
            except NotRebuildable:
                continue
        return out

    return remeasure


def retime(record: Mapping[str, Any], *, warmup: int = 2, repeats: int = 5) -> dict[str, Any]:
    """A fresh measurement of the call ``record`` describes, as a full record (its target,
    FLOPs and description carried over). Raises ``NotRebuildable`` when it cannot be made."""
    refused = why_refused(record)  # the store refuses such entries on reading, too
    if refused:
        raise NotRebuildable(refused)
    call, cuda = rebuild(record.get("call"))
    before = torch.get_num_threads()
    threads = int(record.get("threads") or before)
    on_device = torch.cuda.device(cuda) if cuda is not None else contextlib.nullcontext()
    try:
        torch.set_num_threads(threads)
        with on_device:  # CUDA events time the current device's stream
            call()  # a first call outside the measurement (allocations, primitive creation)
            fresh = measure_op(
                call, cuda, warmup=warmup, repeats=repeats,
                single_thread=record.get("time_1t_s") is not None,
            )  # fmt: skip
    except NotRebuildable:
        raise
    except Exception as e:  # noqa: BLE001 - e.g. a description this torch cannot run
        raise NotRebuildable(f"the rebuilt call failed: {type(e).__name__}: {e}") from e
    finally:
        torch.set_num_threads(before)
    keep = {k: record[k] for k in ("target", "flops", "call") if k in record}
    return {**keep, **fresh}


def _rank(comp: pd.DataFrame, measured: list[float] | None, over: bool) -> list[tuple[str, float]]:
    """(signature, seconds of the gap it explains), most first; only those that explain any."""
    pred = comp.groupby("signature").time_s.sum()
    if measured is None:  # no per-node evidence: the biggest shares of the prediction
        return [(str(s), float(v)) for s, v in pred.sort_values(ascending=False).items()]
    meas = pd.Series(measured, index=comp.index).groupby(comp.signature).sum()
    gap = (pred - meas) if over else (meas - pred)
    gap = gap[gap > 0].sort_values(ascending=False)
    return [(str(s), float(v)) for s, v in gap.items()]


def heal(
    table: pd.DataFrame,
    measured: float | Mapping[str, float] | None = None,
    *,
    store: ProfileStore | None = None,
    remeasure: Remeasure | None = None,
    predicted_s: float | None = None,
    ratio: float = HEAL_RATIO,
    warn: bool = True,
) -> tuple[pd.DataFrame, str | None]:
    """Check ``table`` against a measured run; re-measure and replace the store entries that
    explain a disagreement beyond ``ratio``. Returns (table, the warning text or ``None``).

    ``measured``: ``None`` uses ``table.attrs`` from ``profile_graph`` (per-node evidence);
    a float is the graph's measured serial seconds; a mapping gives seconds per node key.
    ``predicted_s`` defaults to the table's sum of operator times. ``store`` receives the
    replacements (and is flushed); ``remeasure`` defaults to ``remeasure_from_store(store)``.
    The returned table is a copy when anything changed. See the module docstring.
    """
    if remeasure is None:
        if store is None:
            raise ValueError("heal needs a store, a remeasure function, or both")
        remeasure = remeasure_from_store(store)
    comp = table[table.signature.astype(str) != ""]
    if comp.empty:
        return table, None
    evidence = table.attrs.get("evidence") if measured is None else None
    total = table.attrs.get("measured_s") if measured is None else None
    if isinstance(measured, Mapping):
        evidence = measured
    elif measured is not None:
        total = float(measured)
    per_node = None
    if evidence is not None and all(k in evidence for k in comp.key):
        per_node = []
        for key, pred in zip(comp.key, comp.time_s, strict=True):
            m = float(evidence[key])
            noise = abs(m - pred) <= NOISE_FLOOR_S or not disagree(m, pred, ratio)
            per_node.append(float(pred) if noise else m)
        total = sum(per_node)
    if total is None or total <= 0:
        return table, None
    predicted = float(comp.time_s.sum()) if predicted_s is None else float(predicted_s)
    if not disagree(predicted, total, ratio) or abs(predicted - total) <= GAP_FLOOR_S:
        return table, None
    over = predicted > total
    first_prediction = predicted
    queue = _rank(comp, per_node, over)
    table = table.copy()
    tried: list[str] = []
    replaced: list[Replacement] = []
    for _ in range(MAX_ROUNDS):
        gap, batch, covered = abs(predicted - total), [], 0.0
        while queue and len(batch) < MAX_OPS_PER_ROUND and covered < gap:
            sig, share = queue.pop(0)
            batch.append(sig)
            covered += share
        if not batch:
            break
        tried += batch
        fresh = remeasure(batch)
        for sig in batch:
            new = fresh.get(sig)
            rows = table.signature == sig
            row_s = float(table.loc[rows, "time_s"].iloc[0])
            old = (store.get(sig) if store is not None else None) or {"time_s": row_s}
            if new is None or not accept(old, new, ratio):
                continue
            new = {**{k: old[k] for k in ("target", "flops", "call") if k in old}, **new}
            if store is not None:
                store.replace(sig, new)
            predicted -= (row_s - float(new["time_s"])) * int(rows.sum())
            table.loc[rows, "time_s"] = float(new["time_s"])
            if new.get("time_1t_s") is not None:
                table.loc[rows, "time_1t_s"] = float(new["time_1t_s"])
            target = str(new.get("target") or table.loc[rows, "target"].iloc[0])
            replaced.append(
                Replacement(sig, target, float(old["time_s"]), float(new["time_s"]), quality(new))
            )
        if not disagree(predicted, total, ratio):
            break
    if store is not None and replaced:
        store.flush()
    table.attrs["heal"] = {
        "predicted_s": first_prediction,
        "measured_s": total,
        "remeasured": tried,
        "replaced": [r.signature for r in replaced],
    }
    if not replaced:
        return table, None
    graphs = ", ".join(sorted(set(map(str, comp.graph)))) if "graph" in comp else "the graph"
    message = (
        f"autopar: the profile store disagreed with this run of {graphs}: it predicted "
        f"{first_prediction * 1e3:.3f} ms serial, the run measured {total * 1e3:.3f} ms. "
        f"Re-measured {len(tried)} operator signature(s); replaced {len(replaced)} stored "
        f"entr{'y' if len(replaced) == 1 else 'ies'}: "
        + "; ".join(r.describe() for r in replaced)
        + ". Plans now use the new times (and so will later runs)."
    )
    if warn:
        warnings.warn(message, StoreWarning, stacklevel=2)
    return table, message


@dataclass(frozen=True)
class Verdict:
    """One stored entry re-timed by ``verify_store``: ``status`` is ``ok``, ``off`` (the
    stored time is more than the ratio away from a re-measurement that ``accept`` trusts),
    ``fixed`` (off, and replaced), ``unsure`` (more than the ratio away, but the
    re-measurement was provisional and slower: contended now, proves nothing) or ``skipped``
    (``note`` says why: no call description, cannot be rebuilt here)."""

    signature: str
    target: str
    stored_s: float
    new_s: float | None
    status: str
    note: str = ""


def verify_store(
    store: ProfileStore,
    signatures: Iterable[str] | None = None,
    *,
    ratio: float = HEAL_RATIO,
    fix: bool = False,
    warmup: int = 2,
    repeats: int = 5,
) -> list[Verdict]:
    """Re-time stored entries (all, or ``signatures``) and flag those more than ``ratio``
    off; with ``fix``, replace them where ``accept`` agrees (then flush).

    Example::

        >>> [v.status for v in verify_store(store)]                    # doctest: +SKIP
        ['ok', 'ok', 'off']
    """
    out: list[Verdict] = []
    for sig in list(store) if signatures is None else list(signatures):
        old = store.get(sig)
        if old is None:
            continue
        target, stored = str(old.get("target", "?")), float(old["time_s"])
        try:
            new = retime(old, warmup=warmup, repeats=repeats)
        except NotRebuildable as e:
            out.append(Verdict(sig, target, stored, None, "skipped", str(e)))
            continue
        status, note = "ok", str(new.get("reason", ""))
        if accept(old, new, ratio):
            status = "off"
            if fix:
                store.replace(sig, new)
                status = "fixed"
        elif disagree(stored, float(new["time_s"]), ratio):
            status = "unsure"
        out.append(Verdict(sig, target, stored, float(new["time_s"]), status, note))
    if fix and any(v.status == "fixed" for v in out):
        store.flush()
    return out
