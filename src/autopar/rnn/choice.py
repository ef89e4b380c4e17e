"""The measured choice between the forms of ``nn.LSTM`` / ``nn.GRU`` (:mod:`autopar.rnn.layers`).

At the first call of a shape under ``rewrite_rnns`` each form is timed forward+backward on
random data of the actual shapes (throw-away copies of the weights; best of a few reps), at
the default intra-op thread count and at half of it. The whole unrolled module is timed as
it is (no credit for concurrency: its per-step ops are dispatch/GIL bound). Fused and
chunked pieces (one ``fused_lstm_layer`` / ``fused_gru_layer`` call each) are timed one
call each; their dependency graph is then handed to the planner's list scheduler and
simulator (``autopar.planning.listsched.list_schedule``) twice: on one stream at the
default thread count, and on two streams at half the threads (one ``sync_s`` per
cross-stream edge), each piece slowed by the measured speedup of two pieces run at once on
two threads (a busy or shared second core gives ~1x, so concurrency is then not counted
on). The lower of the two predictions is the form's; another form must beat ``fused`` by
``MARGIN`` (25%). Choices are cached in memory per shape key and thread count by the
caller (not in the profile store: a choice depends on the machine's load).

On CUDA nothing is timed: :func:`cuda_rnn_form` leaves the module to cuDNN.

Example::

    spec = RNNSpec(steps=32, batch=16, input=64, hidden=128, layers=4, dirs=1, bias=True,
                   dtype="float32", barrier=False, mode="gru")
    (form, k), predicted = choose_rnn_form(spec, measure_rnn_forms(spec))
"""

from __future__ import annotations

import math
import os
import threading
import time
from typing import NamedTuple

import networkx as nx
import torch
from torch import nn

from autopar.planning.costmodel import MachineModel
from autopar.planning.listsched import list_schedule
from autopar.planning.plan import Stream
from autopar.rnn.cells import fused_lstm_layer
from autopar.rnn.forms import _run_rnn
from autopar.rnn.gru import fused_gru_layer

__all__ = [
    "RNNSpec", "choose_rnn_form", "cuda_rnn_form", "measure_rnn_forms", "predict_rnn_form",
]  # fmt: skip

CHUNK_CANDIDATES = (2, 4)  # k the chooser tries
# The simulator's inputs here are the measured piece times; these three constants cover
# what it cannot see from them:
#
# unrolled/chunked must be predicted this much faster than fused: the simulator's error on
# these piece schedules. 0.25, not less: on the 2-core box (quiet, 2 threads) the
# prediction put chunked:2 ahead of fused at hidden 256 and 128, and it measured 0.87x and
# 0.71x of eager against fused 0.95x and 0.88x.
MARGIN = 0.25
# ... and a chunked form's simulated time on ONE stream may be at most this much above
# fused's. The two-stream wavefront is only this simulation of the pieces; the planner,
# from the per-op profile of the whole graph, and the first-call measurement decide later
# whether the chunked graph really runs on two streams, and on the 2-core box they often
# kept one: the chooser's chunked:2 picks then measured 0.84x and 0.82x of eager where
# fused measured 0.96x and 0.92x (LSTM hidden 256 and 128). This bounds that downside.
DOWNSIDE = 0.05
# ... and chunked forms are candidates only from this many cores on. Below 4 cores the
# simulated wavefront runs two ONE-thread streams, which the planner can only reproduce
# with its 2x1 layout (every other op of the step single-threaded too) or its mixed layout
# (a 2-thread and a 1-thread stream on 2 cores, oversubscribed: the simulator's
# OVERSUBSCRIBED_TEAM_RATE): costs outside the pieces simulated here. On the 2-core box
# the chooser still picked chunked:2 at hidden 256 now and then (its fw+bw piece timings
# credit the wavefront more than the planner's per-op profile does), and chunked forms
# measured 0.74-0.88x of eager against fused 0.86-0.96x in every LSTM run
# (docs/benchmarks.md). Gating also saves timing their pieces at the first call.
MIN_CORES_CHUNKED = 4
SYNC_S = 50e-6  # one cross-stream handoff in the prediction (events + wake-up)
REPS = 3  # timed reps per measurement (best of), after one warm-up


class RNNSpec(NamedTuple):
    """Shape key of one nn.LSTM / nn.GRU call (``barrier``: train-mode dropout between layers)."""

    steps: int
    batch: int
    input: int
    hidden: int
    layers: int
    dirs: int
    bias: bool
    dtype: str
    barrier: bool
    mode: str = "lstm"  # or "gru"


def _chunk_lengths(steps: int, k: int) -> list[int]:
    """The time lengths ``torch.chunk(x, k)`` gives (it may give fewer than k chunks)."""
    size = math.ceil(steps / k)
    return [min(size, steps - s) for s in range(0, steps, size)]


