"""The profiler: exact real run, FLOPs, bytes/views/edges, dedup, store reuse, RNG, in-place."""

from __future__ import annotations

import copy
import importlib
import math
import re
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch.fx.experimental.proxy_tensor import make_fx
from torch.utils._pytree import tree_leaves

from autopar.errors import StoreWarning
from autopar.profiling.profiler import COLUMNS, profile_graph, profile_table_summary
from autopar.profiling.signature import signature
from autopar.profiling.store import ProfileStore

prof = importlib.import_module("autopar.profiling.profiler")
timing = importlib.import_module("autopar.profiling.timing")
FAST = {"warmup": 1, "repeats": 1}  # timing quality is not what these tests check


@pytest.fixture(autouse=True)
def quiet_machine(monkeypatch):
    """Every sample counts as undisturbed and no spread is too large: these tests check what
    the profiler does with measurements, and the shared test machine is rarely idle (a
    provisional entry would be measured again, which some tests count). The contention rules
    themselves are tested in tests/test_timing.py with fake samples."""
    monkeypatch.setattr(timing, "_is_disturbed", lambda *_: False)
    monkeypatch.setattr(timing, "SPREAD_LIMIT", math.inf)


def _same(a, b) -> bool:
    la, lb = tree_leaves(a), tree_leaves(b)
    return len(la) == len(lb) and all(
        torch.equal(x, y) if isinstance(x, torch.Tensor) else x == y
        for x, y in zip(la, lb, strict=True)
    )


def _ops(df, target):
    return df[df.target == target]


def test_columns_match_the_documented_table():
    doc = (Path(__file__).parents[1] / "docs" / "architecture.md").read_text()
    section = doc.split("## The profile table", 1)[1].split("Timing:", 1)[0]
    documented = re.findall(r"^\| `(\w+)` \|", section, flags=re.M)
    assert documented == COLUMNS


def test_linear_flops_exact_and_table_shape():
    B, n_in, n_out = 8, 16, 4
    x, w, b = torch.randn(B, n_in), torch.randn(n_out, n_in), torch.randn(n_out)
    gm = make_fx(F.linear)(x, w, b)
    out, df = profile_graph(gm, [x, w, b], **FAST)
    assert torch.equal(out, gm(x, w, b))
    assert list(df.columns) == COLUMNS and len(df) == len(gm.graph.nodes)
    addmm = _ops(df, "aten.addmm.default").iloc[0]
    assert addmm.flops == 2 * B * n_in * n_out == df.flops.sum()
    assert addmm.bytes_read == 4 * (B * n_in + n_in * n_out + n_out)
    assert addmm.bytes_written == addmm.output_bytes == 4 * B * n_out
    assert not addmm.is_view and addmm["shape"] == "[8, 4]" and addmm["dtype"] == "float32"
    assert addmm.time_s > 0 and addmm.time_1t_s > 0 and addmm.key == "g0.fw/addmm"
    t = _ops(df, "aten.t.default").iloc[0]  # a view: reads, writes nothing new
    assert t.is_view and t.bytes_written == 0 and t.output_bytes == 4 * n_in * n_out
    fixed = df[df.op.isin(["placeholder", "output"])]
    assert (fixed.time_s == 0).all() and (fixed.flops == 0).all() and (fixed.signature == "").all()
    for node in gm.graph.nodes:  # the row is also on the node
        assert node.meta["autopar.profile"]["node"] == node.name


def test_edges_are_consistent():
    gm = make_fx(lambda x, w: (torch.relu(x @ w) + x @ w).sum())(torch.randn(4, 4), torch.eye(4))
    _, df = profile_graph(gm, [torch.randn(4, 4), torch.eye(4)], **FAST)
    rows = df.set_index("node")
    for name, row in rows.iterrows():
        assert len(row.inputs) == len(row.input_bytes)
        for producer, nbytes in zip(row.inputs, row.input_bytes, strict=True):
            assert name in rows.loc[producer, "users"]
            assert nbytes == rows.loc[producer, "output_bytes"]
    assert rows.loc["output", "inputs"] == ["sum_1"]


def test_repeated_signatures_are_measured_once(monkeypatch):
    calls = []
    real = prof.measure_op
    monkeypatch.setattr(prof, "measure_op", lambda *a, **k: calls.append(1) or real(*a, **k))

    def chain(x, w):
        for _ in range(32):
            x = torch.mm(x, w)
        return x

    x, w = torch.randn(8, 8), torch.eye(8)
    gm = make_fx(chain)(x, w)
    out, df = profile_graph(gm, [x, w], **FAST)
    assert torch.equal(out, gm(x, w))
    mm = _ops(df, "aten.mm.default")
    assert len(mm) == 32 and mm.signature.nunique() == 1
    assert mm.cached.tolist() == [False] + [True] * 31
    assert mm.time_s.nunique() == 1  # the one measurement is reused
    assert df.attrs["measured"] == 1
    assert len(calls) == 1  # one record: both thread settings


