"""The fault-injection seam of the I/O layer, for tests (see csrc/include/pyinfinity/fault.hpp)."""
from __future__ import annotations

import contextlib
import errno as _errno
from typing import Iterator, Union

from pyinfinity import _C


@contextlib.contextmanager
def fault_injection(op: str = "any", nth: int = 1, action: str = "errno",
                    value: Union[int, str] = _errno.EIO, count: int = 1) -> Iterator[None]:
    """Within the block, the `nth` I/O piece of kind `op` ("read", "write", "any") and the
    `count - 1` after it (count=0: all) fail with errno `value` (action="errno"), come back
    short (action="short"), or stall for `value` ms (action="stall")."""
    if isinstance(value, str):
        value = getattr(_errno, value)
    _C.set_fault(op, nth, action, int(value), count)
    try:
        yield
    finally:
        _C.clear_fault()


def faults_injected() -> int:
    """How many pieces the seam has altered since the process started."""
    return _C.faults_injected()
