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
    spec = {"system": "pyinfinity-cpu", "size": "micro", "device": "cpu", "steps": 4, "warmup": 2, "batch": 1,
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


TINY = ["--sizes", "micro", "--batch", "2", "--seq", "32", "--steps", "3", "--warmup", "1", "--no-progress"]


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
    assert rates["disk_read"] > 0 and rates["adam"] > 0 and rates["matmul"]["micro"] > 0
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
        assert f"micro {s}: host memory" in p.stdout and "x the plan" in p.stdout
        # the engine's own prediction at the run's shape, beside what was measured
        assert r["plan_predicted"]["seconds"] > 0 and r["plan_predicted"]["bottleneck"]
        assert f"micro {s}: the engine's plan predicted" in p.stdout and "predicted/measured" in p.stdout
    assert "rss_before_build" in runs["torch"] and "plan_host_bytes" not in runs["torch"]
    assert (tmp_path / "bt.png").stat().st_size > 10_000
    md = (tmp_path / "bt.md").read_text()
    assert "| micro |" in md and "pyinfinity-nvme" in md
    assert "tokens/s" in p.stdout and "largest trained by pyinfinity-cpu: micro" in p.stdout
    assert os.listdir(tmp_path / "swap") == []  # each run's swap files removed
    assert sorted(os.listdir(tmp_path / "logs")) == ["micro-pyinfinity-cpu.log", "micro-pyinfinity-nvme.log",
                                                     "micro-torch.log"]
    # a second invocation appends; --report-only redraws from the file
    p = _cli(*TINY, "--systems", "torch", "--no-trace", "--nvme", str(tmp_path / "swap"), "--json", str(out))
    assert p.returncode == 0, p.stdout + p.stderr
    d = json.loads(out.read_text())
    assert len(d["invocations"]) == 2 and len(d["runs"]) == 4 and d["runs"][-1]["invocation"] == 1
    assert "trace" not in d["runs"][-1]
    p = _cli("--report-only", "--json", str(out), "--plot", str(tmp_path / "again.png"))
    assert p.returncode == 0, p.stderr
    assert p.stdout.count("micro ") >= 3 and (tmp_path / "again.png").stat().st_size > 10_000


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
    (["--grad-accum", "0"], "--grad-accum: 0 is below 1"),
    (["--systems", "torch,pyinfinity-auto[resident_bytes=0"], "unclosed bracket"),
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


# ----------------------------------------------------------------------------------- systems and variants


def test_systems_parse_variants_with_brackets_inside_the_comma_list():
    labels = bt.parse_systems("torch-nocap, pyinfinity-auto[resident_bytes=0,prefetch=false],"
                              "deepspeed-z2-cpu[bf16.bf16_optimizer_states=true,aio.block_size=[1,2]],deepspeed-cpu")
    assert labels == ["torch-nocap", "pyinfinity-auto[resident_bytes=0,prefetch=false]",
                      "deepspeed-z2-cpu[bf16.bf16_optimizer_states=true,aio.block_size=[1,2]]", "deepspeed-cpu"]
    s = bt.parse_system(labels[2])
    assert s.base == "deepspeed-z2-cpu"
    assert s.variant == (("bf16.bf16_optimizer_states", True), ("aio.block_size", [1, 2]))
    assert bt.parse_system("pyinfinity-auto[optimizer_state=8bit]").variant == (("optimizer_state", "8bit"),)
    assert bt.parse_system('pyinfinity-auto[x="a,b"]').variant == (("x", "a,b"),)
    assert bt.base_system(labels[1]) == "pyinfinity-auto"


@pytest.mark.parametrize("text, msg", [
    ("pyinfinity-auto[resident_bytes=0", "unclosed bracket"),
    ("pyinfinity-auto]", "unbalanced"),
    ("pyinfinity-auto[resident_bytes]", "is not KEY=VALUE"),
    ("pyinfinity-auto[a..b=1]", "is not KEY=VALUE"),
    ("pyinfinity-auto[]", "empty variant"),
    ("pyinfinity-auto[a=1,a=2]", "a is set twice"),
    ("torch[lr=1]", "torch has no config for a variant"),
    ("deepspeed-z9[a=1]", "unknown deepspeed-z9"),
    ("pyinfinity-cpu,pyinfinity-cpu", "pyinfinity-cpu is given twice"),
])
def test_malformed_systems_are_errors_that_say_which(text, msg):
    with pytest.raises(bt.BenchTrainError, match=msg.replace("[", r"\[")):
        bt.parse_systems(text)


def _spec(system, variant=None, **kw):
    return dict({"system": system, "variant": variant or {}, "batch": 2, "seq": 8, "lr": 1e-4, "dtype": "bf16",
                 "device": "cuda:0", "nvme_dir": "/swap", "cap_bytes": 8 << 30, "grad_accum": 1,
                 "deepspeed": json.loads(json.dumps(bt.DEEPSPEED_DEFAULTS))}, **kw)


def test_the_new_deepspeed_systems_keep_the_parameters_on_the_gpu_with_zero_offloads_settings():
    from pyinfinity.bench.train_worker import ZERO_OFFLOAD, deepspeed_config

    z2 = deepspeed_config(_spec("deepspeed-z2-cpu", grad_accum=4))
    zero = z2["zero_optimization"]
    assert zero["stage"] == 2 and zero["offload_optimizer"]["device"] == "cpu" and "offload_param" not in zero
    assert {k: zero[k] for k in ZERO_OFFLOAD} == ZERO_OFFLOAD
    assert zero["overlap_comm"] is True and zero["contiguous_gradients"] is True
    assert z2["gradient_accumulation_steps"] == 4 and z2["bf16"] == {"enabled": True}
    z3 = deepspeed_config(_spec("deepspeed-z3-gpu-params"))["zero_optimization"]
    assert z3["stage"] == 3 and z3["offload_param"]["device"] == "none" and z3["offload_optimizer"]["device"] == "cpu"
    assert z3["overlap_comm"] is True and z3["contiguous_gradients"] is True
    # the ZeRO-3 offload of every parameter is unchanged
    assert deepspeed_config(_spec("deepspeed-cpu"))["zero_optimization"]["offload_param"]["device"] == "cpu"


def test_a_variant_sets_its_keys_in_that_systems_config():
    from pyinfinity.bench.train_worker import deepspeed_config, pyinfinity_config

    ds = deepspeed_config(_spec("deepspeed-z2-cpu", {"bf16.bf16_optimizer_states": True,
                                                     "zero_optimization.reduce_bucket_size": 2e8}))
    assert ds["bf16"] == {"enabled": True, "bf16_optimizer_states": True}
    assert ds["zero_optimization"]["reduce_bucket_size"] == 2e8
    # pyinfinity: a key outside the top-level sections is one of the "pyinfinity" section
    pc = pyinfinity_config(_spec("pyinfinity-auto", {"resident_bytes": 0, "zero_optimization.offload_optimizer.device":
                                                     "nvme", "gradient_clipping": 1.0}))
    assert pc["pyinfinity"]["resident_bytes"] == 0 and pc["gradient_clipping"] == 1.0
    assert pc["zero_optimization"]["offload_optimizer"]["device"] == "nvme"
    with pytest.raises(ValueError, match="bf16.enabled.x: bf16.enabled is True in the config, not a section"):
        deepspeed_config(_spec("deepspeed-z2-cpu", {"bf16.enabled.x": 1}))


def test_a_pyinfinity_variant_key_the_config_rejects_stops_the_bench_before_it_runs(tmp_path):
    p = _cli(*TINY, "--systems", "torch,pyinfinity-auto[optimizer_stat=8bit]", "--nvme", str(tmp_path / "swap"),
             "--json", str(tmp_path / "bt.json"))
    assert p.returncode == 2, p.stdout + p.stderr
    assert "--systems pyinfinity-auto[optimizer_stat=8bit]: unknown config key 'pyinfinity.optimizer_stat'" in p.stderr
    assert not (tmp_path / "bt.json").exists()


BF16_KEYS = {"bf16.bf16_optimizer_states": True, "bf16.bf16_master_weights_and_grads": True}


def test_the_disk_term_charges_the_run_s_optimizer_state_format():
    """12 B/param only for the exact state: pyinfinity's 8bit and bf16 formats, DeepSpeed's bf16 master and
    states, each at its own bytes (the bound's disk term; the disk-space check before a run charges the same)."""
    state = bt.optimizer_state_bytes
    assert state(_spec("pyinfinity-nvme")) == 12
    assert state(_spec("pyinfinity-nvme", {"optimizer_state": "8bit"})) == pytest.approx(6 + 8 / 256)
    assert state(_spec("pyinfinity-auto", BF16_KEYS)) == 6  # a bf16 master beside the bf16 moments
    assert state(_spec("deepspeed-nvme")) == 12
    assert state(_spec("deepspeed-nvme", BF16_KEYS)) == 6
    assert state(_spec("deepspeed-nvme", {"bf16.bf16_master_weights_and_grads": True})) == 10
    b = bt.bound("pyinfinity-nvme", FACTS, RATES, cuda=True, state_bytes=state(_spec("pyinfinity-nvme",
                                                                                    {"optimizer_state": "8bit"})))
    assert b["disk_bytes"] == {"read": 6_031_250_000, "write": 6_031_250_000}
    assert b["terms"]["disk"] == pytest.approx(6.03125e9 / 1e9)
    # a run's own figure (pyinfinity's placement: the exact homes, small fp32 shards included) still wins
    placement = {"params": {"cpu": 1}, "optimizer": {"nvme": 1}, "optimizer_disk_per_step": 7_000_000_000}
    assert bt.bound("pyinfinity-nvme", FACTS, RATES, True, placement, 6.0)["disk_bytes"]["read"] == 7e9


def test_the_cpu_adam_term_takes_the_rate_of_the_run_s_state_format():
    """The 8-bit kernel steps faster than the fp32 one (fewer bytes a parameter): an 8bit run bounded by
    the fp32 rate ran below its bound on the H200 box. Each format's term takes its own probe's rate."""
    def fmt(spec):
        return bt.optimizer_state(spec)[0]

    assert fmt(_spec("pyinfinity-auto")) == "fp32"
    assert fmt(_spec("pyinfinity-auto", {"optimizer_state": "8bit"})) == "8bit"
    assert fmt(_spec("pyinfinity-auto", BF16_KEYS)) == "bf16"
    assert fmt(_spec("deepspeed-cpu", BF16_KEYS)) == "bf16" and fmt(_spec("deepspeed-cpu")) == "fp32"
    rates = {**RATES, "adam_8bit": 8e9}
    assert bt.bound("pyinfinity-cpu", FACTS, rates, cuda=True)["terms"]["cpu_adam"] == pytest.approx(0.25)
    assert bt.bound("pyinfinity-cpu", FACTS, rates, cuda=True, state_format="8bit")["terms"]["cpu_adam"] == \
        pytest.approx(0.125)


def test_compressed_optimizer_state_systems_run_on_the_cpu(tmp_path):
    """The two compressed formats as `bench train` variants, on the CPU: the bf16 master makes --dtype auto
    bf16 (it needs bf16 compute), each run's config and record carry its format and bytes."""
    eight, bf16 = "pyinfinity-auto[optimizer_state=8bit]", \
        "pyinfinity-auto[bf16.bf16_optimizer_states=true,bf16.bf16_master_weights_and_grads=true]"
    out = tmp_path / "bt.json"
    p = _cli(*TINY, "--device", "cpu", "--no-trace", "--systems", f"{eight},{bf16}", "--nvme", str(tmp_path / "swap"),
             "--json", str(out), "--log-dir", str(tmp_path / "logs"))
    assert p.returncode == 0, p.stdout + p.stderr
    runs = {r["system"]: r for r in json.loads(out.read_text())["runs"]}
    assert list(runs) == [eight, bf16]
    for r in runs.values():
        assert r["ok"], r
        assert r["dtype"] == "bf16" and r["steps"] and r["tokens_per_s"] > 0
    assert runs[eight]["config"]["pyinfinity"]["optimizer_state"] == "8bit"
    assert runs[eight]["optimizer_state_bytes"] == pytest.approx(6 + 8 / 256)
    assert runs[bf16]["config"]["bf16"] == {"enabled": True, **{k.split(".")[1]: True for k in BF16_KEYS}}
    assert runs[bf16]["optimizer_state_bytes"] == 6
    # with --dtype fp32 the bf16 master is refused before anything runs, saying what to give
    p = _cli(*TINY, "--device", "cpu", "--dtype", "fp32", "--systems", bf16, "--nvme", str(tmp_path / "swap"))
    assert p.returncode == 2 and "requires bf16.enabled" in p.stderr and "--dtype bf16" in p.stderr


def test_parameters_on_the_gpu_cross_pcie_once():
    b = bt.bound("deepspeed-z2-cpu[bf16.enabled=true]", FACTS, RATES, cuda=True)
    assert b["terms"]["pcie"] == pytest.approx(max(2e9 / 50e9, 2e9 / 40e9))
    assert b["terms"]["cpu_adam"] == pytest.approx(0.25) and "disk" not in b["terms"]
    assert not bt.uses_disk("deepspeed-z3-gpu-params") and bt.uses_disk("pyinfinity-auto[resident_bytes=0]")


def test_the_best_disk_rates_of_several_probes():
    assert bt.best_disk_rates({"disk_read": 1.16e9, "disk_write": 3e9}, {"disk_read": 2.44e9, "disk_write": 2e9}) == \
        {"disk_read": 2.44e9, "disk_write": 3e9}
    assert bt.best_disk_rates({"disk_read": 0.0, "disk_write": 0.0, "disk_error": "x"}) == \
        {"disk_read": 0.0, "disk_write": 0.0}


# ----------------------------------------------------------------------------------- the invocation, faked


def _fake_bench(monkeypatch, tmp_path, systems, seconds, probes, grad_accum=1):
    """run_bench with its rates and workers faked: ``seconds[label]`` is each run's step time (None: it fails)."""
    calls: list[str] = []
    # the compressed formats' CPU Adam rates given too (a run of one is otherwise probed once, for real)
    monkeypatch.setattr(bt, "measure_bound_rates", lambda device, d: dict(RATES, disk_read=1e9, disk_write=1e9,
                                                                          adam_8bit=6e9, adam_bf16=5e9))
    monkeypatch.setattr(bt, "measure_matmul_rate", lambda *a: RATES["matmul"])
    it = iter(probes)

    def probe(d):
        calls.append("probe")
        return next(it)

    def run_one(spec, timeout, log_path, on_line=None):
        calls.append(spec["label"])
        t = seconds[spec["label"]]
        if t is None:
            return {"system": spec["system"], "size": spec["size"], "ok": False, "error": "simulated failure"}
        steps = [{"seconds": t, "loss": 1.0, "disk_read": 0, "disk_write": 0}] * spec["steps"]
        return {"system": spec["system"], "size": spec["size"], "ok": True, "steps": steps, "params": 1}

    monkeypatch.setattr(bt, "probe_disk", probe)
    monkeypatch.setattr(bt, "run_one", run_one)
    s = bt.Settings(sizes=["micro"], systems=systems, nvme_dir=str(tmp_path / "swap"), device="cpu", steps=3,
                    warmup=1, batch=2, seq=32, grad_accum=grad_accum, trace=False, progress=False,
                    log_dir=str(tmp_path / "logs"))
    data = bt.run_bench(s, str(tmp_path / "bt.json"))
    return data, calls


def test_vs_the_best_deepspeed_of_the_invocation_and_flagged_runs_left_out(monkeypatch, tmp_path):
    systems = ["pyinfinity-auto", "pyinfinity-auto[resident_bytes=0]", "deepspeed-cpu", "deepspeed-z2-cpu",
               "deepspeed-z2-cpu[bf16.bf16_optimizer_states=true]", "deepspeed-z3-gpu-params", "torch"]
    # the micro model's compute bound is microseconds; deepspeed-z2-cpu[...] runs "below" a bound faked high
    seconds = {"pyinfinity-auto": 0.5, "pyinfinity-auto[resident_bytes=0]": 0.8, "deepspeed-cpu": 2.0,
               "deepspeed-z2-cpu": 1.0, "deepspeed-z2-cpu[bf16.bf16_optimizer_states=true]": 0.1,
               "deepspeed-z3-gpu-params": None, "torch": 0.2}
    real_bound = bt.bound

    def bound(system, facts, rates, cuda, placement=None, state_bytes=12.0, state_format="fp32"):
        b = real_bound(system, facts, rates, cuda, placement, state_bytes, state_format)
        if system.endswith("[bf16.bf16_optimizer_states=true]"):
            b["seconds"] = 0.3
        return b

    monkeypatch.setattr(bt, "bound", bound)
    probes = [{"disk_read": 1.2e9, "disk_write": 3e9}, {"disk_read": 2.4e9, "disk_write": 2e9},
              {"disk_read": 1.0e9, "disk_write": 1e9}, {"disk_read": 1.0e9, "disk_write": 1e9}]
    data, calls = _fake_bench(monkeypatch, tmp_path, systems, seconds, probes)
    # the disk is probed right before and right after each run that may use it (the pyinfinity ones here)
    assert calls[:4] == ["probe", "pyinfinity-auto", "probe", "probe"]
    runs = {r["system"]: r for r in json.loads((tmp_path / "bt.json").read_text())["runs"]}
    assert runs["pyinfinity-auto"]["bound"]["rates"] == {"disk_read": 2.4e9, "disk_write": 3e9}
    assert runs["pyinfinity-auto"]["disk_probes"] == probes[:2]
    assert "disk_probes" not in runs["deepspeed-cpu"]
    flagged = runs["deepspeed-z2-cpu[bf16.bf16_optimizer_states=true]"]
    assert flagged["below_bound"] and flagged["base_system"] == "deepspeed-z2-cpu"
    assert flagged["variant"] == {"bf16.bf16_optimizer_states": True}
    # the fastest usable DeepSpeed of the run is deepspeed-z2-cpu (the faster variant is below its bound)
    assert runs["pyinfinity-auto"]["vs_best_deepspeed"] == {"ratio": pytest.approx(2.0), "peer": "deepspeed-z2-cpu",
                                                            "peer_tokens_per_s": pytest.approx(64 / 1.0)}
    assert runs["pyinfinity-auto[resident_bytes=0]"]["vs_best_deepspeed"]["ratio"] == pytest.approx(1.25)
    assert "vs_best_deepspeed" not in runs["deepspeed-cpu"]
    text = bt.report(data)
    assert "micro: pyinfinity-auto / the best DeepSpeed configuration of the same run (deepspeed-z2-cpu) = 2.00x" in text
    assert "BELOW BOUND: bound wrong, figure not used" in text
    assert "deepspeed-z2-cpu[bf16.bf16_optimizer_states=true]: ran 0.100 s/step, below its bound" in text
    over = next(line for line in text.splitlines() if "step time over plain torch" in line)
    assert "bf16_optimizer_states" not in over and "pyinfinity-auto 2.50x" in over
    row = next(line for line in text.splitlines() if line.startswith("micro") and " pyinfinity-auto " in line)
    assert "2.00x deepspeed-z2-cpu" in row
    # the table's rows: every label, the variants after their system
    labels = [r["system"] for r in bt.latest_runs(data)]
    assert labels.index("pyinfinity-auto[resident_bytes=0]") == labels.index("pyinfinity-auto") + 1
    # a later invocation's DeepSpeed run is not this one's peer
    data2, _ = _fake_bench(monkeypatch, tmp_path, ["deepspeed-cpu"], {"deepspeed-cpu": 0.01}, [])
    assert len(data2["invocations"]) == 2
    pa = next(r for r in data2["runs"] if r["system"] == "pyinfinity-auto")
    bt.report(data2)
    assert pa["vs_best_deepspeed"]["peer"] == "deepspeed-z2-cpu"


def test_tokens_per_step_count_every_micro_batch(monkeypatch, tmp_path):
    data, _ = _fake_bench(monkeypatch, tmp_path, ["torch", "pyinfinity-cpu"], {"torch": 0.5, "pyinfinity-cpu": 1.0},
                          [], grad_accum=4)
    for r in data["runs"]:
        assert r["grad_accum"] == 4 and r["tokens_per_step"] == 4 * 2 * 32
        assert r["tokens_per_s"] == pytest.approx(4 * 64 / r["step_seconds"])
    one = bt.size_facts(bt.model_fields("micro", 32), "fp32", 2, 32, True)["flops_per_step"]
    assert data["runs"][0]["flops_per_step"] == pytest.approx(4 * one)
    assert "per optimizer step (micro-batches a step in these runs: 4)" in bt.report(data)


def test_torch_accumulates_over_micro_batches_as_one_big_batch():
    """batch 2 in one step and 2 micro-batches of 1 see the same tokens (one generator) and train alike."""
    from pyinfinity.bench import train_worker as tw

    spec = {"system": "torch", "size": "micro", "device": "cpu", "dtype": "fp32", "steps": 3, "warmup": 1,
            "seq": 16, "model": dict(bt.model_fields("micro", 16)), "checkpointing": False, "lr": 1e-3, "seed": 0}
    whole = tw.run(dict(spec, batch=2, grad_accum=1))
    micro = tw.run(dict(spec, batch=1, grad_accum=2))
    assert whole["ok"] and micro["ok"], (whole, micro)
    assert [s["loss"] for s in micro["steps"]] == pytest.approx([s["loss"] for s in whole["steps"]], rel=1e-5)
    assert whole["steps"][0]["loss"] != whole["steps"][2]["loss"]  # it trained


def test_deepspeed_systems_and_variants_end_to_end_on_the_cpu(tmp_path):
    """The new DeepSpeed systems train on the CPU (torch's AdamW: no cpu_adam build; small buckets:
    DeepSpeed's 5e8-element ones take minutes to allocate on a CPU), a key DeepSpeed rejects is that
    run's row naming the key, and --grad-accum counts every micro-batch in every system."""
    pytest.importorskip("deepspeed")
    small = "zero_force_ds_cpu_optimizer=false,zero_optimization.reduce_bucket_size=1e6"
    z2 = f"deepspeed-z2-cpu[{small},zero_optimization.allgather_bucket_size=1e6]"
    z3 = f"deepspeed-z3-gpu-params[{small}]"
    bad = "deepspeed-z2-cpu[zero_optimization.overlap_comms=true]"
    out = tmp_path / "bt.json"
    p = _cli(*TINY, "--grad-accum", "2", "--no-trace", "--systems", f"pyinfinity-cpu,{z2},{z3},{bad}",
             "--nvme", str(tmp_path / "swap"), "--json", str(out), "--log-dir", str(tmp_path / "logs"), timeout=600)
    assert p.returncode == 0, p.stdout + p.stderr
    runs = {r["system"]: r for r in json.loads(out.read_text())["runs"]}
    assert list(runs) == ["pyinfinity-cpu", z2, z3, bad]
    for label in ("pyinfinity-cpu", z2, z3):
        r = runs[label]
        assert r["ok"], r
        assert r["grad_accum"] == 2 and r["config"]["gradient_accumulation_steps"] == 2
        assert r["tokens_per_s"] == pytest.approx(2 * 64 / r["step_seconds"])
    assert runs[z2]["config"]["zero_optimization"]["stage"] == 2
    assert runs[z2]["config"]["zero_optimization"]["reduce_bucket_size"] == 1e6
    assert runs[z3]["config"]["zero_optimization"]["offload_param"]["device"] == "none"
    assert not runs[bad]["ok"]
    assert runs[bad]["error"] == ("ValidationError: DeepSpeedZeroConfig.overlap_comms: Extra inputs are not permitted")
    assert bad in p.stdout and "DeepSpeedZeroConfig.overlap_comms" in p.stdout
    # vs the best DeepSpeed: the faster usable one of the two that trained (a loaded CPU may flag a run)
    usable = [runs[x] for x in (z2, z3) if not runs[x]["below_bound"]]
    vs = runs["pyinfinity-cpu"].get("vs_best_deepspeed")
    if runs["pyinfinity-cpu"]["below_bound"] or not usable:
        assert vs is None
    else:
        best = max(usable, key=lambda r: r["tokens_per_s"])
        assert vs["peer"] == best["system"]
        assert vs["ratio"] == pytest.approx(runs["pyinfinity-cpu"]["tokens_per_s"] / best["tokens_per_s"])
    assert sorted(os.listdir(tmp_path / "logs")) == sorted(
        f"micro-{bt._file_name(x)}.log" for x in runs)


# ----------------------------------------------------------------------------------- LoRA


def test_the_cpu_adam_bound_leaves_out_what_a_run_steps_on_the_gpu():
    """A pyinfinity run whose resident units keep their optimizer state on the GPU steps them there:
    the CPU Adam term counts the rest (the run's placement says how many parameters that is)."""
    on_gpu = FACTS["params"] // 5
    b = bt.bound("pyinfinity-auto", FACTS, RATES, cuda=True,
                 placement={"params": {"cpu": FACTS["param_bytes"]}, "optimizer": {"cpu": 12 * FACTS["params"]},
                            "optimizer_device_numel": on_gpu})
    assert b["terms"]["cpu_adam"] == pytest.approx((FACTS["params"] - on_gpu) / RATES["adam"], abs=1e-5)
    assert bt.bound("pyinfinity-auto", FACTS, RATES, cuda=True)["terms"]["cpu_adam"] == pytest.approx(0.25)
    # their step is on the compute stream: at the format's device rate it adds to the compute term
    stepped = bt.bound("pyinfinity-auto", FACTS, {**RATES, "device_adam_8bit": 2e9}, cuda=True,
                       placement={"optimizer_device_numel": on_gpu}, state_format="8bit")
    assert stepped["terms"]["compute"] == pytest.approx(0.3 + on_gpu / 2e9, abs=1e-5)
    assert b["terms"]["compute"] == pytest.approx(0.3)  # fp32 with no device rate measured: nothing added


def test_the_device_step_rate_is_probed_once_per_format(monkeypatch):
    from pyinfinity.bench import train_bound
    from pyinfinity import probes as probes_mod

    calls = []
    monkeypatch.setattr(probes_mod, "measure_device_adam", lambda dev, fmt, n, reps: calls.append((dev, fmt)) or 3e9)
    rates: dict = {}
    assert train_bound.device_adam_rate_for(rates, "8bit", "cuda:0") == 3e9 == rates["device_adam_8bit"]
    assert train_bound.device_adam_rate_for(rates, "8bit", "cuda:0") == 3e9 and calls == [("cuda:0", "8bit")]


def test_a_lora_bound_streams_the_frozen_base_and_steps_the_adapters():
    """With --lora the frozen base crosses PCIe twice a step, less what a run keeps resident, and
    is never written; gradients, optimizer state and CPU Adam are the adapters'."""
    base, n = FACTS["param_bytes"], 1_000_000
    lora = dict(FACTS, params=FACTS["params"] + n, param_bytes=base + 4 * n, frozen_bytes=base, trainable=n)
    b = bt.bound("pyinfinity-nvme-all", lora, RATES, cuda=True)
    assert b["terms"]["pcie"] == pytest.approx(2 * (base + 4 * n) / RATES["h2d"], abs=1e-5)
    assert b["terms"]["cpu_adam"] == pytest.approx(n / RATES["adam"], abs=1e-5)
    assert b["disk_bytes"] == {"read": 2 * (base + 4 * n) + 12 * n, "write": 4 * n + 12 * n}
    resident = {"params": {"cpu": base + 4 * n - (1 << 30), "device(resident)": 1 << 30}, "optimizer": {"cpu": 12 * n}}
    b = bt.bound("pyinfinity-auto", lora, RATES, cuda=True, placement=resident)
    assert b["terms"]["pcie"] == pytest.approx(2 * (base + 4 * n - (1 << 30)) / RATES["h2d"], abs=1e-5)
    full = bt.bound("pyinfinity-nvme-all", FACTS, RATES, cuda=True)
    assert full["terms"]["cpu_adam"] == pytest.approx(FACTS["params"] / RATES["adam"], abs=1e-5)


def test_lora_facts_count_peft_s_adapters_and_no_weight_gradients_of_the_base():
    peft = pytest.importorskip("peft")
    from transformers import LlamaConfig, LlamaForCausalLM

    fields = bt.model_fields("micro", 32)
    for targets in (None, "all-linear", "q_proj,down_proj"):
        lora = bt.lora_spec(4, targets)
        with torch.device("meta"):
            model = peft.get_peft_model(LlamaForCausalLM(LlamaConfig(**fields)),
                                        peft.LoraConfig(r=4, target_modules=lora["targets"]))
        trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
        facts = bt.size_facts(fields, "bf16", 2, 32, True, lora)
        full = bt.size_facts(fields, "bf16", 2, 32, True)
        assert facts["trainable"] == trainable and facts["frozen_bytes"] == full["param_bytes"]
        assert facts["params"] == full["params"] + trainable
        assert facts["flops_per_step"] < full["flops_per_step"]  # one pass of the base's matmuls fewer
    assert bt.lora_spec(4, None)["targets"] == ["q_proj", "v_proj"]  # PEFT's default for Llama
    with pytest.raises(bt.BenchTrainError, match="--lora-targets: lm_head is not a layer"):
        bt.lora_spec(4, "q_proj,lm_head")
    with pytest.raises(bt.BenchTrainError, match="--lora: 0 must be >= 1"):
        bt.lora_spec(0, None)


def test_bench_train_with_lora_on_the_cpu(tmp_path):
    """Every system trains the same adapters on a frozen base: pyinfinity keeps optimizer state
    for them alone (12 bytes each), its count of trainable parameters is the bench's, and the table
    says LoRA."""
    pytest.importorskip("peft")
    from pyinfinity.bench.train_matrix import LLAMA_LINEARS

    out = tmp_path / "bt.json"
    p = _cli(*TINY, "--no-trace", "--lora", "4", "--lora-targets", "all-linear", "--systems",
             "pyinfinity-nvme,torch", "--nvme", str(tmp_path / "swap"), "--json", str(out),
             "--log-dir", str(tmp_path / "logs"))
    assert p.returncode == 0, p.stdout + p.stderr
    runs = {r["system"]: r for r in json.loads(out.read_text())["runs"]}
    for r in runs.values():
        assert r["ok"], r
        assert r["lora"] == {"r": 4, "alpha": 8, "targets": list(LLAMA_LINEARS)}
        assert r["trainable_params"] < r["params"] / 10
    py = runs["pyinfinity-nvme"]
    assert py["trainable_params_counted"] == py["trainable_params"]
    assert py["placement"]["optimizer"] == {"nvme": 12 * py["trainable_params"]}
    assert "LoRA r=4 on q_proj,k_proj" in p.stdout and f"({py['trainable_params'] / 1e3:.1f}K LoRA r4)" in p.stdout
    p = _cli(*TINY, "--lora-targets", "all-linear", "--systems", "torch", "--nvme", str(tmp_path / "swap"))
    assert p.returncode == 2 and "--lora-targets: needs --lora R" in p.stderr


def test_deepspeed_zero3_trains_the_same_peft_model_on_the_cpu(tmp_path):
    """DeepSpeed ZeRO-3 with offload_param cpu on the PEFT model (PEFT wraps the partitioned model,
    the optimizer gets the adapters), as the --lora default systems run it; without --systems those
    are the ones a LoRA invocation runs."""
    pytest.importorskip("peft")
    pytest.importorskip("deepspeed")
    from pyinfinity.bench.train_matrix import DEEPSPEED_LORA_TUNED, DEFAULT_SYSTEMS_LORA
    from pyinfinity.cli.bench_train import build_parser, settings_from_args

    a = build_parser().parse_args([*TINY, "--lora", "8", "--nvme", str(tmp_path), "--log-dir", str(tmp_path)])
    a.made_dirs = []
    assert settings_from_args(a).systems == list(DEFAULT_SYSTEMS_LORA) and DEEPSPEED_LORA_TUNED in DEFAULT_SYSTEMS_LORA
    out = tmp_path / "bt.json"
    ds = "deepspeed-cpu[zero_force_ds_cpu_optimizer=false]"  # torch's AdamW: no cpu_adam build needed
    p = _cli(*TINY, "--no-trace", "--lora", "4", "--systems", ds, "--nvme", str(tmp_path / "swap"), "--json",
             str(out), timeout=600)
    assert p.returncode == 0, p.stdout + p.stderr
    (r,) = json.loads(out.read_text())["runs"]
    assert r["ok"], r
    assert r["config"]["zero_optimization"]["offload_param"]["device"] == "cpu"
    assert r["lora"]["targets"] == ["q_proj", "v_proj"]


def test_torch_fp32master_trains_fp32_weights_under_bf16_autocast_beside_torch_nocap(tmp_path):
    """torch-fp32master keeps the weights, gradients and AdamW state in fp32 and computes in the
    run's bf16 under autocast: its first loss (same model, same data) is torch-nocap's to bf16's
    precision, and the run sets no cap."""
    out = tmp_path / "bt.json"
    p = _cli(*TINY, "--no-trace", "--dtype", "bf16", "--systems", "torch-nocap,torch-fp32master", "--nvme",
             str(tmp_path / "swap"), "--json", str(out), "--log-dir", str(tmp_path / "logs"))
    assert p.returncode == 0, p.stdout + p.stderr
    runs = {r["system"]: r for r in json.loads(out.read_text())["runs"]}
    assert runs["torch-fp32master"]["ok"] and runs["torch-nocap"]["ok"], runs
    assert runs["torch-fp32master"]["param_dtypes"] == ["float32"] and runs["torch-nocap"]["param_dtypes"] == ["bfloat16"]
    a, b = runs["torch-fp32master"]["steps"][0]["loss"], runs["torch-nocap"]["steps"][0]["loss"]
    assert a == pytest.approx(b, rel=2e-2)
