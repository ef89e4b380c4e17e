"""The joint executor: a whole Dynamo graph, forward and backward together, compiled by
Inductor's own pipeline (``compile_fx``), exactly as ``torch.compile`` compiles it.

:mod:`autopar.codegen.inductor` compiles the forward and backward graphs that autopar
captured: AOTAutograd partitioned them *before* Inductor's
decompositions, with its default partitioner. ``torch.compile`` instead decomposes the joint
graph first and partitions it with the min-cut partitioner, which recomputes cheap ops in
the backward instead of saving them. On HF BERT (tiny, 2 cores, 2026-11-30) that backward
ran 3% faster (6.44 vs 6.64 ms a step). Neither pipeline wins everywhere (autopar's
partition was 4-7% ahead on the Inception and towers models). This one is the
``inductor`` executor (``autopar.runtime.executors.inductor``): it is what ``torch.compile``
runs, forward and backward together, raced by whole training steps (``runtime.judge``).

The compile patches three settings, and only for its own duration:

* Inductor's ``fallback_random``: dropout draws exactly what eager draws (as in
  :data:`autopar.codegen.inductor.INDUCTOR_CONFIG`);
* AOTAutograd's ``force_non_lazy_backward_lowering``: the backward compiles with the
  forward (AOTAutograd compiles a static-shape backward lazily, at the first backward,
  which would put a compile inside a training step and out of the warm-up process's
  reach); and ``enable_autograd_cache`` off, so that Inductor's output code (what
  ``autopar.explain`` shows) is produced even when the compile is a cache hit.

The cold compile runs in a background process
(:func:`start_joint_warmup`: a job for the warm-up worker, ``codegen.warmup``) that fills
Inductor's FX graph cache; the training process then compiles at a step boundary and hits
it.

Example::

    >>> prog = compile_joint(dynamo_gm, args, tag="g0")   # doctest: +SKIP
    >>> out = prog.fn(*args)        # differentiable: its backward is the compiled one
    >>> print(prog.sources["backward"][:200])              # doctest: +SKIP
"""

from __future__ import annotations

import importlib
import operator
import os
import pickle
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch
import torch.fx as fx

from autopar import compat
from autopar.codegen.emit import Program
from autopar.codegen.inductor import INDUCTOR_CONFIG, input_meta, stand_ins
from autopar.codegen.warmup import WarmupJob, load_warmup_job, spawn_warmup

#: AOTAutograd settings for a joint compile (``compat.functorch_config().patch``), see above.
AOT_CONFIG = {"force_non_lazy_backward_lowering": True, "enable_autograd_cache": False}


@dataclass(frozen=True)
class JointProgram:
    """A Dynamo graph compiled whole: ``fn(*args)`` returns what the graph returns, and
    its autograd backward runs the compiled backward. ``sources``: Inductor's output code
    per phase (``"forward"``, ``"backward"``)."""

    tag: str  # "g<k>", the Dynamo graph
    fn: Callable[..., Any] = field(repr=False)
    sources: dict[str, str] = field(repr=False)
    seconds: float = 0.0
    partition: str = "min-cut"
    #: Which runtime runs the halves: ``"direct"`` (autopar's ``autograd.Function``,
    #: ``capture.direct_autograd``) or ``"AOTAutograd (<why>)"`` (its runtime wrapper).
    autograd: str = "AOTAutograd"
    #: Why the compiled forward's outputs are not one tensor each (the same value twice: a
    #: user output also saved for the backward), or None. A caller that owns the outputs'
    #: memory itself (the native split: it freed such a value twice) needs None.
    shared_outputs: str | None = None
    #: Per phase, (inputs, outputs) of the graph Inductor compiled: the compile's own
    #: metadata, which the native split's C++ calls are sized by.
    arity: dict[str, tuple[int, int]] = field(default_factory=dict, repr=False)

    def program(self, phase: str) -> Program:
        """The ``Program`` that shows this compile's ``phase`` half in ``autopar.explain``
        (its ``fn`` is the joint callable: the halves run together)."""
        tag = f"{self.tag}.{'fw' if phase == 'forward' else 'bw'}"
        head = (
            f"# autopar: Dynamo graph {self.tag} compiled whole by Inductor's compile_fx in "
            f"{self.seconds:.1f} s\n# (forward and backward together, {self.partition} "
            f"partition of the decomposed joint graph), run through autograd "
            f"{self.autograd}; the {phase}:\n"
        )
        body = self.sources.get(phase) or "# (output code not kept)\n"
        return Program(head + body, self.fn, None, tag, f"<autopar joint {tag}>",
                       notes=(f"joint: {self.seconds:.1f} s", f"autograd: {self.autograd}"),
                       )  # fmt: skip


