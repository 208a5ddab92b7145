"""Pretrained weights streamed from sharded safetensors into every tier: logits equal to
transformers' own from_pretrained, fine-tuning matches plain torch, export round-trips with the
tokenizer, peak RSS bounded on a checkpoint larger than the host budget, and every bad input is a
clear error that leaves nothing in the swap directory."""
from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import textwrap

import pytest
import torch

import pyinfinity
from pyinfinity.pretrained import WeightsError

sys.path.insert(0, os.path.dirname(__file__))
from pretrained_dirs import make_model_dir  # noqa: E402


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    return {f: make_model_dir(str(root / f), f) for f in ("llama", "gpt2")}


def _config(tier: str, swap: str, **over) -> dict:
    op = {"none": "none", "cpu": "cpu", "nvme": "nvme", "split": "nvme"}[tier]
    cfg = {
        "train_micro_batch_size_per_gpu": 2,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.01}},
        "zero_optimization": {
            "stage": 3,
            "offload_param": {"device": op, "nvme_path": swap, "max_in_cpu": 3000 if tier == "split" else 0},
            "offload_optimizer": {"device": "nvme" if op == "nvme" else "cpu", "nvme_path": swap},
            "stage3_param_persistence_threshold": 0,
            "stage3_prefetch_bucket_size": 1 << 20,
        },
        "pyinfinity": {"device": "cpu", "device_memory": "64MiB"},
    }
    cfg.update(over)
    return cfg


def _plain(path: str):
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(path, local_files_only=True)
    return m.eval()


def _ids(n: int = 2, seq: int = 16, seed: int = 0) -> torch.Tensor:
    return torch.randint(2, 300, (n, seq), generator=torch.Generator().manual_seed(seed))


def _swap_files(swap: str) -> list[str]:
    return [os.path.join(d, f) for d, _, fs in os.walk(swap) for f in fs] if os.path.exists(swap) else []


@pytest.mark.parametrize("family", ["llama", "gpt2"])
@pytest.mark.parametrize("tier", ["none", "cpu", "nvme", "split"])
def test_logits_equal_transformers_from_pretrained(family, tier, model_dirs, tmp_path, caplog):
    path = model_dirs[family]
    x = _ids()
    with torch.no_grad():
        want = _plain(path)(input_ids=x).logits
    with caplog.at_level(logging.WARNING, logger="pyinfinity.pretrained"):
        eng = pyinfinity.from_pretrained(path, _config(tier, str(tmp_path / "swap")))
    with eng:
        assert not [r for r in caplog.records if "Some weights" in r.getMessage()]  # nothing missing/unexpected
        assert eng.weights.report.loaded == len(eng.weights.tensors)
        tiers = {sh.home.tier.value for sh in eng.partition.shards}
        assert tiers == {"none": {"gpu"}, "cpu": {"cpu"}, "nvme": {"nvme"}, "split": {"cpu", "nvme"}}[tier]
        if family == "gpt2":  # tied: one parameter, loaded from the embedding's key
            assert eng.module.lm_head.weight is eng.module.transformer.wte.weight
        eng.eval()
        with torch.no_grad():
            got = eng(input_ids=x).logits
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_bf16_logits_within_rounding(model_dirs, tmp_path):
    path = model_dirs["llama"]
    x = _ids()
    with torch.no_grad():
        want = _plain(path).to(torch.bfloat16)(input_ids=x).logits.float()
    with pyinfinity.from_pretrained(path, _config("nvme", str(tmp_path / "swap"), bf16={"enabled": True})) as eng:
        assert {sh.dtype for sh in eng.partition.shards} == {torch.bfloat16}
        eng.eval()
        with torch.no_grad():
            got = eng(input_ids=x).logits.float()
    torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2)


