"""Held-out models: written to check autopar on models it was not tuned for. They are not in
``autopar bench``'s list and no constant of autopar was chosen by looking at them; run them
as a user would, through ``--model``::

    .venv/bin/autopar bench --model benchmarks/heldout.py:wide
    .venv/bin/autopar bench --first-minute --model benchmarks/heldout.py:mini_inception

Each factory returns ``(model, example_inputs)``. The Hugging Face models need
``transformers`` (random initialisation from a config: nothing is downloaded).
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F


class _Wide(nn.Module):
    """Six independent two-layer branches over one input, concatenated, then a head."""

    def __init__(self, d: int = 256, branches: int = 6):
        super().__init__()
        self.branches = nn.ModuleList(
            nn.Sequential(nn.Linear(d, d), nn.ReLU(), nn.Linear(d, d // 2), nn.GELU())
            for _ in range(branches))  # fmt: skip
        self.head = nn.Linear(branches * d // 2, 10)

    def forward(self, x):
        return self.head(torch.cat([b(x) for b in self.branches], dim=1))


def wide():
    torch.manual_seed(0)
    return _Wide(), (torch.randn(64, 256),)


class _Block(nn.Module):
    def __init__(self, c_in: int, c: int):
        super().__init__()
        self.a = nn.Conv2d(c_in, c, 1)
        self.b = nn.Sequential(nn.Conv2d(c_in, c, 1), nn.ReLU(), nn.Conv2d(c, c, 3, padding=1))
        self.d = nn.Sequential(nn.Conv2d(c_in, c // 2, 1), nn.ReLU(),
                               nn.Conv2d(c // 2, c, 5, padding=2))  # fmt: skip
        self.p = nn.Sequential(nn.AvgPool2d(3, 1, 1), nn.Conv2d(c_in, c, 1))

    def forward(self, x):
        return F.relu(torch.cat([self.a(x), self.b(x), self.d(x), self.p(x)], 1))


class _MiniInception(nn.Module):
    def __init__(self):
        super().__init__()
        self.stem = nn.Conv2d(3, 16, 3, padding=1)
        self.b1, self.b2 = _Block(16, 12), _Block(48, 16)
        self.head = nn.Linear(64, 10)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.stem(x)), 2)
        x = F.max_pool2d(self.b1(x), 2)
        return self.head(self.b2(x).mean(dim=(2, 3)))


def mini_inception():
    torch.manual_seed(0)
    return _MiniInception(), (torch.randn(16, 3, 32, 32),)


def deep_mlp():
    torch.manual_seed(0)
    layers = []
    for _ in range(10):
        layers += [nn.Linear(384, 384), nn.ReLU()]
    return nn.Sequential(*layers, nn.Linear(384, 8)), (torch.randn(128, 384),)


class _EncDec(nn.Module):
    """A GRU encoder and a GRU decoder fed the encoder's outputs."""

    def __init__(self, d: int = 64, h: int = 128):
        super().__init__()
        self.enc = nn.GRU(d, h, batch_first=True)
        self.dec = nn.GRU(h, h, batch_first=True)
        self.out = nn.Linear(h, d)

    def forward(self, x):
        y, hn = self.enc(x)
        z, _ = self.dec(y, hn)
        return self.out(z)


def gru_encdec():
    torch.manual_seed(0)
    return _EncDec(), (torch.randn(16, 20, 64),)


class _HF(nn.Module):
    """A Hugging Face model whose forward returns its logits (a tensor, not a ModelOutput)."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, ids):
        return self.model(input_ids=ids).logits


def bert_tiny():
    from transformers import BertConfig, BertForSequenceClassification

    torch.manual_seed(0)
    cfg = BertConfig(vocab_size=2000, hidden_size=128, num_hidden_layers=2,
                     num_attention_heads=2, intermediate_size=512, max_position_embeddings=64,
                     num_labels=4, attn_implementation="eager")  # fmt: skip
    return _HF(BertForSequenceClassification(cfg)), (torch.randint(0, 2000, (8, 32)),)


def gpt2_tiny():
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    cfg = GPT2Config(vocab_size=2000, n_embd=128, n_layer=2, n_head=2, n_positions=64,
                     bos_token_id=0, eos_token_id=0, attn_implementation="eager")  # fmt: skip
    return _HF(GPT2LMHeadModel(cfg)), (torch.randint(0, 2000, (8, 32)),)
