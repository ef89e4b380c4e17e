"""Small models shared by the runtime tests."""

from __future__ import annotations

import torch
import torch.nn as nn


def dynamo_graph(model, *inputs):
    """The Dynamo FX graph of ``model`` called on ``inputs``, untouched, and its example
    inputs (static shapes), as a backend receives them."""
    seen = {}

    def backend(gm, example_inputs):
        seen["gm"], seen["args"] = gm, list(example_inputs)
        return gm.forward

    torch._dynamo.reset()  # many models share one forward's code: no recompile limit
    torch.compile(model, backend=backend, dynamic=False)(*inputs)
    return seen["gm"], seen["args"]


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


def compile_and_land(make_inputs, keep: dict, executor: str = "inductor"):
    """A ``check_training`` ``compile_fn``: autopar with ``executor`` alone on its ladder,
    built at once (``background=False``); two steps (the first captures, the second builds
    and runs it), then the model's own state back, so the check starts from it.
    ``keep["m"]`` is the compiled module."""
    import copy

    import autopar
    from autopar.profiling.store import ProfileStore

    def compile_fn(m):
        state = copy.deepcopy(m.state_dict())
        cm = autopar.compile(m, executors=(executor,), background=False,
                             store=ProfileStore.memory())  # fmt: skip
        for _ in range(3):
            out = cm(*make_inputs())
            (out[0] if isinstance(out, tuple) else out).sum().backward()
        m.load_state_dict(state)
        m.zero_grad(set_to_none=True)
        keep["m"] = cm
        return cm

    return compile_fn


def race_side_by_side(model, x, steps: int, executors=("eager", "plan", "inductor"),
                      verdicts: list | None = None):
    """``model`` compiled by autopar with the judge racing ``executors`` (built at once),
    trained ``steps`` steps beside its eager twin (:func:`train_side_by_side`). Returns
    ``(cmodel, eager, pipeline, the executors that ran steps)``; ``verdicts``, if given,
    collects the judge's verdicts after every step."""
    import copy

    import autopar
    from autopar.profiling.store import ProfileStore

    eager = copy.deepcopy(model)
    cmodel = autopar.compile(model, executors=executors, background=False,
                             store=ProfileStore.memory())  # fmt: skip
    pipe = cmodel._autopar_pipeline
    ran = set()
    def between(step):
        ran.add(pipe.variant)
        if verdicts is not None:
            verdicts.extend(v for v, _ in pipe.runtime.judge.report().values() if v)

    train_side_by_side(cmodel, eager, x, steps, between)
    return cmodel, eager, pipe, ran
