"""What a layout costs in each memory pool: the device (``charges``), pinned and pageable RAM, and
each swap directory. :func:`plan_layout` is the planner's figure for a candidate (every pool, from
the model's sizes and the knobs); :func:`engine_pools` is what the engine checks at start and
reserves (the swappers' pinned pools and each swap directory's claim) from its resolved config.
The bytes of an optimizer state's home (:func:`home_bytes`) and the slack of formats whose home is
not proportional to its shard (:func:`home_slack`) are stated here once."""
from __future__ import annotations

import math
import mmap
from dataclasses import dataclass
from typing import Any, Optional, Sequence

from pyinfinity.config_values import MIN_QUANTIZED_NUMEL, STATE_FORMATS, StateFormat
from pyinfinity.layout.charges import (GRAD_BYTES_PER_PARAM, OPT_BYTES_PER_PARAM, DeviceCharges, TrainShape,
                                       accumulator_bytes, device_charges, device_state_cost, step_scratch)
from pyinfinity.layout.shards import Knobs, ShardLayout, device_units, is_persistent, param_tiers, shard_layout
from pyinfinity.layout.sizes import ModelSizes

SWAP_GROW = 256 << 20  # SwapSpace grows each file in steps of at most this (smaller when the need is)
SWAP_SLOT_ALIGN = 4096
SWAP_STRIPE_MIN = 4 << 20  # SwapSpace: slots below this go to one file, round-robin
# under accumulation: the host staging buffers gradients land in, taken in turn while the worker adds
# the last ones (zero.accumulate.STAGING_SLOTS, each of the largest trainable unit), and the worker's
# fp32 chunk (zero.accumulate.ADD_CHUNK)
GRAD_STAGING_SLOTS = 3
ADD_SCRATCH = 4 * (1 << 20)
# under accumulation: the pinned fp32 buffers the sums of device gradient accumulators land in for the
# CPU step, each reused once the step that read it is done (zero.optim.landing.LandingRing)
LANDING_SLOTS = 3
# the parameter swapper's pinned pool beyond its homes (alignment of the slots)
PINNED_SLACK = 1 << 20
# pyinfinity.checkpoint_staging for a run that saves in the background (`train --save-every`)
CHECKPOINT_STAGING = 1 << 30


