"""autopar.rnn.fuse: nn.LSTMCell / nn.GRUCell time loops become fused layer calls, when safe."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.nn as nn
from oracle import check_training

import autopar
from autopar.errors import FallbackWarning
from autopar.profiling.store import ProfileStore
from autopar.rnn.fuse import fuse_cell_loops
from autopar.rnn.rewrite import rewrite_rnns
from autopar.tools import zoo

pytestmark = pytest.mark.skipif(
    not torch.backends.mkldnn.is_available(), reason="needs oneDNN (mkldnn) on CPU"
)


class Decoder(nn.Module):
    """Feedback: each step's input is computed from the previous step's h (must not fuse)."""

    def __init__(self, d: int = 16, hidden: int = 32, steps: int = 5, gru: bool = False):
        super().__init__()
        self.hidden, self.steps = hidden, steps
        self.cell = (nn.GRUCell if gru else nn.LSTMCell)(d, hidden)
        self.proj = nn.Linear(hidden, d)

    def forward(self, x):  # x: [batch, d]
        h = c = x.new_zeros(x.size(0), self.hidden)
        inp, outs = x, []
        for _ in range(self.steps):
            if isinstance(self.cell, nn.GRUCell):
                h = self.cell(inp, h)
            else:
                h, c = self.cell(inp, (h, c))
            inp = torch.tanh(self.proj(h))
            outs.append(h)
        return torch.stack(outs, dim=1)


class UsesCellState(nn.Module):
    """Reads every intermediate c_t (must not fuse)."""

    def __init__(self, d: int = 16, hidden: int = 32):
        super().__init__()
        self.hidden = hidden
        self.cell = nn.LSTMCell(d, hidden)

    def forward(self, x):  # x: [batch, time, d]
        h = c = x.new_zeros(x.size(0), self.hidden)
        outs = []
        for t in range(x.size(1)):
            h, c = self.cell(x[:, t], (h, c))
            outs.append(h + c)
        return torch.stack(outs, dim=1)


class Seq2Seq(nn.Module):
    """An encoder loop (fusable; no bias, and its final c is used) feeding a Decoder."""

    def __init__(self, d: int = 16, hidden: int = 32):
        super().__init__()
        self.hidden = hidden
        self.enc = nn.LSTMCell(d, hidden, bias=False)
        self.dec = Decoder(d, hidden, steps=3)

    def forward(self, x):
        h = c = x.new_zeros(x.size(0), self.hidden)
        for t in range(x.size(1)):
            h, c = self.enc(x[:, t] * 2.0, (h, c))  # the inputs are not plain x[:, t]
        return self.dec(h[:, :16] + c[:, :16])


def _targets(gm: torch.fx.GraphModule) -> list[str]:
    return [str(n.target) for n in gm.graph.nodes if n.op == "call_function"]


def _count(gm, name: str) -> int:
    return sum(name in t for t in _targets(gm))


def _compile(model):
    return autopar.compile(model, store=ProfileStore.memory())


def _forward_gm(cmodel) -> torch.fx.GraphModule:
    records = cmodel._autopar_pipeline.records
    return next(r.gm for r in records if r.phase == "forward")


def _dynamo_graph(model, *inputs):
    """The Dynamo FX graph of ``model`` (under rewrite_rnns), untouched, and its inputs."""
    seen = []

    def backend(gm, example_inputs):
        seen.append((gm, list(example_inputs)))
        return gm.forward

    torch._dynamo.reset()
    with rewrite_rnns(model):
        torch.compile(model, backend=backend, dynamic=False)(*inputs)
    torch._dynamo.reset()
    return seen[0]


# (cell op, fused forward op, fused backward op) per zoo model
OPS = {
    "lstm_cells": ("autopar.lstm_cell", "mkldnn_rnn_layer", "mkldnn_rnn_layer_backward"),
    "gru_cells": ("autopar.gru_cell", "autopar.gru_layer.", "autopar.gru_layer_backward"),
}


@pytest.mark.parametrize("opt", ["sgd", "adam"])
@pytest.mark.parametrize("name", sorted(OPS))
def test_cell_stack_fuses_and_trains_like_eager(name, opt):
    model, inputs = zoo.build(name)  # a 2-layer cell stack (16 -> 32), x [4, 6, 16]
    with warnings.catch_warnings():
        warnings.simplefilter("error", FallbackWarning)  # the fused graph is planned, not eager
        cmodel = check_training(model, inputs, _compile, opt_name=opt)
    cell, fused, fused_bw = OPS[name]
    fw = _forward_gm(cmodel)
    # One fused layer op per layer (autopar::mkldnn_rnn_layer / autopar::gru_layer).
    assert _count(fw, fused) == 2
    assert _count(fw, cell) == 0
    bw = next(r.gm for r in cmodel._autopar_pipeline.records if r.phase == "backward")
    assert _count(bw, fused_bw) == 2
    assert _count(bw, cell + "_backward") == 0


@pytest.mark.parametrize("name", sorted(OPS))
def test_backend_autopar_fuses_the_cell_loops_dynamo_captured_as_aten_cells(name):
    """Under ``torch.compile(backend="autopar")`` nothing rewrites the cells: Dynamo records
    ``torch.lstm_cell`` / ``torch.gru_cell`` nodes, which ``rnn.cell_nodes`` writes in
    autopar's form and fuses as well; training equals eager by the fp64 oracle."""
    model, inputs = zoo.build(name)
    torch._dynamo.reset()

    def compile_fn(m):
        return torch.compile(m, backend="autopar", dynamic=False,
                             options={"store": ProfileStore.memory()})  # fmt: skip

    with warnings.catch_warnings():
        warnings.simplefilter("error", FallbackWarning)
        cmodel = check_training(model, inputs, compile_fn, opt_name="sgd")
    pipe = autopar.api._pipeline_of(cmodel, "test")
    fw = next(r.gm for r in pipe.records if r.phase == "forward")
    cell, fused, _ = OPS[name]
    assert _count(fw, fused) == 2 and _count(fw, cell) == 0
    assert _count(pipe.capture.dynamo_graphs[0].gm, "_cell") == 0  # no ATen cell left


