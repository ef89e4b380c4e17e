"""The batch-split tier: a Dynamo graph run as two half batches at once, each half on its
own thread at one intra-op thread, through a program compiled for the half
(:mod:`autopar.codegen.batch_split`: which graphs qualify, and why it can pay on few
cores). A contender of the step race like the joint tier: whole training steps decide.

How a call runs (:class:`SplitRunner`, one ``autograd.Function``):

* forward: the batched inputs are sliced in two (views, no copies); each half gets its
  own detached leaves for every input that requires grad (the parameters are shared, not
  copied). The second half runs on a persistent worker thread while the first runs on the
  calling thread; their outputs are concatenated along dim 0. Each half's autograd graph
  is kept for the backward.
* backward: the output gradients are sliced the same way and each half's graph runs
  through ``torch.autograd.grad`` on its own thread at once (the C++ wrapper releases the
  GIL in the compiled backward too). The batched inputs' gradients are concatenated, the
  parameters' summed: the engine then accumulates them into ``.grad`` once, so a tensor
  hook on a parameter runs once with the whole gradient, as in eager.

Neither half ever uses more than one thread, and the two together never more than the
caller's ``torch.get_num_threads()`` (the tier is offered only where that is at least 2).
Not supported (as with any ``autograd.Function`` run once): a second backward through the
same outputs (``retain_graph=True``) and double backward.

Example::

    >>> warm, build, check = split_parts(graph.gm, args, "g0")   # doctest: +SKIP
    >>> check() is None and (warm().wait(), build())             # doctest: +SKIP
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from autopar.codegen.batch_split import (
    batched_inputs,
    compile_split,
    halve,
    split_reason,
    start_split_warmup,
)
from autopar.codegen.emit import Program
from autopar.codegen.inductor import input_meta, stand_ins
from autopar.codegen.joint import JointProgram, roles, with_roles
from autopar.runtime.streams import (
    intra_op_threads,
    release_idle_omp_team,
    set_thread_local_threads,
)


class SplitRunner:
    """Runs a Dynamo graph's compiled half-batch program ``fn`` on both halves of a batch of
    ``batch`` rows at once (module docstring). ``picked``: the batched inputs' positions."""

    def __init__(self, fn: Callable[..., Any], picked: list[int], batch: int):
        self.fn, self.picked, self.half = fn, frozenset(picked), batch // 2
        self.pool = ThreadPoolExecutor(
            1, "autopar-split", initializer=set_thread_local_threads, initargs=(1,)
        )

    def __call__(self, *args: Any) -> tuple:
        return _SplitJoin.apply(self, *args)

    def halves(self, args: tuple) -> list[list]:
        """Two argument lists: the batched inputs' rows split, every input that requires
        grad a fresh leaf (a view of the same data) so each half's gradient stays its own."""
        out = []
        for rows in (slice(0, self.half), slice(self.half, None)):
            half = []
            for i, a in enumerate(args):
                if isinstance(a, torch.Tensor):
                    leaf = a.detach()[rows] if i in self.picked else a.detach()
                    a = leaf.requires_grad_() if a.requires_grad else leaf
                half.append(a)
            out.append(half)
        return out

    def both(self, work: Callable[[int], Any]) -> list:
        """``[work(0), work(1)]``, the second on the worker thread, both at one thread."""
        # The calling thread's OpenMP team (from its last 2-thread op) would spin on the core
        # the worker needs: inception's split step took 15.8 ms with it, 14.1 ms without.
        release_idle_omp_team()
        later = self.pool.submit(work, 1)
        with intra_op_threads(1):
            first = work(0)
        return [first, later.result()]


