"""Which of two measurements of one operator to keep: the rules the store and ``heal`` share.

A record's ``quality`` is ``"clean"`` (taken while nothing else competed for the cores) or
``"provisional"`` (contended, too few clean samples, or too noisy: kept only until a clean
measurement exists, and re-measured whenever it is met). A record without ``quality`` (written
by a caller, not by the profiler) counts as clean: the caller vouches for it.

``preferred(current, incoming)`` decides:

1. a clean record beats a provisional one, whatever their times;
2. of two records of the same quality that *disagree* (one more than ``DISAGREE_RATIO``
   times the other), the faster is kept: interference (other processes, cold caches, page
   faults, a clock stepping down) only ever adds time, so the faster one is the one less
   disturbed;
3. otherwise (they agree) the incoming, newer one.

Example::

    >>> clean = {"time_s": 1e-3, "quality": "clean"}
    >>> slow = {"time_s": 50e-3, "quality": "clean"}
    >>> fast_but_contended = {"time_s": 1e-4, "quality": "provisional"}
    >>> preferred(slow, clean) is clean, preferred(clean, fast_but_contended) is clean
    (True, True)
"""

from __future__ import annotations

from typing import Any

CLEAN = "clean"
PROVISIONAL = "provisional"
#: Two measurements of one operator disagree when one is more than this times the other.
DISAGREE_RATIO = 1.5

_RANK = {PROVISIONAL: 0, CLEAN: 1}


def quality(record: dict[str, Any] | None) -> str:
    """The record's quality; ``"clean"`` when it has none (a caller's own record).

    Example::

        >>> quality({"time_s": 1.0}), quality({"time_s": 1.0, "quality": "provisional"})
        ('clean', 'provisional')
    """
    if not record:
        return PROVISIONAL
    q = record.get("quality", CLEAN)
    return q if q in _RANK else PROVISIONAL


def is_provisional(record: dict[str, Any] | None) -> bool:
    """Whether ``record`` must be re-measured when met (and never replaces a clean one).

    Example::

        >>> is_provisional({"time_s": 1.0, "quality": "provisional"})
        True
    """
    return quality(record) == PROVISIONAL


def disagree(a_s: float, b_s: float, ratio: float = DISAGREE_RATIO) -> bool:
    """Whether two times of one operator are more than ``ratio`` apart (either way).

    Example::

        >>> disagree(1.0, 1.4), disagree(1.0, 1.6), disagree(0.0, 0.0)
        (False, True, False)
    """
    lo, hi = sorted((float(a_s), float(b_s)))
    if hi <= 0.0:
        return False
    return lo <= 0.0 or hi > ratio * lo


def preferred(
    current: dict[str, Any] | None, incoming: dict[str, Any], ratio: float = DISAGREE_RATIO
) -> dict[str, Any]:
    """The record to keep of ``current`` (may be ``None``) and ``incoming`` (the module's rules).

    Example::

        >>> preferred(None, {"time_s": 2.0})
        {'time_s': 2.0}
        >>> preferred({"time_s": 2.0}, {"time_s": 2.2})   # they agree: the newer one
        {'time_s': 2.2}
    """
    if current is None:
        return incoming
    rc, ri = _RANK[quality(current)], _RANK[quality(incoming)]
    if rc != ri:
        return incoming if ri > rc else current
    t_cur, t_new = float(current["time_s"]), float(incoming["time_s"])
    if disagree(t_cur, t_new, ratio):
        return incoming if t_new < t_cur else current
    return incoming
