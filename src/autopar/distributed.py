"""Beyond one device: process-group setup, per-layer profiling, the data-vs-pipeline choice,
and the runners behind ``autopar.step.compile_step``.

* ``setup`` joins (or creates) the ``torch.distributed`` process group from the torchrun
  environment (``WORLD_SIZE``/``RANK``/``MASTER_ADDR``...), gloo on CPU, nccl on CUDA, with a
  bounded ``timeout`` so a dead or stuck peer ends every rank with a ``DistributedError``.
* ``split_candidates`` finds where a model can be cut into a chain (top-level children called
  once, containers expanded); ``profile_layers`` times each segment (forward + backward) at
  two batch sizes with ``torch.distributed.pipelining.pipeline``'s export-based split.
* ``plan_distributed`` predicts one step of data parallelism (compute on B/N + all-reduce of
  the gradients + optimizer) and of pipeline parallelism (``partition.stage_partition``
  stage DP, then ``(M + S - 1) * (bottleneck stage + transfer + per-micro-batch overhead)``
  for the best micro-batch count M) and picks the faster.
* ``multi_device_source`` generates the single-process multi-GPU pipeline (stages on
  cuda:0..n, activation copies on side streams); it also runs on CPU for testing.

Example::

    >>> layers = [LayerCost("a", {4: 1e-3}, 0, 0, 4096), LayerCost("b", {4: 1e-3}, 64, 0, 4096)]
    >>> p = plan_distributed(layers, batch=8, world=2, comm=CommModel(1e-4, 1e9))
    >>> sorted(p.predicted)
    ['data', 'pipeline']
"""

from __future__ import annotations

import gc
import logging
import math
import os
import statistics
import time
from dataclasses import dataclass, field
from datetime import timedelta
from functools import partial

import torch
import torch.distributed as dist
import torch.nn as nn

from autopar.errors import AutoparError

log = logging.getLogger("autopar.distributed")

#: Python bookkeeping of one micro-batch on one pipeline stage (schedule actions, shape
#: checks, the send/recv calls), measured ~0.2-0.5 ms with gloo on CPU.
PIPELINE_MB_OVERHEAD_S = 300e-6
#: Bytes the optimizer reads and writes per parameter byte (SGD+momentum ~4, Adam ~7).
OPTIMIZER_TRAFFIC = 6.0
#: Bytes DDP moves per gradient byte besides the all-reduce: copy into the flat bucket,
#: divide by N, copy back (read + write each).
DDP_BUCKET_TRAFFIC = 4.0
MODES = ("auto", "data", "pipeline", "none")


class DistributedError(AutoparError):
    """A distributed run cannot go on (peer died, timeout, mismatched configuration)."""


# -- process group -----------------------------------------------------------------------
@dataclass(frozen=True)
class DistEnv:
    """Where this process stands: rank, world size, backend and compute device."""

    rank: int = 0
    world_size: int = 1
    local_world_size: int = 1
    backend: str = ""
    device: str = "cpu"
    timeout_s: float = 120.0

    @property
    def is_last(self) -> bool:
        return self.rank == self.world_size - 1


