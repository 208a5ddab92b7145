"""The training configuration: DeepSpeed's JSON format (the subset that applies to one process with
ZeRO stage 3 offload) parsed into dataclasses and validated, with errors that name the key.

``load_config(dict | path)`` parses and validates; ``"auto"`` stays a marker (``AUTO``) until the
planner (``pyinfinity.plan.resolve_auto``) decides it, with the two rules the planner and the
engine share here (``default_optimizer_threads``, ``overlap_step_blocker``). The values below the
config (``AUTO``, ``ConfigError``, sizes, the optimizer state's formats) are in ``config_values``.

Each section's dataclass, its parser and its checks read side by side, and a key is added in one
place.
"""
from __future__ import annotations

import difflib
import errno
import json
import logging
import math
import os
import re
from dataclasses import dataclass, field, fields, replace
from typing import Any, Optional, Union

from pyinfinity.config_values import (AUTO, MIN_QUANTIZED_NUMEL, OPTIMIZER_STATES, QUANT_BLOCK, STATE_FORMATS,
                                      ConfigError, StateFormat, device_budget, format_size, parse_size)

log = logging.getLogger(__name__)


def default_optimizer_threads(device: str) -> int:
    """``pyinfinity.optimizer_threads`` "auto": 1 on the CPU device (backward has the cores), else
    every CPU this process may run on."""
    if str(device).startswith("cpu"):
        return 1
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def optimizer_threads(value: Any, device: str) -> int:
    """The threads the optimizer's CPU step runs on: ``pyinfinity.optimizer_threads`` as set, or
    "auto" decided for ``device`` (the engine's and the rate probe's figure)."""
    return int(value) if value != AUTO else default_optimizer_threads(device)


def overlap_step_blocker(c: "Config") -> Optional[str]:
    """Why the optimizer cannot step in the background under ``c`` (None: it can). Clipping and
    fp16 loss scaling are no reason: the step then waits for the global norm after backward and
    overlaps the next forward instead."""
    if c.pyinfinity.optimizer_step_device == "device":
        return ("optimizer_step_device \"device\" steps on the compute device, which a background thread "
                "would share with backward")
    return None


def auto_overlap_off(cuda: bool, optimizer_on_disk: bool, on_cpu: bool = False) -> Optional[str]:
    """Why ``pyinfinity.overlap_step`` "auto" leaves the background step off where nothing blocks it
    (``overlap_step_blocker``), or None (on): it is on with a GPU, and on the CPU device only when
    part of the optimizer state is on disk (the step then mostly waits for the disk; with the state
    in RAM backward would compete with it for the same cores) or ``on_cpu`` asks for it."""
    if cuda or optimizer_on_disk or on_cpu:
        return None
    return ("the compute device is the CPU and the optimizer state is in RAM: backward would compete with "
            "the background step for the same cores")

SizeOrAuto = Union[int, str]

# DeepSpeed keys that mean something to DeepSpeed but nothing here: accepted, warned about once.
IGNORED_TOP = {
    "wall_clock_breakdown", "dump_state", "prescale_gradients",
    "gradient_predivide_factor", "sparse_gradients", "memory_breakdown", "flops_profiler",
    "tensorboard", "wandb", "csv_monitor", "comms_logger", "communication_data_type",
    "zero_allow_untested_optimizer", "zero_force_ds_cpu_optimizer", "amp", "autotuning",
    "elasticity", "checkpoint", "data_types", "activation_checkpointing", "seed",
    "compression_training", "data_efficiency", "curriculum_learning", "eigenvalue",
    "progressive_layer_drop", "pipeline", "sparse_attention", "aio_config", "weight_quantization",
    "train_micro_batch_size", "torch_autocast", "disable_allgather", "use_data_before_expert_parallelism",
}
IGNORED_ZERO = {
    "contiguous_gradients", "overlap_comm", "reduce_scatter", "reduce_bucket_size",
    "allgather_partitions", "allgather_bucket_size", "round_robin_gradients", "sub_group_size",
    "stage3_max_reuse_distance", "stage3_gather_16bit_weights_on_model_save",
    "gather_16bit_weights_on_model_save", "elastic_checkpoint", "load_from_fp32_weights",
    "ignore_unused_parameters", "legacy_stage1", "cpu_offload", "cpu_offload_params",
    "cpu_offload_use_pin_memory", "zero_hpz_partition_size", "zero_quantized_weights",
    "zero_quantized_gradients", "mics_shard_size", "mics_hierarchical_params_gather",
    "memory_efficient_linear", "pipeline_loading_checkpoint", "override_module_apply",
    "use_multi_rank_bucket_allreduce", "module_granularity_threshold", "log_trace_cache_warnings",
    "stage3_use_all_reduce_for_fetch_params", "stage3_module_granularity_threshold",
}
IGNORED_FP16 = {"auto_cast", "consecutive_hysteresis", "fp16_master_weights_and_grads"}
IGNORED_AIO = {"single_submit", "overlap_events", "use_gds"}


_said: dict[str, bool] = {}  # notes logged once per process



# ----------------------------------------------------------------------------- sections


@dataclass
class OptimizerConfig:
    """``optimizer``: Adam (DeepSpeed's ``adam_w_mode`` default true = AdamW) or AdamW."""

    type: str = "AdamW"
    lr: float = 1e-3
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.0
    adam_w_mode: bool = True
    amsgrad: bool = False


