"""MegaTrain as a system of `pyinfinity bench train` (``--systems megatrain``).

MegaTrain (github.com/DLYuanGod/MegaTrain, Apache-2.0) keeps a model's weights, gradients and
optimizer state in host RAM and streams the decoder layers through a double-buffered pipeline on
one GPU. It is not a library with a training loop to call: it is a script,
``examples/sft/train.py``, that reads a YAML recipe naming a Hugging Face model directory and a
dataset of chat samples. A run here therefore writes what that script reads and runs it in a
subprocess, in the bench's worker:

* the model directory (``write_model_dir``): the size preset's ``config.json`` and random-initialised
  bf16 weights as safetensors, written one shard at a time (the fp32 model is never held);
* a tokenizer (``write_tokenizer``) whose words are the token ids themselves (``<17>`` is id 17)
  and whose chat template only joins the messages' text, so that the text of a sample tokenizes
  back to exactly the ids it was written from;
* the dataset (``write_dataset``): the bench's own token stream (``train_worker.token_rows``: the
  micro-batches every other system trains on, in the same order), one sample a sequence, as an arrow dataset
  (``datasets.Dataset.save_to_disk``) with an empty query and the sequence as the response:
  MegaTrain masks the prompt's tokens (none) and the padding (none: every sample is exactly
  ``seq`` tokens), so every token is trained on, as in the other systems;
* the recipe (``megatrain_config``): MegaTrain's own Llama-3-8B recipe (``RECIPE``) with the run's
  model, data, sequence length and step count, and ``sdpa`` attention (the attention every system
  of the bench uses; the recipe asks for flash-attn).

MegaTrain takes a whole optimizer step's sequences as one batch through each layer; its recipe's
batch is 148 x 1024 tokens. The run's tokens a step (``--batch`` x ``--grad-accum`` sequences)
go in one batch up to the recipe's tokens, in MegaTrain's own gradient accumulation beyond
(``recipe_shape``); a variant (``megatrain[memory.checkpoint_interval=2]``) sets any key of the
recipe.

Its log (``parse_log``) gives each step's time (the seconds of its forward, backward, gradient
clipping and optimizer step, from its tokens/s), loss, its own TFLOPS (6 x parameters x tokens
over the step's seconds), peak device memory (``torch.cuda.max_memory_allocated``) and the host
RSS it reports; the run's peak RSS is the subprocess's own (``getrusage``).

Its script runs under ``python -m pyinfinity.bench.megatrain SCRIPT ARGS`` (``main``), which
changes one thing before running it: at the commit measured, MegaTrain's single-GPU path hands
its decoder layers the batch's 2-D padding mask, which only flash-attn's attention takes (sdpa
and eager reject it); with another attention its layers get what its multi-GPU path gives them
(a 4-D causal mask), or no mask where no sample is padded (``patch_layer_mask``): causal
attention on whole sequences, sdpa's causal kernel, as the bench's other systems get.

What MegaTrain keeps, as its code at the recipe's settings does: bf16 weights and bf16 gradients
in RAM (no fp32 master copy), DeepSpeed's CPU Adam in AdamW mode with fp32 moments, gradients
clipped to norm 1.0 every step (``PRECISION``, ``OPTIMIZER``).
"""
from __future__ import annotations

import json
import math
import os
import re
import resource
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Iterable, Optional

from pyinfinity.bench.procs import kill_group

ENV_SOURCE = "PYINFINITY_MEGATRAIN_SRC"
TRAIN_SCRIPT = os.path.join("examples", "sft", "train.py")

