"""`pyinfinity bench train`: pyinfinity against DeepSpeed ZeRO-3 (and plain PyTorch) training the
same Llama-architecture models, on the same data, under the same device-memory cap.

Each (size, system) pair runs in its own process (:mod:`pyinfinity.bench.train_worker`); results
are appended to one JSON file, so a matrix too big for one session can be measured over several
and reported together. For every run an analytic lower bound on the step time is computed from
rates measured in the same invocation:

    bound = max(compute, PCIe, disk, CPU Adam)
      compute  = matmul FLOPs of the step / the device's measured matmul rate (model's shape, dtype)
      PCIe     = max(2 x parameter bytes / H2D, gradient bytes / D2H)   (GPU only; full duplex;
                 parameters kept on the GPU cross once, as the updated values: parameter bytes / H2D)
      disk     = max(bytes read / disk read rate, bytes written / disk write rate): the disk serves
                 reads and writes at once (their sum is reported beside it), where the bytes are
                 what the run's tiers force: optimizer on disk = 12 B/param read and written
                 (fp32 master, m, v; for pyinfinity only the state its run steps from disk, as units
                 stepped on the GPU never cross it); parameters on disk = read twice (forward,
                 backward), written once; the rates are the best of probes taken right before and
                 right after the run (a shared disk's rate moves)
      CPU Adam = parameters / the CPU Adam rate measured on the engine's kernel (offloaded optimizer only)

per optimizer step (with --grad-accum N, N micro-batches' compute), and the run's measured step
time over it is printed (1.0 = at the bound). A run faster than its bound shows the bound wrong:
it is flagged, and its figure is left out of every ratio.

Systems may carry a variant, ``pyinfinity-auto[resident_bytes=0]`` or
``deepspeed-z2-cpu[bf16.bf16_optimizer_states=true]``: dotted config keys set in that system's
config, so configurations of one engine are compared in one invocation; the full name labels the
run. "vs best DeepSpeed" is a run's tokens/s over the fastest DeepSpeed run (any configuration or
variant) of the same size in the same invocation.
"""
from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Optional, Sequence

from pyinfinity.bench.train_worker import RESULT_PREFIX, SYSTEMS, TIERS

log = logging.getLogger(__name__)

SCHEMA = "pyinfinity.bench.train/1"

_LLAMA = dict(vocab_size=32000, max_position_embeddings=2048, rms_norm_eps=1e-5, tie_word_embeddings=False)
# name -> LlamaConfig fields. "1.1b" is TinyLlama-1.1B's shape.
SIZES: dict[str, dict[str, Any]] = {
    "tiny": dict(_LLAMA, vocab_size=1024, hidden_size=64, intermediate_size=172, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=4),
    "125m": dict(_LLAMA, hidden_size=768, intermediate_size=2048, num_hidden_layers=12, num_attention_heads=12,
                 num_key_value_heads=12),
    "1.1b": dict(_LLAMA, hidden_size=2048, intermediate_size=5632, num_hidden_layers=22, num_attention_heads=32,
                 num_key_value_heads=4),
    "3b": dict(_LLAMA, hidden_size=3200, intermediate_size=8640, num_hidden_layers=26, num_attention_heads=32,
               num_key_value_heads=32),
    "7b": dict(_LLAMA, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32,
               num_key_value_heads=32),
    "10b": dict(_LLAMA, hidden_size=4608, intermediate_size=12288, num_hidden_layers=40, num_attention_heads=36,
                num_key_value_heads=36),
    "13b": dict(_LLAMA, hidden_size=5120, intermediate_size=13824, num_hidden_layers=40, num_attention_heads=40,
                num_key_value_heads=40),
    # LLaMA-30B's shape (the original LLaMA release)
    "30b": dict(_LLAMA, hidden_size=6656, intermediate_size=17920, num_hidden_layers=60, num_attention_heads=52,
                num_key_value_heads=52),
    # Llama-2-70B's shape (grouped-query attention: 8 KV heads)
    "70b": dict(_LLAMA, hidden_size=8192, intermediate_size=28672, num_hidden_layers=80, num_attention_heads=64,
                num_key_value_heads=8),
}
DEFAULT_SIZES_GPU = ("1.1b", "3b", "7b", "10b")
DEFAULT_SIZES_CPU = ("tiny",)
DEFAULT_SYSTEMS = ("pyinfinity-cpu", "pyinfinity-nvme", "pyinfinity-auto", "deepspeed-cpu", "deepspeed-z2-cpu",
                   "deepspeed-z3-gpu-params", "deepspeed-nvme", "torch")
