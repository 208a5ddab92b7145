"""``"auto"`` in a DeepSpeed-format config, decided by the planner.

``resolve_auto(config_dict, model_or_sizes)`` returns the same dict with every ``"auto"`` replaced
(and, where a section's device is ``"auto"``, its split knobs ``max_in_cpu``/``ratio`` too) plus the
:class:`Placement`; ``plan_engine_config(cfg, model, device)`` is the same for the engine's parsed
``Config``. Explicit values are honoured: the planner only chooses among placements that keep them.
"""
from __future__ import annotations

import copy
import errno
import logging
from dataclasses import dataclass, replace
from typing import Any, Optional, Protocol, Union

import torch

from pyinfinity.config import (auto_overlap_off, default_optimizer_threads, format_size, load_config,
                               optimizer_threads, overlap_step_blocker)
from pyinfinity.config_values import SwapSpaceTooSmall
from pyinfinity.layout.charges import PlanError, TrainShape, fmt, largest_shape
from pyinfinity.layout.pools import EnginePools, engine_pools
from pyinfinity.layout.shards import Knobs
from pyinfinity.layout.sizes import ModelSizes
from pyinfinity.plan.budgets import Budgets, measure_budgets
from pyinfinity.plan.evaluation import (Placement, evaluate, flops_compute, swap_shortfalls, swap_violations,
                                       train_at_seq_len)
from pyinfinity.plan.placement import Fixed, solve
from pyinfinity.plan.rates import Rates
from pyinfinity.plan.sizes import model_sizes
from pyinfinity.units import auto_unit_bytes

log = logging.getLogger(__name__)

AUTO = "auto"
DEFAULT_SEQ_LEN = 1024
# "auto" overlap_step on a CPU compute device: off. Backward then runs on the same cores as the
# background step (see config.auto_overlap_off).
AUTO_OVERLAP_ON_CPU = False

# Fixed field -> dotted config key
KEYS = {
    "param_device": "zero_optimization.offload_param.device",
    "max_in_cpu": "zero_optimization.offload_param.max_in_cpu",
    "param_buffer_count": "zero_optimization.offload_param.buffer_count",
    "param_buffer_size": "zero_optimization.offload_param.buffer_size",
    "optimizer_device": "zero_optimization.offload_optimizer.device",
    "ratio": "zero_optimization.offload_optimizer.ratio",
    "optimizer_buffer_count": "zero_optimization.offload_optimizer.buffer_count",
    "prefetch_bytes": "zero_optimization.stage3_prefetch_bucket_size",
    "max_live": "zero_optimization.stage3_max_live_parameters",
    "persistence_threshold": "zero_optimization.stage3_param_persistence_threshold",
    "prefetch": "pyinfinity.prefetch",
    "optimizer_step_device": "pyinfinity.optimizer_step_device",
    "resident_bytes": "pyinfinity.resident_bytes",
    "device_optimizer_bytes": "pyinfinity.device_optimizer_bytes",
    "device_accumulator_bytes": "pyinfinity.device_accumulator_bytes",
}
# planned only when something else is: left "auto" in an otherwise fixed config, they become 0
UNPLANNED_ALONE = {"resident_bytes", "device_optimizer_bytes", "device_accumulator_bytes"}
# sized only when something else is planned; in an otherwise fixed config, from the device budget
# (``budget_sizing``): most configs leave it out, and absent means "auto"
SIZED_ALONE = {"max_live"}
SPLIT_OF = {"max_in_cpu": "param_device", "ratio": "optimizer_device"}


class Probes(Protocol):
    """What the planner asks of the machine when it is not handed rates (the engine passes
    ``pyinfinity.probes.MachineProbes``): the rates of a run of the parsed config ``cfg`` on
    ``device`` (matmuls of ``rows`` x the model's width in ``dtype``; ``rates_file`` figures first),
    and the seconds of one micro-batch of ``model`` on the device (None: FLOPs / matmul rate
    stands in)."""

    def rates(self, cfg: Any, device: torch.device, sizes: ModelSizes, dtype: torch.dtype, rows: int,
              rates_file: Optional[str] = None) -> Rates: ...

    def compute(self, model: Any, train: TrainShape, device: torch.device, device_memory: Optional[int],
                dtype: torch.dtype) -> Optional[float]: ...