# MegaTrain's Llama-3-8B recipe (examples/sft/configs/llama3_8b.yaml), the keys its YAML loader
# reads; the run replaces the model, the data and the shape (``megatrain_config``)
RECIPE: dict[str, dict[str, Any]] = {
    "model": {"name": "", "dtype": "bfloat16", "device": 0, "attn_implementation": "sdpa",
              "trust_remote_code": False},
    "dataset": {"path": "", "max_seq_len": 1024, "num_workers": 4, "query_field": "query",
                "response_field": "response"},
    "training": {"batch_size": 148, "gradient_accumulation_steps": 1, "num_steps": 1000, "learning_rate": 2.0e-5,
                 "weight_decay": 0.01, "max_grad_norm": 1.0, "seed": 42},
    "optimizer": {"type": "deepspeed_adam", "beta1": 0.9, "beta2": 0.999, "eps": 1.0e-8},
    "memory": {"checkpoint_interval": 4, "num_grad_slabs": 12},
    "logging": {"log_interval": 1, "enable_timing": True},
}
RECIPE_TOKENS = 148 * 1024  # the recipe's tokens in one batch
ATTENTION = "sdpa"
PRECISION = "bf16 weights and gradients in RAM (no fp32 master)"
OPTIMIZER = "DeepSpeed CPU Adam (AdamW mode, fp32 moments), gradients clipped to norm 1.0"
SHARD_BYTES = 2 << 30  # the largest safetensors shard the model directory gets


class MegaTrainError(RuntimeError):
    """A MegaTrain run that cannot start (its source missing, no CUDA device)."""


# ----------------------------------------------------------------------------------- the source


def find_source(path: Optional[str]) -> str:
    """The MegaTrain checkout to run: ``path`` (``--megatrain-src``), else $PYINFINITY_MEGATRAIN_SRC;
    MegaTrainError ("megatrain source not found ...") when neither names a checkout holding its
    training script and its ``infinity`` package."""
    where = path or os.environ.get(ENV_SOURCE) or ""
    if where and os.path.isfile(os.path.join(where, TRAIN_SCRIPT)) and \
            os.path.isfile(os.path.join(where, "infinity", "__init__.py")):
        return os.path.abspath(where)
    said = f" at {where} (no {TRAIN_SCRIPT} or infinity/__init__.py there)" if where else ""
    raise MegaTrainError(f"megatrain source not found{said}: give --megatrain-src DIR or set {ENV_SOURCE} "
                         "to a MegaTrain checkout (see BENCHMARKS.md)")


# ----------------------------------------------------------------------------------- what it reads


def _llama_config(fields: dict[str, Any]) -> Any:
    import torch
    from transformers import LlamaConfig

    cfg = LlamaConfig(**fields, use_cache=False)
    cfg.dtype = torch.bfloat16
    cfg.bos_token_id = cfg.eos_token_id = cfg.pad_token_id = 0
    return cfg


