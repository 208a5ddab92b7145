"""AioHandle: DeepSpeed's ``aio_handle`` API (deepspeed 0.19) on pyinfinity's C++ engine.

Same constructor, methods and return conventions as DeepSpeed's handle — ``sync_*`` return 1,
``async_*`` return 0, ``wait()`` returns the number of operations it completed — with these
differences, all in the caller's favour:

* failures raise (``OSError`` with errno and path, at the call or at ``wait()``) instead of
  returning -1, printing, or aborting the process;
* any size and offset works (DeepSpeed needs sizes divisible by ``intra_op_parallelism`` and
  silently wrote empty files for sizes that were not 512-byte multiples);
* buffers may be pinned or pageable CPU tensors of any alignment, or CUDA tensors (staged through
  pinned memory, as DeepSpeed does);
* each file gets the backend that works on its filesystem (``posix`` on tmpfs, which has no
  O_DIRECT); all I/O runs in the C++ engine with the GIL released.

``single_submit`` and ``overlap_events`` are accepted and reported by the getters; the engine
always keeps ``queue_depth`` requests in flight, which is what ``overlap_events`` asks for.
"""
from __future__ import annotations

import logging
import os
import threading
from dataclasses import dataclass
from typing import List, Optional, Union

import torch

from pyinfinity import _C
from pyinfinity.swap.arena import PinnedArena, Slab
from pyinfinity.swap.engine import SwapEngine

log = logging.getLogger(__name__)

O_DIRECT_ALIGNMENT = 512  # DeepSpeed's constant, for get_alignment()

# Locked buffers are process-wide, as in DeepSpeed (one pin manager per process): a tensor from
# any handle's new_cpu_locked_tensor is is_pinned() on every handle and can be freed through any.
# base address -> (arena, slab, nbytes)
_LOCKED: dict = {}
_LOCKED_LOCK = threading.Lock()


@dataclass
class _Pending:
    request: _C.Request
    device_tensor: Optional[torch.Tensor]  # CUDA destination of a staged read
    host: torch.Tensor                     # the CPU tensor the engine moved (pinned copy for CUDA)
    validate: Optional[tuple]              # (path, offset) to check after completion


def _positive_int(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name}: expected an int, got {type(value).__name__}")
    if value <= 0:
        raise ValueError(f"{name}: must be > 0, got {value}")
    return value


