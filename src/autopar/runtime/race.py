"""The whole-module safety net: a compiler that makes a step slower is a bug, so the first
steps of each input signature race whole eager steps against whole compiled steps, and the
module keeps whichever is faster.

Both are valid training steps (same Parameters, same RNG use, results equal to eager within
float reordering), so alternating them costs nothing in correctness. A step's time is the
wall time from one forward call to the next forward call of the same input signature: it
holds the forward, the backward, the optimizer and the user's own loop, which are the same
for both contenders. Steps during which anything compiled, profiled or measured are
"dirty" and not counted.

Policy (constants below): the contenders take turns of ``RUN`` consecutive steps, and only
the last step of a turn counts (E E C C E E ...): the first step after a switch runs with
the caches and allocator of the other contender, and single alternating steps hid a
compiled path's cost (deep MLP, 2026-11-30: compiled 0.7% slower than eager alternating
step by step, 2.9% slower counting the second of two, 6.3% slower in blocks of eight).
After ``SAMPLES`` clean counted steps of each, the compiled path is kept only if it is no
slower than eager (``MARGIN``, below); otherwise the module runs eagerly for that
signature and says why. When the two are within ``UNCLEAR`` of each other, a few steps
each cannot tell them apart, so the race goes on, up to ``MAX_SAMPLES`` each, before that
rule decides; a contender already ``UNCLEAR`` behind the leader takes no more
turns meanwhile (and cannot win), except the reference (below), which every score is
measured against. A new compiled tier (a faster executor landing, a
re-plan) calls :meth:`StepRace.reset`: the race runs again, so a later improvement is not
locked out by an early verdict.

A race's winner is first *provisional*: the steps run it, and ``CONFIRM_AFTER_S`` seconds
later the same contenders race again. The verdict is final once one contender has won
``AGREE`` races, or after ``MAX_RACES`` races (the last one's winner). Until then no
contender is dropped, and :meth:`StepRace.verdict` is None. Why: a race takes a few
seconds, and which contender wins depends on the box's state then. On the 2-core box the
Inception race once ran while a neighbour loaded it (the 2-thread matmul speedup read
1.29x, against 1.88x quiet) and kept the per-graph programs over the batch split by 3%;
on the quiet box the split then ran 1.36x the best peer and those programs 0.71x
(``benchmarks/race_replay.py``, 2026-12-03). A verdict must not rest on one window.

More compiled contenders can join (:meth:`StepRace.add`): a whole-graph tier whose worth
only whole steps show (``"joint"``, the Dynamo graph compiled by ``torch.compile``'s own
pipeline: a forward and backward timed alone misjudged it by 4-8% on the Inception model,
2026-11-30; ``"split"``, two half batches on two threads). They take turns with the
others (E E C C J J ...).

Who must beat whom: the *reference* is ``"joint"`` where it races (it runs exactly what
``torch.compile`` runs, so keeping it is never slower than that peer), else
``"compiled"``. Every contender is scored by the median, over rounds, of its step time
divided by the reference's step time *in the same round*: the box's load drifts slowly
(a 2-core box: one round's steps correlate 0.6-0.8, and the level moved 18 -> 13.5 ms
within 40 s), so per-round ratios cancel what separate medians keep. Another compiled
contender wins below ``ADDED_MARGIN``; eager wins below ``1 / MARGIN`` times the best
compiled contender's score (on that contender's scale: judged against the reference alone,
an eager step tied with a ``"compiled"`` one that carries ``ADDED_MARGIN`` won); ties go to
the reference, then to the other compiled contenders, then to eager. Measured on 200 rounds
of race-pattern steps per model (2026-12-02, ``benchmarks/race_replay.py``), replayed
through both rules: with ``"compiled"`` as the reference, separate medians and 5 to 15
samples, BERT's race ended on per-graph or eager steps in 38% of the replays (0.957x the
best peer on average); with this rule and 8 to 20 samples in 1% (0.975x); GPT-2 41% ->
3% (0.970x -> 0.979x).

Assumes one forward call per training step (the common loop); with several forwards per
step the race compares call-to-call intervals, which still treat both contenders alike on
average. Under ``torch.compile(model, backend="autopar")`` the pipeline marks the steps at
the Dynamo graph calls instead (``Pipeline._backend_graph_call``), and an eager step runs
each Dynamo graph as captured.

Example::

    >>> race = StepRace()
    >>> race.choose("k", now=0.0)   # first call of a signature: compiled (it compiles)
    'compiled'
"""

