"""pyinfinity as DeepSpeed's NVMe I/O backend (ZeRO-Infinity swapping and the fast checkpoint writer).

After :func:`install` (or with ``PYINFINITY_DEEPSPEED=1`` when this module is imported), every
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
(seeding it would not do: the builder's ``load`` first JIT-builds the ``pin_memory`` op). If ``deepspeed`` is not imported yet,
``install()`` does not import it; a post-import hook patches the moment ``import deepspeed``
completes. A DeepSpeed whose version or layout differs from what this was checked against makes
``install()`` (or that import) raise :class:`DeepSpeedLayoutError`, naming each difference.

:func:`fix_nvme_prefetch` (opt-in) works around a DeepSpeed 0.19.8 bug on the nvme-parameter
prefetch path that stops training whatever the I/O backend.
"""
from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import inspect
import logging
import os
import re
import sys
import threading
import types
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Set, Tuple

import torch

from pyinfinity.aio import AioHandle

log = logging.getLogger(__name__)

ENV_VAR = "PYINFINITY_DEEPSPEED"
#: DeepSpeed release series whose layout this module knows (checked further at install).
SUPPORTED_SERIES: Tuple[Tuple[int, int], ...] = ((0, 19),)
#: The release the tests ran against.
TESTED_VERSION = "0.19.8"
OP_NAME = "async_io"
#: Modules that bind ``AsyncIOBuilder`` at import time and build aio handles from it.
BINDING_MODULES: Tuple[str, ...] = (
    "deepspeed.runtime.swap_tensor.partitioned_param_swapper",
    "deepspeed.runtime.swap_tensor.partitioned_optimizer_swapper",
    "deepspeed.runtime.swap_tensor.pipelined_optimizer_swapper",
    "deepspeed.runtime.model_checkpointing.writer_factory",
)
_PATCHED_METHODS = ("load", "is_compatible")
_MARK = "__pyinfinity_patch__"


class DeepSpeedLayoutError(RuntimeError):
    """The installed DeepSpeed is not laid out the way this integration expects."""


# -- I/O counters --------------------------------------------------------------------------------
@dataclass
class IoStats:
    """What DeepSpeed asked pyinfinity to do, counted at submission (failures raise at wait)."""
    handles: int = 0
    reads: int = 0
    writes: int = 0
    bytes_read: int = 0
    bytes_written: int = 0
    files_read: Set[str] = field(default_factory=set)
    files_written: Set[str] = field(default_factory=set)

    def as_dict(self) -> Dict[str, Any]:
        d = dict(self.__dict__)
        d["files_read"] = sorted(self.files_read)
        d["files_written"] = sorted(self.files_written)
        return d


_stats = IoStats()
_stats_lock = threading.Lock()


def stats() -> IoStats:
    """A snapshot of the counters since the last :func:`reset_stats`."""
    with _stats_lock:
        return IoStats(_stats.handles, _stats.reads, _stats.writes, _stats.bytes_read, _stats.bytes_written,
                       set(_stats.files_read), set(_stats.files_written))


def reset_stats() -> None:
    global _stats
    with _stats_lock:
        _stats = IoStats()


def _target_path(target: Any) -> str:
    if isinstance(target, int) and not isinstance(target, bool):
        try:
            return os.readlink(f"/proc/self/fd/{target}")
        except OSError:
            return f"<fd {target}>"
    return os.path.abspath(os.fspath(target))


def _record(write: bool, buffer: torch.Tensor, target: Any) -> None:
    path, n = _target_path(target), buffer.numel() * buffer.element_size()
    with _stats_lock:
        if write:
            _stats.writes += 1
            _stats.bytes_written += n
            _stats.files_written.add(path)
        else:
            _stats.reads += 1
            _stats.bytes_read += n
            _stats.files_read.add(path)


