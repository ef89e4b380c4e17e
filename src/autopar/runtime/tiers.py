"""Tiered compilation: training starts on the cheapest correct tier at once, and faster
executors land later, each only if measured faster.

Tier 0 is what the first call chose (the planned program, or the captured graph). Tier 1
is the whole graph compiled by Inductor (``autopar.codegen.inductor``). With
``background=True`` its cold compile runs in another process that fills Inductor's cache
(:func:`~autopar.codegen.inductor.start_warmup`); when that process has finished, the
graph's next call compiles here (a cache hit), times both tiers on the real inputs with
their side effects undone (``runtime.measure``), and keeps the faster. The swap happens
between two calls of the graph, under its lock; the module-level race is reset so eager,
too, is measured against the new tier. With ``background=False`` everything happens at
the first call (slow first step, fastest steady state from step 2).

Example::

    >>> tiers = Tiers(background=True)                  # doctest: +SKIP
    >>> tiers.start(record, args)     # at the first call, after tier 0 was chosen
    >>> tiers.maybe_land(record, args)  # at each later call
"""

from __future__ import annotations

import atexit
import logging
import time
import weakref
from dataclasses import dataclass
from typing import Any

from autopar.codegen.inductor import compile_inductor, input_meta, stand_ins, start_warmup
from autopar.runtime.measure import SideEffectGuard, time_candidates, written_inputs

log = logging.getLogger("autopar")

#: A new tier must take at most this fraction of the current tier's time to be swapped in
#: (measurement noise must not flip executors back and forth).
LAND_MARGIN = 0.97


@dataclass
class _Tier:
    meta: list
    started: float
    proc: Any = None  # the warm-up process (None: none, or reaped)
    program: Any = None  # compiled here, waiting to be measured at the next call
    done: bool = False  # landed, lost, or failed: nothing more to do
    error: str | None = None


class Tiers:
    """The background compiles of one compiled model, and their landing."""

    def __init__(self, background: bool = True):
        self.background = background
        self._tiers: dict[int, _Tier] = {}
        self.events: list[str] = []  # one line per tier that landed, lost or failed
        weakref.finalize(self, _stop, self._tiers)

    # -- the first call ---------------------------------------------------------------
    def start(self, record, args: list) -> None:
        """Begin compiling ``record``'s graph with Inductor (in another process, or now)."""
        tier = _Tier(input_meta(args), time.perf_counter())
        self._tiers[id(record)] = tier
        if not self.background:
            self._compile(record, tier)
            self._land(record, tier, args)
            return
        try:
            tier.proc = start_warmup(record.gm, stand_ins(tier.meta), record.tag)
            _LIVE.add(tier.proc)
        except Exception as exc:  # noqa: BLE001 - no warm-up: compile at the next call
            log.debug("autopar: %s: no background warm-up (%s)", record.tag, exc)

    # -- every later call ---------------------------------------------------------------
    def maybe_land(self, record, args: list) -> None:
        """If ``record``'s background compile is ready, measure it and maybe swap it in."""
        tier = self._tiers.get(id(record))
        if tier is None or tier.done:
            return
        if tier.proc is not None and tier.proc.poll() is None:
            return  # still compiling elsewhere
        self._reap(record, tier)
        if tier.program is None and not tier.done:
            self._compile(record, tier)
        if not tier.done:
            self._land(record, tier, args)

    def pending(self) -> int:
        return sum(not t.done for t in self._tiers.values())

    def wait(self, records, timeout: float | None = None) -> bool:
        """Block until every background compile has finished and been compiled here (they
        are measured and swapped at each graph's next call). True when nothing is left."""
        deadline = None if timeout is None else time.monotonic() + timeout
        for record in records:
            tier = self._tiers.get(id(record))
            if tier is None or tier.done:
                continue
            if tier.proc is not None:
                left = None if deadline is None else max(0.0, deadline - time.monotonic())
                try:
                    tier.proc.wait(left)
                except Exception:  # noqa: BLE001 - subprocess.TimeoutExpired
                    return False
                self._reap(record, tier)
            if tier.program is None and not tier.done:
                self._compile(record, tier)
        return True

    # -- mechanics ----------------------------------------------------------------------
    def _reap(self, record, tier: _Tier) -> None:
        proc, tier.proc = tier.proc, None
        if proc is None:
            return
        _LIVE.discard(proc)
        if proc.returncode:
            err = (proc.stderr.read() if proc.stderr else b"").decode(errors="replace")
            last = err.strip().splitlines()[-1] if err.strip() else f"exit {proc.returncode}"
            log.debug("autopar: %s: warm-up process failed: %s", record.tag, last)
        if proc.stderr:
            proc.stderr.close()

    def _compile(self, record, tier: _Tier) -> None:
        try:
            tier.program = compile_inductor(record.gm, stand_ins(tier.meta), tag=record.tag)
        except Exception as exc:  # noqa: BLE001 - the current tier simply stays
            tier.done, tier.error = True, f"{type(exc).__name__}: {exc}"
            self._event(record, f"inductor could not compile it ({tier.error}); tier kept")

    def _land(self, record, tier: _Tier, args: list) -> None:
        tier.done = True
        current, prog = record.runner, tier.program
        if current is None:
            current = lambda a, f=record.gm.forward: f(*a)  # noqa: E731
        guard = SideEffectGuard(args, written_inputs(record.gm))
        best = time_candidates({"current": current, "inductor": lambda a: prog.fn(*a)},
                               args, guard)  # fmt: skip
        cur, ind = best.get("current", float("inf")), best.get("inductor", float("inf"))
        waited = time.perf_counter() - tier.started
        verdict = (
            f"inductor {ind * 1e3:.3f} ms vs {record.executor} {cur * 1e3:.3f} ms "
            f"(ready {waited:.1f} s after the first call)"
        )
        if ind < LAND_MARGIN * cur:
            with record.lock:
                fn = prog.fn
                record.runner = lambda a: fn(*a)
                record.advance("tier", waited, verdict + ": landed", program=prog,
                               executor="inductor")  # fmt: skip
            self._event(record, verdict + ": landed")
        else:
            record.advance("tier", waited, verdict + ": kept " + record.executor)
            self._event(record, verdict + f": kept {record.executor}")

    def _event(self, record, text: str) -> None:
        line = f"{record.tag}: {text}"
        self.events.append(line)
        log.info("autopar: %s", line)


_LIVE: set = set()  # warm-up processes still running, stopped at exit


def _stop(tiers: dict) -> None:
    for tier in tiers.values():
        if tier.proc is not None and tier.proc.poll() is None:
            tier.proc.kill()


@atexit.register
def _stop_all() -> None:
    for proc in list(_LIVE):
        if proc.poll() is None:
            proc.kill()
