"""A Dynamo graph at run time: the callable ``autopar.capture.backend`` hands to Dynamo,
whose runner another executor (``autopar.runtime.executors``) can replace between two calls.

Example::

    >>> g = DynamoGraph(0, gm=None, runner=lambda x: x + 1)
    >>> g(1), g.tag
    (2, 'g0')
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import torch.fx as fx

# Optional hook around every call of a Dynamo graph: ``on_graph_call(graph, args) ->
# outputs``, where ``graph.runner(*args)`` runs it (the pipeline runs the step's executor).
OnGraphCall = Callable[["DynamoGraph", tuple], Any]


class DynamoGraph:
    """One Dynamo graph ``g<k>`` at run time: the callable Dynamo calls. ``runner(*args)``
    runs it: AOTAutograd over autopar's recorded forward and backward graphs
    (``captured``), or another executor's program that runs both halves at once
    (``autopar.runtime.executors``), swapped between two calls.
    ``on_call`` (None: call ``runner`` directly) sees every call while something may
    still be swapped in."""

    def __init__(self, group: int, gm: fx.GraphModule, runner: Callable[..., Any],
                 on_call: OnGraphCall | None = None):  # fmt: skip
        self.group = group
        self.gm = gm  # after the graph passes: what AOTAutograd traced
        self.captured = runner
        self.runner = runner
        self.executor = "per-graph"  # the executors of g<k>.fw and g<k>.bw, each its own
        self.checked: set[str] = set()  # built programs whose first call gave the right outputs
        self.out_meta: list | None = None  # the captured runner's outputs' metadata
        self.on_call = on_call
        self.lock = threading.RLock()
        # Around the two halves: "AOTAutograd" (its runtime wrapper, with the reason) until
        # both were compiled, then "direct" where nothing needs that wrapper
        # (``autopar.capture.direct_autograd``).
        self.autograd = "AOTAutograd"

    tag = property(lambda self: f"g{self.group}")

    def __call__(self, *args: Any) -> Any:
        on_call = self.on_call
        if on_call is None:
            return self.runner(*args)
        return on_call(self, args)

    def __repr__(self) -> str:
        return f"DynamoGraph({self.tag}, executor={self.executor!r})"
