"""The joint tier: a whole Dynamo graph (forward and backward together) compiled by
Inductor's own pipeline (``autopar.codegen.joint``), swapped in for autopar's per-graph
executors only when measured faster: by whole training steps, as a contender of the step
race (``autopar.runtime.race``, wired by the pipeline, under ``autopar.compile`` and
``torch.compile(backend="autopar")`` alike), or, where no race runs (``race=False``), by a
forward and backward timed here. A forward and backward timed alone misjudged
Inception's by 4% against the step (2026-11-30): it is the fallback, not the rule.

Why a tier of its own: its forward saves other tensors for its backward than autopar's
forward does, so the two halves are one executor and are chosen together, per Dynamo
graph. The swap is safe between any two calls: each call's backward is the one of the
``autograd.Function`` its own forward ran (a backward still pending from before the swap
runs autopar's backward, as it should).

Measuring a step of one graph: each candidate runs its forward on the real inputs, then
``torch.autograd.grad`` of the outputs (gradient of ones) with respect to the inputs that
require grad. ``autograd.grad`` returns the gradients without accumulating them into
``.grad``; the inputs that do not require grad (buffers such as BatchNorm statistics, the
batch) and the random generators are restored after every run (``runtime.measure``), so
training is exactly as if only the real call had run. Not measured (the tier is skipped,
with a note) when an input that requires grad carries a tensor hook (``register_hook``):
``autograd.grad`` would run the user's hook once per timed run.

Example::

    >>> warm, build = joint_parts(graph.gm, args, "g0")     # doctest: +SKIP
    >>> proc = warm(); proc.wait(); prog = build()          # doctest: +SKIP
    >>> best = time_forward_backward({"current": graph.runner, "joint": prog.fn}, args)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.utils._pytree as pytree

from autopar.codegen.inductor import input_meta, stand_ins
from autopar.codegen.joint import compile_joint, roles, start_joint_warmup, with_roles
from autopar.runtime.measure import SideEffectGuard, time_candidates

#: Interleaved timed forward-and-backward runs per candidate (after one warm-up each). More
#: than a single graph's ``measure.ROUNDS``: the two pipelines differ by a few percent.
ROUNDS = 5
#: The joint executor must take at most this fraction of the current one's time. Smaller
#: than the per-graph ``LAND_MARGIN``: a forward-and-backward is a longer, steadier sample
#: (best of 5), and the gains this tier exists for are 2-4% (HF BERT, 2026-11-30).
JOINT_MARGIN = 0.99


def trains(records: list) -> bool:
    """Whether AOTAutograd traced this Dynamo graph for training (a ``g<k>.fw`` forward with
    a backward to come), known at its first call. Only those get a joint tier: an inference
    graph (``g<k>.inf``) has no partition to choose, and is the per-graph Inductor tier's."""
    return any(r.tag.endswith(".fw") for r in records)


def ready_to_measure(records: list) -> bool:
    """Both halves ran (forward and backward prepared), so the current executor is what a
    training step really runs."""
    phases = {r.phase for r in records if r.runner is not None}
    return {"forward", "backward"} <= phases


def unmeasurable(args: list) -> str | None:
    """Why a forward-and-backward cannot be timed on ``args`` without side effects."""
    if not torch.is_grad_enabled():
        return "called with grad disabled"
    grads = [a for a in args if isinstance(a, torch.Tensor) and a.requires_grad]
    if not grads:
        return "no input requires grad"
    if any(getattr(a, "_backward_hooks", None) for a in grads):
        return "an input that requires grad has a tensor hook (it would run per timed run)"
    return None


def joint_parts(gm, args: list, tag: str):
    """``(warm, build)`` for the joint candidate of Dynamo graph ``gm`` (tag ``g<k>``): the
    background warm-up and the compile here, both from stand-ins of ``args`` (their shapes,
    strides, dtypes and roles; no data is kept)."""
    meta, kinds = input_meta(args), roles(args)

    def inputs() -> list:
        return with_roles(stand_ins(meta), kinds)

    def warm():
        return start_joint_warmup(gm, inputs(), tag)

    def build():
        return compile_joint(gm, inputs(), tag=tag)

    return warm, build


def _forward_backward(fn: Callable, grad_at: list[int]) -> Callable[[list], Any]:
    def run(args: list) -> None:
        outs = [o for o in pytree.tree_leaves(fn(*args))
                if isinstance(o, torch.Tensor) and o.requires_grad]  # fmt: skip
        if outs:
            torch.autograd.grad(outs, [args[i] for i in grad_at],
                                grad_outputs=[torch.ones_like(o) for o in outs],
                                allow_unused=True)  # fmt: skip

    return run


def time_forward_backward(fns: dict[str, Callable], args: list, rounds: int = ROUNDS) -> dict:
    """Best-of-``rounds`` seconds of a forward and backward per candidate (``fns[name](*args)``
    is a differentiable call of the graph), with every side effect undone (module docstring)."""
    grad_at = [i for i, a in enumerate(args) if isinstance(a, torch.Tensor) and a.requires_grad]
    kept = [i for i, a in enumerate(args) if isinstance(a, torch.Tensor) and not a.requires_grad]
    guard = SideEffectGuard(args, kept)
    runs = {name: _forward_backward(fn, grad_at) for name, fn in fns.items()}
    return time_candidates(runs, args, guard, rounds)
