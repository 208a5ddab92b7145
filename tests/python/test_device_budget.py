"""The device budget holds: the planner's charges (one place), the placement shrinking on the
measured peak, recovery from an out-of-memory error in forward or backward (DeviceBudgetExceeded,
the resident units and device optimizer state back in their host homes, the micro-batch run
again), the partly-stepped refusal when units were already stepped, and the refusal of a shape
that cannot fit. On the CPU device the "device" pool is the engine's own count; an out-of-memory
error is simulated by a seam (an allocation that raises torch.OutOfMemoryError)."""
from __future__ import annotations

import logging
from dataclasses import replace

import pytest
import torch

import pyinfinity
from pyinfinity.engine import SHRINK_AT, retry_micro_batch
from pyinfinity.layout.charges import (DEVICE_HEADROOM, PlanError, TrainShape, device_charges, largest_shape, loss_room,
                                     shape_refusal)
from pyinfinity.plan.placement import solve
from pyinfinity.plan.sizes import llama_sizes
from pyinfinity.zero.coordinator import ParameterCoordinator
from tests.python.conftest import engine_state, train_steps

LLAMA_7B = dict(hidden_size=4096, intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32,
                num_key_value_heads=32, vocab_size=32000)
LLAMA_1B = dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=22, num_attention_heads=32,
                num_key_value_heads=4, vocab_size=32000)
GIB = 1 << 30


def _cfg(engine_config, resident="64MiB", dob=0, overlap=False, clip=0.0, gas=1, tier="cpu", device_memory="64MiB"):
    cfg = engine_config(tier, gradient_accumulation_steps=gas, gradient_clipping=clip)
    cfg["pyinfinity"].update(resident_bytes=resident, unit_bytes=0, device_optimizer_bytes=dob, overlap_step=overlap,
                             device_memory=device_memory)
    return cfg


def _oom_at(monkeypatch, n: int, what: str = "_collect") -> list[int]:
    """The n-th call of ParameterCoordinator.<what> (1-based; _collect allocates a unit's flat
    gradient on the device) raises torch.OutOfMemoryError, once."""
    calls = [0]
    orig = getattr(ParameterCoordinator, what)

    def seam(self, *a, **kw):
        calls[0] += 1
        if calls[0] == n:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 250.00 MiB (simulated)")
        return orig(self, *a, **kw)
    monkeypatch.setattr(ParameterCoordinator, what, seam)
    return calls


def _forward_oom(eng, n: int = 1) -> None:
    """The n-th forward of blocks[1] raises torch.OutOfMemoryError, once."""
    calls = [0]

    def hook(module, args):
        calls[0] += 1
        if calls[0] == n:
            raise torch.OutOfMemoryError("CUDA out of memory (simulated, forward)")
    eng.module.blocks[1].register_forward_pre_hook(hook)


# ----------------------------------------------------------------------------- the planner's charges


def test_the_placement_charges_gradient_buffers_and_headroom_and_fits_its_budget():
    """7B at 8 GiB: every placement the solver returns keeps all its charges (the flat gradients
    being collected, the largest parameter's gradient, 10% headroom) inside the budget."""
    from tests.python.test_plan import GPU_RATES, _budgets

    sizes = llama_sizes(dict(LLAMA_7B, model_type="llama"), "bf16")
    for mb, seq in ((1, 1024), (1, 4096), (4, 1024)):
        train = TrainShape(micro_batch=mb, seq_len=seq, checkpointing=True)
        p = solve(sizes, train, _budgets(8 * GIB, 200 * 10**9), GPU_RATES)
        c = p.charges
        assert c is not None and p.device_bytes == c.total <= 8 * GIB, p.table()
        layer = max(sizes.shard_numels) * 2
        assert c.grad_buffers == 2 * layer + 32000 * 4096 * 2  # two flat unit gradients + the head's weight gradient
        assert c.headroom == int(8 * GIB * DEVICE_HEADROOM)
        # the loss's share of the estimate beyond a layer's recompute is charged once: at the loss
        # the working set and gradient buffers of a layer are not held
        assert c.activations == sizes.activation_bytes(mb, seq, True) - loss_room(
            sizes, train, c.working_set + c.grad_buffers, layer)
        # what is left for the placement is what the budget leaves after the charges
        assert c.resident + c.prefetch + c.device_state <= 8 * GIB - (c.total - c.resident - c.prefetch - c.device_state)


