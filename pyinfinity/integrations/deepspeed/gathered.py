"""``deepspeed.zero.GatheredParameters`` for the parameters of a model pyinfinity's engine trains
(on the ``engine_route``): libraries that read a parameter outside its module's forward under
ZeRO-3 (TRL's fused LM-head loss reads ``lm_head.weight`` directly) gather it through that context
manager and check ``param.ds_status`` first. :func:`register` marks an engine's parameters
(``ds_status`` NOT_AVAILABLE: they are offloaded) and :class:`GatheredParameters` makes them
resident for the block through the engine's coordinator; any other parameter goes to DeepSpeed's
own. With ``modifier_rank`` (a user initialising the embedding rows of new tokens, say) the
values changed in the block are written, on leaving it, into the engine's fp32 masters,
parameter homes and resident copies (``TrainingState.overwrite``), so training goes on from them;
only changed elements are written (a bf16 model's untouched weights keep their fp32 masters). Without it the block only reads: the tiers stay as they were."""
from __future__ import annotations

import contextlib
import weakref
from typing import Any, Dict, Iterable, Optional, Tuple

from pyinfinity.integrations.deepspeed.route_checks import refuse

_owner: Dict[int, Tuple[Any, Any]] = {}  # id(parameter) -> (weakref to it, weakref to its Engine)
_original: Any = None  # DeepSpeed's GatheredParameters


def register(engine: Any) -> None:
    """Marks the parameters ``engine`` partitioned as ZeRO-3 parameters that are not available."""
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

    ref = weakref.ref(engine)
    for key in [k for k, (p, e) in _owner.items() if p() is None or e() is None]:
        del _owner[key]
    for sh in engine.partition.shards:
        for sl in sh.slices:
            _owner[id(sl.param)] = (weakref.ref(sl.param), ref)
            sl.param.ds_status = ZeroParamStatus.NOT_AVAILABLE


def engine_of(param: Any) -> Any:
    """The live Engine that partitioned ``param``, or None."""
    entry = _owner.get(id(param))
    if entry is None or entry[0]() is not param:
        return None
    return entry[1]()


def _as_list(params: Any) -> list:
    if params is None:
        return []
    if isinstance(params, Iterable) and not hasattr(params, "data"):
        return [p for p in params if p is not None]
    return [params]


class GatheredParameters:
    """DeepSpeed's signature; an engine's parameters are resident within the block."""

    def __init__(self, params: Any, modifier_rank: Optional[int] = None, fwd_module: Any = None,
                 enabled: bool = True) -> None:
        params = _as_list(params)
        ours = [p for p in params if engine_of(p) is not None]
        self._inner: Any
        if not enabled or not params:
            self._inner = contextlib.nullcontext()
        elif not ours and all(p.is_meta for p in params):
            self._inner = contextlib.nullcontext()  # built by zero_init.Init: the engine loads their values
        elif not ours:
            self._inner = _original(params, modifier_rank=modifier_rank, fwd_module=fwd_module, enabled=enabled)
        else:
            engine = engine_of(ours[0])
            if engine.closed:
                raise RuntimeError("GatheredParameters: the pyinfinity engine these parameters belonged to is closed")
            if any(engine_of(p) is not engine for p in ours):
                raise refuse("GatheredParameters", "parameters of two pyinfinity engines in one block", "gather "
                             "each engine's parameters in a block of its own")
            self._inner = engine.coordinator.gathered(ours)
            if modifier_rank is not None:
                self._engine, self._modified = engine, ours
        self._before: list = []

    _engine: Any = None  # with modifier_rank: the engine the changed values are written into
    _modified: list = []

    def __enter__(self) -> Any:
        out = self._inner.__enter__()
        if self._engine is not None:  # what the block starts from: the changed elements are found against it
            self._before = [p.data.detach().clone() for p in self._modified]
        return out

    def __exit__(self, *exc: Any) -> Any:
        if self._engine is None:
            return self._inner.__exit__(*exc)
        changes = []
        try:
            if exc[0] is None:
                for p, before in zip(self._modified, self._before):
                    after = p.data.detach().reshape(-1)
                    changes.append((p, after != before.reshape(-1), after.clone()))
        finally:
            self._before = []
            ret = self._inner.__exit__(*exc)
        if changes:
            self._engine.state.overwrite(changes)
        return ret


def patch_trl(utils: Any) -> None:
    """TRL's fused LM-head loss gathers ``lm_head.weight`` with ``maybe_gather_lm_head_ctx``, in
    its forward and again in its backward, where the weight is what pyinfinity's saved-tensor hook
    hands back (a view of the resident shard, no ``ds_status``): for an engine's parameters, and
    for such views, the gather is this module's (a view is resident already)."""
    original = getattr(utils, "maybe_gather_lm_head_ctx", None)
    if original is None or getattr(original, "__pyinfinity_patch__", False):
        return

    def maybe_gather_lm_head_ctx(*params: Any) -> Any:
        given = [p for p in params if p is not None]
        ours = [p for p in given if engine_of(p) is not None]
        if not ours and all(hasattr(p, "ds_status") for p in given):
            return original(*params)
        return GatheredParameters(ours) if ours else contextlib.nullcontext()

    maybe_gather_lm_head_ctx.__pyinfinity_patch__ = True  # type: ignore[attr-defined]
    maybe_gather_lm_head_ctx.__doc__ = original.__doc__
    utils.maybe_gather_lm_head_ctx = maybe_gather_lm_head_ctx


def install(zero: Any) -> None:
    """Puts :class:`GatheredParameters` in ``deepspeed.zero`` (DeepSpeed's kept for the others)."""
    global _original
    if zero.GatheredParameters is not GatheredParameters:
        _original = zero.GatheredParameters
        zero.GatheredParameters = GatheredParameters


def uninstall(zero: Any) -> None:
    global _original
    if _original is not None:
        zero.GatheredParameters = _original
        _original = None


__all__ = ["GatheredParameters", "register", "engine_of", "install", "uninstall", "patch_trl"]
