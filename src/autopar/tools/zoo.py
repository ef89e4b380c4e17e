"""The model zoo: the model families autopar is tested and benchmarked on.

Each entry is a factory plus an input maker, so tests, benchmarks, the CLI
(``autopar profile autopar.tools.zoo:inception --input-shape 8,3,16,16``) and the notebook build
the very same models.

Example::

    >>> from autopar.tools import zoo
    >>> model, inputs = zoo.build("mlp")
    >>> model(*inputs).shape
    torch.Size([16, 10])
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F


class MLP(nn.Module):
    def __init__(self, d_in: int = 32, hidden: int = 64, d_out: int = 10, depth: int = 3):
        super().__init__()
        dims = [d_in] + [hidden] * (depth - 1) + [d_out]
        self.layers = nn.ModuleList(nn.Linear(a, b) for a, b in zip(dims, dims[1:], strict=False))

    def forward(self, x):
        for i, layer in enumerate(self.layers):
            x = layer(x)
            if i < len(self.layers) - 1:
                x = F.relu(x)
        return x


class InceptionBlock(nn.Module):
    """Four branches (1x1; 1x1->3x3; 1x1->5x5; pool->1x1), concatenated: GoogLeNet's block."""

    def __init__(self, c_in: int, c: int):
        super().__init__()
        self.b1 = nn.Conv2d(c_in, c, 1)
        self.b2 = nn.Sequential(nn.Conv2d(c_in, c, 1), nn.ReLU(), nn.Conv2d(c, c, 3, padding=1))
        self.b3 = nn.Sequential(nn.Conv2d(c_in, c, 1), nn.ReLU(), nn.Conv2d(c, c, 5, padding=2))
        self.b4 = nn.Sequential(nn.MaxPool2d(3, 1, 1), nn.Conv2d(c_in, c, 1))

    def forward(self, x):
        return F.relu(torch.cat([self.b1(x), self.b2(x), self.b3(x), self.b4(x)], dim=1))


class InceptionCNN(nn.Module):
    def __init__(self, c_in: int = 3, c: int = 16, blocks: int = 2, classes: int = 10):
        super().__init__()
        self.stem = nn.Conv2d(c_in, 4 * c, 3, padding=1)
        self.blocks = nn.Sequential(*[InceptionBlock(4 * c, c) for _ in range(blocks)])
        self.head = nn.Linear(4 * c, classes)

    def forward(self, x):
        x = self.blocks(F.relu(self.stem(x)))
        return self.head(x.mean(dim=(2, 3)))


class MultiTowerMLP(nn.Module):
    """Independent towers over the same input, summed: a recommendation-model shape."""

    def __init__(self, d_in: int = 64, hidden: int = 256, towers: int = 4, depth: int = 4):
        super().__init__()
        self.towers = nn.ModuleList(MLP(d_in, hidden, hidden, depth) for _ in range(towers))
        self.head = nn.Linear(hidden * towers, 1)

    def forward(self, x):
        return self.head(torch.cat([F.relu(t(x)) for t in self.towers], dim=1))


class DeepMLP(nn.Module):
    """A plain chain: nothing to run concurrently. autopar must not cost much here."""

    def __init__(self, d: int = 512, depth: int = 8):
        super().__init__()
        self.net = MLP(d, d, d, depth)

    def forward(self, x):
        return self.net(x)


class LSTMCellStack(nn.Module):
    """A stacked LSTM written by hand: ``nn.LSTMCell`` layers in a Python loop over time."""

    def __init__(self, d_in: int = 64, hidden: int = 256, layers: int = 4):
        super().__init__()
        self.hidden = hidden
        self.cells = nn.ModuleList(
            nn.LSTMCell(d_in if i == 0 else hidden, hidden) for i in range(layers)
        )

    def forward(self, x):  # x: [batch, time, features]
        b, steps, _ = x.shape
        h = [x.new_zeros(b, self.hidden) for _ in self.cells]
        c = [x.new_zeros(b, self.hidden) for _ in self.cells]
        outs = []
        for t in range(steps):
            inp = x[:, t]
            for i, cell in enumerate(self.cells):
                h[i], c[i] = cell(inp, (h[i], c[i]))
                inp = h[i]
            outs.append(inp)
        return torch.stack(outs, dim=1)


class GRUCellStack(LSTMCellStack):
    def __init__(self, d_in: int = 64, hidden: int = 256, layers: int = 4):
        nn.Module.__init__(self)
        self.hidden = hidden
        self.cells = nn.ModuleList(
            nn.GRUCell(d_in if i == 0 else hidden, hidden) for i in range(layers)
        )

    def forward(self, x):
        b, steps, _ = x.shape
        h = [x.new_zeros(b, self.hidden) for _ in self.cells]
        outs = []
        for t in range(steps):
            inp = x[:, t]
            for i, cell in enumerate(self.cells):
                h[i] = cell(inp, h[i])
                inp = h[i]
            outs.append(inp)
        return torch.stack(outs, dim=1)


