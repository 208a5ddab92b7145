"""The offloaded optimizer: fp32 master weights and Adam/AdamW moments per shard, in host RAM or on
NVMe, stepped on the CPU with torch's fused Adam kernels; gradients accumulated in fp32 on the
host; global-norm clipping; fp16 dynamic loss scaling.

The state of one shard is one flat fp32 home of ``3 * numel`` elements: ``[master | exp_avg |
exp_avg_sq]`` (one read and one write per shard per step). On NVMe the step is pipelined over
``buffer_count`` (>= 3) staging buffers: the read of shard k+1 and the write of shard k-1 run in
the swap engine's threads while shard k is stepped.
"""
from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Optional, Sequence

import torch

from pyinfinity.config import FP16Config, OptimizerConfig
from pyinfinity.swap.tensor_swapper import SwapRecord, Tier, TensorSwapper, aligned_empty
from pyinfinity.zero.partition import FlatShard, ParamSlice

log = logging.getLogger(__name__)


@dataclass(eq=False)
class ShardOptimState:
    """What the optimizer keeps about one trainable shard."""

    shard: FlatShard
    home: SwapRecord  # fp32 [master | exp_avg | exp_avg_sq]
    grad: Optional[torch.Tensor] = None  # fp32 accumulator on the host, allocated on first grad
    step: int = 0
    # slices (by offset) that received a gradient in this accumulation window: the first one is
    # copied rather than added, so zero_grad needs no pass over the buffer
    written: set = field(default_factory=set)

    @property
    def numel(self) -> int:
        return self.shard.numel


class DynamicLossScaler:
    """fp16 loss scaling as DeepSpeed does it: halve on overflow (after ``hysteresis`` overflows),
    double after ``loss_scale_window`` good steps; a static scale when ``loss_scale`` > 0."""

    def __init__(self, cfg: FP16Config) -> None:
        self.dynamic = cfg.enabled and cfg.loss_scale == 0
        self.scale = (2.0 ** cfg.initial_scale_power) if self.dynamic else (cfg.loss_scale or 1.0)
        self.window = cfg.loss_scale_window
        self.min_scale = cfg.min_loss_scale
        self.hysteresis = cfg.hysteresis
        self._hyst_left = cfg.hysteresis
        self._good = 0

    def update(self, overflow: bool) -> None:
        if not self.dynamic:
            return
        if overflow:
            self._good = 0
            if self._hyst_left <= 1:
                self.scale = max(self.scale / 2, self.min_scale)
                self._hyst_left = self.hysteresis
            else:
                self._hyst_left -= 1
            return
        self._good += 1
        if self._good % self.window == 0:
            self.scale *= 2
            self._hyst_left = self.hysteresis

    def state_dict(self) -> dict:
        return {"scale": self.scale, "good": self._good, "hyst_left": self._hyst_left}

    def load_state_dict(self, d: dict) -> None:
        self.scale, self._good, self._hyst_left = d["scale"], d["good"], d["hyst_left"]


@dataclass
class StepResult:
    """What one optimizer step did."""

    grad_norm: float
    skipped: bool  # fp16 overflow
    seconds: float
    read_wait_s: float = 0.0


