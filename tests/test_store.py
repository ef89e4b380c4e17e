"""The profile store: round trip, its key, quality-aware merge, every kind of bad file handled
once, and several processes writing one store (one of them killed mid-write)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import warnings

import pytest

from autopar.errors import StoreWarning
from autopar.profiling.store import (
    STORE_FORMAT,
    STORE_VERSION,
    ProfileStore,
    default_file_name,
    machine_fingerprint,
    openmp_library,
    read_store_file,
    store_key,
    torch_version,
    validate_record,
)
from autopar.profiling.storefiles import (
    STALE_TMP_S,
    backup_file,
    host_tag,
    remove_orphaned_tmp,
)

REC = {"target": "aten.mm.default", "time_s": 1.5e-5, "time_1t_s": 2.5e-5, "flops": 1024}


def _file(tmp_path, ops=None, **header):
    doc = {
        "format": STORE_FORMAT,
        "version": STORE_VERSION,
        **store_key(),
        "ops": {"a" * 16: REC} if ops is None else ops,
        "calibration": {},
    }
    doc.update(header)
    path = tmp_path / "p.json"
    path.write_text(json.dumps(doc))
    return path


def test_round_trip_directory_mode(tmp_path):
    store = ProfileStore(tmp_path / "profiles")
    assert store.path == str(tmp_path / "profiles" / default_file_name())
    assert not os.path.exists(store.path)  # nothing is written before flush()
    store.put("0123456789abcdef", REC)
    store.put_calibration("cpu_matmul", {"gflops": 12.5, "points": [[1, 2.0e-6]]})
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a clean round trip warns about nothing
        store.flush()
        again = ProfileStore(tmp_path / "profiles")
    assert len(again) == 1 and "0123456789abcdef" in again
    assert again.get("0123456789abcdef") == REC
    assert again.get_calibration("cpu_matmul") == {"gflops": 12.5, "points": [[1, 2.0e-6]]}
    assert again.get("missing") is None and again.get_calibration("missing") is None
    doc = json.loads(open(store.path).read())
    assert doc["format"] == STORE_FORMAT and doc["version"] == STORE_VERSION
    assert doc["machine"] == machine_fingerprint() and doc["torch"] == torch_version()
    assert doc["openmp"] == openmp_library()
    names = {p.name for p in (tmp_path / "profiles").iterdir()}
    name = os.path.basename(store.path)
    assert names <= {name, name + ".lock"}  # the lock file may stay (empty)


def test_json_file_mode_and_env_default(tmp_path, monkeypatch):
    assert ProfileStore(tmp_path / "mine.json").path == str(tmp_path / "mine.json")
    monkeypatch.setenv("AUTOPAR_PROFILE_DIR", str(tmp_path / "envdir"))
    assert ProfileStore().path.startswith(str(tmp_path / "envdir"))


def test_memory_store_never_writes(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    store = ProfileStore.memory()
    store.put("s", REC)
    store.flush()
    assert store.path is None and store.get("s") == REC and list(tmp_path.iterdir()) == []


def test_get_returns_a_copy():
    store = ProfileStore.memory()
    store.put("s", REC)
    store.get("s")["time_s"] = 99.0
    assert store.get("s")["time_s"] == REC["time_s"]


@pytest.mark.parametrize(
    "bad",
    [{"time_s": -1.0}, {"time_s": float("nan")}, {"time_s": float("inf")}, {"flops": 3},
     {"time_s": 1.0, "flops": -5}, {"time_s": 1.0, "bytes_read": object()}, [1.0]],
)  # fmt: skip
def test_put_rejects_invalid_records(bad):
    store = ProfileStore.memory()
    with pytest.raises(ValueError, match="refusing to store"):
        store.put("s", bad)
    assert len(store) == 0


def test_calibration_may_hold_negative_intercepts():
    assert validate_record({"intercept": -1e-6, "slope": 2.0}, op=False) is None
    assert validate_record({"launch_s": -1e-6}, op=False) is not None


def _bad_files():
    good = {
        "format": STORE_FORMAT,
        "version": STORE_VERSION,
        **store_key(),
        "ops": {"a" * 16: REC},
        "calibration": {},
    }
    text = json.dumps(good)
    return {
        "garbage": ("\x00\x01 not json at all", "not valid JSON"),
        "truncated": (text[: len(text) // 2], "not valid JSON"),
        "empty": ("", "empty"),
        "wrong_format": (json.dumps({**good, "format": "something-else"}), "not an autopar"),
        "list": ("[1, 2, 3]", "not an autopar"),
        "foreign_version": (json.dumps({**good, "version": 99}), "format version 99"),
        "foreign_machine": (
            json.dumps({**good, "machine": {**good["machine"], "cpu": "Other CPU 9000"}}),
            "another machine",
        ),
        "foreign_torch": (json.dumps({**good, "torch": "1.0.0"}), "torch '1.0.0'"),
        "foreign_openmp": (json.dumps({**good, "openmp": "libiomp5.so"}), "'libiomp5.so'"),
        "version_1": (json.dumps({**good, "version": 1}), "format version 1"),
        "no_ops": (json.dumps({k: v for k, v in good.items() if k != "ops"}), "no 'ops'"),
    }


@pytest.mark.parametrize("kind", sorted(_bad_files()))
def test_bad_file_warns_once_moves_aside_and_recovers(tmp_path, kind):
    text, why = _bad_files()[kind]
    path = tmp_path / "p.json"
    path.write_text(text)
    with pytest.warns(StoreWarning) as caught:
        store = ProfileStore(path)
        store.put("b" * 16, REC)
        store.flush()  # the new file is written without a second warning
    assert len(caught) == 1, [str(w.message) for w in caught]
    msg = str(caught[0].message)
    assert str(path) in msg and why in msg and "re-measured" in msg
    (backup,) = tmp_path.glob("p.json.corrupt-*")
    assert str(backup) in msg  # the one warning says where the file went
    assert backup.read_text() == text  # kept for inspection
    assert len(store) == 1 and store.get("a" * 16) is None  # nothing of it was trusted
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert ProfileStore(path).get("b" * 16) == REC


def test_invalid_entries_are_dropped_and_valid_ones_kept(tmp_path):
    ops = {"good": REC, "neg": {**REC, "time_s": -2.0}, "nan": {**REC, "time_1t_s": "x"}}
    path = _file(tmp_path, ops=ops)
    text = path.read_text().replace('"x"', "NaN")  # Python's json reads NaN: it must not pass
    path.write_text(text)
    with pytest.warns(StoreWarning, match="2 invalid entries") as caught:
        store = ProfileStore(path)
    assert len(caught) == 1
    assert store.get("good") == REC and "neg" not in store and "nan" not in store


def test_flush_merges_with_concurrent_writer(tmp_path):
    path = tmp_path / "shared.json"
    a, b = ProfileStore(path), ProfileStore(path)  # both loaded an empty store
    a.put("from_a", REC)
    a.put("both", {**REC, "time_s": 1.0})
    a.flush()
    b.put("from_b", REC)
    b.put("both", {**REC, "time_s": 2.0})
    b.flush()  # must keep a's entries, and its own value wins on a conflict
    merged = ProfileStore(path)
    assert {"from_a", "from_b", "both"} <= set(merged)
    # They disagree (2x) and neither says it is provisional: the faster is the one kept.
    assert merged.get("both")["time_s"] == 1.0 and b.get("both")["time_s"] == 1.0
    assert b.get("from_a") == REC  # the merge is visible in memory too
    assert not [p for p in tmp_path.iterdir() if p.suffix == ".tmp"]  # temp files cleaned up


def test_unwritable_location_warns_once_and_keeps_memory(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("a file where a directory should be")
    store = ProfileStore(blocker / "sub" / "p.json")
    store.put("s", REC)
    with pytest.warns(StoreWarning, match="could not be written") as caught:
        store.flush()
        store.put("t", REC)
        store.flush()  # still failing: no second warning
    assert len(caught) == 1
    assert store.get("s") == REC and store.get("t") == REC


def test_non_utf8_file_is_backed_up_not_overwritten(tmp_path):
    raw = b"\xff\xfe\x00\x81 binary garbage \xc3"
    path = tmp_path / "p.json"
    path.write_bytes(raw)
    with pytest.warns(StoreWarning, match="not UTF-8") as caught:
        store = ProfileStore(path)
        store.put("b" * 16, REC)
        store.flush()
    assert len(caught) == 1
    (backup,) = tmp_path.glob("p.json.corrupt-*")
    assert str(backup) in str(caught[0].message)
    assert backup.read_bytes() == raw  # byte for byte
    assert ProfileStore(path).get("b" * 16) == REC


def test_every_bad_file_gets_its_own_backup(tmp_path):
    """A store from a newer autopar, replaced, then written again by it: the second backup
    must not overwrite the first (the old code renamed both to the same ``.corrupt``)."""
    path = tmp_path / "p.json"
    newer = [json.dumps({"format": STORE_FORMAT, "version": STORE_VERSION + 1, "n": i})
             for i in range(3)]  # fmt: skip
    for text in newer:
        path.write_text(text)
        with pytest.warns(StoreWarning, match="format version") as caught:
            store = ProfileStore(path)
            store.put("b" * 16, REC)
            store.flush()
        assert len(caught) == 1
    backups = sorted(tmp_path.glob("p.json.corrupt-*"))
    assert sorted(b.read_text() for b in backups) == sorted(newer)
    assert ProfileStore(path).get("b" * 16) == REC


def test_backup_names_never_collide(tmp_path):
    path = tmp_path / "p.json"
    names = []
    for i in range(3):  # same process, most likely the same second: numbered names
        path.write_text(f"bad {i}")
        names.append(backup_file(str(path)))
    assert len(set(names)) == 3 and not path.exists()
    assert [open(n).read() for n in names] == ["bad 0", "bad 1", "bad 2"]


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()  # reaped: the pid names no process now
    return proc.pid


def test_orphaned_temporary_files_are_removed(tmp_path):
    host, me = host_tag(), os.getpid()
    files = {
        f"p.json.{host}-{_dead_pid()}.abc123.tmp": False,  # its writer was killed
        f"p.json.{host}-{me}.fresh1.tmp": True,  # writer alive, recent: maybe mid-write
        f"p.json.{host}-{me}.stale1.tmp": False,  # alive pid, but far too old
        f"p.json.otherhost-{me}.fresh2.tmp": True,  # another host: only age can tell
        "p.json.k3x9q_ab.tmp": True,  # the old unnamed format, recent
        "p.json.k3x9q_cd.tmp": False,  # the old unnamed format, old
        f"other.json.{host}-{_dead_pid()}.x1.tmp": True,  # another store's
        "p.json.notes": True,  # not a temporary file
    }
    old = time.time() - 2 * STALE_TMP_S
    for name in files:
        (tmp_path / name).write_text("{")
        if "stale1" in name or "_cd" in name:
            os.utime(tmp_path / name, (old, old))
    store = ProfileStore(tmp_path / "p.json")
    store.put("s" * 16, REC)
    store.flush()
    left = {p.name for p in tmp_path.iterdir()} - {"p.json.lock"}
    assert left == {name for name, kept in files.items() if kept} | {"p.json"}
    assert remove_orphaned_tmp(str(tmp_path / "p.json")) == []  # nothing more to clean


def test_flush_names_its_temporary_file_after_its_writer(tmp_path, monkeypatch):
    """The pid in the name is what lets a later flush tell a killed writer's file."""
    seen = []
    real = os.replace

    def spy(src, dst):
        seen.append(os.path.basename(src))
        return real(src, dst)

    monkeypatch.setattr(os, "replace", spy)
    store = ProfileStore(tmp_path / "p.json")
    store.put("s" * 16, REC)
    store.flush()
    (name,) = seen
    assert name.startswith(f"p.json.{host_tag()}-{os.getpid()}.") and name.endswith(".tmp")


