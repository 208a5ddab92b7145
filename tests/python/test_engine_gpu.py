"""The Engine on a CUDA device (skipped without one): parity with torch AdamW on the GPU, the
device budget, telemetry from CUDA events, bf16 transformers training under a memory cap."""
from __future__ import annotations

import copy
import math

import pytest
import torch

import pyinfinity
from tests.python.conftest import train_steps

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
pytestmark = pytest.mark.gpu


def _cfg(tier, tmp_path, **over):
    swap = str(tmp_path / "swap")
    cfg = {
        "gradient_accumulation_steps": 2, "gradient_clipping": 0.5,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01}},
        "zero_optimization": {"stage": 3, "offload_param": {"device": tier, "nvme_path": swap},
                              "offload_optimizer": {"device": tier, "nvme_path": swap},
                              "stage3_param_persistence_threshold": 0, "stage3_prefetch_bucket_size": 1 << 20},
        "pyinfinity": {"device": "cuda", "device_memory": "1GiB"},
    }
    cfg.update(over)
    return cfg


@cuda
@pytest.mark.parametrize("tier, step_device", [("cpu", "cpu"), ("nvme", "cpu"), ("nvme", "device")])
def test_gpu_parity_with_torch_adamw(tier, step_device, tiny_lm, lm_batches, tmp_path):
    torch.backends.cuda.matmul.allow_tf32 = False
    model = tiny_lm(layers=3)
    ref = copy.deepcopy(model).cuda()
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.01)
    losses, ref_losses = [], []
    cfg = _cfg(tier, tmp_path)
    cfg["pyinfinity"]["optimizer_step_device"] = step_device
    with pyinfinity.initialize(model, cfg) as eng:
        assert eng.device.type == "cuda"
        for i, (x, y) in enumerate(lm_batches(12)):
            x, y = x.cuda(), y.cuda()
            loss = eng(x, y)
            eng.backward(loss)
            eng.step()
            losses.append(loss.item())
            rl = ref(x, y)
            (rl / 2).backward()
            ref_losses.append(rl.item())
            if i % 2 == 1:
                torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.5)
                ref_opt.step()
                ref_opt.zero_grad()
        rec = eng.history[-1]
        assert rec.peak_device_allocated is not None and rec.peak_device_allocated > 0
        assert rec.overlap_fraction is not None and 0.0 <= rec.overlap_fraction <= 1.0
        assert rec.bytes_moved.get("device.h2d", 0) > 0
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-4, atol=1e-6)