@dataclass
class SchedulerConfig:
    """``scheduler``: DeepSpeed's WarmupLR, WarmupDecayLR or WarmupCosineLR and their params."""

    type: str
    params: dict[str, Any] = field(default_factory=dict)


@dataclass
class OffloadParamConfig:
    """``zero_optimization.offload_param``: where parameter shards live between uses.

    max_in_cpu: with device nvme, the first this-many elements stay in pinned RAM. The default is
    0 (DeepSpeed's is 1e9) so that "nvme" means the parameters are on NVMe.
    buffer_count: with device nvme, how many shard reads may be in flight ahead of use.
    buffer_size: accepted so DeepSpeed configs load, and has no effect: pyinfinity has no
    fixed-size swap buffers (DeepSpeed's "Not enough buffers" cannot happen); each shard is read
    into a buffer of its own size, within ``pyinfinity.device_memory`` (logged at INFO when set).
    """

    device: str = "cpu"  # none | cpu | nvme | auto ("none" = resident on the compute device)
    nvme_path: Optional[list[str]] = None
    pin_memory: bool = True
    buffer_count: SizeOrAuto = 5
    buffer_size: SizeOrAuto = 100_000_000
    max_in_cpu: SizeOrAuto = 0  # elements kept in RAM when device is nvme (DeepSpeed: 1e9)


@dataclass
class OffloadOptimizerConfig:
    """``zero_optimization.offload_optimizer``: where fp32 master weights and Adam moments live.

    ``ratio`` is the fraction of the optimizer state kept on NVMe when device is nvme (the rest
    in RAM), as in DeepSpeed's "partial offload"; 1.0 = all on NVMe.
    """

    device: str = "cpu"  # cpu | nvme | auto
    nvme_path: Optional[list[str]] = None
    pin_memory: bool = True
    pipeline_read: bool = True
    pipeline_write: bool = True
    ratio: float = 1.0
    buffer_count: int = 4
    fast_init: bool = False


@dataclass
class ZeroConfig:
    """``zero_optimization``."""

    stage: int = 3
    offload_param: OffloadParamConfig = field(default_factory=OffloadParamConfig)
    offload_optimizer: OffloadOptimizerConfig = field(default_factory=OffloadOptimizerConfig)
    stage3_prefetch_bucket_size: SizeOrAuto = 50_000_000  # DeepSpeed's default; "auto": the planner's
    # absent = "auto" (the plan's cap, or the device budget's elements): DeepSpeed's 1e9 would stop
    # every prefetch of a 30B model's 535M-element decoder layers; a value given, 1e9 included, is kept
    stage3_max_live_parameters: SizeOrAuto = AUTO
    stage3_param_persistence_threshold: SizeOrAuto = 100_000


@dataclass
class AioConfig:
    """``aio``: knobs of the NVMe swap engine (DeepSpeed's names)."""

    block_size: int = 1 << 20
    queue_depth: int = 32
    thread_count: int = 1
    backend: str = "auto"  # auto | aio | uring | posix (pyinfinity extension)
    intra_op_parallelism: int = 1


@dataclass
class FP16Config:
    """``fp16``: half-precision compute with dynamic loss scaling (loss_scale 0 = dynamic)."""

    enabled: bool = False
    loss_scale: float = 0.0
    initial_scale_power: int = 16
    loss_scale_window: int = 1000
    hysteresis: int = 2
    min_loss_scale: float = 1.0


@dataclass
class BF16Config:
    """``bf16``: bfloat16 compute, fp32 master weights; DeepSpeed's two keys for a bf16 state.

    bf16_master_weights_and_grads: the master weights are the bf16 weights themselves (no fp32
    copy) and the gradients stay bf16. bf16_optimizer_states: Adam's moments in bf16 too (DeepSpeed
    allows it only with bf16_master_weights_and_grads). pyinfinity supports the two together, the
    ``"bf16"`` optimizer state (6 bytes a parameter with the weights): see :data:`STATE_FORMATS`.
    """

    enabled: bool = False
    bf16_master_weights_and_grads: bool = False
    bf16_optimizer_states: bool = False


