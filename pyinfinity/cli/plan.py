"""`pyinfinity plan`: where a model's parameters, gradients and optimizer states should live under
the given budgets, every buffer's size, and the predicted step time with its bottleneck; writes
the resolved DeepSpeed-format config (every "auto" replaced) that `pyinfinity train` and
`pyinfinity.initialize` accept."""
from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from typing import Any, Optional

log = logging.getLogger(__name__)

ASSUMED_TARGET_CORES = 16
"""CPU cores assumed for a GPU machine that is not this one when no --cpu-cores is given (a GPU
server's share of cores per GPU): this machine's Adam rate is scaled to them, and the plan says so."""


def add_parser(subparsers: Any, summary: str) -> None:
    p = subparsers.add_parser("plan", help=summary,
                              description=__doc__)
    which = p.add_mutually_exclusive_group(required=True)
    which.add_argument("--model", metavar="CONFIG", help="a transformers config.json (or a directory holding one)")
    from pyinfinity.presets import NAMES

    which.add_argument("--model-size", choices=NAMES, metavar="SIZE",
                       help="a Llama shape from the preset table that `train --model-size` and `bench train "
                            "--sizes` take too (vocab 32000 but the small ones and 8b): " + ", ".join(NAMES)
                            + " (1.1b is TinyLlama's shape, 8b Llama-3-8B's, 30b LLaMA-30B's, 70b Llama-2-70B's)")
    p.add_argument("--config", metavar="JSON",
                   help="a DeepSpeed-format config whose \"auto\" values are decided (default: all auto)")
    p.add_argument("--gpu-memory", "--device-memory", dest="device_memory", default=None, metavar="SIZE|none",
                   help="device memory budget, e.g. 8GiB; none (the default) = the whole device, its free memory "
                        "measured; without --device it means --device cuda")
    p.add_argument("--cpu-memory", dest="host_memory", default=None,
                   help="host RAM budget the plan may fill, e.g. 51GiB for a machine with 64 GiB of RAM (default: "
                        "80%% of what is available here, leaving the rest to the system; give the target machine "
                        "the same headroom)")
    p.add_argument("--nvme", action="append", metavar="DIR", default=None,
                   help="swap directory (repeat to stripe over several drives); the plan never creates it")
    p.add_argument("--nvme-free", metavar="SIZE", default=None,
                   help="free space of each --nvme directory's drive on the target machine, e.g. 2TB (default: "
                        "measured here)")
    p.add_argument("--cpu-cores", type=int, metavar="N", default=None,
                   help="CPU cores of the target machine: the optimizer's threads, and this machine's Adam rate "
                        "scaled to them (default: this machine's; for a GPU not on this machine an assumed "
                        f"{ASSUMED_TARGET_CORES}, said so; a --rates file made on the target is better)")
    p.add_argument("--device", default=None,
                   help="compute device: cpu, cuda, cuda:N (default: cuda if present, or when --gpu-memory is "
                        "given); a GPU that is not on this machine is planned for from presets, never touched")
    p.add_argument("--micro-batch", type=int, default=None, help="micro-batch size (default: the config's, else 1)")
    p.add_argument("--grad-accum", type=int, default=None, help="gradient accumulation steps")
    p.add_argument("--tokens-per-step", type=int, default=None, metavar="N",
                   help="tokens an optimizer step: the planner chooses the micro-batch (the fastest it predicts that "
                        "fits beside the placement, the larger among ties), the accumulation (N / (micro-batch x "
                        "--seq-len), rounded up) and checkpointing, keeping --micro-batch, --grad-accum and "
                        "--checkpointing where given (the first two together must multiply out to N)")
    p.add_argument("--seq-len", "--seq", dest="seq_len", type=int, default=1024,
                   help="tokens per sequence (default 1024)")
    p.add_argument("--dtype", default="bf16", choices=["bf16", "fp16", "fp32"], help="compute dtype (default bf16)")
    p.add_argument("--optimizer-state", choices=["fp32", "8bit", "bf16"], default=None,
                   help="the optimizer state's format (default: the config's, else fp32): fp32 (exact, 12 bytes a "
                        "parameter beside the weights), 8bit (fp32 master, 8-bit moments: 6.03), bf16 (bf16 master "
                        "and moments: 6, as README and docs/optimizer_state.md count it; needs --dtype bf16)")
    p.add_argument("--checkpointing", action="store_true", help="activation checkpointing")
    p.add_argument("--rates", metavar="JSON",
                   help="measured rates: `pyinfinity bench io --json`, `pyinfinity tune -o` (aio settings "
                        "for the probe) or a file from --save-rates")
    p.add_argument("--save-rates", metavar="JSON", help="write the rates used here")
    from pyinfinity.plan.hardware import DISK_PRESETS, LINK_PRESETS

    p.add_argument("--link", choices=sorted(LINK_PRESETS), default=None,
                   help="host<->device link of the target machine, for figures --rates does not give: "
                        + "; ".join(f"{k} {v.h2d / 1e9:.0f} GB/s" for k, v in LINK_PRESETS.items())
                        + " (default for a GPU not on this machine: pcie4x16; else measured)")
    p.add_argument("--disk", choices=sorted(DISK_PRESETS), default=None,
                   help="swap drive class of the target machine: "
                        + "; ".join(f"{k} read {v.read / 1e9:g} / write {v.write / 1e9:g} GB/s"
                                    for k, v in DISK_PRESETS.items())
                        + " (default for a GPU not on this machine: nvme-gen4; else measured in --nvme)")
    p.add_argument("--tflops", type=float, default=None, metavar="N",
                   help="the target device's sustained matmul rate in TFLOP/s at --dtype (default: measured "
                        "here; 100 for a GPU not on this machine)")
    p.add_argument("--calibrate", choices=["auto", "on", "off"], default="auto",
                   help="time the model built with 1 and 2 layers on the device (resident) to predict compute "
                        "and activations instead of FLOPs / matmul rate (auto: on a GPU)")
    p.add_argument("--lora", type=int, metavar="R",
                   help="plan a LoRA run (PEFT adapters of rank R): the base is frozen, so it costs its stored copy "
                        "only (no gradient, fp32 master or Adam moments); those are the adapters' alone")
    p.add_argument("--lora-targets", metavar="NAMES",
                   help="with --lora: the layers that get adapters, comma-separated (e.g. q_proj,v_proj) or "
                        "all-linear (default: PEFT's default for the architecture)")
    p.add_argument("--out", "-o", metavar="JSON", help="write the resolved config here (default: print it)")
    p.add_argument("--json", metavar="FILE", help="write the placement (and prediction) as JSON")
    p.add_argument("--measure", type=int, default=0, metavar="STEPS",
                   help="then train the model (random init, random tokens) for STEPS optimizer steps with the "
                        "resolved config and print predicted vs measured step time (the first 2 are warm-up)")
    p.set_defaults(func=run)


