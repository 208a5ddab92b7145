"""Crash and resume: a training process SIGKILLed in the middle of an optimizer step (or of a
checkpoint save) resumes from its last checkpoint in a new process, on the same swap directory
(the crashed run's stale files are cleaned at start), with losses identical to an uninterrupted
run; a torn checkpoint file is detected on load with a clear error."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap

import pytest
import torch

import pyinfinity
from pyinfinity.swap.ownership import MANIFEST_NAME, read_manifest
from tests.python.conftest import train_steps

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
STEPS = 8

# One training process. argv: swap dir, checkpoint dir, resume (0/1), checkpoint every k steps,
# stall_at (step whose optimizer writes stall), stall_in ("step" or "save").
_TRAIN = textwrap.dedent("""
    import logging, sys, threading, time
    import torch
    import pyinfinity
    from pyinfinity.swap import fault_injection, faults_injected
    from tests.python.conftest import TinyLM

    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    torch.set_num_threads(1)
    swap, ckpt, resume, every, stall_at, stall_in, steps = sys.argv[1:8]
    resume, every, stall_at, steps = int(resume), int(every), int(stall_at), int(steps)
    torch.manual_seed(0)
    model = TinyLM(vocab=48, d=32, layers=3)
    cfg = {"train_micro_batch_size_per_gpu": 2, "gradient_clipping": 1.0,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01}},
           "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 1e-2,
                                                        "warmup_num_steps": 4}},
           "zero_optimization": {"stage": 3, "offload_param": {"device": "nvme", "nvme_path": swap},
                                 "offload_optimizer": {"device": "nvme", "nvme_path": swap},
                                 "stage3_param_persistence_threshold": 0},
           "pyinfinity": {"device": "cpu", "device_memory": "64MiB"}}
    eng = pyinfinity.initialize(model, cfg)
    if resume:
        eng.load_checkpoint(ckpt)
    print("start", eng.global_steps, flush=True)

    def batch(i):  # the data of step i, whichever process runs it
        g = torch.Generator().manual_seed(1000 + i)
        x = torch.randint(0, 48, (2, 8), generator=g)
        return x, torch.randint(0, 48, (2, 8), generator=g)

    def stalled(what):  # the writes of `what` stall; say so once the first one is stuck
        n0 = faults_injected()
        def watch():
            while faults_injected() == n0:
                time.sleep(0.002)
            print("stalled", what, flush=True)
        threading.Thread(target=watch, daemon=True).start()
        return fault_injection(op="write", nth=1, action="stall", value=120_000)

    while eng.global_steps < steps:
        i = eng.global_steps + 1
        x, y = batch(i)
        loss = eng(x, y)
        eng.backward(loss)
        print("loss", i, repr(loss.item()), flush=True)
        if i == stall_at and stall_in == "step":
            with stalled("step"):
                eng.step()
                eng.synchronize()  # the step's writes run in the background: inside the stall
        else:
            eng.step()
            eng.synchronize()
        if i % every == 0:
            if i == stall_at and stall_in == "save":
                with stalled("save"):
                    eng.save_checkpoint(ckpt, by_reference=False)  # a copy: its writes are what stalls
            else:
                eng.save_checkpoint(ckpt)
            print("saved", i, flush=True)
    eng.close()
    print("done", flush=True)
