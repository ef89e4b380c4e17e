"""Triton kernels for the pointwise part of LSTM and GRU cells, forward and backward.

The custom ops in :mod:`autopar.rnn.cells` call these wrappers when their tensors are on CUDA.
Layouts follow PyTorch: LSTM gates are chunks ``(i, f, g, o)`` of a ``4*H`` last dimension,
GRU gates ``(r, z, n)`` of ``3*H``; ``hgates`` includes ``b_hh``. Every kernel works on the
flattened ``[rows, H]`` element space: one program handles ``BLOCK`` consecutive
``(row, col)`` elements and reads that element's gates at ``row*nH + k*H + col``.
Math runs in fp32 whatever the storage dtype (fp16/bf16 inputs are upcast on load).

The wrappers also run on CPU tensors under ``TRITON_INTERPRET=1`` (that is how they are
tested without a GPU).

Example::

    h, c_new = lstm_cell_forward(igates, hgates, c)              # CUDA tensors
    grad_gates, grad_c = lstm_cell_backward(gh, gc, igates, hgates, c)
"""

from __future__ import annotations

import contextlib

import torch
import triton
import triton.language as tl
from torch import Tensor

__all__ = [
    "lstm_cell_forward",
    "lstm_cell_backward",
    "gru_cell_forward",
    "gru_cell_backward",
]

_BLOCK = 1024


@triton.jit
def _tanh(x):
    # tanh(x) = sign(x) * (1 - e) / (1 + e), e = exp(-2|x|): never overflows, and the
    # absolute error stays ~1 ulp of 1.0. (libdevice.tanh would be marginally more precise
    # for tiny |x| but is not available in the CPU interpreter we test with.)
    e = tl.exp(-2.0 * tl.abs(x))
    t = (1.0 - e) / (1.0 + e)
    return tl.where(x < 0, -t, t)


@triton.jit
def _sigmoid(x):
    return 1.0 / (1.0 + tl.exp(-x))


