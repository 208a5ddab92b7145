"""`pyinfinity tune PATH`: a short sweep on PATH, then the best ``aio`` section for a
DeepSpeed-format config (``{"aio": {...}}``, the shape pyinfinity.config and DeepSpeed accept)."""
from __future__ import annotations

import logging
import statistics
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from pyinfinity.bench.io import IoBenchSettings, run_io_bench
from pyinfinity.bench.records import Result
from pyinfinity.bench.workload import KiB, MiB

log = logging.getLogger(__name__)

TIE = 0.03
"""Configurations within 3% of the best are ties; the cheapest of them wins (fewer threads,
smaller queue depth, smaller block)."""


@dataclass
class TuneSettings:
    directory: str
    file_size: int = 256 * MiB
    block_sizes: list[int] = field(default_factory=lambda: [256 * KiB, 1 * MiB, 4 * MiB])
    queue_depths: list[int] = field(default_factory=lambda: [8, 32, 128])
    threads: list[int] = field(default_factory=lambda: [1, 2])
    backends: Optional[list[str]] = None
    reps: int = 2
    read_weight: float = 0.5     # share of reads in the score (swap-in is on the critical path)


@dataclass
class Candidate:
    backend: str
    block_size: int
    queue_depth: int
    threads: int
    read_gbps: float
    write_gbps: float
    score: float


@dataclass
class TuneResult:
    best: Candidate
    candidates: list[Candidate]
    results: list[Result]

    def aio_section(self) -> dict[str, Any]:
        b = self.best
        return {"block_size": b.block_size, "queue_depth": b.queue_depth,
                "intra_op_parallelism": b.threads, "single_submit": False, "overlap_events": True,
                "backend": b.backend}

    def config(self) -> dict[str, Any]:
        return {"aio": self.aio_section()}


def score(read_gbps: float, write_gbps: float, read_weight: float) -> float:
    """Weighted harmonic mean: the rate of a mix of reads and writes of equal bytes."""
    if read_gbps <= 0 or write_gbps <= 0:
        return 0.0
    return 1.0 / (read_weight / read_gbps + (1.0 - read_weight) / write_gbps)


def candidates_from(results: list[Result], read_weight: float) -> list[Candidate]:
    by: dict[tuple, dict[str, Result]] = {}
    for r in results:
        if r.tool == "pyinfinity" and r.workload == "file" and r.seconds and r.verified is not False:
            by.setdefault((r.backend, r.block_size, r.queue_depth, r.threads), {})[r.op] = r
    out = []
    for (backend, bs, qd, th), ops in by.items():
        if "read" in ops and "write" in ops:
            rd, wr = ops["read"].gbps_median, ops["write"].gbps_median
            out.append(Candidate(backend, bs, qd, th, rd, wr, score(rd, wr, read_weight)))
    return out


def pick(cands: list[Candidate]) -> Candidate:
    if not cands:
        raise RuntimeError("no configuration completed: see the log for why each backend failed")
    top = max(c.score for c in cands)
    near = [c for c in cands if c.score >= (1 - TIE) * top]
    return min(near, key=lambda c: (c.threads, c.queue_depth, c.block_size, -c.score))


def run_tune(t: TuneSettings, progress: Optional[Callable[[int, int, str], None]] = None) -> TuneResult:
    s = IoBenchSettings(directory=t.directory, file_size=t.file_size, block_sizes=t.block_sizes,
                        queue_depths=t.queue_depths, threads=t.threads, io_sizes=[t.file_size],
                        reps=t.reps, backends=t.backends, peers=[], small_count=0, gpu=False,
                        aio_handle=False)
    run = run_io_bench(s, progress)
    cands = candidates_from(run.results, t.read_weight)
    best = pick(cands)
    log.info("best: %s (score %.2f GB/s; median of %d candidates %.2f)", best, best.score,
             len(cands), statistics.median(c.score for c in cands))
    return TuneResult(best, sorted(cands, key=lambda c: -c.score), run.results)
