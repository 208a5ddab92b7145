"""The numerics of the optimizer-state formats (``pyinfinity.config.STATE_FORMATS``): the 8-bit
codes, a pure-torch reference step of each compressed format, the step for units stepped on the
compute device (the build's CUDA kernels there, ``zero.cuda_steps``, else torch), the CPU kernels'
wrappers, and the memory layout of a shard's state.

Formats (docs/optimizer_state.md has the choice and its measurements):

* ``"fp32"``: ``[master | exp_avg | exp_avg_sq]`` in fp32, 12 bytes a parameter (the exact default;
  ``_C.adam_step``).
* ``"8bit"``: the fp32 master, and per block of :data:`QUANT_BLOCK` (256) parameters counted from
  the start of the shard: ``exp_avg`` as E4M3 codes (sign, 4 exponent bits, 3 mantissa bits, bias
  7, subnormals: torch.float8_e4m3fn's encoding of finite values) of ``exp_avg / scale`` with
  ``scale = absmax / 448``, and ``sqrt(exp_avg_sq)`` as unsigned E4M4 codes (4 exponent bits, 4
  mantissa bits, bias 15, subnormals, largest 1.9375) of ``sqrt(exp_avg_sq) / scale`` with
  ``scale = absmax / 1.9375``. Both round to nearest even; a non-zero second moment never becomes
  0 (the smallest code instead). 6.03 bytes a parameter (``_C.adam_step_8bit``). Shards below
  :data:`MIN_QUANTIZED_NUMEL` elements keep the fp32 state.
* ``"bf16"``: the bf16 weights are the master, ``exp_avg`` and ``exp_avg_sq`` bf16, everything
  stepped in fp32 and rounded to nearest even as DeepSpeed's CPU Adam does; 4 bytes a parameter
  besides the weights (``_C.adam_step_bf16``).

Every compressed step runs the same operations in the same order: the CPU kernels (each instruction
set, compiled without FMA contraction), :func:`reference_step_8bit` / :func:`reference_step_bf16`
(written for reading: the codes by a search of their value tables) and :func:`device_step_8bit` /
:func:`device_step_bf16` (written for the device: bit arithmetic, in chunks, no Python loop over
blocks) compute the same bits on the CPU, which the tests check.
"""
from __future__ import annotations

import math
import struct
from dataclasses import dataclass
from typing import Optional

import torch

from pyinfinity.config import MIN_QUANTIZED_NUMEL, QUANT_BLOCK, STATE_FORMATS, StateFormat
from pyinfinity.zero.cuda_steps import (DEVICE_STEP_IMPLS, OUT_TYPES_8BIT, cuda_kernels, device_impl, step_8bit_cuda,
                                        step_bf16_cuda)

EXP_AVG_CODE_MAX = 448.0
"""The largest E4M3 value: a block's largest |exp_avg| is stored as it."""

EXP_AVG_SQ_CODE_MAX = 1.9375
"""The largest unsigned E4M4 value: a block's largest sqrt(exp_avg_sq) is stored as it."""

DEVICE_CHUNK = 1 << 22
"""Elements :func:`device_step_8bit` / :func:`device_step_bf16` step at a time (a multiple of
QUANT_BLOCK): their fp32 temporaries are about DEVICE_SCRATCH_PER_ELEMENT bytes an element of it."""

DEVICE_SCRATCH_PER_ELEMENT = 40
"""Bytes of temporaries an element of a chunk costs the torch step at its peak (the gradient and
both moments in fp32, the master's new value and two operands of the operation in flight)."""

_SECTION_ALIGN = 64  # each array of a shard's 8-bit home starts on a cache line

__all__ = ["QUANT_BLOCK", "MIN_QUANTIZED_NUMEL", "EXP_AVG_CODE_MAX", "EXP_AVG_SQ_CODE_MAX", "DEVICE_CHUNK",
           "AdamHyper", "Adam8bitState", "Layout8bit", "state_format", "bytes_per_param", "state_nbytes", "layout_8bit",
           "views_8bit", "e4m3_values", "ue4m4_values", "encode_e4m3", "decode_e4m3", "encode_ue4m4",
           "decode_ue4m4", "quantize_moments", "dequantize_moments", "reference_step_8bit",
           "reference_step_bf16", "device_step_8bit", "device_step_bf16", "cpu_step_8bit", "cpu_step_bf16",
           "DEVICE_STEP_IMPLS", "cuda_kernels"]


