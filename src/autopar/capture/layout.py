"""Layout robustness of captured aten graphs: views that survive a mispredicted stride.

AOTAutograd traces with fake tensors, and a fake tensor's strides are the *meta kernel's*
prediction of the real kernel's output layout. Some predictions are wrong on CPU (torch
2.13): ``native_batch_norm`` / ``native_batch_norm_backward`` on a channels-last-like
(transposed) input predict the input's layout where the real kernel returns a contiguous
tensor, and ``native_dropout_backward`` predicts a contiguous gradient where the real kernel
follows the (transposed) incoming gradient. AOTAutograd then emits ``aten.view`` where the
*fake* layout allows it (merging dimensions that are adjacent in memory only in the
prediction), and the real run fails with "view size is not compatible with input tensor's
size and stride". Eager never meets this: it asks ``reshape`` only what is logically needed.

:func:`robust_views` rewrites exactly the views that can fail that way into ``aten.reshape``,
which *is* the same view whenever the real strides allow one (same storage, no copy, same
aliasing, measured at no extra cost) and copies otherwise. ``reshape`` keeps the aliasing
schema (``Tensor(a) -> Tensor(a)``), so :mod:`autopar.capture.analysis`, the profiler and
Inductor read the node as before. A view is left alone when

* it cannot fail for any strides: it only splits dimensions or adds/drops size-1 ones;
* its input's real layout is the fake one by construction: a forward graph input (Dynamo
  guards the strides of the tensors it was traced with) or a view chain of one (a view's
  strides are computed by the same code for fake and real tensors);
* anything in the graph writes the buffer in place, where a copy would lose the write.

Example::

    >>> import torch
    >>> from torch.fx.experimental.proxy_tensor import make_fx
    >>> gm = make_fx(lambda x: (x * 2).view(6), tracing_mode="fake")(torch.ones(2, 3))
    >>> robust_views(gm, phase="backward")   # the mul's layout is a prediction
    1
    >>> [n.target for n in gm.graph.nodes if n.op == "call_function"][-1]
    <OpOverload(op='aten.reshape', overload='default')>
"""

from __future__ import annotations

import math
import operator

import torch
import torch.fx as fx

from autopar.capture.analysis import buffer_analysis, is_op

aten = torch.ops.aten

#: Ops whose success depends on the input's strides, not only its shape: the ones AOTAutograd
#: emits for ``x.view(...)`` / ``x.reshape(...)`` and for the results of decomposed matmuls.
LAYOUT_SENSITIVE = {aten.view.default, aten._unsafe_view.default}


def robust_views(gm: fx.GraphModule, phase: str) -> int:
    """Rewrite the layout-sensitive views of ``gm`` whose real input layout may differ from
    the fake one into ``aten.reshape`` (module docstring). ``phase`` is the graph's:
    ``"backward"`` graph inputs (activations saved by the forward, tangents) are real
    kernels' outputs, so their layout is a prediction too. Edits ``gm`` in place (and
    recompiles it when something changed); returns how many nodes it rewrote."""
    nodes = list(gm.graph.nodes)
    base, writes = buffer_analysis(nodes)
    written = {b for bufs in writes.values() for b in bufs}
    exact: set[fx.Node] = set()  # nodes whose real strides are the fake ones
    changed = 0
    for n in nodes:
        src = _aliased_input(n)
        if n.op == "placeholder":
            if phase != "backward":
                exact.add(n)
        elif n.op == "get_attr" or (src is not None and src in exact):
            exact.add(n)
        if n.target not in LAYOUT_SENSITIVE or not isinstance(n.args[0], fx.Node):
            continue
        x = n.args[0]
        if x in exact or base.get(x, x) in written or not _can_fail(x, n):
            continue
        n.target = aten.reshape.default  # same (self, shape) arguments as view
        changed += 1
    if changed:
        gm.recompile()
    return changed


def _aliased_input(n: fx.Node) -> fx.Node | None:
    """The input whose storage ``n``'s result reads through a pure view (a view op, or an
    element of split/unbind/chunk), or None when ``n`` computes a new result."""
    if is_op(n) and n.target.is_view and n.args and isinstance(n.args[0], fx.Node):
        return n.args[0]
    if n.op == "call_function" and n.target is operator.getitem:
        src = n.args[0]
        if isinstance(src, fx.Node) and is_op(src) and src.target.is_view:
            return src.args[0] if isinstance(src.args[0], fx.Node) else None
    return None


def _can_fail(x: fx.Node, view: fx.Node) -> bool:
    """Whether ``view`` of ``x`` fails for some strides of ``x``: it merges two dimensions
    (of size > 1) into one. Without shapes to read, assume it can."""
    before, after = _shape(x), _shape(view)
    if before is None or after is None:
        return True
    return merges_dims(before, after)


def merges_dims(before: tuple[int, ...], after: tuple[int, ...]) -> bool:
    """Whether reshaping ``before`` into ``after`` folds two dimensions of size > 1 into one
    (the only way a ``view`` can depend on strides). Splitting a dimension, or adding and
    dropping size-1 dimensions, works on any strides.

    Example::

        >>> merges_dims((4, 5, 8), (20, 8)), merges_dims((20, 8), (4, 5, 8))
        (True, False)
    """
    src = [d for d in before if d != 1]
    dst = [d for d in after if d != 1]
    if 0 in src or math.prod(src) != math.prod(dst):
        return not (0 in src and 0 in dst)  # empty tensors view freely; odd shapes: assume so
    j = 0
    for d in src:  # each input dimension must be covered by whole output dimensions alone
        covered = 1
        while covered < d and j < len(dst):
            covered *= dst[j]
            j += 1
        if covered != d:
            return True  # an output dimension straddles two input dimensions
    return False


def _shape(n: fx.Node) -> tuple[int, ...] | None:
    val = n.meta.get("val")
    if not isinstance(val, torch.Tensor):
        return None
    try:
        return tuple(int(d) for d in val.shape)
    except (TypeError, ValueError):  # a symbolic size: no static answer
        return None


__all__ = ["LAYOUT_SENSITIVE", "merges_dims", "robust_views"]
