"""Hugging Face ``Trainer`` with a ``deepspeed=`` config (ZeRO-3, parameters and optimizer states on
NVMe) and ``PYINFINITY_DEEPSPEED=1`` trains a tiny Llama on the CPU with every swap file written and
read by pyinfinity. The config's swap knobs are left out and sized by size_nvme_offload(). Runs in
its own interpreter (DeepSpeed's and accelerate's process-global state)."""
from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.python import test_deepspeed_integration as ds

SCRIPT = r"""
import json, os, sys
from pathlib import Path
import torch
import pyinfinity.integrations.deepspeed as pids      # PYINFINITY_DEEPSPEED=1: installed on import
import deepspeed
deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False  # gloo; no shared-memory op build
from deepspeed.ops.op_builder.builder import OpBuilder
def no_build(self, verbose=True):
    raise RuntimeError(f"test guard: DeepSpeed tried to build its {self.name!r} op")
OpBuilder.jit_load = no_build
from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments

nvme, out = sys.argv[1], sys.argv[2]
mc = LlamaConfig(vocab_size=4096, hidden_size=512, intermediate_size=1024, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=64)
config = {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
          "bf16": {"enabled": "auto"}, "zero_force_ds_cpu_optimizer": False,
          "zero_optimization": {"stage": 3,
                                "offload_param": {"device": "nvme", "nvme_path": nvme, "pin_memory": True},
                                "offload_optimizer": {"device": "nvme", "nvme_path": nvme, "pin_memory": True},
                                "stage3_param_persistence_threshold": 0},
          "aio": {"block_size": 262144, "queue_depth": 8}}
sized = pids.size_nvme_offload(config, mc)            # buffer_count/buffer_size/max_in_cpu were left out
args = TrainingArguments(output_dir=str(Path(out).parent / "trainer"), per_device_train_batch_size=2, max_steps=2,
                         bf16=True, use_cpu=True, deepspeed=sized.config, report_to=[], logging_steps=1,
                         save_strategy="no", optim="adamw_torch", seed=0)
torch.manual_seed(0)
model = LlamaForCausalLM(mc)
g = torch.Generator().manual_seed(0)
data = [{"input_ids": (ids := torch.randint(0, 4096, (32,), generator=g)), "labels": ids} for _ in range(4)]
trainer = Trainer(model=model, args=args, train_dataset=data)
trainer.train()
files = sorted(str(p) for p in Path(nvme).rglob("*.swp"))
st = pids.stats()
Path(out).write_text(json.dumps({
    "deepspeed": bool(trainer.is_deepspeed_enabled), "changes": sized.changes,
    "losses": [h["loss"] for h in trainer.state.log_history if "loss" in h],
    "swap_files": files, "written": sorted(st.files_written), "read": sorted(st.files_read),
    "loaded_ops": sorted(OpBuilder._loaded_ops)}))
"""


def test_trainer_with_deepspeed_config_swaps_through_pyinfinity(tmp_path: Path) -> None:
    pytest.importorskip("accelerate")
    if ds.run_snippet("import deepspeed").returncode != 0:
        pytest.skip("deepspeed is not importable")
    nvme, out = tmp_path / "nvme", tmp_path / "result.json"
    nvme.mkdir()
    r = subprocess.run([sys.executable, "-c", textwrap.dedent(SCRIPT), str(nvme), str(out)], cwd=str(ds.ROOT),
                       env=ds._env({"PYINFINITY_DEEPSPEED": "1"}), capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-6000:]
    res = json.loads(out.read_text())
    assert res["deepspeed"] and len(res["losses"]) == 2 and all(0 < x < 20 for x in res["losses"])
    assert any("offload_param.buffer_count" in c for c in res["changes"])
    files = set(res["swap_files"])
    assert any("bfloat16params" in f for f in files) and any("exp_avg" in f for f in files), sorted(files)
    assert files <= set(res["written"]) and files <= set(res["read"])   # every swap file through pyinfinity
    assert "async_io" not in res["loaded_ops"]


def docs_trainer_script() -> str:
    """docs/deepspeed.md's Trainer script, as printed."""
    import re

    text = (ds.ROOT / "docs" / "deepspeed.md").read_text(encoding="utf-8")
    blocks = [m.group(1) for m in re.finditer(r"^```python[^\n]*\n(.*?)^```", text, re.S | re.M)]
    return next(b for b in blocks if "Trainer(" in b and "train_ds =" in b)


