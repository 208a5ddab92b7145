"""A config that fixes its placement: the planner's check before the engine writes a byte
(``plan.resolve.check_placement``) refuses in one line for each pool it does not fit, the
layout's swap figure for it is what the engine claims in each directory, and the units the
engine places on the device are the layout's."""
from __future__ import annotations

import errno
import os

import pytest

import pyinfinity
from pyinfinity.config import format_size, load_config
from pyinfinity.config_values import SwapSpaceTooSmall
from pyinfinity.layout.charges import fmt
from pyinfinity.plan import Budgets, PlanError, Rates, SwapDir, placement_of, plan_engine_config
from pyinfinity.plan.resolve import check_placement
from tests.python.conftest import train_steps

GiB = 1 << 30
MiB = 1 << 20
RATES = Rates(h2d=1e9, d2h=1e9, disk_read=1e9, disk_write=1e9, adam=1e9, matmul=1e12, memcpy=1e9)


def _resolved(cfg: dict, model, device: str, budgets: Budgets):
    """The config as the engine holds it when it checks the placement (every "auto" decided)."""
    c, _, plan = plan_engine_config(load_config(cfg), model, device, budgets=budgets)
    assert plan is None  # the config fixes the placement
    return c


def test_the_layouts_swap_figure_of_a_fixed_placement_is_what_the_engine_claims(tiny_lm, engine_config):
    cfg = engine_config("nvme")
    swap = cfg["zero_optimization"]["offload_param"]["nvme_path"]
    os.makedirs(swap, exist_ok=True)
    model = tiny_lm()
    budgets = Budgets(device_memory=64 * MiB, host_memory=1 << 34, device_is_host=True,
                      swap=[SwapDir(swap, 100 * GiB, 1)])
    plan = placement_of(cfg, model, budgets, RATES, seq_len=8)
    with pyinfinity.initialize(model, cfg) as eng:
        claimed = sum(p.file_bytes for p in eng.state.ownership.plans.values())
        on_disk = sum(os.path.getsize(f) for f in eng.param_swapper.files() + eng.optim_swapper.files())
    assert plan.swap_per_dir == {swap: claimed}
    assert 0 < on_disk <= claimed


def test_a_fixed_placement_whose_swap_files_do_not_fit_is_refused_in_one_line(tiny_lm, engine_config):
    cfg = engine_config("nvme")
    swap = cfg["zero_optimization"]["offload_param"]["nvme_path"]
    os.makedirs(swap, exist_ok=True)
    model = tiny_lm()
    roomy = Budgets(device_memory=64 * MiB, host_memory=1 << 34, device_is_host=True,
                    swap=[SwapDir(swap, 100 * GiB, 1)])
    c = _resolved(cfg, model, "cpu", roomy)
    need = check_placement(c, model, "cpu", budgets=roomy).swap_per_dir[swap]
    tight = Budgets(device_memory=64 * MiB, host_memory=1 << 34, device_is_host=True,
                    swap=[SwapDir(swap, need - 1, 1)])
    with pytest.raises(SwapSpaceTooSmall) as ei:  # as the swap claim refuses: ENOSPC naming the directory
        check_placement(c, model, "cpu", budgets=tight)
    assert ei.value.errno == errno.ENOSPC and ei.value.filename == swap
    msg = ei.value.strerror
    assert "\n" not in msg and "nothing was written" in msg, msg
    assert (f"swap: the swap files they need {format_size(need)} (params " in msg
            and f"the filesystem of {swap} has {format_size(need - 1)} free: {format_size(1)} missing" in msg), msg
    assert "give nvme_path directories on a disk with that room" in msg, msg


def test_a_fixed_placement_over_the_device_budget_is_refused_in_one_line(tiny_lm, engine_config):
    """On a GPU (planned for, not touched: the budgets are given) the device's need beside the
    prefetch bucket, which the engine can shrink, is checked against the budget too."""
    cfg = engine_config("cpu", pyinfinity={"device": "cuda:0", "device_memory": "16KiB"})
    model = tiny_lm()
    budgets = Budgets(device_memory=16 << 10, host_memory=1 << 34)
    c = _resolved(cfg, model, "cuda:0", budgets)
    with pytest.raises(PlanError) as ei:
        check_placement(c, model, "cuda:0", budgets=budgets)
    msg = str(ei.value)
    assert "\n" not in msg and "device memory: needs " in msg and f"budget {fmt(16 << 10)}" in msg, msg
    assert "prefetch" not in msg.split(";")[0], msg  # the bucket the engine can shrink is not charged
    assert "raise pyinfinity.device_memory" in msg, msg
    # the same config within a budget that holds it passes
    roomy = Budgets(device_memory=GiB, host_memory=1 << 34)
    assert check_placement(_resolved(cfg, model, "cuda:0", roomy), model, "cuda:0", budgets=roomy).violations == []


@pytest.mark.parametrize("accumulation", [1, 2])
def test_the_engine_applies_the_device_side_the_layout_decides(tiny_lm, lm_batches, engine_config, accumulation):
    """One rule, decided once: the units the engine keeps on the device, steps there and
    accumulates there are those the layout of the same resolved config places (``plan_layout``
    over the sizes counted from the module before the partition): the layout decides, the engine
    applies. The host gradient bytes the engine allocates are the layout's and its pools'."""
    from pyinfinity.layout.pools import LANDING_SLOTS, landing_bytes, plan_layout
    from pyinfinity.plan.resolve import _fixed_knobs, _train_shape
    from pyinfinity.plan.sizes import model_sizes

    cfg = engine_config("cpu", gradient_accumulation_steps=accumulation,
                        pyinfinity={"device": "cpu", "device_memory": "64MiB", "resident_bytes": "12KiB",
                                    "device_optimizer_bytes": "8KiB", "device_accumulator_bytes": "1MiB",
                                    "unit_bytes": 0})
    model = tiny_lm()
    budgets = Budgets(device_memory=64 * MiB, host_memory=1 << 34, device_is_host=True)
    c = _resolved(cfg, model, "cpu", budgets)
    sizes = model_sizes(model, None, unit_bytes=int(c.pyinfinity.unit_bytes))
    lay = plan_layout(sizes, _train_shape(c, 8, False), _fixed_knobs(c, sizes, 64 * MiB), 64 * MiB,
                      device_is_host=True)
    with pyinfinity.initialize(model, cfg) as eng:
        dp = eng.state.placement
        resident = {sh.index for sh in dp.resident_units}
        stepped = sorted(sh.index for sh in eng.partition.shards if sh.device_step)
        accumulated = sorted(sh.index for sh in eng.partition.shards if sh.grad_on_device)
        train_steps(eng, lm_batches(accumulation))
        host_grads = eng.optimizer.grad_bytes  # what the engine allocated: host accumulators, landing ring
        pools_grads = eng.state.pools.grads
    assert resident == lay.shards.resident and resident
    assert stepped == sorted(lay.shards.device_state) and stepped
    assert accumulated == sorted(lay.shards.device_accumulators)
    assert bool(accumulated) == (accumulation > 1)
    if accumulation > 1:  # the device accumulators' sums land in the layout's ring, not a buffer each
        assert host_grads == lay.grads.ram - lay.grad_staging == pools_grads
        assert lay.landing == landing_bytes([sizes.shard_numels[i] for i in accumulated]) > 0
        assert len(accumulated) > LANDING_SLOTS and lay.landing < 4 * sum(sizes.shard_numels[i] for i in accumulated)
