"""Partitioning: each unit's parameters (a block of modules, ``pyinfinity.units``) become one flat
shard per dtype and requires_grad, in the compute dtype.

With one process a ZeRO-3 "shard" is the whole flat buffer of one unit's parameters of one dtype
(a decoder layer, say, or one module's own parameters); each parameter keeps its ``nn.Parameter``
object (so optimizers, tied weights and user references stay valid) but its ``.data`` is a
0-element placeholder except while the coordinator has the shard resident, when it is a view into
the shard's device buffer.

Dtypes are never changed silently: the compute dtype is the parameter's own dtype unless the
config enables fp16/bf16, and the fp32 master copy (taken before any cast) goes to the optimizer.

A ``FlatShard`` is what the partition decided about one buffer (its unit, dtype, slices, home);
its run-time state is one ``ShardRun``, whose named transitions are the only way that state
changes: the coordinator, the optimizer's parts and the device placement ask for them.
"""
from __future__ import annotations

import contextlib
import enum
import logging
from dataclasses import InitVar, dataclass, field
from typing import Any, Callable, Iterable, Iterator, Optional

import torch
from torch import nn


log = logging.getLogger(__name__)


class ShardState(enum.Enum):
    """Where a shard's values are on the compute device (``ShardRun.residency``)."""

    RELEASED = "released"  # only the home copy (cpu / nvme) exists
    INFLIGHT = "inflight"  # a fetch into the device buffer is in progress
    RESIDENT = "resident"  # the device buffer holds the data; params point into it


