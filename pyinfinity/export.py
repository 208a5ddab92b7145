"""``Engine.export``: the trained weights as a consolidated safetensors state dict that the plain
model loads (``load_state_dict``; ``from_pretrained`` for a transformers model, whose config.json
is written too), values from the fp32 masters cast to each parameter's original dtype, files of at
most ``EXPORT_FILE_BYTES`` with a Hugging Face style index above that. It works on the engine's
training state (``zero.state.TrainingState``) through its public methods."""
from __future__ import annotations

import json
import logging
import os
from typing import TYPE_CHECKING, Callable, Optional, Union

import torch
from torch import nn

from pyinfinity import adapters, guards
from pyinfinity.zero.partition import FlatShard

if TYPE_CHECKING:
    from pyinfinity.zero.state import TrainingState

log = logging.getLogger(__name__)

EXPORT_FILE_BYTES = 4 << 30  # safetensors file size cap (HF-style sharding above it)


def write(state: "TrainingState", out_dir: str, *, tokenizer_dir: Union[str, os.PathLike, None] = None,
          merge_adapters: bool = False) -> list[str]:
    """Writes the trained weights of ``state`` under ``out_dir``; returns the files written. The
    tokenizer files of the model directory ``tokenizer_dir`` (the one the weights came from) go
    along, so that ``AutoTokenizer`` loads ``out_dir``.

    A PEFT model (LoRA adapters) is written as ``PeftModel.save_pretrained`` writes it
    (``adapter_config.json`` + ``adapter_model.safetensors``, loaded by ``PeftModel.from_pretrained``),
    or with ``merge_adapters`` as the base model with every adapter merged into its layer's weight
    (``W + scaling * B @ A``, shard by shard on the CPU), loaded by ``from_pretrained``."""
    state.check_trainable("export()")
    state.quiesce("export()")
    state.coordinator.release_all()
    peft_model = adapters.is_peft_model(state.model)
    if merge_adapters and not peft_model:
        raise ValueError("export(merge_adapters=True): the model has no adapters to merge (it is not a PEFT model)")
    if peft_model:
        adapters.check_lora(state.model, "export()")
    os.makedirs(out_dir, exist_ok=True)
    names, buffers = _names(state)
    if peft_model and not merge_adapters:
        files = _write_adapters(state, out_dir, names)
    elif peft_model:
        # the adapters (small) first, by their names in the base model; each base weight merged as it is read
        lora = {k[len(adapters.PEFT_PREFIX):]: v for k, v in _adapter_values(state, names).items()}
        base_model = state.model.get_base_model()
        # trained copies of whole modules (modules_to_save) of the active adapters replace their originals
        active, replaced = list(state.model.active_adapters), adapters.replaced_originals(state.model)

        def rename(key: str, t: torch.Tensor) -> Optional[tuple[str, torch.Tensor]]:
            base_key = adapters.merged_key(key, active, replaced)
            if base_key is None:
                return None
            owner = adapters.lora_owner(key[len(adapters.PEFT_PREFIX):])
            if owner is not None:
                t = adapters.merge_weight(base_model, owner, t, lora)
            return base_key, t

        buffers = {adapters.merged_key(k, active, replaced): v for k, v in buffers.items()
                   if adapters.merged_key(k, active, replaced) is not None}
        files = _write_model(state, out_dir, names, buffers, rename)
    else:
        files = _write_model(state, out_dir, names, buffers)
    if merge_adapters or not peft_model:  # a model: its (base model's) transformers config goes along
        cfg = adapters.base_config(state.model) if peft_model else getattr(state.model, "config", None)
        if cfg is not None and hasattr(cfg, "save_pretrained"):
            cfg.save_pretrained(out_dir)
            files.append(os.path.join(out_dir, "config.json"))
    if tokenizer_dir is not None:  # a model directory's tokenizer goes along (AutoTokenizer loads out_dir)
        from pyinfinity.pretrained import copy_tokenizer_files

        files += copy_tokenizer_files(tokenizer_dir, out_dir)
    log.info("exported %d files to %s%s", len(files), out_dir, _dtype_note(state, peft_model and not merge_adapters))
    return files


def state_dict(state: "TrainingState", *, trainable_only: bool = False) -> dict[str, torch.Tensor]:
    """The trained weights as one state dict in memory (the whole model: what DeepSpeed's
    ``_zero3_consolidated_16bit_state_dict`` returns), each in its parameter's original dtype, the
    buffers included; ``trainable_only``: the trainable parameters only (a LoRA run's adapters)."""
    state.check_trainable("state_dict()")
    state.quiesce("state_dict()")
    state.coordinator.release_all()
    names, buffers = _names(state)
    out: dict[str, torch.Tensor] = {}
    for sh in state.partition.shards:
        if sh.trainable or not trainable_only:
            out.update(_shard_tensors(state, sh, names))
    if not trainable_only:
        out.update(buffers)
    return out


