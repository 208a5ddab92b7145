"""`pyinfinity report`: is this machine set up for offloading? Each check is OK, WARN or FAIL and
says the fix in words (the ds_report habit: most failures are configuration)."""
from __future__ import annotations

import logging
import os
import platform
import shutil
import sys
import tempfile
import uuid
from dataclasses import dataclass
from typing import Any, Optional

from pyinfinity.bench import machine as mach

log = logging.getLogger(__name__)

OK, WARN, FAIL = "OK", "WARN", "FAIL"
NETWORK_FILESYSTEMS = {"nfs", "nfs4", "cifs", "smb3", "fuse", "fuseblk", "sshfs", "9p", "lustre",
                       "gpfs", "ceph", "glusterfs"}
GOOD_FILESYSTEMS = {"ext4", "xfs", "btrfs", "f2fs"}


@dataclass
class Check:
    """One line of the report."""

    name: str
    status: str      # OK | WARN | FAIL
    detail: str
    fix: str = ""


@dataclass
class BackendProbe:
    backend: str
    compiled: bool
    ok: bool
    detail: str


def default_swap_dir() -> str:
    return os.environ.get("PYINFINITY_SWAP_DIR") or tempfile.gettempdir()


def swap_dirs_from_config(path: str) -> list[str]:
    """The ``nvme_path`` directories a DeepSpeed-format config names (through pyinfinity.config;
    its errors are ValueErrors that name the key)."""
    from pyinfinity.config import load_config

    return list(load_config(path).nvme_paths)


def _gib(n: float) -> str:
    return f"{n / (1 << 30):.1f} GiB"


def compiled_backends(info: dict[str, Any]) -> list[str]:
    """Backends the extension was built with, from ``build_info()`` (list or per-name flags)."""
    b = info.get("backends")
    if isinstance(b, (list, tuple)):
        return [str(x) for x in b]
    if isinstance(b, dict):
        return [k for k, v in b.items() if v]
    if isinstance(b, str):
        return [x.strip() for x in b.replace(",", " ").split()]
    return [k for k in ("aio", "uring", "posix") if info.get(k) or info.get(f"has_{k}")]


def probe_backends(directory: str) -> list[BackendProbe]:
    """Live round trip per backend in ``directory``: write 1 MiB + 7 random bytes at an odd offset,
    read them back, compare. Cheap (milliseconds); removes its file."""
    import torch

    info = mach.build_info()
    if "error" in info:
        return [BackendProbe(b, False, False, info["error"]) for b in ("aio", "uring", "posix")]
    from pyinfinity.swap import SwapEngine

    compiled = compiled_backends(info)
    out = []
    n, off = (1 << 20) + 7, 4096 + 3
    src = torch.randint(1, 256, (n,), dtype=torch.uint8)
    for b in ("aio", "uring", "posix"):
        if compiled and b not in compiled:
            out.append(BackendProbe(b, False, False, "not compiled into this build"))
            continue
        path = os.path.join(directory, f".pyinfinity-probe-{b}-{uuid.uuid4().hex}")
        try:
            eng = SwapEngine(backend=b, block_size=1 << 20, queue_depth=4, threads=1)
            eng.write(src, path, offset=off).wait()
            dst = torch.zeros(n, dtype=torch.uint8)
            eng.read(dst, path, offset=off).wait()
            ok = bool(torch.equal(src, dst))
            served = str(eng.backend_for(path))
            detail = "round trip OK" if ok else "data mismatch"
            if served != b:
                detail += f" (served by {served}: the engine fell back for this file)"
            out.append(BackendProbe(b, True, ok, detail))
        except Exception as exc:  # the reason is the result
            out.append(BackendProbe(b, True, False, f"{type(exc).__name__}: {exc}"))
        finally:
            try:
                os.unlink(path)
            except OSError:
                pass
    return out


