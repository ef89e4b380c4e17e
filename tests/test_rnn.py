"""autopar.rnn.cells: the cell custom ops and the LSTM/GRU module rewrite.

Accuracy rule (the "fp64 oracle"): for every output and gradient, autopar's max error vs an
fp64 run of the same model is at most 2x eager fp32's error + 1e-6.
"""

from __future__ import annotations

import copy
from collections import Counter

import pytest
import torch
import torch.nn.functional as F
from functorch.compile import make_boxed_func
from torch import nn
from torch._dynamo.backends.common import aot_autograd
from torch._dynamo.utils import counters
from torch.nn.utils.rnn import pack_padded_sequence

from autopar.errors import CaptureError
from autopar.rnn.rewrite import rewrite_rnns

IN, H, B = 5, 6, 3


# --------------------------------------------------------------------------- op level


def _gates(n: int, dtype=torch.float64, batch=(4,)):
    g = torch.Generator().manual_seed(n)
    mk = lambda *s: torch.randn(*s, generator=g, dtype=dtype).requires_grad_()
    return mk(*batch, n * H), mk(*batch, n * H), mk(*batch, H)


def test_ops_pass_opcheck():
    """Schemas, fake impls, autograd registration and AOT dispatch are consistent."""
    torch.library.opcheck(torch.ops.autopar.lstm_cell.default, _gates(4))
    torch.library.opcheck(torch.ops.autopar.gru_cell.default, _gates(3))


@pytest.mark.parametrize("kind", ["lstm", "gru"])
def test_ops_gradcheck(kind):
    op = torch.ops.autopar.lstm_cell if kind == "lstm" else torch.ops.autopar.gru_cell
    args = _gates(4 if kind == "lstm" else 3, batch=(2, 3))  # extra leading dim works too
    assert torch.autograd.gradcheck(op, args)


def test_ops_reject_bad_shapes_with_clear_errors():
    ig, hg, c = _gates(4)
    with pytest.raises(ValueError, match=r"\[\.\.\., 4\*H\]"):
        torch.ops.autopar.lstm_cell(ig, hg, c[:, :-1])
    with pytest.raises(ValueError, match="same shape"):
        torch.ops.autopar.gru_cell(ig[:, : 3 * H], hg[:, :-1], c)


# --------------------------------------------------------------------------- models


class CellLoop(nn.Module):
    """A Python loop over an nn.LSTMCell / nn.GRUCell stack, like users write."""

    def __init__(self, kind: str, layers: int = 2, bias: bool = True):
        super().__init__()
        cls = nn.LSTMCell if kind == "lstm" else nn.GRUCell
        self.kind = kind
        self.cells = nn.ModuleList(cls(IN if k == 0 else H, H, bias=bias) for k in range(layers))

    def forward(self, x, *state):
        hs = [None] * len(self.cells)
        if state:  # one initial (h, c) / h shared by all layers
            hs = [state if self.kind == "lstm" else state[0]] * len(self.cells)
        outs = []
        for t in range(x.size(0)):
            inp = x[t]
            for k, cell in enumerate(self.cells):
                hs[k] = cell(inp, hs[k])
                inp = hs[k][0] if self.kind == "lstm" else hs[k]
            outs.append(inp)
        last = hs[-1] if self.kind == "lstm" else (hs[-1],)
        return (torch.stack(outs), *last)


class RNNNet(nn.Module):
    """Wraps nn.LSTM / nn.GRU and flattens its outputs to a tuple of tensors."""

    def __init__(self, kind: str, **kw):
        super().__init__()
        self.rnn = (nn.LSTM if kind == "lstm" else nn.GRU)(IN, H, **kw)

    def forward(self, x, *state):
        if isinstance(self.rnn, nn.LSTM):
            out, (h, c) = self.rnn(x, tuple(state) if state else None)
            return out, h, c
        out, h = self.rnn(x, state[0] if state else None)
        return out, h


def _inputs(net: nn.Module, steps: int, batched: bool, with_state: bool):
    g = torch.Generator().manual_seed(7)
    rnn = getattr(net, "rnn", None)
    bf = bool(rnn is not None and rnn.batch_first)
    shape = ((B, steps, IN) if bf else (steps, B, IN)) if batched else (steps, IN)
    xs = [torch.randn(*shape, generator=g, dtype=torch.float64)]
    if with_state:
        lead = () if not batched else (B,)
        if rnn is None:
            sizes = [H, H] if net.kind == "lstm" else [H]
            xs += [torch.randn(*lead, s, generator=g, dtype=torch.float64) for s in sizes]
        else:
            dirs = 2 if rnn.bidirectional else 1
            n = rnn.num_layers * dirs
            h_size = rnn.proj_size if getattr(rnn, "proj_size", 0) else H
            sizes = [h_size, H] if isinstance(rnn, nn.LSTM) else [H]
            xs += [torch.randn(n, *lead, s, generator=g, dtype=torch.float64) for s in sizes]
    return xs


