"""How fast each optimizer-state format steps one flat shard on one device, the way the engine steps
a unit there: torch's fused (CUDA) or foreach (CPU) AdamW on fp32 state as the reference, then the
8-bit and bf16 formats by pyinfinity's kernels (CUDA, or the one-pass CPU kernels) and by the torch
step (tensor operations in chunks). Prints a table, writes JSON, and checks that the kernel and the
torch step of each format leave the same bits.

    python examples/optimizer_step_bench.py --params 256M --steps 20 --json step.json
    python examples/optimizer_step_bench.py --device cpu --params 8M --steps 3
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Callable

import torch

from pyinfinity.zero import state_formats as sf

# bytes of memory traffic a parameter's step moves (read + written), for the GB/s column
TRAFFIC = {"fp32": 4 * 4 + 3 * 4 + 2,   # p, m, v, fp32 grad read; p, m, v written; bf16 weights out
           "8bit": 4 + 2 + 2 + 4 + 2 + 2,  # master, two codes, bf16 grad read; master, codes, bf16 out written
           "bf16": 4 * 2 + 4 * 2}         # p, m, v, bf16 grad read; p, m, v, bf16 out written


def parse_count(text: str) -> int:
    """'256M' -> 256,000,000 (K, M, G: powers of 1000), '1000000' -> 1,000,000."""
    t = text.strip().upper().replace("_", "")
    mult = {"K": 10 ** 3, "M": 10 ** 6, "G": 10 ** 9}.get(t[-1:], 1)
    body = t[:-1] if mult > 1 else t
    try:
        return int(float(body) * mult)
    except ValueError:
        raise ValueError(f"expected a count like 256M, 1G or 1000000, got {text!r}") from None


def _timer(device: torch.device) -> Callable[[Callable[[], None], int], float]:
    def run(fn: Callable[[], None], steps: int) -> float:
        fn()  # warm-up: kernels loaded, allocator primed
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        for _ in range(steps):
            fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return (time.perf_counter() - t0) / steps
    return run


def bench(n: int, steps: int, device: torch.device, threads: int) -> list[dict]:
    g = torch.Generator().manual_seed(0)
    master = torch.randn(n, generator=g)
    grad32 = 1e-3 * torch.randn(n, generator=g)
    m0, v0 = 1e-4 * torch.randn(n, generator=g), 1e-8 * torch.rand(n, generator=g)
    grad16 = grad32.to(torch.bfloat16).to(device)
    timed = _timer(device)
    h = sf.AdamHyper(lr=1e-4, weight_decay=0.1, step=10)
    rows = []

    def row(fmt: str, impl: str, seconds: float, same: object = "") -> None:
        rows.append({"format": fmt, "impl": impl, "params": n, "seconds": seconds, "gparams_per_s": n / seconds / 1e9,
                     "gb_per_s": n * TRAFFIC[fmt] / seconds / 1e9, "same_bits_as_kernel": same})

    # fp32 reference: torch's AdamW on the fp32 master, the bf16 weights copied out after it
    p = torch.nn.Parameter(master.to(device))
    p.grad = grad32.to(device)
    fused = {"fused": True} if device.type == "cuda" else {"foreach": True}
    opt = torch.optim.AdamW([p], lr=1e-4, weight_decay=0.1, **fused)
    out = torch.empty(n, dtype=torch.bfloat16, device=device)

    def fp32() -> None:
        opt.step()
        out.copy_(p.detach())
    row("fp32", "torch " + next(iter(fused)), timed(fp32, steps))
    del opt, p

    # 8-bit: the kernel (CUDA, or the CPU one-pass kernel) and the torch step, from one start
    start = sf.quantize_moments(m0, v0, master)
    kernel_name = "cuda kernel" if device.type == "cuda" else "cpu kernel"
    results = {}
    for impl in (kernel_name, "torch step"):
        s = sf.Adam8bitState(*(t.to(device) for t in start.tensors()))
        o = torch.empty(n, dtype=torch.bfloat16, device=device)
        if impl == "cpu kernel":
            def step8(s=s, o=o) -> None:
                sf.cpu_step_8bit(s, grad16, h, o, threads=threads)
        else:
            def step8(s=s, o=o, impl=impl) -> None:
                sf.device_step_8bit(s, grad16, h, o, impl="cuda" if impl == "cuda kernel" else "torch")
        once = sf.Adam8bitState(*(t.to(device) for t in start.tensors()))
        (sf.cpu_step_8bit(once, grad16, h, threads=threads) if impl == "cpu kernel" else
         sf.device_step_8bit(once, grad16, h, impl="cuda" if impl == "cuda kernel" else "torch"))
        results[impl] = once
        row("8bit", impl, timed(step8, steps),
            "" if impl == kernel_name else all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in
                                               zip(results[kernel_name].tensors(), once.tensors())))
        del s, o

    # bf16 master and moments (DeepSpeed's bf16 keys)
    b0 = [master.to(torch.bfloat16), m0.to(torch.bfloat16), v0.to(torch.bfloat16)]
    results = {}
    for impl in (kernel_name, "torch step"):
        t = [x.to(device) for x in b0]
        o = torch.empty(n, dtype=torch.bfloat16, device=device)
        if impl == "cpu kernel":
            def stepb(t=t, o=o) -> None:
                sf.cpu_step_bf16(*t, grad16, h, threads=threads, out=o)
        else:
            def stepb(t=t, o=o, impl=impl) -> None:
                sf.device_step_bf16(*t, grad16, h, out=o, impl="cuda" if impl == "cuda kernel" else "torch")
        once = [x.to(device) for x in b0]
        (sf.cpu_step_bf16(*once, grad16, h, threads=threads) if impl == "cpu kernel" else
         sf.device_step_bf16(*once, grad16, h, impl="cuda" if impl == "cuda kernel" else "torch"))
        results[impl] = once
        row("bf16", impl, timed(stepb, steps),
            "" if impl == kernel_name else all(torch.equal(a.view(torch.int16), b.view(torch.int16))
                                               for a, b in zip(results[kernel_name], once)))
        del t, o
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--params", default="256M", help="parameters of the shard (a count: 256M, 1G, 1000000)")
    ap.add_argument("--steps", type=int, default=20, help="timed steps per row, after one warm-up step")
    ap.add_argument("--device", default="cuda", help="cuda (default), cuda:N or cpu")
    ap.add_argument("--threads", type=int, default=0, help="CPU kernel threads (0: every CPU of this process)")
    ap.add_argument("--json", metavar="FILE", help="write the rows and the machine here")
    args = ap.parse_args(argv)
    try:
        n = parse_count(args.params)
    except ValueError as e:
        ap.error(f"--params: {e}")
    if n <= 0 or args.steps <= 0:
        ap.error("--params and --steps must be positive")
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("optimizer_step_bench: no CUDA device here; run with --device cpu for the CPU kernels", file=sys.stderr)
        return 2
    if device.type == "cuda" and not sf.cuda_kernels():
        print("optimizer_step_bench: this build of pyinfinity has no CUDA kernels (built without nvcc); "
              "rebuild with the CUDA toolkit", file=sys.stderr)
        return 2
    threads = args.threads or len(os.sched_getaffinity(0))
    rows = bench(n, args.steps, device, threads)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else f"CPU, {threads} threads"
    print(f"one step of {n:,} parameters on {device} ({name}), mean of {args.steps}")
    print(f"{'format':6} {'implementation':16} {'ms/step':>9} {'Gparam/s':>9} {'GB/s':>8}  same bits as the kernel")
    for r in rows:
        same = {True: "yes", False: "NO", "": ""}[r["same_bits_as_kernel"]]
        print(f"{r['format']:6} {r['impl']:16} {r['seconds'] * 1e3:9.2f} {r['gparams_per_s']:9.2f} "
              f"{r['gb_per_s']:8.1f}  {same}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": str(device), "device_name": name, "params": n, "steps": args.steps,
                       "torch": torch.__version__, "rows": rows}, f, indent=1)
    return 0 if all(r["same_bits_as_kernel"] in ("", True) for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
