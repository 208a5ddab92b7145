"""What of the training state stays on the compute device between steps, and the guards that keep
it within ``pyinfinity.device_memory``.

Resident units, the optimizer state of some of them and, under gradient accumulation, the fp32
gradient accumulators of units stepped on the CPU are placed once, at construction, where the
layout says (``layout.shards.device_units``, the rule the planner evaluates). Three guards
back the planner's estimate of a step's charges (``layout.charges.DeviceCharges``): the first
training forward refuses a micro-batch x sequence that cannot fit even with nothing resident;
after each step a measured peak past ``SHRINK_AT`` of the budget gives up prefetch, device
optimizer state, device accumulators and resident units until the charges are back under the
planner's target; an out-of-memory error in forward or backward gives all of it up. The other
way, a peak that left room under that target lets a planned prefetch grow into it (the
planner's activation estimate errs high: the measured peak is what a step held).
"""
from __future__ import annotations

import logging
from typing import Any, Callable, Iterable, Iterator, Optional

import torch

from pyinfinity.config import format_size
from pyinfinity.host_memory import HOST_SPARE, mem_available
from pyinfinity.layout.charges import DEVICE_HEADROOM, PlanError, TrainShape, grad_buffer_bytes, shape_refusal
from pyinfinity.swap.tensor_swapper import Tier
from pyinfinity.zero.budget import DeviceBudgetExceeded
from pyinfinity.zero.coordinator import ParameterCoordinator
from pyinfinity.zero.homes import ParamHomes
from pyinfinity.zero.optimizer import OffloadOptimizer
from pyinfinity.zero.partition import FlatShard, Partition

log = logging.getLogger(__name__)

# a step whose measured device peak passes this share of the budget gives up part of the placement
# (prefetch, device optimizer state, device accumulators, resident units) until the charges are back under the
# planner's target (1 - DEVICE_HEADROOM of the budget)
SHRINK_AT = 0.95
# a planned prefetch grows into the room a step's measured peak left under the planner's target, up
# to this many of the largest offloaded unit or decoder block on a GPU (2 on the CPU device: the
# planner's own caps), in steps of at least PREFETCH_GROW_MIN bytes (a quarter unit when smaller)
PREFETCH_GROW_UNITS = 4
PREFETCH_GROW_MIN = 32 << 20


