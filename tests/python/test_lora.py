"""LoRA adapters through PEFT, parameters and optimizer on the NVMe tier: adapters made by
``from_pretrained(..., peft_config=)`` equal PEFT's under the same seed and train with PEFT +
torch AdamW's losses; the export loads in PEFT (``PeftModel.from_pretrained``) and, merged, in
transformers (``from_pretrained``) with the engine's logits; an exported adapter continues; the
command line trains and exports one, and refuses bad flag combinations in one line. A LoRA
checkpoint holds the adapters' state and the base's identity only, resumes exactly, refuses
another base, and a version-2 checkpoint (every shard saved) still loads."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

peft = pytest.importorskip("peft")

import pyinfinity  # noqa: E402
from pyinfinity.adapters import AdapterError, require_peft  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))
from pretrained_dirs import make_model_dir  # noqa: E402

LR, WD = 1e-2, 0.01
STEPS = 4


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    return {f: make_model_dir(str(root / f), f) for f in ("llama", "gpt2")}


def _config(swap: str) -> dict:
    return {
        "train_micro_batch_size_per_gpu": 2,
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": WD}},
        "zero_optimization": {
            "stage": 3,
            "offload_param": {"device": "nvme", "nvme_path": swap, "max_in_cpu": 0},
            "offload_optimizer": {"device": "nvme", "nvme_path": swap},
            "stage3_param_persistence_threshold": 0,
        },
        "pyinfinity": {"device": "cpu", "device_memory": "64MiB"},
    }


def _lora(**kw) -> "peft.LoraConfig":
    return peft.LoraConfig(**{"r": 8, "target_modules": ["q_proj", "v_proj"], **kw})


def _base(path: str, **kw):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, local_files_only=True, **kw)


def _ids(seed: int = 0) -> torch.Tensor:
    return torch.randint(2, 300, (2, 16), generator=torch.Generator().manual_seed(seed))


def _adapter_values(model) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in peft.get_peft_model_state_dict(model).items()}


def _train_reference(model, steps: int = STEPS, device: str = "cpu") -> list[float]:
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LR, weight_decay=WD)
    losses = []
    for i in range(steps):
        x = _ids(i).to(device)
        loss = model(input_ids=x, labels=x).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def _train_engine(eng, steps: int = STEPS, start: int = 0) -> list[float]:
    losses = []
    for i in range(start, start + steps):
        x = _ids(i)
        loss = eng(input_ids=x, labels=x).loss
        eng.backward(loss)
        eng.step()
        losses.append(loss.item())
    return losses


def _eval_logits(eng) -> torch.Tensor:
    eng.eval()
    with torch.no_grad():
        return eng(input_ids=_ids(99)).logits


def test_adapters_are_peft_s_and_train_with_peft_s_losses(model_dirs, tmp_path):
    path = model_dirs["llama"]
    torch.manual_seed(7)
    ref = peft.get_peft_model(_base(path), _lora())
    after_ref = torch.random.get_rng_state()
    torch.manual_seed(7)
    with pyinfinity.from_pretrained(path, _config(str(tmp_path / "swap")), peft_config=_lora()) as eng:
        assert torch.equal(torch.random.get_rng_state(), after_ref)  # the same draws as PEFT's
        tiers = {sh.home.tier.value for sh in eng.partition.shards}
        assert tiers == {"nvme"}
        trainable = [sh for sh in eng.partition.shards if sh.trainable]
        frozen = [sh for sh in eng.partition.shards if not sh.trainable]
        assert trainable and frozen
        assert all("lora_" in s.name for sh in trainable for s in sh.slices)
        assert all(eng.optimizer.state_of(sh) is not None for sh in trainable)
        assert all(eng.optimizer.state_of(sh) is None for sh in frozen)  # no master or moments for the base
        eng.export(str(tmp_path / "initial"))
        from safetensors.torch import load_file

        initial = load_file(str(tmp_path / "initial" / "adapter_model.safetensors"))
        want = _adapter_values(ref)
        assert initial.keys() == want.keys()
        for k in want:
            assert torch.equal(initial[k], want[k]), k
        losses = _train_engine(eng)
    torch.testing.assert_close(losses, _train_reference(ref), rtol=1e-5, atol=0)


def test_exports_load_in_peft_and_merged_in_transformers_with_the_engine_s_logits(model_dirs, tmp_path):
    from safetensors import safe_open

    path = model_dirs["llama"]
    adapter, merged = str(tmp_path / "adapter"), str(tmp_path / "merged")
    with pyinfinity.from_pretrained(path, _config(str(tmp_path / "swap")), peft_config=_lora()) as eng:
        _train_engine(eng)
        want = _eval_logits(eng)
        eng.export(adapter)
        eng.export(merged, merge_adapters=True)
    assert {"adapter_config.json", "adapter_model.safetensors"} <= set(os.listdir(adapter))
    with safe_open(os.path.join(adapter, "adapter_model.safetensors"), "pt") as f:
        keys = list(f.keys())
    assert keys and all(k.startswith("base_model.model.") and ".default." not in k and "lora_" in k for k in keys)
    with open(os.path.join(adapter, "adapter_config.json")) as f:
        assert json.load(f)["r"] == 8
    loaded = peft.PeftModel.from_pretrained(_base(path), adapter).eval()
    with torch.no_grad():
        torch.testing.assert_close(loaded(input_ids=_ids(99)).logits, want, atol=1e-5, rtol=0)
    plain = _base(merged).eval()
    with safe_open(os.path.join(merged, "model.safetensors"), "pt") as f:
        assert set(f.keys()) == set(_base(path).state_dict())  # the base model's own names, nothing of PEFT's
    with torch.no_grad():
        torch.testing.assert_close(plain(input_ids=_ids(99)).logits, want, atol=1e-4, rtol=0)
    assert os.path.isfile(os.path.join(merged, "tokenizer.json"))


def test_modules_to_save_train_export_and_continue_as_peft_s(model_dirs, tmp_path):
    """``modules_to_save``: PEFT trains a copy of a whole module (here the head), which starts from
    the base's tensor. The losses of PEFT + AdamW; the adapter export holds the copy and loads in
    PEFT, the merged export has the copy in the original's place under the base model's names;
    continuing the exported adapter starts from the trained copy."""
    from safetensors import safe_open

    path = model_dirs["llama"]
    lc = {"modules_to_save": ["lm_head"]}
    torch.manual_seed(7)
    ref = peft.get_peft_model(_base(path), _lora(**lc))
    torch.manual_seed(7)
    adapter, merged = str(tmp_path / "adapter"), str(tmp_path / "merged")
    with pyinfinity.from_pretrained(path, _config(str(tmp_path / "s0")), peft_config=_lora(**lc)) as eng:
        assert any(sh.trainable and sh.module_name.endswith("lm_head.modules_to_save") for sh in eng.partition.shards)
        assert eng.weights.complete  # the copy is read from the base's head
        losses = _train_engine(eng)
        want = _eval_logits(eng)
        eng.export(adapter)
        eng.export(merged, merge_adapters=True)
    torch.testing.assert_close(losses, _train_reference(ref), rtol=1e-5, atol=0)
    with safe_open(os.path.join(adapter, "adapter_model.safetensors"), "pt") as f:
        assert "base_model.model.lm_head.weight" in set(f.keys())
    with torch.no_grad():
        loaded = peft.PeftModel.from_pretrained(_base(path), adapter).eval()
        torch.testing.assert_close(loaded(input_ids=_ids(99)).logits, want, atol=1e-5, rtol=0)
        with safe_open(os.path.join(merged, "model.safetensors"), "pt") as f:
            assert set(f.keys()) == set(_base(path).state_dict())
        torch.testing.assert_close(_base(merged).eval()(input_ids=_ids(99)).logits, want, atol=1e-4, rtol=0)
    with pyinfinity.from_pretrained(path, _config(str(tmp_path / "s1")), adapter=adapter) as eng:
        torch.testing.assert_close(_eval_logits(eng), want, atol=1e-6, rtol=0)


def test_merged_export_of_gpt2_s_conv1d_layers(model_dirs, tmp_path):
    """GPT-2's Conv1D keeps its weight transposed (PEFT's fan_in_fan_out): the merge follows it."""
    path = model_dirs["gpt2"]
    cfg = peft.LoraConfig(r=4, lora_alpha=16, target_modules=["c_attn", "c_proj"], fan_in_fan_out=True)
    with pyinfinity.from_pretrained(path, _config(str(tmp_path / "swap")), peft_config=cfg) as eng:
        _train_engine(eng, 2)
        want = _eval_logits(eng)
        eng.export(str(tmp_path / "merged"), merge_adapters=True)
    with torch.no_grad():
        got = _base(str(tmp_path / "merged")).eval()(input_ids=_ids(99)).logits
    torch.testing.assert_close(got, want, atol=1e-4, rtol=0)


def test_an_exported_adapter_continues_as_peft_continues_it(model_dirs, tmp_path):
    path = model_dirs["llama"]
    adapter = str(tmp_path / "adapter")
    with pyinfinity.from_pretrained(path, _config(str(tmp_path / "swap")), peft_config=_lora()) as eng:
        _train_engine(eng, 2)
        eng.export(adapter)
    ref = peft.PeftModel.from_pretrained(_base(path), adapter, is_trainable=True)
    with pyinfinity.from_pretrained(path, _config(str(tmp_path / "swap2")), adapter=adapter) as eng:
        losses = _train_engine(eng)
    torch.testing.assert_close(losses, _train_reference(ref), rtol=1e-5, atol=0)


def test_a_bf16_base_stays_bf16_and_the_adapters_are_fp32(tmp_path):
    src = make_model_dir(str(tmp_path / "fp32"), "llama")
    path = str(tmp_path / "bf16")
    _base(src, dtype=torch.bfloat16).save_pretrained(path, safe_serialization=True)  # config.json: bfloat16
    with pyinfinity.from_pretrained(path, _config(str(tmp_path / "swap")), peft_config=_lora()) as eng:
        dtypes = {(s.orig_dtype, s.requires_grad) for sh in eng.partition.shards for s in sh.slices}
        assert dtypes == {(torch.bfloat16, False), (torch.float32, True)}
        _train_engine(eng, 1)


def test_a_frozen_base_streams_through_backward_under_a_budget_a_quarter_its_size(tmp_path):
    """Parameters on NVMe, one unit per module, a device budget of a quarter of the bf16 base:
    backward releases each frozen unit as it moves on (held to the end of backward, most of the
    base would be on the device at once), and the step holds no more than the budget."""
    src = make_model_dir(str(tmp_path / "fp32"), "llama", hidden=64, layers=6)
    path = str(tmp_path / "bf16")
    _base(src, dtype=torch.bfloat16).save_pretrained(path, safe_serialization=True)
    cap = 128 << 10
    cfg = _config(str(tmp_path / "swap"))
    cfg["zero_optimization"]["stage3_prefetch_bucket_size"] = 0
    cfg["pyinfinity"].update(device_memory=cap, unit_bytes=0)
    with pyinfinity.from_pretrained(path, cfg, peft_config=_lora(r=4)) as eng:
        base = sum(sh.nbytes for sh in eng.partition.shards if not sh.trainable)
        assert base > 4 * cap
        losses = _train_engine(eng, 3)
        assert max(r.peak_device_bytes for r in eng.history) <= cap
    assert all(torch.isfinite(torch.tensor(losses)))


def test_the_frozen_base_needs_no_optimizer_ram(model_dirs, tmp_path):
    """The host RAM the engine checks at start counts optimizer state (12 bytes a parameter) for
    the adapters only: a budget that holds the base and the adapters' state is enough, where
    state for every parameter would need four times the base."""
    path = model_dirs["llama"]
    cfg = _config(str(tmp_path / "swap"))
    cfg["zero_optimization"]["offload_param"]["device"] = "cpu"
    cfg["zero_optimization"]["offload_optimizer"]["device"] = "cpu"
    with pyinfinity.from_pretrained(path, cfg, peft_config=_lora()) as eng:
        base = sum(sh.nbytes for sh in eng.partition.shards if not sh.trainable)
        adapters = sum(sh.numel for sh in eng.partition.shards if sh.trainable)
    cfg["pyinfinity"]["host_memory"] = base + 12 * adapters + (64 << 10)
    assert cfg["pyinfinity"]["host_memory"] < 2 * base
    with pyinfinity.from_pretrained(path, cfg, peft_config=_lora()) as eng:
        assert _train_engine(eng, 1)


def test_bad_adapter_setups_are_clear_errors(model_dirs, tmp_path, monkeypatch):
    path = model_dirs["llama"]
    cfg = _config(str(tmp_path / "swap"))
    with pytest.raises(ValueError, match="not both"):
        pyinfinity.from_pretrained(path, cfg, peft_config=_lora(), adapter=str(tmp_path))
    with pytest.raises(AdapterError, match="init_lora_weights='pissa'"):
        pyinfinity.from_pretrained(path, cfg, peft_config=_lora(init_lora_weights="pissa"))
    with pytest.raises(AdapterError, match="DoRA"):
        pyinfinity.from_pretrained(path, cfg, peft_config=_lora(use_dora=True))
    with pytest.raises(FileNotFoundError, match="adapter_config.json"):
        pyinfinity.from_pretrained(path, cfg, adapter=str(tmp_path))
    with pytest.raises(AdapterError, match="trainable_token_indices"):
        pyinfinity.from_pretrained(path, cfg, peft_config=_lora(trainable_token_indices=[3, 4]))
    assert not os.path.exists(tmp_path / "swap") or not os.listdir(tmp_path / "swap")
    monkeypatch.setitem(sys.modules, "peft", None)  # as if it were not installed
    with pytest.raises(ImportError, match=r"pip install peft"):
        require_peft()


def test_merge_without_adapters_is_refused(model_dirs, tmp_path):
    with pyinfinity.from_pretrained(model_dirs["llama"], _config(str(tmp_path / "swap"))) as eng:
        with pytest.raises(ValueError, match="no adapters to merge"):
            eng.export(str(tmp_path / "out"), merge_adapters=True)


# ---------------------------------------------------------------------------- the command line
def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pyinfinity", *args], capture_output=True, text=True, timeout=600,
                          env=os.environ.copy())


@pytest.fixture(scope="module")
def data_file(tmp_path_factory):
    from pretrained_dirs import CORPUS

    p = tmp_path_factory.mktemp("data") / "data.txt"
    p.write_text(CORPUS)
    return str(p)


@pytest.mark.parametrize("merge", [False, True])
def test_cli_trains_lora_and_its_export_loads(model_dirs, data_file, tmp_path, merge):
    path, out = model_dirs["llama"], str(tmp_path / "out")
    p = _cli("train", "--model", path, "--data", data_file, "--lora", "4", "--lora-targets", "q_proj,v_proj",
             "--steps", "2", "--seq", "32", "--batch", "2", "--device", "cpu", "--offload", "nvme", "--nvme",
             str(tmp_path / "swap"), "--no-progress", "--export", out, *(["--merge-adapters"] if merge else []))
    assert p.returncode == 0, p.stderr[-3000:]
    if merge:
        _base(out)
        return
    with open(os.path.join(out, "adapter_config.json")) as f:
        cfg = json.load(f)
    assert (cfg["r"], cfg["lora_alpha"], sorted(cfg["target_modules"])) == (4, 8, ["q_proj", "v_proj"])
    peft.PeftModel.from_pretrained(_base(path), out)


def test_cli_lora_on_a_gpu_keeps_each_parameters_dtype():
    """--dtype auto is bf16 on a GPU, but a LoRA run casts nothing, as PEFT trains: the base stays in
    the checkpoint's dtype and the adapters in fp32 (a bf16 section would make them bf16 too)."""
    import argparse

    from pyinfinity.cli.train_args import add_arguments, build_config

    p = argparse.ArgumentParser()
    add_arguments(p)
    assert build_config(p.parse_args([]), "cuda:0")["bf16"] == {"enabled": True}
    for flags in (["--lora", "8"], ["--adapter", "DIR"]):
        cfg = build_config(p.parse_args(flags), "cuda:0")
        assert "bf16" not in cfg and "fp16" not in cfg
    assert build_config(p.parse_args(["--lora", "8", "--dtype", "bf16"]), "cuda:0")["bf16"] == {"enabled": True}


