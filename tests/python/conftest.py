"""Shared fixtures. Tests that mount filesystems need root with CAP_SYS_ADMIN (as in CI)."""
from __future__ import annotations

import contextlib
import os
import subprocess
import tempfile

import pytest
import torch


def random_bytes(n: int, seed: int = 0) -> torch.Tensor:
    """n random bytes (never zeros-only), reproducible."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g)


@contextlib.contextmanager
def mounted(fstype: str, options: str):
    """Mounts a fresh filesystem of `fstype` on a temp dir; unmounts and removes it after."""
    if os.geteuid() != 0:
        pytest.skip("mounting needs root")
    d = tempfile.mkdtemp(prefix=f"pyinf-{fstype}-")
    rc = subprocess.run(["mount", "-t", fstype, "-o", options, fstype, d], capture_output=True, text=True)
    if rc.returncode != 0:
        os.rmdir(d)
        pytest.fail(f"mount -t {fstype} failed: {rc.stderr.strip()}")
    try:
        yield d
    finally:
        subprocess.run(["umount", "-l", d], check=False)
        os.rmdir(d)


@pytest.fixture
def tmpfs_dir():
    """A 64 MiB tmpfs (O_DIRECT only on Linux >= 6.6)."""
    with mounted("tmpfs", "size=64m") as d:
        yield d


@pytest.fixture
def nodirect_dir():
    """A ramfs: a filesystem without O_DIRECT on every kernel."""
    with mounted("ramfs", "mode=755") as d:
        yield d


@pytest.fixture
def tiny_tmpfs_dir():
    """A 1 MiB tmpfs, to make a real ENOSPC."""
    with mounted("tmpfs", "size=1m") as d:
        yield d


@pytest.fixture
def readonly_dir(tmp_path):
    """A read-only mount (root ignores permission bits, so chmod would not do)."""
    with mounted("tmpfs", "size=1m") as d:
        with open(os.path.join(d, "existing.bin"), "wb") as f:
            f.write(b"x" * 8192)
        subprocess.run(["mount", "-o", "remount,ro", d], check=True)
        yield d