def setup(timeout_s: float = 120.0) -> DistEnv:
    """Join the process group described by the torchrun environment (or the one the user
    already initialised). One process without ``WORLD_SIZE`` gets ``DistEnv()`` (world 1).

    Example::

        >>> setup().world_size   # no torchrun here
        1
    """
    env_ws = int(os.environ.get("WORLD_SIZE", "1"))
    local_ws = int(os.environ.get("LOCAL_WORLD_SIZE", str(env_ws)))
    available = dist.is_available()
    if available and dist.is_initialized():
        ws, rank = dist.get_world_size(), dist.get_rank()
        if "WORLD_SIZE" in os.environ and env_ws != ws:
            raise DistributedError(
                f"WORLD_SIZE={env_ws} in the environment but the initialised process group "
                f"has {ws} ranks; start the job with torchrun --nproc_per_node={ws} or "
                "initialise the process group with the same world size"
            )
        backend = dist.get_backend()
    elif env_ws > 1:
        if not available:
            raise DistributedError(
                f"WORLD_SIZE={env_ws} but this torch build has no torch.distributed; "
                "run in one process (unset WORLD_SIZE) or install a torch with distributed"
            )
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        if backend == "nccl":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group(backend, timeout=timedelta(seconds=timeout_s))
        ws, rank = dist.get_world_size(), dist.get_rank()
    else:
        return DistEnv(timeout_s=timeout_s)
    if backend == "nccl":
        device = f"cuda:{torch.cuda.current_device()}"
    else:
        device = "cpu"
        if "OMP_NUM_THREADS" not in os.environ:  # share the cores among local ranks
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // max(local_ws, 1)))
    return DistEnv(rank, ws, local_ws, backend, device, timeout_s)


_COMM_MARKERS = ("gloo", "nccl", "timed out", "timeout", "connection", "closed", "peer", "socket")


def is_comm_failure(exc: BaseException) -> bool:
    """True for errors of the communication layer (not of the user's model)."""
    if isinstance(exc, getattr(dist, "DistError", ())):
        return True
    text = str(exc).lower()
    return isinstance(exc, RuntimeError) and any(m in text for m in _COMM_MARKERS)


def comm_error(env: DistEnv, what: str, exc: BaseException) -> DistributedError:
    """The clear error every rank raises when a collective fails or times out."""
    first = (str(exc).strip().splitlines() or [""])[0][:300]
    return DistributedError(
        f"rank {env.rank} of {env.world_size}: {what} did not complete ({type(exc).__name__}: "
        f"{first}). Another rank died, raised, or stopped calling step() (collectives time "
        f"out after {env.timeout_s:g} s: compile_step(timeout=...)). Look at the other "
        "ranks' output; every rank must call step() with the same global batch."
    )


def check_consistent(env: DistEnv, config: tuple) -> None:
    """All ranks must run the same configuration and global batch shapes; else say which."""
    if env.world_size == 1:
        return
    got: list = [None] * env.world_size
    dist.all_gather_object(got, config)
    for r, c in enumerate(got):
        if c != config:
            raise DistributedError(
                f"rank {r} runs {c} but rank {env.rank} runs {config}: every rank must pass "
                "the same distributed=/stages=/microbatches= and the same GLOBAL batch "
                "(inputs are split by rank inside step(); do not shard them yourself)"
            )


# -- communication model ---------------------------------------------------------------
@dataclass(frozen=True)
class CommModel:
    """Measured collective costs: ``latency_s`` per message, ``bandwidth_Bps`` per link."""

    latency_s: float
    bandwidth_Bps: float

    def p2p(self, nbytes: float) -> float:
        """One send/recv of ``nbytes`` (Hockney: ``latency + bytes / bandwidth``)."""
        from autopar.costmodel import MachineModel, transfer_time

        m = MachineModel(
            transfer_latency_s=self.latency_s, transfer_bandwidth_Bps=self.bandwidth_Bps
        )
        return transfer_time(int(nbytes), m)

    def allreduce(self, nbytes: float, world: int) -> float:
        """Ring all-reduce: ``2 (N-1)`` steps moving ``nbytes / N`` each."""
        if world <= 1 or nbytes <= 0:
            return 0.0
        return 2 * (world - 1) * (self.latency_s + nbytes / world / self.bandwidth_Bps)