def no_rates(what: str) -> ValueError:
    """The error of a plan asked for without rates and without probes to measure them."""
    return ValueError(f"{what}: the config leaves its placement to the planner, which needs rates: pass rates "
                      "(a Rates) or probes (pyinfinity.probes.MachineProbes() measures this machine)")


@dataclass
class Decision:
    """One value the planner chose: the dotted config key, the value and why."""

    key: str
    value: Any
    why: str


def _get(d: dict, dotted: str) -> Any:
    cur: Any = d
    for part in dotted.split("."):
        if not isinstance(cur, dict) or part not in cur:
            return None
        cur = cur[part]
    return cur


def _has(d: dict, dotted: str) -> bool:
    cur: Any = d
    for part in dotted.split("."):
        if not isinstance(cur, dict) or part not in cur:
            return False
        cur = cur[part]
    return True


def _set(d: dict, dotted: str, value: Any) -> None:
    parts = dotted.split(".")
    cur = d
    for part in parts[:-1]:
        if not isinstance(cur.get(part), dict):
            cur[part] = {}
        cur = cur[part]
    cur[parts[-1]] = value


def _train_shape(cfg: Any, seq_len: Optional[int], checkpointing: bool) -> TrainShape:
    ov = cfg.pyinfinity.overlap_step
    if overlap_step_blocker(cfg) is not None or ov is False:
        overlap = "off"
    else:
        overlap = "on" if ov is True else "auto"
    return TrainShape(micro_batch=int(cfg.train_micro_batch_size_per_gpu), seq_len=int(seq_len or DEFAULT_SEQ_LEN),
                      grad_accum=int(cfg.gradient_accumulation_steps), checkpointing=checkpointing,
                      overlap_step=overlap, norm_first=cfg.gradient_clipping > 0 or cfg.fp16.enabled,
                      optimizer_state=cfg.optimizer_state_format)


def planned_train_shape(cfg: Any, seq_len: Optional[int], checkpointing: bool) -> TrainShape:
    """The training shape the planner plans a parsed config for (what ``plan_engine_config`` uses)."""
    return _train_shape(cfg, seq_len, checkpointing)


def planned_fixed(cfg: Any) -> Fixed:
    """The placement knobs a parsed config fixes (the rest are the planner's)."""
    return _fixed_from(cfg, None)[0]


def compute_dtype(cfg: Any) -> Optional[torch.dtype]:
    """The dtype a config trains in: fp16 or bf16 when enabled, else None (the model's own)."""
    if cfg.fp16.enabled:
        return torch.float16
    if cfg.bf16.enabled:
        return torch.bfloat16
    return None


def run_dtype(cfg: Any, model: Any = None) -> torch.dtype:
    """The dtype the compute runs in, for the matmul and gradient-add probes: the config's (fp16 or
    bf16 enabled), else the dtype most of the model's floating parameters are in (a LoRA run keeps
    its bf16 base beside fp32 adapters with no bf16 section: timing fp32 matmuls for it predicted a
    compute ten times too slow), else fp32."""
    dt = compute_dtype(cfg)
    if dt is not None:
        return dt
    counts: dict[torch.dtype, int] = {}
    if isinstance(model, torch.nn.Module):
        for p in model.parameters():
            if p.is_floating_point():
                counts[p.dtype] = counts.get(p.dtype, 0) + p.numel()
    return max(counts, key=lambda d: counts[d]) if counts else torch.float32


def planned_device(cfg: Any, device: Optional[Union[str, torch.device]]) -> torch.device:
    """The device planned for: ``device`` if given, else ``pyinfinity.device``; ``cuda``/``auto``
    on a GPU machine with its index (a CUDA device not on this machine stays as given)."""
    from pyinfinity.device import resolve_device

    return resolve_device(device if device is not None else cfg.pyinfinity.device, must_exist=False)


