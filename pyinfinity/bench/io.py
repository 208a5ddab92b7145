"""`pyinfinity bench io`: read/write GB/s of each pyinfinity backend over a sweep, with its peers
(fio, dd, DeepSpeed's aio handle) on the same file in the same run.

Fairness rules: every tool moves the same bytes of the same file; repetitions interleave the tools
(rep 1 of every tool, then rep 2, ...) so drift hits all alike; each tool reads back what it just
wrote and the first repetition of every configuration is verified; page cache is kept out by
O_DIRECT, else by dropping caches (root), else the figure is labelled "cached".
"""
from __future__ import annotations

import dataclasses
import itertools
import logging
import os
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Optional

import torch

from pyinfinity.bench import machine as mach
from pyinfinity.bench.pattern import fill_pattern, fill_poison, same
from pyinfinity.bench.peers import (FIO_ENGINES, DdRunner, DeepSpeedRunner, FioRunner, Runner, flag_suspect_peers,
                                    Sample, fio_engine_works, fio_status)
from pyinfinity.bench.records import (CACHE_CACHED, CACHE_DIRECT, CACHE_DROPPED, CACHE_MEMORY,
                                      SCHEMA, PeerStatus, Result)
from pyinfinity.bench.workload import (GiB, KiB, MiB, IoConfig, file_config, small_config,
                                       small_odd_config)
from pyinfinity.swap.manifest import fsync_path

log = logging.getLogger(__name__)

BENCH_FILE = "pyinfinity-bench.dat"
SEED = 20261202
PYINF_BACKENDS = ("aio", "uring", "posix")


@dataclass
class IoBenchSettings:
    """The sweep. Defaults are the full sweep; :func:`quick_settings` is the < 30 s preset."""

    directory: str
    file_size: int = 1 * GiB
    block_sizes: list[int] = field(default_factory=lambda: [256 * KiB, 1 * MiB, 4 * MiB])
    queue_depths: list[int] = field(default_factory=lambda: [1, 8, 32, 128])
    threads: list[int] = field(default_factory=lambda: [1, 2])
    io_sizes: list[int] = field(default_factory=lambda: [1 * GiB])   # per request; add 64M etc.
    reps: int = 3
    backends: Optional[list[str]] = None          # None: every backend that works on the directory
    peers: list[str] = field(default_factory=lambda: ["fio", "dd", "deepspeed"])
    fio_engines: list[str] = field(default_factory=lambda: list(FIO_ENGINES))
    small_count: int = 4096                       # many-small-tensors workload; 0 skips it
    small_size: int = 256 * KiB
    small_queue_depths: list[int] = field(default_factory=lambda: [32])
    small_block_size: int = 1 * MiB
    odd_sizes: bool = True
    aio_handle: bool = True                       # also pyinfinity.aio.AioHandle (DeepSpeed's API)
    deepspeed_build: bool = False
    fio_batch: bool = False                       # fio runs all repetitions in one process
    disk: bool = True                             # False: GPU figures only (no file sweep, no peers)
    gpu: bool = True                              # host<->GPU and NVMe<->GPU when a GPU is present
    gpu_bytes: int = 1 * GiB
    keep_file: bool = False


def quick_settings(directory: str) -> IoBenchSettings:
    return IoBenchSettings(directory=directory, file_size=64 * MiB, block_sizes=[1 * MiB],
                           queue_depths=[1, 32], threads=[1], io_sizes=[64 * MiB], reps=3,
                           fio_engines=["libaio"], small_count=256, small_size=256 * KiB,
                           gpu_bytes=256 * MiB, fio_batch=True)


@dataclass
class BenchRun:
    """Everything one `bench io` run produced; :meth:`to_json` is the ``--json`` file."""

    settings: IoBenchSettings
    machine: mach.MachineInfo
    peers: list[PeerStatus]
    backends: dict[str, str]          # pyinfinity backend -> "ok" or why it was skipped
    cache: str                        # how page cache was kept out of the disk figures
    results: list[Result] = field(default_factory=list)
    seconds: float = 0.0
    argv: list[str] = field(default_factory=list)
    load_avg: list[float] = field(default_factory=list)   # 1-minute load at start and at end

    def to_json(self) -> dict[str, Any]:
        return {"schema": SCHEMA, "argv": self.argv, "seconds": self.seconds, "load_avg": self.load_avg,
                "settings": asdict(self.settings), "machine": asdict(self.machine),
                "peers": [asdict(p) for p in self.peers], "backends": self.backends,
                "cache": self.cache, "results": [r.to_json() for r in self.results]}


