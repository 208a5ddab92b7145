"""The `pyinfinity` command line: one entry point, one module per subcommand.

Each subcommand module exposes ``add_parser(subparsers)`` which registers its parser and sets
``func`` (called with the parsed namespace, returns an exit code).
"""
from __future__ import annotations

import argparse
import importlib
import logging
import sys
import traceback
from typing import Any, Callable

from pyinfinity.cli.errors import EXIT_USER_ERROR, UsageError, is_user_error, one_line, system_exit_message

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
    parser.add_argument("-v", "--verbose", action="store_true",
                        help="log at DEBUG level, and a user error's traceback (anywhere on the line)")
    parser.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
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


def _version() -> str:
    from pyinfinity import __version__

    return __version__


def main(argv: list[str] | None = None) -> int:
    """Runs one subcommand. A user's mistake (see :mod:`pyinfinity.cli.errors`) is one line on
    stderr and exit status 2 (its traceback with ``-v``); a crash keeps its traceback."""
    argv = sys.argv[1:] if argv is None else list(argv)
    rest = [a for a in argv if a not in ("-v", "--verbose")]
    verbose = len(rest) < len(argv)
    command = next((a for a in rest if not a.startswith("-")), None)
    if rest[:2] == ["bench", "train"]:  # its own parser: argparse's REMAINDER drops leading options
        from pyinfinity.cli import bench_train

        return _guarded(lambda: bench_train.main(rest[2:] + (["-v"] if verbose else [])), "bench train", verbose)
    parser = build_parser()
    args = parser.parse_args(rest)  # argparse's own errors: usage, one line, exit 2
    args.verbose = verbose  # -v anywhere: before the subcommand or among its flags
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO,
                        format="%(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    return _guarded(lambda: args.func(args), command or "", args.verbose)


def _guarded(fn: Callable[[], Any], command: str, verbose: bool) -> int:
    prog = f"pyinfinity {command}".strip()
    try:
        return int(fn() or 0)
    except SystemExit as exc:
        msg = system_exit_message(exc)
        if msg is None:
            raise
        print(f"{prog}: error: {msg}", file=sys.stderr)
        return EXIT_USER_ERROR
    except KeyboardInterrupt:
        print(f"{prog}: interrupted", file=sys.stderr)
        return 130
    except Exception as exc:  # noqa: BLE001 - sorted into the user's mistakes and crashes below
        if not is_user_error(exc):
            raise
        if verbose:
            traceback.print_exc(file=sys.stderr)
        hint = "" if verbose or isinstance(exc, UsageError) else " (run with -v for the traceback)"
        print(f"{prog}: error: {one_line(exc)}{hint}", file=sys.stderr)
        return EXIT_USER_ERROR
