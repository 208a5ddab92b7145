"""fp16 dynamic loss scaling (DeepSpeed's rules)."""
from __future__ import annotations

from typing import Any


class DynamicLossScaler:
    """fp16 loss scaling as DeepSpeed does it: halve on overflow (after ``hysteresis`` overflows),
    double after ``loss_scale_window`` good steps; a static scale when ``loss_scale`` > 0."""

    def __init__(self, cfg: Any) -> None:
        self.dynamic = cfg.enabled and cfg.loss_scale == 0
        self.scale = (2.0 ** cfg.initial_scale_power) if self.dynamic else (cfg.loss_scale or 1.0)
        self.window = cfg.loss_scale_window
        self.min_scale = cfg.min_loss_scale
        self.hysteresis = cfg.hysteresis
        self._hyst_left = cfg.hysteresis
        self._good = 0

    def update(self, overflow: bool) -> None:
        if not self.dynamic:
            return
        if overflow:
            self._good = 0
            if self._hyst_left <= 1:
                self.scale = max(self.scale / 2, self.min_scale)
                self._hyst_left = self.hysteresis
            else:
                self._hyst_left -= 1
            return
        self._good += 1
        if self._good % self.window == 0:
            self.scale *= 2
            self._hyst_left = self.hysteresis

    def state_dict(self) -> dict:
        return {"scale": self.scale, "good": self._good, "hyst_left": self._hyst_left}

    def load_state_dict(self, d: dict) -> None:
        self.scale, self._good, self._hyst_left = d["scale"], d["good"], d["hyst_left"]


__all__ = ["DynamicLossScaler"]