def _run(net, inputs64, dtype, weights=None, seed=0):
    """Forward + backward of sum(out_k * w_k); returns (outputs, {name: grad})."""
    xs = [x.detach().to(dtype).requires_grad_() for x in inputs64]
    for p in net.parameters():
        p.grad = None
    torch.manual_seed(seed)
    outs = net(*xs)
    if weights is None:
        g = torch.Generator().manual_seed(3)
        weights = [torch.randn(o.shape, generator=g, dtype=torch.float64) for o in outs]
    loss = sum((o * w.to(dtype)).sum() for o, w in zip(outs, weights, strict=True))
    loss.backward()
    # torch.compile's wrapper names parameters "_orig_mod.<name>".
    grads = {
        n.removeprefix("_orig_mod."): p.grad.detach().clone() for n, p in net.named_parameters()
    }
    grads.update({f"input{k}": x.grad.detach().clone() for k, x in enumerate(xs)})
    return [o.detach() for o in outs], grads, weights


def _assert_oracle(got, eager, ref, what):
    err = (got.double() - ref).abs().max().item()
    base = (eager.double() - ref).abs().max().item()
    assert err <= 2 * base + 1e-6, f"{what}: autopar err {err:.3g} > 2 x eager err {base:.3g}"


class _Capture:
    """aot_autograd backend recording the forward/backward graphs it is given."""

    def __init__(self):
        self.graphs: dict[str, list] = {"fw": [], "bw": []}

    def _compiler(self, tag):
        def compile_fn(gm, example_inputs):
            self.graphs[tag].append(gm)
            return make_boxed_func(gm.forward)

        return compile_fn

    def backend(self):
        return aot_autograd(fw_compiler=self._compiler("fw"), bw_compiler=self._compiler("bw"))

    def targets(self, tag) -> Counter:
        return Counter(
            str(n.target)
            for g in self.graphs[tag]
            for n in g.graph.nodes
            if n.op == "call_function"
        )


CASES = {
    "lstmcell_loop": (lambda: CellLoop("lstm"), 4, True, False),
    "lstmcell_loop_state_unbatched": (lambda: CellLoop("lstm"), 3, False, True),
    "grucell_loop_state": (lambda: CellLoop("gru"), 4, True, True),
    "grucell_loop_nobias_unbatched": (lambda: CellLoop("gru", bias=False), 3, False, False),
    "lstm_1layer": (lambda: RNNNet("lstm"), 5, True, False),
    "lstm_3layer_bidir_bf_state": (
        lambda: RNNNet("lstm", num_layers=3, bidirectional=True, batch_first=True),
        3,
        True,
        True,
    ),
    "lstm_2layer_bidir_dropout_eval": (
        lambda: RNNNet("lstm", num_layers=2, bidirectional=True, dropout=0.4).eval(),
        4,
        True,
        False,
    ),
    "lstm_2layer_dropout_train": (lambda: RNNNet("lstm", num_layers=2, dropout=0.4), 4, True, True),
    "lstm_proj_nobias_unbatched": (
        lambda: RNNNet("lstm", num_layers=2, proj_size=4, bias=False, bidirectional=True),
        3,
        False,
        True,
    ),
    "gru_1layer_bf": (lambda: RNNNet("gru", batch_first=True), 5, True, True),
    "gru_3layer_bidir": (lambda: RNNNet("gru", num_layers=3, bidirectional=True), 3, True, False),
    "gru_2layer_bidir_dropout_train_bf": (
        lambda: RNNNet("gru", num_layers=2, bidirectional=True, dropout=0.3, batch_first=True),
        4,
        True,
        True,
    ),
    "gru_unbatched_state": (lambda: RNNNet("gru", num_layers=2), 3, False, True),
}


