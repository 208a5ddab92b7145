"""`pyinfinity train`'s two runs, the built-in corpus (``--model-size``) and a model directory with
your data (``--model DIR --data FILE``, full fine-tune and LoRA), give every flag they both accept
the same behaviour: each such flag of ``cli/train_args.py`` is run through both and its effect
checked (the table below must name every one, so a new shared flag needs its check here)."""
from __future__ import annotations

import fcntl
import json
import os
import pty
import re
import struct
import subprocess
import sys
import termios
import threading

import pytest

from pyinfinity.cli.train_args import add_arguments

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# the flags only one run accepts (what the model is, where the data comes from)
MODEL_SIZE_ONLY = {"model_size", "hidden", "layers", "heads", "intermediate", "corpus_bytes"}
MODEL_ONLY = {"model", "data", "data_field", "eval_every", "eval_fraction", "model_dtype", "lora", "lora_alpha",
              "lora_dropout", "lora_targets", "adapter", "merge_adapters"}

# each shared flag -> where its effect is checked below
CHECKED_BY = {
    "config": "the config's betas", "steps": "global_steps of the resumed run", "seq": "the resume refusal",
    "batch": "the config and the resume refusal", "grad_accum": "the config and the resume refusal",
    "lr": "the config and the resume refusal", "clip": "the config", "warmup": "the config and the resume refusal",
    "offload": "the config", "offload_optimizer": "the config", "optimizer_nvme_ratio": "the config",
    "optimizer_step": "the config", "optimizer_state": "the resumed run's config (converted)",
    "nvme": "the config", "device": "the config", "device_memory": "the config", "dtype": "the config",
    "checkpoint_activations": "the model's gradient_checkpointing_enable", "no_prefetch": "the config",
    "seed": "the resume refusal", "save": "the checkpoints", "save_every": "the checkpoints",
    "save_total_limit": "the checkpoints the resumed run leaves",
    "blocking_saves": "the first run's log (test_cli.py: the background default)",
    "resume": "the resumed run", "resume_convert": "the resumed run", "export": "the exported files",
    # read by train.run before either path is built (the schedule check), tested in test_cli.py
    "resume_reschedule": "test_cli.py's resume tests",
    "resume_replan": "test_cli.py's placement-keeping resume test (finetune.py calls the same function)",
    "json": "the JSON file", "no_progress": "the bar on a terminal", "stop_after": "the first run's steps",
    # the shape the planner chooses (both runs call cli.train_args.apply_tokens_per_step)
    "tokens_per_step": "test_step_shape.py: the run at the chosen shape, bit for bit the plain loop at it",
}

BAR = re.compile(r"\r(?!\n)")  # a carriage return that is not the terminal's end of line: a bar redrawn

# the CLI with transformers' gradient_checkpointing_enable saying when it is called
_DRIVER = """
import sys, transformers
real = transformers.PreTrainedModel.gradient_checkpointing_enable
def enable(self, *a, **k):
    print("gradient checkpointing enabled", file=sys.stderr, flush=True)
    return real(self, *a, **k)
transformers.PreTrainedModel.gradient_checkpointing_enable = enable
from pyinfinity.cli import main
sys.exit(main(sys.argv[1:]))
"""


def _shared_flags() -> set[str]:
    import argparse

    p = argparse.ArgumentParser()
    add_arguments(p)
    dests = {a.dest for a in p._actions if a.dest != "help"}
    return dests - MODEL_SIZE_ONLY - MODEL_ONLY


def test_the_table_names_every_flag_both_runs_accept():
    assert set(CHECKED_BY) == _shared_flags()


