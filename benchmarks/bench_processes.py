"""`autopar bench` in several fresh processes: how much of one run's ratio is luck of layout?

One `autopar bench` run interleaves its contenders in one process, so noise on the machine
hits them alike. It does not even out the process's own state. On the 2-core box, eager's
step of the multi-tower MLP took 3.5-3.8 ms in one process and 6.4-6.6 ms in the next, with
the same code; heap allocations kept alive flipped it within a process. Each contender owns
its buffers, so one run's `autopar / best` for such a model depends on which state each
contender drew.

This script runs the bench once per process (`python -m autopar.tools.cli bench` with the
same options, a fresh profile store each), then prints every run's medians and ratio and,
per model, the median ratio across runs with its range: a figure that no single layout
decides.

Run::

    .venv/bin/python ../shared/tools/quiet-check --wait 60
    .venv/bin/python benchmarks/bench_processes.py --processes 5 --models towers
    .venv/bin/python benchmarks/bench_processes.py --processes 3 --models towers -- --block 8

Options after ``--`` go to each `autopar bench` run as they are.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

CONTENDERS = ("eager", "torch.compile", "autopar")


def run_once(models: str, extra: list[str], workdir: Path, k: int) -> list[dict]:
    """One bench run in a fresh process; its per-model results (the JSON's ``results``)."""
    out = workdir / f"run{k}.json"
    cmd = [sys.executable, "-m", "autopar.tools.cli", "bench", "--models", models,
           "--store", str(workdir / f"run{k}-profiles"), "--out", str(out), *extra]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True)
    (workdir / f"run{k}.log").write_text(proc.stdout + proc.stderr)
    if proc.returncode != 0 or not out.exists():
        tail = (proc.stdout + proc.stderr).strip().splitlines()[-3:]
        raise SystemExit(f"bench run {k} failed (rc={proc.returncode}): " + " | ".join(tail))
    return json.loads(out.read_text())["results"]


def row(res: dict) -> dict:
    """Medians (ms), autopar against the best of eager and torch.compile (the bench's own
    ``speedup_vs_best``), and the race."""
    cs = res["contenders"]
    ms = {c: cs[c]["median_step_ms"] for c in CONTENDERS if c in cs and not cs[c]["error"]}
    races = (res.get("autopar") or {}).get("race") or []
    verdict = ", ".join(r.get("verdict") or "none" for r in races) or "?"
    return {**ms, "ratio": cs["autopar"]["speedup_vs_best"], "race": verdict}


def summarize(runs: list[list[dict]]) -> str:
    """Every run's row per model, then the median ratio across runs and its range."""
    lines = []
    for name in [r["model"] for r in runs[0]]:
        rows = [row(r) for run in runs for r in run if r["model"] == name]
        lines.append(f"== {name}: {len(rows)} processes")
        lines.append("   run  eager ms  torch.compile ms  autopar ms  autopar/best  race")
        for k, r in enumerate(rows, 1):
            tc = r.get("torch.compile", float("nan"))
            lines.append(f"   {k:>3}  {r['eager']:8.3f}  {tc:16.3f}  {r['autopar']:10.3f}  "
                         f"{r['ratio']:11.2f}x  {r['race']}")  # fmt: skip
        ratios = [r["ratio"] for r in rows]
        lines.append(f"   median autopar/best {statistics.median(ratios):.2f}x "
                     f"(range {min(ratios):.2f}-{max(ratios):.2f}x)")  # fmt: skip
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    ours = argv[: argv.index("--")] if "--" in argv else argv
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--processes", type=int, default=3, help="bench runs, one process each")
    ap.add_argument("--models", default="towers", help="comma-separated bench models")
    ap.add_argument("--keep", default=None, help="directory for the runs' JSON and logs")
    a = ap.parse_args(ours)
    if a.processes < 1:
        ap.error("--processes must be at least 1")
    workdir = Path(a.keep or tempfile.mkdtemp(prefix="autopar-bench-processes-"))
    workdir.mkdir(parents=True, exist_ok=True)
    runs = []
    for k in range(1, a.processes + 1):
        runs.append(run_once(a.models, extra, workdir, k))
        print(f"run {k}/{a.processes} done", flush=True)
    print(summarize(runs))
    print(f"runs' JSON and logs: {workdir}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
