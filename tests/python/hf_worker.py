"""The runs of test_hf_engine.py, each in its own interpreter (DeepSpeed's, Accelerate's and
transformers' process-global state must not leak between them): a tiny Llama trained on
pyinfinity's engine through Hugging Face Trainer, TRL's SFTTrainer or an Accelerate loop, with
parameters and optimizer on the NVMe tier. ``python hf_worker.py PHASE OUT_DIR [options]`` writes
OUT_DIR/result.json."""
from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from pathlib import Path

import pyinfinity  # noqa: F401  the one line: deepspeed.initialize now routes a "pyinfinity" config
import torch

VOCAB, SEQ, SAMPLES, MICRO, ACCUM = 256, 16, 24, 2, 2
STEPS = SAMPLES // (MICRO * ACCUM)
LR, WARMUP, CLIP = 1e-3, 2, 1.0
DEVICE = "cpu"  # pyinfinity.device of every run (--device: cuda for the GPU suite)


def llama_config():
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=64)


def write_base(path: Path) -> Path:
    """A random-init Llama checkpoint (safetensors), the same in every run."""
    from transformers import LlamaForCausalLM

    if not (path / "config.json").exists():
        torch.manual_seed(0)
        LlamaForCausalLM(llama_config()).save_pretrained(str(path))
    return path


def samples() -> list:
    g = torch.Generator().manual_seed(1)
    return [{"input_ids": (ids := torch.randint(0, VOCAB, (SEQ,), generator=g)), "labels": ids.clone()}
            for _ in range(SAMPLES)]


def ds_config(nvme: Path, gather: bool) -> dict:
    """A user's ZeRO-3 NVMe offload config, plus the section that selects pyinfinity's engine."""
    return {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
            "gradient_clipping": "auto", "bf16": {"enabled": "auto"},
            "zero_optimization": {"stage": 3, "offload_param": {"device": "nvme", "nvme_path": str(nvme)},
                                  "offload_optimizer": {"device": "nvme", "nvme_path": str(nvme)},
                                  "stage3_param_persistence_threshold": "auto",
                                  "stage3_gather_16bit_weights_on_model_save": gather},
            "pyinfinity": {"device": DEVICE}}


class SkippedSaves(logging.Handler):
    """Counts the facade's "not written again" notes (Trainer's second save_checkpoint of a step)."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.count = 0

    def emit(self, record: logging.LogRecord) -> None:
        if "not written again" in record.getMessage():
            self.count += 1


def log_series(trainer) -> dict:
    h = [x for x in trainer.state.log_history if "loss" in x]
    return {"losses": [x["loss"] for x in h], "grad_norms": [x["grad_norm"] for x in h],
            "lrs": [x["learning_rate"] for x in h], "steps": [x["step"] for x in h]}


def trainer_args(out: Path, config: dict, **kw):
    from transformers import TrainingArguments

    return TrainingArguments(output_dir=str(out / "trainer"), per_device_train_batch_size=MICRO,
                             gradient_accumulation_steps=ACCUM, max_steps=STEPS, learning_rate=LR,
                             warmup_steps=WARMUP, lr_scheduler_type="cosine", max_grad_norm=CLIP,
                             use_cpu=DEVICE == "cpu", deepspeed=config, report_to=[], logging_steps=1, save_steps=2,
                             save_total_limit=2, seed=0, disable_tqdm=True, **kw)


def fast_group(model) -> tuple[list, list]:
    """(the rest, the q_proj weights): the parameters of ``--fast-lr-ratio``'s two groups (LoRA+ style:
    one group of each decoder layer's unit steps with another lr)."""
    fast = [p for n, p in model.named_parameters() if "q_proj" in n]
    return [p for n, p in model.named_parameters() if "q_proj" not in n], fast


