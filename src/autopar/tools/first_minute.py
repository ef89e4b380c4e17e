"""``autopar bench --first-minute``: time to train. How many training steps does each
contender finish in the first ``--seconds`` (default 60) from its first call, compile
included, each in a fresh process?

What a user feels when they start a run, stop it to change a hyperparameter and start it
again: the steady state alone hides the compile and the choosing. Each model runs, per
contender (eager, ``torch.compile``, autopar), two fresh processes one after the other:

* **cold**: a fresh, empty Inductor cache and profile store (and so no remembered verdict);
* **warm**: the same caches again, after one untimed run that settled (for autopar:
  ``autopar.wait`` for its builds, then steps until its judge decided; ``torch.compile``
  compiled in its cold run): a model trained on this machine before.

A process builds the model under the bench's seed, trains in a plain loop (the bench's
loss, SGD) until ``--seconds`` have passed since the first call began, and reports its step
count, its first step's time and the step times per 10-second window; autopar's also
reports when its verdicts stood. The contenders alternate (eager, torch.compile, autopar,
then the other order for the warm runs), so a slow phase of the machine is shared.

Example::

    autopar bench --first-minute --models towers,bert
    autopar bench --first-minute --model my_model.py:make --seconds 30
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

CONTENDERS = ("eager", "torch.compile", "autopar")
WINDOW_S = 10.0


def run_child(model: str, contender: str, seconds: float, seed: int,
              fill: bool = False) -> dict[str, Any]:  # fmt: skip
    """The measurement, in this (fresh) process: train ``model`` (a bench name or
    ``MODULE:FACTORY``) with ``contender`` for ``seconds`` from the first call. ``fill``:
    untimed, until autopar has settled (its builds waited for), to fill the caches."""
    import torch

    from autopar.tools.bench_models import BENCH_MODELS, make_loss, user_model

    spec = BENCH_MODELS[model] if model in BENCH_MODELS else user_model(model)
    torch.manual_seed(seed)
    net, inputs = spec.make(), spec.make_inputs()
    with torch.no_grad():
        loss_fn = make_loss(spec, net(*inputs))
    opt = torch.optim.SGD(net.parameters(), lr=0.01)
    pipeline = None
    if contender == "torch.compile":
        module = torch.compile(net)
    elif contender == "autopar":
        import autopar

        module = autopar.compile(net)
        pipeline = module._autopar_pipeline
    else:
        module = net
    times, settled_s = [], None
    t0 = time.perf_counter()
    while True:
        t = time.perf_counter()
        if t - t0 >= seconds or (fill and settled_s is not None):
            break
        opt.zero_grad(set_to_none=True)
        loss_fn(module(*inputs)).backward()
        opt.step()
        times.append(time.perf_counter() - t)
        if fill and pipeline is not None and pipeline.runtime.builds.pending():
            import autopar

            autopar.wait(module, timeout=seconds)
        if pipeline is not None and settled_s is None and len(times) > 1 \
                and pipeline.runtime.settled():  # fmt: skip
            settled_s = time.perf_counter() - t0
    windows, start = [], 0.0
    ends = [sum(times[: i + 1]) for i in range(len(times))]
    while start < seconds:
        idx = [i for i, e in enumerate(ends) if start <= e < start + WINDOW_S]
        win = [times[i] for i in idx]
        windows.append({"steps": len(win),
                        "median_ms": statistics.median(win) * 1e3 if win else None})  # fmt: skip
        start += WINDOW_S
    out = {"steps": len(times), "first_step_s": times[0] if times else None,
           "windows": windows, "settled_s": settled_s}  # fmt: skip
    if pipeline is not None:
        import autopar

        ex = autopar.explain(module)
        out["verdicts"] = [v for v, _ in pipeline.runtime.judge.report().values()]
        out["ladder"] = ex.rungs
        out["events"] = list(ex.events)
    return out


def _child(model: str, contender: str, seconds: float, seed: int, dirs: dict,
           fill: bool = False) -> dict:  # fmt: skip
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": dirs["inductor"],
           "AUTOPAR_PROFILE_DIR": dirs["profiles"]}  # fmt: skip
    cmd = [sys.executable, "-m", "autopar.tools.first_minute", model, contender, str(seconds),
           str(seed), "fill" if fill else "timed"]  # fmt: skip
    res = subprocess.run(cmd, env=env, capture_output=True, text=True,
                         timeout=seconds + 600)  # fmt: skip
    lines = [ln for ln in res.stdout.splitlines() if ln.startswith("{")]
    if res.returncode != 0 or not lines:
        tail = (res.stderr or res.stdout).strip().splitlines()[-1:] or ["no output"]
        return {"error": f"exit {res.returncode}: {tail[0][:200]}"}
    return json.loads(lines[-1])


def first_minute(models: list[str], seconds: float = 60.0, seed: int = 0,
                 echo=print) -> list[dict[str, Any]]:  # fmt: skip
    """Cold and warm runs of every contender per model (module docstring); one result dict
    per model: ``{"model", "seconds", "cold": {contender: run}, "warm": {...}}``."""
    out = []
    for model in models:
        res: dict[str, Any] = {"model": model, "seconds": seconds, "cold": {}, "warm": {}}
        dirs = {c: {"inductor": tempfile.mkdtemp(prefix="autopar-fm-ind-"),
                    "profiles": tempfile.mkdtemp(prefix="autopar-fm-prof-")}
                for c in CONTENDERS}  # fmt: skip
        try:
            for phase, order in (("cold", CONTENDERS), ("warm", CONTENDERS[::-1])):
                for c in order:
                    if phase == "warm" and c == "autopar":  # a run that settled, untimed
                        _child(model, c, 600.0, seed, dirs[c], fill=True)
                    run = _child(model, c, seconds, seed, dirs[c])
                    res[phase][c] = run
                    echo(f"   {model} {phase:<4} {c:<13} " + (
                        run["error"] if "error" in run else
                        f"{run['steps']:>7} steps, first step {run['first_step_s']:.2f} s"
                        + (f", settled at {run['settled_s']:.1f} s" if run.get("settled_s")
                           else "")))  # fmt: skip
        finally:
            for d in dirs.values():
                for path in d.values():
                    shutil.rmtree(path, ignore_errors=True)
        out.append(res)
    return out


def format_first_minute(results: list[dict[str, Any]]) -> str:
    """The table: steps in the first minute, cold and warm, and autopar over the best of
    eager and ``torch.compile``."""
    lines = ["== time to train: steps done in the first "
             f"{results[0]['seconds']:.0f} s from the first call, one fresh process each" if
             results else "== time to train: no model",
             f"   {'model':<14} {'cache':<5} {'eager':>8} {'t.compile':>9} {'autopar':>8} "
             f"{'autopar/best':>12} {'autopar settled':>15}"]  # fmt: skip
    for res in results:
        for phase in ("cold", "warm"):
            runs = res[phase]
            steps = {c: runs.get(c, {}).get("steps") for c in CONTENDERS}
            peers = [s for c, s in steps.items() if c != "autopar" and s]
            ap = steps["autopar"]
            ratio = f"{ap / max(peers):.2f}x" if ap and peers else "-"
            settled = runs.get("autopar", {}).get("settled_s")
            lines.append(
                f"   {res['model']:<14} {phase:<5} " + " ".join(
                    f"{(str(steps[c]) if steps[c] is not None else 'failed'):>{w}}"
                    for c, w in zip(CONTENDERS, (8, 9, 8), strict=True))
                + f" {ratio:>12} {(f'{settled:.1f} s' if settled else 'no'):>15}")  # fmt: skip
    return "\n".join(lines)


def main(args) -> int:
    """``autopar bench --first-minute`` (``args`` from ``autopar bench``'s parser)."""
    print(f"autopar bench --first-minute: {', '.join(args.models)}, {args.seconds:.0f} s "
          "windows, cold then warm caches, one fresh process per run", flush=True)  # fmt: skip
    models = [args.model] if getattr(args, "model", None) else args.models  # as given
    results = first_minute(models, args.seconds, args.seed,
                           echo=lambda line: print(line, flush=True))  # fmt: skip
    print(format_first_minute(results), flush=True)
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)) or ".", exist_ok=True)
        with open(args.out, "w") as f:
            json.dump({"first_minute": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    name, who, secs, seed_ = sys.argv[1], sys.argv[2], float(sys.argv[3]), int(sys.argv[4])
    fill_ = len(sys.argv) > 5 and sys.argv[5] == "fill"
    print(json.dumps(run_child(name, who, secs, seed_, fill_)), flush=True)
