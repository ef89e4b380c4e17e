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

from autopar.planning.plan import Plan
from autopar.tools.cli import build_parser, main

SUBCOMMANDS = ["profile", "plan", "bench", "demo"]
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


def test_missing_input_shape_is_a_clear_error(tmp_path):
    with pytest.raises(SystemExit) as exc:
        main(["profile", "autopar.tools.zoo:mlp", "--out", str(tmp_path / "p.json")])
    assert "--input-shape" in str(exc.value.code)


@pytest.mark.parametrize(
    "spec, expected",
    [
        ("autopar.tools.zoo", "expected MODULE:FACTORY"),
        ("no_such_module_xyz:make", "cannot import module 'no_such_module_xyz'"),
        ("autopar.tools.zoo:no_such_factory", "has no callable 'no_such_factory'"),
        ("autopar.tools.zoo:MODELS", "has no callable 'MODELS'"),
    ],
)
def test_bad_model_spec_is_a_clear_error(spec, expected, tmp_path):
    with pytest.raises(SystemExit) as exc:
        main(["profile", spec, "--input-shape", "16,32", "--out", str(tmp_path / "p.json")])
    assert expected in str(exc.value.code)


def test_plan_writes_gantt_and_plan_json(tmp_path, capsys):
    png, plan_json = tmp_path / "x.png", tmp_path / "plan.json"
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
        ]
    )
    assert rc == 0
    out = capsys.readouterr().out
    assert str(png) in out and str(plan_json) in out
    assert png.read_bytes()[:8] == PNG_MAGIC
    plan = Plan.from_json(plan_json.read_text())
    assert plan.order and plan.predicted_step_time > 0


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
