"""What the layout knows about a model: its flat shards (elements, trainable, bytes in the compute
dtype, in the order the engine partitions them), the working set of one block, the matmul FLOPs
per token and an activation estimate (:class:`ModelSizes`). The planner builds it from a module or
a transformers config (``plan.sizes``); the engine from the model it partitions."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Union

import torch

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
    # the most parameter bytes one module call needs at once (its own and tied parameters; 0: unknown)
    largest_module_bytes: int = 0

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

    def live_elements(self, nbytes: int) -> int:
        """The live-parameter cap (elements, at least 1) that holds ``nbytes`` of shards: counted at
        :attr:`narrowest_itemsize`."""
        return max(1, int(nbytes) // self.narrowest_itemsize)

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


__all__ = ["ModelSizes", "SMALL_SHARD_NUMEL", "parse_dtype"]