def own_loop(model, batches: list, nvme: Path, weight_decay: float = 0.0, decayed: tuple = (),
             fast_lr_ratio: float = 0.0) -> dict:
    """pyinfinity's own training loop on the batches Trainer drew, with Trainer's schedule; with
    ``weight_decay``, only the parameters named in ``decayed`` decay (Trainer's two groups); with
    ``fast_lr_ratio``, the q_proj weights are a group of that many times the lr."""
    from transformers import get_cosine_schedule_with_warmup

    cfg = {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": ACCUM, "gradient_clipping": CLIP,
           "optimizer": {"type": "AdamW", "params": {"lr": LR, "betas": [0.9, 0.999], "eps": 1e-8,
                                                           "weight_decay": weight_decay}},
           "zero_optimization": {"stage": 3, "offload_param": {"device": "nvme", "nvme_path": str(nvme)},
                                 "offload_optimizer": {"device": "nvme", "nvme_path": str(nvme)}},
           "pyinfinity": {"device": DEVICE}}
    shadow = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=LR)  # only its lr: the schedule's value
    sched = get_cosine_schedule_with_warmup(shadow, WARMUP, STEPS)
    engine = pyinfinity.initialize(model, cfg)
    if weight_decay:
        engine.optimizer.set_weight_decay({id(p): 0.0 for n, p in model.named_parameters() if n not in decayed})
    if fast_lr_ratio:
        rest, fast = fast_group(model)
        engine.optimizer.set_param_groups([{"params": rest}, {"params": fast, "lr": LR * fast_lr_ratio}])
    losses, norms = [], []
    for i, ids in enumerate(batches):
        if fast_lr_ratio:  # as Trainer's LambdaLR: each group's initial lr times the schedule's factor
            for g in engine.optimizer.param_groups:
                g["lr"] = g["initial_lr"] * (shadow.param_groups[0]["lr"] / LR)
        else:
            engine.optimizer.param_groups[0]["lr"] = shadow.param_groups[0]["lr"]
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        rec = engine.step()
        if rec is not None:
            losses.append(rec.loss)
            norms.append(rec.grad_norm)
            shadow.step()
            sched.step()
    engine.close()
    return {"losses": losses, "grad_norms": norms}


def phase_trainer(out: Path, opts: argparse.Namespace) -> dict:
    """Trainer over pyinfinity's engine: uninterrupted (and optionally compared with the own loop,
    evaluated, saved, generating), or resumed from one of its checkpoints."""
    from transformers import LlamaForCausalLM, Trainer, TrainerCallback
    from transformers.data.data_collator import default_data_collator

    base = write_base(out.parent / "base")
    own_model = LlamaForCausalLM.from_pretrained(str(base)) if opts.own else None
    config = ds_config(out / "nvme", opts.gather)
    if opts.zero_init:  # as Hugging Face documents: the arguments first, then from_pretrained under zero.Init
        args = trainer_args(out, config, weight_decay=opts.weight_decay)
        model = LlamaForCausalLM.from_pretrained(str(base))
        from transformers.integrations.deepspeed import is_deepspeed_zero3_enabled

        assert is_deepspeed_zero3_enabled() and all(p.is_meta for p in model.parameters())
    else:
        model = LlamaForCausalLM.from_pretrained(str(base))
        args = trainer_args(out, config, weight_decay=opts.weight_decay)
    batches: list = []

    def collate(features):
        batch = default_data_collator(features)
        batches.append(batch["input_ids"].clone())
        return batch

    skipped = SkippedSaves()
    logging.getLogger("pyinfinity").addHandler(skipped)
    logging.getLogger("pyinfinity").setLevel(logging.INFO)
    res: dict = {}
    (out / "nvme").mkdir(parents=True, exist_ok=True)
    data = samples()

    class TwoLrTrainer(Trainer):  # as LoRA+ and LLaMA-Factory's trainers: their own optimizer groups
        def create_optimizer(self, model=None):
            if self.optimizer is None:
                rest, fast = fast_group(self.model)
                self.optimizer = torch.optim.AdamW([{"params": rest}, {"params": fast,
                                                                        "lr": LR * opts.fast_lr_ratio}],
                                                   lr=LR, weight_decay=opts.weight_decay)
            return self.optimizer

    group_lrs: list = []

    class GroupLrs(TrainerCallback):  # each step's lr of each group, as the engine's optimizer holds them
        def on_step_end(self, args, state, control, optimizer=None, **kw):
            group_lrs.append([g["lr"] for g in optimizer.param_groups])

    trainer = (TwoLrTrainer if opts.fast_lr_ratio else Trainer)(model=model, args=args, train_dataset=data,
                                                                eval_dataset=data[:4], data_collator=collate,
                                                                callbacks=[GroupLrs()])
    trainer.train(resume_from_checkpoint=opts.resume)
    import deepspeed

    decayed = tuple(trainer.get_decay_parameter_names(trainer.model))
    res["decayed"] = [len(decayed), sum(1 for _ in trainer.model.parameters())]

    res.update(log_series(trainer), engine=type(trainer.model_wrapped).__name__,
               is_deepspeed_engine=isinstance(trainer.model_wrapped, deepspeed.DeepSpeedEngine),
               skipped_saves=skipped.count,
               checkpoints={p.name: sorted(q.name for q in p.iterdir()) for p in (out / "trainer").iterdir()
                            if p.name.startswith("checkpoint-")})
    if opts.final:
        res["eval_loss"] = trainer.evaluate()["eval_loss"]
        trainer.save_model(str(out / "final"))
        prompt = torch.tensor([[1, 2, 3, 4]])
        res["generated"] = trainer.model.generate(prompt, max_new_tokens=6, do_sample=False)[0].tolist()
    trainer.model_wrapped.destroy()
    if own_model is not None:
        (out / "nvme_own").mkdir(exist_ok=True)
        res["own"] = own_loop(own_model, batches, out / "nvme_own", opts.weight_decay, decayed, opts.fast_lr_ratio)
    res["group_lrs"] = group_lrs
    return res


