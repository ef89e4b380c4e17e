"""The CUDA path, checked on a machine without a GPU.

Codegen only writes source, so a CUDA plan can be generated for a graph whose traced values
say ``cuda:0`` (a CPU trace relabelled with fake CUDA tensors). The generated program is
then *run* on CPU tensors with ``torch.cuda``'s stream and event calls replaced by a
simulator (:class:`StreamSim`): every aten op is logged with the stream it was enqueued on,
and the device's ordering rules are replayed with vector clocks (an op on stream ``s`` may
use data written by an op on stream ``t`` only if ``s`` has, through waits on events and
streams, learned that op finished; likewise for writes after reads). That is what a race
on the GPU would need, so a program the simulator accepts is race-free for the plan, and
its results must equal the graph's. It also checks ``record_stream`` (every cross-stream
use of a tensor is recorded for its allocator), models the caching allocator's reuse (a
storage freed while another stream may still use it, and handed out again by its home
stream's pool, is a race), runs the caller on a non-default stream of its own, and checks
that the program joins all work into the caller's stream and leaves it current.
"""

from __future__ import annotations

import itertools
import operator
import random
import weakref
from pathlib import Path

import pytest
import torch
from functorch.compile import aot_function
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

import autopar.runtime.streams as rt
from autopar.capture.analysis import buffer_analysis
from autopar.codegen.cuda import device_waits, is_metadata_only
from autopar.codegen.emit import Boxed, schedule
from autopar.codegen.emitters import generate
from autopar.codegen.inductor_streams import annotate_streams
from autopar.planning.plan import Plan, Stream, Sync, node_key
from autopar.tools import zoo

ROOT = Path(__file__).resolve().parents[1]
TAG = "g0.fw"


# -- graphs with CUDA values, built on CPU ---------------------------------------------------
def as_cuda(gm, keep_cpu=(), device="cuda:0"):
    """Relabel ``gm``'s traced values as fake tensors on ``device`` (nodes named in
    ``keep_cpu`` stay on the CPU): what a trace on a GPU would have recorded."""
    with FakeTensorMode():
        for n in gm.graph.nodes:
            v = n.meta.get("val")
            if n.name in keep_cpu:
                continue
            if isinstance(v, torch.Tensor):
                n.meta["val"] = torch.empty_strided(
                    v.shape, v.stride(), dtype=v.dtype, device=device
                )
            elif isinstance(v, (list, tuple)):
                n.meta["val"] = type(v)(
                    torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device=device)
                    if isinstance(x, torch.Tensor)
                    else x
                    for x in v
                )
    return gm


def cuda_plan(gm, assign, n_streams, tag=TAG):
    """A plan on ``cuda:0`` placing node ``n`` on ``assign(i, n) % n_streams`` (graph order;
    a sync for every cross-stream data edge, as the planner would emit)."""
    nodes = list(gm.graph.nodes)
    place = {node_key(tag, n.name): assign(i, n) % n_streams for i, n in enumerate(nodes)}
    syncs = [
        Sync(node_key(tag, n.name), node_key(tag, u.name), place[node_key(tag, n.name)],
             place[node_key(tag, u.name)])
        for n in nodes for u in n.users
        if place[node_key(tag, n.name)] != place[node_key(tag, u.name)]
    ]  # fmt: skip
    streams = tuple(Stream(i, "cuda:0", 0) for i in range(n_streams))
    order = tuple(node_key(tag, n.name) for n in nodes)
    return Plan(tag, "hand", streams, tuple(sorted(place.items())), order, tuple(syncs))


