"""Validate autopar's CUDA stream programs on a GPU machine, in under 8 minutes.

What runs is chosen by public options only (:data:`TWO_STREAMS`)::

    autopar.compile(model, executors=("plan",), streams=2, policy="round_robin",
                    native=False, adapt=False, store=ProfileStore.memory())

``executors=("plan",)``: every step runs autopar's planned programs (no eager or Inductor
steps, no judge); ``streams=2`` with ``policy="round_robin"``: node ``i`` of each graph on
stream ``i mod 2``, so every graph of two or more kernels uses both streams and most of
its edges cross them (a forced policy gets no serial candidate); ``native=False``: the
Python program (a CUDA graph never gets the native interpreter anyway); ``adapt=False``:
no re-plan swaps another program in mid-check.

Per zoo model (:data:`MODELS`, at least :data:`MIN_MODELS` must pass), eager and autopar
train side by side on ``cuda:0`` (TF32 off) with a float64 copy on the CPU as the oracle:

1. ``fp32``: outputs, every gradient, parameters and buffers after SGD, step by step,
   judged by the rule of ``tests/oracle.py``: ``max|autopar - ref64| <= FACTOR *
   max|eager - ref64| + ATOL * (1 + max|ref64|)``. A model that draws random numbers
   (dropout) cannot be judged by a CPU reference (the CPU draws other numbers): it is
   compared with eager on the GPU, ``max|autopar - eager| <= RTOL * (1 + max|eager|)``
   (the same kernels, the generator consumed in graph order).
2. ``sleep:<stream>``: the same, with ``torch.cuda._sleep`` enqueued on one stream at a
   time (the side stream, then the caller's) each time the program switches to it. The
   sleeping stream's work starts late, so a consumer on the other stream that does not
   wait for it reads stale data: a missing wait shows as wrong numbers, not as luck. One
   stream at a time, since slowing both alike can hide a missing wait.
3. ``caller-stream``: the same, with the training loop on a non-default CUDA stream (the
   programs must fork from and join into the *caller's* stream, not the default one).
4. ``bf16``: the same under ``torch.autocast("cuda", torch.bfloat16)`` (a new input
   signature: recaptured, re-profiled and re-planned at its first step), with ``ATOL_BF16``.

Every model must run on two streams. Then ``speed``: median training-step times of eager,
``torch.compile`` and autopar (its forced two-stream program, and its own plan), timed
interleaved and CUDA-synchronised.

Output is flushed line by line; the last line is a JSON summary (also written with
``--json``). Exit 0 on PASS, 1 on FAIL. Without CUDA it prints ``SKIP: CUDA is not
available`` and the JSON summary and exits 0 within seconds.

    python benchmarks/gpu_validate.py [--models a,b] [--json PATH] [--skip speed]
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import signal
import statistics
import sys
import time

import torch

START = time.monotonic()

#: The public options that force autopar's two-stream program (module docstring).
TWO_STREAMS = dict(executors=("plan",), streams=2, policy="round_robin", native=False,
                   adapt=False)  # fmt: skip
MODELS = ("towers", "inception", "transformer", "inplace_views", "lstm_cells", "dropout", "gru")
MIN_MODELS = 5
RANDOM_MODELS = {"dropout"}  # their steps draw random numbers: compared with eager directly
SPEED_MODELS = ("towers", "inception")
#: Seconds per section and for the whole script (8 minutes less a margin for start-up).
BUDGET_S = {"checks": 330, "speed": 100}
TOTAL_S = 450
FACTOR, ATOL, ATOL_BF16 = 2.0, 1e-6, 4e-3  # bf16: one rounding step (2^-8) of slack
RTOL = 1e-4
SLEEP_CYCLES = 1_000_000  # ~0.5 ms of spinning on the stream just switched to
STEPS = 3  # per check; a check's first step may compile (profiled: exact), the rest run it


def say(*parts) -> None:
    print(*parts, flush=True)


def left(section: str, t0: float) -> float:
    """Seconds left to ``section`` (started at ``t0``) within the whole script's budget."""
    now = time.monotonic()
    return min(BUDGET_S[section] - (now - t0), TOTAL_S - (now - START))


