"""autopar's own ``autograd.Function`` around a training graph's forward and backward, used
in place of AOTAutograd's runtime wrapper where that wrapper has nothing to do.

Why: AOTAutograd wraps every compiled training graph in generated code that handles input
mutations, outputs that alias inputs or each other, tensor subclasses, effect tokens, RNG
functionalization, duplicated and synthetic-base inputs, autocast and compiled autograd.
For a graph with none of these, all it does is call the forward, save tensors, mark the
outputs that need no gradient, and, in the backward, coerce the incoming gradients to the
traced layout and call the backward. The rest costs time on every step: measured on the
4-tower MLP (2 cores, 2026-12-03, 12 ABBA rounds of 40 steps in one process, planned
programs, race and Inductor off), a step took 3.34 ms through AOTAutograd's wrapper and
3.19 ms through this one at batch 64 (4.6%), 2.70 and 2.63 ms at batch 32 (2.6%). A small
Python function on that box runs 3-10x slower right after a large kernel than in a tight
loop (cold caches), so each layer of wrapper costs more inside a step than alone.

What runs: :class:`DirectGraph` is the Dynamo graph's runner once both halves were compiled
(AOTAutograd compiles the backward lazily, at the first backward, so the first step runs
through AOTAutograd). Its forward and backward are the very callables AOTAutograd calls
(``autopar.capture.backend.LazyGraph``), with the same arguments, so the same programs
run, and AOTAutograd's runner stays the fallback:

- built only where :func:`unsupported` finds nothing AOTAutograd would have to do;
- a call under autocast, under a functorch transform (``torch.func``) or with compiled
  autograd on goes through AOTAutograd's runner.

Kept from AOTAutograd: tensors saved with ``save_for_backward``, views detached first (an
in-place change between the forward and the backward raises autograd's usual error);
outputs that need no gradient marked non-differentiable (and no zero gradients made for
them); incoming gradients coerced to the layout the backward was traced for; saved tensors
freed once the backward has read them (unless ``retain_graph``); the double-backward error;
and, for a backward compiled with donated buffers (Inductor writes into saved tensors it
reads last: ``donated``), AOTAutograd's error under ``retain_graph=True``, where a second
backward would read what the first overwrote.

A bypass (``autopar.compat``): on a torch release the project has not tested, or with
``AUTOPAR_BYPASSES=0``, every graph runs through AOTAutograd's wrapper.

Example::

    >>> meta = compat.current_tracing_context().fw_metadata   # doctest: +SKIP
    >>> unsupported(meta, num_inputs=35)       # None: this graph can run directly
    >>> runner = DirectGraph(meta, fw, bw, aot_runner)             # doctest: +SKIP
    >>> out = runner(*args)                    # what AOTAutograd's runner returns
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from autopar import compat

compiled_autograd = compat.dynamo_compiled_autograd()  # imported already: Dynamo runs
coerce_to_expected_memory_format = compat.coerce_to_expected_memory_format_fn()
make_contiguous_strides_for = compat.make_contiguous_strides_for

#: AOTAutograd's error for a backward with donated buffers under ``retain_graph=True``
#: (torch 2.13, ``runtime_wrappers``), with what autopar adds.
DONATED_RETAIN = (
    "This backward function was compiled with non-empty donated buffers which requires "
    "create_graph=False and retain_graph=False. Please keep backward(create_graph=False, "
    "retain_graph=False) across all backward() function calls, or set "
    "torch._functorch.config.donated_buffer=False to disable donated buffer. (autopar: or set "
    "compile with executors=('eager', 'plan'): 'inductor' and 'split' donate buffers)"
)


def enabled() -> bool:
    return compat.bypasses_on()


def attach(graph: Any, forward: Callable, backward: Callable, meta: Any, autocast: bool) -> None:
    """Make a :class:`DirectGraph` the runner of ``graph`` (a ``capture.DynamoGraph`` whose
    halves ``forward`` and ``backward`` are both compiled) where nothing needs AOTAutograd's
    wrapper; ``graph.autograd`` says which runs, and why. ``meta``: AOTAutograd's metadata;
    ``autocast``: whether the forward was traced under autocast. A runner that replaced
    ``graph.runner`` already stays; ``graph.captured`` changes either way."""
    if isinstance(graph.captured, DirectGraph):
        return  # attached already
    runner, label = direct_runner(graph.gm, meta, forward, backward, graph.captured, autocast)
    with graph.lock:
        graph.autograd = label
        if runner is None:
            return
        if graph.runner is graph.captured:
            graph.runner = runner
        graph.captured = runner


def direct_runner(gm: Any, meta: Any, forward: Callable, backward: Callable, aot: Callable,
                  autocast: bool, donated: bool = False,
                  ) -> tuple[DirectGraph | None, str]:  # fmt: skip
    """``(DirectGraph, "direct")`` for the Dynamo graph ``gm``'s compiled halves where
    nothing needs AOTAutograd's wrapper, else ``(None, "AOTAutograd (<why>)")``: the label
    ``autopar.explain`` shows. ``aot``: AOTAutograd's runner; ``autocast``: whether the
    forward was traced under autocast; ``donated``: whether the backward was compiled with
    donated buffers (module docstring)."""
    inputs = len(gm.graph.find_nodes(op="placeholder"))
    why = (
        compat.bypasses_off_reason() if not enabled()
        else "traced under autocast" if autocast
        else unsupported(meta, inputs)
    )  # fmt: skip
    if why is None:
        try:
            return DirectGraph(meta, forward, backward, aot, donated), "direct"
        except ValueError as exc:
            why = str(exc)
    return None, f"AOTAutograd ({why})"


def unsupported(meta: Any, num_inputs: int) -> str | None:
    """Why AOTAutograd's runtime wrapper would do more for this graph than
    :class:`DirectGraph` does (None: nothing). ``meta`` is AOTAutograd's
    ``ViewAndMutationMeta`` of the graph; ``num_inputs`` the forward graph's inputs."""
    if meta is None:
        return "no AOTAutograd metadata"
    checks = (
        (len(meta.input_info) != num_inputs, "inputs lifted or deduplicated by AOTAutograd"),
        (any(i.mutates_data or i.mutates_metadata for i in meta.input_info),
         "the graph mutates an input"),
        (meta.num_intermediate_bases or meta.tokens or meta.num_backward_tokens,
         "outputs alias intermediates, or effect tokens"),
        (meta.is_rng_op_functionalized or meta.num_graphsafe_rng_states,
         "functionalized random numbers"),
        (meta.num_symints_saved_for_bw or meta.num_tensors_saved_with_no_vc_check
         or meta.num_opaque_objects_saved_for_bw, "saves symbols or unchecked tensors"),
        (meta.grad_enabled_mutation is not None, "the graph changes grad mode"),
        (getattr(meta, "dynamic_saved_tensors_idxs", None), "saves tensors of dynamic shape"),
        (meta.indices_of_inputs_that_requires_grad_with_mutations_in_bw,
         "the backward mutates an input"),
        (not all(_plain(m) for m in (*meta.subclass_inp_meta, *meta.subclass_fw_graph_out_meta,
                                     *meta.subclass_tangent_meta)), "tensor subclasses"),
        (not all(_plain_output(o) for o in meta.output_info), "an output aliases or is no tensor"),
    )  # fmt: skip
    return next((why for bad, why in checks if bad), None)