class ShardRun:
    """A shard's run-time state, and the one place it changes.

    Each change is a method named for the event that causes it; the coordinator, the optimizer's
    parts and the device placement ask for it and read the attributes, none of them sets one.
    What it holds, and who asks for each change:

    * residency (coordinator): ``residency`` moves RELEASED -> INFLIGHT (``fetching``) ->
      RESIDENT (``arrived``) -> RELEASED (``released``), the device ``buffer`` with it;
      ``kept_resident``: the unit stays on the device between steps (``keep_resident``, set by
      the partition's persistence threshold or the device placement; ``stop_keeping_resident``
      when a budget overflow gives it up);
    * uses (coordinator): ``users`` (module calls inside forward that need it), ``calls`` (calls
      of its owner in this forward), ``prefetched`` (fetched ahead, not used yet),
      ``held_by_backward`` (backward needs it until its gradients are in);
    * the gradient of this backward (coordinator): ``grad`` (the unit's flat gradient on the
      compute device while it is collected), ``grads_in`` (the trainable slices, by offset, whose
      gradient hook fired), ``grad_handed`` (handed off to the optimizer);
    * the home (coordinator, optimizer): ``home_stale``: the home holds a gradient, or a step
      will rewrite it; a fetch waits for the step (``home_awaits_step``, ``home_current``);
    * CUDA events (coordinator): ``ready`` (the copy of a resident unit's new values the next
      use waits for), ``backward_done`` (after this backward's last use of the unit);
    * where the optimizer keeps it (optimizer): ``steps_on_device`` (its optimizer state is on
      the device too, the gradient stays there), ``accumulates_on_device`` (its fp32 gradient
      accumulator is on the device, under accumulation).
    """

    __slots__ = ("_numel", "_dtype", "n_trainable", "residency", "buffer", "kept_resident", "users", "calls",
                 "prefetched", "held_by_backward", "grad", "grads_in", "grad_handed", "home_stale", "ready", "backward_done",
                 "steps_on_device", "accumulates_on_device")

    def __init__(self, numel: int, dtype: torch.dtype, n_trainable: int, kept_resident: bool = False) -> None:
        self._numel, self._dtype = numel, dtype  # the shape of the gradient collected
        self.n_trainable = n_trainable
        self.residency = ShardState.RELEASED
        self.buffer: Optional[torch.Tensor] = None
        self.kept_resident = kept_resident
        self.users = 0
        self.calls = 0
        self.prefetched = False
        self.held_by_backward = False
        self.grad: Optional[torch.Tensor] = None
        self.grads_in: set[int] = set()
        self.grad_handed = False
        self.home_stale = False
        self.ready: Any = None
        self.backward_done: Any = None
        self.steps_on_device = False
        self.accumulates_on_device = False

    def _expect(self, *states: ShardState) -> None:
        if self.residency not in states:
            raise RuntimeError(f"shard transition from {self.residency.value}: expected "
                               f"{' or '.join(s.value for s in states)}")

    # -- residency
    def fetching(self, buffer: torch.Tensor) -> None:
        """A fetch into ``buffer`` started."""
        self._expect(ShardState.RELEASED)
        self.buffer, self.residency = buffer, ShardState.INFLIGHT

    def arrived(self) -> None:
        """The buffer holds the values (or a failed fetch gives its buffer back next)."""
        self._expect(ShardState.INFLIGHT)
        self.residency = ShardState.RESIDENT

    def released(self) -> torch.Tensor:
        """The buffer leaves the device; returns it."""
        self._expect(ShardState.RESIDENT)
        buf, self.buffer, self.residency = self.buffer, None, ShardState.RELEASED
        return buf

    def keep_resident(self) -> None:
        self.kept_resident = True

    def stop_keeping_resident(self) -> None:
        """Fetched before each use from now on; a pending update of its device copy is moot."""
        self.kept_resident, self.ready = False, None

    # -- uses
    @property
    def idle(self) -> bool:
        """No module call uses it and backward does not hold it."""
        return self.users == 0 and not self.held_by_backward

    def use(self) -> None:
        self.users += 1

    def unuse(self) -> None:
        if self.users > 0:
            self.users -= 1

    def called(self) -> None:
        """Its owner module was called in this forward."""
        self.calls += 1

    def new_forward(self) -> None:
        self.calls = 0

    def prefetch_issued(self) -> None:
        self.prefetched = True

    def prefetch_ended(self) -> None:
        """The prefetch was used, or dropped unused."""
        self.prefetched = False

    def hold_for_backward(self) -> None:
        self.held_by_backward = True

    def backward_let_go(self) -> None:
        self.held_by_backward = False

    def forget_uses(self) -> None:
        """Everything is released (after the optimizer changed the homes)."""
        self.users, self.held_by_backward, self.prefetched = 0, False, False

    # -- the gradient of this backward
    @property
    def grads_pending(self) -> bool:
        """Some trainable slice's gradient has not arrived in this backward."""
        return len(self.grads_in) < self.n_trainable

    def grad_arrived(self, offset: int, grad: Optional[torch.Tensor], device: Optional[torch.device]) -> None:
        """The gradient hook of the slice at ``offset`` fired; ``grad`` (the slice's, flattened) is
        summed into the unit's flat gradient (zeros first) unless None."""
        if grad is not None:
            if self.grad is None:
                self.grad = torch.zeros(self._numel, dtype=self._dtype, device=device)
            self.grad[offset:offset + grad.numel()].add_(grad)
        self.grads_in.add(offset)

    def take_grad(self) -> torch.Tensor:
        """The unit's gradient is final for this backward and handed off: returns it."""
        g, self.grad, self.grad_handed = self.grad, None, True
        return g

    def end_backward(self) -> None:
        self.grads_in.clear()
        self.grad_handed = False

    def drop_grad(self) -> None:
        """A failed backward: the gradient collected so far is dropped."""
        self.grad = None
        self.end_backward()

    # -- the home
    def home_awaits_step(self) -> None:
        """The home holds a gradient, or the optimizer will rewrite it: a fetch waits for the step."""
        self.home_stale = True

    def home_current(self) -> None:
        """The home holds the current values (written by the step, restored or loaded)."""
        self.home_stale = False

    # -- CUDA events
    def update_queued(self, event: Any) -> None:
        """A copy of new values into the resident buffer was queued: the next use waits for ``event``."""
        self.ready = event

    def take_ready(self) -> Any:
        ev, self.ready = self.ready, None
        return ev

    def backward_enqueued(self, event: Any) -> None:
        """This backward's last use of the unit is queued before ``event``."""
        self.backward_done = event

    # -- where the optimizer keeps it
    def state_to_device(self) -> None:
        self.steps_on_device = True

    def state_to_host(self) -> None:
        self.steps_on_device = False

    def accumulator_to_device(self) -> None:
        self.accumulates_on_device = True

    def accumulator_to_host(self) -> None:
        self.accumulates_on_device = False


