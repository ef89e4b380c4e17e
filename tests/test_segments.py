"""The segment executor (codegen/segments.py): every stream's segments compiled by Inductor's
C++ wrapper, one synchronisation per segment boundary. Judged by the fp64 oracle on zoo
forward and backward graphs; RNG and in-place writes keep eager's order.

Plans here are HEFT plans of the profile tables with the measured times dropped (the cost
model estimates them from FLOPs and bytes) on the default machine constants, so the
segments, and therefore Inductor's FX graph cache keys, are the same on every run: a cold
run compiles ~40 segments (a couple of seconds each), a warm one hits the cache.
"""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from captured import planned_zoo_records
from oracle import assert_close_to_oracle, max_err
from test_codegen import TAG, make_plan, random_dag, random_topo_order
from torch._dynamo.utils import counters
from torch.fx.experimental.proxy_tensor import make_fx

import autopar
from autopar.capture.analysis import example_args
from autopar.codegen.inductor import input_meta
from autopar.codegen.segments import (
    compile_segments,
    cut_segments,
    refine_for_segments,
    segment_makespan,
)
from autopar.codegen.warmup import warmup_error
from autopar.errors import PlanError
from autopar.planning.costmodel import MachineModel
from autopar.planning.partition import make_plan as plan_table
from autopar.runtime.segment_runner import (
    compile_segment_tier,
    segment_plan,
    start_segment_warmup,
)
from autopar.runtime.streams import intra_op_threads

ONE_THREAD_EACH = [autopar.Stream(0, "cpu", 1), autopar.Stream(1, "cpu", 1)]


def _deterministic_plan(record):
    table = record.table.copy()
    table["time_s"] = np.nan  # measured times vary run to run; estimates do not
    table["time_1t_s"] = np.nan
    return plan_table(table, streams=ONE_THREAD_EACH, policy="heft", graph_id=record.tag,
                      machine=MachineModel.default_cpu())  # fmt: skip


def _worse(a, b, ref):
    if ref is None:
        return None
    return a if max_err(a, ref) >= max_err(b, ref) else b


def _check_cut(cut, gm):
    """Every compute node in exactly one segment; dependencies point to earlier segments."""
    seg_of = {n: s for s in cut.segments for n in s.nodes}
    compute = [n for n in gm.graph.nodes if n.op not in ("placeholder", "get_attr", "output")]
    assert sorted(seg_of, key=str) == sorted(compute, key=str)
    assert sum(len(s.nodes) for s in cut.segments) == len(compute)
    for s in cut.segments:
        for n in s.nodes:
            for p in n.all_input_nodes:
                if p in seg_of:
                    assert seg_of[p].index <= s.index
                    if seg_of[p] is not s and seg_of[p].stream != s.stream:
                        assert seg_of[p].index in s.after  # waited for, maybe implied
        for P in s.waits:
            assert P.stream != s.stream and P.index < s.index


@pytest.mark.parametrize("name", ["towers", "inception"])
def test_zoo_forward_and_backward_graphs(name):
    for r in planned_zoo_records(name):
        if name == "towers" and r.tag.endswith(".bw"):
            # HEFT alternates the towers' backward between the streams op by op: a segment
            # compile each (about 45 s of the suite's time on the 2-core box). Its forward
            # has the same shape, and Inception's backward covers a backward graph.
            continue
        plan = _deterministic_plan(r)
        args = example_args(r.gm)
        prog = compile_segments(r.gm, plan, args, tag=r.tag)
        _check_cut(cut_segments(r.gm, plan, r.tag), r.gm)
        tier_plan = segment_plan(r.gm, r.table, r.tag)  # the tier's plan (measured times)
        if tier_plan is not None:
            _check_cut(cut_segments(r.gm, tier_plan, r.tag), r.gm)
        assert prog.streams_used == (0, 1), prog.notes
        assert prog.source.count("= _seg") >= 2 and "_rt.run_streams" in prog.source
        args64 = [a.double() if isinstance(a, torch.Tensor) and a.is_floating_point() else a
                  for a in args]  # fmt: skip
        with torch.no_grad():
            ref = r.gm(*args64)
            eager_nt = r.gm(*args)
            with intra_op_threads(1):  # the segments run 1 thread each: either is eager
                eager_1t = r.gm(*args)
            eager = [_worse(a, b, f) for a, b, f in zip(eager_nt, eager_1t, ref, strict=True)]
            for _ in range(2):  # the worker pool is reused
                got = prog.fn(*args)
                assert type(got) is type(ref) and len(got) == len(ref)
                for i, (a, e, f) in enumerate(zip(got, eager, ref, strict=True)):
                    if f is None:
                        assert a is None
                        continue
                    assert a.shape == f.shape and a.dtype == e.dtype
                    assert_close_to_oracle(f"{r.tag} output {i}", a, e, f)