def _plain(m: Any) -> bool:
    return type(m).__name__ == "PlainTensorMeta"


def _plain_output(info: Any) -> bool:
    """An output AOTAutograd returns as it is (``NoopAliasHandler``): no alias, or the
    ``_unsafe_view`` of an intermediate no one else sees."""
    kind = info.output_type.name
    return kind in ("non_alias", "unsafe_view_alias") and issubclass(info.raw_type, torch.Tensor)


class DirectGraph:
    """The runner of one training Dynamo graph: ``runner(*args)`` returns what AOTAutograd's
    runner returns (a list of the user outputs), through an ``autograd.Function`` of its
    own (one class per graph: the graph is bound to it, not passed on every call).

    ``forward(list) -> outs`` and ``backward(list) -> grads`` are the boxed callables
    AOTAutograd calls; ``aot(*args)`` is AOTAutograd's runner, for the calls this one
    leaves to it; ``donated``: the backward writes into saved tensors (module docstring)."""

    def __init__(self, meta: Any, forward: Callable, backward: Callable, aot: Callable,
                 donated: bool = False):  # fmt: skip
        self.forward, self.backward, self.aot = forward, backward, aot
        self.donated = donated
        outputs = meta.output_info
        self.num_outputs = len(outputs)
        self.no_grad_outputs = [i for i, o in enumerate(outputs) if not o.requires_grad]
        # The backward takes a gradient for the outputs that take part in it, in order.
        self.grad_outputs = [i for i, o in enumerate(outputs) if o.requires_grad_for_backward]
        self.layouts = [m.memory_format for m in meta.subclass_tangent_meta]
        if len(self.layouts) != len(self.grad_outputs):
            raise ValueError("tangent layouts do not match the outputs that take gradients")
        # every incoming gradient is expected contiguous: Tensor.contiguous() coerces it
        self.plain = all(_is_contiguous_layout(x) for x in self.layouts)
        self.function = _function_for(self)
        # ``native(args) -> outputs``: the same two programs as one C++ autograd function,
        # set by the runtime while both halves run native programs and nothing needs their
        # Python calls (``autopar.runtime.native_direct``); None: ``function`` runs.
        self.native: Callable[[tuple], list] | None = None

    def __call__(self, *args: Any) -> list:
        if aot_only():
            return self.aot(*args)
        native = self.native
        if native is not None:
            return native(args)
        outs = self.function.apply(*args)
        return [outs] if self.num_outputs == 1 else list(outs)

    def __repr__(self) -> str:
        return f"DirectGraph(outputs={self.num_outputs}, grads={len(self.grad_outputs)})"


