"""The command line as a user meets it: a mistake (a flag, a path, a full disk, a device this
machine lacks) is one line on stderr and exit status 2, its traceback only with -v; a crash keeps
its traceback. `train --resume` continues a run exactly; the progress bar stays out of log files."""
from __future__ import annotations

import json
import re
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


@pytest.mark.parametrize("flags, needles", [
    (["--save", "ck", "--save-total-limit", "0"], ("--save-total-limit", "0", ">= 1")),
    (["--save-total-limit", "2"], ("--save-total-limit", "needs --save")),
    (["--save", "ck", "--blocking-saves"], ("--blocking-saves", "needs --save-every")),
])
def test_a_bad_save_total_limit_is_one_line(flags, needles, tmp_path):
    assert_one_line_user_error(cli(*TRAIN, *[str(tmp_path / f) if f == "ck" else f for f in flags]), *needles)
    assert not (tmp_path / "ck").exists()


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
    assert "checkpoint " + str(tmp_path / "ck" / "global_step3") + ": writing in the background" in whole.stderr
    resumed = cli(*common, "--resume", str(tmp_path / "ck" / "global_step3"), "--json", str(tmp_path / "b.json"))
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resumed" in resumed.stderr
    saves = json.loads((tmp_path / "a.json").read_text())["saves"]  # --save-every's, in the background
    assert [(s["step"], s["background"]) for s in saves] == [(3, True)]
    assert saves[0]["bytes"] > 0 and saves[0]["total_s"] > 0 and saves[0]["blocked_s"] >= saves[0]["call_s"]
    a = json.loads((tmp_path / "a.json").read_text())["steps"]
    b = json.loads((tmp_path / "b.json").read_text())["steps"]
    assert [s["step"] for s in b] == [s["step"] for s in a[3:]] and len(b) == 3
    assert [(repr(s["loss"]), repr(s["lr"])) for s in b] == [(repr(s["loss"]), repr(s["lr"])) for s in a[3:]]
    p = cli(*common, "--resume", str(tmp_path / "nothing-here"))
    assert_one_line_user_error(p, "--resume", "not a checkpoint")


def test_a_resume_keeps_the_placement_the_checkpoint_was_saved_under_and_replans_only_when_asked_or_it_cannot_fit(
        tmp_path, monkeypatch, caplog):
    """The planner decides the placement from the machine's budgets and measured rates, which a
    resume may find otherwise (here: another device budget); the resumed run keeps the saved
    placement (each shard stored and stepped where it was: bit for bit the run it continues),
    --resume-replan plans anew, and a saved placement this machine cannot hold is planned anew with
    a warning instead of refused."""
    common = [*TRAIN[:3], "--steps", "4", "--seq", "32", "--batch", "2", "--device", "cpu", "--corpus-bytes", "64KB",
              "--offload", "cpu", "--warmup", "1", "--lr", "1e-3", "--no-progress"]
    whole = cli(*common, "--gpu-memory", "2MiB", "--save", str(tmp_path / "ck"), "--save-every", "2",
                "--json", str(tmp_path / "a.json"))
    assert whole.returncode == 0, whole.stderr[-3000:]
    live = "zero_optimization.stage3_max_live_parameters"
    planned = json.loads((tmp_path / "a.json").read_text())["summary"]["auto"]  # the planner's decisions
    saved = json.loads((tmp_path / "ck" / "global_step2" / "meta.json").read_text())["placement"]
    assert saved[live] == planned[live]
    ck2 = str(tmp_path / "ck" / "global_step2")

    def resumed(tag: str, *extra: str) -> tuple[subprocess.CompletedProcess, dict]:
        p = cli(*common, "--resume", ck2, *extra, "--json", str(tmp_path / f"{tag}.json"))
        assert p.returncode == 0, p.stderr[-3000:]
        return p, json.loads((tmp_path / f"{tag}.json").read_text())

    planned_big = cli(*common, "--gpu-memory", "256MiB", "--json", str(tmp_path / "big.json"))
    assert planned_big.returncode == 0, planned_big.stderr[-3000:]
    big = json.loads((tmp_path / "big.json").read_text())["summary"]["auto"]
    assert big[live] != saved[live]  # planned anew, the resumed run would place otherwise

    p, doc = resumed("kept", "--gpu-memory", "256MiB")
    assert "--resume: the placement" in p.stderr and "is kept" in p.stderr
    z = doc["config"]["zero_optimization"]
    for key in ("stage3_max_live_parameters", "stage3_param_persistence_threshold", "stage3_prefetch_bucket_size"):
        assert z[key] == saved["zero_optimization." + key], key
    assert live not in doc["summary"]["auto"]
    a = json.loads((tmp_path / "a.json").read_text())["steps"]
    assert [(s["step"], repr(s["loss"])) for s in doc["steps"]] == [(s["step"], repr(s["loss"])) for s in a[2:]]

    p, doc = resumed("replan", "--gpu-memory", "256MiB", "--resume-replan")
    assert "is kept" not in p.stderr and doc["summary"]["auto"][live] == big[live]

    # a saved placement this machine cannot hold (the engine's own check of a fixed placement refuses
    # it: host RAM, swap space, the device) is planned anew, with a warning naming why
    import argparse
    import logging

    from pyinfinity.cli.train_args import keep_saved_placement
    from pyinfinity.layout.charges import PlanError
    from pyinfinity.plan import resolve

    def refuse(*a, **k):
        raise PlanError("the config's placement does not fit this machine (nothing was written): host RAM: ...")

    monkeypatch.setattr(resolve, "check_placement", refuse)
    args = argparse.Namespace(resume_replan=False, seq=32, checkpoint_activations=False)
    cfg = {"zero_optimization": {"stage": 3}, "pyinfinity": {"device": "cpu"}}
    with caplog.at_level(logging.WARNING):
        model = torch.nn.Linear(2, 2)  # fp32, as the saved run computed (a model in another dtype is planned anew)
        assert keep_saved_placement(args, cfg, "cpu", model, str(tmp_path / "ck"), "global_step2") is cfg
    assert "cannot be kept here (the config's placement does not fit" in caplog.text and "planned anew" in caplog.text


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