def test_store_round_trip_second_run_measures_nothing(tmp_path):
    x, w = torch.randn(6, 5), torch.randn(5, 3)
    gm = make_fx(lambda x, w: torch.tanh(x @ w).sum(0))(x, w)
    _, first = profile_graph(gm, [x, w], store=ProfileStore(tmp_path), **FAST)
    assert first.attrs["measured"] > 0 and len(list(tmp_path.glob("*.json"))) == 1
    store = ProfileStore(tmp_path)  # a new process would load it like this
    out, second = profile_graph(gm, [x, w], store=store, **FAST)
    assert torch.equal(out, gm(x, w))
    assert second.attrs["measured"] == 0
    comp = second.op == "call_function"
    assert second[comp].cached.all() and not first[comp].cached.any()
    assert second.time_s.tolist() == first.time_s.tolist()
    assert second.flops.tolist() == first.flops.tolist()


def test_corrupted_store_is_remeasured_without_crash(tmp_path):
    x = torch.randn(4, 4)
    gm = make_fx(lambda x: torch.sigmoid(x) * 2)(x)
    path = tmp_path / "p.json"
    path.write_text('{"format": "autopar-profile", "version": 2, "ops": {"tru')
    with pytest.warns(StoreWarning) as caught:
        out, df = profile_graph(gm, [x], store=ProfileStore(path), **FAST)
    assert len(caught) == 1 and "p.json" in str(caught[0].message)
    assert torch.equal(out, gm(x)) and df.attrs["measured"] == 2
    assert len(list(tmp_path.glob("p.json.corrupt*"))) == 1  # kept under a unique backup name
    assert len(ProfileStore(path)) == 2  # the fresh file is valid


@pytest.mark.parametrize(
    "fn",
    [
        lambda x: F.dropout(x, 0.5, training=True) * 3,
        lambda x: torch.ops.aten.native_dropout.default(x, 0.3, True),
        lambda x: x + torch.rand(x.shape) + torch.randn_like(x).bernoulli_(0.5),
    ],
    ids=["dropout", "native_dropout", "rand_bernoulli"],
)
def test_random_ops_draw_what_eager_draws(fn):
    x = torch.randn(64, 32)
    gm = make_fx(fn)(x)
    torch.manual_seed(1234)
    out, df = profile_graph(gm, [x], **FAST)
    after_profile = torch.rand(8)
    torch.manual_seed(1234)
    ref = gm(x)
    after_eager = torch.rand(8)
    torch.manual_seed(1234)
    assert _same(out, ref) and _same(fn(x), ref)  # and the graph is the eager function
    assert torch.equal(after_profile, after_eager)  # the stream continues where eager's does
    assert df.attrs["measured"] > 0


def test_random_op_with_explicit_generator():
    gen_a, gen_b = torch.Generator().manual_seed(7), torch.Generator().manual_seed(7)
    x = torch.randn(32)
    gm = torch.fx.symbolic_trace(lambda x, g: torch.bernoulli(torch.sigmoid(x), generator=g))
    out, _ = profile_graph(gm, [x, gen_a], **FAST)
    assert torch.equal(out, gm(x, gen_b))
    assert torch.equal(torch.rand(4, generator=gen_a), torch.rand(4, generator=gen_b))


@pytest.mark.parametrize("mutation", ["copy_", "add_"])
def test_inplace_into_input_applied_once(mutation):
    def fn(buf, y):
        if mutation == "copy_":
            buf.copy_(y * 2)
        else:
            buf.add_(y)  # applied twice would be visible, unlike copy_
        return buf.sum() + y

    y = torch.randn(5)
    gm = make_fx(fn)(torch.zeros(5), y)
    assert any(str(n.target).startswith(f"aten.{mutation}") for n in gm.graph.nodes)
    buf_p, buf_e = torch.ones(5), torch.ones(5)
    out, df = profile_graph(gm, [buf_p, y], **FAST)
    ref = gm(buf_e, y)
    assert torch.equal(out, ref) and torch.equal(buf_p, buf_e)
    row = df[df.target.str.startswith(f"aten.{mutation}")].iloc[0]
    assert row.is_view and row.bytes_written == 20  # in place: aliases and writes its input


def test_inplace_method_without_schema_applied_once():
    gm = torch.fx.symbolic_trace(lambda buf, y: buf.mul_(2).add_(y).sum())
    assert [n.op for n in gm.graph.nodes].count("call_method") == 3
    y = torch.randn(5)
    buf_p, buf_e = torch.ones(5), torch.ones(5)
    out, df = profile_graph(gm, [buf_p, y], **FAST)
    assert torch.equal(out, gm(buf_e, y)) and torch.equal(buf_p, buf_e)
    assert df[df.target == "mul_"].iloc[0].is_view