class AioHandle:
    """Drop-in for ``deepspeed.ops.op_builder.AsyncIOBuilder().load().aio_handle``."""

    def __init__(self, block_size: int = 1048576, queue_depth: int = 128, single_submit: bool = False,
                 overlap_events: bool = False, intra_op_parallelism: int = 1) -> None:
        self._block_size = _positive_int("block_size", block_size)
        self._queue_depth = _positive_int("queue_depth", queue_depth)
        self._threads = _positive_int("intra_op_parallelism", intra_op_parallelism)
        self._single_submit = bool(single_submit)
        self._overlap_events = bool(overlap_events)
        # The engine needs a block of at least one page; DeepSpeed accepts smaller (slow) blocks.
        self._engine = SwapEngine(backend=None, block_size=max(self._block_size, 4096),
                                  queue_depth=self._queue_depth, threads=self._threads)
        self._lock = threading.Lock()
        self._pending: List[_Pending] = []

    # -- getters (DeepSpeed names) -----------------------------------------------------------
    def get_block_size(self) -> int:
        return self._block_size

    def get_queue_depth(self) -> int:
        return self._queue_depth

    def get_single_submit(self) -> bool:
        return self._single_submit

    def get_overlap_events(self) -> bool:
        return self._overlap_events

    def get_intra_op_parallelism(self) -> int:
        return self._threads

    def get_alignment(self) -> int:
        return self._threads * O_DIRECT_ALIGNMENT

    @property
    def engine(self) -> SwapEngine:
        """The underlying SwapEngine (its stats() count every byte this handle moved)."""
        return self._engine

    # -- submission --------------------------------------------------------------------------
    @staticmethod
    def _file(target: Union[str, os.PathLike, int], write: bool) -> _C.FileHandle:
        if isinstance(target, bool):
            raise TypeError("filename: expected a path or a file descriptor, got bool")
        if isinstance(target, int):
            if target < 0:
                raise ValueError(f"fd: must be >= 0, got {target}")
            try:
                os.fstat(target)
            except OSError as exc:
                raise OSError(exc.errno, f"fd {target}: {exc.strerror}") from None
            # Reopen the descriptor's file (works for unlinked files too) with our own flags.
            return _C.FileHandle(f"/proc/self/fd/{target}", "rw" if write else "r")
        if not isinstance(target, (str, os.PathLike)):
            raise TypeError(f"filename: expected a path or a file descriptor, got {type(target).__name__}")
        return _C.FileHandle(os.fspath(target), "rw" if write else "r")

    def _submit(self, buffer: torch.Tensor, target, write: bool, file_offset: int, validate: bool) -> None:
        if not isinstance(buffer, torch.Tensor):
            raise TypeError(f"buffer: expected a torch.Tensor, got {type(buffer).__name__}")
        if buffer.device.type not in ("cpu", "cuda"):
            raise ValueError(f"buffer: must be on cpu or cuda, got {buffer.device}")
        if not buffer.is_contiguous():
            raise ValueError("buffer: must be contiguous")
        if buffer.numel() == 0:
            raise ValueError("buffer: zero-size tensor")
        if isinstance(file_offset, bool) or not isinstance(file_offset, int):
            raise TypeError(f"file_offset: expected an int, got {type(file_offset).__name__}")
        if file_offset < 0:
            raise ValueError(f"file_offset: must be >= 0, got {file_offset}")
        fh = self._file(target, write)
        host, device_tensor = buffer, None
        if buffer.device.type == "cuda":
            # Stage through pinned host memory, as DeepSpeed's handle does.
            host = torch.empty(buffer.numel(), dtype=buffer.dtype, pin_memory=True).view(buffer.shape)
            if write:
                host.copy_(buffer)
            else:
                device_tensor = buffer
        req = self._engine.submit(host, fh, file_offset, write)
        check = (fh.path, file_offset) if validate else None
        with self._lock:
            self._pending.append(_Pending(req, device_tensor, host, check))

    def _sync(self) -> int:
        return self.wait()

    # -- DeepSpeed API -----------------------------------------------------------------------
    def async_pread(self, buffer: torch.Tensor, filename, file_offset: int = 0) -> int:
        self._submit(buffer, filename, False, file_offset, False)
        return 0

    def async_pwrite(self, buffer: torch.Tensor, filename, file_offset: int = 0) -> int:
        """filename may be a path or an open file descriptor (int)."""
        self._submit(buffer, filename, True, file_offset, False)
        return 0

    def sync_pread(self, buffer: torch.Tensor, filename, file_offset: int = 0) -> int:
        self._submit(buffer, filename, False, file_offset, False)
        return self._sync()

    def sync_pwrite(self, buffer: torch.Tensor, filename, file_offset: int = 0) -> int:
        self._submit(buffer, filename, True, file_offset, False)
        return self._sync()

    def pread(self, buffer: torch.Tensor, filename, validate: bool, async_op: bool = False,
              file_offset: int = 0, **kw) -> int:
        async_op = kw.pop("async", async_op)
        if kw:
            raise TypeError(f"pread: unexpected arguments {sorted(kw)}")
        self._submit(buffer, filename, False, file_offset, validate)
        return 0 if async_op else self._sync()

    def pwrite(self, buffer: torch.Tensor, filename, validate: bool, async_op: bool = False,
               file_offset: int = 0, **kw) -> int:
        async_op = kw.pop("async", async_op)
        if kw:
            raise TypeError(f"pwrite: unexpected arguments {sorted(kw)}")
        self._submit(buffer, filename, True, file_offset, validate)
        return 0 if async_op else self._sync()

    def read(self, buffer: torch.Tensor, filename, validate: bool, file_offset: int = 0) -> int:
        """Synchronous read; returns 0 like DeepSpeed's (which also printed timings)."""
        self._submit(buffer, filename, False, file_offset, validate)
        self._sync()
        return 0

    def write(self, buffer: torch.Tensor, filename, validate: bool, file_offset: int = 0) -> int:
        """Synchronous write; returns 0 like DeepSpeed's."""
        self._submit(buffer, filename, True, file_offset, validate)
        self._sync()
        return 0

    def wait(self, timeout: Optional[float] = None) -> int:
        """Completes every pending operation; returns how many. Raises the first failure
        (OSError with errno and path) after all of them have finished. With nothing pending it
        returns 0 (DeepSpeed's release builds do the same)."""
        with self._lock:
            pending, self._pending = self._pending, []
        err: Optional[BaseException] = None
        for p in pending:
            try:
                p.request.wait(timeout)
                if p.device_tensor is not None:
                    p.device_tensor.copy_(p.host)
                if p.validate is not None:
                    self._validate(p)
            except BaseException as exc:  # noqa: BLE001 - re-raised after the others finish
                err = err or exc
        if err is not None:
            raise err
        return len(pending)

    @staticmethod
    def _validate(p: _Pending) -> None:
        path, offset = p.validate
        with open(path, "rb") as f:
            f.seek(offset)
            data = f.read(p.request.nbytes)
        if p.host.reshape(-1).view(torch.uint8).numpy().tobytes() != data:
            raise OSError(5, "validation failed: file bytes differ from the buffer", path)

    # -- pinned memory -----------------------------------------------------------------------
    def new_cpu_locked_tensor(self, num_elem: int, example_tensor: torch.Tensor) -> torch.Tensor:
        """A page-locked CPU tensor of `num_elem` elements of example_tensor's dtype, from
        pyinfinity's PinnedArena (CUDA-registered when a GPU is present, else mlocked)."""
        num_elem = _positive_int("num_elem", num_elem)
        dtype = example_tensor.dtype
        nbytes = num_elem * torch.empty((), dtype=dtype).element_size()
        arena = PinnedArena(nbytes)
        slab = arena.allocate(nbytes)
        t = slab.tensor(dtype, (num_elem,))
        with _LOCKED_LOCK:
            _LOCKED[t.data_ptr()] = (arena, slab, nbytes)
        return t

    def free_cpu_locked_tensor(self, tensor: torch.Tensor) -> bool:
        """Frees a tensor from any handle's new_cpu_locked_tensor; ValueError for any other
        tensor (or a second free)."""
        with _LOCKED_LOCK:
            entry = _LOCKED.pop(tensor.data_ptr(), None)
        if entry is None:
            raise ValueError("tensor: not allocated by new_cpu_locked_tensor (or freed twice)")
        entry[1].free()
        return True

    def is_pinned(self, buffer: torch.Tensor) -> bool:
        """True for torch-pinned tensors and tensors lying wholly inside a locked buffer."""
        if buffer.device.type != "cpu":
            return False
        if buffer.is_pinned():
            return True
        start = buffer.data_ptr()
        end = start + buffer.numel() * buffer.element_size()
        with _LOCKED_LOCK:
            return any(base <= start and end <= base + n for base, (_, _, n) in _LOCKED.items())
