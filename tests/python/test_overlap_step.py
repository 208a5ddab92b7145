"""pyinfinity.overlap_step: the optimizer steps in a background thread — each unit during the
boundary micro-batch's backward, or, with clipping / fp16 loss scaling, after it while the next
forward waits for each unit's new values. Parity with the serial step (bit-identical parameters and
optimizer state over tiers, accumulation, clipping and fp16), the knob's validation and "auto", and
failures: an exception in the background step or in backward surfaces as itself, training then
refuses to go on with a partly stepped state until a checkpoint is loaded, and the engine closes
without hanging."""
from __future__ import annotations

import errno
import logging
import threading
import time

import pytest
import torch

import pyinfinity
import pyinfinity.plan.resolve
from pyinfinity.config import ConfigError
from pyinfinity.swap.faults import fault_injection
from tests.python.conftest import engine_state, train_steps


def _overlap_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "pyinfinity-optimizer"]


def _model(tiny_lm, frozen_and_unused: bool):
    m = tiny_lm()
    if frozen_and_unused:
        m.blocks[1].norm.bias.requires_grad_(False)  # a frozen slice inside a trainable shard
        m.unused = torch.nn.Linear(4, 4)  # trainable, never gets a gradient: steps on zeros at step()
    return m


def _run(tiny_lm, batches, cfg, frozen_and_unused=False):
    with pyinfinity.initialize(_model(tiny_lm, frozen_and_unused), cfg) as eng:
        losses = train_steps(eng, batches)
        return losses, list(eng.history), engine_state(eng)


@pytest.mark.parametrize("tier, ratio, gas, persistent, extra", [
    ("cpu", None, 1, 0, False),
    ("cpu", None, 3, 100, True),  # small shards resident on the device, frozen and unused params
    ("nvme", None, 2, 0, False),
    ("nvme", 0.5, 2, 0, True),  # half the optimizer state in RAM, half on NVMe
])
def test_overlap_is_bit_identical_to_the_serial_step(tier, ratio, gas, persistent, extra, tiny_lm, lm_batches,
                                                     engine_config):
    steps = 4
    batches = lm_batches(steps * gas)
    got = {}
    for overlap in (False, True):
        cfg = engine_config(tier, gradient_accumulation_steps=gas)
        cfg["zero_optimization"]["stage3_param_persistence_threshold"] = persistent
        if ratio is not None:
            cfg["zero_optimization"]["offload_optimizer"]["ratio"] = ratio
        cfg["pyinfinity"]["overlap_step"] = overlap
        got[overlap] = _run(tiny_lm, batches, cfg, extra)
    (l0, h0, s0), (l1, h1, s1) = got[False], got[True]
    assert len(h1) == steps
    assert all(r.overlapped_shards == 0 for r in h0)
    assert all(r.overlapped_shards > 0 for r in h1)  # the mechanism ran (not the serial fallback)
    assert l0 == l1
    assert [r.grad_norm for r in h0] == [r.grad_norm for r in h1]  # telemetry unchanged
    assert sum(r.optimizer_busy_seconds for r in h1) > 0  # reported as the worker gets through it
    assert s0.keys() == s1.keys()
    for k in s0:
        assert torch.equal(s0[k], s1[k]), k


@pytest.mark.parametrize("clip, fp16", [(0.05, False), (0.0, True), (1e3, False)])
def test_clipping_and_fp16_steps_in_the_background_are_bit_identical(clip, fp16, tiny_lm, lm_batches, engine_config):
    """With clipping (firing every step at 0.05, never at 1e3) or fp16 loss scaling the step needs the
    global norm: it runs after backward, unit by unit in the worker, while the next forward waits
    for each unit's new values. Same results as the serial step, bit for bit."""
    batches = lm_batches(4)
    got = {}
    for overlap in (False, True):
        cfg = engine_config("nvme", gradient_clipping=clip)
        if fp16:
            cfg["fp16"] = {"enabled": True, "initial_scale_power": 8}
        cfg["pyinfinity"]["overlap_step"] = overlap
        got[overlap] = _run(tiny_lm, batches, cfg)
    (l0, h0, s0), (l1, h1, s1) = got[False], got[True]
    assert l0 == l1 and [r.grad_norm for r in h0] == [r.grad_norm for r in h1]
    if clip == 0.05:
        assert all(r.grad_norm > clip for r in h0)  # clipping fired every step
    assert s0.keys() == s1.keys() and all(torch.equal(s0[k], s1[k]) for k in s0)