def test_the_docs_trainer_script_trains_and_checkpoints_as_printed(tmp_path: Path) -> None:
    """The script with two substitutions: MODEL, the model it documents as a Hub name or a local
    directory, is a small local Llama; nvme_path is under tmp_path. It trains on the CPU with
    bf16, saves its two checkpoints (Trainer's double save_checkpoint into one folder, which
    DeepSpeed 0.19's NVMe optimizer copy refuses on its own), and leaves nothing under nvme_path."""
    import re

    from tests.python.pretrained_dirs import make_model_dir

    pytest.importorskip("accelerate")
    if ds.run_snippet("import deepspeed").returncode != 0:
        pytest.skip("deepspeed is not importable")
    model = make_model_dir(str(tmp_path / "model"), "llama", hidden=768, layers=2, shard="200MB")
    src, n = re.subn(r'^MODEL = "[^"]*"', f'MODEL = "{model}"', docs_trainer_script(), flags=re.M)
    assert n == 1, "the script no longer sets MODEL on a line of its own"
    swap = tmp_path / "nvme" / "ds_swap"
    assert "/mnt/nvme0/ds_swap" in src
    (tmp_path / "train.py").write_text(src.replace("/mnt/nvme0/ds_swap", str(swap)))
    env = {k: v for k, v in ds._env({}).items() if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_SIZE",
                                                                  "MASTER_ADDR", "DS_ACCELERATOR")}
    r = subprocess.run([sys.executable, "train.py"], cwd=str(tmp_path), env=env, capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-6000:]
    for step in (2, 4):
        copy = tmp_path / "out" / f"checkpoint-{step}" / f"global_step{step}" / "offloaded_tensors" / "rank00"
        assert any(copy.glob("*.swp")), f"no NVMe optimizer state in {copy}"
    state = json.loads((tmp_path / "out" / "checkpoint-4" / "trainer_state.json").read_text())
    losses = [h["loss"] for h in state["log_history"] if "loss" in h]
    assert len(losses) == 4 and all(0 < x < 20 for x in losses)
    assert not (tmp_path / "nvme").exists() or not any((tmp_path / "nvme").rglob("*")), \
        sorted(str(p) for p in (tmp_path / "nvme").rglob("*"))


def docs_blocks(lang: str) -> list[str]:
    import re

    text = (ds.ROOT / "docs" / "deepspeed.md").read_text(encoding="utf-8")
    return [m.group(1) for m in re.finditer(rf"^```{lang}[^\n]*\n(.*?)^```", text, re.S | re.M)]


def test_the_docs_plain_deepspeed_script_and_sizing_run_as_printed(tmp_path: Path) -> None:
    """docs/deepspeed.md's install lines, its ds_config.json with the training script that loads it
    (the model line replaced by the one the script documents for a CPU, nvme_path under
    tmp_path), and the sizing snippet: each runs in its own interpreter as printed; the training
    writes and reads its swap files through pyinfinity and leaves nothing under nvme_path."""
    import re

    if ds.run_snippet("import deepspeed").returncode != 0:
        pytest.skip("deepspeed is not importable")
    swap = tmp_path / "nvme" / "ds_swap"
    (config,) = docs_blocks("json")[:1]
    (tmp_path / "ds_config.json").write_text(config.replace("/mnt/nvme0/ds_swap", str(swap)))
    python = docs_blocks("python")
    script = next(b for b in python if "deepspeed.initialize(" in b)
    cpu = re.search(r"^# on a CPU: (model_config = .*)$", script, re.M)
    assert cpu, "the script no longer documents its CPU model line"
    script = re.sub(r"^model_config = LlamaConfig\((.|\n)*?\)[^\n]*\n", cpu.group(1) + "\n", script, count=1,
                    flags=re.M)
    script += "\nst = pyinf_ds.stats()\nassert st.writes and st.reads and st.files_written, st\n"
    env = {k: v for k, v in ds._env({}).items() if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_SIZE",
                                                                  "MASTER_ADDR")}
    for name, src in (("install.py", python[0]), ("train_ds.py", script),
                      ("sizing.py", next(b for b in python if "sizing.changes" in b))):
        (tmp_path / name).write_text(src)
        r = subprocess.run([sys.executable, name], cwd=str(tmp_path), env=env, capture_output=True, text=True,
                           timeout=600)
        assert r.returncode == 0, name + "\n" + r.stdout[-3000:] + r.stderr[-6000:]
        if name == "sizing.py":
            assert "offload_param.buffer_size" in r.stdout, r.stdout
    assert not (tmp_path / "nvme").exists() or not any((tmp_path / "nvme").rglob("*")), \
        sorted(str(p) for p in (tmp_path / "nvme").rglob("*"))


def test_a_run_deepspeed_swaps_nothing_of_is_said_and_leaves_nothing(tmp_path: Path) -> None:
    """The docs' script with a model whose partitions are all below DeepSpeed's swap threshold and
    the optimizer state in CPU memory: DeepSpeed writes nothing under nvme_path; a warning says
    so at exit, and the folders made for the run are gone."""
    import re

    if ds.run_snippet("import deepspeed").returncode != 0:
        pytest.skip("deepspeed is not importable")
    swap = tmp_path / "nvme" / "ds_swap"
    config = json.loads(docs_blocks("json")[0].replace("/mnt/nvme0/ds_swap", str(swap)))
    config["zero_optimization"]["offload_optimizer"] = {"device": "cpu"}
    (tmp_path / "ds_config.json").write_text(json.dumps(config))
    script = next(b for b in docs_blocks("python") if "deepspeed.initialize(" in b)
    tiny = ("model_config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, "
            "num_attention_heads=4, num_key_value_heads=2, vocab_size=256)")
    script = re.sub(r"^model_config = LlamaConfig\((.|\n)*?\)[^\n]*\n", tiny + "\n", script, count=1, flags=re.M)
    (tmp_path / "train_ds.py").write_text(script)
    env = {k: v for k, v in ds._env({}).items() if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_SIZE",
                                                                  "MASTER_ADDR")}
    r = subprocess.run([sys.executable, "train_ds.py"], cwd=str(tmp_path), env=env, capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-6000:]
    assert "DeepSpeed wrote nothing to its swap folders" in r.stderr, r.stderr[-3000:]
    assert not (tmp_path / "nvme").exists() or not any((tmp_path / "nvme").rglob("*")), \
        sorted(str(p) for p in (tmp_path / "nvme").rglob("*"))
