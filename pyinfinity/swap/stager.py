"""CudaStager: file <-> GPU tensors through pinned bounce buffers, disk and PCIe overlapped."""
from __future__ import annotations

import os
from typing import Optional

import torch

from pyinfinity import _C
from pyinfinity.swap.checks import as_path, check_offset, check_tensor, nbytes
from pyinfinity.swap.engine import FileLike, SwapEngine


def cuda_status_words(status: str) -> str:
    """The CUDA runtime's no-device status (``_C.cuda_status()``) as a user reads it: error 35
    ("driver insufficient") is what the runtime says when no NVIDIA driver is loaded at all, 100
    when the driver sees no GPU."""
    if "cudaError 35" in status:
        if not os.path.exists("/proc/driver/nvidia/version"):
            return "no NVIDIA driver / no GPU"
        return "the NVIDIA driver is older than the CUDA runtime pyinfinity was built with: update the driver"
    if "cudaError 100" in status:
        return "no NVIDIA driver / no GPU (the driver sees no device)"
    return status


def cuda_available() -> bool:
    """True when pyinfinity was built with CUDA and a device is usable."""
    return _C.cuda_compiled() and _C.cuda_device_count() > 0


class CudaStager:
    """Streams file bytes into (and out of) CUDA tensors chunk by chunk.

    The copies run on `stream` (default: torch's current stream of the tensor's device). When
    ``wait()`` returns, the copies into the tensor are enqueued on that stream, so kernels that
    the caller enqueues on it afterwards see the data; writes have reached the file.
    Raises RuntimeError (with the reason) when no CUDA device is usable.
    """

    def __init__(self, engine: Optional[SwapEngine] = None, device: Optional[int] = None,
                 chunk_bytes: Optional[int] = None, num_buffers: Optional[int] = None) -> None:
        if not _C.cuda_compiled() or _C.cuda_device_count() == 0:
            why = cuda_status_words(_C.cuda_status()) if _C.cuda_compiled() else "pyinfinity was built without CUDA"
            raise RuntimeError(f"CudaStager needs a CUDA device: {why}")
        self.engine = engine if engine is not None else SwapEngine()
        dev = torch.cuda.current_device() if device is None else int(device)
        kwargs = {}
        if chunk_bytes is not None:
            kwargs["chunk_bytes"] = chunk_bytes
        if num_buffers is not None:
            kwargs["num_buffers"] = num_buffers
        self.device = dev
        self._core = _C.CudaStager(self.engine.core, dev, **kwargs)

    def _stream(self, tensor: torch.Tensor, stream: Optional[torch.cuda.Stream]) -> int:
        s = stream if stream is not None else torch.cuda.current_stream(tensor.device)
        return s.cuda_stream

    def _file(self, file: FileLike, write: bool) -> _C.FileHandle:
        return file if isinstance(file, _C.FileHandle) else _C.FileHandle(as_path(file), "rw" if write else "r")

    def read_to_device(self, tensor: torch.Tensor, file: FileLike, offset: int = 0,
                       stream: Optional[torch.cuda.Stream] = None) -> _C.StageRequest:
        check_tensor(tensor, device="cuda")
        check_offset(offset)
        return self._core.read_to_device(self._file(file, False), offset, tensor.data_ptr(), nbytes(tensor),
                                         self._stream(tensor, stream), tensor)

    def write_from_device(self, tensor: torch.Tensor, file: FileLike, offset: int = 0,
                          stream: Optional[torch.cuda.Stream] = None) -> _C.StageRequest:
        check_tensor(tensor, device="cuda")
        check_offset(offset)
        return self._core.write_from_device(self._file(file, True), offset, tensor.data_ptr(), nbytes(tensor),
                                            self._stream(tensor, stream), tensor)

    def copy(self, dst: torch.Tensor, src: torch.Tensor, stream: Optional[torch.cuda.Stream] = None,
             synchronize: bool = False) -> None:
        """cudaMemcpyAsync between a (pinned) CPU tensor and a CUDA tensor of the same size."""
        if dst.device.type == src.device.type:
            raise ValueError("copy: one tensor must be on cuda and the other on cpu")
        h2d = dst.device.type == "cuda"
        check_tensor(dst, "dst", "cuda" if h2d else "cpu")
        check_tensor(src, "src", "cpu" if h2d else "cuda")
        if nbytes(dst) != nbytes(src):
            raise ValueError(f"copy: dst has {nbytes(dst)} bytes, src {nbytes(src)}")
        gpu = dst if h2d else src
        self._core.copy(dst.data_ptr(), src.data_ptr(), nbytes(src), h2d, self._stream(gpu, stream), synchronize)

    def stats(self) -> dict:
        return self._core.stats()
