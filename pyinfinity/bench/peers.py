"""The peers every pyinfinity figure is compared with, on the same file in the same run: fio
(libaio, io_uring), dd with O_DIRECT, and DeepSpeed's own aio handle (in a worker process, see
:mod:`pyinfinity.bench.ds_worker`)."""
from __future__ import annotations

import json
import logging
import os
import re
import select
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from typing import Any, Optional, Protocol

from pyinfinity.bench.records import PeerStatus, Result
from pyinfinity.bench.workload import IoConfig

log = logging.getLogger(__name__)


@dataclass
class Sample:
    """One timed repetition."""

    seconds: float
    nbytes: int
    verified: Optional[bool] = None   # None: this repetition was not checked


class Runner(Protocol):
    """A tool that can move an :class:`IoConfig`'s bytes to or from ``path``."""

    tool: str
    backend: str

    def supports(self, cfg: IoConfig) -> Optional[str]:
        """None when ``cfg`` can run, else why not (shown in the table's note)."""

    def run(self, cfg: IoConfig, path: str, verify: bool) -> Sample:
        """Run ``cfg`` once on ``path``; with ``verify``, check the data (untimed)."""

    def close(self) -> None: ...


# --------------------------------------------------------------------------------------------- fio
FIO_ENGINES = ("libaio", "io_uring")


def fio_status() -> PeerStatus:
    exe = shutil.which("fio")
    if exe is None:
        return PeerStatus("fio", False, note="fio is not installed (Debian/Ubuntu: apt-get install fio); "
                                            "figures come without fio's for comparison")
    out = subprocess.run([exe, "--version"], capture_output=True, text=True)
    return PeerStatus("fio", True, version=out.stdout.strip())


def fio_engine_works(engine: str, directory: str, direct: bool) -> Optional[str]:
    """None when fio's ``engine`` runs in ``directory``, else fio's complaint."""
    fd, path = tempfile.mkstemp(prefix=".pyinfinity-fio-", dir=directory)
    os.close(fd)
    try:
        cmd = ["fio", "--name=probe", f"--filename={path}", "--rw=write", "--bs=4k", "--size=64k",
               f"--ioengine={engine}", f"--direct={int(direct)}", "--output-format=json"]
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
        if out.returncode != 0:
            return (out.stderr.strip() or out.stdout.strip()).splitlines()[-1][:200]
        return None
    except (OSError, subprocess.TimeoutExpired) as exc:
        return str(exc)
    finally:
        os.unlink(path)


SUSPECT_BELOW_DD = 0.8
"""A peer below this fraction of dd (one block in flight) on the same file, size, block and
direction was run wrongly or disturbed: it is flagged, never divided by."""
SUSPECT_NOTE = "suspect"


