"""Where a unit's parameter values live between uses (its *home*, a swap record on the cpu, nvme or
gpu tier) as the coordinator's gradient hooks and the optimizer's worker see them: where a unit's
gradient lands on the host, where the one-pass CPU step may write new weights, how new values go
home (and to a resident unit's device buffer)."""
from __future__ import annotations

import collections
import threading
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
    (``coordinator.DeviceCopies.update_resident``; None: nothing is resident) and returns the
    copy's event (None where it copied in place)."""

    def __init__(self, param_swapper: TensorSwapper, device: torch.device, accumulation: int, *,
                 update_resident: Optional[Callable[[FlatShard, torch.Tensor], Any]] = None,
                 writeback_slots: int = 4) -> None:
        self.param_swapper = param_swapper
        self.device = device
        self.accumulation = accumulation
        self.update_resident = update_resident
        self.largest_trainable = 0  # bytes of the largest trainable shard placed (sizes the gradient staging)
        self.grad_bufs: dict[int, torch.Tensor] = {}
        self.grad_staging: Optional[GradStaging] = None  # under accumulation (made on first use)
        # pinned slots new values of device-homed shards are copied from, with each one's last copy
        # (the optimizer's worker and the caller's step may both write)
        self._slots: collections.deque[tuple[torch.Tensor, Any]] = collections.deque()
        self._slots_made = 0
        self._out_slots: dict[int, torch.Tensor] = {}  # shard index -> the slot param_out gave the step
        self.writeback_slots = writeback_slots  # offload_optimizer.buffer_count: the layout's write-back buffers
        self._slots_lock = threading.Lock()

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
        """The bf16 home the optimizer's one-pass step may write a shard's new weights into; for a
        shard whose home is the device, the pinned slot its new values are copied from (taken
        here, given back by ``write_param``)."""
        home = shard.home
        if home.tier == Tier.CPU and home.tensor is not None and home.tensor.device.type == "cpu":
            return home.tensor
        if home.tier == Tier.GPU and shard.trainable and self._async_device_home(shard):
            raw = self._writeback_slot(shard)
            with self._slots_lock:
                self._out_slots[shard.index] = raw
            return raw[:shard.nbytes].view(shard.dtype)
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
        if home.tier == Tier.GPU and self._async_device_home(shard):
            # the device buffer is the home: one copy from a pinned slot on the update stream, after
            # the unit's backward; the next use waits for it (a pageable copy would stall compute)
            with self._slots_lock:
                raw = self._out_slots.pop(shard.index, None)  # the one-pass step may have written it
            if raw is None:
                raw, cast = self._writeback_slot(shard), True
            src = raw[:shard.nbytes].view(shard.dtype)
            if cast:
                src.copy_(master)
            self._slot_done(raw, self.update_resident(shard, src))
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

    def _async_device_home(self, shard: FlatShard) -> bool:
        """Whether a device-homed shard's new values can go to its buffer through the resident
        update (a GPU, the buffer in place as its home)."""
        return (self.update_resident is not None and self.device.type == "cuda" and shard.persistent
                and shard.buffer is shard.home.tensor)

    def _writeback_slot(self, shard: FlatShard) -> torch.Tensor:
        """A pinned slot (bytes) for a shard's new values on their way to its device home:
        ``writeback_slots`` slots of the largest trainable shard (the layout's write-back buffers),
        each reused once its last copy has completed; give it back with ``_slot_done``."""
        with self._slots_lock:
            if self._slots_made < self.writeback_slots or not self._slots:
                self._slots_made += 1
                raw, ev = None, None
            else:
                raw, ev = self._slots.popleft()
        if ev is not None:
            ev.synchronize()
        if raw is None or raw.numel() < shard.nbytes:
            raw = aligned_empty(max(self.largest_trainable, shard.nbytes), torch.uint8, pin=True)
        return raw

    def _slot_done(self, raw: torch.Tensor, event: Any) -> None:
        """A slot is in the ring again, to be reused after ``event`` (its copy; None: done)."""
        with self._slots_lock:
            self._slots.append((raw, event))

    def write_home(self, shard: FlatShard, master: torch.Tensor) -> Any:
        """A device-stepped unit's fp32 master (host) written into its parameter home only (its
        device buffer is current already): for checkpoints and export."""
        return self.write_param(shard, master, to_device=False)


__all__ = ["ParamHomes"]
