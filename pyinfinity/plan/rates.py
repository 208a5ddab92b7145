"""The measured rates the planner predicts step time from, as data: host<->device copy, disk
read/write, CPU Adam, device matmul and host memcpy (:class:`Rates`), each figure naming its source.

Nothing here runs the engine: the probes that time this machine live in :mod:`pyinfinity.probes`
(above both ``zero/`` and ``plan/``), and the engine or the command line hands what they measured to
the planner. A rates file (``pyinfinity bench io --json`` results, a file written by
:meth:`Rates.save`, a ``pyinfinity tune`` output's ``aio`` settings) is read here
(:func:`load_rates_file`); the named presets' tables are in :mod:`pyinfinity.plan.hardware`, which
the command line's help reads without torch.
"""
from __future__ import annotations

import json
import math
import os
from dataclasses import asdict, dataclass, field
from typing import Any, Optional, Union

import torch

SCHEMA = "pyinfinity.plan.rates/1"


DEVICE_ADAM_ASSUMED = {"fp32": math.inf, "8bit": 2.5e9, "bf16": 11.8e9}
"""Params/s of each format's device step where it was not measured (planning a GPU that is not on
this machine): the compressed formats' torch steps as one H200 ran them, every unit of a 1.26B
Llama stepped there (0.507 s and 0.107 s a step); fp32's fused step as free."""


def device_adam_key(state: str) -> str:
    """The :class:`Rates` field of the ``state`` format's device step rate."""
    if state not in DEVICE_ADAM_ASSUMED:
        raise ValueError(f"optimizer state format: expected one of {', '.join(DEVICE_ADAM_ASSUMED)}, got {state!r}")
    return "device_adam" if state == "fp32" else f"device_adam_{state}"



def device_is_here(device: Union[str, torch.device]) -> bool:
    """Whether ``device`` exists on this machine (the CPU always; a CUDA device when torch sees it).
    Never initializes CUDA beyond torch's availability query."""
    dev = torch.device(device)
    if dev.type == "cpu":
        return True
    if dev.type != "cuda" or not torch.cuda.is_available():
        return False
    return dev.index is None or dev.index < torch.cuda.device_count()



