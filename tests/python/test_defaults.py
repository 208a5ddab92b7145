"""The defaults table: every knob documented in README.md, bad values are clear errors."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from pyinfinity import _C

ROOT = Path(__file__).resolve().parents[2]


def test_every_env_var_is_documented_in_readme():
    readme = (ROOT / "README.md").read_text()
    missing = [d["env"] for d in _C.defaults() if d["env"] not in readme]
    assert not missing, f"README.md does not document {missing}"


def test_env_overrides_and_validation():
    code = "from pyinfinity.swap import SwapEngine; e = SwapEngine(); print(e.block_size, e.queue_depth)"
    env = dict(os.environ, PYINFINITY_BLOCK_SIZE="256KiB", PYINFINITY_QUEUE_DEPTH="7")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert out.stdout.split() == ["262144", "7"], out.stderr
    env["PYINFINITY_QUEUE_DEPTH"] = "lots"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode != 0 and "PYINFINITY_QUEUE_DEPTH" in out.stderr


def test_build_info():
    info = _C.build_info()
    assert set(info["backends"]) == {"aio", "uring", "posix"}
    assert "-O2" in info["cxx_flags"] or "-O3" in info["cxx_flags"] or info["sanitizer"]
