"""The placement rule (``pyinfinity.layout.shards``) and the pools' formulas (``layout.pools``) on
small made-up shard lists: the rule the planner evaluates and the engine applies, stated once."""
from __future__ import annotations

from types import SimpleNamespace

from pyinfinity.config_values import MIN_QUANTIZED_NUMEL, STATE_FORMATS
from pyinfinity.layout.pools import PINNED_SLACK, engine_pools, home_bytes, home_slack, page_rounded
from pyinfinity.layout.shards import (Knobs, ParamTiers, device_units, optimizer_tiers, param_tiers, resident_units,
                                      shard_layout)
from pyinfinity.layout.sizes import ModelSizes


def test_parameter_shards_fill_max_in_cpu_in_creation_order_whole_shards_only():
    assert param_tiers([10, 30, 5, 20], "nvme", 40) == ["ram", "ram", "disk", "disk"]
    tiers = ParamTiers("nvme", 40)
    # 35 does not fit the 30 left, 5 still does, 30 not the 25 left then
    assert [tiers.next(n) for n in (10, 35, 5, 30)] == ["ram", "disk", "ram", "disk"]
    assert param_tiers([1, 2], "cpu", 0) == ["ram", "ram"]
    assert param_tiers([1, 2], "none", 0) == ["device", "device"]


def test_resident_units_are_whole_units_from_the_end_skipping_persistent_and_too_large_ones():
    # bytes 40 30 20 10; the last is persistent (resident anyway); 55 bytes of budget
    assert resident_units([40, 30, 20, 10], [False, False, False, True], 55) == {2, 1}
    assert resident_units([40, 30, 20, 10], [False, False, False, False], 45) == {3, 2}
    assert resident_units([40, 30], [False, False], 0) == set()


def test_device_state_goes_to_resident_units_from_the_front_and_accumulators_skip_them():
    numels, nbytes = [10, 10, 10, 10], [20, 20, 20, 20]
    trainable, persistent = [True, True, False, True], [False] * 4
    k = Knobs(param_device="cpu", resident_bytes=60, device_optimizer_bytes=25, device_accumulator_bytes=1000)
    resident, state, acc = device_units(numels, nbytes, trainable, persistent, k, 2, lambda i: 20.0)
    assert resident == {1, 2, 3}
    assert state == [1]  # the first resident trainable unit; the next (3) does not fit 25 - 20
    assert acc == [0, 3]  # trainable, not stepped on the device; the frozen one has none
    _, state, acc = device_units(numels, nbytes, trainable, persistent,
                                 Knobs(resident_bytes=60, device_optimizer_bytes=25, optimizer_step_device="device",
                                       device_accumulator_bytes=1000), 1, lambda i: 20.0)
    assert state == [] and acc == []  # the streamed device step steps everything there; no accumulation


def test_the_optimizer_state_keeps_the_first_share_of_trainable_elements_in_ram():
    assert optimizer_tiers([10, 10, 5, 10], [True, True, False, True], "nvme", 0.5) == ["ram", "disk", "", "disk"]
    assert optimizer_tiers([10, 10], [True, True], "cpu", 0.5) == ["ram", "ram"]
    lay = shard_layout([50, 10, 200], [100, 20, 400], [True, True, True], Knobs(persistence_threshold=10), 1,
                       lambda i: 0.0)
    assert lay.persistent == {1} and lay.on_device(1) and not lay.on_device(0)


def test_a_home_holds_the_formats_bytes_and_small_8bit_shards_are_kept_fp32():
    eight, bf16 = STATE_FORMATS["8bit"], STATE_FORMATS["bf16"]
    assert home_bytes(eight, MIN_QUANTIZED_NUMEL - 1) == 12 * (MIN_QUANTIZED_NUMEL - 1)
    assert home_bytes(bf16, 100) == 600  # the bf16 master's gradient slot beside the moments
    assert home_slack(STATE_FORMATS["fp32"], 7) == 0
    assert home_slack(eight, 3) == 3 * 12 * (MIN_QUANTIZED_NUMEL - 1)


