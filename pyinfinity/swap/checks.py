"""Argument checks shared by the swap layer: what a buffer must be to cross into the core."""
from __future__ import annotations

import os
from typing import Any

import torch


def as_path(file: Any, name: str = "file") -> str:
    if isinstance(file, (str, os.PathLike)):
        path = os.fspath(file)
        if not path:
            raise ValueError(f"{name}: empty path")
        return path
    raise TypeError(f"{name}: expected a path (str or os.PathLike) or a FileHandle, got {type(file).__name__}")


def check_offset(offset: Any, name: str = "offset") -> int:
    if isinstance(offset, bool) or not isinstance(offset, int):
        raise TypeError(f"{name}: expected an int, got {type(offset).__name__}")
    if offset < 0:
        raise ValueError(f"{name}: must be >= 0, got {offset}")
    return offset


def check_tensor(tensor: Any, name: str = "tensor", device: str = "cpu") -> torch.Tensor:
    """A non-empty contiguous tensor on `device` ("cpu" or "cuda"), else ValueError/TypeError."""
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(tensor).__name__}")
    if tensor.device.type != device:
        hint = " (use CudaStager or AioHandle for GPU tensors)" if device == "cpu" else ""
        raise ValueError(f"{name}: must be on {device}, got a tensor on {tensor.device}{hint}")
    if not tensor.is_contiguous():
        raise ValueError(f"{name}: must be contiguous (call .contiguous() first); shape {tuple(tensor.shape)}, "
                         f"strides {tensor.stride()}")
    if tensor.numel() == 0:
        raise ValueError(f"{name}: zero-size tensor (shape {tuple(tensor.shape)})")
    return tensor


def nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()
