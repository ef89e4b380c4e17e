"""A graph's planned program: plan its profile, generate the program, and at the first call
measure it against the serial program.

Which emitter (``codegen.executors.EXECUTORS``): the native stream interpreter
(``codegen.native``) when it is on (``native=`` of ``autopar.compile``, else
``$AUTOPAR_NATIVE``, default on) and built (``runtime.native.available()``); else
``$AUTOPAR_EXECUTOR`` or the Python program. Planning follows the emitter: the native
interpreter runs several streams at one intra-op thread each and a cross-stream wait is
an atomic flag, so its plans are made with those constants
(``codegen.native.planning_machine``) and compared with the serial plan at the caller's
thread count by the simulator; the Python program keeps the calibrated machine and the
layouts the options ask for.

Example::

    >>> from autopar.api import CompileOptions
    >>> emitter(CompileOptions(native=False))
    'python'
"""

from __future__ import annotations

import os
import time

from autopar.logs import env_switch

#: A multi-stream program must take at most this fraction of the serial program's time.
MEASURE_MARGIN = 0.95


def native_on(options) -> bool:
    """``options.native``, else ``$AUTOPAR_NATIVE`` (default on; the test suite turns it off
    so that only the tests of the interpreter depend on its build)."""
    flag = getattr(options, "native", None)
    if flag is None:
        flag = env_switch("AUTOPAR_NATIVE", empty_is_on=False)
    return bool(flag)


def emitter(options) -> str:
    """The ``EXECUTORS`` key for this model's planned programs now (module docstring)."""
    from autopar.runtime import native

    if native_on(options) and native.available():
        return "native"
    env = os.environ.get("AUTOPAR_EXECUTOR") or "python"
    return "python" if env == "native" and not native_on(options) else env


def make_plans(table, options, store, tag: str, executor: str, serial: bool = False):
    """The plan of one graph's profile for ``executor`` (``serial``: the one-stream plan that
    a multi-stream one is measured against)."""
    from autopar.codegen.native import planning_machine, planning_streams
    from autopar.planning.partition import default_machine, make_plan

    budget = getattr(options, "memory_budget", None)
    if serial:
        return make_plan(table, policy="serial", memory_budget=budget, graph_id=tag,
                         store=store)  # fmt: skip
    if executor != "native":
        return make_plan(
            table, streams=options.streams, policy=options.policy, memory_budget=budget,
            graph_id=tag, store=store,
        )  # fmt: skip
    machine = default_machine(store, "cpu")
    serial = make_plan(table, policy="serial", memory_budget=budget, graph_id=tag,
                       store=store, machine=machine)  # fmt: skip
    streams = planning_streams(options.streams, machine.cores)
    if streams is None:
        return serial
    multi = make_plan(
        table, streams=streams, policy=options.policy, memory_budget=budget, graph_id=tag,
        store=store, machine=planning_machine(machine),
    )  # fmt: skip
    return multi if multi.predicted_step_time < serial.predicted_step_time else serial


def plan_and_generate(record, table, options, store, provenance: dict, executor=None,
                      serial: bool = False):  # fmt: skip
    """Plan ``table`` (one graph's profile) and generate its program (thread-safe: the
    adaptive re-planner calls it from a background thread). Returns ``(plan, program)``.
    ``serial``: the one-stream plan (``make_plans``)."""
    from autopar.codegen.executors import generate

    executor = executor or emitter(options)
    t1 = time.perf_counter()
    plan = make_plans(table, options, store, record.tag, executor, serial)
    t2 = time.perf_counter()
    program = generate(record.gm, plan, record.tag, provenance=provenance, executor=executor)
    record.advance("plan", t2 - t1, plan.policy)
    record.advance("codegen", time.perf_counter() - t2)
    return plan, program


