"""The models of ``autopar bench``: zoo models and, when ``transformers`` is installed, tiny
randomly initialised Hugging Face BERT and GPT-2 (built from a config: nothing is downloaded).

Each :class:`BenchModel` says how to build the model, its inputs and its loss, so that every
contender trains the same thing. The HF models are wrapped so that the compiled module returns
the logits tensor (``model(input_ids=ids).logits``); the loss is cross entropy against random
labels (BERT: one class per sequence; GPT-2: one token per position).

Example::

    >>> from autopar.tools.bench_models import BENCH_MODELS, make_loss
    >>> spec = BENCH_MODELS["deep_mlp"]
    >>> model, inputs = spec.make(), spec.make_inputs()
    >>> loss_fn = make_loss(spec, model(*inputs))
    >>> loss_fn(model(*inputs)).ndim
    0
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from autopar.tools import zoo

#: Token vocabulary of the tiny HF models (GPT-2's real 50,257 would make the LM head and its
#: logits dominate the step; 1,024 keeps the transformer layers the bulk of the work).
HF_VOCAB = 1024
HF_BATCH, HF_SEQ = 8, 64


@dataclass(frozen=True)
class BenchModel:
    """One benchmark model, sized to take milliseconds per training step on 2 cores.

    ``inputs``: makes the example inputs (default: ``torch.randn`` of ``input_shapes``);
    ``loss``: ``"mse"`` against a random target of the output's shape, or ``"ce"``, cross
    entropy of the logits (last dimension = classes) against random labels;
    ``requires``: a package the model needs (the model is offered only when it imports)."""

    name: str
    description: str
    make: Callable[[], nn.Module]
    input_shapes: tuple[tuple[int, ...], ...]
    inputs: Callable[[], tuple] | None = None
    loss: str = "mse"
    requires: str | None = None

    def make_inputs(self) -> tuple:
        if self.inputs is not None:
            return self.inputs()
        return tuple(torch.randn(s) for s in self.input_shapes)

    @property
    def available(self) -> bool:
        return self.requires is None or importlib.util.find_spec(self.requires) is not None


def make_loss(spec: BenchModel, out: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor]:
    """The loss of ``spec``'s training step, with its random target drawn now (from the
    global generator, after the inputs) for outputs shaped like ``out``."""
    if spec.loss == "ce":
        labels = torch.randint(0, out.shape[-1], out.shape[:-1])
        return lambda o: F.cross_entropy(o.reshape(-1, o.shape[-1]), labels.reshape(-1))
    target = torch.randn_like(out)
    return lambda o: F.mse_loss(o, target)


# -- the Hugging Face models -----------------------------------------------------------------
class Logits(nn.Module):
    """``model(input_ids=ids).logits``: what the benchmark compiles, so every contender's
    output is one tensor (HF models return a ``ModelOutput``)."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=input_ids).logits


def tiny_bert() -> nn.Module:
    """``BertForSequenceClassification``: hidden 128, 2 layers, 2 heads, ff 512, 2 labels,
    vocabulary 1,024, dropout off (the contenders then compute the same losses)."""
    from transformers import BertConfig, BertForSequenceClassification

    cfg = BertConfig(
        vocab_size=HF_VOCAB,
        hidden_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=512,
        max_position_embeddings=128,
        num_labels=2,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )
    return Logits(BertForSequenceClassification(cfg)).train()


def tiny_gpt2() -> nn.Module:
    """``GPT2LMHeadModel``: n_embd 128, 2 layers, 2 heads, vocabulary 1,024, 128 positions,
    no KV cache, dropout off."""
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(
        vocab_size=HF_VOCAB,
        n_embd=128,
        n_layer=2,
        n_head=2,
        n_positions=128,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        use_cache=False,
        bos_token_id=HF_VOCAB - 1,  # GPT-2's 50256 is outside the tiny vocabulary
        eos_token_id=HF_VOCAB - 1,
    )
    return Logits(GPT2LMHeadModel(cfg)).train()


def _token_ids() -> tuple[torch.Tensor]:
    return (torch.randint(0, HF_VOCAB, (HF_BATCH, HF_SEQ)),)


BENCH_MODELS: dict[str, BenchModel] = {
    m.name: m
    for m in (
        BenchModel(
            "inception",
            "Inception-style CNN: 2 blocks of 4 conv branches, 16 channels each",
            lambda: zoo.InceptionCNN(c_in=3, c=16, blocks=2),
            ((16, 3, 16, 16),),
        ),
        BenchModel(
            "towers",
            "multi-tower MLP: 4 independent towers of 4x256 Linear, concatenated",
            lambda: zoo.MultiTowerMLP(d_in=64, hidden=256, towers=4, depth=4),
            ((64, 64),),
        ),
        BenchModel(
            "lstm_cells",
            "stacked nn.LSTMCell loop: 2 layers x 128 hidden, 16 time steps",
            lambda: zoo.LSTMCellStack(d_in=32, hidden=128, layers=2),
            ((16, 16, 32),),
        ),
        BenchModel(
            "transformer",
            "Transformer encoder: 2 layers, d=64, 4 heads, ff=128",
            lambda: zoo.Transformer(d=64, heads=4, layers=2, ff=128),
            ((8, 16, 64),),
        ),
        BenchModel(
            "deep_mlp",
            "plain deep MLP: 8 x 512 Linear chain (nothing runs concurrently)",
            lambda: zoo.DeepMLP(d=512, depth=8),
            ((64, 512),),
        ),
        BenchModel(
            "bert",
            "HF BertForSequenceClassification, random tiny config: hidden 128, 2 layers, "
            "2 heads, vocab 1024; cross entropy on 2 labels",
            tiny_bert,
            ((HF_BATCH, HF_SEQ),),
            inputs=_token_ids,
            loss="ce",
            requires="transformers",
        ),
        BenchModel(
            "gpt2",
            "HF GPT2LMHeadModel, random tiny config: n_embd 128, 2 layers, 2 heads, "
            "vocab 1024; cross entropy per token",
            tiny_gpt2,
            ((HF_BATCH, HF_SEQ),),
            inputs=_token_ids,
            loss="ce",
            requires="transformers",
        ),
    )
}


def default_models() -> list[str]:
    """Every model whose requirements import here."""
    return [n for n, m in BENCH_MODELS.items() if m.available]
