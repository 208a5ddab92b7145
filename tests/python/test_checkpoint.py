"""Checkpoint rotation (``keep_last`` / ``pyinfinity.checkpoint_keep_last`` / ``--save-total-limit``):
only the newest checkpoints stay, the oldest goes only once the newest is durable, and removing a
checkpoint (by the engine or by an ``rmtree`` from outside) leaves the live state and every other
checkpoint intact: each kept one resumes bit for bit as the uninterrupted run."""
from __future__ import annotations

import os
import pathlib
import shutil

import pytest

import pyinfinity
from pyinfinity.checkpoint import complete_checkpoints
from pyinfinity.config import ConfigError
from tests.python.conftest import train_steps

STEPS = 5


def _listing(d) -> list[str]:
    return sorted(os.listdir(d))


def _resumed_losses(tiny_lm, engine_config, batches, ckpt, tag=None) -> tuple[int, list[float]]:
    """The step a checkpoint holds and the losses of the steps after it, from a fresh engine."""
    with pyinfinity.initialize(tiny_lm(seed=7), engine_config("nvme")) as eng:
        eng.load_checkpoint(str(ckpt), tag)
        step = eng.global_steps
        return step, train_steps(eng, batches[step:])


def test_keep_last_keeps_the_newest_checkpoints_and_each_resumes_bit_exact(tiny_lm, lm_batches, engine_config,
                                                                           tmp_path):
    ckpt = tmp_path / "ckpt"
    batches = lm_batches(STEPS)
    losses = []
    with pyinfinity.initialize(tiny_lm(), engine_config("nvme")) as eng:
        for i in range(STEPS):
            losses += train_steps(eng, batches[i:i + 1])
            eng.save_checkpoint(str(ckpt), keep_last=2)
            assert complete_checkpoints(str(ckpt)) == [f"global_step{s}" for s in range(max(1, i), i + 2)]
    assert _listing(ckpt) == ["global_step4", "global_step5", "latest"]
    assert (ckpt / "latest").read_text() == "global_step5"
    assert _resumed_losses(tiny_lm, engine_config, batches, ckpt, "global_step4") == (4, losses[4:])
    assert _resumed_losses(tiny_lm, engine_config, batches, ckpt) == (5, [])


def test_the_oldest_checkpoint_goes_only_once_the_newest_is_durable(tiny_lm, lm_batches, engine_config, tmp_path,
                                                                    monkeypatch):
    """A save that fails (ENOSPC on meta.json) removes nothing: the older checkpoints and latest stay."""
    ckpt = tmp_path / "ckpt"
    real_open = os.open

    def open_full(path, flags, *args, **kw):
        if str(path).endswith("meta.json") and flags & os.O_WRONLY:
            return real_open("/dev/full", os.O_WRONLY)
        return real_open(path, flags, *args, **kw)
    with pyinfinity.initialize(tiny_lm(), engine_config("nvme")) as eng:
        batches = lm_batches(3)
        for i in range(2):
            train_steps(eng, batches[i:i + 1])
            eng.save_checkpoint(str(ckpt), keep_last=1)
        assert _listing(ckpt) == ["global_step2", "latest"]
        train_steps(eng, batches[2:])
        monkeypatch.setattr(os, "open", open_full)
        with pytest.raises(OSError, match="meta.json"):
            eng.save_checkpoint(str(ckpt), keep_last=1)
        monkeypatch.undo()
        assert _listing(ckpt) == ["global_step2", "latest"]
        assert (ckpt / "latest").read_text() == "global_step2"


def test_a_checkpoint_removed_from_outside_leaves_training_and_the_other_checkpoints_intact(
        tiny_lm, lm_batches, engine_config, tmp_path):
    ckpt = tmp_path / "ckpt"
    batches = lm_batches(STEPS)
    with pyinfinity.initialize(tiny_lm(), engine_config("nvme")) as eng:
        losses = train_steps(eng, batches[:1])
        eng.save_checkpoint(str(ckpt))
        losses += train_steps(eng, batches[1:2])
        eng.save_checkpoint(str(ckpt))
        losses += train_steps(eng, batches[2:3])
        eng.save_checkpoint(str(ckpt), tag="other")  # not a global_step name: rotation goes by save order
        shutil.rmtree(ckpt / "global_step2")  # Trainer's rotation, or a user, removes one under the engine
        losses += train_steps(eng, batches[3:4])
        eng.save_checkpoint(str(ckpt), keep_last=2)
        losses += train_steps(eng, batches[4:])
    assert _listing(ckpt) == ["global_step4", "latest", "other"]
    assert _resumed_losses(tiny_lm, engine_config, batches, ckpt, "other") == (3, losses[3:])
    assert _resumed_losses(tiny_lm, engine_config, batches, ckpt) == (4, losses[4:])


def test_rotation_leaves_what_is_not_a_complete_checkpoint_alone(tiny_lm, lm_batches, engine_config, tmp_path):
    ckpt = tmp_path / "ckpt"
    (ckpt / "notes").mkdir(parents=True)
    (ckpt / "README").write_text("mine")
    with pyinfinity.initialize(tiny_lm(), engine_config("nvme")) as eng:
        for i, (x, y) in enumerate(lm_batches(3)):
            train_steps(eng, [(x, y)])
            eng.save_checkpoint(str(ckpt), keep_last=1)
    assert _listing(ckpt) == ["README", "global_step3", "latest", "notes"]


