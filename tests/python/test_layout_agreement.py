"""The layout (``pyinfinity.layout``) and the engine agree: over a grid of tiny models (two sizes x
parameter and optimizer tiers {cpu, nvme} x optimizer-state formats {fp32, 8bit, bf16} x LoRA x
gradient accumulation) the engine is built and what it actually reserved is read back, never the
layout again: the homes its swappers hold in RAM and on disk, the swap files' sizes on disk, the
pinned bytes its arenas reserved, what its device budget holds after ``initialize()`` and the
growth of the process's resident set across it. Each is equal to or within the layout's figure
for the same config (``plan.placement_of``: the planner's layout; ``layout.engine_pools``: what
the engine checks and reserves from). The GPU variant compares ``torch.cuda.max_memory_allocated()``
over the baseline after a step with the layout's device figure."""
from __future__ import annotations

import gc
import os

import pytest
import torch

import pyinfinity
from pyinfinity.config_values import STATE_FORMATS
from pyinfinity.layout.pools import SWAP_SLOT_ALIGN, Share, home_bytes_per_param
from pyinfinity.plan import Budgets, Rates, placement_of
from pyinfinity.telemetry import host_rss

MiB = 1 << 20
# the resident set grows by more than the training state's bytes: torch's and glibc's allocators keep
# freed memory (the model's own parameters, copied into their homes), the swap engines' threads and
# buffers, the partition's bookkeeping. The growth across initialize() stays within the layout's host
# figure plus this allowance.
RSS_ALLOWANCE = 96 * MiB
# the engine's optimizer-state homes align their sections; the planner counts the format's bytes
# (StateFormat.shard_bytes) without it: at most this much more a shard
HOME_ALIGN_SLACK = 4096

STATE_KEYS = {"fp32": {},
              "8bit": {"pyinfinity": {"optimizer_state": "8bit"}},
              "bf16": {"bf16": {"enabled": True, "bf16_master_weights_and_grads": True,
                                "bf16_optimizer_states": True}}}
SIZES = {"small": {"d": 32, "layers": 2}, "wider": {"d": 96, "layers": 3}}  # 96: 8-bit shards are quantised

# preset rates: the figures compared are bytes, which no rate changes; nothing is probed
RATES = Rates(h2d=10e9, d2h=10e9, disk_read=2e9, disk_write=1e9, adam=1e9, matmul=1e12, memcpy=5e9,
              device="cpu")


def _model(tiny_lm, size: str, lora: bool, dtype: torch.dtype) -> torch.nn.Module:
    model = tiny_lm(**SIZES[size]).to(dtype)
    if lora:
        peft = pytest.importorskip("peft")
        model = peft.get_peft_model(model, peft.LoraConfig(r=4, target_modules=["up", "down"]))
        for p in model.parameters():  # the adapters train in the base's dtype
            p.data = p.data.to(dtype)
    return model


def _config(engine_config, tier: str, fmt: str, accumulation: int) -> dict:
    cfg = engine_config(tier, **STATE_KEYS[fmt])
    cfg["gradient_accumulation_steps"] = accumulation
    z = cfg["zero_optimization"]
    z["stage3_param_persistence_threshold"] = 200  # the norms' shards stay on the device
    if tier == "nvme":
        z["offload_param"]["max_in_cpu"] = 3000  # a few shards stay in RAM, the rest go to disk
        z["offload_optimizer"]["ratio"] = 0.5
    return cfg


def _swap_files(swap: str) -> dict[str, int]:
    """Bytes on disk of each swap file under ``swap`` (the manifest and lock aside)."""
    out: dict[str, int] = {}
    if not os.path.isdir(swap):
        return out
    for name in os.listdir(swap):
        path = os.path.join(swap, name)
        if os.path.isfile(path) and name.endswith(".swp"):
            out[path] = os.stat(path).st_blocks * 512
    return out


def _homes(state: Share, fmt: str, accumulation: int) -> Share:
    """The bytes of the optimizer state's homes (``layout.pools.home_bytes``) for the planner's
    state bytes ``state``: a bf16 master's home holds the gradient's slot beside the moments, which
    the planner counts with the gradients without accumulation (the slot is the gradient buffer)
    and with the home under it (the gradients are the fp32 accumulators)."""
    f = STATE_FORMATS[fmt]
    scale = home_bytes_per_param(f) / f.state_bytes if f.weights_are_master and accumulation == 1 else 1.0
    return Share(ram=int(state.ram * scale), disk=int(state.disk * scale))


def _arena_bytes(swapper) -> int:
    arena = swapper._arena
    return 0 if arena is None else int(arena.stats()["capacity"])