def tokenizer(base: Path):
    """A word-level tokenizer over the tiny vocabulary ("t0" .. "t255"), saved beside the weights."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(VOCAB)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="t0", eos_token="t1", pad_token="t2")
    fast.save_pretrained(str(base))
    return fast


def phase_sft(out: Path, opts: argparse.Namespace) -> dict:
    """TRL's SFTTrainer over pyinfinity's engine, on text: LoRA adapters over the offloaded base
    (``--lora 1``) or a full fine-tune; the result saved with save_model."""
    from datasets import Dataset
    from transformers import LlamaForCausalLM
    from trl import SFTConfig, SFTTrainer

    base = write_base(out.parent / "base")
    tok = tokenizer(base)
    # --zero-init: SFTTrainer given the directory loads it itself, after its arguments (under zero.Init)
    model = str(base) if opts.zero_init else LlamaForCausalLM.from_pretrained(str(base))
    g = torch.Generator().manual_seed(2)
    texts = [" ".join(f"t{int(i)}" for i in torch.randint(3, VOCAB, (SEQ - 1,), generator=g)) for _ in range(16)]
    (out / "nvme").mkdir(parents=True, exist_ok=True)
    args = SFTConfig(output_dir=str(out / "sft"), per_device_train_batch_size=MICRO, gradient_accumulation_steps=ACCUM,
                     max_steps=4, learning_rate=1e-2, deepspeed=ds_config(out / "nvme", True), use_cpu=DEVICE == "cpu",
                     report_to=[], logging_steps=1, save_strategy="no", max_length=SEQ, packing=False, seed=0,
                     disable_tqdm=True, dataset_text_field="text")
    peft_config = None
    if opts.lora:
        from peft import LoraConfig

        peft_config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")
    trainer = SFTTrainer(model=model, args=args, train_dataset=Dataset.from_dict({"text": texts}),
                         processing_class=tok, peft_config=peft_config)
    trainer.train()
    trainer.save_model(str(out / "saved"))
    res = {"losses": [x["loss"] for x in trainer.state.log_history if "loss" in x],
           "engine": type(trainer.model_wrapped).__name__, "saved": sorted(p.name for p in (out / "saved").iterdir()),
           "trainable": sorted(n for n, p in trainer.model.named_parameters() if p.requires_grad)}
    trainer.model_wrapped.destroy()
    return res


def phase_accelerate(out: Path, opts: argparse.Namespace) -> dict:
    """A plain Accelerate loop (prepare, accumulate, backward, clip_grad_norm_, save_state /
    load_state) over pyinfinity's engine; ``--resume DIR`` loads a saved state and runs the rest."""
    from accelerate import Accelerator
    from accelerate.utils import DeepSpeedPlugin
    from torch.utils.data import DataLoader
    from transformers import LlamaForCausalLM
    from transformers.data.data_collator import default_data_collator

    base = write_base(out.parent / "base")
    model = LlamaForCausalLM.from_pretrained(str(base))
    own_model = LlamaForCausalLM.from_pretrained(str(base)) if opts.own else None
    (out / "nvme").mkdir(parents=True, exist_ok=True)
    config = ds_config(out / "nvme", False)
    config.update(gradient_accumulation_steps=ACCUM, gradient_clipping=CLIP)
    acc = Accelerator(deepspeed_plugin=DeepSpeedPlugin(hf_ds_config=config), gradient_accumulation_steps=ACCUM)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0)
    data = samples()
    dl = DataLoader(data, batch_size=MICRO, collate_fn=default_data_collator)
    model, opt, dl = acc.prepare(model, opt, dl)
    done = 0
    if opts.resume:
        acc.load_state(opts.resume)
        done = 6
        dl = acc.skip_first_batches(dl, done)
    micro_losses, norms = [], []
    for i, batch in enumerate(dl, done):
        with acc.accumulate(model):
            loss = model(**batch).loss
            micro_losses.append(loss.item())
            acc.backward(loss)
            if acc.sync_gradients:
                norms.append(float(acc.clip_grad_norm_(model.parameters(), CLIP)))
            opt.step()
            opt.zero_grad()
        if i + 1 == 6 and not opts.resume:
            acc.save_state(str(out / "state"))
    res = {"micro_losses": micro_losses, "grad_norms": norms, "engine": type(model).__name__,
           "saved": sorted(p.name for p in (out / "state").iterdir()) if not opts.resume else []}
    model.destroy()
    if own_model is not None:
        (out / "nvme_own").mkdir(exist_ok=True)
        cfg = {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": ACCUM,
               "gradient_clipping": CLIP, "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.0}},
               "zero_optimization": config["zero_optimization"], "pyinfinity": {"device": DEVICE}}
        cfg["zero_optimization"] = {k: v for k, v in cfg["zero_optimization"].items() if v != "auto"}
        engine = pyinfinity.initialize(own_model, cfg)
        own_norms = []
        for batch in DataLoader(data, batch_size=MICRO, collate_fn=default_data_collator):
            engine.backward(engine(**batch).loss)
            rec = engine.step()
            if rec is not None:
                own_norms.append(rec.grad_norm)
        engine.close()
        res["own_grad_norms"] = own_norms
    return res


