"""autopar: an operator-profiling auto-parallelization compiler for PyTorch training.

Example::

    import autopar
    model = autopar.compile(model)   # then train exactly as before

The pipeline (one module per stage): ``capture`` -> ``profile`` -> ``partition`` (cost model,
simulator) -> ``codegen`` -> ``runtime``; ``api`` composes them.
"""

# The submodules autopar.plan and autopar.profile share their names with the public
# functions autopar.plan() and autopar.profile(). Import the modules first: Python sets the
# package attribute when a submodule is first loaded, so the functions, bound last, win.
import autopar.plan as _plan_module  # noqa: F401
import autopar.profile as _profile_module  # noqa: F401
from autopar.adapt import AdaptOptions, stats
from autopar.api import CompiledModule, CompileOptions, compile, explain, plan, profile
from autopar.plan import Plan, Stream, Sync
from autopar.step import compile_step

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
    "plan",
    "profile",
    "stats",
]
