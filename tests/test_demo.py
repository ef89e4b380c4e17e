"""``autopar demo``: every model trains a few tiny steps, the losses agree, the final screen
names the chosen executor of every graph and every promised file is written; the decisions
are read from the graphs' provenance; ``autopar bench-report`` rewrites README's table."""

from __future__ import annotations

import json
import re
from types import SimpleNamespace

import pytest
import torch

import autopar.tools.demo as demo
from autopar.tools.bench_report import README_BEGIN, README_END, readme_table, update_readme
from autopar.tools.cli import main
from autopar.tools.demo_models import (
    VOCAB,
    CharLM,
    bert_available,
    compare_curves,
    load_corpus,
    make_batches,
)
from autopar.tools.demo_report import final_screen, graph_decisions


def _run(tmp_path, capsys, *extra) -> tuple[int, str]:
    out = tmp_path / "demo"
    rc = main(["demo", "--tiny", "--no-progress", "--streams", "2", "--out", str(out),
               "--store", str(tmp_path / "store.json"), *extra])  # fmt: skip
    return rc, capsys.readouterr().out


@pytest.mark.parametrize("model", ["charlstm", "towers", "bert"])
def test_each_model_trains_and_the_final_screen_names_every_graphs_executor(
    model, tmp_path, capsys
):
    if model == "bert" and not bert_available():
        pytest.skip("transformers is not installed")
    rc, text = _run(tmp_path, capsys, "--model", model)
    assert rc == 0, text  # 0: the eager and autopar loss curves agree
    screen = text[text.index("what the compiler decided") :]
    tags = re.findall(r"^(g\d+\.(?:fw|bw)) \(", screen, flags=re.M)
    assert tags and {"g0.fw", "g0.bw"} <= set(tags), screen
    assert "executor ladder: eager, plan" in screen and "g0: the ladder" in screen
    for tag in tags:  # each graph: what runs it, the reason, prediction vs measurement
        block = screen[screen.index(f"{tag} (") :]
        assert re.match(rf"{re.escape(tag)} \(\w+, \d+ ops\)\s+runs: (PLAN|INDUCTOR|CAPTURED)",
                        block), block  # fmt: skip
        for word in ("why", "predicted", "measured"):
            assert word in block.split("\n\n")[0], (tag, word)
    assert "AGREE" in screen and "step time" in screen
    out = tmp_path / "demo"
    for name in ("timeline.png", "trace.json", "loss.png", "step_times.png", "program.py"):
        assert (out / name).stat().st_size > 0, name
        assert str(out / name) in screen, name  # the final screen names every file
    trace = json.loads((out / "trace.json").read_text())
    procs = [e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "process_name"]
    assert any(p.startswith("predicted: g0.fw") for p in procs), procs
    assert any(p.startswith("measured: g0.fw") for p in procs), procs
    flat = " ".join(screen.split())  # the screen wraps its lines
    assert "torch.compile not timed (add --torch-compile" in flat  # and how to include it