def test_a_finished_run_resumed_says_it_is_complete_and_another_steps_is_refused_unless_rescheduled(tmp_path):
    """A resume of a run at its last step trains nothing and says so (not "0 steps: loss nan");
    a resume with another --steps would move the lr to another schedule's value: one line naming
    the schedules and the lr's jump, unless --resume-reschedule, which trains on the new one."""
    common = [*TRAIN[:3], "--seq", "32", "--batch", "2", "--device", "cpu", "--corpus-bytes", "64KB",
              "--offload", "cpu", "--warmup", "1", "--lr", "1e-3", "--no-progress"]
    saved = cli(*common, "--steps", "2", "--save", str(tmp_path / "ck"))
    assert saved.returncode == 0, saved.stderr[-3000:]
    again = cli(*common, "--steps", "2", "--resume", str(tmp_path / "ck"))
    assert again.returncode == 0, again.stderr[-3000:]
    assert "already complete: at step 2, --steps 2" in again.stdout, again.stdout
    assert "nan" not in again.stdout + again.stderr and "0 tokens/s" not in again.stdout
    more = cli(*common, "--steps", "4", "--resume", str(tmp_path / "ck"))
    assert_one_line_user_error(more, "--resume", "another learning-rate schedule", "total_num_steps 2, this run's 4",
                               "the lr of step 3 would go from", "--resume-reschedule")
    more = cli(*common, "--steps", "4", "--resume", str(tmp_path / "ck"), "--resume-reschedule",
               "--json", str(tmp_path / "more.json"))
    assert more.returncode == 0, more.stderr[-3000:]
    assert "--resume-reschedule: the new schedule is used from step 3" in more.stderr
    assert [s["step"] for s in json.loads((tmp_path / "more.json").read_text())["steps"]] == [3, 4]
    assert_one_line_user_error(cli(*common, "--resume-reschedule"), "--resume-reschedule", "needs --resume")


# ------------------------------------------------------------------ what a new user meets first

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TINY_TRAIN_MODEL = {"model_type": "llama", "vocab_size": 260, "hidden_size": 128, "intermediate_size": 344,
                    "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 4,
                    "max_position_embeddings": 2048, "tie_word_embeddings": False}


def read(path: str) -> str:
    with open(os.path.join(ROOT, path)) as f:
        return f.read()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from tests.python.pretrained_dirs import make_model_dir

    return make_model_dir(str(tmp_path_factory.mktemp("cli-model") / "llama"))


def test_a_missing_swap_directory_is_created_with_a_warning_and_removed_and_a_run_says_what_moved(tmp_path):
    """A run creates a missing --nvme directory as DeepSpeed does, says on which filesystem, and
    removes it at the end; a plan creates nothing; a run that fails after the engine is built
    (a checkpoint it cannot read) removes it too. The summary has the bytes moved per tier."""
    swap = tmp_path / "new" / "swap"
    p = cli(*TRAIN, "--offload", "nvme", "--nvme", str(swap))
    assert p.returncode == 0, p.stderr[-3000:]
    warn = [line for line in p.stderr.splitlines() if "did not exist" in line]
    assert len(warn) == 1 and str(swap) in warn[0] and "filesystem mounted at" in warn[0], p.stderr[-3000:]
    assert not (tmp_path / "new").exists()
    moved = [line for line in p.stdout.splitlines() if line.startswith("bytes moved per step")]
    assert moved and "params.nvme.read" in moved[0] and "device.h2d" in moved[0], p.stdout
    (tmp_path / "model.json").write_text(json.dumps(TINY_LLAMA))
    p = cli("plan", "--model", str(tmp_path / "model.json"), "--device", "cpu", "--nvme", str(swap),
            "-o", str(tmp_path / "plan.json"))
    assert p.returncode == 0, p.stderr[-3000:]
    assert not (tmp_path / "new").exists()
    bad = tmp_path / "ck"  # looks like a checkpoint until it is read
    (bad / "global_step1").mkdir(parents=True)
    (bad / "latest").write_text("global_step1")
    (bad / "global_step1" / "meta.json").write_text("{not json")
    p = cli(*TRAIN, "--offload", "nvme", "--nvme", str(swap), "--resume", str(bad))
    assert p.returncode != 0 and "engine built" in p.stderr, p.stderr[-3000:]
    assert not (tmp_path / "new").exists(), p.stderr[-3000:]


