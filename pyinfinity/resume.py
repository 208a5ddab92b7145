"""What a resume keeps from the checkpoint and what from the config: the hyperparameters a
checkpoint records (``hyperparameters``) and, when the config of the resuming run differs, which
of the two is used (``apply_hyperparameters``, as DeepSpeed does). ``checkpoint`` calls them."""
from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Optional

if TYPE_CHECKING:
    from pyinfinity.zero.state import TrainingState

log = logging.getLogger("pyinfinity.checkpoint")  # its warnings are the checkpoint load's


def hyperparameters(state: "TrainingState") -> dict:
    """What a resume compares with its config: the optimizer's hyperparameters (lr as configured),
    the accumulation steps, the scheduler's type and parameters."""
    g, cfg = state.optimizer.param_groups[0], state.config
    sched = cfg.scheduler
    return {"lr": float(cfg.optimizer.lr), "betas": [float(b) for b in g["betas"]], "eps": float(g["eps"]),
            "weight_decay": float(g["weight_decay"]), "gradient_accumulation_steps": state.gradient_accumulation_steps,
            "scheduler": None if sched is None else {"type": sched.type, "params": dict(sched.params)}}


def apply_hyperparameters(state: "TrainingState", path: str, saved: Optional[dict], micro_steps: int) -> int:
    """A resume under a config that differs from the checkpoint's: as DeepSpeed, the optimizer's
    state (betas, eps, weight decay, the learning rate without a scheduler) comes from the
    checkpoint, the schedule's shape and the accumulation steps from the config (the scheduler's
    position from the checkpoint); one WARNING lists every difference and which one is used.
    Returns the micro-step count, realigned to the config's accumulation steps."""
    if saved is None:  # a checkpoint from before they were recorded: nothing to compare
        return micro_steps
    mine = hyperparameters(state)
    diffs = []
    g = state.optimizer.param_groups[0]
    for key in ("betas", "eps", "weight_decay"):
        if saved[key] != mine[key]:
            diffs.append(f"optimizer {key}: config {mine[key]}, checkpoint {saved[key]}: the checkpoint's is used")
            g[key] = tuple(saved[key]) if key == "betas" else saved[key]
    if saved["lr"] != mine["lr"]:
        used = ("the config's scheduler sets it (at the checkpoint's step)" if state.lr_scheduler is not None
                else "the checkpoint's is used")
        diffs.append(f"optimizer lr: config {mine['lr']}, checkpoint {saved['lr']}: {used}")
    if saved["scheduler"] != mine["scheduler"]:
        diffs.append(f"scheduler: config {mine['scheduler']}, checkpoint {saved['scheduler']}: the config's is used "
                     "(from the checkpoint's step)")
    gas, old = mine["gradient_accumulation_steps"], saved["gradient_accumulation_steps"]
    if gas != old:
        realigned = (micro_steps // old) * gas  # whole windows done (a partial window's gradients are not saved)
        diffs.append(f"gradient_accumulation_steps: config {gas}, checkpoint {old}: the config's is used (micro-step "
                     f"count {micro_steps} -> {realigned}: the next step comes after {gas} micro-batches)")
        micro_steps = realigned
    if diffs:
        log.warning("checkpoint %s: the config differs from the checkpoint's run: %s", path, "; ".join(diffs))
    state.optimizer.defaults.update({k: g[k] for k in ("betas", "eps", "weight_decay")})
    return micro_steps


__all__ = ["apply_hyperparameters", "hyperparameters"]
