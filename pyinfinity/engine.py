"""The training engine: ``initialize(model, config) -> Engine``.

The Engine partitions the model into flat shards (``zero.partition``), keeps each shard's home in
its tier (device, pinned RAM or NVMe, ``swap.tensor_swapper``), streams shards to the compute
device around every module's use (``zero.coordinator``), moves gradients off the device as they
are produced, and steps Adam/AdamW on fp32 master weights kept in RAM or on NVMe
(``zero.optimizer``). The calling convention is DeepSpeed's: ``engine(batch)``,
``engine.backward(loss)``, ``engine.step()`` once per micro-batch.
"""
from __future__ import annotations

import atexit
import collections
import contextlib
import logging
import os
import time
import weakref
from dataclasses import dataclass
from typing import Any, Iterator, Optional, Union

import torch
from torch import nn

from pyinfinity import checkpoint, guards
from pyinfinity.config import (AUTO, Config, ConfigError, ModelSizes, default_optimizer_threads, format_size,
                               load_config, overlap_step_blocker)
from pyinfinity.swap.ownership import claim_swap_dirs
from pyinfinity.swap.tensor_swapper import Tier, TensorSwapper, aligned_empty
from pyinfinity.units import auto_unit_bytes
from pyinfinity.zero.budget import DeviceBudgetExceeded
from pyinfinity.zero.coordinator import ParameterCoordinator
from pyinfinity.zero.homes import ParamHomes
from pyinfinity.zero.lr_schedules import build_scheduler
from pyinfinity.zero.optim.formats import AdamFp32
from pyinfinity.zero.optimizer import DynamicLossScaler, OffloadOptimizer
from pyinfinity.zero.partition import FlatShard, compute_dtype_for, partition_model

log = logging.getLogger(__name__)

HISTORY_STEPS = 10_000  # telemetry records kept (a run of days must not grow without bound)
# a step whose measured device peak passes this share of the budget gives up part of the placement
# (prefetch, device optimizer state, resident units) until the charges are back under the
# planner's target (1 - DEVICE_HEADROOM of the budget)
SHRINK_AT = 0.95
_overlap_off_logged: set[str] = set()  # why "auto" turned overlap_step off, logged once per process
# "auto" on a CPU compute device: off. Backward then runs on the same cores as the background step;
# measured on 2 cores (`pyinfinity train --model-size small --device cpu`): 7% slower steps with the
# background step on one intra-op thread (overlap_threads), 40% with a full OpenMP team.
AUTO_OVERLAP_ON_CPU = False


# ----------------------------------------------------------------------------------- records


@dataclass
class StepRecord:
    """Telemetry of one optimizer step (all micro-batches of it)."""

    step: int
    loss: float
    lr: float
    tokens: int
    seconds: float
    tokens_per_s: float
    grad_norm: float
    skipped: bool
    loss_scale: float
    peak_device_bytes: int  # resident shard + buffer bytes high-water (the engine's own count)
    peak_device_allocated: Optional[int]  # torch.cuda.max_memory_allocated on a GPU, else None
    bytes_moved: dict[str, int]  # "params.nvme.read" etc., this step
    overlap_fraction: Optional[float]  # share of parameter transfer time hidden behind compute
    prefetch_hits: int
    on_demand_fetches: int
    optimizer_seconds: float  # time step() spent on the optimizer (with overlap_step: the wait after backward)
    optimizer_busy_seconds: float = 0.0  # optimizer time in all threads (with overlap_step: hidden part included)
    overlapped_shards: int = 0  # shards stepped in the background during the boundary backward
    # seconds of the optimizer's per-shard work since the last record, by part: gradient (wait for its
    # copy + convert to fp32), adam, write (new values home and to resident units), read_wait (NVMe),
    # accumulate (the gradient adds of this step's micro-batches, on their worker)
    optimizer_phases: Optional[dict] = None
    step_wait_seconds: float = 0.0  # time forward/backward waited for the optimizer to write a unit's values


@dataclass
class MemoryReport:
    """Where the training state lives (bytes per tensor class and tier) and the peaks."""

    device: str
    device_budget: Optional[int]
    device_resident: int
    device_peak: int
    device_allocated_peak: Optional[int]
    params: dict[str, int]
    optimizer: dict[str, int]
    grads: dict[str, int]
    swap_files: list[str]
    host_rss: int

    def table(self) -> str:
        rows = [f"device {self.device}: resident {format_size(self.device_resident)}, peak "
                f"{format_size(self.device_peak)}, budget "
                f"{format_size(self.device_budget) if self.device_budget else 'none'}"]
        for name, d in (("params", self.params), ("optimizer", self.optimizer), ("grads", self.grads)):
            held = ", ".join(f"{k} {format_size(v)}" for k, v in sorted(d.items()) if v)
            rows.append(f"{name:9s} " + (held or "none held"))
        return "\n".join(rows)


def _rss() -> int:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        return 0


# ----------------------------------------------------------------------------------- init_empty


@contextlib.contextmanager
def init_empty(config: Union[dict, str, Config, None] = None) -> Iterator[None]:
    """Builds models without materialising their parameters: each parameter is moved to the meta
    device as it is registered (before any initialiser touches its memory).

    ``initialize`` then materialises one module at a time, initialises it (``reset_parameters`` or
    a transformers model's ``_init_weights``), partitions it and writes the shard straight to its
    tier, so the whole model never exists in host RAM. Buffers are real (they are small and often
    computed in ``__init__``, e.g. rotary frequencies).
    """
    if config is not None:
        load_config(config)  # fail early on a bad config
    orig = nn.Module.register_parameter

    def register_parameter(self: nn.Module, name: str, param: Optional[nn.Parameter]) -> None:
        orig(self, name, param)
        if param is not None and not param.is_meta:
            p = self._parameters[name]
            self._parameters[name] = nn.Parameter(p.to("meta"), requires_grad=p.requires_grad)

    nn.Module.register_parameter = register_parameter  # type: ignore[method-assign]
    try:
        yield
    finally:
        nn.Module.register_parameter = orig  # type: ignore[method-assign]


# ----------------------------------------------------------------------------------- engine


def initialize(model: nn.Module, config: Union[dict, str, os.PathLike, Config],
               lr_scheduler: Any = None, weights: Union[str, os.PathLike, None] = None, *,
               seq_len: Optional[int] = None) -> "Engine":
    """Wraps ``model`` for offloaded ZeRO-3 training; ``config`` is DeepSpeed's format (dict or
    JSON path). ``lr_scheduler``: a scheduler object, or a callable taking the engine's optimizer
    and returning one (overrides the config's ``scheduler``). ``weights``: a safetensors checkpoint
    (file or model directory) whose values the parameters start from, streamed module by module
    into their tiers (``pretrained.WeightLoader``). ``seq_len``: the tokens per sequence the run
    will train on, when known: the planner sizes activations and compute for it (default 1024)."""
    return Engine(model, config, lr_scheduler, weights=weights, seq_len=seq_len)


