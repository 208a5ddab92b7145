"""examples/ckpt_bench.py end to end on a CPU (a micro model), and the figures it gives for why a
case cannot meet a ratio: each way's per-step seconds, the write rate and the disk-bound floor."""
from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def load_bench():
    spec = importlib.util.spec_from_file_location("ckpt_bench", ROOT / "examples" / "ckpt_bench.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("save_s, every, step_s, floor", [(10.0, 2, 2.0, 2.5), (4.6, 5, 0.923, 1.0),
                                                          (11.4, 10, 2.611, 1.0), (0.0, 3, 1.0, 1.0)])
def test_the_disk_floor_is_the_save_time_over_the_steps_between_saves_and_never_below_one(save_s, every, step_s,
                                                                                          floor):
    assert load_bench().disk_floor(save_s, every, step_s) == pytest.approx(floor)


def test_ckpt_bench_runs_on_a_cpu_and_says_what_bounds_each_background_way(tmp_path):
    out = tmp_path / "bench.json"
    p = subprocess.run([sys.executable, str(ROOT / "examples" / "ckpt_bench.py"), "--model-size", "micro",
                        "--device", "cpu", "--steps", "4", "--save-every", "2", "--save-total-limit", "1",
                        "--seq", "32", "--batch", "1", "--ways", "no saves,background,blocking", "--dir",
                        str(tmp_path), "--out", str(out)], capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    rows = {r["way"]: r for r in json.loads(out.read_text())["rows"]}
    assert list(rows) == ["no saves", "background", "blocking"]
    base = rows["no saves"]
    for r in rows.values():
        assert len(r["step_seconds"]) == r["steps"] == 4 and all(s > 0 for s in r["step_seconds"])
        assert r["step_s"] == pytest.approx(sum(r["step_seconds"][2:]) / 2)  # the warm-up steps left out
    assert base["write_rate_bytes_s"] is None and base["disk_floor_ratio"] is None
    for way in ("background", "blocking"):
        r = rows[way]
        assert r["saves"] >= 1 and r["checkpoint_bytes"] > 0
        assert r["write_rate_bytes_s"] == pytest.approx(r["checkpoint_bytes"] / r["mean_save_total_s"])
    bg = rows["background"]
    assert bg["mean_rotate_s"] >= 0  # --save-total-limit 1: the previous checkpoint removed after each
    floor = max(1.0, (bg["mean_save_total_s"] + bg["mean_rotate_s"]) / (2 * base["step_s"]))
    assert bg["disk_floor_ratio"] == pytest.approx(floor)
    assert rows["blocking"]["disk_floor_ratio"] is None  # a blocking save's cost is its own, not the disk's floor
    table = p.stdout.splitlines()
    head = next(line for line in table if line.startswith("way"))
    assert "floor" in head.split() and "GB/s" in head.split()
    line = next(line for line in table if line.startswith("background"))
    cols = dict(zip(head.replace("max blocked s", "max_blocked_s").replace("step s", "step_s")
                    .replace("eff. s", "eff_s").replace("save s", "save_s").replace("rot. s", "rot_s")
                    .replace("written GB", "written_GB")
                    .replace("disk GB", "disk_GB").split(), line.split()))
    assert float(cols["floor"]) == pytest.approx(bg["disk_floor_ratio"], abs=1e-3)
    assert float(cols["GB/s"]) == pytest.approx(bg["write_rate_bytes_s"] / 1e9, abs=0.01)
    assert next(line for line in table if line.startswith("blocking")).split()[5] == "-"
