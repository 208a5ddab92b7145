"""The compressed optimizer-state formats (``pyinfinity.zero.state_formats``): the 8-bit codes
against torch's float8 and half, the C++ kernels against the pure-torch reference bit for bit on
every instruction set and thread count, the torch device step against the reference, the
quantisation error, and training that converges as with the exact fp32 state."""
from __future__ import annotations

import math
import os
import subprocess
import sys

import pytest
import torch

from pyinfinity import _C
from pyinfinity.config import MIN_QUANTIZED_NUMEL, QUANT_BLOCK, STATE_FORMATS
from pyinfinity.zero import state_formats as sf

ISAS = _C.cpu_isas()


def _moments(n: int, seed: int, spread: float = 1.0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(master, exp_avg, exp_avg_sq) like a run's: per-element gradient scales over orders of magnitude."""
    g = torch.Generator().manual_seed(seed)
    s = 1e-3 * torch.exp(spread * torch.randn(n, generator=g))
    return (torch.randn(n, generator=g), 0.3 * s * torch.randn(n, generator=g),
            s * s * (0.5 + torch.randn(n, generator=g).abs()))


def _equal(a: sf.Adam8bitState, b: sf.Adam8bitState) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a.tensors(), b.tensors()))


# ----------------------------------------------------------------------------- the codes


def test_e4m3_is_torch_float8_e4m3fn():
    x = torch.cat([torch.randn(100_000) * 30, torch.randn(10_000) * 1e-3, torch.tensor([0.0, -0.0, 448.0, -448.0]),
                   sf.e4m3_values()[:127], (sf.e4m3_values()[1:127] + sf.e4m3_values()[:126]) / 2])  # ties
    x = x.clamp(-448, 448)
    assert torch.equal(sf.encode_e4m3(x), x.to(torch.float8_e4m3fn).view(torch.uint8))
    codes = torch.tensor([c for c in range(256) if c & 0x7F != 0x7F], dtype=torch.uint8)
    assert torch.equal(sf.decode_e4m3(codes), codes.view(torch.float8_e4m3fn).float())
    assert torch.equal(sf.decode_e4m3(codes), sf.e4m3_values()[codes.long()])
    # beyond the range, infinities and NaN saturate (a non-finite moment poisons its block's scale instead)
    # NaN: +448 whatever its sign bit (x86 makes an invalid operation's NaN negative, a GPU positive)
    assert sf.encode_e4m3(torch.tensor([1e6, -math.inf, math.nan, -math.nan])).tolist() == [0x7E, 0xFE, 0x7E, 0x7E]


def test_ue4m4_is_a_shifted_half_and_rounds_to_nearest_even():
    codes = torch.arange(256, dtype=torch.int32)
    as_half = (codes << 6).to(torch.int16).view(torch.float16).float()
    assert torch.equal(sf.decode_ue4m4(codes.to(torch.uint8)), as_half)
    assert torch.equal(sf.ue4m4_values(), as_half)
    assert torch.equal(sf.encode_ue4m4(as_half), codes.to(torch.uint8))
    x = torch.cat([torch.rand(100_000) * 1.9375, torch.rand(10_000) * 2.0 ** -14,
                   (as_half[1:] + as_half[:-1]) / 2])  # every tie
    assert torch.equal(sf.encode_ue4m4(x), sf._nearest_code(x, sf.ue4m4_values()).to(torch.uint8))


# ----------------------------------------------------------------------------- quantisation