def template(args: argparse.Namespace) -> dict:
    """The config to resolve: --config's, else one with every knob "auto"; the flags override."""
    if args.config:
        with open(args.config) as f:
            cfg = json.load(f)
    else:
        auto_sec = {"device": "auto", "buffer_count": "auto"}
        cfg = {
            "train_micro_batch_size_per_gpu": 1,
            "gradient_accumulation_steps": 1,
            "zero_optimization": {
                "stage": 3,
                "offload_param": {**auto_sec, "max_in_cpu": "auto", "pin_memory": True},
                "offload_optimizer": {"device": "auto", "pin_memory": True},
                "stage3_prefetch_bucket_size": "auto",
                "stage3_max_live_parameters": "auto",
                "stage3_param_persistence_threshold": "auto",
            },
            "pyinfinity": {"device": "auto", "device_memory": "auto", "host_memory": "auto"},
        }
    z = cfg.setdefault("zero_optimization", {"stage": 3})
    if args.nvme:
        for sec in ("offload_param", "offload_optimizer"):
            z.setdefault(sec, {"device": "auto"}).setdefault("nvme_path", args.nvme)
    e = cfg.setdefault("pyinfinity", {})
    if args.device_memory:
        e["device_memory"] = args.device_memory
    if args.host_memory:
        e["host_memory"] = args.host_memory
    if args.device:
        e["device"] = args.device
    elif args.device_memory:  # a GPU budget means a GPU: never plan it silently for the CPU
        e["device"] = "cuda"
    if args.micro_batch:
        cfg["train_micro_batch_size_per_gpu"] = args.micro_batch
        cfg.pop("train_batch_size", None)
    if args.grad_accum:
        cfg["gradient_accumulation_steps"] = args.grad_accum
        cfg.pop("train_batch_size", None)
    state_keys = {k: v for k, v in (cfg.get("bf16") or {}).items()
                  if k in ("bf16_master_weights_and_grads", "bf16_optimizer_states")}
    for key in ("bf16", "fp16"):
        cfg.pop(key, None)
    if args.dtype != "fp32" and getattr(args, "lora", None) is None:
        # (a LoRA run keeps each parameter's dtype, as `train --lora` does: the base --dtype's, adapters fp32)
        cfg[args.dtype] = {"enabled": True}
    if state_keys and args.optimizer_state is None:  # the config's bf16 state stays unless --optimizer-state says
        if args.dtype != "bf16" and any(state_keys.values()):
            from pyinfinity.cli.errors import UsageError

            raise UsageError(f"--dtype {args.dtype}: the config's bf16 optimizer state "
                             "(bf16.bf16_master_weights_and_grads) keeps the bf16 weights as the master; plan it with "
                             "--dtype bf16, or pass --optimizer-state fp32 or 8bit")
        if args.dtype == "bf16":
            cfg["bf16"].update(state_keys)
    if args.optimizer_state is not None:
        from pyinfinity.cli.train_args import set_optimizer_state

        set_optimizer_state(cfg, args.optimizer_state, "--optimizer-state")
    if args.cpu_cores and e.get("optimizer_threads", "auto") == "auto" and e.get("device") != "cpu":
        e["optimizer_threads"] = args.cpu_cores
    return cfg


