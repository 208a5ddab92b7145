"""The values a config holds, below the config itself: the ``AUTO`` marker, ``ConfigError`` (a value
that cannot be used, naming its key), sizes (``parse_size`` reads ``"8GiB"``, ``1e9`` or
``512MB``; ``format_size`` writes one) and the optimizer state's formats (``STATE_FORMATS``: the
bytes each keeps a parameter, which the config's "auto" rules, the planner and the state's numerics
read). ``pyinfinity.config`` re-exports them."""
from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any

AUTO = "auto"
"""Marker for a value the planner (or, until it lands, a heuristic) decides."""


class ConfigError(ValueError):
    """A configuration value that cannot be used; the message names the key (dotted path)."""


class SwapSpaceTooSmall(OSError, ConfigError):
    """The swap files this config needs do not fit a swap directory's filesystem: a ``ConfigError``
    (the config asks for more than the disk has) and ``OSError`` ENOSPC (filename = the directory),
    raised before anything is written (by the planner's check of a fixed placement, and by the
    swap directories' claim); the message has the need, the free bytes and what is missing."""


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


WHOLE_DEVICE = "none"
"""The one spelling of "no device-memory cap: the whole device" (``--gpu-memory none`` of ``train``,
``plan`` and ``bench train``; ``pyinfinity.device_memory: "none"`` or null in a config)."""
# spellings people reach for instead, each refused with a pointer to WHOLE_DEVICE
_NOT_WHOLE_DEVICE = ("0", "auto", "off", "no", "null", "nil", "unlimited", "uncapped", "nocap", "no-cap", "all",
                     "max", "full", "whole", "inf", "infinity", "gpu", "device")


def device_budget(value: Any, key: str) -> Any:
    """A device-memory budget as given by a user: None for :data:`WHOLE_DEVICE` (and JSON null),
    else its bytes (> 0). Another spelling of "no cap" (``0``, ``auto``, ``unlimited``, ...) is a
    ConfigError naming ``key`` and the one spelling."""
    if value is None or (isinstance(value, str) and value.strip().lower() == WHOLE_DEVICE):
        return None
    if isinstance(value, (int, float, str)) and not isinstance(value, bool) and \
            str(value).strip().lower() in _NOT_WHOLE_DEVICE:
        raise ConfigError(f"{key}: {value!r} is not a budget; did you mean {WHOLE_DEVICE!r} (no cap: the whole "
                          "device) or a size such as 8GiB?")
    n = parse_size(value, key)
    if n <= 0:
        raise ConfigError(f"{key}: must be > 0; for the whole device give {WHOLE_DEVICE!r}")
    return n


def format_size(n: float) -> str:
    """Human-readable bytes, binary units."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return f"{n} B"


# ----------------------------------------------------------------------------- optimizer-state formats


OPTIMIZER_STATES = ("fp32", "8bit")
"""Values of ``pyinfinity.optimizer_state`` (the bf16 state is asked for with DeepSpeed's ``bf16`` keys)."""

QUANT_BLOCK = 256
"""Parameters per quantisation block of the 8-bit state (one fp32 scale per moment each; the C++
core's ``kQuantBlock``, ``pyinfinity._C.QUANT_BLOCK``)."""

MIN_QUANTIZED_NUMEL = 4096
"""Shards with fewer trainable elements keep the exact fp32 state under ``"8bit"`` (bitsandbytes'
``min_8bit_size``): a unit holding only a norm or a few biases saves nothing worth its error."""


@dataclass(frozen=True)
class StateFormat:
    """One format of the optimizer state: what it keeps for each trainable parameter.

    state_bytes: host RAM or disk bytes a parameter of the optimizer state (master, moments and
    scales; not the parameter's weights, which every format keeps in the compute dtype).
    weights_are_master: the weights are the master copy (no fp32 master): a gradient cannot land in
    the weights' home and needs a buffer of its own.
    """

    name: str
    state_bytes: float
    weights_are_master: bool
    description: str

    def shard_format(self, numel: int) -> "StateFormat":
        """The format a shard of ``numel`` trainable elements is kept in: the 8-bit state keeps shards
        below :data:`MIN_QUANTIZED_NUMEL` in fp32."""
        return STATE_FORMATS["fp32"] if self.name == "8bit" and numel < MIN_QUANTIZED_NUMEL else self

    def shard_bytes(self, numel: int) -> float:
        """Optimizer-state bytes of a shard of ``numel`` trainable elements (without the alignment of
        the home's sections, at most a few hundred bytes a shard)."""
        fmt = self.shard_format(numel)
        if fmt.name == "8bit":
            return 6 * numel + 8 * -(-numel // QUANT_BLOCK)
        return fmt.state_bytes * numel


STATE_FORMATS: dict[str, StateFormat] = {
    "fp32": StateFormat("fp32", 12.0, False, "fp32 master weights and fp32 Adam moments (exact; the default)"),
    "8bit": StateFormat("8bit", 6.0 + 8.0 / QUANT_BLOCK, False,
                        "fp32 master weights; Adam's moments block-wise quantised to a byte each "
                        "(pyinfinity.optimizer_state \"8bit\")"),
    "bf16": StateFormat("bf16", 4.0, True,
                        "the bf16 weights are the master; bf16 Adam moments (bf16.bf16_master_weights_and_grads "
                        "+ bf16.bf16_optimizer_states)"),
}
"""The optimizer-state formats by name (``Config.optimizer_state_format``)."""


__all__ = ["AUTO", "ConfigError", "SwapSpaceTooSmall", "parse_size", "format_size", "device_budget", "WHOLE_DEVICE",
           "OPTIMIZER_STATES", "STATE_FORMATS", "StateFormat",
           "QUANT_BLOCK", "MIN_QUANTIZED_NUMEL"]
