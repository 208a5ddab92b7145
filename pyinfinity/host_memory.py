"""Host RAM available now: what the kernel says (``/proc/meminfo`` MemAvailable) capped by the
cgroup's limit (v2 ``memory.max - memory.current``, v1 ``limit_in_bytes - usage_in_bytes``), so a
container's limit is honoured. The planner's host budget starts from it; the engine asks it
before it takes host RAM that no plan charged (a device placement given up, a background save's
staging beyond ``pyinfinity.checkpoint_staging``), leaving HOST_SPARE free."""
from __future__ import annotations

import logging
import os
from typing import Optional

log = logging.getLogger(__name__)

# host RAM the engine leaves free when it takes more than a plan charged (the process's other
# allocations, the page cache the checkpoint and swap files go through)
HOST_SPARE = 2 << 30


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


__all__ = ["mem_available", "cgroup_memory_left"]
