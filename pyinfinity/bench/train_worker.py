"""One run of `pyinfinity bench train`: one system on one model size, in its own process.

    python -m pyinfinity.bench.train_worker SPEC.json

Each run is a fresh process so that an out-of-memory, a DeepSpeed process group, a per-process
memory fraction or a crash cannot leak into the next run. The spec (written by
:mod:`pyinfinity.bench.train`) names the system, the model's LlamaConfig fields and the training
shape; the worker prints one line ``RESULT {json}`` on stdout and exits 0, also when the run
itself failed (``ok: false`` with the error); a non-zero exit means the worker itself broke.

Measured per step, after ``warmup`` steps, with the device synchronised around each step:
seconds, tokens/s, disk bytes read/written by this process (``/proc/self/io``: O_DIRECT and
buffered alike, any system), peak device memory (``torch.cuda.max_memory_allocated``) and peak
host RSS. pyinfinity runs add the engine's own counters (bytes per tier, share of transfer time
hidden behind compute). With ``trace``, one more step runs under a tracer: phase boundaries
(forward / backward / optimizer step), the device's kernels and host<->device copies from
``torch.profiler`` (on a GPU), and disk read/write activity sampled from ``/proc/self/io`` —
the timeline the plot draws (the measurements: ``run_metrics``).
"""
from __future__ import annotations

import json
import os
import sys
import tempfile
import time
import traceback
from typing import Any, Callable, Optional

from pyinfinity.bench.run_metrics import STEP_LABEL, DiskSampler, current_rss, gpu_intervals, peak_rss, proc_io
from pyinfinity.bench.run_metrics import merge_intervals  # noqa: F401 - importable from here, as before

RESULT_PREFIX = "RESULT "
SYSTEMS = ("pyinfinity-cpu", "pyinfinity-nvme", "pyinfinity-nvme-params", "pyinfinity-nvme-all", "pyinfinity-auto",
           "deepspeed-cpu", "deepspeed-nvme", "deepspeed-nvme-params", "deepspeed-nvme-all", "deepspeed-z2-cpu",
           "deepspeed-z3-gpu-params", "torch", "torch-nocap", "torch-fp32master", "megatrain")
# (param tier, optimizer tier) each system forces; "auto" is read from the run's placement; "device":
# the parameters stay on the GPU (ZeRO-2 keeps them there, ZeRO-3 with offload_param "none" too)
TIERS = {"pyinfinity-cpu": ("cpu", "cpu"), "pyinfinity-nvme": ("cpu", "nvme"), "pyinfinity-nvme-params": ("nvme", "cpu"),
         "pyinfinity-nvme-all": ("nvme", "nvme"), "pyinfinity-auto": ("auto", "auto"),
         "deepspeed-cpu": ("cpu", "cpu"), "deepspeed-nvme": ("cpu", "nvme"), "deepspeed-nvme-params": ("nvme", "cpu"),
         "deepspeed-nvme-all": ("nvme", "nvme"), "deepspeed-z2-cpu": ("device", "cpu"),
         "deepspeed-z3-gpu-params": ("device", "cpu"), "torch": ("device", "device"),
         "torch-nocap": ("device", "device"), "torch-fp32master": ("device", "device"), "megatrain": ("cpu", "cpu")}
# plain PyTorch without the device-memory cap
UNCAPPED = ("torch-nocap", "torch-fp32master")
# DeepSpeed's ZeRO-Offload settings (its ZeRO and ZeRO-Offload tutorials) for the systems that keep
# the parameters on the GPU and offload the optimizer: gradients reduced into contiguous buffers in
# 5e8-element buckets, their copy to the CPU overlapped with backward
ZERO_OFFLOAD = {"overlap_comm": True, "contiguous_gradients": True, "reduce_scatter": True,
                "reduce_bucket_size": 5e8, "allgather_bucket_size": 5e8}


# ----------------------------------------------------------------------------------- systems


def _llama(spec: dict) -> Any:
    from transformers import LlamaConfig

    return LlamaConfig(**spec["model"], use_cache=False)