def test_a_missing_model_directory_never_reaches_for_the_network(tmp_path):
    (tmp_path / "data.txt").write_text("hello\n" * 100)
    data = str(tmp_path / "data.txt")
    env = {"HF_ENDPOINT": "http://127.0.0.1:9"}  # were the Hub asked, the error would say so
    for model in (str(tmp_path / "does_not_exist"), "meta-llama/Llama-2-7b-hf"):
        p = cli("train", "--model", model, "--data", data, "--device", "cpu", env=env)
        last = assert_one_line_user_error(p, "--model", model, "no such directory", "nothing is downloaded")
        assert "Repo id" not in last and "127.0.0.1" not in p.stderr and "no usable tokenizer" not in last
    (tmp_path / "empty").mkdir()
    assert_one_line_user_error(cli("train", "--model", str(tmp_path / "empty"), "--data", data, env=env),
                               "not a transformers model directory", "no config.json")


def test_fine_tuning_flags_are_checked_before_anything_is_built(model_dir, tmp_path):
    """--batch -1, a --resume folder that is not a checkpoint and binary --data on the
    --model/--data path: one line each, by the flag's or the file's name, before the tokenizer
    or the model is loaded."""
    (tmp_path / "data.txt").write_text("some text to train on\n" * 200)
    data = str(tmp_path / "data.txt")
    base = ["train", "--model", model_dir, "--data", data, "--device", "cpu", "--seq", "16", "--steps", "1"]
    for extra, needles in ((["--batch", "-1"], ("--batch", "-1", ">= 1")),
                           (["--resume", str(tmp_path)], ("--resume", str(tmp_path), "not a checkpoint"))):
        p = cli(*base, *extra)
        assert_one_line_user_error(p, *needles)
        assert "INFO" not in p.stderr, p.stderr  # nothing loaded, built or tokenised first
    binary = tmp_path / "data.bin"
    binary.write_bytes(b"ok\n" + bytes([0x00, 0xff, 0xd3, 0xfe]) * 50)
    last = assert_one_line_user_error(cli(*base[:4], str(binary), *base[5:]), str(binary), "not UTF-8",
                                      "offset 4", "--data takes a UTF-8 text file or JSON lines")
    assert "codec" not in last


def test_train_accepts_the_config_plan_writes_and_the_flags_given_override_it(tmp_path):
    (tmp_path / "model.json").write_text(json.dumps(TINY_TRAIN_MODEL))
    cfg = tmp_path / "plan.json"
    p = cli("plan", "--model", str(tmp_path / "model.json"), "--device", "cpu", "--micro-batch", "3",
            "--seq-len", "32", "--cpu-memory", "3GiB", "-o", str(cfg))
    assert p.returncode == 0, p.stderr[-3000:]
    planned = json.loads(cfg.read_text())
    p = cli("train", "--config", str(cfg), "--model-size", "tiny", "--steps", "1", "--seq", "32", "--corpus-bytes",
            "64KB", "--lr", "1e-3", "--json", str(tmp_path / "run.json"))
    assert p.returncode == 0, p.stderr[-3000:]
    used = json.loads((tmp_path / "run.json").read_text())["config"]
    assert used["train_micro_batch_size_per_gpu"] == 3  # the plan's, no --batch given
    assert used["optimizer"]["params"]["lr"] == 1e-3  # the flag's
    assert used["pyinfinity"]["host_memory"] == planned["pyinfinity"]["host_memory"]  # the plan's budget
    assert used["zero_optimization"]["offload_param"] == planned["zero_optimization"]["offload_param"]
    p = cli("train", "--config", str(cfg), "--model-size", "tiny", "--steps", "1", "--seq", "32", "--corpus-bytes",
            "64KB", "--batch", "2", "--json", str(tmp_path / "run2.json"))
    assert p.returncode == 0, p.stderr[-3000:]
    assert json.loads((tmp_path / "run2.json").read_text())["config"]["train_micro_batch_size_per_gpu"] == 2
    (tmp_path / "bad.json").write_text("{")
    assert_one_line_user_error(cli("train", "--config", str(tmp_path / "bad.json")), "--config", "not valid JSON")


