"""Result records of the benchmarks: one :class:`Result` per configuration, holding every sample."""
from __future__ import annotations

import statistics
from dataclasses import asdict, dataclass, field
from typing import Any, Optional

from pyinfinity.bench import GB

SCHEMA = "pyinfinity.bench.io/1"

# How the page cache was kept out of a figure.
CACHE_DIRECT = "direct"    # O_DIRECT: the page cache is bypassed
CACHE_DROPPED = "dropped"  # buffered I/O, caches dropped (root) before each read, fsync in each write
CACHE_CACHED = "cached"    # buffered I/O, caches could not be dropped: the figure may be the page cache's
CACHE_MEMORY = "memory"    # the filesystem is RAM (tmpfs/ramfs): no disk in the path at all


@dataclass
class Result:
    """One configuration of one tool, with every repetition's timing.

    ``tool`` is who moved the bytes (``pyinfinity``, ``fio``, ``dd``, ``deepspeed``, ``torch``);
    ``backend`` its engine (``aio``/``uring``/``posix`` for pyinfinity, ``libaio``/``io_uring`` for
    fio, ``O_DIRECT`` for dd, ``aio_handle`` for DeepSpeed, ``pinned``/``pageable`` for copies).
    """

    workload: str              # "file" (one big file), "small" (many tensors), "small-odd", "h2d", ...
    op: str                    # "read" | "write" | "h2d" | "d2h" | "nvme2gpu" | "gpu2nvme"
    tool: str
    backend: str
    nbytes: int                # bytes moved per repetition
    block_size: int = 0
    queue_depth: int = 0
    threads: int = 1
    io_size: int = 0           # bytes per request handed to the engine (a tensor's size)
    n_ops: int = 1             # requests per repetition
    seconds: list[float] = field(default_factory=list)
    verified: Optional[bool] = None   # None: not checked by us (the tool checked itself, or n/a)
    cache: str = CACHE_DIRECT
    note: str = ""

    @property
    def gbps(self) -> list[float]:
        return [self.nbytes / s / GB if s > 0 else float("inf") for s in self.seconds]

    @property
    def gbps_median(self) -> float:
        return statistics.median(self.gbps) if self.seconds else float("nan")

    @property
    def gbps_min(self) -> float:
        return min(self.gbps) if self.seconds else float("nan")

    @property
    def gbps_max(self) -> float:
        return max(self.gbps) if self.seconds else float("nan")

    @property
    def ok(self) -> bool:
        return bool(self.seconds) and self.verified is not False

    def key(self) -> tuple:
        """The setting peers are compared at: same workload, direction, depth, threads, and block
        size (one big file) or tensor size (many small tensors: there the tensor is the unit)."""
        unit = self.block_size if self.workload == "file" else self.io_size
        return (self.workload, self.op, unit, self.queue_depth, self.threads)

    def label(self) -> str:
        return f"{self.tool}:{self.backend}"

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["gbps"] = self.gbps
        d["gbps_median"] = self.gbps_median if self.seconds else None
        d["gbps_min"] = self.gbps_min if self.seconds else None
        d["gbps_max"] = self.gbps_max if self.seconds else None
        return d


@dataclass
class PeerStatus:
    """Whether a comparison tool could run here, and why not."""

    name: str
    available: bool
    version: str = ""
    note: str = ""


def best_peer(results: list[Result], r: Result) -> Optional[Result]:
    """The fastest peer (non-pyinfinity) result at ``r``'s setting, or None. The CUDA stager's
    reference is the same shards moved between disk and pinned host alone ("disk-only")."""
    if r.backend == "stager":
        return next((p for p in results if p.tool == "pyinfinity" and p.backend.startswith("disk-only")
                     and p.workload == r.workload and p.op == r.op and p.seconds), None)
    peers = [p for p in results if p.tool != "pyinfinity" and p.tool != r.tool and p.key() == r.key()
             and p.seconds and p.verified is not False and not p.note.startswith("suspect")]
    return max(peers, key=lambda p: p.gbps_median, default=None)


def ratio_to_best_peer(results: list[Result], r: Result) -> Optional[float]:
    """``r``'s median over the best peer's median at the same setting (pyinfinity rows only)."""
    if r.tool != "pyinfinity" or not r.seconds:
        return None
    p = best_peer(results, r)
    if p is None or not p.gbps_median:
        return None
    return r.gbps_median / p.gbps_median


def ratio_to(results: list[Result], r: Result, tool: str) -> Optional[float]:
    """``r``'s median over ``tool``'s median at the same setting (pyinfinity rows only)."""
    if r.tool != "pyinfinity" or not r.seconds:
        return None
    p = next((p for p in results if p.tool == tool and p.key() == r.key() and p.seconds
              and p.verified is not False), None)
    return r.gbps_median / p.gbps_median if p is not None and p.gbps_median else None