def _optim_on_nvme(engine_config, overlap):
    cfg = engine_config("nvme", pyinfinity={"device": "cpu", "device_memory": "64MiB", "overlap_step": overlap})
    cfg["zero_optimization"]["offload_param"] = {"device": "cpu"}  # only the optimizer's reads hit the disk
    return cfg


def test_slow_state_reads_queue_shards_up_and_the_read_ahead_stays_bit_identical(tiny_lm, lm_batches,
                                                                               engine_config):
    """Every optimizer read stalls 20 ms, so shards pile up behind the worker and their reads are
    started ahead (one staging buffer each, reused only after its write-back): same result."""
    batches = lm_batches(3)
    with fault_injection("read", nth=1, action="stall", value=20, count=0):
        _, hist, state = _run(tiny_lm, batches, _optim_on_nvme(engine_config, True))
    assert all(r.overlapped_shards > 0 for r in hist)
    _, _, ref = _run(tiny_lm, batches, _optim_on_nvme(engine_config, False))
    assert state.keys() == ref.keys() and all(torch.equal(state[k], ref[k]) for k in ref)


def test_a_failed_read_ahead_surfaces_and_nothing_hangs(tiny_lm, lm_batches, engine_config):
    (x, y), (x2, y2) = lm_batches(2)
    eng = pyinfinity.initialize(tiny_lm(), _optim_on_nvme(engine_config, True))
    try:
        eng.backward(eng(x, y))
        eng.step()
        with fault_injection("read", nth=2, action="errno", value=errno.EIO, count=0):
            with pytest.raises(OSError) as ei:
                eng.backward(eng(x2, y2))
                eng.step()
                eng.synchronize()
        assert ei.value.errno == errno.EIO
        assert not eng.optimizer.overlap_open
        with pytest.raises(RuntimeError, match="partly stepped"):
            eng.step()
    finally:
        _close_quickly(eng)


# ----------------------------------------------------------------------------------- the knob


@pytest.mark.parametrize("value, needle", [("yes", "pyinfinity.overlap_step"), (1, "pyinfinity.overlap_step"),
                                           (None, "pyinfinity.overlap_step")])
def test_bad_values_name_the_key(value, needle, engine_config):
    cfg = engine_config(pyinfinity={"device": "cpu", "overlap_step": value})
    with pytest.raises(ConfigError, match=needle):
        pyinfinity.config.load_config(cfg)


def test_typo_suggests_the_key(engine_config):
    with pytest.raises(ConfigError, match="did you mean 'overlap_step'"):
        pyinfinity.config.load_config(engine_config(pyinfinity={"device": "cpu", "overlap_steps": True}))


def test_true_with_a_device_step_is_an_error(engine_config):
    cfg = engine_config(pyinfinity={"device": "cpu", "optimizer_step_device": "device", "overlap_step": True})
    with pytest.raises(ConfigError, match="pyinfinity.overlap_step: true is not exact here: optimizer_step_device"):
        pyinfinity.config.load_config(cfg)
    cfg["pyinfinity"]["overlap_step"] = "auto"
    pyinfinity.config.load_config(cfg)  # auto and false are fine
    for over in ({"gradient_clipping": 1.0}, {"fp16": {"enabled": True}}):  # exact: accepted
        cfg = engine_config(**over)
        cfg["pyinfinity"] = {**cfg["pyinfinity"], "overlap_step": True}
        pyinfinity.config.load_config(cfg)


@pytest.fixture
def auto_on_cpu(monkeypatch):
    """"auto" decides as on a GPU (it is off on a CPU compute device, tested below)."""
    monkeypatch.setattr(pyinfinity.plan.resolve, "AUTO_OVERLAP_ON_CPU", True)


