"""Recurrent layers in a form autopar can capture, plan and run fast.

Capturing a Python loop of ``nn.LSTMCell`` with Dynamo + AOTAutograd yields ~80 forward and
~210 backward aten nodes per cell step (every sigmoid, chunk and mul, and their grads), and
AOTAutograd spends ~1 ms per node. Here each cell's *pointwise* part is ONE custom op
(``autopar::lstm_cell`` / ``autopar::gru_cell``) whose backward is ONE more custom op
(``autopar::lstm_cell_backward`` / ``autopar::gru_cell_backward``), while the GEMMs stay
ordinary aten ops (``F.linear``), so the planner still sees them and can hoist input
projections and run a layer x time wavefront.

:func:`rewrite_rnns` routes ``nn.LSTMCell``, ``nn.GRUCell``, ``nn.LSTM`` and ``nn.GRU``
submodules through such an implementation while active, using the very same Parameters.
Whole ``nn.LSTM`` layers may instead run fused (:func:`fused_lstm_layer`: one oneDNN
``aten.mkldnn_rnn_layer`` per layer, direction and optional time chunk); the per-module
choice between the forms is measured, see :mod:`autopar.rnn.layers`.

CPU body of the pointwise ops: plain torch ops written to allocate little (in-place
activations on views of one gates buffer). ATen has no CPU fused-cell helper
(``_thnn_fused_lstm_cell`` is CUDA-only). An Inductor-compiled body measured 1.5-2x faster
for forward+backward at [16, 4*256] (one C++ loop vs ~25 small ops), but it needs a C++
compiler and a compile per dtype/shape class at first use, so it is not the default (see
``benchmarks/rnn_cells.py``). On CUDA the ops dispatch to the Triton kernels in
:mod:`autopar.runtime.kernels.triton_cells`. In eager mode (not under Dynamo) the rewritten modules
call the same bodies through a plain ``autograd.Function``, which costs about half of a
custom op's dispatch per call. The Triton kernels launch under ``torch.cuda.device`` of
their inputs (``triton_cells.launch_guard``), so a cell on cuda:1 runs on cuda:1. Whole
``nn.LSTM`` / ``nn.GRU`` modules on CUDA are left to cuDNN (``autopar.rnn.layers``); these
cells serve user cell loops (``nn.LSTMCell`` / ``nn.GRUCell``) and the forced unrolled form.

Mixed dtypes follow eager (:mod:`autopar.rnn.dtypes`): under CPU autocast the gate GEMMs
are bfloat16 while the user's state stays float32, and ATen's cells promote, so the ops take
``igates`` and ``hgates`` of one dtype and a state of any floating dtype, compute in the
promoted dtype and return it; each gradient comes back in its input's dtype. A Dynamo graph
thus keeps ``lstm_cell(F.linear(..), F.linear(..), c)`` as is and still fuses. Under CUDA
autocast the forward ops cast every input to autocast's dtype, as ATen's listed cells do.

Saved tensors: the forward ops save only their inputs (``igates``, ``hgates``, ``c``/``h``)
and the backward ops recompute the activations: that saves no more than the unfused
version's gate buffer and keeps the op schemas exactly ``(h, c_new)`` / ``h_new``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from autopar.rnn.dtypes import (
    AUTOCAST_CELL_DEVICES,
    common_dtype,
    eager_autocast,
    promoted,
    register_lower_precision_autocast,
)

__all__ = [
    "lstm_cell",
    "gru_cell",
    "fused_lstm_layer",
    "unrolled_lstm_layer",
    "mkldnn_lstm_usable",
    "RNN_MODULE_TYPES",
    "RNN_FORMS",
]

#: Forms of nn.LSTM / nn.GRU :func:`rewrite_rnns` can run (see :mod:`autopar.rnn.layers`).
#: ``"cudnn"``: the module's own forward on CUDA (the default there); on CPU it is ``fused``.
RNN_FORMS = ("unrolled", "fused", "chunked", "cudnn")

#: Module types :func:`rewrite_rnns` rewrites (exact types and their subclasses).
RNN_MODULE_TYPES = (nn.LSTMCell, nn.GRUCell, nn.LSTM, nn.GRU)


# --------------------------------------------------------------------------- shape checks


def _check_gates(name: str, igates: Tensor, hgates: Tensor, state: Tensor, n: int) -> int:
    """Validate the pointwise ops' inputs; returns the hidden size H (gates are ``n*H`` wide)."""
    if igates.shape != hgates.shape:
        raise ValueError(
            f"autopar::{name}: igates {tuple(igates.shape)} and hgates {tuple(hgates.shape)} "
            "must have the same shape (both are [..., "
            f"{n}*hidden]: F.linear(x, W_ih, b_ih) and F.linear(h, W_hh, b_hh))."
        )
    hidden = state.shape[-1] if state.dim() else 0
    if igates.dim() == 0 or igates.shape[-1] != n * hidden or igates.shape[:-1] != state.shape[:-1]:
        raise ValueError(
            f"autopar::{name}: gates {tuple(igates.shape)} do not fit state "
            f"{tuple(state.shape)}; expected gates of shape [..., {n}*H] and state [..., H] "
            "with the same leading dimensions."
        )
    if igates.dtype != hgates.dtype or not state.is_floating_point():
        raise ValueError(
            f"autopar::{name}: igates {igates.dtype} and hgates {hgates.dtype} must share a "
            f"floating dtype, and the state ({state.dtype}) must be floating; convert them."
        )
    return hidden


