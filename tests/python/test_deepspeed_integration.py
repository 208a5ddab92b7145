"""pyinfinity as DeepSpeed's NVMe backend: DeepSpeed 0.19 ZeRO-3 trains on the CPU with every swap file
written and read by pyinfinity, losses equal to the offload-to-cpu run; install/uninstall semantics.

Each DeepSpeed training runs in its own process (``python this_file.py --worker cfg.json``) so that
DeepSpeed's process-global state (accelerator, dist group, op cache) does not leak between runs.
The worker forbids every DeepSpeed op build, so nothing here needs or builds DeepSpeed's aio op.
"""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any, Dict, List

import pytest

ROOT = Path(__file__).resolve().parents[2]
HIDDEN = 1024          # each Linear weight: 1024*1024 bf16 = 2 MiB (> 1 MiB, so it is swapped)
LAYERS = 4
BATCH = 8
STEPS = 4
WORKER_TIMEOUT_S = 240


# ---------------------------------------------------------------------------------------------
# The worker: one DeepSpeed training run, results as JSON
# ---------------------------------------------------------------------------------------------
def ds_config(offload: str, nvme_path: str, pipeline_read: bool = False, pipeline_write: bool = False,
              fast_init: bool = False, llama: bool = False) -> Dict[str, Any]:
    zero: Dict[str, Any] = {
        "stage": 3,
        "offload_param": {"device": offload, "pin_memory": True},
        "offload_optimizer": {"device": offload, "pin_memory": True},
        "stage3_param_persistence_threshold": 1e5 if llama else 0,
        "stage3_prefetch_bucket_size": 5e7 if llama else 2 * HIDDEN * HIDDEN,
        "stage3_max_live_parameters": 1e8 if llama else 2 * HIDDEN * HIDDEN,
    }
    if offload == "cpu-nvme":  # parameters in CPU memory, optimizer states on NVMe
        zero["offload_param"]["device"] = "cpu"
    if offload == "nvme":
        zero["offload_param"].update(nvme_path=nvme_path, buffer_count=6 if llama else 4,
                                     buffer_size=LAYERS * HIDDEN * HIDDEN, max_in_cpu=0)
    if offload in ("nvme", "cpu-nvme"):
        zero["offload_optimizer"].update(device="nvme", nvme_path=nvme_path, buffer_count=4, fast_init=fast_init,
                                         pipeline_read=pipeline_read, pipeline_write=pipeline_write)
    return {
        "train_micro_batch_size_per_gpu": BATCH,
        "gradient_accumulation_steps": 1,
        "bf16": {"enabled": True},
        "zero_optimization": zero,
        "zero_force_ds_cpu_optimizer": False,  # torch's AdamW: no cpu_adam op to build
        "aio": {"block_size": 262144, "queue_depth": 8, "intra_op_parallelism": 1,
                "single_submit": False, "overlap_events": True},
        "steps_per_print": 10 ** 6,
    }


def _worker(cfg: Dict[str, Any]) -> Dict[str, Any]:
    import torch

    if cfg["backend"] == "pyinfinity" and cfg.get("via") == "install":
        from pyinfinity.integrations import deepspeed as pids  # noqa: F401 (env var route when via=env)
        pids.install()
    elif cfg["backend"] == "pyinfinity":
        assert os.environ.get("PYINFINITY_DEEPSPEED") == "1"
        import pyinfinity.integrations.deepspeed  # noqa: F401 - acts on PYINFINITY_DEEPSPEED=1

    import deepspeed
    from deepspeed.ops.op_builder.builder import OpBuilder

    if cfg.get("unpatched_swapper"):  # DeepSpeed's own parameter swapper, pyinfinity's I/O
        from pyinfinity.integrations import deepspeed as pids

        pids.unpatch_param_swapper()

    def no_build(self: Any, verbose: bool = True) -> None:
        raise RuntimeError(f"test guard: DeepSpeed tried to build its {self.name!r} op")

    OpBuilder.jit_load = no_build  # nothing may be built: not DeepSpeed's aio, not cpu_adam
    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False  # one process: gloo, no shm op build

    torch.manual_seed(0)
    llama = cfg["model"] == "llama"
    conf = ds_config(cfg["offload"], cfg["nvme"], cfg["pipeline_read"], cfg["pipeline_write"], cfg["fast_init"],
                     llama)
    zero = conf["zero_optimization"]
    for section in ("offload_param", "offload_optimizer"):
        for key, value in cfg.get(section, {}).items():  # None: leave the knob out
            if value is None:
                zero[section].pop(key, None)
            else:
                zero[section][key] = value
    for key, value in cfg.get("zero", {}).items():
        if value is None:
            zero.pop(key, None)
        else:
            zero[key] = value
    if cfg.get("size_nvme"):
        from pyinfinity.integrations import deepspeed as pids

        with torch.device("meta"):
            meta = torch.nn.Sequential(*[torch.nn.Linear(HIDDEN, HIDDEN, bias=False) for _ in range(LAYERS)])
        sizing = pids.size_nvme_offload(conf, meta)
        conf = sizing.config
        cfg["sizing"] = sizing.changes
        print("SIZING", json.dumps(sizing.changes), flush=True)
    if llama:  # imported outside zero.Init, which patches torch.Tensor.__new__
        from transformers import LlamaConfig, LlamaForCausalLM
    with deepspeed.zero.Init(config_dict_or_path=conf):
        if llama:  # lm_head (4096 x 256) ends the forward pass and starts the backward pass
            model = LlamaForCausalLM(LlamaConfig(
                vocab_size=4096, hidden_size=256, intermediate_size=704, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128))
        else:
            layers: List[torch.nn.Module] = []
            for i in range(LAYERS):
                layers += [torch.nn.Linear(HIDDEN, HIDDEN, bias=False), torch.nn.GELU()]
            model = torch.nn.Sequential(*layers[:-1])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    eng, *_ = deepspeed.initialize(model=model, optimizer=opt, config=conf)

    g = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(cfg["steps"]):
        if llama:
            ids = torch.randint(0, 4096, (2, 64), generator=g)
            loss = eng(input_ids=ids, labels=ids).loss
        else:
            x = torch.randn(BATCH, HIDDEN, generator=g).to(torch.bfloat16)
            y = torch.randn(BATCH, HIDDEN, generator=g)
            loss = ((eng(x).float() - y) ** 2).mean()
        eng.backward(loss)
        eng.step()
        losses.append(loss.item())

    swapper = getattr(eng.optimizer, "optimizer_swapper", None)
    out: Dict[str, Any] = {"losses": [float.hex(v) for v in losses],
                           "optimizer_swapper": type(swapper).__name__ if swapper is not None else None,
                           "sizing": cfg.get("sizing"),
                           "offload_optimizer": {k: v for k, v in conf["zero_optimization"]["offload_optimizer"].items()
                                                 if k != "nvme_path"},
                           "loaded_ops": sorted(OpBuilder._loaded_ops),
                           "ds_aio_op_imported": "deepspeed.ops.aio.async_io_op" in sys.modules}
    if cfg["offload"] != "cpu":
        every = sorted(p for p in Path(cfg["nvme"]).rglob("*") if p.is_file())
        claims = [p for p in every if p.parent.name.startswith("pyinfinity-rank")]  # pyinfinity's lock, manifest
        out["swap_files"] = {str(p): p.stat().st_size for p in every if p not in claims}
        out["claim_files"] = [str(p.relative_to(cfg["nvme"])) for p in claims]
    if cfg["backend"] == "pyinfinity":
        from pyinfinity.integrations import deepspeed as pids

        out["stats"] = pids.stats().as_dict()
    return out


