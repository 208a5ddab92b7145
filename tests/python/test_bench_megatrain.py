"""MegaTrain as a system of `pyinfinity bench train`: what the run writes for its training script
(model directory, tokenizer, arrow dataset, YAML recipe), how its log is read, and the row of a
run without its source. The run itself needs a CUDA device and a MegaTrain checkout (the test
marked gpu; BENCHMARKS.md names the command)."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
import yaml

from pyinfinity.bench import megatrain as mt
from pyinfinity.bench import train as bt
from pyinfinity.bench.train_matrix import model_fields
from pyinfinity.bench.train_worker import _batches, token_rows

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _spec(tmp_path, **kw):
    spec = {"system": "megatrain", "size": "micro", "model": model_fields("micro", 16), "device": "cuda:0",
            "dtype": "bf16", "batch": 2, "seq": 16, "grad_accum": 2, "steps": 3, "warmup": 1, "seed": 0,
            "variant": {}, "nvme_dir": str(tmp_path), "timeout": 600, "megatrain_src": None}
    spec.update(kw)
    return spec


# ----------------------------------------------------------------------------------- what it reads


def test_the_model_directory_loads_with_transformers_with_the_presets_parameter_count(tmp_path):
    from transformers import LlamaForCausalLM

    from pyinfinity.plan.sizes import llama_sizes

    fields = model_fields("micro", 64)
    out = str(tmp_path / "model")
    n = mt.write_model_dir(fields, out, seed=1, shard_bytes=100_000)  # several shards
    shards = sorted(f for f in os.listdir(out) if f.endswith(".safetensors"))
    assert len(shards) > 1
    index = json.load(open(os.path.join(out, "model.safetensors.index.json")))
    assert sorted(set(index["weight_map"].values())) == shards
    model = LlamaForCausalLM.from_pretrained(out)
    expected = llama_sizes(dict(fields, model_type="llama"), dtype="bf16").numel
    assert n == expected == sum(p.numel() for p in model.parameters())
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert model.config.num_hidden_layers == fields["num_hidden_layers"]
    assert model.config.vocab_size == fields["vocab_size"]
    assert torch.equal(model.model.norm.weight, torch.ones_like(model.model.norm.weight))
    w = model.model.layers[0].mlp.up_proj.weight.detach().float()
    assert 0.015 < float(w.std()) < 0.025  # the config's initializer_range, not zeros or garbage


def test_the_dataset_holds_the_bench_tokens_and_tokenizes_back_to_them_as_megatrain_reads_it(tmp_path):
    """MegaTrain's dataset class renders a sample (an empty query, the response) with the tokenizer's
    chat template, tokenizes it padded and truncated to the sequence length without special tokens,
    and masks the prompt's tokens: the ids must be the bench's, every one of them trained on."""
    from datasets import load_from_disk
    from transformers import AutoTokenizer

    spec = _spec(tmp_path)
    rows = token_rows(spec)
    assert torch.equal(rows, torch.cat(_batches(spec, 6)))  # the stream every other system trains on
    assert rows.shape == (3 * 2 * 2, 16)
    model_dir, data_dir = str(tmp_path / "model"), str(tmp_path / "data")
    mt.write_tokenizer(model_dir, spec["model"]["vocab_size"])
    assert mt.write_dataset(data_dir, rows) == 3 * 2 * 2 * 16
    ds = load_from_disk(data_dir)
    assert len(ds) == 12 and set(ds.column_names) == {"query", "response"}
    tok = AutoTokenizer.from_pretrained(model_dir)
    seq = spec["seq"]
    for i, sample in enumerate(ds):
        messages = [{"role": "user", "content": sample["query"]}, {"role": "assistant", "content": sample["response"]}]
        text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=False)
        enc = tok(text, max_length=seq, truncation=True, padding="max_length", return_tensors="pt",
                  add_special_tokens=False)
        assert enc["input_ids"][0].tolist() == rows[i].tolist()
        assert int(enc["attention_mask"].sum()) == seq  # no padding
        prompt = tok.apply_chat_template(messages[:1], tokenize=False, add_generation_prompt=True)
        penc = tok(prompt, max_length=seq, truncation=True, padding="max_length", return_tensors="pt",
                   add_special_tokens=False)
        assert int(penc["attention_mask"].sum()) == 0  # no prompt token masked out of the loss


def test_the_yaml_recipe_is_megatrains_8b_recipe_at_the_runs_shape(tmp_path):
    # its own shape: 148 x 1024 tokens in one batch
    cfg = mt.megatrain_config(_spec(tmp_path, batch=148, seq=1024, grad_accum=1, steps=5), "/m", "/d")
    assert cfg["training"]["batch_size"] == 148 and cfg["training"]["gradient_accumulation_steps"] == 1
    assert cfg["training"]["num_steps"] == 5 and cfg["training"]["learning_rate"] == 2.0e-5
    assert cfg["memory"]["checkpoint_interval"] == 4 and cfg["optimizer"]["type"] == "deepspeed_adam"
    assert cfg["model"] == {"name": "/m", "dtype": "bfloat16", "device": 0, "attn_implementation": "sdpa",
                            "trust_remote_code": False}
    assert cfg["dataset"]["path"] == "/d" and cfg["dataset"]["max_seq_len"] == 1024
    # 64k tokens a step given as 4 x 16 micro-batches: one batch of 64 (fewer tokens than its recipe's)
    cfg = mt.megatrain_config(_spec(tmp_path, batch=4, seq=1024, grad_accum=16, steps=3, device="cuda:1"))
    assert (cfg["training"]["batch_size"], cfg["training"]["gradient_accumulation_steps"]) == (64, 1)
    assert cfg["model"]["device"] == 1
    # more tokens than its recipe's batch: its own accumulation, batches that divide the step
    cfg = mt.megatrain_config(_spec(tmp_path, batch=8, seq=4096, grad_accum=8, steps=3))
    assert (cfg["training"]["batch_size"], cfg["training"]["gradient_accumulation_steps"]) == (32, 2)
    assert cfg["training"]["num_steps"] == 6
    # a variant sets a key of the recipe; the YAML is what its loader reads
    spec = _spec(tmp_path, variant={"memory.checkpoint_interval": 2, "training.batch_size": 2,
                                    "training.gradient_accumulation_steps": 2})
    cfg = mt.megatrain_config(spec)
    assert cfg["memory"]["checkpoint_interval"] == 2 and cfg["training"]["num_steps"] == 6
    assert yaml.safe_load(yaml.safe_dump(cfg)) == cfg
    with pytest.raises(ValueError, match="memory.bogus: not a key of MegaTrain's recipe"):
        mt.megatrain_config(_spec(tmp_path, variant={"memory.bogus": 1}))
    with pytest.raises(ValueError, match="is not the run's 4 sequences a step"):
        mt.megatrain_config(_spec(tmp_path, variant={"training.batch_size": 3}))


def test_a_bad_megatrain_variant_is_refused_before_anything_runs(tmp_path):
    assert bt.parse_system("megatrain[memory.checkpoint_interval=2]").variant == (("memory.checkpoint_interval", 2),)
    s = bt.Settings(sizes=["micro"], systems=["megatrain[memory.bogus=1]"], nvme_dir=str(tmp_path), dtype="bf16")
    with pytest.raises(bt.BenchTrainError, match=r"--systems megatrain\[memory.bogus=1\]: memory.bogus"):
        bt.check_configs(s, model_fields("micro", 1024), "cuda:0", "bf16", True)


# ----------------------------------------------------------------------------------- its log

# the lines its training script logs (logging's "%(asctime)s [%(levelname)s] %(message)s")
SAMPLE_LOG = """\
10:00:01 [INFO] Model loaded. Attention implementation: sdpa
10:00:02 [INFO] Using DeepSpeed CPUAdam optimizer (SIMD-accelerated)
10:00:05 [INFO] Step 1/4 | Loss 11.0312 | Avg 11.0312
10:00:05 [INFO]   Time: 3.02s | Tokens/s 1356.3 | TFLOPS 98.7
10:00:05 [INFO]   FWD: 1.00s | BWD: 1.90s
10:00:05 [INFO]   GPU: 20.50GB peak (alloc 3.10GB / reserved 22.00GB)
10:00:05 [INFO]   CPU: 40.25GB
10:00:07 [INFO] Step 2/4 | Loss 10.9000 | Avg 10.9656
10:00:07 [INFO]   Time: 2.00s | Tokens/s 2048.0 | TFLOPS 150.0
10:00:07 [INFO]   FWD: 0.70s | BWD: 1.20s
10:00:07 [INFO]   GPU: 21.00GB peak (alloc 3.10GB / reserved 22.00GB)
10:00:07 [INFO]   CPU: 41.00GB
10:00:09 [INFO] Step 3/4 | Loss 10.5000 | Avg 10.8104
10:00:09 [INFO]   Time: 1.00s | Tokens/s 4000.0 | TFLOPS 300.0
10:00:09 [INFO]   GPU: 21.00GB peak (alloc 3.10GB / reserved 22.00GB)
10:00:09 [INFO]   CPU: 41.00GB
10:00:11 [INFO] Step 4/4 | Loss 10.1000 | Avg 10.6328
10:00:11 [INFO]   Time: 1.00s | Tokens/s 4096.0 | TFLOPS 310.0
10:00:11 [INFO]   GPU: 21.00GB peak (alloc 3.10GB / reserved 22.00GB)
10:00:11 [INFO]   CPU: 41.00GB
10:00:11 [INFO] Peak GPU: 21.25 GB
10:00:11 [INFO] Peak CPU: 41.00 GB
"""


def test_the_log_parser_reads_megatrains_step_lines():
    facts = mt.parse_log(SAMPLE_LOG.splitlines())
    assert [s.step for s in facts.steps] == [1, 2, 3, 4]
    assert facts.steps[0].loss == pytest.approx(11.0312) and facts.steps[0].seconds == pytest.approx(3.02)
    assert facts.steps[1].tokens_per_s == 2048.0 and facts.steps[1].tflops == 150.0
    assert facts.steps[1].peak_gpu_gib == 21.0 and facts.steps[1].rss_gib == 41.0
    assert facts.peak_gpu_gib == 21.25 and facts.optimizer == "deepspeed_adam" and facts.attention == "sdpa"
    assert facts.error is None
    # one batch a step: the seconds from tokens / tokens/s (finer than its 10 ms print)
    steps = mt.optimizer_steps(facts, 1, 4096)
    assert [s["seconds"] for s in steps] == pytest.approx([4096 / 1356.3, 2.0, 1.024, 1.0])
    # two batches an optimizer step: their seconds add, their losses and TFLOPS average
    steps = mt.optimizer_steps(facts, 2, 4096)
    assert len(steps) == 2 and steps[1]["seconds"] == pytest.approx(2.024)
    assert steps[1]["loss"] == pytest.approx(10.3) and steps[1]["megatrain_tflops"] == pytest.approx(305.0)


def test_the_log_parser_keeps_the_last_error_line_and_the_optimizer_it_fell_back_to():
    log = ["10:00:02 [INFO] DeepSpeed CPUAdam not available, using PyTorch AdamW",
           "10:00:02 [INFO] Using PyTorch AdamW optimizer",
           "Traceback (most recent call last):",
           '  File "train.py", line 1, in <module>',
           "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB.",
           ""]
    facts = mt.parse_log(log)
    assert facts.optimizer == "torch_adamw" and facts.steps == []
    assert facts.error == "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB."


# ----------------------------------------------------------------------------------- a row without it


def test_a_megatrain_run_without_its_source_is_a_row_saying_so(tmp_path, monkeypatch):
    monkeypatch.delenv(mt.ENV_SOURCE, raising=False)
    res = mt.run(_spec(tmp_path), None)
    assert res["ok"] is False and res["error"].startswith("megatrain source not found: give --megatrain-src DIR")
    res = mt.run(_spec(tmp_path, megatrain_src=str(tmp_path)), None)  # a directory without its script
    assert res["error"].startswith(f"megatrain source not found at {tmp_path} (no examples/sft/train.py")
    # a checkout, but no CUDA device to run it on
    src = tmp_path / "src"
    (src / "examples" / "sft").mkdir(parents=True)
    (src / "infinity").mkdir()
    (src / "examples" / "sft" / "train.py").write_text("")
    (src / "infinity" / "__init__.py").write_text("")
    monkeypatch.setenv(mt.ENV_SOURCE, str(src))
    assert mt.find_source(None) == str(src)
    res = mt.run(_spec(tmp_path, device="cpu"), None)
    assert res["ok"] is False and res["error"] == "MegaTrain trains on a CUDA device only"


def test_bench_train_reports_the_megatrain_row_without_its_source(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != mt.ENV_SOURCE}
    out = tmp_path / "r.json"
    proc = subprocess.run([sys.executable, "-m", "pyinfinity", "bench", "train", "--device", "cpu", "--sizes", "micro",
                           "--systems", "megatrain", "--steps", "2", "--warmup", "1", "--seq", "16", "--batch", "1",
                           "--no-progress", "--no-trace", "--json", str(out)],
                          capture_output=True, text=True, cwd=REPO, timeout=600, env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    row = json.load(open(out))["runs"][-1]
    assert row["system"] == "megatrain" and row["ok"] is False
    assert row["error"].startswith("megatrain source not found")
    assert "FAILED: megatrain source not found" in proc.stdout


# a stand-in for MegaTrain's training script: reads the YAML as its loader does, checks what the run
# wrote, and logs its steps in MegaTrain's format (or fails as told by FAIL in the environment)
STAND_IN = """
import argparse, logging, os, sys, yaml
logging.basicConfig(level=logging.INFO, format="%(asctime)s [%(levelname)s] %(message)s", datefmt="%H:%M:%S")
log = logging.getLogger()
p = argparse.ArgumentParser(); p.add_argument("--config"); a = p.parse_args()
cfg = yaml.safe_load(open(a.config))
assert os.path.isfile(os.path.join(cfg["model"]["name"], "config.json"))
assert os.path.isfile(os.path.join(cfg["dataset"]["path"], "dataset_info.json"))
import torch
from infinity.model.cpu_master import CPUMasterModel  # the checkout's package, on PYTHONPATH
m = CPUMasterModel(); m.config = argparse.Namespace(attn_implementation=cfg["model"]["attn_implementation"])
assert m._build_layer_kwargs(torch.ones(2, 4, dtype=torch.long), None, None, None)["attention_mask"] is None
log.info("Model loaded. Attention implementation: " + cfg["model"]["attn_implementation"])
log.info("Using DeepSpeed CPUAdam optimizer (SIMD-accelerated)")
tokens = cfg["training"]["batch_size"] * cfg["dataset"]["max_seq_len"]
for i in range(cfg["training"]["num_steps"]):
    if os.environ.get("FAIL") and i == 1:
        raise RuntimeError("CUDA error: an illegal memory access was encountered")
    log.info(f"Step {i + 1}/{cfg['training']['num_steps']} | Loss {10 - i:.4f} | Avg 10.0000")
    log.info(f"  Time: 0.50s | Tokens/s {tokens / 0.5:.1f} | TFLOPS {100 + i:.1f}")
    log.info("  GPU: 3.00GB peak (alloc 1.00GB / reserved 4.00GB)")
    log.info("  CPU: 2.00GB")
