"""`pyinfinity train --model DIR --data FILE`: fine-tune a transformers model directory (config,
safetensors, tokenizer) on a text or JSON-lines file, the weights streamed into the tiers."""
from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from dataclasses import asdict
from typing import Any, Optional

from pyinfinity.cli import train_loop
from pyinfinity.cli.train_args import (add_arguments, apply_tokens_per_step, check_arguments, engine_config, exported_line,
                                       keep_saved_placement, lora_config, mean)

log = logging.getLogger(__name__)


def _model_dtype(path: str, choice: Optional[str], lora: bool) -> Any:
    import torch

    from pyinfinity.pretrained import checkpoint_dtype

    if choice is None:  # a frozen base keeps the checkpoint's dtype; a full fine-tune trains in fp32
        choice = "auto" if lora else "fp32"
    if choice == "auto":
        return checkpoint_dtype(path)
    return {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[choice]


def _peak_rss() -> int:
    """The process's peak resident set (VmHWM), bytes."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


class TextBatches:
    """``TextData`` as the training loop's ``Batches`` (the labels are the inputs: the model shifts
    them); the position is the data's epoch and index."""

    def __init__(self, data: Any, batch: int) -> None:
        self.data, self.batch = data, batch

    def next(self) -> tuple[Any, Any]:
        x = self.data.next_batch(self.batch)
        return x, x

    def state(self) -> dict:
        return {"data": self.data.state_dict()}

    def restore(self, client: dict, origin: str, global_steps: int) -> None:
        if "data" not in client:
            raise SystemExit(f"--resume: {origin} has no data position (it was not saved by a --model/--data run)")
        self.data.load_state_dict(client["data"], origin=origin)


def eval_loss(engine: Any, data: Any, batch: int) -> Optional[float]:
    """Mean loss over the held-out blocks (no gradients)."""
    import torch

    losses = []
    engine.eval()
    try:
        with torch.no_grad():
            for x in data.eval_batches(batch):
                x = x.to(engine.device)
                losses.append(float(engine(input_ids=x, labels=x).loss) * x.shape[0])
    finally:
        engine.train()
    return sum(losses) / data.eval.shape[0] if losses else None


def run_finetune(args: argparse.Namespace, resume: Optional[tuple[str, Optional[str]]] = None) -> int:
    """Fine-tunes ``args.model`` on ``args.data``; ``resume``: --resume's (save_dir, tag) from
    ``check_arguments`` (checked again here when it is not given)."""
    import torch

    import pyinfinity
    from pyinfinity.config import format_size
    from pyinfinity.data import TextData, load_tokenizer
    from pyinfinity.pretrained import build_empty_model

    if resume is None:
        resume = check_arguments(args)
    torch.manual_seed(args.seed)
    cfg, _device = engine_config(args)
    # the data first: a bad file fails before anything is loaded or written
    data = TextData.from_file(args.data, load_tokenizer(args.model), args.seq, field=args.data_field,
                              eval_fraction=args.eval_fraction, seed=args.seed)
    rss_before = _peak_rss()
    t0 = time.perf_counter()
    evals: list[dict] = []
    lora = args.lora is not None or args.adapter is not None
    dtype = _model_dtype(args.model, args.model_dtype, lora)
    if lora:
        from pyinfinity.adapters import build_peft_model

        model, weights = build_peft_model(args.model, cfg, dtype, peft_config=lora_config(args), adapter=args.adapter)
    else:
        model, weights = build_empty_model(args.model, cfg, dtype), args.model
    apply_tokens_per_step(args, cfg, _device, model)
    if args.checkpoint_activations:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if resume[0] is not None:
        cfg = keep_saved_placement(args, cfg, _device, model, *resume)
    engine = pyinfinity.initialize(model, cfg, weights=weights, seq_len=args.seq)
    load_s = time.perf_counter() - t0
    peak_load = _peak_rss()
    log.info("loaded %s in %.1fs (%s of weights), peak RSS %s", args.model, load_s,
             format_size(engine.partition.nbytes), format_size(peak_load))
    batches = TextBatches(data, args.batch)
    with engine:
        engine.train()
        if resume[0] is not None:
            train_loop.resume(engine, args, batches, *resume)

        def after_step(rec: Any) -> None:
            if args.eval_every and engine.global_steps % args.eval_every == 0:
                evals.append({"step": engine.global_steps, "loss": eval_loss(engine, data, args.batch)})
                log.info("step %d eval loss %.4f", engine.global_steps, evals[-1]["loss"])

        result = train_loop.train(engine, args, batches, after_step)
        records, timed = result.records, result.timed
        if not evals or evals[-1]["step"] != engine.global_steps:
            evals.append({"step": engine.global_steps, "loss": eval_loss(engine, data, args.batch)})
        steady = timed[1:] or timed
        summary = {
            "model": args.model, "data": args.data, "params": engine.partition.numel,
            "param_bytes_compute": engine.partition.nbytes, "device": str(engine.device),
            "load_seconds": load_s, "peak_rss_before_load": rss_before, "peak_rss_load": peak_load, "peak_rss": _peak_rss(),
            "steps": len(records), "global_steps": engine.global_steps,
            "first_loss": records[0].loss if records else None, "last_loss": records[-1].loss if records else None,
            "eval_loss": evals[-1]["loss"], "evals": evals,
            "tokens_per_s": sum(n for n, _ in steady) / max(1e-9, sum(t for _, t in steady)),
            "step_seconds": mean([t for _, t in steady]),
            "weights_missing": engine.weights.report.missing, "weights_unexpected": engine.weights.report.unexpected,
        }
        print(f"fine-tuned {args.model} ({format_size(engine.partition.nbytes)} of weights, loaded in {load_s:.1f}s, "
              f"peak RSS {format_size(peak_load)}) for {len(records)} steps: loss "
              f"{summary['first_loss'] if records else float('nan'):.3f} -> "
              f"{summary['last_loss'] if records else float('nan'):.3f}, eval loss "
              f"{'n/a' if summary['eval_loss'] is None else format(summary['eval_loss'], '.3f')}, "
              f"{summary['tokens_per_s']:.0f} tokens/s")
        if args.save:
            train_loop.save(engine, args, batches)
        if args.export:
            print(exported_line(args.export, engine.export(args.export, merge_adapters=args.merge_adapters), cfg))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"summary": summary, "steps": [asdict(r) for r in records], "config": cfg}, f, indent=1,
                      default=str)
    return 0


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="finetune", description=__doc__)
    add_arguments(parser)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    return run_finetune(args)


if __name__ == "__main__":
    sys.exit(main())
