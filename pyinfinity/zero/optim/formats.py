"""The optimizer state's format: how one shard's state is laid out in its home and stepped.

Everything else in the optimizer (where homes live, the NVMe pipeline, the background worker,
gradient intake, device placement) goes through :class:`OptimStateFormat` and never looks inside
a home. A format says what a parameter's state costs, allocates a shard's home and fills it from
the fp32 weights, gives the fp32 master values of a home (for the weights, checkpoints and
export), turns a home into what a checkpoint stores and back, and steps a home on the CPU and on
the compute device. :class:`AdamFp32` is the one in use: fp32 master weights and Adam/AdamW
moments, ``[master | exp_avg | exp_avg_sq]`` in one flat fp32 home (one read and one write per
shard per step). A compressed format (8-bit block-quantised moments beside an fp32 master, or a
bf16 master and moments) is another subclass; the planner's ``plan.charges.OPT_BYTES_PER_PARAM``
charges ``bytes_per_param`` of the format in use.
"""
from __future__ import annotations

import abc
from typing import Optional

import torch

from pyinfinity.swap.tensor_swapper import SwapRecord, Tier, TensorSwapper

DEVICE_CHUNK = 16 << 20  # elements of a device-stepped unit converted to fp32 at a time (plan.placement counts it)


class OptimStateFormat(abc.ABC):
    """How one shard's optimizer state is stored and stepped. ``flat`` is always the whole home
    of one shard (in RAM, a staging buffer of a home on NVMe, or its copy on the device);
    ``numel`` is the shard's parameter count; ``hyper`` holds lr, beta1, beta2, eps and
    weight_decay."""

    name: str = ""
    bytes_per_param: int = 0  # bytes of a home per parameter (RAM, disk; the device copy costs the same)

    @abc.abstractmethod
    def home_spec(self, numel: int) -> tuple[int, torch.dtype]:
        """(elements, dtype) of the flat home of a shard of ``numel`` parameters."""

    def allocate(self, swapper: TensorSwapper, key: str, numel: int, tier: Tier) -> SwapRecord:
        """A home for a shard of ``numel`` parameters on ``tier`` (filled by ``init``)."""
        n, dtype = self.home_spec(numel)
        return swapper.allocate(key, n, dtype, tier)

    @abc.abstractmethod
    def init(self, flat: torch.Tensor, numel: int, values: torch.Tensor) -> None:
        """Fills a fresh state from the shard's fp32 values (the master; moments zero)."""

    @abc.abstractmethod
    def master(self, flat: torch.Tensor, numel: int) -> torch.Tensor:
        """The fp32 master values of a state (a view where they are stored as fp32)."""

    def save(self, flat: torch.Tensor, numel: int) -> torch.Tensor:
        """What a checkpoint stores of a state (default: the home as it is)."""
        return flat

    def load(self, data: torch.Tensor, numel: int) -> torch.Tensor:
        """A state for the home from what ``save`` gave; ValueError if it does not fit."""
        n, dtype = self.home_spec(numel)
        if data.numel() != n or data.dtype != dtype:
            raise ValueError(f"{self.name} optimizer state of {numel} parameters: expected {n} {dtype} elements, "
                             f"got {data.numel()} {data.dtype}")
        return data

    @abc.abstractmethod
    def step_cpu(self, flat: torch.Tensor, numel: int, grad: torch.Tensor, out: Optional[torch.Tensor], hyper: dict,
                 step: int, grad_scale: float, threads: int) -> torch.Tensor:
        """One step of a host state in place with ``grad`` (host, fp32 or bf16, contiguous; divided
        by ``grad_scale`` on the way), ``step`` the step count after this one; with ``out`` (a bf16
        home of ``numel``), the new weights are cast into it in the same pass. Returns the master."""

    @abc.abstractmethod
    def step_torch(self, flat: torch.Tensor, numel: int, grad: torch.Tensor, hyper: dict, step: torch.Tensor,
                   inv_factor: Optional[torch.Tensor]) -> None:
        """One step of a state in place with torch's kernels, on whatever device ``flat`` is
        (the streamed device step, and the CPU path without the one-pass kernel); ``grad`` fp32 on
        the same device, ``step`` a scalar tensor there, ``inv_factor`` what grad is divided by."""

    @abc.abstractmethod
    def step_device(self, flat: torch.Tensor, numel: int, grad: torch.Tensor, out: torch.Tensor, hyper: dict,
                    step: torch.Tensor, inv_factor: Optional[torch.Tensor]) -> None:
        """One step of a state kept on the compute device (``OffloadOptimizer.to_device``), on the
        current stream, ``grad`` in any float dtype there; the new weights are cast into ``out``
        (the unit's device buffer). ``step`` is the device scalar of the count (already advanced)."""