def _fixed_from(cfg: Any, raw: Optional[dict]) -> tuple[Fixed, set[str]]:
    """Knobs the config fixes, and the fields the planner owns (auto, or the split knob of an auto
    device; with ``raw`` given, absent keys are planner-owned too)."""
    z = cfg.zero_optimization
    values = {
        "param_device": z.offload_param.device, "max_in_cpu": z.offload_param.max_in_cpu,
        "param_buffer_count": z.offload_param.buffer_count, "param_buffer_size": z.offload_param.buffer_size,
        "optimizer_device": z.offload_optimizer.device, "ratio": z.offload_optimizer.ratio,
        "optimizer_buffer_count": z.offload_optimizer.buffer_count,
        "prefetch_bytes": z.stage3_prefetch_bucket_size, "max_live": z.stage3_max_live_parameters,
        "persistence_threshold": z.stage3_param_persistence_threshold, "prefetch": cfg.pyinfinity.prefetch,
        "optimizer_step_device": cfg.pyinfinity.optimizer_step_device,
        "resident_bytes": cfg.pyinfinity.resident_bytes,
        "device_optimizer_bytes": cfg.pyinfinity.device_optimizer_bytes,
        "device_accumulator_bytes": cfg.pyinfinity.device_accumulator_bytes,
    }
    owned = {name for name, v in values.items() if v == AUTO}
    for split, dev in SPLIT_OF.items():
        if values[dev] == AUTO:
            owned.add(split)
    if raw is not None:
        owned |= {name for name, key in KEYS.items() if not _has(raw, key)}
    fixed = Fixed(**{name: v for name, v in values.items() if name not in owned},
                  checkpoint_staging=cfg.checkpoint_staging_bytes)
    return fixed, owned


def _placement_is_possible(cfg: Any) -> bool:
    """Whether anything placement-related is "auto" (else no rates need measuring). A config that
    fixes everything but ``resident_bytes`` is not planned: it keeps no unit resident (and so no
    optimizer state on the device)."""
    fixed, owned = _fixed_from(cfg, None)
    return bool(owned - UNPLANNED_ALONE - SIZED_ALONE)


def budget_sizing(cfg: Any, sizes: ModelSizes, device_memory: int) -> dict[str, int]:
    """The live-parameter cap of a config that fixes its placement and leaves the cap "auto" (or
    out), sized without a plan: the device budget in elements of the shards' narrowest dtype (the
    budget check governs what is held; DeepSpeed's 1e9 default would forbid two of a 30B model's
    decoder layers at once). Empty when the config sets the cap."""
    _, owned = _fixed_from(cfg, None)
    if "max_live" not in owned:
        return {}
    return {"max_live": sizes.live_elements(device_memory)}


def plan_config(cfg: Any, sizes: ModelSizes, budgets: Budgets, rates: Rates, train: TrainShape,
                owned: set[str], fixed: Fixed) -> tuple[Any, list[Decision], Placement]:
    """Solves with ``fixed`` and writes the owned knobs into a copy of ``cfg`` (a parsed Config)."""
    c = copy.deepcopy(cfg)
    z = c.zero_optimization
    paths = list(c.nvme_paths)
    placement = solve(sizes, train, budgets, rates, fixed, paths)
    vals = placement.config_values()
    decisions: list[Decision] = []
    why = f"planner: {placement.predicted.breakdown()}"
    for name in sorted(owned):
        key = KEYS[name]
        if name == "prefetch":
            continue
        value = vals[key]
        sec, _, leaf = key.rpartition(".")
        obj: Any = c
        for part in sec.split("."):
            obj = getattr(obj, part)
        setattr(obj, leaf, value)
        decisions.append(Decision(key, value, why))
    for sec in (z.offload_param, z.offload_optimizer):
        if sec.device == "nvme" and not sec.nvme_path:
            sec.nvme_path = paths or None
    e = c.pyinfinity
    if e.device_memory in (AUTO, None):
        e.device_memory = budgets.device_memory
        decisions.append(Decision("pyinfinity.device_memory", e.device_memory, "measured device budget"))
    if e.host_memory == AUTO:
        e.host_memory = budgets.host_memory
        decisions.append(Decision("pyinfinity.host_memory", e.host_memory, "measured host budget"))
    decisions += _threads(e)
    return c, decisions, placement


def _threads(e: Any) -> list[Decision]:
    """``pyinfinity.optimizer_threads`` "auto" decided for the config's device."""
    if e.optimizer_threads != AUTO or e.device == AUTO:
        return []
    e.optimizer_threads = default_optimizer_threads(e.device)
    return [Decision("pyinfinity.optimizer_threads", e.optimizer_threads,
                     "one on the CPU device, else every CPU of this process")]