def test_a_plan_writes_only_what_it_decides_and_train_says_what_the_file_replaces(tmp_path):
    """`plan -o` writes no learning rate (not the planner's), so `train --config` keeps its own
    optimizer and schedule; every value of the file that replaces one of train's defaults (the
    planned micro-batch, placement, dtype) is named in one line."""
    (tmp_path / "model.json").write_text(json.dumps(TINY_TRAIN_MODEL))
    cfg = tmp_path / "plan.json"
    p = cli("plan", "--model", str(tmp_path / "model.json"), "--device", "cpu", "--seq-len", "32",
            "--cpu-memory", "3GiB", "-o", str(cfg))
    assert p.returncode == 0, p.stderr[-3000:]
    planned = json.loads(cfg.read_text())
    assert "optimizer" not in planned and "scheduler" not in planned, planned
    p = cli("train", "--config", str(cfg), "--model-size", "tiny", "--steps", "1", "--seq", "32", "--corpus-bytes",
            "64KB", "--no-progress", "--json", str(tmp_path / "run.json"))
    assert p.returncode == 0, p.stderr[-3000:]
    used = json.loads((tmp_path / "run.json").read_text())["config"]
    assert used["optimizer"] == {"type": "AdamW", "params": {"lr": 3e-4, "betas": [0.9, 0.95], "weight_decay": 0.1}}
    assert used["scheduler"] == {"type": "LinearWarmupCosineLR",  # --steps 1 and the default --warmup 5
                                 "params": {"total_num_steps": 5, "warmup_num_steps": 5}}
    steps = json.loads((tmp_path / "run.json").read_text())["steps"]
    assert steps[0]["lr"] == pytest.approx(3e-4 / 5)  # the first step trains: peak / warm-up steps
    said = [ln for ln in p.stderr.splitlines() if f"--config {cfg} sets, instead of train's defaults" in ln]
    assert len(said) == 1, p.stderr[-3000:]
    assert f"train_micro_batch_size_per_gpu {planned['train_micro_batch_size_per_gpu']} (train's --batch 4)" in said[0]
    assert "bf16.enabled true (train's --dtype auto: not set)" in said[0]
    assert "optimizer.params" not in said[0] and "scheduler" not in said[0]

def test_v_works_anywhere_on_the_line(tmp_path):
    p = cli(*TRAIN[:-2], "--batch", "-4", "-v")
    assert p.returncode == 2 and "Traceback" in p.stderr and "--batch" in p.stderr.splitlines()[-1], p.stderr
    p = cli("plan", "--model-size", "7b", "--micro-batch", "0", "--device", "cpu", "-v")
    assert p.returncode == 2 and "Traceback" in p.stderr and "--micro-batch" in p.stderr.splitlines()[-1], p.stderr


def test_plan_model_size_presets_are_the_benchmarks_table_with_30b_and_70b():
    from pyinfinity.presets import PRESETS as SIZES

    assert SIZES["30b"] == {**SIZES["7b"], "hidden_size": 6656, "intermediate_size": 17920, "num_hidden_layers": 60,
                            "num_attention_heads": 52, "num_key_value_heads": 52}
    assert SIZES["70b"] == {**SIZES["7b"], "hidden_size": 8192, "intermediate_size": 28672, "num_hidden_layers": 80,
                            "num_attention_heads": 64, "num_key_value_heads": 8}
    assert all(SIZES[s]["vocab_size"] == 32000 for s in ("1.1b", "7b", "10b", "13b", "30b", "70b"))
    h = cli("plan", "--help")
    assert h.returncode == 0 and "--model-size" in h.stdout and "bench train" in " ".join(h.stdout.split())
    p = cli("plan", "--model-size", "70b", "--gpu-memory", "80GiB", "--cpu-memory", "2TiB", "--tflops", "400")
    assert p.returncode == 0, p.stderr[-3000:]
    assert "68,976,648,192 parameters" in p.stdout  # Llama-2-70B's count


def test_plan_for_a_target_machine_and_what_would_change_it(tmp_path):
    """--nvme-free and --cpu-cores describe the target; the rates that are this machine's are
    named with how to make the target's file; a flag given is not called a default; the plan
    ends with the bounding resource doubled; the notes agree with the config written."""
    out = tmp_path / "cfg.json"
    args = ["plan", "--model-size", "7b", "--gpu-memory", "8GiB", "--cpu-memory", "64GiB", "--link", "pcie4x16",
            "--checkpointing", "--nvme", str(tmp_path / "target-swap"), "--cpu-cores", "32", "-o", str(out)]
    p = cli(*args, "--nvme-free", "2TB")
    assert p.returncode == 0, p.stderr[-3000:]
    assert not (tmp_path / "target-swap").exists()
    cfg = json.loads(out.read_text())
    assert cfg["pyinfinity"]["optimizer_threads"] == 32
    rates = {line.split()[0]: line for line in p.stdout.splitlines() if line.startswith("  ")}
    assert "scaled to --cpu-cores 32" in rates["adam"]
    assert "default" not in rates["h2d"] and "pcie4x16" in rates["h2d"]  # it was given
    assert "default, pass --disk" in rates["disk_read"]  # it was not
    assert "this machine's, not the target's" in p.stdout and "--save-rates" in p.stdout
    tail = p.stdout[p.stdout.index("what would change this plan"):].splitlines()
    assert "bound by disk" in tail[0] and "a second swap drive" in tail[1] and "s/step" in tail[1], tail
    assert 2 <= len(tail) <= 5
    res = [line for line in p.stdout.splitlines() if "stay on the device" in line]
    assert res and f"pyinfinity.resident_bytes: {cfg['pyinfinity']['resident_bytes']} (" in res[0], res
    assert "  swap: " in p.stdout and "of state on disk" in p.stdout
    small = cli(*args, "--nvme-free", "1GB")  # the target's disk, not this machine's
    assert_one_line_user_error(small, "swap", "free")
    assert_one_line_user_error(cli("plan", "--model-size", "7b", "--nvme-free", "1TB"), "--nvme-free", "--nvme")