def compile_joint(
    gm: fx.GraphModule,
    example_args: list,
    *,
    tag: str,
    options: dict | None = None,
    partition: str = "min-cut",
) -> JointProgram:
    """Compile Dynamo graph ``gm`` (tag ``g<k>``) with ``compile_fx`` for inputs shaped like
    ``example_args`` (real tensors or :func:`~autopar.codegen.inductor.stand_ins`: only
    metadata is read). Synchronous; call it on the thread that runs the model. The user's
    random generators are left as they were. ``options``: more Inductor settings, patched
    over :data:`~autopar.codegen.inductor.INDUCTOR_CONFIG` for this compile only.
    ``partition``: ``"min-cut"`` (``torch.compile``'s) or ``"default"`` (AOTAutograd's
    default partition after the same joint-graph passes: ``codegen.partition``)."""
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    compile_lock = compat.dynamo_compile_lock()
    aot_config, config = compat.functorch_config(), compat.inductor_config()

    sources: dict[str, str] = {}
    halves: dict[str, Any] = {}  # the compiled callables AOTAutograd calls, per phase
    # AOTAutograd compiles with autocast off, so its state is read here, before.
    traced_autocast = compat.is_any_autocast_enabled()

    shared: list[str] = []
    arity: dict[str, tuple[int, int]] = {}

    def inner(graph, inputs, **kwargs):
        if not kwargs.get("is_backward"):
            shared.extend(_shared_outputs(graph))
        arity["backward" if kwargs.get("is_backward") else "forward"] = (
            len(inputs), len(graph.graph.output_node().args[0]))
        compiled = compat.compile_fx_inner(graph, inputs, **kwargs)
        phase = "backward" if kwargs.get("is_backward") else "forward"
        sources[phase] = getattr(compiled, "source_code", None) or ""
        halves[phase] = compiled
        return compiled

    t0 = time.perf_counter()
    cuda = sorted({a.device.index or 0 for a in example_args
                   if isinstance(a, torch.Tensor) and a.is_cuda})  # fmt: skip
    # The FX graph cache serves only compiles under a TracingContext whose fake mode has a
    # ShapeEnv (static shapes: autopar captures with dynamic=False), as Dynamo's do.
    # The inputs go in as static fakes: from real tensors AOTAutograd would make every size
    # of a non-parameter input symbolic (Dynamo tells it otherwise; here no Dynamo runs),
    # and Inductor would compile shape-generic kernels (measured 5% slower on BERT).
    mode = compat.fake_tensor_mode(shape_env=ShapeEnv(), static_shapes=True,
                                   allow_non_fake_inputs=True)  # fmt: skip
    fakes = [mode.from_tensor(a, static_shapes=True) if isinstance(a, torch.Tensor) else a
             for a in example_args]  # fmt: skip
    # compile_lock: Inductor compiles are not re-entrant across threads (as in inductor.py).
    settings = {**INDUCTOR_CONFIG, **(options or {})}
    if partition == "default":
        from autopar.codegen.partition import DefaultPartition

        settings["custom_partitioner_fn"] = DefaultPartition()
    context = compat.tracing_context(mode)
    with compile_lock, torch.random.fork_rng(devices=cuda), config.patch(settings), \
            aot_config.patch(AOT_CONFIG), compat.tracing(context):  # fmt: skip
        fn = compat.compile_fx(gm, fakes, inner_compile=inner)
    fn, autograd = _direct(fn, gm, halves, context.fw_metadata, traced_autocast)
    return JointProgram(tag, fn, sources, time.perf_counter() - t0, partition, autograd,
                        "; ".join(shared) or None, arity)


def _shared_outputs(gm: fx.GraphModule) -> list[str]:
    """What makes forward graph ``gm``'s outputs share memory: a value returned twice (a
    user output that is also saved for the backward)."""
    outs = [o for o in gm.graph.output_node().args[0] if isinstance(o, fx.Node)]
    seen: set = set()
    why = []
    for o in outs:
        if o in seen and o.op != "placeholder":
            why.append(f"{o.name} is returned twice")
        seen.add(o)
    return why


def _direct(fn, gm: fx.GraphModule, halves: dict, meta: Any, autocast: bool):
    """``(runner, autograd)``: the compiled halves through autopar's own
    ``autograd.Function`` (``capture.direct_autograd.DirectGraph``, with ``fn``,
    AOTAutograd's runner, for the calls it leaves to it) where AOTAutograd's runtime wrapper
    has nothing to do, else ``fn`` itself. On the 4-tower MLP that wrapper cost 2.6-4.6% of
    a training step (direct_autograd's docstring), about joint's gap to ``torch.compile``."""
    from autopar.capture.direct_autograd import direct_runner

    if set(halves) != {"forward", "backward"}:
        return fn, "AOTAutograd (no compiled backward)"
    donated = bool(getattr(meta, "bw_donated_idxs", None))  # Inductor writes into saved tensors
    runner, label = direct_runner(gm, meta, halves["forward"], halves["backward"], fn, autocast,
                                  donated)  # fmt: skip
    return runner or fn, label


