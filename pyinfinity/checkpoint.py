"""Checkpoints of an offloaded engine: the full training state (NVMe-resident tensors included)
written to ``save_dir/tag`` under a temporary name, fsynced, then renamed; read back and checked.

A checkpoint directory holds ``state.bin`` (the tensors; a CRC-32C per entry), ``meta.json`` (what
is where, counters, scaler, scheduler, learning rates, client state), ``rng.pt`` (RNG states) and,
written last, ``checksums.json`` (size and CRC-32C of ``meta.json`` and ``rng.pt``). A load checks
the checksums, then every metadata key and value against this engine, then the RNG states, before
it changes anything; an error names the checkpoint, the file and the key. Only a ``state.bin``
entry failing its checksum (or an I/O error) can stop a load part-way: the engine then refuses to
train, save or export until a load succeeds.

A run whose frozen shards all hold pretrained weights unchanged (a LoRA run's base model) saves
only the trainable shards' state and records the weights' identity under ``base``: config.json,
each safetensors file's name and size, and the CRC-32C of every byte of every tensor the run read
(``WeightLoader.identity``: taken while the engine streamed the weights in, so a load compares
without reading the base again). A load checks that identity against the weights its engine was
built from and refuses another base in one line naming the tensor that differs. A version-3
checkpoint recorded only a CRC-32 of each file's first MiB: it loads with that check and a warning.

``save`` and ``load`` work on the engine's training state (``zero.state.TrainingState``, what
``Engine.save_checkpoint`` and ``load_checkpoint`` hand over) through its public methods.

NVMe-resident optimizer state is saved by reference (version 5, ``by_reference``): the checkpoint
holds a hard link to each swap file (``optimizer.<part>.<token>.swp``) and records, per shard, the
slot's extents and the CRC-32Cs the swap layer computed when it wrote them; the slot is frozen
(``SwapSpace.freeze``): the next step writes that shard into a fresh slot, and the frozen one is
freed once no checkpoint refers to it (noticed at the next save: rotated or removed). Nothing is
read or copied at the save, but one checkpoint beside the live state needs the NVMe state's size
again on the swap filesystem (Adam rewrites every shard each step). A swap file on another
filesystem than the checkpoint is copied as before.

One module for the format (about 640 lines): the writer, the reader and the check of every
metadata key against the engine follow one format's rules, kept in one place."""

from __future__ import annotations

import collections
import copy
import errno
import io as _io
import itertools
import json
import math
import logging
import os
import shutil
import threading
import time
from typing import TYPE_CHECKING, Any, Optional

import torch

from pyinfinity.config import STATE_FORMATS, format_size, placement_values
from pyinfinity.host_memory import HOST_SPARE, mem_available
from pyinfinity.layout.pools import save_staging_bytes
from pyinfinity.resume import apply_hyperparameters, hyperparameters
from pyinfinity.swap.manifest import fsync_path, write_fsynced
from pyinfinity.swap.ownership import clean_checkpoint_leftovers
from pyinfinity.swap.tensor_swapper import aligned_empty
from pyinfinity.zero.optim.formats import OptimStateFormat, convert_home, make_state_format

if TYPE_CHECKING:
    from pyinfinity.zero.state import TrainingState

