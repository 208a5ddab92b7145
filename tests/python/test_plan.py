"""The planner without timing: sizes as the engine partitions, budgets (cgroup, shared
filesystems), placements that move with the budgets and respect every one of them over a grid,
infeasible problems as errors with numbers, the engine realising a fractional plan, rates files."""
from __future__ import annotations

import json
import os

import pytest
import torch

import pyinfinity
from pyinfinity.config import load_config
from pyinfinity.plan import (Budgets, Fixed, PlanError, Rates, SwapDir, TrainShape, placement_of, plan_engine_config,
                             resolve_auto, solve)
from pyinfinity.host_memory import cgroup_memory_left
from pyinfinity.plan.budgets import swap_dirs
from pyinfinity.plan.rates import load_rates_file
from pyinfinity.plan.sizes import llama_sizes, sizes_from_config, sizes_from_module

GB = 10**9
LLAMA_1B = {"model_type": "llama", "vocab_size": 32000, "hidden_size": 2048, "intermediate_size": 5632,
            "num_hidden_layers": 22, "num_attention_heads": 32, "num_key_value_heads": 4,
            "max_position_embeddings": 2048}
TINY_LLAMA = {"model_type": "llama", "vocab_size": 64, "hidden_size": 32, "intermediate_size": 64,
              "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
              "max_position_embeddings": 64}
# an H200-like machine: the planner's choices below do not depend on this machine's speed
GPU_RATES = Rates(h2d=50e9, d2h=50e9, disk_read=1.5e9, disk_write=1.2e9, adam=3.4e9, matmul=600e12,
                  memcpy=20e9, disk_latency=1e-4, device="cuda")


def _budgets(dm: float, hm: float, free: float = 4e12, path: str = "/mnt/nvme0") -> Budgets:
    return Budgets(device_memory=int(dm), host_memory=int(hm), swap=[SwapDir(path, int(free), 1)])


# ----------------------------------------------------------------------------------- sizes


def test_sizes_match_the_engines_partition(tiny_lm, engine_config):
    """Shards as the engine cuts them (tied head counted once), also for an init_empty model."""
    model = tiny_lm(layers=3, tie=True)
    sizes = sizes_from_module(model)
    with pyinfinity.init_empty():
        empty = tiny_lm(layers=3, tie=True)
    assert sizes_from_module(empty).shard_numels == sizes.shard_numels
    with pyinfinity.initialize(model, engine_config("cpu")) as eng:
        assert sizes.shard_numels == [sh.numel for sh in eng.partition.shards]
    assert sizes.numel == sum(p.numel() for p in tiny_lm(layers=3, tie=True).parameters())
    assert sizes.itemsize == 4 and sizes_from_module(tiny_lm(), "bf16").itemsize == 2