PEERS = {"pyinfinity-cpu": "deepspeed-cpu", "pyinfinity-nvme": "deepspeed-nvme",
         "pyinfinity-nvme-params": "deepspeed-nvme-params", "pyinfinity-nvme-all": "deepspeed-nvme-all"}

# DeepSpeed ZeRO-3 offload settings as commonly used for one GPU (BENCHMARKS.md lists them)
DEEPSPEED_DEFAULTS: dict[str, Any] = {
    "prefetch_bucket_size": 5e7, "max_live_parameters": 1e8, "param_persistence_threshold": 1e5,
    "buffer_count": 6, "buffer_size": 1.5e8, "max_in_cpu": 1e9, "pipeline": False, "optimizer_buffer_count": 4,
    "aio": {"block_size": 1048576, "queue_depth": 32, "intra_op_parallelism": 4, "single_submit": False,
            "overlap_events": True},
}


class BenchTrainError(ValueError):
    """Bad arguments or an unusable results file."""


@dataclass
class Settings:
    sizes: list[str]
    systems: list[str]
    nvme_dir: str
    device: str = "auto"
    cap_bytes: Optional[int] = 8 << 30
    batch: int = 4
    seq: int = 1024
    steps: int = 5
    warmup: int = 2
    dtype: str = "auto"
    checkpointing: bool = True
    lr: float = 1e-4
    clip: float = 0.0  # gradient clipping (global norm) applied by every system; 0 = off
    grad_accum: int = 1  # micro-batches per optimizer step, every system
    seed: int = 0
    trace: bool = True
    timeout: float = 1800.0
    torch_sizes: str = "smallest"  # "smallest" | "all"
    deepspeed: dict[str, Any] = field(default_factory=lambda: json.loads(json.dumps(DEEPSPEED_DEFAULTS)))
    pyinfinity: dict[str, Any] = field(default_factory=dict)  # extra pyinfinity.* config keys
    log_dir: Optional[str] = None
    progress: bool = True


# ----------------------------------------------------------------------------------- systems


@dataclass(frozen=True)
class SystemSpec:
    """One entry of --systems: a system and its variant (``deepspeed-z2-cpu[bf16.enabled=true]``)."""

    label: str                 # the name as given (spaces removed): the row's label
    base: str                  # the system (a key of SYSTEMS)
    variant: tuple = ()        # ((dotted key, value), ...) set in the system's config


def _split_top(text: str, sep: str = ",") -> list[str]:
    """``text`` split at ``sep`` outside brackets, braces and quotes."""
    out, depth, quote, cur = [], 0, "", []
    for ch in text:
        if quote:
            quote = "" if ch == quote else quote
        elif ch in "\"'":
            quote = ch
        elif ch in "[{":
            depth += 1
        elif ch in "]}":
            depth -= 1
            if depth < 0:
                raise BenchTrainError(f"--systems {text!r}: unbalanced {ch!r}")
        elif ch == sep and depth == 0:
            out.append("".join(cur))
            cur = []
            continue
        cur.append(ch)
    if depth or quote:
        raise BenchTrainError(f"--systems {text!r}: unclosed {'quote' if quote else 'bracket'}")
    out.append("".join(cur))
    return out