from __future__ import annotations

import os
import statistics
import threading
from dataclasses import dataclass, field

#: Clean steps per contender before a verdict. Replays of recorded races
#: (``benchmarks/race_replay.py``, 2026-12-02), with this module's rule, against 5 (and
#: ``MAX_SAMPLES`` 15): BERT chose eager or per-graph steps in 1% of the replays instead of
#: 7%, GPT-2 in 3% instead of 8%; about three rounds more per race.
SAMPLES = 8
#: Consecutive steps per turn; only a turn's last step is a sample (module docstring).
RUN = 2
#: The reference must be no slower than this times eager to be kept (eager's per-round
#: ratio is scaled by it): ties go to the compiled reference, whose steady state can still
#: improve (tiers), but a measurable loss goes to eager.
MARGIN = 1.0
#: Scores closer than this (relative) are a tie that a few samples cannot settle: on the
#: 2-core box a step's interquartile range is 5-15%, and a race of 5 + 5 steps on the deep
#: MLP kept compiled at 5.53 vs 5.56 ms while 60 interleaved steps then measured it 5%
#: slower than eager (2026-11-30). Race on instead.
UNCLEAR = 0.03
#: A compiled contender other than the reference must take at most this fraction of the
#: reference's step to win: the reference keeps near-ties, as a tier must beat the
#: current executor by ``runtime.tiers.LAND_MARGIN``. Needed where a step's interval spans
#: other work (a loop that also steps other models): the char-LSTM demo's race picked the
#: joint executor at 72.6 vs 74.8 ms, inside that noise (2026-11-30).
ADDED_MARGIN = 0.97
#: At most this many clean steps per contender: a tie within ``UNCLEAR`` costs at most
#: that much on these steps, and then the margins decide.
MAX_SAMPLES = 20
#: Seconds from a race's provisional verdict to the race that confirms it (module
#: docstring): long against a neighbour's burst of load on the box (a compile takes 20-40
#: s), short against a training run. ``$AUTOPAR_RACE_CONFIRM_S`` sets it; ``off``: one
#: race decides (the test suite's default, except in the tests of confirmation).
CONFIRM_AFTER_S = 10.0
#: Races a contender must win for a final verdict ...
AGREE = 2
#: ... or the last winner after this many races (three that disagree: the box changed
#: during each; the latest state is the best guess).
MAX_RACES = 3


BASE = ("eager", "compiled")
#: The reference contender: the first of these that races (module docstring).
REFERENCE = ("joint", "compiled")


@dataclass
class _Race:
    samples: dict[str, list[float]] = field(default_factory=lambda: {k: [] for k in BASE})
    verdict: str | None = None
    reason: str = "racing eager and compiled steps"
    last: tuple[str, float, bool] | None = None  # (contender, start, counts) of the open step
    dirty: bool = True  # the open step compiled/measured something: don't count it
    turn: int = 0
    out: set[str] = field(default_factory=set)  # clearly behind: no more turns (``_decide``)
    wins: list[str] = field(default_factory=list)  # each race's winner, until a final verdict
    provisional: str | None = None  # the last race's winner, run until the next race
    again_at: float = 0.0  # when the next (confirming) race starts


def confirm_delay_from_env() -> float | None:
    """``$AUTOPAR_RACE_CONFIRM_S``: seconds (``CONFIRM_AFTER_S`` when unset), or ``off``."""
    text = os.environ.get("AUTOPAR_RACE_CONFIRM_S", "").strip().lower()
    if not text:
        return CONFIRM_AFTER_S
    if text in ("off", "none", "no"):
        return None
    try:
        return max(0.0, float(text))
    except ValueError:
        raise ValueError(
            f"AUTOPAR_RACE_CONFIRM_S={text!r}: give seconds (e.g. 10) or 'off'"
        ) from None


