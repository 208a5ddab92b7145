"""Sizing DeepSpeed's NVMe offload knobs from the model (:func:`size_nvme_offload`), before
DeepSpeed builds its swap buffers from the config."""
from __future__ import annotations

import logging
import math
import os
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional

import torch

log = logging.getLogger(__name__)


#: DeepSpeed 0.19's defaults for the knobs sized here (``runtime/zero/offload_config.py``, ``config.py``)
DS_DEFAULTS: Dict[str, float] = {"buffer_count": 5, "buffer_size": 1e8, "max_in_cpu": 1e9,
                                 "optimizer_buffer_count": 4, "sub_group_size": 1e9, "stage3_prefetch_bucket_size": 5e7,
                                 "stage3_max_live_parameters": 1e9, "stage3_max_reuse_distance": 1e9}
MIN_AIO_BYTES = 1 << 20       # DeepSpeed swaps a partition only from this size (and from aio.block_size)
AIO_ALIGNED_BYTES = 1024      # DeepSpeed aligns each swap buffer to this times intra_op_parallelism
FETCH_RESERVE = 2             # buffers one module's fetch needs beyond what is held
#: Pinned buffers a sub-group holds in DeepSpeed's optimizer swapper with Adam: the fp32 master,
#: exp_avg and exp_avg_sq, and the gradient (``runtime/swap_tensor/pipelined_optimizer_swapper.py``,
#: ``_swap_in_optimizer_state``: ``num_tensors() + 1``).
OPTIMIZER_SWAP_BUFFERS = 4
#: Sub-groups size_nvme_offload aims for when it turns the pipelined swapper on and
#: ``sub_group_size`` is left out (DeepSpeed's 1e9 leaves a 1B model two: nothing to read ahead).
PIPELINE_SUB_GROUPS = 8


@dataclass
class NvmeOffloadSizing:
    """What :func:`size_nvme_offload` decided: the config to hand DeepSpeed, and each change as a
    line (``key: old -> new (why)``), also logged."""
    config: Dict[str, Any]
    changes: List[str]
    swappable_partitions: int      # partitions DeepSpeed will put on NVMe (per rank)
    largest_partition_numel: int
    smallest_swappable_numel: int


def _knob(section: Dict[str, Any], key: str) -> Optional[float]:
    """A knob's number, or None when absent or "auto"."""
    v = section.get(key)
    if v is None or (isinstance(v, str) and v.strip().lower() == "auto"):
        return None
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise ValueError(f"{key}: expected a number or \"auto\", got {v!r}")
    return float(v)


