"""The planner: model sizes + budgets + measured rates -> a Placement (where parameters, gradients
and optimizer states live, every buffer's size) and a predicted step time naming the bottleneck.
``"auto"`` in a config means "ask the planner" (``resolve_auto``)."""
from pyinfinity.layout.charges import PlanError, TrainShape
from pyinfinity.layout.pools import Share
from pyinfinity.layout.shards import Knobs
from pyinfinity.layout.sizes import ModelSizes
from pyinfinity.plan.budgets import Budgets, SwapDir, measure_budgets
from pyinfinity.plan.evaluation import Placement, StepTime, evaluate
from pyinfinity.plan.placement import Fixed, solve
from pyinfinity.plan.rates import Rates, measure_rates
from pyinfinity.plan.resolve import Decision, placement_of, plan_engine_config, resolve_auto
from pyinfinity.plan.sizes import model_sizes, sizes_from_config, sizes_from_module

__all__ = ["Budgets", "SwapDir", "measure_budgets", "Fixed", "Knobs", "Placement", "PlanError", "Share",
           "StepTime", "TrainShape", "evaluate", "solve", "Rates", "measure_rates", "Decision", "placement_of",
           "plan_engine_config", "resolve_auto", "ModelSizes", "model_sizes", "sizes_from_config",
           "sizes_from_module"]
