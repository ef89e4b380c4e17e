"""``MODULE:FACTORY`` and ``FILE.py:FACTORY``: the user's own model on the command line.

One loader for every command that takes a model (``autopar profile``, ``autopar plan``,
``autopar bench --model``). ``MODULE`` is imported as Python would (the current directory
is importable, since the user's models usually live next to where they run); a path ending in
``.py`` is loaded as a file, with its own directory importable (as ``python FILE.py`` would
have it), so it may import its neighbours. ``FACTORY`` is a zero-argument callable in it
that returns an ``nn.Module``, or ``(model, example_inputs)``: a tuple of tensors (or one
tensor), the arguments of one forward call. ``autopar bench`` needs the inputs; ``profile`` and
``plan`` take them as well as ``--input-shape``.

Example::

    >>> model, inputs = load_model("autopar.tools.zoo:mlp")
    >>> type(model).__name__, inputs
    ('MLP', None)
    >>> load_factory("my_model.py:make")                     # doctest: +SKIP
    <function make at 0x...>
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import os
import sys
from collections.abc import Callable
from types import ModuleType
from typing import TYPE_CHECKING

from autopar.tools.args import UsageError, one_line

if TYPE_CHECKING:
    import torch

#: How the command-line help spells the argument.
METAVAR = "MODULE_OR_FILE:FACTORY"


def load_factory(spec: str) -> Callable:
    """The callable that ``spec`` names: ``package.module:name`` or ``path/to/file.py:name``.

    Raises ``UsageError`` (exit status 2 on the command line) when the module or file cannot
    be loaded or has no callable of that name; an exception raised while importing the user's
    module is reported in one line, with its type.

    Example::

        >>> load_factory("autopar.tools.zoo:towers").__name__
        'towers'
    """
    where, sep, name = spec.rpartition(":")
    if not sep or not where or not name:
        raise UsageError(
            f"expected MODULE:FACTORY or FILE.py:FACTORY (e.g. autopar.tools.zoo:mlp or "
            f"my_model.py:make), got {spec!r}"
        )
    module = _load_file(where) if _is_file(where) else _import(where)
    fn = getattr(module, name, None)
    if fn is None or not callable(fn):
        raise UsageError(f"{where!r} has no callable {name!r}")
    return fn


def load_model(spec: str) -> tuple[torch.nn.Module, tuple[torch.Tensor, ...] | None]:
    """Call the factory ``spec`` names: ``(model, example_inputs)``, the inputs None where the
    factory returned the model alone. Anything else it returns, or raises, is a ``UsageError``
    in one line.

    Example::

        >>> model, (x,) = load_model("my_model.py:make")       # doctest: +SKIP
    """
    import torch
    import torch.nn as nn

    fn = load_factory(spec)
    try:
        made = fn()
    except Exception as exc:
        raise UsageError(f"{spec}() raised {type(exc).__name__}: {one_line(exc)}") from exc
    if isinstance(made, nn.Module):
        return made, None
    if isinstance(made, tuple) and len(made) == 2 and isinstance(made[0], nn.Module):
        model, inputs = made
        inputs = (inputs,) if isinstance(inputs, torch.Tensor) else inputs
        if isinstance(inputs, tuple | list) and all(isinstance(x, torch.Tensor) for x in inputs):
            return model, tuple(inputs)
    raise UsageError(
        f"{spec} returned {type(made).__name__}, not an nn.Module or (model, example_inputs) "
        "with example_inputs a tuple of tensors"
    )


def _is_file(where: str) -> bool:
    return where.endswith(".py") or os.sep in where or "/" in where


def _import(name: str) -> ModuleType:
    if os.getcwd() not in sys.path:  # the user's own models live next to where they run
        sys.path.insert(0, os.getcwd())
    try:
        return importlib.import_module(name)
    except ImportError as exc:
        raise UsageError(f"cannot import module {name!r}: {exc}") from None


def _load_file(path: str) -> ModuleType:
    full = os.path.abspath(os.path.expanduser(path))
    if not os.path.isfile(full):
        raise UsageError(f"no Python file {path!r} (a FILE.py:FACTORY must name a .py file)")
    # One module per file, under a name that cannot shadow an installed package; kept in
    # sys.modules so that inspect (Dynamo reads source lines) and pickling find it.
    stem = os.path.splitext(os.path.basename(full))[0]
    digest = hashlib.sha1(full.encode()).hexdigest()[:8]
    name = f"autopar_user_{stem if stem.isidentifier() else 'model'}_{digest}"
    if name in sys.modules:
        return sys.modules[name]
    directory = os.path.dirname(full)
    if directory not in sys.path:  # its neighbours import, as under `python FILE.py`
        sys.path.insert(0, directory)
    loader_spec = importlib.util.spec_from_file_location(name, full)
    if loader_spec is None or loader_spec.loader is None:
        raise UsageError(f"cannot load {path!r} as a Python module")
    module = importlib.util.module_from_spec(loader_spec)
    sys.modules[name] = module
    try:
        loader_spec.loader.exec_module(module)
    except Exception as exc:
        del sys.modules[name]
        raise UsageError(f"loading {path} raised {type(exc).__name__}: {one_line(exc)}") from exc
    return module