def _resolve_device(spec: str) -> torch.device:
    """``pyinfinity.device`` as a torch.device; ``cuda`` and ``auto`` with a GPU become an indexed
    CUDA device (``LOCAL_RANK`` under torchrun), which torch's per-device memory calls require."""
    from pyinfinity.device import resolve_device

    try:
        return resolve_device(spec)
    except ValueError as e:
        raise ConfigError(f"pyinfinity.device: {e}") from None


def _resolve_overlap_step(cfg: Config, device: torch.device) -> str:
    """``pyinfinity.overlap_step`` -> "on" | "off". true/false as given (load_config refused true
    where it cannot be exact); "auto" = off where the optimizer steps on the compute device, or
    where the compute device is the CPU and the optimizer state all in RAM (backward would
    compete for the same cores; with state on disk the background step mostly waits for the disk:
    125M params, optimizer on nvme, 2 cores: the wait after backward 1.4-2.3 s -> 0.5-1.0 s);
    else on. Clipping and fp16 loss scaling do not turn it off: the step then runs after backward,
    unit by unit in forward order, while the next forward goes on (``zero.optimizer``)."""
    v = cfg.pyinfinity.overlap_step
    if v != AUTO:
        return "on" if v else "off"
    why = overlap_step_blocker(cfg)
    oo = cfg.zero_optimization.offload_optimizer
    on_disk = oo.device == "nvme" and oo.ratio > 0
    if why is None and device.type == "cpu" and not AUTO_OVERLAP_ON_CPU and not on_disk:
        why = ("the compute device is the CPU and the optimizer state is in RAM: backward would compete with "
               "the background step for the same cores")
    if why is None:
        return "on"
    _log_overlap_off(why)
    return "off"


def _log_overlap_off(why: str) -> None:
    if why not in _overlap_off_logged:
        _overlap_off_logged.add(why)
        log.info("auto: pyinfinity.overlap_step = false (%s)", why)


def _weakly(method: Any) -> Any:
    """A callable for the engine's parts (hooks, the optimizer's worker) that does not keep the engine
    alive: an engine dropped without close() is collected (its finalizer removes the swap files
    and the hooks)."""
    ref = weakref.WeakMethod(method)

    def call(*args: Any, **kwargs: Any) -> Any:
        m = ref()
        if m is None:
            raise RuntimeError("the pyinfinity Engine this belongs to was garbage-collected without close(); "
                               "build a new engine")
        return m(*args, **kwargs)
    return call


def _recomputes_activations(model: nn.Module) -> bool:
    """Whether a transformers model has activation checkpointing on (the planner's activation estimate)."""
    import warnings

    with warnings.catch_warnings():  # transformers deprecates one name for the other
        warnings.simplefilter("ignore")
        for name in ("is_activation_checkpointing", "is_gradient_checkpointing"):
            try:
                v = getattr(model, name)
            except AttributeError:
                continue
            if isinstance(v, bool):
                return v
    return False


def _model_sizes(model: nn.Module, fp16: bool, bf16: bool, threshold: Any) -> ModelSizes:
    numel = pbytes = largest = largest_mod = persistent = small = 0
    seen: set[int] = set()
    thr = threshold if isinstance(threshold, int) else 0
    for module in model.modules():
        by_dtype: dict[torch.dtype, int] = {}
        mod_bytes = 0
        for p in module.parameters(recurse=False):
            dt = compute_dtype_for(p.dtype, fp16, bf16)
            nb = p.numel() * torch.empty((), dtype=dt).element_size()
            mod_bytes += nb
            if id(p) in seen:
                continue
            seen.add(id(p))
            numel += p.numel()
            pbytes += nb
            by_dtype[dt] = by_dtype.get(dt, 0) + p.numel()
        for dt, n in by_dtype.items():
            nb = n * torch.empty((), dtype=dt).element_size()
            largest = max(largest, nb)
            if n <= thr:
                persistent += nb
            if n <= 100_000:
                small += nb
        largest_mod = max(largest_mod, mod_bytes)
    return ModelSizes(numel=numel, param_bytes=pbytes, largest_shard_bytes=largest,
                      largest_module_bytes=largest_mod, persistent_bytes=persistent,
                      small_shard_bytes=small)


