"""Named hardware of a machine the plan is made for, when it is not this one: host<->device links
(``plan --link``), swap drive classes (``plan --disk``) and the matmul rate assumed for a GPU.
Plain data, importable without torch (the command line's help lists it);
:func:`pyinfinity.probes.preset_rates` turns it into rates."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional


@dataclass(frozen=True)
class LinkPreset:
    """Host<->device copy rates of a named link (bytes/s): pinned both ways, and from pageable memory."""

    h2d: float
    d2h: float
    h2d_pageable: float
    note: str


@dataclass(frozen=True)
class DiskPreset:
    """Sustained 1 MiB O_DIRECT read/write of a named drive class (bytes/s) and the cost of one I/O piece (s)."""

    read: float
    write: float
    latency: float
    note: str


GB = 1e9

LINK_PRESETS: dict[str, LinkPreset] = {
    "pcie3x16": LinkPreset(12 * GB, 12 * GB, 6 * GB, "PCIe 3.0 x16: 15.8 GB/s raw, ~12 GB/s pinned copies"),
    "pcie4x16": LinkPreset(24 * GB, 24 * GB, 10 * GB, "PCIe 4.0 x16: 31.5 GB/s raw, ~24 GB/s pinned copies"),
    "pcie5x16": LinkPreset(48 * GB, 48 * GB, 16 * GB, "PCIe 5.0 x16: 63 GB/s raw, ~48 GB/s pinned copies"),
    "h200-sxm": LinkPreset(55 * GB, 55 * GB, 20 * GB, "H200 SXM host link, 55 GB/s pinned as measured"),
}
"""Named host<->device links for planning a GPU machine from another one (``plan --link``)."""

DISK_PRESETS: dict[str, DiskPreset] = {
    "sata-ssd": DiskPreset(0.5 * GB, 0.45 * GB, 200e-6, "SATA 6 Gb/s SSD"),
    "nvme-gen3": DiskPreset(3.0 * GB, 2.0 * GB, 100e-6, "PCIe 3.0 x4 NVMe SSD"),
    "nvme-gen4": DiskPreset(6.0 * GB, 4.0 * GB, 80e-6, "PCIe 4.0 x4 NVMe SSD"),
    "nvme-gen5": DiskPreset(11.0 * GB, 8.0 * GB, 60e-6, "PCIe 5.0 x4 NVMe SSD"),
}
"""Named drive classes (``plan --disk``): sustained figures a little under the vendors' sequential
peaks, since swap traffic is 1 MiB pieces at a moderate queue depth."""

DEFAULT_LINK = "pcie4x16"
DEFAULT_DISK = "nvme-gen4"
DEFAULT_GPU_MATMUL = 100e12
"""FLOP/s assumed for a GPU that is not on this machine when no ``--tflops`` is given (a mid-range
data-center GPU's sustained bf16 matmul); the plan names it as an assumption."""

BF16_PEAKS: tuple[tuple[str, float], ...] = (
    ("H200", 989e12),
    ("H100 80GB HBM3", 989e12),  # the H100 SXM as CUDA names it
    ("H100 SXM", 989e12),
    ("A100", 312e12),
)
"""Dense bf16 matmul peak (FLOP/s) by a piece of the device's CUDA name, for the model FLOPs
utilisation ``plan`` prints; a device not listed gets none."""


def bf16_peak(device_name: str) -> Optional[float]:
    """The dense bf16 peak of the device named ``device_name`` (``torch.cuda.get_device_name``), or
    None when :data:`BF16_PEAKS` does not list it."""
    for piece, peak in BF16_PEAKS:
        if piece.lower() in device_name.lower():
            return peak
    return None


def model_flops_utilisation(params: int, tokens_per_second: float, peak: float) -> float:
    """6 x parameters x tokens/s over the device's peak: the share of the peak a step's model FLOPs
    (forward and backward, no recompute, no attention scores) would use."""
    return 6.0 * params * tokens_per_second / peak
