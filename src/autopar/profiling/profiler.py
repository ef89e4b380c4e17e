"""The operator profiler: run an aten-level FX graph once for real, measuring every operator.

``profile_graph`` interprets the graph node by node (an ``fx.Interpreter``). Each compute node
runs exactly once on the real data, in graph order, so the returned output is bit-identical
to ``gm(*args)``. Each *new* operator signature is additionally timed on the side:

* the real call runs first; then the timing calls run on the same inputs, except that
  arguments the operator writes in place (schema ``Tensor(a!)``) are cloned, so e.g. the
  ``add_`` AOTAutograd emits for BatchNorm running stats is applied to real data once;
* the CPU/CUDA random generators (and any ``torch.Generator`` argument) are saved before the
  timing calls and restored after, so dropout masks are those eager execution draws;
* the intra-op thread count is restored in a ``finally`` after the 1-thread timing.

Timing (``autopar.profiling.timing.measure_op``): samples of batched calls, at least three,
each checked for contention (the calling thread descheduled, or any thread of the process
preempted, during it); disturbed samples and slow outliers are set aside; the median of the
rest is the time. A contended setting is re-measured after a pause (within ``RETRY_BUDGET_S``
per run); still contended, the record is ``provisional``: the store keeps it only where it has
no clean one, and a provisional entry met in the store is measured again. CUDA samples use
CUDA events and synchronise. CUDA ops get ``time_1t_s = time_s`` (intra-op threads are a CPU
setting). Each stored record also holds its call's description (``callspec``), so the store
can re-time it alone.

Operators found in the store are checked against this run: their real call, and one more
warm call on the side (CUDA: timed by events), give ``measured`` seconds per node.
``df.attrs["measured_s"]`` sums them (fresh measurements count at their new time) and
``df.attrs["evidence"]`` holds them per node key: ``autopar.profiling.heal`` compares them with
the store's times.

The table's columns are documented in docs/architecture.md ("The profile table"). Example::

    >>> import torch
    >>> from torch.fx.experimental.proxy_tensor import make_fx
    >>> gm = make_fx(lambda x, w: torch.relu(x @ w))(torch.randn(8, 4), torch.randn(4, 3))
    >>> out, df = profile_graph(gm, [torch.randn(8, 4), torch.randn(4, 3)], repeats=2)
    >>> df.loc[df.target == "aten.mm.default", "flops"].item()
    192
"""

from __future__ import annotations

import contextlib
import copy
import math
import operator
import time
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import pandas as pd
import torch
import torch.fx
from torch.utils.flop_counter import FlopCounterMode

from autopar import compat
from autopar.capture.backend import node_key
from autopar.errors import node_source
from autopar.profiling.callspec import encode
from autopar.profiling.quality import is_provisional
from autopar.profiling.signature import (
    describe,
    format_meta,
    leaves,
    nbytes,
    signature,
    storage_ptr,
    target_name,
    tensors,
    version_of,
)
from autopar.profiling.store import ProfileStore
from autopar.profiling.timing import (
    BATCH_TARGET_S,
    MAX_BATCH,
    NodeTimes,
    RetryBudget,
    measure_op,
    planning_time_s,
    time_sample,
)

COLUMNS = [
    "graph", "phase", "node", "key", "op", "target", "signature", "time_s", "time_1t_s",
    "threads", "flops", "bytes_read", "bytes_written", "output_bytes", "is_view", "inputs",
    "input_bytes", "users", "shape", "dtype", "device", "cached", "source",
]  # fmt: skip

#: Seconds one profile_graph may spend re-measuring contended operators.
RETRY_BUDGET_S = 2.0
_COMPUTE_OPS = ("call_function", "call_method", "call_module")


# -- measuring one operator -------------------------------------------------------------------
@contextlib.contextmanager
def _rng_preserved(devices: set[torch.device], generators: list[torch.Generator]):
    """Restore every random generator the timing calls could advance."""
    cpu = torch.get_rng_state()
    cuda = {d: torch.cuda.get_rng_state(d) for d in devices}
    gens = [(g, g.get_state()) for g in generators]
    try:
        yield
    finally:
        torch.set_rng_state(cpu)
        for d, s in cuda.items():
            torch.cuda.set_rng_state(s, d)
        for g, s in gens:
            g.set_state(s)


def _clone(value: Any) -> Any:
    """A private copy of every tensor in ``value``, keeping sizes and strides (views too)."""
    if isinstance(value, torch.Tensor):
        if value.layout != torch.strided:
            return value.clone()
        twin = torch.empty_strided(
            value.size(), value.stride(), dtype=value.dtype, device=value.device
        )
        return twin.copy_(value)
    if isinstance(value, tuple):
        return tuple(_clone(v) for v in value)
    if isinstance(value, list):
        return [_clone(v) for v in value]
    return value