@dataclass
class EngineConfig:
    """``pyinfinity``: what DeepSpeed's format has no key for.

    device: compute device ("auto" = cuda when present, else cpu; cuda = cuda:$LOCAL_RANK under
    torchrun, else the current device: pyinfinity.device.resolve_device). device_memory: the budget the
    engine keeps resident parameters, buffers and prefetch within ("auto" = heuristic, None = no
    cap); on a GPU it caps torch's allocator for the process at what the process held when the
    engine was made plus this budget. host_memory: RAM the engine may use for offloaded state ("auto" = 80% of available).
    prefetch: trace-driven prefetch on/off. Swap files are always removed on close (and a crashed
    run's on the next start: swap/ownership.py).
    checksums: a CRC-32C of every 64 KiB written to the swap files (computed in the I/O thread),
    verified on every read: a changed byte raises OSError(EBADMSG) naming file, offset and slot
    instead of being trained on (cost: RELIABILITY.md).
    overlap_step: step the optimizer in a background thread (``zero.optim.worker``): without clipping
    or fp16 loss scaling each unit as soon as its gradient is complete in the boundary backward,
    with them each unit after backward (the global norm known) while the next forward runs, that
    forward waiting for each unit's new values. Exact in every case. "auto" = on, except with
    ``optimizer_step_device: device`` (an error with true) and on a CPU compute device with the
    optimizer state in RAM (backward would compete for the cores).
    resident_bytes: parameter bytes kept on the compute device between steps (whole units, the
    last ones in the model first; "auto" = as many as the device budget leaves after
    activations, a working set and prefetch; 0 = none).
    unit_bytes: the largest block of modules moved as one unit ("auto" = pyinfinity.units'
    rule; 0 = one unit per module).
    device_optimizer_bytes: device memory for the fp32 master and Adam moments (12 bytes a
    parameter) of resident units, which then step on the device as their gradients are final
    (no gradient leaves the device, no CPU time); whole units from the front of the model (their
    gradients come last in backward). Their host homes are brought up to date before a
    checkpoint or an export. "auto" = what the device budget leaves after the resident units,
    activations and headroom (on a GPU; 0 on the CPU device); 0 = none.
    device_accumulator_bytes: under gradient accumulation, device memory for the fp32 gradient
    accumulators (4 bytes a parameter) of units stepped on the CPU: their micro-batch gradients
    are added on the device and leave it once per optimizer step (in fp32, into a pinned host
    buffer), instead of every micro-batch (then added on the host); whole units from the front of
    the model. The sums are bit for bit the host's. "auto" = with accumulation on a GPU, the
    device room left after the resident units, activations and headroom goes to these first
    (then to device_optimizer_bytes); 0 on the CPU device and without accumulation.
    optimizer_threads: threads of the CPU Adam step when the background worker runs it, and of the
    gradient adds under accumulation ("auto" = every CPU this process may run on with a GPU
    compute device, 1 on the CPU device, where backward has the cores).
    optimizer_state: "fp32" (exact, 12 bytes a parameter of master and moments) or "8bit" (the fp32
    master, Adam's moments block-wise quantised to a byte each: 6.03 bytes; docs/optimizer_state.md).
    checkpoint_keep_last: ``save_checkpoint``'s default ``keep_last``: once a new checkpoint is
    durable, the oldest complete checkpoints of its directory are removed until this many remain
    (Trainer's ``save_total_limit``); None keeps every one.
    checkpoint_staging: host RAM a save may hold in shard copies taken and not yet written (at
    least one shard's: a copy larger than the budget goes alone), charged in the layout's host RAM
    beside the training state: one buffer, kept by the engine from one save to the next. A
    background save needs to hold what is not yet written when a shard is next updated: it
    stages beyond this budget, up to the whole checkpoint, what the host has free at the save
    (MemAvailable less 2 GiB). "auto" = 0: a run that never saves in the background pays nothing;
    `pyinfinity train --save-every` sets 1 GiB unless ``--blocking-saves``.
    A bf16 master with bf16 moments is DeepSpeed's ``bf16.bf16_master_weights_and_grads`` +
    ``bf16.bf16_optimizer_states``.
    """

    device: str = AUTO
    device_memory: Optional[SizeOrAuto] = AUTO
    host_memory: SizeOrAuto = AUTO
    prefetch: bool = True
    optimizer_step_device: str = "cpu"  # cpu | device (states streamed to the compute device)
    log_every: Optional[int] = None  # the step line's interval; None: the top-level steps_per_print
    checksums: bool = False
    overlap_step: Union[bool, str] = AUTO  # True | False | "auto"
    resident_bytes: SizeOrAuto = AUTO
    unit_bytes: SizeOrAuto = AUTO
    device_optimizer_bytes: SizeOrAuto = AUTO
    device_accumulator_bytes: SizeOrAuto = AUTO
    optimizer_threads: Union[int, str] = AUTO
    optimizer_state: str = "fp32"  # fp32 | 8bit
    checkpoint_keep_last: Optional[int] = None  # save_checkpoint keeps this many in its directory; None: all
    checkpoint_staging: SizeOrAuto = AUTO  # bytes of a save's shard copies not yet written; "auto": 0


@dataclass
class Config:
    """A validated training configuration (one process, ZeRO stage 3 with offload)."""

    train_batch_size: Optional[int] = None
    train_micro_batch_size_per_gpu: int = 1
    gradient_accumulation_steps: int = 1
    gradient_clipping: float = 0.0
    steps_per_print: int = 10  # a step line every this many optimizer steps (DeepSpeed's key and default)
    fp16: FP16Config = field(default_factory=FP16Config)
    bf16: BF16Config = field(default_factory=BF16Config)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    scheduler: Optional[SchedulerConfig] = None
    zero_optimization: ZeroConfig = field(default_factory=ZeroConfig)
    aio: AioConfig = field(default_factory=AioConfig)
    pyinfinity: EngineConfig = field(default_factory=EngineConfig)

    @property
    def optimizer_state_format(self) -> str:
        """The optimizer state's format (a key of :data:`STATE_FORMATS`): "bf16" under DeepSpeed's
        bf16 master and moments, else ``pyinfinity.optimizer_state``."""
        if self.bf16.bf16_master_weights_and_grads:
            return "bf16"
        return self.pyinfinity.optimizer_state

    @property
    def checkpoint_staging_bytes(self) -> int:
        """``pyinfinity.checkpoint_staging`` in bytes ("auto": 0, see :class:`EngineConfig`)."""
        v = self.pyinfinity.checkpoint_staging
        return 0 if v == AUTO else int(v)

    @property
    def nvme_paths(self) -> list[str]:
        """Every swap directory named in the config (parameters and optimizer may share)."""
        out: list[str] = []
        z = self.zero_optimization
        for paths, dev in ((z.offload_param.nvme_path, z.offload_param.device),
                           (z.offload_optimizer.nvme_path, z.offload_optimizer.device)):
            if dev in ("nvme", AUTO) and paths:
                out += [p for p in paths if p not in out]
        return out

    def to_dict(self) -> dict[str, Any]:
        """The config in DeepSpeed's JSON layout (``pyinfinity`` section included)."""
        def conv(obj: Any) -> Any:
            if hasattr(obj, "__dataclass_fields__"):
                return {f.name: conv(getattr(obj, f.name)) for f in fields(obj)}
            if isinstance(obj, tuple):
                return list(obj)
            return obj
        d = conv(self)
        opt = d.pop("optimizer")
        d["optimizer"] = {"type": opt.pop("type"), "params": opt}
        if d["scheduler"] is None:
            d.pop("scheduler")
        return d