# ------------------------------------------------------------------------------------- pyinfinity
class PyinfinityRunner:
    """pyinfinity's SwapEngine with one backend; all requests of a configuration are submitted
    before the first wait, as the swapper does. Buffers come from one PinnedArena."""

    tool = "pyinfinity"

    def __init__(self, backend: str, fsync_writes: bool) -> None:
        self.backend = backend
        self.fsync_writes = fsync_writes
        self._engines: dict[tuple[int, int, int], Any] = {}
        self._arena: Any = None
        self._src: Optional[torch.Tensor] = None
        self._dst: Optional[torch.Tensor] = None
        self._slabs: list[Any] = []

    def supports(self, cfg: IoConfig) -> Optional[str]:
        return None

    def _engine(self, cfg: IoConfig) -> Any:
        from pyinfinity.swap import SwapEngine

        key = (cfg.block_size, cfg.queue_depth, cfg.threads)
        if key not in self._engines:
            self._engines[key] = SwapEngine(backend=self.backend, block_size=cfg.block_size,
                                            queue_depth=cfg.queue_depth, threads=cfg.threads)
        return self._engines[key]

    def _buffers(self, nbytes: int) -> tuple[torch.Tensor, torch.Tensor]:
        if self._src is None or self._src.numel() < nbytes:
            self._release_buffers()
            self._src, self._dst = pinned_pair(nbytes, self)
            fill_pattern(self._src, SEED)
        assert self._src is not None and self._dst is not None
        return self._src, self._dst

    def _release_buffers(self) -> None:
        self._src = self._dst = None
        self._slabs.clear()
        self._arena = None

    def run(self, cfg: IoConfig, path: str, verify: bool) -> Sample:
        eng = self._engine(cfg)
        src, dst = self._buffers(cfg.nbytes)
        if cfg.op == "read":
            fill_poison(dst[:cfg.nbytes])
        buf = src if cfg.op == "write" else dst
        submit = eng.write if cfg.op == "write" else eng.read
        t0 = time.perf_counter()
        reqs = [submit(buf[o:o + s], path, o) for o, s in cfg.requests()]
        for r in reqs:
            r.wait()
        if cfg.op == "write" and self.fsync_writes:
            fsync_path(path)
        seconds = time.perf_counter() - t0
        verified: Optional[bool] = None
        if verify:
            if cfg.op == "write":  # untimed read-back
                fill_poison(dst[:cfg.nbytes])
                for r in [eng.read(dst[o:o + s], path, o) for o, s in cfg.requests()]:
                    r.wait()
            verified = same(src[:cfg.nbytes], dst[:cfg.nbytes])
        return Sample(seconds, cfg.nbytes, verified)

    def close(self) -> None:
        self._engines.clear()
        self._release_buffers()