@cuda
@pytest.mark.parametrize("held", [0, 768 << 20])
def test_gpu_budget_holds_and_llama_bf16_trains(held, tmp_path):
    """``held``: bytes the process keeps on the GPU before the engine is made (a reference model,
    say), more than the engine's budget: the budget is the engine's own, on top of them."""
    from transformers import LlamaConfig, LlamaForCausalLM

    import gc

    gc.collect()
    torch.cuda.empty_cache()  # the memory fraction caps the whole process: start from a clean one
    torch.manual_seed(0)
    # large enough that the budget (half its bf16 weights) leaves room for cuBLAS workspaces
    mc = LlamaConfig(vocab_size=260, hidden_size=1024, intermediate_size=2752, num_hidden_layers=8,
                     num_attention_heads=8, num_key_value_heads=8, max_position_embeddings=512, use_cache=False)
    with pyinfinity.init_empty():
        model = LlamaForCausalLM(mc)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    weights = sum(p.numel() for p in model.parameters()) * 2
    budget = weights * 9 // 10  # the memory fraction caps activations and cuBLAS workspaces too
    cfg = _cfg("nvme", tmp_path, bf16={"enabled": True}, gradient_accumulation_steps=1,
               pyinfinity={"device": "cuda", "device_memory": budget})
    cfg["zero_optimization"]["stage3_prefetch_bucket_size"] = budget // 4
    cfg["optimizer"]["params"]["lr"] = 1e-3
    x = torch.randint(0, 256, (2, 128), device="cuda")
    other = torch.full((held // 4,), 7.0, device="cuda")
    with pyinfinity.initialize(model, cfg) as eng:
        assert held == 0 or held > budget  # what the process held is more than the engine may use
        eng.train()
        for _ in range(6):
            out = eng(input_ids=x, labels=x)
            eng.backward(out.loss)
            eng.step()
        h = eng.history
        print("llama bf16 gpu:", [(round(r.loss, 3), r.overlap_fraction, r.peak_device_allocated) for r in h])
        assert h[-1].loss < h[0].loss
        assert max(r.peak_device_bytes for r in h) <= budget < weights
        assert max(r.peak_device_allocated for r in h) <= budget
        assert sum(r.prefetch_hits for r in h) > 0
    assert bool((other == 7.0).all())


@cuda
def test_gpu_checkpoint_resume_and_export(tiny_lm, lm_batches, tmp_path):
    from safetensors.torch import load_file

    batches = [(x.cuda(), y.cuda()) for x, y in lm_batches(4)]
    cfg = _cfg("nvme", tmp_path, gradient_accumulation_steps=1, bf16={"enabled": True})
    with pyinfinity.initialize(tiny_lm(seed=0), cfg) as eng:
        for x, y in batches[:2]:
            eng.backward(eng(x, y))
            eng.step()
        eng.save_checkpoint(str(tmp_path / "ckpt"))
        want = []
        for x, y in batches[2:]:
            loss = eng(x, y)
            eng.backward(loss)
            eng.step()
            want.append(loss.item())
        eng.eval()
        with torch.no_grad():
            logits = eng(batches[0][0]).float()
        files = eng.export(str(tmp_path / "out"))
    with pyinfinity.initialize(tiny_lm(seed=5), _cfg("nvme", tmp_path, gradient_accumulation_steps=1,
                                                     bf16={"enabled": True})) as eng2:
        eng2.load_checkpoint(str(tmp_path / "ckpt"))
        got = []
        for x, y in batches[2:]:
            loss = eng2(x, y)
            eng2.backward(loss)
            eng2.step()
            got.append(loss.item())
    assert got == want
    plain = tiny_lm(seed=9).cuda().to(torch.bfloat16)
    plain.load_state_dict({k: v.to(torch.bfloat16) for k, v in load_file(files[0]).items()})
    with torch.no_grad():
        torch.testing.assert_close(plain(batches[0][0]).float(), logits, rtol=0, atol=0)


def _outcome(eng, losses: list[float]) -> tuple:
    """A run's losses, trained values (every shard's fp32 master) and gradient norms."""
    eng.synchronize()
    return losses, [eng.state.trained_values(sh).clone() for sh in eng.partition.shards], [r.grad_norm for r in eng.history]


def _assert_exact_and_like_torch(got: dict, model, batches, clip: float) -> None:
    """The background run (got[True]) bit-identical to the serial one (got[False]), and its losses
    those of plain torch AdamW (lr 1e-2, weight decay 0.01) on the GPU, clipped to ``clip``."""
    assert got[False][0] == got[True][0] and got[False][2] == got[True][2]
    assert all(torch.equal(a, b) for a, b in zip(got[False][1], got[True][1]))
    ref = model.cuda()
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.01)
    ref_losses = []
    for x, y in batches:
        rl = ref(x, y)
        rl.backward()
        if clip:
            torch.nn.utils.clip_grad_norm_(ref.parameters(), clip)
        opt.step()
        opt.zero_grad()
        ref_losses.append(rl.item())
    torch.testing.assert_close(torch.tensor(got[True][0]), torch.tensor(ref_losses), rtol=1e-4, atol=1e-6)


@cuda
@pytest.mark.parametrize("clip", [0.0, 0.05])
def test_gpu_resident_units_and_background_step_are_exact(clip, tiny_lm, lm_batches, tmp_path):
    """Units kept on the GPU (resident_bytes) get the optimizer's new values through the update
    stream; the background step (during backward without clipping, after it with clipping while
    the next forward waits unit by unit) is bit-identical to the serial step, and both follow
    torch AdamW."""
    torch.backends.cuda.matmul.allow_tf32 = False
    batches = [(x.cuda(), y.cuda()) for x, y in lm_batches(6)]
    got = {}
    for overlap in (False, True):
        cfg = _cfg("cpu", tmp_path, gradient_accumulation_steps=1, gradient_clipping=clip)
        cfg["pyinfinity"].update(overlap_step=overlap, resident_bytes="12KiB", unit_bytes=0)
        with pyinfinity.initialize(tiny_lm(layers=3), cfg) as eng:
            kept = [s.persistent for s in eng.partition.shards]
            assert any(kept) and not all(kept)  # some units stay on the GPU, the others stream
            losses = train_steps(eng, batches)
            got[overlap] = _outcome(eng, losses)
    _assert_exact_and_like_torch(got, tiny_lm(layers=3), batches, clip)


@cuda
@pytest.mark.parametrize("accumulation", [1, 2])
def test_gpu_parameters_homed_on_the_device_take_the_cpu_steps_values_exactly(accumulation, tiny_lm, lm_batches,
                                                                                tmp_path):
    """offload_param "none" (every parameter's home is its device buffer) with the optimizer on the
    CPU: the new values go to the device buffers through pinned write-back slots on the update
    stream, the background step is bit-identical to the serial one, and both follow torch AdamW."""
    torch.backends.cuda.matmul.allow_tf32 = False
    batches = [(x.cuda(), y.cuda()) for x, y in lm_batches(6)]
    got = {}
    for overlap in (False, True):
        cfg = _cfg("cpu", tmp_path, gradient_accumulation_steps=accumulation, gradient_clipping=0.0)
        cfg["zero_optimization"]["offload_param"] = {"device": "none"}
        cfg["pyinfinity"].update(overlap_step=overlap, unit_bytes=0)
        with pyinfinity.initialize(tiny_lm(layers=3), cfg) as eng:
            assert all(s.home.tier.name == "GPU" for s in eng.partition.shards)
            losses = train_steps(eng, batches)
            got[overlap] = _outcome(eng, losses)
            assert eng.state.homes._slots_made > 0  # the values went through the pinned slots
    if accumulation == 1:
        _assert_exact_and_like_torch(got, tiny_lm(layers=3), batches, 0.0)
    else:
        assert got[False][0] == got[True][0] and got[False][2] == got[True][2]
        assert all(torch.equal(a, b) for a, b in zip(got[False][1], got[True][1]))


@cuda
@pytest.mark.parametrize("clip", [0.0, 0.05])
def test_gpu_optimizer_state_on_the_device(clip, tiny_lm, lm_batches, tmp_path):
    """Resident units whose optimizer state is on the GPU (device_optimizer_bytes) keep their
    gradients there; the background paths (device units during backward or after the norm, the
    others on the CPU worker) are bit-identical to the serial step, both follow torch AdamW, and a
    checkpoint taken from the device state resumes exactly."""
    torch.backends.cuda.matmul.allow_tf32 = False
    batches = [(x.cuda(), y.cuda()) for x, y in lm_batches(6)]
    got = {}
    for overlap in (False, True):
        cfg = _cfg("cpu", tmp_path, gradient_accumulation_steps=1, gradient_clipping=clip)
        cfg["pyinfinity"].update(overlap_step=overlap, resident_bytes="1GiB", unit_bytes=0,
                                 device_optimizer_bytes="40KiB")
        with pyinfinity.initialize(tiny_lm(layers=3), cfg) as eng:
            on = [sh.device_step for sh in eng.partition.shards]
            assert any(on) and not all(on)
            assert all(eng.optimizer.state_of(sh).dev.is_cuda for sh in eng.partition.shards if sh.device_step)
            losses = train_steps(eng, batches[:3])
            eng.save_checkpoint(str(tmp_path / f"ckpt{overlap}"))
            losses += train_steps(eng, batches[3:])
            trainable = sum(sh.nbytes for sh in eng.partition.shards if sh.trainable)
            d2h = eng.history[-1].bytes_moved.get("device.d2h", 0)
            assert 0 < d2h < trainable  # the device units' gradients stayed on the GPU
            got[overlap] = _outcome(eng, losses)
    _assert_exact_and_like_torch(got, tiny_lm(layers=3), batches, clip)
    cfg["pyinfinity"]["overlap_step"] = True
    with pyinfinity.initialize(tiny_lm(seed=3, layers=3), cfg) as eng:
        eng.load_checkpoint(str(tmp_path / "ckptTrue"))
        assert train_steps(eng, batches[3:]) == got[True][0][3:]


@cuda
@pytest.mark.parametrize("where", ["device_state", "streamed"])
def test_gpu_a_background_save_while_training_resumes_exactly(where, tiny_lm, lm_batches, tmp_path):
    """A background save taken while units' optimizer state lives on the GPU (their copies taken
    when the point is fixed) or while the streamed device step steps every shard (each step's copy
    taken from the host state before it is streamed): two more steps run before the writer is let
    go, and the checkpoint resumes with the uninterrupted run's losses."""
    import threading

    from pyinfinity import checkpoint

    torch.backends.cuda.matmul.allow_tf32 = False
    batches = [(x.cuda(), y.cuda()) for x, y in lm_batches(6)]
    if where == "device_state":
        cfg = _cfg("cpu", tmp_path, gradient_accumulation_steps=1)
        cfg["pyinfinity"].update(overlap_step=True, resident_bytes="1GiB", unit_bytes=0,
                                 device_optimizer_bytes="40KiB")
    else:
        cfg = _cfg("nvme", tmp_path, gradient_accumulation_steps=1)
        cfg["pyinfinity"]["optimizer_step_device"] = "device"
    release = threading.Event()
    run = checkpoint.CheckpointWrite.run

    def held(self):
        release.wait(60)
        run(self)
    ckpt = str(tmp_path / "ckpt")
    with pyinfinity.initialize(tiny_lm(layers=3), cfg) as eng:
        losses = train_steps(eng, batches[:3])
        checkpoint.CheckpointWrite.run = held
        try:
            eng.save_checkpoint(ckpt, blocking=False)
            losses += train_steps(eng, batches[3:5])
            release.set()
            eng.wait_for_checkpoint()
        finally:
            checkpoint.CheckpointWrite.run = run
        losses += train_steps(eng, batches[5:])
    with pyinfinity.initialize(tiny_lm(seed=3, layers=3), cfg) as eng:
        eng.load_checkpoint(ckpt)
        assert eng.global_steps == 3
        assert train_steps(eng, batches[3:]) == losses[3:]


@cuda
def test_a_random_init_on_a_gpu_engine_draws_on_the_gpu_a_module_at_a_time(tmp_path):
    """init_empty + a CUDA engine: each module small enough (a quarter of the budget) is initialised
    by the GPU's generator and copied to the host; the same seed gives the same model, a tied
    parameter stays one tensor, and the values follow the model's init (std 0.02 here)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from pyinfinity.zero.partition import materialize_module

    lin = torch.nn.Linear(256, 512, device="meta")
    materialize_module(lin, None, {}, init_device=torch.device("cuda"), init_bytes=1 << 30)
    assert lin.weight.device.type == "cpu" and lin.bias.device.type == "cpu"
    assert 0.5 / 256 ** 0.5 < lin.weight.std().item() < 0.7 / 256 ** 0.5  # kaiming_uniform(a=sqrt 5): 1/sqrt(3 fan_in)

    mc = LlamaConfig(vocab_size=260, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=128, use_cache=False,
                     tie_word_embeddings=True)
    x = torch.randint(0, 256, (2, 64), generator=torch.Generator().manual_seed(1))

    def first_losses() -> list[float]:
        torch.manual_seed(0)
        with pyinfinity.init_empty():
            model = LlamaForCausalLM(mc)
        cfg = _cfg("cpu", tmp_path, pyinfinity={"device": "cuda", "device_memory": "1GiB"})
        with pyinfinity.initialize(model, cfg) as eng:
            eng.train()
            out = []
            for _ in range(2):
                loss = eng(input_ids=x, labels=x).loss
                eng.backward(loss)
                eng.step()
                out.append(loss.item())
            names = [s.name for sh in eng.partition.shards for s in sh.slices]
            assert sum("embed_tokens" in n or "lm_head" in n for n in names) == 1  # tied: one tensor
        return out

    a, b = first_losses(), first_losses()
    assert a == b
    assert abs(a[0] - math.log(260)) < 0.5  # std-0.02 weights: the first loss is about ln(vocab)


def test_the_plan_times_the_formats_step_on_the_gpu_and_gives_the_memory_back():
    """On a GPU the rates include the planned format's device step, timed as the engine runs it
    (``Rates.device_adam_rate``); the probe's tensors are released, for every format."""
    from pyinfinity.probes import measure_device_adam, measure_rates

    before = torch.cuda.memory_allocated()
    rates = measure_rates("cuda", optimizer_state="8bit", quick=True)
    assert rates.device_adam_8bit > 0 and rates.source["device_adam_8bit"] == "probe"
    for state in ("fp32", "8bit", "bf16"):
        assert 0 < measure_device_adam("cuda", state, numel=1 << 20, reps=1) < math.inf
    assert torch.cuda.memory_allocated() == before