# Python operators FX emits (getitem on multi-output ops, scalar arithmetic) never write their
# arguments, except the augmented assignments: iadd, iand, imatmul, ... (i + another operator).
def _is_pure_builtin(fn: Any) -> bool:
    if getattr(fn, "__module__", None) not in ("_operator", "operator"):
        return False
    name = getattr(fn, "__name__", "")
    inplace = name.startswith("i") and (
        hasattr(operator, name[1:]) or hasattr(operator, name[1:] + "_")
    )
    return not inplace


def _timing_args(node: torch.fx.Node, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """Arguments for the timing calls: clones of whatever the operator may write in place."""
    target = node.target
    if node.op == "call_function" and isinstance(target, compat.OpOverload):
        writes = [
            (i, a.name)
            for i, a in enumerate(target._schema.arguments)
            if a.alias_info is not None and a.alias_info.is_write
        ]
        if not writes:
            return args, kwargs
        args, kwargs = list(args), dict(kwargs)
        for i, name in writes:
            if i < len(args) and not target._schema.arguments[i].kwarg_only:
                args[i] = _clone(args[i])
            elif name in kwargs:
                kwargs[name] = _clone(kwargs[name])
        return tuple(args), kwargs
    if node.op == "call_function" and _is_pure_builtin(target):
        return args, kwargs
    # No schema to tell what is written (torch.* functions, methods, modules): clone it all.
    return tuple(_clone(a) for a in args), {k: _clone(v) for k, v in kwargs.items()}


class _ProfilingInterpreter(torch.fx.Interpreter):
    """Runs every node for real once; measures each new signature on the side."""

    def __init__(self, gm, *, tag, phase, store, warmup, repeats, single_thread):
        super().__init__(gm)
        self.tag, self.phase, self.store = tag, phase, store
        self.warmup, self.repeats = warmup, repeats
        self.single_thread = single_thread
        self.threads = torch.get_num_threads()
        self.rows: list[dict[str, Any]] = []
        self.seen: dict[str, dict[str, Any]] = {}  # signature -> record, this run
        self.from_store: set[str] = set()  # signatures this run took from the store
        self.checked: dict[str, float] = {}  # of those: seconds per call, timed in this run
        self.evidence: dict[str, float] = {}  # node key -> seconds measured in this run
        self.budget = RetryBudget(RETRY_BUDGET_S)
        self.measured = 0
        self.errors: list[str] = []

    # -- the real run + bookkeeping ----------------------------------------------------------
    def run_node(self, n: torch.fx.Node) -> Any:
        inputs = n.all_input_nodes
        input_bytes = [nbytes(self.env.get(p)) for p in inputs]
        record, sig, cached = None, "", False
        read = written = 0
        is_view = False
        if n.op in _COMPUTE_OPS:
            with self._set_current_node(n):
                args, kwargs = self.fetch_args_kwargs_from_env(n)
                in_tensors = tensors((args, kwargs))
                versions = [version_of(t) for t in in_tensors]
                t0 = time.perf_counter()
                result = getattr(self, n.op)(n.target, args, kwargs)  # the one real execution
                real_s = time.perf_counter() - t0
                read = sum(t.numel() * t.element_size() for t in in_tensors)
                written, is_view = self._writes(in_tensors, versions, tensors(result))
                sig = signature(self._label(n), args, kwargs, self.threads)
                record, cached = self._lookup(sig)
                if record is None:
                    record = self._measure(n, sig, args, kwargs, result, real_s)
                key = node_key(self.tag, n.name)
                if sig in self.from_store:
                    if sig not in self.checked:
                        self.checked[sig] = self._check(n, args, kwargs, result, real_s, record)
                    self.evidence[key] = self.checked[sig]
                else:
                    self.evidence[key] = float(record["time_s"])
        else:
            result = super().run_node(n)
        out_tensors = tensors(result) if n.op != "output" else []  # output: just edges
        shape, dtype, device = format_meta(result, out_tensors)
        row = {
            "graph": self.tag,
            "phase": self.phase,
            "node": n.name,
            "key": node_key(self.tag, n.name),
            "op": n.op,
            "target": target_name(n),
            "signature": sig,
            "time_s": planning_time_s(record) if record else 0.0,
            "time_1t_s": self._time_1t(record) if record else 0.0,
            "threads": self.threads,
            "flops": int(record.get("flops", 0)) if record else 0,
            "bytes_read": read,
            "bytes_written": written,
            "output_bytes": sum(t.numel() * t.element_size() for t in out_tensors),
            "is_view": is_view,
            "inputs": [p.name for p in inputs],
            "input_bytes": input_bytes,
            "users": [u.name for u in n.users],
            "shape": shape,
            "dtype": dtype,
            "device": device or (self._device_of(n) if n.op in _COMPUTE_OPS else ""),
            "cached": cached,
            "source": node_source(n),
        }
        n.meta["autopar.profile"] = row
        self.rows.append(row)
        return result

    def _label(self, n: torch.fx.Node) -> str:
        if n.op == "call_module":  # the module's configuration decides its cost, not its path
            mod = self.submodules[n.target]
            params = [describe(p) for p in mod.parameters()]
            return f"module:{type(mod).__qualname__}({mod.extra_repr()}){params}"
        if n.op == "call_method":
            return f"method:{n.target}"
        return target_name(n)

    def _device_of(self, n: torch.fx.Node) -> str:
        for p in n.all_input_nodes:
            ts = tensors(self.env.get(p))
            if ts:
                return str(ts[0].device)
        return "cpu"

    @staticmethod
    def _writes(in_tensors, versions, out_tensors) -> tuple[int, bool]:
        """(bytes written, aliases an input) of the call that just ran, measured: storage
        sharing + version counters.

        An output sharing storage with an input is a view, unless the operator wrote that
        input in place (its version counter moved), which writes the output's bytes.

        This is not ``autopar.capture.analysis.buffer_analysis``, and does not reuse it:
        that is the static, schema-based answer (the buffers a node *may* write or share,
        on every run), which scheduling needs for correctness. This is what one call *did*,
        in bytes, for the table's ``bytes_written`` (the cost model's memory traffic) and
        ``is_view`` (liveness) columns: ``reshape`` or ``contiguous`` share their input's
        storage only when no copy was needed, and call_method / call_module nodes have no
        schema to read.
        """
        in_ptrs = {storage_ptr(t) for t in in_tensors} - {0}
        mutated = {
            storage_ptr(t) for t, v in zip(in_tensors, versions, strict=True)
            if v is None or version_of(t) != v
        }
        written, alias = 0, False
        for t in out_tensors:
            ptr = storage_ptr(t)
            if ptr and ptr in in_ptrs:
                alias = True
                if ptr not in mutated:
                    continue
            written += t.numel() * t.element_size()
        return written, alias

    def _time_1t(self, record: dict[str, Any]) -> float:
        return float("nan") if (t1 := record.get("time_1t_s")) is None else float(t1)

    def _lookup(self, sig: str) -> tuple[dict[str, Any] | None, bool]:
        record = self.seen.get(sig)
        if record is None:
            record = self.store.get(sig)
            needs_1t = self.single_thread and self.threads > 1
            if record is None or (needs_1t and record.get("time_1t_s") is None):
                return None, False
            if is_provisional(record):  # measured under contention: measure it again
                return None, False
            self.seen[sig] = record
            self.from_store.add(sig)
        return record, True

    # -- the side measurement -----------------------------------------------------------------
    def _call_of(self, n: torch.fx.Node, args: tuple, kwargs: dict) -> Callable[[], Any]:
        if n.op == "call_function":
            fn = n.target
            return lambda: fn(*args, **kwargs)
        if n.op == "call_method":
            self_obj, rest = args[0], args[1:]
            method = n.target
            return lambda: getattr(self_obj, method)(*rest, **kwargs)
        # A module may update buffers (BatchNorm running stats): time a private copy.
        mod = copy.deepcopy(self.submodules[n.target])
        return lambda: mod(*args, **kwargs)

    @contextlib.contextmanager
    def _side_call(self, n, args, kwargs, result):
        """(call, CUDA device or None): the node's operator, callable on the side without
        touching the real run (written arguments cloned, generators restored after)."""
        every = tensors((args, kwargs, result))
        cuda_devs = {t.device for t in every if t.device.type == "cuda"}
        kw_dev = kwargs.get("device")
        if kw_dev is not None and torch.device(kw_dev).type == "cuda":
            cuda_devs.add(torch.device(kw_dev))
        cuda = min(cuda_devs, key=str) if cuda_devs else None
        gens = [g for g in leaves((args, kwargs)) if isinstance(g, torch.Generator)]
        on_device = torch.cuda.device(cuda) if cuda is not None else contextlib.nullcontext()
        with _rng_preserved(cuda_devs, gens), on_device:
            t_args, t_kwargs = _timing_args(n, args, kwargs)
            yield self._call_of(n, t_args, t_kwargs), cuda

    def _check(self, n, args, kwargs, result, real_s, record) -> float:
        """Seconds per call of a stored operator now: one sample on the side, batched like
        the stored one (CUDA: timed by events), or the real call if faster. A disturbed
        sample is only an upper bound (interference adds time): it may lower the stored
        time, never raise it."""
        if n.op == "call_module":  # the side call would deep-copy the module: not worth it
            return real_s
        est = min(real_s, float(record["time_s"]))
        k = min(MAX_BATCH, max(1, math.ceil(BATCH_TARGET_S / max(est, 1e-9))))
        try:
            with self._side_call(n, args, kwargs, result) as (call, cuda):
                call()  # warm-up, as the stored measurement had
                warm = time_sample(call, k, cuda)
        except Exception:  # noqa: BLE001 - a check must never break the user's run
            return real_s
        now = warm.seconds if cuda is not None else min(real_s, warm.seconds)
        return min(now, float(record["time_s"])) if warm.disturbed else now

    def _measure(self, n, sig, args, kwargs, result, real_s) -> dict[str, Any]:
        record: dict[str, Any] = {"target": target_name(n)}
        try:
            with self._side_call(n, args, kwargs, result) as (call, cuda):
                counter = FlopCounterMode(display=False)
                with counter:  # the first (untimed) warm-up call counts the FLOPs
                    call()
                record["flops"] = int(counter.get_total_flops())
                record.update(
                    measure_op(
                        call, cuda, warmup=self.warmup - 1, repeats=self.repeats,
                        single_thread=self.single_thread, budget=self.budget,
                    )
                )  # fmt: skip
            spec = encode(self._label(n), args, kwargs)
            if spec is not None:
                record["call"] = spec
        except Exception as e:  # noqa: BLE001 - timing must never break the user's run
            self.errors.append(f"{n.format_node()}: {type(e).__name__}: {e}")
            # The real call's time is the best we have (one sample; launch time on CUDA).
            record = {"target": target_name(n), "time_s": real_s, "time_1t_s": real_s, "flops": 0}
            self.seen[sig] = record  # not stored: re-measured next run
            return record
        self.measured += 1
        self.seen[sig] = record
        self.store.put(sig, record)
        return record


def profile_graph(
    gm: torch.fx.GraphModule,
    args: Sequence[Any],
    *,
    tag: str = "g0.fw",
    phase: str = "forward",
    store: ProfileStore | None = None,
    warmup: int = 2,
    repeats: int = 5,
    measure_single_thread: bool = True,
) -> tuple[Any, pd.DataFrame]:
    """Run ``gm(*args)`` once for real and measure every operator; return (output, table).

    The output is exactly what ``gm(*args)`` returns (same values, same RNG draws, in-place
    updates applied once). The table has one row per node with the columns of
    docs/architecture.md; ``node.meta["autopar.profile"]`` holds the node's row. Signatures
    found in ``store`` (or seen earlier in this run) are not re-measured (``cached``); new
    measurements are put into ``store`` and flushed. ``store=None`` uses a memory-only store.
    ``df.attrs`` holds ``measured`` (new signatures timed), ``signatures`` (distinct ones),
    ``seconds`` (wall time of the whole profile), ``errors`` (operators whose timing
    failed; they run correctly and show the time of their one real call), ``provisional``
    (signatures measured under contention this run), and ``measured_s`` / ``evidence``
    (this run's own serial time, in total and per node key; see the module docstring).

    ``bytes_written`` counts non-view outputs, and outputs written in place (``add_``).

    Example::

        >>> import torch
        >>> gm = torch.fx.symbolic_trace(lambda x: (x * 2).relu())
        >>> out, df = profile_graph(gm, [torch.randn(4)], repeats=1)
        >>> list(df.op)
        ['placeholder', 'call_function', 'call_method', 'output']
    """
    if not isinstance(gm, torch.fx.GraphModule):
        raise TypeError(
            f"profile_graph needs a torch.fx.GraphModule, got {type(gm).__name__}; trace the "
            "function first (torch.fx.symbolic_trace or make_fx)"
        )
    if repeats < 1 or warmup < 0:
        raise ValueError(f"need repeats >= 1 and warmup >= 0, got {repeats=}, {warmup=}")
    store = ProfileStore.memory() if store is None else store
    t0 = time.perf_counter()
    interp = _ProfilingInterpreter(
        gm,
        tag=tag,
        phase=phase,
        store=store,
        warmup=warmup,
        repeats=repeats,
        single_thread=measure_single_thread,
    )
    # fx.Interpreter sets torch.fx.traceback's process-wide current node, which a Dynamo or
    # AOTAutograd trace in another thread reads and counts on (two threads on one model
    # broke each other's traces): interpret under Dynamo's compile lock, as traces run.
    with compat.dynamo_compile_lock():
        output = interp.run(*args)
    store.flush()
    df = pd.DataFrame(interp.rows, columns=COLUMNS)
    df["time_s"] = df["time_s"].astype(float)
    df["time_1t_s"] = df["time_1t_s"].astype(float)
    for col in ("threads", "flops", "bytes_read", "bytes_written", "output_bytes"):
        df[col] = df[col].astype("int64")
    df["is_view"] = df["is_view"].astype(bool)
    df["cached"] = df["cached"].astype(bool)
    comp = set(df.key[df.op.isin(_COMPUTE_OPS)])
    df.attrs.update(
        measured=interp.measured,
        signatures=len(interp.seen),
        seconds=time.perf_counter() - t0,
        errors=list(interp.errors),
        provisional=sorted(s for s, r in interp.seen.items() if is_provisional(r)),
        measured_s=float(sum(v for k, v in interp.evidence.items() if k in comp)),
        evidence=NodeTimes(interp.evidence),
    )
    if interp.errors:
        warnings.warn(
            f"autopar: could not time {len(interp.errors)} operator(s) of {tag}; they ran "
            f"correctly and show the time of their one real call. First: {interp.errors[0]}",
            RuntimeWarning,
            stacklevel=2,
        )
    return output, df


def profile_table_summary(df: pd.DataFrame, top: int = 10) -> str:
    """Text report of a profile table: totals, top operators by time and by FLOPs.

    Operators are grouped by target (all ``aten.mm.default`` nodes together); the last block
    lists the most expensive single nodes with their source line.

    Example::

        >>> import torch
        >>> gm = torch.fx.symbolic_trace(lambda x: x @ x)
        >>> print(profile_table_summary(profile_graph(gm, [torch.eye(4)], repeats=1)[1]))
        ... # doctest: +ELLIPSIS
        profile: 3 nodes ...
    """
    comp = df[df.op.isin(_COMPUTE_OPS)]
    total_t = float(comp.time_s.sum())
    total_f = int(comp.flops.sum())
    graphs = ", ".join(sorted(df.graph.unique()))
    lines = [
        f"profile: {len(df)} nodes ({len(comp)} operators) in {graphs}; "
        f"serial time {total_t * 1e3:.3f} ms, {total_f / 1e9:.3f} GFLOP, "
        f"{int(comp.cached.sum())}/{len(comp)} operators from the store or repeated"
    ]
    if comp.empty:
        return lines[0]
    agg = comp.groupby("target").agg(
        n=("node", "size"), time=("time_s", "sum"), t1=("time_1t_s", "sum"), flops=("flops", "sum")
    )
    lines.append(f"\ntop {top} operators by time:")
    lines.append(f"  {'target':<40} {'count':>5} {'ms':>10} {'%':>6} {'ms@1t':>10}")
    for r in agg.sort_values("time", ascending=False).head(top).itertuples():
        target = str(r.Index)
        share = 100 * r.time / total_t if total_t > 0 else 0.0
        lines.append(
            f"  {target[:40]:<40} {r.n:>5} {r.time * 1e3:>10.3f} {share:>6.1f} {r.t1 * 1e3:>10.3f}"
        )
    flop_rows = agg[agg.flops > 0].sort_values("flops", ascending=False).head(top)
    lines.append(f"\ntop {top} operators by FLOPs:")
    lines.append(f"  {'target':<40} {'count':>5} {'GFLOP':>10} {'GFLOP/s':>10}")
    for r in flop_rows.itertuples():
        target = str(r.Index)
        rate = r.flops / r.time / 1e9 if r.time > 0 else 0.0
        lines.append(f"  {target[:40]:<40} {r.n:>5} {r.flops / 1e9:>10.4f} {rate:>10.2f}")
    if flop_rows.empty:
        lines.append("  (no operator with counted FLOPs)")
    lines.append(f"\ntop {min(top, 5)} nodes by time:")
    for _, r in comp.sort_values("time_s", ascending=False).head(min(top, 5)).iterrows():
        ms = r["time_s"] * 1e3
        lines.append(f"  {r['key']:<32} {ms:>9.3f} ms  {r['shape']:<20} {r['source']}")
    return "\n".join(lines)