def _json_value(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def parse_system(entry: str) -> SystemSpec:
    """``name`` or ``name[key=value,key=value]``: values are JSON where they parse, else strings."""
    entry = entry.strip()
    name, bracket, rest = entry.partition("[")
    name = name.strip()
    if name not in SYSTEMS:
        raise BenchTrainError(f"--systems: unknown {name or entry}; choose from {', '.join(SYSTEMS)}")
    if not bracket:
        return SystemSpec(label=name, base=name)
    if not rest.endswith("]"):
        raise BenchTrainError(f"--systems {entry}: a variant is name[key=value,...], ending in ']'")
    items = [x.strip() for x in _split_top(rest[:-1]) if x.strip()]
    if not items:
        raise BenchTrainError(f"--systems {entry}: empty variant")
    if name.startswith("torch"):
        raise BenchTrainError(f"--systems {entry}: {name} has no config for a variant to set")
    variant: list[tuple[str, Any]] = []
    for item in items:
        key, eq, val = item.partition("=")
        key = key.strip()
        if not eq or not key or any(not part for part in key.split(".")):
            raise BenchTrainError(f"--systems {entry}: {item!r} is not KEY=VALUE (a dotted config key)")
        if key in (k for k, _ in variant):
            raise BenchTrainError(f"--systems {entry}: {key} is set twice")
        variant.append((key, _json_value(val.strip())))
    label = f"{name}[{','.join(items)}]"
    return SystemSpec(label=label, base=name, variant=tuple(variant))


def parse_systems(text: str) -> list[str]:
    """--systems as a list of labels, each checked (see parse_system); a label given twice is an error."""
    labels: list[str] = []
    for entry in _split_top(text):
        if not entry.strip():
            continue
        label = parse_system(entry).label
        if label in labels:
            raise BenchTrainError(f"--systems: {label} is given twice")
        labels.append(label)
    return labels


def base_system(label: str) -> str:
    """The system of a run's label (``pyinfinity-auto[...]`` -> ``pyinfinity-auto``)."""
    return label.partition("[")[0]


# ----------------------------------------------------------------------------------- sizes


def model_fields(size: str, seq: int) -> dict[str, Any]:
    """LlamaConfig fields of a named size, or of a JSON config file (a transformers config.json)."""
    if size in SIZES:
        d = dict(SIZES[size])
    elif size.endswith(".json") and os.path.isfile(size):
        with open(size) as f:
            raw = json.load(f)
        keep = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "max_position_embeddings", "rms_norm_eps", "tie_word_embeddings")
        d = {k: raw[k] for k in keep if k in raw}
        missing = [k for k in keep[:5] if k not in d]
        if missing:
            raise BenchTrainError(f"--sizes: {size} lacks {', '.join(missing)} (expected a Llama config.json)")
    else:
        raise BenchTrainError(f"--sizes: unknown size {size!r}; choose from {', '.join(SIZES)} or give a "
                              "Llama config.json path")
    d["max_position_embeddings"] = max(int(d.get("max_position_embeddings", 2048)), seq)
    return d


def size_facts(fields: dict[str, Any], dtype: str, batch: int, seq: int, checkpointing: bool) -> dict[str, Any]:
    from pyinfinity.plan.sizes import llama_sizes

    sz = llama_sizes(dict(fields, model_type="llama"), dtype=dtype)
    return {"params": sz.numel, "param_bytes": sz.param_bytes, "itemsize": sz.itemsize,
            "flops_per_step": sz.flops_per_step(batch, seq, checkpointing)}


# ----------------------------------------------------------------------------------- the bound


def tier_fractions(system: str, placement: Optional[dict]) -> tuple[float, float]:
    """(share of parameters on disk, share of optimizer state on disk) of a run."""
    ptier, otier = TIERS[base_system(system)]
    if ptier != "auto":
        return float(ptier == "nvme"), float(otier == "nvme")

    def share(d: Optional[dict], homes: tuple[str, ...]) -> float:
        d = {k: v for k, v in (d or {}).items() if k in homes}
        total = sum(d.values())
        return d.get("nvme", 0) / total if total else 0.0

    placement = placement or {}
    # the optimizer's "device" bytes are copies of homes in RAM or on disk, not homes of their own
    return share(placement.get("params"), ("gpu", "cpu", "nvme")), share(placement.get("optimizer"), ("cpu", "nvme"))


