"""Every user path on a GPU (the GPU suite, ``make test-gpu``; all of it is skipped without a CUDA
device): `pyinfinity train` at `make train`'s GPU size; `train --model DIR --data FILE` on a
sharded checkpoint, exported, loaded by transformers with the engine's logits; `--save`, SIGKILL,
`--resume` bit-identical to an uninterrupted run; DeepSpeed with pyinfinity as its NVMe backend;
and the device budget at 1.1B under a 2 GiB cap over micro-batch x sequence shapes.

The command-line runs are subprocesses (a SIGKILL, DeepSpeed's process-global state, a clean
device per run); the budget grid and the fine-tune run in this process."""
from __future__ import annotations

import gc
import importlib.util
import json
import math
import os
import re
import signal
import socket
import subprocess
import sys
import textwrap
import time

import pytest
import torch

from tests.python.pretrained_dirs import CORPUS, make_model_dir

pytestmark = pytest.mark.gpu

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
GiB = 1 << 30

# `python -c` for a deterministic command-line run: the same kernels, the same sums, every run
DETERMINISTIC_CLI = ("import sys, torch; torch.use_deterministic_algorithms(True); "
                     "from pyinfinity.cli import main; sys.exit(main(sys.argv[1:]))")


def _env(**extra: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("LOCAL_RANK", "PYINFINITY_DEEPSPEED")}
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    env["CUBLAS_WORKSPACE_CONFIG"] = ":4096:8"
    env.update(extra)
    return env


def cli(*args: str, deterministic: bool = False, timeout: float = 600) -> subprocess.CompletedProcess:
    """``pyinfinity ARGS`` in a fresh process (with ``torch.use_deterministic_algorithms(True)``
    when ``deterministic``); fails the test on a non-zero exit."""
    prog = ["-c", DETERMINISTIC_CLI] if deterministic else ["-m", "pyinfinity"]
    p = subprocess.run([sys.executable, *prog, *args], capture_output=True, text=True,
                       timeout=timeout, cwd=ROOT, env=_env())
    assert p.returncode == 0, f"pyinfinity {' '.join(args)} exited {p.returncode}:\n{p.stderr[-6000:]}"
    return p


def makefile_gpu_args() -> list[str]:
    """TRAIN_ARGS_GPU from the Makefile: what `make train` runs on a GPU machine."""
    with open(os.path.join(ROOT, "Makefile")) as f:
        text = f.read().replace("\\\n", " ")
    m = re.search(r"^TRAIN_ARGS_GPU\s*\?=\s*(.*)$", text, re.M)
    assert m, "Makefile: no TRAIN_ARGS_GPU"
    return m.group(1).split()


def _flag(args: list[str], name: str, value: str) -> list[str]:
    out = list(args)
    out[out.index(name) + 1] = value
    return out


# ----------------------------------------------------------------------------- preset training
def test_make_train_gpu_size_trains_on_an_indexed_cuda_device_within_its_budget(tmp_path):
    """`make train`'s GPU flags, fewer steps: it trains on cuda:N, its weights exceed the budget,
    and the device never holds more than the budget."""
    from pyinfinity.config import parse_size

    args = _flag(makefile_gpu_args(), "--steps", "6")
    budget = parse_size(args[args.index("--gpu-memory") + 1], "--gpu-memory")
    cli("train", *args, "--no-progress", "--json", str(tmp_path / "run.json"))
    s = json.loads((tmp_path / "run.json").read_text())["summary"]
    assert re.fullmatch(r"cuda:\d+", s["device"]), s["device"]
    assert s["steps"] == 6 and s["param_bytes_compute"] > budget
    assert math.isfinite(s["first_loss"]) and math.isfinite(s["last_loss"])
    assert s["peak_device_allocated"] <= budget, (s["peak_device_allocated"], budget)