class OffloadOptimizer:
    """Adam/AdamW over flat shards whose fp32 state lives in RAM or on NVMe.

    ``param_groups`` mirrors torch's (one group) so DeepSpeed-style and torch LR schedulers can
    drive ``lr``. ``write_param(shard, flat)`` is called after each shard's step with the new
    values in the compute dtype; it returns a request (or None) the step waits for at its end.
    """

    def __init__(self, cfg: OptimizerConfig, swapper: TensorSwapper, *, nvme_ratio: float = 0.0,
                 buffer_count: int = 4, pipeline: bool = True,
                 write_param: Optional[Callable[[FlatShard, torch.Tensor], Any]] = None,
                 step_device: Optional[torch.device] = None) -> None:
        self.cfg = cfg
        # where the Adam arithmetic runs: None = on the CPU, in place on the host state; a device
        # = each shard's state is streamed there, stepped by the device's fused kernel and back
        self.step_device = torch.device(step_device) if step_device is not None else None
        self._dev_bufs: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.swapper = swapper
        self.nvme_ratio = nvme_ratio
        self.buffer_count = max(3, buffer_count)
        self.pipeline = pipeline
        self.write_param = write_param
        self.states: list[ShardOptimState] = []
        self._by_shard: dict[int, ShardOptimState] = {}
        self.param_groups = [{"lr": cfg.lr, "initial_lr": cfg.lr, "betas": cfg.betas, "eps": cfg.eps,
                              "weight_decay": cfg.weight_decay, "params": []}]
        self.defaults = dict(self.param_groups[0])
        self._staging: list[torch.Tensor] = []
        self._planned_nvme_numel = 0
        self._total_numel = 0

    # ------------------------------------------------------------------------- placement
    def plan(self, shards: Sequence[FlatShard]) -> None:
        """Declares the trainable shards up front so ``ratio`` can split RAM vs NVMe by size."""
        self._total_numel = sum(s.numel for s in shards if s.trainable)

    def _tier_for(self, numel: int) -> Tier:
        if self.nvme_ratio <= 0:
            return Tier.CPU
        # the first (1 - ratio) of the state (in order of creation) stays in RAM, the rest on disk
        placed = sum(s.numel for s in self.states)
        ram_share = (1.0 - self.nvme_ratio) * self._total_numel
        return Tier.CPU if placed + numel <= ram_share else Tier.NVME

    def add_shard(self, shard: FlatShard, flat32: torch.Tensor) -> Optional[ShardOptimState]:
        """Creates a shard's state: master = its fp32 values, moments = 0. Frozen shards get none."""
        if not shard.trainable:
            return None
        n = shard.numel
        tier = self._tier_for(n)
        home = self.swapper.allocate(f"optim.{shard.index}", 3 * n, torch.float32, tier)
        buf = home.tensor if tier == Tier.CPU else aligned_empty(3 * n, torch.float32)
        buf[:n].copy_(flat32)
        buf[n:].zero_()
        self.swapper.write(home, buf).wait()
        st = ShardOptimState(shard, home)
        self.states.append(st)
        self._by_shard[shard.index] = st
        return st

    def state_of(self, shard: FlatShard) -> Optional[ShardOptimState]:
        return self._by_shard.get(shard.index)

    # ------------------------------------------------------------------------- gradients
    def accumulate(self, shard: FlatShard, sl: ParamSlice, grad: torch.Tensor) -> None:
        """Adds one parameter's gradient (any device/dtype) into the shard's fp32 host buffer."""
        st = self._by_shard.get(shard.index)
        if st is None:
            return
        if st.grad is None:
            st.grad = torch.empty(shard.numel, dtype=torch.float32)
        dst = st.grad[sl.offset:sl.offset + sl.numel]
        g = grad.detach().reshape(-1)
        if g.device.type != "cpu":
            g = g.to("cpu")
        if sl.offset in st.written:
            dst.add_(g)
        else:
            dst.copy_(g)
            st.written.add(sl.offset)

    def zero_grad(self) -> None:
        for st in self.states:
            st.written.clear()

    def _fill_unwritten(self) -> None:
        """Parameters that got no gradient in this window count as zero gradient."""
        for st in self.states:
            if len(st.written) == len(st.shard.slices) and st.grad is not None:
                continue
            if st.grad is None:
                st.grad = torch.empty(st.numel, dtype=torch.float32)
            for sl in st.shard.slices:
                if sl.offset not in st.written:
                    st.grad[sl.offset:sl.offset + sl.numel].zero_()
                    st.written.add(sl.offset)

    def grad_norm(self) -> float:
        """Global L2 norm over every shard's gradient (inf/nan if any is not finite)."""
        norms = [torch.linalg.vector_norm(st.grad, 2) for st in self.states if st.grad is not None]
        if not norms:
            return 0.0
        return float(torch.linalg.vector_norm(torch.stack(norms), 2))

    # ------------------------------------------------------------------------- the step
    def _staging_buffers(self) -> list[torch.Tensor]:
        if not self._staging:
            biggest = max((st.numel for st in self.states if st.home.tier == Tier.NVME), default=0)
            if biggest:
                n = self.buffer_count if self.pipeline else 1
                self._staging = [aligned_empty(3 * biggest, torch.float32, pin=self.swapper._pin)
                                 for _ in range(n)]
        return self._staging

    def iter_states(self, write_back: bool) -> Iterator[tuple[ShardOptimState, torch.Tensor]]:
        """Yields (state, flat [master|m|v]) for every shard, reading NVMe homes ahead of use and,
        if ``write_back``, writing each back after the caller is done with it (pipelined)."""
        staging = self._staging_buffers()
        nb = len(staging)
        reads: dict[int, Any] = {}
        writes: dict[int, Any] = {}  # buffer index -> pending write(s)
        nvme = [i for i, st in enumerate(self.states) if st.home.tier == Tier.NVME]
        slot_of = {i: k % max(1, nb) for k, i in enumerate(nvme)}
        order = {i: k for k, i in enumerate(nvme)}
        tail: list[Any] = []  # requests for cpu-tier shards (parameter writes)

        def start_read(i: int) -> None:
            b = slot_of[i]
            for w in writes.pop(b, []):
                w.wait()
            st = self.states[i]
            reads[i] = self.swapper.read(st.home, staging[b][:3 * st.numel])

        if nvme:
            start_read(nvme[0])
        for i, st in enumerate(self.states):
            if st.home.tier == Tier.CPU:
                extra = yield st, st.home.tensor
                tail.extend(extra or [])
                continue
            k = order[i]
            if self.pipeline and k + 1 < len(nvme):
                start_read(nvme[k + 1])
            reads.pop(i).wait()
            buf = staging[slot_of[i]][:3 * st.numel]
            extra = yield st, buf
            pend = list(extra or [])
            if write_back:
                pend.append(self.swapper.write(st.home, buf))
            writes.setdefault(slot_of[i], []).extend(pend)
            if not self.pipeline:
                for w in writes.pop(slot_of[i], []):
                    w.wait()
                if k + 1 < len(nvme):
                    start_read(nvme[k + 1])
        for lst in writes.values():
            for w in lst:
                w.wait()
        for w in tail:
            w.wait()

    def step(self, grad_scale: float = 1.0, clip: float = 0.0, check_overflow: bool = False) -> StepResult:
        """One Adam/AdamW step on every shard. Gradients are divided by ``grad_scale`` (fp16 loss
        scale) and clipped to global norm ``clip`` (0 = off), as torch's clip_grad_norm_ does."""
        t0 = time.perf_counter()
        self._fill_unwritten()
        norm = self.grad_norm()
        raw_norm = norm / grad_scale if grad_scale != 1.0 else norm
        if check_overflow and not math.isfinite(norm):
            return StepResult(grad_norm=raw_norm, skipped=True, seconds=time.perf_counter() - t0)
        factor = 1.0 / grad_scale if grad_scale != 1.0 else 1.0
        if clip > 0:
            coef = clip / (raw_norm + 1e-6)
            if coef < 1.0:
                factor *= coef
        dev = self.step_device
        inv_factor = torch.tensor(1.0 / factor, device=dev) if factor != 1.0 else None
        g = self.param_groups[0]
        beta1, beta2 = g["betas"]
        kernel = torch._fused_adamw_ if self.cfg.adam_w_mode else torch._fused_adam_
        gen = self.iter_states(write_back=True)
        extra: Optional[list] = None
        k = 0  # shards stepped on the device (alternates its two buffer sets)
        try:
            item = gen.send(None)
            while True:
                st, flat = item
                n = st.numel
                st.step += 1
                work, grad = flat, st.grad
                if dev is not None:  # stream the state to the device, step there, bring it back
                    dflat, dgrad = self._device_buffers(k % 2)
                    k += 1
                    work, grad = dflat[:3 * n], dgrad[:n]
                    work.copy_(flat, non_blocking=True)
                    grad.copy_(st.grad, non_blocking=True)
                master, m, v = work[:n], work[n:2 * n], work[2 * n:]
                step_t = torch.tensor(float(st.step), device=dev)
                # unscaling/clipping happens inside the kernel (it divides by grad_scale): no extra pass
                kernel([master], [grad], [m], [v], [], [step_t], lr=float(g["lr"]), beta1=beta1,
                       beta2=beta2, weight_decay=float(g["weight_decay"]), eps=float(g["eps"]),
                       amsgrad=False, maximize=False, grad_scale=inv_factor)
                if dev is not None:
                    flat.copy_(work)  # device -> host; waits for the kernel (the write-back needs it)
                    master = flat[:n]
                extra = []
                if self.write_param is not None:
                    req = self.write_param(st.shard, master)
                    if req is not None:
                        extra.append(req)
                item = gen.send(extra)
        except StopIteration:
            pass
        return StepResult(grad_norm=raw_norm, skipped=False, seconds=time.perf_counter() - t0)

    def _device_buffers(self, which: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Two sets of device buffers ([master|m|v] and grad) for the streamed step, sized for the
        largest shard, allocated on first use and kept."""
        if not self._dev_bufs:
            biggest = max((st.numel for st in self.states), default=0)
            self._dev_bufs = [(torch.empty(3 * biggest, dtype=torch.float32, device=self.step_device),
                               torch.empty(biggest, dtype=torch.float32, device=self.step_device))
                              for _ in range(2)]
        return self._dev_bufs[which]

    # ------------------------------------------------------------------------- state
    def load_shard_state(self, shard: FlatShard, flat: torch.Tensor, step: int) -> None:
        """Overwrites a shard's [master|m|v] home (checkpoint load)."""
        st = self._by_shard[shard.index]
        st.step = step
        self.swapper.write(st.home, flat.contiguous()).wait()

    @property
    def bytes_by_tier(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for st in self.states:
            out[st.home.tier.value] = out.get(st.home.tier.value, 0) + st.home.nbytes
        return out

    @property
    def grad_bytes(self) -> int:
        return sum(st.grad.numel() * 4 for st in self.states if st.grad is not None)

    def close(self) -> None:
        self._staging.clear()
        self._dev_bufs.clear()
        for st in self.states:
            st.grad = None
