"""PinnedArena: page-aligned slabs visible as tensors without a copy."""
from __future__ import annotations

import pytest
import torch

from pyinfinity import _C
from pyinfinity.swap import PinnedArena, SwapEngine
from tests.python.conftest import random_bytes


def test_slab_tensor_is_a_view_not_a_copy():
    arena = PinnedArena(1 << 20)
    slab = arena.allocate(4000)
    t = slab.tensor(torch.float32, (1000,))
    t.fill_(2.5)
    again = slab.tensor(torch.float32)
    assert again.data_ptr() == t.data_ptr() == slab.ptr
    assert torch.all(again == 2.5)
    assert slab.ptr % 4096 == 0


def test_no_power_of_two_rounding_and_stats():
    arena = PinnedArena(10 * 4096 + 1)
    st = arena.stats()
    assert st["capacity"] == 11 * 4096
    slabs = [arena.allocate(n) for n in (4097, 1, 12288)]
    st = arena.stats()
    assert st["in_use"] == 2 * 4096 + 4096 + 3 * 4096
    assert st["slabs"] == 3
    for s in slabs:
        s.free()
    st = arena.stats()
    assert st["in_use"] == 0 and st["high_water"] == 6 * 4096 and st["largest_free"] == 11 * 4096


def test_exhaustion_is_a_clear_error():
    arena = PinnedArena(64 << 10)
    held = arena.allocate(60 << 10)  # noqa: F841 - a slab lives as long as its object
    with pytest.raises(ValueError, match=r"PinnedArena exhausted: asked for .* free"):
        arena.allocate(8 << 10)
    del held
    arena.allocate(8 << 10)  # dropping the slab returned its bytes


def test_double_free_and_use_after_free():
    arena = PinnedArena(1 << 16)
    s = arena.allocate(100)
    s.free()
    with pytest.raises(ValueError, match="double free"):
        s.free()
    with pytest.raises(ValueError, match="after free"):
        s.tensor()


def test_bad_arguments():
    with pytest.raises(ValueError):
        PinnedArena(0)
    with pytest.raises(TypeError):
        PinnedArena(1.5)
    with pytest.raises(ValueError, match="lock"):
        PinnedArena(4096, lock="sometimes")
    arena = PinnedArena(4096)
    with pytest.raises(ValueError):
        arena.allocate(0)
    with pytest.raises(ValueError, match="needs"):
        arena.allocate(100).tensor(torch.float64, (100,))


def test_locking_without_gpu():
    arena = PinnedArena(1 << 20)
    if _C.cuda_device_count() == 0:
        assert arena.locked_by in ("mlock", "none")  # root: mlock beyond ulimit -l works
        with pytest.raises(RuntimeError, match="CUDA"):
            PinnedArena(4096, lock="cuda")
    else:
        assert arena.locked_by == "cuda"
        assert arena.allocate(4096).tensor().is_pinned()


def test_engine_io_from_a_slab(tmp_path):
    arena = PinnedArena(16 << 20)
    slab = arena.allocate(4 << 20)
    t = slab.tensor()
    t.copy_(random_bytes(t.numel(), 3))
    eng = SwapEngine("aio")
    eng.write(t, tmp_path / "s").wait()
    back = arena.allocate(t.numel()).tensor()
    eng.read(back, tmp_path / "s").wait()
    assert torch.equal(t, back)
    st = eng.stats()
    assert st["bounced"] == 0 and st["buffered"] == 0  # page-aligned: straight O_DIRECT, no copy
