"""The printed tables, the CSV and the run's conditions of ``autopar bench``
(:mod:`autopar.tools.bench` measures; this module only formats its result dicts).

Example::

    >>> from autopar.tools.bench_report import _fmt
    >>> _fmt(1.23456, ".2f"), _fmt(None, ".2f")
    ('1.23', '-')
"""

from __future__ import annotations

import csv
import os
import platform
import re
import statistics
import textwrap
import time
from typing import Any

import torch

_SHORT = {"inductor": "ind", "joint": "joint", "split": "split", "plan": "plan",
          "native": "nat", "captured": "capt"}  # fmt: skip


def _fmt(x: float | None, spec: str, none: str = "-") -> str:
    return none if x is None else format(x, spec)


def _ratio(x: float | None) -> str:
    return _fmt(x, ".2f") + "x" if x is not None else "-"


def vs_best(row: dict[str, Any] | None) -> str:
    """``0.96x (0.92-1.01)``: the ratio to the best peer and its 90% bootstrap interval
    (``tools.bench_stats``); ``skipped``/``failed``/``-`` where there is none."""
    if row is None:
        return "skipped"
    if row["error"]:
        return "failed"
    text = _ratio(row.get("speedup_vs_best"))
    ci = row.get("vs_best_interval")
    return text + (f" ({ci[0]:.2f}-{ci[1]:.2f})" if ci else "")


def executors_brief(graphs: list[dict[str, Any]]) -> str:
    """``fw ind, bw plan`` for one Dynamo graph; ``g0.fw ind, g0.bw plan, g1.fw ...`` else.
    A planned program on the native interpreter reads ``nat``."""
    if not graphs:
        return "-"
    one = all(g["tag"].startswith("g0.") for g in graphs)

    def short(g) -> str:
        name = executor_name(g)
        return _SHORT.get(name, name)

    return ", ".join(f"{g['tag'][3:] if one else g['tag']} {short(g)}" for g in graphs)


def executor_name(graph: dict[str, Any]) -> str:
    """A graph's executor by name, as the README's table gives it (``executors_brief``
    shortens it): a planned program on the native interpreter is ``native``, not ``plan``."""
    return "native" if graph["executor"] == "plan" and graph.get("native") else graph["executor"]


def race_brief(race: list[dict[str, Any]]) -> str:
    """The race verdict(s): ``compiled``, ``eager``, ``racing`` (no verdict yet) or ``-``."""
    verdicts = sorted({r["verdict"] or "racing" for r in race})
    return "/".join(verdicts) if verdicts else "-"


def how_timed(steps, warmup, block) -> str:
    """``60 steps in interleaved blocks of 4 (...) after 3 warm-up rounds``; bench files
    from before ``--block`` (every step timed, one per round) read as block 1."""
    if block == 1:
        return f"{steps} interleaved steps after {warmup} warm-up"
    return (
        f"{steps} steps in interleaved blocks of {block} (each block's first step untimed) "
        f"after {warmup} warm-up rounds"
    )