# ---------------------------------------------------------------------------------------------
# Running workers
# ---------------------------------------------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env(extra: Dict[str, str] | None = None) -> Dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "PYINFINITY_DEEPSPEED"}
    env.update(DS_ACCELERATOR="cpu", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()), RANK="0",
               WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_SIZE="1", OMP_NUM_THREADS="1",
               PYTHONPATH=str(ROOT) + os.pathsep + env.get("PYTHONPATH", ""))
    env.update(extra or {})
    return env


def start_worker(tmp: Path, name: str, backend: str, offload: str, pipeline_read: bool = False,
                 pipeline_write: bool = False, fast_init: bool = False, via: str = "install",
                 steps: int = STEPS, model: str = "mlp", **extra: Any) -> subprocess.Popen:
    """extra: unpatched_swapper (DeepSpeed's own parameter swapper), offload_param / zero (knobs
    over ds_config's; None removes one), size_nvme (size_nvme_offload on the config)."""
    d = tmp / name
    (d / "nvme").mkdir(parents=True)
    cfg = {"backend": backend, "offload": offload, "pipeline_read": pipeline_read, "pipeline_write": pipeline_write,
           "fast_init": fast_init, "via": via, "steps": steps, "model": model, **extra,
           "nvme": str(d / "nvme"), "out": str(d / "result.json")}
    (d / "cfg.json").write_text(json.dumps(cfg))
    extra = {"PYINFINITY_DEEPSPEED": "1"} if via == "env" else {}
    with open(d / "log.txt", "w") as log:  # the child keeps its own descriptor
        return subprocess.Popen([sys.executable, __file__, "--worker", str(d / "cfg.json")], cwd=str(ROOT),
                                env=_env(extra), stdout=log, stderr=subprocess.STDOUT)


