"""The analytic lower bound of a `pyinfinity bench train` run's optimizer step, from rates measured
in the same invocation:

    bound = max(compute, PCIe, disk, CPU Adam)
      compute  = matmul FLOPs of the step / the device's measured matmul rate (model's shape, dtype),
                 plus, on a GPU, the step of pyinfinity's units stepped there (their parameters /
                 the format's device step rate, measured as the engine runs it: on the compute
                 stream, nothing hides it)
      PCIe     = max(2 x parameter bytes / H2D, gradient bytes / D2H)   (GPU only; full duplex;
                 parameters kept on the GPU cross once, as the updated values: parameter bytes / H2D)
      disk     = max(bytes read / disk read rate, bytes written / disk write rate): the disk serves
                 reads and writes at once (their sum is reported beside it), where the bytes are
                 what the run's tiers force: optimizer on disk = its state's bytes a parameter read
                 and written (fp32 master, m, v: 12; pyinfinity's 8bit state: 6.03; a bf16 master
                 with bf16 moments: 6; ``optimizer_state_bytes``), for pyinfinity the bytes its run
                 reports it steps from disk (units stepped on the GPU never cross it); parameters on
                 disk = read twice (forward, backward), written once; the rates are the best of
                 probes taken right before and right after the run (a shared disk's rate moves)
      CPU Adam = parameters stepped on the CPU / the CPU Adam rate measured on the engine's kernel
                 (offloaded optimizer only; pyinfinity's units with device optimizer state are
                 stepped on the GPU, and the run's placement says how many parameters they hold)

With LoRA (``--lora``) the base is frozen: it crosses PCIe twice a step (forward, and backward or
its recompute) less what a run keeps resident, and is never written; gradients, optimizer state
and CPU Adam are the adapters' alone, and the compute term has no weight gradients of the base.

per optimizer step (with --grad-accum N, N micro-batches' compute), and the run's measured step
time over it is printed (1.0 = at the bound). A run faster than its bound shows the bound wrong:
it is flagged, and its figure is left out of every ratio.
"""
from __future__ import annotations

import logging
import time
from typing import Any, Optional

from pyinfinity.bench.train_matrix import base_system
from pyinfinity.bench.train_worker import TIERS
from pyinfinity.plan.rates import device_adam_key

log = logging.getLogger(__name__)


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


def optimizer_state(spec: dict[str, Any]) -> tuple[str, float]:
    """The run's optimizer state as its config asks for it: (the CPU step kernel its format uses,
    "fp32", "8bit" or "bf16": the key of the CPU Adam rate its bound takes; the bytes a trainable
    parameter keeps in RAM or on disk). pyinfinity: its format (``pyinfinity.optimizer_state``, or
    DeepSpeed's ``bf16`` keys), whose quantised figure (``Adam8bit.bytes_per_param``) leaves out the
    small shards that stay fp32 (the run's placement then reports the exact bytes,
    ``optimizer_disk_per_step``). DeepSpeed: its fp32 or bf16 master and moments, the bf16 moments
    timed with pyinfinity's bf16 kernel as its fp32 state is with the fp32 one. MegaTrain: bf16
    weights (its only copy) and fp32 moments."""
    from pyinfinity.bench.train_worker import system_config

    if spec["system"] == "megatrain":
        return "fp32", 2.0 + 8.0
    cfg = system_config(spec) or {}
    if spec["system"].startswith("pyinfinity"):
        from pyinfinity.config import load_config
        from pyinfinity.zero.optim.formats import make_state_format

        name = load_config(cfg).optimizer_state_format
        return name, float(make_state_format(name, True).bytes_per_param)
    bf16 = cfg.get("bf16") or {}
    master = 2 if bf16.get("bf16_master_weights_and_grads") else 4
    moments = bf16.get("bf16_optimizer_states")
    return ("bf16" if moments else "fp32"), float(master + (4 if moments else 8))


def optimizer_state_bytes(spec: dict[str, Any]) -> float:
    """The bytes a trainable parameter's optimizer state keeps in RAM or on disk (``optimizer_state``)."""
    return optimizer_state(spec)[1]


def adam_rate_for(rates: dict[str, Any], state_format: str) -> float:
    """``state_format``'s CPU Adam rate from ``measure_bound_rates``' figures; a compressed
    format's kernel is probed the first time a run uses it and kept in ``rates``."""
    key = adam_rate_key(state_format)
    if key not in rates:
        from pyinfinity.probes import ADAM_PROBE_NUMEL, measure_adam

        rates[key] = measure_adam(ADAM_PROBE_NUMEL, 5, state=state_format)
    return float(rates[key])


def device_adam_rate_for(rates: dict[str, Any], state_format: str, device: str) -> float:
    """``state_format``'s step rate on ``device`` (``probes.measure_device_adam``), probed the
    first time a run steps units there and kept in ``rates``."""
    from pyinfinity.probes import DEVICE_ADAM_PROBE_NUMEL, measure_device_adam

    key = device_adam_key(state_format)
    if key not in rates:
        rates[key] = measure_device_adam(device, state_format, DEVICE_ADAM_PROBE_NUMEL, 5)
    return float(rates[key])