def test_sizes_from_a_transformers_config_match_the_real_model(tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM

    path = tmp_path / "config.json"
    path.write_text(json.dumps(TINY_LLAMA))
    meta = sizes_from_config(str(path), "fp32")
    real = sizes_from_module(LlamaForCausalLM(LlamaConfig(**{k: v for k, v in TINY_LLAMA.items()
                                                              if k != "model_type"})))
    assert meta.shard_numels == real.shard_numels
    assert llama_sizes(TINY_LLAMA, "fp32").numel == real.numel  # the analytic fallback agrees
    big = sizes_from_config(LLAMA_1B, "bf16")
    assert big.numel == llama_sizes(LLAMA_1B).numel and 1.09e9 < big.numel < 1.11e9
    assert big.param_bytes == 2 * big.numel and big.hidden == 2048 and big.layers == 22
    with pytest.raises(ValueError, match="cannot read"):
        sizes_from_config(str(tmp_path / "missing.json"))


# ----------------------------------------------------------------------------------- budgets


def test_cgroup_limits_and_shared_filesystems(tmp_path):
    root = tmp_path / "cg"
    root.mkdir()
    assert cgroup_memory_left(str(root)) is None  # no limit files
    (root / "memory.max").write_text("max\n")
    assert cgroup_memory_left(str(root)) is None  # v2 unlimited
    (root / "memory.max").write_text(str(8 << 30))
    (root / "memory.current").write_text(str(3 << 30))
    assert cgroup_memory_left(str(root)) == 5 << 30
    v1 = tmp_path / "v1"
    (v1 / "memory").mkdir(parents=True)
    (v1 / "memory" / "memory.limit_in_bytes").write_text(str(4 << 30))
    (v1 / "memory" / "memory.usage_in_bytes").write_text(str(1 << 30))
    assert cgroup_memory_left(str(v1)) == 3 << 30
    a, b = swap_dirs([str(tmp_path / "a"), str(tmp_path / "b")])  # two directories, one filesystem
    st = os.statvfs(tmp_path)
    assert abs(a.free - st.f_bavail * st.f_frsize) < 64 << 20 and a.fs_id == b.fs_id
    assert Budgets(1, 1, [a, b]).swap_free in (a.free, b.free)  # counted once, not a.free + b.free


# ----------------------------------------------------------------------------------- placement


def test_more_ram_means_less_on_disk_and_a_smaller_device_less_resident():
    sizes = llama_sizes(LLAMA_1B, "bf16")  # 2.2 GB bf16 weights, 13.2 GB optimizer state
    train = TrainShape(micro_batch=4, seq_len=1024, checkpointing=True)
    on_disk, times = [], []
    for host in (10, 12, 14, 18, 22, 30, 60):
        p = solve(sizes, train, _budgets(8 * 2**30, host * GB), GPU_RATES)
        on_disk.append(p.params.disk + p.optimizer.disk)
        times.append(p.predicted.total)
    assert on_disk == sorted(on_disk, reverse=True) and on_disk[0] > 0 and on_disk[-1] == 0, on_disk
    assert times == sorted(times, reverse=True), times
    resident, prefetch = [], []
    for dm in (64, 16, 8, 6, 5, 4.5, 4):
        p = solve(sizes, train, _budgets(dm * 2**30, 100 * GB), GPU_RATES)
        resident.append(p.knobs.resident_bytes)
        prefetch.append(p.knobs.prefetch_bytes)
        assert p.device_bytes <= dm * 2**30
    small = sizes.small_shard_bytes()  # the final norm: persistent, not counted as resident
    assert resident[0] == sizes.param_bytes - small and resident[-1] < resident[0], resident  # all, then fewer
    assert resident == sorted(resident, reverse=True), resident
    assert prefetch[0] == 0 and all(pf > 0 for r, pf in zip(resident, prefetch) if r < resident[0]), prefetch


def test_an_overlapped_optimizer_step_hides_behind_backward_as_far_as_backward_lasts():
    """1.1B on a GPU, optimizer in RAM or partly on disk: the boundary backward (3/4 of a
    micro-batch with checkpointing) hides as much of the step as it lasts, never the largest
    shard's share."""
    sizes = llama_sizes(LLAMA_1B, "bf16")
    base = dict(micro_batch=4, seq_len=1024, checkpointing=True, compute_seconds=0.6)
    got = {}
    for host in (60, 14):
        for ov in ("off", "auto", "on"):
            p = solve(sizes, TrainShape(**base, overlap_step=ov), _budgets(8 * 2**30, host * GB), GPU_RATES)
            got[host, ov] = p
    for host in (60, 14):
        off, auto = got[host, "off"].predicted, got[host, "auto"].predicted
        assert auto.micro_batch == off.micro_batch and auto.total < off.total
        assert got[host, "on"].predicted.total == auto.total  # a GPU: auto means on
        tail = off.optimizer_phase * sizes.largest_shard_numel / sizes.numel
        assert tail <= auto.optimizer_phase < off.optimizer_phase
    assert got[60, "auto"].optimizer.disk == 0 and got[14, "auto"].optimizer.disk > 0


def test_on_the_cpu_device_auto_overlaps_only_with_state_on_disk_and_only_its_disk_part():
    sizes = llama_sizes(dict(TINY_LLAMA, num_hidden_layers=16), "fp32")  # a unit small beside the state
    cpu = Rates(h2d=20e9, d2h=20e9, disk_read=0.05e9, disk_write=0.05e9, adam=1e7, matmul=5e10, memcpy=20e9,
                device="cpu")
    ram = Budgets(device_memory=1 << 40, host_memory=10 * GB, device_is_host=True)
    for ov in ("off", "auto"):
        p = solve(sizes, TrainShape(micro_batch=2, seq_len=64, compute_seconds=0.5, overlap_step=ov), ram, cpu)
        assert p.optimizer.disk == 0
        if ov == "off":
            ref = p.predicted.total
    assert p.predicted.total == ref  # state in RAM on the CPU device: auto stays off
    small = Budgets(device_memory=1 << 40, host_memory=2_500_000, device_is_host=True,
                    swap=[SwapDir("/mnt/nvme0", 4 * 10**12, 1)])
    p = {ov: solve(sizes, TrainShape(micro_batch=2, seq_len=64, compute_seconds=0.5, overlap_step=ov,
                                     activation_bytes=0), small, cpu)
         for ov in ("off", "auto")}
    assert p["auto"].optimizer.disk > 0 and p["auto"].predicted.total < p["off"].predicted.total
    # Adam and the gradient norm stay visible: only the disk part hides behind backward
    adam = sizes.trainable_numel / cpu.adam
    assert p["auto"].predicted.optimizer_phase > adam
@pytest.mark.parametrize("free_gb", [5, 20, 4000])
def test_every_plan_respects_every_budget(free_gb):
    """Property over a grid of budgets: a plan is returned only if it fits all of them; otherwise
    the error names what is short."""
    sizes = llama_sizes(LLAMA_1B, "bf16")
    train = TrainShape(micro_batch=2, seq_len=1024, checkpointing=True)
    solved = failed = 0
    for dm in (0.25, 1, 2, 4, 8, 24):
        for host in (3, 6, 9, 12, 16, 24, 48):
            b = _budgets(dm * 2**30, host * GB, free_gb * GB)
            try:
                p = solve(sizes, train, b, GPU_RATES)
            except PlanError as exc:
                failed += 1
                assert "needs" in str(exc) and ("budget" in str(exc) or "free at" in str(exc)), str(exc)
                continue
            solved += 1
            assert p.feasible and p.device_bytes <= b.device_memory and p.host_bytes <= b.host_memory
            assert sum(p.swap_per_dir.values()) <= b.swap_free
            assert p.params.total == sizes.param_bytes and p.optimizer.total == 12 * sizes.trainable_numel
            assert p.predicted.total > 0 and p.predicted.bottleneck in ("compute", "host<->device", "disk", "optimizer")
    assert solved and failed  # the grid crosses the feasibility boundary


def test_infeasible_plans_name_the_numbers_and_the_path():
    sizes = llama_sizes(LLAMA_1B, "bf16")
    train = TrainShape(micro_batch=4, seq_len=1024, checkpointing=True)
    with pytest.raises(PlanError) as exc:  # about 10 GB of state beyond RAM, 2 GB of disk
        solve(sizes, train, _budgets(8 * 2**30, 10 * GB, 2 * GB, "/mnt/nvme0"), GPU_RATES)
    msg = str(exc.value)
    assert "of swap" in msg and "free at /mnt/nvme0" in msg and "add " in msg and "second path" in msg, msg
    assert "2 GB free" in msg
    with pytest.raises(PlanError, match=r"device memory: needs .* budget 268 MB.*raise the device budget"):
        solve(sizes, train, _budgets(256 * 2**20, 100 * GB), GPU_RATES)
    with pytest.raises(PlanError, match="give a swap directory"):
        solve(sizes, train, Budgets(device_memory=8 << 30, host_memory=10 * GB), GPU_RATES)
    with pytest.raises(PlanError, match=r"host RAM: needs .*budget 2 GB"):
        solve(sizes, train, _budgets(8 * 2**30, 2 * GB), GPU_RATES)


def test_the_engines_plan_is_compared_at_the_sequence_length_the_run_fed(tiny_lm, tmp_path):
    """The engine plans before it sees a batch (at DEFAULT_SEQ_LEN); at the end of the run the
    prediction is redone at the tokens the run really fed, and says so."""
    from pyinfinity.config import load_config
    from pyinfinity.plan.resolve import DEFAULT_SEQ_LEN

    swap = str(tmp_path / "swap")
    model = tiny_lm(vocab=64, d=64, layers=4, tie=False)
    cfg = load_config({"train_micro_batch_size_per_gpu": 2,
                       "zero_optimization": {"stage": 3, "offload_param": {"device": "auto", "nvme_path": swap},
                                             "offload_optimizer": {"device": "auto", "nvme_path": swap}},
                       "pyinfinity": {"device": "cpu", "device_memory": 4 << 20}})
    rates = Rates(h2d=4e9, d2h=4e9, disk_read=1e9, disk_write=1e9, adam=3e8, matmul=5e9, memcpy=4e9)
    budgets = Budgets(device_memory=4 << 20, host_memory=1 << 30, swap=swap_dirs([swap]), device_is_host=True)
    _, _, plan = plan_engine_config(cfg, model, "cpu", rates=rates, budgets=budgets)
    short = plan.at_seq_len(64).predicted.total
    assert short < plan.predicted.total  # fewer tokens, less compute
    msg = plan.compare([1.0, 1.0, short], tokens_per_micro_batch=2 * 64)
    assert f"predicted {short:.3f} s/step at the run's 64 tokens per sequence (planned at {DEFAULT_SEQ_LEN}: " \
           f"{plan.predicted.total:.3f} s/step)" in msg and msg.endswith("predicted/measured 1.00")
    same = plan.compare([1.0, 1.0, plan.predicted.total], tokens_per_micro_batch=2 * DEFAULT_SEQ_LEN)
    assert "tokens per sequence" not in same and same.endswith("predicted/measured 1.00")


@pytest.mark.parametrize("device_memory, ram_per_param, params_split", [(4 << 20, 6, False), (400 << 10, 2, False)])
def test_resolved_config_loads_and_the_engine_realises_a_fractional_plan(device_memory, ram_per_param, params_split,
                                                                         tiny_lm, lm_batches, tmp_path):
    """A host budget that holds part of the optimizer state (and, with a small device, part of the
    parameters): the resolved config loads, every "auto" is gone, and the engine puts exactly the
    planned bytes in RAM and on disk."""
    swap = str(tmp_path / "swap")
    model = tiny_lm(vocab=64, d=64, layers=6, tie=False)
    n = sum(p.numel() for p in model.parameters())
    cfg = {"train_micro_batch_size_per_gpu": 2,
           "zero_optimization": {"stage": 3, "offload_param": {"device": "auto", "nvme_path": swap},
                                 "offload_optimizer": {"device": "auto", "nvme_path": swap},
                                 "stage3_prefetch_bucket_size": "auto", "stage3_max_live_parameters": "auto",
                                 "stage3_param_persistence_threshold": "auto"},
           "pyinfinity": {"device": "cpu", "device_memory": device_memory}}
    rates = Rates(h2d=4e9, d2h=4e9, disk_read=1e9, disk_write=1e9, adam=3e8, matmul=5e10, memcpy=4e9)
    budgets = Budgets(device_memory=device_memory, host_memory=4 * n + ram_per_param * n + (1 << 20),
                      swap=swap_dirs([swap]), device_is_host=True)
    resolved, plan = resolve_auto(cfg, model, budgets, rates, seq_len=8)
    assert '"auto"' not in json.dumps(resolved)
    c = load_config(resolved)
    assert plan.optimizer.ram > 0 and plan.optimizer.disk > 0, plan.table()  # fractional
    assert (plan.params.ram > 0 and plan.params.disk > 0) == params_split, plan.table()
    assert "predicted/measured" in plan.compare([9.0, 9.0, plan.predicted.total, plan.predicted.total * 3,
                                                 plan.predicted.total]) and " 1.00" in plan.compare(
        [9.0, 9.0, plan.predicted.total])
    assert c.zero_optimization.offload_optimizer.device == "nvme" and 0 < c.zero_optimization.offload_optimizer.ratio < 1
    again = placement_of(resolved, model, budgets, rates, seq_len=8)  # the resolved config is the plan
    assert (again.params, again.optimizer) == (plan.params, plan.optimizer)
    with pyinfinity.initialize(model, resolved) as eng:
        for x, y in lm_batches(2, vocab=64):
            eng.backward(eng(x, y))
            eng.step()
        rep = eng.memory_report()
    assert rep.optimizer.get("cpu", 0) == plan.optimizer.ram and rep.optimizer.get("nvme", 0) == plan.optimizer.disk
    assert rep.params.get("nvme", 0) == plan.params.disk
    assert rep.params.get("cpu", 0) + rep.params.get("gpu", 0) == plan.params.ram + plan.params.device


def test_explicit_values_are_kept_and_the_engine_hook(tmp_path, tiny_lm):
    swap = str(tmp_path / "swap")
    cfg = {"zero_optimization": {"stage": 3, "offload_param": {"device": "nvme", "nvme_path": swap},
                                 "offload_optimizer": {"device": "auto", "nvme_path": swap},
                                 "stage3_prefetch_bucket_size": 12345},
           "pyinfinity": {"device": "cpu", "device_memory": "8MiB"}}
    rates = Rates(h2d=4e9, d2h=4e9, disk_read=1e9, disk_write=1e9, adam=3e8, matmul=5e10, memcpy=4e9)
    b = Budgets(device_memory=8 << 20, host_memory=1 << 30, swap=swap_dirs([swap]), device_is_host=True)
    out, plan = resolve_auto(cfg, tiny_lm(), b, rates, seq_len=8)
    z = out["zero_optimization"]
    assert z["offload_param"]["device"] == "nvme" and z["stage3_prefetch_bucket_size"] == 12345
    assert z["offload_optimizer"]["device"] == "cpu"  # 1 GB of RAM holds it: RAM first
    assert plan.knobs.param_device == "nvme" and plan.knobs.prefetch_bytes == 12345
    # the engine's entry point: a parsed Config in, a Config with no "auto" out
    parsed = load_config(cfg)
    c, decisions, p = plan_engine_config(parsed, tiny_lm(), "cpu", rates=rates, budgets=b)
    keys = {d.key for d in decisions}
    assert p is not None and {"zero_optimization.offload_optimizer.device",
                              "zero_optimization.offload_optimizer.ratio"} <= keys
    assert "zero_optimization.offload_param.max_in_cpu" not in keys  # its device is explicit: default kept
    assert '"auto"' not in json.dumps(c.to_dict()["zero_optimization"])
    plain = load_config({"pyinfinity": {"device": "cpu"}})  # nothing to place: no rates needed
    c2, d2, p2 = plan_engine_config(plain, tiny_lm(), "cpu", budgets=b)
    assert p2 is None and isinstance(c2.pyinfinity.device_memory, int)


# ----------------------------------------------------------------------------------- rates and CLI


def test_rates_files(tmp_path):
    GPU_RATES.save(str(tmp_path / "rates.json"))
    got, aio = load_rates_file(str(tmp_path / "rates.json"))
    assert got["disk_read"] == 1.5e9 and got["disk_latency"] == 1e-4 and not aio
    bench = {"schema": "pyinfinity.bench.io/1", "results": [
        {"tool": "pyinfinity", "workload": "file", "op": "read", "gbps_median": 2.5},
        {"tool": "pyinfinity", "workload": "file", "op": "read", "gbps_median": 3.0},
        {"tool": "fio", "workload": "file", "op": "read", "gbps_median": 9.0},
        {"tool": "pyinfinity", "workload": "file", "op": "write", "gbps_median": 1.0, "verified": False},
        {"tool": "pyinfinity", "workload": "file", "op": "write", "gbps_median": 1.5}]}
    (tmp_path / "bench.json").write_text(json.dumps(bench))
    got, _ = load_rates_file(str(tmp_path / "bench.json"))
    assert got == {"disk_read": 3.0e9, "disk_write": 1.5e9}
    (tmp_path / "tune.json").write_text(json.dumps({"aio": {"block_size": 262144, "queue_depth": 8}}))
    got, aio = load_rates_file(str(tmp_path / "tune.json"))
    assert got == {} and aio["block_size"] == 262144
    (tmp_path / "tune2.json").write_text(json.dumps({"aio": {"block_size": 1 << 20}, "rates": {"disk_read": 2e9}}))
    assert load_rates_file(str(tmp_path / "tune2.json"))[0] == {"disk_read": 2e9}
    (tmp_path / "junk.json").write_text("{}")
    with pytest.raises(ValueError, match="no rates"):
        load_rates_file(str(tmp_path / "junk.json"))


def test_cli_writes_a_config_the_loader_accepts(tmp_path, capsys):
    from pyinfinity.cli import main

    (tmp_path / "model.json").write_text(json.dumps(LLAMA_1B))
    GPU_RATES.save(str(tmp_path / "rates.json"))
    out = tmp_path / "resolved.json"
    rc = main(["plan", "--model", str(tmp_path / "model.json"), "--gpu-memory", "8GiB", "--cpu-memory", "12GB",
               "--nvme", str(tmp_path / "nvme"), "--device", "cpu", "--micro-batch", "4", "--seq-len", "1024",
               "--checkpointing", "--rates", str(tmp_path / "rates.json"), "--out", str(out)])
    printed = capsys.readouterr()
    assert rc == 0, printed.err
    assert "optimizer states" in printed.out and "predicted:" in printed.out and "bound by" in printed.out
    text = out.read_text()
    assert '"auto"' not in text
    c = load_config(str(out))
    assert c.bf16.enabled and c.train_micro_batch_size_per_gpu == 4
    assert c.zero_optimization.offload_optimizer.device == "nvme"  # 12 GB cannot hold 13 GB of Adam state
    rc = main(["plan", "--model", str(tmp_path / "model.json"), "--gpu-memory", "8GiB", "--cpu-memory", "8GB",
               "--device", "cpu", "--rates", str(tmp_path / "rates.json"), "--out", str(tmp_path / "x.json")])
    assert rc == 2 and "give a swap directory" in capsys.readouterr().err  # a user error: exit 2, one line


def test_calibrated_compute_replaces_the_flops_estimate(tmp_path):
    """The model built with 1 and 2 layers is timed; the plan's compute is that figure per micro-batch."""
    from pyinfinity.probes import measure_decoder_compute

    seconds, acts = measure_decoder_compute(TINY_LLAMA, "cpu", micro_batch=1, seq_len=16, dtype=torch.float32, reps=2)
    assert 0 < seconds < 10 and acts == 0  # activation bytes are only measured on a GPU
    cfg = {"gradient_accumulation_steps": 3, "zero_optimization": {"stage": 3, "offload_param": {"device": "auto"},
                                                                    "offload_optimizer": {"device": "auto"}},
           "pyinfinity": {"device": "cpu", "device_memory": "64MiB"}}
    rates = Rates(h2d=4e9, d2h=4e9, disk_read=1e9, disk_write=1e9, adam=3e8, matmul=5e10, memcpy=4e9)
    b = Budgets(device_memory=64 << 20, host_memory=1 << 30, device_is_host=True)
    _, plan = resolve_auto(cfg, TINY_LLAMA, b, rates, seq_len=16, compute_seconds=seconds)
    assert plan.predicted.compute == pytest.approx(3 * seconds)


@pytest.mark.parametrize("dtype,accum", [("bf16", 1), ("fp16", 1), ("bf16", 2)])
def test_the_optimizer_term_charges_the_passes_the_engine_makes(dtype, accum):
    """State and weights in RAM on a GPU: the one-pass kernel writes new bf16 weights into their
    home itself (the measured Adam rate includes it), so the term is Adam alone; fp16 weights take
    one cast pass from the fp32 master (4 + 2 bytes); under accumulation no pass either: the global
    norm comes from per-unit norms (taken on the device, or by the boundary micro-batch's adds)."""
    from pyinfinity.plan import Fixed

    sizes = llama_sizes(LLAMA_1B, dtype=dtype)
    rates = Rates(h2d=50e9, d2h=50e9, disk_read=1.5e9, disk_write=1.2e9, adam=3.4e9, matmul=600e12, memcpy=20e9,
                  device="cuda")
    fixed = Fixed(param_device="cpu", optimizer_device="cpu", resident_bytes=0, device_optimizer_bytes=0)
    p = solve(sizes, TrainShape(micro_batch=1, seq_len=1024, grad_accum=accum, checkpointing=True),
              _budgets(8 << 30, 100 * GB), rates, fixed)
    n = sizes.trainable_numel
    want = n / rates.adam
    if dtype == "fp16":
        want += n * (4 + 2) / (2 * rates.memcpy)
    assert p.predicted.optimizer == pytest.approx(want, rel=1e-6)


def test_10b_for_a_gpu_with_8gib_is_placed_within_15_bytes_per_parameter(tmp_path):
    """The 10.49B preset for a CUDA device with an 8 GiB cap, rates saved from a GPU machine, 100 GiB
    of RAM and a 64 GiB disk: placed, not refused; host + disk state stays within 15 bytes per
    parameter (bf16 weights 2 + fp32 master and moments 12: the gradients land in the weights' home)."""
    from pyinfinity.presets import PRESETS as SIZES
    from pyinfinity.plan import Budgets, Rates, SwapDir, TrainShape, solve
    from pyinfinity.plan.sizes import llama_sizes

    rates_file = tmp_path / "rates.json"
    Rates(h2d=55e9, d2h=55e9, disk_read=2.2e9, disk_write=3.7e9, adam=9.7e9, matmul=6.3e14, memcpy=20e9,
          device="cuda:0").save(str(rates_file))
    rates = Rates.from_json(__import__("json").loads(rates_file.read_text()))
    sizes = llama_sizes(dict(SIZES["10b"], model_type="llama"), dtype="bf16")
    budgets = Budgets(device_memory=8 << 30, host_memory=100 << 30, swap=[SwapDir(str(tmp_path), 64 << 30)])
    p = solve(sizes, TrainShape(micro_batch=4, seq_len=1024, checkpointing=True, overlap_step="auto"), budgets,
              rates)
    assert p.feasible and p.device_bytes <= 8 << 30
    assert 10.4e9 < sizes.numel < 10.6e9
    state = p.params.total + p.optimizer.total + p.grads.total  # staging buffers are working memory, not state
    assert state / sizes.numel <= 15.0, p.table()
    assert p.host_bytes <= 100 << 30 and p.swap_bytes <= 64 << 30
    assert p.optimizer.disk > 0  # 147 GB of state cannot all be in 100 GiB of RAM


def test_13b_refused_on_that_machine_says_what_the_state_costs_a_parameter(tmp_path):
    """The 13B preset does not fit 100 GiB of RAM and a 64 GiB disk: the refusal names the swap it
    needs and the state's bytes a parameter (bf16 weights 2 + fp32 master and moments 12)."""
    import re

    from pyinfinity.presets import PRESETS as SIZES
    from pyinfinity.plan import Budgets, PlanError, Rates, SwapDir, TrainShape, solve
    from pyinfinity.plan.sizes import llama_sizes

    rates = Rates(h2d=55e9, d2h=55e9, disk_read=1.9e9, disk_write=3.6e9, adam=3.9e9, matmul=6.4e14, memcpy=38e9,
                  device="cuda:0")
    sizes = llama_sizes(dict(SIZES["13b"], model_type="llama"), dtype="bf16")
    budgets = Budgets(device_memory=8 << 30, host_memory=100 << 30, swap=[SwapDir(str(tmp_path), 64 << 30)])
    with pytest.raises(PlanError) as ei:
        solve(sizes, TrainShape(micro_batch=4, seq_len=1024, checkpointing=True, overlap_step="auto"), budgets, rates)
    msg = str(ei.value)
    assert msg.startswith("swap: needs") and "free at" in msg
    per = float(re.search(r"the training state is ([0-9.]+) bytes a parameter", msg).group(1))
    assert 13.9 <= per <= 15.0, msg
    assert "13.02B parameters" in msg and "fp32 gradients" not in msg  # they land in the weights' homes


@pytest.mark.parametrize("state, most", [("8bit", 8.1), ("bf16", 8.1)])
def test_13b_with_a_compressed_state_is_placed_where_the_fp32_state_is_refused(tmp_path, state, most):
    """The machine above (8 GiB GPU, 100 GiB of RAM, a 64 GiB disk) refuses the 13B preset with the
    fp32 state; the 8-bit state (fp32 master, 8.03 bytes a parameter with the bf16 weights) and the
    bf16 state (6, and a bf16 gradient buffer: the weights are the master) are placed."""
    from pyinfinity.presets import PRESETS as SIZES

    rates = Rates(h2d=55e9, d2h=55e9, disk_read=1.9e9, disk_write=3.6e9, adam=3.9e9, matmul=6.4e14, memcpy=38e9,
                  device="cuda:0")
    sizes = llama_sizes(dict(SIZES["13b"], model_type="llama"), dtype="bf16")
    budgets = Budgets(device_memory=8 << 30, host_memory=100 << 30, swap=[SwapDir(str(tmp_path), 64 << 30)])
    train = TrainShape(micro_batch=4, seq_len=1024, checkpointing=True, overlap_step="auto", optimizer_state=state)
    p = solve(sizes, train, budgets, rates)
    assert p.feasible and p.state == state and f"{state} state" in p.table()
    assert (p.params.total + p.optimizer.total + p.grads.total) / sizes.numel <= most, p.table()
    assert p.host_bytes <= 100 << 30 and p.swap_bytes <= 64 << 30


@pytest.mark.parametrize("state", ["fp32", "8bit", "bf16"])
@pytest.mark.parametrize("optimizer_device", ["cpu", "nvme"])
def test_each_state_format_is_charged_shard_by_shard_where_it_lies(state, optimizer_device):
    """RAM or disk holds each shard's state in its format (the 8-bit state of a shard under
    MIN_QUANTIZED_NUMEL elements stays fp32; on disk the state moves compressed, and the staging
    buffers hold it so); the CPU step runs at the format's rate; a bf16 master needs a gradient
    buffer of its own."""
    from pyinfinity.config import MIN_QUANTIZED_NUMEL, STATE_FORMATS
    from pyinfinity.plan import Knobs, evaluate

    sizes = llama_sizes(LLAMA_1B, dtype="bf16")
    assert min(sizes.shard_numels) < MIN_QUANTIZED_NUMEL < max(sizes.shard_numels)  # the final norm's unit
    fmt = STATE_FORMATS[state]
    rates = Rates(h2d=50e9, d2h=50e9, disk_read=1.5e9, disk_write=1.2e9, adam=3.4e9, matmul=600e12, memcpy=20e9,
                  adam_8bit=5.1e9, adam_bf16=6.8e9, device="cuda")
    k = Knobs(param_device="cpu", optimizer_device=optimizer_device, ratio=1.0, prefetch_bytes=1 << 30)
    p = evaluate(sizes, TrainShape(optimizer_state=state), _budgets(80 << 30, 1000 * GB), rates, k)
    want = sum(int(fmt.shard_bytes(n)) for n, t in zip(sizes.shard_numels, sizes.shard_trainable) if t)
    assert (p.optimizer.ram if optimizer_device == "cpu" else p.optimizer.disk) == want
    if state == "8bit":
        assert want < sizes.trainable_numel * 6.04 and want > sizes.trainable_numel * 6.03
    assert p.grads.ram == (sizes.param_bytes if state == "bf16" else 0)
    assert p.predicted.optimizer == pytest.approx(sizes.trainable_numel / rates.adam_rate(state), rel=1e-6)
    if optimizer_device == "nvme":
        biggest = max(int(fmt.shard_bytes(n)) for n in sizes.shard_numels)
        assert p.pinned_bytes >= 4 * biggest and p.swap_bytes >= want


def test_rates_per_state_format():
    """A format's CPU step rate where measured, else the fp32 step's; saved and loaded with the rest."""
    import tempfile

    r = Rates(h2d=1e9, d2h=1e9, disk_read=1e9, disk_write=1e9, adam=1e9, matmul=1e12, memcpy=1e10, adam_8bit=2e9)
    assert r.adam_rate("fp32") == 1e9 and r.adam_rate("8bit") == 2e9 and r.adam_rate("bf16") == 1e9
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "rates.json")
        r.save(path)
        assert load_rates_file(path)[0]["adam_8bit"] == 2e9 and "adam_bf16" not in load_rates_file(path)[0]
        assert Rates.from_json(json.load(open(path))).adam_rate("8bit") == 2e9