@pytest.mark.parametrize("n", [1, 255, 256, 4097, 100_003])
@pytest.mark.parametrize("isa", ISAS)
def test_quantize_moments_torch_equals_kernel(n, isa):
    _, m, v = _moments(n, n, spread=2.0)
    want = sf.quantize_moments(m, v)
    got = sf.Adam8bitState.zeros(n)
    _C.quantize_moments(m.data_ptr(), v.data_ptr(), n, got.exp_avg.data_ptr(), got.exp_avg_sq.data_ptr(),
                        got.exp_avg_scale.data_ptr(), got.exp_avg_sq_scale.data_ptr(), 2, isa)
    assert _equal(got, want)
    m2, v2 = torch.empty(n), torch.empty(n)
    _C.dequantize_moments(got.exp_avg.data_ptr(), got.exp_avg_sq.data_ptr(), got.exp_avg_scale.data_ptr(),
                          got.exp_avg_sq_scale.data_ptr(), n, m2.data_ptr(), v2.data_ptr(), 2, isa)
    tm, tv = sf.dequantize_moments(want)
    assert torch.equal(m2, tm) and torch.equal(v2, tv)


@pytest.mark.parametrize("spread", [0.5, 2.0, 4.0])
def test_quantisation_error_is_bounded_for_every_element(spread):
    """Each element keeps its relative precision (half a code step: 2^-4 for exp_avg, 2^-5 for the
    root of exp_avg_sq) down to the code's range below its block's largest; the Adam direction
    m / sqrt(v) stays within a few percent and never blows up, even with element scales over many
    orders of magnitude (where a table code with a 1e-7 range flushes small second moments to 0)."""
    n = 256 * 400
    _, m, v = _moments(n, 1, spread)
    q = sf.quantize_moments(m, v)
    m2, v2 = sf.dequantize_moments(q)
    sm = q.exp_avg_scale.repeat_interleave(QUANT_BLOCK)[:n]
    sr = q.exp_avg_sq_scale.repeat_interleave(QUANT_BLOCK)[:n]
    assert ((m2 - m).abs() <= (m.abs() * 2.0 ** -4 + sm * 2.0 ** -10) * 1.0001).all()
    r, r2 = v.sqrt(), v2.sqrt()
    floor = sr * 2.0 ** -18  # the smallest code: where a root far below its block's largest lands
    near = (r2 - r).abs() <= (r * 2.0 ** -5 + sr * 2.0 ** -19) * 1.0001
    assert (near | ((r < floor) & (r2 <= floor * 1.0001))).all()
    assert (v2 > 0).all()
    d, d2 = m / (v.sqrt() + 1e-8), m2 / (v2.sqrt() + 1e-8)
    assert d2.abs().max() <= 1.5 * d.abs().max()  # no element's step blows up
    if spread <= 2.0:  # beyond, many first moments fall below their block's range: their step is 0
        rel = (d2 - d).abs() / d.abs().clamp_min(1e-3)
        assert rel.median() < 0.04


def test_zero_tiny_and_non_finite_blocks():
    n = 3 * QUANT_BLOCK
    m, v = torch.zeros(n), torch.zeros(n)
    m[QUANT_BLOCK + 5] = v[QUANT_BLOCK + 5] = 1.0
    v[QUANT_BLOCK + 6] = 1e-30  # far below its block's largest: the smallest code, not 0
    m[2 * QUANT_BLOCK] = math.nan
    q = sf.quantize_moments(m, v)
    m2, v2 = sf.dequantize_moments(q)
    assert q.exp_avg_scale[0] == 0 and (m2[:QUANT_BLOCK] == 0).all() and (v2[:QUANT_BLOCK] == 0).all()
    assert 0 < v2[QUANT_BLOCK + 6] < 1e-9 and v2[QUANT_BLOCK + 7] == 0
    assert torch.isnan(m2[2 * QUANT_BLOCK:]).all() and not torch.isnan(m2[:2 * QUANT_BLOCK]).any()


# ----------------------------------------------------------------------------- the steps


HYPERS = [dict(weight_decay=0.0, adamw=True, grad_scale=1.0), dict(weight_decay=0.1, adamw=True, grad_scale=2.5),
          dict(weight_decay=0.1, adamw=False, grad_scale=1.0)]


