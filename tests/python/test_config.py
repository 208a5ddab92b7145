"""Config: DeepSpeed-format parsing, validation errors that name the key, "auto" resolution, and the
DeepSpeed learning-rate schedules."""
from __future__ import annotations

import json
import logging
import os

import pytest

from pyinfinity.config import AUTO, ConfigError, load_config, parse_size


def base(**over):
    cfg = {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 3}}
    cfg.update(over)
    return cfg


@pytest.mark.parametrize("cfg, key, suggestion", [
    ({"zero_optimizaton": {"stage": 3}}, "zero_optimizaton", "zero_optimization"),
    ({"gradient_cliping": 1.0}, "gradient_cliping", "gradient_clipping"),
    ({"zero_optimization": {"stage": 3, "offload_parm": {"device": "cpu"}}},
     "zero_optimization.offload_parm", "offload_param"),
    ({"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu", "pin_memroy": True}}},
     "zero_optimization.offload_optimizer.pin_memroy", "pin_memory"),
    ({"optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "beta": [0.9, 0.99]}}},
     "optimizer.params.beta", "betas"),
    ({"optimizer": {"type": "AdamWW"}}, "optimizer.type", "AdamW"),
])
def test_misspelt_key_names_key_and_suggests(cfg, key, suggestion):
    with pytest.raises(ConfigError) as exc:
        load_config(cfg)
    msg = str(exc.value)
    assert key in msg and repr(suggestion) in msg, msg


def test_ignored_deepspeed_key_warns_once(caplog):
    with caplog.at_level(logging.WARNING, logger="pyinfinity.config"):
        load_config(base(steps_per_print=10, wall_clock_breakdown=False))
    assert any("wall_clock_breakdown" in r.getMessage() for r in caplog.records)


def test_steps_per_print_is_the_step_lines_interval_as_in_deepspeed(caplog):
    assert load_config(base()).steps_per_print == 10  # DeepSpeed's default
    with caplog.at_level(logging.WARNING, logger="pyinfinity.config"):
        assert load_config(base(steps_per_print=3)).steps_per_print == 3
    assert not any("steps_per_print" in r.getMessage() for r in caplog.records)  # it acts: no "ignored"
    with pytest.raises(ConfigError, match="steps_per_print"):
        load_config(base(steps_per_print=0))


@pytest.mark.parametrize("stage", [0, 1, 2])
def test_stage_other_than_3_is_an_error(stage):
    cfg = base(zero_optimization={"stage": stage, "offload_optimizer": {"device": "cpu"}})
    with pytest.raises(ConfigError, match=r"zero_optimization\.stage"):
        load_config(cfg)


@pytest.mark.parametrize("section", ["offload_param", "offload_optimizer"])
def test_nvme_without_path_is_an_error(section):
    cfg = base(zero_optimization={"stage": 3, section: {"device": "nvme"}})
    with pytest.raises(ConfigError, match=rf"zero_optimization\.{section}\.nvme_path"):
        load_config(cfg)


def test_unwritable_nvme_path_is_an_error(tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("x")  # a directory cannot be created below a regular file, even by root
    cfg = base(zero_optimization={"stage": 3, "offload_param": {"device": "nvme",
                                                                 "nvme_path": str(blocker / "swap")}})
    with pytest.raises(ConfigError, match="nvme_path") as exc:
        load_config(cfg)
    assert str(blocker / "swap") in str(exc.value)


def test_read_only_mount_is_an_error(tmpfs_dir):
    import subprocess

    subprocess.run(["mount", "-o", "remount,ro", tmpfs_dir], check=True)
    try:
        cfg = base(zero_optimization={"stage": 3, "offload_optimizer": {"device": "nvme",
                                                                         "nvme_path": tmpfs_dir}})
        with pytest.raises(ConfigError, match="not writable"):
            load_config(cfg)
    finally:
        subprocess.run(["mount", "-o", "remount,rw", tmpfs_dir], check=True)


@pytest.mark.parametrize("cfg, key", [
    ({"gradient_clipping": -1.0}, "gradient_clipping"),
    ({"optimizer": {"type": "Adam", "params": {"lr": "fast"}}}, "optimizer.params.lr"),
    ({"optimizer": {"type": "Adam", "params": {"betas": [0.9, 1.5]}}}, "optimizer.params.betas[1]"),
    ({"zero_optimization": {"stage": 3, "offload_param": {"device": "disk"}}},
     "zero_optimization.offload_param.device"),
    ({"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu", "ratio": 1.5}}},
     "zero_optimization.offload_optimizer.ratio"),
    ({"pyinfinity": {"device_memory": "eight gigs"}}, "pyinfinity.device_memory"),
    ({"pyinfinity": {"device": "tpu"}}, "pyinfinity.device"),
    ({"fp16": {"enabled": True}, "bf16": {"enabled": True}}, "bf16.enabled"),
    ({"scheduler": {"type": "WarmupDecayLR", "params": {"warmup_num_steps": 10}}},
     "scheduler.params.total_num_steps"),
    ({"train_batch_size": 6, "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2},
     "train_batch_size"),
])
def test_impossible_values_name_the_key(cfg, key):
    with pytest.raises(ConfigError) as exc:
        load_config(cfg)
    assert key in str(exc.value), str(exc.value)