def test_the_rate_probe_times_the_planned_formats_kernel(monkeypatch):
    from pyinfinity import probes as probes_mod

    calls = []

    def fake(numel: int = 0, reps: int = 0, threads=None, state: str = "fp32") -> float:
        calls.append(state)
        return {"fp32": 1e9, "8bit": 2e9}[state]

    monkeypatch.setattr(probes_mod, "measure_adam", fake)
    monkeypatch.setattr(probes_mod, "_CACHE", {})
    r = probes_mod.measure_rates("cpu", optimizer_threads=1, cache=True, optimizer_state="8bit")
    assert calls == ["fp32", "8bit"] and r.adam_rate("8bit") == 2e9 and r.source["adam_8bit"] == "probe, 1 thread"
    assert probes_mod.measure_rates("cpu", optimizer_threads=1, cache=True, optimizer_state="8bit") is r
    monkeypatch.undo()
    for state in ("8bit", "bf16"):  # the real kernels, briefly
        assert probes_mod.measure_adam(1 << 16, 1, threads=1, state=state) > 0


def test_device_step_rates_per_state_format():
    """A format's device step rate where measured, else the assumed figure (fp32's fused step
    free, the compressed formats' torch steps as an H200 ran them), with its source; saved and
    loaded with the rest."""
    import math
    import tempfile

    from pyinfinity.plan.rates import DEVICE_ADAM_ASSUMED, device_adam_key

    r = Rates(h2d=1e9, d2h=1e9, disk_read=1e9, disk_write=1e9, adam=1e9, matmul=1e12, memcpy=1e10,
              device_adam_8bit=40e9, source={"device_adam_8bit": "probe"})
    assert r.device_adam_rate("fp32") == math.inf and r.device_adam_rate("8bit") == 40e9
    assert r.device_adam_rate("bf16") == DEVICE_ADAM_ASSUMED["bf16"] < r.adam_rate("bf16") * 20
    assert r.device_adam_source("8bit") == "probe" and "H200" in r.device_adam_source("bf16")
    assert "free" in r.device_adam_source("fp32") and "device_adam_8bit" in r.describe_sources()
    gpu = Rates(**{**r.__dict__, "device": "cuda"})
    assert "device_adam_bf16" in gpu.describe_sources("bf16") and "an H200's figure" in gpu.describe_sources("bf16")
    assert "device_adam_bf16" not in r.describe_sources("bf16")  # the CPU device steps nothing there
    with pytest.raises(ValueError, match="fp64"):
        device_adam_key("fp64")
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "rates.json")
        r.save(path)
        figures = load_rates_file(path)[0]
        assert figures["device_adam_8bit"] == 40e9 and "device_adam" not in figures
        assert Rates.from_json(json.load(open(path))).device_adam_rate("8bit") == 40e9


