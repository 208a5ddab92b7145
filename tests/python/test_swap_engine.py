"""SwapEngine: every backend, any size and offset, byte for byte; errors; faults; tmpfs."""
from __future__ import annotations

import errno
import os
import threading

import pytest
import torch

from pyinfinity import _C
from pyinfinity.swap import FileHandle, SwapEngine, fault_injection
from tests.python.conftest import random_bytes

BACKENDS = ["aio", "uring", "posix", "auto"]
SIZES = [1, 199, 4095, 4096, 4097, (1 << 20) + 7, 64 << 20]
OFFSETS = [0, 1, 4096, 12345]


def round_trip(engine, path, n, offset, seed=0, misalign=0):
    src = random_bytes(n + misalign, seed)[misalign:]
    engine.write(src, path, offset).wait()
    dst = torch.zeros(n + misalign, dtype=torch.uint8)[misalign:]
    engine.read(dst, path, offset).wait()
    assert torch.equal(src, dst)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("offset", OFFSETS)
def test_any_size_and_offset(tmp_path, backend, size, offset):
    with SwapEngine(backend, block_size=1 << 20, queue_depth=8) as eng:
        path = tmp_path / "data.bin"
        round_trip(eng, path, size, offset, seed=size + offset, misalign=size % 3)
        assert os.path.getsize(path) == offset + size  # never padded, never short


@pytest.mark.parametrize("backend", ["aio", "uring", "posix"])
@pytest.mark.parametrize("queue_depth", [1, 4, 32])
@pytest.mark.parametrize("threads", [1, 3])
@pytest.mark.parametrize("block_size", [4096, 65536, 1 << 20])
def test_queue_depth_threads_block_size(tmp_path, backend, queue_depth, threads, block_size):
    with SwapEngine(backend, block_size=block_size, queue_depth=queue_depth, threads=threads) as eng:
        round_trip(eng, tmp_path / "f", (3 << 20) + 123, 4096 * 3 + 5, seed=queue_depth * threads)
        st = eng.stats()
        assert st["read"]["bytes"] == st["write"]["bytes"] == (3 << 20) + 123
        assert st["read"]["errors"] == st["write"]["errors"] == 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64, torch.float16])
def test_dtypes_and_shapes(tmp_path, dtype):
    with SwapEngine() as eng:
        t = torch.randn(37, 129).to(dtype) if dtype.is_floating_point else torch.randint(-10**9, 10**9, (37, 129))
        eng.write(t, tmp_path / "t", 8).wait()
        u = torch.empty_like(t)
        eng.read(u, tmp_path / "t", 8).wait()
        assert torch.equal(t, u)


