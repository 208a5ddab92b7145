"""pyinfinity.device_optimizer_bytes: resident units whose fp32 master and Adam moments live on the
compute device too, stepped there as their gradients are final (no gradient leaves the device).
On the CPU compute device the same code runs with the "device" in RAM, so CI checks the
bookkeeping: which units are chosen, agreement with the CPU kernel, the background paths
bit-identical to the serial one (clipping, accumulation), checkpoints and export reading the
device state, a dropped backward; and the planner's decision for a GPU."""
from __future__ import annotations

import pytest
import torch

import pyinfinity
from pyinfinity.config import ConfigError, load_config
from pyinfinity.layout.charges import device_state_cost
from tests.python.conftest import engine_state, train_steps


def _cfg(engine_config, dob, overlap=False, clip=0.0, gas=1, tier="cpu"):
    cfg = engine_config(tier, gradient_accumulation_steps=gas, gradient_clipping=clip)
    cfg["pyinfinity"].update(resident_bytes="64MiB", unit_bytes=0, device_optimizer_bytes=dob, overlap_step=overlap)
    return cfg


@pytest.mark.parametrize("tier", ["cpu", "nvme"])
def test_whole_units_from_the_front_within_the_budget(tier, tiny_lm, engine_config):
    model = tiny_lm()
    model.blocks[0].up.requires_grad_(False)  # a frozen unit: no optimizer state to place
    probe = pyinfinity.initialize(tiny_lm(), _cfg(engine_config, 0, tier=tier))
    sizes = [sh.numel for sh in probe.partition.shards]
    probe.close()
    per = device_state_cost(4, 1)
    budget = per * (sizes[0] + sizes[1]) + per - 1  # the first two units and not the third
    with pyinfinity.initialize(model, _cfg(engine_config, budget, tier=tier)) as eng:
        on = [sh.index for sh in eng.partition.shards if sh.device_step]
        trainable = [sh for sh in eng.partition.shards if sh.trainable]
        frozen = [sh.index for sh in eng.partition.shards if not sh.trainable]
        assert on and frozen and not set(on) & set(frozen)
        assert on[0] == 0  # the embedding, first in the model
        # greedy in shard order: a unit that does not fit is skipped, a later smaller one may fit
        left = budget
        want = []
        for sh in eng.partition.shards:
            if sh.persistent and sh.trainable and per * sh.numel <= left:
                left -= per * sh.numel
                want.append(sh.index)
        assert on == want
        assert eng.device_state_bytes == sum(12 * eng.partition.shards[i].numel for i in on)
        assert eng.memory_report().optimizer["device"] == eng.device_state_bytes
        assert len(on) < len(trainable)
        # a step reads and writes the disk homes of the units stepped on the CPU only
        stepped_from_disk = sum(12 * sh.numel for sh in trainable if not sh.device_step) if tier == "nvme" else 0
        assert eng.optimizer.disk_bytes_per_step == stepped_from_disk
        assert eng.optimizer.bytes_by_tier.get("nvme", 0) == (sum(12 * sh.numel for sh in trainable) if tier == "nvme" else 0)
    assert all(st.dev is None for st in eng.optimizer.states)  # close() frees the device copies


