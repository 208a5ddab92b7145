"""LoRA adapters through PEFT, the ecosystem's adapter library: a PEFT model built over a
checkpoint's base weights without materialising them, and the names and merge rule the export
uses. ``peft`` is imported only here and only when adapters are asked for.

``build_peft_model`` builds the base architecture on the meta device (``pretrained.build_empty_model``)
and lets PEFT wrap it (``get_peft_model``, or an existing adapter's ``adapter_config.json``). PEFT
moves each new adapter to its base layer's device, which is meta here, so its initial values are
lost; they are made again on the CPU exactly as PEFT's ``LoraLayer.update_layer`` made them, from
the random state PEFT started from (the same draws in the same order: under the same seed the
adapters equal PEFT's on a real base). The base weights are then streamed from the checkpoint by
the engine's ``WeightLoader``, built on the unwrapped base (whose parameters PEFT keeps).
"""
from __future__ import annotations

import os
from typing import Any, Container, Optional, Sequence, Union

import torch
from torch import nn

PEFT_PREFIX = "base_model.model."  # what a PeftModel's state dict puts before the base model's names
ADAPTER_CONFIG = "adapter_config.json"
LORA_INITS = (True, False, "gaussian")  # initialisations that do not read the base weights


class AdapterError(ValueError):
    """A LoRA setup pyinfinity cannot train or export (the message says which part and why)."""


def require_peft() -> Any:
    """The ``peft`` module, or a one-line ImportError saying how to get it."""
    try:
        import peft
    except ImportError:
        raise ImportError("LoRA adapters need the peft package (pip install peft)") from None
    return peft


def is_peft_model(model: nn.Module) -> bool:
    """Whether ``model`` is a PEFT model (checked by its class's package: peft is not imported)."""
    return type(model).__module__.split(".")[0] == "peft" and hasattr(model, "peft_config")


def lora_layers(model: nn.Module) -> dict[str, nn.Module]:
    """The LoRA layers of a PEFT model by qualified name, in module order."""
    peft = require_peft()
    return {name: m for name, m in model.named_modules() if isinstance(m, peft.tuners.lora.LoraLayer)}


def check_lora_config(cfg: Any, what: str) -> None:
    """Refuses a PEFT config pyinfinity does not handle: non-LoRA methods, DoRA, LoRA biases and
    PEFT's trainable token rows (``trainable_token_indices``). ``modules_to_save`` (whole modules
    trained as copies of the base's) is handled."""
    peft = require_peft()
    if cfg.peft_type != peft.PeftType.LORA:
        raise AdapterError(f"{what}: {cfg.peft_type.value}; pyinfinity handles LoRA adapters only")
    if getattr(cfg, "use_dora", False):
        raise AdapterError(f"{what}: DoRA (use_dora=True) is not handled by pyinfinity")
    if getattr(cfg, "lora_bias", False):
        raise AdapterError(f"{what}: lora_bias=True is not handled by pyinfinity")
    if getattr(cfg, "trainable_token_indices", None):
        raise AdapterError(f"{what}: trains rows of the embedding (trainable_token_indices), which pyinfinity does "
                           "not handle")


def check_lora(model: nn.Module, what: str) -> None:
    """Refuses a PEFT model pyinfinity does not handle: each adapter's config (``check_lora_config``)
    and LoRA on layers other than Linear/Conv1D."""
    peft = require_peft()
    for name, cfg in model.peft_config.items():
        check_lora_config(cfg, f"{what}: adapter {name!r}")
    for lname, layer in lora_layers(model).items():
        if type(layer) is not peft.tuners.lora.Linear:
            raise AdapterError(f"{what}: {lname} is a LoRA {type(layer).__name__}; pyinfinity handles LoRA on "
                               "Linear (and GPT-2's Conv1D) layers only")


def saved_copies(model: nn.Module) -> list[tuple[str, nn.Parameter, nn.Parameter]]:
    """``modules_to_save``: every parameter of the trained copies PEFT made of whole modules, as
    (adapter name, the copy's parameter, the original's parameter it copies)."""
    from peft.utils.other import ModulesToSaveWrapper

    out = []
    for m in model.modules():
        if isinstance(m, ModulesToSaveWrapper):
            orig = dict(m.original_module.named_parameters())
            for name, copy in m.modules_to_save.items():
                out += [(name, p, orig[k]) for k, p in copy.named_parameters()]
    return out


