"""capture.dynamo_call: a compiled module's calls run Dynamo's cached code directly, after
Dynamo's own guards, and take Dynamo's path wherever that path would do more than a cache
lookup (hooks, a recompile, a graph break, a stance, a profiler)."""

from __future__ import annotations

import copy
import inspect

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from oracle import assert_close_to_oracle

import autopar
from autopar.capture.dynamo_call import CachedFrameCall, _Binder
from autopar.profiling.store import ProfileStore


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 4)

    def forward(self, x, scale: float = 1.0):
        return self.b(F.relu(self.a(x))) * scale


class Broken(Net):
    def forward(self, x, scale: float = 1.0):
        h = F.relu(self.a(x))
        torch._dynamo.graph_break()
        return super().forward(h, scale)


def _call(model: nn.Module) -> CachedFrameCall:
    optimized = torch.compile(model, backend="eager", dynamic=False, isolate_recompiles=True)
    return CachedFrameCall(model, optimized)


def test_later_calls_run_the_cached_code_directly_and_return_what_dynamo_returns():
    torch.manual_seed(0)
    model, x = Net(), torch.randn(3, 8)
    call = _call(model)
    first = call(x)
    assert call.why_not is None and call.direct_calls == 0  # the first call compiles
    for _ in range(3):
        assert torch.equal(call(x), first)
    assert call.direct_calls == 3
    assert torch.equal(call(x, 2.0), model(x, 2.0))  # another scale: Dynamo recompiles
    assert torch.equal(call(x, scale=2.0), model(x, 2.0))  # then runs directly again
    assert call.direct_calls == 4


def test_a_hook_added_after_the_first_call_takes_effect_on_a_submodule_and_on_the_module():
    model, x = Net(), torch.randn(3, 8)
    ref = copy.deepcopy(model).double()  # the fp64 oracle's twin (hooks added to both)
    call = autopar.compile(model, store=ProfileStore.memory(), race=False)
    call(x), call(x)
    direct = call._autopar_compiled
    assert direct.direct_calls >= 1

    def like_eager(what):  # within the fp64 oracle: a planned program's thread counts differ
        assert_close_to_oracle(what, call(x), model(x), ref(x.double()))

    handles = [m.a.register_forward_hook(lambda _m, i, o: o * 0) for m in (model, ref)]
    like_eager("submodule hook")  # the hook's guard fails: Dynamo recompiles
    for h in handles:
        h.remove()
    handles = [m.register_forward_hook(lambda _m, i, o: o + 1) for m in (model, ref)]
    n = direct.direct_calls
    like_eager("module hook")  # a hook on the module itself: Dynamo's path
    assert direct.direct_calls == n
    for h in handles:
        h.remove()
    call(x)
    assert direct.direct_calls == n + 1


def test_a_graph_break_stance_profiler_or_reset_takes_dynamos_path():
    model, x = Broken(), torch.randn(3, 8)
    call = _call(model)
    for _ in range(3):
        assert torch.allclose(call(x), model(x))
    assert call.direct_calls == 0  # resume functions after the break: Dynamo's frames

    model = Net()
    call = _call(model)
    call(x), call(x)
    n = call.direct_calls
    with torch.compiler.set_stance("force_eager"):
        call(x)
    with torch.profiler.profile():
        call(x)
    assert call.direct_calls == n
    torch._dynamo.reset()  # the cache is gone: no stale entry runs
    call(x)
    assert call.direct_calls == n
    call(x)
    assert call.direct_calls == n + 1


def test_grad_mode_and_shapes_pick_their_own_entries():
    model = Net()
    call = _call(model)
    xs = [torch.randn(3, 8), torch.randn(5, 8)]
    for _ in range(2):
        for x in xs:
            with torch.no_grad():
                assert not call(x).requires_grad
            assert call(x).requires_grad
    assert call.direct_calls == 4


# -- binding: the frame's locals as Python makes them ---------------------------------------
def f_plain(self, x, y):
    return x


def f_defaults(self, x, y=2, *, z=3):
    return x


def f_var(self, x, *rest, k=1, **extra):
    return x


def f_posonly(self, x, /, y=0, **extra):
    return x


FUNCS = [f_plain, f_defaults, f_var, f_posonly]


@settings(max_examples=200, deadline=None)
@given(
    func=st.sampled_from(FUNCS),
    args=st.lists(st.integers(0, 9), max_size=4),
    kwargs=st.dictionaries(st.sampled_from(["x", "y", "z", "k", "rest", "extra", "q"]),
                           st.integers(0, 9), max_size=3),
)  # fmt: skip
def test_the_binder_binds_as_python_or_declines(func, args, kwargs):
    self = object()
    got = _Binder(func)(self, tuple(args), kwargs)
    try:
        bound = inspect.signature(func).bind(self, *args, **kwargs)
    except TypeError:
        assert got is None  # Python raises: Dynamo's path raises it
        return
    bound.apply_defaults()
    if got is not None:  # declining is always allowed (Dynamo's path runs)
        assert got == dict(bound.arguments)


def test_the_binder_reads_free_variables_like_a_frame():
    class WithSuper(Net):
        def forward(self, x, scale: float = 1.0):
            return super().forward(x, scale)

    got = _Binder(WithSuper.forward)(object(), (1,), {})
    assert got["__class__"] is WithSuper and got["scale"] == 1.0


@pytest.mark.parametrize("why", ["forward replaced", "no region"])
def test_calls_that_cannot_skip_dynamo_say_why(why):
    model = Net()
    if why == "forward replaced":
        model.forward = lambda x: x
        optimized = torch.compile(model, backend="eager", isolate_recompiles=True)
    else:
        optimized = torch.compile(model, backend="eager")
    call = CachedFrameCall(model, optimized)
    assert call.why_not
    x = torch.randn(2, 8)
    assert torch.equal(call(x), optimized(x))
    assert call.direct_calls == 0
