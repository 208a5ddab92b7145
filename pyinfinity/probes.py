"""The probes that time this machine for the planner: host<->device copy, disk read/write, CPU
Adam, device matmul, host memcpy, the device's optimizer step, the host's gradient add and one
micro-batch of the model itself, gathered into a :class:`~pyinfinity.plan.rates.Rates`.

They run the engine's own code (the swap engine, the optimizer-state formats' steps, the gradient
add), so they sit above both ``zero/`` and ``plan/``: the planner takes the rates it is given, and
the engine (through :class:`MachineProbes`) or the command line measures them.

Disk rates come from a saved JSON when given (``pyinfinity bench io --json`` results, a rates file
written by :meth:`Rates.save`; a ``pyinfinity tune`` output holds only the chosen ``aio`` settings,
which the probe then uses), else from a short probe through ``pyinfinity.swap.SwapEngine`` in the
swap directory (O_DIRECT where the filesystem allows, as the engine does). Everything else is
timed here: the engine's one-pass CPU Adam kernel on ADAM_PROBE_NUMEL parameters with the engine's
optimizer thread count (and the kernel of the optimizer-state format planned, when it is not
fp32), on a GPU the planned format's step there as the engine runs it for units whose state lives
on the device, a matmul of the model's shape on the compute device, pinned copies (GPU) or memcpy
(CPU device), a host memcpy of MEMCPY_PROBE_BYTES, and under gradient accumulation the engine's own
gradient add (the Adam, memcpy and add probes reach beyond the last-level cache, as the engine's
work does). ``measure_decoder_compute`` times one micro-batch of the model itself (1 and 2 of its
layers) where a figure from FLOPs and the matmul rate would miss the small kernels around them.
Figures are medians of a few repetitions.
"""
from __future__ import annotations

import errno
import functools
import json
import logging
import os
import statistics
import time
from typing import Any, Callable, NamedTuple, Optional, Union

import torch

from pyinfinity.plan.hardware import DEFAULT_DISK, DEFAULT_GPU_MATMUL, DEFAULT_LINK, DISK_PRESETS, LINK_PRESETS
from pyinfinity.layout.charges import TrainShape
from pyinfinity.layout.sizes import ModelSizes
from pyinfinity.plan.rates import Rates, device_adam_key, device_is_here, load_rates_file
from pyinfinity.plan.resolve import aio_options, engine_optimizer_threads

log = logging.getLogger(__name__)

ADAM_PROBE_NUMEL = 64_000_000
"""Parameters of the CPU Adam probe, quick or not. The engine steps whole shards (tens to hundreds of
millions of parameters) streaming their state from memory; the kernel starts its threads at every
call. A probe much smaller measures the caches and those thread starts: at 1M parameters on 16
cores it read about half the rate of the real step. Its state (14 bytes a parameter, 0.9 GB) is
beyond any CPU's last-level cache: on the H200 box (16 cores) 8M parameters (112 MB, within its
cache) read 5.8 Gparam/s, 64M 3.8 and 256M 4.1, while the engine's step at 1.1B ran at 3.75 (the
planner's CPU Adam term was 0.70x the measured step with the 8M probe)."""

DEVICE_ADAM_PROBE_NUMEL = 16 << 20
"""Parameters of the device step probe (:func:`measure_device_adam`): a whole chunk of torch's
fused fp32 step (``zero.optim.formats.DEVICE_CHUNK``) and four of the compressed formats' torch
steps, 0.3 GB of device memory for fp32, released after."""
MEMCPY_PROBE_BYTES = 256 << 20
"""Bytes of the host memcpy probe, quick or not: beyond the last-level cache, as the gradient
accumulators and write-backs it stands for are (a 32 MB copy measures the cache, as a small Adam
probe does)."""

MIN_DISK_PROBE = 1 << 20
"""The smallest file the disk probe writes; with less free space it does not write at all."""



def _preset(table: dict, name: str, what: str) -> Any:
    try:
        return table[name]
    except KeyError:
        raise ValueError(f"{what}: unknown preset {name!r} (choose from {', '.join(table)})") from None



def _keeps_rng(fn: Callable) -> Callable:
    """A probe that draws random tensors (or builds a model) on a fork of torch's RNG: a run's seed
    gives the same model and data whether the engine measured rates first or not."""
    @functools.wraps(fn)
    def probe(*args: Any, **kwargs: Any) -> Any:
        with torch.random.fork_rng(devices=range(torch.cuda.device_count()) if torch.cuda.is_available() else []):
            return fn(*args, **kwargs)
    return probe