class _SplitJoin(torch.autograd.Function):
    @staticmethod
    def forward(ctx, runner: SplitRunner, *args):
        halves = runner.halves(args)

        def run(k: int) -> list:
            with torch.enable_grad():
                return list(runner.fn(*halves[k]))

        outs = runner.both(run)
        ctx.state = (runner, halves, outs)
        joined = tuple(torch.cat([a.detach(), b.detach()]) for a, b in zip(*outs, strict=True))
        ctx.mark_non_differentiable(*(j for j, o in zip(joined, outs[0], strict=True)
                                      if not o.requires_grad))  # fmt: skip
        return joined

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, *grads):
        if ctx.state is None:
            raise RuntimeError(
                "autopar: this batch-split graph's backward already ran; a second backward "
                "through the same outputs (retain_graph=True) is not supported by the split "
                "executor. Set AUTOPAR_TIERS without 'split' to train such a loop.")  # fmt: skip
        runner, halves, outs = ctx.state
        ctx.state = None  # the halves' graphs are freed as in eager
        h = runner.half

        def grad(k: int) -> dict[int, torch.Tensor]:
            rows = slice(0, h) if k == 0 else slice(h, None)
            pairs = [(o, g[rows]) for o, g in zip(outs[k], grads, strict=True)
                     if o.requires_grad and g is not None]  # fmt: skip
            leaves = [i for i, a in enumerate(halves[k])
                      if isinstance(a, torch.Tensor) and a.requires_grad]  # fmt: skip
            if not pairs or not leaves:
                return {}
            got = torch.autograd.grad([o for o, _ in pairs], [halves[k][i] for i in leaves],
                                      [g for _, g in pairs], allow_unused=True)  # fmt: skip
            return {i: g for i, g in zip(leaves, got, strict=True) if g is not None}

        first, second = runner.both(grad)
        result: list[torch.Tensor | None] = []
        for i in range(len(halves[0])):
            a, b = first.get(i), second.get(i)
            if a is None and b is None:
                result.append(None)
            elif i in runner.picked:
                a = torch.zeros_like(b) if a is None else a
                b = torch.zeros_like(a) if b is None else b
                result.append(torch.cat([a, b]))
            else:
                result.append(b if a is None else a if b is None else a + b)
        return (None, *result)


def split_parts(gm, args: list, tag: str):
    """``(warm, build, check)`` for the batch-split candidate of Dynamo graph ``gm`` (tag
    ``g<k>``): ``check()`` says why the graph may not be split (None: it may; it traces the
    graph, so it runs off the first step), ``warm()`` starts the half-batch compile in
    another process, ``build()`` compiles it here and returns a :class:`SplitProgram`."""
    meta, kinds = input_meta(args), roles(args)
    found = batched_inputs(gm, meta)
    picked, batch = found if not isinstance(found, str) else ([], 0)

    def half_inputs() -> list:
        return with_roles(stand_ins(halve(meta, picked)), kinds)

    def check() -> str | None:
        if torch.get_num_threads() < 2:
            return "the caller allows one intra-op thread"
        return found if isinstance(found, str) else split_reason(gm, stand_ins(meta))

    def warm():
        return start_split_warmup(gm, half_inputs(), tag)

    def build():
        return SplitProgram(compile_split(gm, half_inputs(), tag=tag), picked, batch)

    return warm, build, check


class SplitProgram:
    """A compiled half-batch program and the runner that splits every call in two: ``fn``
    is what the tier swaps in, ``program(phase)`` what ``autopar.explain`` shows."""

    def __init__(self, joint: JointProgram, picked: list[int], batch: int):
        self.joint, self.picked, self.batch = joint, picked, batch
        self.fn = SplitRunner(joint.fn, picked, batch)

    def program(self, phase: str) -> Program:
        prog = self.joint.program(phase)
        head = (
            f"# autopar: batch split: inputs {sorted(self.picked)} cut into two halves of "
            f"{self.batch // 2} rows, run at once on two threads (one intra-op thread each)\n"
            "# by the program below, compiled for one half with the C++ wrapper\n"
        )
        return Program(head + prog.source, self.fn, None, prog.tag, prog.filename,
                       notes=(*prog.notes, f"batch split: 2 x {self.batch // 2} rows"))  # fmt: skip
