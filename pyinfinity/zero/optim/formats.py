"""The optimizer state's format: how one shard's state is laid out in its home and stepped.

Everything else in the optimizer (where homes live, the NVMe pipeline, the background worker,
gradient intake, device placement) goes through :class:`OptimStateFormat` and never looks inside
a home. A format says what a parameter's state costs, allocates a shard's home and fills it from
the fp32 weights, gives the fp32 master values of a home (for the weights, checkpoints and
export), turns a home into what a checkpoint stores and back, and steps a home on the CPU and on
the compute device. Three are built in (``make_state_format`` picks the one
``Config.optimizer_state_format`` names; docs/optimizer_state.md):

* :class:`AdamFp32` (the default, exact): fp32 master and Adam/AdamW moments,
  ``[master | exp_avg | exp_avg_sq]`` in one flat fp32 home (one read and one write per shard per
  step);
* :class:`Adam8bit`: the fp32 master and block-quantised 8-bit moments in one byte home
  (``zero.state_formats.layout_8bit``), shards below ``MIN_QUANTIZED_NUMEL`` kept in fp32;
* :class:`AdamBf16` (DeepSpeed's bf16 master and moments): ``[master | exp_avg | exp_avg_sq]`` in bf16.

Homes on NVMe move in the format's own form (bytes of its home). ``bytes_per_param`` is what the
engine's capacity checks charge; the planner charges ``config.STATE_FORMATS``.
"""
from __future__ import annotations

import abc
from typing import Optional

import torch

from pyinfinity.config import QUANT_BLOCK, STATE_FORMATS
from pyinfinity.layout.pools import home_bytes_per_param
from pyinfinity.swap.tensor_swapper import SwapRecord, Tier, TensorSwapper, aligned_empty
from pyinfinity.zero.state_formats import (AdamHyper, Adam8bitState, cpu_step_8bit, cpu_step_bf16, dequantize_moments,
                                           device_step_8bit, device_step_bf16, quantize_moments, state_nbytes,
                                           views_8bit)

DEVICE_CHUNK = 16 << 20  # elements of a device-stepped unit converted to fp32 at a time (plan.placement counts it)
#: the elements [a, b) of a shard one step call covers (None: all of them; ``optim.groups``)
Span = Optional[tuple[int, int]]


def _span(span: Span, numel: int) -> tuple[int, int]:
    return span if span is not None else (0, numel)