def model_source(args: argparse.Namespace) -> Any:
    """--model's path, or --model-size's preset as a transformers config dict."""
    if args.model:
        return args.model
    from pyinfinity.presets import preset

    return {"model_type": "llama", **preset(args.model_size)}


def lora_sizes(model: Any, args: argparse.Namespace, unit_bytes: Optional[int] = None) -> Any:
    """The sizes of ``model`` (a config) with PEFT's LoRA adapters of rank ``--lora`` on it, built
    on the meta device: the base's shards frozen, the adapters' trainable."""
    import torch
    import transformers
    from peft import LoraConfig, get_peft_model

    from pyinfinity.layout.sizes import parse_dtype
    from pyinfinity.plan.sizes import load_model_config, sizes_from_module

    d = load_model_config(model)
    mcfg = transformers.AutoConfig.for_model(d.get("model_type", "llama"),
                                             **{k: v for k, v in d.items() if k != "model_type"})
    targets = args.lora_targets
    if targets is not None and targets != "all-linear":
        targets = [t.strip() for t in targets.split(",")]
    from pyinfinity.adapters import check_lora_targets

    with torch.device("meta"):  # the frozen base in --dtype, the adapters fp32 as PEFT makes them
        base = transformers.AutoModelForCausalLM.from_config(mcfg).to(parse_dtype(args.dtype))
        check_lora_targets(base, targets, "--lora-targets")
        wrapped = get_peft_model(base, LoraConfig(r=args.lora, target_modules=targets, task_type="CAUSAL_LM"))
    sizes = sizes_from_module(wrapped, None, unit_bytes)  # each shard in its own dtype, as a LoRA run computes
    sizes.source = f"{type(base).__name__} + LoRA r={args.lora} (meta)"
    return sizes


