"""What checkpoints cost a run: the same `pyinfinity train` run three ways, each in its own
interpreter: without saves, with `--save-every K --save-total-limit L` in the background (the
default), and the same with `--blocking-saves`. Llama 1.1B (TinyLlama's shape) in fp32 with the
fp32 optimizer state, 4 x 1024 tokens a step with activation checkpointing, under an 8 GiB device
cap by default; `--model-size tiny --device cpu` checks the script end to end on a CPU.

    python examples/ckpt_bench.py --out ckpt_bench.json

prints a table and writes it as JSON. Per way: the mean step time (the steps' own seconds, the
first WARMUP steps left out), the mean effective step time (the training loop's seconds a step, the
time training stopped for saves included) and its ratio to the run without saves; per save the
longest time training stopped for it (the save call, the copies steps took first, plus what the
next save waited for it), the mean time from the call to `latest` moved and then the removal of
the checkpoints `--save-total-limit` lets go, the bytes written and the shard copies a step took
first; the save directory's size at the end (the end-of-run save included) and the free disk a
run needs (`--save-total-limit` + 1 checkpoints: the newest is complete before the oldest goes).
Why a case cannot meet a ratio: per way with saves, the write rate (a checkpoint's bytes / the
mean time from the call to `latest`), and per background way the disk-bound floor of its ratio,
max(1, (mean save + removal seconds) / (save_every x the no-saves step seconds)): a save that takes longer
than the steps between saves makes training wait for the disk whatever the engine does. The JSON
holds every step's seconds of each way (`step_seconds`) besides.

`--offload-optimizer nvme` measures instead, in this interpreter, one engine with the optimizer
state on disk (ratio 1.0, `--nvme` the swap directory, the checkpoints beside it) saving the same
state both ways: a copy (`by_reference=False`) and by reference (the swap file linked, each
shard's slot held). Per way: the time the save call blocked, its total time to `latest`, the bytes
the checkpoint engine wrote, and the swap filesystem's used bytes before the save, after it and
after the next step (which writes every held shard into a fresh slot).

    python examples/ckpt_bench.py --offload-optimizer nvme --nvme /mnt/nvme/swap --model-size 125m"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
WARMUP = 2  # steps left out of the means (allocator and page-cache warm-up)
DEFAULT_WAYS = "no saves,background,blocking"


def run_way(way: str, args: argparse.Namespace, work: Path) -> dict:
    """One `pyinfinity train` run; its JSON, with the save directory's size and the wall time."""
    slug = way.replace(" ", "-")
    out, save = work / f"{slug}.json", work / f"ckpt-{slug}"
    cmd = [sys.executable, "-m", "pyinfinity", "train", "--model-size", args.model_size, "--steps", str(args.steps),
           "--seq", str(args.seq), "--batch", str(args.batch), "--dtype", "fp32", "--optimizer-state", args.optimizer_state,
           "--device", args.device, "--gpu-memory", args.gpu_memory, "--checkpoint-activations", "--no-progress",
           "--json", str(out)]
    if args.nvme:
        cmd += ["--nvme", args.nvme]
    if way != "no saves":
        cmd += ["--save", str(save), "--save-every", str(args.save_every), "--save-total-limit",
                str(args.save_total_limit)]
        if way == "blocking":
            cmd.append("--blocking-saves")
    t0 = time.perf_counter()
    p = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT,
                       env={**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")})
    wall = time.perf_counter() - t0
    if p.returncode:
        raise SystemExit(f"{way}: `{' '.join(cmd)}` failed (exit {p.returncode}):\n{p.stderr[-4000:]}")
    with open(out) as f:
        doc = json.load(f)
    disk = sum(f.stat().st_size for f in save.rglob("*") if f.is_file()) if save.exists() else 0
    shutil.rmtree(save, ignore_errors=True)
    return {"doc": doc, "disk_bytes": disk, "wall_s": wall}


def disk_floor(mean_save_s: float, save_every: int, base_step_s: float) -> float:
    """The lowest effective-step ratio background saves can reach when the disk is the limit:
    a save taking longer than the ``save_every`` steps between saves (``base_step_s`` each,
    without saves) makes the next one wait for it."""
    return max(1.0, mean_save_s / (save_every * base_step_s)) if base_step_s > 0 else 1.0


def summarize(way: str, res: dict, base: dict | None, save_every: int) -> dict:
    """One way's row: ``base`` is the no-saves row (None: this is it)."""
    seconds = [s["seconds"] for s in res["doc"]["steps"]]
    steps = seconds[WARMUP:]
    saves = res["doc"].get("saves", [])
    step_mean = sum(steps) / max(1, len(steps))
    loop = (sum(steps) + sum(s["blocked_s"] for s in saves if s["step"] > WARMUP)) / max(1, len(steps))
    loop_base = loop if base is None else base["effective_step_s"]
    ckpt = max((s["bytes"] for s in saves), default=0)
    mean_save = (sum(s["total_s"] or 0 for s in saves) / len(saves)) if saves else 0.0
    mean_rotate = (sum(s.get("rotate_s", 0.0) for s in saves) / len(saves)) if saves else 0.0
    return {
        "way": way, "steps": len(seconds), "step_s": step_mean, "effective_step_s": loop,
        "ratio": loop / loop_base if loop_base else None, "saves": len(saves),
        "max_blocked_s": max((s["blocked_s"] for s in saves), default=0.0),
        "mean_save_total_s": mean_save, "mean_rotate_s": mean_rotate, "bytes_written": sum(s["bytes"] for s in saves), "checkpoint_bytes": ckpt,
        "write_rate_bytes_s": ckpt / mean_save if saves and mean_save > 0 else None,
        "disk_floor_ratio": (disk_floor(mean_save + mean_rotate, save_every, base["step_s"])
                             if saves and base is not None and way != "blocking" else None),
        "copied_by_step": sum(s["copied_by_step"] for s in saves), "disk_at_end": res["disk_bytes"],
        "wall_s": res["wall_s"], "step_seconds": seconds, "saves_detail": saves,
    }


def table(rows: list[dict], args: argparse.Namespace) -> str:
    gb = 1e9
    head = (f"{'way':<11} {'steps':>5} {'step s':>8} {'eff. s':>8} {'ratio':>6} {'floor':>6} {'saves':>5} "
            f"{'max blocked s':>13} {'save s':>7} {'rot. s':>6} {'GB/s':>6} {'written GB':>10} {'disk GB':>8} "
            f"{'copied':>6}")
    lines = [head, "-" * len(head)]

    def opt(v: float | None, width: int, digits: int) -> str:
        return f"{v:>{width}.{digits}f}" if v is not None else f"{'-':>{width}}"
    for r in rows:
        rate = r["write_rate_bytes_s"] / gb if r["write_rate_bytes_s"] is not None else None
        lines.append(f"{r['way']:<11} {r['steps']:>5} {r['step_s']:>8.3f} {r['effective_step_s']:>8.3f} "
                     f"{r['ratio']:>6.3f} {opt(r['disk_floor_ratio'], 6, 3)} {r['saves']:>5} "
                     f"{r['max_blocked_s']:>13.3f} {r['mean_save_total_s']:>7.2f} {r['mean_rotate_s']:>6.2f} "
                     f"{opt(rate, 6, 2)} "
                     f"{r['bytes_written'] / gb:>10.2f} {r['disk_at_end'] / gb:>8.2f} {r['copied_by_step']:>6}")
    ck = max(r["checkpoint_bytes"] for r in rows)
    lines.append(f"one checkpoint {ck / gb:.2f} GB; free disk a run needs: {(args.save_total_limit + 1) * ck / gb:.2f} "
                 f"GB (--save-total-limit {args.save_total_limit} + 1 while the newest is written)")
    lines.append(f"GB/s: a checkpoint's bytes / the mean save time (to latest); rot. s: then removing the oldest; "
                 f"floor: the lowest ratio background saves reach when the disk is the limit, "
                 f"max(1, (save s + rot. s) / ({args.save_every} x the no-saves step s))")
    return "\n".join(lines)


def _disk_used(path: str) -> int:
    st = os.statvfs(path)
    return (st.f_blocks - st.f_bfree) * st.f_frsize


def nvme_case(args: argparse.Namespace) -> list[dict]:
    """The optimizer state on disk, saved as a copy and by reference (see the module doc)."""
    import torch
    from transformers import LlamaForCausalLM

    import pyinfinity
    from pyinfinity.cli.train import llama_config

    if args.optimizer_state == "bf16":
        raise SystemExit("--offload-optimizer nvme: measures fp32 or 8bit state (a bf16 state is `train`'s, "
                         "not this engine config's)")
    if not args.nvme:
        raise SystemExit("--offload-optimizer nvme: needs --nvme DIR (the swap directory; checkpoints go beside it)")
    ns = argparse.Namespace(model_size=args.model_size, hidden=None, layers=None, heads=None, intermediate=None,
                            seq=args.seq)
    torch.manual_seed(0)
    model = LlamaForCausalLM(llama_config(ns))
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})  # as the runs above
    cfg = {"train_micro_batch_size_per_gpu": args.batch,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
           "zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"},
                                 "offload_optimizer": {"device": "nvme", "nvme_path": args.nvme, "ratio": 1.0}},
           "pyinfinity": {"device": args.device if args.device != "auto" else "cpu",
                          "device_memory": args.gpu_memory, "optimizer_state": args.optimizer_state}}
    g = torch.Generator().manual_seed(1)
    vocab = model.config.vocab_size

    def step(eng) -> None:
        x = torch.randint(0, vocab, (args.batch, args.seq), generator=g)
        eng.backward(eng(input_ids=x, labels=x).loss)
        eng.step()
        eng.synchronize()
    save_root = os.path.join(os.path.dirname(os.path.abspath(args.nvme.rstrip("/"))), "ckpt_bench-saves")
    rows = []
    with pyinfinity.initialize(model, cfg) as eng:
        for _ in range(2):
            step(eng)
        ways = [w.strip() for w in args.ways.split(",")] if args.ways != DEFAULT_WAYS else ["copy", "by reference"]
        unknown = set(ways) - {"copy", "by reference"}
        if unknown:
            raise SystemExit(f"--offload-optimizer nvme: --ways takes copy and 'by reference', not {sorted(unknown)}")
        for way in ways:
            by_ref = way == "by reference"
            save = os.path.join(save_root, way.replace(" ", "-"))
            io = eng.state.checkpoint_io()
            written0 = io.stats()["write"]["bytes"]
            before = _disk_used(args.nvme)
            t0 = time.perf_counter()
            eng.save_checkpoint(save, blocking=False, by_reference=by_ref)
            blocked = time.perf_counter() - t0
            write = eng.wait_for_checkpoint()
            total = time.perf_counter() - t0
            after = _disk_used(args.nvme)
            step(eng)
            rows.append({"way": way, "blocked_s": blocked, "total_s": total,
                         "bytes_written": io.stats()["write"]["bytes"] - written0,
                         "by_reference_bytes": write.by_reference_bytes, "disk_before": before,
                         "disk_after_save": after, "disk_after_next_step": _disk_used(args.nvme)})
            shutil.rmtree(save, ignore_errors=True)
        state = sum(st.home.nbytes for st in eng.state.optimizer.states)
    shutil.rmtree(save_root, ignore_errors=True)
    mb = 1e6
    print(f"optimizer state on disk: {state / mb:.1f} MB ({args.model_size}); disk used (MB) on the swap filesystem")
    head = (f"{'way':<13} {'blocked s':>9} {'total s':>8} {'written MB':>10} {'before':>9} {'after save':>10} "
            f"{'after step':>10}")
    print(head)
    print("-" * len(head))
    for r in rows:
        print(f"{r['way']:<13} {r['blocked_s']:>9.3f} {r['total_s']:>8.3f} {r['bytes_written'] / mb:>10.1f} "
              f"{r['disk_before'] / mb:>9.1f} {r['disk_after_save'] / mb:>10.1f} "
              f"{r['disk_after_next_step'] / mb:>10.1f}")
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model-size", default="1.1b", help="a preset of `pyinfinity train` (tiny on a CPU)")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--save-every", type=int, default=5)
    p.add_argument("--save-total-limit", type=int, default=2)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--device", default="auto")
    p.add_argument("--gpu-memory", default="8GiB")
    p.add_argument("--nvme", help="swap directory, if the planner puts state on NVMe")
    p.add_argument("--dir", help="where the checkpoints go (default: a temporary directory; its disk is the one "
                                  "measured)")
    p.add_argument("--ways", default=DEFAULT_WAYS, help="which runs, of 'no saves,background,blocking' (the first "
                   "must be 'no saves'); with --offload-optimizer nvme, of 'copy,by reference' (a copy of a large "
                   "state needs its size free beside the swap file)")
    p.add_argument("--optimizer-state", default="fp32", choices=["fp32", "8bit", "bf16"],
                   help="the optimizer state's format (`pyinfinity train --optimizer-state`)")
    p.add_argument("--offload-optimizer", choices=["nvme"], help="measure one engine with the optimizer state on "
                   "--nvme instead: a copy save against a by-reference save (module doc)")
    p.add_argument("--out", default="ckpt_bench.json")
    args = p.parse_args(argv)
    if args.offload_optimizer == "nvme":
        rows = nvme_case(args)
        with open(args.out, "w") as f:
            json.dump({"args": vars(args), "rows": rows}, f, indent=1)
        print(f"json: {args.out}")
        return 0
    ways = [w.strip() for w in args.ways.split(",")]
    if ways[0] != "no saves":
        raise SystemExit("--ways: the first must be 'no saves' (the ratios' base)")
    rows = []
    with tempfile.TemporaryDirectory(dir=args.dir, prefix="ckpt_bench-") as d:
        base = None
        for way in ways:
            res = run_way(way, args, Path(d))
            row = summarize(way, res, base, args.save_every)
            if base is None:
                base = row
                row["ratio"] = 1.0
            rows.append(row)
            print(f"{way}: done in {res['wall_s']:.0f} s", file=sys.stderr, flush=True)
    print(table(rows, args))
    with open(args.out, "w") as f:
        json.dump({"args": vars(args), "rows": rows}, f, indent=1)
    print(f"json: {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