def size_nvme_offload(config: Dict[str, Any], model: Any, *, dtype: Any = None, world_size: Optional[int] = None,
                      pinned_budget_bytes: Optional[int] = None,
                      cpu_budget_bytes: Optional[int] = None) -> NvmeOffloadSizing:
    """Sizes DeepSpeed's parameter-swap and optimizer-swap knobs from the model, before ``deepspeed.zero.Init`` /
    ``deepspeed.initialize`` / the Hugging Face Trainer sees ``config`` (they build the swap buffers
    from it). Returns a new config (the input is not changed) and what was changed.

    model: anything ``pyinfinity.plan.model_sizes`` takes (an ``nn.Module``, meta-device or not; a
    transformers config or its dict/path). dtype: the compute dtype (default: the config's bf16/fp16
    section, else bf16). world_size: ranks sharing each parameter (default: ``WORLD_SIZE`` or 1).
    pinned_budget_bytes: pinned RAM the parameter swap buffers may take (default: DeepSpeed's
    buffer_count when given, else 5 buffers). cpu_budget_bytes: RAM for parameters kept in CPU
    memory (sets ``max_in_cpu`` when that is absent or "auto").

    With parameters on NVMe DeepSpeed holds one buffer per partition read and not yet released, and
    it releases a parameter only when it is not used again within ``stage3_max_reuse_distance``
    elements (default 1e9: every parameter of a smaller model stays), so ``buffer_count`` runs out
    ("Not enough buffers 0 for swapping 1"). This sets ``buffer_size`` to at least the largest
    partition ("More elements ... than buffer size"), resolves absent/"auto" integer knobs (which
    DeepSpeed's schema rejects), and lowers the reuse distance, live-parameter and prefetch limits
    to what the buffers hold: (buffer_count - 2) x the smallest swapped partition.

    With ``offload_optimizer.device: nvme`` (parameters on nvme or not) it turns DeepSpeed's
    pipelined optimizer swapper on when ``pipeline_read``/``pipeline_write`` are left out, with the
    buffers and sub-group size it needs (see :func:`_size_optimizer_swap`).
    """
    import copy

    from pyinfinity.plan import model_sizes  # noqa: WPS433 - plan imports torch models lazily

    cfg = copy.deepcopy(config)
    changes: List[str] = []
    zero = cfg.setdefault("zero_optimization", {})
    param = zero.get("offload_param") or {}
    opt = zero.get("offload_optimizer") or {}
    if param.get("device") != "nvme" and opt.get("device") != "nvme":
        return NvmeOffloadSizing(cfg, [], 0, 0, 0)

    def change(where: str, key: str, old: Any, new: Any, why: str) -> None:
        line = f"{where}{key}: {old!r} -> {new!r} ({why})"
        changes.append(line)
        log.info("pyinfinity size_nvme_offload: %s", line)

    if dtype is None:
        dtype = "fp16" if (cfg.get("fp16") or {}).get("enabled") is True else "bf16"
    if hasattr(model, "to_dict") and not isinstance(model, torch.nn.Module):
        model = model.to_dict()  # a transformers PretrainedConfig
    sizes = model_sizes(model, dtype)
    world = int(world_size or os.environ.get("WORLD_SIZE", 1) or 1)
    if world < 1:
        raise ValueError(f"world_size: must be >= 1, got {world}")
    if opt.get("device") == "nvme":
        _size_optimizer_swap(zero, opt, sum(math.ceil(n / world) for n in sizes.shard_numels), change)
    if param.get("device") != "nvme":
        return NvmeOffloadSizing(cfg, changes, 0, 0, 0)
    itemsize = sizes.itemsize
    aio = cfg.get("aio") or {}
    block = int(_knob(aio, "block_size") or 1048576)
    threads = int(_knob(aio, "intra_op_parallelism") or 1)
    align = AIO_ALIGNED_BYTES * threads // itemsize
    min_swap_numel = math.ceil(max(MIN_AIO_BYTES, block) / itemsize)
    parts = [math.ceil(n / world) for n in sizes.shard_numels]
    swappable = [n for n in parts if n >= min_swap_numel]
    if not swappable:
        log.info("pyinfinity size_nvme_offload: no partition reaches %d elements: DeepSpeed keeps every "
                 "parameter in CPU memory; nothing to size", min_swap_numel)
        return NvmeOffloadSizing(cfg, [], 0, max(parts, default=0), 0)
    largest, smallest = max(swappable), min(swappable)
    zero["offload_param"] = param

    # buffer_size: the largest partition, aligned as DeepSpeed aligns it
    need_size = math.ceil(largest / align) * align
    size = _knob(param, "buffer_size")
    if size is None or size < largest:
        why = "absent/auto" if size is None else "below the largest partition, DeepSpeed asserts"
        change("offload_param.", "buffer_size", param.get("buffer_size"), need_size, why)
        param["buffer_size"] = size = need_size
    buffer_bytes = int(size) * itemsize

    # buffer_count: given, or from the pinned budget, never more than the partitions (+ a fetch's)
    most = len(swappable) + FETCH_RESERVE
    count = _knob(param, "buffer_count")
    if count is None:
        new = int(pinned_budget_bytes // buffer_bytes) if pinned_budget_bytes else int(DS_DEFAULTS["buffer_count"])
        new = max(FETCH_RESERVE + 1, min(new, most))
        change("offload_param.", "buffer_count", param.get("buffer_count"), new,
               "absent/auto: " + (f"{pinned_budget_bytes} pinned bytes / {buffer_bytes} per buffer"
                                  if pinned_budget_bytes else "DeepSpeed's default, within the partitions"))
        param["buffer_count"] = count = new
    elif count < FETCH_RESERVE + 1:
        change("offload_param.", "buffer_count", param.get("buffer_count"), FETCH_RESERVE + 1,
               "a fetch needs buffers beyond those held")
        param["buffer_count"] = count = FETCH_RESERVE + 1
    count = int(count)

    # what the buffers hold: every swapped partition when there are enough, else (count - 2) of the smallest
    if count >= most:
        hold = None
    else:
        hold = (count - FETCH_RESERVE) * smallest * world  # the coordinator counts full parameters
    for key in ("stage3_max_reuse_distance", "stage3_max_live_parameters", "stage3_prefetch_bucket_size"):
        given = _knob(zero, key)
        value = given if given is not None else DS_DEFAULTS[key]
        new = value if hold is None else min(value, hold)
        if given is None or new != given:
            why = "absent/auto" if given is None else ""
            if hold is not None and new < value:
                why = (why + "; " if why else "") + (f"{count} buffers hold {count - FETCH_RESERVE} partitions of "
                                                     f">= {smallest} elements beside a fetch")
            change("zero_optimization.", key, zero.get(key), int(new), why)
            zero[key] = int(new)

    if _knob(param, "max_in_cpu") is None:
        new = int(cpu_budget_bytes // itemsize) if cpu_budget_bytes else int(DS_DEFAULTS["max_in_cpu"])
        change("offload_param.", "max_in_cpu", param.get("max_in_cpu"), new,
               "absent/auto: " + (f"{cpu_budget_bytes} CPU bytes" if cpu_budget_bytes else "DeepSpeed's default"))
        param["max_in_cpu"] = new
    for key in ("buffer_count", "buffer_size"):
        param[key] = int(param[key])
    return NvmeOffloadSizing(cfg, changes, len(swappable), largest, smallest)


def _size_optimizer_swap(zero: Dict[str, Any], opt: Dict[str, Any], rank_numel: int,
                         change: Callable[[str, str, Any, Any, str], None]) -> None:
    """The optimizer-swap knobs of :func:`size_nvme_offload` (``offload_optimizer.device: nvme``).

    Without ``pipeline_read``/``pipeline_write`` DeepSpeed steps each sub-group in series: read its
    states and gradient, wait, step, write, wait. Left out, both are turned on (the pipelined
    swapper reads sub-group i+1 and writes i-1 while i steps) when the buffers allow it: it holds
    OPTIMIZER_SWAP_BUFFERS pinned buffers per sub-group in flight (3 with both on, 2 with one) and
    asserts with fewer. Each buffer holds the largest sub-group, so with ``sub_group_size`` left
    out it is lowered to give at least PIPELINE_SUB_GROUPS sub-groups (DeepSpeed's 1e9 gives a
    model of 1B parameters two, and 12 buffers of 4 GB), and further where needed so that the
    buffers pin no more than DeepSpeed's plain swapper does (4 x min(1e9, the rank's parameters)
    fp32 elements)."""
    count = _knob(opt, "buffer_count")
    given = [k for k in ("pipeline_read", "pipeline_write") if k in opt]
    if not given:
        need = OPTIMIZER_SWAP_BUFFERS * 3
        if count is not None and count < need:
            log.info("pyinfinity size_nvme_offload: offload_optimizer.buffer_count %s is below the %d the "
                     "pipelined swapper needs: pipeline_read/pipeline_write left off", opt.get("buffer_count"), need)
        else:
            for key in ("pipeline_read", "pipeline_write"):
                change("offload_optimizer.", key, None, True,
                       "absent: overlap the next sub-group's read and the previous one's write with the step")
                opt[key] = True
    pipelined = bool(opt.get("pipeline_read")) + bool(opt.get("pipeline_write"))
    need = OPTIMIZER_SWAP_BUFFERS * (1 + pipelined) if pipelined else int(DS_DEFAULTS["optimizer_buffer_count"])
    if count is None or count < need:
        why = ("absent/auto: " if count is None else "below what DeepSpeed asserts on: ") + (
            f"{OPTIMIZER_SWAP_BUFFERS} per sub-group x {1 + pipelined} in flight" if pipelined
            else "DeepSpeed's default")
        change("offload_optimizer.", "buffer_count", opt.get("buffer_count"), need, why)
        opt["buffer_count"] = need
    if pipelined and _knob(zero, "sub_group_size") is None:
        # the pinned buffers (count x sub_group_size fp32) stay within what DeepSpeed's default,
        # plain swapper pins (4 buffers of min(1e9, the rank's parameters)): more, smaller
        # sub-groups for a large model rather than three times the pinned RAM
        plain = int(DS_DEFAULTS["optimizer_buffer_count"]) * min(int(DS_DEFAULTS["sub_group_size"]), rank_numel)
        cap = max(1, plain // max(need, int(opt["buffer_count"])))
        new = int(max(MIN_AIO_BYTES // 4,  # never below what DeepSpeed swaps (fp32: 1 MiB)
                      min(DS_DEFAULTS["sub_group_size"], math.ceil(rank_numel / PIPELINE_SUB_GROUPS), cap)))
        change("zero_optimization.", "sub_group_size", zero.get("sub_group_size"), new,
               f"absent/auto: {rank_numel} elements per rank in at least {PIPELINE_SUB_GROUPS} sub-groups, so "
               "that the pipelined swapper has a next one to read and each pinned buffer holds one; its "
               f"{int(opt['buffer_count'])} buffers pin {int(opt['buffer_count']) * new * 4} bytes, no more than "
               "DeepSpeed's plain swapper would")
        zero["sub_group_size"] = new
