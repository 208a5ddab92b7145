"""What checkpoints cost a run: the same `pyinfinity train` run three ways, each in its own
interpreter: without saves, with `--save-every K --save-total-limit L` in the background (the
default), and the same with `--blocking-saves`. Llama 1.1B (TinyLlama's shape) in fp32 with the
fp32 optimizer state, 4 x 1024 tokens a step with activation checkpointing, under an 8 GiB device
cap by default; `--model-size tiny --device cpu` checks the script end to end on a CPU.

    python examples/ckpt_bench.py --out ckpt_bench.json

prints a table and writes it as JSON. Per way: the mean step time (the steps' own seconds, the
first WARMUP steps left out), the mean effective step time (the training loop's seconds a step, the
time training stopped for saves included) and its ratio to the run without saves; per save the
longest time training stopped for it (the save call, plus what the next save waited for it), the
mean time from the call to `latest` moved, the bytes written and the shard copies a step took
first; the save directory's size at the end (the end-of-run save included) and the free disk a
run needs (`--save-total-limit` + 1 checkpoints: the newest is complete before the oldest goes)."""
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


def run_way(way: str, args: argparse.Namespace, work: Path) -> dict:
    """One `pyinfinity train` run; its JSON, with the save directory's size and the wall time."""
    slug = way.replace(" ", "-")
    out, save = work / f"{slug}.json", work / f"ckpt-{slug}"
    cmd = [sys.executable, "-m", "pyinfinity", "train", "--model-size", args.model_size, "--steps", str(args.steps),
           "--seq", str(args.seq), "--batch", str(args.batch), "--dtype", "fp32", "--optimizer-state", "fp32",
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


def summarize(way: str, res: dict, base_step: float | None) -> dict:
    steps = [s["seconds"] for s in res["doc"]["steps"]][WARMUP:]
    saves = res["doc"].get("saves", [])
    step_mean = sum(steps) / max(1, len(steps))
    loop = (sum(steps) + sum(s["blocked_s"] for s in saves if s["step"] > WARMUP)) / max(1, len(steps))
    loop_base = loop if base_step is None else base_step
    ckpt = max((s["bytes"] for s in saves), default=0)
    return {
        "way": way, "steps": len(res["doc"]["steps"]), "step_s": step_mean, "effective_step_s": loop,
        "ratio": loop / loop_base if loop_base else None, "saves": len(saves),
        "max_blocked_s": max((s["blocked_s"] for s in saves), default=0.0),
        "mean_save_total_s": (sum(s["total_s"] or 0 for s in saves) / len(saves)) if saves else 0.0,
        "bytes_written": sum(s["bytes"] for s in saves), "checkpoint_bytes": ckpt,
        "copied_by_step": sum(s["copied_by_step"] for s in saves), "disk_at_end": res["disk_bytes"],
        "wall_s": res["wall_s"], "saves_detail": saves,
    }


def table(rows: list[dict], args: argparse.Namespace) -> str:
    gb = 1e9
    head = (f"{'way':<11} {'steps':>5} {'step s':>8} {'eff. s':>8} {'ratio':>6} {'saves':>5} {'max blocked s':>13} "
            f"{'save s':>7} {'written GB':>10} {'disk GB':>8} {'copied':>6}")
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(f"{r['way']:<11} {r['steps']:>5} {r['step_s']:>8.3f} {r['effective_step_s']:>8.3f} "
                     f"{r['ratio']:>6.3f} {r['saves']:>5} {r['max_blocked_s']:>13.3f} {r['mean_save_total_s']:>7.2f} "
                     f"{r['bytes_written'] / gb:>10.2f} {r['disk_at_end'] / gb:>8.2f} {r['copied_by_step']:>6}")
    ck = max(r["checkpoint_bytes"] for r in rows)
    lines.append(f"one checkpoint {ck / gb:.2f} GB; free disk a run needs: {(args.save_total_limit + 1) * ck / gb:.2f} "
                 f"GB (--save-total-limit {args.save_total_limit} + 1 while the newest is written)")
    return "\n".join(lines)


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
    p.add_argument("--ways", default="no saves,background,blocking")
    p.add_argument("--out", default="ckpt_bench.json")
    args = p.parse_args(argv)
    ways = [w.strip() for w in args.ways.split(",")]
    if ways[0] != "no saves":
        raise SystemExit("--ways: the first must be 'no saves' (the ratios' base)")
    rows = []
    with tempfile.TemporaryDirectory(dir=args.dir, prefix="ckpt_bench-") as d:
        base = None
        for way in ways:
            res = run_way(way, args, Path(d))
            row = summarize(way, res, base)
            if base is None:
                base = row["effective_step_s"]
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
