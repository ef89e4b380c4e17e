"""Builds: the executors of a Dynamo graph that need an Inductor compile, compiled first in
the background and then here.

A build's cold compile runs in the warm-up worker (``codegen.warmup``: one process per
training process, at ``SCHED_IDLE``, one job at a time), which fills Inductor's FX graph
cache; once its warm-up has finished, the training process compiles the same graph at a
step boundary (a cache hit: tenths of a second to a few seconds) and the program races
(``runtime.judge``). With ``background=False`` a build compiles here at once.

The training thread never sleeps here: the worker gets the CPU the training leaves idle.

Example::

    >>> builds = Builds(background=True)                              # doctest: +SKIP
    >>> builds.add(Build(graph, "inductor", key, warm, build))        # doctest: +SKIP
    >>> ready = builds.poll()         # at each step boundary: builds compiled here
"""

from __future__ import annotations

import atexit
import logging
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from autopar.codegen.warmup import warmup_error

log = logging.getLogger("autopar")

#: A warm-up still running this long after it started is stopped and its build given up: a
#: hung compile must not hold a core for good. The slowest whole-graph compile measured on
#: the 2-core box took 71 s.
WARMUP_LIMIT_S = 600.0


@dataclass(eq=False)
class Build:
    """One executor of one Dynamo graph, for the input signature ``key``."""

    graph: Any  # the capture.DynamoGraph
    name: str  # the executor
    key: object
    warm: Callable[[], Any] | None  # queues the background compile (a codegen.warmup job)
    build: Callable[[], Any]  # compiles here (a cache hit once warmed); the program
    job: Any = None  # the warm-up job while it runs
    started: float = field(default_factory=time.perf_counter)  # when it was queued
    program: Any = None
    error: str | None = None
    seconds: float = 0.0  # the compile here


class Builds:
    """The builds of one compiled model: a queue of warm-ups, run one at a time."""

    def __init__(self, background: bool = True) -> None:
        self.background = background
        self._queue: list[Build] = []
        self._warming: Build | None = None
        self._warmed: list[Build] = []  # warm-up done: compiled here at the next boundary
        self._new: list[Build] = []  # compiled or failed since the last poll
        self._jobs: list = []  # for the finalizer only (builds reach back to the model)
        weakref.finalize(self, _stop, self._jobs)

    def add(self, build: Build) -> None:
        """Queue ``build`` (``background=False``: compile it now)."""
        if not self.background or build.warm is None:
            self._compile(build)
            return
        self._queue.append(build)
        self._launch()

    def poll(self, key=None) -> list[Build]:
        """A step boundary of signature ``key``: start the next warm-up when none runs;
        compile here the builds of ``key`` whose warm-up finished (only at a step of their
        own signature: Inductor compiles under the step's grad and autocast modes, and a
        build finished during a ``no_grad`` evaluation step must not compile a training
        graph without its backward); return the builds compiled (or failed) since the
        last poll."""
        self._reap()
        self._launch()
        ready = [b for b in self._warmed if key is None or b.key == key]
        self._warmed = [b for b in self._warmed if b not in ready]
        for b in ready:
            self._compile(b)
        new, self._new = self._new, []
        return new

    def compiling(self) -> bool:
        """A warm-up runs in the background now."""
        return self._warming is not None and self._warming.job.poll() is None

    def pending(self, key=None) -> int:
        """Builds not finished yet (of signature ``key``, or all)."""
        left = [*self._queue, *self._warmed, *([self._warming] if self._warming else [])]
        return sum(key is None or b.key == key for b in left)

    def wait(self, timeout: float | None = None) -> bool:
        """Block until every queued build has warmed up (they are compiled here at the next
        boundary). False if ``timeout`` seconds passed first."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while self._warming is not None or self._queue:
            self._launch()
            b = self._warming
            if b is None:
                continue
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                return False
            try:  # at most the limit at a time: _reap stops a hung compile
                b.job.wait(WARMUP_LIMIT_S if left is None else min(left, WARMUP_LIMIT_S))
            except Exception:  # noqa: BLE001 - subprocess.TimeoutExpired
                pass
            self._reap()
        return True

    # -- mechanics ----------------------------------------------------------------------
    def _launch(self) -> None:
        if self._warming is not None or not self._queue:
            return
        b = self._queue.pop(0)
        b.started = time.perf_counter()  # the limit counts its compile, not its wait
        try:
            b.job = b.warm()
            self._warming = b
            self._jobs.append(b.job)
            _LIVE.add(b.job)
        except Exception as exc:  # noqa: BLE001 - no warm-up: it compiles cold here
            log.debug("autopar: no background warm-up for %s %s (%s)", b.graph.tag, b.name, exc)
            self._warmed.append(b)

    def _reap(self) -> None:
        b = self._warming
        if b is None:
            return
        if b.job.poll() is None:
            waited = time.perf_counter() - b.started
            if waited <= WARMUP_LIMIT_S:
                return
            b.job.kill()
            b.error = f"its background compile was stopped after {waited:.0f} s"
            self._new.append(b)
        else:
            err = warmup_error(b.job)
            if err:  # compiled cold here, where the error shows again if it is real
                log.debug("autopar: %s %s warm-up failed: %s", b.graph.tag, b.name, err)
            self._warmed.append(b)
        _LIVE.discard(b.job)
        self._warming = None
        self._launch()

    def _compile(self, b: Build) -> None:
        t0 = time.perf_counter()
        try:
            b.program = b.build()
        except Exception as exc:  # noqa: BLE001 - the graph keeps what it runs
            b.error = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
        b.seconds = time.perf_counter() - t0
        self._new.append(b)


_LIVE: set = set()  # warm-up jobs still running, cancelled at exit


def _stop(jobs: list) -> None:
    for job in jobs:
        if job.poll() is None:
            job.kill()


atexit.register(lambda: _stop(list(_LIVE)))  # warm-ups still running at exit
