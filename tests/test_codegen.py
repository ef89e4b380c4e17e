"""Codegen: generated programs equal eager within the fp64 oracle for hand-made plans of 1, 2
and 4 streams, and equal themselves bitwise run after run."""

from __future__ import annotations

import random
import re
import traceback

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as hs
from oracle import assert_close_to_oracle, max_err
from torch.fx.experimental.proxy_tensor import make_fx
from torch.utils._pytree import tree_flatten

from autopar.capture.analysis import is_rng
from autopar.codegen.emitters import generate
from autopar.errors import PlanError
from autopar.planning.plan import Plan, Stream, Sync, node_key
from autopar.runtime.streams import intra_op_threads

TAG = "g0.fw"


def make_plan(gm, assign, n_streams, *, tag=TAG, order=None, device="cpu", threads=1):
    """A Plan placing node ``n`` on ``assign(i, n)`` with a sync for every cross-stream edge."""
    nodes = list(gm.graph.nodes)
    place = {node_key(tag, n.name): assign(i, n) % n_streams for i, n in enumerate(nodes)}
    syncs = []
    for n in nodes:
        for u in n.users:
            a, b = place[node_key(tag, n.name)], place[node_key(tag, u.name)]
            if a != b:
                syncs.append(Sync(node_key(tag, n.name), node_key(tag, u.name), a, b))
    order = order or [node_key(tag, n.name) for n in nodes]
    streams = tuple(Stream(i, device, threads) for i in range(n_streams))
    return Plan(tag, "hand", streams, tuple(sorted(place.items())), tuple(order), tuple(syncs))


def assert_same(a, b):
    """Bitwise equal: only for the SAME program run twice (a fixed thread count per stream),
    never for two code paths (see :func:`assert_like_eager`)."""
    if isinstance(a, torch.Tensor):
        assert torch.equal(a, b)
    else:
        assert type(a) is type(b) and len(a) == len(b)
        for x, y in zip(a, b, strict=True):
            assert_same(x, y)


def eager_results(fn, args, seed=None):
    """What a program's results are judged by (:func:`assert_like_eager`): ``fn(*args)``
    eagerly at the caller's intra-op thread count and at one thread (a stream's), and in
    float64 on the same inputs. ``seed`` is set before each run (the same dropout masks);
    each run gets fresh copies of the inputs (``fn`` may write into one)."""

    def run(f64=False):
        xs = [a.clone() if isinstance(a, torch.Tensor) else a for a in args]
        xs = [a.double() if f64 and _is_float(a) else a for a in xs]
        if seed is not None:
            torch.manual_seed(seed)
        return fn(*xs)

    many = run()
    with intra_op_threads(1):
        one = run()
    return many, one, run(f64=True)


def assert_like_eager(tag, got, want):
    """``got`` equals eager within the fp64 oracle: each float result is no further from the
    float64 reference than twice the farther of the two eager runs (``want``, from
    :func:`eager_results`). Not bitwise: the streams run one intra-op thread and eager may
    run more, so reductions and GEMMs round differently (and differently per CPU). Integer
    and bool results (dropout masks) are exact."""
    (leaves, spec), (many, want_spec) = tree_flatten(got), tree_flatten(want[0])
    assert spec == want_spec, f"{tag}: {spec} != {want_spec}"
    one, ref = tree_flatten(want[1])[0], tree_flatten(want[2])[0]
    for i, (g, a, b, f) in enumerate(zip(leaves, many, one, ref, strict=True)):
        if not _is_float(a):
            assert torch.equal(g, a) if isinstance(g, torch.Tensor) else g == a, f"{tag} {i}"
            continue
        assert g.shape == a.shape and g.dtype == a.dtype, (tag, i, g.shape, a.shape)
        worse = a if max_err(a, f) >= max_err(b, f) else b  # both are valid eager runs
        assert_close_to_oracle(f"{tag} output {i}", g, worse, f)


def _is_float(v) -> bool:
    return isinstance(v, torch.Tensor) and v.is_floating_point()


