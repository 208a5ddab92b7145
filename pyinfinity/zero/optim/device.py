"""The optimizer on the compute device: units whose state lives there, and the streamed step.

Units on the device (``to_device``): a resident unit's state may also live on the compute device
(a copy of its host home); its gradient then never leaves the device and it is stepped there by
the format's device step, on the compute stream, the new weights cast straight into the unit's
device buffer: as soon as its gradient is final when nothing global is needed, else first thing
in ``step``. The host home is brought up to date by ``sync_homes`` (checkpoints, export).

The streamed step (``pyinfinity.optimizer_step_device: device``): every shard's state is copied
to the device through one of two buffer sets, stepped there by torch's kernel and copied back.
"""
from __future__ import annotations

import time
from typing import Any, Callable, Optional

import torch

from pyinfinity.swap.tensor_swapper import Tier, TensorSwapper
from pyinfinity.zero.optim.groups import Call, span_kw, step_calls
from pyinfinity.zero.optim.formats import OptimStateFormat
from pyinfinity.zero.optim.records import PhaseClock, ShardOptimState
from pyinfinity.zero.partition import FlatShard

WriteHome = Callable[[FlatShard, torch.Tensor], Any]


class DeviceStates:
    """The shards whose state has a copy on the compute device. ``state_in_ram(st, read)`` gives a
    shard's home in RAM (its home there, else a buffer, read from the disk when ``read``)."""

    def __init__(self, states: list[ShardOptimState], by_shard: dict[int, ShardOptimState], fmt: OptimStateFormat,
                 swapper: TensorSwapper, phases: PhaseClock,
                 state_in_ram: Callable[[ShardOptimState, bool], torch.Tensor]) -> None:
        self.states = states
        self.by_shard = by_shard
        self.format = fmt
        self.swapper = swapper
        self.phases = phases
        self._state_in_ram = state_in_ram
        self.before_update: Optional[Callable[[ShardOptimState, Optional[torch.Tensor]], None]] = None

    def to_device(self, shard: FlatShard, device: torch.device) -> int:
        """Keeps the shard's state on ``device`` too (a copy of its home): from now on it is stepped
        there. The unit must stay resident (its new weights go into ``shard.buffer``). Returns the
        device bytes taken (0 for a frozen shard)."""
        st = self.by_shard.get(shard.index)
        if st is None:
            return 0
        host = self._state_in_ram(st, True)
        st.dev = torch.empty(host.numel(), dtype=host.dtype, device=device)
        st.dev.copy_(host)
        st.dev_step = torch.full((), float(st.step), dtype=torch.float32, device=device)
        st.dev_stale = False
        shard.run.state_to_device()
        return st.dev.numel() * st.dev.element_size()

    def step(self, st: ShardOptimState, hyper: dict, inv_factor: Optional[torch.Tensor],
             scale: float = 1.0) -> None:
        """One step of a unit whose state is on the device, on the current stream (the compute
        stream: after the gradient, before the unit's next use); the new weights are cast into the
        unit's device buffer. ``inv_factor``: a scalar tensor on that device, or None; ``scale`` its
        value on the host (1.0 for None)."""
        t0 = time.perf_counter()
        n, dev = st.numel, st.dev
        g = st.src if st.src is not None else st.grad
        if g is None:  # no gradient in this window: zero (weight decay and momentum still apply)
            g = st.grad = torch.zeros(n, dtype=torch.float32, device=dev.device)
        st.step += 1
        st.dev_step.add_(1)
        out = st.shard.buffer
        if out is None or out.numel() != n:
            raise RuntimeError(f"shard {st.shard.index} ({st.shard.module_name or '<root>'}) steps on the device but is "
                               "not resident there")
        for span, h in step_calls(st.ranges, hyper, lambda: self.format.master(dev, n),
                                  decoupled_decay=self.format.decoupled_decay):
            self.format.step_device(dev, n, g, out, h, st.dev_step, inv_factor, count=st.step, scale=scale,
                                    **span_kw(span))
        st.dev_stale = True
        st.handed = True  # stepped in this step (a failure after this leaves the state partly stepped)
        st.src = st.event = None
        self.phases.add(device=time.perf_counter() - t0)

    def _write_back(self, st: ShardOptimState, write_home: Optional[WriteHome]) -> None:
        """The device copy into the host homes: the state's, and the weights' through ``write_home``."""
        if self.before_update is not None:  # a background checkpoint's copy of the home comes first
            self.before_update(st, None)
        host = self._state_in_ram(st, False)
        host.copy_(st.dev)  # waits for the step's kernels
        if st.home.tier != Tier.CPU:
            self.swapper.write(st.home, host).wait()
        if write_home is not None:
            req = write_home(st.shard, self.format.master(host, st.numel))
            if req is not None:
                req.wait()

    def sync_homes(self, write_home: Optional[WriteHome] = None) -> None:
        """Brings the host homes of device-stepped units up to date: their state and, through
        ``write_home(shard, master)``, their parameter home (for a checkpoint, an export)."""
        for st in self.states:
            if st.dev is None or not st.dev_stale:
                continue
            self._write_back(st, write_home)
            st.dev_stale = False

    def to_host(self, shard: FlatShard, write_home: Optional[WriteHome] = None) -> int:
        """Undoes ``to_device``: the host homes are brought up to date (``write_home(shard, master)``
        for the parameter home), the device copy is dropped and the shard steps on the CPU again (an
        fp32 accumulator on the device comes to the host). Returns the device bytes freed."""
        st = self.by_shard.get(shard.index)
        if st is None or st.dev is None:
            return 0
        if st.dev_stale:
            self._write_back(st, write_home)
        freed = st.dev.numel() * st.dev.element_size()
        if st.grad is not None and st.grad.device.type != "cpu":
            st.grad = st.grad.cpu()
        st.src = st.norm = None
        st.dev = st.dev_step = None
        st.dev_stale = False
        shard.run.state_to_host()
        return freed

    def close(self) -> None:
        """Drops the device copies (the homes stay the record)."""
        for st in self.states:
            st.dev = st.dev_step = None


