"""`make build` reinstalls the extension only when what it is built from changed (csrc/,
CMakeLists.txt, setup.py, pyproject.toml): a second `make build` does nothing."""
from __future__ import annotations

import os
import shutil
import subprocess
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def dry_run(venv: str, *extra: str) -> str:
    """What `make build` would run (make -n), with ``venv`` as the virtual environment."""
    p = subprocess.run(["make", "-n", "-C", ROOT, "build", f"VENV={venv}", *extra], capture_output=True,
                       text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    return p.stdout


@pytest.mark.skipif(shutil.which("make") is None, reason="needs make")
def test_a_second_build_with_nothing_changed_does_not_reinstall(tmp_path):
    venv = str(tmp_path / "venv")
    os.makedirs(venv)
    future = time.time() + 3600  # newer than every source
    for stamp in (".bootstrapped", ".built"):
        path = os.path.join(venv, stamp)
        open(path, "w").close()
        os.utime(path, (future, future))
    assert "pip install" not in dry_run(venv)
    assert "pip install" in dry_run(venv, "-W", "CMakeLists.txt")  # a changed source rebuilds
    src = next(os.path.join(d, f)[len(ROOT) + 1:] for d, _, fs in os.walk(os.path.join(ROOT, "csrc")) for f in fs)
    assert "pip install" in dry_run(venv, "-W", src)
    os.unlink(os.path.join(venv, ".built"))
    assert "pip install" in dry_run(venv)  # never built
