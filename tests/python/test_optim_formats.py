"""The optimizer state's format (``zero.optim.formats``): everything in the optimizer goes through
``OptimStateFormat``, so a format with another layout of the same arithmetic (here the master
last: ``[exp_avg | exp_avg_sq | master]``) trains bit for bit like ``AdamFp32`` on every path (the
one-pass CPU kernel, torch's kernel, NVMe homes with the background worker's read-ahead, units
stepped on the device); and the planner charges what the format in use costs."""
from __future__ import annotations

import pytest
import torch

import pyinfinity
import pyinfinity.zero.optim.formats
from pyinfinity.config import MIN_QUANTIZED_NUMEL, OptimizerConfig
from pyinfinity.swap.tensor_swapper import TensorSwapper, Tier
from pyinfinity.zero.optim.formats import DEVICE_CHUNK, AdamFp32, OptimStateFormat
from pyinfinity.zero.optimizer import OffloadOptimizer
from tests.python.conftest import train_steps
from tests.python.test_zero_optimizer import SIZES, grads_for, make_shards


class MasterLast(OptimStateFormat):
    """fp32 Adam with the master after the moments: the same numbers in another place."""

    name = "fp32-master-last"
    bytes_per_param = 12

    def __init__(self, adam_w: bool) -> None:
        self.adam_w = adam_w
        self.calls: dict[str, int] = {}

    def _count(self, what: str) -> None:
        self.calls[what] = self.calls.get(what, 0) + 1

    def home_spec(self, numel):
        return 3 * numel, torch.float32

    def init(self, flat, numel, values):
        self._count("init")
        flat[:2 * numel].zero_()
        flat[2 * numel:].copy_(values)

    def master(self, flat, numel):
        return flat[2 * numel:3 * numel]

    def step_cpu(self, flat, numel, grad, out, hyper, step, grad_scale, threads):
        from pyinfinity import _C

        self._count("step_cpu")
        p, n = flat.data_ptr(), numel
        _C.adam_step(p + 8 * n, p, p + 4 * n, grad.data_ptr(), 1 if grad.dtype == torch.bfloat16 else 0,
                     out.data_ptr() if out is not None else 0, n, hyper["lr"], hyper["beta1"], hyper["beta2"],
                     hyper["eps"], hyper["weight_decay"], self.adam_w, step, grad_scale, threads)
        return self.master(flat, n)

    def _kernel(self):
        return torch._fused_adamw_ if self.adam_w else torch._fused_adam_

    def step_torch(self, flat, numel, grad, hyper, step, inv_factor, *, count, scale):
        self._count("step_torch")
        n = numel
        self._kernel()([flat[2 * n:]], [grad], [flat[:n]], [flat[n:2 * n]], [], [step], lr=hyper["lr"],
                       beta1=hyper["beta1"], beta2=hyper["beta2"], weight_decay=hyper["weight_decay"],
                       eps=hyper["eps"], amsgrad=False, maximize=False, grad_scale=inv_factor)

    def step_device(self, flat, numel, grad, out, hyper, step, inv_factor, *, count, scale):
        self._count("step_device")
        n = numel
        for a in range(0, n, DEVICE_CHUNK):
            b = min(n, a + DEVICE_CHUNK)
            gc = grad[a:b] if grad.dtype == torch.float32 else grad[a:b].float()
            master = flat[2 * n + a:2 * n + b]
            self._kernel()([master], [gc], [flat[a:b]], [flat[n + a:n + b]], [], [step], lr=hyper["lr"],
                           beta1=hyper["beta1"], beta2=hyper["beta2"], weight_decay=hyper["weight_decay"],
                           eps=hyper["eps"], amsgrad=False, maximize=False, grad_scale=inv_factor)
            out[a:b].copy_(master)


def _as_fp32_layout(flat: torch.Tensor, n: int) -> torch.Tensor:
    """A MasterLast state rearranged to AdamFp32's [master | m | v]."""
    return torch.cat([flat[2 * n:], flat[:2 * n]])


def _states(opt) -> dict:
    n_of = {st.shard.index: st.numel for st in opt.states}
    out = {}
    for st, flat in opt.iter_states(write_back=False):
        f = flat.clone()
        out[st.shard.index] = _as_fp32_layout(f, n_of[st.shard.index]) if isinstance(opt.format, MasterLast) else f
    return out


