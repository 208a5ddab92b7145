"""The compressed optimizer states' CUDA kernels (``csrc/src/cuda_adam.cu``) as
``state_formats.device_step_8bit`` / ``device_step_bf16`` call them: which implementation a step
takes, and the launches on the current stream. The kernels compute the CPU kernels' bits."""
from __future__ import annotations

import os
from typing import Any, Optional

import torch

DEVICE_STEP_IMPLS = ("auto", "cuda", "torch")
"""How the device steps step: ``"cuda"`` the build's CUDA kernels (``_C.cuda_adam_step_8bit`` /
``cuda_adam_step_bf16``: one pass over the state), ``"torch"`` tensor operations in chunks (any
device), ``"auto"`` the kernels for CUDA tensors they take when the build has them, else torch.
The environment variable PYINFINITY_DEVICE_STEP (one of these) replaces ``"auto"``."""

OUT_TYPES_8BIT = {torch.bfloat16: 1, torch.float16: 2, torch.float32: 3}
"""The dtypes the 8-bit kernel writes the new weights in, and their codes for ``_C``."""

_KERNELS: Optional[bool] = None


def cuda_kernels() -> bool:
    """Whether this build of ``pyinfinity._C`` has the CUDA kernels of the compressed steps."""
    global _KERNELS
    if _KERNELS is None:
        try:
            from pyinfinity import _C
            _KERNELS = bool(_C.cuda_adam_kernels())
        except (ImportError, AttributeError):
            _KERNELS = False
    return _KERNELS


def device_impl(impl: str, what: str, tensors: tuple, grad: torch.Tensor, out: Optional[torch.Tensor],
                out_dtypes: Any) -> str:
    """"cuda" or "torch" for a step of ``tensors`` (the state), ``grad`` and ``out`` (see
    DEVICE_STEP_IMPLS); "cuda" asked for where the kernels cannot run is a ValueError saying why."""
    _check_out(what, tensors, grad, out)
    if impl == "auto":
        impl = os.environ.get("PYINFINITY_DEVICE_STEP", "auto") or "auto"
    if impl not in DEVICE_STEP_IMPLS:
        raise ValueError(f"{what}: impl (or PYINFINITY_DEVICE_STEP) must be one of {', '.join(DEVICE_STEP_IMPLS)}, "
                         f"got {impl!r}")
    if impl == "torch":
        return "torch"
    every = tensors + (grad,) + (() if out is None else (out,))
    dev = tensors[0].device
    why = None
    if dev.type != "cuda":
        why = f"the state is on {dev}, not a CUDA device"
    elif not cuda_kernels():
        why = "this build of pyinfinity has no CUDA kernels (built without the CUDA compiler)"
    elif any(t.device != dev for t in every):
        why = "the state, the gradient and out are not all on one device"
    elif any(not t.is_contiguous() for t in every):
        why = "a tensor is not contiguous"
    elif grad.dtype not in (torch.float32, torch.bfloat16):
        why = f"the gradient is {grad.dtype} (the kernels take fp32 or bf16)"
    elif out is not None and out.dtype not in out_dtypes:
        why = f"out is {out.dtype} (the kernel writes {', '.join(str(d) for d in out_dtypes)})"
    if why is None:
        return "cuda"
    if impl == "cuda":
        raise ValueError(f"{what}: impl 'cuda' cannot run here: {why}")
    return "torch"


def _overlaps(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether the memory of ``a`` and ``b`` (each contiguous from its data pointer) intersects."""
    a0, b0 = a.data_ptr(), b.data_ptr()
    return a.device == b.device and a0 < b0 + b.numel() * b.element_size() and b0 < a0 + a.numel() * a.element_size()


def _check_out(what: str, tensors: tuple, grad: torch.Tensor, out: Optional[torch.Tensor]) -> None:
    """``out`` may be the gradient itself (each element read before its new weight is written over
    it), never part of the state nor a tensor of another dtype over the gradient's memory (an
    element's new weight would overwrite gradient values other elements have not read yet)."""
    if out is None:
        return
    if any(_overlaps(out, t) for t in tensors):
        raise ValueError(f"{what}: out overlaps the optimizer state")
    if _overlaps(out, grad) and (out.data_ptr() != grad.data_ptr() or out.element_size() != grad.element_size()):
        raise ValueError(f"{what}: out ({out.dtype}) overlaps the gradient ({grad.dtype}) without being it: out may "
                         "be the gradient's own elements, or memory apart from it")


def _where(t: torch.Tensor) -> tuple[int, int]:
    """(device index, the current stream's address) for a launch on ``t``'s device."""
    dev = t.device
    index = dev.index if dev.index is not None else torch.cuda.current_device()
    return index, torch.cuda.current_stream(dev).cuda_stream


def step_8bit_cuda(state: Any, grad: torch.Tensor, hyper: Any, out: Optional[torch.Tensor]) -> None:
    """One 8-bit step by the CUDA kernel (``device_impl`` said "cuda"): ``state`` an
    Adam8bitState, ``hyper`` an AdamHyper; queued on the current stream."""
    from pyinfinity import _C

    hyper.check()
    s = state
    _C.cuda_adam_step_8bit(s.master.data_ptr(), s.exp_avg.data_ptr(), s.exp_avg_sq.data_ptr(),
                           s.exp_avg_scale.data_ptr(), s.exp_avg_sq_scale.data_ptr(), grad.data_ptr(),
                           1 if grad.dtype == torch.bfloat16 else 0, 0 if out is None else out.data_ptr(),
                           0 if out is None else OUT_TYPES_8BIT[out.dtype], s.master.numel(), *hyper.kernel_args(),
                           *_where(s.master))


def step_bf16_cuda(param: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor, grad: torch.Tensor,
                   hyper: Any, out: Optional[torch.Tensor]) -> None:
    """One bf16-state step by the CUDA kernel (``device_impl`` said "cuda"); ``out`` (bf16, may
    be the gradient) receives the new weights. Queued on the current stream."""
    from pyinfinity import _C

    hyper.check()
    _C.cuda_adam_step_bf16(param.data_ptr(), exp_avg.data_ptr(), exp_avg_sq.data_ptr(), grad.data_ptr(),
                           1 if grad.dtype == torch.bfloat16 else 0, 0 if out is None else out.data_ptr(),
                           param.numel(), *hyper.kernel_args(), *_where(param))


__all__ = ["DEVICE_STEP_IMPLS", "OUT_TYPES_8BIT", "cuda_kernels", "device_impl", "step_8bit_cuda", "step_bf16_cuda"]
