"""The background compiles: one worker process per training process compiles the executors'
builds (``runtime.builds``), one job after another, so that Inductor's on-disk FX graph
cache holds them when the training process compiles them itself (a cache hit) at a step
boundary.

Why one worker rather than a process per candidate: a fresh process spends about 3.8 s of
CPU importing torch, autopar and Inductor before it compiles anything (2026-12-02, 2-core
box), and a model queues several candidates (HF BERT three: Inductor forward, backward,
joint; the Inception model four). Why it runs at ``SCHED_IDLE``: :func:`yield_cpu`.

A job is ``<module>._warmup_main(path)``: the module's own warm-up (``codegen.joint``,
``runtime.native_build``) on the job file its parent wrote. The job
file is the job's: the worker deletes it when it loads it, and the parent when the job ends
for any reason (finished, failed, cancelled, stopped at exit), so that a pickled graph
never stays in ``$TMPDIR``.

Why the worker runs isolated (``python -I``, in a private temporary directory, removed when
it ends): it must import the training's autopar and nothing of the directory the training
runs in (a ``json.py`` there was imported by it) nor of ``PYTHONPATH``; the parent passes
the directory that holds its ``autopar`` package, which the worker appends to ``sys.path``
where it is missing. Protocol of the worker (:data:`_BOOT`, with that directory and the
parent's pid as arguments): one JSON line per job on its stdin
(``{"id", "module", "path"}``), one per finished job on its stdout (``{"id", "rc",
"error"}``); everything else it prints goes to an unnamed temp file (its log), never to a
pipe nobody reads. The parent feeds one job at a time, so that cancelling a queued job
costs nothing; a job whose worker ended without answering (killed, or idle just as the job
came) goes to a fresh worker once, then fails. The worker follows its parent (it exits
when the parent is gone) and exits after :data:`IDLE_EXIT_S` without a job; a fresh one
is started for the next job, or when the settings its compiles depend on changed (the
Inductor cache directory, ``TORCHINDUCTOR_*``, ``TORCH_*``, ``TRITON_*`` variables).

Example::

    >>> job = spawn_warmup("autopar.codegen.joint", path)       # doctest: +SKIP
    >>> job.wait(timeout=600); warmup_error(job)                # doctest: +SKIP
    ''
"""

from __future__ import annotations

import atexit
import collections
import contextlib
import itertools
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time

#: A worker with no job for this long exits (it holds torch and Inductor in memory).
IDLE_EXIT_S = 60.0
#: Environment variables whose prefix this names are read by the compiles: a worker started
#: under other values is replaced before the next job.
_ENV_PREFIXES = ("TORCHINDUCTOR_", "TORCH_", "TRITON_", "AUTOPAR_", "OMP_")
#: Directories among them: the worker gets them absolute (_compile_env).
_DIR_VARS = ("TORCHINDUCTOR_CACHE_DIR", "TORCH_EXTENSIONS_DIR", "TRITON_CACHE_DIR", "TORCH_HOME",
             "AUTOPAR_PROFILE_DIR", "AUTOPAR_DEBUG_DIR")  # fmt: skip
#: The directory that holds this ``autopar`` package: the worker imports the same one.
_PACKAGE_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
#: The worker's start (``python -I -c _BOOT <package root> <parent pid>``): ``-I`` leaves the
#: working directory and ``PYTHON*`` variables off ``sys.path``; the package root is appended
#: (after the standard library and site-packages, so a stray module there shadows nothing).
_BOOT = (
    "import sys\n"
    "if sys.argv[1] not in sys.path:\n"
    "    sys.path.append(sys.argv[1])\n"
    "from autopar.codegen.warmup import _worker_main\n"
    "sys.exit(_worker_main(int(sys.argv[2])))\n"
)