def phase_misuse(out: Path, opts: argparse.Namespace) -> dict:
    """deepspeed.initialize with a "pyinfinity" section and what pyinfinity's engine does not do:
    the message of each refusal, and whether DeepSpeed's own initialize ever ran."""
    import deepspeed
    from transformers import LlamaForCausalLM

    from pyinfinity.integrations.deepspeed import engine_route

    ran = []
    original = engine_route._original_initialize

    import functools

    @functools.wraps(original)
    def spy(*a, **kw):
        ran.append(1)
        return original(*a, **kw)

    engine_route._original_initialize = spy
    base = write_base(out.parent / "base")
    (out / "nvme").mkdir(parents=True, exist_ok=True)

    def attempt(config_change=None, optimizer=None, env=None, **kw) -> str:
        model = LlamaForCausalLM.from_pretrained(str(base))
        config = ds_config(out / "nvme", False)
        config.update(train_micro_batch_size_per_gpu=MICRO, gradient_accumulation_steps=1, gradient_clipping=0.0)
        config["bf16"] = {"enabled": False}
        (config_change or (lambda c: None))(config)
        opt = optimizer(model) if optimizer else torch.optim.AdamW(model.parameters(), lr=LR)
        old = dict(os.environ)
        os.environ.update(env or {})
        try:
            deepspeed.initialize(model=model, optimizer=opt, config=config, **kw)
        except Exception as exc:
            return f"{type(exc).__name__}: {exc}"
        finally:
            os.environ.clear()
            os.environ.update(old)
        return "accepted"

    def two_groups(m):  # other lrs are stepped; amsgrad in a group is not
        decay = [p for n, p in m.named_parameters() if "norm" not in n]
        rest = [p for n, p in m.named_parameters() if "norm" in n]
        return torch.optim.AdamW([{"params": decay, "lr": LR}, {"params": rest, "lr": LR / 10, "amsgrad": True}],
                                 lr=LR)

    res = {"pipeline": attempt(lambda c: c.update(pipeline={"stages": 2})),
           "world_size": attempt(env={"WORLD_SIZE": "2"}),
           "tensor_parallel": attempt(lambda c: c.update(tensor_parallel={"autotp_size": 2})),
           "stage": attempt(lambda c: c["zero_optimization"].update(stage=2)),
           "sgd": attempt(optimizer=lambda m: torch.optim.SGD(m.parameters(), lr=0.1)),
           "param_groups": attempt(optimizer=two_groups),
           "mpu": attempt(mpu=object())}
    res["deepspeed_initialize_ran"] = len(ran)
    return res


