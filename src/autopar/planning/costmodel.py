"""The cost model: pure formulas on numbers, plus calibrated machine constants.

Everything here is a function of measured numbers (the profile table) and a
``MachineModel`` whose constants come from microbenchmarks (``calibrate``). The formulas
are explained, with their sources, in docs/cost-model.md.

Example::

    >>> m = MachineModel.default_cpu()
    >>> round(op_time(t1=1.0, tT=0.6, T=2, k=2), 6)   # measured point is reproduced
    0.6
    >>> round(transfer_time(0, m), 9)
    0.0
"""

from __future__ import annotations

import math
import os
import statistics
import threading
import time
from dataclasses import asdict, dataclass, fields

from autopar.errors import PlanError
from autopar.planning.plan import Stream

#: A node wants intra-op threads when its parallel efficiency on all cores is at least
#: this. Why 0.7: running independent ops concurrently reaches at best ~1.0 efficiency and
#: in practice less (syncs, load imbalance, shared caches), so intra-op parallelism must be
#: close to that to win; 0.7 separates large GEMMs/convs (0.85-0.95 measured on 2 cores)
#: from small element-wise ops and small matmuls (<= 0.55).
INTRA_OP_EFFICIENCY = 0.7

#: Per-op cost of a measured CPU op inside a training step beyond its hot-loop time, besides
#: its bytes (``context_s``). Measured on the 2-core box (2026-11-30): the Transformer
#: encoder's planned programs (374 ops) ran 1.64 ms longer per step than the sum of their
#: ops' hot-loop times, of which 0.71 ms is their bytes at the calibrated memory bandwidth:
#: (1.64 - 0.71) ms / 374 = 2.5 us per op (instruction cache and branch predictors cold, the
#: program's own line). Not calibrated per machine: a micro-benchmark runs hot by nature.
CONTEXT_OP_S = 2.5e-6

#: Ops that move no data and run no kernel: zero cost in the model.
ZERO_COST_OPS = frozenset({"placeholder", "output", "get_attr"})


@dataclass(frozen=True)
class MachineModel:
    """Constants of one machine, in seconds, bytes and FLOP/s.

    ``sync_cost_s`` is the latency of one cross-stream wait (a ``threading.Event`` handoff
    between worker threads on CPU, a CUDA event record + wait on GPU). ``dispatch_s`` is the
    per-op dispatch/launch overhead (used when an op's time is estimated, not measured).
    ``transfer_latency_s``/``transfer_bandwidth_Bps`` price copies between devices.
    ``peak_flops_1t`` and ``mem_bandwidth_Bps`` are the single-thread roofline used when
    an op was not timed; ``parallel_overhead_s`` is the fork/join cost of an intra-op
    parallel region (a small op gets slower with threads by about this much).
    ``gil_s`` is the part of each op's time that holds Python's GIL when the generated
    program runs it on a worker stream (argument handling, the op call's Python frames):
    concurrent streams serialise on it (0 = not modelled, the default for synthetic tests).
    ``context_op_s`` and ``context_bandwidth_Bps`` price what a measured op costs inside a
    training step beyond its hot-loop time (``context_s``; 0 = not modelled, the default for
    synthetic tests; ``calibrate`` sets them).
    """

    cores: int = 2
    device: str = "cpu"
    sync_cost_s: float = 20e-6
    dispatch_s: float = 5e-6
    transfer_latency_s: float = 10e-6
    transfer_bandwidth_Bps: float = 5e9
    memory_bytes: int = 24 << 30
    peak_flops_1t: float = 50e9
    mem_bandwidth_Bps: float = 10e9
    parallel_overhead_s: float = 2e-6
    gil_s: float = 0.0
    context_op_s: float = 0.0
    context_bandwidth_Bps: float = 0.0
    source: str = "default"

    @classmethod
    def default_cpu(cls, cores: int = 2) -> MachineModel:
        """Fallback constants, for synthetic tests only (plans for real models use
        ``calibrate``). Sources: a ``threading.Event`` handoff between two CPython threads
        costs 10-50 us; an eager PyTorch CPU op dispatch costs 3-10 us; one AVX2 core does
        ~16 fp32 FLOP/cycle at ~3 GHz (~50 GFLOP/s); one core streams ~10 GB/s; an OpenMP
        fork/join costs ~1-3 us.

        Example::

            >>> MachineModel.default_cpu().cores
            2
        """
        return cls(cores=cores)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> MachineModel:
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in known})