log = logging.getLogger(__name__)


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded into this engine: the message names the checkpoint, the
    file (and the key) and what is wrong."""

CHECKPOINT_VERSION = 5  # 5: NVMe state by reference; 4: "base" with every tensor's CRC-32C; 3: "base"; 2: checksums.json
COPY_VERSION = 4  # what a checkpoint without by-reference entries is written as (every version loads)
CHECKSUMS_NAME = "checksums.json"
CHECKSUMS_FORMAT = "pyinfinity-checkpoint-checksums"
ALIGN = 4096
WAIT_SLICE_S = 0.1  # a wait for a background save wakes this often (Ctrl-C arrives within one)


def save(state: "TrainingState", save_dir: str, tag: Optional[str] = None,
         client_state: Optional[dict] = None, *, base: Optional[dict] = None, keep_last: Optional[int] = None,
         blocking: bool = True, staging: int = 0, by_reference: bool = True) -> "CheckpointWrite":
    """Writes the full training state (NVMe-resident tensors included) to ``save_dir/tag``:
    written under a temporary name, fsynced, then renamed; ``save_dir/latest`` names it.
    ``base``: the identity of the pretrained weights the frozen shards hold unchanged (a LoRA
    run's base model, ``WeightLoader.identity``): recorded instead of the frozen shards' values.
    ``keep_last``: once this checkpoint is durable, only the newest ``keep_last`` checkpoints of
    ``save_dir`` stay (``rotate``); None keeps every one. ``blocking=False``: returns once the
    point of the state it saves is fixed, the bytes written by a thread of its own while training
    goes on (``CheckpointWrite``); the caller waits for it before the next save, a load, an export
    or close. ``staging``: bytes of shard copies taken and not yet written at most
    (``pyinfinity.checkpoint_staging``; a larger copy goes alone, 0 = one at a time).
    ``by_reference``: NVMe-resident optimizer state by reference (the module doc; False: copied,
    a version-4 checkpoint). A save that would not fit the free disk raises OSError(ENOSPC) in one
    line before anything is written. Returns the write (done, when blocking)."""
    check_keep_last(keep_last)
    state.check_not_in_pass("save_checkpoint()")
    state.check_trainable("save_checkpoint()")
    state.quiesce("save_checkpoint()")
    if state.micro_steps % state.gradient_accumulation_steps:
        log.warning("save_checkpoint inside a gradient-accumulation window: the partial "
                    "gradients are not saved")
    state.coordinator.release_all()
    tag = tag or f"global_step{state.global_steps}"
    os.makedirs(save_dir, exist_ok=True)
    clean_checkpoint_leftovers(save_dir)  # of a save a crash cut short
    final = os.path.join(save_dir, tag)
    tmp = os.path.join(save_dir, f".{tag}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    try:
        write = CheckpointWrite(state, save_dir, tag, tmp, client_state, base, keep_last, staging, by_reference,
                                background=not blocking)
    except BaseException:  # a client state that is not JSON, Ctrl-C: nothing of this save stays behind
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if blocking:
        write.run()
        exc, write.failure = write.failure, None
        if exc is not None:  # as it came (ENOSPC naming the file, Ctrl-C): nothing of this save stayed behind
            raise exc
    else:
        write.start()
    return write


class CheckpointWrite:
    """One save's writing: the point of the state it saves is fixed when it is made (counters,
    scaler, scheduler, RNG, client state, the layout of ``state.bin``; the state of every shard
    kept on the device copied), then ``run`` copies each shard's state into a bounded staging
    budget (``staging`` bytes not yet written, or one larger shard alone) and writes it,
    fsyncs, renames the checkpoint into place, moves ``latest`` and rotates.

    In the background (``start``) training goes on meanwhile: copy-before-update per shard. Until
    its copy is taken, a shard's optimizer step (any thread) takes the copy first, from the state it
    is about to step (``OffloadOptimizer.set_before_update``), waiting for staging room if the
    budget is full; the writer takes the other copies in order. Frozen shards' values do not change
    while training. A failure is kept (``failure``) and raised by ``raise_failure``; the temporary
    directory then goes, and ``latest`` is not moved.

    The staging budget is ``pyinfinity.checkpoint_staging`` (what the layout charges); a background
    save stages more, up to the whole checkpoint, where the host has it free now (MemAvailable less
    HOST_SPARE): a shard is updated every step, so with a disk slower than the step everything not
    written within one step must be staged, or the step waits for the disk. A blocking save takes
    two copies' room where free (the next copy taken while one is written). The copies go into one
    page-aligned buffer (``StagingRing``: each at the next free place, given back oldest first as
    its write finishes), the engine's own between background saves
    (``TrainingState.take_checkpoint_staging``): no allocation, page fault or unmap per shard. A
    copy is one pass on the optimizer's thread count (``_copy_crc``: the core's own threads, no
    GIL), each 1 MiB piece checksummed right after it is copied, while it is in cache; a state on
    disk (copied, not by reference) and a frozen shard's values are read straight into their
    place in the buffer. The writer takes the copies in the order the next step updates the
    shards, and lets go of the lock while it waits for the disk."""

    def __init__(self, state: "TrainingState", save_dir: str, tag: str, tmp: str, client_state: Optional[dict],
                 base: Optional[dict], keep_last: Optional[int], staging: int = 0, by_reference: bool = True,
                 background: bool = False) -> None:
        if isinstance(staging, bool) or not isinstance(staging, int) or staging < 0:
            raise ValueError(f"staging: expected bytes >= 0 (pyinfinity.checkpoint_staging), got {staging!r}")
        self.state = state
        self.staging = staging
        self.staged_peak = 0  # most bytes of copies held at once (never above max(staging, one copy))
        self._frozen_slots: list = []  # NVMe slots saved by reference
        self.save_dir, self.tag, self.tmp = save_dir, tag, tmp
        self.path = os.path.join(save_dir, tag)
        self.keep_last = keep_last
        self.failure: Optional[BaseException] = None
        self.blocked_s = 0.0  # time training spent in this save (fixing the point, a step's copies and waits)
        self.copied_by_step = 0  # shard copies a step took before updating the shard
        self.step_s = 0.0  # of blocked_s: what the steps spent taking (or waiting for) their shards' copies
        self._threads = max(1, int(state.optimizer.threads or torch.get_num_threads()))  # of each copy
        self.seconds: Optional[float] = None  # from this save's start to latest moved (once complete)
        self.rotate_s = 0.0  # then removing the checkpoints keep_last lets go (the next save waits for it too)
        self._t0 = time.perf_counter()
        self._data_path = os.path.join(tmp, "state.bin")
        self._io = state.checkpoint_io()
        self._lock = threading.Lock()  # one copy taken at a time; the in-flight queue
        self._stats_lock = threading.Lock()  # blocked_s, added to by the steps' threads and join
        self._inflight: collections.deque = collections.deque()  # (request, bytes), oldest first, as the ring's spans
        self._ring: Optional[StagingRing] = None  # made once the entries are known (its capacity)
        self._keep_staging = staging > 0  # charged in the layout's host RAM: the engine keeps it for the next save
        self._thread: Optional[threading.Thread] = None
        self._finished = threading.Event()  # run() is over (Thread.join, interrupted, may call a live thread done)
        opt, fmt = state.optimizer, state.optimizer.format
        self.entries: list[dict] = []
        self._optim: list[tuple[dict, Any]] = []  # (entry, ShardOptimState), copied
        self._params: list[tuple[dict, Any]] = []  # (entry, FlatShard)
        space = _linkable_space(opt.swapper, save_dir) if by_reference else None
        self.ref: Optional[SwapRef] = SwapRef(save_dir, tag, tmp, space) if space is not None else None
        self.by_reference_bytes = 0  # NVMe state held by reference (not written)
        if space is not None:  # slots only checkpoints removed since (rotated, rmtree'd) held are free again
            space.release_refs(SwapRef.alive)
        offset = 0
        for st in opt.states:
            n = fmt.nbytes(st.numel)
            crcs = space.checksums_of(st.home.slot) if space is not None and st.home.slot is not None else None
            if crcs is not None and st.home.nbytes == n:
                slot = st.home.slot
                self.entries.append({"shard": st.shard.index, "kind": "optim", "numel": st.numel, "step": st.step,
                                     "nbytes": n, "ref": {"files": self.ref.names, "crc32c": crcs,
                                                          "extents": [[x.file, x.offset, x.nbytes]
                                                                      for x in slot.extents]}})
                self._frozen_slots.append(slot)
                self.by_reference_bytes += n
                continue
            e = {"shard": st.shard.index, "kind": "optim", "numel": st.numel, "step": st.step, "offset": offset,
                 "nbytes": n, "crc32c": None}
            self.entries.append(e)
            self._optim.append((e, st))
            offset += -(-n // ALIGN) * ALIGN
        for sh in state.partition.shards:
            if opt.state_of(sh) is None and base is None:  # frozen: its values are the state
                n = sh.numel * sh.dtype.itemsize
                e = {"shard": sh.index, "kind": "param", "numel": sh.numel, "dtype": str(sh.dtype), "offset": offset,
                     "nbytes": n, "crc32c": None}
                self.entries.append(e)
                self._params.append((e, sh))
                offset += -(-n // ALIGN) * ALIGN
        self.data_bytes = offset
        self.version = CHECKPOINT_VERSION if self._frozen_slots else COPY_VERSION
        _check_room(save_dir, self.data_bytes, space, self._frozen_slots)
        meta = {
            "version": self.version, "global_steps": state.global_steps, "micro_steps": state.micro_steps,
            "shards": [{"index": s.index, "module": s.module_name, "numel": s.numel, "dtype": str(s.dtype)}
                       for s in state.partition.shards],
            "entries": self.entries, "data_bytes": offset,
            "scaler": state.scaler.state_dict(),
            "scheduler": state.lr_scheduler.state_dict() if state.lr_scheduler is not None else None,
            "lr": [g["lr"] for g in opt.param_groups],
            "hyperparameters": hyperparameters(state), "optimizer_state": fmt.name,
            "placement": placement_values(state.config),
            "client_state": client_state or {},
        }
        if base is not None:  # the frozen shards are the pretrained weights': a load reads them from there
            meta["base"] = base
        try:
            json.dumps(meta)  # the client state is checked now, not when the bytes are written
        except (TypeError, ValueError) as exc:
            raise TypeError(f"client_state: must be JSON-serialisable ({exc})") from exc
        self._meta = copy.deepcopy(meta)  # fixed now: a later change of the caller's dicts is not saved
        self._meta["entries"] = self.entries
        rng = _io.BytesIO()
        torch.save({"cpu": torch.get_rng_state(),
                    "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None}, rng)
        self._rng = rng.getvalue()
        if self._frozen_slots:  # the point is fixed: these slots are never written again while referred to
            self.ref.link()
            for slot in self._frozen_slots:
                space.freeze(slot, self.ref)
            opt.swapper.note_links([os.path.join(self.path, n) for n in self.ref.names])
        largest = max((e["nbytes"] for e in self.entries if "ref" not in e), default=0)
        if largest:  # the budget, what the host has free beyond it (layout.pools.save_staging_bytes)
            room = mem_available() - HOST_SPARE + state.kept_checkpoint_staging()
            capacity = save_staging_bytes(staging, largest, self.data_bytes, room, background)
            self.staging = max(self.staging, capacity)
            self._ring = StagingRing(state.take_checkpoint_staging(capacity))
        self._pending = {e["shard"] for e, _ in self._optim}  # shards whose copy is not taken yet
        self._entry_of = {e["shard"]: e for e, _ in self._optim}
        # the writer takes the copies in the order the next step updates the shards: as backward
        # reaches them (the last first) when the last step began during backward, else in order
        self._order = list(reversed(self._optim)) if opt.steps_during_backward else list(self._optim)
        with self._lock:  # _make_room lets go of it while it waits for a write
            for e, st in self._optim:  # kept on the device: stepped there, their home written back any time
                if st.dev is not None:
                    self._take(e, st, self._state_source(st))

    # ------------------------------------------------------------------------- running
    def start(self) -> None:
        """Writes in a thread of its own; the optimizer's steps take their shard's copy first."""
        self.blocked_s = time.perf_counter() - self._t0  # before a step can add to it
        self.state.optimizer.set_before_update(self._before_update)
        self._thread = threading.Thread(target=self.run, name="pyinfinity-checkpoint", daemon=True)
        self._thread.start()

    def run(self) -> None:
        """Copies and writes every entry, then completes the checkpoint (see the class doc)."""
        try:
            for e, st in self._order:
                with self._lock:
                    if e["shard"] in self._pending:
                        self._take(e, st, self._state_source(st))
            self._drop_hook()
            for e, sh in self._params:
                with self._lock:
                    buf = self._make_room(e["nbytes"])
                    try:
                        e["crc32c"] = _crc32c(self.state.param_values(sh, out=buf.view(sh.dtype)))
                    except BaseException:
                        self._ring.drop_newest()
                        raise
                    self._submit(e, buf)
            with self._lock:
                self._drain()
                if self.failure is not None:  # a step's copy failed: its shard is not in state.bin
                    raise self.failure
            self._complete()
        except BaseException as exc:  # noqa: BLE001 - kept, raised at the caller's next call
            self.failure = self.failure or exc
        finally:
            self._drop_hook()
            self._pending = set()
            with self._lock:
                for req, _ in self._inflight:  # a failed write: the others finish before their buffers go
                    try:
                        req.wait()
                    except Exception:  # noqa: BLE001 - the first error is the one raised
                        pass
                self._inflight.clear()
                if self._ring is not None:  # no write reads it any more
                    self.state.give_back_checkpoint_staging(self._ring.buf, self._keep_staging)
                    self._ring = None
            if self.failure is not None:
                shutil.rmtree(self.tmp, ignore_errors=True)
                if self.ref is not None:  # its links went with the folder: the frozen slots are free again
                    self.ref.space.release_refs(SwapRef.alive)
            self._finished.set()

    def _drop_hook(self) -> None:
        if self._thread is not None:
            self.state.optimizer.set_before_update(None)

    def _before_update(self, st: Any, flat: Optional[torch.Tensor]) -> None:
        """A shard is about to change: its copy first, if not taken yet (from ``flat``, the state
        about to be stepped, or the home when None). The time counts as blocked, the wait for the
        writer's copy of the same shard included."""
        if st.shard.index not in self._pending:
            return
        t0 = time.perf_counter()
        try:
            with self._lock:
                try:
                    if st.shard.index in self._pending and self.failure is None and self._ring is not None:
                        if self._take(self._entry_of[st.shard.index], st,
                                      flat if flat is not None else self._state_source(st)):
                            self.copied_by_step += 1
                except BaseException as exc:  # noqa: BLE001 - the save fails, the step goes on
                    self.failure = self.failure or exc
                    self._pending = set()
                    if not isinstance(exc, Exception):  # Ctrl-C in a wait for room: the step's too
                        raise
        finally:
            self._add_blocked(time.perf_counter() - t0, by_step=True)

    def _add_blocked(self, seconds: float, by_step: bool = False) -> None:
        with self._stats_lock:
            self.blocked_s += seconds
            if by_step:
                self.step_s += seconds

    def _take(self, e: dict, st: Any, flat: Optional[torch.Tensor]) -> bool:
        """The copy of one shard's state (under the lock) into staging, then written: from ``flat``
        (a state in RAM), or with None read from its home on disk straight into staging. False
        when the other thread took it while this one waited for room."""
        fmt = self.state.optimizer.format
        buf = self._make_room(e["nbytes"], e["shard"])
        if buf is None:
            return False
        try:
            if flat is None:
                numel, dtype = fmt.home_spec(st.numel)
                home = self.state.optimizer.home_in_ram(st, out=buf.view(dtype)[:numel])
                data = fmt.save(home, st.numel)
                e["crc32c"] = (_crc32c(buf) if data.data_ptr() == buf.data_ptr()
                               else _copy_crc(buf, data, self._threads))
            else:
                e["crc32c"] = _copy_crc(buf, fmt.save(flat, st.numel), self._threads)
        except BaseException:
            self._ring.drop_newest()
            raise
        self._pending.discard(e["shard"])
        self._submit(e, buf)
        return True

    def _state_source(self, st: Any) -> Optional[torch.Tensor]:
        """A shard's state to copy: its home in RAM, or None when the home is on disk."""
        return self.state.optimizer.home_in_ram(st) if self.state.optimizer.home_on_host(st) else None

    def _make_room(self, n: int, shard: Optional[int] = None) -> Optional[torch.Tensor]:
        """Waits until a copy of ``n`` bytes fits the staging budget beside the copies still being
        written (or none is) and has a place in the ring: the oldest copy's write first. Called
        and returning with the lock held; the lock is let go while a write is waited for, so a
        step can take its shard's copy meanwhile. Returns that place, or None when ``shard``'s
        copy was taken by the other thread meanwhile (or the save ended)."""
        while self._inflight and (self._staged() + n > self.staging or self._ring.place(n) is None):
            self._wait_oldest()
            if self._ring is None or (shard is not None and shard not in self._pending):
                return None
        return self._ring.take(n)

    def _drain(self) -> None:
        """Waits for every write in flight, oldest first, each place in the ring given back (the
        lock held when called and on return, let go while waiting)."""
        while self._inflight:
            self._wait_oldest()

    def _wait_oldest(self) -> None:
        """Waits for the oldest write in flight without the lock (held when called and on
        return), then gives its place in the ring back unless the other thread did meanwhile."""
        req = self._inflight[0][0]
        self._lock.release()
        try:
            req.wait()
        finally:
            self._lock.acquire()
        if self._inflight and self._inflight[0][0] is req:
            self._inflight.popleft()
            self._ring.release()

    def _staged(self) -> int:
        return sum(n for _, n in self._inflight)

    def _submit(self, e: dict, buf: torch.Tensor) -> None:
        """Writes a copy whose CRC-32C ``e`` holds; its place in the ring is held until the write is
        done. The bytes of ``state.bin`` up to the next page after an entry are its own (the layout
        rounds each up): an unaligned tail goes out as one zero-padded O_DIRECT block, not a
        buffered read-modify-write of its page."""
        self._inflight.append((self._io.submit(buf, self._data_path, e["offset"], True, pad_tail=True), e["nbytes"]))
        self.staged_peak = max(self.staged_peak, self._staged())

    def _complete(self) -> None:
        if os.path.exists(self._data_path):
            fsync_path(self._data_path)
        if self.ref is not None and self._frozen_slots:  # the held slots' bytes durable, not only written
            for name in self.ref.names:
                fsync_path(os.path.join(self.tmp, name))
        files = {"meta.json": json.dumps(self._meta).encode(), "rng.pt": self._rng}
        for name, data in files.items():
            _write_file(os.path.join(self.tmp, name), data)
        sums = {"format": CHECKSUMS_FORMAT, "version": self.version,
                "files": {name: {"nbytes": len(data), "crc32c": _crc32c_bytes(data)} for name, data in files.items()}}
        _write_file(os.path.join(self.tmp, CHECKSUMS_NAME), json.dumps(sums).encode())  # last: its presence says done
        fsync_path(self.tmp)
        _rename_into_place(self.tmp, self.path, self.save_dir)
        latest_tmp = os.path.join(self.save_dir, f".latest.tmp-{os.getpid()}")
        try:
            _write_file(latest_tmp, self.tag.encode())
            os.rename(latest_tmp, os.path.join(self.save_dir, "latest"))
        except BaseException:
            _unlink_quiet(latest_tmp)
            raise
        fsync_path(self.save_dir)
        self.seconds = time.perf_counter() - self._t0
        log.info("checkpoint saved: %s (%s)", self.path, format_size(self.data_bytes))
        if self.keep_last is not None:  # only now: the new checkpoint is complete, fsynced and named by latest
            t0 = time.perf_counter()
            rotate(self.save_dir, self.keep_last)
            if self.ref is not None:
                self.ref.space.release_refs(SwapRef.alive)
            self.rotate_s = time.perf_counter() - t0

    # ------------------------------------------------------------------------- the caller's side
    @property
    def done(self) -> bool:
        return self._finished.is_set()

    def join(self) -> None:
        """Waits for the write, in slices of WAIT_SLICE_S: Ctrl-C arrives within one (the write goes on)."""
        t0 = time.perf_counter()
        try:
            while not self._finished.wait(WAIT_SLICE_S):
                if self._thread is None or not self._thread.is_alive():
                    raise RuntimeError(f"checkpoint {self.path}: the thread writing it died")
        finally:
            self._add_blocked(time.perf_counter() - t0)

    def wait(self, what: str = "wait_for_checkpoint()") -> None:
        """``join``, then raises the write's failure, once."""
        self.join()
        self.raise_failure(what)

    def raise_failure(self, what: str = "save_checkpoint()") -> None:
        exc, self.failure = self.failure, None
        if exc is None:
            return
        if not isinstance(exc, Exception):  # KeyboardInterrupt, SystemExit in the writer: as they came
            raise exc
        if isinstance(exc, OSError):
            raise OSError(exc.errno, f"{what}: the checkpoint {self.path} was not saved ({exc.strerror}); "
                          "latest still names the previous one", exc.filename) from exc
        raise RuntimeError(f"{what}: the checkpoint {self.path} was not saved ({exc!r}); latest still names the "
                           "previous one") from exc

    def __fspath__(self) -> str:
        return self.path

    def __str__(self) -> str:
        return self.path


