"""SwapSpace: one logical swap area made of preallocated files, striped over directories.

Each directory (ideally one per NVMe drive) holds one swap file ``<name>.swp``, locked with
``flock`` for the life of the space so two runs cannot share it. A slot of n bytes is cut into
one extent per directory, so a read or write of the slot keeps every drive busy. Files grow in
``grow_bytes`` steps with ``fallocate``, so a full disk surfaces as ``OSError(ENOSPC)`` at
``allocate()``, not halfway through a training step.

A checkpoint may hold slots by reference (``freeze``): it links the swap files (a hard link in
its own folder keeps their blocks when the swap name goes) and records where the slot's bytes
are. A write to a frozen slot goes to a fresh slot instead (``writable``: copy-on-write; the
caller keeps the slot it is handed); the frozen one stays allocated until no checkpoint refers to
it (``release_refs``). At close, a file other checkpoints link keeps only their slots' blocks:
every other range is punched out (``FALLOC_FL_PUNCH_HOLE``).
"""
from __future__ import annotations

import bisect
import ctypes
import ctypes.util
import errno
import fcntl
import logging
import os
import threading
from dataclasses import dataclass
from typing import Callable, List, Optional, Sequence, Tuple, Union

import torch

from pyinfinity import _C
from pyinfinity.swap.checks import check_tensor, nbytes as tensor_nbytes
from pyinfinity.swap.engine import SwapEngine

log = logging.getLogger(__name__)

ALIGN = 4096
FALLOC_FL_KEEP_SIZE, FALLOC_FL_PUNCH_HOLE = 0x01, 0x02
_libc = None


def punch_hole(fd: int, offset: int, nbytes: int) -> bool:
    """Gives the blocks of ``[offset, offset + nbytes)`` back to the filesystem (the file's size
    stays, the range reads as zeros); False where the filesystem cannot."""
    global _libc
    if nbytes <= 0:
        return True
    if _libc is None:
        _libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        _libc.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]
    if _libc.fallocate(fd, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, offset, nbytes) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EOPNOTSUPP, errno.ENOSYS):
        return False
    raise OSError(err, f"punching out bytes [{offset}, {offset + nbytes}): {os.strerror(err)}")


def _round_up(n: int, a: int = ALIGN) -> int:
    return (n + a - 1) // a * a


@dataclass(frozen=True)
class Extent:
    file: int     # index of the directory / file
    offset: int   # byte offset in that file
    nbytes: int   # bytes of the slot stored there
    reserved: int  # bytes reserved (aligned)


@dataclass(frozen=True)
class Slot:
    """A range of the swap space: `nbytes` bytes stored as extents over the files."""
    id: int
    nbytes: int
    extents: Tuple[Extent, ...]
    tag: str = ""  # what the slot holds (e.g. a parameter's name), for error messages


class _Allocator:
    """First-fit free list over one file's address space, coalescing on free."""

    def __init__(self) -> None:
        self.starts: List[int] = []  # sorted hole starts
        self.sizes: dict = {}        # start -> size
        self.end = 0                 # bytes handed out so far (high water of the file)

    def take(self, n: int) -> Optional[int]:
        for s in self.starts:
            if self.sizes[s] >= n:
                left = self.sizes.pop(s)
                self.starts.remove(s)
                if left > n:
                    self._insert(s + n, left - n)
                return s
        return None

    def grow(self, n: int) -> int:
        off = self.end
        self.end += n
        return off

    def give(self, off: int, n: int) -> None:
        i = bisect.bisect_left(self.starts, off)
        if i < len(self.starts) and self.starts[i] < off + n or (
                i > 0 and self.starts[i - 1] + self.sizes[self.starts[i - 1]] > off):
            raise ValueError(f"slot: double free of bytes [{off}, {off + n})")
        # coalesce with neighbours
        if i < len(self.starts) and self.starts[i] == off + n:
            n += self.sizes.pop(self.starts.pop(i))
        if i > 0 and self.starts[i - 1] + self.sizes[self.starts[i - 1]] == off:
            prev = self.starts[i - 1]
            self.sizes[prev] += n
            return
        self._insert(off, n)

    def _insert(self, off: int, n: int) -> None:
        bisect.insort(self.starts, off)
        self.sizes[off] = n