def phase_gathered(out: Path, opts: argparse.Namespace) -> dict:
    """deepspeed.zero.GatheredParameters over an engine's embedding after initialize: a read-only
    block, then a row set in a block with modifier_rank=0, then one training step; the embedding's
    trained values (the engine's fp32 masters) after each."""
    import deepspeed
    from transformers import LlamaForCausalLM

    from pyinfinity import export

    base = write_base(out.parent / "base")
    (out / "nvme").mkdir(parents=True, exist_ok=True)
    model = LlamaForCausalLM.from_pretrained(str(base))
    config = ds_config(out / "nvme", False)
    config.update(train_micro_batch_size_per_gpu=1, gradient_accumulation_steps=1, gradient_clipping=0.0)
    config["bf16"] = {"enabled": False}
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0)
    engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=config)
    emb = engine.module.model.embed_tokens.weight

    def values() -> torch.Tensor:
        return export.state_dict(engine.pyinfinity_engine.state)["model.embed_tokens.weight"].float().clone()

    start = values()
    with deepspeed.zero.GatheredParameters([emb]):
        read = emb.data[5].float().cpu().clone()  # gathered where the engine computes (the GPU), compared on the host
    after_read = values()
    with deepspeed.zero.GatheredParameters([emb], modifier_rank=0):
        emb.data[5].fill_(0.5)
    modified = values()
    with deepspeed.zero.GatheredParameters([emb]):
        gathered_row = emb.data[5].float().cpu().clone()
    ids = torch.tensor([[5, 7, 9, 5, 11, 13]])
    engine.backward(engine(input_ids=ids, labels=ids).loss)
    engine.step()
    trained = values()
    others = torch.arange(VOCAB) != 5
    engine.destroy()
    return {"read_is_the_weights": torch.equal(read, start[5]), "read_only_changed_nothing": torch.equal(after_read, start),
            "modified_row": modified[5].tolist(), "other_rows_kept": torch.equal(modified[others], start[others]),
            "gathered_row": gathered_row.float().tolist(), "trained_row": trained[5].tolist()}


BIG_LAYERS = 8  # hidden 2048, MLP 5504, vocabulary 32000, untied: 536M parameters, 2.14 GB in fp32