# -- intra-op threads --------------------------------------------------------------------
def serial_fraction(t1: float, tT: float, T: int) -> float:
    """Amdahl serial fraction ``s`` fitted through two measurements.

    Amdahl's law (Amdahl 1967): ``t(k) = t1 * (s + (1 - s) / k)``. Through the point
    ``(T, tT)``: ``s = (tT / t1 - 1 / T) / (1 - 1 / T)``. ``s`` is clamped at 0 (a
    super-linear measurement is noise) but may exceed 1: an op that got *slower* with
    threads (fork/join overhead dominates) keeps getting slower, which is what we measure
    for tiny ops. With ``T == 1`` or no measurement there is no information: ``s = 1``.

    Example::

        >>> serial_fraction(1.0, 0.5, 2), serial_fraction(1.0, 1.0, 2)
        (0.0, 1.0)
    """
    if T <= 1 or t1 <= 0 or tT <= 0:
        return 1.0
    return max(0.0, (tT / t1 - 1.0 / T) / (1.0 - 1.0 / T))


def op_time(t1: float, tT: float, T: int, k: int) -> float:
    """Time of an op on ``k`` intra-op threads, from its single-thread time ``t1`` and its
    time ``tT`` on ``T`` threads: ``t1 * (s + (1 - s) / k)`` with the Amdahl fit ``s``.

    Example::

        >>> op_time(1.0, 0.55, 2, 1), round(op_time(1.0, 0.55, 2, 4), 3)
        (1.0, 0.325)
    """
    if t1 <= 0:
        return max(tT, 0.0)
    k = max(int(k), 1)
    s = serial_fraction(t1, tT, T)
    return t1 * (s + (1.0 - s) / k)


def parallel_efficiency(t1: float, tT: float, T: int, k: int) -> float:
    """Speed-up per thread on ``k`` threads: ``t1 / (k * op_time(k))`` (1.0 is perfect).

    Example::

        >>> parallel_efficiency(1.0, 0.5, 2, 2)
        1.0
    """
    t = op_time(t1, tT, T, k)
    return t1 / (k * t) if t > 0 else 0.0


# -- per-node times ----------------------------------------------------------------------
def roofline_times(flops: float, nbytes: float, machine: MachineModel) -> tuple[float, float]:
    """Estimated ``(t1, tC)`` (1 thread, ``machine.cores`` threads) of an op that was not
    timed: ``dispatch + max(flops / peak_flops_1t / k, bytes / mem_bandwidth)``, plus the
    fork/join overhead when ``k > 1``. Compute scales with threads; memory traffic does
    not (one socket's bandwidth is shared), which is the roofline model (Williams et al.,
    CACM 2009).

    Example::

        >>> m = MachineModel.default_cpu()
        >>> t1, t2 = roofline_times(1e9, 0, m)
        >>> round(t1 / t2, 2)
        2.0
    """
    c = machine.cores
    mem = nbytes / machine.mem_bandwidth_Bps
    t1 = machine.dispatch_s + max(flops / machine.peak_flops_1t, mem)
    tc = machine.dispatch_s + max(flops / machine.peak_flops_1t / c, mem)
    if c > 1:
        tc += machine.parallel_overhead_s
    return t1, tc