class AioHandleRunner(PyinfinityRunner):
    """pyinfinity's DeepSpeed-compatible ``AioHandle`` (what the DeepSpeed integration hands to
    DeepSpeed), driven exactly as the DeepSpeed worker drives DeepSpeed's handle."""

    def __init__(self) -> None:
        super().__init__("AioHandle", fsync_writes=False)

    def _engine(self, cfg: IoConfig) -> Any:
        from pyinfinity.aio import AioHandle

        key = (cfg.block_size, cfg.queue_depth, cfg.threads)
        if key not in self._engines:
            self._engines[key] = AioHandle(block_size=cfg.block_size, queue_depth=cfg.queue_depth,
                                           single_submit=False, overlap_events=False,
                                           intra_op_parallelism=cfg.threads)
        return self._engines[key]

    def run(self, cfg: IoConfig, path: str, verify: bool) -> Sample:
        h = self._engine(cfg)
        src, dst = self._buffers(cfg.nbytes)
        if cfg.op == "read":
            fill_poison(dst[:cfg.nbytes])
        buf = src if cfg.op == "write" else dst
        reqs = list(cfg.requests())
        t0 = time.perf_counter()
        if len(reqs) == 1:
            done = (h.sync_pwrite if cfg.op == "write" else h.sync_pread)(buf[:cfg.nbytes], path, 0)
        else:
            submit = h.async_pwrite if cfg.op == "write" else h.async_pread
            for o, n in reqs:
                submit(buf[o:o + n], path, o)
            done = h.wait()
        seconds = time.perf_counter() - t0
        if done != len(reqs):
            raise RuntimeError(f"AioHandle completed {done} of {len(reqs)} {cfg.op}s")
        verified: Optional[bool] = None
        if verify:
            if cfg.op == "write":
                fill_poison(dst[:cfg.nbytes])
                h.sync_pread(dst[:cfg.nbytes], path, 0)
            verified = same(src[:cfg.nbytes], dst[:cfg.nbytes])
        return Sample(seconds, cfg.nbytes, verified)


