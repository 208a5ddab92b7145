"""The planner against measurement, on the CPU device: a small model, a host RAM budget that cannot
hold the whole training state, and a slow disk (the I/O fault seam stalls every piece). The
planner's configuration must be at least as fast as each of four hand configurations that fit the
same budget (all measured in this run, medians of a few steps), and its predicted step time
within 25% of the measured one. Numbers are printed (pytest -s) and kept in the assertion text.
"""
from __future__ import annotations

import statistics
import time

import torch
from torch import nn

import pyinfinity
from pyinfinity.cli.plan import measure_engine_overhead
from pyinfinity.plan import Budgets, placement_of, resolve_auto
from pyinfinity.probes import measure_rates
from pyinfinity.plan.budgets import swap_dirs
from pyinfinity.swap import fault_injection

D, LAYERS, TOKENS = 512, 8, 64
STALL_MS = 20  # per I/O piece of up to 1 MiB: about 50 MB/s per swap engine
BLOCK = 1 << 20
STEPS, WARMUP = 4, 1
MARGIN = 1.10  # the planner may be at most 10% slower than a hand configuration (noise)


class MLP(nn.Module):
    """LAYERS linear layers of D x D: compute is matmuls, the state is 2.1 M parameters."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.Sequential(*[nn.Sequential(nn.Linear(D, D), nn.Tanh()) for _ in range(LAYERS)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x).square().mean()


def _base(swap: str) -> dict:
    """Everything explicit; each configuration gets its own swap directory (a swap space is
    locked by the engine that opened it)."""
    return {
        "train_micro_batch_size_per_gpu": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
        "zero_optimization": {
            "stage": 3,
            "offload_param": {"device": "nvme", "nvme_path": swap, "max_in_cpu": 0, "buffer_count": 4,
                              "buffer_size": 1 << 20},
            "offload_optimizer": {"device": "nvme", "nvme_path": swap, "ratio": 1.0, "buffer_count": 3},
            "stage3_prefetch_bucket_size": 2 << 20,
            "stage3_max_live_parameters": 1 << 30,
            "stage3_param_persistence_threshold": 0,
        },
        "aio": {"block_size": BLOCK, "queue_depth": 8, "thread_count": 1},
        "pyinfinity": {"device": "cpu", "device_memory": "24MiB"},
    }


def _hand(swap: str) -> dict[str, dict]:
    """Four configurations a user might write for this budget."""
    def cfg(**z) -> dict:
        c = _base(swap)
        for key, val in z.items():
            if isinstance(val, dict):
                c["zero_optimization"][key] = {**c["zero_optimization"][key], **val}
            else:
                c["zero_optimization"][key] = val
        return c

    no_prefetch = cfg()
    no_prefetch["pyinfinity"]["prefetch"] = False
    return {
        "all-nvme": cfg(),
        "params-cpu+optim-nvme": cfg(offload_param={"device": "cpu"}),
        "params-nvme+optim-half": cfg(offload_optimizer={"ratio": 0.5}),
        "all-nvme,no-prefetch": no_prefetch,
    }


def _measure(configs: dict[str, dict], x: torch.Tensor) -> dict[str, float]:
    """Median seconds per training step (forward, backward, optimizer) of each configuration under
    the disk stall. The engines step in turns (one step of each, then again), so a drift in the
    machine's load hits all of them alike."""
    times: dict[str, list[float]] = {name: [] for name in configs}
    engines = {}
    try:
        for name, cfg in configs.items():
            torch.manual_seed(0)
            engines[name] = pyinfinity.initialize(MLP(), cfg)
        with fault_injection(op="any", nth=1, action="stall", value=STALL_MS, count=0):
            for i in range(WARMUP + STEPS):
                for name, eng in engines.items():
                    t0 = time.perf_counter()
                    eng.backward(eng(x))
                    eng.step()
                    eng.synchronize()  # the step's background work counts (the engines take turns)
                    if i >= WARMUP:
                        times[name].append(time.perf_counter() - t0)
    finally:
        for eng in engines.values():
            eng.close()
    return {name: statistics.median(t) for name, t in times.items()}


def test_planner_beats_hand_configs_and_predicts_step_time(tmp_path):
    swap = str(tmp_path / "swap")
    torch.manual_seed(1)
    x = torch.randn(TOKENS, D)
    model = MLP()
    numel = sum(p.numel() for p in model.parameters())
    # host RAM: the fp32 gradients (4 B/param), 7 of the 16 B/param of parameters and optimizer
    # state, and 16 MiB for the device pool's activations and working set (it is RAM on the CPU)
    device_pool = 24 << 20
    host = 4 * numel + 7 * numel + (16 << 20)
    with fault_injection(op="any", nth=1, action="stall", value=STALL_MS, count=0):
        rates = measure_rates("cpu", swap, aio=_base(swap)["aio"], matmul_shape=(TOKENS, D, D))
    rates.shard_overhead, rates.shard_step_overhead = measure_engine_overhead("cpu")  # as `pyinfinity plan` does
    budgets = Budgets(device_memory=device_pool, host_memory=host, swap=swap_dirs([swap]), device_is_host=True)
    auto = _base(swap)
    z = auto["zero_optimization"]
    for sec in ("offload_param", "offload_optimizer"):
        z[sec] = {"device": "auto", "nvme_path": swap}
    for key in ("stage3_prefetch_bucket_size", "stage3_max_live_parameters", "stage3_param_persistence_threshold"):
        z[key] = "auto"
    planned, placement = resolve_auto(auto, model, budgets, rates, seq_len=TOKENS, fill_absent=True)
    assert placement.feasible and placement.host_bytes <= host
    assert placement.optimizer.disk > 0, placement.table()  # the state does not fit: some of it is on disk

    hand = _hand(swap)
    for name, cfg in hand.items():
        for sec in ("offload_param", "offload_optimizer"):
            cfg["zero_optimization"][sec]["nvme_path"] = f"{swap}-{name}"
    predicted = {}
    for name, cfg in hand.items():  # the grid is fair: every hand configuration fits the same budgets
        p = placement_of(cfg, model, budgets, rates, seq_len=TOKENS)
        assert p.feasible, (name, p.violations)
        predicted[name] = p.predicted.total
    measured = _measure({"planner": planned, **hand}, x)
    pred = placement.predicted.total
    report = (f"\nrates: {rates.describe()}\nplan:\n{placement.table()}\n"
              + "\n".join(f"  {n:<24} measured {t:.3f} s/step" + (f", predicted {predicted[n]:.3f}" if n in predicted
                                                                  else f", predicted {pred:.3f}")
                          for n, t in measured.items()))
    print(report)
    for name in hand:
        assert measured["planner"] <= measured[name] * MARGIN, f"planner slower than {name}: {report}"
    assert abs(pred - measured["planner"]) <= 0.25 * measured["planner"], f"prediction off by >25%: {report}"
