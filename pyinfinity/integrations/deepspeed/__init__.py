"""pyinfinity as DeepSpeed's NVMe I/O backend (ZeRO-Infinity swapping and the fast checkpoint writer).

After :func:`install` (or with ``PYINFINITY_DEEPSPEED=1`` when this package is imported), every
``AsyncIOBuilder().load()`` in DeepSpeed returns :data:`aio_op`, a module-like object whose
``aio_handle`` is :class:`DeepSpeedAioHandle` — pyinfinity's ``AioHandle`` (C++ engine, pinned
buffers from pyinfinity's arena) plus I/O counters. DeepSpeed's own ``async_io`` op (libaio, a
JIT build of several minutes) is then never built or loaded.

Why this way: DeepSpeed binds the *class* ``AsyncIOBuilder`` at import time in every module that
does NVMe I/O (the three swappers in ``runtime/swap_tensor`` and
``runtime/model_checkpointing/writer_factory.py``), and each calls ``AsyncIOBuilder().load()``
when it builds its handles. The one object all of them share is that class, so ``install()``
replaces its ``load`` and ``is_compatible`` in place (the originals are kept for
:func:`uninstall`). That reaches every binding however early it was made, rebinds nothing in the
importers (``BINDING_MODULES`` is only checked), and leaves ``OpBuilder._loaded_ops`` alone
(seeding it would not do: the builder's ``load`` first JIT-builds the ``pin_memory`` op). If
``deepspeed`` is not imported yet, ``install()`` does not import it; a post-import hook patches the
moment ``import deepspeed`` completes. A DeepSpeed whose version (``SUPPORTED_SERIES``, read when
``install()`` is called) or layout differs from what this was checked against makes ``install()``
(or that import) raise :class:`DeepSpeedLayoutError`, naming each difference.

``PinMemoryBuilder`` (DeepSpeed's ``pin_memory`` op) is replaced the same way: its ``pin_handle``
and every ``aio_handle`` share one page-locked registry, as DeepSpeed's two ops do.

``install()`` also patches DeepSpeed's parameter swapper, where ``offload_param.device: nvme``
stops training whatever the I/O backend ("Not enough buffers", "More elements ... than buffer
size", a repeated parameter in a prefetch), and makes each rank claim its own lock on
``nvme_path`` before DeepSpeed empties its swap folders there (a second job is refused).
:func:`size_nvme_offload` sizes DeepSpeed's swap knobs from the model before DeepSpeed sees the
config.

The package, bottom up: ``ops`` (the handle, its counters and the two op stand-ins), ``layout``
(the versions known and the layout checks), ``patching`` (replacing and restoring a method),
``swapper`` (the parameter-swapper patch and the swap-folder claims), ``sizing``
(:func:`size_nvme_offload`), ``installer`` (:func:`install`, :func:`uninstall`). Everything public
is importable from here.
"""
from __future__ import annotations

import os

from pyinfinity.aio import AioHandle, PinHandle
from pyinfinity.integrations.deepspeed import installer
from pyinfinity.integrations.deepspeed.installer import is_installed, uninstall
from pyinfinity.integrations.deepspeed.layout import (BINDING_MODULES, BINDING_SOURCES, ENV_VAR, SUPPORTED_SERIES,
                                                      TESTED_VERSION, DeepSpeedLayoutError, binding_surface,
                                                      surface_differences)
from pyinfinity.integrations.deepspeed.ops import (OP_NAME, PIN_OP_NAME, REPLACED_OPS, DeepSpeedAioHandle, IoStats,
                                                   aio_op, pin_op, reset_stats, stats)
from pyinfinity.integrations.deepspeed.sizing import (AIO_ALIGNED_BYTES, DS_DEFAULTS, FETCH_RESERVE, MIN_AIO_BYTES,
                                                      OPTIMIZER_SWAP_BUFFERS, PIPELINE_SUB_GROUPS, NvmeOffloadSizing,
                                                      size_nvme_offload)
from pyinfinity.integrations.deepspeed.swapper import (SwapBuffersExhausted, claim_dir, patch_param_swapper,
                                                       release_claims, unpatch_param_swapper)


def install() -> None:
    """Makes DeepSpeed's ``AsyncIOBuilder().load()`` return :data:`aio_op` (pyinfinity's AioHandle)
    and ``PinMemoryBuilder().load()`` :data:`pin_op`, and patches its parameter swapper.

    Works before or after ``import deepspeed`` (before: it patches when that import completes) and
    is idempotent. Raises :class:`DeepSpeedLayoutError` if deepspeed's version (one of
    ``SUPPORTED_SERIES``) or layout differs, leaving DeepSpeed untouched. Handles DeepSpeed built
    before this call are not replaced.
    """
    installer.install(SUPPORTED_SERIES)


def fix_nvme_prefetch() -> None:
    """Applies the parameter-swapper patch on its own (install() applies it too). Kept for
    scripts written before install() did; idempotent; imports deepspeed."""
    patch_param_swapper(SUPPORTED_SERIES)


def _env_requested() -> bool:
    raw = os.environ.get(ENV_VAR, "").strip().lower()
    if raw in ("", "0", "false", "no", "off"):
        return False
    if raw in ("1", "true", "yes", "on"):
        return True
    raise ValueError(f"{ENV_VAR}={raw!r}: expected 1 (use pyinfinity for DeepSpeed's NVMe I/O) or 0")


__all__ = ["install", "uninstall", "is_installed", "fix_nvme_prefetch", "size_nvme_offload", "NvmeOffloadSizing",
           "DeepSpeedAioHandle", "AioHandle", "PinHandle", "aio_op", "pin_op", "stats", "reset_stats", "IoStats",
           "DeepSpeedLayoutError", "SwapBuffersExhausted", "claim_dir", "release_claims", "patch_param_swapper",
           "unpatch_param_swapper", "binding_surface", "surface_differences", "ENV_VAR", "SUPPORTED_SERIES",
           "TESTED_VERSION", "OP_NAME", "PIN_OP_NAME", "REPLACED_OPS", "BINDING_MODULES", "BINDING_SOURCES",
           "DS_DEFAULTS", "MIN_AIO_BYTES", "AIO_ALIGNED_BYTES", "FETCH_RESERVE", "OPTIMIZER_SWAP_BUFFERS",
           "PIPELINE_SUB_GROUPS"]

if _env_requested():
    install()
