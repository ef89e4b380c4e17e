"""Can independent branches beat eager by running on two threads? Module-level branch threads
on the multi-tower MLP, measured against eager in one process.

The design tried (issue 12's "module-level segments whose backward runs in the autograd
engine"): the towers of ``zoo.MultiTowerMLP`` are split into two halves. Forward: one half
runs on the calling thread, the other on a persistent worker thread, each at one intra-op
thread (ATen releases the GIL inside every op). Backward: an ``autograd.Function`` joins the
halves; its backward calls ``torch.autograd.backward`` for each half on its own thread, so both
halves' backward graphs run in the C++ autograd engine at once, and returns the input's
gradient. Parameters get their gradients from the engine as in eager (gradients checked
equal to eager's below).

Contenders, interleaved ABBA in one process (median step, ratio = eager / contender):

* ``eager``: the model as it is, at the caller's intra-op threads (2 here);
* ``branches, serial``: the same split and ``autograd.Function`` on the calling thread only:
  what the structure itself costs;
* ``branch threads``: the two halves on two threads, one intra-op thread each; the calling
  thread's idle OpenMP team is released first (``runtime.streams.release_idle_omp_team``),
  so it does not spin on the core the worker needs.

Run::

    .venv/bin/python ../shared/tools/quiet-check --wait 60
    .venv/bin/python benchmarks/branch_threads.py [--rounds 300] [--batch 32]
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time
from concurrent.futures import ThreadPoolExecutor

import torch
import torch.nn.functional as F

from autopar.runtime.streams import (
    intra_op_threads,
    release_idle_omp_team,
    set_thread_local_threads,
)
from autopar.tools import zoo


class _JoinBranches(torch.autograd.Function):
    """Forward: the branches' outputs, detached (their graphs stay with ``ctx``). Backward:
    each half's graph through the engine on its own thread; returns the input's gradient."""

    @staticmethod
    def forward(ctx, x, anchor, state):
        ctx.state = state
        return tuple(o.detach() for o in state["outs"])

    @staticmethod
    def backward(ctx, *grads):
        state = ctx.state
        outs, inputs, run = state["outs"], state["inputs"], state["run"]

        def engine(idx):
            torch.autograd.backward([outs[i] for i in idx], [grads[i] for i in idx])

        run(engine)
        gx = inputs[0].grad
        for xi in inputs[1:]:
            gx = gx + xi.grad
        return gx, None, None


class BranchRunner:
    """Runs ``model.towers`` in two halves: on the calling thread and (``threaded``) on one
    worker thread, each at one intra-op thread."""

    def __init__(self, model, threaded: bool):
        self.model, self.threaded = model, threaded
        self.pool = ThreadPoolExecutor(1) if threaded else None
        if self.pool is not None:
            self.pool.submit(set_thread_local_threads, 1).result()

    def run(self, fn):
        """``fn(indices)`` for both halves of the towers; their results in tower order."""
        n = len(self.model.towers)
        first, second = range(n // 2), range(n // 2, n)
        if self.pool is None:
            return fn(first) + fn(second)
        release_idle_omp_team()
        later = self.pool.submit(fn, second)
        with intra_op_threads(1):
            head = fn(first)
        return head + later.result()

    def forward(self, x):
        towers = self.model.towers
        inputs = [x.detach().requires_grad_() for _ in towers]
        outs = self.run(lambda idx: [F.relu(towers[i](inputs[i])) for i in idx])
        state = {"outs": outs, "inputs": inputs, "run": lambda f: self.run(lambda i: f(i) or [])}
        anchor = torch.empty(0, requires_grad=True)  # makes the join part of the graph
        joined = _JoinBranches.apply(x, anchor, state)
        return self.model.head(torch.cat(joined, dim=1))


def check_gradients(model, x, target) -> float:
    """Largest |grad difference| between eager and branch threads, from equal weights."""
    a, b = copy.deepcopy(model), copy.deepcopy(model)
    F.mse_loss(a(x), target).backward()
    F.mse_loss(BranchRunner(b, threaded=True).forward(x), target).backward()
    return max(
        (p.grad - q.grad).abs().max().item()
        for p, q in zip(a.parameters(), b.parameters(), strict=True)
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=300, help="interleaved timed rounds")
    ap.add_argument("--batch", type=int, default=32, help="batch size (the zoo's is 32)")
    args = ap.parse_args(argv)
    torch.manual_seed(0)
    model = zoo.MultiTowerMLP()
    x, target = torch.randn(args.batch, 64), torch.randn(args.batch, 1)
    print(
        f"multi-tower MLP (4 towers x 4 x 256), batch {args.batch}, "
        f"{torch.get_num_threads()} intra-op threads; max |grad difference| eager vs "
        f"branch threads: {check_gradients(model, x, target):.2e}"
    )
    contenders = {}
    for name, threaded in (("eager", None), ("branches, serial", False), ("branch threads", True)):
        m = copy.deepcopy(model)
        opt = torch.optim.SGD(m.parameters(), lr=1e-3)
        fwd = m if threaded is None else BranchRunner(m, threaded).forward

        def step(m=m, opt=opt, fwd=fwd):
            opt.zero_grad()
            F.mse_loss(fwd(x), target).backward()
            opt.step()

        contenders[name] = step
    times = {k: [] for k in contenders}
    order = list(contenders)
    for r in range(args.rounds + 10):
        for k in order if r % 2 == 0 else order[::-1]:  # ABBA
            t0 = time.perf_counter()
            contenders[k]()
            if r >= 10:  # the first rounds warm up
                times[k].append(time.perf_counter() - t0)
    eager = statistics.median(times["eager"])
    print(f"{'contender':<18} {'step ms':>8} {'eager/x':>8}")
    for k, v in times.items():
        med = statistics.median(v)
        print(f"{k:<18} {med * 1e3:8.3f} {eager / med:7.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
