"""Nothing silently wrong after a failure: damaged checkpoint metadata, failed saves, SIGTERM,
Ctrl-C during a stuck wait, and misuse. Each case is refused with an error naming what is wrong,
or completes correctly; none loads or trains on wrong state."""
from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch

import pyinfinity
from pyinfinity import checkpoint
from pyinfinity.checkpoint import CHECKSUMS_NAME, CheckpointError
from tests.python.conftest import sigint_default, train_steps

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _env():
    return {**os.environ, "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", "")}


def _snapshot(eng):
    """What a load changes: counters, learning rates, scaler, RNG, trained values of every shard."""
    return (eng.global_steps, eng.micro_steps, [g["lr"] for g in eng.optimizer.param_groups],
            dict(eng.scaler.state_dict()), torch.get_rng_state().clone(),
            [eng.state.trained_values(sh).clone() for sh in eng.partition.shards])


def _same(a, b):
    return a[:4] == b[:4] and torch.equal(a[4], b[4]) and all(torch.equal(x, y) for x, y in zip(a[5], b[5]))


# ----------------------------------------------------------------------------------- checkpoint metadata

FLIPS = 100  # random bit flips per file


@pytest.fixture
def saved(tiny_lm, lm_batches, engine_config, tmp_path):
    """An engine trained 2 steps with a checkpoint of step 2, then trained one step more."""
    sched = {"type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 1e-2, "warmup_num_steps": 5}}
    eng = pyinfinity.initialize(tiny_lm(), engine_config("nvme", scheduler=sched))
    batches = lm_batches(4)
    train_steps(eng, batches[:2])
    # the NVMe state copied into state.bin (by_reference=False): its entries are what tests damage
    path = eng.save_checkpoint(str(tmp_path / "ckpt"), client_state={"epoch": 1}, by_reference=False)
    train_steps(eng, batches[2:3])
    yield eng, path, batches
    eng.close()


def _bad_copy(path, tmp_path, name, mutate):
    d = tmp_path / "bad" / os.path.basename(path)
    shutil.rmtree(d.parent, ignore_errors=True)
    shutil.copytree(path, d)
    p = d / name
    data = bytearray(p.read_bytes())
    mutate(data)
    p.write_bytes(bytes(data))
    return str(d.parent), d


@pytest.mark.parametrize("name", ["meta.json", "rng.pt"])
def test_random_bit_flips_in_metadata_are_refused_before_any_state_changes(name, saved, tmp_path):
    eng, path, batches = saved
    rnd = random.Random(16)
    before = _snapshot(eng)
    refused = 0
    for _ in range(FLIPS):
        size = os.path.getsize(os.path.join(path, name))
        at, bit = rnd.randrange(size), rnd.randrange(8)

        def flip(data):
            data[at] ^= 1 << bit
        load_dir, d = _bad_copy(path, tmp_path, name, flip)
        with pytest.raises(CheckpointError) as ei:
            eng.load_checkpoint(load_dir, tag=d.name)
        assert name in str(ei.value) and str(d) in str(ei.value)
        refused += 1
        assert _same(_snapshot(eng), before), f"flip of bit {bit} at byte {at} of {name} changed the engine"
    assert refused == FLIPS
    # the engine still trains, and a good load gives the checkpoint's state
    train_steps(eng, batches[3:])
    _, client = eng.load_checkpoint(os.path.dirname(path))
    assert client == {"epoch": 1} and eng.global_steps == 2


def _edit_meta(path, tmp_path, edit, fix_checksum):
    def mutate(data):
        meta = json.loads(data)
        edit(meta)
        data[:] = json.dumps(meta).encode()
    load_dir, d = _bad_copy(path, tmp_path, "meta.json", mutate)
    if fix_checksum:  # a deliberate edit with its checksum recomputed: the metadata checks must catch it
        sums = json.loads((d / CHECKSUMS_NAME).read_text())
        raw = (d / "meta.json").read_bytes()
        sums["files"]["meta.json"] = {"nbytes": len(raw), "crc32c": checkpoint._crc32c_bytes(raw)}
        (d / CHECKSUMS_NAME).write_text(json.dumps(sums))
    return load_dir, d


def _set(key, value):
    def edit(meta):
        obj = meta
        *parts, last = key
        for p in parts:
            obj = obj[p]
        obj[last] = value
    return edit


EDITS = {  # id: (edit, message when the checksum is recomputed)
    "shard 2->3": (_set(("entries", 2, "shard"), 3), r"entries\[2\]: numel \d+, nbytes \d+; shard 3 needs"),
    "shard out of range": (_set(("entries", 0, "shard"), 999), r"entries\[0\]\.shard: 999 is out of range"),
    "step above global_steps": (_set(("entries", 1, "step"), 7), r"entries\[1\]\.step: 7 is above global_steps"),
    "step negative": (_set(("entries", 1, "step"), -1), r"entries\[1\]\.step: expected an integer >= 0"),
    "lr list length": (_set(("lr",), [0.1, 0.2]), r"lr: expected a list of 1 learning rate"),
    "lr a string": (_set(("lr",), ["0.1"]), r"lr\[0\]: expected a finite number"),
    "global_steps a float": (_set(("global_steps",), 2.5), r"global_steps: expected an integer"),
    "micro_steps below global": (_set(("micro_steps",), 1), r"micro_steps: 1 is below global_steps"),
    "offset outside": (_set(("entries", 0, "offset"), 1 << 40), r"entries\[0\]\.offset: .* inside data_bytes"),
    "offset overlapping": (_set(("entries", 1, "offset"), 0), r"entries\[\d\]\.offset: 0 overlaps"),
    "key missing": (lambda m: m.pop("scaler"), r"missing keys \['scaler'\]"),
    "entry missing": (lambda m: m["entries"].pop(), r"entries: no entry for shard"),
    "scheduler garbage": (_set(("scheduler",), {"x": 1}), r"scheduler: keys \['x'\]"),
}


@pytest.mark.parametrize("fix_checksum", [False, True], ids=["as-is", "checksum-recomputed"])
@pytest.mark.parametrize("what", list(EDITS))
def test_targeted_metadata_edits_are_refused(what, fix_checksum, saved, tmp_path):
    eng, path, _ = saved
    edit, message = EDITS[what]
    before = _snapshot(eng)
    load_dir, d = _edit_meta(path, tmp_path, edit, fix_checksum)
    with pytest.raises(CheckpointError, match="meta.json") as ei:
        eng.load_checkpoint(load_dir, tag=d.name)
    assert str(d) in str(ei.value)
    if fix_checksum:
        assert ei.match(message)
    else:
        assert ei.match("fails its checksum")
    assert _same(_snapshot(eng), before)


def test_a_different_model_says_which_shard_differs(saved, tiny_lm, engine_config, tmp_path):
    _, path, _ = saved
    cfg = engine_config("cpu")
    cfg["zero_optimization"]["offload_param"]["nvme_path"] = str(tmp_path / "swap2")
    with pyinfinity.initialize(tiny_lm(d=32), cfg) as other:
        with pytest.raises(CheckpointError, match=r"different model/partition \(\d+ shards there, \d+ here\); the "
                           r"first difference is at shard 0: checkpoint has shard 0 of module 'embed': 1152 "
                           r"elements of torch.float32, this model has shard 0 of module 'embed': 1536 elements"):
            other.load_checkpoint(os.path.dirname(path))


def test_a_state_bin_entry_failing_its_checksum_refuses_training_until_a_good_load(saved, tmp_path):
    eng, path, batches = saved
    meta = json.loads(open(os.path.join(path, "meta.json")).read())
    e = meta["entries"][-1]  # the last one: the others were loaded already

    def flip(data):
        data[e["offset"] + 5] ^= 0x10
    load_dir, d = _bad_copy(path, tmp_path, "state.bin", flip)
    with pytest.raises(CheckpointError, match=r"state\.bin bytes .* fail their checksum"):
        eng.load_checkpoint(load_dir, tag=d.name)
    for call in (lambda: eng.backward(eng(*batches[0])), eng.step,
                 lambda: eng.save_checkpoint(str(tmp_path / "other"))):
        with pytest.raises(RuntimeError, match="failed part-way"):
            call()
    eng.load_checkpoint(os.path.dirname(path))
    train_steps(eng, batches[3:])
    assert eng.global_steps == 3


def test_a_version_1_checkpoint_without_checksums_still_loads(saved, tmp_path, caplog):
    """Version 1 had neither checksums.json nor a CRC-32C per state.bin entry: it loads, with a
    warning saying what cannot be verified."""
    eng, path, _ = saved

    def v1(data):
        meta = json.loads(data)
        meta["version"] = 1
        for e in meta["entries"]:
            del e["crc32c"]
        del meta["hyperparameters"]
        data[:] = json.dumps(meta).encode()
    load_dir, d = _bad_copy(path, tmp_path, "meta.json", v1)
    os.unlink(d / CHECKSUMS_NAME)
    with caplog.at_level("WARNING", logger="pyinfinity"):
        eng.load_checkpoint(load_dir, tag=d.name)
    assert eng.global_steps == 2
    assert "cannot be verified, nor the" in caplog.text and "entries saved without a CRC-32C" in caplog.text
    os.unlink(os.path.join(path, CHECKSUMS_NAME))  # a version 2 checkpoint must have it
    with pytest.raises(CheckpointError, match=f"{CHECKSUMS_NAME} missing"):
        eng.load_checkpoint(os.path.dirname(path))


# ----------------------------------------------------------------------------------- failed saves


def test_a_save_that_runs_out_of_space_names_the_file_and_leaves_nothing(tiny_lm, lm_batches, engine_config,
                                                                          tiny_tmpfs_dir, monkeypatch):
    with pyinfinity.initialize(tiny_lm(), engine_config("cpu")) as eng:
        train_steps(eng, lm_batches(1))
        # fill the 1 MiB filesystem so that state.bin fits and meta.json does not
        big = os.path.join(tiny_tmpfs_dir, "filler")
        st = os.statvfs(tiny_tmpfs_dir)
        state_bytes = sum(-(-(3 * sh.numel * 4) // 4096) * 4096 for sh in eng.partition.shards)
        with open(big, "wb") as f:
            f.write(b"\0" * (st.f_bavail * st.f_frsize - state_bytes - 8192))
        save_dir = os.path.join(tiny_tmpfs_dir, "ckpt")
        with pytest.raises(OSError) as ei:
            eng.save_checkpoint(save_dir)
        assert ei.value.errno == 28
        assert ei.value.filename and os.path.basename(ei.value.filename) in ("state.bin", "meta.json", "rng.pt")
        assert os.listdir(save_dir) == []  # no temporary directory left for the rest of the run
        os.unlink(big)
        path = eng.save_checkpoint(save_dir)  # space back: the next save works
        assert sorted(os.listdir(save_dir)) == ["global_step1", "latest"]
        assert sorted(os.listdir(path)) == [CHECKSUMS_NAME, "meta.json", "rng.pt", "state.bin"]


def test_meta_json_out_of_space_names_the_file(tiny_lm, lm_batches, engine_config, tmp_path, monkeypatch):
    real_open = os.open

    def open_full(path, flags, *args, **kw):  # meta.json lands on /dev/full: ENOSPC at its first write
        if str(path).endswith("meta.json") and flags & os.O_WRONLY:
            return real_open("/dev/full", os.O_WRONLY)
        return real_open(path, flags, *args, **kw)
    with pyinfinity.initialize(tiny_lm(), engine_config("cpu")) as eng:
        train_steps(eng, lm_batches(1))
        monkeypatch.setattr(os, "open", open_full)
        with pytest.raises(OSError, match=r"No space left on device: writing checkpoint file meta\.json") as ei:
            eng.save_checkpoint(str(tmp_path / "ckpt"))
        monkeypatch.undo()
        assert ei.value.errno == 28 and ei.value.filename.endswith("meta.json")
        assert os.listdir(tmp_path / "ckpt") == []


# ----------------------------------------------------------------------------------- signals

_SIGTERM_RUN = textwrap.dedent("""
    import signal, sys, torch, pyinfinity
    swap, mode = sys.argv[1], sys.argv[2]
    if mode == "handler":
        def on_term(signum, frame):
            print("app handler", flush=True)
            sys.exit(3)
        signal.signal(signal.SIGTERM, on_term)
    elif mode == "ignore":
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    m = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 64))
    cfg = {"zero_optimization": {"stage": 3, "offload_param": {"device": "nvme", "nvme_path": swap},
           "offload_optimizer": {"device": "nvme", "nvme_path": swap}}, "pyinfinity": {"device": "cpu"}}
    eng = pyinfinity.initialize(m, cfg)
    x = torch.randn(4, 64)
    i = 0
    while i < (300 if mode == "ignore" else 10**9):
        eng.backward(eng(x).square().mean())
        eng.step()
        i += 1
        if i == 2:
            print("ready", flush=True)
    eng.close()
    print("finished", flush=True)
""")


@pytest.mark.parametrize("mode, rc", [("default", -signal.SIGTERM), ("handler", 3), ("ignore", 0)])
def test_sigterm_removes_swap_files_and_keeps_the_previous_disposition(mode, rc, tmp_path):
    swap = tmp_path / "swap"
    proc = subprocess.Popen([sys.executable, "-c", _SIGTERM_RUN, str(swap), mode], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=_env())
    try:
        assert proc.stdout.readline().strip() == "ready"
        assert len(list(swap.glob("*.swp"))) == 2
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == rc, err
    if mode == "handler":
        assert out.strip() == "app handler"
    if mode == "ignore":
        assert out.strip() == "finished"  # SIGTERM ignored: the run went on to its end
    assert not swap.exists()  # swap files, manifest, lock and the directory the engine created


_STALL_RUN = textwrap.dedent("""
    import os, sys, time, torch
    from pyinfinity.swap import SwapEngine, fault_injection
    eng = SwapEngine(backend="posix")
    buf = torch.zeros(1 << 16, dtype=torch.uint8)
    with fault_injection(op="write", action="stall", value=4000):
        req = eng.write(buf, sys.argv[1], 0)
        print("waiting", flush=True)
        t0 = time.perf_counter()
        try:
            req.wait()
            print("finished", time.perf_counter() - t0, flush=True)
        except KeyboardInterrupt:
            print("interrupted", time.perf_counter() - t0, flush=True)
        req.wait()  # the transfer itself goes on; its buffer stays owned until it is done
""")


def test_ctrl_c_interrupts_a_stuck_wait_promptly(tmp_path):
    proc = subprocess.Popen([sys.executable, "-c", _STALL_RUN, str(tmp_path / "f.bin")], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=_env(), preexec_fn=sigint_default)
    try:
        assert proc.stdout.readline().strip() == "waiting"
        time.sleep(0.5)
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, err
    what, seconds = out.split()
    assert what == "interrupted" and float(seconds) < 0.5 + 1.0, out


# A background step whose NVMe write stalls 4 s; synchronize() or save_checkpoint() waits on it
_STALLED_STEP = textwrap.dedent("""
    import os, sys, threading, time
    from pyinfinity.swap.faults import fault_injection, faults_injected
    from tests.python import fault_sweep

    root, call = sys.argv[1], sys.argv[2]
    eng = fault_sweep._engine(root, "clipped")
    batches = fault_sweep._batches()
    fault_sweep._train(eng, batches[:1])
    eng.backward(eng(*batches[1]))
    n0 = faults_injected()

    def watch():
        while faults_injected() == n0:
            time.sleep(0.002)
        print("stalled", flush=True)

    threading.Thread(target=watch, daemon=True).start()
    with fault_injection(op="write", nth=1, action="stall", value=4000):
        eng.step()
        try:
            eng.synchronize() if call == "synchronize" else eng.save_checkpoint(os.path.join(root, "ck"))
            print("finished", flush=True)
        except KeyboardInterrupt:
            print("interrupted", time.monotonic(), flush=True)
    eng.synchronize()  # the step went on in the background: nothing was lost
    eng.save_checkpoint(os.path.join(root, "ck"))
    print("saved", eng.global_steps, flush=True)
    eng.close()
""")


@pytest.mark.parametrize("call", ["synchronize", "save_checkpoint"])
def test_ctrl_c_while_the_background_step_waits_on_io_arrives_at_once_and_loses_nothing(call, tmp_path):
    """Ctrl-C in synchronize() or save_checkpoint() while the background step's write is stalled
    raises KeyboardInterrupt at once (it came only when the I/O completed), and is not taken for
    a failure of the step: the step finishes in the background, a save afterwards is accepted."""
    proc = subprocess.Popen([sys.executable, "-c", _STALLED_STEP, str(tmp_path), call], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=_env(), preexec_fn=sigint_default)
    try:
        assert proc.stdout.readline().strip() == "stalled"
        time.sleep(0.3)
        sent = time.monotonic()
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, err[-3000:]
    lines = out.split("\n")
    what, when = lines[0].split()
    assert what == "interrupted" and float(when) - sent < 0.5, (out, err[-2000:])  # the stall had 3.7 s to go
    assert lines[1] == "saved 2" and "partly stepped" not in err, (out, err[-2000:])


# ----------------------------------------------------------------------------------- misuse


def test_a_regular_file_as_nvme_path_is_not_a_directory(tiny_lm, engine_config, tmp_path):
    f = tmp_path / "file"
    f.write_bytes(b"x")
    cfg = engine_config("nvme")
    cfg["zero_optimization"]["offload_param"]["nvme_path"] = str(f)
    with pytest.raises(pyinfinity.config.ConfigError, match="is not a directory"):
        pyinfinity.initialize(tiny_lm(), cfg)


@pytest.mark.parametrize("how", ["symlink", "trailing slash"])
def test_one_directory_named_twice_is_one_swap_directory(how, tiny_lm, lm_batches, engine_config, tmp_path):
    d = tmp_path / "swap"
    d.mkdir()
    cfg = engine_config("nvme")
    if how == "symlink":
        os.symlink(d, tmp_path / "link")
        cfg["zero_optimization"]["offload_param"]["nvme_path"] = str(d)
        cfg["zero_optimization"]["offload_optimizer"]["nvme_path"] = str(tmp_path / "link")
    else:
        cfg["zero_optimization"]["offload_param"]["nvme_path"] = [str(d), str(d) + "/"]
        cfg["zero_optimization"]["offload_optimizer"]["nvme_path"] = str(d) + "/"
    with pyinfinity.initialize(tiny_lm(), cfg) as eng:
        train_steps(eng, lm_batches(2))
        assert eng.global_steps == 2
    assert os.listdir(d) == []


def test_a_wrapped_model_refuses_state_dict_and_a_second_wrap(tiny_lm, lm_batches, engine_config, tmp_path):
    model = tiny_lm()
    eng = pyinfinity.initialize(model, engine_config("cpu"))
    train_steps(eng, lm_batches(1))
    with pytest.raises(RuntimeError, match=r"state_dict\(\) while a pyinfinity engine trains it.*engine\.export"):
        model.state_dict()
    with pytest.raises(RuntimeError, match="state_dict"):
        model.blocks[0].state_dict()
    cfg2 = engine_config("cpu")
    with pytest.raises(ValueError, match=r"already wrapped by a pyinfinity engine \(open\)"):
        pyinfinity.initialize(model, cfg2)
    files = eng.export(str(tmp_path / "out"))  # the engine's own read passes
    assert files
    eng.close()
    with pytest.raises(RuntimeError, match=r"state_dict\(\) after engine\.close\(\)"):
        model.state_dict()
    with pytest.raises(RuntimeError, match=r"model\(\.\.\.\) after engine\.close\(\).*engine\.export"):
        model(lm_batches(1)[0][0])
    with pytest.raises(ValueError, match=r"already wrapped by a pyinfinity engine \(closed\)"):
        pyinfinity.initialize(model, engine_config("cpu"))
    # the exported weights load into a fresh model
    from safetensors.torch import load_file

    fresh = tiny_lm(seed=5)
    fresh.load_state_dict(load_file(files[0]))


def test_save_pretrained_of_a_wrapped_transformers_model_refuses(engine_config, tmp_path):
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                   num_attention_heads=2, num_key_value_heads=2)
    model = transformers.LlamaForCausalLM(cfg)
    with pyinfinity.initialize(model, engine_config("cpu")):
        with pytest.raises(RuntimeError, match=r"state_dict\(\) while a pyinfinity engine trains it"):
            model.save_pretrained(str(tmp_path / "hf"))
    assert not (tmp_path / "hf" / "model.safetensors").exists()


# ----------------------------------------------------------------------------------- for the step rewrite


def test_a_step_failing_part_way_refuses_until_a_load(tiny_lm, lm_batches, engine_config, tmp_path):
    from pyinfinity.swap import fault_injection

    cfg = engine_config("nvme", pyinfinity={"device": "cpu", "device_memory": "64MiB", "overlap_step": False})
    with pyinfinity.initialize(tiny_lm(), cfg) as eng:
        batches = lm_batches(3)
        train_steps(eng, batches[:1])
        ckpt = eng.save_checkpoint(str(tmp_path / "ckpt"))
        eng.backward(eng(*batches[1]))
        with fault_injection(op="write", nth=3, action="errno", value="EIO"):
            with pytest.raises(OSError):
                eng.step()
        for call in (eng.step, lambda: eng.save_checkpoint(str(tmp_path / "other"))):
            with pytest.raises(RuntimeError, match="load_checkpoint"):
                call()
        eng.load_checkpoint(os.path.dirname(ckpt))
        train_steps(eng, batches[2:])


def test_an_engine_dropped_without_close_is_collected(tiny_lm, lm_batches, engine_config, tmp_path):
    import gc

    cfg = engine_config("nvme")
    model = tiny_lm()
    eng = pyinfinity.initialize(model, cfg)
    train_steps(eng, lm_batches(1))
    del eng, model
    gc.collect()
    assert not (tmp_path / "swap").exists()  # the engine created it and removed it at close
    with pyinfinity.initialize(tiny_lm(), cfg) as eng2:  # a rebuild in the same process
        train_steps(eng2, lm_batches(1))


# ----------------------------------------------------------------------------------- resume with another config


def test_a_resume_under_another_config_says_what_differs_and_keeps_the_checkpoints_optimizer(
        tiny_lm, lm_batches, engine_config, tmp_path, caplog):
    """As DeepSpeed, the optimizer's state comes from the checkpoint (lr, weight decay): one WARNING
    names every difference and which one is used; training then goes on as the saved run would."""
    batches = lm_batches(4)
    with pyinfinity.initialize(tiny_lm(), engine_config("nvme")) as eng:
        train_steps(eng, batches[:2])
        eng.save_checkpoint(str(tmp_path / "ckpt"))
        want = train_steps(eng, batches[2:])
    other = engine_config("nvme", optimizer={"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.1}})
    with pyinfinity.initialize(tiny_lm(), other) as eng:
        caplog.clear()
        with caplog.at_level("WARNING", logger="pyinfinity"):
            eng.load_checkpoint(str(tmp_path / "ckpt"))
        msgs = [r.getMessage() for r in caplog.records if "differs" in r.getMessage()]
        assert len(msgs) == 1, caplog.text
        assert "lr: config 0.001, checkpoint 0.01: the checkpoint's is used" in msgs[0]
        assert "weight_decay: config 0.1, checkpoint 0.01: the checkpoint's is used" in msgs[0]
        assert "betas" not in msgs[0]
        assert eng.optimizer.param_groups[0]["lr"] == 1e-2 and eng.optimizer.param_groups[0]["weight_decay"] == 0.01
        assert train_steps(eng, batches[2:]) == want


def test_a_resume_with_other_accumulation_steps_realigns_the_micro_step_count(tiny_lm, lm_batches, engine_config,
                                                                              tmp_path, caplog):
    batches = lm_batches(7)
    with pyinfinity.initialize(tiny_lm(), engine_config("nvme", gradient_accumulation_steps=2)) as eng:
        train_steps(eng, batches[:4])
        assert eng.global_steps == 2
        eng.save_checkpoint(str(tmp_path / "ckpt"))
    with pyinfinity.initialize(tiny_lm(), engine_config("nvme", gradient_accumulation_steps=3)) as eng:
        with caplog.at_level("WARNING", logger="pyinfinity"):
            eng.load_checkpoint(str(tmp_path / "ckpt"))
        assert "gradient_accumulation_steps: config 3, checkpoint 2: the config's is used" in caplog.text
        assert eng.micro_steps == 6 and eng.global_steps == 2
        stepped = []
        for x, y in batches[4:7]:
            eng.backward(eng(x, y))
            stepped.append(eng.step() is not None)
        assert stepped == [False, False, True]  # the first step after 3 micro-batches, not 2


def test_a_tag_that_appears_while_a_save_renames_its_copy_names_the_directory_and_the_cause(
        tiny_lm, lm_batches, engine_config, tmp_path, monkeypatch):
    """Two processes saving the same tag into one directory: the other's copy lands between this
    save's check and its rename (made here by hiding it from the check)."""
    save_dir = tmp_path / "ckpt"
    with pyinfinity.initialize(tiny_lm(), engine_config("nvme")) as eng:
        train_steps(eng, lm_batches(1))
        final = eng.save_checkpoint(str(save_dir))
        real = os.path.exists
        monkeypatch.setattr(checkpoint.os.path, "exists", lambda p: False if p == final else real(p))
        with pytest.raises(OSError) as ei:
            eng.save_checkpoint(str(save_dir))
        monkeypatch.undo()
        msg = str(ei.value)
        assert str(save_dir) in msg and "another process is saving into" in msg and ei.value.filename == final
        assert sorted(os.listdir(save_dir)) == ["global_step1", "latest"]  # nothing of the failed save left
        eng.load_checkpoint(str(save_dir))


@pytest.mark.parametrize("during", ["forward", "backward"])
def test_a_save_from_a_signal_handler_during_a_pass_is_refused_and_the_pass_goes_on(
        during, tiny_lm, lm_batches, engine_config, tmp_path):
    """A handler that saves runs between two bytecodes of a forward or backward (here: a module
    hook calls it at such a point): the save refuses in one sentence, the pass completes unharmed,
    and a save after step() works."""
    (x, y), = lm_batches(1)
    with pyinfinity.initialize(tiny_lm(), engine_config("nvme")) as ref:
        want = train_steps(ref, [(x, y)] * 2)
    refused = []

    def handler(*_):
        try:
            eng.save_checkpoint(str(tmp_path / "ckpt"))
        except RuntimeError as exc:
            refused.append(str(exc))
    with pyinfinity.initialize(tiny_lm(), engine_config("nvme")) as eng:
        block = eng.module.blocks[1]
        h = (block.register_forward_hook(handler) if during == "forward"
             else block.register_full_backward_hook(handler))
        got = train_steps(eng, [(x, y)])
        h.remove()
        assert len(refused) == 1 and "while a forward or backward of this engine is running" in refused[0]
        assert "save after step()" in refused[0]
        got += train_steps(eng, [(x, y)])
        assert got == want
        eng.save_checkpoint(str(tmp_path / "ckpt"))
        assert not os.path.exists(tmp_path / "ckpt" / "global_step0")


def test_a_swap_directory_held_by_an_engine_of_this_process_says_to_close_it(tiny_lm, engine_config):
    """A notebook cell run again: the first engine still holds the directory. The error says it
    is this process's own engine and to close() it, not to stop another run."""
    from pyinfinity.swap.ownership import SwapDirBusyError

    cfg = engine_config("nvme")
    first = pyinfinity.initialize(tiny_lm(), cfg)
    with pytest.raises(SwapDirBusyError) as ei:
        pyinfinity.initialize(tiny_lm(), cfg)
    msg = str(ei.value)
    assert f"another engine of this process (pid {os.getpid()})" in msg and "close()" in msg
    assert "gc.collect()" in msg and "stop the other run" not in msg
    first.close()
    pyinfinity.initialize(tiny_lm(), cfg).close()
