"""ParameterCoordinator: fetch/release around every module, trace-driven prefetch (and that it is
real, under an injected I/O stall), trace divergence, tied weights, the device budget, modules
called twice, external parameters and activation checkpointing."""
from __future__ import annotations

import copy
import time

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

import pyinfinity
from pyinfinity.config import load_config
from pyinfinity.zero.budget import DeviceBudgetError
from pyinfinity.zero.partition import ShardState


def engine_grads(engine):
    """name -> accumulated fp32 gradient, read back from the engine's optimizer."""
    out = {}
    for sh in engine.partition.shards:
        g = engine.optimizer.gradient(sh)
        if g is None:  # no gradient in this backward (a branch not taken)
            continue
        for sl in sh.slices:
            out[sl.name] = g[sl.offset:sl.offset + sl.numel].view(sl.shape).clone()
    return out


def ref_grads(model):
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def assert_grads_match(engine, ref_model):
    got, want = engine_grads(engine), ref_grads(ref_model)
    assert set(want) <= set(got)
    for n in want:
        torch.testing.assert_close(got[n], want[n], rtol=1e-5, atol=1e-7, msg=n)


def resident(engine):
    return [s for s in engine.partition.shards if s.state != ShardState.RELEASED]


def test_forward_matches_and_everything_is_released(tiny_lm, lm_batches, engine_config):
    model = tiny_lm()
    ref = copy.deepcopy(model)
    (x, y), = lm_batches(1)
    with pyinfinity.initialize(model, engine_config("cpu")) as eng:
        out = eng(x, y)
        assert not resident(eng)  # all released after forward
        torch.testing.assert_close(out, ref(x, y), rtol=0, atol=0)
        eng.backward(out)
        assert not resident(eng)
        ref(x, y).backward()
        assert_grads_match(eng, ref)
        eng.eval()
        with torch.no_grad():
            torch.testing.assert_close(eng(x), ref(x), rtol=0, atol=0)
        assert not resident(eng)


@pytest.mark.parametrize("prefetch", [True, False])
def test_trace_prefetch_counts(tiny_lm, lm_batches, engine_config, prefetch):
    model = tiny_lm(layers=4)
    cfg = engine_config("cpu", pyinfinity={"device": "cpu", "device_memory": "64MiB", "prefetch": prefetch})
    with pyinfinity.initialize(model, cfg) as eng:
        for i, (x, y) in enumerate(lm_batches(3)):
            eng.backward(eng(x, y))
            eng.step()
            rec = eng.history[-1]
            if i == 0:  # first iteration records the trace: every use is on demand
                assert rec.prefetch_hits == 0 and rec.on_demand_fetches > 0
        st = eng.coordinator.stats
        if prefetch:
            # later iterations replay the trace: most uses are served by a prefetch
            assert rec.prefetch_hits > 2 * rec.on_demand_fetches, rec
            assert st.prefetch_issued >= st.prefetch_hits > 0
        else:
            assert st.prefetch_hits == 0 and st.prefetch_issued == 0 and rec.on_demand_fetches > 0
        assert st.divergences == 0


class Branchy(nn.Module):
    """Dynamic control flow: which blocks run depends on the input."""

    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([nn.Linear(16, 16) for _ in range(4)])

    def forward(self, x, skip):
        for i, b in enumerate(self.blocks):
            if i != skip:
                x = torch.tanh(b(x))
        return x.square().mean()


def test_trace_divergence_falls_back_and_stays_correct(engine_config):
    torch.manual_seed(0)
    model = Branchy()
    ref = copy.deepcopy(model)
    x = torch.randn(3, 16)
    with pyinfinity.initialize(model, engine_config("cpu")) as eng:
        for skip in (9, 9, 1, 1, 2):
            ref.zero_grad()
            loss = eng(x, skip)
            eng.backward(loss)
            ref(x, skip).backward()
            assert_grads_match(eng, ref)
            eng.zero_grad()
        st = eng.coordinator.stats
        # 9 -> 9 replays; 9 -> 1 and 1 -> 2 diverge (1 -> 1 replays the re-recorded trace)
        assert st.divergences == 2
        assert not resident(eng)