@triton.jit
def _elements(total, hidden, BLOCK: tl.constexpr):
    """This program's element offsets, their mask, and (row, col) in the [rows, H] space."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < total
    return offs, mask, offs // hidden, offs % hidden


@triton.jit
def _lstm_fwd_kernel(ig, hg, c, h_out, c_out, total, hidden, BLOCK: tl.constexpr):
    offs, mask, row, col = _elements(total, hidden, BLOCK)
    gi = row * 4 * hidden + col
    pre_i = tl.load(ig + gi, mask=mask).to(tl.float32) + tl.load(hg + gi, mask=mask)
    gf = gi + hidden
    pre_f = tl.load(ig + gf, mask=mask).to(tl.float32) + tl.load(hg + gf, mask=mask)
    gg = gf + hidden
    pre_g = tl.load(ig + gg, mask=mask).to(tl.float32) + tl.load(hg + gg, mask=mask)
    go = gg + hidden
    pre_o = tl.load(ig + go, mask=mask).to(tl.float32) + tl.load(hg + go, mask=mask)
    c_prev = tl.load(c + offs, mask=mask).to(tl.float32)
    c_new = _sigmoid(pre_f) * c_prev + _sigmoid(pre_i) * _tanh(pre_g)
    h = _sigmoid(pre_o) * _tanh(c_new)
    tl.store(c_out + offs, c_new.to(c_out.dtype.element_ty), mask=mask)
    tl.store(h_out + offs, h.to(h_out.dtype.element_ty), mask=mask)


@triton.jit
def _lstm_bwd_kernel(
    grad_h, grad_c, ig, hg, c, grad_gates, grad_c_prev, total, hidden, BLOCK: tl.constexpr
):
    offs, mask, row, col = _elements(total, hidden, BLOCK)
    gi = row * 4 * hidden + col
    gf = gi + hidden
    gg = gf + hidden
    go = gg + hidden
    i = _sigmoid(tl.load(ig + gi, mask=mask).to(tl.float32) + tl.load(hg + gi, mask=mask))
    f = _sigmoid(tl.load(ig + gf, mask=mask).to(tl.float32) + tl.load(hg + gf, mask=mask))
    g = _tanh(tl.load(ig + gg, mask=mask).to(tl.float32) + tl.load(hg + gg, mask=mask))
    o = _sigmoid(tl.load(ig + go, mask=mask).to(tl.float32) + tl.load(hg + go, mask=mask))
    c_prev = tl.load(c + offs, mask=mask).to(tl.float32)
    dh = tl.load(grad_h + offs, mask=mask).to(tl.float32)
    tanh_c = _tanh(f * c_prev + i * g)
    # Total gradient of c_new: directly and through h = o * tanh(c_new).
    dc = tl.load(grad_c + offs, mask=mask).to(tl.float32) + dh * o * (1.0 - tanh_c * tanh_c)
    ty = grad_gates.dtype.element_ty
    tl.store(grad_gates + gi, (dc * g * i * (1.0 - i)).to(ty), mask=mask)
    tl.store(grad_gates + gf, (dc * c_prev * f * (1.0 - f)).to(ty), mask=mask)
    tl.store(grad_gates + gg, (dc * i * (1.0 - g * g)).to(ty), mask=mask)
    tl.store(grad_gates + go, (dh * tanh_c * o * (1.0 - o)).to(ty), mask=mask)
    tl.store(grad_c_prev + offs, (dc * f).to(grad_c_prev.dtype.element_ty), mask=mask)


@triton.jit
def _gru_fwd_kernel(ig, hg, h, h_out, total, hidden, BLOCK: tl.constexpr):
    offs, mask, row, col = _elements(total, hidden, BLOCK)
    gr = row * 3 * hidden + col
    gz = gr + hidden
    gn = gz + hidden
    r = _sigmoid(tl.load(ig + gr, mask=mask).to(tl.float32) + tl.load(hg + gr, mask=mask))
    z = _sigmoid(tl.load(ig + gz, mask=mask).to(tl.float32) + tl.load(hg + gz, mask=mask))
    # b_hn sits inside hg, so it is scaled by r like in PyTorch.
    hn = tl.load(hg + gn, mask=mask).to(tl.float32)
    n = _tanh(tl.load(ig + gn, mask=mask).to(tl.float32) + r * hn)
    h_prev = tl.load(h + offs, mask=mask).to(tl.float32)
    tl.store(h_out + offs, (n + z * (h_prev - n)).to(h_out.dtype.element_ty), mask=mask)


@triton.jit
def _gru_bwd_kernel(
    grad_hy, ig, hg, h, grad_ig, grad_hg, grad_h, total, hidden, BLOCK: tl.constexpr
):
    offs, mask, row, col = _elements(total, hidden, BLOCK)
    gr = row * 3 * hidden + col
    gz = gr + hidden
    gn = gz + hidden
    r = _sigmoid(tl.load(ig + gr, mask=mask).to(tl.float32) + tl.load(hg + gr, mask=mask))
    z = _sigmoid(tl.load(ig + gz, mask=mask).to(tl.float32) + tl.load(hg + gz, mask=mask))
    hn = tl.load(hg + gn, mask=mask).to(tl.float32)
    n = _tanh(tl.load(ig + gn, mask=mask).to(tl.float32) + r * hn)
    h_prev = tl.load(h + offs, mask=mask).to(tl.float32)
    dy = tl.load(grad_hy + offs, mask=mask).to(tl.float32)
    d_n = dy * (1.0 - z) * (1.0 - n * n)
    d_z = dy * (h_prev - n) * z * (1.0 - z)
    d_r = d_n * hn * r * (1.0 - r)
    ty = grad_ig.dtype.element_ty
    tl.store(grad_ig + gr, d_r.to(ty), mask=mask)
    tl.store(grad_ig + gz, d_z.to(ty), mask=mask)
    tl.store(grad_ig + gn, d_n.to(ty), mask=mask)
    tl.store(grad_hg + gr, d_r.to(ty), mask=mask)
    tl.store(grad_hg + gz, d_z.to(ty), mask=mask)
    tl.store(grad_hg + gn, (d_n * r).to(ty), mask=mask)
    tl.store(grad_h + offs, (dy * z).to(grad_h.dtype.element_ty), mask=mask)


# --------------------------------------------------------------------------- wrappers


def _prepare(name: str, n: int, igates: Tensor, hgates: Tensor, state: Tensor, *more: Tensor):
    """Check shapes, make everything contiguous; returns (tensors, rows*H, H)."""
    hidden = state.shape[-1]
    if (
        igates.shape != hgates.shape
        or igates.shape[-1] != n * hidden
        or igates.shape[:-1] != state.shape[:-1]
        or any(t.shape != state.shape for t in more)
    ):
        raise ValueError(
            f"autopar.runtime.kernels.triton_cells.{name}: expected igates/hgates [..., {n}*H] and "
            f"state/grads [..., H] with equal leading dims; got igates "
            f"{tuple(igates.shape)}, hgates {tuple(hgates.shape)}, state {tuple(state.shape)}, "
            f"others {[tuple(t.shape) for t in more]}."
        )
    devices = {t.device for t in (igates, hgates, state, *more)}
    if len(devices) > 1:
        raise ValueError(
            f"autopar.runtime.kernels.triton_cells.{name}: tensors are on several devices "
            f"{sorted(map(str, devices))}; move them to one device."
        )
    tensors = [t.contiguous() for t in (igates, hgates, state, *more)]
    return tensors, state.numel(), hidden


def _grid(total: int):
    return (max(1, triton.cdiv(total, _BLOCK)),)


def launch_guard(t: Tensor):
    """The device context a kernel on ``t`` is launched in: ``torch.cuda.device(t.device)``.

    Triton launches on the *current* CUDA device (and its current stream), not on the
    device of the pointers it is given: without this an LSTM on cuda:1 would launch on
    cuda:0 and read memory of another device. CPU tensors (the interpreter) need none.
    """
    return torch.cuda.device(t.device) if t.is_cuda else contextlib.nullcontext()


def lstm_cell_forward(igates: Tensor, hgates: Tensor, c: Tensor) -> tuple[Tensor, Tensor]:
    """``(h, c_new)`` of an LSTM cell from pre-activation gates (see ``autopar::lstm_cell``).

    Example::

        h, c_new = lstm_cell_forward(x @ W_ih.T + b_ih, h @ W_hh.T + b_hh, c)
    """
    (ig, hg, c), total, hidden = _prepare("lstm_cell_forward", 4, igates, hgates, c)
    h_out, c_out = torch.empty_like(c), torch.empty_like(c)
    if total:
        with launch_guard(c):
            _lstm_fwd_kernel[_grid(total)](ig, hg, c, h_out, c_out, total, hidden, BLOCK=_BLOCK)
    return h_out, c_out


def lstm_cell_backward(
    grad_h: Tensor, grad_c: Tensor, igates: Tensor, hgates: Tensor, c: Tensor
) -> tuple[Tensor, Tensor]:
    """``(grad_gates, grad_c_prev)`` of :func:`lstm_cell_forward`; activations recomputed.

    Example::

        grad_gates, grad_c_prev = lstm_cell_backward(gh, gc, igates, hgates, c)
    """
    (ig, hg, c, gh, gc), total, hidden = _prepare(
        "lstm_cell_backward", 4, igates, hgates, c, grad_h, grad_c
    )
    grad_gates, grad_c_prev = torch.empty_like(ig), torch.empty_like(c)
    if total:
        with launch_guard(c):
            _lstm_bwd_kernel[_grid(total)](
                gh, gc, ig, hg, c, grad_gates, grad_c_prev, total, hidden, BLOCK=_BLOCK
            )
    return grad_gates, grad_c_prev


def gru_cell_forward(igates: Tensor, hgates: Tensor, h: Tensor) -> Tensor:
    """``h_new`` of a GRU cell from pre-activation gates (see ``autopar::gru_cell``).

    Example::

        h_new = gru_cell_forward(x @ W_ih.T + b_ih, h @ W_hh.T + b_hh, h)
    """
    (ig, hg, h), total, hidden = _prepare("gru_cell_forward", 3, igates, hgates, h)
    h_out = torch.empty_like(h)
    if total:
        with launch_guard(h):
            _gru_fwd_kernel[_grid(total)](ig, hg, h, h_out, total, hidden, BLOCK=_BLOCK)
    return h_out


def gru_cell_backward(
    grad_h_new: Tensor, igates: Tensor, hgates: Tensor, h: Tensor
) -> tuple[Tensor, Tensor, Tensor]:
    """``(grad_igates, grad_hgates, grad_h)`` of :func:`gru_cell_forward`.

    Example::

        gi, gh, gprev = gru_cell_backward(grad, igates, hgates, h)
    """
    (ig, hg, h, gy), total, hidden = _prepare("gru_cell_backward", 3, igates, hgates, h, grad_h_new)
    grad_ig, grad_hg, grad_h = torch.empty_like(ig), torch.empty_like(ig), torch.empty_like(h)
    if total:
        with launch_guard(h):
            _gru_bwd_kernel[_grid(total)](
                gy, ig, hg, h, grad_ig, grad_hg, grad_h, total, hidden, BLOCK=_BLOCK
            )
    return grad_ig, grad_hg, grad_h
