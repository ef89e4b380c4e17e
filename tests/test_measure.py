"""Multi-stream plans of graphs with dropout and BatchNorm train equal to eager under the
same seed (running statistics updated once, the RNG stream where eager leaves it), and the
guard of a built program's first call restores what a failed call changed."""

from __future__ import annotations

import copy

import torch
import torch.nn as nn
from torch.fx.experimental.proxy_tensor import make_fx

import autopar
from autopar.profiling.store import ProfileStore
from autopar.runtime.measure import SideEffectGuard, output_meta, output_mismatch, written_inputs


class TwoBranch(nn.Module):
    """Two independent branches (so a 2-stream plan exists), with BatchNorm and dropout.
    (One dropout: plans that reorder two random ops are rejected by the verifier.)"""

    def __init__(self):
        super().__init__()
        self.a = nn.Sequential(nn.Linear(16, 32), nn.BatchNorm1d(32), nn.Dropout(0.3))
        self.b = nn.Sequential(nn.Linear(16, 32), nn.BatchNorm1d(32))
        self.head = nn.Linear(32, 4)

    def forward(self, x):
        return self.head(self.a(x).relu() + self.b(x).tanh())


def _train(model, xs, seed=0):
    torch.manual_seed(seed)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    outs = []
    for x in xs:
        out = model(x)
        out.square().mean().backward()
        opt.step()
        opt.zero_grad()
        outs.append(out.detach())
    return outs, torch.rand(4)  # where the RNG stream stands afterwards


def test_a_multi_stream_plan_with_dropout_and_batchnorm_equals_eager():
    torch.manual_seed(1)
    model = TwoBranch()
    xs = [torch.randn(8, 16) for _ in range(3)]
    eager = copy.deepcopy(model)
    cmodel = autopar.compile(
        copy.deepcopy(model), streams=2, policy="round_robin", store=ProfileStore.memory()
    )
    e_out, e_rng = _train(eager, xs)
    c_out, c_rng = _train(cmodel, xs)
    assert torch.equal(c_rng, e_rng), "the compiled steps drew other random numbers"
    for a, b in zip(c_out, e_out, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    for (name, be), bc in zip(eager.named_buffers(), cmodel.buffers(), strict=True):
        if be.dtype == torch.long:  # num_batches_tracked: updated once per step, not more
            assert torch.equal(bc, be), name
        else:
            torch.testing.assert_close(bc, be, rtol=1e-5, atol=1e-6, msg=name)


def test_guard_restores_written_inputs_and_rng():
    def f(x, buf):
        buf.add_(1.0)
        return torch.dropout(x, 0.5, True) + buf

    gm = make_fx(f)(torch.ones(4), torch.zeros(4))
    assert written_inputs(gm) == [1]
    args = [torch.ones(4), torch.zeros(4)]
    guard = SideEffectGuard(args, written_inputs(gm))
    before = torch.get_rng_state()
    out = gm(*args)
    assert torch.equal(args[1], torch.ones(4))  # written, and the generator moved
    guard.restore()
    assert torch.equal(args[1], torch.zeros(4))
    assert torch.equal(torch.get_rng_state(), before)
    assert output_mismatch(out, output_meta(out)) is None
    assert "output 0 is" in output_mismatch(out[:2], output_meta(out))
