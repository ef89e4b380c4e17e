"""Inductor's settings for every autopar compile and the inputs' stand-ins (what the
``inductor`` and ``split`` executors and the warm-up worker share, so that their cache keys
agree), and a per-graph compile of one aten graph with its stream annotations kept.

* autopar's AOTAutograd graphs are traced without Inductor's decompositions, which Inductor
  refuses ("both a fallback and a decomp for same op"). :func:`prepare` re-traces the graph
  with ``make_fx(decomposition_table=select_decomp_table())`` on fake tensors (nothing runs,
  no RNG is drawn, the caller's graph is not mutated), then runs the joint-graph passes, as
  ``torch.compile`` does before partitioning. ``fallback_random=True`` keeps dropout as
  eager's kernel, so a seed gives eager's masks and the generator moves as in eager.
* :func:`compile_inductor` and the stream annotations (:func:`annotations`,
  :func:`annotate`, ``codegen.inductor_streams``) are the ground of a multi-stream CUDA
  executor that is not on the ladder yet (it needs a GPU to be measured); nothing in the
  runtime calls them.

The FX graph cache needs a ``TracingContext`` whose fake mode has a ``ShapeEnv``; every
compile here runs under one (static shapes: autopar captures with ``dynamic=False``).

Example::

    >>> stand_ins(input_meta([torch.ones(2, 3)]))[0].shape
    torch.Size([2, 3])
"""

from __future__ import annotations

import time
from typing import Any, NamedTuple

import torch
import torch.fx as fx

from autopar.codegen.emit import Program


class TensorMeta(NamedTuple):
    shape: tuple
    stride: tuple
    dtype: torch.dtype
    device: str


#: Inductor settings for every autopar compile (applied with ``config.patch``: the process's
#: settings are untouched). fallback_random: dropout draws exactly what eager draws.
INDUCTOR_CONFIG = {"fallback_random": True}


def _fake_args(example_args: list):
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    mode = FakeTensorMode(shape_env=ShapeEnv(), static_shapes=True, allow_non_fake_inputs=True)
    fakes = [mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in example_args]
    return mode, fakes


def prepare(gm: fx.GraphModule, example_args: list):
    """Re-trace ``gm`` with Inductor's decompositions and joint-graph passes, on fakes of
    ``example_args`` (real tensors or ``torch.empty_strided`` stand-ins: only metadata is
    read). Returns ``(decomposed graph, fake mode, fake args)``. Run it on the thread that
    calls the compiled model (FX tracing sets process-global state).

    Node meta survives the re-trace: every node made while tracing node ``n`` (its
    decomposition) gets ``n``'s ``custom`` dict (the stream annotation of
    ``codegen.inductor_streams``) and a ``from_node`` naming ``n``; ``gm.meta``'s
    ``autopar.stream_index`` is copied and its ``autopar.stream_syncs`` re-pointed at the
    new nodes (:func:`carry_stream_meta`)."""
    from torch._guards import TracingContext, tracing
    from torch._inductor import config
    from torch._inductor.decomposition import select_decomp_table
    from torch._inductor.fx_passes.joint_graph import joint_graph_passes
    from torch._inductor.virtualized import V
    from torch.fx import traceback as fx_traceback
    from torch.fx.experimental.proxy_tensor import make_fx

    mode, fakes = _fake_args(example_args)

    def run(*args):
        # Through an Interpreter, not gm's own forward: Interpreter.run_node makes each
        # node's meta the "current meta" that the tracer copies onto the nodes it creates
        # (under preserve_node_meta), so an annotation survives decomposition.
        return fx.Interpreter(gm).run(*args)

    with config.patch(INDUCTOR_CONFIG), tracing(TracingContext(mode)), torch.no_grad(), \
            fx_traceback.preserve_node_meta():
        dec = make_fx(run, decomposition_table=select_decomp_table(), tracing_mode="fake")(*fakes)
        with V.set_fake_mode(mode):
            joint_graph_passes(dec)
    carry_stream_meta(gm, dec)
    return dec, mode, fakes


def origin(node: fx.Node) -> str | None:
    """The name of the node of the traced graph that ``node`` of a re-trace came from (its
    ``meta["from_node"]``, set under ``preserve_node_meta``), or None."""
    src = node.meta.get("from_node")
    return getattr(src[-1], "name", None) if src else None


def carry_stream_meta(gm: fx.GraphModule, dec: fx.GraphModule) -> None:
    """Copy ``gm.meta``'s stream entries (``codegen.inductor_streams.annotate_streams``) to
    its re-trace ``dec``, with each sync ``(producer, consumer)`` re-pointed from ``gm``'s
    node names to ``dec``'s: the last node made from the producer (the one holding its
    value) and the first made from the consumer (the first kernel that must wait). A sync
    whose nodes vanished (folded away by a pass) is dropped: nothing is left to order."""
    if "autopar.stream_index" not in gm.meta:
        return
    dec.meta["autopar.stream_index"] = dict(gm.meta["autopar.stream_index"])
    first: dict[str, str] = {}
    last: dict[str, str] = {}
    for n in dec.graph.nodes:
        o = origin(n)
        if o is not None and n.op == "call_function":
            first.setdefault(o, n.name)
            last[o] = n.name
    dec.meta["autopar.stream_syncs"] = [
        (last[p], first[c]) for p, c in gm.meta.get("autopar.stream_syncs", ())
        if p in last and c in first
    ]  # fmt: skip


