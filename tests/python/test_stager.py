"""CudaStager and the CUDA paths: clean errors without a device, byte-exact transfers with one."""
from __future__ import annotations

import os

import pytest
import torch

from pyinfinity import _C
from pyinfinity.swap import CudaStager, PinnedArena, SwapEngine, cuda_available
from tests.python.conftest import random_bytes



def needs_gpu(test):
    """Part of the GPU suite (``-m gpu``); skipped unless the extension sees a CUDA device."""
    return pytest.mark.gpu(pytest.mark.skipif(not cuda_available(), reason=f"no CUDA device: {_C.cuda_status()}")(test))


def test_no_device_is_a_clear_error_not_a_crash():
    if cuda_available():
        pytest.skip("a CUDA device is present")
    assert _C.cuda_device_count() == 0
    assert _C.cuda_status()  # says why (e.g. "CUDA driver version is insufficient", error 35)
    with pytest.raises(RuntimeError, match="CudaStager needs a CUDA device") as ei:
        CudaStager()
    if not os.path.exists("/proc/driver/nvidia/version"):  # the runtime's "driver insufficient" says it worse
        assert "no NVIDIA driver / no GPU" in str(ei.value) and "insufficient" not in str(ei.value)
    with pytest.raises(RuntimeError, match="CUDA"):
        _C.CudaStager(SwapEngine().core, 0, 1 << 20, 2)


@needs_gpu
@pytest.mark.parametrize("n", [1, 4097, (64 << 20) + 7, 300 << 20])
@pytest.mark.parametrize("offset", [0, 4096, 12345])
def test_file_to_gpu_and_back(tmp_path, n, offset):
    eng = SwapEngine()
    st = CudaStager(eng, chunk_bytes=16 << 20, num_buffers=4)
    data = random_bytes(n, n)
    eng.write(data, tmp_path / "src", offset).wait()
    dev = torch.empty(n, dtype=torch.uint8, device="cuda")
    stream = torch.cuda.Stream()
    st.read_to_device(dev, tmp_path / "src", offset, stream=stream).wait()
    torch.cuda.current_stream().wait_stream(stream)
    assert torch.equal(dev.cpu(), data)
    dev2 = (dev.to(torch.int16) + 1).to(torch.uint8)  # new data computed on the GPU
    st.write_from_device(dev2, tmp_path / "dst", offset).wait()
    back = torch.empty(n, dtype=torch.uint8)
    eng.read(back, tmp_path / "dst", offset).wait()
    assert torch.equal(back, dev2.cpu())


@needs_gpu
def test_pinned_copy_and_arena_is_pinned():
    arena = PinnedArena(64 << 20)
    host = arena.allocate(64 << 20).tensor()
    assert arena.locked_by == "cuda" and host.is_pinned()
    host.copy_(random_bytes(64 << 20, 1))
    dev = torch.empty(64 << 20, dtype=torch.uint8, device="cuda")
    st = CudaStager()
    st.copy(dev, host, synchronize=True)
    assert torch.equal(dev.cpu(), host)


@needs_gpu
def test_stager_errors(tmp_path):
    st = CudaStager()
    with pytest.raises(ValueError, match="must be on cuda"):
        st.read_to_device(torch.empty(10), tmp_path / "x")
    (tmp_path / "short").write_bytes(b"abc")
    with pytest.raises(ValueError, match="read past end"):
        st.read_to_device(torch.empty(10, dtype=torch.uint8, device="cuda"), tmp_path / "short")
