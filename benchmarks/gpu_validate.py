"""Validate autopar's CUDA path on a GPU machine, in under 8 minutes, one section at a time.

Sections (each with its own time budget; what does not fit is reported as skipped):

1. equivalence: autopar's generated multi-stream program (2 CUDA streams, round-robin
   placement so that every graph really uses both; no race, no Inductor tier, no monitor)
   trains like eager over steps 2-4 (step 1 profiles and plans): outputs, gradients,
   parameters and buffers after SGD, TF32 off, on >= 6 zoo models (dropout, BatchNorm
   with in-place views, nn.GRU, nn.LSTM among them). Every model must use >= 2 streams.
2. sleep: the same with ``torch.cuda._sleep`` enqueued after every stream switch of the
   generated programs, so a missing wait shows up as wrong numbers, not as luck.
3. sanitizer: one model under ``TORCH_CUDA_SANITIZER=1`` (CSAN; a subprocess).
4. speed: training-step medians of eager, autopar (its multi-stream program), Inductor and
   Inductor ``mode="reduce-overhead"`` (CUDA graph trees), CUDA-synchronised.
5. lstm: nn.LSTM training steps at batch 1/16/64 x hidden 256/1024: eager cuDNN, autopar's
   default on CUDA (cuDNN) and autopar's forced unrolled form (Triton cells).

Output is flushed line by line; the last lines are a PASS/FAIL summary, and a JSON report is
written (``--json``, default ``$OUT/gpu_validate.json`` or ``./gpu_validate.json``).
Without a CUDA device it says so, writes a SKIP report and exits 0 within seconds.

    python benchmarks/gpu_validate.py [--models a,b] [--json PATH]
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import os
import signal
import statistics
import subprocess
import sys
import time

import torch

MODELS = ("towers", "inception", "dropout", "inplace_views", "gru", "lstm", "lstm_cells",
          "transformer")  # fmt: skip
SPEED_MODELS = ("towers", "inception")
BUDGET_S = {"equivalence": 170, "sleep": 70, "sanitizer": 60, "speed": 100, "lstm": 60}
TOTAL_S = 470  # hard stop for the whole script (8 minutes less a margin)
STEPS = 4  # compared: steps 2..STEPS
RTOL = 1e-4  # |autopar - eager| <= RTOL * max(1, max|eager|): same kernels, TF32 off
SLEEP_CYCLES = 1_000_000  # ~0.5 ms of spinning on the stream just switched to
START = time.monotonic()


def say(*parts) -> None:
    print(*parts, flush=True)


class Budget:
    """Seconds left for one section (and for the whole script)."""

    def __init__(self, name: str):
        self.name, self.t0 = name, time.monotonic()

    def left(self) -> float:
        section = BUDGET_S[self.name] - (time.monotonic() - self.t0)
        return min(section, TOTAL_S - (time.monotonic() - START))


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


def build(name: str):
    from autopar.tools import zoo

    model, inputs = zoo.build(name)
    return model.cuda(), [x.cuda() for x in inputs]


def compile_streams(model):
    """autopar's generated program on 2 CUDA streams, nothing else in the way."""
    import autopar
    import autopar.pipeline
    from autopar.profiling.store import ProfileStore

    # The first call keeps the serial program when the multi-stream one does not measure
    # faster (Pipeline.confirm_by_measurement); here the multi-stream one is under test.
    autopar.pipeline.MEASURE_MARGIN = float("inf")
    return autopar.compile(
        model, streams=2, policy="round_robin", store=ProfileStore.memory(), race=False,
        inductor=False, adapt=False, background=False,
    )  # fmt: skip


def train(model, inputs, steps: int, seed: int = 0) -> list[list[torch.Tensor]]:
    """Per step: output, gradients, then parameters and buffers after an SGD step."""
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.SGD(params, lr=0.05)
    out_steps = []
    for i in range(steps):
        torch.manual_seed(seed + i)
        out = model(*inputs)
        out.float().sum().backward()
        grads = [p.grad.detach().clone() for p in params]
        opt.step()
        opt.zero_grad(set_to_none=True)
        state = [t.detach().clone() for t in (*model.parameters(), *model.buffers())]
        out_steps.append([out.detach().clone(), *grads, *state])
    torch.cuda.synchronize()
    return out_steps


