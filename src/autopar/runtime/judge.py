"""The judge: the one place that compares times. For each input signature it races the
executors that can run a step (whole training steps, interleaved) and says which one runs.

A step's time is the wall time from one forward call to the next forward call of the same
input signature: the forward, the backward, the optimizer and the user's own loop, the same
for every contender. Steps during which anything compiled, profiled or measured are
*dirty* and not counted.

The rule (constants below):

* Contenders take turns of :data:`RUN` consecutive steps and only the last step of a turn
  counts: the first step after a switch runs with the other contender's caches.
* A *round* is one turn of every live contender. Every contender is compared with every
  other by per-round ratios (``t_a / t_b`` of the same round), which cancel the box's
  slow drift.
* After :data:`MIN_ROUNDS` rounds, the *leader* is the contender with the smallest median
  per-round time (each round's times divided by the reference's). A contender whose
  ratio to the leader has a confidence interval (:data:`CONFIDENCE`, distribution-free:
  order statistics of the per-round ratios, the sign test's) entirely above 1 is clearly
  slower and leaves the race. When one contender is left, it is the verdict.
* After :data:`MAX_ROUNDS` rounds the race stops: the leader wins if its interval against
  the *reference* lies below 1, else the reference does (a tie goes to the reference).

The reference is ``"inductor"`` where it races (it runs exactly what ``torch.compile``
runs, so keeping it is never slower than that peer), else ``"eager"`` (the user's own step:
a planned program replaces it only where it is clearly faster, since its worker threads
lose most beside other work, a background compile included), else the first contender.

A verdict stands for its signature until :meth:`Judge.reopen` (the monitor saw sustained
drift) or until a new contender is ready (:meth:`Judge.enter`), which then races the
current verdict alone. A verdict can also be given without a race (:meth:`Judge.settle`:
the decision cache remembered it).

Example::

    >>> judge = Judge()
    >>> judge.enter("k", "eager"); judge.enter("k", "plan")
    >>> judge.choose("k", now=0.0)
    'eager'
"""

from __future__ import annotations

import math
import statistics
import threading
from dataclasses import dataclass, field

#: Consecutive steps per turn; only a turn's last step is a sample. On the deep MLP a
#: compiled path measured 0.7% slower than eager alternating step by step, 2.9% slower
#: counting the second of two, 6.3% slower in blocks of eight: the first step after a switch
#: runs on the other contender's caches.
RUN = 2
#: Rounds before any contender may leave the race or win.
MIN_ROUNDS = 6
#: Rounds at most; then the leader wins only if it is clearly faster than the reference.
MAX_ROUNDS = 24
#: Two-sided confidence of the interval of a per-round ratio's median.
CONFIDENCE = 0.9
#: Which contender is the reference: the first of these that races. On HF BERT tiny a
#: planned program tied eager (per-round ratio 0.992) and won as the reference; beside the
#: background compile that followed it took 12-20 ms a step, eager 9.5 ms.
REFERENCE = ("inductor", "eager")


def median_interval(values: list[float], confidence: float = CONFIDENCE) -> tuple[float, float]:
    """A distribution-free interval for the median of ``values``: the order statistics
    ``x(k+1)`` and ``x(n-k)``, ``k`` the largest count with ``P(Bin(n, 1/2) <= k) <= (1 -
    confidence) / 2`` (the sign test). Fewer than 5 values: the whole range.

    Example::

        >>> median_interval([0.9, 0.95, 0.92, 0.97, 0.91, 0.94])
        (0.9, 0.97)
    """
    xs = sorted(values)
    n = len(xs)
    tail, k, cum = (1.0 - confidence) / 2.0, -1, 0.0
    for i in range(n + 1):
        cum += math.comb(n, i) / 2.0**n
        if cum > tail:
            break
        k = i
    if k < 0:
        return (xs[0], xs[-1]) if xs else (math.nan, math.nan)
    return xs[k], xs[n - 1 - k]


@dataclass
class _Race:
    contenders: list[str] = field(default_factory=list)  # in the order they entered
    times: dict[str, list[float]] = field(default_factory=dict)  # counted steps, by round
    out: set[str] = field(default_factory=set)  # clearly slower: no more turns
    verdict: str | None = None
    reason: str = "waiting for a second contender"
    last: tuple[str, float, bool] | None = None  # (contender, start, counts) of the open step
    dirty: bool = True
    turn: int = 0

    def live(self) -> list[str]:
        return [c for c in self.contenders if c not in self.out]