@pytest.mark.parametrize("flags, needle", [
    (["--lora-alpha", "8"], "--lora-alpha: needs --lora"),
    (["--lora-dropout", "0.1"], "--lora-dropout: needs --lora"),
    (["--lora-targets", "q_proj"], "--lora-targets: needs --lora"),
    (["--lora", "4", "--merge-adapters"], "--merge-adapters: needs --export"),
    (["--merge-adapters", "--export", "OUT"], "--merge-adapters: needs --lora"),
    (["--lora", "0"], "--lora: 0 must be >= 1"),
    (["--lora", "4", "--lora-dropout", "1.5"], "--lora-dropout: 1.5"),
    (["--lora", "4", "--lora-targets", "q_proj,,v_proj"], "--lora-targets"),
    (["--lora", "4", "--adapter", "DIR"], "give one"),
    (["--adapter", "DIR"], "not a PEFT adapter directory"),
])
def test_cli_bad_lora_flags_are_one_line(model_dirs, data_file, tmp_path, flags, needle):
    flags = [str(tmp_path / f) if f in ("OUT", "DIR") else f for f in flags]
    p = _cli("train", "--model", model_dirs["llama"], "--data", data_file, "--device", "cpu", *flags)
    assert p.returncode == 2, p.stderr[-3000:]
    lines = p.stderr.strip().splitlines()
    assert "Traceback" not in p.stderr and len(lines) == 1 and needle in lines[0], p.stderr


