"""The offloaded optimizer: Adam/AdamW state per shard in host RAM or on NVMe, stepped on the CPU
or on the compute device; global-norm clipping; fp16 dynamic loss scaling.

``OffloadOptimizer`` places each trainable shard's state (its home) and runs the step; the work
is done by parts with one job each, in ``zero/optim/``:

* ``formats.py`` — the state's format (``OptimStateFormat``: what a parameter costs, how a home is
  allocated, filled, saved, loaded, converted and stepped on the CPU and on the device):
  ``AdamFp32`` (fp32 master and moments ``[master | exp_avg | exp_avg_sq]``, the default),
  ``Adam8bit`` and ``AdamBf16`` (``pyinfinity.optimizer_state``, docs/optimizer_state.md);
* ``grads.py`` — gradient intake: each unit's gradient until the step reads it (kept, or added
  into an fp32 accumulator under accumulation, on the host by the accumulation worker or on the
  device), the norms;
* ``landing.py`` — the landing ring: the few pinned buffers device accumulators' sums are copied
  into for the CPU step, each given back by the step that read it;
* ``cpu_step.py`` — the per-shard step of a state the CPU reads (one pass, or streamed to the
  device) and the serial step over many shards, pipelined over NVMe homes;
* ``device.py`` — units whose state lives on the compute device, and the streamed step's buffers;
* ``worker.py`` — the background worker (``pyinfinity.overlap_step``): steps handed shards while the
  caller goes on, reads NVMe states ahead, keeps its failure for the caller;
* ``groups.py`` — param groups that differ within a shard (lr, betas, eps, weight decay): the
  kernel calls of one shard's step;
* ``records.py``, ``scaler.py`` — the records they share, fp16 loss scaling.

Every path runs the same per-shard function on the same inputs, so the background step is
bit-identical to the serial one.
"""
from __future__ import annotations

import logging
import math
import time
from typing import Any, Callable, Iterator, Mapping, Optional, Sequence

import torch

from pyinfinity.swap.tensor_swapper import Tier, TensorSwapper, aligned_empty
from pyinfinity.zero.optim.cpu_step import CpuStep
from pyinfinity.zero.optim.device import DeviceStates, StreamedStep
from pyinfinity.config import QUANT_BLOCK
from pyinfinity.zero.optim.formats import DEVICE_CHUNK, Adam8bit, AdamFp32, OptimStateFormat
from pyinfinity.zero.optim.grads import GradientIntake
from pyinfinity.zero.optim.groups import ShardRanges, shard_ranges, split_blocks
from pyinfinity.zero.optim.records import (BackgroundStepFailed, PhaseClock, ShardOptimState, StepJob, StepResult,
                                           StepWindow)
from pyinfinity.zero.optim.scaler import DynamicLossScaler
from pyinfinity.zero.optim.worker import WAIT_STUCK_S, WAIT_WARN_S, StepWorker
from pyinfinity.zero.partition import FlatShard, ParamSlice

log = logging.getLogger(__name__)


