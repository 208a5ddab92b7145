"""The one-pass CPU optimizer step (``_C.adam_step``): the same update as torch's fused Adam/AdamW
(fp32 or bf16 gradients, weight decay both ways, a gradient scale), the bf16 weights it writes are
exactly the fp32 master rounded as torch rounds, odd sizes and thread splits change nothing, and
the AVX2 and AVX-512 loops give the same bits (the compressed formats: test_state_formats.py)."""
from __future__ import annotations

import pytest
import torch

from pyinfinity import _C


def _step(flat, g, out, n, *, lr=1e-2, wd=0.0, adamw=True, step=3, scale=1.0, threads=2, isa="auto"):
    _C.adam_step(flat.data_ptr(), flat.data_ptr() + 4 * n, flat.data_ptr() + 8 * n, g.data_ptr(),
                 1 if g.dtype == torch.bfloat16 else 0, out.data_ptr() if out is not None else 0, n,
                 lr, 0.9, 0.99, 1e-8, wd, adamw, step, scale, threads, isa)


@pytest.mark.parametrize("n", [1, 1000, 4097, 300_001])
@pytest.mark.parametrize("gdtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("wd, adamw, scale", [(0.0, True, 1.0), (0.1, True, 2.5), (0.1, False, 1.0)])
def test_matches_torch_fused_adam(n, gdtype, wd, adamw, scale):
    g0 = torch.Generator().manual_seed(n)
    master, m = torch.randn(n, generator=g0), torch.randn(n, generator=g0) * 0.1
    v = torch.rand(n, generator=g0) * 0.01
    g = torch.randn(n, generator=g0).to(gdtype)
    flat = torch.cat([master, m, v])
    ref = [master.clone(), m.clone(), v.clone()]
    kernel = torch._fused_adamw_ if adamw else torch._fused_adam_
    kernel([ref[0]], [g.float().clone()], [ref[1]], [ref[2]], [], [torch.tensor(3.0)], lr=1e-2, beta1=0.9,
           beta2=0.99, weight_decay=wd, eps=1e-8, amsgrad=False, maximize=False,
           grad_scale=torch.tensor(scale) if scale != 1.0 else None)
    out = torch.full((n,), float("nan"), dtype=torch.bfloat16)  # poisoned: every element must be written
    _step(flat, g, out, n, wd=wd, adamw=adamw, scale=scale)
    for got, want in zip((flat[:n], flat[n:2 * n], flat[2 * n:]), ref):
        torch.testing.assert_close(got, want, rtol=2e-5, atol=2e-7)  # FMA: an ulp here and there
    assert torch.equal(out, flat[:n].to(torch.bfloat16))  # torch's rounding, bit for bit


def test_threads_and_in_place_gradient_change_nothing():
    n = 1_000_003
    g0 = torch.Generator().manual_seed(0)
    base = torch.cat([torch.randn(n, generator=g0), torch.zeros(n), torch.zeros(n)])
    grad = torch.randn(n, generator=g0).to(torch.bfloat16)
    results = []
    for threads in (1, 3, 8):
        flat = base.clone()
        out = torch.empty(n, dtype=torch.bfloat16)
        _step(flat, grad, out, n, threads=threads, step=1)
        results.append((flat, out))
    assert all(torch.equal(results[0][0], f) and torch.equal(results[0][1], o) for f, o in results[1:])
    flat = base.clone()
    home = grad.clone()  # the gradient lands in the parameter home; the new weights overwrite it
    _step(flat, home, home, n, threads=3, step=1)
    assert torch.equal(flat, results[0][0]) and torch.equal(home, results[0][1])


def test_instruction_sets_step_alike():
    """AVX2 and AVX-512 contract the same multiply-adds into FMAs: the same bits, so the default
    path on an AVX-512 machine is the AVX2 path's; the x86-64 baseline (no FMA) is within an ulp."""
    n = 200_003
    g0 = torch.Generator().manual_seed(1)
    base = torch.cat([torch.randn(n, generator=g0), torch.randn(n, generator=g0) * 0.1,
                      torch.rand(n, generator=g0) * 0.01])
    grad = torch.randn(n, generator=g0).to(torch.bfloat16)
    results = {}
    for isa in ["auto", *_C.cpu_isas()]:
        flat, out = base.clone(), torch.empty(n, dtype=torch.bfloat16)
        _step(flat, grad, out, n, wd=0.1, isa=isa)
        results[isa] = (flat, out)
    fma = [isa for isa in results if isa != "generic"]
    assert all(torch.equal(results[fma[0]][0], results[i][0]) and torch.equal(results[fma[0]][1], results[i][1])
               for i in fma)
    torch.testing.assert_close(results["generic"][0], results["auto"][0], rtol=2e-5, atol=2e-7)


def test_bad_arguments_are_errors():
    t = torch.zeros(3)
    with pytest.raises(ValueError, match="step must be >= 1"):
        _step(torch.zeros(9), t, None, 3, step=0)
    with pytest.raises(ValueError, match="grad_scale"):
        _step(torch.zeros(9), t, None, 3, scale=0.0)
    with pytest.raises(ValueError, match="isa: expected auto, avx512, avx2 or generic"):
        _step(torch.zeros(9), t, None, 3, isa="sse")