@pytest.mark.parametrize("state", ["fp32", "8bit", "bf16"])
def test_the_device_step_probe_times_the_engines_own_step(state, monkeypatch):
    """measure_device_adam runs the format's step_device (any device: here the CPU's tensors) and
    gives params/s; the probe runs on the planned format's step."""
    from pyinfinity import probes as probes_mod
    from pyinfinity.zero.optim import formats

    calls = []
    real = formats.make_state_format

    def spy(name: str, adam_w: bool):
        fmt = real(name, adam_w)
        step = fmt.step_device

        def counted(*a, **kw):
            calls.append(name)
            return step(*a, **kw)

        fmt.step_device = counted
        return fmt

    monkeypatch.setattr(formats, "make_state_format", spy)
    rate = probes_mod.measure_device_adam("cpu", state, numel=1 << 16, reps=1)
    assert rate > 0 and calls and set(calls) == {state}


@pytest.mark.parametrize("oom", [False, True])
def test_the_rates_of_a_gpu_include_the_planned_formats_device_step(oom, monkeypatch, caplog):
    """On a GPU the rates time the planned format's device step; with no device memory to spare the
    assumed figure stands in, with a warning (the probes stubbed: this machine has no GPU)."""
    from pyinfinity import probes as probes_mod
    from pyinfinity.plan.rates import DEVICE_ADAM_ASSUMED

    def device_step(dev, state, numel, reps):
        if oom:
            raise torch.OutOfMemoryError("CUDA out of memory")
        return 40e9

    monkeypatch.setattr(probes_mod, "_CACHE", {})
    monkeypatch.setattr(probes_mod, "device_is_here", lambda dev: True)
    monkeypatch.setattr(probes_mod, "measure_device_adam", device_step)
    monkeypatch.setattr(probes_mod, "measure_adam", lambda *a, **k: 3e9)
    monkeypatch.setattr(probes_mod, "measure_memcpy", lambda *a, **k: 20e9)
    monkeypatch.setattr(probes_mod, "measure_copies", lambda *a, **k: (50e9, 50e9, 20e9))
    monkeypatch.setattr(probes_mod, "matmul_probe", lambda *a, **k: (600e12, 1.0))  # FLOP/s, samples' spread
    r = probes_mod.measure_rates("cuda:0", optimizer_state="8bit", optimizer_threads=1)
    if oom:
        assert r.device_adam_8bit == 0 and "no device memory to time the 8bit optimizer step" in caplog.text
        assert r.device_adam_rate("8bit") == DEVICE_ADAM_ASSUMED["8bit"]
    else:
        assert r.device_adam_rate("8bit") == 40e9 and r.source["device_adam_8bit"] == "probe"
    assert r.device_adam == 0  # only the planned format's step is timed