def branches(x, w):
    a = (x @ w).tanh()
    b = (x @ w.t()).relu()
    c = x.sin() * 2
    d = torch.sigmoid(x + 1).exp()
    return torch.cat([a, b, c, d]), a.sum()


def backward_like(x, w1, w2):
    x = x.detach().requires_grad_()
    h = torch.tanh(x @ w1)
    y = (h @ w2).sigmoid().sum() + h.pow(2).sum()
    return torch.autograd.grad(y, [x])


ARGS = (torch.randn(8, 16), torch.randn(16, 16))
BW_ARGS = (torch.randn(8, 16), torch.randn(16, 16), torch.randn(16, 16))


def test_serial_plan_is_straight_line_code():
    gm = make_fx(branches)(*ARGS)
    prog = generate(gm, make_plan(gm, lambda i, n: 0, 1), TAG)
    assert "threading" not in prog.source and "run_streams" not in prog.source
    # the only runtime call: the plan's intra-op thread count around the straight-line body
    assert [ln.strip() for ln in prog.source.splitlines() if "_rt." in ln] == [
        "with _rt.intra_op_threads(1):"
    ]
    body = prog.source.split("def forward", 1)[1]
    assert re.findall(r"aten\.[\w.]+", body) == re.findall(r"aten\.[\w.]+", gm.code)
    assert_like_eager("serial", prog.fn(*ARGS), eager_results(gm, ARGS))
    assert "# plan hash:" in prog.source and torch.__version__ in prog.source


