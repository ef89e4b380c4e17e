"""The native tier: where the native stream interpreter (``runtime.native``) was not built
at a graph's first call, its planned program ran in Python; this tier builds the
interpreter in the warm-up worker process (40-60 s of compiler time at ``SCHED_IDLE``, once
per torch version and machine: later runs load the build in milliseconds), then plans and
generates the graph's program for it and lets ``runtime.tiers`` measure it against the
current tier.

The build is one job for the whole process: every graph's candidate waits on the same one
(:func:`start_native_build`).

Example::

    >>> from autopar.runtime.native_tier import start_native_build
    >>> job = start_native_build()   # doctest: +SKIP
    >>> job.wait(600)                # doctest: +SKIP
    0
"""

from __future__ import annotations

import os
import tempfile
import threading

from autopar.codegen.warmup import spawn_warmup
from autopar.runtime import native

_lock = threading.Lock()
_job = None  # the build job of this process, once queued


class FinishedJob:
    """A finished job (the interpreter was built already, or a candidate needs no warm-up):
    ``WarmupJob``'s interface."""

    returncode, error = 0, ""

    def poll(self) -> int:
        return 0

    def wait(self, timeout: float | None = None) -> int:
        return 0

    def kill(self) -> None:
        pass


def start_native_build():
    """The job that builds the interpreter in the warm-up worker (the same one for every
    caller in this process; a finished stand-in when it is built already). A failed build
    is tried again; a stopped one (``runtime.tiers.WARMUP_LIMIT_S``) is not: every other
    graph's candidate would wait for the limit again."""
    global _job
    with _lock:
        if native.available():
            return FinishedJob()
        retry = _job is not None and _job.poll() not in (None, 0) and not _job.cancelled
        if _job is None or retry:
            fd, path = tempfile.mkstemp(prefix="autopar-native-", suffix=".job")
            os.close(fd)
            _job = spawn_warmup("autopar.runtime.native_tier", path)
        return _job


def native_candidate(record, meta: list, planner, candidate):
    """The tier's ``candidate(...)`` for ``record``, or None: no planner (the pipeline
    passes itself: its ``options``, ``store`` and ``plan_and_generate``), no profile, a graph
    off the CPU, or a planned program that is native already (or could not be: its notes
    say why). Offered only where the cost model, with the interpreter's costs, plans
    several streams (``runtime.planned.make_plans``): a one-stream native program saves
    only Python's per-op dispatch, which the Inductor tier saves too, and the build would
    delay that tier by its 40-60 s."""
    if planner is None or record.table is None or record.executor != "plan":
        return None
    from autopar.runtime import native

    if native.cannot_build() is not None:  # said once, by the native module
        return None
    if any(getattr(m, "device", "cpu") != "cpu" for m in meta):
        return None
    program = record.program
    if program is not None and (
        program.executor == "native"
        or any(n.startswith("native executor not used") for n in program.notes)
    ):
        return None

    def check() -> str | None:
        from autopar.runtime.planned import make_plans

        plan = make_plans(record.table, planner.options, planner.store, record.tag, "native")
        if len({s for _, s in plan.placements}) < 2:
            return "the cost model plans one stream for it"
        return None

    def build():
        # never build on the training thread: the warm-up built it, or failed (then this
        # raises, and the tier line says so)
        native.load(build=False)
        program = planner.plan_and_generate(record, record.table, "native")[1]
        if program.executor != "native":
            raise RuntimeError(next(n for n in program.notes if n.startswith("native")))
        return program

    return candidate("native", warm=start_native_build, build=build, check=check,
                     tag=record.tag, executor="plan")  # fmt: skip


def _warmup_main(path: str, parent: int | None = None) -> int:
    """The worker's job: build the interpreter (torch's build lock orders it with any
    other process building it)."""
    os.unlink(path)
    native.load()
    return 0
