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


# Hugging Face Trainer, TRL and Accelerate reach an engine through `deepspeed.initialize`: once DeepSpeed
# (and Accelerate) are imported, a config with a "pyinfinity" section is routed to pyinfinity's engine
# (integrations/deepspeed/engine_route.py). Only a finder is registered here: nothing is imported now.
from pyinfinity import post_import as _post_import  # noqa: E402

_post_import.when_imported("deepspeed", "pyinfinity.integrations.deepspeed.engine_route:install_route")
_post_import.when_imported("accelerate.accelerator", "pyinfinity.integrations.deepspeed.engine_route:patch_accelerate")
_post_import.when_imported("transformers.integrations.deepspeed",
                           "pyinfinity.integrations.deepspeed.engine_route:patch_trainer_config")
_post_import.when_imported("trl.trainer.utils", "pyinfinity.integrations.deepspeed.gathered:patch_trl")
_post_import.when_imported("transformers.modeling_utils", "pyinfinity.integrations.deepspeed.zero_init:patch_transformers")
