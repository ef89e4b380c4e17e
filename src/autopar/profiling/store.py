"""The persistent profile store: operator measurements as versioned JSON under ``profiles/``.

One file holds the measurements of one machine with one torch version::

    {"format": "autopar-profile", "version": 1,
     "machine": {"cpu": ..., "logical_cores": ..., "platform": ..., "cuda": [...]},
     "torch": "2.13.0+cpu",
     "ops": {signature: {"target": ..., "time_s": ..., "time_1t_s": ..., "flops": ...}},
     "calibration": {name: {...}}}

``ops`` is keyed by the operator signature made in ``autopar.profiling.profiler`` (a hash of
the target,
argument shapes/dtypes/strides/devices and the intra-op thread count). ``calibration`` holds
the cost model's microbenchmark constants.

A file that cannot be trusted (not UTF-8 or not JSON, truncated, another format or version,
measured on another machine or with another torch) is reported in one ``StoreWarning`` naming
its backup, ``<name>.corrupt-<time>-<pid>``: a new name each time, so no backup is ever
overwritten. Its operators are re-measured. Temporary files of a writer that was killed
mid-write are removed by the next ``flush()``. An I/O error never stops the user's run (the
store keeps working in memory). Example::

    >>> store = ProfileStore.memory()
    >>> store.put("0123456789abcdef", {"target": "aten.mm.default", "time_s": 1e-5})
    >>> store.get("0123456789abcdef")["time_s"]
    1e-05
    >>> len(store)
    1
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import math
import os
import platform
import re
import socket
import tempfile
import time
import warnings
from collections.abc import Iterator
from typing import Any

from autopar.errors import StoreWarning

STORE_FORMAT = "autopar-profile"
STORE_VERSION = 1
ENV_DIR = "AUTOPAR_PROFILE_DIR"
DEFAULT_DIR = "profiles"
#: A temporary file older than this is an orphan whatever its writer: a flush writes one JSON
#: file, which takes well under a second.
STALE_TMP_S = 300.0


# -- machine identity ------------------------------------------------------------------------
@functools.lru_cache(maxsize=1)
def machine_fingerprint() -> dict[str, Any]:
    """What identifies this machine's performance: CPU model, logical cores, OS/arch, GPUs.

    Measurements are only reused on a machine with the same fingerprint. The host name is left
    out on purpose: identical hardware may share a profile file.

    Example::

        >>> sorted(machine_fingerprint())
        ['cpu', 'cuda', 'logical_cores', 'platform']
    """
    cpu = ""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.lower().startswith(("model name", "hardware", "cpu model")):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    cpu = cpu or platform.processor() or platform.machine() or "unknown-cpu"
    cuda: list[str] = []
    try:
        import torch

        if torch.cuda.is_available():
            cuda = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    except Exception:  # a broken CUDA install must not stop profiling on the CPU
        cuda = []
    return {
        "cpu": " ".join(cpu.split()),
        "logical_cores": os.cpu_count() or 1,
        "platform": f"{platform.system()}-{platform.machine()}",
        "cuda": cuda,
    }


def torch_version() -> str:
    import torch

    return str(torch.__version__)


def _slug(text: str, limit: int = 40) -> str:
    text = re.sub(r"\((r|tm)\)", "", text, flags=re.I)  # "Intel(R) Xeon(R)" -> "Intel Xeon"
    return re.sub(r"[^A-Za-z0-9.]+", "-", text).strip("-").lower()[:limit].strip("-")


def default_file_name(machine: dict[str, Any] | None = None, torch_ver: str | None = None) -> str:
    """The store's file name inside a profile directory: ``<machine>-torch<version>.json``.

    ``<machine>`` is a readable slug (CPU model, cores, first GPU) plus a short hash of the
    whole fingerprint, so two machines never share a file by accident.

    Example::

        >>> name = default_file_name({"cpu": "Xeon 8375C", "logical_cores": 2,
        ...                           "platform": "Linux-x86_64", "cuda": []}, "2.13.0+cpu")
        >>> name.startswith("xeon-8375c-2c-"), name.endswith("-torch2.13.0_cpu.json")
        (True, True)
    """
    machine = machine_fingerprint() if machine is None else machine
    torch_ver = torch_version() if torch_ver is None else torch_ver
    digest = hashlib.sha1(json.dumps(machine, sort_keys=True).encode()).hexdigest()[:6]
    parts = [_slug(machine.get("cpu", "cpu")), f"{machine.get('logical_cores', 0)}c"]
    if machine.get("cuda"):
        parts.append(_slug(machine["cuda"][0], 24))
    ver = re.sub(r"[^A-Za-z0-9.]", "_", torch_ver)
    return f"{'-'.join(p for p in parts if p)}-{digest}-torch{ver}.json"


# -- record validation -------------------------------------------------------------------------
# Keys whose values are durations, counts or sizes: they must be >= 0. Any number anywhere must
# be finite (JSON written by other tools may hold NaN/Infinity, which Python's json accepts).
_NONNEGATIVE_KEY = re.compile(r"(^time|_s$|flops|bytes|threads|repeats|batch|count)")


def _invalid_value(value: Any, key: str, depth: int = 0) -> str | None:
    if depth > 8:
        return f"{key!r} is nested too deeply"
    if isinstance(value, bool) or value is None or isinstance(value, str):
        return None
    if isinstance(value, (int, float)):
        if not math.isfinite(value):
            return f"{key!r} = {value!r} is not finite"
        if value < 0 and _NONNEGATIVE_KEY.search(key):
            return f"{key!r} = {value!r} is negative"
        return None
    if isinstance(value, list):
        for v in value:
            bad = _invalid_value(v, key, depth + 1)
            if bad:
                return bad
        return None
    if isinstance(value, dict):
        for k, v in value.items():
            if not isinstance(k, str):
                return f"key {k!r} inside {key!r} is not a string"
            bad = _invalid_value(v, k, depth + 1)
            if bad:
                return bad
        return None
    return f"{key!r} has type {type(value).__name__}, which JSON cannot hold"


def validate_record(record: Any, *, op: bool = True) -> str | None:
    """Why ``record`` cannot be stored, or ``None`` when it is fine.

    A record is a dict of JSON values; numbers are finite, times/counts/bytes are >= 0, and an
    operator record (``op=True``) has a number ``time_s``.

    Example::

        >>> validate_record({"time_s": -1.0})
        "'time_s' = -1.0 is negative"
    """
    if not isinstance(record, dict):
        return f"the record is a {type(record).__name__}, not a dict"
    if op:
        t = record.get("time_s")
        if isinstance(t, bool) or not isinstance(t, (int, float)):
            return f"'time_s' is missing or not a number (got {t!r})"
    return _invalid_value(record, "record")


class ProfileStore:
    """Measurements keyed by operator signature, persisted as one JSON file per machine+torch.

    ``path`` is a directory (the file inside is named by ``default_file_name()``) or a
    ``.json`` file. ``None`` means ``$AUTOPAR_PROFILE_DIR`` or else ``./profiles``. Nothing is
    written until ``flush()``; the directory is created then.

    Example::

        >>> store = ProfileStore("profiles")                          # doctest: +SKIP
        >>> store.put(sig, {"target": "aten.mm.default", "time_s": 3e-5})  # doctest: +SKIP
        >>> store.flush()                                            # doctest: +SKIP
    """

    def __init__(self, path: str | os.PathLike[str] | None = None, *, _memory: bool = False):
        self.machine = machine_fingerprint()
        self.torch = torch_version()
        self._ops: dict[str, dict[str, Any]] = {}
        self._calibration: dict[str, dict[str, Any]] = {}
        # Keys changed in this process; flush() writes these over what is on disk.
        self._dirty_ops: set[str] = set()
        self._dirty_cal: set[str] = set()
        self._warned = False
        self.path: str | None
        if _memory:
            self.path = None
            return
        if path is None:
            path = os.environ.get(ENV_DIR) or DEFAULT_DIR
        path = os.fspath(path)
        if not path.endswith(".json"):
            path = os.path.join(path, default_file_name(self.machine, self.torch))
        self.path = path
        ops, cal = self._read_disk()
        self._ops.update(ops)
        self._calibration.update(cal)

    @classmethod
    def memory(cls) -> ProfileStore:
        """A store that lives in memory only and never touches the disk (tests, one-off runs).

        Example::

            >>> ProfileStore.memory().path is None
            True
        """
        return cls(_memory=True)

    # -- mapping API -----------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self._ops)

    def __contains__(self, signature: object) -> bool:
        return signature in self._ops

    def __iter__(self) -> Iterator[str]:
        return iter(self._ops)

    def __repr__(self) -> str:
        where = self.path or "memory"
        n_ops, n_cal = len(self._ops), len(self._calibration)
        return f"ProfileStore({where!r}, ops={n_ops}, calibration={n_cal})"

    def get(self, signature: str) -> dict[str, Any] | None:
        """The measurement stored for ``signature`` (a copy), or ``None``."""
        rec = self._ops.get(signature)
        return dict(rec) if rec is not None else None

    def put(self, signature: str, record: dict[str, Any]) -> None:
        """Store one operator measurement; raises ``ValueError`` if the record is invalid."""
        self._check(signature, record, op=True)
        self._ops[signature] = dict(record)
        self._dirty_ops.add(signature)

    def get_calibration(self, name: str) -> dict[str, Any] | None:
        """A calibration record of the cost model (e.g. ``"cpu_matmul"``), or ``None``."""
        rec = self._calibration.get(name)
        return dict(rec) if rec is not None else None

    def put_calibration(self, name: str, record: dict[str, Any]) -> None:
        """Store a calibration record; raises ``ValueError`` if it is invalid."""
        self._check(name, record, op=False)
        self._calibration[name] = dict(record)
        self._dirty_cal.add(name)

    @staticmethod
    def _check(key: str, record: dict[str, Any], *, op: bool) -> None:
        if not isinstance(key, str) or not key:
            raise ValueError(f"profile store keys are non-empty strings, got {key!r}")
        bad = validate_record(record, op=op)
        if bad:
            raise ValueError(
                f"refusing to store {key!r}: {bad}. Measurements must be finite, times and "
                "sizes non-negative; check the timing code that produced it."
            )

    # -- disk --------------------------------------------------------------------------------
    def _warn(self, what: str, moved: str) -> None:
        if self._warned:  # one warning per store: the user needs to know once, not per entry
            return
        self._warned = True
        warnings.warn(
            f"autopar: profile store {self.path!r} {what}; {moved}. Its operators will be "
            "re-measured (results are unaffected; the first run is slower).",
            StoreWarning,
            stacklevel=4,
        )

    def _move_aside(self) -> str:
        assert self.path is not None
        try:
            aside = _backup(self.path)
            return f"it was kept as {aside!r}"
        except FileNotFoundError:  # another process backed it up (or replaced it) first
            return "another process has moved it aside already"
        except OSError as e:
            return f"it could not be moved aside ({e.strerror or e}) and will be overwritten"

    def _read_disk(self) -> tuple[dict[str, dict], dict[str, dict]]:
        """Valid entries of the file on disk now; a bad file is reported and moved aside."""
        assert self.path is not None
        try:
            with open(self.path, "rb") as f:
                raw = f.read()
        except (FileNotFoundError, NotADirectoryError):  # nothing there yet: not a problem
            return {}, {}
        except OSError as e:
            self._warn(f"could not be read ({e})", "it is left in place")
            return {}, {}
        problem, data = None, None
        try:
            # Decoded here, not by open(): undecodable bytes are a bad file to back up, not
            # an I/O error to leave in place (the next flush would overwrite it).
            text = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            problem = f"is not UTF-8 text (byte {e.start}), so not a profile store"
        else:
            try:
                data = json.loads(text)
            except ValueError as e:
                problem = "is not valid JSON (truncated or corrupted"
                problem += f": {e})" if text.strip() else ": the file is empty)"
        if problem is None:
            problem = self._header_problem(data)
        if problem is not None:
            self._warn(problem, self._move_aside())
            return {}, {}
        ops, cal, bad = {}, {}, []
        for section, out, is_op in ((data["ops"], ops, True), (data["calibration"], cal, False)):
            for key, rec in section.items():
                why = validate_record(rec, op=is_op)
                if why:
                    bad.append(f"{key}: {why}")
                else:
                    out[key] = rec
        if bad:
            self._warn(
                f"has {len(bad)} invalid entries (first: {bad[0]})",
                "they were dropped and the file will be rewritten without them",
            )
        return ops, cal

    def _header_problem(self, data: Any) -> str | None:
        if not isinstance(data, dict) or data.get("format") != STORE_FORMAT:
            return f"is not an autopar profile (expected format {STORE_FORMAT!r})"
        if data.get("version") != STORE_VERSION:
            return (
                f"has format version {data.get('version')!r}, this autopar reads version "
                f"{STORE_VERSION}"
            )
        if data.get("machine") != self.machine:
            return (
                f"was measured on another machine ({data.get('machine')!r}; this one is "
                f"{self.machine!r})"
            )
        if data.get("torch") != self.torch:
            return f"was measured with torch {data.get('torch')!r}, this is torch {self.torch}"
        if not isinstance(data.get("ops"), dict):
            return "has no 'ops' table"
        if not isinstance(data.setdefault("calibration", {}), dict):
            return "has a 'calibration' entry that is not a table"
        return None

    def flush(self) -> None:
        """Write the store atomically, merged with what is on disk now.

        Another process may have added measurements since this store was loaded: its entries
        are kept, and this process's new entries win on a conflict. The file is written to a
        temporary file in the same directory and ``os.replace``-d, so a reader never sees half
        a file. An I/O error is reported once as a ``StoreWarning`` and the store stays usable
        in memory. A memory store does nothing.
        """
        if self.path is None or not (self._dirty_ops or self._dirty_cal):
            return
        directory = os.path.dirname(os.path.abspath(self.path))
        try:
            os.makedirs(directory, exist_ok=True)
            with _dir_lock(directory):
                disk_ops, disk_cal = self._read_disk()
                for k in self._dirty_ops:
                    disk_ops[k] = self._ops[k]
                for k in self._dirty_cal:
                    disk_cal[k] = self._calibration[k]
                doc = {
                    "format": STORE_FORMAT,
                    "version": STORE_VERSION,
                    "machine": self.machine,
                    "torch": self.torch,
                    "ops": dict(sorted(disk_ops.items())),
                    "calibration": dict(sorted(disk_cal.items())),
                }
                text = json.dumps(doc, indent=1, allow_nan=False)
                _remove_orphaned_tmp(self.path)
                fd, tmp = tempfile.mkstemp(
                    prefix=_tmp_prefix(self.path), suffix=".tmp", dir=directory
                )
                try:
                    with os.fdopen(fd, "w", encoding="utf-8") as f:
                        f.write(text)
                        f.flush()
                        os.fsync(f.fileno())
                    os.replace(tmp, self.path)
                except BaseException:
                    with contextlib.suppress(OSError):
                        os.unlink(tmp)
                    raise
        except OSError as e:
            self._warn(
                f"could not be written ({e.strerror or e})",
                "the measurements of this run are kept in memory only",
            )
            return
        self._ops.update(disk_ops)
        self._calibration.update(disk_cal)
        self._dirty_ops.clear()
        self._dirty_cal.clear()


# -- recovery: backups of bad files, orphaned temporary files ----------------------------------
def _backup(path: str) -> str:
    """Move ``path`` to a fresh ``<path>.corrupt-<YYYYmmdd-HHMMSS>-<pid>[-N]``; the name.

    ``os.link`` fails instead of replacing an existing file, so even two processes backing up
    at the same second never overwrite each other's (or an earlier) backup.
    """
    stem = f"{path}.corrupt-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}"
    for n in range(1, 1000):
        aside = stem if n == 1 else f"{stem}-{n}"
        try:
            os.link(path, aside)
        except FileExistsError:
            continue
        except OSError:  # no hard links here (some network/FAT file systems): check, rename
            if os.path.lexists(aside):
                continue
            os.rename(path, aside)
            return aside
        os.unlink(path)
        return aside
    raise FileExistsError(f"too many backups named {stem}-*")


def _host_tag() -> str:
    # Letters and digits only: the tag sits between '.' and '-' separators of the name.
    return re.sub(r"[^A-Za-z0-9]", "", socket.gethostname())[:32] or "host"


def _tmp_prefix(path: str) -> str:
    """``<name>.<host>-<pid>.``: whoever finds the file later can tell if its writer lives."""
    return f"{os.path.basename(path)}.{_host_tag()}-{os.getpid()}."


def _pid_alive(pid: int) -> bool:
    if os.name == "nt":  # os.kill(pid, 0) would send Ctrl-C there: leave it to the age rule
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # PermissionError: it exists, owned by someone else
        return True
    return True


def _remove_orphaned_tmp(path: str, now: float | None = None) -> list[str]:
    """Delete temporary files a killed writer of ``path`` left behind; the paths removed.

    Orphans are ``<name>.<host>-<pid>.<random>.tmp`` files of this host whose writer process
    is gone, and any ``<name>.*.tmp`` older than ``STALE_TMP_S`` (another host's writer, or a
    reused pid). Called under the directory lock, so no writer that takes it is mid-write.
    """
    directory = os.path.dirname(os.path.abspath(path))
    base = re.escape(os.path.basename(path))
    pattern = re.compile(rf"^{base}\.(?:(?P<host>[A-Za-z0-9]+)-(?P<pid>\d+)\.)?[^.]+\.tmp$")
    now = time.time() if now is None else now
    host, removed = _host_tag(), []
    try:
        names = os.listdir(directory)
    except OSError:
        return removed
    for name in names:
        m = pattern.match(name)
        if m is None:
            continue
        full = os.path.join(directory, name)
        try:
            old = now - os.stat(full).st_mtime > STALE_TMP_S
            dead = m["host"] == host and m["pid"] is not None and not _pid_alive(int(m["pid"]))
            if old or dead:
                os.unlink(full)
                removed.append(full)
        except OSError:  # gone already, or not ours to delete: leave it
            continue
    return removed


@contextlib.contextmanager
def _dir_lock(directory: str) -> Iterator[None]:
    """Serialise read-merge-write between processes sharing a profile directory.

    Best effort: a POSIX ``flock`` on the directory itself (no lock files left behind). Where
    that is unavailable, ``os.replace`` still keeps the file whole; only a concurrent merge
    could then lose the other process's newest entries, which are simply re-measured.
    """
    try:
        import fcntl
    except ImportError:  # Windows
        yield
        return
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        yield
        return
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
        except OSError:  # e.g. a file system without flock
            pass
        yield
    finally:
        with contextlib.suppress(OSError):
            fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)
