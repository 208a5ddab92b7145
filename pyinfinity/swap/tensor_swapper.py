"""TensorSwapper: where a flat tensor lives between uses — tier ``gpu`` (stays on the compute
device), ``cpu`` (pinned host RAM) or ``nvme`` (a slot of a SwapSpace) — and async moves between
its home and a host buffer, with byte counters per tier and direction.

The engine's parameter shards and optimizer states both go through one of these; the NVMe tier
is built on ``SwapSpace`` (slots in preallocated, striped files) so no tensor file I/O is written
here.
"""
from __future__ import annotations

import enum
import functools
import logging
import os
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence, Union

import torch

log = logging.getLogger(__name__)

ALIGN = 4096


class Tier(str, enum.Enum):
    GPU = "gpu"
    CPU = "cpu"
    NVME = "nvme"


def aligned_empty(numel: int, dtype: torch.dtype, pin: bool = False) -> torch.Tensor:
    """A 1-D host tensor whose data pointer is page aligned (O_DIRECT-safe without a bounce)."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    nbytes = max(1, numel) * itemsize
    raw = torch.empty(nbytes + ALIGN, dtype=torch.uint8, pin_memory=pin)
    shift = (-raw.data_ptr()) % ALIGN
    return raw[shift:shift + nbytes].view(dtype)[:numel]


def pin_available() -> bool:
    """Whether page-locked host memory can be had (a CUDA device is present)."""
    try:
        return torch.cuda.is_available()
    except Exception:  # noqa: BLE001 - a broken driver means "no"
        return False


@dataclass(eq=False)
class SwapRecord:
    """One tensor's home: its tier and either a host tensor (cpu/gpu) or a swap slot (nvme)."""

    key: str
    tier: Tier
    numel: int
    dtype: torch.dtype
    tensor: Optional[torch.Tensor] = None  # cpu / gpu tiers
    slot: Any = None  # nvme tier
    slab: Any = None  # cpu tier, when the tensor lives in the swapper's pinned arena

    @property
    def nbytes(self) -> int:
        return self.numel * torch.empty((), dtype=self.dtype).element_size()


class Done:
    """A transfer that already completed (cpu tier) — the same interface as a swap Request."""

    def wait(self, timeout: Optional[float] = None) -> None:
        return None

    def done(self) -> bool:
        return True


class Pending:
    """Several requests that complete together; ``wait`` records the time spent blocked."""

    def __init__(self, requests: Sequence[Any], swapper: "TensorSwapper", keep: Any = None) -> None:
        self._requests = list(requests)
        self._swapper = swapper
        self._keep = keep  # buffers that must outlive the transfer

    def done(self) -> bool:
        return all(r.done() for r in self._requests)

    def wait(self, timeout: Optional[float] = None) -> None:
        if not self._requests:
            return
        t0 = time.perf_counter()
        try:
            for r in self._requests:
                r.wait(timeout)
        finally:
            self._swapper._add_wait(time.perf_counter() - t0)
            self._requests = []
            self._keep = None


@dataclass
class SwapStats:
    """Bytes moved per (tier, direction) and time the caller spent blocked waiting on I/O."""

    bytes: dict[str, int] = field(default_factory=dict)  # "nvme.read" -> bytes
    wait_seconds: float = 0.0
    resident: dict[str, int] = field(default_factory=dict)  # tier -> bytes held there


