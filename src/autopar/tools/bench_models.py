"""The models of ``autopar bench``: zoo models and, when ``transformers`` is installed, tiny
randomly initialised Hugging Face BERT and GPT-2 (built from a config: nothing is downloaded);
and the user's own (``--model MODULE_OR_FILE:FACTORY``, ``user_model``).

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
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

from autopar.tools import zoo
from autopar.tools.args import UsageError, one_line
from autopar.tools.factory import load_model

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


def make_loss(spec: BenchModel, out: Any) -> Callable[[Any], torch.Tensor]:
    """The loss of ``spec``'s training step, with its random target drawn now (from the
    global generator, after the inputs) for outputs shaped like ``out``. An output that is not
    one tensor (a tuple, a list, a dict or a Hugging Face ``ModelOutput``) trains on the sum of
    the ``"mse"`` losses of its floating-point tensors."""
    if spec.loss == "ce":
        labels = torch.randint(0, out.shape[-1], out.shape[:-1])
        return lambda o: F.cross_entropy(o.reshape(-1, o.shape[-1]), labels.reshape(-1))
    if isinstance(out, torch.Tensor):
        target = torch.randn_like(out)
        return lambda o: F.mse_loss(o, target)
    targets = [torch.randn_like(t) for t in float_tensors(out)]
    return lambda o: sum(F.mse_loss(t, g) for t, g in zip(float_tensors(o), targets, strict=True))


def float_tensors(out: Any) -> list[torch.Tensor]:
    """The floating-point tensors of a model's output, in order (tuples, lists and dicts,
    nested; a Hugging Face ``ModelOutput`` is a dict).

    Example::

        >>> len(float_tensors((torch.ones(2), {"n": torch.arange(3), "y": torch.zeros(1)})))
        2
    """
    if isinstance(out, torch.Tensor):
        return [out] if out.is_floating_point() else []
    if isinstance(out, dict):
        out = list(out.values())
    if isinstance(out, tuple | list):
        return [t for o in out for t in float_tensors(o)]
    return []


def user_model(spec: str) -> BenchModel:
    """The ``BenchModel`` of ``autopar bench --model MODULE_OR_FILE:FACTORY``: ``FACTORY()``
    returns ``(model, example_inputs)``; the loss is ``"mse"`` against a random target (summed
    over the output's floating-point tensors). The factory is called now, and the model run
    once eagerly, so that a factory or a model that does not work fails before any timing, in
    one line (``UsageError``); each run of the bench calls it again, under the bench's seed.

    Example::

        >>> user_model("my_model.py:make").name                  # doctest: +SKIP
        'my_model:make'
    """
    model, inputs = load_model(spec)
    if inputs is None:
        raise UsageError(
            f"{spec} returned the model alone; autopar bench needs example inputs: make it "
            "return (model, example_inputs)"
        )
    try:
        with torch.no_grad(), torch.random.fork_rng(devices=[]):
            out = model(*inputs)
    except Exception as exc:
        raise UsageError(
            f"{spec}: the model does not run on its example inputs: {type(exc).__name__}: "
            f"{one_line(exc)}"
        ) from exc
    if not float_tensors(out):
        raise UsageError(
            f"{spec}: the model's output holds no floating-point tensor to train on "
            f"(got {type(out).__name__})"
        )
    where, _, name = spec.rpartition(":")
    label = f"{os.path.splitext(os.path.basename(where))[0]}:{name}"
    made: dict[str, tuple] = {}  # the inputs of make()'s factory call, for make_inputs()

    def make() -> nn.Module:
        m, made["inputs"] = load_model(spec)
        return m

    return BenchModel(
        label,
        f"{type(model).__name__} from {spec}",
        make,
        tuple(tuple(x.shape) for x in inputs),
        inputs=lambda: made.pop("inputs", None) or load_model(spec)[1],
    )


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


def choose_models(args, quick: list[str] | None = None) -> None:
    """Which models ``autopar bench`` runs: sets ``args.models`` (names), ``args.skipped``
    (default models left out, ``{name: package}``) and ``args.specs`` (``{name: BenchModel}``).
    ``--model`` (``args.model``): the user's model alone, loaded and checked here (a factory
    that fails is a ``UsageError``); else ``--models``; else ``quick``'s available models
    (``--quick``), or every default one. A second call changes nothing.

    Example::

        >>> import argparse
        >>> args = argparse.Namespace(models=["towers"])
        >>> choose_models(args)
        >>> args.models, args.skipped, type(args.specs["towers"]).__name__
        (['towers'], {}, 'BenchModel')
    """
    if getattr(args, "specs", None) is not None:
        return
    given = getattr(args, "models", None)
    if getattr(args, "model", None) is not None:
        if given is not None:
            raise UsageError("give --model (your own model) or --models (built-in ones), not both")
        spec = user_model(args.model)
        args.models, args.skipped, args.specs = [spec.name], {}, {spec.name: spec}
        return
    if getattr(args, "skipped", None) is None:  # the default list says what it leaves out
        args.skipped = {} if given is not None else {
            n: m.requires for n, m in BENCH_MODELS.items() if not m.available}  # fmt: skip
    if given is None:
        given = [m for m in quick if BENCH_MODELS[m].available] if quick else default_models()
    args.models = given
    args.specs = {n: BENCH_MODELS[n] for n in given}
