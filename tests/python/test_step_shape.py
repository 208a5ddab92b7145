"""The step's shape from the tokens a step (``plan.step_shape``, ``--tokens-per-step``): the
planner's micro-batch x accumulation x checkpointing at 7B-8B on a whole GPU and under a cap, the
user's own choices kept or refused in one line, and the path end to end through `train`, `plan`
and `bench train` on the CPU, bit for bit the plain loop at the same shape."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from pyinfinity.layout.charges import TrainShape
from pyinfinity.plan.budgets import Budgets
from pyinfinity.plan.evaluation import DEVICE_ADD_RATE, ELEMENTWISE_SHARE
from pyinfinity.plan.rates import Rates
from pyinfinity.plan.sizes import sizes_from_config
from pyinfinity.plan.step_shape import choose_step_shape, micro_batch_candidates, step_shape_refusal
from pyinfinity.presets import preset

GIB = 1 << 30
# an H100-like machine: PCIe 5 copies, 16 cores of CPU Adam, a 700 TFLOP/s bf16 matmul
H100 = dict(h2d=50e9, d2h=50e9, disk_read=6e9, disk_write=4e9, adam=3e9, matmul=700e12, memcpy=25e9, device="cuda:0")


def _sizes(name: str):
    return sizes_from_config({"model_type": "llama", **preset(name)}, "bf16")


def _budgets(device_memory: int) -> Budgets:
    return Budgets(device_memory=device_memory, host_memory=1000 * 10**9, swap=[], device_is_host=False)


def _cli(*args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pyinfinity", *args], capture_output=True, text=True,
                          timeout=timeout)


TRAIN = ["train", "--model-size", "tiny", "--steps", "1", "--seq", "32", "--batch", "2", "--device", "cpu",
         "--corpus-bytes", "64KB"]


def assert_one_line_user_error(p: subprocess.CompletedProcess, *needles: str) -> None:
    """Exit status 2, no traceback, and the last stderr line is the error naming each of ``needles``."""
    assert p.returncode == 2 and "Traceback" not in p.stderr, (p.returncode, p.stderr[-3000:])
    last = p.stderr.strip().splitlines()[-1]
    assert last.startswith("pyinfinity ") and ": error: " in last, p.stderr[-3000:]
    for n in needles:
        assert n in last, last


def test_tokens_and_a_micro_batch_and_accumulation_that_disagree_are_refused_in_one_line():
    why = step_shape_refusal(65536, 1024, 4, 4)
    assert why is not None and "\n" not in why and "--tokens-per-step 65536" in why and "16384" in why
    assert step_shape_refusal(65536, 1024, 8, 8) is None
    assert step_shape_refusal(65536, 1024, 8, None) is None and step_shape_refusal(65536, 1024, None, 3) is None
    assert "fewer than one sequence" in step_shape_refusal(512, 1024)
    assert "less than one micro-batch" in step_shape_refusal(2048, 1024, 4, None)
    assert micro_batch_candidates(64) == [64, 32, 16, 8, 4, 2, 1]
    assert micro_batch_candidates(6) == [6, 4, 3, 2, 1]


@pytest.mark.parametrize("name,budget", [("7b", 72 * 10**9), ("8b", 72 * 10**9), ("7b", 125 * 10**9)])
def test_a_whole_gpu_keeps_every_unit_resident_and_the_step_is_the_micro_batches_plus_the_optimizer_tail(name, budget):
    """At 7B-8B on an 80 GB or 139 GB device the bf16 weights (14-16 GB) stay on the device beside
    the chosen micro-batch's activations: nothing is fetched in a micro-batch, so the predicted step
    is the micro-batches' compute plus what of the optimizer no backward hides."""
    sizes = _sizes(name)
    train = TrainShape(seq_len=1024, overlap_step="auto")
    shape = choose_step_shape(sizes, train, _budgets(budget), Rates(**H100), 65536)
    p = shape.placement
    assert shape.tokens == 65536 and shape.micro_batch * shape.grad_accum == 64
    assert p.feasible and p.device_bytes <= budget
    assert p.knobs.resident_bytes >= sizes.param_bytes - sizes.small_shard_bytes(), "every unit resident"
    assert p.charges.working_set == 0 and p.charges.prefetch == 0
    flops = sizes.flops_per_step(shape.micro_batch, 1024, shape.checkpointing) / H100["matmul"]
    t = p.predicted
    adds = p.accumulator_bytes / 4 * (2 + 8) / DEVICE_ADD_RATE if shape.grad_accum > 1 else 0.0
    assert t.compute == pytest.approx(shape.grad_accum * (flops * (1 + ELEMENTWISE_SHARE) + adds))
    assert t.total == pytest.approx(shape.grad_accum * t.micro_batch + t.optimizer_phase, rel=1e-6)
    assert t.micro_batch == pytest.approx(t.compute / shape.grad_accum, rel=0.05)  # no fetch in a micro-batch
    assert t.bottleneck == "compute"


