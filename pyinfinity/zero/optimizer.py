"""The offloaded optimizer: fp32 master weights and Adam/AdamW moments per shard, in host RAM or on
NVMe, stepped on the CPU with torch's fused Adam kernels; gradients accumulated in fp32 on the
host; global-norm clipping; fp16 dynamic loss scaling.

The state of one shard is one flat fp32 home of ``3 * numel`` elements: ``[master | exp_avg |
exp_avg_sq]`` (one read and one write per shard per step). On NVMe the step is pipelined over
``buffer_count`` (>= 3) staging buffers: the read of shard k+1 and the write of shard k-1 run in
the swap engine's threads while shard k is stepped.

Step overlap (``begin_overlap``): in the boundary micro-batch's backward, a shard whose trainable
slices all received their gradient is handed to one background thread that steps it (NVMe read,
fused Adam, state write-back) while backward goes on; the thread starts the reads of the shards
queued behind the one it steps (a staging buffer each), so with backward ahead of it the disk
stays busy rather than waiting on one read at a time; ``step`` then steps the rest, joins the
thread and writes every shard's new values home through ``write_param`` on the calling thread
(after the engine released all shards, so no fetch reads a home being rewritten). Exact only
without clipping and fp16 loss scaling (nothing global is needed before a shard steps).
"""
from __future__ import annotations

import collections
import logging
import math
import queue
import threading
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
    # step overlap: slices (by offset) with a gradient in the boundary micro-batch, and whether the
    # shard was handed to the background thread (no gradient may arrive after that)
    fresh: set = field(default_factory=set)
    handed: bool = False

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
    seconds: float  # time the caller spent in step() (with overlap: the wait after backward)
    read_wait_s: float = 0.0
    busy_seconds: float = 0.0  # optimizer time in all threads (with overlap: hidden part included)
    overlapped_shards: int = 0  # shards stepped during backward


OVERLAP_WARN_S = 30.0  # a wait on the background step logs what it waits for this often
OVERLAP_STUCK_S = 600.0  # ... and gives up (TimeoutError) when one shard takes this long


