"""The CUDA training program's CPU-checkable parts: the device picks the emitter and the
streams, stream annotations survive Inductor's re-trace, the monitor synchronises CUDA only
in measurement windows, a boxed call frees saved tensors at their last use, and the GPU
validation script forces its two-stream program by public options (and skips without CUDA).

CUDA is faked as tests/test_gpu_path.py does: traced values relabelled ``cuda:0`` (fake
tensors), profiles relabelled ``cuda:0``, a stored CUDA calibration, and ``torch.cuda``'s
events and synchronisation replaced where a test runs a call.
"""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
import threading
import time
import types
import weakref
from pathlib import Path

import pytest
import torch
from test_gpu_path import (
    ARGS,
    TAG,
    StreamSim,
    as_cuda,
    branches,
    clone_args,
    cuda_plan,
    cuda_store,
    install,
    simulate_boxed,
)
from torch.fx.experimental.proxy_tensor import make_fx
from torch.utils._python_dispatch import TorchDispatchMode

from autopar.api import CompileOptions
from autopar.codegen.emit import Boxed
from autopar.codegen.emitters import generate
from autopar.errors import PlanError
from autopar.planning import partition
from autopar.planning.costmodel import MachineModel, calibration_name
from autopar.planning.plan import Stream
from autopar.profiling.profiler import profile_graph
from autopar.runtime import planned

ROOT = Path(__file__).resolve().parents[1]


# -- 1. the device decides the emitter and the streams ---------------------------------------
@pytest.fixture
def profiled():
    """(graph, profile) of a graph with three independent branches, profiled on the CPU."""
    gm = make_fx(branches)(*ARGS)
    _, table = profile_graph(gm, list(ARGS), warmup=1, repeats=1)
    return gm, table


@pytest.fixture
def native_built(monkeypatch):
    """The native interpreter on and built (as on a machine that built it), and a record of
    every native program generated."""
    from autopar.codegen import emitters
    from autopar.runtime import native

    monkeypatch.setattr(native, "available", lambda: True)
    monkeypatch.setattr(partition, "_MACHINE_CACHE", {})  # a fake CUDA machine stays here
    calls = []
    monkeypatch.setitem(emitters.EMITTERS, "native", lambda *a, **k: calls.append(a) or 1 / 0)
    return calls


def record_of(gm):
    return types.SimpleNamespace(gm=gm, tag=TAG, advance=lambda *a, **k: None)


def test_a_cuda_graph_gets_cuda_streams_and_never_the_native_interpreter(profiled, native_built):
    gm, table = profiled
    table = table.copy()
    # A CUDA graph whose first value is a CPU one (an index tensor, a lifted constant) is
    # still a CUDA graph: the device is not its first row's.
    table["device"] = table["device"].replace({"cpu": "cuda:0"})
    table.loc[0, "device"] = "cpu"
    assert planned.graph_device(table) == "cuda:0"
    options = CompileOptions(native=True, streams=2, policy="round_robin")
    assert planned.emitter(options, "cpu") == "native"  # (the interpreter is on and built)
    assert planned.emitter(options, planned.graph_device(table)) == "python"

    store = cuda_store()
    # A stored CUDA calibration that lost its device still plans CUDA streams.
    values = MachineModel(device="cuda:0").to_dict()
    del values["device"], values["source"]
    store.put_calibration(calibration_name("cuda:0"), values)

    plan, prog = planned.plan_and_generate(record_of(as_cuda(gm)), table, options, store, {})
    assert [s.device for s in plan.streams] == ["cuda:0", "cuda:0"]
    assert len(prog.streams_used) == 2 and prog.executor != "native" and not native_built
    assert "torch.cuda.current_stream" in prog.source and "run_streams" not in prog.source