class StepRace:
    """Per input signature: which path runs this step, and what the race has seen."""

    def __init__(
        self,
        samples: int = SAMPLES,
        margin: float = MARGIN,
        enabled: bool = True,
        max_samples: int = MAX_SAMPLES,
        run: int = RUN,
        confirm_after_s: float | None | str = "env",
    ):
        self.samples, self.margin, self.enabled = samples, margin, enabled
        #: seconds to the confirming race (None: the first race is final); see the module
        self.confirm_after_s = (confirm_delay_from_env() if confirm_after_s == "env"
                                else confirm_after_s)  # fmt: skip
        self.run = max(1, run)
        self.max_samples = max(max_samples, samples)
        self._races: dict[object, _Race] = {}
        self._lock = threading.Lock()

    def choose(self, key, now: float, paused: float = 0.0) -> str:
        """Close the previous step of ``key`` (counting its time, less ``paused`` seconds
        the caller slept before ``now`` for a background compile) and pick ``"eager"``,
        ``"compiled"`` or an added contender for the step that starts ``now``."""
        with self._lock:
            race = self._race(key)
            if race.last is not None and not race.dirty and race.verdict is None:
                who, t0, counts = race.last
                if counts:
                    race.samples[who].append(now - t0 - paused)
            if race.provisional is not None and now >= race.again_at:
                self._again(race)
            if race.verdict is None and race.provisional is None and self.enabled:
                self._decide(race, now)
            counts = False
            if race.verdict is not None or not self.enabled:
                who = race.verdict or "compiled"
            elif race.provisional is not None:
                who = race.provisional  # between two races: run the last one's winner
            elif not race.samples["compiled"] and race.last is None:
                who = "compiled"  # the very first step compiles: start there
            else:
                race.turn += 1
                turn, step = divmod(race.turn - 1, self.run)
                names = [k for k in race.samples if k not in race.out]  # eager, compiled, added
                who = names[turn % len(names)]
                counts = step == self.run - 1  # the last step of its turn
            race.last, race.dirty = (who, now, counts), False
            return who

    def add(self, contender: str, key) -> None:
        """A new way to run compiled steps of signature ``key`` is ready: race that signature
        again, with it (the others, which cannot run it, race on as they were)."""
        with self._lock:
            race = self._race(key)
            race.samples.setdefault(contender, [])
            self._restart(f"racing again: {contender} ready", [race])

    def remove(self, contender: str, key) -> None:
        """``contender`` cannot run signature ``key`` (its first call failed): it leaves
        that race, which goes on with the others."""
        with self._lock:
            race = self._race(key)
            race.samples.pop(contender, None)
            race.out.discard(contender)
            race.dirty = True

    def _race(self, key) -> _Race:
        race = self._races.get(key)
        if race is None:
            race = self._races[key] = _Race()
        return race

    def verdict(self, key) -> str | None:
        with self._lock:
            race = self._races.get(key)
            return race.verdict if race is not None else None

    def mark_dirty(self, key) -> None:
        """Something was compiled, profiled or measured during the open step of ``key``."""
        with self._lock:
            race = self._races.get(key)
            if race is not None:
                race.dirty = True

    def reset(self) -> None:
        """A new compiled tier landed: race every signature again."""
        with self._lock:
            self._restart("racing again: a new tier", list(self._races.values()))

    @staticmethod
    def _restart(reason: str, races: list[_Race]) -> None:
        """A new set of contenders: race afresh (earlier races' wins no longer count)."""
        for race in races:
            StepRace._again(race, reason)
            race.wins = []

    @staticmethod
    def _again(race: _Race, reason: str | None = None) -> None:
        """Start the next race of ``race``'s contenders (all of them take turns again)."""
        if reason is None:
            won = ", ".join(race.wins)
            reason = f"racing again to confirm {race.provisional} (races won so far: {won})"
        race.samples = {k: [] for k in race.samples}
        race.verdict, race.reason, race.dirty, race.out = None, reason, True, set()
        race.provisional, race.turn = None, 0

    def _decide(self, race: _Race, now: float) -> None:
        names = list(race.samples)  # eager, compiled, then the added ones
        counts = {k: len(race.samples[k]) for k in names}
        steps = " + ".join(str(counts[k]) for k in ("compiled", "eager", *names[2:]))
        if min(counts.values()) < self.samples:
            return
        ref = next(k for k in REFERENCE if k in race.samples)
        # Each contender's step over the reference's step of the same round, scaled by
        # its margin; ties go to the reference, then the other compiled ones, then eager.
        prefer = [ref, *(k for k in names if k not in (ref, "eager")), "eager"]
        per_round = {k: 1.0 if k == ref else _per_round(race.samples[k], race.samples[ref])
                     for k in names}  # fmt: skip
        scale = {k: 1.0 if k == ref else 1.0 / ADDED_MARGIN for k in names if k != "eager"}
        score = {k: per_round[k] * scale[k] for k in scale}
        # Eager is judged against the best compiled contender, on that contender's scale:
        # with ``"joint"`` the reference, ``"compiled"`` carries ``ADDED_MARGIN`` against
        # it, and an unscaled eager won a tie with compiled (the towers, 2026-12-02
        # evening: per round vs joint eager 0.897, compiled 0.898 -> eager).
        champ = min((k for k in prefer if k in score and k not in race.out),
                    key=lambda k: score[k])  # fmt: skip
        score["eager"] = per_round["eager"] * self.margin * scale[champ]
        # A contender clearly behind the leader takes no more turns (and cannot win): a
        # near-tie between the others races on without it (a race of four had run
        # 10 + 9 + 10 + 9 steps, 2026-11-30). The reference always takes its turns: every
        # score is measured against its steps.
        best = min((k for k in prefer if k not in race.out), key=lambda k: score[k])
        race.out |= {k for k in names
                     if k not in (best, ref) and score[k] > (1 + UNCLEAR) * score[best]}
        live = [k for k in prefer if k not in race.out]  # `prefer` order: ties keep it
        ranked = sorted(live, key=lambda k: score[k])
        best = ranked[0]
        if (len(ranked) > 1 and score[ranked[1]] - score[best] < UNCLEAR * score[best]
                and min(counts[k] for k in live) < self.max_samples):  # fmt: skip
            race.reason = f"racing on: within {UNCLEAR:.0%} after {steps}"
            return
        med = {k: statistics.median(race.samples[k]) for k in names}  # for the reason only
        others = "".join(f" vs {k} {med[k] * 1e3:.2f} ms" for k in names if k not in BASE)
        rounds = ", ".join(f"{k} {per_round[k]:.3f}" for k in names if k != ref)
        race.reason = (
            f"median step: compiled {med['compiled'] * 1e3:.2f} ms vs eager "
            f"{med['eager'] * 1e3:.2f} ms{others} ({steps} steps; per round vs {ref}: "
            f"{rounds}) -> {best}"
        )
        race.wins.append(best)
        if (self.confirm_after_s is None or race.wins.count(best) >= AGREE
                or len(race.wins) >= MAX_RACES):  # fmt: skip
            race.verdict = best
            if len(race.wins) > 1:
                race.reason += f" (races won: {', '.join(race.wins)})"
            return
        race.provisional, race.again_at = best, now + self.confirm_after_s
        race.reason += (f", provisional: race {len(race.wins) + 1} in "
                        f"{self.confirm_after_s:g} s confirms or overturns it")  # fmt: skip

    def report(self) -> dict[object, tuple[str | None, str]]:
        """Per signature: (verdict or None while racing, reason)."""
        with self._lock:
            return {k: (r.verdict, r.reason) for k, r in self._races.items()}


def _per_round(times: list[float], ref: list[float]) -> float:
    """Median over rounds of ``times[i] / ref[i]`` (the i-th counted steps of two
    contenders ran in the same round of turns, give or take one dirty step)."""
    return statistics.median(t / r for t, r in zip(times, ref, strict=False))
