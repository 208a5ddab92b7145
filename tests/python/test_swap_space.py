"""SwapSpace: slots in preallocated, locked, striped swap files."""
from __future__ import annotations

import errno
import os

import pytest
import torch

from pyinfinity.swap import SwapEngine, SwapSpace
from tests.python.conftest import random_bytes


@pytest.mark.parametrize("ndirs", [1, 2, 3])
def test_slots_round_trip_and_stripe(tmp_path, ndirs):
    dirs = [tmp_path / f"d{i}" for i in range(ndirs)]
    for d in dirs:
        d.mkdir()
    with SwapSpace(dirs, name="p", stripe_min=1 << 20) as sp:
        sizes = [1, 4097, (1 << 20) + 7, 9 << 20, 333]
        data = [random_bytes(n, seed=n) for n in sizes]
        slots = [sp.allocate(n) for n in sizes]
        for t, s in zip(data, slots):
            sp.write(t, s).wait()
        for t, s in zip(data, slots):
            u = torch.empty_like(t)
            sp.read(u, s).wait()
            assert torch.equal(t, u)
        big = slots[3]
        assert len(big.extents) == ndirs  # striped over every directory
        assert sum(e.nbytes for e in big.extents) == big.nbytes
        assert all(e.offset % 4096 == 0 for s in slots for e in s.extents)
        paths = list(sp.paths)
    assert not any(os.path.exists(p) for p in paths)  # removed on close


def test_free_reuses_space_and_rejects_double_free(tmp_path):
    with SwapSpace(tmp_path, name="r", grow_bytes=1 << 20) as sp:
        a = sp.allocate(100_000)
        b = sp.allocate(100_000)
        sp.free(a)
        c = sp.allocate(50_000)
        assert c.extents[0].offset == a.extents[0].offset  # the hole is reused
        with pytest.raises(ValueError, match="double free"):
            sp.free(a)
        sp.free(b)
        sp.free(c)
        assert sp.stats()["used"] == 0


def test_typed_tensors(tmp_path):
    with SwapSpace(tmp_path) as sp:
        t = torch.randn(1000, 7).to(torch.bfloat16)
        s = sp.allocate(t.numel() * 2)
        sp.write(t, s).wait()
        u = torch.empty_like(t)
        sp.read(u, s).wait()
        assert torch.equal(t, u)
        with pytest.raises(ValueError, match="slot .* holds"):
            sp.write(torch.zeros(10), s)


def test_second_space_on_same_directory_is_refused(tmp_path):
    with SwapSpace(tmp_path, name="x"):
        with pytest.raises(OSError) as ei:
            SwapSpace(tmp_path, name="x")
        assert ei.value.errno == errno.EBUSY
        assert "in use" in str(ei.value)
        with SwapSpace(tmp_path, name="y"):  # another name is fine
            pass


def test_capacity_and_real_disk_full(tmp_path, tiny_tmpfs_dir):
    with SwapSpace(tmp_path, capacity=1 << 20) as sp:
        sp.allocate(1 << 19)
        with pytest.raises(OSError) as ei:
            sp.allocate(1 << 20)
        assert ei.value.errno == errno.ENOSPC
    with SwapSpace(tiny_tmpfs_dir, grow_bytes=64 << 10) as sp:
        sp.allocate(256 << 10)
        with pytest.raises(OSError) as ei:
            sp.allocate(4 << 20)  # fails at allocate, not halfway through a later write
        assert ei.value.errno == errno.ENOSPC
        assert "bytes free" in ei.value.strerror


def test_bad_paths(tmp_path, readonly_dir):
    with pytest.raises(FileNotFoundError):
        SwapSpace(tmp_path / "missing")
    f = tmp_path / "file"
    f.write_bytes(b"x")
    with pytest.raises(NotADirectoryError):
        SwapSpace(f)
    with pytest.raises(OSError) as ei:
        SwapSpace(readonly_dir)
    assert ei.value.errno == errno.EROFS
    with pytest.raises(ValueError):
        SwapSpace([])
    with pytest.raises(ValueError, match="name"):
        SwapSpace(tmp_path, name="a/b")


def test_use_after_close(tmp_path):
    sp = SwapSpace(tmp_path, engine=SwapEngine("posix"))
    s = sp.allocate(10)
    sp.close()
    sp.close()  # idempotent
    with pytest.raises(ValueError, match="after close"):
        sp.allocate(10)
    with pytest.raises(ValueError, match="after close"):
        sp.write(torch.zeros(10, dtype=torch.uint8), s)


