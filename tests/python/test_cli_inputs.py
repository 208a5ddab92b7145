"""Broken inputs to `pyinfinity train --model DIR --data FILE [--adapter DIR]`: a model directory
with a shard or its index missing, a garbage config.json, an adapter directory without its
weights, with a damaged safetensors header or a torn adapter_config.json. Each is one line naming
the file and the real cause, exit status 2 (a user's mistake, not a crash)."""
from __future__ import annotations

import os
import shutil
import struct
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ADAPTER_WEIGHTS = "adapter_model.safetensors"


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    """A model directory (several shards), an adapter of it saved by PEFT, a data file."""
    import peft

    from tests.python.pretrained_dirs import CORPUS, make_model_dir

    root = tmp_path_factory.mktemp("inputs")
    model = make_model_dir(str(root / "model"))
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(model, local_files_only=True)
    peft.get_peft_model(base, peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"])).save_pretrained(
        str(root / "adapter"))
    data = root / "data.txt"
    data.write_text(CORPUS)
    return {"model": model, "adapter": str(root / "adapter"), "data": str(data)}


def _train(model: str, data: str, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pyinfinity", "train", "--model", model, "--data", data, "--device",
                           "cpu", "--offload", "cpu", "--steps", "1", "--seq", "16", "--batch", "2", "--no-progress",
                           *extra], capture_output=True, text=True, timeout=300, cwd=REPO,
                          env={**os.environ, "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", "")})


def _one_line(p: subprocess.CompletedProcess, *needles: str) -> str:
    assert p.returncode == 2 and "Traceback" not in p.stderr, p.stderr[-3000:]
    last = p.stderr.strip().splitlines()[-1]
    assert last.startswith("pyinfinity train: error: "), p.stderr[-3000:]
    for n in needles:
        assert n in last, last
    return last


def _shards(model: str) -> list[str]:
    return sorted(n for n in os.listdir(model) if n.endswith(".safetensors"))


@pytest.mark.parametrize("damage", ["missing_shard", "missing_index", "garbage_config", "config_not_an_object"])
def test_a_broken_model_directory_is_one_line_naming_the_file(damage, dirs, tmp_path):
    model = shutil.copytree(dirs["model"], tmp_path / "model")
    if damage == "missing_shard":
        gone = _shards(str(model))[1]
        os.unlink(model / gone)
        needles = (gone, "missing shard of", "model.safetensors.index.json")
    elif damage == "missing_index":
        os.unlink(model / "model.safetensors.index.json")
        needles = (str(model), "no model.safetensors or model.safetensors.index.json", "without their index")
    elif damage == "garbage_config":
        (model / "config.json").write_text("{garbage, not json")
        needles = (str(model / "config.json"), "not valid JSON")
    else:
        (model / "config.json").write_text("[1, 2]")
        needles = (str(model / "config.json"), "not an object")
    last = _one_line(_train(str(model), dirs["data"]), *needles)
    assert "tokenizer" not in last


def _damage_header(path: str, how: str) -> None:
    with open(path, "rb") as f:
        raw = f.read()
    n = struct.unpack("<Q", raw[:8])[0]
    if how == "truncated":
        raw = raw[:len(raw) // 2]
    elif how == "header_not_json":
        raw = raw[:8] + b"\xff" * 16 + raw[24:]
    elif how == "header_length_too_large":
        raw = struct.pack("<Q", len(raw) * 2) + raw[8:]
    elif how == "dtype_changed":  # F32 -> F16: the tensor's shape no longer fits its data_offsets
        header = raw[8:8 + n]
        assert b'"F32"' in header
        raw = raw[:8] + header.replace(b'"F32"', b'"F16"', 1) + raw[8 + n:]
    with open(path, "wb") as f:
        f.write(raw)


@pytest.mark.parametrize("damage, needles", [
    ("missing_weights", ("no adapter_model.safetensors or adapter_model.bin", "weights are missing")),
    ("truncated", (ADAPTER_WEIGHTS, "truncated")),
    ("header_not_json", (ADAPTER_WEIGHTS, "header is not JSON")),
    ("header_length_too_large", (ADAPTER_WEIGHTS, "header claims")),
    ("dtype_changed", (ADAPTER_WEIGHTS, "data_offsets")),
    ("torn_config", ("adapter_config.json", "not valid JSON")),
])
def test_a_broken_adapter_directory_is_one_line_naming_the_file(damage, needles, dirs, tmp_path):
    adapter = shutil.copytree(dirs["adapter"], tmp_path / "adapter")
    if damage == "missing_weights":
        os.unlink(adapter / ADAPTER_WEIGHTS)
    elif damage == "torn_config":
        cfg = adapter / "adapter_config.json"
        cfg.write_bytes(cfg.read_bytes()[:40])
    else:
        _damage_header(str(adapter / ADAPTER_WEIGHTS), damage)
    last = _one_line(_train(dirs["model"], dirs["data"], "--adapter", str(adapter)), str(adapter), *needles)
    assert "HFValidationError" not in last and "SafetensorError" not in last


def _corpus_run(*extra: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pyinfinity", "train", "--model-size", "tiny", "--hidden", "32",
                           "--layers", "2", "--corpus-bytes", "64KB", "--seq", "16", "--batch", "2", "--device", "cpu",
                           "--offload", "cpu", "--no-progress", *extra], capture_output=True, text=True, timeout=300,
                          cwd=REPO, env={**os.environ, "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", "")})


def test_a_resume_across_compute_dtypes_names_the_dtype_and_resume_convert_converts(tmp_path):
    """A CPU fp32-compute run resumed into the bf16 optimizer state (which needs bf16 compute): the
    refusal names the compute dtype (it said "a different model/partition"); --resume-convert
    converts it and trains on; a bf16 run resumed in fp32 the same way round."""
    import json

    ck, back = str(tmp_path / "ck"), str(tmp_path / "back")
    p = _corpus_run("--steps", "2", "--dtype", "fp32", "--save", ck)
    assert p.returncode == 0, p.stderr[-3000:]
    to_bf16 = ["--steps", "4", "--dtype", "bf16", "--optimizer-state", "bf16", "--resume", ck]
    last = _one_line(_corpus_run(*to_bf16), "computing in torch.float32", "computes in torch.bfloat16",
                     "bf16 optimizer state", "--resume-convert")
    assert "partition" not in last
    p = _corpus_run(*to_bf16, "--resume-convert", "--save", back, "--json", str(tmp_path / "b.json"))
    assert p.returncode == 0, p.stderr[-3000:]
    with open(tmp_path / "b.json") as f:
        steps = json.load(f)["steps"]
    assert [s["step"] for s in steps] == [3, 4] and all(s["loss"] == s["loss"] for s in steps)
    to_fp32 = ["--steps", "6", "--dtype", "fp32", "--optimizer-state", "fp32", "--resume", back, "--resume-reschedule"]
    _one_line(_corpus_run(*to_fp32), "computing in torch.bfloat16", "computes in torch.float32")
    p = _corpus_run(*to_fp32, "--resume-convert")
    assert p.returncode == 0, p.stderr[-3000:]
