"""Evaluating one candidate placement (:class:`Knobs`): :func:`evaluate` takes the layout the
engine realises under it (``layout.plan_layout``: each shard's tiers by the engine's own rules,
every pool's bytes), lists the budgets it exceeds and predicts the step time from the measured
rates (:func:`predict`), into a :class:`Placement`.

The step-time model (one optimizer step = ``grad_accum`` micro-batches, then the optimizer):
  * micro-batch: matmul and attention FLOPs / matmul rate, plus ELEMENTWISE_SHARE of it for the
    non-matmul kernels (norms, rotary, activations, the loss); every non-persistent shard is fetched twice (forward
    and backward; the recompute of checkpointing re-fetches instead of the backward); fetches
    from RAM are host->device copies (on the CPU device: memcpys the compute thread does itself,
    so they add to compute), fetches from disk are SwapEngine reads that prefetch overlaps with
    compute; gradients leave the device and are accumulated in fp32 on the host by a worker
    thread (overlapping the GPU's backward; on the CPU device it adds to the compute).
    With prefetch: max(compute [+ copies on the CPU device], copies, disk) + one shard's latency;
    without prefetch: the sum. Under accumulation the adds into device accumulators are compute
    too (the gradient and the fp32 sum streamed at DEVICE_ADD_RATE): with every unit resident and
    N micro-batches the step is N x that compute, then what of the optimizer nothing hides.
  * optimizer: the global gradient norm (from per-unit norms taken as the gradients were made,
    under accumulation by the boundary micro-batch's adds), the one-pass Adam kernel over every
    parameter the CPU steps at the measured rate of the optimizer state's format's kernel (which
    includes writing bf16 weights into a home in RAM; a home on disk or on the device, or another
    dtype, adds a cast pass from the fp32 master); the RAM part first, then the disk part
    pipelined (read k+1 || step k || write k-1) with the parameter write-back, its reads and
    writes at the disk's measured duplex share (``Rates.disk_duplex``) of the two one after the
    other. Serial after the last backward, unless the step overlaps it
    (``pyinfinity.overlap_step``, :attr:`TrainShape.overlap_step`): then the boundary
    micro-batch's backward (and recompute) hides up to its own length of it (on the CPU device
    only the disk part: Adam would compete for the cores), and at least the largest shard's share
    stays visible (it is often the embedding, the last to get its gradient). With gradient
    clipping or fp16 loss scaling (:attr:`TrainShape.norm_first`) no unit can step before the
    global norm, known when the backward ends: the step then runs in model order behind the next
    forward, which waits for each unit's new values, so only that forward's share of a
    micro-batch hides it. Under accumulation on a GPU the step is at least the host's
    memory-bound work in a row: every micro-batch's adds, then the CPU step (they share the
    memory bus, so one does not hide the other).
  * units whose state lives on the device step there on the compute stream, unhidden, at the
    format's device rate (``Rates.device_adam_rate``); ``placement.candidates`` weighs the host.
"""
from __future__ import annotations

import math
import statistics
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Optional, Sequence

import torch

from pyinfinity.config import auto_overlap_off
from pyinfinity.layout.charges import DeviceCharges, TrainShape, accumulator_bytes, fmt
from pyinfinity.layout.pools import Layout, Share, plan_layout
from pyinfinity.layout.shards import Knobs
from pyinfinity.layout.sizes import ModelSizes
from pyinfinity.plan.budgets import Budgets
from pyinfinity.plan.rates import Rates

