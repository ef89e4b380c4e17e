"""autopar's log: one logger (``"autopar"``), how to turn it on, and compile progress.

Every event autopar reports is one line on the ``"autopar"`` logger (submodules log on
children of it): the stages of each compile (capture, profile, plan, codegen, measure),
recompiles with their reason, plan-cache misses, drift and re-plans, builds and verdicts,
fallbacks. Turn it on with any of::

    AUTOPAR_LOGS=info python train.py          # or 1 / autopar; debug / +autopar for more
    TORCH_LOGS=autopar python train.py         # torch's switch (+autopar: debug)
    autopar.logs.configure("info")             # in code; returns a function that undoes it

A compile that takes more than :data:`SLOW_S` seconds also shows its lines on stderr when
stderr is a terminal and the log is off (:class:`CompileProgress`); nothing is printed
otherwise (tests, CI, a fast compile).
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import threading
import time
import warnings
from collections.abc import Callable

LOGGER = "autopar"
ENV = "AUTOPAR_LOGS"
log = logging.getLogger(LOGGER)

#: A compile (a first call or a recompile) slower than this shows its stage lines.
SLOW_S = 2.0

_OFF = ("", "0", "off", "false", "no", "none")
_LEVELS = {
    **{k: logging.INFO for k in ("1", "on", "true", "yes", "info", "autopar")},
    **{k: logging.DEBUG for k in ("2", "debug", "+autopar", "+")},
    **{k: logging.WARNING for k in ("warning", "warn", "-autopar")},
    "error": logging.ERROR,
}


def env_switch(name: str, *, empty_is_on: bool = True) -> bool:
    """Whether the on/off switch ``$name`` is on: unset, it is; set, it is off for ``0``,
    ``off``, ``false`` or ``no`` (any case), and for the empty string where ``empty_is_on``
    is False. autopar's switches (``AUTOPAR_NATIVE``, ``AUTOPAR_BYPASSES``) read it.

    Example::

        >>> os.environ["AUTOPAR_EXAMPLE"] = "Off"
        >>> env_switch("AUTOPAR_EXAMPLE"), env_switch("AUTOPAR_UNSET_EXAMPLE")
        (False, True)
        >>> del os.environ["AUTOPAR_EXAMPLE"]
    """
    value = os.environ.get(name)
    if value is None:
        return True
    off = ("0", "off", "false", "no") if empty_is_on else ("0", "off", "false", "no", "")
    return value.strip().lower() not in off


def parse(spec: str | int) -> int | None:
    """The logging level an ``AUTOPAR_LOGS`` value asks for (None: off).

    Example::

        >>> parse("+autopar") == logging.DEBUG, parse("info") == logging.INFO, parse("0")
        (True, True, None)
    """
    if isinstance(spec, int) and not isinstance(spec, bool):
        return spec
    s = str(spec).strip().lower()
    if s in _OFF:
        return None
    if s not in _LEVELS:
        raise ValueError(
            f"{ENV}={spec!r}: use info (or 1, autopar), debug (or +autopar), warning or 0"
        )
    return _LEVELS[s]


class _StderrHandler(logging.StreamHandler):
    """Writes to whatever ``sys.stderr`` is at each record (pytest and notebooks swap it)."""

    def emit(self, record: logging.LogRecord) -> None:
        self.stream = sys.stderr
        super().emit(record)


def configure(spec: str | int = "info", stream=None) -> Callable[[], None]:
    """Show autopar's log lines at ``spec`` (``"info"``, ``"debug"``, a level) on ``stream``
    (default: stderr). Returns a function that restores the logger as it was.

    Example::

        undo = autopar.logs.configure("info")
        cmodel(x).sum().backward()       # one line per compile stage on stderr
        undo()
    """
    level = parse(spec)
    saved = (log.level, log.propagate)
    if level is None:
        return lambda: None
    handler = logging.StreamHandler(stream) if stream is not None else _StderrHandler()
    handler.setFormatter(logging.Formatter("[%(asctime)s] %(message)s", "%H:%M:%S"))
    log.addHandler(handler)
    log.setLevel(level)
    log.propagate = False  # as torch's own logs: one copy of each line

    def undo() -> None:
        log.removeHandler(handler)
        log.setLevel(saved[0])
        log.propagate = saved[1]

    return undo


@contextlib.contextmanager
def enabled(spec: str | int = "info", stream=None):
    """:func:`configure` for a ``with`` block (the logger is restored on exit)."""
    undo = configure(spec, stream)
    try:
        yield log
    finally:
        undo()


def register_with_torch() -> None:
    """Name the ``"autopar"`` log in ``torch._logging``'s registry, so ``TORCH_LOGS=help``
    lists it and ``TORCH_LOGS=autopar`` / ``+autopar`` set its level. (TORCH_LOGS finds
    ``autopar`` as an importable module even before ``import autopar``.)"""
    from autopar import compat

    try:
        compat.register_torch_log(LOGGER)
    except Exception:  # noqa: BLE001 - torch's registry moved: TORCH_LOGS still finds the module
        pass


def setup() -> None:
    """At ``import autopar``: register with torch and honour ``$AUTOPAR_LOGS``."""
    register_with_torch()
    spec = os.environ.get(ENV)
    if spec is None or log.handlers:
        return
    try:
        configure(spec)
    except ValueError as exc:
        warnings.warn(f"autopar: {exc}; logs stay off", stacklevel=2)


def info_enabled() -> bool:
    """Whether autopar's INFO lines reach someone (a handler at INFO or below)."""
    return log.isEnabledFor(logging.INFO)


def stderr_is_tty() -> bool:
    try:
        return sys.stderr.isatty()
    except (AttributeError, ValueError):
        return False


class CompileProgress:
    """One compile of one model (its first call or a recompile): a header line naming the
    reason, then one line per stage. Every line goes to the log at INFO. When the log is off
    and stderr is a terminal, the lines are also written to stderr once the compile has
    taken more than :data:`SLOW_S` seconds (the lines so far at once, then each as it
    comes); a fast compile prints nothing.

    Example::

        >>> p = CompileProgress("MLP", "first call")
        >>> line = p.stage("g0.fw", "profile", 0.05, "3 of 5 operator signatures timed")
        >>> p.header
        'autopar: MLP: compiling (first call)'
    """

    def __init__(self, model: str, reason: str, start: float | None = None, recompile=None):
        self.model = model
        self.reason = reason
        self.start = time.perf_counter() if start is None else start
        verb = "recompiling" if (recompile if recompile is not None else reason != "first call") \
            else "compiling"  # fmt: skip
        self.header = f"autopar: {model}: {verb} ({reason})"
        self.lines: list[str] = [self.header]  # every line, in order
        self._shown = 0  # lines written to stderr so far
        self._lock = threading.Lock()
        log.info("%s", self.header)

    def stage(self, tag: str, stage: str, seconds: float, detail: str = "") -> str:
        """One stage of one graph: ``autopar: MLP g0.fw: plan 0.40 s (heft, 2 streams)``."""
        line = f"autopar: {self.model} {tag}: {stage} {seconds:.2f} s"
        return self.line(line + (f" ({detail})" if detail else ""))

    def line(self, text: str) -> str:
        log.info("%s", text)
        with self._lock:
            self.lines.append(text)
            if info_enabled() or not stderr_is_tty():
                return text
            if time.perf_counter() - self.start < SLOW_S and not self._shown:
                return text
            new, self._shown = self.lines[self._shown:], len(self.lines)
        sys.stderr.write("".join(f"{s}\n" for s in new))
        sys.stderr.flush()
        return text
