"""The re-measure tier: the first call's choice between a graph's multi-stream program and
its serial program is measured again in the steady state, like any tier.

Why: the first call decides on three timed runs of each program (``runtime.planned.
confirm_by_measurement``), in a process that has just started, traced and profiled. Those
runs are not the steady state. The multi-tower MLP's forward (``autopar bench`` model
``towers``, 2-core box, 2026-12-03) measured at its first call, in six fresh processes:
two streams 0.64-1.21 ms against serial 0.67-1.17 ms. Twice the serial program was kept (once
it won outright, once the margin was missed). Measured later in the same process, the two
streams took 0.52 ms and serial 0.68-0.70 ms. A training run that kept serial there lost 7%
of every step for good: the bench read autopar at 1.01x eager next to its own planned
programs at 1.09x.

So the program the first call did not keep is offered as a candidate: ``"streams"``, the
cost model's multi-stream program, where serial was kept; ``"serial"`` where the
multi-stream program was kept. It needs no warm-up. It is measured with the others once
every warm-up is done (``runtime.tiers``) and lands only if faster by ``LAND_MARGIN``; with
the step race on, the program it replaces races it over whole steps (``runtime.race``).

Example::

    >>> from autopar.runtime.remeasure_tier import remeasure_candidate
    >>> remeasure_candidate(record, meta, pipeline, Candidate)   # doctest: +SKIP
    Candidate(name='streams', ...)
"""

from __future__ import annotations

from autopar.runtime.native_tier import FinishedJob


def remeasure_candidate(record, meta: list, planner, candidate):
    """The tier's ``candidate(...)`` for ``record``, or None: no planner (the pipeline
    passes itself: its ``plan_and_generate``), no profile, no planned program, or a
    program that the first call did not choose by measurement (its ``measure`` stamp,
    which only ``runtime.planned.confirm_by_measurement`` makes)."""
    program = record.program
    if planner is None or record.table is None or record.executor != "plan" or program is None:
        return None
    if not any(p.stage == "measure" for p in record.unit.provenance):
        return None
    serial = len(getattr(program, "streams_used", ())) > 1  # the other one: serial
    executor = "native" if program.executor == "native" else None
    made: list = []  # the program, generated once: by check(), which runs before build()

    def check() -> str | None:
        try:
            made.append(planner.plan_and_generate(record, record.table, executor,
                                                  serial=serial)[1])  # fmt: skip
        except Exception as exc:  # noqa: BLE001 - the current program simply stays
            return f"could not generate it ({type(exc).__name__}: {exc})"
        if not serial and len(made[-1].streams_used) < 2:
            return "the cost model plans one stream for it now"
        return None

    return candidate("serial" if serial else "streams", warm=FinishedJob,
                     build=lambda: made[-1], check=check, tag=record.tag,
                     executor="plan")  # fmt: skip
