"""``autopar.compat``: the fast paths that copy PyTorch's per-call work run on a tested torch
release only, and only while the snapshot of what they rely on holds; on any other release
every one is off and the models still train equal to eager."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from nets import dynamo_graph
from oracle import check_training

import autopar
from autopar import compat
from autopar.capture.direct_autograd import DirectGraph
from autopar.profiling.store import ProfileStore
from autopar.tools import zoo


@pytest.fixture
def untested_torch(monkeypatch):
    """This process pretends to run a torch release the project has not tested."""
    monkeypatch.setattr(compat, "release", lambda version=None: "2.99.0")
    yield
    compat._say_once.cache_clear()


def test_the_tested_release_matches_the_snapshot():
    """What the bypasses rely on, pinned: AOTAutograd's metadata fields and Dynamo's
    cache-entry API. A torch upgrade that changes them fails here, and at run time the
    bypasses turn themselves off (compat._snapshot_problem)."""
    if not compat.tested():
        pytest.skip(f"torch {compat.release()} is not a tested release")
    from torch._functorch._aot_autograd.schemas import ViewAndMutationMeta

    assert {f.name for f in dataclasses.fields(ViewAndMutationMeta)} == compat.AOT_META_FIELDS
    assert compat._snapshot_problem() is None and compat.bypasses_on()
    model, (x,) = zoo.build("mlp")  # a module of the user's: its forward is the frame
    autopar.compile(model, store=ProfileStore.memory())(x)
    entries = compat.dynamo_cache_entries()(type(model).forward.__code__)
    assert entries and all(hasattr(e, a) for e in entries
                           for a in ("guard_manager", "code", "isolate_recompiles_id"))  # fmt: skip


def test_the_cpp_wrapper_entrys_arity_comes_from_the_compile():
    """The native split sizes its C++ calls by the graph Inductor compiled (its own record),
    cross-checked against the compiled graph's outputs: no regex over generated source."""
    from autopar.codegen.batch_split import compile_split

    gm, args = dynamo_graph(torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh()),
                            torch.randn(4, 8, requires_grad=True))  # fmt: skip
    joint = compile_split(gm, [a[:2] if a.shape[0] == 4 else a for a in args], tag="g0")
    fw_in, fw_out = joint.arity["forward"]
    assert fw_in == len(args)
    assert fw_out == len(joint.fn.forward.output_strides)
    assert joint.arity["backward"][1] == len(joint.fn.backward.output_strides)


def test_an_untested_release_turns_every_bypass_off(untested_torch, caplog):
    import logging

    from autopar.capture.dynamo_call import CachedFrameCall

    with caplog.at_level(logging.INFO, logger="autopar"):
        assert not compat.bypasses_on()
    assert "2.99.0 is not a tested release" in caplog.text
    model = torch.nn.Linear(4, 2)
    call = CachedFrameCall(model, torch.compile(model))
    assert "not a tested release" in call.why_not


@pytest.mark.parametrize("name", ["mlp", "inplace_views", "graph_break"])
def test_an_untested_release_still_trains_the_zoo_like_eager(name, untested_torch):
    model, inputs = zoo.build(name)
    compiled = {}

    def compile_fn(m):
        cm = compiled["m"] = autopar.compile(m, store=ProfileStore.memory(), race=False)
        return cm

    check_training(model, inputs, compile_fn)
    pipe = compiled["m"]._autopar_pipeline
    assert not any(isinstance(g.captured, DirectGraph) for g in pipe.capture.dynamo_graphs)
    assert compiled["m"]._autopar_compiled.direct_calls == 0
    assert "not a tested release" in str(autopar.explain(compiled["m"]))


def test_every_private_name_resolves_on_the_tested_release():
    """Each accessor of ``compat`` finds its PyTorch name (the lazy ones imported here): a
    torch upgrade that moves one fails here, not in the middle of a training step."""
    if not compat.tested():
        pytest.skip(f"torch {compat.release()} is not a tested release")
    bound = ["is_any_autocast_enabled", "peek_interpreter_stack", "len_torch_dispatch_stack",
             "len_torch_function_stack", "top_saved_tensors_default_hooks",
             "get_current_graph_task_keep_graph", "get_tracing_state", "nn_linear", "vf_gru",
             "make_contiguous_strides_for", "tree_leaves", "is_fx_symbolic_tracing",
             "get_current_dispatch_mode_stack", "pop_mode_temporarily"]  # fmt: skip
    missing = [n for n in bound if getattr(getattr(compat, n), "__name__", "").startswith("torch")]
    assert not missing, f"stand-ins for missing names: {missing}"
    getters = ["dynamo_config", "dynamo_eval_frame", "dynamo_compiled_autograd",
               "optimized_module_class", "dynamo_exception_classes", "restart_analysis_class",
               "dynamo_compile_lock", "functorch_config", "view_and_mutation_meta_class",
               "coerce_to_expected_memory_format_fn", "custom_op_analysis_mode_class",
               "inductor_config", "custom_partitioner_class", "dynamo_cache_entries"]  # fmt: skip
    assert all(getattr(compat, n)() is not None for n in getters)
    assert compat.autocast_dispatch_key("cpu") == "AutocastCPU"
    assert isinstance(compat.inductor_default_cache_dir(), str)


def test_a_missing_private_name_raises_a_clear_error():
    stand_in = compat._bound("torch._C", "_no_such_function")
    with pytest.raises(compat.MissingPrivateAPI, match="torch._C._no_such_function"):
        stand_in()