def bound(system: str, facts: dict[str, Any], rates: dict[str, float], cuda: bool,
          placement: Optional[dict] = None) -> dict[str, Any]:
    """The analytic lower bound of one optimizer step (see the module's docstring), term by term.
    ``facts["flops_per_step"]`` is the whole optimizer step's (every micro-batch)."""
    system = base_system(system)
    n, pb = facts["params"], facts["param_bytes"]
    terms: dict[str, float] = {"compute": facts["flops_per_step"] / rates["matmul"]}
    offloaded = not system.startswith("torch")
    if offloaded and cuda:
        if TIERS[system][0] == "device":  # parameters live on the GPU: gradients out, new values in
            terms["pcie"] = max(pb / rates["h2d"], pb / rates["d2h"])
        else:
            terms["pcie"] = max(2 * pb / rates["h2d"], pb / rates["d2h"])
    f_par, f_opt = tier_fractions(system, placement) if offloaded else (0.0, 0.0)
    opt_disk = 12 * n * f_opt
    if placement and placement.get("optimizer_disk_per_step") is not None:
        opt_disk = placement["optimizer_disk_per_step"]  # the run's own: state stepped on the GPU stays off the disk
    read = 2 * pb * f_par + opt_disk
    write = pb * f_par + opt_disk
    serial = None
    if read or write:
        if rates.get("disk_read", 0) <= 0 or rates.get("disk_write", 0) <= 0:
            terms["disk"] = float("nan")
        else:
            # the disk serves reads and writes at once: the slower of the two bounds the step;
            # their sum (one after the other) is kept beside it
            terms["disk"] = max(read / rates["disk_read"], write / rates["disk_write"])
            serial = round(read / rates["disk_read"] + write / rates["disk_write"], 5)
    if offloaded:
        terms["cpu_adam"] = n / rates["adam"]
    finite = {k: v for k, v in terms.items() if v == v}
    name = max(finite, key=lambda k: finite[k])
    out = {"seconds": finite[name], "bound_by": name, "terms": {k: round(v, 5) for k, v in terms.items()},
           "disk_bytes": {"read": int(read), "write": int(write)}, "disk_share": {"params": f_par, "optimizer": f_opt}}
    if serial is not None:
        out["disk_serial_seconds"] = serial
    return out


def measure_bound_rates(device: str, nvme_dir: str) -> dict[str, Any]:
    """Host<->device copies, disk, CPU Adam (measured once per invocation); matmul per size later."""
    from pyinfinity.plan.rates import measure_adam, measure_copies

    t0 = time.perf_counter()
    out: dict[str, Any] = {"adam": measure_adam(8_000_000, 5)}
    h2d, d2h, _ = measure_copies(device, 256 << 20 if device.startswith("cuda") else 64 << 20, 5)
    out.update(h2d=h2d, d2h=d2h)
    out.update(probe_disk(nvme_dir))
    out["seconds"] = round(time.perf_counter() - t0, 2)
    return out


def probe_disk(nvme_dir: str) -> dict[str, Any]:
    """One probe of the swap directory's disk: read and write bytes/s (0 when it cannot be measured)."""
    from pyinfinity.plan.rates import measure_disk

    try:
        r, w, lat = measure_disk(nvme_dir, 256 << 20, 3)
        return {"disk_read": r, "disk_write": w, "disk_latency": lat}
    except OSError as exc:
        log.warning("disk rates at %s could not be measured (%s); disk bounds will be missing", nvme_dir, exc)
        return {"disk_read": 0.0, "disk_write": 0.0, "disk_error": str(exc)}