def _on_cuda(*tensors: Tensor) -> bool:
    return any(t.is_cuda for t in tensors)


# --------------------------------------------------------------------------- LSTM cell op


def _lstm_cell_impl(igates: Tensor, hgates: Tensor, c: Tensor) -> tuple[Tensor, Tensor]:
    """Pointwise part of ``nn.LSTMCell``: returns ``(h, c_new)``.

    ``igates + hgates`` are the pre-activation gates laid out like PyTorch's, chunks
    ``(i, f, g, o)`` of the last dimension ``4*H``; ``c`` is the previous cell state.

    Example::

        ig = F.linear(x, cell.weight_ih, cell.bias_ih)
        hg = F.linear(h, cell.weight_hh, cell.bias_hh)
        h, c = torch.ops.autopar.lstm_cell(ig, hg, c)   # == cell(x, (h, c))
    """
    hidden = _check_gates("lstm_cell", igates, hgates, c, 4)
    igates, hgates, c = promoted(igates, hgates, c)
    if _on_cuda(igates, hgates, c):
        from autopar.runtime.kernels.triton_cells import lstm_cell_forward

        return lstm_cell_forward(igates, hgates, c)
    gates = torch.add(igates, hgates)
    # i and f are adjacent, so one in-place sigmoid covers both.
    i_f = gates[..., : 2 * hidden].sigmoid_()
    g = gates[..., 2 * hidden : 3 * hidden].tanh_()
    o = gates[..., 3 * hidden :].sigmoid_()
    i, f = i_f[..., :hidden], i_f[..., hidden:]
    c_new = torch.empty(c.shape, dtype=c.dtype, device=c.device)
    torch.mul(f, c, out=c_new)
    c_new.addcmul_(i, g)
    h = torch.tanh(c_new).mul_(o)
    return h, c_new


lstm_cell = torch.library.custom_op("autopar::lstm_cell", _lstm_cell_impl, mutates_args=())


@lstm_cell.register_fake
def _(igates: Tensor, hgates: Tensor, c: Tensor) -> tuple[Tensor, Tensor]:
    _check_gates("lstm_cell", igates, hgates, c, 4)
    dtype = common_dtype(igates, c)
    return c.new_empty(c.shape, dtype=dtype), c.new_empty(c.shape, dtype=dtype)