def test_a_cpu_graph_gets_cpu_streams_and_the_interpreter_when_built(profiled, native_built):
    gm, table = profiled
    options = CompileOptions(native=True, streams=2, policy="round_robin")
    assert planned.graph_device(table) == "cpu"
    assert planned.emitter(options, planned.graph_device(table)) == "native"
    plan = planned.make_plans(table, options, cuda_store(), TAG, "python")
    assert {s.device for s in plan.streams} == {"cpu"} and len(plan.streams) == 2
    prog = generate(gm, plan, TAG)
    assert "run_streams" in prog.source and "torch.cuda" not in prog.source


def test_a_graph_with_cuda_values_is_a_cuda_graph_whatever_its_profile_says(
    profiled, native_built
):
    gm, table = profiled  # a profile that says cpu throughout
    options = CompileOptions(native=True, streams=2, policy="round_robin")
    assert planned.graph_device(table, as_cuda(gm)) == "cuda:0"
    plan, prog = planned.plan_and_generate(record_of(gm), table, options, cuda_store(), {})
    assert prog.executor != "native" and not native_built
    assert {s.device for s in plan.streams} == {"cuda:0"}


def test_codegen_runs_a_plan_on_the_graphs_device(monkeypatch):
    """A CPU plan for a graph whose values are on cuda:0 runs on CUDA streams (never CPU
    worker threads launching CUDA kernels); a CUDA plan for a CPU graph is refused."""
    cpu_gm = make_fx(branches)(*ARGS)
    gm = as_cuda(make_fx(branches)(*ARGS))
    plan = cuda_plan(gm, lambda i, n: 1 if n.name in {"t", "mm_1", "relu"} else 0, 2)
    cpu_plan = plan.replace(streams=(Stream(0, "cpu", 1), Stream(1, "cpu", 1)))
    prog = generate(gm, cpu_plan, TAG)
    assert "run_streams" not in prog.source and "torch.cuda.set_stream" in prog.source
    assert [s.device for s in prog.plan.streams] == ["cuda:0", "cuda:0"]
    assert any("run as cuda:0 streams" in note for note in prog.notes)
    sim = install(StreamSim(), monkeypatch)
    simulate_boxed(sim, prog, clone_args(ARGS))
    assert not sim.errors, sim.errors
    with pytest.raises(PlanError, match="re-plan it on the graph's device"):
        generate(cpu_gm, plan, TAG)


# -- 2. stream annotations survive Inductor's re-trace ---------------------------------------
def two_branches(x, w):
    a = torch.nn.functional.hardswish(x @ w)
    b = torch.nn.functional.silu(x @ w.t()).log_softmax(-1)  # both decomposed by Inductor
    return a + b + torch.addcmul(x, x, x)


def test_stream_annotations_survive_the_inductor_retrace():
    from autopar.codegen import inductor
    from autopar.codegen.inductor_streams import annotate_streams

    args = [torch.randn(8, 16), torch.randn(16, 16)]
    gm = make_fx(two_branches)(*args)
    side = {"t", "mm_1", "silu", "_log_softmax"}
    plan = cuda_plan(gm, lambda i, n: 1 if n.name in side else 0, 2)
    annotate_streams(gm, plan, TAG, {1: 3})

    def annotated(g):
        return {n.name: n.meta["custom"]["stream"] for n in g.graph.nodes
                if "stream" in (n.meta.get("custom") or {})}  # fmt: skip

    before = annotated(gm)
    assert before == dict.fromkeys(side, 3)
    dec, _, _ = inductor.prepare(gm, args)
    after = annotated(dec)
    origin = {n.name: inductor.origin(n) for n in dec.graph.nodes}
    # Every node made from a side-stream node carries its stream (silu and log_softmax
    # became several nodes each), and none made from a main-stream node does.
    assert len(after) > len(before) and set(after.values()) == {3}
    assert {origin[n] for n in after} == side
    made = [n.name for n in dec.graph.nodes if n.op == "call_function"]
    assert all((n in after) == (origin[n] in side) for n in made)
    # The cross-stream syncs point at the re-traced graph's nodes.
    assert dec.meta["autopar.stream_index"] == {1: 3}
    (sync,) = gm.meta["autopar.stream_syncs"]
    (new,) = dec.meta["autopar.stream_syncs"]
    assert (origin[new[0]], origin[new[1]]) == sync and new[0] in after and new[1] not in after

    # The warm-up worker's copy: a pickled graph loses node meta; the job carries them.
    path = Path(os.environ["AUTOPAR_PROFILE_DIR"]) / "job.pt"
    torch.save({"gm": gm, "annotations": inductor.annotations(gm)}, path)
    job = torch.load(path, weights_only=False)
    copy = job["gm"]  # rebuilt from its code: other node names, no meta
    assert annotated(copy) == {} and [n.name for n in copy.graph.nodes] != list(origin)
    names = dict(zip((n.name for n in gm.graph.nodes), (n.name for n in copy.graph.nodes),
                     strict=True))  # fmt: skip
    assert annotated(inductor.annotate(copy, job["annotations"])) == {
        names[n]: s for n, s in before.items()
    }
    assert copy.meta["autopar.stream_syncs"] == [(names[sync[0]], names[sync[1]])]
    assert annotated(inductor.prepare(copy, args)[0]) == after  # the worker's compile input


