"""Measure, don't assume: time candidate runners of one graph on its real inputs, leaving no
trace of the extra runs.

A graph may write its inputs (BatchNorm running statistics, ``copy_`` into a buffer) and
draw from the random generator (dropout). Running it again to time it would apply those
effects twice and shift the user's RNG stream. :class:`SideEffectGuard` snapshots the
written inputs and the generator states once, and restores them after every timed run, so
the training result is exactly as if only the real call had run.

Timing: each candidate runs once to warm up, then ``rounds`` interleaved times (A B A B...,
so a slow phase of the machine hits every candidate alike); the *minimum* counts, since
noise only ever adds time. On CUDA every run is bracketed by ``torch.cuda.synchronize``:
the host returns as soon as the work is enqueued, so an unsynchronised timer measures the
launch, not the work.

Example::

    >>> guard = SideEffectGuard(args, written=[3])           # doctest: +SKIP
    >>> best = time_candidates({"a": fa, "b": fb}, args, guard)   # doctest: +SKIP
    >>> min(best, key=best.get)                               # doctest: +SKIP
    'b'
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.fx as fx

from autopar.capture.analysis import buffer_analysis

#: Interleaved timed runs per candidate (after one warm-up run each).
ROUNDS = 3


def written_inputs(gm: fx.GraphModule) -> list[int]:
    """Indices of ``gm``'s placeholders whose buffers the graph writes in place."""
    nodes = list(gm.graph.nodes)
    _, writes = buffer_analysis(nodes)
    written = {b for bases in writes.values() for b in bases}
    placeholders = [n for n in nodes if n.op == "placeholder"]
    return [i for i, n in enumerate(placeholders) if n in written]


class SideEffectGuard:
    """Snapshot of the inputs a graph writes and of every random generator it may draw
    from; :meth:`restore` puts them back bit for bit."""

    def __init__(self, args: Sequence[Any], written: Sequence[int]):
        self.args = args
        self.saved = [(i, args[i].detach().clone()) for i in written
                      if isinstance(args[i], torch.Tensor)]  # fmt: skip
        self.cpu_rng = torch.get_rng_state()
        cuda = {a.device for a in args if isinstance(a, torch.Tensor) and a.is_cuda}
        self.cuda_rng = {d: torch.cuda.get_rng_state(d) for d in cuda}

    def restore(self) -> None:
        with torch.no_grad():
            for i, value in self.saved:
                self.args[i].copy_(value)
        torch.set_rng_state(self.cpu_rng)
        for d, state in self.cuda_rng.items():
            torch.cuda.set_rng_state(state, d)


def _sync(args: Sequence[Any]) -> Callable[[], None]:
    devices = {a.device for a in args if isinstance(a, torch.Tensor) and a.is_cuda}
    if not devices:
        return lambda: None
    return lambda: [torch.cuda.synchronize(d) for d in devices] and None


def time_candidates(
    fns: dict[str, Callable[[list], Any]],
    args: Sequence[Any],
    guard: SideEffectGuard,
    rounds: int = ROUNDS,
) -> dict[str, float]:
    """Best-of-``rounds`` seconds per candidate; ``fns[name](list(args))`` runs one. A
    candidate that raises is dropped (it is not a valid executor for these inputs)."""
    sync = _sync(args)
    best = {name: float("inf") for name in fns}
    alive = dict(fns)
    for r in range(rounds + 1):  # round 0 warms up
        for name, fn in list(alive.items()):
            sync()
            t0 = time.perf_counter()
            try:
                fn(list(args))
                sync()
            except Exception:  # noqa: BLE001 - a failing candidate is simply not chosen
                del alive[name]
                best.pop(name)
                continue
            finally:
                guard.restore()
            if r:
                best[name] = min(best[name], time.perf_counter() - t0)
    return best


def output_meta(out) -> list:
    """(shape, dtype, device) of every tensor a graph call returned, in order."""
    leaves = torch.utils._pytree.tree_leaves(out)
    return [(tuple(t.shape), t.dtype, t.device) if isinstance(t, torch.Tensor) else type(t)
            for t in leaves]  # fmt: skip


def output_mismatch(out, expected: list | None) -> str | None:
    """Why ``out`` is not what the current runner returns (None: it is, or nothing known)."""
    if expected is None:
        return None
    got = output_meta(out)
    if len(got) != len(expected):
        return f"returned {len(got)} values where the graph returns {len(expected)}"
    for i, (a, b) in enumerate(zip(got, expected, strict=True)):
        if a != b:
            return f"output {i} is {a} where the graph gives {b}"
    return None
