"""The one door to PyTorch's private APIs: the torch releases this project has tested, and
each private name it uses, found here and nowhere else.

Why: autopar reads and calls parts of Dynamo, AOTAutograd and Inductor that are not public,
and some of its fast paths (*bypasses*) copy what PyTorch does per call to skip a wrapper:

* ``capture.dynamo_call``: Dynamo's cached code, called after Dynamo's own guards;
* ``capture.direct_autograd``: AOTAutograd's runtime wrapper replaced where it has nothing to
  do (it reads AOTAutograd's ``ViewAndMutationMeta``);
* ``runtime.native_direct`` and the native batch split (``split.cpp``): compiled programs
  called from C++ (the second calls Inductor's C++-wrapper entry by its symbol).

A feature check ("this torch has the names") would turn them on for a release whose
behaviour behind the names changed, and a wrong guess there corrupts results silently. So
the bypasses run only on a release listed in :data:`TESTED_RELEASES` and only while the
snapshot of what they rely on matches (``tests/test_compat.py`` pins the snapshot); on any
other release they are off, with one info line on the ``"autopar"`` logger, and the public
paths run. ``AUTOPAR_BYPASSES=0`` turns them off on a tested release too.

Example::

    >>> from autopar import compat
    >>> compat.release() in compat.TESTED_RELEASES or not compat.bypasses_on()
    True
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os

import torch

log = logging.getLogger("autopar")

#: The torch releases the whole test suite ran on (``make test``), without a build tag.
TESTED_RELEASES = ("2.13.0",)
#: ``AUTOPAR_BYPASSES=0``: the public paths only, on any release.
ENV = "AUTOPAR_BYPASSES"
#: The fields of AOTAutograd's ``ViewAndMutationMeta`` that ``capture.direct_autograd``
#: was written against (torch 2.13): another set means AOTAutograd's runtime wrapper may do
#: work that the direct path does not.
AOT_META_FIELDS = frozenset({
    "act_input_indices", "bw_donated_idxs", "compile_id_str", "deterministic",
    "grad_enabled_mutation", "graphsafe_rng_device", "graphsafe_rng_state_index",
    "indices_of_inputs_that_requires_grad_with_mutations_in_bw", "input_info",
    "keep_input_mutations", "mutated_inp_stream_indices", "num_backward_tokens",
    "num_graphsafe_rng_states", "num_intermediate_bases", "num_opaque_objects_saved_for_bw",
    "num_symints_saved_for_bw", "num_tensors_saved_with_no_vc_check", "output_info",
    "static_input_indices", "subclass_fw_graph_out_meta", "subclass_inp_meta",
    "subclass_tangent_meta", "tangent_source_stack_traces", "tokens", "traced_tangent_metas",
    "traced_tangents", "traced_tangents_descs",
})  # fmt: skip


def release(version: str | None = None) -> str:
    """The torch release, without its build tag: ``"2.13.0"`` for ``"2.13.0+cpu"``."""
    return str(torch.__version__ if version is None else version).split("+")[0]


def tested() -> bool:
    """Whether this torch is a release the project has tested."""
    return release() in TESTED_RELEASES


def bypasses_off_reason() -> str | None:
    """Why the bypasses are off in this process (None: they are on)."""
    if os.environ.get(ENV, "").strip().lower() in ("0", "off", "false", "no"):
        return f"switched off (${ENV}=0)"
    if not tested():
        return (f"torch {release()} is not a tested release "
                f"({', '.join(TESTED_RELEASES)}): the public paths run")  # fmt: skip
    why = _snapshot_problem()
    if why is not None:
        return f"this torch differs from the tested one ({why}): the public paths run"
    return None


def bypasses_on() -> bool:
    """Whether the fast paths that copy PyTorch's per-call work may run (module docstring).
    The first time they may not, one info line says why."""
    why = bypasses_off_reason()
    if why is not None:
        _say_once(why)
    return why is None


@functools.cache
def _say_once(why: str) -> None:
    log.info("autopar: the fast paths around Dynamo and AOTAutograd are off: %s", why)


@functools.cache
def _snapshot_problem() -> str | None:
    """What of the bypasses' snapshot this torch does not match (None: all of it)."""
    ViewAndMutationMeta = view_and_mutation_meta_class()  # noqa: N806 - a class
    if ViewAndMutationMeta is None:
        return "no ViewAndMutationMeta"
    fields = {f.name for f in dataclasses.fields(ViewAndMutationMeta)}
    if fields != AOT_META_FIELDS:
        return f"ViewAndMutationMeta fields {sorted(fields ^ AOT_META_FIELDS)} changed"
    if dynamo_cache_entries() is None:
        return "no Dynamo cache-entry API"
    return None