class RNNModel(nn.Module):
    """``nn.LSTM`` or ``nn.GRU`` followed by a linear head."""

    def __init__(self, kind="lstm", d_in=64, hidden=256, layers=4, bidirectional=False):
        super().__init__()
        rnn = nn.LSTM if kind == "lstm" else nn.GRU
        self.rnn = rnn(d_in, hidden, layers, batch_first=True, bidirectional=bidirectional)
        self.head = nn.Linear(hidden * (2 if bidirectional else 1), 8)

    def forward(self, x):
        out, _ = self.rnn(x)
        return self.head(out)


class Transformer(nn.Module):
    def __init__(self, d: int = 64, heads: int = 4, layers: int = 2, ff: int = 128):
        super().__init__()
        layer = nn.TransformerEncoderLayer(d, heads, ff, dropout=0.0, batch_first=True)
        self.enc = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Linear(d, 4)

    def forward(self, x):
        return self.head(self.enc(x))


class InplaceViews(nn.Module):
    """In-place ops on views, a transpose, a slice assignment and a BatchNorm buffer update."""

    def __init__(self, d: int = 16):
        super().__init__()
        self.fc = nn.Linear(d, d)
        self.bn = nn.BatchNorm1d(d)

    def forward(self, x):
        y = self.fc(x)
        y = self.bn(y)
        y.relu_()
        z = y.t().contiguous().view(-1)[: y.numel() // 2]
        z.mul_(2.0)
        w = y.clone()
        w[:, :2] += 1.0
        return torch.cat([w, y.view(y.shape[0], -1)], dim=1)


class DropoutMLP(nn.Module):
    def __init__(self, d: int = 32, p: float = 0.3):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(d, 64), nn.Linear(64, 10)
        self.drop = nn.Dropout(p)

    def forward(self, x):
        return self.fc2(self.drop(F.relu(self.fc1(x))))


class GraphBreak(nn.Module):
    """Data-dependent Python control flow: Dynamo splits the graph in two."""

    def __init__(self, d: int = 16):
        super().__init__()
        self.a, self.b, self.c = nn.Linear(d, d), nn.Linear(d, d), nn.Linear(d, d)

    def forward(self, x):
        y = self.a(x)
        if y.sum() > 0:  # a graph break: the branch depends on tensor values
            y = self.b(y)
        else:
            y = self.c(y)
        return y.tanh()


@dataclass(frozen=True)
class ZooEntry:
    factory: Callable[[], nn.Module]
    inputs: Callable[[], tuple[torch.Tensor, ...]]
    description: str


def _randn(*shape):
    return lambda: (torch.randn(*shape),)


MODELS: dict[str, ZooEntry] = {
    "mlp": ZooEntry(MLP, _randn(16, 32), "3-layer MLP"),
    "inception": ZooEntry(InceptionCNN, _randn(8, 3, 16, 16), "Inception-style CNN, 4 branches"),
    "towers": ZooEntry(MultiTowerMLP, _randn(32, 64), "4-tower MLP"),
    "deep_mlp": ZooEntry(DeepMLP, _randn(64, 512), "8-layer MLP, no parallelism"),
    "lstm_cells": ZooEntry(
        lambda: LSTMCellStack(16, 32, 2), _randn(4, 6, 16), "stacked nn.LSTMCell loop"
    ),
    "lstm_cells_big": ZooEntry(LSTMCellStack, _randn(16, 32, 64), "4x256 LSTMCell loop, 32 steps"),
    "gru_cells": ZooEntry(lambda: GRUCellStack(16, 32, 2), _randn(4, 6, 16), "stacked GRUCell"),
    "lstm": ZooEntry(lambda: RNNModel("lstm", 16, 32, 2), _randn(4, 6, 16), "nn.LSTM, 2 layers"),
    "gru": ZooEntry(lambda: RNNModel("gru", 16, 32, 2), _randn(4, 6, 16), "nn.GRU, 2 layers"),
    "bilstm": ZooEntry(
        lambda: RNNModel("lstm", 16, 32, 2, True), _randn(4, 6, 16), "bidirectional nn.LSTM"
    ),
    "transformer": ZooEntry(Transformer, _randn(4, 10, 64), "2-layer Transformer encoder"),
    "inplace_views": ZooEntry(InplaceViews, _randn(8, 16), "in-place ops, views, BatchNorm"),
    "dropout": ZooEntry(DropoutMLP, _randn(16, 32), "MLP with dropout"),
    "graph_break": ZooEntry(GraphBreak, _randn(4, 16), "data-dependent control flow"),
}


def build(name: str, seed: int = 0) -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    """A fresh zoo model and example inputs, deterministic for a given seed."""
    if name not in MODELS:
        raise KeyError(f"unknown zoo model {name!r}; choose one of {sorted(MODELS)}")
    torch.manual_seed(seed)
    entry = MODELS[name]
    model = entry.factory()
    return model, entry.inputs()


# Factories for the CLI (``MODULE:FACTORY``): zero-argument callables returning a Module.
def mlp() -> nn.Module:
    return MLP()


def inception() -> nn.Module:
    return InceptionCNN()


def towers() -> nn.Module:
    return MultiTowerMLP()


def deep_mlp() -> nn.Module:
    return DeepMLP()


def lstm_cells() -> nn.Module:
    return LSTMCellStack()


def transformer() -> nn.Module:
    return Transformer()
