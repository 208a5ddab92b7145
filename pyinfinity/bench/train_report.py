"""The results file of `pyinfinity bench train` (one JSON file that invocations append to) and its
report: the table, the ratios against DeepSpeed and the bound, and the plots."""
from __future__ import annotations

import json
import os
from typing import Any, Optional, Sequence

from pyinfinity.bench.train_matrix import PEERS, SCHEMA, BenchTrainError, base_system
from pyinfinity.bench.train_worker import SYSTEMS


def load_results(path: Optional[str]) -> dict[str, Any]:
    empty = {"schema": SCHEMA, "invocations": [], "runs": []}
    if not path or not os.path.exists(path):
        return empty
    try:
        with open(path) as f:
            d = json.load(f)
    except (OSError, json.JSONDecodeError) as exc:
        raise BenchTrainError(f"--json {path}: exists but cannot be read as JSON ({exc}); give another path "
                              "(it is not overwritten)") from exc
    if not isinstance(d, dict) or d.get("schema") != SCHEMA:
        raise BenchTrainError(f"--json {path}: not a `pyinfinity bench train` results file (schema "
                              f"{d.get('schema') if isinstance(d, dict) else None!r}, expected {SCHEMA!r}); "
                              "give another path (it is not overwritten)")
    return d


def save_results(path: str, data: dict[str, Any]) -> None:
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(data, f, indent=1, default=str)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def latest_runs(data: dict[str, Any]) -> list[dict[str, Any]]:
    """The newest run of each (size, system) pair, by size, then system, variants after their system."""
    by: dict[tuple[str, str], dict[str, Any]] = {}
    for r in data["runs"]:
        by[(r["size"], r["system"])] = r

    def order(r: dict[str, Any]) -> tuple:
        base = base_system(r["system"])
        return (r.get("params") or 0, SYSTEMS.index(base) if base in SYSTEMS else 99, r["system"] != base)

    return sorted(by.values(), key=order)


def gib(n: Optional[float]) -> str:
    """Bytes as GiB with two decimals ("-" for None)."""
    return "-" if n is None else f"{n / 2**30:.2f} GiB"


def _count(n: float) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.1f}M" if n >= 1e5 else f"{n / 1e3:.1f}K"


def _bytes(n: float) -> str:
    from pyinfinity.config import format_size

    return format_size(int(n)) if n else "0"


def _f(x: Optional[float], fmt: str) -> str:
    return "-" if x is None else format(x, fmt)


def below_bound(r: dict[str, Any]) -> bool:
    """Whether a run stepped faster than its bound: the bound is then wrong, and the figure unused."""
    x = r.get("step_over_bound")
    return bool(r.get("ok")) and x is not None and x < 1.0


def usable(r: dict[str, Any]) -> bool:
    """A run whose figure may enter a ratio: it trained, and not below its bound."""
    return bool(r.get("ok")) and r.get("tokens_per_s") is not None and not below_bound(r)


def compare_to_best_deepspeed(runs: Sequence[dict[str, Any]], invocation: int) -> None:
    """Sets ``vs_best_deepspeed`` on the pyinfinity runs of ``invocation``: tokens/s over the fastest
    DeepSpeed run (any configuration or variant) that trained that size in the same invocation,
    flagged runs on neither side."""
    mine = [r for r in runs if r.get("invocation") == invocation]
    best: dict[str, dict[str, Any]] = {}
    for r in mine:
        if base_system(r["system"]).startswith("deepspeed") and usable(r):
            if r["size"] not in best or r["tokens_per_s"] > best[r["size"]]["tokens_per_s"]:
                best[r["size"]] = r
    for r in mine:
        if not base_system(r["system"]).startswith("pyinfinity"):
            continue
        r.pop("vs_best_deepspeed", None)
        p = best.get(r["size"])
        if usable(r) and p is not None:
            r["vs_best_deepspeed"] = {"ratio": r["tokens_per_s"] / p["tokens_per_s"], "peer": p["system"],
                                      "peer_tokens_per_s": p["tokens_per_s"]}


