"""`pyinfinity tune`: its JSON is an `aio` section the config loader accepts, and the pick rule."""
from __future__ import annotations

import json

import pytest

from pyinfinity.bench.tune import Candidate, pick, score
from pyinfinity.cli import main

AIO_KEYS = {"block_size", "queue_depth", "intra_op_parallelism", "backend"}


def load(cfg: dict):
    """pyinfinity.config's loader; checks the shape only where it is not importable."""
    try:
        from pyinfinity.config import load_config
    except ImportError:
        assert set(cfg) == {"aio"} or "aio" in cfg
        return None
    return load_config(cfg)


@pytest.fixture(scope="module")
def tuned(tmp_path_factory):
    d = tmp_path_factory.mktemp("tune")
    out = d / "aio.json"
    rc = main(["tune", str(d / "swap"), "--quick", "--reps", "1", "-o", str(out), "--no-progress"])
    return rc, out, d


def test_tune_writes_an_aio_section(tuned):
    rc, out, _ = tuned
    assert rc == 0
    cfg = json.loads(out.read_text())
    assert list(cfg) == ["aio"]
    aio = cfg["aio"]
    assert AIO_KEYS <= set(aio)
    assert aio["backend"] in ("aio", "uring", "posix")
    assert aio["block_size"] == 1 << 20 and aio["queue_depth"] in (8, 32)
    assert aio["intra_op_parallelism"] == 1


def test_tune_output_is_accepted_by_the_config_loader(tuned):
    _, out, _ = tuned
    cfg = json.loads(out.read_text())
    c = load(cfg)
    if c is not None:
        assert c.aio.block_size == cfg["aio"]["block_size"]
        assert c.aio.queue_depth == cfg["aio"]["queue_depth"]
        assert c.aio.backend == cfg["aio"]["backend"]
        assert c.aio.intra_op_parallelism == cfg["aio"]["intra_op_parallelism"]


def test_tune_merges_into_an_existing_config(tmp_path):
    base = {"train_micro_batch_size_per_gpu": 1,
            "zero_optimization": {"stage": 3},
            "aio": {"block_size": 4096, "queue_depth": 1, "single_submit": True}}
    p = tmp_path / "ds.json"
    p.write_text(json.dumps(base))
    assert main(["tune", str(tmp_path / "swap"), "--quick", "--reps", "1", "--backends", "posix",
                 "--queue-depths", "4", "--merge", str(p), "--no-progress"]) == 0
    cfg = json.loads(p.read_text())
    assert cfg["zero_optimization"] == {"stage": 3} and cfg["train_micro_batch_size_per_gpu"] == 1
    assert cfg["aio"]["backend"] == "posix" and cfg["aio"]["queue_depth"] == 4
    assert cfg["aio"]["block_size"] == 1 << 20 and cfg["aio"]["single_submit"] is False
    load(cfg)


def test_pick_prefers_cheapest_within_tie():
    def c(bs, qd, th, s):
        return Candidate("aio", bs, qd, th, s, s, s)

    best = c(1 << 20, 128, 2, 2.00)
    cheap = c(1 << 20, 32, 1, 1.97)   # within 3%: fewer threads and a smaller depth win
    slow = c(256 << 10, 8, 1, 1.50)
    assert pick([best, cheap, slow]) is cheap
    assert pick([best, slow]) is best
    with pytest.raises(RuntimeError):
        pick([])


def test_score_is_harmonic():
    assert score(2.0, 2.0, 0.5) == pytest.approx(2.0)
    assert score(1.0, 3.0, 0.5) == pytest.approx(1.5)
    assert score(0.0, 3.0, 0.5) == 0.0