# ----------------------------------------------------------------------------- parsing


# The keys that decide where each shard's state lives, where it is stepped and how the model is cut
# into units (the planner decides those left "auto"): what a checkpoint records of the run that saved
# it (``placement_values``) and what ``pyinfinity train --resume`` keeps, so that a resumed run steps
# every shard where the saved run did (planned anew on rates measured again, a shard stepped on the
# CPU could step on the device, in another kernel's rounding, and the run would not continue bit
# for bit).
PLACEMENT_KEYS = (
    "zero_optimization.offload_param.device", "zero_optimization.offload_param.max_in_cpu",
    "zero_optimization.offload_param.buffer_count", "zero_optimization.offload_param.buffer_size",
    "zero_optimization.offload_optimizer.device", "zero_optimization.offload_optimizer.ratio",
    "zero_optimization.offload_optimizer.buffer_count", "zero_optimization.stage3_prefetch_bucket_size",
    "zero_optimization.stage3_max_live_parameters", "zero_optimization.stage3_param_persistence_threshold",
    "pyinfinity.prefetch", "pyinfinity.optimizer_step_device", "pyinfinity.resident_bytes",
    "pyinfinity.device_optimizer_bytes", "pyinfinity.device_accumulator_bytes", "pyinfinity.unit_bytes",
    "pyinfinity.overlap_step",
)


def placement_values(c: "Config") -> dict[str, Any]:
    """The values of :data:`PLACEMENT_KEYS` in a resolved config, by dotted key."""
    out = {}
    for key in PLACEMENT_KEYS:
        obj: Any = c
        for part in key.split("."):
            obj = getattr(obj, part)
        out[key] = obj
    return out


def _suggest(key: str, valid: list[str]) -> str:
    close = difflib.get_close_matches(key, valid, n=1, cutoff=0.5)
    return f"; did you mean {close[0]!r}?" if close else f"; valid keys: {', '.join(sorted(valid))}"


_warned: set[str] = set()


def _check_keys(d: dict, valid: list[str], ignored: set[str], where: str) -> None:
    if not isinstance(d, dict):
        raise ConfigError(f"{where or 'config'}: expected an object, got {type(d).__name__}")
    for key in d:
        if key in valid:
            continue
        path = f"{where}.{key}" if where else key
        if key in ignored:
            if path not in _warned:
                _warned.add(path)
                log.warning("config key %r is a DeepSpeed option that does not apply here; ignored", path)
            continue
        raise ConfigError(f"unknown config key {path!r}{_suggest(key, valid)}")


def _bool(v: Any, key: str) -> bool:
    if isinstance(v, bool):
        return v
    raise ConfigError(f"{key}: expected true or false, got {v!r}")


def _int(v: Any, key: str, lo: int = 0, allow_auto: bool = False) -> Any:
    if allow_auto and v == AUTO:
        return AUTO
    if isinstance(v, bool):
        raise ConfigError(f"{key}: expected an integer, got {v!r}")
    if isinstance(v, str):
        v = parse_size(v, key)
    if isinstance(v, float):
        if not v.is_integer():
            raise ConfigError(f"{key}: expected an integer, got {v!r}")
        v = int(v)
    if not isinstance(v, int):
        alt = ' or "auto"' if allow_auto else ""
        raise ConfigError(f"{key}: expected an integer{alt}, got {v!r}")
    if v < lo:
        raise ConfigError(f"{key}: must be >= {lo}, got {v}")
    return v


def _float(v: Any, key: str, lo: float = 0.0, hi: float = math.inf) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise ConfigError(f"{key}: expected a number, got {v!r}")
    if not (lo <= v <= hi) or not math.isfinite(v):
        raise ConfigError(f"{key}: must be in [{lo}, {hi}], got {v}")
    return float(v)


def _choice(v: Any, key: str, choices: tuple[str, ...]) -> str:
    if not isinstance(v, str) or v.lower() not in choices:
        raise ConfigError(f"{key}: expected one of {', '.join(choices)}, got {v!r}")
    return v.lower()


def _paths(v: Any, key: str) -> Optional[list[str]]:
    if v is None:
        return None
    if isinstance(v, str):
        v = [v]
    if not isinstance(v, list) or not v or not all(isinstance(p, str) and p for p in v):
        raise ConfigError(f"{key}: expected a directory or a non-empty list of directories, got {v!r}")
    # one directory reached twice (through a symlink, or "d" and "d/") is one swap directory
    return list(dict.fromkeys(os.path.realpath(os.path.expanduser(p)) for p in v))


