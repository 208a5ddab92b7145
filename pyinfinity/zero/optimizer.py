"""The offloaded optimizer: fp32 master weights and Adam/AdamW moments per shard, in host RAM or on
NVMe, stepped on the CPU by the one-pass kernel (``_C.adam_step``), or on the compute device for
units whose state lives there too; global-norm clipping; fp16 dynamic loss scaling.

The state of one shard is one flat fp32 home of ``3 * numel`` elements: ``[master | exp_avg |
exp_avg_sq]`` (one read and one write per shard per step). On NVMe the step is pipelined over
``buffer_count`` (>= 3) staging buffers: the read of shard k+1 and the write of shard k-1 run in
the swap engine's threads while shard k is stepped.

Gradients arrive one unit at a time (``grad_ready``), as a flat host tensor in the compute dtype
(often the shard's own parameter home: the gradient is written over the weights, which the step
rewrites from the fp32 master anyway, so no fp32 gradient copy is kept) with the CUDA event that
completes its copy and its L2 norm. Under gradient accumulation they are added into an fp32
accumulator instead.

Units on the device (``to_device``): a resident unit's state may also live on the compute device
(a copy of its host home); its gradient then never leaves the device and it is stepped there by
torch's fused Adam kernel, on the compute stream, the new weights cast straight into the unit's
device buffer: as soon as its gradient is final when nothing global is needed, else first thing
in ``step``. The host home is brought up to date by ``sync_homes`` (checkpoints, export).

Background stepping (``background``): a worker thread steps shards while the caller goes on.
Without anything global to know first (no clipping, no fp16 loss scaling), each unit is handed to
it as soon as its gradient is complete, during the boundary backward; otherwise ``step`` computes
the global norm from the per-unit norms and hands every shard over in order. ``step`` returns
without waiting: a shard's new values reach its home (and its resident device copy) when the
worker has stepped it, and whoever reads a home first waits for that shard (``wait_shard``) —
the next forward waits unit by unit, so the step overlaps it. Every path runs the same per-shard
function on the same inputs, so the results are bit-identical to the serial step.
"""
from __future__ import annotations

import collections
import logging
import math
import os
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Optional, Sequence

import torch

from pyinfinity.swap.tensor_swapper import SwapRecord, Tier, TensorSwapper, aligned_empty
from pyinfinity.zero.accumulate import ADD_CHUNK, AccumulateWorker, add_into, norm_of_squares
from pyinfinity.zero.partition import FlatShard, ParamSlice

log = logging.getLogger(__name__)

WAIT_WARN_S = 30.0  # a wait on the background step logs what it waits for this often
WAIT_STUCK_S = 600.0  # ... and gives up (TimeoutError) when one shard takes this long
DEVICE_CHUNK = 16 << 20  # elements of a device-stepped unit converted to fp32 at a time (plan.placement counts it)


@dataclass(eq=False)
class ShardOptimState:
    """What the optimizer keeps about one trainable shard."""

    shard: FlatShard
    home: SwapRecord  # fp32 [master | exp_avg | exp_avg_sq]
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
    dev: Optional[torch.Tensor] = None  # [master|m|v] on the compute device: the unit steps there (``to_device``)
    dev_step: Optional[torch.Tensor] = None  # its step count, a device scalar (the fused kernel reads it there)
    dev_stale: bool = False  # the host home lags ``dev`` (``sync_homes`` brings it up to date)
    # a device accumulator (``accumulate_on_device``): ``grad`` is on the device, its sum is copied into
    # ``landing`` (pinned host fp32) in the boundary micro-batch, ``acc_event`` completes that copy
    landing: Optional[torch.Tensor] = None
    acc_event: Any = None

    @property
    def numel(self) -> int:
        return self.shard.numel


class DynamicLossScaler:
    """fp16 loss scaling as DeepSpeed does it: halve on overflow (after ``hysteresis`` overflows),
    double after ``loss_scale_window`` good steps; a static scale when ``loss_scale`` > 0."""

    def __init__(self, cfg: Any) -> None:
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
    seconds: float  # time the caller spent in step()
    read_wait_s: float = 0.0
    busy_seconds: float = 0.0  # optimizer time in all threads since the last step (the hidden part included)
    overlapped_shards: int = 0  # shards handed to the background worker during backward
    phases: dict = field(default_factory=dict)  # seconds per part of the per-shard step (gradient, adam, write, read_wait)


class BackgroundStepFailed(RuntimeError):
    """A call that needs the background step's results after that step has failed (its failure
    was raised before): the optimizer state is partly stepped."""


@dataclass
class _Job:
    """One shard's step for the worker: the hyperparameters and the gradient factor."""

    hyper: dict
    inv_factor: Optional[torch.Tensor]


