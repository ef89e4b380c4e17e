"""What a user adopting autopar meets first: where the profile store goes, one name for it on
every command, and what the package and the repository ship (licence, type information, the
torch it admits, set-up that installs only what each command needs)."""

from __future__ import annotations

import argparse
import os
import pathlib
import shutil
import subprocess
import sys

import pytest
import torch

from autopar.profiling.store import ProfileStore, default_dir
from autopar.tools.cli import build_parser, main

ROOT = pathlib.Path(__file__).resolve().parents[1]


# -- the profile store's place -------------------------------------------------------------------
def test_store_goes_to_the_users_cache_unless_told(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.delenv("AUTOPAR_PROFILE_DIR", raising=False)
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    assert default_dir() == str(tmp_path / "home" / ".cache" / "autopar" / "profiles")
    monkeypatch.setenv("XDG_CACHE_HOME", "relative/cache")  # not absolute: ignored (XDG spec)
    assert default_dir() == str(tmp_path / "home" / ".cache" / "autopar" / "profiles")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert default_dir() == str(tmp_path / "xdg" / "autopar" / "profiles")
    monkeypatch.setenv("AUTOPAR_PROFILE_DIR", str(tmp_path / "mine"))
    assert default_dir() == str(tmp_path / "mine")
    store = ProfileStore()
    assert os.path.dirname(store.path) == str(tmp_path / "mine")


def test_the_suite_never_writes_the_users_store():
    """tests/conftest.py points the default store at a directory of the session's own."""
    here = default_dir()
    assert here == os.environ["AUTOPAR_PROFILE_DIR"]
    assert not here.startswith(os.path.expanduser("~")) and not here.startswith(str(ROOT))


# -- one name per thing on the command line ------------------------------------------------------
def _subparsers() -> dict[str, argparse.ArgumentParser]:
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    found = {}
    for name, p in sub.choices.items():
        found[name] = p
        for a in p._actions:  # autopar store show|verify|prune
            if isinstance(a, argparse._SubParsersAction):
                found.update({f"{name} {n}": q for n, q in a.choices.items()})
    return found


@pytest.mark.parametrize(
    "command", ["profile", "plan", "bench", "demo", "store show", "store verify", "store prune"]
)
def test_every_command_calls_the_store_store(command):
    p = _subparsers()[command]
    store = [a for a in p._actions if a.dest == "store"]
    assert [a.option_strings for a in store] == [["--store"]]
    assert "~/.cache/autopar/profiles" in store[0].help


def test_profile_out_is_the_former_name_of_store(tmp_path, capsys):
    path = tmp_path / "p.json"
    with pytest.warns(FutureWarning, match="--out is the former name of --store"):
        rc = main(["profile", "autopar.tools.zoo:mlp", "--input-shape", "16,32", "--out",
                   str(path)])  # fmt: skip
    assert rc == 0 and path.exists() and str(path) in capsys.readouterr().out
    help_text = _subparsers()["profile"].format_help()
    assert "--out" not in help_text  # not offered any more


def test_profile_takes_a_file_factory_and_its_inputs(tmp_path, capsys):
    factory = tmp_path / "net.py"
    factory.write_text(
        "import torch\n"
        "def make():\n"
        "    return torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh()), torch.ones(4, 8)\n"
    )
    rc = main(["profile", f"{factory}:make", "--store", str(tmp_path / "s.json"), "--top", "3"])
    assert rc == 0 and "aten." in capsys.readouterr().out


# -- what the package and the repository ship ------------------------------------------------------
def test_licence_and_type_information_ship():
    licence = (ROOT / "LICENSE").read_text()
    assert "Apache License" in licence and "Version 2.0, January 2004" in licence
    assert "END OF TERMS AND CONDITIONS" in licence  # the full text, not a notice
    assert (ROOT / "src" / "autopar" / "py.typed").exists()
    pyproject = (ROOT / "pyproject.toml").read_text()
    assert '"py.typed"' in pyproject and 'license = { text = "Apache-2.0" }' in pyproject


def test_torch_range_is_the_tested_release():
    tomllib = pytest.importorskip("tomllib")
    doc = tomllib.loads((ROOT / "pyproject.toml").read_text())
    (req,) = [d for d in doc["project"]["dependencies"] if d.startswith("torch")]
    assert req == "torch>=2.13,<2.14"
    assert torch.__version__.startswith("2.13."), "the suite runs on the tested release"


def test_changelog_names_this_version():
    import autopar

    text = (ROOT / "CHANGELOG.md").read_text()
    assert "## Unreleased" in text and f"## {autopar.__version__}" in text


@pytest.mark.skipif(shutil.which("make") is None, reason="make is not installed")
def test_demo_setup_leaves_the_test_extras_out():
    """``make demo`` installs autopar alone; ``make test`` and ``make lint`` add ``[dev]``
    (triton alone is about 1 GB). ``make -n`` only prints what it would run."""

    def plan(target: str) -> str:
        proc = subprocess.run(["make", "-n", "-B", target], cwd=ROOT, capture_output=True,
                              text=True, check=True)  # fmt: skip
        return proc.stdout

    assert "AUTOPAR_EXTRAS" not in plan("demo") and "bash scripts/setup.sh" in plan("demo")
    for target in ("test", "lint"):
        assert "AUTOPAR_EXTRAS=dev bash scripts/setup.sh" in plan(target)


def test_ci_lints_before_the_readme_test_command():
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    assert ci.index("make lint") < ci.index("make test")
    assert "make test" in (ROOT / "README.md").read_text()


def test_quickstart_example_runs_and_is_what_the_readme_shows():
    """examples/quickstart.py, in a fresh interpreter as a user runs it (the suite's settings:
    the ladder eager, plan; the session's store); the README shows its training loop."""
    script = ROOT / "examples" / "quickstart.py"
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                          timeout=300, cwd=ROOT)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    loss, summary = proc.stdout.split("step 29: loss ", 1)[1].split("\n", 1)
    assert float(loss) > 0 and summary.strip()  # explain's summary follows
    source, readme = script.read_text(), (ROOT / "README.md").read_text()
    for line in ("cmodel = autopar.compile(model)", "cross_entropy(cmodel(x), y)",
                 "print(autopar.explain(cmodel))"):  # fmt: skip
        assert line in source and line in readme, line
