"""Where a settled autopar forward call spends its time beyond ``torch.compile``'s: the
layers of one call, each timed on its own, against ``torch.compile(model)``.

Five callables per model, all with gradients on (a training forward; the output is dropped):

* ``torch.compile``: ``torch.compile(model)``, the bench's peer;
* ``tc + autopar's Dynamo settings``: Inductor behind autopar's own ``torch.compile`` call
  (``capture.backend.dynamo_compile``: ``dynamic=False``, its own cache region), first
  called with ``skip_nnmodule_hook_guards=False`` (as ``adapt.shapes.HookGuardsWhileCompiling``
  sets it, so that a hook added after the first call takes effect): the cost of those guards;
* ``autopar: Dynamo module``: autopar's own ``torch.compile``d module (its Dynamo guards and
  the graph's settled executor, with no ``Pipeline.call`` around it);
* ``autopar: Pipeline.call``: the same through ``Pipeline.call`` (input signature, the
  runtime's judge, the monitor);
* ``autopar``: the user's call, ``cmodel(x)`` (``nn.Module.__call__`` and the compiled
  module's ``forward``).

autopar trains alone until its builds have finished and its judge has a verdict (as in
``autopar bench``), then every round runs ``--calls`` calls of each callable in a new random
order. The table gives each one's median per call and the median over rounds of its
difference to ``torch.compile`` in the same round (paired: a slow moment of the machine hits
both). The graph's executor differs between autopar and ``torch.compile`` unless the judge
chose ``inductor`` (torch.compile's own pipeline): ``AUTOPAR_EXECUTORS=inductor`` offers
only that one.

Measured 2026-12-04 (AMD EPYC, 2 vCPUs, tiny HF BERT, verdict joint, 500 rounds): hook
guards +100 us a forward, ``dynamic=False`` with the isolated cache region +22-30 us,
``Pipeline.call`` about +100 us (a forward of 4-6 ms leaves its code cold in the caches: on
a small MLP it takes 25 us); rows agree to about 30 us.

Run::

    .venv/bin/python ../shared/tools/quiet-check --wait 60
    AUTOPAR_EXECUTORS=inductor .venv/bin/python benchmarks/call_overhead.py --models bert
"""

from __future__ import annotations

import argparse
import copy
import random
import statistics
import tempfile
import time
from collections.abc import Callable
from types import SimpleNamespace

import torch

import autopar
from autopar.api import _pipeline_of
from autopar.capture.backend import dynamo_compile
from autopar.tools.bench import DEFAULTS
from autopar.tools.bench_models import BENCH_MODELS, default_models, make_loss
from autopar.tools.bench_settle import autopar_settle


def _with_autopar_dynamo_settings(model: torch.nn.Module, inputs, recompile_limit: int):
    """``torch.compile`` with Inductor as autopar calls ``torch.compile``
    (``capture.backend.dynamo_compile``), its first compile with the hook guards on."""
    compiled = dynamo_compile(model, SimpleNamespace(backend="inductor"), recompile_limit)
    with torch._dynamo.config.patch(skip_nnmodule_hook_guards=False):
        compiled(*inputs)
    return compiled


def measure(name: str, rounds: int, calls: int, store: str, max_steps: int) -> None:
    torch.manual_seed(0)
    spec = BENCH_MODELS[name]
    base, inputs = spec.make(), spec.make_inputs()
    loss_fn = make_loss(spec, base(*inputs))

    tc = torch.compile(copy.deepcopy(base))
    model = copy.deepcopy(base)
    cmodel = autopar.compile(model, store=store)
    pipeline = _pipeline_of(cmodel, "call_overhead")
    tc_settings = _with_autopar_dynamo_settings(copy.deepcopy(base), inputs,
                                                pipeline.recompile_limit)  # fmt: skip
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        loss_fn(cmodel(*inputs)).backward()
        opt.step()

    t_first = time.perf_counter()
    step()
    # autopar bench's phase 2: autopar.wait, then steps until the judge settled
    contender = SimpleNamespace(module=cmodel, t_first=t_first, compile_s=None, error=None)
    limits = SimpleNamespace(wait_timeout=600.0, settle_steps=max_steps,
                             settle_s=DEFAULTS["settle_s"])  # fmt: skip
    settle_steps = autopar_settle(contender, step, limits)["settle_steps"]
    inner, orig = cmodel._autopar_compiled, cmodel._orig_mod  # CachedFrameCall
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

    executors = ", ".join(f"{u.tag} {u.executor}" for u in autopar.graphs(cmodel))
    print(f"\n{name}: executors {executors}, "
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
    ap.add_argument("--settle-steps", type=int, default=DEFAULTS["settle_steps"])
    ap.add_argument("--store", default=None, help="profile store (default: a temporary one)")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.models.split(","):
            measure(name.strip(), args.rounds, args.calls, args.store or tmp, args.settle_steps)


if __name__ == "__main__":
    main()