def _pieces(spec: RNNSpec, k: int):
    """Pieces (layer, dir, chunk) in issue order, with their deps and (input size, steps)."""
    lens = _chunk_lengths(spec.steps, k)
    n = len(lens)
    out = []
    for layer in range(spec.layers):
        in_size = spec.input if layer == 0 else spec.hidden * spec.dirs
        for d in range(spec.dirs):
            for j in range(n - 1, -1, -1) if d else range(n):
                deps = []
                prev = j + 1 if d else j - 1
                if 0 <= prev < n:
                    deps.append((layer, d, prev))
                if layer:  # layer input chunk(s): both directions' outputs
                    js = range(n) if spec.barrier else (j,)
                    deps += [(layer - 1, dd, jj) for dd in range(spec.dirs) for jj in js]
                out.append(((layer, d, j), deps, (in_size, lens[j])))
    return out


def _threads() -> tuple[int, int]:
    """(default intra-op threads, half of them): the two settings pieces are timed at."""
    default = torch.get_num_threads()
    return default, max(1, default // 2)


def _simulated(pieces, cost: dict, streams: int, threads: int, sync_s: float) -> float:
    """The planner's prediction (``listsched.list_schedule``) for ``pieces`` on ``streams``
    CPU streams of ``threads`` threads each, a piece of shape ``s`` taking ``cost[s]``.

    Simulator inputs: the measured piece times as the cost table, ``sync_s`` as the sync
    cost, and at least as many cores as the default thread count (the pieces were timed at
    that count, so their times already include any oversubscription it causes); with more
    threads than cores the simulator charges the contention itself.
    """
    graph = nx.DiGraph()
    for key, deps, _ in pieces:
        graph.add_node(key)
        graph.add_edges_from((d, key) for d in deps)
    machine = MachineModel(
        cores=max(_cores(), _threads()[0]), sync_cost_s=sync_s, source="rnn.choice"
    )
    costs = {("cpu", threads): {key: cost[shape] for key, _, shape in pieces}}
    lanes = [Stream(i, "cpu", threads) for i in range(streams)]
    return list_schedule(graph, lanes, machine, costs).makespan


def predict_rnn_form(spec: RNNSpec, form: str, k: int, timings: dict, sync_s=SYNC_S) -> float:
    """Predicted forward+backward seconds of one form from :func:`measure_rnn_forms`'s
    ``timings``: ``"unrolled"`` -> (t_default, t_half) of the whole module,
    ``(input_size, steps)`` -> (t_default, t_half) of one fused call, and ``"pair"`` -> the
    measured speedup (1..2) of two such calls run at once on two threads vs one after the
    other (1: the second core is busy or shared; concurrency buys nothing).

    The best of the simulated one-stream schedule at the default threads and two-stream
    schedule at half the threads, each piece's half-thread time divided by
    ``pair / 2`` there (the interference of two pieces at once, which the simulator's
    contention model, oversubscription only, does not see)."""
    if form == "unrolled":
        return min(timings["unrolled"])
    serial = _serial_time(spec, form, k, timings, sync_s)
    slow = 2.0 / min(2.0, max(1.0, timings.get("pair", 2.0)))  # per piece, when overlapped
    half = {key: t[1] * slow for key, t in timings.items() if isinstance(key, tuple)}
    pieces = _pieces(spec, k if form == "chunked" else 1)
    return min(serial, _simulated(pieces, half, 2, _threads()[1], sync_s))


def _serial_time(spec: RNNSpec, form: str, k: int, timings: dict, sync_s=SYNC_S) -> float:
    """The simulated pieces of a fused/chunked form on one stream at the default threads
    (one after the other: the sum of their times)."""
    pieces = _pieces(spec, k if form == "chunked" else 1)
    default = {key: t[0] for key, t in timings.items() if isinstance(key, tuple)}
    return _simulated(pieces, default, 1, _threads()[0], sync_s)


def _chunked_candidates(spec: RNNSpec) -> bool:
    """Whether chunked forms are timed and considered (see MIN_CORES_CHUNKED)."""
    return not spec.barrier and _cores() >= MIN_CORES_CHUNKED


def _cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def choose_rnn_form(spec: RNNSpec, timings: dict, sync_s=SYNC_S):
    """``((form, k), {candidate: predicted seconds})`` -- deterministic given ``timings``."""
    cands = [("fused", 1), ("unrolled", 1)]
    if _chunked_candidates(spec):
        cands += [("chunked", k) for k in CHUNK_CANDIDATES if k <= spec.steps]
    pred = {c: predict_rnn_form(spec, *c, timings, sync_s) for c in cands}
    fused_serial = _serial_time(spec, "fused", 1, timings, sync_s)

    def bounded(c) -> bool:  # see DOWNSIDE
        if c[0] != "chunked":
            return True
        return _serial_time(spec, *c, timings, sync_s) <= fused_serial * (1 + DOWNSIDE)

    fast = [
        c for c in cands[1:] if pred[c] < pred[("fused", 1)] * (1 - MARGIN) and bounded(c)
    ]
    return min(fast, key=lambda c: (pred[c], cands.index(c)), default=("fused", 1)), pred


def cuda_rnn_form(forced: str | None = None, timings: dict | None = None) -> tuple[str, int]:
    """The form of an nn.LSTM / nn.GRU whose tensors are on CUDA, decided without running
    anything (nothing is timed at the first call on CUDA).

    ``("cudnn", 1)``: the module's own forward, ONE fused cuDNN call for all layers and
    directions, forward and backward, where the unrolled form launches a GEMM, a Triton
    cell kernel and their autograd bookkeeping from Python at every step (~9 launches per
    step with the backward). That is the default.

    ``forced``: the form name of an override (``rewrite_rnns(rnn_form=...)``):
    ``"unrolled"`` keeps the per-step Triton cells; ``"fused"``, ``"chunked"`` and
    ``"cudnn"`` all mean cuDNN on CUDA (cuDNN's layer is the fused layer there, and it has
    no time-chunk entry point a plan could schedule). ``timings``: measured forward+backward
    seconds ``{"cudnn": s, "unrolled": s}`` (``benchmarks/gpu_validate.py`` prints them);
    the unrolled form is chosen only when it beats cuDNN by ``MARGIN``.

    Example::

        >>> cuda_rnn_form()
        ('cudnn', 1)
        >>> cuda_rnn_form("unrolled")
        ('unrolled', 1)
    """
    if forced is not None:
        return ("unrolled", 1) if forced == "unrolled" else ("cudnn", 1)
    if timings and timings.get("unrolled", math.inf) < timings.get("cudnn", 0.0) * (1 - MARGIN):
        return "unrolled", 1
    return "cudnn", 1


def _name(choice: tuple[str, int]) -> str:
    return f"chunked:{choice[1]}" if choice[0] == "chunked" else choice[0]


def _time(fn) -> float:
    fn()
    best = math.inf
    for _ in range(REPS):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def measure_rnn_forms(spec: RNNSpec) -> dict:
    """Time the unrolled module and every distinct fused piece (see the module doc).

    The global RNG is left as it was (the user's dropout masks must not change)."""
    with torch.random.fork_rng(devices=[]):
        return _measure(spec)


def _measure(spec: RNNSpec) -> dict:
    from autopar.runtime.streams import intra_op_threads

    dtype = getattr(torch, spec.dtype)
    gru = spec.mode == "gru"
    gates = (3 if gru else 4) * spec.hidden
    cls = nn.GRU if gru else nn.LSTM
    rnn = cls(spec.input, spec.hidden, spec.layers, spec.bias, bidirectional=spec.dirs == 2,
              dtype=dtype)  # fmt: skip
    x = torch.randn(spec.steps, spec.batch, spec.input, dtype=dtype)
    zeros = x.new_zeros(spec.layers * spec.dirs, spec.batch, spec.hidden)

    def unrolled():
        out, h, c = _run_rnn(rnn, x, zeros, None if gru else zeros, False)
        out.sum().backward()

    def piece(in_size, steps):
        xp = torch.randn(steps, spec.batch, in_size, dtype=dtype, requires_grad=True)
        w = [p.detach().clone().requires_grad_() for p in (rnn.weight_ih_l0, rnn.weight_hh_l0)]
        if in_size != spec.input:  # nn.LSTM/GRU's own init scale: unit-scale random weights
            # saturate the gates and fill the backward with denormals, timed 1.6x slower
            k = spec.hidden**-0.5
            w[0] = torch.empty(gates, in_size, dtype=dtype).uniform_(-k, k).requires_grad_()
        b = [torch.zeros(gates, dtype=dtype, requires_grad=True)] * 2
        b = b if spec.bias else [None, None]
        h0 = zeros[0]

        def run():
            if gru:
                out, _ = fused_gru_layer(xp, *w, *b, h0)
            else:
                out, _, _ = fused_lstm_layer(xp, *w, *b, h0, h0)
            out.sum().backward()

        return run

    ks = (1, *CHUNK_CANDIDATES) if _chunked_candidates(spec) else (1,)
    shapes = {shape for k in ks for _, _, shape in _pieces(spec, k)}
    half = _threads()[1]
    timings: dict = {}
    with torch.enable_grad():
        for threads in (0, half):
            with intra_op_threads(threads):
                timings.setdefault("unrolled", []).append(_time(unrolled))
                for shape in sorted(shapes):
                    timings.setdefault(shape, []).append(_time(piece(*shape)))
        big = max(shapes, key=lambda s: s[0] * s[1])
        pair = _pair_speedup(piece(*big), piece(*big), half) if _cores() > 1 else 1.0
    return {key: tuple(v) for key, v in timings.items()} | {"pair": pair}


def _pair_speedup(run_a, run_b, threads: int) -> float:
    """(a then b) / (a with b on a second thread), both at ``threads`` intra-op threads."""
    from autopar.runtime.streams import (
        intra_op_threads,
        release_idle_omp_team,
        set_thread_local_threads,
    )

    def both():  # as the runtime runs two streams (run_streams)
        release_idle_omp_team()
        worker = threading.Thread(target=lambda: (set_thread_local_threads(threads), run_b()))
        worker.start()
        run_a()
        worker.join()

    with intra_op_threads(threads):
        run_a()
        run_b()
        return _time(lambda: (run_a(), run_b())) / _time(both)
