"""10,000 random asynchronous reads and writes with injected faults: every byte verified,
every fault surfaced once, no file descriptor or memory growth. (The 100,000-op run is
`python examples/soak_io.py`; its figures are in RELIABILITY.md.)"""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def load_soak():
    spec = importlib.util.spec_from_file_location("soak_io", ROOT / "examples" / "soak_io.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["soak_io"] = mod  # dataclasses look the module up by name
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("backend", ["auto", "posix"])
def test_soak_10k(tmp_path, backend):
    soak = load_soak()
    ops = 10_000 if backend == "auto" else 3_000
    r = soak.soak(str(tmp_path), ops=ops, backend=backend, fault_every=250)
    assert r.ops == ops
    assert r.mismatches == 0, r.errors[:5]
    assert not r.errors, r.errors[:5]
    assert r.faults_injected == ops // 250
    assert r.failed_requests == r.faults_injected  # each fault surfaced, as exactly one failed request
    assert r.fd_after <= r.fd_before  # no descriptor leaked
    assert r.rss_after_mib - r.rss_warm_mib < 48, (r.rss_warm_mib, r.rss_after_mib)
    assert r.bytes_verified > 100 * 2**20
