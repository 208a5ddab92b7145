"""The training state of one model on one device, below the engine.

``TrainingState`` builds and holds what training changes: the partition (``partition``), each
shard's home in its tier (the swappers, ``homes``), the coordinator that moves units to the
compute device, the offloaded optimizer, the device placement (``device_placement``), the loss
scaler, the lr scheduler and the step counters, with the swap engines and the swap-directory claim
under them. It also keeps the checks that say whether the state may be read or trained on:

* open or closed;
* partly stepped: some shards hold a step's (or a checkpoint's) values and others not, after a
  failure part-way; training, saving and exporting refuse until a checkpoint is loaded;
* a boundary backward's gradients waiting for ``step()`` (``pending_backward``), and the
  optimizer's worker stepping in the background: what reads the whole state first waits for the
  worker and refuses in between (``quiesce``);
* a forward or backward running (``in_pass``): a save or load from a signal handler refuses.

The ``Engine`` is the user's facade over it (``engine.state``); ``checkpoint`` and ``export`` read
and write it through the methods here. It holds no reference to the engine, and nothing it hands
out (hooks, the worker) holds a strong reference to it, so an engine dropped without ``close()``
is collected and the finalizer removes the swap files.
"""
from __future__ import annotations

import atexit
import contextlib
import functools
import logging
import threading
import time
import weakref
from typing import Any, Iterator, Optional, Sequence

import torch
from torch import nn

from pyinfinity.config import Config
from pyinfinity.layout.charges import device_state_cost
from pyinfinity.layout.pools import config_knobs, engine_pools
from pyinfinity.layout.shards import ParamTiers, device_units
from pyinfinity.layout.sizes import ModelSizes
from pyinfinity.swap.ownership import claim_swap_dirs
from pyinfinity.swap.tensor_swapper import Tier, TensorSwapper, aligned_empty
from pyinfinity.progress import Progress
from pyinfinity.zero.budget import FetchStats
from pyinfinity.zero.coordinator import DeviceCopies, ParameterCoordinator
from pyinfinity.zero.device_placement import DevicePlacement
from pyinfinity.zero.homes import ParamHomes
from pyinfinity.zero.lr_schedules import build_scheduler
from pyinfinity.zero.optim.formats import make_state_format
from pyinfinity.zero.optimizer import DynamicLossScaler, OffloadOptimizer
from pyinfinity.zero.partition import FlatShard, materialize_module, partition_model

log = logging.getLogger(__name__)

_TIERS = {"device": Tier.GPU, "ram": Tier.CPU, "disk": Tier.NVME}  # layout.shards.ParamTiers -> the swapper's


def _weakly(method: Any) -> Any:
    """A callable for the state's parts (hooks, the device placement) that does not keep the state
    alive: an engine dropped without close() is collected (its finalizer removes the swap files
    and the hooks)."""
    ref = weakref.WeakMethod(method)

    def call(*args: Any, **kwargs: Any) -> Any:
        m = ref()
        if m is None:
            raise RuntimeError("the pyinfinity Engine this belongs to was garbage-collected without close(); "
                               "build a new engine")
        return m(*args, **kwargs)
    return call


def _buffers_to_device(model: nn.Module, device: torch.device) -> int:
    """Moves the model's buffers to the device, where they stay; returns their bytes (charged to
    the device budget)."""
    nbytes = 0
    for mod in model.modules():
        for name, b in list(mod._buffers.items()):
            if b is not None:
                mod._buffers[name] = b.to(device)
                nbytes += b.numel() * b.element_size()
    return nbytes


def _scheduler(given: Any, cfg: Config, optimizer: OffloadOptimizer) -> Any:
    """The lr scheduler: the caller's (a scheduler, or a callable that builds one from the
    optimizer), else the config's, else None."""
    if given is not None:
        return given(optimizer) if callable(given) and not hasattr(given, "step") else given
    if cfg.scheduler is not None:
        return build_scheduler(cfg.scheduler.type, optimizer, cfg.scheduler.params)
    return None