def test_a_plan_for_another_machine_assumes_its_cores_aloud_and_calls_cpu_memory_a_budget(tmp_path):
    """Without --cpu-cores a GPU machine elsewhere gets an assumed core count, named in the rates
    and the notes, and its config leaves the optimizer's threads to the target ("auto"), not this
    machine's count; --cpu-memory is said to be a budget the plan fills, with the figure that
    keeps the default's headroom; a CPU plan offers no "twice the device memory"."""
    from pyinfinity.cli.plan import ASSUMED_TARGET_CORES

    out = tmp_path / "cfg.json"
    p = cli("plan", "--model-size", "7b", "--gpu-memory", "8GiB", "--cpu-memory", "128GiB", "--seq-len", "256",
            "-o", str(out))
    assert p.returncode == 0, p.stderr[-3000:]
    assert json.loads(out.read_text())["pyinfinity"]["optimizer_threads"] == "auto"
    adam = next(line for line in p.stdout.splitlines() if line.startswith("  adam "))
    assert f"scaled to an assumed {ASSUMED_TARGET_CORES} cores of the target (no --cpu-cores given)" in adam, adam
    assert f"the target's CPU cores are assumed ({ASSUMED_TARGET_CORES}; pass --cpu-cores N)" in p.stdout
    assert ("--cpu-memory 128GiB is the host RAM budget the plan may fill, all of it; the default keeps 20% of the "
            "available RAM for the system: for a machine with 128GiB of RAM, plan with --cpu-memory 102.40 GiB") in p.stdout
    (tmp_path / "m.json").write_text(json.dumps(TINY_TRAIN_MODEL))
    p = cli("plan", "--model", str(tmp_path / "m.json"), "--device", "cpu", "--seq-len", "32", "--cpu-memory", "3GiB")
    assert p.returncode == 0, p.stderr[-3000:]
    assert "what would change this plan" in p.stderr and "device memory" not in p.stderr.split("what would change")[1]
    assert "cores are assumed" not in p.stdout  # this machine: its own cores

def test_plan_and_train_take_the_optimizer_state(tmp_path):
    """`plan --optimizer-state 8bit` places the 13B preset where the fp32 state is refused (8 GiB GPU,
    100 GiB of RAM, a 64 GiB disk) and writes the key; a bf16 master needs bf16 compute (`train
    --optimizer-state 8bit`: test_train_resumes_another_optimizer_state_only_converted)."""
    args = ["plan", "--model-size", "13b", "--gpu-memory", "8GiB", "--cpu-memory", "100GiB", "--checkpointing",
            "--nvme", str(tmp_path / "target-swap"), "--nvme-free", "64GiB"]
    assert_one_line_user_error(cli(*args), "swap: needs", "14.0 bytes a parameter")
    out = tmp_path / "cfg.json"
    p = cli(*args, "--optimizer-state", "8bit", "-o", str(out))
    assert p.returncode == 0, p.stderr[-3000:]
    assert "8bit state" in p.stdout and "adam_8bit" in p.stdout
    assert json.loads(out.read_text())["pyinfinity"]["optimizer_state"] == "8bit"
    assert_one_line_user_error(cli(*args, "--optimizer-state", "bf16", "--dtype", "fp16"), "--optimizer-state bf16",
                               "--dtype bf16")
    assert_one_line_user_error(cli(*TRAIN, "--optimizer-state", "bf16"), "--optimizer-state bf16", "--dtype bf16")


def test_train_resumes_another_optimizer_state_only_converted(tmp_path):
    """`train --optimizer-state 8bit` trains and saves its state as it is; a --resume of it with
    the fp32 state is refused in one line naming --resume-convert, which converts it."""
    save = tmp_path / "ckpt"
    p = cli(*TRAIN, "--optimizer-state", "8bit", "--save", str(save))
    assert p.returncode == 0, p.stderr[-3000:]
    assert json.loads((save / "global_step1" / "meta.json").read_text())["optimizer_state"] == "8bit"
    two = [*TRAIN[:TRAIN.index("--steps") + 1], "2", *TRAIN[TRAIN.index("--steps") + 2:], "--resume", str(save)]
    p = cli(*two)  # refused once the engine is built (after the plan's table in the log): the last line says why
    assert p.returncode == 2 and "Traceback" not in p.stderr, p.stderr[-3000:]
    last = p.stderr.strip().splitlines()[-1]
    assert last.startswith("pyinfinity train: error: ") and "the 8bit optimizer state" in last, last
    assert "the fp32 one" in last and "--resume-convert" in last, last
    p = cli(*two, "--resume-convert")
    assert p.returncode == 0, p.stderr[-3000:]
    assert "resumed" in p.stderr and "at step 1 of 2" in p.stderr, p.stderr[-3000:]
    assert_one_line_user_error(cli(*TRAIN, "--resume-convert"), "--resume-convert", "--resume")


