"""The ``autopar`` command line: help texts, profile/plan/bench runs, clear errors.

Runs ``autopar.tools.cli.main`` in-process (fast); one test runs
``python -m autopar.tools.cli`` for real.
Every run writes into ``tmp_path`` (never ./profiles or ./results).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

import pytest

from autopar.errors import PlanError
from autopar.planning.plan import Plan
from autopar.tools.cli import build_parser, main

SUBCOMMANDS = ["profile", "plan", "bench", "bench-report", "demo", "store"]
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _subparser(name: str) -> argparse.ArgumentParser:
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices[name]


def test_top_level_help_lists_every_subcommand(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    for name in SUBCOMMANDS:
        assert name in out
    assert "MODULE:FACTORY" in out  # the epilog explains the model argument


def test_module_entry_point_runs():
    proc = subprocess.run(
        [sys.executable, "-m", "autopar.tools.cli", "--help"], capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stderr
    assert "profile" in proc.stdout


@pytest.mark.parametrize("name", SUBCOMMANDS)
def test_subcommand_help_explains_every_option(name, capsys):
    sub = _subparser(name)
    undocumented = [
        a.option_strings or [a.dest]
        for a in sub._actions
        if not isinstance(a, argparse._HelpAction)
        and (not a.help or a.help == argparse.SUPPRESS or len(a.help) < 10)
    ]
    assert not undocumented, f"autopar {name}: options without a useful help text: {undocumented}"
    with pytest.raises(SystemExit) as exc:
        main([name, "--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    for a in sub._actions:
        for opt in a.option_strings:
            assert opt in out, f"autopar {name} --help does not show {opt}"


def test_profile_prints_top_operators_and_writes_the_store(tmp_path, capsys):
    store = tmp_path / "p.json"
    csv = tmp_path / "table.csv"
    rc = main(
        [
            "profile",
            "autopar.tools.zoo:mlp",
            "--input-shape",
            "16,32",
            "--out",
            str(store),
            "--top",
            "5",
            "--csv",
            str(csv),
        ]
    )
    assert rc == 0
    out = capsys.readouterr().out
    assert "aten." in out  # operator names of the top operators
    assert str(store) in out
    doc = json.loads(store.read_text())
    assert doc["format"] == "autopar-profile" and doc["ops"]
    assert csv.exists() and "time_s" in csv.read_text().splitlines()[0]


@pytest.mark.parametrize(
    "shape, expected",
    [("16,x", "comma-separated ints"), ("16,-3", "positive"), ("", "comma-separated ints")],
)
def test_bad_input_shape_is_a_clear_error(shape, expected, capsys):
    with pytest.raises(SystemExit) as exc:
        main(["profile", "autopar.tools.zoo:mlp", "--input-shape", shape])
    assert exc.value.code == 2  # argparse usage error
    err = capsys.readouterr().err
    assert "--input-shape" in err and expected in err


def _usage_error(capsys, argv) -> str:
    """Run a command that must fail as a usage error: exit 2, at most two lines on stderr
    (what was wrong, where to look), no traceback. Returns stderr."""
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert 1 <= len(lines) <= 2, err
    assert "Traceback" not in err
    return err


def test_missing_input_shape_is_a_clear_error(tmp_path, capsys):
    err = _usage_error(
        capsys, ["profile", "autopar.tools.zoo:mlp", "--out", str(tmp_path / "p.json")]
    )
    assert "--input-shape" in err


@pytest.mark.parametrize(
    "spec, expected",
    [
        ("autopar.tools.zoo", "expected MODULE:FACTORY"),
        ("no_such_module_xyz:make", "cannot import module 'no_such_module_xyz'"),
        ("autopar.tools.zoo:no_such_factory", "has no callable 'no_such_factory'"),
        ("autopar.tools.zoo:MODELS", "has no callable 'MODELS'"),
    ],
)
def test_bad_model_spec_is_a_clear_error(spec, expected, tmp_path, capsys):
    argv = ["profile", spec, "--input-shape", "16,32", "--out", str(tmp_path / "p.json")]
    assert expected in _usage_error(capsys, argv)


MLP = ["autopar.tools.zoo:mlp", "--input-shape", "16,32"]


@pytest.mark.parametrize(
    "argv, expected",
    [
        (["profile", "autopar.tools.zoo:mlp", "--input-shape", "8,3"], "does not run on"),
        (["profile", *MLP, "--input-shape", "4"], "does not run on"),  # one input too many
        (["plan", *MLP, "--streams", "0"], "--streams"),
        (["profile", *MLP, "--dtype", "floot32"], "did you mean 'float32'"),
        (["profile", *MLP, "--dtype", "bfloat16"], "float32 parameters"),
        (["profile", *MLP, "--dtype", "int64"], "does not run on"),  # ints into a Linear
        (["plan", *MLP, "--gantt", "nodir/x.png"], "mkdir -p nodir"),
        (["plan", *MLP, "--gantt", "x.txt"], "image extension"),
        (["plan", *MLP, "--json", "nodir/plan.json"], "does not exist"),
        (["plan", *MLP, "--trace", "."], "is a directory"),
        (["profile", *MLP, "--csv", "nodir/t.csv"], "does not exist"),
        (["profile", *MLP, "--top", "-1"], "--top"),
        (["profile", *MLP, "--top", "0"], "--top"),
        (["profile", *MLP, "--out", "notes.txt"], "not a .json store"),
    ],
)
def test_bad_argument_exits_2_with_two_lines(argv, expected, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)  # relative paths land here; nothing may be written at all
    (tmp_path / "notes.txt").write_text("a file where the store would go")
    err = _usage_error(capsys, argv)
    assert expected in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt"]  # failed up front


def test_version(capsys):
    import torch

    import autopar

    with pytest.raises(SystemExit) as exc:
        main(["--version"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith(f"autopar {autopar.__version__}") and torch.__version__ in out


def _failing_plan(exc):
    def plan(*args, **kwargs):
        raise exc

    return plan


@pytest.mark.parametrize(
    "exc, status, expected",
    [
        (PlanError("even the serial plan exceeds the memory budget"), 2, "memory budget"),
        (RuntimeError("boom in a pass"), 1, "RuntimeError: boom in a pass"),
    ],
)
def test_errors_while_running_are_two_lines_unless_debugging(
    exc, status, expected, tmp_path, monkeypatch, capsys
):
    import autopar.api

    monkeypatch.setattr(autopar.api, "plan", _failing_plan(exc))
    monkeypatch.delenv("AUTOPAR_DEBUG", raising=False)
    argv = ["plan", *MLP, "--store", str(tmp_path / "s.json")]
    assert main(argv) == status
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert len(lines) == 2 and expected in lines[0] and "--debug" in lines[1], err
    assert "Traceback" not in err
    for how in (["--debug", *argv], [*argv, "--debug"]):  # before or after the subcommand
        assert main(how) == status
        assert "Traceback" in capsys.readouterr().err
    monkeypatch.setenv("AUTOPAR_DEBUG", "1")
    assert main(argv) == status
    err = capsys.readouterr().err
    assert "Traceback" in err and expected in err


def test_shape_check_leaves_the_model_as_it_was(tmp_path, monkeypatch):
    """The eager forward that checks --input-shape must not change what is profiled."""
    (tmp_path / "bn_models_cli.py").write_text(
        "import torch.nn as nn\n"
        "def make():\n"
        "    return nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Dropout(0.5))\n"
    )
    monkeypatch.chdir(tmp_path)  # the current directory is importable, as documented
    import argparse as ap

    import torch

    from autopar.tools.cli import _model_and_inputs

    args = ap.Namespace(model="bn_models_cli:make", input_shape=[(8, 3)], dtype="float32")
    model, (x,) = _model_and_inputs(args)
    bn = model[1]
    assert torch.equal(bn.running_mean, torch.zeros(4)) and int(bn.num_batches_tracked) == 0
    assert x.shape == (8, 3)
    after = torch.rand(1)  # the check's dropout draws did not move the generator
    torch.manual_seed(0)
    torch.randn(8, 3)
    assert torch.equal(after, torch.rand(1))


def test_plan_writes_gantt_and_plan_json(tmp_path, capsys):
    png, plan_json, trace = tmp_path / "x.png", tmp_path / "plan.json", tmp_path / "t.json"
    rc = main(
        [
            "plan",
            "autopar.tools.zoo:mlp",
            "--input-shape",
            "16,32",
            "--streams",
            "2",
            "--store",
            str(tmp_path / "store.json"),
            "--gantt",
            str(png),
            "--json",
            str(plan_json),
            "--trace",
            str(trace),
        ]
    )
    assert rc == 0
    out = capsys.readouterr().out
    assert str(png) in out and str(plan_json) in out and str(trace) in out
    assert png.read_bytes()[:8] == PNG_MAGIC
    plan = Plan.from_json(plan_json.read_text())
    assert plan.order and plan.predicted_step_time > 0
    events = json.loads(trace.read_text())["traceEvents"]
    assert any(e["ph"] == "X" for e in events)


def test_bench_runs_and_writes_json_and_csv(tmp_path, capsys):
    out_json, out_csv = tmp_path / "r" / "bench.json", tmp_path / "bench.csv"
    rc = main(
        [
            "bench",
            "--models",
            "deep_mlp",
            "--no-inductor",
            "--steps",
            "2",
            "--warmup",
            "0",
            "--store",
            str(tmp_path / "store.json"),
            "--out",
            str(out_json),
            "--csv",
            str(out_csv),
        ]
    )
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "eager/x" in out and "summary" in out and "predicted" in out
    doc = json.loads(out_json.read_text())
    (res,) = doc["results"]
    assert set(res["contenders"]) == {"eager", "autopar"}
    predicted = res["autopar"]["predicted_fwbw_ms"]  # a value reported, not a timing check
    assert predicted > 0
    rows = out_csv.read_text().splitlines()
    assert rows[0].startswith("model,contender") and len(rows) == 3


def test_bench_rejects_unknown_model(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["bench", "--models", "towers,resnet9000"])
    assert exc.value.code == 2
    assert "resnet9000" in capsys.readouterr().err


def test_gpu_check_without_cuda_says_so(capsys):
    """benchmarks/gpu_check.py runs on a lent GPU machine; here it must say why it can't."""
    import importlib.util
    import pathlib

    import torch

    if torch.cuda.is_available():  # pragma: no cover - CI has no GPU
        return
    path = pathlib.Path(__file__).parent.parent / "benchmarks" / "gpu_check.py"
    spec = importlib.util.spec_from_file_location("gpu_check", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    assert mod.main([]) == 0
    assert "no CUDA device" in capsys.readouterr().out
