"""The `train` command's flags, their checks and the engine config they make: one module that both
runs of `pyinfinity train` use (the built-in corpus, ``train.py``; a model directory and your data,
``finetune.py``), so neither imports the other's helpers.

Every mistake a flag can hold is found here, before a model is built or a file is read: a bad
number by its flag's name, a ``--model`` that is not a local model directory (nothing is ever
downloaded), a ``--resume`` that is not a checkpoint, a ``--config`` that is not JSON.
"""
from __future__ import annotations

import argparse
import copy
import json
import logging
import os
from typing import Any, Optional

from pyinfinity.cli.errors import UsageError

from pyinfinity.presets import NAMES

# flags whose default is applied after parsing, so that a flag given on the command line can be
# told from one left out (with --config, only the given ones override the file)
DEFAULTS: dict[str, Any] = {"steps": 20, "batch": 4, "grad_accum": 1, "lr": 3e-4, "clip": 1.0, "warmup": 5,
                            "offload": "auto", "optimizer_nvme_ratio": 1.0, "optimizer_step": "cpu",
                            "device": "auto", "device_memory": "auto", "dtype": "auto", "optimizer_state": "fp32"}

# flag dest -> the config keys it sets (dotted); --config's file keeps the rest
FLAG_KEYS: dict[str, tuple[str, ...]] = {
    "batch": ("train_micro_batch_size_per_gpu",),
    "grad_accum": ("gradient_accumulation_steps",),
    "lr": ("optimizer.params.lr",),
    "clip": ("gradient_clipping",),
    "steps": ("scheduler",),
    "warmup": ("scheduler",),
    "offload": ("zero_optimization.offload_param.device", "zero_optimization.offload_param.max_in_cpu"),
    "offload_optimizer": ("zero_optimization.offload_optimizer.device",),
    "optimizer_nvme_ratio": ("zero_optimization.offload_optimizer.ratio",),
    "optimizer_step": ("pyinfinity.optimizer_step_device",),
    "nvme": ("zero_optimization.offload_param.nvme_path", "zero_optimization.offload_optimizer.nvme_path"),
    "device_memory": ("pyinfinity.device_memory",),
    "dtype": ("bf16.enabled", "fp16"),  # a config's bf16 state keys stay (and need bf16)
    "optimizer_state": ("pyinfinity.optimizer_state", "bf16.bf16_master_weights_and_grads",
                        "bf16.bf16_optimizer_states"),
    "no_prefetch": ("pyinfinity.prefetch",),
}


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Every `pyinfinity train` flag (both runs)."""
    p.add_argument("--config", metavar="FILE",
                   help="a DeepSpeed-format config to train with, e.g. the one `pyinfinity plan -o FILE` writes; "
                        "the flags given on the command line override its values")
    p.add_argument("--model-size", default="tiny", choices=NAMES,
                   help="preset (pyinfinity.presets; the corpus's byte vocabulary); --hidden/--layers override")
    p.add_argument("--hidden", type=int, help="hidden size")
    p.add_argument("--layers", type=int, help="decoder layers")
    p.add_argument("--heads", type=int, help="attention heads")
    p.add_argument("--intermediate", type=int, help="MLP intermediate size")
    p.add_argument("--steps", type=int, help="optimizer steps (default 20)")
    p.add_argument("--seq", type=int, default=256, help="sequence length (bytes, or tokens with --model; default 256)")
    p.add_argument("--batch", type=int, help="micro-batch size (default 4)")
    p.add_argument("--grad-accum", type=int, help="gradient accumulation steps (default 1)")
    p.add_argument("--tokens-per-step", type=int, metavar="N",
                   help="tokens an optimizer step: the planner chooses the micro-batch (the one it predicts fastest "
                        "among those that fit the device beside the placement, the larger among ties), the "
                        "accumulation (N / (micro-batch x --seq), rounded up: the run says when it does not divide) "
                        "and activation checkpointing, keeping whichever of --batch, --grad-accum and "
                        "--checkpoint-activations you give (--batch and --grad-accum together must multiply out to N)")
    p.add_argument("--lr", type=float, help="peak learning rate (default 3e-4)")
    p.add_argument("--clip", type=float, metavar="NORM",
                   help="gradient clipping to this global norm (default 1.0; 0: off, which lets the optimizer step "
                        "overlap backward, pyinfinity.overlap_step)")
    p.add_argument("--warmup", type=int, help="warm-up steps of the lr schedule (default 5; linear from the first "
                   "step's peak/N, then cosine decay: LinearWarmupCosineLR)")
    p.add_argument("--offload", choices=["none", "cpu", "nvme", "auto"],
                   help="where parameters and optimizer states live (default auto; nvme needs --nvme)")
    p.add_argument("--offload-optimizer", choices=["cpu", "nvme", "auto"],
                   help="optimizer-state tier if different from --offload")
    p.add_argument("--optimizer-nvme-ratio", type=float, metavar="R",
                   help="with the optimizer on nvme: the fraction of its state on disk, the rest in RAM (default 1)")
    p.add_argument("--optimizer-step", choices=["cpu", "device"],
                   help="run the Adam step on the CPU (default), or stream the states to the device and step there")
    p.add_argument("--optimizer-state", choices=["fp32", "8bit", "bf16"],
                   help="the optimizer state's format: fp32 (default, exact), 8bit (fp32 master, Adam's moments "
                        "block-wise quantised to a byte), bf16 (a bf16 master and bf16 moments; needs bf16 "
                        "compute): docs/optimizer_state.md")
    p.add_argument("--nvme", action="append", metavar="DIR",
                   help="swap directory (repeat to stripe over several drives); created if missing, with a "
                        "warning naming its filesystem, and removed at the end")
    p.add_argument("--device", help="compute device: cpu, cuda, cuda:N or auto (default: cuda when present)")
    p.add_argument("--gpu-memory", "--device-memory", dest="device_memory", metavar="SIZE|none",
                   help="device memory budget, e.g. 8GiB; none (the default) = the whole device (its free memory, "
                        "measured)")
    p.add_argument("--dtype", choices=["auto", "fp32", "bf16", "fp16"],
                   help="compute dtype (default auto: bf16 on a GPU, fp32 on the CPU; with --lora/--adapter each "
                        "parameter's own, as PEFT trains: the frozen base in the checkpoint's dtype, the adapters "
                        "in fp32)")
    p.add_argument("--checkpoint-activations", action="store_true", help="recompute activations in backward")
    p.add_argument("--no-prefetch", action="store_true", help="fetch every shard on demand")
    p.add_argument("--corpus-bytes", default="16MB", help="how much of the stdlib sources to read")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--save", metavar="DIR", help="save a checkpoint there at the end (DIR/global_stepN, "
                                                 "DIR/latest names the newest)")
    p.add_argument("--save-every", type=int, default=0, metavar="N",
                   help="with --save: also save a checkpoint every N optimizer steps")
    p.add_argument("--blocking-saves", action="store_true",
                   help="with --save-every: each periodic save stops training until it is written (default: it "
                        "is written in the background while training goes on, DIR/latest moved once it is complete)")
    p.add_argument("--save-total-limit", type=int, default=None, metavar="N",
                   help="with --save: keep only the newest N checkpoints there; the oldest is removed once a "
                        "new one is complete and fsynced and DIR/latest names it (Trainer's save_total_limit)")
    p.add_argument("--resume", metavar="DIR",
                   help="continue the run saved there (a --save directory, or one of its global_stepN): "
                        "the step count, LR schedule, optimizer state and data position carry on; give the "
                        "same flags as the first run")
    p.add_argument("--resume-convert", action="store_true",
                   help="with --resume: convert a checkpoint whose optimizer state is of another format than "
                        "this run's (--optimizer-state) into this run's (decoded to fp32, encoded again); without "
                        "it such a resume is refused")
    p.add_argument("--resume-reschedule", action="store_true",
                   help="with --resume: continue a run under another learning-rate schedule than it was saved with "
                        "(a --steps or --warmup of its own, or another --config scheduler): the lr moves to the new "
                        "schedule's value at the checkpoint's step; without it such a resume is refused")
    p.add_argument("--resume-replan", action="store_true",
                   help="with --resume: plan the placement anew on this machine instead of keeping the one the "
                        "checkpoint was saved under (which keeps a resumed run bit for bit the run it continues); "
                        "e.g. on a larger machine. A saved placement that does not fit is planned anew all the same, "
                        "with a warning")
    p.add_argument("--export", metavar="DIR", help="export the trained weights (safetensors) there")
    p.add_argument("--json", metavar="FILE", help="write the run's telemetry as JSON")
    p.add_argument("--no-progress", action="store_true",
                   help="no progress bar (it is off anyway when stderr is not a terminal, e.g. a log file)")
    g = p.add_argument_group("fine-tuning a pretrained model on your data")
    g.add_argument("--model", metavar="DIR",
                   help="a local transformers model directory (config.json, safetensors, tokenizer files) to start "
                        "from; nothing is downloaded")
    g.add_argument("--data", metavar="FILE", help="UTF-8 text file, or JSON lines (.jsonl) with a text field, to "
                                                  "train on")
    g.add_argument("--data-field", default="text", metavar="F", help="the JSON-lines field that holds the text")
    g.add_argument("--eval-every", type=int, default=0, metavar="N",
                   help="eval loss on the held-out blocks every N optimizer steps (0: at the end only)")
    g.add_argument("--eval-fraction", type=float, default=0.05, metavar="R",
                   help="share of the data's blocks held out for the eval loss")
    g.add_argument("--model-dtype", choices=["auto", "fp32", "bf16", "fp16"],
                   help="dtype the model is built and exported in (auto: config.json's torch_dtype, as transformers' "
                        "dtype='auto'; default fp32, auto with --lora/--adapter, whose base stays frozen); the "
                        "optimizer keeps fp32 masters either way")
    g.add_argument("--stop-after", type=int, metavar="N",
                   help="stop after N optimizer steps of this run (the schedule still spans --steps; with --save, "
                        "a later --resume continues)")


    g = p.add_argument_group("LoRA adapters (PEFT; with --model): the base stays frozen, only the adapters train")
    g.add_argument("--lora", type=int, metavar="R", help="train new LoRA adapters of rank R over the frozen model")
    g.add_argument("--lora-alpha", type=float, metavar="A", help="LoRA alpha: the update is scaled by A/R (default 2R)")
    g.add_argument("--lora-dropout", type=float, metavar="P", help="dropout on the adapters' input (default 0)")
    g.add_argument("--lora-targets", metavar="NAMES",
                   help="the layers that get adapters: comma-separated module names (e.g. q_proj,v_proj) or "
                        "all-linear (default: PEFT's default for the architecture)")
    g.add_argument("--adapter", metavar="DIR",
                   help="continue training the PEFT adapter saved there (adapter_config.json and its weights; "
                        "an --export of a LoRA run) instead of starting new ones")
    g.add_argument("--merge-adapters", action="store_true",
                   help="with --export: write the model with the adapters merged into its weights (loadable by "
                        "from_pretrained) instead of the adapters alone (loadable by PeftModel.from_pretrained)")


def check_lora_arguments(args: argparse.Namespace) -> None:
    """The LoRA flags: each needs what it acts on, values in range, peft importable."""
    lora, adapter = getattr(args, "lora", None), getattr(args, "adapter", None)
    for flag, dest in (("--lora-alpha", "lora_alpha"), ("--lora-dropout", "lora_dropout"),
                       ("--lora-targets", "lora_targets")):
        if getattr(args, dest, None) is not None and lora is None:
            raise UsageError(f"{flag}: needs --lora R (the rank of the new adapters)")
    if getattr(args, "merge_adapters", False):
        if lora is None and adapter is None:
            raise UsageError("--merge-adapters: needs --lora R or --adapter DIR (there are no adapters to merge)")
        if not args.export:
            raise UsageError("--merge-adapters: needs --export DIR (where the merged model is written)")
    if lora is None and adapter is None:
        return
    which = "--lora" if lora is not None else "--adapter"
    if lora is not None and adapter is not None:
        raise UsageError("--lora and --adapter: give one (--adapter continues an adapter with its own rank and "
                         "targets, --lora starts new ones)")
    if not args.model:
        raise UsageError(f"{which}: needs --model DIR (adapters train over a pretrained model)")
    if lora is not None and lora < 1:
        raise UsageError(f"--lora: {lora} must be >= 1")
    if args.lora_alpha is not None and args.lora_alpha <= 0:
        raise UsageError(f"--lora-alpha: {args.lora_alpha} must be positive")
    if args.lora_dropout is not None and not 0 <= args.lora_dropout < 1:
        raise UsageError(f"--lora-dropout: {args.lora_dropout} must be in [0, 1)")
    if args.lora_targets is not None and not all(t.strip() for t in args.lora_targets.split(",")):
        raise UsageError(f"--lora-targets: {args.lora_targets!r} has an empty name (give e.g. q_proj,v_proj or all-linear)")
    if adapter is not None and not os.path.isfile(os.path.join(adapter, "adapter_config.json")):
        raise UsageError(f"--adapter: {adapter} is not a PEFT adapter directory (no adapter_config.json)")
    try:
        import peft  # noqa: F401
    except ImportError:
        raise UsageError(f"{which}: needs the peft package (pip install peft)") from None


def lora_config(args: argparse.Namespace) -> Any:
    """The ``peft.LoraConfig`` of --lora and its flags (None without --lora)."""
    if getattr(args, "lora", None) is None:
        return None
    from peft import LoraConfig

    targets = args.lora_targets
    if targets is not None and targets != "all-linear":
        targets = [t.strip() for t in targets.split(",")]
    return LoraConfig(r=args.lora, lora_alpha=args.lora_alpha if args.lora_alpha is not None else 2 * args.lora,
                      lora_dropout=args.lora_dropout or 0.0, target_modules=targets, task_type="CAUSAL_LM")


def apply_defaults(args: argparse.Namespace) -> None:
    """Fills the flags left out with their defaults; ``args.given`` names the ones given."""
    if getattr(args, "given", None) is not None:
        return
    args.given = {k for k in DEFAULTS if getattr(args, k, None) is not None}
    args.given |= {k for k in ("offload_optimizer", "nvme") if getattr(args, k, None)}
    if getattr(args, "no_prefetch", False):
        args.given.add("no_prefetch")
    for k, v in DEFAULTS.items():
        if getattr(args, k, None) is None:
            setattr(args, k, v)


def check_arguments(args: argparse.Namespace) -> tuple[Optional[str], Optional[str]]:
    """Every flag checked before anything is built or read; returns --resume's (save_dir, tag)."""
    apply_defaults(args)
    for flag, value, low in (("--steps", args.steps, 1), ("--seq", args.seq, 1), ("--batch", args.batch, 1),
                             ("--grad-accum", args.grad_accum, 1), ("--warmup", args.warmup, 0),
                             ("--save-every", args.save_every, 0), ("--eval-every", args.eval_every, 0)):
        if value < low:
            raise UsageError(f"{flag}: {value} must be >= {low}")
    if "device_memory" in args.given:
        from pyinfinity.config import ConfigError, device_budget

        try:
            device_budget(args.device_memory, "--gpu-memory")
        except ConfigError as exc:
            raise UsageError(str(exc)) from None
    tps = getattr(args, "tokens_per_step", None)
    if tps is not None:
        from pyinfinity.plan.step_shape import step_shape_refusal

        if tps < 1:
            raise UsageError(f"--tokens-per-step: {tps} must be >= 1")
        why = step_shape_refusal(tps, args.seq, args.batch if "batch" in args.given else None,
                                 args.grad_accum if "grad_accum" in args.given else None)
        if why:
            raise UsageError(why)
    if args.stop_after is not None and args.stop_after < 1:
        raise UsageError(f"--stop-after: {args.stop_after} must be >= 1")
    if args.clip < 0:
        raise UsageError(f"--clip: {args.clip} must be 0 (off) or positive")
    if not 0 <= args.eval_fraction < 1:
        raise UsageError(f"--eval-fraction: {args.eval_fraction} must be in [0, 1)")
    if args.resume_convert and not args.resume:
        raise UsageError("--resume-convert: needs --resume DIR (the checkpoint to convert)")
    if args.resume_reschedule and not args.resume:
        raise UsageError("--resume-reschedule: needs --resume DIR (the run to continue on a new schedule)")
    if args.resume_replan and not args.resume:
        raise UsageError("--resume-replan: needs --resume DIR (the run whose placement to plan anew)")
    if args.save_every and not args.save:
        raise UsageError("--save-every: needs --save DIR (where to write the checkpoints)")
    if args.blocking_saves and not args.save_every:
        raise UsageError("--blocking-saves: needs --save-every N (the periodic saves it makes blocking)")
    if args.save_total_limit is not None:
        if args.save_total_limit < 1:
            raise UsageError(f"--save-total-limit: {args.save_total_limit} must be >= 1 (the checkpoints kept)")
        if not args.save:
            raise UsageError("--save-total-limit: needs --save DIR (the checkpoints it keeps)")
    if bool(args.model) != bool(args.data):
        raise UsageError("--model and --data go together: a model directory to start from and the data to train on")
    if args.model:
        check_model_dir(args.model)
        from pyinfinity.data import check_data_file

        check_data_file(args.data)  # a directory, a device or a FIFO is named as such
    if args.config and not os.path.isfile(args.config):
        raise UsageError(f"--config: {args.config}: no such file")
    check_lora_arguments(args)
    return checkpoint_location(args.resume) if args.resume else (None, None)


