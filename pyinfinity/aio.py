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
  O_DIRECT); all I/O runs in the C++ engine with the GIL released;
* every I/O method takes an open descriptor by keyword ``fd`` (DeepSpeed: ``async_pwrite`` only)
  and a path of any ``os.PathLike``.

Page-locked tensors live in one process-wide registry, :data:`LOCKED_TENSORS`, shared by every
handle and by :class:`PinHandle` (DeepSpeed's ``pin_memory`` op): ``is_pinned`` on any recognises
tensors from all of them; ``free_cpu_locked_tensor`` returns False for a tensor it did not
allocate, as DeepSpeed's.

``single_submit`` and ``overlap_events`` are accepted and reported by the getters; the engine
always keeps ``queue_depth`` requests in flight, which is what ``overlap_events`` asks for.
"""
from __future__ import annotations

import logging
import os
import threading
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Union

import torch

from pyinfinity import _C
from pyinfinity.swap.arena import PinnedArena, Slab
from pyinfinity.swap.engine import SwapEngine

log = logging.getLogger(__name__)

O_DIRECT_ALIGNMENT = 512  # DeepSpeed's constant, for get_alignment()



@dataclass
class _Locked:
    """One page-locked allocation: the arena that owns it, the slab, its size."""
    arena: PinnedArena
    slab: Slab
    nbytes: int


class LockedTensorRegistry:
    """The process-wide page-locked CPU tensors, as DeepSpeed's one ``deepspeed_pin_tensor_t``
    manager: every ``AioHandle`` and every pin handle allocates, recognises and frees through the
    same registry, so a tensor from one ``is_pinned()`` on all and can be freed through any."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._by_base: Dict[int, _Locked] = {}  # base address -> allocation

    def alloc(self, num_elem: int, dtype: torch.dtype) -> torch.Tensor:
        """A page-locked tensor of ``num_elem`` elements (CUDA-registered when a GPU is present,
        else mlocked), from pyinfinity's PinnedArena."""
        num_elem = _positive_int("num_elem", num_elem)
        nbytes = num_elem * torch.empty((), dtype=dtype).element_size()
        arena = PinnedArena(nbytes)
        slab = arena.allocate(nbytes)
        t = slab.tensor(dtype, (num_elem,))
        with self._lock:
            self._by_base[t.data_ptr()] = _Locked(arena, slab, nbytes)
        return t

    def free(self, tensor: torch.Tensor) -> bool:
        """Frees the allocation that starts at ``tensor``'s first byte; False (and nothing freed)
        for any other tensor, as DeepSpeed's manager does."""
        return self.free_by_ptr(tensor.data_ptr())

    def free_by_ptr(self, address: int) -> bool:
        """Frees the allocation whose base address is ``address``; False when there is none."""
        with self._lock:
            entry = self._by_base.pop(int(address), None)
        if entry is None:
            return False
        entry.slab.free()
        return True

    def is_managed(self, buffer: torch.Tensor) -> bool:
        """True when ``buffer``'s bytes lie wholly inside one locked allocation (views count)."""
        if buffer.device.type != "cpu":
            return False
        start = buffer.data_ptr()
        end = start + buffer.numel() * buffer.element_size()
        with self._lock:
            return any(base <= start and end <= base + e.nbytes for base, e in self._by_base.items())

    def __len__(self) -> int:
        with self._lock:
            return len(self._by_base)


#: The one registry of the process (DeepSpeed's ``deepspeed_pin_tensor_t::shared()``).
LOCKED_TENSORS = LockedTensorRegistry()


def is_pinned(buffer: torch.Tensor) -> bool:
    """DeepSpeed's test: torch-pinned, or inside a tensor of :data:`LOCKED_TENSORS`."""
    if buffer.device.type != "cpu":
        return False
    return buffer.is_pinned() or LOCKED_TENSORS.is_managed(buffer)


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


Target = Union[str, os.PathLike, int, None]
_REQUIRED: Any = object()  # marks an argument DeepSpeed's binding requires


def _required_flags(method: str, validate: Any, async_op: Any, kw: Dict[str, Any]) -> tuple:
    """(validate, async) of pread/pwrite: both required, ``async`` by keyword as in DeepSpeed."""
    if "async" in kw:
        if async_op is not _REQUIRED:
            raise TypeError(f"{method}: got `async` twice (as async_op and async)")
        async_op = kw.pop("async")
    if kw:
        raise TypeError(f"{method}: unexpected keyword arguments {sorted(kw)}")
    missing = [n for n, v in (("validate", validate), ("async", async_op)) if v is _REQUIRED]
    if missing:
        raise TypeError(f"{method}: missing required arguments {missing} (DeepSpeed's signature is "
                        f"{method}(buffer, filename, validate, async, file_offset=0))")
    return bool(validate), bool(async_op)


def _one_of(method: str, **named: Optional[torch.Tensor]) -> torch.Tensor:
    given = [(k, v) for k, v in named.items() if v is not None]
    if len(given) != 1:
        raise TypeError(f"{method}: pass exactly one of {sorted(named)}, got {[k for k, _ in given] or 'none'}")
    if not isinstance(given[0][1], torch.Tensor):
        raise TypeError(f"{method}: {given[0][0]}: expected a torch.Tensor, got {type(given[0][1]).__name__}")
    return given[0][1]


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
    # DeepSpeed binds `filename` as a path (and, for async_pwrite, a second overload taking an open
    # descriptor by keyword `fd`); here every I/O method takes either, by position or keyword.
    @staticmethod
    def _target(method: str, filename: Target, fd: Optional[int]) -> Target:
        if fd is not None and filename is not None:
            raise TypeError(f"{method}: pass a path as `filename` or an open descriptor as `fd`, not both")
        if fd is None and filename is None:
            raise TypeError(f"{method}: missing the file: pass `filename` (a path) or `fd` (an open descriptor)")
        if fd is not None and (isinstance(fd, bool) or not isinstance(fd, int)):
            raise TypeError(f"{method}: fd: expected an int, got {type(fd).__name__}")
        return filename if fd is None else fd

    def async_pread(self, buffer: torch.Tensor, filename: Target = None, file_offset: int = 0, *,
                    fd: Optional[int] = None) -> int:
        """Starts a read; 0 now, and ``wait()`` counts it."""
        self._submit(buffer, self._target("async_pread", filename, fd), False, file_offset, False)
        return 0

    def async_pwrite(self, buffer: torch.Tensor, filename: Target = None, file_offset: int = 0, *,
                     fd: Optional[int] = None) -> int:
        """Starts a write to a path or an open descriptor (``fd=``, DeepSpeed's second overload)."""
        self._submit(buffer, self._target("async_pwrite", filename, fd), True, file_offset, False)
        return 0

    def sync_pread(self, buffer: torch.Tensor, filename: Target = None, file_offset: int = 0, *,
                   fd: Optional[int] = None) -> int:
        """Reads and waits; returns the number of operations completed (this one and any pending)."""
        self._submit(buffer, self._target("sync_pread", filename, fd), False, file_offset, False)
        return self._sync()

    def sync_pwrite(self, buffer: torch.Tensor, filename: Target = None, file_offset: int = 0, *,
                    fd: Optional[int] = None) -> int:
        """Writes and waits; returns the number of operations completed (this one and any pending)."""
        self._submit(buffer, self._target("sync_pwrite", filename, fd), True, file_offset, False)
        return self._sync()

    def pread(self, buffer: torch.Tensor, filename: Target = None, validate: Any = _REQUIRED,
              async_op: Any = _REQUIRED, file_offset: int = 0, *, fd: Optional[int] = None, **kw: Any) -> int:
        """DeepSpeed's ``pread(buffer, filename, validate, async, file_offset=0)``: ``validate``
        and ``async`` are required (by position, or by keyword ``async``/``async_op``); 0 when
        asynchronous, else the number of operations completed."""
        validate, async_op = _required_flags("pread", validate, async_op, kw)
        self._submit(buffer, self._target("pread", filename, fd), False, file_offset, validate)
        return 0 if async_op else self._sync()

    def pwrite(self, buffer: torch.Tensor, filename: Target = None, validate: Any = _REQUIRED,
               async_op: Any = _REQUIRED, file_offset: int = 0, *, fd: Optional[int] = None, **kw: Any) -> int:
        """DeepSpeed's ``pwrite(buffer, filename, validate, async, file_offset=0)`` (see pread)."""
        validate, async_op = _required_flags("pwrite", validate, async_op, kw)
        self._submit(buffer, self._target("pwrite", filename, fd), True, file_offset, validate)
        return 0 if async_op else self._sync()

    def read(self, buffer: torch.Tensor, filename: Target = None, validate: Any = _REQUIRED,
             file_offset: int = 0, *, fd: Optional[int] = None) -> int:
        """Synchronous read; returns 0 like DeepSpeed's (which also printed timings)."""
        if validate is _REQUIRED:
            raise TypeError("read: missing required argument 'validate'")
        self._submit(buffer, self._target("read", filename, fd), False, file_offset, bool(validate))
        self._sync()
        return 0

    def write(self, buffer: torch.Tensor, filename: Target = None, validate: Any = _REQUIRED,
              file_offset: int = 0, *, fd: Optional[int] = None) -> int:
        """Synchronous write; returns 0 like DeepSpeed's."""
        if validate is _REQUIRED:
            raise TypeError("write: missing required argument 'validate'")
        self._submit(buffer, self._target("write", filename, fd), True, file_offset, bool(validate))
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

    # -- pinned memory (the process-wide LOCKED_TENSORS, shared with the pin_memory op) -------
    def new_cpu_locked_tensor(self, num_elem: int, example_tenosr: Optional[torch.Tensor] = None, *,
                              example_tensor: Optional[torch.Tensor] = None) -> torch.Tensor:
        """A page-locked CPU tensor of ``num_elem`` elements of the example's dtype. DeepSpeed's
        keyword is ``example_tenosr`` (sic); ``example_tensor`` is accepted too."""
        example = _one_of("new_cpu_locked_tensor", example_tenosr=example_tenosr, example_tensor=example_tensor)
        return LOCKED_TENSORS.alloc(num_elem, example.dtype)

    def free_cpu_locked_tensor(self, tensor: torch.Tensor) -> bool:
        """Frees a tensor from any handle's (or the pin op's) new_cpu_locked_tensor: True; False
        for any other tensor or a second free, as DeepSpeed."""
        return LOCKED_TENSORS.free(tensor)

    def is_pinned(self, buffer: torch.Tensor) -> bool:
        """True for torch-pinned tensors and tensors lying wholly inside a locked buffer."""
        return is_pinned(buffer)


class PinHandle:
    """DeepSpeed's ``pin_memory`` op handle (``PinMemoryBuilder().load().pin_handle``), on
    :data:`LOCKED_TENSORS`: what it allocates every ``AioHandle`` recognises, and back."""

    def new_cpu_locked_tensor(self, num_elem: int, example_tensor: torch.Tensor) -> torch.Tensor:
        """A page-locked CPU tensor of ``num_elem`` elements of ``example_tensor``'s dtype."""
        return LOCKED_TENSORS.alloc(num_elem, example_tensor.dtype)

    def free_cpu_locked_tensor(self, locked_tensor: torch.Tensor) -> bool:
        """True when freed; False for a tensor not allocated here (or freed already)."""
        return LOCKED_TENSORS.free(locked_tensor)

    def free_cpu_locked_tensor_by_ptr(self, address: int) -> bool:
        """Frees by allocation base address (the tensor's storage may have been redirected)."""
        return LOCKED_TENSORS.free_by_ptr(address)

    def is_pinned(self, buffer: torch.Tensor) -> bool:
        """Torch-pinned, or inside a locked tensor of any handle."""
        return is_pinned(buffer)
