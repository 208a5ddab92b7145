"""Swap directory ownership: what a training engine claims before it writes, and gives back at close.

* A lock per swap directory (``<dir>/pyinfinity.lock``, ``flock``, holding the owner's pid, host
  and start time): a second run pointed at the same directory fails at start with an error naming
  the directory and the owner. The kernel drops the lock when its process dies, so a crash never
  leaves a directory locked.
* A start check that the state fits, with the numbers: free space per swap filesystem (the
  preallocated swap files included), and the RAM and device budgets (``CapacityError``).
* A manifest per directory (``<dir>/pyinfinity-manifest.json``, written atomically: temporary
  name, fsync, rename) listing the swap files, their sizes and a dtype/shape/key record per slot,
  with a format version and the owner. With it a stale directory of a crashed run (lock free,
  manifest present, owner gone) is cleaned with a warning at the next start; a swap file no
  manifest claims (foreign) is refused, never overwritten nor read; a swap file truncated under a
  running engine is reported (``verify``), never read as data.
* ``release()`` removes the swap files, the manifest and the lock (``close()`` and interpreter
  exit). Swap files are never reused across runs: training state comes back from a checkpoint.
* A checkpoint may hold a swap file by a hard link in its own folder (the optimizer state saved
  by reference, ``checkpoint``): the manifest lists those links (``link``). Release, a crash and
  the next start's stale cleanup only unlink the swap file's name here: the blocks stay the
  checkpoint's, and a file other links hold is never truncated (``SwapSpace`` opens a fresh one).

The swap layer below (``SwapSpace``) knows nothing of this; ``TensorSwapper`` calls ``open_space``
and ``record``; the training state calls ``claim_swap_dirs``, ``flush``, ``verify`` and
``release``. The owner record, the manifest's format and the durable writes are in
``swap.manifest``, creating and removing directories in ``swap.directories``.
"""
from __future__ import annotations

import errno
import fcntl
import json
import logging
import os
import re
import shutil
import signal
import threading
import time
import weakref
from dataclasses import asdict, dataclass
from typing import Any, Callable, Sequence

from pyinfinity.config_values import SwapSpaceTooSmall
from pyinfinity.swap.directories import make_swap_dir, mount_of, remove_created_dirs
from pyinfinity.swap.manifest import (LOCK_NAME, MANIFEST_FORMAT, MANIFEST_NAME, MANIFEST_VERSION, FileEntry, Owner,
                                      SwapFileError, fsync_path, pid_running, read_manifest, write_atomic,
                                      write_fsynced)

log = logging.getLogger(__name__)



class CapacityError(ValueError):
    """The training state cannot fit the budgets given; the message says how much is missing and
    where (which tier, which config key)."""


class SwapDirBusyError(OSError):
    """The swap directory is locked by another engine (errno EBUSY, filename = the directory)."""






