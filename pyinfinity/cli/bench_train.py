"""`pyinfinity bench train`: pyinfinity vs DeepSpeed (ZeRO-3 and ZeRO-2 offload) vs plain PyTorch,
training the same Llama-architecture models on the same data under the same device-memory cap.

Every (size, system) pair runs in its own process; results are appended to --json, so the matrix
can be measured over several sessions and reported together (--report-only redraws the table and
the plot from the file). Each run's measured step time is set against an analytic bound
(max of compute, PCIe, disk and CPU Adam time at rates measured in the same invocation); a run
below its bound is flagged and its figure enters no ratio. pyinfinity runs are set against the
fastest DeepSpeed configuration of the same invocation ("vs best DS").
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import sys
import tempfile
from typing import Any, Optional

from pyinfinity.bench.train import (DEEPSPEED_DEFAULTS, DEFAULT_SIZES_CPU, DEFAULT_SIZES_GPU, DEFAULT_SYSTEMS,
                                    DEFAULT_SYSTEMS_LORA, BenchTrainError, Settings, load_results, lora_spec,
                                    parse_systems, plot, report, run_bench)
from pyinfinity.bench.train_worker import SYSTEMS, ZERO_OFFLOAD
from pyinfinity.presets import NAMES

EPILOG = f"""
systems: {', '.join(SYSTEMS)}
  pyinfinity-cpu / deepspeed-cpu         parameters and optimizer states in RAM
  pyinfinity-nvme / deepspeed-nvme       parameters in RAM, optimizer states on --nvme
  pyinfinity-nvme-params / deepspeed-nvme-params  parameters on --nvme, optimizer states in RAM
  pyinfinity-nvme-all / deepspeed-nvme-all  both on --nvme
  pyinfinity-auto                        the planner decides (only what does not fit in RAM goes to disk)
  deepspeed-z2-cpu                       ZeRO-2 with offload_optimizer cpu (ZeRO-Offload): parameters and
                                         gradients on the GPU, optimizer states and Adam on the CPU
  deepspeed-z3-gpu-params                ZeRO-3 with offload_param none: parameters on the GPU, optimizer on the CPU
  torch                                  plain PyTorch under the cap (the smallest size only, unless --torch-all-sizes)
  torch-nocap                            plain PyTorch without the cap (the compute reference; weights, gradients
                                         and AdamW state in the run's dtype: 8 bytes a parameter in bf16)
  torch-fp32master                       plain PyTorch without the cap, fp32 weights (the master), gradients and
                                         AdamW state, the compute in --dtype under autocast (16 bytes a parameter)
  megatrain                              MegaTrain (github.com/DLYuanGod/MegaTrain) run by its own training script
                                         from a checkout (--megatrain-src or $PYINFINITY_MEGATRAIN_SRC) on a model
                                         directory and an arrow dataset written from the bench's shape and tokens:
                                         its Llama-3-8B recipe (checkpoint every 4 layers, DeepSpeed CPU Adam, lr
                                         2e-5, clipping 1.0) with sdpa attention, bf16 weights and gradients in RAM;
                                         the step's sequences in one batch up to its recipe's 148 x 1024 tokens; no
                                         device cap (it takes the whole GPU); megatrain[memory.checkpoint_interval=2]
                                         sets a key of its recipe. "TFLOPS 6ND" in the JSON is its kind of figure
variants: SYSTEM[KEY=VALUE,...] sets dotted config keys in that system's config, e.g.
  pyinfinity-auto[resident_bytes=0]  deepspeed-z2-cpu[bf16.bf16_optimizer_states=true]
  (values are JSON where they parse, else strings; a pyinfinity key outside the config's top-level
  sections is a key of its "pyinfinity" section; the full name labels the run; plain torch has none)
sizes: {', '.join(NAMES)} (pyinfinity.presets), or a Llama config.json path
DeepSpeed settings (defaults: DeepSpeed ZeRO-3 offload as commonly configured for one GPU):
  {json.dumps(DEEPSPEED_DEFAULTS)}
ZeRO-Offload settings of deepspeed-z2-cpu (DeepSpeed's ZeRO and ZeRO-Offload tutorials; deepspeed-z3-gpu-params
takes overlap_comm, contiguous_gradients and reduce_bucket_size from it):
  {json.dumps(ZERO_OFFLOAD)}
"""


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="pyinfinity bench train", description=__doc__, epilog=EPILOG,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", help=f"comma-separated sizes, smallest first (default: {','.join(DEFAULT_SIZES_GPU)} "
                                   f"with a GPU, {','.join(DEFAULT_SIZES_CPU)} without)")
    p.add_argument("--systems",
                   help="comma-separated systems, each optionally SYSTEM[KEY=VALUE,...] (default: "
                        f"{','.join(DEFAULT_SYSTEMS)}; with --lora: {','.join(DEFAULT_SYSTEMS_LORA)})")
    p.add_argument("--lora", type=int, metavar="R",
                   help="every system trains PEFT LoRA adapters of rank R (alpha 2R) on a frozen base in --dtype "
                        "(the adapters fp32, as PEFT makes them): the step is bound by streaming the frozen weights "
                        "through the GPU, forward and backward, against compute")
    p.add_argument("--lora-targets", metavar="NAMES",
                   help="with --lora: the layers that get adapters, comma-separated (q_proj,v_proj: PEFT's default "
                        "for Llama) or all-linear")
    p.add_argument("--nvme", metavar="DIR", help="swap directory for the nvme tiers (default: a temp dir under "
                                                 "$PYINFINITY_SWAP_DIR or /tmp; removed per run)")
    p.add_argument("--gpu-memory", default="8GiB", metavar="SIZE|none",
                   help="device-memory cap (torch's per-process memory fraction, and pyinfinity's budget); none = "
                        "no cap, the whole device (default: %(default)s)")
    p.add_argument("--device", default="auto", help="cuda, cuda:N, cpu or auto")
    p.add_argument("--batch", type=int, help="micro-batch size (default: 4; with --tokens-per-step the planner's)")
    p.add_argument("--seq", type=int, default=1024, help="sequence length (default: %(default)s)")
    p.add_argument("--tokens-per-step", type=int, metavar="N",
                   help="tokens an optimizer step, every system: the pyinfinity planner chooses the micro-batch (the "
                        "largest-throughput one that fits the device beside its placement; the accumulation is "
                        "N / (micro-batch x seq), rounded up) for each size, unless --batch or --grad-accum fixes "
                        "it; --batch and --grad-accum given with it must multiply out to N")
    p.add_argument("--grad-accum", type=int, metavar="N",
                   help="micro-batches per optimizer step, every system (torch included); s/step and tokens/s "
                        "are per optimizer step of N x batch x seq tokens (default: 1; with --tokens-per-step the "
                        "planner's)")
    p.add_argument("--steps", type=int, default=5, help="optimizer steps per run, warm-up included "
                                                        "(default: %(default)s)")
    p.add_argument("--warmup", type=int, default=2, help="untimed first steps (default: %(default)s)")
    p.add_argument("--dtype", default="auto", choices=["auto", "bf16", "fp16", "fp32"],
                   help="auto: bf16 on a GPU, fp32 on the CPU unless a system's variant asks for a bf16 master "
                        "(bf16.bf16_master_weights_and_grads), which needs bf16 compute")
    p.add_argument("--no-checkpointing", action="store_true", help="keep activations (default: recompute them)")
    p.add_argument("--clip", type=float, default=0.0, metavar="NORM",
                   help="gradient clipping to this global norm for every system (default: 0 = off)")
    p.add_argument("--no-trace", action="store_true", help="skip the extra traced step (the timeline)")
    p.add_argument("--timeout", type=float, default=1800, help="seconds per run before it is killed")
    p.add_argument("--torch-all-sizes", action="store_true", help="run plain torch at every size")
    p.add_argument("--ds", action="append", default=[], metavar="KEY=VALUE",
                   help="a DeepSpeed setting (repeatable): prefetch_bucket_size, max_live_parameters, "
                        "param_persistence_threshold, buffer_count, buffer_size, max_in_cpu, pipeline, "
                        "optimizer_buffer_count, aio.block_size, aio.queue_depth, aio.intra_op_parallelism, ...")
    p.add_argument("--pyinfinity", action="append", default=[], metavar="KEY=VALUE",
                   help="an extra pyinfinity.* config key for the pyinfinity runs (repeatable), e.g. prefetch=false")
    p.add_argument("--megatrain-src", metavar="DIR", default=os.environ.get("PYINFINITY_MEGATRAIN_SRC"),
                   help="a MegaTrain checkout for --systems megatrain (default: $PYINFINITY_MEGATRAIN_SRC); "
                        "its SFT script needs datasets and deepspeed importable; BENCHMARKS.md says how to set it up")
    p.add_argument("--json", metavar="FILE", help="results file; runs are appended (created if missing)")
    p.add_argument("--plot", metavar="PNG", help="throughput vs size per system, and one step's timeline")
    p.add_argument("--timeline", metavar="SYSTEM@SIZE", help="the run whose traced step --plot draws "
                                                             "(default: the largest pyinfinity run)")
    p.add_argument("--markdown", metavar="FILE", help="also write the table as Markdown")
    p.add_argument("--report-only", action="store_true", help="run nothing: table and plot from --json")
    p.add_argument("--log-dir", metavar="DIR",
                   help="keep each run's log there (default: a temp dir, removed at the end)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("-v", "--verbose", action="store_true")
    return p


def _value(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def _apply(dst: dict, items: list[str], flag: str, known: Optional[dict] = None) -> None:
    for item in items:
        key, sep, val = item.partition("=")
        if not sep or not key:
            raise BenchTrainError(f"{flag} {item!r}: expected KEY=VALUE")
        parts = key.split(".")
        d = dst
        if known is not None:
            k = known
            for part in parts:
                if not isinstance(k, dict) or part not in k:
                    raise BenchTrainError(f"{flag} {key}: unknown setting; known: "
                                          + ", ".join(_flat_keys(known)))
                k = k[part]
        for part in parts[:-1]:
            d = d.setdefault(part, {})
        d[parts[-1]] = _value(val)


def _flat_keys(d: dict, prefix: str = "") -> list[str]:
    out = []
    for k, v in d.items():
        out.extend(_flat_keys(v, f"{prefix}{k}.") if isinstance(v, dict) else [f"{prefix}{k}"])
    return out


def settings_from_args(a: argparse.Namespace) -> Settings:
    from pyinfinity.config import ConfigError, device_budget
    from pyinfinity.plan.step_shape import step_shape_refusal

    try:
        cap = device_budget(a.gpu_memory, "--gpu-memory")
    except ConfigError as exc:
        raise BenchTrainError(str(exc)) from None
    if a.sizes:
        sizes = [s.strip() for s in a.sizes.split(",") if s.strip()]
    else:
        import torch

        gpu = a.device.startswith("cuda") or (a.device == "auto" and torch.cuda.is_available())
        sizes = list(DEFAULT_SIZES_GPU if gpu else DEFAULT_SIZES_CPU)
    fixed = {k for k in ("batch", "grad_accum") if getattr(a, k) is not None}
    tps = a.tokens_per_step
    if tps is not None:
        if tps < 1:
            raise BenchTrainError(f"--tokens-per-step: {tps} is below 1")
        why = step_shape_refusal(tps, a.seq, a.batch, a.grad_accum)
        if why:
            raise BenchTrainError(why)
    batch = a.batch if a.batch is not None else 4
    grad_accum = a.grad_accum if a.grad_accum is not None else 1
    for name, v, lo in (("--batch", batch, 1), ("--seq", a.seq, 2), ("--steps", a.steps, 1),
                        ("--grad-accum", grad_accum, 1),
                        ("--warmup", a.warmup, 0), ("--clip", a.clip, 0)):
        if v < lo:
            raise BenchTrainError(f"{name}: {v} is below {lo}")
    if a.timeout <= 0:
        raise BenchTrainError(f"--timeout: {a.timeout} must be positive")
    if a.lora_targets is not None and a.lora is None:
        raise BenchTrainError("--lora-targets: needs --lora R (the rank of the adapters)")
    lora = lora_spec(a.lora, a.lora_targets) if a.lora is not None else None
    if lora is not None:
        import importlib.util

        if importlib.util.find_spec("peft") is None:
            raise BenchTrainError("--lora: needs the peft package (pip install peft)")
    systems = parse_systems(a.systems or ",".join(DEFAULT_SYSTEMS_LORA if lora else DEFAULT_SYSTEMS))
    # temporary directories last, once the flags are known good; main() removes them (made_dirs)
    nvme = a.nvme or _temp_dir(a, dir=os.environ.get("PYINFINITY_SWAP_DIR") or None)
    log_dir = a.log_dir or _temp_dir(a)
    s = Settings(sizes=sizes, systems=systems, nvme_dir=nvme, grad_accum=grad_accum, tokens_per_step=tps,
                 step_fixed=sorted(fixed), device=a.device, cap_bytes=cap, batch=batch, seq=a.seq, steps=a.steps, warmup=a.warmup,
                 dtype=a.dtype, checkpointing=not a.no_checkpointing, trace=not a.no_trace, timeout=a.timeout,
                 clip=a.clip,
                 torch_sizes="all" if a.torch_all_sizes else "smallest", log_dir=log_dir,
                 progress=not a.no_progress, lora=lora, megatrain_src=a.megatrain_src)
    _apply(s.deepspeed, a.ds, "--ds", known=DEEPSPEED_DEFAULTS)
    _apply(s.pyinfinity, a.pyinfinity, "--pyinfinity")
    return s


def _temp_dir(a: argparse.Namespace, dir: Optional[str] = None) -> str:
    d = tempfile.mkdtemp(prefix="pyinfinity-bench-train-", dir=dir)
    a.made_dirs.append(d)
    return d


def main(argv: Optional[list[str]] = None) -> int:
    a = build_parser().parse_args(argv)
    a.made_dirs = []  # temporary swap and log directories, removed at the end whatever happens
    logging.basicConfig(level=logging.DEBUG if a.verbose else logging.INFO,
                        format="%(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    try:
        if a.report_only:
            if not a.json or not os.path.exists(a.json):
                raise BenchTrainError("--report-only needs --json FILE with earlier results")
            data = load_results(a.json)
        else:
            try:
                data = run_bench(settings_from_args(a), a.json)
            finally:
                for d in a.made_dirs:
                    shutil.rmtree(d, ignore_errors=True)
        print()
        print(report(data))
        if a.markdown:
            with open(a.markdown, "w") as f:
                f.write(report(data, markdown=True) + "\n")
        if a.plot:
            drawn = plot(data, a.plot, a.timeline)
            print(f"plot: {a.plot}" + (f" (timeline: {drawn})" if drawn else " (no traced run for a timeline)"))
        if a.json:
            print(f"results: {a.json}")
    except BenchTrainError as exc:
        print(f"pyinfinity bench train: {exc}", file=sys.stderr)
        return 2
    runs = data["runs"]
    return 0 if runs else 1