def checkpoint_keys(base_model: nn.Module) -> dict[str, Optional[str]]:
    """The ``WeightLoader`` key map of a base model PEFT has wrapped (``PeftModel.get_base_model()``):
    each state-dict key -> the name the base checkpoint gives that tensor, or None for one it does
    not hold (a LoRA weight: it keeps its values). A LoRA layer's wrapped layer drops its
    ``base_layer`` from the name (``q_proj.base_layer.weight`` -> ``q_proj.weight``), a module
    PEFT trains a copy of (``modules_to_save``) its ``original_module``; a copy that has no values
    yet (meta) starts from the original's tensor, one that has keeps them."""
    from peft.tuners.tuners_utils import BaseTunerLayer
    from peft.utils.other import ModulesToSaveWrapper

    out: dict[str, Optional[str]] = {}

    def join(a: str, b: str) -> str:
        return f"{a}.{b}" if a else b

    def walk(module: nn.Module, key: str, base: Optional[str], copy: bool = False) -> None:
        tuner = isinstance(module, BaseTunerLayer)
        tensors = list(module._parameters.items()) + [(n, b) for n, b in module._buffers.items()
                                                      if n not in module._non_persistent_buffers_set]
        for name, t in tensors:
            if t is not None:
                has_values = copy and not t.is_meta
                out[join(key, name)] = None if tuner or base is None or has_values else join(base, name)
        for name, child in module._modules.items():
            if child is None:
                continue
            if isinstance(module, ModulesToSaveWrapper):
                if name == "original_module":
                    walk(child, join(key, name), base)
                elif name == "modules_to_save":
                    for aname, c in child._modules.items():
                        walk(c, join(join(key, name), aname), base, copy=True)
                continue
            keep = base is not None and (not tuner or name == "base_layer")
            walk(child, join(key, name), (base if tuner else join(base, name)) if keep else None, copy)

    walk(base_model, "", "")
    return {k: v for k, v in out.items() if k != v}


def check_adapters_materialized(model: nn.Module) -> None:
    """Refuses a PEFT model whose adapters are on the meta device (``get_peft_model`` over a base
    built under ``init_empty`` leaves them there): initialised by their layers' own initialiser
    they would not be PEFT's (B must start at zero)."""
    for name, p in model.named_parameters():
        if p.is_meta and any(part.startswith("lora_") for part in name.split(".")):
            raise AdapterError(f"model: adapter weight {name} is on the meta device (PEFT puts new adapters on "
                               "their base layer's device): build the model with pyinfinity.from_pretrained(DIR, "
                               "config, peft_config=...), which makes them as PEFT does")


# ------------------------------------------------------------------------------ building
def build_peft_model(path: Union[str, os.PathLike], config: Any, dtype: Optional[torch.dtype], *,
                     peft_config: Any = None, adapter: Union[str, os.PathLike, None] = None) -> tuple[nn.Module, Any]:
    """The PEFT model over the model directory ``path`` (base weights not materialised), with a new
    adapter from ``peft_config`` or the existing one in ``adapter`` (trainable, as
    ``PeftModel.from_pretrained(..., is_trainable=True)``); returns it and the ``WeightLoader`` that
    streams the base weights. ``dtype`` None: the base keeps the checkpoint's dtype (config.json's,
    fp32 when it names none), as it is frozen; the adapters are fp32, as PEFT makes them."""
    from pyinfinity.pretrained import WeightLoader, build_empty_model, checkpoint_dtype

    if (peft_config is None) == (adapter is None):
        raise ValueError("from_pretrained: give peft_config= (a new adapter) or adapter= (an adapter directory), not both")
    peft = require_peft()
    if adapter is not None:
        adapter = os.fspath(adapter)
        peft_config = _read_adapter_dir(adapter)
        peft_config.inference_mode = False
    elif not isinstance(peft_config, peft.PeftConfig):
        raise TypeError(f"peft_config: a peft.LoraConfig, got {type(peft_config).__name__}")
    check_lora_config(peft_config, "peft_config" if adapter is None else f"adapter {adapter}")
    base = build_empty_model(path, config, dtype if dtype is not None else checkpoint_dtype(path))
    loader = WeightLoader(path, base)  # checked against the base's own names, before anything is written
    model = get_peft_model(base, peft_config)
    if adapter is not None:
        _give_copies_storage(model)  # PEFT copied meta tensors: the adapter's values go here
        _load_adapter(model, adapter)
    else:
        for _, p, orig in saved_copies(model):  # a new copy starts from the tensor it copies, as PEFT's does
            loader.alias(p, orig)
    return model, loader