class Judge:
    """Per input signature: who runs this step, and the verdict."""

    def __init__(self, run: int = RUN, min_rounds: int = MIN_ROUNDS,
                 max_rounds: int = MAX_ROUNDS) -> None:  # fmt: skip
        self.run, self.min_rounds = max(1, run), max(1, min_rounds)
        self.max_rounds = max(max_rounds, self.min_rounds)
        self._races: dict[object, _Race] = {}
        self._lock = threading.Lock()

    # -- the contenders -------------------------------------------------------------------
    def enter(self, key, name: str) -> None:
        """``name`` can run steps of signature ``key`` now. Where a verdict stands, the race
        starts again between the verdict and ``name`` alone."""
        with self._lock:
            race = self._race(key)
            if name in race.contenders and name not in race.out:
                return
            if race.verdict is not None:
                race.contenders = [race.verdict]
            if name not in race.contenders:
                race.contenders.append(name)
            self._restart(race, f"racing: {name} ready")

    def remove(self, key, name: str, why: str = "") -> None:
        """``name`` cannot run ``key`` (its first call failed): it leaves the race."""
        with self._lock:
            race = self._race(key)
            if name in race.contenders:
                race.contenders.remove(name)
            race.times.pop(name, None)
            if race.verdict == name:
                race.verdict = None
            self._restart(race, f"{name} left: {why}" if why else f"{name} left")

    def settle(self, key, name: str, reason: str) -> None:
        """A verdict without a race (the decision cache remembered one for ``key``)."""
        with self._lock:
            race = self._race(key)
            if name not in race.contenders:
                race.contenders.append(name)
            race.verdict, race.reason = name, reason

    def forget(self, key) -> None:
        """Drop ``key``'s race and verdict (its remembered winner cannot run): it starts
        again from its next contender."""
        with self._lock:
            self._races.pop(key, None)

    def reopen(self, key, why: str) -> None:
        """The verdict of ``key`` no longer holds (sustained drift): race every contender
        again."""
        with self._lock:
            race = self._races.get(key)
            if race is not None:
                race.out = set()
                self._restart(race, f"racing again: {why}")

    def dirty(self, key) -> None:
        """Something was compiled, profiled or measured during the open step of ``key``."""
        with self._lock:
            race = self._races.get(key)
            if race is not None:
                race.dirty = True

    # -- the steps ------------------------------------------------------------------------
    def choose(self, key, now: float) -> str | None:
        """Close the open step of ``key`` (counting its time) and pick who runs the step that
        starts ``now``: the verdict, or the contender whose turn it is; None while nothing
        can run it."""
        with self._lock:
            race = self._race(key)
            if race.last is not None and not race.dirty and race.verdict is None:
                who, t0, counts = race.last
                if counts and who in race.times:
                    race.times[who].append(now - t0)
                    self._decide(race)
            if race.verdict is not None:
                who, counts = race.verdict, False
            else:
                live = race.live()
                if not live:
                    race.last = None
                    return None
                if len(live) == 1:
                    who, counts = live[0], False
                else:
                    turn, step = divmod(race.turn, self.run)
                    race.turn += 1
                    who, counts = live[turn % len(live)], step == self.run - 1
            race.last, race.dirty = (who, now, counts), False
            return who

    def verdict(self, key) -> str | None:
        with self._lock:
            race = self._races.get(key)
            return race.verdict if race is not None else None

    def contenders(self, key) -> list[str]:
        with self._lock:
            race = self._races.get(key)
            return list(race.contenders) if race is not None else []

    def report(self) -> dict[object, tuple[str | None, str]]:
        """Per signature: (verdict, or None while racing; why)."""
        with self._lock:
            return {k: (r.verdict, r.reason) for k, r in self._races.items()}

    def medians(self, key) -> dict[str, float]:
        """Median counted step time per contender of ``key``'s current race (seconds)."""
        with self._lock:
            race = self._races.get(key)
            if race is None:
                return {}
            return {c: statistics.median(t) for c, t in race.times.items() if t}

    # -- the rule -------------------------------------------------------------------------
    def _race(self, key) -> _Race:
        race = self._races.get(key)
        if race is None:
            race = self._races[key] = _Race()
        return race

    @staticmethod
    def _restart(race: _Race, reason: str) -> None:
        race.times = {c: [] for c in race.contenders}
        race.verdict, race.reason, race.dirty, race.turn = None, reason, True, 0
        race.out = {c for c in race.out if c in race.contenders}
        if len(race.live()) == 1 and len(race.contenders) == 1:
            race.reason = "waiting for a second contender"

    def _decide(self, race: _Race) -> None:
        live = race.live()
        if len(live) < 2:
            return
        rounds = min(len(race.times[c]) for c in live)
        if rounds < self.min_rounds:
            race.reason = f"racing {', '.join(live)}: {rounds} rounds"
            return
        ref = next((c for c in REFERENCE if c in live), live[0])

        def ratios(a: str, b: str) -> list[float]:
            return [x / y for x, y in zip(race.times[a][:rounds], race.times[b][:rounds],
                                          strict=True) if y > 0]  # fmt: skip

        score = {c: 1.0 if c == ref else statistics.median(ratios(c, ref)) for c in live}
        # ties keep the reference, then the order of entry (eager last)
        order = sorted(live, key=lambda c: (score[c], c != ref, c == "eager"))
        leader = order[0]
        for c in live:
            if c != leader and median_interval(ratios(c, leader))[0] > 1.0:
                race.out.add(c)  # clearly slower than the leader
        live = race.live()
        times = ", ".join(f"{c} {statistics.median(race.times[c][:rounds]) * 1e3:.2f} ms"
                          for c in race.contenders if race.times.get(c))  # fmt: skip
        if len(live) == 1:
            race.verdict = live[0]
        elif rounds >= self.max_rounds:
            lo, hi = median_interval(ratios(leader, ref)) if leader != ref else (1.0, 1.0)
            race.verdict = leader if hi < 1.0 else ref
        else:
            race.reason = f"racing on after {rounds} rounds: median step {times}"
            return
        race.reason = (f"median step {times} over {rounds} rounds (per-round ratio to "
                       f"{ref}: " + ", ".join(f"{c} {score[c]:.3f}" for c in score if c != ref)
                       + f") -> {race.verdict}")  # fmt: skip
