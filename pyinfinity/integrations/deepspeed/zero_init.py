"""``deepspeed.zero.Init`` for a config with a ``"pyinfinity"`` section: a model larger than host
RAM is built and loaded through transformers' ZeRO-3 path without being materialised.

transformers builds the model under ``zero.Init(config_dict_or_path=...)`` when a DeepSpeed
ZeRO-3 config is active (``TrainingArguments(deepspeed=...)`` before ``from_pretrained``), then
copies each module's checkpoint values into it through ``GatheredParameters(..., modifier_rank=0)``.
On pyinfinity's route:

- :class:`Init` builds the model as ``pyinfinity.init_empty`` does: every parameter on the meta
  device as it is registered (no storage; buffers real);
- transformers' ``load_state_dict`` reads the checkpoint as meta tensors (names, shapes, dtypes)
  while the active config has the section: the values are not needed yet (and a meta model's
  hub kernels are chosen for the device the engine computes on);
- ``GatheredParameters`` over meta parameters is empty (``gathered``), so the copies and the
  initialisation of missing keys touch no memory;
- ``deepspeed.initialize`` then builds the engine with the model directory ``from_pretrained`` read
  (``config._name_or_path``) as its weights: ``pretrained.WeightLoader`` streams them module by
  module into the tiers (RAM, NVMe), the same path ``pyinfinity.from_pretrained`` takes, and
  initialises what the checkpoint does not hold.

A config without the section gets DeepSpeed's own ``Init``."""
from __future__ import annotations

import functools
import logging
import os
from typing import Any, Optional

from pyinfinity.integrations.deepspeed.route_checks import has_section, load_dict, refuse

log = logging.getLogger(__name__)

_original: Any = None  # DeepSpeed's zero.Init


class Init:
    """DeepSpeed's ``zero.Init`` signature; with a "pyinfinity" section in the config, parameters
    are created on the meta device (``pyinfinity.init_empty``)."""

    def __new__(cls, module: Any = None, *args: Any, config_dict_or_path: Any = None, config: Any = None,
                enabled: bool = True, **kwargs: Any) -> Any:
        cfg = load_dict(config_dict_or_path if config_dict_or_path is not None else config)
        if not has_section(cfg):
            return _original(module, *args, config_dict_or_path=config_dict_or_path, config=config, enabled=enabled,
                             **kwargs)
        if module is not None:
            raise refuse("zero.Init(module=...)", "partitioning a model built already is done by deepspeed.initialize "
                         "on pyinfinity's route", "pass the model to deepspeed.initialize (Trainer does)")
        self = super().__new__(cls)
        self._enabled = enabled
        self._ctx: Any = None
        return self

    def __enter__(self) -> "Init":
        if self._enabled:
            from pyinfinity.zero.partition import init_empty

            init_process_group()  # transformers' ZeRO-3 load asks torch.distributed for the rank
            self._ctx = init_empty()
            self._ctx.__enter__()
        return self

    def __exit__(self, *exc: Any) -> Any:
        if self._ctx is not None:
            ctx, self._ctx = self._ctx, None
            return ctx.__exit__(*exc)
        return None


def init_process_group() -> None:
    """A process group of one, as DeepSpeed's initialize makes (Trainer gathers its logged losses
    through it): in memory (no port, no launcher's environment needed), then DeepSpeed's comm over it."""
    import torch
    import torch.distributed as dist
    from deepspeed import comm

    if not dist.is_initialized():
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    comm.init_distributed(dist_backend=dist.get_backend(), dist_init_required=False)


def _active_section() -> bool:
    """Whether transformers' active DeepSpeed config (HfDeepSpeedConfig) has the section."""
    try:
        from transformers.integrations.deepspeed import deepspeed_config
    except ImportError:
        return False
    return has_section(deepspeed_config())


def patch_transformers(modeling_utils: Any) -> None:
    """transformers' ``load_state_dict`` reads meta tensors (names, shapes, dtypes) while the active
    DeepSpeed config has the section (the engine reads the values at ``initialize``)."""
    original = getattr(modeling_utils, "load_state_dict", None)
    if original is None or getattr(original, "__pyinfinity_patch__", False):
        return

    @functools.wraps(original)
    def load_state_dict(checkpoint_file: Any, map_location: Any = "cpu", *args: Any, **kwargs: Any) -> Any:
        if _active_section():
            map_location = "meta"
        return original(checkpoint_file, map_location, *args, **kwargs)

    load_state_dict.__pyinfinity_patch__ = True  # type: ignore[attr-defined]
    modeling_utils.load_state_dict = load_state_dict
    model_cls = modeling_utils.PreTrainedModel
    set_use_kernels = model_cls.set_use_kernels

    @functools.wraps(set_use_kernels)
    def set_use_kernels_on_device(self: Any, *args: Any, **kwargs: Any) -> Any:
        # a meta model's layers run where the engine runs: the kernels are chosen for that device
        if getattr(self, "_kernels_device", None) is None and _active_section() and any(
                p.is_meta for p in self.parameters()):
            import torch

            self._kernels_device = "cuda" if torch.cuda.is_available() else "cpu"
        return set_use_kernels(self, *args, **kwargs)

    set_use_kernels_on_device.__pyinfinity_patch__ = True  # type: ignore[attr-defined]
    model_cls.set_use_kernels = set_use_kernels_on_device


def weights_source(model: Any) -> Optional[str]:
    """The model directory the engine reads a meta model's values from (None when no parameter is
    on the meta device): the one ``from_pretrained`` read, as its config records it."""
    if not any(p.is_meta for p in model.parameters()):
        return None
    from pyinfinity import adapters

    base = model.get_base_model() if adapters.is_peft_model(model) else model
    path = getattr(getattr(base, "config", None), "_name_or_path", None)
    if not path or not os.path.isdir(path):
        raise refuse("model", f"its parameters are on the meta device (built under zero.Init) and its checkpoint "
                     f"{path!r} is not a local model directory", "download it (huggingface-cli download) and "
                     "pass the directory to from_pretrained")
    return os.path.abspath(path)


def install(zero: Any) -> None:
    global _original
    if zero.Init is not Init:
        _original = zero.Init
        zero.Init = Init


def uninstall(zero: Any) -> None:
    global _original
    if _original is not None:
        zero.Init = _original
        _original = None


__all__ = ["Init", "install", "uninstall", "patch_transformers", "weights_source", "init_process_group"]
