"""What ``"auto"`` means without the planner: the rules the engine and the planner share
(``default_optimizer_threads``, ``overlap_step_blocker``), and the heuristic resolution of a whole
config from the machine's budgets (``resolve_auto``, ``measure_budgets``), which predates the
planner (``pyinfinity.plan.resolve_auto``, what ``initialize`` and ``pyinfinity plan`` use).
``pyinfinity.config`` re-exports them."""
from __future__ import annotations

import copy
import os
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Optional

from pyinfinity.config_values import AUTO, STATE_FORMATS, ConfigError, format_size

if TYPE_CHECKING:
    from pyinfinity.config import Config


def default_optimizer_threads(device: str) -> int:
    """``pyinfinity.optimizer_threads`` "auto": 1 on the CPU device (backward has the cores), else
    every CPU this process may run on."""
    if str(device).startswith("cpu"):
        return 1
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def overlap_step_blocker(c: Config) -> Optional[str]:
    """Why the optimizer cannot step in the background under ``c`` (None: it can). Clipping and
    fp16 loss scaling are no reason: the step then waits for the global norm after backward and
    overlaps the next forward instead."""
    if c.pyinfinity.optimizer_step_device == "device":
        return ("optimizer_step_device \"device\" steps on the compute device, which a background thread "
                "would share with backward")
    return None


@dataclass
class ModelSizes:
    """What "auto" needs to know about the model."""

    numel: int  # trainable + frozen parameter elements
    param_bytes: int  # in the compute dtype
    largest_shard_bytes: int  # the biggest single flat shard (one module's own parameters)
    largest_module_bytes: int  # the most parameter bytes one module call needs at once
    persistent_bytes: int = 0  # shards kept resident by stage3_param_persistence_threshold
    small_shard_bytes: int = 0  # bytes of shards of at most 1e5 elements (DeepSpeed's default threshold)
    trainable: Optional[int] = None  # elements with requires_grad (they alone get optimizer state); None: all

    @property
    def trainable_numel(self) -> int:
        return self.numel if self.trainable is None else self.trainable


@dataclass
class Budgets:
    """Memory and disk available to the engine (bytes)."""

    device_memory: int
    host_memory: int
    nvme_free: int  # total over the swap directories; 0 when none


@dataclass
class AutoDecision:
    key: str
    value: Any
    why: str


def measure_budgets(cfg: Config, device: "Any") -> Budgets:
    """Budgets from the machine: device memory (free on the GPU; on the CPU device 25% of the
    available RAM), host RAM available (``/proc/meminfo`` MemAvailable) and free space under the
    swap directories. Explicit values in ``pyinfinity.device_memory`` / ``host_memory`` win."""
    import torch

    avail = _mem_available()
    dm = cfg.pyinfinity.device_memory
    if isinstance(dm, int):
        device_memory = dm
    elif getattr(device, "type", str(device)) == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        device_memory = int(free * 0.9)
    else:
        device_memory = avail // 4
    hm = cfg.pyinfinity.host_memory
    host = hm if isinstance(hm, int) else int(avail * 0.8)
    free = 0
    seen: set[int] = set()
    for p in cfg.nvme_paths:
        st = os.statvfs(p)
        if st.f_fsid not in seen:
            seen.add(st.f_fsid)
            free += st.f_bavail * st.f_frsize
    return Budgets(device_memory=device_memory, host_memory=host, nvme_free=free)


def _mem_available() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 2


