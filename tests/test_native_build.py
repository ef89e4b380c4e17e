"""Building the native interpreter survives a build that was killed: torch's build lock is a
file only its holder removes, so a warm-up worker killed while it compiled (the training
process exited) once made every later build wait forever, and the training paid the
compile's share of every step meanwhile. No compiler runs here: ``compile_it`` stands in
for torch's build. Without a compiler the interpreter is off, the log says why once, and
the tests that need it skip, saying why."""

from __future__ import annotations

import json
import os
import re
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
    """A build stopped (cancelled) is not started again for the next graph planned; a failed
    build is retried."""
    from autopar.runtime import native_build as native_tier

    class Job:
        def __init__(self):
            self.returncode, self.cancelled = None, False

        def poll(self):
            return self.returncode

    jobs = []
    monkeypatch.setattr(native, "available", lambda: False)
    monkeypatch.setattr(native, "cannot_build", lambda: None)
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


#: Without a compiler: what cannot_build says under $CXX and under $PATH, and what
#: available() and load() do (the log line once, however often they are asked).
_NO_COMPILER = """
import json, logging, os, sys
from autopar.runtime import native

lines = []
handler = logging.Handler()
handler.emit = lambda r: lines.append(r.getMessage())
logging.getLogger("autopar").addHandler(handler)
reasons = [native.cannot_build()]
cxx = os.environ.pop("CXX")
os.environ["PATH"] = sys.argv[1]  # a directory without c++
reasons.append(native.cannot_build())
os.environ["CXX"] = cxx
states = [native.available(), native.available()]
errors = []
for build in (False, True):
    try:
        native.load(build=build)
    except RuntimeError as e:
        errors.append(str(e))
print(json.dumps({"reasons": reasons, "states": states, "errors": errors, "lines": lines}))
"""


def _without_a_compiler(tmp_path) -> dict[str, str]:
    """This environment with ``$CXX`` naming no compiler and an empty extension cache (so
    nothing is built: a finished build would load without a compiler)."""
    return {**os.environ, "CXX": "/nonexistent/c++", "TORCH_EXTENSIONS_DIR": str(tmp_path / "ext")}


def test_without_a_compiler_the_interpreter_is_off_and_the_log_says_so_once(tmp_path):
    """No C++ compiler: not "not built yet" (no build will come), but why, once."""
    empty = tmp_path / "bin"
    empty.mkdir()
    out = subprocess.run([sys.executable, "-c", _NO_COMPILER, str(empty)], capture_output=True,
                         text=True, timeout=300, env=_without_a_compiler(tmp_path))  # fmt: skip
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout.splitlines()[-1])
    assert got["reasons"] == ["no C++ compiler found ($CXX=/nonexistent/c++ not found)",
                              "no C++ compiler found (c++ not on $PATH)"]  # fmt: skip
    assert got["states"] == [False, False]
    assert len(got["errors"]) == 2
    for e in got["errors"]:
        assert e.startswith("no C++ compiler found") and "not built yet" not in e
    assert got["lines"] == [
        "autopar: no C++ compiler found ($CXX=/nonexistent/c++ not found); the native "
        "interpreter is off and planned programs run in Python, slower"
    ]


def test_the_native_tests_skip_without_a_compiler(tmp_path):
    """Their module fixture asks native.cannot_build: skipped, with the reason, not errors."""
    tests = os.path.dirname(os.path.abspath(__file__))
    out = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-rs",
         os.path.join(tests, "test_native.py"), os.path.join(tests, "test_native_direct.py")],
        capture_output=True, text=True, timeout=600, env=_without_a_compiler(tmp_path),
        cwd=os.path.dirname(tests),
    )  # fmt: skip
    summary = out.stdout.strip().splitlines()[-1]  # "32 skipped in 5.1s": no error, no pass
    assert out.returncode == 0 and re.fullmatch(r"\d+ skipped in .*", summary), out.stdout[-3000:]
    assert "no C++ compiler found ($CXX=/nonexistent/c++ not found)" in out.stdout
