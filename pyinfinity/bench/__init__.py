"""Microbenchmarks, environment report and tuner behind `pyinfinity bench io | report | tune`.

Library code only: every function returns records (dataclasses in :mod:`records`); the CLI
(pyinfinity/cli/) prints them. GB/s means 10**9 bytes per second everywhere.
"""
from __future__ import annotations

GB = 1e9
"""Bytes in one GB as every figure here reports it (decimal)."""
