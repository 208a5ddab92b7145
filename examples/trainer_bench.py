"""The same Hugging Face training script, three ways, on one GPU: DeepSpeed ZeRO-3 with parameters
and optimizer offloaded to the CPU (DeepSpeed's engine and CPU Adam), the same script on
pyinfinity's engine (the script's one extra line, ``import pyinfinity``, and a ``"pyinfinity"``
section in the same DeepSpeed config), and pyinfinity's own loop at the same shape
(``python -m pyinfinity bench train``). The model is a random-init Llama checkpoint of a preset
shape (``pyinfinity/presets.py``) written locally as sharded bf16 safetensors (nothing is
downloaded); bf16, 4 x 1024 tokens a step, activation checkpointing, an 8 GiB device cap.

Two scripts (``--mode``):

* ``trainer`` (default; Llama 1.1B, TinyLlama's shape): ``transformers.Trainer``, every parameter
  trained (torch AdamW);
* ``trl`` (default 13B, LLaMA-13B's shape: a 26 GB checkpoint): TRL's ``SFTTrainer`` with
  ``peft_config=LoraConfig(r=16, alpha 32, q_proj and v_proj)`` over the frozen base, on a
  ``datasets.Dataset`` of token blocks; the own loop is ``bench train --lora 16`` at that shape.

    python examples/trainer_bench.py --steps 10 --warmup 3 --out trainer_bench.json
    python examples/trainer_bench.py --mode trl --steps 6 --warmup 2 --out sft_bench.json
    python examples/trainer_bench.py --mode trl --model-size micro --seq 128 --ways pyinfinity,own  # CPU check

Where one call's time is bounded, run the ways one per call on the same machine, the checkpoint
first (``--ways none`` writes it only), each later call with ``--merge`` (the table and ratios then
cover every way run into that ``--out``)::

    python examples/trainer_bench.py --mode trl --ways none
    python examples/trainer_bench.py --mode trl --ways own --out sft_bench.json
    python examples/trainer_bench.py --mode trl --ways pyinfinity --merge --out sft_bench.json

prints a table (s/step, tokens/s, peak GPU memory, peak RSS, the ratios the targets are stated
in) and writes it as JSON. Each way runs in its own interpreter, in its own process group, killed
after ``--timeout`` seconds: a way that cannot run the shape (out of device or host memory, a
refusal) or does not finish gets its row as an error with the last exception line of its log,
and the others still run."""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
GiB = 1 << 30
SHARD_BYTES = 2 * GiB  # safetensors file size of the written checkpoint
MODES = {"trainer": {"size": "1.1b", "what": "Trainer", "ratio": "trainer"},
         "trl": {"size": "13b", "what": "SFTTrainer + LoRA", "ratio": "sft"}}


def shape(size: str) -> dict:
    """LlamaConfig fields of a preset (``pyinfinity.presets``)."""
    sys.path.insert(0, str(ROOT))
    from pyinfinity.presets import preset

    return preset(size)


def write_model(path: Path, fields: dict, tokenizer: bool) -> None:
    """A random-init Llama checkpoint in bf16 safetensors shards of at most ``SHARD_BYTES``, written
    tensor by tensor (one shard's tensors in RAM at a time), with its index and config; with
    ``tokenizer``, a word-level tokenizer over the vocabulary (``t0`` .. ``tN``) beside it."""
    import torch
    from safetensors.torch import save_file
    from transformers import LlamaConfig, LlamaForCausalLM

    if (path / "config.json").exists():
        return
    path.mkdir(parents=True, exist_ok=True)
    mc = LlamaConfig(**fields)
    mc.dtype = "bfloat16"
    with torch.device("meta"):
        shapes = {k: v.shape for k, v in LlamaForCausalLM(mc).state_dict().items()}
    g = torch.Generator().manual_seed(0)
    groups: list = [[]]
    size = 0
    for k, s in shapes.items():
        nbytes = 2 * int(torch.Size(s).numel())
        if groups[-1] and size + nbytes > SHARD_BYTES:
            groups.append([])
            size = 0
        groups[-1].append(k)
        size += nbytes
    weight_map = {}
    for i, names in enumerate(groups):
        name = f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors" if len(groups) > 1 else "model.safetensors"
        tensors = {k: (torch.empty(shapes[k]).normal_(0, 0.02, generator=g) if len(shapes[k]) > 1
                       else torch.ones(shapes[k])).to(torch.bfloat16) for k in names}
        save_file(tensors, str(path / name), metadata={"format": "pt"})
        weight_map.update({k: name for k in names})
        del tensors
    if len(groups) > 1:
        (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    if tokenizer:
        from tokenizers import Tokenizer, models, pre_tokenizers
        from transformers import PreTrainedTokenizerFast

        tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(fields["vocab_size"])}, unk_token="t0"))
        tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
        PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="t0", eos_token="t1", pad_token="t2").save_pretrained(
            str(path))
    mc.save_pretrained(str(path))  # last: its presence says the checkpoint is complete


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


