"""The whole training step, compiled: forward, loss, backward and optimizer, in one process or
across processes (torchrun).

Example::

    >>> import torch, autopar.parallel.step
    >>> model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
    >>> opt = torch.optim.SGD(model.parameters(), lr=0.1)
    >>> step = autopar.compile_step(model, torch.nn.MSELoss(), opt, compile_model=False)
    >>> loss = step(torch.randn(16, 8), target=torch.randn(16, 1))  # one optimizer step
    >>> loss.requires_grad, step.mode
    (False, 'none')

The same script runs under ``torchrun --nproc_per_node=N``: ``distributed="auto"`` profiles
the model, predicts data and pipeline parallelism and runs the faster (see
docs/distributed.md). Inputs and target are the GLOBAL batch on every rank; each rank takes
its part. The returned loss is the mean loss of the global batch, the same on every rank.
"""

from __future__ import annotations

import logging
import threading
from contextlib import contextmanager

import torch
import torch.distributed as dist
import torch.nn as nn

from autopar import compat
from autopar.parallel.distributed import (
    MODES,
    DistEnv,
    DistPlan,
    DistributedError,
    build_pipe,
    check_consistent,
    comm_error,
    is_comm_failure,
    measure_comm,
    plan_distributed,
    profile_layers,
    setup,
    split_candidates,
)
from autopar.parallel.multigpu import compile_multi_device

log = logging.getLogger("autopar.parallel.step")

#: Optimizers whose ``step`` on a one-parameter group equals their step on all parameters
#: (purely per-parameter updates); only these are stepped per parameter during backward.
PER_PARAM_OPTIMIZERS = tuple(
    getattr(torch.optim, n)
    for n in ("SGD", "Adam", "AdamW", "Adamax", "Adagrad", "RMSprop", "NAdam", "RAdam", "Adadelta")
)


def compile_step(
    model: nn.Module,
    loss_fn,
    optimizer: torch.optim.Optimizer,
    distributed: str = "auto",
    streams: int | None = None,
    microbatches: int | None = None,
    *,
    stages: int | None = None,
    schedule: str | None = None,
    timeout: float = 120.0,
    compile_model: bool | None = None,
    overlap_optimizer: bool = True,
    memory_budget: int | None = None,
    **compile_options,
) -> Step:
    """Compile one training step; ``loss = step(*inputs, target=y)``.

    Args:
        distributed: ``"auto"`` (one process: ``"none"``; several: the faster of data and
            pipeline parallelism, as predicted from a profile), ``"data"`` (DDP, each rank
            takes ``1/N`` of the global batch), ``"pipeline"`` (one stage per rank), or
            ``"none"``.
        streams: concurrency for ``autopar.compile`` in one process.
        microbatches: pipeline micro-batch count (default: chosen by the cost model).
        stages: pipeline stage count; must equal the world size (checked).
        schedule: ``"1F1B"`` or ``"GPipe"`` (default: 1F1B when micro-batches >= stages).
        timeout: seconds any collective may take before every rank raises
            ``DistributedError`` (a dead or stuck peer never hangs the job).
        compile_model: run the model through ``autopar.compile`` (default: in one process
            only; under DDP/pipelining each rank runs it eagerly).
        overlap_optimizer: in one process, update each parameter as soon as its gradient is
            ready (per-parameter hooks), overlapping the update with the rest of the backward.
        memory_budget: bytes per device for the pipeline stage split.
        compile_options: passed to ``autopar.compile`` (``store=``, ``policy=``...).

    Example::

        step = compile_step(model, nn.CrossEntropyLoss(), opt)   # torchrun or not
        for x, y in loader:
            loss = step(x, target=y)
        print(step.summary())
    """
    if distributed not in MODES:
        raise ValueError(f"distributed must be one of {MODES}, got {distributed!r}")
    if schedule is not None and schedule not in ("1F1B", "GPipe"):
        raise ValueError(f"schedule must be '1F1B' or 'GPipe', got {schedule!r}")
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"optimizer must be a torch.optim.Optimizer, got {type(optimizer)}")
    return Step(
        model,
        loss_fn,
        optimizer,
        distributed,
        streams=streams,
        microbatches=microbatches,
        stages=stages,
        schedule=schedule,
        timeout=timeout,
        compile_model=compile_model,
        overlap_optimizer=overlap_optimizer,
        memory_budget=memory_budget,
        compile_options=compile_options,
    )


