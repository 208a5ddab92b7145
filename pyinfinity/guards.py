"""Guards on a model wrapped by an engine: the plain-PyTorch entry points that would silently read
or write offloaded (empty) parameters raise an error that says what to do instead.

* wrapping a model that an engine already wrapped is refused (its parameters are shards now);
* ``model.state_dict()`` (and so ``save_pretrained()``, ``torch.save(model.state_dict())``) while
  wrapped refuses: the parameters hold no values; ``engine.export(dir)`` writes the real weights;
* ``model(x)`` after ``engine.close()`` refuses: the trained values went with the swap files.
  Export before closing, then load the exported weights into a fresh model.
"""
from __future__ import annotations

import contextlib
import threading
import weakref
from typing import Any, Iterator

from torch import nn

_MARK = "_pyinfinity_engine"  # attribute on the wrapped root module: a weak reference to its engine
_allowed = threading.local()  # set while the engine itself reads the module's state dict


def check_not_wrapped(model: nn.Module) -> None:
    """Refuses a model an engine already wrapped (open or closed): its parameters are offloaded shards."""
    ref = getattr(model, _MARK, None)
    if ref is None:
        return
    eng = ref()
    state = "closed" if eng is None or getattr(eng, "closed", True) else "open"
    raise ValueError(f"model: already wrapped by a pyinfinity engine ({state}); its parameters are offloaded "
                     "shards, not weights: pass the engine itself to your training code, or export the weights "
                     "(engine.export(dir)) and load them into a fresh model to wrap again")


def attach(engine: Any, model: nn.Module) -> None:
    """Marks ``model`` as wrapped by ``engine`` (held weakly) and installs the guards."""
    ref = weakref.ref(engine)
    setattr(model, _MARK, ref)

    def state_dict_pre(module: nn.Module, prefix: str, keep_vars: bool) -> None:
        if getattr(_allowed, "on", False):
            return
        eng = ref()
        when = "after engine.close()" if eng is None or eng.closed else "while a pyinfinity engine trains it"
        raise RuntimeError(f"state_dict() {when}: the model's parameters are offloaded shards and hold no "
                           "weights (save_pretrained() and torch.save(model.state_dict()) would write empty "
                           "tensors); use engine.export(dir) (before close()) for the trained weights, or "
                           "engine.save_checkpoint(dir) for the full training state")

    def forward_pre(module: nn.Module, args: Any) -> None:
        eng = ref()
        if eng is None or eng.closed:
            raise RuntimeError("model(...) after engine.close(): the engine was closed and the trained values "
                               "went with its swap files; export the weights with engine.export(dir) before "
                               "close() and load them into a fresh model")

    for m in model.modules():
        m.register_state_dict_pre_hook(state_dict_pre)
    model.register_forward_pre_hook(forward_pre)


@contextlib.contextmanager
def engine_state_dict() -> Iterator[None]:
    """The engine's own reads of the module's state dict (export) pass the guard."""
    prev = getattr(_allowed, "on", False)
    _allowed.on = True
    try:
        yield
    finally:
        _allowed.on = prev
