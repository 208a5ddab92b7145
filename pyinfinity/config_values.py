"""The values a config holds, below the config itself: the ``AUTO`` marker, ``ConfigError`` (a value
that cannot be used, naming its key) and sizes (``parse_size`` reads ``"8GiB"``, ``1e9`` or
``512MB``; ``format_size`` writes one). ``pyinfinity.config`` re-exports them."""
from __future__ import annotations

import math
import re
from typing import Any

AUTO = "auto"
"""Marker for a value the planner (or, until it lands, a heuristic) decides."""


class ConfigError(ValueError):
    """A configuration value that cannot be used; the message names the key (dotted path)."""


_SIZE_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([KMGTP]?i?B?)?\s*$", re.I)
_UNITS = {"": 1, "B": 1, "K": 10**3, "KB": 10**3, "KIB": 2**10, "KI": 2**10, "M": 10**6, "MB": 10**6,
          "MIB": 2**20, "MI": 2**20, "G": 10**9, "GB": 10**9, "GIB": 2**30, "GI": 2**30,
          "T": 10**12, "TB": 10**12, "TIB": 2**40, "TI": 2**40, "P": 10**15, "PB": 10**15,
          "PIB": 2**50, "PI": 2**50}


def parse_size(value: Any, key: str = "size") -> int:
    """Bytes (or a count) from an int, a float like ``1e9`` or a string like ``"8GiB"``/``"512MB"``."""
    if isinstance(value, bool):
        raise ConfigError(f"{key}: expected a size, got {value!r}")
    if isinstance(value, (int, float)):
        if value < 0 or (isinstance(value, float) and not math.isfinite(value)):
            raise ConfigError(f"{key}: must be a non-negative size, got {value!r}")
        return int(value)
    if isinstance(value, str):
        m = _SIZE_RE.match(value)
        if m:
            unit = (m.group(2) or "").upper()
            if unit in _UNITS:
                return int(float(m.group(1)) * _UNITS[unit])
    raise ConfigError(f"{key}: cannot read {value!r} as a size (examples: 8GiB, 512MB, 1e9)")


def format_size(n: float) -> str:
    """Human-readable bytes, binary units."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return f"{n} B"


__all__ = ["AUTO", "ConfigError", "parse_size", "format_size"]
