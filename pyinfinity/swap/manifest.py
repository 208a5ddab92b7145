"""The files that say who holds a swap directory and what is in it: the owner record (pid, host,
start time, boot id: :class:`Owner`), the manifest (``pyinfinity-manifest.json``, every swap file
and slot) and their durable writes (written under a temporary name, fsynced, renamed). The lock
and the manifest are used by ``swap.ownership``; the durable writes by checkpoints too."""
from __future__ import annotations

import errno
import json
import os
import socket
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Optional

LOCK_NAME = "pyinfinity.lock"
MANIFEST_NAME = "pyinfinity-manifest.json"
MANIFEST_FORMAT = "pyinfinity-swap-manifest"
MANIFEST_VERSION = 1


class SwapFileError(OSError):
    """A swap file that cannot be trusted: foreign (EEXIST), stale and unclaimable, or truncated
    under a running engine (EIO); filename = the file."""


def process_state(pid: int) -> Optional[tuple[str, int]]:
    """(state, start time in clock ticks since boot) of a process, None when it does not exist."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            rest = f.read().rsplit(")", 1)[1].split()
        return rest[0], int(rest[19])
    except (OSError, IndexError, ValueError):
        return None


def _boot_id() -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return ""


@dataclass
class Owner:
    """Who holds (or held) a swap directory."""

    pid: int
    host: str
    started: float  # epoch seconds when the engine took the directory
    proc_start: Optional[int] = None  # /proc/<pid>/stat start time, tells a reused pid apart
    boot_id: str = ""  # a pid from before a reboot is gone
    argv: list[str] = field(default_factory=list)

    @classmethod
    def current(cls) -> "Owner":
        st = process_state(os.getpid())
        return cls(pid=os.getpid(), host=socket.gethostname(), started=time.time(),
                   proc_start=st[1] if st else None, boot_id=_boot_id(), argv=list(sys.argv[:4]))

    @classmethod
    def from_dict(cls, d: Any) -> Optional["Owner"]:
        try:
            return cls(pid=int(d["pid"]), host=str(d["host"]), started=float(d["started"]),
                       proc_start=d.get("proc_start"), boot_id=str(d.get("boot_id", "")),
                       argv=[str(a) for a in d.get("argv", [])])
        except (KeyError, TypeError, ValueError):
            return None

    def alive(self) -> Optional[bool]:
        """Whether the owner process still runs; None when that cannot be told (another host)."""
        if self.host != socket.gethostname():
            return None
        if self.boot_id and self.boot_id != _boot_id():
            return False
        st = process_state(self.pid)
        if st is None or st[0] in ("Z", "X"):
            return False
        return self.proc_start is None or st[1] == self.proc_start

    def describe(self) -> str:
        when = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(self.started))
        cmd = f", {' '.join(self.argv)!r}" if self.argv else ""
        return f"pid {self.pid} on host {self.host} (started {when}{cmd})"


@dataclass
class FileEntry:
    """One swap file of a manifest: its space, its place among the space's directories, its size and slots."""

    name: str  # file name inside the directory (<space>.swp)
    space: str
    part: int  # index of this directory among the space's directories
    parts: int
    dev: Optional[int] = None
    ino: Optional[int] = None
    nbytes: int = 0  # the file must hold at least this many bytes (end of its last extent)
    slots: list[dict] = field(default_factory=list)
    links: list[str] = field(default_factory=list)  # checkpoints' hard links to this file (their blocks stay)


def read_manifest(directory: str) -> Optional[dict]:
    """The manifest of a swap directory, None when there is none; SwapFileError when it is not
    one pyinfinity can read."""
    path = os.path.join(directory, MANIFEST_NAME)
    try:
        with open(path) as f:
            m = json.load(f)
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        raise SwapFileError(errno.EBADMSG, f"swap manifest cannot be read ({exc}); nothing in that directory was "
                            "removed or used: remove its swap files and the manifest yourself, or use another "
                            "nvme_path", path) from exc
    if not isinstance(m, dict) or m.get("format") != MANIFEST_FORMAT or not isinstance(m.get("files"), list):
        raise SwapFileError(errno.EBADMSG, "not a pyinfinity swap manifest; nothing in that directory was removed "
                            "or used: use another nvme_path", path)
    if not isinstance(m.get("version"), int) or m["version"] > MANIFEST_VERSION:
        raise SwapFileError(errno.EBADMSG, f"swap manifest version {m.get('version')!r} is newer than this "
                            f"pyinfinity's ({MANIFEST_VERSION}); its files were left alone: use another nvme_path",
                            path)
    return m


def write_fsynced(path: str, data: bytes) -> None:
    """Writes ``data`` to ``path`` (created or truncated) and fsyncs it; short writes are continued."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o644)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_path(path: str) -> None:
    """fsyncs a file or a directory (a directory: its entries, e.g. after a rename) by its path."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomic(path: str, data: bytes) -> None:
    """Replaces ``path`` by ``data`` atomically: a temporary name, fsync, rename, fsync of the directory."""
    d = os.path.dirname(path)
    tmp = os.path.join(d, f".{os.path.basename(path)}.tmp-{os.getpid()}-{threading.get_ident()}")
    write_fsynced(tmp, data)
    os.rename(tmp, path)
    fsync_path(d)


def pid_running(pid: int) -> bool:
    """Whether process ``pid`` exists on this host and is not a zombie."""
    st = process_state(pid)
    return st is not None and st[0] not in ("Z", "X")


__all__ = ["LOCK_NAME", "MANIFEST_NAME", "MANIFEST_FORMAT", "MANIFEST_VERSION", "SwapFileError", "Owner",
           "FileEntry", "read_manifest", "write_fsynced", "fsync_path", "write_atomic", "process_state", "pid_running"]
