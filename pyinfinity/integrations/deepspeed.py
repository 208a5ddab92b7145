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

``PinMemoryBuilder`` (DeepSpeed's ``pin_memory`` op) is replaced the same way: its ``pin_handle``
and every ``aio_handle`` share one page-locked registry, as DeepSpeed's two ops do.

``install()`` also patches DeepSpeed's parameter swapper, where ``offload_param.device: nvme``
stops training whatever the I/O backend ("Not enough buffers", "More elements ... than buffer
size", a repeated parameter in a prefetch), and makes each rank claim its own lock on
``nvme_path`` before DeepSpeed empties its swap folders there (a second job is refused).
:func:`size_nvme_offload` sizes DeepSpeed's swap knobs from the model before DeepSpeed sees the
config.
"""
from __future__ import annotations

import dataclasses
import importlib
import importlib.abc
import importlib.machinery
import inspect
import logging
import math
import os
import re
import sys
import threading
import time
import types
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Set, Tuple

import torch

from pyinfinity.aio import AioHandle, PinHandle

log = logging.getLogger(__name__)

ENV_VAR = "PYINFINITY_DEEPSPEED"
#: DeepSpeed release series whose layout this module knows (checked further at install).
SUPPORTED_SERIES: Tuple[Tuple[int, int], ...] = ((0, 19),)
#: The release the tests ran against.
TESTED_VERSION = "0.19.8"
OP_NAME = "async_io"
PIN_OP_NAME = "pin_memory"
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
    """What DeepSpeed asked pyinfinity to do, counted at submission (failures raise at wait), and
    how long DeepSpeed's threads were blocked waiting for it: every ``wait()`` of a handle,
    including those inside ``sync_pread``/``sync_pwrite``/``pread``/``pwrite``/``read``/``write``
    and the module-level ``aio_read``/``aio_write``. A wait whose operations were all reads counts
    in ``read_wait_s``, all writes in ``write_wait_s``; a wait over both only in ``wait_s``."""
    handles: int = 0
    reads: int = 0
    writes: int = 0
    bytes_read: int = 0
    bytes_written: int = 0
    files_read: Set[str] = field(default_factory=set)
    files_written: Set[str] = field(default_factory=set)
    wait_calls: int = 0
    wait_s: float = 0.0
    read_wait_s: float = 0.0
    write_wait_s: float = 0.0

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
        return dataclasses.replace(_stats, files_read=set(_stats.files_read), files_written=set(_stats.files_written))


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


def _record_wait(seconds: float, writes: Set[bool]) -> None:
    """One blocking wait of ``seconds`` over operations of the directions in ``writes``."""
    with _stats_lock:
        _stats.wait_calls += 1
        _stats.wait_s += seconds
        if writes == {False}:
            _stats.read_wait_s += seconds
        elif writes == {True}:
            _stats.write_wait_s += seconds


# -- the handle DeepSpeed gets ---------------------------------------------------------------------
class DeepSpeedAioHandle(AioHandle):
    """``AioHandle`` as DeepSpeed's swappers use it, counting every read and write and timing every
    wait (see :func:`stats`). Locked buffers are process-wide in AioHandle itself, as in DeepSpeed."""

    def __init__(self, block_size: int = 1048576, queue_depth: int = 128, single_submit: bool = False,
                 overlap_events: bool = False, intra_op_parallelism: int = 1) -> None:
        super().__init__(block_size, queue_depth, single_submit, overlap_events, intra_op_parallelism)
        with _stats_lock:
            _stats.handles += 1

    def _submit(self, buffer: torch.Tensor, target: Any, write: bool, file_offset: int, validate: bool) -> None:
        super()._submit(buffer, target, write, file_offset, validate)
        _record(write, buffer, target)

    def wait(self, timeout: Optional[float] = None) -> int:
        """AioHandle.wait, timed (every sync_* / pread / pwrite without async waits through here)."""
        with self._lock:
            writes = {p.request.is_write for p in self._pending}
        t = time.perf_counter()
        try:
            return super().wait(timeout)
        finally:
            _record_wait(time.perf_counter() - t, writes)


def _aio_read(buffer: torch.Tensor, filename: str, block_size: int, queue_depth: int, single_submit: bool,
              overlap_events: bool, validate: bool) -> int:
    """DeepSpeed's module-level ``aio_read``: one synchronous read; 0 on success (raises on failure)."""
    DeepSpeedAioHandle(block_size, queue_depth, single_submit, overlap_events).pread(buffer, filename, validate, False)
    return 0


def _aio_write(buffer: torch.Tensor, filename: str, block_size: int, queue_depth: int, single_submit: bool,
               overlap_events: bool, validate: bool) -> int:
    """DeepSpeed's module-level ``aio_write``: one synchronous write; 0 on success."""
    DeepSpeedAioHandle(block_size, queue_depth, single_submit, overlap_events).pwrite(buffer, filename, validate, False)
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

#: What ``PinMemoryBuilder().load()`` returns once installed: DeepSpeed's ``pin_memory`` op, whose
#: ``pin_handle`` shares one page-locked registry (``pyinfinity.aio.LOCKED_TENSORS``) with every
#: ``aio_handle``, as DeepSpeed's two ops share one ``deepspeed_pin_tensor_t``.
pin_op = types.ModuleType("pyinfinity_pin_memory_op", "pyinfinity's stand-in for DeepSpeed's pin_memory op")
pin_op.pin_handle = PinHandle

#: op name -> (the builder class name, what its ``load()`` returns once installed)
REPLACED_OPS: Dict[str, Tuple[str, types.ModuleType]] = {
    OP_NAME: ("AsyncIOBuilder", aio_op),
    PIN_OP_NAME: ("PinMemoryBuilder", pin_op),
}


# -- layout checks -----------------------------------------------------------------------------------
def _parse_version(version: str) -> Optional[Tuple[int, int, int]]:
    m = re.match(r"^(\d+)\.(\d+)\.(\d+)", str(version))
    return (int(m.group(1)), int(m.group(2)), int(m.group(3))) if m else None


#: DeepSpeed's pybind sources of the ops replaced, and the class each binds: (path under the
#: deepspeed package, C++ class in ``py::class_<...>``, pyinfinity's class standing in for it)
BINDING_SOURCES: Tuple[Tuple[str, str, str], ...] = (
    ("ops/csrc/aio/py_lib/py_ds_aio.cpp", "deepspeed_aio_handle_t", "aio_handle"),
    ("ops/csrc/pin_memory/py_ds_pin_memory.cpp", "deepspeed_pin_handle_t", "pin_handle"),
)


def binding_surface(source: str, cpp_class: str) -> Optional[Dict[str, List[List[str]]]]:
    """Methods a pybind ``py::class_<cpp_class>`` block binds: name -> one list of keyword
    names (``"x"_a``) per overload, in order. None when the source binds no such class."""
    start = source.find(f"py::class_<{cpp_class}>")
    if start < 0:
        return None
    depth, end = 0, len(source)
    for i in range(start, len(source)):  # the statement ends at the first ';' outside () and {} (lambdas)
        c = source[i]
        if c in "({":
            depth += 1
        elif c in ")}":
            depth -= 1
        elif c == ";" and depth == 0:
            end = i
            break
    block = source[start:end]
    methods: Dict[str, List[List[str]]] = {}
    for chunk in re.split(r"\.def\(", block)[1:]:
        m = re.match(r'\s*"(\w+)"', chunk)
        if m:
            methods.setdefault(m.group(1), []).append(re.findall(r'"(\w+)"_a', chunk))
    return methods


def surface_differences(surface: Dict[str, List[List[str]]], cls: type) -> List[str]:
    """What ``cls`` lacks of a bound surface: methods, and keyword names of each overload
    (pyinfinity may accept more; it must accept every call DeepSpeed's binding accepts)."""
    problems: List[str] = []
    for name, overloads in sorted(surface.items()):
        fn = getattr(cls, name, None)
        if not callable(fn):
            problems.append(f"{cls.__name__} lacks {name}()")
            continue
        params = inspect.signature(fn).parameters
        takes_kw = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
        for keywords in overloads:
            # `async` is a Python keyword: pyinfinity takes it through **kw (see AioHandle.pread)
            missing = [k for k in keywords if k not in params and not (k == "async" and takes_kw)]
            if missing:
                problems.append(f"{cls.__name__}.{name}{inspect.signature(fn)} does not take {missing} "
                                f"(DeepSpeed's overload takes {keywords})")
    return problems


def _check_builder(cls: Any, class_name: str, op_name: str, op_builder: Any, accel: Any) -> List[str]:
    problems: List[str] = []
    if not isinstance(cls, type):
        return [f"deepspeed.ops.op_builder.{class_name} is {type(cls).__name__}, expected a class"]
    if isinstance(op_builder, type) and not issubclass(cls, op_builder):
        problems.append(f"{cls.__module__}.{class_name} does not derive from OpBuilder")
    if getattr(cls, "NAME", None) != op_name:
        problems.append(f"{class_name}.NAME is {getattr(cls, 'NAME', None)!r}, expected {op_name!r}")
    for meth in _PATCHED_METHODS:
        fn = getattr(cls, meth, None)
        if not callable(fn):
            problems.append(f"{class_name}.{meth} is missing")
        elif "verbose" not in inspect.signature(fn).parameters:
            problems.append(f"{class_name}.{meth}{inspect.signature(fn)} takes no 'verbose'")
    try:
        acc_cls = accel.get_op_builder(class_name)
    except Exception as exc:  # noqa: BLE001
        problems.append(f"get_accelerator().get_op_builder({class_name!r}) failed: {exc!r}")
    else:
        if acc_cls is not cls:
            problems.append(f"the accelerator's {class_name} ({acc_cls!r}) is not "
                            f"deepspeed.ops.op_builder.{class_name} ({cls!r})")
    return problems


def _check_layout() -> List[type]:
    """Returns DeepSpeed's builder classes to patch (AsyncIOBuilder, PinMemoryBuilder), or raises
    DeepSpeedLayoutError naming every difference."""
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

    classes: List[type] = []
    for op_name, (class_name, _) in REPLACED_OPS.items():
        cls = getattr(op_builder_pkg, class_name, None)
        problems += _check_builder(cls, class_name, op_name, op_builder, get_accelerator())
        if isinstance(cls, type):
            classes.append(cls)
    aio_cls = getattr(op_builder_pkg, "AsyncIOBuilder", None)

    ctor = set(inspect.signature(AioHandle.__init__).parameters) - {"self"}
    for name in BINDING_MODULES:
        try:
            mod = importlib.import_module(name)
        except Exception as exc:  # noqa: BLE001
            problems.append(f"{name}: cannot import ({exc!r})")
            continue
        bound = getattr(mod, "AsyncIOBuilder", None)
        if bound is not aio_cls:
            problems.append(f"{name}.AsyncIOBuilder is {bound!r}, not deepspeed.ops.op_builder.AsyncIOBuilder")
        try:
            source = inspect.getsource(mod)
        except (OSError, TypeError):
            continue
        kwargs = set(re.findall(r"[(,]\s*(\w+)\s*=\s*(?:self\.)?aio_config\[", source))  # keyword arguments only
        unknown = sorted(kwargs - ctor)
        if unknown:
            problems.append(f"{name} builds aio handles with {unknown}, which AioHandle does not take")

    ds_root = Path(deepspeed.__file__).parent
    for rel, cpp_class, attr in BINDING_SOURCES:
        src = ds_root / rel
        if not src.is_file():
            continue  # a DeepSpeed wheel without its sources: nothing to compare
        surface = binding_surface(src.read_text(errors="replace"), cpp_class)
        if not surface:
            problems.append(f"{rel} no longer binds {cpp_class}")
            continue
        op = aio_op if attr == "aio_handle" else pin_op
        problems += [f"{rel}: {p}" for p in surface_differences(surface, getattr(op, attr))]

    if problems:
        raise DeepSpeedLayoutError(
            f"deepspeed {version} differs from the layout pyinfinity's integration was checked against "
            f"({TESTED_VERSION}):\n  - " + "\n  - ".join(problems))
    return classes


# -- patching ------------------------------------------------------------------------------------------
_MISSING = object()
_state_lock = threading.RLock()
_patched: Dict[type, Dict[str, Any]] = {}  # class -> {method: original in its __dict__ or _MISSING}
_hook: Optional["_PostImportHook"] = None


def _original(cls: type, meth: str, saved: Any) -> Callable[..., Any]:
    if saved is _MISSING:
        return lambda self, *a, **kw: getattr(super(cls, self), meth)(*a, **kw)
    return saved


def _make_load(op_name: str, op: types.ModuleType, original: Callable[..., Any]) -> Callable[..., Any]:
    def load(self: Any, verbose: bool = False) -> Any:
        if getattr(self, "name", None) != op_name:  # a subclass, e.g. GDSBuilder ("gds")
            return original(self, verbose=verbose)
        return op

    setattr(load, _MARK, True)
    load.__doc__ = f"pyinfinity: returns pyinfinity.integrations.deepspeed's {op.__name__} (no build)."
    return load


def _make_is_compatible(op_name: str, original: Callable[..., Any]) -> Callable[..., Any]:
    def is_compatible(self: Any, verbose: bool = False) -> bool:
        if getattr(self, "name", None) != op_name:
            return original(self, verbose=verbose)
        return True  # pyinfinity's core needs neither libaio nor a build

    setattr(is_compatible, _MARK, True)
    return is_compatible


def _patch() -> None:
    """Checks DeepSpeed's layout, then patches its AsyncIOBuilder and PinMemoryBuilder and its
    parameter swapper (no-op when already patched)."""
    with _state_lock:
        classes = _check_layout()
        import deepspeed

        _check_swapper_layout(deepspeed.__version__)  # before anything is patched
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
            saved = {m: cls.__dict__.get(m, _MISSING) for m in _PATCHED_METHODS}
            cls.load = _make_load(op_name, op, _original(cls, "load", saved["load"]))
            cls.is_compatible = _make_is_compatible(op_name, _original(cls, "is_compatible", saved["is_compatible"]))
            _patched[cls] = saved
            log.info("pyinfinity: deepspeed %s %s.%s().load() now returns pyinfinity's %s", deepspeed.__version__,
                     cls.__module__, cls.__name__, op.__name__)
        _patch_param_swapper()


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
        _unpatch_param_swapper()
        release_claims()


# -- DeepSpeed's parameter swapper: the buffer assertions (independent of the I/O backend) -----------
#
# With ``offload_param.device: nvme`` each parameter partition read from NVMe occupies one of
# ``offload_param.buffer_count`` pinned buffers of ``buffer_size`` elements until the parameter is
# released. DeepSpeed 0.19 stops training in three ways there:
#
# * "Not enough buffers 0 for swapping 1": ``PartitionedParameterCoordinator`` prefetches NVMe
#   partitions (``__prefetch_nvme_param_partitions``) into every buffer still free, while the
#   parameters kept live by ``stage3_max_live_parameters`` / ``stage3_max_reuse_distance`` hold the
#   others; the next fetch of a parameter that was not prefetched (the trace diverges, e.g. under
#   gradient checkpointing, or a module needs more partitions than were left) finds none free and
#   ``swap_in`` asserts. Nothing gives a prefetched-but-unused buffer back.
# * "More elements N than buffer size M": ``get_buffer`` asserts when a parameter's partition is
#   larger than ``buffer_size``.
# * "param N already assigned swap buffer id M": the prefetch walks a trace in which a parameter used
#   at the end of the forward pass and first in the backward pass (a language model's ``lm_head``)
#   appears twice, and hands both to ``swap_in``.
#
# The patch (install(); undone by uninstall()): ``swap_in`` drops repeats; a prefetch takes only the
# buffers that are free; a fetch that finds too few free buffers first waits for the reads in flight
# and gives back the buffers of prefetched partitions nobody uses yet (latest prefetched first; they
# are read again when needed: the file is unchanged until the optimizer writes it), and when the
# parameters in use hold every buffer it raises an error saying which knob to raise; a partition
# larger than ``buffer_size`` stays in CPU memory (logged once) instead of asserting.
# :func:`size_nvme_offload` sizes the knobs so that the fallbacks are rarely needed.
_SWAPPER_MODULE = "deepspeed.runtime.swap_tensor.partitioned_param_swapper"
_SWAPPER_METHODS: Dict[str, List[str]] = {  # method -> the leading parameters the patch relies on
    "swap_in": ["self", "params", "async_op", "swap_in_buffers"],
    "swappable_tensor": ["self", "param", "numel"],
}
_SWAPPER_ATTRS = ("available_buffer_ids", "param_id_to_buffer_id", "elements_per_buffer", "param_buffer_count",
                  "inflight_params", "synchronize_reads", "remove_partition_and_release_buffers")
_swapper_patch: Optional[List[Tuple[type, str, Any]]] = None  # (class, method, original or _MISSING)
_protected = threading.local()  # ds_ids of the parameters the fetch in progress needs


class SwapBuffersExhausted(RuntimeError):
    """Every parameter swap buffer is held by a parameter in use; the message says what to raise."""


def _check_swapper_layout(version: str) -> Tuple[type, type, type]:
    problems: List[str] = []
    swapper_mod = importlib.import_module(_SWAPPER_MODULE)
    from deepspeed.runtime.zero import partition_parameters as pp

    cls = getattr(swapper_mod, "AsyncPartitionedParameterSwapper", None)
    if not isinstance(cls, type):
        raise DeepSpeedLayoutError(f"deepspeed {version}: {_SWAPPER_MODULE}.AsyncPartitionedParameterSwapper is missing")
    for meth, lead in _SWAPPER_METHODS.items():
        fn = cls.__dict__.get(meth)
        params = list(inspect.signature(fn).parameters) if callable(fn) else []
        if params[:len(lead)] != lead:
            problems.append(f"AsyncPartitionedParameterSwapper.{meth}{params} does not start with {lead}")
    try:
        src = inspect.getsource(cls)
    except (OSError, TypeError):
        src = ""
    for attr in _SWAPPER_ATTRS:
        if src and f"{attr}" not in src:
            problems.append(f"AsyncPartitionedParameterSwapper no longer has {attr}")
    init = getattr(pp, "Init", None)
    fn = getattr(init, "_ensure_availability_of_partitioned_params", None)
    if not callable(fn) or list(inspect.signature(fn).parameters)[:2] != ["self", "params"]:
        problems.append("partition_parameters.Init._ensure_availability_of_partitioned_params(self, params) is missing")
    for name in ("ZeroParamStatus",):
        if not hasattr(pp, name):
            problems.append(f"partition_parameters.{name} is missing")
    if not hasattr(swapper_mod, "PartitionedParamStatus"):
        problems.append(f"{_SWAPPER_MODULE}.PartitionedParamStatus is missing")
    fn = cls.__dict__.get("_configure_aio")
    if not callable(fn) or list(inspect.signature(fn).parameters)[:2] != ["self", "ds_config"]:
        problems.append("AsyncPartitionedParameterSwapper._configure_aio(self, ds_config) is missing")
    from deepspeed.runtime.swap_tensor import optimizer_utils

    opt = getattr(optimizer_utils, "OptimizerSwapper", None)
    fn = getattr(opt, "__init__", None)
    if not isinstance(opt, type) or list(inspect.signature(fn).parameters)[:2] != ["self", "swap_config"]:
        problems.append("optimizer_utils.OptimizerSwapper.__init__(self, swap_config, ...) is missing")
    if problems:
        raise DeepSpeedLayoutError(f"deepspeed {version}: the parameter swapper differs from {TESTED_VERSION}'s, so "
                                   "pyinfinity cannot patch it:\n  - " + "\n  - ".join(problems))
    return cls, init, opt


def _give_back_prefetched(swapper: Any, needed: int, keep: Set[int]) -> int:
    """Frees up to ``needed`` swap buffers no fetch needs; returns how many were freed. First those
    of gathered parameters whose full data lives elsewhere (on the device, or in a multi-rank
    gather's own buffer: the partition is no longer read; DeepSpeed itself does this for persistent
    parameters), then those of prefetched partitions nobody uses yet (latest first: needed furthest
    ahead; read again when needed, the file being unchanged until the optimizer writes it)."""
    from deepspeed.accelerator import get_accelerator
    from deepspeed.runtime.swap_tensor.partitioned_param_swapper import PartitionedParamStatus
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

    if swapper.inflight_params:
        swapper.synchronize_reads()  # in-flight reads land first: their buffers become candidates
    known: Dict[int, Any] = swapper.__dict__.get("_pyinfinity_params", {})
    buffers = swapper.buffers.untyped_storage().data_ptr()

    def held(ds_id: int, p: Any) -> bool:
        return (ds_id in swapper.param_id_to_buffer_id and ds_id not in keep
                and p.ds_tensor.status == PartitionedParamStatus.AVAILABLE)

    gathered = [p for i, p in known.items() if held(i, p) and p.ds_status == ZeroParamStatus.AVAILABLE
                and (p.data.device.type != "cpu" or p.data.untyped_storage().data_ptr() != buffers)][:needed]
    prefetched = [p for i, p in reversed(list(known.items()))
                  if held(i, p) and p.ds_status == ZeroParamStatus.NOT_AVAILABLE][:needed - len(gathered)]
    if gathered:
        get_accelerator().synchronize()  # copies out of the pinned buffers have completed
    victims = gathered + prefetched
    if victims:
        swapper.remove_partition_and_release_buffers(victims)
        log.debug("pyinfinity: gave back the swap buffers of gathered parameters %s and prefetched %s",
                  [p.ds_id for p in gathered], [p.ds_id for p in prefetched])
    return len(victims)


# -- one job per swap folder: each rank claims its own lock before DeepSpeed touches the folder ------
_claims: Dict[Tuple[str, int], Any] = {}  # (nvme_path, rank) -> SwapOwnership


def claim_dir(nvme_path: str, rank: int) -> str:
    """The folder a rank's claim on ``nvme_path`` locks (DeepSpeed keeps its own files in
    ``zero_stage_3/*/rank<N>``, which it empties at start)."""
    return os.path.join(os.path.abspath(os.fspath(nvme_path)), f"pyinfinity-rank{rank}")


def _claim_swap_space(nvme_path: Any) -> None:
    """Locks ``nvme_path`` for this rank (pyinfinity's swap-directory lock and manifest,
    ``pyinfinity.swap.ownership``) before DeepSpeed empties or writes its swap folders there. Every
    rank of one job takes its own lock, so they never contend; a second job pointed at the same
    ``nvme_path`` finds rank 0's lock held and stops with ``SwapDirBusyError`` naming the owner,
    instead of DeepSpeed deleting the first job's swap files. Released at exit and by uninstall()."""
    if not nvme_path:
        return
    from deepspeed import comm as ds_dist

    from pyinfinity.swap.ownership import SwapOwnership

    try:
        rank = int(ds_dist.get_rank())
    except Exception:  # noqa: BLE001 - not initialised: the launcher's rank
        rank = int(os.environ.get("RANK", 0))
    key = (os.path.abspath(os.fspath(nvme_path)), rank)
    with _state_lock:
        if key in _claims and not _claims[key].released:
            return
        d = claim_dir(nvme_path, rank)
        os.makedirs(d, exist_ok=True)
        _claims[key] = SwapOwnership.acquire([d])
        log.info("pyinfinity: rank %d claimed %s", rank, d)


def release_claims() -> None:
    """Gives back every swap-folder claim of this process (also done at exit and by uninstall())."""
    with _state_lock:
        for own in _claims.values():
            own.release()
        _claims.clear()


def _patch_param_swapper() -> None:
    """Applies the parameter-swapper patch described above (idempotent; imports deepspeed)."""
    global _swapper_patch
    with _state_lock:
        if _swapper_patch is not None:
            return
        import deepspeed

        version = getattr(deepspeed, "__version__", "<none>")
        parsed = _parse_version(version)
        if parsed is None or parsed[:2] not in SUPPORTED_SERIES:
            raise DeepSpeedLayoutError(f"the parameter-swapper patch: deepspeed {version} is not a version it was "
                                       f"checked against ({TESTED_VERSION})")
        cls, init, opt = _check_swapper_layout(version)
        targets = [(cls, "swap_in"), (cls, "swappable_tensor"), (init, "_ensure_availability_of_partitioned_params"),
                   (cls, "_configure_aio"), (opt, "__init__")]
        saved = [(c, m, c.__dict__.get(m, _MISSING)) for c, m in targets]
        orig_swap_in, orig_swappable, ensure, orig_configure, orig_opt_init = (_original(c, m, o) for c, m, o in saved)

        def swap_in(self: Any, params: List[Any], async_op: bool = True, swap_in_buffers: Any = None) -> Any:
            if swap_in_buffers is None:
                seen: Set[int] = set()
                unique = [p for p in params if not (id(p) in seen or seen.add(id(p)))]
                if len(unique) != len(params):
                    log.debug("pyinfinity: swap_in: dropped %d repeated parameter(s)", len(params) - len(unique))
                params = unique
                free = len(self.available_buffer_ids)
                if async_op and len(params) > free:  # a prefetch: what does not fit is read when needed
                    params = params[:free]
                    if not params:
                        return None
                elif len(params) > free:
                    keep = {p.ds_id for p in params} | getattr(_protected, "ids", set())
                    free += _give_back_prefetched(self, len(params) - free, keep)
                    if len(params) > free:
                        held = sorted(self.param_id_to_buffer_id)
                        raise SwapBuffersExhausted(
                            f"DeepSpeed's parameter swapper has {self.param_buffer_count} buffers "
                            f"(offload_param.buffer_count) and parameters in use hold {len(held)} of them "
                            f"(ds_ids {held[:16]}{'...' if len(held) > 16 else ''}); this fetch needs "
                            f"{len(params)} (ds_ids {[p.ds_id for p in params][:16]}). Raise "
                            f"offload_param.buffer_count to at least {len(held) + len(params)}, or lower "
                            "stage3_max_live_parameters / stage3_max_reuse_distance; "
                            "pyinfinity.integrations.deepspeed.size_nvme_offload() sizes these from the model.")
                known = self.__dict__.setdefault("_pyinfinity_params", {})
                for p in params:
                    known.pop(p.ds_id, None)
                    known[p.ds_id] = p  # insertion order = swap-in order
            return orig_swap_in(self, params, async_op=async_op, swap_in_buffers=swap_in_buffers)

        def swappable_tensor(self: Any, param: Any = None, numel: Optional[int] = None) -> bool:
            ok = orig_swappable(self, param=param, numel=numel)
            n = param.ds_tensor.ds_numel if param is not None else numel
            if ok and n > self.elements_per_buffer:
                if not self.__dict__.get("_pyinfinity_warned_size"):
                    self._pyinfinity_warned_size = True
                    log.warning("pyinfinity: a parameter partition of %d elements exceeds offload_param.buffer_size "
                                "(%d): partitions larger than buffer_size stay in CPU memory instead of on NVMe. "
                                "Set buffer_size to at least the largest partition (size_nvme_offload() does).",
                                n, self.elements_per_buffer)
                return False
            return ok

        def ensure_availability(self: Any, params: Any) -> Any:
            params = list(params)
            outer = getattr(_protected, "ids", None)
            _protected.ids = {p.ds_id for p in params} | (outer or set())
            try:
                return ensure(self, params)
            finally:
                _protected.ids = outer if outer is not None else set()

        def configure_aio(self: Any, ds_config: Any) -> Any:
            _claim_swap_space(ds_config.zero_config.offload_param.nvme_path)
            return orig_configure(self, ds_config)

        def optimizer_swapper_init(self: Any, swap_config: Any, *args: Any, **kwargs: Any) -> None:
            _claim_swap_space(getattr(swap_config, "nvme_path", None))
            orig_opt_init(self, swap_config, *args, **kwargs)

        patched = {"swap_in": swap_in, "swappable_tensor": swappable_tensor,
                   "_ensure_availability_of_partitioned_params": ensure_availability,
                   "_configure_aio": configure_aio, "__init__": optimizer_swapper_init}
        for c, m, _ in saved:
            setattr(patched[m], _MARK, True)
            setattr(c, m, patched[m])
        _swapper_patch = saved
        log.info("pyinfinity: deepspeed %s parameter swapper patched (a fetch short of buffers takes back those of "
                 "gathered and prefetched partitions, repeated parameters are read once, oversized partitions stay "
                 "in CPU memory, each rank claims its nvme_path)", version)


def _unpatch_param_swapper() -> None:
    global _swapper_patch
    if _swapper_patch is not None:
        for c, m, orig in _swapper_patch:
            if orig is _MISSING:
                if m in c.__dict__:
                    delattr(c, m)
            else:
                setattr(c, m, orig)
        _swapper_patch = None


def fix_nvme_prefetch() -> None:
    """Applies the parameter-swapper patch on its own (install() applies it too). Kept for
    scripts written before install() did; idempotent; imports deepspeed."""
    _patch_param_swapper()


# -- sizing DeepSpeed's NVMe offload knobs from the model ------------------------------------------
#: DeepSpeed 0.19's defaults for the knobs sized here (``runtime/zero/offload_config.py``, ``config.py``)
DS_DEFAULTS: Dict[str, float] = {"buffer_count": 5, "buffer_size": 1e8, "max_in_cpu": 1e9,
                                 "optimizer_buffer_count": 4, "sub_group_size": 1e9, "stage3_prefetch_bucket_size": 5e7,
                                 "stage3_max_live_parameters": 1e9, "stage3_max_reuse_distance": 1e9}
MIN_AIO_BYTES = 1 << 20       # DeepSpeed swaps a partition only from this size (and from aio.block_size)
AIO_ALIGNED_BYTES = 1024      # DeepSpeed aligns each swap buffer to this times intra_op_parallelism
FETCH_RESERVE = 2             # buffers one module's fetch needs beyond what is held
#: Pinned buffers a sub-group holds in DeepSpeed's optimizer swapper with Adam: the fp32 master,
#: exp_avg and exp_avg_sq, and the gradient (``runtime/swap_tensor/pipelined_optimizer_swapper.py``,
#: ``_swap_in_optimizer_state``: ``num_tensors() + 1``).
OPTIMIZER_SWAP_BUFFERS = 4
#: Sub-groups size_nvme_offload aims for when it turns the pipelined swapper on and
#: ``sub_group_size`` is left out (DeepSpeed's 1e9 leaves a 1B model two: nothing to read ahead).
PIPELINE_SUB_GROUPS = 8


@dataclass
class NvmeOffloadSizing:
    """What :func:`size_nvme_offload` decided: the config to hand DeepSpeed, and each change as a
    line (``key: old -> new (why)``), also logged."""
    config: Dict[str, Any]
    changes: List[str]
    swappable_partitions: int      # partitions DeepSpeed will put on NVMe (per rank)
    largest_partition_numel: int
    smallest_swappable_numel: int


def _knob(section: Dict[str, Any], key: str) -> Optional[float]:
    """A knob's number, or None when absent or "auto"."""
    v = section.get(key)
    if v is None or (isinstance(v, str) and v.strip().lower() == "auto"):
        return None
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise ValueError(f"{key}: expected a number or \"auto\", got {v!r}")
    return float(v)


def size_nvme_offload(config: Dict[str, Any], model: Any, *, dtype: Any = None, world_size: Optional[int] = None,
                      pinned_budget_bytes: Optional[int] = None,
                      cpu_budget_bytes: Optional[int] = None) -> NvmeOffloadSizing:
    """Sizes DeepSpeed's parameter-swap and optimizer-swap knobs from the model, before ``deepspeed.zero.Init`` /
    ``deepspeed.initialize`` / the Hugging Face Trainer sees ``config`` (they build the swap buffers
    from it). Returns a new config (the input is not changed) and what was changed.

    model: anything ``pyinfinity.plan.model_sizes`` takes (an ``nn.Module``, meta-device or not; a
    transformers config or its dict/path). dtype: the compute dtype (default: the config's bf16/fp16
    section, else bf16). world_size: ranks sharing each parameter (default: ``WORLD_SIZE`` or 1).
    pinned_budget_bytes: pinned RAM the parameter swap buffers may take (default: DeepSpeed's
    buffer_count when given, else 5 buffers). cpu_budget_bytes: RAM for parameters kept in CPU
    memory (sets ``max_in_cpu`` when that is absent or "auto").

    With parameters on NVMe DeepSpeed holds one buffer per partition read and not yet released, and
    it releases a parameter only when it is not used again within ``stage3_max_reuse_distance``
    elements (default 1e9: every parameter of a smaller model stays), so ``buffer_count`` runs out
    ("Not enough buffers 0 for swapping 1"). This sets ``buffer_size`` to at least the largest
    partition ("More elements ... than buffer size"), resolves absent/"auto" integer knobs (which
    DeepSpeed's schema rejects), and lowers the reuse distance, live-parameter and prefetch limits
    to what the buffers hold: (buffer_count - 2) x the smallest swapped partition.

    With ``offload_optimizer.device: nvme`` (parameters on nvme or not) it turns DeepSpeed's
    pipelined optimizer swapper on when ``pipeline_read``/``pipeline_write`` are left out, with the
    buffers and sub-group size it needs (see :func:`_size_optimizer_swap`).
    """
    import copy

    from pyinfinity.plan import model_sizes  # noqa: WPS433 - plan imports torch models lazily

    cfg = copy.deepcopy(config)
    changes: List[str] = []
    zero = cfg.setdefault("zero_optimization", {})
    param = zero.get("offload_param") or {}
    opt = zero.get("offload_optimizer") or {}
    if param.get("device") != "nvme" and opt.get("device") != "nvme":
        return NvmeOffloadSizing(cfg, [], 0, 0, 0)

    def change(where: str, key: str, old: Any, new: Any, why: str) -> None:
        line = f"{where}{key}: {old!r} -> {new!r} ({why})"
        changes.append(line)
        log.info("pyinfinity size_nvme_offload: %s", line)

    if dtype is None:
        dtype = "fp16" if (cfg.get("fp16") or {}).get("enabled") is True else "bf16"
    if hasattr(model, "to_dict") and not isinstance(model, torch.nn.Module):
        model = model.to_dict()  # a transformers PretrainedConfig
    sizes = model_sizes(model, dtype)
    world = int(world_size or os.environ.get("WORLD_SIZE", 1) or 1)
    if world < 1:
        raise ValueError(f"world_size: must be >= 1, got {world}")
    if opt.get("device") == "nvme":
        _size_optimizer_swap(zero, opt, sum(math.ceil(n / world) for n in sizes.shard_numels), change)
    if param.get("device") != "nvme":
        return NvmeOffloadSizing(cfg, changes, 0, 0, 0)
    itemsize = sizes.itemsize
    aio = cfg.get("aio") or {}
    block = int(_knob(aio, "block_size") or 1048576)
    threads = int(_knob(aio, "intra_op_parallelism") or 1)
    align = AIO_ALIGNED_BYTES * threads // itemsize
    min_swap_numel = math.ceil(max(MIN_AIO_BYTES, block) / itemsize)
    parts = [math.ceil(n / world) for n in sizes.shard_numels]
    swappable = [n for n in parts if n >= min_swap_numel]
    if not swappable:
        log.info("pyinfinity size_nvme_offload: no partition reaches %d elements: DeepSpeed keeps every "
                 "parameter in CPU memory; nothing to size", min_swap_numel)
        return NvmeOffloadSizing(cfg, [], 0, max(parts, default=0), 0)
    largest, smallest = max(swappable), min(swappable)
    zero["offload_param"] = param

    # buffer_size: the largest partition, aligned as DeepSpeed aligns it
    need_size = math.ceil(largest / align) * align
    size = _knob(param, "buffer_size")
    if size is None or size < largest:
        why = "absent/auto" if size is None else "below the largest partition, DeepSpeed asserts"
        change("offload_param.", "buffer_size", param.get("buffer_size"), need_size, why)
        param["buffer_size"] = size = need_size
    buffer_bytes = int(size) * itemsize

    # buffer_count: given, or from the pinned budget, never more than the partitions (+ a fetch's)
    most = len(swappable) + FETCH_RESERVE
    count = _knob(param, "buffer_count")
    if count is None:
        new = int(pinned_budget_bytes // buffer_bytes) if pinned_budget_bytes else int(DS_DEFAULTS["buffer_count"])
        new = max(FETCH_RESERVE + 1, min(new, most))
        change("offload_param.", "buffer_count", param.get("buffer_count"), new,
               "absent/auto: " + (f"{pinned_budget_bytes} pinned bytes / {buffer_bytes} per buffer"
                                  if pinned_budget_bytes else "DeepSpeed's default, within the partitions"))
        param["buffer_count"] = count = new
    elif count < FETCH_RESERVE + 1:
        change("offload_param.", "buffer_count", param.get("buffer_count"), FETCH_RESERVE + 1,
               "a fetch needs buffers beyond those held")
        param["buffer_count"] = count = FETCH_RESERVE + 1
    count = int(count)

    # what the buffers hold: every swapped partition when there are enough, else (count - 2) of the smallest
    if count >= most:
        hold = None
    else:
        hold = (count - FETCH_RESERVE) * smallest * world  # the coordinator counts full parameters
    for key in ("stage3_max_reuse_distance", "stage3_max_live_parameters", "stage3_prefetch_bucket_size"):
        given = _knob(zero, key)
        value = given if given is not None else DS_DEFAULTS[key]
        new = value if hold is None else min(value, hold)
        if given is None or new != given:
            why = "absent/auto" if given is None else ""
            if hold is not None and new < value:
                why = (why + "; " if why else "") + (f"{count} buffers hold {count - FETCH_RESERVE} partitions of "
                                                     f">= {smallest} elements beside a fetch")
            change("zero_optimization.", key, zero.get(key), int(new), why)
            zero[key] = int(new)

    if _knob(param, "max_in_cpu") is None:
        new = int(cpu_budget_bytes // itemsize) if cpu_budget_bytes else int(DS_DEFAULTS["max_in_cpu"])
        change("offload_param.", "max_in_cpu", param.get("max_in_cpu"), new,
               "absent/auto: " + (f"{cpu_budget_bytes} CPU bytes" if cpu_budget_bytes else "DeepSpeed's default"))
        param["max_in_cpu"] = new
    for key in ("buffer_count", "buffer_size"):
        param[key] = int(param[key])
    return NvmeOffloadSizing(cfg, changes, len(swappable), largest, smallest)


def _size_optimizer_swap(zero: Dict[str, Any], opt: Dict[str, Any], rank_numel: int,
                         change: Callable[[str, str, Any, Any, str], None]) -> None:
    """The optimizer-swap knobs of :func:`size_nvme_offload` (``offload_optimizer.device: nvme``).

    Without ``pipeline_read``/``pipeline_write`` DeepSpeed steps each sub-group in series: read its
    states and gradient, wait, step, write, wait. Left out, both are turned on (the pipelined
    swapper reads sub-group i+1 and writes i-1 while i steps) when the buffers allow it: it holds
    OPTIMIZER_SWAP_BUFFERS pinned buffers per sub-group in flight (3 with both on, 2 with one) and
    asserts with fewer. Each buffer holds the largest sub-group, so with ``sub_group_size`` left
    out it is lowered to give at least PIPELINE_SUB_GROUPS sub-groups (DeepSpeed's 1e9 gives a
    model of 1B parameters two, and 12 buffers of 4 GB), and further where needed so that the
    buffers pin no more than DeepSpeed's plain swapper does (4 x min(1e9, the rank's parameters)
    fp32 elements)."""
    count = _knob(opt, "buffer_count")
    given = [k for k in ("pipeline_read", "pipeline_write") if k in opt]
    if not given:
        need = OPTIMIZER_SWAP_BUFFERS * 3
        if count is not None and count < need:
            log.info("pyinfinity size_nvme_offload: offload_optimizer.buffer_count %s is below the %d the "
                     "pipelined swapper needs: pipeline_read/pipeline_write left off", opt.get("buffer_count"), need)
        else:
            for key in ("pipeline_read", "pipeline_write"):
                change("offload_optimizer.", key, None, True,
                       "absent: overlap the next sub-group's read and the previous one's write with the step")
                opt[key] = True
    pipelined = bool(opt.get("pipeline_read")) + bool(opt.get("pipeline_write"))
    need = OPTIMIZER_SWAP_BUFFERS * (1 + pipelined) if pipelined else int(DS_DEFAULTS["optimizer_buffer_count"])
    if count is None or count < need:
        why = ("absent/auto: " if count is None else "below what DeepSpeed asserts on: ") + (
            f"{OPTIMIZER_SWAP_BUFFERS} per sub-group x {1 + pipelined} in flight" if pipelined
            else "DeepSpeed's default")
        change("offload_optimizer.", "buffer_count", opt.get("buffer_count"), need, why)
        opt["buffer_count"] = need
    if pipelined and _knob(zero, "sub_group_size") is None:
        # the pinned buffers (count x sub_group_size fp32) stay within what DeepSpeed's default,
        # plain swapper pins (4 buffers of min(1e9, the rank's parameters)): more, smaller
        # sub-groups for a large model rather than three times the pinned RAM
        plain = int(DS_DEFAULTS["optimizer_buffer_count"]) * min(int(DS_DEFAULTS["sub_group_size"]), rank_numel)
        cap = max(1, plain // max(need, int(opt["buffer_count"])))
        new = int(max(MIN_AIO_BYTES // 4,  # never below what DeepSpeed swaps (fp32: 1 MiB)
                      min(DS_DEFAULTS["sub_group_size"], math.ceil(rank_numel / PIPELINE_SUB_GROUPS), cap)))
        change("zero_optimization.", "sub_group_size", zero.get("sub_group_size"), new,
               f"absent/auto: {rank_numel} elements per rank in at least {PIPELINE_SUB_GROUPS} sub-groups, so "
               "that the pipelined swapper has a next one to read and each pinned buffer holds one; its "
               f"{int(opt['buffer_count'])} buffers pin {int(opt['buffer_count']) * new * 4} bytes, no more than "
               "DeepSpeed's plain swapper would")
        zero["sub_group_size"] = new


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
