"""The Engine end to end on the CPU device: parity with plain PyTorch AdamW (offload to cpu and to
nvme), offload is real (RSS, corrupted swap file), checkpoint/resume, export, half precision,
transformers models (generate, save_pretrained layout), life cycle."""
from __future__ import annotations

import copy
import logging
import os

import pytest
import torch

import pyinfinity
from pyinfinity.zero.lr_schedules import WarmupDecayLR
from tests.python.conftest import sigint_default


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.mark.parametrize("tier, persistent, step_device", [("cpu", 0, "cpu"), ("nvme", 0, "cpu"),
                                                           ("nvme", 100, "cpu"), ("nvme", 0, "device")])
def test_parity_with_torch_adamw(tier, persistent, step_device, tiny_lm, lm_batches, engine_config):
    """Same model, init and data: losses and final parameters match torch AdamW, with gradient
    accumulation, clipping and a WarmupDecayLR schedule (and with small shards kept resident)."""
    steps, gas = 10, 2
    model = tiny_lm()
    ref = copy.deepcopy(model)
    sched = {"type": "WarmupDecayLR", "params": {"total_num_steps": steps, "warmup_min_lr": 1e-4,
                                                 "warmup_max_lr": 1e-2, "warmup_num_steps": 3,
                                                 "warmup_type": "linear"}}
    cfg = engine_config(tier, gradient_accumulation_steps=gas, gradient_clipping=0.3, scheduler=sched)
    cfg["zero_optimization"]["stage3_param_persistence_threshold"] = persistent
    cfg["pyinfinity"]["optimizer_step_device"] = step_device  # "device": streamed through device buffers
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.01)
    ref_sched = WarmupDecayLR(ref_opt, **sched["params"])
    batches = lm_batches(steps * gas)
    losses, ref_losses = [], []
    with pyinfinity.initialize(model, cfg) as eng:
        for i, (x, y) in enumerate(batches):
            loss = eng(x, y)
            eng.backward(loss)
            eng.step()
            losses.append(loss.item())
            rl = ref(x, y)
            (rl / gas).backward()
            ref_losses.append(rl.item())
            if (i + 1) % gas == 0:
                torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.3)
                ref_opt.step()
                ref_opt.zero_grad()
                ref_sched.step()
        assert eng.global_steps == steps
        assert any(s.persistent for s in eng.partition.shards) == bool(persistent)
        assert [r.lr for r in eng.history][:4] != [1e-2] * 4  # the schedule was applied
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=0)
        assert losses[-1] < losses[0]
        if tier == "nvme":
            moved = {k for r in eng.history for k in r.bytes_moved}
            assert {"params.nvme.read", "optimizer.nvme.read", "optimizer.nvme.write", "device.h2d",
                    "device.d2h"} <= moved
            # every step moves all gradients off the device once per micro-batch
            n = sum(p.numel() for p in ref.parameters())
            assert all(r.bytes_moved["device.d2h"] == gas * n * 4 for r in eng.history)
        trained = {}
        for sh in eng.partition.shards:
            vals = eng.state.trained_values(sh)
            for sl in sh.slices:
                trained[sl.name] = vals[sl.offset:sl.offset + sl.numel].view(sl.shape).clone()
    for name, p in ref.named_parameters():
        torch.testing.assert_close(trained[name], p.detach(), rtol=1e-5, atol=1e-7, msg=name)


