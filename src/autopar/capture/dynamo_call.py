"""Calling a compiled module's forward through Dynamo's cache directly: Dynamo's own guards,
then Dynamo's own compiled code, without Dynamo's Python wrappers around them.

Why: a call of a ``torch.compile``d module goes through ``OptimizedModule.__call__``,
``nn.Module.__call__`` twice, Dynamo's ``compile_wrapper`` (about twenty checks and settings
made and undone: tracing contexts, export, fx and jit tracing, stance, recompile region,
graph-break policy) and only then to the C frame evaluator, which checks the guards of
each cache entry of the forward's code and runs the first entry that passes. On the 2-core
box that wrapper cost 85-170 us of every training step (measured 2026-12-07: towers
2.97 -> 2.86-2.88 ms a step, the Transformer 1.79 -> 1.67-1.69 ms, the deep MLP
4.69 -> 4.50-4.53 ms; ABBA in one process, `/tmp`-free probe in docs/benchmarks.md). Python
code run right after large kernels runs 3-10x slower than in a tight loop (cold caches),
so those layers cost far more inside a step than a micro-benchmark shows.

What :class:`CachedFrameCall` does on a call:

1. Takes Dynamo's normal path (the ``OptimizedModule``) unless nothing but a cache lookup
   could happen there: ``model.forward`` is still the forward bound here (a forward
   replaced on the instance or the class takes Dynamo's path, which compiles it, as
   ``torch.compile`` does), no hooks on the module itself and no global module hooks (they run
   outside Dynamo, in ``nn.Module.__call__``), the default stance, Dynamo enabled, no
   tracing (Dynamo, fx, jit) and no profiler (Dynamo's region annotations stay), no
   compiled-autograd context to enter, keyword arguments that bind plainly.
2. Binds the arguments as the forward's frame would (defaults, ``*args``, ``**kwargs``),
   and checks the guards of the forward's cache entries in Dynamo's own order, with
   Dynamo's own guard managers (``guard_manager.check``: grad mode, global state, every
   tensor's metadata, module attributes, hooks on submodules, ...). Only entries of this
   module's recompile region count.
3. Runs the first entry that passes when its code is one compiled graph and nothing else
   (no resume function after a graph break, no other call Dynamo would have to catch):
   the very code object Dynamo would run, as a function over the same globals, closure
   and defaults. Any other case, including no entry passing (Dynamo then compiles), goes
   through the ``OptimizedModule`` as before.

So what runs is what Dynamo would have run, and every decision that could differ (a
recompile, a hook, a graph break) is Dynamo's. Where this torch has no cache-entry API, or
the module has no recompile region of its own (``capture.backend.dynamo_regions``), every
call takes the normal path.

Example::

    >>> m = torch.nn.Linear(4, 2)                                   # doctest: +SKIP
    >>> call = CachedFrameCall(m, torch.compile(m, isolate_recompiles=True))
    >>> call(torch.randn(3, 4)).shape        # first call: Dynamo compiles, as usual
    torch.Size([3, 2])
    >>> call.direct_calls                     # later calls run the cached code directly
"""

from __future__ import annotations

import inspect
import types
from typing import Any

import torch
import torch.fx

from autopar import compat

_entries = compat.dynamo_cache_entries()  # None on another torch: Dynamo's path always

#: Names in a compiled frame's code that mean more than one compiled graph runs there:
#: a resume function after a graph break (Dynamo must catch its frame).
_RESUME_PREFIX = "__resume_at_"
_COMPILED_PREFIX = "__compiled_fn_"


class CachedFrameCall:
    """``call(*args, **kwargs)`` returns what ``optimized(*args, **kwargs)`` returns
    (``optimized``: ``torch.compile(model, ...)``), running Dynamo's cached code for the
    forward directly where only a cache lookup would have happened (module docstring).
    ``direct_calls`` counts the calls that did."""

    def __init__(self, model: torch.nn.Module, optimized: Any):
        self.model, self.optimized = model, optimized
        self.direct_calls = 0
        self._functions: dict[types.CodeType, types.FunctionType | None] = {}
        forward = getattr(model, "forward", None)
        ctx = getattr(optimized, "dynamo_ctx", None)
        self._region = getattr(ctx, "_isolate_recompiles_id", -1)
        self._why_not = _unsupported(model, forward, ctx, self._region)
        if self._why_not is None:
            func = forward.__func__
            self._func, self._code = func, func.__code__
            self._bind = _Binder(func)
            # What ``model.forward`` resolves to now: an instance attribute (a forward
            # replaced with ``model.forward = ...``) or the class's function. A call checks
            # both before it runs the code bound here; Dynamo's guards do not cover them.
            self._own_forward = model.__dict__.get("forward")
            self._class_forward = getattr(type(model), "forward", None)

    @property
    def why_not(self) -> str | None:
        """Why no call can run directly (None: calls that only look up the cache do)."""
        return self._why_not

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        model = self.model
        if (self._why_not is None and model.__dict__.get("forward") is self._own_forward
                and type(model).forward is self._class_forward and _plain_call(model)):  # fmt: skip
            f_locals = self._bind(model, args, kwargs)
            if f_locals is not None:
                fn = self._lookup(f_locals)
                if fn is not None:
                    self.direct_calls += 1
                    return fn(model, *args, **kwargs)
        return self.optimized(*args, **kwargs)

    def _lookup(self, f_locals: dict) -> types.FunctionType | None:
        """The function of the first cache entry (in Dynamo's order, this region's) whose
        guards pass, when its code runs one compiled graph and nothing else; else None."""
        for entry in _entries(self._code):
            if entry.isolate_recompiles_id != self._region:
                continue
            try:
                if not entry.guard_manager.check(f_locals):
                    continue
            except Exception:  # noqa: BLE001 - a guard that cannot run here: Dynamo's path
                return None
            code = entry.code
            fn = self._functions.get(code, False)
            if fn is False:
                fn = self._functions[code] = self._function(code)
            return fn
        return None

    def _function(self, code: types.CodeType) -> types.FunctionType | None:
        """The compiled frame's code as a function like the forward (its globals, closure,
        defaults), or None where the code does more than call one compiled graph."""
        names = code.co_names
        compiled = [n for n in names if n.startswith(_COMPILED_PREFIX)]
        if len(compiled) != 1 or any(n.startswith(_RESUME_PREFIX) for n in names):
            return None
        func = self._func
        if len(code.co_freevars) != len(func.__closure__ or ()):
            return None
        fn = types.FunctionType(code, func.__globals__, func.__name__, func.__defaults__,
                                func.__closure__)  # fmt: skip
        fn.__kwdefaults__ = func.__kwdefaults__
        return fn


