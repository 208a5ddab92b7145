"""Hugging Face Trainer, TRL's SFTTrainer and Accelerate train on pyinfinity's own engine when the
DeepSpeed config has a "pyinfinity" section and the script imports pyinfinity: a tiny Llama on the
CPU, parameters and optimizer on the NVMe tier. Each run is a fresh interpreter (hf_worker.py)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.python import test_deepspeed_integration as ds

WORKER = Path(__file__).with_name("hf_worker.py")

pytest.importorskip("accelerate")
pytest.importorskip("transformers")


def run_worker(phase: str, out: Path, *args: str, timeout: int = 300, gpu: bool = False) -> dict:
    env = ds._env({"DS_ACCELERATOR": "cuda"} if gpu else None)
    r = subprocess.run([sys.executable, str(WORKER), phase, str(out), *args, *(["--device", "cuda"] if gpu else [])],
                       cwd=str(ds.ROOT), env=env, capture_output=True, text=True, timeout=timeout)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-6000:]
    return json.loads((out / "result.json").read_text())


@pytest.fixture(autouse=True, scope="module")
def _deepspeed_importable() -> None:
    if ds.run_snippet("import deepspeed").returncode != 0:
        pytest.skip("deepspeed is not importable")


def test_a_library_release_outside_the_known_series_is_refused_naming_the_known_ones(monkeypatch) -> None:
    from pyinfinity.config_values import ConfigError
    from pyinfinity.integrations.deepspeed import route_checks

    monkeypatch.setattr(route_checks, "KNOWN_SERIES", {"pytest": ((0, 1),)})
    monkeypatch.delenv(route_checks.UNTESTED_ENV, raising=False)
    with pytest.raises(ConfigError, match=r"pytest \S+ \(known: 0\.1\.x\).*PYINFINITY_HF_UNTESTED=1"):
        route_checks.check_versions()
    monkeypatch.setenv(route_checks.UNTESTED_ENV, "1")
    route_checks.check_versions()  # a warning only


def by_step(res: dict, key: str) -> dict:
    return dict(zip(res["steps"], res[key]))


def test_trainer_trains_on_pyinfinitys_engine_as_its_own_loop_does_and_saves_a_model_from_pretrained_loads(
        tmp_path: Path) -> None:
    # the model loaded after TrainingArguments(deepspeed=...), as Hugging Face documents: transformers'
    # ZeRO-3 from_pretrained builds it on the meta device and the engine streams the checkpoint in
    res = run_worker("trainer", tmp_path / "run", "--own", "1", "--final", "1", "--gather", "1", "--zero-init", "1")
    assert res["engine"] == "PyinfinityDeepSpeedEngine" and res["is_deepspeed_engine"]
    assert res["steps"] == [1, 2, 3, 4, 5, 6]
    # the same batches through pyinfinity's own loop: the same losses and pre-clip gradient norms
    assert res["losses"] == pytest.approx(res["own"]["losses"], rel=1e-5)
    assert res["grad_norms"] == pytest.approx(res["own"]["grad_norms"], rel=1e-5)
    assert max(res["grad_norms"]) > 1.0  # max_grad_norm=1.0 clipped these steps
    lrs = res["lrs"]  # warm-up over two steps, then cosine down
    assert lrs[0] == 0.0 and lrs[2] == pytest.approx(1e-3) and lrs[2] > lrs[3] > lrs[4] > lrs[5] > 0
    # save_steps=2, save_total_limit=2: the last two checkpoints, each with the engine's global_step folder
    cks = res["checkpoints"]
    assert sorted(cks) == ["checkpoint-4", "checkpoint-6"]
    assert "global_step4" in cks["checkpoint-4"] and "global_step6" in cks["checkpoint-6"]
    assert "model.safetensors" in cks["checkpoint-6"]  # stage3_gather_16bit_weights_on_model_save: true
    assert 0 < res["eval_loss"] < 10
    import torch
    from transformers import LlamaForCausalLM

    final = tmp_path / "run" / "final"
    assert (final / "model.safetensors").exists()
    model = LlamaForCausalLM.from_pretrained(str(final))
    base = LlamaForCausalLM.from_pretrained(str(tmp_path / "base"))
    assert any(not torch.equal(a, b) for a, b in zip(model.parameters(), base.parameters()))  # trained weights
    out = model.generate(torch.tensor([[1, 2, 3, 4]]), max_new_tokens=6, do_sample=False)[0].tolist()
    assert out == res["generated"]  # what the trained model generated in the run, from the saved weights


def test_trainer_with_weight_decay_steps_its_decay_and_no_decay_groups_as_its_own_loop_with_those_groups(
        tmp_path: Path) -> None:
    # weight_decay > 0: Trainer's AdamW has two groups (biases and norms without decay), and a unit
    # of the engine holds parameters of both
    res = run_worker("trainer", tmp_path / "run", "--own", "1", "--weight-decay", "0.5")
    assert res["engine"] == "PyinfinityDeepSpeedEngine" and res["steps"] == [1, 2, 3, 4, 5, 6]
    decayed, total = res["decayed"]
    assert 0 < decayed < total  # two groups
    assert res["losses"] == pytest.approx(res["own"]["losses"], rel=1e-5)
    assert res["grad_norms"] == pytest.approx(res["own"]["grad_norms"], rel=1e-5)


def test_trainer_with_a_group_of_another_lr_steps_each_group_with_its_scheduled_lr_as_its_own_loop(
        tmp_path: Path) -> None:
    # a LoRA+ style optimizer: q_proj's weights at 4x the lr, in the same unit as the rest of their layer;
    # Trainer's LambdaLR scales each group's own lr
    res = run_worker("trainer", tmp_path / "run", "--own", "1", "--fast-lr-ratio", "4")
    assert res["engine"] == "PyinfinityDeepSpeedEngine" and res["steps"] == [1, 2, 3, 4, 5, 6]
    lrs = res["group_lrs"]
    assert len(lrs) == 6 and all(len(g) == 2 and g[1] == pytest.approx(4 * g[0]) for g in lrs)
    assert len({g[0] for g in lrs}) > 2  # the schedule moved them
    assert res["losses"] == pytest.approx(res["own"]["losses"], rel=1e-5)
    assert res["grad_norms"] == pytest.approx(res["own"]["grad_norms"], rel=1e-5)


def test_trainer_with_a_group_of_another_lr_resumes_from_its_checkpoint_exactly(tmp_path: Path) -> None:
    whole = run_worker("trainer", tmp_path / "whole", "--fast-lr-ratio", "4")
    resumed = run_worker("trainer", tmp_path / "resumed", "--fast-lr-ratio", "4", "--resume",
                         str(tmp_path / "whole" / "trainer" / "checkpoint-4"))
    assert resumed["group_lrs"] == whole["group_lrs"][4:]  # both groups' lrs, steps 5 and 6
    for key in ("losses", "grad_norms"):
        w, r = by_step(whole, key), by_step(resumed, key)
        assert [r[5], r[6]] == pytest.approx([w[5], w[6]], rel=1e-5), key


def test_trainer_resumed_from_its_checkpoint_continues_exactly_and_saves_each_checkpoint_once(tmp_path: Path) -> None:
    # stage3_gather_16bit_weights_on_model_save false: Trainer calls save_checkpoint twice per checkpoint
    whole = run_worker("trainer", tmp_path / "whole", "--gather", "0")
    assert whole["skipped_saves"] == 3  # the second call of each of the three checkpoints wrote nothing
    assert sorted(whole["checkpoints"]) == ["checkpoint-4", "checkpoint-6"]
    resumed = run_worker("trainer", tmp_path / "resumed", "--gather", "0", "--resume",
                         str(tmp_path / "whole" / "trainer" / "checkpoint-4"))
    for key in ("losses", "grad_norms", "lrs"):
        w, r = by_step(whole, key), by_step(resumed, key)
        assert [r[5], r[6]] == pytest.approx([w[5], w[6]], rel=1e-5), key


def test_sft_trainer_trains_lora_adapters_over_the_offloaded_base_and_saves_what_peft_loads(tmp_path: Path) -> None:
    pytest.importorskip("trl")
    peft = pytest.importorskip("peft")
    # the model given as its directory: SFTTrainer loads it under zero.Init (meta) and PEFT wraps it there
    res = run_worker("sft", tmp_path / "lora", "--lora", "1", "--zero-init", "1")
    assert res["engine"] == "PyinfinityDeepSpeedEngine"
    assert res["trainable"] and all("lora_" in n for n in res["trainable"])  # the base stays frozen
    assert len(res["losses"]) == 4 and res["losses"][-1] < res["losses"][0]
    assert "adapter_model.safetensors" in res["saved"] and "model.safetensors" not in res["saved"]
    import torch
    from transformers import LlamaForCausalLM

    base = LlamaForCausalLM.from_pretrained(str(tmp_path / "base"))
    ids = torch.tensor([[5, 6, 7, 8]])
    before = base(ids).logits
    model = peft.PeftModel.from_pretrained(base, str(tmp_path / "lora" / "saved"))
    lora_b = [p for n, p in model.named_parameters() if "lora_B" in n]
    assert lora_b and all(p.abs().sum() > 0 for p in lora_b)  # trained from their zero start
    assert not torch.allclose(model(ids).logits, before)


def test_sft_trainer_fine_tunes_every_parameter_and_saves_a_model_from_pretrained_loads(tmp_path: Path) -> None:
    pytest.importorskip("trl")
    res = run_worker("sft", tmp_path / "full")
    assert res["engine"] == "PyinfinityDeepSpeedEngine"
    assert len(res["losses"]) == 4 and res["losses"][-1] < res["losses"][0]
    import torch
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(str(tmp_path / "full" / "saved"))
    base = LlamaForCausalLM.from_pretrained(str(tmp_path / "base"))
    assert all(not torch.equal(a, b) for a, b in zip(model.parameters(), base.parameters()))


def test_accelerate_loop_clips_accumulates_and_resumes_from_save_state_exactly(tmp_path: Path) -> None:
    whole = run_worker("accelerate", tmp_path / "whole", "--own", "1")
    assert whole["engine"] == "PyinfinityDeepSpeedEngine"
    assert len(whole["micro_losses"]) == 12 and len(whole["grad_norms"]) == 6
    # accelerator.backward divides by the accumulation steps as pyinfinity's own loop does: the same norms
    assert whole["grad_norms"] == pytest.approx(whole["own_grad_norms"], rel=1e-5)
    assert "pytorch_model" in whole["saved"]
    resumed = run_worker("accelerate", tmp_path / "resumed", "--resume", str(tmp_path / "whole" / "state"))
    assert resumed["micro_losses"] == pytest.approx(whole["micro_losses"][6:], rel=1e-5)
    assert resumed["grad_norms"] == pytest.approx(whole["grad_norms"][3:], rel=1e-5)


def test_what_pyinfinitys_engine_does_not_do_is_refused_naming_the_key_and_never_falls_back(tmp_path: Path) -> None:
    res = run_worker("misuse", tmp_path / "misuse")
    assert res.pop("deepspeed_initialize_ran") == 0  # DeepSpeed's own engine was never built instead
    expected = {"pipeline": "pipeline:", "world_size": "world size: 2 processes", "tensor_parallel":
                "tensor_parallel.autotp_size: 2", "stage": "zero_optimization.stage: 2", "sgd": "optimizer: SGD",
                "param_groups": "optimizer.param_groups[1].amsgrad", "mpu": "mpu:"}
    for case, start in expected.items():
        msg = res[case]
        assert msg.startswith("ConfigError: " + start), (case, msg)
        assert "\n" not in msg and "remove the \"pyinfinity\" section" in msg, (case, msg)


def test_a_row_set_in_gathered_parameters_with_modifier_rank_is_written_into_the_engine_and_trained_from(
        tmp_path: Path) -> None:
    res = run_worker("gathered", tmp_path / "gathered")
    assert res["read_is_the_weights"] and res["read_only_changed_nothing"]
    assert res["modified_row"] == [0.5] * 64 and res["other_rows_kept"]  # the fp32 master holds the new row
    assert res["gathered_row"] == [0.5] * 64  # and so does the compute copy
    trained = res["trained_row"]  # one Adam step of lr 1e-3 from 0.5: each element moved by about lr
    assert all(abs(v - 0.5) < 2e-3 for v in trained) and any(v != 0.5 for v in trained)


def test_a_2gb_checkpoint_in_two_shards_loads_through_zero3_from_pretrained_without_being_materialised(
        tmp_path: Path) -> None:
    ckpt = run_worker("big_write", tmp_path / "ckpt")
    model_bytes = ckpt["params"] * 4
    assert model_bytes >= 2e9 and len(ckpt["files"]) >= 2
    res = run_worker("big_load", tmp_path / "load", "--resume", str(tmp_path / "ckpt"))
    assert res["meta"]  # from_pretrained under the zero.Init stand-in: no parameter materialised
    assert (res["after_build_kib"] - res["before_kib"]) * 1024 < 0.05 * model_bytes
    growth = (res["peak_kib"] - res["before_kib"]) * 1024  # peak resident memory the build and load added
    assert growth <= max(ckpt["files"]) + 0.25 * model_bytes, (growth, ckpt)
    assert res["tiers"]["nvme"] >= model_bytes  # every parameter went to the NVMe tier
    assert res["logits_finite"]


# -- the GPU suite (pytest -m gpu): the same paths with the engine computing on the GPU
@pytest.mark.gpu
def test_on_the_gpu_trainer_trains_on_pyinfinitys_engine_as_its_own_loop_does(tmp_path: Path) -> None:
    res = run_worker("trainer", tmp_path / "run", "--own", "1", "--final", "1", "--zero-init", "1", gpu=True)
    assert res["engine"] == "PyinfinityDeepSpeedEngine" and res["steps"] == [1, 2, 3, 4, 5, 6]
    assert res["losses"] == pytest.approx(res["own"]["losses"], rel=1e-4)
    assert res["grad_norms"] == pytest.approx(res["own"]["grad_norms"], rel=1e-4)
    assert 0 < res["eval_loss"] < 10 and len(res["generated"]) == 10


@pytest.mark.gpu
def test_on_the_gpu_sft_trainer_trains_lora_adapters_over_the_offloaded_base(tmp_path: Path) -> None:
    pytest.importorskip("trl")
    res = run_worker("sft", tmp_path / "lora", "--lora", "1", gpu=True)
    assert res["engine"] == "PyinfinityDeepSpeedEngine" and res["losses"][-1] < res["losses"][0]
    assert "adapter_model.safetensors" in res["saved"]


@pytest.mark.gpu
def test_on_the_gpu_an_accelerate_loop_matches_pyinfinitys_own_loop_and_resumes(tmp_path: Path) -> None:
    whole = run_worker("accelerate", tmp_path / "whole", "--own", "1", gpu=True)
    assert whole["grad_norms"] == pytest.approx(whole["own_grad_norms"], rel=1e-4)
    resumed = run_worker("accelerate", tmp_path / "resumed", "--resume", str(tmp_path / "whole" / "state"), gpu=True)
    assert resumed["micro_losses"] == pytest.approx(whole["micro_losses"][6:], rel=1e-4)


@pytest.mark.gpu
def test_on_the_gpu_trainer_with_weight_decay_steps_its_two_groups_as_its_own_loop(tmp_path: Path) -> None:
    res = run_worker("trainer", tmp_path / "run", "--own", "1", "--weight-decay", "0.5", gpu=True)
    assert res["engine"] == "PyinfinityDeepSpeedEngine" and res["steps"] == [1, 2, 3, 4, 5, 6]
    assert res["losses"] == pytest.approx(res["own"]["losses"], rel=1e-4)
    assert res["grad_norms"] == pytest.approx(res["own"]["grad_norms"], rel=1e-4)


@pytest.mark.gpu
def test_on_the_gpu_a_row_set_in_gathered_parameters_is_written_into_the_engine_and_trained_from(
        tmp_path: Path) -> None:
    res = run_worker("gathered", tmp_path / "gathered", gpu=True)
    assert res["read_is_the_weights"] and res["read_only_changed_nothing"]
    assert res["modified_row"] == [0.5] * 64 and res["other_rows_kept"] and res["gathered_row"] == [0.5] * 64
    assert all(abs(v - 0.5) < 2e-3 for v in res["trained_row"]) and any(v != 0.5 for v in res["trained_row"])


def test_trainer_leaves_the_planned_keys_auto_for_pyinfinitys_engine_and_fills_them_for_deepspeed() -> None:
    import types

    import pyinfinity  # noqa: F401  registers the route's patches
    from transformers.integrations.deepspeed import HfTrainerDeepSpeedConfig

    def config(section: bool) -> dict:
        c = {"zero_optimization": {"stage": 3, "offload_param": {"device": "auto"},
                                   "offload_optimizer": {"device": "cpu"},
                                   "stage3_prefetch_bucket_size": "auto",
                                   "stage3_param_persistence_threshold": "auto"}}
        return {**c, "pyinfinity": {"device": "cpu"}} if section else c

    args = types.SimpleNamespace(get_warmup_steps=lambda n: 0)
    model = types.SimpleNamespace(config=types.SimpleNamespace(hidden_size=64))
    ours = HfTrainerDeepSpeedConfig(config(True))
    ours.trainer_config_finalize(args, model, 10)
    z = ours.config["zero_optimization"]
    assert z["stage3_prefetch_bucket_size"] == "auto" and z["stage3_param_persistence_threshold"] == "auto"
    assert z["offload_param"]["device"] == "auto"
    theirs = HfTrainerDeepSpeedConfig(config(False))
    theirs.trainer_config_finalize(args, model, 10)
    z = theirs.config["zero_optimization"]
    assert z["stage3_prefetch_bucket_size"] == int(0.9 * 64 * 64) and z["stage3_param_persistence_threshold"] == 640


def test_accelerates_plugin_leaves_the_offload_devices_auto_for_pyinfinitys_engine_and_fills_them_for_deepspeed(
) -> None:
    import pyinfinity  # noqa: F401  registers the route's patches
    from accelerate.utils import DeepSpeedPlugin

    def config(section: bool) -> dict:
        c = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
             "zero_optimization": {"stage": 3, "offload_param": {"device": "auto"},
                                   "offload_optimizer": {"device": "auto"}}}
        return {**c, "pyinfinity": {"device": "cpu"}} if section else c

    ours = DeepSpeedPlugin(hf_ds_config=config(True)).deepspeed_config["zero_optimization"]
    assert ours["offload_param"]["device"] == "auto" and ours["offload_optimizer"]["device"] == "auto"
    theirs = DeepSpeedPlugin(hf_ds_config=config(False)).deepspeed_config["zero_optimization"]
    assert theirs["offload_param"]["device"] == "none" and theirs["offload_optimizer"]["device"] == "none"


def test_the_sft_lora_benchmark_script_runs_on_the_cpu_and_reports_a_way_that_does_not_finish_as_an_error(
        tmp_path: Path) -> None:
    pytest.importorskip("trl")
    pytest.importorskip("peft")
    script = ds.ROOT / "examples" / "trainer_bench.py"
    common = [sys.executable, str(script), "--mode", "trl", "--model-size", "micro", "--seq", "64", "--steps", "3",
              "--warmup", "1", "--model-dir", str(tmp_path / "model")]
    r = subprocess.run([*common, "--ways", "pyinfinity", "--out", str(tmp_path / "sft.json")], cwd=str(ds.ROOT),
                       env=ds._env(), capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    res = json.loads((tmp_path / "sft.json").read_text())
    row = res["rows"][0]
    assert res["mode"] == "trl" and res["lora"] == {"r": 16, "targets": "q_proj,v_proj"}
    assert row["engine"] == "PyinfinityDeepSpeedEngine" and row["tokens_per_s"] > 0 and len(row["losses"]) == 3
    assert row["trainable_params"] == 2 * 2 * 16 * (64 + 64)  # r=16 on q_proj and v_proj of the 2 layers (64 wide)
    assert "SFTTrainer + LoRA: Llama micro" in r.stdout
    r = subprocess.run([*common, "--ways", "own", "--merge", "--out", str(tmp_path / "sft.json")], cwd=str(ds.ROOT),
                       env=ds._env(), capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    merged = json.loads((tmp_path / "sft.json").read_text())  # the earlier call's row kept beside this one's
    assert [row["key"] for row in merged["rows"]] == ["pyinfinity", "own"] and "sft_vs_own_loop" in merged["ratios"]
    r = subprocess.run([*common, "--ways", "pyinfinity", "--timeout", "1", "--out", str(tmp_path / "cut.json")],
                       cwd=str(ds.ROOT), env=ds._env(), capture_output=True, text=True, timeout=300)
    assert r.returncode == 1  # the way's row is an error; the script ends
    assert "did not finish in 1 s (killed)" in json.loads((tmp_path / "cut.json").read_text())["rows"][0]["error"]
