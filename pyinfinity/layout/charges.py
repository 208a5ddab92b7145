"""What one training step holds on the compute device, by kind (:class:`DeviceCharges`): the one
place the device budget is charged. The planner's placements and buffer sizes, the engine's
prefetch reserve, its sizing of device optimizer state and its refusal of a micro-batch x
sequence that cannot fit (:func:`shape_refusal`) all take their figures here."""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Optional

from pyinfinity.config_values import STATE_FORMATS, StateFormat
from pyinfinity.layout.sizes import ModelSizes

OPT_BYTES_PER_PARAM = 12  # fp32 master + exp_avg + exp_avg_sq (zero.optim.formats.AdamFp32.bytes_per_param;
# the fp32 state: STATE_FORMATS has the others)
GRAD_BYTES_PER_PARAM = 4  # fp32 accumulator on the host
DEVICE_HEADROOM = 0.10  # of the device budget kept free for the allocator's fragmentation / workspace
DEVICE_STEP_SCRATCH = 4 * (16 << 20)  # the device step's fp32 gradient chunk (zero.optim.formats.DEVICE_CHUNK)
# the torch step of a compressed state on the device: zero.state_formats.DEVICE_CHUNK elements at a
# time, DEVICE_SCRATCH_PER_ELEMENT bytes of temporaries each
FORMAT_STEP_SCRATCH = 40 * (1 << 22)
# flat unit gradients alive on the device at once in backward: the unit being collected and the one
# whose copy off the device is still in flight (its memory is reused only after the copy ran)
GRAD_BUFFERS_LIVE = 2


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
    # the optimizer state's format (Config.optimizer_state_format: a key of config.STATE_FORMATS)
    optimizer_state: str = "fp32"

    @property
    def tokens(self) -> int:
        return self.micro_batch * self.seq_len

    @property
    def state_format(self) -> StateFormat:
        return STATE_FORMATS[self.optimizer_state]

    @property
    def host_grads(self) -> str:
        """What the host's gradient buffers are: fp32 accumulators, or gradients in the compute
        dtype (for homes on disk or on the device, or weights that are the master)."""
        return "fp32 gradients" if self.grad_accum > 1 else "gradient buffers"


@dataclass
class DeviceCharges:
    """What the device holds at the peak of a step, by kind (bytes). The one place the device
    budget is charged: the planner's placement and buffer sizing (``evaluate``, ``candidates``), the
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


def accumulator_bytes(numel: int) -> int:
    """Bytes of the fp32 gradient accumulators of ``numel`` parameters (on the host or the device)."""
    return GRAD_BYTES_PER_PARAM * int(numel)


def state_room_freeing_accumulators(room: int, per_param: float) -> int:
    """Device bytes of optimizer state (``per_param`` a parameter, ``device_state_cost``) that
    ``room`` holds when every accumulator is on the device already: a unit stepped there frees
    its own accumulator."""
    return int(room * per_param // (per_param - GRAD_BYTES_PER_PARAM))


def prefetch_cap(sizes: ModelSizes, device_is_host: bool) -> int:
    """The most a prefetch bucket is worth: four of the largest blocks (units) ahead on a GPU, two
    on the CPU device (a copy there is a memcpy the compute thread makes itself)."""
    return (2 if device_is_host else 4) * max(sizes.block_bytes, sizes.largest_shard_bytes)


def grad_buffer_bytes(largest_trainable_shard_bytes: int, largest_param_bytes: int) -> int:
    """Device bytes of gradients in backward beyond the activations: GRAD_BUFFERS_LIVE flat unit
    gradients (``coordinator._collect``) and the parameter gradient autograd hands over before it
    is summed in."""
    return GRAD_BUFFERS_LIVE * largest_trainable_shard_bytes + largest_param_bytes


def working_set_bytes(sizes: ModelSizes, train: TrainShape) -> int:
    """Parameter bytes on the device besides persistent shards and prefetch: the shard in use and
    the next one; with checkpointing a block's recompute keeps its whole set referenced until its
    backward is done."""
    if train.checkpointing:
        return sizes.block_bytes + sizes.largest_shard_bytes
    return 2 * sizes.largest_shard_bytes


def activation_charge(sizes: ModelSizes, train: TrainShape) -> int:
    """The activations of one micro-batch: the known figure, else the model's estimate."""
    if train.activation_bytes is not None:
        return train.activation_bytes
    return sizes.activation_bytes(train.micro_batch, train.seq_len, train.checkpointing)