def best_disk_rates(*probes: dict[str, Any]) -> dict[str, float]:
    """The best read and the best write rate of several probes of one disk (a bound takes the
    fastest the disk was seen to go)."""
    return {k: max(float(p.get(k) or 0.0) for p in probes) for k in ("disk_read", "disk_write")}


def uses_disk(system: str) -> bool:
    """Whether a run of ``system`` may put state on the disk (its bound then has a disk term)."""
    return any(t in ("nvme", "auto") for t in TIERS[base_system(system)])


def measure_matmul_rate(device: str, dtype: str, fields: dict[str, Any], tokens: int) -> float:
    """FLOP/s of the model's biggest matmul shape (tokens x hidden @ hidden x intermediate)."""
    import torch

    from pyinfinity.plan.rates import measure_matmul

    dt = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[dtype]
    m = min(tokens, 8192)
    return measure_matmul(device, m, int(fields["hidden_size"]), int(fields["intermediate_size"]), dt, reps=5)


# ----------------------------------------------------------------------------------- results file


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


# ----------------------------------------------------------------------------------- running


def _gpu_present() -> bool:
    import torch

    return torch.cuda.is_available()


def _resolve(settings: Settings) -> tuple[str, str]:
    device = settings.device
    if device == "auto":
        device = "cuda" if _gpu_present() else "cpu"
    if device == "cuda":
        device = "cuda:0"  # each worker is a fresh process: torch.cuda.set_device needs an index
    dtype = settings.dtype
    if dtype == "auto":
        dtype = "bf16" if device.startswith("cuda") else "fp32"
    return device, dtype


def _summarise(res: dict[str, Any], warmup: int, tokens: int, facts: dict[str, Any]) -> None:
    steps = res.get("steps") or []
    steady = [s["seconds"] for s in steps[warmup:]] or [s["seconds"] for s in steps]
    if steady:
        t = statistics.median(steady)
        res["step_seconds"] = t
        res["tokens_per_s"] = tokens / t
        res["model_tflops"] = facts["flops_per_step"] / t / 1e12
        tail = steps[warmup:] or steps
        res["disk_read_per_step"] = int(statistics.mean(s["disk_read"] for s in tail))
        res["disk_write_per_step"] = int(statistics.mean(s["disk_write"] for s in tail))


def _disk_need(system: str, facts: dict[str, Any]) -> int:
    f_par, f_opt = tier_fractions(system, None) if TIERS[base_system(system)][0] != "auto" else (0.0, 0.0)
    return int(12 * facts["params"] * f_opt + facts["param_bytes"] * f_par)


def run_one(spec: dict[str, Any], timeout: float, log_path: str, on_line: Any = None) -> dict[str, Any]:
    """Runs the worker on ``spec``; its result, or a failed result naming what happened."""
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False, prefix="pyinfinity-bench-") as f:
        json.dump(spec, f)
        spec_path = f.name
    t0 = time.perf_counter()
    cmd = [sys.executable, "-m", "pyinfinity.bench.train_worker", spec_path]
    result: Optional[dict[str, Any]] = None
    out_lines: list[str] = []
    try:
        with open(log_path, "w") as logf:
            proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                    start_new_session=True, bufsize=1)

            def pump_err() -> None:
                assert proc.stderr is not None
                for line in proc.stderr:
                    logf.write(line)
                    logf.flush()
                    if on_line is not None:
                        on_line(line.rstrip())

            th = threading.Thread(target=pump_err, daemon=True)
            th.start()
            assert proc.stdout is not None

            def pump_out() -> None:
                assert proc.stdout is not None
                for line in proc.stdout:
                    out_lines.append(line)

            to = threading.Thread(target=pump_out, daemon=True)
            to.start()
            try:
                rc = proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                _kill_group(proc)
                rc = None
            to.join(10)
            th.join(10)
        for line in out_lines:
            if line.startswith(RESULT_PREFIX):
                result = json.loads(line[len(RESULT_PREFIX):])
        if result is None:
            tail = _tail(log_path, 15)
            if rc is None:
                why = f"timed out after {timeout:g} s (--timeout)"
            elif rc < 0:
                sig = signal.Signals(-rc).name if -rc in signal.Signals._value2member_map_ else str(-rc)
                why = f"killed by {sig}" + (" (the kernel's OOM killer: host RAM ran out)" if rc == -9 else "")
            else:
                why = f"the worker exited with status {rc} without a result"
            result = {"system": spec["system"], "size": spec["size"], "ok": False, "error": why, "log_tail": tail}
    finally:
        os.unlink(spec_path)
    result["wall_seconds"] = round(time.perf_counter() - t0, 2)
    result["log"] = log_path
    return result