def _lstm_cell_backward_impl(
    grad_h: Tensor, grad_c: Tensor, igates: Tensor, hgates: Tensor, c: Tensor
) -> tuple[Tensor, Tensor]:
    """Backward of :func:`lstm_cell`: returns ``(grad_gates, grad_c_prev)``.

    ``grad_gates`` is the gradient of both ``igates`` and ``hgates`` (they are summed).
    The activations are recomputed from the saved inputs.

    Example::

        gg, gc = torch.ops.autopar.lstm_cell_backward(gh, gc_new, ig, hg, c)
    """
    hidden = _check_gates("lstm_cell_backward", igates, hgates, c, 4)
    grad_h, grad_c, igates, hgates, c = promoted(grad_h, grad_c, igates, hgates, c)
    if _on_cuda(grad_h, grad_c, igates, hgates, c):
        from autopar.runtime.kernels.triton_cells import lstm_cell_backward as triton_bwd

        return triton_bwd(grad_h, grad_c, igates, hgates, c)
    # Op count matters more than flops at RNN sizes (~3 us per op): in-place ops on views of
    # one buffer, and no `1 - x` (rsub with a Scalar is ~10x slower than `x.neg_().add_(1)`).
    act = torch.add(igates, hgates)
    act[..., : 2 * hidden].sigmoid_()
    act[..., 2 * hidden : 3 * hidden].tanh_()
    act[..., 3 * hidden :].sigmoid_()
    i, f, g, o = act.split(hidden, dim=-1)
    tanh_c = torch.mul(f, c).addcmul_(i, g).tanh_()
    # dL/dc_new in total: directly, and through h = o * tanh(c_new).
    dc = torch.mul(tanh_c, tanh_c).neg_().add_(1).mul_(o)
    # Outputs are allocated contiguous explicitly, matching the fake impls' strides even
    # when incoming grads are not contiguous.
    dc = torch.addcmul(grad_c, grad_h, dc, out=torch.empty(c.shape, dtype=c.dtype, device=c.device))
    # Gradients w.r.t. the activated gates, written into one [..., 4H] buffer ...
    grad = torch.empty(act.shape, dtype=act.dtype, device=act.device)
    gi, gf, gg, go = grad.split(hidden, dim=-1)
    torch.mul(dc, g, out=gi)
    torch.mul(dc, c, out=gf)
    torch.mul(dc, i, out=gg)
    torch.mul(grad_h, tanh_c, out=go)
    # ... then through the activations: sigmoid' = s - s^2, tanh' = 1 - t^2.
    deriv = torch.addcmul(act, act, act, value=-1)
    torch.mul(g, g, out=deriv[..., 2 * hidden : 3 * hidden]).neg_().add_(1)
    grad.mul_(deriv)
    return grad, dc.mul_(f)


lstm_cell_backward = torch.library.custom_op(
    "autopar::lstm_cell_backward", _lstm_cell_backward_impl, mutates_args=()
)


@lstm_cell_backward.register_fake
def _(grad_h, grad_c, igates, hgates, c):
    _check_gates("lstm_cell_backward", igates, hgates, c, 4)
    dtype = common_dtype(grad_h, grad_c, igates, c)
    return igates.new_empty(igates.shape, dtype=dtype), c.new_empty(c.shape, dtype=dtype)


def _lstm_setup_context(ctx, inputs, output) -> None:
    ctx.save_for_backward(*inputs)


def _lstm_backward(ctx, grad_h: Tensor, grad_c: Tensor):
    igates, hgates, c = ctx.saved_tensors
    grad_gates, grad_c_prev = torch.ops.autopar.lstm_cell_backward(
        grad_h, grad_c, igates, hgates, c
    )
    return _lstm_grads(ctx.needs_input_grad, grad_gates, grad_c_prev, igates, c)


def _lstm_grads(need, grad_gates: Tensor, grad_c_prev: Tensor, igates: Tensor, c: Tensor):
    """The backward op's results as the gradients of (igates, hgates, c), each in its
    input's dtype (the math ran in the promoted one)."""
    grad_gates = grad_gates.to(igates.dtype)
    return (
        grad_gates if need[0] else None,
        grad_gates if need[1] else None,
        grad_c_prev.to(c.dtype) if need[2] else None,
    )


lstm_cell.register_autograd(_lstm_backward, setup_context=_lstm_setup_context)


