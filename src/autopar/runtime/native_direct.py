"""The native direct path: a training graph whose forward and backward both run native
programs is called as one C++ autograd function (``interp.cpp``'s ``DirectFunction``), with
no Python between the two programs and autograd.

Why: through ``capture.direct_autograd``'s Python ``autograd.Function`` a training step
runs the forward program, makes a Python tensor of every output (the user's and every
tensor saved for the backward: 43 on the multi-tower MLP), saves them, and in the
backward unpacks them into Python again, calls the backward program through five layers
of Python (the graph's record, the pipeline's and the monitor's call hooks) and returns a
Python tuple of gradients. Measured on the 2-core box (2026-12-07, towers at batch 64, ABBA
in one process, 400 rounds, three processes): the C++ function made a training step
100-130 us faster, 2.55-2.70 -> 2.43-2.56 ms (4-5%), with bitwise equal gradients (the same
programs).

When (:meth:`NativePaths.refresh`, at every step boundary of ``Pipeline.call``): the Dynamo
graph's runner is its ``DirectGraph`` with contiguous incoming gradients; both halves run
native programs (their records' runners are ``codegen.emit.Boxed`` native programs whose
inputs are exactly the graph's: no constants appended) over tensor inputs and outputs; and
the caller's state needs none of the Python calls: the signature's verdict is ``plan`` with no
judge's turn left, nothing for the monitor to do at the next call (no re-profile due). Otherwise
the Python function runs, as before; a swapped program (a re-plan) changes a record's
runner, which ends the path at the next boundary.

What the Python calls did is kept: the programs time themselves (``Program.take_seconds``)
and :meth:`NativePaths.drain` hands those times to the monitor at the next step boundary
(``Monitor.observed``: call counts, drift windows, ``autopar.stats`` rows), before anything
else of that step. The autograd semantics are ``DirectGraph``'s (see ``interp.cpp``).
A bypass: off on a torch release the project has not tested (``autopar.compat``).

Example::

    >>> paths = NativePaths()
    >>> paths.refresh(dynamo_graphs, records_of, settled=True)   # doctest: +SKIP
    >>> paths.drain(monitor)                                      # doctest: +SKIP
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import torch

from autopar import compat
from autopar.capture.direct_autograd import DirectGraph
from autopar.codegen.emit import Boxed
from autopar.runtime import native


def enabled() -> bool:
    """A bypass (``autopar.compat``): only on a tested torch release."""
    return compat.bypasses_on()


class NativeDirect:
    """``path(args)`` runs one Dynamo graph's two native programs through the C++ autograd
    function: what ``direct(*args)`` returns (a list of the user outputs)."""

    def __init__(self, direct: DirectGraph, fw_record: Any, bw_record: Any):
        self.direct, self.fw_record, self.bw_record = direct, fw_record, bw_record
        self.fw_runner, self.bw_runner = fw_record.runner, bw_record.runner
        self.fw = self.fw_runner.program.interpreter
        self.bw = self.bw_runner.program.interpreter
        self._apply = native.load(build=False).direct_apply
        self._rest = (direct.num_outputs, direct.grad_outputs)

    def __call__(self, args: tuple) -> list:
        return self._apply(list(args), self.fw, self.bw, *self._rest)

    def current(self) -> bool:
        """Both halves still run the programs this path runs."""
        return self.fw_record.runner is self.fw_runner and self.bw_record.runner is self.bw_runner

    def quiet(self, quiet: Callable[[Any], bool]) -> bool:
        return quiet(self.fw_record) and quiet(self.bw_record)


class NativePaths:
    """The native direct paths of one compiled model: which Dynamo graphs run one, and the
    program times not yet handed to the monitor."""

    def __init__(self) -> None:
        self.on = enabled()
        self._paths: dict[int, NativeDirect] = {}  # id(DirectGraph) -> its path
        # DirectGraph -> why it can never have one (found once)
        self._why: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    def refresh(self, graphs: list, records_of: Callable[[int], list], settled: bool,
                quiet: Callable[[Any], bool]) -> None:  # fmt: skip
        """A step boundary: give each graph its path where it can have one and nothing needs
        its Python calls (``settled``: the caller says nothing else runs the records;
        ``quiet(record)``: the monitor has nothing to do at its next call); take it away
        elsewhere."""
        for graph in graphs:
            # The captured runner's: the path runs the records' programs, which are plan's.
            # A graph settled on another executor's program (an inductor DirectGraph: the
            # same class) must never get it.
            direct = graph.captured
            if not isinstance(direct, DirectGraph):
                continue
            path = self._paths.get(id(direct))
            if path is not None and not (settled and path.current() and path.quiet(quiet)):
                self._paths.pop(id(direct))
                direct.native = path = None
            if path is None and settled and self.on and direct not in self._why:
                path = self._build(direct, records_of(graph.group))
                if path is not None and path.quiet(quiet):
                    self._paths[id(direct)] = path
                    direct.native = path

    def drain(self, observed: Callable[[Any, list[float]], None]) -> None:
        """Hand the programs' own times to ``observed(record, seconds)`` (the monitor)."""
        for path in self._paths.values():
            for record, prog in ((path.fw_record, path.fw), (path.bw_record, path.bw)):
                seconds = prog.take_seconds()
                if seconds:
                    observed(record, seconds)

    def _build(self, direct: DirectGraph, records: list) -> NativeDirect | None:
        halves = {r.tag.rsplit(".", 1)[1]: r for r in records}
        fw, bw = halves.get("fw"), halves.get("bw")
        why = why_not(direct, fw, bw)
        if why is None:
            return NativeDirect(direct, fw, bw)
        if why.startswith("graph:"):  # never changes for this graph: do not look again
            self._why[direct] = why
        return None


def why_not(direct: DirectGraph, fw: Any, bw: Any) -> str | None:
    """Why this graph cannot run the native direct path now (None: it can). Reasons that
    hold for the graph's life start with ``graph:``; the others may change (a re-plan swaps a
    native program in)."""
    if not direct.plain:
        return "graph: a gradient is expected in another layout than contiguous"
    if direct.no_grad_outputs:  # compiled autograd refuses C++ functions that mark one
        return "graph: an output needs no gradient"
    if fw is None or bw is None:
        return "graph: no forward and backward record"
    for record in (fw, bw):
        runner = record.runner
        interpreter = getattr(runner.program, "interpreter", None) if isinstance(
            runner, Boxed) else None  # fmt: skip
        if interpreter is None:
            return f"{record.tag} runs no native program"
        if interpreter.n_inputs != len(_placeholders(record)):
            return f"graph: {record.tag}'s program takes constants besides its inputs"
    fw_ins, fw_outs = _placeholders(fw), _outputs(fw)
    if not all(_is_tensor(n) for n in (*fw_ins, *fw_outs)):
        return "graph: an input or output of the forward is no tensor"
    saved = len(fw_outs) - direct.num_outputs
    if len(_placeholders(bw)) != saved + len(direct.grad_outputs):
        return "graph: the backward does not take the saved tensors and the gradients"
    bw_outs = _outputs(bw)
    if len(bw_outs) != len(fw_ins) or not all(n is None or _is_tensor(n) for n in bw_outs):
        return "graph: the backward does not return a gradient or None per input"
    return None


def _placeholders(record: Any) -> list:
    return record.gm.graph.find_nodes(op="placeholder")


def _outputs(record: Any) -> list:
    (out,) = record.gm.graph.find_nodes(op="output")
    return list(out.args[0])


def _is_tensor(node: Any) -> bool:
    return isinstance(getattr(node, "meta", {}).get("val"), torch.Tensor)