def check_model_dir(path: str) -> None:
    """UsageError unless ``path`` is a local transformers model directory (no network, ever)."""
    if not os.path.isdir(path):
        what = "is a file" if os.path.exists(path) else "no such directory"
        raise UsageError(f"--model: {path}: {what} (a local transformers model directory with config.json, "
                         "safetensors and tokenizer files is needed; nothing is downloaded: fetch a Hub model "
                         "first, e.g. `huggingface-cli download REPO --local-dir DIR`)")
    cfg = os.path.join(path, "config.json")
    if not os.path.isfile(cfg):
        raise UsageError(f"--model: {path} is not a transformers model directory: no config.json (save one with "
                         "model.save_pretrained(DIR))")
    try:
        with open(cfg, "rb") as f:
            parsed = json.loads(f.read())
    except ValueError as exc:  # JSONDecodeError, UnicodeDecodeError
        raise UsageError(f"--model: {cfg}: the model's config is not valid JSON ({exc}): damaged or not a "
                         "transformers config") from None
    if not isinstance(parsed, dict):
        raise UsageError(f"--model: {cfg}: the model's config is a JSON {type(parsed).__name__}, not an object")


def checkpoint_location(path: str) -> tuple[str, Optional[str]]:
    """(save_dir, tag) of a --resume argument: a --save directory (its ``latest``) or one tag in it."""
    path = os.path.abspath(path)
    if os.path.isfile(os.path.join(path, "meta.json")):
        return os.path.dirname(path), os.path.basename(path)
    if os.path.isfile(os.path.join(path, "latest")):
        return path, None
    raise UsageError(f"--resume: {path} is not a checkpoint (expected a --save directory holding 'latest', or "
                     "one of its global_stepN directories)")


