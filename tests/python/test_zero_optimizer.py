"""OffloadOptimizer: Adam/AdamW on flat fp32 states in RAM or on NVMe (pipelined or not, partial
NVMe ratio) against torch's optimizers; clipping; fp16 loss scaling."""
from __future__ import annotations

import math

import pytest
import torch

from pyinfinity.config import FP16Config, OptimizerConfig
from pyinfinity.swap.tensor_swapper import TensorSwapper, Tier
from pyinfinity.zero.optim.formats import Adam8bit, make_state_format
from pyinfinity.zero.optimizer import DynamicLossScaler, OffloadOptimizer
from pyinfinity.zero.partition import FlatShard, ParamSlice

SIZES = [1000, 4097, 33, 70000, 5]


def make_shards(seed=0):
    g = torch.Generator().manual_seed(seed)
    shards, values = [], []
    for i, n in enumerate(SIZES):
        p = torch.nn.Parameter(torch.empty(0))
        sl = ParamSlice(f"p{i}", p, 0, n, torch.Size([n]), torch.float32, True)
        shards.append(FlatShard(index=i, module_name=f"m{i}", dtype=torch.float32, slices=[sl], numel=n))
        values.append(torch.randn(n, generator=g))
    return shards, values


def grads_for(step, seed=1):
    g = torch.Generator().manual_seed(seed + step)
    return [torch.randn(n, generator=g) * (3.0 if step % 2 else 0.5) for n in SIZES]


def read_master(opt, shard):
    st = opt.state_of(shard)
    buf = torch.empty(3 * shard.numel)
    opt.swapper.read(st.home, buf).wait()
    return buf[:shard.numel]


@pytest.mark.parametrize("tier, ratio, pipeline", [("cpu", 0.0, True), ("nvme", 1.0, True),
                                                   ("nvme", 1.0, False), ("nvme", 0.5, True)])