def test_bert_without_transformers_is_one_line_and_exit_2(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(demo, "bert_available", lambda: False)
    rc = main(["demo", "--model", "bert", "--tiny", "--out", str(tmp_path)])
    err = capsys.readouterr().err
    assert rc == 2
    assert len(err.strip().splitlines()) == 1 and "pip install transformers" in err


def test_corpus_is_deterministic_ascii_stdlib_source():
    a, files, root = load_corpus(8)
    b, _, _ = load_corpus(8)
    assert torch.equal(a, b) and len(a) == 8 * 1024
    assert files == sorted(files) and all(f.endswith(".py") for f in files)
    assert int(a.max()) < VOCAB and root


def test_batches_are_shifted_windows_and_reproducible():
    data = torch.arange(100) % VOCAB
    (x, y), *_ = make_batches(data, 3, batch=2, seq_len=5, seed=1)
    assert x.shape == y.shape == (2, 5)
    assert torch.equal(x[:, 1:], y[:, :-1])
    (x2, _), *_ = make_batches(data, 3, batch=2, seq_len=5, seed=1)
    assert torch.equal(x, x2)


def test_cell_and_lstm_models_give_logits_over_the_vocabulary():
    x = torch.randint(0, VOCAB, (3, 7))
    for cell in (False, True):
        assert CharLM(hidden=8, layers=2, emb=4, cell=cell)(x).shape == (3, 7, VOCAB)


def test_compare_curves_allows_growing_rounding_drift_but_not_a_different_start():
    same_start = [3.0] * 10 + [2.0] * 30
    drifted = [3.0] * 10 + [2.0 + 0.01 * (-1) ** i for i in range(30)]
    assert compare_curves(same_start, drifted, tol=0.05)[0]
    assert not compare_curves(same_start, [x + 0.01 for x in same_start], tol=0.05)[0]
    assert not compare_curves(same_start, [3.0] * 10 + [2.2] * 30, tol=0.05)[0]


# -- the final screen, from an explanation made here ---------------------------------------
def _unit(tag, executor, stamps, policy="serial"):
    placements = (("a", 0), ("b", 1 if policy != "serial" else 0))
    plan = SimpleNamespace(policy=policy, predicted_step_time=2e-3, serial_time=3e-3,
                           placements=placements)  # fmt: skip
    gm = SimpleNamespace(graph=SimpleNamespace(nodes=[SimpleNamespace(op="call_function")] * 3))
    prov = tuple(SimpleNamespace(stage=s, seconds=1.0, note=n) for s, n in stamps)
    return SimpleNamespace(tag=tag, phase="forward", gm=gm, plan=plan, provenance=prov,
                           executor=executor, fallback=None)  # fmt: skip


def test_decisions_name_the_ladder_the_verdict_and_each_graphs_executor():
    verdict = "median step inductor 1.00 ms, plan 2.50 ms over 8 rounds -> inductor"
    ex = SimpleNamespace(
        graphs=(_unit("g0.fw", "inductor", [("verdict", verdict)], "heft"),
                _unit("g0.bw", "plan", [])),
        steps={"([4, 8] float32; train)": ("inductor", verdict)},
        rungs={"g0": {"eager": "racing", "plan": "racing",
                      "inductor": "built (compiled here in 1.2 s); racing",
                      "split": "not offered: an inference graph"}},
        ladder=("eager", "plan", "inductor", "split"), events=(), compile_seconds=1.5,
        graph_breaks=0,
    )  # fmt: skip
    fw, bw = graph_decisions(ex, None)
    assert fw.chosen == "inductor" and "-> inductor" in fw.why
    assert bw.chosen == "plan (serial on 1 stream)" and "predicted serial" in bw.why
    info = {"model": "m", "agree": True, "agreement": "ok", "window": "steps 2-3", "out": "o",
            "times": {"eager": (2.0, 2), "autopar": (1.0, 2)}, "files": {"loss plot": "o/l"}}
    screen = final_screen(ex, [fw, bw], info)
    assert "runs: INDUCTOR" in screen and "runs: PLAN" in screen
    assert "executor ladder: eager, plan, inductor, split" in screen
    assert "not offered: an inference graph" in screen
    assert "autopar 1.00 ms, 2.00x eager" in screen


# -- README's results table ------------------------------------------------------------------------
def _bench_doc():
    c = {"median_step_ms": 10.0, "speedup_vs_eager": 1.0, "speedup_vs_best": 1.0,
         "first_step_s": 0.1, "error": None}  # fmt: skip
    return {
        "meta": {"time": "2026-11-30 09:12:53", "platform": "Linux-6.1-x86_64-with-glibc2.36",
                 "cpu_count": 2, "torch": "2.13.0+cpu", "python": "3.11.7", "steps": 20,
                 "warmup": 3, "optimizer": "sgd", "intra_op_threads": 2,
                 "inductor_cache": "fresh"},
        "results": [{
            "model": "towers", "description": "multi-tower MLP: 4 towers", "wall_s": 60.0,
            "machine_before": {"load1": 1.25}, "machine_after": {"load1": 2.5}, "noisy": None,
            "contenders": {"eager": c, "autopar": {**c, "speedup_vs_eager": 1.5}},
            "autopar": {"graphs": [{"executor": "inductor"}, {"executor": "plan"},
                                   {"executor": "plan", "native": True}],
                        "race": [{"verdict": "compiled"}]},
        }],
    }  # fmt: skip


def test_readme_table_says_when_where_and_the_first_minute():
    table = readme_table(_bench_doc(), "b.json")
    assert "2026-11-30" in table and "load average before each model 1.25" in table
    row = next(line for line in table.splitlines() if line.startswith("| multi-tower"))
    assert "| 1.50x |" in row and "| - |" in row  # no torch.compile
    fm = [{"model": "towers", "seconds": 60,
           "cold": {"eager": {"steps": 100}, "torch.compile": {"steps": 50},
                    "autopar": {"steps": 110}},
           "warm": {"eager": {"steps": 100}, "torch.compile": {"steps": 120},
                    "autopar": {"steps": 114}}}]  # fmt: skip
    table = readme_table(_bench_doc(), "b.json", fm)
    row = next(line for line in table.splitlines() if line.startswith("| multi-tower"))
    assert row.endswith("| 1.10x / 0.95x |") and "First minute:" in table


def test_bench_report_rewrites_only_the_marked_section(tmp_path, capsys):
    readme, js = tmp_path / "README.md", tmp_path / "bench.json"
    js.write_text(json.dumps(_bench_doc()))
    readme.write_text(f"intro\n{README_BEGIN}\nold table\n{README_END}\noutro\n")
    assert main(["bench-report", str(js), "--readme", str(readme), "--check"]) == 1
    assert main(["bench-report", str(js), "--readme", str(readme)]) == 0
    text = readme.read_text()
    assert text.startswith("intro\n") and text.endswith(f"{README_END}\noutro\n")
    assert "old table" not in text and "multi-tower MLP (`towers`)" in text
    assert not update_readme(str(readme), _bench_doc(), str(js))  # idempotent
    assert main(["bench-report", str(js), "--readme", str(readme), "--check"]) == 0
    readme.write_text("no markers\n")
    with pytest.raises(SystemExit) as exc:  # a usage error: exit 2, one line
        main(["bench-report", str(js), "--readme", str(readme)])
    assert exc.value.code == 2 and "has no section between" in capsys.readouterr().err