def test_the_configs_checkpoint_keep_last_is_the_default_and_a_call_overrides_it(tiny_lm, lm_batches,
                                                                                  engine_config, tmp_path):
    cfg = engine_config("nvme")
    cfg["pyinfinity"]["checkpoint_keep_last"] = 1
    with pyinfinity.initialize(tiny_lm(), cfg) as eng:
        for x, y in lm_batches(2):
            train_steps(eng, [(x, y)])
            eng.save_checkpoint(str(tmp_path / "a"))
            eng.save_checkpoint(str(tmp_path / "b"), keep_last=3)
    assert _listing(tmp_path / "a") == ["global_step2", "latest"]
    assert _listing(tmp_path / "b") == ["global_step1", "global_step2", "latest"]


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, "2"])
def test_a_bad_keep_last_is_refused_before_anything_is_written(bad, tiny_lm, engine_config, tmp_path):
    with pyinfinity.initialize(tiny_lm(), engine_config("cpu")) as eng:
        with pytest.raises(ValueError, match="keep_last: expected None or an integer >= 1"):
            eng.save_checkpoint(str(tmp_path / "ckpt"), keep_last=bad)
    assert not (tmp_path / "ckpt").exists()
    cfg = engine_config("cpu")
    cfg["pyinfinity"]["checkpoint_keep_last"] = 0
    with pytest.raises(ConfigError, match="pyinfinity.checkpoint_keep_last"):
        pyinfinity.initialize(tiny_lm(), cfg)


# ----------------------------------------------------------------------------------- background saves


@pytest.fixture
def held_writer(monkeypatch):
    """Background saves' writers wait for ``release.set()`` before they copy or write anything
    (training goes on meanwhile: every step then takes its shard's copy itself)."""
    import threading

    from pyinfinity import checkpoint

    release = threading.Event()
    run = checkpoint.CheckpointWrite.run

    def held(self):
        if self._thread is not None:
            release.wait(60)
        run(self)
    monkeypatch.setattr(checkpoint.CheckpointWrite, "run", held)  # checkpoint_staging "auto": a shard at a time
    yield release
    release.set()


@pytest.mark.parametrize("tier, state", [("cpu", "fp32"), ("nvme", "fp32"), ("nvme", "8bit"), ("cpu", "overlap"),
                                         ("nvme", "by reference")])
def test_a_background_save_holds_the_state_of_its_step_while_training_goes_on(tier, state, tiny_lm, lm_batches,
                                                                              engine_config, tmp_path, held_writer):
    """Each step after the save reaches every shard before the (held) writer: each takes its
    shard's copy first, in the serial step, in the background worker (overlap_step, shards
    stepped during backward) and from an 8-bit state (the NVMe state copied: by_reference=False);
    held by reference, no step copies anything: each writes its shard into a fresh slot."""
    ckpt = tmp_path / "ckpt"
    batches = lm_batches(STEPS)

    def config(tier):
        cfg = engine_config(tier)
        if state == "8bit":
            cfg["pyinfinity"]["optimizer_state"] = "8bit"
        if state == "overlap":
            cfg["pyinfinity"]["overlap_step"] = True
        return cfg
    with pyinfinity.initialize(tiny_lm(), config(tier)) as eng:
        losses = train_steps(eng, batches[:1])
        eng.save_checkpoint(str(ckpt))
        losses += train_steps(eng, batches[1:2])
        path = eng.save_checkpoint(str(ckpt), blocking=False, by_reference=state == "by reference")
        assert path == str(ckpt / "global_step2")
        assert (ckpt / "latest").read_text() == "global_step1"  # not before it is complete
        assert not os.path.exists(path)
        losses += train_steps(eng, batches[2:4])  # every shard's copy taken by its step, before updating it
        held_writer.set()
        write = eng.wait_for_checkpoint()
        if state == "by reference":
            assert write.copied_by_step == 0 and write.by_reference_bytes > 0
        else:
            assert write.copied_by_step == len(eng.optimizer.states) > 1
        assert (ckpt / "latest").read_text() == "global_step2"
        losses += train_steps(eng, batches[4:])
    assert _resumed_losses(tiny_lm, config, batches, ckpt) == (2, losses[2:])


def test_a_background_save_the_writer_copies_alone_equals_a_blocking_save(tiny_lm, lm_batches, engine_config,
                                                                          tmp_path):
    import json

    with pyinfinity.initialize(tiny_lm(), engine_config("nvme")) as eng:
        train_steps(eng, lm_batches(2))
        eng.save_checkpoint(str(tmp_path / "a"), by_reference=False)
        eng.save_checkpoint(str(tmp_path / "b"), blocking=False, by_reference=False)
        eng.wait_for_checkpoint()
    a, b = tmp_path / "a" / "global_step2", tmp_path / "b" / "global_step2"
    assert (a / "state.bin").read_bytes() == (b / "state.bin").read_bytes()
    assert json.loads((a / "meta.json").read_text()) == json.loads((b / "meta.json").read_text())