def test_an_unknown_lora_target_is_one_line_naming_the_layers_there(model_dirs, data_file, tmp_path):
    """`--lora-targets q_prj` (train and plan): the layers of that model LoRA can adapt, not PEFT's
    "not found in the base model"."""
    p = _cli("train", "--model", model_dirs["llama"], "--data", data_file, "--device", "cpu", "--lora", "4",
             "--lora-targets", "q_prj,v_proj", "--steps", "1", "--seq", "32", "--no-progress")
    assert p.returncode == 2 and "Traceback" not in p.stderr, p.stderr[-3000:]
    last = p.stderr.strip().splitlines()[-1]
    assert "--lora-targets" in last and "q_prj: no such layer in LlamaForCausalLM" in last, last
    assert "q_proj, up_proj, v_proj" in last and "(or all-linear)" in last and "v_proj:" not in last, last
    cfg = tmp_path / "model.json"
    cfg.write_text(json.dumps(PLAN_MODEL))
    p = _cli("plan", "--model", str(cfg), "--device", "cpu", "--lora", "4", "--lora-targets", "q_prj")
    last = p.stderr.strip().splitlines()[-1]
    assert p.returncode == 2 and "Traceback" not in p.stderr, p.stderr[-3000:]
    assert last.startswith("pyinfinity plan: error: --lora-targets: q_prj: no such layer in LlamaForCausalLM"), last
    assert "q_proj" in last, last