# -- the handle DeepSpeed gets ---------------------------------------------------------------------
class DeepSpeedAioHandle(AioHandle):
    """``AioHandle`` as DeepSpeed's swappers use it, counting every read and write (see
    :func:`stats`). Locked buffers are process-wide in AioHandle itself, as in DeepSpeed."""

    def __init__(self, block_size: int = 1048576, queue_depth: int = 128, single_submit: bool = False,
                 overlap_events: bool = False, intra_op_parallelism: int = 1) -> None:
        super().__init__(block_size, queue_depth, single_submit, overlap_events, intra_op_parallelism)
        with _stats_lock:
            _stats.handles += 1

    def async_pread(self, buffer: torch.Tensor, filename: Any, file_offset: int = 0) -> int:
        r = super().async_pread(buffer, filename, file_offset)
        _record(False, buffer, filename)
        return r

    def async_pwrite(self, buffer: torch.Tensor, filename: Any, file_offset: int = 0) -> int:
        r = super().async_pwrite(buffer, filename, file_offset)
        _record(True, buffer, filename)
        return r

    def sync_pread(self, buffer: torch.Tensor, filename: Any, file_offset: int = 0) -> int:
        r = super().sync_pread(buffer, filename, file_offset)
        _record(False, buffer, filename)
        return r

    def sync_pwrite(self, buffer: torch.Tensor, filename: Any, file_offset: int = 0) -> int:
        r = super().sync_pwrite(buffer, filename, file_offset)
        _record(True, buffer, filename)
        return r

    def pread(self, buffer: torch.Tensor, filename: Any, validate: bool, async_op: bool = False,
              file_offset: int = 0, **kw: Any) -> int:
        r = super().pread(buffer, filename, validate, async_op, file_offset, **kw)
        _record(False, buffer, filename)
        return r

    def pwrite(self, buffer: torch.Tensor, filename: Any, validate: bool, async_op: bool = False,
               file_offset: int = 0, **kw: Any) -> int:
        r = super().pwrite(buffer, filename, validate, async_op, file_offset, **kw)
        _record(True, buffer, filename)
        return r

    def read(self, buffer: torch.Tensor, filename: Any, validate: bool, file_offset: int = 0) -> int:
        r = super().read(buffer, filename, validate, file_offset)
        _record(False, buffer, filename)
        return r

    def write(self, buffer: torch.Tensor, filename: Any, validate: bool, file_offset: int = 0) -> int:
        r = super().write(buffer, filename, validate, file_offset)
        _record(True, buffer, filename)
        return r


def _aio_read(buffer: torch.Tensor, filename: str, block_size: int, queue_depth: int, single_submit: bool,
              overlap_events: bool, validate: bool) -> int:
    """DeepSpeed's module-level ``aio_read``: one synchronous read; 0 on success (raises on failure)."""
    DeepSpeedAioHandle(block_size, queue_depth, single_submit, overlap_events).pread(buffer, filename, validate)
    return 0


def _aio_write(buffer: torch.Tensor, filename: str, block_size: int, queue_depth: int, single_submit: bool,
               overlap_events: bool, validate: bool) -> int:
    """DeepSpeed's module-level ``aio_write``: one synchronous write; 0 on success."""
    DeepSpeedAioHandle(block_size, queue_depth, single_submit, overlap_events).pwrite(buffer, filename, validate)
    return 0


def _memcpy(dest: torch.Tensor, src: torch.Tensor) -> int:
    """DeepSpeed's ``deepspeed_memcpy``."""
    dest.copy_(src)
    return 0


#: What ``AsyncIOBuilder().load()`` returns once installed (same attributes as DeepSpeed's op).
aio_op = types.ModuleType("pyinfinity_async_io_op", "pyinfinity's stand-in for DeepSpeed's async_io op")
aio_op.aio_handle = DeepSpeedAioHandle
aio_op.aio_read = _aio_read
aio_op.aio_write = _aio_write
aio_op.deepspeed_memcpy = _memcpy


# -- layout checks -----------------------------------------------------------------------------------
def _parse_version(version: str) -> Optional[Tuple[int, int, int]]:
    m = re.match(r"^(\d+)\.(\d+)\.(\d+)", str(version))
    return (int(m.group(1)), int(m.group(2)), int(m.group(3))) if m else None


def _handle_api_in_source(ds_root: Path) -> Optional[Set[str]]:
    """Method names DeepSpeed's C++ aio_handle binds (None when its sources are not shipped)."""
    src = ds_root / "ops" / "csrc" / "aio" / "py_lib" / "py_ds_aio.cpp"
    if not src.is_file():
        return None
    text = src.read_text(errors="replace")
    start = text.find('py::class_<deepspeed_aio_handle_t>')
    if start < 0:
        return set()
    block = text[start:]
    block = block[: block.find(";")]
    return set(re.findall(r'\.def\(\s*"(\w+)"', block))