def test_the_loss_and_a_layers_recompute_are_charged_as_two_phases_not_one():
    """A 20B Llama at 4 x 1024 with checkpointing on 8 GiB: the step's peak is the checkpointed
    inputs plus the larger of a layer's phase (its working set, gradient buffers and recompute)
    and the loss's (the head, its gradient and the logits' tensors). Charged as both at once it
    came to 8.93 GB and the planner refused the shape; it fits. A measured activation figure and a
    run without checkpointing get no such credit."""
    from pyinfinity.presets import PRESETS as SIZES

    sizes = llama_sizes(dict(SIZES["20b"], model_type="llama"), "bf16")
    train = TrainShape(micro_batch=4, seq_len=1024, checkpointing=True)
    c = device_charges(sizes, train, 8 * GIB)
    inputs, per_layer, logits = sizes._activation_parts(4, 1024, None)
    layer = max(sizes.shard_numels) * 2
    layer_phase = c.working_set + c.grad_buffers + per_layer
    loss_phase = sizes.largest_shard_bytes + layer + logits
    assert logits > per_layer and loss_phase < layer_phase + (logits - per_layer)
    assert c.working_set + c.grad_buffers + c.activations == inputs + max(layer_phase, loss_phase)
    both = c.working_set + c.grad_buffers + sizes.activation_bytes(4, 1024, True) + c.headroom
    assert both > 8 * GIB >= c.total, (both, c.total)
    assert shape_refusal(sizes, train, 8 * GIB) is None
    measured = replace(train, activation_bytes=sizes.activation_bytes(4, 1024, True))
    assert device_charges(sizes, measured, 8 * GIB).activations == measured.activation_bytes
    plain = replace(train, checkpointing=False)
    assert device_charges(sizes, plain, 8 * GIB).activations == sizes.activation_bytes(4, 1024, False)


def test_the_activation_estimate_of_a_llama_layer_is_what_transformers_saves():
    """Saved-tensor hooks on a small transformers Llama in bf16 count what backward keeps: the
    planner's estimate is within 10% of it, with and without checkpointing."""
    transformers = pytest.importorskip("transformers")
    from pyinfinity.plan.sizes import sizes_from_module

    h, ff, layers, vocab, seq = 128, 344, 3, 300, 256
    for ckpt in (False, True):
        cfg = transformers.LlamaConfig(vocab_size=vocab, hidden_size=h, intermediate_size=ff, num_hidden_layers=layers,
                                       num_attention_heads=4, num_key_value_heads=4, use_cache=False)
        torch.manual_seed(0)
        model = transformers.LlamaForCausalLM(cfg).to(torch.bfloat16).train()
        if ckpt:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        params = {p.untyped_storage().data_ptr() for p in model.parameters()}
        saved: dict[int, int] = {}

        def pack(t):
            st = t.untyped_storage()
            if st.data_ptr() not in params:
                saved[st.data_ptr()] = st.nbytes()
            return t
        x = torch.randint(0, vocab, (1, seq))
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = model(input_ids=x, labels=x)
        held = sum(saved.values()) + out.logits.untyped_storage().nbytes()  # after forward
        sizes = sizes_from_module(model, torch.bfloat16)
        est = sizes.activation_bytes(1, seq, ckpt)
        grads = 8 * seq * vocab  # the loss's two fp32 gradients at its backward, on top of what forward left
        if not ckpt:
            assert 0.9 * (held + grads) <= est <= 1.1 * (held + grads), (est, held + grads)
        else:  # the layer inputs, and at most one layer's recompute or the loss's gradients on top
            one_layer = (sizes.activation_bytes(1, seq, False) - 14 * seq * vocab) // layers
            assert held <= est <= held + max(one_layer, grads), (est, held)


