"""What pyinfinity's engine behind ``deepspeed.initialize`` (``engine_route``) accepts: the
config section that selects it, the library releases it was checked against, and the refusals of
what it does not implement (one line naming the key and what to do instead; nothing falls back to
DeepSpeed's engine silently)."""
from __future__ import annotations

import importlib.metadata
import json
import logging
import os
import sys
from typing import Any, Dict, Tuple

from pyinfinity.config_values import ConfigError
from pyinfinity.integrations.deepspeed.layout import SUPPORTED_SERIES, parse_version

log = logging.getLogger(__name__)

#: The DeepSpeed config section that selects pyinfinity's engine (its content: pyinfinity's ``pyinfinity`` keys).
SECTION = "pyinfinity"
#: Set to 1, versions outside KNOWN_SERIES are used with a warning instead of refused.
UNTESTED_ENV = "PYINFINITY_HF_UNTESTED"
#: Release series (major, minor) of each library whose calls on the engine this route was checked against.
KNOWN_SERIES: Dict[str, Tuple[Tuple[int, int], ...]] = {
    "deepspeed": SUPPORTED_SERIES,
    "transformers": ((5, 17), (5, 25)),
    "accelerate": ((1, 16),),
    "trl": ((1, 16),),
    "peft": ((0, 21),),
}
#: Keys Trainer and Accelerate would fill when they are "auto" (from the model's hidden size, and the offload
#: devices from Accelerate's plugin): on this route their "auto" stays, and pyinfinity's planner decides them.
PLANNED_KEYS = ("zero_optimization.reduce_bucket_size", "zero_optimization.stage3_prefetch_bucket_size",
                "zero_optimization.stage3_param_persistence_threshold",
                "zero_optimization.offload_param.device", "zero_optimization.offload_optimizer.device")

def has_section(config: Any) -> bool:
    """Whether a DeepSpeed config (dict, or JSON path) selects pyinfinity's engine."""
    return isinstance(load_dict(config), dict) and SECTION in load_dict(config)


def load_dict(config: Any) -> Any:
    if isinstance(config, (str, os.PathLike)) and os.path.isfile(config):
        with open(config) as f:
            return json.load(f)
    return config


def check_versions() -> None:
    """Refuses (or, with PYINFINITY_HF_UNTESTED=1, warns about) an imported library of a release
    series this route was not checked against, naming the known ones."""
    bad = []
    for name, series in KNOWN_SERIES.items():
        if name not in sys.modules:
            continue
        try:
            version = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            version = str(getattr(sys.modules[name], "__version__", "?"))
        v = parse_version(version)
        if v is None or v[:2] not in series:
            bad.append(f"{name} {version} (known: {', '.join(f'{a}.{b}.x' for a, b in series)})")
    if not bad:
        return
    msg = (f"pyinfinity's engine through deepspeed.initialize was checked against other releases: {'; '.join(bad)}; "
           f"install a known one (.ci/requirements.txt), or set {UNTESTED_ENV}=1 to try this one")
    if os.environ.get(UNTESTED_ENV, "").strip() in ("1", "true", "yes", "on"):
        log.warning("%s", msg.split("; install")[0] + f" ({UNTESTED_ENV}=1: going on)")
        return
    raise ConfigError(msg)


def _world_size() -> int:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size()
    try:
        return int(os.environ.get("WORLD_SIZE", "1"))
    except ValueError:
        return 1


def refuse(key: str, why: str, instead: str) -> ConfigError:
    return ConfigError(f"{key}: {why}; {instead} (or remove the \"{SECTION}\" section to train with DeepSpeed's "
                       "own engine)")


