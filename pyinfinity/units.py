"""Units: the blocks of modules whose parameters move together.

A unit is a subtree of the module tree (e.g. a decoder layer with its attention and MLP) whose
parameters are kept in one flat buffer per dtype, fetched to the compute device with one copy and
whose gradient comes back with one copy. Units are chosen from the structure of the model, top
down: a module whose whole subtree holds at most ``cap`` bytes of parameters is a unit (its root);
a module above that size keeps only its own parameters as a unit and its children are looked at
in turn. ``cap`` = 0 gives one unit per module (every module's own parameters, the finest grain).

This module depends on torch alone: the engine's partition (``zero.partition``) and the planner's
size model (``plan.sizes``) both call :func:`unit_roots`, so the planner counts exactly the flat
buffers the engine will make.
"""
from __future__ import annotations

from typing import Callable, Optional

from torch import nn

AUTO_MIN_UNIT_BYTES = 1 << 20  # "auto" never makes units smaller than this (per-unit overhead)
AUTO_MODEL_FRACTION = 4  # "auto": a unit holds at most 1/4 of the model ...
AUTO_BUDGET_FRACTION = 8  # ... and at most 1/8 of the device budget


def auto_unit_bytes(model_bytes: int, largest_module_bytes: int, device_budget: Optional[int]) -> int:
    """The cap "auto" picks: at most a quarter of the model (so a model is always several units and
    prefetch has something to overlap) and an eighth of the device budget (so a few units fit in
    flight beside the activations), never below the largest single module's own parameters nor
    below 1 MiB unless the model itself is smaller."""
    cap = max(1, model_bytes // AUTO_MODEL_FRACTION)
    if device_budget:
        cap = min(cap, max(1, int(device_budget) // AUTO_BUDGET_FRACTION))
    floor = min(AUTO_MIN_UNIT_BYTES, max(1, model_bytes // AUTO_MODEL_FRACTION))
    return max(cap, floor, largest_module_bytes)


def own_bytes(model: nn.Module, itemsize: Callable[[nn.Parameter], int]) -> dict[int, int]:
    """id(module) -> bytes of its own parameters (tied ones counted where first registered)."""
    seen: set[int] = set()
    out: dict[int, int] = {}
    for m in model.modules():
        n = 0
        for p in m.parameters(recurse=False):
            if id(p) not in seen:
                seen.add(id(p))
                n += p.numel() * itemsize(p)
        out[id(m)] = n
    return out


def unit_roots(model: nn.Module, cap: int, itemsize: Callable[[nn.Parameter], int]) -> set[int]:
    """ids of the modules that root a whole-subtree unit (see the module doc). Modules with own
    parameters outside every such subtree form a unit of their own parameters alone."""
    if cap <= 0:
        return set()
    own = own_bytes(model, itemsize)
    subtree: dict[int, int] = {}

    def size(m: nn.Module) -> int:
        if id(m) not in subtree:
            subtree[id(m)] = own[id(m)] + sum(size(c) for c in m.children())
        return subtree[id(m)]

    roots: set[int] = set()

    def visit(m: nn.Module) -> None:
        if size(m) == 0:
            return
        if size(m) <= cap:
            roots.add(id(m))
            return
        for c in m.children():
            visit(c)

    visit(model)
    return roots


def unit_members(model: nn.Module, roots: set[int]) -> dict[int, nn.Module]:
    """id(module) -> the module rooting its unit, for every module inside a whole-subtree unit."""
    out: dict[int, nn.Module] = {}

    def walk(m: nn.Module, root: Optional[nn.Module]) -> None:
        if root is None and id(m) in roots:
            root = m
        if root is not None:
            out[id(m)] = root
        for c in m.children():
            walk(c, root)

    walk(model, None)
    return out


__all__ = ["auto_unit_bytes", "unit_roots", "unit_members", "own_bytes"]