def test_a_shape_that_cannot_fit_with_nothing_resident_is_refused_naming_the_largest_that_fits():
    sizes = llama_sizes(dict(LLAMA_7B, model_type="llama"), "bf16")
    no_ckpt = TrainShape(micro_batch=1, seq_len=1024)
    why = shape_refusal(sizes, no_ckpt, 8 * GIB)
    assert why is not None and "1 x 1024" in why and "the largest that fits is 1 x " in why and "\n" not in why
    mb, seq = largest_shape(sizes, no_ckpt, 8 * GIB)
    assert mb == 1 and 0 < seq < 1024
    assert shape_refusal(sizes, TrainShape(micro_batch=1, seq_len=seq), 8 * GIB) is None
    assert shape_refusal(sizes, TrainShape(micro_batch=1, seq_len=seq + 1), 8 * GIB) is not None
    # with checkpointing the three shapes of the 7B fine-tune fit 8 GiB
    for mb, s in ((1, 1024), (1, 4096), (4, 1024)):
        assert shape_refusal(sizes, TrainShape(micro_batch=mb, seq_len=s, checkpointing=True), 8 * GIB) is None
    # 1.1B under 2 GiB: the loss over a 32000 vocabulary at 4096 tokens alone is 1.8 GB
    small = llama_sizes(dict(LLAMA_1B, model_type="llama"), "bf16")
    why = shape_refusal(small, TrainShape(micro_batch=4, seq_len=1024, checkpointing=True), 2 * GIB)
    assert why is not None and "the largest that fits is 4 x " in why
    got = largest_shape(small, TrainShape(micro_batch=4, seq_len=1024, checkpointing=True), 2 * GIB)
    assert got[0] == 4 and shape_refusal(small, TrainShape(4, got[1], checkpointing=True), 2 * GIB) is None


def test_the_engine_refuses_a_shape_at_the_first_forward_on_a_gpu(tiny_lm, lm_batches, engine_config, monkeypatch):
    """The check runs at the first training forward with the sizes the planner used; it is a GPU
    path (the CPU device's pool holds shards only), so the test gives the engine a 7B's sizes, an
    8 GiB budget and a CUDA device type for the check alone."""
    (x, y), = lm_batches(1)
    with pyinfinity.initialize(tiny_lm(), _cfg(engine_config, resident=0)) as eng:
        placement = eng.state.placement  # the device budget's guards
        placement.plan_sizes = llama_sizes(dict(LLAMA_7B, model_type="llama"), "bf16")
        placement.device_memory = 8 * GIB
        real = placement.device
        placement.device = type("Cuda", (), {"type": "cuda"})()
        with pytest.raises(PlanError, match=r"^micro-batch x sequence 2 x 8192 cannot fit .* the largest that fits is "
                                            r"2 x \d+;") as ei:
            placement.check_shape((torch.zeros(2, 8192, dtype=torch.long),), {})
        assert "\n" not in str(ei.value) and placement.shape_checked
        placement.check_shape((torch.zeros(1, 256, dtype=torch.long),), {})  # fits: no error
        placement.device = real
        placement.device_memory = 64 << 20
        placement.shape_checked = False
        train_steps(eng, [(x, y)])  # on the CPU device the first forward checks nothing more


# ----------------------------------------------------------------------------- out of memory: recovery


