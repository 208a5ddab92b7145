"""Gradient intake: what the optimizer does with each unit's gradient until the step reads it.

Gradients arrive one unit at a time (``grad_ready``), as a flat host tensor in the compute dtype
(often the shard's own parameter home: the gradient is written over the weights, which the step
rewrites from the fp32 master anyway, so no fp32 gradient copy is kept) with the CUDA event that
completes its copy and its L2 norm. Under gradient accumulation they are added into an fp32
accumulator instead: by the accumulation worker (``zero.accumulate``) from a staging buffer while
backward goes on, or, for a unit with a device accumulator, on the device, its sum copied once a
step into a buffer of the landing ring (``optim.landing``), which the unit's CPU step reads and
gives back. A unit whose state is on the device keeps its gradient there. Here too: the per-unit
and global norms, a shard's gradient as the step reads it, and the parameters that got none
counting as zero.
"""
from __future__ import annotations

import logging
import threading
from typing import Any, Callable, Optional, Sequence

import torch

from pyinfinity.zero.accumulate import ADD_CHUNK, AccumulateWorker, add_into, norm_of_squares
from pyinfinity.zero.optim.landing import LandingRing
from pyinfinity.zero.optim.records import ShardOptimState, StepJob, StepWindow
from pyinfinity.zero.partition import FlatShard, ParamSlice

log = logging.getLogger(__name__)


def _name(st: ShardOptimState) -> str:
    return f"shard {st.shard.index} ({st.shard.module_name or '<root>'})"