def decide_unit_bytes(c: Any, whole: ModelSizes) -> list[Decision]:
    """``pyinfinity.unit_bytes`` "auto" of the parsed config ``c`` decided, in place, before the
    units are counted (the planner counts the units the partition makes): ``units.auto_unit_bytes``
    of the model (``whole``: its sizes, any unit cap), within a device budget the config sets. The
    engine (``plan_engine_config``) and ``plan -o`` (``resolve_auto``, the CLI) both decide it here."""
    e = c.pyinfinity
    if e.unit_bytes != AUTO:
        return []
    dm = e.device_memory
    e.unit_bytes = auto_unit_bytes(whole.param_bytes, whole.largest_module_bytes, dm if isinstance(dm, int) else None)
    return [Decision("pyinfinity.unit_bytes", e.unit_bytes,
                     "at most a quarter of the model and an eighth of a set device budget, at least its largest module")]


def _unit_bytes(c: Any, model: Any) -> list[Decision]:
    """:func:`decide_unit_bytes` for a model (or its config, or its sizes)."""
    return decide_unit_bytes(c, model_sizes(model, compute_dtype(c))) if c.pyinfinity.unit_bytes == AUTO else []


def _overlap_step(c: Any, device: torch.device) -> list[Decision]:
    """``pyinfinity.overlap_step`` "auto" decided for the resolved placement: off where
    ``config.overlap_step_blocker`` names a reason (the optimizer steps on the compute device) or
    ``config.auto_overlap_off`` does (the CPU device with the optimizer state all in RAM; the
    planner's prediction asks the same rule), else on. Clipping and fp16 loss scaling do not turn
    it off: the step then runs after backward, unit by unit, while the next forward goes on."""
    e = c.pyinfinity
    if e.overlap_step != AUTO:
        return []
    oo = c.zero_optimization.offload_optimizer
    why = overlap_step_blocker(c) or auto_overlap_off(device.type == "cuda", oo.device == "nvme" and oo.ratio > 0,
                                                      AUTO_OVERLAP_ON_CPU)
    e.overlap_step = why is None
    return [] if why is None else [Decision("pyinfinity.overlap_step", False, why)]


def engine_optimizer_threads(e: Any, device: Union[str, torch.device]) -> int:
    """The threads the engine's CPU Adam step runs on under the ``pyinfinity`` section ``e`` on
    ``device`` (what ``Engine`` gives the optimizer): the rate probe times the kernel on as many."""
    return optimizer_threads(e.optimizer_threads, str(torch.device(device)))


def resolve_auto(config_dict: dict, model_or_sizes: Any, budgets: Optional[Budgets] = None,
                 rates: Optional[Rates] = None, *, seq_len: Optional[int] = None, checkpointing: bool = False,
                 device: Optional[Union[str, torch.device]] = None, rates_file: Optional[str] = None,
                 fill_absent: bool = False, compute_seconds: Optional[float] = None,
                 activation_bytes: Optional[int] = None, probes: Optional[Probes] = None) -> tuple[dict, Placement]:
    """Every ``"auto"`` of ``config_dict`` decided by the planner: returns (a new dict the config
    loader accepts, the Placement). ``model_or_sizes``: an nn.Module (possibly from
    ``init_empty``), a transformers config (dict or path) or ModelSizes. ``budgets`` defaults to
    measuring this machine, ``rates`` to asking ``probes`` (``pyinfinity.probes.MachineProbes()``
    times this machine; without either, ValueError). fill_absent: keys the dict does not set are decided too
    (the CLI's resolved config spells every knob out).

    The training shape comes from the config (micro-batch, accumulation, bf16/fp16) plus
    ``seq_len`` (default 1024) and ``checkpointing``; ``compute_seconds``/``activation_bytes`` are
    measured figures of one micro-batch (``probes.measure_decoder_compute``) that replace the
    estimates. Raises ConfigError for a bad config and
    PlanError (a ValueError) when no placement fits, with the numbers.
    """
    cfg = load_config(copy.deepcopy(config_dict))
    dev = planned_device(cfg, device)
    # the unit size the engine would decide; sizes given are taken as counted with it (the CLI
    # counts them after decide_unit_bytes), a model or its config is counted with it here
    units = _unit_bytes(cfg, model_or_sizes)
    unit_bytes = cfg.pyinfinity.unit_bytes
    sizes = model_sizes(model_or_sizes, compute_dtype(cfg), unit_bytes=unit_bytes if isinstance(unit_bytes, int)
                        else None)
    if budgets is None:
        dm, hm = cfg.pyinfinity.device_memory, cfg.pyinfinity.host_memory
        budgets = measure_budgets(dev, cfg.nvme_paths, device_memory=dm if isinstance(dm, int) else None,
                                  host_memory=hm if isinstance(hm, int) else None)
    if rates is None:
        if probes is None:
            raise no_rates("resolve_auto")
        rows = min(4096, max(64, cfg.train_micro_batch_size_per_gpu * (seq_len or DEFAULT_SEQ_LEN)))
        rates = probes.rates(cfg, dev, sizes, run_dtype(cfg, model_or_sizes), rows, rates_file)
    fixed, owned = _fixed_from(cfg, config_dict if fill_absent else None)
    train = _train_shape(cfg, seq_len, checkpointing)
    train.compute_seconds, train.activation_bytes = compute_seconds, activation_bytes
    resolved_cfg, decisions, placement = plan_config(cfg, sizes, budgets, rates, train, owned, fixed)
    decisions = units + decisions + _overlap_step(resolved_cfg, dev)
    out = copy.deepcopy(config_dict)
    for d in decisions:
        _set(out, d.key, d.value)
    if _get(out, "pyinfinity.overlap_step") == AUTO or (fill_absent and not _has(out, "pyinfinity.overlap_step")):
        _set(out, "pyinfinity.overlap_step", resolved_cfg.pyinfinity.overlap_step)  # decided on as well as off
    z = resolved_cfg.zero_optimization
    for name, sec in (("offload_param", z.offload_param), ("offload_optimizer", z.offload_optimizer)):
        if sec.device == "nvme" and not _get(out, f"zero_optimization.{name}.nvme_path") and sec.nvme_path:
            _set(out, f"zero_optimization.{name}.nvme_path", sec.nvme_path)
    if _get(out, "pyinfinity.device") == AUTO or device is not None:
        _set(out, "pyinfinity.device", str(dev))
    load_config(out)  # what we hand back must load
    return out, placement