def check_arguments(args: argparse.Namespace) -> None:
    from pyinfinity.cli.errors import UsageError

    for flag, value in (("--micro-batch", args.micro_batch), ("--grad-accum", args.grad_accum),
                        ("--seq-len", args.seq_len), ("--cpu-cores", args.cpu_cores)):
        if value is not None and value < 1:
            raise UsageError(f"{flag}: {value} must be >= 1")
    if args.lora_targets is not None and args.lora is None:
        raise UsageError("--lora-targets: needs --lora R (the rank of the adapters planned for)")
    if args.lora is not None:
        if args.lora < 1:
            raise UsageError(f"--lora: {args.lora} must be >= 1")
        if args.measure:
            raise UsageError("--measure: trains a randomly initialised model, not a LoRA run: leave out --lora or "
                             "--measure")
        if args.lora_targets is not None and not all(t.strip() for t in args.lora_targets.split(",")):
            raise UsageError(f"--lora-targets: {args.lora_targets!r} has an empty name")
        try:
            import peft  # noqa: F401
        except ImportError:
            raise UsageError("--lora: needs the peft package (pip install peft)") from None
    if args.device_memory is not None:
        from pyinfinity.config import ConfigError, device_budget

        try:
            device_budget(args.device_memory, "--gpu-memory")
        except ConfigError as exc:
            raise UsageError(str(exc)) from None
    if args.tokens_per_step is not None:
        from pyinfinity.plan.step_shape import step_shape_refusal

        if args.tokens_per_step < 1:
            raise UsageError(f"--tokens-per-step: {args.tokens_per_step} must be >= 1")
        why = step_shape_refusal(args.tokens_per_step, args.seq_len, args.micro_batch, args.grad_accum,
                                 ("--tokens-per-step", "--seq-len", "--micro-batch", "--grad-accum"))
        if why:
            raise UsageError(why)
    if args.nvme_free is not None and not args.nvme:
        raise UsageError("--nvme-free: the free space of the target's swap drive needs the swap directory it "
                         "will be used as: pass --nvme DIR too")
    for flag, path in (("--model", args.model), ("--config", args.config), ("--rates", args.rates)):
        if path is not None and not os.path.exists(path):
            raise UsageError(f"{flag}: {path}: no such file")


def target_budgets(args: argparse.Namespace, cfg: Any, dev: Any) -> Any:
    """This machine's budgets, with the target's free swap space when --nvme-free gives it."""
    from dataclasses import replace

    from pyinfinity.config import parse_size
    from pyinfinity.plan.budgets import measure_budgets

    dm, hm = cfg.pyinfinity.device_memory, cfg.pyinfinity.host_memory
    b = measure_budgets(dev, cfg.nvme_paths, device_memory=dm if isinstance(dm, int) else None,
                        host_memory=hm if isinstance(hm, int) else None)
    if args.nvme_free is not None:
        free = parse_size(args.nvme_free, "--nvme-free")
        b.swap = [replace(d, free=free, fs_id=i + 1) for i, d in enumerate(b.swap)]  # one drive each
    return b


def _this_cpu_count() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def what_would_change_it(config_dict: dict, sizes: Any, budgets: Any, rates: Any, placement: Any,
                         args: argparse.Namespace) -> list[str]:
    """The predicted step with the resource that bounds it doubled (re-planned, so a placement
    the extra resource allows is taken): a few lines for the end of the plan."""
    from dataclasses import replace

    from pyinfinity.plan import resolve_auto
    from pyinfinity.plan.hardware import LINK_PRESETS

    bound = placement.predicted.bottleneck
    tries: list[tuple[str, Any, Any]] = []
    if bound == "disk":
        tries.append(("a second swap drive as fast (--nvme twice)",
                      replace(rates, disk_read=2 * rates.disk_read, disk_write=2 * rates.disk_write), budgets))
        tries.append(("twice the RAM budget (--cpu-memory)", rates, replace(budgets, host_memory=2 * budgets.host_memory)))
    elif bound == "optimizer":
        tries.append(("twice the CPU Adam rate (twice the cores, --cpu-cores)",
                      replace(rates, adam=2 * rates.adam, adam_8bit=2 * rates.adam_8bit, adam_bf16=2 * rates.adam_bf16),
                      budgets))
    elif bound == "host<->device":
        faster = sorted((v.h2d, k) for k, v in LINK_PRESETS.items() if v.h2d > rates.h2d * 1.05)
        if faster:
            lp = LINK_PRESETS[faster[0][1]]
            tries.append((f"the next link preset, --link {faster[0][1]}",
                          replace(rates, h2d=lp.h2d, d2h=lp.d2h, h2d_pageable=lp.h2d_pageable), budgets))
    elif bound == "compute":
        tries.append(("a device twice as fast (--tflops)", replace(rates, matmul=2 * rates.matmul), budgets))
    if not budgets.device_is_host:  # on the CPU device, its "device memory" is a share of the same RAM
        tries.append(("twice the device memory (--gpu-memory)", rates,
                      replace(budgets, device_memory=2 * budgets.device_memory)))
    now = placement.predicted.total
    lines = [f"what would change this plan (bound by {bound}, {now:.3f} s/step):"]
    quiet = logging.getLogger("pyinfinity")  # the what-if plans' own INFO lines are not the user's plan
    level = quiet.level
    quiet.setLevel(max(level, logging.WARNING))
    try:
        for what, r, b in tries:
            try:
                _, p = resolve_auto(config_dict, sizes, budgets=b, rates=r, seq_len=args.seq_len,
                                    checkpointing=args.checkpointing, fill_absent=True)
            except ValueError as exc:
                lines.append(f"  {what}: no plan ({exc})")
                continue
            t = p.predicted.total
            lines.append(f"  {what}: {t:.3f} s/step ({now / t:.2f}x), then bound by {p.predicted.bottleneck}")
    finally:
        quiet.setLevel(level)
    return lines