def test_units_stepped_on_the_device_cost_their_step_there():
    """The device step of units whose state lives on the device is on the compute stream: the
    prediction adds their parameters over the format's device rate; torch's fused fp32 step is
    free."""
    from pyinfinity.plan import Knobs, evaluate

    sizes = llama_sizes(LLAMA_1B, dtype="bf16")
    k = Knobs(param_device="cpu", optimizer_device="cpu", ratio=1.0, prefetch_bytes=0,
              resident_bytes=sizes.param_bytes, device_optimizer_bytes=1 << 40)
    budgets = _budgets(139 * 2**30, 100 * GB)
    fast, slow = (Rates(**{**GPU_RATES.__dict__, "device_adam_8bit": r}) for r in (1e15, 1e9))
    p_fast, p_slow = (evaluate(sizes, TrainShape(optimizer_state="8bit"), budgets, r, k) for r in (fast, slow))
    assert p_fast.device_state_bytes > 0 and p_fast.feasible, p_fast.violations
    stepped = sum(n for n, t in zip(sizes.shard_numels, sizes.shard_trainable) if t)
    assert p_slow.predicted.total - p_fast.predicted.total == pytest.approx(stepped / 1e9 - stepped / 1e15, rel=1e-3)
    assert p_slow.predicted.optimizer - p_fast.predicted.optimizer == pytest.approx(stepped / 1e9, rel=1e-3)
    fp32 = evaluate(sizes, TrainShape(), budgets, GPU_RATES, k)
    assert fp32.predicted.optimizer == pytest.approx(0.0, abs=1e-3)