@pytest.mark.parametrize("fused, background", [(True, False), (True, True), (False, False)])
def test_another_layout_steps_bit_for_bit_like_the_fp32_format(fused, background, tmp_path):
    """The optimizer alone, half the state on NVMe (read ahead by the worker in the background
    path), clipping: the same masters, moments and new weights, rearranged, as AdamFp32."""
    got = []
    for fmt_cls in (AdamFp32, MasterLast):
        cfg = OptimizerConfig(type="AdamW", lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, adam_w_mode=True)
        sw = TensorSwapper("optimizer", torch.device("cpu"), [str(tmp_path / fmt_cls.__name__)])
        written = {}
        fmt = fmt_cls(True)
        opt = OffloadOptimizer(cfg, sw, nvme_ratio=0.5, buffer_count=3, state_format=fmt,
                               write_param=lambda sh, m: written.__setitem__(sh.index, m.clone()))
        opt.fused, opt.background = fused, background
        shards, values = make_shards()
        opt.plan(shards)
        for sh, v in zip(shards, values):
            opt.add_shard(sh, v)
        assert {st.home.tier for st in opt.states} == {Tier.CPU, Tier.NVME}
        norms = []
        for step in range(3):
            for sh, g in zip(shards, grads_for(step)):
                opt.accumulate(sh, sh.slices[0], g)
            norms.append(opt.step(clip=1.0).grad_norm)
            opt.drain()
            opt.zero_grad()
        got.append((norms, _states(opt), written))
        if fmt_cls is MasterLast:
            assert fmt.calls["init"] == len(SIZES)
            assert fmt.calls["step_cpu" if fused else "step_torch"] == 3 * len(SIZES)
        opt.close()
        sw.close()
    (n0, s0, w0), (n1, s1, w1) = got
    assert n0 == n1
    assert s0.keys() == s1.keys() and all(torch.equal(s0[k], s1[k]) for k in s0)
    assert all(torch.equal(w0[k], w1[k]) for k in w0)


def test_another_layout_trains_the_engine_bit_for_bit(tiny_lm, lm_batches, engine_config, monkeypatch):
    """Through the engine: NVMe homes, the background step, half the units' state on the "device"
    (the CPU device), accumulation. Losses and trained values (read through the format) are
    AdamFp32's."""
    batches = lm_batches(8)
    got = []
    for fmt_cls in (AdamFp32, MasterLast):
        # the format the training state builds its optimizer with
        monkeypatch.setitem(pyinfinity.zero.optim.formats.FORMAT_CLASSES, "fp32", fmt_cls)
        cfg = engine_config("nvme", gradient_accumulation_steps=2)
        cfg["pyinfinity"].update(resident_bytes="64MiB", unit_bytes=0, device_optimizer_bytes="6KiB",
                                 overlap_step=True)
        with pyinfinity.initialize(tiny_lm(), cfg) as eng:
            assert isinstance(eng.optimizer.format, fmt_cls)
            assert any(sh.device_step for sh in eng.partition.shards)
            losses = train_steps(eng, batches)
            trained = [eng.state.trained_values(sh).clone() for sh in eng.partition.shards]
            got.append((losses, [r.grad_norm for r in eng.history], trained))
            if fmt_cls is MasterLast:
                calls = eng.optimizer.format.calls
                assert calls.get("step_device", 0) > 0 and calls.get("step_cpu", 0) > 0
    (l0, n0, t0), (l1, n1, t1) = got
    assert l0 == l1 and n0 == n1
    assert all(torch.equal(a, b) for a, b in zip(t0, t1))


def test_a_state_of_the_wrong_size_is_refused_on_load():
    fmt = AdamFp32(True)
    with pytest.raises(ValueError, match="fp32 optimizer state of 4 parameters: expected 12 torch.float32"):
        fmt.load(torch.zeros(8), 4)
    assert fmt.load(torch.zeros(12), 4).numel() == 12


def test_the_planner_charges_what_the_format_costs():
    from pyinfinity.layout.charges import DEVICE_STEP_SCRATCH, OPT_BYTES_PER_PARAM

    assert OPT_BYTES_PER_PARAM == AdamFp32.bytes_per_param
    assert DEVICE_STEP_SCRATCH == 4 * DEVICE_CHUNK


# ----------------------------------------------------------------------------- the compressed formats


def _run_format(fmt_name: str, tmp_path, *, ratio=0.0, fused=True, background=False, streamed=False,
                on_device=(), steps=3):
    """The optimizer alone with format ``fmt_name`` on SIZES (clipping on): returns (norms, each
    shard's home bytes, the new weights written, the optimizer's bytes by tier)."""
    from pyinfinity.zero.optim.formats import make_state_format

    cfg = OptimizerConfig(type="AdamW", lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, adam_w_mode=True)
    sw = TensorSwapper("optimizer", torch.device("cpu"), [str(tmp_path / f"swap-{fmt_name}-{ratio}")])
    written = {}
    opt = OffloadOptimizer(cfg, sw, nvme_ratio=ratio, buffer_count=3, state_format=make_state_format(fmt_name, True),
                           write_param=lambda sh, m: written.__setitem__(sh.index, m.float().clone()),
                           step_device=torch.device("cpu") if streamed else None)
    opt.fused, opt.background = fused, background
    shards, values = make_shards()
    opt.plan(shards)
    for sh, v in zip(shards, values):
        opt.add_shard(sh, v)
    for i in on_device:  # stepped by the format's device step (the CPU as the device)
        shards[i].run.fetching(torch.empty(shards[i].numel))  # resident: the device step writes the weights there
        shards[i].run.arrived()
        opt.to_device(shards[i], torch.device("cpu"))
    norms = []
    for step in range(steps):
        for sh, g in zip(shards, grads_for(step)):
            opt.accumulate(sh, sh.slices[0], g)
        norms.append(opt.step(clip=1.0).grad_norm)
        opt.drain()
        opt.zero_grad()
    for i in on_device:
        opt.to_host(shards[i], lambda sh, m: written.__setitem__(sh.index, m.float().clone()))
    homes = {st.shard.index: flat.clone() for st, flat in opt.iter_states(write_back=False)}
    by_tier = opt.bytes_by_tier
    opt.close()
    sw.close()
    return norms, homes, written, by_tier