def test_weights_into_a_model_built_under_init_empty(model_dirs, tmp_path):
    """initialize(model, config, weights=path) for a model the user built; a real (non-meta) model
    gets its values overwritten too."""
    from transformers import AutoConfig, AutoModelForCausalLM

    path = model_dirs["gpt2"]
    x = _ids()
    with torch.no_grad():
        want = _plain(path)(input_ids=x).logits
    mcfg = AutoConfig.from_pretrained(path)
    with pyinfinity.init_empty():
        empty = AutoModelForCausalLM.from_config(mcfg)
    torch.manual_seed(1)
    real = AutoModelForCausalLM.from_config(mcfg)
    for i, model in enumerate((empty, real)):
        with pyinfinity.initialize(model, _config("cpu", str(tmp_path / f"swap{i}")), weights=path) as eng:
            eng.eval()
            with torch.no_grad():
                torch.testing.assert_close(eng(input_ids=x).logits, want, rtol=0, atol=0)


def test_finetune_20_steps_matches_torch_and_exports(model_dirs, tmp_path):
    """20 AdamW steps from the checkpoint, parameters and optimizer states on nvme: the losses of
    plain torch on transformers' own from_pretrained model; the export loads with its tokenizer."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = model_dirs["llama"]
    ref = _plain(path).train()
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3, weight_decay=0.01)
    batches = [_ids(seed=i) for i in range(20)]
    losses, ref_losses = [], []
    with pyinfinity.from_pretrained(path, _config("nvme", str(tmp_path / "swap"))) as eng:
        eng.train()
        for x in batches:
            out = eng(input_ids=x, labels=x)
            eng.backward(out.loss)
            eng.step()
            losses.append(out.loss.item())
            rl = ref(input_ids=x, labels=x).loss
            rl.backward()
            ref_opt.step()
            ref_opt.zero_grad()
            ref_losses.append(rl.item())
        files = eng.export(str(tmp_path / "out"))
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=0)
    assert losses[-1] < losses[0]
    assert any(f.endswith("tokenizer.json") for f in files)
    plain = AutoModelForCausalLM.from_pretrained(str(tmp_path / "out"), local_files_only=True).eval()
    tok = AutoTokenizer.from_pretrained(str(tmp_path / "out"), local_files_only=True)
    assert tok("def decode(self, s):")["input_ids"] == AutoTokenizer.from_pretrained(path)("def decode(self, s):")[
        "input_ids"]
    with torch.no_grad():
        torch.testing.assert_close(plain(input_ids=batches[0]).logits, ref.eval()(input_ids=batches[0]).logits,
                                   rtol=1e-5, atol=1e-5)


def test_missing_and_unexpected_keys_are_reported(model_dirs, tmp_path, caplog):
    """A key the file lacks (with an initializer) is newly initialised and listed; a key the model
    does not use is listed; both as a warning, as transformers' from_pretrained does."""
    from safetensors.torch import load_file, save_file

    src = model_dirs["llama"]
    d = tmp_path / "m"
    d.mkdir()
    for f in os.listdir(src):
        if not f.endswith(".safetensors"):
            (d / f).write_bytes(open(os.path.join(src, f), "rb").read())
    index = json.loads((d / "model.safetensors.index.json").read_text())
    wm = index["weight_map"]
    for fname in set(wm.values()):
        t = load_file(os.path.join(src, fname))
        if fname == wm["model.norm.weight"]:  # the final norm's weight replaced by a key the model lacks
            del t["model.norm.weight"]
            t["extra.bias"] = torch.zeros(3)
        save_file(t, str(d / fname), metadata={"format": "pt"})
    wm["extra.bias"] = wm.pop("model.norm.weight")
    (d / "model.safetensors.index.json").write_text(json.dumps(index))
    with caplog.at_level(logging.WARNING, logger="pyinfinity.pretrained"):
        with pyinfinity.from_pretrained(str(d), _config("cpu", str(tmp_path / "swap"))) as eng:
            assert eng.weights.report.missing == ["model.norm.weight"]
            assert eng.weights.report.unexpected == ["extra.bias"]
            sh, sl = eng.partition.param_slice[id(eng.module.model.norm.weight)]
            assert torch.equal(eng.state.trained_values(sh)[sl.offset:sl.offset + sl.numel], torch.ones(32))  # RMSNorm init
    text = caplog.text
    assert "were not used" in text and "extra.bias" in text
    assert "newly initialized" in text and "model.norm.weight" in text


