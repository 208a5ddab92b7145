"""The training engine: ``initialize(model, config) -> Engine``.

The Engine is the user's facade. It reads the config, decides its "auto" values with the planner,
caps the device's memory, and builds the training state (``zero.state.TrainingState``): the model
partitioned into flat shards (``zero.partition``), each shard's home in its tier (device, pinned
RAM or NVMe, ``swap.tensor_swapper``), the coordinator that streams shards to the compute device
around every module's use and moves gradients off it as they are produced
(``zero.coordinator``), and Adam/AdamW on fp32 master weights kept in RAM or on NVMe
(``zero.optimizer``). It runs the training calls in DeepSpeed's convention, ``engine(batch)``,
``engine.backward(loss)``, ``engine.step()`` once per micro-batch, records each step
(``telemetry``), and hands saving, loading and exporting to ``checkpoint`` and ``export``, which
work on the training state (``engine.state``).

The config's reading, the planning, the training calls and their records are the user's one
surface, and each of them hands its work to the training state below it.
"""
from __future__ import annotations

import collections
import logging
import os
import time
from typing import Any, Optional, Union

import torch
from torch import nn

from pyinfinity import checkpoint, guards
from pyinfinity.config import Config, ConfigError, format_size, load_config
from pyinfinity.layout.charges import PlanError
from pyinfinity.telemetry import MemoryReport, StepRecord, default_logging, host_rss, measured_parts
from pyinfinity.zero.budget import DeviceBudgetExceeded
from pyinfinity.zero.coordinator import ParameterCoordinator
from pyinfinity.zero.device_placement import SHRINK_AT
from pyinfinity.zero.optimizer import DynamicLossScaler, OffloadOptimizer
from pyinfinity.zero.partition import Partition, init_empty
from pyinfinity.zero.state import TrainingState

log = logging.getLogger(__name__)

HISTORY_STEPS = 10_000  # telemetry records kept (a run of days must not grow without bound)


# ----------------------------------------------------------------------------------- engine


def initialize(model: nn.Module, config: Union[dict, str, os.PathLike, Config],
               lr_scheduler: Any = None, weights: Union[str, os.PathLike, None] = None, *,
               seq_len: Optional[int] = None) -> "Engine":
    """Wraps ``model`` for offloaded ZeRO-3 training; ``config`` is DeepSpeed's format (dict or
    JSON path). ``lr_scheduler``: a scheduler object, or a callable taking the engine's optimizer
    and returning one (overrides the config's ``scheduler``). ``weights``: a safetensors checkpoint
    (file or model directory) whose values the parameters start from, streamed module by module
    into their tiers (or a ``pretrained.WeightLoader`` already built for it). ``seq_len``: the tokens per sequence the run
    will train on, when known: the planner sizes activations and compute for it (default 1024)."""
    return Engine(model, config, lr_scheduler, weights=weights, seq_len=seq_len)


def from_pretrained(path: Union[str, os.PathLike], config: Any, *, dtype: Optional[torch.dtype] = None,
                    peft_config: Any = None, adapter: Union[str, os.PathLike, None] = None,
                    **engine_kwargs: Any) -> Any:
    """``initialize`` for a transformers model directory: the architecture from its config.json,
    the weights streamed from its safetensors into the tiers of ``config``. ``dtype``: the
    dtype the model is built in (and exported in); default fp32, as transformers does.
    ``peft_config`` (a ``peft.LoraConfig``): train new LoRA adapters over the frozen base, made
    as ``peft.get_peft_model`` makes them; ``adapter``: continue training the PEFT adapter saved in
    that directory (``pyinfinity.adapters``). ``engine_kwargs``: the rest of ``initialize``'s
    (``lr_scheduler``)."""
    if peft_config is not None or adapter is not None:
        from pyinfinity.adapters import build_peft_model

        model, loader = build_peft_model(path, config, dtype, peft_config=peft_config, adapter=adapter)
        return initialize(model, config, weights=loader, **engine_kwargs)
    from pyinfinity.pretrained import build_empty_model

    model = build_empty_model(path, config, dtype)
    return initialize(model, config, weights=path, **engine_kwargs)