def resolve_device(spec: str) -> str:
    """The device ``spec`` names on this machine: ``auto`` and ``cuda`` become the GPU with its
    index (``LOCAL_RANK`` under torchrun), ``auto`` the CPU without one; a device this machine
    lacks is refused."""
    from pyinfinity.cli.errors import check_device_here

    return check_device_here(spec)


def build_config(args: argparse.Namespace, device: str) -> dict:
    """The engine config the flags describe (DeepSpeed format)."""
    apply_defaults(args)
    opt_tier = args.offload_optimizer or ("cpu" if args.offload == "none" else args.offload)
    nvme = args.nvme
    if "nvme" in (args.offload, opt_tier) and not nvme:
        raise UsageError("--nvme: a swap directory is needed with --offload nvme")
    dtype = args.dtype
    if dtype == "auto":  # with adapters no cast: the base keeps the checkpoint's dtype, the adapters fp32
        adapters = getattr(args, "lora", None) is not None or getattr(args, "adapter", None) is not None
        dtype = "bf16" if device.startswith("cuda") and not adapters else "fp32"
    cfg: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": args.batch,
        "gradient_accumulation_steps": args.grad_accum,
        "gradient_clipping": args.clip,
        "optimizer": {"type": "AdamW", "params": {"lr": args.lr, "betas": [0.9, 0.95], "weight_decay": 0.1}},
        "scheduler": flag_schedule(args),
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
    if getattr(args, "save_every", 0) and not getattr(args, "blocking_saves", False):
        from pyinfinity.layout.pools import CHECKPOINT_STAGING

        cfg["pyinfinity"]["checkpoint_staging"] = CHECKPOINT_STAGING  # background saves: charged in host RAM
    if nvme:
        cfg["zero_optimization"]["offload_param"]["nvme_path"] = nvme
        cfg["zero_optimization"]["offload_optimizer"]["nvme_path"] = nvme
    if dtype == "bf16":
        cfg["bf16"] = {"enabled": True}
    elif dtype == "fp16":
        cfg["fp16"] = {"enabled": True}
    set_optimizer_state(cfg, args.optimizer_state, "--optimizer-state")
    return cfg


