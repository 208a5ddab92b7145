"""`--plot FILE.png`: GB/s vs block size per backend and per peer, read and write, plus the
many-small-tensors workloads. matplotlib is imported only here (Agg backend, no display)."""
from __future__ import annotations

import logging
from collections import defaultdict
from typing import Sequence

from pyinfinity.bench.records import Result
from pyinfinity.bench.workload import fmt_size

log = logging.getLogger(__name__)


def plot_results(results: Sequence[Result], path: str, title: str = "") -> None:
    """Write a PNG to ``path``. Raises ImportError when matplotlib is missing."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    done = [r for r in results if r.seconds and r.verified is not False]
    fig, axes = plt.subplots(1, 3, figsize=(18, 5.5))
    files = [r for r in done if r.workload == "file"]
    # GB/s vs block size; with a single block size in the sweep, vs queue depth instead
    by_bs = len({r.block_size for r in files}) > 1 or len({r.queue_depth for r in files}) <= 1
    xattr = "block_size" if by_bs else "queue_depth"
    for ax, op in zip(axes[:2], ("write", "read")):
        lines: dict[str, list[Result]] = defaultdict(list)
        for r in files:
            if r.op == op:
                req = "" if r.tool != "pyinfinity" else f" req {fmt_size(r.io_size)}"
                fixed = f"qd{r.queue_depth}" if by_bs else f"bs {fmt_size(r.block_size)}"
                lines[f"{r.label()} {fixed} t{r.threads}{req}"].append(r)
        for label, rs in sorted(lines.items()):
            rs.sort(key=lambda r: getattr(r, xattr))
            x = [getattr(r, xattr) for r in rs]
            y = [r.gbps_median for r in rs]
            err = [[r.gbps_median - r.gbps_min for r in rs], [r.gbps_max - r.gbps_median for r in rs]]
            style = "-o" if label.startswith("pyinfinity") else "--s"
            ax.errorbar(x, y, yerr=err, fmt=style, capsize=3, label=label, markersize=4)
        ax.set_xscale("log", base=2)
        ticks = sorted({getattr(r, xattr) for rs in lines.values() for r in rs})
        if ticks:
            ax.set_xticks(ticks)
            ax.set_xticklabels([fmt_size(t) if by_bs else str(t) for t in ticks])
        ax.set_xlabel("block size" if by_bs else "queue depth")
        ax.set_ylabel("GB/s (1e9 B/s), median, bars min-max")
        ax.set_title(f"one big file: {op}")
        ax.grid(True, alpha=0.3)
        if lines:
            ax.legend(fontsize=6, loc="best")
    ax = axes[2]
    bars = [r for r in done if r.workload != "file"]
    if bars:
        labels = [f"{r.workload} {r.op} {r.label()}" for r in bars]
        ax.barh(range(len(bars)), [r.gbps_median for r in bars],
                xerr=[[r.gbps_median - r.gbps_min for r in bars],
                      [r.gbps_max - r.gbps_median for r in bars]],
                color=["C0" if r.tool == "pyinfinity" else "C1" for r in bars])
        ax.set_yticks(range(len(bars)))
        ax.set_yticklabels(labels, fontsize=6)
        ax.invert_yaxis()
    ax.set_xlabel("GB/s")
    ax.set_title("many small tensors / GPU")
    ax.grid(True, axis="x", alpha=0.3)
    if title:
        fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    log.info("plot written to %s", path)