def get_peft_model(base: nn.Module, peft_config: Any) -> nn.Module:
    """``peft.get_peft_model(base, peft_config)`` for a base on the meta device (``init_empty``):
    PEFT leaves the new adapters on their base layers' device, meta; they are made again on the
    CPU as PEFT made them (``_init_adapters``). ``from_pretrained`` uses it before streaming the
    base from a checkpoint; a base without one (a benchmark's) is initialised by the engine."""
    peft = require_peft()
    check_lora_config(peft_config, "peft_config")
    if peft_config.init_lora_weights not in LORA_INITS:
        raise AdapterError(f"peft_config: init_lora_weights={peft_config.init_lora_weights!r} reads the base weights, "
                           f"which are not in memory here; use one of {list(LORA_INITS)}")
    check_lora_targets(base, peft_config.target_modules, "peft_config.target_modules (--lora-targets)")
    rng = torch.random.get_rng_state()
    model = peft.get_peft_model(base, peft_config)
    check_lora(model, "peft_config")
    _init_adapters(model, rng)
    return model


def check_lora_targets(base: nn.Module, targets: Any, what: str) -> None:
    """AdapterError naming the layers LoRA can adapt in ``base`` when a name of ``targets`` (a list
    of module names, matched as PEFT does: the whole name or its last dotted parts) matches none of
    them; PEFT's own message does not say which names there are. A regex string or "all-linear" is
    PEFT's to match."""
    if targets is None or isinstance(targets, str):
        return
    adaptable = (nn.Linear, nn.Embedding, nn.Conv1d, nn.Conv2d, nn.Conv3d)
    names = [n for n, m in base.named_modules() if n and (isinstance(m, adaptable) or type(m).__name__ == "Conv1D")]
    missing = [t for t in targets if not any(n == t or n.endswith("." + t) for n in names)]
    if missing:
        leaves = sorted({n.rsplit(".", 1)[-1] for n in names})
        raise AdapterError(f"{what}: {', '.join(missing)}: no such layer in "
                           f"{type(base).__name__}; the layers LoRA can adapt there: {', '.join(leaves)} "
                           "(or all-linear)")


def _give_copies_storage(model: nn.Module) -> None:
    """CPU storage for the trained copies (``modules_to_save``) still on the meta device."""
    from peft.utils.other import ModulesToSaveWrapper

    for m in model.modules():
        if isinstance(m, ModulesToSaveWrapper):
            for sub in m.modules_to_save.modules():
                for name, p in list(sub._parameters.items()):
                    if p is not None and p.is_meta:
                        sub._parameters[name] = nn.Parameter(torch.empty(p.shape, dtype=p.dtype),
                                                             requires_grad=p.requires_grad)


def init_new_adapters(model: nn.Module) -> None:
    """LoRA weights PEFT left on the meta device made on the CPU as PEFT makes them, drawing from
    the current random state: a base built under ``zero.Init`` on the DeepSpeed route, wrapped by
    PEFT (TRL's ``SFTTrainer(model=DIR, peft_config=...)``) before pyinfinity sees the model."""
    if any(ab[name].weight.is_meta for layer in lora_layers(model).values() for ab in (layer.lora_A, layer.lora_B)
           for name in ab.keys()):
        _init_adapters(model, torch.random.get_rng_state(), replay_check=False)


def _init_adapters(model: nn.Module, rng: torch.Tensor, replay_check: bool = True) -> None:
    """Makes the LoRA weights again on the CPU, drawing from ``rng`` what PEFT drew from it:
    ``nn.Linear(in, r)`` and ``nn.Linear(r, out)`` built, then ``reset_lora_parameters``, layer by
    layer in module order; cast through the base layer's dtype to the dtype PEFT left them in.
    ``replay_check``: PEFT drew from ``rng`` before, and must have drawn as much as the replay."""
    after = torch.random.get_rng_state()
    torch.random.set_rng_state(rng)
    replayed = None
    try:
        for layer in lora_layers(model).values():
            for name in list(layer.lora_A.keys()):
                old = {"A": layer.lora_A[name].weight, "B": layer.lora_B[name].weight}
                base_dtype = layer.get_base_layer().weight.dtype
                a = nn.Linear(layer.in_features, layer.r[name], bias=False)
                b = nn.Linear(layer.r[name], layer.out_features, bias=False)
                layer.lora_A[name], layer.lora_B[name] = a, b
                layer.reset_lora_parameters(name, model.peft_config[name].init_lora_weights)
                for mod, key in ((a, "A"), (b, "B")):
                    w = mod.weight.detach().to(base_dtype).to(old[key].dtype)
                    mod.weight = nn.Parameter(w, requires_grad=old[key].requires_grad)
        replayed = torch.random.get_rng_state()
    finally:
        torch.random.set_rng_state(after)
    if replay_check and not torch.equal(replayed, after):  # PEFT drew more or less than replayed: the values would differ
        raise AdapterError("peft_config: PEFT initialised the adapters differently than pyinfinity replays it "
                           f"(peft {require_peft().__version__}); this version is not supported")