def check_supported(config: dict, model: Any, mpu: Any, training_data: Any) -> None:
    """Refuses what pyinfinity's engine does not implement, one line naming the key."""
    if mpu is not None:
        raise refuse("mpu", "model parallelism (a model-parallel unit) is DeepSpeed's", "train on one device")
    pipe = sys.modules.get("deepspeed.pipe")
    if pipe is not None and isinstance(model, getattr(pipe, "PipelineModule", ())):
        raise refuse("model", "a deepspeed.pipe.PipelineModule: pipeline parallelism is not implemented by "
                      "pyinfinity's engine", "pass the plain nn.Module")
    if "pipeline" in config:
        raise refuse("pipeline", "pipeline parallelism is not implemented by pyinfinity's engine",
                      "remove the key and pass the plain nn.Module")
    world = _world_size()
    if world > 1:
        raise refuse("world size", f"{world} processes; pyinfinity's engine trains one model on one device in one "
                      "process (parameters and optimizer offloaded, not sharded across ranks)", "launch one process")
    tp = (config.get("tensor_parallel") or {}).get("autotp_size", 1)
    if isinstance(tp, int) and tp > 1:
        raise refuse("tensor_parallel.autotp_size", f"{tp}: tensor parallelism is not implemented by pyinfinity's "
                      "engine", "set it to 1")
    sp = config.get("sequence_parallel_size", 1)
    if isinstance(sp, int) and sp > 1:
        raise refuse("sequence_parallel_size", f"{sp}: sequence parallelism is not implemented by pyinfinity's "
                      "engine", "set it to 1")
    stage = (config.get("zero_optimization") or {}).get("stage", 3)
    if stage != 3:
        raise refuse("zero_optimization.stage", f"{stage!r}: pyinfinity's engine is ZeRO-3 style (every parameter "
                      "offloaded in units)", "set it to 3")
    if training_data is not None:
        raise refuse("training_data", "pyinfinity's engine builds no data loader", "iterate over your own "
                      "DataLoader and pass each batch to the engine")


#: torch optimizers whose update pyinfinity's offloaded Adam reproduces, by class name: AdamW-style decay or not.
ADAM_CLASSES = {"AdamW": True, "Adam": None, "DeepSpeedCPUAdam": None, "FusedAdam": None}


def optimizer_section(optimizer: Any) -> dict:
    """The DeepSpeed ``"optimizer"`` section that makes pyinfinity's offloaded Adam step as
    ``optimizer`` (a torch Adam/AdamW, or DeepSpeed's Adam) would, with group 0's values (the
    engine's ``OffloadOptimizer.set_param_groups`` gives every group its own lr, betas, eps and
    weight decay); refuses any other optimizer, and amsgrad or maximize in any group."""
    name = type(optimizer).__name__
    if name not in ADAM_CLASSES:
        raise refuse("optimizer", f"{name} cannot be offloaded by pyinfinity's engine (it steps Adam/AdamW on "
                      "the host or NVMe)", "use torch.optim.AdamW (Trainer: optim=\"adamw_torch\"), or an "
                      "\"optimizer\" section of type AdamW")
    adamw = ADAM_CLASSES[name]
    if adamw is None:  # DeepSpeed's Adam says which; torch's Adam adds the decay to the gradient (L2)
        adamw = bool(getattr(optimizer, "adam_w_mode", False)) if name != "Adam" else False
    groups = optimizer.param_groups
    for i, g in enumerate(groups):
        for k in ("amsgrad", "maximize"):
            if g.get(k):
                key = f"optimizer.param_groups[{i}].{k}" if len(groups) > 1 else f"optimizer.{k}"
                raise refuse(key, "true is not implemented by pyinfinity's offloaded Adam", "set it false")
    first = groups[0]
    betas = tuple(float(b) for b in first.get("betas", (0.9, 0.999)))
    return {"type": "AdamW" if adamw else "Adam",
            "params": {"lr": float(first["lr"]), "betas": list(betas), "eps": float(first.get("eps", 1e-8)),
                       "weight_decay": float(first.get("weight_decay", 0.0)), "adam_w_mode": adamw}}


__all__ = ["SECTION", "UNTESTED_ENV", "KNOWN_SERIES", "PLANNED_KEYS", "ADAM_CLASSES", "has_section", "load_dict",
           "check_versions", "check_supported", "optimizer_section", "refuse"]