def test_cli_lora_needs_a_model(tmp_path):
    p = _cli("train", "--lora", "4", "--device", "cpu")
    assert p.returncode == 2 and p.stderr.strip().splitlines()[-1].endswith(
        "--lora: needs --model DIR (adapters train over a pretrained model)"), p.stderr


# ---------------------------------------------------------------------------- checkpoints
def _engine(path: str, swap: str):
    torch.manual_seed(3)
    return pyinfinity.from_pretrained(path, _config(swap), peft_config=_lora())


def test_a_lora_checkpoint_holds_the_adapters_only_and_resumes_exactly(model_dirs, tmp_path):
    path = model_dirs["llama"]
    with _engine(path, str(tmp_path / "s0")) as eng:
        straight = _train_engine(eng, 4)
    with _engine(path, str(tmp_path / "s1")) as eng:
        first = _train_engine(eng, 2)
        saved = eng.save_checkpoint(str(tmp_path / "ckpt"), by_reference=False)  # the adapters' state in state.bin
        adapter_numel = sum(sh.numel for sh in eng.partition.shards if sh.trainable)
        base_numel = sum(sh.numel for sh in eng.partition.shards if not sh.trainable)
    with open(os.path.join(saved, "meta.json")) as f:
        meta = json.load(f)
    assert meta["version"] == 4 and set(meta["base"]) == {"config", "files", "tensors", "adapters"}
    assert {e["kind"] for e in meta["entries"]} == {"optim"}
    assert os.path.getsize(os.path.join(saved, "state.bin")) < 3 * 4 * adapter_numel + 4096 * len(meta["entries"])
    assert base_numel > adapter_numel  # what was left out is most of the model
    with _engine(path, str(tmp_path / "s2")) as eng:
        eng.load_checkpoint(str(tmp_path / "ckpt"))
        rest = _train_engine(eng, 2, start=2)
    torch.testing.assert_close(first + rest, straight, rtol=1e-6, atol=0)


def test_a_lora_checkpoint_refuses_another_base(model_dirs, tmp_path):
    from pyinfinity.checkpoint import CheckpointError

    path = model_dirs["llama"]
    with _engine(path, str(tmp_path / "s0")) as eng:
        _train_engine(eng, 1)
        eng.save_checkpoint(str(tmp_path / "ckpt"))
    other = make_model_dir(str(tmp_path / "other"), "llama", seed=1)  # same config and file sizes, other values
    with _engine(other, str(tmp_path / "s1")) as eng:
        with pytest.raises(CheckpointError, match="other base weights.*safetensors files"):
            eng.load_checkpoint(str(tmp_path / "ckpt"))
    with open(os.path.join(other, "config.json")) as f:
        cfg = json.load(f)
    cfg["rms_norm_eps"] = 1e-5
    with open(os.path.join(other, "config.json"), "w") as f:
        json.dump(cfg, f)
    with _engine(other, str(tmp_path / "s2")) as eng:
        with pytest.raises(CheckpointError, match="other base weights.*config.json"):
            eng.load_checkpoint(str(tmp_path / "ckpt"))


def _largest_shard(path: str) -> str:
    return max((os.path.join(path, n) for n in os.listdir(path) if n.endswith(".safetensors")), key=os.path.getsize)


def _flip_byte_at(path: str, fraction: float) -> None:
    with open(path, "r+b") as f:
        f.seek(int(os.path.getsize(path) * fraction))
        b = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([b[0] ^ 0x10]))


