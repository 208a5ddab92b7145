"""The README's main command and the example: `python -m pyinfinity train` trains a Llama model on
the stdlib's sources with parameters and optimizer states on NVMe, and reports its telemetry."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_train_cli_on_nvme(tmp_path):
    out = tmp_path / "run.json"
    swap = tmp_path / "swap"
    cmd = [sys.executable, "-m", "pyinfinity", "train", "--model-size", "tiny", "--layers", "2",
           "--steps", "4", "--seq", "32", "--batch", "2", "--offload", "nvme", "--nvme", str(swap),
           "--gpu-memory", "1MiB", "--device", "cpu", "--lr", "3e-3", "--warmup", "1",
           "--clip", "0", "--json", str(out), "--no-progress"]
    res = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "tokens/s" in res.stdout
    run = json.loads(out.read_text())
    s = run["summary"]
    assert s["steps"] == 4 and s["params"] > 100_000
    assert s["peak_device_bytes"] <= s["device_budget"] == 1 << 20 < s["param_bytes_compute"]
    moved = {k for step in run["steps"] for k, v in step["bytes_moved"].items() if v}
    assert {"params.nvme.read", "optimizer.nvme.read", "optimizer.nvme.write"} <= moved
    assert all(step["tokens"] == 2 * 32 and step["tokens_per_s"] > 0 for step in run["steps"])
    assert s["last_loss"] < s["first_loss"]
    assert s["prefetch_hits"] > 0
    assert run["memory"]["params"].get("nvme", 0) == s["param_bytes_compute"]
    assert not list(swap.glob("*.swp"))  # swap files removed at the end
    # no clipping, optimizer on disk: every step overlaps backward (units stepped as their gradients land)
    assert all(step["overlapped_shards"] > 0 for step in run["steps"])


def test_example_script_help():
    res = subprocess.run([sys.executable, os.path.join(ROOT, "examples", "train_oversized.py"), "--help"],
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 0 and "--nvme" in res.stdout and "--gpu-memory" in res.stdout


def test_finetune_7b_shape_example_at_a_tiny_shape(tmp_path):
    """The 7B-shape script end to end at a tiny shape: checkpoint written, loaded, fine-tuned,
    exported, measurements in --json."""
    out = tmp_path / "r.json"
    res = subprocess.run([sys.executable, os.path.join(ROOT, "examples", "finetune_7b_shape.py"),
                          "--dir", str(tmp_path / "ck"), "--swap", str(tmp_path / "swap"), "--hidden", "64",
                          "--layers", "1", "--heads", "4", "--intermediate", "128", "--vocab", "600", "--seq", "32",
                          "--steps", "2", "--batch", "2", "--device", "cpu", "--data-bytes", "200000",
                          "--shard-bytes", "100000", "--json", str(out)], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    r = json.load(open(out))
    assert r["load_seconds"] > 0 and r["peak_rss_load"] > 0 and r["tokens_per_s"] > 0
    assert r["summary"]["steps"] == 2
    assert len([f for f in os.listdir(tmp_path / "ck") if f.endswith(".safetensors")]) > 1
    assert {"config.json", "tokenizer.json", "model.safetensors"} <= set(os.listdir(r["export_dir"]))
    from pyinfinity.pretrained import read_header
    import torch

    # built in the checkpoint's dtype (config.json: bfloat16), so exported in it
    assert {t.dtype for t in read_header(os.path.join(r["export_dir"], "model.safetensors")).values()} == {
        torch.bfloat16}


def _finetune_example():
    import importlib.util

    spec = importlib.util.spec_from_file_location("finetune_7b_shape",
                                                  os.path.join(ROOT, "examples", "finetune_7b_shape.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_finetune_7b_shape_defaults_fit_the_box_it_documents(tmp_path):
    """The example's defaults at the 7B shape, planned for the box its docstring names (8 GiB of
    GPU, 125 GiB of RAM, a 64 GiB disk): --offload auto places the 94.9 GB of training state so
    that it fits, where --offload nvme is refused; --batch/--seq reach the train command."""
    import argparse

    from pyinfinity.cli.train_args import add_arguments, build_config
    from pyinfinity.plan import PlanError
    from pyinfinity.plan.budgets import Budgets, SwapDir
    from pyinfinity.probes import preset_rates
    from pyinfinity.plan.resolve import resolve_auto

    ex = _finetune_example()
    GiB = 1 << 30
    swap = tmp_path / "swap"
    swap.mkdir()

    def plan(*flags: str):
        a = ex.parse_args(["--dir", str(tmp_path / "ck"), "--swap", str(swap), "--json", "r.json", *flags])
        cmd = ex.train_command(a, "data.txt", None, "run.json")
        p = argparse.ArgumentParser()
        add_arguments(p)
        args = p.parse_args(cmd[cmd.index("train") + 1:])
        model = {"model_type": "llama", "vocab_size": a.vocab, "hidden_size": a.hidden,
                 "intermediate_size": a.intermediate, "num_hidden_layers": a.layers, "num_attention_heads": a.heads,
                 "num_key_value_heads": a.heads, "torch_dtype": "bfloat16"}
        box = Budgets(device_memory=8 * GiB, host_memory=int(125 * GiB * 0.8), swap=[SwapDir(str(swap), 60 * GiB, 1)])
        return cmd, resolve_auto(build_config(args, "cuda:0"), model, budgets=box, seq_len=a.seq, device="cuda",
                                 checkpointing=args.checkpoint_activations,
                                 rates=preset_rates("cuda", link="h200-sxm", disk="nvme-gen4", matmul=400e12))[1]

    cmd, placed = plan()
    assert cmd[cmd.index("--offload") + 1] == "auto" and "--optimizer-nvme-ratio" not in cmd
    assert "--checkpoint-activations" in cmd
    assert (cmd[cmd.index("--batch") + 1], cmd[cmd.index("--seq") + 1]) == ("1", "1024")
    assert placed.swap_bytes <= 60 * GiB and placed.host_bytes <= 125 * GiB * 0.8
    with pytest.raises(PlanError, match="swap"):
        plan("--offload", "nvme")
    for batch, seq in (("1", "4096"), ("4", "1024")):
        cmd, placed = plan("--batch", batch, "--seq", seq)
        assert (cmd[cmd.index("--batch") + 1], cmd[cmd.index("--seq") + 1]) == (batch, seq)
        assert placed.device_bytes <= 8 * GiB
    with pytest.raises(PlanError, match="activation checkpointing"):  # what the default avoids
        plan("--batch", "4", "--seq", "1024", "--no-checkpoint-activations")
