"""Hyperparameters that differ between parameters of one shard: torch's param groups (their own
lr, betas, eps or weight decay; Trainer's default AdamW puts biases and norms in a group without
decay, LoRA+ gives ``lora_B`` its own lr).

A shard flattens a unit's parameters, so one shard can hold parameters of several groups. Each
shard's state keeps its :class:`ShardRanges` (``ShardOptimState.ranges``): the element ranges of
the shard, the optimizer group of each and, optionally, a weight decay of its own. The values of
each group are read from the step's hyperparameters (``hyper["groups"]``, one set per group, as
``OffloadOptimizer.param_groups`` held them when the step began), so a schedule that sets each
group's lr steps each range with its group's.

:func:`step_calls` gives the kernel calls one shard's step makes. Adam's update is elementwise,
so a range can be stepped by itself with its own hyperparameters, the step count shared:

* one set for the whole shard: one call over the shard, as without groups;
* sets that differ only in AdamW's decoupled weight decay, with an fp32 master
  (``decoupled_decay``): the decay is applied here, range by range, to the master
  (``p *= 1 - lr * weight_decay``, what ``torch.optim.AdamW`` does first), then one call over the
  shard with no decay (the Adam update does not read the weights);
* anything else: one call per range (``span``), each with its range's set. The 8-bit state
  quantises its moments by blocks of ``QUANT_BLOCK`` elements, so there every range must start
  on a block boundary (:func:`split_blocks` names the first that does not)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Hashable, Mapping, Optional, Sequence

import torch

#: what one range's kernel call gets: (element range of the shard, or None for the whole shard; hyperparameters)
Call = tuple[Optional[tuple[int, int]], dict]


@dataclass(frozen=True)
class ShardRanges:
    """``ranges``: (start, end, group, weight decay or None for the group's) covering a shard in order."""

    ranges: tuple[tuple[int, int, int, Optional[float]], ...]

    def uniform(self) -> bool:
        """Whether every range has one group and one weight decay (the shard steps as one)."""
        return len({(g, wd) for _, _, g, wd in self.ranges}) == 1


def shard_ranges(slices: Sequence[object], numel: int, group_of: Mapping[int, int],
                 decay_of: Mapping[int, float]) -> Optional[ShardRanges]:
    """The ranges of a shard of ``numel`` elements whose ``slices`` (``ParamSlice``: ``param``,
    ``offset``, ``numel``) are put in a group by ``group_of`` (``id(param)`` -> group index; the
    rest in group 0) and given a weight decay by ``decay_of`` (``id(param)`` -> value; the rest
    keep their group's); None when neither names a slice of the shard."""
    if not any(id(sl.param) in group_of or id(sl.param) in decay_of for sl in slices):  # type: ignore[attr-defined]
        return None
    ranges: list[tuple[int, int, int, Optional[float]]] = []
    pos = 0

    def add(a: int, b: int, group: int, wd: Optional[float]) -> None:
        if b <= a:
            return
        if ranges and ranges[-1][1] == a and ranges[-1][2:] == (group, wd):
            ranges[-1] = (ranges[-1][0], b, group, wd)
        else:
            ranges.append((a, b, group, wd))

    def last() -> tuple[int, Optional[float]]:
        return ranges[-1][2:] if ranges else (0, None)  # type: ignore[return-value]

    for sl in sorted(slices, key=lambda s: s.offset):  # type: ignore[attr-defined]
        a, b = sl.offset, sl.offset + sl.numel  # type: ignore[attr-defined]
        add(pos, a, *last())  # padding between slices (zeros, no gradient): joins the range before it
        wd = decay_of.get(id(sl.param))  # type: ignore[attr-defined]
        add(a, b, int(group_of.get(id(sl.param), 0)), None if wd is None else float(wd))  # type: ignore[attr-defined]
        pos = max(pos, b)
    add(pos, numel, *last())
    return ShardRanges(tuple(ranges))


def split_blocks(ranges: Optional[ShardRanges], numel: int, block: int,
                 key: Callable[[int, Optional[float]], Hashable]) -> Optional[int]:
    """The first element where a range that steps in a call of its own starts inside a block of
    ``block`` elements (a quantised state's), or None when every such boundary is on one;
    ``key(group, weight decay)`` is equal for ranges that step in one call."""
    if ranges is None:
        return None
    r = ranges.ranges
    for prev, cur in zip(r, r[1:]):
        if key(*prev[2:]) != key(*cur[2:]) and cur[0] % block and cur[0] < numel:
            return cur[0]
    return None


def span_kw(span: Optional[tuple[int, int]]) -> dict:
    """The ``span`` keyword of a format's step call: given only for a range (a format that never
    sees groups need not take it)."""
    return {} if span is None else {"span": span}


def _set_of(hyper: dict, group: int, wd: Optional[float]) -> dict:
    groups = hyper.get("groups")
    h = dict(groups[group]) if groups else {k: v for k, v in hyper.items() if k != "groups"}
    if wd is not None:
        h["weight_decay"] = wd
    return h


def step_calls(ranges: Optional[ShardRanges], hyper: dict, master: Callable[[], torch.Tensor], *,
               decoupled_decay: bool) -> list[Call]:
    """The kernel calls of one shard's step (see the module's docstring). ``master()``: the
    shard's fp32 master where the kernel reads it (the decay pass writes it in place);
    ``decoupled_decay``: the format steps AdamW's decoupled decay on an fp32 master."""
    if ranges is None:
        return [(None, _set_of(hyper, 0, None) if hyper.get("groups") else hyper)]
    spans: list[tuple[int, int, dict]] = []
    for a, b, group, wd in ranges.ranges:
        h = _set_of(hyper, group, wd)
        if spans and spans[-1][1] == a and spans[-1][2] == h:
            spans[-1] = (spans[-1][0], b, h)
        else:
            spans.append((a, b, h))
    if len({tuple(sorted(h.items())) for _, _, h in spans}) == 1:
        return [(None, spans[0][2])]
    rest = {tuple(sorted((k, v) for k, v in h.items() if k != "weight_decay")) for _, _, h in spans}
    if len(rest) == 1 and decoupled_decay:
        m = master()
        for a, b, h in spans:
            wd = float(h["weight_decay"])
            if wd != 0.0:
                m[a:b].mul_(1 - float(h["lr"]) * wd)
        return [(None, {**spans[0][2], "weight_decay": 0.0})]
    return [((a, b), h) for a, b, h in spans]


__all__ = ["Call", "ShardRanges", "shard_ranges", "span_kw", "split_blocks", "step_calls"]