def step_shape_config(cfg_dict: dict, cfg: Any, sizes: Any, budgets: Any, rates: Any,
                      args: argparse.Namespace) -> tuple[dict, Any]:
    """--tokens-per-step: the micro-batch, accumulation and checkpointing the planner chooses
    (``plan.step_shape.choose_step_shape``), written into the config (and ``args.checkpointing``);
    the config dict and its parsed form back. One line on stderr names the shape."""
    from pyinfinity.cli.errors import UsageError
    from pyinfinity.config import load_config
    from pyinfinity.layout.charges import PlanError
    from pyinfinity.plan.resolve import planned_fixed, planned_train_shape
    from pyinfinity.plan.step_shape import choose_step_shape

    train = planned_train_shape(cfg, args.seq_len, args.checkpointing)
    if budgets.device_is_host:
        train.activation_bytes = 0  # the CPU device: activations live in host RAM, not its pool
    try:
        shape = choose_step_shape(sizes, train, budgets, rates, args.tokens_per_step, planned_fixed(cfg),
                                  list(cfg.nvme_paths), micro_batch=args.micro_batch, grad_accum=args.grad_accum,
                                  checkpointing=True if args.checkpointing else None)
    except PlanError as exc:
        raise UsageError(f"--tokens-per-step {args.tokens_per_step}: {exc}") from None
    out = json.loads(json.dumps(cfg_dict))
    out["train_micro_batch_size_per_gpu"] = shape.micro_batch
    out["gradient_accumulation_steps"] = shape.grad_accum
    out.pop("train_batch_size", None)
    args.checkpointing = shape.checkpointing
    print(f"--tokens-per-step {args.tokens_per_step}: {shape.describe()}", file=sys.stderr)
    return out, load_config(json.loads(json.dumps(out)))


def throughput_line(params: int, tokens_per_step: int, step_seconds: float, device: Any) -> str:
    """What the predicted step means: tokens/s, and the model FLOPs utilisation (6 x parameters x
    tokens/s over the device's bf16 peak) where ``device`` is a CUDA device here whose peak
    ``plan.hardware.BF16_PEAKS`` lists."""
    from pyinfinity.plan.hardware import bf16_peak, model_flops_utilisation

    tps = tokens_per_step / step_seconds if step_seconds > 0 else 0.0
    line = f"  expected: {tps:,.0f} tokens/s ({tokens_per_step:,} tokens a step in {step_seconds:.3f} s)"
    name = None
    if device is not None and getattr(device, "type", None) == "cuda":
        import torch

        name = torch.cuda.get_device_name(device)
    peak = bf16_peak(name) if name else None
    if peak and tps:
        mfu = model_flops_utilisation(params, tps, peak)
        line += f"; model FLOPs utilisation {mfu:.0%} of the {name}'s bf16 peak {peak / 1e12:.0f} TFLOP/s"
    else:
        line += "; model FLOPs utilisation not given (" + (f"no bf16 peak known for {name}" if name else
                                                           "not a CUDA device on this machine") + ")"
    return line