def flag_schedule(args: argparse.Namespace) -> dict:
    """The learning-rate schedule --steps and --warmup make (a config's ``scheduler``)."""
    return {"type": "LinearWarmupCosineLR", "params": {"total_num_steps": max(args.steps, args.warmup),
                                                       "warmup_num_steps": args.warmup}}


def _resume_meta(save_dir: str, tag: Optional[str]) -> tuple[str, dict]:
    """(the checkpoint's directory, its meta.json) of --resume's (save_dir, tag); OSError or
    ValueError when either cannot be read (the engine's load then says what is wrong)."""
    if tag is None:
        with open(os.path.join(save_dir, "latest")) as f:
            tag = f.read().strip()
    where = os.path.join(save_dir, tag)
    with open(os.path.join(where, "meta.json")) as f:
        meta = json.load(f)
    if not isinstance(meta, dict):
        raise ValueError(f"{where}/meta.json: not an object")
    return where, meta


def keep_saved_placement(args: argparse.Namespace, cfg: dict, device: str, model: Any, save_dir: str,
                         tag: Optional[str]) -> dict:
    """The engine config of a resumed run: ``cfg`` with the placement the checkpoint was saved
    under (``config.PLACEMENT_KEYS``, recorded at save time) for every key ``cfg`` leaves "auto" or
    out, so each shard is stored and stepped where it was and the run continues bit for bit; the
    config's own values win. ``cfg`` as it is with --resume-replan, for a checkpoint that records
    no placement, or (a warning) when the saved placement does not fit this machine
    (``plan.resolve.check_placement``: host RAM, swap space, the device)."""
    if args.resume_replan:
        return cfg
    try:
        where, meta = _resume_meta(save_dir, tag)
    except (OSError, ValueError):
        return cfg  # the engine's load says what is wrong with it
    saved = meta.get("placement")
    if not isinstance(saved, dict):
        return cfg
    from pyinfinity.config import AUTO, PLACEMENT_KEYS, load_config
    from pyinfinity.layout.charges import PlanError
    from pyinfinity.plan.resolve import check_placement
    from pyinfinity.zero.partition import compute_dtype_for

    log = logging.getLogger(__name__)
    parsed = load_config(cfg)
    mine = {str(compute_dtype_for(p.dtype, parsed.fp16.enabled, parsed.bf16.enabled)) for p in model.parameters()}
    theirs = {s.get("dtype") for s in meta.get("shards") or [] if isinstance(s, dict)}
    if mine != theirs:  # the units are cut by bytes: in another dtype the same unit_bytes cuts them otherwise
        log.info("--resume: %s was saved computing in %s, this run computes in %s: its placement is planned anew",
                 where, ", ".join(sorted(map(str, theirs))), ", ".join(sorted(mine)))
        return cfg
    out, kept = copy.deepcopy(cfg), []
    for key in PLACEMENT_KEYS:
        if key in saved and saved[key] != AUTO and _get(out, key) in (None, AUTO):
            _put(out, key, saved[key])
            kept.append(key)
    if not kept:
        return cfg
    try:
        check_placement(load_config(out), model, device, seq_len=args.seq,
                        checkpointing=bool(args.checkpoint_activations))
    except (PlanError, OSError, ValueError) as exc:
        log.warning("--resume: the placement %s was saved under cannot be kept here (%s): planned anew; the "
                    "run continues from the checkpoint, not bit for bit where a shard now steps elsewhere", where,
                    str(exc).splitlines()[0])
        return cfg
    log.info("--resume: the placement %s was saved under is kept (%d keys: each shard stored and stepped where it "
             "was; --resume-replan plans anew)", where, len(kept))
    return out


