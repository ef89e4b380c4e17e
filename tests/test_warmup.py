"""The warm-up worker (``autopar.codegen.warmup``): one background process compiles the
executors' builds one job after another, at ``SCHED_IDLE``; failures, cancels and a dead
worker are reported per job, and the next job still runs; the worker runs isolated from the
training's directory, and no job file outlives its job."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

from autopar.codegen import warmup
from autopar.codegen.warmup import spawn_warmup, warmup_error

THIS = "autopar.codegen.warmup"  # its own job writes the worker's pid and policy


def _ran_in(job, path) -> dict:
    """What the job ``spawn_warmup(THIS, path)`` wrote (to ``<path>.out``: ``path`` is the
    job file, deleted when the job ends)."""
    job.wait(timeout=300)
    assert job.returncode == 0, warmup_error(job)
    with open(f"{path}.out") as f:
        return json.load(f)


def test_jobs_share_one_worker_that_yields_the_cpu(tmp_path):
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    ja, jb = spawn_warmup(THIS, str(a)), spawn_warmup(THIS, str(b))
    first, second = _ran_in(ja, a), _ran_in(jb, b)
    assert first["pid"] == second["pid"] != os.getpid()
    if hasattr(os, "SCHED_IDLE"):
        assert first["policy"] == os.SCHED_IDLE
    # the same session: a session of its own is a scheduling group of its own (autogroups),
    # where SCHED_IDLE no longer yields to the training process
    assert first["sid"] == os.getsid(0)


def test_a_failed_job_is_reported_and_the_next_one_runs(tmp_path):
    bad = spawn_warmup("autopar.codegen.joint", str(tmp_path / "missing.pt"))
    good = tmp_path / "good.json"
    after = spawn_warmup(THIS, str(good))
    bad.wait(timeout=300)
    assert bad.returncode != 0 and "FileNotFoundError" in warmup_error(bad)
    assert _ran_in(after, good)["pid"] != os.getpid()


def test_a_queued_job_can_be_cancelled(tmp_path):
    first, second = tmp_path / "1.json", tmp_path / "2.json"
    j1, j2 = spawn_warmup(THIS, str(first)), spawn_warmup(THIS, str(second))
    j2.kill()  # still queued behind j1: never sent
    assert j2.poll() == -9
    _ran_in(j1, first)
    assert not os.path.exists(f"{second}.out")


def test_a_killed_worker_is_replaced(tmp_path):
    p = tmp_path / "p.json"
    before = _ran_in(spawn_warmup(THIS, str(p)), p)["pid"]
    os.kill(before, 9)  # as if the OOM killer took it between jobs
    q = tmp_path / "q.json"
    assert _ran_in(spawn_warmup(THIS, str(q)), q)["pid"] not in (before, os.getpid())


def test_another_inductor_cache_gets_another_worker(tmp_path, monkeypatch):
    p, q = tmp_path / "p.json", tmp_path / "q.json"
    before = _ran_in(spawn_warmup(THIS, str(p)), p)["pid"]
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "cache"))
    assert _ran_in(spawn_warmup(THIS, str(q)), q)["pid"] != before


def test_a_worker_that_exits_idle_as_a_job_arrives_hands_the_job_on(tmp_path):
    """The worker exits after IDLE_EXIT_S without a job; a job sent just then is not lost."""
    p = tmp_path / "p.json"
    _ran_in(spawn_warmup(THIS, str(p)), p)
    proc = warmup._WORKER._proc
    proc.stdin.close()  # the worker ends as if idle (exit status 0)
    proc.wait(timeout=60)
    q = tmp_path / "q.json"
    assert _ran_in(spawn_warmup(THIS, str(q)), q)["pid"] != proc.pid


def test_a_job_that_kills_its_worker_twice_fails(tmp_path, monkeypatch):
    """A job whose worker dies unanswered goes to a fresh worker once, then fails."""
    import threading

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "c"))  # a fresh worker: it
    p = tmp_path / "p.json"  # imports torch for seconds before it can answer
    job = spawn_warmup(THIS, str(p))
    killed = []

    def kill_workers():  # each worker this job is sent to dies before it answers
        while job.poll() is None and len(killed) < 5:
            proc = job.proc
            if proc is not None and proc.pid not in killed:
                proc.kill()
                killed.append(proc.pid)

    t = threading.Thread(target=kill_workers)
    t.start()
    job.wait(timeout=300)
    t.join()
    assert job.returncode != 0 and "worker exited" in warmup_error(job), warmup_error(job)
    assert len(killed) == 2


def test_killing_a_worker_kills_the_compilers_it_started():
    """A compiler the worker ran (ninja, c++) must not go on as an orphan, writing into the
    build directory the next builder uses: the worker leads its process group, all killed."""
    from autopar.codegen.warmup import _kill_group

    worker = subprocess.Popen(
        [sys.executable, "-c", "import subprocess, sys, time\n"
         "c = subprocess.Popen(['sleep', '600'])\n"
         "print(c.pid, flush=True); time.sleep(600)\n"],
        stdout=subprocess.PIPE, text=True, start_new_session=True,  # it leads its group
    )  # fmt: skip
    child = int(worker.stdout.readline())
    _kill_group(worker)
    worker.wait(10)
    for _ in range(100):  # the child dies with the group (then its zombie is reaped by init)
        try:
            os.kill(child, 0)
        except ProcessLookupError:
            break
        try:
            with open(f"/proc/{child}/stat") as f:
                if f.read().split(")")[1].split()[0] == "Z":  # dead, not yet reaped
                    break
        except FileNotFoundError:
            break
        time.sleep(0.05)
    else:
        raise AssertionError("the worker's child outlived it")


def test_the_worker_runs_isolated_from_the_training_directory(tmp_path, monkeypatch):
    """A module in the directory the training runs in (or on its PYTHONPATH) is not the
    worker's: it runs ``python -I`` in a directory of its own, removed when it ends, and
    imports this autopar package."""
    import autopar

    user = tmp_path / "training"
    user.mkdir()
    (user / "json.py").write_text("raise ImportError('the training directory was imported')\n")
    monkeypatch.chdir(user)
    monkeypatch.setenv("PYTHONPATH", str(user))
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "c"))  # a fresh worker
    p = tmp_path / "p.json"
    got = _ran_in(spawn_warmup(THIS, str(p)), p)
    home = got["cwd"]
    assert os.path.realpath(home) != os.path.realpath(user)
    assert not {str(user), ""} & set(got["sys_path"])
    assert got["autopar"] == os.path.dirname(autopar.__file__)
    proc = warmup._WORKER._proc
    assert proc.pid == got["pid"] and os.path.isdir(home)
    proc.stdin.close()  # the worker ends (as if idle): its directory goes with it
    proc.wait(timeout=60)
    for _ in range(100):
        if not os.path.exists(home):
            break
        time.sleep(0.05)
    assert not os.path.exists(home)


def test_no_job_file_outlives_its_job(tmp_path):
    """A job's file (a pickled graph in $TMPDIR) is deleted when the job ends: finished,
    cancelled while queued, or stopped at exit (the worker deletes it only when it loads
    it; this module's own job never does)."""
    files = [tmp_path / f"{name}.pt" for name in ("done", "cancelled", "running", "queued")]
    for f in files:
        f.write_bytes(b"a pickled graph")
    done, cancelled, running, queued = files
    first, second = spawn_warmup(THIS, str(done)), spawn_warmup(THIS, str(cancelled))
    second.kill()  # queued behind the first
    assert second.poll() == -9 and not cancelled.exists()
    _ran_in(first, done)
    assert not done.exists()

    worker = warmup._Worker()  # another training process's, stopped at its exit
    jobs = [worker.submit(THIS, str(running)), worker.submit(THIS, str(queued))]
    proc = worker._proc
    worker.stop()
    assert [j.poll() for j in jobs] == [-9, -9]
    assert not running.exists() and not queued.exists()
    assert proc.poll() is not None and not os.path.exists(proc.home)


def test_relative_directories_reach_the_worker_absolute(tmp_path, monkeypatch):
    """The worker runs in a directory of its own: a relative cache directory would name
    another place there (its native build would be lost with that directory)."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", "ext")
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", "inductor")
    env = warmup._compile_env()
    assert env["TORCH_EXTENSIONS_DIR"] == os.path.join(os.getcwd(), "ext")
    assert env["TORCHINDUCTOR_CACHE_DIR"] == os.path.join(os.getcwd(), "inductor")


def test_the_worker_knows_autopar_ops_before_its_first_job():
    """The worker imports autopar and nothing else before it unpickles a graph: every
    ``torch.ops.autopar`` op autopar defines must exist after ``import autopar`` alone (a
    GRU graph's warm-up failed on ``autopar.gru_layer`` and compiled cold on the training
    thread instead: a 13 s stall)."""
    code = (
        "import pkgutil, importlib, torch, autopar, autopar.rnn\n"
        "before = {n for n in dir(torch.ops.autopar)}\n"
        "for m in pkgutil.iter_modules(autopar.rnn.__path__):\n"
        "    importlib.import_module('autopar.rnn.' + m.name)\n"
        "after = {n for n in dir(torch.ops.autopar)}\n"
        "print(sorted(after - before))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True)  # fmt: skip
    assert out.stdout.strip().splitlines()[-1] == "[]"
