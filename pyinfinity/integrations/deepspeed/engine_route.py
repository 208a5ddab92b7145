"""pyinfinity's own engine behind ``deepspeed.initialize``: the route Hugging Face Trainer, TRL and
Accelerate take when their DeepSpeed config has a ``"pyinfinity"`` section.

Those libraries reach DeepSpeed through ``Accelerator._prepare_deepspeed``, which looks
``deepspeed.initialize`` up when it runs and has no slot for another engine. ``import pyinfinity``
therefore asks (``pyinfinity.post_import``) for :func:`install_route` to run the moment
``deepspeed`` is imported: it replaces ``deepspeed.initialize`` by :func:`initialize`, which hands a
config without the section to DeepSpeed's own and otherwise builds pyinfinity's ``Engine`` behind
the facade of ``engine_facade`` (what Trainer and Accelerate call on DeepSpeed's engine).
``deepspeed.zero.GatheredParameters`` gets a stand-in the same way (``gathered``): a library that
reads an engine's parameter outside its module's forward (TRL's fused LM-head loss) has it made
resident through the engine's coordinator. ``deepspeed.zero.Init`` too (``zero_init``):
transformers' ZeRO-3 ``from_pretrained`` then builds the model on the meta device, and the engine
streams the checkpoint into its tiers module by module, never holding the whole model.

Accelerate is patched when ``accelerate.accelerator`` is imported, for a config with the section
only: an optimizer offloaded with no ``"optimizer"`` section makes it replace the user's torch
optimizer by DeepSpeed's CPU Adam (a C++ build of minutes) before ``initialize``, and the keys it
derives from the hidden size would override the planner's ``"auto"``; both are left alone then.

What pyinfinity's engine does not do is refused with one line naming the key and what to do
instead (:func:`check_supported`); nothing falls back to DeepSpeed's engine silently. The library
versions these paths were tested with are :data:`KNOWN_SERIES`; others are refused unless
``PYINFINITY_HF_UNTESTED=1`` (then a warning)."""
from __future__ import annotations

import functools
import inspect
import json
import logging
import sys
import types
from typing import Any, Callable, Optional, Tuple

from pyinfinity.integrations.deepspeed.patching import MARK
from pyinfinity.integrations.deepspeed.route_checks import (PLANNED_KEYS, SECTION, check_supported, check_versions,
                                                            has_section, load_dict, optimizer_section, refuse)

log = logging.getLogger(__name__)

_original_initialize: Optional[Callable[..., Any]] = None
#: zero_optimization keys whose "auto" pyinfinity's planner decides (other "auto" values left by the libraries
#: are dropped: pyinfinity's defaults apply)
PLANNED_ZERO_KEYS = ("stage3_prefetch_bucket_size", "stage3_max_live_parameters", "stage3_param_persistence_threshold")


def engine_config(config: dict, optimizer: Any) -> dict:
    """The config pyinfinity's engine is built with: DeepSpeed's, its optimizer section from the
    torch optimizer handed over, and the "auto" values Accelerate could not fill left to the planner."""
    cfg = json.loads(json.dumps(config))
    if optimizer is not None:
        if "optimizer" in cfg:
            raise refuse("optimizer", "given both in the config and as an object", "remove one of them")
        cfg["optimizer"] = optimizer_section(optimizer)
    z = cfg.get("zero_optimization") or {}
    # keys Trainer and Accelerate add that only DeepSpeed's engine reads (the facade reads the gather switch)
    for key in ("steps_per_print", "zero_allow_untested_optimizer", "zero_force_ds_cpu_optimizer"):
        cfg.pop(key, None)
    for key in ("stage3_gather_16bit_weights_on_model_save", "gather_16bit_weights_on_model_save"):
        z.pop(key, None)
    for key in [k for k, v in z.items() if v == "auto" and k not in PLANNED_ZERO_KEYS]:
        del z[key]  # pyinfinity's defaults decide them
    for key in [k for k, v in cfg.items() if v == "auto"]:
        del cfg[key]
    for key in ("fp16", "bf16"):
        if isinstance(cfg.get(key), dict) and cfg[key].get("enabled") == "auto":
            cfg[key]["enabled"] = False
    return cfg


def initialize(*args: Any, **kwargs: Any) -> Tuple[Any, Any, Any, Any]:
    """``deepspeed.initialize``: DeepSpeed's own for a config without a ``"pyinfinity"`` section,
    else pyinfinity's engine behind ``engine_facade.DeepSpeedFacade``: (engine, optimizer, None,
    lr_scheduler)."""
    assert _original_initialize is not None
    bound = inspect.signature(_original_initialize).bind(*args, **kwargs)
    bound.apply_defaults()
    a = bound.arguments
    config = a.get("config") if a.get("config") is not None else a.get("config_params")
    if config is None and a.get("args") is not None:
        config = getattr(a["args"], "deepspeed_config", None)
    config = load_dict(config)
    if not isinstance(config, dict) or SECTION not in config:
        return _original_initialize(*args, **kwargs)
    check_versions()
    model = a.get("model")
    check_supported(config, model, a.get("mpu"), a.get("training_data"))
    optimizer = a.get("optimizer")
    if callable(optimizer) and not hasattr(optimizer, "param_groups"):
        raise refuse("optimizer", "a callable building the optimizer: pyinfinity's engine builds its own offloaded "
                      "Adam", "pass a torch.optim.AdamW or an \"optimizer\" section")
    from pyinfinity.integrations.deepspeed.engine_facade import build_facade
    from pyinfinity.integrations.deepspeed.zero_init import init_process_group

    init_process_group()

    facade = build_facade(model, config, engine_config(config, optimizer), optimizer=optimizer,
                          model_parameters=a.get("model_parameters"), lr_scheduler=a.get("lr_scheduler"))
    return facade, facade.optimizer, None, facade.lr_scheduler