def test_batch_sizes_are_reconciled():
    c = load_config({"train_batch_size": 12, "train_micro_batch_size_per_gpu": 3})
    assert c.gradient_accumulation_steps == 4
    c = load_config({"train_batch_size": 12, "gradient_accumulation_steps": 6})
    assert c.train_micro_batch_size_per_gpu == 2


def test_full_deepspeed_config_from_json_file(tmp_path):
    cfg = {
        "train_batch_size": 8, "gradient_accumulation_steps": 2, "gradient_clipping": 1.0,
        "bf16": {"enabled": True},
        "optimizer": {"type": "Adam", "params": {"lr": 3e-4, "betas": [0.9, 0.95], "eps": 1e-8,
                                                 "weight_decay": 0.1, "adam_w_mode": False}},
        "scheduler": {"type": "WarmupCosineLR", "params": {"total_num_steps": 100, "warmup_num_steps": 10}},
        "zero_optimization": {
            "stage": 3, "overlap_comm": True, "contiguous_gradients": True,
            "offload_param": {"device": "nvme", "nvme_path": [str(tmp_path / "a"), str(tmp_path / "b")],
                              "buffer_count": 5, "buffer_size": "100MB", "max_in_cpu": 1e9},
            "offload_optimizer": {"device": "nvme", "nvme_path": str(tmp_path / "a"), "ratio": 0.5},
            "stage3_prefetch_bucket_size": "auto", "stage3_param_persistence_threshold": 1e4,
        },
        "aio": {"block_size": 1048576, "queue_depth": 8, "thread_count": 1, "single_submit": False,
                "overlap_events": True},
        "pyinfinity": {"device": "cpu", "device_memory": "2GiB"},
    }
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(cfg))
    c = load_config(str(path))
    assert c.train_micro_batch_size_per_gpu == 4
    assert c.optimizer.type == "Adam" and c.optimizer.adam_w_mode is False and c.optimizer.betas == (0.9, 0.95)
    assert c.zero_optimization.offload_param.nvme_path == [str(tmp_path / "a"), str(tmp_path / "b")]
    assert c.zero_optimization.offload_param.buffer_size == 100_000_000
    assert c.zero_optimization.stage3_prefetch_bucket_size == AUTO
    assert c.zero_optimization.stage3_param_persistence_threshold == 10_000
    assert c.pyinfinity.device_memory == 2 << 30
    assert c.nvme_paths == [str(tmp_path / "a"), str(tmp_path / "b")]
    assert not os.path.exists(tmp_path / "b")  # loading a config creates nothing: the engine makes it at start


def test_bad_json_file_is_a_config_error(tmp_path):
    p = tmp_path / "bad.json"
    p.write_text("{not json")
    with pytest.raises(ConfigError, match="not valid JSON"):
        load_config(str(p))
    with pytest.raises(ConfigError, match="cannot read config file"):
        load_config(str(tmp_path / "missing.json"))


@pytest.mark.parametrize("text, n", [("8GiB", 8 << 30), ("512MB", 512_000_000), ("1e9", 10**9),
                                     ("64 MiB", 64 << 20), (4096, 4096), (1.5e3, 1500)])
def test_parse_size(text, n):
    assert parse_size(text) == n


