"""Replay the step race's rules on recorded training steps (issue 12, 2026-12-02).

The race (``autopar.runtime.race``) picks a module's executor from eight to twenty steps per
contender (five to fifteen before). On a 2-core box a step's interquartile range can be 25%
of its median, so which rule decides near-ties matters more than the clock. This script
records what the race sees and replays it through two rules:

* ``collect``: settle autopar on one bench model with every contender kept runnable, then
  run ``--rounds`` rounds of the race's pattern (each contender ``RUN`` consecutive steps,
  the last one recorded: eager, compiled, joint, split), plus a turn of ``torch.compile``
  per round. Writes the recorded seconds as JSON.
* ``replay``: from every starting round, feed the recorded steps to the shipped
  :class:`~autopar.runtime.race.StepRace` (per-round ratios against the reference, ``joint``
  where it races) and to the rule before it (separate medians, ``compiled`` the reference:
  :func:`previous_rule`), and print how often each contender was chosen and what the choice
  is worth: its per-round time against the best of eager and ``torch.compile``, over all
  rounds (> 1: faster than the best peer).

Usage::

    python benchmarks/race_replay.py collect bert --rounds 200 --out results/race/bert.json
    python benchmarks/race_replay.py replay results/race/*.json
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import time
from unittest import mock

from autopar.runtime.race import RUN, UNCLEAR, StepRace


def collect(model_name: str, rounds: int, out: str) -> None:
    import torch

    import autopar
    from autopar.pipeline import Pipeline
    from autopar.tools.bench_models import BENCH_MODELS, make_loss
    from autopar.tools.bench_settle import _settled

    spec = BENCH_MODELS[model_name]
    torch.manual_seed(0)
    model, inputs = spec.make(), spec.make_inputs()
    with torch.no_grad():
        loss_fn = make_loss(spec, model(*inputs))
    mods = {"tc": torch.compile(copy.deepcopy(model)), "ap": autopar.compile(copy.deepcopy(model))}
    opts = {k: torch.optim.SGD(m.parameters(), lr=0.01) for k, m in mods.items()}

    def step(k: str) -> float:
        t0 = time.perf_counter()
        opts[k].zero_grad(set_to_none=True)
        loss_fn(mods[k](*inputs)).backward()
        opts[k].step()
        return time.perf_counter() - t0

    # Keep every whole-graph candidate runnable after the race's verdict (the pipeline
    # would otherwise swap the winner in and drop the others), and the kept planned
    # programs too (a "compiled" verdict drops them, after which "plan" turns ran the
    # tier's programs): measurement-only patches.
    from autopar.runtime.planned import KeptPlans

    with mock.patch.object(Pipeline, "_settle_graphs", lambda self, key: None), \
            mock.patch.object(KeptPlans, "settle", lambda self, key, verdict, reason: []):
        for k in mods:
            step(k)
        pipe = mods["ap"]._autopar_pipeline
        for n in range(300):
            if _settled(pipe):
                break
            if n % 20 == 0:
                autopar.wait(mods["ap"])
            step("ap")
        (race,) = pipe.race._races.values()  # one input signature
        names = list(race.samples)
        print(f"{model_name}: {race.reason}", file=sys.stderr)
        got: dict[str, list[float]] = {k: [] for k in [*names, "tc"]}
        for _ in range(rounds):
            for k in got:
                if k != "tc":
                    race.verdict = k  # the contender of this turn's autopar steps
                for _ in range(RUN):
                    t = step("ap" if k != "tc" else "tc")
                got[k].append(t)  # the turn's last step
    with open(out, "w") as f:
        json.dump({"model": model_name, "samples": got}, f)
    print({k: round(statistics.median(v) * 1e3, 2) for k, v in got.items()}, "ms")


def shipped_rule(s: dict[str, list[float]], i0: int) -> tuple[str, int] | None:
    """The shipped StepRace fed the recorded rounds from ``i0``: (verdict, rounds used)."""
    race, t, used = StepRace(), 0.0, {k: 0 for k in s}
    race.choose("k", t)
    for name in s:
        if name not in ("eager", "compiled"):
            race.add(name, "k")
    while (who := race.choose("k", t)) and race.verdict("k") is None:
        if i0 + used[who] >= len(s[who]):
            return None
        for _ in range(RUN - 1):  # the turn's first steps: not counted, any length will do
            who = race.choose("k", t := t + s[who][i0 + used[who]])
        t += s[who][i0 + used[who]]
        used[who] += 1
    return race.verdict("k"), max(used.values())


def previous_rule(s: dict[str, list[float]], i0: int) -> tuple[str, int] | None:
    """The rule before 2026-12-02: separate medians, ``compiled`` the reference, eager at
    ``MARGIN`` 1.0 and the others at ``ADDED_MARGIN`` 0.97, 5 to 15 samples each; near-ties
    race on (its clearly-behind rule, which mostly saves turns, is left out)."""
    prefer = ["compiled", *(k for k in s if k not in ("eager", "compiled")), "eager"]
    scale = {k: 1.0 if k in ("eager", "compiled") else 1 / 0.97 for k in prefer}
    for n in range(5, 16):
        if i0 + n > len(s["eager"]):
            return None
        score = {k: statistics.median(s[k][i0 : i0 + n]) * scale[k] for k in prefer}
        ranked = sorted(prefer, key=lambda k: score[k])
        if score[ranked[1]] - score[ranked[0]] >= UNCLEAR * score[ranked[0]] or n == 15:
            return ranked[0], n
    return None


def replay(paths: list[str]) -> None:
    for path in paths:
        with open(path) as f:
            data = json.load(f)
        s = {k: v for k, v in data["samples"].items() if k != "tc"}
        tc = data["samples"]["tc"]
        vs_tc = {k: statistics.median(a / b for a, b in zip(v, tc, strict=True))
                 for k, v in s.items()}  # fmt: skip
        peer = min(vs_tc["eager"], 1.0)  # the best of eager and torch.compile, per round
        worth = {k: peer / v for k, v in vs_tc.items()}
        print(f"{data['model']}: worth vs the best peer, all {len(tc)} rounds: "
              + ", ".join(f"{k} {w:.3f}" for k, w in worth.items()))  # fmt: skip
        for label, rule in (("previous", previous_rule), ("shipped", shipped_rule)):
            got = [r for i0 in range(len(tc)) if (r := rule(s, i0)) is not None]
            picks = {k: sum(v == k for v, _ in got) / len(got) for k in s}
            mean_worth = statistics.mean(worth[v] for v, _ in got)
            steps = statistics.mean(n for _, n in got)
            print(f"  {label:8s} rule, {len(got)} replays: worth {mean_worth:.3f} on average, "
                  f"{steps:.1f} steps each; chose "
                  + ", ".join(f"{k} {p:.0%}" for k, p in picks.items() if p))  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("collect")
    c.add_argument("model")
    c.add_argument("--rounds", type=int, default=200)
    c.add_argument("--out", required=True)
    r = sub.add_parser("replay")
    r.add_argument("paths", nargs="+")
    args = parser.parse_args()
    if args.cmd == "collect":
        collect(args.model, args.rounds, args.out)
    else:
        replay(args.paths)


if __name__ == "__main__":
    main()