def _last_tensor(fpath: str) -> tuple[str, int]:
    """(name, file offset) of the tensor stored last in a safetensors file."""
    import struct

    with open(fpath, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        header = json.loads(f.read(n))
    key = max((k for k in header if k != "__metadata__"), key=lambda k: header[k]["data_offsets"][0])
    return key, 8 + n + header[key]["data_offsets"][0]


def _scale_one_layer(fpath: str, factor: float) -> str:
    """Multiplies the tensor stored last in ``fpath`` by ``factor`` in place (same names, shapes,
    dtypes and file size: only its values change); returns its name."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    with safe_open(fpath, "pt") as f:
        meta, tensors = f.metadata(), {k: f.get_tensor(k) for k in f.keys()}
    key = _last_tensor(fpath)[0]
    tensors[key] = tensors[key] * factor
    size = os.path.getsize(fpath)
    save_file(tensors, fpath, metadata=meta)
    assert os.path.getsize(fpath) == size and _last_tensor(fpath)[0] == key
    return key


@pytest.mark.parametrize("change", ["byte_at_97_percent", "one_layer_times_1.01"])
def test_a_lora_checkpoint_refuses_a_base_changed_past_the_first_mib(change, model_dirs, tmp_path):
    """The base's identity covers every byte of every tensor the run read (a CRC-32C taken while the
    load streamed it in): a base changed at the end of a shard, or one layer scaled by 1.01 (a
    re-published base, an adapter merged in), is refused in one line naming a changed tensor."""
    from pyinfinity import pretrained
    from pyinfinity.checkpoint import CheckpointError

    path = make_model_dir(str(tmp_path / "base"), "llama", hidden=256, shard="3MB")  # shards of several MiB
    with _engine(path, str(tmp_path / "s0")) as eng:
        _train_engine(eng, 1)
        eng.save_checkpoint(str(tmp_path / "ckpt"))
    shard = _largest_shard(path)
    if change == "byte_at_97_percent":
        _flip_byte_at(shard, 0.97)
        assert 0.97 * os.path.getsize(shard) > 2 * pretrained.IDENTITY_SAMPLE  # past the first MiB
    else:
        _scale_one_layer(shard, 1.01)
        assert _last_tensor(shard)[1] > pretrained.IDENTITY_SAMPLE
    with _engine(path, str(tmp_path / "s1")) as eng:
        with pytest.raises(CheckpointError, match=r"other base weights.*tensor\(s\) differ.*e\.g\. '") as info:
            eng.load_checkpoint(str(tmp_path / "ckpt"))
        assert "\n" not in str(info.value)
        assert eng.global_steps == 0  # nothing was loaded


def test_a_lora_checkpoint_over_the_unchanged_base_resumes_bit_exact_and_a_version_3_one_loads_with_a_warning(
        model_dirs, tmp_path, caplog):
    path = model_dirs["llama"]
    with _engine(path, str(tmp_path / "s0")) as eng:
        straight = _train_engine(eng, 4)
    with _engine(path, str(tmp_path / "s1")) as eng:
        _train_engine(eng, 2)
        saved = eng.save_checkpoint(str(tmp_path / "ckpt"), by_reference=False)  # rewritten as version 3 below
    with _engine(path, str(tmp_path / "s2")) as eng:
        eng.load_checkpoint(str(tmp_path / "ckpt"))
        assert _train_engine(eng, 2, start=2) == straight[2:]

    def as_version_3(meta):
        meta["version"] = 3
        meta["base"].pop("tensors")

    _rewrite_meta(saved, as_version_3)
    with _engine(path, str(tmp_path / "s3")) as eng:
        caplog.clear()
        eng.load_checkpoint(str(tmp_path / "ckpt"))
        assert any("version 3" in r.message and "first MiB only" in r.message for r in caplog.records)
        assert _train_engine(eng, 2, start=2) == straight[2:]


@pytest.mark.parametrize("change, needle", [
    ({"r": 4}, "adapter 'default' r 4 here, 8 then"),
    ({"target_modules": ["q_proj", "k_proj", "v_proj"]},
     "adapter 'default' target_modules ['k_proj', 'q_proj', 'v_proj'] here, ['q_proj', 'v_proj'] then"),
])
def test_a_lora_resume_with_another_rank_or_targets_gets_the_adapter_message(change, needle, model_dirs, tmp_path):
    """Another rank or other targets change the shards too: the adapters' config is checked first,
    so the message names it, not "a different model/partition"."""
    from pyinfinity.checkpoint import CheckpointError

    path = model_dirs["llama"]
    with _engine(path, str(tmp_path / "s0")) as eng:
        _train_engine(eng, 1)
        eng.save_checkpoint(str(tmp_path / "ckpt"))
    with pyinfinity.from_pretrained(path, _config(str(tmp_path / "s1")), peft_config=_lora(**change)) as eng:
        with pytest.raises(CheckpointError, match="trained its adapters with another config") as info:
            eng.load_checkpoint(str(tmp_path / "ckpt"))
        assert needle in str(info.value) and "partition" not in str(info.value)


def _rewrite_meta(saved: str, change) -> None:
    """meta.json edited by ``change`` and checksums.json made to match it (as an older writer made it)."""
    from pyinfinity import checkpoint

    with open(os.path.join(saved, "meta.json")) as f:
        meta = json.load(f)
    change(meta)
    data = json.dumps(meta).encode()
    with open(os.path.join(saved, "meta.json"), "wb") as f:
        f.write(data)
    with open(os.path.join(saved, checkpoint.CHECKSUMS_NAME)) as f:
        sums = json.load(f)
    sums["files"]["meta.json"] = {"nbytes": len(data), "crc32c": checkpoint._crc32c_bytes(data)}
    with open(os.path.join(saved, checkpoint.CHECKSUMS_NAME), "w") as f:
        json.dump(sums, f)


def test_a_lora_checkpoint_refuses_another_adapter_config(model_dirs, tmp_path):
    """lora_alpha (or dropout, rslora) changes no shard, only what trains: a resume under another
    value is refused in one line naming it. A checkpoint written before the adapters' config was
    recorded loads as before."""
    from pyinfinity.checkpoint import CheckpointError

    path = model_dirs["llama"]
    with _engine(path, str(tmp_path / "s0")) as eng:
        _train_engine(eng, 1)
        saved = eng.save_checkpoint(str(tmp_path / "ckpt"))
    with open(os.path.join(saved, "meta.json")) as f:
        assert json.load(f)["base"]["adapters"]["default"]["lora_alpha"] == 8
    with pyinfinity.from_pretrained(path, _config(str(tmp_path / "s1")), peft_config=_lora(lora_alpha=32)) as eng:
        with pytest.raises(CheckpointError) as info:
            eng.load_checkpoint(str(tmp_path / "ckpt"))
        assert "\n" not in str(info.value) and "adapter 'default' lora_alpha 32 here, 8 then" in str(info.value)
        assert _train_engine(eng, 1)  # nothing was loaded
    _rewrite_meta(saved, lambda meta: meta["base"].pop("adapters"))
    with _engine(path, str(tmp_path / "s2")) as eng:
        eng.load_checkpoint(str(tmp_path / "ckpt"))


def test_a_version_2_lora_checkpoint_with_the_base_still_loads(model_dirs, tmp_path):
    from pyinfinity import checkpoint

    path = model_dirs["llama"]
    with _engine(path, str(tmp_path / "s0")) as eng:
        _train_engine(eng, 2)
        want = _eval_logits(eng)
        saved = checkpoint.save(eng.state, str(tmp_path / "ckpt"), by_reference=False)  # as version 2 wrote it: every shard
    with open(os.path.join(saved, "meta.json")) as f:
        meta = json.load(f)
    assert "base" not in meta and "param" in {e["kind"] for e in meta["entries"]}
    meta["version"] = 2
    data = json.dumps(meta).encode()
    with open(os.path.join(saved, "meta.json"), "wb") as f:
        f.write(data)
    with open(os.path.join(saved, checkpoint.CHECKSUMS_NAME)) as f:
        sums = json.load(f)
    sums["version"] = 2
    sums["files"]["meta.json"] = {"nbytes": len(data), "crc32c": checkpoint._crc32c_bytes(data)}
    with open(os.path.join(saved, checkpoint.CHECKSUMS_NAME), "w") as f:
        json.dump(sums, f)
    with _engine(path, str(tmp_path / "s1")) as eng:
        eng.load_checkpoint(str(tmp_path / "ckpt"))
        torch.testing.assert_close(_eval_logits(eng), want, rtol=0, atol=0)


# ---------------------------------------------------------------------------- the planner
PLAN_MODEL = {"model_type": "llama", "vocab_size": 1000, "hidden_size": 256, "intermediate_size": 512,
              "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2}


def _plan(tmp_path, *extra: str) -> dict:
    cfg, out = tmp_path / "model.json", tmp_path / f"plan{len(extra)}.json"
    cfg.write_text(json.dumps(PLAN_MODEL))
    p = _cli("plan", "--model", str(cfg), "--device", "cpu", "--calibrate", "off", "--cpu-memory", "8GiB",
             "--json", str(out), "-o", str(tmp_path / "cfg.json"), *extra)
    assert p.returncode == 0, p.stderr[-3000:]
    return json.loads(out.read_text())["placement"]


def test_plan_lora_charges_gradients_and_optimizer_for_the_adapters_only(tmp_path):
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        base = AutoModelForCausalLM.from_config(AutoConfig.for_model(**PLAN_MODEL))
        n_base = sum(p.numel() for p in base.parameters())
        wrapped = peft.get_peft_model(base, peft.LoraConfig(r=8, target_modules=["q_proj", "v_proj"]))
    n_lora = sum(p.numel() for p in wrapped.parameters() if p.requires_grad)
    full = _plan(tmp_path)
    lora = _plan(tmp_path, "--lora", "8", "--lora-targets", "q_proj,v_proj")
    total = lambda share: sum(share.values())  # noqa: E731
    assert total(full["optimizer"]) == 12 * n_base  # fp32 master + two moments per parameter
    assert total(lora["optimizer"]) == 12 * n_lora
    assert total(lora["grads"]) <= 4 * n_lora  # a gradient buffer, if any, for the adapters alone
    assert total(lora["params"]) == 2 * n_base + 4 * n_lora  # the base stored in bf16, the adapters in fp32


def test_the_planner_counts_a_lora_model_in_each_shards_own_dtype():
    """The engine's planner sizes a LoRA run without a bf16 config (each parameter keeps its dtype):
    the frozen bf16 base at 2 bytes a parameter, the fp32 adapters at 4; their gradients and state
    at the adapters' itemsize; activations in the base's dtype."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from pyinfinity.plan.sizes import sizes_from_module

    with torch.device("meta"):
        base = AutoModelForCausalLM.from_config(AutoConfig.for_model(**PLAN_MODEL)).to(torch.bfloat16)
        n_base = sum(p.numel() for p in base.parameters())
        wrapped = peft.get_peft_model(base, peft.LoraConfig(r=8, target_modules=["q_proj", "v_proj"]))
    n_lora = sum(p.numel() for p in wrapped.parameters() if p.requires_grad)
    s = sizes_from_module(wrapped)
    assert s.param_bytes == 2 * n_base + 4 * n_lora and s.trainable_numel == n_lora
    assert (s.itemsize, s.act_itemsize, s.dtype) == (4, 2, None)
    assert s.largest_shard_bytes == 2 * max(s.shard_numels)  # a decoder layer's frozen bf16 shard
    assert s.activation_bytes(1, 64, False) == s.with_dtype("bf16").activation_bytes(1, 64, False)