def write_model_dir(fields: dict[str, Any], out: str, seed: int = 0, shard_bytes: int = SHARD_BYTES) -> int:
    """A Hugging Face LlamaForCausalLM directory of the LlamaConfig ``fields`` in ``out``: its
    ``config.json`` and random bf16 weights (normal with the config's ``initializer_range``, norms
    one) in safetensors shards of at most ``shard_bytes``, one shard in memory at a time; the names
    and shapes are the model's own (built on the meta device). Returns the parameter count."""
    import torch
    from safetensors.torch import save_file
    from transformers import LlamaForCausalLM

    os.makedirs(out, exist_ok=True)
    cfg = _llama_config(fields)
    cfg.save_pretrained(out)
    with torch.device("meta"):
        meta = LlamaForCausalLM(cfg)
    shapes = [(k, tuple(v.shape)) for k, v in meta.state_dict().items()
              if not (cfg.tie_word_embeddings and k == "lm_head.weight")]
    groups: list[list[tuple[str, tuple[int, ...]]]] = [[]]
    size = 0
    for name, shape in shapes:
        nbytes = 2 * math.prod(shape)
        if groups[-1] and size + nbytes > shard_bytes:
            groups.append([])
            size = 0
        groups[-1].append((name, shape))
        size += nbytes
    gen = torch.Generator().manual_seed(seed)
    weight_map, total, numel = {}, 0, 0
    for i, group in enumerate(groups):
        fname = f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors"
        tensors = {}
        for name, shape in group:
            if name.endswith("norm.weight"):
                t = torch.ones(shape, dtype=torch.bfloat16)
            else:
                t = torch.empty(shape, dtype=torch.float32).normal_(0.0, cfg.initializer_range, generator=gen)
                t = t.to(torch.bfloat16)
            tensors[name] = t
            weight_map[name] = fname
            total += 2 * t.numel()
            numel += t.numel()
        save_file(tensors, os.path.join(out, fname), metadata={"format": "pt"})
        del tensors
    with open(os.path.join(out, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=1)
    return numel


def token_word(i: int) -> str:
    """The tokenizer's word for token id ``i``."""
    return f"<{i}>"


# the messages' text, one after the other, each followed by a space (the prompt of a sample with
# an empty query is then blank: no token of the sample is masked as prompt)
CHAT_TEMPLATE = "{% for m in messages %}{{ m['content'] }}{{ ' ' }}{% endfor %}"


def write_tokenizer(out: str, vocab_size: int) -> None:
    """A tokenizer for MegaTrain's dataset in ``out``: one word a token id (``token_word``), split
    at whitespace, ``CHAT_TEMPLATE`` as its chat template, id 0 its end and padding token (a
    sample is never padded: each is exactly the run's sequence length)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({token_word(i): i for i in range(vocab_size)}, unk_token=token_word(0)))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=token_word(0), pad_token=token_word(0),
                                   unk_token=token_word(0), model_max_length=1 << 30)
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(out)


def sample_text(ids: Iterable[int]) -> str:
    """A sequence of token ids as the tokenizer's text."""
    return " ".join(token_word(int(i)) for i in ids)


def write_dataset(out: str, rows: Any, query_field: str = "query", response_field: str = "response") -> int:
    """``rows`` (a [n, seq] tensor of token ids) as MegaTrain's arrow dataset in ``out``: one
    sample a row, an empty query and the row as the response. Returns the tokens written."""
    from datasets import Dataset

    texts = [sample_text(r.tolist()) for r in rows]
    Dataset.from_dict({query_field: [""] * len(texts), response_field: texts}).save_to_disk(out)
    return int(rows.numel())


# ----------------------------------------------------------------------------------- its recipe


def recipe_shape(rows_per_step: int, seq: int) -> tuple[int, int]:
    """MegaTrain's (batch, gradient accumulation) for ``rows_per_step`` sequences of ``seq`` tokens a
    step: the largest batch of at most the recipe's tokens that divides the step's sequences."""
    most = max(1, RECIPE_TOKENS // seq)
    batch = max(d for d in range(1, min(most, rows_per_step) + 1) if rows_per_step % d == 0)
    return batch, rows_per_step // batch


def _set(cfg: dict[str, Any], key: str, value: Any) -> None:
    section, _, name = key.partition(".")
    if section not in cfg or not name or name not in cfg[section]:
        known = ", ".join(f"{s}.{k}" for s, keys in cfg.items() for k in keys)
        raise ValueError(f"{key}: not a key of MegaTrain's recipe; known: {known}")
    cfg[section][name] = value


def megatrain_config(spec: dict[str, Any], model_dir: str = "", data_dir: str = "") -> dict[str, Any]:
    """The YAML recipe of a run of ``spec``: ``RECIPE`` with the run's model directory, dataset,
    sequence length, device, batch and accumulation (``recipe_shape``), ``steps`` optimizer steps,
    and the variant's keys (``section.key``) set last. ValueError for a key the recipe lacks or a
    batch x accumulation that is not the run's tokens a step."""
    cfg = json.loads(json.dumps(RECIPE))
    rows = int(spec["batch"]) * int(spec.get("grad_accum", 1))
    seq = int(spec["seq"])
    batch, accum = recipe_shape(rows, seq)
    device = str(spec.get("device", "cuda:0"))
    cfg["model"].update(name=model_dir, device=int(device.partition(":")[2] or 0))
    cfg["dataset"].update(path=data_dir, max_seq_len=seq)
    cfg["training"].update(batch_size=batch, gradient_accumulation_steps=accum, seed=int(spec.get("seed", 0)))
    for key, value in (spec.get("variant") or {}).items():
        _set(cfg, key, value)
    tr = cfg["training"]
    if int(tr["batch_size"]) * int(tr["gradient_accumulation_steps"]) != rows:
        raise ValueError(f"training.batch_size {tr['batch_size']} x training.gradient_accumulation_steps "
                         f"{tr['gradient_accumulation_steps']} is not the run's {rows} sequences a step "
                         "(--batch x --grad-accum)")
    tr["num_steps"] = int(spec["steps"]) * int(tr["gradient_accumulation_steps"])
    return cfg


# ----------------------------------------------------------------------------------- its log

# the lines its training script logs for each step (after the logger's "HH:MM:SS [INFO] ")
_STEP = re.compile(r"Step (\d+)/(\d+) \| Loss ([-+0-9.eEnaif]+)")
_TIME = re.compile(r"Time: ([0-9.]+)s \| Tokens/s ([0-9.]+) \| TFLOPS ([0-9.]+)")
_GPU = re.compile(r"GPU: ([0-9.]+)GB peak")
_CPU = re.compile(r"^\s*CPU: ([0-9.]+)GB")
_PEAK_GPU = re.compile(r"Peak GPU: ([0-9.]+) GB")
_ERROR = re.compile(r"^([A-Za-z_][\w.]*(Error|Exception|Interrupt)|torch\.\w+\.\w*Error|Killed)\b")
_PREFIX = re.compile(r"^\d\d:\d\d:\d\d \[[A-Z]+\] ")


@dataclass
class LogStep:
    """One step of MegaTrain's loop as its log tells it (one batch: with gradient accumulation,
    several make an optimizer step)."""

    step: int
    loss: float
    seconds: Optional[float] = None
    tokens_per_s: Optional[float] = None
    tflops: Optional[float] = None
    peak_gpu_gib: Optional[float] = None
    rss_gib: Optional[float] = None


@dataclass
class LogFacts:
    steps: list[LogStep] = field(default_factory=list)
    optimizer: Optional[str] = None      # the optimizer its script chose
    attention: Optional[str] = None      # the attention the loaded model reports
    peak_gpu_gib: Optional[float] = None
    error: Optional[str] = None          # the last error line


def parse_log(lines: Iterable[str]) -> LogFacts:
    """MegaTrain's training log as steps and facts. A step's seconds are its tokens over its
    tokens/s (both printed; the seconds themselves only to 10 ms), else the printed seconds."""
    out = LogFacts()
    for raw in lines:
        line = _PREFIX.sub("", raw.rstrip("\n"))
        m = _STEP.search(line)
        if m:
            out.steps.append(LogStep(step=int(m.group(1)), loss=float(m.group(3))))
            continue
        m = _TIME.search(line)
        if m and out.steps:
            st = out.steps[-1]
            st.seconds, st.tokens_per_s, st.tflops = float(m.group(1)), float(m.group(2)), float(m.group(3))
            continue
        m = _GPU.search(line)
        if m and out.steps and not line.lstrip().startswith("Peak"):
            out.steps[-1].peak_gpu_gib = float(m.group(1))
            continue
        m = _CPU.search(line)
        if m and out.steps:
            out.steps[-1].rss_gib = float(m.group(1))
            continue
        m = _PEAK_GPU.search(line)
        if m:
            out.peak_gpu_gib = float(m.group(1))
        elif "Using DeepSpeed CPUAdam optimizer" in line:
            out.optimizer = "deepspeed_adam"
        elif "Using PyTorch AdamW optimizer" in line:
            out.optimizer = "torch_adamw"
        elif "Attention implementation:" in line:
            out.attention = line.rsplit(":", 1)[1].strip()
        elif _ERROR.match(line.strip()):
            out.error = line.strip()
    return out


def optimizer_steps(facts: LogFacts, accum: int, tokens_per_batch: int) -> list[dict[str, Any]]:
    """The bench's per-step records (seconds, loss, disk bytes unknown: 0) of MegaTrain's logged
    batches, ``accum`` batches an optimizer step (an unfinished last step is left out)."""
    out = []
    done = [s for s in facts.steps if s.seconds is not None]
    for i in range(0, len(done) - accum + 1, accum):
        group = done[i:i + accum]
        secs = sum(tokens_per_batch / s.tokens_per_s if s.tokens_per_s else s.seconds for s in group)
        out.append({"seconds": round(secs, 5), "loss": sum(s.loss for s in group) / accum,
                    "megatrain_tflops": sum(s.tflops or 0.0 for s in group) / accum,
                    "disk_read": 0, "disk_write": 0})
    return out


# ----------------------------------------------------------------------------------- its script

MASK_NOTE = ("its decoder layers get no mask (every sample whole: causal attention) where its single-GPU path "
             "hands them the 2-D padding mask only flash-attn takes")


def patch_layer_mask(model_cls: Any) -> None:
    """Makes ``model_cls`` (MegaTrain's ``CPUMasterModel``) give its decoder layers a mask their
    attention takes when it is not flash-attn's: none where the batch's 2-D padding mask is all
    ones (sdpa then runs its causal kernel), else the 4-D causal mask its multi-GPU path makes
    (its own ``_prepare_4d_causal_mask``)."""
    build = model_cls._build_layer_kwargs

    def build_layer_kwargs(self: Any, mask: Any, *args: Any) -> dict[str, Any]:
        kwargs = build(self, mask, *args)
        if self.config.attn_implementation != "flash_attention_2" and mask is not None and mask.dim() == 2:
            kwargs["attention_mask"] = None if bool(mask.all()) else \
                model_cls._prepare_4d_causal_mask(mask, self.config.dtype, mask.shape[1])
        return kwargs

    model_cls._build_layer_kwargs = build_layer_kwargs


def main(argv: Optional[list[str]] = None) -> int:
    """``python -m pyinfinity.bench.megatrain SCRIPT ARGS...``: MegaTrain's ``SCRIPT`` run as its
    ``__main__`` with ``ARGS``, its layers' mask made one their attention takes (``patch_layer_mask``);
    its checkout must be on PYTHONPATH."""
    import runpy

    argv = sys.argv[1:] if argv is None else argv
    if not argv:
        print("usage: python -m pyinfinity.bench.megatrain SCRIPT [ARGS...]", file=sys.stderr)
        return 2
    from infinity.model.cpu_master import CPUMasterModel

    patch_layer_mask(CPUMasterModel)
    print(f"pyinfinity bench: {MASK_NOTE}", file=sys.stderr, flush=True)
    sys.argv = list(argv)
    runpy.run_path(argv[0], run_name="__main__")
    return 0


# ----------------------------------------------------------------------------------- the run


def run(spec: dict[str, Any], rows: Any) -> dict[str, Any]:
    """One bench run of MegaTrain on ``spec`` (the worker's spec) and ``rows``, the token ids of its
    dataset (``train_worker.token_rows``: the bench's batches, in order); the row's fields, ``ok``
    false with the reason when it cannot start or fails (its last error line)."""
    import yaml

    t_start = time.perf_counter()
    res: dict[str, Any] = {"system": spec["system"], "size": spec["size"], "ok": False,
                           "attention": ATTENTION, "precision": PRECISION, "optimizer": OPTIMIZER,
                           "megatrain_patch": MASK_NOTE}
    try:
        src = find_source(spec.get("megatrain_src"))
        if not str(spec.get("device", "")).startswith("cuda"):
            raise MegaTrainError("MegaTrain trains on a CUDA device only")
        if spec["dtype"] != "bf16":
            raise MegaTrainError(f"MegaTrain trains in bf16 only (the run's --dtype is {spec['dtype']})")
        cfg = megatrain_config(spec)
    except (MegaTrainError, ValueError) as exc:
        res["error"] = str(exc)
        return res
    res["megatrain_src"] = src
    work = spec["nvme_dir"]
    model_dir, data_dir = os.path.join(work, "model"), os.path.join(work, "data")
    phase = "build"
    try:
        res["params"] = write_model_dir(spec["model"], model_dir, seed=int(spec.get("seed", 0)))
        write_tokenizer(model_dir, int(spec["model"]["vocab_size"]))
        res["dataset_tokens"] = write_dataset(data_dir, rows)
        res["build_seconds"] = round(time.perf_counter() - t_start, 3)
        cfg = megatrain_config(spec, model_dir, data_dir)
        res["config"] = cfg
        yaml_path = os.path.join(work, "megatrain.yaml")
        with open(yaml_path, "w") as f:
            yaml.safe_dump(cfg, f, sort_keys=False)
        phase = "train"
        here = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # pyinfinity's root
        path = [src] + [p for p in [os.environ.get("PYTHONPATH")] if p] + [here]
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(path),
                   HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
        cmd = [sys.executable, "-m", "pyinfinity.bench.megatrain", os.path.join(src, TRAIN_SCRIPT),
               "--config", yaml_path]
        left = float(spec.get("timeout") or 1800) - (time.perf_counter() - t_start) - 30
        lines = _run_logged(cmd, src, env, max(left, 1.0))
        facts = parse_log(lines)
    except Exception as exc:  # noqa: BLE001 - every failure becomes a row of the table
        res["error_phase"] = phase
        res["error"] = f"{type(exc).__name__}: " + " ".join(str(exc).split())[:600]
        return res
    rc = lines.returncode
    tr = cfg["training"]
    accum = int(tr["gradient_accumulation_steps"])
    res["steps"] = optimizer_steps(facts, accum, int(tr["batch_size"]) * int(spec["seq"]))
    res["megatrain_batch"], res["megatrain_grad_accum"] = int(tr["batch_size"]), accum
    res["megatrain_optimizer"], res["megatrain_attention"] = facts.optimizer, facts.attention
    peak = facts.peak_gpu_gib or max((s.peak_gpu_gib or 0.0 for s in facts.steps), default=0.0)
    res["peak_device_allocated"] = int(peak * (1 << 30)) if peak else None
    res["peak_rss"] = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024
    warm = int(spec.get("warmup", 0))
    tf = [s["megatrain_tflops"] for s in res["steps"][warm:]] or [s["megatrain_tflops"] for s in res["steps"]]
    if tf:
        res["megatrain_tflops"] = statistics.median(tf)  # as the bench's step time is taken
    text = "\n".join(lines)
    if rc == 0 and len(res["steps"]) == int(spec["steps"]):
        if facts.optimizer != "deepspeed_adam":
            res["error"] = (f"MegaTrain ran with {facts.optimizer or 'an unknown optimizer'}, not DeepSpeed's CPU "
                            "Adam (deepspeed.ops.adam does not import in its process)")
        else:
            res["ok"] = True
        return res
    res["error_phase"] = "train"
    if lines.timed_out:
        why = f"MegaTrain timed out after {left:.0f} s (--timeout)"
    elif rc is not None and rc < 0:
        name = signal.Signals(-rc).name if -rc in signal.Signals._value2member_map_ else str(-rc)
        why = f"MegaTrain was killed by {name}" + (" (the kernel's OOM killer: host RAM ran out)" if rc == -9 else "")
    else:
        why = f"MegaTrain exited with status {rc}"
    if "out of memory" in text.lower() and "CUDA" in text:
        res["oom"] = True
    last = facts.error or next((ln.strip() for ln in reversed(lines) if ln.strip()), "")
    res["error"] = f"{why}: {last[:400]}" if last else why
    res["log_tail"] = "\n".join(lines[-15:])
    return res


class _Lines(list):
    returncode: Optional[int] = None
    timed_out: bool = False


def _run_logged(cmd: list[str], cwd: str, env: dict[str, str], timeout: float) -> _Lines:
    """Runs ``cmd``, its output (stdout and stderr together) copied line by line to this process's
    stderr (the bench's log) and returned; killed with its process group after ``timeout`` s."""
    import threading

    out = _Lines()
    proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            errors="replace", bufsize=1, start_new_session=True)

    def pump() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            out.append(line.rstrip("\n"))
            sys.stderr.write(line)
            m = _STEP.search(line)
            if m:  # the bench's progress bar reads "step " lines
                sys.stderr.write(f"step {m.group(1)}/{m.group(2)}: loss {m.group(3)}\n")
            sys.stderr.flush()

    th = threading.Thread(target=pump, daemon=True)
    th.start()
    try:
        out.returncode = proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_group(proc)
        out.timed_out = True
        out.returncode = proc.returncode
    th.join(10)
    return out


__all__ = ["ATTENTION", "ENV_SOURCE", "MASK_NOTE", "MegaTrainError", "OPTIMIZER", "PRECISION", "RECIPE", "main",
           "patch_layer_mask",
           "find_source", "megatrain_config", "optimizer_steps", "parse_log", "recipe_shape", "run",
           "sample_text", "write_dataset", "write_model_dir", "write_tokenizer"]


if __name__ == "__main__":
    sys.exit(main())
