"""What `pyinfinity bench train` can run: the model sizes (Llama shapes), the systems and their
variants (``deepspeed-z2-cpu[bf16.enabled=true]``), and the DeepSpeed settings every DeepSpeed run
starts from."""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any

from pyinfinity.bench.train_worker import SYSTEMS

SCHEMA = "pyinfinity.bench.train/1"

_LLAMA = dict(vocab_size=32000, max_position_embeddings=2048, rms_norm_eps=1e-5, tie_word_embeddings=False)
# name -> LlamaConfig fields. "1.1b" is TinyLlama-1.1B's shape.
SIZES: dict[str, dict[str, Any]] = {
    "tiny": dict(_LLAMA, vocab_size=1024, hidden_size=64, intermediate_size=172, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=4),
    "125m": dict(_LLAMA, hidden_size=768, intermediate_size=2048, num_hidden_layers=12, num_attention_heads=12,
                 num_key_value_heads=12),
    "1.1b": dict(_LLAMA, hidden_size=2048, intermediate_size=5632, num_hidden_layers=22, num_attention_heads=32,
                 num_key_value_heads=4),
    "3b": dict(_LLAMA, hidden_size=3200, intermediate_size=8640, num_hidden_layers=26, num_attention_heads=32,
               num_key_value_heads=32),
    "7b": dict(_LLAMA, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32,
               num_key_value_heads=32),
    "10b": dict(_LLAMA, hidden_size=4608, intermediate_size=12288, num_hidden_layers=40, num_attention_heads=36,
                num_key_value_heads=36),
    "13b": dict(_LLAMA, hidden_size=5120, intermediate_size=13824, num_hidden_layers=40, num_attention_heads=40,
                num_key_value_heads=40),
    # LLaMA-30B's shape (the original LLaMA release)
    "30b": dict(_LLAMA, hidden_size=6656, intermediate_size=17920, num_hidden_layers=60, num_attention_heads=52,
                num_key_value_heads=52),
    # Llama-2-70B's shape (grouped-query attention: 8 KV heads)
    "70b": dict(_LLAMA, hidden_size=8192, intermediate_size=28672, num_hidden_layers=80, num_attention_heads=64,
                num_key_value_heads=8),
}
DEFAULT_SIZES_GPU = ("1.1b", "3b", "7b", "10b")
DEFAULT_SIZES_CPU = ("tiny",)
DEFAULT_SYSTEMS = ("pyinfinity-cpu", "pyinfinity-nvme", "pyinfinity-auto", "deepspeed-cpu", "deepspeed-z2-cpu",
                   "deepspeed-z3-gpu-params", "deepspeed-nvme", "torch")
PEERS = {"pyinfinity-cpu": "deepspeed-cpu", "pyinfinity-nvme": "deepspeed-nvme",
         "pyinfinity-nvme-params": "deepspeed-nvme-params", "pyinfinity-nvme-all": "deepspeed-nvme-all"}

# DeepSpeed ZeRO-3 offload settings as commonly used for one GPU (BENCHMARKS.md lists them)
DEEPSPEED_DEFAULTS: dict[str, Any] = {
    "prefetch_bucket_size": 5e7, "max_live_parameters": 1e8, "param_persistence_threshold": 1e5,
    "buffer_count": 6, "buffer_size": 1.5e8, "max_in_cpu": 1e9, "pipeline": False, "optimizer_buffer_count": 4,
    "aio": {"block_size": 1048576, "queue_depth": 32, "intra_op_parallelism": 4, "single_submit": False,
            "overlap_events": True},
}


class BenchTrainError(ValueError):
    """Bad arguments or an unusable results file."""


# ----------------------------------------------------------------------------------- systems


@dataclass(frozen=True)
class SystemSpec:
    """One entry of --systems: a system and its variant (``deepspeed-z2-cpu[bf16.enabled=true]``)."""

    label: str                 # the name as given (spaces removed): the row's label
    base: str                  # the system (a key of SYSTEMS)
    variant: tuple = ()        # ((dotted key, value), ...) set in the system's config


