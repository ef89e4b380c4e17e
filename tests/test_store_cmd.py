"""``autopar store show|verify|prune`` on small stores written here (no timing is checked:
re-measurements are faked where a verdict depends on them)."""

from __future__ import annotations

import argparse
import importlib
import json

import pytest
import torch

from autopar.profiling.callspec import NotRebuildable, encode
from autopar.profiling.store import ProfileStore, store_key
from autopar.tools.store_cmd import add_arguments

heal_mod = importlib.import_module("autopar.profiling.heal")
MM = encode("aten.mm.default", (torch.ones(8, 8), torch.ones(8, 8)), {})
CLEAN = {"target": "aten.mm.default", "time_s": 2e-5, "quality": "clean", "call": MM,
         "threads": 1, "samples": 5, "kept": 5, "spread": 0.01, "contention": 0.0}  # fmt: skip
PROV = {**CLEAN, "target": "aten.relu.default", "time_s": 9e-3, "quality": "provisional",
        "call": encode("aten.relu.default", (torch.ones(8, 8),), {}),
        "reason": "5/5 samples disturbed at 2 thread(s)", "contention": 1.0}  # fmt: skip
OLD = {"target": "aten.add.Tensor", "time_s": 1e-6}  # no call description


def _run(argv) -> int:
    parser = argparse.ArgumentParser(prog="autopar")
    add_arguments(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    assert args.parser.prog == f"autopar store {argv[1]}"
    return args.func(args)


@pytest.fixture
def store_dir(tmp_path):
    store = ProfileStore(tmp_path)
    store.put("c" * 16, CLEAN)
    store.put("p" * 16, PROV)
    store.put("o" * 16, OLD)
    store.flush()
    return tmp_path


def test_show_lists_files_keys_and_entries(store_dir, capsys):
    foreign = {"format": "autopar-profile", "version": 2, **store_key(), "torch": "0.1",
               "ops": {"x" * 16: OLD}, "calibration": {}}  # fmt: skip
    (store_dir / "other.json").write_text(json.dumps(foreign))
    assert _run(["store", "show", "--store", str(store_dir)]) == 0
    out = capsys.readouterr().out
    assert "(this process's key)" in out and "torch 0.1" in out and "other.json" in out
    assert "3 entries (1 provisional, 1 without a call description)" in out
    assert out.index("aten.relu.default") < out.index("aten.mm.default")  # by time
    assert "5/5 samples disturbed" in out
    assert (store_dir / "other.json").exists()  # show never moves a file
    assert _run(["store", "show", "--store", str(store_dir), "--json", "--target", "mm"]) == 0
    assert list(json.loads(capsys.readouterr().out.split("\n", 4)[-1])) == ["c" * 16]


def test_show_without_a_store(tmp_path, capsys):
    assert _run(["store", "show", "--store", str(tmp_path / "none")]) == 0
    assert "no profile store" in capsys.readouterr().out


def test_prune_provisional_and_by_signature(store_dir, capsys):
    assert _run(["store", "prune", "--store", str(store_dir), "--provisional", "--dry-run"]) == 0
    assert "would drop 1 of 3" in capsys.readouterr().out
    assert len(ProfileStore(store_dir)) == 3
    assert _run(["store", "prune", "--store", str(store_dir), "--provisional"]) == 0
    assert set(ProfileStore(store_dir)) == {"c" * 16, "o" * 16}
    argv = ["store", "prune", "--store", str(store_dir), "--signature", "o" * 16]
    assert _run(argv + ["--signature", "z" * 16]) == 0
    assert "no entry " + "z" * 16 in capsys.readouterr().out
    assert set(ProfileStore(store_dir)) == {"c" * 16}


def test_prune_needs_a_selector_and_refuses_foreign_files(store_dir, tmp_path, capsys):
    assert _run(["store", "prune", "--store", str(store_dir)]) == 2
    assert "say what to drop" in capsys.readouterr().err
    foreign = tmp_path / "foreign.json"
    doc = {"format": "autopar-profile", "version": 2, **store_key(), "openmp": "libiomp5.so",
           "ops": {"x" * 16: PROV}, "calibration": {}}  # fmt: skip
    foreign.write_text(json.dumps(doc))
    assert _run(["store", "prune", "--store", str(foreign), "--provisional"]) == 2
    assert "another store key" in capsys.readouterr().err
    assert json.loads(foreign.read_text()) == doc  # untouched, not moved aside


def test_verify_flags_fixes_and_skips(store_dir, monkeypatch, capsys):
    slow = {**CLEAN, "time_s": 1e-3}  # the stored entry is 50x too fast

    def retime(record, **kw):
        if "call" not in record:
            raise NotRebuildable("no call description")
        return slow

    monkeypatch.setattr(heal_mod, "retime", retime)
    assert _run(["store", "verify", "--store", str(store_dir), "--target", "mm"]) == 1
    out = capsys.readouterr().out
    assert "off" in out and "50x" in out and "--fix" in out
    assert _run(["store", "verify", "--store", str(store_dir), "--target", "mm", "--fix"]) == 0
    assert ProfileStore(store_dir).get("c" * 16)["time_s"] == 1e-3
    assert _run(["store", "verify", "--store", str(store_dir), "--target", "add"]) == 0
    assert "1 skipped" in capsys.readouterr().out


def test_wired_into_the_autopar_parser(store_dir, capsys):
    """tools/cli.py wires it: ``store_args(sub)`` next to bench and demo."""
    from autopar.tools.cli import build_parser

    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    store = sub.choices["store"]
    nested = next(a for a in store._actions if isinstance(a, argparse._SubParsersAction))
    for p in [store, *nested.choices.values()]:
        terse = [a.dest for a in p._actions if not isinstance(a, argparse._HelpAction)
                 and (not a.help or a.help == argparse.SUPPRESS or len(a.help) < 10)]  # fmt: skip
        assert not terse, (p.prog, terse)
    for argv in (["--debug", "store", "show"], ["store", "show", "--debug"]):
        args = parser.parse_args(argv + ["--store", str(store_dir)])
        assert args.debug and args.func(args) == 0
    assert "aten.mm.default" in capsys.readouterr().out