@pytest.mark.parametrize("mode", ["eager", "aot"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_rewrite_matches_eager(case, mode):
    make, steps, batched, with_state = CASES[case]
    torch.manual_seed(0)
    net = make()
    net64 = copy.deepcopy(net).double()
    inputs = _inputs(net, steps, batched, with_state)
    # The same seed before each run: dropout masks come from the global RNG in the same
    # order, so train-mode dropout matches eager exactly (also under AOTAutograd).
    ref_out, ref_grads, w = _run(net64, inputs, torch.float64)
    eager_out, eager_grads, _ = _run(net, inputs, torch.float32, w)
    torch._dynamo.reset()
    cap = _Capture()
    with rewrite_rnns(net, rnn_form="unrolled") as names:
        assert names, "no module was rewritten"
        runner = net if mode == "eager" else torch.compile(net, backend=cap.backend())
        got_out, got_grads, _ = _run(runner, inputs, torch.float32, w)
    for k, (a, e, r) in enumerate(zip(got_out, eager_out, ref_out, strict=True)):
        assert a.shape == e.shape, (k, a.shape, e.shape)
        _assert_oracle(a, e, r, f"{case}/{mode} output {k}")
    assert got_grads.keys() == eager_grads.keys()
    for name in got_grads:
        _assert_oracle(got_grads[name], eager_grads[name], ref_grads[name], f"grad {name}")
    if mode == "aot":
        cell = "autopar.lstm_cell" if "lstm" in case else "autopar.gru_cell"
        fw, bw = cap.targets("fw"), cap.targets("bw")
        assert fw[cell + ".default"] > 0 and bw[cell + "_backward.default"] > 0, (fw, bw)
        # No unfused pointwise gate math left over in the captured graphs.
        assert fw["aten.sigmoid.default"] == 0 and bw["aten.sigmoid_backward.default"] == 0
        assert len(cap.graphs["fw"]) == 1, "graph break in the rewritten forward"


# --------------------------------------------------------------------------- the rewrite


def test_parameters_state_dict_and_optimizer_untouched():
    torch.manual_seed(0)
    net = RNNNet("lstm", num_layers=2, bidirectional=True)
    before = {k: (id(v), v.data_ptr()) for k, v in net.state_dict(keep_vars=True).items()}
    class_forward = type(net.rnn).forward
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    snapshot = [p.detach().clone() for p in net.parameters()]
    with rewrite_rnns(net):
        assert "forward" in net.rnn.__dict__
        assert {k: (id(v), v.data_ptr()) for k, v in net.state_dict(keep_vars=True).items()} == (
            before
        )
        out, h, c = net(torch.randn(4, B, IN))
        (out.sum() + h.sum() + c.sum()).backward()
        opt.step()
    after = {k: (id(v), v.data_ptr()) for k, v in net.state_dict(keep_vars=True).items()}
    assert after == before
    assert "forward" not in net.rnn.__dict__ and type(net.rnn).forward is class_forward
    assert all(not torch.equal(p, s) for p, s in zip(net.parameters(), snapshot, strict=True))
    # The optimizer's param group holds the very same Parameter objects.
    assert [id(p) for p in opt.param_groups[0]["params"]] == [id(p) for p in net.parameters()]


def test_context_restores_on_error_and_allows_nesting():
    net = CellLoop("gru")
    with pytest.raises(RuntimeError, match="boom"), rewrite_rnns(net):
        with rewrite_rnns(net) as inner:
            assert inner == []  # the outer context already routes them
        assert all("forward" in c.__dict__ for c in net.cells)
        raise RuntimeError("boom")
    assert all("forward" not in c.__dict__ for c in net.cells)


def test_user_patched_forward_is_not_overridden():
    cell = nn.GRUCell(IN, H)
    cell.forward = lambda x, h=None: x
    with pytest.raises(CaptureError, match="instance attribute 'forward'"), rewrite_rnns(cell):
        pass


def test_packed_sequence_is_rejected_with_a_fix():
    lstm = nn.LSTM(IN, H)
    packed = pack_padded_sequence(torch.randn(4, 2, IN), torch.tensor([4, 2]))
    with pytest.raises(CaptureError, match="pad_packed_sequence"), rewrite_rnns(lstm):
        lstm(packed)


def test_dynamo_traces_without_graph_breaks_or_recompiles():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(IN, IN), nn.GRU(IN, H, num_layers=2))
    x = torch.randn(4, B, IN)
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(net, backend="eager")
    with torch._dynamo.config.patch(error_on_recompile=True):
        for _ in range(3):  # re-entering the context must hit the same compiled code
            with rewrite_rnns(net):
                out, h = compiled(x)
    assert not counters["graph_break"], dict(counters["graph_break"])
    assert counters["stats"]["unique_graphs"] == 1
    with rewrite_rnns(net):
        ref = net(x)
    assert torch.equal(out, ref[0]) and torch.equal(h, ref[1])


def test_rewritten_lstm_hoists_input_projection():
    """One input GEMM per layer and direction over all timesteps, one hgates GEMM per step."""
    torch.manual_seed(0)
    lstm = nn.LSTM(IN, H, num_layers=2)
    cap = _Capture()
    torch._dynamo.reset()
    with rewrite_rnns(lstm, rnn_form="unrolled"):
        torch.compile(lstm, backend=cap.backend())(torch.randn(5, B, IN))
    fw = cap.targets("fw")
    assert fw["aten.addmm.default"] == 2 * (1 + 5)
    assert fw["autopar.lstm_cell.default"] == 2 * 5


def test_f_dropout_is_what_the_rewrite_uses():
    """Documented assumption: ATen's RNN loop uses the same dropout as F.dropout."""
    torch.manual_seed(1)
    a = F.dropout(torch.ones(3, 4), 0.5, True)
    torch.manual_seed(1)
    assert torch.equal(a, torch.dropout(torch.ones(3, 4), 0.5, True))
