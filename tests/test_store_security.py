"""A profile store holds data, never code: a store file from elsewhere (a shared directory, a
CI cache) that names ``os.system`` or any other callable runs nothing, under ``autopar
store verify`` and under training, and the warning names the refused entry."""

from __future__ import annotations

import argparse
import json
import warnings

import pytest
import torch

import autopar
from autopar.errors import StoreWarning
from autopar.profiling.callspec import MAX_BYTES, NotRebuildable, encode, rebuild, why_refused
from autopar.profiling.store import ProfileStore
from autopar.tools.store_cmd import add_arguments


def _crafted_calls(marker) -> dict[str, dict]:
    """Call descriptions that would each create ``marker`` if autopar ran what they name."""
    cmd = f"touch {marker}"
    return {
        "os.system": {"target": "os.system", "args": [cmd], "kwargs": {}},
        "posix.system": {"target": "posix.system", "args": [cmd], "kwargs": {}},
        "builtins.exec": {"target": "builtins.exec",
                          "args": [f"open({str(marker)!r}, 'w')"], "kwargs": {}},  # fmt: skip
        "torch.load": {"target": "torch.load", "args": [str(marker)], "kwargs": {}},
        "torch.hub.load": {"target": "torch.hub.load", "args": [cmd], "kwargs": {}},
        "method:__reduce_ex__": {"target": "method:__reduce_ex__", "args": [1], "kwargs": {}},
        "method:register_hook": {"target": "method:register_hook", "args": [], "kwargs": {}},
        # aten operators that would create (or grow) a file
        "aten.from_file.default": {"target": "aten.from_file.default",
                                   "args": [str(marker), True, 8], "kwargs": {}},  # fmt: skip
        "torch.from_file": {"target": "torch.from_file", "args": [str(marker), True, 8],
                            "kwargs": {}},  # fmt: skip
        # a callable smuggled in as an argument of an allowed operator
        "_operator.add": {"target": "_operator.add",
                          "args": [{"torch_attr": "load"}, str(marker)], "kwargs": {}},
    }  # fmt: skip


def _tamper(path, marker, shown: str | None = None) -> list[str]:
    """Point every entry of the store file at ``path`` to a crafted call; returns their
    signatures. ``shown``: the target the entry shows (default: the one it would run)."""
    doc = json.loads(path.read_text())
    crafted = list(_crafted_calls(marker).values())
    sigs = sorted(doc["ops"])
    for i, sig in enumerate(sigs):
        call = crafted[i % len(crafted)]
        rec = doc["ops"][sig]
        rec["call"] = call
        rec["target"] = shown or call["target"]
        rec["time_s"] = rec["time_s"] * 50  # wrong: the first call re-measures it
    path.write_text(json.dumps(doc))
    return sigs


class _MLP(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = torch.nn.Linear(16, 32), torch.nn.Linear(32, 4)

    def forward(self, x):
        return self.b(torch.relu(self.a(x)))


def _train(store_dir, steps: int = 3):
    torch.manual_seed(0)
    cmodel = autopar.compile(_MLP(), store=str(store_dir), race=False)
    x = torch.randn(8, 16)
    for _ in range(steps):
        cmodel(x).sum().backward()
    return cmodel


@pytest.mark.parametrize("name", sorted(_crafted_calls("m")))
def test_every_crafted_call_is_refused_and_runs_nothing(name, tmp_path):
    marker = tmp_path / "ran"
    call = _crafted_calls(marker)[name]
    assert why_refused({"target": call["target"], "time_s": 1.0, "call": call}) is not None \
        or name == "_operator.add"  # its target is allowed; its argument is refused below
    with pytest.raises(NotRebuildable):
        rebuild(call)
    assert not marker.exists()


def test_the_name_shown_must_be_the_name_that_runs():
    mm = encode("aten.mm.default", (torch.ones(2, 2), torch.ones(2, 2)), {})
    assert why_refused({"target": "aten.mm.default", "call": mm}) is None
    assert "would run 'aten.addmm.default'" in why_refused(
        {"target": "aten.mm.default", "call": {**mm, "target": "aten.addmm.default"}})


def test_allowed_calls_still_rebuild():
    for target, args in [
        ("aten.relu.default", (torch.randn(3),)),
        ("torch.relu", (torch.randn(3),)),
        ("torch.nn.functional.linear", (torch.randn(2, 3), torch.randn(4, 3))),
        ("method:add", (torch.randn(3), torch.randn(3))),
        ("_operator.mul", (torch.randn(3), 2.0)),
    ]:
        spec = json.loads(json.dumps(encode(target, args, {})))
        assert spec is not None, target
        assert rebuild(spec)[0]().shape[-1] in (3, 4)


def test_descriptions_cannot_exhaust_memory_or_name_other_devices():
    big = {"tensor": [1 << 20, 1 << 20], "stride": [1 << 20, 1], "dtype": "float32",
           "device": "cpu"}  # fmt: skip
    with pytest.raises(NotRebuildable, match="GiB"):
        rebuild({"target": "aten.relu.default", "args": [big], "kwargs": {}})
    assert MAX_BYTES >= 1 << 30
    meta = {**big, "tensor": [2], "stride": [1], "device": "meta"}
    with pytest.raises(NotRebuildable, match="device"):
        rebuild({"target": "aten.relu.default", "args": [meta], "kwargs": {}})
    bad_dtype = {**meta, "device": "cpu", "dtype": "load"}
    with pytest.raises(NotRebuildable, match="not a torch"):
        rebuild({"target": "aten.relu.default", "args": [bad_dtype], "kwargs": {}})


def _verify(store_dir) -> int:
    parser = argparse.ArgumentParser(prog="autopar")
    add_arguments(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["store", "verify", "--store", str(store_dir)])
    return args.func(args)


@pytest.mark.parametrize("shown", [None, "aten.addmm.default"])
def test_a_crafted_store_runs_nothing_under_verify_or_training(shown, tmp_path, capsys):
    store_dir = tmp_path / "store"
    _train(store_dir)  # a real store of this machine's key
    (path,) = store_dir.glob("*.json")
    marker = tmp_path / "ran"
    sigs = _tamper(path, marker, shown)

    with pytest.warns(StoreWarning) as caught:
        _verify(store_dir)
    text = " ".join(str(w.message) for w in caught)
    assert "refused" in text and any(s in text for s in sigs) and str(path) in text
    assert not marker.exists()
    capsys.readouterr()

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cmodel = _train(store_dir, steps=4)
    refusals = [w for w in caught if issubclass(w.category, StoreWarning)
                and "refused" in str(w.message)]  # fmt: skip
    assert len(refusals) == 1 and any(s in str(refusals[0].message) for s in sigs)
    assert not marker.exists()
    # the refused entries were measured again and the file no longer holds them
    cmodel._autopar_pipeline.store.flush()
    doc = json.loads(path.read_text())
    assert not any(why_refused(r) for r in doc["ops"].values())
    assert ProfileStore(store_dir).path == str(path)
