"""AioHandle: DeepSpeed 0.19's aio_handle API and return conventions, minus its failure modes."""
from __future__ import annotations

import errno
import os
import re
from pathlib import Path

import pytest
import torch

from pyinfinity.aio import AioHandle
from pyinfinity.swap import fault_injection
from tests.python.conftest import random_bytes


def deepspeed_aio_methods() -> set:
    """Method names DeepSpeed's aio_handle binds, read from the installed deepspeed's source."""
    ds = pytest.importorskip("deepspeed")
    src = Path(ds.__file__).parent / "ops" / "csrc" / "aio" / "py_lib" / "py_ds_aio.cpp"
    if not src.exists():
        pytest.skip("deepspeed's aio sources are not installed")
    text = src.read_text()
    block = text[text.index('py::class_<deepspeed_aio_handle_t>'):]
    block = block[: block.index(";")]
    return set(re.findall(r'\.def\(\s*"(\w+)"', block))


def test_has_every_deepspeed_method():
    missing = sorted(m for m in deepspeed_aio_methods() if not hasattr(AioHandle, m))
    assert not missing, f"AioHandle lacks {missing}"


def test_constructor_defaults_and_getters():
    h = AioHandle()
    assert (h.get_block_size(), h.get_queue_depth(), h.get_single_submit(), h.get_overlap_events(),
            h.get_intra_op_parallelism()) == (1048576, 128, False, False, 1)
    h = AioHandle(block_size=65536, queue_depth=8, single_submit=True, overlap_events=True, intra_op_parallelism=2)
    assert (h.get_block_size(), h.get_queue_depth(), h.get_intra_op_parallelism()) == (65536, 8, 2)
    assert h.get_alignment() == 2 * 512
    with pytest.raises(ValueError, match="queue_depth"):
        AioHandle(queue_depth=0)


def test_return_conventions(tmp_path):
    h = AioHandle(queue_depth=32)
    t = torch.randn(1000)
    assert h.async_pwrite(t, str(tmp_path / "a")) == 0
    assert h.async_pwrite(t, str(tmp_path / "b")) == 0
    assert h.wait() == 2
    u = torch.empty(1000)
    assert h.sync_pread(u, str(tmp_path / "a")) == 1
    assert torch.equal(t, u)
    assert h.sync_pwrite(t, str(tmp_path / "c")) == 1
    assert h.pwrite(t, str(tmp_path / "d"), False, True) == 0
    assert h.pwrite(t, str(tmp_path / "d2"), False, True) == 0
    assert h.wait() == 2
    assert h.pread(u, str(tmp_path / "d"), False, True) == 0  # (a read may not race its file's write)
    assert h.wait() == 1
    assert h.pread(u, str(tmp_path / "d"), True, False) == 1  # validate
    assert h.read(u, str(tmp_path / "d"), True) == 0
    assert h.write(t, str(tmp_path / "e"), True) == 0
    assert h.wait() == 0  # nothing pending


@pytest.mark.parametrize("n", [1, 199, 4000, 4095, 4097, (1 << 20) + 7])
@pytest.mark.parametrize("intra_op", [1, 3])
def test_odd_sizes_and_pageable_misaligned_buffers(tmp_path, n, intra_op):
    # DeepSpeed's handle, tried here: a 4000-byte write returned success and left a 0-byte file.
    h = AioHandle(queue_depth=32, intra_op_parallelism=intra_op)
    src = random_bytes(n + 1, n)[1:]  # misaligned pageable memory
    p = str(tmp_path / "odd")
    assert h.sync_pwrite(src, p, 0) == 1
    assert os.path.getsize(p) == n
    dst = torch.zeros(n + 3, dtype=torch.uint8)[3:]
    assert h.sync_pread(dst, p, 0) == 1
    assert torch.equal(src, dst)