def run(args: argparse.Namespace) -> int:
    check_arguments(args)  # before the planner (and torch) is imported
    from pyinfinity.config import ConfigError, load_config
    from pyinfinity.plan import resolve_auto
    from pyinfinity.probes import measure_rates
    from pyinfinity.plan.resolve import (aio_options, compute_dtype, decide_unit_bytes, engine_optimizer_threads,
                                         planned_device)
    from pyinfinity.plan.sizes import sizes_from_config

    from pyinfinity.plan.rates import device_is_here

    cfg_dict = template(args)
    cfg = load_config(json.loads(json.dumps(cfg_dict)))
    dev = planned_device(cfg, None)
    here = device_is_here(dev)
    if not here and (args.device_memory is None or cfg.pyinfinity.device_memory is None):
        raise ConfigError(f"--gpu-memory{' none' if args.device_memory else ''}: planning for {dev}, which is not on "
                          "this machine, needs the target's device memory budget (e.g. --gpu-memory 80GiB)")
    if not here and args.calibrate == "on":
        raise ConfigError(f"--calibrate on: times the model on {dev}, which is not on this machine "
                          "(leave it auto, or pass --tflops)")
    if not here and args.measure:
        raise ConfigError(f"--measure: trains on {dev}, which is not on this machine")
    model = model_source(args)
    sizes = lora_sizes(model, args) if args.lora is not None else sizes_from_config(model, args.dtype)
    if decide_unit_bytes(cfg, sizes):  # "auto": as the engine decides it; the file carries it, the units recounted
        unit_bytes = int(cfg.pyinfinity.unit_bytes)
        cfg_dict.setdefault("pyinfinity", {})["unit_bytes"] = unit_bytes
        sizes = (lora_sizes(model, args, unit_bytes) if args.lora is not None
                 else sizes_from_config(model, args.dtype, unit_bytes))
    cores = args.cpu_cores or (None if here else ASSUMED_TARGET_CORES)  # the target's, when it is not this one
    tokens = cfg.train_micro_batch_size_per_gpu * args.seq_len
    m = sizes.hidden or 1024
    rates = measure_rates(dev, cfg.nvme_paths[0] if cfg.nvme_paths else None, rates_file=args.rates,
                          aio=aio_options(cfg), matmul_shape=(min(tokens, 8192), m, m),
                          dtype=compute_dtype(cfg) or __import__("torch").float32, link=args.link,
                          disk=args.disk, matmul=args.tflops * 1e12 if args.tflops else None,
                          # the engine's optimizer threads here; every core when scaled to --cpu-cores
                          optimizer_threads=engine_optimizer_threads(cfg.pyinfinity, dev)
                          if here and not cores else None,
                          optimizer_state=cfg.optimizer_state_format)
    for key in ("adam", "adam_8bit", "adam_bf16"):
        if cores and getattr(rates, key) and rates.source.get(key, "").startswith("probe"):
            here_cores = _this_cpu_count()
            setattr(rates, key, getattr(rates, key) * cores / here_cores)
            to = (f"--cpu-cores {cores}" if args.cpu_cores else
                  f"an assumed {cores} cores of the target (no --cpu-cores given)")
            rates.source[key] = (f"probe on this machine's {here_cores} cores, scaled to {to} (linear: an estimate; "
                                 "a --rates file made on the target replaces it)")
    if not rates.shard_overhead:
        rates.shard_overhead, rates.shard_step_overhead = measure_engine_overhead(dev if here else "cpu")
        rates.source["shard_overhead"] = rates.source["shard_step_overhead"] = (
            "probe" if here else "probe on this machine's CPU")
    if args.save_rates:
        rates.save(args.save_rates)
    budgets = target_budgets(args, cfg, dev)
    if args.tokens_per_step is not None:
        cfg_dict, cfg = step_shape_config(cfg_dict, cfg, sizes, budgets, rates, args)
    compute_s = acts = None
    if here and (args.calibrate == "on" or (args.calibrate == "auto" and dev.type == "cuda")):
        from pyinfinity.probes import measure_decoder_compute
        from pyinfinity.layout.sizes import parse_dtype
        from pyinfinity.plan.sizes import load_model_config

        compute_s, acts = measure_decoder_compute(
            load_model_config(model), dev, cfg.train_micro_batch_size_per_gpu, args.seq_len,
            parse_dtype(args.dtype), args.checkpointing)
        acts = acts or None
        print(f"calibrated: forward+backward {compute_s:.3f} s per micro-batch"
              + (f", activations {acts / 1e9:.2f} GB" if acts else ""), file=sys.stderr)
    resolved, placement = resolve_auto(cfg_dict, sizes, budgets=budgets, rates=rates, seq_len=args.seq_len,
                                       checkpointing=args.checkpointing, fill_absent=True,
                                       compute_seconds=compute_s, activation_bytes=acts)
    if cores and not args.cpu_cores and resolved.get("pyinfinity", {}).get("optimizer_threads") is not None:
        resolved["pyinfinity"]["optimizer_threads"] = "auto"  # every CPU of the target, not this machine's count
    if "buffer_size" not in (cfg_dict.get("zero_optimization", {}).get("offload_param") or {}):
        # a DeepSpeed knob pyinfinity does not use: not written unless the given config had it
        (resolved.get("zero_optimization", {}).get("offload_param") or {}).pop("buffer_size", None)
    print(f"model: {sizes.source}, {sizes.numel:,} parameters ({sizes.numel / 1e9:.2f} B), "
          f"{len(sizes.shard_numels)} shards, compute dtype {args.dtype}; micro-batch "
          f"{cfg.train_micro_batch_size_per_gpu} x {args.seq_len} tokens x {cfg.gradient_accumulation_steps} "
          f"accumulation{', checkpointing' if args.checkpointing else ''}; device {dev}")
    print(f"rates{'' if here else f' (planning for {dev}, which is not on this machine: nothing was run on it)'}:"
          f"\n{rates.describe_sources(cfg.optimizer_state_format)}")
    mine = [k for k, v in rates.source.items() if "this machine" in v]
    if mine and not here:
        print(f"  {', '.join(mine)}: this machine's, not the target's. For the target's own rates run there "
              f"`pyinfinity plan {'--model CONFIG' if args.model else f'--model-size {args.model_size}'} "
              "--nvme DIR --save-rates rates.json` and pass --rates rates.json here")
    print(placement.table())
    print(throughput_line(sizes.numel, cfg.train_micro_batch_size_per_gpu * args.seq_len
                          * cfg.gradient_accumulation_steps, placement.predicted.total, dev if here else None))
    if cores and not args.cpu_cores:
        print(f"  note: the target's CPU cores are assumed ({cores}; pass --cpu-cores N): they set its Adam rate, "
              "and the config leaves pyinfinity.optimizer_threads \"auto\" (every CPU there)")
    if args.host_memory:
        from pyinfinity.config import format_size
        from pyinfinity.plan.budgets import HOST_FRACTION

        print(f"  note: --cpu-memory {args.host_memory} is the host RAM budget the plan may fill, all of it; the "
              f"default keeps {1 - HOST_FRACTION:.0%} of the available RAM for the system: for a machine with "
              f"{args.host_memory} of RAM, plan with --cpu-memory {format_size(budgets.host_memory * HOST_FRACTION)}")
    text = json.dumps(resolved, indent=2) + "\n"
    if args.out:
        tmp = args.out + ".tmp"
        with open(tmp, "w") as f:
            f.write(text)
        os.replace(tmp, args.out)
        print(f"wrote {args.out}", file=sys.stderr)
    else:
        sys.stdout.write(text)
    # after the config: it ends the output a person reads (the config goes to -o or a pipe)
    print("\n".join(what_would_change_it(cfg_dict, sizes, budgets, rates, placement, args)),
          file=sys.stdout if args.out else sys.stderr)
    result: dict[str, Any] = {"placement": placement.to_json(), "rates": rates.to_json(), "config": resolved}
    if args.measure:
        result["measured"] = measure(resolved, args, placement.predicted.total, args.measure)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0


