"""Progress of a long phase (materialising or streaming a model's weights into its tiers), logged
at INFO a line every few seconds: a leaf, so the training state below the engine can report it."""
from __future__ import annotations

import logging
import time
from typing import Callable, Optional

from pyinfinity.config_values import format_size


class Progress:
    """Progress of a long phase, logged at INFO at most every ``interval`` seconds: modules done of
    the total, bytes, the rate and the time left at that rate, and with ``disk_written`` (bytes
    written to disk so far) what went to the disk and its rate: a state placed on disk writes more
    than the weights' bytes (an fp32 master and two moments a parameter), so the weights' rate alone
    would read as a slow disk. Nothing is logged for a phase that ends within one interval (a
    small model's start stays quiet)."""

    def __init__(self, what: str, modules: int, nbytes: int, *, interval: float = 5.0,
                 clock: Callable[[], float] = time.monotonic, logger: Optional[logging.Logger] = None,
                 disk_written: Optional[Callable[[], int]] = None) -> None:
        self.what, self.total_modules, self.total_bytes = what, max(0, modules), max(0, nbytes)
        self.interval, self.clock, self.disk_written = interval, clock, disk_written
        self.disk0 = disk_written() if disk_written is not None else 0
        self.log = logger or logging.getLogger("pyinfinity.progress")
        self.modules = self.bytes = 0
        self.t0 = self.last = clock()

    def advance(self, modules: int = 0, nbytes: int = 0) -> None:
        self.modules += modules
        self.bytes += nbytes
        now = self.clock()
        if now - self.last >= self.interval:
            self.last = now
            self.log.info("%s", self.line(now))

    def line(self, now: Optional[float] = None) -> str:
        elapsed = max(1e-9, (self.clock() if now is None else now) - self.t0)
        rate = self.bytes / elapsed
        left = (self.total_bytes - self.bytes) / rate if rate > 0 and self.total_bytes > self.bytes else 0.0
        disk = self.disk_written() - self.disk0 if self.disk_written is not None else 0
        return (f"{self.what}: {self.modules}/{self.total_modules} modules, {format_size(self.bytes)} of "
                f"{format_size(self.total_bytes)} ({format_size(rate)}/s)"
                + (f", {format_size(disk)} written to disk ({format_size(disk / elapsed)}/s)" if disk > 0 else "")
                + f", {_duration(elapsed)} so far, about {_duration(left)} left")


def _duration(seconds: float) -> str:
    s = int(round(seconds))
    return f"{s // 3600}h{s % 3600 // 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s" if s >= 60 else f"{s}s"