def page_rounded(nbytes: int) -> int:
    """``nbytes`` rounded up to whole pages, as the pinned arena (``swap.PinnedArena``) reserves it."""
    return -(-int(nbytes) // mmap.PAGESIZE) * mmap.PAGESIZE


def home_bytes(state: StateFormat, numel: float) -> float:
    """Bytes of an optimizer state's home for ``numel`` parameters in RAM or on disk: the format's
    state (``StateFormat.shard_bytes``), and a bf16 master's own buffer for the gradient (the 2
    bytes a gradient buffer would cost were the master the weights' home)."""
    return state.shard_bytes(numel) + (2 * numel if state.weights_are_master else 0)


def home_bytes_per_param(state: StateFormat) -> float:
    """:func:`home_bytes` a parameter, for shards large enough to be kept in the format itself."""
    return state.state_bytes + (2 if state.weights_are_master else 0)


def home_slack(state: StateFormat, n_modules: int) -> int:
    """Bytes a format whose home is not proportional to its shard needs beyond
    :func:`home_bytes_per_param` x the trainable elements: at most one shard a module below
    MIN_QUANTIZED_NUMEL, whose home the 8-bit state keeps in fp32 (the bf16 one's sections are
    aligned); 0 for the fp32 state."""
    if state.name == "fp32":
        return 0
    return int(n_modules * home_bytes(state, MIN_QUANTIZED_NUMEL - 1))


def save_staging_bytes(budget: int, largest: int, checkpoint: int, room: int, background: bool) -> int:
    """One save's staging buffer at run time, in whole pages: ``budget`` (``pyinfinity.checkpoint_staging``,
    what the layout charges) and beyond it what the host has free now (``room``): up to the whole
    ``checkpoint`` for a background save (each shard is updated every step: with a disk slower
    than the step, what is not staged makes a step wait for the disk), two copies of the
    ``largest`` for a blocking one (the next copy taken while one is written); at least one
    copy, never more than the checkpoint."""
    copy = page_rounded(max(1, largest))
    free = max(0, int(room)) // mmap.PAGESIZE * mmap.PAGESIZE
    grant = free if background else min(free, 2 * copy)
    return min(max(int(budget) // mmap.PAGESIZE * mmap.PAGESIZE, grant, copy), int(checkpoint))


def checkpoint_staging_bytes(budget: int, sizes: ModelSizes, state: StateFormat) -> int:
    """Host RAM a save's shard copies take at most under ``pyinfinity.checkpoint_staging`` =
    ``budget``: none when 0 (a run that does not save in the background), else the budget or one
    shard's saved state when that is larger (the writer lets a larger copy go alone)."""
    if budget <= 0:
        return 0
    largest = 0
    for i, (numel, trainable) in enumerate(zip(sizes.shard_numels, sizes.shard_trainable)):
        saved = int(home_bytes(state, numel)) + SWAP_SLOT_ALIGN if trainable else sizes.shard_bytes(i)
        largest = max(largest, saved)
    return max(int(budget), largest)


def landing_ring(acc_numels: Sequence[int]) -> tuple[int, int]:
    """The landing ring of the device accumulators of shards of ``acc_numels`` elements: (buffers,
    fp32 elements each): LANDING_SLOTS buffers (fewer when fewer units accumulate on the device) of
    the largest such shard. A device accumulator's sum is copied into one of them in the boundary
    micro-batch and read there by the unit's CPU step, which gives the buffer back."""
    sizes = [int(n) for n in acc_numels if n > 0]
    if not sizes:
        return 0, 0
    return min(LANDING_SLOTS, len(sizes)), max(sizes)


def landing_bytes(acc_numels: Sequence[int]) -> int:
    """Host bytes (pinned on a GPU) of :func:`landing_ring`: what the device accumulators cost in
    RAM, whatever their number."""
    count, numel = landing_ring(acc_numels)
    return count * accumulator_bytes(numel)


def ram_state_bytes(sizes: ModelSizes, state: StateFormat) -> int:
    """Bytes of the whole training state in host RAM: the weights, and each trainable parameter's
    optimizer state and fp32 gradient."""
    return int(sizes.trainable_numel * (state.state_bytes + GRAD_BYTES_PER_PARAM) + sizes.param_bytes)


def state_numel_within(state: StateFormat, ram_bytes: int) -> int:
    """Parameters whose optimizer state in ``state``'s format fits ``ram_bytes``."""
    return int(max(0, ram_bytes) // state.state_bytes)


@dataclass
class SwapFile:
    """One state class's swap file in each of its directories, as the engine claims it: the bytes
    a file reaches at most (:attr:`nbytes`) and the step the swap space grows it in."""

    payload: int  # bytes of state the engine puts in the space (over all its directories)
    per_dir: int  # upper bound of one file's bytes before the last step's rounding
    grow: int  # the preallocation step

    @property
    def nbytes(self) -> int:
        """What one file is preallocated to at most: :attr:`per_dir` in whole :attr:`grow` steps."""
        return -(-max(1, self.per_dir) // self.grow) * self.grow if self.payload else 0


def swap_file(payload: int, slots: int, n_dirs: int) -> SwapFile:
    """The swap file of a state class holding ``payload`` bytes in ``slots`` slots striped over
    ``n_dirs`` directories (each slot aligned; a second directory adds the striping's slack); the
    step is the file's own size in whole MiB, at most SWAP_GROW."""
    n = max(1, n_dirs)
    per_dir = -(-(int(payload) + slots * SWAP_SLOT_ALIGN) // n) + (SWAP_STRIPE_MIN if n > 1 else 0)
    grow = min(SWAP_GROW, max(1 << 20, -(-per_dir // (1 << 20)) * (1 << 20)))
    return SwapFile(payload=int(payload), per_dir=per_dir, grow=grow)


@dataclass
class Share:
    """Bytes of one tensor class on the device, in RAM and on disk."""

    device: int = 0
    ram: int = 0
    disk: int = 0

    @property
    def total(self) -> int:
        return self.device + self.ram + self.disk


@dataclass
class Layout:
    """A candidate's layout: where each shard lives (:class:`ShardLayout`) and the bytes of every
    pool it charges."""

    shards: ShardLayout
    params: Share
    grads: Share
    optimizer: Share
    charges: DeviceCharges  # the device at the peak of a step, by kind
    device_bytes: int  # the device peak (charges.total, or the streamed device step's)
    host_bytes: int  # RAM: homes + gradients + staging (+ the device pool on the CPU device)
    pinned_bytes: int  # of host_bytes, the pinned pool
    swap_bytes: int  # on disk over all swap directories
    swap_per_dir: dict[str, int]
    staging: int  # host staging buffers of disk reads and the optimizer's pipeline
    writeback: int  # the optimizer's write-back temporaries in the compute dtype
    device_state_bytes: int  # of device_bytes, resident units' optimizer state and their gradients
    device_state_numel: int
    accumulator_bytes: int  # of device_bytes, fp32 gradient accumulators on the device
    accumulator_numel: int
    resident_bytes: int  # units kept on the device within resident_bytes
    persistent_bytes: int  # small shards kept on the device
    fetch_ram: int  # bytes of the shards fetched from RAM each pass
    fetch_disk: int  # bytes of the shards fetched from disk each pass
    biggest_disk_state: int = 0  # the largest shard's optimizer state on disk
    first_disk_state: int = 0  # the first shard's optimizer state on disk
    grad_staging: int = 0  # under accumulation, the host staging ring and the worker's chunk
    landing: int = 0  # under accumulation, the landing ring of the device accumulators (landing_bytes)
    checkpoint_staging: int = 0  # a save's shard copies not yet written (pyinfinity.checkpoint_staging)


def plan_layout(sizes: ModelSizes, train: TrainShape, knobs: Knobs, device_memory: int, *,
                device_is_host: bool = False, cuda: bool = False, swap_dirs: Sequence[str] = ()) -> Layout:
    """The layout the engine realises under ``knobs`` for a model of ``sizes`` and the pools it
    charges: the device (the charges of one step within ``device_memory``), host RAM and its
    pinned part, and ``swap_dirs`` (striped equally, each file grown in SWAP_GROW steps)."""
    k = knobs
    isz = sizes.itemsize
    state_fmt = train.state_format
    numels = sizes.shard_numels
    nbytes = [sizes.shard_bytes(i) for i in range(len(numels))]
    sl = shard_layout(numels, nbytes, sizes.shard_trainable, k, train.grad_accum,
                      lambda i: device_state_cost(sizes.shard_itemsize(i), train.grad_accum, state_fmt.name)
                      * numels[i])
    params = Share()
    persistent = resident_bytes = fetch_ram = fetch_disk = 0
    for i, tier in enumerate(sl.param):
        setattr(params, tier, getattr(params, tier) + nbytes[i])
        if tier == "device":
            continue
        if i in sl.resident:
            resident_bytes += nbytes[i]
        elif i in sl.persistent:
            persistent += nbytes[i]
        elif tier == "ram":
            fetch_ram += nbytes[i]
        else:
            fetch_disk += nbytes[i]
    dev_state = set(sl.device_state)
    dev_state_numel = sum(numels[i] for i in sl.device_state)
    dev_state_cost = 0.0
    for i in sl.device_state:
        dev_state_cost += device_state_cost(sizes.shard_itemsize(i), train.grad_accum, state_fmt.name) * numels[i]
    dev_acc_numel = sum(numels[i] for i in sl.device_accumulators)
    acc_bytes = accumulator_bytes(dev_acc_numel)
    landing = landing_bytes([numels[i] for i in sl.device_accumulators])
    # -- optimizer states: the shard's home, moved whole (compressed on disk). Under accumulation a
    # bf16 master's home keeps its gradient slot beside the fp32 accumulator (home_bytes); without
    # accumulation that slot is the gradient buffer the gradients' share counts below
    optim = Share()
    biggest_disk_state = first_disk_state = 0
    for i, tier in enumerate(sl.optimizer):
        if not tier:
            continue
        nb = int(home_bytes(state_fmt, numels[i]) if train.grad_accum > 1 else state_fmt.shard_bytes(numels[i]))
        if tier == "ram":
            optim.ram += nb
        else:
            optim.disk += nb
            biggest_disk_state = max(biggest_disk_state, nb)
            first_disk_state = first_disk_state or nb
    # gradients on the host: none extra when they land in a parameter home in RAM (the step rewrites
    # it from the fp32 master), a buffer of their own for homes on disk or on the device, or when the
    # weights are the master; fp32 under accumulation (with the staging buffers they land in, pinned
    # on a GPU; the sums of device accumulators land in the few pinned buffers of the landing ring)
    total_train = sizes.trainable_numel
    grad_staging = 0
    if train.grad_accum > 1:
        if total_train - dev_state_numel - dev_acc_numel > 0:
            largest_trainable = max((nbytes[i] for i, t in enumerate(sizes.shard_trainable) if t), default=0)
            grad_staging = GRAD_STAGING_SLOTS * largest_trainable + ADD_SCRATCH
        grads = Share(device=acc_bytes,
                      ram=accumulator_bytes(total_train - dev_state_numel - dev_acc_numel) + landing + grad_staging)
    else:
        grads = Share(ram=sum(nbytes[i] for i, (t, pt) in enumerate(zip(sizes.shard_trainable, sl.param))
                              if t and (pt != "ram" or state_fmt.weights_are_master) and i not in dev_state))
    device_state_bytes = int(dev_state_cost)
    # -- device: the charges of one step (DeviceCharges: shards, activations, gradients, state, headroom)
    everything = k.param_device == "none" or resident_bytes + persistent >= params.total
    charges = device_charges(sizes, train, device_memory, device_is_host=device_is_host,
                             resident=params.device if k.param_device == "none" else resident_bytes,
                             persistent=0 if k.param_device == "none" else persistent,
                             prefetch=k.prefetch_bytes if k.prefetch else 0,
                             device_state=device_state_bytes + step_scratch(state_fmt.name) if dev_state else 0,
                             accumulators=acc_bytes, all_resident=everything)
    device_bytes = charges.total
    if k.optimizer_step_device == "device":  # two sets of the state + grad buffers, after release_all
        device_bytes = max(device_bytes, persistent + 2 * int(state_fmt.shard_bytes(sizes.largest_shard_numel)
                                                              + 4 * sizes.largest_shard_numel))
    # -- host: homes in RAM, gradients, staging, write-back temporaries (+ the device pool on the CPU)
    staging = 0
    if optim.disk:
        staging += (k.optimizer_buffer_count if k.pipeline else 1) * biggest_disk_state
    if cuda and fetch_disk:
        staging += k.param_buffer_count * sizes.largest_shard_bytes  # pinned read staging
    writeback = (sizes.largest_shard_numel * isz * k.optimizer_buffer_count) if isz != 4 else 0
    # pinned: what crosses PCIe (parameter homes, read staging); the optimizer state only when the
    # optimizer steps on the device (a CPU step reads it in place)
    pinned = params.ram + staging + (optim.ram if k.optimizer_step_device == "device" else 0)
    ckpt_staging = checkpoint_staging_bytes(k.checkpoint_staging, sizes, state_fmt)
    host_bytes = (pinned + (optim.ram if k.optimizer_step_device != "device" else 0) + grads.ram + writeback
                  + ckpt_staging + (device_bytes if device_is_host else 0))
    # -- swap: striped equally over the directories, each file grows in SWAP_GROW steps
    swap_bytes = params.disk + optim.disk
    swap_per_dir: dict[str, int] = {}
    if swap_bytes and swap_dirs:
        spaces = (1 if params.disk else 0) + (1 if optim.disk else 0)
        per = math.ceil(swap_bytes / len(swap_dirs)) + spaces * SWAP_GROW + 2 * len(numels) * SWAP_SLOT_ALIGN
        swap_per_dir = {d: per for d in swap_dirs}
    # of host_bytes: the gradient staging and the landing ring of the device accumulators are pinned too
    pinned_all = pinned + ((grad_staging - ADD_SCRATCH if grad_staging else 0) + landing if cuda else 0)
    return Layout(shards=sl, params=params, grads=grads, optimizer=optim, charges=charges, device_bytes=device_bytes,
                  host_bytes=host_bytes, pinned_bytes=pinned_all, swap_bytes=swap_bytes, swap_per_dir=swap_per_dir,
                  staging=staging, writeback=writeback, device_state_bytes=device_state_bytes,
                  device_state_numel=dev_state_numel, accumulator_bytes=acc_bytes,
                  accumulator_numel=dev_acc_numel, resident_bytes=resident_bytes, persistent_bytes=persistent,
                  fetch_ram=fetch_ram, fetch_disk=fetch_disk, biggest_disk_state=biggest_disk_state,
                  first_disk_state=first_disk_state, grad_staging=grad_staging, landing=landing,
                  checkpoint_staging=ckpt_staging)


@dataclass
class EnginePools:
    """What the engine checks at start and reserves, from its resolved config and the model's
    sizes (upper bounds: the RAM/disk split is per shard)."""

    param_ram: int  # parameter homes in RAM
    param_disk: int  # parameter homes on disk
    optim_ram: int  # optimizer state homes in RAM
    optim_disk: int  # optimizer state on disk (with the slack of whole shards at the split)
    grads: int  # host gradient buffers (fp32 accumulators under accumulation)
    device_need: int  # the least the device must hold: every parameter, or the largest module + persistent shards
    param_pinned: int  # the parameter swapper's pinned pool
    optim_pinned: int  # the optimizer swapper's pinned pool
    persistent: int = 0  # small shards kept on the device (stage3_param_persistence_threshold)
    n_tensors: int = 1  # tensors a swap directory holds at most per state class (one a module)
    param_dirs: tuple[str, ...] = ()  # the parameters' swap directories (offload_param.nvme_path on nvme)
    optim_dirs: tuple[str, ...] = ()  # the optimizer state's (offload_optimizer.nvme_path on nvme)
    checkpoint_staging: int = 0  # a save's shard copies not yet written (checkpoint_staging_bytes)

    @property
    def host(self) -> int:
        """Host RAM the training state needs: homes in RAM, gradients and a save's staging."""
        return self.param_ram + self.optim_ram + self.grads + self.checkpoint_staging

    @property
    def param_file(self) -> SwapFile:
        """The parameters' swap file in each of :attr:`param_dirs`."""
        return swap_file(self.param_disk if self.param_dirs else 0, self.n_tensors, len(self.param_dirs))

    @property
    def optim_file(self) -> SwapFile:
        """The optimizer state's swap file in each of :attr:`optim_dirs`."""
        return swap_file(self.optim_disk if self.optim_dirs else 0, self.n_tensors, len(self.optim_dirs))

    @property
    def swap_per_dir(self) -> dict[str, int]:
        """Bytes the engine claims in each swap directory (every state class's file there)."""
        out: dict[str, int] = {}
        for dirs, f in ((self.param_dirs, self.param_file), (self.optim_dirs, self.optim_file)):
            for d in dirs:
                if f.nbytes:
                    out[d] = out.get(d, 0) + f.nbytes
        return out


def config_knobs(cfg: Any) -> Knobs:
    """The device side's knobs of a resolved config (``pyinfinity.config.Config``): the parameters'
    home and the resident, device-state and device-accumulator budgets ("auto" left: none)."""
    e = cfg.pyinfinity
    budget = {k: 0 if not isinstance(getattr(e, k, 0), int) else int(getattr(e, k, 0))
              for k in ("resident_bytes", "device_optimizer_bytes", "device_accumulator_bytes")}
    return Knobs(param_device=cfg.zero_optimization.offload_param.device,
                 optimizer_step_device=getattr(e, "optimizer_step_device", "cpu"), **budget)


def _config_device_units(cfg: Any, sizes: ModelSizes, state: StateFormat, accumulation: int
                         ) -> tuple[set[int], list[int], list[int]]:
    numels = sizes.shard_numels
    thr = int(cfg.zero_optimization.stage3_param_persistence_threshold or 0)
    return device_units(
        numels, [sizes.shard_bytes(i) for i in range(len(numels))], sizes.shard_trainable,
        [is_persistent(n, thr) for n in numels], config_knobs(cfg), accumulation,
        lambda i: device_state_cost(sizes.shard_itemsize(i), accumulation, state.name) * numels[i])


def device_state_numel(cfg: Any, sizes: ModelSizes, state: StateFormat, accumulation: int) -> int:
    """Trainable elements of the units whose optimizer state (and gradient) the engine keeps and
    steps on the device under ``cfg`` (``layout.shards.device_units``, as ``TrainingState`` places
    them): their gradients never take a host buffer."""
    _, on_device, _ = _config_device_units(cfg, sizes, state, accumulation)
    return sum(sizes.shard_numels[i] for i in on_device)


def device_accumulator_numels(cfg: Any, sizes: ModelSizes, state: StateFormat, accumulation: int) -> list[int]:
    """The elements of each unit whose fp32 gradient accumulator the engine keeps on the device
    under ``cfg`` (as ``TrainingState`` places them): their sums land in the landing ring
    (:func:`landing_bytes`), not in a host accumulator each."""
    _, _, accumulators = _config_device_units(cfg, sizes, state, accumulation)
    return [sizes.shard_numels[i] for i in accumulators]


def engine_pools(cfg: Any, sizes: ModelSizes, n_modules: int, persistence_threshold: Optional[int] = None
                 ) -> EnginePools:
    """The pools of the engine's resolved config ``cfg`` (``pyinfinity.config.Config``) for a model
    of ``sizes`` with ``n_modules`` modules that own parameters."""
    z = cfg.zero_optimization
    op, oo = z.offload_param, z.offload_optimizer
    itemsize = max(1, sizes.param_bytes // max(1, sizes.numel))
    # the parameters' homes shard by shard, as the engine places them (whole shards in RAM first)
    tiers = param_tiers(sizes.shard_numels, op.device, int(op.max_in_cpu) if op.device == "nvme" else 0)
    param_ram = sum(sizes.shard_bytes(i) for i, t in enumerate(tiers) if t == "ram")
    param_disk = sum(sizes.shard_bytes(i) for i, t in enumerate(tiers) if t == "disk")
    ratio = oo.ratio if oo.device == "nvme" else 0.0
    # optimizer state and gradients for the trainable parameters only: a frozen one costs its home
    train = sizes.trainable_numel
    fmt = STATE_FORMATS[getattr(cfg, "optimizer_state_format", "fp32")]
    optim = int(train * home_bytes_per_param(fmt)) + home_slack(fmt, n_modules)
    if fmt.name == "8bit":  # no home is larger than the fp32 state's
        optim = min(optim, train * OPT_BYTES_PER_PARAM)
    optim_disk = min(optim, int(optim * ratio) + 6 * sizes.largest_shard_bytes) if ratio else 0
    optim_ram = optim - int(optim * ratio)
    # gradients on the host: they land in the parameter homes in RAM (the step rewrites those); homes
    # on NVMe or on the device need a buffer of their own (at most the trainable parameters' bytes);
    # accumulation keeps an fp32 sum on the host for every unit whose state does not step on the device
    # and whose accumulator is not on the device (those land in the landing ring)
    accumulation = int(cfg.gradient_accumulation_steps)
    if accumulation > 1:
        on_device = device_accumulator_numels(cfg, sizes, fmt, accumulation)
        grads = (accumulator_bytes(train - device_state_numel(cfg, sizes, fmt, accumulation) - sum(on_device))
                 + landing_bytes(on_device))
    else:
        grads = min(param_disk + (sizes.param_bytes if op.device == "none" else 0), train * itemsize)
    thr = int(z.stage3_param_persistence_threshold) if persistence_threshold is None else persistence_threshold
    persistent = sizes.small_shard_bytes(thr) if thr else 0
    device_need = sizes.param_bytes if op.device == "none" else max(sizes.largest_module_bytes, 1) + persistent
    # the parameter swapper's homes in RAM (with the parameters on the device: the elements
    # max_in_cpu names, for what the swapper keeps in RAM beside them)
    # (each pool as the pinned arena reserves it: whole pages)
    param_pinned = page_rounded((param_ram if op.device != "none"
                                 else min(sizes.param_bytes, int(op.max_in_cpu) * itemsize)) + PINNED_SLACK)
    return EnginePools(param_ram=param_ram, param_disk=param_disk, optim_ram=optim_ram, optim_disk=optim_disk,
                       grads=grads, device_need=device_need, param_pinned=param_pinned,
                       optim_pinned=page_rounded(optim_ram + PINNED_SLACK), persistent=persistent,
                       n_tensors=n_modules,
                       param_dirs=tuple(op.nvme_path or ()) if op.device == "nvme" else (),
                       optim_dirs=tuple(oo.nvme_path or ()) if oo.device == "nvme" else (),
                       checkpoint_staging=checkpoint_staging_bytes(getattr(cfg, "checkpoint_staging_bytes", 0), sizes, fmt))


__all__ = ["Share", "Layout", "plan_layout", "EnginePools", "engine_pools", "config_knobs", "device_state_numel",
           "device_accumulator_numels", "landing_ring", "landing_bytes", "LANDING_SLOTS",
           "home_bytes", "home_bytes_per_param", "checkpoint_staging_bytes", "CHECKPOINT_STAGING",
           "home_slack", "ram_state_bytes", "state_numel_within", "SwapFile",
           "swap_file", "SWAP_STRIPE_MIN", "SWAP_GROW", "SWAP_SLOT_ALIGN", "GRAD_STAGING_SLOTS", "ADD_SCRATCH",
           "PINNED_SLACK"]
