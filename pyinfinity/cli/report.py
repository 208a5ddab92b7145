"""`pyinfinity report`: versions, build, backends working on the swap path, GPUs, memory limits,
free space; each line OK/WARN/FAIL with the fix in words. Exit status 1 when anything FAILs."""
from __future__ import annotations

import argparse
import json
import logging
from dataclasses import asdict
from typing import Any


def add_parser(subparsers: Any, summary: str) -> None:
    p = subparsers.add_parser("report", help=summary,
                              description=__doc__)
    p.add_argument("--path", default=None,
                   help="swap directory to check (default: $PYINFINITY_SWAP_DIR or the temp dir)")
    p.add_argument("--config", metavar="FILE", default=None,
                   help="a DeepSpeed-format config: check each nvme_path it names")
    p.add_argument("--need", default="10G",
                   help="free space the swap path must have (default 10G)")
    p.add_argument("--json", metavar="FILE", default=None, help="also write the checks as JSON")
    p.set_defaults(func=run)


PATH_CHECKS = {"swap path writable", "filesystem type", "free space", "O_DIRECT", "I/O backends on path"}


def run(args: argparse.Namespace) -> int:
    from pyinfinity.bench.report import FAIL, run_report, worst
    from pyinfinity.bench.workload import parse_size

    # deepspeed logs at import; keep the report readable
    logging.getLogger("DeepSpeed").setLevel(logging.ERROR)
    paths: list = [args.path]
    if args.config:
        from pyinfinity.bench.report import swap_dirs_from_config

        try:
            paths = swap_dirs_from_config(args.config) or [args.path]
        except (OSError, ValueError) as exc:
            print(f"[FAIL] config {args.config}: {exc}")
            return 1
    checks = []
    for i, path in enumerate(paths):
        got = run_report(path, parse_size(args.need))
        if i:  # further swap paths: only their path checks
            got = [c for c in got if c.name in PATH_CHECKS or c.name.startswith("backend ")]
            for c in got:
                c.name = f"{c.name} [{path}]"
        checks += got
    width = max(len(c.name) for c in checks)
    for c in checks:
        print(f"[{c.status:<4}] {c.name:<{width}}  {c.detail}")
        if c.fix and c.status != "OK":
            print(f"       {'':<{width}}  fix: {c.fix}")
    w = worst(checks)
    print(f"\noverall: {w}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"overall": w, "checks": [asdict(c) for c in checks]}, f, indent=1)
    return 1 if w == FAIL else 0