class OptimStateFormat(abc.ABC):
    """How one shard's optimizer state is stored and stepped. ``flat`` is always the whole home
    of one shard (in RAM, a staging buffer of a home on NVMe, or its copy on the device);
    ``numel`` is the shard's parameter count; ``hyper`` holds lr, beta1, beta2, eps and
    weight_decay."""

    name: str = ""
    bytes_per_param: float = 0  # bytes of a home per parameter (RAM, disk; the device copy costs the same)
    adam_w: bool = True  # AdamW's decoupled weight decay (False: Adam's L2 decay, added to the gradient)
    master_fp32: bool = True  # the master is stored in fp32

    @property
    def decoupled_decay(self) -> bool:
        """Whether AdamW's decoupled decay can be applied to the fp32 master before the step, so
        ranges that differ only in weight decay step in one call (``optim.groups``)."""
        return self.adam_w and self.master_fp32

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
                 step: int, grad_scale: float, threads: int, *, span: Span = None) -> torch.Tensor:
        """One step of a host state in place with ``grad`` (host, fp32 or bf16, contiguous; divided
        by ``grad_scale`` on the way), ``step`` the step count after this one; with ``out`` (a bf16
        home of ``numel``), the new weights are cast into it in the same pass. Returns the master.
        ``span``: only the shard's elements ``[a, b)`` are stepped (every step method takes it)."""

    @abc.abstractmethod
    def step_torch(self, flat: torch.Tensor, numel: int, grad: torch.Tensor, hyper: dict, step: torch.Tensor,
                   inv_factor: Optional[torch.Tensor], *, count: int, scale: float, span: Span = None) -> None:
        """One step of a state in place with torch's kernels, on whatever device ``flat`` is
        (the streamed device step, and the CPU path without the one-pass kernel); ``grad`` fp32 on
        the same device, ``step`` a scalar tensor there, ``inv_factor`` what grad is divided by;
        ``count`` and ``scale`` the same two as host numbers (a format whose step needs them on the
        host reads these, never the tensors: no synchronisation)."""

    @abc.abstractmethod
    def step_device(self, flat: torch.Tensor, numel: int, grad: torch.Tensor, out: torch.Tensor, hyper: dict,
                    step: torch.Tensor, inv_factor: Optional[torch.Tensor], *, count: int, scale: float,
                    span: Span = None) -> None:
        """One step of a state kept on the compute device (``OffloadOptimizer.to_device``), on the
        current stream, ``grad`` in any float dtype there; the new weights are cast into ``out``
        (the unit's device buffer). ``step`` is the device scalar of the count (already advanced);
        ``count`` and ``scale`` as for ``step_torch``."""

    def to_fp32(self, flat: torch.Tensor, numel: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(master, exp_avg, exp_avg_sq) of a state in fp32 (decoded where stored compressed): what
        converting a checkpoint of this format into another starts from."""
        raise NotImplementedError(f"the {self.name} optimizer state cannot be converted from")

    def from_fp32(self, master: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor) -> torch.Tensor:
        """A home of this format (in RAM) holding the fp32 state given (encoded where stored
        compressed): the other half of a conversion."""
        raise NotImplementedError(f"the {self.name} optimizer state cannot be converted into")

    def nbytes(self, numel: int) -> int:
        """Bytes of the home of a shard of ``numel`` parameters."""
        n, dtype = self.home_spec(numel)
        return n * torch.empty((), dtype=dtype).element_size()


class _MasterThenMoments(OptimStateFormat):
    """A home laid out ``[master | exp_avg | exp_avg_sq]``, each ``numel`` long, in one dtype."""

    def __init__(self, adam_w: bool) -> None:
        self.adam_w = bool(adam_w)

    @staticmethod
    def _parts(flat: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return flat[:n], flat[n:2 * n], flat[2 * n:3 * n]

    def init(self, flat: torch.Tensor, numel: int, values: torch.Tensor) -> None:
        flat[:numel].copy_(values)
        flat[numel:].zero_()

    def master(self, flat: torch.Tensor, numel: int) -> torch.Tensor:
        return flat[:numel]


class AdamFp32(_MasterThenMoments):
    """fp32 master and Adam/AdamW moments: ``[master | exp_avg | exp_avg_sq]``, 12 bytes a
    parameter. On the CPU the one-pass C++ kernel (``_C.adam_step``: 28 bytes of memory traffic a
    parameter, the bf16 weights written in the same pass); on the device torch's fused kernel."""

    name = "fp32"
    bytes_per_param = home_bytes_per_param(STATE_FORMATS["fp32"])

    def home_spec(self, numel: int) -> tuple[int, torch.dtype]:
        return 3 * numel, torch.float32

    def to_fp32(self, flat: torch.Tensor, numel: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self._parts(flat, numel)

    def from_fp32(self, master: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor) -> torch.Tensor:
        return torch.cat([master.float(), exp_avg.float(), exp_avg_sq.float()])

    def step_cpu(self, flat: torch.Tensor, numel: int, grad: torch.Tensor, out: Optional[torch.Tensor], hyper: dict,
                 step: int, grad_scale: float, threads: int, *, span: Span = None) -> torch.Tensor:
        from pyinfinity import _C

        n = numel
        a, b = _span(span, n)
        at = flat.data_ptr() + 4 * a  # a range is the same kernel over pointers moved to its first element
        _C.adam_step(at, at + 4 * n, at + 8 * n, grad.data_ptr() + a * grad.element_size(),
                     1 if grad.dtype == torch.bfloat16 else 0, out.data_ptr() + 2 * a if out is not None else 0, b - a,
                     hyper["lr"], hyper["beta1"], hyper["beta2"], hyper["eps"], hyper["weight_decay"],
                     self.adam_w, step, grad_scale, threads)
        return flat[:n]

    def _kernel(self):  # noqa: ANN202 - torch's private fused kernels
        return torch._fused_adamw_ if self.adam_w else torch._fused_adam_

    def step_torch(self, flat: torch.Tensor, numel: int, grad: torch.Tensor, hyper: dict, step: torch.Tensor,
                   inv_factor: Optional[torch.Tensor], *, count: int = 0, scale: float = 1.0,
                   span: Span = None) -> None:
        n = numel
        a, b = _span(span, n)
        # unscaling/clipping happens inside the kernel (it divides by grad_scale): no extra pass
        self._kernel()([flat[a:b]], [grad[a:b]], [flat[n + a:n + b]], [flat[2 * n + a:2 * n + b]], [], [step],
                       lr=hyper["lr"], beta1=hyper["beta1"], beta2=hyper["beta2"],
                       weight_decay=hyper["weight_decay"], eps=hyper["eps"], amsgrad=False, maximize=False,
                       grad_scale=inv_factor)

    def step_device(self, flat: torch.Tensor, numel: int, grad: torch.Tensor, out: torch.Tensor, hyper: dict,
                    step: torch.Tensor, inv_factor: Optional[torch.Tensor], *, count: int = 0,
                    scale: float = 1.0, span: Span = None) -> None:
        n, kernel = numel, self._kernel()
        start, end = _span(span, n)
        for a in range(start, end, DEVICE_CHUNK):  # Adam is elementwise: the fp32 gradient a chunk at a time
            b = min(end, a + DEVICE_CHUNK)
            gc = grad[a:b] if grad.dtype == torch.float32 else grad[a:b].float()
            master = flat[a:b]
            kernel([master], [gc], [flat[n + a:n + b]], [flat[2 * n + a:2 * n + b]], [], [step], lr=hyper["lr"],
                   beta1=hyper["beta1"], beta2=hyper["beta2"], weight_decay=hyper["weight_decay"], eps=hyper["eps"],
                   amsgrad=False, maximize=False, grad_scale=inv_factor)
            out[a:b].copy_(master)


def _hyper(hyper: dict, adam_w: bool, count: int, scale: float) -> AdamHyper:
    """The optimizer's hyperparameters and one step's count and gradient divisor for the
    compressed formats' steps (``zero.state_formats``)."""
    return AdamHyper(lr=hyper["lr"], beta1=hyper["beta1"], beta2=hyper["beta2"], eps=hyper["eps"],
                     weight_decay=hyper["weight_decay"], adamw=adam_w, step=int(count), grad_scale=float(scale))


class Adam8bit(OptimStateFormat):
    """``pyinfinity.optimizer_state: "8bit"``: the fp32 master and Adam's moments block-quantised
    to a byte each (``zero.state_formats``: E4M3 ``exp_avg``, unsigned E4M4 ``sqrt(exp_avg_sq)``,
    one fp32 scale per moment per block of 256), about 6.03 bytes a parameter. A home is a byte
    buffer in ``state_formats.layout_8bit``'s layout; a shard below ``MIN_QUANTIZED_NUMEL``
    elements keeps the fp32 state (``[master | exp_avg | exp_avg_sq]``) in its bytes. Stepped on
    the CPU by ``_C.adam_step_8bit`` (one pass); elsewhere by ``state_formats.device_step_8bit``
    (torch, in chunks), which gives the kernel's bits."""

    name = "8bit"
    bytes_per_param = home_bytes_per_param(STATE_FORMATS["8bit"])

    def __init__(self, adam_w: bool) -> None:
        self.adam_w = bool(adam_w)
        self._fp32 = AdamFp32(adam_w)

    @staticmethod
    def quantized(numel: int) -> bool:
        """Whether a shard of ``numel`` parameters keeps the 8-bit state (else fp32: below
        ``MIN_QUANTIZED_NUMEL``, ``StateFormat.shard_format``)."""
        return STATE_FORMATS["8bit"].shard_format(numel).name == "8bit"

    def home_spec(self, numel: int) -> tuple[int, torch.dtype]:
        return state_nbytes("8bit", numel), torch.uint8

    def _state(self, flat: torch.Tensor, numel: int) -> Adam8bitState:
        return views_8bit(flat, numel)

    def init(self, flat: torch.Tensor, numel: int, values: torch.Tensor) -> None:
        if not self.quantized(numel):
            return self._fp32.init(flat.view(torch.float32), numel, values)
        flat.zero_()  # codes and scales of zero moments
        self._state(flat, numel).master.copy_(values)

    def master(self, flat: torch.Tensor, numel: int) -> torch.Tensor:
        if not self.quantized(numel):
            return flat.view(torch.float32)[:numel]
        return self._state(flat, numel).master

    def to_fp32(self, flat: torch.Tensor, numel: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if not self.quantized(numel):
            return self._fp32.to_fp32(flat.view(torch.float32), numel)
        state = self._state(flat, numel)
        return (state.master, *dequantize_moments(state))

    def from_fp32(self, master: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor) -> torch.Tensor:
        n = master.numel()
        if not self.quantized(n):
            return self._fp32.from_fp32(master, exp_avg, exp_avg_sq).view(torch.uint8)
        flat = torch.zeros(state_nbytes("8bit", n), dtype=torch.uint8)
        src = quantize_moments(exp_avg.float(), exp_avg_sq.float(), master.float())
        for dst, t in zip(self._state(flat, n).tensors(), src.tensors()):
            dst.copy_(t)
        return flat

    def _span_of(self, flat: torch.Tensor, numel: int, span: Span) -> Adam8bitState:
        """The state of the elements ``span`` covers (views): whole blocks of the moments' scales,
        so a span starts on a block boundary (``OffloadOptimizer.set_param_groups`` refuses others)."""
        state = self._state(flat, numel)
        if span is None:
            return state
        a, b = span
        if a % QUANT_BLOCK or (b % QUANT_BLOCK and b != numel):
            raise ValueError(f"8bit optimizer state: a step over elements [{a}, {b}) splits a quantisation block "
                             f"of {QUANT_BLOCK}")
        blocks = slice(a // QUANT_BLOCK, -(-b // QUANT_BLOCK))
        return Adam8bitState(state.master[a:b], state.exp_avg[a:b], state.exp_avg_sq[a:b],
                             state.exp_avg_scale[blocks], state.exp_avg_sq_scale[blocks])

    @staticmethod
    def _cut(t: Optional[torch.Tensor], span: Span) -> Optional[torch.Tensor]:
        return t if t is None or span is None else t[span[0]:span[1]]

    def step_cpu(self, flat: torch.Tensor, numel: int, grad: torch.Tensor, out: Optional[torch.Tensor], hyper: dict,
                 step: int, grad_scale: float, threads: int, *, span: Span = None) -> torch.Tensor:
        if not self.quantized(numel):
            return self._fp32.step_cpu(flat.view(torch.float32), numel, grad, out, hyper, step, grad_scale, threads,
                                       span=span)
        cpu_step_8bit(self._span_of(flat, numel, span), self._cut(grad, span),
                      _hyper(hyper, self.adam_w, step, grad_scale), self._cut(out, span), threads=threads)
        return self._state(flat, numel).master

    def step_torch(self, flat: torch.Tensor, numel: int, grad: torch.Tensor, hyper: dict, step: torch.Tensor,
                   inv_factor: Optional[torch.Tensor], *, count: int, scale: float, span: Span = None) -> None:
        if not self.quantized(numel):
            return self._fp32.step_torch(flat.view(torch.float32), numel, grad, hyper, step, inv_factor, span=span)
        device_step_8bit(self._span_of(flat, numel, span), self._cut(grad, span),
                         _hyper(hyper, self.adam_w, count, scale))

    def step_device(self, flat: torch.Tensor, numel: int, grad: torch.Tensor, out: torch.Tensor, hyper: dict,
                    step: torch.Tensor, inv_factor: Optional[torch.Tensor], *, count: int, scale: float,
                    span: Span = None) -> None:
        if not self.quantized(numel):
            return self._fp32.step_device(flat.view(torch.float32), numel, grad, out, hyper, step, inv_factor,
                                          span=span)
        device_step_8bit(self._span_of(flat, numel, span), self._cut(grad, span),
                         _hyper(hyper, self.adam_w, count, scale), out=self._cut(out, span))


class AdamBf16(_MasterThenMoments):
    """DeepSpeed's ``bf16.bf16_master_weights_and_grads`` + ``bf16.bf16_optimizer_states``: a bf16
    master and bf16 moments, ``[master | exp_avg | exp_avg_sq]`` in one bf16 home (6 bytes a
    parameter), stepped in fp32 and rounded to nearest even (``_C.adam_step_bf16`` on the CPU,
    ``state_formats.device_step_bf16`` elsewhere: the same bits). The master is a bf16 copy of the
    weights kept with the moments, so the gradient lands in the weights' home as for the other
    formats; the new weights are the master, copied into it after the step."""

    name = "bf16"
    master_fp32 = False
    # the bf16 master with the moments: what the planner charges for the state (4) and for the
    # gradient buffer a master in the weights' home would need (2)
    # the master is the weights' home: a gradient slot of its own beside it
    bytes_per_param = home_bytes_per_param(STATE_FORMATS["bf16"])

    def home_spec(self, numel: int) -> tuple[int, torch.dtype]:
        return 3 * numel, torch.bfloat16

    def to_fp32(self, flat: torch.Tensor, numel: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return tuple(t.float() for t in self._parts(flat, numel))  # type: ignore[return-value]

    def from_fp32(self, master: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor) -> torch.Tensor:
        return torch.cat([master, exp_avg, exp_avg_sq]).to(torch.bfloat16)  # nearest even

    def _span_parts(self, flat: torch.Tensor, numel: int, span: Span) -> tuple[torch.Tensor, ...]:
        a, b = _span(span, numel)
        return tuple(t[a:b] for t in self._parts(flat, numel))

    def step_cpu(self, flat: torch.Tensor, numel: int, grad: torch.Tensor, out: Optional[torch.Tensor], hyper: dict,
                 step: int, grad_scale: float, threads: int, *, span: Span = None) -> torch.Tensor:
        a, b = _span(span, numel)
        p, m, v = self._span_parts(flat, numel, span)
        # out: the weights' home (where the gradient was), written with the new weights in the kernel's pass
        cpu_step_bf16(p, m, v, grad[a:b], _hyper(hyper, self.adam_w, step, grad_scale), threads=threads,
                      out=out[a:b] if out is not None else None)
        return self._parts(flat, numel)[0]

    def step_torch(self, flat: torch.Tensor, numel: int, grad: torch.Tensor, hyper: dict, step: torch.Tensor,
                   inv_factor: Optional[torch.Tensor], *, count: int, scale: float, span: Span = None) -> None:
        a, b = _span(span, numel)
        device_step_bf16(*self._span_parts(flat, numel, span), grad[a:b], _hyper(hyper, self.adam_w, count, scale))

    def step_device(self, flat: torch.Tensor, numel: int, grad: torch.Tensor, out: torch.Tensor, hyper: dict,
                    step: torch.Tensor, inv_factor: Optional[torch.Tensor], *, count: int, scale: float,
                    span: Span = None) -> None:
        a, b = _span(span, numel)
        device_step_bf16(*self._span_parts(flat, numel, span), grad[a:b], _hyper(hyper, self.adam_w, count, scale),
                         out=out[a:b])


# the class of each ``Config.optimizer_state_format`` (a key of ``config.STATE_FORMATS``): the
# training state builds its optimizer's format from this table
FORMAT_CLASSES: dict[str, type[OptimStateFormat]] = {"fp32": AdamFp32, "8bit": Adam8bit, "bf16": AdamBf16}


def make_state_format(name: str, adam_w: bool) -> OptimStateFormat:
    """The format of ``Config.optimizer_state_format`` (``FORMAT_CLASSES``)."""
    if name not in FORMAT_CLASSES:
        raise ValueError(f"optimizer state format: expected one of {', '.join(FORMAT_CLASSES)}, got {name!r}")
    return FORMAT_CLASSES[name](adam_w)


def convert_home(data: torch.Tensor, numel: int, src: OptimStateFormat, dst: OptimStateFormat) -> torch.Tensor:
    """A home of format ``src`` (e.g. a checkpoint's) as a home of ``dst``: unchanged when the two
    are one format, else decoded to fp32 and encoded again (a page-aligned host tensor)."""
    if src.name == dst.name:
        return data
    new = dst.from_fp32(*src.to_fp32(data, numel))
    out = aligned_empty(new.numel(), new.dtype)
    out.copy_(new)
    return out


__all__ = ["Adam8bit", "AdamBf16", "AdamFp32", "DEVICE_CHUNK", "OptimStateFormat", "Span", "convert_home",
           "make_state_format"]
