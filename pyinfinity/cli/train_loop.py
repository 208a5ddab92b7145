"""The training loop both runs of `pyinfinity train` drive (the built-in corpus, ``train.py``; a
model directory and your data, ``finetune.py``): --resume, --steps, --stop-after, --save-every,
--blocking-saves, --save-total-limit, --save, the progress bar. A run gives its data as a
``Batches``; everything a flag does to the loop happens here once, so a flag both runs accept
behaves the same in both."""
from __future__ import annotations

import argparse
import logging
import math
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Protocol

log = logging.getLogger(__name__)

RESUME_FLAGS = ("seed", "lr", "batch", "seq", "grad_accum", "warmup")  # what the data and schedule follow


class Batches(Protocol):
    """A run's data, with its position as a checkpoint's client state records it."""

    def next(self) -> tuple[Any, Any]:
        """The next micro-batch (input_ids, labels)."""

    def state(self) -> dict:
        """The data position, merged into the checkpoint's client state."""

    def restore(self, client: dict, origin: str, global_steps: int) -> None:
        """Goes to the position a checkpoint's client state holds (``origin``: its path, for errors;
        ``global_steps``: its step, for a checkpoint that does not record the position)."""


@dataclass
class SaveRecord:
    """One --save-every checkpoint: how long training stopped for it and what it wrote."""

    step: int
    path: str
    background: bool
    call_s: float  # the save_checkpoint call (background: fixing the point; blocking: the whole save)
    wait_s: float = 0.0  # background: what the next save (or the loop's end) waited for it
    total_s: Optional[float] = None  # from the call to latest moved
    bytes: int = 0  # the checkpoint's files
    copied_by_step: int = 0  # background: shard copies a step took before updating its shard
    copy_s: float = 0.0  # background: what the steps spent taking those copies
    rotate_s: float = 0.0  # removing the checkpoints --save-total-limit let go, after latest moved
    called_at: float = 0.0  # time.perf_counter() at the call
    said_slow: bool = False  # the warning that the disk does not keep up came with this one

    @property
    def blocked_s(self) -> float:
        return self.call_s + self.wait_s + self.copy_s


@dataclass
class LoopResult:
    records: list = field(default_factory=list)  # the StepRecord of each optimizer step of this run
    timed: list = field(default_factory=list)  # (tokens, wall seconds) of each step, from batch to step
    saves: list = field(default_factory=list)  # the SaveRecord of each --save-every checkpoint


def run_flags(args: argparse.Namespace) -> dict:
    """The flags a --resume must repeat, as a checkpoint's client state records them."""
    return {k: getattr(args, k) for k in RESUME_FLAGS}


def check_resume_flags(path: str, client: dict, args: argparse.Namespace) -> None:
    """A --resume with other data or schedule flags than the saved run would train on silently
    different batches and learning rates: refused, naming each flag."""
    from pyinfinity.cli.errors import UsageError

    saved = client.get("flags")
    if not isinstance(saved, dict):
        log.warning("--resume: %s does not record the run's flags; give the same --seed/--lr/--batch/--seq/"
                    "--grad-accum/--warmup as the first run", path)
        return
    now = run_flags(args)
    diff = [f"--{k.replace('_', '-')} {now[k]} (the checkpoint's run: {saved.get(k)})"
            for k in RESUME_FLAGS if saved.get(k) != now[k]]
    if diff:
        raise UsageError(f"--resume: {path} was saved by a run with other flags: {'; '.join(diff)}; resume with "
                         "the same flags (a new run: leave out --resume)")


def save(engine: Any, args: argparse.Namespace, data: Batches, *, blocking: bool = True,
         saves: Optional[list] = None) -> str:
    """A checkpoint in --save with the data position and the run's flags; --save-total-limit's
    oldest removed once it is durable. ``blocking=False``: written in the background (the engine
    waits for it at the next save and at close). ``saves``: the SaveRecords to append to (the
    previous background one completed first)."""
    if saves is not None:
        finish_saves(engine, saves)
    t0 = time.perf_counter()
    path = engine.save_checkpoint(args.save, client_state={**data.state(), "flags": run_flags(args)},
                                  keep_last=args.save_total_limit, blocking=blocking)
    call = time.perf_counter() - t0
    if not blocking:
        log.info("checkpoint %s: writing in the background (training stopped %.3f s for it)", path, call)
    if saves is not None:
        saves.append(SaveRecord(engine.global_steps, path, not blocking, call, total_s=None if not blocking else call,
                                bytes=0 if not blocking else _dir_bytes(path), called_at=t0))
    return path


# a background save the next one waited longer for than this (and this share of the steps between
# them) is reported once: the disk does not keep up with --save-every
SLOW_SAVE_WAIT_S = 0.5
SLOW_SAVE_SHARE = 0.05