def test_a_rewritten_store_file_keeps_its_mode(tmp_path):
    """A store shared by a group (mode 0664, say) stays shared after another flush: the
    temporary file that replaces it must not keep its own 0600."""
    path = tmp_path / "p.json"
    store = ProfileStore(path)
    store.put("a" * 16, REC)
    store.flush()
    for mode in (0o664, 0o640, 0o600):
        os.chmod(path, mode)
        store.put(f"{mode:o}" * 4, REC)
        store.flush()
        assert os.stat(path).st_mode & 0o7777 == mode
        assert f"{mode:o}" * 4 in ProfileStore(path)  # rewritten, not left alone


@pytest.mark.parametrize("umask", [0o022, 0o002, 0o077])
def test_a_new_store_file_gets_the_umasks_mode(tmp_path, umask):
    """As a plain open() would create it: 0o666 less the process umask."""
    path = tmp_path / "p.json"
    store = ProfileStore(path)
    store.put("a" * 16, REC)
    old = os.umask(umask)
    try:
        store.flush()
    finally:
        os.umask(old)
    assert os.stat(path).st_mode & 0o7777 == 0o666 & ~umask


# -- the key -------------------------------------------------------------------------------------
def test_file_name_spells_the_key():
    name = default_file_name()
    m = machine_fingerprint()
    assert f"-{m['usable_cores']}c-" in name and "torch" in name and name.endswith(".json")
    other = default_file_name(openmp="libiomp5.so")
    assert other != name and other.endswith("-iomp5.json")
    assert default_file_name(torch_ver="9.9.9") != name
    assert default_file_name(machine={**m, "usable_cores": m["usable_cores"] + 1}) != name
    assert sorted(store_key()) == ["machine", "openmp", "torch"]