def worker(way: str, a: argparse.Namespace, model_dir: str, cap: int, out: str) -> None:
    """One run of the mode's script; writes {s_per_step, tokens_per_s, peaks, losses} to ``out``."""
    if way == "pyinfinity":
        import pyinfinity  # noqa: F401  the one line
    import torch
    from transformers import AutoModelForCausalLM, TrainerCallback

    fields = shape(a.model_size)
    cuda = torch.cuda.is_available()  # (the CPU: a check of this script's logic only)
    if way == "deepspeed" and cuda:  # the same cap for DeepSpeed: torch's allocator limit for the process
        total = torch.cuda.get_device_properties(0).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, cap / total), 0)
    tmp = tempfile.mkdtemp(prefix=f"trainer_bench_{a.mode}_{way}_")
    common = dict(output_dir=tmp, deepspeed=ds_config(way, cap), bf16=True, per_device_train_batch_size=a.batch,
                  gradient_accumulation_steps=1, max_steps=a.steps, gradient_checkpointing=True, learning_rate=1e-4,
                  max_grad_norm=0.0, weight_decay=0.0, warmup_steps=0, save_strategy="no", logging_steps=1,
                  report_to=[], disable_tqdm=True, optim="adamw_torch", seed=0, use_cpu=not cuda)
    g = torch.Generator().manual_seed(0)
    blocks = [torch.randint(0, fields["vocab_size"], (a.seq,), generator=g) for _ in range(a.steps * a.batch)]
    ends: list = []

    class StepTimes(TrainerCallback):
        def on_step_end(self, *args, **kwargs):
            if cuda:
                torch.cuda.synchronize()
            ends.append(time.perf_counter())

    if a.mode == "trainer":
        from transformers import Trainer, TrainingArguments

        args = TrainingArguments(**common)
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16)  # under zero.Init (ZeRO-3)
        trainer = Trainer(model=model, args=args, train_dataset=[{"input_ids": b, "labels": b} for b in blocks],
                          callbacks=[StepTimes()])
    else:
        from datasets import Dataset
        from peft import LoraConfig
        from transformers import AutoTokenizer
        from trl import SFTConfig, SFTTrainer

        args = SFTConfig(**common, max_length=a.seq, packing=False)
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16)  # under zero.Init (ZeRO-3)
        peft_config = LoraConfig(r=a.lora, lora_alpha=2 * a.lora, lora_dropout=0.0,
                                 target_modules=a.lora_targets.split(","), task_type="CAUSAL_LM")
        trainer = SFTTrainer(model=model, args=args, processing_class=AutoTokenizer.from_pretrained(model_dir),
                             train_dataset=Dataset.from_dict({"input_ids": [b.tolist() for b in blocks]}),
                             peft_config=peft_config, callbacks=[StepTimes()])
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    trainer.train()
    timed = ends[a.warmup - 1:] if a.warmup > 0 else ends
    s_per_step = (timed[-1] - timed[0]) / max(1, len(timed) - 1)
    rss = next(int(line.split()[1]) * 1024 for line in Path("/proc/self/status").read_text().splitlines()
               if line.startswith("VmHWM:"))
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    inner = getattr(trainer.model_wrapped, "pyinfinity_engine", None)  # pyinfinity's: its per-step telemetry
    history = [dataclasses.asdict(r) for r in inner.history] if inner is not None else None
    trainable = sum(p.numel() for p in trainer.model.parameters() if p.requires_grad)
    Path(out).write_text(json.dumps({
        "way": f"{way} engine through {MODES[a.mode]['what']}", "engine": type(trainer.model_wrapped).__name__,
        "s_per_step": s_per_step, "tokens_per_s": a.batch * a.seq / s_per_step,
        "peak_gpu_bytes": torch.cuda.max_memory_reserved() if cuda else None, "peak_rss_bytes": rss, "losses": losses,
        "timed_steps": len(timed) - 1, "trainable_params": trainable, "torch_threads": torch.get_num_threads(),
        "cpus": len(os.sched_getaffinity(0)), "engine_history": history}, default=str))


