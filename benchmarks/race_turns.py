"""How should the step race interleave its contenders? One model, its eager steps and its
compiled (autopar, builds done, race off) steps, timed in three patterns in one process:

* ``alternating``: E C E C ... (the race's rule before 2026-11-30), every step counted;
* ``turns of 2``: E E C C ..., only the second step of each turn counted (``runtime.judge.RUN``);
* ``blocks of 8``: eight steps of one, then eight of the other, every step counted: the
  steady state of a training loop, which runs the same path step after step.

A step is forward + loss + backward + SGD step, timed alone (``perf_counter`` around it);
the table gives medians and compiled / eager. The pattern whose ratio is closest to the
blocks' one is the one that predicts the loop the user will run. On the deep MLP
(2026-11-30, quiet 2-core box): alternating 1.007, turns of 2 1.029, blocks of 8 1.063;
a second run (the joint executor had landed): 0.979, 1.012, 1.034. Alternating single
steps hid most of the compiled path's cost, or even reversed it.

Run::

    .venv/bin/python ../shared/tools/quiet-check --wait 60
    .venv/bin/python benchmarks/race_turns.py [--model deep_mlp] [--rounds 40]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import autopar
from autopar.tools.bench_models import BENCH_MODELS, make_loss


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="deep_mlp", choices=sorted(BENCH_MODELS))
    ap.add_argument("--rounds", type=int, default=40)
    args = ap.parse_args()

    torch.manual_seed(0)
    spec = BENCH_MODELS[args.model]
    model, inputs = spec.make(), spec.make_inputs()
    loss_fn = make_loss(spec, model(*inputs))
    compiled = autopar.compile(model, background=False, race=False)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)

    def step(fn) -> float:
        t0 = time.perf_counter()
        loss_fn(fn(*inputs)).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return time.perf_counter() - t0

    for _ in range(30):  # compile, settle, warm both paths
        step(compiled)
        step(model)
    print("executors:", {u.tag: u.executor for u in autopar.graphs(compiled)})
    times: dict[str, dict[str, list[float]]] = {
        p: {"eager": [], "compiled": []} for p in ("alternating", "turns of 2", "blocks of 8")
    }
    paths = {"eager": model, "compiled": compiled}
    for _ in range(args.rounds):
        for _ in range(4):
            for who, fn in paths.items():
                times["alternating"][who].append(step(fn))
        for _ in range(2):
            for who, fn in paths.items():
                step(fn)
                times["turns of 2"][who].append(step(fn))
        for who, fn in paths.items():
            times["blocks of 8"][who].extend(step(fn) for _ in range(8))
    print(f"{'pattern':12s} {'eager ms':>9s} {'compiled ms':>12s} {'compiled/eager':>15s}")
    for pattern, t in times.items():
        e, c = statistics.median(t["eager"]), statistics.median(t["compiled"])
        print(f"{pattern:12s} {e * 1e3:9.3f} {c * 1e3:12.3f} {c / e:15.3f}")


if __name__ == "__main__":
    main()