def test_read_store_file_reads_foreign_files_without_moving_them(tmp_path):
    path = _file(tmp_path, torch="0.1")
    assert read_store_file(str(path))["torch"] == "0.1" and path.exists()
    (tmp_path / "x.json").write_text("[]")
    with pytest.raises(ValueError, match="not an autopar profile"):
        read_store_file(str(tmp_path / "x.json"))


# -- two measurements of one signature -------------------------------------------------------
CLEAN = {**REC, "quality": "clean"}
PROV = {**REC, "quality": "provisional", "reason": "5/5 samples disturbed"}


def test_provisional_never_replaces_clean():
    store = ProfileStore.memory()
    assert store.put("s", CLEAN)
    for t in (REC["time_s"] * 100, REC["time_s"] / 100, REC["time_s"]):
        assert not store.put("s", {**PROV, "time_s": t})  # faster, slower, equal: kept out
    assert store.get("s") == CLEAN
    store.put("p", PROV)
    assert store.put("p", {**CLEAN, "time_s": 9.0})  # clean replaces provisional, any time
    assert store.get("p")["quality"] == "clean"


def test_of_two_disagreeing_clean_measurements_the_faster_is_kept():
    store = ProfileStore.memory()
    store.put("s", {**CLEAN, "time_s": 24e-3})  # the issue's poisoned 1x1 conv
    assert store.put("s", {**CLEAN, "time_s": 0.43e-3})
    assert not store.put("s", {**CLEAN, "time_s": 24e-3})
    assert store.put("s", {**CLEAN, "time_s": 0.5e-3})  # they agree: the newer one
    assert store.get("s")["time_s"] == 0.5e-3