# -- the private names ----------------------------------------------------------------------
# Every private PyTorch name autopar uses (``torch._*``, and private modules of public
# packages such as ``torch.utils._pytree``) is reached through this section and nowhere else
# (``tests/test_architecture.py`` checks it). Two kinds of accessor:
#
# * names of modules that ``import torch`` has loaded already (``torch._C``, ``torch._ops``,
#   ``torch._VF``, ``torch._prims_common``, ``torch.utils._pytree``, ...) are bound here at
#   import, so the hot paths call them without an extra Python frame; a name this torch
#   lacks is bound to a stand-in that raises a clear error when called (:func:`_bound`);
# * the rest (Dynamo, AOTAutograd, Inductor: slow to import, Inductor above all) are
#   functions that import on first use. A function named for a thing returns it (a module,
#   a class, a lock; cached: the per-call paths read Dynamo's config through it); one named
#   for an action does it and returns its result.


class MissingPrivateAPI(RuntimeError):
    """A private PyTorch name autopar uses is not in this torch."""


def _missing(name: str):
    def missing(*args, **kwargs):
        raise MissingPrivateAPI(
            f"autopar uses {name}, which torch {torch.__version__} does not have "
            f"(tested releases: {', '.join(TESTED_RELEASES)})"
        )

    missing.__name__ = missing.__qualname__ = name
    return missing


def _bound(module: str, path: str):
    """``module.path`` (an attribute path), or :func:`_missing`'s stand-in for it."""
    import importlib

    try:
        obj = importlib.import_module(module)
        for part in path.split("."):
            obj = getattr(obj, part)
    except (ImportError, AttributeError):
        return _missing(f"{module}.{path}")
    return obj


# -- dispatch, autograd and the C extension (bound at import) --------------------------------
#: An aten-style operator overload (``aten.mm.default``): FX targets that have a schema.
OpOverload = torch._ops.OpOverload
#: An operator packet (``aten.mm``): graph signatures print it like an overload.
OpOverloadPacket = torch._ops.OpOverloadPacket
#: Whether autocast is on for any device: the direct AOTAutograd path leaves such calls.
is_any_autocast_enabled = _bound("torch._C", "_is_any_autocast_enabled")
#: The innermost ``torch.func`` transform (None outside one): such calls take the slow path.
peek_interpreter_stack = _bound("torch._C", "_functorch.peek_interpreter_stack")
#: How many ``TorchDispatchMode`` are active: the split runner stays on the caller's thread.
len_torch_dispatch_stack = _bound("torch._C", "_len_torch_dispatch_stack")
#: How many ``__torch_function__`` modes are active (the same check as above).
len_torch_function_stack = _bound("torch._C", "_len_torch_function_stack")
#: The innermost saved-tensor hooks (``top_saved_tensors_default_hooks(False)``): None if none.
top_saved_tensors_default_hooks = _bound("torch._C", "_autograd._top_saved_tensors_default_hooks")
#: Whether the running backward keeps the graph (``retain_graph``): direct_autograd frees.
get_current_graph_task_keep_graph = _bound(
    "torch._C", "_autograd._get_current_graph_task_keep_graph"
)
#: The TorchScript tracer's state (None when not tracing): the Dynamo cached call steps aside.
get_tracing_state = _bound("torch._C", "_get_tracing_state")
#: ``F.linear``'s C implementation, as FX graphs name it: the RNN cell-loop matcher.
nn_linear = _bound("torch._C", "_nn.linear")
#: ATen's GRU (``torch._VF.gru``): the loop of ``autopar::gru_layer``'s forward.
vf_gru = _bound("torch._VF", "gru")
#: The row-major strides of a size: direct_autograd's check for plain tangent layouts.
make_contiguous_strides_for = _bound("torch._prims_common", "make_contiguous_strides_for")
#: The leaves of a pytree (``torch.utils._pytree``): graph outputs measured and compared.
tree_leaves = _bound("torch.utils._pytree", "tree_leaves")
#: Whether ``torch.fx.symbolic_trace`` is tracing: the Dynamo cached call steps aside.
is_fx_symbolic_tracing = _bound("torch.fx._symbolic_trace", "is_fx_symbolic_tracing")
#: The active ``TorchDispatchMode`` stack: the profiler looks for AOTAutograd's check mode.
get_current_dispatch_mode_stack = _bound(
    "torch.utils._python_dispatch", "_get_current_dispatch_mode_stack"
)
#: A context manager that pops the top dispatch mode while entered (the same use).
pop_mode_temporarily = _bound("torch.utils._python_dispatch", "_pop_mode_temporarily")