def _dtype(spec: dict) -> Any:
    import torch

    return {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[spec["dtype"]]


def _lora_config(spec: dict) -> Any:
    """The run's ``peft.LoraConfig`` (``spec["lora"]``: rank, alpha, target layers), None without."""
    lora = spec.get("lora")
    if not lora:
        return None
    import peft

    return peft.LoraConfig(r=lora["r"], lora_alpha=lora["alpha"], target_modules=list(lora["targets"]),
                           task_type="CAUSAL_LM")


def _trainable(model: Any) -> list:
    return [p for p in model.parameters() if p.requires_grad]


def _adamw(spec: dict) -> dict:
    return {"type": "AdamW", "params": {"lr": spec["lr"], "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.0}}


def set_key(cfg: dict, key: str, value: Any) -> None:
    """Sets a dotted ``key`` (``bf16.enabled``) in the nested dict ``cfg``, making the sections it
    names; a section that is already a value is an error naming the key."""
    parts = key.split(".")
    d = cfg
    for i, part in enumerate(parts[:-1]):
        nxt = d.setdefault(part, {})
        if not isinstance(nxt, dict):
            raise ValueError(f"{key}: {'.'.join(parts[:i + 1])} is {nxt!r} in the config, not a section")
        d = nxt
    d[parts[-1]] = value


# the top-level sections of a pyinfinity config; a variant's key naming none of them is a key of the
# ``pyinfinity`` section (``pyinfinity-auto[resident_bytes=0]``)
PYINFINITY_SECTIONS = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps",
                       "gradient_clipping", "fp16", "bf16", "optimizer", "scheduler", "zero_optimization", "aio",
                       "pyinfinity")


def pyinfinity_key(key: str) -> str:
    """A variant's key as a path in the pyinfinity config."""
    return key if key.split(".")[0] in PYINFINITY_SECTIONS else f"pyinfinity.{key}"


def pyinfinity_config(spec: dict) -> dict:
    system = spec["system"]
    param_dev, opt_dev = TIERS[system]
    zero: dict[str, Any] = {"stage": 3, "offload_param": {"device": param_dev},
                            "offload_optimizer": {"device": opt_dev},
                            "stage3_prefetch_bucket_size": "auto", "stage3_param_persistence_threshold": "auto"}
    if "nvme" in (param_dev, opt_dev) or system == "pyinfinity-auto":
        zero["offload_param"]["nvme_path"] = spec["nvme_dir"]
        zero["offload_optimizer"]["nvme_path"] = spec["nvme_dir"]
    cfg: dict[str, Any] = {"train_micro_batch_size_per_gpu": spec["batch"],
                           "gradient_accumulation_steps": int(spec.get("grad_accum", 1)),
                           "gradient_clipping": float(spec.get("clip", 0.0)), "optimizer": _adamw(spec),
                           "zero_optimization": zero, "pyinfinity": {"device": spec["device"], "log_every": 1 << 30}}
    if system == "pyinfinity-cpu":
        cfg["pyinfinity"]["resident_bytes"] = 0  # every unit streamed, none kept on the device
    if spec.get("cap_bytes"):
        cfg["pyinfinity"]["device_memory"] = int(spec["cap_bytes"])
    if spec.get("lora"):
        pass  # each parameter keeps its dtype: the frozen base --dtype's, the adapters fp32, as PEFT's
    elif spec["dtype"] == "bf16":
        cfg["bf16"] = {"enabled": True}
    elif spec["dtype"] == "fp16":
        cfg["fp16"] = {"enabled": True}
    cfg["pyinfinity"].update(spec.get("pyinfinity_overrides") or {})
    for key, value in (spec.get("variant") or {}).items():
        set_key(cfg, pyinfinity_key(key), value)
    return cfg


def deepspeed_config(spec: dict) -> dict:
    system = spec["system"]
    param_dev, opt_dev = TIERS[system]
    ds = spec["deepspeed"]
    zero: dict[str, Any]
    if system == "deepspeed-z2-cpu":  # ZeRO-Offload: ZeRO-2, parameters and gradients on the GPU
        zero = {"stage": 2, "offload_optimizer": {"device": "cpu", "pin_memory": True}, **ZERO_OFFLOAD}
    else:
        zero = {"stage": 3, "offload_param": {"device": "none" if param_dev == "device" else param_dev,
                                              "pin_memory": True},
                "offload_optimizer": {"device": opt_dev, "pin_memory": True},
                "stage3_prefetch_bucket_size": ds["prefetch_bucket_size"],
                "stage3_max_live_parameters": ds["max_live_parameters"],
                "stage3_param_persistence_threshold": ds["param_persistence_threshold"]}
        if system == "deepspeed-z3-gpu-params":
            zero.update(overlap_comm=True, contiguous_gradients=True,
                        reduce_bucket_size=ZERO_OFFLOAD["reduce_bucket_size"])
    if param_dev == "nvme":
        zero["offload_param"].update(nvme_path=spec["nvme_dir"], buffer_count=ds["buffer_count"],
                                     buffer_size=ds["buffer_size"], max_in_cpu=ds["max_in_cpu"])
    if opt_dev == "nvme":
        zero["offload_optimizer"].update(nvme_path=spec["nvme_dir"], pipeline_read=ds["pipeline"],
                                         pipeline_write=ds["pipeline"], buffer_count=ds["optimizer_buffer_count"])
    cfg: dict[str, Any] = {"train_micro_batch_size_per_gpu": spec["batch"],
                           "gradient_accumulation_steps": int(spec.get("grad_accum", 1)),
                           "gradient_clipping": float(spec.get("clip", 0.0)),
                           "zero_optimization": zero, "optimizer": _adamw(spec), "aio": dict(ds["aio"]),
                           "steps_per_print": 1 << 30, "wall_clock_breakdown": False}
    if spec["dtype"] == "bf16":
        cfg["bf16"] = {"enabled": True}
    elif spec["dtype"] == "fp16":
        cfg["fp16"] = {"enabled": True}
    for key, value in (spec.get("variant") or {}).items():
        set_key(cfg, key, value)
    return cfg


def system_config(spec: dict) -> Optional[dict]:
    """The config a run of ``spec`` hands its engine (None for plain torch; MegaTrain's recipe
    without its model and data paths, which the run writes)."""
    if spec["system"] == "megatrain":
        from pyinfinity.bench.megatrain import megatrain_config

        return megatrain_config(spec)
    if spec["system"].startswith("pyinfinity"):
        return pyinfinity_config(spec)
    if spec["system"].startswith("deepspeed"):
        return deepspeed_config(spec)
    return None


class Run:
    """The model and one optimizer step of a system; ``step(xs, mark)`` runs forward and backward
    on each micro-batch of ``xs`` (gradient accumulation over all of them), then the optimizer,
    calling ``mark(phase)`` after each phase (for the traced step)."""

    def __init__(self, spec: dict) -> None:
        import torch

        self.spec = spec
        self.system = spec["system"]
        self.device = torch.device(spec["device"])
        self.engine: Any = None
        self.params = 0
        self.extra: dict[str, Any] = {}
        self.close: Callable[[], None] = lambda: None
        self.synchronize: Callable[[], None] = lambda: None  # waits for work a step left in the background
        if self.system.startswith("pyinfinity"):
            self._pyinfinity()
        elif self.system.startswith("deepspeed"):
            self._deepspeed()
        else:
            self._torch()

    def _ckpt(self, model: Any) -> None:
        if self.spec["checkpointing"]:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})

    def _torch(self) -> None:
        import torch
        from transformers import LlamaForCausalLM

        with torch.device(self.device):  # drawn by the device's generator: the CPU's takes minutes at 13B and up
            model = LlamaForCausalLM(_llama(self.spec))
        # torch-fp32master: the weights (the master), their gradients and AdamW's moments in fp32, the
        # compute in the run's dtype under autocast (16 bytes a parameter on the device); the others
        # keep all of it in the run's dtype
        master = self.system == "torch-fp32master"
        compute = _dtype(self.spec)
        if not master:
            model = model.to(dtype=compute)
        lora = _lora_config(self.spec)
        if lora is not None:  # plain PEFT: the adapters fp32 on the bf16 base
            import peft

            model = peft.get_peft_model(model, lora)
        self._ckpt(model)
        model.train()
        self.params = sum(p.numel() for p in model.parameters())
        self.extra["param_dtypes"] = sorted({str(p.dtype).replace("torch.", "") for p in model.parameters()})
        opt = torch.optim.AdamW(_trainable(model), lr=self.spec["lr"], betas=(0.9, 0.999), eps=1e-8,
                                weight_decay=0.0, fused=True)

        clip = float(self.spec.get("clip", 0.0))

        def step(xs: list, mark: Callable[[str], None]) -> float:
            total = 0.0
            for x in xs:  # gradients summed over the micro-batches, each loss scaled by 1/N
                with torch.autocast(self.device.type, dtype=compute, enabled=master and compute != torch.float32):
                    loss = model(input_ids=x, labels=x).loss
                mark("forward")
                (loss / len(xs)).backward()
                mark("backward")
                total += float(loss.detach())
            if clip > 0:
                torch.nn.utils.clip_grad_norm_(_trainable(model), clip)
            opt.step()
            opt.zero_grad(set_to_none=True)
            mark("step")
            return total / len(xs)

        self.step = step

    def _pyinfinity(self) -> None:
        from transformers import LlamaForCausalLM

        import pyinfinity

        cfg = pyinfinity_config(self.spec)
        with pyinfinity.init_empty(cfg):
            model = LlamaForCausalLM(_llama(self.spec))
        lora = _lora_config(self.spec)
        if lora is not None:  # the frozen base in the training dtype, the adapters made as PEFT makes them
            from pyinfinity.adapters import get_peft_model

            model = get_peft_model(model.to(_dtype(self.spec)), lora)
        self._ckpt(model)
        eng = pyinfinity.initialize(model, cfg)
        eng.train()
        self.engine = eng
        self.params = sum(sh.numel for sh in eng.partition.shards)  # the model's own are placeholders now
        self.extra["trainable_params_counted"] = sum(sh.numel for sh in eng.partition.shards if sh.trainable)
        self.extra["auto"] = {d.key: d.value for d in eng.auto_decisions}
        self.extra["config"] = cfg
        self.records: list[Any] = []

        def step(xs: list, mark: Callable[[str], None]) -> float:
            rec, losses = None, []
            for x in xs:  # DeepSpeed's protocol: step() after each micro-batch, applied at the boundary
                loss = eng(input_ids=x, labels=x).loss
                mark("forward")
                eng.backward(loss)
                mark("backward")
                losses.append(float(loss.detach()))
                rec = eng.step()
            mark("step")
            self.records.append(rec)
            return float(rec.loss) if rec is not None else sum(losses) / len(losses)

        self.step = step
        self.close = eng.close
        self.synchronize = eng.synchronize

    def _deepspeed(self) -> None:
        for k, v in (("MASTER_ADDR", "127.0.0.1"), ("RANK", "0"), ("WORLD_SIZE", "1"), ("LOCAL_RANK", "0")):
            os.environ.setdefault(k, v)
        os.environ.setdefault("MASTER_PORT", str(self.spec.get("master_port", 29517)))
        try:
            import deepspeed
        except Exception as exc:  # ImportError, or a broken install failing at import
            raise RuntimeError(f"deepspeed cannot be imported: {type(exc).__name__}: {exc}") from exc
        from transformers import LlamaForCausalLM

        cfg = deepspeed_config(self.spec)
        # ZeRO-3 partitions the parameters as the model is built; ZeRO-2 takes the whole model,
        # which deepspeed.initialize casts and moves to the GPU
        stage3 = (cfg.get("zero_optimization") or {}).get("stage") == 3
        if stage3:
            with deepspeed.zero.Init(config_dict_or_path=cfg):
                model = LlamaForCausalLM(_llama(self.spec))
        else:
            # built on the device in the training dtype: a model too big for the cap fails at once,
            # not after minutes of building it in fp32 in RAM
            import torch

            prev = torch.get_default_dtype()
            torch.set_default_dtype(_dtype(self.spec))
            try:
                with self.device:
                    model = LlamaForCausalLM(_llama(self.spec))
            finally:
                torch.set_default_dtype(prev)
        lora = _lora_config(self.spec)
        if lora is not None:  # PEFT wraps the (partitioned) model, as with transformers' Trainer
            import peft

            model = peft.get_peft_model(model, lora)
        self._ckpt(model)
        eng, *_ = deepspeed.initialize(model=model, model_parameters=_trainable(model), config=cfg)
        self.params = sum(getattr(p, "ds_numel", p.numel()) for p in model.parameters())
        self.extra["config"] = cfg
        self.extra["deepspeed"] = deepspeed.__version__

        def step(xs: list, mark: Callable[[str], None]) -> float:
            total = 0.0
            for x in xs:  # DeepSpeed's protocol: step() after each micro-batch, applied at the boundary
                loss = eng(input_ids=x, labels=x).loss
                mark("forward")
                eng.backward(loss)
                mark("backward")
                total += float(loss.detach())
                eng.step()
            mark("step")
            return total / len(xs)

        self.step = step

        def close() -> None:
            eng.destroy()
            import torch.distributed as dist

            if dist.is_initialized():
                dist.destroy_process_group()

        self.close = close