def compare(got, want, skip: int = 1) -> tuple[bool, float]:
    worst = 0.0
    for step_got, step_want in zip(got[skip:], want[skip:], strict=True):  # steps 2..
        for a, b in zip(step_got, step_want, strict=True):
            if a.shape != b.shape:
                return False, float("inf")
            if a.numel() == 0:
                continue
            a64, b64 = a.double(), b.double()
            err = (a64 - b64).abs().max().item() / max(1.0, b64.abs().max().item())
            worst = max(worst, err)
    return worst <= RTOL, worst


def streams_used(cmodel) -> int:
    import autopar

    return max((len(u.program.streams_used) for u in autopar.graphs(cmodel) if u.program),
               default=0)  # fmt: skip


@contextlib.contextmanager
def sleep_after_switches():
    """Every ``torch.cuda.set_stream`` of a generated program also enqueues a spin kernel
    on the stream switched to: its later work starts late, so a consumer on another stream
    that does not wait for it reads stale data."""
    orig = torch.cuda.set_stream

    def set_stream(stream):
        orig(stream)
        torch.cuda._sleep(SLEEP_CYCLES)

    torch.cuda.set_stream = set_stream
    try:
        yield
    finally:
        torch.cuda.set_stream = orig


LIVE: dict[str, tuple] = {}  # model -> (eager, compiled, inputs): the sleep pass goes on


def check_model(name: str, sleep: bool) -> dict:
    """Train eager and autopar side by side and compare. The first pass compiles (steps
    2..STEPS compared); the sleep pass trains the same two models 3 more steps, every step
    compared, so it costs no second compile."""
    if sleep:
        eager, cm, inputs = LIVE[name]
        want = train(eager, inputs, 3, seed=100)
        with sleep_after_switches():
            got = train(cm, inputs, 3, seed=100)
        ok, err = compare(got, want, skip=0)
    else:
        model, inputs = build(name)
        eager = copy.deepcopy(model)
        want = train(eager, inputs, STEPS)
        cm = compile_streams(copy.deepcopy(model))
        got = train(cm, inputs, STEPS)
        ok, err = compare(got, want)
        LIVE[name] = (eager, cm, inputs)
    used = streams_used(cm)
    verdict = "ok" if ok and used >= 2 else ("wrong numbers" if not ok else "one stream")
    return {"verdict": verdict, "max_rel_err": err, "streams": used}


def section_equivalence(models, report: dict, key: str, sleep: bool) -> None:
    budget = Budget(key)
    if sleep:
        say(f"\n== sleep: the same models, 3 more steps each compared, _sleep({SLEEP_CYCLES}) "
            "after every stream switch")  # fmt: skip
        models = [m for m in models if m in LIVE]
    else:
        say(f"\n== equivalence: autopar (2 CUDA streams) vs eager over steps 2-{STEPS}, "
            "TF32 off")  # fmt: skip
    results = report.setdefault(key, {})
    for name in models:
        left = budget.left()
        if left < 5:
            results[name] = {"verdict": "skipped (budget)"}
            say(f"  {name:14s} skipped: section budget spent")
            continue
        t0 = time.monotonic()
        try:
            with deadline(left):
                results[name] = check_model(name, sleep)
        except Exception as exc:  # noqa: BLE001 - report every model
            results[name] = {"verdict": f"ERROR {type(exc).__name__}: {exc}"[:300]}
        r = results[name]
        extra = (f"max rel err {r['max_rel_err']:.2e}, {r['streams']} streams"
                 if "streams" in r else "")  # fmt: skip
        say(f"  {name:14s} {r['verdict']:16s} {extra} ({time.monotonic() - t0:.1f} s)")


SANITIZER_CHILD = """
import sys, torch
sys.argv = ["gpu_validate"]
sys.path.insert(0, {here!r})
import gpu_validate as v
model, inputs = v.build({name!r})
cm = v.compile_streams(model)
v.train(cm, inputs, 3)
print("CSAN: no race reported, streams used:", v.streams_used(cm), flush=True)
"""


