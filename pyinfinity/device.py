"""The compute device a device spec means: ``"cuda"`` and ``"auto"`` become one indexed CUDA device.

torch APIs such as ``torch.cuda.set_per_process_memory_fraction`` refuse a ``cuda`` device
without an index, and under ``torchrun`` each process must use its own GPU. Every place that takes
a device spec from a user (the engine's ``pyinfinity.device``, the planner, the command line)
resolves it here, so ``cuda`` means the same GPU everywhere: ``cuda:$LOCAL_RANK`` when torchrun (or
another launcher) set ``LOCAL_RANK``, else torch's current device.
"""
from __future__ import annotations

import logging
import os
from typing import Optional, Union

import torch

log = logging.getLogger(__name__)

AUTO = "auto"


def _local_rank() -> Optional[int]:
    """``LOCAL_RANK`` as set by torchrun and DeepSpeed's launcher (None when unset)."""
    v = os.environ.get("LOCAL_RANK")
    if v is None or v.strip() == "":
        return None
    try:
        rank = int(v)
    except ValueError:
        raise ValueError(f"LOCAL_RANK: expected a GPU index, got {v!r}") from None
    if rank < 0:
        raise ValueError(f"LOCAL_RANK: expected a GPU index >= 0, got {rank}")
    return rank


def default_cuda_index() -> int:
    """The GPU a bare ``cuda`` means: ``LOCAL_RANK`` when set (one GPU per process under
    torchrun; the only one when the launcher made one visible per process), else torch's current
    device."""
    rank = _local_rank()
    if rank is not None:
        count = torch.cuda.device_count()
        if rank < count:
            return rank
        if count == 1:  # the launcher made one GPU visible to each process (CUDA_VISIBLE_DEVICES)
            return 0
        raise ValueError(f"LOCAL_RANK={rank}, but this process sees {count} GPU(s)")
    return torch.cuda.current_device()


def cuda_available() -> bool:
    """``torch.cuda.is_available()``, False where the query itself fails (a broken driver)."""
    try:
        return torch.cuda.is_available()
    except Exception:  # noqa: BLE001 - no usable driver: no GPU
        return False


def resolve_device(spec: Union[str, torch.device], *, must_exist: bool = True) -> torch.device:
    """The device ``spec`` ("auto", "cpu", "cuda", "cuda:N" or a torch.device) names, a CUDA device
    always with its index. "auto" is the CUDA device when one is available, else the CPU.

    must_exist: raise ValueError when ``spec`` names a CUDA device this machine does not have.
    With ``must_exist=False`` (planning for another machine) such a spec is returned as given."""
    if isinstance(spec, str) and spec.strip().lower() == AUTO:
        return torch.device("cuda", default_cuda_index()) if cuda_available() else torch.device("cpu")
    try:
        dev = torch.device(spec)
    except (RuntimeError, TypeError) as e:
        raise ValueError(f"device: expected cpu, cuda, cuda:N or auto, got {spec!r}") from e
    if dev.type != "cuda":
        return dev
    if not cuda_available():
        if must_exist:
            raise ValueError(f"device {str(spec)!r} asked for, but no CUDA device is available")
        return dev
    count = torch.cuda.device_count()
    if dev.index is None:
        return torch.device("cuda", default_cuda_index())
    if dev.index >= count and must_exist:
        raise ValueError(f"device {str(spec)!r} does not exist: this machine has {count} GPU(s)")
    return dev


__all__ = ["resolve_device", "default_cuda_index", "cuda_available"]
