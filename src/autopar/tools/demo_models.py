"""The models ``autopar demo`` trains, each with data that needs no download.

* ``charlstm`` (the default): a character-level LSTM language model on the Python standard
  library's own ``.py`` files, read from the running interpreter, written as an
  ``nn.LSTMCell`` loop (autopar fuses each layer's loop into one LSTM layer op).
* ``towers``: the zoo's multi-tower MLP (independent towers over one input, the shape of a
  recommendation model: work that can run concurrently) regressing a fixed random teacher
  network of the same shape on Gaussian inputs.
* ``bert``: Hugging Face ``BertForSequenceClassification`` from a tiny random config (nothing
  is downloaded; needs ``transformers``) on a toy sentiment task: sequences of random
  "words" where a positive sequence draws more of its words from the vocabulary's positive half.

:func:`build_task` returns a :class:`DemoTask`: the model, a batch maker (step -> inputs,
target, the same for every contender) and the loss.

Example::

    >>> import argparse
    >>> ns = argparse.Namespace(model="towers", tiny=True, seed=0)
    >>> task = build_task(ns)
    >>> inputs, target = task.batch(0)
    >>> task.loss(task.model(*inputs), target).ndim
    0
"""

from __future__ import annotations

import glob
import importlib.util
import os
import statistics
import sysconfig
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn as nn
import torch.nn.functional as F

from autopar.tools import zoo
from autopar.tools.bench_models import Logits

VOCAB = 128  # charlstm: ASCII; other characters become "?"
MODELS = ("charlstm", "towers", "bert")

#: Per-model sizes (options left unset take these); ``--tiny`` takes the second column.
DEFAULTS: dict[str, dict[str, tuple]] = {
    #            option      normal   tiny
    "charlstm": {"hidden": (128, 16), "layers": (2, 1), "emb": (64, 8), "seq_len": (32, 6),
                 "batch": (32, 4), "lr": (3e-3, 3e-3), "corpus_kb": (300, 8)},
    "towers": {"hidden": (256, 16), "layers": (4, 2), "emb": (64, 8), "seq_len": (1, 1),
               "batch": (64, 4), "lr": (1e-3, 1e-3), "corpus_kb": (0, 0)},
    "bert": {"hidden": (128, 32), "layers": (2, 1), "emb": (1024, 64), "seq_len": (64, 8),
             "batch": (16, 2), "lr": (5e-4, 5e-4), "corpus_kb": (0, 0)},
}  # fmt: skip


@dataclass
class DemoTask:
    """One demo model and its training data.

    ``batch(step)`` returns ``(inputs, target)`` for training step ``step`` (deterministic in
    the seed; the demo makes each batch once and gives it to every contender); ``loss(out,
    target)`` is the training loss; ``about`` are the header lines that say what is trained;
    ``sample`` (or None) writes a few characters with a trained model."""

    name: str
    title: str
    model: nn.Module
    batch: Callable[[int], tuple[tuple, torch.Tensor]]
    loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    lr: float
    loss_name: str
    about: list[str] = field(default_factory=list)
    sample: Callable[[nn.Module], str] | None = None


def resolve_sizes(args) -> dict:
    """The sizes for ``args.model``: each option the user set, else the model's default
    (``--tiny``: the tiny default), as a dict keyed by option name.

    Example::

        >>> import argparse
        >>> resolve_sizes(argparse.Namespace(model="bert", tiny=True, hidden=48))["hidden"]
        48
    """
    col = 1 if getattr(args, "tiny", False) else 0
    out = {}
    for name, values in DEFAULTS[args.model].items():
        given = getattr(args, name, None)
        out[name] = values[col] if given is None else given
    return out


def build_task(args) -> DemoTask:
    """The :class:`DemoTask` of ``args.model`` (sizes from :func:`resolve_sizes`), with its
    weights drawn from ``args.seed``. Example: see the module docstring."""
    sizes = resolve_sizes(args)
    seed = getattr(args, "seed", 0)
    builders = {"charlstm": _charlstm, "towers": _towers, "bert": _bert}
    if args.model not in builders:
        raise ValueError(f"unknown demo model {args.model!r}; choose one of {MODELS}")
    torch.manual_seed(seed)
    return builders[args.model](args, sizes, seed)


