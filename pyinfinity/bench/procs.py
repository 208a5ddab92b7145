"""Ending the benchmark's child processes: a run started in its own process group (so that what
it starts goes with it) is stopped with SIGTERM, then SIGKILL, waiting up to 20 s for each."""
from __future__ import annotations

import os
import signal
import subprocess


def kill_group(proc: subprocess.Popen) -> None:
    """Stops the process group ``proc`` leads: SIGTERM, then SIGKILL if it is still there after 20 s."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=20)
            return
        except subprocess.TimeoutExpired:
            continue


__all__ = ["kill_group"]
