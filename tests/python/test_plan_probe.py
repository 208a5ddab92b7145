"""The planner's CPU Adam probe measures what the engine runs: the engine's kernel on a shard-sized
buffer with the engine's optimizer thread count; and the optimizer term charges the passes the
engine makes for a placement (no cast pass when the kernel writes the bf16 home in RAM itself)."""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch

import pyinfinity
from pyinfinity.plan import Budgets, Rates, SwapDir, TrainShape
from pyinfinity import probes as probes_mod
from pyinfinity.layout.shards import Knobs
from pyinfinity.plan.evaluation import evaluate
from pyinfinity.plan.sizes import llama_sizes

LLAMA_7B = {"model_type": "llama", "vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 11008,
            "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 32,
            "max_position_embeddings": 4096}


@pytest.fixture
def probes(monkeypatch):
    """Records every Adam probe (numel, threads) instead of timing it; an empty rates cache."""
    calls: list[tuple[int, int]] = []

    def fake(numel: int = 8_000_000, reps: int = 5, threads=None) -> float:
        calls.append((numel, threads))
        return 1e9

    monkeypatch.setattr(probes_mod, "measure_adam", fake)
    monkeypatch.setattr(probes_mod, "_CACHE", {})
    return calls


@pytest.mark.parametrize("threads", ["auto", 3])
def test_the_engines_probe_times_adam_on_its_optimizer_threads(tiny_lm, engine_config, probes, threads):
    """The engine's "auto" plan probes the kernel on as many threads as its optimizer then steps
    with (one on the CPU device by default, not every core) and on a buffer large enough that the
    kernel's thread starts and the caches do not set the rate (1M parameters measured half the
    real step's rate on 16 cores)."""
    cfg = engine_config("cpu", zero_optimization={**engine_config("cpu")["zero_optimization"],
                                                  "offload_optimizer": {"device": "auto"}},
                        pyinfinity={"device": "cpu", "device_memory": "64MiB", "optimizer_threads": threads})
    with pyinfinity.initialize(tiny_lm(), cfg) as eng:
        engine_threads = eng.optimizer.threads
        assert eng.plan is not None
        assert f"{engine_threads} thread" in eng.plan.inputs[2].source["adam"]
    assert engine_threads == (1 if threads == "auto" else 3)
    assert [t for _, t in probes] == [engine_threads]
    assert probes[0][0] >= 8_000_000


def test_measure_rates_probes_once_per_thread_count(probes):
    a = probes_mod.measure_rates("cpu", optimizer_threads=2, cache=True)
    b = probes_mod.measure_rates("cpu", optimizer_threads=2, cache=True)
    c = probes_mod.measure_rates("cpu", optimizer_threads=1, cache=True)
    assert a is b and c is not a
    assert [t for _, t in probes] == [2, 1]
    assert c.source["adam"] == "probe, 1 thread"



