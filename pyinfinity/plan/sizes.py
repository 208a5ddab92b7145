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
from dataclasses import dataclass, field
from typing import Any, Optional, Union

import torch
from torch import nn

log = logging.getLogger(__name__)

SMALL_SHARD_NUMEL = 100_000
"""DeepSpeed's default ``stage3_param_persistence_threshold``: shards this small may stay resident."""

_DTYPES = {"fp32": torch.float32, "float32": torch.float32, "bf16": torch.bfloat16,
           "bfloat16": torch.bfloat16, "fp16": torch.float16, "float16": torch.float16}


def parse_dtype(dtype: Union[str, torch.dtype]) -> torch.dtype:
    """``"bf16"``/``"fp16"``/``"fp32"`` (or a torch dtype) -> torch dtype."""
    if isinstance(dtype, torch.dtype):
        return dtype
    try:
        return _DTYPES[str(dtype).lower()]
    except KeyError:
        raise ValueError(f"dtype: expected one of {', '.join(sorted(_DTYPES))}, got {dtype!r}") from None


@dataclass
class ModelSizes:
    """Parameter sizes of one model as the engine will partition it.

    shard_numels: elements of each flat shard (one per module and dtype, creation order);
    shard_trainable: whether each shard gets optimizer state. itemsize: bytes per element in the
    compute dtype (of the trainable shards, where dtypes are mixed: their gradients and device
    state); shard_itemsizes: each shard's own when they differ (a LoRA run's bf16 frozen base and
    fp32 adapters; empty: every shard ``itemsize``); act_itemsize: bytes per activation element
    (0: ``itemsize``; the base's dtype in a LoRA run). block_bytes: the parameter bytes of the
    largest repeated block (a decoder layer), the working set the coordinator holds during that
    block's backward.
    flops_per_token: forward matmul FLOPs per token, without attention scores (2 x the weights of
    every matmul). Transformer fields (hidden, layers, heads, vocab) are 0 when unknown.
    """

    shard_numels: list[int]
    shard_trainable: list[bool]
    itemsize: int
    block_bytes: int
    flops_per_token: float
    hidden: int = 0
    layers: int = 0
    heads: int = 0
    vocab: int = 0
    intermediate: int = 0
    act_width: int = 0  # sum of matmul output widths per token (generic activation estimate)
    source: str = ""
    dtype: Optional[torch.dtype] = None  # the compute dtype when every shard has it (None: mixed or unknown)
    largest_param_numel: int = 0  # the largest single parameter (its gradient is whole before it is summed in; 0: unknown)
    shard_itemsizes: list[int] = field(default_factory=list)
    act_itemsize: int = 0

    def shard_itemsize(self, i: int) -> int:
        return self.shard_itemsizes[i] if self.shard_itemsizes else self.itemsize

    def shard_bytes(self, i: int) -> int:
        """Bytes of shard ``i`` in its compute dtype."""
        return self.shard_numels[i] * self.shard_itemsize(i)

    @property
    def numel(self) -> int:
        return sum(self.shard_numels)

    @property
    def trainable_numel(self) -> int:
        return sum(n for n, t in zip(self.shard_numels, self.shard_trainable) if t)

    @property
    def param_bytes(self) -> int:
        return sum(self.shard_bytes(i) for i in range(len(self.shard_numels)))

    @property
    def largest_shard_numel(self) -> int:
        return max(self.shard_numels, default=0)

    @property
    def narrowest_itemsize(self) -> int:
        """The smallest element size of the shards (a LoRA run's bf16 base beside fp32 adapters):
        what the live-parameter cap counts elements at."""
        return min(self.shard_itemsizes or [self.itemsize])

    @property
    def largest_shard_bytes(self) -> int:
        return max((self.shard_bytes(i) for i in range(len(self.shard_numels))), default=0)

    def small_shard_bytes(self, threshold: int = SMALL_SHARD_NUMEL) -> int:
        """Bytes of the shards of at most ``threshold`` elements (kept resident when persistent)."""
        return sum(self.shard_bytes(i) for i, n in enumerate(self.shard_numels) if 0 < n <= threshold)

    def with_dtype(self, dtype: Union[str, torch.dtype]) -> "ModelSizes":
        from dataclasses import replace

        dt = parse_dtype(dtype)
        itemsize = torch.empty((), dtype=dt).element_size()
        return replace(self, itemsize=itemsize, block_bytes=self.block_bytes // self.itemsize * itemsize, dtype=dt,
                       shard_itemsizes=[], act_itemsize=0)

    def activation_bytes(self, micro_batch: int, seq: int, checkpointing: bool,
                         itemsize: Optional[int] = None) -> int:
        """Device bytes of saved activations for one micro-batch.

        Transformers: a Llama-style layer (gated MLP) counted tensor by tensor as transformers saves
        them (about 46·h bytes per token at 2-byte activations for Llama-2-7B), else Korthikanti et
        al.'s 34·h bytes per token and layer at 2-byte activations (scaled by itemsize); no seq²
        term: fused/SDPA attention keeps no score matrix. Plus the loss over the vocabulary (the
        logits, the fp32 log-softmax and two fp32 gradients); with checkpointing each layer keeps
        its input, plus the larger of the loss's tensors and one layer's full set during recompute.
        Other models: every matmul output kept once and twice for its gradient.
        """
        parts = self._activation_parts(micro_batch, seq, itemsize)
        if parts is None:
            isz = itemsize or self.act_itemsize or self.itemsize
            return 3 * micro_batch * seq * max(self.act_width, 1) * isz
        inputs, per_layer, logits = parts
        if checkpointing:  # the loss's tensors are gone before the first layer's recompute
            return inputs + max(per_layer, logits)
        return self.layers * per_layer + logits

    def loss_over_layer(self, micro_batch: int, seq: int, checkpointing: bool) -> int:
        """With checkpointing: how much of :meth:`activation_bytes` is the loss's tensors beyond a
        layer's recompute (the part a step holds only while the loss runs, when no decoder layer's
        working set is); 0 without checkpointing or a transformer's shape."""
        parts = self._activation_parts(micro_batch, seq, None) if checkpointing else None
        return 0 if parts is None else max(0, parts[2] - parts[1])

    def _activation_parts(self, micro_batch: int, seq: int,
                          itemsize: Optional[int]) -> Optional[tuple[int, int, int]]:
        """(every layer's checkpointed input, one layer's full set, the loss's tensors) in bytes
        (see :meth:`activation_bytes`); None for a model without a transformer's shape."""
        isz = itemsize or self.act_itemsize or self.itemsize
        tokens = micro_batch * seq
        if self.hidden and self.layers:
            h = self.hidden
            if self.intermediate and self.intermediate != 4 * h:
                # a Llama-style layer (gated MLP, RMSNorm, rotary; what transformers saves for backward):
                # two norms' fp32 inputs (4h bytes each), then 8h values (norm outputs, q/k/v, the
                # rotated q/k, attention output) and gate, up, SiLU(gate) and the down-projection's
                # input (4 x intermediate). Counted with saved-tensor hooks on transformers 5.x's Llama
                # in bf16: 45.9·h bytes per token and layer at intermediate 2.69·h; this gives 45.5
                per_layer = tokens * (8 * h + isz * (8 * h + 4 * self.intermediate))
            else:
                per_layer = tokens * 34 * h * isz // 2
            # the loss over the vocabulary: logits in the compute dtype (held by the output), their
            # fp32 copy's log-softmax, and in backward its gradient and the gradient of the fp32 copy
            logits = tokens * self.vocab * (isz + 3 * 4)
            return self.layers * tokens * h * isz, per_layer, logits
        return None

    def flops_per_step(self, micro_batch: int, seq: int, checkpointing: bool) -> float:
        """Matmul FLOPs of one micro-batch's forward + backward (+ recompute with checkpointing):
        (6 or 8) x weights x tokens, plus causal attention scores (2·seq·h per token and layer
        forward, the causal half of 4·seq·h). A frozen weight's backward makes no weight gradient:
        one pass fewer for the frozen share of the parameters (a LoRA run's base)."""
        tokens = micro_batch * seq
        passes = 4.0 if checkpointing else 3.0
        frozen = 1.0 - self.trainable_numel / self.numel if self.numel else 0.0
        attn = 2.0 * seq * self.hidden * self.layers
        return ((passes - frozen) * self.flops_per_token + passes * attn) * tokens


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
    cfg = getattr(model, "config", None)
    floats = {p.dtype for p in model.parameters() if p.dtype.is_floating_point}
    s = ModelSizes(shard_numels=numels, shard_trainable=trainable, itemsize=itemsize, block_bytes=block,
                   flops_per_token=flops, act_width=act_width, source=type(model).__name__,
                   largest_param_numel=largest_param,
                   dtype=dt if dt is not None else (floats.pop() if len(floats) == 1 else None),
                   shard_itemsizes=itemsizes if mixed else [], act_itemsize=act_itemsize if mixed else 0)
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
                      dtype: Union[str, torch.dtype] = "bf16") -> ModelSizes:
    """Sizes from a transformers config (path to config.json / a model directory / a dict): the
    model is built on the meta device (nothing allocated) so the count is exact; if transformers
    cannot build it, a Llama-style analytic count."""
    d = load_model_config(config)
    try:
        import transformers

        mt = d.get("model_type", "llama")
        cfg = transformers.AutoConfig.for_model(mt, **{k: v for k, v in d.items() if k != "model_type"})
        with torch.device("meta"):
            model = transformers.AutoModelForCausalLM.from_config(cfg)
        s = sizes_from_module(model, dtype)
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
    return sizes_from_config(model, dtype or "bf16")


__all__ = ["ModelSizes", "sizes_from_module", "sizes_from_config", "llama_sizes", "model_sizes",
           "parse_dtype", "load_model_config", "SMALL_SHARD_NUMEL"]
