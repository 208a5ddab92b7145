"""pyinfinity: train models far larger than one GPU's memory by streaming ZeRO-3 shards from
pinned host memory and NVMe (see ARCHITECTURE.md)."""
from __future__ import annotations

import logging

__version__ = "0.1.0"

logging.getLogger(__name__).addHandler(logging.NullHandler())


def __getattr__(name: str):
    # Lazy so that `import pyinfinity` stays cheap and the I/O layer is usable without the engine.
    if name in ("initialize", "init_empty", "Engine"):
        from pyinfinity import engine

        return getattr(engine, name)
    if name == "from_pretrained":
        from pyinfinity import pretrained

        return pretrained.from_pretrained
    raise AttributeError(f"module 'pyinfinity' has no attribute {name!r}")
