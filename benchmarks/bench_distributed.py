"""Data vs pipeline parallelism vs one process, predicted vs measured.

Run::

    .venv/bin/python benchmarks/bench_distributed.py [--steps 20] [--quick]

For a deep model (a chain of 8 square layers: little to all-reduce per FLOP) and a wide model
(few, very large layers: gradients are big) it measures one training step (forward, loss,
backward, SGD) as

* eager, 1 process x all threads;
* ``compile_step(distributed="none")`` (autopar.compile + overlapped optimizer), 1 process;
* ``compile_step`` with ``"data"``, ``"pipeline"`` and ``"auto"``, 2 processes x 1 thread
  (torchrun, gloo),

and prints a table with the cost model's prediction next to each measurement, then checks
that ``"auto"`` did not pick the mode that measured slower (more than 10% slower).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import torch
import torch.nn as nn

MODELS = {
    # name: (factory, global batch shape)
    "deep": (lambda: _mlp(512, 512, 8), (64, 512)),
    "wide": (lambda: _mlp(256, 2048, 3), (32, 256)),
}


def _mlp(d_in: int, hidden: int, depth: int) -> nn.Module:
    from autopar.tools.zoo import MLP

    return MLP(d_in, hidden, 16, depth)


def _data(name: str):
    factory, shape = MODELS[name]
    torch.manual_seed(0)
    model = factory()
    x = torch.randn(*shape)
    y = torch.randn(shape[0], 16)
    return model, x, y


def _time_steps(fn, steps: int) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _single(name: str, steps: int) -> dict:
    from autopar.parallel.step import compile_step
    from autopar.profiling.store import ProfileStore

    out = {}
    model, x, y = _data(name)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)

    def eager():
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()

    out["eager 1p"] = (None, _time_steps(eager, steps))
    model, x, y = _data(name)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    step = compile_step(model, nn.MSELoss(), opt, store=ProfileStore.memory())
    out["autopar none 1p"] = (None, _time_steps(lambda: step(x, target=y), steps))
    return out


def _worker(name: str, steps: int) -> None:
    """Under torchrun: auto, data, pipeline in one process group; rank 0 prints JSON."""
    from autopar.parallel.step import compile_step

    res = {}
    for mode in ("auto", "data", "pipeline"):
        model, x, y = _data(name)
        opt = torch.optim.SGD(model.parameters(), lr=1e-3)
        step = compile_step(model, nn.MSELoss(), opt, distributed=mode, timeout=300)
        t = _time_steps(lambda step=step, x=x, y=y: step(x, target=y), steps)
        tt = torch.tensor([t])
        torch.distributed.all_reduce(tt, op=torch.distributed.ReduceOp.MAX)
        res[mode] = {"measured": float(tt), "chosen": step.mode, "pred": step.plan.predicted}
    if torch.distributed.get_rank() == 0:
        print("RESULT " + json.dumps(res), flush=True)


def _distributed(name: str, steps: int) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node=2",
        __file__,
        "--worker",
        name,
        "--steps",
        str(steps),
    ]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")), None)
    if line is None:
        raise RuntimeError(f"torchrun failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    res = json.loads(line[len("RESULT ") :])
    pred = res["auto"]["pred"]
    out = {
        "data 2p x 1t": (pred.get("data"), res["data"]["measured"]),
        "pipeline 2p x 1t": (pred.get("pipeline"), res["pipeline"]["measured"]),
        f"auto 2p -> {res['auto']['chosen']}": (
            pred.get(res["auto"]["chosen"]),
            res["auto"]["measured"],
        ),
    }
    out["_chosen"] = res["auto"]["chosen"]
    out["_measured"] = {m: res[m]["measured"] for m in ("data", "pipeline")}
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--quick", action="store_true", help="5 timed steps")
    args = ap.parse_args()
    steps = 5 if args.quick else args.steps
    if args.worker:
        _worker(args.worker, steps)
        return 0
    ok = True
    print(f"{'model':<6} {'configuration':<26} {'predicted ms':>13} {'measured ms':>12}")
    for name in MODELS:
        rows = {**_single(name, steps), **_distributed(name, steps)}
        chosen, measured = rows.pop("_chosen"), rows.pop("_measured")
        for cfg, (pred, meas) in rows.items():
            p = f"{pred * 1e3:13.2f}" if pred is not None else f"{'-':>13}"
            print(f"{name:<6} {cfg:<26} {p} {meas * 1e3:12.2f}")
        best = min(measured, key=measured.get)
        verdict = "ok" if measured[chosen] <= 1.1 * measured[best] else "LOSES"
        ok &= verdict == "ok"
        print(f"{name:<6} auto chose {chosen}; measured best {best}: {verdict}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