@pytest.mark.parametrize("flags, needle", [
    (["--lora-targets", "q_proj"], "--lora-targets: needs --lora"),
    (["--lora", "8", "--measure", "3"], "--measure"),
    (["--lora", "0"], "--lora: 0 must be >= 1"),
])
def test_plan_bad_lora_flags_are_one_line(tmp_path, flags, needle):
    cfg = tmp_path / "model.json"
    cfg.write_text(json.dumps(PLAN_MODEL))
    p = _cli("plan", "--model", str(cfg), "--device", "cpu", *flags)
    lines = p.stderr.strip().splitlines()
    assert p.returncode == 2 and "Traceback" not in p.stderr and needle in lines[-1], p.stderr


def test_cli_lora_run_saves_and_resumes(model_dirs, data_file, tmp_path):
    path, ckpt = model_dirs["llama"], str(tmp_path / "ckpt")
    run = ["train", "--model", path, "--data", data_file, "--lora", "4", "--steps", "2", "--seq", "32", "--batch",
           "2", "--device", "cpu", "--offload", "nvme", "--nvme", str(tmp_path / "swap"), "--no-progress",
           "--save", ckpt]
    p = _cli(*run, "--stop-after", "1")
    assert p.returncode == 0, p.stderr[-3000:]
    with open(os.path.join(ckpt, "global_step1", "meta.json")) as f:
        assert "base" in json.load(f)
    p = _cli(*run, "--resume", ckpt, "--json", str(tmp_path / "run.json"))
    assert p.returncode == 0, p.stderr[-3000:]
    with open(tmp_path / "run.json") as f:
        summary = json.load(f)["summary"]
    assert (summary["steps"], summary["global_steps"]) == (1, 2)


