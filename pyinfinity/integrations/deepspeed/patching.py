"""Replacing a method of one of DeepSpeed's classes in place, and putting the original back."""
from __future__ import annotations

from typing import Any, Callable

#: Set (True) on every function pyinfinity puts into a DeepSpeed class.
MARK = "__pyinfinity_patch__"
#: What ``saved`` holds for a method the class did not define itself (it inherited one).
MISSING = object()


def saved_method(cls: type, meth: str) -> Any:
    """The class's own ``meth`` (from its ``__dict__``), or MISSING: what :func:`restore` puts back."""
    return cls.__dict__.get(meth, MISSING)


def original(cls: type, meth: str, saved: Any) -> Callable[..., Any]:
    """The callable a patch delegates to: the saved method, or the inherited one."""
    if saved is MISSING:
        return lambda self, *a, **kw: getattr(super(cls, self), meth)(*a, **kw)
    return saved


def install_method(cls: type, meth: str, fn: Callable[..., Any]) -> None:
    """Puts ``fn`` (marked with MARK) into ``cls`` as ``meth``."""
    setattr(fn, MARK, True)
    setattr(cls, meth, fn)


def restore(cls: type, meth: str, saved: Any) -> None:
    """Puts back what :func:`saved_method` returned (removing the patch when it was MISSING)."""
    if saved is MISSING:
        if meth in cls.__dict__:
            delattr(cls, meth)
    else:
        setattr(cls, meth, saved)
