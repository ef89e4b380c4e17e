"""How fast does training run while autopar's tiers still compile? (issue 12, 2026-12-02)

``autopar bench`` reports the time to first step and, after ``autopar.wait``, the steady
state; the steps in between, while the background warm-ups compile Inductor candidates in
other processes, are in neither. On a 2-core box those warm-ups compete with the training
process's two intra-op threads. This script trains one bench model in a plain loop for
``--seconds`` and prints, per 5-second window, how many steps ran and their median time,
with the tier events as they land. Run it once per variant, each in a fresh Inductor cache
(a warm cache makes the warm-ups nearly free):

* ``--contender eager``: the plain module (the throughput to compare with);
* ``--contender autopar``: ``autopar.compile(model)``, defaults;
* ``--contender plans``: ``autopar.compile(model, inductor=False)``: no background work;
* ``--contender backend``: ``torch.compile(model, backend="autopar", dynamic=False)``;
* ``--contender torch.compile``: ``torch.compile(model)`` (its first step compiles).

``--no-race`` runs the autopar contenders with ``race=False`` (no eager safety net).

Usage::

    .venv/bin/python ../shared/tools/quiet-check --wait 60
    TORCHINDUCTOR_CACHE_DIR=$(mktemp -d) .venv/bin/python benchmarks/early_steps.py bert
    .venv/bin/python benchmarks/early_steps.py bert --contender eager --seconds 30
"""

from __future__ import annotations

import argparse
import logging
import statistics
import tempfile
import time

WINDOW_S = 5.0


def main() -> None:
    import torch

    import autopar
    from autopar.tools.bench_models import BENCH_MODELS, make_loss

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", choices=sorted(BENCH_MODELS))
    ap.add_argument("--contender", default="autopar",
                    choices=("autopar", "plans", "eager", "backend", "torch.compile"))  # fmt: skip
    ap.add_argument("--seconds", type=float, default=70.0)
    ap.add_argument("--no-race", action="store_true", help="autopar/backend with race=False")
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(relativeCreated)8.0f ms %(message)s")

    spec = BENCH_MODELS[args.model]
    torch.manual_seed(0)
    model, inputs = spec.make(), spec.make_inputs()
    with torch.no_grad():
        loss_fn = make_loss(spec, model(*inputs))
    store = tempfile.mkdtemp(prefix="autopar-early-")
    if args.contender == "eager":
        module = model
    elif args.contender == "torch.compile":
        module = torch.compile(model)
    elif args.contender == "backend":
        module = torch.compile(model, backend="autopar", dynamic=False,
                               options={"store": store, "race": not args.no_race})  # fmt: skip
    else:
        module = autopar.compile(model, store=store, inductor=args.contender == "autopar",
                                 race=not args.no_race)  # fmt: skip
    opt = torch.optim.SGD(model.parameters(), lr=0.01)

    windows: dict[int, list[float]] = {}
    start = time.perf_counter()
    while (t0 := time.perf_counter()) - start < args.seconds:
        opt.zero_grad(set_to_none=True)
        loss_fn(module(*inputs)).backward()
        opt.step()
        windows.setdefault(int((t0 - start) // WINDOW_S), []).append(time.perf_counter() - t0)
    total = sum(len(v) for v in windows.values())
    print(f"{args.model} {args.contender}: {total} steps in {args.seconds:.0f} s; "
          f"per {WINDOW_S:.0f} s window from the first step: steps / median step")  # fmt: skip
    if args.contender not in ("eager", "torch.compile"):
        pipe = autopar.api._pipeline_of(module, "early_steps")
        print("  tiers: " + ("; ".join(pipe.tiers.events) or "none landed"))
        print("  race: " + "; ".join(f"{v}: {why}" for v, why in pipe.race.report().values()))
    print("  " + "  ".join(f"{k * WINDOW_S:.0f}s: {len(v)} / {statistics.median(v) * 1e3:.0f} ms"
                           for k, v in sorted(windows.items())))  # fmt: skip


if __name__ == "__main__":
    main()