def train_graphs(name: str):
    """(fw gm, fw args, bw gm, bw args) of a zoo model's training step, traced on CPU by
    AOTAutograd (as autopar captures them), values relabelled to cuda:0."""
    model, inputs = zoo.build(name)
    names = [k for k, _ in model.named_parameters()] + [k for k, _ in model.named_buffers()]
    state = [p.detach().clone().requires_grad_() for p in model.parameters()]
    state += [b.clone() for b in model.buffers()]  # inputs too: BatchNorm updates them
    got: dict = {}

    def compiler(kind):
        def compile_(gm, example_inputs):
            got[kind] = gm

            def run(args):
                got[kind + "_args"] = clone_args(args)
                return gm(*args)

            run._boxed_call = True
            return run

        return compile_

    def f(*a):
        tensors = dict(zip(names, a[len(inputs) :], strict=True))
        return torch.func.functional_call(model, tensors, a[: len(inputs)])

    step = aot_function(f, fw_compiler=compiler("fw"), bw_compiler=compiler("bw"))
    torch.manual_seed(0)
    step(*inputs, *state).sum().backward()
    return as_cuda(got["fw"]), got["fw_args"], as_cuda(got["bw"]), got["bw_args"]


# -- the simulator --------------------------------------------------------------------------
class FakeStream:
    def __init__(self, sim: StreamSim, name: str):
        self.sim, self.name = sim, name
        self.count = 0
        self.clock: dict[FakeStream, int] = {}

    def merge(self, clock: dict) -> None:
        for s, i in clock.items():
            if i > self.clock.get(s, -1):
                self.clock[s] = i

    def wait_stream(self, other: FakeStream) -> None:
        self.merge(other.clock)

    def wait_event(self, event: FakeEvent) -> None:
        assert event.snapshot is not None, "waited on an event that was never recorded"
        self.merge(event.snapshot)

    def __repr__(self) -> str:
        return f"<stream {self.name}>"


class FakeEvent:
    def __init__(self, *args, **kwargs):
        self.snapshot: dict | None = None

    def record(self, stream: FakeStream) -> None:
        self.snapshot = dict(stream.clock)