def _resolve_device(spec: str) -> torch.device:
    """``pyinfinity.device`` as a torch.device; ``cuda`` and ``auto`` with a GPU become an indexed
    CUDA device (``LOCAL_RANK`` under torchrun), which torch's per-device memory calls require."""
    from pyinfinity.device import resolve_device

    try:
        return resolve_device(spec)
    except ValueError as e:
        raise ConfigError(f"pyinfinity.device: {e}") from None


def _log_decisions(decisions: list) -> None:
    """The planner's "auto" decisions, one line per reason (the planner's decisions share theirs:
    the predicted step, which the plan's table logs once)."""
    by_why: dict[str, list[str]] = {}
    for d in decisions:
        value = str(d.value).lower() if isinstance(d.value, bool) else d.value  # as the config spells it
        by_why.setdefault(d.why, []).append(f"{d.key} = {value}")
    for why, what in by_why.items():
        if why.startswith("planner: "):
            why = "planner: see the plan above"
        log.info("auto: %s (%s)", ", ".join(what), why)


def _recomputes_activations(model: nn.Module) -> bool:
    """Whether a transformers model has activation checkpointing on (the planner's activation estimate)."""
    import warnings

    with warnings.catch_warnings():  # transformers deprecates one name for the other
        warnings.simplefilter("ignore")
        for name in ("is_activation_checkpointing", "is_gradient_checkpointing"):
            try:
                v = getattr(model, name)
            except AttributeError:
                continue
            if isinstance(v, bool):
                return v
    return False


