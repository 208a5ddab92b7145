"""Test data: random bytes (never zeros) that are cheap to make at GiB sizes and still catch a block
read from or written to the wrong place."""
from __future__ import annotations

import torch

PERIOD = 1_000_003
"""A prime period: the pattern repeats every PERIOD bytes, so no power-of-two block or offset
shift maps it onto itself and a misplaced block never compares equal."""


def fill_pattern(t: torch.Tensor, seed: int) -> None:
    """Fill the uint8 tensor ``t`` (contiguous, CPU) with the repeating random pattern of ``seed``."""
    flat = t.view(-1)
    n = flat.numel()
    g = torch.Generator().manual_seed(seed)
    base = torch.randint(1, 256, (min(n, PERIOD),), dtype=torch.uint8, generator=g)
    done = 0
    while done < n:
        k = min(base.numel(), n - done)
        flat[done:done + k].copy_(base[:k])
        done += k


def fill_poison(t: torch.Tensor) -> None:
    """Fill a read destination with a value the pattern is unlikely to match byte for byte."""
    t.view(-1).fill_(0xA5)


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Byte-for-byte equality of two contiguous uint8 tensors (compared as int64 words when
    aligned: three times faster than torch.equal on bytes)."""
    a, b = a.reshape(-1), b.reshape(-1)
    if a.numel() != b.numel():
        return False
    n = a.numel() // 8 * 8
    if n and a.data_ptr() % 8 == 0 and b.data_ptr() % 8 == 0 and a.dtype == b.dtype == torch.uint8:
        if not torch.equal(a[:n].view(torch.int64), b[:n].view(torch.int64)):
            return False
        return bool(torch.equal(a[n:], b[n:]))
    return bool(torch.equal(a, b))