def test_auto_is_off_on_a_cpu_compute_device(tiny_lm, lm_batches, engine_config, caplog):
    with caplog.at_level(logging.INFO, logger="pyinfinity.engine"):
        with pyinfinity.initialize(tiny_lm(), engine_config()) as eng:
            for x, y in lm_batches(2):
                eng.backward(eng(x, y))
                assert eng.step().overlapped_shards == 0
            assert eng.overlap_step is False
    assert any("overlap_step = false (the compute device is the CPU and the optimizer state is in RAM"
               in r.getMessage() for r in caplog.records)


def test_auto_is_on_on_a_cpu_compute_device_when_the_optimizer_state_is_on_disk(tiny_lm, lm_batches, engine_config):
    """With the state on disk the background step mostly waits for the disk: worth overlapping."""
    with pyinfinity.initialize(tiny_lm(), engine_config("nvme")) as eng:
        recs = []
        for x, y in lm_batches(3):
            eng.backward(eng(x, y))
            recs.append(eng.step())
        assert eng.overlap_step is True
        assert all(r.overlapped_shards > 0 for r in recs)


def test_the_background_step_leaves_torchs_thread_count_alone(tiny_lm, lm_batches, engine_config, monkeypatch):
    """On a CPU device the background step runs one intra-op thread; the caller's count and the
    default of threads started later stay what they were."""
    want = torch.get_num_threads()
    (x, y), = lm_batches(1)
    in_worker = []
    with pyinfinity.initialize(tiny_lm(), engine_config(pyinfinity={"device": "cpu", "overlap_step": True})) as eng:
        real = eng.optimizer._adam

        def adam(*a, **kw):
            if threading.current_thread().name == "pyinfinity-optimizer":
                in_worker.append(torch.get_num_threads())
            return real(*a, **kw)

        monkeypatch.setattr(eng.optimizer, "_adam", adam)
        eng.backward(eng(x, y))
        assert eng.step().overlapped_shards > 0
    assert in_worker and set(in_worker) == {1}
    seen = []
    t = threading.Thread(target=lambda: seen.append(torch.get_num_threads()))
    t.start()
    t.join()
    assert torch.get_num_threads() == want and seen == [want]


def test_auto_is_on_from_the_first_step_and_with_clipping(tiny_lm, lm_batches, engine_config, auto_on_cpu):
    batches = lm_batches(2)
    with pyinfinity.initialize(tiny_lm(), engine_config()) as eng:
        assert eng.overlap_step is True
        for x, y in batches:
            eng.backward(eng(x, y))
            assert eng.step().overlapped_shards > 0  # units stepped during backward
    with pyinfinity.initialize(tiny_lm(), engine_config(gradient_clipping=0.5)) as eng:
        assert eng.overlap_step is True
        for x, y in batches:
            eng.backward(eng(x, y))
            assert eng.step().overlapped_shards == 0  # after backward: the norm first
        eng.synchronize()  # step() handed the units to the worker and returned
        assert all(st.step == 2 for st in eng.optimizer.states)


def test_backward_without_step_steps_nothing(tiny_lm, lm_batches, engine_config, auto_on_cpu):
    """backward() only, gradients inspected and zeroed (no step()): nothing stays stepped, and a
    forward in between sees the weights, not the gradients held in the parameter homes."""
    (x, y), = lm_batches(1)
    with pyinfinity.initialize(tiny_lm(), engine_config(gradient_clipping=1.0)) as eng:
        want = eng(x, y).item()
        for _ in range(3):
            eng.backward(eng(x, y))
            with torch.no_grad():
                assert eng(x, y).item() == want
            eng.zero_grad()
        assert all(st.step == 0 for st in eng.optimizer.states)
        assert eng(x, y).item() == want