def test_the_engines_pools_split_the_parameters_as_the_shards_are_placed():
    sizes = ModelSizes(shard_numels=[1000, 3000, 500], shard_trainable=[True, True, True], itemsize=2,
                       block_bytes=6000, flops_per_token=0.0, largest_module_bytes=6000)
    z = SimpleNamespace(offload_param=SimpleNamespace(device="nvme", max_in_cpu=1600, nvme_path=["/swap"]),
                        offload_optimizer=SimpleNamespace(device="cpu", ratio=1.0, nvme_path=None),
                        stage3_param_persistence_threshold=0)
    cfg = SimpleNamespace(zero_optimization=z, optimizer_state_format="fp32", gradient_accumulation_steps=1)
    pools = engine_pools(cfg, sizes, 3)
    assert (pools.param_ram, pools.param_disk) == (1500 * 2, 3000 * 2)  # 1000 and 500 fit 1600 elements; 3000 not
    assert pools.param_pinned == page_rounded(pools.param_ram + PINNED_SLACK)  # whole pages, as the arena reserves
    assert pools.optim_ram == 4500 * 12 and pools.optim_disk == 0
    assert pools.grads == 3000 * 2  # the disk-homed shard's gradient needs a buffer of its own


def test_under_accumulation_the_engine_charges_no_host_gradient_for_units_stepped_on_the_device():
    # three resident units; the first two's state (12 + 2 + 4 bytes a parameter with accumulation)
    # fits device_optimizer_bytes: their gradients stay on the device, only the third sums on the host
    sizes = ModelSizes(shard_numels=[1000, 1000, 1000], shard_trainable=[True, True, True], itemsize=2,
                       block_bytes=2000, flops_per_token=0.0, largest_module_bytes=2000)
    z = SimpleNamespace(offload_param=SimpleNamespace(device="cpu", max_in_cpu=0),
                        offload_optimizer=SimpleNamespace(device="cpu", ratio=1.0),
                        stage3_param_persistence_threshold=0)
    e = SimpleNamespace(resident_bytes=6000, device_optimizer_bytes=2 * 18 * 1000, device_accumulator_bytes=0,
                        optimizer_step_device="cpu")
    cfg = SimpleNamespace(zero_optimization=z, pyinfinity=e, optimizer_state_format="fp32",
                          gradient_accumulation_steps=4)
    assert engine_pools(cfg, sizes, 3).grads == 1000 * 4
    e.device_optimizer_bytes = 0
    assert engine_pools(cfg, sizes, 3).grads == 3000 * 4


def test_device_accumulators_cost_the_landing_ring_in_ram_not_a_buffer_a_unit():
    """Under accumulation, the units whose accumulator is on the device need no host accumulator:
    their sums land in LANDING_SLOTS buffers of the largest of them. The engine's pools and the
    planner's layout charge the same figure."""
    from pyinfinity.layout.charges import TrainShape
    from pyinfinity.layout.pools import LANDING_SLOTS, plan_layout

    numels = [1000, 3000, 1000, 1000, 1000, 2000]
    sizes = ModelSizes(shard_numels=numels, shard_trainable=[True] * 6, itemsize=2, block_bytes=6000,
                       flops_per_token=0.0, largest_module_bytes=6000)
    z = SimpleNamespace(offload_param=SimpleNamespace(device="cpu", max_in_cpu=0),
                        offload_optimizer=SimpleNamespace(device="cpu", ratio=1.0),
                        stage3_param_persistence_threshold=0)
    e = SimpleNamespace(resident_bytes=0, device_optimizer_bytes=0, device_accumulator_bytes=4 * 7000,
                        optimizer_step_device="cpu")  # the first five units, not the sixth
    cfg = SimpleNamespace(zero_optimization=z, pyinfinity=e, optimizer_state_format="fp32",
                          gradient_accumulation_steps=4)
    ring = LANDING_SLOTS * 3000 * 4
    assert engine_pools(cfg, sizes, 6).grads == 2000 * 4 + ring
    knobs = Knobs(param_device="cpu", device_accumulator_bytes=4 * 7000)
    lay = plan_layout(sizes, TrainShape(micro_batch=1, seq_len=8, grad_accum=4), knobs, 1 << 30, device_is_host=True)
    assert lay.shards.device_accumulators == [0, 1, 2, 3, 4]
    assert lay.landing == ring and lay.grads.ram - lay.grad_staging == 2000 * 4 + ring
    assert lay.grads.device == 7000 * 4
    e.device_accumulator_bytes = 0
    assert engine_pools(cfg, sizes, 6).grads == sum(numels) * 4