@pytest.mark.parametrize("device_rate, on_device", [(1e9, False), (200e9, True)])
def test_the_plan_keeps_state_on_the_host_when_its_device_step_is_the_slower(device_rate, on_device):
    """A whole 1.1B run fits an H200: the device could hold every unit's 8-bit state, but its step
    there runs at the format's device rate on the compute stream. Slower than the CPU's step
    beside the compute, the plan keeps the state on the host and says why; fast (a kernel),
    it steps there."""
    sizes = llama_sizes(LLAMA_1B, dtype="bf16")
    rates = Rates(**{**GPU_RATES.__dict__, "adam_8bit": 3.3e9, "device_adam_8bit": device_rate,
                     "source": {"device_adam_8bit": "probe"}})
    p = solve(sizes, TrainShape(micro_batch=4, seq_len=1024, checkpointing=True, optimizer_state="8bit"),
              _budgets(139 * 2**30, 100 * GB), rates)
    assert (p.knobs.device_optimizer_bytes > 0) is on_device and (p.device_state_bytes > 0) is on_device
    why = [n for n in p.notes if "stays on the host" in n]
    assert bool(why) is not on_device
    if why:
        assert "1.00 Gparam/s (probe)" in why[0] and "pyinfinity.device_optimizer_bytes" in why[0]


def test_the_device_steps_scratch_is_charged_as_the_step_takes_it():
    from pyinfinity.layout.charges import FORMAT_STEP_SCRATCH, device_state_cost, step_scratch
    from pyinfinity.zero import optimizer, state_formats

    assert step_scratch("fp32") == 4 * optimizer.DEVICE_CHUNK
    assert step_scratch("8bit") == FORMAT_STEP_SCRATCH == state_formats.DEVICE_SCRATCH_PER_ELEMENT * \
        state_formats.DEVICE_CHUNK
    assert device_state_cost(2, 1) == 14 and device_state_cost(2, 1, "8bit") == 2 + 6 + 8 / 256
    assert device_state_cost(2, 2, "bf16") == 2 + 4 + 4  # the master is the unit's own device buffer


# ----------------------------------------------------------------------------------- planning for another machine


def test_preset_rates_name_their_figures_and_sources():
    from pyinfinity.plan.hardware import DISK_PRESETS, LINK_PRESETS
    from pyinfinity.probes import preset_rates

    r = preset_rates("cuda", link="pcie4x16", disk="nvme-gen4", matmul=150e12, adam=2e9, memcpy=10e9)
    assert (r.h2d, r.d2h) == (LINK_PRESETS["pcie4x16"].h2d, LINK_PRESETS["pcie4x16"].d2h)
    assert (r.disk_read, r.disk_write) == (DISK_PRESETS["nvme-gen4"].read, DISK_PRESETS["nvme-gen4"].write)
    assert r.matmul == 150e12 and r.adam == 2e9 and r.device == "cuda"
    assert r.source["h2d"].startswith("preset pcie4x16") and r.source["disk_read"].startswith("preset nvme-gen4")
    assert r.source["matmul"] == "given"
    assert LINK_PRESETS["h200-sxm"].h2d == 55e9  # as measured on an H200 SXM, pinned
    with pytest.raises(ValueError, match="link: unknown preset 'pcie9'.*pcie4x16"):
        preset_rates("cuda", link="pcie9")


def _plan(*args: str, env_extra: dict | None = None) -> "subprocess.CompletedProcess":
    import subprocess
    import sys

    # CUDA_VISIBLE_DEVICES="" : a machine without a GPU even where the test runs on one
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", **(env_extra or {})}
    return subprocess.run([sys.executable, "-m", "pyinfinity", "plan", *args], capture_output=True, text=True,
                          timeout=300, env=env)


def test_planning_for_a_gpu_from_a_machine_without_one(tmp_path):
    (tmp_path / "model.json").write_text(json.dumps(LLAMA_1B))
    model = str(tmp_path / "model.json")
    # --gpu-memory without --device plans for a GPU (never silently for the CPU), from presets
    p = _plan("--model", model, "--gpu-memory", "8GiB", "--cpu-memory", "64GB", "--nvme", str(tmp_path / "swap"), "-o",
              str(tmp_path / "out.json"))
    assert p.returncode == 0, p.stderr[-3000:]
    assert "not on this machine" in p.stdout
    for key, src in (("h2d", "preset pcie4x16"), ("disk_read", "preset nvme-gen4"), ("matmul", "assumed"),
                     ("adam", "scaled to an assumed")):
        assert any(line.split()[:1] == [key] and src in line for line in p.stdout.splitlines()), (key, p.stdout)
    out = json.loads((tmp_path / "out.json").read_text())
    assert out["pyinfinity"]["device"] == "cuda"
    assert "buffer_size" not in out["zero_optimization"]["offload_param"]  # a knob pyinfinity does not use
    assert "engine ready" not in p.stderr  # the internal overhead probe stays quiet
    # named presets and a rates file: the file's figures win, the presets and --tflops fill the rest
    (tmp_path / "rates.json").write_text(json.dumps({"rates": {"disk_read": 0.9e9, "disk_write": 0.8e9}}))
    p = _plan("--model", model, "--device", "cuda", "--gpu-memory", "8GiB", "--cpu-memory", "64GB", "--link", "pcie3x16", "--disk",
              "nvme-gen5", "--tflops", "200", "--rates", str(tmp_path / "rates.json"))
    assert p.returncode == 0, p.stderr[-3000:]
    lines = {line.split()[0]: line for line in p.stdout.splitlines() if line.startswith("  ") and line.split()}
    assert "12.00 GB/s" in lines["h2d"] and "preset pcie3x16" in lines["h2d"]
    assert "0.900 GB/s" in lines["disk_read"] and "file:" in lines["disk_read"]
    assert "preset nvme-gen5" in lines["disk_latency"]  # the file has no latency: the preset's
    assert "200.000 TFLOP/s" in lines["matmul"] and "given" in lines["matmul"]
    # the target's memory cannot be measured from here: a one-line error says what to give
    p = _plan("--model", model, "--device", "cuda")
    assert p.returncode == 2 and "Traceback" not in p.stderr and "--gpu-memory" in p.stderr.splitlines()[-1]


def test_under_accumulation_the_accumulators_go_to_the_device_before_resident_units():
    """1.1B under 8 GiB with 4 micro-batches: every unit resident leaves room for the fp32
    accumulators of about two thirds of the parameters, and the host adds the rest's gradient every
    micro-batch while the CPU step streams the same memory. The planner also weighs the placement
    that streams the units again and puts nearly every accumulator on the device; where the compute
    leaves the link time to spare and the host adds are as slow as they were on an H200 box (a real
    1.1B step sustains about half the probe's matmul rate: plain PyTorch ran 0.133 s a
    micro-batch; the engine's adds of 0.37B parameters took 0.17 s a micro-batch, a memcpy rate of
    about 9.6 GB/s in the model's terms) it is predicted faster and chosen. Without accumulation
    every unit stays resident."""
    from dataclasses import replace

    from pyinfinity.plan.placement import candidates

    sizes = llama_sizes(LLAMA_1B, "bf16")
    budgets = _budgets(8 * 2**30, 100 * GB)
    need = 4 * sizes.trainable_numel
    four = TrainShape(micro_batch=4, seq_len=1024, grad_accum=4, checkpointing=True)
    accs = sorted(k.device_accumulator_bytes for k in candidates(sizes, four, budgets, GPU_RATES, Fixed(), False))
    assert accs[0] < 0.75 * need and accs[-1] >= 0.95 * need  # both placements are weighed
    sustained = replace(GPU_RATES, matmul=300e12, memcpy=9.6e9)
    one = solve(sizes, TrainShape(micro_batch=4, seq_len=1024, checkpointing=True), budgets, sustained)
    assert one.knobs.resident_bytes == sizes.param_bytes - sizes.small_shard_bytes(one.knobs.persistence_threshold)
    p = solve(sizes, four, budgets, sustained)
    assert p.knobs.device_accumulator_bytes >= 0.95 * need and p.knobs.resident_bytes < one.knobs.resident_bytes
    kept = solve(sizes, four, budgets, sustained, Fixed(resident_bytes=one.knobs.resident_bytes))
    assert kept.knobs.device_accumulator_bytes < 0.75 * need and p.predicted.total < kept.predicted.total


