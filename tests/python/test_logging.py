"""What the package logs reaches a user who configured no logging: WARNING and above on stderr
(e.g. the removal of a crashed run's swap files), INFO not until an engine is made, then the
engine's plan, progress and a step line every ``steps_per_print`` steps; once the application
configures logging, records go its way only (never twice)."""
from __future__ import annotations

import re
import subprocess
import sys

SCRIPT = """
import logging, sys
import pyinfinity
{setup}
log = logging.getLogger("pyinfinity.swap.ownership")
log.info("an info line")
log.warning("stale swap files removed")
"""


def run(setup: str = "") -> str:
    p = subprocess.run([sys.executable, "-c", SCRIPT.format(setup=setup)], capture_output=True, text=True,
                       timeout=120)
    assert p.returncode == 0, p.stderr
    return p.stderr


def test_warnings_reach_a_user_who_configured_nothing_and_info_stays_quiet():
    err = run()
    assert "stale swap files removed" in err and "WARNING" in err
    assert "an info line" not in err


def test_a_configured_application_gets_each_record_once_its_own_way():
    err = run("logging.basicConfig(level=logging.INFO, format='APP %(levelname)s %(message)s', stream=sys.stderr)")
    assert err.count("stale swap files removed") == 1 and "APP WARNING stale swap files removed" in err
    assert "APP INFO an info line" in err


ENGINE = """
import logging, sys, torch
import pyinfinity
from transformers import LlamaConfig, LlamaForCausalLM
{setup}
cfg = {{"train_micro_batch_size_per_gpu": 2, "optimizer": {{"type": "AdamW", "params": {{"lr": 1e-3}}}},
        "zero_optimization": {{"stage": 3, "offload_param": {{"device": "cpu"}}, "offload_optimizer": {{"device": "cpu"}}}},
        "pyinfinity": {{"device": "cpu", "device_memory": "64MiB"}}{extra}}}
model = LlamaForCausalLM(LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                                     num_key_value_heads=2, vocab_size=256))
with pyinfinity.initialize(model, cfg) as eng:
    for _ in range(12):
        b = torch.randint(0, 256, (2, 16))
        eng.backward(eng(input_ids=b, labels=b).loss)
        eng.step()
"""


def run_engine(setup: str = "", extra: str = "") -> str:
    p = subprocess.run([sys.executable, "-c", ENGINE.format(setup=setup, extra=extra)], capture_output=True,
                       text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    return p.stderr


def step_lines(err: str) -> list[int]:
    return [int(line.split("step ", 1)[1].split()[0]) for line in err.splitlines() if " step " in f" {line}"
            and "loss" in line]


def test_an_engine_prints_a_step_line_every_ten_steps_without_a_logging_setup():
    err = run_engine()
    assert step_lines(err) == [10], err
    assert "plan (the config's placement, checked)" in err and "engine ready" in err


def test_steps_per_print_sets_the_step_lines_interval():
    assert step_lines(run_engine(extra=', "steps_per_print": 4')) == [4, 8, 12]


def test_a_user_quiets_the_engine_by_setting_the_package_loggers_level():
    err = run_engine('logging.getLogger("pyinfinity").setLevel(logging.WARNING)')
    assert step_lines(err) == [] and "engine ready" not in err, err


def test_the_starts_progress_says_modules_bytes_and_time_left_every_interval(caplog):
    import logging

    from pyinfinity.progress import Progress

    now = [100.0]
    prog = Progress("loading the weights into their tiers", 10, 10 << 30, interval=5.0, clock=lambda: now[0])
    with caplog.at_level(logging.INFO, logger="pyinfinity.progress"):
        prog.advance(modules=1, nbytes=1 << 30)
        now[0] += 4.0
        prog.advance(modules=1, nbytes=1 << 30)  # within the interval: quiet
        assert not caplog.records
        now[0] += 1.0  # 5 s in, 2 GiB done: 8 GiB left at 2 GiB / 5 s
        prog.advance(modules=1, nbytes=0)
    assert [r.getMessage() for r in caplog.records] == [
        "loading the weights into their tiers: 3/10 modules, 2.00 GiB of 10.00 GiB (409.60 MiB/s), 5s so far, "
        "about 20s left"]


def test_the_starts_progress_says_what_it_wrote_to_disk_beside_the_weights_it_placed(caplog):
    """A state placed on disk writes more than the weights' bytes (an fp32 master and moments):
    the progress line says the disk's bytes and rate beside the weights' (counted from its start)."""
    import logging

    from pyinfinity.progress import Progress

    now, written = [0.0], [7 << 30]  # 7 GiB written before this phase: not its own

    prog = Progress("writing the weights to their tiers", 4, 4 << 30, interval=5.0, clock=lambda: now[0],
                    disk_written=lambda: written[0])
    with caplog.at_level(logging.INFO, logger="pyinfinity.progress"):
        now[0], written[0] = 5.0, (7 << 30) + (5 << 30)
        prog.advance(modules=1, nbytes=1 << 30)
    assert [r.getMessage() for r in caplog.records] == [
        "writing the weights to their tiers: 1/4 modules, 1.00 GiB of 4.00 GiB (204.80 MiB/s), 5.00 GiB written "
        "to disk (1.00 GiB/s), 5s so far, about 15s left"]


def test_the_planned_step_is_logged_once_not_with_every_decision(caplog, tmp_path):
    import logging

    from transformers import LlamaConfig, LlamaForCausalLM

    import pyinfinity

    cfg = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
           "zero_optimization": {"stage": 3, "offload_param": {"device": "auto", "nvme_path": str(tmp_path)},
                                 "offload_optimizer": {"device": "auto", "nvme_path": str(tmp_path)}},
           "pyinfinity": {"device": "cpu", "device_memory": "64MiB"}}
    with caplog.at_level(logging.INFO, logger="pyinfinity"):
        model = LlamaForCausalLM(LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                             num_attention_heads=4, num_key_value_heads=2, vocab_size=256))
        with pyinfinity.initialize(model, cfg):
            pass
    predicted = [r.getMessage() for r in caplog.records if "s/step (compute" in r.getMessage()]
    assert len(predicted) == 1 and predicted[0].startswith("plan:"), predicted
    decided = [r.getMessage() for r in caplog.records if r.getMessage().startswith("auto: ")]
    assert any("zero_optimization.offload_param.device = " in m and "see the plan above" in m for m in decided)