def node_times(attrs: dict, machine: MachineModel) -> tuple[float, float, int]:
    """``(t1, tT, T)`` of a task-graph node: measured when present, else the roofline
    estimate (``T = machine.cores``). Placeholders/outputs cost 0.

    Example::

        >>> node_times({"op": "call_function", "time_1t_s": 2e-3, "time_s": 1e-3,
        ...             "threads": 2}, MachineModel.default_cpu())
        (0.002, 0.001, 2)
    """
    if attrs.get("op") in ZERO_COST_OPS:
        return 0.0, 0.0, 1
    t1 = float(attrs.get("time_1t_s") or 0.0)
    tT = float(attrs.get("time_s") or 0.0)
    T = int(attrs.get("threads") or 1)
    if t1 > 0 and tT > 0:
        return t1, tT, T
    if t1 > 0 or tT > 0:  # one measurement only: assume no gain from threads
        t = max(t1, tT)
        return t, t, 1
    flops = float(attrs.get("flops") or 0)
    nbytes = float(attrs.get("bytes_read") or 0) + float(attrs.get("bytes_written") or 0)
    if flops == 0 and nbytes == 0:
        return 0.0, 0.0, 1
    e1, ec = roofline_times(flops, nbytes, machine)
    return e1, ec, machine.cores


def context_s(attrs: dict, machine: MachineModel) -> float:
    """What a *measured* CPU op costs inside a training step beyond its hot-loop time:
    ``context_op_s + (bytes_read + bytes_written) / context_bandwidth_Bps`` (views move no
    data: the first term only). Zero for unmeasured ops (the roofline already prices their
    bytes at memory bandwidth and their dispatch) and where the machine does not model it.

    Why: the profiler times an op by calling it back to back (``profiling.timing``), so its
    inputs sit in cache and its code in the instruction cache. In a training step the
    previous graph, the optimizer and the other ops have evicted both: on the 2-core box
    the planned programs of the seven bench models ran 18-43% (median 38%) longer than the
    sum of their ops' hot-loop times (2026-11-30, ``autopar bench``). Two terms account for
    it: every byte the op touches comes once from memory (at the calibrated bandwidth), and
    a fixed per-op cost (``CONTEXT_OP_S``). docs/cost-model.md has the measurement. Known
    limit: a chain of element-wise ops reads what the op before it just wrote, still in
    cache, so the bytes term over-prices it (GPT-2's backward: +8.8 ms predicted where the
    whole step's context measured about 5.6 ms). In-place timing of ops inside whole-graph
    runs would measure this instead of modelling it.

    Example::

        >>> m = MachineModel(context_op_s=2e-6, context_bandwidth_Bps=1e9)
        >>> a = {"op": "call_function", "time_s": 1e-3, "bytes_read": 1000, "bytes_written": 0}
        >>> round(context_s(a, m), 9), context_s(a, MachineModel())
        (3e-06, 0.0)
    """
    if attrs.get("op") in ZERO_COST_OPS or not (attrs.get("time_s") or attrs.get("time_1t_s")):
        return 0.0
    t = machine.context_op_s
    if machine.context_bandwidth_Bps > 0 and not attrs.get("is_view"):
        nbytes = float(attrs.get("bytes_read") or 0) + float(attrs.get("bytes_written") or 0)
        t += nbytes / machine.context_bandwidth_Bps
    return t


def node_time(attrs: dict, threads: int, machine: MachineModel, device: str = "cpu") -> float:
    """Modelled time of a node on a stream with ``threads`` intra-op threads
    (``0`` = the default, ``machine.cores``), in a training step (``context_s``). On CUDA
    the measured ``time_s`` is used.

    Example::

        >>> m = MachineModel.default_cpu()
        >>> a = {"op": "call_function", "time_1t_s": 2e-3, "time_s": 1.1e-3, "threads": 2}
        >>> node_time(a, 1, m), node_time(a, 2, m)
        (0.002, 0.0011)
    """
    t1, tT, T = node_times(attrs, machine)
    if device.startswith("cuda"):
        return tT
    return op_time(t1, tT, T, threads or machine.cores) + context_s(attrs, machine)


