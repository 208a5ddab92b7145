"""`pyinfinity train`: train a Llama-architecture model (random init from a transformers
LlamaConfig; nothing is downloaded) on the Python standard library's own source files as
byte-level tokens, with parameters and optimizer states offloaded to RAM or NVMe."""
from __future__ import annotations

import argparse
import glob
import json
import logging
import os
import sys
import sysconfig
import time
from dataclasses import asdict
from typing import Any, Optional

from pyinfinity.cli.finetune import add_finetune_arguments, run_finetune

log = logging.getLogger(__name__)

VOCAB = 260  # 256 byte values + BOS/EOS/PAD and one spare
BOS, EOS = 256, 257

# name -> (hidden, layers, heads, intermediate)
PRESETS = {
    "tiny": (128, 4, 4, 344),
    "small": (256, 8, 8, 688),
    "medium": (512, 12, 8, 1376),
    "125m": (768, 12, 12, 2048),
    "350m": (1024, 24, 16, 2816),
    "1b": (2048, 16, 16, 5504),
    "3b": (2560, 32, 32, 6912),
    "5b": (4096, 24, 32, 11008),  # bf16 weights ~9.8 GB: more than an 8 GiB device budget
    "7b": (4096, 32, 32, 11008),
    "13b": (5120, 40, 40, 13824),
}


def add_parser(subparsers: Any) -> None:
    p = subparsers.add_parser("train", help="train a Llama model on the stdlib's sources, offloaded",
                              description=__doc__)
    add_arguments(p)
    p.set_defaults(func=run)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model-size", default="tiny", choices=sorted(PRESETS),
                   help="preset (hidden, layers, heads, intermediate); --hidden/--layers override")
    p.add_argument("--hidden", type=int, help="hidden size")
    p.add_argument("--layers", type=int, help="decoder layers")
    p.add_argument("--heads", type=int, help="attention heads")
    p.add_argument("--intermediate", type=int, help="MLP intermediate size")
    p.add_argument("--steps", type=int, default=20, help="optimizer steps")
    p.add_argument("--seq", type=int, default=256, help="sequence length (bytes)")
    p.add_argument("--batch", type=int, default=4, help="micro-batch size")
    p.add_argument("--grad-accum", type=int, default=1, help="gradient accumulation steps")
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--clip", type=float, default=1.0, metavar="NORM",
                   help="gradient clipping to this global norm (0: off, which lets the optimizer step "
                        "overlap backward, pyinfinity.overlap_step)")
    p.add_argument("--warmup", type=int, default=5, help="WarmupCosineLR warm-up steps")
    p.add_argument("--offload", default="auto", choices=["none", "cpu", "nvme", "auto"],
                   help="where parameters and optimizer states live (nvme needs --nvme)")
    p.add_argument("--offload-optimizer", choices=["cpu", "nvme", "auto"],
                   help="optimizer-state tier if different from --offload")
    p.add_argument("--optimizer-nvme-ratio", type=float, default=1.0, metavar="R",
                   help="with the optimizer on nvme: the fraction of its state on disk (the rest in RAM)")
    p.add_argument("--optimizer-step", default="cpu", choices=["cpu", "device"],
                   help="run the Adam step on the CPU, or stream the states to the device and step there")
    p.add_argument("--nvme", action="append", metavar="DIR",
                   help="swap directory (repeat to stripe over several drives)")
    p.add_argument("--device", default="auto", help="compute device: cpu, cuda, cuda:N or auto")
    p.add_argument("--gpu-memory", "--device-memory", dest="device_memory", default="auto",
                   help="device memory budget, e.g. 8GiB (auto: measured)")
    p.add_argument("--dtype", default="auto", choices=["auto", "fp32", "bf16", "fp16"],
                   help="compute dtype (auto: bf16 on a GPU, fp32 on the CPU)")
    p.add_argument("--checkpoint-activations", action="store_true", help="recompute activations in backward")
    p.add_argument("--no-prefetch", action="store_true", help="fetch every shard on demand")
    p.add_argument("--corpus-bytes", default="16MB", help="how much of the stdlib sources to read")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--save", metavar="DIR", help="save a checkpoint there at the end (DIR/global_stepN, "
                                                 "DIR/latest names the newest)")
    p.add_argument("--save-every", type=int, default=0, metavar="N",
                   help="with --save: also save a checkpoint every N optimizer steps")
    p.add_argument("--resume", metavar="DIR",
                   help="continue the run saved there (a --save directory, or one of its global_stepN): "
                        "the step count, LR schedule, optimizer state and data position carry on; give the "
                        "same flags as the first run")
    p.add_argument("--export", metavar="DIR", help="export the trained weights (safetensors) there")
    p.add_argument("--json", metavar="FILE", help="write the run's telemetry as JSON")
    p.add_argument("--no-progress", action="store_true",
                   help="no progress bar (it is off anyway when stderr is not a terminal, e.g. a log file)")
    add_finetune_arguments(p)


