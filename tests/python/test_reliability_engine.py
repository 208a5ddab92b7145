"""Engine-level reliability: swap directory ownership (lock, manifest, stale and foreign files,
free space), swap files changed under a running engine, impossible budgets, bad input at the
engine's entry points, misuse and use after close(). The I/O layer's own faults are in
test_swap_*.py; checkpoints killed mid-write in test_crash_resume.py."""
from __future__ import annotations

import errno
import json
import logging
import os
import random
import re
import signal
import subprocess
import sys
import textwrap

import pytest
import torch

import pyinfinity
from pyinfinity.config import ConfigError
from pyinfinity.swap.ownership import (LOCK_NAME, MANIFEST_NAME, MANIFEST_VERSION, CapacityError, SwapDirBusyError,
                                       SwapFileError, SwapSpaceTooSmall, read_manifest)

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _train(eng, batches):
    for x, y in batches:
        eng.backward(eng(x, y))
        eng.step()


def _listing(d) -> list[str]:
    """What is in ``d``; a directory the engine created and removed at close holds nothing."""
    return sorted(os.listdir(d)) if os.path.exists(d) else []


def _bytes(text: str) -> float:
    num, unit = text.split()
    return float(num) * {"B": 1, "KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30}[unit]


def _fmt(n: float) -> str:
    from pyinfinity.config import format_size
    return format_size(n)


# ----------------------------------------------------------------------------------- ownership


def test_manifest_lists_every_slot_and_close_leaves_the_directory_empty(tiny_lm, lm_batches, engine_config,
                                                                        tmp_path):
    swap = tmp_path / "swap"
    eng = pyinfinity.initialize(tiny_lm(), engine_config("nvme"))
    try:
        assert _listing(swap) == sorted([LOCK_NAME, "optimizer.swp", "params.swp", MANIFEST_NAME])
        m = read_manifest(str(swap))
        assert m["version"] == MANIFEST_VERSION and m["owner"]["pid"] == os.getpid()
        files = {f["name"]: f for f in m["files"]}
        shards = eng.partition.shards
        # one record per shard: key, dtype, shape and bytes agree with the partition
        p = {s["key"]: s for s in files["params.swp"]["slots"]}
        assert set(p) == {f"param.{s.index}" for s in shards}
        for s in shards:
            r = p[f"param.{s.index}"]
            assert (r["dtype"], r["shape"], r["nbytes"]) == (str(s.dtype).replace("torch.", ""), [s.numel], s.nbytes)
        o = {s["key"]: s for s in files["optimizer.swp"]["slots"]}
        assert sum(r["nbytes"] for r in o.values()) == 12 * sum(s.numel for s in shards)
        for name, f in files.items():  # the file holds every byte its slots need
            assert os.path.getsize(swap / name) >= f["nbytes"] == max(s["offset"] + s["nbytes"] for s in f["slots"])
            assert (f["dev"], f["ino"]) == (os.stat(swap / name).st_dev, os.stat(swap / name).st_ino)
        lock = json.loads((swap / LOCK_NAME).read_text())
        assert lock["pid"] == os.getpid() and lock["host"] == m["owner"]["host"]
        _train(eng, lm_batches(2))
        assert not [n for n in os.listdir(swap) if ".tmp-" in n]  # atomic writes leave no temporaries
    finally:
        eng.close()
    assert _listing(swap) == []


_HOLDER = textwrap.dedent("""
    import sys, time, torch, pyinfinity
    m = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 64))
    swap = sys.argv[1]
    cfg = {"zero_optimization": {"stage": 3, "offload_param": {"device": "nvme", "nvme_path": swap},
           "offload_optimizer": {"device": "nvme", "nvme_path": swap}}, "pyinfinity": {"device": "cpu"}}
    eng = pyinfinity.initialize(m, cfg)
    print("ready", flush=True)
    time.sleep(600)
""")


def test_second_run_is_refused_then_a_crashed_runs_files_are_cleaned(tiny_lm, engine_config, tmp_path, caplog):
    """Another process holds the swap directory: refused, naming the directory and its pid. Once it
    is SIGKILLed (lock free, manifest and swap files left), the next start removes its files with a
    warning naming the dead pid, and runs."""
    swap = tmp_path / "swap"
    proc = subprocess.Popen([sys.executable, "-c", _HOLDER, str(swap)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, cwd=REPO)
    try:
        assert proc.stdout.readline().strip() == "ready", proc.stderr.read()
        with pytest.raises(SwapDirBusyError) as ei:
            pyinfinity.initialize(tiny_lm(), engine_config("nvme"))
        assert ei.value.errno == errno.EBUSY and ei.value.filename == str(swap)
        assert f"pid {proc.pid}" in str(ei.value) and "in use" in str(ei.value)
        left = _listing(swap)
        assert {"params.swp", "optimizer.swp", MANIFEST_NAME} <= set(left)  # the holder's files untouched
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert _listing(swap) == left  # a SIGKILL leaves everything behind
    stale = read_manifest(str(swap))
    assert stale["owner"]["pid"] == proc.pid
    with caplog.at_level(logging.WARNING, logger="pyinfinity.swap.ownership"):
        eng = pyinfinity.initialize(tiny_lm(), engine_config("nvme"))
    try:
        msg = " ".join(r.getMessage() for r in caplog.records)
        assert f"pid {proc.pid}" in msg and "has exited" in msg and "params.swp" in msg, msg
        assert len(eng.state.ownership.cleaned) == 2
        assert read_manifest(str(swap))["owner"]["pid"] == os.getpid()
    finally:
        eng.close()
    assert _listing(swap) == []


_FORKER = textwrap.dedent("""
    import os, sys, time, torch, pyinfinity
    m = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 64))
    swap = sys.argv[1]
    cfg = {"zero_optimization": {"stage": 3, "offload_param": {"device": "nvme", "nvme_path": swap}},
           "pyinfinity": {"device": "cpu"}}
    eng = pyinfinity.initialize(m, cfg)
    child = os.fork()  # like a DataLoader worker: inherits the lock's open file
    if child == 0:
        null = os.open(os.devnull, os.O_WRONLY)
        os.dup2(null, 1)  # let the test's pipes close
        os.dup2(null, 2)
        time.sleep(120)
        os._exit(0)
    print(child, flush=True)
    os._exit(0)  # the owner dies without cleaning up; its child lives on
""")


def test_a_lock_inherited_by_a_forked_child_is_explained(tiny_lm, engine_config, tmp_path):
    swap = tmp_path / "swap"
    out = subprocess.run([sys.executable, "-c", _FORKER, str(swap)], capture_output=True, text=True, cwd=REPO,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    child = int(out.stdout.split()[0])
    try:
        owner = read_manifest(str(swap))["owner"]["pid"]
        with pytest.raises(SwapDirBusyError) as ei:
            pyinfinity.initialize(tiny_lm(), engine_config("nvme"))
        msg = str(ei.value)
        assert f"pid {owner}" in msg and "has exited" in msg and "DataLoader worker" in msg, msg
    finally:
        os.kill(child, signal.SIGKILL)
    for _ in range(200):  # the child is reparented; wait until the kernel dropped its lock
        try:
            with pyinfinity.initialize(tiny_lm(), engine_config("nvme")):
                break
        except SwapDirBusyError:
            import time
            time.sleep(0.05)
    else:
        pytest.fail("the lock was not released after its last holder died")
    assert _listing(swap) == []


def test_owner_liveness_tells_dead_zombie_reused_and_foreign_owners_apart():
    from pyinfinity.swap.ownership import Owner

    me = Owner.current()
    assert me.alive() is True
    init = Owner.from_dict({**me.__dict__, "pid": 1})
    assert init.alive() is False  # pid 1 runs, but not since our start time: a reused pid
    assert Owner.from_dict({**me.__dict__, "boot_id": "another-boot"}).alive() is False
    assert Owner.from_dict({**me.__dict__, "host": "another-host"}).alive() is None  # cannot tell
    zombie = subprocess.Popen(["true"])
    try:
        for _ in range(200):  # exited, not yet reaped
            with open(f"/proc/{zombie.pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                    break
            import time
            time.sleep(0.01)
        assert Owner.from_dict({**me.__dict__, "pid": zombie.pid, "proc_start": None}).alive() is False
    finally:
        zombie.wait()
    assert Owner.from_dict({**me.__dict__, "pid": zombie.pid, "proc_start": None}).alive() is False


def test_a_foreign_swap_file_is_refused_and_left_intact(tiny_lm, engine_config, tmp_path):
    swap = tmp_path / "swap"
    swap.mkdir()
    foreign = swap / "params.swp"
    foreign.write_bytes(b"somebody else's data" * 100)
    with pytest.raises(SwapFileError) as ei:
        pyinfinity.initialize(tiny_lm(), engine_config("nvme"))
    assert ei.value.errno == errno.EEXIST and ei.value.filename == str(foreign)
    assert "no pyinfinity manifest claims it" in str(ei.value)
    assert foreign.read_bytes() == b"somebody else's data" * 100
    assert _listing(swap) == ["params.swp"]  # nothing written, lock given back


@pytest.mark.parametrize("kind", ["other_host", "newer_version", "torn", "bad_name"])
def test_a_manifest_that_is_not_ours_to_clean_is_reported(kind, tiny_lm, engine_config, tmp_path):
    swap = tmp_path / "swap"
    swap.mkdir()
    (swap / "params.swp").write_bytes(b"x" * 4096)
    owner = {"pid": 1, "host": "another-host", "started": 0.0}
    m = {"format": "pyinfinity-swap-manifest", "version": MANIFEST_VERSION, "owner": owner,
         "files": [{"name": "params.swp", "nbytes": 4096}]}
    if kind == "newer_version":
        m["version"] = MANIFEST_VERSION + 1
    if kind == "bad_name":
        m["owner"] = {"pid": 2 ** 22 + 1, "host": os.uname().nodename, "started": 0.0}  # a dead pid here
        m["files"] = [{"name": "../../etc/passwd"}]
    text = json.dumps(m)
    (swap / MANIFEST_NAME).write_text(text[:len(text) // 2] if kind == "torn" else text)
    with pytest.raises(SwapFileError) as ei:
        pyinfinity.initialize(tiny_lm(), engine_config("nvme"))
    assert ei.value.filename == str(swap / MANIFEST_NAME)
    want = {"other_host": "another-host", "newer_version": "newer", "torn": "cannot be read",
            "bad_name": "invalid file name"}[kind]
    assert want in str(ei.value)
    assert (swap / "params.swp").read_bytes() == b"x" * 4096  # left alone, and its manifest too
    assert (swap / MANIFEST_NAME).read_text() == (text[:len(text) // 2] if kind == "torn" else text)
    assert _listing(swap) == sorted(["params.swp", MANIFEST_NAME])  # lock given back


def _overwrite_in_place(path, data):
    """Corrupts a swap file without changing its size: prefetches of the last forward may still be
    in flight, and a file shrunk under them (truncate to 0, then back) reads as a short transfer
    (ENODATA) rather than as corruption, which made these tests flaky."""
    fd = os.open(path, os.O_WRONLY)
    try:
        assert os.pwrite(fd, data, 0) == len(data)
        os.fsync(fd)
    finally:
        os.close(fd)


def test_swap_file_truncated_or_changed_under_a_running_engine(tiny_lm, lm_batches, engine_config):
    """Truncated: the next step raises naming the file and the bytes (no step on lost state).
    Zeroed behind the engine's back with pyinfinity.checksums: the read raises EBADMSG naming the
    file and the slot, instead of training on zeros."""
    cfg = engine_config("nvme", pyinfinity={"device": "cpu", "device_memory": "64MiB", "checksums": True})
    (x, y), = lm_batches(1)
    with pyinfinity.initialize(tiny_lm(), cfg) as eng:
        _train(eng, [(x, y)])
        # the background step may still be writing new weights (O_DIRECT): a buffered write racing it
        # makes the kernel flag the file's page cache (EIO at the fsync below)
        eng.synchronize()
        path = eng.param_swapper.files()[0]
        size = os.path.getsize(path)
        # the same bytes as zeros: size checks pass, checksums do not
        _overwrite_in_place(path, bytes(size))
        with pytest.raises(OSError) as ei:
            eng(x, y)
        assert ei.value.errno == errno.EBADMSG and ei.value.filename == path
        assert "checksum mismatch" in str(ei.value) and "param." in str(ei.value)
    # overlap_step off: with it, backward's background step is still writing optimizer states when
    # the file is cut, and a late write regrows it (to some size short of what the slots need)
    with pyinfinity.initialize(tiny_lm(), engine_config("nvme", pyinfinity={"device": "cpu", "device_memory": "64MiB",
                                                                            "overlap_step": False})) as eng:
        _train(eng, [(x, y)])
        eng.backward(eng(x, y))
        path = eng.optim_swapper.files()[0]
        need = read_manifest(os.path.dirname(path))["files"]
        need = next(f["nbytes"] for f in need if f["name"] == "optimizer.swp")
        os.truncate(path, need // 2)
        with pytest.raises(SwapFileError) as ei:
            eng.step()
        assert ei.value.errno == errno.EIO and ei.value.filename == path
        assert f"has {need // 2} bytes" in str(ei.value) and f"need {need}" in str(ei.value)


def test_swap_directory_removed_under_a_running_engine_is_warned_and_training_goes_on(
        tiny_lm, lm_batches, engine_config, tmp_path, caplog):
    import shutil

    batches = lm_batches(3)
    with pyinfinity.initialize(tiny_lm(), engine_config("nvme")) as eng:
        _train(eng, batches[:1])
        shutil.rmtree(tmp_path / "swap")
        with caplog.at_level(logging.WARNING, logger="pyinfinity.swap.ownership"):
            _train(eng, batches[1:])
        assert any("was removed under the running engine" in r.getMessage() for r in caplog.records)
        got = [r.loss for r in eng.history]
    with pyinfinity.initialize(tiny_lm(), engine_config("nvme")) as ref:
        _train(ref, batches)
        assert [r.loss for r in ref.history] == got  # the open files kept every byte


# ----------------------------------------------------------------------------------- bad paths, budgets


def test_missing_swap_path_is_created_with_a_warning_naming_its_filesystem_and_removed(
        tiny_lm, lm_batches, engine_config, tmp_path, caplog):
    """As DeepSpeed, a missing nvme_path is created (with its parents); unlike it, the warning
    says which filesystem it landed on, and close removes what the engine created, unless
    someone else has put a file there since."""
    from pyinfinity.swap.ownership import mount_of

    cfg = engine_config("nvme")
    deep = str(tmp_path / "a" / "b" / "swap")
    for sec in ("offload_param", "offload_optimizer"):
        cfg["zero_optimization"][sec]["nvme_path"] = deep
    with caplog.at_level(logging.WARNING, logger="pyinfinity"):
        with pyinfinity.initialize(tiny_lm(), cfg) as eng:
            assert os.path.isdir(deep)
            _train(eng, lm_batches(1))
    msg = [r.getMessage() for r in caplog.records if "did not exist" in r.getMessage()]
    assert len(msg) == 1 and deep in msg[0] and f"mounted at {mount_of(deep)[0]} " in msg[0], msg
    assert not os.path.exists(tmp_path / "a") and os.path.isdir(tmp_path)
    with pyinfinity.initialize(tiny_lm(), cfg) as eng:
        with open(tmp_path / "a" / "theirs.txt", "w") as f:
            f.write("kept")
        _train(eng, lm_batches(1))
    assert _listing(tmp_path / "a") == ["theirs.txt"]  # only the empty directories it made are removed


@pytest.mark.parametrize("kind", ["not_a_directory", "read_only"])
def test_unusable_swap_path_names_it(kind, tiny_lm, engine_config, tmp_path, readonly_dir):
    cfg = engine_config("nvme")
    if kind == "not_a_directory":
        path = tmp_path / "plain_file"
        path.write_text("x")
    else:
        path = readonly_dir
    cfg["zero_optimization"]["offload_param"]["nvme_path"] = str(path)
    with pytest.raises(ConfigError) as ei:
        pyinfinity.initialize(tiny_lm(), cfg)
    assert "zero_optimization.offload_param.nvme_path" in str(ei.value) or "nvme_path" in str(ei.value)
    assert str(path) in str(ei.value)


def _mid_model(tiny_lm):
    return tiny_lm(d=128, layers=4, tie=False)  # ~0.28 M params: 1.1 MB fp32, optimizer 3.3 MB


def test_full_swap_path_fails_at_start_with_the_numbers(tiny_lm, engine_config, tiny_tmpfs_dir):
    cfg = engine_config("nvme")
    for sec in ("offload_param", "offload_optimizer"):
        cfg["zero_optimization"][sec]["nvme_path"] = tiny_tmpfs_dir
    # what RELIABILITY.md promises: a ConfigError that is also OSError(ENOSPC), naming the directory
    with pytest.raises(SwapSpaceTooSmall) as ei:
        pyinfinity.initialize(_mid_model(tiny_lm), cfg)
    assert isinstance(ei.value, ConfigError) and ei.value.errno == errno.ENOSPC
    assert ei.value.filename == tiny_tmpfs_dir
    assert re.search(r"they need [\d.]+ \w+ .* has [\d.]+ \w+ free: [\d.]+ \w+ missing", str(ei.value)), ei.value
    assert _listing(tiny_tmpfs_dir) == []  # nothing written


def test_one_full_directory_of_several_fails_at_start_naming_it(tiny_lm, engine_config, tmp_path, tiny_tmpfs_dir):
    """The total free space suffices but one stripe's filesystem does not: ENOSPC naming that
    directory, what is needed there and what is missing, before anything is written."""
    cfg = engine_config("nvme")
    roomy = str(tmp_path / "roomy")
    for sec in ("offload_param", "offload_optimizer"):
        cfg["zero_optimization"][sec]["nvme_path"] = [roomy, tiny_tmpfs_dir]
    with pytest.raises(OSError) as ei:
        pyinfinity.initialize(_mid_model(tiny_lm), cfg)
    assert ei.value.errno == errno.ENOSPC and ei.value.filename == tiny_tmpfs_dir
    msg = str(ei.value)
    m = re.search(r"they need ([\d.]+ \w+) .* has ([\d.]+ \w+) free: ([\d.]+ \w+) missing", msg)
    assert m and "params" in msg and "optimizer" in msg, msg
    assert _bytes(m.group(1)) > (1 << 20) >= _bytes(m.group(2))  # more than the 1 MiB filesystem holds
    assert abs(_bytes(m.group(1)) - _bytes(m.group(2)) - _bytes(m.group(3))) < 0.01 * _bytes(m.group(1))
    assert _listing(tiny_tmpfs_dir) == [] and _listing(roomy) == []


def test_swap_files_fit_a_small_disk_that_holds_the_state(tiny_lm, lm_batches, engine_config, tmpfs_dir):
    """Preallocation is sized from the need (not 256 MiB steps), so a 64 MiB filesystem holds a
    model whose swap state is a few MiB."""
    cfg = engine_config("nvme")
    for sec in ("offload_param", "offload_optimizer"):
        cfg["zero_optimization"][sec]["nvme_path"] = tmpfs_dir
    with pyinfinity.initialize(_mid_model(tiny_lm), cfg) as eng:
        _train(eng, lm_batches(1))
        used = sum(os.path.getsize(f) for f in eng.param_swapper.files() + eng.optim_swapper.files())
        assert used < 16 << 20
    assert _listing(tmpfs_dir) == []


def test_impossible_budgets_say_what_is_missing_and_where(tiny_lm, engine_config):
    model = _mid_model(tiny_lm)
    n = sum(p.numel() for p in model.parameters())
    cfg = engine_config("cpu", pyinfinity={"device": "cpu", "device_memory": "64MiB", "host_memory": "1MiB"})
    with pytest.raises(CapacityError) as ei:
        pyinfinity.initialize(model, cfg)
    msg = str(ei.value)
    need = n * 4 + n * 12  # params + master/moments in RAM (the gradients land in the parameter homes)
    assert "pyinfinity.host_memory" in msg and f"host RAM: {_fmt(need)}" in msg, msg
    assert f"{_fmt(need - (1 << 20))} missing" in msg, msg
    largest = max(sum(p.numel() for p in m.parameters(recurse=False)) for m in model.modules()) * 4
    cfg = engine_config("nvme", pyinfinity={"device": "cpu", "device_memory": "16KiB"})
    with pytest.raises(CapacityError) as ei:
        pyinfinity.initialize(model, cfg)
    msg = str(ei.value)
    assert "pyinfinity.device_memory" in msg and f"{_fmt(largest - (16 << 10))} missing" in msg, msg


# ----------------------------------------------------------------------------------- misuse


def test_misuse_of_the_training_calls(tiny_lm, lm_batches, engine_config):
    (x, y), = lm_batches(1)
    with pyinfinity.initialize(tiny_lm(), engine_config("cpu")) as eng:
        before = eng.state.trained_values(eng.partition.shards[1]).clone()
        with pytest.raises(RuntimeError, match=r"step\(\): no backward\(\)"):
            eng.step()
        assert eng.global_steps == 0 and eng.micro_steps == 0
        torch.testing.assert_close(eng.state.trained_values(eng.partition.shards[1]), before, rtol=0, atol=0)
        with pytest.raises(TypeError, match="loss: .*got float"):
            eng.backward(3.0)
        with torch.no_grad():
            detached = eng(x, y)
        with pytest.raises(TypeError, match="loss: .*without grad"):
            eng.backward(detached)
        eng.backward(eng(x, y))
        assert eng.step() is not None and eng.global_steps == 1


def test_every_training_entry_point_refuses_use_after_close(tiny_lm, lm_batches, engine_config, tmp_path):
    (x, y), = lm_batches(1)
    eng = pyinfinity.initialize(tiny_lm(), engine_config("nvme"))
    _train(eng, [(x, y)])
    ckpt = eng.save_checkpoint(str(tmp_path / "ckpt"))
    loss = eng(x, y)
    eng.close()
    calls = {"forward": lambda: eng(x, y), "backward": lambda: eng.backward(loss), "step": eng.step,
             "save_checkpoint": lambda: eng.save_checkpoint(str(tmp_path / "ckpt2")),
             "load_checkpoint": lambda: eng.load_checkpoint(os.path.dirname(ckpt)),
             "export": lambda: eng.export(str(tmp_path / "out"))}
    for name, call in calls.items():
        with pytest.raises(RuntimeError, match=r"used after close\(\)"):
            call()
    assert not (tmp_path / "ckpt2").exists() and not (tmp_path / "out").exists()
    assert _listing(tmp_path / "swap") == []


def test_a_checkpoint_load_recovers_from_a_corrupted_swap_file(tiny_lm, lm_batches, engine_config, tmp_path):
    cfg = engine_config("nvme", pyinfinity={"device": "cpu", "device_memory": "64MiB", "checksums": True})
    (x, y), = lm_batches(1)
    with pyinfinity.initialize(tiny_lm(), cfg) as eng:
        _train(eng, [(x, y)])
        eng.save_checkpoint(str(tmp_path / "ckpt"))
        want = eng(x, y).item()
        path = eng.param_swapper.files()[0]
        _overwrite_in_place(path, random.Random(0).randbytes(os.path.getsize(path)))
        with pytest.raises(OSError) as ei:
            eng(x, y)
        assert ei.value.errno == errno.EBADMSG
        eng.load_checkpoint(str(tmp_path / "ckpt"))  # rewrites every home
        assert eng(x, y).item() == want


_EXITER = textwrap.dedent("""
    import sys, torch, pyinfinity
    m = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 64))
    swap = sys.argv[1]
    cfg = {"zero_optimization": {"stage": 3, "offload_param": {"device": "nvme", "nvme_path": swap},
           "offload_optimizer": {"device": "nvme", "nvme_path": swap}}, "pyinfinity": {"device": "cpu"}}
    eng = pyinfinity.initialize(m, cfg)
    eng.backward(eng(torch.randn(2, 64)).square().mean())
    eng.step()
    print(len(eng.param_swapper.files() + eng.optim_swapper.files()), flush=True)
    if sys.argv[2] == "raise":
        raise RuntimeError("the training script fails")
""")


@pytest.mark.parametrize("how", ["normal", "raise"])
def test_interpreter_exit_without_close_leaves_the_directory_empty(how, tmp_path):
    swap = tmp_path / "swap"
    out = subprocess.run([sys.executable, "-c", _EXITER, str(swap), how], capture_output=True, text=True,
                         cwd=REPO, timeout=120)
    assert out.returncode == (0 if how == "normal" else 1), out.stderr
    assert out.stdout.split() == ["2"]
    assert _listing(swap) == []  # swap files, manifest and lock


@pytest.mark.parametrize("section, value, key, hint", [
    ("pyinfinity", {"device": "cpu", "checksum": True}, "pyinfinity.checksum", "'checksums'"),
    ("pyinfinity", {"device": "cpu", "checksums": "yes"}, "pyinfinity.checksums", "true or false"),
])
def test_config_typos_fail_before_the_swap_directory_is_touched(section, value, key, hint, tiny_lm, engine_config,
                                                                  tmp_path):
    cfg = engine_config("nvme", **{section: value})
    with pytest.raises(ConfigError) as ei:
        pyinfinity.initialize(tiny_lm(), cfg)
    assert key in str(ei.value) and hint in str(ei.value), str(ei.value)
    assert not (tmp_path / "swap").exists() or _listing(tmp_path / "swap") == []


def test_checksums_change_nothing_but_the_verification(tiny_lm, lm_batches, engine_config):
    batches = lm_batches(4)
    losses = {}
    for on in (False, True):
        cfg = engine_config("nvme", gradient_accumulation_steps=2,
                            pyinfinity={"device": "cpu", "device_memory": "64MiB", "checksums": on})
        with pyinfinity.initialize(tiny_lm(), cfg) as eng:
            assert eng.param_swapper.space.checksums is on and eng.optim_swapper.space.checksums is on
            _train(eng, batches)
            losses[on] = [r.loss for r in eng.history]
    assert len(losses[True]) == 2 and losses[True] == losses[False]