def resolve_auto(cfg: Config, sizes: ModelSizes, budgets: Budgets) -> tuple[Config, list[AutoDecision]]:
    """Replace every ``"auto"`` by a value from the budgets; returns the new config and the decisions.

    Heuristics (until ``pyinfinity.plan`` decides; each is reported at start):
      * device_memory: the budget given, else ``budgets.device_memory``.
      * offload_param.device: "cpu" if the parameters (compute dtype) fit in half the host budget
        after the optimizer states placed in RAM, else "nvme" (needs nvme_path).
      * offload_optimizer.device: "cpu" if master + Adam moments + fp32 grads (16 B/param with the
        fp32 state, 10.03 with 8bit, 8 with bf16) fit in the host budget, else "nvme".
      * stage3_prefetch_bucket_size: what the device budget leaves after the persistent shards and
        two of the largest module working sets, at most 4x the largest module.
      * stage3_max_live_parameters: the device budget, in elements of the compute dtype.
      * buffer_size: the largest shard; buffer_count: prefetch bytes / buffer_size + 2.
      * max_in_cpu: the host budget left after the optimizer states placed in RAM.
      * stage3_param_persistence_threshold: 1e5 (DeepSpeed's default) when all shards of at most
        1e5 elements together cost <= 5% of the device budget, else 0.
      * pyinfinity.overlap_step: true unless ``overlap_step_blocker`` names a reason (an engine
        given "auto" itself also waits for its first optimizer step before overlapping).
    """
    c = _deepcopy(cfg)
    out: list[AutoDecision] = []
    z = c.zero_optimization
    itemsize = max(1, sizes.param_bytes // max(1, sizes.numel))
    e = c.pyinfinity
    if e.device == AUTO:
        from pyinfinity.device import resolve_device

        e.device = str(resolve_device(AUTO))
        out.append(AutoDecision("pyinfinity.device", e.device, "CUDA device present" if e.device != "cpu"
                                else "no CUDA device"))
    if e.device_memory == AUTO or e.device_memory is None:
        e.device_memory = budgets.device_memory
        out.append(AutoDecision("pyinfinity.device_memory", e.device_memory, "measured device budget"))
    if e.optimizer_threads == AUTO:
        e.optimizer_threads = default_optimizer_threads(e.device)
        out.append(AutoDecision("pyinfinity.optimizer_threads", e.optimizer_threads,
                                "one on the CPU device, else every CPU of this process"))
    if e.overlap_step == AUTO:
        blocker = overlap_step_blocker(c)
        e.overlap_step = blocker is None
        out.append(AutoDecision("pyinfinity.overlap_step", e.overlap_step,
                                blocker or "no clipping, no fp16 loss scaling, optimizer steps on the CPU"))
    dev_budget = int(e.device_memory)
    state = STATE_FORMATS[c.optimizer_state_format]
    opt_bytes = int(sizes.trainable_numel * (state.state_bytes + 4))  # master and moments + an fp32 gradient
    host = budgets.host_memory
    nvme_ok = bool(c.nvme_paths)
    if z.offload_optimizer.device == AUTO:
        if opt_bytes <= host or not nvme_ok:
            z.offload_optimizer.device = "cpu"
            why = (f"optimizer states {format_size(opt_bytes)} fit in host budget {format_size(host)}"
                   if opt_bytes <= host else "no nvme_path given")
        else:
            z.offload_optimizer.device = "nvme"
            why = f"optimizer states {format_size(opt_bytes)} exceed host budget {format_size(host)}"
        out.append(AutoDecision("zero_optimization.offload_optimizer.device", z.offload_optimizer.device, why))
    host_left = host - (opt_bytes if z.offload_optimizer.device == "cpu" else sizes.trainable_numel * 4)
    if z.offload_param.device == AUTO:
        if sizes.param_bytes <= max(0, host_left) // 2 or not nvme_ok:
            z.offload_param.device = "cpu"
            why = f"parameters {format_size(sizes.param_bytes)} fit in half the host RAM left ({format_size(max(0, host_left))})"
        else:
            z.offload_param.device = "nvme"
            why = f"parameters {format_size(sizes.param_bytes)} exceed half the host RAM left ({format_size(max(0, host_left))})"
        out.append(AutoDecision("zero_optimization.offload_param.device", z.offload_param.device, why))
    for sec in (z.offload_param, z.offload_optimizer):
        if sec.nvme_path is None and sec.device == "nvme":
            sec.nvme_path = c.nvme_paths or None
        if sec.device == "nvme" and not sec.nvme_path:
            raise ConfigError("nvme_path: \"auto\" placed state on NVMe but no nvme_path is configured")
    if z.stage3_param_persistence_threshold == AUTO:
        thr = 100_000 if sizes.small_shard_bytes <= dev_budget * 0.05 else 0
        z.stage3_param_persistence_threshold = thr
        out.append(AutoDecision("zero_optimization.stage3_param_persistence_threshold", thr,
                                f"shards of <= 1e5 elements ({format_size(sizes.small_shard_bytes)}) stay resident "
                                "only if they cost <= 5% of the device budget"))
        sizes = replace(sizes, persistent_bytes=sizes.small_shard_bytes if thr else 0)
    if z.stage3_prefetch_bucket_size == AUTO:
        left = dev_budget - sizes.persistent_bytes - 2 * sizes.largest_module_bytes
        pf = max(0, min(left, 4 * sizes.largest_module_bytes))
        z.stage3_prefetch_bucket_size = pf
        out.append(AutoDecision("zero_optimization.stage3_prefetch_bucket_size", pf,
                                f"device budget {format_size(dev_budget)} minus persistent and two working sets"))
    if z.stage3_max_live_parameters == AUTO:
        z.stage3_max_live_parameters = dev_budget // itemsize
        out.append(AutoDecision("zero_optimization.stage3_max_live_parameters", z.stage3_max_live_parameters,
                                "device budget in elements"))
    op = z.offload_param
    if op.buffer_size == AUTO:
        op.buffer_size = max(1, sizes.largest_shard_bytes)
        out.append(AutoDecision("zero_optimization.offload_param.buffer_size", op.buffer_size, "largest shard"))
    if op.buffer_count == AUTO:
        op.buffer_count = int(z.stage3_prefetch_bucket_size) // max(1, int(op.buffer_size)) + 2
        out.append(AutoDecision("zero_optimization.offload_param.buffer_count", op.buffer_count,
                                "prefetch bytes / buffer_size + 2"))
    if op.max_in_cpu == AUTO:
        op.max_in_cpu = max(0, host_left)
        out.append(AutoDecision("zero_optimization.offload_param.max_in_cpu", op.max_in_cpu,
                                "host budget left after optimizer states"))
    if e.host_memory == AUTO:
        e.host_memory = host
    if e.resident_bytes == AUTO:
        e.resident_bytes = 0
        out.append(AutoDecision("pyinfinity.resident_bytes", 0, "the heuristic keeps no unit resident"))
    if e.device_optimizer_bytes == AUTO:
        e.device_optimizer_bytes = 0
        out.append(AutoDecision("pyinfinity.device_optimizer_bytes", 0, "no unit is resident"))
    if e.device_accumulator_bytes == AUTO:
        e.device_accumulator_bytes = 0
        out.append(AutoDecision("pyinfinity.device_accumulator_bytes", 0, "the heuristic leaves no device room"))
    if e.unit_bytes == AUTO:
        from pyinfinity.units import auto_unit_bytes

        e.unit_bytes = auto_unit_bytes(sizes.param_bytes, sizes.largest_module_bytes, dev_budget)
        out.append(AutoDecision("pyinfinity.unit_bytes", e.unit_bytes, "a quarter of the model, an eighth of the device"))
    if z.offload_param.device == "nvme" or z.offload_optimizer.device == "nvme":
        need = (sizes.param_bytes if z.offload_param.device == "nvme" else 0) + \
               (int(sizes.trainable_numel * state.state_bytes * z.offload_optimizer.ratio)
                if z.offload_optimizer.device == "nvme" else 0)
        if budgets.nvme_free and need > budgets.nvme_free:
            raise ConfigError(f"nvme_path: needs {format_size(need)} of swap, {format_size(budgets.nvme_free)} "
                              f"free at {', '.join(c.nvme_paths)}; add {format_size(need - budgets.nvme_free)} "
                              "or another path")
    return c, out


def _deepcopy(c: Config) -> Config:
    return copy.deepcopy(c)


__all__ = ["ModelSizes", "Budgets", "AutoDecision", "measure_budgets", "resolve_auto", "default_optimizer_threads",
           "overlap_step_blocker"]