class Step:
    """A compiled training step. Plans lazily on the first call (with the real batch)."""

    def __init__(self, model, loss_fn, optimizer, distributed, **cfg):
        self.model, self.loss_fn, self.optimizer = model, loss_fn, optimizer
        self.requested = distributed
        self.cfg = cfg
        self.env: DistEnv = setup(cfg["timeout"])
        self.plan: DistPlan | None = None
        self.source: str | None = None  # generated code of the multi-device pipeline
        self._runner = None
        self._fwd = None
        self._key = None
        self._owned: list[list[str]] = []  # pipeline: names held by each stage
        self._hooks: list = []
        self._subs: dict = {}  # parameter -> its one-parameter optimizer (see _step_one)
        self._overlap_active = False
        self._lock = threading.Lock()
        n, st = self.env.world_size, cfg["stages"]
        if st is not None and distributed in ("auto", "pipeline") and n > 1 and st != n:
            raise DistributedError(
                f"stages={st} but the job has {n} processes (one stage per rank): run "
                f"torchrun --nproc_per_node={st}, or pass stages={n} (or stages=None)"
            )
        reduction = getattr(loss_fn, "reduction", "mean")
        if reduction not in ("mean", "sum"):
            raise ValueError(
                f"loss_fn must reduce to a scalar (reduction 'mean' or 'sum'), got {reduction!r}"
            )
        self._sum = reduction == "sum"

    @property
    def mode(self) -> str:
        return self.plan.mode if self.plan else "unplanned"

    # -- the call ------------------------------------------------------------------------
    def __call__(self, *inputs, target=None) -> torch.Tensor:
        if not inputs or not all(isinstance(x, torch.Tensor) for x in inputs):
            raise TypeError("step(*inputs, target=y): inputs must be tensors (the global batch)")
        key = tuple(tuple(x.shape) for x in inputs) + (
            tuple(target.shape) if isinstance(target, torch.Tensor) else None,
        )
        try:
            if key != self._key:
                self._prepare(inputs, target, key)
            return self._runner(inputs, target)
        except DistributedError:
            raise
        except Exception as exc:
            if self.env.world_size > 1 and is_comm_failure(exc):
                raise comm_error(self.env, f"step ({self.mode})", exc) from exc
            raise

    # -- planning ------------------------------------------------------------------------
    def _prepare(self, inputs, target, key) -> None:
        env, cfg, req = self.env, self.cfg, self.requested
        if env.world_size == 1:
            ngpu = torch.cuda.device_count() if torch.cuda.is_available() else 0
            if req in ("auto", "pipeline") and ngpu > 1:
                self._prepare_multi_device(inputs, ngpu)
            elif req == "pipeline":
                raise DistributedError(
                    "distributed='pipeline' needs one stage per process or GPU, but this is "
                    "one process with fewer than 2 GPUs: run torchrun --nproc_per_node=2 "
                    "script.py, or use distributed='auto'/'none'"
                )
            else:
                self.plan = DistPlan("none", 1, reason=f"one process ({req} requested)")
                self._prepare_local()
        else:
            cfg_key = (req, cfg["stages"], cfg["microbatches"], cfg["schedule"], key)
            check_consistent(env, cfg_key)
            batch = inputs[0].shape[0]
            if req == "data":
                self.plan = DistPlan("data", env.world_size, reason="data requested", batch=batch)
            else:
                self.plan = self._plan_collectively(inputs, batch)
            if self.plan.mode == "data":
                self._prepare_data(batch)
            else:
                self._prepare_pipeline(inputs)
        self._key = key
        log.info("autopar step plan:\n%s", self.plan.text())
        self._note_plans()

    def _plan_collectively(self, inputs, batch) -> DistPlan:
        """Rank 0 profiles and decides; every rank gets the same plan (or the same error)."""
        env = self.env
        pbytes = sum(p.numel() * p.element_size() for p in self.model.parameters())
        comm = measure_comm(env, pbytes)
        box: list = [None]
        if env.rank == 0:
            try:
                box[0] = self._plan_here(inputs, batch, env.world_size, comm)
            except Exception as exc:  # noqa: BLE001 - sent to every rank, raised there
                box[0] = DistributedError(f"planning on rank 0 failed: {exc}")
        dist.broadcast_object_list(box, src=0)
        if isinstance(box[0], Exception):
            raise box[0]
        return box[0]

    def _plan_here(self, inputs, batch, n_stages, comm) -> DistPlan:
        cfg, req = self.cfg, self.requested
        cands = split_candidates(self.model, inputs)
        m_max = max([m for m in range(n_stages, min(batch, 16) + 1) if batch % m == 0] or [1])
        sizes = sorted({max(batch // n_stages, 1), max(batch // m_max, 1)})
        if len(cands) < n_stages:
            if req == "pipeline":
                plan_distributed([], batch, n_stages, comm, "pipeline")  # raises, with the fix
            return DistPlan(
                "data",
                n_stages,
                reason=f"auto: the model has {len(cands)} cut point(s) ({cands}), fewer than "
                f"{n_stages} pipeline stages",
                batch=batch,
                comm=comm,
            )
        layers = profile_layers(self.model, inputs, cands, sizes)
        return plan_distributed(
            layers,
            batch,
            n_stages,
            comm,
            req,
            cfg["memory_budget"],
            cfg["microbatches"],
            cfg["schedule"],
        )

    def _note_plans(self) -> None:
        """Keep the decision in the autopar Plans of the compiled model, when there are."""
        pipeline = getattr(self._fwd, "_autopar_pipeline", None) if self._runner else None
        for rec in getattr(pipeline, "records", []) if pipeline else []:
            if rec.plan is not None and not any("distributed:" in n for n in rec.plan.notes):
                plan = rec.plan.replace(notes=rec.plan.notes + self.plan.notes())
                rec.advance("step plan", plan=plan)

    # -- one process ---------------------------------------------------------------------
    def _prepare_local(self) -> None:
        cfg, opt = self.cfg, self.optimizer
        fwd = self.model
        if cfg["compile_model"] is not False:
            import autopar.api

            fwd = autopar.api.compile(self.model, streams=cfg["streams"], **cfg["compile_options"])
        self._fwd = fwd
        overlap = cfg["overlap_optimizer"] and isinstance(opt, PER_PARAM_OPTIMIZERS)
        if overlap and not self._hooks:
            self._install_overlap()
        self.plan.reason += "; optimizer " + (
            "stepped per parameter during backward" if overlap else "stepped after backward"
        )

        def run(inputs, target):
            opt.zero_grad(set_to_none=True)
            with self._overlapping(overlap):
                loss = self.loss_fn(fwd(*inputs), target)
                loss.backward()
            if not overlap:
                opt.step()
            return loss.detach()

        self._runner = run

    def _install_overlap(self) -> None:
        opt = self.optimizer
        for gi, group in enumerate(opt.param_groups):
            for p in group["params"]:
                if p.requires_grad:
                    self._hooks.append(
                        p.register_post_accumulate_grad_hook(lambda p, gi=gi: self._step_one(p, gi))
                    )

    def _step_one(self, p: torch.Tensor, gi: int) -> None:
        """Step the user's optimizer on ``p`` alone (its group's current hyper-parameters;
        its state lands in ``optimizer.state[p]`` as with a plain step).

        Through a one-parameter optimizer of the same type that shares the user's
        ``state`` dict, with the group's hyper-parameters copied in before each step (so a
        scheduler's new ``lr`` applies); the user's optimizer itself is never modified."""
        if not self._overlap_active:
            return  # a backward outside step(): leave the gradient to the user
        opt = self.optimizer
        with self._lock:
            group = opt.param_groups[gi]
            sub = self._subs.get(p)
            if sub is None:
                sub = type(opt)([dict(group, params=[p])], **opt.defaults)
                sub.state = opt.state  # the same dict: state lands in optimizer.state[p]
                self._subs[p] = sub
            sub.param_groups[0].update((k, v) for k, v in group.items() if k != "params")
            sub.step()

    @contextmanager
    def _overlapping(self, on: bool):
        self._overlap_active = on
        try:
            yield
        finally:
            self._overlap_active = False

    # -- data parallel -------------------------------------------------------------------
    def _prepare_data(self, batch: int) -> None:
        from torch.nn.parallel import DistributedDataParallel as DDP

        env, cfg, opt = self.env, self.cfg, self.optimizer
        n, r = env.world_size, env.rank
        if batch % n:
            raise DistributedError(
                f"global batch {batch} is not divisible by the world size {n}: use a batch "
                f"that is a multiple of {n} (every rank takes batch/{n} samples)"
            )
        inner = self.model
        if cfg["compile_model"]:
            import autopar.api

            inner = autopar.api.compile(
                self.model, streams=cfg["streams"], **cfg["compile_options"]
            )
        ddp = DDP(inner, device_ids=None if env.device == "cpu" else [env.device])
        self._fwd, b = inner, batch // n
        scale = float(n) if self._sum else 1.0  # DDP averages; a summed loss wants the sum

        def run(inputs, target):
            xs = [x[r * b : (r + 1) * b].to(env.device) for x in inputs]
            t = target[r * b : (r + 1) * b].to(env.device) if target is not None else None
            opt.zero_grad(set_to_none=True)
            loss = self.loss_fn(ddp(*xs), t)
            (loss * scale if scale != 1.0 else loss).backward()
            opt.step()
            out = loss.detach().clone()
            dist.all_reduce(out)
            return out if self._sum else out / n

        self._runner = run

    # -- pipeline parallel ---------------------------------------------------------------
    def _prepare_pipeline(self, inputs) -> None:
        from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

        env, plan, opt = self.env, self.plan, self.optimizer
        m = plan.microbatches
        pipe = build_pipe(
            self.model, tuple(x[: x.shape[0] // m] for x in inputs), plan.split_points
        )
        if pipe.num_stages != env.world_size:
            raise DistributedError(
                f"the pipeline has {pipe.num_stages} stages but the job has {env.world_size} "
                f"processes: run torchrun --nproc_per_node={pipe.num_stages}"
            )
        self._owned = [
            [n for n, _ in pipe.get_stage_module(j).named_parameters()]
            + [n for n, _ in pipe.get_stage_module(j).named_buffers()]
            for j in range(pipe.num_stages)
        ]
        # A manual PipelineStage infers shapes at run time (from the real, contiguous
        # activations) instead of trusting the export's strides; gloo needs contiguous.
        mod = pipe.get_stage_module(env.rank)
        if env.device != "cpu":
            compat.modify_graph_op_device(mod, torch.device(env.device))
        stage = PipelineStage(mod, env.rank, env.world_size, torch.device(env.device))
        cls = Schedule1F1B if plan.schedule == "1F1B" else ScheduleGPipe
        sched = cls(stage, m, loss_fn=self.loss_fn, scale_grads=not self._sum)
        self._fwd = None
        last = env.world_size - 1

        def run(inputs, target):
            opt.zero_grad(set_to_none=True)
            losses: list = []
            if env.rank == 0:
                sched.step(*[x.to(env.device) for x in inputs])
            elif env.rank == last:
                sched.step(target=target.to(env.device), losses=losses)
            else:
                sched.step()
            opt.step()  # only this stage's parameters have gradients
            if env.rank == last:
                ls = torch.stack([x.detach().reshape(()) for x in losses])
                out = ls.sum() if self._sum else ls.mean()
            else:
                out = torch.zeros((), device=env.device)
            dist.broadcast(out, src=last)
            return out

        self._runner = run

    # -- one process, several GPUs -------------------------------------------------------
    def _prepare_multi_device(self, inputs, ngpu: int) -> None:
        from autopar.parallel.distributed import CommModel
        from autopar.planning.costmodel import calibrate

        batch = inputs[0].shape[0]
        devices = [torch.device(f"cuda:{j}") for j in range(ngpu)]
        mach = calibrate(device="cuda:0")
        comm = CommModel(mach.transfer_latency_s, mach.transfer_bandwidth_Bps)
        cuda_in = tuple(x.to(devices[0]) for x in inputs)
        self.model.to(devices[0])
        self.plan = self._plan_here(cuda_in, batch, ngpu, comm)
        if self.plan.mode != "pipeline":
            self.plan.mode, self.plan.reason = "none", "one process: model cannot be split"
            return self._prepare_local()
        m = self.plan.microbatches
        pipe = build_pipe(
            self.model, tuple(x[: batch // m] for x in cuda_in), self.plan.split_points
        )
        stages = [pipe.get_stage_module(j).to(devices[j]) for j in range(ngpu)]
        streams = [torch.cuda.Stream(d) for d in devices]
        self.source, fn = compile_multi_device(ngpu, m)
        self._fwd, opt = None, self.optimizer

        def run(inputs, target):
            opt.zero_grad(set_to_none=True)
            loss = fn(stages, devices, streams, inputs, target, self.loss_fn)
            opt.step()
            return loss

        self._runner = run

    # -- checkpoints ---------------------------------------------------------------------
    def state_dict(self) -> dict:
        """The ORIGINAL model's plain ``state_dict`` (no ``module.`` prefix), loadable under
        any world size. In pipeline mode it is collective (call it on every rank): each
        stage's owner broadcasts its parameters so every rank returns the whole model."""
        if self.plan is not None and self.plan.mode == "pipeline" and self.env.world_size > 1:
            self.sync_model()
        return self.model.state_dict()

    def load_state_dict(self, state_dict: dict, strict: bool = True):
        """Load a plain ``state_dict`` (saved under any world size) into the model."""
        return self.model.load_state_dict(state_dict, strict=strict)

    def sync_model(self) -> None:
        """Pipeline mode: make every rank's model whole again (collective)."""
        done: set[str] = set()
        try:
            for j, names in enumerate(self._owned):
                for name in names:
                    if name in done:
                        continue
                    done.add(name)
                    try:
                        t = self.model.get_parameter(name)
                    except AttributeError:
                        t = self.model.get_buffer(name)
                    dist.broadcast(t.data, src=j)
        except Exception as exc:
            if is_comm_failure(exc):
                raise comm_error(self.env, "state_dict() gather", exc) from exc
            raise

    # -- inspection ----------------------------------------------------------------------
    def plan_summary(self) -> str:
        """The distributed decision, its predictions, and the per-segment profile."""
        if self.plan is None:
            return "not planned yet: call step(*inputs, target=y) once"
        return self.plan.text()

    def summary(self) -> str:
        e = self.env
        head = (
            f"autopar step: mode={self.mode} (requested {self.requested}), rank {e.rank} of "
            f"{e.world_size}, backend={e.backend or 'none'}, device={e.device}, "
            f"threads={torch.get_num_threads()}"
        )
        return head + "\n" + self.plan_summary()

    def close(self) -> None:
        """Remove the per-parameter optimizer hooks (the model trains as before)."""
        for h in self._hooks:
            h.remove()
        self._hooks.clear()

    def __repr__(self) -> str:
        return f"<autopar Step mode={self.mode} rank={self.env.rank}/{self.env.world_size}>"