def test_flush_merge_keeps_the_clean_entry_of_another_process(tmp_path):
    path = tmp_path / "p.json"
    a, b = ProfileStore(path), ProfileStore(path)
    a.put("s", CLEAN)
    a.flush()
    b.put("s", {**PROV, "time_s": 1e-7})  # b never saw a's entry; it is provisional
    b.put("t", PROV)
    b.flush()
    again = ProfileStore(path)
    assert again.get("s") == CLEAN and again.get("t") == PROV and b.get("s") == CLEAN
    a.put("t", CLEAN)  # and the other way round: clean replaces provisional on disk
    a.flush()
    assert ProfileStore(path).get("t") == CLEAN


def test_replace_and_remove_reach_the_disk(tmp_path):
    path = tmp_path / "p.json"
    first = ProfileStore(path)
    first.put("s", {**CLEAN, "time_s": 1e-3})
    first.put("gone", CLEAN)
    first.flush()
    healer = ProfileStore(path)
    healer.replace("s", {**CLEAN, "time_s": 5e-3})  # slower, but evidence says so
    assert healer.remove("gone") and not healer.remove("never")
    healer.flush()
    again = ProfileStore(path)
    assert again.get("s")["time_s"] == 5e-3 and "gone" not in again
    first.put("other", CLEAN)  # a process that still holds the old entries in memory
    first.flush()
    again = ProfileStore(path)
    assert again.get("s")["time_s"] == 5e-3 and "gone" not in again and "other" in again


