"""DeepSpeed's learning-rate schedules (WarmupLR, WarmupDecayLR, WarmupCosineLR) with the same
formulas and the same stepping convention: the schedule sets the lr of iteration -1 at creation
and ``step()`` is called after every optimizer step. As in DeepSpeed, their warm-up starts at its
minimum (0 by default) for the first two optimizer steps (iterations -1 and 0).

``LinearWarmupCosineLR`` is pyinfinity's own (``pyinfinity train``'s schedule): its warm-up gives
optimizer step k (from 1) the lr ``peak * k / warmup_num_steps``, so the first step trains; then
a cosine decay to ``cos_min_ratio * peak`` at ``total_num_steps``."""
from __future__ import annotations

import logging
import math
from typing import Any

log = logging.getLogger(__name__)


class WarmupLR:
    """Increases the lr from warmup_min_lr to warmup_max_lr over warmup_num_steps (log or linear),
    then keeps it at warmup_max_lr."""

    def __init__(self, optimizer: Any, warmup_min_lr: float = 0.0, warmup_max_lr: float = 0.001,
                 warmup_num_steps: int = 1000, warmup_type: str = "log", last_batch_iteration: int = -1) -> None:
        if warmup_type not in ("log", "linear"):
            raise ValueError(f"warmup_type: expected 'log' or 'linear', got {warmup_type!r}")
        self.optimizer = optimizer
        self.min_lr = float(warmup_min_lr)
        self.delta = float(warmup_max_lr) - self.min_lr
        self.warmup_num_steps = max(2, int(warmup_num_steps))
        self.warmup_type = warmup_type
        self.inverse_log_warm_up = 1.0 / math.log(self.warmup_num_steps)
        self.last_batch_iteration = last_batch_iteration
        self._apply()

    def _warmup_gamma(self) -> float:
        it = self.last_batch_iteration
        if self.warmup_type == "log":
            return self.inverse_log_warm_up * math.log(it + 1)
        return it / self.warmup_num_steps

    def _gamma(self) -> float:
        if self.last_batch_iteration < self.warmup_num_steps:
            return self._warmup_gamma()
        return 1.0

    def get_lr(self) -> list[float]:
        if self.last_batch_iteration < 0:
            return [self.min_lr]
        return [self.min_lr + self.delta * self._gamma()]

    def _scaled(self, ratio: float) -> list[float]:
        """Each group's own lr (its ``initial_lr``) times ``ratio``."""
        return [float(g["initial_lr"]) * ratio for g in self.optimizer.param_groups]

    def _apply(self) -> None:
        lrs = self.get_lr()
        for group, lr in zip(self.optimizer.param_groups, lrs * len(self.optimizer.param_groups)):
            group["lr"] = lr
        self._last_lr = lrs

    def step(self, last_batch_iteration: int | None = None) -> None:
        self.last_batch_iteration = (self.last_batch_iteration + 1 if last_batch_iteration is None
                                     else last_batch_iteration)
        self._apply()

    def get_last_lr(self) -> list[float]:
        return self._last_lr

    def state_dict(self) -> dict:
        return {"last_batch_iteration": self.last_batch_iteration}

    def load_state_dict(self, sd: dict) -> None:
        self.last_batch_iteration = sd["last_batch_iteration"]
        self._apply()


class WarmupDecayLR(WarmupLR):
    """WarmupLR, then a linear decay to 0 at total_num_steps."""

    def __init__(self, optimizer: Any, total_num_steps: int, warmup_min_lr: float = 0.0,
                 warmup_max_lr: float = 0.001, warmup_num_steps: int = 1000, warmup_type: str = "log",
                 last_batch_iteration: int = -1) -> None:
        self.total_num_steps = int(total_num_steps)
        super().__init__(optimizer, warmup_min_lr, warmup_max_lr, warmup_num_steps, warmup_type,
                         last_batch_iteration)

    def _gamma(self) -> float:
        if self.last_batch_iteration < self.warmup_num_steps:
            return self._warmup_gamma()
        return max(0.0, float(self.total_num_steps - self.last_batch_iteration)
                   / float(max(1.0, self.total_num_steps - self.warmup_num_steps)))