# ----------------------------------------------------------------------------------- the run


def _sync(device: Any) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _batches(spec: dict, n: int) -> list[Any]:
    """The same token ids for every system: a fixed-seed CPU generator."""
    import torch

    g = torch.Generator().manual_seed(int(spec.get("seed", 0)))
    return [torch.randint(0, int(spec["model"]["vocab_size"]), (spec["batch"], spec["seq"]), generator=g)
            for _ in range(n)]


def token_rows(spec: dict) -> Any:
    """The token ids of a run's timed and warm-up steps, micro-batch after micro-batch, as one
    [steps x grad_accum x batch, seq] tensor (the rows of MegaTrain's dataset)."""
    import torch

    return torch.cat(_batches(spec, int(spec["steps"]) * int(spec.get("grad_accum", 1))))


def error_text(exc: BaseException) -> str:
    """One line naming the error; a config validation error (DeepSpeed's pydantic models) names each
    rejected key with its model, e.g. ``DeepSpeedZeroConfig.overlap_comms: Extra inputs are not permitted``."""
    errors = getattr(exc, "errors", None)
    if type(exc).__name__ == "ValidationError" and callable(errors):
        try:
            parts = [f"{getattr(exc, 'title', '')}.{'.'.join(str(x) for x in e['loc'])}: {e['msg']}" for e in errors()]
            return f"{type(exc).__name__}: " + "; ".join(parts)[:600]
        except (TypeError, KeyError):
            pass
    return f"{type(exc).__name__}: " + " ".join(str(exc).split())[:600]