def test_tied_weights_stay_tied(tiny_lm, lm_batches, engine_config, tmp_path):
    model = tiny_lm(tie=True)
    with pyinfinity.initialize(model, engine_config("cpu")) as eng:
        for x, y in lm_batches(3):
            eng.backward(eng(x, y))
            eng.step()
        assert model.head.weight is model.embed.weight
        eng.export(str(tmp_path / "out"))
    from safetensors.torch import load_file

    sd = load_file(str(tmp_path / "out" / "model.safetensors"))
    torch.testing.assert_close(sd["head.weight"], sd["embed.weight"], rtol=0, atol=0)


def test_device_budget_holds_for_a_model_several_times_larger(tiny_lm, lm_batches, engine_config):
    model = tiny_lm(layers=12, d=32, vocab=32)
    model_bytes = sum(p.numel() * 4 for p in model.parameters())
    budget = model_bytes // 4
    cfg = engine_config("cpu", pyinfinity={"device": "cpu", "device_memory": budget},
                        zero_optimization={"stage": 3, "stage3_param_persistence_threshold": 0,
                                           "stage3_prefetch_bucket_size": budget // 4})
    with pyinfinity.initialize(model, cfg) as eng:
        for x, y in lm_batches(3, vocab=32):
            eng.backward(eng(x, y))
            eng.step()
        peak = max(r.peak_device_bytes for r in eng.history)
        assert 0 < peak <= budget < model_bytes / 3
        assert eng.memory_report().device_peak == peak


class Nested(nn.Module):
    """A module with its own parameter around a child with parameters: both resident at once."""

    def __init__(self):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(256))
        self.inner = nn.Linear(16, 16)

    def forward(self, x):
        return (self.inner(x).sum() * self.scale).sum()


def test_too_small_budget_is_a_clear_error(tiny_lm, engine_config):
    # smaller than the largest module: refused at start
    with pytest.raises(ValueError, match="device_memory"):
        pyinfinity.initialize(tiny_lm(layers=2, d=32), engine_config("cpu", pyinfinity={"device": "cpu",
                                                                                       "device_memory": 1024}))
    # each module fits, but a parent and its child together do not: the coordinator says so
    budget = 256 * 4 + 100
    with pyinfinity.initialize(Nested(), engine_config("cpu", pyinfinity={"device": "cpu",
                                                                          "device_memory": budget})) as eng:
        with pytest.raises(DeviceBudgetError, match="device_memory"):
            eng(torch.randn(2, 16))


class TwiceAndExternal(nn.Module):
    """A block applied twice per forward, and a head that reuses another module's weight."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(8, 8)
        self.shared = nn.Linear(8, 8)
        self.out = nn.Linear(8, 8)
        self.head = nn.Module()

    def forward(self, x):
        h = torch.relu(self.shared(torch.relu(self.shared(self.inp(x)))))
        return (self.out(h) @ self.inp.weight.t()).pow(2).mean()  # inp.weight outside inp's forward


def test_module_called_twice_and_external_parameter(engine_config):
    torch.manual_seed(0)
    model = TwiceAndExternal()
    ref = copy.deepcopy(model)
    x = torch.randn(4, 8)
    with pyinfinity.initialize(model, engine_config("cpu")) as eng:
        with pytest.raises(RuntimeError):  # unregistered use outside the owner's forward is not silent
            eng(x)
        eng.coordinator.register_external_parameter(model, model.inp.weight)
        loss = eng(x)
        eng.backward(loss)
        ref_loss = ref(x)
        ref_loss.backward()
        torch.testing.assert_close(loss, ref_loss, rtol=0, atol=0)
        assert_grads_match(eng, ref)


class Checkpointed(nn.Module):
    def __init__(self, reentrant):
        super().__init__()
        self.reentrant = reentrant
        self.blocks = nn.ModuleList([nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16))
                                     for _ in range(3)])

    def forward(self, x):
        for b in self.blocks:
            x = x + checkpoint(b, x, use_reentrant=self.reentrant)
        return x.pow(2).mean()


@pytest.mark.parametrize("reentrant", [False, True])
def test_activation_checkpointing(engine_config, reentrant):
    torch.manual_seed(0)
    model = Checkpointed(reentrant)
    ref = copy.deepcopy(model)
    x = torch.randn(4, 16, requires_grad=reentrant)  # reentrant checkpoint needs a grad-requiring input
    with pyinfinity.initialize(model, engine_config("cpu")) as eng:
        for _ in range(2):
            eng.zero_grad()
            ref.zero_grad()
            loss = eng(x)
            eng.backward(loss)
            ref(x).backward()
            assert_grads_match(eng, ref)
            assert not resident(eng)


class Scaled(nn.Module):
    """An RMSNorm's pattern: ``weight * x`` saves the Parameter object itself for backward."""

    def __init__(self, d):
        super().__init__()
        self.weight = nn.Parameter(1 + 0.1 * torch.randn(d))

    def forward(self, x):
        return self.weight * x


class CheckpointedUnits(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([nn.Sequential(Scaled(16), nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16))
                                     for _ in range(3)])

    def forward(self, x):
        for b in self.blocks:
            x = x + checkpoint(b, x, use_reentrant=False)
        return x.pow(2).mean()


BLOCK_BYTES = (16 + 16 * 32 + 32 + 32 * 16 + 16) * 4


@pytest.mark.parametrize("frozen", [False, True])
def test_a_recompute_keeps_its_unit_on_the_device_until_backward_leaves_it(engine_config, frozen):
    """Units of several modules (a decoder layer) under activation checkpointing: the recompute
    fetches each unit once and keeps it until backward moves on. Releasing it after each module of
    the recompute left a norm's saved weight pointing at the empty placeholder (torch's checkpoint
    refused the recomputed shapes) and fetched the unit once per module. ``frozen``: all but the
    last Linear of each block frozen, as under LoRA."""
    torch.manual_seed(0)
    model = CheckpointedUnits()
    if frozen:
        for b in model.blocks:
            for p in list(b[0].parameters()) + list(b[1].parameters()):
                p.requires_grad_(False)
    ref = copy.deepcopy(model)
    x = torch.randn(4, 16)
    cfg = engine_config("cpu", pyinfinity={"device": "cpu", "device_memory": "64MiB", "unit_bytes": BLOCK_BYTES})
    cfg["zero_optimization"]["stage3_prefetch_bucket_size"] = 0
    with pyinfinity.initialize(model, cfg) as eng:
        units = {sh.owner for sh in eng.partition.shards}
        assert units == set(model.blocks)  # one unit per block (a shard per block, or two with frozen weights)
        for _ in range(2):
            eng.zero_grad()
            ref.zero_grad()
            before = eng.coordinator.stats.fetched_bytes
            loss = eng(x)
            eng.backward(loss)
            ref(x).backward()
            assert_grads_match(eng, ref)
            # forward, then the recompute: each unit's bytes twice, not once per module
            assert eng.coordinator.stats.fetched_bytes - before == 2 * sum(sh.nbytes for sh in eng.partition.shards)
            assert not resident(eng)


class SlowBlock(nn.Module):
    """A layer whose compute takes a fixed time, so there is something to hide I/O behind."""

    def __init__(self, d, delay):
        super().__init__()
        self.lin = nn.Linear(d, d)
        self.delay = delay

    def forward(self, x):
        time.sleep(self.delay)
        return torch.tanh(self.lin(x))


def test_prefetch_is_real_under_an_io_stall(engine_config):
    from pyinfinity.swap import fault_injection

    stall_ms, delay_ms, layers = 25, 50, 6
    times = {}
    hits = {}
    for prefetch in (False, True):
        torch.manual_seed(0)
        model = nn.Sequential(*[SlowBlock(64, delay_ms / 1000) for _ in range(layers)])
        cfg = engine_config("nvme", pyinfinity={"device": "cpu", "device_memory": "64MiB", "prefetch": prefetch})
        # one layer ahead: the seam stalls every piece the I/O thread stages, one after another
        cfg["zero_optimization"]["stage3_prefetch_bucket_size"] = 64 * 65 * 4
        cfg["zero_optimization"]["offload_optimizer"] = {"device": "cpu"}
        x = torch.randn(4, 64)
        with pyinfinity.initialize(model, cfg) as eng:
            eng.eval()
            with torch.no_grad():
                eng(x)  # records the trace
                eng.coordinator.stats.prefetch_hits = 0
                with fault_injection(op="read", nth=1, action="stall", value=stall_ms, count=0):
                    t0 = time.perf_counter()
                    for _ in range(2):
                        eng(x)
                    times[prefetch] = time.perf_counter() - t0
            hits[prefetch] = (eng.coordinator.stats.prefetch_hits, eng.coordinator.stats.on_demand)
    # without prefetch every layer waits for its stalled read, then computes; with prefetch the
    # read of layer k+1 runs during the compute of layer k
    assert hits[False][0] == 0 and hits[True][0] >= 2 * (layers - 1)
    assert times[True] < 0.8 * times[False], (times, hits)


@pytest.mark.parametrize("buffer_count", [1, 3])
def test_buffer_count_and_max_live_bound_prefetch(tiny_lm, lm_batches, engine_config, buffer_count):
    model = tiny_lm(layers=6)
    cfg = engine_config("nvme")
    cfg["pyinfinity"]["overlap_step"] = False  # a unit the optimizer is still writing is not prefetched
    cfg["zero_optimization"]["offload_param"]["buffer_count"] = buffer_count
    biggest = max(p.numel() for p in model.parameters())
    cfg["zero_optimization"]["stage3_max_live_parameters"] = 4 * biggest
    with pyinfinity.initialize(model, cfg) as eng:
        inflight, live = [], []

        def probe(shard):  # called by the coordinator before each fetch starts
            inflight.append(sum(s.state == ShardState.INFLIGHT for s in eng.partition.shards))
            live.append(sum(s.numel for s in eng.partition.shards if s.state != ShardState.RELEASED))

        eng.coordinator._fault = probe
        for x, y in lm_batches(3):
            eng.backward(eng(x, y))
            eng.step()
        assert eng.coordinator.stats.prefetch_hits > 0
        assert max(inflight) <= buffer_count
        # prefetch never starts a fetch past the live-parameter cap (a demand fetch may)
        assert max(live) <= 4 * biggest


@pytest.mark.parametrize("placement", ["fixed", "auto"])
def test_an_absent_live_parameter_cap_is_sized_and_a_set_one_kept_with_a_warning(
        placement, tiny_lm, lm_batches, engine_config, caplog):
    """Left out, stage3_max_live_parameters is "auto": the plan's cap, or with the placement fixed
    the device budget in elements (DeepSpeed's default of 1e9 stopped every prefetch of a 30B model's
    decoder layers). A value the config sets is kept; one too small to fetch the largest unit ahead
    of the one in use is named in a warning."""
    cfg = engine_config("nvme")
    cfg["pyinfinity"]["overlap_step"] = False
    if placement == "auto":
        cfg["zero_optimization"]["stage3_prefetch_bucket_size"] = "auto"
        cfg["zero_optimization"]["offload_optimizer"]["device"] = "auto"
    assert load_config(cfg).zero_optimization.stage3_max_live_parameters == "auto"
    model = tiny_lm(layers=6)
    with pyinfinity.initialize(model, cfg) as eng:
        assert "zero_optimization.stage3_max_live_parameters" in {d.key for d in eng.auto_decisions}
        units = [sh for sh in eng.partition.shards if not sh.persistent]
        coord = eng.coordinator
        assert coord.max_live_elements >= 2 * max(sh.numel for sh in units)
        assert coord.prefetch_bytes >= max(sh.nbytes for sh in units)
        for x, y in lm_batches(3):
            eng.backward(eng(x, y))
            eng.step()
        assert coord.stats.prefetch_hits > 0
    assert "never fetched ahead" not in caplog.text

    biggest = max(p.numel() for p in tiny_lm(layers=6).parameters())
    cfg["zero_optimization"]["stage3_max_live_parameters"] = biggest  # one unit: nothing ahead of it
    with caplog.at_level("WARNING", logger="pyinfinity"), pyinfinity.initialize(tiny_lm(layers=6), cfg) as eng:
        assert eng.config.zero_optimization.stage3_max_live_parameters == biggest
        assert "zero_optimization.stage3_max_live_parameters" not in {d.key for d in eng.auto_decisions}
    assert f"stage3_max_live_parameters {biggest:,} is below two of the largest unit" in caplog.text
