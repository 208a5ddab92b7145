"""`pyinfinity bench train`: pyinfinity against DeepSpeed ZeRO-3 (and plain PyTorch) training the
same Llama-architecture models, on the same data, under the same device-memory cap.

Each (size, system) pair runs in its own process (:mod:`pyinfinity.bench.train_worker`); results
are appended to one JSON file, so a matrix too big for one session can be measured over several
and reported together. For every run an analytic lower bound on the step time is
computed from rates measured in the same invocation (``train_bound``).

Systems may carry a variant, ``pyinfinity-auto[resident_bytes=0]`` or
``deepspeed-z2-cpu[bf16.bf16_optimizer_states=true]``: dotted config keys set in that system's
config, so configurations of one engine are compared in one invocation; the full name labels the
run. "vs best DeepSpeed" is a run's tokens/s over the fastest DeepSpeed run (any configuration or
variant) of the same size in the same invocation.

This module runs the matrix; what can be run (sizes, systems) is in ``train_matrix``, the bound in
``train_bound``, the results file and the report in ``train_report``; their names are importable
from here.
"""
from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Optional

from pyinfinity.bench.procs import kill_group
from pyinfinity.bench.train_bound import (adam_rate_for, adam_rate_key, best_disk_rates, bound, device_adam_rate_for,
                                          measure_bound_rates, measure_matmul_rate, optimizer_state,
                                          optimizer_state_bytes, probe_disk, tier_fractions, uses_disk)
from pyinfinity.bench.train_matrix import (DEEPSPEED_DEFAULTS, DEFAULT_SIZES_CPU, DEFAULT_SIZES_GPU, DEFAULT_SYSTEMS,
                                           DEFAULT_SYSTEMS_LORA, PEERS, SCHEMA, BenchTrainError, SystemSpec,
                                           base_system, lora_spec, model_fields, parse_system, parse_systems,
                                           size_facts)
from pyinfinity.bench.train_report import (HEADER, below_bound, compare_to_best_deepspeed, gib, latest_runs,
                                           load_results, one_line, plot, ratio_lines, report, rss_over_plan,
                                           save_results, table_rows, usable)
from pyinfinity.bench.train_worker import RESULT_PREFIX, TIERS
from pyinfinity.plan.rates import device_adam_key

log = logging.getLogger(__name__)


@dataclass
class Settings:
    sizes: list[str]
    systems: list[str]
    nvme_dir: str
    device: str = "auto"
    cap_bytes: Optional[int] = 8 << 30
    batch: int = 4
    seq: int = 1024
    steps: int = 5
    warmup: int = 2
    dtype: str = "auto"
    checkpointing: bool = True
    lr: float = 1e-4
    clip: float = 0.0  # gradient clipping (global norm) applied by every system; 0 = off
    grad_accum: int = 1  # micro-batches per optimizer step, every system
    # tokens an optimizer step: the planner chooses batch x grad_accum per size (step_shapes), keeping
    # those named in step_fixed ("batch", "grad_accum") as given
    tokens_per_step: Optional[int] = None
    step_fixed: list[str] = field(default_factory=list)
    seed: int = 0
    trace: bool = True
    timeout: float = 1800.0
    torch_sizes: str = "smallest"  # "smallest" | "all"
    deepspeed: dict[str, Any] = field(default_factory=lambda: json.loads(json.dumps(DEEPSPEED_DEFAULTS)))
    pyinfinity: dict[str, Any] = field(default_factory=dict)  # extra pyinfinity.* config keys
    log_dir: Optional[str] = None
    progress: bool = True
    lora: Optional[dict[str, Any]] = None  # train_matrix.lora_spec: every system trains these adapters on a frozen base
    megatrain_src: Optional[str] = None  # a MegaTrain checkout (--megatrain-src), for --systems megatrain


# ----------------------------------------------------------------------------------- running


def _gpu_present() -> bool:
    import torch

    return torch.cuda.is_available()


def _resolve(settings: Settings) -> tuple[str, str]:
    device = settings.device
    if device == "auto":
        device = "cuda" if _gpu_present() else "cpu"
    if device == "cuda":
        device = "cuda:0"  # each worker is a fresh process: torch.cuda.set_device needs an index
    dtype = settings.dtype
    if dtype == "auto":
        dtype = "bf16" if device.startswith("cuda") or _bf16_master(settings.systems) else "fp32"
    return device, dtype


