"""``autopar bench``'s table building: the three phases on a tiny model, the columns of the
per-model table, the summary, the CSV and the JSON-able result; the HF models when
``transformers`` is installed. No timing is asserted: only that the values are reported."""

import argparse
import dataclasses
import json

import pytest
import torch

from autopar.tools import bench, bench_models
from autopar.tools.bench_models import BenchModel, make_loss
from autopar.tools.zoo import MLP

HAS_TRANSFORMERS = bench_models.BENCH_MODELS["bert"].available
needs_transformers = pytest.mark.skipif(not HAS_TRANSFORMERS, reason="transformers not installed")

TINY = BenchModel(
    "tiny_mlp",
    "3-layer MLP, 16 -> 32 -> 8",
    lambda: MLP(d_in=16, hidden=32, d_out=8, depth=3),
    ((4, 16),),
)


def _args(tmp_path, *extra: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    argv = ["--no-inductor", "--steps", "2", "--warmup", "0", "--settle-steps", "2"]
    argv += ["--store", str(tmp_path / "store.json"), "--out", "", *extra]
    return bench.resolve_args(parser.parse_args(argv))


def test_bench_model_reports_every_column(tmp_path):
    args = _args(tmp_path)
    res = bench.bench_model(TINY, args, torch.get_num_threads())
    assert set(res["contenders"]) == {"eager", "autopar"}  # --no-inductor: no torch.compile
    for name, row in res["contenders"].items():
        assert row["error"] is None, (name, row["error"])
        assert row["timed_steps"] == 2
        for key in ("median_step_ms", "median_fwbw_ms", "speedup_vs_eager", "speedup_vs_best"):
            assert row[key] is not None, (name, key)
        assert row["first_step_s"] is not None
    a = res["autopar"]
    assert a["ladder"] == ["eager", "plan"]  # --no-inductor: nothing compiles, nothing waits
    assert a["settle_steps"] <= 2 and a["wait_done"]
    assert {g["tag"] for g in a["graphs"]} == {"g0.fw", "g0.bw"}
    assert all(g["executor"] in ("plan", "captured") for g in a["graphs"])
    assert (a["final_s"] is None) == (not a["settled"])  # 2 settle steps: still racing
    # --no-inductor: autopar itself runs its plans, so its monitor checks the cost model
    check = {k: a[k] for k in ("prediction_error_pct", "predicted_fwbw_ms",
                               "plan_measured_fwbw_ms")}  # fmt: skip
    assert None not in check.values(), check  # reported; the values are the benchmark's
    (race,) = a["race"]
    assert set(race) == {"signature", "verdict", "reason"} and race["reason"]
    json.dumps(res)  # what --out writes

    res["machine_before"] = res["machine_after"] = bench.machine_state(torch.get_num_threads())
    probe_fields = {"speedup", "quiet", "load1", "waited_s"}  # the probe's record, not a timing
    assert set(res["machine_before"]) == probe_fields
    table = bench.format_result(res, args)
    assert "machine before: " in table
    for column in ("step ms", "(IQR %)", "fw+bw ms", "eager/x", "best/x", "1st step s"):
        assert column in table
    assert "autopar ladder: eager, plan" in table
    assert "autopar g0.fw" in table and "autopar verdict" in table

    summary = bench.format_summary([res])
    for column in ("eager ms", "torch.compile", "autopar/best", "1st step tc / ap s", "settled"):
        assert column in summary
    assert "tiny_mlp" in summary and "skipped" in summary  # no torch.compile in this run
    assert "vs_best_interval" in res["contenders"]["autopar"]

    path = tmp_path / "r.csv"
    bench.write_csv(str(path), [res])
    header, *rows = path.read_text().splitlines()
    assert header.split(",") == bench.CSV_COLUMNS and len(rows) == 2


def test_cost_model_probe_runs_the_plans_only(tmp_path):
    """With autopar's Inductor executors on, an ``autopar-plans`` contender (``plan`` alone on
    its ladder) runs the planned programs the cost model predicts; never the "best" peer."""
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    args = bench.resolve_args(parser.parse_args(["--store", str(tmp_path / "s.json")]))
    contenders = {c.name: c for c in bench._make_contenders(TINY.make(), args)}
    assert set(contenders) == set(bench.CONTENDERS)
    opts = contenders["autopar-plans"].module._autopar_pipeline.options
    assert opts.executors == ("plan",)
    assert "autopar-plans" in bench.PROBES


def test_mse_and_cross_entropy_losses():
    out = torch.randn(4, 3, 5)
    assert make_loss(TINY, out)(out).ndim == 0
    ce = dataclasses.replace(TINY, loss="ce")
    loss = make_loss(ce, out)(out.requires_grad_())
    loss.backward()
    assert loss.ndim == 0 and out.grad.shape == out.shape


def test_quick_defaults_and_explicit_options(tmp_path):
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    quick = bench.resolve_args(parser.parse_args(["--quick"]))
    assert quick.models == bench.QUICK["models"] and quick.steps == bench.QUICK["steps"]
    full = bench.resolve_args(parser.parse_args(["--quick", "--steps", "7", "--models", "towers"]))
    assert full.models == ["towers"] and full.steps == 7 and full.warmup == bench.QUICK["warmup"]
    opts = bench.autopar_options(_args(tmp_path, "--no-race", "--no-background"))
    assert opts["inductor"] is False and opts["race"] is False and opts["background"] is False


def test_settling_stops_at_its_time_budget(tmp_path):
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    assert bench.resolve_args(parser.parse_args([])).settle_s == bench.DEFAULTS["settle_s"]
    # The race needs more than one step to decide: a budget of 0 s stops before any.
    args = _args(tmp_path, "--settle-steps", "1000", "--settle-s", "0")
    a = bench.bench_model(TINY, args, torch.get_num_threads())["autopar"]
    assert a["settle_steps"] == 0 and not a["settled"]
    with pytest.raises(SystemExit, match="--settle-s"):
        bench.resolve_args(parser.parse_args(["--settle-s", "-1"]))


def test_model_needing_a_missing_package_is_refused(monkeypatch):
    missing = dataclasses.replace(bench_models.BENCH_MODELS["bert"], requires="no_such_pkg_x")
    monkeypatch.setitem(bench_models.BENCH_MODELS, "bert", missing)
    with pytest.raises(argparse.ArgumentTypeError, match=r"bert needs no_such_pkg_x.*autopar\["):
        bench._model_list("towers,bert")
    assert "bert" not in bench_models.default_models()
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    default = bench.resolve_args(parser.parse_args([]))  # the default list says what it left out
    assert "bert" not in default.models and default.skipped["bert"] == "no_such_pkg_x"
    assert bench.resolve_args(parser.parse_args(["--models", "towers"])).skipped == {}


@needs_transformers
@pytest.mark.parametrize("name", ["bert", "gpt2"])
def test_hf_models_build_and_train_one_step(name):
    spec = bench_models.BENCH_MODELS[name]
    torch.manual_seed(0)
    model = spec.make()
    (ids,) = spec.make_inputs()
    assert ids.dtype == torch.int64 and tuple(ids.shape) == spec.input_shapes[0]
    out = model(ids)
    assert out.shape[:-1] == ((8,) if name == "bert" else (8, 64))
    make_loss(spec, out.detach())(out).backward()
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad)


