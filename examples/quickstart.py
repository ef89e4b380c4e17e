"""The README's 10-line example: your own model, trained through autopar exactly as before.

    python examples/quickstart.py

Two independent branches give autopar work to run at once. The first step profiles and plans
(about a second); the profile store goes to ~/.cache/autopar/profiles.
"""

import torch
import torch.nn as nn

import autopar


class TwoTowers(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 10))
        self.b = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 10))

    def forward(self, x):
        return self.a(x) + self.b(x)


model = TwoTowers()
opt = torch.optim.SGD(model.parameters(), lr=0.05)  # built on the model, as usual
cmodel = autopar.compile(model)  # same Parameters, same state_dict
for step in range(30):
    x, y = torch.randn(32, 64), torch.randint(0, 10, (32,))
    loss = nn.functional.cross_entropy(cmodel(x), y)
    opt.zero_grad()
    loss.backward()
    opt.step()
print(f"step {step}: loss {loss.item():.3f}")
print(autopar.explain(cmodel))  # which executor runs each graph, and why