def measure_engine_overhead(device: Any, shards: int = 24, steps: int = 5) -> tuple[float, float]:
    """(seconds per shard per forward+backward, per shard per optimizer step) of the engine's own
    bookkeeping on ``device``: a chain of tiny linear layers (negligible compute), cpu tier."""
    import statistics

    import torch

    import pyinfinity

    dev = torch.device(device)
    model = torch.nn.Sequential(*[torch.nn.Linear(8, 8) for _ in range(shards)])
    cfg = {"train_micro_batch_size_per_gpu": 1,
           "zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"}, "offload_optimizer": {"device": "cpu"},
                                 "stage3_param_persistence_threshold": 0, "stage3_prefetch_bucket_size": 1 << 20},
           "pyinfinity": {"device": str(dev), "device_memory": 64 << 20, "log_every": 1 << 30}}
    x = torch.randn(4, 8, device=dev)
    sync = (lambda: torch.cuda.synchronize(dev)) if dev.type == "cuda" else (lambda: None)
    quiet = logging.getLogger("pyinfinity")  # the probe engine's INFO lines are not the user's run
    level = quiet.level
    quiet.setLevel(max(level, logging.WARNING))
    try:
        with pyinfinity.initialize(model, cfg) as eng:
            fb, st = _time_engine(eng, x, sync, steps)
    finally:
        quiet.setLevel(level)
    return statistics.median(fb) / shards, statistics.median(st) / shards