def autocast_dispatch_key(device_type: str) -> str:
    """The autocast dispatch key of a device type (``"AutocastCPU"``): autopar's autocast
    kernels for its custom RNN ops are registered under it."""
    return "Autocast" + torch._C._dispatch_key_for_device(device_type)


def exclude_dispatch_key(key: str):
    """A factory of guards (``factory()`` is a context manager) that exclude dispatch key
    ``key`` while entered: an autocast kernel runs its op below autocast, as ATen's do."""
    keys = torch._C.DispatchKeySet(getattr(torch._C.DispatchKey, key))
    return functools.partial(torch._C._ExcludeDispatchKeyGuard, keys)


# -- Dynamo ------------------------------------------------------------------------------------
def dynamo_cache_entries():
    """Dynamo's cache entries of a code object (``_debug_get_cache_entry_list``), or None."""
    try:
        from torch._C._dynamo.eval_frame import _debug_get_cache_entry_list
    except ImportError:
        return None
    return _debug_get_cache_entry_list


@functools.cache
def dynamo_config():
    """``torch._dynamo.config``: recompile limits, hook guards, ``allow_rnn``, ``disable``."""
    import torch._dynamo.config

    return torch._dynamo.config


@functools.cache
def dynamo_eval_frame():
    """``torch._dynamo.eval_frame``: the Dynamo cached call reads its compile stance."""
    import torch._dynamo.eval_frame

    return torch._dynamo.eval_frame


@functools.cache
def dynamo_compiled_autograd():
    """``torch._dynamo.compiled_autograd``: the direct path leaves calls where it is on."""
    from torch._dynamo import compiled_autograd

    return compiled_autograd


@functools.cache
def optimized_module_class() -> type:
    """Dynamo's ``OptimizedModule`` (what ``torch.compile(module)`` returns): the backend
    finds the user's module being compiled by it."""
    from torch._dynamo.eval_frame import OptimizedModule

    return OptimizedModule


def dynamo_current_tx():
    """The frame Dynamo is tracing now (``InstructionTranslator.current_tx()``): the
    backend names the model of a ``torch.compile(..., backend="autopar")``. Raises where
    none is (or on a torch without it)."""
    from torch._dynamo.symbolic_convert import InstructionTranslator

    return InstructionTranslator.current_tx()


def register_dynamo_backend(fn, name: str):
    """Register ``fn`` as Dynamo backend ``name`` (``backend="autopar"``)."""
    import torch._dynamo

    return torch._dynamo.register_backend(fn, name=name)


@functools.cache
def dynamo_exception_classes() -> tuple[type, type] | None:
    """``(TorchDynamoException, TorchRuntimeError)``, or None on a torch without Dynamo:
    autopar unwraps the user's own error from Dynamo's."""
    try:
        from torch._dynamo.exc import TorchDynamoException, TorchRuntimeError
    except ImportError:
        return None
    return TorchDynamoException, TorchRuntimeError


@functools.cache
def restart_analysis_class() -> type:
    """Dynamo's ``RestartAnalysis``: its own control flow, which the backend re-raises."""
    from torch._dynamo.exc import RestartAnalysis

    return RestartAnalysis


@functools.cache
def dynamo_compile_lock():
    """Dynamo's compile lock: autopar's own traces and compiles run under it, as Dynamo's."""
    from torch._dynamo.convert_frame import compile_lock

    return compile_lock


def dynamo_aot_autograd(**kwargs):
    """A Dynamo backend that runs AOTAutograd with the given compilers (``aot_autograd``)."""
    from torch._dynamo.backends.common import aot_autograd

    return aot_autograd(**kwargs)


def dynamo_metrics_context():
    """Dynamo's compile metrics (``get_metrics_context()``): the recompile reason."""
    from torch._dynamo.utils import get_metrics_context

    return get_metrics_context()


def dynamo_reset() -> None:
    """Drop every compiled graph (``torch._dynamo.reset()``): the benchmark between models."""
    import torch._dynamo

    torch._dynamo.reset()


def assume_constant_result(fn):
    """``torch._dynamo.assume_constant_result`` as a decorator: Dynamo bakes in the result
    (the RNN form choice, timed once outside the graph)."""
    import torch._dynamo

    return torch._dynamo.assume_constant_result(fn)


def dynamo_disable(fn):
    """``torch._dynamo.disable`` as a decorator: the function runs eagerly, a graph break
    (the cuDNN RNN forward)."""
    import torch._dynamo

    return torch._dynamo.disable(fn)


# -- AOTAutograd, functorch, fake tensors ----------------------------------------------------
@functools.cache
def functorch_config():
    """``torch._functorch.config``: AOTAutograd's settings, patched around autopar's traces."""
    import torch._functorch.config

    return torch._functorch.config