def _names(cls: type) -> list[str]:
    return [f.name for f in fields(cls)]


def _parse_optimizer(d: dict) -> OptimizerConfig:
    _check_keys(d, ["type", "params"], set(), "optimizer")
    typ = d.get("type", "AdamW")
    names = {"adam": "Adam", "adamw": "AdamW"}
    if not isinstance(typ, str) or typ.lower() not in names:
        extra = _suggest(str(typ), list(names.values())) if isinstance(typ, str) else ""
        raise ConfigError(f"optimizer.type: {typ!r} is not supported (Adam, AdamW){extra}")
    typ = names[typ.lower()]
    p = d.get("params", {}) or {}
    valid = ["lr", "betas", "eps", "weight_decay", "adam_w_mode", "amsgrad", "bias_correction", "torch_adam"]
    _check_keys(p, valid, {"bias_correction", "torch_adam", "fused"}, "optimizer.params")
    o = OptimizerConfig(type=typ)
    if "lr" in p:
        o.lr = _float(p["lr"], "optimizer.params.lr")
    if "betas" in p:
        b = p["betas"]
        if not (isinstance(b, (list, tuple)) and len(b) == 2):
            raise ConfigError(f"optimizer.params.betas: expected [beta1, beta2], got {b!r}")
        o.betas = (_float(b[0], "optimizer.params.betas[0]", 0, 1 - 1e-12),
                   _float(b[1], "optimizer.params.betas[1]", 0, 1 - 1e-12))
    if "eps" in p:
        o.eps = _float(p["eps"], "optimizer.params.eps")
    if "weight_decay" in p:
        o.weight_decay = _float(p["weight_decay"], "optimizer.params.weight_decay")
    if "adam_w_mode" in p:
        o.adam_w_mode = _bool(p["adam_w_mode"], "optimizer.params.adam_w_mode")
    if "amsgrad" in p:
        o.amsgrad = _bool(p["amsgrad"], "optimizer.params.amsgrad")
        if o.amsgrad:
            raise ConfigError("optimizer.params.amsgrad: true is not supported by the offloaded optimizer")
    if typ == "AdamW":
        o.adam_w_mode = True
    return o


SCHEDULER_PARAMS = {
    "WarmupLR": {"warmup_min_lr": 0.0, "warmup_max_lr": 0.001, "warmup_num_steps": 1000,
                 "warmup_type": "log"},
    "WarmupDecayLR": {"total_num_steps": None, "warmup_min_lr": 0.0, "warmup_max_lr": 0.001,
                      "warmup_num_steps": 1000, "warmup_type": "log"},
    "WarmupCosineLR": {"total_num_steps": None, "warmup_min_ratio": 0.0, "warmup_num_steps": 1000,
                       "cos_min_ratio": 0.0001, "warmup_type": "log"},
    # pyinfinity's own (``pyinfinity train``'s): the first optimizer step's lr is peak / warmup_num_steps
    "LinearWarmupCosineLR": {"total_num_steps": None, "warmup_num_steps": 0, "cos_min_ratio": 0.0001},
}


def parse_scheduler(d: dict) -> SchedulerConfig:
    """A config's ``scheduler`` section, validated (``ConfigError`` naming the key)."""
    _check_keys(d, ["type", "params"], set(), "scheduler")
    typ = d.get("type")
    if typ not in SCHEDULER_PARAMS:
        extra = _suggest(str(typ), list(SCHEDULER_PARAMS)) if isinstance(typ, str) else ""
        raise ConfigError(f"scheduler.type: {typ!r} is not supported "
                          f"({', '.join(SCHEDULER_PARAMS)}){extra}")
    spec = SCHEDULER_PARAMS[typ]
    p = d.get("params", {}) or {}
    _check_keys(p, list(spec), {"last_batch_iteration"}, "scheduler.params")
    out = {k: v for k, v in spec.items()}
    for k, v in p.items():
        if k not in spec:
            continue
        key = f"scheduler.params.{k}"
        if k == "warmup_type":
            out[k] = _choice(v, key, ("log", "linear"))
        elif k in ("warmup_num_steps", "total_num_steps"):
            out[k] = _int(v, key, lo=0)
        else:
            out[k] = _float(v, key)
    if "total_num_steps" in out and out["total_num_steps"] is None:
        raise ConfigError(f"scheduler.params.total_num_steps: required by {typ}")
    if "total_num_steps" in out and out["total_num_steps"] < out["warmup_num_steps"]:
        raise ConfigError("scheduler.params.total_num_steps: must be >= warmup_num_steps "
                          f"({out['total_num_steps']} < {out['warmup_num_steps']})")
    return SchedulerConfig(type=typ, params=out)


def _parse_offload_device(v: Any, key: str, allow_none: bool) -> str:
    choices = ("none", "cpu", "nvme", AUTO) if allow_none else ("none", "cpu", "nvme", AUTO)
    dev = _choice(v if v is not None else "none", key, choices)
    return dev


