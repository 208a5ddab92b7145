"""`pyinfinity tune PATH`: a short sweep on PATH, then the best `aio` section as JSON
({"aio": {block_size, queue_depth, intra_op_parallelism, backend, ...}}) for a DeepSpeed-format
config (pyinfinity's or DeepSpeed's)."""
from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any


def add_parser(subparsers: Any, summary: str) -> None:
    from pyinfinity.cli.bench import comma_list, size_arg

    p = subparsers.add_parser("tune", help=summary,
                              description=__doc__)
    p.add_argument("path", help="the swap directory (on the NVMe drive that will hold swap files)")
    p.add_argument("-o", "--output", metavar="FILE", default=None,
                   help="write the JSON here (default: print it)")
    p.add_argument("--merge", metavar="CONFIG", default=None,
                   help="an existing JSON config whose aio section is replaced (written to -o, "
                        "or in place)")
    p.add_argument("--quick", action="store_true", help="64 MiB, bs 1M, qd 8/32, 1 thread")
    p.add_argument("--file-size", type=size_arg, default=None, help="default 256M")
    p.add_argument("--block-sizes", type=comma_list(size_arg), default=None, metavar="LIST")
    p.add_argument("--queue-depths", type=comma_list(int), default=None, metavar="LIST")
    p.add_argument("--threads", type=comma_list(int), default=None, metavar="LIST")
    p.add_argument("--backends", type=comma_list(str), default=None, metavar="LIST")
    p.add_argument("--reps", type=int, default=None)
    p.add_argument("--read-weight", type=float, default=0.5,
                   help="share of reads in the score, 0..1 (default 0.5)")
    p.add_argument("--no-progress", action="store_true")
    p.set_defaults(func=run)


def check_room(path: str, file_size: int) -> None:
    """ENOSPC naming ``path`` when the sweep's test file cannot fit there, before anything is written."""
    import errno

    from pyinfinity.config import format_size

    os.makedirs(path, exist_ok=True)
    st = os.statvfs(path)
    free = st.f_bavail * st.f_frsize
    if free < file_size:
        raise OSError(errno.ENOSPC, f"the sweep writes a {format_size(file_size)} test file, the filesystem has "
                      f"{format_size(free)} free: free space there or pass a smaller --file-size", path)


def run(args: argparse.Namespace) -> int:
    from pyinfinity.bench.table import render
    from pyinfinity.bench.tune import TuneSettings, run_tune
    from pyinfinity.bench.workload import MiB, fmt_size
    from pyinfinity.cli.bench import Progress
    from pyinfinity.cli.errors import UsageError

    t = TuneSettings(directory=args.path)
    if args.quick:
        t.file_size, t.block_sizes, t.queue_depths, t.threads = 64 * MiB, [1 * MiB], [8, 32], [1]
    for name in ("file_size", "block_sizes", "queue_depths", "threads", "backends", "reps"):
        v = getattr(args, name)
        if v is not None:
            setattr(t, name, v)
    if not 0.0 <= args.read_weight <= 1.0:
        raise UsageError(f"--read-weight: {args.read_weight} must be between 0 and 1")
    t.read_weight = args.read_weight
    check_room(args.path, t.file_size)
    bar = Progress(not args.no_progress)
    try:
        res = run_tune(t, progress=bar)
    finally:
        bar.close()
    rows = [[c.backend, fmt_size(c.block_size), str(c.queue_depth), str(c.threads),
             f"{c.read_gbps:.2f}", f"{c.write_gbps:.2f}", f"{c.score:.2f}",
             "<- best" if c is res.best else ""] for c in res.candidates]
    print(render(rows, ["backend", "block", "qd", "threads", "read GB/s", "write GB/s", "score", ""]),
          file=sys.stderr)
    out: dict[str, Any] = res.config()
    if args.merge:
        with open(args.merge) as f:
            base = json.load(f)
        base["aio"] = {**base.get("aio", {}), **res.aio_section()}
        out = base
    text = json.dumps(out, indent=2) + "\n"
    dest = args.output or args.merge
    if dest:
        tmp = dest + ".tmp"
        with open(tmp, "w") as f:
            f.write(text)
        os.replace(tmp, dest)
        print(f"wrote {dest}", file=sys.stderr)
    else:
        sys.stdout.write(text)
    return 0
