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


def graph_device(table, gm=None) -> str:
    """The device of a profiled graph: the CUDA device most of its rows name when any row
    names one, else ``cpu``. A CUDA graph may hold CPU values (an index tensor, a lifted
    constant, a scalar input) and even start with one; its first row must not make it a
    CPU graph, which would give it the interpreter's CPU streams. With ``gm`` (the graph),
    its traced values count too: a table that lost its devices cannot make a graph with
    CUDA values a CPU graph.

    Example::

        >>> import pandas as pd
        >>> graph_device(pd.DataFrame({"device": ["cpu", "cuda:0", "cuda:0", ""]}))
        'cuda:0'
    """
    from collections import Counter

    devices = Counter(d for d in getattr(table, "device", ()) if isinstance(d, str) and d)
    if gm is not None:
        from autopar.codegen.python import traced_devices

        devices.update(traced_devices(gm))
    cuda = [d for d, _ in devices.most_common() if d.startswith("cuda")]
    if cuda:
        return "cuda:0" if cuda[0] == "cuda" else cuda[0]
    return "cpu"


def make_plans(table, options, store, tag: str, emitter_name: str, device: str | None = None):
    """The plan of one graph's profile for the emitter ``emitter_name``, on ``device``
    (default: :func:`graph_device` of the table)."""
    from autopar.codegen.native import planning_machine, planning_streams
    from autopar.planning.partition import default_machine, make_plan

    budget = getattr(options, "memory_budget", None)
    if emitter_name != "native":
        # The machine of the device the emitter was chosen for (graph_device), so that the
        # planner's streams are on the graph's device: a CUDA graph gets CUDA streams.
        return make_plan(
            table, streams=options.streams, policy=options.policy, memory_budget=budget,
            graph_id=tag, store=store,
            machine=default_machine(store, device or graph_device(table)),
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

    device = graph_device(table, record.gm)
    name = emitter(options, device)
    t1 = time.perf_counter()
    plan = make_plans(table, options, store, record.tag, name, device)
    t2 = time.perf_counter()
    program = generate(record.gm, plan, record.tag, provenance=provenance, emitter=name)
    record.advance("plan", t2 - t1, plan.policy)
    record.advance("codegen", time.perf_counter() - t2)
    return plan, program
