"""compile_step in one process, and across 2 gloo processes (data and pipeline parallelism).

The 2-process checks start their workers once (``spawn``), run every model and mode in that
one job, and compare against single-process eager training on the full batch with the fp64
oracle (tests/oracle.py). Every multi-process check has a hard deadline and kills its
children, so nothing here can hang.
"""

from __future__ import annotations

import copy
import multiprocessing as mp
import os
import socket
import time

import pytest
import torch
import torch.nn as nn
from oracle import assert_close_to_oracle

from autopar.parallel.distributed import (
    CommModel,
    DistributedError,
    LayerCost,
    build_pipe,
    plan_distributed,
    split_candidates,
)
from autopar.parallel.multigpu import compile_multi_device
from autopar.parallel.step import compile_step
from autopar.tools import zoo

STEPS = 3
CASES = [("mlp", "sgd"), ("inception", "momentum"), ("lstm", "adam")]


# -- shared set-up (parent and workers build the very same models and batches) --------------
def _case(name: str):
    model, (x,) = zoo.build(name, seed=0)
    torch.manual_seed(1)
    with torch.no_grad():
        y = torch.randn_like(model(x))
    return model, x, y


def _opt(kind: str, model: nn.Module):
    if kind == "sgd":
        return torch.optim.SGD(model.parameters(), lr=0.1)
    if kind == "momentum":
        return torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    return torch.optim.Adam(model.parameters(), lr=1e-2)


def _eager(model: nn.Module, x, y, kind: str, steps: int = STEPS, dtype=None):
    """Plain single-process training on the full batch: (losses, state_dict)."""
    model = copy.deepcopy(model)
    if dtype is not None:
        model, x, y = model.to(dtype), x.to(dtype), y.to(dtype)
    opt, losses = _opt(kind, model), []
    for _ in range(steps):
        opt.zero_grad()
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.detach())
    return losses, model.state_dict()


def _assert_trains_like_eager(tag, model, x, y, kind, losses, state, steps=STEPS):
    e_losses, e_state = _eager(model, x, y, kind, steps)
    r_losses, r_state = _eager(model, x, y, kind, steps, torch.float64)
    for i, (g, e, r) in enumerate(zip(losses, e_losses, r_losses, strict=True)):
        assert_close_to_oracle(f"{tag} loss {i}", torch.as_tensor(g), e, r)
    assert set(state) == set(e_state), f"{tag}: state_dict keys differ"
    for k in e_state:
        assert_close_to_oracle(f"{tag} {k}", state[k], e_state[k], r_state[k])


# -- two-process harness --------------------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world: int, port: int, outdir: str, scenario: str) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        WORLD_SIZE=str(world),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world),
        OMP_NUM_THREADS="1",
    )
    torch.set_num_threads(1)
    try:
        res = SCENARIOS[scenario](rank)
    except BaseException as exc:  # noqa: BLE001 - reported to the parent
        res = {"error": f"{type(exc).__name__}: {exc}"}
    torch.save(res, os.path.join(outdir, f"rank{rank}.pt"))
    os._exit(0)  # skip process-group teardown (a dead peer can make it block)


def _run_ranks(
    scenario: str, tmp_path, deadline_s: float, world: int = 2, grace_s: float | None = None
) -> list:
    """Run ``scenario`` on ``world`` spawned ranks; kill whatever is left at the deadline
    (an assertion error), or ``grace_s`` after rank 0 finished (fault scenarios)."""
    ctx = mp.get_context("spawn")
    port = _free_port()
    procs = [
        ctx.Process(target=_worker, args=(r, world, port, str(tmp_path), scenario), daemon=True)
        for r in range(world)
    ]
    for p in procs:
        p.start()
    end = time.monotonic() + deadline_s
    try:
        for i, p in enumerate(procs):
            left = max(end - time.monotonic(), 0.1)
            p.join(left if i == 0 or grace_s is None else min(left, grace_s))
    finally:
        hung = [p.pid for p in procs[: 1 if grace_s is not None else world] if p.is_alive()]
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(5)
    assert not hung, f"scenario {scenario}: processes {hung} still running after {deadline_s}s"
    out = []
    for r in range(world):
        f = tmp_path / f"rank{r}.pt"
        out.append(torch.load(f, weights_only=False) if f.exists() else None)
    return out