class StreamSim(TorchDispatchMode):
    """Replays the device's stream semantics for a program run on CPU tensors.

    Data: an op may read what an op of another stream wrote, or overwrite what one read,
    only once its stream knows (vector clocks, through waits on events and streams) that
    op finished. Memory, as the CUDA caching allocator hands it out: a storage comes from
    the pool of the stream that allocated it (its *home*), and when the host frees it the
    block is at once free for the home stream's next allocation, unless ``record_stream``
    named the other streams that used it (then the allocator waits for them). So a storage
    used on stream ``c``, freed without ``record_stream(c)``, is a race when the home
    stream allocates again before it knows ``c``'s last use finished ("reused"). Frees are
    seen as they happen (a finalizer on each storage), so the program's own ``del`` and a
    boxed call's emptied argument list count. The caller runs on a stream of its own
    (``caller``), not the default stream (``default``): a program must fork from and join
    into the caller's stream and leave it current.
    """

    def __init__(self):
        super().__init__()
        self.main = FakeStream(self, "caller")
        self.default = FakeStream(self, "default")
        self.current = self.main
        self.streams = [self.main, self.default]
        self.ids: dict[int, int] = {}  # id(live storage object) -> key (unique per storage)
        self.names = itertools.count()
        self.writer: dict[int, tuple] = {}  # storage -> (stream, index) of its last write
        self.readers: dict[int, list] = {}  # storage -> reads since that write
        self.alloc: dict[int, FakeStream] = {}  # storage -> stream whose pool it came from
        self.last_use: dict[int, dict] = {}  # storage -> stream -> its last op using it
        self.freed_unsafe: dict[FakeStream, list] = {}  # home -> (stream, op) uses at frees
        self.used: set[tuple[int, FakeStream]] = set()
        self.recorded: set[tuple[int, FakeStream]] = set()
        self.errors: list[str] = []
        self.kernels: list[tuple[str, str]] = []  # (op, stream name) in enqueue order
        self.frees = 0
        self.active = False

    # torch.cuda stand-ins
    def new_stream(self, *args, **kwargs) -> FakeStream:
        s = FakeStream(self, f"side{len(self.streams) - 1}")
        self.streams.append(s)
        return s

    def set_stream(self, s: FakeStream) -> None:
        self.current = s

    def record_stream(self, t: torch.Tensor, s: FakeStream) -> None:
        self.recorded.add((self.key(t), s))

    def key(self, t: torch.Tensor) -> int:
        st = t.untyped_storage()  # one Python object per storage while it lives
        k = self.ids.get(id(st))
        if k is None:
            k = self.ids[id(st)] = next(self.names)
            weakref.finalize(st, self.freed, id(st), k).atexit = False
        return k

    def freed(self, obj: int, k: int) -> None:
        """The host freed storage ``k``: its block is back in its home stream's pool."""
        self.ids.pop(obj, None)
        if not self.active:
            return
        self.frees += 1
        home = self.alloc.get(k, self.main)
        for s, op in self.last_use.get(k, {}).items():
            if s is not home and (k, s) not in self.recorded:
                self.freed_unsafe.setdefault(home, []).append((s, op))

    def run_op(self, s: FakeStream) -> tuple:
        i = s.count
        s.count += 1
        s.clock[s] = i
        return (s, i)

    def knows(self, s: FakeStream, op: tuple) -> bool:
        return s.clock.get(op[0], -1) >= op[1]

    def start(self, args) -> None:
        """The caller's stream produced the inputs (one op on it)."""
        self.active = True
        op = self.run_op(self.main)
        for t in tree_leaves(args):
            if isinstance(t, torch.Tensor):
                k = self.key(t)
                self.writer[k], self.readers[k], self.alloc[k] = op, [], self.main

    def finish(self, out) -> None:
        if self.current is not self.main:
            self.errors.append(f"the program leaves {self.current} current, not the caller's")
        for s in self.streams:
            if s.count and not self.knows(self.main, (s, s.count - 1)):
                self.errors.append(f"the caller's stream does not wait for {s}'s last op")
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                k = self.key(t)
                if self.alloc.get(k, self.main) is not self.main:
                    self.used.add((k, self.main))
        for k, s in self.used - self.recorded:
            if self.alloc.get(k, s) is not s:
                self.errors.append(f"storage of {self.alloc[k]} used on {s}: no record_stream")
        self.active = False

    def allocate(self, s: FakeStream, name: str) -> None:
        """``s`` allocates: it may get any block its pool got back, so each use of a block
        freed unrecorded into that pool must be known to ``s`` by now."""
        for c, op in self.freed_unsafe.pop(s, []):
            if not self.knows(s, op):
                self.errors.append(
                    f"{name} on {s} may be given memory freed while {c} op {op[1]} still "
                    "used it (reused: no record_stream, no wait)"
                )

    def __torch_dispatch__(self, func, types_, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func.is_view or func is torch.ops.aten._unsafe_view.default:
            return out  # metadata only: no device access
        s, name = self.current, str(func)
        written = set()
        for arg, val in zip(func._schema.arguments, args, strict=False):
            if arg.alias_info is not None and arg.alias_info.is_write:
                written.update(self.key(t) for t in tree_leaves(val) if isinstance(t, torch.Tensor))
        reads = {self.key(t) for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        for k in reads:
            w = self.writer.get(k)
            if w is not None and not self.knows(s, w):
                self.errors.append(f"{name} on {s} reads data of {w[0]} op {w[1]} unsynchronised")
        for k in written:
            for r in self.readers.get(k, []):
                if r[0] is not s and not self.knows(s, r):
                    self.errors.append(f"{name} on {s} overwrites data {r[0]} op {r[1]} reads")
        fresh = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)
                 and self.key(t) not in reads and self.key(t) not in written]  # fmt: skip
        if fresh:
            self.allocate(s, name)
        op = self.run_op(s)
        self.kernels.append((name, s.name))
        for k in reads | written:
            self.last_use.setdefault(k, {})[s] = op
        for k in reads:
            self.used.add((k, s))
            self.readers.setdefault(k, []).append(op)
        for k in written:
            self.writer[k], self.readers[k] = op, []
        for t in fresh:  # a fresh allocation on s
            k = self.key(t)
            self.writer[k], self.readers[k], self.alloc[k] = op, [], s
            self.last_use[k] = {s: op}
        return out