@pytest.mark.parametrize("clip", [0.0, 0.5])
def test_the_device_step_agrees_with_the_cpu_kernel(clip, tiny_lm, lm_batches, engine_config):
    batches = lm_batches(6)
    got = {}
    for dob in (0, "1MiB"):
        with pyinfinity.initialize(tiny_lm(), _cfg(engine_config, dob, clip=clip)) as eng:
            n_dev = sum(sh.device_step for sh in eng.partition.shards)
            losses = train_steps(eng, batches)
            got[dob] = (n_dev, losses, engine_state(eng), [r.grad_norm for r in eng.history])
    assert got[0][0] == 0 and got["1MiB"][0] == sum(k.startswith("optim.") for k in got[0][2])  # every unit
    torch.testing.assert_close(torch.tensor(got["1MiB"][1]), torch.tensor(got[0][1]), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(torch.tensor(got["1MiB"][3]), torch.tensor(got[0][3]), rtol=1e-5, atol=1e-6)
    for k, v in got[0][2].items():
        torch.testing.assert_close(got["1MiB"][2][k], v, rtol=1e-4, atol=1e-6, msg=k)


@pytest.mark.parametrize("clip, gas", [(0.0, 1), (0.05, 1), (0.0, 2), (0.05, 2)])
def test_background_paths_are_bit_identical_to_the_serial_step(clip, gas, tiny_lm, lm_batches, engine_config):
    """Half the units step on the "device" (during backward, or after the global norm), the rest on
    the CPU worker: bit-identical to the serial step, clipping firing on every step."""
    batches = lm_batches(4 * gas)
    probe = pyinfinity.initialize(tiny_lm(), _cfg(engine_config, 0))
    half = device_state_cost(4, gas) * sum(sh.numel for sh in probe.partition.shards) // 2
    probe.close()
    got = {}
    for overlap in (False, True):
        with pyinfinity.initialize(tiny_lm(), _cfg(engine_config, half, overlap=overlap, clip=clip, gas=gas)) as eng:
            on = [sh.device_step for sh in eng.partition.shards]
            assert any(on) and not all(on)
            losses = train_steps(eng, batches)
            got[overlap] = (losses, list(eng.history), engine_state(eng))
    (l0, h0, s0), (l1, h1, s1) = got[False], got[True]
    assert l0 == l1
    assert [r.grad_norm for r in h0] == [r.grad_norm for r in h1]
    if clip:
        assert all(r.grad_norm > clip for r in h0)  # clipping fired on every step
    else:
        assert all(r.overlapped_shards > 0 for r in h1)  # device units stepped during backward
    assert all("device" in (r.optimizer_phases or {}) for r in h1)
    for k in s0:
        assert torch.equal(s0[k], s1[k]), k


@pytest.mark.parametrize("tier", ["cpu", "nvme"])
def test_checkpoint_resume_and_export_read_the_device_state(tier, tiny_lm, lm_batches, engine_config, tmp_path):
    """The homes (in RAM, or on NVMe: read into the device copy at start, written back by
    sync_homes) are brought up to date before a checkpoint and an export."""
    from safetensors.torch import load_file

    batches = lm_batches(6)
    cfg = _cfg(engine_config, "1MiB", overlap=True, tier=tier)
    with pyinfinity.initialize(tiny_lm(), cfg) as eng:
        train_steps(eng, batches[:3])
        eng.save_checkpoint(str(tmp_path / "ckpt"))
        after = train_steps(eng, batches[3:])
        files = eng.export(str(tmp_path / "out"))
        exported = load_file(files[0])
        masters = {sh.index: eng.optimizer.state_of(sh).dev[:sh.numel].clone() for sh in eng.partition.shards}
        names = {id(p): n for n, p in eng.module.named_parameters()}
        for sh in eng.partition.shards:
            for sl in sh.slices:
                key = names[id(sl.param)]
                if key in exported:
                    assert torch.equal(exported[key].flatten(), masters[sh.index][sl.offset:sl.offset + sl.numel]), key
    with pyinfinity.initialize(tiny_lm(seed=5), cfg) as eng:  # other initial weights: all comes from the checkpoint
        eng.load_checkpoint(str(tmp_path / "ckpt"))
        assert train_steps(eng, batches[3:]) == after


def test_zero_grad_drops_a_backwards_gradients(tiny_lm, lm_batches, engine_config):
    batches = lm_batches(2)
    cfg = _cfg(engine_config, "1MiB")
    with pyinfinity.initialize(tiny_lm(), cfg) as eng:
        before = engine_state(eng)
        eng.backward(eng(*batches[1]))
        eng.zero_grad()  # that backward's gradients are dropped
        assert all(torch.equal(v, before[k]) for k, v in engine_state(eng).items())
        dropped = train_steps(eng, batches[:1])
        state = engine_state(eng)
    with pyinfinity.initialize(tiny_lm(), cfg) as eng:
        assert train_steps(eng, batches[:1]) == dropped
        assert all(torch.equal(v, state[k]) for k, v in engine_state(eng).items())


def test_a_failing_backward_after_device_steps_is_refused_until_a_checkpoint_is_loaded(tiny_lm, lm_batches,
                                                                                       engine_config, tmp_path):
    (x, y), = lm_batches(1)
    with pyinfinity.initialize(tiny_lm(), _cfg(engine_config, "1MiB", overlap=True)) as eng:
        eng.save_checkpoint(str(tmp_path / "ckpt"))
        want = eng(x, y).item()

        def fail(module, grad_in, grad_out):
            raise KeyError("backward failed in blocks.0")

        h = eng.module.blocks[0].register_full_backward_hook(fail)  # the later units are stepped by then
        with pytest.raises(KeyError, match="backward failed"):
            eng.backward(eng(x, y))
        h.remove()
        with pytest.raises(RuntimeError, match="partly stepped"):
            eng.step()
        eng.load_checkpoint(str(tmp_path / "ckpt"))  # the device copies are the checkpoint's again
        assert eng(x, y).item() == want
        train_steps(eng, [(x, y)])


def test_config_and_plan(engine_config):
    from pyinfinity.presets import PRESETS as SIZES
    from pyinfinity.plan import Budgets, Rates, SwapDir, TrainShape, solve
    from pyinfinity.plan.placement import Fixed
    from pyinfinity.plan.sizes import llama_sizes

    with pytest.raises(ConfigError, match="device_optimizer_bytes.*already steps every unit"):
        load_config(dict(engine_config(), pyinfinity={"optimizer_step_device": "device",
                                                      "device_optimizer_bytes": "1GiB"}))
    with pytest.raises(ConfigError, match="optimizer_threads"):
        load_config(dict(engine_config(), pyinfinity={"optimizer_threads": 0}))
    assert load_config(dict(engine_config(), pyinfinity={"optimizer_threads": 6})).pyinfinity.optimizer_threads == 6
    rates = Rates(h2d=55e9, d2h=55e9, disk_read=1.9e9, disk_write=3.6e9, adam=3.9e9, matmul=6.4e14, memcpy=38e9,
                  device="cuda:0")
    sizes = llama_sizes(dict(SIZES["1.1b"], model_type="llama"), dtype="bf16")
    budgets = Budgets(device_memory=8 << 30, host_memory=100 << 30, swap=[SwapDir("/nonexistent", 64 << 30)])
    train = TrainShape(micro_batch=4, seq_len=1024, checkpointing=True, overlap_step="auto")
    p = solve(sizes, train, budgets, rates)
    # the 1.1B weights all stay on the 8 GiB GPU, and the room left holds some units' optimizer state
    assert p.knobs.resident_bytes >= sizes.param_bytes - sizes.small_shard_bytes(p.knobs.persistence_threshold)
    assert p.device_state_bytes > 2e9 and p.device_bytes <= 8 << 30  # the charges include 10% headroom
    assert p.device_bytes - p.charges.headroom <= (8 << 30) * 0.9
    assert p.config_values()["pyinfinity.device_optimizer_bytes"] >= p.device_state_bytes
    assert any("lives on the device too" in n for n in p.notes)
    assert p.optimizer.ram == 12 * sizes.trainable_numel  # the host homes stay (checkpoints, export)
    # nothing resident (pyinfinity-cpu in bench train): nothing to step there
    q = solve(sizes, train, budgets, rates, Fixed(resident_bytes=0))
    assert q.device_state_bytes == 0 and q.knobs.device_optimizer_bytes == 0
    assert p.predicted.total < q.predicted.total
    # the CPU device: the state is in RAM already
    cpu = solve(sizes, train, Budgets(device_memory=8 << 30, host_memory=100 << 30, swap=[], device_is_host=True),
                Rates(h2d=20e9, d2h=20e9, disk_read=1e9, disk_write=1e9, adam=1e9, matmul=1e12, memcpy=20e9))
    assert cpu.device_state_bytes == 0


def test_param_groups_of_other_lrs_step_on_the_device_as_on_the_cpu_kernel(tiny_lm, lm_batches, engine_config):
    # every other parameter in a group of its own lr, betas and eps: units mix both groups, and the
    # device step (a call per range over slices) agrees with the CPU kernel (a call per range over pointers)
    batches = lm_batches(4)
    got = {}
    for dob in (0, "1MiB"):
        model = tiny_lm()
        params = [p for p in model.parameters() if p.requires_grad]
        with pyinfinity.initialize(model, _cfg(engine_config, dob, clip=0.5)) as eng:
            split = eng.optimizer.set_param_groups([{"params": params[0::2]}, {"params": params[1::2], "lr": 5e-3,
                                                                               "betas": (0.8, 0.99), "eps": 1e-6}])
            assert split > 0
            n_dev = sum(sh.device_step for sh in eng.partition.shards)
            got[dob] = (n_dev, train_steps(eng, batches), engine_state(eng))
    assert got[0][0] == 0 and got["1MiB"][0] > 0
    torch.testing.assert_close(torch.tensor(got["1MiB"][1]), torch.tensor(got[0][1]), rtol=1e-5, atol=1e-6)
    for k, v in got[0][2].items():
        torch.testing.assert_close(got["1MiB"][2][k], v, rtol=1e-4, atol=1e-6, msg=k)
