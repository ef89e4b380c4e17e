"""Small models shared by the tier tests."""

from __future__ import annotations

import torch
import torch.nn as nn


class BranchyNet(nn.Module):
    """Two branches (one with BatchNorm and dropout, so its graphs write buffers and draw
    random numbers) summed into a head."""

    def __init__(self):
        super().__init__()
        self.a = nn.Sequential(nn.Linear(16, 32), nn.BatchNorm1d(32), nn.Dropout(0.2))
        self.b = nn.Sequential(nn.Linear(16, 32), nn.Tanh())
        self.head = nn.Linear(32, 3)

    def forward(self, x):
        return self.head(self.a(x).relu() + self.b(x))


def train_side_by_side(cmodel, eager, x, steps: int, between=None, lr: float = 0.1) -> list:
    """``steps`` SGD steps of the compiled model and of its eager twin, each step under the
    same seed (the same dropout masks). After each step the outputs agree and the generator
    is where an eager step leaves it (measuring consumed no random numbers). ``between(step)``
    runs after each step. Returns the set of the compiled model's executors per step."""
    import autopar

    opts = [torch.optim.SGD(m.parameters(), lr=lr) for m in (cmodel, eager)]
    seen = []
    for step in range(steps):
        outs, states = [], []
        for m, opt in zip((cmodel, eager), opts, strict=True):
            torch.manual_seed(100 + step)
            out = m(x)
            out.square().mean().backward()
            opt.step()
            opt.zero_grad()
            outs.append(out.detach())
            states.append(torch.get_rng_state())
        torch.testing.assert_close(outs[0], outs[1], rtol=1e-5, atol=1e-5)
        assert torch.equal(states[0], states[1]), f"step {step}: the generator moved"
        seen.append({u.executor for u in autopar.graphs(cmodel)})
        if between is not None:
            between(step)
    return seen
