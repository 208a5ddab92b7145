"""What the planner knows about a model: its flat shards (bytes in the compute dtype, in the
order the engine partitions them), the working set of one block, the matmul FLOPs per token and
an activation estimate.

Sources: an ``nn.Module`` (real or built under ``pyinfinity.init_empty``: meta parameters have
shapes, which is all that is needed), or a transformers config (a ``config.json`` path or a dict),
built on the meta device so any architecture transformers knows is counted exactly; a Llama-style
analytic count is the fallback when transformers cannot build it.
"""
from __future__ import annotations

import json
import logging
import os
from typing import Any, Optional, Union

import torch
from torch import nn

from pyinfinity.layout.sizes import ModelSizes, parse_dtype

log = logging.getLogger(__name__)

# --------------------------------------------------------------------------- from a module


def _compute_itemsize(p: torch.Tensor, dtype: Optional[torch.dtype]) -> int:
    if dtype is not None and p.dtype.is_floating_point:
        return torch.empty((), dtype=dtype).element_size()
    return p.element_size()


def sizes_from_module(model: nn.Module, dtype: Optional[Union[str, torch.dtype]] = None,
                      unit_bytes: Optional[int] = None) -> ModelSizes:
    """Sizes of ``model`` as ``partition_model`` will cut it: one shard per unit (``pyinfinity.units``)
    and (dtype, requires_grad), tied parameters once. Meta parameters (``init_empty``) work: only
    shapes are read.

    dtype: the compute dtype (fp16/bf16 config); None keeps each parameter's dtype.
    unit_bytes: the unit cap the engine uses (None: the "auto" rule without a device budget).
    """
    from pyinfinity.units import auto_unit_bytes, own_bytes, unit_members, unit_roots

    dt = parse_dtype(dtype) if dtype is not None else None

    def isz_of(p: nn.Parameter) -> int:
        return _compute_itemsize(p, dt)

    own = own_bytes(model, isz_of)  # id(module) -> bytes of its own parameters
    if unit_bytes is None:
        unit_bytes = auto_unit_bytes(sum(own.values()), max(own.values(), default=0), None)
    roots = unit_roots(model, int(unit_bytes), isz_of)
    members = unit_members(model, roots)
    seen: set[int] = set()
    numels: list[int] = []
    trainable: list[bool] = []
    itemsizes: list[int] = []
    largest_param = max((p.numel() for p in model.parameters() if p.requires_grad), default=0)
    flops = 0.0
    act_width = 0
    for module in model.modules():
        w = getattr(module, "weight", None)
        if isinstance(module, nn.Linear) and w is not None:
            flops += 2.0 * w.numel()
            act_width += module.out_features
        elif isinstance(module, nn.modules.conv._ConvNd) and w is not None:
            flops += 2.0 * w.numel()  # per output position; a rough figure for conv nets
            act_width += module.out_channels
        if id(module) in members and members[id(module)] is not module:
            continue  # counted with its unit's root
        by_key: dict[tuple[int, bool], int] = {}
        for m in (module.modules() if id(module) in roots else [module]):
            for p in m.parameters(recurse=False):
                if id(p) in seen:
                    continue
                seen.add(id(p))
                key = (isz_of(p), bool(p.requires_grad))
                by_key[key] = by_key.get(key, 0) + p.numel()
        for (isz, req), n in by_key.items():
            if n:
                numels.append(n)
                trainable.append(req)
                itemsizes.append(isz)
    itemsize = max(itemsizes, default=4)
    mixed = len(set(itemsizes)) > 1
    if mixed:  # e.g. a frozen bf16 base with fp32 adapters: gradients and state are the trainable shards'
        itemsize = max((i for i, t in zip(itemsizes, trainable) if t), default=itemsize)
        by_size: dict[int, int] = {}
        for n, i in zip(numels, itemsizes):
            by_size[i] = by_size.get(i, 0) + n * i
        act_itemsize = max(by_size, key=by_size.__getitem__)  # the dtype of most of the model computes

    def subtree(m: nn.Module) -> int:
        return sum(own.get(id(x), 0) for x in m.modules())

    block = 0
    for m in model.modules():
        if isinstance(m, nn.ModuleList) and len(m) > 1:
            block = max(block, max(subtree(c) for c in m))
    largest = max((n * i for n, i in zip(numels, itemsizes)), default=0)
    block = max(block, largest)
    module_bytes = max((sum(p.numel() * isz_of(p) for p in m.parameters(recurse=False)) for m in model.modules()),
                       default=0)
    cfg = getattr(model, "config", None)
    floats = {p.dtype for p in model.parameters() if p.dtype.is_floating_point}
    s = ModelSizes(shard_numels=numels, shard_trainable=trainable, itemsize=itemsize, block_bytes=block,
                   flops_per_token=flops, act_width=act_width, source=type(model).__name__,
                   largest_param_numel=largest_param,
                   dtype=dt if dt is not None else (floats.pop() if len(floats) == 1 else None),
                   shard_itemsizes=itemsizes if mixed else [], act_itemsize=act_itemsize if mixed else 0,
                   largest_module_bytes=module_bytes)
    if cfg is not None and getattr(cfg, "hidden_size", None) and getattr(cfg, "num_hidden_layers", None):
        s.hidden = int(cfg.hidden_size)
        s.layers = int(cfg.num_hidden_layers)
        s.heads = int(getattr(cfg, "num_attention_heads", 0) or 0)
        s.vocab = int(getattr(cfg, "vocab_size", 0) or 0)
        s.intermediate = int(getattr(cfg, "intermediate_size", 0) or 0)
    return s