def wants_intra_op(node_attrs: dict, machine: MachineModel) -> bool:
    """True when the node should get all cores as intra-op threads rather than run
    concurrently with other ops: its parallel efficiency on ``machine.cores`` threads is
    at least ``INTRA_OP_EFFICIENCY`` and it is long enough (>= 10 sync costs) that the
    gain is not lost in a synchronisation.

    Example::

        >>> m = MachineModel.default_cpu()
        >>> gemm = {"op": "call_function", "time_1t_s": 10e-3, "time_s": 5.3e-3, "threads": 2}
        >>> small = {"op": "call_function", "time_1t_s": 20e-6, "time_s": 19e-6, "threads": 2}
        >>> wants_intra_op(gemm, m), wants_intra_op(small, m)
        (True, False)
    """
    if machine.cores <= 1:
        return False
    t1, tT, T = node_times(node_attrs, machine)
    if t1 < 10 * machine.sync_cost_s:
        return False
    return parallel_efficiency(t1, tT, T, machine.cores) >= INTRA_OP_EFFICIENCY


# -- thread layouts ----------------------------------------------------------------------
def thread_layouts(machine: MachineModel) -> list[tuple[str, tuple[Stream, ...]]]:
    """Candidate stream layouts ``(name, streams)`` for ``machine``.

    Example::

        >>> [n for n, _ in thread_layouts(MachineModel.default_cpu())]
        ['1x2', '1x1', '2x1', 'mixed(2+1)']
    """
    dev, c = machine.device, machine.cores
    if dev.startswith("cuda"):
        return [(f"{k} stream(s)", tuple(Stream(i, dev, 0) for i in range(k))) for k in (1, 2, 4)]
    out = [(f"1x{c}", (Stream(0, "cpu", c),))]
    if c >= 2:
        # One stream, one thread: wins when threads only add fork/join cost (tiny ops) or
        # when another process occupies cores and multi-threaded regions stall.
        out.append(("1x1", (Stream(0, "cpu", 1),)))
        out.append((f"{c}x1", tuple(Stream(i, "cpu", 1) for i in range(c))))
        mixed = (Stream(0, "cpu", c),) + tuple(Stream(i, "cpu", 1) for i in range(1, c))
        out.append((f"mixed({c}+{'+'.join('1' * (c - 1))})", mixed))
    if c >= 4:
        out.append((f"2x{c // 2}", (Stream(0, "cpu", c // 2), Stream(1, "cpu", c // 2))))
    return out


def stream_layouts(streams, machine: MachineModel):
    """``(serial streams, [(layout name, streams)])`` for ``make_plan``'s ``streams``:
    ``None`` -> ``thread_layouts``; an int ``k`` -> ``k`` streams of ``cores // k``
    threads plus a mixed layout; a list of ``Stream`` -> used as given. The serial
    streams are one stream with all cores (or the first given stream).

    Example::

        >>> serial, layouts = stream_layouts(2, MachineModel.default_cpu())
        >>> serial[0].threads, [name for name, _ in layouts]
        (2, ['2x1', 'mixed(2+1)'])
    """
    dev, c = machine.device, machine.cores
    if streams is None:
        layouts = thread_layouts(machine)
        return layouts[0][1], layouts
    if isinstance(streams, int):
        if streams < 1:
            raise PlanError(f"streams={streams}: ask for at least 1 stream")
        full = (Stream(0, dev, 0 if dev.startswith("cuda") else c),)
        if dev.startswith("cuda") or streams == 1:
            k = 0 if dev.startswith("cuda") else c
            return full, [(f"{streams}x{k}", tuple(Stream(i, dev, k) for i in range(streams)))]
        k = max(1, c // streams)
        out = [(f"{streams}x{k}", tuple(Stream(i, dev, k) for i in range(streams)))]
        if k < c:
            mixed = full + tuple(Stream(i, dev, 1) for i in range(1, streams))
            out.append((f"mixed({c}+{'+'.join('1' * (streams - 1))})", mixed))
        return full, out
    streams = tuple(streams)
    if not streams or not all(isinstance(s, Stream) for s in streams):
        raise PlanError(f"streams must be an int or a list of autopar.Stream, got {streams!r}")
    if len({s.id for s in streams}) != len(streams):
        raise PlanError(f"stream ids must be unique, got {[s.id for s in streams]}")
    return streams[:1], [("given", streams)]


# -- communication -----------------------------------------------------------------------
def sync_time(machine: MachineModel) -> float:
    """Latency of one cross-stream synchronisation (calibrated).

    Example::

        >>> sync_time(MachineModel.default_cpu())
        2e-05
    """
    return machine.sync_cost_s


def transfer_time(nbytes: int, machine: MachineModel) -> float:
    """Time to copy ``nbytes`` between devices: ``latency + bytes / bandwidth`` (the
    Hockney model); 0 when nothing moves.

    Example::

        >>> m = MachineModel.default_cpu()
        >>> round(transfer_time(5_000_000_000, m), 6)
        1.00001
    """
    if nbytes <= 0:
        return 0.0
    return machine.transfer_latency_s + nbytes / machine.transfer_bandwidth_Bps


# -- calibration -------------------------------------------------------------------------
def _best(fn, repeats: int) -> float:
    return min(fn() for _ in range(repeats))


def _event_handoff_s(rounds: int = 200) -> float:
    """One-way latency of a ``threading.Event`` handoff: two threads ping-pong ``rounds``
    times; the total divided by ``2 * rounds``."""
    ping, pong = threading.Event(), threading.Event()

    def echo():
        for _ in range(rounds):
            ping.wait()
            ping.clear()
            pong.set()

    t = threading.Thread(target=echo, daemon=True)
    t.start()
    t0 = time.perf_counter()
    for _ in range(rounds):
        ping.set()
        pong.wait()
        pong.clear()
    dt = time.perf_counter() - t0
    t.join()
    return dt / (2 * rounds)


def _gil_share_s(n: int = 400) -> float:
    """Seconds of each tiny op's time that concurrent Python threads cannot overlap.

    One thread runs a chain of ``n`` tiny aten ops (``tau1`` per op); then two threads run
    one chain each at once (wall ``w``). If dispatch were fully parallel ``w == n*tau1``; if
    the GIL serialised everything ``w == 2*n*tau1``. So the serial share per op is
    ``w/n - tau1``, clamped to ``[0, tau1]``. The ops are called as the generated programs
    call them (``torch.ops.aten.<op>.default`` objects).
    """
    import torch

    add = torch.ops.aten.add.Tensor

    def chain():
        a, b = torch.ones(4), torch.ones(4)
        for _ in range(n):
            a = add(a, b)

    def once():
        t0 = time.perf_counter()
        chain()
        return time.perf_counter() - t0

    def twice():
        go = threading.Event()
        th = threading.Thread(target=lambda: (go.wait(), chain()))
        th.start()
        t0 = time.perf_counter()
        go.set()
        chain()
        th.join()
        return time.perf_counter() - t0

    once()
    tau1 = _best(once, 3) / n
    w = _best(twice, 3) / n
    return min(max(w - tau1, 0.0), tau1)


def _measure_cpu() -> dict:
    import torch

    cores = os.cpu_count() or 1
    sync = statistics.median(_event_handoff_s(100) for _ in range(3))
    a, b = torch.ones(1), torch.ones(1)

    def dispatch():
        t0 = time.perf_counter()
        for _ in range(200):
            torch.add(a, b)
        return (time.perf_counter() - t0) / 200

    disp = _best(dispatch, 5)
    src = torch.ones(16 << 20)  # 64 MiB: larger than any last-level cache, so the copy
    dst = torch.zeros_like(src)  # streams memory; both touched first (no page faults)

    def copy():
        t0 = time.perf_counter()
        dst.copy_(src)
        return time.perf_counter() - t0

    copy_s = _best(copy, 4)
    nbytes = src.numel() * src.element_size()
    old = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        x = torch.randn(256, 256, generator=torch.Generator().manual_seed(0))  # not the user RNG

        def mm():
            t0 = time.perf_counter()
            torch.mm(x, x)
            return time.perf_counter() - t0

        mm_s = _best(mm, 5)
    finally:
        torch.set_num_threads(old)
    try:
        mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        mem = MachineModel.memory_bytes
    return dict(
        cores=cores,
        device="cpu",
        sync_cost_s=sync,
        dispatch_s=disp,
        transfer_latency_s=disp,  # a "transfer" on CPU is one copy op
        transfer_bandwidth_Bps=nbytes / copy_s,
        memory_bytes=int(mem),
        peak_flops_1t=2 * 256**3 / mm_s,
        mem_bandwidth_Bps=2 * nbytes / copy_s,  # a copy reads and writes every byte
        gil_s=_gil_share_s() if cores > 1 else 0.0,
        context_op_s=CONTEXT_OP_S,
        context_bandwidth_Bps=2 * nbytes / copy_s,
    )


def _measure_cuda(device: str) -> dict:
    import torch

    d = torch.device(device)
    s1, s2 = torch.cuda.Stream(d), torch.cuda.Stream(d)
    torch.cuda.synchronize(d)

    def event_wait():
        t0 = time.perf_counter()
        for _ in range(50):
            e = torch.cuda.Event()
            e.record(s1)
            s2.wait_event(e)
        torch.cuda.synchronize(d)
        return (time.perf_counter() - t0) / 50

    sync = _best(event_wait, 3)
    tiny = torch.ones(1, device=d)

    def launch():
        t0 = time.perf_counter()
        for _ in range(200):
            tiny.add_(1)
        torch.cuda.synchronize(d)
        return (time.perf_counter() - t0) / 200

    disp = _best(launch, 3)
    host = torch.empty(16 << 20, dtype=torch.uint8).pin_memory()
    dev = torch.empty_like(host, device=d)

    def h2d(n):
        torch.cuda.synchronize(d)
        t0 = time.perf_counter()
        dev[:n].copy_(host[:n], non_blocking=True)
        torch.cuda.synchronize(d)
        return time.perf_counter() - t0

    lat = _best(lambda: h2d(4), 5)
    big = _best(lambda: h2d(host.numel()), 3)
    props = torch.cuda.get_device_properties(d)
    return dict(
        cores=os.cpu_count() or 1,
        device=device,
        sync_cost_s=sync,
        dispatch_s=disp,
        transfer_latency_s=lat,
        transfer_bandwidth_Bps=host.numel() / max(big - lat, 1e-9),
        memory_bytes=int(props.total_memory),
    )


def calibration_name(device: str = "cpu") -> str:
    """The store key of a machine's calibration, e.g. ``"machine-cpu-2c"``.

    Example::

        >>> calibration_name("cpu").startswith("machine-cpu-")
        True
    """
    # v2: gil_s joined the constants; v3: the training-step context (context_s). Older
    # calibrations are re-measured.
    return f"machine-{device.replace(':', '')}-{os.cpu_count() or 1}c-v3"


def calibrate(store=None, device: str = "cpu", force: bool = False) -> MachineModel:
    """Measure this machine's constants (well under 1 s) or read them from ``store``.

    ``store`` is anything with ``get_calibration(name) -> dict | None`` and
    ``put_calibration(name, dict)`` (``autopar.profiling.store.ProfileStore``); ``None`` measures
    without persisting. ``force=True`` re-measures even if the store has a calibration.

    Example::

        >>> calibrate().source                   # doctest: +SKIP
        'measured'
    """
    name = calibration_name(device)
    if store is not None and not force:
        cached = store.get_calibration(name)
        if cached:
            if device.startswith("cuda"):
                # The name is the device's: a stored CUDA calibration lacking its device
                # (or naming another) would give the planner CPU streams for a CUDA graph.
                cached = {**cached, "device": device}
            return MachineModel.from_dict({**cached, "source": "store"})
    if device.startswith("cuda"):
        values = _measure_cuda(device)
    else:
        values = _measure_cpu()
    values = {k: (v if isinstance(v, str) or not math.isnan(v) else 0) for k, v in values.items()}
    if store is not None:
        store.put_calibration(name, values)
    return MachineModel.from_dict({**values, "source": "measured"})
