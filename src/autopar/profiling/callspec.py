"""A JSON description of one operator call, enough to call it again without the graph.

The profiler stores it with each measurement (``record["call"]``), so the store can re-time
an entry on its own (``autopar store verify``, ``heal``): tensors become their metadata
(shape, dtype, strides, device, requires_grad), other arguments their value. ``rebuild`` makes
a call on fresh tensors: random floats, zeros for integers (a valid index into any non-empty
dimension) and ``False`` for booleans. Dense operators cost the same on any values; an
operator whose output shape depends on the values (``nonzero``, ``unique``: PyTorch tags them
``dynamic_output_shape``) is not rebuilt, nor is a call on a module, a generator or an object
without a JSON form. ``encode`` returns ``None`` for those.

**The description is data, never code.** A store file may come from another machine, a shared
directory or a CI cache, so what it names is checked against a fixed rule before anything
runs (:func:`why_refused`): a ``torch.ops`` operator overload of the ``aten``, ``prims`` or
``autopar`` namespace; a function of ``torch`` or ``torch.nn.functional`` that is the binding
of an aten operator of the same name; a C method of ``torch.Tensor`` of the same kind
(``method:add``); or one of a few arithmetic functions of ``operator``; never an operator
that takes a file name (``aten.from_file``). Arguments decode only
to tensors, numbers, strings, dtypes, devices, layouts and memory formats: no description
can make a callable. The name the store shows (``record["target"]``) must be the name that
runs (``record["call"]["target"]``); ``autopar.profiling.store`` refuses any other entry
when it reads the file.

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

import math
import operator
import types
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F  # noqa: N812

from autopar import compat


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


#: The operator namespaces whose overloads a description may name: PyTorch's own and
#: autopar's custom cell ops. Another library's ops are profiled in place, never re-timed.
OP_NAMESPACES = frozenset({"aten", "prims", "autopar"})
#: The functions of Python's ``operator`` module a description may name (FX graphs of
#: Python code call them on tensors and sizes).
OPERATOR_FUNCTIONS = frozenset({
    "add", "sub", "mul", "truediv", "floordiv", "mod", "pow", "matmul", "neg", "pos", "abs",
    "getitem", "lt", "le", "gt", "ge", "eq", "ne", "and_", "or_", "xor", "invert",
})  # fmt: skip


#: String arguments through which an operator reaches the file system (``aten.from_file``'s
#: ``filename``): a description from a store file must not create or grow a file.
FILE_ARGUMENTS = frozenset({"filename", "file", "path"})


def _touches_files(ops: list) -> bool:
    """Whether any of the operator overloads ``ops`` takes a file name."""
    return any(str(a.type) == "str" and a.name in FILE_ARGUMENTS
               for op in ops for a in op._schema.arguments)  # fmt: skip


def _overloads(name: str) -> list:
    packet = getattr(torch.ops.aten, name)
    return [getattr(packet, o) for o in packet.overloads()]


def _aten_binding(owner: Any, name: str, kinds: tuple[type, ...]) -> Callable[..., Any] | None:
    """``owner.<name>`` when it is a C binding (of one of ``kinds``) of the aten operator of
    the same name: the functions and methods that run one operator and nothing else."""
    if name.startswith("_") or not hasattr(torch.ops.aten, name):
        return None
    if _touches_files(_overloads(name)):
        return None
    fn = getattr(owner, name, None)
    return fn if isinstance(fn, kinds) else None


def _method(name: str) -> Callable[..., Any]:
    def call(self, *args, **kwargs):
        if not isinstance(self, torch.Tensor):
            raise NotRebuildable(f"method:{name} called on a {type(self).__name__}")
        return getattr(self, name)(*args, **kwargs)

    return call


def _resolve(target: str) -> Callable[..., Any]:
    """The callable a ``target_name`` names under the module docstring's rule; raises
    ``NotRebuildable`` saying why not."""
    if not isinstance(target, str):
        raise NotRebuildable(f"the target {target!r} is not a name")
    if target.startswith("module:"):
        raise NotRebuildable("a module call (its parameters are not in the description)")
    if target.startswith("method:"):
        name = target.split(":", 1)[1]
        if _aten_binding(torch.Tensor, name, (types.MethodDescriptorType,)) is None:
            raise NotRebuildable(f"{target} is not a Tensor method that runs one aten operator")
        return _method(name)
    module, _, name = target.rpartition(".")
    parts = target.split(".")
    if len(parts) == 3 and parts[0] in OP_NAMESPACES:  # namespace.op.overload
        packet = getattr(getattr(torch.ops, parts[0]), parts[1], None)
        op = getattr(packet, parts[2], None) if packet is not None else None
        if not isinstance(op, compat.OpOverload):
            raise NotRebuildable(f"no operator {target} in this process")
        if torch.Tag.dynamic_output_shape in op.tags:
            raise NotRebuildable(f"{target}'s cost depends on the values of its inputs")
        if _touches_files([op]):
            raise NotRebuildable(f"{target} takes a file name")
        return op
    builtin = (types.BuiltinFunctionType,)
    fn = None
    if module == "torch":
        fn = _aten_binding(torch, name, builtin)
    elif module == "torch.nn.functional":
        fn = _aten_binding(F, name, (*builtin, types.FunctionType))
    elif module in ("_operator", "operator") and name in OPERATOR_FUNCTIONS:
        fn = getattr(operator, name)
    if fn is None:
        raise NotRebuildable(
            f"{target} is not an operator autopar re-times (torch.ops operators of "
            f"{sorted(OP_NAMESPACES)}, torch functions and Tensor methods of aten operators)"
        )
    return fn


def why_refused(record: Any) -> str | None:
    """Why a store record's call description may not be run (None: it may, or it has none).

    Example::

        >>> why_refused({"target": "aten.mm.default", "call": {"target": "os.system"}})
        "it shows 'aten.mm.default' but would run 'os.system'"
    """
    call = record.get("call") if isinstance(record, dict) else None
    if call is None:
        return None
    if not isinstance(call, dict):
        return "its call description is not a table"
    target, shown = call.get("target"), record.get("target")
    if shown != target and f"method:{shown}" != target:  # the profiler shows "mul_" for
        return f"it shows {shown!r} but would run {target!r}"  # "method:mul_"
    try:
        _resolve(target)
    except NotRebuildable as e:
        return str(e)
    return None


def _torch_value(name: Any, kinds) -> Any:
    """``torch.<name>`` when it is a value of ``kinds`` (a dtype, a layout, ...): a
    description names values, never functions."""
    value = getattr(torch, name, None) if isinstance(name, str) else None
    if not isinstance(value, kinds):
        raise NotRebuildable(f"{name!r} is not a torch {getattr(kinds, '__name__', 'value')}")
    return value


#: At most this many bytes of fresh tensors for one described call: a description from a
#: store file must not be able to exhaust the machine's memory.
MAX_BYTES = 8 << 30


def _sizes(value: Any) -> list[int]:
    if not isinstance(value, list) or not all(
        isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in value
    ):
        raise NotRebuildable(f"{value!r} is not a list of sizes")
    return value


class _Made:
    """What decoding one description has made so far: its devices and tensor bytes."""

    def __init__(self) -> None:
        self.devices: set[torch.device] = set()
        self.bytes = 0


def _device(name: Any, made: _Made) -> torch.device:
    """The device a description names: the CPU, or CUDA where this process has it."""
    try:
        device = torch.device(str(name))
    except RuntimeError as e:
        raise NotRebuildable(f"{name!r} is not a device") from e
    if device.type not in ("cpu", "cuda"):
        raise NotRebuildable("a tensor on a device other than cpu/cuda")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise NotRebuildable("a CUDA operator, and CUDA is not available")
    made.devices.add(device)
    return device


def _dec(value: Any, made: _Made) -> Any:
    if not isinstance(value, dict):
        return value
    if "tensor" in value:
        dtype = _torch_value(value["dtype"], torch.dtype)
        device = _device(value["device"], made)
        shape, stride = _sizes(value["tensor"]), _sizes(value["stride"])
        if len(shape) != len(stride):
            raise NotRebuildable("a tensor whose shape and strides differ in length")
        span = 1 + sum((n - 1) * s for n, s in zip(shape, stride, strict=True))
        made.bytes += span * dtype.itemsize if all(shape) else 0
        if made.bytes > MAX_BYTES:
            raise NotRebuildable(f"its tensors would take more than {MAX_BYTES >> 30} GiB")
        t = torch.empty_strided(shape, stride, dtype=dtype, device=device)
        if dtype.is_floating_point or dtype.is_complex:
            t.normal_()
        else:
            t.zero_()
        return t.requires_grad_() if value.get("grad") else t
    if "float" in value:
        return float(value["float"])
    if "list" in value:
        return [_dec(v, made) for v in value["list"]]
    if "tuple" in value:
        return tuple(_dec(v, made) for v in value["tuple"])
    if "dtype_value" in value:
        return _torch_value(value["dtype_value"], torch.dtype)
    if "device_value" in value:
        return _device(value["device_value"], made)
    if "torch_attr" in value:
        return _torch_value(value["torch_attr"], (torch.layout, torch.memory_format))
    raise NotRebuildable(f"unknown argument description {value!r}")


def rebuild(spec: dict[str, Any]) -> tuple[Callable[[], Any], torch.device | None]:
    """(a no-argument call of the described operator on fresh tensors, its CUDA device or
    ``None``); raises ``NotRebuildable`` with the reason.

    Tensors the operator writes in place are fresh too, so calling it has no effect outside.
    """
    if not isinstance(spec, dict) or "target" not in spec:
        raise NotRebuildable("the record has no call description (measured by an older autopar)")
    fn = _resolve(spec["target"])
    made = _Made()
    try:
        with torch.no_grad():
            args = [_dec(a, made) for a in spec.get("args", [])]
            kwargs = {k: _dec(v, made) for k, v in spec.get("kwargs", {}).items()}
    except (AttributeError, TypeError, RuntimeError, KeyError) as e:
        raise NotRebuildable(f"cannot make its arguments ({e})") from e
    cuda = [d for d in made.devices if d.type == "cuda"]
    return (lambda: fn(*args, **kwargs)), (min(cuda, key=str) if cuda else None)