def _check_layout() -> type:
    """Returns DeepSpeed's AsyncIOBuilder class, or raises DeepSpeedLayoutError naming every difference."""
    import deepspeed

    version = getattr(deepspeed, "__version__", "<none>")
    parsed = _parse_version(version)
    if parsed is None or parsed[:2] not in SUPPORTED_SERIES:
        series = ", ".join(f"{a}.{b}.x" for a, b in SUPPORTED_SERIES)
        raise DeepSpeedLayoutError(
            f"deepspeed {version} is not supported by pyinfinity's DeepSpeed integration "
            f"(it knows {series}; tested with {TESTED_VERSION}). Install deepspeed=={TESTED_VERSION} "
            f"or leave {ENV_VAR} unset / do not call install().")

    problems: List[str] = []
    try:
        from deepspeed.ops.op_builder import builder as builder_mod
        import deepspeed.ops.op_builder as op_builder_pkg
        from deepspeed.accelerator import get_accelerator
    except Exception as exc:  # noqa: BLE001 - reported with the layout problems
        raise DeepSpeedLayoutError(f"deepspeed {version}: cannot import its op builders: {exc!r}") from exc

    op_builder = getattr(builder_mod, "OpBuilder", None)
    if not isinstance(op_builder, type):
        problems.append("deepspeed.ops.op_builder.builder.OpBuilder is missing")
    elif not isinstance(op_builder.__dict__.get("_loaded_ops"), dict):
        problems.append("OpBuilder._loaded_ops (the op cache) is missing or not a dict")

    cls = getattr(op_builder_pkg, "AsyncIOBuilder", None)
    if not isinstance(cls, type):
        problems.append(f"deepspeed.ops.op_builder.AsyncIOBuilder is {type(cls).__name__}, expected a class")
    else:
        if isinstance(op_builder, type) and not issubclass(cls, op_builder):
            problems.append(f"{cls.__module__}.AsyncIOBuilder does not derive from OpBuilder")
        if getattr(cls, "NAME", None) != OP_NAME:
            problems.append(f"AsyncIOBuilder.NAME is {getattr(cls, 'NAME', None)!r}, expected {OP_NAME!r}")
        for meth in _PATCHED_METHODS:
            fn = getattr(cls, meth, None)
            if not callable(fn):
                problems.append(f"AsyncIOBuilder.{meth} is missing")
            elif "verbose" not in inspect.signature(fn).parameters:
                problems.append(f"AsyncIOBuilder.{meth}{inspect.signature(fn)} takes no 'verbose'")
        try:
            acc_cls = get_accelerator().get_op_builder("AsyncIOBuilder")
        except Exception as exc:  # noqa: BLE001
            problems.append(f"get_accelerator().get_op_builder('AsyncIOBuilder') failed: {exc!r}")
        else:
            if acc_cls is not cls:
                problems.append(f"the accelerator's AsyncIOBuilder ({acc_cls!r}) is not "
                                f"deepspeed.ops.op_builder.AsyncIOBuilder ({cls!r})")

    ctor = set(inspect.signature(AioHandle.__init__).parameters) - {"self"}
    for name in BINDING_MODULES:
        try:
            mod = importlib.import_module(name)
        except Exception as exc:  # noqa: BLE001
            problems.append(f"{name}: cannot import ({exc!r})")
            continue
        bound = getattr(mod, "AsyncIOBuilder", None)
        if bound is not cls:
            problems.append(f"{name}.AsyncIOBuilder is {bound!r}, not deepspeed.ops.op_builder.AsyncIOBuilder")
        try:
            source = inspect.getsource(mod)
        except (OSError, TypeError):
            continue
        kwargs = set(re.findall(r"[(,]\s*(\w+)\s*=\s*(?:self\.)?aio_config\[", source))  # keyword arguments only
        unknown = sorted(kwargs - ctor)
        if unknown:
            problems.append(f"{name} builds aio handles with {unknown}, which AioHandle does not take")

    api = _handle_api_in_source(Path(deepspeed.__file__).parent)
    if api is not None:
        missing = sorted(m for m in api if not hasattr(DeepSpeedAioHandle, m))
        if not api:
            problems.append("ops/csrc/aio/py_lib/py_ds_aio.cpp no longer binds deepspeed_aio_handle_t")
        elif missing:
            problems.append(f"DeepSpeed's aio_handle has methods AioHandle lacks: {missing}")

    if problems:
        raise DeepSpeedLayoutError(
            f"deepspeed {version} differs from the layout pyinfinity's integration was checked against "
            f"({TESTED_VERSION}):\n  - " + "\n  - ".join(problems))
    return cls