# ----------------------------------------------------------------------------- LR schedules


class _Opt:
    def __init__(self, lr):
        self.param_groups = [{"lr": lr, "initial_lr": lr}]


@pytest.mark.parametrize("name, params", [
    ("WarmupLR", {"warmup_min_lr": 1e-5, "warmup_max_lr": 1e-3, "warmup_num_steps": 7, "warmup_type": "log"}),
    ("WarmupLR", {"warmup_min_lr": 0.0, "warmup_max_lr": 2e-3, "warmup_num_steps": 5, "warmup_type": "linear"}),
    ("WarmupDecayLR", {"total_num_steps": 20, "warmup_min_lr": 0.0, "warmup_max_lr": 1e-3,
                       "warmup_num_steps": 5, "warmup_type": "linear"}),
    ("WarmupCosineLR", {"total_num_steps": 20, "warmup_min_ratio": 0.1, "warmup_num_steps": 4,
                        "cos_min_ratio": 0.01, "warmup_type": "log"}),
])
def test_schedules_match_deepspeed(name, params):
    import torch
    from deepspeed.runtime import lr_schedules as ds

    from pyinfinity.zero.lr_schedules import build_scheduler

    mine_opt = _Opt(1e-3)
    mine = build_scheduler(name, mine_opt, dict(params))
    ref_opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1e-3)
    ref = getattr(ds, name)(ref_opt, **params)
    got, want = [], []
    for _ in range(25):
        got.append(mine_opt.param_groups[0]["lr"])
        want.append(ref_opt.param_groups[0]["lr"])
        mine.step()
        ref.step()
    assert got == pytest.approx(want, rel=1e-12, abs=1e-15)
    assert len(set(round(x, 12) for x in got)) > 2  # the schedule really moves


def test_pyinfinitys_own_warm_up_gives_the_first_optimizer_step_a_learning_rate_and_deepspeeds_does_not():
    from pyinfinity.config import parse_scheduler
    from pyinfinity.zero.lr_schedules import build_scheduler

    peak = 1e-3
    cfg = parse_scheduler({"type": "LinearWarmupCosineLR", "params": {"total_num_steps": 10, "warmup_num_steps": 4}})
    opt = _Opt(peak)
    sched = build_scheduler(cfg.type, opt, dict(cfg.params))
    lrs = []
    for _ in range(10):  # the lr each optimizer step 1..10 runs with
        lrs.append(opt.param_groups[0]["lr"])
        sched.step()
    assert lrs[:4] == pytest.approx([peak / 4, peak / 2, 3 * peak / 4, peak], rel=1e-12)
    assert all(a > b for a, b in zip(lrs[3:], lrs[4:]))  # then the cosine decay
    assert lrs[-1] == pytest.approx(1e-4 * peak, rel=1e-9)  # to cos_min_ratio at total_num_steps
    for k in (1, 3, 7):  # built for a resume: last_batch_iteration k - 2 sets the lr of step k
        again = _Opt(peak)
        build_scheduler(cfg.type, again, {**cfg.params, "last_batch_iteration": k - 2})
        assert again.param_groups[0]["lr"] == pytest.approx(lrs[k - 1], rel=1e-12)
    # DeepSpeed's WarmupLR (kept as DeepSpeed has it): its minimum, 0 by default, for the first two steps
    ds = _Opt(peak)
    sched = build_scheduler("WarmupLR", ds, {"warmup_max_lr": peak, "warmup_num_steps": 4, "warmup_type": "linear"})
    first = [ds.param_groups[0]["lr"]]
    sched.step()
    first.append(ds.param_groups[0]["lr"])
    sched.step()
    assert first == [0.0, 0.0] and ds.param_groups[0]["lr"] == pytest.approx(peak / 4)


def test_offload_param_buffer_size_is_accepted_and_said_to_be_unused(caplog, monkeypatch):
    import logging

    import pyinfinity.config

    monkeypatch.setattr(pyinfinity.config, "_said", {})  # said once per process: as if none was loaded yet
    cfg = {"zero_optimization": {"stage": 3, "offload_param": {"device": "cpu", "buffer_size": 1.5e8}}}
    with caplog.at_level(logging.INFO, logger="pyinfinity.config"):
        load_config(cfg)
        load_config(cfg)  # plan and the engine load a config several times: the note comes once
    said = [r for r in caplog.records
            if "offload_param.buffer_size: accepted for DeepSpeed compatibility and not used" in r.getMessage()]
    assert len(said) == 1


