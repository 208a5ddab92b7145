"""The same Hugging Face Trainer script, three ways, on one GPU: DeepSpeed ZeRO-3 with parameters
and optimizer offloaded to the CPU (DeepSpeed's engine and CPU Adam), the same script on
pyinfinity's engine (the script's one extra line, ``import pyinfinity``, and a ``"pyinfinity"``
section in the same DeepSpeed config), and pyinfinity's own loop at the same shape
(``python -m pyinfinity bench train``). Llama 1.1B (TinyLlama's shape) from a random-init
checkpoint written locally (nothing is downloaded), bf16, 4 x 1024 tokens a step, activation
checkpointing, an 8 GiB device cap.

    python examples/trainer_bench.py --steps 10 --warmup 3 --out trainer_bench.json

prints a table (s/step, tokens/s, peak GPU memory, peak RSS, the ratios the targets are stated
in) and writes it as JSON. Each way runs in its own interpreter."""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TOKENS, BATCH = 1024, 4
SHAPE = dict(vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_hidden_layers=22,
             num_attention_heads=32, num_key_value_heads=4, max_position_embeddings=2048, tie_word_embeddings=False)
GiB = 1 << 30


def write_model(path: Path) -> None:
    """A random-init Llama 1.1B checkpoint in bf16 safetensors, tensor by tensor."""
    import torch
    from safetensors.torch import save_file
    from transformers import LlamaConfig, LlamaForCausalLM

    if (path / "config.json").exists():
        return
    path.mkdir(parents=True, exist_ok=True)
    mc = LlamaConfig(**SHAPE)
    mc.dtype = "bfloat16"
    with torch.device("meta"):
        shapes = {k: v.shape for k, v in LlamaForCausalLM(mc).state_dict().items()}
    g = torch.Generator().manual_seed(0)
    tensors = {k: (torch.empty(s).normal_(0, 0.02, generator=g) if len(s) > 1 else torch.ones(s)).to(torch.bfloat16)
               for k, s in shapes.items()}
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    mc.save_pretrained(str(path))


def ds_config(way: str, cap: int) -> dict:
    """One DeepSpeed ZeRO-3 config: parameters and optimizer offloaded to the CPU (DeepSpeed's
    best offload configuration at 1.1B under a cap, as measured by ``bench train``). The
    pyinfinity way adds the section that selects its engine (its optimizer in RAM, its planner's
    placement within the cap)."""
    cfg = {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
           "gradient_clipping": "auto", "bf16": {"enabled": "auto"},
           "zero_optimization": {"stage": 3, "offload_param": {"device": "cpu", "pin_memory": True},
                                 "offload_optimizer": {"device": "cpu", "pin_memory": True},
                                 "stage3_prefetch_bucket_size": "auto",
                                 "stage3_param_persistence_threshold": "auto",
                                 "stage3_gather_16bit_weights_on_model_save": False}}
    if way == "pyinfinity":
        # the section, and the placement left to pyinfinity's planner as its own loop's is
        # ("auto" offload devices: DeepSpeed itself takes cpu or nvme only)
        cfg["pyinfinity"] = {"device_memory": cap}
        for key in ("offload_param", "offload_optimizer"):
            cfg["zero_optimization"][key]["device"] = "auto"
    return cfg