def one_line(r: dict[str, Any]) -> str:
    if not r.get("ok"):
        return f"{r['size']:>6} {r['system']:<20} FAILED: {r.get('error', '?')}"
    vs = r.get("vs_best_deepspeed")
    return (f"{r['size']:>6} {r['system']:<20} {r['step_seconds']:.3f} s/step, {r['tokens_per_s']:.0f} tok/s, "
            f"peak GPU {gib(r.get('peak_device_allocated'))}, {r['step_over_bound']:.2f}x the bound "
            f"({r['bound']['bound_by']})" + (" BELOW THE BOUND: the bound is wrong" if below_bound(r) else "")
            + (f", {vs['ratio']:.2f}x the best DeepSpeed so far ({vs['peer']})" if vs else "")
            + (f", {r['tflops_6nd']:.1f} TFLOPS as 6 x params x tokens/s" if r.get("tflops_6nd") else "")
            + (f" (MegaTrain's own figure {r['megatrain_tflops']:.1f})" if r.get("megatrain_tflops") is not None
               else ""))


HEADER = ["size", "params", "system", "s/step", "tokens/s", "vs best DS", "TFLOPS", "peak GPU", "peak RSS",
          "disk R/W per step", "hidden", "bound s (by)", "step/bound", "note"]


def _bound_cell(b: dict[str, Any]) -> str:
    if not b:
        return "-"
    cell = f"{b['seconds']:.3f} ({b['bound_by']})"
    if b.get("disk_serial_seconds") is not None:  # the disk term's reads and writes one after the other
        cell += f"; disk {b['terms']['disk']:.3f}, R+W {b['disk_serial_seconds']:.3f}"
    return cell


def table_rows(runs: Sequence[dict[str, Any]]) -> list[list[str]]:
    rows = []
    for r in runs:
        b = r.get("bound") or {}
        note = "" if r.get("ok") else ("OOM" if r.get("oom") else "failed: ") + (
            "" if r.get("oom") else str(r.get("error", ""))[:70])
        if below_bound(r):
            note = "BELOW BOUND: bound wrong, figure not used"
        elif r.get("ok") and r.get("megatrain_tflops") is not None:  # its own figure: 6 x params x tokens/s
            note = (f"its own {r['megatrain_tflops']:.1f} TFLOPS (6ND), batch {r.get('megatrain_batch')} x "
                    f"{r.get('megatrain_grad_accum')}; bf16 weights, DS CPU Adam, sdpa")
        vs = r.get("vs_best_deepspeed")
        ov = r.get("overlap_fraction")
        params = _count(r.get("params") or 0)
        if r.get("lora"):  # a frozen base: the adapters are what trains
            params += f" ({_count(r.get('trainable_params') or 0)} LoRA r{r['lora']['r']})"
        rows.append([r["size"], params, r["system"],
                     _f(r.get("step_seconds"), ".3f"), _f(r.get("tokens_per_s"), ",.0f"),
                     f"{vs['ratio']:.2f}x {vs['peer']}" if vs else "-",
                     _f(r.get("model_tflops"), ".2f"),
                     gib(r.get("peak_device_allocated")) if r.get("peak_device_allocated") is not None else "-",
                     gib(r.get("peak_rss")) if r.get("peak_rss") else "-",
                     (f"{_bytes(r['disk_read_per_step'])} / {_bytes(r['disk_write_per_step'])}"
                      if r.get("ok") else "-"),
                     "-" if ov is None else f"{ov:.2f}",
                     _bound_cell(b),
                     _f(r.get("step_over_bound"), ".2f"), note])
    return rows


def rss_over_plan(r: dict[str, Any]) -> Optional[float]:
    """(peak RSS - RSS before the model was built) / the planner's host bytes, for a run that has all
    three (pyinfinity's; the planner's host bytes are what its training state should hold in RAM)."""
    if not r.get("ok") or not r.get("plan_host_bytes") or not r.get("peak_rss") or r.get("rss_before_build") is None:
        return None
    return (r["peak_rss"] - r["rss_before_build"]) / r["plan_host_bytes"]