def finish_worker(proc: subprocess.Popen, tmp: Path, name: str) -> Dict[str, Any]:
    d = tmp / name
    try:
        rc: Any = proc.wait(timeout=WORKER_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        rc = "timeout"
    if rc != 0:
        return {"error": f"worker {name} exited with {rc}:\n{(d / 'log.txt').read_text()[-6000:]}"}
    return json.loads((d / "result.json").read_text())


def run_workers(tmp: Path, specs: Dict[str, Dict[str, Any]]) -> Dict[str, Dict[str, Any]]:
    """Runs the workers two at a time (this suite targets a 2-core CI machine)."""
    results: Dict[str, Dict[str, Any]] = {}
    names = list(specs)
    for i in range(0, len(names), 2):
        batch = {n: start_worker(tmp, n, **specs[n]) for n in names[i:i + 2]}
        for n, p in batch.items():
            results[n] = finish_worker(p, tmp, n)
    return results


def result(runs: Dict[str, Dict[str, Any]], name: str) -> Dict[str, Any]:
    """The run's results; fails the calling test (only) when that run failed."""
    r = runs[name]
    if "error" in r:
        pytest.fail(r["error"])
    return r


def losses(r: Dict[str, Any]) -> List[float]:
    return [float.fromhex(h) for h in r["losses"]]



PRELUDE = """
import sys
from pyinfinity.integrations import deepspeed as pids
class Reached(Exception):
    pass
def builder():
    from deepspeed.ops.op_builder import AsyncIOBuilder
    return AsyncIOBuilder
def no_builds():  # a DeepSpeed op build here would be a bug (and minutes long): raise instead
    from deepspeed.ops.op_builder.builder import OpBuilder
    def jit_load(self, verbose=True):
        raise Reached(self.name)
    OpBuilder.jit_load = jit_load
"""


def run_snippet(code: str, env: Dict[str, str] | None = None, timeout: int = 120) -> subprocess.CompletedProcess:
    """Runs PRELUDE + `code` in a fresh interpreter (DeepSpeed's import-time state must not leak)."""
    script = PRELUDE + textwrap.dedent(code)
    return subprocess.run([sys.executable, "-c", script], cwd=str(ROOT), env=_env(env),
                          capture_output=True, text=True, timeout=timeout)


def ok(code: str, env: Dict[str, str] | None = None) -> str:
    r = run_snippet(code, env)
    assert r.returncode == 0 and r.stdout.rstrip().endswith("OK"), f"snippet failed ({r.returncode}):\n{r.stdout[-3000:]}\n{r.stderr[-6000:]}"
    return r.stdout


@pytest.fixture(scope="session")
def deepspeed_importable() -> None:
    r = run_snippet("import deepspeed")
    if r.returncode != 0:
        pytest.skip(f"deepspeed is not importable: {r.stderr.strip().splitlines()[-1:]}")


# ---------------------------------------------------------------------------------------------
# Training: ZeRO-3, params + optimizer on nvme through pyinfinity vs offload to cpu
# ---------------------------------------------------------------------------------------------
NVME_RUNS = {
    "nvme": dict(backend="pyinfinity", offload="nvme"),                  # install()
    "nvme_env": dict(backend="pyinfinity", offload="nvme", via="env"),   # PYINFINITY_DEEPSPEED=1
    "pipeline_rw": dict(backend="pyinfinity", offload="nvme", pipeline_read=True, pipeline_write=True),
    "pipeline_r": dict(backend="pyinfinity", offload="nvme", pipeline_read=True),
    "pipeline_w": dict(backend="pyinfinity", offload="nvme", pipeline_write=True),
    # fast_init hands the parameter swapper's locked buffers to the optimizer swapper's handle
    "fast_init": dict(backend="pyinfinity", offload="nvme", fast_init=True),
}

# Parameters in CPU memory, optimizer states on NVMe, one sub-group per weight (DeepSpeed's default
# sub_group_size makes one sub-group here: nothing to pipeline)
ONE_WEIGHT = {"sub_group_size": HIDDEN * HIDDEN}
CPU_NVME_RUNS = {
    "cpu_nvme": dict(backend="pyinfinity", offload="cpu-nvme", zero=ONE_WEIGHT),
    # the knobs left out: size_nvme_offload() turns the pipelined swapper on and sizes it
    "cpu_nvme_sized": dict(backend="pyinfinity", offload="cpu-nvme", size_nvme=True,
                           offload_optimizer={"pipeline_read": None, "pipeline_write": None, "buffer_count": None}),
    # pipelined with DeepSpeed's default 4 buffers: DeepSpeed asserts
    "cpu_nvme_pipe4": dict(backend="pyinfinity", offload="cpu-nvme", zero=ONE_WEIGHT, pipeline_read=True,
                           pipeline_write=True),
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory, deepspeed_importable: None) -> Dict[str, Dict[str, Any]]:
    tmp = tmp_path_factory.mktemp("ds")
    t0 = time.perf_counter()
    res = run_workers(tmp, {"cpu": dict(backend="deepspeed", offload="cpu"), **NVME_RUNS,
                            "llama_cpu": dict(backend="deepspeed", offload="cpu", model="llama"),
                            "llama_nvme_fixed": dict(backend="pyinfinity", offload="nvme", model="llama"),
                            **CPU_NVME_RUNS})
    print(f"{len(res)} DeepSpeed trainings in {time.perf_counter() - t0:.1f} s")
    return res


@pytest.mark.parametrize("name", list(NVME_RUNS))
def test_every_swap_file_written_and_read_by_pyinfinity(runs: Dict[str, Dict[str, Any]], name: str) -> None:
    r = result(runs, name)
    files = r["swap_files"]
    kinds = {"param": "bfloat16params", "exp_avg": "exp_avg-", "exp_avg_sq": "exp_avg_sq-", "gradient": "_gradient_"}
    for kind, needle in kinds.items():
        assert any(needle in f for f in files), f"{name}: no {kind} swap file in {sorted(files)}"
    st = r["stats"]
    assert set(files) <= set(st["files_written"]), f"{name}: written elsewhere: {set(files) - set(st['files_written'])}"
    assert set(files) <= set(st["files_read"]), f"{name}: never read by pyinfinity: {set(files) - set(st['files_read'])}"
    assert set(st["files_written"]) <= set(files)  # nothing pyinfinity wrote is missing from the swap folder
    assert st["bytes_written"] >= sum(files.values()) and st["bytes_read"] > 0
    # Each parameter is read back at least once per step (forward).
    param_files = [f for f in files if "bfloat16params" in f]
    assert st["reads"] >= STEPS * len(param_files)
    assert "async_io" not in r["loaded_ops"] and not r["ds_aio_op_imported"]


@pytest.mark.parametrize("name", list(NVME_RUNS))
def test_losses_match_offload_to_cpu(runs: Dict[str, Dict[str, Any]], name: str) -> None:
    ref, got = losses(result(runs, "cpu")), losses(result(runs, name))
    assert len(got) == len(ref) == STEPS
    assert len(set(ref)) == STEPS, f"loss did not change between steps: {ref}"
    for step, (a, b) in enumerate(zip(ref, got)):
        assert abs(a - b) <= 1e-6 * abs(a), f"{name} step {step}: loss {b!r} vs offload-to-cpu {a!r}"


def test_nvme_params_with_prefetch_fix_train_like_offload_to_cpu(runs: Dict[str, Dict[str, Any]]) -> None:
    """A Llama with its parameters on nvme and prefetch on hits DeepSpeed 0.19.8's repeated-parameter
    swap_in; with install()'s swapper patch it trains exactly like offload-to-cpu."""
    ref, got = result(runs, "llama_cpu"), result(runs, "llama_nvme_fixed")
    assert len(set(ref["losses"])) == STEPS
    assert got["losses"] == ref["losses"]
    files = got["swap_files"]
    assert any("bfloat16params" in f for f in files), sorted(files)
    assert set(files) <= set(got["stats"]["files_written"]) & set(got["stats"]["files_read"])


# ---------------------------------------------------------------------------------------------
# Parameters on NVMe with few / small swap buffers: DeepSpeed's own swapper asserts, install()'s
# patch and size_nvme_offload() make the same configurations train like offload-to-cpu
# ---------------------------------------------------------------------------------------------
SMALL = HIDDEN * HIDDEN // 2  # buffer_size below each Linear weight's partition (HIDDEN * HIDDEN)
BUFFER_STEPS = 3
BUFFER_RUNS = {
    # 3 buffers, 4 weights kept live by stage3_max_reuse_distance (default 1e9) -> "Not enough buffers"
    "ds_few_buffers": dict(backend="pyinfinity", offload="nvme", unpatched_swapper=True,
                           offload_param={"buffer_count": 3}),
    "ds_small_buffers": dict(backend="pyinfinity", offload="nvme", unpatched_swapper=True,
                             offload_param={"buffer_size": SMALL}),
    "sized_few_small": dict(backend="pyinfinity", offload="nvme", size_nvme=True,
                            offload_param={"buffer_count": 3, "buffer_size": SMALL}),
    "patched_small": dict(backend="pyinfinity", offload="nvme", offload_param={"buffer_size": SMALL}),
    "patched_few": dict(backend="pyinfinity", offload="nvme", offload_param={"buffer_count": 3}),
}


@pytest.fixture(scope="module")
def buffer_runs(tmp_path_factory: pytest.TempPathFactory, deepspeed_importable: None) -> Dict[str, Dict[str, Any]]:
    # knobs left out or "auto" are sized in test_deepspeed_trainer.py (and unit-tested in test_deepspeed_api.py)
    runs = {"cpu": dict(backend="deepspeed", offload="cpu"), **BUFFER_RUNS}
    return run_workers(tmp_path_factory.mktemp("ds_buffers"), {n: {**r, "steps": BUFFER_STEPS} for n, r in runs.items()})


@pytest.mark.parametrize("name,message", [("ds_few_buffers", "AssertionError: Not enough buffers 0 for swapping 1"),
                                          ("ds_small_buffers", "AssertionError: More elements 1048576 than "
                                                               f"buffer size {SMALL}")])
def test_deepspeeds_own_swapper_asserts(buffer_runs: Dict[str, Dict[str, Any]], name: str, message: str) -> None:
    """The configurations below fail in DeepSpeed 0.19.8 without the patch (the I/O backend is
    irrelevant: the same assertions with DeepSpeed's aio)."""
    assert message in buffer_runs[name].get("error", ""), buffer_runs[name]


def test_sized_config_trains_like_offload_to_cpu(buffer_runs: Dict[str, Dict[str, Any]]) -> None:
    ref, got = result(buffer_runs, "cpu"), result(buffer_runs, "sized_few_small")
    assert len(set(ref["losses"])) == BUFFER_STEPS
    assert got["losses"] == ref["losses"]  # float.hex: every bit
    files = got["swap_files"]
    params = [f for f in files if "bfloat16params" in f]
    assert len(params) == LAYERS, sorted(files)  # every weight on NVMe, through pyinfinity
    assert set(files) <= set(got["stats"]["files_written"]) & set(got["stats"]["files_read"])


def test_patch_alone_keeps_oversized_partitions_in_cpu_memory(buffer_runs: Dict[str, Dict[str, Any]]) -> None:
    ref, got = result(buffer_runs, "cpu"), result(buffer_runs, "patched_small")
    assert got["losses"] == ref["losses"]
    assert not [f for f in got["swap_files"] if "bfloat16params" in f]  # none fits a buffer: all in RAM


def test_patch_alone_names_the_knob_when_live_parameters_hold_every_buffer(
        buffer_runs: Dict[str, Dict[str, Any]]) -> None:
    """On one CPU rank a gathered parameter is its swap buffer, so nothing can be given back: the
    patch says what to raise instead of asserting."""
    err = buffer_runs["patched_few"].get("error", "")
    assert "SwapBuffersExhausted" in err and "offload_param.buffer_count" in err and "size_nvme_offload" in err, err


def test_bit_for_bit_between_pyinfinity_runs(runs: Dict[str, Dict[str, Any]]) -> None:
    assert result(runs, "nvme")["losses"] == result(runs, "nvme_env")["losses"]  # float.hex: every bit


def test_pipeline_flags_choose_deepspeeds_swapper(runs: Dict[str, Dict[str, Any]]) -> None:
    plain = result(runs, "nvme")
    assert plain["optimizer_swapper"] == "PartitionedOptimizerSwapper"
    for name in ("pipeline_rw", "pipeline_r", "pipeline_w"):
        r = result(runs, name)
        assert r["optimizer_swapper"] == "PipelinedOptimizerSwapper", name
        # the pipelined swapper builds a read and a write handle: one more than the plain one
        assert r["stats"]["handles"] == plain["stats"]["handles"] + 1, name


def test_pipelined_optimizer_swapper_sized_by_pyinfinity_trains_like_the_plain_one(
        runs: Dict[str, Dict[str, Any]]) -> None:
    plain, piped = result(runs, "cpu_nvme"), result(runs, "cpu_nvme_sized")
    assert plain["optimizer_swapper"] == "PartitionedOptimizerSwapper"
    assert piped["optimizer_swapper"] == "PipelinedOptimizerSwapper"
    assert any(c.startswith("offload_optimizer.pipeline_read: None -> True") for c in piped["sizing"]), piped["sizing"]
    assert piped["offload_optimizer"]["buffer_count"] == 12
    assert len(set(plain["losses"])) == STEPS
    assert piped["losses"] == plain["losses"] == result(runs, "cpu")["losses"]  # float.hex: every bit
    for r in (plain, piped):
        files = r["swap_files"]
        assert sum("exp_avg_sq" in f for f in files) == LAYERS and not [f for f in files if "bfloat16params" in f]
        assert set(files) <= set(r["stats"]["files_written"]) & set(r["stats"]["files_read"])
        st = r["stats"]
        assert st["wait_calls"] > 0 and 0 < st["read_wait_s"] + st["write_wait_s"] <= st["wait_s"], st


def test_deepspeeds_pipelined_swapper_asserts_with_its_default_buffer_count(runs: Dict[str, Dict[str, Any]]) -> None:
    """With more than one sub-group the pipelined swapper holds a sub-group's buffers for the
    read ahead and another's for the write behind; DeepSpeed's default of 4 runs out at the
    first step's swap-out (the I/O backend is irrelevant). size_nvme_offload() asks for 12."""
    err = runs["cpu_nvme_pipe4"].get("error", "")
    assert "pipelined_optimizer_swapper.py" in err and "AssertionError" in err, err[-2000:]


# ---------------------------------------------------------------------------------------------
# install / uninstall / import order / env var / version and layout checks
# ---------------------------------------------------------------------------------------------
def test_install_before_import_patches_when_deepspeed_loads(deepspeed_importable: None) -> None:
    out = ok("""
    pids.install()
    assert "deepspeed" not in sys.modules, "install() must not import deepspeed"
    assert pids.is_installed()
    import deepspeed
    no_builds()
    from pyinfinity import post_import
    assert not post_import.waiting("deepspeed")  # the patch ran with the import: nothing waits any more
    B = builder()
    assert B().load() is pids.aio_op and B().load(verbose=False).aio_handle is pids.DeepSpeedAioHandle
    assert B().is_compatible() is True
    from deepspeed.runtime.swap_tensor import partitioned_param_swapper as pps
    assert pps.AsyncIOBuilder().load() is pids.aio_op
    print("OK")
    """)


def test_install_after_import(deepspeed_importable: None) -> None:
    ok("""
    import deepspeed
    no_builds()
    from deepspeed.runtime.swap_tensor import pipelined_optimizer_swapper as pos  # bound before install
    pids.install()
    assert pos.AsyncIOBuilder().load() is pids.aio_op
    h = pids.aio_op.aio_handle(block_size=1 << 20, queue_depth=8, single_submit=False, overlap_events=True,
                               intra_op_parallelism=1)
    assert isinstance(h, pids.AioHandle)
    print("OK")
    """)


def test_install_is_idempotent_and_uninstall_restores(deepspeed_importable: None) -> None:
    ok("""
    pids.install(); pids.install()           # twice before import: one hook
    from pyinfinity import post_import
    assert post_import.waiting("deepspeed").count("pyinfinity.integrations.deepspeed.installer:_on_import") == 1
    import deepspeed
    no_builds()
    from deepspeed.ops.op_builder.builder import OpBuilder
    B = builder()
    patched = B.__dict__["load"]
    pids.install(); pids.install()           # twice after import: same patch
    assert B.__dict__["load"] is patched
    pids.uninstall(); pids.uninstall()
    assert not pids.is_installed()
    # DeepSpeed's own methods are back: load() reaches its JIT build path again
    import inspect
    assert "PinMemoryBuilder" in inspect.getsource(B.load) and "has_function" in inspect.getsource(B.is_compatible)
    try:
        B().load()
    except Reached:
        pass
    else:
        raise AssertionError("uninstall() left AsyncIOBuilder().load() patched")
    pids.install()                           # and again
    assert B().load() is pids.aio_op
    print("OK")
    """)


def test_uninstall_before_import_drops_the_hook(deepspeed_importable: None) -> None:
    ok("""
    pids.install(); pids.uninstall()
    from pyinfinity import post_import
    assert "pyinfinity.integrations.deepspeed.installer:_on_import" not in post_import.waiting("deepspeed")
    import deepspeed
    no_builds()
    assert "load" in builder().__dict__ and not getattr(builder().__dict__["load"], "__pyinfinity_patch__", False)
    assert not pids.is_installed()
    print("OK")
    """)


@pytest.mark.parametrize("value,installed", [("1", True), ("0", False), ("", False)])
def test_env_var(deepspeed_importable: None, value: str, installed: bool) -> None:
    ok(f"""
    assert pids.is_installed() is {installed}
    import deepspeed
    no_builds()
    if {installed}:
        assert builder()().load() is pids.aio_op
    assert getattr(builder().__dict__["load"], "__pyinfinity_patch__", False) is {installed}
    print("OK")
    """, env={"PYINFINITY_DEEPSPEED": value})


def test_env_var_bad_value_is_an_error() -> None:
    r = run_snippet("import pyinfinity.integrations.deepspeed", env={"PYINFINITY_DEEPSPEED": "maybe"})
    assert r.returncode != 0 and "PYINFINITY_DEEPSPEED='maybe'" in r.stderr


def test_version_mismatch_fails_loudly_and_leaves_deepspeed_alone(deepspeed_importable: None) -> None:
    out = ok("""
    import deepspeed
    no_builds()
    deepspeed.__version__ = "0.20.0"
    try:
        pids.install()
    except pids.DeepSpeedLayoutError as e:
        print(e)
    else:
        raise AssertionError("no error for deepspeed 0.20.0")
    assert not getattr(builder().__dict__["load"], "__pyinfinity_patch__", False)
    assert not pids.is_installed()
    print("OK")
    """)
    assert "deepspeed 0.20.0 is not supported" in out and "0.19.x" in out and "0.19.8" in out


def test_version_mismatch_at_import_after_install(deepspeed_importable: None) -> None:
    r = run_snippet("""
    pids.SUPPORTED_SERIES = ((0, 18),)   # as if this deepspeed were a release we do not know
    pids.install()
    import deepspeed
    no_builds()
    """)
    assert r.returncode != 0
    assert "DeepSpeedLayoutError: deepspeed 0.19" in r.stderr and "0.18.x" in r.stderr


def test_layout_mismatch_names_what_differs(deepspeed_importable: None) -> None:
    out = ok("""
    import deepspeed
    no_builds()
    from deepspeed.runtime.swap_tensor import partitioned_optimizer_swapper as pos
    from deepspeed.ops.op_builder.builder import OpBuilder
    pos.AsyncIOBuilder = lambda: None         # a DeepSpeed that binds something else there
    saved = OpBuilder._loaded_ops
    del OpBuilder._loaded_ops
    try:
        pids.install()
    except pids.DeepSpeedLayoutError as e:
        print(e)
    else:
        raise AssertionError("no error for a changed layout")
    OpBuilder._loaded_ops = saved
    assert not pids.is_installed()
    print("OK")
    """)
    assert "partitioned_optimizer_swapper.AsyncIOBuilder is <function" in out
    assert "OpBuilder._loaded_ops" in out


def test_pin_memory_op_is_replaced_and_shares_the_registry(deepspeed_importable: None) -> None:
    ok("""
    import torch
    pids.install()
    import deepspeed
    no_builds()
    from deepspeed.ops.op_builder import PinMemoryBuilder, AsyncIOBuilder
    from deepspeed.accelerator import get_accelerator
    assert PinMemoryBuilder().load() is pids.pin_op and PinMemoryBuilder().is_compatible() is True
    assert get_accelerator().create_op_builder("PinMemoryBuilder").load() is pids.pin_op
    t = PinMemoryBuilder().load().pin_handle().new_cpu_locked_tensor(1000, torch.empty(0, dtype=torch.bfloat16))
    aio = AsyncIOBuilder().load().aio_handle()
    assert aio.is_pinned(t[10:20]) and aio.free_cpu_locked_tensor(t) is True
    pids.uninstall()
    try:
        PinMemoryBuilder().load()
    except Reached as e:
        assert str(e) == "pin_memory"
    else:
        raise AssertionError("uninstall() left PinMemoryBuilder().load() patched")
    print("OK")
    """)


def test_a_binding_pyinfinity_does_not_accept_stops_install(deepspeed_importable: None) -> None:
    out = ok("""
    class Older(pids.DeepSpeedAioHandle):  # as before the fd overload was accepted
        def async_pwrite(self, buffer, filename, file_offset=0):
            return super().async_pwrite(buffer, filename, file_offset)
    pids.aio_op.aio_handle = Older
    import deepspeed
    no_builds()
    try:
        pids.install()
    except pids.DeepSpeedLayoutError as e:
        print(e)
    else:
        raise AssertionError("no error for a binding pyinfinity does not accept")
    assert not pids.is_installed()
    print("OK")
    """)
    assert "py_ds_aio.cpp: Older.async_pwrite" in out and "does not take ['fd']" in out


# ---------------------------------------------------------------------------------------------
# Item 2: DeepSpeed's fast checkpoint writer goes through the same AsyncIOBuilder
# ---------------------------------------------------------------------------------------------
def test_fast_checkpoint_writer_writes_through_pyinfinity(deepspeed_importable: None, tmp_path: Path) -> None:
    ok(f"""
    import types, torch
    pids.install()
    import deepspeed
    no_builds()
    from deepspeed.accelerator import get_accelerator
    from deepspeed.runtime.model_checkpointing.writer_factory import CheckpointWriterFactory
    from deepspeed.runtime.swap_tensor.aio_config import get_aio_config
    import deepspeed.io.fast_file_writer as ffw
    # Two CPU-accelerator gaps unrelated to I/O: no utils op (a byte view) and no pinning.
    def cast(ts):
        one = lambda t: t if t.nbytes <= 1 else t.reshape(-1).view(torch.uint8)
        return [one(t) for t in ts] if isinstance(ts, list) else one(ts)
    ffw.UtilsBuilder = lambda: types.SimpleNamespace(load=lambda: types.SimpleNamespace(cast_to_byte_tensor=cast))
    get_accelerator().is_pinned = lambda t: True
    wc = {{"type": "FAST", "io_buffer_size": 1 << 20, "io_buffer_double": True, "io_multiplier": 1,
          "show_statistics": False}}
    factory = CheckpointWriterFactory(wc, get_aio_config({{}}), types.SimpleNamespace(world_size=1, rank=0, global_rank=0))
    assert isinstance(factory._dnvme_handle, pids.DeepSpeedAioHandle)
    sd = {{"w": torch.randn(1000, 777), "b": torch.arange(13), "s": "x"}}
    path = {str(tmp_path / "ckpt.pt")!r}
    torch.save(sd, factory.create_writer(path, False))
    factory.release_writer()
    back = torch.load(path)
    assert torch.equal(back["w"], sd["w"]) and torch.equal(back["b"], sd["b"]) and back["s"] == "x"
    st = pids.stats()
    import os
    assert st.files_written == {{path}} and st.writes >= 2, st
    assert st.bytes_written <= os.path.getsize(path) < st.bytes_written + 4096, (st, os.path.getsize(path))
    print("OK")
    """)


# ---------------------------------------------------------------------------------------------
# The handle and the op module, in process (no DeepSpeed import)
# ---------------------------------------------------------------------------------------------
def test_locked_buffers_are_process_wide_like_deepspeeds() -> None:
    import torch
    from pyinfinity.aio import AioHandle
    from pyinfinity.integrations.deepspeed import DeepSpeedAioHandle

    a, b = DeepSpeedAioHandle(), DeepSpeedAioHandle()
    t = a.new_cpu_locked_tensor(4096, torch.empty(0, dtype=torch.bfloat16))
    assert a.is_pinned(t) and b.is_pinned(t) and b.is_pinned(t[100:200])
    plain = AioHandle()
    assert plain.is_pinned(t)  # process-wide in AioHandle itself, as in DeepSpeed
    assert not b.is_pinned(torch.empty(10))
    assert b.free_cpu_locked_tensor(t) is True  # freed through the other handle
    assert not a.is_pinned(t)
    assert a.free_cpu_locked_tensor(t) is False  # a second free: False, as DeepSpeed's


def test_stats_count_paths_and_descriptors(tmp_path: Path) -> None:
    import torch
    from pyinfinity.integrations import deepspeed as pids

    pids.reset_stats()
    h = pids.DeepSpeedAioHandle(block_size=65536, queue_depth=4)
    t = torch.arange(50_000, dtype=torch.float32)
    p = tmp_path / "f.swp"
    assert h.async_pwrite(t, str(p)) == 0 and h.wait() == 1
    fd = os.open(tmp_path / "g.swp", os.O_CREAT | os.O_WRONLY, 0o644)
    try:
        assert h.sync_pwrite(t, fd) == 1
    finally:
        os.close(fd)
    u = torch.empty_like(t)
    assert h.pread(u, str(p), True, False) == 1 and torch.equal(t, u)
    st = pids.stats()
    assert (st.handles, st.writes, st.reads) == (1, 2, 1)
    assert (st.bytes_written, st.bytes_read) == (2 * t.nbytes, t.nbytes)
    assert st.files_written == {str(p), str(tmp_path / "g.swp")} and st.files_read == {str(p)}
    pids.reset_stats()


def test_stats_time_each_blocking_wait_by_direction(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every wait (also inside sync_pwrite / pread(async=False)) is one call; its seconds go to
    read_wait_s or write_wait_s by what it waited for, to wait_s only when it waited for both."""
    import threading
    import torch
    from pyinfinity.aio import AioHandle
    from pyinfinity.integrations import deepspeed as pids

    slow = {"s": 0.0}
    orig = AioHandle.wait

    def wait(self: Any, timeout: Any = None) -> int:  # the engine's wait, made measurably long
        time.sleep(slow["s"])
        return orig(self, timeout)

    monkeypatch.setattr(AioHandle, "wait", wait)
    pids.reset_stats()
    h = pids.DeepSpeedAioHandle(block_size=65536, queue_depth=4)
    t = torch.arange(50_000, dtype=torch.float32)
    p, q = str(tmp_path / "f.swp"), str(tmp_path / "g.swp")
    slow["s"] = 0.05
    assert h.sync_pwrite(t, p) == 1                       # write only: 50 ms
    slow["s"] = 0.10
    assert h.pread(torch.empty_like(t), p, False, False) == 1  # read only: 100 ms
    slow["s"] = 0.20
    h.async_pwrite(t, q)
    h.async_pread(torch.empty_like(t), p)
    assert h.wait() == 2                                  # both: 200 ms, in wait_s only
    slow["s"] = 0.0
    assert h.wait() == 0                                  # nothing pending: a call, no direction
    st = pids.stats()
    assert st.wait_calls == 4
    assert 0.05 <= st.write_wait_s < 0.10 and 0.10 <= st.read_wait_s < 0.20, st
    assert 0.35 <= st.wait_s < 0.5 and st.wait_s >= st.read_wait_s + st.write_wait_s + 0.2, st
    assert {"wait_calls", "wait_s", "read_wait_s", "write_wait_s"} <= set(st.as_dict())

    pids.reset_stats()                                    # waits from several threads add up
    slow["s"] = 0.05
    handles = [pids.DeepSpeedAioHandle() for _ in range(4)]
    threads = [threading.Thread(target=g.sync_pwrite, args=(t, str(tmp_path / f"t{i}.swp")))
               for i, g in enumerate(handles)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    st = pids.stats()
    assert st.wait_calls == 4 and st.write_wait_s >= 4 * 0.05 and st.read_wait_s == 0.0, st
    pids.reset_stats()
    assert (pids.stats().wait_calls, pids.stats().wait_s) == (0, 0.0)
    assert pids.stats().writes == 0


def test_aio_op_has_deepspeeds_module_functions(tmp_path: Path) -> None:
    import torch
    from pyinfinity.integrations import deepspeed as pids

    src = None
    try:
        import importlib.util
        spec = importlib.util.find_spec("deepspeed")
        if spec is not None and spec.origin:
            src = Path(spec.origin).parent / "ops" / "csrc" / "aio" / "py_lib" / "py_ds_aio.cpp"
    except (ImportError, ValueError):
        pass
    if src is None or not src.exists():
        pytest.skip("deepspeed's aio sources are not installed")
    import re
    names = set(re.findall(r'm\.def\(\s*"(\w+)"', src.read_text())) | {"aio_handle"}
    assert names and all(hasattr(pids.aio_op, n) for n in names), names
    t = torch.randn(3000)
    p = str(tmp_path / "m")
    assert pids.aio_op.aio_write(t, p, 1 << 20, 8, False, True, False) == 0
    u = torch.empty_like(t)
    assert pids.aio_op.aio_read(u, p, 1 << 20, 8, False, True, True) == 0 and torch.equal(t, u)
    v = torch.empty_like(t)
    assert pids.aio_op.deepspeed_memcpy(v, t) == 0 and torch.equal(v, t)


# ---------------------------------------------------------------------------------------------
# examples/deepspeed_backend_h200.py, as far as a CPU goes
# ---------------------------------------------------------------------------------------------
EXAMPLE = ROOT / "examples" / "deepspeed_backend_h200.py"


def run_example(args: List[str], timeout: int = 180) -> subprocess.CompletedProcess:
    env = _env()
    env.pop("DS_ACCELERATOR")  # the script sets it for its children from --device
    return subprocess.run([sys.executable, str(EXAMPLE), *args], cwd=str(ROOT), env=env, capture_output=True,
                          text=True, timeout=timeout)


def test_h200_example_dry_run_shows_each_configuration() -> None:
    r = run_example(["--dry-run", "--buffer-count", "9", "--nvme-dir", "/x/nv"])
    assert r.returncode == 0, r.stderr
    plan = json.loads(r.stdout)
    assert plan["model"]["hidden_size"] == 2048 and plan["model"]["num_hidden_layers"] == 22
    cfgs = plan["configs"]
    assert list(cfgs) == ["pyinf-cpu-nvme", "ds-cpu-nvme", "pyinf-nvme-nvme", "pyinf-nvme-nvme-fix"]
    for name, c in cfgs.items():
        zero = c["deepspeed_config"]["zero_optimization"]
        assert zero["stage"] == 3 and zero["offload_optimizer"]["device"] == "nvme"
        assert zero["offload_optimizer"]["nvme_path"] == f"/x/nv/{name}"
        assert zero["offload_param"]["device"] == c["params"]
        assert c["command"][-2:] == ["--child", name]
        assert c["deepspeed_config"]["optimizer"]["type"] == "AdamW"  # DeepSpeed's CPU Adam, as the baseline
    assert cfgs["ds-cpu-nvme"]["backend"] == "deepspeed" and cfgs["pyinf-cpu-nvme"]["backend"] == "pyinfinity"
    assert "nvme_path" not in cfgs["pyinf-cpu-nvme"]["deepspeed_config"]["zero_optimization"]["offload_param"]
    assert cfgs["pyinf-nvme-nvme"]["deepspeed_config"]["zero_optimization"]["offload_param"]["buffer_count"] == 9
    assert cfgs["pyinf-nvme-nvme-fix"]["sized"] and not cfgs["pyinf-nvme-nvme"]["sized"]
    sized = cfgs["pyinf-nvme-nvme-fix"]["deepspeed_config"]["zero_optimization"]["offload_param"]
    assert "buffer_count" not in sized and "buffer_size" not in sized  # size_nvme_offload chooses them
    r = run_example(["--dry-run", "--configs", "pyinf-cpu-nvme-pipe,ds-cpu-nvme-pipe,ds-cpu-nvme",
                     "--pipe-sub-group-size", "2e7"])
    assert r.returncode == 0, r.stderr
    cfgs = json.loads(r.stdout)["configs"]
    for name in ("pyinf-cpu-nvme-pipe", "ds-cpu-nvme-pipe"):
        zero = cfgs[name]["deepspeed_config"]["zero_optimization"]
        opt = zero["offload_optimizer"]
        assert opt["pipeline_read"] is opt["pipeline_write"] is True and opt["buffer_count"] == 12, opt
        assert zero["sub_group_size"] == 2 * 10 ** 7 and zero["offload_param"]["device"] == "cpu"
    plain = cfgs["ds-cpu-nvme"]["deepspeed_config"]["zero_optimization"]
    assert plain["offload_optimizer"]["pipeline_read"] is False and "sub_group_size" not in plain


def test_h200_example_rejects_bad_arguments() -> None:
    r = run_example(["--dry-run", "--configs", "pyinf-cpu-nvme,bogus"])
    assert r.returncode == 2 and "bogus" in r.stderr and "ds-cpu-nvme" in r.stderr
    r = run_example(["--dry-run", "--steps", "0"])
    assert r.returncode == 2 and "--steps" in r.stderr


def test_h200_example_runs_end_to_end_on_cpu(deepspeed_importable: None, tmp_path: Path) -> None:
    out = tmp_path / "r.json"
    r = run_example(["--device", "cpu", "--tiny", "--optimizer", "torch", "--steps", "3", "--seq", "32",
                     "--batch", "2", "--max-in-cpu", "0", "--pinned-budget-gib", "0.05",
                     "--configs", "pyinf-cpu-nvme,pyinf-nvme-nvme-fix,pyinf-cpu-nvme-pipe",
                     "--pipe-sub-group-size", "1e6", "--nvme-dir", str(tmp_path / "nv"), "--json", str(out)])
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    doc = json.loads(out.read_text())
    assert [x["config"] for x in doc["results"]] == ["pyinf-cpu-nvme", "pyinf-nvme-nvme-fix", "pyinf-cpu-nvme-pipe"]
    for x in doc["results"]:
        assert x["ok"] and x["tokens_per_s"] > 0 and len(x["step_s"]) == 3, x
        # forward + backward + step() make up each step; the waits are a part of it
        for i, total in enumerate(x["step_s"]):
            assert abs(sum(x["phase_s"][k][i] for k in ("forward", "backward", "step")) - total) < 0.01, x
            assert 0 < x["io_wait_s"]["wait"][i] <= total, x
            # each figure is rounded to 1 ms on its own: the sum of two may exceed the total by 1.5 ms
            assert x["io_wait_s"]["read"][i] + x["io_wait_s"]["write"][i] <= x["io_wait_s"]["wait"][i] + 1.6e-3, x
        assert set(x["phase_s_per_step"]) == {"forward", "backward", "step"}
        assert x["pyinfinity_io"]["swap_files"] > 0 and not x["pyinfinity_io"]["swap_files_not_through_pyinfinity"]
        assert "async_io" not in x["deepspeed_ops_loaded"]
    assert doc["loss_checks"] and doc["loss_checks"][0]["max_rel_loss_diff"] == 0.0
    assert "pyinf-nvme-nvme-fix | pyinfinity | nvme" in r.stdout and "tokens/s" in r.stdout
    assert not (tmp_path / "nv" / "pyinf-cpu-nvme").exists()  # swap files removed after each configuration
    fixed = doc["results"][1]
    assert any(line.startswith("offload_param.buffer_count") for line in fixed["sizing"])
    assert fixed["offload_param"]["buffer_size"] >= 4096 * 256  # the embedding's partition
    piped = doc["results"][2]
    assert piped["offload_optimizer"]["pipeline_read"] is True and piped["sub_group_size"] == 10 ** 6
    assert [c["max_rel_loss_diff"] for c in doc["loss_checks"]] == [0.0, 0.0]


def result_path(cfg: Dict[str, Any]) -> Path:
    """Where a worker writes its results: one file per rank when there are several."""
    out = Path(cfg["out"])
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        out = out.with_name(f"{out.stem}.rank{os.environ['RANK']}.json")
    return out


if __name__ == "__main__" and len(sys.argv) == 3 and sys.argv[1] == "--worker":
    _cfg = json.loads(Path(sys.argv[2]).read_text())
    _res = _worker(_cfg)
    result_path(_cfg).write_text(json.dumps(_res))
    if _cfg.get("hold_until"):  # keep the swap folder claimed until the test says so (bounded)
        _deadline = time.monotonic() + 120
        while not Path(_cfg["hold_until"]).exists() and time.monotonic() < _deadline:
            time.sleep(0.05)
    sys.exit(0)
