"""Cost-model accuracy: the predicted time of autopar's planned programs against their measured
time, with the profile taken on a quiet machine and under CPU hogs.

Run::

    .venv/bin/python benchmarks/cost_model_accuracy.py [--models inception,towers] \\
        [--hogs 0,1,2] [--steps 30] [--reuse] [--out results/cost-model.json]

For each model and each hog count ``H`` (``H`` busy-loop processes, ``python -c "while True:
pass"``, run while the model's first training step profiles it; killed right after):

1. a fresh in-memory profile store; ``autopar.compile(model, inductor=False, race=False,
   adapt=AdaptOptions(max_replans=0))``: the planned programs always run, and the monitor
   times every graph call without ever re-profiling (so what is measured is the first call's
   profile and the store's first-call healing, nothing later);
2. the first step (capture, profile under the hogs, heal, plan), then the hogs are killed and
   the script waits until ``quiet-check`` says the machine is quiet;
3. ``--steps`` training steps; per step, the sum over graphs of the measured program times
   and of the predictions (``autopar.stats(per="graph")``, rows run by the planned program),
   compared as ``autopar bench`` does (``autopar.tools.bench_settle.cost_model_check``).

With ``--reuse`` the profile is the first step of one compile, into a store on disk, and is
then *used* by a second compile of a fresh copy of the model, after the hogs are gone and
the machine is quiet (what a user meets: the store filled on a busy box, read on a quiet
one). The second compile's first call re-measures the entries the first marked provisional
and heals the ones its measured serial time contradicts; its ``--steps`` steps are then
measured as above.

The error of a model is ``predicted / measured - 1`` at the median over those steps (+:
predicted too slow). The summary gives the median absolute error over the models per hog count.
The machine's state (load average, the OpenMP probe) is printed before every model.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import warnings

import torch

import autopar
from autopar.profiling.store import ProfileStore
from autopar.tools.bench_models import BENCH_MODELS, default_models, make_loss
from autopar.tools.bench_settle import cost_model_check

QUIET_CHECK = os.path.join(os.path.dirname(__file__), "..", "..", "shared", "tools", "quiet-check")


def quiet(wait: float) -> str:
    """``quiet-check --wait``'s line (or why it could not run)."""
    if not os.path.exists(QUIET_CHECK):
        return f"load average {os.getloadavg()[0]:.2f} (quiet-check not found)"
    r = subprocess.run([sys.executable, QUIET_CHECK, "--wait", str(wait)],
                       capture_output=True, text=True)  # fmt: skip
    return (r.stdout.strip() or r.stderr.strip()).splitlines()[-1]


def start_hogs(n: int) -> list[subprocess.Popen]:
    return [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]


def stop(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        p.kill()
        p.wait()


def trainer(name: str, store):
    """(cmodel, one training step) of a fresh copy of bench model ``name`` (seed 0), its
    planned programs always running, never re-profiled after the first call."""
    spec = BENCH_MODELS[name]
    torch.manual_seed(0)
    model, inputs = spec.make(), spec.make_inputs()
    with torch.no_grad():
        loss_fn = make_loss(spec, model(*inputs))
    cmodel = autopar.compile(model, inductor=False, race=False, store=store,
                             adapt=autopar.AdaptOptions(max_replans=0))  # fmt: skip
    opt = torch.optim.SGD(model.parameters(), lr=0.01)

    def step():
        opt.zero_grad(set_to_none=True)
        loss_fn(cmodel(*inputs)).backward()
        opt.step()

    return cmodel, step


def run_model(name: str, hogs: int, steps: int, wait: float, reuse: bool = False) -> dict:
    tmp = tempfile.mkdtemp(prefix="autopar-cm-") if reuse else None
    cmodel, step = trainer(name, ProfileStore(tmp) if reuse else ProfileStore.memory())
    before = quiet(wait)
    procs = start_hogs(hogs)
    try:
        time.sleep(0.5 if hogs else 0.0)  # the hogs are running before the profile starts
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            step()  # the first step: capture, profile (under the hogs), heal, plan
    finally:
        stop(procs)
    after = quiet(wait)
    if reuse:  # a second compile reads that store on the quiet machine
        cmodel, step = trainer(name, ProfileStore(tmp))
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            step()  # re-measures provisional entries, heals contradicted ones, plans
        shutil.rmtree(tmp, ignore_errors=True)
    for _ in range(steps):
        step()
    check = cost_model_check(cmodel, steps)  # the bench's rule: planned programs, per step
    return {
        "model": name, "hogs": hogs, "steps": steps, "reuse": reuse,
        "predicted_ms": check["predicted_fwbw_ms"],
        "measured_ms": check["plan_measured_fwbw_ms"],
        "error_pct": check["prediction_error_pct"],
        "executors": sorted({u.executor for u in autopar.graphs(cmodel)}),
        "store_warnings": [str(w.message)[:160] for w in caught
                           if "profile store" in str(w.message)],
        "quiet_before_profile": before, "quiet_after_hogs": after,
    }  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=None, help="comma-separated (default: all bench)")
    parser.add_argument("--hogs", default="0,1,2", help="hog counts to run (default 0,1,2)")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--wait", type=float, default=120.0, help="quiet-check --wait seconds")
    parser.add_argument("--reuse", action="store_true",
                        help="profile under the hogs, then use that store in a second compile")
    parser.add_argument("--out", default="results/cost-model.json")
    args = parser.parse_args(argv)
    models = args.models.split(",") if args.models else default_models()
    hogs = [int(h) for h in args.hogs.split(",")]
    rows = []
    for h in hogs:
        for name in models:
            r = run_model(name, h, args.steps, args.wait, args.reuse)
            rows.append(r)
            print(f"{name:<12} hogs={h}  predicted {r['predicted_ms']:8.3f} ms  measured "
                  f"{r['measured_ms']:8.3f} ms  error {r['error_pct']:+6.1f}%   "
                  f"[{r['quiet_before_profile']}]"
                  + (f"  healed: {len(r['store_warnings'])} warning(s)"
                     if r["store_warnings"] else ""), flush=True)  # fmt: skip
    print("\nmedian |error| per hog count during the profile:")
    for h in hogs:
        errs = [abs(r["error_pct"]) for r in rows if r["hogs"] == h]
        print(f"  hogs={h}: {statistics.median(errs):.1f}%  (models: {len(errs)}, "
              f"max {max(errs):.1f}%)")
    if args.out:
        os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
        meta = {"time": time.strftime("%Y-%m-%d %H:%M:%S"), "torch": torch.__version__,
                "cpu_count": os.cpu_count(), "threads": torch.get_num_threads()}  # fmt: skip
        with open(args.out, "w") as f:
            json.dump({"meta": meta, "rows": rows}, f, indent=1)
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