def measure_comm(env: DistEnv, nbytes: int, repeats: int = 3) -> CommModel:
    """Collective (every rank calls it): time a tiny and an ``nbytes`` all-reduce."""
    n = env.world_size
    if n == 1:
        return CommModel(0.0, float("inf"))
    nbytes = int(min(max(nbytes, 1 << 20), 64 << 20))

    def timed(t: torch.Tensor) -> float:
        times = []
        for _ in range(repeats):
            dist.barrier()
            t0 = time.perf_counter()
            dist.all_reduce(t)
            times.append(time.perf_counter() - t0)
        return statistics.median(times)

    tiny = timed(torch.zeros(1, device=env.device))
    big = timed(torch.zeros(nbytes // 4, device=env.device))
    lat = tiny / (2 * (n - 1))
    per_step = max(big / (2 * (n - 1)) - lat, 1e-9)
    t = torch.tensor([lat, nbytes / n / per_step], dtype=torch.float64, device=env.device)
    dist.broadcast(t, src=0)  # every rank uses rank 0's numbers: identical decisions
    return CommModel(float(t[0]), float(t[1]))


# -- where a model can be cut ------------------------------------------------------------
def split_candidates(model: nn.Module, inputs: tuple) -> list[str]:
    """Module names at which the model can be cut into a chain, in call order.

    Top-level children called exactly once, with ``nn.Sequential``/``nn.ModuleList``
    expanded into their children; a module called several times (a cell in a time loop)
    cannot start a segment. The first name starts segment 0.

    Example::

        >>> m = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
        >>> split_candidates(m, (torch.randn(3, 4),))
        ['0', '1', '2']
    """
    calls: dict[str, int] = {}
    first: dict[str, int] = {}
    hooks = []
    for name, mod in model.named_modules():
        if name:

            def pre(_m, _a, name=name):
                calls[name] = calls.get(name, 0) + 1
                first.setdefault(name, len(first))

            hooks.append(mod.register_forward_pre_hook(pre))
    try:
        with torch.no_grad():
            model(*inputs)
    finally:
        for h in hooks:
            h.remove()
    out: list[str] = []

    def walk(mod: nn.Module, prefix: str) -> None:
        kids = [(prefix + n, c) for n, c in mod.named_children()]
        kids.sort(key=lambda kc: first.get(kc[0], math.inf))
        for name, child in kids:
            container = isinstance(child, (nn.Sequential, nn.ModuleList))
            if container and calls.get(name, 0) <= 1:
                walk(child, name + ".")
            elif calls.get(name, 0) == 1:
                out.append(name)

    walk(model, "")
    return out


def build_pipe(model: nn.Module, mb_inputs: tuple, split_points: list[str]):
    """``torch.distributed.pipelining.pipeline`` cut at the BEGINNING of ``split_points``."""
    from torch.distributed.pipelining import SplitPoint, pipeline

    spec = dict.fromkeys(split_points, SplitPoint.BEGINNING)
    # pipeline() wraps each split module's forward in place; undo that afterwards so the
    # user's model is unchanged and can be split again.
    mods = [model.get_submodule(n) for n in split_points]
    saved = [(m, m.__dict__.get("forward"), "forward" in m.__dict__) for m in mods]
    try:
        pipe = pipeline(model, mb_args=tuple(mb_inputs), split_spec=spec)
    except Exception as exc:  # noqa: BLE001 - export failures: say what to do
        raise DistributedError(
            f"torch.distributed.pipelining could not split {type(model).__name__} at "
            f"{split_points} ({type(exc).__name__}: {str(exc)[:300]}); use "
            "distributed='data', or make the model export-able (torch.export)"
        ) from exc
    finally:
        for m, fwd, had in saved:
            m.__dict__.pop("_orig_forward", None)
            if had:
                m.forward = fwd
            else:
                m.__dict__.pop("forward", None)
    for i in range(pipe.num_stages - 1):
        _contiguous_outputs(pipe.get_stage_module(i))
    if pipe.num_stages != len(split_points) + 1:
        raise DistributedError(
            f"splitting {type(model).__name__} at {split_points} gave {pipe.num_stages} stages, "
            f"not {len(split_points) + 1}: a split point is not on the main chain; use "
            "distributed='data'"
        )
    return pipe


def _contiguous_outputs(gm) -> None:
    """Sends need contiguous tensors (gloo); e.g. a batch-first LSTM output is not."""
    if not isinstance(gm, torch.fx.GraphModule):
        return
    g = gm.graph
    out = next(n for n in g.nodes if n.op == "output")

    def fix(a):
        with g.inserting_before(out):
            return g.call_method("contiguous", (a,))

    out.args = torch.fx.node.map_arg(out.args, fix)
    gm.recompile()


# -- per-layer profile -------------------------------------------------------------------
@dataclass
class LayerCost:
    """One segment (``name`` begins it): fw+bw seconds by batch size, bytes per sample."""

    name: str
    times: dict[int, float]  # batch size -> forward + backward seconds
    out_bytes_per_sample: float  # activation sent to the next segment
    saved_bytes_per_sample: float  # activations kept for the backward
    param_bytes: int

    def time(self, batch: float) -> float:
        """Linear fit ``c0 + c1 * batch`` through the measured points (c0, c1 >= 0)."""
        pts = sorted(self.times.items())
        if len(pts) == 1:
            ((b0, t0),) = pts
            return t0 * batch / b0
        (b0, t0), (b1, t1) = pts[0], pts[-1]
        c1 = max((t1 - t0) / (b1 - b0), 0.0)
        c0 = max(t0 - c1 * b0, 0.0)
        return c0 + c1 * batch


def _tensors(x):
    if isinstance(x, torch.Tensor):
        return [x]
    if isinstance(x, (list, tuple)):
        return [t for y in x for t in _tensors(y)]
    if isinstance(x, dict):
        return [t for y in x.values() for t in _tensors(y)]
    return []


def _nbytes(ts) -> int:
    return sum(t.numel() * t.element_size() for t in ts)


def _record_in(seen: dict, i: int, _mod, args) -> None:
    seen.setdefault(i, args)


def _record_out(outs: dict, i: int, _mod, _args, out) -> None:
    outs.setdefault(i, _nbytes(_tensors(out)))


def _time_segment(mod: nn.Module, args: tuple, first: bool, repeats: int) -> tuple[float, int]:
    """Median forward+backward seconds of one segment, and its saved-activation bytes."""

    def prep():
        return tuple(
            a.detach().requires_grad_(not first and a.is_floating_point())
            if isinstance(a, torch.Tensor)
            else a
            for a in args
        )

    params = {p.data_ptr() for p in mod.parameters()}
    saved: dict[int, int] = {}

    def pack(t):
        if t.data_ptr() not in params:
            saved[t.data_ptr()] = t.numel() * t.element_size()
        return t

    times: list[float] = []
    for i in range(repeats + 1):
        _one_run(mod, prep(), i, pack, times)
    return statistics.median(times), sum(saved.values())


def _one_run(mod, a, i, pack, times) -> None:
    """One forward + backward; run 0 records saved-tensor bytes, the others are timed."""
    t0 = time.perf_counter()
    if i == 0:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = mod(*a)
    else:
        out = mod(*a)
    outs = [t for t in _tensors(out) if t.requires_grad]
    if outs:
        torch.autograd.backward(outs, [torch.ones_like(t) for t in outs])
    if i:
        times.append(time.perf_counter() - t0)


def profile_layers(
    model: nn.Module, inputs: tuple, candidates: list[str], batches: list[int], repeats: int = 3
) -> list[LayerCost]:
    """Time every segment (fw + bw) at each batch size in ``batches``; grads are restored."""
    grads = {p: p.grad for p in model.parameters()}
    layers: list[LayerCost] = []
    try:
        for b in sorted(set(batches)):
            mb = tuple(x[:b] for x in inputs)
            pipe = build_pipe(model, mb, candidates[1:])
            mods = [pipe.get_stage_module(i) for i in range(pipe.num_stages)]
            seen: dict[int, tuple] = {}
            outs: dict[int, int] = {}
            hooks = []

            for i, m in enumerate(mods):  # hooks return None: they only record
                hooks.append(m.register_forward_pre_hook(partial(_record_in, seen, i)))
                hooks.append(m.register_forward_hook(partial(_record_out, outs, i)))
            with torch.no_grad():
                pipe(*mb)
            for h in hooks:
                h.remove()
            gc.collect()  # export leaves many objects: a GC pass inside a timing costs ~0.2 s
            gc.disable()
            try:
                timed = [_time_segment(m, seen[i], i == 0, repeats) for i, m in enumerate(mods)]
            finally:
                gc.enable()
            for i, m in enumerate(mods):
                t, saved_b = timed[i]
                if len(layers) <= i:
                    pbytes = _nbytes(list(m.parameters()))
                    layers.append(LayerCost(candidates[i], {}, outs[i] / b, saved_b / b, pbytes))
                layers[i].times[b] = t
    finally:
        for p, g in grads.items():
            p.grad = g
    return layers


# -- the plan ----------------------------------------------------------------------------
@dataclass
class DistPlan:
    """What runs across processes, why, and what each option was predicted to cost."""

    mode: str
    world_size: int
    reason: str = ""
    predicted: dict[str, float] = field(default_factory=dict)  # mode -> s per step
    layers: list[LayerCost] = field(default_factory=list)
    split_points: list[str] = field(default_factory=list)  # segment names starting stage 1..
    stage_times: list[float] = field(default_factory=list)  # per micro-batch
    microbatches: int = 1
    schedule: str = ""
    batch: int = 0
    comm: CommModel | None = None

    def notes(self) -> tuple[str, ...]:
        pred = ", ".join(f"{k} {v * 1e3:.2f} ms" for k, v in sorted(self.predicted.items()))
        out = [f"distributed: {self.mode} on {self.world_size} rank(s): {self.reason}"]
        if pred:
            out.append(f"distributed predicted per step: {pred}")
        if self.mode == "pipeline":
            s, m = len(self.split_points) + 1, self.microbatches
            out.append(
                f"pipeline: {s} stages split before {self.split_points}, {m} micro-batches, "
                f"{self.schedule}, bubble {(s - 1) / (m + s - 1):.0%}"
            )
        return tuple(out)

    def text(self) -> str:
        lines = list(self.notes())
        if self.layers:
            lines.append(
                f"  {'segment':<24}{'fw+bw @B (ms)':>14}{'act B/sample':>14}{'params':>10}"
            )
            for lc in self.layers:
                lines.append(
                    f"  {lc.name:<24}{lc.time(self.batch) * 1e3:>14.3f}"
                    f"{lc.out_bytes_per_sample:>14.0f}{lc.param_bytes:>10}"
                )
        if self.stage_times:
            st = ", ".join(f"{t * 1e3:.3f}" for t in self.stage_times)
            lines.append(f"  stage times per micro-batch (ms): {st}")
        return "\n".join(lines)


def _stages(costs, cuts, mem, n_stages, budget, comm) -> list[int]:
    """Stage starts from ``partition.stage_partition``; fewer stages than asked are split
    further (the largest stage at its most balanced point) so every rank gets one."""
    from autopar.partition import stage_partition

    starts, _ = stage_partition(
        costs,
        cuts,
        mem,
        n_stages,
        memory_budget=budget,
        latency_s=comm.latency_s,
        bandwidth_Bps=comm.bandwidth_Bps,
    )
    n = len(costs)
    while len(starts) < n_stages:
        bounds = starts + [n]
        spans = [
            (sum(costs[a:b]), a, b) for a, b in zip(bounds, bounds[1:], strict=False) if b - a > 1
        ]
        if not spans:
            break
        tot, a, b = max(spans)
        cut = min(range(a + 1, b), key=lambda k: abs(sum(costs[a:k]) - tot / 2))
        starts = sorted(starts + [cut])
    return starts


def plan_pipeline(layers, batch, n_stages, comm, budget=None, microbatches=None):
    """Best (starts, M, predicted, stage_times): stage DP per M, then the bubble model."""
    if len(layers) < n_stages:
        names = [lc.name for lc in layers]
        raise DistributedError(
            f"the model can be cut into at most {len(layers)} segment(s) ({names}) but "
            f"{n_stages} pipeline stages were asked for; run with "
            f"--nproc_per_node={max(len(layers), 1)}, or use distributed='data' (a module "
            "called in a loop, like an LSTM cell over time, cannot start a stage)"
        )
    if microbatches:
        cands = [microbatches]
    else:
        cands = [m for m in range(n_stages, min(batch, 32) + 1) if batch % m == 0]
    if not cands:
        raise DistributedError(
            f"global batch {batch} cannot be cut into >= {n_stages} equal micro-batches; "
            f"use a batch that is a multiple of {n_stages} or pass microbatches="
        )
    best = None
    for m in cands:
        if batch % m:
            raise DistributedError(f"microbatches={m} does not divide the global batch {batch}")
        b = batch / m
        costs = [lc.time(b) for lc in layers]
        cuts = [lc.out_bytes_per_sample * b for lc in layers[:-1]]
        # 1F1B keeps at most S micro-batches in flight; params + grads + optimizer state
        mem = [lc.saved_bytes_per_sample * b * n_stages + 4 * lc.param_bytes for lc in layers]
        starts = _stages(costs, cuts, mem, n_stages, budget, comm)
        bounds = starts + [len(layers)]
        stage_t = []
        for k in range(len(starts)):
            a, e = bounds[k], bounds[k + 1]
            send = comm.p2p(cuts[e - 1]) if e < len(layers) else 0.0
            stage_t.append(sum(costs[a:e]) + send + PIPELINE_MB_OVERHEAD_S)
        pbytes = max(
            sum(lc.param_bytes for lc in layers[a:e])
            for a, e in zip(bounds, bounds[1:], strict=False)
        )
        total = (m + len(starts) - 1) * max(stage_t) + _opt_time(pbytes)
        if best is None or total < best[2]:
            best = (starts, m, total, stage_t)
    return best


def _opt_time(param_bytes: float) -> float:
    from autopar.costmodel import MachineModel

    return OPTIMIZER_TRAFFIC * param_bytes / MachineModel().mem_bandwidth_Bps


def predict_data(layers, batch, world, comm) -> float:
    """Compute on ``batch / world`` + all-reduce of every gradient + DDP's bucket copies +
    the optimizer.

    DDP overlaps bucket all-reduces with the backward, but on CPU gloo's reduction competes
    for the same cores, so no overlap is credited (a pessimistic, simple model)."""
    pbytes = sum(lc.param_bytes for lc in layers)
    compute = sum(lc.time(batch / world) for lc in layers)
    from autopar.costmodel import MachineModel

    buckets = DDP_BUCKET_TRAFFIC * pbytes / MachineModel().mem_bandwidth_Bps
    return compute + comm.allreduce(pbytes, world) + buckets + _opt_time(pbytes)


def plan_distributed(
    layers, batch, world, comm, mode="auto", budget=None, microbatches=None, schedule=None
) -> DistPlan:
    """Predict data and pipeline parallelism and pick ``mode`` (the faster one for auto)."""
    plan = DistPlan(mode, world, layers=layers, batch=batch, comm=comm)
    pred = plan.predicted
    if mode in ("auto", "data"):
        pred["data"] = predict_data(layers, batch, world, comm)
    pipe = None
    if mode in ("auto", "pipeline"):
        try:
            pipe = plan_pipeline(layers, batch, world, comm, budget, microbatches)
            pred["pipeline"] = pipe[2]
        except (DistributedError, AutoparError) as exc:
            if mode == "pipeline":
                raise
            plan.reason = f"pipeline impossible ({exc}); "
    if mode == "auto":
        plan.mode = min(pred, key=pred.get)
        plan.reason += "auto: predicted fastest"
    else:
        plan.reason = f"{mode} requested"
    if plan.mode == "pipeline":
        starts, m, _, stage_t = pipe
        plan.split_points = [layers[s].name for s in starts[1:]]
        plan.microbatches, plan.stage_times = m, stage_t
        plan.schedule = schedule or ("1F1B" if m >= world else "GPipe")
    return plan


# -- single process, several devices: generated code -------------------------------------
def multi_device_source(n_stages: int, microbatches: int) -> str:
    """Python source of a one-process pipeline: stage ``j`` on ``devices[j]``, micro-batches
    in a fill-drain wavefront, each activation copied to the next device on a side stream
    (``non_blocking``), the consumer's stream waiting on the copy's event. CUDA launches
    are asynchronous, so stage ``j`` of micro-batch ``m`` runs while stage ``j-1`` runs
    micro-batch ``m+1``. With ``streams[j] is None`` (CPU) the same code runs serially.

    Example::

        >>> "non_blocking=True" in multi_device_source(2, 4)
        True
    """
    s, m = n_stages, microbatches
    L = [
        f"# autopar multi-device pipeline: {s} stages, {m} micro-batches, fill-drain (GPipe)",
        "def pipeline_step(stages, devices, streams, inputs, target, loss_fn):",
        f"    mbs = [tuple(t.to(devices[0]) for t in c) for c in _chunks(inputs, {m})]",
        f"    tgts = target.to(devices[{s - 1}]).chunk({m})",
        f"    acts = [[None] * {m} for _ in range({s})]",
        f"    events = [[None] * {m} for _ in range({s})]",
        "    acts[0] = mbs",
        "    total = None",
        f"    for tick in range({m + s - 1}):",
    ]
    for j in range(s):
        L += [
            f"        m = tick - {j}  # stage {j} on devices[{j}]",
            f"        if 0 <= m < {m}:",
            f"            if events[{j}][m] is not None:  # wait for the copy into devices[{j}]",
            f"                torch.cuda.current_stream(devices[{j}]).wait_event(events[{j}][m])",
            f"            y = stages[{j}](*acts[{j}][m])",
        ]
        if j < s - 1:
            L += [
                f"            s = streams[{j}]",
                "            if s is None:",
                f"                acts[{j + 1}][m] = (y.to(devices[{j + 1}]),)",
                "            else:  # copy on the side stream, overlapping the next compute",
                f"                s.wait_stream(torch.cuda.current_stream(devices[{j}]))",
                "                with torch.cuda.stream(s):",
                f"                    y2 = y.to(devices[{j + 1}], non_blocking=True)",
                f"                    acts[{j + 1}][m] = (y2,)",
                "                    y.record_stream(s)",
                "                    e = torch.cuda.Event()",
                "                    e.record(s)",
                f"                events[{j + 1}][m] = e",
            ]
        else:
            L += [
                f"            loss = loss_fn(y, tgts[m]) / {m}",
                "            total = loss if total is None else total + loss",
            ]
    L += ["    total.backward()", "    return total.detach()", ""]
    return "\n".join(L)


def _chunks(inputs: tuple, m: int) -> list[tuple]:
    parts = [x.chunk(m) for x in inputs]
    return [tuple(p[i] for p in parts) for i in range(m)]


def compile_multi_device(n_stages: int, microbatches: int):
    """(source, function) of ``multi_device_source``; what prints is what runs."""
    src = multi_device_source(n_stages, microbatches)
    ns = {"torch": torch, "_chunks": _chunks}
    exec(compile(src, f"<autopar multi-device pipeline {n_stages}x{microbatches}>", "exec"), ns)
    return src, ns["pipeline_step"]
