"""Facts about the machine and the filesystem under a path: what the report prints and what every
benchmark JSON carries, so each figure can be traced to where it was measured."""
from __future__ import annotations

import datetime as _dt
import errno
import logging
import mmap
import os
import platform
import resource
import shutil
import subprocess
import uuid
from dataclasses import asdict, dataclass, field
from typing import Any, Optional

log = logging.getLogger(__name__)

MEMORY_FILESYSTEMS = {"tmpfs", "ramfs", "devtmpfs", "hugetlbfs"}
ALIGN = 4096


@dataclass
class FsInfo:
    """The mount that holds ``path``."""

    path: str
    mount_point: str = ""
    fs_type: str = "unknown"
    source: str = ""
    options: str = ""
    read_only: bool = False
    free_bytes: int = 0
    total_bytes: int = 0

    @property
    def in_memory(self) -> bool:
        return self.fs_type in MEMORY_FILESYSTEMS


def existing_ancestor(path: str) -> str:
    """``path`` itself or its nearest ancestor that exists (the swap dir may not exist yet)."""
    p = os.path.abspath(path)
    while not os.path.exists(p):
        parent = os.path.dirname(p)
        if parent == p:
            break
        p = parent
    return p


def _unescape_mount(s: str) -> str:
    return s.replace("\\040", " ").replace("\\011", "\t").replace("\\012", "\n").replace("\\134", "\\")


def fs_info(path: str) -> FsInfo:
    """Filesystem type, mount point, read-only flag and free space at ``path`` (from mountinfo)."""
    real = os.path.realpath(existing_ancestor(path))
    info = FsInfo(path=os.path.abspath(path))
    best = -1
    try:
        with open("/proc/self/mountinfo") as f:
            for line in f:
                left, _, right = line.partition(" - ")
                parts, rparts = left.split(), right.split()
                if len(parts) < 6 or len(rparts) < 2:
                    continue
                mp = _unescape_mount(parts[4])
                inside = real == mp or real.startswith(mp.rstrip("/") + "/")
                # later lines win on equal length: the top of a stack of mounts on one point
                if inside and len(mp) >= best:
                    best = len(mp)
                    info.mount_point, info.fs_type, info.source = mp, rparts[0], rparts[1]
                    info.options = parts[5]
    except OSError as exc:  # not Linux, or /proc missing
        log.debug("cannot read mountinfo: %s", exc)
    try:
        st = os.statvfs(real)
        info.free_bytes = st.f_bavail * st.f_frsize
        info.total_bytes = st.f_blocks * st.f_frsize
        info.read_only = bool(st.f_flag & os.ST_RDONLY)
    except OSError as exc:
        log.debug("statvfs(%s) failed: %s", real, exc)
    if "ro" in info.options.split(","):
        info.read_only = True
    return info


@dataclass
class DirectProbe:
    """Result of a live O_DIRECT round trip in a directory (Python-level, independent of _C)."""

    ok: bool
    error: str = ""
    errno: int = 0


def probe_o_direct(directory: str) -> DirectProbe:
    """Write and read back one aligned page with O_DIRECT in ``directory``; remove the file."""
    if not hasattr(os, "O_DIRECT"):
        return DirectProbe(False, "O_DIRECT is not available on this OS", errno.ENOTSUP)
    name = os.path.join(directory, f".pyinfinity-probe-{uuid.uuid4().hex}")
    buf = mmap.mmap(-1, ALIGN)  # page aligned, as O_DIRECT wants
    pattern = os.urandom(ALIGN)
    buf.write(pattern)
    fd = -1
    try:
        fd = os.open(name, os.O_CREAT | os.O_RDWR | os.O_DIRECT, 0o600)
        if os.pwrite(fd, buf, 0) != ALIGN:
            return DirectProbe(False, "short O_DIRECT write")
        back = mmap.mmap(-1, ALIGN)
        if os.preadv(fd, [back], 0) != ALIGN or back[:] != pattern:
            return DirectProbe(False, "O_DIRECT read-back mismatch")
        return DirectProbe(True)
    except OSError as exc:
        return DirectProbe(False, f"{exc.strerror} ({errno.errorcode.get(exc.errno, exc.errno)})",
                           exc.errno or 0)
    finally:
        if fd >= 0:
            os.close(fd)
        try:
            os.unlink(name)
        except OSError:
            pass


