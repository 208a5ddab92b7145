"""SwapEngine: asynchronous tensor reads and writes against files, on the C++ core."""
from __future__ import annotations

import logging
from typing import Any, Optional, Sequence, Union

import torch

from pyinfinity import _C
from pyinfinity.swap.checks import as_path, check_offset, check_tensor, nbytes

log = logging.getLogger(__name__)

FileLike = Union[str, "os.PathLike[str]", _C.FileHandle]
Request = _C.Request
FileHandle = _C.FileHandle


def _default(name: str) -> str:
    for entry in _C.defaults():
        if entry["name"] == name:
            return entry["value"]
    raise KeyError(name)


class SwapEngine:
    """Moves bytes of CPU tensors to and from files, asynchronously.

    Every call returns a ``Request``; ``wait(timeout=None)`` blocks without the GIL and raises
    ``OSError(errno, message, path)`` when the transfer failed. Many requests, from many
    threads, may be in flight at once. Defaults come from PYINFINITY_* environment variables
    (``python -m pyinfinity report`` lists them).

    backend: "auto" (probe each directory once), "aio", "uring" or "posix".
    block_size: bytes per I/O piece; queue_depth: pieces in flight per thread;
    threads: submitting threads, each with its own kernel queue.
    """

    def __init__(self, backend: Optional[str] = None, block_size: Optional[int] = None,
                 queue_depth: Optional[int] = None, threads: Optional[int] = None) -> None:
        backend = backend if backend is not None else _default("backend")
        block_size = block_size if block_size is not None else int(_default("block_size"))
        queue_depth = queue_depth if queue_depth is not None else int(_default("queue_depth"))
        threads = threads if threads is not None else int(_default("io_threads"))
        for name, value in (("block_size", block_size), ("queue_depth", queue_depth), ("threads", threads)):
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"{name}: expected an int, got {type(value).__name__}")
        if not isinstance(backend, str):
            raise TypeError(f"backend: expected a str, got {type(backend).__name__}")
        self._core = _C.SwapEngine(backend, block_size, queue_depth, threads)

    @property
    def core(self) -> _C.SwapEngine:
        return self._core

    @property
    def backend(self) -> str:
        return self._core.backend

    @property
    def block_size(self) -> int:
        return self._core.block_size

    @property
    def queue_depth(self) -> int:
        return self._core.queue_depth

    @property
    def threads(self) -> int:
        return self._core.threads

    def _file(self, file: FileLike, write: bool) -> _C.FileHandle:
        if isinstance(file, _C.FileHandle):
            return file
        return _C.FileHandle(as_path(file), "rw" if write else "r")

    def submit(self, tensor: torch.Tensor, file: FileLike, offset: int, write: bool,
               nbytes_: Optional[int] = None, byte_offset: int = 0, checksum: bool = False,
               expected_checksums: Optional[Sequence[int]] = None, pad_tail: bool = False) -> Request:
        """Transfers `nbytes_` bytes (default: all) of `tensor`, starting `byte_offset` bytes in.

        checksum: compute a CRC-32C per 64 KiB (``Request.checksums()`` after ``wait()``), in the
        I/O thread. expected_checksums (reads): what a checksummed write returned; a mismatch
        fails the request with ``OSError(EBADMSG)`` naming the bytes and the file.
        pad_tail (writes): the file bytes up to the next 4 KiB boundary after the transfer are the
        caller's to overwrite (a swap slot's reservation), so an unaligned tail goes out as one
        zero-padded O_DIRECT block rather than a buffered read-modify-write.
        """
        check_tensor(tensor)
        check_offset(offset)
        total = nbytes(tensor)
        n = total - byte_offset if nbytes_ is None else nbytes_
        if byte_offset < 0 or n <= 0 or byte_offset + n > total:
            raise ValueError(f"nbytes: range [{byte_offset}, {byte_offset + n}) outside the tensor's {total} bytes")
        fh = self._file(file, write)
        return self._core.submit(fh, tensor.data_ptr() + byte_offset, n, offset, write, tensor, checksum,
                                 list(expected_checksums) if expected_checksums is not None else [], pad_tail)

    def write(self, tensor: torch.Tensor, file: FileLike, offset: int = 0, checksum: bool = False) -> Request:
        """Writes all bytes of a contiguous CPU tensor to `file` at `offset` (creating the file)."""
        return self.submit(tensor, file, offset, True, checksum=checksum)

    def read(self, tensor: torch.Tensor, file: FileLike, offset: int = 0,
             expected_checksums: Optional[Sequence[int]] = None) -> Request:
        """Fills a contiguous CPU tensor from `file` at `offset`; ValueError if the file is too short."""
        return self.submit(tensor, file, offset, False, expected_checksums=expected_checksums)

    def backend_for(self, file: FileLike) -> str:
        """The backend used for `file` ("auto" resolved by probing its directory)."""
        return self._core.backend_for(self._file(file, False) if not isinstance(file, _C.FileHandle) else file)

    def stats(self) -> dict:
        """Bytes, ops, busy seconds and GB/s (1e9 bytes/s) per direction, and piece counters."""
        return self._core.stats()

    def reset_stats(self) -> None:
        self._core.reset_stats()

    def close(self) -> None:
        """Waits for every request, then stops the I/O threads. Idempotent."""
        self._core.close()

    @property
    def closed(self) -> bool:
        return self._core.closed

    def __enter__(self) -> "SwapEngine":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        return (f"SwapEngine(backend={self.backend!r}, block_size={self.block_size}, "
                f"queue_depth={self.queue_depth}, threads={self.threads})")
