"""The planner: model sizes + budgets + measured rates -> a Placement (where parameters, gradients
and optimizer states live, every buffer's size) and a predicted step time naming the bottleneck.
``"auto"`` in a config means "ask the planner" (``resolve_auto``).

The names below are imported on first use, so that a module of the planner that needs no torch
(``pyinfinity.plan.hardware``: the command line's help) is importable without it."""
from __future__ import annotations

import importlib
from typing import Any

_HOME = {
    "Budgets": "budgets", "SwapDir": "budgets", "measure_budgets": "budgets",
    "PlanError": "charges", "TrainShape": "charges",
    "Knobs": "evaluation", "Placement": "evaluation", "Share": "evaluation", "StepTime": "evaluation",
    "evaluate": "evaluation",
    "Fixed": "placement", "solve": "placement",
    "Rates": "rates", "measure_rates": "rates",
    "Decision": "resolve", "placement_of": "resolve", "plan_engine_config": "resolve", "resolve_auto": "resolve",
    "ModelSizes": "sizes", "model_sizes": "sizes", "sizes_from_config": "sizes", "sizes_from_module": "sizes",
}

__all__ = list(_HOME)


def __getattr__(name: str) -> Any:
    if name not in _HOME:
        raise AttributeError(f"module 'pyinfinity.plan' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"pyinfinity.plan.{_HOME[name]}"), name)
    globals()[name] = value
    return value
