"""PinnedArena: page-aligned (page-locked where possible) host memory, handed out as tensors."""
from __future__ import annotations

import logging
from typing import Sequence

import torch

from pyinfinity import _C

log = logging.getLogger(__name__)


class Slab:
    """One allocation of the arena. ``tensor()`` views it without a copy; ``free()`` returns it.

    Tensors made from a slab must not be used after ``free()`` (the bytes go back to the arena).
    """

    def __init__(self, core: _C.PinnedSlab) -> None:
        self._core = core
        self._bytes = torch.frombuffer(core, dtype=torch.uint8) if core.nbytes else None

    @property
    def nbytes(self) -> int:
        return self._core.nbytes

    @property
    def ptr(self) -> int:
        return self._core.ptr

    @property
    def valid(self) -> bool:
        return self._core.valid

    def tensor(self, dtype: torch.dtype = torch.uint8, shape: Sequence[int] | None = None) -> torch.Tensor:
        """A view of the slab's bytes as `dtype` with `shape` (default: 1-D, as many as fit)."""
        if not self._core.valid:
            raise ValueError("slab: used after free()")
        itemsize = torch.empty((), dtype=dtype).element_size()
        if shape is None:
            shape = (self.nbytes // itemsize,)
        numel = 1
        for s in shape:
            numel *= int(s)
        if numel * itemsize > self.nbytes:
            raise ValueError(f"shape: {tuple(shape)} of {dtype} needs {numel * itemsize} bytes, slab has {self.nbytes}")
        return self._bytes[: numel * itemsize].view(dtype).view(tuple(shape))

    def free(self) -> None:
        """Returns the bytes to the arena; ValueError on a second call."""
        self._core.free()
        self._bytes = None


class PinnedArena:
    """One large host allocation carved into slabs (no power-of-two rounding).

    lock: "auto" page-locks it through CUDA when a GPU is present (fast copies), else with
    mlock when permitted (logged when neither works); "cuda", "mlock" require that method;
    "none" skips locking.
    """

    def __init__(self, capacity: int, lock: str = "auto") -> None:
        if isinstance(capacity, bool) or not isinstance(capacity, int):
            raise TypeError(f"capacity: expected an int, got {type(capacity).__name__}")
        if capacity <= 0:
            raise ValueError(f"capacity: must be > 0, got {capacity}")
        if lock in ("auto", "cuda") and torch.cuda.is_available():
            # torch answers is_pinned() (and so picks truly async copies) only once its own CUDA
            # context exists; make sure it does before the memory is registered.
            torch.cuda.init()
        self._core = _C.PinnedArena(capacity, lock)
        note = self._core.lock_note.strip().rstrip(";")
        if note:
            # Falling back to mlock is the normal case without a GPU; unlocked memory is worth a word.
            log.log(logging.WARNING if self.locked_by == "none" else logging.DEBUG,
                    "PinnedArena(%d bytes) locked by %s: %s", capacity, self.locked_by, note)

    @property
    def locked_by(self) -> str:
        """"cuda", "mlock" or "none"."""
        return self._core.locked_by

    def allocate(self, nbytes: int) -> Slab:
        """A page-aligned slab of `nbytes`; ValueError when the arena is exhausted."""
        if isinstance(nbytes, bool) or not isinstance(nbytes, int):
            raise TypeError(f"nbytes: expected an int, got {type(nbytes).__name__}")
        if nbytes <= 0:
            raise ValueError(f"nbytes: must be > 0, got {nbytes}")
        return Slab(self._core.allocate(nbytes))

    def stats(self) -> dict:
        """capacity, in_use, high_water, slabs, largest_free (bytes)."""
        return self._core.stats()