ADAPTER_WEIGHTS = ("adapter_model.safetensors", "adapter_model.bin")  # what PEFT saves, the first preferred


def _read_adapter_dir(adapter: str) -> Any:
    """The ``PeftConfig`` of an adapter directory, checked with its weights file before anything is
    built: a missing or torn file is an AdapterError naming it (PEFT would take a local directory
    without weights for a Hub repository name, and report a torn file without its path)."""
    import errno
    import json

    from pyinfinity.pretrained import WeightsError, read_header

    cfg_path = os.path.join(adapter, ADAPTER_CONFIG)
    if not os.path.isfile(cfg_path):
        raise FileNotFoundError(errno.ENOENT, f"adapter: no {ADAPTER_CONFIG} in {adapter} (save one with "
                                "PeftModel.save_pretrained(DIR) or engine.export(DIR))", cfg_path)
    try:
        with open(cfg_path) as f:
            raw = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise AdapterError(f"adapter {cfg_path}: not valid JSON ({exc}): torn or not a PEFT adapter config") from None
    if not isinstance(raw, dict) or "peft_type" not in raw:
        raise AdapterError(f"adapter {cfg_path}: not a PEFT adapter config (no peft_type)")
    weights = [os.path.join(adapter, n) for n in ADAPTER_WEIGHTS if os.path.isfile(os.path.join(adapter, n))]
    if not weights:
        raise AdapterError(f"adapter {adapter}: no {' or '.join(ADAPTER_WEIGHTS)}: the adapter's weights are missing "
                           "(copy the whole directory PeftModel.save_pretrained or engine.export wrote)")
    if weights[0].endswith(".safetensors"):
        try:
            read_header(weights[0])  # the whole header: dtypes, shapes, offsets, file length
        except WeightsError as exc:
            raise AdapterError(f"adapter {exc}") from None
    try:
        return require_peft().PeftConfig.from_pretrained(adapter)
    except (ValueError, TypeError, KeyError, OSError) as exc:
        raise AdapterError(f"adapter {cfg_path}: PEFT cannot read it ({exc})") from exc


def _load_adapter(model: nn.Module, adapter: str) -> None:
    """Loads an adapter directory's weights into ``model``'s (CPU) LoRA weights, every one checked."""
    peft = require_peft()
    from peft.utils import load_peft_weights

    try:
        weights = load_peft_weights(adapter, device="cpu")
    except Exception as exc:  # noqa: BLE001 - the file's own errors (safetensors, torch) carry no path
        raise AdapterError(f"adapter {adapter}: its weights cannot be read ({type(exc).__name__}: {exc})") from exc
    try:
        result = peft.set_peft_model_state_dict(model, weights, adapter_name="default")
    except RuntimeError as exc:  # load_state_dict's shape mismatches, one per line
        first = str(exc).strip().splitlines()[-1].strip()
        raise AdapterError(f"adapter {adapter}: its weights do not fit this model ({first}): it was trained on "
                           "another architecture or size") from exc
    unexpected = [k for k in result.unexpected_keys if "lora_" in k or ".modules_to_save." in k]
    missing = [k for k in result.missing_keys if "lora_" in k or ".modules_to_save." in k]
    if unexpected or missing:
        raise AdapterError(f"adapter {adapter}: its weights do not fit this model "
                           f"({len(missing)} missing, e.g. {missing[:1]}; {len(unexpected)} unexpected, e.g. "
                           f"{unexpected[:1]}): it was trained on another architecture or with other target modules")