def test_the_run_plans_at_its_sequence_length():
    p = cli(*TRAIN)
    assert p.returncode == 0, p.stderr[-3000:]
    assert "pyinfinity.plan.resolve: plan:" in p.stderr, p.stderr[-3000:]  # it did plan (the plan's table, logged once)
    assert "sequence length unknown" not in p.stderr, p.stderr[-3000:]


def test_version_and_report_without_a_gpu():
    import pyinfinity

    v = cli("--version")
    assert v.returncode == 0 and v.stdout.strip() == f"pyinfinity {pyinfinity.__version__}"
    if torch.cuda.is_available() or os.path.exists("/proc/driver/nvidia/version"):
        pytest.skip("needs a machine without an NVIDIA driver")
    r = cli("report")
    gpu = [line for line in r.stdout.splitlines() if "] GPUs" in line]
    assert gpu and "no NVIDIA driver / no GPU" in gpu[0] and "cudaError" not in gpu[0], r.stdout


def test_train_and_finetune_share_one_module_of_helpers():
    import ast

    def imports(path: str) -> set[str]:
        tree = ast.parse(read(path))
        return {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}

    assert "pyinfinity.cli.train" not in imports("pyinfinity/cli/finetune.py")
    assert "pyinfinity.cli.train_args" in imports("pyinfinity/cli/finetune.py")
    assert "pyinfinity.cli.train_args" in imports("pyinfinity/cli/train.py")
    assert not {"pyinfinity.cli.train", "pyinfinity.cli.finetune"} & imports("pyinfinity/cli/train_args.py")


def test_the_suite_leaves_no_large_files_and_prints_skip_reasons(tmp_path):
    """The conftest removes the large files a test leaves in its tmp_path (pytest keeps three temp
    roots); `make test` prints why tests were skipped."""
    inner = tmp_path / "inner"
    inner.mkdir()
    (inner / "test_big.py").write_text(
        "def test_big(tmp_path):\n"
        "    (tmp_path / 'big.bin').write_bytes(b'x' * (4 << 20))\n"
        "    (tmp_path / 'small.json').write_text('{}')\n"
        f"    open({str(tmp_path / 'where')!r}, 'w').write(str(tmp_path))\n")
    p = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "tests.python.conftest",
                        "--basetemp", str(tmp_path / "bt"), "--rootdir", str(inner), str(inner / "test_big.py")],
                       capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    left = (tmp_path / "where").read_text()
    assert os.listdir(left) == ["small.json"]
    line = next(line for line in read("Makefile").splitlines() if "-m pytest" in line and "tests/python" in line)
    assert "-rs" in line.split()


def test_readme_says_how_to_reach_the_command_and_its_example_runs_without_a_guess():
    """After `make train` the README says to activate .venv (or call .venv/bin/pyinfinity, the
    entry point pyproject.toml installs); its Python example defines `loader` before using it and
    says how it runs on a CPU."""
    import ast
    import re

    readme = read("README.md")
    assert "source .venv/bin/activate" in readme and ".venv/bin/pyinfinity " in readme
    assert re.search(r'^pyinfinity = "pyinfinity\.cli:main"$', read("pyproject.toml"), re.M)
    example = readme[readme.index("## Training with offload"):]
    code = example[example.index("```python") + len("```python"):]
    code = code[:code.index("```")]
    names = [(n.lineno, type(n.ctx).__name__) for n in ast.walk(ast.parse(code))
             if isinstance(n, ast.Name) and n.id == "loader"]
    stores = [line for line, ctx in names if ctx == "Store"]
    assert stores and min(stores) < min(line for line, ctx in names if ctx == "Load"), names
    assert re.search(r'"pyinfinity": \{"device": "auto"', code) and '"cpu"' in code
    prose = example[:example.index("### Fine-tuning")]
    assert "runs the same\ncode on the CPU" in prose or "on the CPU" in prose.split("```")[-1]
    assert "bytes moved per tier in a step" in " ".join(readme.split())  # the train summary prints them


@pytest.mark.parametrize("size, billions", [("20b", 20.3), ("30b", 32.5), ("70b", 69.0)])
def test_the_30b_and_70b_presets_are_llama_30b_and_llama_2_70b(size, billions):
    """`train --model-size` and `bench train --sizes` (and so `plan --model-size`) have the same
    shapes: LLaMA-30B's and Llama-2-70B's (8 KV heads), 32.5B and 69.0B parameters at their
    32000-token vocabulary, and a 20.3B shape between 13B and 30B (hidden 6144, 44 layers)."""
    import argparse

    from pyinfinity.presets import PRESETS as SIZES
    from pyinfinity.cli.train import llama_config
    from pyinfinity.cli.train_args import add_arguments
    from pyinfinity.plan.sizes import llama_sizes

    p = argparse.ArgumentParser()
    add_arguments(p)
    cfg = llama_config(p.parse_args(["--model-size", size]))
    keys = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads")
    assert {k: getattr(cfg, k) for k in keys} == {k: SIZES[size][k] for k in keys}
    assert round(llama_sizes(dict(SIZES[size], model_type="llama")).numel / 1e9, 1) == billions