def install(sim: StreamSim, monkeypatch) -> StreamSim:
    """``sim`` stands in for ``torch.cuda``'s streams and events (until the test ends)."""
    monkeypatch.setattr(rt, "_cuda_streams", {})
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: sim.current)
    monkeypatch.setattr(torch.cuda, "default_stream", lambda device=None: sim.default)
    monkeypatch.setattr(torch.cuda, "set_stream", sim.set_stream)
    monkeypatch.setattr(torch.cuda, "Stream", sim.new_stream)
    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    monkeypatch.setattr(torch.Tensor, "record_stream", lambda t, s: sim.record_stream(t, s))
    return sim


@pytest.fixture
def sim(monkeypatch):
    return install(StreamSim(), monkeypatch)


def simulate(sim: StreamSim, fn, args):
    """Run ``fn(*args)`` under ``sim`` (the caller holds ``args``: inputs outlive the call)."""
    sim.start(args)
    with sim:
        out = fn(*args)
    sim.finish(out)
    return out


def simulate_boxed(sim: StreamSim, prog, args: list):
    """Run ``prog`` as AOTAutograd calls a graph (``Boxed``: the list is emptied, so each
    input dies at its last use in the program, and the allocator may hand its memory out)."""
    sim.start(args)
    with sim:
        out = Boxed(prog)(args)
    assert args == []
    sim.finish(out)
    return out


def assert_close(a, b):
    """Close to float rounding: on CPU tensors the CUDA program runs the graph's own aten ops
    on the calling thread, only interleaved by stream, so a value read before its writer ran
    (a missing wait) is garbage, far outside this tolerance. Not bitwise: two code paths."""
    for x, y in zip(tree_leaves(a), tree_leaves(b), strict=True):
        if isinstance(x, torch.Tensor):
            torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-6, equal_nan=True)
        else:
            assert x == y


def clone_args(args):
    return [a.clone() if isinstance(a, torch.Tensor) else a for a in args]


# -- the simulator has teeth ----------------------------------------------------------------
def branches(x, w):
    a = (x @ w).tanh()
    b = (x @ w.t()).relu()
    c = x.sin() * 2
    return torch.cat([a, b, c]), a.sum()


ARGS = (torch.randn(8, 16), torch.randn(16, 16))


def test_simulator_accepts_the_program_and_catches_a_dropped_wait(sim, monkeypatch):
    gm = as_cuda(make_fx(branches)(*ARGS))
    plan = cuda_plan(gm, lambda i, n: 1 if n.name in {"t", "mm_1", "relu"} else 0, 2)
    prog = generate(gm, plan, TAG)
    assert_close(simulate(sim, prog.fn, list(ARGS)), gm(*ARGS))
    assert not sim.errors, sim.errors
    assert {s for _, s in sim.kernels} == {"caller", "side1"}  # really two streams

    # The same program without its one cross-stream wait: the simulator must object.
    broken = "\n".join(ln for ln in prog.source.splitlines() if ".wait_event(" not in ln)
    ns = dict(prog.fn.__globals__)
    exec(compile(broken, "broken", "exec"), ns)
    again = install(StreamSim(), monkeypatch)
    simulate(again, ns["forward"], list(ARGS))
    assert any("unsynchronised" in e for e in again.errors), again.errors

    # ... and a dropped record_stream.
    broken = "\n".join(ln for ln in prog.source.splitlines() if "record_stream(" not in ln)
    exec(compile(broken, "broken", "exec"), ns)
    again = install(StreamSim(), monkeypatch)
    simulate(again, ns["forward"], list(ARGS))
    assert any("no record_stream" in e for e in again.errors), again.errors


# -- correct by construction: random plans over real training graphs -----------------------
@pytest.mark.parametrize(
    "name", ["towers", "inplace_views", "dropout", "inception", "transformer", "lstm_cells"]
)
def test_training_graphs_on_cuda_plans_are_race_free(name, monkeypatch):
    fw, fw_args, bw, bw_args = train_graphs(name)
    for gm, args, tag in ((fw, fw_args, "g0.fw"), (bw, bw_args, "g0.bw")):
        for seed in range(3):
            r = random.Random(seed)
            streams = {n.name: r.randrange(3) for n in gm.graph.nodes}
            prog = generate(gm, cuda_plan(gm, lambda i, n, s=streams: s[n.name], 3, tag), tag)
            torch.manual_seed(1)
            want = gm(*clone_args(args))
            sim = install(StreamSim(), monkeypatch)
            torch.manual_seed(1)  # RNG ops run in graph order: the same draws
            got = simulate(sim, prog.fn, clone_args(args))
            assert not sim.errors, (name, tag, seed, sim.errors[:5])
            assert_close(got, want)
            assert len({s for _, s in sim.kernels}) >= 2