@functools.cache
def view_and_mutation_meta_class() -> type | None:
    """AOTAutograd's ``ViewAndMutationMeta`` (None where it moved): the bypasses' snapshot."""
    try:
        from torch._functorch._aot_autograd.schemas import ViewAndMutationMeta
    except ImportError:
        return None
    return ViewAndMutationMeta


@functools.cache
def coerce_to_expected_memory_format_fn():
    """AOTAutograd's ``coerce_to_expected_memory_format(grad, layout)``: direct_autograd
    gives the backward its gradients in the traced layout, as AOTAutograd does."""
    from torch._functorch._aot_autograd.runtime_wrappers import coerce_to_expected_memory_format

    return coerce_to_expected_memory_format


@functools.cache
def custom_op_analysis_mode_class() -> type | None:
    """AOTAutograd's first-call ``_AnalyzeCustomOpInputOutputMode`` (None where this torch
    has none): the profiler suspends it to time the operators' own cost."""
    try:
        from torch._functorch._aot_autograd.runtime_wrappers import (
            _AnalyzeCustomOpInputOutputMode,
        )
    except ImportError:
        return None
    return _AnalyzeCustomOpInputOutputMode


def default_partition(*args, **kwargs):
    """AOTAutograd's default partition (``partitioners.default_partition``): the batch
    split's partitioner saves what the forward computed."""
    from torch._functorch.partitioners import default_partition

    return default_partition(*args, **kwargs)


def current_tracing_context():
    """The ``TracingContext`` of the trace running now, or None: AOTAutograd's metadata."""
    from torch._guards import TracingContext

    return TracingContext.try_get()


def tracing_context(fake_mode):
    """A new ``TracingContext`` over ``fake_mode``: a joint compile outside Dynamo."""
    from torch._guards import TracingContext

    return TracingContext(fake_mode)


def tracing(context):
    """``torch._guards.tracing(context)``: a context manager making ``context`` current."""
    from torch._guards import tracing

    return tracing(context)


def fake_tensor_mode(**kwargs):
    """A new ``FakeTensorMode(**kwargs)``: the stand-in inputs of a joint compile."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    return FakeTensorMode(**kwargs)


# -- Inductor (always imported lazily: slow) ---------------------------------------------------
@functools.cache
def inductor_config():
    """``torch._inductor.config``: Inductor's settings, patched for autopar's compiles."""
    from torch._inductor import config

    return config


def compile_fx(*args, **kwargs):
    """Inductor's ``compile_fx``: a joint forward-and-backward compile of a Dynamo graph."""
    from torch._inductor.compile_fx import compile_fx

    return compile_fx(*args, **kwargs)


def compile_fx_inner(*args, **kwargs):
    """Inductor's ``compile_fx_inner``: one graph (a forward or a backward) compiled."""
    from torch._inductor.compile_fx import compile_fx_inner

    return compile_fx_inner(*args, **kwargs)


@functools.cache
def custom_partitioner_class() -> type:
    """Inductor's ``CustomPartitionerFn`` base: the batch split's default partition."""
    from torch._inductor.custom_graph_pass import CustomPartitionerFn

    return CustomPartitionerFn


def inductor_default_cache_dir() -> str:
    """Inductor's cache directory as it would pick it (``default_cache_dir()``): passed to
    the warm-up process."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    return default_cache_dir()


def inductor_temporary_cache_dir(path: str):
    """A context manager that points Inductor's cache at ``path``: cold-start benchmarks."""
    from torch._inductor.runtime.cache_dir_utils import temporary_cache_dir

    return temporary_cache_dir(path)


# -- misc --------------------------------------------------------------------------------------
def register_torch_log(name: str) -> None:
    """Name log ``name`` in ``torch._logging``'s registry (once), so ``TORCH_LOGS=help``
    lists it and ``TORCH_LOGS=name`` sets its level. Raises where the registry moved."""
    from torch._logging._internal import log_registry, register_log

    if not log_registry.is_log(name):
        register_log(name, [name])


def cpp_extension_build_directory(name: str) -> str:
    """Where ``torch.utils.cpp_extension`` builds extension ``name`` (its private
    ``_get_build_directory``): autopar's native runners are built and found there."""
    from torch.utils.cpp_extension import _get_build_directory

    return _get_build_directory(name, verbose=False)


def modify_graph_op_device(module, device) -> None:
    """Move the device arguments of a pipeline stage's graph ops to ``device``
    (``torch.distributed.pipelining._IR._modify_graph_op_device``)."""
    from torch.distributed.pipelining._IR import _modify_graph_op_device

    _modify_graph_op_device(module, device)