def test_the_probes_leave_torch_s_rng_where_it_was(monkeypatch):
    """A probe draws random tensors and builds a model: on a fork of the RNG, so a seed set before
    ``initialize`` gives the same weights (``init_empty``'s, initialised after the plan) and dropout
    whether the engine measured rates or not."""
    monkeypatch.setattr(probes_mod, "_CACHE", {})
    monkeypatch.setattr(probes_mod, "measure_adam", lambda *a, **k: torch.randn(4).abs().sum().item() * 1e9)
    torch.manual_seed(7)
    probes_mod.measure_rates("cpu")
    probes_mod.measure_decoder_compute({"model_type": "llama", "vocab_size": 64, "hidden_size": 32,
                                       "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2},
                                      "cpu", 1, 8, dtype=torch.float32, reps=1)
    after = torch.rand(3)
    torch.manual_seed(7)
    assert torch.equal(after, torch.rand(3))

def test_measure_adam_runs_the_kernel_on_the_given_threads():
    assert probes_mod.measure_adam(1 << 18, reps=1, threads=1) > 0
    with pytest.raises(ValueError, match="threads must be at least 1"):
        probes_mod.measure_adam(1 << 18, reps=1, threads=0)


def test_the_fine_tunes_optimizer_term_is_one_kernel_pass():
    """A 7B bf16 model with its parameters and optimizer state in RAM (the fine-tune under an
    8 GiB device): the kernel writes the new weights into the RAM homes itself, so the optimizer
    term is parameters / the Adam rate, with no cast pass or fp32 gradient read on top."""
    sizes = llama_sizes(LLAMA_7B, torch.bfloat16)
    rates = Rates(h2d=50e9, d2h=50e9, disk_read=0.0, disk_write=0.0, adam=4.65e9, matmul=600e12, memcpy=20e9,
                  device="cuda")
    budgets = Budgets(device_memory=8 << 30, host_memory=200 << 30, swap=[SwapDir("/swap", 1 << 40, 1)])
    knobs = Knobs(param_device="cpu", optimizer_device="cpu", ratio=0.0)
    train = TrainShape(micro_batch=1, seq_len=1024, grad_accum=1, checkpointing=True)
    p = evaluate(sizes, train, budgets, rates, knobs)
    n = sizes.trainable_numel
    assert p.predicted.optimizer == pytest.approx(n / rates.adam, rel=1e-9)
    # another dtype of the home (fp32 here) adds the cast pass from the master
    p32 = evaluate(llama_sizes(LLAMA_7B, torch.float32), train, budgets, rates, knobs)
    assert p32.predicted.optimizer > n / rates.adam


@pytest.mark.parametrize("clip", [0.0, 1.0])
def test_a_step_that_waits_for_the_norm_hides_behind_the_next_forward_only(clip):
    """With clipping (``pyinfinity train``'s default) no unit steps before the global norm, known at
    the end of the backward: the overlapped step runs behind the next forward, which waits for
    each unit's new values, so only the forward's share of a micro-batch hides it (the fine-tune's
    "waits for new values" were most of its optimizer time). Without clipping units step as their
    gradients land and the backward's share hides it."""
    from pyinfinity.config import load_config
    from pyinfinity.plan.evaluation import BACKWARD_SHARE
    from pyinfinity.plan.resolve import _train_shape

    cfg = load_config({"gradient_clipping": clip, "pyinfinity": {"device": "cuda"}})
    train = replace(_train_shape(cfg, 1024, True), compute_seconds=0.387)
    assert train.norm_first is (clip > 0) and train.overlap_step == "auto"
    sizes = llama_sizes(LLAMA_7B, torch.bfloat16)
    rates = Rates(h2d=57.8e9, d2h=57.8e9, disk_read=0.0, disk_write=0.0, adam=4.65e9, matmul=600e12, memcpy=60e9,
                  device="cuda")
    budgets = Budgets(device_memory=8 << 30, host_memory=1000 << 30, swap=[SwapDir("/swap", 1 << 42, 1)])
    knobs = Knobs(param_device="cpu", optimizer_device="cpu", ratio=0.0, prefetch_bytes=1 << 30)
    p = evaluate(sizes, train, budgets, rates, knobs).predicted
    share = BACKWARD_SHARE[True]
    hidden = p.micro_batch * ((1 - share) if clip else share)
    assert p.optimizer_phase == pytest.approx(p.optimizer - hidden, rel=1e-9)
    assert p.total == pytest.approx(p.micro_batch + p.optimizer - hidden, rel=1e-9)


@pytest.mark.parametrize("spread", [1.2, 3.0])
def test_a_compute_probe_whose_samples_drift_is_named_uncertain(monkeypatch, caplog, spread):
    """As the disk probe: a matmul probe whose slowest sample took more than COMPUTE_SPREAD_LIMIT
    times the fastest timed a machine under load, and its rate's source says so (and a warning)."""
    monkeypatch.setattr(probes_mod, "_CACHE", {})
    monkeypatch.setattr(probes_mod, "measure_adam", lambda *a, **k: 1e9)
    monkeypatch.setattr(probes_mod, "measure_memcpy", lambda *a, **k: 10e9)
    monkeypatch.setattr(probes_mod, "matmul_probe", lambda *a, **k: (1e11, spread))
    r = probes_mod.measure_rates("cpu", optimizer_threads=1)
    assert r.matmul == 1e11
    if spread > probes_mod.COMPUTE_SPREAD_LIMIT:
        assert r.source["matmul"].startswith(f"probe, uncertain: its samples differ {spread:.1f}x"), r.source
        assert "compute probe on cpu" in caplog.text
    else:
        assert r.source["matmul"] == "probe"
