"""Running a function the moment a module's import completes, without importing it: the cheap half
of the integrations that ``import pyinfinity`` sets up (nothing here imports torch or a framework).

``when_imported("deepspeed", "pyinfinity.integrations.deepspeed.engine_route:install_route")`` calls
that function now if ``deepspeed`` is imported already, else right after ``import deepspeed``
completes (a finder on ``sys.meta_path`` wraps the module's loader once, then steps aside). The
callback is named by a string so that its module is imported only then."""
from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import logging
import sys
import threading
import types
from typing import Any, Dict, List, Optional

log = logging.getLogger(__name__)

_lock = threading.RLock()
_pending: Dict[str, List[str]] = {}  # module name -> callbacks ("module:function") waiting for its import
_finder: Optional["_Finder"] = None


def _call(target: str, module: types.ModuleType) -> None:
    mod_name, _, fn_name = target.partition(":")
    getattr(importlib.import_module(mod_name), fn_name)(module)


class _Loader(importlib.abc.Loader):
    """The module's own loader, then the callbacks waiting for it; the original loader goes back on the module."""

    def __init__(self, loader: importlib.abc.Loader, name: str) -> None:
        self._loader = loader
        self._name = name

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> Optional[types.ModuleType]:
        return self._loader.create_module(spec)

    def exec_module(self, module: types.ModuleType) -> None:
        module.__loader__ = self._loader
        if module.__spec__ is not None:
            module.__spec__.loader = self._loader
        self._loader.exec_module(module)
        with _lock:
            targets = _pending.pop(self._name, [])
        for target in targets:
            _call(target, module)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._loader, name)


class _Finder(importlib.abc.MetaPathFinder):
    """Finds nothing itself: wraps the loader of each module some callback waits for."""

    def __init__(self) -> None:
        self._searching = threading.local()  # names this thread is looking up (another finder that asks
        # every finder, as this one does, would otherwise call back into it without end)

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Optional[importlib.machinery.ModuleSpec]:
        with _lock:
            if fullname not in _pending:
                return None
        searching = self._searching.__dict__.setdefault("names", set())
        if fullname in searching:
            return None
        searching.add(fullname)
        try:
            for finder in sys.meta_path:
                if finder is self or not hasattr(finder, "find_spec"):
                    continue
                spec = finder.find_spec(fullname, path, target)
                if spec is not None:
                    break
            else:
                return None
        finally:
            searching.discard(fullname)
        if spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        spec.loader = _Loader(spec.loader, fullname)
        return spec


def when_imported(name: str, target: str) -> None:
    """Calls ``target`` ("package.module:function", given the module object) once ``name`` is
    imported: now if it is, else when its import completes. A target already waiting is not added twice."""
    with _lock:
        module = sys.modules.get(name)
        if module is None or getattr(getattr(module, "__spec__", None), "_initializing", False):
            waiting = _pending.setdefault(name, [])
            if target not in waiting:
                waiting.append(target)
            global _finder
            if _finder is None:
                _finder = _Finder()
                sys.meta_path.insert(0, _finder)
            return
    _call(target, module)


def cancel(name: str, target: str) -> bool:
    """Drops ``target`` from the callbacks waiting for ``name``'s import; whether it was waiting."""
    with _lock:
        waiting = _pending.get(name)
        if not waiting or target not in waiting:
            return False
        waiting.remove(target)
        if not waiting:
            del _pending[name]
        return True


def waiting(name: str) -> List[str]:
    """The callbacks still waiting for ``name``'s import."""
    with _lock:
        return list(_pending.get(name, []))


__all__ = ["when_imported", "cancel", "waiting"]
