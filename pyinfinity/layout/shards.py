"""Where each shard lives: the one rule the planner evaluates and the engine applies.

Given the resolved knobs (:class:`Knobs`, what the config can express) and each shard's size,
the rule says, shard by shard, where its parameters' home is (the device, RAM or disk: parameter
shards fill ``max_in_cpu`` elements of RAM in creation order), whether it stays on the device
between steps (small persistent shards, and whole units from the end of the model within
``resident_bytes``: backward needs them first), whether its optimizer state lives on the device
too (resident units from the front within ``device_optimizer_bytes``: their gradients come last
in backward, when a CPU step would have the least time left), whether its fp32 gradient
accumulator lives on the device (under accumulation, from the front within
``device_accumulator_bytes``, besides those stepped there), and where its optimizer state's home
is (the first ``1 - ratio`` of the trainable elements in RAM, the rest on disk).

The planner feeds it the model's sizes and the format's nominal state bytes
(``plan.evaluation``); the engine feeds it the shards it partitioned and the bytes their homes
really have (``zero.state``), and places what it returns (``zero.device_placement``).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional, Sequence

from pyinfinity.layout.charges import GRAD_BYTES_PER_PARAM


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
    checkpoint_staging: int = 0  # a save's copies, host RAM [pyinfinity.checkpoint_staging]


PARAM_TIERS = {"none": "device", "cpu": "ram"}  # offload_param.device -> the home of every shard ("nvme": split)


class ParamTiers:
    """The home of each parameter shard in creation order: every shard's on the device or in RAM,
    or with ``nvme`` the first shards that fit ``max_in_cpu`` elements in RAM and the rest on disk
    (a shard that does not fit goes to disk; a later smaller one may still fit)."""

    def __init__(self, param_device: str, max_in_cpu: int) -> None:
        self.param_device = param_device
        self.ram_left = int(max_in_cpu) if param_device == "nvme" else 0

    def next(self, numel: int) -> str:
        """The tier of the next shard: ``"device"``, ``"ram"`` or ``"disk"``."""
        if self.param_device in PARAM_TIERS:
            return PARAM_TIERS[self.param_device]
        if self.ram_left >= numel:
            self.ram_left -= numel
            return "ram"
        return "disk"


def param_tiers(numels: Sequence[int], param_device: str, max_in_cpu: int) -> list[str]:
    """:class:`ParamTiers` over every shard."""
    tiers = ParamTiers(param_device, max_in_cpu)
    return [tiers.next(n) for n in numels]


def is_persistent(numel: int, threshold: int) -> bool:
    """A shard small enough to stay on the device (``stage3_param_persistence_threshold``)."""
    return 0 < numel <= threshold


def resident_units(shard_bytes: Sequence[int], persistent: Sequence[bool], budget: int) -> set[int]:
    """Indices of the units kept on the device between steps: whole units from the end of the
    model (backward needs them first) that fit ``budget`` bytes, skipping the persistent ones
    (resident anyway) and any unit larger than what is left."""
    left = int(budget)
    out: set[int] = set()
    for i in range(len(shard_bytes) - 1, -1, -1):
        if persistent[i] or shard_bytes[i] > left:
            continue
        left -= shard_bytes[i]
        out.add(i)
    return out


def device_state_units(costs: Sequence[float], eligible: Sequence[bool], budget: int) -> list[int]:
    """Indices of the units whose optimizer state lives on the device: from the front of the model,
    each eligible unit (on the device, trainable, not empty) whose ``costs[i]`` (``device_state_cost``
    x its elements) fits what ``budget`` has left."""
    left = float(budget)
    out: list[int] = []
    if left <= 0:
        return out
    for i, (cost, ok) in enumerate(zip(costs, eligible)):
        if ok and cost <= left:
            left -= cost
            out.append(i)
    return out


def device_accumulator_units(numels: Sequence[int], eligible: Sequence[bool], budget: int) -> list[int]:
    """Indices of the units whose fp32 gradient accumulator lives on the device: from the front,
    each eligible unit (trainable, not empty, not stepped on the device) whose accumulator
    (GRAD_BYTES_PER_PARAM a parameter) fits what ``budget`` has left."""
    left = int(budget)
    out: list[int] = []
    if left <= 0:
        return out
    for i, (n, ok) in enumerate(zip(numels, eligible)):
        if ok and GRAD_BYTES_PER_PARAM * n <= left:
            left -= GRAD_BYTES_PER_PARAM * n
            out.append(i)
    return out


def optimizer_tiers(numels: Sequence[int], trainable: Sequence[bool], optimizer_device: str, ratio: float) -> list[str]:
    """Where each shard's optimizer state's home is: ``"ram"`` for the first ``1 - ratio`` of the
    trainable elements (every one with ``optimizer_device`` "cpu"), ``"disk"`` for the rest,
    ``""`` for a frozen shard (no state)."""
    total = sum(n for n, t in zip(numels, trainable) if t)
    ram_share = total * (1.0 - (ratio if optimizer_device == "nvme" else 0.0))
    placed = 0
    out = []
    for n, t in zip(numels, trainable):
        if not t:
            out.append("")
            continue
        out.append("ram" if placed + n <= ram_share else "disk")
        placed += n
    return out


@dataclass
class ShardLayout:
    """Where each shard lives (index = the shard's index in creation order); see the module doc."""

    param: list[str]  # "device" | "ram" | "disk": the parameters' home
    optimizer: list[str]  # "ram" | "disk" | "" (frozen): the optimizer state's home
    persistent: set[int]  # small shards kept on the device
    resident: set[int]  # whole units kept on the device within resident_bytes
    device_state: list[int]  # units whose optimizer state lives (and steps) on the device
    device_accumulators: list[int]  # units whose fp32 gradient accumulator lives on the device

    def on_device(self, i: int) -> bool:
        """Whether shard ``i``'s parameters are on the device between steps."""
        return self.param[i] == "device" or i in self.resident or i in self.persistent


def device_units(numels: Sequence[int], nbytes: Sequence[int], trainable: Sequence[bool], persistent: Sequence[bool],
                 knobs: Knobs, accumulation: int, state_cost: Callable[[int], float],
                 all_on_device: Optional[bool] = None) -> tuple[set[int], list[int], list[int]]:
    """The device side of the rule: (resident units, units whose optimizer state is on the device,
    units whose accumulator is on the device). ``state_cost(i)``: the device bytes of shard
    ``i``'s state, gradient and accumulator (``device_state_cost`` x its elements);
    ``all_on_device``: every shard's home is the device (``param_device`` "none")."""
    if all_on_device is None:
        all_on_device = knobs.param_device == "none"
    resident = set() if all_on_device else resident_units(nbytes, persistent, knobs.resident_bytes)
    state: list[int] = []
    if knobs.device_optimizer_bytes > 0 and knobs.optimizer_step_device != "device":
        eligible = [(all_on_device or i in resident or persistent[i]) and trainable[i] and n > 0
                    for i, n in enumerate(numels)]
        state = device_state_units([state_cost(i) if ok else 0.0 for i, ok in enumerate(eligible)], eligible,
                                   knobs.device_optimizer_bytes)
    accumulators: list[int] = []
    if accumulation > 1 and knobs.device_accumulator_bytes > 0:
        stepped = set(state)
        eligible = [trainable[i] and n > 0 and i not in stepped for i, n in enumerate(numels)]
        accumulators = device_accumulator_units(numels, eligible, knobs.device_accumulator_bytes)
    return resident, state, accumulators


def shard_layout(numels: Sequence[int], nbytes: Sequence[int], trainable: Sequence[bool], knobs: Knobs,
                 accumulation: int, state_cost: Callable[[int], float]) -> ShardLayout:
    """The whole rule over a model's shards (see the module doc)."""
    persistent = [is_persistent(n, knobs.persistence_threshold) for n in numels]
    resident, state, accumulators = device_units(numels, nbytes, trainable, persistent, knobs, accumulation,
                                                 state_cost)
    return ShardLayout(param=param_tiers(numels, knobs.param_device, knobs.max_in_cpu),
                       optimizer=optimizer_tiers(numels, trainable, knobs.optimizer_device, knobs.ratio),
                       persistent={i for i, p in enumerate(persistent) if p}, resident=resident,
                       device_state=state, device_accumulators=accumulators)


__all__ = ["Knobs", "ParamTiers", "ShardLayout", "param_tiers", "is_persistent", "resident_units",
           "device_state_units", "device_accumulator_units", "optimizer_tiers", "device_units", "shard_layout"]
