"""pyinfinity's ``Engine`` as DeepSpeed's engine, for the libraries that drive DeepSpeed's: what
``deepspeed.initialize`` returns on pyinfinity's route (``engine_route``).

Hugging Face Trainer and Accelerate call, on the engine: ``set_gradient_accumulation_boundary``
before every ``backward(loss, scale_wrt_gas=...)`` (Trainer's loss is already divided by the
accumulation steps, a plain Accelerate loop's is not), ``step()`` only at the boundary,
``get_global_grad_norm()``, ``zero_gather_16bit_weights_on_model_save()`` and
``_zero3_consolidated_16bit_state_dict()`` to save the weights, ``save_checkpoint`` /
``load_checkpoint`` (``global_step*`` tags, ``(path, client_state)``), ``destroy()``, ``.module``,
``.config`` (the dict) and ``isinstance(engine, DeepSpeedEngine)`` to unwrap it. The facade class is
made (once, when DeepSpeed is imported) as a subclass of ``DeepSpeedEngine`` whose own constructor
never runs: every call those libraries make is one of the methods below, and an attribute of
DeepSpeed's engine that pyinfinity does not implement raises AttributeError naming it.

The optimizer they get is :class:`EngineOptimizer`, a ``torch.optim.Optimizer`` whose
``param_groups`` are the engine's: a torch scheduler built on it (Trainer's ``LambdaLR``) sets each
group's learning rate the offloaded Adam steps with. Its ``step()`` and ``zero_grad()`` do nothing: the
engine steps at the boundary, as DeepSpeed's does."""
from __future__ import annotations

import logging
import os
from typing import Any, Optional

import torch
from torch import nn

from pyinfinity.integrations.deepspeed.route_checks import refuse

log = logging.getLogger(__name__)

_facade_class: Optional[type] = None


