"""Input signatures and the bounded per-shape plan cache.

A compiled model keeps one set of plans per input signature (shapes, dtypes, train/eval,
grad mode, autocast dtype, thread count) in an LRU of ``cache_size`` entries; each miss logs
one line, and more distinct signatures than the cache holds ("dynamic-shape thrash") are
reported once with advice; and the Dynamo settings a compiled call needs. Split from
``autopar.adapt.monitor``; the pipeline imports these names from here.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from typing import Any

import torch

from autopar import compat

log = logging.getLogger("autopar")


class PlanCache:
    """Bounded LRU of plans per input signature (shapes, dtypes, train/eval, grad, autocast).

    A key maps to the Dynamo graph groups that ran under it; evicting the least recently
    used key drops the plans and programs of its groups not used by a resident key (Dynamo
    keeps its own graph; the next call with that key profiles and plans it again, mostly from
    the store). Each miss logs one line; the first eviction warns once about shape thrash.
    """

    def __init__(self, size: int, evict, recompile_limit: int | None = None):
        if not isinstance(size, int) or size < 1:
            raise ValueError(f"cache_size must be a positive int, got {size!r}")
        self.size = size
        self._evict = evict
        self.entries: OrderedDict[Any, set[int]] = OrderedDict()
        self.names: dict[Any, str] = {}
        self.misses = self.evictions = 0
        self.seen: set = set()
        self.thrash_reported = False
        # Dynamo's recompile limit for the module (from the pipeline): past it Dynamo
        # runs new signatures eagerly, which the thrash warning says.
        self.recompile_limit = recompile_limit

    def describe(self, key) -> str:
        return self.names.get(key, "")

    def enter(self, key, describe) -> bool:
        if key in self.entries:
            self.entries.move_to_end(key)
            return True
        self.misses += 1
        again = key in self.seen
        self.seen.add(key)
        self.names[key] = describe()
        self.entries[key] = set()
        log.info(
            "autopar: plan cache miss %d: new input signature %s%s (%d/%d cached)",
            self.misses, self.names[key], " (seen before, evicted)" if again else "",
            len(self.entries), self.size,
        )  # fmt: skip
        while len(self.entries) > self.size:
            old, groups = self.entries.popitem(last=False)
            keep = set().union(*self.entries.values()) if self.entries else set()
            tags = self._evict(groups - keep)
            self.evictions += 1
            log.info("autopar: plan cache full: evicted %s (%s)", self.names[old], tags)
            if not self.thrash_reported:
                self.thrash_reported = True
                past = (f", and past Dynamo's recompile limit ({self.recompile_limit}) new "
                        "ones run eagerly" if self.recompile_limit else "")  # fmt: skip
                msg = (
                    f"autopar: dynamic-shape thrash: {len(self.seen)} distinct input signatures "
                    f"but cache_size={self.size}; a signature seen again after its eviction is "
                    f"profiled and planned again{past}. Pad or bucket shapes (e.g. sequence "
                    "length to a multiple of 64, a fixed batch size with drop_last=True), or "
                    "raise cache_size (autopar raises Dynamo's recompile limit for the module "
                    "to at least cache_size)."
                )
                log.warning(msg)
        return False

    def add_group(self, key, group: int) -> None:
        groups = self.entries.get(key)
        if groups is not None:
            groups.add(group)


def dynamo_recompile_limit() -> int:
    """Dynamo's process-wide recompile limit now (``cache_size_limit`` before torch 2.6)."""
    cfg = compat.dynamo_config()
    return int(getattr(cfg, "recompile_limit", getattr(cfg, "cache_size_limit", 8)))


_limit_lock = threading.Lock()
_limit_total = [0]  # sum of cache_size over every module autopar compiled in this process


def register_cache_size(cache_size: int) -> None:
    """Count a compiled module's ``cache_size`` towards :func:`dynamo_limit`'s limit."""
    with _limit_lock:
        _limit_total[0] += cache_size


class HookGuardsWhileCompiling:
    """``skip_nnmodule_hook_guards=False`` only while Dynamo compiles one of the module's
    frames: a hook added to a submodule after the first call then fails a guard and
    recompiles, as in eager it takes effect at once (Dynamo's default skips those guards).

    Used where ``capture.backend.dynamo_compile`` gave the module its own Dynamo cache region
    and recompile limit (torch 2.13's ``isolate_recompiles``/``recompile_limit``), so that
    nothing else needs setting per call. Dynamo builds a frame's guards after the backend
    returned, in the same compile: the backend calls :meth:`arm`, the compiled call's
    ``with`` block restores the setting on exit. A call that compiles nothing costs an
    attribute check (the per-call :func:`dynamo_limit` cost 22 us a forward on a small MLP,
    measured 2026-11-30: its config reads and writes, and Dynamo's slower path after them).

    Example::

        >>> guards = HookGuardsWhileCompiling()
        >>> with guards:
        ...     guards.arm()
        ...     compat.dynamo_config().skip_nnmodule_hook_guards
        False
        >>> compat.dynamo_config().skip_nnmodule_hook_guards   # restored
        True
    """

    __slots__ = ("old",)

    def __init__(self):
        self.old: bool | None = None

    def arm(self) -> None:
        cfg = compat.dynamo_config()
        if self.old is None and cfg.skip_nnmodule_hook_guards:
            self.old = True
            cfg.skip_nnmodule_hook_guards = False

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        if self.old is not None:
            compat.dynamo_config().skip_nnmodule_hook_guards = self.old
            self.old = None


