"""``nn.LSTM`` / ``nn.GRU`` under ``rewrite_rnns``: three forms and the choice.

Forms (all read the module's own Parameters):

``unrolled``
    per layer and direction one input GEMM over all steps, then per step one ``F.linear``
    and one ``autopar::lstm_cell`` / ``autopar::gru_cell`` (many small nodes; the planner
    sees every step).
``fused``
    per layer and direction ONE layer op: :func:`autopar.rnn.cells.fused_lstm_layer`
    (``aten.mkldnn_rnn_layer``, what ``aten::lstm`` runs on CPU: bit-identical to eager
    ``nn.LSTM``) or :func:`autopar.rnn.gru.fused_gru_layer` (``autopar::gru_layer``: ATen's
    GRU loop forward, a batched-recompute backward; oneDNN has no CPU GRU layer). The two
    directions of a bidirectional layer are independent nodes, so the planner can run them
    concurrently on two streams.
``chunked`` (k)
    each layer's sequence split into k time chunks, one fused call per (layer, direction,
    chunk), the state (``hy``/``cy``) chained from chunk to chunk. Layer l chunk j and layer
    l+1 chunk j-1 are independent: a layer x time wavefront (FlexFlow-style) for the
    planner. Equal to ``fused`` within fp32 rounding (same kernels; only the GEMM blocking
    over time differs).

Choice (per module input shape; :mod:`autopar.rnn.choice`): each form is timed at the first
call of a shape and a list-scheduling model of the pieces predicts one and two streams;
another form must beat ``fused`` by 25%. Choices are cached in memory per shape key and
thread count and logged on the ``"autopar"`` logger. Dynamo traces the choice as a constant
(``torch._dynamo.assume_constant_result``), so the timing runs once, outside the graph.
Override: ``rewrite_rnns(model, rnn_form="fused")`` or env ``AUTOPAR_RNN_FORM`` (read when
the context is entered): ``unrolled``, ``fused``, ``chunked`` or ``chunked:<k>``.

Fallbacks: an LSTM with ``proj_size > 0`` or a device/dtype oneDNN cannot run (CUDA,
float64, ...) is always ``unrolled``; a GRU off the CPU too (CUDA runs the Triton cell
kernels); PackedSequence is rejected (as before).

Dropout (train mode, between layers): ``F.dropout`` on each layer's whole (direction-
concatenated, time-major, contiguous) output, the same call and order as ATen's RNN loop,
so masks consume the global RNG exactly like eager ``nn.LSTM``/``nn.GRU``. In the chunked
form this makes every layer a barrier (the chunks are re-split after the dropout), so the
chooser does not consider ``chunked`` when dropout is active.

Example::

    with rewrite_rnns(model, rnn_form="chunked:4"):
        out, (h, c) = model(x)
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.utils.rnn import PackedSequence

from autopar.errors import CaptureError
from autopar.rnn.cells import (
    RNN_FORMS,
    _gru_pointwise,
    _lstm_pointwise,
    fused_lstm_layer,
    mkldnn_lstm_usable,
)
from autopar.rnn.choice import RNNSpec, _name, choose_rnn_form, measure_rnn_forms
from autopar.rnn.gru import fused_gru_layer, gru_layer_usable

__all__ = [
    "clear_choices",
    "gru_module_forward",
    "lstm_module_forward",
    "parse_form",
]

log = logging.getLogger("autopar")

#: Set by ``rewrite_rnns(rnn_form=...)`` / ``AUTOPAR_RNN_FORM`` while the context is active.
form_override: str | None = None
DEFAULT_CHUNKS = 4  # k of a forced "chunked"

_CHOICES: dict[tuple, tuple[str, int]] = {}


def parse_form(form: str) -> tuple[str, int]:
    """``"fused"`` -> ("fused", 1); ``"chunked:8"`` -> ("chunked", 8); bad names raise."""
    name, _, k = str(form).strip().lower().partition(":")
    ok = name in RNN_FORMS and (not k or (name == "chunked" and k.isdigit() and int(k) >= 1))
    if not ok:
        raise ValueError(
            f"autopar: unknown RNN form {form!r}; use one of {', '.join(RNN_FORMS)} or "
            "'chunked:<k>' (rewrite_rnns(rnn_form=...) or env AUTOPAR_RNN_FORM)."
        )
    return name, (int(k) if k else DEFAULT_CHUNKS) if name == "chunked" else 1


def clear_choices() -> None:
    """Forget every measured choice (the next call of each shape measures again)."""
    _CHOICES.clear()


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


# --------------------------------------------------------------------------- the choice


@torch._dynamo.assume_constant_result
def _chosen_form(key: tuple, override: str | None) -> tuple[str, int]:
    """The form for one shape key (Dynamo runs this at trace time and bakes in the result)."""
    if override:
        return parse_form(override)
    key = (*key, torch.get_num_threads())
    hit = _CHOICES.get(key)
    if hit is None:
        spec = RNNSpec(*key[:-1])
        hit, pred = choose_rnn_form(spec, measure_rnn_forms(spec))
        _CHOICES[key] = hit
        shown = ", ".join(_name(c) + f"={t * 1e3:.1f}ms" for c, t in pred.items())
        kind = "nn.GRU" if spec.mode == "gru" else "nn.LSTM"
        log.info("autopar: %s %s: %s (predicted fw+bw: %s)", kind, spec, _name(hit), shown)
    return hit


def _rnn_form(self: nn.RNNBase, x: Tensor, h0: Tensor, c0: Tensor | None) -> tuple[str, int]:
    """The form of one call; ``c0 is None`` means GRU."""
    if c0 is None:
        usable = gru_layer_usable(x, h0, self.weight_ih_l0)
    else:
        usable = self.proj_size == 0 and mkldnn_lstm_usable(x, h0, c0, self.weight_ih_l0)
    if not usable:
        return "unrolled", 1
    batch_dim = 0 if self.batch_first else 1
    key = (
        x.size(1 - batch_dim),
        x.size(batch_dim),
        self.input_size,
        self.hidden_size,
        self.num_layers,
        2 if self.bidirectional else 1,
        bool(self.bias),
        str(x.dtype).removeprefix("torch."),
        bool(self.dropout and self.training and self.num_layers > 1),
        "lstm" if c0 is not None else "gru",
    )
    return _chosen_form(key, form_override)


# --------------------------------------------------------------------------- fused forms


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


# --------------------------------------------------------------------------- unrolled form


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


def _run_form(self: nn.RNNBase, input: Tensor, h0: Tensor, c0: Tensor | None):
    """Run the chosen form on a batched input: (time-major output, h_n, c_n or None)."""
    form, chunks = _rnn_form(self, input, h0, c0)
    if form == "unrolled":
        return _run_rnn(self, input, h0, c0, batch_major=self.batch_first)
    x = input.transpose(0, 1) if self.batch_first else input
    return _run_fused(self, x, h0, c0, chunks)


def lstm_module_forward(self: nn.LSTM, input, hx=None):
    """``nn.LSTM.forward`` in the unrolled, fused or chunked form (see the module doc)."""
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
    out, h_n, c_n = _run_form(self, input, hx[0], hx[1])
    if self.batch_first:
        out = out.transpose(0, 1)
    if not batched:
        return out.squeeze(batch_dim), (h_n.squeeze(1), c_n.squeeze(1))
    return out, (h_n, c_n)


def gru_module_forward(self: nn.GRU, input, hx=None):
    """``nn.GRU.forward`` in the unrolled, fused or chunked form (see the module doc)."""
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
    out, h_n, _ = _run_form(self, input, hx, None)
    if self.batch_first:
        out = out.transpose(0, 1)
    if not batched:
        return out.squeeze(batch_dim), h_n.squeeze(1)
    return out, h_n
