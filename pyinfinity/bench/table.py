"""Text rendering of benchmark results (returned as strings; the CLI prints them)."""
from __future__ import annotations

from typing import Optional, Sequence

from pyinfinity.bench.records import Result, best_peer, ratio_to, ratio_to_best_peer
from pyinfinity.bench.workload import fmt_size


def render(rows: Sequence[Sequence[str]], header: Sequence[str]) -> str:
    """A plain aligned table (numbers right-aligned)."""
    widths = [max(len(str(x)) for x in col) for col in zip(header, *rows)]

    def line(cells: Sequence[str]) -> str:
        out = []
        for c, w in zip(cells, widths):
            c = str(c)
            out.append(c.rjust(w) if c[:1].isdigit() or c[:1] in "-." else c.ljust(w))
        return "  ".join(out).rstrip()

    sep = "  ".join("-" * w for w in widths)
    return "\n".join([line(header), sep, *(line(r) for r in rows)])


def _ratio(x: Optional[float]) -> str:
    return "" if x is None else f"{x:.2f}x"


def _verified(r: Result) -> str:
    return {True: "yes", False: "NO", None: "-"}[r.verified]


def ratio_text(results: Sequence[Result], r: Result) -> str:
    x = ratio_to_best_peer(list(results), r)
    if x is None:
        return ""
    p = best_peer(list(results), r)
    return f"{x:.2f}x {p.label() if p else ''}"


def results_table(results: Sequence[Result], markdown: bool = False) -> str:
    header = ["workload", "op", "block", "qd", "thr", "request", "tool:backend", "GB/s", "min-max",
              "vs best peer", "vs DeepSpeed", "verified", "cache"]
    rows = []
    for r in results:
        if not r.seconds:
            continue
        rows.append([r.workload, r.op, fmt_size(r.block_size) if r.block_size else "-",
                     str(r.queue_depth) if r.queue_depth else "-", str(r.threads),
                     (f"{r.n_ops}x{'~' if r.workload == 'small-odd' else ''}{fmt_size(r.io_size)}"
                      if r.n_ops > 1 else fmt_size(r.io_size)),
                     r.label(), f"{r.gbps_median:.2f}", f"{r.gbps_min:.2f}-{r.gbps_max:.2f}",
                     ratio_text(results, r), _ratio(ratio_to(list(results), r, "deepspeed")),
                     _verified(r), r.cache])
    return render_markdown(rows, header) if markdown else render(rows, header)


def render_markdown(rows: Sequence[Sequence[str]], header: Sequence[str]) -> str:
    """A GitHub Markdown table (for BENCHMARKS.md)."""
    out = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    out += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
    return "\n".join(out)


def skipped_lines(results: Sequence[Result]) -> list[str]:
    """One line per (tool, reason) that left a configuration unmeasured."""
    seen: dict[tuple[str, str], int] = {}
    for r in results:
        if not r.seconds and r.note:
            k = (r.label(), r.note)
            seen[k] = seen.get(k, 0) + 1
    return [f"{label}: {note} ({n} configurations)" for (label, note), n in seen.items()]


def summary_lines(results: Sequence[Result]) -> list[str]:
    """pyinfinity against its best peer: the worst and best ratio per workload and direction."""
    out = []
    groups: dict[tuple[str, str], list[tuple[float, Result]]] = {}
    for r in results:
        x = ratio_to_best_peer(list(results), r)
        if x is not None:
            groups.setdefault((r.workload, r.op), []).append((x, r))
    for (wl, op), xs in groups.items():
        lo = min(xs, key=lambda t: t[0])
        hi = max(xs, key=lambda t: t[0])
        out.append(f"{wl} {op}: pyinfinity / best peer {lo[0]:.2f}x (worst: {_where(lo[1])}) "
                   f"... {hi[0]:.2f}x (best: {_where(hi[1])})")
    return out


def _where(r: Result) -> str:
    return (f"{r.backend} bs {fmt_size(r.block_size)} qd {r.queue_depth} thr {r.threads} "
            f"req {fmt_size(r.io_size)}")


def failed_lines(results: Sequence[Result]) -> list[str]:
    out = []
    for r in results:
        if r.verified is False:
            out.append(f"DATA MISMATCH: {r.label()} {r.workload} {r.op} {_where(r)}")
        if r.note.startswith("suspect"):
            out.append(f"suspect peer: {r.label()} {r.workload} {r.op} {_where(r)}: {r.note}")
        if r.seconds and r.note.startswith("failed"):
            out.append(f"partly failed: {r.label()} {r.workload} {r.op}: {r.note}")
        elif not r.seconds and r.note.startswith("failed"):
            out.append(f"failed: {r.label()} {r.workload} {r.op} {_where(r)}: {r.note}")
    return out


def best_of(results: Sequence[Result], op: str, workload: str = "file",
            tool: Optional[str] = "pyinfinity") -> Optional[Result]:
    rs = [r for r in results if r.op == op and r.workload == workload and r.seconds
          and r.verified is not False and (tool is None or r.tool == tool)]
    return max(rs, key=lambda r: r.gbps_median, default=None)


def pivot(results: Sequence[Result], markdown: bool = False) -> str:
    """One row per setting (workload, op, block, qd, threads), one column per tool:backend, each
    cell the median GB/s: the side-by-side view of BENCHMARKS.md."""
    done = [r for r in results if r.seconds]
    cols: list[str] = []
    for r in done:
        if r.label() not in cols:
            cols.append(r.label())
    first = ["pyinfinity:aio", "pyinfinity:uring", "pyinfinity:posix", "pyinfinity:AioHandle",
             "deepspeed:aio_handle", "fio:libaio", "fio:io_uring", "dd:O_DIRECT"]
    cols.sort(key=lambda c: (first.index(c) if c in first else len(first), c))
    rows: dict[tuple, dict[str, Result]] = {}
    for r in done:
        unit = fmt_size(r.block_size) if r.workload == "file" else (
            f"{r.n_ops}x{'~' if r.workload == 'small-odd' else ''}{fmt_size(r.io_size)}")
        rows.setdefault((r.workload, r.op, unit, r.queue_depth, r.threads), {})[r.label()] = r
    header = ["workload", "op", "block/tensors", "qd", "thr", *cols]
    body = []
    for (wl, op, unit, qd, th), cells in rows.items():
        body.append([wl, op, unit, str(qd) if qd else "-", str(th),
                     *(f"{cells[c].gbps_median:.2f}" if c in cells and cells[c].verified is not False
                       else ("BAD DATA" if c in cells else "") for c in cols)])
    return render_markdown(body, header) if markdown else render(body, header)
