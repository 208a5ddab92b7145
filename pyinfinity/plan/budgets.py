"""The budgets a plan must respect: device memory, host RAM, and free space per swap directory.

Host RAM is what the kernel says is available (``/proc/meminfo`` MemAvailable) capped by the
cgroup's limit (v2 ``memory.max - memory.current``, v1 ``limit_in_bytes - usage_in_bytes``), so a
container's limit is honoured. Free space is ``statvfs`` per directory; directories on one
filesystem share its free bytes.
"""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

log = logging.getLogger(__name__)

HOST_FRACTION = 0.8
"""Share of the available host RAM a plan may use when no host budget is given."""

CPU_DEVICE_FRACTION = 0.25
"""On the CPU device, the "device" pool is host RAM: a quarter of what is available by default."""


@dataclass
class SwapDir:
    """One swap directory and the free bytes of its filesystem."""

    path: str
    free: int
    fs_id: int = 0  # statvfs f_fsid: directories with the same id share ``free``


@dataclass
class Budgets:
    """What the plan may use (bytes). ``device_is_host``: the compute device is the CPU, so the
    device pool is host RAM too and both budgets are charged for it."""

    device_memory: int
    host_memory: int
    swap: list[SwapDir] = field(default_factory=list)
    device_is_host: bool = False

    @property
    def swap_free(self) -> int:
        """Free bytes over all swap directories (each filesystem counted once)."""
        seen: dict[int, int] = {}
        for i, d in enumerate(self.swap):
            seen[d.fs_id or -(i + 1)] = d.free
        return sum(seen.values())

    @property
    def swap_paths(self) -> list[str]:
        return [d.path for d in self.swap]


def mem_available() -> int:
    """Host bytes available now: MemAvailable, capped by the cgroup limit if there is one."""
    avail = None
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    avail = int(line.split()[1]) * 1024
                    break
    except OSError:
        pass
    if avail is None:
        avail = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 2
    left = cgroup_memory_left()
    if left is not None and left < avail:
        log.debug("cgroup limit leaves %d bytes (MemAvailable %d)", left, avail)
        avail = left
    return avail


def _read_int(path: str) -> Optional[int]:
    try:
        with open(path) as f:
            text = f.read().strip()
    except OSError:
        return None
    if not text or text == "max":
        return None
    try:
        return int(text)
    except ValueError:
        return None


def cgroup_memory_left(root: str = "/sys/fs/cgroup") -> Optional[int]:
    """Bytes the cgroup may still allocate (None when unlimited or unknown). ``root`` is a test seam."""
    rel = ""
    try:
        with open("/proc/self/cgroup") as f:
            for line in f:
                parts = line.strip().split(":", 2)
                if len(parts) == 3 and parts[0] == "0":
                    rel = parts[2].lstrip("/")
    except OSError:
        pass
    for base in (os.path.join(root, rel), root):  # v2: own group, then the mount's root
        limit = _read_int(os.path.join(base, "memory.max"))
        if limit is not None:
            used = _read_int(os.path.join(base, "memory.current")) or 0
            return max(0, limit - used)
    limit = _read_int(os.path.join(root, "memory", "memory.limit_in_bytes"))
    if limit is not None and limit < (1 << 60):  # v1 "unlimited" is a huge number
        used = _read_int(os.path.join(root, "memory", "memory.usage_in_bytes")) or 0
        return max(0, limit - used)
    return None


def swap_dirs(paths: Sequence[str]) -> list[SwapDir]:
    """Free space of each swap directory (of its nearest existing parent when it does not exist
    yet: a plan never creates it; the engine does, with a warning)."""
    out = []
    for p in paths:
        p = os.path.abspath(os.path.expanduser(p))
        probe = p
        while probe and not os.path.exists(probe):
            probe = os.path.dirname(probe)
        st = os.statvfs(probe or "/")
        out.append(SwapDir(path=p, free=st.f_bavail * st.f_frsize, fs_id=st.f_fsid))
    return out


def device_memory_free(device: Any) -> Optional[int]:
    """Free bytes on a CUDA device (None for the CPU or when CUDA is unusable)."""
    import torch

    dev = torch.device(device) if not isinstance(device, torch.device) else device
    if dev.type != "cuda" or not torch.cuda.is_available():
        return None
    try:
        free, _total = torch.cuda.mem_get_info(dev)
    except Exception:  # noqa: BLE001 - no driver: unknown
        return None
    return int(free)


def measure_budgets(device: Any = "cpu", nvme_paths: Sequence[str] = (), *,
                    device_memory: Optional[int] = None, host_memory: Optional[int] = None) -> Budgets:
    """Budgets of this machine. Explicit ``device_memory``/``host_memory`` win over measurement.

    Device: 90% of the free CUDA memory, or on the CPU device a quarter of the available RAM; a
    device that is not on this machine needs ``device_memory`` (ValueError otherwise).
    Host: 80% of the available RAM (cgroup-capped).
    """
    import torch

    from pyinfinity.plan.rates import device_is_here

    dev = torch.device(device) if not isinstance(device, torch.device) else device
    avail = mem_available()
    if device_memory is None and not device_is_here(dev):
        raise ValueError(f"device_memory: planning for {dev}, which is not on this machine, needs its memory "
                         "budget: give it (pyinfinity.device_memory, or --gpu-memory SIZE, e.g. 80GiB)")
    if device_memory is None:
        free = device_memory_free(dev)
        device_memory = int(free * 0.9) if free is not None else int(avail * CPU_DEVICE_FRACTION)
    if host_memory is None:
        host_memory = int(avail * HOST_FRACTION)
    return Budgets(device_memory=int(device_memory), host_memory=int(host_memory),
                   swap=swap_dirs(nvme_paths), device_is_host=dev.type == "cpu")


__all__ = ["Budgets", "SwapDir", "measure_budgets", "mem_available", "cgroup_memory_left", "swap_dirs",
           "device_memory_free"]