def _bf16_master(systems: list[str]) -> bool:
    """Whether a system's variant asks for a bf16 master (``bf16.bf16_master_weights_and_grads``),
    which needs bf16 compute: then ``--dtype auto`` is bf16 on the CPU too, for every system."""
    return any(dict(parse_system(label).variant).get("bf16.bf16_master_weights_and_grads") is True
               for label in systems)


def _summarise(res: dict[str, Any], warmup: int, tokens: int, facts: dict[str, Any]) -> None:
    steps = res.get("steps") or []
    steady = [s["seconds"] for s in steps[warmup:]] or [s["seconds"] for s in steps]
    if steady:
        t = statistics.median(steady)
        res["step_seconds"] = t
        res["tokens_per_s"] = tokens / t
        res["model_tflops"] = facts["flops_per_step"] / t / 1e12
        # the figure MegaTrain (and most papers) print: 6 x parameters x tokens/s, recompute not counted
        res["tflops_6nd"] = 6.0 * facts["params"] * tokens / t / 1e12
        tail = steps[warmup:] or steps
        res["disk_read_per_step"] = int(statistics.mean(s["disk_read"] for s in tail))
        res["disk_write_per_step"] = int(statistics.mean(s["disk_write"] for s in tail))


def _disk_need(system: str, facts: dict[str, Any], state_bytes: float) -> int:
    f_par, f_opt = tier_fractions(system, None) if TIERS[base_system(system)][0] != "auto" else (0.0, 0.0)
    return int(state_bytes * facts.get("trainable", facts["params"]) * f_opt + facts["param_bytes"] * f_par)


def run_one(spec: dict[str, Any], timeout: float, log_path: str, on_line: Any = None) -> dict[str, Any]:
    """Runs the worker on ``spec``; its result, or a failed result naming what happened."""
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False, prefix="pyinfinity-bench-") as f:
        json.dump(spec, f)
        spec_path = f.name
    t0 = time.perf_counter()
    cmd = [sys.executable, "-m", "pyinfinity.bench.train_worker", spec_path]
    result: Optional[dict[str, Any]] = None
    out_lines: list[str] = []
    try:
        with open(log_path, "w") as logf:
            proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                    start_new_session=True, bufsize=1)

            def pump_err() -> None:
                assert proc.stderr is not None
                for line in proc.stderr:
                    logf.write(line)
                    logf.flush()
                    if on_line is not None:
                        on_line(line.rstrip())

            th = threading.Thread(target=pump_err, daemon=True)
            th.start()
            assert proc.stdout is not None

            def pump_out() -> None:
                assert proc.stdout is not None
                for line in proc.stdout:
                    out_lines.append(line)

            to = threading.Thread(target=pump_out, daemon=True)
            to.start()
            try:
                rc = proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                kill_group(proc)
                rc = None
            to.join(10)
            th.join(10)
        for line in out_lines:
            if line.startswith(RESULT_PREFIX):
                result = json.loads(line[len(RESULT_PREFIX):])
        if result is None:
            tail = _tail(log_path, 15)
            if rc is None:
                why = f"timed out after {timeout:g} s (--timeout)"
            elif rc < 0:
                sig = signal.Signals(-rc).name if -rc in signal.Signals._value2member_map_ else str(-rc)
                why = f"killed by {sig}" + (" (the kernel's OOM killer: host RAM ran out)" if rc == -9 else "")
            else:
                why = f"the worker exited with status {rc} without a result"
            result = {"system": spec["system"], "size": spec["size"], "ok": False, "error": why, "log_tail": tail}
    finally:
        os.unlink(spec_path)
    result["wall_seconds"] = round(time.perf_counter() - t0, 2)
    result["log"] = log_path
    return result


def _tail(path: str, n: int) -> str:
    try:
        with open(path, errors="replace") as f:
            return "".join(f.readlines()[-n:])
    except OSError:
        return ""


def plan_runs(settings: Settings) -> list[tuple[str, str]]:
    """The (size, system) pairs to run, smallest size first; plain torch at the smallest size only
    unless ``torch_sizes == "all"`` (it cannot fit larger ones under a cap anyway)."""
    pairs = []
    smallest = settings.sizes[0] if settings.sizes else None
    for size in settings.sizes:
        for system in settings.systems:
            if base_system(system) == "torch" and settings.torch_sizes != "all" and size != smallest:
                continue
            pairs.append((size, system))
    return pairs


def _file_name(label: str) -> str:
    """A run's label as a file name (a variant's brackets, dots and slashes replaced)."""
    return "".join(c if c.isalnum() or c in "-_.=" else "_" for c in label)


