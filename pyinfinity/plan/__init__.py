"""The planner: model sizes + budgets + measured rates -> a Placement (where parameters, gradients
and optimizer states live, every buffer's size) and a predicted step time naming the bottleneck.
``"auto"`` in a config means "ask the planner" (``resolve_auto``).

The names below are imported on first use, so that a module of the planner that needs no torch
(``pyinfinity.plan.hardware``: the command line's help) is importable without it."""
from __future__ import annotations

import importlib
from typing import Any

_HOME = {
    "Budgets": "plan.budgets", "SwapDir": "plan.budgets", "measure_budgets": "plan.budgets",
    "PlanError": "layout.charges", "TrainShape": "layout.charges", "Share": "layout.pools",
    "Knobs": "layout.shards", "ModelSizes": "layout.sizes",
    "Placement": "plan.evaluation", "StepTime": "plan.evaluation", "evaluate": "plan.evaluation",
    "Fixed": "plan.placement", "solve": "plan.placement",
    "Rates": "plan.rates",
    "Decision": "plan.resolve", "placement_of": "plan.resolve", "plan_engine_config": "plan.resolve",
    "resolve_auto": "plan.resolve",
    "model_sizes": "plan.sizes", "sizes_from_config": "plan.sizes", "sizes_from_module": "plan.sizes",
}

__all__ = list(_HOME)


def __getattr__(name: str) -> Any:
    if name not in _HOME:
        raise AttributeError(f"module 'pyinfinity.plan' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"pyinfinity.{_HOME[name]}"), name)
    globals()[name] = value
    return value
