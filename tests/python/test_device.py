"""Device specs: ``cuda`` and ``auto`` on a GPU machine become one indexed CUDA device (torch's
per-device memory calls refuse ``cuda`` without an index), ``LOCAL_RANK`` picks it under torchrun.
CUDA is mocked here (this runs on CPU-only CI); the GPU suite runs the real thing."""
from __future__ import annotations

import pytest
import torch

from pyinfinity.device import resolve_device


@pytest.fixture
def gpus(monkeypatch):
    """A machine with ``n`` CUDA devices, the current one ``current`` (torch.cuda mocked)."""
    def make(n: int = 2, current: int = 1) -> None:
        monkeypatch.setattr(torch.cuda, "is_available", lambda: n > 0)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: n)
        monkeypatch.setattr(torch.cuda, "current_device", lambda: current)
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    return make


def test_cuda_and_auto_get_the_current_device_index(gpus):
    gpus(2, current=1)
    assert resolve_device("cuda") == torch.device("cuda", 1)
    assert resolve_device("auto") == torch.device("cuda", 1)
    assert resolve_device(torch.device("cuda")) == torch.device("cuda", 1)
    assert resolve_device("cuda:0") == torch.device("cuda", 0)
    assert resolve_device("cpu") == torch.device("cpu")


def test_local_rank_picks_the_gpu(gpus, monkeypatch):
    gpus(4, current=0)
    monkeypatch.setenv("LOCAL_RANK", "3")
    assert resolve_device("cuda") == torch.device("cuda", 3)
    assert resolve_device("auto") == torch.device("cuda", 3)
    assert resolve_device("cuda:1") == torch.device("cuda", 1)  # an explicit index wins
    monkeypatch.setenv("LOCAL_RANK", "7")
    with pytest.raises(ValueError, match="LOCAL_RANK=7.*4 GPU"):
        resolve_device("cuda")
    monkeypatch.setenv("LOCAL_RANK", "x")
    with pytest.raises(ValueError, match="LOCAL_RANK"):
        resolve_device("auto")


def test_one_visible_gpu_per_process_is_that_gpu(gpus, monkeypatch):
    gpus(1, current=0)
    monkeypatch.setenv("LOCAL_RANK", "5")  # the launcher set CUDA_VISIBLE_DEVICES per process
    assert resolve_device("cuda") == torch.device("cuda", 0)


def test_missing_devices(gpus):
    gpus(0)
    assert resolve_device("auto") == torch.device("cpu")
    with pytest.raises(ValueError, match="no CUDA device"):
        resolve_device("cuda")
    assert resolve_device("cuda", must_exist=False) == torch.device("cuda")  # planning for elsewhere
    gpus(2)
    with pytest.raises(ValueError, match="2 GPU"):
        resolve_device("cuda:2")
    assert resolve_device("cuda:2", must_exist=False) == torch.device("cuda", 2)
    with pytest.raises(ValueError, match="expected cpu, cuda"):
        resolve_device("gpu0")


def test_engine_planner_config_and_cli_resolve_with_the_index(gpus, monkeypatch):
    from pyinfinity.cli.errors import UsageError, check_device_here
    from pyinfinity.config import ConfigError, load_config
    from pyinfinity.engine import _resolve_device
    from pyinfinity.plan.resolve import planned_device

    gpus(2, current=1)
    assert _resolve_device("auto") == torch.device("cuda", 1)
    assert _resolve_device("cuda") == torch.device("cuda", 1)
    cfg = load_config({"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3}})
    assert cfg.pyinfinity.device == "auto"
    assert planned_device(cfg, None) == torch.device("cuda", 1)
    assert planned_device(cfg, "cuda") == torch.device("cuda", 1)
    assert check_device_here("auto") == "cuda:1"
    assert check_device_here("cuda") == "cuda:1"
    assert check_device_here("cpu") == "cpu"
    monkeypatch.setenv("LOCAL_RANK", "0")
    assert check_device_here("cuda") == "cuda:0"
    with pytest.raises(UsageError, match="--device"):
        check_device_here("cuda:5")
    gpus(0)
    with pytest.raises(ConfigError, match="pyinfinity.device: .*no CUDA device"):
        _resolve_device("cuda")
    assert _resolve_device("auto") == torch.device("cpu")


def test_the_engine_caps_an_indexed_device(gpus, monkeypatch, tiny_lm, engine_config):
    """``pyinfinity.device`` left "auto" on a GPU machine: the memory fraction is set on cuda:N,
    never on a bare ``cuda`` (which torch refuses). The engine stops at the first CUDA call past
    the cap (this machine has no GPU)."""
    gpus(2, current=1)
    seen = []

    class Stop(Exception):
        pass

    def set_fraction(fraction, device=None):
        seen.append(device)
        torch.cuda._utils._get_device_index(device)  # torch's own check: raises on a bare "cuda"
        raise Stop

    monkeypatch.setattr(torch.cuda, "set_device", lambda d: seen.append(("set_device", d)))
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda d: type("P", (), {"total_memory": 80 << 30})())
    monkeypatch.setattr(torch.cuda, "set_per_process_memory_fraction", set_fraction)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda d=None: (70 << 30, 80 << 30))
    import pyinfinity
    import pyinfinity.plan

    cfg = engine_config()
    cfg["pyinfinity"] = {"device_memory": "64MiB"}  # device: "auto", as README's example
    planned = []

    def plan(c, model, device, **kw):  # the planner would probe the (absent) GPU's rates
        planned.append(device)
        c.pyinfinity.unit_bytes = 1 << 20  # the planner decides every "auto"; this one the engine reads first
        return c, [], None
    monkeypatch.setattr(pyinfinity.plan, "plan_engine_config", plan)
    with pytest.raises(Stop):
        pyinfinity.initialize(tiny_lm(), cfg)
    assert seen == [("set_device", torch.device("cuda", 1)), torch.device("cuda", 1)]
    assert planned == [torch.device("cuda", 1)]


def test_engine_inputs_move_to_its_device():
    """A CPU batch (what a DataLoader yields) given to an engine on a GPU is moved there; other
    values pass through as they are."""
    from pyinfinity.engine import _inputs_to

    meta = torch.device("meta")  # a device that is not the CPU, without a GPU
    x, y = torch.ones(2, 3, dtype=torch.long), torch.zeros(2)
    out = _inputs_to({"input_ids": x, "labels": [y, (y, 3)], "n": 4, "s": "a"}, meta)
    assert out["input_ids"].device == meta and out["input_ids"].dtype == torch.long
    assert out["labels"][0].device == meta and out["labels"][1][0].device == meta
    assert isinstance(out["labels"][1], tuple) and out["labels"][1][1] == 3
    assert out["n"] == 4 and out["s"] == "a"
    m = torch.empty(2, device=meta)
    assert _inputs_to((m,), meta)[0] is m  # already there: not copied