def dynamo_limit() -> _DynamoSettings:
    """The Dynamo settings for one compiled call, where the module shares Dynamo's cache
    region with every other compiled instance of its class (torch before 2.13); restored
    on exit: the process-wide settings are never left changed.

    * Dynamo stops compiling a code object after ``recompile_limit`` graphs (then runs it
      eagerly), counting the graphs of *every* instance of a class against one limit.
      Inside the call the limit is at least the sum of ``cache_size`` over the modules
      compiled so far, so every cached signature of every compiled module gets its graph.
    * ``skip_nnmodule_hook_guards=False``: a hook added to a submodule after the first call
      recompiles, as in eager it takes effect at once (Dynamo's default skips those guards
      for speed and silently ignores such hooks).

    Entered on every compiled call, so it sets and restores the attributes itself:
    ``config.patch`` costs twice as much (about 20 us a call)."""
    return _DynamoSettings(_limit_total[0])


class _DynamoSettings:
    __slots__ = ("want", "old")

    def __init__(self, want: int):
        self.want, self.old = want, {}

    def __enter__(self):
        cfg = compat.dynamo_config()
        changes = {}
        if cfg.skip_nnmodule_hook_guards:
            changes["skip_nnmodule_hook_guards"] = False
        for name in _limit_names(cfg):
            if getattr(cfg, name) < self.want:
                changes[name] = self.want
        for k, v in changes.items():
            self.old[k] = getattr(cfg, k)
            setattr(cfg, k, v)
        return self

    def __exit__(self, *exc) -> None:
        cfg = compat.dynamo_config()
        for k, v in self.old.items():
            setattr(cfg, k, v)
        self.old = {}


def _limit_names(cfg) -> tuple[str, ...]:
    """Dynamo's recompile limits in this torch (``cache_size_limit`` before 2.6)."""
    if not _LIMIT_NAMES:
        names = [n for n in ("recompile_limit", "accumulated_recompile_limit") if hasattr(cfg, n)]
        _LIMIT_NAMES.extend(names or ["cache_size_limit"])
    return tuple(_LIMIT_NAMES)


_LIMIT_NAMES: list[str] = []  # filled at the first compiled call (torch._dynamo is lazy)


_DTYPE_NAMES: dict[torch.dtype, str] = {}  # torch.float32 -> "float32"


def input_key(model: torch.nn.Module, args, kwargs) -> tuple:
    """The plan-cache key of one call: what Dynamo specialises a static graph on."""
    parts: list = [
        model.training,
        torch.is_grad_enabled(),
        torch.is_autocast_enabled("cpu") and str(torch.get_autocast_dtype("cpu")),
        torch.get_num_threads(),  # Dynamo guards on it too: a new count is a new graph
    ]
    # Built on every forward call, also when the race sent the module down the eager path:
    # keep it cheap (dtype names cached, keywords sorted only when there are some).
    values = args if not kwargs else list(args) + [v for _, v in sorted(kwargs.items())]
    for v in values:
        if isinstance(v, torch.Tensor):
            dtype = _DTYPE_NAMES.get(v.dtype)
            if dtype is None:
                dtype = _DTYPE_NAMES[v.dtype] = str(v.dtype).replace("torch.", "")
            parts.append((tuple(v.shape), dtype, v.device.type))
        elif isinstance(v, (int, float, bool, str, type(None))):
            parts.append(v)
        else:
            parts.append(type(v).__name__)
    return tuple(parts)


def describe_key(key: tuple) -> str:
    if key[0] == "backend":  # torch.compile(backend="autopar"): steps from Dynamo graph k
        return f"(steps from Dynamo graph g{key[1]})"
    training, grad, amp, threads, *ins = key
    shapes = ", ".join(
        f"{list(x[0])} {x[1]}" if isinstance(x, tuple) and len(x) == 3 else repr(x) for x in ins
    )
    mode = ("train" if training else "eval") + ("" if grad else ", no_grad")
    mode += f", {threads} thread{'s' if threads != 1 else ''}"
    return f"({shapes}; {mode}{', autocast ' + amp if amp else ''})"


# -- public helpers -------------------------------------------------------------------------