@pytest.mark.parametrize("n_streams", [1, 2, 4])
@pytest.mark.parametrize("fn,args", [(branches, ARGS), (backward_like, BW_ARGS)])
def test_streams_match_eager(fn, args, n_streams):
    gm = make_fx(fn)(*args)
    want = eager_results(gm, args)
    for assign in (lambda i, n: i, lambda i, n: hash(n.name) // 7):
        prog = generate(gm, make_plan(gm, assign, n_streams), TAG)
        first = prog.fn(*args)
        assert_like_eager(f"{n_streams} streams", first, want)
        for _ in range(2):  # reused pool: the same program, bit-identical every time
            assert_same(prog.fn(*args), first)


def test_four_branches_one_per_stream_waits_only_on_data():
    gm = make_fx(branches)(*ARGS)
    branch_of = {"mm": 0, "tanh": 0, "sum_1": 0, "t": 1, "mm_1": 1, "relu": 1}
    branch_of.update({"sin": 2, "mul": 2, "add": 3, "sigmoid": 3, "exp": 3})
    plan = make_plan(gm, lambda i, n: branch_of.get(n.name, 0), 4)
    prog = generate(gm, plan, TAG)
    assert_like_eager("four branches", prog.fn(*ARGS), eager_results(gm, ARGS))
    # stream 0 waits once per other branch (before cat); workers never wait
    assert prog.source.count("w(") == 3
    for sid in (1, 2, 3):
        fn_src = prog.source.split(f"def _stream_{sid}(st)")[1].split("\ndef ")[0]
        assert "w(" not in fn_src


def write_then_dropout(x, buf):
    """An in-place write into an input between its readers, then two random draws: the
    effect rules' example for every emitter's tests (test_native)."""
    s = buf.sum()
    buf.copy_(x * 2)
    a = torch.nn.functional.dropout(x.sin(), 0.5, True)
    b = torch.nn.functional.dropout(x.cos(), 0.3, True)
    return buf * 3 + s, a + b


def test_inplace_copy_into_input_keeps_eager_order():
    def f(x, buf):
        s = buf.sum()
        buf.copy_(x * 2)
        return buf * 3 + s, x.cos()

    gm = make_fx(f)(torch.randn(4), torch.randn(4))
    names = [n.name for n in gm.graph.nodes]
    # reader of the old value (sum_1) and the writer (copy_) on different streams
    plan = make_plan(gm, lambda i, n: 1 if n.name in ("sum_1", "cos") else 0, 2)
    assert not any(s.src.endswith("/sum_1") and s.dst.endswith("/copy_") for s in plan.syncs)
    prog = generate(gm, plan, TAG)
    x, buf = torch.randn(4), torch.randn(4)
    b1 = buf.clone()
    assert_like_eager("in place", prog.fn(x, b1), eager_results(f, [x, buf]))
    # the buffer holds the write, made once (what eager leaves: x * 2)
    assert_close_to_oracle("buffer", b1, x * 2, x.double() * 2)
    # a plan running the write before the earlier read is rejected
    order = [node_key(TAG, n) for n in names]
    order.remove(node_key(TAG, "sum_1"))
    order.insert(order.index(node_key(TAG, "copy_")) + 1, node_key(TAG, "sum_1"))
    with pytest.raises(PlanError, match="in place"):
        generate(gm, make_plan(gm, lambda i, n: 0, 2, order=order), TAG)


def test_dropout_on_worker_is_moved_to_stream_0_and_matches_eager():
    def f(x):
        a = torch.nn.functional.dropout(x.sin(), 0.5, True)
        b = torch.nn.functional.dropout(x.cos(), 0.3, True)
        return a + b

    x = torch.randn(64)
    gm = make_fx(f)(x)
    rng = [n.name for n in gm.graph.nodes if is_rng(n)]
    assert rng  # bernoulli_ or native_dropout
    prog = generate(gm, make_plan(gm, lambda i, n: 0 if n.name == "sin" else 1, 2), TAG)
    assert prog.notes and all("moved" in s for s in prog.notes)
    torch.manual_seed(0)
    got = prog.fn(x)
    # the same seed, the same masks: a mask drawn out of order would be far off the oracle
    assert_like_eager("dropout", got, eager_results(f, [x], seed=0))


def test_rng_reordered_is_rejected():
    def f(x):
        return torch.rand_like(x) + torch.randn_like(x)

    gm = make_fx(f)(torch.randn(3))
    order = [node_key(TAG, n.name) for n in gm.graph.nodes]
    i, j = (k for k, n in enumerate(gm.graph.nodes) if is_rng(n))
    order[i], order[j] = order[j], order[i]
    with pytest.raises(PlanError, match="random ops"):
        generate(gm, make_plan(gm, lambda i, n: 0, 1, order=order), TAG)


def test_bad_plans_raise_clear_errors():
    gm = make_fx(branches)(*ARGS)
    with pytest.raises(PlanError, match="places no stream"):
        generate(gm, make_plan(gm, lambda i, n: 0, 1, tag="g1.bw"), TAG)
    order = [node_key(TAG, n.name) for n in gm.graph.nodes][::-1]
    with pytest.raises(PlanError, match="topological"):
        generate(gm, make_plan(gm, lambda i, n: 0, 1, order=order), TAG)
    with pytest.raises(ValueError, match="emitter must be one of"):
        generate(gm, make_plan(gm, lambda i, n: 0, 1), TAG, emitter="nope")


def test_save_and_traceback_show_generated_lines(tmp_path):
    gm = make_fx(branches)(*ARGS)
    prog = generate(gm, make_plan(gm, lambda i, n: 0, 1), TAG, provenance={"store": "p.json"})
    text = open(prog.save(str(tmp_path / "prog.py"))).read()
    assert text == prog.source and "profile store:  p.json" in text
    with pytest.raises(RuntimeError) as info:
        prog.fn(torch.randn(8, 5), ARGS[1])  # wrong shape: mm fails
    tb = "".join(traceback.format_exception(info.value))
    assert "mm = aten.mm.default(x_1, w_1)" in tb


def test_other_graphs_nodes_in_plan_are_ignored():
    gm = make_fx(branches)(*ARGS)
    plan = make_plan(gm, lambda i, n: i, 2)
    extra = plan.placements + (("g0.bw/mm", 1),)
    plan = plan.replace(placements=tuple(sorted(extra)), order=plan.order + ("g0.bw/mm",))
    assert_like_eager("other graphs", generate(gm, plan, TAG).fn(*ARGS), eager_results(gm, ARGS))


# -- random DAGs ------------------------------------------------------------------------------
_UNARY = [torch.sin, torch.tanh, torch.relu, lambda t: t * 1.5, lambda t: t.exp().clamp(max=5)]
_BINARY = [torch.add, torch.mul, torch.maximum, lambda a, b: a - b * 0.5]


def random_dag(seed: int, n_ops: int):
    r = random.Random(seed)
    spec = []
    for k in range(n_ops):
        if r.random() < 0.5:
            spec.append((0, r.randrange(len(_UNARY)), r.randrange(k + 2), 0))
        else:
            spec.append((1, r.randrange(len(_BINARY)), r.randrange(k + 2), r.randrange(k + 2)))

    def f(x, y):
        vals = [x, y]
        for kind, op, i, j in spec:
            vals.append(_UNARY[op](vals[i]) if kind == 0 else _BINARY[op](vals[i], vals[j]))
        return tuple(vals[2:][-3:]) + (vals[-1].sum(),)

    return f


def random_topo_order(gm, r):
    nodes = list(gm.graph.nodes)
    indeg = {n: len(n.all_input_nodes) for n in nodes}
    ready = [n for n in nodes if indeg[n] == 0]
    out = []
    while ready:
        n = ready.pop(r.randrange(len(ready)))
        out.append(node_key(TAG, n.name))
        for u in n.users:
            indeg[u] -= 1
            if indeg[u] == 0:
                ready.append(u)
    return out


def random_case(seed: int, n_ops: int, n_streams: int):
    """``(gm, args, plan)``: a random DAG of ``n_ops`` ops, traced, and a random plan for it
    (random streams, a random topological order): the property tests of every emitter."""
    args = (torch.randn(5, 6), torch.randn(5, 6))
    gm = make_fx(random_dag(seed, n_ops))(*args)
    r = random.Random(seed)
    streams = {n.name: r.randrange(n_streams) for n in gm.graph.nodes}
    order = random_topo_order(gm, r)
    return gm, args, make_plan(gm, lambda i, n: streams[n.name], n_streams, order=order)


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=hs.integers(0, 10_000), n_ops=hs.integers(1, 14), n_streams=hs.sampled_from([1, 2, 4]))
def test_random_dags_random_plans_match_eager(seed, n_ops, n_streams):
    gm, args, plan = random_case(seed, n_ops, n_streams)
    prog = generate(gm, plan, TAG)
    assert_like_eager(f"seed {seed}", prog.fn(*args), eager_results(gm, args))