class TrainingState:
    """The partition, homes, coordinator, optimizer, device placement, scaler, scheduler and step
    counters of one model, and the checks on them (see the module docstring).

    Built from a config whose "auto" values are decided (``plan_engine_config``): ``sizes`` are the
    model's (for the swap-space checks), ``materialize`` the partitioner's materializer for meta
    parameters (``pretrained.WeightLoader``; None: their initialisers), ``background`` whether the
    optimizer steps in a worker thread, ``plan_sizes``/``checkpointing`` what the first forward's
    shape check needs. On failure everything built so far is closed again.
    """

    def __init__(self, model: nn.Module, cfg: Config, device: torch.device, sizes: ModelSizes, *,
                 device_memory: Optional[int] = None, lr_scheduler: Any = None, materialize: Any = None,
                 background: bool = False, plan_sizes: Any = None, checkpointing: bool = False,
                 device_base: int = 0, grow_prefetch: bool = False, grow_live: bool = False) -> None:
        self._closed = True
        self._finalizer: Any = None
        self.config = cfg
        self.device = device
        self.model = model
        self.gradient_accumulation_steps = cfg.gradient_accumulation_steps
        self.global_steps = 0
        self.micro_steps = 0
        self.pending_backward = False  # a boundary backward's gradients wait for step()
        self._partly_stepped: Optional[str] = None  # why some shards hold a step's values and others not
        self._in_pass = 0  # forwards/backwards running now (a save from a signal handler refuses)
        self._checkpoint_staging: Optional[torch.Tensor] = None  # a background save's staging, kept for the next
        self._staging_lock = threading.Lock()  # a save's writer thread gives it back
        z = cfg.zero_optimization

        # the swap layer: one engine per state class so I/O time can be told apart
        self._swap_engines: dict[str, Any] = {}
        op, oo = z.offload_param, z.offload_optimizer
        # how each shard's optimizer state is kept (docs/optimizer_state.md)
        fmt_name, adam_w = cfg.optimizer_state_format, cfg.optimizer.adam_w_mode
        self.state_format = make_state_format(fmt_name, adam_w)
        # the pools the layout gives this config: the swappers' pinned pools, the RAM, device and swap checks
        n_modules = sum(1 for m in model.modules() if m._parameters)
        self.pools = engine_pools(cfg, sizes, n_modules)
        # budgets checked, swap directories locked, a crashed run's files cleaned (swap/ownership.py)
        self.ownership = claim_swap_dirs(cfg, self.pools)
        try:
            self.param_swapper = TensorSwapper("params", device, op.nvme_path,
                                               self._swap_engine("params") if op.device == "nvme" else None,
                                               pin=op.pin_memory, pinned_capacity=self.pools.param_pinned,
                                               checksums=cfg.pyinfinity.checksums, ownership=self.ownership)
            self.optim_swapper = TensorSwapper("optimizer", device, oo.nvme_path,
                                               self._swap_engine("optimizer") if oo.device == "nvme" else None,
                                               pin=oo.pin_memory and cfg.pyinfinity.optimizer_step_device == "device",
                                               pinned_capacity=self.pools.optim_pinned,
                                               checksums=cfg.pyinfinity.checksums, ownership=self.ownership,
                                               record_checksums=True)
        except BaseException:  # e.g. pinned memory refused: give the swap directories back
            for e in self._swap_engines.values():
                e.close()
            self.ownership.release()
            raise
        # the copies beside the compute stream, shared by the coordinator, the homes and the optimizer
        self.copies = DeviceCopies(device, FetchStats())
        self.homes = ParamHomes(self.param_swapper, device, cfg.gradient_accumulation_steps,
                                update_resident=self.copies.update_resident, writeback_slots=oo.buffer_count)
        self.optimizer = OffloadOptimizer(
            cfg.optimizer, self.optim_swapper, nvme_ratio=oo.ratio if oo.device == "nvme" else 0.0,
            buffer_count=oo.buffer_count, pipeline=oo.pipeline_read or oo.pipeline_write,
            step_device=device if cfg.pyinfinity.optimizer_step_device == "device" else None,
            accumulate_steps=cfg.gradient_accumulation_steps, state_format=self.state_format,
            write_param=self.homes.write_param, param_out=self.homes.param_out, release_grad=self.homes.release_grad,
            copy_to_host=self.copies.copy_to_host, background=background,
            # "auto" decided by the planner (plan.resolve): one on the CPU device, where backward has the cores
            threads=int(cfg.pyinfinity.optimizer_threads),
            total_numel=sum(p.numel() for p in {id(p): p for p in model.parameters() if p.requires_grad}.values()))
        # each shard's home, in creation order (layout.shards.ParamTiers)
        self._param_tiers = ParamTiers(op.device, int(op.max_in_cpu) if op.device == "nvme" else 0)

        buf_bytes = _buffers_to_device(model, device)
        self.coordinator: Optional[ParameterCoordinator] = None
        self._closed = False
        self._held: list[Any] = [self.optimizer]  # what the finalizer stops: the worker, later the hooks
        self._finalizer = weakref.finalize(self, TrainingState._cleanup, self.param_swapper, self.optim_swapper,
                                           self._swap_engines, self.ownership, self._held)
        atexit.register(self._finalizer)
        loading = materialize is not None  # a checkpoint's weights (pretrained.WeightLoader), else an init
        if materialize is None and device.type == "cuda" and device_memory:
            # a random init draws its values on the GPU, a module at a time, within a quarter of the budget
            materialize = functools.partial(materialize_module, init_device=device, init_bytes=device_memory // 4)
        progress = Progress("loading the weights into their tiers" if loading else
                            "writing the weights to their tiers", n_modules, sizes.param_bytes,
                            disk_written=self._disk_written)
        make = materialize or materialize_module

        def materialize_counted(m: nn.Module, root: Any, replaced: dict) -> None:
            make(m, root, replaced)
            progress.advance(modules=1 if m._parameters else 0)

        def place_counted(shard: FlatShard, flat: torch.Tensor, flat32: Optional[torch.Tensor]) -> Any:
            home = self._place_shard(shard, flat, flat32)
            progress.advance(nbytes=flat.numel() * flat.element_size())
            return home

        try:
            t0 = time.perf_counter()
            self.partition = partition_model(model, fp16=cfg.fp16.enabled, bf16=cfg.bf16.enabled,
                                             persistence_threshold=int(z.stage3_param_persistence_threshold),
                                             on_shard=place_counted, device=device,
                                             unit_bytes=int(cfg.pyinfinity.unit_bytes), materialize=materialize_counted)
            log.info("placed %d units (%d shards) in %.2fs", self.partition.units, len(self.partition.shards),
                     time.perf_counter() - t0)
            self.ownership.flush()  # the manifest lists every slot
            self.placement = DevicePlacement(self.partition, self.optimizer, self.homes, device, device_memory,
                                             accumulation=self.gradient_accumulation_steps,
                                             drain=_weakly(self.drain), plan_sizes=plan_sizes,
                                             checkpointing=checkpointing, grow_prefetch=grow_prefetch,
                                             grow_live=grow_live)
            resident, device_state, accumulators = self._device_units()
            self.placement.keep_resident(resident)
            self.placement.place_device_states(device_state)
            self.placement.place_device_accumulators(accumulators)
            self.coordinator = ParameterCoordinator(
                model, self.partition, self.param_swapper, device,
                device_memory=device_memory, device_base=device_base,
                prefetch_bytes=int(z.stage3_prefetch_bucket_size), prefetch=cfg.pyinfinity.prefetch,
                on_grad=self.optimizer.grad_ready, grad_dest=self.homes.grad_dest, wait_home=_weakly(self.wait_home),
                master_values=self.optimizer.master_values,
                fixed_bytes=buf_bytes + self.placement.device_state_bytes + self.placement.device_grad_bytes,
                max_live_elements=int(z.stage3_max_live_parameters),
                max_inflight_reads=int(op.buffer_count) if op.device == "nvme" else None, copies=self.copies)
        except BaseException:
            self.close()
            raise
        self._held.append(self.coordinator)  # a dropped engine takes its hooks off the model
        self.placement.watch(self.coordinator)
        self.scaler = DynamicLossScaler(cfg.fp16)
        self.lr_scheduler = _scheduler(lr_scheduler, cfg, self.optimizer)

    # ------------------------------------------------------------------------- construction
    def _swap_engine(self, name: str) -> Any:
        if name not in self._swap_engines:
            from pyinfinity.swap import SwapEngine

            a = self.config.aio
            self._swap_engines[name] = SwapEngine(backend=a.backend, block_size=a.block_size,
                                                  queue_depth=a.queue_depth, threads=a.thread_count)
        return self._swap_engines[name]

    def _place_shard(self, shard: FlatShard, flat: torch.Tensor, flat32: Optional[torch.Tensor]) -> Any:
        """The partitioner's ``on_shard``: the shard's home and its optimizer state; returns the home."""
        home = self.homes.place(shard, flat, _TIERS[self._param_tiers.next(shard.numel)])
        self.optimizer.add_shard(shard, flat32)
        return home

    def _device_units(self) -> tuple[list[int], list[int], list[int]]:
        """The layout's device side for the shards partitioned (``layout.shards.device_units``):
        the units kept on the device, those whose optimizer state steps there, those whose
        accumulator is there; a state's cost is the bytes of its home in this format."""
        shards, acc = self.partition.shards, self.gradient_accumulation_steps
        knobs = config_knobs(self.config)
        resident, state, accumulators = device_units(
            [sh.numel for sh in shards], [sh.nbytes for sh in shards], [sh.trainable for sh in shards],
            [sh.persistent for sh in shards], knobs, acc,
            lambda i: device_state_cost(shards[i].dtype.itemsize, acc, state_bytes=self.state_format.nbytes(
                shards[i].numel) / max(1, shards[i].numel)) * shards[i].numel)
        kept = range(len(shards)) if knobs.param_device == "none" else sorted(resident)
        return list(kept), state, accumulators

    # ------------------------------------------------------------------------- the checks
    @property
    def closed(self) -> bool:
        """Whether close() was called (or construction failed)."""
        return self._closed

    def check_open(self) -> None:
        if self._closed:
            raise RuntimeError("Engine: used after close()")

    def check_parameters(self, model: nn.Module) -> None:
        """RuntimeError naming the first parameter of ``model`` that the engine does not hold: one
        created after ``initialize`` (``resize_token_embeddings``, a module replaced), which the
        engine would neither offload nor train."""
        known = self.partition.param_slice
        for name, p in model.named_parameters():
            if id(p) not in known:
                raise RuntimeError(f"Engine: parameter {name} was created after pyinfinity.initialize (e.g. by "
                                   "resize_token_embeddings or a module replaced after the engine or Trainer wrapped "
                                   "the model), so the engine would neither offload nor train it; change the model "
                                   "before Trainer or pyinfinity.initialize")

    @property
    def partly_stepped(self) -> Optional[str]:
        """Why some shards hold a step's (or a checkpoint's) values and others not, or None."""
        return self._partly_stepped

    def check_trainable(self, what: str) -> None:
        """Open and not partly stepped: ``what`` may train, save or export."""
        self.check_open()
        if self._partly_stepped is not None:
            raise self.partly_stepped_error(what)

    def partly_stepped_error(self, what: str) -> RuntimeError:
        return RuntimeError(f"{what}: the training state is partly stepped ({self._partly_stepped}); "
                            "load_checkpoint() or build a new engine")

    def mark_partly_stepped(self, why: str) -> None:
        """Records that some shards hold a step's results and others not (the first reason is kept):
        backward/step/save refuse (``check_trainable``) until load_checkpoint() succeeds."""
        if self._partly_stepped is None:
            self._partly_stepped = why
            log.error("%s: the optimizer state is partly stepped; load_checkpoint() before training on", why)

    def mark_partly_accumulated(self, why: str) -> None:
        """Part of a micro-batch's gradient was added into the accumulators before its backward
        failed: a retry would add it twice, so training refuses like a partly stepped state (the
        first reason is kept)."""
        if self._partly_stepped is None:
            self._partly_stepped = why

    def mark_partly_loaded(self, why: str) -> None:
        """A checkpoint load stopped part-way: some shards hold the checkpoint's state, the others
        the previous one (replaces an earlier reason)."""
        self._partly_stepped = why

    def mark_whole(self) -> None:
        """Every shard's state and values belong together again (a checkpoint load completed)."""
        self._partly_stepped = None

    @contextlib.contextmanager
    def in_pass(self) -> Iterator[None]:
        """Counts a forward or backward in progress (``check_not_in_pass``)."""
        self._in_pass += 1
        try:
            yield
        finally:
            self._in_pass -= 1

    def check_not_in_pass(self, what: str) -> None:
        """A save or load re-entering a forward or backward (a signal handler runs between two
        bytecodes of it) would read or replace shards the pass holds half-fetched: refused."""
        if self._in_pass:
            raise RuntimeError(f"{what}: called while a forward or backward of this engine is running (from a signal "
                               "handler?), whose shards are in flight; set a flag in the handler and save after "
                               "step() returns")

    def quiesce(self, what: str) -> None:
        """Before reading the whole training state: no boundary backward may be waiting for its
        step(), and the optimizer's worker must have written everything home."""
        if self.pending_backward or self.optimizer.overlap_open:
            raise RuntimeError(f"{what}: called between the boundary backward() and step() (the parameter homes "
                               "hold gradients, part of the model may already be stepped); call step() first")
        self.drain(what)
        self.optimizer.sync_homes(self.homes.write_home)  # units stepped on the device: their homes

    # ------------------------------------------------------------------------- the optimizer's worker
    def drain(self, what: str) -> None:
        """Waits until the optimizer's worker has written every new value home (for anything that
        reads the whole training state); a failure there marks the state partly stepped."""
        try:
            self.optimizer.drain()
        except KeyboardInterrupt:  # the user's Ctrl-C, not a failure: the worker goes on, a later wait finds it done
            raise
        except BaseException as exc:
            self.mark_partly_stepped(f"the background optimizer step failed: {exc!r}")
            self.optimizer.cancel()
            raise

    def wait_home(self, shard: FlatShard) -> float:
        """A fetch waits for the worker to write a unit's new values; a failure there (of any step
        still running in the background) leaves the state partly stepped: the failure is raised
        once, every later fetch gets the partly-stepped refusal."""
        if self._partly_stepped is not None and self.optimizer.failure is not None:
            raise self.partly_stepped_error(f"fetching {shard.module_name or '<root>'}")
        try:
            return self.optimizer.wait_shard(shard)
        except KeyboardInterrupt:  # the wait was interrupted; the step goes on in the background
            raise
        except BaseException as exc:
            if self._partly_stepped is not None:
                raise self.partly_stepped_error(f"fetching {shard.module_name or '<root>'}") from exc
            self.mark_partly_stepped(f"the background optimizer step failed: {exc!r}")
            raise

    def abandon_step(self, why: str) -> None:
        """A step that cannot complete: waits for what the worker was handed, puts the parameter
        homes that hold gradients back to the current weights. If any shard was stepped, or the
        background step of this or an earlier step failed, the training state is partly stepped:
        backward/step/save refuse until load_checkpoint()."""
        self.pending_backward = False
        failed = self.optimizer.failure  # cancel() forgets it
        try:
            stepped = self.optimizer.cancel()
            self.optimizer.restore_homes()
        except BaseException:
            self.mark_partly_stepped(f"{why}; the optimizer step could not be stopped cleanly")
            raise
        if failed is not None:
            self.mark_partly_stepped(f"{why}: the background optimizer step had failed ({failed!r})")
        elif stepped:
            self.mark_partly_stepped(f"{why} after {stepped} shards had been stepped")

    # ------------------------------------------------------------------------- reading and writing it whole
    def checkpoint_io(self) -> Any:
        """The swap engine checkpoint files are read and written through (one of its own)."""
        return self._swap_engine("checkpoint")

    def _disk_written(self) -> int:
        """Bytes every swap engine has written so far."""
        return sum(int(s["write"]["bytes"]) for s in self.io_stats().values())

    def io_stats(self) -> dict[str, Any]:
        """Each swap engine's counters, by state class ("params", "optimizer", "checkpoint")."""
        return {name: e.stats() for name, e in self._swap_engines.items()}

    def param_values(self, shard: FlatShard, out: Optional[torch.Tensor] = None) -> torch.Tensor:
        """A copy of a shard's values from its home (in the compute dtype), into ``out`` (a
        contiguous host tensor of the shard's elements and dtype) or a new buffer."""
        if out is not None and (out.numel(), out.dtype) != (shard.numel, shard.dtype):
            raise ValueError(f"shard {shard.index}: needs {shard.numel} {shard.dtype} elements, out has "
                             f"{out.numel()} {out.dtype}")
        buf = out if out is not None else aligned_empty(shard.numel, shard.dtype)
        self.param_swapper.read(shard.home, buf).wait()
        return buf

    def take_checkpoint_staging(self, nbytes: int) -> torch.Tensor:
        """A page-aligned host buffer of ``nbytes`` for a save's shard copies (``checkpoint.StagingRing``):
        the one the last background save gave back when it is large enough, else a new one. The
        save owns it until ``give_back_checkpoint_staging`` (a save beside it gets its own)."""
        with self._staging_lock:
            kept, self._checkpoint_staging = self._checkpoint_staging, None
        if kept is not None and kept.numel() >= nbytes:
            return kept[:nbytes]
        return aligned_empty(nbytes, torch.uint8)

    def kept_checkpoint_staging(self) -> int:
        """Bytes of the staging buffer kept from the last background save (0: none)."""
        with self._staging_lock:
            return 0 if self._checkpoint_staging is None else self._checkpoint_staging.numel()

    def give_back_checkpoint_staging(self, buf: torch.Tensor, keep: bool) -> None:
        """A save's staging once no write reads it: kept for the next save when ``keep`` (the layout
        charges ``pyinfinity.checkpoint_staging`` in host RAM), else freed."""
        with self._staging_lock:
            if keep and not self._closed and (self._checkpoint_staging is None
                                              or self._checkpoint_staging.numel() < buf.numel()):
                self._checkpoint_staging = buf

    def trained_values(self, shard: FlatShard) -> torch.Tensor:
        """A shard's trained values: its fp32 master when it has one, else its home's values."""
        self.quiesce("reading the trained values")
        st = self.optimizer.state_of(shard)
        if st is None:
            return self.param_values(shard)
        out = torch.empty(shard.numel, dtype=torch.float32)
        self.optimizer.master_values(shard, out)  # the fp32 master, in whatever format the state is kept
        return out

    def write_param(self, shard: FlatShard, master: torch.Tensor) -> Any:
        """New fp32 values of a shard, written home (``ParamHomes.write_param``); returns the request."""
        return self.homes.write_param(shard, master)

    def overwrite(self, changes: Sequence[tuple[nn.Parameter, torch.Tensor, torch.Tensor]]) -> int:
        """New values for some elements of parameters the engine holds, each ``(parameter, mask,
        values)`` (flat, the parameter's element count; ``values`` where ``mask`` is true are
        written): into the fp32 master of a trained parameter (its optimizer state, and the state's
        device copy; the moments and step count stay) and into the parameter home and resident
        copies, so training goes on from them. Elements not in ``mask`` keep the master's values
        (not the compute dtype's rounding of them). Returns the shards written."""
        self.check_open()
        self.check_not_in_pass("writing parameter values")
        self.quiesce("writing parameter values")
        by_shard: dict[int, tuple[FlatShard, list]] = {}
        for p, mask, values in changes:
            entry = self.partition.param_slice.get(id(p))
            if entry is None:
                raise ValueError("writing parameter values: a parameter this engine does not hold")
            sh, sl = entry
            if mask.numel() != sl.numel or values.numel() != sl.numel:
                raise ValueError(f"writing parameter values of {sl.name}: {mask.numel()} / {values.numel()} elements "
                                 f"given, it has {sl.numel}")
            if bool(mask.any()):
                by_shard.setdefault(sh.index, (sh, []))[1].append((sl, mask.reshape(-1).cpu(),
                                                                   values.detach().reshape(-1).cpu()))
        if not by_shard:
            return 0
        self.coordinator.release_all()

        def put(flat: torch.Tensor, items: list) -> None:
            for sl, mask, values in items:
                part = flat[sl.offset:sl.offset + sl.numel]
                part[mask] = values[mask].to(part.dtype)

        for sh, items in by_shard.values():
            st = self.optimizer.state_of(sh)
            if st is None:  # frozen: its home holds its only copy
                buf = self.param_values(sh)
                put(buf, items)
                self.param_swapper.write(sh.home, buf).wait()
                continue
            for _, flat in self.optimizer.iter_states(write_back=True, states=[st]):
                master = self.optimizer.format.master(flat, sh.numel)
                put(master, items)
                if st.dev is not None:  # the state's device copy, stepped there: the same layout
                    st.dev.copy_(flat)
                self.write_param(sh, master).wait()
        self.coordinator.refresh_persistent()
        return len(by_shard)

    # ------------------------------------------------------------------------- life
    @property
    def released(self) -> bool:
        """Whether the swap files are gone (close() ran, or construction failed)."""
        return self._finalizer is None or not self._finalizer.alive

    @staticmethod
    def _cleanup(param_swapper: TensorSwapper, optim_swapper: TensorSwapper, engines: dict,
                 ownership: Any = None, held: Optional[list] = None) -> None:
        for obj in reversed(held or []):  # the coordinator's hooks off the model, the optimizer's worker stopped
            try:
                obj.close()
            except Exception as exc:  # noqa: BLE001 - best effort: the swap files still go
                log.warning("closing %s: %r", type(obj).__name__, exc)
        for sw in (param_swapper, optim_swapper):
            try:
                sw.close()
            except Exception as exc:  # noqa: BLE001 - best effort at exit
                log.warning("closing %s swap: %s", sw.name, exc)
        for e in engines.values():
            try:
                e.close()
            except Exception as exc:  # noqa: BLE001
                log.warning("closing swap engine: %s", exc)
        if ownership is not None:
            ownership.release()  # manifest and lock (after the swap files)

    def close(self) -> None:
        """Removes the hooks, stops the optimizer's worker, frees device/pinned memory and removes
        the swap files. Idempotent."""
        if self.released:
            self._closed = True
            return
        self._closed = True
        self._checkpoint_staging = None
        coord = self.__dict__.get("coordinator")
        if coord is not None:
            try:
                coord.close()
            except Exception as exc:  # noqa: BLE001 - e.g. a failed read left a shard in flight:
                log.warning("closing the parameter coordinator: %r", exc)  # the swap files still go
        try:
            self.optimizer.close()  # stops the background step thread first
        except Exception as exc:  # noqa: BLE001 - the swap files still go
            log.warning("closing the optimizer: %r", exc)
        fin, self._finalizer = self._finalizer, None
        atexit.unregister(fin)
        fin()


__all__ = ["TrainingState"]