class OffloadOptimizer:
    """Adam/AdamW over flat shards whose fp32 state lives in RAM or on NVMe.

    ``param_groups`` mirrors torch's (one group) so DeepSpeed-style and torch LR schedulers can
    drive ``lr``. ``write_param(shard, flat)`` is called after each shard's step with the new
    master values (fp32, host); it writes them home in the compute dtype and returns a request
    (or None) that completes the write.
    """

    def __init__(self, cfg: Any, swapper: TensorSwapper, *, nvme_ratio: float = 0.0,
                 buffer_count: int = 4, pipeline: bool = True,
                 write_param: Optional[Callable[[FlatShard, torch.Tensor], Any]] = None,
                 step_device: Optional[torch.device] = None, accumulate_steps: int = 1) -> None:
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
        self.accumulate_steps = max(1, int(accumulate_steps))
        self.states: list[ShardOptimState] = []
        self._by_shard: dict[int, ShardOptimState] = {}
        self.param_groups = [{"lr": cfg.lr, "initial_lr": cfg.lr, "betas": cfg.betas, "eps": cfg.eps,
                              "weight_decay": cfg.weight_decay, "params": []}]
        self.defaults = dict(self.param_groups[0])
        self._staging: list[torch.Tensor] = []
        self._total_numel = 0
        self._scratch: dict[int, torch.Tensor] = {}  # thread ident -> fp32 gradient scratch
        # background stepping
        self.background = False  # set by the engine (pyinfinity.overlap_step)
        self.threads: Optional[int] = None  # intra-op threads of the worker (None: torch's default)
        self._window: Optional[dict] = None  # hyperparameters fixed when the boundary backward began
        self._eager = False  # hand units over during backward (nothing global needed)
        # the worker takes the lowest unit index first (forward order): after backward, the units the
        # next forward needs first are stepped first, so it overlaps the rest of the step
        self._queue: "queue.PriorityQueue[tuple[float, int, Optional[tuple[ShardOptimState, _Job]]]]" = \
            queue.PriorityQueue()
        self._seq = 0
        # the one-pass CPU step (_C.adam_step); param_out(shard): the bf16 home it may write the new
        # weights into (None: write_param casts them)
        self.fused = True
        self.param_out: Optional[Callable[[FlatShard], Optional[torch.Tensor]]] = None
        self._phase_s: dict[str, float] = {}  # seconds per phase of the per-shard step since the last report
        self._worker: Optional[threading.Thread] = None
        self._cond = threading.Condition()
        self._error: Optional[BaseException] = None  # the worker's failure, kept until cancel()
        self._error_reported = False  # raised once in the caller's thread
        self._current: Optional[ShardOptimState] = None
        self._busy_s = 0.0  # worker seconds since the last step() report
        self._read_wait_s = 0.0
        self._handed_early = 0
        # gradient accumulation: the adds run on a worker of their own (zero.accumulate); a staging
        # buffer a gradient arrived in is given back through ``release_grad`` once it is added
        self._adder: Optional[AccumulateWorker] = None
        self.release_grad: Optional[Callable[[torch.Tensor], None]] = None
        # device accumulators: copy_to_host(src on the device, dst pinned on the host) -> the copy's event
        self.copy_to_host: Optional[Callable[[torch.Tensor, torch.Tensor], Any]] = None
        self._caller_scratch: Optional[torch.Tensor] = None  # add_into's fp32 chunk on the caller's thread
        self._epoch = 0  # bumped by cancel(): a queued add of an abandoned step hands nothing to the step

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

    def to_device(self, shard: FlatShard, device: torch.device) -> int:
        """Keeps the shard's state on ``device`` too (a copy of its home): from now on it is stepped
        there. The unit must stay resident (its new weights go into ``shard.buffer``). Returns the
        device bytes taken (0 for a frozen shard)."""
        st = self._by_shard.get(shard.index)
        if st is None:
            return 0
        if self.step_device is not None:
            raise ValueError("to_device: the streamed device step already steps every unit on the device")
        host = self._state_in_ram(st, read=True)
        st.dev = torch.empty(3 * st.numel, dtype=torch.float32, device=device)
        st.dev.copy_(host)
        st.dev_step = torch.full((), float(st.step), dtype=torch.float32, device=device)
        st.dev_stale = False
        shard.device_step = True
        return st.dev.numel() * 4

    def _step_device(self, st: ShardOptimState, hyper: dict, inv_factor: Optional[torch.Tensor]) -> None:
        """One Adam/AdamW step of a unit whose state is on the device, on the current stream (the
        compute stream: after the gradient, before the unit's next use); the new weights are cast
        into the unit's device buffer. ``inv_factor``: a scalar tensor on that device, or None."""
        t0 = time.perf_counter()
        n, dev = st.numel, st.dev
        g = st.src if st.src is not None else st.grad
        if g is None:  # no gradient in this window: zero (weight decay and momentum still apply)
            g = st.grad = torch.zeros(n, dtype=torch.float32, device=dev.device)
        st.step += 1
        st.dev_step.add_(1)
        kernel = torch._fused_adamw_ if self.cfg.adam_w_mode else torch._fused_adam_
        out = st.shard.buffer
        if out is None or out.numel() != n:
            raise RuntimeError(f"shard {st.shard.index} ({st.shard.module_name or '<root>'}) steps on the device but is "
                               "not resident there")
        for a in range(0, n, DEVICE_CHUNK):  # Adam is elementwise: the fp32 gradient a chunk at a time
            b = min(n, a + DEVICE_CHUNK)
            gc = g[a:b] if g.dtype == torch.float32 else g[a:b].float()
            master = dev[a:b]
            kernel([master], [gc], [dev[n + a:n + b]], [dev[2 * n + a:2 * n + b]], [], [st.dev_step], lr=hyper["lr"],
                   beta1=hyper["beta1"], beta2=hyper["beta2"], weight_decay=hyper["weight_decay"], eps=hyper["eps"],
                   amsgrad=False, maximize=False, grad_scale=inv_factor)
            out[a:b].copy_(master)
        st.dev_stale = True
        st.handed = True  # stepped in this step (a failure after this leaves the state partly stepped)
        st.src = st.event = None
        self._count(device=time.perf_counter() - t0)

    def sync_homes(self, write_home: Optional[Callable[[FlatShard, torch.Tensor], Any]] = None) -> None:
        """Brings the host homes of device-stepped units up to date: their [master|m|v] and, through
        ``write_home(shard, master)``, their parameter home (for a checkpoint, an export)."""
        for st in self.states:
            if st.dev is None or not st.dev_stale:
                continue
            host = self._state_in_ram(st, read=False)
            host.copy_(st.dev)  # waits for the step's kernels
            if st.home.tier != Tier.CPU:
                self.swapper.write(st.home, host).wait()
            if write_home is not None:
                req = write_home(st.shard, host[:st.numel])
                if req is not None:
                    req.wait()
            st.dev_stale = False

    def to_host(self, shard: FlatShard, write_home: Optional[Callable[[FlatShard, torch.Tensor], Any]] = None) -> int:
        """Undoes ``to_device``: the host homes are brought up to date (``write_home(shard, master)``
        for the parameter home), the device copy is dropped and the shard steps on the CPU again (an
        fp32 accumulator on the device comes to the host). Returns the device bytes freed."""
        st = self._by_shard.get(shard.index)
        if st is None or st.dev is None:
            return 0
        if st.dev_stale:
            host = self._state_in_ram(st, read=False)
            host.copy_(st.dev)
            if st.home.tier != Tier.CPU:
                self.swapper.write(st.home, host).wait()
            if write_home is not None:
                req = write_home(shard, host[:st.numel])
                if req is not None:
                    req.wait()
        freed = st.dev.numel() * 4
        if st.grad is not None and st.grad.device.type != "cpu":
            st.grad = st.grad.cpu()
        st.src = st.norm = None
        st.dev = st.dev_step = None
        st.dev_stale = False
        shard.device_step = False
        return freed

    def accumulate_on_device(self, shard: FlatShard, device: torch.device) -> int:
        """Under accumulation, keeps the shard's fp32 gradient accumulator on ``device``: each
        micro-batch's gradient is added there (no copy off the device, no host add) and the sum is
        copied into a pinned host buffer once, in the boundary micro-batch, for the CPU step.
        Returns the device bytes taken (0: frozen, stepped on the device, or no accumulation)."""
        st = self._by_shard.get(shard.index)
        if st is None or st.dev is not None or st.landing is not None or self.accumulate_steps <= 1:
            return 0
        self._wait_adds("moving an accumulator", raise_failure=False)
        acc = torch.empty(st.numel, dtype=torch.float32, device=device)
        if st.grad is not None and st.written:  # the window's sum so far comes along
            acc.copy_(st.grad)
        st.landing = aligned_empty(st.numel, torch.float32, pin=device.type == "cuda")
        st.grad, st.acc_event = acc, None
        shard.grad_on_device = True
        return acc.numel() * 4

    def accumulator_to_host(self, shard: FlatShard) -> int:
        """Undoes ``accumulate_on_device``: the window's sum so far comes to the host, the pinned
        buffer becomes the host accumulator. Returns the device bytes freed."""
        st = self._by_shard.get(shard.index)
        if st is None or st.landing is None:
            return 0
        if st.acc_event is not None:
            st.acc_event.synchronize()
        freed = st.grad.numel() * 4
        if st.written:
            st.landing.copy_(st.grad)
        st.grad, st.landing, st.acc_event = st.landing, None, None
        shard.grad_on_device = False
        return freed

    def _state_in_ram(self, st: ShardOptimState, read: bool) -> torch.Tensor:
        """A shard's [master|m|v] in RAM: its home there, else a buffer of its size (filled from
        the home on disk when ``read``)."""
        if st.home.tier == Tier.CPU:
            return st.home.tensor
        buf = aligned_empty(3 * st.numel, torch.float32)
        if read:
            self.swapper.read(st.home, buf).wait()
        return buf

    # ------------------------------------------------------------------------- gradients
    def grad_ready(self, shard: FlatShard, src: torch.Tensor, event: Any, norm: Optional[torch.Tensor]) -> None:
        """One unit's gradient of this micro-batch: ``src`` (host, compute dtype) is complete once
        ``event`` has (None: already). Under accumulation it is added into the fp32 accumulator now;
        otherwise it is kept for the step (and handed to the worker at once when nothing global
        is needed)."""
        st = self._by_shard.get(shard.index)
        if st is None:
            return
        if st.dev is not None:
            self._grad_on_device(st, src, norm)
            return
        if st.landing is not None:
            self._add_on_device(st, src)
            return
        if self.accumulate_steps > 1:
            self._submit_add(st, src, event)
            return
        if st.src is not None:
            raise RuntimeError(f"shard {shard.index} ({shard.module_name or '<root>'}) got a second gradient in one "
                               "optimizer step without accumulation (backward() called twice before step()?)")
        # the worker may still be writing the last step's state of this shard back (its new values
        # are home already): the new gradient waits for that
        self._wait(lambda: not st.busy, f"shard {shard.index} ({shard.module_name or '<root>'})")
        st.src, st.event, st.norm = src, event, norm
        if self._eager and self._window is not None:
            self._hand(st, _Job(self._window, None))
            self._handed_early += 1

    def _submit_add(self, st: ShardOptimState, src: torch.Tensor, event: Any) -> None:
        """Hands one unit's micro-batch gradient (a staging buffer) to the accumulation worker, which
        adds it into the fp32 accumulator while backward goes on; in the boundary micro-batch it
        also takes the sum's norm and, when nothing global is needed, hands the unit to the step."""
        self._check_window("backward()")
        final = self._window is not None  # the boundary micro-batch: after this add the sum is complete
        job = _Job(self._window, None) if final and self._eager else None
        if job is not None:
            self._handed_early += 1  # counted now: overlap_open holds from here on
        epoch = self._epoch
        release = self.release_grad
        adder = self._accumulator()
        adder.submit(lambda: self._add_one(st, src, event, final, job, epoch),
                     after=(lambda: release(src)) if release is not None else None)

    def _add_on_device(self, st: ShardOptimState, src: torch.Tensor) -> None:
        """A unit with a device accumulator: its gradient (on the device) is added there on the
        current stream; in the boundary micro-batch the sum's norm is taken there and the sum is
        copied to the host (``_land``), then handed to the step like an unaccumulated gradient."""
        self._check_window("backward()")
        if st.acc_event is not None:  # the last window's sum may still be on its way to the host
            if st.grad.is_cuda:
                torch.cuda.current_stream(st.grad.device).wait_event(st.acc_event)
            st.acc_event = None
        if st.grad.device.type == "cpu" and self._caller_scratch is None:
            self._caller_scratch = torch.empty(ADD_CHUNK, dtype=torch.float32)
        fresh = len(st.written) != len(st.shard.slices)
        final = self._window is not None
        squares: Optional[list] = [] if final else None
        add_into(st.grad, src, copy=fresh, scratch=self._caller_scratch, squares=squares)
        if fresh:
            st.written.update(sl.offset for sl in st.shard.slices)
        if final:
            self._land(st, norm_of_squares(squares))
            if self._eager:
                self._hand(st, _Job(self._window, None))
                self._handed_early += 1

    def _land(self, st: ShardOptimState, norm: torch.Tensor) -> None:
        """Copies a device accumulator's sum into its pinned host buffer: from here on it is the
        shard's gradient for the step (``src``, complete once ``event`` has)."""
        # the last step of this shard may still read the buffer (a background step)
        self._wait(lambda: not st.busy, f"shard {st.shard.index} ({st.shard.module_name or '<root>'})")
        if self.copy_to_host is not None:
            ev = self.copy_to_host(st.grad, st.landing)
        else:
            st.landing.copy_(st.grad)
            ev = None
        st.src, st.event, st.norm, st.acc_event = st.landing, ev, norm, ev

    def _land_rest(self) -> None:
        """In step(): the device accumulators whose unit got no gradient in the boundary micro-batch
        land now (their unwritten parts as zeros; the norm as the host accumulators' is taken)."""
        for st in self.states:
            if st.landing is not None and st.src is None and not st.handed:
                self._fill_unwritten([st])
                self._land(st, torch.linalg.vector_norm(st.grad, 2))

    def _accumulator(self) -> AccumulateWorker:
        if self._adder is None:
            self._adder = AccumulateWorker(self.threads)
        return self._adder

    def _add_one(self, st: ShardOptimState, src: torch.Tensor, event: Any, final: bool, job: Optional[_Job],
                 epoch: int) -> None:
        """On the accumulation worker: ``src`` into the shard's fp32 accumulator (copied in the
        window's first micro-batch), chunk by chunk; the sum's norm in the boundary micro-batch."""
        # the step worker may still be stepping the last window's accumulator: it must be done first
        self._wait(lambda: not st.busy, f"shard {st.shard.index} ({st.shard.module_name or '<root>'})")
        if event is not None:
            event.synchronize()
        if st.grad is None:
            st.grad = torch.empty(st.numel, dtype=torch.float32)
        adder = self._adder
        if adder.scratch is None:
            adder.scratch = torch.empty(ADD_CHUNK, dtype=torch.float32)
        fresh = len(st.written) != len(st.shard.slices)
        squares: Optional[list] = [] if final else None
        add_into(st.grad, src, copy=fresh, scratch=adder.scratch, squares=squares)
        if fresh:
            st.written.update(sl.offset for sl in st.shard.slices)
        if final:
            st.norm = norm_of_squares(squares)
        if job is not None:
            with self._cond:
                current = epoch == self._epoch  # cancel() abandoned the step meanwhile: hand nothing over
            if current:
                self._hand(st, job)

    def _wait_adds(self, what: str = "the optimizer step", raise_failure: bool = True) -> None:
        """Waits until every gradient handed to the accumulation worker is added; with
        ``raise_failure`` raises its failure (see ``_check_window``)."""
        if self._adder is not None:
            self._adder.wait(what, raise_failure=False)
        if raise_failure:
            self._check_window(what)

    def check_accumulation(self, what: str) -> None:
        """Raises a failure of the accumulation worker (without waiting for it): the failure itself
        the first time, then a refusal until ``zero_grad`` drops the incomplete window."""
        self._check_window(what)

    def _check_window(self, what: str) -> None:
        """Raises the accumulation worker's failure the first time (as itself), then refuses to go on
        with the window it left incomplete until ``zero_grad`` drops it."""
        err = self._adder.failure if self._adder is not None else None
        if err is None:
            return
        self._adder.check()  # the failure itself, once
        raise RuntimeError(f"{what}: a gradient add of this optimizer step's accumulation failed earlier ({err!r}): "
                           "the accumulated gradients are incomplete; call zero_grad() to drop this step's "
                           "micro-batches, or load_checkpoint()") from err

    @property
    def accumulation_failure(self) -> Optional[BaseException]:
        """The accumulation worker's failure (kept until ``zero_grad``), or None."""
        return self._adder.failure if self._adder is not None else None

    def _grad_on_device(self, st: ShardOptimState, src: torch.Tensor, norm: Optional[torch.Tensor]) -> None:
        """A device-stepped unit's gradient (on the device, compute stream): accumulated there, or
        kept for the step; stepped at once when nothing global is needed."""
        if self.accumulate_steps > 1:
            self._add_flat(st, src)
        else:
            if st.src is not None:
                raise RuntimeError(f"shard {st.shard.index} ({st.shard.module_name or '<root>'}) got a second gradient "
                                   "in one optimizer step without accumulation (backward() called twice before step()?)")
            st.src, st.norm = src, norm
        if self._window is not None and self._eager:
            self._step_device(st, self._window, None)
            self._handed_early += 1

    def accumulate(self, shard: FlatShard, sl: ParamSlice, grad: torch.Tensor) -> None:
        """Adds one parameter's gradient (any device/dtype) into the shard's fp32 accumulator."""
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

    def _add_flat(self, st: ShardOptimState, src: torch.Tensor) -> None:
        if st.grad is None:
            st.grad = torch.empty(st.numel, dtype=torch.float32, device=src.device)
        if len(st.written) == len(st.shard.slices):
            st.grad.add_(src)
        else:
            st.grad.copy_(src)
            st.written.update(sl.offset for sl in st.shard.slices)

    def zero_grad(self) -> None:
        """Starts a new accumulation window: the next gradient of each shard overwrites its
        accumulator (no pass over it). Drops a window a failed add left incomplete."""
        self._wait_adds("zero_grad()", raise_failure=False)
        if self._adder is not None:
            reported = self._adder.reported
            err = self._adder.take_failure()
            if err is not None and not reported:
                log.warning("a gradient add of this optimizer step's accumulation failed (%r); its micro-batches are "
                            "dropped", err)
        for st in self.states:
            st.written.clear()

    def _fill_unwritten(self, states: Optional[Sequence[ShardOptimState]] = None) -> None:
        """Parameters that got no gradient in this window count as zero gradient."""
        for st in self.states if states is None else states:
            if len(st.written) == len(st.shard.slices) and st.grad is not None:
                continue
            if st.grad is None:
                st.grad = torch.empty(st.numel, dtype=torch.float32,
                                      device=st.dev.device if st.dev is not None else "cpu")
            for sl in st.shard.slices:
                if sl.offset not in st.written:
                    st.grad[sl.offset:sl.offset + sl.numel].zero_()
                    st.written.add(sl.offset)

    def _norm_of(self, st: ShardOptimState) -> torch.Tensor:
        """The L2 norm of a shard's gradient in this window (fp32 scalar; 0 when it got none)."""
        if st.norm is not None:
            return st.norm.float()
        if st.src is not None:
            if st.event is not None:
                st.event.synchronize()
            return torch.linalg.vector_norm(st.src, 2, dtype=torch.float32)
        if st.grad is not None and st.written:
            self._fill_unwritten([st])
            return torch.linalg.vector_norm(st.grad, 2)
        return torch.zeros((), dtype=torch.float32)

    def grad_norm(self) -> float:
        """Global L2 norm over every shard's gradient (inf/nan if any is not finite), combined in
        shard order (the same in every path)."""
        self._wait_adds("the gradient norm")
        norms = [self._norm_of(st) for st in self.states]
        if not norms:
            return 0.0
        dev = next((n.device for n in norms if n.device.type != "cpu"), torch.device("cpu"))
        return float(torch.linalg.vector_norm(torch.stack([n.to(dev) for n in norms]), 2))  # one sync

    def gradient(self, shard: FlatShard) -> Optional[torch.Tensor]:
        """A copy of the shard's gradient of this window in fp32 (None: frozen, or none yet)."""
        st = self._by_shard.get(shard.index)
        if st is None:
            return None
        self._wait_adds("reading a gradient")
        if st.src is not None:
            if st.event is not None:
                st.event.synchronize()
            return st.src.float()
        return st.grad.clone() if st.grad is not None and st.written else None

    def _grad32(self, st: ShardOptimState) -> torch.Tensor:
        """The shard's gradient for the step, in fp32 on the host (consumes ``src``). The fp32
        accumulator is completed (``_fill_unwritten``) by ``step`` before any shard is handed over:
        the worker must not look at ``written``, which the caller resets for the next window."""
        if st.src is not None:
            if st.event is not None:
                st.event.synchronize()
            key = threading.get_ident()
            buf = self._scratch.get(key)
            if buf is None or buf.numel() < st.numel:
                biggest = max(s.numel for s in self.states)
                buf = self._scratch[key] = torch.empty(biggest, dtype=torch.float32)
            g = buf[:st.numel]
            g.copy_(st.src)
            return g
        if threading.current_thread() is not self._worker:
            self._fill_unwritten([st])
        if st.grad is None:  # a shard that never got a gradient: zero (weight decay still applies)
            st.grad = torch.zeros(st.numel, dtype=torch.float32)
        return st.grad

    # ------------------------------------------------------------------------- the step
    def _staging_buffers(self) -> list[torch.Tensor]:
        if not self._staging:
            biggest = max((st.numel for st in self.states if st.home.tier == Tier.NVME), default=0)
            if biggest:
                n = self.buffer_count if self.pipeline else 1
                self._staging = [aligned_empty(3 * biggest, torch.float32, pin=self.swapper._pin)
                                 for _ in range(n)]
        return self._staging

    def iter_states(self, write_back: bool, states: Optional[Sequence[ShardOptimState]] = None
                    ) -> Iterator[tuple[ShardOptimState, torch.Tensor]]:
        """Yields (state, flat [master|m|v]) for every shard (or those of ``states``), reading NVMe
        homes ahead of use and, if ``write_back``, writing each back after the caller is done with
        it (pipelined). Waits for the background worker first."""
        self.drain()
        all_states = list(self.states if states is None else states)
        staging = self._staging_buffers()
        nb = len(staging)
        reads: dict[int, Any] = {}
        writes: dict[int, Any] = {}  # buffer index -> pending write(s)
        nvme = [i for i, st in enumerate(all_states) if st.home.tier == Tier.NVME]
        slot_of = {i: k % max(1, nb) for k, i in enumerate(nvme)}
        order = {i: k for k, i in enumerate(nvme)}
        tail: list[Any] = []  # requests for cpu-tier shards (parameter writes)

        def start_read(i: int) -> None:
            b = slot_of[i]
            for w in writes.pop(b, []):
                w.wait()
            st = all_states[i]
            reads[i] = self.swapper.read(st.home, staging[b][:3 * st.numel])

        if nvme:
            start_read(nvme[0])
        for i, st in enumerate(all_states):
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

    def _hyper(self) -> dict:
        g = self.param_groups[0]
        beta1, beta2 = g["betas"]
        return {"lr": float(g["lr"]), "beta1": beta1, "beta2": beta2, "weight_decay": float(g["weight_decay"]),
                "eps": float(g["eps"])}

    def _adam(self, st: ShardOptimState, flat: torch.Tensor, hyper: dict, inv_factor: Optional[torch.Tensor],
              k: int = 0, grad: Optional[torch.Tensor] = None) -> torch.Tensor:
        """One fused Adam/AdamW step of one shard's [master|m|v] ``flat`` with ``grad`` (fp32, host;
        default: the shard's gradient); returns the new master (on the host). ``k`` alternates the
        device buffer sets of a streamed step."""
        n = st.numel
        dev = self.step_device
        if dev is None and grad is None and self.fused and flat.dtype == torch.float32:
            return self._adam_fused(st, flat, hyper, inv_factor)
        t0 = time.perf_counter()
        g32 = self._grad32(st) if grad is None else grad
        t1 = time.perf_counter()
        st.step += 1
        work, g = flat, g32
        if dev is not None:  # stream the state to the device, step there, bring it back
            dflat, dgrad = self._device_buffers(k % 2)
            work, g = dflat[:3 * n], dgrad[:n]
            work.copy_(flat, non_blocking=True)
            g.copy_(g32, non_blocking=True)
        master, m, v = work[:n], work[n:2 * n], work[2 * n:]
        step_t = torch.tensor(float(st.step), device=dev)
        kernel = torch._fused_adamw_ if self.cfg.adam_w_mode else torch._fused_adam_
        # unscaling/clipping happens inside the kernel (it divides by grad_scale): no extra pass
        kernel([master], [g], [m], [v], [], [step_t], lr=hyper["lr"], beta1=hyper["beta1"],
               beta2=hyper["beta2"], weight_decay=hyper["weight_decay"], eps=hyper["eps"],
               amsgrad=False, maximize=False, grad_scale=inv_factor)
        if dev is not None:
            flat.copy_(work)  # device -> host; waits for the kernel (the write-back needs it)
            master = flat[:n]
        self._count(gradient=t1 - t0, adam=time.perf_counter() - t1)
        return master

    def _adam_fused(self, st: ShardOptimState, flat: torch.Tensor, hyper: dict,
                    inv_factor: Optional[torch.Tensor]) -> torch.Tensor:
        """The CPU step in one pass (``_C.adam_step``): the gradient read as it is (bf16 or fp32,
        no fp32 copy) and, when ``param_out`` gives the shard's bf16 home, the new weights cast
        into it in the same pass (``shard.home_fresh``: ``write_param`` need not cast them)."""
        from pyinfinity import _C

        n = st.numel
        t0 = time.perf_counter()
        if st.src is not None:
            if st.event is not None:
                st.event.synchronize()
            g = st.src
        else:
            if threading.current_thread() is not self._worker:
                self._fill_unwritten([st])
            if st.grad is None:  # a shard that never got a gradient: zero (weight decay still applies)
                st.grad = torch.zeros(n, dtype=torch.float32)
            g = st.grad
        if g.dtype not in (torch.float32, torch.bfloat16) or not g.is_contiguous():
            g = g.float().contiguous()  # fp16 gradients: converted once
        out = self.param_out(st.shard) if self.param_out is not None else None
        if out is not None and (out.dtype != torch.bfloat16 or out.numel() != n or not out.is_contiguous()):
            out = None
        t1 = time.perf_counter()
        st.step += 1
        scale = float(inv_factor) if inv_factor is not None else 1.0
        _C.adam_step(flat.data_ptr(), flat.data_ptr() + 4 * n, flat.data_ptr() + 8 * n, g.data_ptr(),
                     1 if g.dtype == torch.bfloat16 else 0, out.data_ptr() if out is not None else 0, n,
                     hyper["lr"], hyper["beta1"], hyper["beta2"], hyper["eps"], hyper["weight_decay"],
                     bool(self.cfg.adam_w_mode), st.step, scale, self._kernel_threads())
        if out is not None:
            st.shard.home_fresh = True
        self._count(gradient=t1 - t0, adam=time.perf_counter() - t1)
        return flat[:n]

    def _kernel_threads(self) -> int:
        """Threads of the one-pass step: on the caller's thread torch's intra-op count; on the
        worker ``threads`` when set (a CPU compute device leaves the cores to backward), else every
        CPU this process may run on (a GPU run's CPU is otherwise idle while the worker steps)."""
        if threading.current_thread() is not self._worker:
            return torch.get_num_threads()
        if self.threads is not None:
            return int(self.threads)
        try:
            return len(os.sched_getaffinity(0))
        except (AttributeError, OSError):
            return os.cpu_count() or 1

    def _count(self, **seconds: float) -> None:
        with self._cond:
            for k, v in seconds.items():
                self._phase_s[k] = self._phase_s.get(k, 0.0) + v

    def _finish(self, st: ShardOptimState) -> None:
        """The shard's gradient is consumed and its new values are home (its norm stays for the
        step's report until ``step`` has combined them)."""
        st.src = st.event = None
        st.shard.home_dirty = False

    def _step_states(self, states: Sequence[ShardOptimState], hyper: dict,
                     inv_factor: Optional[torch.Tensor]) -> None:
        """Steps ``states`` in order on this thread through the pipelined read/step/write-back of
        ``iter_states``, handing each new master to ``write_param``."""
        if not states:
            return
        gen = self.iter_states(write_back=True, states=states)
        k = 0
        done: list[ShardOptimState] = []
        try:
            item = gen.send(None)
            while True:
                st, flat = item
                master = self._adam(st, flat, hyper, inv_factor, k)
                st.handed = True  # stepped in this step (a failure after this leaves the state partly stepped)
                k += 1
                extra: list = []
                t0 = time.perf_counter()
                if self.write_param is not None:
                    req = self.write_param(st.shard, master)
                    if req is not None:
                        extra.append(req)
                self._count(write=time.perf_counter() - t0)
                done.append(st)
                item = gen.send(extra)
        except StopIteration:
            pass
        for st in done:  # every write has completed (iter_states waited for them)
            self._finish(st)

    def restore_homes(self) -> None:
        """Writes the current master values home for every shard whose home holds a gradient (a
        skipped or abandoned step): the parameters are as they were before the backward."""
        for st in self.states:  # a gradient on the device (or landed from there) never touched a home: drop it
            if (st.dev is not None or st.landing is not None) and not st.handed:
                st.src = st.event = st.norm = None
        dirty = [st for st in self.states if st.shard.home_dirty and not st.busy]
        if not dirty:
            return
        for st, flat in self.iter_states(write_back=False, states=dirty):
            if st.event is not None:
                st.event.synchronize()  # the gradient copy must not land after the weights
            if self.write_param is not None:
                req = self.write_param(st.shard, flat[:st.numel])
                if req is not None:
                    req.wait()
            st.src = st.event = st.norm = None
            st.shard.home_dirty = False

    def step(self, grad_scale: float = 1.0, clip: float = 0.0, check_overflow: bool = False) -> StepResult:
        """One Adam/AdamW step on every shard. Gradients are divided by ``grad_scale`` (fp16 loss
        scale) and clipped to global norm ``clip`` (0 = off), as torch's clip_grad_norm_ does.
        With ``background``, the shards not yet handed to the worker are handed over and step()
        returns; otherwise they are stepped here."""
        t0 = time.perf_counter()
        self._raise_error()
        self._wait_adds("step()")  # every micro-batch's gradient is in its accumulator (and handed over, if eager)
        hyper = self._window if self._window is not None else self._hyper()
        if hyper != self._hyper():  # every shard of a step uses one set: the one backward started with
            log.warning("lr/betas/eps/weight_decay changed between backward() and step() (%s -> %s); this step "
                        "used the values backward() started with: set them before backward()", hyper, self._hyper())
        early = self._handed_early
        if early and (grad_scale != 1.0 or clip > 0 or check_overflow):
            raise RuntimeError("overlap_step: shards were stepped during backward, but this step needs loss "
                               "scaling, clipping or an overflow check first")
        self._land_rest()
        norm = self.grad_norm()
        raw_norm = norm / grad_scale if grad_scale != 1.0 else norm
        self._window, self._eager, self._handed_early = None, False, 0
        if check_overflow and not math.isfinite(norm):
            self.restore_homes()
            for st in self.states:
                st.norm = None
            dt = time.perf_counter() - t0
            return StepResult(grad_norm=raw_norm, skipped=True, seconds=dt, busy_seconds=dt)
        factor = 1.0 / grad_scale if grad_scale != 1.0 else 1.0
        if clip > 0:
            coef = clip / (raw_norm + 1e-6)
            if coef < 1.0:
                factor *= coef
        # on the device that steps (torch's fused kernel reads it there; a host tensor would be an illegal address)
        inv_factor = torch.tensor(1.0 / factor, device=self.step_device) if factor != 1.0 else None
        rest = [st for st in self.states if not st.handed]
        self._fill_unwritten([st for st in rest if st.src is None])
        on_device = [st for st in rest if st.dev is not None]
        if on_device:  # first: a few kernels on the compute stream, ahead of the next forward
            inv_dev = (torch.tensor(1.0 / factor, dtype=torch.float32, device=on_device[0].dev.device)
                       if factor != 1.0 else None)
            for st in on_device:
                self._step_device(st, hyper, inv_dev)
            rest = [st for st in rest if st.dev is None]
        if self.background and self.step_device is None:
            job = _Job(hyper, inv_factor)
            for st in rest:
                self._hand(st, job)
            busy = 0.0
        else:
            self._step_states(rest, hyper, inv_factor)
            busy = time.perf_counter() - t0
        for st in self.states:
            st.handed = False
            st.norm = None
        with self._cond:
            busy += self._busy_s
            read_wait, self._busy_s, self._read_wait_s = self._read_wait_s, 0.0, 0.0
            phases, self._phase_s = self._phase_s, {}
        if self._adder is not None:  # the gradient adds of this step's micro-batches (on their worker)
            phases["accumulate"] = self._adder.take_busy()
        dt = time.perf_counter() - t0
        return StepResult(grad_norm=raw_norm, skipped=False, seconds=dt, read_wait_s=read_wait,
                          busy_seconds=busy, overlapped_shards=early,
                          phases={k: round(v, 6) for k, v in phases.items()})

    # ------------------------------------------------------------------------- the worker
    @property
    def overlap_open(self) -> bool:
        """Whether a boundary backward's step has begun (shards handed to the worker) and step()
        has not been called yet."""
        return self._handed_early > 0

    def begin_overlap(self, eager: bool) -> None:
        """The boundary micro-batch's backward begins: its hyperparameters are fixed now; with
        ``eager`` (nothing global needed) each unit is handed to the worker as its gradient lands."""
        self._window = self._hyper()
        self._eager = eager and self.background and self.step_device is None
        if self._eager:
            self._start_worker()

    def _start_worker(self) -> None:
        if self._worker is None or not self._worker.is_alive():
            ready = threading.Event()
            self._worker = threading.Thread(target=self._work, args=(ready,), name="pyinfinity-optimizer",
                                            daemon=True)
            self._worker.start()
            if not ready.wait(WAIT_STUCK_S):
                raise RuntimeError(f"the optimizer's worker thread did not start in {WAIT_STUCK_S:.0f}s")
            if self.threads is not None:
                # torch.set_num_threads in the worker also set the default of threads started later:
                # put it back (this thread keeps its own count, the worker keeps ``threads``)
                torch.set_num_threads(torch.get_num_threads())

    def _hand(self, st: ShardOptimState, job: _Job) -> None:
        self._start_worker()
        with self._cond:
            st.busy = True
            st.handed = True
            st.shard.home_dirty = True  # its home is rewritten: a fetch waits for the worker (wait_shard)
            self._seq += 1
            seq = self._seq
        self._queue.put((st.shard.index, seq, (st, job)))

    def _work(self, ready: threading.Event) -> None:
        """The worker: steps handed shards in order, reading the NVMe states of the shards queued
        behind the current one ahead of use (one staging buffer each)."""
        if self.threads is not None:
            torch.get_num_threads()  # the thread's lazy init first, or its first op would redo it from the default
            torch.set_num_threads(self.threads)
        ready.set()
        staging = self._staging_buffers()
        nb = max(1, len(staging))
        counter = 0
        pending: dict[int, Any] = {}  # staging buffer -> write-back in flight
        written: dict[int, Any] = {}  # shard index -> its state's write-back in flight (read it only after)
        ahead: collections.deque = collections.deque()  # [state, job, buffer, read request, submit error]
        stop = False

        def take(item: tuple) -> None:
            nonlocal counter
            st, job = item
            entry = [st, job, None, None, None]
            if st.home.tier == Tier.NVME and self._error is None:
                b = counter % nb
                counter += 1
                entry[2] = b
                try:
                    w = pending.pop(b, None)
                    if w is not None:
                        w.wait()
                    w = written.pop(st.shard.index, None)
                    if w is not None:  # its last step's state is still on its way to the disk
                        w.wait()
                    entry[3] = self.swapper.read(st.home, staging[b][:3 * st.numel])
                except BaseException as exc:  # noqa: BLE001 - raised when this shard's turn comes
                    entry[4] = exc
            ahead.append(entry)

        while True:
            if not ahead:
                if stop:
                    return
                item = self._queue.get()[2]
                if item is None:
                    return
                take(item)
            while not stop and len(ahead) < nb:
                try:
                    item = self._queue.get_nowait()[2]
                except queue.Empty:
                    break
                if item is None:
                    stop = True
                    break
                take(item)
            st, job, b, req, submit_error = ahead.popleft()
            with self._cond:
                self._current = st
                failed = self._error is not None
            t0 = time.perf_counter()
            try:
                if submit_error is not None:
                    raise submit_error
                if failed:
                    if req is not None:
                        req.wait()  # its buffer must be free before anyone reuses it
                else:
                    self._step_one(st, job, staging[b][:3 * st.numel] if b is not None else None, req, pending, b)
                    if b is not None:
                        written[st.shard.index] = pending[b]
                if not ahead and self._queue.empty():
                    for w in pending.values():
                        w.wait()
                    pending.clear()
                    written.clear()
            except BaseException as exc:  # noqa: BLE001 - raised in the caller's thread
                for w in pending.values():
                    try:
                        w.wait()
                    except BaseException as exc2:  # noqa: BLE001 - the first failure is the one raised
                        log.debug("optimizer worker: a write-back after the failure also failed: %r", exc2)
                pending.clear()
                written.clear()
                with self._cond:
                    if self._error is None:
                        self._error = exc
                log.debug("optimizer worker: stepping shard %d failed: %r", st.shard.index, exc)
            finally:
                with self._cond:
                    self._busy_s += time.perf_counter() - t0
                    st.busy = False
                    self._current = None
                    self._cond.notify_all()

    def _step_one(self, st: ShardOptimState, job: _Job, buf: Optional[torch.Tensor], req: Any,
                  pending: dict[int, Any], b: Optional[int]) -> None:
        if st.home.tier == Tier.CPU:
            flat = st.home.tensor
        else:
            t0 = time.perf_counter()
            req.wait()
            with self._cond:
                self._read_wait_s += time.perf_counter() - t0
                self._phase_s["read_wait"] = self._phase_s.get("read_wait", 0.0) + time.perf_counter() - t0
            flat = buf
        master = self._adam(st, flat, job.hyper, job.inv_factor)
        t0 = time.perf_counter()
        if self.write_param is not None:
            r = self.write_param(st.shard, master)
            if r is not None:
                r.wait()  # a fetch of this shard may come right after: its home must be complete
        self._count(write=time.perf_counter() - t0)
        if st.home.tier == Tier.NVME:
            pending[b] = self.swapper.write(st.home, buf)
        self._finish(st)

    @property
    def failure(self) -> Optional[BaseException]:
        """The background worker's failure, kept until ``cancel()``: the worker skips every shard
        handed to it after one (they would step on a state it left half written), and the
        optimizer state is partly stepped (some shards of a step stepped or written, others not)."""
        return self._error

    def _raise_error(self) -> None:
        """Raises the worker's failure in the caller's thread: the exception itself the first
        time, a ``BackgroundStepFailed`` naming it after that (until ``cancel()``)."""
        err = self._error
        if err is None:
            return
        if not self._error_reported:
            self._error_reported = True
            raise err
        raise BackgroundStepFailed(f"the background optimizer step failed earlier ({err!r}): the optimizer state is "
                                   "partly stepped; load_checkpoint() or build a new engine") from err

    def wait_shard(self, shard: FlatShard) -> float:
        """Waits until the worker has written the shard's new values home if it was handed to it
        (a fetch is about to read the home); returns the seconds waited. Raises the worker's
        failure. A home may still hold a gradient after this (no step() yet): see ``master_values``."""
        st = self._by_shard.get(shard.index)
        t0 = time.perf_counter()
        if st is not None:
            self._wait(lambda: not st.busy, f"shard {shard.index} ({shard.module_name or '<root>'})")
        self._raise_error()
        return time.perf_counter() - t0

    def master_values(self, shard: FlatShard, dst: torch.Tensor) -> None:
        """Writes the shard's current weights (its fp32 master, cast) into ``dst``: the values of a
        home that holds a gradient while no step has consumed it (a forward between backward()
        and step(), e.g. an evaluation)."""
        st = self._by_shard[shard.index]
        dst.copy_(self._state_in_ram(st, read=True)[:st.numel])

    def drain(self) -> None:
        """Waits until the workers have finished everything handed to them (the gradient adds too);
        raises the step worker's failure (an add's failure is raised by the next backward, step()
        or gradient read)."""
        self._wait_adds("the gradient accumulation", raise_failure=False)
        self._wait(lambda: not any(st.busy for st in self.states), "the optimizer step")
        self._raise_error()

    def _wait(self, done: Callable[[], bool], what: str) -> None:
        t_start = time.perf_counter()
        with self._cond:
            while not done():
                if self._worker is None or not self._worker.is_alive():
                    raise RuntimeError(f"the optimizer's worker thread died while {what} was pending")
                if not self._cond.wait(WAIT_WARN_S):
                    cur = self._current
                    on = (f"shard {cur.shard.index} ({cur.shard.module_name or '<root>'}, {cur.home.tier.value} tier)"
                          if cur is not None else "the next queued shard")
                    waited = time.perf_counter() - t_start
                    msg = f"waited {waited:.0f}s for {what}; the optimizer's worker is on {on}"
                    if waited >= WAIT_STUCK_S:
                        raise TimeoutError(msg + "; giving up (the optimizer state is partly stepped)")
                    log.warning("%s", msg)

    def cancel(self) -> int:
        """Abandons the step in progress (a failed backward, close, a checkpoint load): waits for
        what the worker was handed (it skips the rest after a failure of its own), forgets the
        gradients not consumed and the worker's failure (``failure``: read it first). Returns how
        many shards were stepped since the last step() (0: the optimizer state is as before, unless
        the worker failed: its failure may be an earlier step's)."""
        with self._cond:
            self._epoch += 1  # adds still queued hand nothing over to the step
        on_worker = threading.current_thread() is self._worker  # (a finalizer may run there): never wait on itself
        on_adder = self._adder is not None and threading.current_thread() is self._adder._thread
        try:
            if not on_worker and not on_adder:
                self._wait_adds("the gradient accumulation", raise_failure=False)
                self._wait(lambda: not any(st.busy for st in self.states), "the optimizer step")
        finally:
            self._window, self._eager, self._handed_early = None, False, 0
            self._error, self._error_reported = None, False
            stepped = sum(1 for st in self.states if st.handed)
            for st in self.states:
                st.handed = False
                st.norm = None
                if st.dev is not None or st.landing is not None:  # its gradient is not in a home: forget it
                    st.src = st.event = None
        return stepped

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
        st.src = st.event = st.norm = None
        shard.home_dirty = False  # the caller writes the loaded values home next
        self.swapper.write(st.home, flat.contiguous()).wait()
        if st.dev is not None:
            st.dev.copy_(flat)
            st.dev_step.fill_(float(step))
            st.dev_stale = False

    @property
    def bytes_by_tier(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for st in self.states:
            out[st.home.tier.value] = out.get(st.home.tier.value, 0) + st.home.nbytes
            if st.dev is not None:  # a copy of the home, stepped there
                out["device"] = out.get("device", 0) + st.dev.numel() * 4
        return out

    @property
    def disk_bytes_per_step(self) -> int:
        """Bytes of optimizer state a step reads from disk and writes back: the homes on NVMe whose
        units are stepped on the CPU (a unit with a device copy is stepped there, off the disk)."""
        return sum(st.home.nbytes for st in self.states if st.home.tier == Tier.NVME and st.dev is None)

    @property
    def grad_bytes(self) -> int:
        """Host bytes of fp32 gradients: the accumulators in RAM and the pinned buffers device
        accumulators land in."""
        return self.grad_bytes_by_tier.get("cpu", 0)

    @property
    def grad_bytes_by_tier(self) -> dict[str, int]:
        """Bytes of fp32 gradients by tier: "cpu" (accumulators in RAM, the buffers device
        accumulators land in) and "device" (device accumulators)."""
        out: dict[str, int] = {}
        for st in self.states:
            parts = []
            if st.landing is not None:
                parts = [("device", st.grad), ("cpu", st.landing)]
            elif st.grad is not None:
                parts = [("cpu" if st.grad.device.type == "cpu" else "device", st.grad)]
            for tier, t in parts:
                out[tier] = out.get(tier, 0) + t.numel() * 4
        return out

    def close(self) -> None:
        """Stops the worker (after the shard it is on) and frees the buffers."""
        try:
            self.cancel()
        finally:
            if self._adder is not None:
                self._adder.close()
                self._adder = None
            if self._worker is not None and self._worker is threading.current_thread():
                self._queue.put((math.inf, 0, None))  # it stops when it gets there
                self._worker = None
            elif self._worker is not None:
                self._queue.put((math.inf, 0, None))
                self._worker.join(WAIT_STUCK_S)
                if self._worker.is_alive():
                    log.warning("the optimizer's worker thread did not stop within %.0fs", WAIT_STUCK_S)
                self._worker = None
        self._staging.clear()
        self._dev_bufs.clear()
        self._scratch.clear()
        for st in self.states:
            st.grad = None
            st.src = None
            st.landing = st.acc_event = None
            st.shard.grad_on_device = False
            st.dev = st.dev_step = None  # device copies of the state go with the engine (its homes stay the record)
