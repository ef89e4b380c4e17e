"""The Inductor executor: one captured aten graph compiled whole by Inductor (C++/OpenMP
kernels on CPU, Triton on CUDA), exactly as ``torch.compile`` compiles its forward and
backward graphs.

Two facts shape this module (measured on torch 2.13, see docs/executors.md):

* autopar's AOTAutograd graphs are traced without Inductor's decompositions, which Inductor
  refuses ("both a fallback and a decomp for same op"). :func:`prepare` re-traces the graph
  with ``make_fx(decomposition_table=select_decomp_table())`` on fake tensors (nothing runs,
  no RNG is drawn, the caller's graph is not mutated), then runs the joint-graph passes, as
  ``torch.compile`` does before partitioning. ``fallback_random=True`` keeps dropout as
  eager's kernel, so a seed gives eager's masks and the generator moves as in eager.
* A cold Inductor compile takes 20-40 s on a 2-core box, and compiling on a background
  thread of the training process is unsafe (FX tracing flips process-global flags that a
  Dynamo call on the training thread trips over; codegen restores the global RNG state).
  So the *background* work runs in another process (:func:`start_warmup`: a job for the
  warm-up worker, ``codegen.warmup``), which compiles the same graph and fills Inductor's on-disk
  FX graph cache; the training process then compiles at a step boundary and hits the cache
  (tenths of a second to a few seconds instead of tens).

The FX graph cache needs a ``TracingContext`` whose fake mode has a ``ShapeEnv``; every
compile here runs under one (static shapes: autopar captures with ``dynamic=False``).

Example::

    >>> prog = compile_inductor(gm, args, tag="g0.fw")     # doctest: +SKIP
    >>> out = prog.fn(*args)                               # doctest: +SKIP
"""

from __future__ import annotations

import os
import sys
import tempfile
import time
from typing import Any, NamedTuple

import torch
import torch.fx as fx

from autopar.codegen.emit import Program
from autopar.codegen.warmup import load_warmup_job, spawn_warmup


class TensorMeta(NamedTuple):
    shape: tuple
    stride: tuple
    dtype: torch.dtype
    device: str


#: Inductor settings for every autopar compile (applied with ``config.patch``: the process's
#: settings are untouched). fallback_random: dropout draws exactly what eager draws.
INDUCTOR_CONFIG = {"fallback_random": True}


def _fake_args(example_args: list):
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    mode = FakeTensorMode(shape_env=ShapeEnv(), static_shapes=True, allow_non_fake_inputs=True)
    fakes = [mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in example_args]
    return mode, fakes


def prepare(gm: fx.GraphModule, example_args: list):
    """Re-trace ``gm`` with Inductor's decompositions and joint-graph passes, on fakes of
    ``example_args`` (real tensors or ``torch.empty_strided`` stand-ins: only metadata is
    read). Returns ``(decomposed graph, fake mode, fake args)``. Run it on the thread that
    calls the compiled model (FX tracing sets process-global state)."""
    from torch._guards import TracingContext, tracing
    from torch._inductor import config
    from torch._inductor.decomposition import select_decomp_table
    from torch._inductor.fx_passes.joint_graph import joint_graph_passes
    from torch._inductor.virtualized import V
    from torch.fx.experimental.proxy_tensor import make_fx

    mode, fakes = _fake_args(example_args)
    with config.patch(INDUCTOR_CONFIG), tracing(TracingContext(mode)), torch.no_grad():
        dec = make_fx(gm, decomposition_table=select_decomp_table(), tracing_mode="fake")(*fakes)
        with V.set_fake_mode(mode):
            joint_graph_passes(dec)
    return dec, mode, fakes