# ----------------------------------------------------------------- fine-tune, export, from_pretrained
def test_finetune_a_sharded_checkpoint_export_and_load_with_transformers(tmp_path, monkeypatch):
    """`train --model DIR --data FILE --export OUT` in fp32 on CUDA: transformers' own
    from_pretrained(OUT) gives the logits the engine gave at the end of training within 1e-5."""
    from transformers import AutoModelForCausalLM

    from pyinfinity.cli import main
    from pyinfinity.engine import Engine

    model_dir = make_model_dir(str(tmp_path / "model"), "llama", hidden=64, layers=2, shard="40KB")
    shards = [f for f in os.listdir(model_dir) if f.endswith(".safetensors")]
    assert len(shards) >= 3 and os.path.exists(os.path.join(model_dir, "model.safetensors.index.json"))
    data = tmp_path / "notes.txt"
    data.write_text(CORPUS)
    g = torch.Generator().manual_seed(3)
    x = torch.randint(0, 320, (2, 48), generator=g)
    seen: dict = {}
    export = Engine.export

    def export_after_eval(self, out_dir, **kw):  # the engine's eval logits, just before it exports
        self.eval()
        with torch.no_grad():
            seen["logits"] = self(input_ids=x).logits.float().cpu()  # a CPU batch: moved to the device
        self.train()
        seen["device"] = self.device
        return export(self, out_dir, **kw)

    monkeypatch.setattr(Engine, "export", export_after_eval)
    out = tmp_path / "out"
    rc = main(["train", "--model", model_dir, "--data", str(data), "--steps", "6", "--seq", "64", "--batch", "2",
               "--device", "cuda", "--dtype", "fp32", "--model-dtype", "fp32", "--offload", "cpu",
               "--gpu-memory", "256MiB", "--lr", "1e-3", "--no-progress", "--export", str(out),
               "--json", str(tmp_path / "run.json")])
    assert rc == 0
    assert seen["device"].type == "cuda" and seen["device"].index is not None
    summary = json.loads((tmp_path / "run.json").read_text())["summary"]
    assert summary["steps"] == 6 and summary["device"] == str(seen["device"])
    dev = seen["device"]
    loaded = AutoModelForCausalLM.from_pretrained(str(out), local_files_only=True).to(dev).eval()
    assert next(loaded.parameters()).dtype == torch.float32  # exported in fp32 (--model-dtype fp32)
    with torch.no_grad():
        got = loaded(input_ids=x.to(dev)).logits.float().cpu()
        before = AutoModelForCausalLM.from_pretrained(model_dir, local_files_only=True).to(dev).eval()(
            input_ids=x.to(dev)).logits.float().cpu()
    assert (got - before).abs().max() > 1e-3  # it trained: the export is not the checkpoint it started from
    torch.testing.assert_close(got, seen["logits"], rtol=0, atol=1e-5)


# ------------------------------------------------------------------------- save, SIGKILL, resume
RESUME_ARGS = ["train", "--model-size", "125m", "--steps", "30", "--seq", "256", "--batch", "4", "--device", "cuda",
               "--offload", "cpu", "--gpu-memory", "1GiB", "--corpus-bytes", "4MB", "--warmup", "4",
               "--lr", "1e-4", "--no-progress"]
SAVE_EVERY = 10


def _latest(ckpt) -> str:
    try:
        with open(os.path.join(ckpt, "latest")) as f:
            return f.read().strip()
    except OSError:
        return ""


def test_save_sigkill_resume_is_bit_identical_to_an_uninterrupted_run(tmp_path):
    """With deterministic algorithms: the run killed (-9) after its first checkpoint and resumed
    from it gives the uninterrupted run's step numbers, learning rates and losses, bit for bit."""
    whole = tmp_path / "whole"
    cli(*RESUME_ARGS, "--save", str(whole), "--save-every", str(SAVE_EVERY), "--json", str(tmp_path / "a.json"),
        deterministic=True)
    ckpt = tmp_path / "killed"
    log = open(tmp_path / "killed.log", "w")  # a file, not a pipe: the run never blocks on its output
    proc = subprocess.Popen([sys.executable, "-c", DETERMINISTIC_CLI, *RESUME_ARGS, "--save", str(ckpt),
                             "--save-every", str(SAVE_EVERY)], cwd=ROOT, env=_env(), stdout=log, stderr=log)
    try:
        deadline = time.monotonic() + 300
        while not _latest(ckpt) and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.005)
        proc.send_signal(signal.SIGKILL)  # mid-run: the first checkpoint is written, steps remain
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        log.close()
    assert proc.returncode == -signal.SIGKILL, (proc.returncode, (tmp_path / "killed.log").read_text()[-4000:])
    assert _latest(ckpt), "the killed run wrote no checkpoint"
    resumed = cli(*RESUME_ARGS, "--resume", str(ckpt), "--json", str(tmp_path / "b.json"), deterministic=True)
    assert "resumed" in resumed.stderr
    a = json.loads((tmp_path / "a.json").read_text())["steps"]
    b = json.loads((tmp_path / "b.json").read_text())["steps"]
    assert len(a) == 30 and 0 < len(b) < 30 and b[-1]["step"] == a[-1]["step"]
    tail = a[len(a) - len(b):]
    assert [(s["step"], repr(s["loss"]), repr(s["lr"])) for s in b] == \
        [(s["step"], repr(s["loss"]), repr(s["lr"])) for s in tail]
    assert len({repr(s["loss"]) for s in b}) > 1  # the loss really moves


