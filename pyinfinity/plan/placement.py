"""The placement solver: where parameters, gradients and optimizer states live (device, pinned RAM,
disk — fractions allowed, RAM first), how every buffer is sized, and what one step will cost.

A candidate is a set of engine knobs (:class:`Knobs`, exactly what the config can express:
``offload_param.device``/``max_in_cpu``, ``offload_optimizer.device``/``ratio``, prefetch bytes,
buffer counts, persistence threshold). :func:`evaluate` places the model's shards the way the
engine will (the same greedy rules: ``max_in_cpu`` elements of parameter shards in creation order
stay in RAM; the first ``1 - ratio`` of the optimizer state stays in RAM), charges every budget,
and predicts the step time from the measured rates. :func:`solve` evaluates the candidates the
config leaves open and returns the fastest that respects every budget, or raises
:class:`PlanError` with the numbers when none does.

The step-time model (one optimizer step = ``grad_accum`` micro-batches, then the optimizer):
  * micro-batch: matmul and attention FLOPs / matmul rate, plus ELEMENTWISE_SHARE of it for the
    non-matmul kernels (norms, rotary, activations, the loss); every non-persistent shard is fetched twice (forward
    and backward; the recompute of checkpointing re-fetches instead of the backward); fetches
    from RAM are host->device copies (on the CPU device: memcpys the compute thread does itself,
    so they add to compute), fetches from disk are SwapEngine reads that prefetch overlaps with
    compute; gradients leave the device and are accumulated in fp32 on the host by a worker
    thread (overlapping the GPU's backward; on the CPU device it adds to the compute).
    With prefetch: max(compute [+ copies on the CPU device], copies, disk) + one shard's latency;
    without prefetch: the sum.
  * optimizer: the global gradient norm (from per-unit norms taken as the gradients were made,
    under accumulation by the boundary micro-batch's adds), the one-pass Adam kernel over every
    parameter the CPU steps at the measured rate (which includes writing bf16 weights into a home
    in RAM; a home on disk or on the device, or another dtype, adds a cast pass from the fp32
    master); the RAM part first, then the disk part pipelined (read k+1 || step k || write k-1)
    with the parameter write-back. Serial after the last backward, unless the step overlaps it
    (``pyinfinity.overlap_step``, :attr:`TrainShape.overlap_step`): then the boundary
    micro-batch's backward (and recompute) hides up to its own length of it (on the CPU device
    only the disk part: Adam would compete for the cores), and at least the largest shard's share
    stays visible (it is often the embedding, the last to get its gradient). With gradient
    clipping or fp16 loss scaling (:attr:`TrainShape.norm_first`) no unit can step before the
    global norm, known when the backward ends: the step then runs in model order behind the next
    forward, which waits for each unit's new values, so only that forward's share of a
    micro-batch hides it.
"""
from __future__ import annotations

import logging
import math
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Iterable, Optional, Sequence

import torch

from pyinfinity.plan.budgets import Budgets
from pyinfinity.plan.rates import Rates
from pyinfinity.plan.sizes import SMALL_SHARD_NUMEL, ModelSizes

log = logging.getLogger(__name__)

OPT_BYTES_PER_PARAM = 12  # fp32 master + exp_avg + exp_avg_sq (zero.optim.formats.AdamFp32.bytes_per_param)
GRAD_BYTES_PER_PARAM = 4  # fp32 accumulator on the host
SWAP_GROW = 256 << 20  # SwapSpace grows each file in these steps
SWAP_SLOT_ALIGN = 4096
FETCH_PASSES = 2  # forward + backward (or recompute) fetch of every non-persistent shard
# share of a micro-batch's compute after its forward: backward (2 passes of 3), with checkpointing
# recompute + backward (3 of 4); an overlapped optimizer step can hide behind it (one that waits for
# the global norm: behind the rest, the next forward)
BACKWARD_SHARE = {False: 2 / 3, True: 3 / 4}
PERSISTENT_SHARE = 0.05  # small shards stay resident when they cost at most this share of the device
DEVICE_HEADROOM = 0.10  # of the device budget kept free for the allocator's fragmentation / workspace
TIE = 0.02  # candidates within 2% of the fastest are ties; less disk traffic wins
DEVICE_STEP_SCRATCH = 4 * (16 << 20)  # the device step's fp32 gradient chunk (zero.optim.formats.DEVICE_CHUNK)
# under accumulation: the host staging buffers gradients land in, taken in turn while the worker adds
# the last ones (zero.accumulate.STAGING_SLOTS, each of the largest trainable unit), and the worker's
# fp32 chunk (zero.accumulate.ADD_CHUNK)
GRAD_STAGING_SLOTS = 3
ADD_SCRATCH = 4 * (1 << 20)
# flat unit gradients alive on the device at once in backward: the unit being collected and the one
# whose copy off the device is still in flight (its memory is reused only after the copy ran)
GRAD_BUFFERS_LIVE = 2
# non-matmul kernels of a decoder layer (norms, rotary, SiLU, residual adds, softmax and the loss)
# as a share of its matmul time: the matmul-only prediction was 0.76-0.80x the measured step at
# 1.1B and 7B on an H200 (BENCHMARKS.md), where the step is compute-bound
ELEMENTWISE_SHARE = 0.25


class PlanError(ValueError):
    """No placement respects the budgets; the message says what is needed, what is there, and what
    to change."""


def fmt(n: float) -> str:
    """Bytes in decimal units (as disks are sold), e.g. ``212 GB``, ``1.5 GB``, ``64 MB``."""
    for unit, div in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(n) >= div:
            v = n / div
            return f"{v:.0f} {unit}" if v >= 100 else f"{v:.3g} {unit}"
    return f"{n:.0f} B"


@dataclass
class TrainShape:
    """The training shape: tokens per micro-batch, accumulation and activation checkpointing."""

    micro_batch: int = 1
    seq_len: int = 1024
    grad_accum: int = 1
    checkpointing: bool = False
    activation_bytes: Optional[int] = None  # known figure (None: estimated from the model's shape)
    compute_seconds: Optional[float] = None  # measured forward+backward of one micro-batch (None: FLOPs / matmul rate)
    # pyinfinity.overlap_step as the engine resolves it: "on", "off", or "auto" (on with a GPU, and
    # on the CPU device when part of the optimizer state is on disk)
    overlap_step: str = "off"
    # gradient clipping or fp16 loss scaling: the step needs the global norm, so an overlapped step
    # starts after the boundary backward and hides behind the next forward instead
    norm_first: bool = False

    @property
    def tokens(self) -> int:
        return self.micro_batch * self.seq_len


