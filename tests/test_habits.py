"""PyTorch habits work as in eager: hooks added after the first call, copying and saving the
compiled module, empty batches, and a cold compile that leaves the user's RNG alone."""

from __future__ import annotations

import copy
import io
import pickle
import subprocess
import sys
import textwrap

import torch
import torch.nn as nn

import autopar
from autopar.profiling.store import ProfileStore


def _mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))


def _compile(m):
    return autopar.compile(m, store=ProfileStore.memory(), race=False)


def test_hooks_added_after_the_first_call_take_effect():
    x = torch.randn(4, 8)
    m = _mlp()
    cm = _compile(m)
    cm(x)
    h1 = m[0].register_forward_hook(lambda mod, i, o: o * 10)
    torch.testing.assert_close(cm(x), m(x))
    h2 = m[2].register_forward_pre_hook(lambda mod, i: (i[0] + 1,))
    torch.testing.assert_close(cm(x), m(x))
    h1.remove()
    h2.remove()
    torch.testing.assert_close(cm(x), m(x))


def test_deepcopy_pickle_and_torch_save_work():
    x = torch.randn(4, 8)
    m = _mlp()
    cm = _compile(m)
    want = cm(x)
    for copied in (
        copy.deepcopy(cm),
        pickle.loads(pickle.dumps(cm)),
        torch.load(io.BytesIO(_saved(cm)), weights_only=False),
    ):
        assert isinstance(copied, autopar.CompiledModule)
        torch.testing.assert_close(copied(x), want)
        assert copied._orig_mod is not m  # a copy, not the same Parameters


def _saved(module) -> bytes:
    buf = io.BytesIO()
    torch.save(module, buf)
    return buf.getvalue()


def test_empty_batch_returns_what_eager_returns():
    lstm = nn.LSTM(8, 16)
    out, (h, c) = _compile(lstm)(torch.randn(5, 0, 8))
    assert out.shape == (5, 0, 16) and h.shape == (1, 0, 16)


def test_cold_compile_leaves_the_users_rng_stream_alone():
    # A fresh process: nothing calibrated or cached yet (the cold path of a first compile).
    script = textwrap.dedent(
        """
        import torch, torch.nn as nn, autopar
        from autopar.profiling.store import ProfileStore
        def run(compiled):
            torch.manual_seed(0)
            m = nn.Sequential(nn.Linear(8, 8), nn.Dropout(0.5), nn.Linear(8, 2))
            if compiled:
                m = autopar.compile(m, store=ProfileStore.memory(), race=False)
            m(torch.randn(4, 8)).sum().backward()
            return torch.rand(3)
        print(torch.equal(run(True), run(False)))
        """
    )
    env_out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                             timeout=300)  # fmt: skip
    assert env_out.stdout.strip().splitlines()[-1] == "True", env_out.stderr[-2000:]


def test_explain_is_a_structured_report():
    m = _mlp()
    cm = autopar.compile(m, store=ProfileStore.memory())
    ex = autopar.explain(cm)
    assert not ex.graphs and "nothing compiled yet" in ex
    for _ in range(3):
        cm(torch.randn(4, 8)).sum().backward()
    ex = autopar.explain(cm)
    assert [u.tag for u in ex.graphs] == ["g0.fw", "g0.bw"]
    assert all(u.executor == "plan" for u in ex.graphs) and ex.graph_breaks == 0
    first_call = ex.compile_seconds  # recorded (its value is a timing: not checked)
    assert first_call is not None and not ex.fallbacks
    (verdict, why), = ex.steps.values()
    assert verdict is None and "racing" in why  # 3 steps: the race is still running
    assert ex.ladder == ("eager", "plan") and set(ex.rungs["g0"]) == {"eager", "plan"}
    assert str(ex) == ex.summary() and len(str(ex).splitlines()) <= 30
    assert "def forward" in ex.source and ex.text(verbose=True).endswith(ex.source)


def test_profile_and_plan_leave_buffers_rng_and_grads_alone():
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8), nn.Dropout(0.5), nn.Linear(8, 2))
    x = torch.randn(4, 8)
    m(x).sum().backward()
    before = {k: v.clone() for k, v in m.state_dict().items()}
    grads = [p.grad.clone() for p in m.parameters()]
    rng = torch.get_rng_state()
    autopar.profile(m, x, store=ProfileStore.memory())
    autopar.plan(m, x, streams=2, store=ProfileStore.memory())
    assert torch.equal(torch.get_rng_state(), rng)
    for k, v in m.state_dict().items():
        assert torch.equal(v, before[k]), k  # running stats and num_batches_tracked
    for p, g in zip(m.parameters(), grads, strict=True):
        assert torch.equal(p.grad, g)