def _time_engine(eng: Any, x: Any, sync: Any, steps: int) -> tuple[list[float], list[float]]:
    import time

    fb: list[float] = []
    st: list[float] = []
    for i in range(2 + steps):
        sync()
        t0 = time.perf_counter()
        eng.backward(eng(x).square().mean())
        sync()
        t1 = time.perf_counter()
        eng.step()
        sync()
        if i >= 2:
            fb.append(t1 - t0)
            st.append(time.perf_counter() - t1)
    return fb, st


def measure(resolved: dict, args: argparse.Namespace, predicted: float, steps: int) -> dict[str, Any]:
    """Trains the model with the resolved config and prints predicted vs measured s/step."""
    import statistics
    import time

    import torch
    import transformers

    import pyinfinity
    from pyinfinity.plan.sizes import load_model_config

    d = load_model_config(model_source(args))
    hf = transformers.AutoConfig.for_model(d.get("model_type", "llama"),
                                           **{k: v for k, v in d.items() if k != "model_type"})
    hf.use_cache = False
    with pyinfinity.init_empty(resolved):
        model = transformers.AutoModelForCausalLM.from_config(hf)
    if args.checkpointing:
        model.gradient_checkpointing_enable()
    mb = int(resolved.get("train_micro_batch_size_per_gpu", 1))
    gas = int(resolved.get("gradient_accumulation_steps", 1))
    times: list[float] = []
    gen = torch.Generator().manual_seed(0)
    with pyinfinity.initialize(model, resolved) as eng:
        eng.train()
        cuda = eng.device.type == "cuda"
        for i in range(steps):
            xs = [torch.randint(0, hf.vocab_size, (mb, args.seq_len), generator=gen).to(eng.device) for _ in range(gas)]
            if cuda:
                torch.cuda.synchronize(eng.device)
            t0 = time.perf_counter()
            for x in xs:
                out = eng(input_ids=x, labels=x)
                eng.backward(out.loss)
                eng.step()
            if cuda:
                torch.cuda.synchronize(eng.device)
            times.append(time.perf_counter() - t0)
            print(f"step {i}: {times[-1]:.3f} s, loss {float(out.loss):.4f}", file=sys.stderr)
        rep = eng.memory_report()
    steady = times[2:] if len(times) > 2 else times
    med = statistics.median(steady)
    res = {"step_s": times, "steady_median_s": med, "predicted_s": predicted, "ratio": predicted / med,
           "tokens_per_s": mb * gas * args.seq_len / med, "device_peak": rep.device_peak,
           "device_allocated_peak": rep.device_allocated_peak, "params": rep.params, "optimizer": rep.optimizer}
    print(f"predicted {predicted:.3f} s/step, measured {med:.3f} s/step (median of {len(steady)}; "
          f"predicted/measured {predicted / med:.2f}), {res['tokens_per_s']:,.0f} tokens/s, "
          f"params {rep.params}, optimizer {rep.optimizer}")
    print("RESULT " + json.dumps(res), flush=True)
    return res