def test_many_requests_from_many_threads(tmp_path):
    eng = SwapEngine("auto", block_size=65536, queue_depth=16, threads=2)
    fh = FileHandle(str(tmp_path / "shared"), "rw")
    errors = []

    def worker(k):
        try:
            bufs = [random_bytes(10_000 + 37 * i, seed=k * 100 + i) for i in range(20)]
            offs = [(k * 20 + i) * 20_000 for i in range(20)]
            for r in [eng.write(b, fh, o) for b, o in zip(bufs, offs)]:
                r.wait()
            outs = [torch.empty_like(b) for b in bufs]
            for r in [eng.read(u, fh, o) for u, o in zip(outs, offs)]:
                r.wait()
            for b, u in zip(bufs, outs):
                assert torch.equal(b, u)
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    ts = [threading.Thread(target=worker, args=(k,)) for k in range(8)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    assert not errors, errors
    assert eng.stats()["write"]["ops"] == 160
    fh.close()
    eng.close()


def test_file_reused_across_engines(tmp_path):
    data = random_bytes(1_000_003, seed=5)
    with SwapEngine("aio") as eng:
        eng.write(data, tmp_path / "keep", 777).wait()
    with SwapEngine("uring") as eng:
        back = torch.empty_like(data)
        eng.read(back, tmp_path / "keep", 777).wait()
    assert torch.equal(data, back)


def test_request_keeps_tensor_alive(tmp_path):
    eng = SwapEngine()
    req = eng.write(random_bytes(8 << 20, seed=1), tmp_path / "k")  # tensor only referenced by req
    req.wait()
    assert req.done() and req.nbytes == 8 << 20 and req.is_write


# -- errors ------------------------------------------------------------------------------------
def test_bad_arguments(tmp_path):
    eng = SwapEngine()
    p = tmp_path / "f"
    eng.write(random_bytes(100), p).wait()
    with pytest.raises(ValueError, match="contiguous"):
        eng.write(torch.zeros(10, 10).t(), p)
    with pytest.raises(ValueError, match="zero-size"):
        eng.write(torch.zeros(0), p)
    with pytest.raises(ValueError, match="must be on cpu"):
        eng.write(torch.zeros(10, device="meta"), p)
    with pytest.raises(ValueError, match="offset"):
        eng.write(torch.zeros(10), p, -1)
    with pytest.raises(TypeError, match="offset"):
        eng.write(torch.zeros(10), p, 1.5)
    with pytest.raises(TypeError, match="tensor"):
        eng.write(b"bytes", p)
    with pytest.raises(ValueError, match=r"read past end of file.*has 100 bytes"):
        eng.read(torch.zeros(101, dtype=torch.uint8), p)
    with pytest.raises(ValueError, match="read past end"):
        eng.read(torch.zeros(10, dtype=torch.uint8), p, 95)
    with pytest.raises(ValueError, match="backend"):
        SwapEngine("spdk")
    with pytest.raises(ValueError, match="queue_depth"):
        SwapEngine("aio", queue_depth=0)
    with pytest.raises(ValueError, match="block_size"):
        SwapEngine("aio", block_size=100)
    with pytest.raises(FileNotFoundError) as ei:
        eng.read(torch.zeros(10), tmp_path / "missing")
    assert ei.value.filename == str(tmp_path / "missing")
    with pytest.raises(IsADirectoryError):
        eng.write(torch.zeros(10), tmp_path)
    with pytest.raises(FileNotFoundError):
        eng.write(torch.zeros(10), tmp_path / "no" / "such" / "dir")
    fh = FileHandle(str(p), "r")
    with pytest.raises(ValueError, match="read-only"):
        eng.write(torch.zeros(10), fh)
    fh.close()
    with pytest.raises(ValueError, match="after close"):
        eng.read(torch.zeros(10), fh)
    eng.close()
    with pytest.raises(ValueError, match="after close"):
        eng.write(torch.zeros(10), p)


def test_read_only_mount(readonly_dir):
    eng = SwapEngine()
    with pytest.raises(OSError) as ei:
        eng.write(torch.zeros(10), os.path.join(readonly_dir, "new.bin"))
    assert ei.value.errno == errno.EROFS
    back = torch.empty(8192, dtype=torch.uint8)
    eng.read(back, os.path.join(readonly_dir, "existing.bin")).wait()
    assert bytes(back.numpy()) == b"x" * 8192


def test_real_enospc_on_small_filesystem(tiny_tmpfs_dir):
    eng = SwapEngine()
    req = eng.write(random_bytes(2 << 20), os.path.join(tiny_tmpfs_dir, "big"))
    with pytest.raises(OSError) as ei:
        req.wait()
    assert ei.value.errno == errno.ENOSPC
    assert ei.value.filename.endswith("big")
    assert eng.stats()["write"]["errors"] == 1


def test_no_o_direct_filesystem_uses_posix_and_works(nodirect_dir):
    assert _C.probe_backend(nodirect_dir)["direct_io"] is False
    for backend in ["auto", "aio", "uring", "posix"]:
        with SwapEngine(backend) as eng:
            p = os.path.join(nodirect_dir, f"f-{backend}")
            round_trip(eng, p, (1 << 20) + 7, 3, seed=9)
            assert not FileHandle(p, "r").direct
            if backend == "auto":
                assert eng.backend_for(p) == "posix"


def test_tmpfs_works_with_auto(tmpfs_dir):
    with SwapEngine() as eng:
        round_trip(eng, os.path.join(tmpfs_dir, "t"), (4 << 20) + 1, 4095, seed=10)


# -- the fault seam ----------------------------------------------------------------------------
@pytest.mark.parametrize("code", [errno.EIO, errno.ENOSPC])
def test_injected_error_raises_at_wait(tmp_path, code):
    eng = SwapEngine("aio", block_size=4096, queue_depth=4)
    p = tmp_path / "f"
    eng.write(random_bytes(1 << 16, 1), p).wait()
    with fault_injection(op="write", nth=3, action="errno", value=code):
        req = eng.write(random_bytes(1 << 16, 2), p)
        with pytest.raises(OSError) as ei:
            req.wait()
    assert ei.value.errno == code
    assert ei.value.filename == str(p)
    assert "write of 4096 bytes at offset" in ei.value.strerror
    # the engine keeps working after a failure
    round_trip(eng, p, 1 << 16, 0, seed=3)


@pytest.mark.parametrize("backend", ["aio", "uring", "posix"])
def test_eintr_and_short_transfers_are_retried(tmp_path, backend):
    eng = SwapEngine(backend, block_size=8192, queue_depth=4)
    with fault_injection(op="any", nth=2, action="errno", value=errno.EINTR, count=3):
        round_trip(eng, tmp_path / "a", 100_000, 5, seed=4)
    with fault_injection(op="any", nth=1, action="short", count=0):
        round_trip(eng, tmp_path / "b", 100_000, 4096, seed=5)
    st = eng.stats()
    assert st["retries"] >= 3
    assert st["short_resubmits"] > 0


def test_stall_times_out_with_a_message(tmp_path):
    eng = SwapEngine("aio", block_size=4096, queue_depth=2)
    p = tmp_path / "s"
    eng.write(random_bytes(8192), p).wait()
    with fault_injection(op="read", nth=1, action="stall", value=600):
        req = eng.read(torch.empty(8192, dtype=torch.uint8), p)
        with pytest.raises(TimeoutError, match=r"no I/O progress.*read of 8192 bytes.*" + str(p.name)):
            req.wait(timeout=0.1)
        req.wait()  # completes once the stall is over


def test_fault_env_var_is_parsed(tmp_path):
    import subprocess
    import sys
    code = ("import torch, errno; from pyinfinity.swap import SwapEngine; e=SwapEngine('posix');\n"
            "try:\n  e.write(torch.ones(10), %r).wait()\nexcept OSError as x: print('errno', x.errno)" % str(tmp_path / "e"))
    env = dict(os.environ, PYINFINITY_FAULT="op=write,nth=1,action=errno,value=28")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert "errno 28" in out.stdout, out.stderr
    env["PYINFINITY_FAULT"] = "op=sideways"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode != 0 and "PYINFINITY_FAULT: op must be" in out.stderr