@contextlib.contextmanager
def deadline(seconds: float):
    """Raise TimeoutError in this thread after ``seconds`` (checked between Python lines)."""

    def fire(signum, frame):
        raise TimeoutError(f"over its {seconds:.0f} s budget")

    old = signal.signal(signal.SIGALRM, fire)
    signal.setitimer(signal.ITIMER_REAL, max(seconds, 1.0))
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def compile_two_streams(model):
    """autopar's two-stream program for ``model``, by public options only."""
    import autopar
    from autopar.profiling.store import ProfileStore

    return autopar.compile(model, store=ProfileStore.memory(), **TWO_STREAMS)


def programs(cmodel) -> list:
    """The generated programs of ``cmodel``'s graphs that ran."""
    import autopar

    return [u.program for u in autopar.graphs(cmodel) if getattr(u, "program", None)]


# -- training side by side ------------------------------------------------------------------
class Trio:
    """One zoo model three times: eager and autopar on the GPU, float64 eager on the CPU."""

    def __init__(self, name: str):
        from autopar.tools import zoo

        model, inputs = zoo.build(name)
        self.name = name
        self.ref = copy.deepcopy(model).double()
        self.ref_inputs = [x.double() for x in inputs]
        model = model.cuda()
        self.eager = copy.deepcopy(model)
        self.ap = compile_two_streams(copy.deepcopy(model))
        self.inputs = [x.cuda() for x in inputs]
        with torch.no_grad():
            probe = self.eager(*self.inputs)
        gen = torch.Generator().manual_seed(1)
        self.weight = torch.randn(probe.shape, generator=gen)  # a loss with uneven gradients
        self.eager.load_state_dict(self.ap.state_dict())  # undo the probe's buffer updates
        self.seed = 0

    def step(self, model, inputs, weight) -> list[torch.Tensor]:
        out = model(*inputs)
        (out.double() * weight.to(out.device, torch.float64)).sum().backward()
        params = [p for p in model.parameters() if p.requires_grad]
        grads = [p.grad.detach().clone() for p in params]
        torch.optim.SGD(params, lr=0.05).step()
        model.zero_grad(set_to_none=True)
        state = [t.detach().clone() for t in (*model.parameters(), *model.buffers())]
        return [out.detach().clone(), *grads, *state]

    def train(self, steps: int, autocast: bool = False, stream=None) -> list[tuple]:
        """``steps`` steps of all three; per step (autopar's, eager's, ref's) tensors."""
        rows = []
        for _ in range(steps):
            self.seed += 1
            ctx = torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()
            cast = (torch.autocast("cuda", torch.bfloat16) if autocast
                    else contextlib.nullcontext())  # fmt: skip
            got = []
            for model in (self.ap, self.eager):
                torch.manual_seed(self.seed)
                with ctx, cast:
                    got.append(self.step(model, self.inputs, self.weight))
            torch.manual_seed(self.seed)
            ref = self.step(self.ref, self.ref_inputs, self.weight)
            torch.cuda.synchronize()
            rows.append((got[0], got[1], ref))
        return rows

    def judge(self, rows, atol: float = ATOL) -> tuple[bool, float, str]:
        """(ok, worst error / bound, the first tensor over its bound)."""
        worst, first = 0.0, ""
        for step, (ap, eager, ref) in enumerate(rows, 1):
            for i, (a, e, r) in enumerate(zip(ap, eager, ref, strict=True)):
                if a.numel() == 0:
                    continue
                a, e, r = a.double().cpu(), e.double().cpu(), r.double().cpu()
                if self.name in RANDOM_MODELS:
                    err, bound = (a - e).abs().max().item(), RTOL * (1 + e.abs().max().item())
                else:
                    err = (a - r).abs().max().item()
                    scale = r.abs().max().item()
                    bound = FACTOR * (e - r).abs().max().item() + atol * (1.0 + scale)
                ratio = err / bound if bound > 0 else (0.0 if err == 0 else float("inf"))
                if ratio > 1.0 and not first:
                    first = f"step {step} tensor {i}: error {err:.3e} > bound {bound:.3e}"
                worst = max(worst, ratio)
        return not first, worst, first


