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

from pyinfinity.cli.train_args import (add_arguments, apply_tokens_per_step, check_arguments, engine_config, exported_line,
                                       keep_saved_placement, mean, resume_status)
from pyinfinity.presets import preset

log = logging.getLogger(__name__)

VOCAB = 260  # 256 byte values + BOS/EOS/PAD and one spare
BOS, EOS = 256, 257



def add_parser(subparsers: Any, summary: str) -> None:
    p = subparsers.add_parser("train", help=summary,
                              description=__doc__)
    add_arguments(p)
    p.set_defaults(func=run)


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


class CorpusBatches:
    """The built-in corpus as the training loop's ``Batches``: the position is the number of
    batches drawn, and a resume draws as many again."""

    def __init__(self, batches: ByteBatches, grad_accum: int) -> None:
        self.batches, self.grad_accum = batches, grad_accum

    def next(self) -> tuple[Any, Any]:
        return next(self.batches)

    def state(self) -> dict:
        return {"batches_drawn": self.batches.drawn}

    def restore(self, client: dict, origin: str, global_steps: int) -> None:
        drawn = int(client.get("batches_drawn", global_steps * self.grad_accum))
        for _ in range(drawn):  # the data position of the saved run: the same windows come next
            next(self.batches)
        self.batches.drawn = drawn


def llama_config(args: argparse.Namespace) -> Any:
    from transformers import LlamaConfig

    fields = preset(args.model_size)  # its shape; the vocabulary is the corpus's
    hidden, layers = fields["hidden_size"], fields["num_hidden_layers"]
    heads, inter = fields["num_attention_heads"], fields["intermediate_size"]
    kv_heads = fields["num_key_value_heads"] if not (args.hidden or args.heads) else None
    hidden = args.hidden or hidden
    layers = args.layers or layers
    heads = args.heads or (heads if hidden % heads == 0 else max(1, hidden // 64))
    inter = args.intermediate or (inter if not args.hidden else int(hidden * 8 / 3 / 8) * 8)
    if hidden % heads:
        raise SystemExit(f"--heads: hidden {hidden} is not divisible by {heads} heads")
    return LlamaConfig(vocab_size=VOCAB, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
                       num_attention_heads=heads, num_key_value_heads=kv_heads or heads,
                       max_position_embeddings=max(2048, args.seq), rope_theta=fields.get("rope_theta", 10000.0),
                       bos_token_id=BOS, eos_token_id=EOS, pad_token_id=None, tie_word_embeddings=False,
                       use_cache=False)


def run(args: argparse.Namespace) -> int:
    resume_dir, resume_tag = check_arguments(args)  # every flag, before anything is built, read or imported
    done = resume_status(args, resume_dir, resume_tag) if resume_dir is not None else None
    if done:
        print(done)
        return 0
    import torch
    from transformers import LlamaForCausalLM

    import pyinfinity
    from pyinfinity.cli import train_loop
    from pyinfinity.config import format_size, parse_size

    if args.model or args.data:
        from pyinfinity.cli.finetune import run_finetune

        return run_finetune(args, (resume_dir, resume_tag))
    torch.manual_seed(args.seed)
    cfg, device = engine_config(args)
    mcfg = llama_config(args)
    apply_tokens_per_step(args, cfg, device, {**mcfg.to_dict(), "model_type": "llama"})
    t0 = time.perf_counter()
    with pyinfinity.init_empty(cfg):
        model = LlamaForCausalLM(mcfg)
    if args.checkpoint_activations:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if resume_dir is not None:
        cfg = keep_saved_placement(args, cfg, device, model, resume_dir, resume_tag)
    n_params = sum(p.numel() for p in model.parameters())
    log.info("model: Llama hidden %d, %d layers, %.1fM parameters", mcfg.hidden_size, mcfg.num_hidden_layers,
             n_params / 1e6)
    data = CorpusBatches(ByteBatches(stdlib_corpus(parse_size(args.corpus_bytes, "--corpus-bytes")), args.seq,
                                     args.batch, args.seed), args.grad_accum)
    from tqdm.contrib.logging import logging_redirect_tqdm

    with pyinfinity.initialize(model, cfg, seq_len=args.seq) as engine, logging_redirect_tqdm():
        engine.train()
        log.info("engine built in %.1fs", time.perf_counter() - t0)
        if resume_dir is not None:
            train_loop.resume(engine, args, data, resume_dir, resume_tag)
        result = train_loop.train(engine, args, data)
        records = result.records
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
            "overlap_fraction": mean([r.overlap_fraction for r in steady]),
            "optimizer_seconds": mean([r.optimizer_seconds for r in steady]),
            "step_seconds": mean([r.seconds for r in steady]),
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
        moved = bytes_moved_line(steady)
        if moved:
            print(moved)
        print(report.table())
        if args.save:
            train_loop.save(engine, args, data)
        if args.export:
            print(exported_line(args.export, engine.export(args.export), cfg))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"summary": summary, "steps": [asdict(r) for r in records], "config": cfg,
                       "memory": asdict(report), "saves": [{**{k: v for k, v in asdict(r).items() if k != "called_at"},
                                                            "blocked_s": r.blocked_s} for r in result.saves]}, f, indent=1, default=str)
    return 0


def bytes_moved_line(records: list) -> str:
    """Bytes moved per tier in one optimizer step (the mean over ``records``), one line; "" when
    nothing moved (everything stayed on the device)."""
    from pyinfinity.config import format_size

    total: dict[str, int] = {}
    for r in records:
        for k, v in (r.bytes_moved or {}).items():
            total[k] = total.get(k, 0) + int(v)
    parts = [f"{k} {format_size(v / len(records))}" for k, v in sorted(total.items()) if v]
    return f"bytes moved per step (mean of {len(records)}): " + ", ".join(parts) if parts else ""


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="train_oversized", description=__doc__)
    parser.add_argument("-v", "--verbose", action="store_true")
    add_arguments(parser)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO,
                        format="%(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    return run(args)
