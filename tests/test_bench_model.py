"""``autopar bench --model MODULE_OR_FILE:FACTORY``: the user's own model through the bench's
phases, ending with whether autopar is worth it on it; the one loader that ``profile`` and
``plan`` share. Short runs (no Inductor, a few steps): no timing is asserted."""

from __future__ import annotations

import json
import textwrap

import pytest

from autopar.tools import bench_models
from autopar.tools.bench_report import format_verdict
from autopar.tools.cli import main

#: A few steps, no Inductor (its cold compiles take 20-40 s), no long settling.
SHORT = ["--no-inductor", "--steps", "4", "--warmup", "0", "--settle-steps", "2"]


def _bench(tmp_path, capsys, model: str, *extra: str) -> tuple[int, str, dict]:
    out = tmp_path / "bench.json"
    argv = ["bench", "--model", model, *SHORT, "--store", str(tmp_path / "store.json")]
    rc = main([*argv, "--out", str(out), *extra])
    return rc, capsys.readouterr().out, json.loads(out.read_text()) if out.exists() else {}


def _check_verdict(text: str, model: str) -> None:
    verdict = text.split(f"== is autopar worth it on {model}?", 1)[1]
    steady, first, sentence = (line.strip() for line in verdict.strip().splitlines()[:3])
    assert steady.startswith("steady state: autopar ") and " eager " in steady
    assert first.startswith("time to first step: ") and "autopar" in first
    assert sentence.startswith("autopar is ") and "in steady state on this model" in sentence
    # A verdict, or why this short run cannot give one (2 settle steps: the race may be open).
    assert sentence.endswith(("worth it.", "use eager.", "--settle-s.", "--retries 2)."))


def test_bench_module_factory(tmp_path, capsys):
    rc, out, doc = _bench(tmp_path, capsys, "user_models:tiny")
    assert rc == 0, out
    assert doc["meta"]["models"] == ["user_models:tiny"]
    (res,) = doc["results"]
    assert res["input_shapes"] == [[4, 16]] and "MLP from user_models:tiny" in res["description"]
    assert {n: r["error"] for n, r in res["contenders"].items()} == {"eager": None, "autopar": None}
    assert all(r["timed_steps"] == 4 for r in res["contenders"].values())
    _check_verdict(out, "user_models:tiny")


def test_bench_file_factory_outside_the_repository(tmp_path, capsys):
    """A .py file anywhere, importing a neighbour of its own; a forward that returns a tuple
    (the loss sums the MSE of its floating-point tensors)."""
    src = tmp_path / "mine"
    src.mkdir()
    (src / "my_layers.py").write_text(textwrap.dedent("""
        import torch.nn as nn

        class TwoHeads(nn.Module):
            def __init__(self):
                super().__init__()
                self.a, self.b = nn.Linear(8, 4), nn.Linear(8, 2)

            def forward(self, x):
                return self.a(x).relu(), self.b(x), x.argmax(-1)
    """))
    (src / "my_model.py").write_text(textwrap.dedent("""
        import torch
        from my_layers import TwoHeads

        def make():
            return TwoHeads(), torch.randn(6, 8)  # one tensor: the single input
    """))
    rc, out, doc = _bench(tmp_path, capsys, f"{src / 'my_model.py'}:make")
    assert rc == 0, out
    (res,) = doc["results"]
    assert res["model"] == "my_model:make" and res["input_shapes"] == [[6, 8]]
    assert all(r["error"] is None for r in res["contenders"].values()), res["contenders"]
    _check_verdict(out, "my_model:make")


@pytest.mark.parametrize(
    "argv, expected",
    [
        (["--model", "user_models:model_alone"], "needs example inputs"),
        (["--model", "user_models:tiny", "--models", "towers"], "not both"),
        (["--model", "no_such_dir/none.py:make"], "no Python file"),
        (["--model", "user_models:no_such_factory"], "has no callable 'no_such_factory'"),
        (["--model", "user_models"], "expected MODULE:FACTORY or FILE.py:FACTORY"),
    ],
)
def test_bench_model_mistakes_exit_2_in_two_lines(argv, expected, tmp_path, capsys):
    with pytest.raises(SystemExit) as exc:
        main(["bench", *argv, *SHORT, "--out", str(tmp_path / "b.json")])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert expected in err and len(err.strip().splitlines()) == 2, err
    assert not (tmp_path / "b.json").exists()  # refused before any timing


def test_a_model_that_does_not_run_is_refused_up_front(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("import torch\ndef make():\n    return torch.nn.Linear(3, 4), torch.ones(2)\n")
    with pytest.raises(bench_models.UsageError, match="does not run on its example inputs"):
        bench_models.user_model(f"{bad}:make")


def test_plan_takes_the_factory_inputs(tmp_path, capsys):
    """``profile``/``plan`` share the loader: a factory's example inputs stand in for
    --input-shape, and a file path works there too."""
    path = tmp_path / "model_file.py"
    path.write_text("from user_models import tiny as make\n")
    rc = main(["plan", f"{path}:make", "--store", str(tmp_path / "s.json")])
    assert rc == 0
    assert "stream" in capsys.readouterr().out


def _res(autopar_ms: float, interval: tuple[float, float] | None, compile_ms: float | None):
    def row(ms, first, best=None):
        return {"median_step_ms": ms, "first_step_s": first, "error": None,
                "speedup_vs_best": best, "vs_best_interval": interval}  # fmt: skip

    best = min(2.0, compile_ms or 2.0)
    rows = {"eager": row(2.0, 0.01)}
    if compile_ms is not None:
        rows["torch.compile"] = row(compile_ms, 9.0)
    rows["autopar"] = row(autopar_ms, 0.8, best / autopar_ms)
    return {"model": "m", "contenders": rows}


@pytest.mark.parametrize(
    "autopar_ms, interval, compile_ms, sentence",
    [
        (1.6, (1.1, 1.3), 1.8, "1.12x the best of eager and torch.compile in steady state on "
         "this model: worth it."),
        (1.8, (0.97, 1.03), 1.8, "within the noise: not faster than torch.compile here: use "
         "torch.compile."),
        (2.5, (0.7, 0.9), None, "0.80x the best of eager (torch.compile not run) in steady "
         "state on this model: slower than eager: use eager."),
    ],
)  # fmt: skip
def test_verdict_sentence(autopar_ms, interval, compile_ms, sentence):
    text = format_verdict(_res(autopar_ms, interval, compile_ms))
    assert text.splitlines()[-1].endswith(sentence), text
    assert "time to first step: " in text and "90% interval" in text


@pytest.mark.parametrize(
    "extra, reason",
    [({"autopar": {"settled": False}}, "autopar had not settled"),
     ({"autopar": {"settled": True}, "noisy": "machine busy before it: ..."}, "machine busy")],
)  # fmt: skip
def test_no_verdict_from_a_run_that_cannot_tell(extra, reason):
    text = format_verdict({**_res(1.6, (1.1, 1.3), 1.8), **extra})
    assert "but this run cannot tell whether it is worth it: " + reason in text
    assert "worth it." not in text and "use " not in text.splitlines()[-1].split(reason)[0]


def test_verdict_when_autopar_failed():
    res = _res(1.0, None, 1.8)
    res["contenders"]["autopar"]["error"] = "RuntimeError: boom"
    assert format_verdict(res).endswith("autopar failed on this model (RuntimeError: boom): "
                                        "use torch.compile.")  # fmt: skip