FETCH_PASSES = 2  # forward + backward (or recompute) fetch of every non-persistent shard
# share of a micro-batch's compute after its forward: backward (2 passes of 3), with checkpointing
# recompute + backward (3 of 4); an overlapped optimizer step can hide behind it (one that waits for
# the global norm: behind the rest, the next forward)
BACKWARD_SHARE = {False: 2 / 3, True: 3 / 4}
# non-matmul kernels of a decoder layer (norms, rotary, SiLU, residual adds, softmax and the loss)
# as a share of its matmul time: the matmul-only prediction was 0.76-0.80x the measured step at
# 1.1B and 7B on an H200 (BENCHMARKS.md), where the step is compute-bound
ELEMENTWISE_SHARE = 0.25
# device-memory bytes/s at which a device accumulator's add streams (the gradient read, the fp32 sum
# read and written, on the compute stream in every micro-batch): an HBM GPU's, not probed
DEVICE_ADD_RATE = 2e12


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
    state: str = "fp32"  # the optimizer state's format (TrainShape.optimizer_state)
    checkpoint_staging: int = 0  # of host_bytes, a save's shard copies (pyinfinity.checkpoint_staging)

    @property
    def feasible(self) -> bool:
        return not self.violations

    @property
    def disk_traffic(self) -> int:
        return self.params.disk + 2 * self.optimizer.disk

    def config_values(self) -> dict[str, Any]:
        """Dotted config key -> value for every knob the plan decides."""
        k = self.knobs
        return {
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

    def table(self) -> str:
        """The plan as a text table: tiers per tensor class, buffers, budgets, predicted time."""
        k, p = self.knobs, self.predicted

        def row(name: str, s: Share, extra: str = "") -> str:
            return f"  {name:<18}{fmt(s.device):>10}{fmt(s.ram):>10}{fmt(s.disk):>10}  {extra}"

        opt_tier = ("cpu" if k.optimizer_device == "cpu" else f"nvme, ratio {k.ratio:.3f}") + f"; {self.state} state"
        par_tier = k.param_device + (f", max_in_cpu {k.max_in_cpu:,}" if k.param_device == "nvme" else "")
        lines = [f"  {'tensor class':<18}{'device':>10}{'RAM':>10}{'disk':>10}  tier",
                 row("parameters", self.params, par_tier),
                 row("gradients", self.grads, "fp32 accumulators (on the device: pyinfinity.device_accumulator_bytes)"
                     if self.grads.device else "host (fp32 under accumulation)"),
                 row("optimizer states", self.optimizer, opt_tier),
                 "",
                 f"  device peak {fmt(self.device_bytes)} of {fmt(self.device_memory)} (activations "
                 f"{fmt(self.activation_bytes)}, prefetch {fmt(k.prefetch_bytes)}, persistent <= "
                 f"{k.persistence_threshold:,} elements"
                 + (f", optimizer state {fmt(self.device_state_bytes)}" if self.device_state_bytes else "") + ")",
                 f"  host RAM {fmt(self.host_bytes)} of {fmt(self.host_memory)} (pinned pool {fmt(self.pinned_bytes)}"
                 + (f", checkpoint staging {fmt(self.checkpoint_staging)}: pyinfinity.checkpoint_staging"
                    if self.checkpoint_staging else "") + ")",
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
        return evaluate(sizes, train_at_seq_len(sizes, train, seq_len), budgets, rates, self.knobs, paths)

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
        med = statistics.median(steady)
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


def flops_compute(sizes: ModelSizes, train: TrainShape, rates: Rates) -> float:
    """Seconds of one micro-batch's forward + backward from its FLOPs at the matmul rate, plus
    ELEMENTWISE_SHARE of it for the kernels around the matmuls (a measured figure, when there is
    one, is ``TrainShape.compute_seconds``)."""
    return (sizes.flops_per_step(train.micro_batch, train.seq_len, train.checkpointing) / rates.matmul
            * (1 + ELEMENTWISE_SHARE))


def train_at_seq_len(sizes: ModelSizes, train: TrainShape, seq_len: int) -> TrainShape:
    """``train`` at another sequence length; a measured compute figure scaled by the FLOPs."""
    out = replace(train, seq_len=int(seq_len))
    if train.compute_seconds is not None:
        was = sizes.flops_per_step(train.micro_batch, train.seq_len, train.checkpointing)
        now = sizes.flops_per_step(train.micro_batch, out.seq_len, train.checkpointing)
        out.compute_seconds = train.compute_seconds * now / was if was > 0 else None
    return out


def on_cuda(rates: Rates, budgets: Budgets) -> bool:
    """Whether the rates and budgets are those of a CUDA device (not the CPU device)."""
    return not budgets.device_is_host and rates.device.startswith("cuda")


def evaluate(sizes: ModelSizes, train: TrainShape, budgets: Budgets, rates: Rates, knobs: Knobs,
             nvme_paths: Sequence[str] = ()) -> Placement:
    """The layout the engine realises under ``knobs`` (``layout.plan_layout``: where each shard
    lives, every pool's bytes), the budgets it violates (listed, not raised) and the predicted
    step time."""
    cuda = on_cuda(rates, budgets)
    dirs = list(nvme_paths) or budgets.swap_paths
    lay = plan_layout(sizes, train, knobs, budgets.device_memory, device_is_host=budgets.device_is_host, cuda=cuda,
                      swap_dirs=dirs)
    work = _work(sizes, train, rates, knobs, lay)
    pred = predict(sizes, train, rates, knobs, cuda=cuda, fetch_ram=lay.fetch_ram, fetch_disk=lay.fetch_disk,
                   fetch_disk_s=work.fetch_disk_s, seg_a=work.seg_a, seg_b=work.seg_b,
                   first_disk_state=lay.first_disk_state, device_stepped=lay.device_state_numel,
                   device_accumulated=lay.accumulator_numel)
    return Placement(knobs=replace(knobs), params=lay.params, grads=lay.grads, optimizer=lay.optimizer,
                     device_bytes=lay.device_bytes, host_bytes=lay.host_bytes, pinned_bytes=lay.pinned_bytes,
                     swap_bytes=lay.swap_bytes, swap_per_dir=lay.swap_per_dir,
                     activation_bytes=lay.charges.activations, predicted=pred, device_memory=budgets.device_memory,
                     optimizer_step_device=knobs.optimizer_step_device, host_memory=budgets.host_memory,
                     violations=_violations(lay, train, budgets, dirs), notes=_notes(lay, knobs),
                     checkpoint_staging=lay.checkpoint_staging,
                     device_state_bytes=lay.device_state_bytes, accumulator_bytes=lay.accumulator_bytes,
                     charges=lay.charges, state=train.state_format.name)


@dataclass
class _Work:
    """The flows of one step the time model needs beyond the layout's pools: seconds of one read
    of every disk-homed shard, and the optimizer's work on state in RAM (segment a, stepped first)
    and on disk (b)."""

    fetch_disk_s: float
    seg_a: dict
    seg_b: dict


def _work(sizes: ModelSizes, train: TrainShape, rates: Rates, knobs: Knobs, lay: Layout) -> _Work:
    """The fetches' and the optimizer's work under the layout ``lay`` (see :class:`_Work`)."""
    sl = lay.shards
    state_fmt = train.state_format
    fetch_disk_s = sum(rates.read_time(sizes.shard_bytes(i)) for i, t in enumerate(sl.param)
                       if t == "disk" and i not in sl.resident and i not in sl.persistent)
    seg_a = {"adam": 0, "param_dev": 0, "cast": 0, "param_disk_s": 0.0}
    seg_b = {"adam": 0, "param_dev": 0, "cast": 0, "param_disk_s": 0.0, "state": 0, "state_s": 0.0}
    # the one-pass CPU kernel writes the new bf16 weights into a home in RAM itself (its measured
    # rate includes it); other homes and dtypes get a cast pass from the fp32 master. A bf16 master
    # is the weights' home itself: stepped where it lies in RAM, read from disk or the device first
    kernel_writes_home = sizes.dtype == torch.bfloat16 and knobs.optimizer_step_device != "device"
    dev_state = set(sl.device_state)
    for i, (n, otier, ptier) in enumerate(zip(sizes.shard_numels, sl.optimizer, sl.param)):
        if not otier:
            continue
        seg = seg_a if otier == "ram" else seg_b
        if otier == "disk":
            nb = int(state_fmt.shard_bytes(n))
            seg_b["state"] += nb
            seg_b["state_s"] += rates.read_time(nb) + rates.write_time(nb)
        if i in dev_state:  # stepped on the device: no CPU Adam, no cast into the home
            continue
        seg["adam"] += n
        if not (ptier == "ram" and kernel_writes_home):  # a cast pass into the home or a write buffer
            seg["cast"] += n
        if ptier == "device":
            seg["param_dev"] += sizes.shard_bytes(i) * (2 if state_fmt.weights_are_master else 1)
        elif ptier == "disk":
            nb = sizes.shard_bytes(i)
            seg["param_disk_s"] += rates.write_time(nb) + (rates.read_time(nb) if state_fmt.weights_are_master else 0.0)
    return _Work(fetch_disk_s=fetch_disk_s, seg_a=seg_a, seg_b=seg_b)


def _violations(lay: Layout, train: TrainShape, budgets: Budgets, dirs: Sequence[str]) -> list[str]:
    """The budgets the layout ``lay`` exceeds, one line each."""
    out: list[str] = []
    c = lay.charges
    if lay.device_bytes > budgets.device_memory:
        shard_peak = c.resident + c.persistent + c.working_set + c.prefetch
        out.append(
            f"device memory: needs {fmt(lay.device_bytes)} (parameters resident/in flight {fmt(shard_peak)}, "
            f"activations {fmt(c.activations)} for micro-batch {train.micro_batch} x {train.seq_len} tokens"
            f"{' with checkpointing' if train.checkpointing else ''}; {c.describe()}), "
            f"budget {fmt(budgets.device_memory)}")
    if lay.host_bytes > budgets.host_memory:
        out.append(
            f"host RAM: needs {fmt(lay.host_bytes)} (parameters {fmt(lay.params.ram)}, optimizer states "
            f"{fmt(lay.optimizer.ram)}, {train.host_grads} {fmt(lay.grads.ram)}, staging "
            f"{fmt(lay.staging + lay.writeback)}"
            f"{', checkpoint staging ' + fmt(lay.checkpoint_staging) if lay.checkpoint_staging else ''}"
            f"{', device pool ' + fmt(lay.device_bytes) if budgets.device_is_host else ''}), "
            f"budget {fmt(budgets.host_memory)}")
    if lay.swap_bytes and not dirs:
        out.append(f"swap: needs {fmt(lay.swap_bytes)} on disk but no nvme_path is given")
    elif lay.swap_bytes:
        out += swap_violations(lay.swap_per_dir, budgets)
    return out


def swap_shortfalls(swap_per_dir: dict[str, int], budgets: Budgets) -> list[tuple[list[str], int, int]]:
    """The swap filesystems the files of ``swap_per_dir`` (bytes per directory) do not fit:
    (its directories, the bytes they need, its free bytes) each; directories on one filesystem
    add up."""
    by_fs: dict[int, tuple[list[str], int, int]] = {}
    for i, d in enumerate(budgets.swap):
        if d.path in swap_per_dir:
            paths, need, free = by_fs.get(d.fs_id or -(i + 1), ([], 0, d.free))
            by_fs[d.fs_id or -(i + 1)] = (paths + [d.path], need + swap_per_dir[d.path], free)
    return [(paths, need, free) for paths, need, free in by_fs.values() if need > free]


def swap_violations(swap_per_dir: dict[str, int], budgets: Budgets) -> list[str]:
    """:func:`swap_shortfalls` as the plan's violations, one line each."""
    return [f"swap: needs {fmt(need)} of swap, {fmt(free)} free at {', '.join(paths)}; add {fmt(need - free)}, "
            "or a second path" for paths, need, free in swap_shortfalls(swap_per_dir, budgets)]


def _notes(lay: Layout, k: Knobs) -> list[str]:
    """What the layout keeps on the device, for the plan's table."""
    notes = []
    if lay.resident_bytes:
        notes.append(f"{fmt(lay.resident_bytes)} of parameters stay on the device: the whole units that fit "
                     f"pyinfinity.resident_bytes: {int(k.resident_bytes)} ({fmt(k.resident_bytes)})")
    if lay.shards.device_state:
        notes.append(f"the optimizer state of {len(lay.shards.device_state)} resident units "
                     f"({lay.device_state_numel / 1e6:,.0f}M parameters, {fmt(lay.device_state_bytes)} with their "
                     "gradients) lives on the device too and steps there (pyinfinity.device_optimizer_bytes)")
    if lay.accumulator_numel:
        notes.append(f"the fp32 gradient accumulators of {lay.accumulator_numel / 1e6:,.0f}M parameters "
                     f"({fmt(lay.accumulator_bytes)}) live on the device: their micro-batch gradients are added "
                     "there and leave it once a step (pyinfinity.device_accumulator_bytes)")
    return notes


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
    compute = train.compute_seconds if train.compute_seconds is not None else flops_compute(sizes, train, rates)
    passes = FETCH_PASSES
    ram_copy = _div(passes * fetch_ram, rates.h2d)
    disk_read = passes * fetch_disk_s
    # gradients off the device (those of units stepped on the device stay there; a device
    # accumulator's fp32 sum leaves once a step, counted here per micro-batch)
    g = train.grad_accum
    host_acc = train_numel - device_stepped - device_accumulated if g > 1 else train_numel
    grads_off = (_div((train_numel - device_stepped - device_accumulated) * isz, rates.d2h)
                 + _div(accumulator_bytes(device_accumulated) / g, rates.d2h)) if cuda else 0.0
    # memory-bound host work: bytes touched / (2 x memcpy rate), a memcpy touching each byte twice
    # (the gradient adds at their own probe's pace where measured, Rates.accumulate); the first
    # micro-batch of a window copies its gradient into the fp32 accumulator (isz + 4 bytes
    # touched), later ones add to it (isz + 8)
    touched = ((isz + 4) + (g - 1) * (isz + 8)) / g
    # host work per micro-batch: accumulating gradients (the accumulation worker's), and the engine's
    # per-shard bookkeeping
    if rates.accumulate > 0:  # the add's measured pace (the first micro-batch's copy taken at the same pace a byte)
        adds = _div(host_acc * touched / (isz + 8), rates.accumulate)
    else:
        adds = _div(host_acc * touched, 2 * rates.memcpy)
    accumulate = adds + len(sizes.shard_numels) * rates.shard_overhead
    overlap = knobs.prefetch and knobs.prefetch_bytes >= sizes.largest_shard_bytes
    latency = rates.read_time(sizes.largest_shard_bytes) if (fetch_disk and overlap) else 0.0
    if cuda and g > 1:  # the device accumulators' adds run on the compute stream, every micro-batch
        compute += _div(device_accumulated * isz + 2 * accumulator_bytes(device_accumulated), DEVICE_ADD_RATE)
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

    state_bytes = train.state_format.state_bytes

    device_rate = rates.device_adam_rate(train.optimizer_state)

    def adam_time(numel: int) -> float:
        if knobs.optimizer_step_device == "device" and cuda:
            # streamed: state + grad in, the format's step there, state back, a shard at a time
            return (_div(state_bytes * numel, rates.h2d) + _div(4 * numel, pageable) + _div(numel, device_rate)
                    + _div(state_bytes * numel, rates.d2h))
        return _div(numel, rates.adam_rate(train.optimizer_state))

    def cpu_time(seg: dict) -> float:
        # Adam, the cast pass from the fp32 master straight into the home (or the write buffer of a
        # home on disk or on the device), and a device home's copy from that pageable buffer
        return (adam_time(seg["adam"]) + _div(seg["cast"] * (4 + isz), 2 * rates.memcpy)
                + _div(seg["param_dev"], pageable))

    a = cpu_time(seg_a)
    b = cpu_time(seg_b)
    first_read = rates.read_time(first_disk_state) if first_disk_state else 0.0  # bytes of the first shard on disk
    disk_a = seg_a["param_disk_s"] + first_read
    disk_b = seg_b["state_s"] + seg_b["param_disk_s"] - first_read
    if knobs.pipeline:
        # the pipeline's reads (shard k+1) run beside its writes (k-1): at the disk's duplex share
        disk_b *= rates.disk_duplex
        backlog = max(0.0, disk_a - a)
        opt_phase = host + a + max(b, backlog + disk_b)
    else:
        opt_phase = host + a + disk_a + b + disk_b
    visible = opt_phase
    overlapped = train.overlap_step == "on" or (train.overlap_step == "auto" and auto_overlap_off(
        cuda, knobs.optimizer_device == "nvme" and knobs.ratio > 0) is None)
    if overlapped and knobs.optimizer_step_device != "device":
        back = BACKWARD_SHARE[train.checkpointing]
        window = micro * ((1.0 - back) if train.norm_first else back)
        hideable = opt_phase if cuda else max(0.0, opt_phase - (host + a + b))
        tail = hideable * sizes.largest_shard_numel / max(1, sizes.numel)
        visible = opt_phase - hideable + max(hideable - window, tail)
    # units whose state lives on the device step on the compute stream: time nothing hides
    device_step = _div(device_stepped, device_rate) if cuda else 0.0
    total = g * micro + device_step + visible
    if cuda and g > 1 and knobs.optimizer_step_device != "device":
        # the accumulation worker's adds and the CPU step both stream host memory: an overlapped step
        # runs beside the next window's adds, not in time of its own
        total = max(total, g * accumulate + opt_phase)
    disk_busy = g * disk_read + disk_a + disk_b
    busy = {"compute": g * compute, "host<->device": g * h2d_busy, "disk": disk_busy,
            "optimizer": host + a + b + device_step}
    bottleneck = max(busy, key=busy.get)
    return StepTime(compute=busy["compute"], h2d=busy["host<->device"], disk=disk_busy, optimizer=busy["optimizer"],
                    micro_batch=micro, optimizer_phase=visible, total=total, bottleneck=bottleneck)


__all__ = ["StepTime", "Placement", "evaluate", "predict", "on_cuda", "flops_compute", "train_at_seq_len",
           "swap_violations", "swap_shortfalls", "FETCH_PASSES", "BACKWARD_SHARE", "ELEMENTWISE_SHARE",
           "DEVICE_ADD_RATE"]