def inplace_on_views(x, w):
    y = x @ w
    v = y.t()  # a view written in place below
    v.mul_(2)
    z = y.relu()
    y.add_(1)
    parts = y.split(4)
    return z, parts[0].sum(), parts[1] * 3, y.sum()


def test_inplace_writes_through_views_are_ordered(monkeypatch):
    args = (torch.randn(8, 8), torch.randn(8, 8))
    gm = as_cuda(make_fx(inplace_on_views)(*args))
    for seed in range(6):
        r = random.Random(seed)
        streams = {n.name: r.randrange(3) for n in gm.graph.nodes}
        prog = generate(gm, cuda_plan(gm, lambda i, n, s=streams: s[n.name], 3), TAG)
        sim = install(StreamSim(), monkeypatch)
        got = simulate(sim, prog.fn, clone_args(args))
        assert not sim.errors, (seed, sim.errors)
        assert_close(got, gm(*clone_args(args)))


# -- waits and events only between kernels --------------------------------------------------
def test_no_wait_or_event_for_metadata_only_ops():
    _, _, bw, _ = train_graphs("towers")
    nodes = list(bw.graph.nodes)
    r = random.Random(0)
    streams = {n.name: r.randrange(4) for n in nodes}
    plan = cuda_plan(bw, lambda i, n: streams[n.name], 4, "g0.bw")
    prog = generate(bw, plan, "g0.bw")
    base, writes = buffer_analysis(nodes)
    meta = {n.name for n in nodes if is_metadata_only(n, base, writes)}
    targets = {n.target for n in nodes if n.name in meta}
    assert {torch.ops.aten.t.default, torch.ops.aten.view.default} <= targets
    lines = prog.source.splitlines()
    waited = [ln.split("# after ")[1].strip() for ln in lines if ".wait_event(" in ln]
    assert waited and not set(waited) & meta  # every wait is for a kernel's event
    for ln in lines:
        if ".record(s_" in ln:  # "<name> = <op>(...);  e_k = torch.cuda.Event(); e_k.record(s)"
            assert ln.strip().split(" = ", 1)[0] not in meta, ln
    # Fewer waits than the node-level schedule, which also waited on views and for them
    # (95 there, 39 here for this plan).
    sched = schedule(bw, plan, "g0.bw", True)
    node_level = sum(len(w) for w in sched.waits.values())
    assert len(waited) < node_level
    signals = device_waits(sched, plan, "g0.bw").signals
    assert prog.source.count("torch.cuda.Event()") == len(signals)


# -- record_stream --------------------------------------------------------------------------
def gather(x, idx):
    return x.index_select(0, idx) * 2, x.sum()


def test_record_stream_never_for_cpu_tensors():
    args = (torch.randn(6, 4), torch.tensor([0, 2]))
    gm = as_cuda(make_fx(gather)(*args), keep_cpu={"idx_1"})
    plan = cuda_plan(gm, lambda i, n: 1 if n.name == "index_select" else 0, 2)
    src = generate(gm, plan, TAG).source
    assert "x_1.record_stream(s_1)" in src  # a CUDA input used on stream 1
    assert "idx_1.record_stream" not in src and "record_streams(idx_1" not in src

    # A value whose device codegen cannot know is checked at run time instead.
    del gm.graph.find_nodes(op="placeholder")[0].meta["val"]
    src = generate(gm, plan, TAG).source
    assert "_rt.record_streams(x_1, s_1)" in src


