"""Which DeepSpeed this integration knows, and the checks that the installed one is laid out as
expected before anything of it is patched: its version series, its op builders (``AsyncIOBuilder``,
``PinMemoryBuilder``), the modules that bind ``AsyncIOBuilder`` and the keyword arguments they build
handles with, and the pybind surface of the two C++ classes pyinfinity stands in for. A difference
raises :class:`DeepSpeedLayoutError` naming each one."""
from __future__ import annotations

import importlib
import inspect
import re
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

from pyinfinity.aio import AioHandle
from pyinfinity.integrations.deepspeed.ops import REPLACED_OPS, aio_op, pin_op

#: Set to 1, it installs pyinfinity when ``pyinfinity.integrations.deepspeed`` is imported.
ENV_VAR = "PYINFINITY_DEEPSPEED"
#: DeepSpeed release series whose layout this integration knows (checked further at install).
SUPPORTED_SERIES: Tuple[Tuple[int, int], ...] = ((0, 19),)
#: The release the tests ran against.
TESTED_VERSION = "0.19.8"
#: Modules that bind ``AsyncIOBuilder`` at import time and build aio handles from it.
BINDING_MODULES: Tuple[str, ...] = (
    "deepspeed.runtime.swap_tensor.partitioned_param_swapper",
    "deepspeed.runtime.swap_tensor.partitioned_optimizer_swapper",
    "deepspeed.runtime.swap_tensor.pipelined_optimizer_swapper",
    "deepspeed.runtime.model_checkpointing.writer_factory",
)
#: The builder methods the installation replaces.
PATCHED_METHODS = ("load", "is_compatible")


class DeepSpeedLayoutError(RuntimeError):
    """The installed DeepSpeed is not laid out the way this integration expects."""


def parse_version(version: str) -> Optional[Tuple[int, int, int]]:
    """(major, minor, patch) of a version string, None when it does not start with three numbers."""
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
    for meth in PATCHED_METHODS:
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


def check_layout(supported: Tuple[Tuple[int, int], ...] = SUPPORTED_SERIES) -> List[type]:
    """Returns DeepSpeed's builder classes to patch (AsyncIOBuilder, PinMemoryBuilder), or raises
    DeepSpeedLayoutError naming every difference. ``supported``: the release series accepted."""
    import deepspeed

    version = getattr(deepspeed, "__version__", "<none>")
    parsed = parse_version(version)
    if parsed is None or parsed[:2] not in supported:
        series = ", ".join(f"{a}.{b}.x" for a, b in supported)
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