# ------------------------------------------------------------------------------ export
def merged_key(key: str, active: Sequence[str] = ("default",), replaced: Container[str] = ()) -> Optional[str]:
    """The base model's name for a PEFT state-dict key, or None for what the merged model does
    not hold: an adapter weight (merged into its base layer's weight instead), a trained copy
    (``modules_to_save``) of an adapter not in ``active``, and an original module's tensor whose
    active copy replaces it (``replaced``: those keys, ``replaced_originals``)."""
    if not key.startswith(PEFT_PREFIX):
        raise AdapterError(f"export: {key!r} is not a PEFT model's key (no {PEFT_PREFIX!r} prefix)")
    if key in replaced:
        return None
    key = key[len(PEFT_PREFIX):]
    parts = key.split(".")
    if any(part.startswith("lora_") for part in parts):
        return None
    if "modules_to_save" in parts:
        i = parts.index("modules_to_save")
        if i + 1 >= len(parts) or parts[i + 1] not in active:
            return None
        parts = parts[:i] + parts[i + 2:]
    return ".".join(p for p in parts if p not in ("base_layer", "original_module"))


def replaced_originals(model: nn.Module) -> set[str]:
    """The PEFT state-dict keys of the original modules whose trained copy (``modules_to_save``)
    of an active adapter replaces them in a merged model, as ``merge_and_unload`` replaces them."""
    from peft.utils.other import ModulesToSaveWrapper

    out = set()
    for name, m in model.named_modules():
        if isinstance(m, ModulesToSaveWrapper) and any(a in m.modules_to_save for a in m.active_adapters):
            orig = m.original_module
            keys = [k for k, _ in orig.named_parameters()] + [k for k, _ in orig.named_buffers()]
            out |= {f"{name}.original_module.{k}" for k in keys}
    return out


def lora_owner(key: str) -> Optional[str]:
    """The LoRA layer (qualified name in the PEFT model) whose base weight ``key`` is, else None."""
    head, sep, tail = key.rpartition(".base_layer.")
    return head if sep and tail == "weight" else None


def merge_weight(model: nn.Module, layer_name: str, weight: torch.Tensor,
                 adapters: dict[str, torch.Tensor]) -> torch.Tensor:
    """``weight`` (the base layer's, any dtype) plus ``scaling * B @ A`` of every active adapter of
    LoRA layer ``layer_name``, computed in fp32 from the adapters' trained values (``adapters``:
    PEFT state-dict key -> tensor), cast back to ``weight``'s dtype."""
    layer = model.get_submodule(layer_name)
    out = weight.to(torch.float32)
    for name in layer.active_adapters:
        if name not in layer.lora_A:
            continue
        a = adapters[f"{layer_name}.lora_A.{name}.weight"].to(torch.float32)
        b = adapters[f"{layer_name}.lora_B.{name}.weight"].to(torch.float32)
        delta = (b @ a) * layer.scaling[name]
        out += delta.T if layer.fan_in_fan_out else delta
    return out.to(weight.dtype)


# the fields of a LoRA config that change what trains: a checkpoint records them, a resume under
# others is refused (r and the targets change the shards too; alpha, dropout and rslora only the result)
TRAINING_FIELDS = ("r", "lora_alpha", "lora_dropout", "use_rslora", "target_modules", "exclude_modules",
                   "rank_pattern", "alpha_pattern", "layers_to_transform", "layers_pattern", "fan_in_fan_out", "bias",
                   "modules_to_save")


def training_identity(model: nn.Module) -> dict[str, dict]:
    """Each adapter's ``TRAINING_FIELDS``, JSON-ready (sets sorted), by adapter name."""
    out = {}
    for name, cfg in model.peft_config.items():
        d = {}
        for key in TRAINING_FIELDS:
            v = getattr(cfg, key, None)
            d[key] = sorted(v) if isinstance(v, (set, frozenset)) else list(v) if isinstance(v, tuple) else v
        out[name] = d
    return out


def base_config(model: nn.Module) -> Any:
    """The transformers config of a PEFT model's base model (or None)."""
    return getattr(model.get_base_model(), "config", None)


__all__ = ["AdapterError", "require_peft", "is_peft_model", "lora_layers", "check_lora_config", "check_lora",
           "init_new_adapters", "check_lora_targets",
           "check_adapters_materialized", "checkpoint_keys", "saved_copies", "replaced_originals",
           "build_peft_model", "get_peft_model",
           "merged_key", "lora_owner", "merge_weight", "base_config", "training_identity", "PEFT_PREFIX",
           "ADAPTER_CONFIG", "TRAINING_FIELDS"]