BF16_STATE = {"enabled": True, "bf16_master_weights_and_grads": True, "bf16_optimizer_states": True}


@pytest.mark.parametrize("cfg, fmt", [
    (base(), "fp32"),
    (base(pyinfinity={"optimizer_state": "8bit"}), "8bit"),
    (base(pyinfinity={"optimizer_state": "FP32"}), "fp32"),
    (base(bf16={"enabled": True, "bf16_master_weights_and_grads": False, "bf16_optimizer_states": False}), "fp32"),
    (base(bf16=BF16_STATE), "bf16"),
])
def test_optimizer_state_format(cfg, fmt):
    c = load_config(cfg)
    assert c.optimizer_state_format == fmt
    assert load_config(c.to_dict()).optimizer_state_format == fmt  # the written config says the same


@pytest.mark.parametrize("cfg, match", [
    (base(pyinfinity={"optimizer_state": "int4"}), r"pyinfinity\.optimizer_state: expected one of fp32, 8bit"),
    (base(pyinfinity={"optimizer_state": "bf16"}), r"bf16_master_weights_and_grads\": true"),
    (base(bf16={"enabled": True, "bf16_optimizer_states": True}),
     r"bf16\.bf16_optimizer_states: requires bf16\.bf16_master_weights_and_grads"),
    (base(bf16={"bf16_master_weights_and_grads": True, "bf16_optimizer_states": True}),
     r"bf16\.bf16_master_weights_and_grads: requires bf16\.enabled"),
    (base(bf16={"enabled": True, "bf16_master_weights_and_grads": True}),
     r"without bf16\.bf16_optimizer_states .* is not supported"),
    (base(bf16=BF16_STATE, pyinfinity={"optimizer_state": "8bit"}), r"\"8bit\" keeps an fp32 master"),
    (base(bf16={"enabled": True, "bf16_optimizer_states": "yes"}), r"bf16\.bf16_optimizer_states: expected true"),
    (base(fp16={"enabled": True}, bf16=BF16_STATE), r"at most one of them"),
])
def test_optimizer_state_combinations_that_make_no_sense_are_one_line_errors(cfg, match):
    with pytest.raises(ConfigError, match=match) as exc:
        load_config(cfg)
    assert "\n" not in str(exc.value)


@pytest.mark.parametrize("cfg, name", [(base(pyinfinity={"optimizer_state": "8bit", "device": "cpu"}), "8bit"),
                                       (base(bf16=BF16_STATE, pyinfinity={"device": "cpu"}), "bf16"),
                                       (base(pyinfinity={"device": "cpu"}), "fp32")])
def test_the_engine_stores_the_state_the_config_asks_for(cfg, name):
    """Never an fp32 state in place of the one asked for: the optimizer's format, and what
    memory_report says, are the config's."""
    import torch

    import pyinfinity

    with pyinfinity.initialize(torch.nn.Linear(64, 64), cfg) as eng:
        assert eng.optimizer.format.name == name
        assert eng.memory_report().optimizer_state == name


@pytest.mark.parametrize("name, params", [
    ("WarmupCosineLR", {"total_num_steps": 10, "warmup_min_ratio": 0.1, "warmup_num_steps": 3}),
    ("LinearWarmupCosineLR", {"total_num_steps": 10, "warmup_num_steps": 3}),
])
def test_the_ratio_schedules_scale_each_param_groups_own_lr(name, params):
    # param groups of other lrs (an embedding's or LoRA+'s): each follows the schedule from its own peak
    from pyinfinity.zero.lr_schedules import build_scheduler

    one, two = _Opt(1e-3), _Opt(1e-3)
    two.param_groups.append({"lr": 4e-3, "initial_lr": 4e-3})
    a, b = build_scheduler(name, one, dict(params)), build_scheduler(name, two, dict(params))
    for _ in range(10):
        assert two.param_groups[0]["lr"] == one.param_groups[0]["lr"]
        assert two.param_groups[1]["lr"] == pytest.approx(4 * one.param_groups[0]["lr"], rel=1e-12)
        a.step()
        b.step()