def test_a_background_save_failure_is_raised_at_the_next_call_and_latest_stays(tiny_lm, lm_batches,
                                                                                engine_config, tmp_path,
                                                                                monkeypatch, held_writer):
    ckpt = tmp_path / "ckpt"
    real_open = os.open

    def open_full(path, flags, *args, **kw):
        if str(path).endswith("meta.json") and flags & os.O_WRONLY:
            return real_open("/dev/full", os.O_WRONLY)
        return real_open(path, flags, *args, **kw)
    with pyinfinity.initialize(tiny_lm(), engine_config("nvme")) as eng:
        batches = lm_batches(3)
        train_steps(eng, batches[:1])
        eng.save_checkpoint(str(ckpt))
        train_steps(eng, batches[1:2])
        monkeypatch.setattr(os, "open", open_full)
        eng.save_checkpoint(str(ckpt), blocking=False, keep_last=1)
        train_steps(eng, batches[2:])  # training is not disturbed by the failing write
        held_writer.set()
        with pytest.raises(OSError, match=r"save_checkpoint\(\): the checkpoint .*global_step2 was not saved "
                                          r"\(No space left on device: writing checkpoint file meta\.json .*\); latest still names "
                                          r"the previous one") as ei:
            eng.save_checkpoint(str(ckpt), blocking=False)
        monkeypatch.undo()
        assert ei.value.errno == 28
        assert _listing(ckpt) == ["global_step1", "latest"]  # the half-written one is gone, nothing rotated
        assert (ckpt / "latest").read_text() == "global_step1"
        assert eng.wait_for_checkpoint() is None  # raised once
        eng.save_checkpoint(str(ckpt), blocking=False)
    assert _listing(ckpt) == ["global_step1", "global_step3", "latest"]  # close() waited for it


def test_a_copy_a_step_fails_to_take_fails_the_save_and_latest_stays(tiny_lm, lm_batches, engine_config, tmp_path,
                                                                     held_writer, monkeypatch):
    """A step's copy of its shard that fails (a read error) fails the background save: the writer
    does not complete a checkpoint missing that shard, ``latest`` keeps naming the previous one,
    the error is raised at the next call and training goes on."""
    import errno
    import threading

    from pyinfinity import checkpoint

    take = checkpoint.CheckpointWrite._take
    by_step = []

    def failing(self, e, st, flat):
        if self._thread is not None and threading.current_thread() is not self._thread:
            by_step.append(e["shard"])
            if len(by_step) == 2:
                raise OSError(errno.EIO, "injected read error")
        return take(self, e, st, flat)
    monkeypatch.setattr(checkpoint.CheckpointWrite, "_take", failing)
    ckpt = tmp_path / "ckpt"
    batches = lm_batches(4)
    with pyinfinity.initialize(tiny_lm(), engine_config("cpu")) as eng:
        train_steps(eng, batches[:1])
        eng.save_checkpoint(str(ckpt))
        train_steps(eng, batches[1:2])
        eng.save_checkpoint(str(ckpt), blocking=False, by_reference=False)
        train_steps(eng, batches[2:3])  # the step's second copy fails; the step goes on
        held_writer.set()
        with pytest.raises(OSError, match="was not saved"):
            eng.wait_for_checkpoint()
        train_steps(eng, batches[3:])
    assert len(by_step) >= 2
    assert (ckpt / "latest").read_text() == "global_step1"
    assert complete_checkpoints(str(ckpt)) == ["global_step1"]


@pytest.mark.parametrize("call", ["close", "export", "load_checkpoint"])
def test_close_export_and_load_wait_for_a_background_save(call, tiny_lm, lm_batches, engine_config, tmp_path):
    ckpt = tmp_path / "ckpt"
    eng = pyinfinity.initialize(tiny_lm(), engine_config("nvme"))
    try:
        train_steps(eng, lm_batches(1))
        eng.save_checkpoint(str(ckpt), blocking=False)
        if call == "close":
            eng.close()
        elif call == "export":
            eng.export(str(tmp_path / "out"))
        else:
            eng.load_checkpoint(str(ckpt))
        assert (ckpt / "latest").read_text() == "global_step1"
        assert _listing(ckpt) == ["global_step1", "latest"]
    finally:
        eng.close()


def test_ctrl_c_interrupts_a_wait_for_a_background_save_within_a_tenth_of_a_second(tiny_lm, lm_batches,
                                                                                    engine_config, tmp_path,
                                                                                    held_writer):
    import signal
    import threading
    import time

    ckpt = tmp_path / "ckpt"
    sent = []

    def interrupt(signum, frame):
        raise KeyboardInterrupt
    old = signal.signal(signal.SIGINT, interrupt)
    try:
        with pyinfinity.initialize(tiny_lm(), engine_config("nvme")) as eng:
            train_steps(eng, lm_batches(1))
            eng.save_checkpoint(str(ckpt), blocking=False)
            timer = threading.Timer(0.3, lambda: (sent.append(time.perf_counter()), os.kill(os.getpid(),
                                                                                              signal.SIGINT)))
            timer.start()
            with pytest.raises(KeyboardInterrupt):
                eng.wait_for_checkpoint()
            late = time.perf_counter() - sent[0]
            assert late < 0.1 + 0.05, late
            held_writer.set()  # the write went on: the next wait finds it complete
            assert eng.wait_for_checkpoint().path == str(ckpt / "global_step1")
            assert (ckpt / "latest").read_text() == "global_step1"
    finally:
        signal.signal(signal.SIGINT, old)


