"""Gradient accumulation on the host, off the training loop's thread.

Under ``gradient_accumulation_steps`` > 1 every micro-batch's gradient of a unit is added into that
unit's fp32 accumulator. Done in the gradient hook it stalls backward for the whole add (and on a
GPU for the copy off the device before it), and torch's CPU ``fp32.add_(bf16)`` first converts the
whole source into an fp32 temporary of the gradient's size: an allocation of 4 bytes a parameter,
its page faults and a second pass, every micro-batch. Here instead:

* ``GradStaging``: a few (``STAGING_SLOTS``) staging buffers a unit's gradient lands in (pinned
  with a GPU), taken in turn: the copy off the device of unit k+1 runs while unit k is added;
* ``AccumulateWorker``: a thread that runs the adds in the order they were handed over, while
  backward goes on; a failure is kept and raised in the caller's thread at its next sync point;
* ``add_into``: the add (or the first micro-batch's copy) in one pass of a C++ kernel for fp32 and
  bf16 gradients (the GIL released, so the training thread's hooks run beside it), else
  ``ADD_CHUNK`` elements at a time through a small fp32 scratch buffer; no gradient-sized temporary
  is ever made, and the fp32 sums are those of one ``add_``, bit for bit (each element is
  converted exactly and added once).
"""
from __future__ import annotations

import collections
import logging
import threading
import time
from typing import Callable, Optional

import torch

from pyinfinity.swap.tensor_swapper import aligned_empty

log = logging.getLogger(__name__)

STAGING_SLOTS = 3  # gradient staging buffers: one being filled, one being added, one spare (plan.placement counts them)
# elements added per op: a 4 MiB fp32 chunk stays in the caches between its conversion and its add
ADD_CHUNK = 1 << 20
WAIT_STUCK_S = 600.0  # a wait for a staging slot or for the worker gives up (TimeoutError) after this long


_KERNEL_DTYPES = {torch.float32: 0, torch.bfloat16: 1}  # sources _C.accumulate_grad reads (its grad_type codes)


def add_into(dst: torch.Tensor, src: torch.Tensor, *, copy: bool, scratch: Optional[torch.Tensor] = None,
             squares: Optional[list] = None) -> None:
    """``dst += src`` (``dst = src`` with ``copy``) for a flat fp32 ``dst`` and a flat ``src`` of any
    floating dtype and the same length. On the CPU an fp32 or bf16 source goes through the C++
    kernel (``_C.accumulate_grad``: one pass, torch's intra-op threads, the GIL released); another
    goes ``ADD_CHUNK`` elements at a time through ``scratch`` (fp32, at least ``ADD_CHUNK``
    elements; made here when None), never a temporary of its own size. With ``squares`` (a list),
    the sum of squares of each ``ADD_CHUNK`` chunk of the result is appended (a BLAS dot; the
    chunked path reads it while the chunk is hot; ``norm_of_squares`` gives the whole's L2 norm:
    closer to the exact value than one fp32 ``vector_norm`` of the whole, 1e-5 relative off at 1M
    elements)."""
    n = dst.numel()
    if src.numel() != n:
        raise ValueError(f"add_into: {src.numel()} elements into {n}")
    if dst.device.type != "cpu":  # device kernels convert in registers: one op, no temporary
        dst.copy_(src) if copy else dst.add_(src)
        if squares is not None:
            squares.append(torch.dot(dst, dst))
        return
    if (src.dtype in _KERNEL_DTYPES and dst.dtype == torch.float32 and src.device.type == "cpu"
            and dst.is_contiguous() and src.is_contiguous()):
        # the C++ pass: one read of each array, on torch's intra-op threads, without the GIL (the
        # training thread's hooks keep running beside it)
        from pyinfinity import _C

        _C.accumulate_grad(dst.data_ptr(), src.data_ptr(), _KERNEL_DTYPES[src.dtype], n, copy,
                           torch.get_num_threads())
        if squares is not None:  # the same chunks' dots as the loop below takes
            squares.extend(torch.dot(dst[a:a + ADD_CHUNK], dst[a:a + ADD_CHUNK]) for a in range(0, n, ADD_CHUNK))
        return
    convert = src.dtype != dst.dtype and not copy
    if convert and (scratch is None or scratch.numel() < min(n, ADD_CHUNK)):
        scratch = torch.empty(min(n, ADD_CHUNK), dtype=dst.dtype)
    for a in range(0, n, ADD_CHUNK):
        b = min(n, a + ADD_CHUNK)
        d = dst[a:b]
        if copy:
            d.copy_(src[a:b])
        elif convert:
            t = scratch[:b - a]
            t.copy_(src[a:b])
            d.add_(t)
        else:
            d.add_(src[a:b])
        if squares is not None:
            squares.append(torch.dot(d, d))


