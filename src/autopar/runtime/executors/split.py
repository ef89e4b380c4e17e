"""The ``split`` executor: a Dynamo graph run as two half batches at once, each half on its
own thread at one intra-op thread, through a program compiled for the half
(:mod:`autopar.codegen.batch_split`: which graphs qualify, and why it can pay on few
cores). Offered where the graph provably keeps its rows apart and the profile predicts a
gain (:func:`why_not`); whole training steps decide (``autopar.runtime.judge``).

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
caller's ``torch.get_num_threads()`` (the executor is offered only where that is at least 2).
Not supported (as with any ``autograd.Function`` run once): a second backward through the
same outputs (``retain_graph=True``) and double backward.

Where it can, the same split runs natively (:class:`NativeSplitRunner`: ``split.cpp`` in
``autopar.runtime.native``): one C++ autograd function calls the compiled program's C++
entry on both halves from a two-thread OpenMP region, with no Python between the halves
and autograd (measured in ``split.cpp``'s header). It runs the same compiled kernels on
the same halves. Where it cannot (no native extension built, a torch release the project
has not tested (:mod:`autopar.compat`), an output that needs no gradient, a layout the
backward does not take as it comes; and per call: autocast, compiled autograd,
``torch.func``, saved-tensor hooks) the Python runner runs; ``autopar.explain`` says which
ran and why.

Example::

    >>> warm, build, check = split_parts(graph.gm, args, "g0")   # doctest: +SKIP
    >>> check() is None and (warm().wait(), build())             # doctest: +SKIP
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from autopar import compat
from autopar.capture.direct_autograd import DONATED_RETAIN, DirectGraph, aot_only
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
from autopar.runtime import native
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
        """``[work(0), work(1)]``, the second on the worker thread, both at one thread; both
        on the calling thread where it has thread-local state a worker would not see
        (:func:`caller_only_state`: saved-tensor hooks, a mode, a ``torch.func`` transform)."""
        if caller_only_state() is not None:
            return [work(0), work(1)]
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
                "executor: compile with executors=('eager', 'plan') for such a loop.")  # fmt: skip
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
        return SplitProgram(compile_split(gm, half_inputs(), tag=tag), picked, batch, len(args))

    return warm, build, check


#: The split must be predicted at most this fraction of the whole batch's time to be built.
PREDICTED_GAIN = 0.95


def why_not(graph, args: list, records: list, profile) -> str | None:
    """Why the ``split`` executor cannot run (or cannot win on) Dynamo graph ``graph``, None
    where it may: a CPU training graph, at least two intra-op threads, rows provably apart
    at full and half batch (``codegen.batch_split``), and a profile (``profile``: the
    graph's per-operator tables) whose one-thread times at half batch predict a gain:
    ``sum(time_1t) / 2 < PREDICTED_GAIN * sum(time)``."""
    if not any(r.tag.endswith(".fw") for r in records):
        return "an inference graph"
    if any(isinstance(a, torch.Tensor) and a.device.type != "cpu" for a in args):
        return "not a CPU graph"
    *_, check = split_parts(graph.gm, args, graph.tag)
    why = check()
    if why is not None:
        return why
    tables = [t for t in (profile or ()) if t is not None and "time_1t_s" in t]
    if tables:
        whole = sum(float(t["time_s"].sum()) for t in tables)
        half = sum(float(t["time_1t_s"].fillna(t["time_s"]).sum()) for t in tables) / 2
        if half >= PREDICTED_GAIN * whole:
            return (f"the profile predicts no gain (one thread, half batch: {half * 1e3:.2f} "
                    f"ms vs {whole * 1e3:.2f} ms)")  # fmt: skip
    return None


def parts(graph, args: list, profile=None):
    """``(warm, build)`` of the split program (see :func:`split_parts`)."""
    warm, build, _ = split_parts(graph.gm, args, graph.tag)
    return warm, build


class NativeSplitRunner:
    """The split of :class:`SplitRunner` as one C++ autograd function (``split.cpp``):
    ``runner(*args)`` returns the same outputs. ``python``: the Python runner, for the calls
    the C++ function leaves to it (autocast, compiled autograd, ``torch.func``: the compiled
    halves' own runner handles those; saved-tensor hooks: the C++ function keeps its saved
    tensors itself, to free them as the backward runs)."""

    def __init__(self, split_id: int, n_out: int, python: SplitRunner):
        self.split_id, self.n_out, self.python = split_id, n_out, python
        self._apply = native.load(build=False).split_apply

    def __call__(self, *args: Any) -> tuple:
        if aot_only() or caller_only_state() is not None:
            return self.python(*args)
        return tuple(self._apply(list(args), self.split_id, self.n_out))


def native_split(joint: JointProgram, picked: list[int], batch: int, n_args: int):
    """``(split_id, None)`` where the split of ``joint`` can run natively (``split.cpp``), else
    ``(None, why)``."""
    direct = joint.fn
    if not compat.bypasses_on():
        return None, compat.bypasses_off_reason()
    if not native.available():
        return None, native.cannot_build() or "the native extension is not built yet"
    if not isinstance(direct, DirectGraph):
        return None, f"the halves run through {joint.autograd}"
    if joint.shared_outputs:  # split.cpp owns each output's memory: one fresh tensor each
        return None, f"the compiled forward's outputs share memory ({joint.shared_outputs})"
    if not direct.plain or direct.no_grad_outputs:
        return None, "an output needs no gradient, or a gradient layout is not contiguous"
    fw = _entry(direct.forward, joint.arity.get("forward"))
    bw = _entry(direct.backward, joint.arity.get("backward"))
    if isinstance(fw, str) or isinstance(bw, str):
        return None, fw if isinstance(fw, str) else bw
    saved = fw[2] - direct.num_outputs
    if fw[1] != n_args or bw[1] != saved + len(direct.grad_outputs) or bw[2] != n_args:
        return None, "the compiled halves do not take the graph's inputs and gradients"
    mask = [i in picked for i in range(n_args)]
    donated = DONATED_RETAIN if direct.donated else ""
    ext = native.load(build=False)
    return ext.split_program(fw, bw, mask, batch, list(direct.grad_outputs), donated), None


def _entry(compiled: Any, arity: tuple[int, int] | None) -> tuple[str, int, int] | str:
    """``(library, inputs, outputs)`` of a C++-wrapper compile's entry, or why there is none:
    the library is the one its callable's module binds as ``inductor_entry`` (torch 2.13),
    the counts those of the graph Inductor compiled (``arity``: the compile's own record),
    checked against the compiled graph's output strides."""
    call = getattr(compiled, "current_callable", None)
    binding = getattr(call, "__globals__", {}).get("inductor_entry")
    path = getattr(getattr(binding, "__self__", None), "__file__", None)
    if path is None or arity is None:
        return "a compiled half has no C++-wrapper entry"
    if len(getattr(compiled, "output_strides", None) or ()) != arity[1]:
        return "a compiled half returns another number of outputs than its graph"
    if getattr(compiled, "constants", None):
        return "a compiled half takes constants besides its inputs"
    return path, arity[0], arity[1]


_saved_tensor_hooks = compat.top_saved_tensors_default_hooks


def caller_only_state() -> str | None:
    """What of the calling thread's state a worker thread would not see (None: nothing):
    saved-tensor hooks, a dispatch or ``__torch_function__`` mode, a ``torch.func``
    transform, inference mode. Both halves then run on the calling thread (the native
    runner keeps its saved tensors itself, so it leaves such calls to the Python runner):
    a hook must see every tensor of the whole batch, as in eager."""
    if _saved_tensor_hooks(False) is not None:
        return "saved-tensor hooks"
    if compat.len_torch_dispatch_stack() or compat.len_torch_function_stack():
        return "a dispatch or torch-function mode"
    if compat.peek_interpreter_stack() is not None:
        return "a torch.func transform"
    if torch.is_inference_mode_enabled():
        return "inference mode"
    return None


class SplitProgram:
    """A compiled half-batch program and the runner that splits every call in two: ``fn``
    is what runs the graph, ``program(phase)`` what ``autopar.explain`` shows."""

    def __init__(self, joint: JointProgram, picked: list[int], batch: int, n_args: int):
        self.joint, self.picked, self.batch = joint, picked, batch
        python = SplitRunner(joint.fn, picked, batch)
        split_id, why = native_split(joint, picked, batch, n_args)
        self.runner = "native (split.cpp)" if why is None else f"Python ({why})"
        self.fn = python if why is not None else NativeSplitRunner(
            split_id, joint.fn.num_outputs, python)  # fmt: skip

    def program(self, phase: str) -> Program:
        prog = self.joint.program(phase)
        head = (
            f"# autopar: batch split: inputs {sorted(self.picked)} cut into two halves of "
            f"{self.batch // 2} rows, run at once on two threads (one intra-op thread each)\n"
            "# by the program below, compiled for one half with the C++ wrapper\n"
        )
        return Program(head + prog.source, self.fn, None, prog.tag, prog.filename,
                       notes=(*prog.notes, f"batch split: 2 x {self.batch // 2} rows",
                              f"split runner: {self.runner}"))  # fmt: skip