@dataclass
class ParamSlice:
    """Where one parameter lives inside its shard."""

    name: str  # qualified name (first one seen, for tied parameters)
    param: nn.Parameter
    offset: int  # in elements
    numel: int
    shape: torch.Size
    orig_dtype: torch.dtype  # the dtype the user's model had (export restores it)
    requires_grad: bool


@dataclass(eq=False)
class FlatShard:
    """One flat buffer of parameters: what the partition decided (its unit, dtype, slices, home)
    and its run-time state (``run``, a ``ShardRun``: the only place that state changes)."""

    index: int
    module_name: str
    dtype: torch.dtype
    slices: list[ParamSlice]
    numel: int
    kept_resident: InitVar[bool] = False  # from the start (the persistence threshold)
    owner: Optional[nn.Module] = None  # the module rooting the shard's unit
    shared: bool = False  # also needed by a module outside its unit (tied / external parameters)
    home: Any = None  # swap record of the tensor swapper (tier cpu | nvme | gpu), set when placed
    run: ShardRun = field(init=False, repr=False)

    def __post_init__(self, kept_resident: bool) -> None:
        self.run = ShardRun(self.numel, self.dtype, self.n_trainable, kept_resident)

    @property
    def state(self) -> ShardState:
        return self.run.residency

    @property
    def persistent(self) -> bool:
        """Kept on the compute device between steps."""
        return self.run.kept_resident

    @property
    def buffer(self) -> Optional[torch.Tensor]:
        """Its device buffer while in flight or resident."""
        return self.run.buffer

    @property
    def device_step(self) -> bool:
        """Its optimizer state is on the device too (``zero.optim.device``)."""
        return self.run.steps_on_device

    @property
    def grad_on_device(self) -> bool:
        """Its fp32 gradient accumulator is on the device (``zero.optim.grads``)."""
        return self.run.accumulates_on_device

    @property
    def nbytes(self) -> int:
        return self.numel * _itemsize(self.dtype)

    @property
    def trainable(self) -> bool:
        return any(s.requires_grad for s in self.slices)

    @property
    def n_trainable(self) -> int:
        return sum(1 for s in self.slices if s.requires_grad)

    def __repr__(self) -> str:
        return (f"FlatShard({self.index}, {self.module_name or '<root>'}, {self.dtype}, numel={self.numel}, "
                f"{self.state.value})")


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


@dataclass
class Partition:
    """All shards of a model, which shards each module needs, and which shard holds each parameter."""

    shards: list[FlatShard] = field(default_factory=list)
    module_shards: dict[nn.Module, list[FlatShard]] = field(default_factory=dict)
    param_slice: dict[int, tuple[FlatShard, ParamSlice]] = field(default_factory=dict)  # id(param) ->
    units: int = 0  # blocks of modules (a unit has one shard per dtype and requires_grad)

    @property
    def numel(self) -> int:
        return sum(s.numel for s in self.shards)

    @property
    def nbytes(self) -> int:
        return sum(s.nbytes for s in self.shards)

    def largest_module_bytes(self) -> int:
        return max((sum(s.nbytes for s in v) for v in self.module_shards.values()), default=0)


def compute_dtype_for(param_dtype: torch.dtype, fp16: bool, bf16: bool) -> torch.dtype:
    """fp16/bf16 config casts floating parameters; otherwise the parameter keeps its dtype."""
    if not param_dtype.is_floating_point:
        return param_dtype
    if fp16:
        return torch.float16
    if bf16:
        return torch.bfloat16
    return param_dtype


