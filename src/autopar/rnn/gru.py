"""One GRU layer (one direction, a whole sequence or a time chunk) as ONE op, forward and back.

ATen has no fused GRU layer on CPU (oneDNN's ``mkldnn_rnn_layer`` rejects GRU mode there), so
eager ``nn.GRU`` runs ATen's C++ loop of small ops per step and its backward through the
autograd engine, ~25 nodes per step. Here:

``autopar::gru_layer`` (forward)
    ``torch._VF.gru`` for one layer -- the very loop eager ``nn.GRU`` runs (input GEMM
    hoisted over all steps, then per step one GEMM and the gate ops, all in C++ with the GIL
    released) -- called outside autograd, so nothing is recorded. ``W_hh`` is handed over
    column-major: ATen computes ``h @ W_hh^T`` per step and a ``[16, 256] x [256, 768]``
    GEMM measured 44 us with ``W_hh^T`` row-major against 85 us through the transposed view
    (this box, MKL); the copy is one per call.
``autopar::gru_layer_backward``
    recomputes the gates of ALL steps at once from the saved outputs (``h_{t-1}`` is
    ``out[t-1]``): two big GEMMs and a handful of pointwise ops over ``[T, B, 3H]``. What
    the reverse-time recurrence needs per step then folds into one precomputed factor
    ``M_t = d(hgates_t)/d(h_t)`` (elementwise), so each step is four small ops::

        dh += grad_out[t];  dgh_t = dh * M_t;  dh = dh * z_t + dgh_t @ W_hh

    and the weight gradients are three big GEMMs over all steps after the loop.
    ``dgi_t`` equals ``dgh_t`` except in the n block (``dh * (1-z)(1-n^2)``: the ``r``
    factor multiplies only the hidden side).

Gate algebra (PyTorch's GRU): ``r, z = sigmoid(gi_rz + gh_rz)``,
``n = tanh(gi_n + r * gh_n)``, ``h' = n + z * (h - n)``; so with ``a = (1-z)(1-n^2)``:
``dgh_r = dh * a * gh_n * r(1-r)``, ``dgh_z = dh * (h-n) * z(1-z)``, ``dgh_n = dh * a * r``.

Measured on this 2-core box (4-layer GRU, input 64, 32 steps, batch 16, a training step
through ``autopar.compile``; ``benchmarks/bench_lstm.py --config gru``): 1.29x eager
``nn.GRU`` at hidden 256, 1.39x at 128, 1.26x bidirectional (2 x 256); gradients equal
``nn.GRU``'s to 1e-12 in float64 (``tests/test_rnn_gru.py``).

Example::

    out, h_n = fused_gru_layer(x, gru.weight_ih_l0, gru.weight_hh_l0,
                               gru.bias_ih_l0, gru.bias_hh_l0, h0)   # == gru(x, h0[None])
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from autopar import compat

__all__ = ["fused_gru_layer", "gru_layer_usable"]


def gru_layer_usable(*tensors: Tensor | None) -> bool:
    """CPU floating-point tensors of one dtype (CUDA keeps the Triton cell kernels)."""
    ts = [t for t in tensors if t is not None]
    if not ts or ts[0].numel() == 0 or not ts[0].is_floating_point():
        return False
    return all(t.dtype == ts[0].dtype and t.device.type == "cpu" for t in ts)


def _check(x: Tensor, h0: Tensor, w_ih: Tensor, w_hh: Tensor) -> None:
    hidden = h0.size(-1)
    ok = (
        x.dim() == 3
        and h0.dim() == 2
        and x.size(1) == h0.size(0)
        and w_ih.shape == (3 * hidden, x.size(2))
        and w_hh.shape == (3 * hidden, hidden)
    )
    if not ok:
        raise ValueError(
            "autopar::gru_layer: expected x [T, B, I], h0 [B, H], w_ih [3H, I], w_hh [3H, H]; "
            f"got x {tuple(x.shape)}, h0 {tuple(h0.shape)}, w_ih {tuple(w_ih.shape)}, "
            f"w_hh {tuple(w_hh.shape)}"
        )


@torch.library.custom_op("autopar::gru_layer", mutates_args=())
def _gru_layer(
    x: Tensor,
    h0: Tensor,
    w_ih: Tensor,
    w_hh: Tensor,
    b_ih: Tensor | None,
    b_hh: Tensor | None,
    reverse: bool,
) -> tuple[Tensor, Tensor]:
    """``(out [T, B, H], h_n [B, H])`` of one GRU layer and direction (see the module doc)."""
    _check(x, h0, w_ih, w_hh)
    xs = x.flip(0) if reverse else x
    w_hh_cm = w_hh.t().contiguous().t()  # column-major: the fast per-step GEMM (module doc)
    params = (w_ih, w_hh_cm) if b_ih is None else (w_ih, w_hh_cm, b_ih, b_hh)
    with torch.no_grad():  # args: has_biases, layers, dropout, train, bidirectional, batch_first
        out, h_n = compat.vf_gru(xs, h0.unsqueeze(0), params, b_ih is not None, 1, 0.0, False,
                                 False, False)  # fmt: skip
    return (out.flip(0) if reverse else out), h_n[0].clone()


@_gru_layer.register_fake
def _(x, h0, w_ih, w_hh, b_ih, b_hh, reverse):
    _check(x, h0, w_ih, w_hh)
    return x.new_empty(x.size(0), x.size(1), h0.size(-1)), h0.new_empty(h0.shape)


@torch.library.custom_op("autopar::gru_layer_backward", mutates_args=())
def _gru_layer_backward(
    grad_out: Tensor,
    grad_hn: Tensor,
    x: Tensor,
    h0: Tensor,
    w_ih: Tensor,
    w_hh: Tensor,
    b_ih: Tensor | None,
    b_hh: Tensor | None,
    out: Tensor,
    reverse: bool,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """``(dx, dh0, dw_ih, dw_hh, db_ih, db_hh)``; zero bias grads when there are no biases."""
    if reverse:
        x, out, grad_out = x.flip(0), out.flip(0), grad_out.flip(0)
    steps, batch, hidden = out.shape
    hprev = torch.cat([h0.unsqueeze(0), out[:-1]])
    gi = F.linear(x, w_ih, b_ih).view(steps, batch, 3, hidden)
    gh = F.linear(hprev, w_hh, b_hh).view(steps, batch, 3, hidden)
    rz = torch.add(gi[:, :, :2], gh[:, :, :2]).sigmoid_()
    r, z = rz.unbind(2)
    gh_n = gh[:, :, 2]
    n = torch.addcmul(gi[:, :, 2], r, gh_n).tanh_()
    a = (1 - z) * (1 - n * n)
    factor = torch.stack([a * gh_n * r * (1 - r), (hprev - n) * z * (1 - z), a * r], 2)
    dhs = torch.empty_like(out)  # dL/dh_t, all steps (for the batched gradients below)
    dh = grad_hn.clone()
    go_t, z_t, f_t = grad_out.unbind(0), z.unbind(0), factor.unbind(0)
    for t in range(steps - 1, -1, -1):
        dh = dh.add_(go_t[t])
        dhs[t] = dh
        dgh = (dh.unsqueeze(1) * f_t[t]).view(batch, 3 * hidden)
        dh = torch.addmm(dh * z_t[t], dgh, w_hh)
    dgh = (dhs.unsqueeze(2) * factor).view(steps * batch, 3 * hidden)
    dgi = dgh.clone()
    dgi.view(steps, batch, 3, hidden)[:, :, 2] = dhs * a
    x2 = x.reshape(steps * batch, -1)
    dx = dgi.mm(w_ih).view(steps, batch, -1)
    dw_ih = dgi.t().mm(x2)
    dw_hh = dgh.t().mm(hprev.reshape(steps * batch, hidden))
    db_ih, db_hh = dgi.sum(0), dgh.sum(0)
    return (dx.flip(0) if reverse else dx), dh, dw_ih, dw_hh, db_ih, db_hh


@_gru_layer_backward.register_fake
def _(grad_out, grad_hn, x, h0, w_ih, w_hh, b_ih, b_hh, out, reverse):
    three_h = w_hh.size(0)
    return (
        x.new_empty(x.shape),
        h0.new_empty(h0.shape),
        w_ih.new_empty(w_ih.shape),
        w_hh.new_empty(w_hh.shape),
        w_hh.new_empty(three_h),
        w_hh.new_empty(three_h),
    )


def _setup_context(ctx, inputs, output) -> None:
    x, h0, w_ih, w_hh, b_ih, b_hh, reverse = inputs
    ctx.reverse = reverse
    ctx.has_bias = b_ih is not None
    ctx.save_for_backward(x, h0, w_ih, w_hh, b_ih, b_hh, output[0])


def _backward(ctx, grad_out, grad_hn):
    x, h0, w_ih, w_hh, b_ih, b_hh, out = ctx.saved_tensors
    grad_out = torch.zeros_like(out) if grad_out is None else grad_out.contiguous()
    grad_hn = torch.zeros_like(h0) if grad_hn is None else grad_hn.contiguous()
    grads = torch.ops.autopar.gru_layer_backward(
        grad_out, grad_hn, x, h0, w_ih, w_hh, b_ih, b_hh, out, ctx.reverse
    )
    need = ctx.needs_input_grad
    keep = [need[i] and (i < 4 or ctx.has_bias) for i in range(6)]
    return (*(g if k else None for g, k in zip(grads, keep, strict=True)), None)


_gru_layer.register_autograd(_backward, setup_context=_setup_context)


def fused_gru_layer(
    x: Tensor,
    w_ih: Tensor,
    w_hh: Tensor,
    b_ih: Tensor | None,
    b_hh: Tensor | None,
    h0: Tensor,
    *,
    reverse: bool = False,
) -> tuple[Tensor, Tensor]:
    """One GRU layer and direction over ``x [T, B, I]`` from ``h0 [B, H]``: ``(out, h_n)``.

    ``reverse`` runs from ``t = T-1`` down to 0 (nn.GRU's reverse direction). Equal to
    ``nn.GRU`` within fp32 rounding (same ATen loop; only the GEMM kernel differs).

    Example::

        out, h = fused_gru_layer(x, gru.weight_ih_l0, gru.weight_hh_l0,
                                 gru.bias_ih_l0, gru.bias_hh_l0, torch.zeros(B, H))
    """
    return torch.ops.autopar.gru_layer(x.contiguous(), h0.contiguous(), w_ih, w_hh, b_ih, b_hh,
                                       reverse)  # fmt: skip
