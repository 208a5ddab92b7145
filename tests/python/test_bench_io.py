"""`pyinfinity bench io`: the CLI smoke run (--quick), its JSON and plot, and the pieces that keep
its figures honest (verification, page-cache labels, peers that are missing)."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch

from pyinfinity.bench import GB
from pyinfinity.bench import io as bio
from pyinfinity.bench import peers
from pyinfinity.bench.pattern import PERIOD, fill_pattern
from pyinfinity.bench.records import SCHEMA, Result, best_peer, ratio_to_best_peer
from pyinfinity.bench.table import failed_lines
from pyinfinity.bench.workload import KiB, MiB, file_config, odd_sizes, parse_size, small_odd_config
from pyinfinity.cli import build_parser, main

RESULT_KEYS = {"workload", "op", "tool", "backend", "nbytes", "block_size", "queue_depth", "threads",
               "io_size", "n_ops", "seconds", "gbps", "gbps_median", "gbps_min", "gbps_max",
               "verified", "cache", "note"}


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory):
    """One `bench io --quick` run through the CLI, shared by the schema tests."""
    d = tmp_path_factory.mktemp("benchq")
    out = d / "out"
    out.mkdir()
    js, png = out / "r.json", out / "r.png"
    proc = subprocess.run(
        [sys.executable, "-m", "pyinfinity", "bench", "--quick", str(d / "data"),
         "--json", str(js), "--plot", str(png), "--no-progress", "--peers", "fio,dd"],
        capture_output=True, text=True, timeout=120, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    return proc, js, png, d / "data"


def test_quick_cli_exits_zero_and_prints_table(quick_run):
    proc, _, _, _ = quick_run
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "tool:backend" in proc.stdout and "GB/s" in proc.stdout
    assert "pyinfinity:" in proc.stdout
    assert "peers:" in proc.stdout


def test_quick_json_schema(quick_run):
    _, js, _, data_dir = quick_run
    d = json.loads(js.read_text())
    assert d["schema"] == SCHEMA
    for key in ("argv", "settings", "machine", "peers", "backends", "cache", "results", "seconds",
                "load_avg"):
        assert key in d
    assert d["machine"]["fs"]["fs_type"]
    assert d["machine"]["cores"] >= 1 and d["machine"]["ram_bytes"] > 0
    assert {p["name"] for p in d["peers"]} >= {"fio", "dd"}
    for p in d["peers"]:
        assert p["available"] or p["note"], p  # a missing peer always says why
    assert d["results"]
    measured = [r for r in d["results"] if r["seconds"]]
    assert measured
    for r in d["results"]:
        assert RESULT_KEYS <= set(r), set(r) ^ RESULT_KEYS
        assert r["cache"] in ("direct", "dropped", "cached", "memory")
        if r["seconds"]:
            assert len(r["seconds"]) == d["settings"]["reps"]
            assert all(s > 0 for s in r["seconds"])
            # GB/s is 1e9 bytes per second, per sample
            for s, g in zip(r["seconds"], r["gbps"]):
                assert g == pytest.approx(r["nbytes"] / s / GB)
            assert r["gbps_min"] <= r["gbps_median"] <= r["gbps_max"]
        else:
            assert r["note"], r  # nothing measured: the reason is recorded
    ours = [r for r in measured if r["tool"] == "pyinfinity"]
    assert {r["workload"] for r in ours} >= {"file", "small", "small-odd"}
    # every pyinfinity configuration was verified, and passed
    assert all(r["verified"] is True for r in ours)
    assert not os.path.exists(os.path.join(data_dir, bio.BENCH_FILE))  # cleaned up


def test_quick_plot_written(quick_run):
    _, _, png, _ = quick_run
    assert png.stat().st_size > 10_000
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bench_word_is_optional_and_train_has_its_own_options(capsys):
    p = build_parser()
    a = p.parse_args(["bench", "/x", "--quick"])
    assert a.dir == "/x" and a.quick and a.func.__name__ == "run_io"
    a = p.parse_args(["bench", "--quick", "io", "/y", "--reps", "2"])
    assert a.dir == "/y" and a.quick and a.reps == 2
    a = p.parse_args(["bench", "--quick"])
    assert a.dir is None and a.quick
    assert main(["bench", "train", "--systems", "nope"]) == 2  # options reach bench train's own parser
    assert "--systems: unknown nope" in capsys.readouterr().err


def test_pattern_is_random_nonzero_and_not_block_periodic():
    t = torch.empty(4 * MiB, dtype=torch.uint8)
    fill_pattern(t, 1)
    assert int((t == 0).sum()) == 0
    for shift in (512, 4096, 256 * KiB, 1 * MiB):
        assert not torch.equal(t[:1 * MiB], t[shift:shift + 1 * MiB])
    assert torch.equal(t[:4096], t[PERIOD:PERIOD + 4096])
    u = torch.empty(4096, dtype=torch.uint8)
    fill_pattern(u, 2)
    assert not torch.equal(u, t[:4096])


def test_verification_catches_a_corrupted_file(tmp_path):
    path = str(tmp_path / "f")
    bio.prepare_file(path, 2 * MiB)
    r = bio.PyinfinityRunner("posix", fsync_writes=False)
    try:
        cfg = file_config("write", 2 * MiB, 1 * MiB, 4, 1, 1 * MiB)
        assert r.run(cfg, path, verify=True).verified is True
        assert r.run(cfg.with_op("read"), path, verify=True).verified is True
        with open(path, "r+b") as f:
            f.seek(1 * MiB + 123)
            f.write(b"\x00\x01\x02")
            os.fsync(f.fileno())
        assert r.run(cfg.with_op("read"), path, verify=True).verified is False
    finally:
        r.close()


def test_odd_sizes_are_odd_and_packed():
    sizes = odd_sizes(64, 256 * KiB)
    assert all(s % 512 for s in sizes)
    cfg = small_odd_config("write", 64, 256 * KiB, 1 * MiB, 8, 1)
    offs = cfg.offsets()
    assert offs[0] == 0 and all(b - a == s for a, b, s in zip(offs, offs[1:], sizes))
    assert not cfg.aligned


def test_parse_size():
    assert parse_size("4096") == 4096
    assert parse_size("256K") == 256 * KiB
    assert parse_size("1MiB") == MiB
    assert parse_size("1G") == 1 << 30


def test_missing_fio_is_reported(monkeypatch, tmp_path):
    real_which = shutil.which
    monkeypatch.setattr(peers.shutil, "which", lambda n, *a, **k: None if n == "fio" else real_which(n))
    st = peers.fio_status()
    assert not st.available and "apt-get install fio" in st.note
    s = bio.IoBenchSettings(directory=str(tmp_path), file_size=2 * MiB, block_sizes=[1 * MiB],
                            queue_depths=[4], threads=[1], io_sizes=[2 * MiB], reps=1,
                            backends=["posix"], peers=["fio"], small_count=0, gpu=False,
                            aio_handle=False)
    run = bio.run_io_bench(s)
    fio = [p for p in run.peers if p.name == "fio"]
    assert fio and not fio[0].available
    assert not any(r.tool == "fio" for r in run.results)
    assert {r.op for r in run.results if r.tool == "pyinfinity"} == {"read", "write"}


@pytest.mark.skipif(shutil.which("fio") is None, reason="fio not installed")
def test_fio_and_dd_runners_move_and_verify(tmp_path):
    path = str(tmp_path / "f")
    bio.prepare_file(path, 4 * MiB)
    direct = bio.mach.probe_o_direct(str(tmp_path)).ok
    cfg = file_config("write", 4 * MiB, 1 * MiB, 1, 1, 4 * MiB)
    for runner in (peers.FioRunner("libaio", direct), peers.DdRunner(direct)):
        try:
            w = runner.run(cfg, path, verify=True)
            rd = runner.run(cfg.with_op("read"), path, verify=False)
        finally:
            runner.close()
        assert w.verified is True and w.nbytes == 4 * MiB and w.seconds > 0
        assert rd.nbytes == 4 * MiB and rd.seconds > 0
    assert peers.DdRunner(direct).supports(file_config("read", 4 * MiB, 1 * MiB, 8, 1, 4 * MiB))


def test_ratio_to_best_peer_uses_same_setting():
    def res(tool, backend, qd, secs):
        return Result("file", "read", tool, backend, nbytes=int(GB), block_size=MiB, queue_depth=qd,
                      io_size=int(GB), seconds=[secs])

    ours = res("pyinfinity", "aio", 8, 1.0)
    fio8, fio32, dd1 = res("fio", "libaio", 8, 0.5), res("fio", "libaio", 32, 0.25), res("dd", "O_DIRECT", 1, 0.1)
    rs = [ours, fio8, fio32, dd1]
    assert best_peer(rs, ours) is fio8
    assert ratio_to_best_peer(rs, ours) == pytest.approx(0.5)
    assert ratio_to_best_peer(rs, fio8) is None
    bad = res("deepspeed", "aio_handle", 8, 0.01)
    bad.verified = False  # a peer whose data was wrong is no reference
    assert best_peer(rs + [bad], ours) is fio8


def test_tmpfs_figures_are_labelled_memory(tmpfs_dir):
    s = bio.IoBenchSettings(directory=str(tmpfs_dir), file_size=4 * MiB, block_sizes=[1 * MiB],
                            queue_depths=[4], threads=[1], io_sizes=[4 * MiB], reps=1, peers=["dd"],
                            small_count=8, small_size=64 * KiB, gpu=False, aio_handle=False)
    run = bio.run_io_bench(s)
    assert run.cache == "memory"
    measured = [r for r in run.results if r.seconds]
    assert measured and all(r.cache == "memory" for r in measured)
    assert all(r.verified is not False for r in measured)


def test_without_o_direct_caches_are_dropped_and_writes_synced(monkeypatch, tmp_path):
    """Where O_DIRECT fails, root drops caches before reads and labels the figures 'dropped'."""
    if not bio.mach.can_drop_caches():
        pytest.skip("dropping caches needs root")
    monkeypatch.setattr(bio.mach, "probe_o_direct", lambda d: bio.mach.DirectProbe(False, "test"))
    drops = []
    real_drop = bio.mach.drop_page_cache
    monkeypatch.setattr(bio.mach, "drop_page_cache", lambda p=None: drops.append(p) or real_drop(p))
    s = bio.IoBenchSettings(directory=str(tmp_path), file_size=2 * MiB, block_sizes=[1 * MiB],
                            queue_depths=[1], threads=[1], io_sizes=[2 * MiB], reps=2,
                            backends=["posix"], peers=["dd"], small_count=0, gpu=False,
                            aio_handle=False)
    run = bio.run_io_bench(s)
    assert run.cache == "dropped"
    measured = [r for r in run.results if r.seconds]
    assert {r.label() for r in measured} == {"pyinfinity:posix", "dd:buffered"}
    assert all(r.cache == "dropped" for r in measured)
    reads = sum(len(r.seconds) for r in measured if r.op == "read")
    assert len(drops) == reads  # one drop before every timed read
    assert all(r.verified is not False for r in measured)


def test_read_only_directory_is_a_clear_error(readonly_dir, capsys):
    assert main(["bench", "--quick", readonly_dir, "--no-progress", "--peers", "none"]) == 2
    err = capsys.readouterr().err
    assert "cannot benchmark" in err and "pyinfinity report" in err and err.count("\n") == 1  # one line


def test_a_silent_deepspeed_worker_is_killed_not_waited_for():
    st = peers.DeepSpeedRunner(timeout=0.001).start()   # no interpreter starts in 1 ms
    assert not st.available and "no answer" in st.note


def test_a_failing_tool_is_a_result_and_its_read_is_skipped(tmp_path):
    class Broken:
        tool, backend = "fio", "broken"
        calls: list[str] = []

        def supports(self, cfg):
            return None

        def run(self, cfg, path, verify):
            Broken.calls.append(cfg.op)
            raise RuntimeError("disk on fire")

        def close(self):
            pass

    cfg = file_config("write", 1 * MiB, 1 * MiB, 1, 1, 1 * MiB)
    res = bio._measure(cfg, [Broken()], str(tmp_path / "f"), 3, "direct", False, lambda d: None)
    assert Broken.calls == ["write"]              # no read of unwritten bytes, no retry per rep
    assert all(not r.seconds and "disk on fire" in r.note for r in res if r.op == "write")


def test_a_refused_cache_drop_labels_the_read_cached(monkeypatch, tmp_path):
    monkeypatch.setattr(bio.mach, "drop_page_cache", lambda p=None: False)
    cfg = small_odd_config("write", 8, 64 * KiB, 1 * MiB, 4, 1)
    bio.prepare_file(str(tmp_path / "f"), cfg.nbytes)
    r = bio.PyinfinityRunner("posix", fsync_writes=False)
    try:
        res = bio._measure(cfg, [r], str(tmp_path / "f"), 1, "direct", True, lambda d: None)
    finally:
        r.close()
    assert {x.op: x.cache for x in res} == {"write": "direct", "read": "cached"}


def test_fio_runs_the_same_job_as_ours_after_an_untimed_warm_up():
    cfg = file_config("read", 64 * MiB, 1 * MiB, 1, 1, 64 * MiB)
    cmd = peers.FioRunner("libaio", direct=True, batch_reps=3)._cmd(cfg, "/d/bench.bin", verify=False, jobs=3)
    for flag in ("--filename=/d/bench.bin", "--direct=1", f"--bs={MiB}", "--iodepth=1", f"--size={64 * MiB}",
                 "--rw=read"):
        assert flag in cmd, (flag, cmd)
    names = [a for a in cmd if a.startswith("--name=")]
    assert names == ["--name=warmup", "--name=rep0", "--name=rep1", "--name=rep2"]
    data = {"jobs": [{"jobname": n[len("--name="):], "read": {"runtime": 100, "io_bytes": 64 * MiB}} for n in names]}
    assert [j["jobname"] for j in peers.FioRunner._timed_jobs(data)] == ["rep0", "rep1", "rep2"]


def test_a_peer_far_below_dd_on_the_same_file_is_flagged_not_divided_by():
    def res(tool, backend, qd, secs):
        return Result("file", "read", tool, backend, nbytes=int(GB), block_size=MiB, queue_depth=qd,
                      io_size=int(GB), seconds=[secs])

    ours, dd = res("pyinfinity", "aio", 1, 0.55), res("dd", "O_DIRECT", 1, 0.55)  # 1.8 GB/s each
    slow_fio = res("fio", "libaio", 1, 1.5)  # 0.67 GB/s: 0.37x dd, as fio misconfigured read
    rs = [ours, dd, slow_fio]
    assert peers.flag_suspect_peers(rs) and slow_fio.note.startswith("suspect")
    assert "0.8x dd" in slow_fio.note
    assert best_peer(rs, ours) is dd and ratio_to_best_peer(rs, ours) == pytest.approx(1.0)
    assert any("suspect peer" in line for line in failed_lines(rs))
    fair = res("fio", "libaio", 1, 0.6)
    assert peers.flag_suspect_peers([ours, dd, fair]) == [] and not fair.note