def stdlib_corpus(max_bytes: int) -> bytes:
    """The Python standard library's .py files, concatenated (sorted, so runs are repeatable)."""
    root = sysconfig.get_paths()["stdlib"]
    files = sorted(glob.glob(os.path.join(root, "**", "*.py"), recursive=True))
    files = [f for f in files if "site-packages" not in f]
    out, n = [], 0
    for f in files:
        try:
            with open(f, "rb") as fh:
                data = fh.read()
        except OSError:
            continue
        out.append(data)
        n += len(data)
        if n >= max_bytes:
            break
    if not out:
        raise RuntimeError(f"no .py files found under the stdlib at {root!r}")
    return b"\n".join(out)[:max_bytes]


class ByteBatches:
    """Random windows of the corpus as (input_ids, labels) of shape (batch, seq)."""

    def __init__(self, corpus: bytes, seq: int, batch: int, seed: int) -> None:
        import numpy as np
        import torch

        self.data = torch.from_numpy(np.frombuffer(corpus, dtype=np.uint8).astype(np.int64))
        if self.data.numel() < seq + 2:
            raise ValueError(f"--seq: {seq} is longer than the corpus ({self.data.numel()} bytes)")
        self.seq, self.batch = seq, batch
        self.gen = torch.Generator().manual_seed(seed)
        self.drawn = 0  # batches returned so far (a checkpoint records it, --resume skips as many)

    def __next__(self) -> tuple[Any, Any]:
        import torch

        self.drawn += 1
        starts = torch.randint(0, self.data.numel() - self.seq - 1, (self.batch,), generator=self.gen)
        x = torch.stack([self.data[s:s + self.seq] for s in starts.tolist()])
        return x, x.clone()

    def __iter__(self) -> "ByteBatches":
        return self