def _pages(n: int) -> int:
    """``n`` bytes rounded up to whole pages (ALIGN), at least one."""
    return max(1, -(-n // ALIGN)) * ALIGN


class StagingRing:
    """The staging of one save: a page-aligned host buffer holding the copies not yet written, one
    after the other, each at a page boundary (written with O_DIRECT), wrapping to the start when the
    end has no room; given back oldest first, as the writer waits for them. ``place`` says where a
    copy of ``n`` bytes would go (None: not before the oldest is given back); an empty ring holds
    any copy up to its capacity."""

    def __init__(self, buf: torch.Tensor) -> None:
        self.buf = buf  # uint8, page aligned
        self.capacity = buf.numel()
        self._spans: collections.deque = collections.deque()  # (start, end) of the copies held, oldest first

    def place(self, n: int) -> Optional[int]:
        size = _pages(n)
        if size > self.capacity:
            raise ValueError(f"checkpoint staging: a copy of {n} bytes does not fit the {self.capacity} bytes staged")
        if not self._spans:
            return 0
        first, (last_start, last_end) = self._spans[0][0], self._spans[-1]
        if last_start >= first:  # the held bytes in one piece: room after them, else before them
            if last_end + size <= self.capacity:
                return last_end
            return 0 if size <= first else None
        return last_end if last_end + size <= first else None  # wrapped: room between the newest and the oldest

    def take(self, n: int) -> torch.Tensor:
        """The place of a copy of ``n`` bytes, held until ``release`` (RuntimeError if there is none now)."""
        at = self.place(n)
        if at is None:
            raise RuntimeError(f"checkpoint staging: no room for {n} bytes before the oldest copy is given back")
        self._spans.append((at, at + _pages(n)))
        return self.buf[at:at + n]

    def release(self) -> None:
        """Gives back the oldest copy's place (its write is done)."""
        self._spans.popleft()

    def drop_newest(self) -> None:
        """Gives back the newest place (its copy failed before it was written)."""
        self._spans.pop()

    @property
    def held(self) -> int:
        return len(self._spans)


class SwapRef:
    """One checkpoint's hold on the slots of a swap space it saved by reference: a hard link to
    each of the space's files in the checkpoint's folder (the temporary one while it is written,
    then its own), named with a token of this save. It holds while a link is there: a checkpoint
    rotated away, removed by an ``rmtree`` or a save that failed holds nothing."""

    _saves = itertools.count()

    def __init__(self, save_dir: str, tag: str, tmp: str, space: Any) -> None:
        self.space = space
        token = f"{os.getpid()}-{next(SwapRef._saves)}-{time.time_ns()}"
        self.names = [f"{space.name}.{i}.{token}.swp" for i in range(len(space.paths))]
        self.dirs = (tmp, os.path.join(save_dir, tag))

    def link(self) -> None:
        for src, name in zip(self.space.paths, self.names):
            os.link(src, os.path.join(self.dirs[0], name))

    def alive(self) -> bool:
        return any(os.path.exists(os.path.join(d, self.names[0])) for d in self.dirs)


def _linkable_space(swapper: Any, save_dir: str) -> Any:
    """The optimizer state's swap space when a checkpoint in ``save_dir`` can hold its slots by
    reference (the swap files on the checkpoint's filesystem, write checksums recorded), else None."""
    space = swapper.nvme_space()
    if space is None or not space.record_checksums or not space.paths:
        return None
    dev = os.stat(save_dir).st_dev
    if any(os.stat(p).st_dev != dev for p in space.paths):
        log.info("checkpoint: %s is on another filesystem than the swap files: the NVMe state is copied, not "
                 "saved by reference", save_dir)
        return None
    return space


def _check_room(save_dir: str, data_bytes: int, space: Any, frozen: list) -> None:
    """OSError(ENOSPC) in one line, before anything is written, when the save would not fit the
    free disk: state.bin's bytes on the checkpoint's filesystem, and for slots saved by reference
    the fresh slots the next step writes them into (beside the held ones) on the swap filesystem,
    less the room the swap files already have."""
    need: dict[int, list] = {}

    def add(d: str, n: int, what: str) -> None:
        if n <= 0:
            return
        st = os.statvfs(d)
        entry = need.setdefault(os.stat(d).st_dev, [d, st.f_bavail * st.f_frsize, 0, []])
        entry[2] += n
        entry[3].append(what)
    add(save_dir, data_bytes, f"state.bin {format_size(data_bytes)}")
    if frozen:
        per_file = [0] * len(space.paths)
        for slot in frozen:
            if not space.frozen(slot):  # held already: its fresh slot is counted by the save that froze it
                for x in slot.extents:
                    per_file[x.file] += x.reserved
        spare = space.free_bytes() // len(space.paths)
        for path, n in zip(space.paths, per_file):
            add(os.path.dirname(path), n - spare, f"fresh slots for the NVMe state held by reference {format_size(n)}")
    for d, free, n, parts in need.values():
        if n > free:
            raise OSError(errno.ENOSPC, f"save_checkpoint: not enough free disk for this save ({', '.join(parts)}: "
                          f"{format_size(n)}, {format_size(free)} free; nothing was written): a checkpoint holding "
                          "the NVMe state by reference needs its size again beside the live state, the next step "
                          "rewrites every shard", d)


def _check_ref(path: str, key: str, ref: Any, nbytes: Any) -> None:
    """A by-reference entry's ``ref``: the linked files, the extents and their CRC-32Cs."""
    bad = CheckpointError(f"checkpoint {path!r}: meta.json: {key}.ref: expected {{files, extents, crc32c}} "
                          f"covering {nbytes} bytes, got {ref!r}"[:400])
    if not (isinstance(ref, dict) and ref.keys() == {"files", "extents", "crc32c"}):
        raise bad
    files, extents, crcs = ref["files"], ref["extents"], ref["crc32c"]
    if not (isinstance(files, list) and files and all(isinstance(f, str) and os.path.basename(f) == f
                                                      and f.endswith(".swp") for f in files)):
        raise bad
    if not (isinstance(extents, list) and isinstance(crcs, list) and len(extents) == len(crcs) and extents):
        raise bad
    for x, c in zip(extents, crcs):
        if not (isinstance(x, list) and len(x) == 3 and all(_is_int(v) for v in x) and x[0] < len(files)
                and x[1] % ALIGN == 0 and isinstance(c, list) and all(_is_int(v) and v < 1 << 32 for v in c)):
            raise bad
    if sum(x[2] for x in extents) != nbytes:
        raise bad


def _read_ref(io: Any, path: str, e: dict, buf: torch.Tensor) -> None:
    """Reads a by-reference entry from the swap files the checkpoint links, each extent checked
    against the CRC-32Cs recorded when the swap layer wrote it."""
    ref, pos = e["ref"], 0
    for (f, off, n), crcs in zip(ref["extents"], ref["crc32c"]):
        fp = os.path.join(path, ref["files"][f])
        try:
            io.submit(buf, fp, off, False, n, pos, expected_checksums=crcs).wait()
        except (OSError, ValueError) as exc:
            raise CheckpointError(f"checkpoint {path!r}: {ref['files'][f]} bytes [{off}, {off + n}) (shard "
                                  f"{e['shard']}, optimizer state by reference) missing, torn or changed ({exc}); "
                                  "the engine's state is now partly loaded: load another checkpoint before "
                                  "training") from exc
        pos += n


def check_keep_last(keep_last: Optional[int]) -> None:
    """``keep_last`` is None (keep every checkpoint) or an integer >= 1."""
    if keep_last is not None and (not isinstance(keep_last, int) or isinstance(keep_last, bool) or keep_last < 1):
        raise ValueError(f"keep_last: expected None or an integer >= 1 (the checkpoints kept), got {keep_last!r}")


def complete_checkpoints(save_dir: str) -> list[str]:
    """The tags of ``save_dir``'s complete checkpoints, oldest first: directories holding
    ``checksums.json`` (written last, fsynced: its presence says the checkpoint is whole), in the
    order they were completed (its modification time; the tag breaks a tie). Half-written saves
    (``.<tag>.tmp-<pid>``), version-1 checkpoints and anything else in the directory are not listed."""
    found = []
    for name in os.listdir(save_dir):
        path = os.path.join(save_dir, name)
        if name.startswith(".") or os.path.islink(path) or not os.path.isdir(path):
            continue
        try:
            done = os.stat(os.path.join(path, CHECKSUMS_NAME)).st_mtime_ns
        except OSError:  # not a checkpoint, or removed meanwhile
            continue
        found.append((done, name))
    return [name for _, name in sorted(found)]


def rotate(save_dir: str, keep_last: int) -> list[str]:
    """Removes the oldest complete checkpoints of ``save_dir`` until ``keep_last`` remain
    (Trainer's ``save_total_limit``); the one ``latest`` names is never removed. Each goes by a
    rename to a half-written save's name (``.<tag>.tmp-<pid>``), fsynced, then its files: a crash
    part-way leaves a name the next save's cleanup removes, never a partial checkpoint under its
    tag. Every checkpoint is a copy of its own, so removing one (here, or by an ``rmtree`` of its
    folder from outside) changes neither the live state nor another checkpoint. Returns the
    removed paths."""
    check_keep_last(keep_last)
    try:
        with open(os.path.join(save_dir, "latest")) as f:
            newest = f.read().strip()
    except OSError:
        newest = None
    complete = complete_checkpoints(save_dir)
    tags = [t for t in complete if t != newest]
    excess = tags[:max(0, len(tags) - (keep_last - (newest in complete)))]
    removed = []
    for tag in excess:
        path = os.path.join(save_dir, tag)
        doomed = os.path.join(save_dir, f".{tag}.tmp-{os.getpid()}")
        shutil.rmtree(doomed, ignore_errors=True)
        try:
            os.rename(path, doomed)
        except FileNotFoundError:  # removed from outside meanwhile
            continue
        fsync_path(save_dir)
        shutil.rmtree(doomed, ignore_errors=True)
        removed.append(path)
        log.info("checkpoint removed (keep_last=%d): %s", keep_last, path)
    return removed


def _rename_into_place(tmp: str, final: str, save_dir: str) -> None:
    """Renames the written checkpoint ``tmp`` to ``final`` (an older ``final`` renamed away first,
    then removed). Another process saving the same tag at the same time makes a rename fail
    (ENOTEMPTY, EEXIST, ENOENT): an error naming the directory and the cause; this save's files go."""
    try:
        if os.path.exists(final):
            old = final + f".old-{os.getpid()}"
            os.rename(final, old)
            os.rename(tmp, final)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.rename(tmp, final)
    except OSError as exc:
        if exc.errno not in (errno.ENOTEMPTY, errno.EEXIST, errno.ENOENT):
            raise
        shutil.rmtree(tmp, ignore_errors=True)
        raise OSError(exc.errno, f"save_checkpoint: {final} changed while this save renamed its copy into place "
                      f"({exc.strerror}): another process is saving into {save_dir} (give each run its own save "
                      "directory); this save was not kept", final) from exc


def _write_file(path: str, data: bytes) -> None:
    """Writes and fsyncs ``path``; an OSError (ENOSPC...) names the file."""
    try:
        write_fsynced(path, data)
    except OSError as exc:
        if exc.filename is not None:
            raise
        raise OSError(exc.errno, f"{exc.strerror}: writing checkpoint file {os.path.basename(path)} "
                      f"({len(data)} bytes)", path) from exc


def _unlink_quiet(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


def load(state: "TrainingState", load_dir: str, tag: Optional[str] = None, *,
         base: Optional[dict] = None, convert_optimizer_state: bool = False) -> tuple[str, dict]:
    """Restores a state written by ``save_checkpoint``; returns (path, client_state). Everything
    but state.bin's tensors is read and checked before the engine changes (see the module doc).
    ``base``: the identity of the pretrained weights this engine's frozen shards hold; a
    checkpoint that records one (its frozen shards not saved) loads only over the same. A
    checkpoint's optimizer state of another format than the engine's is refused unless
    ``convert_optimizer_state`` (decoded to fp32, encoded in the engine's format)."""
    state.check_open()
    state.check_not_in_pass("load_checkpoint()")
    clean_checkpoint_leftovers(load_dir)  # puts back a tag a crash left renamed away
    if tag is None:
        try:
            with open(os.path.join(load_dir, "latest")) as f:
                tag = f.read().strip()
        except OSError as exc:
            raise FileNotFoundError(f"load_dir: no 'latest' file in {load_dir!r}; pass tag=") from exc
    path = os.path.join(load_dir, tag)
    raw = {name: _read_file(path, name) for name in ("meta.json", "rng.pt")}
    sums = _read_checksums(path)
    if sums is not None:
        for name, data in raw.items():
            want = sums[name]
            if len(data) != want["nbytes"] or _crc32c_bytes(data) != want["crc32c"]:
                raise CheckpointError(f"checkpoint {path!r}: {name} fails its checksum ({len(data)} bytes, CRC-32C "
                                      f"{_crc32c_bytes(data):#010x}; {CHECKSUMS_NAME} lists {want['nbytes']} bytes, "
                                      f"{want['crc32c']:#010x}): changed or torn on disk; nothing was loaded")
    try:
        meta = json.loads(raw["meta.json"])
    except ValueError as exc:
        raise CheckpointError(f"checkpoint {path!r}: meta.json missing or torn ({exc})") from exc
    if not isinstance(meta, dict):
        raise CheckpointError(f"checkpoint {path!r}: meta.json: expected a JSON object, got {type(meta).__name__}")
    version = meta.get("version")
    if sums is None and version != 1:
        raise CheckpointError(f"checkpoint {path!r}: {CHECKSUMS_NAME} missing (a version {version!r} checkpoint "
                              "has one: the save was cut short or the file was removed); nothing was loaded")
    if sums is not None and version not in range(2, CHECKPOINT_VERSION + 1):
        raise CheckpointError(f"checkpoint {path!r}: meta.json: version {version!r} (expected 2 to "
                              f"{CHECKPOINT_VERSION})")
    _check_adapters(path, meta.get("base"), base)  # before the shards: another rank changes them too
    entries = _validate_meta(state, path, meta, convert_optimizer_state)
    _check_base(path, meta.get("base"), base, version)
    saved_format = _saved_format(state, meta)
    if saved_format.name != state.optimizer.format.name and not convert_optimizer_state:
        raise CheckpointError(f"checkpoint {path!r} holds the {saved_format.name} optimizer state, this engine keeps "
                              f"the {state.optimizer.format.name} one: load_checkpoint(..., "
                              "convert_optimizer_state=True) (pyinfinity train --resume-convert) converts it")
    if sums is None:
        unchecked = sum(1 for e in entries if "crc32c" not in e)
        log.warning("checkpoint %s: version 1, without %s: meta.json and rng.pt cannot be verified%s", path,
                    CHECKSUMS_NAME, f", nor the {unchecked} state.bin entries saved without a CRC-32C" if unchecked
                    else "")
    rng = _load_rng(path, raw["rng.pt"])
    data_path = os.path.join(path, "state.bin")
    have = os.path.getsize(data_path) if os.path.exists(data_path) else 0
    need = max((e["offset"] + e["nbytes"] for e in entries if "ref" not in e), default=0)
    if have < need:
        raise CheckpointError(f"checkpoint {path!r}: state.bin has {have} bytes, {need} expected (torn)")
    linked: dict[str, int] = {}  # the swap files a version-5 checkpoint links: each long enough
    for e in entries:
        for f, off, n in e.get("ref", {}).get("extents", ()):
            name = e["ref"]["files"][f]
            linked[name] = max(linked.get(name, 0), off + n)
    for name, n in linked.items():
        try:
            size = os.path.getsize(os.path.join(path, name))
        except OSError as exc:
            raise CheckpointError(f"checkpoint {path!r}: {name} (the swap file it holds the optimizer state in by "
                                  f"reference) missing ({exc}); nothing was loaded") from exc
        if size < n:
            raise CheckpointError(f"checkpoint {path!r}: {name} has {size} bytes, {n} expected (truncated); "
                                  "nothing was loaded")

    # from here on the engine changes: a failure part-way leaves it refusing to train until a load succeeds
    state.optimizer.cancel()  # the loaded state replaces whatever a pending step did
    state.pending_backward = False
    state.coordinator.release_all()
    try:
        _load_tensors(state, path, data_path, entries, saved_format)
    except BaseException as exc:
        state.mark_partly_loaded(f"load_checkpoint({path!r}) failed part-way ({exc!r}): some shards hold the "
                                 "checkpoint's state, the others the previous one")
        log.error("%s; load a checkpoint before training on", state.partly_stepped)
        raise
    state.global_steps = meta["global_steps"]
    state.scaler.load_state_dict(meta["scaler"])
    for g, lr in zip(state.optimizer.param_groups, meta["lr"]):
        g["lr"] = lr
    state.micro_steps = apply_hyperparameters(state, path, meta.get("hyperparameters"), meta["micro_steps"])
    if state.lr_scheduler is not None and meta["scheduler"] is not None:
        state.lr_scheduler.load_state_dict(meta["scheduler"])
    torch.set_rng_state(rng["cpu"])
    if rng["cuda"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(rng["cuda"])
    state.optimizer.zero_grad()
    state.coordinator.refresh_persistent()
    state.mark_whole()  # every shard's state and values are the checkpoint's now
    log.info("checkpoint loaded: %s (step %d)", path, state.global_steps)
    return path, meta["client_state"]


def _saved_format(state: "TrainingState", meta: dict) -> Optional[OptimStateFormat]:
    """The format of a checkpoint's optimizer state (fp32 when it records none: written before the
    formats), None for a name this engine does not know."""
    name = meta.get("optimizer_state", "fp32")
    if name == state.optimizer.format.name:
        return state.optimizer.format
    return make_state_format(name, True) if name in STATE_FORMATS else None  # adam_w: only a step reads it


def _check_adapters(path: str, saved: Optional[dict], mine: Optional[dict]) -> None:
    """The adapters a LoRA checkpoint trained must be those this engine trains (rank, targets,
    alpha, dropout, ...): checked before the shards, since another rank or other targets change
    them too and "another adapter config" is the cause to name."""
    if not isinstance(saved, dict) or mine is None or "adapters" not in saved:  # recorded since version 3
        return
    if saved.get("adapters") != mine.get("adapters"):
        theirs, here = saved.get("adapters") or {}, mine.get("adapters") or {}
        diff = [f"adapter {n!r} {k} {(here.get(n) or {}).get(k)!r} here, {(theirs.get(n) or {}).get(k)!r} then"
                for n in sorted(set(theirs) | set(here))
                for k in sorted(set(theirs.get(n) or {}) | set(here.get(n) or {}))
                if (theirs.get(n) or {}).get(k) != (here.get(n) or {}).get(k)]
        raise CheckpointError(f"checkpoint {path!r} trained its adapters with another config: {'; '.join(diff[:4])}; "
                              "resume with the adapter config it was saved with")


def _check_base(path: str, saved: Optional[dict], mine: Optional[dict], version: Any = CHECKPOINT_VERSION) -> None:
    """A checkpoint without its frozen shards loads only over the pretrained weights it was saved
    over: the same config.json, safetensors files by name and size, and every tensor's CRC-32C
    (a version-3 checkpoint: each file's first MiB, with a warning); the adapters as
    ``_check_adapters``."""
    if saved is None:
        return
    if mine is None:
        raise CheckpointError(f"checkpoint {path!r} holds the trained parameters only (its frozen base is the pretrained "
                              f"weights {sorted(saved.get('files', {}))}): load it into an engine built from those "
                              "weights (from_pretrained of the same model directory)")
    _check_adapters(path, saved, mine)
    saved, mine = ({k: v for k, v in d.items() if k != "adapters"} for d in (saved, mine))
    if "tensors" not in saved:
        log.warning("checkpoint %s: version %s: its base weights are checked by config.json, file sizes and each "
                    "file's first MiB only (a change past that is not seen); a save from this run records every "
                    "tensor's checksum", path, version)
        mine = {k: v for k, v in mine.items() if k != "tensors"}
    else:  # the first MiB is recorded too, but every byte is compared: the tensors say which differs
        mine = {**mine, "files": {n: {k: v for k, v in f.items() if k != "crc32"} for n, f in mine["files"].items()}}
        saved = {**saved, "files": {n: {k: v for k, v in f.items() if k != "crc32"}
                                    for n, f in (saved.get("files") or {}).items()}}
    if saved == mine:
        return
    if saved.get("config") != mine.get("config"):
        what = "their config.json differs"
    elif saved.get("files") != mine.get("files"):
        what = (f"their safetensors files differ (names, sizes{'' if 'tensors' in saved else ', first bytes'}: "
                f"{sorted(saved.get('files') or {})} then, {sorted(mine.get('files') or {})} here)")
    else:
        theirs, here = saved.get("tensors") or {}, mine.get("tensors") or {}
        changed = sorted(k for k in set(theirs) | set(here) if theirs.get(k) != here.get(k))
        what = (f"their safetensors files hold other values: {len(changed)} tensor(s) differ (CRC-32C of every "
                f"byte), e.g. {changed[0]!r}"
                + (f" ({theirs[changed[0]]:#010x} then, {here[changed[0]]:#010x} here)"
                   if changed[0] in theirs and changed[0] in here else " (read by one run only)"))
    raise CheckpointError(f"checkpoint {path!r} was saved over other base weights than this engine's: {what}; load "
                          "it into an engine built from the model directory it was trained on")


def _dtype_named(name: Any) -> Optional[torch.dtype]:
    """The torch dtype ``str(dtype)`` named (e.g. "torch.bfloat16"), None for anything else."""
    d = getattr(torch, name[len("torch."):], None) if isinstance(name, str) and name.startswith("torch.") else None
    return d if isinstance(d, torch.dtype) else None


def _load_tensors(state: "TrainingState", path: str, data_path: str, entries: list[dict],
                  saved_format: OptimStateFormat) -> None:
    io = state.checkpoint_io()
    shards = state.partition.shards
    fmt = state.optimizer.format
    for e in entries:
        sh = shards[e["shard"]]
        if e["kind"] == "optim":
            buf = aligned_empty(*saved_format.home_spec(sh.numel))
            if "ref" in e:
                _read_ref(io, path, e, buf)
            else:
                io.read(buf, data_path, e["offset"]).wait()
                _check_entry(path, e, buf)
            data = convert_home(buf, sh.numel, saved_format, fmt)
            state.optimizer.load_shard_state(sh, data, e["step"])
            state.write_param(sh, fmt.master(data, sh.numel)).wait()
        else:
            dtype = _dtype_named(e["dtype"]) or sh.dtype
            buf = aligned_empty(sh.numel, dtype)
            io.read(buf, data_path, e["offset"]).wait()
            _check_entry(path, e, buf)
            if dtype != sh.dtype:  # converting to this engine's compute dtype
                cast = aligned_empty(sh.numel, sh.dtype)
                cast.copy_(buf)
                buf = cast
            state.param_swapper.write(sh.home, buf).wait()


def _read_file(path: str, name: str) -> bytes:
    try:
        with open(os.path.join(path, name), "rb") as f:
            return f.read()
    except OSError as exc:
        raise CheckpointError(f"checkpoint {path!r}: {name} missing or torn ({exc})") from exc


def _read_checksums(path: str) -> Optional[dict]:
    """checksums.json's file records, None when there is none (a version 1 checkpoint)."""
    fp = os.path.join(path, CHECKSUMS_NAME)
    if not os.path.lexists(fp):
        return None
    data = _read_file(path, CHECKSUMS_NAME)
    where = f"checkpoint {path!r}: {CHECKSUMS_NAME}"
    try:
        doc = json.loads(data)
    except ValueError as exc:
        raise CheckpointError(f"{where}: torn or changed ({exc})") from exc
    if not isinstance(doc, dict) or doc.get("format") != CHECKSUMS_FORMAT or not isinstance(doc.get("files"), dict):
        raise CheckpointError(f"{where}: not a pyinfinity checkpoint checksum file (torn or changed)")
    files = doc["files"]
    for name in ("meta.json", "rng.pt"):
        rec = files.get(name)
        if not (isinstance(rec, dict) and _is_int(rec.get("nbytes")) and _is_int(rec.get("crc32c"))):
            raise CheckpointError(f"{where}: files.{name}: expected {{\"nbytes\": int, \"crc32c\": int}}, got {rec!r}")
    return files


def _is_int(v: Any, lo: int = 0) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= lo


def _is_num(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _validate_meta(state: "TrainingState", path: str, meta: dict, convert: bool = False) -> list[dict]:
    """Every key of meta.json checked against this engine before anything is loaded; returns the
    entries (one per shard) in file order. A checkpoint whose shards differ from this engine's in
    their compute dtype only is refused naming the dtype, or with ``convert`` accepted (its frozen
    shards' values are cast on load, its optimizer state converted as between formats)."""
    where = f"checkpoint {path!r}: meta.json"

    def bad(key: str, what: str) -> CheckpointError:
        return CheckpointError(f"{where}: {key}: {what}")

    keys = {"version", "global_steps", "micro_steps", "shards", "entries", "data_bytes", "scaler", "scheduler",
            "lr", "client_state"}
    # resumes compare them / frozen shards not saved / fp32 / `train --resume` keeps it (config.PLACEMENT_KEYS)
    optional = {"hyperparameters", "base", "optimizer_state", "placement"}
    missing, extra = keys - meta.keys(), meta.keys() - keys - optional
    if missing or extra:
        raise CheckpointError(f"{where}: " + "; ".join(
            ([f"missing keys {sorted(missing)}"] if missing else []) + ([f"unknown keys {sorted(extra)}"] if extra else [])))
    if "placement" in meta and not isinstance(meta["placement"], dict):
        raise bad("placement", f"expected an object of config keys, got {meta['placement']!r}")
    for k in ("global_steps", "micro_steps", "data_bytes"):
        if not _is_int(meta[k]):
            raise bad(k, f"expected an integer >= 0, got {meta[k]!r}")
    if meta["micro_steps"] < meta["global_steps"]:
        raise bad("micro_steps", f"{meta['micro_steps']} is below global_steps ({meta['global_steps']})")
    if _saved_format(state, meta) is None:
        raise bad("optimizer_state", f"expected one of {sorted(STATE_FORMATS)}, got {meta['optimizer_state']!r}")
    saved_format = _saved_format(state, meta)
    # the model and partition
    shards = meta["shards"]
    if not isinstance(shards, list):
        raise bad("shards", f"expected a list, got {type(shards).__name__}")
    mine = state.partition.shards
    for i in range(max(len(shards), len(mine))):
        s = shards[i] if i < len(shards) else None
        if s is not None and not (isinstance(s, dict) and _is_int(s.get("index")) and _is_int(s.get("numel"))
                                  and isinstance(s.get("dtype"), str) and isinstance(s.get("module"), str)):
            raise bad(f"shards[{i}]", f"expected {{index, module, numel, dtype}}, got {s!r}")
        m = mine[i] if i < len(mine) else None
        if s is not None and m is not None and (s["index"], s["numel"], s["module"]) == (m.index, m.numel,
                                                                                         m.module_name):
            if s["dtype"] != str(m.dtype) and not convert:
                bf16 = ("; the bf16 optimizer state keeps bf16 masters, so it needs bf16 compute (--dtype bf16)"
                        if "bf16" in (meta.get("optimizer_state"), state.optimizer.format.name) else "")
                raise CheckpointError(f"checkpoint {path!r}: was saved by a run computing in {s['dtype']}, this "
                                      f"engine computes in {m.dtype} (shard {i}, {s['module']!r}): the compute dtype "
                                      f"differs, not the model{bf16}; resume with the same dtype, or convert with "
                                      "load_checkpoint(..., convert_optimizer_state=True) (pyinfinity train "
                                      "--resume-convert)")
            continue
        if s is None or m is None or (s["index"], s["numel"], s["dtype"]) != (m.index, m.numel, str(m.dtype)):
            theirs = (f"shard {s['index']} of module {s['module']!r}: {s['numel']} elements of {s['dtype']}"
                      if s is not None else "no such shard")
            here = (f"shard {m.index} of module {m.module_name!r}: {m.numel} elements of {m.dtype}"
                    if m is not None else "no such shard")
            raise CheckpointError(f"checkpoint {path!r}: was saved from a different model/partition "
                                  f"({len(shards)} shards there, {len(mine)} here); the first difference is at "
                                  f"shard {i}: checkpoint has {theirs}, this model has {here} (meta.json shards[{i}])")
    # one entry per shard, of the right kind and size, inside state.bin, not overlapping
    entries = meta["entries"]
    if not isinstance(entries, list):
        raise bad("entries", f"expected a list, got {type(entries).__name__}")
    seen: dict[int, int] = {}
    spans = []
    for i, e in enumerate(entries):
        k = f"entries[{i}]"
        if not isinstance(e, dict):
            raise bad(k, f"expected an object, got {e!r}")
        want = {"shard", "kind", "numel", "offset", "nbytes", "crc32c"} | (
            {"step"} if e.get("kind") == "optim" else {"dtype"})
        if "ref" in e and meta["version"] >= 5 and e.get("kind") == "optim":  # NVMe state by reference
            want = want - {"offset", "crc32c"} | {"ref"}
            _check_ref(path, k, e["ref"], e.get("nbytes"))
        if meta["version"] == 1 and "crc32c" not in e:  # written before per-entry checksums
            want.discard("crc32c")
        if e.keys() != want:
            raise bad(k, f"keys {sorted(e.keys())}, expected {sorted(want)}")
        for f in want - {"kind", "dtype", "ref"}:
            if not _is_int(e[f]):
                raise bad(f"{k}.{f}", f"expected an integer >= 0, got {e[f]!r}")
        if e["shard"] >= len(mine):
            raise bad(f"{k}.shard", f"{e['shard']} is out of range ({len(mine)} shards)")
        if e["shard"] in seen:
            raise bad(f"{k}.shard", f"shard {e['shard']} is listed twice (entries[{seen[e['shard']]}] too)")
        seen[e["shard"]] = i
        sh = mine[e["shard"]]
        trainable = state.optimizer.state_of(sh) is not None
        if e["kind"] not in ("optim", "param") or (e["kind"] == "optim") != trainable:
            raise bad(f"{k}.kind", f"{e['kind']!r}, but shard {sh.index} ({sh.module_name!r}) is "
                      f"{'trainable: expected optim' if trainable else 'frozen: expected param'}")
        saved_dtype = sh.dtype
        if not trainable and convert and e.get("dtype") != str(sh.dtype):  # cast on load
            saved_dtype = _dtype_named(e.get("dtype"))
            if saved_dtype is None:
                raise bad(f"{k}.dtype", f"{e.get('dtype')!r} is not a torch dtype")
        nbytes = saved_format.nbytes(sh.numel) if trainable else sh.numel * saved_dtype.itemsize
        if e["numel"] != sh.numel or e["nbytes"] != nbytes:
            raise bad(k, f"numel {e['numel']}, nbytes {e['nbytes']}; shard {sh.index} needs numel {sh.numel}, "
                      f"nbytes {nbytes}")
        if not trainable and e["dtype"] != str(saved_dtype):
            raise bad(f"{k}.dtype", f"{e['dtype']!r}, shard {sh.index} is {sh.dtype}")
        if trainable and e["step"] > meta["global_steps"]:
            raise bad(f"{k}.step", f"{e['step']} is above global_steps ({meta['global_steps']})")
        if "ref" in want:
            continue
        if "crc32c" in e and e["crc32c"] >= 1 << 32:
            raise bad(f"{k}.crc32c", f"{e['crc32c']} is not a CRC-32C")
        if e["offset"] % ALIGN or e["offset"] + e["nbytes"] > meta["data_bytes"]:
            raise bad(f"{k}.offset", f"{e['offset']} (+ {e['nbytes']} bytes) is not {ALIGN}-aligned inside "
                      f"data_bytes ({meta['data_bytes']})")
        spans.append((e["offset"], e["offset"] + e["nbytes"], i))
    if "base" in meta and not isinstance(meta["base"], dict):
        raise bad("base", f"expected an object, got {type(meta['base']).__name__}")
    absent = [sh.index for sh in mine if sh.index not in seen
              and ("base" not in meta or state.optimizer.state_of(sh) is not None)]  # frozen: the base's values
    if absent:
        raise bad("entries", f"no entry for shard(s) {absent[:8]}{' ...' if len(absent) > 8 else ''}")
    spans.sort()
    for (a0, a1, ai), (b0, _, bi) in zip(spans, spans[1:]):
        if b0 < a1:
            raise bad(f"entries[{bi}].offset", f"{b0} overlaps entries[{ai}] (bytes [{a0}, {a1}))")
    # counters, scaler, scheduler, learning rates, client state
    scaler, ref = meta["scaler"], state.scaler.state_dict()
    if not isinstance(scaler, dict) or scaler.keys() != ref.keys():
        raise bad("scaler", f"expected keys {sorted(ref)}, got {scaler!r}")
    if not (_is_num(scaler["scale"]) and scaler["scale"] > 0):
        raise bad("scaler.scale", f"expected a finite number > 0, got {scaler['scale']!r}")
    for key in ref.keys() - {"scale"}:
        if not _is_int(scaler[key]):
            raise bad(f"scaler.{key}", f"expected an integer >= 0, got {scaler[key]!r}")
    sched = meta["scheduler"]
    if sched is not None and not isinstance(sched, dict):
        raise bad("scheduler", f"expected an object or null, got {type(sched).__name__}")
    if state.lr_scheduler is not None and sched is not None:
        ref = state.lr_scheduler.state_dict()
        if set(sched) != set(ref):
            raise bad("scheduler", f"keys {sorted(sched)}, this engine's scheduler has {sorted(ref)}")
        for key, v in ref.items():
            if _is_num(v) and not _is_num(sched[key]):
                raise bad(f"scheduler.{key}", f"expected a number, got {sched[key]!r}")
    lrs = meta["lr"]
    groups = state.optimizer.param_groups
    if not isinstance(lrs, list) or len(lrs) != len(groups):
        raise bad("lr", f"expected a list of {len(groups)} learning rate(s), got {lrs!r}")
    for i, v in enumerate(lrs):
        if not (_is_num(v) and v >= 0):
            raise bad(f"lr[{i}]", f"expected a finite number >= 0, got {v!r}")
    hp = meta.get("hyperparameters")
    if hp is not None:
        want = {"lr", "betas", "eps", "weight_decay", "gradient_accumulation_steps", "scheduler"}
        if not isinstance(hp, dict) or hp.keys() != want:
            raise bad("hyperparameters", f"expected keys {sorted(want)}, got {hp!r}")
        for key in ("lr", "eps", "weight_decay"):
            if not (_is_num(hp[key]) and hp[key] >= 0):
                raise bad(f"hyperparameters.{key}", f"expected a finite number >= 0, got {hp[key]!r}")
        if not (isinstance(hp["betas"], list) and len(hp["betas"]) == 2 and all(_is_num(b) for b in hp["betas"])):
            raise bad("hyperparameters.betas", f"expected two numbers, got {hp['betas']!r}")
        if not _is_int(hp["gradient_accumulation_steps"], 1):
            raise bad("hyperparameters.gradient_accumulation_steps",
                      f"expected an integer >= 1, got {hp['gradient_accumulation_steps']!r}")
        sc = hp["scheduler"]
        if sc is not None and not (isinstance(sc, dict) and sc.keys() == {"type", "params"}):
            raise bad("hyperparameters.scheduler", f"expected null or {{type, params}}, got {sc!r}")
    if not isinstance(meta["client_state"], dict):
        raise bad("client_state", f"expected an object, got {type(meta['client_state']).__name__}")
    return entries


def _load_rng(path: str, data: bytes) -> dict:
    """rng.pt's states, checked (a CPU generator accepts them) without touching the process's RNG."""
    where = f"checkpoint {path!r}: rng.pt"
    try:
        rng = torch.load(_io.BytesIO(data), weights_only=True)
    except Exception as exc:  # noqa: BLE001 - any unpickling error means a torn or changed file
        raise CheckpointError(f"{where}: torn or changed ({exc})") from exc
    if not isinstance(rng, dict) or set(rng) != {"cpu", "cuda"}:
        raise CheckpointError(f"{where}: expected {{'cpu', 'cuda'}} RNG states, got {type(rng).__name__}")
    cpu = rng["cpu"]
    ref = torch.get_rng_state()
    if not (isinstance(cpu, torch.Tensor) and cpu.dtype == torch.uint8 and cpu.shape == ref.shape):
        raise CheckpointError(f"{where}: cpu: expected a uint8 tensor of {ref.numel()} bytes")
    try:
        torch.Generator().set_state(cpu)
    except RuntimeError as exc:
        raise CheckpointError(f"{where}: cpu: not a valid CPU RNG state ({exc})") from exc
    cuda = rng["cuda"]
    if cuda is not None and not (isinstance(cuda, list) and all(
            isinstance(t, torch.Tensor) and t.dtype == torch.uint8 for t in cuda)):
        raise CheckpointError(f"{where}: cuda: expected null or a list of uint8 tensors")
    if cuda is not None and torch.cuda.is_available() and len(cuda) != torch.cuda.device_count():
        raise CheckpointError(f"{where}: cuda: {len(cuda)} device states, this process has "
                              f"{torch.cuda.device_count()} devices")
    return rng


def _crc32c(t: torch.Tensor) -> int:
    from pyinfinity import _C

    return int(_C.crc32c(t.reshape(-1).view(torch.uint8).numpy()))


def _copy_crc(dst: torch.Tensor, src: torch.Tensor, threads: int = 1) -> int:
    """Copies ``src``'s bytes into ``dst`` (uint8, as many bytes; both contiguous host tensors) on
    ``threads`` threads of the core's own (no GIL, no torch intra-op pool), each 1 MiB piece's
    CRC-32C taken right after its copy, while it is in cache; returns the CRC-32C of them all
    (the pieces' combined). One read of ``src`` and one write of ``dst``."""
    from pyinfinity import _C

    if not src.is_contiguous():
        src = src.contiguous()
    n = dst.numel()
    if dst.dtype != torch.uint8 or src.device.type != "cpu" or src.numel() * src.element_size() != n:
        raise ValueError(f"checkpoint staging: cannot copy {src.numel()} {src.dtype} elements on {src.device} into "
                         f"{n} bytes")
    return int(_C.copy_crc32c(dst.numpy(), src.reshape(-1).view(torch.uint8).numpy(), threads))


def _crc32c_bytes(data: bytes) -> int:
    import numpy as np

    from pyinfinity import _C

    return int(_C.crc32c(np.frombuffer(data, dtype=np.uint8)))


def _check_entry(path: str, entry: dict, buf: torch.Tensor) -> None:
    """A checkpoint entry read back must have the CRC-32C it was saved with (older ones have none)."""
    want = entry.get("crc32c")
    if want is not None and _crc32c(buf) != want:
        raise CheckpointError(f"checkpoint {path!r}: state.bin bytes [{entry['offset']}, {entry['offset'] + entry['nbytes']})"
                         f" (shard {entry['shard']}, {entry['kind']}) fail their checksum (torn or changed on disk); "
                         "the engine's state is now partly loaded: load another checkpoint before training")
