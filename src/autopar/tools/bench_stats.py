"""How sure a benchmark ratio is: a bootstrap interval for the ratio of two medians.

``autopar bench`` reports ``best / autopar``: the median step of the faster peer over
autopar's median step. Its timed steps are interleaved rounds (one step of every contender
per round), so a slow moment of the machine hits both sides of a round alike: the interval
resamples whole *rounds* (a paired bootstrap) and keeps that pairing. With 20 rounds and a
6-20% interquartile range, a 90% interval is typically +-2-5% wide: a ratio of 0.96 whose
interval reaches past 1.00 is not evidence of a slower step.

Example::

    >>> lo, hi = ratio_interval([1.0, 1.1, 0.9, 1.0], [1.0, 1.0, 1.0, 1.1])
    >>> lo <= 1.0 <= hi
    True
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

#: Resamples per interval: the interval's ends move by well under 1% between seeds at 20
#: rounds (a few ms of numpy per model).
RESAMPLES = 4000
#: Two-sided coverage of the interval.
LEVEL = 0.90


def ratio_interval(
    reference: Sequence[float],
    contender: Sequence[float],
    level: float = LEVEL,
    resamples: int = RESAMPLES,
    seed: int = 0,
) -> tuple[float, float] | None:
    """Percentile-bootstrap interval of ``median(reference) / median(contender)``.

    Paired by index (round ``i`` of both) when both have as many samples, else each side
    resampled on its own. Uses its own generator (``seed``): no global random state is
    touched. None with fewer than 4 samples on a side (no meaningful interval)."""
    ref = np.asarray(reference, dtype=float)
    con = np.asarray(contender, dtype=float)
    if len(ref) < 4 or len(con) < 4:
        return None
    rng = np.random.default_rng(seed)
    i = rng.integers(0, len(ref), size=(resamples, len(ref)))
    j = i if len(ref) == len(con) else rng.integers(0, len(con), size=(resamples, len(con)))
    ratios = np.median(ref[i], axis=1) / np.median(con[j], axis=1)
    tail = (1.0 - level) / 2 * 100
    lo, hi = np.percentile(ratios, [tail, 100 - tail])
    return float(lo), float(hi)