class _MultiRequest:
    """Several requests (one per extent) behaving as one; `on_done` runs after a clean wait."""

    def __init__(self, reqs: Sequence[_C.Request], slot: Slot, on_done=None) -> None:
        self._reqs = list(reqs)
        self._slot = slot
        self._on_done = on_done

    def done(self) -> bool:
        return all(r.done() for r in self._reqs)

    def wait(self, timeout: Optional[float] = None) -> None:
        err = None
        for r in self._reqs:  # wait for all, even after a failure, so no buffer is still in use
            try:
                r.wait(timeout)
            except OSError as exc:
                if err is None:
                    what = f" (slot {self._slot.id}{', ' + repr(self._slot.tag) if self._slot.tag else ''})"
                    err = OSError(exc.errno, (exc.strerror or str(exc)) + what, exc.filename)
            except BaseException as exc:  # noqa: BLE001 - re-raised below
                err = err or exc
        if err is not None:
            raise err
        if self._on_done is not None:
            self._on_done(self._reqs)
            self._on_done = None

    @property
    def nbytes(self) -> int:
        return sum(r.nbytes for r in self._reqs)


class SwapSpace:
    """Slots in preallocated swap files striped over `dirs`.

    dirs: a directory or a list of them (one per drive); each must exist and be writable.
    engine: the SwapEngine doing the I/O (one is made with defaults when None).
    name: file stem, so several spaces can share directories (``<dir>/<name>.swp``).
    capacity: most bytes the space may hold in all (None: as much as the disks have).
    grow_bytes: preallocation step per file.
    stripe_min: slots smaller than this go to one file (round-robin) instead of being striped.
    checksums: record a CRC-32C per 64 KiB of every write (computed in the I/O thread) and verify
    reads against it; a changed swap file then raises OSError(EBADMSG) naming file, offset and
    slot tag instead of returning wrong data.
    record_checksums: record them without verifying reads (what a checkpoint holding a slot by
    reference records, ``checksums_of``).
    """

    def __init__(self, dirs: Union[str, os.PathLike, Sequence[Union[str, os.PathLike]]],
                 engine: Optional[SwapEngine] = None, name: str = "swap",
                 capacity: Optional[int] = None, grow_bytes: int = 256 << 20,
                 stripe_min: int = 4 << 20, remove_on_close: bool = True, checksums: bool = False,
                 record_checksums: bool = False) -> None:
        if isinstance(dirs, (str, os.PathLike)):
            dirs = [dirs]
        dirs = [os.fspath(d) for d in dirs]
        if not dirs:
            raise ValueError("dirs: at least one directory is needed")
        if not name or "/" in name:
            raise ValueError(f"name: must be a non-empty file stem without '/', got {name!r}")
        if capacity is not None and capacity <= 0:
            raise ValueError(f"capacity: must be > 0 or None, got {capacity}")
        self.engine = engine if engine is not None else SwapEngine()
        self.name = name
        self.capacity = capacity
        self.grow_bytes = _round_up(max(grow_bytes, ALIGN))
        self.stripe_min = stripe_min
        self.remove_on_close = remove_on_close
        self.checksums = checksums
        self.record_checksums = checksums or record_checksums
        self._crcs: dict = {}  # slot id -> list (per extent) of CRC lists, after a checksummed write
        self._refs: dict = {}  # frozen slot id -> the references (checkpoints) holding it
        self._retired: set = set()  # frozen slots a write moved away from: freed with their last reference
        self._lock = threading.Lock()
        self._warned_deleted: set = set()
        self._files: List[_C.FileHandle] = []
        self._lock_fds: List[int] = []
        self._alloc = [_Allocator() for _ in dirs]
        self._allocated = [0] * len(dirs)  # bytes preallocated per file
        self._slots: dict = {}
        self._next_id = 0
        self._rr = 0
        self._used = 0
        self.paths: List[str] = []
        try:
            for d in dirs:
                self._open(d)
        except BaseException:
            self.close()
            raise

    def _open(self, d: str) -> None:
        if not os.path.exists(d):
            raise FileNotFoundError(errno.ENOENT, "swap directory does not exist", d)
        if not os.path.isdir(d):
            raise NotADirectoryError(errno.ENOTDIR, "swap path is not a directory", d)
        path = os.path.join(d, f"{self.name}.swp")
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise OSError(errno.EBUSY, "swap file is in use by another SwapSpace (another run pointed at the "
                          "same directory?); use another directory or name", path) from None
        if os.fstat(fd).st_nlink > 1:  # a checkpoint links it: a fresh file, the old blocks stay theirs
            os.unlink(path)
            os.close(fd)
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        self._lock_fds.append(fd)
        os.ftruncate(fd, 0)  # contents of a previous run are never data for this one
        self._files.append(_C.FileHandle(path, "rw"))
        self.paths.append(path)

    # -- slots -------------------------------------------------------------------------------
    def allocate(self, nbytes: int, tag: str = "") -> Slot:
        """Reserves `nbytes` (> 0); OSError(ENOSPC) when the disks or `capacity` cannot hold it.
        `tag` names the contents in error messages."""
        if isinstance(nbytes, bool) or not isinstance(nbytes, int):
            raise TypeError(f"nbytes: expected an int, got {type(nbytes).__name__}")
        if nbytes <= 0:
            raise ValueError(f"nbytes: must be > 0, got {nbytes}")
        with self._lock:
            self._check_open()
            self._check_files()
            nf = len(self._files)
            if nf == 1 or nbytes < self.stripe_min:
                order = [self._rr % nf]
                self._rr += 1
                parts = [nbytes]
            else:
                order = list(range(nf))
                per = _round_up(-(-nbytes // nf))
                parts = []
                left = nbytes
                for _ in order:
                    parts.append(min(per, left))
                    left -= parts[-1]
                order = [f for f, p in zip(order, parts) if p > 0]
                parts = [p for p in parts if p > 0]
            reserve = sum(_round_up(p) for p in parts)
            if self.capacity is not None and self._used + reserve > self.capacity:
                raise OSError(errno.ENOSPC, f"swap space '{self.name}' is full: {self._used} of {self.capacity} "
                              f"bytes used, {reserve} more asked", self.paths[0])
            extents = []
            try:
                for f, p in zip(order, parts):
                    r = _round_up(p)
                    off = self._alloc[f].take(r)
                    if off is None:
                        off = self._alloc[f].grow(r)
                        self._ensure(f, self._alloc[f].end)
                    extents.append(Extent(f, off, p, r))
            except BaseException:
                for e in extents:
                    self._alloc[e.file].give(e.offset, e.reserved)
                raise
            self._used += reserve
            slot = Slot(self._next_id, nbytes, tuple(extents), tag)
            self._next_id += 1
            self._slots[slot.id] = slot
            return slot

    def _check_files(self) -> None:
        """Warns once per file when it was deleted under the space (the open descriptor still
        holds the data, so nothing is lost, but nothing survives this process either)."""
        for i, fd in enumerate(self._lock_fds):
            if i not in self._warned_deleted and os.fstat(fd).st_nlink == 0:
                self._warned_deleted.add(i)
                log.warning("swap file %s was deleted while in use (directory removed?); its data stays "
                            "readable through the open file until this space is closed", self.paths[i])

    def _ensure(self, f: int, end: int) -> None:
        if end <= self._allocated[f]:
            return
        target = _round_up(end, self.grow_bytes)
        try:
            self._files[f].allocate(target)
        except OSError as exc:
            # undo the logical growth, then say how much was missing
            self._alloc[f].end = min(self._alloc[f].end, self._allocated[f])
            st = os.statvfs(os.path.dirname(self.paths[f]))
            free = st.f_bavail * st.f_frsize
            raise OSError(exc.errno, f"cannot grow swap file to {target} bytes ({free} bytes free on that "
                          f"filesystem): {exc.strerror}", self.paths[f]) from exc
        self._allocated[f] = target

    def free(self, slot: Slot) -> None:
        """Returns a slot's bytes; ValueError when it was already freed or is not from this space.
        A slot a checkpoint holds (``freeze``) stays allocated until its last reference goes."""
        with self._lock:
            if slot.id in self._refs:
                self._retired.add(slot.id)
                return
            self._free_locked(slot)

    def _free_locked(self, slot: Slot) -> None:
        if self._slots.pop(slot.id, None) is None:
            raise ValueError(f"slot: {slot.id} is not allocated in swap space '{self.name}' (double free?)")
        self._crcs.pop(slot.id, None)
        for e in slot.extents:
            self._alloc[e.file].give(e.offset, e.reserved)
            self._used -= e.reserved

    # -- references (checkpoints holding slots) ----------------------------------------------
    def freeze(self, slot: Slot, ref: object) -> None:
        """``ref`` (a checkpoint) holds the slot's current bytes: they are never written again (a
        write goes to a fresh slot, ``writable``) nor freed until ``release_refs`` drops ``ref``."""
        with self._lock:
            if self._slots.get(slot.id) is not slot:
                raise ValueError(f"slot: {slot.id} is not allocated in swap space '{self.name}'")
            self._refs.setdefault(slot.id, set()).add(ref)

    def frozen(self, slot: Slot) -> bool:
        with self._lock:
            return slot.id in self._refs

    def writable(self, slot: Slot) -> Slot:
        """The slot a write of ``slot``'s next contents goes to: ``slot`` itself, or when a
        checkpoint holds it, a fresh one of the same size (the frozen one is retired: kept for its
        references, freed with the last); OSError(ENOSPC) when the disks cannot hold it."""
        if not self.frozen(slot):
            return slot
        fresh = self.allocate(slot.nbytes, slot.tag)
        with self._lock:
            if slot.id in self._refs:
                self._retired.add(slot.id)
            else:  # released meanwhile
                self._free_locked(slot)
        return fresh

    def release_refs(self, keep: Callable[[object], bool]) -> int:
        """Drops every reference ``keep`` says is gone (a checkpoint removed or rotated away); a
        retired slot whose last reference went is freed. Returns the bytes freed."""
        freed = 0
        with self._lock:
            for sid in list(self._refs):
                self._refs[sid] = {r for r in self._refs[sid] if keep(r)}
                if self._refs[sid]:
                    continue
                del self._refs[sid]
                if sid in self._retired:
                    self._retired.discard(sid)
                    slot = self._slots[sid]
                    freed += sum(e.reserved for e in slot.extents)
                    self._free_locked(slot)
        return freed

    def references(self) -> set:
        """Every reference holding a slot of this space."""
        with self._lock:
            return set().union(*self._refs.values()) if self._refs else set()

    def checksums_of(self, slot: Slot) -> Optional[list]:
        """The CRC-32Cs (a list per extent, one per 64 KiB) its last completed write recorded, None
        when there are none (``record_checksums`` off, or no write completed)."""
        with self._lock:
            crcs = self._crcs.get(slot.id)
            return [list(c) for c in crcs] if crcs is not None else None

    def free_bytes(self) -> int:
        """Bytes preallocated in the files and not handed out (a fresh slot takes these first)."""
        with self._lock:
            return sum(self._allocated) - self._used

    # -- I/O ---------------------------------------------------------------------------------
    def _io(self, tensor: torch.Tensor, slot: Slot, write: bool) -> _MultiRequest:
        self._check_open()
        check_tensor(tensor)
        if self._slots.get(slot.id) is not slot:
            raise ValueError(f"slot: {slot.id} is not allocated in swap space '{self.name}'")
        n = tensor_nbytes(tensor)
        if n != slot.nbytes:
            raise ValueError(f"tensor: has {n} bytes, slot {slot.id} holds {slot.nbytes}")
        reqs = []
        pos = 0
        expected = self._crcs.get(slot.id) if (self.checksums and not write) else None
        if write and slot.id in self._refs:
            raise ValueError(f"slot: {slot.id} is held by a checkpoint; write to space.writable(slot)")
        if self.record_checksums and write:
            self._crcs.pop(slot.id, None)  # stale until this write completes
        for i, e in enumerate(slot.extents):
            reqs.append(self.engine.submit(tensor, self._files[e.file], e.offset, write, e.nbytes, pos,
                                           checksum=self.record_checksums and write,
                                           expected_checksums=expected[i] if expected else None,
                                           pad_tail=write))  # extents own their page-rounded reservation
            pos += e.nbytes
        on_done = None
        if self.record_checksums and write:
            def on_done(done, sid=slot.id):
                self._crcs[sid] = [r.checksums() for r in done]
        return _MultiRequest(reqs, slot, on_done)

    def write(self, tensor: torch.Tensor, slot: Slot) -> _MultiRequest:
        """Writes the tensor's bytes into the slot (sizes must match)."""
        return self._io(tensor, slot, True)

    def read(self, tensor: torch.Tensor, slot: Slot) -> _MultiRequest:
        """Reads the slot into the tensor (sizes must match)."""
        return self._io(tensor, slot, False)

    # -- life --------------------------------------------------------------------------------
    def stats(self) -> dict:
        with self._lock:
            return {"files": list(self.paths), "used": self._used, "slots": len(self._slots),
                    "preallocated": sum(self._allocated)}

    def _check_open(self) -> None:
        if not self._files and not self.paths:
            raise ValueError(f"swap space '{self.name}': used after close()")

    def close(self) -> None:
        """Closes (and by default removes) the swap files. Idempotent. A file a checkpoint links
        keeps only the blocks of the slots checkpoints hold: the rest is punched out first."""
        with self._lock:
            if self.remove_on_close and self._refs:
                self._punch_unreferenced()
            for fh in self._files:
                if not fh.closed:
                    fh.close()
            for fd in self._lock_fds:
                os.close(fd)
            if self.remove_on_close:
                for p in self.paths:
                    try:
                        os.unlink(p)
                    except FileNotFoundError:
                        pass
            self._files, self._lock_fds, self.paths = [], [], []
            self._slots.clear()

    def _punch_unreferenced(self) -> None:
        held: list = [[] for _ in self._lock_fds]
        for sid in self._refs:
            for e in self._slots[sid].extents:
                held[e.file].append((e.offset, e.offset + e.reserved))
        for f, fd in enumerate(self._lock_fds):
            pos = 0
            try:
                for a, b in sorted(held[f]) + [(self._allocated[f], self._allocated[f])]:
                    if a > pos and not punch_hole(fd, pos, a - pos):
                        break
                    pos = max(pos, b)
            except OSError as exc:
                log.warning("swap file %s: the ranges no checkpoint holds were not given back (%s); the "
                            "checkpoints linking it keep the whole file", self.paths[f], exc)

    def __enter__(self) -> "SwapSpace":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass
