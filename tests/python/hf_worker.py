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
            "pyinfinity": {"device": "cpu"}}


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
                             warmup_steps=WARMUP, lr_scheduler_type="cosine", max_grad_norm=CLIP, weight_decay=0.0,
                             use_cpu=True, deepspeed=config, report_to=[], logging_steps=1, save_steps=2,
                             save_total_limit=2, seed=0, disable_tqdm=True, **kw)


def own_loop(model, batches: list, nvme: Path) -> dict:
    """pyinfinity's own training loop on the batches Trainer drew, with Trainer's schedule."""
    from transformers import get_cosine_schedule_with_warmup

    cfg = {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": ACCUM, "gradient_clipping": CLIP,
           "optimizer": {"type": "AdamW", "params": {"lr": LR, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.0}},
           "zero_optimization": {"stage": 3, "offload_param": {"device": "nvme", "nvme_path": str(nvme)},
                                 "offload_optimizer": {"device": "nvme", "nvme_path": str(nvme)}},
           "pyinfinity": {"device": "cpu"}}
    shadow = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=LR)  # only its lr: the schedule's value
    sched = get_cosine_schedule_with_warmup(shadow, WARMUP, STEPS)
    engine = pyinfinity.initialize(model, cfg)
    losses, norms = [], []
    for i, ids in enumerate(batches):
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
    from transformers import LlamaForCausalLM, Trainer
    from transformers.data.data_collator import default_data_collator

    base = write_base(out.parent / "base")
    model = LlamaForCausalLM.from_pretrained(str(base))  # before TrainingArguments(deepspeed=...) (zero.Init path)
    own_model = LlamaForCausalLM.from_pretrained(str(base)) if opts.own else None
    batches: list = []

    def collate(features):
        batch = default_data_collator(features)
        batches.append(batch["input_ids"].clone())
        return batch

    skipped = SkippedSaves()
    logging.getLogger("pyinfinity").addHandler(skipped)
    logging.getLogger("pyinfinity").setLevel(logging.INFO)
    res: dict = {}
    config = ds_config(out / "nvme", opts.gather)
    (out / "nvme").mkdir(parents=True, exist_ok=True)
    data = samples()
    trainer = Trainer(model=model, args=trainer_args(out, config), train_dataset=data, eval_dataset=data[:4],
                      data_collator=collate)
    trainer.train(resume_from_checkpoint=opts.resume)
    import deepspeed

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
        res["own"] = own_loop(own_model, batches, out / "nvme_own")
    return res


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("phase")
    ap.add_argument("out")
    ap.add_argument("--gather", type=int, default=1)
    ap.add_argument("--resume", default=None)
    ap.add_argument("--own", type=int, default=0)
    ap.add_argument("--final", type=int, default=0)
    opts = ap.parse_args()
    out = Path(opts.out)
    out.mkdir(parents=True, exist_ok=True)
    res = {"trainer": phase_trainer}[opts.phase](out, opts)
    (out / "result.json").write_text(json.dumps(res))


if __name__ == "__main__":
    sys.exit(main())
