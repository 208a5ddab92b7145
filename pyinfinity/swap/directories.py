"""Swap directories on the filesystem: which mount a path is on (the warning names it), creating a
missing one with its parents as DeepSpeed does, and removing again what was created."""
from __future__ import annotations

import errno
import logging
import os
from typing import Sequence

log = logging.getLogger(__name__)


def mount_of(path: str) -> tuple[str, str, str]:
    """(mount point, filesystem type, source) of the filesystem ``path`` (or its nearest existing
    parent) is on, from /proc/self/mounts; ("/", "unknown", "") when that cannot be read."""
    probe = os.path.realpath(path)
    while probe and not os.path.exists(probe):
        probe = os.path.dirname(probe)
    best = ("/", "unknown", "")
    try:
        with open("/proc/self/mounts") as f:
            for line in f:
                parts = line.split()
                if len(parts) < 3:
                    continue
                mnt = parts[1].replace("\\040", " ")
                inside = probe == mnt or probe.startswith(mnt.rstrip("/") + "/")
                if inside and len(mnt) >= len(best[0]):
                    best = (mnt, parts[2], parts[0])
    except OSError:
        pass
    return best


def make_swap_dir(path: str, warn: bool = True) -> list[str]:
    """Creates the swap directory ``path`` and its missing parents, as DeepSpeed does, with a
    warning naming the filesystem it landed on (a mistyped mount point otherwise fills the root
    disk unnoticed). Returns the directories made, outermost first (nothing when it existed)."""
    path = os.path.abspath(path)
    missing = []
    p = path
    while p and not os.path.exists(p):
        missing.append(p)
        p = os.path.dirname(p)
    if not missing:
        return []
    made = []
    try:
        for d in reversed(missing):
            try:
                os.mkdir(d)
                made.append(d)
            except FileExistsError:
                pass
    except BaseException:
        remove_created_dirs(made)
        raise
    if not warn:
        return made
    mnt, fstype, source = mount_of(path)
    where = f"the filesystem mounted at {mnt} ({fstype}{', ' + source if source else ''})"
    log.warning("swap directory %s did not exist: created it on %s%s; pyinfinity removes it at close",
                path, where, " - the root filesystem, not a separate drive" if mnt == "/" else "")
    return made


def remove_created_dirs(made: Sequence[str]) -> None:
    """Removes the directories ``make_swap_dir`` made (innermost first) when they are empty: what
    another program put there since is kept, with the directory holding it."""
    for d in reversed(list(made)):
        try:
            os.rmdir(d)
        except FileNotFoundError:
            pass
        except OSError as exc:
            if exc.errno not in (errno.ENOTEMPTY, errno.EEXIST):
                log.warning("could not remove swap directory %s: %s", d, exc)
            break
    if isinstance(made, list):
        made.clear()


__all__ = ["mount_of", "make_swap_dir", "remove_created_dirs"]
