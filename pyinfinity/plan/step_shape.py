"""The step's shape from the tokens it should hold: micro-batch x gradient accumulation, and
activation checkpointing, chosen to fill the device (:func:`choose_step_shape`).

A user who gives only the tokens a step (``--tokens-per-step``) gets, among the micro-batches
that fit beside a placement the planner can make (``solve``: the activations of one micro-batch
charged with the rest of the step, every unit resident when they all fit beside them), the one
with the fewest predicted seconds a token; accumulation is ``ceil(tokens / (micro-batch x
sequence))``, so a count that does not divide is rounded up and the shape says so. What the user
fixes (the micro-batch, the accumulation, checkpointing) the choice keeps; a micro-batch and an
accumulation given with the tokens must multiply out to them (:func:`step_shape_refusal`)."""
from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any, Optional, Sequence

from pyinfinity.layout.charges import PlanError, TrainShape
from pyinfinity.layout.sizes import ModelSizes
from pyinfinity.plan.budgets import Budgets
from pyinfinity.plan.evaluation import Placement
from pyinfinity.plan.placement import TIE, Fixed, solve
from pyinfinity.plan.rates import Rates


@dataclass
class StepShape:
    """A chosen step: ``micro_batch`` sequences of ``seq_len`` tokens, ``grad_accum`` of them a
    step, with or without checkpointing, and the placement planned for it."""

    micro_batch: int
    grad_accum: int
    checkpointing: bool
    seq_len: int
    tokens_asked: int
    placement: Optional[Placement] = None

    @property
    def tokens(self) -> int:
        """Tokens a step as trained (at least ``tokens_asked``)."""
        return self.micro_batch * self.grad_accum * self.seq_len

    def describe(self) -> str:
        """One line: the shape, and the tokens asked for when they differ."""
        line = (f"micro-batch {self.micro_batch} x {self.seq_len} tokens x {self.grad_accum} accumulation = "
                f"{self.tokens:,} tokens a step{', checkpointing' if self.checkpointing else ''}")
        if self.tokens != self.tokens_asked:
            line += (f" ({self.tokens_asked:,} asked: not a multiple of micro-batch x sequence, "
                     f"{self.tokens - self.tokens_asked:,} more)")
        return line


def step_shape_refusal(tokens: int, seq_len: int, micro_batch: Optional[int] = None,
                       grad_accum: Optional[int] = None, flags: tuple[str, str, str, str] = (
                           "--tokens-per-step", "--seq", "--batch", "--grad-accum")) -> Optional[str]:
    """Why ``tokens`` a step cannot be trained at the given sequence length, micro-batch and
    accumulation (one line naming ``flags``: tokens, sequence, micro-batch, accumulation), or None."""
    f_tok, f_seq, f_mb, f_acc = flags
    if tokens < seq_len:
        return f"{f_tok} {tokens}: fewer than one sequence of {f_seq} {seq_len} tokens"
    if micro_batch is not None and grad_accum is not None and micro_batch * grad_accum * seq_len != tokens:
        return (f"{f_tok} {tokens} disagrees with {f_mb} {micro_batch} x {f_acc} {grad_accum} x {f_seq} {seq_len} = "
                f"{micro_batch * grad_accum * seq_len} tokens a step: give {f_tok} with at most one of {f_mb} and "
                f"{f_acc} (the planner chooses the other)")
    if micro_batch is not None and micro_batch * seq_len > tokens:
        return (f"{f_tok} {tokens}: less than one micro-batch of {f_mb} {micro_batch} x {f_seq} {seq_len} = "
                f"{micro_batch * seq_len} tokens")
    return None


def micro_batch_candidates(sequences: int) -> list[int]:
    """Micro-batches tried for ``sequences`` sequences a step, largest first: the powers of two
    below it, the divisors of it among the first 64, and itself (one micro-batch a step)."""
    out = {sequences}
    out |= {1 << i for i in range(sequences.bit_length()) if 1 << i <= sequences}
    out |= {d for d in range(1, min(sequences, 64) + 1) if sequences % d == 0}
    return sorted(out, reverse=True)