@contextlib.contextmanager
def sleep_on(target: str):
    """``torch.cuda._sleep`` after each ``set_stream`` to the ``target`` stream (``side``:
    any stream but the caller's; ``caller``: the caller's), so that only that stream runs
    late (module docstring)."""
    orig = torch.cuda.set_stream
    caller = torch.cuda.current_stream()

    def set_stream(stream):
        orig(stream)
        if (stream == caller) == (target == "caller"):
            torch.cuda._sleep(SLEEP_CYCLES)

    torch.cuda.set_stream = set_stream
    try:
        yield
    finally:
        torch.cuda.set_stream = orig


def check_model(name: str) -> dict:
    """Every check of one model (module docstring); each one's verdict and margin."""
    trio = Trio(name)
    out: dict = {}

    def record(check: str, rows, atol: float = ATOL) -> None:
        ok, worst, first = trio.judge(rows, atol)
        out[check] = {"ok": ok, "worst_error_over_bound": round(worst, 4)}
        if first:
            out[check]["first"] = first
        say(f"    {name:14s} {check:14s} {'ok' if ok else 'FAIL':4s} "
            f"worst error/bound {worst:.3f} {first}")  # fmt: skip

    record("fp32", trio.train(STEPS))
    used = [len(p.streams_used) for p in programs(trio.ap)]
    cuda = all("torch.cuda" in p.source and p.executor != "native" for p in programs(trio.ap))
    out["streams"] = max(used, default=0)
    out["cuda_programs"] = cuda
    say(f"    {name:14s} programs: {len(used)}, streams used {used}, CUDA programs: {cuda}")
    for target in ("side", "caller"):
        with sleep_on(target):
            record(f"sleep:{target}", trio.train(2))
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    record("caller-stream", trio.train(2, stream=side))
    torch.cuda.current_stream().wait_stream(side)
    record("bf16", trio.train(STEPS, autocast=True), ATOL_BF16)
    checks = [v for v in out.values() if isinstance(v, dict)]
    out["verdict"] = ("ok" if all(c["ok"] for c in checks) and out["streams"] >= 2 and cuda
                      else "FAIL")  # fmt: skip
    return out


def section_checks(models, report: dict) -> None:
    t0 = time.monotonic()
    say(f"\n== checks: autopar's two-stream program vs eager (fp64 oracle on the CPU), "
        f"{len(models)} models")  # fmt: skip
    results = report.setdefault("models", {})
    for name in models:
        budget = left("checks", t0)
        if budget < 20:
            results[name] = {"verdict": "skipped (budget)"}
            say(f"  {name:14s} skipped: budget spent")
            continue
        t1 = time.monotonic()
        try:
            with deadline(budget):
                results[name] = check_model(name)
        except Exception as exc:  # noqa: BLE001 - report every model
            results[name] = {"verdict": f"ERROR {type(exc).__name__}: {exc}"[:300]}
        say(f"  {name:14s} {results[name]['verdict']} ({time.monotonic() - t1:.1f} s)")


# -- speed -----------------------------------------------------------------------------------
def time_steps(contenders: dict, inputs, steps: int, budget_s: float | None = None) -> dict:
    """Median seconds of one training step per contender (interleaved, synchronised); a
    contender that fails, or runs past ``budget_s`` while compiling and warming up, is
    reported and left out."""
    opts = {k: torch.optim.SGD(m.parameters(), lr=1e-3) for k, m in contenders.items()}

    def step(k):
        contenders[k](*inputs).float().sum().backward()
        opts[k].step()
        opts[k].zero_grad(set_to_none=True)

    t0 = time.monotonic()
    live: dict[str, list[float]] = {}
    for k in contenders:  # compile and warm up, each within what is left
        try:
            limit = None if budget_s is None else budget_s - (time.monotonic() - t0)
            with deadline(limit) if limit is not None else contextlib.nullcontext():
                for _ in range(3):
                    step(k)
            live[k] = []
        except Exception as exc:  # noqa: BLE001 - a contender that fails is reported
            say(f"    {k}: {type(exc).__name__}: {str(exc)[:120]}")
    torch.cuda.synchronize()
    for _ in range(steps):
        for k in live:
            torch.cuda.synchronize()
            t1 = time.perf_counter()
            step(k)
            torch.cuda.synchronize()
            live[k].append(time.perf_counter() - t1)
    return {k: statistics.median(v) for k, v in live.items() if v}


