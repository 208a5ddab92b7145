"""The landing ring (``zero.optim.landing``): the few buffers device accumulators' sums land in,
taken in turn and given back by the step that read them; a wait for one never hangs."""
from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import pytest

from pyinfinity.layout.pools import LANDING_SLOTS, landing_bytes, landing_ring
from pyinfinity.zero.optim.landing import LandingRing


def _state(index: int, numel: int, busy: bool = True) -> SimpleNamespace:
    return SimpleNamespace(shard=SimpleNamespace(index=index), numel=numel, busy=busy)


def _ring(check=lambda: None) -> LandingRing:
    return LandingRing(check=check, releasing=lambda st: st.busy)


def test_the_layout_charges_landing_slots_buffers_of_the_largest_unit_whatever_their_number():
    assert landing_ring([]) == (0, 0) and landing_bytes([]) == 0
    assert landing_ring([10, 30]) == (2, 30)  # fewer units than slots: a buffer each
    assert landing_ring([10, 30, 20, 5, 7]) == (LANDING_SLOTS, 30)
    assert landing_bytes([10, 30, 20, 5, 7]) == LANDING_SLOTS * 30 * 4
    assert landing_bytes([100] * 1000) == landing_bytes([100] * LANDING_SLOTS)


def test_the_ring_is_the_layouts_and_a_buffer_given_back_is_the_next_one_taken():
    ring = _ring()
    numels = [10, 30, 20, 5, 7]
    ring.size_for(numels, pin=False)
    assert ring.nbytes == 0  # allocated by reserve() or the first sum that lands
    ring.reserve()
    assert ring.nbytes == landing_bytes(numels) and len(ring.buffers) == LANDING_SLOTS
    states = [_state(i, n) for i, n in enumerate(numels)]
    taken = [ring.acquire(st) for st in states[:LANDING_SLOTS]]
    assert [t.numel() for t in taken] == numels[:LANDING_SLOTS]
    assert len({t.data_ptr() for t in taken}) == LANDING_SLOTS  # distinct buffers
    assert ring.release(states[1]) and not ring.release(states[1])  # a second release gives nothing back
    again = ring.acquire(states[3])
    assert again.data_ptr() == taken[1].data_ptr()
    with pytest.raises(RuntimeError, match="landed twice"):
        ring.acquire(states[3])


def test_a_taker_waits_until_the_step_gives_a_buffer_back():
    ring = _ring()
    ring.size_for([8, 8, 8, 8], pin=False)
    states = [_state(i, 8) for i in range(4)]
    for st in states[:3]:
        ring.acquire(st)
    got: list = []
    t = threading.Thread(target=lambda: got.append(ring.acquire(states[3])))
    t.start()
    time.sleep(0.2)
    assert not got and t.is_alive()  # every buffer is held by a unit being stepped
    ring.release(states[0])
    t.join(5)
    assert got and not t.is_alive()


def test_a_wait_raises_the_step_workers_failure_instead_of_hanging():
    failure = OSError("the step of shard 0 failed")

    def check() -> None:
        raise failure

    ring = _ring(check)
    ring.size_for([8, 8], pin=False)
    a, b, c = _state(0, 8), _state(1, 8), _state(2, 8)
    ring.acquire(a)
    ring.acquire(b)  # a free buffer: the failure is not looked at
    t0 = time.perf_counter()
    with pytest.raises(OSError, match="shard 0 failed"):
        ring.acquire(c)
    assert time.perf_counter() - t0 < 1.0


def test_a_wait_refuses_when_no_holder_is_being_stepped():
    ring = _ring()
    ring.size_for([8, 8], pin=False)
    held = [_state(0, 8, busy=False), _state(1, 8, busy=False)]
    for st in held:
        ring.acquire(st)
    with pytest.raises(RuntimeError, match="nothing would give one back"):
        ring.acquire(_state(2, 8))


def test_a_smaller_placement_shrinks_the_ring_once_no_buffer_is_held_and_none_frees_it():
    ring = _ring()
    ring.size_for([30, 30, 30, 30], pin=False)
    ring.reserve()
    a = _state(0, 30)
    ring.acquire(a)
    ring.size_for([10, 10], pin=False)  # accumulators given back to the host mid-step
    assert ring.nbytes == landing_bytes([30] * 4)  # a's sum is still to be read
    ring.release(a)
    assert ring.nbytes == landing_bytes([10, 10])
    ring.size_for([], pin=False)
    assert ring.nbytes == 0 and ring.buffers == []
    with pytest.raises(RuntimeError, match="no landing buffer"):
        ring.acquire(_state(5, 10))