def worker(way: str, model_dir: str, steps: int, warmup: int, cap: int, out: str) -> None:
    """One Trainer run; writes {s_per_step, tokens_per_s, peaks} to ``out``."""
    if way == "pyinfinity":
        import pyinfinity  # noqa: F401  the one line
    import torch
    from transformers import AutoModelForCausalLM, Trainer, TrainerCallback, TrainingArguments

    cuda = torch.cuda.is_available()  # (the CPU: a smoke run of this script's logic only)
    if way == "deepspeed" and cuda:  # the same cap for DeepSpeed: torch's allocator limit for the process
        total = torch.cuda.get_device_properties(0).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, cap / total), 0)
    tmp = tempfile.mkdtemp(prefix=f"trainer_bench_{way}_")
    args = TrainingArguments(output_dir=tmp, deepspeed=ds_config(way, cap), bf16=True,
                             per_device_train_batch_size=BATCH, gradient_accumulation_steps=1, max_steps=steps,
                             gradient_checkpointing=True, learning_rate=1e-4, max_grad_norm=0.0, weight_decay=0.0,
                             warmup_steps=0, save_strategy="no", logging_steps=1, report_to=[], disable_tqdm=True,
                             optim="adamw_torch", seed=0, use_cpu=not cuda)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16)  # under zero.Init (ZeRO-3)
    g = torch.Generator().manual_seed(0)
    data = [{"input_ids": (ids := torch.randint(0, SHAPE["vocab_size"], (TOKENS,), generator=g)), "labels": ids}
            for _ in range(steps * BATCH)]
    ends: list = []

    class StepTimes(TrainerCallback):
        def on_step_end(self, *a, **k):
            if cuda:
                torch.cuda.synchronize()
            ends.append(time.perf_counter())

    trainer = Trainer(model=model, args=args, train_dataset=data, callbacks=[StepTimes()])
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    trainer.train()
    timed = ends[warmup - 1:] if warmup > 0 else ends
    s_per_step = (timed[-1] - timed[0]) / max(1, len(timed) - 1)
    rss = next(int(line.split()[1]) * 1024 for line in Path("/proc/self/status").read_text().splitlines()
               if line.startswith("VmHWM:"))
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    inner = getattr(trainer.model_wrapped, "pyinfinity_engine", None)  # pyinfinity's: its per-step telemetry
    history = [dataclasses.asdict(r) for r in inner.history] if inner is not None else None
    Path(out).write_text(json.dumps({
        "way": f"{way} engine through Trainer", "engine": type(trainer.model_wrapped).__name__,
        "s_per_step": s_per_step, "tokens_per_s": BATCH * TOKENS / s_per_step,
        "peak_gpu_bytes": torch.cuda.max_memory_reserved() if cuda else None, "peak_rss_bytes": rss, "losses": losses,
        "timed_steps": len(timed) - 1, "torch_threads": torch.get_num_threads(),
        "cpus": len(os.sched_getaffinity(0)), "engine_history": history}, default=str))


