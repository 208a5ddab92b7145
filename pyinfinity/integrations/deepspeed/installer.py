"""Installing pyinfinity into DeepSpeed: ``AsyncIOBuilder`` and ``PinMemoryBuilder`` get a ``load``
returning pyinfinity's ops and an ``is_compatible`` that is true (the originals kept for
:func:`uninstall`), now if ``deepspeed`` is imported, else the moment ``import deepspeed``
completes (``pyinfinity.post_import``: a callback :func:`uninstall` cancels while it waits); the
parameter-swapper patch goes in with them. Every step is preceded by the layout checks
(``layout``)."""
from __future__ import annotations

import logging
import sys
import threading
import types
from typing import Any, Callable, Dict, Optional, Tuple

from pyinfinity import post_import
from pyinfinity.integrations.deepspeed.checkpoints import patch_save_checkpoint, unpatch_save_checkpoint
from pyinfinity.integrations.deepspeed.layout import PATCHED_METHODS, SUPPORTED_SERIES, check_layout
from pyinfinity.integrations.deepspeed.ops import PIN_OP_NAME, REPLACED_OPS
from pyinfinity.integrations.deepspeed.patching import MARK, original, restore, saved_method
from pyinfinity.integrations.deepspeed.swapper import (check_swapper_layout, patch_param_swapper, release_claims,
                                                       unpatch_param_swapper)

log = logging.getLogger(__name__)

Series = Tuple[Tuple[int, int], ...]
_state_lock = threading.RLock()
_patched: Dict[type, Dict[str, Any]] = {}  # class -> {method: original in its __dict__ or MISSING}
_pending: Optional[Series] = None  # the series install() asked for before deepspeed was imported


def _make_load(op_name: str, op: types.ModuleType, original: Callable[..., Any]) -> Callable[..., Any]:
    def load(self: Any, verbose: bool = False) -> Any:
        if getattr(self, "name", None) != op_name:  # a subclass, e.g. GDSBuilder ("gds")
            return original(self, verbose=verbose)
        return op

    setattr(load, MARK, True)
    load.__doc__ = f"pyinfinity: returns pyinfinity.integrations.deepspeed's {op.__name__} (no build)."
    return load


def _make_is_compatible(op_name: str, original: Callable[..., Any]) -> Callable[..., Any]:
    def is_compatible(self: Any, verbose: bool = False) -> bool:
        if getattr(self, "name", None) != op_name:
            return original(self, verbose=verbose)
        return True  # pyinfinity's core needs neither libaio nor a build

    setattr(is_compatible, MARK, True)
    return is_compatible


def _patch(supported: Series) -> None:
    """Checks DeepSpeed's layout, then patches its AsyncIOBuilder and PinMemoryBuilder and its
    parameter swapper (no-op when already patched)."""
    with _state_lock:
        classes = check_layout(supported)
        import deepspeed

        check_swapper_layout(deepspeed.__version__)  # before anything is patched
        from deepspeed.ops.op_builder.builder import OpBuilder

        for cls in classes:
            if cls in _patched:
                continue
            op_name = cls.NAME
            op = REPLACED_OPS[op_name][1]
            if op_name in OpBuilder._loaded_ops or (op_name == PIN_OP_NAME and
                                                    getattr(sys, "_deepspeed_pin_memory_op_module", None)):
                log.warning("DeepSpeed's own %s op was loaded before pyinfinity's install(); what was made "
                            "from it before now stays DeepSpeed's", op_name)
            saved = {m: saved_method(cls, m) for m in PATCHED_METHODS}
            cls.load = _make_load(op_name, op, original(cls, "load", saved["load"]))
            cls.is_compatible = _make_is_compatible(op_name, original(cls, "is_compatible", saved["is_compatible"]))
            _patched[cls] = saved
            log.info("pyinfinity: deepspeed %s %s.%s().load() now returns pyinfinity's %s", deepspeed.__version__,
                     cls.__module__, cls.__name__, op.__name__)
        patch_param_swapper(supported)
        patch_save_checkpoint()


def _unpatch() -> None:
    with _state_lock:
        for cls, saved in list(_patched.items()):
            for meth, orig in saved.items():
                restore(cls, meth, orig)
            del _patched[cls]
            log.info("pyinfinity: restored DeepSpeed's own %s.AsyncIOBuilder", cls.__module__)


#: the post-import callback that patches DeepSpeed once its import completes
_ON_IMPORT = "pyinfinity.integrations.deepspeed.installer:_on_import"


def _on_import(module: types.ModuleType) -> None:
    """``post_import``'s callback after ``import deepspeed``: patches, unless uninstalled since."""
    global _pending
    with _state_lock:
        supported, _pending = _pending, None
        if supported is not None:  # still wanted
            _patch(supported)


def _add_hook(supported: Series) -> None:
    global _pending
    if _pending is None:
        _pending = supported
        post_import.when_imported("deepspeed", _ON_IMPORT)


def _remove_hook() -> None:
    global _pending
    _pending = None
    post_import.cancel("deepspeed", _ON_IMPORT)


# -- public API --------------------------------------------------------------------------------------
def install(supported: Series = SUPPORTED_SERIES) -> None:
    """Makes DeepSpeed's ``AsyncIOBuilder().load()`` return :data:`aio_op` (pyinfinity's AioHandle).

    Works before or after ``import deepspeed`` (before: it patches when that import completes) and
    is idempotent. Raises :class:`DeepSpeedLayoutError` if deepspeed's version or layout differs,
    leaving DeepSpeed untouched. Handles DeepSpeed built before this call are not replaced.
    ``supported``: the DeepSpeed release series accepted.
    """
    with _state_lock:
        ds = sys.modules.get("deepspeed")
        if ds is None:
            _add_hook(supported)
            log.debug("pyinfinity: deepspeed not imported yet; will patch when it is")
            return
        if getattr(getattr(ds, "__spec__", None), "_initializing", False):
            raise RuntimeError("pyinfinity.integrations.deepspeed.install() called while deepspeed is being "
                               "imported; call it before or after `import deepspeed`")
        _patch(supported)


def uninstall() -> None:
    """Restores DeepSpeed's own AsyncIOBuilder (and drops a pending post-import hook), and undoes
    :func:`fix_nvme_prefetch`. Idempotent. Handles created while installed stay pyinfinity's."""
    with _state_lock:
        _remove_hook()
        _unpatch()
        unpatch_param_swapper()
        unpatch_save_checkpoint()
        release_claims()


def is_installed() -> bool:
    """True when DeepSpeed is patched, or will be when it is imported."""
    with _state_lock:
        return bool(_patched) or _pending is not None