def test_record_streams_skips_cpu_tensors_at_run_time(monkeypatch):
    calls = []
    monkeypatch.setattr(torch.Tensor, "record_stream", lambda t, s: calls.append(t))
    with FakeTensorMode():
        on_gpu = torch.empty(3, device="cuda")
    cpu = torch.ones(2)
    rt.record_streams([cpu, (on_gpu, cpu), 3], "s")
    assert len(calls) == 1 and calls[0] is on_gpu


def test_cuda_graph_option_is_a_clear_error():
    gm = as_cuda(make_fx(branches)(*ARGS))
    plan = cuda_plan(gm, lambda i, n: 0, 1)
    with pytest.raises(ValueError, match='mode="reduce-overhead"'):
        generate(gm, plan, TAG, cuda_graph=True)
    src = generate(gm, plan, TAG).source
    assert "CUDAGraph" not in src and "def _run(" not in src


# -- Inductor stream annotations ------------------------------------------------------------
def test_annotate_streams_marks_side_stream_nodes():
    gm = as_cuda(make_fx(branches)(*ARGS))
    side = {"t", "mm_1", "relu"}
    plan = cuda_plan(gm, lambda i, n: 1 if n.name in side else 0, 2)
    first = next(n for n in gm.graph.nodes if n.op == "call_function")  # mm, on stream 0
    first.meta["custom"] = {"stream": 7, "other": 1}  # a stale annotation goes
    annotate_streams(gm, plan, TAG, {1: 5})
    marked = {n.name: n.meta["custom"]["stream"] for n in gm.graph.nodes
              if "stream" in n.meta.get("custom", {})}  # fmt: skip
    assert marked == dict.fromkeys(side, 5)
    assert first.meta["custom"] == {"other": 1}
    assert gm.meta["autopar.stream_index"] == {1: 5}
    assert gm.meta["autopar.stream_syncs"] == [("relu", "cat")]  # kernels only, no "t"
    annotate_streams(gm, plan, TAG)  # default indices: side streams from 0
    assert {n.meta["custom"]["stream"] for n in gm.graph.nodes if n.name in side} == {0}


# -- Triton cells launch on their tensors' device -------------------------------------------
def test_triton_cells_launch_under_the_inputs_device(monkeypatch):
    pytest.importorskip("triton")
    from autopar.runtime.kernels import triton_cells as tc

    entered = []

    class Guard:
        def __init__(self, device):
            self.device = device

        def __enter__(self):
            entered.append(("enter", self.device))

        def __exit__(self, *exc):
            entered.append(("exit", self.device))

    monkeypatch.setattr(torch.cuda, "device", Guard)
    with FakeTensorMode():
        on1 = torch.empty(2, 3, device="cuda:1")
    with tc.launch_guard(on1):
        pass
    assert entered == [("enter", on1.device), ("exit", on1.device)]
    with tc.launch_guard(torch.ones(1)):  # CPU (the interpreter): no CUDA guard
        pass
    assert len(entered) == 2

    # The launch itself happens inside the guard of the state tensor's device.
    seen = []

    class Kernel:
        def __getitem__(self, grid):
            return lambda *a, **k: seen.append(list(entered))

    monkeypatch.setattr(tc, "launch_guard", lambda t: Guard(t.device))
    monkeypatch.setattr(tc, "_lstm_fwd_kernel", Kernel())
    entered.clear()
    tc.lstm_cell_forward(torch.randn(2, 12), torch.randn(2, 12), torch.randn(2, 3))
    assert seen == [[("enter", torch.device("cpu"))]]
    with pytest.raises(ValueError, match="several devices"):
        tc.gru_cell_forward(torch.randn(2, 9), torch.randn(2, 9), on1)


# -- cuDNN for nn.LSTM / nn.GRU on CUDA -----------------------------------------------------
def test_cuda_rnn_form_is_cudnn_without_running_anything():
    from autopar.rnn.choice import cuda_rnn_form

    assert cuda_rnn_form() == ("cudnn", 1)
    assert cuda_rnn_form("unrolled") == ("unrolled", 1)
    assert cuda_rnn_form("fused") == cuda_rnn_form("chunked") == ("cudnn", 1)
    assert cuda_rnn_form(timings={"cudnn": 1.0, "unrolled": 0.9}) == ("cudnn", 1)  # < margin
    assert cuda_rnn_form(timings={"cudnn": 1.0, "unrolled": 0.5}) == ("unrolled", 1)


