"""The profile store's file handling: where its files go, the inter-process lock, atomic
writes, backups of bad files and the clean-up of temporary files a killed writer left behind.

* ``default_dir()``: the directory of ``ProfileStore()``, a per-user cache.
* ``store_lock(path)``: an exclusive ``filelock.FileLock`` on ``<path>.lock``. The operating
  system releases it when its holder dies (``flock``), even by SIGKILL; ``LOCK_TIMEOUT_S``
  bounds the wait, so a stopped process holding it cannot hang training (``flush`` then warns
  and keeps its entries in memory for the next flush). The ``.lock`` file stays in place on
  release (waiters must share its inode); it is empty and harmless.
* ``write_atomically(path, text)``: a temporary file named after its writer
  (``<name>.<host>-<pid>.<random>.tmp``), fsynced, ``os.replace``-d over ``path``, and the
  directory fsynced: a reader sees the old file or the new one, never half of one. The new
  file keeps the mode of the one it replaces (a store shared by a group stays shared); a
  first one gets the mode a plain ``open`` gives (``0o666`` less the umask).
* ``remove_orphaned_tmp(path)``: temporary files whose writer is gone, or older than
  ``STALE_TMP_S``.
* ``backup_file(path)``: moves a bad file to a fresh ``<path>.corrupt-<time>-<pid>[-N]``.

Example::

    >>> import os, tempfile
    >>> d = tempfile.mkdtemp()
    >>> with store_lock(os.path.join(d, "p.json")):
    ...     write_atomically(os.path.join(d, "p.json"), "{}")
    >>> sorted(os.listdir(d))
    ['p.json', 'p.json.lock']
"""

from __future__ import annotations

import contextlib
import os
import re
import socket
import stat
import time

from filelock import FileLock

#: A temporary file older than this is an orphan whatever its writer: a flush writes one JSON
#: file, which takes well under a second.
STALE_TMP_S = 300.0
#: The longest a flush waits for another process's flush (which takes milliseconds).
LOCK_TIMEOUT_S = 30.0

#: Names the store's directory, before the per-user cache (``default_dir``).
ENV_DIR = "AUTOPAR_PROFILE_DIR"


def default_dir() -> str:
    """The directory ``ProfileStore()`` keeps its files in: ``$AUTOPAR_PROFILE_DIR`` if set,
    else ``$XDG_CACHE_HOME/autopar/profiles``, else ``~/.cache/autopar/profiles``.

    A per-user cache, as torch's own caches are (``$TORCH_HOME``, ``~/.cache/torch``): the
    measurements belong to the machine and the user, not to whichever directory a training
    script happens to run in, so every project of the user reuses them. Read at each call,
    so that a changed environment (a test's temporary directory) takes effect.

    Example::

        >>> default_dir()  # neither variable set, HOME=/home/me  # doctest: +SKIP
        '/home/me/.cache/autopar/profiles'
    """
    explicit = os.environ.get(ENV_DIR)
    if explicit:
        return explicit
    # The XDG base-directory spec: an empty or relative XDG_CACHE_HOME is to be ignored.
    cache = os.environ.get("XDG_CACHE_HOME", "")
    if not os.path.isabs(cache):
        cache = os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(cache, "autopar", "profiles")


def store_lock(path: str, timeout: float = LOCK_TIMEOUT_S) -> FileLock:
    """The exclusive inter-process lock of the store file ``path``: a context manager that
    raises ``filelock.Timeout`` (a ``TimeoutError``, hence an ``OSError``) after ``timeout``
    seconds of waiting."""
    return FileLock(f"{path}.lock", timeout=timeout)


def write_atomically(path: str, text: str) -> None:
    """Replace ``path`` by a file holding ``text``, atomically, with the mode of the file it
    replaces, or for a new one the umask's (see the module docstring)."""
    directory = os.path.dirname(os.path.abspath(path))
    try:
        mode = stat.S_IMODE(os.stat(path).st_mode)
    except FileNotFoundError:  # a new file: the mode os.open gives it (umask applied)
        mode = None
    fd, tmp = _create_tmp(path, directory)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            if mode is not None:
                os.chmod(tmp, mode)
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    _fsync_dir(directory)


def _create_tmp(path: str, directory: str) -> tuple[int, str]:
    """A new temporary file for ``path`` in ``directory`` (``<name>.<host>-<pid>.<random>.tmp``)
    and its descriptor, open for writing. Not ``tempfile.mkstemp``: its files have mode
    0600, and a new store file would keep it (the group that shares the store could no
    longer read or write it); ``0o666`` here, less the umask, as ``open`` creates files."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_BINARY", 0)
    for _ in range(100):
        tmp = os.path.join(directory, f"{tmp_prefix(path)}{os.urandom(6).hex()}.tmp")
        try:
            return os.open(tmp, flags, 0o666), tmp
        except FileExistsError:  # another writer's name (1 in 2**48): draw again
            continue
    raise FileExistsError(f"no free temporary file name for {path}")


def _fsync_dir(directory: str) -> None:
    """Make the rename durable (best effort: not every platform can open a directory)."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def backup_file(path: str) -> str:
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


def host_tag() -> str:
    """This host's name, letters and digits only (it sits between '.' and '-' separators)."""
    return re.sub(r"[^A-Za-z0-9]", "", socket.gethostname())[:32] or "host"


def tmp_prefix(path: str) -> str:
    """``<name>.<host>-<pid>.``: whoever finds the file later can tell if its writer lives."""
    return f"{os.path.basename(path)}.{host_tag()}-{os.getpid()}."


def pid_alive(pid: int) -> bool:
    """Whether a process ``pid`` exists on this host (always True on Windows: unknowable)."""
    if os.name == "nt":  # os.kill(pid, 0) would send Ctrl-C there: leave it to the age rule
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # PermissionError: it exists, owned by someone else
        return True
    return True


def remove_orphaned_tmp(path: str, now: float | None = None) -> list[str]:
    """Delete temporary files a killed writer of ``path`` left behind; the paths removed.

    Orphans are ``<name>.<host>-<pid>.<random>.tmp`` files of this host whose writer process
    is gone, and any ``<name>.*.tmp`` older than ``STALE_TMP_S`` (another host's writer, or a
    reused pid). Called under the store lock, so no writer that takes it is mid-write.
    """
    directory = os.path.dirname(os.path.abspath(path))
    base = re.escape(os.path.basename(path))
    pattern = re.compile(rf"^{base}\.(?:(?P<host>[A-Za-z0-9]+)-(?P<pid>\d+)\.)?[^.]+\.tmp$")
    now = time.time() if now is None else now
    host, removed = host_tag(), []
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
            dead = m["host"] == host and m["pid"] is not None and not pid_alive(int(m["pid"]))
            if old or dead:
                os.unlink(full)
                removed.append(full)
        except OSError:  # gone already, or not ours to delete: leave it
            continue
    return removed