@pytest.mark.parametrize("mode", ["AdamW", "Adam"])
def test_step_matches_torch(tmp_path, tier, ratio, pipeline, mode):
    cfg = OptimizerConfig(type=mode, lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1,
                          adam_w_mode=(mode == "AdamW"))
    sw = TensorSwapper("optimizer", torch.device("cpu"), [str(tmp_path)] if tier == "nvme" else None)
    written = {}
    opt = OffloadOptimizer(cfg, sw, nvme_ratio=ratio, buffer_count=3, pipeline=pipeline,
                           write_param=lambda sh, m: written.__setitem__(sh.index, m.clone()))
    shards, values = make_shards()
    opt.plan(shards)
    for sh, v in zip(shards, values):
        opt.add_shard(sh, v)
    tiers = {st.home.tier for st in opt.states}
    assert tiers == ({Tier.CPU} if tier == "cpu" else {Tier.NVME} if ratio == 1.0 else {Tier.CPU, Tier.NVME})

    ref_params = [torch.nn.Parameter(v.clone()) for v in values]
    cls = torch.optim.AdamW if mode == "AdamW" else torch.optim.Adam
    ref = cls(ref_params, lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    for step in range(4):
        grads = grads_for(step)
        for sh, g in zip(shards, grads):
            opt.accumulate(sh, sh.slices[0], g)
        res = opt.step(clip=1.0)
        opt.zero_grad()
        for p, g in zip(ref_params, grads):
            p.grad = g.clone()
        norm = torch.nn.utils.clip_grad_norm_(ref_params, 1.0)
        ref.step()
        assert res.grad_norm == pytest.approx(float(norm), rel=1e-5)
    for sh, p in zip(shards, ref_params):
        torch.testing.assert_close(read_master(opt, sh), p.detach(), rtol=1e-5, atol=1e-7)
        torch.testing.assert_close(written[sh.index], p.detach(), rtol=1e-5, atol=1e-7)
    sw.close()
    assert not list(tmp_path.glob("*.swp"))  # swap files removed on close


def test_accumulation_is_fp32_and_handles_half_grads():
    sw = TensorSwapper("optimizer", torch.device("cpu"))
    opt = OffloadOptimizer(OptimizerConfig(), sw)
    shards, values = make_shards()
    opt.plan(shards)
    opt.add_shard(shards[0], values[0])
    sl = shards[0].slices[0]
    g = torch.randn(SIZES[0])
    opt.accumulate(shards[0], sl, g.to(torch.bfloat16))
    opt.accumulate(shards[0], sl, g.to(torch.bfloat16))
    st = opt.state_of(shards[0])
    assert st.grad.dtype == torch.float32
    torch.testing.assert_close(st.grad, 2 * g.to(torch.bfloat16).float(), rtol=0, atol=0)
    opt.zero_grad()  # no pass over the buffer: the next gradient overwrites, a missing one counts as 0
    g2 = torch.randn(SIZES[0])
    opt.accumulate(shards[0], sl, g2)
    torch.testing.assert_close(st.grad, g2, rtol=0, atol=0)
    opt.zero_grad()
    opt.grads.fill_unwritten()
    assert st.grad.abs().sum() == 0


def test_overflow_is_skipped_and_states_untouched(tmp_path):
    sw = TensorSwapper("optimizer", torch.device("cpu"), [str(tmp_path)])
    opt = OffloadOptimizer(OptimizerConfig(lr=0.1), sw, nvme_ratio=1.0)
    shards, values = make_shards()
    opt.plan(shards)
    for sh, v in zip(shards, values):
        opt.add_shard(sh, v)
    for sh in shards:
        g = torch.ones(sh.numel)
        if sh.index == 2:
            g[3] = float("inf")
        opt.accumulate(sh, sh.slices[0], g)
    res = opt.step(grad_scale=1024.0, check_overflow=True)
    assert res.skipped and not math.isfinite(res.grad_norm)
    for sh, v in zip(shards, values):
        torch.testing.assert_close(read_master(opt, sh), v, rtol=0, atol=0)
    sw.close()


def test_dynamic_loss_scaler():
    s = DynamicLossScaler(FP16Config(enabled=True, initial_scale_power=8, loss_scale_window=3, hysteresis=2,
                                     min_loss_scale=16))
    assert s.scale == 256
    s.update(True)  # hysteresis absorbs the first overflow
    assert s.scale == 256
    s.update(True)
    assert s.scale == 128
    for _ in range(3):
        s.update(False)
    assert s.scale == 256
    for _ in range(10):
        s.update(True)
        s.update(True)
    assert s.scale == 16  # never below min_loss_scale
    static = DynamicLossScaler(FP16Config(enabled=True, loss_scale=64))
    static.update(True)
    assert static.scale == 64


def make_mixed_shards(seed=0):
    """Shards of several parameters each: ``decay`` says which parameters are in the decay group."""
    g = torch.Generator().manual_seed(seed)
    layout = [[(300, True), (7, False), (513, True)], [(64, False), (64, False)], [(1000, True)],
              [(5, False), (4097, True), (3, False)]]
    shards, params, decay = [], [], []
    for i, sizes in enumerate(layout):
        slices, off = [], 0
        for j, (n, d) in enumerate(sizes):
            p = torch.nn.Parameter(torch.randn(n, generator=g))
            slices.append(ParamSlice(f"m{i}.p{j}", p, off, n, torch.Size([n]), torch.float32, True))
            params.append(p)
            decay.append(d)
            off += n
        shards.append(FlatShard(index=i, module_name=f"m{i}", dtype=torch.float32, slices=slices, numel=off))
    return shards, params, decay


@pytest.mark.parametrize("tier, fused, background", [("cpu", True, False), ("nvme", True, False),
                                                     ("cpu", False, False), ("cpu", True, True)])
def test_param_groups_that_differ_in_weight_decay_step_as_torch_adamw_with_those_groups(tmp_path, tier, fused,
                                                                                         background):
    cfg = OptimizerConfig(type="AdamW", lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, adam_w_mode=True)
    sw = TensorSwapper("optimizer", torch.device("cpu"), [str(tmp_path)] if tier == "nvme" else None)
    opt = OffloadOptimizer(cfg, sw, nvme_ratio=1.0 if tier == "nvme" else 0.0, buffer_count=3,
                           background=background)
    opt.fused = fused
    shards, params, decay = make_mixed_shards()
    opt.plan(shards)
    for sh in shards:
        opt.add_shard(sh, torch.cat([sl.param.detach() for sl in sh.slices]))
    split = opt.set_weight_decay({id(p): 0.0 for p, d in zip(params, decay) if not d})
    assert split == 2  # shards 0 and 3 mix the groups; 1 has no decay at all, 2 the group's

    ref_params = [torch.nn.Parameter(p.detach().clone()) for p in params]
    ref = torch.optim.AdamW([{"params": [r for r, d in zip(ref_params, decay) if d], "weight_decay": 0.1},
                             {"params": [r for r, d in zip(ref_params, decay) if not d], "weight_decay": 0.0}],
                            lr=1e-2, betas=(0.9, 0.95), eps=1e-8)
    gen = torch.Generator().manual_seed(7)
    for step in range(4):
        grads = [torch.randn(p.numel(), generator=gen) for p in params]
        k = 0
        for sh in shards:
            for sl in sh.slices:
                opt.accumulate(sh, sl, grads[k])
                k += 1
        opt.step(clip=1.0)
        opt.drain()
        opt.zero_grad()
        for r, g in zip(ref_params, grads):
            r.grad = g.clone()
        torch.nn.utils.clip_grad_norm_(ref_params, 1.0)
        ref.step()
    k = 0
    for sh in shards:
        master = read_master(opt, sh)
        for sl in sh.slices:
            torch.testing.assert_close(master[sl.offset:sl.offset + sl.numel], ref_params[k].detach(), rtol=1e-6,
                                       atol=1e-7)
            k += 1
    opt.close()
    sw.close()


def test_a_split_weight_decay_is_refused_for_adam_l2_decay():
    cfg = OptimizerConfig(type="Adam", lr=1e-2, weight_decay=0.1, adam_w_mode=False)
    opt = OffloadOptimizer(cfg, TensorSwapper("optimizer", torch.device("cpu"), None))
    shards, params, decay = make_mixed_shards()
    for sh in shards:
        opt.add_shard(sh, torch.cat([sl.param.detach() for sl in sh.slices]))
    with pytest.raises(ValueError, match="L2 decay"):
        opt.set_weight_decay({id(p): 0.0 for p, d in zip(params, decay) if not d})
    opt.close()


@pytest.mark.parametrize("tier, fused, background", [("cpu", True, False), ("nvme", True, False),
                                                     ("cpu", False, False), ("cpu", True, True)])
def test_param_groups_that_differ_in_lr_betas_and_eps_step_as_torch_adamw_with_those_groups_under_a_schedule(
        tmp_path, tier, fused, background):
    # group 0: the "decay" parameters; group 1 (LoRA+ style): ten times the lr, other betas and eps, no decay
    cfg = OptimizerConfig(type="AdamW", lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, adam_w_mode=True)
    sw = TensorSwapper("optimizer", torch.device("cpu"), [str(tmp_path)] if tier == "nvme" else None)
    opt = OffloadOptimizer(cfg, sw, nvme_ratio=1.0 if tier == "nvme" else 0.0, buffer_count=3,
                           background=background)
    opt.fused = fused
    shards, params, decay = make_mixed_shards()
    opt.plan(shards)
    for sh in shards:
        opt.add_shard(sh, torch.cat([sl.param.detach() for sl in sh.slices]))
    other = {"lr": 1e-2, "betas": (0.8, 0.99), "eps": 1e-6, "weight_decay": 0.0}
    split = opt.set_param_groups([{"params": [p for p, d in zip(params, decay) if d]},
                                  {"params": [p for p, d in zip(params, decay) if not d], **other}])
    assert split == 2  # shards 0 and 3 mix the groups
    assert [g["lr"] for g in opt.param_groups] == [1e-3, 1e-2]

    ref_params = [torch.nn.Parameter(p.detach().clone()) for p in params]
    ref = torch.optim.AdamW([{"params": [r for r, d in zip(ref_params, decay) if d]},
                             {"params": [r for r, d in zip(ref_params, decay) if not d], **other}],
                            lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    ratio = lambda k: (k + 1) / 4  # noqa: E731 - a warm-up: the schedule scales each group's own lr
    ref_sched = torch.optim.lr_scheduler.LambdaLR(ref, ratio)
    for g in opt.param_groups:  # as LambdaLR does on the engine's optimizer (Trainer's): initial_lr * ratio
        g["lr"] = g["initial_lr"] * ratio(0)
    gen = torch.Generator().manual_seed(7)
    for step in range(4):
        grads = [torch.randn(p.numel(), generator=gen) for p in params]
        k = 0
        for sh in shards:
            for sl in sh.slices:
                opt.accumulate(sh, sl, grads[k])
                k += 1
        opt.step(clip=1.0)
        opt.drain()
        opt.zero_grad()
        for g in opt.param_groups:
            g["lr"] = g["initial_lr"] * ratio(step + 1)
        for r, g in zip(ref_params, grads):
            r.grad = g.clone()
        torch.nn.utils.clip_grad_norm_(ref_params, 1.0)
        ref.step()
        ref_sched.step()
    assert [g["lr"] for g in opt.param_groups] == [g["lr"] for g in ref.param_groups]
    k = 0
    for sh in shards:
        master = read_master(opt, sh)
        for sl in sh.slices:
            torch.testing.assert_close(master[sl.offset:sl.offset + sl.numel], ref_params[k].detach(), rtol=1e-6,
                                       atol=1e-7)
            k += 1
    opt.close()
    sw.close()


def test_param_groups_of_other_lrs_within_a_quantisation_block_of_the_8bit_state_are_refused_in_one_line():
    cfg = OptimizerConfig(type="AdamW", lr=1e-3, adam_w_mode=True)
    opt = OffloadOptimizer(cfg, TensorSwapper("optimizer", torch.device("cpu"), None),
                           state_format=make_state_format("8bit", True))
    shards, params, decay = make_mixed_shards()
    big = [sh for sh in shards if Adam8bit.quantized(sh.numel)]
    assert big  # shard 3 (5 + 4097 + 3 elements) keeps the 8-bit state
    for sh in shards:
        opt.add_shard(sh, torch.cat([sl.param.detach() for sl in sh.slices]))
    # the same lr in both groups, only weight decay differing: the decay pass, no block boundary needed
    opt.set_param_groups([{"params": [p for p, d in zip(params, decay) if d]},
                          {"params": [p for p, d in zip(params, decay) if not d], "weight_decay": 0.0}])
    with pytest.raises(ValueError, match=r"^param groups within one unit \(m3\): a group's parameters start at "
                                         r"element 5, inside a quantisation block of 256 of the 8bit") as e:
        opt.set_param_groups([{"params": [p for p, d in zip(params, decay) if d]},
                              {"params": [p for p, d in zip(params, decay) if not d], "lr": 1e-2}])
    assert "\n" not in str(e.value)
    opt.close()


@pytest.mark.parametrize("fmt, fused", [("8bit", True), ("8bit", False), ("bf16", True), ("bf16", False)])
def test_a_group_of_its_own_lr_in_a_shard_steps_bit_for_bit_as_that_parameter_in_a_shard_of_its_own(fmt, fused):
    # the compressed formats step a range by itself: the same bits as the range stepped as a whole shard
    # (8-bit: the ranges start on a quantisation block)
    cfg = OptimizerConfig(type="AdamW", lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1, adam_w_mode=True)
    g = torch.Generator().manual_seed(3)
    sizes = (4096, 4096 + 7)  # each of at least MIN_QUANTIZED_NUMEL: 8-bit alone too
    values = [torch.randn(n, generator=g) for n in sizes]

    def optimizer(shards):
        opt = OffloadOptimizer(cfg, TensorSwapper("optimizer", torch.device("cpu"), None),
                               state_format=make_state_format(fmt, True))
        opt.fused = fused
        for sh in shards:
            opt.add_shard(sh, torch.cat([sl.param.detach() for sl in sh.slices]))
        return opt

    params = [torch.nn.Parameter(v.clone()) for v in values]
    joint = FlatShard(index=0, module_name="m", dtype=torch.float32, numel=sum(sizes), slices=[
        ParamSlice("m.a", params[0], 0, sizes[0], torch.Size([sizes[0]]), torch.float32, True),
        ParamSlice("m.b", params[1], sizes[0], sizes[1], torch.Size([sizes[1]]), torch.float32, True)])
    alone = [FlatShard(index=i, module_name=f"m{i}", dtype=torch.float32, numel=n, slices=[
        ParamSlice(f"m{i}.p", torch.nn.Parameter(v.clone()), 0, n, torch.Size([n]), torch.float32, True)])
        for i, (n, v) in enumerate(zip(sizes, values))]
    both, a, b = optimizer([joint]), optimizer(alone[:1]), optimizer(alone[1:])
    assert both.set_param_groups([{"params": [params[0]]}, {"params": [params[1]], "lr": 3e-3, "eps": 1e-6}]) == 1
    b.param_groups[0].update(lr=3e-3, eps=1e-6)
    for _ in range(3):
        grads = [torch.randn(n, generator=g) for n in sizes]
        for sl, gr in zip(joint.slices, grads):
            both.accumulate(joint, sl, gr)
        for opt, sh, gr in ((a, alone[0], grads[0]), (b, alone[1], grads[1])):
            opt.accumulate(sh, sh.slices[0], gr)
        for opt in (both, a, b):
            opt.step()
            opt.zero_grad()
    def master(opt, sh):
        return opt.format.master(opt.home_in_ram(opt.state_of(sh)), sh.numel).float().clone()

    got = master(both, joint)
    assert not torch.equal(got[:sizes[0]], values[0])  # stepped
    assert torch.equal(got[:sizes[0]], master(a, alone[0]))
    assert torch.equal(got[sizes[0]:], master(b, alone[1]))
    for opt in (both, a, b):
        opt.close()
