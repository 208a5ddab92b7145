"""The compressed optimizer states' device steps: which implementation runs (on every machine), and
on a CUDA device (marked gpu) the build's kernels against the CPU kernels and the torch step, bit
for bit: the 8-bit and bf16 formats, fp32 and bf16 gradients, every out dtype, a gradient held in
out, blocks with NaN, infinity, zeros and subnormal moments, sizes around a block, a side stream."""
from __future__ import annotations

import pytest
import torch

from pyinfinity import _C
from pyinfinity.config import QUANT_BLOCK
from pyinfinity.zero import state_formats as sf

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
kernels = pytest.mark.skipif(not sf.cuda_kernels(), reason="this build has no CUDA kernels")

HYPERS = [dict(weight_decay=0.0, adamw=True, grad_scale=1.0), dict(weight_decay=0.1, adamw=True, grad_scale=2.5),
          dict(weight_decay=0.1, adamw=False, grad_scale=1.0)]


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bits as integers (-0.0 differs from 0.0)."""
    return t.view({4: torch.int32, 2: torch.int16, 1: torch.uint8}[t.element_size()])


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """The same bits, except that a NaN equals any NaN: x86 keeps an input NaN's payload and makes
    0xffc00000 for an invalid operation, NVIDIA GPUs make 0x7fffffff for both."""
    a, b = a.cpu(), b.cpu()
    if not a.is_floating_point():
        return torch.equal(a, b)
    nan = torch.isnan(a)
    return torch.equal(nan, torch.isnan(b)) and torch.equal(_bits(a[~nan]), _bits(b[~nan]))


def _same_state(a: sf.Adam8bitState, b: sf.Adam8bitState) -> bool:
    return all(_same(x, y) for x, y in zip(a.tensors(), b.tensors()))


def _to(s: sf.Adam8bitState, device: str) -> sf.Adam8bitState:
    return sf.Adam8bitState(*(t.to(device) for t in s.tensors()))


def _start(n: int, seed: int, special: bool = False) -> tuple[sf.Adam8bitState, torch.Tensor]:
    """An 8-bit state of n parameters like a run's and a gradient; ``special`` puts a NaN, an
    infinity, zeros and subnormal moments into blocks of their own."""
    g = torch.Generator().manual_seed(seed)
    s = 1e-3 * torch.exp(torch.randn(n, generator=g))
    master, m, v = torch.randn(n, generator=g), 0.3 * s * torch.randn(n, generator=g), s * s * (0.5 + torch.rand(n,
                                                                                                          generator=g))
    grad = 1e-3 * torch.randn(n, generator=g)
    if special and n >= 5 * QUANT_BLOCK:
        b = QUANT_BLOCK
        grad[3] = float("nan")
        grad[b + 7] = float("inf")
        m[2 * b:3 * b] = 0.0
        v[2 * b:3 * b] = 0.0
        grad[2 * b:3 * b] = 0.0
        m[3 * b:4 * b] = 1e-40  # subnormal: the block is stored as zeros
        v[3 * b:4 * b] = 1e-44
        grad[4 * b:5 * b] = 1e-39
    return sf.quantize_moments(m, v, master), grad


# ----------------------------------------------------------------------------- which implementation


def test_the_torch_step_runs_where_the_kernels_cannot_and_asking_for_them_there_says_why(monkeypatch):
    state, grad = _start(1000, 1)
    h = sf.AdamHyper(lr=1e-3, step=2)
    want, got = state.clone(), state.clone()
    sf.device_step_8bit(want, grad, h, impl="torch")
    sf.device_step_8bit(got, grad, h)  # auto on the CPU: the torch step
    assert _same_state(got, want)
    with pytest.raises(ValueError, match=r"impl 'cuda' cannot run here: the state is on cpu, not a CUDA device"):
        sf.device_step_8bit(state.clone(), grad, h, impl="cuda")
    with pytest.raises(ValueError, match=r"impl \(or PYINFINITY_DEVICE_STEP\) must be one of auto, cuda, torch, "
                                         r"got 'gpu'"):
        sf.device_step_8bit(state.clone(), grad, h, impl="gpu")
    monkeypatch.setenv("PYINFINITY_DEVICE_STEP", "fast")
    with pytest.raises(ValueError, match="got 'fast'"):
        sf.device_step_8bit(state.clone(), grad, h)
    p = torch.randn(64).to(torch.bfloat16)
    with pytest.raises(ValueError, match="impl 'cuda' cannot run here"):
        sf.device_step_bf16(p, p.clone(), p.clone().abs(), torch.randn(64), h, impl="cuda", chunk=QUANT_BLOCK)


def test_the_build_says_whether_it_has_the_kernels():
    info = _C.build_info()
    assert info["cuda_kernels"] is _C.cuda_adam_kernels() is sf.cuda_kernels()
    if not info["cuda"]:
        assert info["cuda_kernels"] is False  # the kernels come only with the toolkit


@pytest.mark.parametrize("gdtype", [torch.float32, torch.bfloat16])
def test_the_bf16_torch_step_writes_out_even_when_out_holds_the_gradient(gdtype):
    n = 5000
    gen = torch.Generator().manual_seed(3)
    start = [torch.randn(n, generator=gen).to(torch.bfloat16), (torch.randn(n, generator=gen) * 1e-2).to(torch.bfloat16),
             (torch.rand(n, generator=gen) * 1e-4).to(torch.bfloat16)]
    grad = (torch.randn(n, generator=gen) * 1e-2).to(torch.bfloat16)
    h = sf.AdamHyper(lr=1e-3, step=3, weight_decay=0.1)
    want = [t.clone() for t in start]
    sf.cpu_step_bf16(*want, grad.to(gdtype), h)
    got, out = [t.clone() for t in start], torch.empty(n, dtype=torch.bfloat16)
    sf.device_step_bf16(*got, grad.to(gdtype), h, chunk=1024, out=out)
    assert all(_same(a, b) for a, b in zip(got, want)) and _same(out, want[0])
    got, home = [t.clone() for t in start], grad.clone()  # bf16: the gradient lands in the weights' home
    sf.device_step_bf16(*got, home, h, chunk=1024, out=home)
    assert all(_same(a, b) for a, b in zip(got, want)) and _same(home, want[0])
    with pytest.raises(ValueError, match="param and moments must be bf16"):
        sf.device_step_bf16(start[0].float(), *start[1:], grad, h)


def test_out_may_be_the_gradient_itself_but_no_other_view_of_it_nor_the_state():
    """Each element's gradient is read before its new weight is written over it, so out may be the
    gradient's own elements; out of another dtype over the gradient's memory (an element's weight
    would overwrite gradients not read yet) or over the state is refused, whichever step runs."""
    state, grad = _start(2 * QUANT_BLOCK, 4)
    h = sf.AdamHyper(lr=1e-3, step=1)
    buf = grad.to(torch.bfloat16)
    sf.device_step_8bit(state.clone(), buf, h, out=buf)  # the gradient's own elements: fine
    wide = torch.zeros(2 * QUANT_BLOCK, dtype=torch.float32)
    for impl in ("auto", "torch"):
        with pytest.raises(ValueError, match=r"out \(torch.bfloat16\) overlaps the gradient \(torch.float32\) "
                                             "without being it"):
            sf.device_step_8bit(state.clone(), wide, h, out=wide[:QUANT_BLOCK].view(torch.bfloat16), impl=impl)
        s = state.clone()
        with pytest.raises(ValueError, match="out overlaps the optimizer state"):
            sf.device_step_8bit(s, grad, h, out=s.master, impl=impl)
    p = torch.randn(64).to(torch.bfloat16)
    with pytest.raises(ValueError, match="overlaps the optimizer state"):
        sf.device_step_bf16(p, p.clone(), p.clone().abs(), torch.randn(64), h, out=p, chunk=QUANT_BLOCK)


# ----------------------------------------------------------------------------- the kernels on a GPU


@pytest.mark.gpu
@cuda
@kernels
@pytest.mark.parametrize("n", [1, QUANT_BLOCK - 1, QUANT_BLOCK, QUANT_BLOCK + 1, 5 * QUANT_BLOCK + 13, (1 << 20) + 5])
@pytest.mark.parametrize("gdtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("hp", HYPERS)
def test_the_8bit_kernel_computes_the_cpu_kernels_bits(n, gdtype, hp):
    start, grad = _start(n, n, special=True)
    grad = grad.to(gdtype)
    for step in (1, 2, 7):
        h = sf.AdamHyper(lr=2e-3, step=step, **hp)
        want, want_out = start.clone(), torch.empty(n, dtype=torch.bfloat16)
        sf.cpu_step_8bit(want, grad, h, want_out, threads=2)
        got, out = _to(start, "cuda"), torch.empty(n, dtype=torch.bfloat16, device="cuda")
        sf.device_step_8bit(got, grad.cuda(), h, out, impl="cuda")
        assert _same_state(got, want), step
        assert _same(out, want_out), step
        start = want


@pytest.mark.gpu
@cuda
@kernels
@pytest.mark.parametrize("out_dtype", [None, torch.bfloat16, torch.float16, torch.float32])
def test_the_8bit_kernel_equals_the_torch_step_on_the_gpu_for_every_out_dtype(out_dtype):
    n = 3 * (1 << 16) + 77
    start, grad = _start(n, 11, special=True)
    h = sf.AdamHyper(lr=1e-3, step=4, weight_decay=0.05)
    want, got = _to(start, "cuda"), _to(start, "cuda")
    want_out = got_out = None
    if out_dtype is not None:
        want_out, got_out = (torch.full((n,), 7.0, dtype=out_dtype, device="cuda") for _ in range(2))
    sf.device_step_8bit(want, grad.cuda(), h, want_out, impl="torch", chunk=1 << 16)
    sf.device_step_8bit(got, grad.cuda(), h, got_out, impl="cuda")
    assert _same_state(got, want)
    if out_dtype is not None:
        assert _same(got_out, want_out)


@pytest.mark.gpu
@cuda
@kernels
def test_the_8bit_kernel_reads_a_gradient_held_in_out_before_writing_it_and_runs_on_the_current_stream():
    n = 40 * QUANT_BLOCK + 3
    start, grad = _start(n, 5)
    h = sf.AdamHyper(lr=1e-3, step=2)
    want, want_out = start.clone(), torch.empty(n, dtype=torch.bfloat16)
    sf.cpu_step_8bit(want, grad.to(torch.bfloat16), h, want_out)
    got, home = _to(start, "cuda"), grad.to(torch.bfloat16).cuda()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        sf.device_step_8bit(got, home, h, home, impl="cuda")
    side.synchronize()
    assert _same_state(got, want) and _same(home, want_out)


@pytest.mark.gpu
@cuda
@kernels
@pytest.mark.parametrize("n", [1, 4097, 300_001])
@pytest.mark.parametrize("gdtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("hp", HYPERS)
def test_the_bf16_kernel_computes_the_cpu_kernels_bits(n, gdtype, hp):
    gen = torch.Generator().manual_seed(n)
    start = [torch.randn(n, generator=gen).to(torch.bfloat16),
             (torch.randn(n, generator=gen) * 1e-2).to(torch.bfloat16),
             (torch.rand(n, generator=gen) * 1e-4).to(torch.bfloat16)]
    grad = (torch.randn(n, generator=gen) * 1e-2).to(gdtype)
    if n > 10:
        grad[5] = float("nan")
    h = sf.AdamHyper(lr=1e-3, step=4, **hp)
    want = [t.clone() for t in start]
    sf.cpu_step_bf16(*want, grad, h, threads=2)
    got = [t.cuda() for t in start]
    out = torch.empty(n, dtype=torch.bfloat16, device="cuda")
    sf.device_step_bf16(*got, grad.cuda(), h, out=out, impl="cuda")
    assert all(_same(a, b) for a, b in zip(got, want))
    assert _same(out, want[0])
    if gdtype == torch.bfloat16:  # the gradient in the weights' home, overwritten with the new weights
        got, home = [t.cuda() for t in start], grad.cuda()
        sf.device_step_bf16(*got, home, h, out=home, impl="cuda")
        assert all(_same(a, b) for a, b in zip(got, want)) and _same(home, want[0])


@pytest.mark.gpu
@cuda
@kernels
def test_auto_takes_the_kernel_on_cuda_and_the_torch_step_when_asked(monkeypatch):
    calls = []
    real = _C.cuda_adam_step_8bit

    def spy(*a, **k):
        calls.append(1)
        return real(*a, **k)

    monkeypatch.setattr(_C, "cuda_adam_step_8bit", spy)
    start, grad = _start(4 * QUANT_BLOCK, 2)
    h = sf.AdamHyper(lr=1e-3)
    sf.device_step_8bit(_to(start, "cuda"), grad.cuda(), h)
    assert calls == [1]
    monkeypatch.setenv("PYINFINITY_DEVICE_STEP", "torch")
    sf.device_step_8bit(_to(start, "cuda"), grad.cuda(), h)
    assert calls == [1]
    monkeypatch.delenv("PYINFINITY_DEVICE_STEP")
    sf.device_step_8bit(_to(start, "cuda"), grad.half().cuda(), h)  # an fp16 gradient: the torch step takes it
    assert calls == [1]


# ----------------------------------------------------------------------------- the benchmark script


def _bench_script():
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "examples" / "optimizer_step_bench.py"
    spec = importlib.util.spec_from_file_location("optimizer_step_bench", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_the_step_benchmark_times_every_format_and_checks_the_bits_on_the_cpu(tmp_path, capsys):
    import json

    bench = _bench_script()
    assert bench.parse_count("256M") == 256_000_000 and bench.parse_count("1000") == 1000
    with pytest.raises(ValueError, match="expected a count"):
        bench.parse_count("many")
    out = tmp_path / "steps.json"
    assert bench.main(["--device", "cpu", "--params", "70K", "--steps", "1", "--threads", "2",
                       "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [(r["format"], r["impl"]) for r in rows] == [("fp32", "torch foreach"), ("8bit", "cpu kernel"),
                                                       ("8bit", "torch step"), ("bf16", "cpu kernel"),
                                                       ("bf16", "torch step")]
    assert all(r["seconds"] > 0 and r["params"] == 70_000 for r in rows)
    assert [r["same_bits_as_kernel"] for r in rows if r["impl"] == "torch step"] == [True, True]
    assert "same bits as the kernel" in capsys.readouterr().out
    if not torch.cuda.is_available():
        assert bench.main(["--params", "1K"]) == 2
        assert "no CUDA device here" in capsys.readouterr().err


@pytest.mark.gpu
@cuda
@kernels
def test_the_step_benchmark_runs_on_the_gpu(tmp_path):
    bench = _bench_script()
    assert bench.main(["--params", "3M", "--steps", "2", "--json", str(tmp_path / "s.json")]) == 0