def format_result(res: dict[str, Any], args) -> str:
    """The table of one model, as printed."""
    lines = [
        f"== {res['model']}: {res['description']}",
        f"   input {' + '.join('x'.join(map(str, s)) for s in res['input_shapes'])}, "
        f"{res['parameters']:,} parameters, {args.optimizer.upper()}, median of "
        f"{how_timed(args.steps, args.warmup, args.block)}",
        f"   machine before: {describe_state(res.get('machine_before'))}; after: "
        f"{describe_state(res.get('machine_after'))}"
        + (f"; attempt {res['attempt']}" if res.get("attempt", 1) > 1 else "")
        + (f"; NOISY: {res['noisy']}" if res.get("noisy") else ""),
        f"   {'contender':<14} {'step ms':>9} {'(IQR %)':>8} {'fw+bw ms':>9} {'eager/x':>8} "
        f"{'best/x':>7} {'1st step s':>10}",
    ]
    for name, r in res["contenders"].items():
        if r["error"]:
            lines.append(f"   {name:<14} FAILED: {r['error']}")
            continue
        lines.append(
            f"   {name:<14} {_fmt(r['median_step_ms'], '9.3f')} {_fmt(r['spread_pct'], '7.0f'):>8} "
            f"{_fmt(r['median_fwbw_ms'], '9.3f')} {_ratio(r['speedup_vs_eager']):>8} "
            f"{_ratio(r.get('speedup_vs_best')):>7} {_fmt(r['first_step_s'], '10.2f')}"
        )
        lines.extend(f"   {'':<14} note: {n}" for n in sorted(set(r["notes"])))
    a = res["autopar"]
    lines.extend(_autopar_lines(a))
    if a.get("predicted_s") is not None:
        if a.get("predicted_fwbw_ms") is not None:
            lines.append(
                f"   autopar cost model: planned programs' fw+bw graphs predicted "
                f"{a['predicted_fwbw_ms']:.3f} ms, measured {a['plan_measured_fwbw_ms']:.3f} ms "
                f"(median per step, autopar-plans) -> error "
                f"{_fmt(a['prediction_error_pct'], '+.1f')}%"
            )
        else:
            lines.append("   autopar cost model: no step ran every planned program (not checked)")
        lines.append(
            f"   plan: policy {'/'.join(a['policies'])}, {a['streams']} stream(s), predicted "
            f"serial {a['serial_fwbw_ms']:.3f} ms, lower bound {a['lower_bound_s'] * 1e3:.3f} ms"
        )
    else:
        lines.append("   autopar cost model: no plan was made (see the fallbacks below)")
    if a.get("replans"):
        lines.append(
            f"   autopar re-planned {a['replans']} time(s) during the run: measured times "
            "drifted from the prediction (re-profiling steps are slower; see --no-adapt)"
        )
    for tag, why in a["fallbacks"].items():
        lines.append(f"   autopar fallback on {tag}: {why}")
    for w in res["warnings"][:5]:
        lines.append(f"   warning: {w[:200]}")
    return "\n".join(lines)


def _autopar_lines(a: dict[str, Any]) -> list[str]:
    """autopar's settle phase: the wait, when the verdicts stood, what runs every graph and
    the verdicts."""
    if "settle_steps" not in a:
        return []
    lines = [
        f"   autopar ladder: {', '.join(a.get('ladder', [])) or '-'}; autopar.wait "
        f"{a['wait_s']:.1f} s{'' if a['wait_done'] else ' (timed out)'}; "
        + (f"settled {_fmt(a.get('final_s'), '.1f')} s after the first step began"
           if a["settled"] else "NOT settled")
        + f", after {a['settle_steps']} autopar-only step(s)"
    ]
    for g in a.get("graphs", ()):
        lines.append(f"   autopar {g['tag']:<6} -> {executor_name(g)}")
    for e in a.get("events", ())[-6:]:
        lines.append(f"   autopar event: {e}")
    for r in a.get("race", ()):
        lines.append(
            f"   autopar verdict {r['signature']}: {r['verdict'] or 'none'} ({r['reason']})"
        )
    return lines


