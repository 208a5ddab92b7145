"""DeepSpeed ZeRO-3 NVMe offload with pyinfinity's I/O backend vs DeepSpeed's own aio, on one GPU.

The model and budget of the ZeRO-3 baseline measured on one H200 SXM (Llama architecture,
hidden 2048, 22 layers, ~1.1B parameters, bf16, batch 4 x 1024 tokens, gradient checkpointing,
GPU memory capped at 8 GiB). Each configuration runs in its own process (DeepSpeed's state is
process-global); results go to a table on stdout and to JSON (written after every configuration,
so a job cut short keeps what it finished):

    pyinf-cpu-nvme        params cpu,  optimizer nvme, pyinfinity.integrations.deepspeed.install()
    ds-cpu-nvme           params cpu,  optimizer nvme, DeepSpeed's own async_io op (libaio, JIT-built)
    pyinf-nvme-nvme       params nvme, optimizer nvme, pyinfinity (install() also patches
                          DeepSpeed's parameter swapper: see docs/deepspeed.md)
    pyinf-nvme-nvme-fix   the same with the swap knobs sized by
                          pyinfinity.integrations.deepspeed.size_nvme_offload() (buffer_count and
                          buffer_size from --pinned-budget-gib; the reuse/live/prefetch limits fit
                          to the buffers)
    ds-nvme-nvme, ds-nvme-nvme-fix: DeepSpeed's own aio and swapper, both on nvme (not in the
                          default set; "-fix" sizes the knobs, DeepSpeed's swapper stays unpatched)
    pyinf-cpu-nvme-pipe, ds-cpu-nvme-pipe: params cpu, optimizer nvme with DeepSpeed's pipelined
                          optimizer swapper (pipeline_read + pipeline_write: the next sub-group is
                          read and the previous one written while one steps), sub_group_size
                          --pipe-sub-group-size, offload_optimizer.buffer_count at least 12

Each row splits a step into forward, backward and engine.step() (device synchronised before each
timer is read) and, for pyinfinity's rows, the seconds DeepSpeed was blocked in the handle's
waits (read / write; pyinfinity.integrations.deepspeed.stats()). DeepSpeed's own aio handle is
not instrumented: its rows say "n/a" there.

    python examples/deepspeed_backend_h200.py --json results.json
    python examples/deepspeed_backend_h200.py --dry-run          # configs and commands, runs nothing
    python examples/deepspeed_backend_h200.py --device cpu --tiny --optimizer torch \\
        --configs pyinf-nvme-nvme                                # a CPU smoke test of this script

It needs DeepSpeed and libaio-dev on the GPU machine (docs/deepspeed.md, "Measuring on a GPU
machine"). If DeepSpeed's async_io op cannot be built, its row records the build error and the
other rows still run.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

RESULT_PREFIX = "RESULT "


@dataclass(frozen=True)
class RunConfig:
    backend: str                # "pyinfinity" | "deepspeed"
    params: str                 # offload_param.device: "cpu" | "nvme"
    optimizer: str              # offload_optimizer.device: "cpu" | "nvme"
    sized: bool = False         # pyinfinity.integrations.deepspeed.size_nvme_offload() on the config
    pipeline: bool = False      # DeepSpeed's pipelined optimizer swapper (pipeline_read + pipeline_write)


CONFIGS: Dict[str, RunConfig] = {
    "pyinf-cpu-nvme": RunConfig("pyinfinity", "cpu", "nvme"),
    "ds-cpu-nvme": RunConfig("deepspeed", "cpu", "nvme"),
    "pyinf-nvme-nvme": RunConfig("pyinfinity", "nvme", "nvme"),
    "pyinf-nvme-nvme-fix": RunConfig("pyinfinity", "nvme", "nvme", sized=True),
    "ds-nvme-nvme": RunConfig("deepspeed", "nvme", "nvme"),
    "ds-nvme-nvme-fix": RunConfig("deepspeed", "nvme", "nvme", sized=True),
    "pyinf-cpu-nvme-pipe": RunConfig("pyinfinity", "cpu", "nvme", pipeline=True),
    "ds-cpu-nvme-pipe": RunConfig("deepspeed", "cpu", "nvme", pipeline=True),
}
PIPELINE_BUFFERS = 12  # 4 per sub-group (fp32, exp_avg, exp_avg_sq, gradient) x (current, read ahead, write behind)
PHASES = ("forward", "backward", "step")
DEFAULT_CONFIGS = ("pyinf-cpu-nvme", "ds-cpu-nvme", "pyinf-nvme-nvme", "pyinf-nvme-nvme-fix")


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--configs", default=",".join(DEFAULT_CONFIGS),
                    help=f"comma-separated, from {', '.join(CONFIGS)} (default: %(default)s)")
    ap.add_argument("--steps", type=int, default=5, help="training steps per configuration (first 2 are warm-up)")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=22)
    ap.add_argument("--cap-gib", type=float, default=8.0, help="GPU memory cap (0: none)")
    ap.add_argument("--nvme-dir", default="/tmp/pyinf_ds_nvme", help="swap folder (one subfolder per configuration)")
    ap.add_argument("--keep-nvme", action="store_true", help="keep the swap files after each configuration")
    ap.add_argument("--buffer-count", type=int, default=6, help="offload_param.buffer_count (params on nvme)")
    ap.add_argument("--buffer-size", type=float, default=1.5e8, help="offload_param.buffer_size, elements")
    ap.add_argument("--max-in-cpu", type=float, default=1e9, help="offload_param.max_in_cpu, elements")
    ap.add_argument("--pinned-budget-gib", type=float, default=8.0,
                    help="-fix configurations: pinned RAM for the parameter swap buffers (size_nvme_offload "
                         "chooses buffer_count and buffer_size from it; --buffer-count/--buffer-size are left out)")
    ap.add_argument("--prefetch-bucket-size", type=float, default=5e7,
                    help="stage3_prefetch_bucket_size (0 turns ZeRO-3 prefetch, nvme prefetch included, off)")
    ap.add_argument("--no-grad-ckpt", action="store_true", help="no gradient checkpointing")
    ap.add_argument("--pipeline", action="store_true", help="offload_optimizer pipeline_read/pipeline_write")
    ap.add_argument("--optimizer-buffer-count", type=int, default=4, help="offload_optimizer.buffer_count")
    ap.add_argument("--pipe-sub-group-size", type=float, default=1e8,
                    help="zero_optimization.sub_group_size of the -pipe configurations (DeepSpeed's 1e9 leaves "
                         "the 1.1B model two sub-groups: little to read ahead; 12 buffers of 1e8 fp32 = 4.8 GB pinned)")
    ap.add_argument("--optimizer", choices=["ds", "torch"], default="ds",
                    help="ds: DeepSpeed's CPU Adam from the config (as the baseline); torch: torch.optim.AdamW")
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda",
                    help="cpu: DS_ACCELERATOR=cpu, gloo, for a smoke test of this script")
    ap.add_argument("--tiny", action="store_true", help="a small Llama (smoke tests)")
    ap.add_argument("--timeout", type=float, default=1800, help="seconds per configuration")
    ap.add_argument("--json", "--out", dest="out", default="deepspeed_backend_h200.json",
                    help="the JSON result (rewritten after every configuration)")
    ap.add_argument("--log-dir", default=None, help="per-configuration logs (default: beside --out)")
    ap.add_argument("--dry-run", action="store_true", help="print configurations and commands; run nothing")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    names = [n.strip() for n in a.configs.split(",") if n.strip()]
    unknown = [n for n in names if n not in CONFIGS]
    if unknown or not names:
        ap.error(f"--configs: unknown {unknown or names}; choose from {', '.join(CONFIGS)}")
    a.config_names = names
    if a.steps < 1:
        ap.error("--steps: must be >= 1")
    return a


def model_config(a: argparse.Namespace) -> Dict[str, Any]:
    """LlamaConfig keyword arguments (the baseline's model, or a tiny one)."""
    if a.tiny:
        return dict(vocab_size=4096, hidden_size=256, intermediate_size=704, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
    return dict(vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_hidden_layers=a.layers,
                num_attention_heads=32, num_key_value_heads=4, max_position_embeddings=2048)


def ds_config(cfg: RunConfig, a: argparse.Namespace, nvme_path: str) -> Dict[str, Any]:
    """The DeepSpeed JSON of one configuration (the baseline's, with the placement of `cfg`)."""
    zero: Dict[str, Any] = {
        "stage": 3,
        "offload_param": {"device": cfg.params, "pin_memory": True},
        "offload_optimizer": {"device": cfg.optimizer, "pin_memory": True},
        "stage3_prefetch_bucket_size": a.prefetch_bucket_size, "stage3_max_live_parameters": 1e8,
        "stage3_param_persistence_threshold": 1e5,
    }
    if cfg.params == "nvme":
        zero["offload_param"].update(nvme_path=nvme_path, max_in_cpu=a.max_in_cpu)
        if not cfg.sized:  # size_nvme_offload chooses these from the budget
            zero["offload_param"].update(buffer_count=a.buffer_count, buffer_size=a.buffer_size)
    if cfg.optimizer == "nvme":
        pipeline = a.pipeline or cfg.pipeline
        zero["offload_optimizer"].update(nvme_path=nvme_path, pipeline_read=pipeline, pipeline_write=pipeline,
                                         buffer_count=max(a.optimizer_buffer_count, PIPELINE_BUFFERS if pipeline else 0))
        if cfg.pipeline:
            zero["sub_group_size"] = int(a.pipe_sub_group_size)
    conf: Dict[str, Any] = {
        "train_micro_batch_size_per_gpu": a.batch, "gradient_accumulation_steps": 1, "bf16": {"enabled": True},
        "zero_optimization": zero,
        "aio": {"block_size": 1048576, "queue_depth": 32, "intra_op_parallelism": 4, "single_submit": False,
                "overlap_events": True},
        "steps_per_print": 10 ** 6,
    }
    if a.optimizer == "ds":
        conf["optimizer"] = {"type": "AdamW", "params": {"lr": 1e-4}}
    else:
        conf["zero_force_ds_cpu_optimizer"] = False
    return conf


# -- the child: one configuration ---------------------------------------------------------------------
def run_child(name: str, a: argparse.Namespace) -> Dict[str, Any]:
    cfg = CONFIGS[name]
    nvme = os.path.join(a.nvme_dir, name)
    res: Dict[str, Any] = {"config": name, **asdict(cfg), "steps": a.steps,
                           "tokens_per_step": a.batch * a.seq, "ok": False}
    cuda = a.device == "cuda"
    t_start = time.perf_counter()
    try:
        import torch

        if cuda:
            total = torch.cuda.get_device_properties(0).total_memory
            if a.cap_gib > 0:
                torch.cuda.set_per_process_memory_fraction(min(1.0, a.cap_gib * 2 ** 30 / total))
            res["gpu"] = torch.cuda.get_device_name(0)
        if cfg.backend == "pyinfinity":
            from pyinfinity.integrations import deepspeed as pids

            pids.install()
        import deepspeed
        from deepspeed.ops.op_builder import AsyncIOBuilder, CPUAdamBuilder
        from transformers import LlamaConfig, LlamaForCausalLM  # before zero.Init patches torch.Tensor


        res["deepspeed"] = deepspeed.__version__
        if not cuda:  # one CPU process talks gloo; don't JIT-build the shared-memory comm op
            deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
        # Build DeepSpeed's ops up front, so build time and build errors are reported apart.
        builds: Dict[str, float] = {}
        if a.optimizer == "ds":
            t = time.perf_counter()
            CPUAdamBuilder().load(verbose=False)
            builds["cpu_adam"] = round(time.perf_counter() - t, 1)
        if cfg.backend == "deepspeed":
            b = AsyncIOBuilder()
            if not b.is_compatible(verbose=True):
                raise RuntimeError(f"DeepSpeed's async_io op is not compatible here (libaio missing?): {b.error_log}")
            t = time.perf_counter()
            try:
                b.load(verbose=True)
            except Exception as exc:
                raise RuntimeError(f"DeepSpeed's async_io op failed to build: {exc}") from exc
            builds["async_io"] = round(time.perf_counter() - t, 1)
        res["op_build_s"] = builds

        conf = ds_config(cfg, a, nvme)
        if cfg.sized:
            from pyinfinity.integrations.deepspeed import size_nvme_offload

            sizing = size_nvme_offload(conf, LlamaConfig(**model_config(a)),
                                       pinned_budget_bytes=int(a.pinned_budget_gib * 2 ** 30))
            conf = sizing.config
            res["sizing"] = sizing.changes
            for line in sizing.changes:
                print(f"size_nvme_offload: {line}", flush=True)
        res["offload_param"] = conf["zero_optimization"]["offload_param"]
        res["offload_optimizer"] = conf["zero_optimization"]["offload_optimizer"]
        res["sub_group_size"] = conf["zero_optimization"].get("sub_group_size", "DeepSpeed's default (1e9)")
        os.makedirs(nvme, exist_ok=True)
        t = time.perf_counter()
        torch.manual_seed(0)  # same initial weights in every configuration: losses are comparable
        with deepspeed.zero.Init(config_dict_or_path=conf):
            model = LlamaForCausalLM(LlamaConfig(**model_config(a)))
        if not a.no_grad_ckpt:
            model.gradient_checkpointing_enable()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4) if a.optimizer == "torch" else None
        eng, *_ = deepspeed.initialize(model=model, model_parameters=None if opt else model.parameters(),
                                       optimizer=opt, config=conf)
        res["init_s"] = round(time.perf_counter() - t, 1)
        res["params_b"] = round(sum(getattr(p, "ds_numel", p.numel()) for p in model.parameters()) / 1e9, 3)

        dev = eng.device
        vocab = model_config(a)["vocab_size"]
        g = torch.Generator().manual_seed(0)
        times: List[float] = []
        losses: List[float] = []
        phases: Dict[str, List[float]] = {k: [] for k in PHASES}
        io_wait: Dict[str, List[float]] = {"wait": [], "read": [], "write": []}

        def mark() -> float:
            if cuda:
                torch.cuda.synchronize()
            return time.perf_counter()

        for _ in range(a.steps):
            x = torch.randint(0, vocab, (a.batch, a.seq), generator=g).to(dev)
            io0 = pids.stats() if cfg.backend == "pyinfinity" else None
            t0 = mark()
            loss = eng(input_ids=x, labels=x).loss
            t1 = mark()
            eng.backward(loss)
            t2 = mark()
            eng.step()
            t3 = mark()
            losses.append(loss.item())
            times.append(t3 - t0)
            for k, v in zip(PHASES, (t1 - t0, t2 - t1, t3 - t2)):
                phases[k].append(round(v, 3))
            if io0 is not None:
                io1 = pids.stats()
                for k, attr in (("wait", "wait_s"), ("read", "read_wait_s"), ("write", "write_wait_s")):
                    io_wait[k].append(round(getattr(io1, attr) - getattr(io0, attr), 3))
        steady = times[2:] if len(times) > 2 else times
        s_per_step = sum(steady) / len(steady)
        first = 2 if len(times) > 2 else 0

        def mean(v: List[float]) -> float:
            return round(sum(v[first:]) / len(v[first:]), 3)

        res.update(step_s=[round(v, 3) for v in times], s_per_step=round(s_per_step, 3),
                   steps_per_s=round(1 / s_per_step, 4), tokens_per_s=round(a.batch * a.seq / s_per_step, 1),
                   losses=losses, phase_s=phases, phase_s_per_step={k: mean(v) for k, v in phases.items()}, ok=True)
        if cfg.backend == "pyinfinity":
            res.update(io_wait_s=io_wait, io_wait_s_per_step={k: mean(v) for k, v in io_wait.items()})
        else:
            res["io_wait_s"] = "n/a: DeepSpeed's own aio handle is not instrumented"
        if cuda:
            res["peak_gpu_gib"] = round(torch.cuda.max_memory_allocated() / 2 ** 30, 2)
            res["peak_gpu_reserved_gib"] = round(torch.cuda.max_memory_reserved() / 2 ** 30, 2)
        from deepspeed.ops.op_builder.builder import OpBuilder

        res["deepspeed_ops_loaded"] = sorted(OpBuilder._loaded_ops)
        if cfg.backend == "pyinfinity":
            st = pids.stats()
            swap_files = {str(p) for p in Path(nvme).rglob("*")  # not pyinfinity's lock/manifest per rank
                          if p.is_file() and not p.parent.name.startswith("pyinfinity-rank")}
            res["pyinfinity_io"] = {
                "handles": st.handles, "reads": st.reads, "writes": st.writes,
                "gb_read": round(st.bytes_read / 1e9, 2), "gb_written": round(st.bytes_written / 1e9, 2),
                "wait_calls": st.wait_calls, "wait_s": round(st.wait_s, 2),
                "read_wait_s": round(st.read_wait_s, 2), "write_wait_s": round(st.write_wait_s, 2),
                "swap_files": len(swap_files),
                "swap_files_not_through_pyinfinity": sorted(swap_files - st.files_written)[:10],
            }
    except Exception as exc:  # noqa: BLE001 - every failure becomes a row of the table
        import traceback

        traceback.print_exc()
        msg = str(exc).strip().splitlines()
        res["error"] = f"{type(exc).__name__}: {' | '.join(msg)[:600]}"
        if "out of memory" in res["error"].lower():
            res["error"] = "OOM: " + res["error"][:300]
    res["wall_s"] = round(time.perf_counter() - t_start, 1)
    return res


# -- the parent: one process per configuration -------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def child_command(name: str, argv: Sequence[str]) -> List[str]:
    return [sys.executable, os.path.abspath(__file__), *argv, "--child", name]


def child_env(a: argparse.Namespace) -> Dict[str, str]:
    env = dict(os.environ)
    repo = str(Path(__file__).resolve().parents[1])
    env["PYTHONPATH"] = repo + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env.update(MASTER_ADDR=env.get("MASTER_ADDR", "127.0.0.1"), MASTER_PORT=str(_free_port()),
               RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", PYTHONUNBUFFERED="1")
    env.pop("PYINFINITY_DEEPSPEED", None)  # the child installs pyinfinity explicitly, or not at all
    if a.device == "cpu":
        env["DS_ACCELERATOR"] = "cpu"
    return env


def parse_result(output: str) -> Optional[Dict[str, Any]]:
    for line in reversed(output.splitlines()):
        if line.startswith(RESULT_PREFIX):
            return json.loads(line[len(RESULT_PREFIX):])
    return None


def run_config(name: str, a: argparse.Namespace, argv: Sequence[str], log_dir: Path) -> Dict[str, Any]:
    log_path = log_dir / f"{name}.log"
    t = time.perf_counter()
    with open(log_path, "w") as log:
        try:
            proc = subprocess.run(child_command(name, argv), env=child_env(a), stdout=log, stderr=subprocess.STDOUT,
                                  timeout=a.timeout)
            rc: Any = proc.returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
    output = log_path.read_text(errors="replace")
    res = parse_result(output)
    if res is None:
        res = {"config": name, **asdict(CONFIGS[name]), "ok": False,
               "error": f"no result (exit {rc}); log tail: {output[-800:]}"}
    res["exit"] = rc
    res["log"] = str(log_path)
    res.setdefault("wall_s", round(time.perf_counter() - t, 1))
    if not a.keep_nvme:
        shutil.rmtree(os.path.join(a.nvme_dir, name), ignore_errors=True)
    return res


def compare_losses(results: List[Dict[str, Any]]) -> List[Dict[str, Any]]:
    """Every configuration trains the same model from the same seed on the same tokens, so each
    successful run's losses are compared with the first successful run's (expected: equal)."""
    ok = [r for r in results if r.get("ok")]
    out = []
    for other in ok[1:]:
        a, b = ok[0]["losses"], other["losses"]
        rel = max(abs(x - y) / max(abs(x), 1e-30) for x, y in zip(a, b))
        out.append({"runs": [ok[0]["config"], other["config"]], "max_rel_loss_diff": rel})
    return out


def table(results: List[Dict[str, Any]]) -> str:
    head = ["config", "backend", "params", "optim", "s/step", "fwd s", "bwd s", "step() s", "I/O wait s (r/w)",
            "steps/s", "tokens/s", "peak GPU GiB", "note"]
    rows = [head]
    for r in results:
        note = r.get("error", "")
        if r.get("ok") and "pyinfinity_io" in r:
            io = r["pyinfinity_io"]
            note = f"pyinfinity I/O: {io['gb_read']} GB read, {io['gb_written']} GB written"
        ph = r.get("phase_s_per_step") or {}
        w = r.get("io_wait_s_per_step")
        wait = (f"{w['wait']:.2f} ({w['read']:.2f}/{w['write']:.2f})" if w else
                "n/a (DeepSpeed aio)" if r.get("ok") else "-")
        rows.append([r["config"], r["backend"], r["params"], r["optimizer"],
                     f"{r['s_per_step']:.2f}" if r.get("ok") else "-",
                     *(f"{ph[k]:.2f}" if k in ph else "-" for k in PHASES), wait,
                     f"{r['steps_per_s']:.3f}" if r.get("ok") else "-",
                     f"{r['tokens_per_s']:,.0f}" if r.get("ok") else "-",
                     f"{r['peak_gpu_gib']:.2f}" if r.get("peak_gpu_gib") is not None else "-",
                     note[:120]])
    widths = [max(len(str(row[i])) for row in rows) for i in range(len(head))]
    lines = [" | ".join(str(c).ljust(w) for c, w in zip(row, widths)) for row in rows]
    lines.insert(1, "-+-".join("-" * w for w in widths))
    return "\n".join(lines)


def plan(a: argparse.Namespace, argv: Sequence[str]) -> Dict[str, Any]:
    """What a run would do: per configuration its DeepSpeed JSON and child command."""
    return {"model": model_config(a), "configs": {
        n: {**asdict(CONFIGS[n]), "deepspeed_config": ds_config(CONFIGS[n], a, os.path.join(a.nvme_dir, n)),
            "command": child_command(n, argv)} for n in a.config_names}}


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    a = parse_args(argv)
    if a.child:
        print(RESULT_PREFIX + json.dumps(run_child(a.child, a)), flush=True)
        return 0
    if a.dry_run:
        print(json.dumps(plan(a, argv), indent=1))
        return 0
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    log_dir = Path(a.log_dir) if a.log_dir else out.parent / (out.stem + "_logs")
    log_dir.mkdir(parents=True, exist_ok=True)
    results: List[Dict[str, Any]] = []
    doc: Dict[str, Any] = {"args": {k: v for k, v in vars(a).items() if k != "child"}, "model": model_config(a)}
    for name in a.config_names:
        print(f"== {name} ...", flush=True)
        r = run_config(name, a, argv, log_dir)
        results.append(r)
        print(f"   {'ok' if r.get('ok') else 'FAILED'} in {r.get('wall_s')} s"
              + (f": {r.get('error')}" if not r.get("ok") else f", {r.get('tokens_per_s')} tokens/s"), flush=True)
        doc.update(results=results, loss_checks=compare_losses(results))
        out.write_text(json.dumps(doc, indent=1))
    print(table(results))
    print("fwd/bwd/step() s: steady-state seconds per step in forward, backward and engine.step(); I/O wait: "
          "seconds per step DeepSpeed was blocked in pyinfinity's handle (reads/writes; the rest waited for both); "
          "n/a: DeepSpeed's own aio handle is not instrumented")
    for c in doc.get("loss_checks", []):
        print(f"losses {c['runs'][0]} vs {c['runs'][1]}: max relative difference {c['max_rel_loss_diff']:.2e}")
    print(f"results: {out}")
    return 0 if all(r.get("ok") for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
