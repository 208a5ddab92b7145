"""ParameterCoordinator: makes each module's shards resident on the compute device just before
use and releases them after, prefetching ahead along the recorded module order.

How parameters reach the compute at the right time:
  * forward: a pre-hook on every module fetches the shards of its own parameters (and of tied or
    registered external ones); a post-hook releases them when no other call still uses them.
  * backward: while the engine runs a forward, a saved-tensor hook replaces every saved tensor
    that aliases a shard buffer by a reference (so the buffer can be released after forward);
    unpacking it in backward fetches the shard again. This covers any op that saved a parameter
    — inside or outside its module's forward, tied, or called several times — without
    relying on module backward hooks. ``torch.utils.checkpoint`` recomputation goes through the
    forward hooks again.
  * gradients: a post-accumulate-grad hook on every parameter hands the gradient to the engine
    (which moves it off the device) and releases the shard once all its trainable parameters
    have their gradient; whatever is left is released by ``end_backward``.
  * trace: every transition of a shard from idle to in-use is recorded; the next iteration with
    the same mode replays it, prefetching ahead up to a byte budget; a mismatch (dynamic control
    flow) stops prefetching for that iteration (on-demand fetch) and the new order is recorded.

One class: the hooks, the transfers and the trace all drive each shard's state machine
(released, in flight, resident, in use: ``partition.ShardRun``) through its named transitions.
``DeviceCopies`` holds the copies beside the compute stream (gradients to the host, new values of
resident units).
"""
from __future__ import annotations

import contextlib
import logging
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Optional, Sequence

import torch
from torch import nn

from pyinfinity.swap.tensor_swapper import Tier, aligned_empty
from pyinfinity.zero.budget import DeviceBudget, DeviceBudgetError, FetchStats, OverlapSample
from pyinfinity.zero.partition import FlatShard, ParamSlice, Partition, ShardState, placeholder

log = logging.getLogger(__name__)

LOOKAHEAD_ENTRIES = 512  # trace entries scanned per prefetch decision (bounds the cost per use)
MAX_TRACE = 1 << 20  # uses recorded per iteration (a loop that never re-enters the root stops recording)
MAX_EVENT_PAIRS = 8192  # CUDA event pairs kept between overlap() calls (eval loops never call it)


@dataclass
class _Transfer:
    """A fetch in flight: host-side read, optional pinned staging and the H2D copy's events."""

    io: Any = None
    staging: Optional[torch.Tensor] = None
    copied: bool = False
    start: Any = None  # cuda events on the swap stream
    end: Any = None


@dataclass
class _ShardRef:
    """What a saved tensor aliasing a shard buffer is packed into (no reference to the buffer)."""

    shard: FlatShard
    offset: int
    size: tuple
    stride: tuple