def _check_versions() -> list[Check]:
    import torch

    import pyinfinity

    checks = [Check("python", OK if sys.version_info >= (3, 9) else FAIL,
                    f"{platform.python_version()} ({sys.executable})",
                    "" if sys.version_info >= (3, 9) else "use Python 3.9 or newer"),
              Check("torch", OK, f"{torch.__version__}, CUDA {torch.version.cuda or 'none (CPU build)'}"),
              Check("pyinfinity", OK, pyinfinity.__version__)]
    return checks


def _check_build() -> tuple[list[Check], dict[str, Any]]:
    info = mach.build_info()
    if "error" in info:
        return [Check("extension pyinfinity._C", FAIL, info["error"],
                      "build it: pip install --no-build-isolation -e . (needs cmake, ninja, pybind11, "
                      "a C++17 compiler)")], info
    flags = str(info.get("flags", info.get("cxx_flags", "")))
    compiler = str(info.get("compiler", "?"))
    detail = (f"{info.get('version', '?')}, {info.get('build_type', '?')} build, compiler {compiler}, "
              f"flags '{flags.strip() or '?'}', CUDA {info.get('cuda_version') or 'not compiled'}")
    if info.get("sanitizer"):
        detail += f", sanitizer {info['sanitizer']} (slow: for tests only)"
    opt_ok = (not flags or any(f in flags for f in ("-O2", "-O3"))) and not info.get("sanitizer")
    checks = [Check("extension pyinfinity._C", OK if opt_ok else WARN, detail,
                    "" if opt_ok else "rebuild with optimisation (-O2/-O3); -O0 I/O paths are slow")]
    comp = compiled_backends(info)
    missing = [b for b in ("aio", "uring", "posix") if comp and b not in comp]
    checks.append(Check("backends compiled", OK if not missing else WARN,
                        ", ".join(comp) if comp else "unknown (build_info has no backend list)",
                        f"{', '.join(missing)} not compiled: rebuild on a Linux with the kernel headers "
                        "(linux/aio_abi.h, linux/io_uring.h)" if missing else ""))
    return checks, info


def _check_gpu(info: dict[str, Any]) -> list[Check]:
    gpus, why = mach.gpu_info()
    cuda_built = info.get("cuda", info.get("cuda_compiled", None))
    checks = []
    if gpus:
        desc = "; ".join(f"{g.index}: {g.name}, {_gib(g.free_bytes)} free of {_gib(g.total_bytes)}"
                         for g in gpus)
        checks.append(Check("GPUs", OK, desc))
        if cuda_built is False:
            checks.append(Check("CUDA stager", FAIL, "extension built without CUDA but a GPU is present",
                                "rebuild with the CUDA toolkit visible (nvcc on PATH or CUDA_HOME set): "
                                "pip install --no-build-isolation -e ."))
        elif cuda_built:
            checks.append(Check("CUDA stager", OK, "compiled; device present"))
    else:
        try:
            import pyinfinity._C as C
            from pyinfinity.swap.stager import cuda_status_words

            why += f"; CUDA runtime: {cuda_status_words(C.cuda_status())}"
        except (ImportError, AttributeError):
            pass
        checks.append(Check("GPUs", WARN, why,
                            "GPU offload needs a CUDA device and a CUDA build of torch; CPU-only runs "
                            "(tests, device='cpu') still work"))
        if cuda_built is not None:
            checks.append(Check("CUDA stager", OK if cuda_built else WARN,
                                "compiled, unused without a device" if cuda_built else "not compiled",
                                "" if cuda_built else "build with the CUDA toolkit present to stage "
                                "NVMe<->GPU through pinned memory"))
    return checks


def _check_host() -> list[Check]:
    mem = mach.mem_info()
    total, avail = mem.get("MemTotal", 0), mem.get("MemAvailable", 0)
    checks = [Check("host RAM", OK if avail >= 8 << 30 else WARN,
                    f"{_gib(total)} total, {_gib(avail)} available",
                    "" if avail >= 8 << 30 else "little free RAM: pinned buffers and CPU-offloaded "
                    "states need it; close other jobs or offload more to NVMe")]
    lim = mach.memlock_limit()
    root = os.geteuid() == 0
    if lim is None:
        checks.append(Check("locked memory (ulimit -l)", OK, "unlimited"))
    elif root:
        checks.append(Check("locked memory (ulimit -l)", OK,
                            f"{lim // 1024} KiB, not enforced for root (CAP_IPC_LOCK)"))
    else:
        big = lim >= 1 << 30
        checks.append(Check("locked memory (ulimit -l)", OK if big else WARN, f"{lim // 1024} KiB",
                            "" if big else "pinned host buffers cannot be mlock()ed beyond this: raise "
                            "it (ulimit -l unlimited, or 'memlock' in /etc/security/limits.conf, or "
                            "--ulimit memlock=-1 for docker); CUDA pinning via cudaHostAlloc is not "
                            "limited by it"))
    return checks