def resume_status(args: argparse.Namespace, save_dir: str, tag: Optional[str]) -> Optional[str]:
    """What --resume's checkpoint says before anything is built: a line saying the run is already
    complete (its step is at --steps: nothing to train), else None. A run whose learning-rate
    schedule (``scheduler`` as its checkpoint records it) is not the one this run would make is
    refused without --resume-reschedule (with it, a warning): the lr would jump at the first step."""
    import types

    from pyinfinity.config import parse_scheduler
    from pyinfinity.zero.lr_schedules import build_scheduler

    try:
        where, meta = _resume_meta(save_dir, tag)
        step, saved = int(meta["global_steps"]), (meta.get("hyperparameters") or {})
    except (OSError, ValueError, KeyError, TypeError):
        return None  # the engine's load says what is wrong with it
    if step >= args.steps:
        return (f"--resume: the run saved in {where} is already complete: at step {step}, --steps {args.steps}; "
                "nothing to train (to train it further: a larger --steps with --resume-reschedule)")
    file_cfg = read_config_file(args.config) if args.config else {}
    mine = (file_cfg["scheduler"] if "scheduler" in file_cfg and not args.given & {"steps", "warmup"}
            else flag_schedule(args))
    lr = args.lr if "lr" in args.given or not file_cfg else (_get(file_cfg, "optimizer.params.lr") or args.lr)
    old = saved.get("scheduler")
    try:
        new = parse_scheduler(mine)
    except ValueError:
        return None  # the engine's config check names it
    if not isinstance(old, dict) or (old.get("type"), old.get("params")) == (new.type, new.params):
        return None
    flags = (meta.get("client_state") or {}).get("flags")
    if isinstance(flags, dict) and any(getattr(args, k, None) != v for k, v in flags.items()):
        return None  # other data or schedule flags: refused after the load, each named

    def next_lr(sched_type: str, params: dict, peak: float) -> float:
        group = types.SimpleNamespace(param_groups=[{"lr": peak}])
        return build_scheduler(sched_type, group, {**params, "last_batch_iteration": step - 1}).get_last_lr()[0]

    try:
        was, now = next_lr(old["type"], old["params"], float(saved.get("lr", lr))), next_lr(new.type, new.params, lr)
    except (TypeError, ValueError, KeyError):
        was = now = None
    if old.get("type") != new.type:
        change = f"{old.get('type')}, this run's {new.type}"
    else:
        was_p = old.get("params") or {}
        change = f"{new.type} " + ", ".join(f"{k} {was_p.get(k)}, this run's {v}" for k, v in new.params.items()
                                            if was_p.get(k) != v)
    jump = "" if was is None else f"; the lr of step {step + 1} would go from {was:.3g} to {now:.3g}"
    what = f"--resume: {where} was saved by a run with another learning-rate schedule ({change}){jump}"
    if not args.resume_reschedule:
        raise UsageError(f"{what}: give the first run's --steps/--warmup to finish it on its schedule, or "
                         "--resume-reschedule to continue on the new one")
    logging.getLogger(__name__).warning("%s (--resume-reschedule: the new schedule is used from step %d)",
                                        what, step + 1)
    return None


