"""The persistent profile store: operator measurements as versioned JSON, by default in a
per-user cache directory (``default_dir()``, ``~/.cache/autopar/profiles``).

One file holds the measurements of one *store key*: the machine (CPU model, OS/arch, GPUs),
its core count (logical, and usable by this process), the torch version and the OpenMP library
torch loaded (``store_key()``; the file name spells it, ``default_file_name()``)::

    {"format": "autopar-profile", "version": 2,
     "machine": {"cpu": ..., "logical_cores": ..., "usable_cores": ..., "platform": ...,
                 "cuda": [...]},
     "torch": "2.13.0+cpu", "openmp": "libgomp.so.1",
     "ops": {signature: {"target": ..., "time_s": ..., "time_1t_s": ..., "flops": ...,
                         "quality": "clean", "samples": ..., "min_s": ..., ...}},
     "calibration": {name: {...}}}

``ops`` is keyed by the operator signature made in ``autopar.profiling.profiler`` (a hash of
the target, argument shapes/dtypes/strides/devices and the intra-op thread count); the record
fields are documented in docs/cost-model.md ("Measurement quality"). ``calibration`` holds the
cost model's microbenchmark constants.

**Two measurements of one signature** (a ``put`` over an existing entry, or two processes
flushing the same signature) are settled by ``autopar.profiling.quality.preferred``: a clean
measurement is never replaced by a provisional one, and of two that disagree by more than
1.5x the faster is kept. ``replace()`` overrides that (``heal`` and ``autopar store verify
--fix``, which have evidence that the entry is wrong), ``remove()`` drops an entry.

**Concurrency.** ``flush()`` merges with the file under an exclusive ``filelock`` on
``<file>.lock`` (with a timeout: a stuck writer cannot hang training) and replaces the file
atomically (``os.replace`` of a fsynced temporary file), so several processes may write one
store: none loses another's entries, and a writer killed at any point leaves a whole file.

A file that cannot be trusted (not UTF-8 or not JSON, truncated, another format or version,
another store key) is reported in one ``StoreWarning`` naming its backup,
``<name>.corrupt-<time>-<pid>``: a new name each time, so no backup is ever overwritten. Its
operators are re-measured. Temporary files of a writer that was killed mid-write are removed
by the next ``flush()``. An I/O error never stops the user's run (the store keeps working in
memory). Example::

    >>> store = ProfileStore.memory()
    >>> store.put("0123456789abcdef", {"target": "aten.mm.default", "time_s": 1e-5})
    True
    >>> store.get("0123456789abcdef")["time_s"]
    1e-05
    >>> len(store)
    1
"""

from __future__ import annotations

import functools
import hashlib
import json
import math
import os
import platform
import re
import warnings
from collections.abc import Iterator
from typing import Any

from autopar.errors import StoreWarning
from autopar.profiling.quality import preferred
from autopar.profiling.storefiles import (
    ENV_DIR,
    STALE_TMP_S,
    backup_file,
    default_dir,
    remove_orphaned_tmp,
    store_lock,
    write_atomically,
)

STORE_FORMAT = "autopar-profile"
STORE_VERSION = 2  # 2: records carry their quality; the key names cores and OpenMP
__all__ = ["ENV_DIR", "STALE_TMP_S", "default_dir"]  # re-exported (STALE_TMP_S: version 1's)