@needs_transformers
@pytest.mark.slow
def test_bench_bert_without_inductor(tmp_path):
    args = _args(tmp_path, "--steps", "1", "--settle-steps", "0")
    res = bench.bench_model(bench_models.BENCH_MODELS["bert"], args, torch.get_num_threads())
    assert all(r["error"] is None for r in res["contenders"].values())
    assert res["autopar"]["graphs"] and "bert" in bench.format_summary([res])


def test_noisy_runs_are_recognised():
    quiet = {"speedup": 1.7, "quiet": True, "load1": 0.3, "waited_s": 0.0}
    busy = dict(quiet, speedup=0.05, quiet=False)
    res = {"contenders": {"eager": {"spread_pct": 8.0}}, "machine_before": quiet,
           "machine_after": quiet}  # fmt: skip
    assert bench.noisy(res) is None
    assert "busy after" in bench.noisy(dict(res, machine_after=busy))
    assert "spread" in bench.noisy({**res, "contenders": {"eager": {"spread_pct": 400.0}}})


def test_blocks_time_all_but_the_first_step_of_each(tmp_path, monkeypatch):
    """``--block 3``: per round, each contender runs 3 steps in a row; the first follows
    another contender's step (its caches) and is not timed; the timed count is --steps."""
    seen: list[tuple[str, bool]] = []
    train = bench._train_step

    def counting(c, inputs, loss_fn):
        seen.append((c.name, c.compile_s is not None))
        return train(c, inputs, loss_fn)

    monkeypatch.setattr(bench, "_train_step", counting)
    args = _args(tmp_path, "--block", "3", "--settle-steps", "0")
    args.steps = 4
    res = bench.bench_model(TINY, args, torch.get_num_threads())
    eager = [name for name, _ in seen if name == "eager"]
    assert len(eager) == 1 + 2 * 3  # the first step, then 2 rounds of 3
    names = [name for name, after_first in seen if after_first]
    runs = [names[i : i + 3] for i in range(0, len(names), 3)]
    assert all(len(set(r)) == 1 for r in runs)  # a block is one contender's
    assert all(row["timed_steps"] == 4 for row in res["contenders"].values())


def test_bench_processes_summarizes_runs_from_their_json():
    """benchmarks/bench_processes.py: each fresh process's ratio, then the median across
    them (the JSON shape is what ``autopar bench --out`` writes)."""
    import importlib.util
    import pathlib

    path = pathlib.Path(__file__).parent.parent / "benchmarks" / "bench_processes.py"
    spec = importlib.util.spec_from_file_location("bench_processes", path)
    bp = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bp)

    def result(eager, tc, ap, verdict):
        cs = {n: {"median_step_ms": v, "error": None}
              for n, v in (("eager", eager), ("torch.compile", tc), ("autopar", ap))}  # fmt: skip
        cs["autopar"]["speedup_vs_best"] = min(eager, tc) / ap  # as the bench writes it
        return {"model": "towers", "contenders": cs,
                "autopar": {"race": [{"verdict": verdict}]}}  # fmt: skip

    runs = [[result(4.0, 4.4, 3.2, "compiled")], [result(6.0, 6.6, 4.0, "compiled")],
            [result(4.0, 3.9, 3.9, "eager")]]  # fmt: skip
    text = bp.summarize(runs)
    assert "== towers: 3 processes" in text
    assert "1.25x  compiled" in text and "1.50x  compiled" in text and "1.00x  eager" in text
    assert "median autopar/best 1.25x (range 1.00-1.50x)" in text