def _dtype_note(state: "TrainingState", adapters_only: bool) -> str:
    """What dtype the weights were written in, said where it is not the one the run computed in
    (a model built in fp32 and trained in bf16 is exported in fp32, as its own parameters are)."""
    shards = [sh for sh in state.partition.shards if sh.trainable or not adapters_only]
    written = sorted({str(s.orig_dtype).replace("torch.", "") for sh in shards for s in sh.slices})
    cfg = state.config
    compute = "bf16" if cfg.bf16.enabled else "fp16" if cfg.fp16.enabled else None
    names = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}
    written = [names.get(d, d) for d in written]
    if compute is None or written == [compute]:
        return f" (weights in {', '.join(written)})" if written else ""
    return (f" (weights in {', '.join(written)}, each parameter's own dtype, from the fp32 masters; the run computed "
            f"in {compute}: cast them, e.g. model.to(torch.bfloat16), for {compute} files)")


def _names(state: "TrainingState") -> tuple[dict[int, list[str]], dict[str, torch.Tensor]]:
    """The state-dict keys of every offloaded parameter (several when tied) and the buffers' values."""
    names: dict[int, list[str]] = {}
    buffers: dict[str, torch.Tensor] = {}
    with guards.engine_state_dict():
        sd = state.model.state_dict(keep_vars=True)
    for key, val in sd.items():
        if isinstance(val, nn.Parameter) and id(val) in state.partition.param_slice:
            names.setdefault(id(val), []).append(key)
        else:
            buffers[key] = val.detach().to("cpu").contiguous()
    return names, buffers


def _shard_tensors(state: "TrainingState", sh: FlatShard, names: dict[int, list[str]]) -> dict[str, torch.Tensor]:
    """A shard's trained values by state-dict key, each in its parameter's original dtype."""
    vals = state.trained_values(sh)
    out = {}
    for s in sh.slices:
        t = vals[s.offset:s.offset + s.numel].view(s.shape).to(s.orig_dtype)
        for key in names.get(id(s.param), []):
            out[key] = t.clone()
    return out


def _adapter_values(state: "TrainingState", names: dict[int, list[str]]) -> dict[str, torch.Tensor]:
    """The trained values of every trainable parameter (the adapters: small), by PEFT state-dict key."""
    out: dict[str, torch.Tensor] = {}
    for sh in state.partition.shards:
        if sh.trainable:
            out.update(_shard_tensors(state, sh, names))
    return out


def _write_adapters(state: "TrainingState", out_dir: str, names: dict[int, list[str]]) -> list[str]:
    """PEFT's own ``save_pretrained`` on the gathered adapter values (its key names, its config)."""
    before = {os.path.join(d, f) for d, _, fs in os.walk(out_dir) for f in fs}
    with guards.engine_state_dict():
        state.model.save_pretrained(out_dir, state_dict=_adapter_values(state, names), save_embedding_layers=False)
    return sorted({os.path.join(d, f) for d, _, fs in os.walk(out_dir) for f in fs} - before
                  | {os.path.join(out_dir, adapters.ADAPTER_CONFIG)})


def _write_model(state: "TrainingState", out_dir: str, names: dict[int, list[str]], buffers: dict[str, torch.Tensor],
                 rename: Optional[Callable[[str, torch.Tensor], Optional[tuple[str, torch.Tensor]]]] = None) -> list[str]:
    """Every parameter (``rename`` may rename, change or drop each) and buffer as safetensors files
    of at most ``EXPORT_FILE_BYTES``, read shard by shard, with an index when there are several."""
    from safetensors.torch import save_file

    groups: list[list[FlatShard]] = [[]]
    size = 0
    for sh in state.partition.shards:
        nb = sum(s.numel * s.orig_dtype.itemsize * len(names.get(id(s.param), [])) for s in sh.slices)
        if groups[-1] and size + nb > EXPORT_FILE_BYTES:
            groups.append([])
            size = 0
        groups[-1].append(sh)
        size += nb
    n = len(groups)
    files, weight_map = [], {}
    for i, group in enumerate(groups):
        fname = "model.safetensors" if n == 1 else f"model-{i + 1:05d}-of-{n:05d}.safetensors"
        tensors: dict[str, torch.Tensor] = dict(buffers) if i == n - 1 else {}
        for sh in group:
            for key, t in _shard_tensors(state, sh, names).items():
                kept = (key, t) if rename is None else rename(key, t)
                if kept is not None:
                    tensors[kept[0]] = kept[1]
        save_file(tensors, os.path.join(out_dir, fname), metadata={"format": "pt"})
        files.append(os.path.join(out_dir, fname))
        weight_map.update({k: fname for k in tensors})
    if n > 1:
        with open(os.path.join(out_dir, "model.safetensors.index.json"), "w") as f:
            json.dump({"metadata": {}, "weight_map": weight_map}, f, indent=1)
        files.append(os.path.join(out_dir, "model.safetensors.index.json"))
    return files


__all__ = ["write", "state_dict", "EXPORT_FILE_BYTES"]