@dataclass
class Rates:
    """Rates in bytes/s (copies, disk), params/s (Adam) and FLOP/s (matmul).

    h2d/d2h: between the shards' host homes and the compute device (on the CPU device: a memcpy
    the compute thread does itself). disk_read/disk_write: one SwapEngine (one queue) on the swap
    directory; a request costs ``pieces(n) * disk_latency + n / rate`` (the engine splits it into
    ``block_size`` pieces, an unaligned tail is one more), disk_latency fitted from a one-page read.
    disk_duplex: a read and a write of one size issued together, in seconds over the two issued one
    after the other (the optimizer's disk pipeline overlaps its reads with its writes).
    memcpy: host memory bandwidth (gradient accumulation, cpu-tier write-back).
    adam, adam_8bit, adam_bf16: the CPU optimizer step of each state format (:meth:`adam_rate`).
    device_adam, device_adam_8bit, device_adam_bf16: the step of each format on the compute device,
    as the engine runs it for units whose state lives there (:meth:`device_adam_rate`; 0: not
    measured).
    accumulate: params/s of the host's gradient add under accumulation (the engine's ``add_into`` of
    a gradient in the compute dtype into its fp32 accumulator; 0: not measured, the memcpy model
    stands in).
    source: where each figure came from ("probe", "file:<path>", "given").
    """

    h2d: float
    d2h: float
    disk_read: float
    disk_write: float
    adam: float
    matmul: float
    memcpy: float
    disk_latency: float = 0.0  # seconds per I/O piece, on top of bytes / rate
    # seconds of a read and a write of one size at once over the two one after the other (the
    # pipelined optimizer reads shard k+1 while it writes k-1): 1.0 when not measured, down to 0.5
    # for a disk whose reads and writes do not slow each other
    disk_duplex: float = 1.0
    block_size: int = 1 << 20  # the aio block size the disk figures were measured with
    h2d_pageable: float = 0.0  # from pageable host memory (0: same as h2d); write-back to device homes
    adam_8bit: float = 0.0  # params/s of the 8-bit state's CPU step (0: not measured; the fp32 rate stands in)
    adam_bf16: float = 0.0  # params/s of the bf16 state's CPU step (0: not measured; likewise)
    accumulate: float = 0.0  # params/s of the host's gradient add (0: not measured; memcpy model)
    device_adam: float = 0.0  # params/s of the fp32 state's step on the compute device (0: not measured)
    device_adam_8bit: float = 0.0  # likewise of the 8-bit state's
    device_adam_bf16: float = 0.0  # likewise of the bf16 state's
    shard_overhead: float = 0.0  # host seconds per shard per forward+backward (hooks, bookkeeping)
    shard_step_overhead: float = 0.0  # host seconds per shard in the optimizer step
    device: str = "cpu"
    source: dict[str, str] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {"schema": SCHEMA, **asdict(self)}

    def save(self, path: str) -> None:
        tmp = path + ".tmp"
        with open(tmp, "w") as f:
            json.dump(self.to_json(), f, indent=1)
        os.replace(tmp, path)

    @classmethod
    def from_json(cls, d: dict) -> "Rates":
        keys = {k: d[k] for k in ("h2d", "d2h", "disk_read", "disk_write", "adam", "matmul", "memcpy",
                                  "disk_latency", "disk_duplex", "block_size", "h2d_pageable", "shard_overhead",
                                  "shard_step_overhead", "adam_8bit", "adam_bf16", "accumulate", "device_adam",
                                  "device_adam_8bit", "device_adam_bf16", "device", "source")
                if k in d}
        return cls(**keys)

    def adam_rate(self, state: str = "fp32") -> float:
        """Params/s of the CPU optimizer step of the ``state`` format; the fp32 step's rate where the
        format's was not measured (a rates file from before it, or a target described by presets)."""
        rate = {"fp32": self.adam, "8bit": self.adam_8bit, "bf16": self.adam_bf16}[state]
        return rate or self.adam

    def device_adam_rate(self, state: str = "fp32") -> float:
        """Params/s of the ``state`` format's step on the compute device (units whose optimizer
        state lives there, the streamed step): the measured figure, else
        :data:`DEVICE_ADAM_ASSUMED`'s (``math.inf`` for fp32: torch's fused kernel streams the
        state at the device memory's pace, a small share of any step)."""
        return getattr(self, device_adam_key(state)) or DEVICE_ADAM_ASSUMED[state]

    def device_adam_source(self, state: str = "fp32") -> str:
        """Where :meth:`device_adam_rate`'s figure came from."""
        key = device_adam_key(state)
        if getattr(self, key):
            return self.source.get(key, "given")
        return "not measured: fp32's fused step taken as free" if state == "fp32" else "not measured: an H200's figure"

    def pieces(self, nbytes: int) -> int:
        """I/O pieces the swap engine cuts a request of ``nbytes`` into."""
        if nbytes <= 0:
            return 0
        aligned = nbytes // 4096 * 4096
        return -(-aligned // max(1, self.block_size)) + (1 if nbytes % 4096 else 0)

    def read_time(self, nbytes: int) -> float:
        """Seconds of one disk read of ``nbytes``."""
        return self.pieces(nbytes) * self.disk_latency + (nbytes / self.disk_read if self.disk_read > 0 else math.inf)

    def write_time(self, nbytes: int) -> float:
        """Seconds of one disk write of ``nbytes``."""
        return self.pieces(nbytes) * self.disk_latency + (nbytes / self.disk_write if self.disk_write > 0 else math.inf)

    def describe(self) -> str:
        g = 1e9
        return (f"h2d {self.h2d / g:.2f} GB/s, d2h {self.d2h / g:.2f} GB/s, disk read {self.disk_read / g:.3f} GB/s, "
                f"write {self.disk_write / g:.3f} GB/s, latency {self.disk_latency * 1e3:.2f} ms, Adam {self.adam / 1e9:.3f} Gparam/s, "
                f"matmul {self.matmul / 1e12:.3f} TFLOP/s, memcpy {self.memcpy / g:.2f} GB/s")

    def describe_sources(self, state: Optional[str] = None) -> str:
        """One line per figure: its value and where it came from (probe, file, preset, assumed);
        with ``state`` on a GPU, its device step's figure also where it is assumed."""
        g = 1e9
        rows = [("h2d", f"{self.h2d / g:.2f} GB/s"), ("d2h", f"{self.d2h / g:.2f} GB/s"),
                ("h2d_pageable", f"{(self.h2d_pageable or self.h2d) / g:.2f} GB/s"),
                ("disk_read", f"{self.disk_read / g:.3f} GB/s"), ("disk_write", f"{self.disk_write / g:.3f} GB/s"),
                ("disk_latency", f"{self.disk_latency * 1e3:.3f} ms per piece"),
                ("disk_duplex", f"{self.disk_duplex:.2f} of read + write when both run"),
                ("adam", f"{self.adam / 1e9:.3f} Gparam/s"), ("matmul", f"{self.matmul / 1e12:.3f} TFLOP/s"),
                ("memcpy", f"{self.memcpy / g:.2f} GB/s")]
        rows[8:8] = [(k, f"{getattr(self, k) / 1e9:.3f} Gparam/s")
                     for k in ("adam_8bit", "adam_bf16", "device_adam", "device_adam_8bit", "device_adam_bf16",
                               "accumulate") if getattr(self, k)]
        source = dict(self.source)
        if state is not None and self.device.startswith("cuda") and not getattr(self, device_adam_key(state)):
            rate = self.device_adam_rate(state)
            shown = "free" if rate == math.inf else f"{rate / 1e9:.3f} Gparam/s"
            rows.insert([k for k, _ in rows].index("matmul"), (device_adam_key(state), shown))
            source[device_adam_key(state)] = self.device_adam_source(state)
        if self.shard_overhead or "shard_overhead" in self.source:
            rows.append(("shard_overhead", f"{self.shard_overhead * 1e6:.1f} us per shard"))
        w = max(len(k) for k, _ in rows)
        return "\n".join(f"  {k:<{w}}  {v:<20} {source.get(k, 'unknown')}" for k, v in rows)


# ----------------------------------------------------------------------------------- files


def load_rates_file(path: str) -> tuple[dict[str, float], dict]:
    """Figures found in a saved JSON: a rates file (all of them), ``bench io --json`` results (disk
    read/write: the best pyinfinity file figure; h2d/d2h when measured), or a ``tune`` output
    (today only the ``aio`` settings, returned second; a ``"rates"`` object beside them, in bytes/s,
    is read too)."""
    try:
        with open(path) as f:
            d = json.load(f)
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"rates file {path!r}: cannot read it ({exc})") from exc
    if not isinstance(d, dict):
        raise ValueError(f"rates file {path!r}: expected a JSON object")
    out: dict[str, float] = {}
    aio = dict(d.get("aio") or {})
    if d.get("schema") == SCHEMA:
        out = {k: float(d[k]) for k in ("h2d", "d2h", "disk_read", "disk_write", "adam", "matmul", "memcpy",
                                        "disk_latency", "disk_duplex", "h2d_pageable", "adam_8bit", "adam_bf16",
                                        "accumulate", "device_adam", "device_adam_8bit", "device_adam_bf16")
               if isinstance(d.get(k), (int, float))
               and (d[k] or not k.startswith(("adam_", "accumulate", "device_adam")))}
    elif isinstance(d.get("results"), list):
        best: dict[str, float] = {}
        for r in d["results"]:
            gbps = r.get("gbps_median")
            if not isinstance(gbps, (int, float)) or r.get("verified") is False:
                continue
            op, tool = r.get("op"), r.get("tool")
            key = {"read": "disk_read", "write": "disk_write", "h2d": "h2d", "d2h": "d2h"}.get(op)
            if key is None or tool != "pyinfinity" or (key.startswith("disk") and r.get("workload") != "file"):
                continue
            best[key] = max(best.get(key, 0.0), gbps * 1e9)
        out = best
    if isinstance(d.get("rates"), dict):  # a tune/bench output that carries its figures beside the config
        out.update({k: float(v) for k, v in d["rates"].items()
                    if k in ("h2d", "d2h", "disk_read", "disk_write", "disk_latency", "adam", "matmul", "memcpy")
                    and isinstance(v, (int, float))})
    if not out and not aio:
        raise ValueError(f"rates file {path!r}: no rates and no aio section in it (expected a file from "
                         "`pyinfinity bench io --json`, `pyinfinity tune -o` or `pyinfinity plan --save-rates`)")
    return out, aio

__all__ = ["Rates", "SCHEMA", "device_is_here", "DEVICE_ADAM_ASSUMED", "device_adam_key", "load_rates_file"]
