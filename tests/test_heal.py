"""Self-healing store: a poisoned entry (50x too slow) is found at a graph's first call,
re-measured, replaced with one warning, and the plan comes out as from a clean store."""

from __future__ import annotations

import importlib
import json
import math
import shutil
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch.fx.experimental.proxy_tensor import make_fx

from autopar.errors import StoreWarning
from autopar.planning.costmodel import MachineModel
from autopar.planning.partition import make_plan
from autopar.profiling.heal import accept, heal, remeasure_from_store, retime, verify_store
from autopar.profiling.profiler import profile_graph
from autopar.profiling.store import ProfileStore

timing = importlib.import_module("autopar.profiling.timing")
heal_mod = importlib.import_module("autopar.profiling.heal")
POISON = 50.0


@pytest.fixture(autouse=True)
def quiet_machine(monkeypatch):
    """Measurements count as clean on the shared test machine (see tests/test_timing.py for
    the contention rules); what is tested here is what happens to them."""
    monkeypatch.setattr(timing, "_is_disturbed", lambda *_: False)
    monkeypatch.setattr(timing, "SPREAD_LIMIT", math.inf)


def _branches(x, w1, w2, w3):
    a = torch.relu(F.conv2d(x, w1))  # the 1x1 convolution of the issue
    b = F.conv2d(torch.tanh(F.conv2d(x, w2, padding=1)), w3, padding=1)
    return (a + b).sum()


def _graph():
    xs = [torch.randn(4, 8, 12, 12), torch.randn(8, 8, 1, 1), torch.randn(8, 8, 3, 3),
          torch.randn(8, 8, 3, 3)]  # fmt: skip
    return make_fx(_branches)(*xs), xs


def _poisoned_copy(clean_path, tmp_path):
    """A copy of the store with the 1x1 convolution's entry 50x too slow (still 'clean')."""
    path = tmp_path / "poisoned.json"
    shutil.copy(clean_path, path)
    doc = json.loads(path.read_text())
    (sig,) = [
        s for s, r in doc["ops"].items()
        if r["target"] == "aten.convolution.default" and r["call"]["args"][1]["tensor"][2] == 1
    ]  # fmt: skip
    for key in ("time_s", "time_1t_s", "min_s", "min_1t_s"):
        doc["ops"][sig][key] *= POISON
    path.write_text(json.dumps(doc))
    return path, sig


def _fix_times(path):
    """Replace the measured times by made-up ones (from the FLOPs): what the tests compare
    must not depend on how busy the machine was while the store was filled."""
    doc = json.loads(path.read_text())
    for rec in doc["ops"].values():
        t = 2e-6 + rec["flops"] / 5e9
        rec.update(time_s=t, min_s=t, time_1t_s=1.6 * t, min_1t_s=1.6 * t, quality="clean")
    path.write_text(json.dumps(doc))


def _make_stores(tmp_path, fixed_times=True):
    gm, xs = _graph()
    clean = ProfileStore(tmp_path / "clean.json")
    _, clean_table = profile_graph(gm, xs, store=clean, warmup=1, repeats=3)
    if fixed_times:
        _fix_times(tmp_path / "clean.json")
        clean = ProfileStore(tmp_path / "clean.json")
        _, clean_table = profile_graph(gm, xs, store=clean, warmup=1, repeats=3)
        assert clean_table.attrs["measured"] == 0
    path, sig = _poisoned_copy(clean.path, tmp_path)
    return gm, xs, clean, clean_table, ProfileStore(path), sig


@pytest.fixture
def stores(tmp_path):
    return _make_stores(tmp_path)


def _plan(table):
    plan = make_plan(table, machine=MachineModel.default_cpu(), graph_id="g")
    return plan.replace(provenance=())


def test_poisoned_entry_is_healed_and_the_plan_equals_the_clean_one(stores):
    gm, xs, clean, clean_table, poisoned, sig = stores
    _, table = profile_graph(gm, xs, store=poisoned, warmup=1, repeats=3)
    assert table.attrs["measured"] == 0  # every operator came from the (poisoned) store
    assert _plan(table) != _plan(clean_table)
    # What the first call measured, per node: here the clean times, so nothing depends on
    # how fast this machine is today; the real evidence is tested below.
    evidence = dict(zip(clean_table.key, clean_table.time_s, strict=True))
    asked = []

    def remeasure(sigs):
        asked.append(list(sigs))
        return {s: clean.get(s) for s in sigs}

    with pytest.warns(StoreWarning) as caught:
        healed, message = heal(table, evidence, store=poisoned, remeasure=remeasure)
    assert len(caught) == 1 and str(caught[0].message) == message
    assert asked == [[sig]]  # only the entry that explains the gap is re-measured
    assert sig in message and "aten.convolution.default" in message and "replaced 1" in message
    assert healed.attrs["heal"]["replaced"] == [sig]
    assert ProfileStore(poisoned.path).get(sig)["time_s"] == clean.get(sig)["time_s"]  # flushed
    assert _plan(healed) == _plan(clean_table)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # healed: a second check finds nothing to do
        assert heal(healed, evidence, store=poisoned, remeasure=remeasure)[1] is None
    assert len(asked) == 1