log.info("Peak GPU: 3.25 GB")
"""


# the two methods of MegaTrain's CPUMasterModel the run's launcher wraps, as the stand-in's
FAKE_MODEL = """
class CPUMasterModel:
    def _build_layer_kwargs(self, mask, cache_position, position_ids, position_embeddings):
        return {"attention_mask": mask, "use_cache": False}

    @staticmethod
    def _prepare_4d_causal_mask(mask_2d, dtype, T):
        return ("4d", tuple(mask_2d.shape), dtype, T)
"""


def _stand_in(tmp_path):
    src = tmp_path / "megatrain"
    (src / "examples" / "sft").mkdir(parents=True)
    (src / "infinity").mkdir()
    (src / "examples" / "sft" / "train.py").write_text(STAND_IN)
    (src / "infinity" / "__init__.py").write_text("")
    (src / "infinity" / "model").mkdir()
    (src / "infinity" / "model" / "__init__.py").write_text("")
    (src / "infinity" / "model" / "cpu_master.py").write_text(FAKE_MODEL)
    return str(src)


def test_a_run_writes_its_inputs_runs_the_script_and_reads_its_steps_into_the_row(tmp_path):
    work = tmp_path / "work"
    work.mkdir()
    spec = _spec(work, megatrain_src=_stand_in(tmp_path), batch=2, grad_accum=2, steps=3)
    res = mt.run(spec, token_rows(spec))
    assert res["ok"], res.get("error")
    assert res["params"] > 0 and res["dataset_tokens"] == 3 * 4 * 16
    assert (res["megatrain_batch"], res["megatrain_grad_accum"]) == (4, 1)
    assert [s["seconds"] for s in res["steps"]] == pytest.approx([0.5] * 3)
    assert [s["loss"] for s in res["steps"]] == [10.0, 9.0, 8.0]
    assert res["megatrain_tflops"] == 101.5  # the median of the steps after the warm-up one
    assert res["peak_device_allocated"] == int(3.25 * (1 << 30)) and res["peak_rss"] > 0
    assert res["megatrain_optimizer"] == "deepspeed_adam" and res["megatrain_attention"] == "sdpa"
    assert yaml.safe_load(open(work / "megatrain.yaml")) == res["config"]
    assert res["megatrain_patch"] == mt.MASK_NOTE


def test_megatrains_layers_get_a_mask_their_attention_takes(capfd):
    """Its single-GPU path hands each decoder layer the batch's 2-D padding mask, which sdpa rejects:
    no mask where no sample is padded (sdpa's causal path), its own 4-D causal mask otherwise,
    flash-attn's left as it is."""
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

    ns: dict = {}
    exec(FAKE_MODEL, ns)
    cls = ns["CPUMasterModel"]
    mt.patch_layer_mask(cls)
    m = cls()
    m.config = type("C", (), {"attn_implementation": "sdpa", "dtype": torch.bfloat16})()
    whole = torch.ones(2, 8, dtype=torch.long)
    padded = torch.tensor([[1] * 8, [1] * 6 + [0] * 2])
    assert m._build_layer_kwargs(whole, None, None, None)["attention_mask"] is None
    assert m._build_layer_kwargs(padded, None, None, None)["attention_mask"] == ("4d", (2, 8), torch.bfloat16, 8)
    m.config.attn_implementation = "flash_attention_2"
    assert m._build_layer_kwargs(padded, None, None, None)["attention_mask"] is padded
    # a Llama layer with sdpa: the 2-D mask fails, the patched kwargs run it causally
    cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=4,
                      num_hidden_layers=1, vocab_size=100)
    cfg._attn_implementation = "sdpa"
    layer = LlamaDecoderLayer(cfg, 0).eval()
    h = torch.randn(2, 8, 64)
    pos = torch.arange(8).unsqueeze(0).expand(2, -1)
    pe = LlamaRotaryEmbedding(cfg)(h, pos[:1])
    with pytest.raises(RuntimeError, match="attn_mask"):
        layer(h, attention_mask=whole, position_embeddings=pe, position_ids=pos)
    m.config.attn_implementation = "sdpa"
    kw = m._build_layer_kwargs(whole, None, None, None)
    later = h.clone()
    later[:, -1] += 1.0

    def out(x):
        y = layer(x, attention_mask=kw["attention_mask"], position_embeddings=pe, position_ids=pos)
        return y[0] if isinstance(y, tuple) else y

    with torch.no_grad():
        a, b = out(h), out(later)
    assert torch.equal(a[:, :-1], b[:, :-1]) and not torch.equal(a[:, -1], b[:, -1])  # causal