# -- several processes -------------------------------------------------------------------------
WRITER = r"""
import os, sys, time
from autopar.profiling.store import ProfileStore

path, name, n, wait_for, stall = sys.argv[1:6]
n = int(n)
store = ProfileStore(path)

def write(i):
    store.put(f"{name}-{i:03d}", {"target": "aten.mm.default", "time_s": 1e-5 * (i + 1)})
    store.flush()
    print(f"{name}-{i:03d}", flush=True)  # on disk: must never be lost

for i in range(n):
    if i == n // 2 and wait_for != "-":
        while not os.path.exists(wait_for):
            time.sleep(0.01)
    write(i)
if stall != "-":  # hang inside the next flush, after writing the temporary file
    def stalled(fd):
        open(stall, "w").close()
        time.sleep(600)
    os.fsync = stalled
    store.put(f"{name}-doomed", {"target": "aten.mm.default", "time_s": 1.0})
    store.flush()
"""


def _writer(path, name, n, wait_for="-", stall="-"):
    args = [sys.executable, "-c", WRITER, str(path), name, str(n), str(wait_for), str(stall)]
    return subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _finish(proc, timeout=300):
    out, err = proc.communicate(timeout=timeout)
    return out.split(), err


def test_two_processes_writing_at_once_lose_nothing(tmp_path):
    path = tmp_path / "shared.json"
    procs = [_writer(path, name, 30) for name in ("a", "b")]
    results = [_finish(p) for p in procs]
    for p, (_, err) in zip(procs, results, strict=True):
        assert p.returncode == 0, err[-2000:]
    written = {k for keys, _ in results for k in keys}
    assert len(written) == 60
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a whole, valid file: no warning
        store = ProfileStore(path)
    assert set(store) == written


def test_writer_killed_mid_write_loses_nothing_and_leaves_a_readable_file(tmp_path):
    import signal

    path, stalled = tmp_path / "shared.json", tmp_path / "stalled"
    victim = _writer(path, "v", 6, stall=stalled)
    other = _writer(path, "w", 12, wait_for=stalled)  # its second half meets the held lock
    deadline = time.monotonic() + 300
    while not stalled.exists():
        assert victim.poll() is None, victim.communicate()[1][-2000:]
        assert time.monotonic() < deadline, "the victim never reached its flush"
        time.sleep(0.05)
    assert read_store_file(str(path))["ops"]  # readable while a write is half done
    os.kill(victim.pid, signal.SIGKILL)
    victim_keys, _ = _finish(victim)  # reaped: its pid is dead now
    other_keys, err = _finish(other)
    assert victim.returncode == -signal.SIGKILL and other.returncode == 0, err[-2000:]
    assert len(victim_keys) == 6 and len(other_keys) == 12
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        store = ProfileStore(path)
    assert set(store) == set(victim_keys) | set(other_keys)  # "v-doomed" never got there
    store.put("after", REC)
    store.flush()  # cleans the victim's temporary file if the other writer did not
    assert not list(tmp_path.glob("*.tmp"))
    assert set(ProfileStore(path)) == set(victim_keys) | set(other_keys) | {"after"}