def format_verdict(res: dict[str, Any]) -> str:
    """What ``autopar bench --model`` ends with: the steady-state ratio of autopar to the best
    of eager and ``torch.compile``, each contender's time to first step, and one sentence:
    whether autopar is worth it on this model. "Worth it" needs the ratio's 90% interval
    (``tools.bench_stats``) above 1.00; an interval that holds 1.00 is not a gain. A run that
    cannot tell says so instead, and how to rerun: autopar had not settled when the timing
    began (still compiling or choosing its executors: ``--quick`` on a cold machine), or
    another process disturbed it.

    Example::

        >>> row = lambda ms, first: {"median_step_ms": ms, "first_step_s": first,
        ...     "error": None, "speedup_vs_best": 2.0 / ms, "vs_best_interval": (1.1, 1.3)}
        >>> res = {"model": "m", "contenders": {"eager": row(2.0, 0.01),
        ...     "torch.compile": row(2.2, 9.0), "autopar": row(1.66, 0.8)}}
        >>> format_verdict(res).splitlines()[-1].split(": ")[-1]
        'worth it.'
    """
    c = res["contenders"]
    ap, tc = c.get("autopar"), c.get("torch.compile")
    peers = {n: r for n in ("eager", "torch.compile")
             if (r := c.get(n)) and not r["error"] and r["median_step_ms"] is not None}  # fmt: skip
    best = min(peers, key=lambda n: peers[n]["median_step_ms"], default="eager")
    against = "eager and torch.compile" if tc is not None else "eager (torch.compile not run)"
    lines = [f"== is autopar worth it on {res['model']}?"]
    if ap is None or ap["error"] or ap["median_step_ms"] is None:
        why = ap["error"] if ap and ap["error"] else "no timed step"
        lines.append(f"   autopar failed on this model ({why}): use {best}.")
        return "\n".join(lines)
    medians = ", ".join(f"{n} {r['median_step_ms']:.3f} ms" for n, r in peers.items())
    ratio, ci = ap["speedup_vs_best"], ap.get("vs_best_interval")
    interval = f" (90% interval {ci[0]:.2f}-{ci[1]:.2f})" if ci else " (too few steps: no interval)"
    lines.append(
        f"   steady state: autopar {ap['median_step_ms']:.3f} ms per step, {medians}: "
        f"{_ratio(ratio)} the best{interval}"
    )
    firsts = ", ".join(f"{n} {_seconds(r['first_step_s'])}" for n, r in c.items()
                       if n in ("autopar", *peers) and r["first_step_s"] is not None)  # fmt: skip
    lines.append(f"   time to first step: {firsts}")
    # Time to settle and the first minute's figures belong here (the runtime's own report).
    lo, hi = ci if ci else (ratio, ratio)
    head = f"autopar is {_ratio(ratio)} the best of {against} in steady state on this model"
    cannot = f"   {head}, but this run cannot tell whether it is worth it: "
    if res.get("autopar", {}).get("settled") is False:
        lines.append(cannot + "autopar had not settled (still compiling or choosing its "
                     "executors); rerun without --quick or with a larger --settle-s.")  # fmt: skip
    elif res.get("noisy"):
        lines.append(cannot + f"{res['noisy']}; rerun on a quiet machine (--wait-quiet 60 "
                     "--retries 2).")  # fmt: skip
    elif lo > 1.0:
        lines.append(f"   {head}: worth it.")
    elif hi < 1.0:
        lines.append(f"   {head}: slower than {best}: use {best}.")
    else:
        lines.append(f"   {head}, within the noise: not faster than {best} here: use {best}.")
    return "\n".join(lines)


def _seconds(s: float) -> str:
    """``12.3 s``, ``0.84 s``, or ``4.2 ms`` below a tenth of a second (eager's first step)."""
    return f"{s:.1f} s" if s >= 10 else f"{s:.2f} s" if s >= 0.1 else f"{s * 1e3:.1f} ms"


def format_summary(results: list[dict[str, Any]]) -> str:
    """One line per model: medians, ratios, first steps, settle time, executors, verdict."""
    lines = [
        "== summary: median training step; ratios are eager's (or the faster of eager and "
        "torch.compile's) median / the contender's (>1 is faster)",
        "   (90% CI): bootstrap over the interleaved rounds (tools.bench_stats); an interval "
        "that holds 1.00 is no evidence either way",
        "   first steps: torch.compile / autopar, seconds; settled: s from autopar's first step "
        "until its verdicts stood",
        f"   {'model':<12} {'eager ms':>9} {'torch.compile':>13} {'autopar':>8} "
        f"{'autopar/best (90% CI)':>21} {'1st step tc / ap s':>18} {'settled':>8} "
        f"{'model err':>9}  {'executors':<18} race",
    ]
    for res in results:
        c = res["contenders"]

        def val(name, key, spec, c=c):
            r = c.get(name)
            if r is None:
                return "skipped"
            return "failed" if r["error"] else _fmt(r[key], spec)

        def sp(name, key="speedup_vs_eager", c=c):
            r = c.get(name)
            if r is None:
                return "skipped"
            return "failed" if r["error"] else _ratio(r.get(key))

        a = res["autopar"]
        err = _fmt(a.get("prediction_error_pct"), "+.0f", "n/a")
        tc, ap = (val(n, "first_step_s", ".1f") for n in ("torch.compile", "autopar"))
        first = f"{tc} / {ap}"
        model = res["model"] + ("*" if res.get("noisy") else "")
        lines.append(
            f"   {model:<12} {val('eager', 'median_step_ms', '.3f'):>9} "
            f"{sp('torch.compile'):>13} {sp('autopar'):>8} "
            f"{vs_best(c.get('autopar')):>21} {first:>18} "
            f"{_fmt(a.get('final_s'), '.1f'):>8} "
            f"{err + ('%' if err != 'n/a' else ''):>9}  "
            f"{executors_brief(a.get('graphs', [])):<18} {race_brief(a.get('race', []))}"
        )
    if any(res.get("noisy") for res in results):
        lines.append("   * noisy: another process disturbed the run (see the model's table)")
    errs = [abs(e) for res in results
            if (e := res["autopar"].get("prediction_error_pct")) is not None]  # fmt: skip
    if errs:
        lines.append(
            f"   cost model ('model err': predicted vs measured planned programs): median "
            f"|error| {statistics.median(errs):.1f}% over {len(errs)} model(s)"
        )
    return "\n".join(lines)