def _kill_group(proc: subprocess.Popen) -> None:
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


def _tail(path: str, n: int) -> str:
    try:
        with open(path, errors="replace") as f:
            return "".join(f.readlines()[-n:])
    except OSError:
        return ""


def plan_runs(settings: Settings) -> list[tuple[str, str]]:
    """The (size, system) pairs to run, smallest size first; plain torch at the smallest size only
    unless ``torch_sizes == "all"`` (it cannot fit larger ones under a cap anyway)."""
    pairs = []
    smallest = settings.sizes[0] if settings.sizes else None
    for size in settings.sizes:
        for system in settings.systems:
            if base_system(system) == "torch" and settings.torch_sizes != "all" and size != smallest:
                continue
            pairs.append((size, system))
    return pairs


def _file_name(label: str) -> str:
    """A run's label as a file name (a variant's brackets, dots and slashes replaced)."""
    return "".join(c if c.isalnum() or c in "-_.=" else "_" for c in label)


def _spec(settings: Settings, size: str, label: str, fields: dict[str, Any], device: str, dtype: str,
          cuda: bool, k: int) -> dict[str, Any]:
    sysspec = parse_system(label)
    return {"system": sysspec.base, "label": label, "variant": dict(sysspec.variant), "size": size,
            "model": fields, "device": device, "dtype": dtype, "batch": settings.batch, "seq": settings.seq,
            "grad_accum": settings.grad_accum, "steps": settings.steps, "warmup": settings.warmup,
            "checkpointing": settings.checkpointing, "lr": settings.lr, "clip": settings.clip,
            "seed": settings.seed, "trace": settings.trace, "cap_bytes": settings.cap_bytes if cuda else None,
            "nvme_dir": os.path.join(settings.nvme_dir, f"{_file_name(label)}-{size}"),
            "deepspeed": settings.deepspeed, "pyinfinity_overrides": settings.pyinfinity,
            "master_port": 29500 + (os.getpid() + k) % 2000}


def check_configs(settings: Settings, fields: dict[str, Any], device: str, dtype: str, cuda: bool) -> None:
    """Builds every run's config before anything runs: a variant's key that does not fit the config's
    shape is an error here, and so is one pyinfinity's config rejects (its own message, naming the
    key). DeepSpeed checks its config when the run starts: its error is that run's row."""
    from pyinfinity.bench.train_worker import pyinfinity_config, system_config
    from pyinfinity.config import ConfigError, load_config

    for label in settings.systems:
        spec = _spec(settings, settings.sizes[0], label, fields, device, dtype, cuda, 0)
        try:
            system_config(spec)
            if spec["system"].startswith("pyinfinity"):
                load_config(pyinfinity_config(spec))
        except (ConfigError, ValueError) as exc:
            raise BenchTrainError(f"--systems {label}: {exc}") from exc