def test_the_chosen_micro_batch_is_the_fastest_predicted_and_its_activations_fit_beside_the_placement():
    sizes = _sizes("7b")
    budgets = _budgets(72 * 10**9)
    train = TrainShape(seq_len=1024, overlap_step="auto")
    rates = Rates(**H100)
    shape = choose_step_shape(sizes, train, budgets, rates, 65536, checkpointing=True)
    assert shape.checkpointing
    c = shape.placement.charges
    est = sizes.activation_bytes(shape.micro_batch, 1024, True)
    assert est - sizes.loss_over_layer(shape.micro_batch, 1024, True) <= c.activations <= est
    assert c.total == shape.placement.device_bytes <= budgets.device_memory
    per_token = shape.placement.predicted.total / shape.tokens
    for mb in (1, 2, 4, 8, 16, 32, 64):
        try:
            other = choose_step_shape(sizes, train, budgets, rates, 65536, micro_batch=mb, checkpointing=True)
        except ValueError:
            assert mb > shape.micro_batch  # only larger ones may not fit
            continue
        assert per_token <= other.placement.predicted.total / other.tokens * 1.0201, mb


def test_a_tight_cap_streams_the_weights_and_still_finds_a_shape():
    sizes = _sizes("7b")
    shape = choose_step_shape(sizes, TrainShape(seq_len=1024, overlap_step="auto"), _budgets(8 * GIB),
                              Rates(**H100), 65536)
    assert shape.tokens == 65536 and shape.placement.knobs.resident_bytes < sizes.param_bytes
    assert shape.placement.device_bytes <= 8 * GIB


def test_tokens_that_do_not_divide_are_rounded_up_and_said_and_a_fixed_micro_batch_is_kept():
    sizes = _sizes("7b")
    train = TrainShape(seq_len=1024, overlap_step="auto")
    shape = choose_step_shape(sizes, train, _budgets(72 * 10**9), Rates(**H100), 65536 + 100, micro_batch=4)
    assert (shape.micro_batch, shape.grad_accum) == (4, 17) and shape.tokens == 4 * 17 * 1024
    assert "65,636 asked" in shape.describe()
    fixed_acc = choose_step_shape(sizes, train, _budgets(72 * 10**9), Rates(**H100), 65536, grad_accum=16)
    assert (fixed_acc.micro_batch, fixed_acc.grad_accum) == (4, 16)
    with pytest.raises(ValueError, match="no micro-batch"):
        choose_step_shape(sizes, train, _budgets(1 * GIB), Rates(**H100), 65536, micro_batch=64)


def _losses_and_weights(tmp_path, name: str, *flags: str) -> tuple[list[str], dict, dict]:
    out, export = tmp_path / f"{name}.json", tmp_path / f"{name}-export"
    p = _cli("train", "--model-size", "tiny", "--steps", "3", "--seq", "32", "--device", "cpu", "--dtype", "fp32",
             "--corpus-bytes", "64KB", "--offload", "cpu", "--lr", "1e-3", "--warmup", "1", "--no-progress",
             "--json", str(out), "--export", str(export), *flags)
    assert p.returncode == 0, p.stderr[-3000:]
    from safetensors.torch import load_file

    weights: dict = {}
    for f in sorted(os.listdir(export)):
        if f.endswith(".safetensors"):
            weights.update(load_file(str(export / f)))
    run = json.loads(out.read_text())
    return [repr(s["loss"]) for s in run["steps"]], weights, run["config"]


def test_train_tokens_per_step_is_bit_for_bit_the_plain_loop_at_the_shape_it_chose(tmp_path):
    """`train --tokens-per-step` (the planner's accumulation for a given micro-batch; then the
    planner's micro-batch too) trains the same fp32 losses and weights as --batch x --grad-accum
    given by hand."""
    for name, flags in (("acc", ("--tokens-per-step", "256", "--batch", "2")), ("all", ("--tokens-per-step", "256"))):
        losses, weights, cfg = _losses_and_weights(tmp_path, name, *flags)
        mb, acc = cfg["train_micro_batch_size_per_gpu"], cfg["gradient_accumulation_steps"]
        assert mb * acc * 32 == 256 and (name != "acc" or (mb, acc) == (2, 4))
        plain_losses, plain_weights, _ = _losses_and_weights(tmp_path, f"{name}-plain", "--batch", str(mb),
                                                             "--grad-accum", str(acc))
        assert losses == plain_losses
        assert weights.keys() == plain_weights.keys() and weights
        for k in weights:
            assert torch.equal(weights[k], plain_weights[k]), k


