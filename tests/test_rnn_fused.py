"""autopar.rnn.layers: fused / chunked nn.LSTM and nn.GRU forms (one op per layer), the choice.

Accuracy: the fp64-oracle rule of tests/oracle.py on outputs, h_n, c_n and every gradient.
"""

from __future__ import annotations

import copy
import logging
from collections import Counter

import pytest
import torch
from functorch.compile import make_boxed_func
from oracle import assert_close_to_oracle, check_training
from torch import nn
from torch._dynamo.backends.common import aot_autograd

import autopar.rnn.choice as rc
import autopar.rnn.layers as rl
from autopar.rnn.cells import (
    fused_lstm_layer,
    mkldnn_lstm_usable,
    unrolled_lstm_layer,
)
from autopar.rnn.rewrite import rewrite_rnns

IN, H, B, T = 5, 6, 3, 7
pytestmark = pytest.mark.skipif(
    not mkldnn_lstm_usable(torch.zeros(1)), reason="needs oneDNN (mkldnn) on CPU"
)


@pytest.fixture(autouse=True)
def _one_thread():
    """oneDNN's per-step OpenMP barriers cost ~15 ms each on a loaded 2-core box at 2 threads
    (0.05 ms at 1): keep these numerics tests fast and stable; results do not depend on it."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


class Net(nn.Module):
    def __init__(self, kind="lstm", **kw):
        super().__init__()
        self.rnn = (nn.LSTM if kind == "lstm" else nn.GRU)(IN, H, **kw)

    def forward(self, x, *state):
        if isinstance(self.rnn, nn.GRU):
            return self.rnn(x, state[0] if state else None)
        out, (h, c) = self.rnn(x, tuple(state) if state else None)
        return out, h, c


def _inputs(rnn: nn.LSTM, batched=True, with_state=False):
    g = torch.Generator().manual_seed(7)
    shape = ((B, T, IN) if rnn.batch_first else (T, B, IN)) if batched else (T, IN)
    xs = [torch.randn(*shape, generator=g, dtype=torch.float64)]
    if with_state:
        n = rnn.num_layers * (2 if rnn.bidirectional else 1)
        lead = (B,) if batched else ()
        states = 2 if isinstance(rnn, nn.LSTM) else 1
        xs += [torch.randn(n, *lead, H, generator=g, dtype=torch.float64) for _ in range(states)]
    return xs


def _run(net, inputs64, dtype, weights=None):
    xs = [x.detach().to(dtype).requires_grad_() for x in inputs64]
    for p in net.parameters():
        p.grad = None
    torch.manual_seed(0)  # dropout masks: the same global RNG stream in every run
    outs = net(*xs)
    if weights is None:
        g = torch.Generator().manual_seed(3)
        weights = [torch.randn(o.shape, generator=g, dtype=torch.float64) for o in outs]
    sum((o * w.to(dtype)).sum() for o, w in zip(outs, weights, strict=True)).backward()
    grads = {n.removeprefix("_orig_mod."): p.grad.clone() for n, p in net.named_parameters()}
    grads.update({f"input{k}": x.grad.clone() for k, x in enumerate(xs)})
    return [o.detach() for o in outs], grads, weights


def _targets(gms) -> Counter:
    return Counter(str(n.target) for g in gms for n in g.graph.nodes if n.op == "call_function")


CASES = {
    "1layer": (dict(), True, False),
    "3layer": (dict(num_layers=3), True, True),
    "3layer_bidir_bf_state": (dict(num_layers=3, bidirectional=True, batch_first=True), True, True),
    "2layer_bidir_dropout": (dict(num_layers=2, bidirectional=True, dropout=0.4), True, False),
    "3layer_dropout_train_bf": (dict(num_layers=3, dropout=0.5, batch_first=True), True, True),
    "2layer_nobias_unbatched_state": (dict(num_layers=2, bias=False), False, True),
}


@pytest.mark.parametrize("mode", ["eager", "aot"])
@pytest.mark.parametrize("form", ["fused", "chunked:3"])
@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("kind", ["lstm", "gru"])
def test_fused_forms_match_eager(kind, case, form, mode):
    kw, batched, with_state = CASES[case]
    torch.manual_seed(0)
    net = Net(kind, **kw)
    inputs = _inputs(net.rnn, batched, with_state)
    ref_out, ref_grads, w = _run(copy.deepcopy(net).double(), inputs, torch.float64)
    eager_out, eager_grads, _ = _run(net, inputs, torch.float32, w)
    graphs: dict[str, list] = {"fw": [], "bw": []}

    def compiler(tag):
        def fn(gm, example_inputs):
            graphs[tag].append(gm)
            return make_boxed_func(gm.forward)

        return fn

    torch._dynamo.reset()
    with rewrite_rnns(net, rnn_form=form):
        runner = net
        if mode == "aot":
            backend = aot_autograd(fw_compiler=compiler("fw"), bw_compiler=compiler("bw"))
            runner = torch.compile(net, backend=backend)
        got_out, got_grads, _ = _run(runner, inputs, torch.float32, w)
    for k, (a, e, r) in enumerate(zip(got_out, eager_out, ref_out, strict=True)):
        assert a.shape == e.shape, (k, a.shape, e.shape)
        assert_close_to_oracle(f"{case}/{form}/{mode} output {k}", a, e, r)
    assert got_grads.keys() == eager_grads.keys()
    for name in got_grads:
        assert_close_to_oracle(f"grad {name}", got_grads[name], eager_grads[name], ref_grads[name])
    if mode == "aot":
        fw, bw = _targets(graphs["fw"]), _targets(graphs["bw"])
        layers = kw.get("num_layers", 1) * (2 if kw.get("bidirectional") else 1)
        calls = layers * (1 if form == "fused" else 3)
        op, op_bw = {
            "lstm": ("autopar.mkldnn_rnn_layer", "aten.mkldnn_rnn_layer_backward"),
            "gru": ("autopar.gru_layer", "autopar.gru_layer_backward"),
        }[kind]
        assert fw[op + ".default"] == calls, fw
        assert bw[op_bw + ".default"] == calls, bw
        assert not any("_cell" in t for t in fw), fw
        assert len(graphs["fw"]) == 1, "graph break in the fused forward"


def test_bias_free_zeros_get_no_grads_and_params_are_shared():
    torch.manual_seed(0)
    net = Net(num_layers=2, bias=False)
    names = [n for n, _ in net.named_parameters()]
    with rewrite_rnns(net, rnn_form="fused"):
        out, h, c = net(torch.randn(T, B, IN))
        (out.sum() + c.sum()).backward()
    assert [n for n, _ in net.named_parameters()] == names  # no bias Parameters appeared
    assert all(p.grad is not None for p in net.parameters())


def test_fused_lstm_layer_helper_and_fallback():
    torch.manual_seed(0)
    cell = nn.LSTM(IN, H)
    x, h0, c0 = torch.randn(T, B, IN), torch.randn(B, H), torch.randn(B, H)
    ws = (cell.weight_ih_l0, cell.weight_hh_l0, cell.bias_ih_l0, cell.bias_hh_l0)
    ref, (hn, cn) = cell(x, (h0[None], c0[None]))
    r64, (h64, c64) = copy.deepcopy(cell).double()(x.double(), (h0[None].double(),
                                                              c0[None].double()))  # fmt: skip
    out, hy, cy = fused_lstm_layer(x, *ws, h0, c0)
    for name, got, eager, oracle in (("out", out, ref, r64), ("h", hy, hn[0], h64[0]),
                                     ("c", cy, cn[0], c64[0])):  # fmt: skip
        assert_close_to_oracle(name, got, eager, oracle)
    # Non-contiguous inputs (oneDNN ignores strides: the helper must copy them).
    xt = x.transpose(0, 1).contiguous().transpose(0, 1)
    assert_close_to_oracle("strided", fused_lstm_layer(xt, *ws, h0, c0)[0], ref, r64)
    # float64 is not a oneDNN dtype: the unrolled per-step form, same results.
    w64 = [w.double() for w in ws]
    out64, _, _ = fused_lstm_layer(x.double(), *w64, h0.double(), c0.double(), reverse=True)
    exp, _, _ = unrolled_lstm_layer(x.double(), *w64, h0.double(), c0.double(), reverse=True)
    assert torch.equal(out64, exp)
    assert not mkldnn_lstm_usable(x.double())


def test_proj_size_and_float64_stay_unrolled():
    net = nn.LSTM(IN, H, proj_size=4)
    h0, c0 = torch.zeros(1, B, 4), torch.zeros(1, B, H)
    assert rl._rnn_form(net, torch.randn(T, B, IN), h0, c0)[0] == "unrolled"
    net64 = nn.LSTM(IN, H).double()
    x = torch.randn(T, B, IN, dtype=torch.float64)
    assert rl._rnn_form(net64, x, *(torch.zeros(1, B, H).double(),) * 2)[0] == "unrolled"


# --------------------------------------------------------------------------- the choice


def _spec(**kw):
    base = dict(steps=32, batch=16, input=64, hidden=128, layers=4, dirs=1, bias=True)
    base.update(dtype="float32", barrier=False)
    base.update(kw)
    return rc.RNNSpec(**base)


def _fake_timings(spec, unrolled, full_default, full_half):
    """Fused piece times linear in steps: (t_default, t_half) per distinct piece shape."""
    t = {"unrolled": unrolled}
    for k in (1, *rc.CHUNK_CANDIDATES):
        for _, _, shape in rc._pieces(spec, k):
            frac = shape[1] / spec.steps
            t[shape] = (full_default * frac + 1e-4, full_half * frac + 1e-4)
    return t


T_FULL = 32  # _spec()'s steps


def test_choice_is_deterministic_given_timings(monkeypatch):
    monkeypatch.setattr(rc, "_cores", lambda: 4)
    spec = _spec()
    # Threads help each piece (half-thread pieces 2x slower): one stream, fused.
    t = _fake_timings(spec, (1.0, 1.0), full_default=0.01, full_half=0.02)
    assert rc.choose_rnn_form(spec, t)[0] == ("fused", 1)
    # Threads do not help: the wavefront on two half-thread streams wins.
    t = _fake_timings(spec, (1.0, 1.0), full_default=0.01, full_half=0.01)
    choice, pred = rc.choose_rnn_form(spec, t)
    assert choice[0] == "chunked" and pred[choice] < 0.9 * pred[("fused", 1)]
    assert choice == rc.choose_rnn_form(spec, t)[0]
    # ... unless two pieces at once measured no faster than one after the other (busy core).
    assert rc.choose_rnn_form(spec, t | {"pair": 1.0})[0] == ("fused", 1)
    # ... or its chunks one after the other (if the planner keeps one stream) are 20% slower
    # than the fused layer: the downside is bounded (rnn_choice.DOWNSIDE).
    slow = {k: (v[0] * 1.2, v[1]) for k, v in t.items() if isinstance(k, tuple) and k[1] < T_FULL}
    choice, pred = rc.choose_rnn_form(spec, t | slow)
    assert choice == ("fused", 1) and pred[("chunked", 2)] < 0.75 * pred[("fused", 1)]
    # Two cores: chunked forms are not candidates (rnn_choice.MIN_CORES_CHUNKED).
    monkeypatch.setattr(rc, "_cores", lambda: 2)
    choice, pred = rc.choose_rnn_form(spec, t)
    assert choice == ("fused", 1) and all(f != "chunked" for f, _ in pred)
    monkeypatch.setattr(rc, "_cores", lambda: 4)
    # Unrolled measured fastest by far.
    t = _fake_timings(spec, (0.001, 0.002), full_default=0.01, full_half=0.02)
    assert rc.choose_rnn_form(spec, t)[0] == ("unrolled", 1)
    # Dropout between layers (barrier): chunked is not a candidate.
    spec_d = _spec(barrier=True)
    t = _fake_timings(spec_d, (1.0, 1.0), full_default=0.01, full_half=0.01)
    choice, pred = rc.choose_rnn_form(spec_d, t)
    assert choice == ("fused", 1) and all(f != "chunked" for f, _ in pred)
    # Bidirectional, threads useless: the two directions run concurrently (fused ~ halved).
    spec_b = _spec(dirs=2, layers=2)
    t = _fake_timings(spec_b, (1.0, 1.0), full_default=0.01, full_half=0.01)
    _, pred = rc.choose_rnn_form(spec_b, t)
    assert pred[("fused", 1)] < 0.6 * 4 * 0.0101


def test_prediction_is_the_planners_simulation(monkeypatch):
    """The pieces are scheduled and simulated by the planner (listsched.list_schedule): a
    bidirectional fused layer with useless threads runs both directions at once, one sync
    per layer boundary; on one core the simulator sees two streams oversubscribe it."""
    spec = _spec(dirs=2, layers=2)
    t = _fake_timings(spec, (1.0, 1.0), full_default=0.01, full_half=0.01)
    monkeypatch.setattr(rc, "_cores", lambda: 2)
    monkeypatch.setattr(rc, "_threads", lambda: (2, 1))
    piece = 0.01 + 1e-4
    assert rc.predict_rnn_form(spec, "fused", 1, t) == pytest.approx(2 * piece + rc.SYNC_S)
    monkeypatch.setattr(rc, "_cores", lambda: 1)
    monkeypatch.setattr(rc, "_threads", lambda: (1, 1))
    assert rc.predict_rnn_form(spec, "fused", 1, t) == pytest.approx(4 * piece)  # serial


def test_choice_measured_once_cached_logged_and_overridable(monkeypatch, caplog):
    calls = []

    def fake_measure(spec):
        calls.append(spec)
        return _fake_timings(spec, (1e-3, 1e-3), full_default=0.01, full_half=0.02)

    monkeypatch.setattr(rl, "measure_rnn_forms", fake_measure)
    rl.clear_choices()
    net = nn.LSTM(IN, H, num_layers=2)
    x = torch.randn(T, B, IN)
    with caplog.at_level(logging.INFO, logger="autopar"), rewrite_rnns(net):
        net(x)
        net(x)
    assert len(calls) == 1 and calls[0].steps == T and calls[0].layers == 2
    assert any("nn.LSTM" in r.getMessage() and "unrolled" in r.getMessage() for r in caplog.records)
    assert rl._CHOICES and list(rl._CHOICES.values()) == [("unrolled", 1)]
    monkeypatch.setenv("AUTOPAR_RNN_FORM", "chunked:2")
    with rewrite_rnns(net):
        assert rl.form_override == "chunked:2"
        assert rl._rnn_form(net, x, *(torch.zeros(2, B, H),) * 2) == ("chunked", 2)
    assert rl.form_override is None and len(calls) == 1
    monkeypatch.setenv("AUTOPAR_RNN_FORM", "bogus")
    with pytest.raises(ValueError, match="unknown RNN form"), rewrite_rnns(net):
        pass
    rl.clear_choices()


def test_real_measurement_keeps_rng_and_returns_all_shapes():
    spec = _spec(steps=4, batch=2, input=3, hidden=4, layers=2)
    torch.manual_seed(5)
    state = torch.get_rng_state()
    t = rc.measure_rnn_forms(spec)
    assert torch.equal(torch.get_rng_state(), state)
    choice, pred = rc.choose_rnn_form(spec, t)
    assert choice in pred and all(v > 0 for v in pred.values())


def test_gru_cannot_use_onednn():
    """Documented: mkldnn_rnn_layer has no GRU mode on CPU (hence autopar::gru_layer)."""
    g = nn.GRU(IN, H)
    z = torch.zeros(B, H)
    with pytest.raises(RuntimeError):
        torch.ops.aten.mkldnn_rnn_layer(
            torch.randn(T, B, IN), g.weight_ih_l0, g.weight_hh_l0, g.bias_ih_l0, g.bias_hh_l0,
            z, z, False, [], 3, H, 1, True, False, False, True,
        )  # fmt: skip


@pytest.mark.parametrize("form", ["fused", "chunked:2"])
@pytest.mark.parametrize("kind", ["lstm", "gru"])
def test_autopar_compile_trains_like_eager(kind, form, monkeypatch):
    """The whole pipeline (capture, profile, plan, worker streams) on the fused forms."""
    import autopar
    from autopar.profiling.store import ProfileStore

    monkeypatch.setenv("AUTOPAR_RNN_FORM", form)
    torch.manual_seed(0)
    net = Net(kind, num_layers=2, bidirectional=True)
    x = torch.randn(T, B, IN)
    torch._dynamo.reset()
    check_training(net, [x], lambda m: autopar.compile(m, streams=2, store=ProfileStore.memory()))
