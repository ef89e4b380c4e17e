"""The native stream interpreter's build in the background: where it was not built when a
graph was planned, the planned program runs in Python, and the interpreter is built in the
warm-up worker (40-60 s of compiler time at ``SCHED_IDLE``, once per torch version and
machine: later runs load the build in milliseconds) for the graphs planned later (a new
input signature, a re-plan) and the next run. ``make setup`` builds it up front.

The build is one job for the whole process (:func:`start_native_build`).

Example::

    >>> from autopar.runtime.native_build import start_native_build
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
    is tried again; a stopped one is not."""
    global _job
    with _lock:
        if native.available() or native.cannot_build() is not None:
            return FinishedJob()
        retry = _job is not None and _job.poll() not in (None, 0) and not _job.cancelled
        if _job is None or retry:
            fd, path = tempfile.mkstemp(prefix="autopar-native-", suffix=".job")
            os.close(fd)
            _job = spawn_warmup("autopar.runtime.native_build", path)
        return _job


def _warmup_main(path: str) -> int:
    """The worker's job: build the interpreter (torch's build lock orders it with any
    other process building it)."""
    os.unlink(path)
    native.load()
    return 0
