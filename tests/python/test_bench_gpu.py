"""The GPU part of `bench io`, run on the CPU with a stand-in stager: every call it makes is bound
against the real CudaStager's signature, so an API mismatch fails here, not on the GPU box."""
from __future__ import annotations

import contextlib
import inspect

import pytest
import torch

import pyinfinity.swap as swap
from pyinfinity.bench import gpu as bgpu
from pyinfinity.bench.io import IoBenchSettings
from pyinfinity.bench.records import best_peer
from pyinfinity.bench.workload import MiB


class _Stream:
    def synchronize(self) -> None:
        pass


class FakeStager:
    """CPU stand-in for pyinfinity.swap.CudaStager: same methods, moves bytes with the engine."""

    calls: list[str] = []

    def __init__(self, engine=None, device=None, chunk_bytes=None, num_buffers=None) -> None:
        inspect.signature(swap.CudaStager.__init__).bind(self, engine, device=device)
        self.engine = engine

    def _check(self, name, *args, **kwargs):
        inspect.signature(getattr(swap.CudaStager, name)).bind(self, *args, **kwargs)
        FakeStager.calls.append(name)

    def copy(self, dst, src, stream=None, synchronize=False):
        self._check("copy", dst, src, stream=stream, synchronize=synchronize)
        dst.copy_(src)

    def read_to_device(self, tensor, file, offset=0, stream=None):
        self._check("read_to_device", tensor, file, offset, stream=stream)
        return self.engine.read(tensor, file, offset)

    def write_from_device(self, tensor, file, offset=0, stream=None):
        self._check("write_from_device", tensor, file, offset, stream=stream)
        return self.engine.write(tensor, file, offset)

    def stats(self):
        return {}


@pytest.fixture
def fake_cuda(monkeypatch):
    monkeypatch.setattr(swap, "CudaStager", FakeStager)
    monkeypatch.setattr(bgpu, "_new_stream", lambda dev: _Stream())
    monkeypatch.setattr(bgpu, "_synchronize", lambda: None)
    monkeypatch.setattr(bgpu, "_on_stream", lambda s: contextlib.nullcontext())
    FakeStager.calls = []


def test_gpu_figures_with_a_stand_in_stager(fake_cuda, tmp_path):
    s = IoBenchSettings(directory=str(tmp_path), reps=2, gpu_bytes=4 * MiB)
    path = str(tmp_path / "f")
    steps = []
    results = bgpu.run_gpu_bench(s, path, lambda d, t, desc: steps.append((d, t)),
                                 shard_bytes=1 * MiB, device=torch.device("cpu"))
    assert set(FakeStager.calls) == {"copy", "read_to_device", "write_from_device"}
    labels = {(r.op, r.label()) for r in results}
    assert labels == {("h2d", "torch:pinned"), ("h2d", "torch:pageable"), ("h2d", "pyinfinity:stager-pinned"),
                      ("d2h", "torch:pinned"), ("d2h", "torch:pageable"), ("d2h", "pyinfinity:stager-pinned"),
                      ("gpu2nvme", "pyinfinity:disk-only"), ("gpu2nvme", "pyinfinity:stager"),
                      ("nvme2gpu", "pyinfinity:disk-only"), ("nvme2gpu", "pyinfinity:stager")}
    for r in results:
        assert len(r.seconds) == 2 and r.verified is True and r.nbytes == 4 * MiB, r
    st = next(r for r in results if r.op == "nvme2gpu" and r.backend == "stager")
    assert st.n_ops == 4 and st.io_size == 1 * MiB
    assert best_peer(results, st).backend == "disk-only"   # the stager's reference
    h2d = next(r for r in results if r.op == "h2d" and r.tool == "pyinfinity")
    assert best_peer(results, h2d).tool == "torch"
    assert steps[-1][0] == steps[-1][1]                     # progress reaches its total


def test_no_gpu_no_figures(tmp_path):
    if bgpu.gpu_present():
        pytest.skip("a GPU is present")
    assert bgpu.run_gpu_bench(IoBenchSettings(directory=str(tmp_path)), str(tmp_path / "f")) == []