# -- output files ----------------------------------------------------------------------------------
CSV_COLUMNS = [
    "model",
    "contender",
    "median_step_ms",
    "median_fwbw_ms",
    "spread_pct",
    "speedup_vs_eager",
    "speedup_vs_best",
    "compile_s",
    "first_step_s",
    "timed_steps",
    "predicted_fwbw_ms",
    "prediction_error_pct",
    "settled_s",
    "executors",
    "race",
    "error",
]


def write_csv(path: str, results: list[dict[str, Any]]) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=CSV_COLUMNS)
        w.writeheader()
        for res in results:
            for name, r in res["contenders"].items():
                row = {"model": res["model"], "contender": name}
                row.update({k: r.get(k) for k in CSV_COLUMNS if k in r})
                if name == "autopar":
                    a = res["autopar"]
                    row["predicted_fwbw_ms"] = a.get("predicted_fwbw_ms")
                    row["prediction_error_pct"] = a.get("prediction_error_pct")
                    row["settled_s"] = a.get("final_s")
                    row["executors"] = executors_brief(a.get("graphs", []))
                    row["race"] = race_brief(a.get("race", []))
                w.writerow({k: round(v, 4) if isinstance(v, float) else v for k, v in row.items()})


def ladder_of(args) -> tuple[str, ...]:
    """The executor ladder autopar compiles with under these options (``--no-inductor``,
    ``--no-autopar-inductor``, ``--no-race`` take executors off ``autopar.compile``'s
    default)."""
    from autopar.api import resolve_ladder

    no_ind = args.no_inductor or getattr(args, "no_autopar_inductor", False)
    return resolve_ladder(None, not getattr(args, "no_race", False), False if no_ind else None)


def _load() -> float | None:
    """The 1-minute load average, where the OS has one."""
    try:
        return os.getloadavg()[0]
    except (AttributeError, OSError):
        return None