def _check_path(path: str, need_bytes: int) -> list[Check]:
    checks = []
    fs = mach.fs_info(path)
    where = f"{path} on {fs.mount_point or '?'} ({fs.fs_type}, {fs.source})"
    exists = os.path.isdir(path)
    anc = mach.existing_ancestor(path)
    if fs.read_only:
        checks.append(Check("swap path writable", FAIL, f"{where} is mounted read-only",
                            "swap files must be written: remount read-write or choose a path on a "
                            "writable NVMe filesystem (--path / nvme_path)"))
    elif not os.access(anc, os.W_OK):
        checks.append(Check("swap path writable", FAIL, f"{anc} is not writable by uid {os.geteuid()}",
                            "fix the directory's permissions or choose another path"))
    else:
        checks.append(Check("swap path writable", OK,
                            where + ("" if exists else f" (will be created under {anc})")))
    if fs.in_memory:
        checks.append(Check("filesystem type", WARN, f"{fs.fs_type}: a RAM filesystem",
                            "swap files there use host RAM, not NVMe, and benchmarks measure memory; "
                            "point the swap path at an NVMe drive (ext4 or xfs)"))
    elif fs.fs_type in NETWORK_FILESYSTEMS or fs.fs_type.startswith("fuse"):
        checks.append(Check("filesystem type", WARN, f"{fs.fs_type}: network/FUSE filesystem",
                            "slow and often without O_DIRECT: use a local NVMe drive"))
    elif fs.fs_type in GOOD_FILESYSTEMS:
        checks.append(Check("filesystem type", OK, fs.fs_type))
    else:
        checks.append(Check("filesystem type", WARN, f"{fs.fs_type}: untested for swapping",
                            "ext4 or xfs on a local NVMe drive is what is measured and supported"))
    free = fs.free_bytes
    if free < need_bytes:
        checks.append(Check("free space", FAIL, f"{_gib(free)} free at {fs.mount_point}, "
                            f"{_gib(need_bytes)} needed",
                            "free space there, or point the swap path at a larger drive; the offloaded "
                            "parameters and optimizer states must fit (--need sets the requirement)"))
    elif free < 2 * need_bytes:
        checks.append(Check("free space", WARN, f"{_gib(free)} free at {fs.mount_point}",
                            "less than twice the requirement: checkpoints next to swap files may not fit"))
    else:
        checks.append(Check("free space", OK, f"{_gib(free)} free of {_gib(fs.total_bytes)}"))
    if fs.read_only or not os.access(anc, os.W_OK):
        checks.append(Check("I/O backends on path", FAIL, "not probed: the path is not writable",
                            "make the path writable, then run report again"))
        return checks
    made = False
    if not exists:
        try:
            os.makedirs(path, exist_ok=True)
            made = True
        except OSError as exc:
            checks.append(Check("I/O backends on path", FAIL, f"cannot create {path}: {exc}",
                                "create the directory or choose another path"))
            return checks
    try:
        direct = mach.probe_o_direct(path)
        checks.append(Check("O_DIRECT", OK if direct.ok else WARN,
                            "works" if direct.ok else f"fails: {direct.error}",
                            "" if direct.ok else "the filesystem has no O_DIRECT: only the posix backend "
                            "(through the page cache) works; use ext4/xfs on NVMe for aio/uring"))
        probes = probe_backends(path)
        working = [p.backend for p in probes if p.ok]
        for p in probes:
            if not p.compiled:
                continue
            st = OK if p.ok else (WARN if working else FAIL)
            fix = ""
            if not p.ok:
                fix = {"aio": "kernel AIO needs O_DIRECT support and fs.aio-max-nr headroom "
                              "(sysctl fs.aio-max-nr)",
                       "uring": "io_uring may be disabled (sysctl kernel.io_uring_disabled=0) or "
                                "blocked by seccomp in containers (docker --security-opt)",
                       "posix": "check permissions and free space at the path"}.get(p.backend, "")
            checks.append(Check(f"backend {p.backend} on path", st, p.detail, fix))
        auto = _auto_choice(path)
        if auto:
            checks.append(Check("backend auto picks", OK if auto in working else WARN, auto,
                                "" if auto in working else "auto picked a backend that failed the probe: "
                                "report it"))
        if not any(p.compiled for p in probes):
            checks.append(Check("I/O backends on path", FAIL, probes[0].detail if probes else "none",
                                "build the extension: pip install --no-build-isolation -e ."))
    finally:
        if made:
            try:
                os.rmdir(path)
            except OSError:
                pass
    return checks