def ratio_lines(runs: Sequence[dict[str, Any]]) -> list[str]:
    """pyinfinity over the best DeepSpeed configuration of the same invocation, per tier against
    its DeepSpeed peer, step time over plain torch, host memory over the plan, runs below their
    bound, and the largest size each system trained. Flagged runs enter no ratio."""
    by = {(r["size"], r["system"]): r for r in runs}
    out = []
    accum = sorted({int(r.get("grad_accum") or 1) for r in runs})
    if accum != [1]:
        out.append("s/step and tokens/s are per optimizer step (micro-batches a step in these runs: "
                   + ", ".join(str(a) for a in accum) + "); ratios compare runs of one invocation")
    for r in runs:
        if below_bound(r):
            b = r["bound"]
            out.append(f"{r['size']} {r['system']}: ran {r['step_seconds']:.3f} s/step, below its bound of "
                       f"{b['seconds']:.3f} s ({b['bound_by']}; terms {b['terms']}): the bound is wrong; "
                       "the figure is left out of every ratio")
    for r in runs:
        if not base_system(r["system"]).startswith("pyinfinity") or not usable(r):
            continue
        vs = r.get("vs_best_deepspeed")
        if vs:
            out.append(f"{r['size']}: {r['system']} / the best DeepSpeed configuration of the same run "
                       f"({vs['peer']}) = {vs['ratio']:.2f}x tokens/s ({r['tokens_per_s']:,.0f} vs "
                       f"{vs['peer_tokens_per_s']:,.0f})")
            continue
        tried = [p for p in runs if p["size"] == r["size"] and p.get("invocation") == r.get("invocation")
                 and base_system(p["system"]).startswith("deepspeed")]
        if tried:
            out.append(f"{r['size']}: {r['system']} trains ({r['tokens_per_s']:,.0f} tok/s); no DeepSpeed "
                       "configuration of the same run has a usable figure: "
                       + "; ".join(f"{p['system']} " + ("below its bound" if below_bound(p) else
                                                       "failed: " + str(p.get("error", ""))[:80]) for p in tried))
    for (size, system), r in sorted(by.items(), key=lambda kv: kv[1].get("params") or 0):
        peer = PEERS.get(system)
        p = by.get((size, peer)) if peer else None
        if p is None or not usable(r) or p.get("invocation") != r.get("invocation"):
            continue
        if usable(p):
            out.append(f"{size}: {system} / {peer} (the same tiers) = {r['tokens_per_s'] / p['tokens_per_s']:.2f}x "
                       f"tokens/s ({r['tokens_per_s']:,.0f} vs {p['tokens_per_s']:,.0f})")
        elif not p.get("ok"):
            out.append(f"{size}: {system} trains ({r['tokens_per_s']:,.0f} tok/s); {peer} failed: "
                       f"{str(p.get('error', ''))[:100]}")
    for size in sorted({r["size"] for r in runs}, key=lambda z: next(r["params"] for r in runs if r["size"] == z)):
        ref = next((by[(size, t)] for t in ("torch-nocap", "torch") if (size, t) in by and usable(by[(size, t)])),
                   None)
        if ref is None:
            continue
        over = [f"{r['system']} {r['step_seconds'] / ref['step_seconds']:.2f}x" for r in runs
                if r["size"] == size and usable(r) and not base_system(r["system"]).startswith("torch")
                and r.get("invocation") == ref.get("invocation")]
        if over:
            out.append(f"{size}: step time over plain {ref['system']} ({ref['step_seconds']:.3f} s, nothing "
                       f"offloaded): " + ", ".join(over))
    for r in runs:
        share = rss_over_plan(r)
        if share is not None:
            out.append(f"{r['size']} {r['system']}: host memory {gib(r['peak_rss'] - r['rss_before_build'])} "
                       f"(peak RSS {gib(r['peak_rss'])} minus {gib(r['rss_before_build'])} before the model), "
                       f"plan {gib(r['plan_host_bytes'])}: {share:.2f}x the plan")
    for r in runs:  # the engine's own prediction against its own run: no ratio between runs, so
        pred = r.get("plan_predicted")  # a run below its analytic bound still gets its line
        if pred and r.get("ok") and r.get("step_seconds"):
            t = pred["terms"]
            out.append(f"{r['size']} {r['system']}: the engine's plan predicted {pred['seconds']:.3f} s/step "
                       f"(bound by {pred['bottleneck']}; compute {t['compute']:.3f}, host<->device "
                       f"{t['h2d']:.3f}, disk {t['disk']:.3f}, optimizer {t['optimizer']:.3f}), measured "
                       f"{r['step_seconds']:.3f}: predicted/measured {pred['seconds'] / r['step_seconds']:.2f}")
    largest: dict[str, dict[str, Any]] = {}
    for r in runs:
        if r.get("ok") and (r["system"] not in largest or r["params"] > largest[r["system"]]["params"]):
            largest[r["system"]] = r
    for system in sorted({r["system"] for r in runs}):
        r = largest.get(system)
        out.append(f"largest trained by {system}: "
                   + (f"{r['size']} ({_count(r['params'])} params)" if r else "none of the sizes run"))
    return out