def start_joint_warmup(gm: fx.GraphModule, example_args: list, tag: str,
                       options: dict | None = None, partition: str = "min-cut",
                       ) -> WarmupJob:  # fmt: skip
    """Queue the compile of ``gm`` for ``example_args``' shapes in the warm-up process
    (``codegen.warmup``: low priority, the same settings, ``options`` and ``partition``), so
    that :func:`compile_joint` here later hits Inductor's cache. Returns the job's handle."""
    job = {"gm": portable(gm), "dynamo": dynamo_meta(gm), "meta": input_meta(example_args),
           "roles": roles(example_args), "tag": tag, "options": options,
           "partition": partition}  # fmt: skip
    fd, path = tempfile.mkstemp(prefix="autopar-joint-", suffix=".pt")
    os.close(fd)
    try:
        torch.save(job, path, pickle_protocol=PROTOCOL)
    except BaseException:
        os.unlink(path)  # no partial job left in $TMPDIR
        raise
    return spawn_warmup("autopar.codegen.joint", path)


def portable(gm: fx.GraphModule) -> dict:
    """``gm`` as a warm-up job carries it: its nodes as plain tuples (op, name, target,
    arguments with :class:`_NodeRef` for nodes; no node meta, which holds fake and example
    tensors) and the values its ``get_attr`` and ``call_module`` nodes read; :func:`rebuild`
    makes the same GraphModule of them. A pickled GraphModule would not do: unpickling
    re-traces its code, which turns what the graph computes from no input
    (``torch.arange``, HF's empty cache tensors) into constants, another graph with another
    cache key (GPT-2 tiny's warm-up never served its training process: 8.9 s compiling
    cold at a step instead of 3.6 s from the cache)."""
    nodes = []
    for n in gm.graph.nodes:
        target = _by_name(n.target) if n.op == "call_function" else n.target
        args, kwargs = fx.node.map_aggregate(
            (n.args, n.kwargs), lambda x: _NodeRef(x.name) if isinstance(x, fx.Node) else x)
        nodes.append((n.op, n.name, target, tuple(args), dict(kwargs), _picklable(n.type)))
    attrs = {n.target: operator.attrgetter(n.target)(gm) for n in gm.graph.nodes
             if n.op in ("get_attr", "call_module")}  # fmt: skip
    buffers = {name for name, _ in gm.named_buffers()}
    plain = [k for k, v in attrs.items() if isinstance(v, torch.Tensor)
             and not isinstance(v, torch.nn.Parameter) and k not in buffers]  # fmt: skip
    attrs = {k: _Sub(portable(v)) if isinstance(v, fx.GraphModule) else v  # bodies of
             for k, v in attrs.items()}  # higher-order ops (checkpoint, autograd.Function)
    return {"nodes": nodes, "attrs": attrs, "plain": plain}


def rebuild(job: dict) -> fx.GraphModule:
    """The GraphModule that :func:`portable` described (the same code, node names
    included)."""
    graph, env = fx.Graph(), {}
    for op, name, target, args, kwargs, type_expr in job["nodes"]:
        if isinstance(target, _Name):
            target = target.resolve()
        args, kwargs = fx.node.map_aggregate(
            (args, kwargs), lambda x: env[x.name] if isinstance(x, _NodeRef) else x)
        env[name] = graph.create_node(op, target, tuple(args), dict(kwargs), name=name,
                                      type_expr=type_expr)  # fmt: skip
    attrs = {k: rebuild(v.job) if isinstance(v, _Sub) else v for k, v in job["attrs"].items()}
    gm = fx.GraphModule(attrs, graph)
    for name in job["plain"]:  # GraphModule makes every tensor a buffer; these were not
        owner, _, leaf = name.rpartition(".")  # (AOTAutograd asserts each buffer has a source)
        module = gm.get_submodule(owner)
        value = getattr(module, leaf)
        delattr(module, leaf)
        setattr(module, leaf, value)
    return gm


#: The pickle protocol of a warm-up job (``torch.save``'s default, 2, cannot pickle a
#: ``torch.memory_format``); the checks below use the same.
PROTOCOL = 4


@dataclass(frozen=True)
class _Sub:
    """A subgraph (a ``get_attr`` value that is a GraphModule), as :func:`portable` made it."""

    job: dict


@dataclass(frozen=True)
class _NodeRef:
    """A node named in another node's arguments (:func:`portable`)."""

    name: str