def _auto_choice(path: str) -> Optional[str]:
    try:
        import pyinfinity._C as C

        r = C.probe_backend(path)
        return str(r["best"]) if isinstance(r, dict) else str(r)
    except Exception as exc:
        log.debug("probe_backend failed: %s", exc)
        return None


def _read_int(path: str) -> Optional[int]:
    try:
        with open(path) as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def _check_kernel() -> list[Check]:
    """Kernel limits the aio and uring backends depend on."""
    checks = []
    nr, mx = _read_int("/proc/sys/fs/aio-nr"), _read_int("/proc/sys/fs/aio-max-nr")
    if nr is not None and mx is not None:
        free = mx - nr
        checks.append(Check("kernel AIO contexts", OK if free >= 4096 else WARN,
                            f"{nr} of fs.aio-max-nr {mx} in use",
                            "" if free >= 4096 else "few kernel AIO events left: raise it "
                            "(sysctl -w fs.aio-max-nr=1048576) or the aio backend fails with EAGAIN"))
    dis = _read_int("/proc/sys/kernel/io_uring_disabled")
    if dis is not None:
        checks.append(Check("io_uring", OK if dis == 0 else WARN,
                            "enabled" if dis == 0 else f"kernel.io_uring_disabled = {dis}",
                            "" if dis == 0 else "the uring backend needs sysctl -w "
                            "kernel.io_uring_disabled=0; aio and posix still work"))
    return checks


def _check_tools() -> list[Check]:
    checks = []
    import importlib.metadata
    import importlib.util

    # not imported: deepspeed's import probes accelerators and prints to stdout
    try:
        if importlib.util.find_spec("deepspeed") is None:
            raise ModuleNotFoundError("deepspeed")
        checks.append(Check("deepspeed", OK,
                            f"{importlib.metadata.version('deepspeed')} installed"))
    except Exception as exc:
        checks.append(Check("deepspeed", WARN, f"not installed ({type(exc).__name__})",
                            "only needed for the DeepSpeed integration and its aio peer in "
                            "`bench io`: pip install deepspeed"))
    fio = shutil.which("fio")
    checks.append(Check("fio", OK if fio else WARN, mach.tool_version(["fio", "--version"]) or "missing",
                        "" if fio else "`bench io` compares with fio when present: apt-get install fio"))
    return checks


def run_report(path: Optional[str] = None, need_bytes: int = 10 << 30) -> list[Check]:
    """Every check, in the order printed."""
    path = os.path.abspath(path or default_swap_dir())
    checks = _check_versions()
    build_checks, info = _check_build()
    checks += build_checks
    checks += _check_gpu(info)
    checks += _check_host()
    checks += _check_kernel()
    checks += _check_path(path, need_bytes)
    checks += _check_tools()
    return checks


def worst(checks: list[Check]) -> str:
    order = {OK: 0, WARN: 1, FAIL: 2}
    return max((c.status for c in checks), key=order.__getitem__, default=OK)