class ParameterCoordinator:
    """Fetches, prefetches and releases parameter shards around every module's use.

    device: compute device. swapper: homes of the shards. device_memory: budget for resident
    shard bytes (None = unlimited). prefetch_bytes: how far ahead (in bytes) the trace prefetches.
    on_grad(shard, host_flat, event, norm): called once per shard and backward with the unit's
    whole gradient (compute dtype, on the host in ``grad_dest(shard)``; on the device for a unit
    whose optimizer state is there, ``ShardRun.steps_on_device``), the CUDA event that completes its
    copy (None on the CPU or on the device) and its L2 norm (fp32 scalar on the device); each
    parameter's gradient is summed into one flat device buffer per unit as it arrives and
    ``param.grad`` is cleared. grad_dest(shard) -> (host tensor, whether it is the parameter home).
    wait_home(shard): waits until a home that holds a gradient has the new values (the step);
    master_values(shard, dst): the current weights of a home that still holds a gradient.
    copies: the device-to-host and resident-update streams it shares with the homes and the
    optimizer (``DeviceCopies``; default: its own), whose ``stats`` it counts into.
    """

    def __init__(self, model: nn.Module, partition: Partition, swapper: Any, device: torch.device, *,
                 device_memory: Optional[int] = None, device_base: int = 0, prefetch_bytes: int = 0,
                 prefetch: bool = True,
                 on_grad: Optional[Callable[[FlatShard, torch.Tensor, Any, Optional[torch.Tensor]], None]] = None,
                 grad_dest: Optional[Callable[[FlatShard], tuple[torch.Tensor, bool]]] = None,
                 wait_home: Optional[Callable[[FlatShard], float]] = None,
                 master_values: Optional[Callable[[FlatShard, torch.Tensor], None]] = None,
                 fixed_bytes: int = 0, max_live_elements: Optional[int] = None,
                 max_inflight_reads: Optional[int] = None, copies: Optional[DeviceCopies] = None) -> None:
        self.model = model
        self.partition = partition
        self.swapper = swapper
        self.device = torch.device(device)
        self.budget = DeviceBudget(capacity=device_memory,
                                   cuda_device=self.device if self.device.type == "cuda" else None,
                                   base=device_base if self.device.type == "cuda" else 0)
        self.budget.add(fixed_bytes)
        self.budget.fixed = fixed_bytes
        self.prefetch_bytes = int(prefetch_bytes)
        self.prefetch_enabled = prefetch and prefetch_bytes > 0
        self.on_grad = on_grad
        self.grad_dest = grad_dest
        self.wait_home = wait_home
        self.master_values = master_values
        self.max_live_elements = max_live_elements  # stage3_max_live_parameters: caps prefetch
        self.max_inflight_reads = max_inflight_reads  # offload_param.buffer_count: NVMe reads ahead
        self.copies = copies if copies is not None else DeviceCopies(self.device, FetchStats())
        self.stats = self.copies.stats
        self.in_backward = False
        self.grads_handed = 0  # units whose gradient on_grad got in this backward (the engine resets it)
        self.prefetch_high = 0  # most bytes prefetched ahead at once since the engine last reset it
        # a unit the trace named next was larger than the whole prefetch bucket (so nothing could be
        # fetched ahead of it) since the engine last reset this: prefetch growth's cue when
        # prefetch_high stayed 0
        self.prefetch_starved = False
        self._handles: list[Any] = []
        self._transfers: dict[int, _Transfer] = {}  # shard index -> in-flight fetch
        self._storage: dict[int, FlatShard] = {}  # storage data_ptr -> resident shard
        self._traces: dict[tuple, list[int]] = {}
        self._mode: tuple = ()
        self._trace: Optional[list[int]] = None
        self._current: list[int] = []
        self._pos = 0
        self._diverged = False
        self._external: dict[nn.Module, list[FlatShard]] = {}
        self._cuda = self.device.type == "cuda"
        self.swap_stream = torch.cuda.Stream(self.device) if self._cuda else None  # host -> device
        self._held_no_grad: list[FlatShard] = []  # held by backward with no gradient to wait for (_unpack)
        self._stall_events: list[tuple[Any, Any]] = []
        self._transfer_events: list[tuple[Any, Any]] = []
        self._kept: list[tuple[Any, torch.Tensor]] = []  # pinned staging until its H2D copy ran
        self._fault: Optional[Callable[[FlatShard], None]] = None  # test seam: called per fetch
        for sh in partition.shards:
            if sh.run.kept_resident:
                self._start_fetch(sh)
                self._complete(sh)
                self.budget.fixed += sh.nbytes
        self._register_hooks()

    # ------------------------------------------------------------------------------- hooks
    def _register_hooks(self) -> None:
        root = self.model
        for module in self.model.modules():
            shards = self.partition.module_shards.get(module, [])
            if not shards and module is not root:
                continue
            self._handles.append(module.register_forward_pre_hook(self._make_pre(module, module is root)))
            self._handles.append(module.register_forward_hook(self._make_post(module), always_call=True))
        for sh in self.partition.shards:
            for sl in sh.slices:
                if sl.requires_grad:
                    self._handles.append(sl.param.register_hook(self._make_pre_grad_hook(sh, sl)))
                    self._handles.append(sl.param.register_post_accumulate_grad_hook(self._make_grad_hook(sh, sl)))

    def _make_pre_grad_hook(self, shard: FlatShard, sl: ParamSlice) -> Callable:
        # Gradient accumulation checks the parameter's shape. A shard whose backward does not need
        # its values (an embedding) is not resident then: give the parameter a shape-only stub
        # (one element, zero strides) for the accumulation instead of fetching it.
        def hook(grad: torch.Tensor) -> None:
            if shard.run.residency != ShardState.RESIDENT:
                sl.param.data = torch.empty(1, dtype=shard.dtype, device=self.device).expand(sl.shape)
            return None
        return hook

    def _make_pre(self, module: nn.Module, is_root: bool) -> Callable:
        def hook(mod: nn.Module, args: Any) -> None:
            if is_root and not self.in_backward:
                self.begin_iteration()
            self.fetch(mod)
        return hook

    def _make_post(self, module: nn.Module) -> Callable:
        def hook(mod: nn.Module, args: Any, output: Any) -> None:
            self.release(mod)
        return hook

    def _make_grad_hook(self, shard: FlatShard, sl: ParamSlice) -> Callable:
        def hook(param: torch.Tensor) -> None:
            run = shard.run
            grad = param.grad
            if grad is not None and self.on_grad is not None:
                self._collect(shard, sl, grad)
            else:
                run.grad_arrived(sl.offset, None, None)
            if grad is not None:
                param.grad = None
            if run.residency != ShardState.RESIDENT:
                param.data = placeholder(shard.dtype, self.device)
            if self.on_grad is not None and run.grad is not None and not run.grad_handed \
                    and not shard.shared and run.calls <= 1 and not run.grads_pending:
                self._grad_complete(shard)  # every slice is in and no later use can add to it
            if not run.grads_pending and run.held_by_backward:
                run.backward_let_go()
                self._maybe_evict(shard)
        return hook

    def remove_hooks(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()

    # ------------------------------------------------------------------------------- public API
    def shards_of(self, module: nn.Module) -> list[FlatShard]:
        return self.partition.module_shards.get(module, []) + self._external.get(module, [])

    def register_external_parameter(self, module: nn.Module, param: nn.Parameter) -> None:
        """Declares that ``module``'s forward uses ``param`` although another module owns it."""
        shard = self.partition.param_slice[id(param)][0]
        lst = self._external.setdefault(module, [])
        if shard not in lst:
            lst.append(shard)
            if module not in self.partition.module_shards:
                self._handles.append(module.register_forward_pre_hook(self._make_pre(module, False)))
                self._handles.append(module.register_forward_hook(self._make_post(module), always_call=True))

    def fetch(self, module: nn.Module) -> None:
        """Makes ``module``'s shards resident on the compute device (waits for them)."""
        shards = self.shards_of(module)
        if self.in_backward and shards:  # a recompute (activation checkpointing) entered this unit
            self._release_passed(shards[0])
        for sh in shards:
            if sh.owner is module and not self.in_backward:
                sh.run.called()
            self._use(sh)
            sh.run.use()
        for sh in shards:
            self._complete(sh)
            if sh.run.kept_resident:
                self._ready(sh)
            elif self.in_backward:
                self._hold_for_backward(sh)

    def release(self, module: nn.Module) -> None:
        """Ends ``module``'s use of its shards; a shard no call uses any more leaves the device."""
        for sh in self.shards_of(module):
            sh.run.unuse()
            self._maybe_evict(sh)

    @contextlib.contextmanager
    def gathered(self, params: Sequence[nn.Parameter]) -> Iterator[None]:
        """Within the block the given parameters are resident (for reading them outside forward)."""
        shards: list[FlatShard] = []
        for p in params:
            sh = self.partition.param_slice[id(p)][0]
            if sh not in shards:
                shards.append(sh)
        for sh in shards:
            sh.run.use()
            if sh.run.residency == ShardState.RELEASED:
                self._start_fetch(sh)
            self._complete(sh)
        try:
            yield
        finally:
            for sh in shards:
                sh.run.unuse()
                self._maybe_evict(sh)

    def saved_tensors_hooks(self) -> Any:
        """The pack/unpack hooks to run a forward under (the engine's ``__call__`` does)."""
        return torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)

    def begin_iteration(self) -> None:
        """Starts a new forward(+backward): keeps the last iteration's order as the trace of its mode."""
        if self._current:
            self._traces[self._mode] = self._current
        self._drop_unused_prefetches()
        for sh in self.partition.shards:
            sh.run.new_forward()
        self._mode = (self.model.training, torch.is_grad_enabled())
        self._trace = self._traces.get(self._mode)
        self._current = []
        self._pos = 0
        self._diverged = False
        self._prefetch_ahead()

    def end_backward(self) -> None:
        """After ``loss.backward()``: hands off the gradients of units still open (tied, shared or
        called several times), releases what backward still holds."""
        for sh in self.partition.shards:
            if sh.run.grad is not None and not sh.run.grad_handed:
                self._grad_complete(sh)
        self._held_no_grad.clear()
        for sh in self.partition.shards:
            sh.run.end_backward()
            sh.run.backward_let_go()
            self._maybe_evict(sh)

    def abandon_grads(self) -> None:
        """A backward failed: drops the gradients collected so far (nothing is handed off), and any
        parameter gradient autograd left behind (the next backward would add to it)."""
        for sh in self.partition.shards:
            sh.run.drop_grad()
            for sl in sh.slices:
                sl.param.grad = None

    def release_all(self) -> None:
        """Releases every non-persistent shard (after the optimizer changed the homes)."""
        self._held_no_grad.clear()
        for sh in self.partition.shards:
            sh.run.forget_uses()
            if not sh.run.kept_resident and sh.run.residency != ShardState.RELEASED:
                if sh.run.residency == ShardState.INFLIGHT:
                    try:
                        self._complete(sh)
                    except (OSError, ValueError) as exc:  # its data is being dropped anyway
                        log.warning("shard %d: dropping a failed fetch: %s", sh.index, exc)
                        continue
                self._evict(sh)

    def give_up_resident(self, sh: FlatShard) -> int:
        """A unit kept on the device between steps leaves it: from now on it is fetched from its
        home before each use (which must hold its current values). Returns the device bytes freed."""
        if not sh.run.kept_resident or sh.home.tier == Tier.GPU:
            return 0
        sh.run.stop_keeping_resident()
        self.budget.fixed -= sh.nbytes
        if sh.run.residency != ShardState.RELEASED and sh.run.idle:
            self._evict(sh, count=False)
        return sh.nbytes

    def refresh_persistent(self) -> None:
        """Re-reads persistent shards from their homes (the optimizer wrote new values there)."""
        for sh in self.partition.shards:
            if sh.run.kept_resident:
                self._evict(sh, count=False)
                self._start_fetch(sh)
                self._complete(sh)

    def overlap(self) -> Optional[OverlapSample]:
        """Transfer time and compute stall since the last call, from CUDA event timestamps
        (None on the CPU: the engine derives it from I/O busy time and host wait time)."""
        if not self._cuda:
            return None
        s = OverlapSample()
        for a, b in self._transfer_events:
            b.synchronize()
            s.transfer_s += a.elapsed_time(b) / 1e3
        for a, b in self._stall_events:
            b.synchronize()
            s.stalled_s += a.elapsed_time(b) / 1e3
        self._transfer_events.clear()
        self._stall_events.clear()
        return s

    def close(self) -> None:
        self.remove_hooks()
        self.release_all()

    # ------------------------------------------------------------------------------- internals
    def _use(self, sh: FlatShard) -> None:
        """A shard goes from idle to in use: trace bookkeeping, then make sure a fetch runs."""
        if sh.run.kept_resident or not sh.run.idle:
            return
        if len(self._current) < MAX_TRACE:
            self._current.append(sh.index)
        if self._trace is not None and not self._diverged:
            if self._pos < len(self._trace) and self._trace[self._pos] == sh.index:
                self._pos += 1
            else:
                self._diverged = True
                self.stats.divergences += 1
                log.debug("module order diverged from the trace at entry %d (shard %s); "
                          "fetching on demand and re-recording", self._pos, sh.module_name)
                self._drop_unused_prefetches(keep=sh)
        if sh.run.prefetched:
            self.stats.prefetch_hits += 1
            sh.run.prefetch_ended()
        elif sh.run.residency == ShardState.RELEASED:
            self.stats.on_demand += 1
            self._start_fetch(sh, demand=True)
        self._prefetch_ahead()

    def _prefetch_ahead(self) -> None:
        if not self.prefetch_enabled or self._trace is None or self._diverged:
            return
        shards = self.partition.shards
        room = self.prefetch_bytes - sum(s.nbytes for s in shards if s.run.prefetched)
        live = sum(s.numel for s in shards if s.run.residency != ShardState.RELEASED)
        reads = sum(1 for s in shards if s.run.residency == ShardState.INFLIGHT and s.home.tier == Tier.NVME)
        for idx in self._trace[self._pos:self._pos + LOOKAHEAD_ENTRIES]:
            sh = shards[idx]
            if sh.run.residency != ShardState.RELEASED:
                continue
            if sh.run.home_stale:
                break  # the optimizer has not written its new values yet: its use will wait for them
            if sh.nbytes > room or not self.budget.fits(sh.nbytes):
                self.prefetch_starved |= sh.nbytes > self.prefetch_bytes
                break
            if self.max_live_elements is not None and live + sh.numel > self.max_live_elements:
                break
            nvme = sh.home.tier == Tier.NVME
            if nvme and self.max_inflight_reads is not None and reads >= self.max_inflight_reads:
                break
            self._start_fetch(sh)
            sh.run.prefetch_issued()
            room -= sh.nbytes
            live += sh.numel
            reads += nvme
            self.stats.prefetch_issued += 1
        self.prefetch_high = max(self.prefetch_high, self.prefetch_bytes - room)
        self._advance_transfers()

    def _drop_unused_prefetches(self, keep: Optional[FlatShard] = None) -> None:
        for sh in self.partition.shards:
            if sh.run.prefetched and sh is not keep and sh.run.idle:
                sh.run.prefetch_ended()
                self.stats.prefetch_wasted += 1
                if sh.run.residency == ShardState.INFLIGHT:
                    self._complete(sh)
                self._evict(sh)

    def _make_room(self, nbytes: int, for_shard: FlatShard) -> None:
        if self.budget.fits(nbytes):
            return
        for sh in reversed(self.partition.shards):  # drop prefetches the trace needs latest
            if sh.run.prefetched and sh.run.idle:
                sh.run.prefetch_ended()
                self.stats.prefetch_wasted += 1
                if sh.run.residency == ShardState.INFLIGHT:
                    self._complete(sh)
                self._evict(sh)
                if self.budget.fits(nbytes):
                    return
        if self.budget.resident + nbytes <= self.budget.capacity:
            return  # shards fit; whether activations leave room is the allocator's to say (OOM)
        held = [s for s in self.partition.shards if s.run.residency != ShardState.RELEASED and not s.run.kept_resident]
        raise DeviceBudgetError(
            f"device_memory: {self.budget.capacity} bytes cannot hold shard {for_shard.module_name!r} "
            f"({nbytes} bytes) on top of {self.budget.resident} bytes resident "
            f"({self.budget.fixed} persistent/buffers, {len(held)} shards in use: "
            f"{', '.join(s.module_name or '<root>' for s in held[:8])}); raise pyinfinity.device_memory "
            "or lower stage3_param_persistence_threshold")

    def _start_fetch(self, sh: FlatShard, demand: bool = False) -> None:
        """Allocates the device buffer and starts the copy from the shard's home."""
        if sh.run.residency != ShardState.RELEASED:
            return
        if sh.run.home_stale and self.wait_home is not None:  # the step has not written the new values yet
            self.stats.step_wait_seconds += self.wait_home(sh)
        self._make_room(sh.nbytes, sh)
        if self._fault is not None:
            self._fault(sh)
        self.budget.add(sh.nbytes)
        self.stats.fetched_bytes += sh.nbytes
        tr = _Transfer()
        home = sh.home
        if sh.run.home_stale and self.master_values is not None:
            # the home holds the last backward's gradient and no step has consumed it yet (a forward
            # between backward() and step()): the weights come from the optimizer's master copy
            buf = torch.empty(sh.numel, dtype=sh.dtype, device=self.device)
            self.master_values(sh, buf)
            tr.copied = True
        elif home.tier == Tier.GPU:
            buf = home.tensor
            tr.copied = True
        elif not self._cuda:
            buf = aligned_empty(sh.numel, sh.dtype)
            tr.io = self.swapper.read(home, buf)
            tr.copied = True
        else:
            with torch.cuda.stream(self.swap_stream):
                buf = torch.empty(sh.numel, dtype=sh.dtype, device=self.device)
            if home.tier == Tier.CPU:
                self._h2d(tr, buf, home.tensor)
            else:  # nvme -> pinned staging now, H2D when the read is done
                tr.staging = aligned_empty(sh.numel, sh.dtype, pin=True)
                tr.io = self.swapper.read(home, tr.staging)
        self._transfers[sh.index] = tr
        sh.run.fetching(buf)

    def _h2d(self, tr: _Transfer, dst: torch.Tensor, src: torch.Tensor) -> None:
        """Host -> device on the swap stream, bracketed by events (no host synchronisation)."""
        tr.start = torch.cuda.Event(enable_timing=True)
        tr.end = torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(self.swap_stream):
            tr.start.record()
            dst.copy_(src, non_blocking=True)
            tr.end.record()
        self._transfer_events.append((tr.start, tr.end))
        if len(self._transfer_events) > MAX_EVENT_PAIRS:
            del self._transfer_events[:MAX_EVENT_PAIRS // 2]
        tr.copied = True

    def _advance_transfers(self) -> None:
        """Starts the H2D copy of every NVMe read that has finished (GPU only, never blocks)."""
        if not self._cuda:
            return
        for idx, tr in self._transfers.items():
            if not tr.copied and tr.io is not None and tr.io.done():
                tr.io.wait()
                self._h2d(tr, self.partition.shards[idx].run.buffer, tr.staging)

    def _ready(self, sh: FlatShard) -> None:
        """A resident unit about to be used: its new values (the last step's) must be in place."""
        if sh.run.home_stale and self.wait_home is not None:
            self.stats.step_wait_seconds += self.wait_home(sh)
        ev = sh.run.take_ready()
        if ev is not None:
            if self._cuda:
                torch.cuda.current_stream(self.device).wait_event(ev)

    def _complete(self, sh: FlatShard) -> None:
        """Waits until the shard's buffer holds its data and points the parameters into it."""
        run = sh.run
        if run.residency == ShardState.RESIDENT:
            return
        if run.residency == ShardState.RELEASED:
            self._start_fetch(sh, demand=True)
        tr = self._transfers.pop(sh.index)
        t0 = time.perf_counter()
        try:
            if tr.io is not None:
                tr.io.wait()
            if not tr.copied:
                self._h2d(tr, run.buffer, tr.staging)
        except BaseException:
            # the read failed: give the buffer back so the engine stays usable (e.g. to load a
            # checkpoint), then let the caller see the error
            run.arrived()
            self._evict(sh, count=False)
            raise
        self.stats.fetch_wait_seconds += time.perf_counter() - t0
        if self._cuda and tr.end is not None:
            cur = torch.cuda.current_stream(self.device)
            a = torch.cuda.Event(enable_timing=True)
            b = torch.cuda.Event(enable_timing=True)
            a.record(cur)
            cur.wait_event(tr.end)
            b.record(cur)
            self._stall_events.append((a, b))
            if len(self._stall_events) > MAX_EVENT_PAIRS:
                del self._stall_events[:MAX_EVENT_PAIRS // 2]
            run.buffer.record_stream(cur)
            if tr.staging is not None:  # keep the pinned staging alive until the copy ran
                self._kept = [(e, t) for e, t in self._kept if not e.query()]
                self._kept.append((tr.end, tr.staging))
        buf = run.buffer
        for sl in sh.slices:
            sl.param.data = buf[sl.offset:sl.offset + sl.numel].view(sl.shape)
        self._storage[buf.untyped_storage().data_ptr()] = sh
        run.arrived()

    def _maybe_evict(self, sh: FlatShard) -> None:
        run = sh.run
        if not run.kept_resident and run.idle and not run.prefetched and run.residency != ShardState.RELEASED:
            if run.residency == ShardState.INFLIGHT:
                self._complete(sh)
            self._evict(sh)

    def _evict(self, sh: FlatShard, count: bool = True) -> None:
        if sh.run.residency == ShardState.RELEASED:
            return
        if sh.run.residency == ShardState.INFLIGHT:
            self._complete(sh)
        buf = sh.run.released()
        self._storage.pop(buf.untyped_storage().data_ptr(), None)
        for sl in sh.slices:
            sl.param.data = placeholder(sh.dtype, self.device)
        self.budget.sub(sh.nbytes)
        if count:
            self.stats.releases += 1

    # saved-tensor hooks ------------------------------------------------------------------
    def _pack(self, t: torch.Tensor) -> Any:
        if not self._storage or t.device != self.device:
            return t
        try:
            sh = self._storage.get(t.untyped_storage().data_ptr())
        except (RuntimeError, NotImplementedError):
            return t
        if sh is None or t.dtype != sh.dtype or sh.run.kept_resident:
            return t
        # offset relative to the buffer: a later fetch may put the shard at another storage offset
        return _ShardRef(sh, t.storage_offset() - sh.run.buffer.storage_offset(), tuple(t.shape), tuple(t.stride()))

    def _unpack(self, x: Any) -> torch.Tensor:
        if not isinstance(x, _ShardRef):
            return x
        sh = x.shard
        self._release_passed(sh)
        self._use(sh)
        if sh.run.grads_pending:
            sh.run.hold_for_backward()
        self._complete(sh)
        if sh.run.users == 0:
            self._hold_for_backward(sh)
        buf = sh.run.buffer
        return buf.as_strided(x.size, x.stride, buf.storage_offset() + x.offset)

    def _hold_for_backward(self, sh: FlatShard) -> None:
        """Backward uses ``sh`` (a saved tensor unpacked, or a recompute under activation
        checkpointing fetched its unit): it stays on the device until its gradients are in, or, with
        none to wait for (a frozen shard, or its gradients are in), until backward moves on to
        another unit (_release_passed). A recompute saves some parameters as the Parameter objects
        themselves (``weight * x`` in a norm): releasing the unit between the recompute's modules
        would leave those pointing at an empty placeholder, and fetch the unit once per module."""
        if sh.run.held_by_backward:
            return
        sh.run.hold_for_backward()
        if not sh.run.grads_pending:
            self._held_no_grad.append(sh)

    def _release_passed(self, cur: FlatShard) -> None:
        """Backward reached ``cur``'s unit: the shards held without a gradient to wait for (frozen
        weights) of the units it has left are released, so a frozen base streams through backward
        as through forward instead of piling up on the device. One needed again is fetched again."""
        if not self._held_no_grad:
            return
        keep = []
        for sh in self._held_no_grad:
            if sh is cur or sh.owner is cur.owner:
                keep.append(sh)
            elif sh.run.held_by_backward:
                sh.run.backward_let_go()
                self._maybe_evict(sh)
        self._held_no_grad = keep

    # gradients ---------------------------------------------------------------------------
    def _collect(self, shard: FlatShard, sl: ParamSlice, grad: torch.Tensor) -> None:
        """Sums one parameter's gradient into its unit's flat device gradient (zeros first)."""
        shard.run.grad_arrived(sl.offset, grad.reshape(-1), self.device)

    def _grad_complete(self, shard: FlatShard) -> None:
        """A unit's gradient is final for this backward: its norm on the device, one copy of the
        flat gradient to its host destination, then ``on_grad``."""
        run = shard.run
        self.grads_handed += 1
        g = run.take_grad()
        if run.steps_on_device:  # its optimizer state is on the device: the gradient stays, stepped there in order
            self.on_grad(shard, g, None, torch.linalg.vector_norm(g, 2, dtype=torch.float32))
            return
        used = None
        if self._cuda:
            used = torch.cuda.Event()
            used.record(torch.cuda.current_stream(self.device))  # the unit's backward is enqueued: its resident
            run.backward_enqueued(used)  # copy may be rewritten after this
        if run.accumulates_on_device:  # added into its accumulator there (its sum's norm is taken there too)
            self.on_grad(shard, g, None, None)
            return
        norm = torch.linalg.vector_norm(g, 2, dtype=torch.float32)
        self.stats.grad_bytes += shard.nbytes
        dest, is_home = self.grad_dest(shard)
        if is_home:
            run.home_awaits_step()  # its weights are overwritten until the step writes the new ones
        if not self._cuda:
            dest.copy_(g)
            self.on_grad(shard, dest, None, norm)
            return
        d2h = self.copies.d2h_stream
        d2h.wait_event(used)
        with torch.cuda.stream(d2h):
            dest.copy_(g, non_blocking=True)
            ev = torch.cuda.Event()
            ev.record()
        g.record_stream(d2h)  # allocated on the compute stream, read on the copy stream
        self.on_grad(shard, dest, ev, norm)


class DeviceCopies:
    """The copies between the compute device and the host that run beside the compute stream:
    gradients and device accumulators' sums to the host (``d2h_stream``), a resident unit's new
    values to its device buffer (``update_stream``). Built before the coordinator, the parameter
    homes and the optimizer, which all use it. ``stats``: where the bytes moved to the host are
    counted (the coordinator's ``FetchStats``)."""

    def __init__(self, device: torch.device, stats: FetchStats) -> None:
        self.device = torch.device(device)
        self.stats = stats
        self._cuda = self.device.type == "cuda"
        self.d2h_stream = torch.cuda.Stream(self.device) if self._cuda else None  # gradients off the device
        self.update_stream = torch.cuda.Stream(self.device) if self._cuda else None  # new values of resident units

    def copy_to_host(self, src: torch.Tensor, dst: torch.Tensor) -> Any:
        """Copies a device tensor into a (pinned) host tensor on the gradient stream, after the work
        queued on the current stream; returns the copy's CUDA event (None on the CPU device: done).
        ``src`` must not be written before the event (the optimizer's device accumulators wait)."""
        self.stats.grad_bytes += dst.numel() * dst.element_size()
        if not self._cuda:
            dst.copy_(src)
            return None
        self.d2h_stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.d2h_stream):
            dst.copy_(src, non_blocking=True)
            ev = torch.cuda.Event()
            ev.record()
        src.record_stream(self.d2h_stream)  # read there: freed memory is not reused before the copy ran
        return ev

    def update_resident(self, shard: FlatShard, src: torch.Tensor) -> Any:
        """Copies a resident unit's new values (``src``: host, compute dtype) into its device buffer
        once its backward is done; the next use waits for the copy (``ShardRun.ready``). Returns
        the copy's event (None: nothing queued). Called from the optimizer, possibly on its worker
        thread."""
        buf = shard.run.buffer
        if buf is None or buf is src:
            return None
        if not self._cuda:
            buf.copy_(src)
            return None
        done = shard.run.backward_done
        with torch.cuda.stream(self.update_stream):
            if done is not None:
                self.update_stream.wait_event(done)
            buf.copy_(src, non_blocking=src.is_pinned())
            ev = torch.cuda.Event()
            ev.record()
        shard.run.update_queued(ev)
        return ev