def set_optimizer_state(cfg: dict, state: str, flag: str) -> None:
    """Writes the optimizer-state format ``state`` ("fp32", "8bit", "bf16") into a config dict:
    ``pyinfinity.optimizer_state``, or for bf16 DeepSpeed's two ``bf16`` keys (which need bf16
    compute). Shared by `train` and `plan`."""
    bf16 = cfg.get("bf16") or {}
    if state == "bf16":
        if not bf16.get("enabled"):
            raise UsageError(f"{flag} bf16: the bf16 weights are the master, so the compute dtype must be bf16 "
                             "(--dtype bf16)")
        bf16["bf16_master_weights_and_grads"] = bf16["bf16_optimizer_states"] = True
        cfg.setdefault("pyinfinity", {}).pop("optimizer_state", None)
        return
    for key in ("bf16_master_weights_and_grads", "bf16_optimizer_states"):
        bf16.pop(key, None)
    cfg.setdefault("pyinfinity", {})["optimizer_state"] = state


def _get(d: dict, dotted: str) -> Any:
    for part in dotted.split("."):
        if not isinstance(d, dict) or part not in d:
            return None
        d = d[part]
    return d


def _put(d: dict, dotted: str, value: Any) -> None:
    *head, last = dotted.split(".")
    for part in head:
        d = d.setdefault(part, {})
    if value is None:
        d.pop(last, None)
    else:
        d[last] = copy.deepcopy(value)


