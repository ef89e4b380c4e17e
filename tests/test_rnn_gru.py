"""autopar.rnn.gru: the one-op GRU layer (ATen's loop forward, batched-recompute backward)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from autopar.rnn.gru import fused_gru_layer, gru_layer_usable

IN, H, B, T = 5, 7, 3, 6


def _direction_params(gru: nn.GRU, d: int, bias: bool):
    sfx = "_l0" + ("_reverse" if d else "")
    names = ("weight_ih", "weight_hh", "bias_ih", "bias_hh")
    return [getattr(gru, n + sfx) if bias or n.startswith("weight") else None for n in names]


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("bidirectional", [False, True])
def test_matches_nn_gru_in_float64(bias, bidirectional):
    """Outputs, h_n and every gradient (input, h0, weights) equal nn.GRU to rounding."""
    torch.manual_seed(0)
    gru = nn.GRU(IN, H, bias=bias, bidirectional=bidirectional).double()
    dirs = 2 if bidirectional else 1
    x = torch.randn(T, B, IN, dtype=torch.float64, requires_grad=True)
    h0 = torch.randn(dirs, B, H, dtype=torch.float64, requires_grad=True)
    leaves = (x, h0, *gru.parameters())

    def loss(out, h_n):  # nonlinear in both outputs, so every path carries gradient
        return out.sin().sum() + h_n.cos().sum()

    out, h_n = gru(x, h0)
    loss(out, h_n).backward()
    ref = [t.grad.clone() for t in leaves]
    for t in leaves:
        t.grad = None
    pieces = [fused_gru_layer(x, *_direction_params(gru, d, bias), h0[d], reverse=bool(d))
              for d in range(dirs)]  # fmt: skip
    out2 = torch.cat([o for o, _ in pieces], 2)
    h_n2 = torch.stack([h for _, h in pieces])
    torch.testing.assert_close(out2, out, rtol=0, atol=1e-13)
    torch.testing.assert_close(h_n2, h_n, rtol=0, atol=1e-13)
    loss(out2, h_n2).backward()
    for t, r in zip(leaves, ref, strict=True):
        torch.testing.assert_close(t.grad, r, rtol=0, atol=1e-12)


def test_opcheck_forward_and_backward():
    """Schema, fake (meta) kernels and autograd registration agree with the real kernels."""
    torch.manual_seed(0)
    gru = nn.GRU(IN, H)
    args = (
        torch.randn(T, B, IN, requires_grad=True),
        torch.randn(B, H, requires_grad=True),
        gru.weight_ih_l0,
        gru.weight_hh_l0,
        gru.bias_ih_l0,
        gru.bias_hh_l0,
    )
    for reverse in (False, True):
        torch.library.opcheck(torch.ops.autopar.gru_layer.default, (*args, reverse))
    out, _ = torch.ops.autopar.gru_layer(*args, False)
    grads = (torch.randn(T, B, H), torch.randn(B, H))
    bw_args = (*grads, *[a.detach() for a in args], out.detach(), True)
    torch.library.opcheck(torch.ops.autopar.gru_layer_backward.default, bw_args)


def test_chunks_chain_the_state_exactly():
    """Two chunks with h carried across equal one call (what the chunked form relies on)."""
    torch.manual_seed(0)
    gru = nn.GRU(IN, H).double()
    x = torch.randn(T, B, IN, dtype=torch.float64)
    h0 = torch.zeros(B, H, dtype=torch.float64)
    params = _direction_params(gru, 0, True)
    whole, h_whole = fused_gru_layer(x, *params, h0)
    first, h_mid = fused_gru_layer(x[:4], *params, h0)
    second, h_end = fused_gru_layer(x[4:], *params, h_mid)
    torch.testing.assert_close(torch.cat([first, second]), whole, rtol=0, atol=1e-14)
    torch.testing.assert_close(h_end, h_whole, rtol=0, atol=1e-14)


def test_bad_shapes_are_named_and_usability():
    gru = nn.GRU(IN, H)
    with pytest.raises(ValueError, match=r"autopar::gru_layer: expected x \[T, B, I\]"):
        fused_gru_layer(torch.randn(T, B, IN + 1), *_direction_params(gru, 0, True),
                        torch.zeros(B, H))  # fmt: skip
    assert gru_layer_usable(torch.zeros(2), torch.zeros(2, dtype=torch.float32))
    assert not gru_layer_usable(torch.zeros(2), torch.zeros(2, dtype=torch.float64))
    assert not gru_layer_usable(torch.zeros(0))
    assert not gru_layer_usable(torch.zeros(2, dtype=torch.int64))