def test_a_failed_run_says_why_in_its_row(tmp_path, monkeypatch):
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.setenv("FAIL", "1")
    spec = _spec(work, megatrain_src=_stand_in(tmp_path))
    res = mt.run(spec, token_rows(spec))
    assert res["ok"] is False and res["error_phase"] == "train"
    assert res["error"] == ("MegaTrain exited with status 1: RuntimeError: CUDA error: an illegal memory access "
                            "was encountered")
    assert [s["loss"] for s in res["steps"]] == [10.0]  # the step it finished before it failed


# ----------------------------------------------------------------------------------- the run itself


@pytest.mark.gpu
def test_megatrain_trains_a_tiny_model_from_its_checkout(tmp_path):
    """Needs $PYINFINITY_MEGATRAIN_SRC (a MegaTrain checkout) and datasets + deepspeed importable."""
    src = os.environ.get(mt.ENV_SOURCE)
    if not src:
        pytest.skip(f"needs {mt.ENV_SOURCE} (a MegaTrain checkout)")
    spec = _spec(tmp_path, size="tiny", model=model_fields("tiny", 128), seq=128, batch=2, grad_accum=1,
                 steps=3, megatrain_src=src)
    res = mt.run(spec, token_rows(spec))
    assert res["ok"], res.get("error")
    assert len(res["steps"]) == 3 and all(s["seconds"] > 0 for s in res["steps"])
    assert res["megatrain_optimizer"] == "deepspeed_adam" and res["megatrain_attention"] == "sdpa"
    assert res["peak_device_allocated"] > 0 and res["peak_rss"] > 0


def test_a_megatrain_row_shows_its_own_tflops_beside_the_benchs():
    from pyinfinity.bench.train_report import one_line, table_rows

    facts = {"params": 1_000_000_000, "flops_per_step": 8e12}
    res = {"ok": True, "size": "1.1b", "system": "megatrain", "megatrain_tflops": 50.0, "megatrain_batch": 4,
           "megatrain_grad_accum": 1, "steps": [{"seconds": s, "disk_read": 0, "disk_write": 0} for s in (9, 2, 2)]}
    bt._summarise(res, 1, 4096, facts)
    assert res["step_seconds"] == 2 and res["tflops_6nd"] == pytest.approx(6 * 1e9 * 4096 / 2 / 1e12)
    res.update(step_over_bound=2.0, bound={"seconds": 1.0, "bound_by": "compute"})
    assert "12.3 TFLOPS as 6 x params x tokens/s (MegaTrain's own figure 50.0)" in one_line(res)
    note = table_rows([res])[0][-1]
    assert note.startswith("its own 50.0 TFLOPS (6ND), batch 4 x 1") and "sdpa" in note
