"""Building the native interpreter survives a build that was killed: torch's build lock is a
file only its holder removes, so a warm-up worker killed while it compiled (the training
process exited) once made every later build wait forever, and the training paid the
compile's share of every step meanwhile. No compiler runs here: ``compile_it`` stands in
for torch's build."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading

from autopar.runtime import native


def _fake_build(d, calls):
    def compile_it():
        # torch's FileBaton would wait for this file forever: it must be gone by now
        assert not os.path.exists(os.path.join(d, "lock"))
        calls.append(1)
        with open(os.path.join(d, native._name() + ".so"), "w") as f:
            f.write("library")
        return "module"

    return compile_it


def _within(seconds, fn):
    out = []
    t = threading.Thread(target=lambda: out.append(fn()), daemon=True)
    t.start()
    t.join(seconds)
    assert not t.is_alive(), "the build waited for a lock nobody holds"
    return out[0]


def test_a_killed_builders_locks_do_not_block_the_next_build(tmp_path):
    d = str(tmp_path)
    # a builder that holds both locks, as a warm-up worker mid-build does, is killed
    holder = subprocess.Popen([sys.executable, "-c", (
        "import filelock, os, sys, time\n"
        f"filelock.FileLock(os.path.join({d!r}, 'autopar-build.lock')).acquire()\n"
        f"open(os.path.join({d!r}, 'lock'), 'w').close()\n"
        "print('held', flush=True); time.sleep(600)\n")],
        stdout=subprocess.PIPE, text=True)  # fmt: skip
    assert holder.stdout.readline().strip() == "held"
    os.kill(holder.pid, signal.SIGKILL)
    holder.wait()
    assert native._built_library(d) is None  # the torch lock left behind: not finished
    calls = []
    assert _within(30, lambda: native.build_once(d, _fake_build(d, calls))) == "module"
    assert calls == [1]
    assert native._built_library(d) == os.path.join(d, native._name() + ".so")


def test_a_build_another_process_finished_is_not_built_again(tmp_path):
    d = str(tmp_path)
    calls = []
    assert native.build_once(d, _fake_build(d, calls)) == "module"
    assert native.build_once(d, _fake_build(d, calls)) is None
    assert calls == [1]


def test_a_library_without_the_mark_counts_as_built_once_torchs_lock_is_gone(tmp_path):
    d = str(tmp_path)
    lib = os.path.join(d, native._name() + ".so")
    open(lib, "w").close()  # built before the mark existed
    assert native._built_library(d) == lib
    open(os.path.join(d, "lock"), "w").close()  # or killed while linking it
    assert native._built_library(d) is None


def test_a_stopped_build_is_not_started_again_for_the_next_graph(monkeypatch):
    """Past WARMUP_LIMIT_S the tiers stop the build: another graph's native candidate must
    not start it again (it would wait for the limit once more); a failed build is retried."""
    from autopar.runtime import native_tier

    class Job:
        def __init__(self):
            self.returncode, self.cancelled = None, False

        def poll(self):
            return self.returncode

    jobs = []
    monkeypatch.setattr(native, "available", lambda: False)
    monkeypatch.setattr(native_tier, "_job", None)

    def spawn(module, path):
        os.unlink(path)  # the worker would read and delete the job file
        jobs.append(Job())
        return jobs[-1]

    monkeypatch.setattr(native_tier, "spawn_warmup", spawn)
    first = native_tier.start_native_build()
    first.returncode, first.cancelled = -9, True  # stopped at the limit
    assert native_tier.start_native_build() is first
    first.cancelled = False  # failed by itself instead: tried again
    assert native_tier.start_native_build() is not first
    assert len(jobs) == 2
