"""The bodies of the nn.LSTM / nn.GRU forms: fused or chunked layer ops (``_run_fused``) and
the unrolled recurrence (``_run_rnn``), on the module's own Parameters. ``layers`` picks the
form; ``choice`` times these same bodies to choose.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.utils.rnn import PackedSequence

from autopar.errors import CaptureError
from autopar.rnn.cells import _gru_pointwise, _lstm_pointwise, fused_lstm_layer
from autopar.rnn.gru import fused_gru_layer


def _run_fused(self: nn.RNNBase, x: Tensor, h0: Tensor, c0: Tensor | None, chunks: int):
    """Fused (``chunks == 1``) or chunked form; ``x`` is time-major [T, B, I].

    ``c0 is None`` means GRU. Returns (output [T, B, D*H], h_n, c_n or None)."""
    num_dirs = 2 if self.bidirectional else 1
    train = torch.is_grad_enabled()
    layer_in = list(x.contiguous().chunk(chunks)) if chunks > 1 else [x]
    n = len(layer_in)
    h_last, c_last = [], []
    for layer in range(self.num_layers):
        outs: list[list] = [[None] * n for _ in range(num_dirs)]
        for d in range(num_dirs):
            w_ih, w_hh, b_ih, b_hh, _ = _layer_params(self, layer, d)
            h = h0[layer * num_dirs + d]
            c = None if c0 is None else c0[layer * num_dirs + d]
            for j in range(n - 1, -1, -1) if d else range(n):
                if c is None:
                    outs[d][j], h = fused_gru_layer(
                        layer_in[j], w_ih, w_hh, b_ih, b_hh, h, reverse=bool(d)
                    )
                else:
                    outs[d][j], h, c = fused_lstm_layer(
                        layer_in[j], w_ih, w_hh, b_ih, b_hh, h, c, reverse=bool(d), train=train
                    )
            h_last.append(h)
            c_last.append(c)
        layer_in = [o[0] if num_dirs == 1 else torch.cat(o, dim=2) for o in zip(*outs, strict=True)]
        if self.dropout and self.training and layer < self.num_layers - 1:
            # One F.dropout on the whole layer output, as ATen's loop: same RNG use.
            full = layer_in[0] if n == 1 else torch.cat(layer_in)
            full = F.dropout(full, self.dropout, True)
            layer_in = list(full.split([t.size(0) for t in layer_in])) if n > 1 else [full]
    out = layer_in[0] if n == 1 else torch.cat(layer_in)
    return out, torch.stack(h_last), None if c0 is None else torch.stack(c_last)


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