# ----------------------------------------------------------------------------- formats and sizes


def state_format(name: str) -> StateFormat:
    """The format named ``name`` ("fp32", "8bit", "bf16")."""
    try:
        return STATE_FORMATS[name]
    except KeyError:
        raise ValueError(f"optimizer state format: expected one of {', '.join(STATE_FORMATS)}, got {name!r}") from None


def bytes_per_param(name: str) -> float:
    """Host RAM or disk bytes a parameter of optimizer state in format ``name`` costs (master,
    moments and scales; the weights in the compute dtype come on top)."""
    return state_format(name).state_bytes


def _align(n: int) -> int:
    return -(-n // _SECTION_ALIGN) * _SECTION_ALIGN


@dataclass(frozen=True)
class Layout8bit:
    """Byte offsets of the arrays of one shard's 8-bit state in one buffer, and its size."""

    numel: int
    master: int
    exp_avg_scale: int
    exp_avg_sq_scale: int
    exp_avg: int
    exp_avg_sq: int
    nbytes: int


def layout_8bit(numel: int) -> Layout8bit:
    """``[master fp32 | exp_avg scales | exp_avg_sq scales | exp_avg codes | exp_avg_sq codes]``,
    each array on a 64-byte boundary."""
    blocks = -(-numel // QUANT_BLOCK)
    master = 0
    s1 = _align(master + 4 * numel)
    s2 = _align(s1 + 4 * blocks)
    c1 = _align(s2 + 4 * blocks)
    c2 = _align(c1 + numel)
    return Layout8bit(numel, master, s1, s2, c1, c2, _align(c2 + numel))


def state_nbytes(name: str, numel: int) -> int:
    """Bytes of one shard's optimizer state home in format ``name`` (the 8-bit state of a shard
    below MIN_QUANTIZED_NUMEL elements is fp32; the bf16 master is the weights' own home)."""
    fmt = state_format(name).shard_format(numel)
    if fmt.name == "8bit":
        return layout_8bit(numel).nbytes
    return int(fmt.state_bytes) * numel


@dataclass
class Adam8bitState:
    """The 8-bit state of one shard: five tensors on one device (views of one buffer when made by
    :func:`views_8bit`)."""

    master: torch.Tensor  # fp32, numel
    exp_avg: torch.Tensor  # uint8 E4M3 codes, numel
    exp_avg_sq: torch.Tensor  # uint8 unsigned E4M4 codes of the root, numel
    exp_avg_scale: torch.Tensor  # fp32, one per block
    exp_avg_sq_scale: torch.Tensor  # fp32, one per block

    @property
    def numel(self) -> int:
        return self.master.numel()

    @classmethod
    def zeros(cls, numel: int, device: torch.device | str = "cpu") -> "Adam8bitState":
        blocks = -(-numel // QUANT_BLOCK)
        return cls(torch.zeros(numel, device=device), torch.zeros(numel, dtype=torch.uint8, device=device),
                   torch.zeros(numel, dtype=torch.uint8, device=device), torch.zeros(blocks, device=device),
                   torch.zeros(blocks, device=device))

    def clone(self) -> "Adam8bitState":
        return Adam8bitState(*(t.clone() for t in self.tensors()))

    def tensors(self) -> tuple[torch.Tensor, ...]:
        return self.master, self.exp_avg, self.exp_avg_sq, self.exp_avg_scale, self.exp_avg_sq_scale

    def check(self) -> None:
        """ValueError unless the five tensors are contiguous, on one device, of the right dtypes and sizes."""
        n, blocks = self.numel, -(-self.numel // QUANT_BLOCK)
        want = ((self.master, torch.float32, n, "master"), (self.exp_avg, torch.uint8, n, "exp_avg"),
                (self.exp_avg_sq, torch.uint8, n, "exp_avg_sq"), (self.exp_avg_scale, torch.float32, blocks,
                                                                     "exp_avg_scale"),
                (self.exp_avg_sq_scale, torch.float32, blocks, "exp_avg_sq_scale"))
        for t, dtype, size, name in want:
            if t.dtype != dtype or t.numel() != size or not t.is_contiguous() or t.device != self.master.device:
                raise ValueError(f"Adam8bitState.{name}: expected {size} contiguous {dtype} on {self.master.device}, "
                                 f"got {t.numel()} {t.dtype} on {t.device}")


def views_8bit(buf: torch.Tensor, numel: int) -> Adam8bitState:
    """The arrays of a shard's 8-bit state as views of ``buf`` (a contiguous uint8 tensor of at least
    ``layout_8bit(numel).nbytes`` bytes whose start is 64-byte aligned)."""
    lay = layout_8bit(numel)
    if buf.dtype != torch.uint8 or not buf.is_contiguous() or buf.numel() < lay.nbytes:
        raise ValueError(f"views_8bit: need a contiguous uint8 buffer of {lay.nbytes} bytes, got {buf.numel()} "
                         f"{buf.dtype}")
    blocks = -(-numel // QUANT_BLOCK)

    def part(off: int, count: int, dtype: torch.dtype) -> torch.Tensor:
        size = torch.empty((), dtype=dtype).element_size()
        return buf[off:off + count * size].view(dtype)

    return Adam8bitState(part(lay.master, numel, torch.float32), part(lay.exp_avg, numel, torch.uint8),
                         part(lay.exp_avg_sq, numel, torch.uint8), part(lay.exp_avg_scale, blocks, torch.float32),
                         part(lay.exp_avg_sq_scale, blocks, torch.float32))


# ----------------------------------------------------------------------------- hyperparameters


def _f32(x: float) -> float:
    """``x`` rounded to the nearest fp32 value (as C++ converts a double to float)."""
    return struct.unpack("f", struct.pack("f", x))[0]


@dataclass(frozen=True)
class AdamHyper:
    """One step's hyperparameters, as the optimizer hands them to every step of every format."""

    lr: float
    beta1: float = 0.9
    beta2: float = 0.999
    eps: float = 1e-8
    weight_decay: float = 0.0
    adamw: bool = True
    step: int = 1  # the step being taken, 1 for the first (bias corrections)
    grad_scale: float = 1.0  # the gradient is divided by it (loss scale x clipping)

    def check(self) -> None:
        if self.step < 1:
            raise ValueError(f"AdamHyper.step must be >= 1, got {self.step}")
        if not (self.grad_scale > 0 and math.isfinite(self.grad_scale)):
            raise ValueError(f"AdamHyper.grad_scale must be a positive number, got {self.grad_scale}")

    def coefficients(self) -> dict[str, float]:
        """The per-step constants exactly as the C++ steps compute them (``detail::adam_coeffs``):
        fp32 inputs, bias corrections in double, each rounded once to fp32."""
        self.check()
        lr, b1, b2, wd, gs = (_f32(x) for x in (self.lr, self.beta1, self.beta2, self.weight_decay, self.grad_scale))
        bc1 = 1.0 - math.pow(b1, self.step)
        bc2 = 1.0 - math.pow(b2, self.step)
        return {"one_minus_beta1": _f32(1.0 - b1), "beta2": b2, "one_minus_beta2": _f32(1.0 - b2),
                "eps": _f32(self.eps), "step_size": _f32(lr / bc1), "decay": _f32(lr * wd) if self.adamw else 0.0,
                "l2": 0.0 if self.adamw else wd, "inv_scale": _f32(1.0 / gs),
                "inv_bias2_sqrt": _f32(1.0 / math.sqrt(bc2))}

    def kernel_args(self) -> tuple:
        """(lr, beta1, beta2, eps, weight_decay, adamw, step, grad_scale) for the ``_C`` steps."""
        return (self.lr, self.beta1, self.beta2, self.eps, self.weight_decay, bool(self.adamw), int(self.step),
                self.grad_scale)


def _sqrt(x: torch.Tensor) -> torch.Tensor:
    """The correctly rounded fp32 square root, as the kernels' sqrt instruction computes it. torch's
    CPU sqrt of fp32 is not (SLEEF's, within an ulp): there the root is taken in fp64 and rounded once
    (exact: fp64 has more than twice fp32's precision). On CUDA torch's sqrtf is correctly rounded."""
    return torch.sqrt(x) if x.is_cuda else torch.sqrt(x.double()).float()


def _adam_elementwise(g: torch.Tensor, p: torch.Tensor, m: torch.Tensor, v: torch.Tensor,
                      c: dict[str, float]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """One step of fp32 tensors, one rounded operation at a time in the C++ steps' order
    (``adam_element``): returns the new (weights, exp_avg, exp_avg_sq, sqrt(exp_avg_sq))."""
    g = g * c["inv_scale"]
    g = g + p * c["l2"]  # unconditional, as in the kernels: adding a zero product can change a zero's sign
    p = p - p * c["decay"]
    m = m + (g - m) * c["one_minus_beta1"]
    v = v * c["beta2"] + (g * c["one_minus_beta2"]) * g
    root = _sqrt(v)
    denom = root * c["inv_bias2_sqrt"] + c["eps"]
    p = p - (m / denom) * c["step_size"]
    return p, m, v, root


# ----------------------------------------------------------------------------- the 8-bit codes


def e4m3_values() -> torch.Tensor:
    """The 256 E4M3 values by code (fp32). Codes 0x7f and 0xff (float8_e4m3fn's NaN) decode to
    +-480 here; the encoder never writes them."""
    codes = torch.arange(256, dtype=torch.int32)
    e, f = (codes >> 3) & 0xF, codes & 7
    mag = torch.where(e == 0, f.float() * 2.0 ** -9, (1.0 + f.float() / 8) * torch.pow(2.0, (e - 7).float()))
    return torch.where(codes >= 128, -mag, mag)


def ue4m4_values() -> torch.Tensor:
    """The 256 unsigned E4M4 values by code (fp32), increasing; largest 1.9375."""
    codes = torch.arange(256, dtype=torch.int32)
    e, f = codes >> 4, codes & 15
    return torch.where(e == 0, f.float() * 2.0 ** -18, (1.0 + f.float() / 16) * torch.pow(2.0, (e - 15).float()))


def _encode_magnitude(x: torch.Tensor, mbits: int, bias: int) -> torch.Tensor:
    """fp32 magnitudes (finite, >= 0, at most the format's largest) -> int32 codes, nearest even:
    the C++ ``encode_magnitude`` in tensor operations."""
    shift = 23 - mbits
    u = x.view(torch.int32)
    rounded = (u + ((1 << (shift - 1)) - 1) + ((u >> shift) & 1)) >> shift
    normal = rounded - ((127 - bias) << mbits)
    magic = torch.tensor(2.0 ** (24 - bias - mbits), dtype=torch.float32, device=x.device)
    sub = (x + magic).view(torch.int32) - magic.view(torch.int32)
    return torch.where(x < 2.0 ** (1 - bias), sub, normal)


def encode_e4m3(x: torch.Tensor) -> torch.Tensor:
    """fp32 -> uint8 E4M3 codes (nearest even; beyond 448 and infinities saturate to +-448, NaN to
    +448 whatever its sign bit, which differs between machines)."""
    x = x.float().contiguous()
    u = x.view(torch.int32)
    sign = ((u >> 24) & 0x80).masked_fill_(torch.isnan(x), 0)
    mag = torch.clamp(x.abs(), max=EXP_AVG_CODE_MAX).nan_to_num_(nan=EXP_AVG_CODE_MAX)
    return (sign | _encode_magnitude(mag, 3, 7)).to(torch.uint8)


def decode_e4m3(codes: torch.Tensor) -> torch.Tensor:
    """uint8 E4M3 codes -> fp32."""
    c = codes.to(torch.int32)
    mag, sign = c & 0x7F, (c & 0x80) << 24
    e, f = mag >> 3, mag & 7
    normal = ((e + 120) << 23) | (f << 20)
    sub = (f.float() * 2.0 ** -9).view(torch.int32)
    return (torch.where(e == 0, sub, normal) | sign).view(torch.float32)


def encode_ue4m4(x: torch.Tensor) -> torch.Tensor:
    """fp32 >= 0 -> uint8 unsigned E4M4 codes (nearest even; beyond 1.9375 and NaN saturate)."""
    mag = torch.clamp(x.float().abs(), max=EXP_AVG_SQ_CODE_MAX).nan_to_num_(nan=EXP_AVG_SQ_CODE_MAX).contiguous()
    return _encode_magnitude(mag, 4, 15).to(torch.uint8)


def decode_ue4m4(codes: torch.Tensor) -> torch.Tensor:
    """uint8 unsigned E4M4 codes -> fp32 (the bits of an IEEE half, shifted)."""
    c = codes.to(torch.int32)
    e, f = c >> 4, c & 15
    normal = ((e + 112) << 23) | (f << 19)
    sub = (f.float() * 2.0 ** -18).view(torch.int32)
    return torch.where(e == 0, sub, normal).view(torch.float32)


def _block_scales(largest: torch.Tensor, code_max: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(stored scale, encoder multiplier) per block from its largest magnitude, as the C++
    ``block_scales``: NaN for a non-finite block, zeros for one below the smallest normal fp32."""
    tiny = largest < torch.finfo(torch.float32).tiny
    bad = ~torch.isfinite(largest)
    top = torch.full_like(largest, code_max)  # tensor / tensor: torch divides a tensor by a Python
    scale = torch.where(tiny, torch.zeros_like(largest), largest / top)  # number as a multiplication
    scale = torch.where(bad, torch.full_like(largest, math.nan), scale)  # by its reciprocal on CUDA
    inv = torch.where(tiny | bad, torch.zeros_like(largest), top / largest)
    return scale, inv


def _blocks(x: torch.Tensor) -> torch.Tensor:
    """A flat tensor as [blocks, QUANT_BLOCK] (zero-padded: padding never raises a block's largest
    magnitude and is cut off again)."""
    pad = (-x.numel()) % QUANT_BLOCK
    if pad:
        x = torch.nn.functional.pad(x, (0, pad))
    return x.view(-1, QUANT_BLOCK)


def _largest(x: torch.Tensor) -> torch.Tensor:
    """Each block's largest magnitude, NaN if any element is NaN (torch's amax propagates NaN)."""
    return _blocks(x).abs().amax(dim=1)


def _encode_moments(m: torch.Tensor, root: torch.Tensor, state: Adam8bitState, sl: slice, bsl: slice) -> None:
    """New fp32 moments (the first, and the root of the second) of elements ``sl`` (whole blocks
    ``bsl``) -> codes and scales in ``state``, by bit arithmetic (the device path)."""
    n = m.numel()
    m_scale, m_inv = _block_scales(_largest(m), EXP_AVG_CODE_MAX)
    r_scale, r_inv = _block_scales(_largest(root), EXP_AVG_SQ_CODE_MAX)
    xm = (_blocks(m) * m_inv[:, None]).view(-1)[:n]
    xr = (_blocks(root) * r_inv[:, None]).view(-1)[:n]
    codes_r = encode_ue4m4(xr)
    codes_r = torch.where((codes_r == 0) & (root > 0), torch.ones_like(codes_r), codes_r)
    state.exp_avg[sl] = encode_e4m3(xm)
    state.exp_avg_sq[sl] = codes_r
    state.exp_avg_scale[bsl] = m_scale
    state.exp_avg_sq_scale[bsl] = r_scale


def _decode_moments(state: Adam8bitState, sl: slice, bsl: slice) -> tuple[torch.Tensor, torch.Tensor]:
    """(exp_avg, exp_avg_sq) of elements ``sl`` (whole blocks ``bsl``) in fp32, by bit arithmetic."""
    codes_m, codes_r = state.exp_avg[sl], state.exp_avg_sq[sl]
    n = codes_m.numel()
    m = (_blocks(decode_e4m3(codes_m)) * state.exp_avg_scale[bsl][:, None]).view(-1)[:n]
    r = (_blocks(decode_ue4m4(codes_r)) * state.exp_avg_sq_scale[bsl][:, None]).view(-1)[:n]
    return m, r * r


def quantize_moments(exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
                     master: Optional[torch.Tensor] = None) -> Adam8bitState:
    """fp32 moments -> an 8-bit state on their device (``master`` as its master, else zeros): e.g.
    to convert an fp32 state. The same codes as ``_C.quantize_moments``."""
    n = exp_avg.numel()
    if exp_avg_sq.numel() != n or (master is not None and master.numel() != n):
        raise ValueError(f"quantize_moments: sizes differ ({n}, {exp_avg_sq.numel()}"
                         f"{'' if master is None else f', {master.numel()}'})")
    state = Adam8bitState.zeros(n, exp_avg.device)
    if master is not None:
        state.master.copy_(master.reshape(-1))
    _encode_moments(exp_avg.reshape(-1).float(), _sqrt(exp_avg_sq.reshape(-1).float()), state, slice(None),
                    slice(None))
    return state


def dequantize_moments(state: Adam8bitState) -> tuple[torch.Tensor, torch.Tensor]:
    """The 8-bit state's moments as fp32 (exp_avg, exp_avg_sq)."""
    return _decode_moments(state, slice(None), slice(None))


# ----------------------------------------------------------------------------- reference steps


def _nearest_code(x: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """Codes of the values of ``table`` (increasing) nearest to ``x`` (within the table's range),
    ties to the even code: the definition the bit arithmetic implements."""
    mids = (table[1:] + table[:-1]) / 2  # exact: adjacent values of an 8-bit float
    idx = torch.bucketize(x, mids)  # mids[idx-1] < x <= mids[idx]: a tie goes to the lower code
    tie = (idx < mids.numel()) & (x == mids[idx.clamp(max=mids.numel() - 1)]) & (idx % 2 == 1)
    return idx + tie.to(idx.dtype)


def _reference_encode(m: torch.Tensor, root: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Codes and scales of a whole shard's new moments, by nearest search in the value tables."""
    n = m.numel()
    m_scale, m_inv = _block_scales(_largest(m), EXP_AVG_CODE_MAX)
    r_scale, r_inv = _block_scales(_largest(root), EXP_AVG_SQ_CODE_MAX)
    xm = (_blocks(m) * m_inv[:, None]).view(-1)[:n]
    xr = (_blocks(root) * r_inv[:, None]).view(-1)[:n]
    mag_table = e4m3_values()[:127]  # 0 .. 448
    mag = torch.clamp(xm.abs(), max=EXP_AVG_CODE_MAX).nan_to_num(nan=EXP_AVG_CODE_MAX)
    codes_m = _nearest_code(mag, mag_table) | ((torch.signbit(xm) & ~torch.isnan(xm)).to(torch.int64) << 7)
    codes_r = _nearest_code(torch.clamp(xr, max=EXP_AVG_SQ_CODE_MAX).nan_to_num(nan=EXP_AVG_SQ_CODE_MAX),
                            ue4m4_values())
    codes_r = torch.where((codes_r == 0) & (root > 0), torch.ones_like(codes_r), codes_r)
    return codes_m.to(torch.uint8), codes_r.to(torch.uint8), m_scale, r_scale


def reference_step_8bit(state: Adam8bitState, grad: torch.Tensor, hyper: AdamHyper,
                        out: Optional[torch.Tensor] = None) -> None:
    """One Adam/AdamW step of an 8-bit state in place, written for reading: decode through the value
    tables, step in fp32, encode each block by the nearest value (ties to even). ``grad``: fp32 or
    bf16, divided by ``hyper.grad_scale``; ``out``: the new weights in bf16 when given."""
    state.check()
    c = hyper.coefficients()
    n = state.numel
    m = (_blocks(e4m3_values()[state.exp_avg.long()]) * state.exp_avg_scale[:, None]).view(-1)[:n]
    r = (_blocks(ue4m4_values()[state.exp_avg_sq.long()]) * state.exp_avg_sq_scale[:, None]).view(-1)[:n]
    p, m, _, root = _adam_elementwise(grad.reshape(-1).float(), state.master, m, r * r, c)
    state.master.copy_(p)
    codes_m, codes_r, m_scale, r_scale = _reference_encode(m, root)
    state.exp_avg.copy_(codes_m)
    state.exp_avg_sq.copy_(codes_r)
    state.exp_avg_scale.copy_(m_scale)
    state.exp_avg_sq_scale.copy_(r_scale)
    if out is not None:
        out.copy_(p)


def reference_step_bf16(param: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor, grad: torch.Tensor,
                        hyper: AdamHyper) -> None:
    """One Adam/AdamW step in place of a bf16 master with bf16 moments: read as fp32, stepped in
    fp32, each rounded to nearest even (DeepSpeed's bf16_master_weights_and_grads +
    bf16_optimizer_states)."""
    c = hyper.coefficients()
    p, m, v, _ = _adam_elementwise(grad.reshape(-1).float(), param.float(), exp_avg.float(), exp_avg_sq.float(), c)
    param.copy_(p)
    exp_avg.copy_(m)
    exp_avg_sq.copy_(v)


# ----------------------------------------------------------------------------- device steps


def _check_chunk(chunk: int) -> None:
    if chunk <= 0 or chunk % QUANT_BLOCK:
        raise ValueError(f"chunk: must be a positive multiple of {QUANT_BLOCK}, got {chunk}")


def device_step_8bit(state: Adam8bitState, grad: torch.Tensor, hyper: AdamHyper, out: Optional[torch.Tensor] = None,
                     chunk: int = DEVICE_CHUNK, impl: str = "auto") -> None:
    """One Adam/AdamW step of an 8-bit state in place on its device (a unit stepped on the GPU;
    any device works), the same bits as the CPU kernel. ``grad`` (fp32 or bf16) on the state's
    device; ``out``: the new weights written in its dtype (e.g. the unit's bf16 device buffer; it
    may be the gradient). On CUDA the build's kernel queues one pass on the current stream
    (``impl``: DEVICE_STEP_IMPLS); the torch step takes ``chunk`` elements at a time, elementwise
    tensor operations only (no Python loop over blocks)."""
    state.check()
    _check_chunk(chunk)
    n = state.numel
    g = grad.reshape(-1)
    if g.numel() != n or (out is not None and out.numel() != n):
        raise ValueError(f"device_step_8bit: the gradient has {g.numel()} elements"
                         f"{'' if out is None else f', out {out.numel()}'}, the state {n}")
    if device_impl(impl, "device_step_8bit", state.tensors(), grad, out, OUT_TYPES_8BIT) == "cuda":
        return step_8bit_cuda(state, grad, hyper, out)
    c = hyper.coefficients()
    dst = out.reshape(-1) if out is not None else None
    for b in range(0, n, chunk):
        sl, bsl = slice(b, min(n, b + chunk)), slice(b // QUANT_BLOCK, -(-min(n, b + chunk) // QUANT_BLOCK))
        m, v = _decode_moments(state, sl, bsl)
        p, m, v, root = _adam_elementwise(g[sl].float(), state.master[sl], m, v, c)
        del v
        state.master[sl] = p
        if dst is not None:
            dst[sl] = p
        del p
        _encode_moments(m, root, state, sl, bsl)


def device_step_bf16(param: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor, grad: torch.Tensor,
                     hyper: AdamHyper, chunk: int = DEVICE_CHUNK, out: Optional[torch.Tensor] = None,
                     impl: str = "auto") -> None:
    """One Adam/AdamW step in place of a bf16 master with bf16 moments on their device; the same
    bits as the CPU kernel. ``out`` (may be the gradient) receives the new weights. On CUDA the
    build's kernel queues one pass on the current stream (``impl``: DEVICE_STEP_IMPLS); the torch
    step takes ``chunk`` elements at a time."""
    _check_chunk(chunk)
    p_flat, m_flat, v_flat, g = (t.reshape(-1) for t in (param, exp_avg, exp_avg_sq, grad))
    n = p_flat.numel()
    for t, name in ((m_flat, "exp_avg"), (v_flat, "exp_avg_sq"), (g, "grad")) + (() if out is None else
                                                                                ((out.reshape(-1), "out"),)):
        if t.numel() != n:
            raise ValueError(f"device_step_bf16: {name} has {t.numel()} elements, param {n}")
    state = (param, exp_avg, exp_avg_sq)
    if any(t.dtype != torch.bfloat16 for t in state):
        raise ValueError(f"device_step_bf16: param and moments must be bf16, got "
                         f"{', '.join(str(t.dtype) for t in state)}")
    if device_impl(impl, "device_step_bf16", state, grad, out, (torch.bfloat16,)) == "cuda":
        return step_bf16_cuda(param, exp_avg, exp_avg_sq, grad, hyper, out)
    c = hyper.coefficients()
    for b in range(0, n, chunk):
        sl = slice(b, min(n, b + chunk))
        p, m, v, _ = _adam_elementwise(g[sl].float(), p_flat[sl].float(), m_flat[sl].float(), v_flat[sl].float(), c)
        p_flat[sl] = p
        m_flat[sl] = m
        v_flat[sl] = v
    if out is not None:
        out.copy_(param.reshape(out.shape))  # after the loop: out may be the gradient


# ----------------------------------------------------------------------------- the CPU kernels


def _grad_type(grad: torch.Tensor, what: str) -> int:
    if grad.dtype not in (torch.float32, torch.bfloat16) or not grad.is_contiguous() or grad.device.type != "cpu":
        raise ValueError(f"{what}: the gradient must be a contiguous fp32 or bf16 CPU tensor, got {grad.dtype} on "
                         f"{grad.device}")
    return 1 if grad.dtype == torch.bfloat16 else 0


def cpu_step_8bit(state: Adam8bitState, grad: torch.Tensor, hyper: AdamHyper, out: Optional[torch.Tensor] = None,
                  threads: int = 1, isa: str = "auto") -> None:
    """One Adam/AdamW step of an 8-bit state in host memory by the one-pass kernel
    (``_C.adam_step_8bit``): ``out`` (bf16, may be ``grad`` itself) receives the new weights;
    ``isa``: "auto", "avx512", "avx2" or "generic" (PYINFINITY_CPU_ISA for "auto")."""
    from pyinfinity import _C

    state.check()
    n = state.numel
    gt = _grad_type(grad, "cpu_step_8bit")
    if state.master.device.type != "cpu" or grad.numel() != n:
        raise ValueError(f"cpu_step_8bit: a CPU state and a gradient of {n} elements are needed, got "
                         f"{grad.numel()} on {state.master.device}")
    if out is not None and (out.dtype != torch.bfloat16 or out.numel() != n or not out.is_contiguous()):
        raise ValueError(f"cpu_step_8bit: out must be {n} contiguous bf16 values, got {out.numel()} {out.dtype}")
    s = state
    _C.adam_step_8bit(s.master.data_ptr(), s.exp_avg.data_ptr(), s.exp_avg_sq.data_ptr(), s.exp_avg_scale.data_ptr(),
                      s.exp_avg_sq_scale.data_ptr(), grad.data_ptr(), gt, out.data_ptr() if out is not None else 0, n,
                      *hyper.kernel_args(), threads, isa)


def cpu_step_bf16(param: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor, grad: torch.Tensor,
                  hyper: AdamHyper, threads: int = 1, isa: str = "auto", out: Optional[torch.Tensor] = None) -> None:
    """One Adam/AdamW step of a bf16 master with bf16 moments in host memory by the one-pass kernel
    (``_C.adam_step_bf16``); ``grad`` must not overlap them. ``out`` (bf16, may be ``grad`` itself)
    receives the new weights in the same pass."""
    from pyinfinity import _C

    n = param.numel()
    gt = _grad_type(grad, "cpu_step_bf16")
    for t, name in ((param, "param"), (exp_avg, "exp_avg"), (exp_avg_sq, "exp_avg_sq")):
        if t.dtype != torch.bfloat16 or t.numel() != n or not t.is_contiguous() or t.device.type != "cpu":
            raise ValueError(f"cpu_step_bf16: {name} must be {n} contiguous bf16 values on the CPU, got "
                             f"{t.numel()} {t.dtype} on {t.device}")
    if grad.numel() != n:
        raise ValueError(f"cpu_step_bf16: the gradient has {grad.numel()} elements, param {n}")
    if out is not None and (out.dtype != torch.bfloat16 or out.numel() != n or not out.is_contiguous()
                            or out.device.type != "cpu"):
        raise ValueError(f"cpu_step_bf16: out must be {n} contiguous bf16 values on the CPU, got {out.numel()} "
                         f"{out.dtype} on {out.device}")
    _C.adam_step_bf16(param.data_ptr(), exp_avg.data_ptr(), exp_avg_sq.data_ptr(), grad.data_ptr(), gt,
                      out.data_ptr() if out is not None else 0, n, *hyper.kernel_args(), threads, isa)