def section_speed(report: dict) -> None:
    import autopar
    from autopar.profiling.store import ProfileStore
    from autopar.tools import zoo

    t0 = time.monotonic()
    names = ("eager", "torch.compile", "autopar 2 streams", "autopar plan")
    say("\n== speed: training step, median ms (interleaved, CUDA-synchronised)")
    say(f"  {'model':12s} " + " ".join(f"{n:>18s}" for n in names))
    out = report.setdefault("speed_ms", {})
    for name in SPEED_MODELS:
        budget = left("speed", t0)
        if budget < 20:
            out[name] = "skipped (budget)"
            say(f"  {name:12s} skipped: budget spent")
            continue
        model, inputs = zoo.build(name)
        model, inputs = model.cuda(), [x.cuda() for x in inputs]
        cands = {
            "eager": copy.deepcopy(model),
            "torch.compile": torch.compile(copy.deepcopy(model)),
            "autopar 2 streams": compile_two_streams(copy.deepcopy(model)),
            "autopar plan": autopar.compile(copy.deepcopy(model), executors=("plan",),
                                            store=ProfileStore.memory()),  # fmt: skip
        }
        med = time_steps(cands, inputs, 10, budget)
        out[name] = {k: round(v * 1e3, 4) for k, v in med.items()}
        say(f"  {name:12s} " + " ".join(
            f"{med[k] * 1e3:18.3f}" if k in med else f"{'-':>18s}" for k in names))


# -- the verdict -----------------------------------------------------------------------------
def verdict_of(report: dict) -> tuple[str, list[str]]:
    """PASS: at least MIN_MODELS models checked, each passing every check on two CUDA
    streams, and no section failing."""
    results = report.get("models", {})
    problems = [f"{m}: {r.get('verdict')}" for m, r in results.items()
                if r.get("verdict") not in ("ok", "skipped (budget)")]  # fmt: skip
    passed = sum(r.get("verdict") == "ok" for r in results.values())
    if "models" in report and passed < MIN_MODELS:
        problems.append(f"only {passed} model(s) passed every check (need {MIN_MODELS})")
    problems += report.get("errors", [])
    return ("FAIL" if problems else "PASS"), problems


def finish(report: dict, path: str | None) -> None:
    """The JSON summary: written to ``path`` (when given) and printed as the last line."""
    report["elapsed_s"] = round(time.monotonic() - START, 1)
    text = json.dumps(report, default=str)
    if path:
        with open(path, "w") as f:
            f.write(text + "\n")
    say(text)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default=",".join(MODELS))
    p.add_argument("--json", default=None, help="also write the JSON summary here")
    p.add_argument("--skip", default="", help="sections to skip: checks, speed")
    args = p.parse_args(argv)
    report: dict = {"cuda": torch.cuda.is_available(), "torch": torch.__version__}
    if not report["cuda"]:
        report["verdict"] = "SKIP"
        say("SKIP: CUDA is not available")
        finish(report, args.json)
        return 0
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    models = [m for m in args.models.split(",") if m]
    skip = set(args.skip.split(","))
    report["device"] = torch.cuda.get_device_name(0)
    report["options"] = {k: list(v) if isinstance(v, tuple) else v for k, v in TWO_STREAMS.items()}
    say(f"device: {report['device']}, torch {torch.__version__}")
    for name, run in (("checks", lambda: section_checks(models, report)),
                      ("speed", lambda: section_speed(report))):  # fmt: skip
        if name in skip:
            continue
        try:
            run()
        except Exception as exc:  # noqa: BLE001 - the summary must still be printed
            report.setdefault("errors", []).append(f"{name}: {type(exc).__name__}: {exc}")
            say(f"  section {name} failed: {type(exc).__name__}: {exc}")
    verdict, problems = verdict_of(report)
    report["verdict"], report["problems"] = verdict, problems
    for line in problems:
        say(f"  {line}")
    say(f"{verdict}: CUDA stream programs validated in {time.monotonic() - START:.0f} s")
    finish(report, args.json)
    return 0 if verdict == "PASS" else 1


if __name__ == "__main__":
    sys.exit(main())