def confirm_by_measurement(record, table, args, plan, program, options, store, provenance):
    """Measure, don't assume: time the chosen multi-stream program against the serial
    program on the real inputs and keep the faster.

    The simulator's overheads for concurrent streams (GIL, wake-ups) are calibrated on
    microbenchmarks and can be off for a given graph; a few runs of both programs at the
    first call settle it. Graphs that write their inputs (BatchNorm statistics) or draw
    random numbers are measured too: ``SideEffectGuard`` restores the written inputs and the
    generators after every timed run, so training is unchanged (``autopar.runtime.measure``).
    A multi-stream program must win by ``MEASURE_MARGIN`` to be kept. The times go into the
    plan's notes. Returns ``(plan, program)``, the kept ones.
    """
    from autopar.codegen.executors import generate
    from autopar.runtime.measure import SideEffectGuard, time_candidates, written_inputs

    if len(getattr(program, "streams_used", ())) <= 1:
        return plan, program
    t0 = time.perf_counter()
    serial = make_plans(table, options, store, record.tag, "", serial=True)
    executor = "native" if program.executor == "native" else None
    serial_prog = generate(record.gm, serial, record.tag, provenance=provenance,
                           executor=executor)  # fmt: skip
    fns = {"plan": program.fn, "serial": serial_prog.fn}
    guard = SideEffectGuard(args, written_inputs(record.gm))
    best = time_candidates({k: (lambda a, f=f: f(*a)) for k, f in fns.items()}, args, guard)
    best.setdefault("plan", float("inf"))
    best.setdefault("serial", float("inf"))
    verdict = (
        f"measured at first call: {plan.policy} on {len(program.streams_used)} streams "
        f"{best['plan'] * 1e3:.3f} ms vs serial {best['serial'] * 1e3:.3f} ms"
    )
    record.advance("measure", time.perf_counter() - t0, verdict,
                   measured=(("plan", best["plan"]), ("serial", best["serial"])))
    if best["plan"] < MEASURE_MARGIN * best["serial"]:
        return plan.replace(notes=plan.notes + (verdict + ": kept the plan",)), program
    serial = serial.replace(notes=serial.notes + (verdict + ": kept serial",))
    return serial, generate(record.gm, serial, record.tag, provenance=provenance,
                            executor=executor)  # fmt: skip


class KeptPlans:
    """Planned programs that a per-graph tier replaced, kept as the step race's ``"plan"``
    contender until whole steps have judged them.

    Why: a tier lands when its graph, timed alone, beats the current program
    (``runtime.tiers.LAND_MARGIN``), but a graph timed alone is not the graph inside a
    training step. On the multi-tower MLP (2026-12-02, ``autopar bench --block 4``) the
    Inductor backward landed over the native two-stream backward (2.46 vs 2.59 ms alone);
    whole steps then ran 9.1 ms on it against 8.2 ms eager, and the race chose eager,
    while the native programs alone trained at 1.25x eager. Keeping the replaced program
    lets the race choose between them by what counts, the step.

    Example::

        >>> kept = KeptPlans()
        >>> kept.runner(object(), "current")
        'current'
    """

    def __init__(self) -> None:
        self._kept: dict[int, tuple] = {}  # id(record) -> (record, runner, unit, race key)

    def __bool__(self) -> bool:
        return bool(self._kept)

    def keep(self, record, runner, unit, key) -> None:
        """``record`` ran ``runner`` (its planned program, ``unit``) until a tier landed."""
        self._kept[id(record)] = (record, runner, unit, key)

    def runner(self, record, current):
        """What ``record`` runs in a ``"plan"`` step: its kept program, else ``current``."""
        kept = self._kept.get(id(record))
        return current if kept is None else kept[1]

    def settle(self, key, verdict: str, reason: str) -> list:
        """The race of ``key`` decided: ``"plan"`` puts the kept programs back, a compiled
        verdict drops them (the tiers stay), eager keeps them for a later race. Returns
        the records whose program changed."""
        if verdict == "eager":
            return []
        back = []
        for rid, (record, runner, unit, k) in list(self._kept.items()):
            if k != key:
                continue
            del self._kept[rid]
            if verdict != "plan":
                continue
            landed = record.executor
            with record.lock:
                record.runner = runner
                record.advance("race", 0.0, f"whole steps: {reason}: planned program kept "
                               f"over {landed}", program=unit.program, plan=unit.plan,
                               executor=unit.executor)  # fmt: skip
            back.append(record)
        return back