def run_bench(settings: Settings, json_path: Optional[str]) -> dict[str, Any]:
    """Measures the rates, runs every (size, system) pair, appends to ``json_path``; returns the data."""
    from pyinfinity.bench.machine import machine_info

    for label in settings.systems:
        parse_system(label)  # unknown systems and malformed variants, before anything runs
    twice = sorted({s for s in settings.systems if settings.systems.count(s) > 1})
    if twice:
        raise BenchTrainError(f"--systems: {', '.join(twice)} given twice")
    if not settings.sizes or not settings.systems:
        raise BenchTrainError("nothing to run: --sizes and --systems must name at least one each")
    if settings.steps <= settings.warmup:
        raise BenchTrainError(f"--steps {settings.steps} must exceed --warmup {settings.warmup} (the timed "
                              "steps come after the warm-up ones)")
    if settings.grad_accum < 1:
        raise BenchTrainError(f"--grad-accum: {settings.grad_accum} is below 1")
    device, dtype = _resolve(settings)
    cuda = device.startswith("cuda")
    if not cuda and settings.cap_bytes:
        log.info("no GPU: the device-memory cap does not apply (the CPU is the compute device)")
    fields = {s: model_fields(s, settings.seq) for s in settings.sizes}
    check_configs(settings, fields[settings.sizes[0]], device, dtype, cuda)
    data = load_results(json_path)
    os.makedirs(settings.nvme_dir, exist_ok=True)
    log_dir = settings.log_dir or tempfile.mkdtemp(prefix="pyinfinity-bench-train-")
    os.makedirs(log_dir, exist_ok=True)
    micro_tokens = settings.batch * settings.seq
    tokens = micro_tokens * settings.grad_accum  # per optimizer step
    print(f"bench train: device {device}, {dtype}, batch {settings.batch} x {settings.seq} tokens"
          + (f" x {settings.grad_accum} micro-batches a step" if settings.grad_accum > 1 else "")
          + f", {settings.steps} steps ({settings.warmup} warm-up), cap "
          f"{_gib(settings.cap_bytes) if settings.cap_bytes and cuda else 'none'}, swap {settings.nvme_dir}, "
          f"logs {log_dir}", flush=True)
    print("measuring rates for the bound (copies, disk, CPU Adam) ...", flush=True)
    rates = measure_bound_rates(device, settings.nvme_dir)
    matmul: dict[str, float] = {}
    for s in settings.sizes:
        matmul[s] = measure_matmul_rate(device, dtype, fields[s], micro_tokens)
    print("  " + ", ".join([f"H2D {rates['h2d'] / 1e9:.1f} GB/s", f"D2H {rates['d2h'] / 1e9:.1f} GB/s",
                             f"disk read {rates['disk_read'] / 1e9:.2f} GB/s",
                             f"write {rates['disk_write'] / 1e9:.2f} GB/s",
                             f"CPU Adam {rates['adam'] / 1e9:.2f} Gparam/s"]
                            + [f"matmul[{s}] {v / 1e12:.1f} TFLOP/s" for s, v in matmul.items()]), flush=True)
    inv = {"date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
           "machine": asdict(machine_info(settings.nvme_dir)), "rates": dict(rates, matmul=matmul),
           "settings": {k: v for k, v in asdict(settings).items() if k not in ("progress",)},
           "device": device, "dtype": dtype, "argv": sys.argv[1:]}
    data["invocations"].append(inv)
    inv_index = len(data["invocations"]) - 1
    if json_path:
        save_results(json_path, data)
    pairs = plan_runs(settings)
    from tqdm import tqdm

    bar = tqdm(total=len(pairs), unit="run", disable=not settings.progress, file=sys.stderr, dynamic_ncols=True)
    try:
        for k, (size, system) in enumerate(pairs):
            facts = size_facts(fields[size], dtype, settings.batch * settings.grad_accum, settings.seq,
                               settings.checkpointing)
            bar.set_description(f"{size} {system}")
            spec = _spec(settings, size, system, fields[size], device, dtype, cuda, k)
            need = _disk_need(system, facts)
            free = shutil.disk_usage(settings.nvme_dir).free
            probes: list[dict[str, Any]] = []
            if need and need > free:
                res = {"system": system, "size": size, "ok": False, "params": facts["params"],
                       "error": f"not run: its tiers need {_gib(need)} on disk, {_gib(free)} free at "
                                f"{settings.nvme_dir} (give --nvme a bigger drive, or leave this size out)"}
            else:
                os.makedirs(spec["nvme_dir"], exist_ok=True)
                log_path = os.path.join(log_dir, f"{size}-{_file_name(system)}.log")

                def on_line(line: str, _bar: Any = bar) -> None:
                    if line.startswith("step "):
                        _bar.set_postfix_str(line[:60])

                if uses_disk(system):  # the disk's rates right before and right after the run
                    probes.append(probe_disk(settings.nvme_dir))
                res = run_one(spec, settings.timeout, log_path, on_line)
                if uses_disk(system):
                    probes.append(probe_disk(settings.nvme_dir))
                shutil.rmtree(spec["nvme_dir"], ignore_errors=True)
            res["system"] = system  # the label, variant included
            res["base_system"] = spec["system"]
            if spec["variant"]:
                res["variant"] = spec["variant"]
            res["invocation"] = inv_index
            res["batch"], res["seq"], res["dtype"], res["device"] = settings.batch, settings.seq, dtype, device
            res["grad_accum"], res["tokens_per_step"] = settings.grad_accum, tokens
            res["checkpointing"] = settings.checkpointing
            # the analytic count, the same for every system of a size; the worker's own count beside it
            res["params_counted"] = res.get("params")
            res["params"] = facts["params"]
            res["flops_per_step"] = facts["flops_per_step"]
            if res.get("ok"):
                _summarise(res, settings.warmup, tokens, facts)
            rr = dict(rates, matmul=matmul[size])
            if probes:
                res["disk_probes"] = probes
                rr.update(best_disk_rates(*probes))
            res["bound"] = bound(system, facts, rr, cuda, res.get("placement"))
            res["bound"]["rates"] = {k: rr[k] for k in ("disk_read", "disk_write")}
            if res.get("step_seconds"):
                res["step_over_bound"] = res["step_seconds"] / res["bound"]["seconds"]
                res["below_bound"] = res["step_over_bound"] < 1.0
            data["runs"].append(res)
            compare_to_best_deepspeed(data["runs"], inv_index)
            if json_path:
                save_results(json_path, data)
            bar.update(1)
            tqdm.write(one_line(res), file=sys.stdout)
    finally:
        bar.close()
    return data