def test_inference_mode_plans_without_a_warning():
    import warnings

    m = _mlp()
    cm = _compile(m)
    x = torch.randn(4, 8)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no fallback warning: the graph is planned
        with torch.inference_mode():
            out = cm(x)
    torch.testing.assert_close(out, m(x))
    assert all(u.fallback is None for u in autopar.graphs(cm))


def test_copy_of_an_in_memory_model_profiles_in_memory():
    cm = _compile(_mlp())
    copied = copy.deepcopy(cm)
    store = copied._autopar_options.store
    assert isinstance(store, ProfileStore) and store.path is None


class _Scaled(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x, scale=None):
        return self.lin(x) * scale


def test_float64_keyword_tensor_trains_like_eager_without_a_warning():
    """Dynamo re-traces a float scalar input as a tensor (``TensorifyScalarRestartAnalysis``):
    that is Dynamo's control flow, not a failure to fall back on."""
    import warnings

    torch.manual_seed(0)
    model = _Scaled()
    eager = copy.deepcopy(model)
    cmodel = _compile(model)
    x = torch.randn(2, 4)
    scale = torch.tensor(2.0, dtype=torch.float64)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out = cmodel(x, scale=scale)
    ref = eager(x, scale=scale)
    assert out.dtype == ref.dtype
    out.sum().backward()
    ref.sum().backward()
    torch.testing.assert_close(out, ref)
    for p, q in zip(model.parameters(), eager.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad)