def section_sanitizer(report: dict, name: str = "towers") -> None:
    budget = Budget("sanitizer")
    say(f"\n== sanitizer: {name} under TORCH_CUDA_SANITIZER=1 (subprocess)")
    env = dict(os.environ, TORCH_CUDA_SANITIZER="1")
    code = SANITIZER_CHILD.format(here=os.path.dirname(os.path.abspath(__file__)), name=name)
    try:
        res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                             text=True, timeout=max(5.0, budget.left()))  # fmt: skip
        ok = res.returncode == 0 and "no race" in res.stdout
        tail = (res.stdout + res.stderr).strip().splitlines()[-6:]
        report["sanitizer"] = {"verdict": "ok" if ok else "FAIL", "tail": tail}
    except subprocess.TimeoutExpired:
        report["sanitizer"] = {"verdict": "skipped (budget)"}
    say(f"  {report['sanitizer']['verdict']}")
    for line in report["sanitizer"].get("tail", []):
        say(f"    {line}")


def time_steps(
    contenders: dict, inputs, steps: int, budget: Budget | None = None
) -> dict[str, float]:
    """Median seconds of one training step per contender (interleaved, synchronised); a
    contender that fails (or, with a ``budget``, runs past it) while warming up is reported
    and left out."""
    opts = {k: torch.optim.SGD(m.parameters(), lr=1e-3) for k, m in contenders.items()}

    def step(k):
        contenders[k](*inputs).float().sum().backward()
        opts[k].step()
        opts[k].zero_grad(set_to_none=True)

    live = {}
    for k in contenders:  # compile and warm up, each within what is left
        try:
            with deadline(budget.left()) if budget else contextlib.nullcontext():
                for _ in range(3):
                    step(k)
            live[k] = []
        except Exception as exc:  # noqa: BLE001 - a contender that fails is reported
            say(f"    {k}: {type(exc).__name__}: {str(exc)[:120]}")
    torch.cuda.synchronize()
    for _ in range(steps):
        for k in live:
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            step(k)
            torch.cuda.synchronize()
            live[k].append(time.perf_counter() - t0)
    return {k: statistics.median(v) for k, v in live.items()}


def _ms(t: float | None) -> str:
    return f"{t * 1e3:9.3f}" if t is not None else f"{'-':>9s}"


def section_speed(report: dict) -> None:
    import autopar
    from autopar.profiling.store import ProfileStore

    budget = Budget("speed")
    say("\n== speed: training step, median ms (interleaved, CUDA-synchronised)")
    say(f"  {'model':12s} {'eager':>9s} {'autopar':>9s} {'inductor':>9s} {'reduce-oh':>9s}")
    out = report.setdefault("speed", {})
    for name in SPEED_MODELS:
        if budget.left() < 15:
            out[name] = "skipped (budget)"
            say(f"  {name:12s} skipped: section budget spent")
            continue
        model, inputs = build(name)
        cands = {
            "eager": copy.deepcopy(model),
            "autopar": autopar.compile(
                copy.deepcopy(model), store=ProfileStore.memory(), inductor=False, race=False
            ),  # fmt: skip
            "inductor": torch.compile(copy.deepcopy(model)),
            "reduce-overhead": torch.compile(copy.deepcopy(model), mode="reduce-overhead"),
        }
        med = time_steps(cands, inputs, 10, budget)
        out[name] = med
        say(f"  {name:12s} " + " ".join(_ms(med.get(k)) for k in cands))


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