def test_train_and_plan_refuse_a_disagreeing_shape_and_every_no_cap_spelling_but_none_in_one_line():
    p = _cli(*TRAIN, "--tokens-per-step", "1000", "--grad-accum", "3")
    assert_one_line_user_error(p, "--tokens-per-step 1000", "--batch 2", "--grad-accum 3")
    for bad in ("0", "auto", "unlimited"):
        assert_one_line_user_error(_cli(*TRAIN, "--gpu-memory", bad), "--gpu-memory", "did you mean 'none'")
        assert_one_line_user_error(_cli("plan", "--model-size", "tiny", "--gpu-memory", bad), "--gpu-memory",
                                   "did you mean 'none'")
    p = _cli("plan", "--model-size", "tiny", "--tokens-per-step", "4096", "--micro-batch", "2", "--grad-accum", "4")
    assert_one_line_user_error(p, "--tokens-per-step 4096", "--micro-batch 2", "--grad-accum 4")


def test_train_takes_none_for_the_whole_device(tmp_path):
    out = tmp_path / "a.json"
    p = _cli(*TRAIN, "--gpu-memory", "none", "--json", str(out))
    assert p.returncode == 0, p.stderr[-3000:]
    run = json.loads(out.read_text())
    assert run["config"]["pyinfinity"]["device_memory"] == "none" and run["summary"]["device_budget"] > 0


def test_the_config_key_takes_none_and_refuses_zero_with_the_spelling():
    from pyinfinity.config import ConfigError, load_config

    assert load_config({"pyinfinity": {"device_memory": "none"}}).pyinfinity.device_memory is None
    assert load_config({"pyinfinity": {"device_memory": "8GiB"}}).pyinfinity.device_memory == 8 * GIB
    for bad in (0, "0", "unlimited"):
        with pytest.raises(ConfigError, match="pyinfinity.device_memory.*'none'"):
            load_config({"pyinfinity": {"device_memory": bad}})


@pytest.mark.skipif(torch.cuda.is_available(), reason="plans for a GPU this machine lacks")
def test_plan_chooses_the_shape_of_64k_tokens_at_8b_and_prints_tokens_per_second(tmp_path):
    out, rates = tmp_path / "cfg.json", tmp_path / "rates.json"
    # the target's host side given (this machine's own memory copies and Adam are not an H100 box's)
    Rates(**dict(H100, device="cuda"), shard_overhead=1e-4, shard_step_overhead=2e-5,
          source={k: "given" for k in H100}).save(str(rates))
    p = _cli("plan", "--model-size", "8b", "--gpu-memory", "71GiB", "--tokens-per-step", "65536", "--rates",
             str(rates), "--cpu-memory", "800GiB", "-o", str(out))
    assert p.returncode == 0, p.stderr[-3000:]
    cfg = json.loads(out.read_text())
    mb, acc = cfg["train_micro_batch_size_per_gpu"], cfg["gradient_accumulation_steps"]
    assert mb * acc * 1024 == 65536
    assert f"--tokens-per-step 65536: micro-batch {mb} x 1024 tokens x {acc} accumulation" in p.stderr
    line = next(x for x in p.stdout.splitlines() if x.strip().startswith("expected:"))
    assert "tokens/s (65,536 tokens a step in" in line and "not a CUDA device on this machine" in line
    sizes = _sizes("8b")
    assert cfg["pyinfinity"]["resident_bytes"] >= sizes.param_bytes - sizes.small_shard_bytes()


def test_the_bf16_peaks_and_the_model_flops_utilisation():
    from pyinfinity.plan.hardware import bf16_peak, model_flops_utilisation

    assert bf16_peak("NVIDIA H100 80GB HBM3") == bf16_peak("NVIDIA H200") == 989e12
    assert bf16_peak("NVIDIA A100-SXM4-80GB") == 312e12
    assert bf16_peak("NVIDIA H100 PCIe") is None and bf16_peak("NVIDIA GeForce RTX 4090") is None
    assert model_flops_utilisation(7_000_000_000, 10_000, 989e12) == pytest.approx(6 * 7e9 * 1e4 / 989e12)