def contention_probe(threads: int) -> float | None:
    """How much faster a 256x256 matmul runs on ``threads`` intra-op threads than on one
    (median of 15): about 1.5-2 on a quiet 2-core machine, below 1 when another process holds
    a core (the 2-thread OpenMP region then waits for it). None with one thread."""
    if threads < 2:
        return None
    a = torch.randn(256, 256)
    med = {}
    try:
        for th in (1, threads):
            torch.set_num_threads(th)
            for _ in range(3):
                a @ a
            ts = []
            for _ in range(15):
                t = time.perf_counter()
                a @ a
                ts.append(time.perf_counter() - t)
            med[th] = sorted(ts)[len(ts) // 2]
    finally:
        torch.set_num_threads(threads)
    return med[1] / med[threads]


#: ``contention_probe`` above this: no other process holds a core.
QUIET_SPEEDUP = 1.2


def machine_state(threads: int, wait_s: float = 0.0) -> dict[str, Any]:
    """The machine's state now: the contention probe and the load average. With ``wait_s``,
    poll (every 2 s) until three probes in a row say quiet, or the time is up."""
    deadline, streak, t0 = time.monotonic() + wait_s, 0, time.monotonic()
    while True:
        speedup = contention_probe(threads)
        quiet = speedup is None or speedup > QUIET_SPEEDUP
        streak = streak + 1 if quiet else 0
        if wait_s <= 0 or streak >= 3 or time.monotonic() >= deadline:
            break
        time.sleep(2.0)
    return {"speedup": speedup, "quiet": quiet, "load1": _load(),
            "waited_s": time.monotonic() - t0}  # fmt: skip


def describe_state(state: dict[str, Any] | None) -> str:
    if not state:
        return "?"
    word = "quiet" if state["quiet"] else "BUSY"
    return (
        f"{word} (2-thread matmul speedup {_fmt(state['speedup'], '.2f')}x, load "
        f"{_fmt(state['load1'], '.2f')})"
    )


def skipped_note(skipped: dict[str, str]) -> str:
    """The line that names the default models a run left out (``{name: package}``)."""
    needs = ", ".join(sorted(set(skipped.values())))
    return (f"   NOTE: not run: {', '.join(skipped)} (they need {needs}; "
            "pip install 'autopar[bench]' to include them).")  # fmt: skip


def meta(args, default_threads: int) -> dict[str, Any]:
    """The conditions of the run, stored next to the numbers."""
    return {
        "torch": torch.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
        "intra_op_threads": default_threads,
        "load_average_1min_at_end": _load(),
        "models": list(args.models),
        "skipped_models": dict(getattr(args, "skipped", None) or {}),
        "wait_quiet_s": getattr(args, "wait_quiet", 0.0),
        "optimizer": args.optimizer,
        "steps": args.steps,
        "warmup": args.warmup,
        "block": getattr(args, "block", 1),
        "settle_steps": args.settle_steps,
        "settle_s": args.settle_s,
        "streams": args.streams,
        "policy": args.policy,
        "adapt": not getattr(args, "no_adapt", False),
        "inductor": not args.no_inductor,
        "autopar_ladder": list(ladder_of(args)),
        "background": not getattr(args, "no_background", False),
        "race": not getattr(args, "no_race", False),
        "inductor_cache": "warm" if getattr(args, "warm_cache", False) else "fresh",
        "time": time.strftime("%Y-%m-%d %H:%M:%S"),
    }


# -- the README's results table --------------------------------------------------------------------
#: The marker comments around the generated section of README.md.
README_BEGIN = "<!-- autopar bench-report: begin (generated from a bench JSON; edits are lost) -->"
README_END = "<!-- autopar bench-report: end -->"


def _machine(m: dict[str, Any]) -> str:
    """``Linux x86_64, 2 CPUs`` from the run's ``meta`` (platform string and CPU count)."""
    plat = str(m.get("platform", "?"))
    arch = next((a for a in ("x86_64", "aarch64", "arm64", "AMD64") if a in plat), "")
    return f"{plat.split('-')[0]} {arch}".strip() + f", {m.get('cpu_count', '?')} CPUs"


def _cell(contenders: dict[str, Any], name: str, key: str, spec: str, unit: str) -> str:
    r = contenders.get(name)
    if r is None:
        return "-"
    if r["error"]:
        return "failed"
    return "-" if r.get(key) is None else format(r[key], spec) + unit


def readme_table(doc: dict[str, Any], source: str, fm: list | None = None) -> str:
    """The README's results table: per model, eager's step, the speedups of ``torch.compile``
    and autopar, autopar against the best peer with its interval, the first steps, when
    autopar settled, its verdict; with ``fm`` (``autopar bench --first-minute`` results),
    autopar's steps in the first minute over the best peer's, cold and warm.

    Example::

        >>> doc = json.load(open("results/bench.json"))                 # doctest: +SKIP
        >>> print(readme_table(doc, "results/bench.json"))              # doctest: +SKIP
    """
    m = doc["meta"]
    timed = how_timed(m.get("steps", "?"), m.get("warmup", "?"), m.get("block", 1))
    loads = [(res.get("machine_before") or {}).get("load1") for res in doc["results"]]
    loads = [x for x in loads if x is not None]
    intro = (
        f"Training step (zero_grad + forward + loss + backward + {m.get('optimizer', '?').upper()} "
        f"step), median of {timed}; ratio = eager time / contender time (> 1 is faster). "
        f"Measured by `autopar bench` on {_machine(m)}, torch {m.get('torch', '?')}, "
        f"{m.get('intra_op_threads', '?')} intra-op threads, Inductor cache "
        f"{m.get('inductor_cache', '?')}, {str(m.get('time', '?'))[:10]}"
        + (f", load average before each model {min(loads):.2f}-{max(loads):.2f}" if loads
           else "") + f"; generated from `{source}` by `autopar bench-report`."
        + (" First minute: steps in the first 60 s from the first call, one fresh process "
           "per contender (`autopar bench --first-minute`), autopar's over the best of eager "
           "and torch.compile's; cold: empty caches; warm: after a run that settled."
           if fm else "")
    )  # fmt: skip
    first = {r["model"]: r for r in fm or ()}
    head = ("| model | eager step | torch.compile | autopar | autopar / best (90% CI) | "
            "first step: torch.compile / autopar | autopar settled | verdict |")
    rule = "|---|---|---|---|---|---|---|---|"
    if fm:
        head, rule = head + " first minute: cold / warm |", rule + "---|"
    lines = [textwrap.fill(intro, 92, break_on_hyphens=False, break_long_words=False), "",
             head, rule]  # fmt: skip
    for res in doc["results"]:
        c, a = res["contenders"], res["autopar"]
        desc = re.split(r"[:,]", res["description"])[0] + f" (`{res['model']}`)"
        desc += "*" if res.get("noisy") else ""
        row = (
            f"| {desc} | {_cell(c, 'eager', 'median_step_ms', '.2f', ' ms')} | "
            f"{_cell(c, 'torch.compile', 'speedup_vs_eager', '.2f', 'x')} | "
            f"{_cell(c, 'autopar', 'speedup_vs_eager', '.2f', 'x')} | "
            f"{vs_best(c.get('autopar'))} | "
            f"{_cell(c, 'torch.compile', 'first_step_s', '.1f', ' s')} / "
            f"{_cell(c, 'autopar', 'first_step_s', '.1f', ' s')} | "
            f"{_fmt(a.get('final_s'), '.0f', 'no')}{' s' if a.get('final_s') else ''} | "
            f"{race_brief(a.get('race', []))} |"
        )
        if fm:
            row += f" {first_minute_cell(first.get(res['model']))} |"
        lines.append(row)
    if any(res.get("noisy") for res in doc["results"]):
        lines.append("")
        lines.append("\\* noisy: another process disturbed this model's run (see the JSON).")
    return "\n".join(lines)


def first_minute_cell(res: dict[str, Any] | None) -> str:
    """``1.06x / 0.97x``: autopar's first-minute steps over the best peer's, cold / warm."""
    if res is None:
        return "-"
    out = []
    for phase in ("cold", "warm"):
        runs = res.get(phase, {})
        steps = {c: (r or {}).get("steps") for c, r in runs.items()}
        peers = [v for c, v in steps.items() if c != "autopar" and v]
        ap = steps.get("autopar")
        out.append(f"{ap / max(peers):.2f}x" if ap and peers else "-")
    return " / ".join(out)


def update_readme(path: str, doc: dict[str, Any], source: str, check: bool = False,
                  fm: list | None = None) -> bool:
    """Rewrite the part of the file ``path`` between :data:`README_BEGIN` and
    :data:`README_END` with :func:`readme_table`. Returns True when the text changed (with
    ``check``: the file is left as it is). Raises ``ValueError`` when a marker is missing.

    Example::

        >>> update_readme("README.md", doc, "results/bench-full/bench.json")  # doctest: +SKIP
        True
    """
    with open(path, encoding="utf-8") as f:
        text = f.read()
    begin, end = text.find(README_BEGIN), text.find(README_END)
    if begin < 0 or end < begin:
        raise ValueError(f"{path} has no section between the lines {README_BEGIN!r} and "
                         f"{README_END!r}: add them where the table belongs")  # fmt: skip
    table = readme_table(doc, source, fm)
    new = text[: begin + len(README_BEGIN)] + "\n" + table + "\n" + text[end:]
    if new != text and not check:
        with open(path, "w", encoding="utf-8") as f:
            f.write(new)
    return new != text
