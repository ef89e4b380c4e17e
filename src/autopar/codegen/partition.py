"""AOTAutograd's default partition as an Inductor ``custom_partitioner_fn``.

``torch.compile`` splits the joint forward-and-backward graph with the min-cut partitioner,
which recomputes cheap ops in the backward instead of saving them. The default partition
saves what the forward computed (as autopar's captured graphs do). The batch-split
executor compiles with it: its half-batch programs ran 14% faster that way on the
Inception model (``autopar.codegen.batch_split``). A module of its own, imported only when
a compile needs it (it imports ``torch._inductor``), and at module level because
Inductor's cache pickles its settings.

Example::

    >>> config = compat.inductor_config()
    >>> with config.patch({"custom_partitioner_fn": DefaultPartition()}):  # doctest: +SKIP
    ...     compiled = compile_fx(gm, fakes)
"""

from __future__ import annotations

from autopar import compat


class DefaultPartition(compat.custom_partitioner_class()):
    """Inductor runs its joint-graph passes, then this partitions (module docstring)."""

    def __call__(self, gm, joint_inputs, **kwargs):
        kwargs.pop("compiler", None)  # min-cut's argument, not default_partition's
        return compat.default_partition(gm, joint_inputs, **kwargs)

    def uuid(self) -> str:
        """Inductor's cache key for this partitioner (bump it when ``__call__`` changes)."""
        return "autopar-default-partition-1"
