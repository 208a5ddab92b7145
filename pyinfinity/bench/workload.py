"""What one measurement moves: a list of requests (size, offset) in one file, and how the engine is
set up to move them (block size, queue depth, threads)."""
from __future__ import annotations

import itertools
from dataclasses import dataclass, replace
from typing import Iterator

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30


@dataclass(frozen=True)
class IoConfig:
    """One configuration: ``sizes`` are the requests (tensors), packed back to back in the file.

    ``workload`` is ``file`` (one big file cut into ``io_size`` requests), ``small`` (many tensors
    of ``io_size`` bytes) or ``small-odd`` (many tensors of odd sizes at unaligned offsets).
    """

    workload: str
    op: str
    block_size: int
    queue_depth: int
    threads: int
    io_size: int
    sizes: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return sum(self.sizes)

    @property
    def n_ops(self) -> int:
        return len(self.sizes)

    def offsets(self) -> list[int]:
        return [0, *itertools.accumulate(self.sizes)][:-1]

    def requests(self) -> Iterator[tuple[int, int]]:
        """(offset, size) of each request, in file order."""
        return zip(self.offsets(), self.sizes)

    @property
    def aligned(self) -> bool:
        """Every size and offset a multiple of 4096 (what O_DIRECT-only tools need)."""
        return all(s % 4096 == 0 for s in self.sizes)

    def with_op(self, op: str) -> "IoConfig":
        return replace(self, op=op)


def file_config(op: str, file_size: int, block_size: int, queue_depth: int, threads: int,
                io_size: int) -> IoConfig:
    io_size = min(io_size, file_size)
    full, rest = divmod(file_size, io_size)
    sizes = (io_size,) * full + ((rest,) if rest else ())
    return IoConfig("file", op, block_size, queue_depth, threads, io_size, sizes)


def small_config(op: str, count: int, size: int, block_size: int, queue_depth: int,
                 threads: int) -> IoConfig:
    return IoConfig("small", op, block_size, queue_depth, threads, size, (size,) * count)


def odd_sizes(count: int, around: int) -> tuple[int, ...]:
    """``count`` sizes near ``around``, none a multiple of 512 (e.g. 262 143, 258 061, ...)."""
    out = []
    for i in range(count):
        s = around - 2048 + (i * 7919) % 4096
        if s % 512 == 0:
            s += 7
        out.append(s)
    return tuple(out)


def small_odd_config(op: str, count: int, around: int, block_size: int, queue_depth: int,
                     threads: int) -> IoConfig:
    return IoConfig("small-odd", op, block_size, queue_depth, threads, around, odd_sizes(count, around))


def parse_size(text: str) -> int:
    """'1M', '256K', '1G', '4096', '1MiB' -> bytes (binary multiples)."""
    t = text.strip().upper().removesuffix("IB").removesuffix("B")
    mult = {"K": KiB, "M": MiB, "G": GiB, "T": 1 << 40}
    if t and t[-1] in mult:
        return int(float(t[:-1]) * mult[t[-1]])
    return int(t)


def fmt_size(n: int) -> str:
    for unit, m in (("G", GiB), ("M", MiB), ("K", KiB)):
        if n >= m and n % m == 0:
            return f"{n // m}{unit}"
    return str(n)