def test_bench_train_runs_every_system_at_the_shape_planned_for_the_tokens(monkeypatch, tmp_path):
    from pyinfinity.bench import train as bt

    seen = []

    def run_one(spec, timeout, log_path, on_line=None):
        seen.append((spec["label"], spec["batch"], spec["grad_accum"]))
        steps = [{"seconds": 1.0, "loss": 1.0, "disk_read": 0, "disk_write": 0}] * spec["steps"]
        return {"system": spec["system"], "size": spec["size"], "ok": True, "steps": steps, "params": 1}

    monkeypatch.setattr(bt, "probe_disk", lambda d: {"disk_read": 1e9, "disk_write": 1e9})
    monkeypatch.setattr(bt, "run_one", run_one)
    s = bt.Settings(sizes=["micro"], systems=["pyinfinity-auto", "torch"], nvme_dir=str(tmp_path / "swap"),
                    device="cpu", steps=3, warmup=1, batch=2, seq=32, grad_accum=1, tokens_per_step=256,
                    step_fixed=["batch"], trace=False, progress=False, log_dir=str(tmp_path / "logs"))
    data = bt.run_bench(s, str(tmp_path / "bt.json"))
    assert seen == [("pyinfinity-auto", 2, 4), ("torch", 2, 4)]
    assert {r["tokens_per_step"] for r in data["runs"]} == {256}
    assert data["invocations"][-1]["step_shapes"] == {"micro": {"batch": 2, "grad_accum": 4}}


def test_bench_train_refuses_tokens_that_disagree_and_zero_for_the_cap(tmp_path):
    from pyinfinity.bench.train import BenchTrainError
    from pyinfinity.cli.bench_train import build_parser, settings_from_args

    for argv, needle in ((["--tokens-per-step", "1000", "--batch", "2", "--grad-accum", "2"], "--tokens-per-step 1000"),
                         (["--gpu-memory", "0"], "did you mean 'none'")):
        a = build_parser().parse_args(["--sizes", "micro", "--nvme", str(tmp_path), "--log-dir", str(tmp_path), *argv])
        a.made_dirs = []
        with pytest.raises(BenchTrainError, match=needle):
            settings_from_args(a)
    a = build_parser().parse_args(["--sizes", "micro", "--gpu-memory", "none", "--tokens-per-step", "4096", "--nvme",
                                   str(tmp_path), "--log-dir", str(tmp_path)])
    a.made_dirs = []
    s = settings_from_args(a)
    assert s.cap_bytes is None and s.tokens_per_step == 4096 and s.step_fixed == []


@pytest.mark.gpu
def test_the_activation_estimate_covers_what_a_real_step_allocates_on_the_gpu():
    """A 2-layer slice of Llama-2-7B's shape at 4 x 1024 tokens in bf16, with and without
    checkpointing: the planner's activation estimate is at least the step's peak allocation beyond
    the weights and all their gradients, and at most 1.25x the peak beyond the weights alone."""
    transformers = pytest.importorskip("transformers")
    if not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    from pyinfinity.plan.sizes import sizes_from_module

    fields = dict(preset("7b"), num_hidden_layers=2)
    for ckpt in (False, True):
        cfg = transformers.LlamaConfig(**fields, use_cache=False)
        model = transformers.LlamaForCausalLM(cfg).to(torch.bfloat16).cuda().train()
        if ckpt:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        weights = sum(p.numel() * p.element_size() for p in model.parameters())
        x = torch.randint(0, cfg.vocab_size, (4, 1024), device="cuda")
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        model(input_ids=x, labels=x).loss.backward()
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - weights  # activations, and what gradients exist at the peak
        est = sizes_from_module(model, torch.bfloat16).activation_bytes(4, 1024, ckpt)
        # at least the peak less every gradient; not above what the step held beside its weights by much
        assert peak - weights <= est <= 1.25 * peak, (ckpt, est, peak, weights)
        del model, x
        torch.cuda.empty_cache()


@pytest.mark.gpu
def test_train_tokens_per_step_on_the_whole_gpu_runs_the_shape_it_chose_within_the_budget(tmp_path):
    """On the GPU with no cap: the shape the planner chose for 32k tokens at 1.1B trains (no
    out-of-memory at the micro-batch it filled the device with) and the step's peak stays within
    the engine's budget."""
    if not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    out = tmp_path / "a.json"
    p = _cli("train", "--model-size", "1.1b", "--seq", "1024", "--tokens-per-step", "32768", "--steps", "2",
             "--warmup", "1", "--device", "cuda", "--gpu-memory", "none", "--corpus-bytes", "4MB", "--no-progress",
             "--json", str(out), timeout=1800)
    assert p.returncode == 0, p.stderr[-3000:]
    run = json.loads(out.read_text())
    c, s = run["config"], run["summary"]
    assert c["train_micro_batch_size_per_gpu"] * c["gradient_accumulation_steps"] * 1024 == 32768
    assert "--tokens-per-step 32768: micro-batch" in p.stderr
    assert s["peak_device_allocated"] <= s["device_budget"] * 1.05