def aio_options(cfg: Any) -> dict:
    """A config's ``aio`` section as the keyword arguments the rate probes take."""
    a = cfg.aio
    return {"block_size": a.block_size, "queue_depth": a.queue_depth, "thread_count": a.thread_count,
            "backend": a.backend}


def plan_engine_config(cfg: Any, model: Any, device: Union[str, torch.device], *,
                       seq_len: Optional[int] = None, rates: Optional[Rates] = None,
                       budgets: Optional[Budgets] = None,
                       checkpointing: bool = False,
                       probes: Optional[Probes] = None) -> tuple[Any, list[Decision], Optional[Placement]]:
    """For ``Engine.__init__``: (Config with every "auto" decided, the decisions, the Placement or
    None when only budgets were "auto"). Every "auto" of the config is decided here, the one place
    (the placement and its buffers, ``unit_bytes``, the budgets, ``optimizer_threads``,
    ``overlap_step``): the engine and its training state read resolved values. Without ``rates``,
    ``probes`` measure them (and, on a GPU,
    one micro-batch of the model) when there is a placement to plan. Without
    ``seq_len`` the activations are charged at DEFAULT_SEQ_LEN tokens per sequence (the engine
    plans before it sees a batch); ``checkpointing``: the model recomputes activations."""
    dev = torch.device(device)
    c = copy.deepcopy(cfg)
    if c.pyinfinity.device == AUTO:
        c.pyinfinity.device = str(dev)
    dm, hm = c.pyinfinity.device_memory, c.pyinfinity.host_memory
    if budgets is None:
        budgets = measure_budgets(dev, c.nvme_paths, device_memory=dm if isinstance(dm, int) else None,
                                  host_memory=hm if isinstance(hm, int) else None)
    units = _unit_bytes(c, model)
    sizes = model_sizes(model, compute_dtype(c), unit_bytes=int(c.pyinfinity.unit_bytes))
    if not _placement_is_possible(c):
        decisions = units
        if c.pyinfinity.resident_bytes == AUTO:
            c.pyinfinity.resident_bytes = 0
        if c.pyinfinity.device_optimizer_bytes == AUTO:
            c.pyinfinity.device_optimizer_bytes = 0
        if c.pyinfinity.device_accumulator_bytes == AUTO:
            c.pyinfinity.device_accumulator_bytes = 0
        if dm in (AUTO, None):
            c.pyinfinity.device_memory = budgets.device_memory
            decisions.append(Decision("pyinfinity.device_memory", budgets.device_memory, "measured device budget"))
        if hm == AUTO:
            c.pyinfinity.host_memory = budgets.host_memory
            decisions.append(Decision("pyinfinity.host_memory", budgets.host_memory, "measured host budget"))
        decisions += _threads(c.pyinfinity)
        for name, value in budget_sizing(c, sizes, int(c.pyinfinity.device_memory)).items():
            key = KEYS[name]
            setattr(c.zero_optimization, key.rsplit(".", 1)[1], value)
            decisions.append(Decision(key, value, "the device budget (the placement is the config's)"))
        decisions += _overlap_step(c, dev)
        return c, decisions, None
    dtype = run_dtype(c, model)
    if rates is None:
        if probes is None:
            raise no_rates("plan_engine_config")
        rates = probes.rates(c, dev, sizes, dtype, 1024)
    fixed, owned = _fixed_from(c, None)
    train = _train_shape(c, seq_len, checkpointing)
    if not str(dev).startswith("cuda"):
        # the CPU device: activations live in host RAM beside it, not in the device budget
        train.activation_bytes = 0
    elif probes is not None:
        train.compute_seconds = probes.compute(model, train, dev, budgets.device_memory, dtype)
    try:
        out, decisions, placement = plan_config(c, sizes, budgets, rates, train, owned, fixed)
        planned_at = f"{DEFAULT_SEQ_LEN} tokens per sequence"
    except PlanError:
        if seq_len is not None or train.activation_bytes == 0:
            raise
        # the shape is not known yet: plan at the longest sequence that fits with nothing resident;
        # the first forward refuses a longer one in one line (DevicePlacement.check_shape)
        mb, seq = largest_shape(sizes, train, budgets.device_memory)
        if mb != train.micro_batch or seq >= train.seq_len:
            raise
        for _ in range(20):  # knobs the config fixes (a prefetch bucket, say) take a little more
            train = train_at_seq_len(sizes, train, seq)
            try:
                out, decisions, placement = plan_config(c, sizes, budgets, rates, train, owned, fixed)
                break
            except PlanError:
                if seq <= 1:
                    raise
                seq = max(1, seq * 15 // 16)
        else:
            raise
        planned_at = (f"{seq} tokens per sequence, the longest that fits the device budget at micro-batch {mb} "
                      f"({DEFAULT_SEQ_LEN} does not)")
    # for Placement.compare at the end of the run, which re-predicts at the run's real shape
    placement.inputs = (sizes, budgets, rates, train, list(c.nvme_paths))
    if seq_len is None:
        placement.notes.append(f"sequence length unknown at initialize: activations and compute estimated at "
                               f"{planned_at}")
    if train.compute_seconds is not None:
        placement.notes.append(f"compute: {train.compute_seconds:.3f} s a micro-batch, measured on the device with "
                               "1 and 2 of the model's layers (FLOPs / matmul rate would say "
                               f"{flops_compute(sizes, train, rates):.3f})")
    log.info("plan:\n%s", placement.table())
    return out, units + decisions + _overlap_step(out, dev), placement


UNPROBED = "not probed: the config fixes the placement"


def check_placement(cfg: Any, model: Any, device: Union[str, torch.device], *, seq_len: Optional[int] = None,
                    checkpointing: bool = False, budgets: Optional[Budgets] = None) -> Placement:
    """The placement of a resolved config that fixes every placement knob (``plan_engine_config``
    returned no plan), checked against this machine before the engine writes a byte: PlanError,
    one line naming each pool, its need and its budget, as ``solve`` refuses a plan. The pools:
    host RAM; each swap filesystem, for the files the engine claims there
    (``layout.pools.EnginePools.swap_per_dir``); on a GPU the device, for what the engine cannot
    give up (the layout's peak less the prefetch bucket, which it shrinks to stay within the
    budget). A shortfall of swap space alone is ``SwapSpaceTooSmall`` (ENOSPC, the directory), as
    the swap directories' claim raises it. No rate is probed (bytes need none),
    so the Placement's times are not a prediction: ``Placement.table`` is not for this one; the
    engine logs ``budget_summary``. Activations are charged as ``plan_engine_config`` charges
    them: not on the CPU device, and on a GPU only when ``seq_len`` is known (the first forward
    checks a batch's shape against the budget)."""
    dev = torch.device(device)
    ub = cfg.pyinfinity.unit_bytes
    sizes = model_sizes(model, compute_dtype(cfg), unit_bytes=ub if isinstance(ub, int) else None)
    if budgets is None:
        dm, hm = cfg.pyinfinity.device_memory, cfg.pyinfinity.host_memory
        budgets = measure_budgets(dev, cfg.nvme_paths, device_memory=dm if isinstance(dm, int) else None,
                                  host_memory=hm if isinstance(hm, int) else None)
    k = _fixed_knobs(cfg, sizes, budgets.device_memory)
    train = _train_shape(cfg, seq_len, checkpointing)
    if dev.type != "cuda" or seq_len is None:
        train.activation_bytes = 0
    unit = 1.0  # placeholders: evaluate's bytes do not depend on the rates
    rates = Rates(h2d=unit, d2h=unit, disk_read=unit, disk_write=unit, adam=unit, matmul=unit, memcpy=unit,
                  device=str(dev), source={f: UNPROBED for f in ("h2d", "d2h", "disk_read", "disk_write", "adam",
                                                                  "matmul", "memcpy")})
    placement = evaluate(sizes, train, budgets, rates, k, cfg.nvme_paths)
    pools = claimed_pools(cfg, sizes, model)
    if pools is not None:
        placement.swap_per_dir = pools.swap_per_dir
    violations: list[str] = []
    c = placement.charges
    if dev.type == "cuda" and not budgets.device_is_host and c is not None:
        need = placement.device_bytes - c.prefetch
        if need > budgets.device_memory:
            violations.append(f"device memory: needs {fmt(need)} ({replace(c, prefetch=0).describe()}; the "
                              f"prefetch bucket aside, which the engine shrinks), budget {fmt(budgets.device_memory)}")
    # on the CPU device the device pool is host RAM that the device budget bounds (the device memory
    # check): the host check here is of what the tiers, gradients and staging take beside it
    pool = placement.device_bytes if budgets.device_is_host else 0
    host = placement.host_bytes - pool
    if host > budgets.host_memory:
        p = placement
        staging = host - p.params.ram - p.optimizer.ram - p.grads.ram
        violations.append(f"host RAM: needs {fmt(host)} (parameters {fmt(p.params.ram)}, optimizer states "
                          f"{fmt(p.optimizer.ram)}, gradient buffers {fmt(p.grads.ram)}, staging {fmt(staging)})"
                          + (f" beside the device pool's {fmt(pool)}" if pool else "")
                          + f", budget {fmt(budgets.host_memory)}")
    short = swap_shortfalls(placement.swap_per_dir, budgets) if placement.swap_bytes else []
    for paths, need, free in short:
        parts = [f"{name} {format_size(f.nbytes)} in {d}" for d in paths if pools is not None
                 for name, dirs, f in (("params", pools.param_dirs, pools.param_file),
                                       ("optimizer", pools.optim_dirs, pools.optim_file)) if d in dirs and f.nbytes]
        violations.append(f"swap: the swap files they need {format_size(need)}"
                          + (f" ({', '.join(parts)})" if parts else "")
                          + f", the filesystem of {', '.join(paths)} has {format_size(free)} free: "
                          f"{format_size(need - free)} missing")
    placement.violations = violations
    if violations:
        message = ("the config's placement does not fit this machine (nothing was written): "
                   + "; ".join(violations + _fixed_hints(placement)))
        if short and len(short) == len(violations):
            # the swap space alone: as the swap directories' own claim refuses, ENOSPC naming the
            # first directory short of room (with another budget broken too, a PlanError)
            raise SwapSpaceTooSmall(errno.ENOSPC, message, short[0][0][0])
        raise PlanError(message)
    return placement


def claimed_pools(cfg: Any, sizes: ModelSizes, model: Any) -> Optional[EnginePools]:
    """What the engine checks and claims for the resolved config ``cfg`` and a model of ``sizes``
    (``layout.pools.engine_pools``, one swap slot a module that owns parameters), among them the
    bytes of each swap directory; None when ``model`` is not a module (its modules are not known)."""
    if not isinstance(model, torch.nn.Module):
        return None
    n_modules = sum(1 for m in model.modules() if m._parameters)  # as the engine counts them
    return engine_pools(cfg, sizes, n_modules)


def _fixed_hints(p: Placement) -> list[str]:
    """What to change for each budget a fixed placement exceeds."""
    hints = []
    kinds = {v.split(":", 1)[0] for v in p.violations}
    if "device memory" in kinds:
        hints.append("raise pyinfinity.device_memory, or lower stage3_prefetch_bucket_size or the micro-batch")
    if "host RAM" in kinds:
        on_disk = p.knobs.param_device == "nvme" and p.knobs.optimizer_device == "nvme"
        hints.append("raise pyinfinity.host_memory (the gradient buffers and the staging stay in RAM whatever the "
                     "tiers) or train a smaller model" if on_disk else
                     "put more on NVMe (offload_param/offload_optimizer device \"nvme\") or raise "
                     "pyinfinity.host_memory")
    if "swap" in kinds:
        hints.append("give nvme_path directories on a disk with that room")
    hints.append("`pyinfinity plan --config FILE` shows what fits this machine")
    return hints


def budget_summary(placement: Placement) -> str:
    """One line of what a placement charges each budget (the engine's start, for a fixed placement)."""
    swap = f"; swap {fmt(placement.swap_bytes)} on disk" if placement.swap_bytes else ""
    return (f"plan (the config's placement, checked): parameters on {placement.knobs.param_device}, optimizer "
            f"state on {placement.knobs.optimizer_device}; device peak {fmt(placement.device_bytes)} of "
            f"{fmt(placement.device_memory)}, host RAM {fmt(placement.host_bytes)} of {fmt(placement.host_memory)}"
            f"{swap}")


#: The engine's start line after ``budget_summary`` for a fixed placement: the step is not predicted
#: there (probing this machine's rates would lengthen every start by seconds), and how to get it.
UNPREDICTED_HINT = ("step time not predicted: the config fixes the placement and no rates are probed at start; "
                    "`pyinfinity plan --config FILE --model MODEL_DIR` (or --model-size NAME) probes them and "
                    "predicts this placement's step")


def placement_of(config: Union[dict, Any], model_or_sizes: Any, budgets: Budgets, rates: Rates, *,
                 seq_len: Optional[int] = None, checkpointing: bool = False) -> Placement:
    """The placement and predicted step time of a fully specified config (a hand configuration);
    budget violations are listed, not raised."""
    cfg = load_config(copy.deepcopy(config)) if isinstance(config, dict) else config
    sizes = model_sizes(model_or_sizes, compute_dtype(cfg))
    fixed, owned = _fixed_from(cfg, None)
    if owned - UNPLANNED_ALONE - SIZED_ALONE:
        raise ValueError(f"placement_of: the config leaves {sorted(KEYS[o] for o in owned)} to the planner")
    k = _fixed_knobs(cfg, sizes, budgets.device_memory)
    placement = evaluate(sizes, _train_shape(cfg, seq_len, checkpointing), budgets, rates, k, cfg.nvme_paths)
    pools = claimed_pools(cfg, sizes, model_or_sizes)
    if pools is not None:  # the files the engine claims, and the budgets they break
        placement.swap_per_dir = pools.swap_per_dir
        placement.violations = [v for v in placement.violations if not v.startswith("swap: needs")]
        if placement.swap_bytes and cfg.nvme_paths:
            placement.violations += swap_violations(pools.swap_per_dir, budgets)
    return placement


def _fixed_knobs(cfg: Any, sizes: ModelSizes, device_memory: int) -> Knobs:
    """The knobs of a config whose placement is fixed, as the engine realises it: what it leaves
    unplanned alone is none (nothing resident), the buffers sized to the device budget."""
    fixed, owned = _fixed_from(cfg, None)
    for name in UNPLANNED_ALONE & owned:
        setattr(fixed, name, 0)
    for name, value in budget_sizing(cfg, sizes, device_memory).items():
        setattr(fixed, name, value)
    k = Knobs(**{name: getattr(fixed, name) for name in KEYS}, checkpoint_staging=fixed.checkpoint_staging)
    oo = cfg.zero_optimization.offload_optimizer
    k.pipeline = oo.pipeline_read or oo.pipeline_write
    return k


__all__ = ["resolve_auto", "plan_engine_config", "placement_of", "check_placement", "budget_summary",
           "UNPREDICTED_HINT", "decide_unit_bytes", "plan_config",
           "Decision", "DEFAULT_SEQ_LEN", "compute_dtype", "planned_device", "aio_options", "engine_optimizer_threads",
           "run_dtype", "Probes", "planned_train_shape", "planned_fixed"]