def branches(x, w):
    a = (x @ w).tanh()
    b = (x @ w.t()).relu()
    return torch.cat([a, b]) * 2, a.sum()


def test_one_stream_gives_one_segment():
    x, w = torch.randn(8, 16), torch.randn(16, 16)
    gm = make_fx(branches)(x, w)
    plan = make_plan(gm, lambda i, n: 0, 2)
    assert len(cut_segments(gm, plan, TAG).segments) == 1
    prog = compile_segments(gm, plan, [x, w], tag=TAG)
    assert prog.source.count("= _seg") == 1 and "run_streams" not in prog.source
    assert prog.streams_used == (0,)
    for a, b in zip(prog.fn(x, w), gm(x, w), strict=True):
        torch.testing.assert_close(a, b)


def test_dropout_keeps_eager_rng_stream():
    def f(x):
        a, m1 = torch.native_dropout(x.sin(), 0.5, True)
        b, m2 = torch.native_dropout(x.cos(), 0.3, True)
        return a + b, x.exp() * 2, m1, m2

    x = torch.randn(256)
    gm = make_fx(f)(x)
    # every node but sin on stream 1: the random ops are moved to the calling thread
    prog = compile_segments(gm, make_plan(gm, lambda i, n: n.name != "sin", 2), [x], tag=TAG)
    assert sum("moved" in s for s in prog.notes) == 2
    for seed in (0, 1):
        torch.manual_seed(seed)
        got = prog.fn(x)
        after_got = torch.get_rng_state()
        torch.manual_seed(seed)
        want = gm(x)
        assert torch.equal(got[2], want[2]) and torch.equal(got[3], want[3])  # the masks
        assert torch.equal(after_got, torch.get_rng_state())  # the generator moved as eager
        torch.testing.assert_close(got[0], want[0])
        torch.testing.assert_close(got[1], want[1])


def test_inplace_write_keeps_eager_order():
    def f(x, buf):
        s = buf.sum()
        buf.copy_(x * 2)
        return buf * 3 + s, x.cos()

    gm = make_fx(f)(torch.randn(4), torch.randn(4))
    # the reader of the old value (sum_1) on the worker, the writer on the calling thread
    plan = make_plan(gm, lambda i, n: 1 if n.name in ("sum_1", "cos") else 0, 2)
    prog = compile_segments(gm, plan, [torch.randn(4), torch.randn(4)], tag=TAG)
    for _ in range(3):
        x, buf = torch.randn(4), torch.randn(4)
        b1, b2 = buf.clone(), buf.clone()
        got, want = prog.fn(x, b1), f(x, b2)
        # written once (x * 2), by an Inductor kernel, not eager's: the fp64 oracle judges
        assert_close_to_oracle("buffer", b1, b2, x.double() * 2)
        for a, b in zip(got, want, strict=True):
            torch.testing.assert_close(a, b)