def test_file_descriptor_and_offsets(tmp_path):
    h = AioHandle(queue_depth=8)
    p = tmp_path / "fd.bin"
    t = random_bytes(10_001, 1)
    fd = os.open(p, os.O_CREAT | os.O_WRONLY, 0o644)
    try:
        assert h.async_pwrite(t, fd, 4097) == 0
        assert h.wait() == 1
    finally:
        os.close(fd)
    u = torch.empty_like(t)
    h.sync_pread(u, str(p), 4097)
    assert torch.equal(t, u)
    with pytest.raises(OSError) as ei:
        h.async_pwrite(t, 987654)
    assert ei.value.errno == errno.EBADF


def test_locked_tensors():
    h = AioHandle()
    example = torch.empty(0, dtype=torch.bfloat16)
    t = h.new_cpu_locked_tensor(12345, example)
    assert t.dtype == torch.bfloat16 and t.numel() == 12345
    assert h.is_pinned(t) and h.is_pinned(t[100:])
    assert not h.is_pinned(torch.empty(10))
    assert h.free_cpu_locked_tensor(t) is True
    assert h.free_cpu_locked_tensor(t) is False                  # freed twice: False, as DeepSpeed's
    assert h.free_cpu_locked_tensor(torch.empty(3)) is False     # not allocated here


def test_failed_async_op_raises_at_wait_with_errno_and_path(tmp_path):
    h = AioHandle(block_size=4096, queue_depth=4)
    p = str(tmp_path / "bad")
    ok = torch.ones(4096 * 4, dtype=torch.uint8)
    with fault_injection(op="write", nth=2, action="errno", value=errno.EIO):
        assert h.async_pwrite(ok, p) == 0
        assert h.async_pwrite(ok, str(tmp_path / "good")) == 0
        with pytest.raises(OSError) as ei:
            h.wait()
    assert ei.value.errno == errno.EIO and ei.value.filename == p
    assert h.wait() == 0  # the failure consumed both operations; nothing left pending


def test_bad_input(tmp_path):
    h = AioHandle()
    with pytest.raises(ValueError, match="contiguous"):
        h.async_pwrite(torch.zeros(4, 4).t(), str(tmp_path / "x"))
    with pytest.raises(ValueError, match="zero-size"):
        h.async_pwrite(torch.zeros(0), str(tmp_path / "x"))
    with pytest.raises(ValueError, match="file_offset"):
        h.async_pwrite(torch.zeros(4), str(tmp_path / "x"), -5)
    with pytest.raises(ValueError, match="cpu or cuda"):
        h.async_pwrite(torch.zeros(4, device="meta"), str(tmp_path / "x"))
    with pytest.raises(FileNotFoundError):
        h.sync_pread(torch.zeros(4), str(tmp_path / "nope"))
    h.sync_pwrite(torch.zeros(4), str(tmp_path / "small"))
    with pytest.raises(ValueError, match="read past end of file"):
        h.sync_pread(torch.zeros(5), str(tmp_path / "small"))


def test_filesystem_without_o_direct(nodirect_dir):
    h = AioHandle(queue_depth=16)
    t = random_bytes(3_000_001, 2)
    p = os.path.join(nodirect_dir, "t")
    assert h.sync_pwrite(t, p) == 1
    u = torch.empty_like(t)
    assert h.sync_pread(u, p) == 1
    assert torch.equal(t, u)
    assert h.engine.backend_for(p) == "posix"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_tensors_are_staged(tmp_path):
    h = AioHandle()
    t = torch.randn(1_000_003, device="cuda")
    h.sync_pwrite(t, str(tmp_path / "g"))
    u = torch.empty_like(t)
    assert h.async_pread(u, str(tmp_path / "g")) == 0
    assert h.wait() == 1
    assert torch.equal(t, u)


def test_locked_tensors_are_process_wide():
    # DeepSpeed keeps one pin manager per process; its swappers allocate with one handle and
    # check or free with another.
    a, b = AioHandle(), AioHandle()
    t = a.new_cpu_locked_tensor(1024, torch.empty(0))
    assert b.is_pinned(t) and b.is_pinned(t[10:20])
    whole = torch.empty(0).set_(t.untyped_storage(), 0, (1024,))
    assert b.is_pinned(whole)
    assert b.free_cpu_locked_tensor(t) is True
    assert a.free_cpu_locked_tensor(t) is False