# -- patching ------------------------------------------------------------------------------------------
_MISSING = object()
_state_lock = threading.RLock()
_patched: Dict[type, Dict[str, Any]] = {}  # class -> {method: original in its __dict__ or _MISSING}
_hook: Optional["_PostImportHook"] = None


def _original(cls: type, meth: str, saved: Any) -> Callable[..., Any]:
    if saved is _MISSING:
        return lambda self, *a, **kw: getattr(super(cls, self), meth)(*a, **kw)
    return saved


def _make_load(cls: type, original: Callable[..., Any]) -> Callable[..., Any]:
    def load(self: Any, verbose: bool = False) -> Any:
        if getattr(self, "name", None) != OP_NAME:  # a subclass, e.g. GDSBuilder ("gds")
            return original(self, verbose=verbose)
        return aio_op

    setattr(load, _MARK, True)
    load.__doc__ = "pyinfinity: returns pyinfinity.integrations.deepspeed.aio_op (AioHandle)."
    return load


def _make_is_compatible(cls: type, original: Callable[..., Any]) -> Callable[..., Any]:
    def is_compatible(self: Any, verbose: bool = False) -> bool:
        if getattr(self, "name", None) != OP_NAME:
            return original(self, verbose=verbose)
        return True  # pyinfinity's core needs neither libaio nor a build

    setattr(is_compatible, _MARK, True)
    return is_compatible


def _patch() -> None:
    """Checks DeepSpeed's layout, then patches its AsyncIOBuilder (no-op when already patched)."""
    with _state_lock:
        cls = _check_layout()
        if cls in _patched:
            return
        from deepspeed.ops.op_builder.builder import OpBuilder

        if OP_NAME in OpBuilder._loaded_ops:
            log.warning("DeepSpeed's own %s op was loaded before pyinfinity's install(); handles made "
                        "from it before now stay DeepSpeed's", OP_NAME)
        saved = {m: cls.__dict__.get(m, _MISSING) for m in _PATCHED_METHODS}
        cls.load = _make_load(cls, _original(cls, "load", saved["load"]))
        cls.is_compatible = _make_is_compatible(cls, _original(cls, "is_compatible", saved["is_compatible"]))
        _patched[cls] = saved
        import deepspeed

        log.info("pyinfinity: deepspeed %s %s.AsyncIOBuilder().load() now returns pyinfinity's AioHandle",
                 deepspeed.__version__, cls.__module__)


def _unpatch() -> None:
    with _state_lock:
        for cls, saved in list(_patched.items()):
            for meth, orig in saved.items():
                if orig is _MISSING:
                    if meth in cls.__dict__:
                        delattr(cls, meth)
                else:
                    setattr(cls, meth, orig)
            del _patched[cls]
            log.info("pyinfinity: restored DeepSpeed's own %s.AsyncIOBuilder", cls.__module__)


class _PatchingLoader(importlib.abc.Loader):
    """Runs deepspeed's own loader, then patches; puts the original loader back on the module."""

    def __init__(self, loader: importlib.abc.Loader) -> None:
        self._loader = loader

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> Optional[types.ModuleType]:
        return self._loader.create_module(spec)

    def exec_module(self, module: types.ModuleType) -> None:
        module.__loader__ = self._loader
        if module.__spec__ is not None:
            module.__spec__.loader = self._loader
        self._loader.exec_module(module)
        with _state_lock:
            if _hook is not None:  # still wanted
                _remove_hook()
                _patch()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._loader, name)


class _PostImportHook(importlib.abc.MetaPathFinder):
    """Finds nothing itself: wraps the loader of top-level ``deepspeed`` so that _patch() runs
    right after ``import deepspeed`` completes."""

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Optional[importlib.machinery.ModuleSpec]:
        if fullname != "deepspeed":
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                break
        else:
            return None
        if spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        spec.loader = _PatchingLoader(spec.loader)
        return spec


def _add_hook() -> None:
    global _hook
    if _hook is None:
        _hook = _PostImportHook()
        sys.meta_path.insert(0, _hook)


def _remove_hook() -> None:
    global _hook
    if _hook is not None:
        try:
            sys.meta_path.remove(_hook)
        except ValueError:
            pass
        _hook = None


