"""Faults over the background optimizer step: no accepted checkpoint resumes differently from an
uninterrupted run (the short form of ``tests/python/fault_sweep.py``), and the late failures that
once slipped through are refused; a fine-tune SIGKILLed mid-run resumes from its --save-every
checkpoint with the uninterrupted run's losses, and so do runs SIGKILLed at random points of their
background saves (the NVMe state copied, or held by reference); a failing write of a background save is raised and leaves latest on the
previous checkpoint; a LoRA resume over a base changed at the end of a shard is refused."""
from __future__ import annotations

import errno
import threading

import pytest

import pyinfinity
from pyinfinity.swap.faults import fault_injection

from tests.python import fault_sweep


def test_every_accepted_checkpoint_resumes_like_an_uninterrupted_run(tmp_path):
    cases = fault_sweep.sweep(str(tmp_path), range(1, 400, 9))
    injected = [c for c in cases if c.injected]
    assert len(injected) >= 30, fault_sweep.summary(cases)
    assert {c.surfaced for c in injected} >= {"forward", "step", "synchronize"}, fault_sweep.summary(cases)
    wrong = [c for c in injected if not c.held]
    assert not wrong, fault_sweep.summary(cases) + "\n" + "\n".join(map(str, wrong))


def test_a_fine_tune_killed_mid_run_resumes_from_its_save_every_checkpoint_bit_exact(tmp_path):
    held, what = fault_sweep.finetune_killed(str(tmp_path))
    assert held, what


def test_background_saves_killed_at_random_points_resume_from_the_newest_complete_checkpoint_bit_exact(tmp_path):
    trials = fault_sweep.saves_killed(str(tmp_path), trials=20, seed=0)
    wrong = [t for t in trials if not t["held"]]
    assert not wrong, "\n".join(map(str, wrong))
    assert all(t["version"] in (None, 4) for t in trials)  # copied into state.bin (by_reference=False)
    # the kills landed inside saves: a half-written checkpoint, a rotation or latest's move in flight
    assert sum(bool(t["in_flight"]) for t in trials) >= 5, "\n".join(map(str, trials))
    assert all(t["latest"] is None or t["resumed_from"] == int(t["latest"][len("global_step"):]) for t in trials)


def test_by_reference_saves_killed_at_random_points_resume_from_the_newest_complete_checkpoint_bit_exact(tmp_path):
    """The NVMe optimizer state held by reference: killed during a save or during the steps after
    it (which rewrite its shards into fresh slots while rotation frees the slots of the removed
    checkpoints), the next start's stale cleanup unlinks the swap name only and the resume from
    ``latest`` (the swap file it links) has the uninterrupted run's losses, bit for bit."""
    trials = fault_sweep.saves_killed(str(tmp_path), trials=10, seed=1, by_reference=True)
    wrong = [t for t in trials if not t["held"]]
    assert not wrong, "\n".join(map(str, wrong))
    assert all(t["version"] in (None, 5) for t in trials), "\n".join(map(str, trials))
    assert sum(t["resumed_from"] > 0 for t in trials) >= 5, "\n".join(map(str, trials))
    assert all(t["latest"] is None or t["resumed_from"] == int(t["latest"][len("global_step"):]) for t in trials)


@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EIO])
def test_a_failing_background_save_write_is_raised_and_latest_keeps_the_previous_checkpoint(code, tmp_path):
    cases = fault_sweep.save_faults(str(tmp_path), range(1, 80, 5), codes=(code,))
    injected = [c for c in cases if c["injected"]]
    assert len(injected) >= 3 and all(c["raised"] for c in injected), cases
    assert all(c["held"] for c in cases), cases


def test_a_lora_resume_over_a_base_changed_at_the_end_of_a_shard_is_refused(tmp_path):
    refused, why = fault_sweep.changed_base_refused(str(tmp_path))
    assert refused, why
    assert "tensor(s) differ" in why, why


def test_a_late_write_back_failure_with_clipping_refuses_the_save(tmp_path):
    """With clipping every shard is handed to the worker in step(); a write-back of step 3 that
    fails after the next forward has read its unit surfaces only in step 4's step(): the state is
    partly stepped, so the save is refused (it was accepted, and resumed with other losses)."""
    batches = fault_sweep._batches()
    late = 0
    for nth in range(1, 60):
        root = tmp_path / str(nth)
        with fault_sweep._engine(str(root), "clipped") as eng:
            fault_sweep._train(eng, batches[:2])
            eng.backward(eng(*batches[2]))
            try:
                with fault_injection(op="write", nth=nth, action="errno", value=errno.EIO):
                    eng.step()
                    loss = eng(*batches[3])
            except OSError:
                continue  # surfaced early: covered by the sweep
            try:
                eng.backward(loss)
                eng.step()
            except OSError:
                late += 1
                with pytest.raises(RuntimeError, match="partly stepped"):
                    eng.save_checkpoint(str(root / "ckpt"))
                with pytest.raises(RuntimeError, match="partly stepped"):
                    eng.backward(eng(*batches[3]))
            else:
                break  # past the step's write-backs
    assert late >= 1


def test_a_forward_after_a_background_failure_gets_the_partly_stepped_refusal(tiny_lm, lm_batches, engine_config,
                                                                                monkeypatch, tmp_path):
    """The worker fails on shard 0; the next forward raises that failure. The worker must go on
    skipping the shards queued behind (it once stepped them with no read issued: AttributeError
    'NoneType' object has no attribute 'wait'); a second forward gets the partly-stepped refusal."""
    cfg = engine_config("nvme", gradient_clipping=1.0,
                        pyinfinity={"device": "cpu", "device_memory": "64MiB", "overlap_step": True})
    cfg["zero_optimization"]["offload_param"] = {"device": "cpu"}
    cfg["zero_optimization"]["offload_optimizer"]["buffer_count"] = 3
    (x, y), = lm_batches(1)
    eng = pyinfinity.initialize(tiny_lm(), cfg)
    try:
        opt = eng.optimizer
        first = opt.states[0].shard.index
        boom = OSError(errno.EIO, "injected")
        go = threading.Event()
        real_adam, real_read = opt._adam, opt.swapper.read

        def adam(st, *a, **kw):
            if threading.current_thread() is opt.worker.thread and st.shard.index == first:
                raise boom
            return real_adam(st, *a, **kw)

        class Held:  # the read of the shard after the failing one completes once the test says so
            def __init__(self, req):
                self.req = req

            def wait(self, *a, **kw):
                go.wait(30)
                return self.req.wait(*a, **kw)

        def read(home, buf):
            req = real_read(home, buf)
            second = opt.states[1].home
            return Held(req) if threading.current_thread() is opt.worker.thread and home is second else req

        monkeypatch.setattr(opt, "_adam", adam)
        monkeypatch.setattr(opt.swapper, "read", read)
        eng.backward(eng(x, y))
        eng.step()  # hands every shard over
        with pytest.raises(OSError) as ei:
            eng(x, y)
        assert ei.value is boom
        go.set()
        with pytest.raises(RuntimeError, match="partly stepped"):
            eng(x, y)
        with pytest.raises(RuntimeError, match="partly stepped"):
            opt.drain()
        with pytest.raises(RuntimeError, match="partly stepped"):
            eng.save_checkpoint(str(tmp_path / "ckpt"))
    finally:
        go.set()
        eng.close()