def test_a_graph_total_alone_finds_the_poisoned_entry(stores):
    """Without per-node evidence (a float: the graph's measured serial time), the biggest
    shares of the prediction are re-measured first."""
    gm, xs, clean, clean_table, poisoned, sig = stores
    _, table = profile_graph(gm, xs, store=poisoned, warmup=1, repeats=3)
    measured = float(clean_table.time_s.sum())
    with pytest.warns(StoreWarning, match=sig):
        healed, _ = heal(table, measured, store=poisoned,
                         remeasure=lambda sigs: {s: clean.get(s) for s in sigs})  # fmt: skip
    assert _plan(healed) == _plan(clean_table)


def test_first_call_detects_and_remeasures_for_real(tmp_path):
    """The whole path with real timings: profile_graph's own evidence, and the default
    re-measurement from the call stored with the entry. 50x is far outside timing noise."""
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)  # one thread: other processes cannot stall a thread team
        gm, xs, clean, _, poisoned, sig = _make_stores(tmp_path, fixed_times=False)
        _, table = profile_graph(gm, xs, store=poisoned, warmup=1, repeats=3)
        with pytest.warns(StoreWarning, match="aten.convolution.default") as caught:
            healed, _ = heal(table, store=poisoned)
    finally:
        torch.set_num_threads(before)
    assert len(caught) == 1 and sig in healed.attrs["heal"]["replaced"]
    new = ProfileStore(poisoned.path).get(sig)
    assert new["quality"] == "clean" and new["call"] == clean.get(sig)["call"]


def test_agreeing_or_distrusted_remeasurements_replace_nothing(stores):
    gm, xs, clean, clean_table, poisoned, sig = stores
    _, table = profile_graph(gm, xs, store=poisoned, warmup=1, repeats=3)
    evidence = dict(zip(clean_table.key, clean_table.time_s, strict=True))
    old = poisoned.get(sig)
    contended = {**old, "time_s": old["time_s"] * 2, "quality": "provisional"}
    for answer in ({sig: old}, {sig: contended}, {}):  # agrees; slower and provisional; none
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            healed, message = heal(
                table, evidence, store=poisoned, remeasure=lambda s, answer=answer: answer
            )
        assert message is None and poisoned.get(sig) == old
        assert healed.attrs["heal"]["remeasured"][0] == sig


def test_accept_rule():
    assert accept({"time_s": 24e-3}, {"time_s": 0.43e-3, "quality": "clean"})
    assert accept({"time_s": 1e-3}, {"time_s": 5e-3, "quality": "clean"})
    assert not accept({"time_s": 1e-3}, {"time_s": 1.2e-3, "quality": "clean"})
    assert not accept({"time_s": 1e-3}, {"time_s": 5e-3, "quality": "provisional"})


def test_verify_store_flags_and_fixes(stores, monkeypatch):
    _, _, clean, _, poisoned, sig = stores
    monkeypatch.setattr(heal_mod, "retime", lambda rec, **kw: clean.get(sig))  # no timing
    verdicts = {v.signature: v for v in verify_store(poisoned, [sig])}
    assert verdicts[sig].status == "off" and poisoned.get(sig)["time_s"] != clean.get(sig)["time_s"]
    fixed = verify_store(poisoned, [sig], fix=True)
    assert fixed[0].status == "fixed"
    assert ProfileStore(poisoned.path).get(sig)["time_s"] == fixed[0].new_s
    assert verify_store(poisoned, [sig])[0].status == "ok"
    monkeypatch.setattr(heal_mod, "retime", retime)
    poisoned.put("0" * 16, {"target": "aten.mm.default", "time_s": 1e-5})  # no call
    (skipped,) = verify_store(poisoned, ["0" * 16])
    assert skipped.status == "skipped" and "no call description" in skipped.note


def test_remeasure_from_store_keeps_what_it_cannot_retime(stores):
    _, _, clean, _, poisoned, sig = stores
    poisoned.put("0" * 16, {"target": "aten.mm.default", "time_s": 1e-5})
    fresh = remeasure_from_store(poisoned, warmup=1, repeats=3)([sig, "0" * 16, "f" * 16])
    assert set(fresh) == {sig} and fresh[sig]["flops"] == clean.get(sig)["flops"]
    assert retime(clean.get(sig), warmup=1, repeats=3)["threads"] == clean.get(sig)["threads"]


def test_heal_needs_a_way_to_remeasure():
    gm, xs = _graph()
    _, table = profile_graph(gm, xs, warmup=1, repeats=3)
    with pytest.raises(ValueError, match="store, a remeasure"):
        heal(table)