@dataclass
class _OverlapWindow:
    """One boundary micro-batch's overlapped step: hyperparameters fixed at its start, shards
    stepped in the background with their new values (written home by ``step``) and norms."""

    hyper: dict
    done: list = field(default_factory=list)  # (state, new master values, grad norm), in step order
    held_bytes: int = 0  # bytes of new values kept for NVMe-tier shards (written home at step())
    held_cap: int = 0  # ... at most: as much as the staging buffers hold
    busy_s: float = 0.0
    read_wait_s: float = 0.0
    error: Optional[BaseException] = None  # first failure (the worker's or a late gradient)
    current: Optional[ShardOptimState] = None  # what the worker is stepping now
    since: float = 0.0
    queued: int = 0
    finished: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)
    idle: threading.Condition = field(init=False)

    def __post_init__(self) -> None:
        self.idle = threading.Condition(self.lock)


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
        self._n_grad: dict[int, int] = {}  # shard index -> trainable slices (gradients to wait for)
        self._window: Optional[_OverlapWindow] = None  # the open overlap window, if any
        self._queue: "queue.SimpleQueue[Optional[tuple[ShardOptimState, _OverlapWindow]]]" = queue.SimpleQueue()
        self._worker: Optional[threading.Thread] = None
        # intra-op threads of the background step (None: torch's). On a CPU compute device backward
        # uses every core: a second full OpenMP team there made steps 40% slower on 2 cores.
        self.overlap_threads: Optional[int] = None
        self._worker_ready = threading.Event()
        # probe for "auto": slices with a gradient in this micro-batch, and the first one that got two
        self._seen: Optional[set[tuple[int, int]]] = None
        self.repeated_grad: Optional[str] = None

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
        self._n_grad[shard.index] = shard.n_trainable
        return st

    def state_of(self, shard: FlatShard) -> Optional[ShardOptimState]:
        return self._by_shard.get(shard.index)

    # ------------------------------------------------------------------------- gradients
    def accumulate(self, shard: FlatShard, sl: ParamSlice, grad: torch.Tensor) -> None:
        """Adds one parameter's gradient (any device/dtype) into the shard's fp32 host buffer; in an
        overlap window, hands the shard to the background step once all its gradients are in."""
        st = self._by_shard.get(shard.index)
        if st is None:
            return
        win = self._window
        if win is not None and st.handed:
            # stepped already: this gradient would be lost. Recorded, raised after backward().
            with win.lock:
                if win.error is None:
                    win.error = RuntimeError(
                        f"overlap_step: shard {shard.index} ({shard.module_name or '<root>'}) got a gradient for "
                        f"{sl.name!r} after all its gradients were in and its optimizer step had started (a "
                        "parameter whose gradient hook runs twice in one backward, e.g. reentrant activation "
                        "checkpointing, or backward() called twice in one micro-batch); set "
                        "pyinfinity.overlap_step false. The optimizer state is partly stepped: load a checkpoint")
            return
        if self._seen is not None:
            key = (shard.index, sl.offset)
            if key in self._seen and self.repeated_grad is None:
                self.repeated_grad = sl.name
            self._seen.add(key)
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
        if win is not None:
            st.fresh.add(sl.offset)
            if len(st.fresh) == self._n_grad[shard.index]:
                self._hand_off(st, win)

    def probe_repeated_grads(self, on: bool) -> None:
        """Starts (or ends) watching, per micro-batch, for a parameter whose gradient arrives more
        than once (reentrant checkpointing of a reused layer, several backward() calls): with such a
        model, a shard cannot be stepped when its gradients first look complete. Each call with
        ``on`` starts a new micro-batch."""
        self._seen = set() if on else None

    def zero_grad(self) -> None:
        for st in self.states:
            st.written.clear()

    def _fill_unwritten(self, states: Optional[Sequence[ShardOptimState]] = None) -> None:
        """Parameters that got no gradient in this window count as zero gradient."""
        for st in self.states if states is None else states:
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

    def iter_states(self, write_back: bool, states: Optional[Sequence[ShardOptimState]] = None
                    ) -> Iterator[tuple[ShardOptimState, torch.Tensor]]:
        """Yields (state, flat [master|m|v]) for every shard (or those of ``states``), reading NVMe
        homes ahead of use and, if ``write_back``, writing each back after the caller is done with
        it (pipelined)."""
        self._check_no_window("iter_states")
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
              k: int = 0) -> torch.Tensor:
        """One fused Adam/AdamW step of one shard's [master|m|v] ``flat``; returns the new master
        (on the host). ``k`` alternates the device buffer sets of a streamed step."""
        n = st.numel
        dev = self.step_device
        st.step += 1
        work, grad = flat, st.grad
        if dev is not None:  # stream the state to the device, step there, bring it back
            dflat, dgrad = self._device_buffers(k % 2)
            work, grad = dflat[:3 * n], dgrad[:n]
            work.copy_(flat, non_blocking=True)
            grad.copy_(st.grad, non_blocking=True)
        master, m, v = work[:n], work[n:2 * n], work[2 * n:]
        step_t = torch.tensor(float(st.step), device=dev)
        kernel = torch._fused_adamw_ if self.cfg.adam_w_mode else torch._fused_adam_
        # unscaling/clipping happens inside the kernel (it divides by grad_scale): no extra pass
        kernel([master], [grad], [m], [v], [], [step_t], lr=hyper["lr"], beta1=hyper["beta1"],
               beta2=hyper["beta2"], weight_decay=hyper["weight_decay"], eps=hyper["eps"],
               amsgrad=False, maximize=False, grad_scale=inv_factor)
        if dev is not None:
            flat.copy_(work)  # device -> host; waits for the kernel (the write-back needs it)
            master = flat[:n]
        return master

    def _step_states(self, states: Sequence[ShardOptimState], hyper: dict,
                     inv_factor: Optional[torch.Tensor]) -> None:
        """Steps ``states`` in order through the pipelined read/step/write-back of ``iter_states``,
        handing each new master to ``write_param``."""
        if not states:
            return
        gen = self.iter_states(write_back=True, states=states)
        k = 0
        try:
            item = gen.send(None)
            while True:
                st, flat = item
                master = self._adam(st, flat, hyper, inv_factor, k)
                k += 1
                extra: list = []
                if self.write_param is not None:
                    req = self.write_param(st.shard, master)
                    if req is not None:
                        extra.append(req)
                item = gen.send(extra)
        except StopIteration:
            pass

    def step(self, grad_scale: float = 1.0, clip: float = 0.0, check_overflow: bool = False) -> StepResult:
        """One Adam/AdamW step on every shard. Gradients are divided by ``grad_scale`` (fp16 loss
        scale) and clipped to global norm ``clip`` (0 = off), as torch's clip_grad_norm_ does.
        In an overlap window: steps the shards the background thread did not, joins it and writes
        the new values of the shards it stepped (its failure is raised here)."""
        if self._window is not None:
            if grad_scale != 1.0 or clip > 0 or check_overflow:
                self.cancel_overlap()
                raise RuntimeError("overlap_step: a step with loss scaling, clipping or an overflow check cannot "
                                   "follow an overlapped backward (the engine turns overlap off for those)")
            return self._finish_overlap(self._window)
        t0 = time.perf_counter()
        self._fill_unwritten()
        norm = self.grad_norm()
        raw_norm = norm / grad_scale if grad_scale != 1.0 else norm
        if check_overflow and not math.isfinite(norm):
            dt = time.perf_counter() - t0
            return StepResult(grad_norm=raw_norm, skipped=True, seconds=dt, busy_seconds=dt)
        factor = 1.0 / grad_scale if grad_scale != 1.0 else 1.0
        if clip > 0:
            coef = clip / (raw_norm + 1e-6)
            if coef < 1.0:
                factor *= coef
        inv_factor = torch.tensor(1.0 / factor, device=self.step_device) if factor != 1.0 else None
        self._step_states(self.states, self._hyper(), inv_factor)
        dt = time.perf_counter() - t0
        return StepResult(grad_norm=raw_norm, skipped=False, seconds=dt, busy_seconds=dt)

    # ------------------------------------------------------------------------- step overlap
    @property
    def overlap_open(self) -> bool:
        """Whether a boundary backward's overlapped step is under way (``step`` completes it)."""
        return self._window is not None

    def _check_no_window(self, what: str) -> None:
        if self._window is not None:
            raise RuntimeError(f"{what}: the optimizer is stepping shards in the background (overlap_step) "
                               "between the boundary backward() and step(); call step() first")

    def begin_overlap(self) -> None:
        """Opens the overlap window of a boundary micro-batch (before its backward): from now on a
        shard whose gradients are all in is stepped in the background with the hyperparameters
        as they are now. Idempotent while open."""
        if self._window is not None:
            return
        if self.step_device is not None:
            raise RuntimeError("overlap_step: not supported with optimizer_step_device \"device\"")
        staging = self._staging_buffers()  # allocated here, not in the worker
        for st in self.states:
            st.fresh.clear()
            st.handed = False
        self._window = _OverlapWindow(hyper=self._hyper(), held_cap=sum(b.numel() * 4 for b in staging))
        if self._worker is None or not self._worker.is_alive():
            self._worker_ready.clear()
            self._worker = threading.Thread(target=self._work, name="pyinfinity-overlap-step", daemon=True)
            self._worker.start()
            if not self._worker_ready.wait(OVERLAP_STUCK_S):
                raise RuntimeError(f"overlap_step: the background step thread did not start in {OVERLAP_STUCK_S:.0f}s")
            if self.overlap_threads is not None:
                # torch.set_num_threads also set the default of threads started later: put it back
                # (this thread keeps its own count, the worker keeps overlap_threads)
                torch.set_num_threads(torch.get_num_threads())

    def _hand_off(self, st: ShardOptimState, win: _OverlapWindow) -> None:
        if win.error is not None:
            return  # no more work after a failure: the step raises it
        if st.home.tier == Tier.NVME:
            nbytes = st.numel * st.shard.dtype.itemsize
            if win.held_bytes + nbytes > win.held_cap:
                return  # stepped by step() instead: bounded host memory for the kept values
            win.held_bytes += nbytes
        st.handed = True
        self._fill_unwritten([st])  # its frozen slices
        with win.lock:
            win.queued += 1
        self._queue.put((st, win))

    def _work(self) -> None:
        """The background thread: steps handed shards in order, one at a time, reading the NVMe
        states of the shards queued behind the current one ahead of use (one staging buffer each)."""
        if self.overlap_threads is not None:
            torch.get_num_threads()  # the thread's lazy init first, or its first op would redo it from the default
            torch.set_num_threads(self.overlap_threads)  # this thread's team (begin_overlap restores the default)
        self._worker_ready.set()
        nb = max(1, len(self._staging))
        counter = 0  # NVMe-tier shards taken so far: consecutive ones get distinct staging buffers
        pending: dict[int, Any] = {}  # staging buffer -> write-back in flight
        ahead: collections.deque = collections.deque()  # [state, window, buffer, read request, submit error]
        stop = False

        def take(item: tuple) -> None:
            nonlocal counter
            st, win = item
            entry = [st, win, None, None, None]
            if st.home.tier == Tier.NVME and win.error is None:
                b = counter % nb
                counter += 1
                entry[2] = b
                try:
                    w = pending.pop(b, None)
                    if w is not None:
                        w.wait()  # the shard that used this buffer nb shards ago: written back first
                    entry[3] = self.swapper.read(st.home, self._staging[b][:3 * st.numel])
                except BaseException as exc:  # noqa: BLE001 - raised when this shard's turn comes
                    entry[4] = exc
            ahead.append(entry)

        while True:
            if not ahead:
                if stop:
                    return
                item = self._queue.get()
                if item is None:
                    return
                take(item)
            while not stop and len(ahead) < nb:  # read ahead what is already queued
                try:
                    item = self._queue.get_nowait()
                except queue.Empty:
                    break
                if item is None:
                    stop = True
                    break
                take(item)
            st, win, b, req, submit_error = ahead.popleft()
            with win.lock:
                win.current, win.since = st, time.perf_counter()
                failed = win.error is not None
            t0 = time.perf_counter()
            try:
                if submit_error is not None:
                    raise submit_error
                if failed:
                    if req is not None:
                        req.wait()  # its buffer must be free before anyone reuses it
                else:
                    self._step_in_background(st, win, pending, b, req)
                if win.queued == win.finished + 1:  # the last one for now: its writes are done too
                    for w in pending.values():
                        w.wait()
                    pending.clear()
            except BaseException as exc:  # noqa: BLE001 - handed to the main thread, raised there
                for w in pending.values():  # the staging buffers must be free before anyone reuses them
                    try:
                        w.wait()
                    except BaseException as exc2:  # noqa: BLE001 - the first failure is the one raised
                        log.debug("overlap_step: a write-back after the failure also failed: %r", exc2)
                pending.clear()
                with win.lock:
                    if win.error is None:
                        win.error = exc
                log.debug("overlap_step: stepping shard %d failed: %r", st.shard.index, exc)
            finally:
                with win.lock:
                    win.busy_s += time.perf_counter() - t0
                    win.finished += 1
                    win.current = None
                    win.idle.notify_all()

    def _step_in_background(self, st: ShardOptimState, win: _OverlapWindow, pending: dict[int, Any],
                            b: Optional[int], req: Any) -> None:
        norm = torch.linalg.vector_norm(st.grad, 2)
        n = st.numel
        if st.home.tier == Tier.CPU:
            new = self._adam(st, st.home.tensor, win.hyper, None)  # a view of the home: written at step()
        else:
            assert b is not None and req is not None
            buf = self._staging[b][:3 * n]
            t0 = time.perf_counter()
            req.wait()  # started when the shard was taken from the queue
            win.read_wait_s += time.perf_counter() - t0
            master = self._adam(st, buf, win.hyper, None)
            new = aligned_empty(n, st.shard.dtype)  # the values write_param gets at step()
            new.copy_(master)
            pending[b] = self.swapper.write(st.home, buf)
        with win.lock:
            win.done.append((st, new, norm))

    def _wait_idle(self, win: _OverlapWindow) -> None:
        """Waits until the worker has finished everything handed to it (bounded; says what it waits for)."""
        t_start = time.perf_counter()
        with win.lock:
            while win.finished < win.queued:
                if self._worker is None or not self._worker.is_alive():
                    raise RuntimeError(f"overlap_step: the background step thread died with "
                                       f"{win.queued - win.finished} shards handed to it")
                if not win.idle.wait(OVERLAP_WARN_S):
                    cur = win.current
                    what = (f"shard {cur.shard.index} ({cur.shard.module_name or '<root>'}, "
                            f"{cur.home.tier.value} tier)" if cur is not None else "the next queued shard")
                    stuck = time.perf_counter() - (win.since if cur is not None else t_start)
                    msg = (f"overlap_step: waited {time.perf_counter() - t_start:.0f}s for the background "
                           f"step; it has been on {what} for {stuck:.0f}s, {win.queued - win.finished} "
                           "shards left")
                    if stuck >= OVERLAP_STUCK_S:
                        raise TimeoutError(msg + "; giving up (the optimizer state is partly stepped)")
                    log.warning("%s", msg)

    def overlap_error(self) -> Optional[BaseException]:
        """The failure of the open window so far (the worker's exception, or a late gradient)."""
        win = self._window
        return None if win is None else win.error

    def _finish_overlap(self, win: _OverlapWindow) -> StepResult:
        t0 = time.perf_counter()
        self._wait_idle(win)
        waited = time.perf_counter() - t0
        if win.error is not None:
            self._window = None
            raise win.error
        self._window = None  # the worker is idle: the rest runs here
        if self._hyper() != win.hyper:  # every shard of a step uses one set: the one backward started with
            log.warning("overlap_step: lr/betas/eps/weight_decay changed between backward() and step() (%s -> %s); "
                        "this step used the values backward() started with: set them before backward()",
                        win.hyper, self._hyper())
        handed = {id(st): (new, norm) for st, new, norm in win.done}
        rest = [st for st in self.states if id(st) not in handed]
        self._fill_unwritten(rest)
        norms = {id(st): torch.linalg.vector_norm(st.grad, 2) for st in rest}
        norms.update({k: v[1] for k, v in handed.items()})
        self._step_states(rest, win.hyper, None)
        reqs = []
        if self.write_param is not None:
            for st, new, _ in win.done:  # the engine has released every shard: homes may change now
                req = self.write_param(st.shard, new)
                if req is not None:
                    reqs.append(req)
        for r in reqs:
            r.wait()
        stacked = [norms[id(st)] for st in self.states if st.grad is not None]
        norm = float(torch.linalg.vector_norm(torch.stack(stacked), 2)) if stacked else 0.0
        dt = time.perf_counter() - t0
        return StepResult(grad_norm=norm, skipped=False, seconds=dt, read_wait_s=win.read_wait_s,
                          busy_seconds=win.busy_s + (dt - waited), overlapped_shards=len(win.done))

    def cancel_overlap(self) -> int:
        """Closes the window without completing the step (a failed backward, close, a checkpoint
        load): waits until the worker has stepped what it was handed (after a failure of its own
        it skips the rest), writes no parameter. Returns how many shards were handed to it (0: the
        optimizer state is as before the window; else it is partly stepped)."""
        win = self._window
        if win is None:
            return 0
        try:
            self._wait_idle(win)
        finally:
            self._window = None
        return win.queued

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
        """Stops the background step thread (after the shard it is on) and frees the buffers."""
        try:
            self.cancel_overlap()
        finally:
            if self._worker is not None:
                self._queue.put(None)
                self._worker.join(OVERLAP_STUCK_S)
                if self._worker.is_alive():
                    log.warning("overlap_step: the background step thread did not stop within %.0fs", OVERLAP_STUCK_S)
                self._worker = None
        self._staging.clear()
        self._dev_bufs.clear()
        for st in self.states:
            st.grad = None