def _parse_zero(d: dict) -> ZeroConfig:
    valid = _names(ZeroConfig)
    _check_keys(d, valid, IGNORED_ZERO, "zero_optimization")
    z = ZeroConfig()
    if "stage" in d:
        z.stage = _int(d["stage"], "zero_optimization.stage")
        if z.stage > 3:
            raise ConfigError(f"zero_optimization.stage: must be 0..3, got {z.stage}")
    op = d.get("offload_param")
    if op is not None:
        _check_keys(op, _names(OffloadParamConfig), {"fast_init"}, "zero_optimization.offload_param")
        w = "zero_optimization.offload_param"
        z.offload_param = OffloadParamConfig(
            device=_parse_offload_device(op.get("device", "cpu"), f"{w}.device", True),
            nvme_path=_paths(op.get("nvme_path"), f"{w}.nvme_path"),
            pin_memory=_bool(op.get("pin_memory", True), f"{w}.pin_memory"),
            buffer_count=_int(op.get("buffer_count", 5), f"{w}.buffer_count", 1, True),
            buffer_size=_int(op.get("buffer_size", 100_000_000), f"{w}.buffer_size", 1, True),
            max_in_cpu=_int(op.get("max_in_cpu", 0), f"{w}.max_in_cpu", 0, True),
        )
        if "buffer_size" in op and not _said.get("buffer_size"):
            _said["buffer_size"] = True  # once per process: plan and the engine load configs several times
            log.info("%s.buffer_size: accepted for DeepSpeed compatibility and not used (shards are read "
                     "into buffers of their own size, within pyinfinity.device_memory)", w)
    oo = d.get("offload_optimizer")
    if oo is not None:
        w = "zero_optimization.offload_optimizer"
        _check_keys(oo, _names(OffloadOptimizerConfig), set(), w)
        dev = _parse_offload_device(oo.get("device", "cpu"), f"{w}.device", False)
        if dev == "none":
            dev = "cpu"  # the optimizer always steps off the device's resident memory
        z.offload_optimizer = OffloadOptimizerConfig(
            device=dev,
            nvme_path=_paths(oo.get("nvme_path"), f"{w}.nvme_path"),
            pin_memory=_bool(oo.get("pin_memory", True), f"{w}.pin_memory"),
            pipeline_read=_bool(oo.get("pipeline_read", True), f"{w}.pipeline_read"),
            pipeline_write=_bool(oo.get("pipeline_write", True), f"{w}.pipeline_write"),
            ratio=_float(oo.get("ratio", 1.0), f"{w}.ratio", 0.0, 1.0),
            buffer_count=_int(oo.get("buffer_count", 4), f"{w}.buffer_count", 2),
            fast_init=_bool(oo.get("fast_init", False), f"{w}.fast_init"),
        )
    for k in ("stage3_prefetch_bucket_size", "stage3_max_live_parameters",
              "stage3_param_persistence_threshold"):
        if k in d:
            setattr(z, k, _int(d[k], f"zero_optimization.{k}", 0, True))
    return z


def _check_bf16_state(b: BF16Config, key: str) -> None:
    """DeepSpeed's constraints on its bf16 state keys, and the combination pyinfinity lacks."""
    if b.bf16_optimizer_states and not b.bf16_master_weights_and_grads:
        raise ConfigError(f"{key}.bf16_optimizer_states: requires {key}.bf16_master_weights_and_grads (as in "
                          "DeepSpeed: the moments are kept in the master's precision)")
    if b.bf16_master_weights_and_grads and not b.enabled:
        raise ConfigError(f"{key}.bf16_master_weights_and_grads: requires {key}.enabled (the bf16 weights are "
                          "the master)")
    if b.bf16_master_weights_and_grads and not b.bf16_optimizer_states:
        raise ConfigError(f"{key}.bf16_master_weights_and_grads without {key}.bf16_optimizer_states (a bf16 "
                          "master with fp32 moments) is not supported: set bf16_optimizer_states too (bf16 "
                          "moments, 6 bytes a parameter) or use pyinfinity.optimizer_state \"8bit\" (an fp32 "
                          "master, 8 bytes)")


def _parse_engine(d: dict) -> EngineConfig:
    _check_keys(d, _names(EngineConfig), set(), "pyinfinity")
    e = EngineConfig()
    if "device" in d:
        dev = d["device"]
        if not isinstance(dev, str) or not re.fullmatch(r"auto|cpu|cuda(:\d+)?", dev):
            raise ConfigError(f"pyinfinity.device: expected cpu, cuda, cuda:N or auto, got {dev!r}")
        e.device = dev
    if "device_memory" in d:
        v = d["device_memory"]
        # "auto" (the default: planned from the device's free memory) or "none"/null (the whole
        # device, the same budget) or a size
        e.device_memory = AUTO if v == AUTO else device_budget(v, "pyinfinity.device_memory")
    if "host_memory" in d:
        v = d["host_memory"]
        e.host_memory = AUTO if v == AUTO else parse_size(v, "pyinfinity.host_memory")
    if "prefetch" in d:
        e.prefetch = _bool(d["prefetch"], "pyinfinity.prefetch")
    if "optimizer_step_device" in d:
        e.optimizer_step_device = _choice(d["optimizer_step_device"], "pyinfinity.optimizer_step_device",
                                          ("cpu", "device"))

    if "optimizer_threads" in d:
        v = d["optimizer_threads"]
        e.optimizer_threads = AUTO if v == AUTO else _int(v, "pyinfinity.optimizer_threads", 1)
    if d.get("log_every") is not None:
        e.log_every = _int(d["log_every"], "pyinfinity.log_every", 1)
    if "checksums" in d:
        e.checksums = _bool(d["checksums"], "pyinfinity.checksums")
    if d.get("checkpoint_keep_last") is not None:
        e.checkpoint_keep_last = _int(d["checkpoint_keep_last"], "pyinfinity.checkpoint_keep_last", 1)
    for key in ("resident_bytes", "unit_bytes", "device_optimizer_bytes", "device_accumulator_bytes",
                "checkpoint_staging"):
        if key in d:
            v = d[key]
            setattr(e, key, AUTO if v == AUTO else parse_size(v, f"pyinfinity.{key}"))
    if "overlap_step" in d:
        v = d["overlap_step"]
        if v != AUTO and not isinstance(v, bool):
            raise ConfigError(f"pyinfinity.overlap_step: expected true, false or \"auto\", got {v!r}")
        e.overlap_step = v
    if "optimizer_state" in d:
        v = d["optimizer_state"]
        if isinstance(v, str) and v.lower() == "bf16":
            raise ConfigError("pyinfinity.optimizer_state: a bf16 state is DeepSpeed's \"bf16\": "
                              "{\"enabled\": true, \"bf16_master_weights_and_grads\": true, "
                              "\"bf16_optimizer_states\": true}")
        e.optimizer_state = _choice(v, "pyinfinity.optimizer_state", OPTIMIZER_STATES)
    return e


