"""The optimizer state's format (``zero.optim.formats``): everything in the optimizer goes through
``OptimStateFormat``, so a format with another layout of the same arithmetic (here the master
last: ``[exp_avg | exp_avg_sq | master]``) trains bit for bit like ``AdamFp32`` on every path (the
one-pass CPU kernel, torch's kernel, NVMe homes with the background worker's read-ahead, units
stepped on the device); and the planner charges what the format in use costs."""
from __future__ import annotations

import pytest
import torch

import pyinfinity
import pyinfinity.zero.state
from pyinfinity.config import OptimizerConfig
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

    def step_torch(self, flat, numel, grad, hyper, step, inv_factor):
        self._count("step_torch")
        n = numel
        self._kernel()([flat[2 * n:]], [grad], [flat[:n]], [flat[n:2 * n]], [], [step], lr=hyper["lr"],
                       beta1=hyper["beta1"], beta2=hyper["beta2"], weight_decay=hyper["weight_decay"],
                       eps=hyper["eps"], amsgrad=False, maximize=False, grad_scale=inv_factor)

    def step_device(self, flat, numel, grad, out, hyper, step, inv_factor):
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
        monkeypatch.setattr(pyinfinity.zero.state, "AdamFp32", fmt_cls)
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
    from pyinfinity.plan.charges import DEVICE_STEP_SCRATCH, OPT_BYTES_PER_PARAM

    assert OPT_BYTES_PER_PARAM == AdamFp32.bytes_per_param
    assert DEVICE_STEP_SCRATCH == 4 * DEVICE_CHUNK