def _fmt(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return f"{n} B"



# ----------------------------------------------------------------------------------- ownership


@dataclass
class SpacePlan:
    """What one swap space (a state class) will need, as the layout sizes it
    (``layout.pools.SwapFile``): its directories, the payload, the bytes each of its files
    reaches and the step the space grows them in."""

    name: str
    dirs: list[str]
    nbytes: int  # payload bytes the engine will put there
    file_bytes: int  # what each file is preallocated to at most
    grow_bytes: int  # SwapSpace's preallocation step


class SwapOwnership:
    """One engine's claim on its swap directories (see the module docstring). Make one with
    ``acquire`` (or ``claim_swap_dirs`` from an engine config); it is released by ``release()``,
    by garbage collection or at interpreter exit, whichever comes first."""

    def __init__(self, dirs: Sequence[str] = (), plans: Sequence[SpacePlan] = ()) -> None:
        self.dirs = list(dict.fromkeys(os.path.realpath(os.fspath(d)) for d in dirs))  # a symlink is its target
        self.plans = {p.name: p for p in plans}
        self.owner = Owner.current()
        self._lock = threading.Lock()
        self._lock_fds: dict[str, int] = {}
        self._files: dict[str, list[FileEntry]] = {d: [] for d in self.dirs}  # dir -> entries
        self._dirty = False
        self._warned: set[str] = set()
        self.cleaned: list[str] = []  # stale files removed at start (for callers and tests)
        self._state = {"fds": self._lock_fds, "files": self._files, "dirs": self.dirs, "released": False,
                       "manifests": set(),  # dirs whose manifest is ours (never remove another's)
                       "created": [],  # directories acquire() made (outermost first): removed at release
                       "pid": os.getpid()}  # a forked child never removes its parent's files
        self._finalizer = weakref.finalize(self, SwapOwnership._release, self._state)
        if self.dirs:
            _live.difference_update([f for f in _live if not f.alive])
            _live.add(self._finalizer)
            _install_sigterm_cleanup()

    # -- start ---------------------------------------------------------------------------------
    @classmethod
    def acquire(cls, dirs: Sequence[str], plans: Sequence[SpacePlan] = ()) -> "SwapOwnership":
        """Locks every directory, cleans what a crashed run of ours left there, refuses what is
        not ours, and checks the free space ``plans`` need; releases everything on failure."""
        own = cls(dirs, plans)
        try:
            for d in own.dirs:
                own._state["created"] += make_swap_dir(d)
            for d in own.dirs:
                own._lock_dir(d)
            for d in own.dirs:
                own._clean_stale(d)
                own._refuse_foreign(d)
            own.check_free_space()
            for d in own.dirs:
                own._write_manifest(d)
        except BaseException:
            own.release()
            raise
        return own

    def _lock_dir(self, d: str) -> None:
        if not os.path.isdir(d):
            raise NotADirectoryError(errno.ENOTDIR, "swap path is not a directory", d)
        path = os.path.join(d, LOCK_NAME)
        for _ in range(20):
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                try:
                    raw = os.pread(fd, 4096, 0)
                finally:
                    os.close(fd)
                raise self._busy(d, raw) from None
            except BaseException:
                os.close(fd)
                raise
            # the file may have been removed by its previous owner between our open and flock
            st = os.fstat(fd)
            try:
                now = os.stat(path)
            except FileNotFoundError:
                now = None
            if now is not None and (now.st_dev, now.st_ino) == (st.st_dev, st.st_ino):
                break
            os.close(fd)
        else:
            raise SwapDirBusyError(errno.EBUSY, "swap directory lock keeps changing hands; another run is "
                                   "starting there", d)
        self._lock_fds[d] = fd
        data = json.dumps(asdict(self.owner)).encode()
        os.ftruncate(fd, 0)
        os.pwrite(fd, data, 0)

    def _busy(self, d: str, raw: bytes) -> SwapDirBusyError:
        try:
            owner = Owner.from_dict(json.loads(raw.decode() or "null"))
        except ValueError:
            owner = None
        if owner is not None and self._held_by_this_process(owner):
            return SwapDirBusyError(errno.EBUSY, f"swap directory is in use by another engine of this process (pid "
                                    f"{owner.pid}) that was not closed (e.g. a notebook cell run again): call close() "
                                    "on that engine first (one no longer reachable: gc.collect() frees it), or point "
                                    "nvme_path at another directory", d)
        if owner is None:
            who = "another process (it has not written its pid yet)"
        else:
            who = owner.describe()
            if owner.alive() is False:
                who += (", which has exited: the lock is still held by a process it started (e.g. a "
                        "DataLoader worker); end that process")
        return SwapDirBusyError(errno.EBUSY, f"swap directory is in use by {who}; two runs cannot share a swap "
                                "directory: stop the other run or point nvme_path at another directory", d)

    @staticmethod
    def _held_by_this_process(owner: "Owner") -> bool:
        """Whether the lock's recorded owner is this very process (same pid, host, boot, start)."""
        me = Owner.current()
        return (owner.pid, owner.host, owner.boot_id, owner.proc_start) == (me.pid, me.host, me.boot_id, me.proc_start)

    def _clean_stale(self, d: str) -> None:
        """We hold the lock, so the manifest's owner is not running an engine here any more."""
        for name in os.listdir(d):
            if name.startswith(f".{MANIFEST_NAME}.tmp-"):
                os.unlink(os.path.join(d, name))  # a manifest write cut short by a crash
        m = read_manifest(d)
        if m is None:
            return
        path = os.path.join(d, MANIFEST_NAME)
        owner = Owner.from_dict(m.get("owner"))
        alive = owner.alive() if owner is not None else None
        if owner is None or alive is None:
            who = owner.describe() if owner is not None else "an unknown owner"
            raise SwapFileError(errno.EBUSY, f"swap files of {who} are here and this host cannot tell whether that "
                                "run still uses them (its lock is free here); they were left alone: remove them "
                                "and the manifest if that run is over, or use another nvme_path", path)
        removed = []
        for e in m["files"]:
            name = e.get("name") if isinstance(e, dict) else None
            if not isinstance(name, str) or os.path.basename(name) != name or not name.endswith(".swp"):
                raise SwapFileError(errno.EBADMSG, f"swap manifest lists an invalid file name {name!r}; nothing was "
                                    "removed: use another nvme_path", path)
            fp = os.path.join(d, name)
            try:
                size = os.stat(fp).st_size
            except FileNotFoundError:
                continue
            want = int(e.get("nbytes", 0) or 0)
            note = f"{_fmt(size)}" + (f", truncated: {_fmt(want)} listed" if size < want else "")
            held = [p for p in e.get("links", ()) if isinstance(p, str) and os.path.exists(p)]
            if held:  # unlinking the name frees nothing the checkpoints hold
                note += f"; its blocks stay with {len(held)} checkpoint link(s), e.g. {held[-1]}"
            os.unlink(fp)
            removed.append(f"{name} ({note})")
            self.cleaned.append(fp)
        os.unlink(path)
        state = "has exited" if not alive else "no longer holds the lock"
        log.warning("swap directory %s: removed the swap files of a run that ended without cleaning up "
                    "(%s, which %s): %s", d, owner.describe(), state, ", ".join(removed) or "none left")

    def _refuse_foreign(self, d: str) -> None:
        for plan in self.plans.values():
            if d in (os.path.realpath(p) for p in plan.dirs):
                self._check_no_file(os.path.join(d, f"{plan.name}.swp"))

    @staticmethod
    def _check_no_file(path: str) -> None:
        if os.path.lexists(path):
            raise SwapFileError(errno.EEXIST, "a swap file is already there and no pyinfinity manifest claims it "
                                "(another program's file, or left by a pyinfinity without manifests); it is "
                                "neither used as data nor overwritten: remove it or use another nvme_path", path)

    def check_free_space(self) -> None:
        """ENOSPC naming the directory and the numbers when the swap files cannot fit, per
        filesystem (directories on one filesystem add up), before anything is written."""
        need: dict[int, list] = {}
        for plan in self.plans.values():
            if not plan.nbytes:
                continue
            for d in plan.dirs:
                st = os.statvfs(d)
                dev = os.stat(d).st_dev
                entry = need.setdefault(dev, [d, st.f_bavail * st.f_frsize, 0, []])
                entry[2] += plan.file_bytes
                entry[3].append(f"{plan.name} {_fmt(plan.file_bytes)} in {d}")
        for d, free, n, parts in need.values():
            if n > free:
                raise SwapSpaceTooSmall(errno.ENOSPC, f"not enough free space for the swap files: they need {_fmt(n)} "
                              f"({', '.join(parts)}), the filesystem has {_fmt(free)} free: {_fmt(n - free)} "
                              "missing; free space there, add another nvme_path, or keep more state in RAM "
                              "(offload_param.max_in_cpu, offload_optimizer.ratio)", d)

    # -- spaces and slots ------------------------------------------------------------------------
    def open_space(self, name: str, dirs: Sequence[str], make: Callable[..., Any]) -> Any:
        """Lists ``<dir>/<name>.swp`` in the manifests (before the files exist, so a crash leaves
        them claimed), then ``make(grow_bytes=...)`` opens the SwapSpace; records the files' ids."""
        dirs = [os.path.realpath(os.fspath(d)) for d in dirs]
        missing = [d for d in dirs if d not in self._files]
        if missing:
            raise ValueError(f"dirs: {missing} are not swap directories owned by this engine ({self.dirs})")
        with self._lock:
            self._check_open()
            entries = []
            for i, d in enumerate(dirs):
                self._check_no_file(os.path.join(d, f"{name}.swp"))
                e = FileEntry(name=f"{name}.swp", space=name, part=i, parts=len(dirs))
                self._files[d].append(e)
                entries.append((d, e))
            for d in dirs:
                self._write_manifest(d)
        plan = self.plans.get(name)
        space = make(grow_bytes=plan.grow_bytes) if plan is not None and plan.nbytes else make()
        with self._lock:
            for d, e in entries:
                st = os.stat(os.path.join(d, e.name))
                e.dev, e.ino = st.st_dev, st.st_ino
            for d in dirs:
                self._write_manifest(d)
        return space

    def record(self, space: str, key: str, dtype: Any, shape: Sequence[int], slot: Any) -> None:
        """Notes what a slot of ``space`` holds (written to the manifests at the next ``flush``)."""
        with self._lock:
            entries = [e for d in self.dirs for e in self._files[d] if e.space == space]
            by_part = {e.part: e for e in entries}
            for x in slot.extents:
                e = by_part.get(x.file)
                if e is None:
                    continue
                e.nbytes = max(e.nbytes, x.offset + x.nbytes)
                e.slots.append({"key": key, "dtype": str(dtype).replace("torch.", ""), "shape": list(shape),
                                "offset": x.offset, "nbytes": x.nbytes, "part": x.file})
            self._dirty = True

    def link(self, space: str, paths: Sequence[str]) -> None:
        """Notes the hard links a checkpoint made to ``space``'s files (one per file, in the
        space's directory order); written to the manifests at the next ``flush``."""
        with self._lock:
            for d in self.dirs:
                for e in self._files[d]:
                    if e.space == space and e.part < len(paths):
                        e.links = [p for p in e.links if os.path.exists(p)] + [os.fspath(paths[e.part])]
            self._dirty = True

    def flush(self) -> None:
        """Writes the manifests if slots were recorded since the last write."""
        with self._lock:
            if self._dirty and not self._state["released"]:
                for d in self.dirs:
                    self._write_manifest(d)
                self._dirty = False

    def _write_manifest(self, d: str) -> None:
        m = {"format": MANIFEST_FORMAT, "version": MANIFEST_VERSION, "owner": asdict(self.owner), "directory": d,
             "updated": time.time(), "files": [asdict(e) for e in self._files[d]]}
        write_atomic(os.path.join(d, MANIFEST_NAME), json.dumps(m, separators=(",", ":")).encode())
        self._state["manifests"].add(d)

    def verify(self) -> None:
        """Checks the swap files against the manifest: a truncated one raises SwapFileError (its
        data is gone); a removed or replaced one is warned about once (the engine keeps reading
        its open file, so nothing is lost). Also flushes pending manifest records."""
        self.flush()
        for d in self.dirs:
            for e in self._files[d]:
                if e.ino is None:
                    continue
                path = os.path.join(d, e.name)
                try:
                    st = os.stat(path)
                except FileNotFoundError:
                    st = None
                if st is None or (st.st_dev, st.st_ino) != (e.dev, e.ino):
                    if path not in self._warned:
                        self._warned.add(path)
                        log.warning("swap file %s was %s under the running engine; the engine keeps using its "
                                    "open file (nothing is lost), but this run's swap files are no longer in %s",
                                    path, "removed" if st is None else "replaced by another file", d)
                    continue
                if st.st_size < e.nbytes:
                    raise SwapFileError(errno.EIO, f"swap file was truncated under the running engine: it has "
                                        f"{st.st_size} bytes, its {len(e.slots)} slots need {e.nbytes}; the "
                                        "training state in it is lost: resume from the last checkpoint", path)

    # -- end -------------------------------------------------------------------------------------
    def _check_open(self) -> None:
        if self._state["released"]:
            raise ValueError("SwapOwnership: used after release()")

    @property
    def released(self) -> bool:
        return bool(self._state["released"])

    def release(self) -> None:
        """Removes the swap files listed, the manifests and the locks. Idempotent."""
        with self._lock:
            self._finalizer()

    @staticmethod
    def _release(state: dict) -> None:
        if state["released"] or state["pid"] != os.getpid():
            return
        state["released"] = True
        for d in state["dirs"]:
            if d not in state["fds"]:
                continue  # never locked: nothing here is ours
            for e in state["files"].get(d, []):
                _unlink_quiet(os.path.join(d, e.name))
            if d in state["manifests"]:
                _unlink_quiet(os.path.join(d, MANIFEST_NAME))
            _unlink_quiet(os.path.join(d, LOCK_NAME))  # safe: a waiter re-checks the inode after flock
        for fd in state["fds"].values():
            try:
                os.close(fd)  # drops the flock
            except OSError:
                pass
        state["fds"].clear()
        remove_created_dirs(state["created"])



# ----------------------------------------------------------------------------------- SIGTERM

_live: set[Any] = set()  # finalizers of ownerships (they do not keep them alive); dead ones pruned
_sigterm_previous: Any = None  # the disposition before ours (None: ours is not installed)


def _install_sigterm_cleanup() -> None:
    """SIGTERM removes the swap files, manifests and locks as SIGINT does (via KeyboardInterrupt
    and interpreter exit), then acts as the previous disposition would: the application's
    handler is called, SIG_IGN ignores it, SIG_DFL ends the process by SIGTERM. Installed once,
    from the main thread (signal handlers cannot be set from another)."""
    global _sigterm_previous
    if _sigterm_previous is not None or threading.current_thread() is not threading.main_thread():
        return
    try:
        prev = signal.signal(signal.SIGTERM, _on_sigterm)
    except (ValueError, OSError) as exc:  # e.g. an embedded interpreter without signal support
        log.debug("SIGTERM cleanup not installed: %s", exc)
        return
    _sigterm_previous = prev if prev is not None else signal.SIG_DFL


def _on_sigterm(signum: int, frame: Any) -> None:
    prev = _sigterm_previous
    if prev == signal.SIG_IGN:
        return  # ignored before us: the run goes on and keeps its files
    if callable(prev):
        prev(signum, frame)  # the application's handler decides (an exit runs the cleanup at exit)
        return
    for fin in list(_live):  # SIG_DFL: the process ends now, without exit handlers
        try:
            fin()
        except Exception as exc:  # noqa: BLE001 - the process ends anyway
            log.warning("SIGTERM cleanup: %s", exc)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    os.kill(os.getpid(), signal.SIGTERM)


def _unlink_quiet(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    except OSError as exc:  # a read-only or vanished directory at exit: say so, do not raise
        log.warning("could not remove %s: %s", path, exc)


# ----------------------------------------------------------------------------------- checkpoints

_TMP_RE = re.compile(r"^\.(?P<tag>.+)\.tmp-(?P<pid>\d+)$")
_OLD_RE = re.compile(r"^(?P<tag>.+)\.old-(?P<pid>\d+)$")


def clean_checkpoint_leftovers(save_dir: str) -> list[str]:
    """What a save cut short by a crash left in ``save_dir`` (by a process no longer running on
    this host): ``.<tag>.tmp-<pid>`` (a half-written checkpoint, never named by ``latest``) is
    removed; ``<tag>.old-<pid>`` (the previous copy of a tag being replaced) is put back when the
    new one never got its name, removed otherwise. Returns what it did, each also logged."""
    done = []
    try:
        names = os.listdir(save_dir)
    except FileNotFoundError:
        return done
    for name in names:
        m = _TMP_RE.match(name) or _OLD_RE.match(name)
        if m is None or int(m["pid"]) == os.getpid() or pid_running(int(m["pid"])):
            continue
        path = os.path.join(save_dir, name)
        final = os.path.join(save_dir, m["tag"])
        if m.re is _OLD_RE and not os.path.exists(final):
            os.rename(path, final)
            done.append(f"restored {final} from {name}")
        else:
            if os.path.isdir(path) and not os.path.islink(path):
                shutil.rmtree(path, ignore_errors=True)
            else:
                _unlink_quiet(path)
            done.append(f"removed {path}")
    for what in done:
        log.warning("checkpoint directory %s: a save of a process that is gone was cut short: %s", save_dir, what)
    return done


# ----------------------------------------------------------------------------------- engine helper


def claim_swap_dirs(cfg: Any, pools: Any) -> SwapOwnership:
    """The engine's start checks and claim, from its resolved ``pyinfinity.config.Config`` and the
    layout's byte totals (``layout.pools.EnginePools``): the device and RAM budgets
    (``check_budgets``), then the swap directories of every state class placed on NVMe (locked,
    cleaned of a crashed run's files, checked for the layout's bytes of free space). An ownership
    with no directories when nothing goes to NVMe."""
    check_budgets(cfg, pools)
    plans = [SpacePlan(name, list(dirs), f.payload, f.nbytes, f.grow)
             for name, dirs, f in (("params", pools.param_dirs, pools.param_file),
                                   ("optimizer", pools.optim_dirs, pools.optim_file)) if dirs]
    dirs = [d for p in plans for d in p.dirs]
    return SwapOwnership.acquire(dirs, plans) if dirs else SwapOwnership()


def check_budgets(cfg: Any, pools: Any) -> None:
    """The device and RAM budgets of a resolved config against the layout's byte totals
    (``layout.pools.EnginePools``): ``CapacityError`` saying how much is missing and where.
    Writes nothing."""
    op = cfg.zero_optimization.offload_param
    missing = []
    host = cfg.pyinfinity.host_memory
    ram_need = pools.host
    if isinstance(host, int) and ram_need > host:
        missing.append(f"host RAM: {_fmt(ram_need)} (parameters {_fmt(pools.param_ram)}, optimizer states "
                       f"{_fmt(pools.optim_ram)}, gradients {_fmt(pools.grads)}) but pyinfinity.host_memory is "
                       f"{_fmt(host)}: {_fmt(ram_need - host)} missing; put more on NVMe "
                       "(offload_param/offload_optimizer device \"nvme\", offload_optimizer.ratio) or raise "
                       "pyinfinity.host_memory")
    dev = cfg.pyinfinity.device_memory
    if isinstance(dev, int) and pools.device_need > dev:
        what = ("all parameters (offload_param.device \"none\")" if op.device == "none" else
                f"the largest module's parameters {_fmt(pools.device_need - pools.persistent)} + persistent shards "
                f"{_fmt(pools.persistent)}")
        missing.append(f"device: at least {_fmt(pools.device_need)} ({what}) but pyinfinity.device_memory is "
                       f"{_fmt(dev)}: {_fmt(pools.device_need - dev)} missing; raise pyinfinity.device_memory"
                       + ("" if op.device != "none" else " or offload the parameters"))
    if missing:
        raise CapacityError("the model's training state does not fit: " + "; ".join(missing))


__all__ = ["SwapOwnership", "SpacePlan", "CapacityError", "SwapSpaceTooSmall", "SwapDirBusyError", "claim_swap_dirs", "check_budgets",
           "clean_checkpoint_leftovers",
           # from swap.manifest and swap.directories, importable from here as before
           "Owner", "SwapFileError", "read_manifest", "write_fsynced", "fsync_path", "LOCK_NAME", "MANIFEST_NAME",
           "MANIFEST_FORMAT", "MANIFEST_VERSION", "make_swap_dir", "remove_created_dirs", "mount_of"]
