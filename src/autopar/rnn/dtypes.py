"""Dtypes of autopar's RNN cell ops (``rnn.cells``) under mixed precision, as eager has them.

* CPU autocast casts only the cells' gate GEMMs (``F.linear``) to its lower precision, so
  ``nn.LSTMCell`` / ``nn.GRUCell`` meet bfloat16 gates and the user's float32 state, and
  ATen's cells promote (``f * c``, ``h - n`` are float32): :func:`promoted` is that rule,
  which the cell ops apply to their inputs (results in the promoted dtype).
* CUDA autocast lists ``LSTMCell`` / ``GRUCell`` themselves as lower-precision ops: every
  floating input, the state included, is cast to autocast's dtype. On the devices of
  ``AUTOCAST_CELL_DEVICES`` the forward cell ops get that rule as their ``Autocast<device>``
  kernel (:func:`register_lower_precision_autocast`), and the eager path, which skips the
  dispatcher, casts the same way (:func:`eager_autocast`).

Example::

    >>> import torch
    >>> [t.dtype for t in promoted(torch.ones(1, dtype=torch.bfloat16), torch.ones(1))]
    [torch.float32, torch.float32]
"""

from __future__ import annotations

import torch
from torch import Tensor

from autopar import compat

__all__ = [
    "AUTOCAST_CELL_DEVICES", "common_dtype", "eager_autocast", "promoted",
    "register_lower_precision_autocast",
]  # fmt: skip


def promoted(*tensors: Tensor) -> list[Tensor]:
    """``tensors`` in their promoted dtype (ATen's rule for the cells' mixed-dtype math);
    tensors already in it are returned as they are."""
    dtype = common_dtype(*tensors)
    return [t if t.dtype == dtype else t.to(dtype) for t in tensors]


def common_dtype(*tensors: Tensor) -> torch.dtype:
    """The dtype ``promoted`` casts to."""
    dtype = tensors[0].dtype
    for t in tensors[1:]:
        dtype = torch.promote_types(dtype, t.dtype)
    return dtype


#: Devices whose autocast casts nn.LSTMCell / nn.GRUCell to its lower precision (module
#: docstring); elsewhere the cells' own promotion applies.
AUTOCAST_CELL_DEVICES = ("cuda",)


def _autocast_cast(device_type: str, args: tuple) -> tuple:
    """``args`` with every floating tensor on ``device_type`` in autocast's dtype there."""
    dtype = torch.get_autocast_dtype(device_type)
    return tuple(
        a.to(dtype)
        if isinstance(a, Tensor) and a.is_floating_point() and a.device.type == device_type
        else a
        for a in args
    )


def register_lower_precision_autocast(op, device_type: str, lib: torch.library.Library):
    """Give ``op`` autocast's lower-precision rule on ``device_type`` (as ATen registers it
    for its listed ops): under autocast, cast the floating inputs to autocast's dtype, then
    run the op with that autocast key excluded. ``torch.library.register_autocast`` casts
    to one fixed dtype instead, which would ignore ``torch.autocast(dtype=...)``. The
    kernel lives as long as ``lib``."""
    key = compat.autocast_dispatch_key(device_type)
    excluded = compat.exclude_dispatch_key(key)

    def kernel(*args):
        with excluded():
            return op(*_autocast_cast(device_type, args))

    lib.impl(op._schema.name.split("::")[-1], kernel, key)


def eager_autocast(*args: Tensor) -> tuple:
    """The eager path's version of the ``Autocast`` kernels above (it skips the dispatcher)."""
    device = args[0].device.type
    if device in AUTOCAST_CELL_DEVICES and torch.is_autocast_enabled(device):
        return _autocast_cast(device, args)
    return args