@dataclass
class DeviceCharges:
    """What the device holds at the peak of a step, by kind (bytes). The one place the device
    budget is charged: the planner's placement and buffer sizing (``evaluate``, ``_fill``), the
    engine's prefetch reserve and its refusal of a shape that cannot fit take their figures here."""

    persistent: int = 0  # small shards kept resident (stage3_param_persistence_threshold) and buffers
    resident: int = 0  # units kept on the device between steps (pyinfinity.resident_bytes)
    working_set: int = 0  # units fetched for the module in use and the next (0 when every unit is resident)
    prefetch: int = 0  # units fetched ahead (stage3_prefetch_bucket_size)
    activations: int = 0  # saved activations of one micro-batch and the loss's logits
    grad_buffers: int = 0  # flat unit gradients being collected and the largest parameter's own gradient
    device_state: int = 0  # optimizer state of device-stepped units, their gradients, the step's fp32 chunk
    accumulators: int = 0  # fp32 gradient accumulators on the device (pyinfinity.device_accumulator_bytes)
    headroom: int = 0  # the allocator's fragmentation and kernel workspaces (DEVICE_HEADROOM of the budget)

    @property
    def total(self) -> int:
        return (self.persistent + self.resident + self.working_set + self.prefetch + self.activations
                + self.grad_buffers + self.device_state + self.accumulators + self.headroom)

    @property
    def reserve(self) -> int:
        """What a prefetch must leave free for the rest of the step (``DeviceBudget.reserve``)."""
        return self.grad_buffers + self.headroom

    def describe(self) -> str:
        parts = [(n, getattr(self, n)) for n in ("resident", "persistent", "working_set", "prefetch", "activations",
                                                 "grad_buffers", "device_state", "accumulators", "headroom")]
        return ", ".join(f"{n.replace('_', ' ')} {fmt(v)}" for n, v in parts if v)


def grad_buffer_bytes(largest_trainable_shard_bytes: int, largest_param_bytes: int) -> int:
    """Device bytes of gradients in backward beyond the activations: GRAD_BUFFERS_LIVE flat unit
    gradients (``coordinator._collect``) and the parameter gradient autograd hands over before it
    is summed in."""
    return GRAD_BUFFERS_LIVE * largest_trainable_shard_bytes + largest_param_bytes


def device_charges(sizes: ModelSizes, train: TrainShape, device_memory: int, *, resident: int = 0,
                   persistent: int = 0, prefetch: int = 0, device_state: int = 0, accumulators: int = 0,
                   all_resident: bool = False,
                   activations: Optional[int] = None, device_is_host: bool = False) -> DeviceCharges:
    """The device charges of one step (see :class:`DeviceCharges`). ``device_is_host``: the CPU
    device, whose pool (the engine's own count) holds the shards only: gradients are host tensors
    and there is no caching allocator to leave headroom for."""
    trainable = [n for n, t in zip(sizes.shard_numels, sizes.shard_trainable) if t]
    largest_param = sizes.largest_param_numel or sizes.largest_shard_numel
    grads = grad_buffer_bytes(max(trainable, default=0) * sizes.itemsize,
                              largest_param * sizes.itemsize if trainable else 0)
    return DeviceCharges(persistent=persistent, resident=resident,
                         working_set=0 if all_resident else _working_set(sizes, train),
                         prefetch=0 if all_resident else prefetch,
                         activations=_activations(sizes, train) if activations is None else activations,
                         grad_buffers=0 if device_is_host else grads, device_state=device_state,
                         accumulators=accumulators,
                         headroom=0 if device_is_host else int(device_memory * DEVICE_HEADROOM))


def largest_shape(sizes: ModelSizes, train: TrainShape, device_memory: int, persistent: int = 0) -> tuple[int, int]:
    """The largest (micro-batch, sequence length) whose step fits ``device_memory`` with nothing
    resident and nothing prefetched: the sequence at the shape's micro-batch, else at micro-batch 1
    ((0, 0): not even one token)."""
    def fits(mb: int, seq: int) -> bool:
        t = replace(train, micro_batch=mb, seq_len=seq, activation_bytes=None)
        return device_charges(sizes, t, device_memory, persistent=persistent).total <= device_memory

    for mb in dict.fromkeys((train.micro_batch, 1)):
        if not fits(mb, 1):
            continue
        lo, hi = 1, max(1, train.seq_len)
        while fits(mb, hi):
            lo, hi = hi, hi * 2
            if hi > 1 << 24:
                return mb, lo
        while hi - lo > 1:  # fits(lo), not fits(hi)
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if fits(mb, mid) else (lo, mid)
        return mb, lo
    return 0, 0


def shape_refusal(sizes: ModelSizes, train: TrainShape, device_memory: int, persistent: int = 0) -> Optional[str]:
    """Why micro-batch x sequence cannot train within ``device_memory`` even with no unit resident,
    no prefetch and no optimizer state on the device (one line naming the largest shape that fits),
    or None when it can."""
    c = device_charges(sizes, train, device_memory, persistent=persistent)
    if c.total <= device_memory:
        return None
    mb, seq = largest_shape(sizes, train, device_memory, persistent)
    best = f"the largest that fits is {mb} x {seq}" if mb else "not even 1 x 1 fits"
    return (f"micro-batch x sequence {train.micro_batch} x {train.seq_len}"
            f"{' with checkpointing' if train.checkpointing else ''} cannot fit the device budget "
            f"{fmt(device_memory)} even with no unit resident: it needs {fmt(c.total)} ({c.describe()}); {best}; "
            "lower the micro-batch or sequence length, enable activation checkpointing, or raise "
            "pyinfinity.device_memory")


@dataclass
class Knobs:
    """One configuration the engine can realise (the config keys in brackets)."""

    param_device: str = "cpu"  # none | cpu | nvme          [offload_param.device]
    max_in_cpu: int = 0  # elements kept in RAM with nvme   [offload_param.max_in_cpu]
    optimizer_device: str = "cpu"  # cpu | nvme             [offload_optimizer.device]
    ratio: float = 1.0  # share of optimizer state on nvme  [offload_optimizer.ratio]
    persistence_threshold: int = 0  # elements               [stage3_param_persistence_threshold]
    prefetch_bytes: int = 0  #                              [stage3_prefetch_bucket_size]
    max_live: int = 0  # elements                           [stage3_max_live_parameters]
    param_buffer_count: int = 2  # NVMe reads in flight      [offload_param.buffer_count]
    param_buffer_size: int = 0  # bytes (largest shard)     [offload_param.buffer_size]
    optimizer_buffer_count: int = 4  # staging buffers       [offload_optimizer.buffer_count]
    prefetch: bool = True  #                                [pyinfinity.prefetch]
    optimizer_step_device: str = "cpu"  # cpu | device      [pyinfinity.optimizer_step_device]
    pipeline: bool = True  #                                [offload_optimizer.pipeline_read/write]
    resident_bytes: int = 0  # units kept on the device      [pyinfinity.resident_bytes]
    device_optimizer_bytes: int = 0  # their state there     [pyinfinity.device_optimizer_bytes]
    device_accumulator_bytes: int = 0  # fp32 grad sums there [pyinfinity.device_accumulator_bytes]


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
class StepTime:
    """Predicted seconds per optimizer step. compute/h2d/disk/optimizer are each resource's busy
    time (not additive: they overlap as the model says); total is the prediction."""

    compute: float
    h2d: float
    disk: float
    optimizer: float
    micro_batch: float  # one forward+backward, overlap included
    optimizer_phase: float  # the optimizer step, overlap included
    total: float
    bottleneck: str

    def breakdown(self) -> str:
        return (f"{self.total:.3f} s/step (compute {self.compute:.3f}, host<->device {self.h2d:.3f}, "
                f"disk {self.disk:.3f}, optimizer {self.optimizer:.3f}; bound by {self.bottleneck})")


