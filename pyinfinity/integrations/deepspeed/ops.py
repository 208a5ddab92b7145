"""What DeepSpeed's ``async_io`` and ``pin_memory`` ops become once installed: :data:`aio_op`,
whose ``aio_handle`` is :class:`DeepSpeedAioHandle` (pyinfinity's ``AioHandle`` with I/O counters,
:func:`stats`), and :data:`pin_op`, whose ``pin_handle`` shares the process-wide page-locked
registry (``pyinfinity.aio.LOCKED_TENSORS``) with every ``aio_handle``, as DeepSpeed's two ops
share one ``deepspeed_pin_tensor_t``."""
from __future__ import annotations

import dataclasses
import os
import threading
import time
import types
from dataclasses import dataclass, field
from typing import Any, Dict, Optional, Set, Tuple

import torch

from pyinfinity.aio import AioHandle, PinHandle

OP_NAME = "async_io"
PIN_OP_NAME = "pin_memory"


# -- I/O counters ------------------------------------------------------------------------------------
@dataclass
class IoStats:
    """What DeepSpeed asked pyinfinity to do, counted at submission (failures raise at wait), and
    how long DeepSpeed's threads were blocked waiting for it: every ``wait()`` of a handle,
    including those inside ``sync_pread``/``sync_pwrite``/``pread``/``pwrite``/``read``/``write``
    and the module-level ``aio_read``/``aio_write``. A wait whose operations were all reads counts
    in ``read_wait_s``, all writes in ``write_wait_s``; a wait over both only in ``wait_s``."""
    handles: int = 0
    reads: int = 0
    writes: int = 0
    bytes_read: int = 0
    bytes_written: int = 0
    files_read: Set[str] = field(default_factory=set)
    files_written: Set[str] = field(default_factory=set)
    wait_calls: int = 0
    wait_s: float = 0.0
    read_wait_s: float = 0.0
    write_wait_s: float = 0.0

    def as_dict(self) -> Dict[str, Any]:
        d = dict(self.__dict__)
        d["files_read"] = sorted(self.files_read)
        d["files_written"] = sorted(self.files_written)
        return d


_stats = IoStats()
_stats_lock = threading.Lock()


def stats() -> IoStats:
    """A snapshot of the counters since the last :func:`reset_stats`."""
    with _stats_lock:
        return dataclasses.replace(_stats, files_read=set(_stats.files_read), files_written=set(_stats.files_written))


def reset_stats() -> None:
    global _stats
    with _stats_lock:
        _stats = IoStats()


def _target_path(target: Any) -> str:
    if isinstance(target, int) and not isinstance(target, bool):
        try:
            return os.readlink(f"/proc/self/fd/{target}")
        except OSError:
            return f"<fd {target}>"
    return os.path.abspath(os.fspath(target))


def _record(write: bool, buffer: torch.Tensor, target: Any) -> None:
    path, n = _target_path(target), buffer.numel() * buffer.element_size()
    with _stats_lock:
        if write:
            _stats.writes += 1
            _stats.bytes_written += n
            _stats.files_written.add(path)
        else:
            _stats.reads += 1
            _stats.bytes_read += n
            _stats.files_read.add(path)


def _record_wait(seconds: float, writes: Set[bool]) -> None:
    """One blocking wait of ``seconds`` over operations of the directions in ``writes``."""
    with _stats_lock:
        _stats.wait_calls += 1
        _stats.wait_s += seconds
        if writes == {False}:
            _stats.read_wait_s += seconds
        elif writes == {True}:
            _stats.write_wait_s += seconds


# -- the handle DeepSpeed gets ---------------------------------------------------------------------
class DeepSpeedAioHandle(AioHandle):
    """``AioHandle`` as DeepSpeed's swappers use it, counting every read and write and timing every
    wait (see :func:`stats`). Locked buffers are process-wide in AioHandle itself, as in DeepSpeed."""

    def __init__(self, block_size: int = 1048576, queue_depth: int = 128, single_submit: bool = False,
                 overlap_events: bool = False, intra_op_parallelism: int = 1) -> None:
        super().__init__(block_size, queue_depth, single_submit, overlap_events, intra_op_parallelism)
        with _stats_lock:
            _stats.handles += 1

    def _submit(self, buffer: torch.Tensor, target: Any, write: bool, file_offset: int, validate: bool) -> None:
        super()._submit(buffer, target, write, file_offset, validate)
        _record(write, buffer, target)

    def wait(self, timeout: Optional[float] = None) -> int:
        """AioHandle.wait, timed (every sync_* / pread / pwrite without async waits through here)."""
        with self._lock:
            writes = {p.request.is_write for p in self._pending}
        t = time.perf_counter()
        try:
            return super().wait(timeout)
        finally:
            _record_wait(time.perf_counter() - t, writes)


def _aio_read(buffer: torch.Tensor, filename: str, block_size: int, queue_depth: int, single_submit: bool,
              overlap_events: bool, validate: bool) -> int:
    """DeepSpeed's module-level ``aio_read``: one synchronous read; 0 on success (raises on failure)."""
    DeepSpeedAioHandle(block_size, queue_depth, single_submit, overlap_events).pread(buffer, filename, validate, False)
    return 0


def _aio_write(buffer: torch.Tensor, filename: str, block_size: int, queue_depth: int, single_submit: bool,
               overlap_events: bool, validate: bool) -> int:
    """DeepSpeed's module-level ``aio_write``: one synchronous write; 0 on success."""
    DeepSpeedAioHandle(block_size, queue_depth, single_submit, overlap_events).pwrite(buffer, filename, validate, False)
    return 0


def _memcpy(dest: torch.Tensor, src: torch.Tensor) -> int:
    """DeepSpeed's ``deepspeed_memcpy``."""
    dest.copy_(src)
    return 0


#: What ``AsyncIOBuilder().load()`` returns once installed (same attributes as DeepSpeed's op).
aio_op = types.ModuleType("pyinfinity_async_io_op", "pyinfinity's stand-in for DeepSpeed's async_io op")
aio_op.aio_handle = DeepSpeedAioHandle
aio_op.aio_read = _aio_read
aio_op.aio_write = _aio_write
aio_op.deepspeed_memcpy = _memcpy

#: What ``PinMemoryBuilder().load()`` returns once installed: DeepSpeed's ``pin_memory`` op, whose
#: ``pin_handle`` shares one page-locked registry (``pyinfinity.aio.LOCKED_TENSORS``) with every
#: ``aio_handle``, as DeepSpeed's two ops share one ``deepspeed_pin_tensor_t``.
pin_op = types.ModuleType("pyinfinity_pin_memory_op", "pyinfinity's stand-in for DeepSpeed's pin_memory op")
pin_op.pin_handle = PinHandle

#: op name -> (the builder class name, what its ``load()`` returns once installed)
REPLACED_OPS: Dict[str, Tuple[str, types.ModuleType]] = {
    OP_NAME: ("AsyncIOBuilder", aio_op),
    PIN_OP_NAME: ("PinMemoryBuilder", pin_op),
}