def load_config(config: Union[dict, str, os.PathLike, Config]) -> Config:
    """Parse and validate a DeepSpeed-format config (a dict or a JSON file path).

    Raises ConfigError naming the key for unknown keys (with the nearest valid one), wrong types,
    impossible values, stage != 3 with offload, and missing or unusable ``nvme_path``.
    """
    if isinstance(config, Config):
        return config
    if isinstance(config, (str, os.PathLike)):
        try:
            with open(config) as f:
                config = json.load(f)
        except OSError as exc:
            raise ConfigError(f"cannot read config file {os.fspath(config)!r}: {exc.strerror}") from exc
        except json.JSONDecodeError as exc:
            raise ConfigError(f"config file is not valid JSON: {exc}") from exc
    if not isinstance(config, dict):
        raise ConfigError(f"config: expected a dict or a path to a JSON file, got {type(config).__name__}")
    d = config
    _check_keys(d, _names(Config), IGNORED_TOP, "")
    c = Config()
    if "train_batch_size" in d and d["train_batch_size"] != AUTO:
        c.train_batch_size = _int(d["train_batch_size"], "train_batch_size", 1)
    if "train_micro_batch_size_per_gpu" in d and d["train_micro_batch_size_per_gpu"] != AUTO:
        c.train_micro_batch_size_per_gpu = _int(d["train_micro_batch_size_per_gpu"],
                                                "train_micro_batch_size_per_gpu", 1)
    if "gradient_accumulation_steps" in d and d["gradient_accumulation_steps"] != AUTO:
        c.gradient_accumulation_steps = _int(d["gradient_accumulation_steps"],
                                             "gradient_accumulation_steps", 1)
    _reconcile_batch(c, d)
    if "gradient_clipping" in d:
        c.gradient_clipping = _float(d["gradient_clipping"], "gradient_clipping")
    if d.get("steps_per_print", AUTO) != AUTO:
        c.steps_per_print = _int(d["steps_per_print"], "steps_per_print", 1)
    if "fp16" in d:
        f16 = d["fp16"]
        _check_keys(f16, _names(FP16Config), IGNORED_FP16, "fp16")
        c.fp16 = FP16Config(
            enabled=_bool(f16.get("enabled", False), "fp16.enabled"),
            loss_scale=_float(f16.get("loss_scale", 0.0), "fp16.loss_scale"),
            initial_scale_power=_int(f16.get("initial_scale_power", 16), "fp16.initial_scale_power"),
            loss_scale_window=_int(f16.get("loss_scale_window", 1000), "fp16.loss_scale_window", 1),
            hysteresis=_int(f16.get("hysteresis", 2), "fp16.hysteresis", 1),
            min_loss_scale=_float(f16.get("min_loss_scale", 1.0), "fp16.min_loss_scale"),
        )
    for key in ("bf16", "bfloat16"):
        if key in d:
            _check_keys(d[key], _names(BF16Config), {"immediate_grad_update", "check_grad_overflow"}, key)
            c.bf16 = BF16Config(**{f.name: _bool(d[key].get(f.name, False), f"{key}.{f.name}")
                                   for f in fields(BF16Config)})
            _check_bf16_state(c.bf16, key)
    if c.fp16.enabled and c.bf16.enabled:
        raise ConfigError("fp16.enabled and bf16.enabled: at most one of them may be true")
    if "optimizer" in d:
        c.optimizer = _parse_optimizer(d["optimizer"])
    if d.get("scheduler") is not None:
        c.scheduler = parse_scheduler(d["scheduler"])
    if "zero_optimization" in d:
        c.zero_optimization = _parse_zero(d["zero_optimization"])
    if "aio" in d:
        a = d["aio"]
        _check_keys(a, _names(AioConfig), IGNORED_AIO, "aio")
        c.aio = AioConfig(
            block_size=_int(a.get("block_size", 1 << 20), "aio.block_size", 512),
            queue_depth=_int(a.get("queue_depth", 32), "aio.queue_depth", 1),
            thread_count=_int(a.get("thread_count", 1), "aio.thread_count", 1),
            backend=_choice(a.get("backend", "auto"), "aio.backend", ("auto", "aio", "uring", "posix")),
            intra_op_parallelism=_int(a.get("intra_op_parallelism", 1), "aio.intra_op_parallelism", 1),
        )
    if "pyinfinity" in d:
        c.pyinfinity = _parse_engine(d["pyinfinity"])
    _validate(c)
    return c