def _times(fn: Callable[[], None], reps: int, warmup: int = 1) -> list[float]:
    """Seconds of each of ``reps`` calls of ``fn()``, after ``warmup`` untimed ones."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return times


def _median_time(fn: Callable[[], None], reps: int, warmup: int = 1, sync: Callable[[], None] = lambda: None,
                 min_seconds: float = 0.0) -> float:
    """Median seconds of one ``fn()``; with ``min_seconds``, each repetition loops ``fn`` often enough
    to last that long (a few-millisecond kernel timed alone is mostly scheduling noise)."""
    return _timed(fn, reps, warmup, sync, min_seconds)[0]


def _timed(fn: Callable[[], None], reps: int, warmup: int = 1, sync: Callable[[], None] = lambda: None,
           min_seconds: float = 0.0) -> tuple[float, float]:
    """:func:`_median_time`, and the slowest repetition's time over the fastest's."""
    for _ in range(warmup):
        fn()
    sync()
    inner = 1
    if min_seconds > 0:
        t0 = time.perf_counter()
        fn()
        sync()
        one = max(time.perf_counter() - t0, 1e-7)
        inner = max(1, min(1000, int(min_seconds / one) + 1))
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        for _ in range(inner):
            fn()
        sync()
        times.append((time.perf_counter() - t0) / inner)
    return statistics.median(times), max(times) / max(min(times), 1e-12)


# ----------------------------------------------------------------------------------- probes


def all_cpus() -> int:
    """CPUs this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1



def measure_adam(numel: int = ADAM_PROBE_NUMEL, reps: int = 5, threads: Optional[int] = None,
                 state: str = "fp32") -> float:
    """Params/s of the engine's CPU optimizer step: the one-pass kernel (``_C.adam_step``) on one
    shard's flat ``[master | m | v]`` fp32 layout with a bf16 gradient and the bf16 weights written
    out, on ``threads`` threads (the engine's ``pyinfinity.optimizer_threads``; None: every CPU this
    process may use, as the optimizer's worker does on a GPU machine). ``numel`` is large enough
    that the state (14 bytes a parameter) does not fit in the caches and the kernel's thread starts
    are a small share of a call, as in the engine's step of a whole shard (see ADAM_PROBE_NUMEL).
    ``state``: "8bit" or "bf16" times that format's kernel on its layout instead
    (``zero.state_formats``). Without the extension: torch's fused AdamW on separate fp32 tensors."""
    try:
        from pyinfinity import _C
    except ImportError:
        _C = None
    if threads is None:
        threads = all_cpus()
    if threads < 1:
        raise ValueError(f"measure_adam: threads must be at least 1, got {threads}")
    if state != "fp32":
        return _measure_format_step(numel, reps, threads, state)
    if _C is not None and hasattr(_C, "adam_step"):
        flat = torch.zeros(3 * numel)
        grad = torch.full((numel,), 1e-3, dtype=torch.bfloat16)  # the kernel's time does not depend on the values
        out = torch.empty(numel, dtype=torch.bfloat16)
        step = [0]

        def run() -> None:
            step[0] += 1
            _C.adam_step(flat.data_ptr(), flat.data_ptr() + 4 * numel, flat.data_ptr() + 8 * numel, grad.data_ptr(),
                         1, out.data_ptr(), numel, 1e-4, 0.9, 0.999, 1e-8, 0.0, True, step[0], 1.0, threads)

        return numel / _median_time(run, reps, min_seconds=0.05)
    p, g = torch.randn(numel), torch.randn(numel) * 1e-3
    m, v = torch.zeros(numel), torch.zeros(numel)
    step_t = torch.tensor(1.0)

    def run_torch() -> None:
        torch._fused_adamw_([p], [g], [m], [v], [], [step_t], lr=1e-4, beta1=0.9, beta2=0.999,
                            weight_decay=0.0, eps=1e-8, amsgrad=False, maximize=False)

    return numel / _median_time(run_torch, reps, min_seconds=0.05)