@pytest.mark.parametrize("dob", [0, "1MiB"])
@pytest.mark.parametrize("where", ["forward", "backward"])
def test_oom_before_any_unit_stepped_gives_the_placement_back_and_the_retry_trains(where, dob, tiny_lm, lm_batches,
                                                                                  engine_config, monkeypatch):
    """An out-of-memory error in forward or backward with nothing stepped: DeviceBudgetExceeded
    (a torch.OutOfMemoryError), every resident unit and all device optimizer state back in the
    host homes, and the same micro-batch run again trains to what a run that never had them on
    the device gives (exactly with resident parameters only; within the device step's tolerance
    with optimizer state)."""
    batches = lm_batches(4)
    with pyinfinity.initialize(tiny_lm(), _cfg(engine_config, resident=0)) as ref:
        want_losses = train_steps(ref, batches)
        want = engine_state(ref)
    with pyinfinity.initialize(tiny_lm(), _cfg(engine_config, dob=dob)) as eng:
        resident = [sh.index for sh in eng.partition.shards if sh.persistent]
        assert resident and eng.resident_bytes > 0
        assert (eng.device_state_bytes > 0) == bool(dob)
        losses = train_steps(eng, batches[:1])
        x, y = batches[1]
        if where == "forward":
            _forward_oom(eng)
        else:
            _oom_at(monkeypatch, 2)  # the second unit's gradient: the first one's is collected already
        with pytest.raises(pyinfinity.DeviceBudgetExceeded) as ei:
            eng.backward(eng(x, y))
        assert isinstance(ei.value, torch.OutOfMemoryError)
        assert "resident units" in ei.value.gave_up and f"{where} ran out of device memory" in str(ei.value)
        assert (dob != 0) == ("optimizer state" in ei.value.gave_up)
        assert not any(sh.persistent for sh in eng.partition.shards) and eng.resident_bytes == 0
        assert all(st.dev is None for st in eng.optimizer.states) and eng.device_state_bytes == 0
        assert eng.coordinator.budget.resident == eng.coordinator.budget.fixed  # nothing else held
        monkeypatch.undo()
        losses.append(retry_micro_batch(lambda: _micro(eng, x, y)))
        eng.step()
        losses += train_steps(eng, batches[2:])
        assert len(eng.history) == 4 and eng.history[1].tokens == x.numel()
        got = engine_state(eng)
    if dob == 0:  # moving resident parameters changes nothing
        assert losses == want_losses
        for k, v in want.items():
            assert torch.equal(got[k], v), k
    else:
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(want_losses), rtol=1e-5, atol=1e-6)
        for k, v in want.items():
            torch.testing.assert_close(got[k], v, rtol=1e-4, atol=1e-6, msg=k)


def _micro(eng, x, y) -> float:
    loss = eng(x, y)
    eng.backward(loss)
    return loss.item()


def test_retry_micro_batch_runs_it_once_more_and_only_once(tiny_lm, lm_batches, engine_config, monkeypatch):
    (x, y), = lm_batches(1)
    with pyinfinity.initialize(tiny_lm(), _cfg(engine_config)) as eng:
        calls = _oom_at(monkeypatch, 1)
        retry_micro_batch(lambda: _micro(eng, x, y))
        eng.step()
        assert calls[0] > 1 and len(eng.history) == 1
        n = [0]  # a second failure is the caller's

        def twice():
            n[0] += 1
            raise pyinfinity.DeviceBudgetExceeded("simulated", "nothing")
        with pytest.raises(pyinfinity.DeviceBudgetExceeded):
            retry_micro_batch(twice)
        assert n[0] == 2


def test_oom_after_units_were_stepped_is_the_partly_stepped_refusal(tiny_lm, lm_batches, engine_config, monkeypatch,
                                                                  tmp_path):
    """With the optimizer stepping units during backward (overlap, no clipping) an out-of-memory
    error after the first units were stepped is not retryable: the original error, then step()
    refuses until a checkpoint is loaded."""
    (x, y), = lm_batches(1)
    with pyinfinity.initialize(tiny_lm(), _cfg(engine_config, dob="1MiB", overlap=True)) as eng:
        eng.save_checkpoint(str(tmp_path / "ckpt"))
        _oom_at(monkeypatch, 3)  # two units' gradients are final (and stepped on the "device") by then
        with pytest.raises(torch.OutOfMemoryError) as ei:
            eng.backward(eng(x, y))
        assert not isinstance(ei.value, pyinfinity.DeviceBudgetExceeded)
        with pytest.raises(RuntimeError, match="partly stepped"):
            eng.step()
        monkeypatch.undo()
        eng.load_checkpoint(str(tmp_path / "ckpt"))
        train_steps(eng, [(x, y)])


def test_oom_in_backward_after_gradients_were_accumulated_is_refused(tiny_lm, lm_batches, engine_config, monkeypatch):
    """Under gradient accumulation a unit's gradient is added into its accumulator as it is made:
    a retry would add it twice, so the error is not retryable."""
    batches = lm_batches(2)
    with pyinfinity.initialize(tiny_lm(), _cfg(engine_config, gas=2)) as eng:
        x, y = batches[0]
        eng.backward(eng(x, y))
        eng.step()
        _oom_at(monkeypatch, 3)
        x, y = batches[1]
        with pytest.raises(torch.OutOfMemoryError) as ei:
            eng.backward(eng(x, y))
        assert not isinstance(ei.value, pyinfinity.DeviceBudgetExceeded)
        with pytest.raises(RuntimeError, match="partly stepped"):
            eng.step()