def _reconcile_batch(c: Config, d: dict) -> None:
    """train_batch_size = micro batch x accumulation steps (one process); derive the missing one."""
    tbs, mbs, gas = c.train_batch_size, c.train_micro_batch_size_per_gpu, c.gradient_accumulation_steps
    has_mbs = "train_micro_batch_size_per_gpu" in d and d["train_micro_batch_size_per_gpu"] != AUTO
    has_gas = "gradient_accumulation_steps" in d and d["gradient_accumulation_steps"] != AUTO
    if tbs is None:
        c.train_batch_size = mbs * gas
        return
    if has_mbs and has_gas:
        if tbs != mbs * gas:
            raise ConfigError(f"train_batch_size: {tbs} != train_micro_batch_size_per_gpu ({mbs}) x "
                              f"gradient_accumulation_steps ({gas}) on one process")
    elif has_mbs:
        if tbs % mbs:
            raise ConfigError(f"train_batch_size: {tbs} is not a multiple of train_micro_batch_size_per_gpu ({mbs})")
        c.gradient_accumulation_steps = tbs // mbs
    elif has_gas:
        if tbs % gas:
            raise ConfigError(f"train_batch_size: {tbs} is not a multiple of gradient_accumulation_steps ({gas})")
        c.train_micro_batch_size_per_gpu = tbs // gas
    else:
        c.train_micro_batch_size_per_gpu = tbs


def _validate(c: Config) -> None:
    z = c.zero_optimization
    if c.pyinfinity.optimizer_state == "8bit" and c.bf16.bf16_master_weights_and_grads:
        raise ConfigError("pyinfinity.optimizer_state: \"8bit\" keeps an fp32 master, which "
                          "bf16.bf16_master_weights_and_grads drops: set one of them")
    if c.pyinfinity.overlap_step is True:
        why = overlap_step_blocker(c)
        if why is not None:
            raise ConfigError(f"pyinfinity.overlap_step: true is not exact here: {why}; set gradient_clipping "
                              "to 0, disable fp16 (bf16 is fine) and use optimizer_step_device \"cpu\", or "
                              "set overlap_step to \"auto\" (on only when it is exact) or false")
    dob = c.pyinfinity.device_optimizer_bytes
    if dob != AUTO and dob and c.pyinfinity.optimizer_step_device == "device":
        raise ConfigError("pyinfinity.device_optimizer_bytes: optimizer_step_device \"device\" already steps every "
                          "unit on the device (its state streamed there and back); set device_optimizer_bytes to 0 "
                          "or optimizer_step_device to \"cpu\"")
    if z.stage != 3:
        raise ConfigError(f"zero_optimization.stage: pyinfinity offloads ZeRO stage 3 shards; "
                          f"stage {z.stage} with offload_param/offload_optimizer is not supported (use 3)")
    for name, sec in (("offload_param", z.offload_param), ("offload_optimizer", z.offload_optimizer)):
        if sec.device == "nvme" and not sec.nvme_path:
            raise ConfigError(f"zero_optimization.{name}.nvme_path: required when "
                              f"zero_optimization.{name}.device is \"nvme\"")
    for p in c.nvme_paths:
        check_swap_dir(p, "nvme_path")


def _read_only(path: str) -> bool:
    try:
        return bool(os.statvfs(path).f_flag & os.ST_RDONLY)
    except OSError:
        return False


def check_swap_dir(path: str, key: str = "nvme_path") -> None:
    """Check that files can be created in ``path``, or that it can be created when it does not exist
    yet (a clear error otherwise). Nothing is created here: a training engine creates a missing swap
    directory when it starts (``pyinfinity.swap.ownership``), with a warning, and removes it at close."""
    if os.path.exists(path) and not os.path.isdir(path):
        raise ConfigError(f"{key}: {path!r} is not a directory (a swap path must be a directory)")
    if not os.path.exists(path):
        parent = os.path.dirname(os.path.abspath(path))
        while parent and not os.path.exists(parent):
            parent = os.path.dirname(parent)
        if not os.path.isdir(parent):
            raise ConfigError(f"{key}: cannot create swap directory {path!r}: {parent!r} is not a directory")
        if not os.access(parent, os.W_OK | os.X_OK):
            raise ConfigError(f"{key}: cannot create swap directory {path!r}: "
                              f"{os.strerror(errno.EROFS if _read_only(parent) else errno.EACCES)}")
        return
    probe = os.path.join(path, f".pyinfinity-probe-{os.getpid()}")
    try:
        with open(probe, "wb") as f:
            f.write(b"x")
        os.unlink(probe)
    except OSError as exc:
        raise ConfigError(f"{key}: swap directory {path!r} is not writable: {exc.strerror}") from exc


__all__ = ["AUTO", "PLACEMENT_KEYS", "placement_values", "Config", "ConfigError", "load_config", "parse_scheduler", "parse_size", "format_size", "check_swap_dir", "replace",
           "overlap_step_blocker", "auto_overlap_off", "default_optimizer_threads", "optimizer_threads", "OPTIMIZER_STATES", "STATE_FORMATS",
           "StateFormat", "QUANT_BLOCK", "MIN_QUANTIZED_NUMEL"]
