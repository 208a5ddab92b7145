"""Host <-> GPU and NVMe <-> GPU figures (run only when a CUDA device is present).

- ``h2d``/``d2h``: torch's own ``copy_`` from pinned and from pageable memory (the reference and
  its contrast), and the engine's copy (CudaStager.copy) from a PinnedArena slab;
- ``nvme2gpu``/``gpu2nvme``: shards streamed through the CudaStager (disk -> pinned bounce ->
  device, chunk by chunk), next to the same shards read/written disk <-> pinned host alone, the
  figure the stager must hide its PCIe copies behind.
Uses pyinfinity._C directly: the stager takes raw device pointers and stream handles.
"""
from __future__ import annotations

import logging
import os
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
        import pyinfinity._C as C

        return torch.cuda.is_available() and C.cuda_device_count() > 0
    except ImportError:
        return torch.cuda.is_available()


def _timed_cuda(fn: Callable[[], Any], stream: "torch.cuda.Stream") -> float:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    stream.synchronize()
    torch.cuda.synchronize()
    return time.perf_counter() - t0


def run_gpu_bench(s: Any, path: str, progress: Optional[Callable[[int, int, str], None]] = None,
                  shard_bytes: int = 128 * MiB) -> list[Result]:
    """Every GPU figure for settings ``s`` (an IoBenchSettings); [] without a device."""
    if not gpu_present():
        log.info("no CUDA device: host<->GPU and NVMe<->GPU figures skipped")
        return []
    import pyinfinity._C as C

    n = int(s.gpu_bytes)
    reps = int(s.reps)
    dev = torch.device("cuda", torch.cuda.current_device())
    stream = torch.cuda.Stream(dev)
    sptr = stream.cuda_stream
    results: list[Result] = []

    arena = C.PinnedArena(2 * n)
    slab_a, slab_b = arena.allocate(n), arena.allocate(n)
    host = torch.frombuffer(slab_a, dtype=torch.uint8)
    host_back = torch.frombuffer(slab_b, dtype=torch.uint8)
    fill_pattern(host, SEED)
    torch_pinned = torch.empty(n, dtype=torch.uint8, pin_memory=True)
    torch_pinned.copy_(host)
    pageable = host.clone()
    gpu = torch.empty(n, dtype=torch.uint8, device=dev)
    engine = C.SwapEngine("auto", 1 << 20, 32, 1)
    stager = C.CudaStager(engine, dev.index or 0)
    steps = reps * 8
    step = 0

    def tick(desc: str) -> None:
        nonlocal step
        step += 1
        if progress:
            progress(step, steps, desc)

    def result(op: str, tool: str, backend: str, nbytes: int, n_ops: int = 1, io: int = 0) -> Result:
        return Result(workload="gpu", op=op, tool=tool, backend=backend, nbytes=nbytes,
                      io_size=io or nbytes, n_ops=n_ops, block_size=stager.chunk_bytes,
                      queue_depth=stager.num_buffers, cache=CACHE_DIRECT)

    # -------- host <-> device copies
    copies = {
        ("h2d", "torch", "pinned"): lambda: gpu.copy_(torch_pinned, non_blocking=True),
        ("h2d", "torch", "pageable"): lambda: gpu.copy_(pageable),
        ("h2d", "pyinfinity", "stager-pinned"):
            lambda: stager.copy(gpu.data_ptr(), slab_a.ptr, n, True, sptr, False),
        ("d2h", "torch", "pinned"): lambda: torch_pinned.copy_(gpu, non_blocking=True),
        ("d2h", "torch", "pageable"): lambda: pageable.copy_(gpu),
        ("d2h", "pyinfinity", "stager-pinned"):
            lambda: stager.copy(slab_b.ptr, gpu.data_ptr(), n, False, sptr, False),
    }
    for (op, tool, backend), fn in copies.items():
        r = result(op, tool, backend, n)
        r.block_size = r.queue_depth = 0
        for rep in range(reps):
            tick(f"gpu {op} {tool}:{backend}")
            with torch.cuda.stream(stream):
                r.seconds.append(_timed_cuda(fn, stream))
            if rep == 0:
                if op == "h2d":
                    r.verified = same(gpu.cpu(), host)
                else:
                    back = host_back if tool == "pyinfinity" else (torch_pinned if backend == "pinned"
                                                                    else pageable)
                    r.verified = same(back, host)
                    fill_poison(host_back)
        results.append(r)

    # -------- NVMe <-> device through the stager, vs the disk alone
    shard = min(shard_bytes, n)
    count = max(1, n // shard)
    total = shard * count
    fh = C.FileHandle(path, "rw", True)
    if fh.size() < total:
        fh.resize(total)
    # the reference: the same shards disk <-> pinned host with the same engine
    disk_w = result("gpu2nvme", "pyinfinity", "disk-only(write)", total, count, shard)
    disk_r = result("nvme2gpu", "pyinfinity", "disk-only(read)", total, count, shard)
    st_w = result("gpu2nvme", "pyinfinity", "stager", total, count, shard)
    st_r = result("nvme2gpu", "pyinfinity", "stager", total, count, shard)
    gpu.copy_(host)
    torch.cuda.synchronize()
    for rep in range(reps):
        tick("gpu disk-only")
        t0 = time.perf_counter()
        reqs = [engine.submit(fh, slab_a.ptr + i * shard, shard, i * shard, True) for i in range(count)]
        for q in reqs:
            q.wait()
        disk_w.seconds.append(time.perf_counter() - t0)
        fill_poison(host_back)
        t0 = time.perf_counter()
        reqs = [engine.submit(fh, slab_b.ptr + i * shard, shard, i * shard, False) for i in range(count)]
        for q in reqs:
            q.wait()
        disk_r.seconds.append(time.perf_counter() - t0)
        if rep == 0:
            disk_w.verified = disk_r.verified = same(host_back[:total], host[:total])

        tick("gpu stager")
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        reqs = [stager.write_from_device(fh, i * shard, gpu.data_ptr() + i * shard, shard, sptr)
                for i in range(count)]
        for q in reqs:
            q.wait()
        st_w.seconds.append(time.perf_counter() - t0)
        gpu2 = torch.empty_like(gpu) if rep == 0 else gpu
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        reqs = [stager.read_to_device(fh, i * shard, gpu2.data_ptr() + i * shard, shard, sptr)
                for i in range(count)]
        for q in reqs:
            q.wait()
        stream.synchronize()
        st_r.seconds.append(time.perf_counter() - t0)
        if rep == 0:
            st_w.verified = st_r.verified = same(gpu2[:total].cpu(), host[:total])
            del gpu2
    fh.close()
    for r in (disk_w, st_w, disk_r, st_r):
        r.note = f"{count} shards of {shard // MiB} MiB"
    results += [disk_w, st_w, disk_r, st_r]
    stager_stats = stager.stats()
    log.debug("stager stats: %s", stager_stats)
    del stager, engine
    return results