def yield_cpu(pid: int = 0) -> None:
    """Let process ``pid`` (0: this one) run only on CPU time that nothing else wants:
    Linux's ``SCHED_IDLE`` (inherited by the compiler processes it starts), else nice 19.

    Why it matters: training with 2 intra-op threads on 2 cores has no idle core, and an
    OpenMP op whose second thread waits for a core runs 10-50x slower. Why the worker stays
    in its parent's *session*: with the kernel's autogroups (``sched_autogroup_enabled``,
    on here) every session is one scheduling group, CPU time is shared fairly between
    groups first, and a priority (``SCHED_IDLE`` or ``nice``) counts only inside its own
    group. Measured 2026-12-02 (2-core box, eager HF BERT steps while another process
    compiled BERT cold at ``SCHED_IDLE``): 13.1 ms a step alone, 13.3-13.9 ms with the
    compiler in the same session, 46.8-47.9 ms with it in a session of its own
    (``start_new_session``, which the warm-ups used before, at nice 10). A CPU-bound
    ``SCHED_IDLE`` loop in the same session cost nothing (12.3 vs 12.1 ms)."""
    try:
        os.sched_setscheduler(pid, os.SCHED_IDLE, os.sched_param(0))
    except (AttributeError, OSError):  # not Linux, or the process is gone
        try:
            os.setpriority(os.PRIO_PROCESS, pid, 19)
        except (AttributeError, OSError):
            pass


def exit_with_parent(parent: int) -> None:
    """The warm-up is for its parent's cache: once the parent is gone (even killed, when
    its atexit handlers never ran), stop at once."""

    def watch() -> None:
        while True:
            time.sleep(1.0)
            try:
                os.kill(parent, 0)
            except ProcessLookupError:
                _kill_own_group()
                os._exit(0)

    threading.Thread(target=watch, daemon=True, name="autopar-parent-watch").start()


def load_warmup_job(path: str) -> dict:
    """A warm-up job's start in the worker: register autopar's ops and load (then delete)
    the job file its parent wrote."""
    import torch

    import autopar  # noqa: F401 - registers autopar's custom ops before unpickling

    try:
        return torch.load(path, weights_only=False)
    finally:
        os.unlink(path)


# -- the parent's side ----------------------------------------------------------------------
class WarmupJob:
    """One queued or running warm-up, with the part of ``subprocess.Popen``'s interface the
    builds use: ``poll()``, ``wait(timeout)``, ``kill()``, ``returncode``."""

    def __init__(self, module: str, path: str, env: dict[str, str]):
        self.id = next(_IDS)
        self.module, self.path, self.env = module, path, env
        self.returncode: int | None = None
        self.error = ""
        self.proc: subprocess.Popen | None = None  # the worker it was sent to
        self.sent = 0  # to how many workers (one that died unanswered gets it again, once)
        self.cancelled = False
        self._done = threading.Event()

    def poll(self) -> int | None:
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if not self._done.wait(timeout):
            raise subprocess.TimeoutExpired(f"warm-up {self.module}", timeout)
        return self.returncode

    def kill(self) -> None:
        _WORKER.cancel(self)

    def _finish(self, rc: int, error: str) -> None:
        if self.returncode is None:
            self.returncode, self.error = rc, error
            # the job file is no one's now (a worker that loaded it deleted it already)
            with contextlib.suppress(OSError):
                os.unlink(self.path)
            self._done.set()


_IDS = itertools.count()


