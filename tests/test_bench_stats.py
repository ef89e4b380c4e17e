"""The bench's bootstrap interval for a ratio of medians (``tools.bench_stats``)."""

from __future__ import annotations

import random

import numpy as np
import torch

from autopar.tools.bench_report import vs_best
from autopar.tools.bench_stats import ratio_interval


def test_interval_holds_the_ratio_and_narrows_with_more_rounds():
    rng = np.random.default_rng(1)
    ref = 1.0 + 0.1 * rng.standard_normal(200)
    con = 1.25 * (1.0 + 0.1 * rng.standard_normal(200))  # 25% slower: ratio ~0.8
    lo, hi = ratio_interval(ref, con)
    assert lo < float(np.median(ref) / np.median(con)) < hi
    assert 0.7 < lo < hi < 0.9
    lo20, hi20 = ratio_interval(ref[:20], con[:20])
    assert hi20 - lo20 > hi - lo  # fewer rounds, wider interval


def test_paired_rounds_cancel_a_shared_slow_phase():
    """Interleaved rounds: a slow phase hits both sides of a round alike. Paired, the
    interval of two equal contenders is exactly 1.00; with unequal counts (unpaired) the
    shared drift widens it."""
    drift = np.linspace(1.0, 2.0, 40)
    assert ratio_interval(drift, drift) == (1.0, 1.0)
    lo, hi = ratio_interval(drift, drift[:-1])
    assert lo < 1.0 < hi


def test_too_few_samples_give_no_interval_and_no_global_rng_is_touched():
    state = (torch.get_rng_state(), np.random.get_state()[1].copy(), random.getstate())
    assert ratio_interval([1.0, 1.0, 1.0], [1.0] * 10) is None
    ratio_interval([1.0, 1.1, 0.9, 1.0, 1.2], [1.0, 1.0, 1.1, 0.9, 1.0])
    assert torch.equal(torch.get_rng_state(), state[0])
    assert (np.random.get_state()[1] == state[1]).all() and random.getstate() == state[2]


def test_vs_best_cell():
    row = {"error": None, "speedup_vs_best": 0.96, "vs_best_interval": (0.921, 1.013)}
    assert vs_best(row) == "0.96x (0.92-1.01)"
    assert vs_best({**row, "vs_best_interval": None}) == "0.96x"  # older bench files
    assert vs_best({**row, "error": "boom"}) == "failed" and vs_best(None) == "skipped"