def test_a_loop_of_aten_cells_that_cannot_fuse_stays_as_dynamo_made_it():
    """``fuse_module_cells`` works on a copy: a loop whose chain is unsafe (its output fed
    back as the next input) keeps Dynamo's ATen cells, not a half-written graph."""
    from autopar.rnn.cell_nodes import fuse_module_cells

    seen = []

    def backend(gm, example_inputs):
        before = gm.code
        seen.append((fuse_module_cells(gm), before == gm.code))
        return gm.forward

    torch._dynamo.reset()
    torch.compile(Decoder(), backend=backend, dynamic=False)(torch.randn(4, 16))
    torch._dynamo.reset()
    assert seen == [(0, True)]


@pytest.mark.parametrize(
    "model",
    [Decoder(), Decoder(gru=True), UsesCellState()],
    ids=["feedback", "gru_feedback", "uses_c_t"],
)
def test_unsafe_loops_stay_unrolled_and_train_like_eager(model):
    x = torch.randn(4, 16) if isinstance(model, Decoder) else torch.randn(4, 5, 16)
    cmodel = check_training(model, (x,), _compile, opt_name="sgd")
    fw = _forward_gm(cmodel)
    assert _count(fw, "mkldnn_rnn_layer") == 0 and _count(fw, "gru_layer") == 0
    cell = "autopar.gru_cell" if isinstance(model.cell, nn.GRUCell) else "autopar.lstm_cell"
    assert _count(fw, cell) == 5


def test_encoder_fuses_but_decoder_does_not():
    torch.manual_seed(0)
    cmodel = check_training(Seq2Seq(), (torch.randn(4, 6, 16),), _compile, opt_name="adam")
    fw = _forward_gm(cmodel)
    assert _count(fw, "mkldnn_rnn_layer") == 1
    assert _count(fw, "autopar.lstm_cell") == 3


def test_keeps_the_users_source_line():
    model, (x,) = zoo.build("lstm_cells")
    gm, _ = _dynamo_graph(model, x)
    assert fuse_cell_loops(gm) == 2
    fused = [n for n in gm.graph.nodes if "fused_lstm_layer" in str(n.target)]
    assert fused and all("zoo.py" in n.meta.get("stack_trace", "") for n in fused)


@pytest.mark.parametrize("chunks", [1, 3])
@pytest.mark.parametrize("name", sorted(OPS))
def test_chunks_match_eager(name, chunks):
    model, (x,) = zoo.build(name)
    eager = copy.deepcopy(model)
    gm, args = _dynamo_graph(model, x)
    assert fuse_cell_loops(gm, chunks=chunks) == 2
    helper = "fused_lstm_layer" if name == "lstm_cells" else "fused_gru_layer"
    assert _count(gm, helper) == 2 * chunks
    assert _count(gm, OPS[name][0]) == 0
    (out,) = gm(*args)
    out.sum().backward()
    ref = eager(x)
    ref.sum().backward()
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    for (name, p), q in zip(model.named_parameters(), eager.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-5, msg=name)


@pytest.mark.parametrize(
    "name, inputs",
    [
        ("mlp", (torch.randn(4, 32),)),
        ("feedback", (torch.randn(4, 16),)),
    ],
)
def test_nothing_to_fuse_leaves_graph_unchanged(name, inputs):
    model = Decoder() if name == "feedback" else zoo.build(name)[0]
    gm, _ = _dynamo_graph(model, *inputs)
    graph, code = gm.graph, gm.code
    assert fuse_cell_loops(gm) == 0
    assert gm.graph is graph and gm.code == code


def test_random_ops_block_fusion():
    class Dropped(zoo.LSTMCellStack):
        def forward(self, x):
            return torch.nn.functional.dropout(super().forward(x), 0.5, self.training)

    model, (x,) = zoo.build("lstm_cells")
    dropped = Dropped(16, 32, 2)
    dropped.load_state_dict(model.state_dict())
    gm, _ = _dynamo_graph(dropped, x)
    assert fuse_cell_loops(gm) == 0  # fusing reorders nodes: RNG draws could move