@pytest.mark.parametrize("by_reference", [False, True])
def test_ctrl_c_during_a_blocking_save_is_a_keyboard_interrupt_and_leaves_nothing(by_reference, tiny_lm, lm_batches,
                                                                                  engine_config, tmp_path,
                                                                                  monkeypatch):
    """Copied (interrupted while it checksums a shard's copy) or by reference (while it checksums
    meta.json): nothing stays in the save directory, and no slot stays held."""
    from pyinfinity import checkpoint

    def interrupted(buf):
        raise KeyboardInterrupt
    with pyinfinity.initialize(tiny_lm(), engine_config("nvme")) as eng:
        train_steps(eng, lm_batches(1))
        monkeypatch.setattr(checkpoint, "_crc32c_bytes" if by_reference else "_crc32c", interrupted)
        with pytest.raises(KeyboardInterrupt):
            eng.save_checkpoint(str(tmp_path / "ckpt"), by_reference=by_reference)
        monkeypatch.undo()
        assert _listing(tmp_path / "ckpt") == []
        assert not _space(eng).references()
        eng.save_checkpoint(str(tmp_path / "ckpt"), by_reference=by_reference)
    assert _listing(tmp_path / "ckpt") == ["global_step1", "latest"]


@pytest.mark.parametrize("budget", [None, 3 * 4096, 1 << 20])
def test_a_save_stages_no_more_than_the_checkpoint_staging_the_layout_charges(budget, tiny_lm, lm_batches,
                                                                             engine_config, tmp_path, monkeypatch):
    """``pyinfinity.checkpoint_staging``: the planner's layout and the engine's pools charge the same
    bytes in host RAM ("auto": none), and with no host RAM free beyond it a background save never
    holds more shard copies not yet written than that (or one shard's, when the budget is smaller)."""
    from pyinfinity import checkpoint
    from pyinfinity.plan import Budgets, Rates, placement_of

    monkeypatch.setattr(checkpoint, "mem_available", lambda: checkpoint.HOST_SPARE)  # nothing free beyond it

    cfg = engine_config("cpu")
    if budget is not None:
        cfg["pyinfinity"]["checkpoint_staging"] = budget
    model = tiny_lm()
    budgets = Budgets(device_memory=64 << 20, host_memory=1 << 34, device_is_host=True)
    rates = Rates(h2d=10e9, d2h=10e9, disk_read=2e9, disk_write=1e9, adam=1e9, matmul=1e12, memcpy=5e9, device="cpu")
    plan = placement_of(cfg, model, budgets, rates, seq_len=8)
    auto = placement_of(engine_config("cpu"), tiny_lm(), budgets, rates, seq_len=8)
    assert plan.host_bytes - auto.host_bytes == plan.checkpoint_staging
    assert ("checkpoint staging" in plan.table()) == (budget is not None)  # `pyinfinity plan` shows it
    with pyinfinity.initialize(model, cfg) as eng:
        charged = eng.state.pools.checkpoint_staging
        assert charged == plan.checkpoint_staging
        largest = max(eng.state.optimizer.format.nbytes(st.numel) for st in eng.state.optimizer.states)
        if budget is None:
            assert charged == 0
        else:
            assert max(budget, largest) <= charged <= max(budget, largest + 4096)  # a home's alignment at most
        train_steps(eng, lm_batches(1))
        eng.save_checkpoint(str(tmp_path / "ckpt"), blocking=False)
        write = eng.wait_for_checkpoint()
        assert 0 < write.staged_peak <= max(charged, largest)
        if budget == 1 << 20:  # room for several copies: the writer used it
            assert write.staged_peak > largest


def test_a_saves_staging_is_its_budget_and_what_the_host_has_free_beyond_it():
    """``layout.pools.save_staging_bytes``: whole pages; at least one copy; a background save up to
    the whole checkpoint as the free host RAM allows, a blocking one two copies; never more than
    the checkpoint."""
    import mmap

    from pyinfinity.layout.pools import save_staging_bytes

    page = mmap.PAGESIZE
    assert save_staging_bytes(0, 10, 100 * page, 0, True) == page  # one copy, however little is free
    assert save_staging_bytes(0, 3 * page, 100 * page, -5 * page, True) == 3 * page
    assert save_staging_bytes(0, 3 * page, 100 * page, 50 * page + 7, True) == 50 * page
    assert save_staging_bytes(0, 3 * page, 100 * page, 500 * page, True) == 100 * page  # the checkpoint at most
    assert save_staging_bytes(0, 3 * page, 100 * page, 500 * page, False) == 6 * page  # blocking: two copies
    assert save_staging_bytes(8 * page + 5, 3 * page, 100 * page, 0, False) == 8 * page  # the charged budget