def _generator(seed: int, step: int) -> torch.Generator:
    # One generator per step: batch k is the same whatever ran before it.
    return torch.Generator().manual_seed(seed * 1_000_003 + step)


# -- charlstm ------------------------------------------------------------------------------------
def load_corpus(max_kb: int) -> tuple[torch.Tensor, list[str], str]:
    """The stdlib's top-level ``.py`` files in sorted order, as ASCII codes, up to ``max_kb``.

    Returns (codes as int64, the files used, the stdlib directory).

    Example::

        >>> codes, files, root = load_corpus(4)
        >>> len(codes), files[0].endswith(".py")
        (4096, True)
    """
    root = sysconfig.get_paths()["stdlib"]
    files = sorted(glob.glob(os.path.join(root, "*.py")))
    if not files:
        raise SystemExit(f"autopar demo: no .py files in the stdlib directory {root!r}")
    parts, used, size = [], [], 0
    for path in files:
        if size >= max_kb * 1024:
            break
        try:
            with open(path, encoding="utf-8", errors="replace") as f:
                text = f.read()
        except OSError:
            continue
        text = text[: max_kb * 1024 - size]
        parts.append(text)
        used.append(os.path.basename(path))
        size += len(text)
    codes = [c if c < VOCAB else ord("?") for c in map(ord, "".join(parts))]
    return torch.tensor(codes, dtype=torch.long), used, root


def make_batches(data: torch.Tensor, steps: int, batch: int, seq_len: int, seed: int):
    """``steps`` (input, target) pairs of random windows; target is the input shifted by one.

    Example::

        >>> (x, y), = make_batches(torch.arange(50), 1, batch=2, seq_len=4, seed=0)
        >>> bool((x[:, 1:] == y[:, :-1]).all())
        True
    """
    return [_window(data, batch, seq_len, seed, i) for i in range(steps)]


def _window(data: torch.Tensor, batch: int, seq_len: int, seed: int, step: int):
    if len(data) <= seq_len + 1:
        raise SystemExit(f"autopar demo: corpus of {len(data)} chars is shorter than --seq-len")
    starts = torch.randint(0, len(data) - seq_len - 1, (batch, 1), generator=_generator(seed, step))
    window = data[starts + torch.arange(seq_len + 1)]
    return window[:, :-1].contiguous(), window[:, 1:].contiguous()


class CharLM(nn.Module):
    """Embedding -> LSTM (``nn.LSTM``, or an ``nn.LSTMCell`` loop) -> linear over the vocabulary.

    Example::

        >>> CharLM(hidden=8, layers=1, emb=4, cell=True)(torch.zeros(2, 3).long()).shape
        torch.Size([2, 3, 128])
    """

    def __init__(self, hidden: int = 128, layers: int = 2, emb: int = 64, cell: bool = False):
        super().__init__()
        self.cell, self.hidden = cell, hidden
        self.embed = nn.Embedding(VOCAB, emb)
        if cell:
            self.cells = nn.ModuleList(
                nn.LSTMCell(emb if i == 0 else hidden, hidden) for i in range(layers)
            )
        else:
            self.rnn = nn.LSTM(emb, hidden, layers, batch_first=True)
        self.head = nn.Linear(hidden, VOCAB)

    def forward(self, x):  # x: [batch, time] int64 -> logits [batch, time, VOCAB]
        e = self.embed(x)
        if not self.cell:
            out, _ = self.rnn(e)
            return self.head(out)
        b, steps = x.shape
        h = [e.new_zeros(b, self.hidden) for _ in self.cells]
        c = [e.new_zeros(b, self.hidden) for _ in self.cells]
        outs = []
        for t in range(steps):
            inp = e[:, t]
            for i, cell in enumerate(self.cells):
                h[i], c[i] = cell(inp, (h[i], c[i]))
                inp = h[i]
            outs.append(inp)
        return self.head(torch.stack(outs, dim=1))