def choose_step_shape(sizes: ModelSizes, train: TrainShape, budgets: Budgets, rates: Rates, tokens: int,
                      fixed: Optional[Fixed] = None, nvme_paths: Sequence[str] = (), *,
                      micro_batch: Optional[int] = None, grad_accum: Optional[int] = None,
                      checkpointing: Optional[bool] = None) -> StepShape:
    """The shape of a step of ``tokens`` tokens at ``train.seq_len`` (see the module doc): every
    micro-batch and checkpointing setting the caller leaves open is planned (``solve``), and the
    feasible one with the fewest predicted seconds a token wins, the larger micro-batch among ties
    (within ``placement.TIE``). PlanError when none fits, with the smallest's reason."""
    seq = train.seq_len
    why = step_shape_refusal(tokens, seq, micro_batch, grad_accum)
    if why:
        raise ValueError(why)
    sequences = math.ceil(tokens / seq)
    if micro_batch is not None:
        mbs = [micro_batch]
    elif grad_accum is not None:
        mbs = [math.ceil(sequences / grad_accum)]
    else:
        mbs = micro_batch_candidates(sequences)
    cks = [checkpointing] if checkpointing is not None else [False, True]
    best: Optional[tuple[float, StepShape]] = None
    last_error: Optional[PlanError] = None
    for mb in mbs:
        acc = grad_accum if grad_accum is not None else math.ceil(sequences / mb)
        for ck in cks:
            t = replace(train, micro_batch=mb, grad_accum=acc, checkpointing=ck, compute_seconds=None)
            try:
                p = solve(sizes, t, budgets, rates, fixed, nvme_paths)
            except PlanError as exc:
                last_error = exc
                continue
            shape = StepShape(mb, acc, ck, seq, tokens, p)
            per_token = p.predicted.total / shape.tokens
            if best is None or per_token < best[0] * (1 - TIE):
                best = (per_token, shape)
    if best is None:
        raise PlanError(f"no micro-batch of {seq}-token sequences fits for {tokens:,} tokens a step "
                        f"(tried {', '.join(map(str, mbs[-4:]))}, checkpointing "
                        f"{'/'.join('on' if c else 'off' for c in cks)}): {last_error}")
    return best[1]


def plan_step_shape(config: dict, model: Any, device: Any, tokens: int, seq_len: int, *, probes: Any,
                    micro_batch: Optional[int] = None, grad_accum: Optional[int] = None,
                    checkpointing: Optional[bool] = None) -> StepShape:
    """:func:`choose_step_shape` for an engine config (DeepSpeed format) and a model (a module, a
    transformers config or its dict) on ``device``, with this machine's budgets and the rates
    ``probes`` measures (``plan.resolve.Probes``; ``pyinfinity.probes.MachineProbes()`` measures as
    ``pyinfinity.initialize`` does and caches them for the engine that follows).
    Put the result's ``micro_batch`` and ``grad_accum`` into the config
    (``train_micro_batch_size_per_gpu``, ``gradient_accumulation_steps``), draw the data at that
    micro-batch and enable checkpointing when ``checkpointing`` says so."""
    import torch

    from pyinfinity.config import load_config
    from pyinfinity.plan.budgets import measure_budgets
    from pyinfinity.plan.resolve import compute_dtype, planned_fixed, planned_train_shape, run_dtype
    from pyinfinity.plan.sizes import model_sizes

    cfg = load_config(dict(config))
    dev = torch.device(device)
    ub = cfg.pyinfinity.unit_bytes
    sizes = model_sizes(model, compute_dtype(cfg) or run_dtype(cfg, model),
                        unit_bytes=ub if isinstance(ub, int) else None)
    dm, hm = cfg.pyinfinity.device_memory, cfg.pyinfinity.host_memory
    budgets = measure_budgets(dev, cfg.nvme_paths, device_memory=dm if isinstance(dm, int) else None,
                              host_memory=hm if isinstance(hm, int) else None)
    # probed as a run that accumulates (the shapes tried may): the gradient add is timed too
    probe_cfg = load_config({**dict(config), "gradient_accumulation_steps": 2})
    rates = probes.rates(probe_cfg, dev, sizes, run_dtype(cfg, model), 1024)
    train = planned_train_shape(cfg, seq_len, bool(checkpointing))
    if dev.type != "cuda":
        train.activation_bytes = 0  # the CPU device: activations live in host RAM, not its pool
    return choose_step_shape(sizes, train, budgets, rates, tokens, planned_fixed(cfg), list(cfg.nvme_paths),
                             micro_batch=micro_batch, grad_accum=grad_accum, checkpointing=checkpointing)


__all__ = ["StepShape", "choose_step_shape", "plan_step_shape", "step_shape_refusal", "micro_batch_candidates"]
