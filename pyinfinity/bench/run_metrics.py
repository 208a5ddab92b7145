"""What a `pyinfinity bench train` run measures in its own process: the bytes it moved at the storage
layer (``/proc/self/io``: O_DIRECT and buffered alike), its RSS, a sampler of disk activity for the
timeline, and the GPU's kernel and copy lanes from a ``torch.profiler`` trace of the step
annotated ``STEP_LABEL``."""
from __future__ import annotations

import json
import os
import resource
import threading
import time
from typing import Any

STEP_LABEL = "pyinfinity.bench.step"  # the profiler annotation of the traced step


def proc_io() -> tuple[int, int]:
    """(read_bytes, write_bytes) this process has caused at the storage layer so far."""
    try:
        with open("/proc/self/io") as f:
            d = dict(line.split(":", 1) for line in f.read().splitlines() if ":" in line)
        return int(d["read_bytes"]), int(d["write_bytes"])
    except (OSError, KeyError, ValueError):
        return 0, 0


def peak_rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def current_rss() -> int:
    """The process's resident set now (bytes; 0 where /proc is missing)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


class DiskSampler:
    """Samples /proc/self/io every ``period`` seconds on a thread: (t, read_bytes, write_bytes)."""

    def __init__(self, period: float = 0.005) -> None:
        self.period = period
        self.samples: list[tuple[float, int, int]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="pyinfinity-bench-io-sampler", daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            r, w = proc_io()
            self.samples.append((time.perf_counter(), r, w))
            self._stop.wait(self.period)

    def __enter__(self) -> "DiskSampler":
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join()
        r, w = proc_io()
        self.samples.append((time.perf_counter(), r, w))

    def intervals(self, t0: float, which: int) -> list[list[float]]:
        """[start, end, bytes] of each sampling period in which bytes moved (which: 1 read, 2 write),
        seconds relative to t0, consecutive busy periods merged."""
        out: list[list[float]] = []
        for a, b in zip(self.samples, self.samples[1:]):
            n = b[which] - a[which]
            if n <= 0:
                continue
            s, e = a[0] - t0, b[0] - t0
            if out and abs(out[-1][1] - s) < 1e-9:
                out[-1][1] = e
                out[-1][2] += n
            else:
                out.append([s, e, n])
        return [[round(s, 5), round(e, 5), int(n)] for s, e, n in out]


def merge_intervals(iv: list[tuple[float, float]], gap: float = 2e-4) -> list[list[float]]:
    """Sorted, overlapping or nearly touching intervals merged (keeps a step's trace small)."""
    out: list[list[float]] = []
    for s, e in sorted(iv):
        if out and s <= out[-1][1] + gap:
            out[-1][1] = max(out[-1][1], e)
        else:
            out.append([s, e])
    return [[round(s, 5), round(e, 5)] for s, e in out]


def gpu_intervals(trace_path: str, label: str = STEP_LABEL) -> dict[str, list[list[float]]]:
    """Kernel / H2D / D2H intervals from a torch.profiler chrome trace, in seconds from the start
    of the host annotation ``label`` (the traced step)."""
    with open(trace_path) as f:
        events = json.load(f).get("traceEvents", [])
    starts = [float(ev["ts"]) for ev in events if ev.get("ph") == "X" and ev.get("name") == label]
    if not starts:
        raise ValueError(f"no {label!r} annotation in the trace")
    t0_us = min(starts)
    lanes: dict[str, list[tuple[float, float]]] = {"compute": [], "h2d": [], "d2h": []}
    for ev in events:
        if ev.get("ph") != "X" or "dur" not in ev:
            continue
        cat, name = str(ev.get("cat", "")), str(ev.get("name", ""))
        lane = None
        if cat == "kernel":
            lane = "compute"
        elif cat == "gpu_memcpy":
            lane = "h2d" if "HtoD" in name else "d2h" if "DtoH" in name else None
        if lane is None:
            continue
        s = (float(ev["ts"]) - t0_us) / 1e6
        lanes[lane].append((s, s + float(ev["dur"]) / 1e6))
    return {k: merge_intervals(v) for k, v in lanes.items()}


__all__ = ["STEP_LABEL", "proc_io", "peak_rss", "current_rss", "DiskSampler", "merge_intervals", "gpu_intervals"]
