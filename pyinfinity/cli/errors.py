"""What the command line reports as a user's mistake (one line on stderr, exit status 2) and what
it reports as a crash (the traceback, exit status 1).

A user error is something the person running the command can fix: a bad flag or config value
(``ValueError`` and its kinds: ``ConfigError``, ``PlanError``, ``CapacityError``), a path that
is missing, read-only, not a directory or in use, a disk that is full, a device that is not on
this machine. Everything else is a bug or an environment failure and keeps its traceback.
"""
from __future__ import annotations

import errno
from typing import Optional

EXIT_USER_ERROR = 2

USER_ERRNOS = frozenset({errno.ENOENT, errno.EACCES, errno.EPERM, errno.EROFS, errno.ENOSPC, errno.EDQUOT,
                         errno.EEXIST, errno.EBUSY, errno.ENOTDIR, errno.EISDIR, errno.ENAMETOOLONG,
                         errno.EFBIG, errno.ELOOP})

# a hint for the errnos whose strerror alone does not say what to do
_OS_HINTS = {
    errno.EROFS: "the filesystem is mounted read-only: pick a writable directory",
    errno.EACCES: "no permission: pick a directory you can write to",
    errno.EPERM: "not permitted: pick a directory you can write to",
    errno.ENOSPC: "the disk is full: free space there or pick another directory",
    errno.EDQUOT: "the disk quota is used up: free space there or pick another directory",
}


class UsageError(ValueError):
    """A command-line mistake found by the CLI itself (a flag's value, a device not here)."""


def is_user_error(exc: BaseException) -> bool:
    """Whether ``exc`` is the user's to fix (see the module docstring)."""
    if isinstance(exc, ValueError):
        return True
    if isinstance(exc, OSError):
        return exc.errno in USER_ERRNOS
    return False


def one_line(exc: BaseException) -> str:
    """``exc`` as one line: its message (an OSError's with the path and a hint)."""
    if isinstance(exc, OSError) and exc.errno is not None and exc.strerror:
        text = exc.strerror
        if exc.filename is not None and str(exc.filename) not in text:
            text = f"{exc.filename}: {text}"
        hint = _OS_HINTS.get(exc.errno)
        if hint and hint not in text:
            text = f"{text} ({hint})"
    else:
        text = str(exc) or type(exc).__name__
    return " ".join(text.split())


def system_exit_message(exc: SystemExit) -> Optional[str]:
    """The message of a ``SystemExit("...")`` raised for a bad flag (None for a plain exit code)."""
    return exc.code if isinstance(exc.code, str) else None


def check_device_here(spec: str, flag: str = "--device") -> str:
    """The device ``spec`` names on this machine ("auto" and "cuda" with the GPU's index, as
    ``pyinfinity.device.resolve_device``); UsageError when it is a CUDA device this machine does
    not have."""
    import torch

    from pyinfinity.device import resolve_device

    if spec == "auto":
        try:
            return str(resolve_device(spec))
        except ValueError as e:  # LOCAL_RANK names a GPU this process does not see
            raise UsageError(f"{flag}: {spec}: {e}") from None
    try:
        dev = torch.device(spec)
    except (RuntimeError, TypeError):
        raise UsageError(f"{flag}: expected cpu, cuda, cuda:N or auto, got {spec!r}") from None
    if dev.type != "cuda":
        return str(dev)
    if not torch.cuda.is_available():
        why = ("this torch is built without CUDA" if torch.version.cuda is None
               else "no CUDA GPU is visible (driver, CUDA_VISIBLE_DEVICES)")
        raise UsageError(f"{flag}: {spec} is not available on this machine ({why}); use {flag} cpu, or "
                         "`pyinfinity plan --device cuda --gpu-memory SIZE` to plan for a GPU elsewhere")
    if dev.index is not None and dev.index >= torch.cuda.device_count():
        raise UsageError(f"{flag}: {spec} does not exist: this machine has {torch.cuda.device_count()} GPU(s)")
    try:
        return str(resolve_device(dev))
    except ValueError as e:  # LOCAL_RANK names a GPU this process does not see
        raise UsageError(f"{flag}: {spec}: {e}") from None