class _Name(NamedTuple):
    """A function that pickle cannot name by its ``__qualname__`` (``F.max_pool2d`` is a
    local function of ``boolean_dispatch``; autopar's ``torch.ops`` operators), named by
    its dotted path."""

    path: str

    def resolve(self) -> Any:
        parts = self.path.split(".")
        for i in range(len(parts) - 1, 0, -1):  # the longest importable module, then attributes
            try:
                value = importlib.import_module(".".join(parts[:i]))
            except ImportError:
                continue
            for part in parts[i:]:
                value = getattr(value, part)
            return value
        raise ImportError(f"cannot import {self.path}")


def _by_name(fn: Any) -> Any:
    """``fn`` itself where pickle gives it back (by name, not a copy: a higher-order op
    pickles as a new instance), else a :class:`_Name` that resolves to it."""
    try:
        if pickle.loads(pickle.dumps(fn, protocol=PROTOCOL)) is fn:
            return fn
    except Exception:  # noqa: BLE001 - pickle raises several types for this
        pass
    paths = [f"{getattr(fn, '__module__', '')}.{getattr(fn, '__name__', '')}"]
    if isinstance(fn, (compat.OpOverload, compat.OpOverloadPacket)):  # "ns.op[.overload]"
        paths.append(f"torch.ops.{fn}")
    for path in paths:
        try:
            if _Name(path).resolve() is fn:
                return _Name(path)
        except (ImportError, AttributeError, ValueError):
            pass
    raise TypeError(f"the warm-up worker cannot be sent {fn!r}")


def _picklable(value: Any) -> Any:
    """``value`` if pickle takes it, else None (a node's type annotation: only shown)."""
    try:
        pickle.dumps(value, protocol=PROTOCOL)
        return value
    except Exception:  # noqa: BLE001 - pickle raises several types for this
        return None


def dynamo_meta(gm: fx.GraphModule) -> dict:
    """What AOTAutograd reads from a Dynamo graph beyond its code, and pickling drops: the
    graph's compile id, its parameters' sources, and each placeholder's source and
    ``tensor_dict``. From them AOTAutograd learns which inputs are parameters (static:
    alive all step), and the min-cut partition saves those rather than copies of them; a
    warm-up without them partitions differently and fills the cache with other graphs."""
    places = gm.graph.find_nodes(op="placeholder")
    return {
        "compile_id": gm.meta.get("dynamo_compile_id"),
        "param_sources": getattr(gm, "_param_name_to_source", None),
        "placeholders": {n.name: (getattr(n, "_dynamo_source", None), n.meta.get("tensor_dict"))
                         for n in places},
    }  # fmt: skip


def restore_dynamo_meta(gm: fx.GraphModule, meta: dict) -> fx.GraphModule:
    """Put :func:`dynamo_meta`'s record back on a rebuilt graph (placeholders by name)."""
    if meta.get("compile_id") is None:
        return gm  # not a Dynamo graph: nothing was there
    gm.meta["dynamo_compile_id"] = meta["compile_id"]
    if meta.get("param_sources") is not None:
        gm._param_name_to_source = meta["param_sources"]
    places = meta.get("placeholders", {})
    for n in gm.graph.find_nodes(op="placeholder"):
        source, tensor_dict = places.get(n.name, (None, None))
        n._dynamo_source = source
        if tensor_dict is not None:
            n.meta["tensor_dict"] = tensor_dict
    return gm


def roles(args: list) -> list[str | None]:
    """What AOTAutograd sees of each input besides its metadata: ``"param"`` (an
    ``nn.Parameter``), ``"grad"`` (a tensor that requires grad), ``None``. The warm-up's
    stand-ins get the same roles, so both processes trace the same joint graph (without
    them the warm-up would compile an inference graph, and its cache would not serve)."""
    return [
        ("param" if isinstance(a, torch.nn.Parameter) else "grad" if a.requires_grad else None)
        if isinstance(a, torch.Tensor) else None
        for a in args
    ]  # fmt: skip


def with_roles(args: list, kinds: list[str | None]) -> list:
    """``args`` (stand-ins) given the roles :func:`roles` recorded."""
    out = []
    for a, kind in zip(args, kinds, strict=True):
        if kind == "param":
            a = torch.nn.Parameter(a)
        elif kind == "grad":
            a = a.requires_grad_()
        out.append(a)
    return out


def _warmup_main(path: str) -> int:
    job = load_warmup_job(path)
    gm = restore_dynamo_meta(rebuild(job["gm"]), job["dynamo"])
    args = with_roles(stand_ins(job["meta"]), job["roles"])
    compile_joint(gm, args, tag=job["tag"], options=job.get("options"),
                  partition=job.get("partition", "min-cut"))  # fmt: skip
    return 0