def _scenario_train(rank: int) -> dict:
    res: dict = {}
    for name, kind in CASES:
        for mode in ("data", "pipeline"):
            model, x, y = _case(name)
            step = compile_step(
                model, nn.MSELoss(), _opt(kind, model), distributed=mode, timeout=60
            )
            losses = [step(x, target=y) for _ in range(STEPS)]
            res[(name, mode)] = (losses, step.state_dict(), step.summary())
    model, x, y = _case("mlp")
    step = compile_step(model, nn.MSELoss(), _opt("sgd", model), distributed="auto", timeout=60)
    losses = [step(x, target=y) for _ in range(STEPS)]
    res["auto"] = (losses, step.state_dict(), step.summary(), step.mode)
    try:
        compile_step(model, nn.MSELoss(), _opt("sgd", model), distributed="pipeline", stages=3)
    except DistributedError as exc:
        res["stages_error"] = str(exc)
    model, (x,) = zoo.build("lstm_cells")
    step = compile_step(model, nn.MSELoss(), _opt("sgd", model), distributed="pipeline")
    try:
        step(x, target=torch.zeros(4, 6, 32))
    except DistributedError as exc:
        res["unsplittable_error"] = str(exc)
    return res


def _scenario_peer_hangs(rank: int) -> dict:
    model, x, y = _case("mlp")
    step = compile_step(model, nn.MSELoss(), _opt("sgd", model), distributed="data", timeout=3)
    if rank == 1:
        time.sleep(8)  # never joins the collective of the first step
        return {"slept": True}
    t0 = time.monotonic()
    try:
        step(x, target=y)
    except DistributedError as exc:
        return {"error_s": time.monotonic() - t0, "message": str(exc)}
    return {"no_error": True}


def _scenario_peer_dies(rank: int) -> dict:
    model, x, y = _case("mlp")
    step = compile_step(model, nn.MSELoss(), _opt("sgd", model), distributed="data", timeout=20)
    if rank == 1:
        os._exit(3)  # a worker that dies
    t0 = time.monotonic()
    try:
        step(x, target=y)
    except DistributedError as exc:
        return {"error_s": time.monotonic() - t0, "message": str(exc)}
    return {"no_error": True}


SCENARIOS = {
    "train": _scenario_train,
    "peer_hangs": _scenario_peer_hangs,
    "peer_dies": _scenario_peer_dies,
}


# -- the acceptance test ------------------------------------------------------------------
def test_two_ranks_train_like_one_process(tmp_path):
    ranks = _run_ranks("train", tmp_path, deadline_s=200)
    for r, res in enumerate(ranks):
        assert res is not None, f"rank {r} wrote no result"
        assert "error" not in res, f"rank {r}: {res.get('error')}"
    for name, kind in CASES:
        model, x, y = _case(name)
        for mode in ("data", "pipeline"):
            losses0, state0, summary = ranks[0][(name, mode)]
            losses1, state1, _ = ranks[1][(name, mode)]
            assert f"mode={mode}" in summary
            assert [float(v) for v in losses0] == [float(v) for v in losses1], "rank losses"
            for k in state0:  # every rank holds the whole, identical model
                assert torch.equal(state0[k], state1[k]), f"{name}/{mode}: {k} differs by rank"
            assert not any(k.startswith("module.") for k in state0)
            _assert_trains_like_eager(f"{name}/{mode}", model, x, y, kind, losses0, state0)
    losses, state, summary, chosen = ranks[0]["auto"]
    assert chosen in ("data", "pipeline") and "predicted per step" in summary
    assert ranks[1]["auto"][3] == chosen, "ranks chose different modes"
    model, x, y = _case("mlp")
    _assert_trains_like_eager("mlp/auto", model, x, y, "sgd", losses, state)
    assert "--nproc_per_node=3" in ranks[0]["stages_error"]
    for r in ranks:
        assert "distributed='data'" in r["unsplittable_error"]

    # resume in ONE process from the 2-rank data-parallel checkpoint, continue one step
    model, x, y = _case("mlp")
    model.load_state_dict(ranks[0][("mlp", "data")][1])
    step = compile_step(model, nn.MSELoss(), _opt("sgd", model), compile_model=False)
    loss = step(x, target=y)
    base, _, _ = _case("mlp")
    e_losses, e_state = _eager(base, x, y, "sgd", 4)
    r_losses, r_state = _eager(base, x, y, "sgd", 4, torch.float64)
    assert_close_to_oracle("resume loss", loss, e_losses[3], r_losses[3])
    for k, v in step.state_dict().items():
        assert_close_to_oracle(f"resume {k}", v, e_state[k], r_state[k])