@torch.no_grad()
def sample(model: nn.Module, prompt: str, n: int, seed: int = 0) -> str:
    """``n`` characters the (eager) model writes after ``prompt``, temperature 0.8.

    Example::

        >>> len(sample(CharLM(hidden=8, layers=1, emb=4), "def ", 5))
        9
    """
    g = torch.Generator().manual_seed(seed)
    codes = [min(ord(c), VOCAB - 1) for c in prompt]
    for _ in range(n):
        logits = model(torch.tensor([codes[-64:]]))[0, -1] / 0.8
        codes.append(int(torch.multinomial(F.softmax(logits, -1), 1, generator=g)))
    return "".join(chr(c) for c in codes)


def _charlstm(args, s: dict, seed: int) -> DemoTask:
    cell = getattr(args, "cell", True)
    data, used, root = load_corpus(s["corpus_kb"])
    model = CharLM(s["hidden"], s["layers"], s["emb"], cell)
    rnn = (f"an nn.LSTMCell loop ({s['layers']} x {s['hidden']})" if cell
           else f"nn.LSTM ({s['layers']} layers x {s['hidden']})")  # fmt: skip
    n = sum(p.numel() for p in model.parameters())

    def batch(step: int):
        x, y = _window(data, s["batch"], s["seq_len"], seed, step)
        return (x,), y

    return DemoTask(
        name="charlstm",
        title=f"char-LSTM, {rnn}",
        model=model,
        batch=batch,
        loss=lambda out, y: F.cross_entropy(out.reshape(-1, VOCAB), y.reshape(-1)),
        lr=s["lr"],
        loss_name="cross-entropy, nats per character",
        about=[
            "a character-level language model learns to write Python.",
            f"corpus : {len(data) / 1024:.0f} KB of the Python standard library's own source "
            f"({len(used)} files from {root}, {used[0]} .. {used[-1]})",
            f"model  : embedding({VOCAB} chars -> {s['emb']}) -> {rnn} -> linear -> {VOCAB} "
            f"chars; {n:,} parameters",
            f"task   : predict each next character; batches of {s['batch']} x {s['seq_len']} "
            f"chars, Adam lr {s['lr']}",
        ],
        sample=lambda m: sample(m, "def ", 80),
    )


# -- towers --------------------------------------------------------------------------------------
def _towers(args, s: dict, seed: int) -> DemoTask:
    towers = 2 if getattr(args, "tiny", False) else 4
    make = lambda: zoo.MultiTowerMLP(d_in=s["emb"], hidden=s["hidden"], towers=towers,  # noqa: E731
                                     depth=s["layers"])  # fmt: skip
    model = make()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed + 1)  # the teacher: same shape, other weights, frozen
        teacher = make().requires_grad_(False)
        # Targets scaled to unit variance: the same loss scale at any size.
        probe = teacher(torch.randn(256, s["emb"], generator=_generator(seed, -1)))
        scale = float(probe.std()) or 1.0

    def batch(step: int):
        x = torch.randn(s["batch"], s["emb"], generator=_generator(seed, step))
        with torch.no_grad():
            return (x,), teacher(x) / scale

    n = sum(p.numel() for p in model.parameters())
    return DemoTask(
        name="towers",
        title=f"multi-tower MLP, {towers} towers of {s['layers']} x {s['hidden']}",
        model=model,
        batch=batch,
        loss=F.mse_loss,
        lr=s["lr"],
        loss_name="mean squared error",
        about=[
            "a multi-tower MLP (independent towers over one input: work that can run "
            "concurrently) learns a fixed random teacher network.",
            f"model  : {towers} towers of {s['layers']} Linear({s['hidden']}) + ReLU over "
            f"{s['emb']} inputs, concatenated -> Linear(1); {n:,} parameters",
            f"data   : Gaussian inputs drawn per step (seeded); target: a frozen teacher of "
            f"the same shape, scaled to unit variance; batches of {s['batch']}, Adam lr "
            f"{s['lr']}",
        ],
    )