def aot_only() -> bool:
    """Whether this call must go through AOTAutograd's runner: under autocast (it turns
    autocast off around the graph, whose casts are traced in; Dynamo guards on the autocast
    state, so such a graph is always called under autocast), compiled autograd or a
    functorch transform (``torch.func``), which autopar's functions do not handle."""
    return (compat.is_any_autocast_enabled() or _compiled_autograd()
            or compat.peek_interpreter_stack() is not None)  # fmt: skip


def _compiled_autograd() -> bool:
    return compiled_autograd.compiled_autograd_enabled


def _function_for(graph: DirectGraph) -> type[torch.autograd.Function]:
    """forward: the compiled forward; its outputs past the user's are the saved tensors.
    backward: the compiled backward on the saved tensors and the coerced gradients."""
    fw, bw, n = graph.forward, graph.backward, graph.num_outputs
    no_grad, grad_at, layouts = graph.no_grad_outputs, graph.grad_outputs, graph.layouts
    plain, donated = graph.plain, graph.donated

    class DirectFunction(torch.autograd.Function):
        @staticmethod
        def forward(ctx, *args):
            outs = fw(list(args))
            # Views saved as themselves would be views made under no_grad (AOTAutograd's
            # Note [Detaching saved tensors in AOTAutograd]): an in-place change of their
            # base would then raise another error than autograd's version check.
            ctx.save_for_backward(*(x.detach() if x._is_view() else x for x in outs[n:]))
            if no_grad:
                ctx.mark_non_differentiable(*(outs[i] for i in no_grad))
                ctx._materialize_non_diff_grads = False  # as AOTAutograd: no zeros for them
            return outs[0] if n == 1 else tuple(outs[:n])

        @staticmethod
        def backward(ctx, *grads):
            args = list(ctx.saved_tensors)
            if not compat.get_current_graph_task_keep_graph():
                ctx.maybe_clear_saved_tensors()  # the backward frees what it has read
            elif donated:
                raise RuntimeError(DONATED_RETAIN)
            if plain:  # the usual case: contiguous gradients expected
                args += [_contiguous(grads[i]) for i in grad_at]
            else:
                args += [_coerce(grads[i], layouts[j]) for j, i in enumerate(grad_at)]
            if torch.is_grad_enabled():  # create_graph=True: results usable, not differentiable
                # A leaf that requires grad gives the results a grad_fn even where nothing
                # else does (the saved tensors are detached), as in AOTAutograd.
                anchor = torch.empty(0, requires_grad=True)
                return _NoDoubleBackward.apply(bw, anchor, *args)
            return tuple(bw(args))

    return DirectFunction


def _contiguous(grad: torch.Tensor | None) -> torch.Tensor | None:
    return None if grad is None else grad.contiguous()


def _is_contiguous_layout(layout: Any) -> bool:
    """A traced tangent layout that ``Tensor.contiguous()`` meets exactly."""
    if layout is None or layout.memory_format is not None:
        return layout is None or layout.memory_format == torch.contiguous_format
    return tuple(layout.stride) == tuple(make_contiguous_strides_for(layout.size))


def _coerce(grad: torch.Tensor | None, layout: Any) -> torch.Tensor | None:
    """``grad`` in the layout the backward graph was traced for: AOTAutograd's own
    ``coerce_to_expected_memory_format`` (a memory format, or exact strides)."""
    if grad is None or layout is None:
        return grad
    return coerce_to_expected_memory_format(grad, layout)


class _NoDoubleBackward(torch.autograd.Function):
    """The backward under ``create_graph=True``: its results are connected to the graph, and
    differentiating them raises the error AOTAutograd raises."""

    @staticmethod
    def forward(ctx, backward: Callable, anchor: torch.Tensor, *args):
        return tuple(backward(list(args)))

    @staticmethod
    def backward(ctx, *grads):
        raise RuntimeError(
            "torch.compile with aot_autograd does not currently support double backward "
            "(autopar: a compiled graph's backward cannot be differentiated again; run that "
            "part eagerly)"
        )
