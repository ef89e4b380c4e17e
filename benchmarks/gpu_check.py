"""The CUDA path end to end, in one script for a lent GPU machine.

For each zoo model on ``cuda:0``: autopar's program on 1 and 2 CUDA streams (forced by
public options, ``gpu_validate.TWO_STREAMS``) must train like eager over two steps
(outputs, every gradient, SGD steps; judged against a float64 reference on the CPU by the
rule of tests/oracle.py), then the training step of eager, ``torch.compile`` (Inductor)
and autopar is timed interleaved (CUDA-synchronised medians) and the ratios are printed,
with autopar's predicted against measured time. Last, LSTMs against cuDNN's ``nn.LSTM`` at batch
1, 16 and 64 (autopar's default on CUDA is cuDNN; its forced unrolled form is shown too).
``benchmarks/gpu_validate.py`` is the budgeted PASS/FAIL validation of the same path.

    python benchmarks/gpu_check.py [--steps 20] [--no-inductor] [--models a,b]

Without a CUDA device it says so and exits 0 (CI runs on CPU machines).
"""

from __future__ import annotations

import argparse
import copy
import os
import sys

import torch

MODELS = ("inception", "towers", "lstm_cells", "transformer", "deep_mlp")
FACTOR, ATOL = 2.0, 1e-6


def _err(a, ref):
    return (a.detach().double().cpu() - ref.detach().double().cpu()).abs().max().item()


def check_equivalence(name: str, streams: int) -> str:
    """'ok' or the first tensor that breaks the fp64-oracle rule, over two training steps:
    the first profiles and plans (the profiler's run is exact), the second runs autopar's
    program on ``streams`` CUDA streams (forced by public options, as gpu_validate.py)."""
    from gpu_validate import TWO_STREAMS

    import autopar
    from autopar.profiling.store import ProfileStore
    from autopar.tools import zoo

    model, inputs = zoo.build(name)
    dev = torch.device("cuda:0")
    model = model.to(dev)
    xs = [x.to(dev) for x in inputs]
    eager, ref = copy.deepcopy(model), copy.deepcopy(model).double().cpu()
    options = dict(TWO_STREAMS, streams=streams,
                   policy="round_robin" if streams > 1 else "serial")  # fmt: skip
    comp = autopar.compile(copy.deepcopy(model), store=ProfileStore.memory(), **options)
    results: dict[str, list] = {"eager": [], "ref": [], "ap": []}
    for _ in range(2):
        for tag, m, dtype in (("eager", eager, None), ("ref", ref, torch.float64),
                              ("ap", comp, None)):  # fmt: skip
            ins = [x.cpu().to(dtype) if dtype else x for x in xs]
            out = m(*ins)
            out.sum().backward()
            grads = [p.grad.detach().clone() for p in m.parameters()]
            torch.optim.SGD(m.parameters(), lr=0.1).step()
            m.zero_grad(set_to_none=True)
            params = [p.detach().clone() for p in m.parameters()]
            results[tag] += [out.detach()] + grads + params
    triples = zip(results["ap"], results["eager"], results["ref"], strict=True)
    for i, (a, e, r) in enumerate(triples):
        bound = FACTOR * _err(e, r) + ATOL * (1 + r.double().abs().max().item())
        if _err(a, r) > bound:
            return f"tensor {i}: autopar error {_err(a, r):.3e} > bound {bound:.3e}"
    return "ok"


class ForcedForm(torch.nn.Module):
    """Runs ``inner`` with ``AUTOPAR_RNN_FORM`` set (read each call, when the RNN rewrite
    is entered), so one compiled model keeps one form."""

    def __init__(self, inner, form: str):
        super().__init__()
        self.inner, self.form = inner, form

    def forward(self, *args):
        old = os.environ.get("AUTOPAR_RNN_FORM")
        os.environ["AUTOPAR_RNN_FORM"] = self.form
        try:
            return self.inner(*args)
        finally:
            if old is None:
                os.environ.pop("AUTOPAR_RNN_FORM", None)
            else:
                os.environ["AUTOPAR_RNN_FORM"] = old


def predicted(cmodel) -> float:
    recs = cmodel._autopar_pipeline.records
    return sum(r.plan.predicted_step_time for r in recs if r.plan is not None)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--models", default=",".join(MODELS))
    p.add_argument("--no-inductor", action="store_true")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("gpu_check: no CUDA device here: nothing to check (run it on a GPU machine)")
        return 0
    from gpu_validate import time_steps  # one timing loop for both GPU scripts

    import autopar
    from autopar.profiling.store import ProfileStore
    from autopar.tools import zoo

    print(f"device: {torch.cuda.get_device_name(0)}, torch {torch.__version__}")
    failures = 0
    print("\n== equivalence (fp64 oracle: outputs, grads, params after SGD)")
    for name in args.models.split(","):
        for streams in (1, 2):
            try:
                verdict = check_equivalence(name, streams)
            except Exception as exc:  # noqa: BLE001 - report every model, then fail
                verdict = f"ERROR {type(exc).__name__}: {exc}"
            failures += verdict != "ok"
            print(f"{name:12s} streams={streams}: {verdict}")
    print("\n== training step (median ms, interleaved; eager/x > 1 is faster)")
    print(f"{'model':12s} {'eager':>9s} {'compile':>9s} {'autopar':>9s} {'ap/eager':>9s} pred")
    for name in args.models.split(","):
        model, inputs = zoo.build(name)
        model = model.cuda()
        xs = [x.cuda() for x in inputs]
        cands = {"eager": copy.deepcopy(model)}
        if not args.no_inductor:
            cands["compile"] = torch.compile(copy.deepcopy(model))
        cands["autopar"] = autopar.compile(copy.deepcopy(model), store=ProfileStore.memory())
        med = time_steps(cands, xs, args.steps)
        comp = f"{med['compile'] * 1e3:9.3f}" if "compile" in med else f"{'-':>9s}"
        print(
            f"{name:12s} {med['eager'] * 1e3:9.3f} {comp} {med['autopar'] * 1e3:9.3f} "
            f"{med['eager'] / med['autopar']:8.2f}x {predicted(cands['autopar']) * 1e3:.3f}"
        )
    # autopar leaves nn.LSTM on CUDA to cuDNN (autopar.rnn.layers); "unrolled" is its
    # per-step Triton-cell form, forced, to show what that default saves.
    print("\n== LSTM (4 layers, hidden 256, 32 steps) vs cuDNN nn.LSTM")
    for batch in (1, 16, 64):
        model = zoo.RNNModel("lstm", 64, 256, 4).cuda()
        x = torch.randn(batch, 32, 64, device="cuda")
        unrolled = autopar.compile(copy.deepcopy(model), store=ProfileStore.memory())
        med = time_steps(
            {
                "cudnn": copy.deepcopy(model),
                "autopar": autopar.compile(copy.deepcopy(model), store=ProfileStore.memory()),
                "unrolled": ForcedForm(unrolled, "unrolled"),
            },
            [x],
            args.steps,
        )
        print(
            f"batch {batch:3d}: cuDNN {med['cudnn'] * 1e3:.3f} ms, autopar "
            f"{med['autopar'] * 1e3:.3f} ms ({med['cudnn'] / med['autopar']:.2f}x), unrolled "
            f"{med['unrolled'] * 1e3:.3f} ms ({med['cudnn'] / med['unrolled']:.2f}x)"
        )
    print(f"\n{failures} equivalence failure(s)")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
