"""What the engine reports about its steps and its memory: a ``StepRecord`` per optimizer step
(``Engine.history``, returned by ``step()``), a ``MemoryReport`` on demand (``memory_report()``),
the medians the planner's closing comparison of predicted and measured step times reads, and the
default logging that shows step lines and the start's progress (``progress.Progress``)."""
from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass
from typing import Optional

from pyinfinity.config import format_size


@dataclass
class StepRecord:
    """Telemetry of one optimizer step (all micro-batches of it)."""

    step: int
    loss: float
    lr: float
    tokens: int
    seconds: float
    tokens_per_s: float
    grad_norm: float
    skipped: bool
    loss_scale: float
    peak_device_bytes: int  # resident shard + buffer bytes high-water (the engine's own count)
    # GPU: torch.cuda.max_memory_allocated less what the process held before the engine; else None
    peak_device_allocated: Optional[int]
    bytes_moved: dict[str, int]  # "params.nvme.read" etc., this step
    overlap_fraction: Optional[float]  # share of parameter transfer time hidden behind compute
    prefetch_hits: int
    on_demand_fetches: int
    optimizer_seconds: float  # time step() spent on the optimizer (with overlap_step: the wait after backward)
    optimizer_busy_seconds: float = 0.0  # optimizer time in all threads (with overlap_step: hidden part included)
    overlapped_shards: int = 0  # shards stepped in the background during the boundary backward
    # seconds of the optimizer's per-shard work since the last record, by part: gradient (wait for its
    # copy + convert to fp32), adam, write (new values home and to resident units), read_wait (NVMe),
    # accumulate (the gradient adds of this step's micro-batches, on their worker)
    optimizer_phases: Optional[dict] = None
    step_wait_seconds: float = 0.0  # time forward/backward waited for the optimizer to write a unit's values


@dataclass
class MemoryReport:
    """Where the training state lives (bytes per tensor class and tier) and the peaks."""

    device: str
    device_budget: Optional[int]
    device_resident: int
    device_peak: int
    device_allocated_peak: Optional[int]
    params: dict[str, int]
    optimizer: dict[str, int]
    grads: dict[str, int]
    swap_files: list[str]
    host_rss: int
    optimizer_state: str = "fp32"  # the optimizer state's format ("optimizer" counts its homes in it)

    def table(self) -> str:
        rows = [f"device {self.device}: resident {format_size(self.device_resident)}, peak "
                f"{format_size(self.device_peak)}, budget "
                f"{format_size(self.device_budget) if self.device_budget else 'none'}"]
        for name, d in (("params", self.params), ("optimizer", self.optimizer), ("grads", self.grads)):
            held = ", ".join(f"{k} {format_size(v)}" for k, v in sorted(d.items()) if v)
            if name == "optimizer" and self.optimizer_state != "fp32":
                held = f"{held or 'none held'} ({self.optimizer_state} state)"
            rows.append(f"{name:9s} " + (held or "none held"))
        return "\n".join(rows)


def host_rss() -> int:
    """This process's resident set size in bytes (0 where /proc is not there)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        return 0


def measured_parts(history: list) -> dict[str, float]:
    """Medians over the steady steps (after the first two) of what the prediction's terms stand
    for: the optimizer's busy time (all threads), its visible wait in step(), the waits of forward
    and backward for the optimizer's new values."""
    steady = history[2:] or history

    def med(xs: list) -> float:
        xs = sorted(xs)
        return xs[len(xs) // 2] if xs else 0.0
    return {"optimizer busy": med([r.optimizer_busy_seconds for r in steady]),
            "optimizer in step()": med([r.optimizer_seconds for r in steady]),
            "waits for new values": med([r.step_wait_seconds for r in steady])}


def default_logging() -> None:
    """Makes the engine's INFO lines (the plan, the start's progress, a step line every
    ``steps_per_print`` steps) visible where the application configured no logging: when the root
    logger has no handler and the ``pyinfinity`` logger's level was left alone, that logger gets
    level INFO; the package's own stderr handler (``pyinfinity/__init__.py``) prints them, as
    transformers' library logger does. Setting the ``pyinfinity`` logger's level
    (``logging.getLogger("pyinfinity").setLevel(logging.WARNING)``) or configuring logging
    (``logging.basicConfig``) first leaves everything as set."""
    lib = logging.getLogger("pyinfinity")
    if lib.level == logging.NOTSET and not logging.getLogger().handlers:
        lib.setLevel(logging.INFO)


__all__ = ["StepRecord", "MemoryReport", "default_logging", "host_rss", "measured_parts"]
