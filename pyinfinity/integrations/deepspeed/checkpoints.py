"""A second ``save_checkpoint`` of one tag made harmless: DeepSpeed 0.19's engine copies the NVMe
optimizer swap folder into ``<save_dir>/<tag>/offloaded_tensors/rank<N>`` with
``copytree(..., dirs_exist_ok=False)``, so saving the same tag twice raises ``FileExistsError``.
Hugging Face Trainer does exactly that at every checkpoint when
``stage3_gather_16bit_weights_on_model_save`` is false (``save_model`` falls back to a full
``save_checkpoint``, then ``_save_optimizer_and_scheduler`` calls it again into the same folder).
The patch removes this rank's earlier copy of the tag before the engine copies it again: the save
rewrites every other file of the tag anyway, so the second copy replaces the first as those do."""
from __future__ import annotations

import logging
import os
import shutil
import threading
from typing import Any, Optional

from pyinfinity.integrations.deepspeed.patching import install_method, original, restore, saved_method

log = logging.getLogger(__name__)

_lock = threading.Lock()
_saved: Optional[tuple[type, Any]] = None  # (DeepSpeedEngine, its own save_checkpoint or MISSING)


def offloaded_copy(engine: Any, save_dir: str, tag: Optional[Any]) -> Optional[str]:
    """The folder DeepSpeed's ``save_checkpoint(save_dir, tag)`` copies this rank's NVMe optimizer
    state into (None when the optimizer state is not on NVMe): the path its own code builds."""
    if not engine.zero_nvme_offload_optimizer():
        return None
    from deepspeed.checkpoint.ds_to_universal import dp_index_to_str  # how the engine names the rank folder

    rank = engine.local_rank if engine.use_node_local_storage() else engine.global_rank
    tag = f"global_step{engine.global_steps}" if tag is None else str(tag)
    return os.path.join(save_dir, tag, "offloaded_tensors", "rank" + dp_index_to_str(rank))


def patch_save_checkpoint() -> None:
    """Wraps ``DeepSpeedEngine.save_checkpoint`` (idempotent; imports deepspeed)."""
    global _saved
    with _lock:
        if _saved is not None:
            return
        from deepspeed.runtime.engine import DeepSpeedEngine

        own = saved_method(DeepSpeedEngine, "save_checkpoint")
        orig = original(DeepSpeedEngine, "save_checkpoint", own)

        def save_checkpoint(self: Any, save_dir: str, tag: Any = None, *args: Any, **kwargs: Any) -> Any:
            copy = offloaded_copy(self, save_dir, tag) if save_dir else None
            if copy is not None and os.path.isdir(copy):
                log.info("pyinfinity: %s was saved before in this folder; its NVMe optimizer copy is replaced", copy)
                shutil.rmtree(copy)
            return orig(self, save_dir, tag, *args, **kwargs)

        save_checkpoint.__doc__ = orig.__doc__
        install_method(DeepSpeedEngine, "save_checkpoint", save_checkpoint)
        _saved = (DeepSpeedEngine, own)


def unpatch_save_checkpoint() -> None:
    global _saved
    with _lock:
        if _saved is not None:
            restore(_saved[0], "save_checkpoint", _saved[1])
            _saved = None


__all__ = ["patch_save_checkpoint", "unpatch_save_checkpoint", "offloaded_copy"]