def phase_big_write(out: Path, opts: argparse.Namespace) -> dict:
    """A random-init Llama checkpoint of 2.14 GB (fp32) in 1 GB safetensors shards, written tensor
    by tensor (never the whole model in memory)."""
    from safetensors.torch import save_file
    from transformers import LlamaConfig, LlamaForCausalLM

    mc = LlamaConfig(vocab_size=32000, hidden_size=2048, intermediate_size=5504, num_hidden_layers=BIG_LAYERS,
                     num_attention_heads=16, num_key_value_heads=16, max_position_embeddings=256,
                     tie_word_embeddings=False)
    with torch.device("meta"):
        shapes = {k: v.shape for k, v in LlamaForCausalLM(mc).state_dict().items()}
    g = torch.Generator().manual_seed(0)
    shards: list = [{}]
    size = 0
    for k, shape in shapes.items():
        t = torch.empty(shape).normal_(0, 0.02, generator=g) if len(shape) > 1 else torch.ones(shape)
        if size + t.numel() * 4 > (1 << 30) and shards[-1]:
            shards.append({})
            size = 0
        shards[-1][k] = t
        size += t.numel() * 4
    n, weight_map, files = len(shards), {}, []
    for i, tensors in enumerate(shards):
        name = f"model-{i + 1:05d}-of-{n:05d}.safetensors"
        save_file(tensors, str(out / name), metadata={"format": "pt"})
        weight_map.update({k: name for k in tensors})
        files.append(os.path.getsize(out / name))
        tensors.clear()
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    mc.save_pretrained(str(out))
    return {"files": files, "params": sum(int(torch.Size(s).numel()) for s in shapes.values())}


def rss_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


def phase_big_load(out: Path, opts: argparse.Namespace) -> dict:
    """from_pretrained after TrainingArguments(deepspeed=...) (transformers' ZeRO-3 path), then the
    engine built through deepspeed.initialize (Trainer's call), parameters on the NVMe tier: the
    peak resident memory this adds (VmHWM after resetting it)."""
    import deepspeed
    from transformers import LlamaForCausalLM, TrainingArguments

    nvme = out / "nvme"
    nvme.mkdir(parents=True, exist_ok=True)
    config = ds_config(nvme, False)
    config.update(train_micro_batch_size_per_gpu=1, gradient_accumulation_steps=1, gradient_clipping=0.0)
    config["bf16"] = {"enabled": False}
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
    before = rss_kib("VmRSS")
    args = TrainingArguments(output_dir=str(out / "args"), deepspeed=config, use_cpu=DEVICE == "cpu", report_to=[])  # noqa: F841
    model = LlamaForCausalLM.from_pretrained(opts.resume)
    meta = all(p.is_meta for p in model.parameters())
    after_build = rss_kib("VmHWM")
    for n, p in model.named_parameters():  # the optimizer state of the final norm only: the load is measured
        p.requires_grad_(n == "model.norm.weight")
    opt = torch.optim.AdamW([model.model.norm.weight], lr=LR)
    engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=config)
    peak = rss_kib("VmHWM")
    tiers = engine.pyinfinity_engine.memory_report().params
    ids = torch.tensor([[1, 2, 3, 4]])
    with torch.no_grad():
        engine.eval()
        logits = engine(input_ids=ids).logits
    engine.destroy()
    return {"meta": meta, "before_kib": before, "after_build_kib": after_build, "peak_kib": peak, "tiers": tiers,
            "logits_finite": bool(torch.isfinite(logits).all())}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("phase")
    ap.add_argument("out")
    ap.add_argument("--gather", type=int, default=1)
    ap.add_argument("--resume", default=None)
    ap.add_argument("--own", type=int, default=0)
    ap.add_argument("--final", type=int, default=0)
    ap.add_argument("--lora", type=int, default=0)
    ap.add_argument("--zero-init", type=int, default=0)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--weight-decay", type=float, default=0.0)
    ap.add_argument("--fast-lr-ratio", type=float, default=0.0)
    opts = ap.parse_args()
    global DEVICE
    DEVICE = opts.device
    out = Path(opts.out)
    out.mkdir(parents=True, exist_ok=True)
    res = {"trainer": phase_trainer, "sft": phase_sft, "accelerate": phase_accelerate,
           "misuse": phase_misuse, "gathered": phase_gathered, "big_write": phase_big_write, "big_load": phase_big_load}[opts.phase](out, opts)
    (out / "result.json").write_text(json.dumps(res))


if __name__ == "__main__":
    sys.exit(main())