class WarmupCosineLR(WarmupLR):
    """Warms the ratio up from warmup_min_ratio to 1, then cosine-decays it to cos_min_ratio at
    total_num_steps; lr = the optimizer's configured lr x ratio."""

    def __init__(self, optimizer: Any, total_num_steps: int, warmup_min_ratio: float = 0.0,
                 warmup_num_steps: int = 1000, cos_min_ratio: float = 0.0001, warmup_type: str = "log",
                 last_batch_iteration: int = -1) -> None:
        self.total_num_steps = int(total_num_steps)
        self.warmup_min_ratio = float(warmup_min_ratio)
        self.cos_min_ratio = float(cos_min_ratio)
        for g in optimizer.param_groups:  # each group peaks at its own lr (param groups of other lrs)
            g.setdefault("initial_lr", g["lr"])
        super().__init__(optimizer, 0.0, 1.0, warmup_num_steps, warmup_type, last_batch_iteration)

    def get_lr(self) -> list[float]:
        it = self.last_batch_iteration
        if it < 0:
            return [0.0]
        if it < self.warmup_num_steps:
            r = self._warmup_gamma()
            ratio = self.warmup_min_ratio + r * (1.0 - self.warmup_min_ratio)
        else:
            real_last = it - self.warmup_num_steps + 1
            real_total = max(1, self.total_num_steps - self.warmup_num_steps)
            progress = min(1.0, real_last / real_total)
            ratio = (1 + math.cos(math.pi * progress)) / 2
            ratio = max(0.0, self.cos_min_ratio + (1.0 - self.cos_min_ratio) * ratio)
        return self._scaled(ratio)


class LinearWarmupCosineLR(WarmupLR):
    """pyinfinity's warm-up and cosine decay: optimizer step k (from 1) has the lr
    ``peak * k / warmup_num_steps`` while k <= warmup_num_steps (no step at lr 0), then
    ``peak * (cos_min_ratio + (1 - cos_min_ratio) * (1 + cos(pi * p)) / 2)`` with
    ``p = (k - warmup_num_steps) / (total_num_steps - warmup_num_steps)`` (capped at 1); ``peak``
    is the optimizer's configured lr. DeepSpeed's stepping convention: iteration i sets the lr of
    step i + 2 (the lr of step 1 is set at creation)."""

    def __init__(self, optimizer: Any, total_num_steps: int, warmup_num_steps: int = 0,
                 cos_min_ratio: float = 0.0001, last_batch_iteration: int = -1) -> None:
        self.total_num_steps = int(total_num_steps)
        self.cos_min_ratio = float(cos_min_ratio)
        for g in optimizer.param_groups:  # each group peaks at its own lr (param groups of other lrs)
            g.setdefault("initial_lr", g["lr"])
        super().__init__(optimizer, 0.0, 1.0, warmup_num_steps, "linear", last_batch_iteration)
        self.warmup_num_steps = max(0, int(warmup_num_steps))
        self._apply()

    def get_lr(self) -> list[float]:
        k, w = self.last_batch_iteration + 2, self.warmup_num_steps  # the optimizer step this lr is for
        if k <= w:
            ratio = k / w
        else:
            progress = min(1.0, (k - w) / max(1, self.total_num_steps - w))
            ratio = self.cos_min_ratio + (1.0 - self.cos_min_ratio) * (1 + math.cos(math.pi * progress)) / 2
        return self._scaled(ratio)


SCHEDULERS = {"WarmupLR": WarmupLR, "WarmupDecayLR": WarmupDecayLR, "WarmupCosineLR": WarmupCosineLR,
              "LinearWarmupCosineLR": LinearWarmupCosineLR}


def build_scheduler(name: str, optimizer: Any, params: dict) -> WarmupLR:
    """The DeepSpeed schedule ``name`` with ``params`` (already validated by the config)."""
    return SCHEDULERS[name](optimizer, **params)
