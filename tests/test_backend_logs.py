"""``torch.compile(model, backend="autopar")``, autopar's log, compile progress and the
debug dir's layout (docs/user-guide.md: "torch.compile backend", "Logs and progress",
"Debugging")."""

from __future__ import annotations

import io
import logging
import os
import subprocess
import sys
import textwrap
import warnings

import pytest
import torch
import torch.nn as nn
from oracle import check_training

import autopar
from autopar import logs
from autopar.errors import FallbackWarning
from autopar.profiling.store import ProfileStore


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(8, 16), nn.Linear(16, 2)

    def forward(self, x):
        return self.b(torch.tanh(self.a(x)))


def _mlp() -> MLP:
    torch.manual_seed(0)
    return MLP()


class _Backend(nn.Module):
    """``torch.compile(m, backend="autopar")`` with ``m``'s parameter names (the oracle
    compares gradients by name; torch.compile's module prefixes ``_orig_mod.``)."""

    def __init__(self, model, **options):
        super().__init__()
        object.__setattr__(self, "model", model)
        compiled = torch.compile(model, backend="autopar", dynamic=False, options=options)
        object.__setattr__(self, "compiled", compiled)

    def forward(self, *args):
        return self.compiled(*args)

    def named_parameters(self, *args, **kwargs):
        return self.model.named_parameters(*args, **kwargs)


# -- the backend ------------------------------------------------------------------------------
def test_backend_trains_like_eager_with_its_options():
    store = ProfileStore.memory()
    with warnings.catch_warnings():
        warnings.simplefilter("error", FallbackWarning)
        comp = check_training(
            _mlp(), (torch.randn(4, 8),),
            lambda m: _Backend(m, policy="auto", streams=2, store=store, adapt=False),
            opt_name="adam",
        )  # fmt: skip
    units = autopar.graphs(comp.compiled)
    assert [u.tag for u in units] == ["g0.fw", "g0.bw"]
    assert all(u.executor == "plan" for u in units)
    pipe = autopar.api._pipeline_of(comp.compiled, "graphs")
    assert (pipe.options.streams, pipe.options.policy, pipe.options.store) == (2, "auto", store)
    assert pipe.monitor.options is None  # adapt=False reached the pipeline
    assert pipe.name.startswith("MLP")
    assert "g0.fw" in autopar.explain(comp.compiled).summary()


def test_backend_options_are_checked():
    cm = torch.compile(_mlp(), backend="autopar", options={"policy": "serial", "stream": 2})
    with pytest.raises(Exception, match="unknown options \\['stream'\\]"):
        cm(torch.randn(4, 8))
    with pytest.raises(Exception, match="policy must be one of"):
        torch.compile(_mlp(), backend="autopar", options={"policy": "fastest"})(torch.randn(4, 8))


def test_backend_is_found_before_import_autopar(tmp_path):
    """Dynamo finds backend="autopar" through the torch_dynamo_backends entry point: the
    script never imports autopar itself."""
    from importlib.metadata import entry_points

    env = dict(os.environ, AUTOPAR_INDUCTOR="0")
    if "autopar" not in entry_points(group="torch_dynamo_backends").names:
        # metadata installed before the entry point existed: declare it as pyproject does
        dist = tmp_path / "autopar_ep-0.0.0.dist-info"
        dist.mkdir()
        (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: autopar-ep\nVersion: 0.0.0\n")
        (dist / "entry_points.txt").write_text(
            "[torch_dynamo_backends]\nautopar = autopar.api:autopar_backend\n"
        )
        env["PYTHONPATH"] = os.pathsep.join([str(tmp_path), env.get("PYTHONPATH", "")])
    script = textwrap.dedent(
        """
        import sys, torch
        assert "autopar" not in sys.modules
        m = torch.nn.Linear(4, 2)
        x = torch.randn(3, 4)
        out = torch.compile(m, backend="autopar", options={"race": False, "adapt": False})(x)
        torch.testing.assert_close(out, m(x))
        assert "autopar" in sys.modules
        print("ok", [u.executor for u in sys.modules["autopar"].graphs(m)])
        """
    )
    res = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         env=env, timeout=300, cwd=tmp_path)  # fmt: skip
    assert res.returncode == 0, res.stderr[-2000:]
    # the forward ran on its plan; its backward, traced with it, never ran
    assert "ok ['plan', 'captured']" in res.stdout


# -- logs --------------------------------------------------------------------------------------
def test_logs_show_stages_and_the_recompile_reason():
    before = (logs.log.level, logs.log.propagate, list(logs.log.handlers))
    out = io.StringIO()
    with logs.enabled("info", stream=out):
        cm = autopar.compile(_mlp(), store=ProfileStore.memory(), race=False, adapt=False)
        cm(torch.randn(4, 8)).sum().backward()
        cm(torch.randn(6, 8)).sum().backward()
        bm = torch.compile(_mlp(), backend="autopar", dynamic=False,
                           options={"store": ProfileStore.memory()})  # fmt: skip
        bm(torch.randn(4, 8))
        bm(torch.randn(5, 8))
    assert (logs.log.level, logs.log.propagate, list(logs.log.handlers)) == before
    text = out.getvalue()
    name = cm._autopar_pipeline.name
    assert f"autopar: {name}: compiling (first call)" in text
    assert f"autopar: {name} g0: capture " in text  # Dynamo graph 0 through AOTAutograd
    for stage in ("profile", "plan", "codegen"):
        assert f"autopar: {name} g0.fw: {stage} " in text, stage
    assert f"autopar: {name} g0.bw: plan " in text
    # the new batch size says so, in one line naming the change
    (line,) = [s for s in text.splitlines() if f"{name}: recompiling" in s]
    assert "new input signature ([6, 8] float32" in line
    assert "input 0 shape [4, 8] -> [6, 8]" in line
    assert f"autopar: {name} g1.fw: plan " in text
    # under backend="autopar" the reason is Dynamo's
    (line,) = [s for s in text.splitlines() if "recompiling (Dynamo:" in s]
    assert "size mismatch at index 0. expected 4, actual 5" in line


