"""The `pyinfinity` command line: one entry point, one module per subcommand.

Each subcommand module exposes ``add_parser(subparsers)`` which registers its parser and sets
``func`` (called with the parsed namespace, returns an exit code).
"""
from __future__ import annotations

import argparse
import difflib
import importlib
import logging
import sys
import traceback
from typing import Any, Callable, Iterable, Optional

from pyinfinity.cli.errors import EXIT_USER_ERROR, UsageError, is_user_error, one_line, system_exit_message

# name -> its one line in `pyinfinity --help`; each is the module pyinfinity.cli.<name>, imported
# only when its command is run (or its help asked for): a one-line answer (--version, --help, a
# flag's mistake) never waits for torch, and a broken optional dependency of one subcommand never
# breaks the others.
SUBCOMMANDS = {
    "report": "check the environment (OK/WARN/FAIL with fixes)",
    "bench": "microbenchmarks: `bench io` (default), `bench train`",
    "tune": "find the best aio settings for a swap directory",
    "plan": "plan placement and buffers for a model and budgets",
    "train": "train a Llama model on the stdlib's sources, offloaded",
}


def build_parser(commands: Optional[Iterable[str]] = None) -> argparse.ArgumentParser:
    """The command line's parser: the subcommands in ``commands`` (default all) with their flags,
    the others named with their one line only (enough for `pyinfinity --help` and a misspelt
    command)."""
    full = set(SUBCOMMANDS) if commands is None else set(commands)
    parser = argparse.ArgumentParser(prog="pyinfinity", description=__doc__.splitlines()[0])
    parser.add_argument("-v", "--verbose", action="store_true",
                        help="log at DEBUG level, and a user error's traceback (anywhere on the line)")
    parser.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, summary in SUBCOMMANDS.items():
        if name not in full:
            sub.add_parser(name, help=summary, add_help=False)
            continue
        try:
            mod = importlib.import_module(f"pyinfinity.cli.{name}")
        except ModuleNotFoundError as exc:
            if exc.name == f"pyinfinity.cli.{name}":
                continue  # subcommand not built yet
            raise
        mod.add_parser(sub, summary)
    return parser


def unrecognized(extra: list[str], parser: argparse.ArgumentParser) -> str:
    """argparse's "unrecognized arguments" message, with the nearest flag of ``parser`` for each
    misspelt one ("--stpes: did you mean --steps?")."""
    names = [s[2:] for a in parser._actions for s in a.option_strings if s.startswith("--")]
    hints = []
    for arg in extra:
        flag = arg.split("=", 1)[0]
        near = difflib.get_close_matches(flag[2:], names, n=1, cutoff=0.6) if flag.startswith("--") else []
        if near:
            hints.append(f"{flag}: did you mean --{near[0]}?")
    return f"unrecognized arguments: {' '.join(extra)}" + (f" ({'; '.join(hints)})" if hints else "")


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
    parser = build_parser([command] if command in SUBCOMMANDS else [])
    args, extra = parser.parse_known_args(rest)  # argparse's own errors: usage, one line, exit 2
    if extra:  # said by the subcommand's parser: `pyinfinity train: error: ...`, its usage
        subparsers = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
        owner = subparsers.choices.get(args.command, parser) if args.command else parser
        owner.error(unrecognized(extra, owner))
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