def test_backward_graph_from_autograd_grad():
    def train_step(x, w1, w2):
        loss = (torch.tanh(x @ w1) @ w2).pow(2).mean()
        return torch.autograd.grad(loss, [w1, w2])

    x = torch.randn(16, 8)
    w1, w2 = torch.randn(8, 12, requires_grad=True), torch.randn(12, 4, requires_grad=True)
    gm = make_fx(train_step)(x, w1, w2)
    out, df = profile_graph(gm, [x, w1, w2], tag="g0.bw", phase="backward", **FAST)
    assert _same(out, gm(x, w1, w2)) and _same(out, train_step(x, w1, w2))
    assert (df.phase == "backward").all() and df.key.str.startswith("g0.bw/").all()
    mm = _ops(df, "aten.mm.default")
    assert len(mm) >= 4 and (mm.flops > 0).all()  # forward matmuls and their gradients


def test_module_and_method_nodes_keep_eager_semantics():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 6), torch.nn.BatchNorm1d(6)).train()
    twin = copy.deepcopy(model)
    gm = torch.fx.symbolic_trace(model)
    x = torch.randn(10, 6)
    out, df = profile_graph(gm, [x], **FAST)
    assert torch.equal(out, twin(x))
    # BatchNorm updated its running statistics once, as eager did
    assert torch.equal(model[1].running_mean, twin[1].running_mean)
    assert int(model[1].num_batches_tracked) == 1
    assert (df[df.op == "call_module"].time_s > 0).all()


def test_thread_settings(monkeypatch):
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        x = torch.randn(32, 32)
        gm = make_fx(lambda x: x @ x)(x)
        _, df = profile_graph(gm, [x], **FAST)
        mm = _ops(df, "aten.mm.default").iloc[0]
        assert mm.threads == 2 and math.isfinite(mm.time_1t_s) and mm.time_1t_s > 0
        assert torch.get_num_threads() == 2  # restored after the 1-thread timing
        _, df = profile_graph(gm, [x], measure_single_thread=False, **FAST)
        assert math.isnan(_ops(df, "aten.mm.default").iloc[0].time_1t_s)
        torch.set_num_threads(1)
        _, df = profile_graph(gm, [x], **FAST)
        mm = _ops(df, "aten.mm.default").iloc[0]
        assert mm.threads == 1 and mm.time_1t_s == mm.time_s
    finally:
        torch.set_num_threads(before)


def test_timing_failure_falls_back_without_breaking_the_run(monkeypatch):
    def broken(*a, **k):
        raise RuntimeError("timer exploded")

    monkeypatch.setattr(prof, "measure_op", broken)
    store = ProfileStore.memory()
    x = torch.randn(4, 4)
    gm = make_fx(lambda x: torch.exp(x) + 1)(x)
    with pytest.warns(RuntimeWarning, match="timer exploded"):
        out, df = profile_graph(gm, [x], store=store, **FAST)
    assert torch.equal(out, gm(x)) and len(store) == 0  # failed timings are not persisted
    assert len(df.attrs["errors"]) == 2 and (df.time_s >= 0).all()


def test_signature_depends_on_what_changes_cost():
    a = torch.ones(2, 3)
    base = signature("aten.relu.default", (a,), {}, 2)
    assert len(base) == 16 and base == signature("aten.relu.default", (torch.zeros(2, 3),), {}, 2)
    assert base != signature("aten.relu.default", (a,), {}, 1)
    assert base != signature("aten.relu.default", (torch.ones(3, 2),), {}, 2)
    assert base != signature("aten.relu.default", (a.double(),), {}, 2)
    assert base != signature("aten.relu.default", (torch.ones(3, 2).t(),), {}, 2)  # strides
    assert base != signature("aten.gelu.default", (a,), {}, 2)


def test_summary_and_argument_errors():
    x = torch.randn(16, 16)
    gm = make_fx(lambda x: torch.relu(x @ x) @ x)(x)
    _, df = profile_graph(gm, [x], **FAST)
    text = profile_table_summary(df, top=3)
    assert "top 3 operators by time" in text and "aten.mm.default" in text
    assert "by FLOPs" in text and "g0.fw/mm" in text
    with pytest.raises(TypeError, match="GraphModule"):
        profile_graph(lambda x: x, [x])
    with pytest.raises(ValueError, match="repeats"):
        profile_graph(gm, [x], repeats=0)


def test_first_call_profile_sees_no_aot_dispatch_mode(monkeypatch):
    """AOTAutograd runs a graph's first call under a Python dispatch mode (a custom-op
    aliasing check) that adds ~20 us to every operator: the profile and the first-call
    measurements run outside it (``capture.backend.without_aot_first_call_check``)."""
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

    import autopar

    seen = []
    real = prof.measure_op

    def spy(call, cuda, **kw):
        seen.append(len(_get_current_dispatch_mode_stack()))
        return real(call, cuda, **kw)

    monkeypatch.setattr(prof, "measure_op", spy)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    cmodel = autopar.compile(model, store=ProfileStore.memory(), race=False)
    cmodel(torch.randn(4, 8)).sum().backward()
    assert seen and set(seen) == {0}
    assert len(_get_current_dispatch_mode_stack()) == 0  # nothing left pushed or popped