class Engine:
    """Offloaded ZeRO-3 training of one model on one device. Use ``initialize`` to make one."""

    def __init__(self, model: nn.Module, config: Union[dict, str, os.PathLike, Config],
                 lr_scheduler: Any = None, weights: Union[str, os.PathLike, None] = None, *,
                 seq_len: Optional[int] = None) -> None:
        self._closed = True
        guards.check_not_wrapped(model)
        cfg = load_config(config)
        self.weights: Any = None  # pretrained.WeightLoader: names, shapes checked before anything is written
        if weights is not None:
            from pyinfinity.pretrained import WeightLoader

            self.weights = WeightLoader(weights, model)
        self.device = _resolve_device(cfg.pyinfinity.device)
        if self.device.type == "cuda":  # streams, pinned memory and the user's .cuda() follow it
            torch.cuda.set_device(self.device)
        z = cfg.zero_optimization
        fp16, bf16 = cfg.fp16.enabled, cfg.bf16.enabled
        sizes = _model_sizes(model, fp16, bf16, z.stage3_param_persistence_threshold)
        if cfg.pyinfinity.unit_bytes == AUTO:  # before the planner: it counts the units the partition makes
            dm = cfg.pyinfinity.device_memory
            cfg.pyinfinity.unit_bytes = auto_unit_bytes(sizes.param_bytes, sizes.largest_module_bytes,
                                                        dm if isinstance(dm, int) else None)
        # every "auto" decided by the planner (placement, sizes, budgets), logged below
        from pyinfinity.plan import plan_engine_config

        self._checkpointing = _recomputes_activations(model)
        cfg, decisions, self.plan = plan_engine_config(cfg, model, self.device, seq_len=seq_len,
                                                       checkpointing=self._checkpointing)
        # for the shape check at the first forward: the planner's sizes, or (a config with nothing
        # left to plan) the model's own, counted before the partition empties its parameters
        self._plan_sizes = self.plan.inputs[0] if self.plan is not None else None
        if self._plan_sizes is None and self.device.type == "cuda":
            from pyinfinity.plan.sizes import model_sizes

            self._plan_sizes = model_sizes(model, torch.float16 if fp16 else torch.bfloat16 if bf16 else None)
        for d in decisions:
            log.info("auto: %s = %s (%s)", d.key, d.value, d.why)
        self.config = cfg
        self.auto_decisions = decisions
        z = cfg.zero_optimization
        self.module = model
        self.gradient_accumulation_steps = cfg.gradient_accumulation_steps
        self.global_steps = 0
        self.micro_steps = 0
        self._overlap_mode = _resolve_overlap_step(cfg, self.device)
        self._poisoned: Optional[str] = None  # why the training state is partly stepped (load a checkpoint)
        self._pending_backward = False  # a boundary backward's gradients wait for step()
        self._in_pass = 0  # forwards/backwards of this engine running now (a save from a signal handler refuses)
        self.history: collections.deque[StepRecord] = collections.deque(maxlen=HISTORY_STEPS)
        dm = cfg.pyinfinity.device_memory
        self.device_memory: Optional[int] = int(dm) if isinstance(dm, int) else None
        self._capped = False  # this engine set torch's per-process memory fraction (close() puts it back)
        if self.device.type == "cuda" and self.device_memory:
            total = torch.cuda.get_device_properties(self.device).total_memory
            torch.cuda.set_per_process_memory_fraction(min(1.0, self.device_memory / total), self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self._capped = True

        # the swap layer: one engine per state class so I/O time can be told apart
        self._swap_engines: dict[str, Any] = {}
        op, oo = z.offload_param, z.offload_optimizer
        param_ram = sizes.param_bytes if op.device == "cpu" else min(sizes.param_bytes, int(op.max_in_cpu) * max(1, sizes.param_bytes // max(1, sizes.numel)))
        self._state_format = AdamFp32(cfg.optimizer.adam_w_mode)  # how each shard's optimizer state is kept
        optim_ram = sizes.numel * self._state_format.bytes_per_param * (1.0 - (oo.ratio if oo.device == "nvme"
                                                                               else 0.0))
        # budgets checked, swap directories locked, a crashed run's files cleaned (swap/ownership.py)
        self._ownership = claim_swap_dirs(cfg, sizes, sum(1 for m in model.modules() if m._parameters))
        try:
            self.param_swapper = TensorSwapper("params", self.device, op.nvme_path,
                                               self._swap_engine("params") if op.device == "nvme" else None,
                                               pin=op.pin_memory, pinned_capacity=param_ram + (1 << 20),
                                               checksums=cfg.pyinfinity.checksums, ownership=self._ownership)
            self.optim_swapper = TensorSwapper("optimizer", self.device, oo.nvme_path,
                                               self._swap_engine("optimizer") if oo.device == "nvme" else None,
                                               pin=oo.pin_memory and cfg.pyinfinity.optimizer_step_device == "device",
                                               pinned_capacity=int(optim_ram) + (1 << 20),
                                               checksums=cfg.pyinfinity.checksums, ownership=self._ownership)
        except BaseException:  # e.g. pinned memory refused: give the swap directories back
            for e in self._swap_engines.values():
                e.close()
            self._ownership.release()
            raise
        self._homes = ParamHomes(self.param_swapper, self.device, cfg.gradient_accumulation_steps)
        self.optimizer = OffloadOptimizer(cfg.optimizer, self.optim_swapper,
                                          nvme_ratio=oo.ratio if oo.device == "nvme" else 0.0,
                                          buffer_count=oo.buffer_count,
                                          pipeline=oo.pipeline_read or oo.pipeline_write,
                                          write_param=self._homes.write_param,
                                          step_device=self.device if cfg.pyinfinity.optimizer_step_device
                                          == "device" else None,
                                          accumulate_steps=cfg.gradient_accumulation_steps,
                                          state_format=self._state_format)
        self.optimizer.background = self._overlap_mode == "on"
        self.optimizer.param_out = self._homes.param_out
        self.optimizer.release_grad = self._homes.release_grad
        ot = cfg.pyinfinity.optimizer_threads
        # on the CPU device backward has the cores (see AUTO_OVERLAP_ON_CPU)
        self.optimizer.threads = int(ot) if ot != AUTO else default_optimizer_threads(str(self.device))
        self.optimizer._total_numel = sum(p.numel() for p in {id(p): p for p in model.parameters()
                                                               if p.requires_grad}.values())
        self._cpu_params_left = int(op.max_in_cpu) if op.device == "nvme" else 0
        self._param_tier = {"none": Tier.GPU, "cpu": Tier.CPU, "nvme": Tier.NVME}[op.device]

        # buffers go to the device and stay (counted against the budget)
        buf_bytes = 0
        for mod in model.modules():
            for name, b in list(mod._buffers.items()):
                if b is not None:
                    mod._buffers[name] = b.to(self.device)
                    buf_bytes += b.numel() * b.element_size()
        self.coordinator: Optional[ParameterCoordinator] = None
        self._closed = False
        self._held: list[Any] = [self.optimizer]  # what the finalizer stops: the worker, later the hooks
        self._finalizer = weakref.finalize(self, Engine._cleanup, self.param_swapper, self.optim_swapper,
                                           self._swap_engines, self._ownership, self._held)
        atexit.register(self._finalizer)
        try:
            t0 = time.perf_counter()
            self.partition = partition_model(model, fp16=fp16, bf16=bf16,
                                             persistence_threshold=int(z.stage3_param_persistence_threshold),
                                             on_shard=self._place_shard, device=self.device,
                                             unit_bytes=int(cfg.pyinfinity.unit_bytes),
                                             **({"materialize": self.weights} if self.weights is not None else {}))
            log.info("placed %d units (%d shards) in %.2fs", self.partition.units, len(self.partition.shards),
                     time.perf_counter() - t0)
            self._ownership.flush()  # the manifest lists every slot
            self._keep_resident(self.partition.shards if self._param_tier == Tier.GPU else None)
            self._place_device_states()
            self._place_device_accumulators()
            self.coordinator = ParameterCoordinator(
                model, self.partition, self.param_swapper, self.device,
                device_memory=self.device_memory,
                prefetch_bytes=int(z.stage3_prefetch_bucket_size), prefetch=cfg.pyinfinity.prefetch,
                on_grad=self.optimizer.grad_ready, grad_dest=self._homes.grad_dest, wait_home=_weakly(self._wait_home),
                master_values=self.optimizer.master_values,
                fixed_bytes=buf_bytes + self.device_state_bytes + self.device_grad_bytes,
                max_live_elements=int(z.stage3_max_live_parameters),
                max_inflight_reads=int(op.buffer_count) if op.device == "nvme" else None)
        except BaseException:
            self.close()
            raise
        self._held.append(self.coordinator)  # a dropped engine takes its hooks off the model
        self.optimizer.copy_to_host = self.coordinator.copy_to_host  # device accumulators' sums to the host
        self._init_budget_watch(model)
        self._homes.partition, self._homes.coordinator = self.partition, self.coordinator
        self.scaler = DynamicLossScaler(cfg.fp16)
        if lr_scheduler is not None:
            self.lr_scheduler = lr_scheduler(self.optimizer) if callable(lr_scheduler) and not hasattr(
                lr_scheduler, "step") else lr_scheduler
        elif cfg.scheduler is not None:
            self.lr_scheduler = build_scheduler(cfg.scheduler.type, self.optimizer, cfg.scheduler.params)
        else:
            self.lr_scheduler = None
        self._step_t0: Optional[float] = None
        self._tokens = 0
        self._losses: list[torch.Tensor] = []
        self._mark = self._counters()
        guards.attach(self, model)
        log.info("engine ready on %s: %s params (%s), params %s, optimizer on %s%s", self.device,
                 f"{self.partition.numel:,}", format_size(self.partition.nbytes),
                 f"resident on {self.device}" if op.device == "none" else f"on {op.device}", oo.device,
                 f", device budget {format_size(self.device_memory)}" if self.device_memory else "")

    # ------------------------------------------------------------------------- construction
    def _swap_engine(self, name: str) -> Any:
        if name not in self._swap_engines:
            from pyinfinity.swap import SwapEngine

            a = self.config.aio
            self._swap_engines[name] = SwapEngine(backend=a.backend, block_size=a.block_size,
                                                  queue_depth=a.queue_depth, threads=a.thread_count)
        return self._swap_engines[name]

    def _place_shard(self, shard: FlatShard, flat: torch.Tensor, flat32: torch.Tensor) -> None:
        tier = self._param_tier
        if tier == Tier.NVME and self._cpu_params_left >= shard.numel:
            self._cpu_params_left -= shard.numel
            tier = Tier.CPU
        shard.home = self.param_swapper.put(f"param.{shard.index}", flat, tier)
        self.optimizer.add_shard(shard, flat32)

    def _keep_resident(self, shards: Optional[list[FlatShard]]) -> None:
        """Marks the units that stay on the compute device between steps: ``shards`` (all of them
        when parameters are not offloaded), else whole units from the end of the model (backward
        needs them first) within ``pyinfinity.resident_bytes``."""
        if shards is None:
            left = int(self.config.pyinfinity.resident_bytes) if self.config.pyinfinity.resident_bytes != AUTO else 0
            shards = []
            for sh in reversed(self.partition.shards):
                if sh.persistent or sh.nbytes > left:
                    continue
                left -= sh.nbytes
                shards.append(sh)
        for sh in shards:
            sh.persistent = True
        # what a budget overflow may give up (not the units whose home is the device)
        self._resident_units = sorted((sh for sh in shards if sh.home.tier != Tier.GPU), key=lambda sh: sh.index)
        self.resident_bytes = sum(sh.nbytes for sh in self.partition.shards if sh.persistent)

    def _place_device_states(self) -> None:
        """Resident units whose optimizer state also lives on the device, within
        ``pyinfinity.device_optimizer_bytes``: whole units from the front of the model (their
        gradients come last in backward, when a CPU step would have the least time left)."""
        from pyinfinity.plan.placement import device_state_cost

        budget = self.config.pyinfinity.device_optimizer_bytes
        left = 0 if budget == AUTO else int(budget)
        self.device_state_bytes = 0
        if left <= 0 or self.optimizer.step_device is not None:
            return
        units = numel = 0
        for sh in self.partition.shards:
            cost = device_state_cost(sh.dtype.itemsize, self.gradient_accumulation_steps) * sh.numel
            if not (sh.persistent and sh.trainable and sh.numel) or cost > left:
                continue
            left -= cost
            self.device_state_bytes += self.optimizer.to_device(sh, self.device)
            units += 1
            numel += sh.numel
        if units:
            log.info("optimizer state of %d resident units (%s parameters, %s) on %s: they step there", units,
                     f"{numel:,}", format_size(self.device_state_bytes), self.device)

    def _place_device_accumulators(self) -> None:
        """Under gradient accumulation, units whose fp32 gradient accumulator lives on the device
        within ``pyinfinity.device_accumulator_bytes`` (4 bytes a parameter): whole units from the
        front of the model (their gradients come last in backward, when host adds would have the
        least time left), besides those stepped on the device (which accumulate there anyway)."""
        budget = self.config.pyinfinity.device_accumulator_bytes
        left = 0 if budget == AUTO else int(budget)
        self.device_grad_bytes = 0
        if left <= 0 or self.gradient_accumulation_steps <= 1:
            return
        units = numel = 0
        for sh in self.partition.shards:
            if not (sh.trainable and sh.numel) or sh.device_step or 4 * sh.numel > left:
                continue
            n = self.optimizer.accumulate_on_device(sh, self.device)
            left -= n
            self.device_grad_bytes += n
            units += 1
            numel += sh.numel
        if units:
            log.info("gradient accumulators of %d units (%s parameters, %s) on %s: their micro-batch gradients are "
                     "added there", units, f"{numel:,}", format_size(self.device_grad_bytes), self.device)

    # ------------------------------------------------------------------------- the device budget
    def _init_budget_watch(self, model: nn.Module) -> None:
        """What the budget checks need: the prefetch reserve (the planner's charges for gradient
        buffers and headroom), the sizes for the first forward's shape check."""
        from pyinfinity.plan.placement import DEVICE_HEADROOM, grad_buffer_bytes

        self._shape_checked = False
        self._forward_tokens = 0
        self._gave_up: list[str] = []  # what budget overflows took from the placement, in order
        trainable = [sh for sh in self.partition.shards if sh.trainable]
        params = [sl.numel * sh.dtype.itemsize for sh in trainable for sl in sh.slices if sl.requires_grad]
        self._grad_buffers = grad_buffer_bytes(max((sh.nbytes for sh in trainable), default=0), max(params, default=0))
        if self.device_memory:
            headroom = int(self.device_memory * DEVICE_HEADROOM)
            self.coordinator.budget.reserve = headroom + (self._grad_buffers if self.device.type == "cuda" else 0)
        self.coordinator.budget.reset_step_peak()

    def _check_shape(self, args: tuple, kwargs: dict) -> None:
        """At the first training forward, when the micro-batch x sequence is known: refuses a shape
        that cannot fit the device budget even with nothing resident (PlanError, one line naming the
        largest that fits)."""
        self._shape_checked = True
        t = kwargs.get("input_ids")
        if t is None:
            t = next((a for a in args if isinstance(a, torch.Tensor)), None)
        if not isinstance(t, torch.Tensor) or t.dim() != 2 or self.device_memory is None:
            return
        sizes = self._plan_sizes
        if sizes is None or not sizes.hidden:
            return  # the activation estimate is for transformers' decoders; the allocator has the last word
        from pyinfinity.plan.placement import PlanError, TrainShape, shape_refusal

        train = TrainShape(micro_batch=int(t.shape[0]), seq_len=int(t.shape[1]),
                           grad_accum=self.gradient_accumulation_steps, checkpointing=self._checkpointing)
        if self.device.type != "cuda":
            return  # the CPU device's pool holds shards only: the coordinator checks each fetch
        small = sum(sh.nbytes for sh in self.partition.shards if sh.persistent) - self.resident_bytes
        why = shape_refusal(sizes, train, self.device_memory, persistent=max(0, small))
        if why is not None:
            raise PlanError(why)

    def _state_to_host(self, sh: FlatShard) -> int:
        """Moves one shard's optimizer state from the device to its host home (it is stepped on
        the CPU from now on); returns the device bytes freed."""
        n = self.optimizer.to_host(sh, self._homes.write_home)
        self.coordinator.budget.sub(n)
        self.coordinator.budget.fixed -= n
        self.device_state_bytes -= n
        return n

    def _accumulator_to_host(self, sh: FlatShard) -> int:
        """Moves one unit's gradient accumulator from the device to the host (the window's sum so
        far with it); returns the device bytes freed."""
        n = self.optimizer.accumulator_to_host(sh)
        self.coordinator.budget.sub(n)
        self.coordinator.budget.fixed -= n
        self.device_grad_bytes -= n
        return n

    def _give_up(self, need: int, prefetch: bool = True) -> list[str]:
        """Frees at least ``need`` device bytes of the placement if it can: the prefetch it used
        (with ``prefetch``), then the optimizer state on the device (from the back: the units
        stepped there last), then the gradient accumulators on the device (from the back), then
        resident units (from the front: backward needs the back first).
        Returns what was given up."""
        from pyinfinity.config import format_size

        gave: list[str] = []
        coord = self.coordinator
        used = min(coord.prefetch_high, coord.prefetch_bytes)  # what prefetch held at most in the last step
        if prefetch and need > 0 and used > 0:
            before = coord.prefetch_bytes
            coord.prefetch_bytes = max(0, used - need)
            coord.prefetch_enabled = coord.prefetch_enabled and coord.prefetch_bytes > 0
            need -= used - coord.prefetch_bytes
            gave.append(f"prefetch {format_size(before)} -> {format_size(coord.prefetch_bytes)}")
        if need > 0 and (self.device_state_bytes or self.device_grad_bytes or self._resident_units):
            self._drain("giving up device memory")  # the homes must hold the current values
        units = freed = 0
        for sh in reversed(self.partition.shards):  # small persistent shards may step there too
            if need <= 0:
                break
            if sh.device_step:
                n = self._state_to_host(sh)
                need -= n
                freed += n
                units += 1
        if units:
            gave.append(f"the optimizer state of {units} units ({format_size(freed)}) back to the host")
        units = freed = 0
        for sh in reversed(self.partition.shards):
            if need <= 0:
                break
            if sh.grad_on_device:
                n = self._accumulator_to_host(sh)
                need -= n
                freed += n
                units += 1
        if units:
            gave.append(f"the gradient accumulators of {units} units ({format_size(freed)}) to the host")
        units = freed = 0
        if need > 0 and self._resident_units and all(sh.persistent for sh in self.partition.shards):
            # nothing was fetched in the last step: from now on a working set is (the unit in use and the next)
            need += 2 * max(sh.nbytes for sh in self.partition.shards)
        for sh in list(self._resident_units):
            if need <= 0:
                break
            if sh.device_step:
                need -= self._state_to_host(sh)
            n = coord.give_up_resident(sh)
            self._resident_units.remove(sh)
            self.resident_bytes -= n
            need -= n
            freed += n
            units += 1
        if units:
            gave.append(f"{units} resident units ({format_size(freed)}) back to their homes")
        self._gave_up += gave
        return gave

    def _give_up_all(self) -> list[str]:
        """Every resident unit and all device optimizer state back to the host (an out-of-memory error)."""
        return self._give_up(1 << 62, prefetch=False)

    def _budget_exceeded(self, where: str, oom: str) -> DeviceBudgetExceeded:
        """After an out-of-memory error in forward or backward with no unit stepped: the step's
        buffers freed, the placement moved to the host homes. The error to raise."""
        from pyinfinity.config import format_size

        self.coordinator.release_all()
        if where == "backward":  # this micro-batch's gradients are dropped (a home holding one was restored)
            for st in self.optimizer.states:
                if not st.busy:
                    st.src = st.event = st.norm = None
        gave = self._give_up_all()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        what = "; ".join(gave) or "nothing was left to give up"
        msg = (f"{where} ran out of device memory ({oom}) within pyinfinity.device_memory "
               f"{format_size(self.device_memory) if self.device_memory else 'none'}, before any unit was stepped; "
               f"gave up: {what}. The micro-batch may be run again")
        log.warning("%s", msg)
        return DeviceBudgetExceeded(msg, what)

    def _watch_budget(self) -> None:
        """After each optimizer step: the measured device peak (torch's allocator on a GPU, since
        the last shrink; the engine's own count of the step on the CPU device); past SHRINK_AT of
        the budget, the placement gives up what the peak exceeds the planner's target by (a unit
        given up is fetched again when used, so the next step may give up more), with a warning
        the first time."""
        from pyinfinity.config import format_size
        from pyinfinity.plan.placement import DEVICE_HEADROOM

        cap = self.device_memory
        budget = self.coordinator.budget
        cuda = self.device.type == "cuda"
        if cuda:  # torch's peak since the last shrink (reset only then: tools read it at the end of a run)
            peak = torch.cuda.max_memory_allocated(self.device)
            reserved = torch.cuda.max_memory_reserved(self.device)
        else:
            peak, reserved = budget.step_peak, budget.step_peak
        budget.reset_step_peak()
        if not cap or peak <= SHRINK_AT * cap:
            self.coordinator.prefetch_high = 0
            return
        gave = self._give_up(peak - int((1 - DEVICE_HEADROOM) * cap))
        self.coordinator.prefetch_high = 0
        if gave and cuda:
            torch.cuda.reset_peak_memory_stats(self.device)
        if gave:  # a warning the first time; the steps after it may give up a little more (INFO)
            first = len(self._gave_up) == len(gave)
            log.log(logging.WARNING if first else logging.INFO,
                    "device budget: the step's peak was %s of %s (allocator reserved %s): gave up %s%s",
                    format_size(peak), format_size(cap), format_size(reserved), "; ".join(gave),
                    "" if first else f" (in all: {'; '.join(self._gave_up)})")

    def _write_param(self, shard: FlatShard, master: torch.Tensor) -> Any:
        """The optimizer's new fp32 values of a shard, written home (``ParamHomes.write_param``)."""
        return self._homes.write_param(shard, master)

    # ------------------------------------------------------------------------- training API
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """Runs the module's forward through the coordinator's hooks; returns its output as is.
        Tensor arguments (also inside a list, tuple or dict) on another device, e.g. a CPU batch
        from a DataLoader, are moved to the engine's device first."""
        self._check_open()
        if self.device.type != "cpu":
            args, kwargs = _inputs_to(args, self.device), _inputs_to(kwargs, self.device)
        if self._step_t0 is None:
            self._step_t0 = time.perf_counter()
        tokens = _count_tokens(args, kwargs)
        if not (torch.is_grad_enabled() and self.module.training):
            self._tokens += tokens
            with self._pass():
                return self.module(*args, **kwargs)
        if not self._shape_checked:
            self._check_shape(args, kwargs)
        oom = None
        try:
            with self._pass(), self.coordinator.saved_tensors_hooks():
                out = self.module(*args, **kwargs)
        except torch.OutOfMemoryError as exc:
            if isinstance(exc, DeviceBudgetExceeded):
                raise
            oom = str(exc).splitlines()[0] if str(exc) else "out of memory"
        if oom is None:
            self._tokens += tokens
            self._forward_tokens = tokens
            return out
        # outside the except block: the failed forward's frames (and the activations they hold) are gone
        self.coordinator.release_all()
        raise self._budget_exceeded("forward", oom)

    @contextlib.contextmanager
    def _pass(self) -> Iterator[None]:
        """Counts a forward or backward in progress (``_check_not_in_pass``)."""
        self._in_pass += 1
        try:
            yield
        finally:
            self._in_pass -= 1

    def _check_not_in_pass(self, what: str) -> None:
        """A save or load re-entering a forward or backward (a signal handler runs between two
        bytecodes of it) would read or replace shards the pass holds half-fetched: refused."""
        if self._in_pass:
            raise RuntimeError(f"{what}: called while a forward or backward of this engine is running (from a signal "
                               "handler?), whose shards are in flight; set a flag in the handler and save after "
                               "step() returns")

    forward = __call__

    def backward(self, loss: torch.Tensor) -> None:
        """Backward of one micro-batch's loss (scaled for accumulation and fp16); gradients leave
        the device as they are produced."""
        self._check_trainable("backward()")
        if not isinstance(loss, torch.Tensor) or not loss.requires_grad:
            raise TypeError(f"loss: expected a tensor that requires grad (the output of engine(...) in train mode), "
                            f"got {type(loss).__name__ if not isinstance(loss, torch.Tensor) else 'one without grad'}")
        self._losses.append(loss.detach())
        scaled = loss
        if self.config.fp16.enabled:
            scaled = scaled * self.scaler.scale
        if self.gradient_accumulation_steps > 1:
            scaled = scaled / self.gradient_accumulation_steps
        opt = self.optimizer
        if self._pending_backward:
            raise RuntimeError("backward(): the last boundary backward's gradients are waiting for step(); call "
                               "step() after each backward()")
        boundary = self.is_gradient_accumulation_boundary()
        if boundary:  # hyperparameters fixed; without clipping/fp16, units step as their gradients land
            opt.begin_overlap(eager=not (self.config.gradient_clipping > 0 or self.config.fp16.enabled))
        self.coordinator.in_backward = True
        self.coordinator.grads_handed = 0
        oom = None
        try:
            try:
                with self._pass():
                    scaled.backward()
            finally:
                self.coordinator.in_backward = False
            self.coordinator.end_backward()
        except BaseException as exc:
            self.coordinator.abandon_grads()
            self.coordinator.end_backward()
            if not isinstance(exc, torch.OutOfMemoryError) or isinstance(exc, DeviceBudgetExceeded):
                self._abandon_step(f"backward() raised {exc!r}")
                raise
            self._losses.pop()
            oom = str(exc).splitlines()[0] if str(exc) else "out of memory"
            self._abandon_step(f"backward() ran out of device memory ({oom})")
            if self._poisoned is None and self.gradient_accumulation_steps > 1 and self.coordinator.grads_handed:
                # part of this micro-batch's gradient is in the accumulators already: a retry would add it twice
                self._poisoned = (f"backward() ran out of device memory ({oom}) after {self.coordinator.grads_handed} "
                                  "units had added this micro-batch's gradient to the accumulation")
            if self._poisoned is not None:
                raise
        if oom is not None:  # no unit stepped: give up the device placement, the micro-batch may run again
            del scaled, loss
            self._tokens -= self._forward_tokens
            self._forward_tokens = 0
            raise self._budget_exceeded("backward", oom)
        self._pending_backward = boundary and self.gradient_accumulation_steps == 1

    @property
    def overlap_step(self) -> bool:
        """Whether the optimizer steps in a background thread (pyinfinity.overlap_step)."""
        return self._overlap_mode == "on"

    def _abandon_step(self, why: str) -> None:
        """A step that cannot complete: waits for what the worker was handed, puts the parameter
        homes that hold gradients back to the current weights. If any shard was stepped, or the
        background step of this or an earlier step failed, the training state is partly stepped:
        backward/step/save refuse until load_checkpoint()."""
        self._pending_backward = False
        failed = self.optimizer.failure  # cancel() forgets it
        try:
            stepped = self.optimizer.cancel()
            self.optimizer.restore_homes()
        except BaseException:
            self._mark_partly_stepped(f"{why}; the optimizer step could not be stopped cleanly")
            raise
        if failed is not None:
            self._mark_partly_stepped(f"{why}: the background optimizer step had failed ({failed!r})")
        elif stepped:
            self._mark_partly_stepped(f"{why} after {stepped} shards had been stepped")

    def _mark_partly_stepped(self, why: str) -> None:
        """Records that some shards hold a step's results and others not (the first reason is kept):
        backward/step/save refuse (``_check_trainable``) until load_checkpoint() succeeds."""
        if self._poisoned is None:
            self._poisoned = why
            log.error("%s: the optimizer state is partly stepped; load_checkpoint() before training on", why)

    def _partly_stepped_error(self, what: str) -> RuntimeError:
        return RuntimeError(f"{what}: the training state is partly stepped ({self._poisoned}); "
                            "load_checkpoint() or build a new engine")

    def _wait_home(self, shard: FlatShard) -> float:
        """A fetch waits for the worker to write a unit's new values; a failure there (of any step
        still running in the background) leaves the state partly stepped: the failure is raised
        once, every later fetch gets the partly-stepped refusal."""
        if self._poisoned is not None and self.optimizer.failure is not None:
            raise self._partly_stepped_error(f"fetching {shard.module_name or '<root>'}")
        try:
            return self.optimizer.wait_shard(shard)
        except BaseException as exc:
            if self._poisoned is not None:
                raise self._partly_stepped_error(f"fetching {shard.module_name or '<root>'}") from exc
            self._mark_partly_stepped(f"the background optimizer step failed: {exc!r}")
            raise

    def _drain(self, what: str) -> None:
        """Waits until the optimizer's worker has written every new value home (for anything that
        reads the whole training state); a failure there poisons the engine."""
        try:
            self.optimizer.drain()
        except BaseException as exc:
            self._mark_partly_stepped(f"the background optimizer step failed: {exc!r}")
            self.optimizer.cancel()
            raise

    def synchronize(self) -> None:
        """Waits until the optimizer's background work is done: every unit's new values are home
        (and on the device for resident units). ``step()`` does not wait (the next forward waits
        unit by unit); call this before timing a step end to end or reading the model directly."""
        self._check_open()
        self._drain("synchronize()")

    def _check_trainable(self, what: str) -> None:
        self._check_open()
        if self._poisoned is not None:
            raise self._partly_stepped_error(what)

    def is_gradient_accumulation_boundary(self) -> bool:
        return (self.micro_steps + 1) % self.gradient_accumulation_steps == 0

    def step(self) -> Optional[StepRecord]:
        """Counts a micro-batch; at the accumulation boundary applies the optimizer (in the
        background with overlap_step: the next forward waits for each unit's new values), steps
        the lr schedule, zeroes the gradients and returns the step's telemetry."""
        self._check_trainable("step()")
        boundary = self.is_gradient_accumulation_boundary()
        if boundary and not self._losses:
            raise RuntimeError("step(): no backward() since the last optimizer step; call engine.backward(loss) "
                               "first (a step on zero gradients would still apply weight decay and momentum)")
        self.micro_steps += 1
        if not boundary:
            self.optimizer.check_accumulation("step()")  # a failed gradient add surfaces here at the latest
            return None
        fp16 = self.config.fp16.enabled
        try:
            self.coordinator.release_all()
            self._ownership.verify()  # a truncated swap file is an error here, not data
            res = self.optimizer.step(grad_scale=self.scaler.scale if fp16 else 1.0,
                                      clip=self.config.gradient_clipping, check_overflow=fp16)
        except BaseException as exc:
            self._abandon_step(f"step() raised {exc!r}")
            raise
        self._pending_backward = False
        if fp16:
            self.scaler.update(res.skipped)
            if res.skipped:
                log.info("step %d: fp16 overflow, skipped; loss scale now %g", self.global_steps, self.scaler.scale)
        self.optimizer.zero_grad()
        lr = float(self.optimizer.param_groups[0]["lr"])
        if not res.skipped:
            self.global_steps += 1
            if self.lr_scheduler is not None:
                self.lr_scheduler.step()
        rec = self._record(res, lr)
        self.history.append(rec)
        self._watch_budget()
        if self.global_steps % self.config.pyinfinity.log_every == 0:
            log.info("step %d loss %.4f lr %.3g %.0f tok/s peak %s overlap %s", rec.step, rec.loss, rec.lr,
                     rec.tokens_per_s, format_size(rec.peak_device_bytes),
                     "n/a" if rec.overlap_fraction is None else f"{rec.overlap_fraction:.2f}")
        return rec

    def zero_grad(self) -> None:
        """Zeroes the accumulated gradients (``step`` does this itself at the boundary); after a
        boundary backward it drops that backward's gradients (the weights stay as they were)."""
        self._check_open()
        if self.optimizer.overlap_open:
            raise RuntimeError("zero_grad(): the boundary backward() has already stepped part of the model in the "
                               "background (overlap_step); call step() (or set pyinfinity.overlap_step false)")
        self._drain("zero_grad()")
        self.optimizer.restore_homes()
        self._pending_backward = False
        self.optimizer.zero_grad()

    def train(self, mode: bool = True) -> "Engine":
        self.module.train(mode)
        return self

    def eval(self) -> "Engine":
        self.module.eval()
        return self

    def __getattr__(self, name: str) -> Any:
        # generate(), config, ... of the wrapped module (hooks make its parameters resident)
        module = self.__dict__.get("module")
        if module is None or name.startswith("_") or name in ("coordinator", "partition", "config"):
            raise AttributeError(f"'Engine' object has no attribute {name!r}")
        return getattr(module, name)

    def get_lr(self) -> list[float]:
        return [g["lr"] for g in self.optimizer.param_groups]

    # ------------------------------------------------------------------------- telemetry
    def _counters(self) -> dict[str, Any]:
        moved: dict[str, int] = {}
        for cls, sw in (("params", self.param_swapper), ("optimizer", self.optim_swapper)):
            for k, v in sw.stats.bytes.items():
                moved[f"{cls}.{k}"] = v
        st = self.coordinator.stats
        moved["device.h2d"] = st.fetched_bytes
        moved["device.d2h"] = st.grad_bytes
        io = {name: e.stats() for name, e in self._swap_engines.items()}
        return {"moved": moved, "fetch": st.snapshot(), "io": io}

    def _record(self, res: Any, lr: float) -> StepRecord:
        now = time.perf_counter()
        seconds = now - (self._step_t0 or now)
        cur = self._counters()
        moved = {k: v - self._mark["moved"].get(k, 0) for k, v in cur["moved"].items()}
        moved = {k: v for k, v in moved.items() if v}
        f0, f1 = self._mark["fetch"], cur["fetch"]
        overlap: Optional[float] = None
        sample = self.coordinator.overlap()
        if sample is not None:
            if sample.transfer_s > 0:
                overlap = max(0.0, 1.0 - sample.stalled_s / sample.transfer_s)
        elif "params" in cur["io"]:
            busy = cur["io"]["params"]["read"]["seconds"] - self._mark["io"]["params"]["read"]["seconds"]
            waited = f1.fetch_wait_seconds - f0.fetch_wait_seconds
            if busy > 0:
                overlap = min(1.0, max(0.0, 1.0 - waited / busy))
        loss = float(torch.stack([l.float() for l in self._losses]).mean()) if self._losses else float("nan")
        peak_alloc = None
        if self.device.type == "cuda":
            peak_alloc = torch.cuda.max_memory_allocated(self.device)
        rec = StepRecord(step=self.global_steps, loss=loss, lr=lr, tokens=self._tokens, seconds=seconds,
                         tokens_per_s=self._tokens / seconds if seconds > 0 else 0.0,
                         grad_norm=res.grad_norm, skipped=res.skipped,
                         loss_scale=self.scaler.scale if self.config.fp16.enabled else 1.0,
                         peak_device_bytes=self.coordinator.budget.peak, peak_device_allocated=peak_alloc,
                         bytes_moved=moved, overlap_fraction=overlap,
                         prefetch_hits=f1.prefetch_hits - f0.prefetch_hits,
                         on_demand_fetches=f1.on_demand - f0.on_demand, optimizer_seconds=res.seconds,
                         optimizer_busy_seconds=res.busy_seconds, overlapped_shards=res.overlapped_shards,
                         optimizer_phases=getattr(res, "phases", None) or None,
                         step_wait_seconds=f1.step_wait_seconds - f0.step_wait_seconds)
        self._mark = cur
        self._losses.clear()
        self._tokens = 0
        self._step_t0 = None
        return rec

    def memory_report(self) -> MemoryReport:
        """Bytes per tensor class and tier now, and the device peaks."""
        params: dict[str, int] = {}
        for sh in self.partition.shards:
            params[sh.home.tier.value] = params.get(sh.home.tier.value, 0) + sh.nbytes
        params["device(resident)"] = sum(sh.nbytes for sh in self.partition.shards if sh.buffer is not None)
        return MemoryReport(
            device=str(self.device), device_budget=self.device_memory,
            device_resident=self.coordinator.budget.resident, device_peak=self.coordinator.budget.peak,
            device_allocated_peak=torch.cuda.max_memory_allocated(self.device) if self.device.type == "cuda" else None,
            params=params, optimizer=self.optimizer.bytes_by_tier, grads={"cpu": 0, **self.optimizer.grad_bytes_by_tier},
            swap_files=self.param_swapper.files() + self.optim_swapper.files(), host_rss=_rss())

    # ------------------------------------------------------------------------- checkpoints
    def _io(self) -> Any:
        return self._swap_engine("checkpoint")

    def _shard_param_values(self, sh: FlatShard) -> torch.Tensor:
        buf = aligned_empty(sh.numel, sh.dtype)
        self.param_swapper.read(sh.home, buf).wait()
        return buf

    def save_checkpoint(self, save_dir: str, tag: Optional[str] = None,
                        client_state: Optional[dict] = None) -> str:
        """Writes the full training state (NVMe-resident tensors included) to ``save_dir/tag``:
        written under a temporary name, fsynced, then renamed; ``save_dir/latest`` names it."""
        return checkpoint.save(self, save_dir, tag, client_state)

    def load_checkpoint(self, load_dir: str, tag: Optional[str] = None) -> tuple[str, dict]:
        """Restores a state written by ``save_checkpoint``; returns (path, client_state)."""
        return checkpoint.load(self, load_dir, tag)

    def _trained_values(self, sh: FlatShard) -> torch.Tensor:
        self._check_no_overlap("reading the trained values")
        st = self.optimizer.state_of(sh)
        if st is None:
            return self._shard_param_values(sh)
        out = torch.empty(sh.numel, dtype=torch.float32)
        self.optimizer.master_values(sh, out)  # the fp32 master, in whatever format the state is kept
        return out

    def export(self, out_dir: str) -> list[str]:
        """Writes the trained weights as a consolidated safetensors state dict loadable by the
        plain model (``load_state_dict``; ``from_pretrained`` for a transformers model, whose
        config.json is written too). Values come from the fp32 masters, cast to each
        parameter's original dtype. Returns the files written (``pyinfinity.export``)."""
        from pyinfinity import export

        return export.write(self, out_dir)

    # ------------------------------------------------------------------------- life
    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("Engine: used after close()")

    def _check_no_overlap(self, what: str) -> None:
        """Before reading the whole training state: no boundary backward may be waiting for its
        step(), and the optimizer's worker must have written everything home."""
        if self._pending_backward or self.optimizer.overlap_open:
            raise RuntimeError(f"{what}: called between the boundary backward() and step() (the parameter homes "
                               "hold gradients, part of the model may already be stepped); call step() first")
        self._drain(what)
        self.optimizer.sync_homes(self._homes.write_home)  # units stepped on the device: their homes

    @staticmethod
    def _cleanup(param_swapper: TensorSwapper, optim_swapper: TensorSwapper, engines: dict,
                 ownership: Any = None, held: Optional[list] = None) -> None:
        for obj in reversed(held or []):  # the coordinator's hooks off the model, the optimizer's worker stopped
            try:
                obj.close()
            except Exception as exc:  # noqa: BLE001 - best effort: the swap files still go
                log.warning("closing %s: %r", type(obj).__name__, exc)
        for sw in (param_swapper, optim_swapper):
            try:
                sw.close()
            except Exception as exc:  # noqa: BLE001 - best effort at exit
                log.warning("closing %s swap: %s", sw.name, exc)
        for e in engines.values():
            try:
                e.close()
            except Exception as exc:  # noqa: BLE001
                log.warning("closing swap engine: %s", exc)
        if ownership is not None:
            ownership.release()  # manifest and lock (after the swap files)

    def close(self) -> None:
        """Removes the hooks, frees device/pinned memory and removes the swap files. Idempotent."""
        if self._closed and not hasattr(self, "_finalizer"):
            return
        self._closed = True
        plan, history = self.__dict__.get("plan"), self.__dict__.get("history")
        if plan is not None and history:
            micro = max(1, self.gradient_accumulation_steps)
            tokens = history[-1].tokens // micro if history[-1].tokens else None
            log.info("%s", plan.compare([r.seconds for r in history], tokens_per_micro_batch=tokens,
                                        parts=_measured_parts(list(history))))
        coord = self.__dict__.get("coordinator")
        if coord is not None:
            try:
                coord.close()
            except Exception as exc:  # noqa: BLE001 - e.g. a failed read left a shard in flight:
                log.warning("closing the parameter coordinator: %r", exc)  # the swap files still go
        try:
            self.optimizer.close()  # stops the background step thread first
        except Exception as exc:  # noqa: BLE001 - the swap files still go
            log.warning("closing the optimizer: %r", exc)
        fin = self.__dict__.pop("_finalizer", None)
        if fin is not None:
            atexit.unregister(fin)
            fin()
        if self.__dict__.get("_capped"):  # the cap was this engine's: later work in the process is not capped
            self._capped = False
            torch.cuda.set_per_process_memory_fraction(1.0, self.device)

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def _inputs_to(x: Any, device: torch.device) -> Any:
    """``x`` with every tensor in it (through plain lists, tuples and dicts) on ``device``."""
    if isinstance(x, torch.Tensor):
        return x if x.device == device else x.to(device)
    if type(x) in (list, tuple):
        return type(x)(_inputs_to(v, device) for v in x)
    if type(x) is dict:
        return {k: _inputs_to(v, device) for k, v in x.items()}
    return x


def _measured_parts(history: list) -> dict[str, float]:
    """Medians over the steady steps (after the first two) of what the prediction's terms stand
    for: the optimizer's busy time (all threads), its visible wait in step(), the waits of forward
    and backward for the optimizer's new values."""
    steady = history[2:] or history

    def med(xs: list) -> float:
        xs = sorted(xs)
        return xs[len(xs) // 2] if xs else 0.0
    return {"optimizer busy": med([r.optimizer_busy_seconds for r in steady]),
            "optimizer in step()": med([r.optimizer_seconds for r in steady]),
            "waits for new values": med([r.step_wait_seconds for r in steady])}


def retry_micro_batch(fn: Any) -> Any:
    """Runs ``fn()`` (one micro-batch's forward and backward) and, if it raises
    DeviceBudgetExceeded (the engine has given up its device placement), runs it once more."""
    try:
        return fn()
    except DeviceBudgetExceeded as exc:
        log.warning("retrying the micro-batch once: %s", exc.gave_up or exc)
    # outside the except block: the failed attempt's frames (and its activations) are freed first
    return fn()


def _count_tokens(args: tuple, kwargs: dict) -> int:
    t = kwargs.get("input_ids")
    if t is None:
        for a in args:
            if isinstance(a, torch.Tensor):
                t = a
                break
    return int(t.numel()) if isinstance(t, torch.Tensor) else 0