def _measure_format_step(numel: int, reps: int, threads: int, state: str) -> float:
    """Params/s of the CPU step of a compressed state format (see :func:`measure_adam`): the 8-bit
    state's master, codes and scales, or a bf16 master with bf16 moments, a bf16 gradient."""
    from pyinfinity import _C

    grad = (torch.randn(numel) * 1e-3).to(torch.bfloat16)
    hyper = (1e-4, 0.9, 0.999, 1e-8, 0.0, True)
    step = [0]
    if state == "8bit":
        blocks = -(-numel // int(_C.QUANT_BLOCK))
        master, scales = torch.zeros(numel), torch.zeros(2 * blocks)
        codes, out = torch.zeros(2 * numel, dtype=torch.uint8), torch.empty(numel, dtype=torch.bfloat16)

        def run() -> None:
            step[0] += 1
            _C.adam_step_8bit(master.data_ptr(), codes.data_ptr(), codes.data_ptr() + numel, scales.data_ptr(),
                              scales.data_ptr() + 4 * blocks, grad.data_ptr(), 1, out.data_ptr(), numel, *hyper,
                              step[0], 1.0, threads)
    elif state == "bf16":
        param, moments = torch.zeros(numel, dtype=torch.bfloat16), torch.zeros(2 * numel, dtype=torch.bfloat16)
        out = torch.empty(numel, dtype=torch.bfloat16)

        def run() -> None:  # the new weights written to their home in the same pass, as the engine does
            step[0] += 1
            _C.adam_step_bf16(param.data_ptr(), moments.data_ptr(), moments.data_ptr() + 2 * numel, grad.data_ptr(), 1,
                              out.data_ptr(), numel, *hyper, step[0], 1.0, threads)
    else:
        raise ValueError(f"measure_adam: state must be fp32, 8bit or bf16, got {state!r}")
    return numel / _median_time(run, reps, min_seconds=0.05)


def measure_device_adam(device: Union[str, torch.device], state: str = "fp32", numel: int = DEVICE_ADAM_PROBE_NUMEL,
                        reps: int = 5) -> float:
    """Params/s of the ``state`` format's step on ``device`` as the engine runs it for a unit whose
    state lives there (``OptimStateFormat.step_device``: torch's fused kernel for fp32, the
    compressed formats' own step), a bf16 gradient, the new weights written into a bf16 buffer.
    Waits for the device (the time is the kernels', not their launch). The memory is released
    after."""
    from pyinfinity.zero.optim.formats import make_state_format

    dev = torch.device(device)
    fmt = make_state_format(state, adam_w=True)
    size, dtype = fmt.home_spec(numel)
    flat = torch.empty(size, dtype=dtype, device=dev)
    fmt.init(flat, numel, torch.zeros(numel, device=dev))
    grad = torch.full((numel,), 1e-3, dtype=torch.bfloat16, device=dev)
    out = torch.empty(numel, dtype=torch.bfloat16, device=dev)
    step = torch.zeros((), dtype=torch.float32, device=dev)
    hyper = {"lr": 1e-4, "beta1": 0.9, "beta2": 0.999, "eps": 1e-8, "weight_decay": 0.0}
    count = [0]

    def run() -> None:
        count[0] += 1
        step.add_(1)
        fmt.step_device(flat, numel, grad, out, hyper, step, None, count=count[0], scale=1.0)

    cuda = dev.type == "cuda"
    sync = (lambda: torch.cuda.synchronize(dev)) if cuda else (lambda: None)
    try:
        return numel / _median_time(run, reps, sync=sync, min_seconds=0.05)
    finally:
        del flat, grad, out
        if cuda:
            torch.cuda.empty_cache()


def measure_memcpy(nbytes: int = 64 << 20, reps: int = 5) -> float:
    """Host memcpy bytes/s (a copy of page-aligned tensors, as the engine's cpu-tier moves are)."""
    from pyinfinity.swap.tensor_swapper import aligned_empty

    n = nbytes // 4
    a, b = aligned_empty(n, torch.float32), aligned_empty(n, torch.float32)
    a.fill_(1.0)
    b.fill_(0.0)
    return nbytes / _median_time(lambda: b.copy_(a), reps, min_seconds=0.05)


ACCUMULATE_PROBE_NUMEL = 32 << 20  # 128 MiB of fp32 accumulator: past the caches, as a shard's is


def measure_accumulate(numel: int = ACCUMULATE_PROBE_NUMEL, reps: int = 5, threads: Optional[int] = None,
                       dtype: torch.dtype = torch.bfloat16) -> float:
    """Params/s of the engine's host gradient add under accumulation: ``zero.accumulate.add_into``
    of a ``dtype`` gradient into an fp32 accumulator (chunked through an fp32 scratch when it
    converts), on ``threads`` threads as the accumulation worker runs it (None: torch's current
    setting). About half the memcpy model's pace on an H200 box's host: the conversion and the
    add are separate passes over each chunk."""
    from pyinfinity.zero.accumulate import ADD_CHUNK, add_into

    dst = torch.zeros(numel, dtype=torch.float32)
    src = torch.full((numel,), 0.5, dtype=dtype)
    scratch = torch.empty(min(numel, ADD_CHUNK), dtype=torch.float32) if dtype != torch.float32 else None
    was = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        return numel / _median_time(lambda: add_into(dst, src, copy=False, scratch=scratch), reps, min_seconds=0.05)
    finally:
        torch.set_num_threads(was)


COMPUTE_SPREAD_LIMIT = 2.0
"""A matmul probe whose samples differ by more than this factor timed something else besides the
kernel (another process on the same cores or device): its rate is named uncertain."""


def matmul_probe(device: Union[str, torch.device] = "cpu", m: int = 1024, k: int = 1024, n: int = 1024,
                 dtype: torch.dtype = torch.float32, reps: int = 5) -> tuple[float, float]:
    """:func:`measure_matmul`'s FLOP/s, and its samples' spread (the slowest over the fastest)."""
    dev = torch.device(device)
    a = torch.randn(m, k, device=dev).to(dtype)
    b = torch.randn(k, n, device=dev).to(dtype)
    sync = (lambda: torch.cuda.synchronize(dev)) if dev.type == "cuda" else (lambda: None)
    seconds, spread = _timed(lambda: a @ b, reps, warmup=2, sync=sync, min_seconds=0.05)
    return 2.0 * m * k * n / seconds, spread


def measure_matmul(device: Union[str, torch.device] = "cpu", m: int = 1024, k: int = 1024, n: int = 1024,
                   dtype: torch.dtype = torch.float32, reps: int = 5) -> float:
    """FLOP/s of an (m x k) @ (k x n) matmul on ``device`` in ``dtype`` (the model's shape)."""
    return matmul_probe(device, m, k, n, dtype, reps)[0]


def measure_copies(device: Union[str, torch.device], nbytes: int = 256 << 20,
                   reps: int = 5) -> tuple[float, float, float]:
    """(h2d, d2h, h2d from pageable memory) bytes/s between pinned host memory and ``device``;
    memcpy on the CPU device."""
    dev = torch.device(device)
    if dev.type != "cuda":
        r = measure_memcpy(min(nbytes, 64 << 20), reps)
        return r, r, r
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    gpu = torch.empty(nbytes, dtype=torch.uint8, device=dev)
    sync = lambda: torch.cuda.synchronize(dev)  # noqa: E731
    h2d = nbytes / _median_time(lambda: gpu.copy_(host, non_blocking=True), reps, sync=sync)
    d2h = nbytes / _median_time(lambda: host.copy_(gpu, non_blocking=True), reps, sync=sync)
    pageable = torch.empty(nbytes, dtype=torch.uint8)
    pageable.fill_(1)
    h2d_pg = nbytes / _median_time(lambda: gpu.copy_(pageable), reps, sync=sync)
    return h2d, d2h, h2d_pg


class DiskProbe(NamedTuple):
    """One probe of a swap directory (:func:`measure_disk`)."""

    read: float  # bytes/s
    write: float  # bytes/s
    latency: float  # seconds per I/O piece
    duplex: float  # seconds of a read and a write at once over the two one after the other
    spread: float = 1.0  # the slowest read or write sample's time over the fastest's (DISK_SPREAD_LIMIT)


DISK_SPREAD_LIMIT = 2.0
"""A disk probe whose read or write samples differ by more than this factor timed something else
besides the disk (another process's I/O, a busy CPU): its rates are named uncertain."""


def measure_disk(directory: str, nbytes: int = 64 << 20, reps: int = 3,
                 aio: Optional[dict] = None) -> DiskProbe:
    """Read and write bytes/s, seconds per I/O piece and the duplex share of one SwapEngine on a
    file in ``directory`` (removed afterwards). The per-piece cost is the time of a one-page read;
    the rates are of a transfer of ``nbytes`` with its pieces' cost taken out (at most 95% of it);
    the duplex share times a read of ``nbytes`` and a write of as many to the other half of the file
    issued together, against the two alone (between the larger alone's share and 1).

    aio: the ``aio`` section to use (block_size, queue_depth, thread_count/intra_op_parallelism, backend).
    """
    from pyinfinity.swap.directories import make_swap_dir, remove_created_dirs

    made = make_swap_dir(directory, warn=False)  # a swap directory not made yet: timed, then removed
    try:
        return _measure_disk(directory, nbytes, reps, aio or {})
    finally:
        remove_created_dirs(made)


def _measure_disk(directory: str, nbytes: int, reps: int, aio: dict) -> DiskProbe:
    from pyinfinity.swap import SwapEngine
    from pyinfinity.swap.tensor_swapper import aligned_empty

    nbytes = disk_probe_size(directory, 2 * nbytes) // 2 // 4096 * 4096  # the file holds two halves
    path = os.path.join(directory, f".pyinfinity-rates-{os.getpid()}.bin")
    buf = aligned_empty(nbytes, torch.uint8)
    buf.random_(0, 256)
    other = aligned_empty(nbytes, torch.uint8)
    page = buf[:4096]
    threads = aio.get("thread_count", aio.get("intra_op_parallelism"))
    eng = SwapEngine(backend=aio.get("backend"), block_size=aio.get("block_size"),
                     queue_depth=aio.get("queue_depth"), threads=threads)
    eng_block = eng.block_size

    def both() -> None:
        r = eng.read(other, path, 0)
        w = eng.write(buf, path, nbytes)
        r.wait()
        w.wait()

    try:
        for off in (0, nbytes):  # allocate the file's blocks before timing
            eng.write(buf, path, off).wait()
        ws = _times(lambda: eng.write(buf, path, 0).wait(), reps, warmup=0)
        rs = _times(lambda: eng.read(buf, path, 0).wait(), reps, warmup=1)
        rw = _median_time(both, reps, warmup=1)
        # the fastest one-page read: the device's cost of a piece; a slower sample is the scheduler's delay
        lat = min(_times(lambda: eng.read(page, path, nbytes // 2).wait(), max(5, reps), warmup=1))
    finally:
        eng.close()
        try:
            os.unlink(path)
        except OSError:
            pass
    r, w = statistics.median(rs), statistics.median(ws)
    block = int(aio.get("block_size") or eng_block)
    n = -(-nbytes // block)
    lat = min(lat, 0.5 * min(r, w) / n)  # the pieces' cost is at most half a transfer: a rate at most 2x the timed one
    duplex = min(1.0, max(rw, r, w) / (r + w))
    spread = max(max(rs) / min(rs), max(ws) / min(ws))
    return DiskProbe(nbytes / (r - n * lat), nbytes / (w - n * lat), lat, duplex, spread)


def disk_probe_size(directory: str, nbytes: int) -> int:
    """The probe file's size in ``directory``: ``nbytes``, or less so that it takes at most a quarter
    of the free space (whole MiB). ENOSPC naming the directory when not even MIN_DISK_PROBE fits:
    nothing is written then."""
    st = os.statvfs(directory)
    free = st.f_bavail * st.f_frsize
    fit = (free // 4) // MIN_DISK_PROBE * MIN_DISK_PROBE
    if fit < MIN_DISK_PROBE:
        raise OSError(errno.ENOSPC, f"the disk probe needs {MIN_DISK_PROBE * 4 >> 20} MiB free to time the swap "
                      f"directory, it has {free / (1 << 20):.2f} MiB: free space there, or give the disk's rates "
                      "(--rates FILE from `pyinfinity bench io --json` or `plan --save-rates`)", directory)
    if fit < nbytes:
        log.info("disk probe: %s has %.1f MiB free, timing %d MiB instead of %d", directory, free / (1 << 20),
                 fit >> 20, nbytes >> 20)
    return min(nbytes, fit)


def _drop_grad(p: torch.Tensor) -> None:
    p.grad = None


def decoder_probe_bytes(model_config: dict, micro_batch: int, seq_len: int, itemsize: int = 2,
                        checkpointing: bool = False) -> int:
    """An upper estimate of the device bytes :func:`measure_decoder_compute` takes: its 2-layer
    model's weights (embeddings and head counted apart, tied or not), the largest parameter's
    gradient (each is dropped as soon as it is made), the logits with the fp32 loss and its
    gradient, and the layers' activations (one layer's at a time under checkpointing)."""
    h = int(model_config.get("hidden_size") or 0)
    inter = int(model_config.get("intermediate_size") or 4 * h)
    vocab = int(model_config.get("vocab_size") or 0)
    heads = int(model_config.get("num_attention_heads") or 1)
    kv = h * int(model_config.get("num_key_value_heads") or heads) // max(1, heads)
    layer = 2 * h * h + 2 * h * kv + 3 * h * inter
    tokens = micro_batch * seq_len
    weights = (2 * layer + 2 * vocab * h) * itemsize
    grad = max(vocab * h, h * inter) * itemsize
    logits = tokens * vocab * (itemsize + 3 * 4)
    acts = tokens * (16 * h + 4 * inter) * itemsize * (1 if checkpointing else 2)
    return weights + grad + logits + acts


@_keeps_rng
def measure_decoder_compute(model_config: dict, device: Union[str, torch.device], micro_batch: int, seq_len: int,
                            dtype: torch.dtype = torch.bfloat16, checkpointing: bool = False,
                            reps: int = 5) -> tuple[float, int]:
    """Seconds of one micro-batch's forward + backward of a transformers decoder, and its activation
    bytes, extrapolated from the same model built with 1 and 2 layers on ``device`` (resident, no
    offload): t = t1 + (layers - 1) * (t2 - t1). Non-matmul work (norms, attention kernels, the
    loss over the vocabulary) is in the figure, which FLOPs / matmul rate misses. The activation
    bytes are the device peak above the resident weights, with each parameter's gradient dropped
    as soon as it is made (as the engine moves gradients off the device unit by unit: the
    planner counts their buffers apart)."""
    import transformers

    dev = torch.device(device)
    layers = int(model_config["num_hidden_layers"])
    cuda = dev.type == "cuda"
    sync = (lambda: torch.cuda.synchronize(dev)) if cuda else (lambda: None)
    out: list[tuple[float, int]] = []
    for n in (1, 2):
        d = {k: v for k, v in model_config.items() if k != "model_type"}
        d["num_hidden_layers"] = n
        cfg = transformers.AutoConfig.for_model(model_config.get("model_type", "llama"), **d)
        cfg.use_cache = False
        was = torch.get_default_dtype()
        torch.set_default_dtype(dtype)  # built in its dtype where it runs (a CPU generator takes seconds)
        try:
            with dev:
                model = transformers.AutoModelForCausalLM.from_config(cfg)
        finally:
            torch.set_default_dtype(was)
        if checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.train()
        for p in model.parameters():
            p.register_post_accumulate_grad_hook(_drop_grad)
        x = torch.randint(0, int(cfg.vocab_size), (micro_batch, seq_len), device=dev)

        def step() -> None:
            model(input_ids=x, labels=x).loss.backward()
            model.zero_grad(set_to_none=True)

        if cuda:
            torch.cuda.reset_peak_memory_stats(dev)
            base = torch.cuda.memory_allocated(dev)  # the weights (and the batch)
        t = _median_time(step, reps, warmup=2, sync=sync)
        acts = max(0, torch.cuda.max_memory_allocated(dev) - base) if cuda else 0
        out.append((t, acts))
        del model
        if cuda:
            torch.cuda.empty_cache()
    (t1, p1), (t2, p2) = out
    per_layer = max(0.0, t2 - t1)
    acts = max(0, p1 + (layers - 1) * max(0, p2 - p1)) if cuda else 0
    return t1 + (layers - 1) * per_layer, acts


_CACHE: dict[tuple, Rates] = {}


@_keeps_rng
def measure_rates(device: Union[str, torch.device] = "cpu", swap_dir: Optional[str] = None, *,
                  rates_file: Optional[str] = None, aio: Optional[dict] = None,
                  matmul_shape: tuple[int, int, int] = (1024, 1024, 1024),
                  dtype: torch.dtype = torch.float32, quick: bool = True, cache: bool = False,
                  link: Optional[str] = None, disk: Optional[str] = None, matmul: Optional[float] = None,
                  optimizer_threads: Optional[int] = None, optimizer_state: str = "fp32",
                  accumulation: bool = False) -> Rates:
    """Rates for a run on ``device``. Each figure comes from, in this order: ``rates_file``; the
    named ``link`` (h2d/d2h, :data:`LINK_PRESETS`) and ``disk`` (:data:`DISK_PRESETS`) presets
    and a given ``matmul`` (FLOP/s); a probe on this machine (about a second with ``quick``).

    A device that is not on this machine (planning a GPU run from a CPU box) is never touched:
    its link defaults to :data:`DEFAULT_LINK`, its matmul to :data:`DEFAULT_GPU_MATMUL` and its
    disk to :data:`DEFAULT_DISK` (a swap directory here is not the target's drive); Adam and
    memcpy are this machine's CPU's. ``Rates.source`` says where each figure came from. Without a swap directory (and no disk preset) the disk figures are 0 (no disk tier).
    cache: reuse an earlier measurement of the same arguments in this process (the engine's
    "auto" does, so several engines in one process probe once). optimizer_threads: the threads the
    engine's CPU Adam step will use (``pyinfinity.optimizer_threads``, resolved); the Adam probe runs
    on as many (None: every CPU of this process). optimizer_state: the state format planned; its
    kernel is timed too when it is not fp32 (``Rates.adam_8bit`` / ``adam_bf16``). accumulation: the
    run accumulates gradients over micro-batches; the host's gradient add is timed too
    (``Rates.accumulate``, on the optimizer's threads, gradients in ``dtype``)."""
    dev = torch.device(device)
    key = (str(dev), swap_dir, rates_file, json.dumps(aio, sort_keys=True, default=str), matmul_shape, str(dtype),
           quick, link, disk, matmul, optimizer_threads, optimizer_state, accumulation)
    if cache and key in _CACHE:
        return _CACHE[key]
    here = device_is_here(dev)
    given: dict[str, float] = {}
    source: dict[str, str] = {}
    aio = dict(aio or {})
    if rates_file:
        given, file_aio = load_rates_file(rates_file)
        aio = {**file_aio, **aio}
        source.update({k: f"file:{rates_file}" for k in given})
    vals: dict[str, float] = dict(given)
    link_default, disk_default = link is None and not here, disk is None and not here  # not given: say so
    if not here:
        link = link or DEFAULT_LINK
        disk = disk or DEFAULT_DISK
    if link is not None:  # a named preset fills what the file does not give
        lp = _preset(LINK_PRESETS, link, "link")
        how = f"preset {link} ({lp.note})" + ("; default, pass --link" if link_default else "")
        for k, v in (("h2d", lp.h2d), ("d2h", lp.d2h), ("h2d_pageable", lp.h2d_pageable)):
            if k not in vals:
                vals[k], source[k] = v, how
    if disk is not None:
        _set_disk_preset(vals, source, disk, "; default, pass --disk" if disk_default else "")
    if matmul is not None and "matmul" not in vals:
        vals["matmul"], source["matmul"] = float(matmul), "given"
    if not here and "matmul" not in vals:
        vals["matmul"] = DEFAULT_GPU_MATMUL
        source["matmul"] = f"assumed {DEFAULT_GPU_MATMUL / 1e12:.0f} TFLOP/s for {dev} (not on this machine; pass --tflops)"
    reps = 3 if quick else 7
    host_note = "probe" if here else "probe (this machine's CPU, not the target's)"
    threads = optimizer_threads or all_cpus()
    probes = [("adam", "fp32")] + ([(f"adam_{optimizer_state}", optimizer_state)] if optimizer_state != "fp32" else [])
    for figure, state in probes:
        if figure not in vals:
            kw = {"state": state} if state != "fp32" else {}
            vals[figure] = measure_adam(ADAM_PROBE_NUMEL, reps, threads=threads, **kw)
            source[figure] = f"{host_note}, {threads} thread{'s' if threads != 1 else ''}"
    device_figure = device_adam_key(optimizer_state)
    if here and dev.type == "cuda" and device_figure not in vals:  # units whose state lives on the device
        try:
            vals[device_figure] = measure_device_adam(dev, optimizer_state, DEVICE_ADAM_PROBE_NUMEL, reps)
            source[device_figure] = "probe"
        except torch.OutOfMemoryError:  # another process holds the device: the assumed figure stands in
            torch.cuda.empty_cache()
            log.warning("rates: no device memory to time the %s optimizer step on %s; its assumed rate stands in",
                        optimizer_state, dev)
    if "memcpy" not in vals:
        vals["memcpy"] = measure_memcpy(MEMCPY_PROBE_BYTES, reps)
        source["memcpy"] = host_note
    if accumulation and "accumulate" not in vals:  # the gradient adds between optimizer steps
        vals["accumulate"] = measure_accumulate(ACCUMULATE_PROBE_NUMEL, reps, threads=threads,
                                                dtype=dtype if dtype in (torch.bfloat16, torch.float16) else torch.float32)
        source["accumulate"] = f"{host_note}, {threads} thread{'s' if threads != 1 else ''}"
    if "h2d" not in vals or "d2h" not in vals:
        if dev.type == "cuda":
            h, d, pg = measure_copies(dev, (64 << 20) if quick else (512 << 20), reps)
        else:
            h = d = pg = vals["memcpy"]
        vals.setdefault("h2d", h)
        vals.setdefault("d2h", d)
        vals.setdefault("h2d_pageable", pg)
    if "matmul" not in vals:
        m, k, n = matmul_shape
        vals["matmul"], spread = matmul_probe(dev, m, k, n, dtype, reps)
        if spread > COMPUTE_SPREAD_LIMIT:
            note = (f"probe, uncertain: its samples differ {spread:.1f}x (another process on the same cores or "
                    "device while it ran; probe again on a quiet machine, or pass --tflops)")
            log.warning("compute probe on %s: %s", dev, note)
            source["matmul"] = note
    if "disk_read" not in vals or "disk_write" not in vals:
        if swap_dir:
            try:
                probe = measure_disk(swap_dir, (128 << 20) if quick else (256 << 20), reps, aio)
            except OSError as exc:
                if exc.errno != errno.ENOSPC or exc.filename != swap_dir:
                    raise
                # too little room to time the disk: the plan's capacity check will say what is missing
                log.warning("%s", exc.strerror)
                _set_disk_preset(vals, source, DEFAULT_DISK, f"; not measured: {swap_dir} is nearly full")
            else:
                vals.setdefault("disk_latency", probe.latency)
                vals.setdefault("disk_read", probe.read)
                vals.setdefault("disk_write", probe.write)
                vals.setdefault("disk_duplex", probe.duplex)
                if probe.spread > DISK_SPREAD_LIMIT:
                    note = (f"probe, uncertain: its samples differ {probe.spread:.1f}x (other I/O or a busy CPU "
                            "while it ran; probe again on a quiet machine, or pass --rates)")
                    log.warning("disk probe of %s: %s", swap_dir, note)
                    for key in ("disk_read", "disk_write", "disk_latency"):
                        source.setdefault(key, note)
        else:
            vals.setdefault("disk_read", 0.0)
            vals.setdefault("disk_write", 0.0)
            source.setdefault("disk_read", "none (no swap directory)")
            source.setdefault("disk_write", "none (no swap directory)")
    for k in vals:
        source.setdefault(k, "probe")
    rates = Rates(h2d=vals["h2d"], d2h=vals["d2h"], disk_read=vals["disk_read"], disk_write=vals["disk_write"],
                  adam=vals["adam"], matmul=vals["matmul"], memcpy=vals["memcpy"],
                  disk_latency=vals.get("disk_latency", 0.0), disk_duplex=vals.get("disk_duplex", 1.0),
                  h2d_pageable=vals.get("h2d_pageable", 0.0),
                  adam_8bit=vals.get("adam_8bit", 0.0), adam_bf16=vals.get("adam_bf16", 0.0),
                  accumulate=vals.get("accumulate", 0.0),
                  **{k: vals.get(k, 0.0) for k in ("device_adam", "device_adam_8bit", "device_adam_bf16")},
                  block_size=int(aio.get("block_size") or (1 << 20)),
                  device=str(dev), source=source)
    log.debug("rates: %s", rates.describe())
    if cache:
        _CACHE[key] = rates
    return rates


def _set_disk_preset(vals: dict[str, float], source: dict[str, str], name: str, suffix: str = "") -> None:
    dp = _preset(DISK_PRESETS, name, "disk")
    how = f"preset {name} ({dp.note}){suffix}"
    for k, v in (("disk_read", dp.read), ("disk_write", dp.write), ("disk_latency", dp.latency)):
        if k not in vals:
            vals[k], source[k] = v, how


def preset_rates(device: Union[str, torch.device] = "cuda", link: Optional[str] = None, disk: Optional[str] = None,
                 matmul: Optional[float] = None, *, adam: Optional[float] = None,
                 memcpy: Optional[float] = None) -> Rates:
    """Rates for planning a run on a machine described by name, without touching ``device``:
    ``link`` from :data:`LINK_PRESETS`, ``disk`` from :data:`DISK_PRESETS` (defaults
    :data:`DEFAULT_LINK`, :data:`DEFAULT_DISK`), ``matmul`` in FLOP/s (default
    :data:`DEFAULT_GPU_MATMUL` for a GPU), ``adam`` (params/s) and ``memcpy`` (bytes/s) of the
    target's CPU when known, else probed on this machine's CPU. ``source`` names each figure's
    origin. Example: ``preset_rates("cuda", link="pcie4x16", disk="nvme-gen4", matmul=150e12)``."""
    dev = torch.device(device)
    vals: dict[str, float] = {}
    source: dict[str, str] = {}
    lp = _preset(LINK_PRESETS, link or DEFAULT_LINK, "link")
    how = f"preset {link or DEFAULT_LINK} ({lp.note})" + ("" if link else "; default")
    for k, v in (("h2d", lp.h2d), ("d2h", lp.d2h), ("h2d_pageable", lp.h2d_pageable)):
        vals[k], source[k] = v, how
    _set_disk_preset(vals, source, disk or DEFAULT_DISK, "" if disk else "; default")
    if matmul is None:
        vals["matmul"], source["matmul"] = DEFAULT_GPU_MATMUL, f"assumed {DEFAULT_GPU_MATMUL / 1e12:.0f} TFLOP/s"
    else:
        vals["matmul"], source["matmul"] = float(matmul), "given"
    for k, given, probe in (("adam", adam, lambda: measure_adam(ADAM_PROBE_NUMEL, 3)),
                            ("memcpy", memcpy, lambda: measure_memcpy(MEMCPY_PROBE_BYTES, 3))):
        if given is None:
            vals[k], source[k] = probe(), "probe (this machine's CPU)"
        else:
            vals[k], source[k] = float(given), "given"
    return Rates(h2d=vals["h2d"], d2h=vals["d2h"], disk_read=vals["disk_read"], disk_write=vals["disk_write"],
                 adam=vals["adam"], matmul=vals["matmul"], memcpy=vals["memcpy"], disk_latency=vals["disk_latency"],
                 h2d_pageable=vals["h2d_pageable"], device=str(dev), source=source)



def measured_compute(model: Any, train: TrainShape, device: torch.device, device_memory: Optional[int],
                     dtype: torch.dtype) -> Optional[float]:
    """Seconds of one micro-batch's forward + backward on a GPU, measured with 1 and 2 layers of
    the model (:func:`measure_decoder_compute`): a step of small kernels around the matmuls runs
    well below the matmul probe's rate, so FLOPs / matmul rate under-predicts. None (the FLOPs
    estimate stays) for a model that is not a transformers decoder, one with frozen parameters
    (adapters: their backward skips the weight gradients the probe computes), or when the probe
    would not fit 3/4 of the device budget."""
    conf = getattr(model, "config", None)
    to_dict = getattr(conf, "to_dict", None)
    if not callable(to_dict) or getattr(conf, "is_encoder_decoder", False) or not isinstance(model, torch.nn.Module):
        return None
    if any(not p.requires_grad for p in model.parameters()):
        return None
    d = to_dict()
    if int(d.get("num_hidden_layers") or 0) < 2 or not d.get("model_type"):
        return None
    need = decoder_probe_bytes(d, train.micro_batch, train.seq_len, torch.empty((), dtype=dtype).element_size(),
                               train.checkpointing)
    if device_memory and need > device_memory * 3 // 4:
        return None
    try:
        seconds, _ = measure_decoder_compute(d, device, train.micro_batch, train.seq_len, dtype, train.checkpointing)
    except (RuntimeError, ValueError, KeyError, TypeError, AttributeError, ImportError) as exc:  # OOM is a RuntimeError
        log.info("plan: the compute probe did not run (%s); compute from FLOPs / matmul rate", exc)
        torch.cuda.empty_cache()
        return None
    return seconds if seconds > 0 else None


class MachineProbes:
    """This machine's probes, as the planner asks for them (``plan.resolve.Probes``): the rates of
    a run of a parsed config on ``device`` (cached per process, so several engines in one process
    probe once), and one micro-batch of the model timed on the device."""

    def rates(self, cfg: Any, device: torch.device, sizes: ModelSizes, dtype: torch.dtype, rows: int,
              rates_file: Optional[str] = None) -> Rates:
        m = sizes.hidden or 1024
        return measure_rates(device, cfg.nvme_paths[0] if cfg.nvme_paths else None, rates_file=rates_file,
                             aio=aio_options(cfg), matmul_shape=(rows, m, m), dtype=dtype, cache=True,
                             optimizer_threads=engine_optimizer_threads(cfg.pyinfinity, device),
                             optimizer_state=cfg.optimizer_state_format,
                             accumulation=cfg.gradient_accumulation_steps > 1)

    def compute(self, model: Any, train: TrainShape, device: torch.device, device_memory: Optional[int],
                dtype: torch.dtype) -> Optional[float]:
        return measured_compute(model, train, device, device_memory, dtype)


__all__ = ["MachineProbes", "measure_rates", "preset_rates", "measured_compute", "all_cpus", "disk_probe_size",
           "ADAM_PROBE_NUMEL", "MEMCPY_PROBE_BYTES", "MIN_DISK_PROBE", "measure_decoder_compute", "decoder_probe_bytes",
           "measure_accumulate", "ACCUMULATE_PROBE_NUMEL", "measure_adam", "measure_device_adam",
           "DEVICE_ADAM_PROBE_NUMEL", "measure_memcpy", "measure_matmul", "matmul_probe",
           "COMPUTE_SPREAD_LIMIT", "measure_copies", "measure_disk", "DiskProbe",
           "DISK_SPREAD_LIMIT"]