# ----------------------------------------------------------------------------------- bad input


def _copy_dir(src: str, dst) -> str:
    dst.mkdir()
    for f in os.listdir(src):
        (dst / f).write_bytes(open(os.path.join(src, f), "rb").read())
    return str(dst)


def _first_shard(d: str) -> str:
    return os.path.join(d, "model-00001-of-00004.safetensors")


def _break_missing_shard(d: str) -> tuple[type, str]:
    os.remove(_first_shard(d))
    return FileNotFoundError, "model-00001-of-00004.safetensors"


def _break_truncated(d: str) -> tuple[type, str]:
    p = _first_shard(d)
    os.truncate(p, os.path.getsize(p) - 100)
    return WeightsError, "model-00001-of-00004.safetensors: the header describes"


def _break_shape(d: str) -> tuple[type, str]:
    from safetensors.torch import load_file, save_file

    p = _first_shard(d)
    t = load_file(p)
    key = sorted(t)[0]
    t[key] = t[key][..., :-1].contiguous()
    save_file(t, p, metadata={"format": "pt"})
    return WeightsError, f"model-00001-of-00004.safetensors: tensor {key!r} has shape"


def _break_config(d: str) -> tuple[type, str]:
    p = os.path.join(d, "config.json")
    cfg = json.load(open(p))
    cfg["intermediate_size"] = 48
    json.dump(cfg, open(p, "w"))
    return WeightsError, "model-00002-of-00004.safetensors: tensor 'model.layers.0.mlp.gate_proj.weight' has shape [64, 32] but the model's is [48, 32]"


def _break_architecture(d: str) -> tuple[type, str]:
    p = os.path.join(d, "config.json")
    cfg = json.load(open(p))
    cfg.update({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"], "n_embd": 32, "n_layer": 1,
                "n_head": 4})
    json.dump(cfg, open(p, "w"))
    return WeightsError, "are not in the checkpoint, whose tensors are named like"


def _rewrite_header(p: str, edit) -> None:
    """Rewrites a safetensors file's JSON header through ``edit(header)``; the data stays as it is."""
    import struct

    raw = open(p, "rb").read()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n])
    edit(header)
    new = json.dumps(header).encode()
    open(p, "wb").write(struct.pack("<Q", len(new)) + new + raw[8 + n:])


def _tensors_by_offset(header: dict) -> list[str]:
    return sorted((k for k in header if k != "__metadata__"), key=lambda k: header[k]["data_offsets"][0])


def _break_dtype(d: str) -> tuple[type, str]:
    keys = []

    def edit(h):
        keys.append(_tensors_by_offset(h)[-1])
        h[keys[0]]["dtype"] = "F16"  # the bytes stay F32: twice what F16 needs
    _rewrite_header(_first_shard(d), edit)
    return WeightsError, f"model-00001-of-00004.safetensors: tensor {keys[0]!r} (F16, shape"


def _break_overlap(d: str) -> tuple[type, str]:
    keys = []
    index = json.load(open(os.path.join(d, "model.safetensors.index.json")))["weight_map"]
    fname = max(set(index.values()), key=lambda f: sum(1 for v in index.values() if v == f))  # >= 2 tensors

    def edit(h):
        keys.append(_tensors_by_offset(h)[1])
        h[keys[0]]["data_offsets"] = [v - 4 for v in h[keys[0]]["data_offsets"]]
    _rewrite_header(os.path.join(d, fname), edit)
    return WeightsError, f"{fname}: tensor {keys[0]!r}: data_offsets"


def _break_appended(d: str) -> tuple[type, str]:
    with open(_first_shard(d), "ab") as f:
        f.write(b"\0" * 16)
    return WeightsError, "16 more than the"


def _break_weight_map_value(d: str) -> tuple[type, str]:
    p = os.path.join(d, "model.safetensors.index.json")
    index = json.load(open(p))
    key = sorted(index["weight_map"])[0]
    index["weight_map"][key] = 3
    json.dump(index, open(p, "w"))
    return WeightsError, f"weight_map[{key!r}] is 3"