def section_lstm(report: dict) -> None:
    import autopar
    from autopar.profiling.store import ProfileStore
    from autopar.tools import zoo

    budget = Budget("lstm")
    say("\n== lstm: nn.LSTM(64, H, 2 layers), 16 steps; median ms per training step")
    say(f"  {'batch':>5s} {'hidden':>6s} {'cuDNN':>9s} {'autopar':>9s} {'unrolled':>9s}")
    out = report.setdefault("lstm", {})
    for hidden in (256, 1024):
        for batch in (1, 16, 64):
            key = f"b{batch}_h{hidden}"
            if budget.left() < 10:
                out[key] = "skipped (budget)"
                say(f"  {batch:5d} {hidden:6d} skipped: section budget spent")
                continue
            model = zoo.RNNModel("lstm", 64, hidden, 2).cuda()
            x = torch.randn(batch, 16, 64, device="cuda")

            def ap(m):
                return autopar.compile(m, store=ProfileStore.memory(), race=False, inductor=False)

            cands = {
                "cudnn": copy.deepcopy(model),
                "autopar": ap(copy.deepcopy(model)),
                "unrolled": ForcedForm(ap(copy.deepcopy(model)), "unrolled"),
            }
            med = time_steps(cands, [x], 10, budget)
            out[key] = med
            say(f"  {batch:5d} {hidden:6d} " + " ".join(_ms(med.get(k)) for k in cands))


def verdict_of(report: dict, models) -> tuple[str, list[str]]:
    """PASS needs >= 6 models (or all asked for) equal to eager on >= 2 streams, each of
    them equal again with sleeps injected, and a clean sanitizer run."""
    problems = []
    eq = report.get("equivalence")
    if eq is not None:  # None: skipped on the command line
        ok = [m for m in models if eq.get(m, {}).get("verdict") == "ok"]
        bad = {m: r["verdict"] for m, r in eq.items() if r["verdict"] != "ok"}
        if bad:
            problems.append(f"equivalence: {bad}")
        if len(ok) < min(6, len(models)):
            problems.append(f"equivalence: only {len(ok)} model(s) verified (need 6)")
        sleep = report.get("sleep")
        if sleep is not None:
            bad = {m: sleep.get(m, {}).get("verdict", "not run") for m in ok}
            bad = {m: v for m, v in bad.items() if v != "ok"}
            if bad:
                problems.append(f"sleep: {bad}")
    if report.get("sanitizer", {}).get("verdict") not in ("ok", None):
        problems.append(f"sanitizer: {report['sanitizer']['verdict']}")
    problems += report.get("errors", [])
    return ("FAIL" if problems else "PASS"), problems


def write_report(report: dict, path: str) -> None:
    report["elapsed_s"] = round(time.monotonic() - START, 1)
    with open(path, "w") as f:
        json.dump(report, f, indent=1, default=str)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default=",".join(MODELS))
    default_json = os.path.join(os.environ.get("OUT") or ".", "gpu_validate.json")
    p.add_argument("--json", default=default_json)
    p.add_argument("--skip", default="", help="sections to skip, e.g. speed,lstm")
    args = p.parse_args(argv)
    report: dict = {"cuda": torch.cuda.is_available(), "torch": torch.__version__}
    if not report["cuda"]:
        say("gpu_validate: no CUDA device here: nothing to validate (run it on a GPU machine)")
        report["verdict"] = "SKIP"
        write_report(report, args.json)
        say("SKIP: no CUDA device")
        return 0
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    models = [m for m in args.models.split(",") if m]
    skip = set(args.skip.split(","))
    report["device"] = torch.cuda.get_device_name(0)
    say(f"device: {report['device']}, torch {torch.__version__}")
    sections = [
        ("equivalence", lambda: section_equivalence(models, report, "equivalence", False)),
        ("sleep", lambda: section_equivalence(models, report, "sleep", True)),
        ("sanitizer", lambda: section_sanitizer(report)),
        ("speed", lambda: section_speed(report)),
        ("lstm", lambda: section_lstm(report)),
    ]
    for name, run in sections:
        if name in skip:
            continue
        try:
            run()
        except Exception as exc:  # noqa: BLE001 - the summary must still be printed
            report.setdefault("errors", []).append(f"{name}: {type(exc).__name__}: {exc}")
            say(f"  section {name} failed: {type(exc).__name__}: {exc}")
        write_report(report, args.json)  # partial results survive a kill
    verdict, problems = verdict_of(report, models)
    report["verdict"], report["problems"] = verdict, problems
    write_report(report, args.json)
    say(f"\nreport: {args.json} ({report['elapsed_s']} s)")
    for line in problems:
        say(f"  {line}")
    say(f"{verdict}: CUDA path validation")
    return 0 if verdict == "PASS" else 1


if __name__ == "__main__":
    sys.exit(main())
