"""The step of shards whose state the CPU reads: the per-shard Adam step (the format's one-pass
CPU kernel, or torch's fused kernel on the host or streamed to the device), and the serial step
over many shards, pipelined over NVMe homes.

On NVMe the step is pipelined over ``buffer_count`` (>= 3) staging buffers: the read of shard
k+1 and the write of shard k-1 run in the swap engine's threads while shard k is stepped.
"""
from __future__ import annotations

import os
import time
from typing import Any, Callable, Iterator, Optional, Sequence

import torch

from pyinfinity.swap.tensor_swapper import Tier, TensorSwapper, aligned_empty
from pyinfinity.zero.optim.device import StreamedStep
from pyinfinity.zero.optim.formats import OptimStateFormat
from pyinfinity.zero.optim.grads import GradientIntake
from pyinfinity.zero.optim.groups import Call, span_kw, step_calls
from pyinfinity.zero.optim.records import PhaseClock, ShardOptimState
from pyinfinity.zero.partition import FlatShard


class CpuStep:
    """Steps shards whose state is in RAM or on NVMe. ``on_worker()`` says whether the calling
    thread is the background worker (its kernel threads are ``threads``); ``param_out(shard)``
    gives the bf16 home the one-pass kernel may write the new weights into (None: ``write_param``
    casts them; ``ShardOptimState.home_written`` says it did)."""

    def __init__(self, states: list[ShardOptimState], fmt: OptimStateFormat, swapper: TensorSwapper,
                 grads: GradientIntake, phases: PhaseClock, *, buffer_count: int, pipeline: bool,
                 streamed: Optional[StreamedStep], on_worker: Callable[[], bool],
                 param_out: Optional[Callable[[FlatShard], Optional[torch.Tensor]]] = None) -> None:
        self.states = states
        self.format = fmt
        self.swapper = swapper
        self.grads = grads
        self.phases = phases
        self.buffer_count = max(3, buffer_count)
        self.pipeline = pipeline
        self.streamed = streamed
        self._on_worker = on_worker
        self.fused = True  # the format's one-pass CPU step (False: torch's fused kernel on the host)
        self.threads: Optional[int] = None
        self.param_out = param_out
        self._staging: list[torch.Tensor] = []
        self.before_update: Optional[Callable[[ShardOptimState, Optional[torch.Tensor]], None]] = None

    # ------------------------------------------------------------------------- one shard
    def adam(self, st: ShardOptimState, flat: torch.Tensor, hyper: dict, inv_factor: Optional[torch.Tensor],
             k: int = 0, grad: Optional[torch.Tensor] = None) -> torch.Tensor:
        """One Adam/AdamW step of one shard's state ``flat`` (host) with ``grad`` (fp32, host;
        default: the shard's gradient); returns the new master (on the host). ``k`` alternates the
        device buffer sets of a streamed step."""
        n = st.numel
        if self.before_update is not None:  # a background checkpoint's copy of this shard comes first
            self.before_update(st, flat)
        calls = step_calls(st.ranges, hyper, lambda: self.format.master(flat, n),  # per-range decay, in place
                           decoupled_decay=self.format.decoupled_decay)
        if self.streamed is None and grad is None and self.fused:
            return self._one_pass(st, flat, calls, inv_factor)
        t0 = time.perf_counter()
        g32 = self.grads.fp32_for_step(st) if grad is None else grad
        t1 = time.perf_counter()
        st.step += 1
        scale = float(inv_factor) if inv_factor is not None else 1.0  # before any copy is queued
        if self.streamed is not None:  # stream the state to the device, step there, bring it back
            self.streamed.step(flat, n, g32, calls, st.step, inv_factor, k, scale)
        else:
            count = torch.tensor(float(st.step))
            for span, h in calls:
                self.format.step_torch(flat, n, g32, h, count, inv_factor, count=st.step, scale=scale,
                                       **span_kw(span))
        self.phases.add(gradient=t1 - t0, adam=time.perf_counter() - t1)
        return self.format.master(flat, n)

    def _one_pass(self, st: ShardOptimState, flat: torch.Tensor, calls: list[Call],
                  inv_factor: Optional[torch.Tensor]) -> torch.Tensor:
        """The format's CPU step in one pass: the gradient read as it is (bf16 or fp32, no fp32
        copy) and, when ``param_out`` gives the shard's bf16 home, the new weights cast into it in
        the same pass (``st.home_written``: ``write_param`` need not cast them)."""
        n = st.numel
        t0 = time.perf_counter()
        g = self.grads.for_step(st)
        if g.dtype not in (torch.float32, torch.bfloat16) or not g.is_contiguous():
            g = g.float().contiguous()  # fp16 gradients: converted once
        out = self.param_out(st.shard) if self.param_out is not None else None
        if out is not None and (out.dtype != torch.bfloat16 or out.numel() != n or not out.is_contiguous()):
            out = None
        t1 = time.perf_counter()
        st.step += 1
        scale = float(inv_factor) if inv_factor is not None else 1.0
        threads = self.kernel_threads()
        for span, h in calls:
            master = self.format.step_cpu(flat, n, g, out, h, st.step, scale, threads, **span_kw(span))
        st.home_written = out is not None
        self.phases.add(gradient=t1 - t0, adam=time.perf_counter() - t1)
        return master

    def kernel_threads(self) -> int:
        """Threads of the one-pass step: on the caller's thread torch's intra-op count; on the
        worker ``threads`` when set (a CPU compute device leaves the cores to backward), else every
        CPU this process may run on (a GPU run's CPU is otherwise idle while the worker steps)."""
        if not self._on_worker():
            return torch.get_num_threads()
        if self.threads is not None:
            return int(self.threads)
        try:
            return len(os.sched_getaffinity(0))
        except (AttributeError, OSError):
            return os.cpu_count() or 1

    # ------------------------------------------------------------------------- many shards
    def staging_buffers(self) -> list[torch.Tensor]:
        """The buffers NVMe states are read into (sized for the largest, allocated on first use)."""
        if not self._staging:
            # the largest home (a format's home need not grow with its shard: the 8-bit state keeps
            # small shards in fp32)
            on_disk = [st for st in self.states if st.home.tier == Tier.NVME]
            if on_disk:
                n = self.buffer_count if self.pipeline else 1
                numel = max(st.home.numel for st in on_disk)
                dtype = on_disk[0].home.dtype
                self._staging = [aligned_empty(numel, dtype, pin=self.swapper.pin) for _ in range(n)]
        return self._staging

    def iter_states(self, write_back: bool, states: Sequence[ShardOptimState]
                    ) -> Iterator[tuple[ShardOptimState, torch.Tensor]]:
        """Yields (state, its flat home in RAM) for each of ``states``, reading NVMe homes ahead of
        use and, if ``write_back``, writing each back after the caller is done with it
        (pipelined). The caller may send a list of requests to wait for before the buffer is
        reused."""
        all_states = list(states)
        staging = self.staging_buffers()
        nb = len(staging)
        reads: dict[int, Any] = {}
        writes: dict[int, Any] = {}  # buffer index -> pending write(s)
        nvme = [i for i, st in enumerate(all_states) if st.home.tier == Tier.NVME]
        slot_of = {i: k % max(1, nb) for k, i in enumerate(nvme)}
        order = {i: k for k, i in enumerate(nvme)}
        tail: list[Any] = []  # requests for cpu-tier shards (parameter writes)

        def start_read(i: int) -> None:
            b = slot_of[i]
            for w in writes.pop(b, []):
                w.wait()
            st = all_states[i]
            reads[i] = self.swapper.read(st.home, staging[b][:st.home.numel])

        if nvme:
            start_read(nvme[0])
        for i, st in enumerate(all_states):
            if st.home.tier == Tier.CPU:
                extra = yield st, st.home.tensor
                tail.extend(extra or [])
                continue
            k = order[i]
            if self.pipeline and k + 1 < len(nvme):
                start_read(nvme[k + 1])
            reads.pop(i).wait()
            buf = staging[slot_of[i]][:st.home.numel]
            extra = yield st, buf
            pend = list(extra or [])
            if write_back:
                pend.append(self.swapper.write(st.home, buf))
            writes.setdefault(slot_of[i], []).extend(pend)
            if not self.pipeline:
                for w in writes.pop(slot_of[i], []):
                    w.wait()
                if k + 1 < len(nvme):
                    start_read(nvme[k + 1])
        for lst in writes.values():
            for w in lst:
                w.wait()
        for w in tail:
            w.wait()

    def step_states(self, states: Sequence[ShardOptimState], hyper: dict, inv_factor: Optional[torch.Tensor],
                    adam: Callable[..., torch.Tensor], write_param: Callable[[ShardOptimState, torch.Tensor], Any],
                    finish: Callable[[ShardOptimState], None],
                    iter_states: Optional[Callable[..., Iterator[tuple[ShardOptimState, torch.Tensor]]]] = None
                    ) -> None:
        """Steps ``states`` in order on this thread through the pipelined read/step/write-back of
        ``iter_states`` (default: this one's; the optimizer's waits for its workers first) with
        ``adam`` (``OffloadOptimizer._adam``), handing each state and its new master to
        ``write_param`` (``OffloadOptimizer._write_values``);
        ``finish`` marks each consumed once every write has completed."""
        if not states:
            return
        gen = (iter_states or self.iter_states)(write_back=True, states=states)
        k = 0
        done: list[ShardOptimState] = []
        try:
            item = gen.send(None)
            while True:
                st, flat = item
                master = adam(st, flat, hyper, inv_factor, k)
                st.handed = True  # stepped in this step (a failure after this leaves the state partly stepped)
                k += 1
                extra: list = []
                t0 = time.perf_counter()
                req = write_param(st, master)
                if req is not None:
                    extra.append(req)
                self.phases.add(write=time.perf_counter() - t0)
                done.append(st)
                item = gen.send(extra)
        except StopIteration:
            pass
        for st in done:  # every write has completed (iter_states waited for them)
            finish(st)

    def close(self) -> None:
        self._staging.clear()


__all__ = ["CpuStep"]
