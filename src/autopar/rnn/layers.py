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
(``compat.assume_constant_result``), so the timing runs once, outside the graph.
Override: ``rewrite_rnns(model, rnn_form="fused")`` or env ``AUTOPAR_RNN_FORM`` (read when
the context is entered): ``unrolled``, ``fused``, ``chunked`` or ``chunked:<k>``.

CUDA: the module's own forward (``nn.LSTM.forward`` / ``nn.GRU.forward``: ONE fused cuDNN
call for all layers and directions, run eagerly: a graph break, see ``_cudnn_lstm``) is the
default, form ``"cudnn"``, decided without timing anything
(:func:`autopar.rnn.choice.cuda_rnn_form`); ``rnn_form="unrolled"`` forces the per-step
Triton cells (a GEMM and a cell kernel launched from Python per step). The cuDNN path also
takes a PackedSequence, as eager does.

Fallbacks (CPU): an LSTM with ``proj_size > 0`` or a dtype oneDNN cannot run (float64, ...)
is always ``unrolled``; a ``"cudnn"`` override means ``fused``; PackedSequence is rejected
(as before).

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
from torch import Tensor, nn
from torch.nn.utils.rnn import PackedSequence

from autopar import compat
from autopar.rnn.cells import RNN_FORMS, mkldnn_lstm_usable
from autopar.rnn.choice import (
    RNNSpec,
    _name,
    choose_rnn_form,
    cuda_rnn_form,
    measure_rnn_forms,
)
from autopar.rnn.forms import _reject_packed, _run_fused, _run_rnn
from autopar.rnn.gru import gru_layer_usable

__all__ = [
    "clear_choices",
    "cudnn_form",
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


# --------------------------------------------------------------------------- the choice


@compat.assume_constant_result
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


def cudnn_form(input) -> bool:
    """Whether this call runs the module's own forward (cuDNN): its input is on CUDA and no
    override forces the unrolled form (:func:`autopar.rnn.choice.cuda_rnn_form`)."""
    x = input.data if isinstance(input, PackedSequence) else input
    if not (isinstance(x, Tensor) and x.is_cuda):
        return False
    forced = parse_form(form_override)[0] if form_override else None
    return cuda_rnn_form(forced)[0] == "cudnn"


# Traced by Dynamo + AOTAutograd, aten.lstm / aten.gru are decomposed into per-step cell
# ops (torch/_decomp/decompositions.py: lstm_impl, gru_impl), which would lose cuDNN. So the
# module's own forward runs eagerly: a graph break around one fused cuDNN call (forward and
# backward), the same kernels and results as eager nn.LSTM / nn.GRU.
@compat.dynamo_disable
def _cudnn_lstm(module: nn.LSTM, input, hx):
    return nn.LSTM.forward(module, input, hx)  # the class's forward, not the instance patch


@compat.dynamo_disable
def _cudnn_gru(module: nn.GRU, input, hx):
    return nn.GRU.forward(module, input, hx)


def _run_form(self: nn.RNNBase, input: Tensor, h0: Tensor, c0: Tensor | None):
    """Run the chosen form on a batched input: (time-major output, h_n, c_n or None)."""
    form, chunks = _rnn_form(self, input, h0, c0)
    if form == "unrolled":
        return _run_rnn(self, input, h0, c0, batch_major=self.batch_first)
    x = input.transpose(0, 1) if self.batch_first else input
    return _run_fused(self, x, h0, c0, chunks)


def lstm_module_forward(self: nn.LSTM, input, hx=None):
    """``nn.LSTM.forward`` in the unrolled, fused or chunked form, or cuDNN's on CUDA
    (see the module doc)."""
    if cudnn_form(input):
        return _cudnn_lstm(self, input, hx)
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
    """``nn.GRU.forward`` in the unrolled, fused or chunked form, or cuDNN's on CUDA
    (see the module doc)."""
    if cudnn_form(input):
        return _cudnn_gru(self, input, hx)
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
