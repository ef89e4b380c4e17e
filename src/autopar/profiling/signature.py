"""What identifies an operator call, and how its values are described: the store's keys.

``target_name`` names what a node runs (``aten.mm.default``); ``signature`` hashes a call's
target, its arguments' metadata (shape, dtype, strides, device; other arguments' repr) and
its intra-op thread count into the 16-hex-digit key of the profile store, so two calls that
cost the same are measured once. The value helpers (``leaves``, ``tensors``, ``nbytes``,
``format_meta``, ...) flatten and describe what FX nodes take and return.

Example::

    >>> signature("aten.relu.default", (torch.ones(2, 3),), {}, 2) == signature(
    ...     "aten.relu.default", (torch.zeros(2, 3),), {}, 2)
    True
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Any

import torch
import torch.fx

from autopar import compat


def leaves(value: Any) -> list[Any]:
    """Flatten tuples/lists/dicts (the containers FX passes around) into their leaves."""
    if isinstance(value, (list, tuple)):
        return [x for v in value for x in leaves(v)]
    if isinstance(value, dict):
        return [x for v in value.values() for x in leaves(v)]
    return [value]


def tensors(value: Any) -> list[torch.Tensor]:
    return [x for x in leaves(value) if isinstance(x, torch.Tensor)]


def nbytes(value: Any) -> int:
    return sum(t.numel() * t.element_size() for t in tensors(value))


def version_of(t: torch.Tensor) -> int | None:
    """``t._version``; None under ``inference_mode`` (no counter: a write is assumed)."""
    try:
        return t._version
    except RuntimeError:
        return None


def storage_ptr(t: torch.Tensor) -> int:
    try:
        return t.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):  # sparse, nested, ... have no single storage
        return 0


def describe(value: Any) -> str:
    """The part of a signature one argument contributes: tensor metadata, else its repr."""
    if isinstance(value, torch.Tensor):
        grad = "g" if value.requires_grad and torch.is_grad_enabled() else ""
        layout = "" if value.layout == torch.strided else str(value.layout)
        return (
            f"T{list(value.shape)}{str(value.dtype)[6:]}{list(value.stride())}"
            f"{value.device}{layout}{grad}"
        )
    if isinstance(value, (list, tuple)):
        return "(" + ",".join(describe(v) for v in value) + ")"
    if isinstance(value, dict):
        return "{" + ",".join(f"{k}:{describe(v)}" for k, v in value.items()) + "}"
    if isinstance(value, torch.Generator):
        return f"Generator({value.device})"
    text = repr(value)
    # A repr with an address ("<... at 0x7f..>") differs every run: it would never hit the store.
    return f"<{type(value).__qualname__}>" if " at 0x" in text else text


def target_name(node: torch.fx.Node) -> str:
    """A readable, stable name of what a node runs: ``aten.mm.default``, ``_operator.getitem``.

    Example::

        >>> g = torch.fx.symbolic_trace(lambda x: torch.relu(x) + 1)
        >>> [target_name(n) for n in g.graph.nodes]
        ['x', 'torch.relu', '_operator.add', 'output']
    """
    t = node.target
    if isinstance(t, str):
        return t
    if isinstance(t, (compat.OpOverload, compat.OpOverloadPacket)):
        return str(t)
    module = getattr(t, "__module__", None) or ""
    # __name__, not __qualname__: torch.relu's qualname is "_VariableFunctionsClass.relu".
    name = getattr(t, "__name__", None) or repr(t)
    return f"{module}.{name}" if module else name


def signature(target: str, args: Sequence[Any], kwargs: dict[str, Any], threads: int) -> str:
    """The store key of one operator call: sha1 (16 hex digits) of target, arguments, threads.

    Tensors contribute shape, dtype, strides and device (not values); other arguments their
    repr. Two calls with the same signature cost the same, so only one is measured.

    Example::

        >>> a = torch.ones(2, 3)
        >>> signature("aten.relu.default", (a,), {}, 2) == signature(
        ...     "aten.relu.default", (torch.zeros(2, 3),), {}, 2)
        True
    """
    text = f"{target}|{describe(tuple(args))}|{describe(kwargs)}|threads={threads}"
    return hashlib.sha1(text.encode()).hexdigest()[:16]


def format_meta(value: Any, ts: list[torch.Tensor]) -> tuple[str, str, str]:
    """(shape, dtype, device) strings of a node's output(s); ``ts`` are its tensors."""
    if not ts:
        return "", "", ""
    if len(ts) == 1 and isinstance(value, torch.Tensor):
        return str(list(ts[0].shape)), str(ts[0].dtype)[6:], str(ts[0].device)
    shapes = ", ".join(str(list(t.shape)) for t in ts)
    dtypes = ", ".join(str(t.dtype)[6:] for t in ts)
    return f"({shapes})", f"({dtypes})", str(ts[0].device)