# -- bert ----------------------------------------------------------------------------------------
def bert_available() -> bool:
    """Whether ``transformers`` imports here (``--model bert`` needs it).

    Example::

        >>> isinstance(bert_available(), bool)
        True
    """
    return importlib.util.find_spec("transformers") is not None


def _bert(args, s: dict, seed: int) -> DemoTask:
    from transformers import BertConfig, BertForSequenceClassification
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()  # no "initialised from scratch" chatter: it is meant
    vocab, heads = s["emb"], 2
    cfg = BertConfig(
        vocab_size=vocab, hidden_size=s["hidden"], num_hidden_layers=s["layers"],
        num_attention_heads=heads, intermediate_size=4 * s["hidden"],
        max_position_embeddings=max(128, s["seq_len"]), num_labels=2,
        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,  # same losses eager/autopar
    )  # fmt: skip
    model = Logits(BertForSequenceClassification(cfg)).train()
    half = vocab // 2

    def batch(step: int):
        g = _generator(seed, step)
        labels = torch.randint(0, 2, (s["batch"],), generator=g)
        # A positive sequence draws 65% of its words from the lower ("positive") half of the
        # vocabulary, a negative one 35%: learnable (in ~100 steps), but only by looking at
        # every word.
        p = 0.35 + 0.3 * labels.float()[:, None].expand(-1, s["seq_len"])
        positive = torch.bernoulli(p, generator=g).bool()
        words = torch.randint(0, half, (s["batch"], s["seq_len"]), generator=g)
        return (torch.where(positive, words, words + half),), labels

    n = sum(p.numel() for p in model.parameters())
    return DemoTask(
        name="bert",
        title=f"HF BERT (tiny random config: hidden {s['hidden']}, {s['layers']} layers)",
        model=model,
        batch=batch,
        loss=F.cross_entropy,
        lr=s["lr"],
        loss_name="cross-entropy, nats",
        about=[
            "a tiny BERT learns a toy sentiment task (nothing is downloaded).",
            f"model  : BertForSequenceClassification from a random config: hidden "
            f"{s['hidden']}, {s['layers']} layers, {heads} heads, vocabulary {vocab}; "
            f"{n:,} parameters",
            f"data   : sequences of {s['seq_len']} random words; a positive one draws 65% of "
            f"its words from the vocabulary's positive half, a negative one 35%; batches of "
            f"{s['batch']}, Adam lr {s['lr']}",
        ],
    )


# -- comparing two loss curves ---------------------------------------------------------------------
def moving_average(xs: list[float], window: int = 10) -> list[float]:
    """Mean of each value and up to ``window - 1`` values before it.

    Example::

        >>> moving_average([1.0, 3.0, 5.0], window=2)
        [1.0, 2.0, 4.0]
    """
    return [statistics.fmean(xs[max(0, i - window + 1) : i + 1]) for i in range(len(xs))]


def compare_curves(a: list[float], b: list[float], tol: float) -> tuple[bool, str]:
    """Do two loss curves of the same training agree? Returns (verdict, explanation).

    Early on, both runs compute the same numbers up to float32 rounding, so the first 10
    losses must match within ``tol / 50``. Training then amplifies rounding differences
    (as it does between two eager runs with different thread counts), so afterwards the
    10-step moving averages must stay within ``tol``.

    Example::

        >>> compare_curves([2.0] * 20, [2.0] * 20, tol=0.05)[0]
        True
    """
    early = max(abs(x - y) for x, y in zip(a[:10], b[:10], strict=True))
    diffs = [abs(x - y) for x, y in zip(a, b, strict=True)]
    smooth = [abs(x - y) for x, y in zip(moving_average(a), moving_average(b), strict=True)]
    ok = early <= tol / 50 and max(smooth) <= tol
    text = (
        f"first {min(10, len(a))} steps within {early:.1e} (limit {tol / 50:.0e}); 10-step "
        f"moving averages within {max(smooth):.1e} (limit {tol:g}); largest single-step "
        f"|diff| {max(diffs):.1e}"
    )
    return ok, text
