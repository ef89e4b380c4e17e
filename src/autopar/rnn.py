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

CPU body of the pointwise ops: plain torch ops written to allocate little (in-place
activations on views of one gates buffer). ATen has no CPU fused-cell helper
(``_thnn_fused_lstm_cell`` is CUDA-only). An Inductor-compiled body measured 1.5-2x faster
for forward+backward at [16, 4*256] (one C++ loop vs ~25 small ops), but it needs a C++
compiler and a compile per dtype/shape class at first use, so it is not the default (see
``benchmarks/rnn_cells.py``). On CUDA the ops dispatch to the Triton kernels in
:mod:`autopar.kernels.triton_cells`. In eager mode (not under Dynamo) the rewritten modules
call the same bodies through a plain ``autograd.Function``, which costs about half of a
custom op's dispatch per call.

Saved tensors: the forward ops save only their inputs (``igates``, ``hgates``, ``c``/``h``)
and the backward ops recompute the activations: that saves no more than the unfused
version's gate buffer and keeps the op schemas exactly ``(h, c_new)`` / ``h_new``.
"""

from __future__ import annotations

import contextlib
import types
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.utils.rnn import PackedSequence

from autopar.errors import CaptureError

__all__ = ["lstm_cell", "gru_cell", "rewrite_rnns", "RNN_MODULE_TYPES"]

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
    if not (igates.dtype == hgates.dtype == state.dtype):
        raise ValueError(
            f"autopar::{name}: dtypes differ (igates {igates.dtype}, hgates {hgates.dtype}, "
            f"state {state.dtype}); convert them to one dtype."
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
    if _on_cuda(igates, hgates, c):
        from autopar.kernels.triton_cells import lstm_cell_forward

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
    return c.new_empty(c.shape), c.new_empty(c.shape)


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
    if _on_cuda(grad_h, grad_c, igates, hgates, c):
        from autopar.kernels.triton_cells import lstm_cell_backward as triton_bwd

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
    return igates.new_empty(igates.shape), c.new_empty(c.shape)


def _lstm_setup_context(ctx, inputs, output) -> None:
    ctx.save_for_backward(*inputs)


def _lstm_backward(ctx, grad_h: Tensor, grad_c: Tensor):
    igates, hgates, c = ctx.saved_tensors
    grad_gates, grad_c_prev = torch.ops.autopar.lstm_cell_backward(
        grad_h, grad_c, igates, hgates, c
    )
    need = ctx.needs_input_grad
    return (
        grad_gates if need[0] else None,
        grad_gates if need[1] else None,
        grad_c_prev if need[2] else None,
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
    if _on_cuda(igates, hgates, h):
        from autopar.kernels.triton_cells import gru_cell_forward

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
    return h.new_empty(h.shape)


def _gru_cell_backward_impl(
    grad_h_new: Tensor, igates: Tensor, hgates: Tensor, h: Tensor
) -> tuple[Tensor, Tensor, Tensor]:
    """Backward of :func:`gru_cell`: returns ``(grad_igates, grad_hgates, grad_h)``.

    Example::

        gi, gh, gprev = torch.ops.autopar.gru_cell_backward(g, ig, hg, h)
    """
    hidden = _check_gates("gru_cell_backward", igates, hgates, h, 3)
    if _on_cuda(grad_h_new, igates, hgates, h):
        from autopar.kernels.triton_cells import gru_cell_backward as triton_bwd

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
    return igates.new_empty(igates.shape), igates.new_empty(igates.shape), h.new_empty(h.shape)


def _gru_setup_context(ctx, inputs, output) -> None:
    ctx.save_for_backward(*inputs)


def _gru_backward(ctx, grad_h_new: Tensor):
    igates, hgates, h = ctx.saved_tensors
    grad_i, grad_hg, grad_h = torch.ops.autopar.gru_cell_backward(grad_h_new, igates, hgates, h)
    need = ctx.needs_input_grad
    return (
        grad_i if need[0] else None,
        grad_hg if need[1] else None,
        grad_h if need[2] else None,
    )


gru_cell.register_autograd(_gru_backward, setup_context=_gru_setup_context)


# --------------------------------------------------------------------------- eager fast path


class _LSTMCellEager(torch.autograd.Function):
    """Same bodies as the custom ops, without the custom-op dispatch (eager only)."""

    @staticmethod
    def forward(ctx, igates, hgates, c):
        ctx.save_for_backward(igates, hgates, c)
        return _lstm_cell_impl(igates, hgates, c)

    @staticmethod
    def backward(ctx, grad_h, grad_c):
        grad_gates, grad_c_prev = _lstm_cell_backward_impl(grad_h, grad_c, *ctx.saved_tensors)
        return grad_gates, grad_gates, grad_c_prev


class _GRUCellEager(torch.autograd.Function):
    """Same bodies as the custom ops, without the custom-op dispatch (eager only)."""

    @staticmethod
    def forward(ctx, igates, hgates, h):
        ctx.save_for_backward(igates, hgates, h)
        return _gru_cell_impl(igates, hgates, h)

    @staticmethod
    def backward(ctx, grad_h_new):
        return _gru_cell_backward_impl(grad_h_new, *ctx.saved_tensors)


# In eager mode a custom op with autograd costs ~2x a plain autograd.Function per call
# (dispatcher round trips, schema/pytree handling; see benchmarks/rnn_cells.py), which
# adds up over layers x timesteps. While Dynamo traces (is_compiling() is constant-folded
# to True) the custom ops are used, so captured graphs hold exactly one node per cell.
def _lstm_pointwise(igates: Tensor, hgates: Tensor, c: Tensor) -> tuple[Tensor, Tensor]:
    if torch.compiler.is_compiling():
        return torch.ops.autopar.lstm_cell(igates, hgates, c)
    return _LSTMCellEager.apply(igates, hgates, c)


def _gru_pointwise(igates: Tensor, hgates: Tensor, h: Tensor) -> Tensor:
    if torch.compiler.is_compiling():
        return torch.ops.autopar.gru_cell(igates, hgates, h)
    return _GRUCellEager.apply(igates, hgates, h)


# --------------------------------------------------------------------------- cell forwards


def _lstm_cell_module_forward(self: nn.LSTMCell, input: Tensor, hx=None):
    """``nn.LSTMCell.forward`` with the pointwise part as ``autopar::lstm_cell``."""
    if input.dim() not in (1, 2):
        raise ValueError(f"LSTMCell: Expected input to be 1D or 2D, got {input.dim()}D instead")
    if hx is not None:
        for idx, value in enumerate(hx):
            if value.dim() not in (1, 2):
                raise ValueError(
                    f"LSTMCell: Expected hx[{idx}] to be 1D or 2D, got {value.dim()}D instead"
                )
    batched = input.dim() == 2
    if not batched:
        input = input.unsqueeze(0)
    if hx is None:
        zeros = input.new_zeros(input.size(0), self.hidden_size)
        hx = (zeros, zeros)
    elif not batched:
        hx = (hx[0].unsqueeze(0), hx[1].unsqueeze(0))
    igates = F.linear(input, self.weight_ih, self.bias_ih)
    hgates = F.linear(hx[0], self.weight_hh, self.bias_hh)
    h, c = _lstm_pointwise(igates, hgates, hx[1])
    if not batched:
        return h.squeeze(0), c.squeeze(0)
    return h, c


def _gru_cell_module_forward(self: nn.GRUCell, input: Tensor, hx=None):
    """``nn.GRUCell.forward`` with the pointwise part as ``autopar::gru_cell``."""
    if input.dim() not in (1, 2):
        raise ValueError(f"GRUCell: Expected input to be 1D or 2D, got {input.dim()}D instead")
    if hx is not None and hx.dim() not in (1, 2):
        raise ValueError(f"GRUCell: Expected hidden to be 1D or 2D, got {hx.dim()}D instead")
    batched = input.dim() == 2
    if not batched:
        input = input.unsqueeze(0)
    if hx is None:
        hx = input.new_zeros(input.size(0), self.hidden_size)
    elif not batched:
        hx = hx.unsqueeze(0)
    igates = F.linear(input, self.weight_ih, self.bias_ih)
    hgates = F.linear(hx, self.weight_hh, self.bias_hh)
    h = _gru_pointwise(igates, hgates, hx)
    return h if batched else h.squeeze(0)


# --------------------------------------------------------------------------- nn.LSTM / nn.GRU


def _reject_packed(kind: str, input) -> None:
    if isinstance(input, PackedSequence):
        raise CaptureError(
            f"autopar: nn.{kind} got a PackedSequence, which autopar's RNN rewrite does not "
            "support (its time steps have varying batch sizes). Fix: pass a padded tensor "
            "(torch.nn.utils.rnn.pad_packed_sequence) and mask by lengths, or keep this module "
            'eager with autopar.compile(..., rnn="eager").'
        )


def _layer_params(self: nn.RNNBase, layer: int, direction: int):
    """The SAME Parameter objects nn.LSTM/nn.GRU use: (w_ih, w_hh, b_ih, b_hh, w_hr)."""
    sfx = f"_l{layer}" + ("_reverse" if direction else "")
    w_ih = getattr(self, "weight_ih" + sfx)
    w_hh = getattr(self, "weight_hh" + sfx)
    b_ih = getattr(self, "bias_ih" + sfx) if self.bias else None
    b_hh = getattr(self, "bias_hh" + sfx) if self.bias else None
    w_hr = getattr(self, "weight_hr" + sfx) if getattr(self, "proj_size", 0) > 0 else None
    return w_ih, w_hh, b_ih, b_hh, w_hr


def _run_rnn(self: nn.RNNBase, x: Tensor, h0: Tensor, c0: Tensor | None, batch_major: bool):
    """Multi-layer (bi)directional recurrence; ``c0 is None`` means GRU.

    ``x`` is [T, B, I] (or [B, T, I] if ``batch_major``; only the first layer reads it).
    Returns (time-major output [T, B, D*H_out], h_n, c_n or None).
    Each direction's input projection over all timesteps is ONE GEMM on [T*B, I];
    the recurrence is unrolled: one hgates GEMM + one pointwise custom op per step.
    """
    num_dirs = 2 if self.bidirectional else 1
    steps = x.size(1) if batch_major else x.size(0)
    layer_in = x
    h_last, c_last = [], []
    for layer in range(self.num_layers):
        outs = []
        for d in range(num_dirs):
            w_ih, w_hh, b_ih, b_hh, w_hr = _layer_params(self, layer, d)
            flat = layer_in.reshape(-1, layer_in.size(-1))
            ig_all = F.linear(flat, w_ih, b_ih).view(layer_in.size(0), layer_in.size(1), -1)
            # unbind, not ig_all[t]: its backward is ONE stack, while T selects would each
            # scatter into a zero tensor of the full [T, B, 4H] size (O(T^2) traffic).
            ig_steps = ig_all.unbind(1 if batch_major and layer == 0 else 0)
            h = h0[layer * num_dirs + d]
            c = c0[layer * num_dirs + d] if c0 is not None else None
            out: list = [None] * steps
            order = range(steps - 1, -1, -1) if d else range(steps)
            for t in order:
                igates = ig_steps[t]
                hgates = F.linear(h, w_hh, b_hh)
                if c is None:
                    h = _gru_pointwise(igates, hgates, h)
                else:
                    h, c = _lstm_pointwise(igates, hgates, c)
                    if w_hr is not None:
                        h = F.linear(h, w_hr)
                out[t] = h
            outs.append(torch.stack(out))
            h_last.append(h)
            c_last.append(c)
        layer_out = outs[0] if num_dirs == 1 else torch.cat(outs, dim=2)
        if self.dropout and self.training and layer < self.num_layers - 1:
            # Same call, order and (contiguous, time-major) layout as ATen's RNN loop, so
            # the dropout masks consume the global RNG exactly like eager nn.LSTM/nn.GRU.
            layer_out = F.dropout(layer_out, self.dropout, True)
        layer_in = layer_out
    h_n = torch.stack(h_last)
    c_n = torch.stack(c_last) if c0 is not None else None
    return layer_in, h_n, c_n


def _lstm_module_forward(self: nn.LSTM, input, hx=None):
    """``nn.LSTM.forward`` via hoisted input GEMMs and ``autopar::lstm_cell`` steps."""
    _reject_packed("LSTM", input)
    if input.dim() not in (2, 3):
        raise ValueError(f"LSTM: Expected input to be 2D or 3D, got {input.dim()}D instead")
    batched = input.dim() == 3
    batch_dim = 0 if self.batch_first else 1
    if not batched:
        input = input.unsqueeze(batch_dim)
    num_dirs = 2 if self.bidirectional else 1
    real_hidden = self.proj_size if self.proj_size > 0 else self.hidden_size
    if hx is None:
        batch = input.size(batch_dim)
        shape = (self.num_layers * num_dirs, batch)
        hx = (input.new_zeros(*shape, real_hidden), input.new_zeros(*shape, self.hidden_size))
    else:
        want = 3 if batched else 2
        if hx[0].dim() != want or hx[1].dim() != want:
            kind = "batched 3-D" if batched else "unbatched 2-D"
            raise RuntimeError(
                f"For {kind} input, hx and cx should also be {want}-D but got "
                f"({hx[0].dim()}-D, {hx[1].dim()}-D) tensors"
            )
        if not batched:
            hx = (hx[0].unsqueeze(1), hx[1].unsqueeze(1))
    self.check_forward_args(input, hx, None)
    out, h_n, c_n = _run_rnn(self, input, hx[0], hx[1], batch_major=self.batch_first)
    if self.batch_first:
        out = out.transpose(0, 1)
    if not batched:
        return out.squeeze(batch_dim), (h_n.squeeze(1), c_n.squeeze(1))
    return out, (h_n, c_n)


def _gru_module_forward(self: nn.GRU, input, hx=None):
    """``nn.GRU.forward`` via hoisted input GEMMs and ``autopar::gru_cell`` steps."""
    _reject_packed("GRU", input)
    if input.dim() not in (2, 3):
        raise ValueError(f"GRU: Expected input to be 2D or 3D, got {input.dim()}D instead")
    batched = input.dim() == 3
    batch_dim = 0 if self.batch_first else 1
    if not batched:
        input = input.unsqueeze(batch_dim)
        if hx is not None:
            if hx.dim() != 2:
                raise RuntimeError(
                    f"For unbatched 2-D input, hx should also be 2-D but got {hx.dim()}-D tensor"
                )
            hx = hx.unsqueeze(1)
    elif hx is not None and hx.dim() != 3:
        raise RuntimeError(
            f"For batched 3-D input, hx should also be 3-D but got {hx.dim()}-D tensor"
        )
    if hx is None:
        num_dirs = 2 if self.bidirectional else 1
        hx = input.new_zeros(self.num_layers * num_dirs, input.size(batch_dim), self.hidden_size)
    self.check_forward_args(input, hx, None)
    out, h_n, _ = _run_rnn(self, input, hx, None, batch_major=self.batch_first)
    if self.batch_first:
        out = out.transpose(0, 1)
    if not batched:
        return out.squeeze(batch_dim), h_n.squeeze(1)
    return out, h_n


# --------------------------------------------------------------------------- the rewrite

# Subclasses first would not matter: the four types are unrelated to each other.
_FORWARDS = (
    (nn.LSTMCell, _lstm_cell_module_forward),
    (nn.GRUCell, _gru_cell_module_forward),
    (nn.LSTM, _lstm_module_forward),
    (nn.GRU, _gru_module_forward),
)


def _replacement(module: nn.Module):
    for kind, fn in _FORWARDS:
        if isinstance(module, kind):
            return fn
    return None


@contextlib.contextmanager
def rewrite_rnns(model: nn.Module) -> Iterator[list[str]]:
    """Route every LSTM/GRU (cell) submodule of ``model`` through autopar's custom-op form.

    While active, each ``nn.LSTMCell``, ``nn.GRUCell``, ``nn.LSTM`` and ``nn.GRU`` in
    ``model`` (``model`` itself included) runs an equivalent forward built from
    ``F.linear`` GEMMs and the ``autopar::lstm_cell`` / ``autopar::gru_cell`` custom ops,
    reading the module's own Parameters (no copies: ``state_dict()``, ``parameters()`` and
    the user's optimizer are untouched). On exit the modules are exactly as before.
    Yields the qualified names of the rewritten modules.

    Mechanism: an instance attribute ``forward`` (a bound method of the module) shadows
    the class's ``forward`` and is deleted on exit. Dynamo guards on the underlying
    function and module, so re-entering the context does not recompile.

    Example::

        model = nn.Sequential(nn.LSTM(8, 16, num_layers=2))
        with rewrite_rnns(model) as names:          # names == ["0"]
            out, (h, c) = model(torch.randn(5, 3, 8))
            out.sum().backward()                    # grads land in model's Parameters
    """
    if not isinstance(model, nn.Module):
        raise CaptureError(
            f"autopar.rnn.rewrite_rnns expects an nn.Module, got {type(model).__name__}."
        )
    patched: list[tuple[str, nn.Module]] = []
    # Dynamo refuses to trace nn.LSTM/GRU/RNN modules unless allow_rnn is set (their eager
    # forward calls _VF.lstm, which AOTAutograd cannot handle); the rewritten forward is
    # plain traceable Python, so allow it while the rewrite is active.
    with torch._dynamo.config.patch(allow_rnn=True):
        try:
            for name, module in model.named_modules():
                fn = _replacement(module)
                if fn is None:
                    continue
                current = module.__dict__.get("forward")
                if getattr(current, "__func__", None) is fn:
                    continue  # an enclosing rewrite_rnns routes it already and will restore it
                if current is not None:
                    raise CaptureError(
                        f"autopar: module {name or type(module).__name__!r} "
                        f"({type(module).__name__}) has an instance attribute 'forward' (a "
                        "user patch); autopar will not override it. Remove the patch, or keep "
                        'RNNs eager with autopar.compile(..., rnn="eager").'
                    )
                module.forward = types.MethodType(fn, module)
                patched.append((name, module))
            yield [name for name, _ in patched]
        finally:
            for _, module in patched:
                module.__dict__.pop("forward", None)