def install_route(deepspeed: types.ModuleType) -> None:
    """Replaces ``deepspeed.initialize`` (and ``zero.Init`` / ``zero.GatheredParameters``) by
    pyinfinity's route; idempotent. Called by ``post_import`` once ``deepspeed`` is imported."""
    global _original_initialize
    current = getattr(deepspeed, "initialize")
    if getattr(current, MARK, False):
        return
    _original_initialize = current
    route = functools.wraps(current)(initialize)
    setattr(route, MARK, True)
    deepspeed.initialize = route
    from pyinfinity.integrations.deepspeed import gathered, zero_init

    gathered.install(deepspeed.zero)
    zero_init.install(deepspeed.zero)
    log.debug("pyinfinity: deepspeed.initialize routes a config with a %r section to pyinfinity's engine", SECTION)


def uninstall_route() -> None:
    """Puts DeepSpeed's own ``initialize`` (and zero.Init / GatheredParameters) back."""
    global _original_initialize
    ds = sys.modules.get("deepspeed")
    if ds is not None and _original_initialize is not None:
        ds.initialize = _original_initialize
        from pyinfinity.integrations.deepspeed import gathered, zero_init

        gathered.uninstall(ds.zero)
        zero_init.uninstall(ds.zero)
    _original_initialize = None


def _active_config() -> Optional[dict]:
    """The DeepSpeed config of Accelerate's active plugin, None without one."""
    try:
        from accelerate.state import AcceleratorState

        state = AcceleratorState()
        plugin = getattr(state, "deepspeed_plugin", None)
    except Exception:  # no state made yet, or not DeepSpeed
        return None
    return getattr(plugin, "deepspeed_config", None)


def patch_accelerate(accelerator: types.ModuleType) -> None:
    """Accelerate, for a config with the section: keeps the user's torch optimizer (no DeepSpeed
    CPU Adam built), and leaves the hidden-size keys' "auto" to pyinfinity's planner."""
    mapper = getattr(accelerator, "map_pytorch_optim_to_deepspeed", None)
    if mapper is not None and not getattr(mapper, MARK, False):
        @functools.wraps(mapper)
        def map_optimizer(optimizer: Any) -> Any:
            if has_section(_active_config()):
                return optimizer  # pyinfinity's engine takes its hyperparameters; DeepSpeed's CPU Adam is not built
            return mapper(optimizer)

        setattr(map_optimizer, MARK, True)
        accelerator.map_pytorch_optim_to_deepspeed = map_optimizer
    from accelerate.utils.dataclasses import DeepSpeedPlugin

    fill = DeepSpeedPlugin.fill_match
    if not getattr(fill, MARK, False):
        # every fill goes through here: the plugin's own (its offload devices, "none" unless set, in
        # __post_init__) and those of deepspeed_config_process (the model's hidden size)
        @functools.wraps(fill)
        def fill_match(self: Any, ds_key_long: str, mismatches: Any = None, must_match: bool = True,
                       **kw: Any) -> Any:
            if ds_key_long in PLANNED_KEYS and has_section(self.hf_ds_config.config):
                node, leaf = self.hf_ds_config.find_config_node(ds_key_long)
                if node is not None and node.get(leaf) == "auto":
                    return None  # an "auto" stays "auto": pyinfinity's planner decides it
            return fill(self, ds_key_long, mismatches, must_match=must_match, **kw)

        setattr(fill_match, MARK, True)
        DeepSpeedPlugin.fill_match = fill_match


def patch_trainer_config(deepspeed_integration: types.ModuleType) -> None:
    """transformers' Trainer, for a config with the section: the keys it would fill from the model's
    hidden size (``HfTrainerDeepSpeedConfig.trainer_config_finalize``) keep their "auto", which
    pyinfinity's planner decides (DeepSpeed's sizes for them starve pyinfinity's prefetch)."""
    cls = getattr(deepspeed_integration, "HfTrainerDeepSpeedConfig", None)
    finalize = getattr(cls, "trainer_config_finalize", None)
    if finalize is None or getattr(finalize, MARK, False):
        return

    @functools.wraps(finalize)
    def trainer_config_finalize(self: Any, *args: Any, **kwargs: Any) -> Any:
        if not has_section(self.config):
            return finalize(self, *args, **kwargs)
        kept = [key for key in PLANNED_KEYS if self.is_auto(key)]
        try:
            return finalize(self, *args, **kwargs)
        finally:
            for key in kept:
                node, leaf = self.find_config_node(key)
                if node is not None:
                    node[leaf] = "auto"

    setattr(trainer_config_finalize, MARK, True)
    cls.trainer_config_finalize = trainer_config_finalize


__all__ = ["initialize", "install_route", "uninstall_route", "patch_accelerate", "patch_trainer_config",
           "engine_config"]
