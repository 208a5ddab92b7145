"""The background step worker (``pyinfinity.overlap_step``): a thread that steps handed shards
while the caller goes on.

Without anything global to know first (no clipping, no fp16 loss scaling), each unit is handed
to it as soon as its gradient is complete, during the boundary backward; otherwise ``step``
computes the global norm from the per-unit norms and hands every shard over in order. ``step``
returns without waiting: a shard's new values reach its home (and its resident device copy) when
the worker has stepped it, and whoever reads a home first waits for that shard (``wait_for``) —
the next forward waits unit by unit, so the step overlaps it. The worker takes the lowest unit
index first (forward order) and reads the NVMe states of the shards queued behind the current
one ahead of use (one staging buffer each). Every path runs the same per-shard function on the
same inputs, so the results are bit-identical to the serial step. A failure is kept until
``reset``: the worker skips every shard handed to it after one (they would step on a state it
left half written) and the caller sees it at its next wait.
"""
from __future__ import annotations

import collections
import logging
import math
import queue
import threading
import time
from typing import Any, Callable, Optional

import torch

from pyinfinity.swap.tensor_swapper import Tier, TensorSwapper
from pyinfinity.zero.optim.records import BackgroundStepFailed, PhaseClock, ShardOptimState, StepJob

log = logging.getLogger(__name__)

WAIT_WARN_S = 30.0  # a wait on the background step logs what it waits for this often
WAIT_STUCK_S = 600.0  # ... and gives up (TimeoutError) when one shard takes this long


