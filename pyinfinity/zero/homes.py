"""Where a unit's parameter values live between uses (its *home*, a swap record on the cpu, nvme or
gpu tier) as the coordinator's gradient hooks and the optimizer's worker see them: where a unit's
gradient lands on the host, where the one-pass CPU step may write new weights, how new values go
home (and to a resident unit's device buffer)."""
from __future__ import annotations

from typing import Any, Callable, Optional

import torch

from pyinfinity.swap.tensor_swapper import Done, Tier, TensorSwapper, aligned_empty
from pyinfinity.zero.accumulate import STAGING_SLOTS, GradStaging
from pyinfinity.zero.partition import FlatShard


class ParamHomes:
    """The parameter homes as the coordinator's gradient hooks and the optimizer's worker see them:
    where a unit's gradient lands, where the one-pass step may write new weights, how new values
    go home. It holds no reference to the Engine, so an engine dropped without close() is freed
    even while its worker is stepping (its finalizer then stops the worker and removes the files).

    ``update_resident(shard, src)`` copies new values into a resident unit's device buffer
    (``coordinator.DeviceCopies.update_resident``; None: nothing is resident)."""

    def __init__(self, param_swapper: TensorSwapper, device: torch.device, accumulation: int, *,
                 update_resident: Optional[Callable[[FlatShard, torch.Tensor], None]] = None) -> None:
        self.param_swapper = param_swapper
        self.device = device
        self.accumulation = accumulation
        self.update_resident = update_resident
        self.largest_trainable = 0  # bytes of the largest trainable shard placed (sizes the gradient staging)
        self.grad_bufs: dict[int, torch.Tensor] = {}
        self.grad_staging: Optional[GradStaging] = None  # under accumulation (made on first use)

    def place(self, shard: FlatShard, flat: torch.Tensor, tier: Tier) -> Any:
        """Writes a shard's values (compute dtype) to its home in ``tier``; returns the home."""
        if shard.trainable:
            self.largest_trainable = max(self.largest_trainable, shard.nbytes)
        return self.param_swapper.put(f"param.{shard.index}", flat, tier)

    def grad_dest(self, shard: FlatShard) -> tuple[torch.Tensor, bool]:
        """Where a unit's gradient lands on the host: its parameter home in RAM (the step rewrites
        the weights from the fp32 master anyway, so no extra RAM), else a buffer of its own (a
        home on disk or on the device), or under gradient accumulation one of ``STAGING_SLOTS``
        staging buffers (waiting for one to be free): the optimizer's accumulation worker adds it
        into the unit's fp32 accumulator and gives the buffer back (``release_grad``)."""
        home = shard.home
        accumulating = self.accumulation > 1
        if not accumulating and home.tier == Tier.CPU:
            return home.tensor, True
        pin = self.device.type == "cuda"
        if accumulating:
            if self.grad_staging is None:
                self.grad_staging = GradStaging(self.largest_trainable, STAGING_SLOTS, pin=pin)
            return self.grad_staging.acquire(shard.nbytes, shard.dtype), False
        buf = self.grad_bufs.get(shard.index)
        if buf is None:
            buf = self.grad_bufs[shard.index] = aligned_empty(shard.numel, shard.dtype, pin=pin)
        return buf, False

    def release_grad(self, buf: torch.Tensor) -> None:
        """A gradient handed over in a staging buffer was added: the buffer is free again (called
        from the optimizer's accumulation worker)."""
        if self.grad_staging is not None:
            self.grad_staging.release(buf)

    def param_out(self, shard: FlatShard) -> Optional[torch.Tensor]:
        """The bf16 home the optimizer's one-pass step may write a shard's new weights into."""
        home = shard.home
        if home.tier == Tier.CPU and home.tensor is not None and home.tensor.device.type == "cpu":
            return home.tensor
        return None

    def write_param(self, shard: FlatShard, master: torch.Tensor, to_device: bool = True, cast: bool = True) -> Any:
        """The optimizer's new fp32 values of a shard, written home in the compute dtype (and, with
        ``to_device``, to its device copy when the unit is resident). ``cast`` False: the home in
        RAM holds them already (the one-pass CPU step cast them into ``param_out``). Called from
        the optimizer's worker too."""
        home = shard.home
        req: Any = Done()
        if home.tier == Tier.GPU and not to_device:  # the device buffer is the home
            return req
        if home.tier == Tier.CPU:
            if cast:
                home.tensor.copy_(master)  # cast into the (pinned) home, in place
            src = home.tensor
        else:
            src = master
            if shard.dtype != torch.float32 or home.tier == Tier.GPU:
                src = aligned_empty(shard.numel, shard.dtype)  # kept alive by the request until written
                src.copy_(master)
            req = self.param_swapper.write(home, src)
        if to_device and shard.persistent and self.update_resident is not None:
            self.update_resident(shard, src)
        return req

    def write_home(self, shard: FlatShard, master: torch.Tensor) -> Any:
        """A device-stepped unit's fp32 master (host) written into its parameter home only (its
        device buffer is current already): for checkpoints and export."""
        return self.write_param(shard, master, to_device=False)


__all__ = ["ParamHomes"]