@dataclass
class Placement:
    """A plan: the knobs, where each tensor class lives, memory charged to each budget, the
    predicted step time, and any budget it violates (empty for a plan ``solve`` returns)."""

    knobs: Knobs
    params: Share
    grads: Share
    optimizer: Share
    device_bytes: int  # peak on the device: persistent + working set + prefetch + activations
    host_bytes: int  # RAM: homes + gradients + staging (+ the device pool on the CPU device)
    pinned_bytes: int  # of host_bytes, the pinned pool (homes in RAM + staging)
    swap_bytes: int  # on disk over all swap directories
    swap_per_dir: dict[str, int]
    activation_bytes: int
    predicted: StepTime
    optimizer_step_device: str = "cpu"
    device_memory: int = 0  # the budget the config caps the engine at
    host_memory: int = 0
    violations: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    device_state_bytes: int = 0  # of device_bytes, resident units' optimizer state (a copy of its host home)
    accumulator_bytes: int = 0  # of device_bytes, fp32 gradient accumulators on the device
    charges: Optional[DeviceCharges] = None  # device_bytes by kind

    @property
    def feasible(self) -> bool:
        return not self.violations

    @property
    def disk_traffic(self) -> int:
        return self.params.disk + 2 * self.optimizer.disk

    def config_values(self) -> dict[str, Any]:
        """Dotted config key -> value for every knob the plan decides."""
        k = self.knobs
        out: dict[str, Any] = {
            "zero_optimization.offload_param.device": k.param_device,
            "zero_optimization.offload_param.max_in_cpu": int(k.max_in_cpu),
            "zero_optimization.offload_param.buffer_count": int(k.param_buffer_count),
            "zero_optimization.offload_param.buffer_size": int(max(1, k.param_buffer_size)),
            "zero_optimization.offload_optimizer.device": k.optimizer_device,
            "zero_optimization.offload_optimizer.ratio": float(k.ratio),
            "zero_optimization.offload_optimizer.buffer_count": int(k.optimizer_buffer_count),
            "zero_optimization.stage3_prefetch_bucket_size": int(k.prefetch_bytes),
            "zero_optimization.stage3_max_live_parameters": int(k.max_live),
            "zero_optimization.stage3_param_persistence_threshold": int(k.persistence_threshold),
            "pyinfinity.optimizer_step_device": k.optimizer_step_device,
            "pyinfinity.resident_bytes": int(k.resident_bytes),
            # the streamed device step steps everything there already (the config refuses both)
            "pyinfinity.device_optimizer_bytes": int(k.device_optimizer_bytes) if k.optimizer_step_device != "device"
            else 0,
            "pyinfinity.device_accumulator_bytes": int(k.device_accumulator_bytes),
            "pyinfinity.device_memory": int(self.device_memory),
            "pyinfinity.host_memory": int(self.host_memory),
        }
        return out

    def table(self) -> str:
        """The plan as a text table: tiers per tensor class, buffers, budgets, predicted time."""
        k, p = self.knobs, self.predicted

        def row(name: str, s: Share, extra: str = "") -> str:
            return f"  {name:<18}{fmt(s.device):>10}{fmt(s.ram):>10}{fmt(s.disk):>10}  {extra}"

        opt_tier = "cpu" if k.optimizer_device == "cpu" else f"nvme, ratio {k.ratio:.3f}"
        par_tier = k.param_device + (f", max_in_cpu {k.max_in_cpu:,}" if k.param_device == "nvme" else "")
        lines = [f"  {'tensor class':<18}{'device':>10}{'RAM':>10}{'disk':>10}  tier",
                 row("parameters", self.params, par_tier),
                 row("gradients (fp32)", self.grads, "accumulators (on the device: pyinfinity.device_accumulator_bytes)"
                     if self.grads.device else "host accumulator"),
                 row("optimizer states", self.optimizer, opt_tier),
                 "",
                 f"  device peak {fmt(self.device_bytes)} of {fmt(self.device_memory)} (activations "
                 f"{fmt(self.activation_bytes)}, prefetch {fmt(k.prefetch_bytes)}, persistent <= "
                 f"{k.persistence_threshold:,} elements"
                 + (f", optimizer state {fmt(self.device_state_bytes)}" if self.device_state_bytes else "") + ")",
                 f"  host RAM {fmt(self.host_bytes)} of {fmt(self.host_memory)} (pinned pool {fmt(self.pinned_bytes)})",
                 f"  swap: {fmt(self.swap_bytes)} of state on disk"
                 + (f"; swap files up to {fmt(max(self.swap_per_dir.values()))} per directory (grown in steps): "
                    + ", ".join(self.swap_per_dir) if self.swap_per_dir else ""),
                 f"  buffers: {k.param_buffer_count} parameter reads in flight of <= {fmt(k.param_buffer_size)}, "
                 f"{k.optimizer_buffer_count} optimizer staging buffers; optimizer steps on {self.optimizer_step_device}",
                 f"  predicted: {p.breakdown()}"]
        lines += [f"  note: {n}" for n in self.notes]
        lines += [f"  VIOLATES: {v}" for v in self.violations]
        return "\n".join(lines)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    def at_seq_len(self, seq_len: int) -> Optional["Placement"]:
        """The same knobs re-predicted at another sequence length (the engine plans before it sees
        a batch, at DEFAULT_SEQ_LEN); None when the planner's inputs were not kept."""
        inputs = getattr(self, "inputs", None)
        if inputs is None or seq_len <= 0:
            return None
        sizes, budgets, rates, train, paths = inputs
        return evaluate(sizes, replace(train, seq_len=int(seq_len)), budgets, rates, self.knobs, paths)

    def compare(self, step_seconds: Sequence[float], warmup: int = 2,
                tokens_per_micro_batch: Optional[int] = None, parts: Optional[dict[str, float]] = None) -> str:
        """Plan vs measured, for the end of a run: the median step after ``warmup`` steps against
        the prediction, and the ratio. With ``tokens_per_micro_batch`` (what the run really fed),
        the prediction is redone at that sequence length when it differs from the planned one.
        ``parts``: measured seconds per step of named parts (e.g. the optimizer's busy time), printed
        beside the predicted terms so a ratio far from 1 says which term is off."""
        steady = list(step_seconds[warmup:]) or list(step_seconds)
        if not steady:
            return f"plan: predicted {self.predicted.total:.3f} s/step; no step measured"
        steady.sort()
        med = steady[len(steady) // 2] if len(steady) % 2 else 0.5 * (steady[len(steady) // 2 - 1]
                                                                         + steady[len(steady) // 2])
        pred, shape = self.predicted, ""
        inputs = getattr(self, "inputs", None)
        if tokens_per_micro_batch and inputs is not None:
            train = inputs[3]
            seq = max(1, round(tokens_per_micro_batch / max(1, train.micro_batch)))
            if seq != train.seq_len:
                again = self.at_seq_len(seq)
                if again is not None:
                    shape = (f" at the run's {seq} tokens per sequence (planned at {train.seq_len}: "
                             f"{pred.total:.3f} s/step)")
                    pred = again.predicted
        measured = "".join(f", {k} {v:.3f}" for k, v in (parts or {}).items())
        terms = (f" [terms: compute {pred.compute:.3f}, host<->device {pred.h2d:.3f}, disk {pred.disk:.3f}, "
                 f"optimizer {pred.optimizer:.3f}, visible optimizer {pred.optimizer_phase:.3f}"
                 + (f"; measured {measured[2:]}" if measured else "") + "]")
        return (f"plan: predicted {pred.total:.3f} s/step{shape} (bound by {pred.bottleneck}), "
                f"measured {med:.3f} s/step (median of {len(steady)}){terms}, predicted/measured "
                f"{pred.total / med:.2f}")


# --------------------------------------------------------------------------------- evaluation


def _working_set(sizes: ModelSizes, train: TrainShape) -> int:
    """Parameter bytes on the device besides persistent shards and prefetch: the shard in use and
    the next one; with checkpointing a block's recompute keeps its whole set referenced until its
    backward is done."""
    if train.checkpointing:
        return sizes.block_bytes + sizes.largest_shard_bytes
    return 2 * sizes.largest_shard_bytes


def _activations(sizes: ModelSizes, train: TrainShape) -> int:
    if train.activation_bytes is not None:
        return train.activation_bytes
    return sizes.activation_bytes(train.micro_batch, train.seq_len, train.checkpointing)


def _is_cuda(rates: Rates, budgets: Budgets) -> bool:
    return not budgets.device_is_host and rates.device.startswith("cuda")


def evaluate(sizes: ModelSizes, train: TrainShape, budgets: Budgets, rates: Rates, knobs: Knobs,
             nvme_paths: Sequence[str] = ()) -> Placement:
    """Places the shards as the engine will under ``knobs``, charges the budgets and predicts the
    step time. Budget violations are listed in ``violations`` (not raised)."""
    isz = sizes.itemsize
    cuda = _is_cuda(rates, budgets)
    k = knobs
    # -- parameters: the engine's greedy rules, shard by shard
    params = Share()
    persistent = fetch_ram = fetch_disk = 0
    fetch_disk_s = 0.0  # seconds of one read of every disk-homed shard
    left = k.max_in_cpu if k.param_device == "nvme" else 0
    param_tier: list[str] = []
    resident_left = k.resident_bytes if k.param_device != "none" else 0
    resident = set()  # units kept on the device: whole units from the end of the model
    for i in range(len(sizes.shard_numels) - 1, -1, -1):
        nb = sizes.shard_numels[i] * isz
        if 0 < sizes.shard_numels[i] <= k.persistence_threshold or nb > resident_left:
            continue
        resident_left -= nb
        resident.add(i)
    resident_bytes = 0
    for i, n in enumerate(sizes.shard_numels):
        nb = n * isz
        if k.param_device == "none":
            tier = "device"
        elif k.param_device == "cpu":
            tier = "ram"
        else:
            tier = "ram" if left >= n else "disk"
            if tier == "ram":
                left -= n
        param_tier.append(tier)
        setattr(params, tier, getattr(params, tier) + nb)
        if tier == "device":
            continue
        if i in resident:
            resident_bytes += nb
        elif 0 < n <= k.persistence_threshold:
            persistent += nb
        elif tier == "ram":
            fetch_ram += nb
        else:
            fetch_disk += nb
            fetch_disk_s += rates.read_time(nb)
    # -- resident units whose optimizer state also lives on the device (stepped there): whole
    # units from the front of the model within device_optimizer_bytes, as the engine picks them
    dev_state: set[int] = set()
    dev_state_numel = 0
    per_param = device_state_cost(isz, train.grad_accum)
    if k.device_optimizer_bytes > 0 and k.optimizer_step_device != "device":
        dleft = k.device_optimizer_bytes
        for i, (n, trainable) in enumerate(zip(sizes.shard_numels, sizes.shard_trainable)):
            on_device = k.param_device == "none" or i in resident or 0 < n <= k.persistence_threshold
            if on_device and trainable and n and per_param * n <= dleft:
                dleft -= per_param * n
                dev_state.add(i)
                dev_state_numel += n
    # -- under accumulation, units whose fp32 gradient accumulator lives on the device: whole units
    # from the front within device_accumulator_bytes (those stepped there accumulate there anyway)
    dev_acc_numel = 0
    if train.grad_accum > 1 and k.device_accumulator_bytes > 0:
        aleft = k.device_accumulator_bytes
        for i, (n, trainable) in enumerate(zip(sizes.shard_numels, sizes.shard_trainable)):
            if trainable and n and i not in dev_state and GRAD_BYTES_PER_PARAM * n <= aleft:
                aleft -= GRAD_BYTES_PER_PARAM * n
                dev_acc_numel += n
    accumulator_bytes = GRAD_BYTES_PER_PARAM * dev_acc_numel
    # -- optimizer states: the first (1 - ratio) of the trainable elements in RAM
    total_train = sizes.trainable_numel
    ram_share = total_train * (1.0 - (k.ratio if k.optimizer_device == "nvme" else 0.0))
    optim = Share()
    placed = 0
    # optimizer state in RAM (segment a, stepped first), on disk (b); *_s: seconds of disk I/O
    seg_a = {"adam": 0, "param_dev": 0, "cast": 0, "param_disk_s": 0.0}
    seg_b = {"adam": 0, "param_dev": 0, "cast": 0, "param_disk_s": 0.0,
             "state": 0, "state_s": 0.0}
    biggest_disk_state = 0
    first_disk_state = 0
    # the one-pass CPU kernel writes the new bf16 weights into a home in RAM itself (its measured
    # rate includes it); other homes and dtypes get a cast pass from the fp32 master
    kernel_writes_home = sizes.dtype == torch.bfloat16 and k.optimizer_step_device != "device"
    for i, (n, trainable, ptier) in enumerate(zip(sizes.shard_numels, sizes.shard_trainable, param_tier)):
        if not trainable:
            continue
        ram = placed + n <= ram_share
        placed += n
        seg = seg_a if ram else seg_b
        if ram:
            optim.ram += OPT_BYTES_PER_PARAM * n
        else:
            optim.disk += OPT_BYTES_PER_PARAM * n
            seg_b["state"] += OPT_BYTES_PER_PARAM * n
            seg_b["state_s"] += rates.read_time(OPT_BYTES_PER_PARAM * n) + rates.write_time(OPT_BYTES_PER_PARAM * n)
            biggest_disk_state = max(biggest_disk_state, n)
            first_disk_state = first_disk_state or n
        if i in dev_state:  # stepped on the device: no CPU Adam, no cast into the home
            continue
        seg["adam"] += n
        if not (ptier == "ram" and kernel_writes_home):  # a cast pass into the home or a write buffer
            seg["cast"] += n
        if ptier == "device":
            seg["param_dev"] += n * isz
        elif ptier == "disk":
            seg["param_disk_s"] += rates.write_time(n * isz)
    # gradients on the host: none extra when they land in a parameter home in RAM (the step rewrites
    # it), a buffer of their own for homes on disk or on the device, fp32 under accumulation (with
    # the staging buffers they land in, pinned on a GPU; a device accumulator's sum lands in a
    # pinned fp32 buffer of its own instead)
    grad_staging = 0
    if train.grad_accum > 1:
        if total_train - dev_state_numel - dev_acc_numel > 0:
            largest_trainable = max((n for n, t in zip(sizes.shard_numels, sizes.shard_trainable) if t), default=0)
            grad_staging = GRAD_STAGING_SLOTS * isz * largest_trainable + ADD_SCRATCH
        grads = Share(device=accumulator_bytes,
                      ram=GRAD_BYTES_PER_PARAM * (total_train - dev_state_numel) + grad_staging)
    else:
        grads = Share(ram=sum(n * isz for i, (n, t, pt) in enumerate(zip(sizes.shard_numels, sizes.shard_trainable,
                                                                           param_tier))
                              if t and pt != "ram" and i not in dev_state))
    device_state_bytes = per_param * dev_state_numel
    # -- device: the charges of one step (DeviceCharges: shards, activations, gradients, state, headroom)
    everything = k.param_device == "none" or resident_bytes + persistent >= params.total
    charges = device_charges(sizes, train, budgets.device_memory, device_is_host=budgets.device_is_host,
                             resident=params.device if k.param_device == "none" else resident_bytes,
                             persistent=0 if k.param_device == "none" else persistent,
                             prefetch=k.prefetch_bytes if k.prefetch else 0,
                             device_state=device_state_bytes + DEVICE_STEP_SCRATCH if dev_state else 0,
                             accumulators=accumulator_bytes, all_resident=everything)
    acts = charges.activations
    shard_peak = charges.resident + charges.persistent + charges.working_set + charges.prefetch
    device_bytes = charges.total
    if k.optimizer_step_device == "device":  # two sets of [master|m|v] + grad buffers, after release_all
        device_bytes = max(device_bytes, persistent + 2 * 16 * sizes.largest_shard_numel)
    # -- host: homes in RAM, gradients, staging, write-back temporaries (+ the device pool on the CPU)
    staging = 0
    if optim.disk:
        staging += (k.optimizer_buffer_count if k.pipeline else 1) * OPT_BYTES_PER_PARAM * biggest_disk_state
    if cuda and fetch_disk:
        staging += k.param_buffer_count * sizes.largest_shard_bytes  # pinned read staging
    writeback = (sizes.largest_shard_numel * isz * k.optimizer_buffer_count) if isz != 4 else 0
    # pinned: what crosses PCIe (parameter homes, read staging); the optimizer state only when the
    # optimizer steps on the device (a CPU step reads it in place)
    pinned = params.ram + staging + (optim.ram if k.optimizer_step_device == "device" else 0)
    host_bytes = pinned + (optim.ram if k.optimizer_step_device != "device" else 0) + grads.ram + writeback + (device_bytes if budgets.device_is_host else 0)
    # -- swap: striped equally over the directories, each file grows in SWAP_GROW steps
    n_shards = len(sizes.shard_numels)
    swap_bytes = params.disk + optim.disk
    swap_per_dir: dict[str, int] = {}
    dirs = list(nvme_paths) or budgets.swap_paths
    if swap_bytes and dirs:
        spaces = (1 if params.disk else 0) + (1 if optim.disk else 0)
        per = math.ceil(swap_bytes / len(dirs)) + spaces * SWAP_GROW + 2 * n_shards * SWAP_SLOT_ALIGN
        swap_per_dir = {d: per for d in dirs}
    violations: list[str] = []
    if device_bytes > budgets.device_memory:
        violations.append(
            f"device memory: needs {fmt(device_bytes)} (parameters resident/in flight {fmt(shard_peak)}, "
            f"activations {fmt(acts)} for micro-batch {train.micro_batch} x {train.seq_len} tokens"
            f"{' with checkpointing' if train.checkpointing else ''}; {charges.describe()}), "
            f"budget {fmt(budgets.device_memory)}")
    if host_bytes > budgets.host_memory:
        violations.append(
            f"host RAM: needs {fmt(host_bytes)} (parameters {fmt(params.ram)}, optimizer states {fmt(optim.ram)}, "
            f"fp32 gradients {fmt(grads.ram)}, staging {fmt(staging + writeback)}"
            f"{', device pool ' + fmt(device_bytes) if budgets.device_is_host else ''}), budget {fmt(budgets.host_memory)}")
    if swap_bytes and not dirs:
        violations.append(f"swap: needs {fmt(swap_bytes)} on disk but no nvme_path is given")
    elif swap_bytes:
        by_fs: dict[int, tuple[list[str], int, int]] = {}
        for i, d in enumerate(budgets.swap):
            if d.path in swap_per_dir:
                paths, need, free = by_fs.get(d.fs_id or -(i + 1), ([], 0, d.free))
                by_fs[d.fs_id or -(i + 1)] = (paths + [d.path], need + swap_per_dir[d.path], free)
        for paths, need, free in by_fs.values():
            if need > free:
                violations.append(f"swap: needs {fmt(need)} of swap, {fmt(free)} free at {', '.join(paths)}; "
                                  f"add {fmt(need - free)}, or a second path")
    if resident_bytes:
        notes_resident = (f"{fmt(resident_bytes)} of parameters stay on the device: the whole units that fit "
                          f"pyinfinity.resident_bytes: {int(k.resident_bytes)} ({fmt(k.resident_bytes)})")
    pred = predict(sizes, train, rates, knobs, cuda=cuda, fetch_ram=fetch_ram, fetch_disk=fetch_disk,
                   fetch_disk_s=fetch_disk_s, seg_a=seg_a, seg_b=seg_b, first_disk_state=first_disk_state,
                   device_stepped=dev_state_numel, device_accumulated=dev_acc_numel)
    notes = [notes_resident] if resident_bytes else []
    if dev_state:
        notes.append(f"the optimizer state of {len(dev_state)} resident units ({dev_state_numel / 1e6:,.0f}M "
                     f"parameters, {fmt(device_state_bytes)} with their gradients) lives on the device too and steps there "
                     "(pyinfinity.device_optimizer_bytes)")
    if dev_acc_numel:
        notes.append(f"the fp32 gradient accumulators of {dev_acc_numel / 1e6:,.0f}M parameters "
                     f"({fmt(accumulator_bytes)}) live on the device: their micro-batch gradients are added there and "
                     "leave it once a step (pyinfinity.device_accumulator_bytes)")
    return Placement(knobs=replace(knobs), params=params, grads=grads, optimizer=optim, device_bytes=device_bytes,
                     host_bytes=host_bytes,
                     # of host_bytes: the gradient staging and the buffers device accumulators land in are pinned too
                     pinned_bytes=pinned + ((grad_staging - ADD_SCRATCH if grad_staging else 0) + accumulator_bytes
                                            if cuda else 0),
                     swap_bytes=swap_bytes, swap_per_dir=swap_per_dir,
                     activation_bytes=acts, predicted=pred, device_memory=budgets.device_memory,
                     optimizer_step_device=k.optimizer_step_device,
                     host_memory=budgets.host_memory, violations=violations, notes=notes,
                     device_state_bytes=device_state_bytes, accumulator_bytes=accumulator_bytes, charges=charges)


def _div(a: float, b: float) -> float:
    if a <= 0:
        return 0.0
    return a / b if b > 0 else math.inf


def predict(sizes: ModelSizes, train: TrainShape, rates: Rates, knobs: Knobs, *, cuda: bool, fetch_ram: int,
            fetch_disk: int, fetch_disk_s: float, seg_a: dict, seg_b: dict, first_disk_state: int,
            device_stepped: int = 0, device_accumulated: int = 0) -> StepTime:
    """Seconds per optimizer step from the byte flows ``evaluate`` worked out (see the module doc)."""
    isz = sizes.itemsize
    train_numel = sizes.trainable_numel
    # -- one micro-batch
    if train.compute_seconds is not None:
        compute = train.compute_seconds
    else:
        compute = (sizes.flops_per_step(train.micro_batch, train.seq_len, train.checkpointing) / rates.matmul
                   * (1 + ELEMENTWISE_SHARE))
    passes = FETCH_PASSES
    ram_copy = _div(passes * fetch_ram, rates.h2d)
    disk_read = passes * fetch_disk_s
    # gradients off the device (those of units stepped on the device stay there; a device
    # accumulator's fp32 sum leaves once a step, counted here per micro-batch)
    g = train.grad_accum
    host_acc = train_numel - device_stepped - device_accumulated if g > 1 else train_numel
    grads_off = (_div((train_numel - device_stepped - device_accumulated) * isz, rates.d2h)
                 + _div(device_accumulated * GRAD_BYTES_PER_PARAM / g, rates.d2h)) if cuda else 0.0
    # memory-bound host work: bytes touched / (2 x memcpy rate), a memcpy touching each byte twice
    # the first micro-batch of a window copies its gradient into the fp32 accumulator (isz + 4
    # bytes touched), later ones add to it (isz + 8)
    touched = ((isz + 4) + (g - 1) * (isz + 8)) / g
    # host work per micro-batch: accumulating gradients (the accumulation worker's), and the engine's
    # per-shard bookkeeping
    accumulate = _div(host_acc * touched, 2 * rates.memcpy) + len(sizes.shard_numels) * rates.shard_overhead
    overlap = knobs.prefetch and knobs.prefetch_bytes >= sizes.largest_shard_bytes
    latency = rates.read_time(sizes.largest_shard_bytes) if (fetch_disk and overlap) else 0.0
    if cuda:
        # copies run on the swap stream, host accumulation in the grad hooks: both overlap the
        # GPU's compute; without prefetch every fetch (disk read, then H2D) is waited for
        disk_h2d = _div(passes * fetch_disk, rates.h2d)
        link = ram_copy + disk_h2d + grads_off
        serial = 0.0 if overlap else ram_copy + disk_h2d + disk_read
        micro = max(compute + serial, link, disk_read, accumulate) + latency
        h2d_busy = link
    else:
        # the CPU device: fetches from RAM and the accumulation are memcpys of the compute thread
        cpu_side = compute + ram_copy + accumulate
        micro = (max(cpu_side, disk_read) if overlap else cpu_side + disk_read) + latency
        h2d_busy = ram_copy + accumulate
    # -- the optimizer step: norm, RAM part, then the disk part pipelined. The global norm is
    # combined from per-unit norms taken as the gradients were made (under accumulation by the
    # accumulation worker in the boundary micro-batch's add, chunk by chunk while it is in cache)
    host = sum(sizes.shard_trainable) * rates.shard_step_overhead

    pageable = rates.h2d_pageable or rates.h2d  # gradients and write-back sources are pageable

    def adam_time(numel: int) -> float:
        if knobs.optimizer_step_device == "device" and cuda:
            # streamed: state + grad to the device, state back, one shard at a time (the copy back waits)
            return _div(12 * numel, rates.h2d) + _div(4 * numel, pageable) + _div(12 * numel, rates.d2h)
        return _div(numel, rates.adam)

    def cpu_time(seg: dict) -> float:
        # Adam, the cast pass from the fp32 master straight into the home (or the write buffer of a
        # home on disk or on the device), and a device home's copy from that pageable buffer
        return (adam_time(seg["adam"]) + _div(seg["cast"] * (4 + isz), 2 * rates.memcpy)
                + _div(seg["param_dev"], pageable))

    a = cpu_time(seg_a)
    b = cpu_time(seg_b)
    first_read = rates.read_time(OPT_BYTES_PER_PARAM * first_disk_state) if first_disk_state else 0.0
    disk_a = seg_a["param_disk_s"] + first_read
    disk_b = seg_b["state_s"] + seg_b["param_disk_s"] - first_read
    if knobs.pipeline:
        backlog = max(0.0, disk_a - a)
        opt_phase = host + a + max(b, backlog + disk_b)
    else:
        opt_phase = host + a + disk_a + b + disk_b
    visible = opt_phase
    overlapped = train.overlap_step == "on" or (train.overlap_step == "auto" and (
        cuda or (knobs.optimizer_device == "nvme" and knobs.ratio > 0)))
    if overlapped and knobs.optimizer_step_device != "device":
        back = BACKWARD_SHARE[train.checkpointing]
        window = micro * ((1.0 - back) if train.norm_first else back)
        hideable = opt_phase if cuda else max(0.0, opt_phase - (host + a + b))
        tail = hideable * sizes.largest_shard_numel / max(1, sizes.numel)
        visible = opt_phase - hideable + max(hideable - window, tail)
    total = g * micro + visible
    disk_busy = g * disk_read + disk_a + disk_b
    busy = {"compute": g * compute, "host<->device": g * h2d_busy, "disk": disk_busy, "optimizer": host + a + b}
    bottleneck = max(busy, key=busy.get)
    return StepTime(compute=busy["compute"], h2d=busy["host<->device"], disk=disk_busy, optimizer=busy["optimizer"],
                    micro_batch=micro, optimizer_phase=visible, total=total, bottleneck=bottleneck)


# --------------------------------------------------------------------------------- the solver


@dataclass
class Fixed:
    """Knobs the user set explicitly (None = the planner decides)."""

    param_device: Optional[str] = None
    max_in_cpu: Optional[int] = None
    optimizer_device: Optional[str] = None
    ratio: Optional[float] = None
    persistence_threshold: Optional[int] = None
    prefetch_bytes: Optional[int] = None
    max_live: Optional[int] = None
    param_buffer_count: Optional[int] = None
    param_buffer_size: Optional[int] = None
    optimizer_buffer_count: Optional[int] = None
    prefetch: Optional[bool] = None
    optimizer_step_device: Optional[str] = None
    resident_bytes: Optional[int] = None
    device_optimizer_bytes: Optional[int] = None
    device_accumulator_bytes: Optional[int] = None


def _optimizer_split(sizes: ModelSizes, ram_bytes: int) -> float:
    """The nvme ratio whose RAM prefix (as the engine places it) fits in ``ram_bytes``."""
    total = sizes.trainable_numel
    if total == 0:
        return 0.0
    fit = max(0, ram_bytes) // OPT_BYTES_PER_PARAM
    if fit >= total:
        return 0.0
    return min(1.0, max(0.0, 1.0 - fit / total))


def _fill(sizes: ModelSizes, train: TrainShape, budgets: Budgets, rates: Rates, k: Knobs, fixed: Fixed) -> Knobs:
    """Sizes the buffers of ``k`` from the device budget (those the user did not fix)."""
    isz = sizes.itemsize
    acts = _activations(sizes, train)
    if fixed.persistence_threshold is None:
        small = sizes.small_shard_bytes(SMALL_SHARD_NUMEL)
        k.persistence_threshold = SMALL_SHARD_NUMEL if small <= PERSISTENT_SHARE * budgets.device_memory else 0
    persistent = sizes.small_shard_bytes(k.persistence_threshold) if k.persistence_threshold else 0
    working = _working_set(sizes, train)
    base = device_charges(sizes, train, budgets.device_memory, persistent=persistent, activations=acts,
                          device_is_host=budgets.device_is_host)
    room = budgets.device_memory - base.total  # what the budget leaves for resident units and prefetch
    cap = (2 if budgets.device_is_host else 4) * max(sizes.block_bytes, sizes.largest_shard_bytes)
    if fixed.prefetch_bytes is None:
        k.prefetch_bytes = max(0, min(room, cap))
    if fixed.prefetch is None:
        k.prefetch = True
    if fixed.resident_bytes is None and budgets.device_is_host:
        k.resident_bytes = 0  # the CPU device: a resident copy would save a memcpy and double the RAM
    elif fixed.resident_bytes is None:
        # fill the device: every unit stays if they all fit beside the activations; else what is left
        # after the working set and prefetch (resident units are never fetched again)
        offloaded = sizes.param_bytes - persistent
        total_room = room + base.working_set  # every unit resident: no working set, no prefetch
        if offloaded <= total_room:
            k.resident_bytes, k.prefetch_bytes = offloaded, 0 if fixed.prefetch_bytes is None else k.prefetch_bytes
        else:
            k.resident_bytes = max(0, room - k.prefetch_bytes)
    if fixed.device_optimizer_bytes is None or fixed.device_accumulator_bytes is None:
        res = fixed.resident_bytes if fixed.resident_bytes is not None else k.resident_bytes
        step_on = fixed.optimizer_step_device or k.optimizer_step_device
        k.device_accumulator_bytes, k.device_optimizer_bytes = _split_device_room(
            sizes, train, budgets, rates, replace(k, resident_bytes=res, optimizer_step_device=step_on), fixed,
            persistent, acts)
    if fixed.max_live is None:
        k.max_live = max(1, (persistent + working + k.prefetch_bytes) // isz)
    if fixed.param_buffer_size is None:
        k.param_buffer_size = max(1, sizes.largest_shard_bytes)
    if fixed.param_buffer_count is None:
        k.param_buffer_count = int(max(2, min(32, k.prefetch_bytes // max(1, sizes.largest_shard_bytes) + 1)))
    if fixed.optimizer_buffer_count is None:
        k.optimizer_buffer_count = 4
    return k


def device_state_cost(itemsize: int, grad_accum: int) -> int:
    """Device bytes a parameter of a unit stepped on the device costs beyond its weights: the fp32
    master and moments, its gradient (kept there until the step when it cannot step during
    backward) and under accumulation the fp32 accumulator."""
    return OPT_BYTES_PER_PARAM + itemsize + (GRAD_BYTES_PER_PARAM if grad_accum > 1 else 0)


def _device_room(sizes: ModelSizes, train: TrainShape, budgets: Budgets, rates: Rates, k: Knobs,
                 persistent: int, acts: int) -> int:
    """What the device budget leaves after the shards ``k`` keeps there, their working set and
    prefetch, the activations, the gradient buffers and the headroom (0 on the CPU device)."""
    if budgets.device_is_host or not _is_cuda(rates, budgets):
        return 0
    offloaded = sizes.param_bytes - persistent
    c = device_charges(sizes, train, budgets.device_memory, resident=min(max(0, k.resident_bytes), offloaded),
                       persistent=persistent, prefetch=k.prefetch_bytes if k.prefetch else 0,
                       all_resident=k.resident_bytes >= offloaded, activations=acts)
    return max(0, budgets.device_memory - c.total)


def _device_state_room(sizes: ModelSizes, train: TrainShape, budgets: Budgets, rates: Rates, k: Knobs,
                       persistent: int, acts: int) -> int:
    """Device bytes for resident units' optimizer state: ``_device_room`` less the device step's
    fp32 chunk. None on the CPU device (the state is in RAM already), without resident units or
    with the streamed device step."""
    if k.optimizer_step_device == "device" or k.resident_bytes <= 0:
        return 0
    return max(0, _device_room(sizes, train, budgets, rates, k, persistent, acts) - DEVICE_STEP_SCRATCH)


def _split_device_room(sizes: ModelSizes, train: TrainShape, budgets: Budgets, rates: Rates, k: Knobs,
                       fixed: Fixed, persistent: int, acts: int) -> tuple[int, int]:
    """(device_accumulator_bytes, device_optimizer_bytes) for what the config leaves "auto". Under
    accumulation the fp32 accumulators come first: at 4 bytes a parameter they take the host's
    add and the copy off the device of every micro-batch but the last, where optimizer state
    (``device_state_cost``, 18 bytes at bf16) takes one CPU step; the room they leave goes to
    optimizer state, each unit stepped there freeing its own accumulator. Without accumulation
    all of it goes to optimizer state."""
    state_room = _device_state_room(sizes, train, budgets, rates, k, persistent, acts)
    acc_room = _device_room(sizes, train, budgets, rates, k, persistent, acts) if train.grad_accum > 1 else 0
    need = GRAD_BYTES_PER_PARAM * sizes.trainable_numel
    if fixed.device_optimizer_bytes is not None:
        acc_room = max(0, acc_room - fixed.device_optimizer_bytes)
    acc = fixed.device_accumulator_bytes if fixed.device_accumulator_bytes is not None else min(acc_room, need)
    if fixed.device_optimizer_bytes is not None:
        return acc, fixed.device_optimizer_bytes
    if train.grad_accum <= 1:
        return acc, state_room
    left = max(0, state_room - min(acc, need))
    if acc >= need and left:  # every accumulator is on the device: a unit stepped there frees its own
        per = device_state_cost(sizes.itemsize, train.grad_accum)
        left = left * per // (per - GRAD_BYTES_PER_PARAM)
    return acc, left


def candidates(sizes: ModelSizes, train: TrainShape, budgets: Budgets, rates: Rates, fixed: Fixed,
               have_disk: bool, steps: int = 16) -> Iterable[Knobs]:
    """Knob sets to evaluate: every parameter/optimizer tier split the config leaves open (parameters
    in RAM by whole shards on a grid of ``steps``, the optimizer state given the RAM that is left)."""
    base = _fill(sizes, train, budgets, rates, Knobs(), fixed)
    for name in ("max_in_cpu", "ratio", "persistence_threshold", "prefetch_bytes", "max_live", "param_buffer_count",
                 "param_buffer_size", "optimizer_buffer_count", "prefetch", "optimizer_step_device", "resident_bytes",
                 "device_optimizer_bytes", "device_accumulator_bytes"):
        v = getattr(fixed, name)
        if v is not None:
            setattr(base, name, v)
    if fixed.param_device:
        pdevs = [fixed.param_device]
    else:
        # on a GPU, "cpu" with every unit resident is "none" done better (a pinned home the gradients
        # land in and the new values come from): "none" is left to configs that ask for it
        pdevs = ([] if _is_cuda(rates, budgets) else ["none"]) + ["cpu"] + (["nvme"] if have_disk else [])
    odevs = [fixed.optimizer_device] if fixed.optimizer_device else (["cpu", "nvme"] if have_disk else ["cpu"])
    if fixed.optimizer_step_device:
        steps_on = [fixed.optimizer_step_device]
    else:
        steps_on = ["cpu", "device"] if _is_cuda(rates, budgets) else ["cpu"]
    for step_on in steps_on:
        yield from _tier_candidates(replace(base, optimizer_step_device=step_on), sizes, train, budgets, rates,
                                    fixed, pdevs, odevs, steps)


def _tier_candidates(base: Knobs, sizes: ModelSizes, train: TrainShape, budgets: Budgets, rates: Rates,
                     fixed: Fixed, pdevs: list, odevs: list, steps: int) -> Iterable[Knobs]:
    """Parameter tier x parameter RAM share x optimizer tier (its RAM share: all the RAM left, or none)."""
    numel = sizes.numel
    for pd in pdevs:
        if pd == "nvme" and fixed.max_in_cpu is None:
            grid = sorted({int(numel * i / steps) for i in range(steps)})
        else:
            grid = [base.max_in_cpu]
        for mic in grid:
            for od in odevs:
                k = replace(base, param_device=pd, max_in_cpu=mic if pd == "nvme" else 0, optimizer_device=od)
                if pd == "none":
                    k.prefetch_bytes = 0 if fixed.prefetch_bytes is None else k.prefetch_bytes
                if od == "cpu":
                    k.ratio = 1.0 if fixed.ratio is None else fixed.ratio
                    yield k
                    continue
                if fixed.ratio is not None:
                    yield k
                    continue
                # what RAM is left for optimizer states once everything else is charged
                probe = evaluate(sizes, train, budgets, rates, replace(k, ratio=1.0))
                left = budgets.host_memory - probe.host_bytes
                yield replace(k, ratio=_optimizer_split(sizes, left))
                yield replace(k, ratio=1.0)


def solve(sizes: ModelSizes, train: TrainShape, budgets: Budgets, rates: Rates, fixed: Optional[Fixed] = None,
          nvme_paths: Sequence[str] = ()) -> Placement:
    """The fastest placement that respects every budget (ties: the least disk traffic, i.e. RAM
    first). Raises PlanError naming the numbers when no candidate fits."""
    fixed = fixed or Fixed()
    paths = list(nvme_paths) or budgets.swap_paths
    have_disk = bool(paths)
    evaluated = [evaluate(sizes, train, budgets, rates, k, paths)
                 for k in candidates(sizes, train, budgets, rates, fixed, have_disk)]
    ok = [p for p in evaluated if p.feasible]
    if not ok:
        raise PlanError(_explain(sizes, train, budgets, evaluated, paths))
    best_t = min(p.predicted.total for p in ok)
    near = [p for p in ok if p.predicted.total <= best_t * (1 + TIE)]
    best = min(near, key=lambda p: (p.disk_traffic, p.predicted.total))
    best.notes.extend(_notes(best, sizes, budgets, len(evaluated), len(ok)))
    log.info("plan: params %s, optimizer %s; %s", best.knobs.param_device, best.knobs.optimizer_device,
             best.predicted.breakdown())
    return best


def _notes(p: Placement, sizes: ModelSizes, budgets: Budgets, n_eval: int, n_ok: int) -> list[str]:
    out = [f"{n_ok} of {n_eval} candidate placements fit the budgets; this one is the fastest predicted"
           " (ties go to less disk traffic)"]
    if p.optimizer.disk and p.optimizer.ram:
        out.append(f"optimizer state split: {fmt(p.optimizer.ram)} in RAM, the overflow {fmt(p.optimizer.disk)} on disk")
    if p.params.disk and p.params.ram:
        out.append(f"parameters split: {fmt(p.params.ram)} in RAM, {fmt(p.params.disk)} on disk")
    if p.knobs.optimizer_step_device == "device":
        out.append("the optimizer steps on the device: states streamed through two device buffers")
    else:
        out.append("the optimizer steps on the CPU (the one-pass Adam kernel)")
    return out


def _explain(sizes: ModelSizes, train: TrainShape, budgets: Budgets, evaluated: list[Placement],
             paths: Sequence[str]) -> str:
    """The error for an infeasible problem: what the least-violating candidate needs, and what to change."""
    def deficit(p: Placement) -> float:
        d = max(0, p.device_bytes - budgets.device_memory) + max(0, p.host_bytes - budgets.host_memory)
        if p.swap_bytes:
            d += max(0, p.swap_bytes - budgets.swap_free) if paths else p.swap_bytes
        return d

    # explain the tightest constraint first: if some candidates fit the device and RAM, only swap
    # is short (report the least swap needed); else if some fit the device, RAM is short
    fit_dev = [p for p in evaluated if p.device_bytes <= budgets.device_memory]
    fit_host = [p for p in fit_dev if p.host_bytes <= budgets.host_memory]
    pool = fit_host or fit_dev or evaluated
    best = min(pool, key=(lambda p: p.swap_bytes) if fit_host else deficit) if pool else None
    msgs = list(best.violations) if best else ["no candidate placement"]
    hints = []
    for v in msgs:
        if v.startswith("device memory"):
            mb, seq = largest_shape(sizes, train, budgets.device_memory)
            hints.append("raise the device budget (--gpu-memory / pyinfinity.device_memory), lower the "
                         "micro-batch or sequence length, or enable activation checkpointing"
                         + (f" (the largest micro-batch x sequence that fits with nothing resident is {mb} x {seq})"
                            if mb and not budgets.device_is_host else ""))
        elif v.startswith("host RAM") and not paths:
            state = sizes.trainable_numel * (OPT_BYTES_PER_PARAM + GRAD_BYTES_PER_PARAM) + sizes.param_bytes
            hints.append(f"give a swap directory (--nvme DIR / nvme_path) with at least "
                         f"{fmt(max(0, (best.host_bytes if best else state) - budgets.host_memory))} free, or raise the "
                         "host budget (--cpu-memory / pyinfinity.host_memory)")
        elif v.startswith("host RAM"):
            grads = best.grads.ram if best else sizes.trainable_numel * GRAD_BYTES_PER_PARAM
            hints.append("raise the host budget (--cpu-memory / pyinfinity.host_memory): "
                         + (f"the fp32 gradients ({fmt(grads)}) and " if grads else "")
                         + "the staging buffers stay in RAM")
        elif v.startswith("swap: needs") and "no nvme_path" in v:
            hints.append("give a swap directory (--nvme DIR / nvme_path)")
        elif v.startswith("swap"):
            hints.append("or lower the state on disk: raise the host budget (--cpu-memory / pyinfinity.host_memory, "
                         f"now {fmt(budgets.host_memory)}) or train a smaller model")
    if best is not None and sizes.numel:
        # what the state costs a parameter, so a refusal can be checked against the model's size
        state = best.params.total + best.optimizer.total + best.grads.total
        hints.append(f"the training state is {state / sizes.numel:.1f} bytes a parameter ({fmt(state)} for "
                     f"{sizes.numel / 1e9:.2f}B parameters: weights {fmt(best.params.total)}, fp32 master and "
                     f"moments {fmt(best.optimizer.total)}"
                     + (f", fp32 gradients {fmt(best.grads.total)}" if best.grads.total else "") + ")")
    return "; ".join(msgs + hints)


__all__ = ["DeviceCharges", "device_charges", "grad_buffer_bytes", "largest_shape", "shape_refusal",
           "device_state_cost", "Placement", "Knobs", "Share", "StepTime", "TrainShape", "Fixed", "PlanError", "evaluate", "predict",
           "solve", "candidates", "fmt"]
