"""`pyinfinity bench train`: the bound's arithmetic, the trace parsing, and the command end to end
on the CPU (tiny model; the GPU and DeepSpeed-at-scale rows are measured on the lent GPU box)."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from pyinfinity.bench import train as bt
from pyinfinity.bench.train_worker import STEP_LABEL, gpu_intervals, merge_intervals

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
RATES = {"matmul": 100e12, "h2d": 50e9, "d2h": 40e9, "disk_read": 2e9, "disk_write": 1e9, "adam": 4e9}
FACTS = {"params": 1_000_000_000, "param_bytes": 2_000_000_000, "itemsize": 2, "flops_per_step": 30e12}


def _cli(*args, env=None, timeout=300):
    return subprocess.run([sys.executable, "-m", "pyinfinity", "bench", "train", *args], capture_output=True,
                          text=True, cwd=REPO, timeout=timeout, env=env)


# ----------------------------------------------------------------------------------- the bound


def test_bound_terms_follow_the_tiers():
    b = bt.bound("pyinfinity-cpu", FACTS, RATES, cuda=True)
    assert b["terms"] == pytest.approx({"compute": 0.3, "pcie": max(4e9 / 50e9, 2e9 / 40e9), "cpu_adam": 0.25})
    assert b["bound_by"] == "compute" and b["seconds"] == pytest.approx(0.3)
    assert b["disk_bytes"] == {"read": 0, "write": 0}
    # optimizer on disk: 12 B/param read and written
    b = bt.bound("deepspeed-nvme", FACTS, RATES, cuda=True)
    assert b["disk_bytes"] == {"read": 12_000_000_000, "write": 12_000_000_000}
    # the disk serves reads and writes at once: the slower bounds the step; their sum is kept beside it
    assert b["terms"]["disk"] == pytest.approx(max(12e9 / 2e9, 12e9 / 1e9)) and b["bound_by"] == "disk"
    assert b["disk_serial_seconds"] == pytest.approx(12e9 / 2e9 + 12e9 / 1e9)
    # parameters on disk too: read twice, written once
    b = bt.bound("pyinfinity-nvme-all", FACTS, RATES, cuda=True)
    assert b["disk_bytes"] == {"read": 16_000_000_000, "write": 14_000_000_000}
    # plain torch: compute only; no PCIe term on the CPU
    assert bt.bound("torch", FACTS, RATES, cuda=True)["terms"] == pytest.approx({"compute": 0.3})
    assert "pcie" not in bt.bound("pyinfinity-cpu", FACTS, RATES, cuda=False)["terms"]


def test_auto_bound_reads_the_share_on_disk_from_the_placement():
    placement = {"params": {"cpu": 2_000_000_000, "device(resident)": 1}, "optimizer": {"cpu": 9, "nvme": 3}}
    b = bt.bound("pyinfinity-auto", FACTS, RATES, cuda=True, placement=placement)
    assert b["disk_share"] == {"params": 0.0, "optimizer": 0.25}
    assert b["disk_bytes"] == {"read": 3_000_000_000, "write": 3_000_000_000}
    # device copies of optimizer homes are not homes of their own; parameter homes on the GPU are
    placement = {"params": {"cpu": 2, "nvme": 1, "gpu": 1, "device(resident)": 4},
                 "optimizer": {"cpu": 9, "nvme": 3, "device": 6}}
    assert bt.tier_fractions("pyinfinity-auto", placement) == (0.25, 0.25)


def test_the_bound_counts_the_optimizer_state_a_run_steps_from_disk():
    """pyinfinity's units stepped on the GPU keep their state off the disk: the run's own bytes, not 12 B/param."""
    placement = {"params": {"cpu": 2_000_000_000}, "optimizer": {"nvme": 12_000_000_000, "device": 3_000_000_000},
                 "optimizer_disk_per_step": 9_000_000_000}
    b = bt.bound("pyinfinity-nvme", FACTS, RATES, cuda=True, placement=placement)
    assert b["disk_bytes"] == {"read": 9_000_000_000, "write": 9_000_000_000}
    assert b["terms"]["disk"] == pytest.approx(max(9e9 / 2e9, 9e9 / 1e9))
    # a run without the figure (DeepSpeed's, an older result file) keeps the tier's 12 B/param
    del placement["optimizer_disk_per_step"]
    assert bt.bound("pyinfinity-nvme", FACTS, RATES, cuda=True, placement=placement)["disk_bytes"]["read"] == 12e9


def test_timed_steps_hold_one_background_optimizer_pass_each(monkeypatch):
    """What the warm-up leaves in the background is finished before the first timed step; the last
    timed step finishes its own inside its time."""
    from pyinfinity.bench import train_worker as tw

    events: list[str] = []

    class FakeRun:
        engine = None
        params = 1
        extra: dict = {}

        def __init__(self, spec):
            self.n = 0

        def step(self, x, mark):
            self.n += 1
            events.append(f"step{self.n}")
            return 1.0

        def synchronize(self):
            events.append("sync")

        def close(self):
            pass

    monkeypatch.setattr(tw, "Run", FakeRun)
    spec = {"system": "pyinfinity-cpu", "size": "tiny", "device": "cpu", "steps": 4, "warmup": 2, "batch": 1,
            "seq": 4, "model": {"vocab_size": 16}}
    res = tw.run(spec)
    assert res["ok"], res
    assert events == ["step1", "step2", "sync", "step3", "step4", "sync"]
    events.clear()
    assert tw.run(dict(spec, warmup=0))["ok"]
    assert events == ["step1", "step2", "step3", "step4", "sync"]  # nothing to finish before the first


def test_a_missing_disk_rate_leaves_the_disk_term_out_of_the_max_not_zero():
    b = bt.bound("pyinfinity-nvme", FACTS, dict(RATES, disk_read=0.0), cuda=True)
    assert b["terms"]["disk"] != b["terms"]["disk"]  # nan, shown as such
    assert b["bound_by"] == "compute"


def test_rss_over_plan_counts_only_what_the_state_added():
    r = {"ok": True, "peak_rss": 30 << 30, "rss_before_build": 5 << 30, "plan_host_bytes": 20 << 30}
    assert bt.rss_over_plan(r) == pytest.approx(1.25)
    assert bt.rss_over_plan({**r, "plan_host_bytes": None}) is None  # a system without a plan
    assert bt.rss_over_plan({**r, "ok": False}) is None
    assert bt.rss_over_plan({k: v for k, v in r.items() if k != "rss_before_build"}) is None  # older results


def test_sizes_match_the_baseline_model():
    f = bt.model_fields("1.1b", 1024)
    facts = bt.size_facts(f, "bf16", 4, 1024, True)
    assert 1.0e9 < facts["params"] < 1.2e9 and facts["param_bytes"] == 2 * facts["params"]
    big = bt.size_facts(bt.model_fields("10b", 1024), "bf16", 4, 1024, True)
    assert 10e9 < big["params"] < 11e9
    with pytest.raises(bt.BenchTrainError, match="unknown size 'huge'"):
        bt.model_fields("huge", 1024)


# ----------------------------------------------------------------------------------- traces


def test_gpu_intervals_are_relative_to_the_step_annotation(tmp_path):
    ev = [{"ph": "X", "cat": "user_annotation", "name": STEP_LABEL, "ts": 1000.0, "dur": 9000},
          {"ph": "X", "cat": "kernel", "name": "gemm", "ts": 1500.0, "dur": 1000},
          {"ph": "X", "cat": "kernel", "name": "gemm", "ts": 2550.0, "dur": 100},  # merged: gap < 0.2 ms
          {"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy HtoD (Pinned -> Device)", "ts": 1000.0, "dur": 500},
          {"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy DtoH (Device -> Pinned)", "ts": 5000.0, "dur": 250},
          {"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy DtoD", "ts": 6000.0, "dur": 250},
          {"ph": "i", "cat": "kernel", "name": "instant", "ts": 7000.0}]
    path = tmp_path / "t.json"
    path.write_text(json.dumps({"traceEvents": ev}))
    lanes = gpu_intervals(str(path))
    assert lanes == {"compute": [[0.0005, 0.00165]], "h2d": [[0.0, 0.0005]], "d2h": [[0.004, 0.00425]]}
    path.write_text(json.dumps({"traceEvents": ev[1:]}))
    with pytest.raises(ValueError, match="no 'pyinfinity.bench.step' annotation"):
        gpu_intervals(str(path))


def test_this_torchs_profiler_writes_the_annotation_the_parser_needs(tmp_path):
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        with torch.profiler.record_function(STEP_LABEL):
            torch.randn(64, 64) @ torch.randn(64, 64)
    path = tmp_path / "trace.json"
    prof.export_chrome_trace(str(path))
    assert gpu_intervals(str(path)) == {"compute": [], "h2d": [], "d2h": []}


def test_merge_intervals():
    assert merge_intervals([(0.3, 0.4), (0.0, 0.1), (0.1001, 0.2)]) == [[0.0, 0.2], [0.3, 0.4]]


# ----------------------------------------------------------------------------------- the command


TINY = ["--sizes", "tiny", "--batch", "2", "--seq", "32", "--steps", "3", "--warmup", "1", "--no-progress"]


def test_bench_train_end_to_end_on_the_cpu(tmp_path):
    out = tmp_path / "bt.json"
    args = TINY + ["--systems", "pyinfinity-cpu,pyinfinity-nvme,torch", "--nvme", str(tmp_path / "swap"),
                   "--json", str(out), "--plot", str(tmp_path / "bt.png"), "--markdown", str(tmp_path / "bt.md"),
                   "--log-dir", str(tmp_path / "logs")]
    p = _cli(*args)
    assert p.returncode == 0, p.stdout + p.stderr
    d = json.loads(out.read_text())
    assert d["schema"] == bt.SCHEMA and len(d["invocations"]) == 1
    rates = d["invocations"][0]["rates"]
    assert rates["disk_read"] > 0 and rates["adam"] > 0 and rates["matmul"]["tiny"] > 0
    runs = {r["system"]: r for r in d["runs"]}
    assert set(runs) == {"pyinfinity-cpu", "pyinfinity-nvme", "torch"}
    for r in runs.values():
        assert r["ok"], r
        assert len(r["steps"]) == 3 and r["step_seconds"] > 0 and r["tokens_per_s"] == pytest.approx(64 / r["step_seconds"])
        assert r["bound"]["seconds"] > 0 and r["step_over_bound"] == pytest.approx(r["step_seconds"] / r["bound"]["seconds"])
        assert r["peak_rss"] > 0 and r["trace"]["phases"][0][0] == "forward"
        assert r["params_counted"] == r["params"]  # the engine's shards hold the whole model
        assert [p[0] for p in r["trace"]["phases"]] == ["forward", "backward", "step"]
    nv = runs["pyinfinity-nvme"]
    assert nv["bound"]["bound_by"] in ("disk", "compute", "cpu_adam") and "disk" in nv["bound"]["terms"]
    # the optimizer really went through the disk: the engine's counters and the kernel's agree it moved bytes
    assert nv["bytes_moved_per_step"].get("optimizer.nvme.read", 0) > 0
    assert nv["disk_read_per_step"] > 0 and nv["placement"]["optimizer"].get("nvme", 0) > 0
    # no state on the device here: every home on disk is read and written a step, and the bound says so
    assert nv["placement"]["optimizer_disk_per_step"] == nv["placement"]["optimizer"]["nvme"]
    assert nv["bound"]["disk_bytes"]["read"] == nv["placement"]["optimizer_disk_per_step"]
    assert runs["pyinfinity-cpu"]["disk_read_per_step"] == 0
    for s in ("pyinfinity-cpu", "pyinfinity-nvme"):  # the plan's host bytes against what the state took
        r = runs[s]
        assert r["rss_before_build"] > 0 and r["plan_host_bytes"] > 0 and r["peak_rss"] > r["rss_before_build"]
        assert f"tiny {s}: host memory" in p.stdout and "x the plan" in p.stdout
    assert "rss_before_build" in runs["torch"] and "plan_host_bytes" not in runs["torch"]
    assert (tmp_path / "bt.png").stat().st_size > 10_000
    md = (tmp_path / "bt.md").read_text()
    assert "| tiny |" in md and "pyinfinity-nvme" in md
    assert "tokens/s" in p.stdout and "largest trained by pyinfinity-cpu: tiny" in p.stdout
    assert os.listdir(tmp_path / "swap") == []  # each run's swap files removed
    assert sorted(os.listdir(tmp_path / "logs")) == ["tiny-pyinfinity-cpu.log", "tiny-pyinfinity-nvme.log",
                                                     "tiny-torch.log"]
    # a second invocation appends; --report-only redraws from the file
    p = _cli(*TINY, "--systems", "torch", "--no-trace", "--nvme", str(tmp_path / "swap"), "--json", str(out))
    assert p.returncode == 0, p.stdout + p.stderr
    d = json.loads(out.read_text())
    assert len(d["invocations"]) == 2 and len(d["runs"]) == 4 and d["runs"][-1]["invocation"] == 1
    assert "trace" not in d["runs"][-1]
    p = _cli("--report-only", "--json", str(out), "--plot", str(tmp_path / "again.png"))
    assert p.returncode == 0, p.stderr
    assert p.stdout.count("tiny ") >= 3 and (tmp_path / "again.png").stat().st_size > 10_000


def test_a_system_that_cannot_start_is_a_row_not_a_crash(tmp_path):
    shim = tmp_path / "shim" / "deepspeed"
    shim.mkdir(parents=True)
    (shim / "__init__.py").write_text("raise ImportError('simulated: deepspeed is broken here')\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path / "shim"), os.environ.get("PYTHONPATH", "")]))
    out = tmp_path / "bt.json"
    p = _cli(*TINY, "--systems", "deepspeed-cpu,pyinfinity-cpu", "--nvme", str(tmp_path / "swap"),
             "--json", str(out), "--no-trace", env=env)
    assert p.returncode == 0, p.stdout + p.stderr
    runs = {r["system"]: r for r in json.loads(out.read_text())["runs"]}
    assert not runs["deepspeed-cpu"]["ok"] and "simulated: deepspeed is broken here" in runs["deepspeed-cpu"]["error"]
    assert runs["pyinfinity-cpu"]["ok"]
    assert "FAILED: RuntimeError: deepspeed cannot be imported" in p.stdout
    assert "largest trained by deepspeed-cpu: none of the sizes run" in p.stdout


def test_a_run_past_its_timeout_is_killed_and_recorded(tmp_path):
    out = tmp_path / "bt.json"
    p = _cli(*TINY, "--systems", "torch", "--timeout", "0.5", "--nvme", str(tmp_path / "swap"), "--json", str(out))
    assert p.returncode == 0, p.stderr
    (r,) = json.loads(out.read_text())["runs"]
    assert not r["ok"] and r["error"] == "timed out after 0.5 s (--timeout)"
    assert r["wall_seconds"] < 30


@pytest.mark.parametrize("extra", [["--timeout", "0.5"], ["--sizes", "huge"]], ids=["a failed run", "a bad flag"])
def test_temporary_directories_are_removed_at_the_end(tmp_path, extra):
    """Without --nvme and --log-dir the swap and log directories are temporary: nothing is left
    in TMPDIR afterwards, whether the run failed or the flags were wrong."""
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    env = dict(os.environ, TMPDIR=str(tmp))
    env.pop("PYINFINITY_SWAP_DIR", None)
    p = _cli(*TINY, "--systems", "torch", "--no-trace", *extra, env=env)
    assert p.returncode in (0, 2), p.stderr
    assert os.listdir(tmp) == []


def test_a_swap_dir_too_small_skips_the_run_with_the_numbers(tiny_tmpfs_dir, tmp_path):
    out = tmp_path / "bt.json"
    p = _cli(*TINY, "--sizes", "125m", "--systems", "pyinfinity-nvme", "--nvme", tiny_tmpfs_dir, "--json", str(out))
    assert p.returncode == 0, p.stderr
    (r,) = json.loads(out.read_text())["runs"]
    assert not r["ok"] and r["error"].startswith("not run: its tiers need ") and "free at" in r["error"]


@pytest.mark.parametrize("args, msg", [
    (["--systems", "megatron"], "--systems: unknown megatron"),
    (["--sizes", "huge"], "unknown size 'huge'"),
    (["--steps", "2", "--warmup", "2"], "--steps 2 must exceed --warmup 2"),
    (["--ds", "buffer_cnt=4"], "--ds buffer_cnt: unknown setting"),
    (["--ds", "buffer_count"], "expected KEY=VALUE"),
    (["--report-only"], "--report-only needs --json"),
])
def test_bad_arguments_are_errors_that_say_which(args, msg, tmp_path):
    p = _cli(*TINY, "--nvme", str(tmp_path / "swap"), *args)
    assert p.returncode == 2 and msg in p.stderr, p.stderr


def test_a_foreign_json_file_is_not_overwritten(tmp_path):
    out = tmp_path / "other.json"
    out.write_text('{"results": []}')
    p = _cli(*TINY, "--systems", "torch", "--nvme", str(tmp_path / "swap"), "--json", str(out))
    assert p.returncode == 2 and "not a `pyinfinity bench train` results file" in p.stderr
    assert out.read_text() == '{"results": []}'
