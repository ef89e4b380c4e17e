"""Errors and warnings users see. Every message names what was wrong and how to fix it."""

from __future__ import annotations

import logging
import warnings


class AutoparError(Exception):
    """Base class of autopar's errors."""


class CaptureError(AutoparError):
    """The model could not be captured (wrong inputs, not a Module, ...)."""


class PlanError(AutoparError):
    """A plan failed verification or no plan satisfies the constraints (e.g. memory budget)."""


class StoreWarning(UserWarning):
    """The profile store was unusable (corrupted, truncated, foreign version); it is re-measured."""


class FallbackWarning(UserWarning):
    """Part of the model runs eagerly instead of through autopar's plan."""


def node_source(node) -> str:
    """The user's source line of an FX node, as ``file:line in fn`` (or ``"unknown"``).

    Uses ``node.meta["stack_trace"]`` (set by Dynamo/AOTAutograd); its last frame is the
    user's code that produced the node.
    """
    trace = (getattr(node, "meta", None) or {}).get("stack_trace") or ""
    frames = [ln.strip() for ln in trace.strip().splitlines() if ln.strip().startswith("File ")]
    if not frames:
        return "unknown"
    last = frames[-1]  # 'File "x.py", line 12, in forward'
    try:
        file_part, line_part, fn_part = (p.strip() for p in last.split(",", 2))
        return f"{file_part[6:-1]}:{line_part.split()[1]} in {fn_part[3:]}"
    except (ValueError, IndexError):
        return last


def describe_node(node) -> str:
    """``node.format_node()`` plus the user's source line, for error messages."""
    return f"{node.format_node()}  (from {node_source(node)})"


def warn_fallback(what: str, node=None, fix: str = "") -> None:
    """One clear warning that something runs eagerly, naming the node and its source line."""
    where = f" at node {describe_node(node)}" if node is not None else ""
    msg = f"autopar: {what}{where}; this part runs eagerly (results stay correct)."
    if fix:
        msg += f" {fix}"
    logging.getLogger("autopar").info("%s", msg)  # one line in the log too (autopar.logs)
    warnings.warn(msg, FallbackWarning, stacklevel=3)


def traced_user_error(exc: BaseException) -> BaseException | None:
    """The user's own error behind a Dynamo trace failure, restated, or None.

    Dynamo runs the model on fake tensors before anything runs for real, so a bug in the
    model (a shape mismatch) surfaces as a ``TorchRuntimeError`` of several paragraphs that
    tells the user to remove a ``torch.compile`` call they never wrote. This returns the
    underlying exception's type with its message, the user's source line (the innermost
    frame outside torch of Dynamo's ``real_stack``) and what to do; Dynamo's exception is
    kept as its ``dynamo_error`` attribute.

    Example::

        >>> try:                                                # doctest: +SKIP
        ...     cmodel(x)
        ... except Exception as exc:
        ...     raise (traced_user_error(exc) or exc) from None
    """
    from autopar import compat

    classes = compat.dynamo_exception_classes()
    if classes is None:  # pragma: no cover - a torch without Dynamo
        return None
    TorchDynamoException, TorchRuntimeError = classes  # noqa: N806 - classes
    if not isinstance(exc, TorchRuntimeError):
        return None
    orig, seen = exc, 0
    while isinstance(orig, TorchDynamoException) and seen < 10:  # the chain to the op's error
        nxt = orig.__cause__ or orig.__context__
        if nxt is None:
            break
        orig, seen = nxt, seen + 1
    if isinstance(orig, TorchDynamoException):
        return None
    frames = [f for f in (getattr(exc, "real_stack", None) or [])
              if "/torch/" not in f.filename.replace("\\", "/")]  # fmt: skip
    where = f"{frames[-1].filename}:{frames[-1].lineno} ({(frames[-1].line or '').strip()})" \
        if frames else "the model's forward"
    msg = (f"{orig} -- raised at {where} while autopar traced the call with fake tensors. "
           "Check the model without autopar.compile: eager PyTorch raises it there too "
           "unless the model branches on tensor values.")  # fmt: skip
    try:
        clean = type(orig)(msg)
    except Exception:  # noqa: BLE001 - an exception type with another constructor
        clean = RuntimeError(msg)
    clean.dynamo_error = exc  # Dynamo's full report, for a bug report
    return clean