IMPORTS_PROBE = ("import runpy, sys\n"
                 "try:\n"
                 "    runpy.run_module('pyinfinity', run_name='__main__', alter_sys=True)\n"
                 "finally:\n"
                 "    print('IMPORTED:', *sorted(m for m in ('torch', 'transformers') if m in sys.modules), file=sys.stderr)\n")


def cli_imports(*args: str) -> tuple[subprocess.CompletedProcess, list[str]]:
    """`pyinfinity ARGS` run as the command runs, and the heavy packages it imported on the way."""
    p = subprocess.run([sys.executable, "-c", IMPORTS_PROBE, *args], capture_output=True, text=True, timeout=300)
    line = next(ln for ln in p.stderr.splitlines() if ln.startswith("IMPORTED:"))
    p.stderr = p.stderr.replace(line + "\n", "")
    return p, line.split()[1:]


@pytest.mark.parametrize("args", [
    ["--version"], ["--help"], ["train", "--help"], ["plan", "--help"], ["--bogus"], ["trian"],
    ["train", "--stpes", "3"], ["train", "--steps", "many"], ["plan", "--bogus"], ["plan", "--model-size", "nope"],
    ["plan", "--model-size", "7b", "--link", "pcie9"], ["plan", "--model", "/no/such/config.json"],
    ["train", "--model", "/no/such/model", "--data", "/no/such/data.txt"], ["train", "--config", "/no/such.json"],
    ["train", "--resume", "/no/such/run"], ["train", "--batch", "0"],
], ids=" ".join)
def test_a_one_line_answer_imports_neither_torch_nor_transformers(args):
    p, heavy = cli_imports(*args)
    assert p.returncode in (0, 2), p.stderr[-3000:]
    assert heavy == [], (args, heavy)


def test_a_missing_data_file_is_answered_before_torch_is_imported(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(TINY_LLAMA))
    p, heavy = cli_imports("train", "--model", str(tmp_path), "--data", str(tmp_path / "nope.txt"))
    assert_one_line_user_error(p, "--data", "no such file")
    assert heavy == []


def test_a_misspelt_flag_is_the_subcommands_error_with_the_flag_it_resembles():
    """argparse's usage, then its error line, by the subcommand's name, with the nearest flag."""
    for args, prog, needle in ((["train", "--stpes", "3"], "pyinfinity train", "(--stpes: did you mean --steps?)"),
                               (["train", "--lr=1e-3", "--warmpu", "2"], "pyinfinity train",
                                "(--warmpu: did you mean --warmup?)"),
                               (["plan", "--model-size", "tiny", "--cpu-memroy", "8GiB"], "pyinfinity plan",
                                "(--cpu-memroy: did you mean --cpu-memory?)")):
        p = cli(*args)
        last = p.stderr.strip().splitlines()[-1]
        assert p.returncode == 2 and last.startswith(f"{prog}: error: unrecognized arguments: "), p.stderr
        assert last.endswith(needle), last
    p = cli("train", "--zzzzzz")
    last = p.stderr.strip().splitlines()[-1]
    assert p.returncode == 2 and last == "pyinfinity train: error: unrecognized arguments: --zzzzzz", p.stderr


def test_plan_help_counts_the_bf16_state_as_readme_does_and_an_export_names_its_dtype(tmp_path):
    """`plan --help` and README give the bf16 optimizer state's bytes alike; an export of a bf16
    run says its safetensors are fp32 (the model's own dtype), not silently."""
    h = cli("plan", "--help")
    assert h.returncode == 0 and "bf16 (bf16 master and moments: 6," in " ".join(h.stdout.split()), h.stdout
    assert "(6 bytes of state beside the weights in the engine)" in " ".join(read("README.md").split())
    p = cli(*TRAIN, "--dtype", "bf16", "--export", str(tmp_path / "out"), "--no-progress")
    assert p.returncode == 0, p.stderr[-3000:]
    assert (f"exported {tmp_path / 'out'}: safetensors in fp32 (the model's own dtype, from the fp32 masters; the "
            "run computed in bf16") in p.stdout, p.stdout


