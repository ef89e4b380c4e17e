"""Checking a built program's first call without leaving a trace.

A graph may write its inputs (BatchNorm running statistics, ``copy_`` into a buffer) and
draw from the random generator (dropout). A program that fails its first call must leave
no such effect behind, since the captured runner then runs the call again:
:class:`SideEffectGuard` snapshots the written inputs and the generator states, and
:meth:`~SideEffectGuard.restore` puts them back. :func:`output_mismatch` says whether a
program returned what the graph returns (shapes, dtypes, devices).

Example::

    >>> guard = SideEffectGuard(args, written=[3])           # doctest: +SKIP
    >>> guard.restore()                                      # doctest: +SKIP
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.fx as fx

from autopar import compat
from autopar.capture.analysis import buffer_analysis


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


def output_meta(out) -> list:
    """(shape, dtype, device, requires_grad) of every tensor a graph call returned, in
    order: a program compiled without its backward returns outputs that need no grad."""
    leaves = compat.tree_leaves(out)
    return [(tuple(t.shape), t.dtype, t.device, t.requires_grad) if isinstance(t, torch.Tensor)
            else type(t) for t in leaves]  # fmt: skip


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