def adam_rate_key(state_format: str) -> str:
    """The key of ``measure_bound_rates``' figures that holds ``state_format``'s CPU Adam rate."""
    return "adam" if state_format == "fp32" else f"adam_{state_format}"


def bound(system: str, facts: dict[str, Any], rates: dict[str, float], cuda: bool,
          placement: Optional[dict] = None, state_bytes: float = 12.0,
          state_format: str = "fp32") -> dict[str, Any]:
    """The analytic lower bound of one optimizer step (see the module's docstring), term by term.
    ``facts["flops_per_step"]`` is the whole optimizer step's (every micro-batch); ``state_bytes``
    the run's optimizer state a parameter (``optimizer_state_bytes``); ``state_format`` its CPU
    kernel (the first of ``optimizer_state``), whose rate in ``rates`` the CPU Adam term takes."""
    system = base_system(system)
    n, pb = facts["params"], facts["param_bytes"]
    frozen = facts.get("frozen_bytes", 0)  # LoRA: the base's bytes (no gradient, never written)
    n_train = facts.get("trainable", n)
    terms: dict[str, float] = {"compute": facts["flops_per_step"] / rates["matmul"]}
    offloaded = not system.startswith("torch")
    if offloaded and cuda:
        if TIERS[system][0] == "device":  # parameters live on the GPU: gradients out, new values in
            terms["pcie"] = max((pb - frozen) / rates["h2d"], (pb - frozen) / rates["d2h"])
        else:
            streamed = pb
            if frozen:  # what a run keeps resident is not fetched again
                streamed = max(0, pb - int(((placement or {}).get("params") or {}).get("device(resident)", 0)))
            terms["pcie"] = max(2 * streamed / rates["h2d"], (pb - frozen) / rates["d2h"])
    f_par, f_opt = tier_fractions(system, placement) if offloaded else (0.0, 0.0)
    opt_disk = state_bytes * n_train * f_opt
    if placement and placement.get("optimizer_disk_per_step") is not None:
        opt_disk = placement["optimizer_disk_per_step"]  # the run's own: state stepped on the GPU stays off the disk
    read = 2 * pb * f_par + opt_disk
    write = (pb - frozen) * f_par + opt_disk
    serial = None
    if read or write:
        if rates.get("disk_read", 0) <= 0 or rates.get("disk_write", 0) <= 0:
            terms["disk"] = float("nan")
        else:
            # the disk serves reads and writes at once: the slower of the two bounds the step;
            # their sum (one after the other) is kept beside it
            terms["disk"] = max(read / rates["disk_read"], write / rates["disk_write"])
            serial = round(read / rates["disk_read"] + write / rates["disk_write"], 5)
    if offloaded:  # the parameters a run steps on the GPU (pyinfinity's device optimizer state) skip the CPU
        on_device = int((placement or {}).get("optimizer_device_numel", 0))
        terms["cpu_adam"] = max(0, n_train - on_device) / rates.get(adam_rate_key(state_format), rates["adam"])
        device_rate = rates.get(device_adam_key(state_format), 0.0)
        if cuda and on_device and device_rate > 0:  # their step is on the compute stream
            terms["compute"] += on_device / device_rate
    finite = {k: v for k, v in terms.items() if v == v}
    name = max(finite, key=lambda k: finite[k])
    out = {"seconds": finite[name], "bound_by": name, "terms": {k: round(v, 5) for k, v in terms.items()},
           "disk_bytes": {"read": int(read), "write": int(write)}, "disk_share": {"params": f_par, "optimizer": f_opt}}
    if serial is not None:
        out["disk_serial_seconds"] = serial
    return out


def measure_bound_rates(device: str, nvme_dir: str) -> dict[str, Any]:
    """Host<->device copies, disk, CPU Adam (measured once per invocation); matmul per size later."""
    from pyinfinity.probes import ADAM_PROBE_NUMEL, measure_adam, measure_copies

    t0 = time.perf_counter()
    out: dict[str, Any] = {"adam": measure_adam(ADAM_PROBE_NUMEL, 5)}
    h2d, d2h, _ = measure_copies(device, 256 << 20 if device.startswith("cuda") else 64 << 20, 5)
    out.update(h2d=h2d, d2h=d2h)
    out.update(probe_disk(nvme_dir))
    out["seconds"] = round(time.perf_counter() - t0, 2)
    return out


def probe_disk(nvme_dir: str) -> dict[str, Any]:
    """One probe of the swap directory's disk: read and write bytes/s (0 when it cannot be measured)."""
    from pyinfinity.probes import measure_disk

    try:
        probe = measure_disk(nvme_dir, 256 << 20, 3)
        return {"disk_read": probe.read, "disk_write": probe.write, "disk_latency": probe.latency,
                "disk_duplex": probe.duplex}
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

    from pyinfinity.probes import measure_matmul

    dt = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[dtype]
    m = min(tokens, 8192)
    return measure_matmul(device, m, int(fields["hidden_size"]), int(fields["intermediate_size"]), dt, reps=5)
