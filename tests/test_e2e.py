"""End-to-end: every zoo family compiled with autopar trains like eager (fp64 oracle)."""

from __future__ import annotations

import copy
import os
import warnings

import pytest
import torch
from oracle import check_training

import autopar
from autopar.errors import CaptureError, FallbackWarning
from autopar.profiling.store import ProfileStore
from autopar.tools import zoo

FAMILIES = [
    "mlp",
    "inception",
    "lstm_cells",
    "gru_cells",
    "lstm",
    "gru",
    "bilstm",
    "transformer",
    "inplace_views",
    "graph_break",
]


def _compile(streams, policy="auto"):
    store = ProfileStore.memory()
    return lambda m: autopar.compile(m, streams=streams, policy=policy, store=store)


@pytest.mark.parametrize("name", FAMILIES)
@pytest.mark.parametrize("opt", ["sgd", "adam"])
def test_family_trains_like_eager(name, opt):
    model, inputs = zoo.build(name)
    with warnings.catch_warnings():
        warnings.simplefilter("error", FallbackWarning)  # no silent eager fallback here
        check_training(model, inputs, _compile(None), opt_name=opt)


@pytest.mark.parametrize("streams", [1, 2, 4])
@pytest.mark.parametrize("name", ["inception", "towers", "lstm_cells", "transformer"])
def test_streams_equivalence(name, streams):
    model, inputs = zoo.build(name)
    if name == "towers":
        inputs = (torch.randn(8, 64),)
    policy = "serial" if streams == 1 else "heft"
    check_training(model, inputs, _compile(streams, policy), opt_name="sgd")


def test_dropout_matches_eager_with_same_seed():
    model, (x,) = zoo.build("dropout")
    eager, comp = copy.deepcopy(model), _compile(2)(copy.deepcopy(model))
    for _ in range(2):  # the second call runs the generated program, not the profiler
        torch.manual_seed(7)
        ye = eager(x)
        ye.sum().backward()
        torch.manual_seed(7)
        yc = comp(x)
        yc.sum().backward()
        torch.testing.assert_close(yc, ye, rtol=1e-5, atol=1e-6)
    for pe, pc in zip(eager.parameters(), comp.parameters(), strict=True):
        torch.testing.assert_close(pc.grad, pe.grad, rtol=1e-5, atol=1e-6)


def test_same_parameters_and_state_dict():
    model, (x,) = zoo.build("mlp")
    cmodel = autopar.compile(model, store=ProfileStore.memory())
    assert list(cmodel.state_dict()) == list(model.state_dict())
    assert all(a is b for a, b in zip(cmodel.parameters(), model.parameters(), strict=True))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)  # the user's optimizer, built on model
    before = [p.detach().clone() for p in model.parameters()]
    cmodel(x).sum().backward()
    opt.step()
    assert any(not torch.equal(b, p) for b, p in zip(before, model.parameters(), strict=True))


def test_rnn_state_dict_untouched():
    model, (x,) = zoo.build("lstm")
    keys = list(model.state_dict())
    ids = [id(p) for p in model.parameters()]
    cmodel = autopar.compile(model, store=ProfileStore.memory())
    cmodel(x).sum().backward()
    assert list(model.state_dict()) == keys
    assert [id(p) for p in model.parameters()] == ids
    assert "forward" not in vars(model.rnn)  # the rewrite is gone after the call


def test_errors_are_clear():
    with pytest.raises(CaptureError, match="expects a torch.nn.Module"):
        autopar.compile(lambda x: x)
    model, (x,) = zoo.build("mlp")
    cmodel = autopar.compile(model, store=ProfileStore.memory())
    with pytest.raises(CaptureError, match="cannot take these inputs"):
        cmodel(x, x)
    with pytest.raises(CaptureError, match="dtype torch.float64"):
        cmodel(x.double())
    with pytest.raises(ValueError, match="policy must be one of"):
        autopar.compile(model, policy="fastest")


def test_explain_shows_programs():
    model, (x,) = zoo.build("inception")
    cmodel = autopar.compile(model, streams=2, store=ProfileStore.memory())
    assert "nothing compiled yet" in autopar.explain(cmodel)
    cmodel(x).sum().backward()
    text = autopar.explain(cmodel)
    assert "g0.fw" in text and "g0.bw" in text


def test_profile_and_plan_api():
    model, (x,) = zoo.build("inception")
    table = autopar.profile(model, x, store=ProfileStore.memory())
    assert set(table["phase"]) == {"forward", "backward"}
    assert {"time_s", "flops", "bytes_read", "is_view", "inputs"} <= set(table.columns)
    assert all(p.grad is None for p in model.parameters())  # profiling leaves grads alone
    p = autopar.plan(model, x, streams=2, store=ProfileStore.memory())
    assert p.predicted_step_time <= p.serial_time * 1.0001
    assert len(p.to_dataframe()) == len(p.order)


def test_plan_failure_falls_back_once_without_repeating_side_effects():
    """A graph that cannot be planned (impossible memory budget) runs as captured after one
    FallbackWarning; the profiling run's BatchNorm update is not applied twice."""
    model, (x,) = zoo.build("inplace_views")
    eager = copy.deepcopy(model)
    cmodel = autopar.compile(model, memory_budget=1, store=ProfileStore.memory())
    with pytest.warns(FallbackWarning, match="could not plan graph g0.fw"):
        yc = cmodel(x)
    ye = eager(x)
    torch.testing.assert_close(yc, ye)
    torch.testing.assert_close(model.bn.running_mean, eager.bn.running_mean)
    assert model.bn.num_batches_tracked.item() == 1


def test_debug_dir_holds_graph_profile_plan_program_and_gantt(tmp_path, monkeypatch):
    monkeypatch.setenv("AUTOPAR_DEBUG_DIR", str(tmp_path))
    model, (x,) = zoo.build("mlp")
    cmodel = autopar.compile(model, streams=2, store=ProfileStore.memory())
    cmodel(x).sum().backward()
    # per process and per compiled model, like Inductor's debug dir
    (run,) = tmp_path.glob(f"run-{os.getpid()}-*")
    model_dir = run / cmodel._autopar_pipeline.name
    for tag in ("g0.fw", "g0.bw"):
        files = {p.name for p in (model_dir / tag).iterdir()}
        assert {"graph.py", "profile.csv", "plan.json", "program.py", "gantt.png"} <= files
        program = (model_dir / tag / "program.py").read_text()
        assert program == next(
            r.program.source for r in cmodel._autopar_pipeline.records if r.tag == tag
        )