def _break_key_in_two_shards(d: str) -> tuple[type, str]:
    from safetensors.torch import load_file, save_file

    index = json.load(open(os.path.join(d, "model.safetensors.index.json")))["weight_map"]
    key = next(k for k, f in sorted(index.items()) if f == "model-00002-of-00004.safetensors")
    first = load_file(_first_shard(d))
    first[key] = load_file(os.path.join(d, "model-00002-of-00004.safetensors"))[key] + 1  # a second, different copy
    save_file(first, _first_shard(d), metadata={"format": "pt"})
    return WeightsError, (f"tensor {key!r} is in two shards, model-00001-of-00004.safetensors and "
                          "model-00002-of-00004.safetensors")


@pytest.mark.parametrize("breaker", [_break_missing_shard, _break_truncated, _break_shape, _break_config,
                                     _break_architecture, _break_dtype, _break_overlap, _break_appended,
                                     _break_weight_map_value, _break_key_in_two_shards])
def test_bad_checkpoint_is_a_clear_error_and_nothing_is_written(breaker, model_dirs, tmp_path):
    d = _copy_dir(model_dirs["llama"], tmp_path / "m")
    exc_type, fragment = breaker(d)
    swap = str(tmp_path / "swap")
    with pytest.raises(exc_type) as ei:
        pyinfinity.from_pretrained(d, _config("nvme", swap))
    assert fragment in str(ei.value)
    assert _swap_files(swap) == []


def test_a_read_failure_during_the_load_removes_the_swap_files(model_dirs, tmp_path, monkeypatch):
    """A tensor that cannot be read halfway through (the file changed after the check): the error
    names file and key, and the partly placed shards are removed."""
    from pyinfinity import pretrained

    calls = {"n": 0}
    orig = pretrained.WeightLoader._read

    def flaky(self, params, buffers):
        calls["n"] += 1
        if calls["n"] == 4:
            raise WeightsError(f"{params[0][2].file}: reading {params[0][2].key!r} failed: injected")
        return orig(self, params, buffers)

    monkeypatch.setattr(pretrained.WeightLoader, "_read", flaky)
    swap = str(tmp_path / "swap")
    with pytest.raises(WeightsError, match="injected"):
        pyinfinity.from_pretrained(model_dirs["llama"], _config("nvme", swap))
    assert calls["n"] == 4
    assert _swap_files(swap) == []


# ----------------------------------------------------------------------------------- host memory

_RSS_SCRIPT = textwrap.dedent("""
    import json, os, sys
    import pyinfinity
    import pyinfinity.pretrained

    def hwm():
        for line in open("/proc/self/status"):
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024

    path, swap = sys.argv[1], sys.argv[2]
    cfg = {"train_micro_batch_size_per_gpu": 1,
           "zero_optimization": {"stage": 3, "offload_param": {"device": "nvme", "nvme_path": swap, "max_in_cpu": 0},
                                 "offload_optimizer": {"device": "nvme", "nvme_path": swap}},
           "pyinfinity": {"device": "cpu", "device_memory": "64MiB"}}
    model = pyinfinity.pretrained.build_empty_model(path, cfg)
    model.requires_grad_(False)  # loading is measured: no optimizer state
    base = hwm()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM to the current RSS
    eng = pyinfinity.initialize(model, cfg, weights=path)
    peak = hwm()
    print(json.dumps({"base": base, "peak": peak, "param_bytes": eng.partition.nbytes,
                      "largest_module": eng.partition.largest_module_bytes(),
                      "tiers": sorted({sh.home.tier.value for sh in eng.partition.shards})}))
    eng.close()
""")


