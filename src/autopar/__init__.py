"""autopar: an operator-profiling auto-parallelization compiler for PyTorch training.

Example::

    import autopar
    model = autopar.compile(model)   # then train exactly as before

A package per stage, imports flowing one way (docs/architecture.md)::

    capture -> profiling -> planning -> codegen -> runtime -> rnn -> adapt
            -> pipeline, inspection, api (compose) -> parallel -> tools

``api`` only composes; ``errors`` is shared by all.
"""

from autopar.adapt.monitor import AdaptOptions, stats
from autopar.api import (
    CompiledModule,
    CompileOptions,
    compile,
    explain,
    graphs,
    plan,
    profile,
    wait,
)
from autopar.parallel.step import compile_step
from autopar.planning.plan import Plan, Stream, Sync

__version__ = "0.1.0"

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
    "plan",
    "profile",
    "stats",
    "wait",
]