def compile_inductor(
    gm: fx.GraphModule, example_args: list, *, tag: str, cpp_wrapper: bool = False
) -> Program:
    """Compile graph ``gm`` (tag ``g<k>.fw``/``.bw``) whole with Inductor; a :class:`Program`
    whose ``fn(*args)`` returns what ``gm(*args)`` returns and whose ``source`` is
    Inductor's output code. Synchronous; call it on the thread that runs the model.
    ``cpp_wrapper``: Inductor's C++ wrapper, which runs the whole graph without the GIL."""
    from torch._dynamo.convert_frame import compile_lock
    from torch._guards import TracingContext, tracing
    from torch._inductor import config
    from torch._inductor.compile_fx import compile_fx_inner

    t0 = time.perf_counter()
    dec, mode, fakes = prepare(gm, example_args)
    patches = dict(INDUCTOR_CONFIG, cpp_wrapper=cpp_wrapper)
    # compile_lock: Inductor compiles are not re-entrant across threads; this also orders
    # us with any Dynamo compile of the same process.
    with compile_lock, config.patch(patches), tracing(TracingContext(mode)):
        compiled = compile_fx_inner(
            dec, fakes, is_backward=tag.endswith(".bw"), cpp_wrapper=cpp_wrapper
        )

    # Inductor's code asserts the strides it was compiled for. A graph's inputs can change
    # layout when the graph *before* it changes executor (an Inductor forward may save
    # channels-last activations for the backward): such inputs are copied into the
    # compiled layout instead of failing (a per-call check of strides, a copy only then).
    layout = [
        (i, tuple(a.shape), tuple(a.stride())) for i, a in enumerate(example_args)
        if isinstance(a, torch.Tensor)
    ]  # fmt: skip

    def fn(*args: Any) -> Any:
        args = list(args)  # the compiled call clears the list it is given
        for i, shape, stride in layout:
            a = args[i]
            if a.stride() != stride and a.numel() > 1:
                args[i] = torch.empty_strided(shape, stride, dtype=a.dtype,
                                              device=a.device).copy_(a)  # fmt: skip
        return compiled(args)

    seconds = time.perf_counter() - t0
    name = "inductor" + (" cpp_wrapper" if cpp_wrapper else "")
    head = (
        f"# autopar: graph {tag} compiled whole by {name} in {seconds:.1f} s\n"
        "# (torch._inductor; below is Inductor's output code, which is what runs)\n"
    )
    source = head + (getattr(compiled, "source_code", None) or "# (output code not kept)\n")
    filename = f"<autopar {name} {tag}>"
    return Program(source, fn, None, tag, filename, notes=(f"{name}: {seconds:.1f} s",))


def annotations(gm: fx.GraphModule) -> dict:
    """``gm``'s stream annotations as plain data, for :func:`annotate`: per node (get_attr
    nodes aside) its name, target and ``custom`` dict, and the ``autopar.*`` entries of
    ``gm.meta``. A pickled GraphModule is rebuilt from its code, which drops node meta and
    renames the nodes: the warm-up job carries these beside it, so that the worker compiles
    the graph the training process compiles (and their cache keys agree)."""
    nodes = [(n.name, str(n.target), dict(n.meta["custom"]) if isinstance(
        n.meta.get("custom"), dict) else None) for n in _ordered(gm)]  # fmt: skip
    return {"nodes": nodes, "graph": {k: v for k, v in gm.meta.items() if k.startswith("autopar.")}}


def _ordered(gm: fx.GraphModule) -> list[fx.Node]:
    # get_attr nodes move when a graph is rebuilt from its code (emitted at first use)
    return [n for n in gm.graph.nodes if n.op != "get_attr"]


def annotate(gm: fx.GraphModule, saved: dict | None) -> fx.GraphModule:
    """Put :func:`annotations` back on ``gm`` (in place; returned), matching nodes by
    position and target, with the node names of ``autopar.stream_syncs`` translated. A
    graph that does not match is left unannotated (it still compiles, on one stream)."""
    if not saved:
        return gm
    nodes, old = _ordered(gm), saved.get("nodes", [])
    if [str(n.target) for n in nodes] != [t for _, t, _ in old]:
        return gm
    rename = {}
    for n, (name, _, custom) in zip(nodes, old, strict=True):
        rename[name] = n.name
        if custom is not None:
            n.meta["custom"] = dict(custom)
    gm.meta.update(saved.get("graph", {}))
    if "autopar.stream_syncs" in gm.meta:
        gm.meta["autopar.stream_syncs"] = [
            (rename.get(p, p), rename.get(c, c)) for p, c in gm.meta["autopar.stream_syncs"]
        ]
    return gm


def input_meta(args: list) -> list:
    """What a compile needs of the inputs: each tensor's shape, strides, dtype and device
    (as a ``TensorMeta``), other values as they are."""
    return [
        TensorMeta(tuple(a.shape), tuple(a.stride()), a.dtype, str(a.device))
        if isinstance(a, torch.Tensor) else a
        for a in args
    ]  # fmt: skip


def stand_ins(meta: list) -> list:
    """``torch.empty_strided`` tensors with the recorded metadata (values unused). Both
    processes compile from stand-ins, so their cache keys agree."""
    return [
        torch.empty_strided(m.shape, m.stride, dtype=m.dtype, device=m.device)
        if isinstance(m, TensorMeta) else m
        for m in meta
    ]  # fmt: skip
