"""``Engine.export``: the trained weights as a consolidated safetensors state dict that the plain
model loads (``load_state_dict``; ``from_pretrained`` for a transformers model, whose config.json
is written too), values from the fp32 masters cast to each parameter's original dtype, files of at
most ``EXPORT_FILE_BYTES`` with a Hugging Face style index above that. It works on the engine's
training state (``zero.state.TrainingState``) through its public methods."""
from __future__ import annotations

import json
import logging
import os
from typing import TYPE_CHECKING, Union

import torch
from torch import nn

from pyinfinity import guards
from pyinfinity.zero.partition import FlatShard

if TYPE_CHECKING:
    from pyinfinity.zero.state import TrainingState

log = logging.getLogger(__name__)

EXPORT_FILE_BYTES = 4 << 30  # safetensors file size cap (HF-style sharding above it)


def write(state: "TrainingState", out_dir: str, *,
          tokenizer_dir: Union[str, os.PathLike, None] = None) -> list[str]:
    """Writes the trained weights of ``state`` under ``out_dir``; returns the files written. The
    tokenizer files of the model directory ``tokenizer_dir`` (the one the weights came from) go
    along, so that ``AutoTokenizer`` loads ``out_dir``."""
    from safetensors.torch import save_file

    state.check_trainable("export()")
    state.quiesce("export()")
    state.coordinator.release_all()
    os.makedirs(out_dir, exist_ok=True)
    names: dict[int, list[str]] = {}
    buffers: dict[str, torch.Tensor] = {}
    with guards.engine_state_dict():
        sd = state.model.state_dict(keep_vars=True)
    for key, val in sd.items():
        if isinstance(val, nn.Parameter) and id(val) in state.partition.param_slice:
            names.setdefault(id(val), []).append(key)
        else:
            buffers[key] = val.detach().to("cpu").contiguous()
    # group tensors into files of at most EXPORT_FILE_BYTES, shard by shard
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
            vals = state.trained_values(sh)
            for s in sh.slices:
                t = vals[s.offset:s.offset + s.numel].view(s.shape).to(s.orig_dtype)
                for key in names.get(id(s.param), []):
                    tensors[key] = t.clone()
        save_file(tensors, os.path.join(out_dir, fname), metadata={"format": "pt"})
        files.append(os.path.join(out_dir, fname))
        weight_map.update({k: fname for k in tensors})
    if n > 1:
        with open(os.path.join(out_dir, "model.safetensors.index.json"), "w") as f:
            json.dump({"metadata": {}, "weight_map": weight_map}, f, indent=1)
        files.append(os.path.join(out_dir, "model.safetensors.index.json"))
    cfg = getattr(state.model, "config", None)
    if cfg is not None and hasattr(cfg, "save_pretrained"):
        cfg.save_pretrained(out_dir)
        files.append(os.path.join(out_dir, "config.json"))
    if tokenizer_dir is not None:  # a model directory's tokenizer goes along (AutoTokenizer loads out_dir)
        from pyinfinity.pretrained import copy_tokenizer_files

        files += copy_tokenizer_files(tokenizer_dir, out_dir)
    log.info("exported %d tensors to %s", len(weight_map), out_dir)
    return files


__all__ = ["write", "EXPORT_FILE_BYTES"]
