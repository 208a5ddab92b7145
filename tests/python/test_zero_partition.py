"""Partitioning: flat shards per module in the compute dtype, fp32 masters, tied parameters,
materialisation of meta (init_empty) models one module at a time."""
from __future__ import annotations

import pytest
import torch

import pyinfinity
from pyinfinity.zero.partition import partition_model


def _partition(model, **kw):
    got = {}

    def on_shard(shard, flat, flat32):
        got[shard.index] = (flat.clone(), None if flat32 is None else flat32.clone())

    part = partition_model(model, on_shard=on_shard, **kw)
    return part, got


def test_shards_hold_every_parameter_once_in_module_order(tiny_lm):
    model = tiny_lm(layers=2)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    part, got = _partition(model)
    # one shard per module with parameters; tied head.weight is not a second copy
    assert part.numel == sum(t.numel() for t in before.values())
    assert [s.module_name for s in part.shards][:2] == ["embed", "blocks.0.norm"]
    for sh in part.shards:
        flat, flat32 = got[sh.index]
        assert flat.dtype == torch.float32 and flat.numel() == sh.numel
        for sl in sh.slices:
            torch.testing.assert_close(flat[sl.offset:sl.offset + sl.numel].view(sl.shape), before[sl.name],
                                       rtol=0, atol=0)
            assert sl.param.numel() == 0  # released: a placeholder, not the data


def test_dtype_is_never_changed_silently():
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4).to(torch.bfloat16))
    part, _ = _partition(model)
    assert [s.dtype for s in part.shards] == [torch.float32, torch.bfloat16]


@pytest.mark.parametrize("flag, dtype", [("bf16", torch.bfloat16), ("fp16", torch.float16)])
def test_half_compute_keeps_fp32_master_exact(tiny_lm, flag, dtype):
    model = tiny_lm()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    part, got = _partition(model, **{flag: True})
    for sh in part.shards:
        flat, flat32 = got[sh.index]
        assert sh.dtype == dtype and flat.dtype == dtype and flat32.dtype == torch.float32
        for sl in sh.slices:
            assert sl.orig_dtype == torch.float32
            torch.testing.assert_close(flat32[sl.offset:sl.offset + sl.numel].view(sl.shape), before[sl.name],
                                       rtol=0, atol=0)


def test_a_frozen_shard_gets_no_fp32_master():
    """A frozen bf16 base costs its stored copy: no fp32 copy is made of it; a trainable one's
    master is exact, and a frozen fp32 shard's values are their own master."""
    model = torch.nn.Sequential(torch.nn.Linear(4, 4).to(torch.bfloat16), torch.nn.Linear(4, 4).to(torch.bfloat16),
                                torch.nn.Linear(4, 4))
    model[0].requires_grad_(False)
    model[2].requires_grad_(False)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    part, got = _partition(model)
    (f0, m0), (f1, m1), (f2, m2) = (got[sh.index] for sh in part.shards)
    assert m0 is None and f0.dtype == torch.bfloat16
    assert m1.dtype == torch.float32 and torch.equal(m1[:16].view(4, 4), before["1.weight"].float())
    assert m2 is not None and torch.equal(f2, m2) and torch.equal(f2[:16].view(4, 4), before["2.weight"])


def test_tied_parameter_has_one_shard_needed_by_both_modules(tiny_lm):
    model = tiny_lm(tie=True)
    part, _ = _partition(model)
    emb_shard = part.param_slice[id(model.embed.weight)][0]
    assert part.param_slice[id(model.head.weight)][0] is emb_shard
    assert emb_shard in part.module_shards[model.head] and emb_shard in part.module_shards[model.embed]
    assert model.head.weight is model.embed.weight


def test_persistence_threshold_marks_small_shards(tiny_lm):
    model = tiny_lm(d=16)
    part, _ = _partition(model, persistence_threshold=100)
    assert {s.module_name for s in part.shards if s.persistent} == {s.module_name for s in part.shards
                                                                     if s.numel <= 100}
    assert any(s.persistent for s in part.shards) and not all(s.persistent for s in part.shards)


def test_init_empty_builds_on_meta_and_materialises_per_module(tiny_lm):
    with pyinfinity.init_empty():
        model = tiny_lm(tie=True)
    assert all(p.is_meta for p in model.parameters())
    assert model.head.weight is model.embed.weight
    seen = []

    def on_shard(shard, flat, flat32):
        # by the time a shard is placed, no later module has been materialised yet
        seen.append((shard.module_name, sum(1 for p in model.parameters() if not p.is_meta and p.numel())))
        assert torch.isfinite(flat32).all() and flat32.abs().sum() > 0 or "norm" in shard.module_name

    part = partition_model(model, on_shard=on_shard)
    assert len(seen) == len(part.shards)
    assert all(n == 0 for _, n in seen)  # parameters are placeholders again right after placement
    assert not any(p.is_meta for p in model.parameters())
    assert model.head.weight is model.embed.weight  # the tie survives materialisation


def test_init_empty_transformers_model_uses_its_own_init():
    from transformers import LlamaConfig, LlamaForCausalLM

    mc = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                     num_attention_heads=4, num_key_value_heads=4, initializer_range=0.05)
    with pyinfinity.init_empty():
        model = LlamaForCausalLM(mc)
    stats = {}

    def on_shard(shard, flat, flat32):
        stats[shard.module_name] = (float(flat32.std()), float(flat32.mean()))

    partition_model(model, on_shard=on_shard)
    assert stats["model.embed_tokens"][0] == pytest.approx(0.05, rel=0.1)
    assert stats["model.layers.0.mlp.up_proj"][0] == pytest.approx(0.05, rel=0.1)
    assert stats["model.layers.0.input_layernorm"] == (0.0, 1.0)
    torch.testing.assert_close(model.model.rotary_emb.inv_freq[:2], torch.tensor([1.0, 10000 ** (-2 / 16)]))