@pytest.mark.parametrize("tier, budget", [("cpu", 1 << 20), ("nvme", 1 << 20), ("cpu", None)])
def test_a_save_writes_every_copy_from_one_staging_buffer_the_engine_keeps_between_background_saves(
        tier, budget, tiny_lm, lm_batches, engine_config, tmp_path, monkeypatch):
    """The writer stages its copies in one buffer, not a new allocation per shard (fresh pages
    faulted in and unmapped again for every shard); under a staging budget (charged in the layout's
    host RAM) the engine keeps it for the next save. A frozen shard's values and a state on disk
    are read into it directly. The checkpoints still resume bit for bit."""
    import json

    def model(seed=0):
        m = tiny_lm(seed=seed, tie=False)
        m.blocks[0].requires_grad_(False)  # frozen shards: their values are saved
        return m

    def config():
        cfg = engine_config(tier)
        if budget is not None:
            cfg["pyinfinity"]["checkpoint_staging"] = budget
        return cfg
    batches = lm_batches(4)
    storages: list[list[int]] = []
    with pyinfinity.initialize(model(), config()) as eng:
        io = eng.state.checkpoint_io()
        submit = io.submit

        def recorded(tensor, file, offset, write, *a, **kw):
            if write:
                storages[-1].append(tensor.untyped_storage().data_ptr())
            return submit(tensor, file, offset, write, *a, **kw)
        monkeypatch.setattr(io, "submit", recorded)
        losses = train_steps(eng, batches[:1])
        for name in ("a", "b"):
            storages.append([])
            eng.save_checkpoint(str(tmp_path / name), blocking=False, by_reference=False)
            eng.wait_for_checkpoint()
            losses += train_steps(eng, batches[len(losses):len(losses) + 1])
        losses += train_steps(eng, batches[len(losses):])
    meta = json.loads((tmp_path / "b" / "global_step2" / "meta.json").read_text())
    assert {e["kind"] for e in meta["entries"]} == {"optim", "param"}
    assert all(len(s) == len(meta["entries"]) for s in storages)
    assert [len(set(s)) for s in storages] == [1, 1]  # one buffer a save
    if budget is not None:
        assert storages[0][0] == storages[1][0]  # kept between saves
    with pyinfinity.initialize(model(seed=7), config()) as eng:
        eng.load_checkpoint(str(tmp_path / "b"))
        assert train_steps(eng, batches[2:]) == losses[2:]


@pytest.mark.parametrize("overlap", [False, True])
def test_steps_go_on_while_the_disk_holds_a_background_saves_writes(overlap, tiny_lm, lm_batches, engine_config,
                                                                    tmp_path, monkeypatch):
    """A background save stages up to the whole checkpoint where the host has the RAM free now
    (beyond ``pyinfinity.checkpoint_staging``, "auto" here): while the disk has not finished one of
    its writes, the steps after the save train on, none waiting for the disk (the writer waits
    without holding the lock a step's copy needs). The writer copies in the order the steps update
    the shards. The checkpoint then completes and resumes bit for bit."""
    import threading

    from pyinfinity import checkpoint

    def config(tier="cpu"):
        cfg = engine_config(tier)
        cfg["pyinfinity"]["overlap_step"] = overlap
        return cfg
    monkeypatch.setattr(checkpoint, "mem_available", lambda: checkpoint.HOST_SPARE + (1 << 30))  # a GiB free
    batches = lm_batches(STEPS)
    disk = threading.Event()
    order: list[int] = []
    with pyinfinity.initialize(tiny_lm(), config()) as eng:
        io = eng.state.checkpoint_io()
        submit = io.submit

        class Held:  # a write the disk has not finished until disk.set()
            def __init__(self, req):
                self.req = req

            def wait(self, *a, **kw):
                assert disk.wait(60), "the disk was never released"
                return self.req.wait(*a, **kw)

        def held(tensor, file, offset, write, *a, **kw):
            return Held(submit(tensor, file, offset, write, *a, **kw))
        monkeypatch.setattr(io, "submit", held)
        take = checkpoint.CheckpointWrite._take

        def recorded(self, e, st, flat):
            took = take(self, e, st, flat)
            if took:
                order.append(e["shard"])
            return took
        monkeypatch.setattr(checkpoint.CheckpointWrite, "_take", recorded)
        losses = train_steps(eng, batches[:2])
        eng.save_checkpoint(str(tmp_path / "ckpt"), blocking=False, by_reference=False)
        write = eng._checkpoint_write
        shards = sorted(e["shard"] for e, _ in write._optim)
        try:
            losses += train_steps(eng, batches[2:4])  # would hang were a step waiting for the held disk
            assert not write.done
            assert write.staged_peak == sum(e["nbytes"] for e, _ in write._optim)  # all of it in staging
        finally:
            disk.set()
        eng.wait_for_checkpoint()
        assert sorted(order) == shards and order == (shards[::-1] if overlap else shards)
        losses += train_steps(eng, batches[4:])
    assert _resumed_losses(tiny_lm, config, batches, tmp_path / "ckpt") == (2, losses[2:])