def test_initialize_of_a_peft_model_with_weights_loads_the_base_and_refuses_meta_adapters(model_dirs, tmp_path):
    path = model_dirs["llama"]
    torch.manual_seed(5)
    ref = peft.get_peft_model(_base(path), _lora())
    torch.manual_seed(5)
    model = peft.get_peft_model(_base(path), _lora())  # real weights; the engine reloads the base from the file
    with pyinfinity.initialize(model, _config(str(tmp_path / "s0")), weights=path) as eng:
        losses = _train_engine(eng, 2)
    torch.testing.assert_close(losses, _train_reference(ref, 2), rtol=1e-5, atol=0)
    from pyinfinity.pretrained import build_empty_model

    empty = peft.get_peft_model(build_empty_model(path), _lora())
    with pytest.raises(AdapterError, match="meta device.*peft_config"):
        pyinfinity.initialize(empty, _config(str(tmp_path / "s1")), weights=path)


def test_initialize_reads_the_layers_peft_wrapped_from_the_checkpoint(model_dirs, tmp_path):
    """``initialize(peft_model, config, weights=DIR)`` reads every base weight from DIR, those of
    the layers PEFT wrapped too (``q_proj.base_layer.weight`` is the file's ``q_proj.weight``),
    whatever the user's model held: here zeros. Nothing is missing or unexpected, and a
    checkpoint of the run leaves the base out."""
    path = model_dirs["llama"]
    base = _base(path)
    with torch.no_grad():
        for p in base.parameters():
            p.zero_()
    model = peft.get_peft_model(base, _lora())
    x = _ids(4)
    with torch.no_grad():
        want = _base(path).eval()(input_ids=x).logits
    with pyinfinity.initialize(model, _config(str(tmp_path / "s0")), weights=path) as eng:
        assert eng.weights.report.missing == [] and eng.weights.report.unexpected == []
        eng.eval()
        with torch.no_grad():
            torch.testing.assert_close(eng(input_ids=x).logits, want, rtol=0, atol=0)  # B = 0: the base's
        eng.train()
        _train_engine(eng, 1)
        saved = eng.save_checkpoint(str(tmp_path / "ckpt"))
    with open(os.path.join(saved, "meta.json")) as f:
        assert {e["kind"] for e in json.load(f)["entries"]} == {"optim"}


def test_an_adapter_of_another_model_size_is_a_clear_error(model_dirs, tmp_path):
    bigger = make_model_dir(str(tmp_path / "bigger"), "llama", hidden=64)
    with pyinfinity.from_pretrained(bigger, _config(str(tmp_path / "s0")), peft_config=_lora()) as eng:
        eng.export(str(tmp_path / "adapter"))
    with pytest.raises(AdapterError, match="do not fit this model"):
        pyinfinity.from_pretrained(model_dirs["llama"], _config(str(tmp_path / "s1")), adapter=str(tmp_path / "adapter"))


# ---- on a GPU (the GPU suite: pytest -m gpu) -------------------------------------------------------------------


def _cuda_config(swap: str, cap: int) -> dict:
    cfg = _config(swap)
    cfg["zero_optimization"]["stage3_prefetch_bucket_size"] = 0
    cfg["pyinfinity"].update(device="cuda", device_memory=cap, unit_bytes=0)
    return cfg


def _release_cuda() -> None:
    """What earlier tests of this process left in torch's caching allocator counts against the
    per-process cap an engine sets: give it back first."""
    import gc

    gc.collect()
    torch.cuda.empty_cache()


@pytest.mark.gpu
def test_on_a_gpu_a_frozen_bf16_base_streams_under_a_budget_a_third_its_size_and_its_export_loads(tmp_path):
    """The LoRA path on CUDA: a bf16 base three times the device budget streams from NVMe one module
    at a time, the allocator's peak stays within the budget, and the exported adapter loaded into
    PEFT on the GPU gives the engine's logits. (Hidden 512: at a smaller width the activations of
    the 2 x 16 batch alone would take most of a third of the base.)"""
    src = make_model_dir(str(tmp_path / "fp32"), "llama", hidden=512, layers=6)
    path = str(tmp_path / "bf16")
    _base(src, dtype=torch.bfloat16).save_pretrained(path, safe_serialization=True)
    base_bytes = sum(p.numel() * 2 for n, p in _base(path).named_parameters())
    cap = base_bytes // 3
    _release_cuda()
    torch.cuda.reset_peak_memory_stats()
    start = torch.cuda.memory_allocated()
    torch.manual_seed(5)
    with pyinfinity.from_pretrained(path, _cuda_config(str(tmp_path / "swap"), cap), peft_config=_lora(r=4)) as eng:
        assert eng.device.type == "cuda" and eng.device.index is not None
        losses = _train_engine(eng, 3)
        assert max(r.peak_device_bytes for r in eng.history) <= cap
        logits = _eval_logits(eng).float().cpu()
        eng.export(str(tmp_path / "adapter"))
    assert all(torch.isfinite(torch.tensor(losses)))
    assert torch.cuda.max_memory_allocated() - start <= cap + (1 << 20)  # the budget, plus the batch and logits
    model = peft.PeftModel.from_pretrained(_base(path).cuda(), str(tmp_path / "adapter")).eval()
    with torch.no_grad():
        ref = model(input_ids=_ids(99).cuda()).logits.float().cpu()
    torch.testing.assert_close(logits, ref, rtol=2e-2, atol=2e-2)  # bf16 base: the same kernels, one rounding