def test_under_accumulation_the_host_s_adds_and_the_cpu_step_do_not_hide_each_other():
    """Every accumulator on the host and a slow host memory: the step is the g micro-batches' adds
    (bf16 in, fp32 accumulator read and written: 9 bytes a parameter on average over 4
    micro-batches, a memcpy touching each byte twice) plus the whole CPU step, none of it hidden
    behind backward as an overlapped step alone would be."""
    from dataclasses import replace

    sizes = llama_sizes(LLAMA_1B, "bf16")
    slow = replace(GPU_RATES, memcpy=2e9)
    train = TrainShape(micro_batch=4, seq_len=1024, grad_accum=4, checkpointing=True, overlap_step="on")
    p = solve(sizes, train, _budgets(8 * 2**30, 100 * GB), slow,
              Fixed(param_device="cpu", optimizer_device="cpu", device_accumulator_bytes=0, device_optimizer_bytes=0))
    adds = sizes.trainable_numel * ((2 + 4) + 3 * (2 + 8)) / 4 / (2 * slow.memcpy)
    assert p.predicted.total == pytest.approx(4 * adds + p.predicted.optimizer, rel=1e-6)
    assert p.predicted.optimizer_phase < p.predicted.optimizer  # the overlapped step alone would hide part of it


def _tiny_llama(frozen: bool = False):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                                         num_attention_heads=4, num_key_value_heads=4))
    if frozen:
        model.model.embed_tokens.weight.requires_grad_(False)
    return model


def test_the_engine_measures_a_decoder_s_compute_where_it_fits_and_keeps_the_flops_estimate_otherwise():
    """``measured_compute``: one and two of the model's layers timed on the device (here the CPU);
    None for a model with frozen parameters (the probe's backward would compute weight gradients
    adapters skip), a module without a transformers config, or a probe above 3/4 of the budget.
    The probe leaves torch's RNG where it was (a seed gives the same model with or without it)."""
    from pyinfinity.probes import decoder_probe_bytes
    from pyinfinity.probes import measured_compute

    train = TrainShape(micro_batch=2, seq_len=32, checkpointing=True)
    model = _tiny_llama()
    rng = torch.random.get_rng_state()
    seconds = measured_compute(model, train, torch.device("cpu"), 1 << 30, torch.float32)
    assert torch.equal(torch.random.get_rng_state(), rng)
    assert seconds is not None and 0 < seconds < 5
    assert measured_compute(_tiny_llama(frozen=True), train, torch.device("cpu"), 1 << 30, torch.float32) is None
    assert measured_compute(torch.nn.Linear(4, 4), train, torch.device("cpu"), 1 << 30, torch.float32) is None
    need = decoder_probe_bytes(model.config.to_dict(), 2, 32, 4, True)
    assert measured_compute(model, train, torch.device("cpu"), need, torch.float32) is None  # 3/4 of it is too little
    assert measured_compute(model, train, torch.device("cpu"), need * 2, torch.float32) is not None


def test_a_measured_compute_figure_is_scaled_by_the_flops_at_another_sequence_length():
    from pyinfinity.plan.evaluation import train_at_seq_len

    sizes = llama_sizes({"vocab_size": 32000, "hidden_size": 2048, "intermediate_size": 5632, "num_hidden_layers": 22,
                         "num_attention_heads": 32, "num_key_value_heads": 4})
    train = TrainShape(micro_batch=4, seq_len=1024, checkpointing=True, compute_seconds=0.1)
    longer = train_at_seq_len(sizes, train, 2048)
    want = 0.1 * sizes.flops_per_step(4, 2048, True) / sizes.flops_per_step(4, 1024, True)
    assert longer.seq_len == 2048 and longer.compute_seconds == pytest.approx(want)
    assert 0.2 <= longer.compute_seconds <= 0.25  # twice the tokens, plus attention's quadratic part
    assert train_at_seq_len(sizes, TrainShape(seq_len=1024), 512).compute_seconds is None


def test_the_gradient_add_is_timed_under_accumulation_and_its_rate_prices_the_host_adds():
    """``Rates.accumulate``: the engine's own add (a bf16 gradient into an fp32 accumulator), probed
    when the run accumulates; the planner prices the host's adds at it instead of the memcpy model
    (on the H200 box the adds ran at about half the memcpy model's pace: the engine kept units
    resident and added most gradients on the host, predicted 0.71 s/step and ran 1.05)."""
    from pyinfinity.layout.shards import Knobs
    from pyinfinity.plan.evaluation import evaluate
    from pyinfinity.probes import measure_accumulate

    rate = measure_accumulate(1 << 20, reps=2, threads=1)
    assert 1e6 < rate < 1e11
    sizes = llama_sizes({"vocab_size": 32000, "hidden_size": 2048, "intermediate_size": 5632, "num_hidden_layers": 22,
                         "num_attention_heads": 32, "num_key_value_heads": 4})
    train = TrainShape(micro_batch=4, seq_len=1024, grad_accum=4, checkpointing=True, compute_seconds=0.13)
    budgets = Budgets(device_memory=8 << 30, host_memory=100 << 30, device_is_host=False)
    memcpy_model = Rates(h2d=55e9, d2h=55e9, disk_read=2e9, disk_write=3e9, adam=3.8e9, matmul=645e12, memcpy=30e9,
                         device="cuda:0")
    measured = Rates(**{**memcpy_model.__dict__, "accumulate": 1.9e9})
    knobs = Knobs(param_device="cpu", optimizer_device="cpu", resident_bytes=1 << 40)  # every gradient added on the host
    a, b = evaluate(sizes, train, budgets, memcpy_model, knobs), evaluate(sizes, train, budgets, measured, knobs)
    per_micro = sizes.trainable_numel * ((2 + 4) + 3 * (2 + 8)) / 4 / (2 + 8) / 1.9e9
    assert per_micro > 0.13 and b.predicted.micro_batch >= per_micro  # the adds, not the compute, pace a micro-batch
    assert b.predicted.total > a.predicted.total
    # the loader keeps the figure; a rates file without it leaves the memcpy model
    assert Rates.from_json(measured.to_json()).accumulate == 1.9e9
    assert Rates.from_json(memcpy_model.to_json()).accumulate == 0.0