def read_config_file(path: str) -> dict:
    try:
        with open(path) as f:
            cfg = json.load(f)
    except json.JSONDecodeError as exc:
        raise UsageError(f"--config: {path}: not valid JSON ({exc.msg} at line {exc.lineno})") from exc
    if not isinstance(cfg, dict):
        raise UsageError(f"--config: {path}: a JSON object (a DeepSpeed-format config) is needed")
    return cfg


def engine_config(args: argparse.Namespace) -> tuple[dict, str]:
    """(the engine config, the compute device) of a run: the flags' config, or with --config the
    file's, the flags given on the command line overriding it (an optimizer or scheduler the file
    lacks is the flags'; one INFO line names each value of the file that replaces a default of
    train's). ``args.batch`` and ``args.grad_accum`` follow the result (the data is drawn to its
    micro-batch)."""
    apply_defaults(args)
    if not args.config:
        device = resolve_device(args.device)
        return build_config(args, device), device
    file_cfg = read_config_file(args.config)
    spec = args.device if "device" in args.given else (_get(file_cfg, "pyinfinity.device") or "auto")
    device = resolve_device(str(spec))
    flag_cfg = build_config(args, device)
    cfg = copy.deepcopy(file_cfg)
    given = set(args.given)
    if "offload" in given and "offload_optimizer" not in given:
        given.add("offload_optimizer")  # --offload places both, as without --config
    for section in ("optimizer", "scheduler"):  # what the file leaves out is train's own, as without --config
        if section not in cfg:
            cfg[section] = copy.deepcopy(flag_cfg[section])
    for dest in given:
        for key in FLAG_KEYS.get(dest, ()):
            _put(cfg, key, _get(flag_cfg, key))
    if given & {"batch", "grad_accum"}:
        cfg.pop("train_batch_size", None)
    overrides = config_overrides(file_cfg, flag_cfg, given)
    if overrides:
        logging.getLogger(__name__).info("--config %s sets, instead of train's defaults (a flag given on the command "
                                         "line would win): %s", args.config, "; ".join(overrides))
    _put(cfg, "pyinfinity.device", device)
    if _get(cfg, "pyinfinity.checkpoint_staging") in (None, "auto") and _get(flag_cfg, "pyinfinity.checkpoint_staging"):
        _put(cfg, "pyinfinity.checkpoint_staging", _get(flag_cfg, "pyinfinity.checkpoint_staging"))
    if _get(cfg, "pyinfinity.log_every") is None:
        _put(cfg, "pyinfinity.log_every", _get(flag_cfg, "pyinfinity.log_every"))
    gas = int(cfg.get("gradient_accumulation_steps") or 1)
    if "train_micro_batch_size_per_gpu" not in cfg and "train_batch_size" in cfg:
        cfg["train_micro_batch_size_per_gpu"] = max(1, int(cfg["train_batch_size"]) // gas)
    args.batch = int(cfg.get("train_micro_batch_size_per_gpu") or args.batch)
    args.grad_accum = gas
    return cfg, device


def apply_tokens_per_step(args: argparse.Namespace, cfg: dict, device: str, model: Any) -> None:
    """With --tokens-per-step: the micro-batch, accumulation and checkpointing the planner chooses
    for ``model`` (a module, or a transformers config dict) under ``cfg`` on ``device``
    (``plan.step_shape.plan_step_shape``), written into ``cfg`` and ``args``, and logged."""
    tokens = getattr(args, "tokens_per_step", None)
    if tokens is None:
        return
    from pyinfinity.layout.charges import PlanError
    from pyinfinity.plan.step_shape import plan_step_shape
    from pyinfinity.probes import MachineProbes

    given = args.given
    try:
        shape = plan_step_shape(cfg, model, device, tokens, args.seq, probes=MachineProbes(),
                                micro_batch=args.batch if "batch" in given else None,
                                grad_accum=args.grad_accum if "grad_accum" in given else None,
                                checkpointing=True if args.checkpoint_activations else None)
    except PlanError as exc:
        raise UsageError(f"--tokens-per-step {tokens}: {exc}") from None
    cfg["train_micro_batch_size_per_gpu"] = args.batch = shape.micro_batch
    cfg["gradient_accumulation_steps"] = args.grad_accum = shape.grad_accum
    cfg.pop("train_batch_size", None)
    args.checkpoint_activations = shape.checkpointing
    logging.getLogger(__name__).info("--tokens-per-step %d: %s (%s)", tokens, shape.describe(),
                                     shape.placement.predicted.breakdown() if shape.placement else "")


def config_overrides(file_cfg: dict, flag_cfg: dict, given: set) -> list[str]:
    """The values of a --config file that replace what train's flags, left at their defaults,
    would set: one "key value (--flag default: value)" each."""
    out, seen = [], set()
    for dest, keys in FLAG_KEYS.items():
        if dest in given:
            continue
        for key in keys:
            mine, theirs = _get(flag_cfg, key), _get(file_cfg, key)
            if key in seen or theirs is None or theirs == mine:
                continue
            seen.add(key)
            flag, default = f"--{dest.replace('_', '-')}", DEFAULTS.get(dest)
            if default is not None and mine == default:
                was = f"{flag} {default}"
            else:
                was = f"{flag + ' ' + str(default) + ': ' if default is not None else ''}" \
                      f"{'not set' if mine is None else json.dumps(mine)}"
            out.append(f"{key} {json.dumps(theirs)} (train's {was})")
    return out


def exported_line(out_dir: str, files: list, cfg: dict) -> str:
    """What an export wrote: its directory and the dtypes of its safetensors (read from their
    headers), and when they are not the run's compute dtype, that they are the model's own."""
    dtypes: set[str] = set()
    for path in files:
        if str(path).endswith(".safetensors"):
            with open(path, "rb") as f:
                header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
            dtypes |= {v["dtype"] for k, v in header.items() if k != "__metadata__"}
    names = {"F32": "fp32", "BF16": "bf16", "F16": "fp16"}
    written = sorted(names.get(d, d.lower()) for d in dtypes)
    compute = "bf16" if _get(cfg, "bf16.enabled") else "fp16" if _get(cfg, "fp16.enabled") else "fp32"
    line = f"exported {out_dir}: safetensors in {', '.join(written) or 'no tensors'}"
    if written and written != [compute]:
        line += (f" (the model's own dtype, from the fp32 masters; the run computed in {compute}; a --model run "
                 "exports in --model-dtype)")
    return line


def mean(xs: list) -> Optional[float]:
    """The mean of the values that are not None (None when there are none)."""
    xs = [x for x in xs if x is not None]
    return sum(xs) / len(xs) if xs else None