# -- 3. the monitor synchronises CUDA in measurement windows only --------------------------
class Device:
    """A fake CUDA device: events complete when ``run()`` says the device caught up (or at
    a synchronisation); ``elapsed_time`` is the fake clock between two events."""

    def __init__(self):
        self.recorded = 0
        self.finished = 0
        self.syncs = []

    def event_class(self):
        device = self

        class Event:
            def __init__(self, enable_timing=False):
                assert enable_timing
                self.seq = None

            def record(self, stream):
                device.recorded += 1
                self.seq = device.recorded

            def query(self):
                return self.seq <= device.finished

            def elapsed_time(self, end):
                return float(end.seq - self.seq)  # ms: one per event between them

        return Event

    def synchronize(self, d=None):
        self.syncs.append(d)
        self.finished = self.recorded


@pytest.fixture
def device(monkeypatch):
    dev = Device()
    monkeypatch.setattr(torch.cuda, "Event", dev.event_class())
    monkeypatch.setattr(torch.cuda, "synchronize", dev.synchronize)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda d=None: f"caller on {d}")
    return dev


def fake_record(gm):
    return types.SimpleNamespace(
        gm=gm, plan=None, calls=0, lock=threading.RLock(), tag="g0.fw", executor="plan",
        runner=lambda a: a[0],
    )  # fmt: skip


def calls(monitor, record, n, device, caught_up=True):
    """``n`` graph calls, as ``capture.LazyGraph`` makes them; the device keeps up with the
    host when ``caught_up``, else lags until something synchronises."""
    for _ in range(n):
        record.calls += 1
        assert monitor.on_call(record, record.runner, [7]) == 7
        if caught_up:
            device.finished = device.recorded