def _is_oom(exc: BaseException) -> bool:
    import torch

    return isinstance(exc, torch.cuda.OutOfMemoryError) or "out of memory" in str(exc).lower()


def run(spec: dict) -> dict:
    if spec["system"] == "megatrain":  # its own script in a subprocess (this process stays off the GPU)
        from pyinfinity.bench import megatrain

        return megatrain.run(spec, token_rows(spec))
    import torch

    res: dict[str, Any] = {"system": spec["system"], "size": spec["size"], "ok": False}
    device = torch.device(spec["device"])
    torch.manual_seed(int(spec.get("seed", 0)))
    if device.type == "cuda":
        torch.cuda.set_device(device)
        total = torch.cuda.get_device_properties(device).total_memory
        cap = spec.get("cap_bytes")
        if cap and spec["system"] not in UNCAPPED:
            torch.cuda.set_per_process_memory_fraction(min(1.0, cap / total), device)
            res["cap_bytes"] = int(cap)
    steps, warmup = int(spec["steps"]), int(spec["warmup"])
    accum = int(spec.get("grad_accum", 1))
    micro = _batches(spec, (steps + 1) * accum)
    batches = [micro[i * accum:(i + 1) * accum] for i in range(steps + 1)]  # the micro-batches of each step
    r: Optional[Run] = None
    phase = "build"
    try:
        # what the process holds before the model exists (torch, CUDA context, the batches): the
        # training state's share of the peak is peak_rss minus this, against the plan's host bytes
        res["rss_before_build"] = current_rss()
        t0 = time.perf_counter()
        r = Run(spec)
        res["build_seconds"] = round(time.perf_counter() - t0, 3)
        res["params"] = r.params
        res.update({k: v for k, v in r.extra.items() if k != "config"})
        res["config"] = r.extra.get("config")
        phase = "train"  # the device peak spans the build too, as shared/device's baseline script measures it
        per_step: list[dict[str, Any]] = []
        for i in range(steps):
            if i == warmup and i > 0:
                # what the warm-up left in the background (pyinfinity's optimizer) is not a timed
                # step's: each timed step then pays for exactly one optimizer pass, its
                # predecessor's in its forward, the last its own as well (below)
                r.synchronize()
                _sync(device)
            x = [b.to(device) for b in batches[i]]
            io0 = proc_io()
            _sync(device)
            t = time.perf_counter()
            loss = r.step(x, lambda _p: None)
            _sync(device)
            dt = time.perf_counter() - t
            io1 = proc_io()
            per_step.append({"seconds": round(dt, 5), "loss": loss, "disk_read": io1[0] - io0[0],
                             "disk_write": io1[1] - io0[1]})
            print(f"step {i + 1}/{steps}: {dt:.3f} s, loss {loss:.4f}", file=sys.stderr, flush=True)
        # work the last step left in the background (pyinfinity's optimizer) counts in its time:
        # the other timed steps paid for their predecessor's in their forward, so the timed steps
        # hold exactly one optimizer pass each on average (their median is the steady state for
        # three or more; the first has no predecessor, the last two passes)
        io0 = proc_io()
        t = time.perf_counter()
        r.synchronize()
        _sync(device)
        io1 = proc_io()
        if per_step:  # and its disk traffic in the last step's (an optimizer on disk reads and writes then)
            last = per_step[-1]
            last["seconds"] = round(last["seconds"] + time.perf_counter() - t, 5)
            last["disk_read"] += io1[0] - io0[0]
            last["disk_write"] += io1[1] - io0[1]
        res["steps"] = per_step
        res["peak_device_allocated"] = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
        res["peak_rss"] = peak_rss()
        if r.engine is not None:
            recs = [rec for rec in r.records if rec is not None][warmup:] or [rec for rec in r.records if rec]
            moved: dict[str, float] = {}
            for rec in recs:
                for k, v in rec.bytes_moved.items():
                    moved[k] = moved.get(k, 0) + v / len(recs)
            res["bytes_moved_per_step"] = {k: int(v) for k, v in sorted(moved.items())}
            ov = [rec.overlap_fraction for rec in recs if rec.overlap_fraction is not None]
            res["overlap_fraction"] = sum(ov) / len(ov) if ov else None
            res["optimizer_seconds"] = sum(rec.optimizer_seconds for rec in recs) / len(recs) if recs else None
            phases: dict[str, float] = {}
            for rec in recs:
                for k, v in (rec.optimizer_phases or {}).items():
                    phases[k] = phases.get(k, 0.0) + v / len(recs)
            res["optimizer_phases"] = {k: round(v, 4) for k, v in phases.items()}
            res["optimizer_busy_seconds"] = sum(rec.optimizer_busy_seconds for rec in recs) / len(recs) if recs else None
            res["step_wait_seconds"] = sum(rec.step_wait_seconds for rec in recs) / len(recs) if recs else None
            rep = r.engine.memory_report()
            res["placement"] = {"params": rep.params, "optimizer": rep.optimizer, "grads": rep.grads,
                                "optimizer_disk_per_step": r.engine.optimizer.disk_bytes_per_step,
                                "optimizer_device_numel": r.engine.optimizer.device_stepped_numel}
            plan = getattr(r.engine, "plan", None)
            if plan is not None:
                res["plan_host_bytes"] = int(plan.host_bytes)
                res["plan_predicted"] = _plan_prediction(plan, int(spec["seq"]))
        if spec.get("trace"):
            phase = "trace"
            res["trace"] = _traced_step(r, [b.to(device) for b in batches[steps]], device)
        res["ok"] = True
    except BaseException as exc:  # noqa: BLE001 - every failure becomes a row of the table
        if isinstance(exc, KeyboardInterrupt):
            raise
        res["error_phase"] = phase
        if _is_oom(exc):
            res["error"] = "out of memory: " + str(exc).split("\n")[0][:300]
            res["oom"] = True
        else:
            res["error"] = error_text(exc)
            res["traceback"] = traceback.format_exc()[-4000:]
    finally:
        if r is not None:
            try:
                r.close()
            except Exception as exc:  # noqa: BLE001 - the result is what matters; say it
                res["close_error"] = f"{type(exc).__name__}: {exc}"
    if device.type == "cuda" and res.get("peak_device_allocated") is None:
        res["peak_device_allocated"] = torch.cuda.max_memory_allocated(device)
    res.setdefault("peak_rss", peak_rss())
    return res