def placeholder(dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """What a released parameter's ``.data`` is: 0 elements, the right dtype and device."""
    return torch.empty(0, dtype=dtype, device=device)


@contextlib.contextmanager
def init_empty(config: Any = None) -> Iterator[None]:
    """Builds models without materialising their parameters: each parameter is moved to the meta
    device as it is registered (before any initialiser touches its memory).

    ``initialize`` then materialises one module at a time, initialises it (``reset_parameters`` or
    a transformers model's ``_init_weights``), partitions it and writes the shard straight to its
    tier, so the whole model never exists in host RAM. Buffers are real (they are small and often
    computed in ``__init__``, e.g. rotary frequencies). ``config`` (optional, any form
    ``initialize`` takes) is checked first, so a bad one fails before the model is built.
    """
    if config is not None:
        from pyinfinity.config import load_config

        load_config(config)  # fail early on a bad config
    orig = nn.Module.register_parameter

    def register_parameter(self: nn.Module, name: str, param: Optional[nn.Parameter]) -> None:
        orig(self, name, param)
        if param is not None and not param.is_meta:
            p = self._parameters[name]
            self._parameters[name] = nn.Parameter(p.to("meta"), requires_grad=p.requires_grad)

    nn.Module.register_parameter = register_parameter  # type: ignore[method-assign]
    try:
        yield
    finally:
        nn.Module.register_parameter = orig  # type: ignore[method-assign]


def materialize_module(module: nn.Module, root: Optional[nn.Module],
                       replaced: Optional[dict[int, nn.Parameter]] = None, *,
                       init_device: Optional[torch.device] = None, init_bytes: int = 0) -> None:
    """Gives a module's own meta parameters real storage on the CPU and initialises them.

    Used by ``init_empty``: one module at a time, so the whole model never exists in RAM at once.
    Initialisation: ``module.reset_parameters()`` when it has one, then the transformers root
    model's ``_init_weights(module)`` when there is one; with neither, zeros (logged).
    ``init_device`` (a GPU engine's device): a module whose new parameters take at most
    ``init_bytes`` is initialised there, by that device's random generator, and copied to the CPU
    (the CPU's generator draws on one core, the bottleneck of building a large model).
    """
    replaced = {} if replaced is None else replaced
    metas = []
    pending = [p for p in module._parameters.values() if p is not None and p.is_meta and id(p) not in replaced]
    where = torch.device("cpu")
    if init_device is not None and sum(p.numel() * p.element_size() for p in pending) <= init_bytes:
        where = init_device
    for name, p in list(module._parameters.items()):
        if p is None or not p.is_meta:
            continue
        if id(p) in replaced:  # tied to a parameter materialised with an earlier module
            module._parameters[name] = replaced[id(p)]
            continue
        new = nn.Parameter(torch.empty(p.shape, dtype=p.dtype, device=where), requires_grad=p.requires_grad)
        replaced[id(p)] = new
        module._parameters[name] = new
        metas.append((name, new))
    if not metas:
        return
    try:
        _initialize(module, root, metas)
    finally:
        if where.type != "cpu":
            for _, new in metas:  # the same Parameter objects (tied references stay valid), on the CPU
                new.data = new.data.to("cpu")


def _initialize(module: nn.Module, root: Optional[nn.Module], metas: list) -> None:
    """The module's own initialiser, then the transformers root's (see ``materialize_module``)."""
    reset = getattr(module, "reset_parameters", None)
    init_weights = getattr(root, "_init_weights", None) if root is not None else None
    with torch.no_grad():
        if callable(reset):
            reset()
        if callable(init_weights):  # a transformers model's own scheme wins (e.g. std 0.02)
            init_weights(module)
        if not callable(reset) and not callable(init_weights):
            log.warning("init_empty: %s has no reset_parameters/_init_weights; its parameters start at 0",
                        type(module).__name__)
            for _, p in metas:
                p.data.zero_()


def partition_model(
    model: nn.Module,
    *,
    fp16: bool = False,
    bf16: bool = False,
    persistence_threshold: int = 0,
    on_shard: Callable[[FlatShard, torch.Tensor, Optional[torch.Tensor]], Any],
    device: torch.device = torch.device("cpu"),
    unit_bytes: int = 0,
    materialize: Callable[[nn.Module, Optional[nn.Module], dict[int, nn.Parameter]], None] = materialize_module,
) -> Partition:
    """Turns the model's parameters into flat shards, one per unit and (dtype, requires_grad).

    Units (``pyinfinity.units``): a module whose subtree holds at most ``unit_bytes`` of parameters
    (in the compute dtype) is one unit with all of its subtree's parameters; other modules with
    parameters of their own are a unit of those alone (``unit_bytes`` 0: one unit per module).
    For each shard, ``on_shard(shard, flat_compute, flat_fp32)`` is called once with the shard's
    data in the compute dtype and in fp32 (the master copy, taken before any cast; None for a
    frozen shard in another dtype, which gets no master); the callback places them in their tiers
    and returns the shard's home (its swap record).
    Afterwards every parameter's ``.data`` is a placeholder, so the model's own copy is freed unit
    by unit. Meta parameters (``init_empty``) are given storage one
    module at a time, just before their unit is partitioned, by ``materialize(module, model,
    replaced)`` (default: initialised; ``pretrained.WeightLoader``: read from a checkpoint).
    """
    from pyinfinity.units import unit_members, unit_roots

    part = Partition()
    names = {id(m): n for n, m in model.named_modules()}
    replaced: dict[int, nn.Parameter] = {}  # meta parameter -> its materialised replacement

    def isz(p: nn.Parameter) -> int:
        return _itemsize(compute_dtype_for(p.dtype, fp16, bf16))

    roots = unit_roots(model, unit_bytes, isz)
    members = unit_members(model, roots)
    for module in model.modules():
        if id(module) in members and members[id(module)] is not module:
            continue  # partitioned with its unit's root
        mods = list(module.modules()) if id(module) in roots else [module]
        for m in mods:
            materialize(m, model, replaced)
        own: dict[tuple, list[tuple[str, nn.Parameter]]] = {}
        listed: set[int] = set()
        for m in mods:
            mname = names.get(id(m), "")
            for pname, p in m.named_parameters(recurse=False):
                if id(p) in part.param_slice or id(p) in listed:
                    continue  # tied: owned by an earlier unit (or listed already in this one)
                listed.add(id(p))
                key = (compute_dtype_for(p.dtype, fp16, bf16), bool(p.requires_grad))
                own.setdefault(key, []).append((f"{mname}.{pname}" if mname else pname, p))
        uname = names.get(id(module), "")
        made: list[FlatShard] = []
        for (dtype, _), plist in own.items():
            slices, offset = [], 0
            for qual, p in plist:
                n = p.numel()
                slices.append(ParamSlice(qual, p, offset, n, p.shape, p.dtype, p.requires_grad))
                offset += n
            shard = FlatShard(index=len(part.shards), module_name=uname, dtype=dtype, slices=slices,
                              numel=offset, kept_resident=0 < offset <= persistence_threshold, owner=module)
            if offset == 0:
                for s in slices:
                    part.param_slice[id(s.param)] = (shard, s)
                    s.param.data = placeholder(dtype, device)
                continue
            # a frozen shard has no fp32 master: its copy in the compute dtype is all it costs
            trainable = any(s.requires_grad for s in slices)
            flat32 = torch.empty(offset, dtype=torch.float32) if trainable or dtype == torch.float32 else None
            flat = flat32 if flat32 is not None and dtype == torch.float32 else torch.empty(offset, dtype=dtype)
            with torch.no_grad():
                for s in slices:
                    src = s.param.data.reshape(-1)
                    if flat32 is not None:
                        flat32[s.offset:s.offset + s.numel].copy_(src)
                    if flat is not flat32:
                        flat[s.offset:s.offset + s.numel].copy_(src)
            for s in slices:
                part.param_slice[id(s.param)] = (shard, s)
                s.param.data = placeholder(dtype, device)
            shard.home = on_shard(shard, flat, flat32)
            del flat, flat32
            part.shards.append(shard)
            made.append(shard)
        for m in mods:  # what each module's call needs: its unit's shards and what it shares with others
            needed = list(made) if (m is module or any(True for _ in m.parameters(recurse=False))) else []
            for p in m.parameters(recurse=False):
                sh = part.param_slice.get(id(p), (None,))[0]
                if sh is not None and sh.numel and sh not in needed:
                    needed.append(sh)
                    sh.shared = True  # used by a module outside the unit that owns it
            if needed:
                part.module_shards[m] = needed
        if made:
            part.units += 1
    if part.shards:
        log.info("partitioned %d parameters into %d units, %d flat shards (%.1f MiB in compute dtype)",
                 part.numel, part.units, len(part.shards), part.nbytes / 2**20)
    return part


def iter_params(shards: Iterable[FlatShard]) -> Iterable[tuple[FlatShard, ParamSlice]]:
    for sh in shards:
        for s in sh.slices:
            yield sh, s
