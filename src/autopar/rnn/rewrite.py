"""The rewrite: route a model's nn.LSTM / nn.GRU / cells through autopar's custom-op forms
for as long as a ``with rewrite_rnns(model):`` block runs (nothing stays patched after it).

Example::

    model = nn.Sequential(nn.LSTM(8, 16, num_layers=2))
    with rewrite_rnns(model) as names:          # names == ["0"]
        out, (h, c) = model(torch.randn(5, 3, 8))
"""

from __future__ import annotations

import contextlib
import os
import types
from collections.abc import Iterator

import torch.nn.functional as F
from torch import Tensor, nn

from autopar import compat
from autopar.errors import CaptureError
from autopar.rnn import layers as rnn_layers
from autopar.rnn.cells import _gru_pointwise, _lstm_pointwise
from autopar.rnn.layers import gru_module_forward, lstm_module_forward

__all__ = ["rewrite_rnns"]


# The cells' forwards: nn.LSTMCell / nn.GRUCell's checks and GEMMs, the pointwise part as
# autopar's cell ops (rnn.cells; mixed dtypes under autocast are promoted there, as ATen does).
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


def _replacement(module: nn.Module):
    forwards = (
        (nn.LSTMCell, _lstm_cell_module_forward),
        (nn.GRUCell, _gru_cell_module_forward),
        (nn.LSTM, lstm_module_forward),
        (nn.GRU, gru_module_forward),
    )
    for kind, fn in forwards:
        if isinstance(module, kind):
            return fn
    return None


@contextlib.contextmanager
def rewrite_rnns(model: nn.Module, *, rnn_form: str | None = None) -> Iterator[list[str]]:
    """Route every LSTM/GRU (cell) submodule of ``model`` through autopar's custom-op form.

    While active, each ``nn.LSTMCell``, ``nn.GRUCell``, ``nn.LSTM`` and ``nn.GRU`` in
    ``model`` (``model`` itself included) runs an equivalent forward built from
    ``F.linear`` GEMMs and the ``autopar::lstm_cell`` / ``autopar::gru_cell`` custom ops,
    reading the module's own Parameters (no copies: ``state_dict()``, ``parameters()`` and
    the user's optimizer are untouched). On exit the modules are exactly as before.
    Yields the qualified names of the rewritten modules.

    ``nn.LSTM`` and ``nn.GRU`` run in one of :data:`RNN_FORMS` (``autopar.rnn.layers``):
    ``"unrolled"`` (per-step cell ops), ``"fused"`` (one :func:`fused_lstm_layer` or
    ``fused_gru_layer`` per layer and direction) or ``"chunked"`` (fused calls over k time
    chunks, a layer x time wavefront). By default each module's form is chosen from
    measurements at its first call per input shape; ``rnn_form=`` (or env
    ``AUTOPAR_RNN_FORM``; ``"chunked:4"`` fixes k) forces one.
    The fused GRU layer is :mod:`autopar.rnn.gru` (oneDNN has no CPU GRU layer in ATen).

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
            f"autopar.rnn.rewrite.rewrite_rnns expects an nn.Module, got {type(model).__name__}."
        )
    form = rnn_form if rnn_form is not None else os.environ.get("AUTOPAR_RNN_FORM") or None
    if form is not None:
        rnn_layers.parse_form(form)  # a clear error for a bad name, before anything runs
    patched: list[tuple[str, nn.Module]] = []
    saved_form = rnn_layers.form_override
    if form is not None:  # else keep an enclosing context's override
        rnn_layers.form_override = form
    # Dynamo refuses to trace nn.LSTM/GRU/RNN modules unless allow_rnn is set (their eager
    # forward calls _VF.lstm, which AOTAutograd cannot handle); the rewritten forward is
    # plain traceable Python, so allow it while the rewrite is active.
    with compat.dynamo_config().patch(allow_rnn=True):
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
            rnn_layers.form_override = saved_form
            for _, module in patched:
                module.__dict__.pop("forward", None)