class _Worker:
    """The worker process and the jobs waiting for it (one per training process)."""

    def __init__(self):
        self._lock = threading.Lock()
        self._queue: collections.deque[WarmupJob] = collections.deque()
        self._running: WarmupJob | None = None
        self._proc: subprocess.Popen | None = None
        self._workers: set[subprocess.Popen] = set()  # started, not yet ended and cleaned up
        self._env: dict[str, str] | None = None  # the compile settings it started with
        self._stopped = False  # the training process is exiting

    def submit(self, module: str, path: str) -> WarmupJob:
        job = WarmupJob(module, path, _compile_env())
        with self._lock:
            self._queue.append(job)
            self._feed()
        return job

    def cancel(self, job: WarmupJob) -> None:
        """Drop a queued job; kill the worker for a running one. Never blocks: it runs from
        garbage collection too (a model's finalizer), maybe on a thread that holds the lock,
        and then the job is only marked (a queued one is skipped, a running one finishes)."""
        job.cancelled = True
        if not self._lock.acquire(blocking=False):
            return
        try:
            if job in self._queue:
                self._queue.remove(job)
                job._finish(-9, "cancelled")
            elif job is self._running and self._proc is not None:
                _kill_group(self._proc)  # the reader sees its output end and finishes it
        finally:
            self._lock.release()

    def stop(self) -> None:
        """At exit: no more jobs, the worker killed, the jobs left unfinished cancelled (their
        files deleted) and the worker's directory removed: its reader thread, which would
        do both, may never run again before the process ends."""
        with self._lock:
            self._stopped = True
            left = [*self._queue, *([self._running] if self._running is not None else [])]
            self._queue.clear()
            workers = list(self._workers)  # a replaced one may still be ending (_start)
            for proc in workers:
                if proc.poll() is None:
                    _kill_group(proc)
            for job in left:
                job._finish(-9, "cancelled")
        for proc in workers:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(5)  # killed: gone in milliseconds, and its directory unused then
            _remove_home(proc)

    def _feed(self) -> None:
        """Send the next job if none runs (under the lock)."""
        while self._running is None and self._queue and not self._stopped:
            job = self._queue.popleft()
            if job.cancelled:  # marked while the lock was held (cancel)
                job._finish(-9, "cancelled")
                continue
            if self._proc is None or self._proc.poll() is not None or self._env != job.env:
                self._start(job.env)
            line = json.dumps({"id": job.id, "module": job.module, "path": job.path})
            try:
                self._proc.stdin.write(line.encode() + b"\n")
                self._proc.stdin.flush()
                self._running, job.proc = job, self._proc
                job.sent += 1
            except (OSError, ValueError):  # it exited meanwhile: a fresh one takes the job
                self._proc = None
                self._queue.appendleft(job)

    def _start(self, env: dict[str, str]) -> None:
        if self._proc is not None and self._proc.poll() is None:
            self._proc.stdin.close()  # other settings: the old worker ends after its job
        log = tempfile.TemporaryFile()
        full = {k: v for k, v in os.environ.items() if not k.startswith(_ENV_PREFIXES)}
        # Its own process group (a Ctrl-C in the terminal interrupts the training, not the
        # compile) but not its own session: see yield_cpu.
        group = {"process_group": 0} if sys.version_info >= (3, 11) else {}
        # A working directory of its own (module docstring); what it or its compilers leave
        # there goes with it (_remove_home).
        home = tempfile.mkdtemp(prefix="autopar-warmup-")
        try:
            proc = subprocess.Popen(
                [sys.executable, "-I", "-c", _BOOT, _PACKAGE_ROOT, str(os.getpid())],
                env={**full, **env}, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                stderr=log, cwd=home, **group,
            )  # fmt: skip
        except BaseException:
            shutil.rmtree(home, ignore_errors=True)
            log.close()
            raise
        yield_cpu(proc.pid)  # at once: importing torch alone takes seconds of CPU
        proc.log, proc.home = log, home
        self._proc, self._env = proc, env
        self._workers.add(proc)
        threading.Thread(target=self._read, args=(proc,), daemon=True,
                         name="autopar-warmup-reader").start()  # fmt: skip

    def _read(self, proc: subprocess.Popen) -> None:
        """The worker's results, as they come; at its end, the job it left unfinished."""
        for line in proc.stdout:
            try:
                msg = json.loads(line)
            except ValueError:  # not a reply (the worker's prints go to its log): skip
                continue
            with self._lock:
                job = self._running
                if job is not None and job.id == msg["id"]:
                    self._running = None
                    job._finish(msg["rc"], msg["error"])
                self._feed()
        rc = proc.wait()
        with self._lock:
            if self._proc is proc:
                self._proc = None
            job = self._running
            if job is not None and job.proc is proc:  # sent to this worker, never answered
                self._running = None
                if job.cancelled or self._stopped:
                    job._finish(-9, "cancelled")
                elif job.sent < 2:  # it exited idle as the job came, or was killed: again
                    self._queue.appendleft(job)
                else:  # twice: the job itself kills it
                    job._finish(rc or 1, f"the warm-up worker exited ({rc}): {_last_line(proc)}")
            self._feed()
            self._workers.discard(proc)
        _remove_home(proc)
        for f in (proc.stdin, proc.stdout, getattr(proc, "log", None)):
            try:
                f.close()
            except (AttributeError, OSError, ValueError):
                pass


def _kill_group(proc) -> None:
    """Kill the worker ``proc`` and everything it started: it leads its own process group
    (``_Worker._start``), and a compiler it ran (ninja and c++ for the native interpreter)
    would otherwise go on as an orphan, writing into the build directory the next builder
    uses."""
    try:
        if os.getpgid(proc.pid) == proc.pid:
            os.killpg(proc.pid, signal.SIGKILL)
            return
    except (AttributeError, OSError):  # not POSIX, or already gone
        pass
    with contextlib.suppress(OSError):
        proc.kill()


