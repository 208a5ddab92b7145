"""pyinfinity: train models far larger than one GPU's memory by streaming ZeRO-3 shards from
pinned host memory and NVMe. The design: docs/architecture.md in the repository."""
from __future__ import annotations

import logging
import sys

__version__ = "0.1.0"


class _UnconfiguredWarnings(logging.StreamHandler):
    """pyinfinity's records to stderr while the application has configured no logging (the root
    logger has no handler), like ``logging.lastResort``; once it has, records go its way only. What
    passes is the ``pyinfinity`` logger's level: WARNING and above by default (the root's), INFO from
    the first engine on (``telemetry.default_logging``: the plan, progress and step lines)."""

    def __init__(self) -> None:
        super().__init__()
        self.setFormatter(logging.Formatter("pyinfinity %(levelname)s: %(message)s"))

    def emit(self, record: logging.LogRecord) -> None:
        if not logging.getLogger().handlers:
            self.stream = sys.stderr  # the current one (pytest and others replace it after import)
            super().emit(record)


logging.getLogger(__name__).addHandler(_UnconfiguredWarnings())


def __getattr__(name: str):
    # Lazy so that `import pyinfinity` stays cheap and the I/O layer is usable without the engine.
    if name in ("initialize", "from_pretrained", "Engine"):
        from pyinfinity import engine

        return getattr(engine, name)
    if name == "init_empty":
        from pyinfinity.zero.partition import init_empty

        return init_empty
    if name == "DeviceBudgetExceeded":
        from pyinfinity.zero.budget import DeviceBudgetExceeded

        return DeviceBudgetExceeded
    raise AttributeError(f"module 'pyinfinity' has no attribute {name!r}")