def _spec(settings: Settings, size: str, label: str, fields: dict[str, Any], device: str, dtype: str,
          cuda: bool, k: int) -> dict[str, Any]:
    sysspec = parse_system(label)
    return {"system": sysspec.base, "label": label, "variant": dict(sysspec.variant), "size": size,
            "model": fields, "device": device, "dtype": dtype, "batch": settings.batch, "seq": settings.seq,
            "grad_accum": settings.grad_accum, "steps": settings.steps, "warmup": settings.warmup,
            "checkpointing": settings.checkpointing, "lr": settings.lr, "clip": settings.clip,
            "seed": settings.seed, "trace": settings.trace, "cap_bytes": settings.cap_bytes if cuda else None,
            "nvme_dir": os.path.join(settings.nvme_dir, f"{_file_name(label)}-{size}"),
            "deepspeed": settings.deepspeed, "pyinfinity_overrides": settings.pyinfinity, "lora": settings.lora,
            "master_port": 29500 + (os.getpid() + k) % 2000, "timeout": settings.timeout,
            "megatrain_src": settings.megatrain_src}


def check_configs(settings: Settings, fields: dict[str, Any], device: str, dtype: str, cuda: bool) -> None:
    """Builds every run's config before anything runs: a variant's key that does not fit the config's
    shape is an error here, and so is one pyinfinity's config rejects (its own message, naming the
    key). DeepSpeed checks its config when the run starts: its error is that run's row."""
    from pyinfinity.bench.train_worker import pyinfinity_config, system_config
    from pyinfinity.config import ConfigError, load_config

    for label in settings.systems:
        spec = _spec(settings, settings.sizes[0], label, fields, device, dtype, cuda, 0)
        try:
            system_config(spec)
            if spec["system"].startswith("pyinfinity"):
                load_config(pyinfinity_config(spec))
        except (ConfigError, ValueError) as exc:
            hint = " (with --dtype bf16, or leave --dtype auto)" if "requires bf16.enabled" in str(exc) else ""
            raise BenchTrainError(f"--systems {label}: {exc}{hint}") from exc


def step_shapes(settings: Settings, fields: dict[str, dict[str, Any]], device: str, dtype: str,
                rates: dict[str, Any], matmul: dict[str, float]) -> dict[str, Settings]:
    """Per size, ``settings`` at the micro-batch x accumulation the pyinfinity planner chooses for
    ``settings.tokens_per_step`` (``plan.step_shape.choose_step_shape``: its placement with every
    key "auto", the rates this invocation measured, the device's whole free memory or the cap),
    every system then running that shape; the batch or accumulation the user gave kept."""
    from pyinfinity.layout.charges import TrainShape
    from pyinfinity.plan.budgets import measure_budgets
    from pyinfinity.probes import preset_rates
    from pyinfinity.plan.sizes import llama_sizes
    from pyinfinity.plan.step_shape import choose_step_shape

    cuda = device.startswith("cuda")
    if cuda:
        import torch

        torch.cuda.empty_cache()  # the probes' blocks: the budget is what the workers will find free
    budgets = measure_budgets(device, (settings.nvme_dir,), device_memory=settings.cap_bytes if cuda else None)
    out: dict[str, Settings] = {}
    for size in settings.sizes:
        r = preset_rates(device, matmul=matmul[size], adam=rates["adam"])
        r.h2d, r.d2h = rates["h2d"], rates["d2h"]
        if rates.get("disk_read") and rates.get("disk_write"):
            r.disk_read, r.disk_write = rates["disk_read"], rates["disk_write"]
        sizes = llama_sizes(dict(fields[size], model_type="llama"), dtype=dtype)
        train = TrainShape(seq_len=settings.seq, overlap_step="auto", norm_first=settings.clip > 0)
        if not cuda:
            train.activation_bytes = 0  # the CPU device: activations are host RAM, not the device pool
        try:
            shape = choose_step_shape(sizes, train, budgets, r, settings.tokens_per_step, nvme_paths=(settings.nvme_dir,),
                                      micro_batch=settings.batch if "batch" in settings.step_fixed else None,
                                      grad_accum=settings.grad_accum if "grad_accum" in settings.step_fixed else None,
                                      checkpointing=settings.checkpointing)
        except ValueError as exc:  # PlanError included: one line naming what does not fit
            raise BenchTrainError(f"--tokens-per-step {settings.tokens_per_step} at {size}: {exc}") from None
        print(f"  {size}: {shape.describe()} (planned for pyinfinity-auto: "
              f"{shape.placement.predicted.breakdown()})", flush=True)
        out[size] = replace(settings, batch=shape.micro_batch, grad_accum=shape.grad_accum)
    return out