class OffloadOptimizer:
    """Adam/AdamW over flat shards whose state lives in RAM or on NVMe.

    ``param_groups`` mirrors torch's (one group, or those of ``set_param_groups``) so
    DeepSpeed-style and torch LR schedulers can drive each group's ``lr``. ``write_param(shard,
    flat)`` is called after each shard's step with the new master values (fp32, host); it writes them home in the compute dtype and returns a request
    (or None) that completes the write. ``state_format``: how a shard's state is stored and
    stepped (default: ``AdamFp32``). ``param_out(shard)``: the bf16 home the one-pass CPU step may
    write the new weights into (then ``write_param`` is called with ``cast=False``);
    ``release_grad(buf)`` gives a gradient staging buffer back once its gradient is added (under
    accumulation); ``copy_to_host(device tensor, pinned host tensor) -> event`` brings a device
    accumulator's sum to the host. ``background``: step in a worker thread
    (``pyinfinity.overlap_step``); ``threads``: intra-op threads of the background step and the
    gradient adds (None: torch's default); ``total_numel``: the trainable elements of the model,
    what ``nvme_ratio`` splits (or ``plan()``).
    """

    def __init__(self, cfg: Any, swapper: TensorSwapper, *, nvme_ratio: float = 0.0,
                 buffer_count: int = 4, pipeline: bool = True,
                 write_param: Optional[Callable[..., Any]] = None,
                 step_device: Optional[torch.device] = None, accumulate_steps: int = 1,
                 state_format: Optional[OptimStateFormat] = None,
                 param_out: Optional[Callable[[FlatShard], Optional[torch.Tensor]]] = None,
                 release_grad: Optional[Callable[[torch.Tensor], None]] = None,
                 copy_to_host: Optional[Callable[[torch.Tensor, torch.Tensor], Any]] = None,
                 background: bool = False, threads: Optional[int] = None, total_numel: int = 0) -> None:
        self.cfg = cfg
        self.format = state_format if state_format is not None else AdamFp32(cfg.adam_w_mode)
        # where the Adam arithmetic runs: None = on the CPU, in place on the host state; a device
        # = each shard's state is streamed there, stepped by the device's fused kernel and back
        self.step_device = torch.device(step_device) if step_device is not None else None
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
        self._group_of: dict[int, int] = {}  # id(parameter) -> its group (``set_param_groups``); others: group 0
        self._decay_of: dict[int, float] = {}  # id(parameter) -> its own weight decay (``set_weight_decay``)
        self.total_numel = total_numel  # trainable elements in all: what ratio splits
        self.background = background
        # the last backward handed units to the worker as their gradients landed: a step then
        # updates the shards in backward's order (the last first), else in order
        self.steps_during_backward = False
        self.window = StepWindow()
        self.phases = PhaseClock()
        self.worker = StepWorker(swapper, step_shard=self._step_shard, finish=self._finish,
                                 staging=lambda: self.cpu.staging_buffers(), phases=self.phases)
        self.grads = GradientIntake(self.states, self._by_shard, self.accumulate_steps, self.window,
                                    wait_idle=self.worker.wait_for, hand=self._hand,
                                    step_on_device=lambda st, hyper: self.on_device.step(st, hyper, None),
                                    on_worker=self.worker.is_current, release_grad=release_grad,
                                    copy_to_host=copy_to_host, step_failure=self.worker.raise_error)
        self.on_device = DeviceStates(self.states, self._by_shard, self.format, swapper, self.phases,
                                      self._state_in_ram)
        streamed = StreamedStep(self.step_device, self.format, self.states) if self.step_device is not None else None
        self.cpu = CpuStep(self.states, self.format, swapper, self.grads, self.phases, buffer_count=self.buffer_count,
                           pipeline=pipeline, streamed=streamed, on_worker=self.worker.is_current,
                           param_out=param_out)
        self.threads = threads
        self._before_update: Optional[Callable[[ShardOptimState, Optional[torch.Tensor]], None]] = None

    # ------------------------------------------------------------------------- knobs
    @property
    def threads(self) -> Optional[int]:
        """Intra-op threads of the background step and of the gradient adds (None: torch's default)."""
        return self._threads

    @threads.setter
    def threads(self, n: Optional[int]) -> None:
        self._threads = n
        self.worker.threads = self.grads.threads = self.cpu.threads = n

    @property
    def fused(self) -> bool:
        """The format's one-pass CPU step (False: torch's fused kernel on the host)."""
        return self.cpu.fused

    @fused.setter
    def fused(self, on: bool) -> None:
        self.cpu.fused = on

    # ------------------------------------------------------------------------- placement
    def plan(self, shards: Sequence[FlatShard]) -> None:
        """Declares the trainable shards up front so ``ratio`` can split RAM vs NVMe by size."""
        self.total_numel = sum(s.numel for s in shards if s.trainable)

    def _tier_for(self, numel: int) -> Tier:
        if self.nvme_ratio <= 0:
            return Tier.CPU
        # the first (1 - ratio) of the state (in order of creation) stays in RAM, the rest on disk
        placed = sum(s.numel for s in self.states)
        ram_share = (1.0 - self.nvme_ratio) * self.total_numel
        return Tier.CPU if placed + numel <= ram_share else Tier.NVME

    def add_shard(self, shard: FlatShard, flat32: torch.Tensor) -> Optional[ShardOptimState]:
        """Creates a shard's state from its fp32 values (moments zero). Frozen shards get none."""
        if not shard.trainable:
            return None
        n = shard.numel
        tier = self._tier_for(n)
        home = self.format.allocate(self.swapper, f"optim.{shard.index}", n, tier)
        numel, dtype = self.format.home_spec(n)
        buf = home.tensor if tier == Tier.CPU else aligned_empty(numel, dtype)
        self.format.init(buf, n, flat32)
        self.swapper.write(home, buf).wait()
        st = ShardOptimState(shard, home)
        self.states.append(st)
        self._by_shard[shard.index] = st
        return st

    def state_of(self, shard: FlatShard) -> Optional[ShardOptimState]:
        return self._by_shard.get(shard.index)

    def set_weight_decay(self, decay_of: Mapping[int, float]) -> int:
        """Gives the parameters named by ``decay_of`` (``id(parameter)`` -> weight decay) their own
        AdamW weight decay, in place of their group's ``weight_decay`` (which the others keep, read
        at every step); replaces any earlier call's. A shard holding parameters of different decay
        is stepped as ``optim.groups`` says. Returns the shards whose decay is split by range.
        ValueError for Adam's L2 decay, or a state format whose master is not fp32, where one shard's
        parameters would differ."""
        self.drain()
        ranges = self._ranges(self._group_of, decay_of)
        split = 0
        for st in self.states:
            r = ranges[st.shard.index]
            if r is None or len({wd for _, _, _, wd in r.ranges}) == 1:
                continue
            split += 1
            if not self.format.adam_w:
                raise ValueError(f"weight decay per parameter within one unit ({st.shard.module_name or '<root>'}): "
                                 "only AdamW's decoupled decay can differ there, not Adam's L2 decay")
            if not self.format.master_fp32:
                raise ValueError(f"weight decay per parameter within one unit ({st.shard.module_name or '<root>'}): "
                                 f"the {self.format.name} optimizer state's master cannot take a separate decay "
                                 "pass; use the fp32 or 8bit state, or one weight decay")
        self._decay_of = dict(decay_of)
        self._apply_ranges(ranges)
        return split

    def set_param_groups(self, groups: Sequence[Mapping[str, Any]]) -> int:
        """Steps the parameters of each of ``groups`` (torch's param groups: ``params`` and any of
        ``lr``, ``betas``, ``eps``, ``weight_decay``; a key left out takes group 0's as it is now)
        with that group's values, as a torch Adam/AdamW built on those groups would: ``param_groups``
        becomes one group per given group, in order (a schedule sets each one's ``lr``; its
        ``initial_lr`` is the lr given), and a parameter no group names steps with group 0's.
        Replaces any earlier call's. Returns the shards stepped range by range (``optim.groups``).
        ValueError for a parameter in two groups, or where a range of other hyperparameters would
        start inside a quantisation block of the 8-bit state."""
        if not groups:
            raise ValueError("set_param_groups: no groups given")
        self.drain()
        base = self.param_groups[0]
        new: list[dict] = []
        group_of: dict[int, int] = {}
        for i, g in enumerate(groups):
            lr = float(g.get("lr", base["lr"]))
            new.append({"lr": lr, "initial_lr": float(g.get("initial_lr", lr)),
                        "betas": tuple(float(b) for b in g.get("betas", base["betas"])),
                        "eps": float(g.get("eps", base["eps"])),
                        "weight_decay": float(g.get("weight_decay", base["weight_decay"])), "params": []})
            for p in g.get("params", ()):
                if group_of.setdefault(id(p), i) != i:
                    raise ValueError(f"set_param_groups: a parameter is in groups {group_of[id(p)]} and {i}")
        ranges = self._ranges(group_of, self._decay_of)
        if self.format.name == "8bit":
            def key(group: int, wd: Optional[float]) -> tuple:
                g = new[group]
                w = g["weight_decay"] if wd is None else wd
                return (g["lr"], g["betas"], g["eps"], None if self.format.decoupled_decay else w)

            for st in self.states:
                at = split_blocks(ranges[st.shard.index], st.numel, QUANT_BLOCK, key)
                if at is not None and Adam8bit.quantized(st.numel):
                    raise ValueError(f"param groups within one unit ({st.shard.module_name or '<root>'}): a group's "
                                     f"parameters start at element {at}, inside a quantisation block of {QUANT_BLOCK} "
                                     "of the 8bit optimizer state; use the fp32 or bf16 state, or give these "
                                     "parameters one group")
        self.param_groups[:] = new
        self.defaults = dict(new[0])
        self._group_of = group_of
        self._apply_ranges(ranges)
        return sum(1 for r in ranges.values() if r is not None and not r.uniform())

    def _ranges(self, group_of: Mapping[int, int], decay_of: Mapping[int, float]) -> dict[int, Optional[ShardRanges]]:
        return {st.shard.index: shard_ranges(st.shard.slices, st.numel, group_of, decay_of) for st in self.states}

    def _apply_ranges(self, ranges: Mapping[int, Optional[ShardRanges]]) -> None:
        for st in self.states:
            st.ranges = ranges[st.shard.index]

    def _state_in_ram(self, st: ShardOptimState, read: bool, out: Optional[torch.Tensor] = None) -> torch.Tensor:
        """A shard's state in RAM: its home there, else a buffer of its size (``out``, or a new
        one), filled from the home on disk when ``read``."""
        if st.home.tier == Tier.CPU:
            return st.home.tensor
        numel, dtype = self.format.home_spec(st.numel)
        if out is not None and (out.numel(), out.dtype) != (numel, dtype):
            raise ValueError(f"shard {st.shard.index}: its state needs {numel} {dtype} elements, out has "
                             f"{out.numel()} {out.dtype}")
        buf = out if out is not None else aligned_empty(numel, dtype)
        if read:
            self.swapper.read(st.home, buf).wait()
        return buf

    def home_on_host(self, st: ShardOptimState) -> bool:
        """Whether a shard's state has its home in RAM (else on disk)."""
        return st.home.tier == Tier.CPU

    def home_in_ram(self, st: ShardOptimState, out: Optional[torch.Tensor] = None) -> torch.Tensor:
        """A shard's state as its home holds it, in RAM: its home there, else read from the disk
        into ``out`` (its home's elements and dtype) or a new buffer."""
        return self._state_in_ram(st, True, out)

    def set_before_update(self, fn: Optional[Callable[[ShardOptimState, Optional[torch.Tensor]], None]]) -> None:
        """``fn(state, flat)`` runs before anything changes a shard's host state (its step, from any
        thread, with ``flat`` the state about to be stepped, in RAM; a device copy written back to
        the home, with None: the home is still as it was): a background checkpoint takes its copy
        there. None removes it."""
        self._before_update = fn
        self.cpu.before_update = fn
        self.on_device.before_update = fn

    def to_device(self, shard: FlatShard, device: torch.device) -> int:
        """Keeps the shard's state on ``device`` too, stepped there (``optim.device.DeviceStates``).
        Returns the device bytes taken (0 for a frozen shard)."""
        if self.step_device is not None and self._by_shard.get(shard.index) is not None:
            raise ValueError("to_device: the streamed device step already steps every unit on the device")
        return self.on_device.to_device(shard, device)

    def sync_homes(self, write_home: Optional[Callable[[FlatShard, torch.Tensor], Any]] = None) -> None:
        """Brings the host homes of device-stepped units up to date (checkpoints, export)."""
        self.on_device.sync_homes(write_home)

    def to_host(self, shard: FlatShard, write_home: Optional[Callable[[FlatShard, torch.Tensor], Any]] = None) -> int:
        """Undoes ``to_device``; returns the device bytes freed."""
        return self.on_device.to_host(shard, write_home)

    def accumulate_on_device(self, shard: FlatShard, device: torch.device) -> int:
        """Keeps the shard's fp32 gradient accumulator on ``device`` (``optim.grads``); returns the
        device bytes taken."""
        return self.grads.accumulate_on_device(shard, device)

    def reserve_landing(self) -> int:
        """Allocates the landing ring of the device accumulators placed now (``optim.landing``);
        returns its bytes."""
        return self.grads.reserve_landing()

    def accumulator_to_host(self, shard: FlatShard) -> int:
        """Undoes ``accumulate_on_device`` (the window's sum so far comes along); returns the device
        bytes freed."""
        return self.grads.accumulator_to_host(shard)

    # ------------------------------------------------------------------------- gradients
    def grad_ready(self, shard: FlatShard, src: torch.Tensor, event: Any, norm: Optional[torch.Tensor]) -> None:
        """One unit's gradient of this micro-batch (``optim.grads.GradientIntake.grad_ready``)."""
        self.grads.grad_ready(shard, src, event, norm)

    def accumulate(self, shard: FlatShard, sl: ParamSlice, grad: torch.Tensor) -> None:
        """Adds one parameter's gradient (any device/dtype) into the shard's fp32 accumulator."""
        self.grads.accumulate(shard, sl, grad)

    def check_accumulation(self, what: str) -> None:
        """Raises a failure of the accumulation worker (without waiting for it): the failure itself
        the first time, then a refusal until ``zero_grad`` drops the incomplete window."""
        self.grads.check(what)

    @property
    def accumulation_failure(self) -> Optional[BaseException]:
        """The accumulation worker's failure (kept until ``zero_grad``), or None."""
        return self.grads.failure

    def zero_grad(self) -> None:
        """Starts a new accumulation window (no pass over the accumulators); drops a window a
        failed add left incomplete."""
        self.grads.zero_grad()

    def grad_norm(self) -> float:
        """Global L2 norm over every shard's gradient (inf/nan if any is not finite)."""
        return self.grads.grad_norm()

    def gradient(self, shard: FlatShard) -> Optional[torch.Tensor]:
        """A copy of the shard's gradient of this window in fp32 (None: frozen, or none yet)."""
        return self.grads.gradient(shard)

    # ------------------------------------------------------------------------- the step
    def iter_states(self, write_back: bool, states: Optional[Sequence[ShardOptimState]] = None
                    ) -> Iterator[tuple[ShardOptimState, torch.Tensor]]:
        """Yields (state, its home in RAM) for every shard (or those of ``states``), reading NVMe
        homes ahead of use and, if ``write_back``, writing each back after the caller is done with
        it (pipelined). Waits for the background worker first."""
        self.drain()
        yield from self.cpu.iter_states(write_back, self.states if states is None else states)

    def _hyper(self) -> dict:
        """The step's hyperparameters: group 0's, and with several groups each one's under
        ``"groups"`` (``optim.groups.step_calls`` picks a range's)."""
        sets = tuple(self._group_hyper(g) for g in self.param_groups)
        return {**sets[0], "groups": sets} if len(sets) > 1 else sets[0]

    @staticmethod
    def _group_hyper(g: Mapping[str, Any]) -> dict:
        beta1, beta2 = g["betas"]
        return {"lr": float(g["lr"]), "beta1": float(beta1), "beta2": float(beta2),
                "weight_decay": float(g["weight_decay"]), "eps": float(g["eps"])}

    def _adam(self, st: ShardOptimState, flat: torch.Tensor, hyper: dict, inv_factor: Optional[torch.Tensor],
              k: int = 0, grad: Optional[torch.Tensor] = None) -> torch.Tensor:
        """One step of one shard's state ``flat`` (``optim.cpu_step.CpuStep.adam``): the function
        every path (serial, background) runs; returns the new master. A device accumulator's sum
        is read by then: its landing buffer goes back to the ring, also when the step failed."""
        try:
            return self.cpu.adam(st, flat, hyper, inv_factor, k, grad)
        finally:
            self.grads.release_landing(st)

    def _step_shard(self, st: ShardOptimState, flat: torch.Tensor, job: StepJob) -> None:
        """The background worker's step of one shard: Adam, then its new values home."""
        master = self._adam(st, flat, job.hyper, job.inv_factor)
        t0 = time.perf_counter()
        r = self._write_values(st, master)
        if r is not None:
            r.wait()  # a fetch of this shard may come right after: its home must be complete
        self.phases.add(write=time.perf_counter() - t0)

    def _write_values(self, st: ShardOptimState, master: torch.Tensor) -> Any:
        """A stepped shard's new master values home through ``write_param`` (not cast again when the
        one-pass step cast them into the home); returns the write's request, if any."""
        written, st.home_written = st.home_written, False
        if self.write_param is None:
            return None
        return self.write_param(st.shard, master, cast=False) if written else self.write_param(st.shard, master)

    def _finish(self, st: ShardOptimState) -> None:
        """The shard's gradient is consumed and its new values are home (its norm stays for the
        step's report until ``step`` has combined them)."""
        st.src = st.event = None
        st.shard.run.home_current()

    def restore_homes(self) -> None:
        """Writes the current master values home for every shard whose home holds a gradient (a
        skipped or abandoned step): the parameters are as they were before the backward."""
        for st in self.states:  # a gradient on the device (or landed from there) never touched a home: drop it
            if (st.dev is not None or st.device_acc or st.landing is not None) and not st.handed:
                self.grads.release_landing(st)
                st.src = st.event = st.norm = None
        dirty = [st for st in self.states if st.shard.run.home_stale and not st.busy]
        if not dirty:
            return
        for st, flat in self.iter_states(write_back=False, states=dirty):
            if st.event is not None:
                st.event.synchronize()  # the gradient copy must not land after the weights
            st.home_written = False
            if self.write_param is not None:
                req = self.write_param(st.shard, self.format.master(flat, st.numel))
                if req is not None:
                    req.wait()
            st.src = st.event = st.norm = None
            st.shard.run.home_current()

    def step(self, grad_scale: float = 1.0, clip: float = 0.0, check_overflow: bool = False) -> StepResult:
        """One Adam/AdamW step on every shard. Gradients are divided by ``grad_scale`` (fp16 loss
        scale) and clipped to global norm ``clip`` (0 = off), as torch's clip_grad_norm_ does.
        With ``background``, the shards not yet handed to the worker are handed over and step()
        returns; otherwise they are stepped here."""
        t0 = time.perf_counter()
        self.worker.raise_error()
        self.grads.wait("step()")  # every micro-batch's gradient is in its accumulator (and handed over, if eager)
        w = self.window
        hyper = w.hyper if w.hyper is not None else self._hyper()
        if hyper != self._hyper():  # every shard of a step uses one set: the one backward started with
            log.warning("lr/betas/eps/weight_decay changed between backward() and step() (%s -> %s); this step "
                        "used the values backward() started with: set them before backward()", hyper, self._hyper())
        early = w.handed_early
        if early and (grad_scale != 1.0 or clip > 0 or check_overflow):
            raise RuntimeError("overlap_step: shards were stepped during backward, but this step needs loss "
                               "scaling, clipping or an overflow check first")
        norm = self.grads.grad_norm()
        raw_norm = norm / grad_scale if grad_scale != 1.0 else norm
        w.close()
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
        self.grads.fill_unwritten([st for st in rest if st.src is None])
        on_device = [st for st in rest if st.dev is not None]
        if on_device:  # first: a few kernels on the compute stream, ahead of the next forward
            inv_dev = (torch.tensor(1.0 / factor, dtype=torch.float32, device=on_device[0].dev.device)
                       if factor != 1.0 else None)
            for st in on_device:
                self.on_device.step(st, hyper, inv_dev, 1.0 / factor)
            rest = [st for st in rest if st.dev is None]
        if self.background and self.step_device is None:
            job = StepJob(hyper, inv_factor)
            for st in rest:
                if st.device_acc and st.src is None:  # lands here (on the compute stream's side), waiting
                    self.grads.land(st)               # for the worker to give a buffer back if need be
                self._hand(st, job)
            busy = 0.0
        else:
            self.cpu.step_states(rest, hyper, inv_factor, self._adam, self._write_values, self._finish,
                                 iter_states=self.iter_states)
            busy = time.perf_counter() - t0
        for st in self.states:
            st.handed = False
            st.norm = None
        worker_busy, read_wait = self.worker.take_times()
        busy += worker_busy
        phases = self.phases.take()
        accumulate = self.grads.take_busy()
        if accumulate is not None:  # the gradient adds of this step's micro-batches (on their worker)
            phases["accumulate"] = accumulate
        dt = time.perf_counter() - t0
        return StepResult(grad_norm=raw_norm, skipped=False, seconds=dt, read_wait_s=read_wait,
                          busy_seconds=busy, overlapped_shards=early,
                          phases={k: round(v, 6) for k, v in phases.items()})

    # ------------------------------------------------------------------------- the background step
    @property
    def overlap_open(self) -> bool:
        """Whether a boundary backward's step has begun (shards handed to the worker) and step()
        has not been called yet."""
        return self.window.handed_early > 0

    def begin_overlap(self, eager: bool) -> None:
        """The boundary micro-batch's backward begins: its hyperparameters are fixed now; with
        ``eager`` (nothing global needed) each unit is handed to the worker as its gradient lands."""
        self.window.hyper = self._hyper()
        self.window.eager = eager and self.background and self.step_device is None
        self.steps_during_backward = self.window.eager
        if self.window.eager:
            self.worker.start()

    def _hand(self, st: ShardOptimState, job: StepJob) -> None:
        self.worker.hand(st, job)

    @property
    def failure(self) -> Optional[BaseException]:
        """The background worker's failure, kept until ``cancel()``: the worker skips every shard
        handed to it after one (they would step on a state it left half written), and the
        optimizer state is partly stepped (some shards of a step stepped or written, others not)."""
        return self.worker.failure

    def _raise_error(self) -> None:
        self.worker.raise_error()

    def wait_shard(self, shard: FlatShard) -> float:
        """Waits until the worker has written the shard's new values home if it was handed to it
        (a fetch is about to read the home); returns the seconds waited. Raises the worker's
        failure. A home may still hold a gradient after this (no step() yet): see ``master_values``."""
        st = self._by_shard.get(shard.index)
        t0 = time.perf_counter()
        if st is not None:
            self.worker.wait_for(st, f"shard {shard.index} ({shard.module_name or '<root>'})")
        self.worker.raise_error()
        return time.perf_counter() - t0

    def master_values(self, shard: FlatShard, dst: torch.Tensor) -> None:
        """Writes the shard's current weights (its fp32 master, cast) into ``dst``: the values of a
        home that holds a gradient while no step has consumed it (a forward between backward()
        and step(), e.g. an evaluation)."""
        st = self._by_shard[shard.index]
        dst.copy_(self.format.master(self._state_in_ram(st, read=True), st.numel))

    def drain(self) -> None:
        """Waits until the workers have finished everything handed to them (the gradient adds too);
        raises the step worker's failure (an add's failure is raised by the next backward, step()
        or gradient read)."""
        self.grads.wait("the gradient accumulation", raise_failure=False)
        self.worker.wait(lambda: not any(st.busy for st in self.states), "the optimizer step")
        self.worker.raise_error()

    def cancel(self) -> int:
        """Abandons the step in progress (a failed backward, close, a checkpoint load): waits for
        what the worker was handed (it skips the rest after a failure of its own), forgets the
        gradients not consumed and the worker's failure (``failure``: read it first). Returns how
        many shards were stepped since the last step() (0: the optimizer state is as before, unless
        the worker failed: its failure may be an earlier step's)."""
        self.grads.abandon()  # adds still queued hand nothing over to the step
        # (a finalizer may run on a worker): never wait on itself
        on_worker = self.worker.is_current() or self.grads.on_adder()
        try:
            if not on_worker:
                self.grads.wait("the gradient accumulation", raise_failure=False)
                self.worker.wait(lambda: not any(st.busy for st in self.states), "the optimizer step")
        finally:
            self.window.close()
            self.worker.reset()
            stepped = sum(1 for st in self.states if st.handed)
            for st in self.states:
                st.handed = False
                st.norm = None
                if st.dev is not None or st.device_acc or st.landing is not None:  # not in a home: forget it
                    self.grads.release_landing(st)
                    st.src = st.event = None
        return stepped

    # ------------------------------------------------------------------------- state
    def load_shard_state(self, shard: FlatShard, flat: torch.Tensor, step: int) -> None:
        """Overwrites a shard's home with a saved state (``format.save``'s form; checkpoint load)."""
        st = self._by_shard[shard.index]
        data = self.format.load(flat.contiguous(), st.numel)
        st.step = step
        st.src = st.event = st.norm = None
        shard.run.home_current()  # the caller writes the loaded values home next
        self.swapper.write(st.home, data).wait()
        if st.dev is not None:
            st.dev.copy_(data)
            st.dev_step.fill_(float(step))
            st.dev_stale = False

    @property
    def bytes_by_tier(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for st in self.states:
            out[st.home.tier.value] = out.get(st.home.tier.value, 0) + st.home.nbytes
            if st.dev is not None:  # a copy of the home, stepped there
                out["device"] = out.get("device", 0) + st.dev.numel() * st.dev.element_size()
        return out

    @property
    def device_stepped_numel(self) -> int:
        """Parameters whose units are stepped on the device (a device copy of their state), not on
        the CPU."""
        return sum(st.numel for st in self.states if st.dev is not None)

    @property
    def disk_bytes_per_step(self) -> int:
        """Bytes of optimizer state a step reads from disk and writes back: the homes on NVMe whose
        units are stepped on the CPU (a unit with a device copy is stepped there, off the disk)."""
        return sum(st.home.nbytes for st in self.states if st.home.tier == Tier.NVME and st.dev is None)

    @property
    def grad_bytes(self) -> int:
        """Host bytes of fp32 gradients: the accumulators in RAM and the landing ring device
        accumulators' sums land in."""
        return self.grads.bytes_by_tier.get("cpu", 0)

    @property
    def grad_bytes_by_tier(self) -> dict[str, int]:
        """Bytes of fp32 gradients by tier (``optim.grads.GradientIntake.bytes_by_tier``)."""
        return self.grads.bytes_by_tier

    def close(self) -> None:
        """Stops the workers (after the shard each is on) and frees the buffers."""
        try:
            self.cancel()
        finally:
            self.grads.stop()
            self.worker.stop()
        self.cpu.close()
        if self.cpu.streamed is not None:
            self.cpu.streamed.close()
        self.grads.free()
        for st in self.states:
            st.src = None
        self.on_device.close()  # device copies of the state go with the engine (its homes stay the record)


__all__ = ["BackgroundStepFailed", "DEVICE_CHUNK", "DynamicLossScaler", "OffloadOptimizer", "OptimStateFormat",
           "ShardOptimState", "StepResult", "WAIT_STUCK_S", "WAIT_WARN_S"]