def _unsupported(model: torch.nn.Module, forward: Any, ctx: Any, region: int) -> str | None:
    """Why no call of this compiled module can skip Dynamo's wrappers (None: calls can)."""
    if not compat.bypasses_on():
        return compat.bypasses_off_reason()
    if _entries is None:
        return "this torch has no Dynamo cache-entry API"
    if ctx is None or region < 0:
        return "the module has no Dynamo recompile region of its own"
    if not isinstance(forward, types.MethodType) or forward.__self__ is not model:
        return "the module's forward is not a plain method"
    if not isinstance(forward.__func__, types.FunctionType):
        return "the module's forward is not a Python function"
    if any(getattr(h, "__name__", "") == "call_compiled_autograd" for h in ctx.enter_exit_hooks):
        return "compiled autograd is entered around every call"
    return None


def _plain_call(model: torch.nn.Module) -> bool:
    """Whether Dynamo's path would do nothing but look up the cache: checked per call, as
    any of these can change between two calls. (Module attributes, read at call time;
    Python code right after large kernels runs cold, so this reads as little as it can.)"""
    return not (
        model._forward_hooks or model._forward_pre_hooks or model._backward_hooks
        or model._backward_pre_hooks or _module_hooks._has_any_global_hook()
        or _eval_frame._stance.stance != "default" or _dynamo_config.disable
        or _is_compiling() or _tracing_state() is not None or _fx_tracing()
        or _profiler._is_profiler_enabled
    )  # fmt: skip


_module_hooks = torch.nn.modules.module
_eval_frame = compat.dynamo_eval_frame()
_dynamo_config = compat.dynamo_config()
_is_compiling = torch.compiler.is_compiling
_tracing_state = compat.get_tracing_state
_fx_tracing = compat.is_fx_symbolic_tracing
_profiler = torch.autograd.profiler


class _Binder:
    """The forward frame's locals for a call, as Python binds them (defaults, ``*args``,
    ``**kwargs``); None where the call does not bind plainly (Dynamo's path then runs and
    raises Python's own error for a bad call)."""

    def __init__(self, func: types.FunctionType):
        code = func.__code__
        n, k = code.co_argcount, code.co_kwonlyargcount
        self.names = code.co_varnames[:n]
        self.kwonly = code.co_varnames[n : n + k]
        i = n + k
        self.varargs = code.co_varnames[i] if code.co_flags & inspect.CO_VARARGS else None
        i += self.varargs is not None
        self.varkw = code.co_varnames[i] if code.co_flags & inspect.CO_VARKEYWORDS else None
        # positional-only parameters cannot be given by keyword
        self.keywords = frozenset(self.names[code.co_posonlyargcount :] + self.kwonly)
        defaults = func.__defaults__ or ()
        self.defaults = dict(zip(self.names[n - len(defaults) :], defaults, strict=True))
        self.defaults.update(func.__kwdefaults__ or {})
        # A frame's locals include its free variables (``__class__`` for ``super()``).
        self.free = tuple(zip(code.co_freevars, func.__closure__ or (), strict=True))
        # the usual call, positional arguments for every parameter: one dict(zip(...))
        self.simple = k == 0 and self.varargs is None and self.varkw is None and not self.free

    def __call__(self, model: torch.nn.Module, args: tuple, kwargs: dict) -> dict | None:
        names = self.names
        given = (model, *args)
        if self.simple and not kwargs and len(given) == len(names):
            return dict(zip(names, given, strict=True))
        if len(given) > len(names) and self.varargs is None:
            return None
        f_locals = dict(zip(names, given, strict=False))  # the rest: keywords, defaults
        extra_kw = {}
        for name, value in kwargs.items():
            if name in f_locals or name == self.varargs:
                return None  # given twice (Python raises), or not a keyword parameter
            if name in self.keywords:
                f_locals[name] = value
            elif self.varkw is not None:
                extra_kw[name] = value
            else:
                return None
        for name in (*names, *self.kwonly):
            if name not in f_locals:
                if name not in self.defaults:
                    return None  # a missing argument: Python raises
                f_locals[name] = self.defaults[name]
        if self.varargs is not None:
            f_locals[self.varargs] = tuple(given[len(names) :])
        if self.varkw is not None:
            f_locals[self.varkw] = extra_kw
        for name, cell in self.free:
            try:
                f_locals[name] = cell.cell_contents
            except ValueError:  # an empty cell is no local of the frame
                pass
        return f_locals