def test_a_swap_file_is_its_directorys_share_in_whole_steps_of_its_own_size():
    """``layout.pools.swap_file``: what the engine's claim preallocates in each directory and a fixed
    placement's check compares with the free space: the payload and one aligned slot a tensor,
    split over the directories (a second one adds the striping's slack), grown in steps of the
    file's own size in whole MiB, never more than SWAP_GROW a step."""
    from pyinfinity.layout.pools import SWAP_GROW, SWAP_SLOT_ALIGN, SWAP_STRIPE_MIN, swap_file

    MiB = 1 << 20

    small = swap_file(5 * MiB + 1, 3, 1)
    assert small.per_dir == 5 * MiB + 1 + 3 * SWAP_SLOT_ALIGN and small.grow == 6 * MiB and small.nbytes == 6 * MiB
    two = swap_file(10 * MiB, 0, 2)
    assert two.per_dir == 5 * MiB + SWAP_STRIPE_MIN and two.nbytes == 9 * MiB
    big = swap_file(3 * SWAP_GROW + 1, 0, 1)
    assert big.grow == SWAP_GROW and big.nbytes == 4 * SWAP_GROW
    assert swap_file(0, 3, 1).nbytes == 0


def test_a_saves_staging_is_charged_in_host_ram_only_when_the_config_gives_it():
    """``pyinfinity.checkpoint_staging``: none for a run that does not save in the background
    ("auto": 0), else the budget, or the largest shard's saved state when that is larger (the
    writer lets one larger copy go alone); the planner's layout and the engine's pools charge the
    same bytes in host RAM."""
    from pyinfinity.layout.charges import TrainShape
    from pyinfinity.layout.pools import SWAP_SLOT_ALIGN, checkpoint_staging_bytes, plan_layout

    fp32 = STATE_FORMATS["fp32"]
    sizes = ModelSizes(shard_numels=[1000, 3000, 500], shard_trainable=[True, True, False], itemsize=4,
                       block_bytes=12000, flops_per_token=0.0, largest_module_bytes=12000)
    largest = 3000 * 12 + SWAP_SLOT_ALIGN  # the trainable 3000-element shard's state (master and moments)
    assert checkpoint_staging_bytes(0, sizes, fp32) == 0
    assert checkpoint_staging_bytes(1 << 20, sizes, fp32) == 1 << 20
    assert checkpoint_staging_bytes(4096, sizes, fp32) == largest
    z = SimpleNamespace(offload_param=SimpleNamespace(device="cpu", max_in_cpu=0),
                        offload_optimizer=SimpleNamespace(device="cpu", ratio=1.0),
                        stage3_param_persistence_threshold=0)
    cfg = SimpleNamespace(zero_optimization=z, optimizer_state_format="fp32", gradient_accumulation_steps=1,
                          checkpoint_staging_bytes=0)
    without = engine_pools(cfg, sizes, 3).host
    cfg.checkpoint_staging_bytes = 1 << 20
    assert engine_pools(cfg, sizes, 3).host - without == 1 << 20
    train = TrainShape(micro_batch=1, seq_len=8)
    lay0 = plan_layout(sizes, train, Knobs(), 1 << 30, device_is_host=True)
    lay = plan_layout(sizes, train, Knobs(checkpoint_staging=1 << 20), 1 << 30, device_is_host=True)
    assert lay0.checkpoint_staging == 0 and lay.checkpoint_staging == 1 << 20
    assert lay.host_bytes - lay0.host_bytes == 1 << 20 and lay.pinned_bytes == lay0.pinned_bytes