# -- public API --------------------------------------------------------------------------------------
def install() -> None:
    """Makes DeepSpeed's ``AsyncIOBuilder().load()`` return :data:`aio_op` (pyinfinity's AioHandle).

    Works before or after ``import deepspeed`` (before: it patches when that import completes) and
    is idempotent. Raises :class:`DeepSpeedLayoutError` if deepspeed's version or layout differs,
    leaving DeepSpeed untouched. Handles DeepSpeed built before this call are not replaced.
    """
    with _state_lock:
        ds = sys.modules.get("deepspeed")
        if ds is None:
            _add_hook()
            log.debug("pyinfinity: deepspeed not imported yet; will patch when it is")
            return
        if getattr(getattr(ds, "__spec__", None), "_initializing", False):
            raise RuntimeError("pyinfinity.integrations.deepspeed.install() called while deepspeed is being "
                               "imported; call it before or after `import deepspeed`")
        _patch()


def uninstall() -> None:
    """Restores DeepSpeed's own AsyncIOBuilder (and drops a pending post-import hook), and undoes
    :func:`fix_nvme_prefetch`. Idempotent. Handles created while installed stay pyinfinity's."""
    with _state_lock:
        _remove_hook()
        _unpatch()
        _unfix_nvme_prefetch()


# -- a DeepSpeed bug on the parameter-swapping path (independent of the I/O backend) ------------------
_prefetch_fix: Optional[Tuple[type, Any]] = None  # (AsyncPartitionedParameterSwapper, its own swap_in)


def fix_nvme_prefetch() -> None:
    """Works around a DeepSpeed 0.19 bug with ``offload_param.device: nvme`` and prefetch on.

    ``PartitionedParameterCoordinator.__prefetch_nvme_param_partitions`` walks the trace queue, in
    which a parameter used at the end of the forward pass and again first in the backward pass
    (e.g. a language model's ``lm_head``) appears twice, and hands both to
    ``AsyncPartitionedParameterSwapper.swap_in``, which then stops with "param N already assigned
    swap buffer id M". This makes ``swap_in`` drop repeats (one read serves both). Opt-in,
    idempotent, undone by :func:`uninstall`; imports deepspeed.
    """
    global _prefetch_fix
    with _state_lock:
        if _prefetch_fix is not None:
            return
        import deepspeed

        version = getattr(deepspeed, "__version__", "<none>")
        parsed = _parse_version(version)
        if parsed is None or parsed[:2] not in SUPPORTED_SERIES:
            raise DeepSpeedLayoutError(f"fix_nvme_prefetch: deepspeed {version} is not a version it was checked "
                                       f"against ({TESTED_VERSION})")
        from deepspeed.runtime.swap_tensor.partitioned_param_swapper import AsyncPartitionedParameterSwapper as S

        original = S.__dict__.get("swap_in")
        params = list(inspect.signature(original).parameters) if callable(original) else []
        if params[:4] != ["self", "params", "async_op", "swap_in_buffers"]:
            raise DeepSpeedLayoutError(f"fix_nvme_prefetch: deepspeed {version}: "
                                       f"AsyncPartitionedParameterSwapper.swap_in{params} is not (self, params, "
                                       f"async_op, swap_in_buffers)")

        def swap_in(self: Any, params: List[Any], async_op: bool = True, swap_in_buffers: Any = None) -> Any:
            if swap_in_buffers is None:
                seen: Set[int] = set()
                unique = [p for p in params if not (id(p) in seen or seen.add(id(p)))]
                if len(unique) != len(params):
                    log.debug("fix_nvme_prefetch: dropped %d repeated parameter(s) from swap_in",
                              len(params) - len(unique))
                params = unique
            return original(self, params, async_op=async_op, swap_in_buffers=swap_in_buffers)

        setattr(swap_in, _MARK, True)
        S.swap_in = swap_in
        _prefetch_fix = (S, original)
        log.info("pyinfinity: deepspeed %s AsyncPartitionedParameterSwapper.swap_in now drops repeated parameters",
                 version)


def _unfix_nvme_prefetch() -> None:
    global _prefetch_fix
    if _prefetch_fix is not None:
        cls, original = _prefetch_fix
        cls.swap_in = original
        _prefetch_fix = None


def is_installed() -> bool:
    """True when DeepSpeed is patched, or will be when it is imported."""
    with _state_lock:
        return bool(_patched) or _hook is not None


def _env_requested() -> bool:
    raw = os.environ.get(ENV_VAR, "").strip().lower()
    if raw in ("", "0", "false", "no", "off"):
        return False
    if raw in ("1", "true", "yes", "on"):
        return True
    raise ValueError(f"{ENV_VAR}={raw!r}: expected 1 (use pyinfinity for DeepSpeed's NVMe I/O) or 0")


if _env_requested():
    install()