# --------------------------------------------------------------------------- GRU cell op


def _gru_cell_impl(igates: Tensor, hgates: Tensor, h: Tensor) -> Tensor:
    """Pointwise part of ``nn.GRUCell``: returns ``h_new``.

    Gate chunks are ``(r, z, n)`` of the last dimension ``3*H``. ``hgates`` includes
    ``b_hh``, so ``b_hn`` is scaled by ``r`` exactly as in PyTorch:
    ``n = tanh(i_n + r * (W_hn h + b_hn))``, ``h_new = (1 - z) * n + z * h``.

    Example::

        ig = F.linear(x, cell.weight_ih, cell.bias_ih)
        hg = F.linear(h, cell.weight_hh, cell.bias_hh)
        h = torch.ops.autopar.gru_cell(ig, hg, h)   # == cell(x, h)
    """
    hidden = _check_gates("gru_cell", igates, hgates, h, 3)
    igates, hgates, h = promoted(igates, hgates, h)
    if _on_cuda(igates, hgates, h):
        from autopar.runtime.kernels.triton_cells import gru_cell_forward

        return gru_cell_forward(igates, hgates, h)
    rz = torch.add(igates[..., : 2 * hidden], hgates[..., : 2 * hidden]).sigmoid_()
    r, z = rz[..., :hidden], rz[..., hidden:]
    n = torch.addcmul(igates[..., 2 * hidden :], r, hgates[..., 2 * hidden :]).tanh_()
    # Same association as ATen's gru_cell: n + z * (h - n).
    h_new = torch.empty(h.shape, dtype=h.dtype, device=h.device)
    torch.sub(h, n, out=h_new)
    return h_new.mul_(z).add_(n)


gru_cell = torch.library.custom_op("autopar::gru_cell", _gru_cell_impl, mutates_args=())


@gru_cell.register_fake
def _(igates: Tensor, hgates: Tensor, h: Tensor) -> Tensor:
    _check_gates("gru_cell", igates, hgates, h, 3)
    return h.new_empty(h.shape, dtype=common_dtype(igates, h))


def _gru_cell_backward_impl(
    grad_h_new: Tensor, igates: Tensor, hgates: Tensor, h: Tensor
) -> tuple[Tensor, Tensor, Tensor]:
    """Backward of :func:`gru_cell`: returns ``(grad_igates, grad_hgates, grad_h)``.

    Example::

        gi, gh, gprev = torch.ops.autopar.gru_cell_backward(g, ig, hg, h)
    """
    hidden = _check_gates("gru_cell_backward", igates, hgates, h, 3)
    grad_h_new, igates, hgates, h = promoted(grad_h_new, igates, hgates, h)
    if _on_cuda(grad_h_new, igates, hgates, h):
        from autopar.runtime.kernels.triton_cells import gru_cell_backward as triton_bwd

        return triton_bwd(grad_h_new, igates, hgates, h)
    rz = torch.add(igates[..., : 2 * hidden], hgates[..., : 2 * hidden]).sigmoid_()
    r, z = rz[..., :hidden], rz[..., hidden:]
    h_n = hgates[..., 2 * hidden :]
    n = torch.addcmul(igates[..., 2 * hidden :], r, h_n).tanh_()
    # sigmoid' = s - s^2 for r and z at once (no `1 - x`: see lstm_cell_backward).
    drz = torch.addcmul(rz, rz, rz, value=-1)
    grad_i = torch.empty(igates.shape, dtype=h.dtype, device=h.device)
    g_r, g_z, g_n = grad_i.split(hidden, dim=-1)
    # n' = dL/d(pre-tanh n) = g * (1 - z) * (1 - n^2)
    one_minus_z = z.neg().add_(1)
    torch.mul(n, n, out=g_n).neg_().add_(1).mul_(grad_h_new).mul_(one_minus_z)
    # z' = g * (h - n) * z(1 - z)
    torch.sub(h, n, out=g_z).mul_(grad_h_new).mul_(drz[..., hidden:])
    # r' = n' * h_n * r(1 - r)
    torch.mul(g_n, h_n, out=g_r).mul_(drz[..., :hidden])
    grad_hg = grad_i.clone()
    grad_hg[..., 2 * hidden :].mul_(r)
    grad_h = torch.mul(grad_h_new, z, out=torch.empty(h.shape, dtype=h.dtype, device=h.device))
    return grad_i, grad_hg, grad_h