@pytest.mark.parametrize("accumulation", [1, 2])
@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
@pytest.mark.parametrize("fmt", ["fp32", "8bit", "bf16"])
@pytest.mark.parametrize("tier", ["cpu", "nvme"])
@pytest.mark.parametrize("size", sorted(SIZES))
def test_what_the_engine_reserves_is_what_the_layout_says(tiny_lm, engine_config, tmp_path, size, tier, fmt, lora,
                                                          accumulation):
    dtype = torch.bfloat16 if fmt == "bf16" else torch.float32
    cfg = _config(engine_config, tier, fmt, accumulation)
    model = _model(tiny_lm, size, lora, dtype)
    swap = cfg["zero_optimization"]["offload_param"]["nvme_path"]
    if tier == "nvme":
        os.makedirs(swap, exist_ok=True)
    budgets = Budgets(device_memory=64 * MiB, host_memory=1 << 34, device_is_host=True)
    plan = placement_of(cfg, model, budgets, RATES, seq_len=8)
    gc.collect()
    rss0 = host_rss()
    with pyinfinity.initialize(model, cfg) as eng:
        rss = host_rss() - rss0
        st = eng.state
        pools = st.pools  # layout.engine_pools of the engine's config and sizes
        shards = len(eng.partition.shards)
        params, optim = st.param_swapper.stats.resident, st.optim_swapper.stats.resident

        # the parameters' homes: exactly the layout's bytes in each tier
        assert params.get("cpu", 0) == plan.params.ram
        assert params.get("nvme", 0) == plan.params.disk
        # the optimizer state's homes: the format's bytes (and their sections' alignment), within
        # what the engine reserves for them
        homes = _homes(plan.optimizer, fmt, accumulation)
        assert homes.ram <= optim.get("cpu", 0) <= homes.ram + HOME_ALIGN_SLACK * shards
        assert optim.get("cpu", 0) <= pools.optim_ram
        assert homes.disk <= optim.get("nvme", 0) <= homes.disk + HOME_ALIGN_SLACK * shards
        assert optim.get("nvme", 0) <= pools.optim_disk + pools.param_disk or not optim.get("nvme", 0)
        assert params.get("nvme", 0) <= pools.param_disk

        # the swap files on disk: within the layout's figure for the directory
        files = _swap_files(swap)
        if plan.swap_bytes:
            on_disk = sum(files.values())
            assert on_disk <= plan.swap_per_dir[swap], (files, plan.swap_per_dir)
            assert on_disk >= params.get("nvme", 0) + optim.get("nvme", 0) - 2 * shards * SWAP_SLOT_ALIGN
        else:
            assert not files

        # pinned memory the arenas reserved (none without a GPU): within the engine's pools
        assert _arena_bytes(st.param_swapper) <= pools.param_pinned
        assert _arena_bytes(st.optim_swapper) <= pools.optim_pinned

        # the device budget after initialize(): the persistent shards the layout keeps there
        budget = st.coordinator.budget
        c = plan.charges
        buffers = sum(b.numel() * b.element_size() for b in model.buffers())
        assert budget.resident <= c.persistent + c.resident + c.device_state + c.accumulators + buffers
        assert budget.resident >= c.persistent

        # the process's resident set grew by at most the layout's host figure and the allowance
        assert rss <= plan.host_bytes + RSS_ALLOWANCE, (rss, plan.host_bytes)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("accumulation", [1, 2])
@pytest.mark.parametrize("fmt", ["fp32", "8bit", "bf16"])
@pytest.mark.parametrize("tier", ["cpu", "nvme"])
def test_the_device_peak_is_within_the_layouts_device_figure(tiny_lm, engine_config, lm_batches, tier, fmt,
                                                             accumulation):
    dtype = torch.bfloat16 if fmt == "bf16" else torch.float32
    cfg = _config(engine_config, tier, fmt, accumulation)
    cfg["pyinfinity"] = {**cfg["pyinfinity"], "device": "cuda", "device_memory": "512MiB"}
    cfg["bf16"] = {**cfg.get("bf16", {}), "enabled": True}
    model = _model(tiny_lm, "wider", False, dtype)
    swap = cfg["zero_optimization"]["offload_param"]["nvme_path"]
    if tier == "nvme":
        os.makedirs(swap, exist_ok=True)
    budgets = Budgets(device_memory=512 * MiB, host_memory=1 << 34)
    rates = Rates(h2d=10e9, d2h=10e9, disk_read=2e9, disk_write=1e9, adam=1e9, matmul=1e12, memcpy=5e9,
                  device="cuda")
    seq = 8
    plan = placement_of(cfg, model, budgets, rates, seq_len=seq)
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    with pyinfinity.initialize(model, cfg) as eng:
        st = eng.state
        pools = st.pools  # layout.engine_pools of the engine's config and sizes
        assert _arena_bytes(st.param_swapper) <= pools.param_pinned
        assert _arena_bytes(st.optim_swapper) <= pools.optim_pinned
        for x, y in lm_batches(accumulation, seq=seq):
            loss = eng(x.cuda(), y.cuda())
            eng.backward(loss)
            eng.step()
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - base
    assert peak <= plan.device_bytes, (peak, plan.charges)