def own_loop(steps: int, warmup: int, cap_text: str, log: Path) -> dict:
    """pyinfinity's own loop at the same shape: ``bench train``'s pyinfinity-auto run."""
    result = log.with_suffix(".bench_train.json")
    result.unlink(missing_ok=True)
    cmd = [sys.executable, "-m", "pyinfinity", "bench", "train", "--sizes", "1.1b", "--systems", "pyinfinity-auto",
           "--gpu-memory", cap_text, "--steps", str(steps), "--warmup", str(warmup), "--batch", str(BATCH),
           "--seq", str(TOKENS), "--dtype", "bf16", "--no-trace", "--json", str(result)]
    r = subprocess.run(cmd, cwd=str(ROOT), capture_output=True, text=True)
    log.write_text(r.stdout + r.stderr)
    if r.returncode != 0 or not result.exists():
        return {"way": "pyinfinity's own loop (bench train)", "error": f"exit {r.returncode}: see {log}"}
    run = [x for x in json.loads(result.read_text())["runs"] if x.get("tokens_per_s")][-1]
    return {"way": "pyinfinity's own loop (bench train)", "s_per_step": BATCH * TOKENS / run["tokens_per_s"],
            "tokens_per_s": run["tokens_per_s"], "peak_gpu_bytes": run.get("peak_gpu_bytes"),
            "peak_rss_bytes": run.get("peak_rss_bytes"), "command": " ".join(cmd[1:])}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=10, help="optimizer steps per run (default: %(default)s)")
    ap.add_argument("--warmup", type=int, default=3, help="untimed first steps (default: %(default)s)")
    ap.add_argument("--gpu-memory", default="8GiB", help="device cap, in GiB (default: %(default)s)")
    ap.add_argument("--model-dir", default=None, help="where the random-init 1.1B checkpoint is (written if absent)")
    ap.add_argument("--ways", default="deepspeed,pyinfinity,own", help="which of deepspeed,pyinfinity,own to run")
    ap.add_argument("--out", default="trainer_bench.json", help="results (JSON)")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--result", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if not a.gpu_memory.endswith("GiB"):
        ap.error("--gpu-memory: give it in GiB, e.g. 8GiB")
    cap = int(float(a.gpu_memory[:-3]) * GiB)
    model_dir = Path(a.model_dir or Path(tempfile.gettempdir()) / "trainer_bench_llama_1.1b")
    if a.worker:
        worker(a.worker, str(model_dir), a.steps, a.warmup, cap, a.result)
        return 0
    if a.warmup >= a.steps - 1:
        ap.error("--warmup: leave at least two timed steps (--steps > --warmup + 1)")
    write_model(model_dir)
    logs = Path(a.out).with_suffix("")
    rows = []
    for way in a.ways.split(","):
        log = Path(f"{logs}.{way}.log")
        if way == "own":
            rows.append(own_loop(a.steps, a.warmup, a.gpu_memory, log))
            continue
        res = Path(f"{logs}.{way}.result.json")
        res.unlink(missing_ok=True)
        # the box's transformers/Accelerate may be of another release series than the tested ones (refused by
        # default): the benchmark runs them with a warning, and the JSON records the versions
        env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
                   PYINFINITY_HF_UNTESTED="1")
        r = subprocess.run([sys.executable, __file__, "--worker", way, "--result", str(res), "--steps", str(a.steps),
                            "--warmup", str(a.warmup), "--gpu-memory", a.gpu_memory, "--model-dir", str(model_dir)],
                           env=env, capture_output=True, text=True)
        log.write_text(r.stdout + r.stderr)
        rows.append(json.loads(res.read_text()) if r.returncode == 0 and res.exists()
                    else {"way": f"{way} engine through Trainer", "error": f"exit {r.returncode}: see {log}"})
    by = {r["way"].split()[0]: r for r in rows if "s_per_step" in r}
    ratios = {}
    if "pyinfinity" in by and "pyinfinity's" in by:
        ratios["trainer_vs_own_loop"] = by["pyinfinity's"]["s_per_step"] / by["pyinfinity"]["s_per_step"]
    if "pyinfinity" in by and "deepspeed" in by:
        ratios["trainer_pyinfinity_vs_trainer_deepspeed"] = by["deepspeed"]["s_per_step"] / by["pyinfinity"]["s_per_step"]
    print(f"Llama 1.1B, bf16, {BATCH} x {TOKENS} tokens, activation checkpointing, {a.gpu_memory} cap, "
          f"{a.steps} steps ({a.warmup} untimed)")
    print(f"{'way':42} {'s/step':>8} {'tokens/s':>10} {'peak GPU':>10} {'peak RSS':>10}")
    for r in rows:
        if "error" in r:
            print(f"{r['way']:42} {r['error']}")
            continue
        gpu = f"{r['peak_gpu_bytes'] / GiB:.2f} GiB" if r.get("peak_gpu_bytes") else "-"
        rss = f"{r['peak_rss_bytes'] / GiB:.1f} GiB" if r.get("peak_rss_bytes") else "-"
        print(f"{r['way']:42} {r['s_per_step']:8.3f} {r['tokens_per_s']:10,.0f} {gpu:>10} {rss:>10}")
    for k, v in ratios.items():
        print(f"{k}: {v:.2f}x")
    import importlib.metadata as md

    versions = {}
    for name in ("torch", "transformers", "accelerate", "deepspeed"):
        try:
            versions[name] = md.version(name)
        except md.PackageNotFoundError:
            versions[name] = None
    Path(a.out).write_text(json.dumps({"rows": rows, "ratios": ratios, "steps": a.steps, "warmup": a.warmup,
                                       "gpu_memory": a.gpu_memory, "versions": versions}, indent=1))
    print(f"json: {a.out}")
    return 0 if all("error" not in r for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
