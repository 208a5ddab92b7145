"""What `pyinfinity bench train` can run: the model sizes (``pyinfinity.presets``), the systems and their
variants (``deepspeed-z2-cpu[bf16.enabled=true]``), and the DeepSpeed settings every DeepSpeed run
starts from."""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any, Optional

from pyinfinity.bench.train_worker import SYSTEMS
from pyinfinity.presets import NAMES, PRESETS, preset

SCHEMA = "pyinfinity.bench.train/1"

DEFAULT_SIZES_GPU = ("1.1b", "3b", "7b", "10b")
DEFAULT_SIZES_CPU = ("micro",)
DEFAULT_SYSTEMS = ("pyinfinity-cpu", "pyinfinity-nvme", "pyinfinity-auto", "deepspeed-cpu", "deepspeed-z2-cpu",
                   "deepspeed-z3-gpu-params", "deepspeed-nvme", "torch")
PEERS = {"pyinfinity-cpu": "deepspeed-cpu", "pyinfinity-nvme": "deepspeed-nvme",
         "pyinfinity-nvme-params": "deepspeed-nvme-params", "pyinfinity-nvme-all": "deepspeed-nvme-all"}

# with --lora: the engines that stream a frozen base through the GPU, and plain PEFT where it fits.
# DeepSpeed ZeRO-3 with offload_param cpu twice, the better counting ("vs best DS"): with the
# settings below, and tuned for streaming (10x the prefetch bucket; DeepSpeed's own default of 1e9
# live parameters instead of 1e8)
DEEPSPEED_LORA_TUNED = ("deepspeed-cpu[zero_optimization.stage3_prefetch_bucket_size=5e8,"
                        "zero_optimization.stage3_max_live_parameters=1e9]")
DEFAULT_SYSTEMS_LORA = ("pyinfinity-auto", "deepspeed-cpu", DEEPSPEED_LORA_TUNED, "torch-nocap")


def _linears(fields: dict[str, Any]) -> dict[str, tuple[int, int]]:
    """The Llama layers LoRA may target, with their (in, out) features in a model of ``fields``
    (``all-linear``: every one, as PEFT's shorthand picks them; the head is left out)."""
    h, ff = int(fields["hidden_size"]), int(fields["intermediate_size"])
    heads = int(fields["num_attention_heads"])
    kv = int(fields.get("num_key_value_heads") or heads)
    hd = h // heads
    return {"q_proj": (h, heads * hd), "k_proj": (h, kv * hd), "v_proj": (h, kv * hd), "o_proj": (heads * hd, h),
            "gate_proj": (h, ff), "up_proj": (h, ff), "down_proj": (ff, h)}


# their names, and PEFT's default targets for Llama
LLAMA_LINEARS = tuple(_linears(PRESETS["tiny"]))
LORA_DEFAULT_TARGETS = ("q_proj", "v_proj")

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
    """LlamaConfig fields of a named size (``pyinfinity.presets``), or of a JSON config file (a
    transformers config.json)."""
    if size in NAMES:
        d = preset(size)
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
        raise BenchTrainError(f"--sizes: unknown size {size!r}; choose from {', '.join(NAMES)} or give a "
                              "Llama config.json path")
    d["max_position_embeddings"] = max(int(d.get("max_position_embeddings", 2048)), seq)
    return d


def lora_spec(rank: int, targets: Optional[str]) -> dict[str, Any]:
    """--lora R [--lora-targets NAMES|all-linear] as a run's LoRA: rank, alpha (2R) and the Llama
    layers that get adapters (PEFT's default for Llama without --lora-targets)."""
    if rank < 1:
        raise BenchTrainError(f"--lora: {rank} must be >= 1 (the adapters' rank)")
    if targets is None:
        names: tuple[str, ...] = LORA_DEFAULT_TARGETS
    elif targets.strip() == "all-linear":
        names = LLAMA_LINEARS
    else:
        names = tuple(t.strip() for t in targets.split(",") if t.strip())
        bad = [t for t in names if t not in LLAMA_LINEARS]
        if bad or not names:
            raise BenchTrainError(f"--lora-targets: {', '.join(bad) or repr(targets)} is not a layer of the bench's "
                                  f"Llama models; choose from {','.join(LLAMA_LINEARS)} or all-linear")
    return {"r": int(rank), "alpha": 2 * int(rank), "targets": list(names)}


def lora_numel(fields: dict[str, Any], lora: dict[str, Any]) -> int:
    """The adapters' parameters: r x (in + out) for each targeted layer of every decoder layer."""
    shapes = _linears(fields)
    return int(fields["num_hidden_layers"]) * sum(lora["r"] * sum(shapes[t]) for t in lora["targets"])


def size_facts(fields: dict[str, Any], dtype: str, batch: int, seq: int, checkpointing: bool,
               lora: Optional[dict[str, Any]] = None) -> dict[str, Any]:
    """Parameters, their bytes and the matmul FLOPs of one step. With ``lora`` the base is frozen
    in ``dtype`` and the adapters (``trainable``) are fp32: backward computes the input gradients
    through the base but no weight gradient of it, one pass of the base's matmuls fewer."""
    from pyinfinity.plan.sizes import llama_sizes

    sz = llama_sizes(dict(fields, model_type="llama"), dtype=dtype)
    flops = sz.flops_per_step(batch, seq, checkpointing)
    out = {"params": sz.numel, "param_bytes": sz.param_bytes, "itemsize": sz.itemsize, "flops_per_step": flops}
    if lora:
        n = lora_numel(fields, lora)
        tokens = batch * seq
        passes = 4 if checkpointing else 3
        out.update(params=sz.numel + n, param_bytes=sz.param_bytes + 4 * n, frozen_bytes=sz.param_bytes, trainable=n,
                   flops_per_step=flops - sz.flops_per_token * tokens + passes * 2.0 * n * tokens)
    return out