def test_offload_is_real_rss_and_corrupted_swap_file(tiny_lm, lm_batches, engine_config):
    """Everything on NVMe: host RSS grows by less than the fp32 training state, and bytes changed in
    the parameter swap file change the model's output (so it is read from disk)."""
    with pyinfinity.init_empty():
        model = tiny_lm(vocab=64, d=384, layers=16, tie=False)
    numel = sum(p.numel() for p in model.parameters())
    state_bytes = numel * 16  # fp32 params + master + exp_avg + exp_avg_sq
    # overlap_step off: it keeps up to the staging buffers' size of new values until step() (its
    # own test bounds that); here the bound is on what offload itself keeps in RAM
    cfg = engine_config("nvme", pyinfinity={"device": "cpu", "device_memory": "16MiB", "overlap_step": False},
                        zero_optimization={"stage": 3, "stage3_param_persistence_threshold": 0,
                                           "stage3_prefetch_bucket_size": 4 << 20})
    cfg["zero_optimization"]["offload_optimizer"]["buffer_count"] = 3
    rss0 = _rss()
    peak = 0
    with pyinfinity.initialize(model, cfg) as eng:
        peak = max(peak, _rss() - rss0)
        for x, y in lm_batches(2, vocab=64):
            eng.backward(eng(x, y))
            peak = max(peak, _rss() - rss0)
            eng.step()
            peak = max(peak, _rss() - rss0)
        # what RAM holds: fp32 grads (4 B/param), the optimizer's 3 staging buffers, the 16 MiB
        # device pool; the fp32 state (16 B/param) must not be there
        assert peak < 0.75 * state_bytes, (peak, state_bytes)
        rep = eng.memory_report()
        assert rep.params.get("nvme", 0) == numel * 4 and rep.optimizer.get("nvme", 0) == numel * 12
        # reads come from the swap file
        eng.eval()
        (x, _), = lm_batches(1, vocab=64, seed=5)
        with torch.no_grad():
            a, b = eng(x), eng(x)
        torch.testing.assert_close(a, b, rtol=0, atol=0)
        path = eng.param_swapper.files()[0]
        size = eng.param_swapper.space.stats()["used"]  # the file itself is preallocated larger
        fd = os.open(path, os.O_RDWR)
        try:
            junk = torch.randint(0, 256, (size // 2,), dtype=torch.uint8).numpy().tobytes()
            os.pwrite(fd, junk, size // 4)
            os.fsync(fd)
        finally:
            os.close(fd)
        with torch.no_grad():
            c = eng(x)
        assert not torch.equal(a, c)


@pytest.mark.parametrize("tier", ["cpu", "nvme"])
def test_checkpoint_resume_gives_identical_losses(tier, tiny_lm, lm_batches, engine_config, tmp_path):
    sched = {"type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 1e-2, "warmup_num_steps": 5}}
    cfg = engine_config(tier, scheduler=sched, gradient_clipping=1.0)
    batches = lm_batches(6)
    ckpt = str(tmp_path / "ckpt")
    with pyinfinity.initialize(tiny_lm(seed=0), cfg) as eng:
        for x, y in batches[:3]:
            eng.backward(eng(x, y))
            eng.step()
        path = eng.save_checkpoint(ckpt, client_state={"epoch": 7})
        assert os.path.basename(path) == "global_step3"
        expected = []
        for x, y in batches[3:]:
            loss = eng(x, y)
            eng.backward(loss)
            eng.step()
            expected.append(loss.item())
    cfg2 = engine_config(tier, scheduler=sched, gradient_clipping=1.0)
    with pyinfinity.initialize(tiny_lm(seed=123), cfg2) as eng2:  # different init: all comes from the checkpoint
        _, client = eng2.load_checkpoint(ckpt)
        assert client == {"epoch": 7} and eng2.global_steps == 3
        got = []
        for x, y in batches[3:]:
            loss = eng2(x, y)
            eng2.backward(loss)
            eng2.step()
            got.append(loss.item())
    assert got == expected


def test_torn_checkpoint_is_detected(tiny_lm, lm_batches, engine_config, tmp_path):
    ckpt = str(tmp_path / "ckpt")
    with pyinfinity.initialize(tiny_lm(), engine_config("cpu")) as eng:
        (x, y), = lm_batches(1)
        eng.backward(eng(x, y))
        eng.step()
        path = eng.save_checkpoint(ckpt)
        with open(os.path.join(path, "state.bin"), "r+b") as f:
            f.truncate(100)
        with pytest.raises(ValueError, match="torn"):
            eng.load_checkpoint(ckpt)
    with pyinfinity.initialize(tiny_lm(layers=1), engine_config("cpu")) as other:
        with pytest.raises(ValueError, match="different model"):
            other.load_checkpoint(ckpt)


def test_export_loads_into_the_plain_model(tiny_lm, lm_batches, engine_config, tmp_path):
    from safetensors.torch import load_file

    model = tiny_lm()
    with pyinfinity.initialize(model, engine_config("nvme")) as eng:
        for x, y in lm_batches(3):
            eng.backward(eng(x, y))
            eng.step()
        eng.eval()
        (x, _), = lm_batches(1, seed=9)
        with torch.no_grad():
            want = eng(x)
        files = eng.export(str(tmp_path / "export"))
    plain = tiny_lm(seed=42)
    plain.load_state_dict(load_file(files[0]), strict=True)
    with torch.no_grad():
        torch.testing.assert_close(plain(x), want, rtol=0, atol=0)


def _tiny_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                      bos_token_id=1, eos_token_id=2, pad_token_id=0)
    return LlamaForCausalLM(cfg)


def test_transformers_llama_train_generate_export(engine_config, tmp_path):
    from transformers import LlamaForCausalLM

    model = _tiny_llama()
    ref = copy.deepcopy(model)
    x = torch.randint(3, 64, (2, 12), generator=torch.Generator().manual_seed(0))
    with pyinfinity.initialize(model, engine_config("nvme")) as eng:
        out = eng(input_ids=x, labels=x)
        assert type(out).__name__ == "CausalLMOutputWithPast"  # output returned unchanged
        torch.testing.assert_close(out.loss, ref(input_ids=x, labels=x).loss, rtol=1e-6, atol=0)
        for _ in range(3):
            out = eng(input_ids=x, labels=x)
            eng.backward(out.loss)
            eng.step()
        eng.eval()
        gen = eng.generate(x[:, :4], max_new_tokens=5, do_sample=False)
        with torch.no_grad():
            logits = eng(input_ids=x).logits
        eng.export(str(tmp_path / "hf"))
    assert os.path.exists(tmp_path / "hf" / "config.json")
    plain = LlamaForCausalLM.from_pretrained(str(tmp_path / "hf"))
    plain.eval()
    with torch.no_grad():
        torch.testing.assert_close(plain(input_ids=x).logits, logits, rtol=0, atol=0)
    torch.testing.assert_close(plain.generate(x[:, :4], max_new_tokens=5, do_sample=False), gen, rtol=0, atol=0)


@pytest.mark.parametrize("half", ["bf16", "fp16"])
def test_half_precision_trains(half, tiny_lm, lm_batches, engine_config):
    model = tiny_lm()
    cfg = engine_config("nvme", **{half: {"enabled": True}})
    if half == "fp16":
        cfg["fp16"]["initial_scale_power"] = 8
    batches = lm_batches(1) * 8
    with pyinfinity.initialize(model, cfg) as eng:
        dtype = torch.bfloat16 if half == "bf16" else torch.float16
        assert {s.dtype for s in eng.partition.shards} == {dtype}
        for x, y in batches:
            eng.backward(eng(x, y))
            eng.step()
        losses = [r.loss for r in eng.history if not r.skipped]
        assert len(losses) >= 6 and losses[-1] < losses[0]
        if half == "fp16":
            assert eng.history[0].loss_scale == 2.0 ** 8


def test_fp16_overflow_skips_step_and_lowers_scale(tiny_lm, lm_batches, engine_config):
    cfg = engine_config("cpu", fp16={"enabled": True, "initial_scale_power": 30, "hysteresis": 1})
    with pyinfinity.initialize(tiny_lm(), cfg) as eng:
        (x, y), = lm_batches(1)
        eng.backward(eng(x, y) * 1e6)  # scaled by 2^30 this overflows fp16 gradients
        rec = eng.step()
        assert rec.skipped and eng.global_steps == 0 and eng.scaler.scale == 2.0 ** 29


def test_close_removes_swap_files_and_forbids_use(tiny_lm, lm_batches, engine_config, tmp_path):
    eng = pyinfinity.initialize(tiny_lm(), engine_config("nvme"))
    files = eng.param_swapper.files() + eng.optim_swapper.files()
    assert len(files) == 2 and all(os.path.exists(f) for f in files)
    rep = eng.memory_report()
    assert rep.swap_files == files and rep.device == "cpu"
    eng.close()
    eng.close()  # idempotent
    assert not any(os.path.exists(f) for f in files)
    (x, y), = lm_batches(1)
    with pytest.raises(RuntimeError, match="after close"):
        eng(x, y)


def test_memory_report_table_says_when_a_class_holds_nothing():
    from pyinfinity.engine import MemoryReport

    rep = MemoryReport(device="cuda:0", device_budget=8 << 30, device_resident=1 << 30, device_peak=2 << 30,
                       device_allocated_peak=None, params={"cpu": 3 << 30, "nvme": 0}, optimizer={"cpu": 12 << 30},
                       grads={"cpu": 0}, swap_files=[], host_rss=0)
    lines = rep.table().splitlines()
    assert lines[1].startswith("params") and "cpu 3.00 GiB" in lines[1] and "nvme" not in lines[1]
    assert lines[3].split() == ["grads", "none", "held"]


def test_swap_dir_in_use_by_another_engine_is_an_error(tiny_lm, engine_config):
    cfg = engine_config("nvme")
    with pyinfinity.initialize(tiny_lm(), cfg):
        with pytest.raises(OSError, match="in use"):
            pyinfinity.initialize(tiny_lm(), cfg)


def test_engine_exit_cleans_up_in_a_subprocess(tmp_path):
    """Interpreter exit without close() (atexit) removes the swap files."""
    import subprocess
    import sys

    swap = tmp_path / "swap"
    code = f"""
import torch, pyinfinity
m = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8))
cfg = {{"zero_optimization": {{"stage": 3, "offload_param": {{"device": "nvme", "nvme_path": {str(swap)!r}}},
        "offload_optimizer": {{"device": "nvme", "nvme_path": {str(swap)!r}}}}}, "pyinfinity": {{"device": "cpu"}}}}
eng = pyinfinity.initialize(m, cfg)
eng(torch.randn(2, 8)).sum()
print(len(eng.param_swapper.files()))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "1"
    assert not list(swap.glob("*.swp"))


def test_frozen_parameters_stay_and_the_rest_matches_torch(tiny_lm, lm_batches, engine_config, tmp_path):
    model = tiny_lm(tie=False)
    for p in list(model.embed.parameters()) + list(model.blocks[0].parameters()):
        p.requires_grad_(False)
    ref = copy.deepcopy(model)
    ref_opt = torch.optim.AdamW([p for p in ref.parameters() if p.requires_grad], lr=1e-2, weight_decay=0.01)
    with pyinfinity.initialize(model, engine_config("nvme")) as eng:
        assert sum(1 for s in eng.partition.shards if not s.trainable) == 4  # embed + 3 in block 0
        for x, y in lm_batches(4):
            loss = eng(x, y)
            eng.backward(loss)
            eng.step()
            rl = ref(x, y)
            rl.backward()
            ref_opt.step()
            ref_opt.zero_grad()
            torch.testing.assert_close(loss, rl, rtol=1e-5, atol=0)
        files = eng.export(str(tmp_path / "out"))
    from safetensors.torch import load_file

    sd = load_file(files[0])
    for name, p in ref.named_parameters():
        torch.testing.assert_close(sd[name], p.detach(), rtol=1e-5, atol=1e-7, msg=name)


def test_frozen_units_stream_through_backward_within_the_device_budget(engine_config):
    """Backward needs a frozen unit's weights (for the gradient of its input) but gives it no
    gradient: it is released when backward moves on to another unit, so frozen weights stream
    through backward as through forward. Seven frozen layers after a trainable one, under a
    device budget of three layers: held until the end of backward they would not fit."""
    torch.manual_seed(0)
    layers = [torch.nn.Linear(64, 64) for _ in range(8)]
    model = torch.nn.Sequential(*[m for lin in layers for m in (lin, torch.nn.Tanh())])
    for lin in layers[1:]:
        lin.requires_grad_(False)
    ref = copy.deepcopy(model)
    ref_opt = torch.optim.AdamW(ref[0].parameters(), lr=1e-2, weight_decay=0.01)
    layer_bytes = (64 * 64 + 64) * 4
    cfg = engine_config("nvme", zero_optimization={"stage3_prefetch_bucket_size": 0},
                        pyinfinity={"device": "cpu", "device_memory": 3 * layer_bytes})
    g = torch.Generator().manual_seed(1)
    with pyinfinity.initialize(model, cfg) as eng:
        for _ in range(3):
            x = torch.randn(4, 64, generator=g)
            loss = eng(x).square().mean()
            eng.backward(loss)
            eng.step()
            rl = ref(x).square().mean()
            rl.backward()
            ref_opt.step()
            ref_opt.zero_grad()
            torch.testing.assert_close(loss, rl, rtol=1e-5, atol=0)
        assert max(r.peak_device_bytes for r in eng.history) <= 3 * layer_bytes
        assert eng.history[-1].bytes_moved["device.d2h"] == layer_bytes  # the trainable layer's gradient only


def test_ctrl_c_removes_swap_files(tmp_path):
    import signal
    import subprocess
    import sys

    swap = tmp_path / "swap"
    code = f"""
import sys, torch, pyinfinity
m = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 64))
cfg = {{"zero_optimization": {{"stage": 3, "offload_param": {{"device": "nvme", "nvme_path": {str(swap)!r}}},
        "offload_optimizer": {{"device": "nvme", "nvme_path": {str(swap)!r}}}}}, "pyinfinity": {{"device": "cpu"}}}}
eng = pyinfinity.initialize(m, cfg)
x = torch.randn(4, 64)
i = 0
while True:
    eng.backward(eng(x).square().mean())
    eng.step()
    i += 1
    if i == 2:
        print("ready", flush=True)
"""
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=sigint_default)
    try:
        assert proc.stdout.readline().strip() == "ready"
        assert len(list(swap.glob("*.swp"))) == 2
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert "KeyboardInterrupt" in err
    assert not list(swap.glob("*.swp"))


def test_export_of_a_bf16_run_says_it_writes_the_models_own_fp32(engine_config, tmp_path, caplog):
    """A model built in fp32 and trained in bf16 is exported in fp32 (its parameters' own dtype):
    the export's log line says so, and the files hold fp32."""
    from safetensors import safe_open

    x = torch.randint(3, 64, (2, 12), generator=torch.Generator().manual_seed(0))
    with pyinfinity.initialize(_tiny_llama(), engine_config("cpu", bf16={"enabled": True})) as eng:
        eng.backward(eng(input_ids=x, labels=x).loss)
        eng.step()
        with caplog.at_level(logging.INFO, logger="pyinfinity.export"):
            files = eng.export(str(tmp_path / "hf"))
    line = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("exported"))
    assert "weights in fp32" in line and "computed in bf16" in line, line
    st = next(f for f in files if f.endswith(".safetensors"))
    with safe_open(st, "pt") as f:
        assert {f.get_tensor(k).dtype for k in f.keys()} == {torch.float32}


def test_a_parameter_created_after_initialize_fails_the_next_forward_naming_it(engine_config):
    # a new embedding set after the engine (or Trainer) wrapped the model, as resize_token_embeddings
    # sets one: the engine never partitioned it; training on would leave it untrained and unoffloaded
    model = _tiny_llama()
    x = torch.randint(3, 64, (2, 12), generator=torch.Generator().manual_seed(0))
    with pyinfinity.initialize(model, engine_config("cpu")) as eng:
        eng.backward(eng(input_ids=x, labels=x).loss)
        eng.step()
        model.set_input_embeddings(torch.nn.Embedding(80, 32))
        for mode in ("train", "eval"):
            getattr(eng, mode)()
            with pytest.raises(RuntimeError, match=r"^Engine: parameter model\.embed_tokens\.weight was created after "
                                                   r"pyinfinity\.initialize.*before Trainer") as e:
                eng(input_ids=x, labels=x)
            assert "\n" not in str(e.value)
