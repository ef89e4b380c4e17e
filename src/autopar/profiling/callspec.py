"""A JSON description of one operator call, enough to call it again without the graph.

The profiler stores it with each measurement (``record["call"]``), so the store can re-time
an entry on its own (``autopar store verify``, ``heal``): tensors become their metadata
(shape, dtype, strides, device, requires_grad), other arguments their value. ``rebuild`` makes
a call on fresh tensors: random floats, zeros for integers (a valid index into any non-empty
dimension) and ``False`` for booleans. Dense operators cost the same on any values; an
operator whose output shape depends on the values (``nonzero``, ``unique``: PyTorch tags them
``dynamic_output_shape``) is not rebuilt, nor is a call on a module, a generator or an object
without a JSON form. ``encode`` returns ``None`` for those.

Example::

    >>> import torch
    >>> spec = encode("aten.mm.default", (torch.ones(2, 3), torch.ones(3, 4)), {})
    >>> spec["args"][0]
    {'tensor': [2, 3], 'dtype': 'float32', 'stride': [3, 1], 'device': 'cpu'}
    >>> fn, device = rebuild(spec)
    >>> fn().shape, device
    (torch.Size([2, 4]), None)
"""

from __future__ import annotations

import importlib
import math
from collections.abc import Callable
from typing import Any

import torch


class NotRebuildable(ValueError):
    """The described call cannot be made again from its description (the message says why)."""


def _enc(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        if value.layout != torch.strided:
            raise NotRebuildable(f"a {value.layout} tensor")
        spec = {
            "tensor": list(value.shape),
            "dtype": str(value.dtype).removeprefix("torch."),
            "stride": list(value.stride()),
            "device": str(value.device),
        }
        if value.requires_grad:
            spec["grad"] = True
        return spec
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else {"float": repr(value)}
    if isinstance(value, (list, tuple)):  # fx's immutable_list too
        return {"tuple" if isinstance(value, tuple) else "list": [_enc(v) for v in value]}
    if isinstance(value, torch.dtype):
        return {"dtype_value": str(value).removeprefix("torch.")}
    if isinstance(value, torch.device):
        return {"device_value": str(value)}
    if isinstance(value, (torch.layout, torch.memory_format)):
        return {"torch_attr": str(value).removeprefix("torch.")}
    raise NotRebuildable(f"an argument of type {type(value).__qualname__}")


def encode(target: str, args: tuple, kwargs: dict[str, Any]) -> dict[str, Any] | None:
    """The JSON description of calling ``target`` (a ``target_name``) on ``args``/``kwargs``,
    or ``None`` when the call cannot be rebuilt (see the module docstring)."""
    try:
        _resolve(target)
        return {
            "target": target,
            "args": [_enc(a) for a in args],
            "kwargs": {k: _enc(v) for k, v in kwargs.items()},
        }
    except NotRebuildable:
        return None


def _resolve(target: str) -> Callable[..., Any]:
    """The callable a ``target_name`` names: ``aten.mm.default``, ``torch.relu``, ...; a
    method (``method:add``) resolves to a caller of that method on the first argument."""
    if target.startswith("module:"):
        raise NotRebuildable("a module call (its parameters are not in the description)")
    if target.startswith("method:"):
        name = target.split(":", 1)[1]
        return lambda self, *a, **k: getattr(self, name)(*a, **k)
    parts = target.split(".")
    if len(parts) == 3 and not target.startswith("torch."):  # namespace.op.overload
        try:
            op = getattr(getattr(getattr(torch.ops, parts[0]), parts[1]), parts[2])
        except (AttributeError, RuntimeError) as e:
            raise NotRebuildable(f"no operator {target} in this process") from e
        if isinstance(op, torch._ops.OpOverload):
            if torch.Tag.dynamic_output_shape in op.tags:
                raise NotRebuildable(f"{target}'s cost depends on the values of its inputs")
            return op
    module, _, name = target.rpartition(".")
    try:
        fn = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError, ValueError) as e:
        raise NotRebuildable(f"cannot import {target}") from e
    if not callable(fn):
        raise NotRebuildable(f"{target} is not callable")
    return fn


def _dec(value: Any, devices: set[torch.device]) -> Any:
    if not isinstance(value, dict):
        return value
    if "tensor" in value:
        dtype = getattr(torch, value["dtype"])
        device = torch.device(value["device"])
        devices.add(device)
        shape, stride = value["tensor"], value["stride"]
        t = torch.empty_strided(shape, stride, dtype=dtype, device=device)
        if dtype.is_floating_point or dtype.is_complex:
            t.normal_()
        else:
            t.zero_()
        return t.requires_grad_() if value.get("grad") else t
    if "float" in value:
        return float(value["float"])
    if "list" in value:
        return [_dec(v, devices) for v in value["list"]]
    if "tuple" in value:
        return tuple(_dec(v, devices) for v in value["tuple"])
    if "dtype_value" in value:
        return getattr(torch, value["dtype_value"])
    if "device_value" in value:
        device = torch.device(value["device_value"])
        devices.add(device)
        return device
    if "torch_attr" in value:
        return getattr(torch, value["torch_attr"])
    raise NotRebuildable(f"unknown argument description {value!r}")


def rebuild(spec: dict[str, Any]) -> tuple[Callable[[], Any], torch.device | None]:
    """(a no-argument call of the described operator on fresh tensors, its CUDA device or
    ``None``); raises ``NotRebuildable`` with the reason.

    Tensors the operator writes in place are fresh too, so calling it has no effect outside.
    """
    if not isinstance(spec, dict) or "target" not in spec:
        raise NotRebuildable("the record has no call description (measured by an older autopar)")
    fn = _resolve(spec["target"])
    devices: set[torch.device] = set()
    try:
        with torch.no_grad():
            args = [_dec(a, devices) for a in spec.get("args", [])]
            kwargs = {k: _dec(v, devices) for k, v in spec.get("kwargs", {}).items()}
    except (AttributeError, TypeError, RuntimeError) as e:
        raise NotRebuildable(f"cannot make its arguments ({e})") from e
    cuda = [d for d in devices if d.type == "cuda"]
    if any(d.type not in ("cpu", "cuda") for d in devices):
        raise NotRebuildable("a tensor on a device other than cpu/cuda")
    if cuda and not torch.cuda.is_available():
        raise NotRebuildable("a CUDA operator, and CUDA is not available")
    return (lambda: fn(*args, **kwargs)), (min(cuda, key=str) if cuda else None)
