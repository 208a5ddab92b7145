"""Weight decay that differs between parameters of one shard (torch's param groups that differ
only in ``weight_decay``: Trainer's default AdamW puts biases and norms in a group without decay).

A shard flattens a unit's parameters, so one shard can hold parameters of several groups. Each
shard's state keeps its :class:`DecayRanges` (``ShardOptimState.decay``): the element ranges of
the shard and the weight decay of each (None: the optimizer group's ``weight_decay``, read at
every step). :func:`step_hyper` gives the hyperparameters one shard steps with: a shard whose
ranges all have one value steps with it in the format's kernel as before; a shard whose ranges
differ has AdamW's decoupled decay applied here, range by range, to its fp32 master
(``p *= 1 - lr * weight_decay``, what ``torch.optim.AdamW`` does first), and is then stepped by the
kernel with no decay. The Adam update does not read the weights, so the result is AdamW's with
each parameter's own decay. Only AdamW's decoupled decay is split this way (Adam's L2 decay is
added to the gradient inside the kernel), and only for a format whose master is fp32."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Mapping, Optional, Sequence

import torch


@dataclass(frozen=True)
class DecayRanges:
    """``ranges``: (start, end, weight decay or None for the group's) covering a shard in order."""

    ranges: tuple[tuple[int, int, Optional[float]], ...]

    def values(self, group: float) -> set[float]:
        return {group if wd is None else wd for _, _, wd in self.ranges}


def shard_ranges(slices: Sequence[object], numel: int, decay_of: Mapping[int, float]) -> Optional[DecayRanges]:
    """The ranges of a shard of ``numel`` elements whose ``slices`` (``ParamSlice``: ``param``,
    ``offset``, ``numel``) are given a weight decay by ``decay_of`` (``id(param)`` -> value; the
    rest keep the group's); None when no slice of the shard is in ``decay_of``."""
    if not any(id(sl.param) in decay_of for sl in slices):  # type: ignore[attr-defined]
        return None
    ranges: list[tuple[int, int, Optional[float]]] = []
    pos = 0

    def add(a: int, b: int, wd: Optional[float]) -> None:
        if b <= a:
            return
        if ranges and ranges[-1][1] == a and ranges[-1][2] == wd:
            ranges[-1] = (ranges[-1][0], b, wd)
        else:
            ranges.append((a, b, wd))

    for sl in sorted(slices, key=lambda s: s.offset):  # type: ignore[attr-defined]
        a, b = sl.offset, sl.offset + sl.numel  # type: ignore[attr-defined]
        add(pos, a, None)  # padding between slices: the group's (it holds zeros and gets no gradient)
        wd = decay_of.get(id(sl.param))  # type: ignore[attr-defined]
        add(a, b, None if wd is None else float(wd))
        pos = max(pos, b)
    add(pos, numel, None)
    return DecayRanges(tuple(ranges))


def step_hyper(decay: Optional[DecayRanges], hyper: dict, master: Callable[[], torch.Tensor]) -> dict:
    """The hyperparameters one shard steps with; for a shard whose ranges differ in weight decay,
    the decoupled decay is applied here to ``master()`` (the shard's fp32 master, where the
    kernel reads it) and the returned set has none."""
    if decay is None:
        return hyper
    group = float(hyper["weight_decay"])
    values = decay.values(group)
    if len(values) == 1:
        wd = values.pop()
        return hyper if wd == group else {**hyper, "weight_decay": wd}
    m = master()
    lr = float(hyper["lr"])
    for a, b, wd in decay.ranges:
        wd = group if wd is None else wd
        if wd != 0.0:
            m[a:b].mul_(1 - lr * wd)
    return {**hyper, "weight_decay": 0.0}


__all__ = ["DecayRanges", "shard_ranges", "step_hyper"]