class GradientIntake:
    """The gradients of one optimizer step, unit by unit. ``wait_idle(st, what)`` waits until the
    step worker is done with a shard (its last step still reads the accumulator or the buffer a
    gradient lands in), ``hand(st, job)`` hands a shard whose gradient is final to the step worker,
    ``step_on_device(st, hyper)`` steps a unit whose state is on the device, ``on_worker()`` says
    whether the calling thread is the step worker, ``step_failure()`` raises its failure."""

    def __init__(self, states: list[ShardOptimState], by_shard: dict[int, ShardOptimState], accumulate_steps: int,
                 window: StepWindow, *, wait_idle: Callable[[ShardOptimState, str], None],
                 hand: Callable[[ShardOptimState, StepJob], None],
                 step_on_device: Callable[[ShardOptimState, dict], None], on_worker: Callable[[], bool],
                 release_grad: Optional[Callable[[torch.Tensor], None]] = None,
                 copy_to_host: Optional[Callable[[torch.Tensor, torch.Tensor], Any]] = None,
                 step_failure: Optional[Callable[[], None]] = None) -> None:
        self.states = states
        self.by_shard = by_shard
        self.accumulate_steps = max(1, int(accumulate_steps))
        self.window = window
        self._wait_idle = wait_idle
        self._hand = hand
        self._step_on_device = step_on_device
        self._on_worker = on_worker
        self.threads: Optional[int] = None  # intra-op threads of the accumulation worker
        # a staging buffer a gradient arrived in is given back through ``release_grad`` once added
        self.release_grad = release_grad
        # device accumulators: copy_to_host(src on the device, dst pinned on the host) -> the copy's event
        self.copy_to_host = copy_to_host
        self._adder: Optional[AccumulateWorker] = None
        self._caller_scratch: Optional[torch.Tensor] = None  # add_into's fp32 chunk on the caller's thread
        self._scratch: dict[int, torch.Tensor] = {}  # thread ident -> fp32 gradient scratch (grad32)
        self._lock = threading.Lock()
        self._epoch = 0  # bumped by abandon(): a queued add of an abandoned step hands nothing to the step
        # the buffers device accumulators' sums land in; a unit being stepped gives its buffer back,
        # and a wait for one raises the step worker's failure (``step_failure``)
        self.ring = LandingRing(check=step_failure or (lambda: None), releasing=lambda st: st.busy)
        self._pin_landing = False

    # ------------------------------------------------------------------------- intake
    def grad_ready(self, shard: FlatShard, src: torch.Tensor, event: Any, norm: Optional[torch.Tensor]) -> None:
        """One unit's gradient of this micro-batch: ``src`` (host, compute dtype; on the device for
        a unit whose state or accumulator is there) is complete once ``event`` has (None: already).
        Under accumulation it is added into the fp32 accumulator; otherwise it is kept for the step
        (and handed to the worker at once when nothing global is needed)."""
        st = self.by_shard.get(shard.index)
        if st is None:
            return
        if st.dev is not None:
            self._grad_on_device(st, src, norm)
            return
        if st.device_acc:
            self._add_on_device(st, src)
            return
        if self.accumulate_steps > 1:
            self._submit_add(st, src, event)
            return
        if st.src is not None:
            raise RuntimeError(f"{_name(st)} got a second gradient in one optimizer step without accumulation "
                               "(backward() called twice before step()?)")
        # the worker may still be writing the last step's state of this shard back (its new values
        # are home already): the new gradient waits for that
        self._wait_idle(st, _name(st))
        st.src, st.event, st.norm = src, event, norm
        w = self.window
        if w.eager and w.open:
            self._hand(st, StepJob(w.hyper, None))
            w.handed_early += 1

    def _grad_on_device(self, st: ShardOptimState, src: torch.Tensor, norm: Optional[torch.Tensor]) -> None:
        """A device-stepped unit's gradient (on the device, compute stream): accumulated there, or
        kept for the step; stepped at once when nothing global is needed."""
        if self.accumulate_steps > 1:
            self._add_flat(st, src)
        else:
            if st.src is not None:
                raise RuntimeError(f"{_name(st)} got a second gradient in one optimizer step without accumulation "
                                   "(backward() called twice before step()?)")
            st.src, st.norm = src, norm
        w = self.window
        if w.open and w.eager:
            self._step_on_device(st, w.hyper)
            w.handed_early += 1

    def _submit_add(self, st: ShardOptimState, src: torch.Tensor, event: Any) -> None:
        """Hands one unit's micro-batch gradient (a staging buffer) to the accumulation worker, which
        adds it into the fp32 accumulator while backward goes on; in the boundary micro-batch it
        also takes the sum's norm and, when nothing global is needed, hands the unit to the step."""
        self.check("backward()")
        w = self.window
        final = w.open  # the boundary micro-batch: after this add the sum is complete
        job = StepJob(w.hyper, None) if final and w.eager else None
        if job is not None:
            w.handed_early += 1  # counted now: overlap_open holds from here on
        epoch = self._epoch
        release = self.release_grad
        adder = self._accumulator()
        adder.submit(lambda: self._add_one(st, src, event, final, job, epoch),
                     after=(lambda: release(src)) if release is not None else None)

    def _accumulator(self) -> AccumulateWorker:
        if self._adder is None:
            self._adder = AccumulateWorker(self.threads)
        return self._adder

    def _add_one(self, st: ShardOptimState, src: torch.Tensor, event: Any, final: bool, job: Optional[StepJob],
                 epoch: int) -> None:
        """On the accumulation worker: ``src`` into the shard's fp32 accumulator (copied in the
        window's first micro-batch), chunk by chunk; the sum's norm in the boundary micro-batch."""
        # the step worker may still be stepping the last window's accumulator: it must be done first
        self._wait_idle(st, _name(st))
        if event is not None:
            event.synchronize()
        if st.grad is None:
            st.grad = torch.empty(st.numel, dtype=torch.float32)
        adder = self._adder
        if adder.scratch is None:
            adder.scratch = torch.empty(ADD_CHUNK, dtype=torch.float32)
        fresh = len(st.written) != len(st.shard.slices)
        squares: Optional[list] = [] if final else None
        add_into(st.grad, src, copy=fresh, scratch=adder.scratch, squares=squares)
        if fresh:
            st.written.update(sl.offset for sl in st.shard.slices)
        if final:
            st.norm = norm_of_squares(squares)
        if job is not None:
            with self._lock:
                current = epoch == self._epoch  # cancel() abandoned the step meanwhile: hand nothing over
            if current:
                self._hand(st, job)

    def _add_on_device(self, st: ShardOptimState, src: torch.Tensor) -> None:
        """A unit with a device accumulator: its gradient (on the device) is added there on the
        current stream; in the boundary micro-batch the sum's norm is taken there and, when the unit
        is handed to the background step at once, the sum is copied to the host (``land``) and
        handed over like an unaccumulated gradient; otherwise it lands when ``step()`` steps it."""
        self.check("backward()")
        if st.acc_event is not None:  # the last window's sum may still be on its way to the host
            if st.grad.is_cuda:
                torch.cuda.current_stream(st.grad.device).wait_event(st.acc_event)
            st.acc_event = None
        if st.grad.device.type == "cpu" and self._caller_scratch is None:
            self._caller_scratch = torch.empty(ADD_CHUNK, dtype=torch.float32)
        fresh = len(st.written) != len(st.shard.slices)
        w = self.window
        final = w.open
        squares: Optional[list] = [] if final else None
        add_into(st.grad, src, copy=fresh, scratch=self._caller_scratch, squares=squares)
        if fresh:
            st.written.update(sl.offset for sl in st.shard.slices)
        if final:
            st.norm = norm_of_squares(squares)
            if w.eager:  # without a consumer until step(), a landed sum would hold its buffer
                self.land(st)
                self._hand(st, StepJob(w.hyper, None))
                w.handed_early += 1

    def land(self, st: ShardOptimState) -> None:
        """Copies a device accumulator's complete sum into a buffer of the landing ring (waiting for
        a free one): from here on it is the shard's gradient for the step (``src``, complete once
        ``event`` has), until the step gives the buffer back (``release_landing``)."""
        # the last step of this shard must be done (its forward waited for it already)
        self._wait_idle(st, _name(st))
        buf = self.ring.acquire(st)
        try:
            if self.copy_to_host is not None:
                ev = self.copy_to_host(st.grad, buf)
            else:
                buf.copy_(st.grad)
                ev = None
        except BaseException:
            self.ring.release(st)
            raise
        st.landing, st.src, st.event, st.acc_event = buf, buf, ev, ev

    def release_landing(self, st: ShardOptimState) -> None:
        """Gives the landing buffer ``st`` holds back to the ring (nothing if none): its step has
        read it, or its gradient is dropped (then ``src`` is forgotten too)."""
        if st.landing is None:
            return
        if st.src is st.landing:
            if st.event is not None:
                st.event.synchronize()  # the copy into it must be done before another lands there
            st.src = st.event = None
        st.landing = None
        self.ring.release(st)

    def _landed_for_step(self, st: ShardOptimState) -> None:
        """A device accumulator's sum that has not landed yet lands now, on the stepping thread
        (the serial step: its buffer was given back by the shard before)."""
        if st.src is not None or not st.device_acc:
            return
        if self._on_worker():
            raise RuntimeError(f"{_name(st)}: handed to the background step before its device sum landed")
        self.fill_unwritten([st])
        self.land(st)

    def accumulate(self, shard: FlatShard, sl: ParamSlice, grad: torch.Tensor) -> None:
        """Adds one parameter's gradient (any device/dtype) into the shard's fp32 accumulator."""
        st = self.by_shard.get(shard.index)
        if st is None:
            return
        if st.grad is None:
            st.grad = torch.empty(shard.numel, dtype=torch.float32)
        dst = st.grad[sl.offset:sl.offset + sl.numel]
        g = grad.detach().reshape(-1)
        if g.device.type != "cpu":
            g = g.to("cpu")
        if sl.offset in st.written:
            dst.add_(g)
        else:
            dst.copy_(g)
            st.written.add(sl.offset)

    def _add_flat(self, st: ShardOptimState, src: torch.Tensor) -> None:
        if st.grad is None:
            st.grad = torch.empty(st.numel, dtype=torch.float32, device=src.device)
        if len(st.written) == len(st.shard.slices):
            st.grad.add_(src)
        else:
            st.grad.copy_(src)
            st.written.update(sl.offset for sl in st.shard.slices)

    # ------------------------------------------------------------------------- device accumulators
    def accumulate_on_device(self, shard: FlatShard, device: torch.device) -> int:
        """Under accumulation, keeps the shard's fp32 gradient accumulator on ``device``: each
        micro-batch's gradient is added there (no copy off the device, no host add) and the sum is
        copied into a pinned host buffer once, in the boundary micro-batch, for the CPU step.
        Returns the device bytes taken (0: frozen, stepped on the device, or no accumulation)."""
        st = self.by_shard.get(shard.index)
        if st is None or st.dev is not None or st.device_acc or self.accumulate_steps <= 1:
            return 0
        self.wait("moving an accumulator", raise_failure=False)
        acc = torch.empty(st.numel, dtype=torch.float32, device=device)
        if st.grad is not None and st.written:  # the window's sum so far comes along
            acc.copy_(st.grad)
        st.grad, st.acc_event, st.device_acc = acc, None, True
        self._pin_landing = device.type == "cuda"
        self._size_ring()
        shard.run.accumulator_to_device()
        return acc.numel() * 4

    def _size_ring(self) -> None:
        self.ring.size_for([st.numel for st in self.states if st.device_acc], pin=self._pin_landing)

    def reserve_landing(self) -> int:
        """Allocates the landing ring for the units placed with a device accumulator now (else the
        first sum to land does); returns its bytes."""
        self.ring.reserve()
        return self.ring.nbytes

    def accumulator_to_host(self, shard: FlatShard) -> int:
        """Undoes ``accumulate_on_device``: the window's sum so far comes to a host accumulator of
        its own (a sum that landed already stays the step's gradient until the step gives its
        buffer back). Returns the device bytes freed."""
        st = self.by_shard.get(shard.index)
        if st is None or not st.device_acc:
            return 0
        if st.acc_event is not None:
            st.acc_event.synchronize()
        freed = st.grad.numel() * 4
        host = torch.empty(st.numel, dtype=torch.float32)
        if st.written:
            host.copy_(st.grad)
        st.grad, st.acc_event, st.device_acc = host, None, False
        self._size_ring()
        shard.run.accumulator_to_host()
        return freed

    # ------------------------------------------------------------------------- the accumulation worker
    def wait(self, what: str = "the optimizer step", raise_failure: bool = True) -> None:
        """Waits until every gradient handed to the accumulation worker is added; with
        ``raise_failure`` raises its failure (see ``check``)."""
        if self._adder is not None:
            self._adder.wait(what, raise_failure=False)
        if raise_failure:
            self.check(what)

    def check(self, what: str) -> None:
        """Raises the accumulation worker's failure the first time (as itself), then refuses to go on
        with the window it left incomplete until ``zero_grad`` drops it. Does not wait."""
        err = self._adder.failure if self._adder is not None else None
        if err is None:
            return
        self._adder.check()  # the failure itself, once
        raise RuntimeError(f"{what}: a gradient add of this optimizer step's accumulation failed earlier ({err!r}): "
                           "the accumulated gradients are incomplete; call zero_grad() to drop this step's "
                           "micro-batches, or load_checkpoint()") from err

    @property
    def failure(self) -> Optional[BaseException]:
        """The accumulation worker's failure (kept until ``zero_grad``), or None."""
        return self._adder.failure if self._adder is not None else None

    def take_busy(self) -> Optional[float]:
        """Seconds the accumulation worker spent adding since the last call (None: it never ran)."""
        return self._adder.take_busy() if self._adder is not None else None

    def abandon(self) -> None:
        """The step is abandoned (``cancel``): adds still queued hand nothing over to the step."""
        with self._lock:
            self._epoch += 1

    def on_adder(self) -> bool:
        return self._adder is not None and self._adder.is_current()

    # ------------------------------------------------------------------------- windows and norms
    def zero_grad(self) -> None:
        """Starts a new accumulation window: the next gradient of each shard overwrites its
        accumulator (no pass over it). Drops a window a failed add left incomplete."""
        self.wait("zero_grad()", raise_failure=False)
        if self._adder is not None:
            reported = self._adder.reported
            err = self._adder.take_failure()
            if err is not None and not reported:
                log.warning("a gradient add of this optimizer step's accumulation failed (%r); its micro-batches are "
                            "dropped", err)
        for st in self.states:
            st.written.clear()

    def fill_unwritten(self, states: Optional[Sequence[ShardOptimState]] = None) -> None:
        """Parameters that got no gradient in this window count as zero gradient."""
        for st in self.states if states is None else states:
            if len(st.written) == len(st.shard.slices) and st.grad is not None:
                continue
            if st.grad is None:
                st.grad = torch.empty(st.numel, dtype=torch.float32,
                                      device=st.dev.device if st.dev is not None else "cpu")
            for sl in st.shard.slices:
                if sl.offset not in st.written:
                    st.grad[sl.offset:sl.offset + sl.numel].zero_()
                    st.written.add(sl.offset)

    def norm_of(self, st: ShardOptimState) -> torch.Tensor:
        """The L2 norm of a shard's gradient in this window (fp32 scalar; 0 when it got none)."""
        if st.norm is not None:
            return st.norm.float()
        if st.src is not None:
            if st.event is not None:
                st.event.synchronize()
            return torch.linalg.vector_norm(st.src, 2, dtype=torch.float32)
        if st.grad is not None and st.written:
            self.fill_unwritten([st])
            return torch.linalg.vector_norm(st.grad, 2)
        return torch.zeros((), dtype=torch.float32)

    def grad_norm(self) -> float:
        """Global L2 norm over every shard's gradient (inf/nan if any is not finite), combined in
        shard order (the same in every path)."""
        self.wait("the gradient norm")
        norms = [self.norm_of(st) for st in self.states]
        if not norms:
            return 0.0
        dev = next((n.device for n in norms if n.device.type != "cpu"), torch.device("cpu"))
        return float(torch.linalg.vector_norm(torch.stack([n.to(dev) for n in norms]), 2))  # one sync

    def gradient(self, shard: FlatShard) -> Optional[torch.Tensor]:
        """A copy of the shard's gradient of this window in fp32 (None: frozen, or none yet)."""
        st = self.by_shard.get(shard.index)
        if st is None:
            return None
        self.wait("reading a gradient")
        if st.src is not None:
            if st.event is not None:
                st.event.synchronize()
            return st.src.float()
        return st.grad.clone() if st.grad is not None and st.written else None

    # ------------------------------------------------------------------------- what the step reads
    def for_step(self, st: ShardOptimState) -> torch.Tensor:
        """The shard's gradient for the one-pass CPU step as it is (the compute dtype or the fp32
        accumulator, or a device accumulator's sum, landed now if it has not; a shard that got none:
        zeros, weight decay still applies)."""
        self._landed_for_step(st)
        if st.src is not None:
            if st.event is not None:
                st.event.synchronize()
            return st.src
        if not self._on_worker():
            self.fill_unwritten([st])
        if st.grad is None:
            st.grad = torch.zeros(st.numel, dtype=torch.float32)
        return st.grad

    def fp32_for_step(self, st: ShardOptimState) -> torch.Tensor:
        """The shard's gradient for the step, in fp32 on the host (consumes ``src``). The fp32
        accumulator is completed (``fill_unwritten``) by ``step`` before any shard is handed over:
        the worker must not look at ``written``, which the caller resets for the next window."""
        self._landed_for_step(st)
        if st.src is not None:
            if st.event is not None:
                st.event.synchronize()
            key = threading.get_ident()
            buf = self._scratch.get(key)
            if buf is None or buf.numel() < st.numel:
                biggest = max(s.numel for s in self.states)
                buf = self._scratch[key] = torch.empty(biggest, dtype=torch.float32)
            g = buf[:st.numel]
            g.copy_(st.src)
            return g
        return self.for_step(st)

    # ------------------------------------------------------------------------- reports and life
    @property
    def bytes_by_tier(self) -> dict[str, int]:
        """Bytes of fp32 gradients by tier: "cpu" (accumulators in RAM, the landing ring device
        accumulators' sums land in) and "device" (device accumulators)."""
        out: dict[str, int] = {}
        for st in self.states:
            if st.grad is not None:
                on_device = st.device_acc or st.dev is not None or st.grad.device.type != "cpu"
                tier = "device" if on_device else "cpu"  # the CPU device's "device" is RAM too
                out[tier] = out.get(tier, 0) + st.grad.numel() * 4
        if self.ring.nbytes:
            out["cpu"] = out.get("cpu", 0) + self.ring.nbytes
        return out

    def stop(self) -> None:
        """Stops the accumulation worker (after what it was handed)."""
        if self._adder is not None:
            self._adder.close()
            self._adder = None

    def free(self) -> None:
        """Frees the accumulators and buffers (after ``stop``; the step worker stopped too)."""
        self._scratch.clear()
        self._caller_scratch = None
        for st in self.states:
            st.grad = None
            st.landing = st.acc_event = None
            st.device_acc = False
            st.shard.run.accumulator_to_host()
        self.ring.free()


__all__ = ["GradientIntake"]
