"""The landing ring: the few pinned host buffers the sums of device gradient accumulators are
copied into for the CPU step.

A unit whose fp32 accumulator is on the device (``GradientIntake.accumulate_on_device``) needs its
sum on the host only between the copy off the device and the end of its CPU step, which reads it
once. So the sums share ``layout.pools.landing_ring`` buffers (LANDING_SLOTS, fewer when fewer
units accumulate there, each of the largest such unit's elements) instead of one a unit:

* a buffer is taken (``acquire``) when a sum lands: in the boundary micro-batch when the unit is
  handed to the background step at once, else in ``step()`` just before the unit is handed over or
  stepped (``GradientIntake.land``). The taking thread waits while every buffer is held;
* it is given back (``release``) once the step that read it has finished reading it
  (``OffloadOptimizer._adam``, on whichever thread stepped the unit), or when the gradient it holds
  is dropped (a skipped or abandoned step, ``cancel``, ``close``);
* the step of unit k therefore runs while the sums of the next units land, up to the ring's size
  ahead; a boundary backward that gets further ahead of the CPU step waits for it.

A wait never hangs: it raises the step worker's failure as soon as there is one, and refuses
(RuntimeError) when every buffer is held by a unit that is not being stepped (nothing would give
one back). The numbers are unchanged: the step reads the same fp32 sum from a pinned buffer as
before, whichever buffer it is. What the ring costs is the layout's ``landing_bytes``, the one
figure of the planner and the engine.
"""
from __future__ import annotations

import logging
import threading
import time
from typing import Callable, Sequence

import torch

from pyinfinity.layout.pools import landing_ring
from pyinfinity.zero.optim.records import ShardOptimState
from pyinfinity.zero.optim.worker import WAIT_STUCK_S, WAIT_WARN_S

log = logging.getLogger(__name__)

POLL_S = 0.5  # a waiting taker looks at the step worker's failure this often


class LandingRing:
    """The landing buffers of one optimizer. ``pin``: page-locked buffers (a GPU's copies land
    asynchronously); ``check()`` raises the step worker's failure (called while waiting);
    ``releasing(st)``: whether a unit holding a buffer is being stepped, so that it will give the
    buffer back."""

    def __init__(self, *, check: Callable[[], None], releasing: Callable[[ShardOptimState], bool]) -> None:
        self._check = check
        self._releasing = releasing
        self._cond = threading.Condition()
        self._want: tuple[int, int] = (0, 0)  # (buffers, elements each) of the units placed now
        self._pin = False
        self._buffers: list[torch.Tensor] = []
        self._free: list[int] = []  # indices into _buffers
        self._held: dict[int, tuple[ShardOptimState, int]] = {}  # id(state) -> (state, buffer index)

    # ------------------------------------------------------------------------- sizing
    def size_for(self, numels: Sequence[int], pin: bool) -> None:
        """The units with a device accumulator are now those of ``numels``: the ring becomes
        ``landing_ring(numels)``. A smaller ring is applied at once when no buffer is held (else
        when the last held one comes back); a larger one is allocated by ``reserve`` or the next
        ``acquire``. No unit: the buffers are freed."""
        with self._cond:
            self._want, self._pin = landing_ring(numels), pin
            count, numel = self._want
            have = self._buffers[0].numel() if self._buffers else 0
            if not self._held and (count < len(self._buffers) or numel < have):
                self._reallocate()

    def reserve(self) -> None:
        """Allocates the ring as ``size_for`` last said, when no buffer is held."""
        with self._cond:
            if not self._held:
                self._reallocate()

    def _reallocate(self) -> None:
        from pyinfinity.swap.tensor_swapper import aligned_empty

        count, numel = self._want
        if len(self._buffers) == count and (not count or self._buffers[0].numel() == numel):
            return
        self._buffers, self._free = [], []  # the old ones first: both sets need not fit at once
        self._buffers = [aligned_empty(numel, torch.float32, pin=self._pin) for _ in range(count)]
        self._free = list(range(count))

    @property
    def nbytes(self) -> int:
        """Bytes of the buffers allocated now."""
        return sum(b.numel() * 4 for b in self._buffers)

    @property
    def buffers(self) -> list[torch.Tensor]:
        return list(self._buffers)

    # ------------------------------------------------------------------------- taking and giving back
    def holds(self, st: ShardOptimState) -> bool:
        with self._cond:
            return id(st) in self._held

    def acquire(self, st: ShardOptimState) -> torch.Tensor:
        """A free buffer for ``st``'s sum (its first ``st.numel`` elements), waiting while every
        buffer is held. Raises the step worker's failure, RuntimeError when nothing would give a
        buffer back, TimeoutError after WAIT_STUCK_S."""
        t0 = time.perf_counter()
        warned = t0
        with self._cond:
            if id(st) in self._held:
                raise RuntimeError(f"shard {st.shard.index}: its device accumulator's sum landed twice in one step")
            while True:
                if not self._held:
                    self._reallocate()  # a size change deferred while buffers were held
                if not self._buffers or self._buffers[0].numel() < st.numel:
                    raise RuntimeError(f"shard {st.shard.index} ({st.numel:,} elements) has no landing buffer: its "
                                       "accumulator was not placed on the device through accumulate_on_device")
                if self._free:
                    b = self._free.pop()
                    self._held[id(st)] = (st, b)
                    return self._buffers[b][:st.numel]
                self._check()
                holders = [s for s, _ in self._held.values()]
                if not any(self._releasing(s) for s in holders):
                    names = ", ".join(str(s.shard.index) for s in holders)
                    raise RuntimeError(f"shard {st.shard.index}: every landing buffer is held by a unit that is not "
                                       f"being stepped (shards {names}); nothing would give one back")
                self._cond.wait(POLL_S)
                now = time.perf_counter()
                if now - t0 >= WAIT_STUCK_S:
                    raise TimeoutError(f"waited {now - t0:.0f}s for a landing buffer for shard {st.shard.index}; "
                                       "giving up")
                if now - warned >= WAIT_WARN_S:
                    warned = now
                    log.warning("waited %.0fs for a landing buffer for shard %d", now - t0, st.shard.index)

    def release(self, st: ShardOptimState) -> bool:
        """Gives ``st``'s buffer back (nothing if it holds none); returns whether it held one."""
        with self._cond:
            item = self._held.pop(id(st), None)
            if item is None:
                return False
            self._free.append(item[1])
            if not self._held:
                self._reallocate()
            self._cond.notify_all()
            return True

    def free(self) -> None:
        """Frees every buffer (the optimizer is closed: nothing is held or stepped any more)."""
        with self._cond:
            self._held.clear()
            self._want = (0, 0)
            self._buffers, self._free = [], []
            self._cond.notify_all()


__all__ = ["LandingRing", "POLL_S"]