def test_lstm_and_gru_on_cuda_run_the_module_forward(monkeypatch):
    from autopar.rnn import layers as rl

    with FakeTensorMode():
        x = torch.empty(5, 3, 4, device="cuda")
    assert rl.cudnn_form(x) and not rl.cudnn_form(torch.ones(5, 3, 4))
    monkeypatch.setattr(rl, "form_override", "unrolled")
    assert not rl.cudnn_form(x)
    monkeypatch.setattr(rl, "form_override", None)
    assert rl._cudnn_lstm._torchdynamo_disable  # eager cuDNN: never decomposed by a trace
    calls = []
    monkeypatch.setattr(rl, "_cudnn_lstm", lambda m, i, h: calls.append(("lstm", m, h)) or "L")
    monkeypatch.setattr(rl, "_cudnn_gru", lambda m, i, h: calls.append(("gru", m, h)) or "G")
    lstm, gru = torch.nn.LSTM(4, 8), torch.nn.GRU(4, 8)
    assert rl.lstm_module_forward(lstm, x) == "L" and rl.gru_module_forward(gru, x, None) == "G"
    assert calls == [("lstm", lstm, None), ("gru", gru, None)]


# -- the simulator's memory and caller-stream rules have teeth -----------------------------
def test_memory_freed_unrecorded_is_caught_when_its_pool_hands_it_out(monkeypatch):
    gm = as_cuda(make_fx(branches)(*ARGS))
    plan = cuda_plan(gm, lambda i, n: 1 if n.name in {"t", "mm_1", "relu"} else 0, 2)
    prog = generate(gm, plan, TAG)
    sim = install(StreamSim(), monkeypatch)
    simulate_boxed(sim, prog, clone_args(ARGS))
    assert not sim.errors, sim.errors
    assert sim.frees >= 2  # x_1 and w_1 die inside the program, at their last use

    # Without record_stream, w_1 (the caller's memory, read on stream 1 by mm_1 through
    # its view t) goes back to the caller's pool at `del t`, right after mm_1 is enqueued,
    # and the caller's next allocation (sin) may get it while mm_1 may still read it.
    broken = "\n".join(ln for ln in prog.source.splitlines() if "record_stream(" not in ln)
    ns = dict(prog.fn.__globals__)
    exec(compile(broken, "broken", "exec"), ns)
    prog.boxed = ns["forward_boxed"]
    again = install(StreamSim(), monkeypatch)
    simulate_boxed(again, prog, clone_args(ARGS))
    reused = [e for e in again.errors if "reused" in e]
    assert reused and reused[0].startswith("aten.sin.default on <stream caller>"), reused
    assert "<stream side1> op 0" in reused[0]  # mm_1, stream 1's first kernel


def test_a_program_on_the_default_stream_fails_a_caller_on_its_own_stream(monkeypatch):
    gm = as_cuda(make_fx(branches)(*ARGS))
    plan = cuda_plan(gm, lambda i, n: 1 if n.name in {"t", "mm_1", "relu"} else 0, 2)
    prog = generate(gm, plan, TAG)
    broken = prog.source.replace("torch.cuda.current_stream(", "torch.cuda.default_stream(")
    assert broken != prog.source
    ns = dict(prog.fn.__globals__)
    exec(compile(broken, "broken", "exec"), ns)
    sim = install(StreamSim(), monkeypatch)
    simulate(sim, ns["forward"], clone_args(ARGS))
    assert any("unsynchronised" in e for e in sim.errors), sim.errors  # inputs not waited
    assert any("leaves <stream default> current" in e for e in sim.errors), sim.errors