# ----------------------------------------------------------------------------------- reporting


def _gib(n: Optional[float]) -> str:
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
            f"peak GPU {_gib(r.get('peak_device_allocated'))}, {r['step_over_bound']:.2f}x the bound "
            f"({r['bound']['bound_by']})" + (" BELOW THE BOUND: the bound is wrong" if below_bound(r) else "")
            + (f", {vs['ratio']:.2f}x the best DeepSpeed so far ({vs['peer']})" if vs else ""))


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
        vs = r.get("vs_best_deepspeed")
        ov = r.get("overlap_fraction")
        rows.append([r["size"], _count(r.get("params") or 0), r["system"],
                     _f(r.get("step_seconds"), ".3f"), _f(r.get("tokens_per_s"), ",.0f"),
                     f"{vs['ratio']:.2f}x {vs['peer']}" if vs else "-",
                     _f(r.get("model_tflops"), ".2f"),
                     _gib(r.get("peak_device_allocated")) if r.get("peak_device_allocated") is not None else "-",
                     _gib(r.get("peak_rss")) if r.get("peak_rss") else "-",
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
            out.append(f"{r['size']} {r['system']}: host memory {_gib(r['peak_rss'] - r['rss_before_build'])} "
                       f"(peak RSS {_gib(r['peak_rss'])} minus {_gib(r['rss_before_build'])} before the model), "
                       f"plan {_gib(r['plan_host_bytes'])}: {share:.2f}x the plan")
    for r in runs:
        pred = r.get("plan_predicted")
        if pred and usable(r) and r.get("step_seconds"):
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
