"""Real faults under the swap layer: a full ext4 disk (O_DIRECT path), a directory removed
under a running SwapSpace, and no leaks (fds, pinned memory, threads) after failures."""
from __future__ import annotations

import errno
import gc
import os
import shutil
import threading

import pytest
import torch

from pyinfinity import _C
from pyinfinity.swap import PinnedArena, SwapEngine, SwapSpace, fault_injection
from tests.python.conftest import random_bytes


def fds() -> int:
    gc.collect()  # count only what is still referenced
    return len(os.listdir("/proc/self/fd"))


@pytest.mark.parametrize("backend", ["aio", "uring", "posix"])
def test_full_ext4_disk_raises_enospc_and_keeps_earlier_data(small_ext4_dir, backend):
    assert _C.probe_backend(small_ext4_dir)["direct_io"]
    eng = SwapEngine(backend)
    keep = random_bytes(4 << 20, 1)
    eng.write(keep, os.path.join(small_ext4_dir, "keep")).wait()
    before = fds()
    req = eng.write(random_bytes(64 << 20, 2), os.path.join(small_ext4_dir, "fill"))
    with pytest.raises(OSError) as ei:
        req.wait()
    assert ei.value.errno == errno.ENOSPC
    assert ei.value.filename.endswith("fill")
    del req, ei
    assert fds() == before  # the failed request's file was closed
    back = torch.empty_like(keep)
    eng.read(back, os.path.join(small_ext4_dir, "keep")).wait()
    assert torch.equal(back, keep)  # earlier data intact
    eng.close()


def test_swap_space_on_full_ext4_fails_at_allocate(small_ext4_dir):
    with SwapSpace(small_ext4_dir, grow_bytes=4 << 20) as sp:
        s = sp.allocate(8 << 20)
        t = random_bytes(8 << 20, 3)
        sp.write(t, s).wait()
        with pytest.raises(OSError) as ei:
            sp.allocate(64 << 20)
        assert ei.value.errno == errno.ENOSPC
        back = torch.empty_like(t)
        sp.read(back, s).wait()
        assert torch.equal(back, t)


def test_directory_removed_under_a_running_space(tmp_path, caplog):
    d = tmp_path / "swap"
    d.mkdir()
    sp = SwapSpace(d)
    t = random_bytes(3 << 20, 4)
    s = sp.allocate(t.numel())
    sp.write(t, s).wait()
    shutil.rmtree(d)
    # The open file keeps the data: nothing is lost, and the loss of the directory is reported.
    back = torch.empty_like(t)
    sp.read(back, s).wait()
    assert torch.equal(back, t)
    with caplog.at_level("WARNING"):
        s2 = sp.allocate(1 << 20)
    assert any("deleted" in r.message for r in caplog.records)
    sp.write(random_bytes(1 << 20, 5), s2).wait()
    sp.close()  # files already gone: close still succeeds


def test_failures_leak_nothing(tmp_path):
    eng = SwapEngine("aio", block_size=4096, queue_depth=4)
    arena = PinnedArena(1 << 20)
    slab = arena.allocate(64 << 10)
    t = slab.tensor()
    t.copy_(random_bytes(t.numel(), 6))
    eng.write(t, tmp_path / "x").wait()
    fd0, th0 = fds(), threading.active_count()
    for k in range(50):
        with fault_injection(op="any", nth=1 + k % 5, action="errno", value=errno.EIO):
            with pytest.raises(OSError):
                eng.read(t, tmp_path / "x").wait()
    assert fds() == fd0 and threading.active_count() == th0
    slab.free()
    assert arena.stats()["in_use"] == 0
