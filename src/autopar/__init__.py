"""autopar: an operator-profiling auto-parallelization compiler for PyTorch training.

Example::

    import autopar
    model = autopar.compile(model)   # then train exactly as before

A package per stage, imports flowing one way (docs/architecture.md)::

    capture -> profiling -> planning -> codegen -> runtime -> rnn -> adapt
            -> pipeline, inspection, api (compose) -> parallel -> tools

``api`` only composes; ``errors`` and ``logs`` are shared by all. ``torch.compile(model,
backend="autopar", options={...})`` is the same pipeline (``autopar.api.autopar_backend``).
"""

from autopar import logs
from autopar.adapt.monitor import AdaptOptions, stats
from autopar.api import (
    CompiledModule,
    CompileOptions,
    compile,
    explain,
    graphs,
    plan,
    profile,
    register_backend,
    wait,
)
from autopar.parallel.step import compile_step
from autopar.planning.plan import Plan, Stream, Sync

# torch.ops.autopar's RNN ops: a process that loads a graph holding one (the warm-up worker)
# has them once it imported autopar
from autopar.rnn import cells as _cells  # noqa: F401
from autopar.rnn import gru as _gru  # noqa: F401

__version__ = "0.1.0"

logs.setup()  # $AUTOPAR_LOGS, and the "autopar" log in torch._logging's registry
register_backend()  # torch.compile(model, backend="autopar")

__all__ = [
    "AdaptOptions",
    "CompileOptions",
    "CompiledModule",
    "Plan",
    "Stream",
    "Sync",
    "__version__",
    "compile",
    "compile_step",
    "explain",
    "graphs",
    "logs",
    "plan",
    "profile",
    "stats",
    "wait",
]