def report(data: dict[str, Any], markdown: bool = False) -> str:
    from pyinfinity.bench.table import render, render_markdown

    for i in range(len(data["invocations"])):  # results files written before the field existed too
        compare_to_best_deepspeed(data["runs"], i)
    runs = latest_runs(data)
    rows = table_rows(runs)
    text = (render_markdown if markdown else render)(rows, HEADER)
    lines = [text, ""] + ratio_lines(runs)
    return "\n".join(lines)


def plot(data: dict[str, Any], path: str, timeline: Optional[str] = None) -> Optional[str]:
    """Throughput vs model size per system, and one run's step timeline; returns the run drawn."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = latest_runs(data)
    fig, (ax, tl) = plt.subplots(2, 1, figsize=(10, 9), gridspec_kw={"height_ratios": [3, 2]})
    for system in list(dict.fromkeys(r["system"] for r in sorted(runs, key=lambda r: (
            SYSTEMS.index(base_system(r["system"])) if base_system(r["system"]) in SYSTEMS else 99, r["system"])))):
        rs = sorted((r for r in runs if r["system"] == system), key=lambda r: r["params"])
        ok = [r for r in rs if r.get("ok")]
        line, = ax.plot([r["params"] / 1e9 for r in ok], [r["tokens_per_s"] for r in ok], marker="o", label=system)
        bad = [r for r in rs if not r.get("ok")]
        if bad:
            ax.scatter([r["params"] / 1e9 for r in bad], [0.5] * len(bad), marker="x", color=line.get_color())
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("parameters (billions)")
    ax.set_ylabel("tokens/s (x at the bottom: failed / out of memory)")
    cpu_only = all(str(r.get("device", "")).startswith("cpu") for r in runs)
    ax.set_title("training throughput (compute device: the CPU, no cap)" if cpu_only
                 else "training throughput under the device-memory cap")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    chosen = _timeline_run(runs, timeline)
    if chosen is None:
        tl.text(0.5, 0.5, "no traced run", ha="center", va="center")
        tl.set_axis_off()
    else:
        tr = chosen["trace"]
        lanes = [("phase", None), ("compute", "tab:blue"), ("h2d", "tab:green"), ("d2h", "tab:olive"),
                 ("disk_read", "tab:red"), ("disk_write", "tab:purple")]
        if "compute" not in tr:  # no device trace (CPU run): the phases are the compute
            lanes = [lane for lane in lanes if lane[0] not in ("compute", "h2d", "d2h")]
        colors = {"forward": "tab:cyan", "backward": "tab:orange", "step": "tab:gray"}
        for i, (lane, color) in enumerate(lanes):
            if lane == "phase":
                for name, s, e in tr.get("phases", []):
                    tl.broken_barh([(s, e - s)], (i - 0.4, 0.8), color=colors.get(name, "k"))
                    tl.text((s + e) / 2, i, name, ha="center", va="center", fontsize=7)
            else:
                iv = [(s, e - s) for s, e, *_ in tr.get(lane, [])]
                if iv:
                    tl.broken_barh(iv, (i - 0.4, 0.8), color=color)
        tl.set_yticks(range(len(lanes)), [n for n, _ in lanes])
        tl.set_xlabel("seconds from the start of the step")
        tl.set_title(f"one step: {chosen['system']} at {chosen['size']} "
                     f"({tr.get('seconds') or 0:.2f} s; traced, so slower than the timed steps)")
        tl.invert_yaxis()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return None if chosen is None else f"{chosen['system']}@{chosen['size']}"


def _timeline_run(runs: Sequence[dict[str, Any]], which: Optional[str]) -> Optional[dict[str, Any]]:
    traced = [r for r in runs if r.get("ok") and r.get("trace")]
    if which:
        system, _, size = which.partition("@")
        for r in traced:
            if r["system"] == system and (not size or r["size"] == size):
                return r
        raise BenchTrainError(f"--timeline {which}: no traced run of that system/size in the results")
    pyi = [r for r in traced if r["system"].startswith("pyinfinity")]
    pool = pyi or traced

    def key(r: dict[str, Any]) -> tuple:
        tr = r["trace"]
        disk = sum(n for lane in ("disk_read", "disk_write") for *_, n in tr.get(lane, []))
        return (r["params"], disk)

    return max(pool, key=key) if pool else None
