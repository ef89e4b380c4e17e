"""autopar: an operator-profiling auto-parallelization compiler for PyTorch training.

Example::

    import autopar
    model = autopar.compile(model)   # then train exactly as before
"""

from autopar.plan import Plan, Stream, Sync

__version__ = "0.1.0"

__all__ = ["Plan", "Stream", "Sync", "__version__"]