def test_monitor_times_cuda_by_events_and_synchronises_in_windows_only(device):
    from autopar.adapt.monitor import MAX_PENDING, AdaptOptions, Monitor, cuda_devices

    gm = as_cuda(make_fx(branches)(*ARGS))
    assert cuda_devices(gm) == [torch.device("cuda:0")]
    assert cuda_devices(make_fx(branches)(*ARGS)) == []

    # Steady state: events only. Every sample_every-th call is a measurement window.
    mon = Monitor(None, AdaptOptions(sample_every=16), cache_size=2)
    record = fake_record(gm)
    calls(mon, record, 40, device)
    assert device.syncs == [torch.device("cuda:0")] * 2  # calls 16 and 32
    # Every call timed by its events (1 "ms" apart), read at the next call (the device
    # finished it meanwhile): the 40th is still unread.
    assert len(mon.rows) == 39 and [r[4] for r in mon.rows] == [1e-3] * 39
    assert mon.rows[15][7] == {0: 1e-3} and mon.rows[14][7] is None  # call 16 sampled

    # A device behind the host: calls are read once a window synchronised, in call order.
    device.syncs.clear()
    mon = Monitor(None, AdaptOptions(sample_every=16), cache_size=2)
    record = fake_record(gm)
    calls(mon, record, 15, device, caught_up=False)
    assert not device.syncs and not mon.rows
    calls(mon, record, 1, device, caught_up=False)
    assert len(device.syncs) == 1 and len(mon.rows) == 16

    # Never sampling: never a synchronisation, unless the host runs MAX_PENDING calls ahead.
    device.syncs.clear()
    mon = Monitor(None, AdaptOptions(sample_every=0), cache_size=2)
    record = fake_record(gm)
    calls(mon, record, 200, device)
    assert not device.syncs and len(mon.rows) == 199
    record = fake_record(gm)
    mon = Monitor(None, AdaptOptions(sample_every=0), cache_size=2)
    calls(mon, record, MAX_PENDING + 1, device, caught_up=False)
    assert len(device.syncs) == 1 and len(mon.rows) == MAX_PENDING


def test_a_cpu_graph_is_never_synchronised(device):
    from autopar.adapt.monitor import AdaptOptions, Monitor

    for every in (0, 1):
        mon = Monitor(None, AdaptOptions(sample_every=every), cache_size=2)
        calls(mon, fake_record(make_fx(branches)(*ARGS)), 5, device)
        assert not device.syncs and device.recorded == 0 and len(mon.rows) == 5


# -- 4. a boxed call frees saved tensors at their last use -----------------------------------
def backward_like(saved, grad):
    a = saved.sin()  # the saved tensor's last use
    b = (grad * 2).cos()
    return a + b


class Alive(TorchDispatchMode):
    """Whether ``ref`` is alive at each op: ``seen`` holds (op, alive) in call order."""

    def __init__(self, ref):
        super().__init__()
        self.ref, self.seen = ref, []

    def __torch_dispatch__(self, func, types_, args=(), kwargs=None):
        self.seen.append((str(func), self.ref() is not None))
        return func(*args, **(kwargs or {}))


def serial_plan(gm):
    plan = cuda_plan(gm, lambda i, n: 0, 1)
    return plan.replace(streams=(Stream(0, "cpu", 1),))


def test_a_boxed_call_frees_a_saved_tensor_before_the_program_returns():
    args = [torch.randn(64, 64), torch.randn(64, 64)]
    gm = make_fx(backward_like)(*clone_args(args))
    prog = generate(gm, serial_plan(gm), TAG)
    assert prog.boxed is not None and "_args.clear()" in prog.source
    want = gm(*clone_args(args))
    ref = weakref.ref(args[0])
    with Alive(ref) as alive:
        out = Boxed(prog)(args)
    assert args == [] and ref() is None
    torch.testing.assert_close(out, want, rtol=0, atol=0)
    ops = [op for op, _ in alive.seen]
    last = ops.index("aten.sin.default")
    assert all(a for _, a in alive.seen[: last + 1])  # alive up to its last use ...
    assert not any(a for _, a in alive.seen[last + 1 :])  # ... and dead from then on

    # A plain call keeps its arguments (the caller holds them), as before.
    kept = [torch.randn(64, 64), torch.randn(64, 64)]
    prog.fn(*kept)
    assert len(kept) == 2


def test_a_boxed_call_of_a_program_without_a_boxed_entry_still_empties_the_list():
    gm = make_fx(branches)(*ARGS)
    plan = cuda_plan(gm, lambda i, n: 1 if n.name in {"t", "mm_1", "relu"} else 0, 2)
    plan = plan.replace(streams=(Stream(0, "cpu", 1), Stream(1, "cpu", 1)))
    prog = generate(gm, plan, TAG)  # CPU worker streams: no forward_boxed
    assert prog.boxed is None and "run_streams" in prog.source
    args = clone_args(ARGS)
    out = Boxed(prog)(args)
    assert args == []
    torch.testing.assert_close(out, gm(*ARGS), rtol=0, atol=0)


