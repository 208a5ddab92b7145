"""The placement solver: where parameters, gradients and optimizer states live (device, pinned RAM,
disk — fractions allowed, RAM first), how every buffer is sized, and what one step will cost.

A candidate is a set of engine knobs (:class:`Knobs`, exactly what the config can express:
``offload_param.device``/``max_in_cpu``, ``offload_optimizer.device``/``ratio``, prefetch bytes,
buffer counts, persistence threshold). :func:`evaluate` places the model's shards the way the
engine will (the same greedy rules: ``max_in_cpu`` elements of parameter shards in creation order
stay in RAM; the first ``1 - ratio`` of the optimizer state stays in RAM), charges every budget,
and predicts the step time from the measured rates. :func:`solve` evaluates the candidates the
config leaves open and returns the fastest that respects every budget, or raises
:class:`PlanError` with the numbers when none does.

The candidate set, the buffer sizing (:func:`candidates`) and the choice (:func:`solve`) are here;
what one step holds on the device is in ``charges``, a candidate's evaluation and the step-time
model in ``evaluation``.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, fields, replace
from typing import Iterable, Optional, Sequence

from pyinfinity.config_values import STATE_FORMATS, StateFormat
from pyinfinity.layout.charges import (PlanError, TrainShape, accumulator_bytes, activation_charge, device_charges,
                                       device_state_cost, fmt, largest_shape, prefetch_cap,
                                       state_room_freeing_accumulators, step_scratch, working_set_bytes)
from pyinfinity.layout.pools import ram_state_bytes, state_numel_within
from pyinfinity.layout.shards import Knobs
from pyinfinity.layout.sizes import SMALL_SHARD_NUMEL, ModelSizes
from pyinfinity.plan.budgets import Budgets
from pyinfinity.plan.evaluation import Placement, evaluate, on_cuda
from pyinfinity.plan.rates import Rates

log = logging.getLogger(__name__)

PERSISTENT_SHARE = 0.05  # small shards stay resident when they cost at most this share of the device
TIE = 0.02  # candidates within 2% of the fastest are ties; less disk traffic wins


@dataclass
class Fixed:
    """Knobs the user set explicitly (None = the planner decides)."""

    param_device: Optional[str] = None
    max_in_cpu: Optional[int] = None
    optimizer_device: Optional[str] = None
    ratio: Optional[float] = None
    persistence_threshold: Optional[int] = None
    prefetch_bytes: Optional[int] = None
    max_live: Optional[int] = None
    param_buffer_count: Optional[int] = None
    param_buffer_size: Optional[int] = None
    optimizer_buffer_count: Optional[int] = None
    prefetch: Optional[bool] = None
    optimizer_step_device: Optional[str] = None
    resident_bytes: Optional[int] = None
    device_optimizer_bytes: Optional[int] = None
    device_accumulator_bytes: Optional[int] = None
    checkpoint_staging: Optional[int] = None  # never planned: the config's bytes ("auto": 0)


def _optimizer_split(sizes: ModelSizes, ram_bytes: int, state: StateFormat = STATE_FORMATS["fp32"]) -> float:
    """The nvme ratio whose RAM prefix (as the engine places it) fits in ``ram_bytes``."""
    total = sizes.trainable_numel
    if total == 0:
        return 0.0
    fit = state_numel_within(state, ram_bytes)
    if fit >= total:
        return 0.0
    return min(1.0, max(0.0, 1.0 - fit / total))


def _fill(sizes: ModelSizes, train: TrainShape, budgets: Budgets, rates: Rates, k: Knobs, fixed: Fixed) -> Knobs:
    """Sizes the buffers of ``k`` from the device budget (those the user did not fix), beside the
    values the user fixed (a persistence threshold, a prefetch bucket: each charged as given)."""
    for f in fields(fixed):
        v = getattr(fixed, f.name)
        if v is not None and hasattr(k, f.name):
            setattr(k, f.name, v)
    isz = sizes.itemsize
    acts = activation_charge(sizes, train)
    if fixed.persistence_threshold is None:
        small = sizes.small_shard_bytes(SMALL_SHARD_NUMEL)
        k.persistence_threshold = SMALL_SHARD_NUMEL if small <= PERSISTENT_SHARE * budgets.device_memory else 0
    persistent = sizes.small_shard_bytes(k.persistence_threshold) if k.persistence_threshold else 0
    working = working_set_bytes(sizes, train)
    base = device_charges(sizes, train, budgets.device_memory, persistent=persistent, activations=acts,
                          device_is_host=budgets.device_is_host)
    room = budgets.device_memory - base.total  # what the budget leaves for resident units and prefetch
    cap = prefetch_cap(sizes, budgets.device_is_host)
    if fixed.prefetch_bytes is None:
        k.prefetch_bytes = max(0, min(room, cap))
    if fixed.prefetch is None:
        k.prefetch = True
    if fixed.resident_bytes is None and budgets.device_is_host:
        k.resident_bytes = 0  # the CPU device: a resident copy would save a memcpy and double the RAM
    elif fixed.resident_bytes is None:
        # fill the device: every unit stays if they all fit beside the activations; else what is left
        # after the working set and prefetch (resident units are never fetched again)
        offloaded = sizes.param_bytes - persistent
        total_room = room + base.working_set  # every unit resident: no working set, no prefetch
        if offloaded <= total_room:
            k.resident_bytes, k.prefetch_bytes = offloaded, 0 if fixed.prefetch_bytes is None else k.prefetch_bytes
        else:
            k.resident_bytes = max(0, room - k.prefetch_bytes)
    if fixed.device_optimizer_bytes is None or fixed.device_accumulator_bytes is None:
        k.device_accumulator_bytes, k.device_optimizer_bytes = _split_device_room(
            sizes, train, budgets, rates, k, fixed, persistent, acts)
    if fixed.max_live is None:
        # elements the coordinator may hold at once (it counts resident units too), at the narrowest
        # dtype the shards have (a LoRA run's bf16 base beside fp32 adapters)
        k.max_live = sizes.live_elements(persistent + k.resident_bytes + working + k.prefetch_bytes)
    if fixed.param_buffer_size is None:
        k.param_buffer_size = max(1, sizes.largest_shard_bytes)
    if fixed.param_buffer_count is None:
        k.param_buffer_count = int(max(2, min(32, k.prefetch_bytes // max(1, sizes.largest_shard_bytes) + 1)))
    if fixed.optimizer_buffer_count is None:
        k.optimizer_buffer_count = 4
    return k


def _device_room(sizes: ModelSizes, train: TrainShape, budgets: Budgets, rates: Rates, k: Knobs,
                 persistent: int, acts: int) -> int:
    """What the device budget leaves after the shards ``k`` keeps there, their working set and
    prefetch, the activations, the gradient buffers and the headroom (0 on the CPU device)."""
    if budgets.device_is_host or not on_cuda(rates, budgets):
        return 0
    offloaded = sizes.param_bytes - persistent
    c = device_charges(sizes, train, budgets.device_memory, resident=min(max(0, k.resident_bytes), offloaded),
                       persistent=persistent, prefetch=k.prefetch_bytes if k.prefetch else 0,
                       all_resident=k.resident_bytes >= offloaded, activations=acts)
    return max(0, budgets.device_memory - c.total)


def _device_state_room(sizes: ModelSizes, train: TrainShape, budgets: Budgets, rates: Rates, k: Knobs,
                       persistent: int, acts: int) -> int:
    """Device bytes for resident units' optimizer state: ``_device_room`` less the device step's
    scratch (``step_scratch``: the fp32 chunk, or a compressed format's temporaries). None on the
    CPU device (the state is in RAM already), without resident units or with the streamed device
    step."""
    if k.optimizer_step_device == "device" or k.resident_bytes <= 0:
        return 0
    return max(0, _device_room(sizes, train, budgets, rates, k, persistent, acts)
               - step_scratch(train.optimizer_state))


def _split_device_room(sizes: ModelSizes, train: TrainShape, budgets: Budgets, rates: Rates, k: Knobs,
                       fixed: Fixed, persistent: int, acts: int) -> tuple[int, int]:
    """(device_accumulator_bytes, device_optimizer_bytes) for what the config leaves "auto". Under
    accumulation the fp32 accumulators come first: at 4 bytes a parameter they take the host's
    add and the copy off the device of every micro-batch but the last, where optimizer state
    (``device_state_cost``, 18 bytes at bf16) takes one CPU step; the room they leave goes to
    optimizer state, each unit stepped there freeing its own accumulator. Without accumulation
    all of it goes to optimizer state."""
    state_room = _device_state_room(sizes, train, budgets, rates, k, persistent, acts)
    acc_room = _device_room(sizes, train, budgets, rates, k, persistent, acts) if train.grad_accum > 1 else 0
    need = accumulator_bytes(sizes.trainable_numel)
    if fixed.device_optimizer_bytes is not None:
        acc_room = max(0, acc_room - fixed.device_optimizer_bytes)
    acc = fixed.device_accumulator_bytes if fixed.device_accumulator_bytes is not None else min(acc_room, need)
    if fixed.device_optimizer_bytes is not None:
        return acc, fixed.device_optimizer_bytes
    if train.grad_accum <= 1:
        return acc, state_room
    left = max(0, state_room - min(acc, need))
    if acc >= need and left:  # every accumulator is on the device: a unit stepped there frees its own
        per = device_state_cost(sizes.itemsize, train.grad_accum, train.optimizer_state)
        left = state_room_freeing_accumulators(left, per)
    return acc, left


def candidates(sizes: ModelSizes, train: TrainShape, budgets: Budgets, rates: Rates, fixed: Fixed,
               have_disk: bool, steps: int = 16) -> Iterable[Knobs]:
    """Knob sets to evaluate: every parameter/optimizer tier split the config leaves open (parameters
    in RAM by whole shards on a grid of ``steps``, the optimizer state given the RAM that is left)."""
    bases = [_fill(sizes, train, budgets, rates, Knobs(), fixed)]
    for alt in (_accumulators_first(sizes, train, budgets, rates, fixed, bases[0]),
                _lean_staging(sizes, train, budgets, rates, fixed, bases[0], have_disk)):
        if alt is not None:
            bases.append(alt)
    if fixed.device_optimizer_bytes is None:
        # state the device room could hold steps there at the format's device rate, on the compute
        # stream; kept on the host, the CPU steps it beside the compute: both are weighed (a
        # compressed format's torch step on the device can be the slower)
        bases += [replace(b, device_optimizer_bytes=0) for b in bases if b.device_optimizer_bytes > 0]
    for base in bases:
        yield from _candidates_of(base, sizes, train, budgets, rates, fixed, have_disk, steps)


def _lean_staging(sizes: ModelSizes, train: TrainShape, budgets: Budgets, rates: Rates, fixed: Fixed,
                  base: Knobs, have_disk: bool) -> Optional[Knobs]:
    """With a disk tier for the parameters, when the device budget sizes a prefetch of several
    shards: the candidate that prefetches one shard, with two reads in flight. Each read in flight
    holds a pinned staging buffer of the largest shard, in RAM, so a deep prefetch pushes that much
    more of the parameters onto the disk, where a disk-bound step reads them twice (a 70B model
    with 16 GiB of device memory: five 1.7 GB buffers). Both are evaluated; ties keep the deeper
    prefetch. None when it does not apply."""
    if (not have_disk or fixed.param_device not in (None, "nvme") or fixed.prefetch_bytes is not None
            or fixed.param_buffer_count is not None or base.param_buffer_count <= 2):
        return None
    shard = max(1, sizes.largest_shard_bytes)
    return _fill(sizes, train, budgets, rates, Knobs(), replace(fixed, prefetch_bytes=min(base.prefetch_bytes, shard)))


def _accumulators_first(sizes: ModelSizes, train: TrainShape, budgets: Budgets, rates: Rates, fixed: Fixed,
                        base: Knobs) -> Optional[Knobs]:
    """Under accumulation on a GPU, when the resident units leave too little room for an fp32
    accumulator of every trainable parameter: the candidate that keeps fewer units resident (they
    stream in again each micro-batch, over a link that usually has time to spare) so that every
    accumulator is on the device (as many as fit with none resident), and the host adds little or
    nothing. None when it does not apply or holds no more accumulators."""
    if (train.grad_accum <= 1 or budgets.device_is_host or not on_cuda(rates, budgets)
            or fixed.resident_bytes is not None or fixed.device_accumulator_bytes is not None):
        return None
    need = accumulator_bytes(sizes.trainable_numel)
    if base.device_accumulator_bytes >= need:
        return None
    persistent = sizes.small_shard_bytes(base.persistence_threshold) if base.persistence_threshold else 0
    acts = activation_charge(sizes, train)
    streamed = _fill(sizes, train, budgets, rates, Knobs(), replace(fixed, resident_bytes=0))
    streamed.resident_bytes = 0
    room = _device_room(sizes, train, budgets, rates, streamed, persistent, acts)
    k = _fill(sizes, train, budgets, rates, Knobs(), replace(fixed, resident_bytes=max(0, room - need)))
    k.resident_bytes = max(0, room - need)
    return k if k.device_accumulator_bytes > base.device_accumulator_bytes else None


def _candidates_of(base: Knobs, sizes: ModelSizes, train: TrainShape, budgets: Budgets, rates: Rates,
                   fixed: Fixed, have_disk: bool, steps: int) -> Iterable[Knobs]:
    # ``base`` comes from _fill, which set every value ``fixed`` holds
    if fixed.param_device:
        pdevs = [fixed.param_device]
    else:
        # on a GPU, "cpu" with every unit resident is "none" done better (a pinned home the gradients
        # land in and the new values come from): "none" is left to configs that ask for it
        pdevs = ([] if on_cuda(rates, budgets) else ["none"]) + ["cpu"] + (["nvme"] if have_disk else [])
    odevs = [fixed.optimizer_device] if fixed.optimizer_device else (["cpu", "nvme"] if have_disk else ["cpu"])
    if fixed.optimizer_step_device:
        steps_on = [fixed.optimizer_step_device]
    else:
        steps_on = ["cpu", "device"] if on_cuda(rates, budgets) else ["cpu"]
    for step_on in steps_on:
        yield from _tier_candidates(replace(base, optimizer_step_device=step_on), sizes, train, budgets, rates,
                                    fixed, pdevs, odevs, steps)


def _tier_candidates(base: Knobs, sizes: ModelSizes, train: TrainShape, budgets: Budgets, rates: Rates,
                     fixed: Fixed, pdevs: list, odevs: list, steps: int) -> Iterable[Knobs]:
    """Parameter tier x parameter RAM share x optimizer tier (its RAM share: all the RAM left, or none)."""
    numel = sizes.numel
    for pd in pdevs:
        if pd == "nvme" and fixed.max_in_cpu is None:
            grid = sorted({int(numel * i / steps) for i in range(steps)})
        else:
            grid = [base.max_in_cpu]
        for mic in grid:
            for od in odevs:
                k = replace(base, param_device=pd, max_in_cpu=mic if pd == "nvme" else 0, optimizer_device=od)
                if pd == "none":
                    k.prefetch_bytes = 0 if fixed.prefetch_bytes is None else k.prefetch_bytes
                if od == "cpu":
                    k.ratio = 1.0 if fixed.ratio is None else fixed.ratio
                    yield k
                    continue
                if fixed.ratio is not None:
                    yield k
                    continue
                # what RAM is left for optimizer states once everything else is charged
                probe = evaluate(sizes, train, budgets, rates, replace(k, ratio=1.0))
                left = budgets.host_memory - probe.host_bytes
                yield replace(k, ratio=_optimizer_split(sizes, left, train.state_format))
                yield replace(k, ratio=1.0)


def solve(sizes: ModelSizes, train: TrainShape, budgets: Budgets, rates: Rates, fixed: Optional[Fixed] = None,
          nvme_paths: Sequence[str] = ()) -> Placement:
    """The fastest placement that respects every budget (ties: the least disk traffic, i.e. RAM
    first). Raises PlanError naming the numbers when no candidate fits."""
    fixed = fixed or Fixed()
    paths = list(nvme_paths) or budgets.swap_paths
    have_disk = bool(paths)
    evaluated = [evaluate(sizes, train, budgets, rates, k, paths)
                 for k in candidates(sizes, train, budgets, rates, fixed, have_disk)]
    ok = [p for p in evaluated if p.feasible]
    if not ok:
        raise PlanError(_explain(sizes, train, budgets, evaluated, paths))
    best_t = min(p.predicted.total for p in ok)
    near = [p for p in ok if p.predicted.total <= best_t * (1 + TIE)]
    best = min(near, key=lambda p: (p.disk_traffic, p.predicted.total))
    best.notes.extend(_notes(best, sizes, budgets, len(evaluated), len(ok)))
    stepped_there = [p for p in ok if p.device_state_bytes > 0]
    if not best.device_state_bytes and stepped_there:
        alt = min(stepped_there, key=lambda p: p.predicted.total)
        best.notes.append(f"the device has room for the optimizer state of some resident units, but stepping it there "
                          f"at {rates.device_adam_rate(train.optimizer_state) / 1e9:.2f} Gparam/s "
                          f"({rates.device_adam_source(train.optimizer_state)}) predicts "
                          f"{alt.predicted.total:.3f} s/step against {best.predicted.total:.3f}: it stays on the host "
                          "(pyinfinity.device_optimizer_bytes sets it)")
    log.debug("plan: params %s, optimizer %s; %s", best.knobs.param_device, best.knobs.optimizer_device,
             best.predicted.breakdown())
    return best


def _notes(p: Placement, sizes: ModelSizes, budgets: Budgets, n_eval: int, n_ok: int) -> list[str]:
    out = [f"{n_ok} of {n_eval} candidate placements fit the budgets; this one is the fastest predicted"
           " (ties go to less disk traffic)"]
    if p.optimizer.disk and p.optimizer.ram:
        out.append(f"optimizer state split: {fmt(p.optimizer.ram)} in RAM, the overflow {fmt(p.optimizer.disk)} on disk")
    if p.params.disk and p.params.ram:
        out.append(f"parameters split: {fmt(p.params.ram)} in RAM, {fmt(p.params.disk)} on disk")
    if p.knobs.optimizer_step_device == "device":
        out.append("the optimizer steps on the device: states streamed through two device buffers")
    else:
        out.append("the optimizer steps on the CPU (the one-pass Adam kernel)")
    return out


def _explain(sizes: ModelSizes, train: TrainShape, budgets: Budgets, evaluated: list[Placement],
             paths: Sequence[str]) -> str:
    """The error for an infeasible problem: what the least-violating candidate needs, and what to change."""
    def deficit(p: Placement) -> float:
        d = max(0, p.device_bytes - budgets.device_memory) + max(0, p.host_bytes - budgets.host_memory)
        if p.swap_bytes:
            d += max(0, p.swap_bytes - budgets.swap_free) if paths else p.swap_bytes
        return d

    # explain the tightest constraint first: if some candidates fit the device and RAM, only swap
    # is short (report the least swap needed); else if some fit the device, RAM is short
    fit_dev = [p for p in evaluated if p.device_bytes <= budgets.device_memory]
    fit_host = [p for p in fit_dev if p.host_bytes <= budgets.host_memory]
    pool = fit_host or fit_dev or evaluated
    best = min(pool, key=(lambda p: p.swap_bytes) if fit_host else deficit) if pool else None
    msgs = list(best.violations) if best else ["no candidate placement"]
    hints = []
    for v in msgs:
        if v.startswith("device memory"):
            mb, seq = largest_shape(sizes, train, budgets.device_memory)
            hints.append("raise the device budget (--gpu-memory / pyinfinity.device_memory), lower the "
                         "micro-batch or sequence length, or enable activation checkpointing"
                         + (f" (the largest micro-batch x sequence that fits with nothing resident is {mb} x {seq})"
                            if mb and not budgets.device_is_host else ""))
        elif v.startswith("host RAM") and not paths:
            state = ram_state_bytes(sizes, train.state_format)
            hints.append(f"give a swap directory (--nvme DIR / nvme_path) with at least "
                         f"{fmt(max(0, (best.host_bytes if best else state) - budgets.host_memory))} free, or raise the "
                         "host budget (--cpu-memory / pyinfinity.host_memory)")
        elif v.startswith("host RAM"):
            grads = best.grads.ram if best else accumulator_bytes(sizes.trainable_numel)
            hints.append("raise the host budget (--cpu-memory / pyinfinity.host_memory): "
                         + (f"the {train.host_grads} ({fmt(grads)}) and " if grads else "")
                         + "the staging buffers stay in RAM")
        elif v.startswith("swap: needs") and "no nvme_path" in v:
            hints.append("give a swap directory (--nvme DIR / nvme_path)")
        elif v.startswith("swap"):
            hints.append("or lower the state on disk: raise the host budget (--cpu-memory / pyinfinity.host_memory, "
                         f"now {fmt(budgets.host_memory)}) or train a smaller model")
    if best is not None and sizes.numel:
        # what the state costs a parameter, so a refusal can be checked against the model's size
        state = best.params.total + best.optimizer.total + best.grads.total
        what = {"fp32": "fp32 master and moments", "8bit": "fp32 master and 8-bit moments",
                "bf16": "bf16 moments"}[train.optimizer_state]
        hints.append(f"the training state is {state / sizes.numel:.1f} bytes a parameter ({fmt(state)} for "
                     f"{sizes.numel / 1e9:.2f}B parameters: weights {fmt(best.params.total)}, {what} "
                     f"{fmt(best.optimizer.total)}"
                     + (f", {train.host_grads} {fmt(best.grads.total)}" if best.grads.total else "") + ")")
    return "; ".join(msgs + hints)


__all__ = ["solve", "candidates", "Fixed", "PERSISTENT_SHARE", "TIE"]