def norm_of_squares(squares: list) -> torch.Tensor:
    """The L2 norm (fp32 scalar, on the chunks' device) of a whole from its chunks' sums of
    squares (``add_into``'s ``squares``), summed in fp64."""
    if not squares:
        return torch.zeros((), dtype=torch.float32)
    return torch.stack([x.double() for x in squares]).sum().sqrt().float()


class GradStaging:
    """``count`` flat buffers of ``nbytes`` each where units' gradients land on the host, handed out
    in turn: ``acquire`` waits until one is free, ``release`` (by the worker, after the add) frees it.
    Pinned when ``pin`` (a copy off a GPU runs at the link's speed only into pinned memory)."""

    def __init__(self, nbytes: int, count: int = STAGING_SLOTS, pin: bool = False) -> None:
        if count < 1:
            raise ValueError(f"GradStaging: count must be >= 1, got {count}")
        self.nbytes = int(nbytes)
        self.count = count
        self.pin = pin
        self._bufs: list[torch.Tensor] = []  # allocated on first use
        self._free: collections.deque = collections.deque(range(count))
        self._by_ptr: dict[int, int] = {}
        self._cond = threading.Condition()

    @property
    def allocated_bytes(self) -> int:
        return sum(b.numel() for b in self._bufs)

    def acquire(self, nbytes: int, dtype: torch.dtype) -> torch.Tensor:
        """A free buffer's first ``nbytes`` as a flat ``dtype`` tensor; waits for one."""
        if nbytes > self.nbytes:
            raise ValueError(f"GradStaging: {nbytes} bytes asked of buffers of {self.nbytes}")
        if not self._bufs:
            self._bufs = [aligned_empty(max(1, self.nbytes), torch.uint8, pin=self.pin) for _ in range(self.count)]
            self._by_ptr = {b.data_ptr(): i for i, b in enumerate(self._bufs)}
        t0 = time.perf_counter()
        with self._cond:
            while not self._free:
                if not self._cond.wait(WAIT_STUCK_S) and time.perf_counter() - t0 >= WAIT_STUCK_S:
                    raise TimeoutError(f"no gradient staging buffer came free in {WAIT_STUCK_S:.0f}s (the "
                                       "accumulation worker holds all of them)")
            i = self._free.popleft()
        return self._bufs[i][:nbytes].view(dtype)

    def owns(self, t: torch.Tensor) -> bool:
        return t.device.type == "cpu" and t.data_ptr() in self._by_ptr

    def release(self, t: torch.Tensor) -> None:
        """Frees the buffer ``t`` came from (``acquire``); a tensor of no buffer here is ignored."""
        i = self._by_ptr.get(t.data_ptr()) if t.device.type == "cpu" else None
        if i is None:
            return
        with self._cond:
            if i not in self._free:
                self._free.append(i)
            self._cond.notify_all()

    def close(self) -> None:
        with self._cond:
            self._bufs, self._by_ptr = [], {}
            self._free = collections.deque(range(self.count))
            self._cond.notify_all()