""")


def _cmd(swap, ckpt, resume=0, every=2, stall_at=0, stall_in="step", steps=STEPS):
    return [sys.executable, "-c", _TRAIN, str(swap), str(ckpt), str(resume), str(every), str(stall_at),
            stall_in, str(steps)]


def _env():
    return {**os.environ, "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", "")}


def _losses(lines):
    return {int(p[1]): p[2] for p in (ln.split() for ln in lines) if p and p[0] == "loss"}


def _run(args, timeout=120):
    out = subprocess.run(args, capture_output=True, text=True, timeout=timeout, cwd=REPO, env=_env())
    assert out.returncode == 0, out.stderr
    return out.stdout.splitlines(), out.stderr


def _kill_when_stalled(args, what):
    """Runs until the process reports its writes stalled inside `what`, then SIGKILLs it."""
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO, env=_env())
    lines = []
    try:
        for line in proc.stdout:
            lines.append(line.strip())
            if line.strip() == f"stalled {what}":
                proc.send_signal(signal.SIGKILL)
                break
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert lines and lines[-1] == f"stalled {what}", (lines, proc.stderr.read())
    assert proc.returncode == -signal.SIGKILL
    return proc.pid, lines


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """Losses of an uninterrupted run (the same script, checkpointing as the others do)."""
    d = tmp_path_factory.mktemp("reference")
    lines, _ = _run(_cmd(d / "swap", d / "ckpt"))
    losses = _losses(lines)
    assert sorted(losses) == list(range(1, STEPS + 1)) and lines[-1] == "done"
    assert len(set(losses.values())) == STEPS  # the loss really moves
    return losses


def test_sigkill_mid_step_then_resume_gives_identical_losses(reference, tmp_path):
    swap, ckpt = tmp_path / "swap", tmp_path / "ckpt"
    pid, lines = _kill_when_stalled(_cmd(swap, ckpt, stall_at=5, stall_in="step"), "step")
    crashed = _losses(lines)
    assert crashed == {i: reference[i] for i in range(1, 6)}  # killed inside step 5's optimizer writes
    assert "saved 4" in lines and "saved 6" not in lines
    assert (ckpt / "latest").read_text() == "global_step4"
    # what the crash left: swap files, a manifest naming the dead process
    assert read_manifest(str(swap))["owner"]["pid"] == pid
    assert {"params.swp", "optimizer.swp"} <= set(os.listdir(swap))
    lines, err = _run(_cmd(swap, ckpt, resume=1))
    assert lines[0] == "start 4"
    resumed = _losses(lines)
    assert resumed == {i: reference[i] for i in range(5, STEPS + 1)}  # bit-identical, repr of the floats
    assert f"pid {pid}" in err and "ended without cleaning up" in err, err
    assert os.listdir(swap) == []


def test_sigkill_during_a_checkpoint_save_keeps_the_previous_checkpoint(reference, tmp_path):
    swap, ckpt = tmp_path / "swap", tmp_path / "ckpt"
    _, lines = _kill_when_stalled(_cmd(swap, ckpt, stall_at=4, stall_in="save"), "save")
    assert "saved 2" in lines and "saved 4" not in lines
    assert (ckpt / "latest").read_text() == "global_step2"  # never points at a half-written checkpoint
    half = [n for n in os.listdir(ckpt) if n.startswith(".global_step4.tmp-")]
    assert half and not (ckpt / "global_step4").exists()
    lines, err = _run(_cmd(swap, ckpt, resume=1))
    assert lines[0] == "start 2"
    assert _losses(lines) == {i: reference[i] for i in range(3, STEPS + 1)}
    assert not [n for n in os.listdir(ckpt) if ".tmp-" in n]  # the next save removed the torn one
    assert f"removed {ckpt / half[0]}" in err, err


def _dead_pid() -> int:
    p = subprocess.Popen(["true"])
    p.wait()
    return p.pid


def test_a_checkpoint_renamed_away_by_a_crash_is_put_back(tiny_lm, lm_batches, engine_config, tmp_path):
    """A crash between save_checkpoint's two renames (old copy moved aside, new one not yet in
    place) leaves the tag only as ``<tag>.old-<pid>``: the next load puts it back and loads it."""
    ckpt = tmp_path / "ckpt"
    batches = lm_batches(4)
    with pyinfinity.initialize(tiny_lm(), engine_config("nvme")) as eng:
        for x, y in batches[:2]:
            eng.backward(eng(x, y))
            eng.step()
        path = eng.save_checkpoint(str(ckpt), tag="mine")
        want = train_steps(eng, batches[2:])
    os.rename(path, f"{path}.old-{_dead_pid()}")
    with pyinfinity.initialize(tiny_lm(seed=5), engine_config("nvme")) as eng:
        eng.load_checkpoint(str(ckpt))
        assert eng.global_steps == 2 and os.path.isdir(path)
        got = train_steps(eng, batches[2:])
    assert got == want


# ----------------------------------------------------------------------------------- torn files


def _flip(path, offset):
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0x01]))


@pytest.mark.parametrize("damage, message", [
    ("flip_state", r"state\.bin bytes \[\d+, \d+\) \(shard \d+, optim\) fail their checksum"),
    ("truncate_state", r"state\.bin has \d+ bytes, \d+ expected \(torn\)"),
    ("truncate_meta", r"meta\.json fails its checksum"),
    ("truncate_rng", r"rng\.pt fails its checksum"),
    ("missing_tag", r"meta\.json missing or torn"),
])
def test_a_torn_checkpoint_is_detected_on_load(damage, message, tiny_lm, lm_batches, engine_config, tmp_path):
    ckpt = str(tmp_path / "ckpt")
    batches = lm_batches(3)
    with pyinfinity.initialize(tiny_lm(), engine_config("nvme")) as eng:
        for x, y in batches[:2]:
            eng.backward(eng(x, y))
            eng.step()
        path = eng.save_checkpoint(ckpt, by_reference=not damage.endswith("_state"))  # state.bin: copied
        meta = json.load(open(os.path.join(path, "meta.json")))
        if damage == "flip_state":
            e = meta["entries"][len(meta["entries"]) // 2]
            _flip(os.path.join(path, "state.bin"), e["offset"] + e["nbytes"] // 2)
        elif damage == "missing_tag":
            with open(os.path.join(ckpt, "latest"), "w") as f:
                f.write("global_step99")
        else:
            name = {"truncate_state": "state.bin", "truncate_meta": "meta.json", "truncate_rng": "rng.pt"}[damage]
            p = os.path.join(path, name)
            os.truncate(p, os.path.getsize(p) // 2)
        steps_before = eng.global_steps
        eng.backward(eng(*batches[2]))
        eng.step()
        with pytest.raises(ValueError, match=message) as ei:
            eng.load_checkpoint(ckpt)
        assert ckpt in str(ei.value)
        if damage != "flip_state":  # detected before anything was changed
            assert eng.global_steps == steps_before + 1
    assert not (tmp_path / "swap").exists()  # the engine created it and removed it at close