def test_fallbacks_are_logged_once(monkeypatch):
    from autopar.codegen import emitters

    def broken(*args, **kwargs):
        raise RuntimeError("codegen broke")

    monkeypatch.setattr(emitters, "generate", broken)
    out = io.StringIO()
    with logs.enabled("info", stream=out), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cm = autopar.compile(_mlp(), store=ProfileStore.memory(), race=False, adapt=False)
        x = torch.randn(4, 8)
        torch.testing.assert_close(cm(x), cm._orig_mod(x))
    fallback = [s for s in out.getvalue().splitlines() if "could not plan graph g0.fw" in s]
    assert len(fallback) == 1 and "codegen broke" in fallback[0]
    assert any(issubclass(w.category, FallbackWarning) for w in caught)


def test_autopar_logs_values():
    assert logs.parse("info") == logs.parse("1") == logs.parse("autopar") == logging.INFO
    assert logs.parse("+autopar") == logs.parse("debug") == logging.DEBUG
    assert logs.parse("0") is None and logs.parse("") is None
    with pytest.raises(ValueError, match="AUTOPAR_LOGS"):
        logs.parse("loud")
    import torch._logging._internal as torch_logs

    assert torch_logs.log_registry.is_log("autopar")  # TORCH_LOGS=autopar / +autopar


def test_autopar_logs_env_var_in_a_fresh_process():
    script = "import autopar, logging; logging.getLogger('autopar').info('autopar: hello')"
    env = dict(os.environ, AUTOPAR_LOGS="info")
    env.pop("TORCH_LOGS", None)
    res = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         env=env, timeout=300)  # fmt: skip
    assert res.returncode == 0, res.stderr[-2000:]
    assert "autopar: hello" in res.stderr


# -- progress ----------------------------------------------------------------------------------
def _first_step(**kw):
    cm = autopar.compile(_mlp(), store=ProfileStore.memory(), race=False, adapt=False, **kw)
    cm(torch.randn(4, 8)).sum().backward()
    return cm


def test_progress_is_shown_for_a_slow_compile_on_a_terminal(monkeypatch, capsys):
    monkeypatch.setattr(logs, "stderr_is_tty", lambda: True)
    monkeypatch.setattr(logs, "SLOW_S", 0.0)  # every compile counts as slow
    cm = _first_step()
    err = capsys.readouterr().err
    name = cm._autopar_pipeline.name
    assert f"autopar: {name}: compiling (first call)" in err
    assert f"autopar: {name} g0: capture " in err
    for stage in ("profile", "plan", "codegen"):
        assert f"autopar: {name} g0.fw: {stage} " in err, stage


def test_no_progress_for_fast_compiles_or_without_a_terminal(monkeypatch, capsys):
    monkeypatch.setattr(logs, "stderr_is_tty", lambda: True)
    monkeypatch.setattr(logs, "SLOW_S", 1e9)  # fast
    _first_step()
    assert "autopar:" not in capsys.readouterr().err
    monkeypatch.setattr(logs, "stderr_is_tty", lambda: False)  # CI, a pipe
    monkeypatch.setattr(logs, "SLOW_S", 0.0)
    _first_step()
    assert "autopar:" not in capsys.readouterr().err


# -- the debug dir -------------------------------------------------------------------------------
def test_debug_dir_has_a_folder_per_run_model_and_graph(tmp_path, monkeypatch):
    monkeypatch.setenv("AUTOPAR_DEBUG_DIR", str(tmp_path))
    first, second = _first_step(), _first_step()
    names = [first._autopar_pipeline.name, second._autopar_pipeline.name]
    assert names[0] != names[1] and all(n.startswith("MLP") for n in names)
    (run,) = tmp_path.iterdir()
    assert run.name == f"run-{os.getpid()}-0"
    assert sorted(p.name for p in run.iterdir()) == sorted(names)
    for cm in (first, second):
        d = run / cm._autopar_pipeline.name
        assert sorted(p.name for p in d.iterdir()) == ["g0.bw", "g0.fw"]
        for tag in ("g0.fw", "g0.bw"):
            files = {p.name for p in (d / tag).iterdir()}
            assert {"graph.py", "profile.csv", "plan.json", "program.py", "gantt.png"} <= files
            unit = next(u for u in autopar.graphs(cm) if u.tag == tag)
            assert (d / tag / "program.py").read_text() == unit.program.source


# -- what is not supported says so ------------------------------------------------------------
def test_double_backward_fails_in_one_line_and_retain_graph_works():
    m = _mlp()
    cm = autopar.compile(m, store=ProfileStore.memory(), race=False, adapt=False)
    x = torch.randn(4, 8, requires_grad=True)
    (g,) = torch.autograd.grad(cm(x).sum(), x, create_graph=True)
    with pytest.raises(RuntimeError) as err:
        g.sum().backward()
    assert "\n" not in str(err.value).strip() and "double backward" in str(err.value)
    m.zero_grad(set_to_none=True)
    y = cm(x).sum()
    y.backward(retain_graph=True)
    first = m.a.weight.grad.clone()
    y.backward()
    torch.testing.assert_close(m.a.weight.grad, 2 * first)