# -- CUDA (structural: no GPU here) ----------------------------------------------------------
def test_cuda_source_structure():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():  # traced values on cuda:0 (no GPU needed): record_stream is emitted
        fake = [torch.empty(a.shape, device="cuda") for a in ARGS]
    gm = make_fx(branches, tracing_mode="fake")(*fake)
    on_one = {"t", "mm_1", "relu"}  # branch b on stream 1
    plan = make_plan(gm, lambda i, n: 1 if n.name in on_one else 0, 2, device="cuda:0", threads=0)
    prog = generate(gm, plan, TAG)
    src = prog.source
    compile(src, "cuda_prog", "exec")
    lines = [ln.strip() for ln in src.splitlines()]

    def at(prefix):
        return next(i for i, ln in enumerate(lines) if ln.startswith(prefix))

    assert "threading" not in src and "run_streams" not in src
    assert at("s_1.wait_stream(s_0)") < at("torch.cuda.set_stream(s_1)")
    # w_1 reaches stream 1 through the view t (no kernel): recorded where mm_1 uses it
    assert "x_1.record_stream(s_1)" in src and "t.record_stream(s_1)" in src
    rec = at("relu = aten.relu.default")
    assert "e_0 = torch.cuda.Event();  e_0.record(s_1)" in lines[rec]
    wait = at("s_0.wait_event(e_0)")
    assert rec < wait < at("relu.record_stream(s_0)") < at("cat = aten.cat.default")
    assert at("s_0.wait_stream(s_1)") > at("cat = aten.cat.default")
    assert src.count("wait_event") == 1  # minimum synchronisation: one cross edge
    with pytest.raises(ValueError, match="reduce-overhead"):  # no unsound CUDA graph capture
        generate(gm, plan, TAG, cuda_graph=True)
