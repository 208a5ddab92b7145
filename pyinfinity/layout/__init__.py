"""The placement model: from one :class:`ModelSizes` and the resolved knobs, where each shard's
parameters, optimizer state and gradient accumulator live (``shards``) and what that costs in
every memory pool: the device (``charges``), pinned and pageable RAM, each swap directory
(``pools``). Pure: no tensors are allocated and nothing is read or written. The planner evaluates
it with a step-time model over measured rates (``pyinfinity.plan``); the engine applies it
(``pyinfinity.zero``) and checks its swap directories against it (``pyinfinity.swap``)."""
from pyinfinity.layout.charges import DeviceCharges, PlanError, TrainShape, device_charges, shape_refusal
from pyinfinity.layout.pools import EnginePools, Layout, Share, engine_pools, plan_layout
from pyinfinity.layout.shards import Knobs, ShardLayout, shard_layout
from pyinfinity.layout.sizes import ModelSizes

__all__ = ["DeviceCharges", "PlanError", "TrainShape", "device_charges", "shape_refusal", "EnginePools", "Layout",
           "Share", "engine_pools", "plan_layout", "Knobs", "ShardLayout", "shard_layout", "ModelSizes"]