# ----------------------------------------------------------------------------- the measured peak


def test_a_step_whose_peak_passes_the_budget_gives_up_resident_units_once(tiny_lm, lm_batches, engine_config,
                                                                          caplog):
    """The CPU device: the engine's own count. Every unit resident in a budget they fill to 98%:
    the first step's peak passes SHRINK_AT, the engine gives up resident units (warning once)
    until a step's peak is under it, and trains on to the same results."""
    batches = lm_batches(6)
    with pyinfinity.initialize(tiny_lm(), _cfg(engine_config, resident=0)) as ref:
        want = train_steps(ref, batches)
        total = sum(sh.nbytes for sh in ref.partition.shards)
    cap = int(total / 0.98)
    with caplog.at_level(logging.INFO, logger="pyinfinity.engine"):
        with pyinfinity.initialize(tiny_lm(), _cfg(engine_config, device_memory=cap)) as eng:
            assert eng.resident_bytes == total
            peaks = []
            got = []
            for b in batches:
                got += train_steps(eng, [b])
                peaks.append(eng.coordinator.budget.peak)
                eng.coordinator.budget.peak = eng.coordinator.budget.resident
            assert eng.resident_bytes < total and eng.coordinator.budget.fixed <= (1 - DEVICE_HEADROOM) * cap
            assert max(peaks) <= cap and peaks[-1] <= SHRINK_AT * cap, (peaks, cap)
    warned = [r.getMessage() for r in caplog.records if "device budget" in r.getMessage()
              and r.levelno == logging.WARNING]
    assert len(warned) == 1 and "resident units" in warned[0], warned
    assert got == want


def test_a_peak_under_the_budget_changes_nothing(tiny_lm, lm_batches, engine_config):
    with pyinfinity.initialize(tiny_lm(), _cfg(engine_config)) as eng:
        before = eng.resident_bytes
        train_steps(eng, lm_batches(2))
        assert eng.resident_bytes == before and not eng.state.placement.gave_up


def test_a_planned_prefetch_grows_into_the_room_a_measured_peak_left_and_a_set_one_never(tiny_lm, lm_batches,
                                                                                          engine_config, caplog):
    """The planner charges a working set and prefetch the step does not hold at once: the measured
    peak leaves room under the budget's target, and a prefetch the planner sized grows into it
    (not after the first step, whose fetches are on demand), stays under SHRINK_AT and changes no
    result. A prefetch the config sets is never changed."""
    batches = lm_batches(5)
    cap = 20 << 10

    def run(prefetch):
        cfg = _cfg(engine_config, resident=0, device_memory=cap)
        cfg["zero_optimization"]["stage3_prefetch_bucket_size"] = prefetch
        with pyinfinity.initialize(tiny_lm(), cfg) as eng:
            planned = eng.coordinator.prefetch_bytes
            peaks, sizes = [], []
            losses = []
            for b in batches:
                losses += train_steps(eng, [b])
                peaks.append(eng.coordinator.budget.peak)
                sizes.append(eng.coordinator.prefetch_bytes)
            assert not eng.state.placement.gave_up
            return planned, sizes, peaks, losses, eng.state.placement.prefetch_grown

    with caplog.at_level(logging.INFO, logger="pyinfinity.zero.device_placement"):
        planned, sizes, peaks, got, grown = run("auto")
    assert sizes[0] == planned  # the first step fetched on demand: its peak says nothing of prefetch
    assert grown > 0 and sizes[-1] == planned + grown > planned, sizes
    assert max(peaks) <= SHRINK_AT * cap, (peaks, cap)
    assert any("prefetch" in r.getMessage() and "device budget" in r.getMessage() for r in caplog.records)
    set_planned, set_sizes, _, want, set_grown = run(planned)
    assert set_grown == 0 and set(set_sizes) == {planned} == {set_planned}
    assert got == want