def loss_room(sizes: ModelSizes, train: TrainShape, layer_held: int, head_grad: int) -> int:
    """With checkpointing, the loss's tensors (the logits and their fp32 copies) and a decoder
    layer's recompute are never on the device at once, and neither are what each phase holds
    besides: a layer's working set and its gradient buffers (``layer_held``) in backward, the
    output head (at most the largest shard) and its gradient (``head_grad``) at the loss. The
    activation estimate charges the larger of the loss and a layer's recompute beside the whole
    working set and gradient buffers; the bytes of its loss share the loss can find in what the
    layer phase holds beyond the head's are charged once, not twice. 0 for a measured activation
    figure (it is what the step held)."""
    if train.activation_bytes is not None:
        return 0
    over = sizes.loss_over_layer(train.micro_batch, train.seq_len, train.checkpointing)
    return min(over, max(0, layer_held - sizes.largest_shard_bytes - head_grad))


def device_charges(sizes: ModelSizes, train: TrainShape, device_memory: int, *, resident: int = 0,
                   persistent: int = 0, prefetch: int = 0, device_state: int = 0, accumulators: int = 0,
                   all_resident: bool = False,
                   activations: Optional[int] = None, device_is_host: bool = False) -> DeviceCharges:
    """The device charges of one step (see :class:`DeviceCharges`). ``device_is_host``: the CPU
    device, whose pool (the engine's own count) holds the shards only: gradients are host tensors
    and there is no caching allocator to leave headroom for."""
    trainable = [n for n, t in zip(sizes.shard_numels, sizes.shard_trainable) if t]
    largest_param = sizes.largest_param_numel or sizes.largest_shard_numel
    largest_trainable = max(trainable, default=0) * sizes.itemsize
    grads = 0 if device_is_host else grad_buffer_bytes(largest_trainable,
                                                       largest_param * sizes.itemsize if trainable else 0)
    working = 0 if all_resident else working_set_bytes(sizes, train)
    acts = activation_charge(sizes, train) if activations is None else activations
    acts -= loss_room(sizes, train, working + grads, largest_trainable)
    return DeviceCharges(persistent=persistent, resident=resident, working_set=working,
                         prefetch=0 if all_resident else prefetch, activations=acts,
                         grad_buffers=grads, device_state=device_state,
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


def step_scratch(state: str) -> int:
    """Device bytes of temporaries the device step of the ``state`` format takes at its peak."""
    return DEVICE_STEP_SCRATCH if state == "fp32" else FORMAT_STEP_SCRATCH


def device_state_cost(itemsize: int, grad_accum: int, state: str = "fp32",
                      state_bytes: Optional[float] = None) -> float:
    """Device bytes a parameter of a unit stepped on the device costs beyond its weights: its
    optimizer state (the fp32 master and moments, or the ``state`` format's; ``state_bytes``: the
    bytes of the engine's copy of a home instead, ``OptimStateFormat.bytes_per_param``), its
    gradient (kept there until the step when it cannot step during backward) and under
    accumulation the fp32 accumulator."""
    state_cost = STATE_FORMATS[state].state_bytes if state_bytes is None else state_bytes
    return state_cost + itemsize + (GRAD_BYTES_PER_PARAM if grad_accum > 1 else 0)


__all__ = ["PlanError", "TrainShape", "DeviceCharges", "device_charges", "grad_buffer_bytes", "working_set_bytes",
           "accumulator_bytes", "state_room_freeing_accumulators", "prefetch_cap",
           "activation_charge", "loss_room", "largest_shape", "shape_refusal", "device_state_cost", "step_scratch",
           "fmt", "DEVICE_HEADROOM", "OPT_BYTES_PER_PARAM", "GRAD_BYTES_PER_PARAM", "DEVICE_STEP_SCRATCH",
           "FORMAT_STEP_SCRATCH", "GRAD_BUFFERS_LIVE"]