def test_make_train_leaves_the_swap_directory_to_the_run_which_removes_it():
    """`make train` does not make SWAP_DIR itself: `train --nvme` creates a missing one and removes
    it at the end, so no empty .swap/ stays in the checkout."""
    p = subprocess.run(["make", "-n", "train"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    run = [line for line in p.stdout.splitlines() if "-m pyinfinity train" in line]
    assert run and "--nvme .swap" in run[-1], p.stdout
    assert not any("mkdir" in line and ".swap" in line for line in p.stdout.splitlines()), p.stdout


def test_train_save_every_charges_the_background_saves_staging_and_blocking_saves_do_not(tmp_path):
    """`train --save-every N` saves in the background: its config sets pyinfinity.checkpoint_staging
    (charged in the layout's host RAM); without saves or with --blocking-saves it stays "auto" (0),
    and a --config file's own value wins."""
    import argparse
    import json

    from pyinfinity.cli.train_args import add_arguments, engine_config
    from pyinfinity.layout.pools import CHECKPOINT_STAGING

    p = argparse.ArgumentParser()
    add_arguments(p)

    def staging(*argv: str):
        cfg, _ = engine_config(p.parse_args(["--device", "cpu", *argv]))
        return cfg["pyinfinity"].get("checkpoint_staging")

    save = ["--save", str(tmp_path / "ckpt"), "--save-every", "2"]
    assert staging() is None
    assert staging(*save) == CHECKPOINT_STAGING
    assert staging(*save, "--blocking-saves") is None
    file = tmp_path / "ds.json"
    file.write_text(json.dumps({"pyinfinity": {"checkpoint_staging": "64MiB"}}))
    assert staging("--config", str(file), *save) == "64MiB"
    file.write_text(json.dumps({"pyinfinity": {}}))
    assert staging("--config", str(file), *save) == CHECKPOINT_STAGING


def test_a_disk_slower_than_save_every_is_reported_once_with_the_save_every_that_keeps_up(caplog):
    """`train --save-every`: when the next save waits for a background save (the disk writes a
    checkpoint slower than the steps between saves), one warning gives the write rate and a
    --save-every whose steps outlast a save; the records count that wait and the steps' copies as
    blocked. A save the steps outlast says nothing."""
    import logging
    import time
    from types import SimpleNamespace

    from pyinfinity.cli import train_loop

    class Engine:
        global_steps = 0

        def __init__(self):
            self.write = None

        def wait_for_checkpoint(self):
            write, self.write = self.write, None
            time.sleep(write.seconds_left)
            return write

    eng = Engine()
    saves = []

    def run(steps: int, step_s: float, save_s: float, copies_s: float = 0.0) -> None:
        eng.global_steps += steps
        saves.append(train_loop.SaveRecord(eng.global_steps - steps, f"/ck/global_step{eng.global_steps - steps}",
                                           True, 0.01, called_at=time.perf_counter() - steps * step_s))
        eng.write = SimpleNamespace(seconds=save_s, data_bytes=int(12e9), copied_by_step=2, rotate_s=0.0,
                                    step_s=copies_s, blocked_s=0.01 + copies_s + max(0.0, save_s - steps * step_s),
                                    seconds_left=max(0.0, save_s - steps * step_s))
        train_loop.finish_saves(eng, saves)

    with caplog.at_level(logging.WARNING, logger=train_loop.log.name):
        run(5, 0.2, 0.5, copies_s=0.05)  # the steps outlast the save: nothing to say
        assert not caplog.records and saves[0].wait_s < 0.05
        assert saves[0].blocked_s == pytest.approx(0.01 + saves[0].wait_s + 0.05, abs=0.02)
        run(5, 0.1, 1.5)  # 0.5 s of steps, a 1.5 s save: 1 s waited
        run(5, 0.1, 1.5)
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 1, warnings
    assert "waited 1.0 s" in warnings[0] and "12.00 GB in 1.5 s (8.00 GB/s)" in warnings[0]
    assert "--save-every 17" in warnings[0], warnings[0]  # 5 x 1.5 / 0.5 x 1.1 = 16.5
    assert saves[1].said_slow and not saves[2].said_slow


def test_plan_writes_the_unit_size_and_overlap_step_it_planned_with_and_train_runs_with_them(tmp_path):
    """`plan -o` decides "auto" unit_bytes and overlap_step as the engine does (one function each)
    and writes them: `train --config` then cuts the model into the units the planner printed and
    steps with the planned overlap."""
    (tmp_path / "model.json").write_text(json.dumps(TINY_TRAIN_MODEL))
    cfg = tmp_path / "plan.json"
    p = cli("plan", "--model", str(tmp_path / "model.json"), "--device", "cpu", "--seq-len", "32",
            "--cpu-memory", "3GiB", "-o", str(cfg))
    assert p.returncode == 0, p.stderr[-3000:]
    planned = json.loads(cfg.read_text())["pyinfinity"]
    assert isinstance(planned.get("unit_bytes"), int) and planned["unit_bytes"] > 0, planned
    assert planned.get("overlap_step") in (True, False), planned
    shards = int(re.search(r"parameters \([\d.]+ B\), (\d+) shards", p.stdout).group(1))
    p = cli("train", "--config", str(cfg), "--model-size", "tiny", "--steps", "1", "--seq", "32", "--corpus-bytes",
            "64KB", "--no-progress", "--json", str(tmp_path / "run.json"))
    assert p.returncode == 0, p.stderr[-3000:]
    used = json.loads((tmp_path / "run.json").read_text())["config"]["pyinfinity"]
    assert used["unit_bytes"] == planned["unit_bytes"] and used["overlap_step"] == planned["overlap_step"]
    placed = re.search(r"placed \d+ units \((\d+) shards\)", p.stderr)
    assert placed is not None and int(placed.group(1)) == shards, p.stderr[-3000:]