@pytest.mark.gpu
def test_on_a_gpu_lora_trains_with_peft_s_losses(model_dirs, tmp_path):
    """fp32 base, the same adapters (same seed): the engine on CUDA with parameters on NVMe and
    PEFT + torch AdamW on CUDA give the same losses. The engine runs first: its device budget is
    the process's, and a reference model already on the GPU would count against it."""
    path = model_dirs["llama"]
    _release_cuda()
    torch.manual_seed(7)
    with pyinfinity.from_pretrained(path, _cuda_config(str(tmp_path / "swap"), 256 << 20),
                                    peft_config=_lora()) as eng:
        losses = _train_engine(eng)
    torch.manual_seed(7)
    ref = peft.get_peft_model(_base(path), _lora()).cuda()
    torch.testing.assert_close(losses, _train_reference(ref, STEPS, "cuda"), rtol=1e-4, atol=0)


@pytest.mark.gpu
def test_on_a_gpu_the_cli_trains_lora_and_its_export_loads(model_dirs, data_file, tmp_path):
    path, out = model_dirs["llama"], str(tmp_path / "out")
    p = _cli("train", "--model", path, "--data", data_file, "--lora", "4", "--steps", "3", "--seq", "32", "--batch",
             "2", "--device", "cuda", "--gpu-memory", "256MiB", "--offload", "cpu", "--no-progress", "--export", out)
    assert p.returncode == 0, p.stderr[-3000:]
    assert "cuda:" in p.stdout + p.stderr
    model = peft.PeftModel.from_pretrained(_base(path).cuda(), out)
    assert all(t.is_cuda for t in model.parameters())


def test_plan_places_a_70b_lora_base_on_100gib_of_ram_and_a_64gib_disk(tmp_path):
    """The Llama-2-70B preset with r = 16 adapters on an 8 GiB GPU, 100 GiB of RAM and a 64 GiB
    disk: its 138 GB bf16 base does not fit the RAM, so the plan splits it between RAM and the disk
    (at 2 bytes a frozen parameter: no gradient, master or optimizer state for it), within both,
    and predicts a step."""
    out = tmp_path / "p70.json"
    swap = tmp_path / "swap"
    swap.mkdir()
    p = _cli("plan", "--model-size", "70b", "--lora", "16", "--lora-targets", "q_proj,k_proj,v_proj,o_proj",
             "--gpu-memory", "8GiB", "--cpu-memory", "100GiB", "--nvme", str(swap), "--nvme-free", "64GiB",
             "--micro-batch", "1", "--seq-len", "1024", "--checkpointing", "--link", "h200-sxm", "--tflops", "680",
             "--disk", "nvme-gen4", "--json", str(out))
    assert p.returncode == 0, p.stderr[-3000:]
    plan = json.loads(out.read_text())
    params, optim = plan["placement"]["params"], plan["placement"]["optimizer"]
    base = 69_000_000_000 * 2
    assert params["ram"] > 0.5 * base and params["disk"] > 0.1 * base, params
    assert params["ram"] + params["disk"] + params["device"] >= base
    assert params["ram"] + optim["ram"] <= 100 << 30 and params["disk"] + optim["disk"] <= 64 << 30
    assert sum(optim.values()) < 1 << 30  # the adapters' state alone
    assert plan["placement"]["predicted"]["total"] > 0
    assert "parameters split" in p.stdout + p.stderr


def test_plan_with_more_device_memory_is_never_predicted_slower(tmp_path):
    """Each NVMe read in flight holds a pinned staging buffer of the largest shard in RAM: sized by a
    16 GiB GPU's deep prefetch (five 1.7 GB buffers), they pushed 8 GB more of the 70B base onto the
    disk, read twice a step, and the plan with twice the device memory was predicted slower than
    with 8 GiB. The planner also weighs a one-shard prefetch with two reads in flight."""
    swap = tmp_path / "swap"
    swap.mkdir()
    plans = {}
    # one unit size for both (the "auto" one follows the device budget): the same shards, so the
    # disk's share shows the staging's effect alone
    units = tmp_path / "units.json"
    units.write_text(json.dumps({"pyinfinity": {"unit_bytes": "1GiB"}}))
    for gpu in ("8GiB", "16GiB"):
        out = tmp_path / f"p{gpu}.json"
        p = _cli("plan", "--config", str(units), "--model-size", "70b", "--lora", "16",
                 "--lora-targets", "q_proj,k_proj,v_proj,o_proj",
                 "--gpu-memory", gpu, "--cpu-memory", "100GiB", "--nvme", str(swap), "--nvme-free", "64GiB",
                 "--micro-batch", "1", "--seq-len", "1024", "--checkpointing", "--link", "h200-sxm", "--tflops",
                 "680", "--disk", "nvme-gen4", "--json", str(out))
        assert p.returncode == 0, p.stderr[-3000:]
        plans[gpu] = json.loads(out.read_text())
    small, big = (plans[g]["placement"] for g in ("8GiB", "16GiB"))
    assert big["predicted"]["total"] <= small["predicted"]["total"], (small["predicted"], big["predicted"])
    assert big["params"]["disk"] <= small["params"]["disk"], (small["params"], big["params"])
