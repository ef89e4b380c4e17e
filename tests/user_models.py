"""Factories as a user writes them for ``autopar bench --model`` / ``autopar plan``
(``tests/test_bench_model.py`` names them as ``user_models:FACTORY``: pytest puts tests/ on
the import path)."""

import torch

from autopar.tools.zoo import MLP


def tiny():
    """(model, example_inputs): a 3-layer MLP, 16 -> 32 -> 8, on a batch of 4."""
    return MLP(d_in=16, hidden=32, d_out=8, depth=3), (torch.randn(4, 16),)


def model_alone():
    """A factory of the ``profile``/``plan`` kind: the model without inputs."""
    return MLP(d_in=16, hidden=32, d_out=8, depth=3)