def pinned_pair(nbytes: int, owner: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """Two ``nbytes`` uint8 tensors from one PinnedArena (kept alive through ``owner``)."""
    from pyinfinity.swap import PinnedArena

    align = 1 << 20
    per = (nbytes + align - 1) // align * align
    arena = PinnedArena(2 * per)
    slabs = [arena.allocate(per), arena.allocate(per)]
    owner._arena, owner._slabs = arena, slabs
    a, b = (s.tensor(torch.uint8, (per,)) for s in slabs)
    return a, b


def working_backends(directory: str, wanted: Optional[list[str]] = None) -> dict[str, str]:
    """pyinfinity backend -> "ok", or why it cannot run on ``directory`` (live round trip with an
    odd size at an odd offset, see report.probe_backends)."""
    from pyinfinity.bench.report import probe_backends

    status = {p.backend: ("ok" if p.ok else p.detail) for p in probe_backends(directory)}
    if wanted:
        return {b: status.get(b, "unknown backend") for b in wanted}
    return status


# ----------------------------------------------------------------------------------------- sweep
ProgressFn = Callable[[int, int, str], None]


def _configs(s: IoBenchSettings) -> list[IoConfig]:
    """Every configuration of the sweep, writes and reads paired (write first)."""
    out: list[IoConfig] = []
    if not s.disk:
        return out
    for bs, qd, th, io in itertools.product(s.block_sizes, s.queue_depths, s.threads, s.io_sizes):
        if io > s.file_size:
            continue
        out.append(file_config("write", s.file_size, bs, qd, th, io))
    if s.small_count:
        for qd in s.small_queue_depths:
            out.append(small_config("write", s.small_count, s.small_size, s.small_block_size, qd, 1))
            if s.odd_sizes:
                out.append(small_odd_config("write", s.small_count, s.small_size,
                                            s.small_block_size, qd, 1))
    return out


def _peer_config_filter(runner: Runner, cfg: IoConfig, seen: set) -> bool:
    """Peers ignore ``io_size`` (fio and dd stream the file): run them once per setting."""
    if runner.tool == "pyinfinity" or cfg.workload != "file":
        return True
    key = (runner.tool, runner.backend, cfg.block_size, cfg.queue_depth, cfg.threads)
    if key in seen:
        return False
    seen.add(key)
    return True


def prepare_file(path: str, nbytes: int) -> None:
    """Create ``path`` with ``nbytes`` of written (not sparse, not unwritten-extent) data, so every
    tool overwrites allocated blocks; leave it out of the page cache."""
    if os.path.exists(path) and os.path.getsize(path) >= nbytes:
        return
    chunk = bytes(range(1, 256)) * (4 * MiB // 255 + 1)
    with open(path, "wb") as f:
        left = nbytes
        while left > 0:
            k = min(left, 4 * MiB)
            f.write(chunk[:k])
            left -= k
        f.flush()
        os.fsync(f.fileno())
        os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)


def _cache_mode(info: mach.MachineInfo, fs: mach.FsInfo) -> tuple[bool, str]:
    """(use O_DIRECT, cache label) for the directory."""
    direct = info.o_direct and not fs.in_memory
    if fs.in_memory:
        return direct, CACHE_MEMORY
    if direct:
        return direct, CACHE_DIRECT
    return direct, CACHE_DROPPED if mach.can_drop_caches() else CACHE_CACHED


def _make_runners(s: IoBenchSettings, info: mach.MachineInfo, direct: bool,
                  ds: Optional[DeepSpeedRunner], runners: list[Runner]
                  ) -> tuple[list[PeerStatus], dict[str, str]]:
    """Append every tool that can run here to ``runners``; return the peers' status and the
    pyinfinity backends' status (each "ok" or why not)."""
    want_handle = s.aio_handle and (s.backends is None or "AioHandle" in s.backends)
    wanted = [b for b in s.backends if b != "AioHandle"] if s.backends else None
    backends = working_backends(s.directory, wanted or None)
    peers: list[PeerStatus] = []
    for b, why in backends.items():
        if why == "ok":
            # without O_DIRECT the engine writes through the page cache: time the fsync in
            runners.append(PyinfinityRunner(b, fsync_writes=not direct))
        else:
            log.warning("pyinfinity backend %s skipped: %s", b, why)
    if want_handle and any(why == "ok" for why in backends.values()):
        runners.append(AioHandleRunner())
    if "fio" in s.peers:
        st = fio_status()
        peers.append(st)
        if st.available:
            for eng in s.fio_engines:
                why = fio_engine_works(eng, s.directory, direct)
                if why is None:
                    runners.append(FioRunner(eng, direct, batch_reps=s.reps if s.fio_batch else 0))
                else:
                    peers.append(PeerStatus(f"fio:{eng}", False, note=why))
        else:
            log.warning("%s", st.note)
    if "dd" in s.peers:
        ok = info.tools.get("dd") is not None
        peers.append(PeerStatus("dd", ok, version=info.tools.get("dd") or "",
                                note="" if ok else "dd (coreutils) not found"))
        if ok:
            runners.append(DdRunner(direct))
    if ds is not None:
        st = ds.start()
        peers.append(st)
        if st.available:
            runners.append(ds)
        else:
            log.warning("DeepSpeed aio peer unavailable: %s", st.note)
    return peers, backends


def _measure(cfg: IoConfig, rs: list[Runner], path: str, reps: int, cache: str, drop_odd: bool,
             tick: Callable[[str], None]) -> list[Result]:
    """Every repetition of one configuration: per repetition, each tool writes then reads back."""
    results: dict[tuple[int, str], Result] = {}
    skip: dict[int, str] = {}
    for i, r in enumerate(rs):
        why = r.supports(cfg)
        if why:
            skip[i] = why
        for op in ("write", "read"):
            c = cfg.with_op(op)
            results[(i, op)] = Result(
                workload=c.workload, op=op, tool=r.tool, backend=r.backend, nbytes=c.nbytes,
                block_size=c.block_size, queue_depth=c.queue_depth, threads=c.threads,
                io_size=c.io_size, n_ops=c.n_ops, cache=cache, note=skip.get(i, ""))
    for rep in range(reps):
        for i, r in enumerate(rs):
            tick(f"{cfg.workload} {r.tool}:{r.backend}")
            if i in skip:
                continue
            w = results[(i, "write")]
            if w.note and not w.seconds:
                continue  # its first write failed: nothing to read back, no retries
            for op in ("write", "read"):
                res = results[(i, op)]
                if res.note and not res.seconds:
                    continue  # failed on its first repetition
                # unaligned heads/tails go through the page cache even with O_DIRECT: drop it
                # before reads of odd sizes too, so they come from the disk
                if op == "read" and (cache == CACHE_DROPPED or (drop_odd and not cfg.aligned)):
                    if not mach.drop_page_cache(path):
                        res.cache = CACHE_CACHED  # the drop was refused (a container, say)
                try:
                    smp = r.run(cfg.with_op(op), path, verify=(rep == 0))
                except Exception as exc:  # a tool failing is a result, not a crash
                    log.warning("%s:%s %s failed: %s", r.tool, r.backend, op, exc)
                    res.note = f"failed: {exc}"[:300]
                    if op == "write":
                        break  # its read would check bytes that were never written
                    continue
                res.seconds.append(smp.seconds)
                res.nbytes = smp.nbytes
                if smp.verified is not None:
                    res.verified = smp.verified if res.verified in (None, True) else False
    return [results[(i, op)] for i in range(len(rs)) for op in ("write", "read")]


def run_io_bench(s: IoBenchSettings, progress: Optional[ProgressFn] = None,
                 argv: Optional[list[str]] = None) -> BenchRun:
    """The whole `bench io` run: set-up, every configuration with every tool, GPU figures."""
    t_start = time.perf_counter()
    load0 = os.getloadavg()[0]
    if load0 > 0.5 * (os.cpu_count() or 1):
        log.warning("load average %.1f on %d cores: other work shares this machine and will add "
                    "noise (tools are interleaved repetition by repetition, so ratios stay fair)",
                    load0, os.cpu_count() or 1)
    ds: Optional[DeepSpeedRunner] = None
    if not s.disk:
        s = dataclasses.replace(s, peers=[], aio_handle=False, backends=["posix"])
    if "deepspeed" in s.peers:
        ds = DeepSpeedRunner(allow_build=s.deepspeed_build)
        ds.begin()  # its imports overlap the set-up below; measurements start after it is ready
    runners: list[Runner] = []
    path = os.path.join(s.directory, BENCH_FILE)
    try:
        os.makedirs(s.directory, exist_ok=True)
        info = mach.machine_info(s.directory)
        direct, cache = _cache_mode(info, mach.fs_info(s.directory))
        if cache in (CACHE_MEMORY, CACHE_CACHED):
            log.warning("figures on %s are labelled %r: %s", s.directory, cache,
                        "it is a RAM filesystem" if cache == CACHE_MEMORY
                        else "no O_DIRECT and caches cannot be dropped (not root)")
        configs = _configs(s)
        prepare_file(path, max([c.nbytes for c in configs] + [0]))
        peers, backends = _make_runners(s, info, direct, ds, runners)
        run = BenchRun(s, info, peers, backends, cache, argv=list(argv or []))

        plan: list[tuple[IoConfig, list[Runner]]] = []
        seen: set = set()
        for cfg in configs:
            plan.append((cfg, [r for r in runners if _peer_config_filter(r, cfg, seen)]))
        steps = sum(len(rs) for _, rs in plan) * s.reps
        moved = s.reps * sum(cfg.nbytes * 2 * sum(1 for r in rs if not r.supports(cfg))
                             for cfg, rs in plan)
        log.info("%d configurations x %d repetitions: about %.0f GB to move (%.1f min at 2 GB/s)",
                 len(plan), s.reps, moved / 1e9, moved / 2e9 / 60)
        done = 0

        def tick(desc: str) -> None:
            nonlocal done
            done += 1
            if progress:
                progress(done, steps, desc)

        drop_odd = cache == CACHE_DIRECT and mach.can_drop_caches()
        for cfg, rs in plan:
            run.results.extend(_measure(cfg, rs, path, s.reps, cache, drop_odd, tick))
        if s.gpu:
            from pyinfinity.bench.gpu import run_gpu_bench

            try:
                run.results.extend(run_gpu_bench(s, path, progress))
            except Exception as exc:  # the disk figures above stay valid; say what broke
                log.exception("GPU figures failed")
                run.results.append(Result(workload="gpu", op="h2d", tool="pyinfinity",
                                          backend="stager", nbytes=0,
                                          note=f"failed: {type(exc).__name__}: {exc}"[:300]))
    finally:
        for r in runners:
            r.close()
        if ds is not None:
            ds.close()
        if not s.keep_file:
            try:
                os.unlink(path)
            except OSError:
                pass
    for line in flag_suspect_peers(run.results):
        log.warning("peer result flagged: %s", line)
    run.seconds = time.perf_counter() - t_start
    run.load_avg = [load0, os.getloadavg()[0]]
    return run