def test_checksums_catch_a_flipped_byte(tmp_path):
    with SwapSpace(tmp_path, name="c", checksums=True) as sp:
        t = random_bytes(300_000, 11)
        s = sp.allocate(t.numel(), tag="layers.3.mlp.weight")
        sp.write(t, s).wait()
        back = torch.empty_like(t)
        sp.read(back, s).wait()
        assert torch.equal(t, back)
        # flip one byte behind the engine's back
        off = s.extents[0].offset + 200_000
        with open(sp.paths[0], "r+b") as f:
            f.seek(off)
            b = f.read(1)
            f.seek(off)
            f.write(bytes([b[0] ^ 0x40]))
        with pytest.raises(OSError) as ei:
            sp.read(back, s).wait()
        assert ei.value.errno == errno.EBADMSG
        assert ei.value.filename == sp.paths[0]
        msg = ei.value.strerror
        assert "checksum mismatch" in msg and "bytes [196608, 262144)" in msg and "layers.3.mlp.weight" in msg
        sp.write(t, s).wait()  # rewriting heals it
        sp.read(back, s).wait()
        assert torch.equal(t, back)


def test_engine_checksums_api(tmp_path):
    from pyinfinity import _C
    eng = SwapEngine()
    t = random_bytes(200_001, 12)
    r = eng.write(t, tmp_path / "x", 5, checksum=True)
    r.wait()
    crcs = r.checksums()
    assert len(crcs) == 4 and crcs[0] == _C.crc32c(t[:65536].numpy())
    eng.read(torch.empty_like(t), tmp_path / "x", 5, expected_checksums=crcs).wait()
    with pytest.raises(ValueError, match="expected_checksums"):
        eng.read(torch.empty_like(t), tmp_path / "x", 5, expected_checksums=crcs[:2])


def test_unaligned_tails_are_written_direct_and_padded(tmp_path):
    eng = SwapEngine("aio")
    with SwapSpace(tmp_path, engine=eng, name="pad") as sp:
        sizes = [1, 4097, 100_003, (1 << 20) + 7]
        data = [random_bytes(n, n) for n in sizes]
        slots = [sp.allocate(n) for n in sizes]
        eng.reset_stats()
        for t, s in zip(data, slots):
            sp.write(t, s).wait()
        assert eng.stats()["buffered"] == 0  # every tail went out as one padded O_DIRECT block
        for t, s in zip(data, slots):
            back = torch.empty_like(t)
            sp.read(back, s).wait()
            assert torch.equal(back, t)
        assert eng.stats()["buffered"] == 0


def test_a_frozen_slot_is_written_copy_on_write_and_freed_with_its_last_reference(tmp_path):
    """``freeze``: a checkpoint holds the slot's bytes; the next contents go to a fresh slot
    (``writable``), the frozen one keeps its bytes and its write checksums, and is freed when
    its last reference goes (``release_refs``); a direct write to it is refused."""
    import torch

    from pyinfinity.swap import SwapSpace

    with SwapSpace(str(tmp_path), name="cow", record_checksums=True) as sp:
        slot = sp.allocate(3 * 4096 + 100, tag="optim.0")
        a = torch.arange(slot.nbytes, dtype=torch.uint8)
        sp.write(a, slot).wait()
        crcs = sp.checksums_of(slot)
        assert crcs and not sp.checksums  # recorded, reads not verified
        ref = object()
        sp.freeze(slot, ref)
        with pytest.raises(ValueError, match="held by a checkpoint"):
            sp.write(a, slot)
        fresh = sp.writable(slot)
        assert fresh.id != slot.id and fresh.nbytes == slot.nbytes
        sp.write(torch.zeros_like(a), fresh).wait()
        back = torch.empty_like(a)
        sp.read(back, slot).wait()
        assert torch.equal(back, a) and sp.checksums_of(slot) == crcs
        used = sp.stats()["used"]
        assert sp.release_refs(lambda r: r is ref) == 0 and sp.stats()["used"] == used  # still held
        assert sp.release_refs(lambda r: False) > 0 and sp.stats()["used"] < used
        assert sp.writable(fresh) is fresh  # nothing holds it


def test_a_swap_file_a_checkpoint_links_is_never_truncated_by_the_next_space(tmp_path):
    import torch

    from pyinfinity.swap import SwapSpace

    sp = SwapSpace(str(tmp_path), name="held")
    slot = sp.allocate(8192)
    sp.write(torch.full((8192,), 7, dtype=torch.uint8), slot).wait()
    os.link(sp.paths[0], tmp_path / "checkpoint-link.swp")
    sp.remove_on_close = False
    sp.close()
    SwapSpace(str(tmp_path), name="held").close()  # opens a fresh file: the linked one keeps its bytes
    assert (tmp_path / "checkpoint-link.swp").read_bytes()[:8192] == bytes([7]) * 8192
