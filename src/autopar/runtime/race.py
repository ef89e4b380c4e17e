"""The whole-module safety net: a compiler that makes a step slower is a bug, so the first
steps of each input signature race whole eager steps against whole compiled steps, and the
module keeps whichever is faster.

Both are valid training steps (same Parameters, same RNG use, results equal to eager within
float reordering), so alternating them costs nothing in correctness. A step's time is the
wall time from one forward call to the next forward call of the same input signature: it
holds the forward, the backward, the optimizer and the user's own loop, which are the same
for both contenders. Steps during which anything compiled, profiled or measured are
"dirty" and not counted.

Policy (constants below): after ``SAMPLES`` clean steps of each, interleaved
E C E C ..., the compiled path is kept only if its median step is at most ``MARGIN`` times
the eager median; otherwise the module runs eagerly for that signature and says why. When
the two medians are within ``UNCLEAR`` of each other, five steps each cannot tell them
apart, so the race goes on, up to ``MAX_SAMPLES`` each, before that rule decides. A new
compiled tier (a faster executor landing, a re-plan) calls :meth:`StepRace.reset`: the race
runs again, so a later improvement is not locked out by an early verdict.

Assumes one forward call per training step (the common loop); with several forwards per
step the race compares call-to-call intervals, which still treat both contenders alike on
average.

Example::

    >>> race = StepRace()
    >>> race.choose("k", now=0.0)   # first call of a signature: compiled (it compiles)
    'compiled'
"""

from __future__ import annotations

import statistics
import threading
from dataclasses import dataclass, field

#: Clean steps per contender before a verdict (medians of 5 resist one noisy step).
SAMPLES = 5
#: Compiled must be no slower than this times eager to be kept: ties go to compiled, whose
#: steady state can still improve (tiers), but a measurable loss goes to eager.
MARGIN = 1.0
#: Medians closer than this (relative) are a tie that five samples cannot settle: on the
#: 2-core box a step's interquartile range is 5-15%, and a race of 5 + 5 steps on the deep
#: MLP kept compiled at 5.53 vs 5.56 ms while 60 interleaved steps then measured it 5%
#: slower than eager (2026-11-30). Race on instead.
UNCLEAR = 0.03
#: At most this many clean steps per contender: a tie within ``UNCLEAR`` costs at most
#: that much on these steps, and then ``MARGIN`` decides.
MAX_SAMPLES = 15


@dataclass
class _Race:
    samples: dict[str, list[float]] = field(default_factory=lambda: {"eager": [], "compiled": []})
    verdict: str | None = None
    reason: str = "racing eager and compiled steps"
    last: tuple[str, float] | None = None  # (contender, start time) of the open step
    dirty: bool = True  # the open step compiled/measured something: don't count it
    turn: int = 0


class StepRace:
    """Per input signature: which path runs this step, and what the race has seen."""

    def __init__(
        self,
        samples: int = SAMPLES,
        margin: float = MARGIN,
        enabled: bool = True,
        max_samples: int = MAX_SAMPLES,
    ):
        self.samples, self.margin, self.enabled = samples, margin, enabled
        self.max_samples = max(max_samples, samples)
        self._races: dict[object, _Race] = {}
        self._lock = threading.Lock()

    def choose(self, key, now: float) -> str:
        """Close the previous step of ``key`` (counting its time) and pick ``"eager"`` or
        ``"compiled"`` for the step that starts ``now``."""
        with self._lock:
            race = self._races.setdefault(key, _Race())
            if race.last is not None and not race.dirty and race.verdict is None:
                who, t0 = race.last
                race.samples[who].append(now - t0)
            if race.verdict is None and self.enabled:
                self._decide(race)
            if race.verdict is not None or not self.enabled:
                who = race.verdict or "compiled"
            elif not race.samples["compiled"] and race.last is None:
                who = "compiled"  # the very first step compiles: start there
            else:
                race.turn += 1
                who = "eager" if race.turn % 2 else "compiled"
            race.last, race.dirty = (who, now), False
            return who

    def mark_dirty(self, key) -> None:
        """Something was compiled, profiled or measured during the open step of ``key``."""
        with self._lock:
            race = self._races.get(key)
            if race is not None:
                race.dirty = True

    def reset(self) -> None:
        """A new compiled tier landed: race every signature again."""
        with self._lock:
            for race in self._races.values():
                race.samples = {"eager": [], "compiled": []}
                race.verdict, race.reason, race.dirty = None, "racing again: a new tier", True

    def _decide(self, race: _Race) -> None:
        e, c = race.samples["eager"], race.samples["compiled"]
        if len(e) < self.samples or len(c) < self.samples:
            return
        me, mc = statistics.median(e), statistics.median(c)
        if abs(mc - me) < UNCLEAR * me and min(len(e), len(c)) < self.max_samples:
            race.reason = f"racing on: medians within {UNCLEAR:.0%} after {len(c)} + {len(e)}"
            return
        race.verdict = "compiled" if mc <= self.margin * me else "eager"
        race.reason = (
            f"median step: compiled {mc * 1e3:.2f} ms vs eager {me * 1e3:.2f} ms "
            f"({len(c)} + {len(e)} steps) -> {race.verdict}"
        )

    def report(self) -> dict[object, tuple[str | None, str]]:
        """Per signature: (verdict or None while racing, reason)."""
        with self._lock:
            return {k: (r.verdict, r.reason) for k, r in self._races.items()}
