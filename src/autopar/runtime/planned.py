"""A graph's planned program: plan its profile and generate the program (the ``plan``
executor's per-graph work, at the graph's first call and at a re-plan).

Which emitter (``codegen.emitters.EMITTERS``): the native stream interpreter
(``codegen.native``) for a CPU graph when it is on (``native=`` of ``autopar.compile``, else
``$AUTOPAR_NATIVE``, default on) and built (``runtime.native.available()``); else the
Python program, the only one for a CUDA graph (the device decides: a CUDA graph never gets
the interpreter's CPU streams). Where the interpreter is on but not built, its build starts
in the background (``runtime.native_build``) for the graphs planned later. Planning follows
the emitter: the native interpreter runs several streams at one intra-op thread each and a
cross-stream wait is an atomic flag, so its plans are made with those constants
(``codegen.native.planning_machine``) and compared with the serial plan at the caller's
thread count by the simulator; the Python program keeps the calibrated machine.

Example::

    >>> from autopar.api import CompileOptions
    >>> emitter(CompileOptions(native=False), "cpu")
    'python'
"""

from __future__ import annotations

import time

from autopar.logs import env_switch


def native_on(options) -> bool:
    """``options.native``, else ``$AUTOPAR_NATIVE`` (default on; the test suite turns it off
    so that only the tests of the interpreter depend on its build)."""
    flag = getattr(options, "native", None)
    if flag is None:
        flag = env_switch("AUTOPAR_NATIVE", empty_is_on=False)
    return bool(flag)


def emitter(options, device: str = "cpu") -> str:
    """The ``EMITTERS`` key for a graph on ``device`` planned now (module docstring)."""
    from autopar.runtime import native

    if not native_on(options) or not str(device).startswith("cpu"):
        return "python"
    if native.available():
        return "native"
    from autopar.runtime.native_build import start_native_build

    start_native_build()  # for the graphs planned later (idle priority, once a process)
    return "python"


def graph_device(table) -> str:
    """The device of a profiled graph: its first operator's that names one, else ``cpu``."""
    devices = [d for d in getattr(table, "device", ()) if isinstance(d, str) and d]
    return devices[0] if devices else "cpu"


def make_plans(table, options, store, tag: str, emitter_name: str):
    """The plan of one graph's profile for the emitter ``emitter_name``."""
    from autopar.codegen.native import planning_machine, planning_streams
    from autopar.planning.partition import default_machine, make_plan

    budget = getattr(options, "memory_budget", None)
    if emitter_name != "native":
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


def plan_and_generate(record, table, options, store, provenance: dict):
    """Plan ``table`` (one graph's profile) and generate its program (thread-safe: the
    adaptive re-planner calls it from a background thread). Returns ``(plan, program)``."""
    from autopar.codegen.emitters import generate

    name = emitter(options, graph_device(table))
    t1 = time.perf_counter()
    plan = make_plans(table, options, store, record.tag, name)
    t2 = time.perf_counter()
    program = generate(record.gm, plan, record.tag, provenance=provenance, emitter=name)
    record.advance("plan", t2 - t1, plan.policy)
    record.advance("codegen", time.perf_counter() - t2)
    return plan, program
