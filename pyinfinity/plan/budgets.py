"""The budgets a plan must respect: device memory, host RAM, and free space per swap directory.

Host RAM is what the kernel says is available (``host_memory.mem_available``: MemAvailable
capped by the cgroup's limit, so a container's limit is honoured). Free space is ``statvfs`` per
directory; directories on one filesystem share its free bytes.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

from pyinfinity.host_memory import mem_available

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


__all__ = ["Budgets", "SwapDir", "measure_budgets", "swap_dirs",
           "device_memory_free"]
