"""Where a settled autopar forward call spends its time beyond ``torch.compile``'s: the
layers of one call, each timed on its own, against ``torch.compile(model)``.

Five callables per model, all with gradients on (a training forward; the output is dropped):

* ``torch.compile``: ``torch.compile(model)``, the bench's peer;
* ``tc + autopar's Dynamo settings``: ``torch.compile(model, dynamic=False, recompile_limit=8,
  isolate_recompiles=True)``, first called with ``skip_nnmodule_hook_guards=False`` (what
  ``capture.backend.dynamo_compile`` and ``adapt.shapes.HookGuardsWhileCompiling`` do, so
  that a hook added after the first call takes effect): the cost of those guards;
* ``autopar: Dynamo module``: autopar's own ``torch.compile``d module (its Dynamo guards and
  the graph's settled executor, with no ``Pipeline.call`` around it);
* ``autopar: Pipeline.call``: the same through ``Pipeline.call`` (input signature, race,
  tiers, monitor);
* ``autopar``: the user's call, ``cmodel(x)`` (``nn.Module.__call__`` and the compiled
  module's ``forward``).

autopar trains alone until its tiers have landed and its race has a verdict (as in
``autopar bench``), then every round runs ``--calls`` calls of each callable in a new random
order. The table gives each one's median per call and the median over rounds of its
difference to ``torch.compile`` in the same round (paired: a slow moment of the machine hits
both). The graph's executor differs between autopar and ``torch.compile`` unless the race
chose ``joint`` (torch.compile's own pipeline): ``AUTOPAR_TIERS=joint`` offers only that one.

Measured 2026-12-04 (AMD EPYC, 2 vCPUs, tiny HF BERT, race verdict joint, 500 rounds): hook
guards +100 us a forward, ``dynamic=False`` with the isolated cache region +22-30 us,
``Pipeline.call`` about +100 us (a forward of 4-6 ms leaves its code cold in the caches: on
a small MLP it takes 25 us); rows agree to about 30 us. See
docs/benchmarks.md ("What a settled call costs").

Run::

    .venv/bin/python ../shared/tools/quiet-check --wait 60
    AUTOPAR_RACE_CONFIRM_S=off .venv/bin/python benchmarks/call_overhead.py --models bert
"""

from __future__ import annotations

import argparse
import copy
import random
import statistics
import tempfile
import time
from collections.abc import Callable

import torch

import autopar
from autopar.api import _pipeline_of
from autopar.tools.bench_models import BENCH_MODELS, default_models, make_loss
from autopar.tools.bench_settle import _settled


def _settle(cmodel, step: Callable[[], None], max_steps: int) -> int:
    """``autopar.wait``, then training steps until every tier landed and the race decided."""
    pipeline = _pipeline_of(cmodel, "call_overhead")
    autopar.wait(cmodel, timeout=600)
    steps = 0
    while not _settled(pipeline) and steps < max_steps:
        step()
        steps += 1
    return steps


def _with_autopar_dynamo_settings(model: torch.nn.Module, inputs) -> torch.nn.Module:
    compiled = torch.compile(model, dynamic=False, recompile_limit=8, isolate_recompiles=True)
    with torch._dynamo.config.patch(skip_nnmodule_hook_guards=False):  # the first compile
        compiled(*inputs)
    return compiled


def measure(name: str, rounds: int, calls: int, store: str, max_steps: int) -> None:
    torch.manual_seed(0)
    spec = BENCH_MODELS[name]
    base, inputs = spec.make(), spec.make_inputs()
    loss_fn = make_loss(spec, base(*inputs))

    tc = torch.compile(copy.deepcopy(base))
    tc_settings = _with_autopar_dynamo_settings(copy.deepcopy(base), inputs)
    model = copy.deepcopy(base)
    cmodel = autopar.compile(model, store=store)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        loss_fn(cmodel(*inputs)).backward()
        opt.step()

    step()
    settle_steps = _settle(cmodel, step, max_steps)
    pipeline = _pipeline_of(cmodel, "call_overhead")
    inner, orig = cmodel._autopar_compiled, cmodel._orig_mod
    fns: dict[str, Callable[[], object]] = {
        "torch.compile": lambda: tc(*inputs),
        "tc + autopar's Dynamo settings": lambda: tc_settings(*inputs),
        "autopar: Dynamo module": lambda: inner(*inputs),
        "autopar: Pipeline.call": lambda: pipeline.call(orig, inner, inputs, {}),
        "autopar": lambda: cmodel(*inputs),
    }
    for fn in fns.values():  # compile and warm every one
        for _ in range(3):
            fn()
    times: dict[str, list[float]] = {k: [] for k in fns}
    order = random.Random(0)
    for _ in range(rounds):
        names = list(fns)
        order.shuffle(names)
        for k in names:
            t0 = time.perf_counter()
            for _ in range(calls):
                fns[k]()
            times[k].append((time.perf_counter() - t0) / calls)

    verdicts = [v for v, _ in pipeline.race.report().values()]
    executors = ", ".join(f"{u.tag} {u.executor}" for u in autopar.graphs(cmodel))
    print(f"\n{name}: race verdict {verdicts}, executors {executors}, "
          f"settled after {settle_steps} steps; {rounds} rounds x {calls} calls")  # fmt: skip
    ref = times["torch.compile"]
    print(f"  {'callable':32s} {'median us':>10s} {'vs torch.compile us':>20s}")
    for k, v in times.items():
        diff = statistics.median(a - b for a, b in zip(v, ref, strict=True)) * 1e6
        print(f"  {k:32s} {statistics.median(v) * 1e6:10.1f} {diff:+20.1f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="transformer,bert",
                    help=f"comma-separated, from {','.join(default_models())}")  # fmt: skip
    ap.add_argument("--rounds", type=int, default=400)
    ap.add_argument("--calls", type=int, default=3, help="calls per callable per round")
    ap.add_argument("--settle-steps", type=int, default=10000)
    ap.add_argument("--store", default=None, help="profile store (default: a temporary one)")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.models.split(","):
            measure(name.strip(), args.rounds, args.calls, args.store or tmp, args.settle_steps)


if __name__ == "__main__":
    main()