# -- every zoo model's CUDA program, as autopar captures and plans it ----------------------
def cuda_store():
    """A profile store holding a CUDA calibration: the planner's machine for ``cuda:0``
    without a GPU to measure."""
    from autopar.planning.costmodel import MachineModel, calibration_name
    from autopar.profiling.store import ProfileStore

    store = ProfileStore.memory()
    values = MachineModel(device="cuda:0", sync_cost_s=5e-6, dispatch_s=5e-6).to_dict()
    values.pop("source")
    store.put_calibration(calibration_name("cuda:0"), values)
    return store


def captured(name: str, monkeypatch) -> list:
    """``(record, args)`` of every graph autopar captures in one training step of zoo model
    ``name`` on the CPU (the rewrite of RNN layers, graph breaks and AOTAutograd's split
    included), each with its profile (``record.unit.table``) and a copy of its inputs."""
    from autopar.api import CompiledModule, CompileOptions
    from autopar.pipeline import Pipeline
    from autopar.profiling.store import ProfileStore

    got = []
    prepare = Pipeline.prepare

    def spy(self, record, args):
        got.append((record, clone_args(args)))
        return prepare(self, record, args)

    monkeypatch.setattr(Pipeline, "prepare", spy)
    model, inputs = zoo.build(name)
    options = CompileOptions(executors=("plan",), native=False, adapt=False, warmup=1,
                             repeats=1, store=ProfileStore.memory())  # fmt: skip
    torch.manual_seed(0)
    CompiledModule(model, options)(*inputs).sum().backward()
    monkeypatch.setattr(Pipeline, "prepare", prepare)
    return got


def scratch_outputs(gm) -> set[int]:
    """Positions of ``gm``'s outputs that are oneDNN RNN workspaces (result 3 of
    ``mkldnn_rnn_layer``): scratch the kernel leaves partly uninitialised, so its bytes
    differ from run to run; only the backward's oneDNN kernel reads them."""
    (out,) = gm.graph.find_nodes(op="output")
    return {
        i for i, n in enumerate(tree_leaves(out.args[0]))
        if isinstance(n, torch.fx.Node) and n.target is operator.getitem and n.args[1] == 3
        and "mkldnn_rnn_layer" in str(n.args[0].target)
    }  # fmt: skip


@pytest.mark.parametrize("name", sorted(zoo.MODELS))
def test_every_zoo_models_cuda_program_is_race_free(name, monkeypatch):
    """Each graph's profile, relabelled ``cuda:0``, planned by the planner on three CUDA
    streams (round_robin: most edges cross streams), generated, and run as AOTAutograd
    runs it (boxed: inputs die at their last use) under the simulator, the caller on a
    stream of its own: no unsynchronised access, no memory reused early, the graph's
    results bit for bit."""
    from autopar.planning import partition

    monkeypatch.setattr(partition, "_MACHINE_CACHE", {})  # the fake CUDA machine stays here
    store = cuda_store()
    graphs = captured(name, monkeypatch)
    assert graphs and {r.tag.rsplit(".", 1)[1] for r, _ in graphs} >= {"fw", "bw"}
    for record, args in graphs:
        gm = as_cuda(record.gm)
        table = record.unit.table.copy()
        table["device"] = table["device"].replace({"cpu": "cuda:0"})
        plan = partition.make_plan(table, streams=3, policy="round_robin", store=store,
                                   graph_id=record.tag)  # fmt: skip
        assert {s.device for s in plan.streams} == {"cuda:0"}
        prog = generate(gm, plan, record.tag)
        assert prog.boxed is not None and "torch.cuda.set_stream" in prog.source
        torch.manual_seed(1)
        want = gm(*clone_args(args))
        sim = install(StreamSim(), monkeypatch)
        torch.manual_seed(1)  # RNG ops run in graph order: the same draws
        got = simulate_boxed(sim, prog, clone_args(args))
        assert not sim.errors, (record.tag, sim.errors[:5])
        keep = [i not in scratch_outputs(gm) for i in range(len(tree_leaves(want)))]
        assert_close(*([x for x, k in zip(tree_leaves(out), keep, strict=True) if k]
                       for out in (got, want)))  # fmt: skip
        assert len({s for _, s in sim.kernels}) >= 2, record.tag
