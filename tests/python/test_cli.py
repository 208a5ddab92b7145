"""The command line as a user meets it: a mistake (a flag, a path, a full disk, a device this
machine lacks) is one line on stderr and exit status 2, its traceback only with -v; a crash keeps
its traceback. `train --resume` continues a run exactly; the progress bar stays out of log files."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from pyinfinity.cli import _guarded

TINY_LLAMA = {"model_type": "llama", "vocab_size": 64, "hidden_size": 32, "intermediate_size": 64,
              "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
              "max_position_embeddings": 64}
TRAIN = ["train", "--model-size", "tiny", "--steps", "1", "--seq", "32", "--batch", "2", "--device", "cpu",
         "--corpus-bytes", "64KB"]


def cli(*args: str, env: dict | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pyinfinity", *args], capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, **(env or {})})


def assert_one_line_user_error(p: subprocess.CompletedProcess, *needles: str) -> str:
    """Exit status 2, no traceback, and the last stderr line says `pyinfinity CMD: error: ...`
    with each of ``needles``; the lines before it are log lines (``LEVEL name: ...``), if any."""
    assert p.returncode == 2, (p.returncode, p.stderr[-3000:])
    assert "Traceback" not in p.stderr, p.stderr[-3000:]
    lines = p.stderr.strip().splitlines()
    last = lines[-1]
    assert last.startswith("pyinfinity ") and ": error: " in last, p.stderr[-3000:]
    assert all(line.split(" ", 1)[0] in ("DEBUG", "INFO", "WARNING") for line in lines[:-1]), p.stderr[-3000:]
    for n in needles:
        assert n in last, last
    return last


def test_a_negative_batch_is_one_line():
    assert_one_line_user_error(cli(*TRAIN[:-2], "--batch", "-4"), "--batch", "-4")


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_a_device_this_machine_lacks_is_one_line():
    last = assert_one_line_user_error(cli(*[a if a != "cpu" else "cuda" for a in TRAIN]), "--device", "cuda")
    assert "--device cpu" in last  # says how to fix it


def test_a_read_only_swap_directory_is_one_line_and_its_traceback_comes_with_v(readonly_dir, tmp_path):
    sub = os.path.join(readonly_dir, "swap")
    assert_one_line_user_error(cli(*TRAIN, "--offload", "nvme", "--nvme", sub), sub, "Read-only")
    p = cli("-v", *TRAIN, "--offload", "nvme", "--nvme", sub)
    assert p.returncode == 2 and "Traceback" in p.stderr and "Read-only" in p.stderr.splitlines()[-1]
    (tmp_path / "model.json").write_text(json.dumps(TINY_LLAMA))
    assert_one_line_user_error(cli("plan", "--model", str(tmp_path / "model.json"), "--device", "cpu",
                                   "--nvme", sub), sub)
    assert_one_line_user_error(cli("tune", sub, "--quick", "--no-progress"), sub)
    assert_one_line_user_error(cli("bench", "io", sub, "--quick", "--no-progress", "--peers", "none"), sub)


def test_a_disk_too_small_gets_the_capacity_message_not_a_probe_write_error(tiny_tmpfs_dir, tmp_path):
    p = cli(*TRAIN, "--offload", "nvme", "--nvme", tiny_tmpfs_dir)
    last = assert_one_line_user_error(p, tiny_tmpfs_dir, "free")
    assert "needs" in last and "Errno" not in last and ".pyinfinity-rates" not in p.stderr
    assert os.listdir(tiny_tmpfs_dir) == []  # the probe wrote nothing
    p = cli("tune", tiny_tmpfs_dir, "--quick", "--no-progress")
    assert_one_line_user_error(p, tiny_tmpfs_dir, "free", "--file-size")
    # plan: the disk is not timed (nothing written), its rates are named as a preset, the plan is made
    (tmp_path / "model.json").write_text(json.dumps(TINY_LLAMA))
    p = cli("plan", "--model", str(tmp_path / "model.json"), "--device", "cpu", "--nvme", tiny_tmpfs_dir,
            "-o", str(tmp_path / "out.json"))
    assert p.returncode == 0, p.stderr[-3000:]
    assert "not measured" in p.stdout and "Traceback" not in p.stderr
    assert os.listdir(tiny_tmpfs_dir) == []


def test_a_crash_keeps_its_traceback_and_a_user_error_is_sorted_out(capsys):
    def crash() -> int:
        raise RuntimeError("a bug")

    with pytest.raises(RuntimeError, match="a bug"):
        _guarded(crash, "train", False)

    def enospc() -> int:
        raise OSError(28, "No space left on device", "/some/dir")

    assert _guarded(enospc, "train", False) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "/some/dir" in err and "free space" in err

    def exit_with_message() -> int:
        raise SystemExit("--heads: hidden 100 is not divisible by 3 heads")

    assert _guarded(exit_with_message, "train", False) == 2
    assert capsys.readouterr().err == "pyinfinity train: error: --heads: hidden 100 is not divisible by 3 heads\n"


def test_resume_continues_the_same_run(tmp_path):
    """6 steps straight vs 3 steps, then --resume from the step-3 checkpoint: the same step
    numbers, learning rates and losses (bit for bit), and no progress-bar carriage returns in
    stderr when it is not a terminal."""
    common = [*TRAIN[:3], "--steps", "6", "--seq", "32", "--batch", "2", "--device", "cpu", "--corpus-bytes", "64KB",
              "--offload", "cpu", "--warmup", "2", "--lr", "1e-3"]
    whole = cli(*common, "--save", str(tmp_path / "ck"), "--save-every", "3", "--json", str(tmp_path / "a.json"))
    assert whole.returncode == 0, whole.stderr[-3000:]
    assert "\r" not in whole.stderr  # tqdm is off when stderr is a pipe or a file
    assert sorted(os.listdir(tmp_path / "ck")) == ["global_step3", "global_step6", "latest"]
    resumed = cli(*common, "--resume", str(tmp_path / "ck" / "global_step3"), "--json", str(tmp_path / "b.json"))
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resumed" in resumed.stderr
    a = json.loads((tmp_path / "a.json").read_text())["steps"]
    b = json.loads((tmp_path / "b.json").read_text())["steps"]
    assert [s["step"] for s in b] == [s["step"] for s in a[3:]] and len(b) == 3
    assert [(repr(s["loss"]), repr(s["lr"])) for s in b] == [(repr(s["loss"]), repr(s["lr"])) for s in a[3:]]
    p = cli(*common, "--resume", str(tmp_path / "nothing-here"))
    assert_one_line_user_error(p, "--resume", "not a checkpoint")


def test_resume_with_other_data_or_schedule_flags_is_refused(tmp_path):
    """The built-in corpus run: a --resume whose --seed/--lr/--batch/--seq/--grad-accum/--warmup
    differ from the saved run's is one line naming each (it trained on, with other losses)."""
    common = [*TRAIN[:3], "--steps", "3", "--device", "cpu", "--corpus-bytes", "64KB", "--offload", "cpu"]
    first = ["--seq", "32", "--batch", "2", "--warmup", "2", "--lr", "1e-3", "--seed", "0", "--grad-accum", "1"]
    saved = cli(*common, *first, "--steps", "2", "--save", str(tmp_path / "ck"))
    assert saved.returncode == 0, saved.stderr[-3000:]
    other = ["--seq", "16", "--batch", "1", "--warmup", "1", "--lr", "2e-3", "--seed", "1", "--grad-accum", "2"]
    p = cli(*common, *other, "--resume", str(tmp_path / "ck"))
    assert p.returncode == 2 and "Traceback" not in p.stderr, p.stderr[-3000:]
    last = p.stderr.strip().splitlines()[-1]  # (the engine's plan, logged before, spans several lines)
    assert last.startswith("pyinfinity train: error: --resume:"), last
    for flag in ("--seed 1", "--lr 0.002", "--batch 1", "--seq 16", "--grad-accum 2", "--warmup 1", "same flags"):
        assert flag in last, last