def _split_top(text: str, sep: str = ",") -> list[str]:
    """``text`` split at ``sep`` outside brackets, braces and quotes."""
    out, depth, quote, cur = [], 0, "", []
    for ch in text:
        if quote:
            quote = "" if ch == quote else quote
        elif ch in "\"'":
            quote = ch
        elif ch in "[{":
            depth += 1
        elif ch in "]}":
            depth -= 1
            if depth < 0:
                raise BenchTrainError(f"--systems {text!r}: unbalanced {ch!r}")
        elif ch == sep and depth == 0:
            out.append("".join(cur))
            cur = []
            continue
        cur.append(ch)
    if depth or quote:
        raise BenchTrainError(f"--systems {text!r}: unclosed {'quote' if quote else 'bracket'}")
    out.append("".join(cur))
    return out


def _json_value(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def parse_system(entry: str) -> SystemSpec:
    """``name`` or ``name[key=value,key=value]``: values are JSON where they parse, else strings."""
    entry = entry.strip()
    name, bracket, rest = entry.partition("[")
    name = name.strip()
    if name not in SYSTEMS:
        raise BenchTrainError(f"--systems: unknown {name or entry}; choose from {', '.join(SYSTEMS)}")
    if not bracket:
        return SystemSpec(label=name, base=name)
    if not rest.endswith("]"):
        raise BenchTrainError(f"--systems {entry}: a variant is name[key=value,...], ending in ']'")
    items = [x.strip() for x in _split_top(rest[:-1]) if x.strip()]
    if not items:
        raise BenchTrainError(f"--systems {entry}: empty variant")
    if name.startswith("torch"):
        raise BenchTrainError(f"--systems {entry}: {name} has no config for a variant to set")
    variant: list[tuple[str, Any]] = []
    for item in items:
        key, eq, val = item.partition("=")
        key = key.strip()
        if not eq or not key or any(not part for part in key.split(".")):
            raise BenchTrainError(f"--systems {entry}: {item!r} is not KEY=VALUE (a dotted config key)")
        if key in (k for k, _ in variant):
            raise BenchTrainError(f"--systems {entry}: {key} is set twice")
        variant.append((key, _json_value(val.strip())))
    label = f"{name}[{','.join(items)}]"
    return SystemSpec(label=label, base=name, variant=tuple(variant))


def parse_systems(text: str) -> list[str]:
    """--systems as a list of labels, each checked (see parse_system); a label given twice is an error."""
    labels: list[str] = []
    for entry in _split_top(text):
        if not entry.strip():
            continue
        label = parse_system(entry).label
        if label in labels:
            raise BenchTrainError(f"--systems: {label} is given twice")
        labels.append(label)
    return labels


def base_system(label: str) -> str:
    """The system of a run's label (``pyinfinity-auto[...]`` -> ``pyinfinity-auto``)."""
    return label.partition("[")[0]


# ----------------------------------------------------------------------------------- sizes


def model_fields(size: str, seq: int) -> dict[str, Any]:
    """LlamaConfig fields of a named size, or of a JSON config file (a transformers config.json)."""
    if size in SIZES:
        d = dict(SIZES[size])
    elif size.endswith(".json") and os.path.isfile(size):
        with open(size) as f:
            raw = json.load(f)
        keep = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "max_position_embeddings", "rms_norm_eps", "tie_word_embeddings")
        d = {k: raw[k] for k in keep if k in raw}
        missing = [k for k in keep[:5] if k not in d]
        if missing:
            raise BenchTrainError(f"--sizes: {size} lacks {', '.join(missing)} (expected a Llama config.json)")
    else:
        raise BenchTrainError(f"--sizes: unknown size {size!r}; choose from {', '.join(SIZES)} or give a "
                              "Llama config.json path")
    d["max_position_embeddings"] = max(int(d.get("max_position_embeddings", 2048)), seq)
    return d


def size_facts(fields: dict[str, Any], dtype: str, batch: int, seq: int, checkpointing: bool) -> dict[str, Any]:
    from pyinfinity.plan.sizes import llama_sizes

    sz = llama_sizes(dict(fields, model_type="llama"), dtype=dtype)
    return {"params": sz.numel, "param_bytes": sz.param_bytes, "itemsize": sz.itemsize,
            "flops_per_step": sz.flops_per_step(batch, seq, checkpointing)}