@pytest.mark.parametrize("fmt", ["8bit", "bf16"])
@pytest.mark.parametrize("path", ["nvme+background", "torch step", "streamed", "device-stepped"])
def test_a_compressed_format_steps_the_same_bits_on_every_path(fmt, path, tmp_path):
    """The one-pass CPU kernel in RAM is the reference; half the state on NVMe (moved in its
    compressed form, read ahead by the background worker), the torch step on the host, the
    streamed device step and units stepped by the format's device step give the same bits."""
    want = _run_format(fmt, tmp_path)
    kw = {"nvme+background": dict(ratio=0.5, background=True), "torch step": dict(fused=False),
          "streamed": dict(streamed=True), "device-stepped": dict(on_device=(1, 3))}[path]
    got = _run_format(fmt, tmp_path, **kw)
    assert got[1].keys() == want[1].keys() and got[2].keys() == want[2].keys()
    # the 8-bit state's small shards are fp32: torch's fused kernel steps them there, which is not
    # the one-pass kernel's bits (AdamFp32's paths differ the same way)
    torch_fp32 = fmt == "8bit" and path in ("torch step", "streamed")
    for k, n in enumerate(SIZES):
        if torch_fp32 and n < MIN_QUANTIZED_NUMEL:
            torch.testing.assert_close(got[2][k], want[2][k], rtol=1e-5, atol=1e-6)
            continue
        assert torch.equal(got[1][k], want[1][k]) and torch.equal(got[2][k], want[2][k]), (k, n)
    if not torch_fp32:
        assert got[0] == want[0]
    if path == "nvme+background":
        assert set(got[3]) == {"cpu", "nvme"} and sum(got[3].values()) == sum(want[3].values())


def test_the_8bit_state_is_quantised_above_the_threshold_and_steps_like_adam(tmp_path):
    """Shards of MIN_QUANTIZED_NUMEL elements or more are stored in the 8-bit layout, smaller ones
    in fp32 (bit for bit AdamFp32's); the quantised shards' updates follow fp32 Adam's."""
    from pyinfinity.zero import state_formats as sf

    _, homes8, w8, tiers8 = _run_format("8bit", tmp_path)
    _, homes32, w32, tiers32 = _run_format("fp32", tmp_path)
    _, values = make_shards()
    for i, n in enumerate(SIZES):
        if n < MIN_QUANTIZED_NUMEL:
            assert torch.equal(homes8[i].view(torch.float32), homes32[i]) and torch.equal(w8[i], w32[i])
            continue
        assert homes8[i].dtype == torch.uint8 and homes8[i].numel() == sf.layout_8bit(n).nbytes
        d8, d32 = w8[i] - values[i], w32[i] - values[i]
        assert (d8 - d32).norm() / d32.norm() < 0.05
        assert torch.nn.functional.cosine_similarity(d8, d32, dim=0) > 0.999
    assert sum(tiers8.values()) < 0.6 * sum(tiers32.values())


def test_conversions_between_formats_round_trip():
    """to_fp32 / from_fp32: fp32 -> 8bit -> fp32 keeps the master exactly and the moments within
    the codes' precision; bf16 rounds each to nearest even; fp32 is exact."""
    from pyinfinity.zero.optim.formats import make_state_format

    n = 5000
    g = torch.Generator().manual_seed(0)
    master, m, v = torch.randn(n, generator=g), torch.randn(n, generator=g) * 1e-3, torch.rand(n, generator=g) * 1e-6
    for name in ("fp32", "8bit", "bf16"):
        fmt = make_state_format(name, True)
        home = fmt.from_fp32(master, m, v)
        assert home.numel() == fmt.home_spec(n)[0] and home.dtype == fmt.home_spec(n)[1]
        p2, m2, v2 = fmt.to_fp32(home, n)
        if name == "fp32":
            assert torch.equal(p2, master) and torch.equal(m2, m) and torch.equal(v2, v)
        elif name == "8bit":
            assert torch.equal(p2, master)
            torch.testing.assert_close(m2, m, rtol=0.07, atol=m.abs().max().item() * 2 ** -9)
            torch.testing.assert_close(v2.sqrt(), v.sqrt(), rtol=0.04, atol=0)
        else:
            assert torch.equal(p2, master.bfloat16().float()) and torch.equal(m2, m.bfloat16().float())
    with pytest.raises(ValueError, match="expected one of fp32, 8bit, bf16, got 'int4'"):
        make_state_format("int4", True)