def llama_config(args: argparse.Namespace) -> Any:
    from transformers import LlamaConfig

    hidden, layers, heads, inter = PRESETS[args.model_size]
    hidden = args.hidden or hidden
    layers = args.layers or layers
    heads = args.heads or (heads if hidden % heads == 0 else max(1, hidden // 64))
    inter = args.intermediate or (inter if not args.hidden else int(hidden * 8 / 3 / 8) * 8)
    if hidden % heads:
        raise SystemExit(f"--heads: hidden {hidden} is not divisible by {heads} heads")
    return LlamaConfig(vocab_size=VOCAB, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
                       num_attention_heads=heads, num_key_value_heads=heads, max_position_embeddings=max(2048, args.seq),
                       bos_token_id=BOS, eos_token_id=EOS, pad_token_id=None, tie_word_embeddings=False,
                       use_cache=False)


def build_config(args: argparse.Namespace, device: str) -> dict:
    opt_tier = args.offload_optimizer or ("cpu" if args.offload == "none" else args.offload)
    nvme = args.nvme
    if "nvme" in (args.offload, opt_tier) and not nvme:
        raise SystemExit("--nvme: a swap directory is needed with --offload nvme")
    dtype = args.dtype
    if dtype == "auto":
        dtype = "bf16" if device.startswith("cuda") else "fp32"
    cfg: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": args.batch,
        "gradient_accumulation_steps": args.grad_accum,
        "gradient_clipping": args.clip,
        "optimizer": {"type": "AdamW", "params": {"lr": args.lr, "betas": [0.9, 0.95], "weight_decay": 0.1}},
        "scheduler": {"type": "WarmupCosineLR", "params": {"total_num_steps": max(args.steps, args.warmup),
                                                           "warmup_num_steps": args.warmup,
                                                           "warmup_type": "linear"}},
        "zero_optimization": {
            "stage": 3,
            "offload_param": {"device": args.offload, "max_in_cpu": 0},
            "offload_optimizer": {"device": opt_tier, "ratio": args.optimizer_nvme_ratio},
            "stage3_prefetch_bucket_size": "auto",
            "stage3_param_persistence_threshold": "auto",
        },
        "pyinfinity": {"device": device, "device_memory": args.device_memory, "prefetch": not args.no_prefetch,
                       "log_every": max(1, args.steps // 10),
                       "optimizer_step_device": args.optimizer_step},
    }
    if nvme:
        cfg["zero_optimization"]["offload_param"]["nvme_path"] = nvme
        cfg["zero_optimization"]["offload_optimizer"]["nvme_path"] = nvme
    if dtype == "bf16":
        cfg["bf16"] = {"enabled": True}
    elif dtype == "fp16":
        cfg["fp16"] = {"enabled": True}
    return cfg


def run(args: argparse.Namespace) -> int:
    import torch
    from tqdm import tqdm
    from transformers import LlamaForCausalLM

    import pyinfinity
    from pyinfinity.config import format_size, parse_size

    from pyinfinity.cli.errors import UsageError, check_device_here

    if args.model or args.data:
        return run_finetune(args)
    torch.manual_seed(args.seed)
    device = check_device_here(args.device)  # cuda and auto with the GPU's index
    for flag, value, low in (("--steps", args.steps, 1), ("--seq", args.seq, 1), ("--batch", args.batch, 1),
                             ("--grad-accum", args.grad_accum, 1), ("--warmup", args.warmup, 0),
                             ("--save-every", args.save_every, 0)):
        if value < low:
            raise UsageError(f"{flag}: {value} must be >= {low}")
    if args.clip < 0:
        raise UsageError(f"--clip: {args.clip} must be 0 (off) or positive")
    if args.save_every and not args.save:
        raise UsageError("--save-every: needs --save DIR (where to write the checkpoints)")
    resume_dir, resume_tag = _checkpoint_location(args.resume) if args.resume else (None, None)
    cfg = build_config(args, device)
    mcfg = llama_config(args)
    t0 = time.perf_counter()
    with pyinfinity.init_empty(cfg):
        model = LlamaForCausalLM(mcfg)
    if args.checkpoint_activations:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    n_params = sum(p.numel() for p in model.parameters())
    log.info("model: Llama hidden %d, %d layers, %.1fM parameters", mcfg.hidden_size, mcfg.num_hidden_layers,
             n_params / 1e6)
    data = ByteBatches(stdlib_corpus(parse_size(args.corpus_bytes, "--corpus-bytes")), args.seq, args.batch,
                       args.seed)
    records = []
    from tqdm.contrib.logging import logging_redirect_tqdm

    from pyinfinity.engine import retry_micro_batch

    with pyinfinity.initialize(model, cfg) as engine, logging_redirect_tqdm():
        engine.train()
        log.info("engine built in %.1fs", time.perf_counter() - t0)
        if resume_dir is not None:
            path, client = engine.load_checkpoint(resume_dir, resume_tag)
            _check_resume_flags(path, client, args)
            drawn = int(client.get("batches_drawn", engine.global_steps * args.grad_accum))
            for _ in range(drawn):  # the data position of the saved run: the same windows come next
                next(data)
            data.drawn = drawn
            log.info("resumed %s at step %d of %d", path, engine.global_steps, args.steps)
            if engine.global_steps >= args.steps:
                log.warning("--resume: the checkpoint is at step %d, --steps is %d: nothing to train",
                            engine.global_steps, args.steps)
        # disable=None: no bar when stderr is not a terminal (a log file gets the log lines only)
        bar = tqdm(total=args.steps, initial=engine.global_steps, unit="step",
                   disable=True if args.no_progress else None, file=sys.stderr, dynamic_ncols=True)
        while engine.global_steps < args.steps:
            x, y = next(data)
            x, y = x.to(engine.device), y.to(engine.device)
            retry_micro_batch(lambda: engine.backward(engine(input_ids=x, labels=y).loss))
            rec = engine.step()
            if rec is not None:
                records.append(rec)
                bar.update(1)
                bar.set_postfix(loss=f"{rec.loss:.3f}", tok_s=f"{rec.tokens_per_s:.0f}",
                                peak=format_size(rec.peak_device_allocated or rec.peak_device_bytes),
                                overlap="n/a" if rec.overlap_fraction is None else f"{rec.overlap_fraction:.2f}")
                if args.save_every and engine.global_steps % args.save_every == 0 and engine.global_steps < args.steps:
                    engine.save_checkpoint(args.save, client_state={"batches_drawn": data.drawn, "flags": _run_flags(args)})
        bar.close()
        report = engine.memory_report()
        steady = records[1:] or records
        summary = {
            "params": n_params,
            "param_bytes_compute": engine.partition.nbytes,
            "device": str(engine.device),
            "device_budget": engine.device_memory,
            "steps": len(records),
            "first_loss": records[0].loss if records else None,
            "last_loss": records[-1].loss if records else None,
            "tokens_per_s": sum(r.tokens for r in steady) / max(1e-9, sum(r.seconds for r in steady)),
            "peak_device_bytes": max((r.peak_device_bytes for r in records), default=0),
            "peak_device_allocated": max((r.peak_device_allocated or 0 for r in records), default=0) or None,
            "overlap_fraction": _mean([r.overlap_fraction for r in steady]),
            "optimizer_seconds": _mean([r.optimizer_seconds for r in steady]),
            "step_seconds": _mean([r.seconds for r in steady]),
            "prefetch_hits": sum(r.prefetch_hits for r in records),
            "on_demand_fetches": sum(r.on_demand_fetches for r in records),
            "auto": {d.key: d.value for d in engine.auto_decisions},
        }
        ov = summary["overlap_fraction"]
        if records:
            print(f"trained {n_params / 1e6:.1f}M params ({format_size(engine.partition.nbytes)} of weights) on "
                  f"{engine.device} for {len(records)} steps: loss {summary['first_loss']:.3f} -> "
                  f"{summary['last_loss']:.3f}, {summary['tokens_per_s']:.0f} tokens/s, peak device "
                  f"{format_size(summary['peak_device_allocated'] or summary['peak_device_bytes'])}, overlap "
                  f"{'n/a' if ov is None else f'{ov:.2f}'}")
        print(report.table())
        if args.save:
            engine.save_checkpoint(args.save, client_state={"batches_drawn": data.drawn, "flags": _run_flags(args)})
        if args.export:
            engine.export(args.export)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"summary": summary, "steps": [asdict(r) for r in records], "config": cfg,
                       "memory": asdict(report)}, f, indent=1, default=str)
    return 0