# ------------------------------------------------------------------ DeepSpeed, pyinfinity backend
DS_WORKER = textwrap.dedent("""
    import json, os, sys
    import torch
    torch.use_deterministic_algorithms(True, warn_only=True)  # DeepSpeed's own ops: warn, never fail
    from pyinfinity.integrations import deepspeed as pids
    pids.install()
    import deepspeed

    spec = json.loads(sys.argv[1])
    H, LAYERS, BATCH = 1024, 4, 8
    nvme = spec["nvme"]
    zero = {"stage": 3, "offload_param": {"device": spec["param"], "pin_memory": True},
            "offload_optimizer": {"device": spec["optimizer"], "pin_memory": True},
            "stage3_param_persistence_threshold": 0, "stage3_prefetch_bucket_size": 2 * H * H,
            "stage3_max_live_parameters": 2 * H * H}
    for sec in ("offload_param", "offload_optimizer"):
        if zero[sec]["device"] == "nvme":
            zero[sec]["nvme_path"] = nvme
    conf = {"train_micro_batch_size_per_gpu": BATCH, "gradient_accumulation_steps": 1, "bf16": {"enabled": True},
            "zero_optimization": zero, "zero_force_ds_cpu_optimizer": False, "steps_per_print": 10 ** 6,
            "aio": {"block_size": 1048576, "queue_depth": 16, "intra_op_parallelism": 1, "single_submit": False,
                    "overlap_events": True}}
    if spec["size"]:  # the swap knobs left out: sized for this model by pyinfinity
        with torch.device("meta"):
            meta = torch.nn.Sequential(*[torch.nn.Linear(H, H, bias=False) for _ in range(LAYERS)])
        conf = pids.size_nvme_offload(conf, meta).config
    torch.manual_seed(0)
    with deepspeed.zero.Init(config_dict_or_path=conf):
        layers = []
        for _ in range(LAYERS):
            layers += [torch.nn.Linear(H, H, bias=False), torch.nn.GELU()]
        model = torch.nn.Sequential(*layers[:-1])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    eng, *_ = deepspeed.initialize(model=model, optimizer=opt, config=conf)
    assert str(eng.device).startswith("cuda"), eng.device
    g = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(4):
        x = torch.randn(BATCH, H, generator=g).to(eng.device, torch.bfloat16)
        y = torch.randn(BATCH, H, generator=g).to(eng.device)
        loss = ((eng(x).float() - y) ** 2).mean()
        eng.backward(loss)
        eng.step()
        losses.append(float.hex(loss.item()))
    files = sorted(os.path.join(d, f) for d, _, fs in os.walk(nvme) for f in fs
                   if not os.path.basename(d).startswith("pyinfinity-rank"))
    st = pids.stats()
    print("RESULT " + json.dumps({"losses": losses, "swap_files": files, "read": sorted(st.files_read),
                                  "written": sorted(st.files_written),
                                  "ds_aio_op": "deepspeed.ops.aio.async_io_op" in sys.modules}))
""")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_deepspeed_with_pyinfinity_as_its_nvme_backend(tmp_path):
    """DeepSpeed ZeRO-3 on CUDA with its swap I/O done by pyinfinity: the optimizer on NVMe
    (parameters on the GPU), and parameters and optimizer on NVMe (knobs sized by
    size_nvme_offload); every swap file written and read by pyinfinity, and the losses of the
    same run offloaded to CPU memory instead, bit for bit."""
    if importlib.util.find_spec("deepspeed") is None:
        pytest.skip("deepspeed is not installed")
    runs = {"gpu_params_cpu_opt": ("none", "cpu", False), "gpu_params_nvme_opt": ("none", "nvme", False),
            "cpu_all": ("cpu", "cpu", False), "nvme_all_sized": ("nvme", "nvme", True)}
    procs = {}
    for name, (param, optimizer, size) in runs.items():
        nvme = tmp_path / name
        nvme.mkdir()
        spec = {"param": param, "optimizer": optimizer, "size": size, "nvme": str(nvme)}
        env = _env(DS_ACCELERATOR="cuda", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()), RANK="0",
                   WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_SIZE="1")
        procs[name] = subprocess.Popen([sys.executable, "-c", DS_WORKER, json.dumps(spec)], cwd=ROOT, env=env,
                                       stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    out = {}
    for name, proc in procs.items():
        text, _ = proc.communicate(timeout=600)
        assert proc.returncode == 0, f"{name} exited {proc.returncode}:\n{text[-6000:]}"
        line = next(ln for ln in text.splitlines() if ln.startswith("RESULT "))
        out[name] = json.loads(line[len("RESULT "):])
    for name, ref in (("gpu_params_nvme_opt", "gpu_params_cpu_opt"), ("nvme_all_sized", "cpu_all")):
        r = out[name]
        assert r["swap_files"], f"{name}: nothing was swapped"
        assert set(r["swap_files"]) <= set(r["read"]) & set(r["written"]), name
        assert not r["ds_aio_op"], f"{name}: DeepSpeed's own aio op was loaded"
        assert len(set(out[ref]["losses"])) == 4, out[ref]["losses"]
        assert r["losses"] == out[ref]["losses"], (name, r["losses"], out[ref]["losses"])
    assert any("bfloat16params" in f for f in out["nvme_all_sized"]["swap_files"])  # parameters on NVMe too


# --------------------------------------------------------------------------- the device budget grid
CAP = 2 * GiB


# 4 x 1024 and 1 x 4096 cannot fit 2 GiB whatever stays on the host: transformers' loss alone holds
# about 14 bytes a logit at its backward peak (1.8 GB at 4096 tokens of a 32000 vocabulary)
MUST_TRAIN = {(1, 512), (1, 2048)}


@pytest.mark.parametrize("micro_batch,seq", [(1, 512), (1, 2048), (4, 1024), (1, 4096)])
def test_budget_grid_at_1_1b_under_2gib(micro_batch, seq):
    """bench's 1.1B Llama (random init under init_empty, bf16, checkpointed), 2 GiB device cap,
    parameters and optimizer in pinned RAM: never an out-of-memory error. A shape that fits trains
    two steps and the device never holds more than the cap; one that cannot fit even with nothing
    resident is refused at the first forward, before any step, in one line naming the largest that
    fits."""
    from pyinfinity.plan import PlanError

    from transformers import LlamaConfig, LlamaForCausalLM

    import pyinfinity
    from pyinfinity.bench.train import model_fields

    fields = model_fields("1.1b", seq)
    cfg = {"train_micro_batch_size_per_gpu": micro_batch, "gradient_accumulation_steps": 1,
           "bf16": {"enabled": True}, "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
           "zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"}, "offload_optimizer": {"device": "cpu"}},
           "pyinfinity": {"device": "cuda", "device_memory": CAP}}
    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    with pyinfinity.init_empty(cfg):
        model = LlamaForCausalLM(LlamaConfig(**fields, use_cache=False))
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    g = torch.Generator().manual_seed(0)
    losses = []
    refused = None
    with pyinfinity.initialize(model, cfg) as eng:
        dev = eng.device
        eng.train()
        try:
            for _ in range(2):
                x = torch.randint(0, fields["vocab_size"], (micro_batch, seq), generator=g)
                loss = eng(input_ids=x, labels=x).loss
                eng.backward(loss)
                eng.step()
                losses.append(float(loss))
        except PlanError as e:
            refused = str(e)
        eng.synchronize()
        peak = torch.cuda.max_memory_allocated(dev)
    del model, eng
    gc.collect()
    torch.cuda.empty_cache()
    if refused is not None:
        assert (micro_batch, seq) not in MUST_TRAIN, refused
        assert not losses and "\n" not in refused and "the largest that fits is" in refused, refused
        return
    assert all(v == v for v in losses), losses
    assert peak <= CAP, f"{micro_batch}x{seq}: peak {peak / GiB:.2f} GiB allocated, cap {CAP / GiB:.0f} GiB"
