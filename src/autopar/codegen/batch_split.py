"""The batch-split executor's compile side: which Dynamo graphs may run as two half batches
at once, and their compile.

Why: on the 2-core box a 1-thread kernel is more efficient than a 2-thread one on small
convolutions, and Inductor's C++ wrapper releases the GIL for a whole compiled graph. Two
half batches of the Inception model, each compiled with ``cpp_wrapper`` at one OpenMP
thread and run on two threads at once, took 13.7-14.7 ms per forward and backward against
18.1-19.6 ms for ``torch.compile`` on the whole batch at two threads (1.32-1.34x,
``benchmarks/batch_split.py``, 2026-11-30). On the multi-tower MLP it lost (0.85x): two
separate processes on half batches, no gradient summed, train it only 1.11-1.15x faster
than one 2-thread process (``benchmarks/concurrency_ceiling.py``, 2026-12-02), less than
the split's gradient sum and handoffs cost. Whole training steps decide
(``autopar.runtime.executors.split``).

A graph qualifies when every row of its outputs depends only on the same row of its batched
inputs (its non-module tensor inputs, split along dim 0): then running the halves and
concatenating their outputs is the graph, and the parameters' gradient is the sum of the
halves' (a float reordering; the fp64 oracle judges it). :func:`split_reason` proves it op
by op on the graph traced to aten ops (``make_fx`` on fake tensors: nothing runs), with
the rules of ``_ROW_WISE`` and friends below; any other op, a random draw (dropout: the
halves would draw other masks than eager) or an in-place write (BatchNorm statistics) rules
the graph out, with the reason.

Example::

    >>> split_reason(dynamo_gm, args)       # doctest: +SKIP
    'aten.native_batch_norm mixes the rows of the batch'
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx

from autopar import compat
from autopar.codegen.inductor import TensorMeta
from autopar.codegen.joint import JointProgram, compile_joint, start_joint_warmup

#: Inductor settings of a half-batch compile: the C++ wrapper (the graph runs without the
#: GIL) and one OpenMP thread in every kernel (two halves share the two cores).
SPLIT_OPTIONS = {"cpp_wrapper": True, "cpp.threads": 1}
#: The partition of a half-batch compile (see :func:`compile_split`).
SPLIT_PARTITION = "default"
#: Fewer rows than this per half and the per-call costs (a thread hand-off, the join) win.
MIN_ROWS = 2

aten = torch.ops.aten
# Ops whose output row b depends on row b of one operand only (its position here; ``None``:
# every tensor operand is batched, as ``bmm``'s two) when the batch is dim 0 of that operand
# and of the output, and no other operand is batched (those are parameters).
_ROW_WISE = {
    aten.convolution.default: 0, aten.addmm.default: 1, aten.mm.default: 0,
    aten.bmm.default: None, aten.max_pool2d_with_indices.default: 0,
    aten.avg_pool2d.default: 0, aten._adaptive_avg_pool2d.default: 0, aten.view.default: 0,
    aten._unsafe_view.default: 0, aten.reshape.default: 0, aten.expand.default: 0,
    aten.clone.default: 0, aten.alias.default: 0, aten._to_copy.default: 0,
    aten.embedding.default: 1, aten.native_layer_norm.default: 0, aten.detach.default: 0,
    aten.flatten.using_ints: 0, aten.empty_like.default: 0, aten.zeros_like.default: 0,
    aten.ones_like.default: 0, aten.full_like.default: 0, aten.new_zeros.default: 0,
    aten.new_ones.default: 0, aten.new_empty.default: 0, aten.new_full.default: 0,
}  # fmt: skip
# Ops that work along the dimensions named by their arguments at these positions (a dim or
# a list of dims; a missing argument counts as dim 0): row-wise unless one of them is dim 0.
_ALONG_DIM = {
    aten.mean.dim: (1,), aten.sum.dim_IntList: (1,), aten.amax.default: (1,),
    aten.amin.default: (1,), aten.max.dim: (1,), aten.min.dim: (1,),
    aten._softmax.default: (1,), aten._log_softmax.default: (1,), aten.softmax.int: (1,),
    aten.log_softmax.int: (1,), aten.unbind.int: (1,), aten.select.int: (1,),
    aten.slice.Tensor: (1,), aten.squeeze.dim: (1,), aten.unsqueeze.default: (1,),
    aten.transpose.int: (1, 2), aten.split.Tensor: (2,), aten.split_with_sizes.default: (2,),
    aten.unsafe_split.Tensor: (2,), aten.unsafe_split_with_sizes.default: (2,),
    aten.chunk.default: (2,),
}  # fmt: skip


def batched_inputs(gm: fx.GraphModule, args: list) -> tuple[list[int], int] | str:
    """The positions of ``gm``'s batched inputs (tensors that are not module state: their
    Dynamo source is not an attribute of ``self``) and the batch size, or why there is none."""
    places = gm.graph.find_nodes(op="placeholder")
    picked, rows = [], set()
    for i, (node, a) in enumerate(zip(places, args, strict=True)):
        source = getattr(node, "_dynamo_source", None)
        if source is None:
            return "the graph's inputs carry no Dynamo sources"
        name = source.name  # L['x']: an argument; L['self']...: a parameter or buffer
        state = name.startswith("L['self']") or any(
            k in name for k in ("._parameters[", "._buffers[", "._modules["))  # any `self` name
        if not isinstance(a, torch.Tensor | TensorMeta) or not name.startswith("L[") or state:
            continue
        if len(a.shape) == 0:
            return f"input {node.name} is a scalar tensor"
        picked.append(i)
        rows.add(a.shape[0])
    if not picked:
        return "no tensor input from outside the module"
    if len(rows) != 1:
        return f"the inputs' first dimensions differ ({sorted(rows)})"
    batch = rows.pop()
    if batch < 2 * MIN_ROWS or batch % 2:
        return f"batch of {batch} (needs an even batch of at least {2 * MIN_ROWS})"
    return picked, batch


def split_reason(gm: fx.GraphModule, args: list) -> str | None:
    """None when Dynamo graph ``gm`` may run as two half batches (module docstring), else
    why not. ``args``: the graph's real inputs (only their metadata is read)."""
    found = batched_inputs(gm, args)
    if isinstance(found, str):
        return found
    picked, batch = found
    if any(isinstance(a, torch.Tensor) and a.device.type != "cpu" for a in args):
        return "not a CPU graph"
    try:
        aten_gm = _trace(gm, args)
    except Exception as exc:  # noqa: BLE001 - a graph we cannot trace is not split
        return f"could not trace it to aten ops ({type(exc).__name__})"
    why = _rows_stay_apart(aten_gm, set(picked), batch)
    if why is not None:
        return why
    try:
        half_gm = _trace(gm, [a[: batch // 2] if i in picked else a for i, a in enumerate(args)])
    except Exception as exc:  # noqa: BLE001
        return f"fails at half batch ({type(exc).__name__}: a batch size baked into the graph?)"
    return _halves_follow(aten_gm, half_gm)


def _halves_follow(full: fx.GraphModule, half: fx.GraphModule) -> str | None:
    """None when the graph traced at half batch is the full one with every batch dimension
    halved: the same ops, each batched value half as many rows and every other value the
    same. Dynamo bakes ``x.size(0)`` into the graph as a number, so ``h.reshape(x.size(0),
    -1, 8)`` is ``reshape(8, -1, 8)`` at any batch: run on half the rows it would move
    values between rows. The split is proved on the program it runs, the half-batch one."""
    a = [n for n in full.graph.nodes if n.op in ("call_function", "output")]
    b = [n for n in half.graph.nodes if n.op in ("call_function", "output")]
    if [n.target for n in a] != [n.target for n in b]:
        return "traces to other ops at half batch (a size depends on the batch)"
    for x, y in zip(a, b, strict=True):
        vx, vy = x.meta.get("val"), y.meta.get("val")
        shapes = [(tuple(p.shape), tuple(q.shape)) for p, q in zip(
            compat.tree_leaves(vx), compat.tree_leaves(vy),
            strict=False) if isinstance(p, torch.Tensor) and isinstance(q, torch.Tensor)]
        for s_full, s_half in shapes:
            if s_half != s_full and (not s_full or s_half != (s_full[0] // 2, *s_full[1:])):
                return (f"{x.target} gives {list(s_half)} at half batch where {list(s_full)} "
                        "is halved (a batch size baked into the graph: x.size(0)?)")  # fmt: skip
    return None


def _trace(gm: fx.GraphModule, args: list) -> fx.GraphModule:
    from torch.fx.experimental.proxy_tensor import make_fx

    with torch.no_grad():  # the forward's ops only (nothing runs: fake tensors)
        return make_fx(gm, tracing_mode="fake")(*args)


def _rows_stay_apart(g: fx.GraphModule, picked: set[int], batch: int) -> str | None:
    """Propagate "batched at dim 0" through the aten graph; None if every output is."""
    for node in [n for n in g.graph.nodes if n.op == "call_function"]:
        tags, schema = getattr(node.target, "tags", ()), getattr(node.target, "_schema", None)
        if torch.Tag.nondeterministic_seeded in tags:
            return f"{node.target} draws random numbers (the halves would draw other values)"
        if schema is not None and schema.is_mutable:
            # A pointwise write into the graph's own intermediate (``c.add_(x)`` in a cell)
            # is row-wise like its out-of-place form; a write into an input (BatchNorm's
            # running statistics) or any other in-place op is not.
            own = bool(node.args) and isinstance(node.args[0], fx.Node)
            into_input = own and _root(node.args[0]).op == "placeholder"
            if not own or into_input or torch.Tag.pointwise not in tags:
                return f"{node.target} writes a tensor in place (BatchNorm statistics?)"
    batched: set[fx.Node] = set()
    places = g.graph.find_nodes(op="placeholder")
    batched.update(n for i, n in enumerate(places) if i in picked)
    for node in g.graph.nodes:
        if node.op != "call_function":
            continue
        ins = [a for a in node.all_input_nodes if a in batched]
        if not ins:
            continue  # depends on parameters only
        why = _row_wise(node, ins, batch)
        if why is None and torch.Tag.inplace in getattr(node.target, "tags", ()):
            if node.args[0] not in batched:
                why = "writes batched values into a tensor shared by both halves"
        if why is not None:
            return f"{node.target} {why}"
        batched.add(node)
    outs = [a for a in compat.tree_leaves(g.graph.output_node().args)
            if isinstance(a, fx.Node)]  # fmt: skip
    for out in outs:
        if out not in batched or out.op == "placeholder":
            return f"output {out.name} is not computed row by row from the batch"
    return None


def _root(node: fx.Node) -> fx.Node:
    """The tensor ``node`` is a view of (itself when it is none)."""
    while node.op == "call_function" and getattr(node.target, "is_view", False) and node.args:
        node = node.args[0]
    return node


def _row_wise(node: fx.Node, ins: list[fx.Node], batch: int) -> str | None:
    """None if ``node``'s output keeps the batch at dim 0, row by row."""
    target, tags = node.target, getattr(node.target, "tags", ())
    out = node.meta.get("val")
    first = node.args[0] if node.args else None
    vals = out if isinstance(out, list | tuple) else [out]
    if any(not isinstance(v, torch.Tensor) or v.dim() == 0 or v.shape[0] != batch
           for v in vals):  # fmt: skip
        return "does not keep the batch as its first dimension"
    if target is operator.getitem:
        return None  # an element of a row-wise op's tuple (split, max_pool's indices)
    if target is aten.native_layer_norm.default and len(node.args[1]) >= first.meta["val"].dim():
        return "normalizes over the batch dimension too"
    if torch.Tag.pointwise in tags:
        return _broadcasts_row_wise(node, ins, batch)
    if target in _ROW_WISE:
        at = _ROW_WISE[target]
        tensors = [a for a in node.args if isinstance(a, fx.Node)]
        rows = tensors if at is None else [node.args[at]]
        if all(a in ins for a in rows) and not any(a in ins for a in tensors if a not in rows):
            return None
        return "takes the batch in another operand than its rows"
    if target in _ALONG_DIM and first in ins:
        rank = max(first.meta["val"].dim(), 1)
        dims = []
        for pos in _ALONG_DIM[target]:
            d = node.args[pos] if len(node.args) > pos else 0
            dims += list(d) if isinstance(d, list | tuple) else [d]
        if not dims or any(d is None or d % rank == 0 for d in dims):  # [] or None: all
            return "works along the batch dimension"
        return None
    if target in (aten.cat.default, aten.stack.default):
        dim, parts = (node.args[1] if len(node.args) > 1 else 0), node.args[0]
        rank = parts[0].meta["val"].dim() + (target is aten.stack.default)
        if dim % rank == 0 or any(p not in ins for p in parts):
            return "joins along the batch or with a non-batched tensor"
        return None
    if target is aten.permute.default:
        return None if node.args[1][0] == 0 else "moves the batch dimension"
    if target is aten.t.default:
        return "moves the batch dimension"
    return "is not known to keep the rows of the batch apart"


def _broadcasts_row_wise(node: fx.Node, ins: list[fx.Node], batch: int) -> str | None:
    """A pointwise op is row-wise when every batched operand has the batch at dim 0 of the
    output, and no other operand has a row per sample (a size-``batch`` leading dim)."""
    rank = node.meta["val"].dim()
    for a in node.all_input_nodes:
        val = a.meta.get("val")
        if not isinstance(val, torch.Tensor):
            continue
        aligned = val.dim() == rank and val.shape[0] == batch
        if (a in ins) != aligned:
            return "broadcasts the batch against another dimension"
    return None


def start_split_warmup(gm: fx.GraphModule, half_args: list, tag: str):
    """:func:`compile_split` queued for the warm-up process (``codegen.warmup``, a joint
    compile job with the same settings), so that the compile here later hits Inductor's
    cache. Returns the job's handle."""
    return start_joint_warmup(gm, half_args, tag, SPLIT_OPTIONS, partition=SPLIT_PARTITION)


def compile_split(gm: fx.GraphModule, half_args: list, *, tag: str) -> JointProgram:
    """``gm`` compiled whole (forward and backward) for one half batch ``half_args`` with
    :data:`SPLIT_OPTIONS`: the program each of the two threads runs. AOTAutograd's default
    partition (the backward reuses the forward's activations; ``torch.compile``'s min-cut
    partition recomputes cheap ones): inception's split forward and backward took 11.8 ms
    with it and 13.6 ms with min-cut, against 16.5-17.2 ms for ``torch.compile`` (2026-11-30)."""
    return compile_joint(gm, half_args, tag=tag, options=SPLIT_OPTIONS, partition=SPLIT_PARTITION)


def halve(meta: list, picked: list[int]) -> list:
    """``input_meta`` of a half batch: dim 0 of the batched inputs halved (strides kept)."""
    out = list(meta)
    for i in picked:
        m = meta[i]
        out[i] = m._replace(shape=(m.shape[0] // 2, *m.shape[1:]))
    return out