class FioRunner:
    """fio on the same file: ``--bs`` = block size (file) or tensor size (small tensors),
    ``--iodepth`` = queue depth, ``--numjobs`` = threads, each job on its own slice of the file;
    ``--direct=1`` whenever pyinfinity's rows use O_DIRECT. Every configuration starts with an
    untimed warm-up pass of the same job (fio's process start, file open and the drive's first
    touch stay out of the figures)."""

    tool = "fio"

    def __init__(self, engine: str, direct: bool, batch_reps: int = 0) -> None:
        self.backend = engine
        self.direct = direct
        # batch_reps > 1: one fio process runs that many repetitions back to back (each a job of
        # its own reporting group) and later calls hand them out; saves fio's ~0.3 s start per
        # repetition (the --quick preset), at the price of not interleaving fio with the others
        self.batch_reps = batch_reps
        self._batched: dict[tuple, list[Sample]] = {}

    def supports(self, cfg: IoConfig) -> Optional[str]:
        if cfg.workload == "small-odd":
            return "fio has no packed odd-size workload"
        unit = cfg.block_size if cfg.workload == "file" else cfg.io_size
        if cfg.nbytes // cfg.threads < unit:
            return "file too small for this many jobs"
        return None

    def _cmd(self, cfg: IoConfig, path: str, verify: bool, jobs: int = 1) -> list[str]:
        unit = cfg.block_size if cfg.workload == "file" else cfg.io_size
        per_job = (cfg.nbytes // cfg.threads) // unit * unit
        cmd = ["fio", f"--filename={path}", f"--ioengine={self.backend}",
               f"--rw={cfg.op}", f"--bs={unit}", f"--iodepth={cfg.queue_depth}",
               f"--numjobs={cfg.threads}", f"--size={per_job}", f"--offset_increment={per_job}",
               f"--direct={int(self.direct)}", "--thread", "--group_reporting",
               "--allow_file_create=0", "--verify_state_save=0",
               "--output-format=json"]
        if cfg.op == "write" and not self.direct:
            cmd.append("--end_fsync=1")
        if verify:
            cmd += ["--verify=crc32c", "--do_verify=1", "--verify_fatal=1"]
        cmd.append("--name=warmup")  # untimed: its group is dropped (see _timed_jobs)
        for i in range(jobs):
            cmd += [f"--name=rep{i}", "--stonewall", "--new_group"]
        return cmd

    @staticmethod
    def _timed_jobs(data: dict[str, Any]) -> list[dict[str, Any]]:
        return [j for j in data["jobs"] if j.get("jobname") != "warmup"]

    def _exec(self, cmd: list[str]) -> dict[str, Any]:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        if out.returncode != 0:
            raise RuntimeError(f"fio failed ({out.returncode}): {out.stderr.strip()[-300:]}")
        text = out.stdout[out.stdout.find("{"):]
        return json.loads(text)

    def run(self, cfg: IoConfig, path: str, verify: bool) -> Sample:
        verified: Optional[bool] = None
        if verify and cfg.op == "write":
            # an untimed extra pass: fio writes crc32c-stamped blocks and reads them all back
            try:
                self._exec(self._cmd(cfg, path, verify=True))
                verified = True
            except RuntimeError as exc:
                if "verify" not in str(exc).lower() and "err=84" not in str(exc):
                    raise  # fio failed for another reason: a failure, not bad data
                log.warning("fio verify failed: %s", exc)
                verified = False
        key = (cfg, path)
        if self.batch_reps > 1:
            if not self._batched.get(key):
                data = self._exec(self._cmd(cfg, path, verify=False, jobs=self.batch_reps))
                self._batched[key] = [self._sample(j, cfg.op) for j in self._timed_jobs(data)]
            smp = self._batched[key].pop(0)
        else:
            smp = self._sample(self._timed_jobs(self._exec(self._cmd(cfg, path, verify=False)))[0], cfg.op)
        smp.verified = verified
        return smp

    @staticmethod
    def _sample(job: dict[str, Any], op: str) -> Sample:
        d = job[op]
        runtime_ms = d.get("runtime", 0)
        nbytes = int(d["io_bytes"])
        if runtime_ms <= 0 or nbytes <= 0:
            raise RuntimeError(f"fio reported no {op} I/O: {d}")
        return Sample(runtime_ms / 1000.0, nbytes)

    def close(self) -> None:
        pass


def flag_suspect_peers(results: list[Result]) -> list[str]:
    """Marks every peer (fio, DeepSpeed) result below SUSPECT_BELOW_DD x dd's median on the same
    file, size, block and direction as suspect (its note says why; ratios skip it). dd keeps one
    block in flight, so any peer at the same block size should reach it. Returns the notes."""
    out = []
    for r in results:
        if r.tool in ("pyinfinity", "dd") or not r.seconds or r.workload != "file":
            continue
        dd = next((d for d in results if d.tool == "dd" and d.seconds and d.verified is not False
                   and (d.workload, d.op, d.nbytes, d.block_size) == (r.workload, r.op, r.nbytes, r.block_size)),
                  None)
        if dd is None or r.gbps_median >= SUSPECT_BELOW_DD * dd.gbps_median:
            continue
        r.note = (f"{SUSPECT_NOTE}: {r.gbps_median:.2f} GB/s is below {SUSPECT_BELOW_DD}x dd's "
                  f"{dd.gbps_median:.2f} GB/s on the same file and size; not used as a reference"
                  + (f"; {r.note}" if r.note else ""))
        out.append(f"{r.label()} {r.op} bs {r.block_size} qd {r.queue_depth}: {r.note}")
    return out


# ---------------------------------------------------------------------------------------------- dd
_DD_SECONDS = re.compile(r"copied, ([0-9.eE+-]+) s")


class DdRunner:
    """GNU dd, one block in flight: ``iflag=direct``/``oflag=direct`` (or buffered + fdatasync with
    caches dropped, where O_DIRECT is unavailable). Writes copy random bytes from a RAM file."""

    tool = "dd"

    def __init__(self, direct: bool, scratch_dir: Optional[str] = None) -> None:
        self.direct = direct
        self.backend = "O_DIRECT" if direct else "buffered"
        shm = "/dev/shm"
        self.scratch_dir = scratch_dir or (shm if os.path.isdir(shm) and os.access(shm, os.W_OK)
                                           else tempfile.gettempdir())
        self._src: Optional[str] = None
        self._src_size = 0

    def supports(self, cfg: IoConfig) -> Optional[str]:
        if cfg.workload != "file":
            return "dd moves one stream, not many tensors"
        if cfg.queue_depth != 1 or cfg.threads != 1:
            return "dd has one block in flight"
        if cfg.nbytes % cfg.block_size:
            return "size not a multiple of the block size"
        return None

    def _source(self, nbytes: int) -> str:
        if self._src is None or self._src_size < nbytes:
            self.close()
            fd, self._src = tempfile.mkstemp(prefix="pyinfinity-dd-src-", dir=self.scratch_dir)
            with os.fdopen(fd, "wb") as f:
                chunk = os.urandom(1 << 20)
                left = nbytes
                while left > 0:
                    k = min(left, len(chunk))
                    f.write(chunk[:k])
                    left -= k
                    chunk = chunk[1:] + chunk[:1]  # not periodic at 1 MiB
            self._src_size = nbytes
        return self._src

    def run(self, cfg: IoConfig, path: str, verify: bool) -> Sample:
        count = cfg.nbytes // cfg.block_size
        if cfg.op == "read":
            cmd = ["dd", f"if={path}", "of=/dev/null", f"bs={cfg.block_size}", f"count={count}"]
            cmd += ["iflag=direct"] if self.direct else []
        else:
            src = self._source(cfg.nbytes)
            cmd = ["dd", f"if={src}", f"of={path}", f"bs={cfg.block_size}", f"count={count}",
                   "conv=notrunc" + ("" if self.direct else ",fdatasync")]
            cmd += ["oflag=direct"] if self.direct else []
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=600,
                             env={**os.environ, "LC_ALL": "C"})
        if out.returncode != 0:
            raise RuntimeError(f"dd failed: {out.stderr.strip()[-300:]}")
        m = _DD_SECONDS.search(out.stderr)
        if not m:
            raise RuntimeError(f"cannot parse dd's output: {out.stderr.strip()[-200:]}")
        verified = None
        if verify and cfg.op == "write":
            verified = _same_file_prefix(self._source(cfg.nbytes), path, cfg.nbytes)
        return Sample(float(m.group(1)), cfg.nbytes, verified)

    def close(self) -> None:
        if self._src:
            try:
                os.unlink(self._src)
            except OSError:
                pass
        self._src, self._src_size = None, 0