def test_a_bug_in_the_model_reads_like_eagers_error_with_the_users_line():
    """A shape mismatch in the model surfaces while Dynamo traces with fake tensors: the
    error is the op's own (RuntimeError), names this file's line, and says what to do,
    without Dynamo's advice to remove a torch.compile call the user never wrote."""
    import pytest

    class Buggy(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(8, 8), nn.Linear(7, 3)

        def forward(self, x):
            return self.b(self.a(x))  # 8 features into Linear(7, 3)

    with pytest.raises(RuntimeError) as info:
        _compile(Buggy())(torch.randn(4, 8))
    text = str(info.value)
    assert "test_habits.py:" in text and "self.b(self.a(x))" in text
    assert "without autopar.compile" in text and "torch.compile` call" not in text
    assert info.value.__cause__ is None and info.value.dynamo_error is not None


def test_two_threads_each_training_its_own_model_started_together():
    """Two threads, each compiling and training its own model, started at once: both
    finish, the graphs get plans, and each model trains like its eager twin."""
    import threading

    for _ in range(3):
        barrier = threading.Barrier(2)
        results: dict = {}

        def work(i: int, barrier=barrier, results=results) -> None:
            try:
                torch.manual_seed(i)
                model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
                eager = copy.deepcopy(model)
                cmodel = _compile(model)
                x = torch.randn(4, 8)
                barrier.wait()
                for _ in range(3):
                    for m in (cmodel, eager):
                        m.zero_grad()
                        m(x).square().sum().backward()
                grads = [(p.grad, q.grad) for p, q in zip(model.parameters(),
                                                           eager.parameters(), strict=True)]
                results[i] = ({u.executor for u in autopar.graphs(cmodel)}, grads)
            except Exception as exc:  # noqa: BLE001 - reported below
                results[i] = exc

        threads = [threading.Thread(target=work, args=(i,)) for i in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        for i in range(2):
            assert not isinstance(results.get(i), Exception), results.get(i)
            executors, grads = results[i]
            # Dynamo caches per code object: when both threads look up at once, one model
            # may run the graphs the other compiled (parameters are inputs: same results),
            # and autopar.graphs lists them under that other model.
            assert executors <= {"plan"}
            for g, h in grads:
                torch.testing.assert_close(g, h, rtol=1e-5, atol=1e-6)
        assert any(results[i][0] == {"plan"} for i in range(2))


def test_instances_of_one_class_compile_apart_and_leave_dynamo_config_as_it_was():
    """More compiled instances of one class than Dynamo's default recompile limit (8) each
    get their graphs (a cache region and limit per module where torch offers them, else a
    raised limit during calls); no Dynamo setting is left changed after a call."""
    cfg = torch._dynamo.config
    before = (cfg.skip_nnmodule_hook_guards, cfg.recompile_limit)
    x = torch.randn(4, 8)
    for _ in range(9):
        m = _mlp()
        cm = autopar.compile(m, store=ProfileStore.memory(), race=False, adapt=False)
        torch.testing.assert_close(cm(x), m(x))
        assert autopar.graphs(cm), "Dynamo ran the module eagerly: recompile limit hit"
        assert (cfg.skip_nnmodule_hook_guards, cfg.recompile_limit) == before


def test_backend_autopar_leaves_dynamo_hook_guard_setting_as_it_was():
    """``torch.compile(backend="autopar")`` has no autopar call around Dynamo's: the hook
    guards are not switched on there, so nothing would restore them."""
    before = torch._dynamo.config.skip_nnmodule_hook_guards
    x = torch.randn(4, 8)
    m = _mlp()
    cm = torch.compile(m, backend="autopar", options={"store": ProfileStore.memory()})
    torch.testing.assert_close(cm(x), m(x))
    assert torch._dynamo.config.skip_nnmodule_hook_guards == before


class _Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(8, 16), nn.Linear(16, 2)

    def forward(self, x):
        return self.b(torch.relu(self.a(x)))


class _Doubled(_Net):
    """A subclass that overrides ``__call__`` (eager runs it around ``forward``)."""

    def __call__(self, *args, **kwargs):
        return super().__call__(*args, **kwargs) * 2


def _twins(cls):
    torch.manual_seed(0)
    model = cls()
    return autopar.compile(copy.deepcopy(model), store=ProfileStore.memory()), model


def _step_both(cmodel, eager, x, opts):
    outs = []
    for m, opt in zip((cmodel, eager), opts, strict=True):
        out = m(x)
        out.square().mean().backward()
        opt.step()
        opt.zero_grad()
        outs.append(out.detach())
    torch.testing.assert_close(outs[0], outs[1], rtol=1e-5, atol=1e-5)


def test_a_forward_replaced_after_four_steps_runs_as_in_eager():
    import types

    class Net(_Net):  # its own class: the test replaces the class's forward too
        pass

    cmodel, eager = _twins(Net)
    x = torch.randn(8, 8)
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (cmodel, eager)]
    for _ in range(4):
        _step_both(cmodel, eager, x, opts)

    def new_forward(self, x):
        return self.b(torch.tanh(self.a(x))) + 1.0

    for m in (cmodel._orig_mod, eager):  # on the instance, as users patch a model
        m.forward = types.MethodType(new_forward, m)
    for _ in range(6):
        _step_both(cmodel, eager, x, opts)
    for m in (cmodel._orig_mod, eager):
        del m.forward
    Net.forward = lambda self, x: self.b(self.a(x).sigmoid())  # on the class
    for _ in range(3):
        _step_both(cmodel, eager, x, opts)
    for p, q in zip(cmodel.parameters(), eager.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-5)


def test_a_subclass_that_overrides_call_runs_its_call_as_in_eager():
    cmodel, eager = _twins(_Doubled)
    x = torch.randn(8, 8)
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (cmodel, eager)]
    for _ in range(8):
        _step_both(cmodel, eager, x, opts)
    for p, q in zip(cmodel.parameters(), eager.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-5)


def test_two_threads_calling_one_compiled_model_match_eager_in_50_rounds():
    """Two threads share one compiled model (each with its own batch size, so both compile
    at once): no error, no fallback, and every gradient is eager's, in 50 of 50 rounds."""
    import threading
    import warnings

    for r in range(50):
        torch.manual_seed(r)
        model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
        eager = copy.deepcopy(model)
        cmodel = _compile(model)
        barrier, errors = threading.Barrier(2), []

        def work(i: int, cmodel=cmodel, eager=eager, barrier=barrier, errors=errors) -> None:
            try:
                x = torch.randn(4 + 2 * i, 8, generator=torch.Generator().manual_seed(i))
                barrier.wait()
                for _ in range(4):
                    g = torch.autograd.grad(cmodel(x).square().sum(), list(cmodel.parameters()))
                    e = torch.autograd.grad(eager(x).square().sum(), list(eager.parameters()))
                    for a, b in zip(g, e, strict=True):
                        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
            except Exception as exc:  # noqa: BLE001 - reported below
                errors.append(exc)

        with warnings.catch_warnings():
            warnings.simplefilter("error", autopar.errors.FallbackWarning)
            threads = [threading.Thread(target=work, args=(i,)) for i in range(2)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(120)
        assert not errors, f"round {r}: {errors[0]!r}"