# --------------------------------------------------------------------------- from a transformers config


def load_model_config(config: Union[str, os.PathLike, dict]) -> dict:
    """A transformers config as a dict: given as one, or read from config.json (a path to it or to
    its model directory); ValueError naming the path when it cannot be read."""
    if isinstance(config, dict):
        return dict(config)
    path = os.fspath(config)
    if os.path.isdir(path):
        path = os.path.join(path, "config.json")
    try:
        with open(path) as f:
            return json.load(f)
    except OSError as exc:
        raise ValueError(f"model config {path!r}: cannot read it ({exc.strerror})") from exc
    except json.JSONDecodeError as exc:
        raise ValueError(f"model config {path!r}: not valid JSON ({exc})") from exc


def llama_sizes(d: dict, dtype: Union[str, torch.dtype] = "bf16") -> ModelSizes:
    """Analytic sizes of a Llama-style decoder (embedding, per layer q/k/v/o, gate/up/down and two
    RMSNorms, final norm, untied head unless ``tie_word_embeddings``), shards in module order."""
    h = int(d["hidden_size"])
    L = int(d["num_hidden_layers"])
    V = int(d.get("vocab_size", 32000))
    ff = int(d.get("intermediate_size", 4 * h))
    heads = int(d.get("num_attention_heads", max(1, h // 128)))
    kv = int(d.get("num_key_value_heads", heads) or heads)
    hd = int(d.get("head_dim", h // heads) or h // heads)
    bias = bool(d.get("attention_bias", False))
    tied = bool(d.get("tie_word_embeddings", False))
    layer = [h * heads * hd + (heads * hd if bias else 0), h * kv * hd + (kv * hd if bias else 0),
             h * kv * hd + (kv * hd if bias else 0), heads * hd * h + (h if bias else 0),
             h * ff, h * ff, ff * h, h, h]
    shards = [V * h] + [sum(layer)] * L + [h] + ([] if tied else [V * h])  # units: embedding, layers, norm, head
    isz = torch.empty((), dtype=parse_dtype(dtype)).element_size()
    mm = sum(layer[:7]) + V * h  # every layer's matmuls and the head
    return ModelSizes(shard_numels=shards, shard_trainable=[True] * len(shards), itemsize=isz,
                      block_bytes=sum(layer) * isz, flops_per_token=2.0 * (L * sum(layer[:7]) + V * h),
                      hidden=h, layers=L, heads=heads, vocab=V, intermediate=ff,
                      act_width=(heads * hd + 2 * kv * hd + h + 3 * ff) * L + V, source="llama (analytic)",
                      largest_param_numel=max(V * h, h * ff), dtype=parse_dtype(dtype))


def sizes_from_config(config: Union[str, os.PathLike, dict],
                      dtype: Union[str, torch.dtype] = "bf16", unit_bytes: Optional[int] = None) -> ModelSizes:
    """Sizes from a transformers config (path to config.json / a model directory / a dict): the
    model is built on the meta device (nothing allocated) so the count is exact, its units cut at
    ``unit_bytes`` (``sizes_from_module``); if transformers cannot build it, a Llama-style
    analytic count (a unit per decoder layer)."""
    d = load_model_config(config)
    try:
        import transformers

        mt = d.get("model_type", "llama")
        cfg = transformers.AutoConfig.for_model(mt, **{k: v for k, v in d.items() if k != "model_type"})
        with torch.device("meta"):
            model = transformers.AutoModelForCausalLM.from_config(cfg)
        s = sizes_from_module(model, dtype, unit_bytes)
        s.source = f"{type(model).__name__} (meta)"
        return s
    except Exception as exc:  # noqa: BLE001 - any failure to build falls back to the formula
        if "hidden_size" not in d or "num_hidden_layers" not in d:
            raise ValueError(f"model config: transformers could not build it ({exc}) and it has no "
                             "hidden_size/num_hidden_layers for the Llama formula") from exc
        log.info("transformers could not build the model (%s); counting it as a Llama decoder", exc)
        return llama_sizes(d, dtype)


def model_sizes(model: Any, dtype: Optional[Union[str, torch.dtype]] = None,
                unit_bytes: Optional[int] = None) -> ModelSizes:
    """ModelSizes from whatever is given: ModelSizes (returned), an nn.Module, a config dict/path."""
    if isinstance(model, ModelSizes):
        return model if dtype is None else model.with_dtype(dtype)
    if isinstance(model, nn.Module):
        return sizes_from_module(model, dtype, unit_bytes)
    return sizes_from_config(model, dtype or "bf16", unit_bytes)


__all__ = ["sizes_from_module", "sizes_from_config", "llama_sizes", "model_sizes", "load_model_config"]