def _run_on_a_terminal(args: list[str]) -> tuple[int, str]:
    """Runs the CLI with stderr on a pseudo-terminal (as a user's shell has it); (status, stderr)."""
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 120, 0, 0))  # a bar needs columns
    env = {**os.environ, "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.Popen([sys.executable, "-c", _DRIVER, *args], stdout=subprocess.DEVNULL, stderr=slave,
                            stdin=subprocess.DEVNULL, cwd=REPO, env=env)
    os.close(slave)
    chunks: list[bytes] = []

    def drain() -> None:
        while True:
            try:
                b = os.read(master, 65536)
            except OSError:  # EIO: the child closed its end
                return
            if not b:
                return
            chunks.append(b)

    t = threading.Thread(target=drain, daemon=True)
    t.start()
    try:
        rc = proc.wait(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
    t.join(30)
    os.close(master)
    return rc, b"".join(chunks).decode("utf-8", "replace")


@pytest.fixture(scope="module")
def model_and_data(tmp_path_factory):
    from tests.python.pretrained_dirs import CORPUS, make_model_dir

    root = tmp_path_factory.mktemp("paths")
    data = root / "data.txt"
    data.write_text(CORPUS * 2)
    return make_model_dir(str(root / "llama")), str(data)


@pytest.mark.parametrize("run", ["model-size", "model", "model-lora"])
def test_every_flag_both_runs_accept_behaves_the_same_in_each(run, model_and_data, tmp_path):
    model, data = model_and_data
    source = {"model-size": ["--model-size", "tiny", "--hidden", "32", "--layers", "2", "--corpus-bytes", "64KB"],
              "model": ["--model", model, "--data", data],
              "model-lora": ["--model", model, "--data", data, "--lora", "4"]}[run]
    cfg_file = tmp_path / "ds.json"
    cfg_file.write_text(json.dumps({"optimizer": {"type": "AdamW", "params": {"lr": 5e-4, "betas": [0.8, 0.9]}}}))
    ck, ex, swap = tmp_path / "ck", tmp_path / "ex", tmp_path / "swap"
    common = ["train", *source, "--config", str(cfg_file), "--steps", "5", "--seq", "16", "--batch", "2",
              "--grad-accum", "2", "--lr", "1e-3", "--clip", "0.5", "--warmup", "1", "--offload", "nvme",
              "--nvme", str(swap), "--offload-optimizer", "cpu", "--optimizer-nvme-ratio", "0.5",
              "--optimizer-step", "cpu", "--device", "cpu", "--gpu-memory", "64MiB", "--dtype", "fp32",
              "--checkpoint-activations", "--no-prefetch", "--seed", "3", "--save", str(ck), "--save-total-limit", "2"]
    rc, err = _run_on_a_terminal([*common, "--optimizer-state", "fp32", "--save-every", "2", "--blocking-saves",
                                  "--stop-after", "3",
                                  "--export", str(ex), "--json", str(tmp_path / "a.json"), "--no-progress"])
    assert rc == 0, err[-3000:]
    assert "gradient checkpointing enabled" in err
    assert not BAR.search(err)  # --no-progress: no bar on the terminal
    assert "writing in the background" not in err  # --blocking-saves
    a = json.loads((tmp_path / "a.json").read_text())
    c = a["config"]
    assert c["optimizer"]["params"]["betas"] == [0.8, 0.9] and c["optimizer"]["params"]["lr"] == 1e-3
    assert (c["train_micro_batch_size_per_gpu"], c["gradient_accumulation_steps"], c["gradient_clipping"]) == (2, 2, 0.5)
    assert c["scheduler"]["params"]["warmup_num_steps"] == 1 and c["scheduler"]["params"]["total_num_steps"] == 5
    z = c["zero_optimization"]
    assert (z["offload_param"]["device"], z["offload_optimizer"]["device"], z["offload_optimizer"]["ratio"]) == \
        ("nvme", "cpu", 0.5)
    assert z["offload_param"]["nvme_path"] == [str(swap)]
    py = c["pyinfinity"]
    assert (py["device"], py["device_memory"], py["prefetch"], py["optimizer_step_device"],
            py["optimizer_state"]) == ("cpu", "64MiB", False, "cpu", "fp32")
    assert not (c.get("bf16") or {}).get("enabled") and not (c.get("fp16") or {}).get("enabled")
    assert len(a["steps"]) == 3  # --stop-after 3 of --steps 5
    # --save-every 2 and --save at the end
    assert sorted(os.listdir(ck)) == ["global_step2", "global_step3", "latest"]
    assert (ck / "latest").read_text() == "global_step3"
    assert any(n.endswith(".safetensors") for n in os.listdir(ex))

    # --resume --resume-convert into another optimizer state, with the bar on the terminal
    rc, err = _run_on_a_terminal([*common, "--optimizer-state", "8bit", "--resume", str(ck / "global_step2"),
                                  "--resume-convert", "--json", str(tmp_path / "b.json")])
    assert rc == 0, err[-3000:]
    assert BAR.search(err)  # the progress bar
    b = json.loads((tmp_path / "b.json").read_text())
    assert b["config"]["pyinfinity"]["optimizer_state"] == "8bit"
    assert [s["step"] for s in b["steps"]] == [3, 4, 5]
    assert repr(b["steps"][0]["loss"]) == repr(a["steps"][2]["loss"])  # step 3 again, from the step-2 save
    # no --save-every; --save-total-limit 2: the step-2 save went once global_step5 was durable
    assert sorted(os.listdir(ck)) == ["global_step3", "global_step5", "latest"]

    # a resume with other data or schedule flags is refused, naming them
    other = [a if a != "3" else "4" for a in common]  # --seed 4
    p = subprocess.run([sys.executable, "-m", "pyinfinity", *other, "--seq", "8", "--resume", str(ck / "global_step3")],
                       capture_output=True, text=True, timeout=300, cwd=REPO,
                       env={**os.environ, "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", "")})
    last = p.stderr.strip().splitlines()[-1]
    assert p.returncode == 2 and "--seed 4" in last and "--seq 8" in last, p.stderr[-3000:]