def compile_inductor(
    gm: fx.GraphModule, example_args: list, *, tag: str, cpp_wrapper: bool = False
) -> Program:
    """Compile graph ``gm`` (tag ``g<k>.fw``/``.bw``) whole with Inductor; a :class:`Program`
    whose ``fn(*args)`` returns what ``gm(*args)`` returns and whose ``source`` is
    Inductor's output code. Synchronous; call it on the thread that runs the model.
    ``cpp_wrapper``: Inductor's C++ wrapper, which runs the whole graph without the GIL."""
    from torch._dynamo.convert_frame import compile_lock
    from torch._guards import TracingContext, tracing
    from torch._inductor import config
    from torch._inductor.compile_fx import compile_fx_inner

    t0 = time.perf_counter()
    dec, mode, fakes = prepare(gm, example_args)
    patches = dict(INDUCTOR_CONFIG, cpp_wrapper=cpp_wrapper)
    # compile_lock: Inductor compiles are not re-entrant across threads; this also orders
    # us with any Dynamo compile of the same process.
    with compile_lock, config.patch(patches), tracing(TracingContext(mode)):
        compiled = compile_fx_inner(
            dec, fakes, is_backward=tag.endswith(".bw"), cpp_wrapper=cpp_wrapper
        )

    # Inductor's code asserts the strides it was compiled for. A graph's inputs can change
    # layout when the graph *before* it changes executor (an Inductor forward may save
    # channels-last activations for the backward): such inputs are copied into the
    # compiled layout instead of failing (a per-call check of strides, a copy only then).
    layout = [
        (i, tuple(a.shape), tuple(a.stride())) for i, a in enumerate(example_args)
        if isinstance(a, torch.Tensor)
    ]  # fmt: skip

    def fn(*args: Any) -> Any:
        args = list(args)  # the compiled call clears the list it is given
        for i, shape, stride in layout:
            a = args[i]
            if a.stride() != stride and a.numel() > 1:
                args[i] = torch.empty_strided(shape, stride, dtype=a.dtype,
                                              device=a.device).copy_(a)  # fmt: skip
        return compiled(args)

    seconds = time.perf_counter() - t0
    name = "inductor" + (" cpp_wrapper" if cpp_wrapper else "")
    head = (
        f"# autopar: graph {tag} compiled whole by {name} in {seconds:.1f} s\n"
        "# (torch._inductor; below is Inductor's output code, which is what runs)\n"
    )
    source = head + (getattr(compiled, "source_code", None) or "# (output code not kept)\n")
    filename = f"<autopar {name} {tag}>"
    return Program(source, fn, None, tag, filename, notes=(f"{name}: {seconds:.1f} s",))


# -- the background half: a separate process fills Inductor's FX graph cache -------------
def start_warmup(gm: fx.GraphModule, example_args: list, tag: str):
    """Queue the compile of ``gm`` for ``example_args``' shapes in the warm-up process
    (``codegen.warmup``: low priority; the same settings, so the cache keys agree),
    so that :func:`compile_inductor` here later hits the cache. The graph and the input
    metadata travel in a temp file. Returns the job's handle."""
    meta = input_meta(example_args)
    fd, path = tempfile.mkstemp(prefix="autopar-inductor-", suffix=".pt")
    os.close(fd)
    torch.save({"gm": gm, "meta": meta, "tag": tag}, path)
    return spawn_warmup("autopar.codegen.inductor", path)


def input_meta(args: list) -> list:
    """What a compile needs of the inputs: each tensor's shape, strides, dtype and device
    (as a ``TensorMeta``), other values as they are."""
    return [
        TensorMeta(tuple(a.shape), tuple(a.stride()), a.dtype, str(a.device))
        if isinstance(a, torch.Tensor) else a
        for a in args
    ]  # fmt: skip


def stand_ins(meta: list) -> list:
    """``torch.empty_strided`` tensors with the recorded metadata (values unused). Both
    processes compile from stand-ins, so their cache keys agree."""
    return [
        torch.empty_strided(m.shape, m.stride, dtype=m.dtype, device=m.device)
        if isinstance(m, TensorMeta) else m
        for m in meta
    ]  # fmt: skip


def _warmup_main(path: str, parent: int | None = None) -> int:
    job = load_warmup_job(path, parent)
    compile_inductor(job["gm"], stand_ins(job["meta"]), tag=job["tag"])
    return 0


if __name__ == "__main__":
    # Through the package module, not __main__: the pickled TensorMeta names that class.
    from autopar.codegen.inductor import _warmup_main as main

    sys.exit(main(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else None))
