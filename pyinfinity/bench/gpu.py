"""Host <-> GPU and NVMe <-> GPU figures (run only when a CUDA device is present).

- ``h2d``/``d2h``: torch's own ``copy_`` from pinned and from pageable memory (the reference and
  its contrast), and the engine's copy (CudaStager.copy) from a PinnedArena slab;
- ``nvme2gpu``/``gpu2nvme``: shards streamed through the CudaStager (disk -> pinned bounce ->
  device, chunk by chunk), next to the same shards read/written disk <-> pinned host alone
  ("disk-only"), the time the stager must hide its PCIe copies behind.
"""
from __future__ import annotations

import logging
import time
from typing import Any, Callable, Optional

import torch

from pyinfinity.bench.pattern import fill_pattern, fill_poison, same
from pyinfinity.bench.records import CACHE_DIRECT, Result
from pyinfinity.bench.workload import MiB

log = logging.getLogger(__name__)

SEED = 777


def gpu_present() -> bool:
    try:
        from pyinfinity.swap import cuda_available

        return torch.cuda.is_available() and cuda_available()
    except ImportError:
        return False


# The three CUDA calls the timing needs, as module functions so a CPU test can stand in for them.
def _new_stream(dev: torch.device) -> Any:
    return torch.cuda.Stream(dev)


def _synchronize() -> None:
    torch.cuda.synchronize()


def _on_stream(stream: Any) -> Any:
    return torch.cuda.stream(stream)


def _timed(fn: Callable[[], Any], stream: Any) -> float:
    _synchronize()
    t0 = time.perf_counter()
    with _on_stream(stream):
        fn()
    stream.synchronize()
    return time.perf_counter() - t0


def run_gpu_bench(s: Any, path: str, progress: Optional[Callable[[int, int, str], None]] = None,
                  shard_bytes: int = 128 * MiB, device: Optional[torch.device] = None) -> list[Result]:
    """Every GPU figure for settings ``s`` (an IoBenchSettings); [] without a device."""
    if device is None and not gpu_present():
        log.info("no CUDA device: host<->GPU and NVMe<->GPU figures skipped")
        return []
    from pyinfinity.swap import CudaStager, FileHandle, PinnedArena, SwapEngine

    reps = int(s.reps)
    shard = min(shard_bytes, int(s.gpu_bytes))
    count = max(1, int(s.gpu_bytes) // shard)
    n = shard * count
    dev = device if device is not None else torch.device("cuda", torch.cuda.current_device())
    stream = _new_stream(dev)
    results: list[Result] = []

    arena = PinnedArena(2 * n)
    slab_a, slab_b = arena.allocate(n), arena.allocate(n)
    host = slab_a.tensor(torch.uint8, (n,))
    host_back = slab_b.tensor(torch.uint8, (n,))
    fill_pattern(host, SEED)
    torch_pinned = torch.empty(n, dtype=torch.uint8, pin_memory=torch.cuda.is_available())
    torch_pinned.copy_(host)
    pageable = host.clone()
    gpu = torch.empty(n, dtype=torch.uint8, device=dev)
    engine = SwapEngine(backend="auto", block_size=1 << 20, queue_depth=32, threads=1)
    stager = CudaStager(engine, device=dev.index or 0)
    steps, step = reps * 8, 0

    def tick(desc: str) -> None:
        nonlocal step
        step += 1
        if progress:
            progress(step, steps, desc)

    def result(op: str, tool: str, backend: str, n_ops: int = 1, io: int = 0) -> Result:
        return Result(workload="gpu", op=op, tool=tool, backend=backend, nbytes=n,
                      io_size=io or n, n_ops=n_ops, cache=CACHE_DIRECT)

    # -------- host <-> device copies (same bytes, same stream)
    copies: list[tuple[str, str, str, Callable[[], Any], torch.Tensor]] = [
        ("h2d", "torch", "pinned", lambda: gpu.copy_(torch_pinned, non_blocking=True), gpu),
        ("h2d", "torch", "pageable", lambda: gpu.copy_(pageable), gpu),
        ("h2d", "pyinfinity", "stager-pinned", lambda: stager.copy(gpu, host, stream=stream), gpu),
        ("d2h", "torch", "pinned", lambda: torch_pinned.copy_(gpu, non_blocking=True), torch_pinned),
        ("d2h", "torch", "pageable", lambda: pageable.copy_(gpu), pageable),
        ("d2h", "pyinfinity", "stager-pinned", lambda: stager.copy(host_back, gpu, stream=stream),
         host_back),
    ]
    for op, tool, backend, fn, dst in copies:
        r = result(op, tool, backend)
        if op == "d2h":
            gpu.copy_(host)
        for rep in range(reps):
            tick(f"gpu {op} {tool}:{backend}")
            if rep == 0:
                if op == "h2d":
                    gpu.fill_(0xA5)
                else:
                    fill_poison(dst)
            r.seconds.append(_timed(fn, stream))
            if rep == 0:
                r.verified = same(dst.cpu() if dst.is_cuda else dst, host)
        results.append(r)

    # -------- NVMe <-> device through the stager, vs the same shards disk <-> pinned host alone
    fh = FileHandle(path, "rw")
    if fh.size() < n:
        fh.resize(n)
    disk_w = result("gpu2nvme", "pyinfinity", "disk-only", count, shard)
    disk_r = result("nvme2gpu", "pyinfinity", "disk-only", count, shard)
    st_w = result("gpu2nvme", "pyinfinity", "stager", count, shard)
    st_r = result("nvme2gpu", "pyinfinity", "stager", count, shard)
    gpu.copy_(host)
    _synchronize()
    for rep in range(reps):
        tick("gpu disk-only")
        t0 = time.perf_counter()
        for q in [engine.write(host[i * shard:(i + 1) * shard], fh, i * shard) for i in range(count)]:
            q.wait()
        disk_w.seconds.append(time.perf_counter() - t0)
        if rep == 0:
            fill_poison(host_back)
        t0 = time.perf_counter()
        for q in [engine.read(host_back[i * shard:(i + 1) * shard], fh, i * shard) for i in range(count)]:
            q.wait()
        disk_r.seconds.append(time.perf_counter() - t0)
        if rep == 0:
            disk_w.verified = disk_r.verified = same(host_back, host)

        tick("gpu stager")
        _synchronize()
        t0 = time.perf_counter()
        for q in [stager.write_from_device(gpu[i * shard:(i + 1) * shard], fh, i * shard, stream=stream)
                  for i in range(count)]:
            q.wait()
        st_w.seconds.append(time.perf_counter() - t0)
        dst = torch.full_like(gpu, 0xA5) if rep == 0 else gpu
        _synchronize()
        t0 = time.perf_counter()
        for q in [stager.read_to_device(dst[i * shard:(i + 1) * shard], fh, i * shard, stream=stream)
                  for i in range(count)]:
            q.wait()
        stream.synchronize()
        st_r.seconds.append(time.perf_counter() - t0)
        if rep == 0:
            st_w.verified = st_r.verified = same(dst.cpu(), host)
            del dst
    fh.close()
    for r in (disk_w, st_w, disk_r, st_r):
        r.note = f"{count} shards of {shard // MiB} MiB"
    results += [disk_w, st_w, disk_r, st_r]
    log.debug("stager stats: %s", stager.stats())
    return results