class AccumulateWorker:
    """A thread that runs gradient adds in the order they were submitted. A job's ``run`` failing
    is kept (``failure``): the jobs after it are not run (the window's sums are incomplete anyway)
    but their ``finally`` parts (a staging buffer's release) are; ``wait`` and ``check`` raise it in
    the caller's thread, once (``take_failure`` clears it)."""

    def __init__(self, threads: Optional[int] = None, name: str = "pyinfinity-accumulate") -> None:
        self.threads = threads
        self.name = name
        self._jobs: collections.deque = collections.deque()
        self._cond = threading.Condition()
        self._running = False  # a job is being run now
        self._thread: Optional[threading.Thread] = None
        self._stop = False
        self._error: Optional[BaseException] = None
        self._reported = False
        self.busy_s = 0.0  # seconds spent in jobs since the last ``take_busy``
        self.scratch: Optional[torch.Tensor] = None  # the worker's fp32 chunk for add_into

    # -- the caller's side
    def submit(self, run: Callable[[], None], after: Optional[Callable[[], None]] = None) -> None:
        """Queues ``run`` (skipped after a failure) and then ``after`` (always run)."""
        self._start()
        with self._cond:
            self._jobs.append((run, after))
            self._cond.notify_all()

    @property
    def idle(self) -> bool:
        with self._cond:
            return not self._jobs and not self._running

    @property
    def failure(self) -> Optional[BaseException]:
        return self._error

    def check(self) -> None:
        """Raises the worker's failure if there is one not raised yet (does not wait)."""
        err = self._error
        if err is not None and not self._reported:
            self._reported = True
            raise err

    @property
    def reported(self) -> bool:
        """Whether ``failure`` was raised in the caller's thread already."""
        return self._reported

    def wait(self, what: str = "the gradient accumulation", raise_failure: bool = True) -> None:
        """Waits until every submitted job has run; with ``raise_failure`` raises a failure not
        raised yet."""
        t0 = time.perf_counter()
        with self._cond:
            while self._jobs or self._running:
                if self._thread is None or not self._thread.is_alive():
                    raise RuntimeError(f"the accumulation worker thread died while {what} was pending")
                if not self._cond.wait(30.0):
                    waited = time.perf_counter() - t0
                    if waited >= WAIT_STUCK_S:
                        raise TimeoutError(f"waited {waited:.0f}s for {what}; giving up")
                    log.warning("waited %.0fs for %s (%d adds queued)", waited, what, len(self._jobs))
        if raise_failure:
            self.check()

    def take_failure(self) -> Optional[BaseException]:
        """Forgets the failure (after it was dealt with); returns it, or None."""
        with self._cond:
            err, self._error, self._reported = self._error, None, False
        return err

    def is_current(self) -> bool:
        """Whether the calling thread is the worker."""
        return self._thread is not None and threading.current_thread() is self._thread

    def take_busy(self) -> float:
        with self._cond:
            s, self.busy_s = self.busy_s, 0.0
        return s

    def close(self) -> None:
        """Runs what is queued, then stops the thread."""
        t = self._thread
        if t is None:
            return
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        if t is not threading.current_thread():
            t.join(WAIT_STUCK_S)
            if t.is_alive():
                log.warning("the accumulation worker thread did not stop within %.0fs", WAIT_STUCK_S)
        self._thread = None
        self.scratch = None
        if self._error is not None and not self._reported:
            log.error("a gradient add failed and was never reported: %r", self._error)

    # -- the thread
    def _start(self) -> None:
        if self._thread is not None and self._thread.is_alive():
            return
        self._stop = False
        ready = threading.Event()
        self._thread = threading.Thread(target=self._loop, args=(ready,), name=self.name, daemon=True)
        self._thread.start()
        if not ready.wait(WAIT_STUCK_S):
            raise RuntimeError(f"the accumulation worker thread did not start in {WAIT_STUCK_S:.0f}s")
        if self.threads is not None:
            # torch.set_num_threads in the worker also set the default of threads started later: put it back
            torch.set_num_threads(torch.get_num_threads())

    def _loop(self, ready: threading.Event) -> None:
        if self.threads is not None:
            torch.get_num_threads()  # the thread's lazy init first, or its first op would redo it from the default
            torch.set_num_threads(self.threads)
        ready.set()
        while True:
            with self._cond:
                while not self._jobs and not self._stop:
                    self._cond.wait()
                if not self._jobs:
                    return
                run, after = self._jobs.popleft()
                self._running = True
                failed = self._error is not None
            t0 = time.perf_counter()
            try:
                if not failed:
                    run()
            except BaseException as exc:  # noqa: BLE001 - raised in the caller's thread
                log.debug("accumulation worker: an add failed: %r", exc)
                with self._cond:
                    if self._error is None:
                        self._error, self._reported = exc, False
            finally:
                try:
                    if after is not None:
                        after()
                except BaseException as exc:  # noqa: BLE001 - raised in the caller's thread
                    with self._cond:
                        if self._error is None:
                            self._error, self._reported = exc, False
                with self._cond:
                    self.busy_s += time.perf_counter() - t0
                    self._running = False
                    self._cond.notify_all()


__all__ = ["ADD_CHUNK", "STAGING_SLOTS", "AccumulateWorker", "GradStaging", "add_into", "norm_of_squares"]
