"""The re-measure tier (``runtime.remeasure_tier``): the planned program that the first
call's measurement did not keep is measured again later and can land, and training stays
equal to eager (fp64 oracle) when it does.

Which program the first call keeps is forced here (``MEASURE_MARGIN``), and so is the landing
(``LAND_MARGIN``): what is tested is the mechanism, not which program is faster here.
"""

from __future__ import annotations

import copy

import pytest
import torch
from nets import compile_and_land, train_side_by_side
from oracle import check_training

import autopar
import autopar.runtime.planned as planned
import autopar.runtime.tiers as tiers
from autopar.profiling.store import ProfileStore
from autopar.tools import zoo


@pytest.fixture
def remeasure_only(monkeypatch):
    monkeypatch.setenv("AUTOPAR_TIERS", "remeasure")
    monkeypatch.setattr(tiers, "LAND_MARGIN", float("inf"))


def _streams(unit) -> int:
    return len(unit.program.streams_used) or 1


@pytest.mark.parametrize("first_keeps", ["serial", "streams"])
def test_the_program_the_first_call_dropped_lands_later_and_trains_like_eager(
    first_keeps, remeasure_only, monkeypatch
):
    # 0: no multi-stream program wins at the first call; inf: every one does
    monkeypatch.setattr(planned, "MEASURE_MARGIN", 0.0 if first_keeps == "serial" else 1e9)
    torch.manual_seed(0)
    model, (x,) = zoo.build("towers")
    eager = copy.deepcopy(model)
    cmodel = autopar.compile(model, inductor=True, background=True, race=False, streams=2,
                             store=ProfileStore.memory())  # fmt: skip
    seen = train_side_by_side(cmodel, eager, x, 4)
    assert seen == [{"plan"}] * 4
    other = "streams" if first_keeps == "serial" else "serial"
    for unit in autopar.graphs(cmodel):
        kept = next(p.note for p in unit.provenance if p.stage == "measure")
        assert kept.startswith("measured at first call")
        tier = next(p.note for p in unit.provenance if p.stage == "tier")
        assert tier.endswith(f"{other} landed"), tier
        assert (_streams(unit) > 1) == (other == "streams"), unit.program.source[:400]
    for p, q in zip(model.parameters(), eager.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
    assert f"{other} landed" in autopar.explain(cmodel)


def test_a_landed_multi_stream_program_matches_the_fp64_oracle(remeasure_only, monkeypatch):
    monkeypatch.setattr(planned, "MEASURE_MARGIN", 0.0)  # the first call keeps serial
    model, inputs = zoo.build("towers")
    keep: dict = {}
    check_training(model, inputs, compile_and_land(lambda: inputs, keep), opt_name="sgd")
    units = autopar.graphs(keep["m"])
    assert units and all(_streams(u) > 1 for u in units), [u.executor for u in units]


def test_no_candidate_where_the_first_call_measured_nothing(remeasure_only):
    model, (x,) = zoo.build("towers")
    cmodel = autopar.compile(model, inductor=True, background=True, race=False, streams=1,
                             store=ProfileStore.memory())  # fmt: skip
    for _ in range(3):
        cmodel(x).sum().backward()
    for unit in autopar.graphs(cmodel):
        assert not any(p.stage in ("measure", "tier") for p in unit.provenance), unit.provenance
