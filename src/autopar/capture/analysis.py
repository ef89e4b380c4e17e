"""Static analysis of a captured aten graph: which nodes write which buffers, which share
storage, which draw random numbers.

Everything here reads the graph and the aten schemas only (``alias_info``: ``Tensor(a!)``
is written in place, a ``Tensor(a)`` return aliases its ``Tensor(a)`` argument), never
tensor values, so the answers hold for every run of the graph. That is what scheduling needs
to stay correct: codegen keeps readers and writers of a buffer in eager order and random ops
in graph order, and the pipeline does not re-run a graph with effects to time it. It lives
in capture, the lowest stage, so the profiler, the planner and codegen share one version.

The profiler answers a different question at run time (``profiling.profiler``: how many
bytes an operator actually wrote this call, from storage pointers and version counters, for
the cost model), and also covers nodes without an aten schema; it does not replace this.

Example::

    >>> import torch
    >>> from torch.fx.experimental.proxy_tensor import make_fx
    >>> gm = make_fx(lambda x: x.add_(1).relu())(torch.ones(2))
    >>> base, writes = buffer_analysis(list(gm.graph.nodes))
    >>> [(n.name, sorted(b.name for b in bufs)) for n, bufs in writes.items()]
    [('add_', ['x_1'])]
    >>> has_side_effects(gm)
    True
"""

from __future__ import annotations

import operator
from collections.abc import Iterator
from typing import Any

import torch
import torch.fx as fx

from autopar import compat

#: Base names of aten ops that draw from the global random generator, for ops whose schema
#: lacks the ``nondeterministic_seeded`` tag and a ``Generator`` argument.
RNG_NAMES = {
    "dropout", "native_dropout", "bernoulli", "bernoulli_", "rand", "rand_like", "randn",
    "randn_like", "randint", "randint_like", "randperm", "normal", "normal_", "uniform",
    "uniform_", "exponential", "exponential_", "geometric_", "log_normal_", "cauchy_",
    "multinomial", "poisson", "rrelu_with_noise", "_fused_dropout", "feature_dropout",
}  # fmt: skip


def is_op(node: fx.Node) -> bool:
    """Whether ``node`` calls an aten-style ``OpOverload`` (it has a schema to read)."""
    return node.op == "call_function" and isinstance(node.target, compat.OpOverload)


def is_written(arg: Any) -> bool:
    """Whether a schema argument is written in place (``Tensor(a!)``)."""
    return arg.alias_info is not None and arg.alias_info.is_write


def schema_args(node: fx.Node) -> Iterator[tuple[Any, Any]]:
    """(schema argument, value) pairs of an OpOverload call, positional and keyword."""
    schema = node.target._schema
    for i, arg in enumerate(schema.arguments):
        if i < len(node.args):
            yield arg, node.args[i]
        elif arg.name in node.kwargs:
            yield arg, node.kwargs[arg.name]


def is_rng(node: fx.Node) -> bool:
    """Whether ``node`` consumes the global random generator: its schema is tagged
    ``nondeterministic_seeded``, its name is in ``RNG_NAMES``, or it takes a ``Generator``.

    Example::

        >>> g = make_fx(lambda x: torch.dropout(x, 0.5, True))(torch.ones(2))  # doctest: +SKIP
    """
    if not is_op(node):
        return False
    op = node.target
    if torch.Tag.nondeterministic_seeded in op.tags:
        return True
    if op._schema.name.split("::")[-1] in RNG_NAMES:
        return True
    return any("Generator" in str(a.type) for a in op._schema.arguments)


def buffer_analysis(nodes: list[fx.Node]) -> tuple[dict, dict]:
    """``base[n]``: the node owning n's storage; ``writes[n]``: bases that n writes.

    From the schemas: an argument marked ``is_write`` is written (its base); a result with
    ``alias_info`` (a view, or an in-place op's result) shares the base of its first aliased
    argument; ``getitem`` of a view-returning op (split, unbind, chunk) shares its base.
    """
    base: dict[fx.Node, fx.Node] = {}
    writes: dict[fx.Node, set] = {}
    for n in nodes:
        base[n] = n
        if is_op(n):
            aliased = None
            for arg, val in schema_args(n):
                if arg.alias_info is None or not isinstance(val, fx.Node):
                    continue
                aliased = aliased or val
                if is_written(arg):
                    writes.setdefault(n, set()).add(base[val])
            if aliased is not None and any(r.alias_info for r in n.target._schema.returns):
                base[n] = base[aliased]  # a view or an in-place result: same buffer
        elif n.op == "call_function" and n.target is operator.getitem:
            src = n.args[0]
            if isinstance(src, fx.Node) and base[src] is not src:
                base[n] = base[src]  # an element of split/unbind/chunk (views)
    return base, writes


def write_orderings(compute: list[fx.Node], base: dict, writes: dict, gpos: dict):
    """The pairs that must keep eager order around in-place writes: for every buffer a node
    writes, each other reader or writer of that buffer among ``compute``. Yields
    ``(first, second, written, writer)`` with ``first`` before ``second`` in graph order
    (``gpos``: node -> graph position); ``base``/``writes`` from :func:`buffer_analysis`."""
    readers: dict[fx.Node, list[fx.Node]] = {}
    for n in compute:
        for p in n.all_input_nodes:
            readers.setdefault(base[p], []).append(n)
    for m, bufs in writes.items():
        for b in bufs:
            for r in readers.get(b, []) + [w for w in writes if b in writes[w]]:
                if r is not m:
                    first, second = (r, m) if gpos[r] < gpos[m] else (m, r)
                    yield first, second, b, m


def has_side_effects(gm: fx.GraphModule) -> bool:
    """Whether running ``gm`` again would repeat an effect: a write into an argument (an
    input mutation such as a BatchNorm statistic) or a draw from the random generator."""
    nodes = list(gm.graph.nodes)
    _, writes = buffer_analysis(nodes)
    return bool(writes) or any(is_rng(n) for n in nodes)


def example_args(gm: fx.GraphModule, generator: torch.Generator | None = None) -> list:
    """Inputs for a captured graph's placeholders, from their ``meta["val"]``: random
    normal floating tensors (drawn from ``generator``, or the global generator), zero
    tensors of other dtypes, non-tensor values as recorded. For running a graph outside
    the model (tests, benchmarks), where the values do not matter but must be finite.

    Example::

        >>> import torch
        >>> from torch.fx.experimental.proxy_tensor import make_fx
        >>> gm = make_fx(lambda x, i: x[i], tracing_mode="fake")(
        ...     torch.ones(3, 2), torch.zeros(1, dtype=torch.long))
        >>> [(tuple(a.shape), a.dtype) for a in example_args(gm)]
        [((3, 2), torch.float32), ((1,), torch.int64)]
    """
    out = []
    for n in gm.graph.nodes:
        if n.op != "placeholder":
            continue
        v = n.meta["val"]
        if not isinstance(v, torch.Tensor):
            out.append(v)
        elif v.dtype.is_floating_point:
            out.append(torch.randn(v.shape, dtype=v.dtype, generator=generator))
        else:
            out.append(torch.zeros(v.shape, dtype=v.dtype))
    return out