@pytest.mark.parametrize("scenario", ["peer_hangs", "peer_dies"])
def test_failed_peer_ends_every_rank_with_a_clear_error(tmp_path, scenario):
    t0 = time.monotonic()
    ranks = _run_ranks(scenario, tmp_path, deadline_s=60, grace_s=1.0)
    res = ranks[0]
    assert res is not None and "message" in res, f"rank 0 did not raise: {res}"
    assert res["error_s"] < 30, f"took {res['error_s']:.1f}s"
    assert "rank 0 of 2" in res["message"] and "timeout=" in res["message"]
    assert time.monotonic() - t0 < 60


# -- one process ----------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["sgd", "adam"])
@pytest.mark.parametrize("compiled", [False, True])
def test_one_process_step_with_overlapped_optimizer(kind, compiled):
    from autopar.profiling.store import ProfileStore

    model, x, y = _case("mlp")
    work = copy.deepcopy(model)
    opts = {"store": ProfileStore.memory()} if compiled else {}
    step = compile_step(work, nn.MSELoss(), _opt(kind, work), compile_model=compiled, **opts)
    losses = [step(x, target=y) for _ in range(STEPS)]
    assert step.mode == "none" and "per parameter" in step.summary()
    assert not losses[0].requires_grad
    _assert_trains_like_eager(f"none/{kind}", model, x, y, kind, losses, step.state_dict())
    # a backward outside step() must not move the parameters
    before = {k: v.clone() for k, v in work.state_dict().items()}
    nn.functional.mse_loss(work(x), y).backward()
    assert all(torch.equal(before[k], v) for k, v in work.state_dict().items())
    step.close()


def test_bad_arguments_say_what_to_change():
    model, x, y = _case("mlp")
    opt = _opt("sgd", model)
    with pytest.raises(ValueError, match="distributed must be one of"):
        compile_step(model, nn.MSELoss(), opt, distributed="tensor")
    with pytest.raises(ValueError, match="schedule"):
        compile_step(model, nn.MSELoss(), opt, schedule="zigzag")
    step = compile_step(model, nn.MSELoss(), opt, distributed="pipeline")
    with pytest.raises(DistributedError, match="nproc_per_node=2"):
        step(x, target=y)


# -- planning and the multi-device code path, without processes ----------------------------
def test_auto_prefers_pipeline_when_allreduce_dominates_and_data_otherwise():
    big = [LayerCost(f"l{i}", {4: 1e-3, 8: 2e-3}, 64, 1024, 64 << 20) for i in range(4)]
    slow_net = CommModel(1e-4, 1e8)  # 64 MiB gradients per layer over 100 MB/s
    p = plan_distributed(big, batch=8, world=2, comm=slow_net)
    assert p.mode == "pipeline" and p.predicted["pipeline"] < p.predicted["data"]
    assert len(p.split_points) == 1 and p.microbatches in (2, 4, 8)
    assert any("bubble" in n for n in p.notes())
    small = [LayerCost(f"l{i}", {4: 1e-3, 8: 2e-3}, 1 << 20, 0, 4096) for i in range(4)]
    p = plan_distributed(small, batch=8, world=2, comm=CommModel(1e-4, 1e9))
    assert p.mode == "data" and "predicted" in p.text()


def test_split_candidates_and_unsplittable_models():
    model, (x,) = zoo.build("inception")
    assert split_candidates(model, (x,)) == ["stem", "blocks.0", "blocks.1", "head"]
    model, (x,) = zoo.build("lstm_cells")
    assert split_candidates(model, (x,)) == []  # cells run in a time loop
    with pytest.raises(DistributedError, match="at most 0 segment"):
        plan_distributed([], batch=4, world=2, comm=CommModel(0, 1e9), mode="pipeline")


def test_multi_device_pipeline_source_and_cpu_run():
    src, fn = compile_multi_device(2, 4)
    for needle in (
        "torch.cuda.stream(s)",
        "non_blocking=True",
        "record_stream",
        "wait_event",
        "wait_stream",
        "for tick in range(5)",
    ):
        assert needle in src, needle
    compile(src, "<generated>", "exec")
    model, x, y = _case("mlp")
    pipe = build_pipe(model, (x[:4],), ["layers.2"])
    stages = [pipe.get_stage_module(j) for j in range(2)]
    loss = fn(stages, ["cpu", "cpu"], [None, None], (x,), y, nn.MSELoss())
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    ref = copy.deepcopy(model)
    ref.zero_grad()
    ref_loss = nn.functional.mse_loss(ref(x), y)
    ref_loss.backward()
    torch.testing.assert_close(loss, ref_loss.detach(), rtol=1e-5, atol=1e-6)
    for n, p in ref.named_parameters():
        torch.testing.assert_close(grads[n], p.grad, rtol=1e-5, atol=1e-6)