def _plan_prediction(plan: Any, seq: int) -> dict[str, Any]:
    """The engine's own prediction of one optimizer step at the run's sequence length (the engine
    plans before it sees a batch; ``Placement.compare`` redoes it the same way at close), its terms
    and what bounds it, for the report's plan-versus-measured line."""
    pred, planned_seq = plan.predicted, None
    inputs = getattr(plan, "inputs", None)
    if inputs is not None and seq > 0 and inputs[3].seq_len != seq:
        planned_seq = inputs[3].seq_len
        again = plan.at_seq_len(seq)
        pred = again.predicted if again is not None else pred
    return {"seconds": pred.total, "bottleneck": pred.bottleneck, "planned_seq": planned_seq,
            "terms": {"compute": pred.compute, "h2d": pred.h2d, "disk": pred.disk,
                      "optimizer": pred.optimizer, "visible_optimizer": pred.optimizer_phase}}


def _traced_step(r: Run, x: list, device: Any) -> dict[str, Any]:
    """One more step under the tracers; returns the timeline (seconds from the step's start)."""
    import torch

    prof = None
    if device.type == "cuda":
        prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                  torch.profiler.ProfilerActivity.CUDA])
    marks: list[tuple[str, float]] = []

    def mark(p: str) -> None:
        _sync(device)
        marks.append((p, time.perf_counter()))

    _sync(device)
    with DiskSampler() as sampler:
        if prof is not None:
            prof.__enter__()
        try:
            t0 = time.perf_counter()
            # the annotation's start is the trace's time origin for the device lanes
            with torch.profiler.record_function(STEP_LABEL):
                r.step(x, mark)
        finally:
            if prof is not None:
                prof.__exit__(None, None, None)
    phases, start = [], t0
    for name, t in marks:
        phases.append([name, round(start - t0, 5), round(t - t0, 5)])
        start = t
    out: dict[str, Any] = {"seconds": round(marks[-1][1] - t0, 5) if marks else None, "phases": phases,
                           "disk_read": sampler.intervals(t0, 1), "disk_write": sampler.intervals(t0, 2)}
    if prof is not None:
        with tempfile.TemporaryDirectory() as d:
            path = os.path.join(d, "trace.json")
            prof.export_chrome_trace(path)
            try:
                out.update(gpu_intervals(path))
            except (OSError, ValueError, KeyError) as exc:
                out["trace_error"] = f"{type(exc).__name__}: {exc}"
        # where the host's time went: the operators and runtime calls with the most self time
        ops = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)[:15]
        out["host_top"] = [[e.key, round(e.self_cpu_time_total / 1e6, 5), int(e.count)] for e in ops]
    return out


def main(argv: Optional[list[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print("usage: python -m pyinfinity.bench.train_worker SPEC.json", file=sys.stderr)
        return 2
    with open(argv[0]) as f:
        spec = json.load(f)
    res = run(spec)
    sys.stdout.write(RESULT_PREFIX + json.dumps(res, default=str) + "\n")
    sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