def test_a_planned_prefetch_below_every_unit_still_grows(tiny_lm, lm_batches, engine_config):
    """A planned bucket smaller than any unit the coordinator fetches (the 30B LoRA plan's 473 MB
    against 1.07 GB decoder layers) fetches nothing ahead, so the step's prefetch high-water mark
    stays 0; the unit the trace named next and that no room in the bucket could take is the cue
    to grow all the same, to at least that unit, with the same losses."""
    batches = lm_batches(5)
    cfg = _cfg(engine_config, resident=0, device_memory=20 << 10)
    cfg["zero_optimization"]["stage3_prefetch_bucket_size"] = "auto"
    with pyinfinity.initialize(tiny_lm(), _cfg(engine_config, resident=0, device_memory=20 << 10)) as ref:
        want = train_steps(ref, batches)
    with pyinfinity.initialize(tiny_lm(), cfg) as eng:
        coord = eng.coordinator
        fetched = [sh.nbytes for sh in eng.partition.shards if not sh.persistent]
        assert len(fetched) >= 2
        coord.prefetch_bytes = min(fetched) - 1  # as a plan that left less than one unit
        sizes, got = [], []
        for b in batches:
            got += train_steps(eng, [b])
            sizes.append(coord.prefetch_bytes)
        assert not eng.state.placement.gave_up
    assert sizes[0] == min(fetched) - 1 and sizes[-1] >= max(fetched), (sizes, fetched)
    assert got == want


# ----------------------------------------------------------------------------- on a GPU


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gpu_oom_recovery_with_a_real_allocation(tiny_lm, lm_batches, engine_config, monkeypatch):
    """On CUDA the same recovery from an OutOfMemoryError raised where the issue saw it (the flat
    gradient's allocation in _collect); max_memory_allocated stays within the cap."""
    cfg = _cfg(engine_config, dob="1MiB", device_memory="1GiB")
    cfg["pyinfinity"]["device"] = "cuda:0"
    batches = [(x.cuda(), y.cuda()) for x, y in lm_batches(3)]
    with pyinfinity.initialize(tiny_lm(), cfg) as eng:
        train_steps(eng, batches[:1])
        _oom_at(monkeypatch, 2)
        with pytest.raises(pyinfinity.DeviceBudgetExceeded):
            eng.backward(eng(*batches[1]))
        monkeypatch.undo()
        retry_micro_batch(lambda: _micro(eng, *batches[1]))
        eng.step()
        train_steps(eng, batches[2:])
        assert all(r.peak_device_allocated <= (1 << 30) for r in eng.history)


def test_the_plan_line_names_its_terms_and_the_measured_parts():
    from tests.python.test_plan import GPU_RATES, _budgets

    sizes = llama_sizes(dict(LLAMA_1B, model_type="llama"), "bf16")
    p = solve(sizes, TrainShape(micro_batch=4, seq_len=1024, checkpointing=True), _budgets(8 * GIB, 200 * 10**9),
              GPU_RATES)
    line = p.compare([1.0, 1.0, 0.5], parts={"optimizer busy": 0.25})
    assert line.startswith(f"plan: predicted {p.predicted.total:.3f} s/step") and "measured 0.500 s/step" in line
    assert f"compute {p.predicted.compute:.3f}" in line and "measured optimizer busy 0.250" in line
    assert line.endswith(f"predicted/measured {p.predicted.total / 0.5:.2f}")
    # the compute term counts the non-matmul kernels too
    from pyinfinity.plan.evaluation import ELEMENTWISE_SHARE

    flops = sizes.flops_per_step(4, 1024, True)
    assert p.predicted.compute == pytest.approx(flops / GPU_RATES.matmul * (1 + ELEMENTWISE_SHARE))