@pytest.mark.parametrize("blocking", [True, False])
def test_the_copies_a_save_takes_at_once_wait_for_staging_room_like_the_writers(blocking, tiny_lm, lm_batches,
                                                                               engine_config, tmp_path, monkeypatch):
    """The state of units stepped on the device is copied when the save fixes its point, before
    it returns: with staging room for one shard only (no host RAM free beyond the budget), each
    of those copies waits for the previous one's write, as the writer's copies do. (Shards are
    marked as stepped on the device here; their homes are in RAM, as the device's are once synced.)"""
    from pyinfinity import checkpoint

    monkeypatch.setattr(checkpoint, "mem_available", lambda: checkpoint.HOST_SPARE)
    batches = lm_batches(4)
    with pyinfinity.initialize(tiny_lm(), engine_config("cpu")) as eng:
        losses = train_steps(eng, batches[:2])
        states = eng.optimizer.states
        assert len(states) > 2
        for st in states[:3]:
            st.dev = object()
        try:
            eng.save_checkpoint(str(tmp_path / "ckpt"), blocking=blocking)
            write = eng.wait_for_checkpoint() if not blocking else None
        finally:
            for st in states[:3]:
                st.dev = None
        if write is not None:
            assert write.staged_peak == max(eng.optimizer.format.nbytes(st.numel) for st in states)
        losses += train_steps(eng, batches[2:])
    assert _resumed_losses(tiny_lm, engine_config, batches, tmp_path / "ckpt") == (2, losses[2:])


def test_a_step_waiting_for_staging_room_while_the_writer_drains_gets_no_place_and_the_ring_empties():
    """A step waiting for room (the lock let go) while the writer takes its shard and then waits
    for every write (the end of a save): once the writes are done the step finds its shard taken
    and takes no place; every place in the ring is given back."""
    import collections
    import threading
    import time

    import torch

    from pyinfinity.checkpoint import CheckpointWrite, StagingRing

    class Request:  # a write the test finishes
        def __init__(self):
            self.done = threading.Event()

        def wait(self):
            assert self.done.wait(30)
    w = CheckpointWrite.__new__(CheckpointWrite)
    w._lock, w._inflight, w.staging = threading.Lock(), collections.deque(), 2 * 4096
    w._ring, w._pending = StagingRing(torch.zeros(2 * 4096, dtype=torch.uint8)), {7}
    writes = [Request(), Request()]
    for req in writes:  # the ring full of copies being written
        w._ring.take(4096)
        w._inflight.append((req, 4096))
    got = {}

    def step():
        with w._lock:
            got["place"] = w._make_room(4096, 7)
    t = threading.Thread(target=step)
    t.start()
    time.sleep(0.1)  # the step waits for the oldest write, without the lock
    with w._lock:
        w._pending.discard(7)  # the writer took shard 7 meanwhile
        for req in writes:
            req.done.set()
        w._drain()
    t.join(30)
    assert got == {"place": None} and w._ring.held == 0 and not w._inflight


