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


def fake_venv(tmp_path, gpu: bool) -> str:
    """A venv whose python answers the Makefile's GPU probe (and is never run otherwise: make -n)."""
    venv = tmp_path / ("venv-gpu" if gpu else "venv-cpu")
    (venv / "bin").mkdir(parents=True)
    py = venv / "bin" / "python"
    py.write_text("#!/bin/sh\necho %s\n" % ("1" if gpu else ""))
    py.chmod(0o755)
    future = time.time() + 3600
    for stamp in (".bootstrapped", ".built"):
        path = venv / stamp
        path.touch()
        os.utime(path, (future, future))
    return str(venv)


def train_command(venv: str, *extra: str) -> str:
    p = subprocess.run(["make", "-n", "-C", ROOT, "train", f"VENV={venv}", *extra], capture_output=True,
                       text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    return next(line for line in p.stdout.splitlines() if "-m pyinfinity train" in line)


@pytest.mark.skipif(shutil.which("make") is None, reason="needs make")
def test_make_train_uses_the_gpu_when_the_venv_sees_one(tmp_path):
    cpu = train_command(fake_venv(tmp_path, gpu=False))
    assert "--device cpu" in cpu and "--offload nvme" in cpu and "--model-size small" in cpu
    gpu = train_command(fake_venv(tmp_path, gpu=True))
    assert "--device cuda" in gpu and "--device cpu" not in gpu
    assert "--model-size 1b" in gpu and "--gpu-memory 1GiB" in gpu
    # the preset's bf16 weights exceed the budget it sets: a real offload run
    from pyinfinity.cli.train import VOCAB
    from pyinfinity.config import parse_size
    from pyinfinity.presets import PRESETS

    f = PRESETS["1b"]
    hidden, layers, inter = f["hidden_size"], f["num_hidden_layers"], f["intermediate_size"]
    params = layers * (4 * hidden * hidden + 3 * hidden * inter + 2 * hidden) + 2 * VOCAB * hidden + hidden
    assert 2 * params > parse_size("1GiB", "budget")
    # TRAIN_ARGS given on the command line wins on either machine
    assert "--steps 3" in train_command(fake_venv(tmp_path / "x", gpu=True), "TRAIN_ARGS=--steps 3")


def test_bootstrap_from_a_virtual_environment_uses_its_torch(tmp_path):
    """A GPU image's python3 is often itself a virtual environment holding torch: the venv the
    README's commands make from it must import that torch (--system-site-packages alone reaches
    only the base interpreter's packages) and install nothing (such a machine may be offline)."""
    import sys

    if sys.prefix == sys.base_prefix:
        pytest.skip("the test runs under a virtual environment's python (the project's .venv)")
    venv = tmp_path / "v"
    env = {**os.environ, "PIP_NO_INDEX": "1"}  # any install attempt fails instead of reaching the network
    p = subprocess.run(["bash", os.path.join(ROOT, ".ci", "bootstrap.sh"), sys.executable, str(venv)],
                       capture_output=True, text=True, timeout=600, env=env)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    assert "installing" not in p.stdout, p.stdout
    q = subprocess.run([str(venv / "bin" / "python"), "-c", "import torch, sys; print(torch.__file__)"],
                       capture_output=True, text=True, timeout=120)
    assert q.returncode == 0 and q.stdout.startswith(sys.prefix), q.stdout + q.stderr


@pytest.mark.skipif(shutil.which("make") is None, reason="needs make")
def test_make_test_says_how_long_it_takes_and_offers_a_quick_subset(tmp_path):
    venv = fake_venv(tmp_path, gpu=False)
    full = subprocess.run(["make", "-n", "-C", ROOT, "test", f"VENV={venv}"], capture_output=True, text=True,
                          timeout=60)
    assert full.returncode == 0, full.stderr
    first = next(line for line in full.stdout.splitlines() if line.startswith("echo"))
    assert "min" in first and "make test-quick" in first  # said before anything is built
    assert "pytest" in full.stdout and "ctest" in full.stdout  # the full suite stays the full suite
    quick = subprocess.run(["make", "-n", "-C", ROOT, "test-quick", f"VENV={venv}"], capture_output=True, text=True,
                           timeout=60)
    assert quick.returncode == 0, quick.stderr
    run = next(line for line in quick.stdout.splitlines() if "-m pytest" in line)
    files = [w for w in run.split() if w.startswith("tests/python/test_")]
    assert files and all(os.path.exists(os.path.join(ROOT, f)) for f in files)
    assert "ctest" not in quick.stdout
