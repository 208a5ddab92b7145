"""Worker process that drives DeepSpeed's ``aio_handle`` for the benchmark (see
``peers.DeepSpeedRunner``). Protocol: one JSON object per line on stdin, one reply per line on
the original stdout; everything DeepSpeed prints goes to stderr."""
from __future__ import annotations

import json
import os
import sys
import time
from typing import Any, Optional, TextIO

SEED = 20261202


def _jit_library(name: str) -> str:
    """Where torch's JIT builder keeps op ``name`` for this interpreter (computed, not created:
    torch's own helper makes the directory)."""
    import torch
    from torch.utils.cpp_extension import get_default_build_root

    root = os.environ.get("TORCH_EXTENSIONS_DIR") or get_default_build_root()
    cu = "cpu" if torch.version.cuda is None else "cu" + torch.version.cuda.replace(".", "")
    tag = f"py{sys.version_info.major}{sys.version_info.minor}_{cu}"
    return os.path.join(root, tag, name, f"{name}.so")


def _load_op(allow_build: bool) -> tuple[Any, str]:
    import deepspeed
    from deepspeed.ops.op_builder import AsyncIOBuilder

    version = deepspeed.__version__
    builder = AsyncIOBuilder()
    try:
        from deepspeed.git_version_info import installed_ops
        prebuilt = bool(installed_ops.get("async_io"))
    except ImportError:
        prebuilt = False
    if not prebuilt and not allow_build:
        # Load the library torch's JIT builder left behind, as it is: builder.load() would
        # recompile it (minutes) whenever the sources' paths differ, e.g. from another venv.
        path = _jit_library(builder.name)
        if not os.path.exists(path):
            if not builder.is_compatible(verbose=False):
                raise RuntimeError("DeepSpeed's async_io op cannot be built here: libaio headers "
                                   "missing (apt-get install libaio-dev)")
            raise RuntimeError("DeepSpeed's async_io op is not built; pass --deepspeed-build to "
                               "JIT-compile it (minutes), or install deepspeed with DS_BUILD_AIO=1")
        import importlib.util

        import ctypes

        import torch  # noqa: F401 - the op links against libtorch

        # async_io resolves symbols of DeepSpeed's pin_memory op, which its builder loads first.
        pin = _jit_library("pin_memory")
        if os.path.exists(pin):
            ctypes.CDLL(pin, mode=ctypes.RTLD_GLOBAL)
        spec = importlib.util.spec_from_file_location(builder.name, path)
        mod = importlib.util.module_from_spec(spec)
        try:
            spec.loader.exec_module(mod)
        except ImportError as exc:
            raise RuntimeError(f"DeepSpeed's cached async_io op at {path} does not load ({exc}); "
                               "pass --deepspeed-build to rebuild it") from None
        return mod, version
    if not prebuilt and not builder.is_compatible(verbose=False):
        raise RuntimeError("DeepSpeed's async_io op cannot be built here: libaio headers "
                           "missing (apt-get install libaio-dev)")
    return builder.load(verbose=False), version


class Worker:
    def __init__(self) -> None:
        self.op: Any = None
        self.handles: dict[tuple[int, int, int], Any] = {}
        self.src: Any = None
        self.dst: Any = None

    def _handle(self, bs: int, qd: int, threads: int) -> Any:
        key = (bs, qd, threads)
        if key not in self.handles:
            self.handles[key] = self.op.aio_handle(bs, qd, False, False, threads)
        return self.handles[key]

    def _buffers(self, nbytes: int) -> None:
        import torch

        from pyinfinity.bench.pattern import fill_pattern

        if self.src is None or self.src.numel() < nbytes:
            h = self._handle(1 << 20, 1, 1)
            example = torch.empty(0, dtype=torch.uint8)
            for t in (self.src, self.dst):
                if t is not None:
                    h.free_cpu_locked_tensor(t)
            self.src = h.new_cpu_locked_tensor(nbytes, example)
            self.dst = h.new_cpu_locked_tensor(nbytes, example)
            fill_pattern(self.src, SEED)

    def run(self, m: dict[str, Any]) -> dict[str, Any]:
        from pyinfinity.bench.pattern import fill_poison, same

        sizes: list[int] = m["sizes"]
        total = sum(sizes)
        self._buffers(total)
        h = self._handle(m["block_size"], m["queue_depth"], m["threads"])
        path, op = m["path"], m["op"]
        buf = self.src if op == "write" else self.dst
        if op == "read":
            fill_poison(self.dst[:total])
        reqs, off = [], 0
        for s in sizes:
            reqs.append((off, s))
            off += s
        t0 = time.perf_counter()
        if len(reqs) == 1:
            fn = h.sync_pwrite if op == "write" else h.sync_pread
            done = fn(buf[:total], path, 0)
        else:
            submit = h.async_pwrite if op == "write" else h.async_pread
            for o, s in reqs:
                rc = submit(buf[o:o + s], path, o)
                if rc != 0:
                    return {"ok": False, "error": f"async_p{op} returned {rc}"}
            done = h.wait()
        seconds = time.perf_counter() - t0
        if done != len(reqs):
            return {"ok": False, "error": f"{done} of {len(reqs)} {op}s completed"}
        verified: Optional[bool] = None
        if m.get("verify"):
            if op == "write":  # read back, untimed
                fill_poison(self.dst[:total])
                h.sync_pread(self.dst[:total], path, 0)
            verified = same(self.src[:total], self.dst[:total])
        return {"ok": True, "seconds": seconds, "nbytes": total, "verified": verified}

    def close(self) -> None:
        if self.handles:
            h = next(iter(self.handles.values()))
            for t in (self.src, self.dst):
                if t is not None:
                    h.free_cpu_locked_tensor(t)
        self.src = self.dst = None
        self.handles.clear()  # DeepSpeed's handle aborts the process if left to interpreter exit


def serve(inp: TextIO, out: TextIO) -> None:
    w = Worker()
    try:
        for line in inp:
            m = json.loads(line)
            try:
                if m["cmd"] == "init":
                    w.op, version = _load_op(bool(m.get("allow_build")))
                    reply: dict[str, Any] = {"ok": True, "version": version}
                elif m["cmd"] == "run":
                    reply = w.run(m)
                elif m["cmd"] == "exit":
                    out.write(json.dumps({"ok": True}) + "\n")
                    out.flush()
                    break
                else:
                    reply = {"ok": False, "error": f"unknown command {m['cmd']!r}"}
            except Exception as exc:  # reported to the parent, which labels the peer unavailable
                reply = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
            out.write(json.dumps(reply) + "\n")
            out.flush()
    finally:
        w.close()


def main() -> None:
    # DeepSpeed logs to stdout: keep the real stdout for replies, send fd 1 to stderr.
    reply_fd = os.dup(1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    with os.fdopen(reply_fd, "w", buffering=1) as out:
        serve(sys.stdin, out)


if __name__ == "__main__":
    main()
