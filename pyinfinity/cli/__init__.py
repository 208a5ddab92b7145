"""The `pyinfinity` command line: one entry point, one module per subcommand.

Each subcommand module exposes ``add_parser(subparsers)`` which registers its parser and sets
``func`` (called with the parsed namespace, returns an exit code).
"""
from __future__ import annotations

import argparse
import importlib
import logging
import sys

# name -> module under pyinfinity.cli; imported lazily so a broken optional dependency of one
# subcommand never breaks the others.
SUBCOMMANDS = {
    "report": "report",
    "bench": "bench",
    "tune": "tune",
    "plan": "plan",
    "train": "train",
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pyinfinity", description=__doc__.splitlines()[0])
    parser.add_argument("-v", "--verbose", action="store_true", help="log at DEBUG level")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, module in SUBCOMMANDS.items():
        try:
            mod = importlib.import_module(f"pyinfinity.cli.{module}")
        except ModuleNotFoundError as exc:
            if exc.name == f"pyinfinity.cli.{module}":
                continue  # subcommand not built yet
            raise
        mod.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    rest = [a for a in argv if a not in ("-v", "--verbose")]
    if rest[:2] == ["bench", "train"]:  # its own parser: argparse's REMAINDER drops leading options
        from pyinfinity.cli import bench_train

        return int(bench_train.main(rest[2:] + (["-v"] if len(rest) < len(argv) else [])) or 0)
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO,
                        format="%(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    return int(args.func(args) or 0)