class StreamedStep:
    """``pyinfinity.optimizer_step_device: device``: each shard's state and gradient are copied
    to the device through one of two buffer sets (sized for the largest shard, allocated on first
    use and kept), stepped there by the format's torch step, and copied back."""

    def __init__(self, device: torch.device, fmt: OptimStateFormat, states: list[ShardOptimState]) -> None:
        self.device = torch.device(device)
        self.format = fmt
        self.states = states
        self._bufs: list[tuple[torch.Tensor, torch.Tensor]] = []

    def buffers(self, which: int) -> tuple[torch.Tensor, torch.Tensor]:
        if not self._bufs:
            biggest = max((st.numel for st in self.states), default=0)
            numel = max((st.home.numel for st in self.states), default=0)  # the largest home (not the largest shard's)
            dtype = self.states[0].home.dtype if self.states else torch.float32
            self._bufs = [(torch.empty(numel, dtype=dtype, device=self.device),
                           torch.empty(biggest, dtype=torch.float32, device=self.device)) for _ in range(2)]
        return self._bufs[which]

    def step(self, flat: torch.Tensor, numel: int, grad32: torch.Tensor, calls: list[Call], step: int,
             inv_factor: Optional[torch.Tensor], k: int, scale: float = 1.0) -> None:
        """One step of the host state ``flat`` on the device (buffer set ``k % 2``), one kernel call
        per ``calls`` (``optim.groups.step_calls``); ``flat`` holds the new state when this returns.
        ``scale``: ``inv_factor``'s value on the host."""
        dflat, dgrad = self.buffers(k % 2)
        work, g = dflat[:flat.numel()], dgrad[:numel]
        work.copy_(flat, non_blocking=True)
        g.copy_(grad32, non_blocking=True)
        count = torch.tensor(float(step), device=self.device)
        for span, h in calls:
            self.format.step_torch(work, numel, g, h, count, inv_factor, count=step, scale=scale, **span_kw(span))
        flat.copy_(work)  # device -> host; waits for the kernel (the write-back needs it)

    def close(self) -> None:
        self._bufs.clear()


__all__ = ["DeviceStates", "StreamedStep"]