gru_cell_backward = torch.library.custom_op(
    "autopar::gru_cell_backward", _gru_cell_backward_impl, mutates_args=()
)


@gru_cell_backward.register_fake
def _(grad_h_new, igates, hgates, h):
    _check_gates("gru_cell_backward", igates, hgates, h, 3)
    dtype = common_dtype(grad_h_new, igates, h)
    gates = igates.new_empty(igates.shape, dtype=dtype)
    return gates, igates.new_empty(igates.shape, dtype=dtype), h.new_empty(h.shape, dtype=dtype)


def _gru_setup_context(ctx, inputs, output) -> None:
    ctx.save_for_backward(*inputs)


def _gru_backward(ctx, grad_h_new: Tensor):
    igates, hgates, h = ctx.saved_tensors
    grad_i, grad_hg, grad_h = torch.ops.autopar.gru_cell_backward(grad_h_new, igates, hgates, h)
    return _gru_grads(ctx.needs_input_grad, grad_i, grad_hg, grad_h, igates, h)


def _gru_grads(need, grad_i: Tensor, grad_hg: Tensor, grad_h: Tensor, igates: Tensor, h: Tensor):
    """The backward op's results, each in its input's dtype (see :func:`_lstm_grads`)."""
    return (
        grad_i.to(igates.dtype) if need[0] else None,
        grad_hg.to(igates.dtype) if need[1] else None,
        grad_h.to(h.dtype) if need[2] else None,
    )


gru_cell.register_autograd(_gru_backward, setup_context=_gru_setup_context)


# --------------------------------------------------------------------------- autocast

_AUTOCAST_LIB = torch.library.Library("autopar", "FRAGMENT")  # the kernels live as long as it
for _op in (torch.ops.autopar.lstm_cell.default, torch.ops.autopar.gru_cell.default):
    for _device in AUTOCAST_CELL_DEVICES:
        register_lower_precision_autocast(_op, _device, _AUTOCAST_LIB)


# --------------------------------------------------------------------------- eager fast path


class _LSTMCellEager(torch.autograd.Function):
    """Same bodies as the custom ops, without the custom-op dispatch (eager only)."""

    @staticmethod
    def forward(ctx, igates, hgates, c):
        ctx.save_for_backward(igates, hgates, c)
        return _lstm_cell_impl(igates, hgates, c)

    @staticmethod
    def backward(ctx, grad_h, grad_c):
        igates, hgates, c = ctx.saved_tensors
        grad_gates, grad_c_prev = _lstm_cell_backward_impl(grad_h, grad_c, igates, hgates, c)
        return _lstm_grads((True,) * 3, grad_gates, grad_c_prev, igates, c)


class _GRUCellEager(torch.autograd.Function):
    """Same bodies as the custom ops, without the custom-op dispatch (eager only)."""

    @staticmethod
    def forward(ctx, igates, hgates, h):
        ctx.save_for_backward(igates, hgates, h)
        return _gru_cell_impl(igates, hgates, h)

    @staticmethod
    def backward(ctx, grad_h_new):
        igates, hgates, h = ctx.saved_tensors
        grads = _gru_cell_backward_impl(grad_h_new, igates, hgates, h)
        return _gru_grads((True,) * 3, *grads, igates, h)


# In eager mode a custom op with autograd costs ~2x a plain autograd.Function per call
# (dispatcher round trips, schema/pytree handling; see benchmarks/rnn_cells.py), which
# adds up over layers x timesteps. While Dynamo traces (is_compiling() is constant-folded
# to True) the custom ops are used, so captured graphs hold exactly one node per cell.
def _lstm_pointwise(igates: Tensor, hgates: Tensor, c: Tensor) -> tuple[Tensor, Tensor]:
    if torch.compiler.is_compiling():
        return torch.ops.autopar.lstm_cell(igates, hgates, c)
    return _LSTMCellEager.apply(*eager_autocast(igates, hgates, c))