def _remove_home(proc) -> None:
    """Remove the ended worker ``proc``'s working directory (``_Worker._start``)."""
    home = getattr(proc, "home", None)
    if home is not None:
        shutil.rmtree(home, ignore_errors=True)


def _kill_own_group() -> None:
    """The worker's own end (its parent is gone): its compilers with it, when it leads its
    process group (started by ``_Worker``, not from a shell script's group)."""
    with contextlib.suppress(AttributeError, OSError):
        if os.getpgid(0) == os.getpid():
            os.killpg(0, signal.SIGKILL)


def _last_line(proc) -> str:
    log = getattr(proc, "log", None)
    if log is None:
        return ""
    log.seek(0)
    lines = log.read().decode(errors="replace").strip().splitlines()
    return lines[-1] if lines else ""


def _compile_env() -> dict[str, str]:
    """The settings a compile depends on beyond its job file: the Inductor cache directory
    (as Inductor would pick it, without creating it) and the variables of ``_ENV_PREFIXES``,
    the directories of :data:`_DIR_VARS` made absolute (the worker runs in a directory of
    its own: a relative one would name another place there)."""
    env = {k: v for k, v in os.environ.items() if k.startswith(_ENV_PREFIXES)}
    if "TORCHINDUCTOR_CACHE_DIR" not in env:
        from autopar import compat

        env["TORCHINDUCTOR_CACHE_DIR"] = compat.inductor_default_cache_dir()
    for k in _DIR_VARS:
        if env.get(k):
            env[k] = os.path.abspath(env[k])
    return env


_WORKER = _Worker()
atexit.register(_WORKER.stop)


def spawn_warmup(module: str, job: str) -> WarmupJob:
    """Queue ``<module>._warmup_main(job)`` for the worker process; the returned handle
    says when it finished (``poll``, ``wait``) and cancels it (``kill``)."""
    return _WORKER.submit(module, job)


def warmup_error(job: WarmupJob) -> str:
    """Why a finished warm-up failed (its exception, one line); empty when it succeeded."""
    return job.error if job.returncode else ""


# -- the worker's side ----------------------------------------------------------------------
def _warmup_main(path: str) -> int:
    """This module's own job: write the worker's pid, scheduling policy, session, working
    directory, ``sys.path`` and ``autopar`` package to ``<path>.out`` (JSON; not ``path``,
    the job file, which the parent deletes when the job ends). Shows which process ran a
    job, that it yields the CPU, and where it runs (tests)."""
    import autopar

    policy = os.sched_getscheduler(0) if hasattr(os, "sched_getscheduler") else None
    with open(path + ".out", "w") as f:
        json.dump({"pid": os.getpid(), "policy": policy, "sid": os.getsid(0),
                   "cwd": os.getcwd(), "sys_path": sys.path,
                   "autopar": os.path.dirname(autopar.__file__)}, f)  # fmt: skip
    return 0


def _worker_main(parent: int) -> int:
    import importlib
    import select
    import traceback

    exit_with_parent(parent)
    yield_cpu()
    replies = os.fdopen(os.dup(1), "w")  # the protocol's stdout; fd 1 goes to the log:
    os.dup2(2, 1)  # a compile's prints (g++, Inductor) must not reach the parent's reader
    import autopar  # noqa: F401 - torch and autopar's ops before the first job arrives

    while True:
        ready, _, _ = select.select([sys.stdin], [], [], IDLE_EXIT_S)
        line = sys.stdin.readline() if ready else ""
        if not line:  # idle, or the parent closed the pipe
            return 0
        job = json.loads(line)
        rc, error = 0, ""
        try:
            importlib.import_module(job["module"])._warmup_main(job["path"])
        except BaseException as exc:  # noqa: BLE001 - reported; the next job still runs
            traceback.print_exc()
            last = str(exc).strip().splitlines()
            rc, error = 1, f"{type(exc).__name__}: {last[-1] if last else ''}"
        replies.write(json.dumps({"id": job["id"], "rc": rc, "error": error}) + "\n")
        replies.flush()


if __name__ == "__main__":  # by hand (the parent starts it isolated: _BOOT)
    sys.exit(_worker_main(int(sys.argv[1])))