class EngineOptimizer(torch.optim.Optimizer):
    """The engine's offloaded Adam as a torch optimizer: ``param_groups`` is the engine's list
    (the user's groups, ``OffloadOptimizer.set_param_groups``; writing a group's ``lr`` sets that
    group's next step), ``overflow`` says whether the last step
    was skipped (fp16 overflow). It holds no state of its own: the engine's checkpoint has it."""

    def __init__(self, engine: Any, facade: Any = None) -> None:
        # torch's constructor wants parameters; the groups are then the engine's own list
        super().__init__([nn.Parameter(torch.zeros(0))], {k: v for k, v in engine.optimizer.defaults.items()
                                                           if k != "params"})
        self.param_groups = engine.optimizer.param_groups
        self._engine = engine
        self._facade = facade

    @property
    def overflow(self) -> bool:
        last = self._facade.last_step if self._facade is not None else None
        return bool(last is not None and last.skipped)

    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        """Nothing: the engine steps in its ``step()`` at the accumulation boundary."""
        if closure is not None:
            raise refuse("optimizer.step(closure)", "a closure re-evaluating the loss is not supported by "
                          "pyinfinity's engine", "call engine.backward(loss) and engine.step()")
        return None

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Nothing: the engine zeroes the accumulated gradients when it steps."""

    def state_dict(self) -> dict:
        raise RuntimeError("optimizer.state_dict(): the offloaded Adam state lives in pyinfinity's tiers; save it "
                           "with engine.save_checkpoint(dir) (Trainer and Accelerate do)")

    def load_state_dict(self, state_dict: dict) -> None:
        raise RuntimeError("optimizer.load_state_dict(): the offloaded Adam state lives in pyinfinity's tiers; "
                           "restore it with engine.load_checkpoint(dir)")


class _Facade:
    """The methods of the facade class (``facade_class()`` puts them before DeepSpeedEngine's)."""

    is_compiled = False

    def __init__(self, engine: Any, ds_config: dict, optimizer: EngineOptimizer) -> None:
        nn.Module.__init__(self)
        self.module = engine.module  # a submodule, as DeepSpeed's engine has it
        self.pyinfinity_engine = engine
        self.config = ds_config
        self.optimizer = optimizer
        self.last_step: Any = None  # the engine's StepRecord of the last optimizer step
        self._boundary_pending = False  # the window's last backward ran; its step() has not
        self._saved: Optional[tuple] = None  # (dir, tag, global_steps, micro_steps) of the last save_checkpoint

    def __getattr__(self, name: str) -> Any:
        try:
            return nn.Module.__getattr__(self, name)
        except AttributeError:
            pass
        module = self.__dict__.get("_modules", {}).get("module")
        if module is not None and not name.startswith("__") and hasattr(module, name):
            return getattr(module, name)  # generate(), config, ... as DeepSpeed's engine passes them through
        raise AttributeError(f"DeepSpeed engine attribute {name!r}: not implemented by pyinfinity's engine (the "
                             "config's \"pyinfinity\" section selected it); remove the section to use DeepSpeed's")

    # -- training
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.pyinfinity_engine(*args, **kwargs)

    def train(self, mode: bool = True) -> Any:
        return nn.Module.train(self, mode)

    def eval(self) -> Any:
        return nn.Module.train(self, False)

    def set_gradient_accumulation_boundary(self, is_boundary: bool) -> None:
        self.pyinfinity_engine.set_gradient_accumulation_boundary(is_boundary)

    def is_gradient_accumulation_boundary(self) -> bool:
        return self.pyinfinity_engine.is_gradient_accumulation_boundary()

    def backward(self, loss: torch.Tensor, retain_graph: bool = False, scale_wrt_gas: bool = True) -> torch.Tensor:
        """One micro-batch's backward; ``scale_wrt_gas=False``: the loss is already divided by the
        accumulation steps. Inside the window the micro-batch is counted here (Accelerate calls
        ``step()`` only at the boundary; a ``step()`` after it then does nothing, as DeepSpeed's)."""
        if retain_graph:
            raise refuse("backward(retain_graph=True)", "pyinfinity's engine releases each unit's parameters "
                          "after its backward", "run one backward per forward")
        e = self.pyinfinity_engine
        if self._boundary_pending:
            raise RuntimeError("backward(): the last backward ended the accumulation window and its step() has not "
                               "run; call engine.step() after it")
        boundary = e.is_gradient_accumulation_boundary()
        e.backward(loss, scale_wrt_gas=scale_wrt_gas)
        if boundary:
            self._boundary_pending = True
        else:
            e.step()  # counts the micro-batch; the gradients stay accumulated
        return loss

    def step(self, lr_kwargs: Any = None) -> None:
        """After the window's last backward: the optimizer step (clipping, lr schedule, zeroed
        gradients). After a backward inside the window: nothing (it was counted)."""
        if not self._boundary_pending:
            return
        self._boundary_pending = False
        rec = self.pyinfinity_engine.step()
        if rec is not None:
            self.last_step = rec

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Nothing: the engine zeroes the accumulated gradients when it steps."""

    def get_global_grad_norm(self) -> Optional[float]:
        """The gradient norm of the last optimizer step, before clipping (None before the first)."""
        return None if self.last_step is None else float(self.last_step.grad_norm)

    def was_step_applied(self) -> bool:
        return self.last_step is not None and not self.last_step.skipped

    def get_lr(self) -> list:
        return self.pyinfinity_engine.get_lr()

    @property
    def lr_scheduler(self) -> Any:
        return self.pyinfinity_engine.lr_scheduler

    @property
    def global_steps(self) -> int:
        return self.pyinfinity_engine.global_steps

    @property
    def micro_steps(self) -> int:
        return self.pyinfinity_engine.micro_steps

    @property
    def global_samples(self) -> int:
        return self.pyinfinity_engine.global_steps * self.train_batch_size()

    @property
    def device(self) -> torch.device:
        return self.pyinfinity_engine.device

    def gradient_accumulation_steps(self) -> int:
        return self.pyinfinity_engine.gradient_accumulation_steps

    def train_micro_batch_size_per_gpu(self) -> int:
        return self.pyinfinity_engine.config.train_micro_batch_size_per_gpu

    def train_batch_size(self) -> int:
        return self.pyinfinity_engine.config.train_batch_size

    def gradient_clipping(self) -> float:
        return self.pyinfinity_engine.config.gradient_clipping

    def zero_optimization(self) -> bool:
        return True

    def zero_optimization_stage(self) -> int:
        return 3

    def zero_optimization_partition_weights(self) -> bool:
        return True

    def fp16_enabled(self) -> bool:
        return self.pyinfinity_engine.config.fp16.enabled

    def bfloat16_enabled(self) -> bool:
        return self.pyinfinity_engine.config.bf16.enabled

    # -- weights and checkpoints
    def zero_gather_16bit_weights_on_model_save(self) -> bool:
        z = self.config.get("zero_optimization") or {}
        return bool(z.get("stage3_gather_16bit_weights_on_model_save", z.get("gather_16bit_weights_on_model_save",
                                                                              False)))

    def _zero3_consolidated_16bit_state_dict(self, exclude_frozen_parameters: bool = False) -> dict:
        """The trained weights in one state dict (each in its parameter's dtype; frozen ones left
        out with ``exclude_frozen_parameters``)."""
        from pyinfinity import export

        return export.state_dict(self.pyinfinity_engine.state, trainable_only=exclude_frozen_parameters)

    def save_checkpoint(self, save_dir: str, tag: Optional[str] = None, client_state: Optional[dict] = None,
                        save_latest: bool = True, exclude_frozen_parameters: bool = False) -> bool:
        """The full training state under ``save_dir/tag`` (``global_step<N>`` by default). A second
        call for the same folder and tag with no step in between (Trainer saves twice into a
        checkpoint when the weights are not gathered) keeps the first and writes nothing."""
        e = self.pyinfinity_engine
        tag = tag or f"global_step{e.global_steps}"
        key = (os.path.realpath(save_dir), tag, e.global_steps, e.micro_steps)
        if key == self._saved and os.path.isdir(os.path.join(save_dir, tag)):
            log.info("save_checkpoint: %s already holds this step's state; not written again",
                     os.path.join(save_dir, tag))
            return True
        e.save_checkpoint(save_dir, tag, client_state=dict(client_state or {}))
        self._saved = key
        return True

    def load_checkpoint(self, load_dir: str, tag: Optional[str] = None, load_module_strict: bool = True,
                        load_optimizer_states: bool = True, load_lr_scheduler_states: bool = True,
                        load_module_only: bool = False, custom_load_fn: Any = None) -> tuple:
        """Restores a state ``save_checkpoint`` wrote; returns (path, client_state)."""
        if load_module_only or not load_optimizer_states or custom_load_fn is not None:
            key = ("load_module_only" if load_module_only else "custom_load_fn" if custom_load_fn is not None
                   else "load_optimizer_states=False")
            raise refuse(f"load_checkpoint({key})", "pyinfinity's checkpoint restores the whole training state",
                          "load all of it, or load the weights with from_pretrained before initialize")
        path, client = self.pyinfinity_engine.load_checkpoint(load_dir, tag)
        self._saved = None
        self.last_step = None
        return path, client

    def destroy(self) -> None:
        """Closes pyinfinity's engine: hooks off the model, swap files removed. Idempotent."""
        e = self.__dict__.get("pyinfinity_engine")
        if e is not None:
            e.close()


def facade_class() -> type:
    """The facade class: :class:`_Facade`'s methods over DeepSpeed's ``DeepSpeedEngine`` (made once)."""
    global _facade_class
    if _facade_class is None:
        from deepspeed.runtime.engine import DeepSpeedEngine

        _facade_class = type("PyinfinityDeepSpeedEngine", (_Facade, DeepSpeedEngine),
                             {"__module__": __name__, "__doc__": "pyinfinity's Engine as DeepSpeed's engine."})
    return _facade_class


def _check_optimizer_covers(model: nn.Module, params: Any) -> None:
    """Every parameter that requires grad must be one the optimizer steps: pyinfinity's engine steps all of them."""
    stepped = {id(p) for g in params for p in (g["params"] if isinstance(g, dict) else [g])}
    missing = [n for n, p in model.named_parameters() if p.requires_grad and id(p) not in stepped]
    if missing:
        raise refuse("optimizer.param_groups", f"{len(missing)} parameters that require grad are not in it (e.g. "
                      f"{missing[0]!r}); pyinfinity's engine steps every parameter that requires grad",
                      "set requires_grad=False on those, or give them to the optimizer")


def build_facade(model: nn.Module, ds_config: dict, cfg: dict, *, optimizer: Any = None, model_parameters: Any = None,
                 lr_scheduler: Any = None) -> Any:
    """pyinfinity's engine over ``model`` with ``cfg`` behind the facade; ``ds_config`` is what
    ``engine.config`` shows. ``lr_scheduler``: a callable taking the optimizer (Trainer's), or a
    scheduler object built on ``optimizer`` (rebound to the engine's)."""
    if model is None:
        raise refuse("model", "none given", "pass the nn.Module to train")
    if optimizer is not None:
        _check_optimizer_covers(model, optimizer.param_groups)
    elif model_parameters is not None:
        _check_optimizer_covers(model, list(model_parameters))
    from pyinfinity.engine import initialize as engine_initialize

    from pyinfinity import adapters
    from pyinfinity.integrations.deepspeed.zero_init import weights_source

    weights = weights_source(model)  # a meta model (built under zero.Init): its checkpoint is streamed in
    if weights is not None and adapters.is_peft_model(model):
        adapters.init_new_adapters(model)  # PEFT put new adapters on the meta base's device
    engine = engine_initialize(model, cfg, weights=weights)
    try:
        if optimizer is not None and len(optimizer.param_groups) > 1:
            # Trainer's AdamW: biases and norms in a group without weight decay; LoRA+ or an embedding's own lr
            try:
                engine.optimizer.set_param_groups(optimizer.param_groups)
            except ValueError as exc:
                raise refuse("optimizer.param_groups", str(exc), "give those parameters one group") from None
        from pyinfinity.integrations.deepspeed import gathered

        gathered.register(engine)
        facade = facade_class()(engine, ds_config, None)
        opt = EngineOptimizer(engine, facade)
        facade.optimizer = opt
        if lr_scheduler is not None:
            if callable(lr_scheduler) and not hasattr(lr_scheduler, "step"):
                sched = lr_scheduler(opt)
            elif getattr(lr_scheduler, "optimizer", None) is optimizer and optimizer is not None:
                sched = lr_scheduler
                sched.optimizer = opt  # the schedule now sets the engine's lr
                for g, user in zip(opt.param_groups, optimizer.param_groups):
                    g["lr"] = user["lr"]
            else:
                raise refuse("lr_scheduler", "a scheduler not built on the optimizer passed", "pass a callable "
                              "taking the optimizer, or a scheduler built on it")
            engine.state.lr_scheduler = sched
    except BaseException:
        engine.close()
        raise
    return facade


__all__ = ["EngineOptimizer", "facade_class", "build_facade"]