def test_the_staging_ring_never_hands_out_bytes_a_copy_not_yet_written_holds():
    """``StagingRing``: copies placed one after the other at page boundaries, wrapping to the
    start, given back oldest first; a place never overlaps a held copy and never passes the end."""
    import random

    import torch

    from pyinfinity.checkpoint import ALIGN, StagingRing

    rng = random.Random(0)
    ring = StagingRing(torch.empty(10 * ALIGN, dtype=torch.uint8))
    held: list[tuple[int, int]] = []
    placed = 0
    for _ in range(2000):
        n = rng.choice([1, ALIGN - 1, ALIGN, ALIGN + 1, 3 * ALIGN, 10 * ALIGN])
        while ring.place(n) is None:
            assert held
            ring.release()
            held.pop(0)
        buf = ring.take(n)
        a = buf.data_ptr() - ring.buf.data_ptr()
        b = a + -(-n // ALIGN) * ALIGN
        assert buf.numel() == n and a % ALIGN == 0 and b <= ring.capacity
        assert all(b <= x or y <= a for x, y in held)
        held.append((a, b))
        placed += 1
        if rng.random() < 0.3:
            ring.release()
            held.pop(0)
    assert placed == 2000
    with pytest.raises(ValueError, match="does not fit"):
        ring.place(10 * ALIGN + 1)
    while held:
        ring.release()
        held.pop(0)
    assert ring.held == 0 and ring.place(10 * ALIGN) == 0


# ----------------------------------------------------------------------------------- NVMe state by reference


def _meta(path) -> dict:
    import json

    return json.loads((path / "meta.json").read_text())


def _space(eng):
    return eng.state.optim_swapper.nvme_space()


@pytest.mark.parametrize("blocking", [True, False])
def test_a_save_holds_the_nvme_state_by_reference_and_resumes_bit_exact(blocking, tiny_lm, lm_batches, engine_config,
                                                                       tmp_path):
    """The optimizer state on NVMe is not copied: the checkpoint links the swap file, records each
    shard's slot and the CRC-32Cs written with it (version 5); the next steps write the shards
    into fresh slots, and a fresh engine resumes from it as the uninterrupted run goes on."""
    ckpt = tmp_path / "ckpt"
    batches = lm_batches(STEPS)
    with pyinfinity.initialize(tiny_lm(), engine_config("nvme")) as eng:
        losses = train_steps(eng, batches[:2])
        written = eng.state.io_stats()["checkpoint"]["write"]["bytes"] if "checkpoint" in eng.state.io_stats() else 0
        path = eng.save_checkpoint(str(ckpt), blocking=blocking)
        eng.wait_for_checkpoint()
        losses += train_steps(eng, batches[2:])
        meta = _meta(ckpt / "global_step2")
        refs = [e for e in meta["entries"] if "ref" in e]
        assert meta["version"] == 5 and refs and len(refs) == len(eng.state.optimizer.states)
        assert meta["data_bytes"] == 0 and not (ckpt / "global_step2" / "state.bin").exists()
        assert eng.state.io_stats()["checkpoint"]["write"]["bytes"] == written  # no byte of the state copied
        link = ckpt / "global_step2" / refs[0]["ref"]["files"][0]
        live = eng.state.optim_swapper.files()[0]
        assert os.stat(link).st_ino == os.stat(live).st_ino  # the swap file itself, held by a link
        held = {s.id for s in (st.home.slot for st in eng.state.optimizer.states)}
        assert all(x[1:] not in [[e.offset, e.nbytes] for st in eng.state.optimizer.states
                                 for e in st.home.slot.extents] for r in refs for x in r["ref"]["extents"])
        assert len(held) == len(refs)
    assert os.path.exists(link) and not os.path.exists(live)  # close unlinked the swap name only
    held_bytes = sum(e["nbytes"] for e in refs)
    # the rest of the file (the live state, the preallocated room) was punched out at close
    assert os.stat(link).st_blocks * 512 <= held_bytes + 4096 * len(refs) < os.stat(link).st_size
    assert _resumed_losses(tiny_lm, engine_config, batches, ckpt) == (2, losses[2:])


def test_a_copy_save_writes_version_4_and_both_versions_load(tiny_lm, lm_batches, engine_config, tmp_path):
    """``by_reference=False`` writes the NVMe state into state.bin, as version 4 (what the code
    before by-reference saves wrote); it and a version-5 checkpoint of the same step resume alike."""
    batches = lm_batches(STEPS)
    with pyinfinity.initialize(tiny_lm(), engine_config("nvme")) as eng:
        losses = train_steps(eng, batches[:2])
        eng.save_checkpoint(str(tmp_path / "v4"), by_reference=False)
        eng.save_checkpoint(str(tmp_path / "v5"))
        losses += train_steps(eng, batches[2:])
    v4 = _meta(tmp_path / "v4" / "global_step2")
    assert v4["version"] == 4 and not any("ref" in e for e in v4["entries"]) and v4["data_bytes"] > 0
    assert _meta(tmp_path / "v5" / "global_step2")["version"] == 5
    for d in ("v4", "v5"):
        assert _resumed_losses(tiny_lm, engine_config, batches, tmp_path / d) == (2, losses[2:])


def test_a_frozen_slot_is_freed_once_no_checkpoint_refers_to_it(tiny_lm, lm_batches, engine_config, tmp_path):
    """Rotation (keep_last) and an rmtree of a checkpoint from outside free its slots at the next
    save: the swap space stays at about twice the state, however many saves."""
    ckpt = tmp_path / "ckpt"
    batches = lm_batches(8)
    with pyinfinity.initialize(tiny_lm(), engine_config("nvme")) as eng:
        train_steps(eng, batches[:1])
        state_bytes = _space(eng).stats()["used"]
        for i in range(1, 5):
            eng.save_checkpoint(str(ckpt), keep_last=1)
            train_steps(eng, batches[i:i + 1])
        assert complete_checkpoints(str(ckpt)) == ["global_step4"]
        assert _space(eng).stats()["used"] <= 2 * state_bytes + 4096 * len(eng.state.optimizer.states)
        assert len(_space(eng).references()) == 1
        shutil.rmtree(ckpt / "global_step4")  # Trainer's own rotation, from outside
        eng.save_checkpoint(str(tmp_path / "other"))
        train_steps(eng, batches[5:6])
        assert len(_space(eng).references()) == 1  # only the new one's
        assert _space(eng).stats()["used"] <= 2 * state_bytes + 4096 * len(eng.state.optimizer.states)


def test_removing_a_by_reference_checkpoint_never_changes_the_live_state(tiny_lm, lm_batches, engine_config,
                                                                         tmp_path):
    """An rmtree of a by-reference checkpoint (the link goes) leaves the run training as the
    uninterrupted run, and a later checkpoint resumes bit for bit."""
    batches = lm_batches(STEPS)
    with pyinfinity.initialize(tiny_lm(), engine_config("nvme")) as eng:
        expected = train_steps(eng, batches)
    with pyinfinity.initialize(tiny_lm(), engine_config("nvme")) as eng:
        got = train_steps(eng, batches[:1])
        eng.save_checkpoint(str(tmp_path / "a"))
        got += train_steps(eng, batches[1:2])
        shutil.rmtree(tmp_path / "a")
        eng.save_checkpoint(str(tmp_path / "b"))
        got += train_steps(eng, batches[2:])
    assert got == expected
    assert _resumed_losses(tiny_lm, engine_config, batches, tmp_path / "b") == (2, expected[2:])


def test_a_by_reference_entry_changed_on_disk_fails_its_checksum_on_load(tiny_lm, lm_batches, engine_config,
                                                                         tmp_path):
    ckpt = tmp_path / "ckpt"
    with pyinfinity.initialize(tiny_lm(), engine_config("nvme")) as eng:
        train_steps(eng, lm_batches(1))
        eng.save_checkpoint(str(ckpt))
    ref = _meta(ckpt / "global_step1")["entries"][0]["ref"]
    f, off, n = ref["extents"][0]
    fd = os.open(ckpt / "global_step1" / ref["files"][f], os.O_WRONLY)
    try:
        os.pwrite(fd, b"\x5a" * 64, off + n // 2)
    finally:
        os.close(fd)
    from pyinfinity.checkpoint import CheckpointError

    with pyinfinity.initialize(tiny_lm(), engine_config("nvme")) as eng:
        with pytest.raises(CheckpointError, match="optimizer state by reference"):
            eng.load_checkpoint(str(ckpt))


def test_a_by_reference_save_that_would_not_fit_the_disk_says_so_before_writing(tiny_lm, lm_batches, engine_config,
                                                                                tmp_path, monkeypatch):
    import errno
    from collections import namedtuple

    ckpt = tmp_path / "ckpt"
    with pyinfinity.initialize(tiny_lm(), engine_config("nvme")) as eng:
        train_steps(eng, lm_batches(1))
        real = os.statvfs
        full = namedtuple("statvfs", "f_bavail f_frsize")
        monkeypatch.setattr(_space(eng), "free_bytes", lambda: 0)  # no spare room preallocated in the swap file
        monkeypatch.setattr(os, "statvfs", lambda d: full(0, 4096) if str(d).startswith(str(tmp_path)) else real(d))
        with pytest.raises(OSError, match="not enough free disk for this save") as err:
            eng.save_checkpoint(str(ckpt))
        assert err.value.errno == errno.ENOSPC and "\n" not in str(err.value)
        assert not _space(eng).references()
        monkeypatch.setattr(os, "statvfs", real)
        assert [n for n in os.listdir(ckpt) if not n.startswith(".")] == []


def test_the_swap_manifest_lists_the_links_a_by_reference_checkpoint_holds(tiny_lm, lm_batches, engine_config,
                                                                           tmp_path):
    """The ownership layer knows a swap file may be held by a checkpoint: the manifest lists the
    link (release and the next start's stale cleanup then unlink only the swap name)."""
    from pyinfinity.swap.manifest import read_manifest

    with pyinfinity.initialize(tiny_lm(), engine_config("nvme")) as eng:
        train_steps(eng, lm_batches(1))
        path = eng.save_checkpoint(str(tmp_path / "ckpt"))
        name = _meta(tmp_path / "ckpt" / "global_step1")["entries"][0]["ref"]["files"][0]
        swap_dir = os.path.dirname(eng.state.optim_swapper.files()[0])
        files = read_manifest(swap_dir)["files"]
        optim = [f for f in files if f["space"] == "optimizer"]
        assert optim and optim[0]["links"] == [os.path.join(path, name)]
        assert all(f["links"] == [] for f in files if f["space"] != "optimizer")


@pytest.mark.parametrize("fs", ["tmpfs_dir", "small_ext4_dir"])
def test_a_by_reference_checkpoint_on_tmpfs_and_ext4_resumes_and_keeps_only_its_blocks(fs, request, tiny_lm,
                                                                                       lm_batches, engine_config):
    """On a tmpfs and on an ext4 (a loop device): the swap directory and the checkpoint on one
    filesystem, the state saved by reference resumes bit for bit after the run closed, and the
    linked file keeps only the held slots' blocks (the rest punched out at close)."""
    root = request.getfixturevalue(fs)
    swap, ckpt = os.path.join(root, "swap"), os.path.join(root, "ckpt")

    def config():
        cfg = engine_config("nvme")
        for k in ("offload_param", "offload_optimizer"):
            cfg["zero_optimization"][k]["nvme_path"] = swap
        return cfg
    batches = lm_batches(STEPS)
    with pyinfinity.initialize(tiny_lm(), config()) as eng:
        losses = train_steps(eng, batches[:2])
        path = eng.save_checkpoint(ckpt)
        losses += train_steps(eng, batches[2:])
    refs = [e for e in _meta(pathlib.Path(path))["entries"] if "ref" in e]
    assert refs
    link = os.path.join(path, refs[0]["ref"]["files"][0])
    assert os.stat(link).st_blocks * 512 <= sum(e["nbytes"] for e in refs) + 4096 * len(refs)
    with pyinfinity.initialize(tiny_lm(seed=7), config()) as eng:
        eng.load_checkpoint(ckpt)
        assert train_steps(eng, batches[2:]) == losses[2:]