class Engine:
    """Offloaded ZeRO-3 training of one model on one device. Use ``initialize`` to make one.

    The training state it trains is ``engine.state`` (``zero.state.TrainingState``); its parts are
    also reachable here by their usual names (``optimizer``, ``coordinator``, ``partition``,
    ``lr_scheduler``, ``global_steps``, ...)."""

    def __init__(self, model: nn.Module, config: Union[dict, str, os.PathLike, Config],
                 lr_scheduler: Any = None, weights: Union[str, os.PathLike, None] = None, *,
                 seq_len: Optional[int] = None) -> None:
        self.state: Optional[TrainingState] = None
        default_logging()  # the plan, the progress and the step lines show without a logging setup
        guards.check_not_wrapped(model)
        cfg = load_config(config)
        self.weights: Any = None  # pretrained.WeightLoader: names, shapes checked before anything is written
        from pyinfinity import adapters

        if adapters.is_peft_model(model):
            adapters.check_adapters_materialized(model)
        if weights is not None:
            from pyinfinity.pretrained import WeightLoader

            if not isinstance(weights, WeightLoader):  # a PEFT model's checkpoint is its base model's
                if adapters.is_peft_model(model):
                    base = model.get_base_model()
                    weights = WeightLoader(weights, base, key_map=adapters.checkpoint_keys(base))
                else:
                    weights = WeightLoader(weights, model)
            self.weights = weights
        self.device = _resolve_device(cfg.pyinfinity.device)
        if self.device.type == "cuda":  # streams, pinned memory and the user's .cuda() follow it
            torch.cuda.set_device(self.device)
        fp16, bf16 = cfg.fp16.enabled, cfg.bf16.enabled
        from pyinfinity.plan.sizes import model_sizes

        dtype = torch.float16 if fp16 else torch.bfloat16 if bf16 else None
        # every "auto" decided in one place, the planner's plan_engine_config (the placement, the unit
        # size, the buffers, the budgets, the threads, overlap_step), logged below; the engine and
        # the training state read the resolved values
        from pyinfinity.plan import plan_engine_config
        from pyinfinity.probes import MachineProbes

        checkpointing = _recomputes_activations(model)
        cfg, decisions, self.plan = plan_engine_config(cfg, model, self.device, seq_len=seq_len,
                                                       checkpointing=checkpointing, probes=MachineProbes())
        # the one ModelSizes of the model as the partition cuts it (the layout's input), counted
        # before the partition empties the parameters
        sizes = model_sizes(model, dtype, unit_bytes=int(cfg.pyinfinity.unit_bytes))
        # for the shape check at the first forward: the planner's sizes, or (a config with nothing
        # left to plan) the model's own, counted before the partition empties its parameters
        plan_sizes = self.plan.inputs[0] if self.plan is not None else None
        if plan_sizes is None and self.device.type == "cuda":
            plan_sizes = sizes
        _log_decisions(decisions)
        if self.plan is None:  # a placement the config fixes: checked against this machine before a byte is written
            from pyinfinity.layout.pools import engine_pools
            from pyinfinity.plan.resolve import UNPREDICTED_HINT, budget_summary, check_placement
            from pyinfinity.swap.ownership import check_budgets

            check_budgets(cfg, engine_pools(cfg, sizes, sum(1 for m in model.modules() if m._parameters)))
            log.info("%s", budget_summary(check_placement(cfg, model, self.device, seq_len=seq_len,
                                                          checkpointing=checkpointing)))
            log.info("%s", UNPREDICTED_HINT)
        self.config = cfg
        self.auto_decisions = decisions
        planned = {d.key for d in decisions}
        self.module = model
        self._overlap_mode = "on" if cfg.pyinfinity.overlap_step else "off"
        self.history: collections.deque[StepRecord] = collections.deque(maxlen=HISTORY_STEPS)
        dm = cfg.pyinfinity.device_memory
        self.device_memory: Optional[int] = int(dm) if isinstance(dm, int) else None
        self._capped = False  # this engine set torch's per-process memory fraction (close() puts it back)
        self._checkpoint_write: Optional[checkpoint.CheckpointWrite] = None  # a save writing in the background
        device_base = 0
        if self.device.type == "cuda" and self.device_memory:
            # the budget is this engine's, on top of what the process holds on the device already
            # (a reference model, a batch): torch's cap is on the allocator's reserved bytes, so
            # the cached free blocks go back first and the cap is what stays reserved plus the budget
            torch.cuda.empty_cache()
            device_base = torch.cuda.memory_allocated(self.device)
            total = torch.cuda.get_device_properties(self.device).total_memory
            reserved = torch.cuda.memory_reserved(self.device)
            torch.cuda.set_per_process_memory_fraction(min(1.0, (reserved + self.device_memory) / total), self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self._capped = True
        try:
            self.state = TrainingState(model, cfg, self.device, sizes, device_memory=self.device_memory,
                                       lr_scheduler=lr_scheduler, materialize=self.weights,
                                       background=self._overlap_mode == "on", plan_sizes=plan_sizes,
                                       checkpointing=checkpointing, device_base=device_base,
                                       # what the plan sized may grow with the measured peak, a user's own values never
                                       grow_prefetch="zero_optimization.stage3_prefetch_bucket_size" in planned,
                                       grow_live="zero_optimization.stage3_max_live_parameters" in planned)
        except torch.OutOfMemoryError as exc:  # placing the model (persistent shards, resident units, buffers)
            self._uncap()
            if self.device.type == "cuda":
                torch.cuda.empty_cache()
            what = str(exc).splitlines()[0] if str(exc) else "out of memory"
            budget = format_size(self.device_memory) if self.device_memory else "(no cap)"
            raise PlanError(f"pyinfinity.device_memory {budget}: the device ran out of memory while the engine "
                            f"placed the model, before any step ({what}); the budget must hold the small "
                            "persistent shards, the units kept resident, device optimizer state and the "
                            "gradient buffers: raise it (--gpu-memory), or lower "
                            "stage3_param_persistence_threshold") from exc
        except BaseException:
            self._uncap()
            raise
        self._forward_tokens = 0
        self._step_t0: Optional[float] = None
        self._tokens = 0
        self._losses: list[torch.Tensor] = []
        self._mark = self._counters()
        guards.attach(self, model)
        op, oo = cfg.zero_optimization.offload_param, cfg.zero_optimization.offload_optimizer
        log.info("engine ready on %s: %s params (%s), params %s, optimizer on %s%s", self.device,
                 f"{self.partition.numel:,}", format_size(self.partition.nbytes),
                 f"resident on {self.device}" if op.device == "none" else f"on {op.device}", oo.device,
                 f", device budget {format_size(self.device_memory)}" if self.device_memory else "")

    # ------------------------------------------------------------------------- the training state's parts
    @property
    def optimizer(self) -> OffloadOptimizer:
        return self._state().optimizer

    @property
    def coordinator(self) -> ParameterCoordinator:
        return self._state().coordinator

    @property
    def partition(self) -> Partition:
        return self._state().partition

    @property
    def param_swapper(self) -> Any:
        return self._state().param_swapper

    @property
    def optim_swapper(self) -> Any:
        return self._state().optim_swapper

    @property
    def scaler(self) -> DynamicLossScaler:
        return self._state().scaler

    @property
    def lr_scheduler(self) -> Any:
        return self._state().lr_scheduler

    @property
    def global_steps(self) -> int:
        """Optimizer steps taken (skipped fp16 overflow steps not counted)."""
        return self._state().global_steps

    @property
    def micro_steps(self) -> int:
        """Micro-batches stepped (``step()`` calls)."""
        return self._state().micro_steps

    @property
    def gradient_accumulation_steps(self) -> int:
        return self._state().gradient_accumulation_steps

    @property
    def resident_bytes(self) -> int:
        """Bytes of the units kept on the compute device between steps."""
        return self._state().placement.resident_bytes

    @property
    def device_state_bytes(self) -> int:
        """Device bytes of the optimizer state kept there (``pyinfinity.device_optimizer_bytes``)."""
        return self._state().placement.device_state_bytes

    @property
    def device_grad_bytes(self) -> int:
        """Device bytes of the fp32 gradient accumulators kept there (``pyinfinity.device_accumulator_bytes``)."""
        return self._state().placement.device_grad_bytes

    def _state(self) -> TrainingState:
        state = self.__dict__.get("state")
        if state is None:
            raise RuntimeError("Engine: its construction failed; build a new one")
        return state

    # ------------------------------------------------------------------------- training API
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """Runs the module's forward through the coordinator's hooks; returns its output as is.
        Tensor arguments (also inside a list, tuple or dict) on another device, e.g. a CPU batch
        from a DataLoader, are moved to the engine's device first. A parameter the engine does not
        hold (created after ``initialize``) is refused, naming it."""
        self.state.check_open()
        self.state.check_parameters(self.module)
        if self.device.type != "cpu":
            args, kwargs = _inputs_to(args, self.device), _inputs_to(kwargs, self.device)
        if self._step_t0 is None:
            self._step_t0 = time.perf_counter()
        tokens = _count_tokens(args, kwargs)
        if not (torch.is_grad_enabled() and self.module.training):
            self._tokens += tokens
            with self.state.in_pass():
                return self.module(*args, **kwargs)
        if not self.state.placement.shape_checked:
            self.state.placement.check_shape(args, kwargs)
        oom = None
        try:
            with self.state.in_pass(), self.coordinator.saved_tensors_hooks():
                out = self.module(*args, **kwargs)
        except torch.OutOfMemoryError as exc:
            if isinstance(exc, DeviceBudgetExceeded):
                raise
            oom = str(exc).splitlines()[0] if str(exc) else "out of memory"
        if oom is None:
            self._tokens += tokens
            self._forward_tokens = tokens
            return out
        # outside the except block: the failed forward's frames (and the activations they hold) are gone
        self.coordinator.release_all()
        raise self.state.placement.budget_exceeded("forward", oom)

    forward = __call__

    def backward(self, loss: torch.Tensor, *, scale_wrt_gas: bool = True) -> None:
        """Backward of one micro-batch's loss (scaled for accumulation and fp16); gradients leave
        the device as they are produced. ``scale_wrt_gas=False`` (DeepSpeed's keyword): the loss
        is already divided by the accumulation steps (Hugging Face Trainer's is)."""
        self.state.check_trainable("backward()")
        if not isinstance(loss, torch.Tensor) or not loss.requires_grad:
            raise TypeError(f"loss: expected a tensor that requires grad (the output of engine(...) in train mode), "
                            f"got {type(loss).__name__ if not isinstance(loss, torch.Tensor) else 'one without grad'}")
        self._losses.append(loss.detach())
        scaled = loss
        if self.config.fp16.enabled:
            scaled = scaled * self.scaler.scale
        if self.gradient_accumulation_steps > 1 and scale_wrt_gas:
            scaled = scaled / self.gradient_accumulation_steps
        opt = self.optimizer
        if self.state.pending_backward:
            raise RuntimeError("backward(): the last boundary backward's gradients are waiting for step(); call "
                               "step() after each backward()")
        boundary = self.is_gradient_accumulation_boundary()
        if boundary:  # hyperparameters fixed; without clipping/fp16, units step as their gradients land
            opt.begin_overlap(eager=not (self.config.gradient_clipping > 0 or self.config.fp16.enabled))
        self.coordinator.in_backward = True
        self.coordinator.grads_handed = 0
        oom = None
        try:
            try:
                with self.state.in_pass():
                    scaled.backward()
            finally:
                self.coordinator.in_backward = False
            self.coordinator.end_backward()
        except BaseException as exc:
            self.coordinator.abandon_grads()
            self.coordinator.end_backward()
            if not isinstance(exc, torch.OutOfMemoryError) or isinstance(exc, DeviceBudgetExceeded):
                self.state.abandon_step(f"backward() raised {exc!r}")
                raise
            self._losses.pop()
            oom = str(exc).splitlines()[0] if str(exc) else "out of memory"
            self.state.abandon_step(f"backward() ran out of device memory ({oom})")
            if self.gradient_accumulation_steps > 1 and self.coordinator.grads_handed:
                # part of this micro-batch's gradient is in the accumulators already: a retry would add it twice
                self.state.mark_partly_accumulated(
                    f"backward() ran out of device memory ({oom}) after {self.coordinator.grads_handed} "
                    "units had added this micro-batch's gradient to the accumulation")
            if self.state.partly_stepped is not None:
                raise
        if oom is not None:  # no unit stepped: give up the device placement, the micro-batch may run again
            del scaled, loss
            self._tokens -= self._forward_tokens
            self._forward_tokens = 0
            raise self.state.placement.budget_exceeded("backward", oom)
        self.state.pending_backward = boundary and self.gradient_accumulation_steps == 1

    @property
    def overlap_step(self) -> bool:
        """Whether the optimizer steps in a background thread (pyinfinity.overlap_step)."""
        return self._overlap_mode == "on"

    def synchronize(self) -> None:
        """Waits until the optimizer's background work is done: every unit's new values are home
        (and on the device for resident units). ``step()`` does not wait (the next forward waits
        unit by unit); call this before timing a step end to end or reading the model directly."""
        self.state.check_open()
        self.state.drain("synchronize()")

    def is_gradient_accumulation_boundary(self) -> bool:
        """Whether the next backward()/step() ends the accumulation window: as the caller set it
        (``set_gradient_accumulation_boundary``), else every ``gradient_accumulation_steps`` micro-batches."""
        told = self.__dict__.get("_boundary")
        if told is not None:
            return told
        return (self.micro_steps + 1) % self.gradient_accumulation_steps == 0

    def set_gradient_accumulation_boundary(self, is_boundary: Optional[bool]) -> None:
        """DeepSpeed's: the caller says whether the next backward()/step() ends the window (a
        training loop whose last window of an epoch is shorter); None goes back to counting."""
        self._boundary = None if is_boundary is None else bool(is_boundary)

    def step(self) -> Optional[StepRecord]:
        """Counts a micro-batch; at the accumulation boundary applies the optimizer (in the
        background with overlap_step: the next forward waits for each unit's new values), steps
        the lr schedule, zeroes the gradients and returns the step's telemetry."""
        self.state.check_trainable("step()")
        boundary = self.is_gradient_accumulation_boundary()
        if boundary and not self._losses:
            raise RuntimeError("step(): no backward() since the last optimizer step; call engine.backward(loss) "
                               "first (a step on zero gradients would still apply weight decay and momentum)")
        self.state.micro_steps += 1
        if not boundary:
            self.optimizer.check_accumulation("step()")  # a failed gradient add surfaces here at the latest
            return None
        fp16 = self.config.fp16.enabled
        try:
            self.coordinator.release_all()
            self.state.ownership.verify()  # a truncated swap file is an error here, not data
            res = self.optimizer.step(grad_scale=self.scaler.scale if fp16 else 1.0,
                                      clip=self.config.gradient_clipping, check_overflow=fp16)
        except BaseException as exc:
            self.state.abandon_step(f"step() raised {exc!r}")
            raise
        self.state.pending_backward = False
        if fp16:
            self.scaler.update(res.skipped)
            if res.skipped:
                log.info("step %d: fp16 overflow, skipped; loss scale now %g", self.global_steps, self.scaler.scale)
        self.optimizer.zero_grad()
        lr = float(self.optimizer.param_groups[0]["lr"])
        if not res.skipped:
            self.state.global_steps += 1
            if self.lr_scheduler is not None:
                self.lr_scheduler.step()
        rec = self._record(res, lr)
        self.history.append(rec)
        self.state.placement.after_step()
        if self.global_steps % (self.config.pyinfinity.log_every or self.config.steps_per_print) == 0:
            log.info("step %d loss %.4f lr %.3g %.0f tok/s peak %s overlap %s", rec.step, rec.loss, rec.lr,
                     rec.tokens_per_s, format_size(rec.peak_device_bytes),
                     "n/a" if rec.overlap_fraction is None else f"{rec.overlap_fraction:.2f}")
        return rec

    def zero_grad(self) -> None:
        """Zeroes the accumulated gradients (``step`` does this itself at the boundary); after a
        boundary backward it drops that backward's gradients (the weights stay as they were)."""
        self.state.check_open()
        if self.optimizer.overlap_open:
            raise RuntimeError("zero_grad(): the boundary backward() has already stepped part of the model in the "
                               "background (overlap_step); call step() (or set pyinfinity.overlap_step false)")
        self.state.drain("zero_grad()")
        self.optimizer.restore_homes()
        self.state.pending_backward = False
        self.optimizer.zero_grad()

    def train(self, mode: bool = True) -> "Engine":
        self.module.train(mode)
        return self

    def eval(self) -> "Engine":
        self.module.eval()
        return self

    def __getattr__(self, name: str) -> Any:
        # generate(), config, ... of the wrapped module (hooks make its parameters resident)
        module = self.__dict__.get("module")
        if module is None or name.startswith("_") or name in ("state", "coordinator", "partition", "config"):
            raise AttributeError(f"'Engine' object has no attribute {name!r}")
        return getattr(module, name)

    def get_lr(self) -> list[float]:
        return [g["lr"] for g in self.optimizer.param_groups]

    # ------------------------------------------------------------------------- telemetry
    def _counters(self) -> dict[str, Any]:
        moved: dict[str, int] = {}
        for cls, sw in (("params", self.param_swapper), ("optimizer", self.optim_swapper)):
            for k, v in sw.stats.bytes.items():
                moved[f"{cls}.{k}"] = v
        st = self.coordinator.stats
        moved["device.h2d"] = st.fetched_bytes
        moved["device.d2h"] = st.grad_bytes
        io = self.state.io_stats()
        return {"moved": moved, "fetch": st.snapshot(), "io": io}

    def _record(self, res: Any, lr: float) -> StepRecord:
        now = time.perf_counter()
        seconds = now - (self._step_t0 or now)
        cur = self._counters()
        moved = {k: v - self._mark["moved"].get(k, 0) for k, v in cur["moved"].items()}
        moved = {k: v for k, v in moved.items() if v}
        f0, f1 = self._mark["fetch"], cur["fetch"]
        overlap: Optional[float] = None
        sample = self.coordinator.overlap()
        if sample is not None:
            if sample.transfer_s > 0:
                overlap = max(0.0, 1.0 - sample.stalled_s / sample.transfer_s)
        elif "params" in cur["io"]:
            busy = cur["io"]["params"]["read"]["seconds"] - self._mark["io"]["params"]["read"]["seconds"]
            waited = f1.fetch_wait_seconds - f0.fetch_wait_seconds
            if busy > 0:
                overlap = min(1.0, max(0.0, 1.0 - waited / busy))
        loss = float(torch.stack([l.float() for l in self._losses]).mean()) if self._losses else float("nan")
        peak_alloc = None
        if self.device.type == "cuda":
            peak_alloc = self.coordinator.budget.allocator_peaks()[0]
        rec = StepRecord(step=self.global_steps, loss=loss, lr=lr, tokens=self._tokens, seconds=seconds,
                         tokens_per_s=self._tokens / seconds if seconds > 0 else 0.0,
                         grad_norm=res.grad_norm, skipped=res.skipped,
                         loss_scale=self.scaler.scale if self.config.fp16.enabled else 1.0,
                         peak_device_bytes=self.coordinator.budget.peak, peak_device_allocated=peak_alloc,
                         bytes_moved=moved, overlap_fraction=overlap,
                         prefetch_hits=f1.prefetch_hits - f0.prefetch_hits,
                         on_demand_fetches=f1.on_demand - f0.on_demand, optimizer_seconds=res.seconds,
                         optimizer_busy_seconds=res.busy_seconds, overlapped_shards=res.overlapped_shards,
                         optimizer_phases=getattr(res, "phases", None) or None,
                         step_wait_seconds=f1.step_wait_seconds - f0.step_wait_seconds)
        self._mark = cur
        self._losses.clear()
        self._tokens = 0
        self._step_t0 = None
        return rec

    def memory_report(self) -> MemoryReport:
        """Bytes per tensor class and tier now, and the device peaks."""
        params: dict[str, int] = {}
        for sh in self.partition.shards:
            params[sh.home.tier.value] = params.get(sh.home.tier.value, 0) + sh.nbytes
        params["device(resident)"] = sum(sh.nbytes for sh in self.partition.shards if sh.buffer is not None)
        return MemoryReport(
            device=str(self.device), device_budget=self.device_memory,
            device_resident=self.coordinator.budget.resident, device_peak=self.coordinator.budget.peak,
            device_allocated_peak=self.coordinator.budget.allocator_peaks()[0] if self.device.type == "cuda" else None,
            params=params, optimizer=self.optimizer.bytes_by_tier,
            grads={"cpu": 0, **self.optimizer.grad_bytes_by_tier},
            swap_files=self.param_swapper.files() + self.optim_swapper.files(), host_rss=host_rss(),
            optimizer_state=self.optimizer.format.name)

    # ------------------------------------------------------------------------- checkpoints
    def save_checkpoint(self, save_dir: str, tag: Optional[str] = None, client_state: Optional[dict] = None, *,
                        keep_last: Optional[int] = None, blocking: bool = True, by_reference: bool = True) -> str:
        """Writes the full training state (NVMe-resident tensors included) to ``save_dir/tag``:
        written under a temporary name, fsynced, then renamed; ``save_dir/latest`` names it.
        Frozen parameters that all came from the pretrained weights (a LoRA run's base) are not
        written: the checkpoint records the weights' identity, which a load checks. ``keep_last``
        (default: the config's ``pyinfinity.checkpoint_keep_last``): once the new checkpoint is
        durable, the oldest of ``save_dir`` are removed until that many remain. ``blocking=False``:
        returns once the point of the state it saves is fixed; the bytes are written while training
        goes on (each shard's copy taken before its next update), ``latest`` moves when they are
        all fsynced. The next save, a load, ``export``, ``close`` and ``wait_for_checkpoint`` wait
        for it and raise its failure. The shard copies a save holds not yet written stay within
        ``pyinfinity.checkpoint_staging`` (charged in the layout's host RAM; "auto": none, a save
        then copies one shard at a time). ``by_reference``: optimizer state on NVMe is held by
        reference (a hard link to the swap file and the slots' places, nothing copied;
        ``checkpoint`` module doc), False: copied. Returns the checkpoint's path."""
        if keep_last is None:
            keep_last = self.config.pyinfinity.checkpoint_keep_last
        self.wait_for_checkpoint("save_checkpoint()")
        write = checkpoint.save(self.state, save_dir, tag, client_state, base=self._base_identity(),
                                keep_last=keep_last, blocking=blocking, staging=self.config.checkpoint_staging_bytes,
                                by_reference=by_reference)
        if not blocking:
            self._checkpoint_write = write
        return write.path

    def wait_for_checkpoint(self, what: str = "wait_for_checkpoint()") -> Optional[checkpoint.CheckpointWrite]:
        """Waits until a background save is complete (Ctrl-C interrupts the wait within 0.1 s; the
        write goes on) and raises its failure; returns that save (None: there was none)."""
        write = self.__dict__.get("_checkpoint_write")
        if write is None:
            return None
        write.join()  # Ctrl-C: the write goes on, to be waited for again
        self._checkpoint_write = None
        write.raise_failure(what)  # once
        return write

    def load_checkpoint(self, load_dir: str, tag: Optional[str] = None, *,
                        convert_optimizer_state: bool = False) -> tuple[str, dict]:
        """Restores a state written by ``save_checkpoint``; returns (path, client_state). A
        checkpoint whose optimizer state is of another format (``pyinfinity.optimizer_state``) is
        refused unless ``convert_optimizer_state`` (then decoded to fp32 and encoded in this one's)."""
        self.wait_for_checkpoint("load_checkpoint()")
        return checkpoint.load(self.state, load_dir, tag, base=self._base_identity(),
                               convert_optimizer_state=convert_optimizer_state)

    def _base_identity(self) -> Optional[dict]:
        """The identity of the pretrained weights every parameter started from, when some shards are
        frozen (they hold those weights unchanged); None without frozen shards, without pretrained
        weights, or when some parameters were newly initialised."""
        w = self.weights
        if w is None or not w.complete or all(self.optimizer.state_of(sh) is not None for sh in self.partition.shards):
            return None
        identity = w.identity()
        from pyinfinity import adapters

        if adapters.is_peft_model(self.module):  # what trains over that base: a resume must train the same
            identity["adapters"] = adapters.training_identity(self.module)
        return identity

    def export(self, out_dir: str, *, merge_adapters: bool = False) -> list[str]:
        """Writes the trained weights as a consolidated safetensors state dict loadable by the
        plain model (``load_state_dict``; ``from_pretrained`` for a transformers model, whose
        config.json is written too). Values come from the fp32 masters, cast to each
        parameter's original dtype. A PEFT model's LoRA adapters are written in PEFT's format
        (``PeftModel.from_pretrained`` loads them), or with ``merge_adapters`` merged into the
        base model (``from_pretrained`` loads it). Returns the files written (``pyinfinity.export``)."""
        from pyinfinity import export

        self.wait_for_checkpoint("export()")
        return export.write(self.state, out_dir, tokenizer_dir=self.weights.path if self.weights is not None else None,
                            merge_adapters=merge_adapters)

    # ------------------------------------------------------------------------- life
    @property
    def closed(self) -> bool:
        """Whether the engine was closed (or its construction failed): it can no longer be used."""
        state = self.__dict__.get("state")
        return state is None or state.closed

    def close(self) -> None:
        """Removes the hooks, frees device/pinned memory and removes the swap files. Idempotent."""
        state = self.__dict__.get("state")
        if state is None or state.released:
            return
        write = self.__dict__.get("_checkpoint_write")
        failure = None
        if write is not None:
            try:
                self.wait_for_checkpoint("close()")
            except KeyboardInterrupt:
                raise
            except BaseException as exc:  # noqa: BLE001 - raised once the engine is closed
                failure = exc
        plan, history = self.__dict__.get("plan"), self.__dict__.get("history")
        if plan is not None and history:
            micro = max(1, self.gradient_accumulation_steps)
            tokens = history[-1].tokens // micro if history[-1].tokens else None
            log.info("%s", plan.compare([r.seconds for r in history], tokens_per_micro_batch=tokens,
                                        parts=measured_parts(list(history))))
        state.close()
        self._uncap()
        if failure is not None:
            raise failure

    def _uncap(self) -> None:
        if self.__dict__.get("_capped"):  # the cap was this engine's: later work in the process is not capped
            self._capped = False
            torch.cuda.set_per_process_memory_fraction(1.0, self.device)

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def _inputs_to(x: Any, device: torch.device) -> Any:
    """``x`` with every tensor in it (through plain lists, tuples and dicts) on ``device``."""
    if isinstance(x, torch.Tensor):
        return x if x.device == device else x.to(device)
    if type(x) in (list, tuple):
        return type(x)(_inputs_to(v, device) for v in x)
    if type(x) is dict:
        return {k: _inputs_to(v, device) for k, v in x.items()}
    return x


def retry_micro_batch(fn: Any) -> Any:
    """Runs ``fn()`` (one micro-batch's forward and backward) and, if it raises
    DeviceBudgetExceeded (the engine has given up its device placement), runs it once more."""
    try:
        return fn()
    except DeviceBudgetExceeded as exc:
        log.warning("retrying the micro-batch once: %s", exc.gave_up or exc)
    # outside the except block: the failed attempt's frames (and its activations) are freed first
    return fn()


def _count_tokens(args: tuple, kwargs: dict) -> int:
    t = kwargs.get("input_ids")
    if t is None:
        for a in args:
            if isinstance(a, torch.Tensor):
                t = a
                break
    return int(t.numel()) if isinstance(t, torch.Tensor) else 0


__all__ = ["initialize", "from_pretrained", "init_empty", "Engine", "StepRecord", "MemoryReport", "retry_micro_batch",
           "HISTORY_STEPS", "SHRINK_AT"]
