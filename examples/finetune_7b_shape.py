"""Fine-tune a 7B-shaped Llama checkpoint that does not fit the device: the whole user path, measured.

    python examples/finetune_7b_shape.py --dir /mnt/nvme0/llama7b --swap /mnt/nvme0/swap \\
        --gpu-memory 8GiB --steps 5 --json finetune_7b.json

1. Writes a random-weight checkpoint of the Llama-2-7B shape (hidden 4096, 32 layers, vocab 32000)
   to ``--dir`` as sharded bf16 safetensors with an index, its config.json and a byte-level BPE
   tokenizer trained on the data file (one layer's tensors in RAM at a time). Skipped when
   ``--dir`` already holds one.
2. Runs ``pyinfinity train --model DIR --data FILE`` in a fresh process (so its peak RSS is the
   load's and the training's alone): the weights streamed into the tiers, a few steps, an
   eval loss, ``--export``.
3. Prints load time, peak RSS and tokens/s and writes them with the run's summary to ``--json``.

``--hidden/--layers/--intermediate/--vocab`` shrink the shape for a dry run on a small machine.
Disk and RAM at the 7B shape (bf16 weights, fp32 optimizer state): checkpoint 13.5 GB, parameter
swap 13.5 GB, export 13.5 GB, optimizer state 81 GB (on disk by ``--optimizer-nvme-ratio``, the
rest in RAM), fp32 gradients 27 GB of RAM; choose the ratio so that both fit.
The data file defaults to the Python standard library's sources written into ``--dir``.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import subprocess
import sys
import time

log = logging.getLogger("finetune_7b_shape")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dir", required=True, help="where the checkpoint is written (a local disk)")
    p.add_argument("--swap", required=True, help="pyinfinity's swap directory (NVMe)")
    p.add_argument("--data", help="text file to fine-tune on (default: the stdlib's sources, written into --dir)")
    p.add_argument("--data-bytes", type=int, default=8 << 20, help="size of the default data file")
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--intermediate", type=int, default=11008)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--shard-bytes", type=int, default=2 << 30, help="safetensors file size of the checkpoint")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--checkpoint-activations", action="store_true",
                   help="recompute activations in backward (7B under 8 GiB beyond about 1 x 800 tokens needs it)")
    p.add_argument("--gpu-memory", default="8GiB", help="device memory cap")
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="auto", choices=["auto", "fp32", "bf16"])
    p.add_argument("--offload", default="nvme", choices=["cpu", "nvme", "auto"])
    p.add_argument("--offload-optimizer", choices=["cpu", "nvme", "auto"],
                   help="optimizer-state tier if not --offload (7B: 84 GB of fp32 master + Adam moments)")
    p.add_argument("--optimizer-nvme-ratio", type=float, default=1.0,
                   help="with the optimizer on nvme: the share of its state on disk (the rest in RAM)")
    p.add_argument("--model-dtype", default="auto", choices=["auto", "fp32", "bf16"],
                   help="dtype the model is built and exported in (auto: the checkpoint's, bf16)")
    p.add_argument("--export", help="export directory (default: DIR-finetuned)")
    p.add_argument("--no-export", action="store_true", help="skip the export")
    p.add_argument("--json", required=True, help="where the measurements are written")
    return p.parse_args(argv)


def write_data(path: str, nbytes: int) -> None:
    from pyinfinity.cli.train import stdlib_corpus

    with open(path, "wb") as f:
        f.write(stdlib_corpus(nbytes))


def write_tokenizer(out: str, data: str, vocab: int) -> int:
    """A byte-level BPE of at most ``vocab`` tokens trained on the first MiBs of ``data``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=["<s>", "</s>"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    with open(data, encoding="utf-8", errors="replace") as f:
        text = f.read(4 << 20)
    tok.train_from_iterator([text[i:i + 65536] for i in range(0, len(text), 65536)], trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>")
    fast.save_pretrained(out)
    return len(fast)


def write_checkpoint(args: argparse.Namespace, data: str) -> float:
    """Random bf16 weights (std 0.02, norms 1) of the configured shape as sharded safetensors; one
    tensor generated at a time, a file's tensors held until it is written. Returns seconds."""
    import torch
    from safetensors.torch import save_file
    from transformers import LlamaConfig, LlamaForCausalLM

    t0 = time.perf_counter()
    os.makedirs(args.dir, exist_ok=True)
    n_tok = write_tokenizer(args.dir, data, args.vocab)
    cfg = LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.intermediate,
                      num_hidden_layers=args.layers, num_attention_heads=args.heads, num_key_value_heads=args.heads,
                      max_position_embeddings=max(4096, args.seq), bos_token_id=0, eos_token_id=1,
                      tie_word_embeddings=False, torch_dtype="bfloat16", use_cache=False)
    assert n_tok <= args.vocab
    with torch.device("meta"):
        shapes = {k: tuple(v.shape) for k, v in LlamaForCausalLM(cfg).state_dict().items()}
    gen_device = "cuda" if torch.cuda.is_available() else "cpu"
    g = torch.Generator(device=gen_device).manual_seed(0)
    files: list[list[str]] = [[]]
    size = 0
    for k, shape in shapes.items():
        nb = 2 * int(torch.Size(shape).numel())
        if files[-1] and size + nb > args.shard_bytes:
            files.append([])
            size = 0
        files[-1].append(k)
        size += nb
    weight_map = {}
    for i, keys in enumerate(files):
        name = f"model-{i + 1:05d}-of-{len(files):05d}.safetensors"
        tensors = {}
        for k in keys:
            if k.endswith("norm.weight"):
                tensors[k] = torch.ones(shapes[k], dtype=torch.bfloat16)
            else:
                t = torch.empty(shapes[k], dtype=torch.bfloat16, device=gen_device).normal_(0, 0.02, generator=g)
                tensors[k] = t.cpu()
            weight_map[k] = name
        save_file(tensors, os.path.join(args.dir, name), metadata={"format": "pt"})
        log.info("wrote %s (%d tensors)", name, len(keys))
        del tensors
    total = sum(2 * int(torch.Size(s).numel()) for s in shapes.values())
    with open(os.path.join(args.dir, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=1)
    cfg.save_pretrained(args.dir)  # last: its presence marks a complete checkpoint
    return time.perf_counter() - t0


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    args = parse_args(argv)
    os.makedirs(args.dir, exist_ok=True)
    data = args.data or os.path.join(args.dir, "data.txt")
    if not args.data and not os.path.exists(data):
        write_data(data, args.data_bytes)
    build_s = None
    if not os.path.exists(os.path.join(args.dir, "config.json")):
        build_s = write_checkpoint(args, data)
        log.info("checkpoint written in %.0fs", build_s)
    export = None if args.no_export else (args.export or args.dir.rstrip("/") + "-finetuned")
    run_json = args.json + ".run.json"
    cmd = [sys.executable, "-m", "pyinfinity", "train", "--model", args.dir, "--data", data, "--steps",
           str(args.steps), "--seq", str(args.seq), "--batch", str(args.batch), "--offload", args.offload,
           "--nvme", args.swap, "--gpu-memory", args.gpu_memory, "--device", args.device, "--dtype", args.dtype,
           "--warmup", "1", "--lr", "1e-5", "--no-progress", "--json", run_json, "--model-dtype", args.model_dtype,
           "--optimizer-nvme-ratio", str(args.optimizer_nvme_ratio)]
    if args.offload_optimizer:
        cmd += ["--offload-optimizer", args.offload_optimizer]
    if args.checkpoint_activations:
        cmd.append("--checkpoint-activations")
    if export:
        cmd += ["--export", export]
    log.info("running: %s", " ".join(cmd))
    t0 = time.perf_counter()
    subprocess.run(cmd, check=True)
    wall = time.perf_counter() - t0
    with open(run_json) as f:
        run = json.load(f)
    s = run["summary"]
    result = {"checkpoint_dir": args.dir, "checkpoint_bytes": s["param_bytes_compute"], "params": s["params"],
              "checkpoint_build_seconds": build_s, "load_seconds": s["load_seconds"],
              "peak_rss_before_load": s["peak_rss_before_load"], "peak_rss_load": s["peak_rss_load"], "peak_rss": s["peak_rss"], "tokens_per_s": s["tokens_per_s"],
              "step_seconds": s["step_seconds"], "first_loss": s["first_loss"], "last_loss": s["last_loss"],
              "eval_loss": s["eval_loss"], "export_dir": export, "run_wall_seconds": wall, "summary": s}
    with open(args.json, "w") as f:
        json.dump(result, f, indent=1)
    print(f"load {s['load_seconds']:.1f}s, peak RSS {s['peak_rss'] / 2**30:.2f} GiB (load "
          f"{s['peak_rss_load'] / 2**30:.2f} GiB), {s['tokens_per_s']:.0f} tokens/s, loss {s['first_loss']:.3f} -> "
          f"{s['last_loss']:.3f}; written to {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
