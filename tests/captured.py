"""Captured zoo graphs for executor tests: a zoo model compiled with two HEFT streams and
run once forward and backward, so its planned graph records (``g0.fw``, ``g0.bw``) hold the
graph, its profile table and a plan."""

from __future__ import annotations

import torch

import autopar
from autopar.profiling.store import ProfileStore
from autopar.tools import zoo


def planned_zoo_records(name: str) -> list:
    """The planned graph records of zoo model ``name`` after one training step (towers with
    a batch of 8, so that its graphs stay small)."""
    model, inputs = zoo.build(name)
    if name == "towers":
        inputs = (torch.randn(8, 64),)
    cm = autopar.compile(model, streams=2, policy="heft", store=ProfileStore.memory())
    cm(*inputs).sum().backward()
    records = [r for r in cm._autopar_pipeline.records if r.plan is not None]
    assert {r.tag.split(".")[1] for r in records} == {"fw", "bw"}
    return records
