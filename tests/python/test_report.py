"""`pyinfinity report`: OK/WARN/FAIL decisions on real mounts (tmpfs, read-only), and the CLI."""
from __future__ import annotations

import json
import os

from pyinfinity.bench import machine as mach
from pyinfinity.bench.report import FAIL, OK, WARN, run_report, worst
from pyinfinity.cli import main

MiB, GiB = 1 << 20, 1 << 30


def by_name(checks):
    out = {c.name: c for c in checks}
    assert len(out) == len(checks), "check names must be unique"
    return out


def test_every_line_has_a_status_and_non_ok_has_a_fix(tmp_path):
    checks = run_report(str(tmp_path), need_bytes=1 * MiB)
    assert checks
    for c in checks:
        assert c.status in (OK, WARN, FAIL)
        if c.status != OK:
            assert c.fix, f"{c.name} is {c.status} without a fix"
    names = by_name(checks)
    for key in ("python", "torch", "pyinfinity", "extension pyinfinity._C", "GPUs", "host RAM",
                "locked memory (ulimit -l)", "swap path writable", "filesystem type", "free space",
                "deepspeed", "fio"):
        assert key in names, key
    assert names["swap path writable"].status == OK
    # at least one backend works on a writable local directory, and its probe left no file
    assert any(c.name.startswith("backend ") and c.name.endswith(" on path") and c.status == OK
               for c in checks)
    assert os.listdir(tmp_path) == []


def test_tmpfs_warns_ram_filesystem_and_fails_on_space(tmpfs_dir):
    checks = by_name(run_report(tmpfs_dir, need_bytes=1 * GiB))
    assert checks["filesystem type"].status == WARN
    assert "tmpfs" in checks["filesystem type"].detail
    assert "NVMe" in checks["filesystem type"].fix
    assert checks["free space"].status == FAIL           # 64 MiB < 1 GiB
    assert checks["swap path writable"].status == OK
    # the posix backend works on tmpfs whatever the kernel's O_DIRECT support there
    assert checks["backend posix on path"].status == OK


def test_tmpfs_with_room_is_ok_on_space(tmpfs_dir):
    checks = by_name(run_report(tmpfs_dir, need_bytes=8 * MiB))
    assert checks["free space"].status == OK
    assert worst(list(checks.values())) in (WARN, FAIL)  # still a RAM filesystem


def test_read_only_path_fails_with_a_fix(readonly_dir):
    checks = by_name(run_report(readonly_dir, need_bytes=1))
    w = checks["swap path writable"]
    assert w.status == FAIL and "read-only" in w.detail and "remount" in w.fix
    assert checks["I/O backends on path"].status == FAIL
    assert not any(name.startswith("backend ") and name.endswith(" on path") for name in checks)


def test_missing_subdir_is_created_then_removed(tmp_path):
    target = tmp_path / "a" / "b"
    checks = by_name(run_report(str(target), need_bytes=1))
    assert checks["swap path writable"].status == OK
    assert not target.exists()


def test_cli_exit_status_and_json(readonly_dir, tmp_path, capsys):
    js = tmp_path / "r.json"
    assert main(["report", "--path", readonly_dir, "--need", "1M", "--json", str(js)]) == 1
    out = capsys.readouterr().out
    assert "[FAIL]" in out and "fix:" in out and "overall: FAIL" in out
    d = json.loads(js.read_text())
    assert d["overall"] == FAIL and any(c["status"] == FAIL for c in d["checks"])
    assert main(["report", "--path", str(tmp_path), "--need", "1M"]) in (0, 1)
    out = capsys.readouterr().out
    assert "swap path writable" in out


def test_fs_info_sees_the_mount(tmpfs_dir, readonly_dir):
    t = mach.fs_info(tmpfs_dir)
    assert t.fs_type == "tmpfs" and t.mount_point == os.path.realpath(tmpfs_dir) and not t.read_only
    assert 0 < t.free_bytes <= 64 * MiB
    assert mach.fs_info(os.path.join(tmpfs_dir, "not", "yet")).mount_point == t.mount_point
    r = mach.fs_info(readonly_dir)
    assert r.read_only


def _ds_config(tmp_path, p1, p2):
    cfg = {"train_micro_batch_size_per_gpu": 1,
           "zero_optimization": {"stage": 3,
                                 "offload_param": {"device": "nvme", "nvme_path": str(p1)},
                                 "offload_optimizer": {"device": "nvme", "nvme_path": str(p2)}}}
    f = tmp_path / "ds.json"
    f.write_text(json.dumps(cfg))
    return str(f)


def test_cli_checks_every_nvme_path_of_a_config(tmp_path, capsys):
    a, b = tmp_path / "a", tmp_path / "b"
    main(["report", "--config", _ds_config(tmp_path, a, b), "--need", "1M"])
    out = capsys.readouterr().out
    assert f"swap path writable [{b}]" in out
    assert f"{a}" in out


def test_cli_config_with_read_only_nvme_path_fails(tmp_path, readonly_dir, capsys):
    rc = main(["report", "--config", _ds_config(tmp_path, tmp_path / "a", readonly_dir), "--need", "1M"])
    assert rc == 1
    assert "FAIL" in capsys.readouterr().out