# -- the store key ---------------------------------------------------------------------------
@functools.lru_cache(maxsize=1)
def machine_fingerprint() -> dict[str, Any]:
    """What identifies this machine's performance: CPU model, cores, OS/arch, GPUs.

    ``logical_cores`` is the machine's, ``usable_cores`` what this process may run on (a
    container or ``taskset`` may allow fewer). Measurements are only reused under the same
    fingerprint. The host name is left out on purpose: identical hardware may share a profile
    file.

    Example::

        >>> sorted(machine_fingerprint())
        ['cpu', 'cuda', 'logical_cores', 'platform', 'usable_cores']
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
    logical = os.cpu_count() or 1
    try:
        usable = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        usable = logical
    return {
        "cpu": " ".join(cpu.split()),
        "logical_cores": logical,
        "usable_cores": usable,
        "platform": f"{platform.system()}-{platform.machine()}",
        "cuda": cuda,
    }


def torch_version() -> str:
    """``torch.__version__`` (its build tag too: ``2.13.0+cpu``)."""
    import torch

    return str(torch.__version__)


_OMP_LIB = re.compile(
    r"/(lib(?:gomp|iomp5|iomp5md|omp|omp5)(?:[.-][^/\s]*)?\.(?:so|dylib|dll)[^/\s]*)"
)


@functools.lru_cache(maxsize=1)
def openmp_library() -> str:
    """The OpenMP runtime torch runs its intra-op threads on: the file name of the loaded
    library (``libgomp.so.1``, ``libiomp5.so``, ``libomp.dylib``), else what torch reports
    (``openmp``, or ``native`` for a build without OpenMP). Their thread teams wait, spin and
    wake differently, which changes multi-threaded operator times.

    Example::

        >>> openmp_library() != ""
        True
    """
    import torch

    names: set[str] = set()
    try:
        with open("/proc/self/maps", encoding="utf-8", errors="replace") as f:
            names = {m.group(1) for m in _OMP_LIB.finditer(f.read())}
    except OSError:  # no /proc (macOS, Windows): ask torch
        pass
    if names:
        return "+".join(sorted(names))
    info = torch.__config__.parallel_info()
    return "openmp" if "parallel backend: OpenMP" in info else "native"


def store_key() -> dict[str, Any]:
    """Everything a measurement depends on besides the operator call: the store's key.

    Example::

        >>> sorted(store_key())
        ['machine', 'openmp', 'torch']
    """
    return {"machine": machine_fingerprint(), "torch": torch_version(), "openmp": openmp_library()}


def _slug(text: str, limit: int = 40) -> str:
    text = re.sub(r"\((r|tm)\)", "", text, flags=re.I)  # "Intel(R) Xeon(R)" -> "Intel Xeon"
    return re.sub(r"[^A-Za-z0-9.]+", "-", text).strip("-").lower()[:limit].strip("-")


def default_file_name(
    machine: dict[str, Any] | None = None,
    torch_ver: str | None = None,
    openmp: str | None = None,
) -> str:
    """The store's file name in a profile directory: ``<machine>-torch<version>-<openmp>.json``.

    ``<machine>`` is a readable slug (CPU model, usable cores, first GPU) plus a short hash of
    the whole key, so two keys never share a file by accident.

    Example::

        >>> name = default_file_name({"cpu": "Xeon 8375C", "logical_cores": 2, "usable_cores": 2,
        ...                           "platform": "Linux-x86_64", "cuda": []}, "2.13.0+cpu",
        ...                          "libgomp.so.1")
        >>> name.startswith("xeon-8375c-2c-"), name.endswith("-torch2.13.0_cpu-gomp.json")
        (True, True)
    """
    machine = machine_fingerprint() if machine is None else machine
    torch_ver = torch_version() if torch_ver is None else torch_ver
    openmp = openmp_library() if openmp is None else openmp
    key = {"machine": machine, "torch": torch_ver, "openmp": openmp}
    digest = hashlib.sha1(json.dumps(key, sort_keys=True).encode()).hexdigest()[:6]
    cores = machine.get("usable_cores", machine.get("logical_cores", 0))
    parts = [_slug(machine.get("cpu", "cpu")), f"{cores}c"]
    if machine.get("cuda"):
        parts.append(_slug(machine["cuda"][0], 24))
    ver = re.sub(r"[^A-Za-z0-9.]", "_", torch_ver)
    omp = re.sub(r"^lib|\.(so|dylib|dll).*$", "", openmp.split("+")[0]) or "none"
    return f"{'-'.join(p for p in parts if p)}-{digest}-torch{ver}-{_slug(omp, 12)}.json"


# -- record validation -------------------------------------------------------------------------
# Keys whose values are durations, counts or sizes: they must be >= 0. Any number anywhere must
# be finite (JSON written by other tools may hold NaN/Infinity, which Python's json accepts).
_NONNEGATIVE_KEY = re.compile(
    r"(^time|_s$|flops|bytes|threads|repeats|batch|count|samples|kept|spread|contention)"
)


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


def refused_call(record: dict[str, Any]) -> str | None:
    """Why an operator record's call description must not run (``callspec.why_refused``)."""
    if "call" not in record:
        return None
    from autopar.profiling.callspec import why_refused  # imports torch: only when needed

    return why_refused(record)


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
    ``.json`` file; ``None``: ``default_dir()``. Nothing is written until ``flush()``.

    Example::

        >>> store = ProfileStore("profiles")                          # doctest: +SKIP
        >>> store.put(sig, {"target": "aten.mm.default", "time_s": 3e-5})  # doctest: +SKIP
        True
        >>> store.flush()                                            # doctest: +SKIP
    """

    def __init__(self, path: str | os.PathLike[str] | None = None, *, _memory: bool = False):
        self.machine = machine_fingerprint()
        self.torch = torch_version()
        self.openmp = openmp_library()
        self._ops: dict[str, dict[str, Any]] = {}
        self._calibration: dict[str, dict[str, Any]] = {}
        # Keys changed in this process; flush() merges these with what is on disk. Replaced
        # keys overwrite the disk's entry whatever its quality; removed ones delete it.
        self._dirty_ops: set[str] = set()
        self._dirty_cal: set[str] = set()
        self._replaced: set[str] = set()
        self._removed: set[str] = set()
        self._warned = False
        self._refused: dict[str, str] = {}  # entries that name what autopar does not run
        self.path: str | None
        if _memory:
            self.path = None
            return
        if path is None:
            path = default_dir()
        path = os.fspath(path)
        if not path.endswith(".json"):
            path = os.path.join(path, default_file_name(self.machine, self.torch, self.openmp))
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

    def items(self) -> Iterator[tuple[str, dict[str, Any]]]:
        """(signature, record copy) pairs, in signature order."""
        for sig in sorted(self._ops):
            yield sig, dict(self._ops[sig])

    @property
    def key(self) -> dict[str, Any]:
        """This store's key: ``{"machine": ..., "torch": ..., "openmp": ...}``."""
        return {"machine": self.machine, "torch": self.torch, "openmp": self.openmp}

    def put(self, signature: str, record: dict[str, Any]) -> bool:
        """Offer one operator measurement; whether it was kept. An entry already there is
        kept instead when it is the better measurement (``quality.preferred``: a clean one is
        never replaced by a provisional one; of two that disagree, the faster). Raises
        ``ValueError`` if the record is invalid.
        """
        self._check(signature, record, op=True)
        current = self._ops.get(signature)
        if preferred(current, record) is current:
            return False
        self._ops[signature] = dict(record)
        self._dirty_ops.add(signature)
        self._removed.discard(signature)
        return True

    def replace(self, signature: str, record: dict[str, Any]) -> None:
        """Store ``record`` over whatever is there, here and on disk at the next flush: for a
        caller with evidence that the stored entry is wrong (``heal``, ``store verify --fix``).
        """
        self._check(signature, record, op=True)
        self._ops[signature] = dict(record)
        self._dirty_ops.add(signature)
        self._replaced.add(signature)
        self._removed.discard(signature)

    def remove(self, signature: str) -> bool:
        """Drop an entry, here and on disk at the next flush; whether there was one."""
        had = self._ops.pop(signature, None) is not None
        self._dirty_ops.discard(signature)
        self._replaced.discard(signature)
        self._removed.add(signature)
        return had

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
        bad = validate_record(record, op=op) or (refused_call(record) if op else None)
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
            aside = backup_file(self.path)
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
        ops, cal, bad, refused = {}, {}, [], {}
        for section, out, is_op in ((data["ops"], ops, True), (data["calibration"], cal, False)):
            for key, rec in section.items():
                why = validate_record(rec, op=is_op)
                if why:
                    bad.append(f"{key}: {why}")
                elif is_op and (no := refused_call(rec)):
                    refused[key] = no
                else:
                    out[key] = rec
        if bad:
            self._warn(
                f"has {len(bad)} invalid entries (first: {bad[0]})",
                "they were dropped and the file will be rewritten without them",
            )
        self._refuse(refused)
        return ops, cal

    def _refuse(self, refused: dict[str, str]) -> None:
        """One ``StoreWarning`` naming the file and the entries whose call description names
        what autopar does not run (``callspec.why_refused``): treated as missing (measured
        again), gone from the file at the next flush; each named once per store."""
        new = {k: v for k, v in refused.items() if k not in self._refused}
        if not new:
            return
        self._refused.update(new)
        first, why = next(iter(new.items()))
        more = f" and {len(new) - 1} more" if len(new) > 1 else ""
        warnings.warn(
            f"autopar: profile store {self.path!r}: entry {first}{more} refused: {why}. "
            "Only torch operators are re-timed from a store; the entry is ignored and its "
            "operator measured again. If this file came from elsewhere, delete it.",
            StoreWarning,
            stacklevel=4,
        )

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
        if data.get("openmp") != self.openmp:
            return (
                f"was measured with OpenMP library {data.get('openmp')!r}, this process uses "
                f"{self.openmp!r}"
            )
        if not isinstance(data.get("ops"), dict):
            return "has no 'ops' table"
        if not isinstance(data.setdefault("calibration", {}), dict):
            return "has a 'calibration' entry that is not a table"
        return None

    def flush(self) -> None:
        """Write the store atomically, merged with what is on disk now.

        Another process may have added measurements since this store was loaded: its entries
        are kept; where both hold a signature, ``quality.preferred`` picks (a ``replace``-d
        entry wins, a ``remove``-d one goes). The merge runs under the store's file lock and
        the file is replaced atomically (``autopar.profiling.storefiles``). An I/O error (or a
        lock held longer than ``LOCK_TIMEOUT_S``) is reported once as a ``StoreWarning``; the
        entries stay in memory and the next flush tries again. A memory store does nothing.
        """
        if self.path is None or not (self._dirty_ops or self._dirty_cal or self._removed):
            return
        directory = os.path.dirname(os.path.abspath(self.path))
        try:
            os.makedirs(directory, exist_ok=True)
            with store_lock(self.path):
                disk_ops, disk_cal = self._read_disk()
                for k in self._dirty_ops:
                    ours = self._ops[k]
                    keep = k in self._replaced
                    disk_ops[k] = ours if keep else preferred(disk_ops.get(k), ours)
                for k in self._removed:
                    disk_ops.pop(k, None)
                for k in self._dirty_cal:
                    disk_cal[k] = self._calibration[k]
                doc = {
                    "format": STORE_FORMAT,
                    "version": STORE_VERSION,
                    "machine": self.machine,
                    "torch": self.torch,
                    "openmp": self.openmp,
                    "ops": dict(sorted(disk_ops.items())),
                    "calibration": dict(sorted(disk_cal.items())),
                }
                text = json.dumps(doc, indent=1, allow_nan=False)
                remove_orphaned_tmp(self.path)
                write_atomically(self.path, text)
        except OSError as e:
            self._warn(
                f"could not be written ({e.strerror or e})",
                "the measurements of this run are kept in memory only",
            )
            return
        for k in self._removed:
            self._ops.pop(k, None)
        self._ops.update(disk_ops)
        self._calibration.update(disk_cal)
        self._dirty_ops.clear()
        self._dirty_cal.clear()
        self._replaced.clear()
        self._removed.clear()


def read_store_file(path: str) -> dict[str, Any]:
    """The parsed document of a store file, for inspection only: nothing is moved, written or
    validated beyond the format. Raises ``ValueError`` saying why it is not a store file, and
    ``OSError`` if it cannot be read.

    Example::

        >>> read_store_file("profiles/this.json")["ops"]       # doctest: +SKIP
        {...}
    """
    with open(path, "rb") as f:
        raw = f.read()
    try:
        data = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as e:
        raise ValueError(f"{path} is not a JSON profile store ({e})") from None
    if not isinstance(data, dict) or data.get("format") != STORE_FORMAT:
        raise ValueError(f"{path} is not an autopar profile (format {STORE_FORMAT!r})")
    if not isinstance(data.get("ops"), dict):
        raise ValueError(f"{path} has no 'ops' table")
    return data