def test_a_training_step_frees_saved_tensors_inside_the_backward():
    """End to end on autopar's own capture: the backward graph's runner gets the saved
    tensors in a list nobody else holds; at its last op, saved tensors it read early are
    already freed. (One stream: a serial program, as a CUDA one, frees at its ``del``s;
    CPU worker streams hold their arguments until the call returns.)"""
    import autopar
    from autopar.profiling.store import ProfileStore

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Tanh(), torch.nn.Linear(64, 64),
                                torch.nn.Tanh(), torch.nn.Linear(64, 1))  # fmt: skip
    cm = autopar.compile(model, executors=("plan",), native=False, adapt=False, streams=1,
                         store=ProfileStore.memory())  # fmt: skip
    x = torch.randn(16, 32)
    cm(x).sum().backward()  # profiles and plans both graphs
    (bw,) = [r for r in cm._autopar_pipeline.records if r.tag.endswith(".bw")]
    runner = bw.runner
    seen = {}

    def spy(args):
        refs = [weakref.ref(a) for a in args if isinstance(a, torch.Tensor)]

        class Last(TorchDispatchMode):
            def __torch_dispatch__(self, func, types_, a=(), kw=None):
                seen["dead"] = sum(r() is None for r in refs)
                return func(*a, **(kw or {}))

        with Last():
            out = runner(args)
        seen["list"] = list(args)
        return out

    bw.runner = spy
    cm(x).sum().backward()
    gc.collect()
    assert seen["list"] == []  # the runner emptied AOTAutograd's list
    assert bw.unit.program.boxed is not None
    assert seen["dead"] >= 4, seen  # saved activations died before the last op ran


# -- 5. the GPU validation script ----------------------------------------------------------
def load_validate():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import gpu_validate
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    return gpu_validate


def test_gpu_validate_without_cuda_skips_at_once(tmp_path):
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")
    t0 = time.monotonic()
    res = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "gpu_validate.py"), "--json",
         str(tmp_path / "v.json")],
        capture_output=True, text=True, timeout=120, env=env, cwd=tmp_path,
    )  # fmt: skip
    assert res.returncode == 0, res.stderr
    assert time.monotonic() - t0 < 30
    lines = res.stdout.strip().splitlines()
    assert "SKIP: CUDA is not available" in lines
    summary = json.loads(lines[-1])  # the JSON summary comes last
    assert summary["verdict"] == "SKIP" and summary["cuda"] is False
    assert json.loads((tmp_path / "v.json").read_text()) == summary


def test_the_two_stream_option_is_public_and_gives_two_cpu_streams():
    """gpu_validate's forcing options are autopar.compile's own (no patching): on this
    CPU they give the towers model a two-stream program, on CPU streams, training like
    eager by the fp64 oracle."""
    import inspect

    from oracle import check_training

    import autopar
    from autopar.profiling.store import ProfileStore
    from autopar.tools import zoo

    options = load_validate().TWO_STREAMS
    assert set(options) <= set(inspect.signature(autopar.compile).parameters)
    model, inputs = zoo.build("towers")
    seen = []

    def compile_fn(m):
        cm = autopar.compile(m, store=ProfileStore.memory(), **options)
        seen.append(cm)
        return cm

    check_training(model, inputs, compile_fn)
    cm = seen[0]
    cm(*inputs).sum().backward()  # a second step: the programs run
    units = autopar.graphs(cm)
    assert {u.tag for u in units} >= {"g0.fw", "g0.bw"}
    for u in units:
        assert u.plan.policy == "round_robin" and len(u.program.streams_used) == 2, u.tag
        assert {s.device for s in u.plan.streams} == {"cpu"}
        assert "torch.cuda" not in u.program.source and u.program.executor != "native"