def test_rng_out_of_graph_order_is_rejected():
    def f(x):
        return torch.native_dropout(x, 0.5, True)[0] + torch.native_dropout(x, 0.2, True)[0]

    gm = make_fx(f)(torch.randn(8))
    names = [n.name for n in gm.graph.nodes]
    first = [n for n in names if n.startswith("native_dropout_1") or n == "getitem_2"]
    keys = [f"{TAG}/{n}" for n in names[:1] + first + [n for n in names[1:] if n not in first]]
    with pytest.raises(PlanError, match="random"):
        cut_segments(gm, make_plan(gm, lambda i, n: 0, 2, order=keys), TAG)


@pytest.mark.parametrize("seed", range(40))
def test_random_plans_cut_into_an_acyclic_segment_graph(seed):
    """The cut alone (no compile): random DAGs, random placements, random plan orders."""
    r = random.Random(seed)
    f = random_dag(seed, r.randint(1, 14))
    gm = make_fx(f)(torch.randn(5, 6), torch.randn(5, 6))
    n_streams = r.choice([1, 2, 3])
    streams = {n.name: r.randrange(n_streams) for n in gm.graph.nodes}
    plan = make_plan(gm, lambda i, n: streams[n.name], n_streams,
                     order=random_topo_order(gm, r))  # fmt: skip
    cut = cut_segments(gm, plan, TAG)
    _check_cut(cut, gm)
    for s in cut.segments:  # a segment holds one stream's nodes in plan order
        assert all(cut.stream[n] == s.stream for n in s.nodes)


def test_refine_removes_alternations():
    """A plan alternating every op between streams: whole segments move until the
    predicted time (segment calls and waits, plus node costs) stops improving."""
    x, w = torch.randn(8, 16), torch.randn(16, 16)
    gm = make_fx(branches)(x, w)
    plan = make_plan(gm, lambda i, n: i, 2)
    before = cut_segments(gm, plan, TAG)
    refined, note = refine_for_segments(gm, plan, TAG)
    after = cut_segments(gm, refined, TAG)
    _check_cut(after, gm)
    assert len(after.segments) < len(before.segments), note
    assert segment_makespan(after, {}) < segment_makespan(before, {})
    assert note in refined.notes and refined.order == plan.order
    prog = compile_segments(gm, refined, [x, w], tag=TAG)
    for a, b in zip(prog.fn(x, w), gm(x, w), strict=True):
        torch.testing.assert_close(a, b)


def test_errors_name_the_segment_and_nothing_hangs():
    x, w = torch.randn(8, 16), torch.randn(16, 16)
    gm = make_fx(branches)(x, w)
    names = {"mm_1", "t", "relu"}  # the second branch on the worker
    prog = compile_segments(gm, make_plan(gm, lambda i, n: n.name in names, 2), [x, w], tag=TAG)
    assert prog.streams_used == (0, 1)
    with pytest.raises(Exception) as info:  # noqa: PT011 - Inductor's size check
        prog.fn(torch.randn(8, 16), torch.randn(3, 3))
    assert "segment" in "".join(getattr(info.value, "__notes__", []))
    for a, b in zip(prog.fn(x, w), gm(x, w), strict=True):  # and the program still works
        torch.testing.assert_close(a, b)


def test_warmup_process_compiles_the_same_segments():
    x, w = torch.randn(8, 16), torch.randn(16, 16)
    gm = make_fx(branches)(x, w)
    plan = make_plan(gm, lambda i, n: n.name in {"mm_1", "t", "relu"}, 2)
    proc = start_segment_warmup(gm, input_meta([x, w]), plan, TAG)
    proc.wait(timeout=600)
    assert proc.returncode == 0, warmup_error(proc)
    hits = counters["inductor"]["fxgraph_cache_hit"]
    prog = compile_segment_tier(gm, input_meta([x, w]), plan, TAG)
    assert prog.streams_used == (0, 1)
    # every segment is a cache hit: the warm-up compiled the very same graphs
    assert counters["inductor"]["fxgraph_cache_hit"] - hits == len(
        cut_segments(gm, plan, TAG).segments
    )
    for a, b in zip(prog.fn(x, w), gm(x, w), strict=True):
        torch.testing.assert_close(a, b)