def finish_saves(engine: Any, saves: list) -> None:
    """Waits for the last background save of ``saves`` and completes its record. The first time
    the wait is long (the disk slower than --save-every's steps), says so once with the
    --save-every that would hide the writes."""
    if not saves or not saves[-1].background or saves[-1].total_s is not None:
        return
    t0 = time.perf_counter()
    write = engine.wait_for_checkpoint()
    rec = saves[-1]
    rec.wait_s = time.perf_counter() - t0
    if write is not None:
        rec.total_s, rec.copied_by_step = write.seconds, write.copied_by_step
        rec.copy_s = write.step_s
        rec.rotate_s = write.rotate_s
    rec.bytes = _dir_bytes(rec.path)
    between = t0 - rec.called_at  # the steps since the call, which the write ran beside
    steps = engine.global_steps - rec.step
    if (write is not None and write.seconds and steps > 0 and between > 0 and not any(r.said_slow for r in saves)
            and rec.wait_s > max(SLOW_SAVE_WAIT_S, SLOW_SAVE_SHARE * between)):
        rec.said_slow = True
        every = max(steps + 1, math.ceil(steps * (write.seconds + write.rotate_s) / between * 1.1))
        log.warning("checkpoint %s: training waited %.1f s for it: a save writes %.2f GB in %.1f s (%.2f GB/s)%s, "
                    "the %d steps between saves took %.1f s; --save-every %d (or --save on a faster disk) keeps "
                    "the writes behind training", rec.path, rec.wait_s, write.data_bytes / 1e9, write.seconds,
                    write.data_bytes / write.seconds / 1e9,
                    f" and removing the oldest took {write.rotate_s:.1f} s" if write.rotate_s >= 0.05 else "",
                    steps, between, every)


def _dir_bytes(path: str) -> int:
    import os

    try:
        return sum(os.path.getsize(os.path.join(path, n)) for n in os.listdir(path))
    except OSError:  # rotated away meanwhile
        return 0


def resume(engine: Any, args: argparse.Namespace, data: Batches, resume_dir: str, resume_tag: Optional[str]) -> None:
    """Loads --resume's checkpoint: the engine's state, then the run's flags checked, then the data
    position."""
    path, client = engine.load_checkpoint(resume_dir, resume_tag, convert_optimizer_state=args.resume_convert)
    check_resume_flags(path, client, args)
    data.restore(client, path, engine.global_steps)
    log.info("resumed %s at step %d of %d", path, engine.global_steps, args.steps)
    if engine.global_steps >= args.steps:
        log.warning("--resume: the checkpoint is at step %d, --steps is %d: nothing to train",
                    engine.global_steps, args.steps)


def train(engine: Any, args: argparse.Namespace, data: Batches,
          after_step: Optional[Callable[[Any], None]] = None) -> LoopResult:
    """Steps until --steps (or --stop-after steps of this run), saving every --save-every steps;
    ``after_step(record)`` runs after each optimizer step (before its periodic save)."""
    from tqdm import tqdm

    from pyinfinity.config import format_size
    from pyinfinity.engine import retry_micro_batch

    out = LoopResult()
    # disable=None: no bar when stderr is not a terminal (a log file gets the log lines only)
    bar = tqdm(total=args.steps, initial=engine.global_steps, unit="step",
               disable=True if args.no_progress else None, file=sys.stderr, dynamic_ncols=True)
    t_step, tokens = time.perf_counter(), 0
    try:
        while engine.global_steps < args.steps and (args.stop_after is None or len(out.records) < args.stop_after):
            x, y = data.next()
            x, y = x.to(engine.device), y.to(engine.device)
            tokens += x.numel()
            retry_micro_batch(lambda: engine.backward(engine(input_ids=x, labels=y).loss))
            rec = engine.step()
            if rec is None:
                continue
            out.timed.append((tokens, time.perf_counter() - t_step))
            out.records.append(rec)
            bar.update(1)
            bar.set_postfix(loss=f"{rec.loss:.3f}", tok_s=f"{rec.tokens_per_s:.0f}",
                            peak=format_size(rec.peak_device_allocated or rec.peak_device_bytes),
                            overlap="n/a" if rec.overlap_fraction is None else f"{rec.overlap_fraction:.2f}")
            if after_step is not None:
                after_step(rec)
            if args.save_every and engine.global_steps % args.save_every == 0 and engine.global_steps < args.steps:
                save(engine, args, data, blocking=args.blocking_saves, saves=out.saves)
            t_step, tokens = time.perf_counter(), 0
        finish_saves(engine, out.saves)
    finally:
        bar.close()
    return out