def test_the_engine_plans_at_the_longest_sequence_that_fits_when_1024_does_not():
    """Before the first batch the engine plans at 1024 tokens a sequence; when that cannot fit even
    with nothing resident it plans at the longest that does (the first forward refuses a longer
    one), and a refusal at initialize names the largest shape."""
    from pyinfinity.config import load_config
    from pyinfinity.plan import Budgets, plan_engine_config
    from tests.python.test_plan import GPU_RATES

    sizes = llama_sizes(dict(LLAMA_7B, model_type="llama"), "bf16")
    cfg = load_config({"train_micro_batch_size_per_gpu": 1, "bf16": {"enabled": True},
                       "zero_optimization": {"stage": 3, "offload_param": {"device": "auto"},
                                             "offload_optimizer": {"device": "auto"}},
                       "pyinfinity": {"device": "cuda:0", "device_memory": "8GiB", "host_memory": "200GB"}})
    budgets = Budgets(device_memory=8 * GIB, host_memory=200 * 10**9)
    _, _, plan = plan_engine_config(cfg, sizes, "cuda:0", rates=GPU_RATES, budgets=budgets)
    seq = plan.inputs[3].seq_len
    most = largest_shape(sizes, TrainShape(1, 1024), 8 * GIB)
    assert most[0] == 1 and 0.8 * most[1] <= seq <= most[1] < 1024  # less the config's 50 MB prefetch bucket
    assert any(f"{seq} tokens per sequence, the longest that fits" in n for n in plan.notes)
    assert plan.device_bytes <= 8 * GIB
    with pytest.raises(PlanError, match=r"the largest micro-batch x sequence that fits with nothing resident is 1 x "):
        solve(sizes, TrainShape(1, 1024), budgets, GPU_RATES)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("mb, seq", [(1, 512), (1, 2048), (4, 1024), (1, 4096)])
def test_gpu_a_llama_under_a_tight_cap_trains_within_it_or_is_refused_in_one_line(mb, seq, tmp_path):
    """A transformers Llama whose weights and activations exceed a 768 MiB cap, "auto" placement,
    checkpointing: each shape either trains three steps with max_memory_allocated within the cap
    and no out-of-memory error, or is refused at the first forward naming the largest that fits."""
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(vocab_size=32000, hidden_size=1024, intermediate_size=2816, num_hidden_layers=8,
                                   num_attention_heads=16, num_key_value_heads=16, max_position_embeddings=4096,
                                   use_cache=False)
    cap = 768 << 20
    ds = {"train_micro_batch_size_per_gpu": mb, "bf16": {"enabled": True}, "gradient_clipping": 1.0,
          "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
          "zero_optimization": {"stage": 3, "offload_param": {"device": "auto"},
                                "offload_optimizer": {"device": "auto"}},
          "pyinfinity": {"device": "cuda:0", "device_memory": cap}}
    with pyinfinity.init_empty(ds):
        model = transformers.LlamaForCausalLM(cfg)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    g = torch.Generator().manual_seed(0)
    eng = pyinfinity.initialize(model, ds)  # plans at the longest sequence that fits if 1024 does not
    with eng:
        eng.train()
        try:
            for _ in range(3):
                x = torch.randint(0, 32000, (mb, seq), generator=g).cuda()
                retry_micro_batch(lambda: eng.backward(eng(input_ids=x, labels=x).loss))
                eng.step()
        except PlanError as exc:
            assert str(exc).startswith(f"micro-batch x sequence {mb} x {seq}") and "the largest that fits is" in str(exc)
            assert mb * seq > 512  # 1 x 512 fits this cap
            return
        assert all(r.peak_device_allocated <= cap for r in eng.history), [r.peak_device_allocated for r in eng.history]
        assert len(eng.history) == 3


def test_running_out_of_device_memory_while_placing_the_model_is_one_clear_error(tiny_lm, engine_config, monkeypatch):
    """Before any step (persistent shards, resident units, buffers placed at initialize): not torch's
    raw out-of-memory error but a PlanError (a ValueError: one line from the command line) naming the
    budget and what it must hold."""
    import pyinfinity.engine as engine_mod
    from pyinfinity.plan import PlanError

    def oom(*a, **k):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 MiB. GPU 0 has ...\nmore")

    monkeypatch.setattr(engine_mod, "TrainingState", oom)
    with pytest.raises(PlanError) as info:
        pyinfinity.initialize(tiny_lm(layers=2), _cfg(engine_config, device_memory="48MiB"))
    msg = str(info.value)
    assert "pyinfinity.device_memory 48.00 MiB" in msg and "CUDA out of memory. Tried to allocate 2.00 MiB" in msg
    assert "--gpu-memory" in msg and "\n" not in msg
    assert isinstance(info.value.__cause__, torch.OutOfMemoryError)