def _gru_pointwise(igates: Tensor, hgates: Tensor, h: Tensor) -> Tensor:
    if torch.compiler.is_compiling():
        return torch.ops.autopar.gru_cell(igates, hgates, h)
    return _GRUCellEager.apply(*eager_autocast(igates, hgates, h))


# --------------------------------------------------------------------------- the oneDNN op


def _aten_lstm_layer(x, w_ih, w_hh, b_ih, b_hh, h0, c0, reverse, has_biases, train):
    return torch.ops.aten.mkldnn_rnn_layer(
        x,
        w_ih,
        w_hh,
        b_ih,
        b_hh,
        h0,
        c0,
        reverse,
        [],
        2,
        w_hh.size(1),
        1,
        has_biases,
        False,
        False,
        train,
    )  # fmt: skip (mode 2: LSTM; one layer, one direction, time-major)


# AOTAutograd runs a compiled forward under no_grad, where aten.mkldnn_rnn_layer returns no
# workspace (None) even with train=True, and the saved None then fails the backward. This
# wrapper op runs it with grad mode on (its body runs below autograd: nothing is recorded)
# and its backward is exactly aten.mkldnn_rnn_layer_backward (the node the bw graph holds).
@torch.library.custom_op("autopar::mkldnn_rnn_layer", mutates_args=())
def _mkldnn_rnn_layer_op(
    x: Tensor,
    w_ih: Tensor,
    w_hh: Tensor,
    b_ih: Tensor,
    b_hh: Tensor,
    h0: Tensor,
    c0: Tensor,
    reverse: bool,
    has_biases: bool,
    train: bool,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """``aten.mkldnn_rnn_layer`` for one LSTM layer and direction (see fused_lstm_layer)."""
    with torch.enable_grad():
        out = _aten_lstm_layer(x, w_ih, w_hh, b_ih, b_hh, h0, c0, reverse, has_biases, train)
    # Fresh outputs (custom ops may not alias); an empty workspace when not training.
    return tuple(t if t is not None else x.new_empty(0) for t in out)


@_mkldnn_rnn_layer_op.register_fake
def _(x, w_ih, w_hh, b_ih, b_hh, h0, c0, reverse, has_biases, train):
    return _aten_lstm_layer(x, w_ih, w_hh, b_ih, b_hh, h0, c0, reverse, has_biases, train)


def _mkldnn_setup_context(ctx, inputs, output) -> None:
    ctx.flags = inputs[7:]
    ctx.save_for_backward(*inputs[:7], *output)


def _mkldnn_backward(ctx, g_out, g_hy, g_cy, _g_ws):
    x, w_ih, w_hh, b_ih, b_hh, h0, c0, out, hy, cy, ws = ctx.saved_tensors
    reverse, has_biases, train = ctx.flags
    grads = [None if g is None else g.contiguous() for g in (g_out, g_hy, g_cy)]
    res = torch.ops.aten.mkldnn_rnn_layer_backward(
        x, w_ih, w_hh, b_ih, b_hh, h0, c0, out, hy, cy, *grads, reverse, 2, w_hh.size(1), 1,
        has_biases, train, False, [], False, ws,
    )  # fmt: skip
    need = ctx.needs_input_grad
    return (*(g if need[i] else None for i, g in enumerate(res)), None, None, None)


_mkldnn_rnn_layer_op.register_autograd(_mkldnn_backward, setup_context=_mkldnn_setup_context)


# --------------------------------------------------------------------------- fused LSTM layer

_HAS_MKLDNN = bool(torch.backends.mkldnn.is_available())
_MKLDNN_BF16 = _HAS_MKLDNN and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


def mkldnn_lstm_usable(*tensors: Tensor | None) -> bool:
    """Can ``aten.mkldnn_rnn_layer`` run an LSTM layer on these tensors (all of one dtype)?

    CPU, float32 (or bfloat16 where oneDNN supports it), non-empty, oneDNN built in and not
    disabled (``torch.backends.mkldnn.enabled``, read outside Dynamo traces only)."""
    ts = [t for t in tensors if t is not None]
    if not _HAS_MKLDNN or not ts or ts[0].numel() == 0:
        return False
    if not torch.compiler.is_compiling() and not torch.backends.mkldnn.enabled:
        return False
    dtype = ts[0].dtype
    if dtype != torch.float32 and not (dtype == torch.bfloat16 and _MKLDNN_BF16):
        return False
    return all(t.dtype == dtype and t.device.type == "cpu" for t in ts)


def unrolled_lstm_layer(
    x: Tensor, w_ih, w_hh, b_ih, b_hh, h0: Tensor, c0: Tensor, *, reverse: bool = False
) -> tuple[Tensor, Tensor, Tensor]:
    """One LSTM layer as one input GEMM over [T*B, I] plus a GEMM and a cell op per step."""
    ig_steps = F.linear(x, w_ih, b_ih).unbind(0)  # unbind: ONE stack in backward
    h, c = h0, c0
    out: list = [None] * x.size(0)
    for t in range(x.size(0) - 1, -1, -1) if reverse else range(x.size(0)):
        h, c = _lstm_pointwise(ig_steps[t], F.linear(h, w_hh, b_hh), c)
        out[t] = h
    return torch.stack(out), h, c


def fused_lstm_layer(
    x: Tensor,
    w_ih: Tensor,
    w_hh: Tensor,
    b_ih: Tensor | None,
    b_hh: Tensor | None,
    h0: Tensor,
    c0: Tensor,
    *,
    reverse: bool = False,
    train: bool = True,
) -> tuple[Tensor, Tensor, Tensor]:
    """One LSTM layer and direction over a whole sequence: ``(out[T,B,H], hy[B,H], cy[B,H])``.

    ``x`` is time-major ``[T, B, I]``; ``h0``/``c0`` are ``[B, H]``; ``reverse`` runs from
    ``t = T-1`` down to 0 (nn.LSTM's reverse direction). Where :func:`mkldnn_lstm_usable`,
    this is ONE ``aten.mkldnn_rnn_layer`` call -- exactly what ``aten::lstm`` runs per layer
    and direction on CPU, so results are bit-identical to ``nn.LSTM`` -- which Dynamo +
    AOTAutograd capture as one forward and one ``aten.mkldnn_rnn_layer_backward`` node.
    Otherwise (CUDA, float64, no oneDNN) it is :func:`unrolled_lstm_layer`.
    ``train=False`` skips the workspace (forward only: no backward through it).

    The oneDNN op ignores strides, so every tensor is made contiguous first. Missing biases
    are passed as zeros that do not require grad (no gradient goes anywhere).

    Example::

        out, hy, cy = fused_lstm_layer(x, lstm.weight_ih_l0, lstm.weight_hh_l0,
                                       lstm.bias_ih_l0, lstm.bias_hh_l0, h0, c0)
    """
    if not mkldnn_lstm_usable(x, w_ih, w_hh, b_ih, b_hh, h0, c0) or w_hh.size(1) != h0.size(-1):
        return unrolled_lstm_layer(x, w_ih, w_hh, b_ih, b_hh, h0, c0, reverse=reverse)
    has_biases = b_ih is not None
    if b_ih is None:
        b_ih = w_ih.new_zeros(w_ih.size(0))
    if b_hh is None:
        b_hh = w_hh.new_zeros(w_hh.size(0))
    args = [t.contiguous() for t in (x, w_ih, w_hh, b_ih, b_hh, h0, c0)]
    # Always the wrapper op (eager too: its ~20 us dispatch is noise next to a layer), so
    # graphs traced by any route (Dynamo, or make_fx of an FX graph calling this) work.
    out, hy, cy, _ = torch.ops.autopar.mkldnn_rnn_layer(*args, reverse, has_biases, train)
    return out, hy, cy