class _ReusedUnderCheckpoint(torch.nn.Module):
    """Layer 0 applied twice, in two reentrant checkpointed segments: its parameters' gradient hooks
    run twice in one backward, so "all gradients in" comes too early for them."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList([torch.nn.Linear(8, 8) for _ in range(2)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from torch.utils.checkpoint import checkpoint

        for layer in (self.layers[0], self.layers[1], self.layers[0]):
            x = x + checkpoint(layer, x, use_reentrant=True)
        return x.pow(2).mean()


def test_a_layer_reused_under_reentrant_checkpointing_steps_once_its_last_gradient_is_in(engine_config):
    """Layer 0 runs twice per forward: its unit's gradient is complete only at the end of backward,
    so stepping it in the background gives the serial result."""
    x = torch.randn(4, 8, requires_grad=True)

    def run(overlap):
        torch.manual_seed(0)
        cfg = engine_config()
        cfg["pyinfinity"]["overlap_step"] = overlap
        with pyinfinity.initialize(_ReusedUnderCheckpoint(), cfg) as eng:
            for _ in range(3):
                eng.backward(eng(x))
                eng.step()
            return [eng.state.trained_values(sh).clone() for sh in eng.partition.shards]

    got, want = run(True), run(False)
    assert all(torch.equal(a, b) for a, b in zip(got, want))


# ----------------------------------------------------------------------------------- failures


def _close_quickly(eng) -> None:
    t0 = time.perf_counter()
    eng.close()
    assert time.perf_counter() - t0 < 10
    assert not _overlap_threads()


def test_an_io_error_in_the_background_step_surfaces_and_blocks_training(tiny_lm, lm_batches, engine_config,
                                                                          tmp_path):
    """Writes during backward are the background step's own (optimizer state write-backs): failing
    them all makes backward(), step() or, at the latest, synchronize() raise that OSError; then the state is partly stepped, so
    training refuses to go on until a checkpoint is loaded."""
    cfg = engine_config("nvme", pyinfinity={"device": "cpu", "device_memory": "64MiB", "overlap_step": True})
    (x, y), (x2, y2) = lm_batches(2)
    eng = pyinfinity.initialize(tiny_lm(), cfg)
    try:
        eng.backward(eng(x, y))
        eng.step()
        eng.save_checkpoint(str(tmp_path / "ckpt"))
        with fault_injection("write", nth=1, action="errno", value=errno.EIO, count=0):
            with pytest.raises(OSError) as ei:
                eng.backward(eng(x2, y2))
                eng.step()  # returns at once in the background mode: the failing write-backs may come later
                eng.synchronize()  # waits for the background step: its error surfaces here at the latest
        assert ei.value.errno == errno.EIO
        assert not eng.optimizer.overlap_open
        for call in (lambda: eng.step(), lambda: eng.backward(eng(x2, y2)), lambda: eng.save_checkpoint(str(tmp_path / "c2"))):
            with pytest.raises(RuntimeError, match="partly stepped"):
                call()
        eng.load_checkpoint(str(tmp_path / "ckpt"))
        eng.backward(eng(x2, y2))
        assert eng.step().overlapped_shards > 0  # trains again
    finally:
        _close_quickly(eng)


def test_the_background_steps_own_exception_is_raised_as_itself(tiny_lm, lm_batches, engine_config, monkeypatch):
    boom = ValueError("adam exploded")
    (x, y), = lm_batches(1)
    eng = pyinfinity.initialize(tiny_lm(), engine_config(pyinfinity={"device": "cpu", "overlap_step": True}))
    try:
        real = eng.optimizer._adam

        def adam(*a, **kw):
            if threading.current_thread().name == "pyinfinity-optimizer":
                raise boom
            return real(*a, **kw)

        monkeypatch.setattr(eng.optimizer, "_adam", adam)
        with pytest.raises(ValueError) as ei:
            eng.backward(eng(x, y))
            eng.step()
            eng.synchronize()  # step() returns before the worker is done: its failure surfaces at the next wait
        assert ei.value is boom
    finally:
        _close_quickly(eng)


def test_a_failing_backward_stops_the_background_step(tiny_lm, lm_batches, engine_config, tmp_path):
    """backward() raises after some shards were stepped in the background: the error is backward's,
    nothing runs on, and the partly stepped state is refused until load_checkpoint()."""
    (x, y), = lm_batches(1)
    eng = pyinfinity.initialize(tiny_lm(), engine_config(pyinfinity={"device": "cpu", "overlap_step": True}))
    try:
        eng.save_checkpoint(str(tmp_path / "ckpt"))
        want = eng(x, y).item()

        def fail(module, grad_in, grad_out):
            raise KeyError("backward failed in blocks.0")

        h = eng.module.blocks[0].register_full_backward_hook(fail)  # after the later blocks' grads are in
        with pytest.raises(KeyError, match="backward failed"):
            eng.backward(eng(x, y))
        h.remove()
        assert not eng.optimizer.overlap_open
        with pytest.raises(RuntimeError, match="partly stepped.*backward\\(\\) raised"):
            eng.step()
        eng.load_checkpoint(str(tmp_path / "ckpt"))
        assert eng(x, y).item() == want
    finally:
        _close_quickly(eng)


def test_a_second_backward_in_the_boundary_micro_batch_is_refused(tiny_lm, lm_batches, engine_config):
    (x, y), = lm_batches(1)
    eng = pyinfinity.initialize(tiny_lm(), engine_config(pyinfinity={"device": "cpu", "overlap_step": True}))
    try:
        eng.backward(eng(x, y))
        with pytest.raises(RuntimeError, match=r"call step\(\) after each backward"):
            eng.backward(eng(x, y))
        assert eng.step().overlapped_shards > 0  # the first backward's step is intact
    finally:
        _close_quickly(eng)


def test_calls_that_need_a_complete_step_refuse_the_open_window(tiny_lm, lm_batches, engine_config, tmp_path):
    (x, y), = lm_batches(1)
    with pyinfinity.initialize(tiny_lm(), engine_config(pyinfinity={"device": "cpu", "overlap_step": True})) as eng:
        eng.backward(eng(x, y))
        for call in (lambda: eng.save_checkpoint(str(tmp_path / "c")), lambda: eng.export(str(tmp_path / "e")),
                     eng.zero_grad):
            with pytest.raises(RuntimeError, match="step\\(\\)"):
                call()
        assert eng.step().overlapped_shards > 0
        eng.save_checkpoint(str(tmp_path / "c"))


def test_close_in_the_middle_of_a_window_does_not_hang(tiny_lm, lm_batches, engine_config):
    (x, y), = lm_batches(1)
    eng = pyinfinity.initialize(tiny_lm(), engine_config("nvme", pyinfinity={"device": "cpu", "overlap_step": True}))
    eng.backward(eng(x, y))
    assert eng.optimizer.overlap_open
    _close_quickly(eng)
    eng = pyinfinity.initialize(tiny_lm(), engine_config("nvme", pyinfinity={"device": "cpu", "overlap_step": True},
                                                         gradient_clipping=0.1))
    eng.backward(eng(x, y))
    eng.step()  # handed to the worker; close waits for it
    _close_quickly(eng)


def test_hyperparameters_are_those_backward_started_with(tiny_lm, lm_batches, engine_config, caplog):
    """An lr set between backward() and step() does not split a step in two: every shard uses the lr
    of the backward (as the shards stepped during it did), and a warning says so."""
    batches = lm_batches(2)
    got = {}
    for overlap in (False, True):
        cfg = engine_config(pyinfinity={"device": "cpu", "overlap_step": overlap})
        with pyinfinity.initialize(tiny_lm(), cfg) as eng:
            for i, (x, y) in enumerate(batches):
                if not overlap:
                    eng.optimizer.param_groups[0]["lr"] = 1e-2 * (i + 1)
                eng.backward(eng(x, y))
                if overlap:  # set too late: the step keeps the lr backward started with
                    eng.optimizer.param_groups[0]["lr"] = 1e-2 * (i + 2)
                with caplog.at_level(logging.WARNING, logger="pyinfinity.zero.optimizer"):
                    eng.step()
            got[overlap] = engine_state(eng)
    assert any("changed between backward() and step()" in r.getMessage() for r in caplog.records)
    assert all(torch.equal(got[False][k], got[True][k]) for k in got[False])