def run_bench(settings: Settings, json_path: Optional[str]) -> dict[str, Any]:
    """Measures the rates, runs every (size, system) pair, appends to ``json_path``; returns the data."""
    from pyinfinity.bench.machine import machine_info

    for label in settings.systems:
        parse_system(label)  # unknown systems and malformed variants, before anything runs
    twice = sorted({s for s in settings.systems if settings.systems.count(s) > 1})
    if twice:
        raise BenchTrainError(f"--systems: {', '.join(twice)} given twice")
    if not settings.sizes or not settings.systems:
        raise BenchTrainError("nothing to run: --sizes and --systems must name at least one each")
    if settings.steps <= settings.warmup:
        raise BenchTrainError(f"--steps {settings.steps} must exceed --warmup {settings.warmup} (the timed "
                              "steps come after the warm-up ones)")
    if settings.grad_accum < 1:
        raise BenchTrainError(f"--grad-accum: {settings.grad_accum} is below 1")
    device, dtype = _resolve(settings)
    cuda = device.startswith("cuda")
    if not cuda and settings.cap_bytes:
        log.info("no GPU: the device-memory cap does not apply (the CPU is the compute device)")
    fields = {s: model_fields(s, settings.seq) for s in settings.sizes}
    check_configs(settings, fields[settings.sizes[0]], device, dtype, cuda)
    data = load_results(json_path)
    os.makedirs(settings.nvme_dir, exist_ok=True)
    log_dir = settings.log_dir or tempfile.mkdtemp(prefix="pyinfinity-bench-train-")
    os.makedirs(log_dir, exist_ok=True)
    micro_tokens = settings.batch * settings.seq
    print(f"bench train: device {device}, {dtype}, "
          + (f"{settings.tokens_per_step:,} tokens a step (micro-batch x accumulation planned per size)"
             if settings.tokens_per_step else f"batch {settings.batch} x {settings.seq} tokens"
             + (f" x {settings.grad_accum} micro-batches a step" if settings.grad_accum > 1 else ""))
          + (f", LoRA r={settings.lora['r']} on {','.join(settings.lora['targets'])} (frozen base)"
             if settings.lora else "")
          + f", {settings.steps} steps ({settings.warmup} warm-up), cap "
          f"{gib(settings.cap_bytes) if settings.cap_bytes and cuda else 'none'}, swap {settings.nvme_dir}, "
          f"logs {log_dir}", flush=True)
    print("measuring rates for the bound (copies, disk, CPU Adam) ...", flush=True)
    rates = measure_bound_rates(device, settings.nvme_dir)
    matmul: dict[str, float] = {}
    for s in settings.sizes:
        matmul[s] = measure_matmul_rate(device, dtype, fields[s], micro_tokens)
    shapes = step_shapes(settings, fields, device, dtype, rates, matmul) if settings.tokens_per_step else {}
    print("  " + ", ".join([f"H2D {rates['h2d'] / 1e9:.1f} GB/s", f"D2H {rates['d2h'] / 1e9:.1f} GB/s",
                             f"disk read {rates['disk_read'] / 1e9:.2f} GB/s",
                             f"write {rates['disk_write'] / 1e9:.2f} GB/s",
                             f"CPU Adam {rates['adam'] / 1e9:.2f} Gparam/s"]
                            + [f"matmul[{s}] {v / 1e12:.1f} TFLOP/s" for s, v in matmul.items()]), flush=True)
    inv = {"date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
           "machine": asdict(machine_info(settings.nvme_dir)), "rates": dict(rates, matmul=matmul),
           "step_shapes": {k: {"batch": v.batch, "grad_accum": v.grad_accum} for k, v in shapes.items()},
           "settings": {k: v for k, v in asdict(settings).items() if k not in ("progress",)},
           "device": device, "dtype": dtype, "argv": sys.argv[1:]}
    data["invocations"].append(inv)
    inv_index = len(data["invocations"]) - 1
    if json_path:
        save_results(json_path, data)
    pairs = plan_runs(settings)
    base = settings
    from tqdm import tqdm

    bar = tqdm(total=len(pairs), unit="run", disable=not settings.progress, file=sys.stderr, dynamic_ncols=True)
    try:
        for k, (size, system) in enumerate(pairs):
            settings = shapes.get(size, base)  # the size's planned micro-batch x accumulation
            tokens = settings.batch * settings.seq * settings.grad_accum  # per optimizer step
            facts = size_facts(fields[size], dtype, settings.batch * settings.grad_accum, settings.seq,
                               settings.checkpointing, settings.lora)
            bar.set_description(f"{size} {system}")
            spec = _spec(settings, size, system, fields[size], device, dtype, cuda, k)
            fmt, state_bytes = optimizer_state(spec)
            need = _disk_need(system, facts, state_bytes)
            free = shutil.disk_usage(settings.nvme_dir).free
            probes: list[dict[str, Any]] = []
            if need and need > free:
                res = {"system": system, "size": size, "ok": False, "params": facts["params"],
                       "error": f"not run: its tiers need {gib(need)} on disk, {gib(free)} free at "
                                f"{settings.nvme_dir} (give --nvme a bigger drive, or leave this size out)"}
            else:
                os.makedirs(spec["nvme_dir"], exist_ok=True)
                log_path = os.path.join(log_dir, f"{size}-{_file_name(system)}.log")

                def on_line(line: str, _bar: Any = bar) -> None:
                    if line.startswith("step "):
                        _bar.set_postfix_str(line[:60])

                if uses_disk(system):  # the disk's rates right before and right after the run
                    probes.append(probe_disk(settings.nvme_dir))
                res = run_one(spec, settings.timeout, log_path, on_line)
                if uses_disk(system):
                    probes.append(probe_disk(settings.nvme_dir))
                shutil.rmtree(spec["nvme_dir"], ignore_errors=True)
            res["system"] = system  # the label, variant included
            res["base_system"] = spec["system"]
            if spec["variant"]:
                res["variant"] = spec["variant"]
            res["invocation"] = inv_index
            res["batch"], res["seq"], res["dtype"], res["device"] = settings.batch, settings.seq, dtype, device
            res["grad_accum"], res["tokens_per_step"] = settings.grad_accum, tokens
            res["checkpointing"] = settings.checkpointing
            if settings.lora:
                res["lora"], res["trainable_params"] = settings.lora, facts["trainable"]
            # the analytic count, the same for every system of a size; the worker's own count beside it
            res["params_counted"] = res.get("params")
            res["params"] = facts["params"]
            res["flops_per_step"] = facts["flops_per_step"]
            if res.get("ok"):
                _summarise(res, settings.warmup, tokens, facts)
            rr = dict(rates, matmul=matmul[size])
            if probes:
                res["disk_probes"] = probes
                rr.update(best_disk_rates(*probes))
            res["optimizer_state_bytes"] = state_bytes
            rr[adam_rate_key(fmt)] = adam_rate_for(rates, fmt)
            if cuda and int((res.get("placement") or {}).get("optimizer_device_numel", 0)):
                rr[device_adam_key(fmt)] = device_adam_rate_for(rates, fmt, device)
            res["bound"] = bound(system, facts, rr, cuda, res.get("placement"), state_bytes, fmt)
            res["bound"]["rates"] = {k: rr[k] for k in ("disk_read", "disk_write")}
            if res.get("step_seconds"):
                res["step_over_bound"] = res["step_seconds"] / res["bound"]["seconds"]
                res["below_bound"] = res["step_over_bound"] < 1.0
            data["runs"].append(res)
            compare_to_best_deepspeed(data["runs"], inv_index)
            if json_path:
                save_results(json_path, data)
            bar.update(1)
            tqdm.write(one_line(res), file=sys.stdout)
    finally:
        bar.close()
    return data


__all__ = ["Settings", "run_bench", "run_one", "plan_runs", "check_configs",
           # from train_matrix, train_bound and train_report, importable from here as before
           "SCHEMA", "DEFAULT_SIZES_GPU", "DEFAULT_SIZES_CPU", "DEFAULT_SYSTEMS", "DEFAULT_SYSTEMS_LORA",
           "PEERS", "DEEPSPEED_DEFAULTS", "lora_spec",
           "BenchTrainError", "SystemSpec", "parse_system", "parse_systems", "base_system", "model_fields", "size_facts",
           "tier_fractions", "bound", "optimizer_state", "optimizer_state_bytes",
           "measure_bound_rates", "probe_disk", "best_disk_rates",
           "uses_disk",
           "measure_matmul_rate", "load_results", "save_results", "latest_runs", "below_bound", "usable",
           "compare_to_best_deepspeed", "one_line", "HEADER", "table_rows", "rss_over_plan", "ratio_lines", "report",
           "plot"]