@pytest.mark.parametrize("n", [1, 1000, 4097, 300_001])
@pytest.mark.parametrize("gdtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("hp", HYPERS)
def test_8bit_kernel_equals_reference(n, gdtype, hp):
    p, m, v = _moments(n, n)
    start = sf.quantize_moments(m, v, p)
    grad = (torch.randn(n, generator=torch.Generator().manual_seed(1)) * 1e-3).to(gdtype)
    h = sf.AdamHyper(lr=1e-3, beta1=0.9, beta2=0.99, step=7, **hp)
    want, want_out = start.clone(), torch.empty(n, dtype=torch.bfloat16)
    sf.reference_step_8bit(want, grad, h, want_out)
    for isa in ["auto", *ISAS]:
        got = start.clone()
        out = torch.full((n,), math.nan, dtype=torch.bfloat16)  # poisoned: every element must be written
        sf.cpu_step_8bit(got, grad, h, out, threads=3, isa=isa)
        assert _equal(got, want), isa
        assert torch.equal(out, want_out), isa
    assert torch.equal(want_out, want.master.to(torch.bfloat16))


def test_8bit_threads_and_in_place_gradient_change_nothing():
    n = 1_000_003
    p, m, v = _moments(n, 3)
    start = sf.quantize_moments(m, v, p)
    grad = (torch.randn(n) * 1e-3).to(torch.bfloat16)
    h = sf.AdamHyper(lr=1e-3, step=2)
    ref = start.clone()
    ref_out = torch.empty(n, dtype=torch.bfloat16)
    sf.cpu_step_8bit(ref, grad, h, ref_out, threads=1)
    for threads in (2, 8):
        s = start.clone()
        out = torch.empty(n, dtype=torch.bfloat16)
        sf.cpu_step_8bit(s, grad, h, out, threads=threads)
        assert _equal(s, ref) and torch.equal(out, ref_out)
    s, home = start.clone(), grad.clone()  # the gradient lands in the parameter home; the new weights overwrite it
    sf.cpu_step_8bit(s, home, h, home, threads=3)
    assert _equal(s, ref) and torch.equal(home, ref_out)


@pytest.mark.parametrize("chunk", [QUANT_BLOCK, 4096, sf.DEVICE_CHUNK])
@pytest.mark.parametrize("hp", HYPERS[1:])
def test_8bit_device_step_equals_reference(chunk, hp):
    n = 40_000 + 17
    p, m, v = _moments(n, 5)
    start = sf.quantize_moments(m, v, p)
    grad = (torch.randn(n) * 1e-3).to(torch.bfloat16)
    h = sf.AdamHyper(lr=2e-3, step=3, **hp)
    want, got = start.clone(), start.clone()
    want_out, out = torch.empty(n, dtype=torch.bfloat16), torch.empty(n, dtype=torch.bfloat16)
    sf.reference_step_8bit(want, grad, h, want_out)
    sf.device_step_8bit(got, grad, h, out, chunk=chunk)
    assert _equal(got, want) and torch.equal(out, want_out)


@pytest.mark.parametrize("n", [1, 4097, 300_001])
@pytest.mark.parametrize("gdtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("hp", HYPERS)
def test_bf16_kernel_and_device_step_equal_reference(n, gdtype, hp):
    g0 = torch.Generator().manual_seed(n)
    start = [torch.randn(n, generator=g0).to(torch.bfloat16), (torch.randn(n, generator=g0) * 1e-2).to(torch.bfloat16),
             (torch.rand(n, generator=g0) * 1e-4).to(torch.bfloat16)]
    grad = (torch.randn(n, generator=g0) * 1e-2).to(gdtype)
    h = sf.AdamHyper(lr=1e-3, step=4, **hp)
    want = [t.clone() for t in start]
    sf.reference_step_bf16(*want, grad, h)
    for isa in ["auto", *ISAS]:
        got = [t.clone() for t in start]
        sf.cpu_step_bf16(*got, grad, h, threads=3, isa=isa)
        assert all(torch.equal(a, b) for a, b in zip(got, want)), isa
    got = [t.clone() for t in start]
    sf.device_step_bf16(*got, grad, h, chunk=4096)
    assert all(torch.equal(a, b) for a, b in zip(got, want))


def test_bf16_step_rounds_each_value_once_to_nearest_even():
    """DeepSpeed's bf16 master: the fp32 result of the step rounded to nearest even, not truncated
    and not stochastically rounded (a step smaller than half a bf16 ulp leaves the weight as it is)."""
    p = torch.full((1024,), 1.0, dtype=torch.bfloat16)
    m, v = torch.zeros(1024, dtype=torch.bfloat16), torch.zeros(1024, dtype=torch.bfloat16)
    grad = torch.ones(1024)
    sf.cpu_step_bf16(p, m, v, grad, sf.AdamHyper(lr=1e-3))  # 1 - 0.001 rounds back to 1 (ulp 2^-7 below 1: 0.0039)
    assert (p == 1.0).all() and (m == torch.tensor(0.1).to(torch.bfloat16)).all()
    sf.cpu_step_bf16(p, m, v, grad, sf.AdamHyper(lr=3e-3, step=2))  # 1 - 0.003 rounds to 1 - 2^-8 ... the nearest
    assert (p.float() == torch.tensor(1.0 - 0.003).to(torch.bfloat16).float()).all()


# ----------------------------------------------------------------------------- the instruction set


def test_forced_isa_is_used_and_checked():
    assert _C.cpu_isa("generic") == "generic" and ISAS[0] == "generic"
    assert _C.cpu_isa() == os.environ.get("PYINFINITY_CPU_ISA", ISAS[-1]) or "PYINFINITY_CPU_ISA" in os.environ
    with pytest.raises(ValueError, match="expected auto, avx512, avx2 or generic"):
        _C.cpu_isa("sse9")
    code = "from pyinfinity import _C; print(_C.cpu_isa())"
    for value in ("generic", *ISAS):
        out = subprocess.run([sys.executable, "-c", code], env=dict(os.environ, PYINFINITY_CPU_ISA=value),
                             capture_output=True, text=True, timeout=60)
        assert out.stdout.strip() == value, out.stderr
    out = subprocess.run([sys.executable, "-c", code], env=dict(os.environ, PYINFINITY_CPU_ISA="fast"),
                         capture_output=True, text=True, timeout=60)
    assert out.returncode != 0 and "PYINFINITY_CPU_ISA" in out.stderr


# ----------------------------------------------------------------------------- sizes and layout


def test_bytes_per_parameter_and_layout():
    assert sf.bytes_per_param("fp32") == 12 and sf.bytes_per_param("bf16") == 4
    assert sf.bytes_per_param("8bit") == 6 + 8 / 256 and _C.QUANT_BLOCK == QUANT_BLOCK
    assert sf.bytes_per_param("8bit") + 2 <= 8.1  # with bf16 weights: the bound
    n = 1_000_003
    lay = sf.layout_8bit(n)
    assert all(off % 64 == 0 for off in (lay.master, lay.exp_avg_scale, lay.exp_avg_sq_scale, lay.exp_avg,
                                          lay.exp_avg_sq))
    assert lay.nbytes == sf.state_nbytes("8bit", n) and lay.nbytes - STATE_FORMATS["8bit"].shard_bytes(n) < 5 * 64
    assert sf.state_nbytes("8bit", MIN_QUANTIZED_NUMEL - 1) == 12 * (MIN_QUANTIZED_NUMEL - 1)  # small shards: fp32
    buf = torch.zeros(lay.nbytes, dtype=torch.uint8)
    s = sf.views_8bit(buf, n)
    s.check()
    s.exp_avg_sq_scale.fill_(2.0)
    s.exp_avg.fill_(7)
    assert buf[lay.exp_avg_sq_scale:lay.exp_avg_sq_scale + 4].view(torch.float32).item() == 2.0
    assert buf[lay.exp_avg_sq - 1] == 0 and buf[lay.exp_avg] == 7
    with pytest.raises(ValueError, match="views_8bit"):
        sf.views_8bit(buf[:100], n)


def test_bad_arguments_are_one_line_errors():
    s = sf.Adam8bitState.zeros(10)
    with pytest.raises(ValueError, match="step must be >= 1"):
        sf.cpu_step_8bit(s, torch.zeros(10), sf.AdamHyper(lr=1e-3, step=0))
    with pytest.raises(ValueError, match="grad_scale"):
        sf.device_step_8bit(s, torch.zeros(10), sf.AdamHyper(lr=1e-3, grad_scale=0.0))
    with pytest.raises(ValueError, match="fp32 or bf16"):
        sf.cpu_step_8bit(s, torch.zeros(10, dtype=torch.float16), sf.AdamHyper(lr=1e-3))
    with pytest.raises(ValueError, match="exp_avg_scale"):
        sf.cpu_step_8bit(sf.Adam8bitState(s.master, s.exp_avg, s.exp_avg_sq, s.exp_avg_scale[:0], s.exp_avg_sq_scale),
                         torch.zeros(10), sf.AdamHyper(lr=1e-3))
    with pytest.raises(ValueError, match="multiple of 256"):
        sf.device_step_8bit(s, torch.zeros(10), sf.AdamHyper(lr=1e-3), chunk=100)
    with pytest.raises(ValueError, match="expected one of"):
        sf.bytes_per_param("int4")


# ----------------------------------------------------------------------------- convergence


def _train(fmt: str, steps: int = 150, lr: float = 3e-3) -> float:
    """A two-layer MLP regression trained with one flat parameter vector, stepped by the format's CPU
    kernel; returns the final loss on the whole data set."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2048, 32, generator=g)
    y = torch.tanh(x @ torch.randn(32, 16, generator=g)) + 0.05 * torch.randn(2048, 16, generator=g)
    shapes = [(32, 128), (128,), (128, 16), (16,)]
    init = [torch.randn(32, 128, generator=g) * 0.15, torch.zeros(128), torch.randn(128, 16, generator=g) * 0.08,
            torch.zeros(16)]
    flat = torch.cat([t.reshape(-1) for t in init])
    n = flat.numel()

    def loss_of(w: torch.Tensor, xb: torch.Tensor, yb: torch.Tensor) -> torch.Tensor:
        parts, o = [], 0
        for s in shapes:
            k = math.prod(s)
            parts.append(w[o:o + k].view(s))
            o += k
        return ((torch.relu(xb @ parts[0] + parts[1]) @ parts[2] + parts[3] - yb) ** 2).mean()

    state8 = sf.Adam8bitState.zeros(n)
    state8.master.copy_(flat)
    p16, m16, v16 = flat.to(torch.bfloat16), torch.zeros(n, dtype=torch.bfloat16), torch.zeros(n, dtype=torch.bfloat16)
    m32, v32 = torch.zeros(n), torch.zeros(n)
    master = flat.clone()
    for step in range(1, steps + 1):
        w = (p16.float() if fmt == "bf16" else state8.master if fmt == "8bit" else master).clone().requires_grad_()
        idx = torch.randint(0, 2048, (128,), generator=g)
        loss_of(w, x[idx], y[idx]).backward()
        grad = w.grad.contiguous()
        h = sf.AdamHyper(lr=lr, weight_decay=0.01, step=step)
        if fmt == "8bit":
            sf.cpu_step_8bit(state8, grad, h)
        elif fmt == "bf16":
            sf.cpu_step_bf16(p16, m16, v16, grad, h)
        else:
            torch._fused_adamw_([master], [grad], [m32], [v32], [], [torch.tensor(float(step))], lr=lr, beta1=0.9,
                                beta2=0.999, weight_decay=0.01, eps=1e-8, amsgrad=False, maximize=False)
    final = p16.float() if fmt == "bf16" else state8.master if fmt == "8bit" else master
    with torch.no_grad():
        return float(loss_of(final, x, y))


def test_training_converges_like_the_exact_state():
    start = _train("fp32", steps=0)
    exact = _train("fp32")
    assert exact < 0.5 * start
    assert abs(_train("8bit") - exact) <= 0.05 * exact
    assert abs(_train("bf16") - exact) <= 0.10 * exact