def _same_file_prefix(a: str, b: str, nbytes: int) -> bool:
    """Untimed check that the first ``nbytes`` of two files are equal; leaves ``b`` uncached."""
    with open(a, "rb") as fa, open(b, "rb") as fb:
        left = nbytes
        while left > 0:
            k = min(left, 16 << 20)
            if fa.read(k) != fb.read(k):
                return False
            left -= k
        os.posix_fadvise(fb.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
    return True


# --------------------------------------------------------------------------------------- DeepSpeed
class DeepSpeedRunner:
    """DeepSpeed's ``aio_handle``, in a worker process: its import prints to stdout, it can abort
    the process on odd sizes, and its handle must be destroyed before interpreter exit."""

    tool = "deepspeed"
    backend = "aio_handle"

    def __init__(self, allow_build: bool = False, timeout: float = 900.0) -> None:
        self.allow_build = allow_build
        self.timeout = timeout
        self._proc: Optional[subprocess.Popen] = None
        self._begin_error = ""
        self.status = PeerStatus("deepspeed", False)

    def begin(self) -> None:
        """Start the worker and ask it to load the op, without waiting (it imports deepspeed,
        seconds, while the caller prepares files)."""
        cmd = [sys.executable, "-m", "pyinfinity.bench.ds_worker"]
        try:
            self._proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                          stderr=subprocess.DEVNULL, text=True, bufsize=1)
            self._send({"cmd": "init", "allow_build": self.allow_build})
        except OSError as exc:
            self._begin_error = str(exc)

    def start(self) -> PeerStatus:
        """Wait for the op to load (``begin`` first if not yet); the status says why not."""
        if self._proc is None and not self._begin_error:
            self.begin()
        try:
            if self._begin_error:
                raise RuntimeError(self._begin_error)
            reply = self._receive()
        except (OSError, RuntimeError, json.JSONDecodeError) as exc:
            reply = {"ok": False, "error": str(exc)}
        if reply.get("ok"):
            self.status = PeerStatus("deepspeed", True, version=reply.get("version", ""))
        else:
            self.status = PeerStatus("deepspeed", False, version=reply.get("version", ""),
                                     note=reply.get("error", "unknown error"))
            self.close()
        return self.status

    def _send(self, msg: dict[str, Any]) -> None:
        if self._proc is None or self._proc.poll() is not None:
            raise RuntimeError("DeepSpeed worker is not running")
        assert self._proc.stdin is not None
        self._proc.stdin.write(json.dumps(msg) + "\n")
        self._proc.stdin.flush()

    def _receive(self) -> dict[str, Any]:
        if self._proc is None:
            raise RuntimeError("DeepSpeed worker is not running")
        assert self._proc.stdout is not None
        ready, _, _ = select.select([self._proc.stdout], [], [], self.timeout)
        if not ready:  # a hung handle must not hang the benchmark
            self._proc.kill()
            self._proc.wait()
            self._proc = None
            raise RuntimeError(f"DeepSpeed worker gave no answer in {self.timeout:.0f} s; killed")
        line = self._proc.stdout.readline()
        if not line:
            code = self._proc.wait(timeout=10)
            self._proc = None
            raise RuntimeError(f"DeepSpeed worker died (exit {code})")
        return json.loads(line)

    def _call(self, msg: dict[str, Any]) -> dict[str, Any]:
        self._send(msg)
        return self._receive()

    def supports(self, cfg: IoConfig) -> Optional[str]:
        if not self.status.available:
            return "DeepSpeed aio unavailable"
        if any(s % (512 * cfg.threads) for s in cfg.sizes):
            return "DeepSpeed's handle needs sizes in 512-byte multiples per thread (aborts otherwise)"
        return None

    def run(self, cfg: IoConfig, path: str, verify: bool) -> Sample:
        reply = self._call({"cmd": "run", "path": path, "op": cfg.op, "sizes": list(cfg.sizes),
                            "block_size": cfg.block_size, "queue_depth": cfg.queue_depth,
                            "threads": cfg.threads, "verify": verify})
        if not reply.get("ok"):
            raise RuntimeError(f"DeepSpeed aio: {reply.get('error')}")
        return Sample(float(reply["seconds"]), int(reply["nbytes"]), reply.get("verified"))

    def close(self) -> None:
        if self._proc is not None:
            try:
                if self._proc.poll() is None:
                    self._call({"cmd": "exit"})
                self._proc.wait(timeout=30)
            except (RuntimeError, OSError, subprocess.TimeoutExpired, json.JSONDecodeError):
                self._proc.kill()
                self._proc.wait()
            self._proc = None