class DevicePlacement:
    """The resident units, the device optimizer state and the device gradient accumulators of one
    training state, and giving them up.

    ``drain(what)`` waits until the optimizer's worker has written every new value home (the
    training state's own, which marks the state partly stepped when that fails): the homes must
    hold the current values before a unit or its state leaves the device."""

    def __init__(self, partition: Partition, optimizer: OffloadOptimizer, homes: ParamHomes, device: torch.device,
                 device_memory: Optional[int], *, accumulation: int, drain: Callable[[str], None],
                 plan_sizes: Any = None,
                 checkpointing: bool = False, grow_prefetch: bool = False, grow_live: bool = False) -> None:
        self.partition = partition
        self.optimizer = optimizer
        self.homes = homes
        self.device = device
        self.device_memory = device_memory
        self.accumulation = accumulation
        self.coordinator: Optional[ParameterCoordinator] = None  # set by watch()
        self._drain = drain
        # for the shape check at the first forward: the planner's sizes, or the model's own
        self.plan_sizes = plan_sizes
        self.checkpointing = checkpointing
        self.shape_checked = False
        self.resident_units: list[FlatShard] = []  # what a budget overflow may give up, in unit order
        self.resident_bytes = 0
        self.device_state_bytes = 0
        self.device_grad_bytes = 0  # the fp32 gradient accumulators on the device
        self.gave_up: list[str] = []  # what budget overflows took from the placement, in order
        self.grad_buffers = 0
        # the planner sized prefetch (and the live-parameter cap) from its estimate of the step's
        # charges: a measured peak with room under the budget's target lets them grow (_grow_prefetch)
        self.grow_prefetch, self.grow_live = grow_prefetch, grow_live
        self.prefetch_grown = 0

    # ------------------------------------------------------------------------- placing
    def keep_resident(self, units: Iterable[int]) -> None:
        """Marks the units the layout keeps on the compute device between steps
        (``layout.shards.device_units``: every unit when the parameters' home is the device)."""
        shards = [self.partition.shards[i] for i in units]
        for sh in shards:
            sh.run.keep_resident()
        # what a budget overflow may give up (not the units whose home is the device)
        self.resident_units = sorted((sh for sh in shards if sh.home.tier != Tier.GPU), key=lambda sh: sh.index)
        self.resident_bytes = sum(sh.nbytes for sh in self.partition.shards if sh.persistent)

    def place_device_states(self, units: Iterable[int]) -> None:
        """Moves the optimizer state of the resident units the layout names to the device: they
        step there."""
        self.device_state_bytes = 0
        numel = 0
        units = list(units)
        for i in units:
            sh = self.partition.shards[i]
            self.device_state_bytes += self.optimizer.to_device(sh, self.device)
            numel += sh.numel
        if units:
            log.info("optimizer state of %d resident units (%s parameters, %s) on %s: they step there", len(units),
                     f"{numel:,}", format_size(self.device_state_bytes), self.device)

    def place_device_accumulators(self, units: Iterable[int]) -> None:
        """Under gradient accumulation, moves the fp32 gradient accumulators of the units the layout
        names to the device: their micro-batch gradients are added there."""
        self.device_grad_bytes = 0
        numel = 0
        units = list(units)
        for i in units:
            sh = self.partition.shards[i]
            self.device_grad_bytes += self.optimizer.accumulate_on_device(sh, self.device)
            numel += sh.numel
        self.optimizer.reserve_landing()  # the pinned buffers their sums land in, shared (layout.pools.landing_ring)
        if units:
            log.info("gradient accumulators of %d units (%s parameters, %s) on %s: their micro-batch gradients are "
                     "added there", len(units), f"{numel:,}", format_size(self.device_grad_bytes), self.device)

    def watch(self, coordinator: ParameterCoordinator) -> None:
        """Starts watching ``coordinator``'s device budget: the prefetch reserve (the planner's charges
        for gradient buffers and headroom) and the step's peak; warns of a set prefetch bucket or
        live-parameter cap that no unit can be fetched ahead within."""
        self.coordinator = coordinator
        trainable = [sh for sh in self.partition.shards if sh.trainable]
        params = [sl.numel * sh.dtype.itemsize for sh in trainable for sl in sh.slices if sl.requires_grad]
        self.grad_buffers = grad_buffer_bytes(max((sh.nbytes for sh in trainable), default=0), max(params, default=0))
        if self.device_memory:
            headroom = int(self.device_memory * DEVICE_HEADROOM)
            coordinator.budget.reserve = headroom + (self.grad_buffers if self.device.type == "cuda" else 0)
        coordinator.budget.reset_step_peak()
        self._warn_small_prefetch()

    # ------------------------------------------------------------------------- the guards
    def check_shape(self, args: tuple, kwargs: dict) -> None:
        """At the first training forward, when the micro-batch x sequence is known: refuses a shape
        that cannot fit the device budget even with nothing resident (PlanError, one line naming the
        largest that fits)."""
        self.shape_checked = True
        t = kwargs.get("input_ids")
        if t is None:
            t = next((a for a in args if isinstance(a, torch.Tensor)), None)
        if not isinstance(t, torch.Tensor) or t.dim() != 2 or self.device_memory is None:
            return
        sizes = self.plan_sizes
        if sizes is None or not sizes.hidden:
            return  # the activation estimate is for transformers' decoders; the allocator has the last word
        train = TrainShape(micro_batch=int(t.shape[0]), seq_len=int(t.shape[1]),
                           grad_accum=self.accumulation, checkpointing=self.checkpointing)
        if self.device.type != "cuda":
            return  # the CPU device's pool holds shards only: the coordinator checks each fetch
        small = sum(sh.nbytes for sh in self.partition.shards if sh.persistent) - self.resident_bytes
        why = shape_refusal(sizes, train, self.device_memory, persistent=max(0, small))
        if why is not None:
            raise PlanError(why)

    def after_step(self) -> None:
        """After each optimizer step: the measured device peak (torch's allocator on a GPU, since
        the last shrink; the engine's own count of the step on the CPU device); past SHRINK_AT of
        the budget, the placement gives up what the peak exceeds the planner's target by (a unit
        given up is fetched again when used, so the next step may give up more), with a warning
        the first time."""
        cap = self.device_memory
        coord = self._coordinator()
        budget = coord.budget
        cuda = self.device.type == "cuda"
        if cuda:  # torch's peak since the last shrink (reset only then: tools read it at the end of a run)
            peak, reserved = budget.allocator_peaks()
        else:
            peak, reserved = budget.step_peak, budget.step_peak
        budget.reset_step_peak()
        if not cap or peak <= SHRINK_AT * cap:
            self._grow_prefetch(peak)
            coord.prefetch_high, coord.prefetch_starved = 0, False
            return
        gave = self.give_up(peak - int((1 - DEVICE_HEADROOM) * cap))
        coord.prefetch_high, coord.prefetch_starved = 0, False
        if gave and cuda:
            torch.cuda.reset_peak_memory_stats(self.device)
        if gave:  # a warning the first time; the steps after it may give up a little more (INFO)
            first = len(self.gave_up) == len(gave)
            log.log(logging.WARNING if first else logging.INFO,
                    "device budget: the step's peak was %s of %s (allocator reserved %s): gave up %s%s",
                    format_size(peak), format_size(cap), format_size(reserved), "; ".join(gave),
                    "" if first else f" (in all: {'; '.join(self.gave_up)})")

    def _largest_unit(self) -> Optional[FlatShard]:
        """The largest shard the coordinator fetches (none persistent or resident)."""
        return max((sh for sh in self.partition.shards if not sh.persistent), key=lambda sh: sh.nbytes, default=None)

    def _warn_small_prefetch(self) -> None:
        """A prefetch bucket or live-parameter cap the config set (not the plan: those grow) below
        what fetching one unit ahead needs (the largest unit; beside it, the one in use) is kept,
        as given, with a warning: DeepSpeed's defaults (5e7 bytes, 1e9 elements) stop every
        prefetch of a 30B model's decoder layers."""
        coord = self.coordinator
        big = self._largest_unit()
        if not coord.prefetch_enabled or big is None or sum(not sh.persistent for sh in self.partition.shards) < 2:
            return
        too_small = []
        if not self.grow_prefetch and coord.prefetch_bytes < big.nbytes:
            too_small.append(f"stage3_prefetch_bucket_size {coord.prefetch_bytes:,} bytes is below the largest "
                             f"unit's {big.nbytes:,}")
        if not self.grow_live and coord.max_live_elements is not None and coord.max_live_elements < 2 * big.numel:
            too_small.append(f"stage3_max_live_parameters {coord.max_live_elements:,} is below two of the largest "
                             f"unit ({2 * big.numel:,} elements)")
        if too_small:
            log.warning("%s (%s): that unit is never fetched ahead, and its copy waits in every step; set the "
                        "key to \"auto\" for the planner's value", "; ".join(too_small), big.module_name)

    def _grow_prefetch(self, peak: int) -> None:
        """After a step whose measured device peak left room under the planner's target (1 -
        DEVICE_HEADROOM of the budget) and fetched ahead, or met a unit larger than the whole
        bucket (a bucket planned below one decoder layer fetches nothing ahead): a planned prefetch
        grows by that room, less the part of the current prefetch the step did not use, up to the
        planner's own cap (PREFETCH_GROW_UNITS of the largest offloaded unit or block); a planned
        live-parameter cap grows alike. The planner's activation estimate is conservative; the peak is what the step
        held. Not once the placement gave something up (the two would take turns)."""
        coord = self._coordinator()
        if not (self.grow_prefetch and coord.prefetch_enabled and self.device_memory) or self.gave_up:
            return
        if coord.prefetch_high == 0 and not coord.prefetch_starved:
            return  # nothing was fetched ahead (a first step has no trace yet) and no unit outgrew the bucket
        big = self._largest_unit()
        unit = big.nbytes if big is not None else 0
        sizes = self.plan_sizes
        block = max(unit, sizes.block_bytes if sizes is not None else 0)  # the planner's cap is of the larger
        limit = (PREFETCH_GROW_UNITS if self.device.type == "cuda" else 2) * block
        unused = max(0, coord.prefetch_bytes - coord.prefetch_high)
        room = int((1 - DEVICE_HEADROOM) * self.device_memory) - peak - unused
        add = min(room, limit - coord.prefetch_bytes)
        if add < min(PREFETCH_GROW_MIN, unit // 4) or add <= 0:
            return
        before = coord.prefetch_bytes
        coord.prefetch_bytes += add
        if coord.max_live_elements is not None and self.grow_live:  # planned from the prefetch: grows alike
            itemsize = min((sh.dtype.itemsize for sh in self.partition.shards if not sh.persistent), default=1)
            coord.max_live_elements += add // itemsize
        self.prefetch_grown += add
        log.info("device budget: the step's peak was %s of %s: prefetch %s -> %s", format_size(peak),
                 format_size(self.device_memory), format_size(before), format_size(coord.prefetch_bytes))

    def budget_exceeded(self, where: str, oom: str) -> DeviceBudgetExceeded:
        """After an out-of-memory error in forward or backward with no unit stepped: the step's
        buffers freed, the placement moved to the host homes. The error to raise."""
        coord = self._coordinator()
        coord.release_all()
        if where == "backward":  # this micro-batch's gradients are dropped (a home holding one was restored)
            for st in self.optimizer.states:
                if not st.busy:
                    st.src = st.event = st.norm = None
        gave = self.give_up_all()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        what = "; ".join(gave) or "nothing was left to give up"
        msg = (f"{where} ran out of device memory ({oom}) within pyinfinity.device_memory "
               f"{format_size(self.device_memory) if self.device_memory else 'none'}, before any unit was stepped; "
               f"gave up: {what}. The micro-batch may be run again")
        log.warning("%s", msg)
        return DeviceBudgetExceeded(msg, what)

    # ------------------------------------------------------------------------- giving up
    def give_up(self, need: int, prefetch: bool = True) -> list[str]:
        """Frees at least ``need`` device bytes of the placement if it can: the prefetch it used
        (with ``prefetch``), then the optimizer state on the device (from the back: the units
        stepped there last), then the gradient accumulators on the device (from the back), then
        resident units (from the front: backward needs the back first).
        Returns what was given up."""
        gave: list[str] = []
        coord = self._coordinator()
        used = min(coord.prefetch_high, coord.prefetch_bytes)  # what prefetch held at most in the last step
        if prefetch and need > 0 and used > 0:
            before = coord.prefetch_bytes
            coord.prefetch_bytes = max(0, used - need)
            coord.prefetch_enabled = coord.prefetch_enabled and coord.prefetch_bytes > 0
            need -= used - coord.prefetch_bytes
            gave.append(f"prefetch {format_size(before)} -> {format_size(coord.prefetch_bytes)}")
        if need > 0 and (self.device_state_bytes or self.device_grad_bytes or self.resident_units):
            self._drain("giving up device memory")  # the homes must hold the current values
        back = list(reversed(self.partition.shards))  # small persistent shards may step there too
        need = self._release((sh for sh in back if sh.device_step), need, self._state_to_host, gave,
                             "the optimizer state of {units} units ({size}) back to the host")
        need = self._release(self._accumulators_the_host_holds(back, need, gave), need, self._accumulator_to_host,
                             gave, "the gradient accumulators of {units} units ({size}) to the host (as much host "
                             "RAM, beyond the plan's landing ring)")
        if need > 0 and self.resident_units and all(sh.persistent for sh in self.partition.shards):
            # nothing was fetched in the last step: from now on a working set is (the unit in use and the next)
            need += 2 * max(sh.nbytes for sh in self.partition.shards)
        self._release(list(self.resident_units), need, self._resident_to_home, gave,
                      "{units} resident units ({size}) back to their homes")
        self.gave_up += gave
        return gave

    @staticmethod
    def _accumulators_the_host_holds(shards: list[FlatShard], need: int, gave: list[str]) -> Iterator[FlatShard]:
        """The units of ``shards`` with a device accumulator, in order, as long as the host RAM
        available now (``host_memory.mem_available``, less HOST_SPARE) holds a host accumulator
        of each (4 bytes a parameter, which no plan charged): a unit that would not fit ends them,
        with a line in ``gave`` saying so (the resident units go back instead)."""
        if need <= 0:
            return
        room = mem_available() - HOST_SPARE
        for sh in shards:
            if not sh.grad_on_device:
                continue
            n = sh.numel * 4
            if n > room:
                gave.append(f"not the gradient accumulators from unit {sh.module_name or '<root>'} on: the host has "
                            f"{format_size(max(0, room + HOST_SPARE))} available, short of {format_size(n)} for the "
                            "first")
                return
            room -= n
            yield sh

    @staticmethod
    def _release(shards: Iterable[FlatShard], need: int, release: Callable[[FlatShard], tuple[int, int]],
                 gave: list[str], what: str) -> int:
        """Calls ``release(sh)`` on ``shards`` in order until ``need`` device bytes are freed;
        ``release`` returns the bytes of what it moved and any other device bytes freed with it.
        Appends ``what`` (with the units and the bytes moved) to ``gave`` when it moved any; returns
        what is still needed."""
        units = freed = 0
        for sh in shards:
            if need <= 0:
                break
            n, also = release(sh)
            need -= n + also
            freed += n
            units += 1
        if units:
            gave.append(what.format(units=units, size=format_size(freed)))
        return need

    def give_up_all(self) -> list[str]:
        """Every resident unit, all device optimizer state and every device accumulator back to the
        host (an out-of-memory error)."""
        return self.give_up(1 << 62, prefetch=False)

    def _state_to_host(self, sh: FlatShard) -> tuple[int, int]:
        """Moves one shard's optimizer state from the device to its host home (it is stepped on
        the CPU from now on); returns the device bytes freed (and 0: nothing else)."""
        n = self._unfix(self.optimizer.to_host(sh, self.homes.write_home))
        self.device_state_bytes -= n
        return n, 0

    def _accumulator_to_host(self, sh: FlatShard) -> tuple[int, int]:
        """Moves one unit's gradient accumulator from the device to the host (the window's sum so
        far with it, into a host accumulator of its own); returns the device bytes freed (and 0:
        nothing else)."""
        n = self._unfix(self.optimizer.accumulator_to_host(sh))
        self.device_grad_bytes -= n
        return n, 0

    def _resident_to_home(self, sh: FlatShard) -> tuple[int, int]:
        """Gives up one resident unit (its optimizer state first, when it steps on the device): it
        is fetched again when used. Returns the unit's device bytes and its state's."""
        state = self._state_to_host(sh)[0] if sh.device_step else 0
        n = self._coordinator().give_up_resident(sh)
        self.resident_units.remove(sh)
        self.resident_bytes -= n
        return n, state

    def _unfix(self, n: int) -> int:
        """``n`` device bytes of the placement freed: no longer charged to the coordinator's budget."""
        budget = self._coordinator().budget
        budget.sub(n)
        budget.fixed -= n
        return n

    def _coordinator(self) -> ParameterCoordinator:
        if self.coordinator is None:
            raise RuntimeError("DevicePlacement: watch(coordinator) was not called")
        return self.coordinator