def drop_page_cache(path: Optional[str] = None) -> bool:
    """Evict cached pages: ``path``'s via fadvise (anyone), then all clean caches as root.

    Returns True when the system-wide drop succeeded (root); False means only ``path``'s pages
    were advised away, which the kernel may ignore, so figures must then be labelled "cached".
    """
    if path and os.path.exists(path):
        try:
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)
        except OSError as exc:
            log.debug("fadvise(%s) failed: %s", path, exc)
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("1\n")
        return True
    except OSError as exc:
        log.debug("cannot drop caches: %s", exc)
        return False


def can_drop_caches() -> bool:
    return os.geteuid() == 0 and os.access("/proc/sys/vm/drop_caches", os.W_OK)


def mem_info() -> dict[str, int]:
    """/proc/meminfo's totals in bytes (MemTotal, MemAvailable, ...)."""
    out: dict[str, int] = {}
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                k, _, v = line.partition(":")
                fields = v.split()
                if fields:
                    out[k] = int(fields[0]) * (1024 if len(fields) > 1 else 1)
    except OSError:
        pass
    return out


def memlock_limit() -> Optional[int]:
    """``ulimit -l`` in bytes; None means unlimited."""
    soft, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    return None if soft == resource.RLIM_INFINITY else soft


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def tool_version(argv: list[str]) -> Optional[str]:
    """First line of ``argv``'s output, or None when the program is missing."""
    if shutil.which(argv[0]) is None:
        return None
    try:
        out = subprocess.run(argv, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    text = (out.stdout or out.stderr).strip()
    return text.splitlines()[0] if text else ""


@dataclass
class GpuInfo:
    index: int
    name: str
    total_bytes: int
    free_bytes: int


def gpu_info() -> tuple[list[GpuInfo], str]:
    """Visible CUDA devices (through torch) and a note why none, if none."""
    try:
        import torch
    except ImportError:
        return [], "torch is not installed"
    if not torch.cuda.is_available():
        why = "torch was built without CUDA" if torch.version.cuda is None else "no CUDA device visible"
        return [], why
    gpus = []
    for i in range(torch.cuda.device_count()):
        free, total = torch.cuda.mem_get_info(i)
        gpus.append(GpuInfo(i, torch.cuda.get_device_name(i), total, free))
    return gpus, ""


def build_info() -> dict[str, Any]:
    """``pyinfinity._C.build_info()``, or ``{"error": ...}`` when the extension does not load."""
    try:
        import pyinfinity._C as C
    except ImportError as exc:
        return {"error": f"pyinfinity._C does not import: {exc}"}
    try:
        return dict(C.build_info())
    except Exception as exc:  # a broken build must not break the report
        return {"error": f"build_info() failed: {exc}"}


@dataclass
class MachineInfo:
    """Recorded with every benchmark so its numbers can be traced."""

    date_utc: str
    cpu: str
    cores: int
    ram_bytes: int
    kernel: str
    python: str
    torch: str
    torch_cuda: Optional[str]
    pyinfinity: str
    build: dict[str, Any]
    gpus: list[dict[str, Any]]
    fs: dict[str, Any]
    o_direct: bool
    can_drop_caches: bool
    memlock_bytes: Optional[int]
    tools: dict[str, Optional[str]] = field(default_factory=dict)
    source: str = ""          # git commit of the pyinfinity checkout, when run from one


def source_revision() -> str:
    """``git describe --always --dirty`` of the checkout holding this package, or ""."""
    here = os.path.dirname(os.path.abspath(__file__))
    try:
        out = subprocess.run(["git", "-C", here, "describe", "--always", "--dirty"],
                             capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return ""
    return out.stdout.strip() if out.returncode == 0 else ""


def machine_info(path: str) -> MachineInfo:
    import torch

    import pyinfinity

    gpus, _ = gpu_info()
    fs = fs_info(path)
    d = existing_ancestor(path)
    return MachineInfo(
        date_utc=_dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        cpu=cpu_model(), cores=os.cpu_count() or 1, ram_bytes=mem_info().get("MemTotal", 0),
        kernel=platform.release(), python=platform.python_version(), torch=torch.__version__,
        torch_cuda=torch.version.cuda, pyinfinity=pyinfinity.__version__, build=build_info(),
        gpus=[asdict(g) for g in gpus], fs=asdict(fs),
        o_direct=probe_o_direct(d).ok if os.access(d, os.W_OK) and not fs.read_only else False,
        can_drop_caches=can_drop_caches(), memlock_bytes=memlock_limit(),
        tools={"fio": tool_version(["fio", "--version"]), "dd": tool_version(["dd", "--version"])},
        source=source_revision(),
    )