def own_loop(a: argparse.Namespace, log: Path) -> dict:
    """pyinfinity's own loop at the same shape: ``bench train``'s pyinfinity-auto run (with the
    same LoRA adapters in the trl mode)."""
    result = log.with_suffix(".bench_train.json")
    result.unlink(missing_ok=True)
    cmd = [sys.executable, "-m", "pyinfinity", "bench", "train", "--sizes", a.model_size, "--systems",
           "pyinfinity-auto", "--gpu-memory", a.gpu_memory, "--steps", str(a.steps), "--warmup", str(a.warmup),
           "--batch", str(a.batch), "--seq", str(a.seq), "--dtype", "bf16", "--no-trace", "--json", str(result),
           "--timeout", str(a.timeout)]
    if a.mode == "trl":
        cmd += ["--lora", str(a.lora), "--lora-targets", a.lora_targets]
    way = "pyinfinity's own loop (bench train" + (f" --lora {a.lora})" if a.mode == "trl" else ")")
    rc, text = run_bounded(cmd, a.timeout + 120, {})
    log.write_text(text)
    if rc != 0 or not result.exists():
        return {"way": way, "error": failure(rc, text, log, a.timeout + 120), "command": " ".join(cmd[1:])}
    runs = [x for x in json.loads(result.read_text())["runs"] if x.get("tokens_per_s")]
    if not runs:
        return {"way": way, "error": f"bench train recorded no timed run: see {log}", "command": " ".join(cmd[1:])}
    run = runs[-1]
    return {"way": way, "s_per_step": a.batch * a.seq / run["tokens_per_s"], "tokens_per_s": run["tokens_per_s"],
            "peak_gpu_bytes": run.get("peak_gpu_bytes"), "peak_rss_bytes": run.get("peak_rss_bytes"),
            "command": " ".join(cmd[1:])}