def test_the_probes_time_the_dtype_most_of_the_model_computes_in():
    """A LoRA run sets no bf16 section (the base keeps its bf16, the adapters are fp32): the matmul
    probe timed fp32 for it, and the engine predicted a 13B step of 11.6 s that ran in 1.1."""
    peft = pytest.importorskip("peft")
    from pyinfinity.adapters import get_peft_model
    from pyinfinity.plan.resolve import run_dtype

    base = _tiny_llama().to(torch.bfloat16)
    lora = get_peft_model(base, peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    plain = load_config({"train_micro_batch_size_per_gpu": 1})
    assert {p.dtype for p in lora.parameters()} == {torch.bfloat16, torch.float32}
    assert run_dtype(plain, lora) == torch.bfloat16
    assert run_dtype(load_config({"train_micro_batch_size_per_gpu": 1, "fp16": {"enabled": True}}), lora) == torch.float16
    assert run_dtype(plain, _tiny_llama()) == torch.float32 and run_dtype(plain, None) == torch.float32


def test_the_disk_probe_times_a_read_and_a_write_together(tmp_path):
    """measure_disk times a read and a write issued at once against the two alone: the duplex share
    lies between the larger alone's share and 1, and the probe leaves nothing in the directory."""
    from pyinfinity.probes import DiskProbe, measure_disk

    probe = measure_disk(str(tmp_path), 4 << 20, reps=2)
    assert isinstance(probe, DiskProbe)
    assert probe.read > 0 and probe.write > 0 and probe.latency >= 0
    assert 0.5 <= probe.duplex <= 1.0
    assert list(tmp_path.iterdir()) == []



class _TimedSwapEngine:
    """A SwapEngine stand-in whose transfers take set times: ``plan[kind]`` is a list of seconds,
    one per call, cycled (kind: "page" for a one-page read, else "read" or "write")."""

    plan: dict = {}

    def __init__(self, **kw):
        self.block_size = 64 << 10
        self.calls = {k: 0 for k in self.plan}

    def _wait(self, kind):
        import time

        times = self.plan[kind]
        seconds = times[self.calls[kind] % len(times)]
        self.calls[kind] += 1
        return type("Handle", (), {"wait": lambda _self: time.sleep(seconds)})()

    def read(self, tensor, path, offset):
        return self._wait("page" if tensor.numel() == 4096 else "read")

    def write(self, tensor, path, offset):
        return self._wait("write")

    def close(self):
        pass


def test_a_disk_probe_on_a_busy_machine_is_never_many_times_the_transfer_it_timed(tmp_path, monkeypatch):
    """A one-page read delayed by the scheduler is not the disk's cost of a piece: the fastest page
    read is taken, and the pieces' cost is at most half a transfer, so the rate is at most twice
    the one timed (subtracting 64 delayed page reads made it up to 20x); samples that differ more
    than DISK_SPREAD_LIMIT name the probe uncertain in the rates table."""
    import pyinfinity.swap
    from pyinfinity import probes as probes_mod

    nbytes = 4 << 20
    monkeypatch.setattr(pyinfinity.swap, "SwapEngine", _TimedSwapEngine)
    monkeypatch.setattr(_TimedSwapEngine, "plan", {"read": [0.04], "write": [0.04], "page": [0.005]})
    probe = probes_mod.measure_disk(str(tmp_path), nbytes, reps=3, aio={"block_size": 64 << 10})
    assert probe.read <= 2 * nbytes / 0.04 and probe.write <= 2 * nbytes / 0.04, probe
    assert probe.spread < probes_mod.DISK_SPREAD_LIMIT
    monkeypatch.setattr(_TimedSwapEngine, "plan", {"read": [0.04], "write": [0.03, 0.12], "page": [0.005, 1e-5]})
    probe = probes_mod.measure_disk(str(tmp_path), nbytes, reps=3, aio={"block_size": 64 << 10})
    assert probe.latency < 0.001 and probe.spread > probes_mod.DISK_SPREAD_LIMIT, probe
    r = probes_mod.measure_rates("cpu", str(tmp_path), matmul=1e12, aio={"block_size": 64 << 10})
    assert "uncertain: its samples differ" in r.source["disk_write"], r.source

@pytest.mark.parametrize("pipeline", [True, False])
def test_the_pipelined_optimizers_disk_term_takes_the_disks_duplex_share(pipeline):
    """With the optimizer's disk pipeline (reads of shard k+1 beside writes of k-1) the disk part
    of the step costs the measured duplex share of its reads and writes one after the other;
    without it the sum stays."""
    from dataclasses import replace

    from pyinfinity.plan import Knobs, evaluate

    sizes = llama_sizes(LLAMA_1B, dtype="bf16")
    serial = Rates(h2d=50e9, d2h=50e9, disk_read=1.5e9, disk_write=2.5e9, adam=3.4e9, matmul=600e12, memcpy=20e9,
                   disk_latency=1e-4, device="cuda")
    duplex = replace(serial, disk_duplex=0.8)
    k = Knobs(param_device="cpu", optimizer_device="nvme", ratio=1.0, prefetch_bytes=1 << 30, pipeline=pipeline)
    train = TrainShape(micro_batch=1, seq_len=512, checkpointing=True)
    a = evaluate(sizes, train, _budgets(80 << 30, 1000 * GB), serial, k)
    b = evaluate(sizes, train, _budgets(80 << 30, 1000 * GB), duplex, k)
    if pipeline:
        assert b.predicted.disk < a.predicted.disk
        # the first shard's read waits alone; the rest of the pipeline's disk time scales
        assert b.predicted.disk == pytest.approx(0.8 * a.predicted.disk, rel=0.05)
    else:
        assert b.predicted.disk == pytest.approx(a.predicted.disk)


def test_a_frozen_weights_backward_makes_no_weight_gradient_flops():
    """The FLOPs of a step: 8 x weights x tokens with checkpointing when everything trains (forward,
    recompute, the input and the weight gradients); a frozen base skips its weight gradients, so
    a LoRA run's step is about 7/8 of the full fine-tune's matmul work (attention scores unchanged)."""
    from dataclasses import replace

    full = llama_sizes(LLAMA_1B, dtype="bf16")
    frozen = replace(full, shard_trainable=[False] * len(full.shard_numels))
    attn = 2.0 * 1024 * full.hidden * full.layers * 4 * 1024
    assert full.flops_per_step(4, 1024, True) == pytest.approx(4 * (full.flops_per_token * 4 * 1024) + 4 * attn)
    assert frozen.flops_per_step(4, 1024, True) == pytest.approx(3 * (full.flops_per_token * 4 * 1024) + 4 * attn)
    assert frozen.flops_per_step(4, 1024, False) == pytest.approx(2 * (full.flops_per_token * 4 * 1024) + 3 * attn)


def test_the_live_parameter_cap_counts_resident_units_at_the_narrowest_dtype():
    """stage3_max_live_parameters caps the coordinator's prefetch by the elements not released, the
    resident units included: the planned cap covers resident units, the working set and the
    prefetch, counted at the base's 2 bytes an element when fp32 adapters sit beside a bf16 base
    (at 4 it halved the cap and no decoder layer was ever fetched ahead)."""
    from dataclasses import replace

    from pyinfinity.plan import solve
    from pyinfinity.layout.charges import working_set_bytes

    base = llama_sizes(LLAMA_1B, dtype="bf16")
    n = len(base.shard_numels)
    lora = replace(base, itemsize=4, shard_itemsizes=[2] * n, act_itemsize=2,
                   shard_trainable=[m == min(base.shard_numels) for m in base.shard_numels])
    rates = Rates(h2d=55e9, d2h=55e9, disk_read=0.0, disk_write=0.0, adam=3.9e9, matmul=6.4e14, memcpy=38e9,
                  device="cuda:0")
    train = TrainShape(micro_batch=4, seq_len=1024, checkpointing=True)
    p = solve(lora, train, Budgets(device_memory=4 << 30, host_memory=100 << 30, swap=[]), rates)
    k = p.knobs
    assert 0 < k.resident_bytes < lora.param_bytes and k.prefetch_bytes > 0, p.table()
    held = k.resident_bytes + working_set_bytes(lora, train) + k.prefetch_bytes
    assert k.max_live * 2 >= held  # at 4 bytes an element the cap would be about held / 4


def test_the_planner_decides_only_keys_a_checkpoint_records_as_its_placement():
    """``plan.resolve.KEYS`` (what the planner decides) and ``config.PLACEMENT_KEYS`` (what a
    checkpoint records and ``train --resume`` keeps) name the same config keys: a knob the planner
    gains that the list lacks would be planned anew on every resume."""
    from pyinfinity.config import PLACEMENT_KEYS
    from pyinfinity.plan.resolve import KEYS

    assert set(KEYS.values()) <= set(PLACEMENT_KEYS)
    assert set(PLACEMENT_KEYS) - set(KEYS.values()) == {"pyinfinity.unit_bytes", "pyinfinity.overlap_step"}
