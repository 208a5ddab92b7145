"""The records the optimizer's parts share: what is kept about one trainable shard, one step's
result and job, the window of a step that began in backward, and the per-phase timings."""
from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any, Optional

import torch

from pyinfinity.swap.tensor_swapper import SwapRecord
from pyinfinity.zero.optim.groups import ShardRanges
from pyinfinity.zero.partition import FlatShard


@dataclass(eq=False)
class ShardOptimState:
    """What the optimizer keeps about one trainable shard."""

    shard: FlatShard
    home: SwapRecord  # the state in its format (OptimStateFormat), in RAM or on NVMe
    grad: Optional[torch.Tensor] = None  # fp32 accumulator (gradient accumulation), allocated on first use
    step: int = 0
    # slices (by offset) that received a gradient in this accumulation window: the first one is
    # copied rather than added, so zero_grad needs no pass over the buffer
    written: set = field(default_factory=set)
    src: Optional[torch.Tensor] = None  # this window's gradient in the compute dtype (host), not yet consumed
    event: Any = None  # CUDA event after which ``src`` is complete
    norm: Optional[torch.Tensor] = None  # L2 norm of ``src`` (fp32 scalar, on the compute device)
    busy: bool = False  # handed to the worker, not finished yet
    handed: bool = False  # handed to the worker in this step
    dev: Optional[torch.Tensor] = None  # the state on the compute device: the unit steps there (``to_device``)
    dev_step: Optional[torch.Tensor] = None  # its step count, a device scalar (the fused kernel reads it there)
    dev_stale: bool = False  # the host home lags ``dev`` (``sync_homes`` brings it up to date)
    # a device accumulator (``accumulate_on_device``): ``grad`` is on the device; its sum is copied into
    # ``landing``, a buffer of the landing ring (``optim.landing``) held until the step has read it;
    # ``acc_event`` completes that copy
    device_acc: bool = False
    landing: Optional[torch.Tensor] = None
    acc_event: Any = None
    home_written: bool = False  # the one-pass CPU step cast the new weights into the parameter home (``param_out``)
    ranges: Optional[ShardRanges] = None  # the param group and weight decay per range (``optim.groups``); None: group 0

    @property
    def numel(self) -> int:
        return self.shard.numel


@dataclass
class StepResult:
    """What one optimizer step did."""

    grad_norm: float
    skipped: bool  # fp16 overflow
    seconds: float  # time the caller spent in step()
    read_wait_s: float = 0.0
    busy_seconds: float = 0.0  # optimizer time in all threads since the last step (the hidden part included)
    overlapped_shards: int = 0  # shards handed to the background worker during backward
    phases: dict = field(default_factory=dict)  # seconds per part of the per-shard step (gradient, adam, write, read_wait)


class BackgroundStepFailed(RuntimeError):
    """A call that needs the background step's results after that step has failed (its failure
    was raised before): the optimizer state is partly stepped."""


@dataclass
class StepJob:
    """One shard's step for the worker: the hyperparameters and the gradient factor."""

    hyper: dict
    inv_factor: Optional[torch.Tensor]


@dataclass
class StepWindow:
    """A step that began in the boundary micro-batch's backward (``begin_overlap``) and has not
    been through ``step()`` yet."""

    hyper: Optional[dict] = None  # hyperparameters fixed when the boundary backward began
    eager: bool = False  # units are handed over as their gradients are final (nothing global needed)
    handed_early: int = 0  # units handed over (or stepped on the device) during that backward
    epoch: int = 0  # bumped by cancel(): work queued for an abandoned step hands nothing over

    @property
    def open(self) -> bool:
        return self.hyper is not None

    def close(self) -> None:
        self.hyper, self.eager, self.handed_early = None, False, 0


class PhaseClock:
    """Seconds per phase of the per-shard step (gradient, adam, write, read_wait, device), added
    from any thread, taken by each step's report."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._s: dict[str, float] = {}

    def add(self, **seconds: float) -> None:
        with self._lock:
            for k, v in seconds.items():
                self._s[k] = self._s.get(k, 0.0) + v

    def take(self) -> dict[str, float]:
        with self._lock:
            out, self._s = self._s, {}
        return out


__all__ = ["BackgroundStepFailed", "PhaseClock", "ShardOptimState", "StepJob", "StepResult", "StepWindow"]