class TensorSwapper:
    """Homes of flat tensors in one of three tiers, and async copies between a home and a buffer.

    nvme_dirs: swap directories (striped when several); a SwapSpace named ``name`` (files
    ``<dir>/<name>.swp``, locked while open) is opened in them on the first NVMe allocation. engine: a shared SwapEngine (one per training engine).
    pin: allocate cpu-tier homes page-locked when a GPU exists.
    checksums: SwapSpace's CRC-32C of every block written, verified on read.
    ownership: the engine's ``swap.ownership.SwapOwnership`` (manifest records of every slot).
    record_checksums: the swap space records each write's CRC-32Cs without verifying reads (what a
    checkpoint holding a home by reference records).
    """

    def __init__(self, name: str, device: torch.device, nvme_dirs: Optional[Sequence[str]] = None,
                 engine: Any = None, pin: bool = True, pinned_capacity: int = 0,
                 checksums: bool = False, ownership: Any = None, record_checksums: bool = False) -> None:
        self.name = name
        self.record_checksums = record_checksums
        self.checksums, self._ownership = checksums, ownership
        self.device = torch.device(device)
        self.nvme_dirs = list(nvme_dirs or [])
        self._engine = engine
        self._space: Any = None
        self._pin = pin and pin_available()
        self._lock = threading.Lock()
        self.stats = SwapStats()
        self._records: list[SwapRecord] = []
        self._closed = False
        # cpu-tier homes come from one page-locked arena when a GPU exists (no per-tensor pinning,
        # no power-of-two rounding of torch's pinned allocator); overflow falls back to torch
        self._arena: Any = None
        if self._pin and pinned_capacity > 0:
            from pyinfinity.swap import PinnedArena

            self._arena = PinnedArena(int(pinned_capacity))

    @property
    def pin(self) -> bool:
        """Whether host buffers for this swapper's tensors are page-locked (asked for, and a GPU exists)."""
        return self._pin

    # -- placement ---------------------------------------------------------------------------
    @property
    def space(self) -> Any:
        if self._space is None:
            if not self.nvme_dirs:
                raise ValueError(f"{self.name}: the nvme tier needs nvme_path (no swap directory configured)")
            from pyinfinity.swap import SwapEngine, SwapSpace

            if self._engine is None:
                self._engine = SwapEngine()
            for d in self.nvme_dirs:
                os.makedirs(d, exist_ok=True)
            make = functools.partial(SwapSpace, self.nvme_dirs, engine=self._engine, name=self.name,
                                     checksums=self.checksums, record_checksums=self.record_checksums)
            own = self._ownership
            self._space = own.open_space(self.name, self.nvme_dirs, make) if own is not None else make()
        return self._space

    def allocate(self, key: str, numel: int, dtype: torch.dtype, tier: Union[Tier, str]) -> SwapRecord:
        """A home of ``numel`` elements in ``tier`` (contents undefined until written)."""
        self._check_open()
        tier = Tier(tier)
        rec = SwapRecord(key, tier, numel, dtype)
        if tier == Tier.NVME:
            rec.slot = self.space.allocate(rec.nbytes, tag=key)
            if self._ownership is not None:
                self._ownership.record(self.name, key, dtype, (numel,), rec.slot)
        elif tier == Tier.CPU:
            if self._arena is not None:
                try:
                    rec.slab = self._arena.allocate(rec.nbytes)
                    rec.tensor = rec.slab.tensor(dtype, (numel,))
                except ValueError:  # arena exhausted
                    log.debug("%s: pinned arena full, %s from torch's pinned allocator", self.name, key)
            if rec.tensor is None:
                rec.tensor = aligned_empty(numel, dtype, pin=self._pin)
        else:
            rec.tensor = torch.empty(numel, dtype=dtype, device=self.device)
        self.stats.resident[tier.value] = self.stats.resident.get(tier.value, 0) + rec.nbytes
        self._records.append(rec)
        return rec

    def put(self, key: str, tensor: torch.Tensor, tier: Union[Tier, str]) -> SwapRecord:
        """A new home in ``tier`` holding a copy of ``tensor`` (1-D, on the CPU); waits for it."""
        rec = self.allocate(key, tensor.numel(), tensor.dtype, tier)
        self.write(rec, tensor).wait()
        return rec

    # -- transfers -----------------------------------------------------------------------------
    def read(self, rec: SwapRecord, dst: torch.Tensor) -> Union[Pending, Done]:
        """Starts copying the home into ``dst`` (a contiguous host tensor for nvme)."""
        self._check_open()
        self._count(rec.tier, "read", rec.nbytes)
        if rec.tier == Tier.NVME:
            return Pending([self.space.read(dst, rec.slot)], self)
        dst.copy_(rec.tensor, non_blocking=dst.device.type == "cuda")
        return Done()

    def write(self, rec: SwapRecord, src: torch.Tensor) -> Union[Pending, Done]:
        """Starts copying ``src`` into the home; ``src`` must stay unchanged until it is done. A home
        on NVMe a checkpoint holds by reference moves to a fresh slot first (copy-on-write)."""
        self._check_open()
        self._count(rec.tier, "write", rec.nbytes)
        if rec.tier == Tier.NVME:
            slot = self.space.writable(rec.slot)
            if slot is not rec.slot:
                rec.slot = slot
                if self._ownership is not None:
                    self._ownership.record(self.name, rec.key, rec.dtype, (rec.numel,), slot)
            if src.device.type != "cpu" or not src.is_contiguous():
                src = src.detach().to("cpu").contiguous()
            return Pending([self.space.write(src, rec.slot)], self, keep=src)
        rec.tensor.copy_(src.reshape(-1), non_blocking=src.device.type == "cuda")
        return Done()

    def free(self, rec: SwapRecord) -> None:
        if rec.tier == Tier.NVME and rec.slot is not None and self._space is not None:
            self._space.free(rec.slot)
        if rec.slab is not None:
            rec.tensor = None
            rec.slab.free()
            rec.slab = None
        self.stats.resident[rec.tier.value] = self.stats.resident.get(rec.tier.value, 0) - rec.nbytes
        rec.tensor, rec.slot = None, None

    def nvme_space(self) -> Any:
        """The nvme tier's SwapSpace, None when nothing was placed there."""
        return self._space

    def note_links(self, paths: Sequence[str]) -> None:
        """Records in the swap directories' manifests the hard links a checkpoint made to the nvme
        tier's files (``swap.ownership``)."""
        if self._ownership is not None:
            self._ownership.link(self.name, paths)
            self._ownership.flush()

    def files(self) -> list[str]:
        """The swap files of the nvme tier (for tests and reports)."""
        return list(self._space.paths) if self._space is not None else []

    # -- bookkeeping ---------------------------------------------------------------------------
    def _count(self, tier: Tier, direction: str, nbytes: int) -> None:
        key = f"{tier.value}.{direction}"
        with self._lock:
            self.stats.bytes[key] = self.stats.bytes.get(key, 0) + nbytes

    def _add_wait(self, seconds: float) -> None:
        with self._lock:
            self.stats.wait_seconds += seconds

    def _check_open(self) -> None:
        if self._closed:
            raise ValueError(f"TensorSwapper({self.name!r}): used after close()")

    def close(self) -> None:
        """Frees every home and closes the swap space (its files are removed by SwapSpace)."""
        if self._closed:
            return
        self._closed = True
        for rec in self._records:
            rec.tensor, rec.slot = None, None
            if rec.slab is not None:
                rec.slab.free()
                rec.slab = None
        self._records.clear()
        self._arena = None
        if self._space is not None:
            try:
                self._space.close()
            finally:
                self._space = None