def launcher_env() -> dict:
    """One process's launcher variables (what ``deepspeed``/``torchrun`` would set), unless already
    set: without them DeepSpeed's distributed start looks for MPI (mpi4py)."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    want = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port)}
    return {k: v for k, v in want.items() if k not in os.environ}


def run_bounded(cmd: list, timeout: float, env: dict) -> tuple:
    """Runs ``cmd`` in a process group of its own; past ``timeout`` seconds the whole group is
    killed (DeepSpeed's op builds and workers included). Returns (exit code or None, output)."""
    with tempfile.TemporaryFile("w+") as out:
        p = subprocess.Popen(cmd, cwd=str(ROOT), env={**os.environ, **env}, stdout=out, stderr=subprocess.STDOUT,
                             text=True, start_new_session=True)
        try:
            rc = p.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
            rc = None
        out.seek(0)
        return rc, out.read()


def failure(rc, text: str, log: Path, timeout: float) -> str:
    """A failed way's row: why, in one line (the last exception line of its output), and the log."""
    if rc is None:
        return f"did not finish in {timeout:.0f} s (killed): see {log}"
    errors = [ln.strip() for ln in text.splitlines() if re.match(r"\s*(\[rank\d+\]: )?[\w.]*(Error|Exception)\b", ln)]
    why = errors[-1][:300] if errors else "no exception line"
    return f"exit {rc}: {why} (see {log})"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mode", choices=list(MODES), default="trainer",
                    help="trainer: Trainer, full fine-tune; trl: SFTTrainer with LoRA over a frozen base")
    ap.add_argument("--model-size", default=None,
                    help="a preset of pyinfinity/presets.py (default: 1.1b for trainer, 13b for trl; micro or tiny "
                         "for a check on the CPU)")
    ap.add_argument("--steps", type=int, default=10, help="optimizer steps per run (default: %(default)s)")
    ap.add_argument("--warmup", type=int, default=3, help="untimed first steps (default: %(default)s)")
    ap.add_argument("--batch", type=int, default=4, help="micro-batch size (default: %(default)s)")
    ap.add_argument("--seq", type=int, default=1024, help="tokens per sample (default: %(default)s)")
    ap.add_argument("--lora", type=int, default=16, help="trl mode: the adapters' rank (default: %(default)s)")
    ap.add_argument("--lora-targets", default="q_proj,v_proj",
                    help="trl mode: the layers that get adapters (default: %(default)s, PEFT's for Llama)")
    ap.add_argument("--gpu-memory", default="8GiB", help="device cap, in GiB (default: %(default)s)")
    ap.add_argument("--timeout", type=int, default=3600, help="seconds per way before it is killed (default: "
                                                              "%(default)s)")
    ap.add_argument("--model-dir", default=None, help="where the random-init checkpoint is (written if absent)")
    ap.add_argument("--ways", default="deepspeed,pyinfinity,own",
                    help="which of deepspeed,pyinfinity,own to run (none: only write the checkpoint)")
    ap.add_argument("--out", default="trainer_bench.json", help="results (JSON)")
    ap.add_argument("--merge", action="store_true",
                    help="keep the rows of the ways not run now from --out (a run of the same mode and shape, "
                         "e.g. one way per call where a call's time is bounded); the table and ratios cover all")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--result", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if not a.gpu_memory.endswith("GiB"):
        ap.error("--gpu-memory: give it in GiB, e.g. 8GiB")
    a.model_size = a.model_size or MODES[a.mode]["size"]
    try:
        fields = shape(a.model_size)
    except (KeyError, ValueError) as exc:
        ap.error(f"--model-size: {exc}")
    if a.seq > fields.get("max_position_embeddings", a.seq):
        ap.error(f"--seq: {a.seq} is longer than the {a.model_size} shape's {fields['max_position_embeddings']} "
                 "positions")
    cap = int(float(a.gpu_memory[:-3]) * GiB)
    model_dir = Path(a.model_dir or Path(tempfile.gettempdir()) / f"trainer_bench_llama_{a.model_size}")
    if a.worker:
        worker(a.worker, a, str(model_dir), cap, a.result)
        return 0
    if a.warmup >= a.steps - 1:
        ap.error("--warmup: leave at least two timed steps (--steps > --warmup + 1)")
    ways = [] if a.ways == "none" else a.ways.split(",")
    bad = [w for w in ways if w not in ("deepspeed", "pyinfinity", "own")]
    if bad:
        ap.error(f"--ways: {', '.join(bad)} (expected deepspeed, pyinfinity, own, or none)")
    setting = {"mode": a.mode, "model_size": a.model_size, "batch": a.batch, "seq": a.seq, "steps": a.steps,
               "warmup": a.warmup, "gpu_memory": a.gpu_memory}
    kept: list = []
    if a.merge and Path(a.out).exists():
        old = json.loads(Path(a.out).read_text())
        differ = [k for k, v in setting.items() if old.get(k) != v]
        if differ:
            ap.error(f"--merge: {a.out} was run with other {', '.join(differ)}")
        kept = [r for r in old["rows"] if r.get("key") not in ways]
    t0 = time.perf_counter()
    write_model(model_dir, fields, tokenizer=a.mode == "trl")
    if not ways:
        print(f"checkpoint: {model_dir} ({time.perf_counter() - t0:.0f} s)")
        return 0
    logs = Path(a.out).with_suffix("")
    rows = []
    for way in ways:
        log = Path(f"{logs}.{way}.log")
        if way == "own":
            rows.append({**own_loop(a, log), "key": way})
            continue
        res = Path(f"{logs}.{way}.result.json")
        res.unlink(missing_ok=True)
        # the box's transformers/Accelerate may be of another release series than the tested ones (refused by
        # default): the benchmark runs them with a warning, and the JSON records the versions
        env = {"PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""), "PYINFINITY_HF_UNTESTED": "1",
               **launcher_env()}
        cmd = [sys.executable, __file__, "--worker", way, "--result", str(res), "--mode", a.mode, "--model-size",
               a.model_size, "--steps", str(a.steps), "--warmup", str(a.warmup), "--batch", str(a.batch), "--seq",
               str(a.seq), "--lora", str(a.lora), "--lora-targets", a.lora_targets, "--gpu-memory", a.gpu_memory,
               "--model-dir", str(model_dir)]
        rc, text = run_bounded(cmd, a.timeout, env)
        log.write_text(text)
        rows.append({**(json.loads(res.read_text()) if rc == 0 and res.exists()
                        else {"way": f"{way} engine through {MODES[a.mode]['what']}",
                              "error": failure(rc, text, log, a.timeout)}), "key": way})
    order = ("deepspeed", "pyinfinity", "own")
    rows = sorted(kept + rows, key=lambda r: order.index(r["key"]) if r.get("key") in order else len(order))
    by = {r["way"].split()[0]: r for r in rows if "s_per_step" in r}
    ratios = {}
    name = MODES[a.mode]["ratio"]
    if "pyinfinity" in by and "pyinfinity's" in by:
        ratios[f"{name}_vs_own_loop"] = by["pyinfinity's"]["s_per_step"] / by["pyinfinity"]["s_per_step"]
    if "pyinfinity" in by and "deepspeed" in by:
        ratios[f"{name}_pyinfinity_vs_{name}_deepspeed"] = by["deepspeed"]["s_per_step"] / by["pyinfinity"]["s_per_step"]
    lora = f", LoRA r={a.lora} on {a.lora_targets} (frozen base)" if a.mode == "trl" else ""
    print(f"{MODES[a.mode]['what']}: Llama {a.model_size}, bf16, {a.batch} x {a.seq} tokens, activation "
          f"checkpointing{lora}, {a.gpu_memory} cap, {a.steps} steps ({a.warmup} untimed)")
    print(f"{'way':50} {'s/step':>8} {'tokens/s':>10} {'peak GPU':>10} {'peak RSS':>10}")
    for r in rows:
        if "error" in r:
            print(f"{r['way']:50} {r['error']}")
            continue
        gpu = f"{r['peak_gpu_bytes'] / GiB:.2f} GiB" if r.get("peak_gpu_bytes") else "-"
        rss = f"{r['peak_rss_bytes'] / GiB:.1f} GiB" if r.get("peak_rss_bytes") else "-"
        print(f"{r['way']:50} {r['s_per_step']:8.3f} {r['tokens_per_s']:10,.0f} {gpu:>10} {rss:>10}")
    for k, v in ratios.items():
        print(f"{k}: {v:.2f}x")
    import importlib.metadata as md

    versions = {}
    for pkg in ("torch", "transformers", "accelerate", "deepspeed", "trl", "peft", "datasets"):
        try:
            versions[pkg] = md.version(pkg)
        except md.PackageNotFoundError:
            versions[pkg] = None
    Path(a.out).write_text(json.dumps({**setting, "lora": {"r": a.lora, "targets": a.lora_targets}
                                       if a.mode == "trl" else None, "rows": rows, "ratios": ratios,
                                       "versions": versions}, indent=1))
    print(f"json: {a.out}")
    return 0 if all("error" not in r for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
