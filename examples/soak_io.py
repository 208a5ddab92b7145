"""Soak test of the swap engine: many random asynchronous reads and writes, every byte verified.

Threads issue overlapping-in-time requests (random sizes, offsets and alignments) on several
files, keeping a shadow copy of every file in memory; each read is compared with the shadow.
Every `fault_every` operations an I/O error is injected through the fault seam: the failed write
marks its range unknown (rewritten later), and the run checks that every injected fault surfaced
as exactly one failed request. File descriptors and RSS are sampled before and after.

    python examples/soak_io.py --ops 100000 --dir /mnt/nvme0 --json soak.json
"""
from __future__ import annotations

import argparse
import errno
import gc
import json
import os
import random
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field

import numpy as np
import torch

from pyinfinity.swap import SwapEngine, faults_injected
from pyinfinity import _C


@dataclass
class SoakResult:
    ops: int = 0
    reads: int = 0
    writes: int = 0
    bytes_verified: int = 0
    mismatches: int = 0
    faults_injected: int = 0
    failed_requests: int = 0
    fd_before: int = 0
    fd_after: int = 0
    rss_before_mib: float = 0.0
    rss_warm_mib: float = 0.0  # after 20% of the operations (allocator pools warmed up)
    rss_after_mib: float = 0.0
    seconds: float = 0.0
    backend: str = ""
    errors: list = field(default_factory=list)


def fd_count() -> int:
    gc.collect()  # files owned by garbage from before the run must not count
    return len(os.listdir("/proc/self/fd"))


def rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def soak(directory: str, ops: int = 10_000, threads: int = 4, files: int = 3, file_mib: int = 16,
         region_kib: int = 256, inflight: int = 8, fault_every: int = 500, backend: str = "auto",
         seed: int = 0, progress: bool = False) -> SoakResult:
    res = SoakResult(backend=backend)
    region = region_kib * 1024
    fsize = file_mib * 2**20
    nregions = fsize // region
    paths = [os.path.join(directory, f"soak-{i}.bin") for i in range(files)]
    shadow = [np.zeros(fsize, dtype=np.uint8) for _ in paths]
    known = [np.zeros(nregions, dtype=bool) for _ in paths]  # region content known (written OK)
    eng = SwapEngine(backend, block_size=64 * 1024, queue_depth=16, threads=2)
    for p in paths:  # start from a file of known bytes
        rng = np.random.default_rng(seed)
        shadow[paths.index(p)][:] = rng.integers(0, 256, fsize, dtype=np.uint8)
        eng.write(torch.from_numpy(shadow[paths.index(p)]), p).wait()
        known[paths.index(p)][:] = True
    res.fd_before, res.rss_before_mib = fd_count(), rss_mib()
    faults0 = faults_injected()
    lock = threading.Lock()
    counter = [0]
    t0 = time.perf_counter()

    def worker(k: int) -> None:
        rng = random.Random(seed * 1000 + k)
        mine = [(f, r) for f in range(files) for r in range(nregions) if (f * nregions + r) % threads == k]
        pending = []  # (req, kind, f, r, lo, n, buf)

        def finish(item) -> None:
            req, kind, f, r, lo, n, buf = item
            try:
                req.wait(timeout=120)
            except OSError as exc:
                with lock:
                    res.failed_requests += 1
                if exc.errno != errno.EIO:
                    res.errors.append(f"unexpected errno {exc.errno}: {exc}")
                if kind == "w":
                    known[f][r] = False  # partially written: unknown until rewritten whole
                return
            if kind == "w":
                shadow[f][lo:lo + n] = buf.numpy()
            elif known[f][r]:
                if not np.array_equal(buf.numpy(), shadow[f][lo:lo + n]):
                    with lock:
                        res.mismatches += 1
                        res.errors.append(f"mismatch in {paths[f]} [{lo}, {lo + n})")
                else:
                    with lock:
                        res.bytes_verified += n

        busy = set()
        while True:
            with lock:
                if counter[0] >= ops:
                    break
                counter[0] += 1
                i = counter[0]
            if i == ops // 5:
                res.rss_warm_mib = rss_mib()
            if i % fault_every == 0:
                _C.set_fault("any", 1, "errno", errno.EIO, 1)  # the next piece anyone submits
            while len(pending) >= inflight:
                item = pending.pop(0)
                busy.discard((item[2], item[3]))
                finish(item)
            f, r = rng.choice([x for x in mine if x not in busy] or mine[:1])
            if (f, r) in busy:
                continue
            base = r * region
            if not known[f][r]:  # rewrite a damaged region whole
                lo, n, kind = base, region, "w"
            else:
                a, b = sorted(rng.randrange(0, region + 1) for _ in range(2))
                lo, n = base + a, max(1, b - a)
                n = min(n, region - a)
                kind = rng.choice("rw")
            if kind == "w":
                buf = torch.from_numpy(np.frombuffer(rng.randbytes(n), dtype=np.uint8).copy())
                req = eng.write(buf, paths[f], lo)
            else:
                buf = torch.empty(n, dtype=torch.uint8)
                req = eng.read(buf, paths[f], lo)
            with lock:
                res.ops += 1
                if kind == "w":
                    res.writes += 1
                else:
                    res.reads += 1
            pending.append((req, kind, f, r, lo, n, buf))
            busy.add((f, r))
        for item in pending:
            finish(item)

    ts = [threading.Thread(target=worker, args=(k,)) for k in range(threads)]
    stop = threading.Event()

    def report() -> None:
        while not stop.wait(2.0):
            print(f"soak: {counter[0]}/{ops} ops, {res.bytes_verified / 1e9:.2f} GB verified, "
                  f"{res.mismatches} mismatches", file=sys.stderr, flush=True)

    rep = threading.Thread(target=report, daemon=True)
    if progress:
        rep.start()
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    stop.set()
    _C.clear_fault()
    res.rss_after_mib = rss_mib()
    # Final pass: every known region of every file equals the shadow.
    for f, p in enumerate(paths):
        back = torch.empty(fsize, dtype=torch.uint8)
        eng.read(back, p).wait()
        b = back.numpy()
        for r in np.flatnonzero(known[f]):
            lo = r * region
            if not np.array_equal(b[lo:lo + region], shadow[f][lo:lo + region]):
                res.mismatches += 1
                res.errors.append(f"final mismatch in {p} region {r}")
            else:
                res.bytes_verified += region
    res.faults_injected = faults_injected() - faults0
    res.seconds = time.perf_counter() - t0
    eng.close()
    del eng
    for p in paths:
        os.unlink(p)
    res.fd_after = fd_count()
    return res


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ops", type=int, default=100_000)
    ap.add_argument("--dir", default=None, help="directory for the soak files (default: a temp dir)")
    ap.add_argument("--threads", type=int, default=4)
    ap.add_argument("--backend", default="auto")
    ap.add_argument("--fault-every", type=int, default=500)
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    with tempfile.TemporaryDirectory(dir=a.dir) as d:
        r = soak(d, ops=a.ops, threads=a.threads, backend=a.backend, fault_every=a.fault_every, progress=True)
    out = asdict(r)
    print(f"ops {r.ops} (reads {r.reads}, writes {r.writes}) in {r.seconds:.1f} s; "
          f"{r.bytes_verified / 1e9:.2f} GB verified; faults injected {r.faults_injected}, "
          f"failed requests {r.failed_requests}; mismatches {r.mismatches}; "
          f"fds {r.fd_before}->{r.fd_after}; RSS {r.rss_before_mib:.0f} MiB at start, "
          f"{r.rss_warm_mib:.0f} after 20% of the ops, {r.rss_after_mib:.0f} at the end")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=2)
    ok = r.mismatches == 0 and r.faults_injected == r.failed_requests and not r.errors and r.fd_after <= r.fd_before
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