RESUME_FLAGS = ("seed", "lr", "batch", "seq", "grad_accum", "warmup")  # what the data and schedule follow


def _run_flags(args: argparse.Namespace) -> dict:
    """The flags a --resume must repeat, as a checkpoint's client state records them."""
    return {k: getattr(args, k) for k in RESUME_FLAGS}


def _check_resume_flags(path: str, client: dict, args: argparse.Namespace) -> None:
    """A --resume with other data or schedule flags than the saved run would train on silently
    different batches and learning rates: refused, naming each flag."""
    from pyinfinity.cli.errors import UsageError

    saved = client.get("flags")
    if not isinstance(saved, dict):
        log.warning("--resume: %s does not record the run's flags; give the same --seed/--lr/--batch/--seq/"
                    "--grad-accum/--warmup as the first run", path)
        return
    now = _run_flags(args)
    diff = [f"--{k.replace('_', '-')} {now[k]} (the checkpoint's run: {saved.get(k)})"
            for k in RESUME_FLAGS if saved.get(k) != now[k]]
    if diff:
        raise UsageError(f"--resume: {path} was saved by a run with other flags: {'; '.join(diff)}; resume with "
                         "the same flags (a new run: leave out --resume)")


def _checkpoint_location(path: str) -> tuple[str, Optional[str]]:
    """(save_dir, tag) of a --resume argument: a --save directory (its ``latest``) or one tag in it."""
    from pyinfinity.cli.errors import UsageError

    path = os.path.abspath(path)
    if os.path.isfile(os.path.join(path, "meta.json")):
        return os.path.dirname(path), os.path.basename(path)
    if os.path.isfile(os.path.join(path, "latest")):
        return path, None
    raise UsageError(f"--resume: {path} is not a checkpoint (expected a --save directory holding 'latest', or "
                     "one of its global_stepN directories)")


def _mean(xs: list) -> Optional[float]:
    xs = [x for x in xs if x is not None]
    return sum(xs) / len(xs) if xs else None


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="train_oversized", description=__doc__)
    parser.add_argument("-v", "--verbose", action="store_true")
    add_arguments(parser)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO,
                        format="%(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    return run(args)
