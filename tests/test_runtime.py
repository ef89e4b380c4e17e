"""Runtime: worker pools, error propagation without hangs, concurrency, per-thread threads."""

from __future__ import annotations

import threading

import pytest
import torch
from test_codegen import (
    ARGS,
    TAG,
    assert_like_eager,
    assert_same,
    branches,
    eager_results,
    make_plan,
)
from torch.fx.experimental.proxy_tensor import make_fx

import autopar.runtime.streams as rt
from autopar.codegen.emitters import generate


def run_with_deadline(fn, seconds=60.0):
    """Run ``fn`` in a thread; fail (instead of hanging the suite) if it does not finish."""
    box: dict = {}

    def body():
        try:
            box["result"] = fn()
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            box["error"] = exc

    t = threading.Thread(target=body, daemon=True)
    t.start()
    t.join(seconds)
    assert not t.is_alive(), "the program hung"
    if "error" in box:
        raise box["error"]
    return box["result"]


def _docstring_example() -> int:
    """The module docstring's two-stream program: the worker hands 41 to main, main adds 1."""
    st = rt.CallState(n_slots=1, n_events=1, args=())

    def worker(st):
        st.v[0] = 41
        st.ev[0].set()

    def main(st):
        st.wait(0)
        return st.v[0] + 1

    return rt.run_streams(rt.StreamSpec(main=main, workers=((worker, 0),)), st)


def test_run_streams_docstring_example():
    assert _docstring_example() == 42


def test_pool_threads_are_created_once_and_reused():
    gm = make_fx(branches)(*ARGS)
    prog = generate(gm, make_plan(gm, lambda i, n: i, 4), TAG)
    prog.fn(*ARGS)
    before = {t.ident for t in threading.enumerate() if t.name.startswith("autopar-worker")}
    want = eager_results(gm, ARGS)
    for _ in range(5):
        assert_like_eager("pool", prog.fn(*ARGS), want)
    after = {t.ident for t in threading.enumerate() if t.name.startswith("autopar-worker")}
    assert after == before and len(after) >= 3


def two_branch_program(n_streams=2):
    def f(x, w1, w2):
        return torch.cat([(x @ w1).tanh(), (x @ w2).sin()]) * 2

    args = (torch.randn(4, 8), torch.randn(8, 8), torch.randn(8, 8))
    gm = make_fx(f)(*args)
    # the x @ w1 branch on stream 1, the rest on stream 0
    plan = make_plan(gm, lambda i, n: 1 if n.name in ("mm", "tanh") else 0, n_streams)
    return gm, generate(gm, plan, TAG), args


def test_worker_exception_is_reraised_with_node_name_and_nothing_hangs():
    gm, prog, (x, w1, w2) = two_branch_program()
    assert "def _stream_1" in prog.source and "mm = aten.mm.default(x_1, w1_1)" in prog.source
    with pytest.raises(RuntimeError) as info:
        run_with_deadline(lambda: prog.fn(x, torch.randn(3, 8), w2))  # mm on stream 1 fails
    notes = "\n".join(getattr(info.value, "__notes__", []))
    assert "node g0.fw/mm on stream 1 (worker thread)" in notes
    assert "generated line: mm = aten.mm.default(x_1, w1_1)" in notes
    # the pool is healthy afterwards
    got = run_with_deadline(lambda: prog.fn(x, w1, w2))
    assert_like_eager("after a worker error", got, eager_results(gm, [x, w1, w2]))


def test_main_stream_exception_unblocks_waiting_worker():
    def f(x, w):
        a = x @ w  # stream 0, fails
        return (a.tanh() @ w).sin()  # stream 1 waits for a

    args = (torch.randn(4, 8), torch.randn(8, 8))
    gm = make_fx(f)(*args)
    plan = make_plan(gm, lambda i, n: 0 if n.name in ("mm", "output") else 1, 2)
    prog = generate(gm, plan, TAG)
    with pytest.raises(RuntimeError) as info:
        run_with_deadline(lambda: prog.fn(torch.randn(4, 5), args[1]))
    assert "node g0.fw/mm on stream 0 (calling thread)" in "\n".join(info.value.__notes__)
    got = run_with_deadline(lambda: prog.fn(*args))
    assert_like_eager("after a main-stream error", got, eager_results(gm, args))


def test_wait_times_out_instead_of_hanging():
    st = rt.CallState(n_slots=0, n_events=1, args=(), timeout_s=0.2)
    spec = rt.StreamSpec(main=lambda st: st.wait(0), workers=((lambda st: None, 0),))
    with pytest.raises(TimeoutError, match="missing signal"):
        run_with_deadline(lambda: rt.run_streams(spec, st))


def test_two_programs_from_two_threads_at_once():
    gm_a, prog_a, args_a = two_branch_program()
    gm_b = make_fx(branches)(*ARGS)
    prog_b = generate(gm_b, make_plan(gm_b, lambda i, n: i, 4), TAG)
    want_a, want_b = eager_results(gm_a, args_a), eager_results(gm_b, ARGS)
    errors: list = []

    def loop(prog, args, want):
        try:
            for _ in range(20):
                assert_like_eager("concurrent", prog.fn(*args), want)
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    threads = [
        threading.Thread(target=loop, args=(prog_a, args_a, want_a)),
        threading.Thread(target=loop, args=(prog_b, ARGS, want_b)),
        threading.Thread(target=loop, args=(prog_b, ARGS, want_b)),  # same program twice
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
        assert not t.is_alive(), "concurrent calls deadlocked"
    assert not errors, errors


def test_results_are_bit_identical_run_after_run():
    gm = make_fx(branches)(*ARGS)
    prog = generate(gm, make_plan(gm, lambda i, n: i * 3, 4), TAG)
    first = prog.fn(*ARGS)
    for _ in range(10):
        assert_same(prog.fn(*ARGS), first)


def test_thread_local_threads_do_not_leak_to_other_threads():
    default = torch.get_num_threads()
    seen = {}

    def worker():
        rt.set_thread_local_threads(1)
        seen["worker"] = torch.get_num_threads()

    t = threading.Thread(target=worker)
    t.start()
    t.join()
    assert seen["worker"] == 1
    assert torch.get_num_threads() == default
    if rt.PER_THREAD_SETTING:  # the process default that new threads copy is untouched
        t = threading.Thread(target=lambda: seen.update(fresh=torch.get_num_threads()))
        t.start()
        t.join()
        assert seen["fresh"] == default
    with rt.intra_op_threads(1):
        assert torch.get_num_threads() == 1
    assert torch.get_num_threads() == default


def test_idle_omp_team_is_released_before_worker_streams(monkeypatch):
    """run_streams stops the caller's idle OpenMP team spinning (it would take the core a
    worker stream needs); ops afterwards re-create the team and compute the same."""
    a = torch.randn(256, 256)
    ref = a @ a  # a 2-thread op: the calling thread now has an idle team
    if rt.PER_THREAD_SETTING and rt._OMP_PAUSE is not None:  # libgomp (this box)
        assert rt.release_idle_omp_team() is True
        assert rt.release_idle_omp_team() is True  # nothing left to release: still fine
    assert torch.equal(a @ a, ref)
    calls = []
    monkeypatch.setattr(rt, "release_idle_omp_team", lambda: calls.append(1) or True)
    assert _docstring_example() == 42
    assert calls == [1]


def test_programs_never_exceed_the_callers_thread_count():
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        with rt.intra_op_threads(2):
            assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)