class StepWorker:
    """The ``pyinfinity-optimizer`` thread. ``step_shard(st, flat, job)`` steps one shard's state
    ``flat`` (in RAM) and writes its new values home; ``finish(st)`` marks its gradient consumed;
    ``staging()`` gives the staging buffers NVMe states are read into; ``threads`` the intra-op
    threads the thread runs (None: torch's default)."""

    def __init__(self, swapper: TensorSwapper, *, step_shard: Callable[[ShardOptimState, torch.Tensor, StepJob], None],
                 finish: Callable[[ShardOptimState], None], staging: Callable[[], list[torch.Tensor]],
                 phases: PhaseClock) -> None:
        self.swapper = swapper
        self._step_shard = step_shard
        self._finish = finish
        self._staging = staging
        self._phases = phases
        self.threads: Optional[int] = None
        # the lowest unit index first (forward order): after backward, the units the next forward
        # needs first are stepped first, so it overlaps the rest of the step
        self._queue: "queue.PriorityQueue[tuple[float, int, Optional[tuple[ShardOptimState, StepJob]]]]" = \
            queue.PriorityQueue()
        self._seq = 0
        self.thread: Optional[threading.Thread] = None
        self.cond = threading.Condition()
        self._error: Optional[BaseException] = None  # the worker's failure, kept until reset()
        self._error_reported = False  # raised once in the caller's thread
        self._current: Optional[ShardOptimState] = None
        self._busy_s = 0.0  # seconds since the last ``take_times``
        self._read_wait_s = 0.0

    # ------------------------------------------------------------------------- the caller's side
    def is_current(self) -> bool:
        """Whether the calling thread is the worker."""
        return threading.current_thread() is self.thread

    def start(self) -> None:
        if self.thread is None or not self.thread.is_alive():
            ready = threading.Event()
            self.thread = threading.Thread(target=self._work, args=(ready,), name="pyinfinity-optimizer", daemon=True)
            self.thread.start()
            if not ready.wait(WAIT_STUCK_S):
                raise RuntimeError(f"the optimizer's worker thread did not start in {WAIT_STUCK_S:.0f}s")
            if self.threads is not None:
                # torch.set_num_threads in the worker also set the default of threads started later:
                # put it back (this thread keeps its own count, the worker keeps ``threads``)
                torch.set_num_threads(torch.get_num_threads())

    def hand(self, st: ShardOptimState, job: StepJob) -> None:
        """Queues one shard's step; its home is rewritten (a fetch waits for the worker)."""
        self.start()
        with self.cond:
            st.busy = True
            st.handed = True
            st.shard.run.home_awaits_step()
            self._seq += 1
            seq = self._seq
        self._queue.put((st.shard.index, seq, (st, job)))

    def wait(self, done: Callable[[], bool], what: str) -> None:
        """Waits until ``done()`` (checked under the worker's lock), logging every WAIT_WARN_S what
        the worker is on; TimeoutError after WAIT_STUCK_S, RuntimeError if the thread died."""
        t_start = time.perf_counter()
        with self.cond:
            while not done():
                if self.thread is None or not self.thread.is_alive():
                    raise RuntimeError(f"the optimizer's worker thread died while {what} was pending")
                if not self.cond.wait(WAIT_WARN_S):
                    cur = self._current
                    on = (f"shard {cur.shard.index} ({cur.shard.module_name or '<root>'}, {cur.home.tier.value} tier)"
                          if cur is not None else "the next queued shard")
                    waited = time.perf_counter() - t_start
                    msg = f"waited {waited:.0f}s for {what}; the optimizer's worker is on {on}"
                    if waited >= WAIT_STUCK_S:
                        raise TimeoutError(msg + "; giving up (the optimizer state is partly stepped)")
                    log.warning("%s", msg)

    def wait_for(self, st: ShardOptimState, what: str) -> None:
        """Waits until the worker is done with ``st`` (not busy)."""
        self.wait(lambda: not st.busy, what)

    @property
    def failure(self) -> Optional[BaseException]:
        return self._error

    def raise_error(self) -> None:
        """Raises the worker's failure in the caller's thread: the exception itself the first
        time, a ``BackgroundStepFailed`` naming it after that (until ``reset``)."""
        err = self._error
        if err is None:
            return
        if not self._error_reported:
            self._error_reported = True
            raise err
        raise BackgroundStepFailed(f"the background optimizer step failed earlier ({err!r}): the optimizer state is "
                                   "partly stepped; load_checkpoint() or build a new engine") from err

    def reset(self) -> None:
        """Forgets the failure (the step was abandoned)."""
        self._error, self._error_reported = None, False

    def take_times(self) -> tuple[float, float]:
        """(busy, read-wait) seconds of the worker since the last call."""
        with self.cond:
            out = (self._busy_s, self._read_wait_s)
            self._busy_s = self._read_wait_s = 0.0
        return out

    def stop(self) -> None:
        """Stops the thread after the shard it is on (from the thread itself: when it gets there)."""
        if self.thread is None:
            return
        self._queue.put((math.inf, 0, None))
        if self.thread is not threading.current_thread():
            self.thread.join(WAIT_STUCK_S)
            if self.thread.is_alive():
                log.warning("the optimizer's worker thread did not stop within %.0fs", WAIT_STUCK_S)
        self.thread = None

    # ------------------------------------------------------------------------- the thread
    def _work(self, ready: threading.Event) -> None:
        """Steps handed shards in order, reading the NVMe states of the shards queued behind the
        current one ahead of use (one staging buffer each)."""
        if self.threads is not None:
            torch.get_num_threads()  # the thread's lazy init first, or its first op would redo it from the default
            torch.set_num_threads(self.threads)
        ready.set()
        staging = self._staging()
        nb = max(1, len(staging))
        counter = 0
        pending: dict[int, Any] = {}  # staging buffer -> write-back in flight
        written: dict[int, Any] = {}  # shard index -> its state's write-back in flight (read it only after)
        ahead: collections.deque = collections.deque()  # [state, job, buffer, read request, submit error]
        stop = False

        def take(item: tuple) -> None:
            nonlocal counter
            st, job = item
            entry = [st, job, None, None, None]
            if st.home.tier == Tier.NVME and self._error is None:
                b = counter % nb
                counter += 1
                entry[2] = b
                try:
                    w = pending.pop(b, None)
                    if w is not None:
                        w.wait()
                    w = written.pop(st.shard.index, None)
                    if w is not None:  # its last step's state is still on its way to the disk
                        w.wait()
                    entry[3] = self.swapper.read(st.home, staging[b][:st.home.numel])
                except BaseException as exc:  # noqa: BLE001 - raised when this shard's turn comes
                    entry[4] = exc
            ahead.append(entry)

        while True:
            if not ahead:
                if stop:
                    return
                item = self._queue.get()[2]
                if item is None:
                    return
                take(item)
            while not stop and len(ahead) < nb:
                try:
                    item = self._queue.get_nowait()[2]
                except queue.Empty:
                    break
                if item is None:
                    stop = True
                    break
                take(item)
            st, job, b, req, submit_error = ahead.popleft()
            with self.cond:
                self._current = st
                failed = self._error is not None
            t0 = time.perf_counter()
            try:
                if submit_error is not None:
                    raise submit_error
                if failed:
                    if req is not None:
                        req.wait()  # its buffer must be free before anyone reuses it
                else:
                    self._step_one(st, job, staging[b][:st.home.numel] if b is not None else None, req, pending, b)
                    if b is not None:
                        written[st.shard.index] = pending[b]
                if not ahead and self._queue.empty():
                    for w in pending.values():
                        w.wait()
                    pending.clear()
                    written.clear()
            except BaseException as exc:  # noqa: BLE001 - raised in the caller's thread
                for w in pending.values():
                    try:
                        w.wait()
                    except BaseException as exc2:  # noqa: BLE001 - the first failure is the one raised
                        log.debug("optimizer worker: a write-back after the failure also failed: %r", exc2)
                pending.clear()
                written.clear()
                with self.cond:
                    if self._error is None:
                        self._error = exc
                log.debug("optimizer worker: stepping shard %d failed: %r", st.shard.index, exc)
            finally:
                with self.cond:
                    self._busy_s += time.perf_counter() - t0
                    st.busy = False
                    self._current = None
                    self.cond.notify_all()

    def _step_one(self, st: ShardOptimState, job: StepJob, buf: Optional[torch.Tensor], req: Any,
                  pending: dict[int, Any], b: Optional[int]) -> None:
        if st.home.tier == Tier.CPU:
            flat = st.home.tensor
        else:
            t0 = time.perf_counter()
            req.wait()
            waited = time.perf_counter() - t0
            with self.cond:
                self._read_wait_s += waited
            self._phases.add(read_wait=waited)
            flat = buf
        self._step_shard(st, flat, job)
        if st.home.tier == Tier.NVME:
            pending[b] = self.swapper.write(st.home, buf)
        self._finish(st)


__all__ = ["StepWorker", "WAIT_STUCK_S", "WAIT_WARN_S"]
