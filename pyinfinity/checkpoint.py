"""Checkpoints of an offloaded engine: the full training state (NVMe-resident tensors included)
written to ``save_dir/tag`` under a temporary name, fsynced, then renamed; read back and checked."""

from __future__ import annotations

import collections
import json
import logging
import os
import shutil
from typing import TYPE_CHECKING, Optional

import torch

from pyinfinity.config import format_size
from pyinfinity.swap.ownership import clean_checkpoint_leftovers
from pyinfinity.swap.tensor_swapper import aligned_empty

if TYPE_CHECKING:
    from pyinfinity.engine import Engine

log = logging.getLogger(__name__)

CHECKPOINT_VERSION = 1
ALIGN = 4096
CHECKPOINT_INFLIGHT = 1 << 30  # bytes of checkpoint copies in flight to the disk at most


def save(engine: "Engine", save_dir: str, tag: Optional[str] = None,
         client_state: Optional[dict] = None) -> str:
    """Writes the full training state (NVMe-resident tensors included) to ``save_dir/tag``:
    written under a temporary name, fsynced, then renamed; ``save_dir/latest`` names it."""
    engine._check_trainable("save_checkpoint()")
    engine._check_no_overlap("save_checkpoint()")
    if engine.micro_steps % engine.gradient_accumulation_steps:
        log.warning("save_checkpoint inside a gradient-accumulation window: the partial "
                    "gradients are not saved")
    engine.coordinator.release_all()
    tag = tag or f"global_step{engine.global_steps}"
    os.makedirs(save_dir, exist_ok=True)
    clean_checkpoint_leftovers(save_dir)  # of a save a crash cut short
    final = os.path.join(save_dir, tag)
    tmp = os.path.join(save_dir, f".{tag}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    data_path = os.path.join(tmp, "state.bin")
    io = engine._io()
    entries, offset = [], 0
    pending: collections.deque = collections.deque()  # (request, buffer), oldest first

    def submit(buf: torch.Tensor, at: int) -> None:
        # bounded: at most CHECKPOINT_INFLIGHT bytes of copies wait for the disk at once
        pending.append((io.write(buf, data_path, at), buf))
        while sum(b.numel() * b.element_size() for _, b in pending) > CHECKPOINT_INFLIGHT:
            pending.popleft()[0].wait()

    for st, flat in engine.optimizer.iter_states(write_back=False):
        n = flat.numel() * 4
        buf = aligned_empty(flat.numel(), torch.float32)
        buf.copy_(flat)
        submit(buf, offset)
        entries.append({"shard": st.shard.index, "kind": "optim", "numel": st.numel, "step": st.step,
                        "offset": offset, "nbytes": n, "crc32c": _crc32c(buf)})
        offset += -(-n // ALIGN) * ALIGN
    for sh in engine.partition.shards:
        if engine.optimizer.state_of(sh) is None:  # frozen: its values are the state
            buf = engine._shard_param_values(sh)
            n = buf.numel() * buf.element_size()
            submit(buf, offset)
            entries.append({"shard": sh.index, "kind": "param", "numel": sh.numel, "dtype": str(sh.dtype),
                            "offset": offset, "nbytes": n, "crc32c": _crc32c(buf)})
            offset += -(-n // ALIGN) * ALIGN
    for req, _ in pending:
        req.wait()
    meta = {
        "version": CHECKPOINT_VERSION, "global_steps": engine.global_steps, "micro_steps": engine.micro_steps,
        "shards": [{"index": s.index, "module": s.module_name, "numel": s.numel, "dtype": str(s.dtype)}
                   for s in engine.partition.shards],
        "entries": entries, "data_bytes": offset,
        "scaler": engine.scaler.state_dict(),
        "scheduler": engine.lr_scheduler.state_dict() if engine.lr_scheduler is not None else None,
        "lr": [g["lr"] for g in engine.optimizer.param_groups],
        "client_state": client_state or {},
    }
    if os.path.exists(data_path):
        _fsync_path(data_path)
    with open(os.path.join(tmp, "meta.json"), "w") as f:
        json.dump(meta, f)
        f.flush()
        os.fsync(f.fileno())
    torch.save({"cpu": torch.get_rng_state(),
                "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None},
               os.path.join(tmp, "rng.pt"))
    _fsync_path(os.path.join(tmp, "rng.pt"))
    _fsync_path(tmp)
    if os.path.exists(final):
        old = final + f".old-{os.getpid()}"
        os.rename(final, old)
        os.rename(tmp, final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.rename(tmp, final)
    latest_tmp = os.path.join(save_dir, f".latest.tmp-{os.getpid()}")
    with open(latest_tmp, "w") as f:
        f.write(tag)
        f.flush()
        os.fsync(f.fileno())
    os.rename(latest_tmp, os.path.join(save_dir, "latest"))
    _fsync_path(save_dir)
    log.info("checkpoint saved: %s (%s)", final, format_size(offset))
    return final


def load(engine: "Engine", load_dir: str, tag: Optional[str] = None) -> tuple[str, dict]:
    """Restores a state written by ``save_checkpoint``; returns (path, client_state)."""
    engine._check_open()
    clean_checkpoint_leftovers(load_dir)  # puts back a tag a crash left renamed away
    if tag is None:
        try:
            with open(os.path.join(load_dir, "latest")) as f:
                tag = f.read().strip()
        except OSError as exc:
            raise FileNotFoundError(f"load_dir: no 'latest' file in {load_dir!r}; pass tag=") from exc
    path = os.path.join(load_dir, tag)
    try:
        with open(os.path.join(path, "meta.json")) as f:
            meta = json.load(f)
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"checkpoint {path!r}: meta.json missing or torn ({exc})") from exc
    if meta.get("version") != CHECKPOINT_VERSION:
        raise ValueError(f"checkpoint {path!r}: version {meta.get('version')} (expected {CHECKPOINT_VERSION})")
    mine = [(s.index, s.numel, str(s.dtype)) for s in engine.partition.shards]
    theirs = [(s["index"], s["numel"], s["dtype"]) for s in meta["shards"]]
    if mine != theirs:
        raise ValueError(f"checkpoint {path!r}: was saved from a different model/partition "
                         f"({len(theirs)} shards vs {len(mine)} here)")
    data_path = os.path.join(path, "state.bin")
    have = os.path.getsize(data_path) if os.path.exists(data_path) else 0
    need = max((e["offset"] + e["nbytes"] for e in meta["entries"]), default=0)
    if have < need:
        raise ValueError(f"checkpoint {path!r}: state.bin has {have} bytes, {need} expected (torn)")
    try:  # read before anything is changed, so a torn file leaves the engine as it was
        rng = torch.load(os.path.join(path, "rng.pt"), weights_only=False)
    except Exception as exc:  # noqa: BLE001 - any unpickling error means a torn file
        raise ValueError(f"checkpoint {path!r}: rng.pt missing or torn ({exc})") from exc
    if engine.optimizer.overlap_open:  # the loaded state replaces whatever the window stepped
        engine._abandon_overlap("load_checkpoint() during an overlapped step")
    engine.coordinator.release_all()
    io = engine._io()
    shards = engine.partition.shards
    for e in meta["entries"]:
        sh = shards[e["shard"]]
        if e["kind"] == "optim":
            buf = aligned_empty(3 * sh.numel, torch.float32)
            io.read(buf, data_path, e["offset"]).wait()
            _check_entry(path, e, buf)
            engine.optimizer.load_shard_state(sh, buf, e["step"])
            engine._write_param(sh, buf[:sh.numel]).wait()
        else:
            buf = aligned_empty(sh.numel, sh.dtype)
            io.read(buf, data_path, e["offset"]).wait()
            _check_entry(path, e, buf)
            engine.param_swapper.write(sh.home, buf).wait()
    engine.global_steps, engine.micro_steps = meta["global_steps"], meta["micro_steps"]
    engine.scaler.load_state_dict(meta["scaler"])
    for g, lr in zip(engine.optimizer.param_groups, meta["lr"]):
        g["lr"] = lr
    if engine.lr_scheduler is not None and meta["scheduler"] is not None:
        engine.lr_scheduler.load_state_dict(meta["scheduler"])
    torch.set_rng_state(rng["cpu"])
    if rng["cuda"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(rng["cuda"])
    engine.optimizer.zero_grad()
    engine.coordinator.refresh_persistent()
    engine._poisoned = None  # every shard's state and values are the checkpoint's now
    log.info("checkpoint loaded: %s (step %d)", path, engine.global_steps)
    return path, meta["client_state"]


def _crc32c(t: torch.Tensor) -> int:
    from pyinfinity import _C

    return int(_C.crc32c(t.reshape(-1).view(torch.uint8).numpy()))


def _check_entry(path: str, entry: dict, buf: torch.Tensor) -> None:
    """A checkpoint entry read back must have the CRC-32C it was saved with (older ones have none)."""
    want = entry.get("crc32c")
    if want is not None and _crc32c(buf) != want:
        raise ValueError(f"checkpoint {path!r}: state.bin bytes [{entry['offset']}, {entry['offset'] + entry['nbytes']})"
                         f" (shard {entry['shard']}, {entry['kind']}) fail their checksum (torn or changed on disk); "
                         "the engine's state is now partly loaded: load another checkpoint before training")


def _fsync_path(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