class AdamFp32(OptimStateFormat):
    """fp32 master and Adam/AdamW moments: ``[master | exp_avg | exp_avg_sq]``, 12 bytes a
    parameter. On the CPU the one-pass C++ kernel (``_C.adam_step``: 28 bytes of memory traffic a
    parameter, the bf16 weights written in the same pass); on the device torch's fused kernel."""

    name = "fp32"
    bytes_per_param = 12

    def __init__(self, adam_w: bool) -> None:
        self.adam_w = bool(adam_w)

    def home_spec(self, numel: int) -> tuple[int, torch.dtype]:
        return 3 * numel, torch.float32

    def init(self, flat: torch.Tensor, numel: int, values: torch.Tensor) -> None:
        flat[:numel].copy_(values)
        flat[numel:].zero_()

    def master(self, flat: torch.Tensor, numel: int) -> torch.Tensor:
        return flat[:numel]

    def step_cpu(self, flat: torch.Tensor, numel: int, grad: torch.Tensor, out: Optional[torch.Tensor], hyper: dict,
                 step: int, grad_scale: float, threads: int) -> torch.Tensor:
        from pyinfinity import _C

        n = numel
        _C.adam_step(flat.data_ptr(), flat.data_ptr() + 4 * n, flat.data_ptr() + 8 * n, grad.data_ptr(),
                     1 if grad.dtype == torch.bfloat16 else 0, out.data_ptr() if out is not None else 0, n,
                     hyper["lr"], hyper["beta1"], hyper["beta2"], hyper["eps"], hyper["weight_decay"],
                     self.adam_w, step, grad_scale, threads)
        return flat[:n]

    def _kernel(self):  # noqa: ANN202 - torch's private fused kernels
        return torch._fused_adamw_ if self.adam_w else torch._fused_adam_

    def step_torch(self, flat: torch.Tensor, numel: int, grad: torch.Tensor, hyper: dict, step: torch.Tensor,
                   inv_factor: Optional[torch.Tensor]) -> None:
        n = numel
        # unscaling/clipping happens inside the kernel (it divides by grad_scale): no extra pass
        self._kernel()([flat[:n]], [grad], [flat[n:2 * n]], [flat[2 * n:]], [], [step], lr=hyper["lr"],
                       beta1=hyper["beta1"], beta2=hyper["beta2"], weight_decay=hyper["weight_decay"],
                       eps=hyper["eps"], amsgrad=False, maximize=False, grad_scale=inv_factor)

    def step_device(self, flat: torch.Tensor, numel: int, grad: torch.Tensor, out: torch.Tensor, hyper: dict,
                    step: torch.Tensor, inv_factor: Optional[torch.Tensor]) -> None:
        n, kernel = numel, self._kernel()
        for a in range(0, n, DEVICE_CHUNK):  # Adam is elementwise: the fp32 gradient a chunk at a time
            b = min(n, a + DEVICE_CHUNK)
            gc = grad[a:b] if grad.dtype == torch.float32 else grad[a:b].float()
            master = flat[a:b]
            kernel([master], [gc], [flat[n + a:n + b]], [flat[2 * n + a:2 * n + b]], [], [step], lr=hyper["lr"],
                   beta1=hyper["beta1"], beta2=hyper["beta2"], weight_decay=hyper["weight_decay"], eps=hyper["eps"],
                   amsgrad=False, maximize=False, grad_scale=inv_factor)
            out[a:b].copy_(master)


__all__ = ["AdamFp32", "DEVICE_CHUNK", "OptimStateFormat"]