def test_peak_rss_while_loading_a_checkpoint_larger_than_ram_held(tmp_path):
    """~290 MiB of weights in 6 shards, parameters on nvme: loading grows the peak RSS by less than
    3x the largest module (the tensor read, the parameter, the flat shard) + 64 MiB, a quarter of
    the checkpoint at most (holding it would need all of it). Frozen, so that no optimizer state
    is written: the load alone is measured."""
    d = make_model_dir(str(tmp_path / "big"), "llama", hidden=1024, layers=8, shard="60MB")
    out = subprocess.run([sys.executable, "-c", _RSS_SCRIPT, d, str(tmp_path / "swap")],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    r = json.loads(out.stdout.strip().splitlines()[-1])
    grown = r["peak"] - r["base"]
    assert r["tiers"] == ["nvme"]
    bound = 3 * r["largest_module"] + (64 << 20)
    assert grown < bound, (grown / 2**20, bound / 2**20, r)
    assert grown < r["param_bytes"] / 4, (grown / 2**20, r)


class _Scaled(torch.nn.Module):
    """A plain module with a parameter of its own and no initializer for it."""

    def __init__(self) -> None:
        super().__init__()
        self.gain = torch.nn.Parameter(torch.ones(4))
        self.lin = torch.nn.Linear(4, 4)
        self.register_buffer("offset", torch.zeros(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) * self.gain + self.offset


def test_plain_module_from_one_file_and_a_missing_key_without_initializer(tmp_path):
    """A single .safetensors file into a plain nn.Module (buffers loaded too); a parameter the file
    lacks and nothing can initialise is an error naming the key."""
    from safetensors.torch import save_file

    torch.manual_seed(0)
    src = _Scaled()
    with torch.no_grad():
        src.gain.uniform_()
        src.offset.fill_(0.5)
    save_file({k: v.contiguous() for k, v in src.state_dict().items()}, str(tmp_path / "w.safetensors"))
    x = torch.randn(3, 4)
    with pyinfinity.init_empty():
        model = _Scaled()
    with pyinfinity.initialize(model, _config("cpu", str(tmp_path / "swap")), weights=tmp_path / "w.safetensors") as e:
        assert torch.equal(model.offset, src.offset)
        with torch.no_grad():
            torch.testing.assert_close(e(x), src(x), rtol=0, atol=0)
    save_file({k: v.contiguous() for k, v in src.state_dict().items() if k != "gain"}, str(tmp_path / "v.safetensors"))
    with pyinfinity.init_empty():
        model = _Scaled()
    with pytest.raises(WeightsError, match=r"v.safetensors: no tensor 'gain' in the checkpoint, and _Scaled \(<root>\) "
                                           r"has no initializer"):
        pyinfinity.initialize(model, _config("cpu", str(tmp_path / "swap")), weights=tmp_path / "v.safetensors")


def test_tied_embeddings_with_a_different_lm_head_in_the_files_are_untied_as_transformers_does(model_dirs, tmp_path,
                                                                                                caplog):
    """config.json says tie_word_embeddings, but the files hold an lm_head.weight that differs from
    the embedding: transformers warns and does not tie (the file's lm_head is used); so does
    pyinfinity, with the same logits."""
    d = _copy_dir(model_dirs["llama"], tmp_path / "m")
    p = os.path.join(d, "config.json")
    cfg = json.load(open(p))
    cfg["tie_word_embeddings"] = True
    json.dump(cfg, open(p, "w"))
    x = _ids()
    plain = _plain(d)
    assert plain.lm_head.weight is not plain.model.embed_tokens.weight  # transformers did not tie them
    with torch.no_grad():
        want = plain(input_ids=x).logits
    with caplog.at_level(logging.WARNING, logger="pyinfinity.pretrained"):
        eng = pyinfinity.from_pretrained(d, _config("nvme", str(tmp_path / "swap")))
    with eng:
        assert "NOT tied" in caplog.text and "lm_head.weight" in caplog.text
        assert eng.module.lm_head.weight is not eng.module.model.embed_tokens.weight
        assert eng.weights.report.loaded == len(eng.weights.tensors)
        eng.eval()
        with torch.no_grad():
            got = eng(input_ids=x).logits
    torch.testing.assert_close(got, want, rtol=0, atol=0)
