"""What the parameter coordinator counts: the device budget its shard buffers are held to, how
shards reached the device, and how much of the transfer time the compute waited for."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch


class DeviceBudgetError(RuntimeError):
    """The device budget cannot hold what one module call needs."""


class DeviceBudgetExceeded(torch.OutOfMemoryError):
    """The device ran out of memory in forward or backward before any unit was stepped. The engine
    has moved its resident units and device optimizer state back to their host homes (``gave_up``
    says what) and freed the step's buffers: the same micro-batch may be run again."""

    def __init__(self, message: str, gave_up: str = "") -> None:
        super().__init__(message)
        self.gave_up = gave_up


@dataclass
class FetchStats:
    """How shards reached the device (cumulative; the engine reports deltas per step)."""

    prefetch_hits: int = 0  # uses served by a prefetch issued earlier
    on_demand: int = 0  # uses that had to start the fetch themselves
    prefetch_issued: int = 0
    prefetch_wasted: int = 0  # prefetched, then released unused
    divergences: int = 0  # iterations whose module order left the trace
    releases: int = 0
    fetch_wait_seconds: float = 0.0  # host time blocked waiting for a shard to arrive
    fetched_bytes: int = 0  # shard bytes copied to the device (host -> device)
    grad_bytes: int = 0  # gradient bytes handed off the device (device -> host)
    step_wait_seconds: float = 0.0  # host time a fetch waited for the optimizer to write a unit's new values

    def snapshot(self) -> "FetchStats":
        return FetchStats(**self.__dict__)


@dataclass
class DeviceBudget:
    """Bytes of shard buffers resident on the compute device, against ``device_memory``.

    On a GPU the allocator's own figure (activations and workspaces included) must also leave
    room: torch's per-process memory fraction enforces the same cap on everything, so a prefetch
    that only counted shards would run the step out of memory.
    """

    capacity: Optional[int]
    resident: int = 0
    peak: int = 0
    fixed: int = 0  # buffers and persistent shards, counted in resident too
    cuda_device: Optional[torch.device] = None
    # bytes a prefetch must leave free for what the step allocates after it: on a GPU the flat
    # gradients being collected, the largest parameter gradient and the allocator's headroom; on the
    # CPU device the planner's headroom (``layout.charges.device_charges``: the engine sets it from
    # the same charges as the planner). A fetch the compute waits for may still use all of capacity.
    reserve: int = 0
    # on a GPU: the bytes torch's allocator held for the rest of the process when the engine was
    # made (the budget is on top of them; the allocator's figures are read minus this)
    base: int = 0

    def fits(self, nbytes: int) -> bool:
        if self.capacity is None:
            return True
        if self.resident + nbytes > self.capacity:
            return False
        if self.cuda_device is not None:  # a host-side counter: no synchronisation
            headroom = max(self.reserve, min(256 << 20, self.capacity // 8))
            used = torch.cuda.memory_allocated(self.cuda_device) - self.base
            return used + nbytes <= self.capacity - headroom
        return self.resident + nbytes <= self.capacity - self.reserve

    def allocator_peaks(self) -> tuple[int, int]:
        """On a GPU: torch's peak allocated and reserved bytes since their last reset, less what
        the process held before the engine (``base``)."""
        assert self.cuda_device is not None
        return (torch.cuda.max_memory_allocated(self.cuda_device) - self.base,
                torch.cuda.max_memory_reserved(self.cuda_device) - self.base)

    step_peak: int = 0  # the high-water since the last ``reset_step_peak`` (the engine's per-step measure)

    def reset_step_peak(self) -> None:
        """The next step's peak starts from what is resident now."""
        self.step_peak = self.resident

    def add(self, nbytes: int) -> None:
        self.resident += nbytes
        self.peak = max(self.peak, self.resident)
        self.step_peak = max(self.step_peak, self.resident)

    def sub(self, nbytes: int) -> None:
        self.resident -= nbytes


@dataclass
class OverlapSample:
    """Per-step transfer time and the part of it the compute waited for (seconds)."""

    transfer_s: float = 0.0
    stalled_s: float = 0.0