def test_the_engines_start_logs_its_progress_through_the_weights(caplog, monkeypatch, tmp_path):
    """The start's progress lines (here one per module: interval 0) count modules and bytes up to the
    model's totals while the weights are initialised and written to their tiers."""
    import functools
    import logging

    from transformers import LlamaConfig, LlamaForCausalLM

    import pyinfinity
    import pyinfinity.zero.state as state_mod
    from pyinfinity.progress import Progress

    monkeypatch.setattr(state_mod, "Progress", functools.partial(Progress, interval=0.0))
    cfg = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
           "zero_optimization": {"stage": 3, "offload_param": {"device": "nvme", "nvme_path": str(tmp_path)},
                                 "offload_optimizer": {"device": "nvme", "nvme_path": str(tmp_path)}},
           "pyinfinity": {"device": "cpu", "device_memory": "64MiB"}}
    with pyinfinity.init_empty(cfg):
        model = LlamaForCausalLM(LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                             num_attention_heads=4, num_key_value_heads=2, vocab_size=256))
    with caplog.at_level(logging.INFO, logger="pyinfinity.progress"):
        with pyinfinity.initialize(model, cfg):
            pass
    lines = [r.getMessage() for r in caplog.records if r.name == "pyinfinity.progress"]
    assert lines and all(m.startswith("writing the weights to their tiers: ") for m in lines)
    n = sum(1 for m in model.modules() if m._parameters)
    assert f"{n}/{n} modules" in lines[-1] and "left" in lines[-1], lines[-1]


def test_a_fixed_placement_logs_its_layout_and_one_line_saying_how_to_get_a_predicted_step():
    # the engine probes no rates for a placement the config fixes (the quick probe would lengthen every start)
    lines = run_engine().splitlines()
    summary = [ln for ln in lines if "plan (the config's placement, checked)" in ln]
    assert len(summary) == 1 and "device peak" in summary[0] and "host RAM" in summary[0], lines
    hint = [ln for ln in lines if "step time not predicted" in ln]
    assert len(hint) == 1, lines
    assert "`pyinfinity plan --config FILE --model MODEL_DIR` (or --model-size NAME)" in hint[0]
    assert not any(re.search(r"predicted: [\d.]+ s/step", ln) for ln in lines)  # no figure without rates
