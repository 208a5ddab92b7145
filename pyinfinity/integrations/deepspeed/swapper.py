"""DeepSpeed's parameter swapper made to keep training where ``offload_param.device: nvme`` stops
it, whatever the I/O backend, and one lock per rank on ``nvme_path`` so that a second job cannot
empty the first one's swap folders. Applied by ``install()`` (or :func:`patch_param_swapper`
alone), after checking the swapper's layout; undone by ``uninstall()``."""
from __future__ import annotations

import atexit
import importlib
import inspect
import logging
import os
import shutil
import threading
from typing import Any, Dict, List, Optional, Set, Tuple

from pyinfinity.integrations.deepspeed.layout import (SUPPORTED_SERIES, TESTED_VERSION, DeepSpeedLayoutError,
                                                      parse_version)
from pyinfinity.integrations.deepspeed.patching import install_method, original, restore, saved_method

log = logging.getLogger(__name__)

_lock = threading.RLock()  # the patch and the claims


# The buffer assertions (independent of the I/O backend).
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
_swapper_patch: Optional[List[Tuple[type, str, Any]]] = None  # (class, method, original or MISSING)
_protected = threading.local()  # ds_ids of the parameters the fetch in progress needs


class SwapBuffersExhausted(RuntimeError):
    """Every parameter swap buffer is held by a parameter in use; the message says what to raise."""


def check_swapper_layout(version: str) -> Tuple[type, type, type]:
    """The parameter swapper's class, ``Init`` and the optimizer swapper's base class, checked to
    have what the patch relies on; else DeepSpeedLayoutError naming every difference."""
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
_made: List[str] = []  # folders the claims created (the claim folders, a missing nvme_path), removed when empty
_swap_folders: Dict[str, str] = {}  # DeepSpeed's swap folder of this rank -> its nvme_path, removed at release
_exit_hook = False


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
    with _lock:
        if key in _claims and not _claims[key].released:
            return
        d = claim_dir(nvme_path, rank)
        from pyinfinity.swap.directories import make_swap_dir

        _made.extend(make_swap_dir(d, warn=False))
        _claims[key] = SwapOwnership.acquire([d])
        global _exit_hook
        if not _exit_hook:
            _exit_hook = True
            atexit.register(release_claims)
        log.info("pyinfinity: rank %d claimed %s", rank, d)


def _note_swap_folder(swapper: Any, nvme_path: Any) -> None:
    """Records a DeepSpeed swapper's folder (``zero_stage_3/<kind>/rank<N>`` under ``nvme_path``),
    which this rank's claim covers: its swap files are removed with the claim."""
    folder = getattr(swapper, "swap_folder", None)
    if folder and nvme_path:
        with _lock:
            _swap_folders[os.path.abspath(folder)] = os.path.abspath(os.fspath(nvme_path))


def release_claims() -> None:
    """Gives back every swap-folder claim of this process (also done at exit and by uninstall()):
    removes this rank's DeepSpeed swap folders (their files are of no use once the process ends:
    DeepSpeed empties them at its next start, and a checkpoint keeps its own copy), the folders
    the claims made, and says so when DeepSpeed swapped nothing through pyinfinity."""
    from pyinfinity.integrations.deepspeed.ops import stats
    from pyinfinity.swap.directories import remove_created_dirs

    with _lock:
        if _claims and not stats().writes:
            log.warning("pyinfinity: DeepSpeed wrote nothing to its swap folders under %s: every parameter "
                        "partition was below its swap threshold (max(1 MiB, aio.block_size) bytes) and no "
                        "optimizer state went to NVMe, so the run kept everything in memory",
                        ", ".join(sorted({p for p, _ in _claims})))
        for folder, root in _swap_folders.items():
            shutil.rmtree(folder, ignore_errors=True)
            parent = os.path.dirname(folder)
            while parent.startswith(root + os.sep):  # zero_stage_3/<kind>, zero_stage_3 when left empty
                try:
                    os.rmdir(parent)
                except OSError:
                    break
                parent = os.path.dirname(parent)
        _swap_folders.clear()
        for own in _claims.values():
            own.release()
        _claims.clear()
        remove_created_dirs(list(_made))
        _made.clear()


def patch_param_swapper(supported: Tuple[Tuple[int, int], ...] = SUPPORTED_SERIES) -> None:
    """Applies the parameter-swapper patch described above (idempotent; imports deepspeed).
    ``supported``: the DeepSpeed release series accepted."""
    global _swapper_patch
    with _lock:
        if _swapper_patch is not None:
            return
        import deepspeed

        version = getattr(deepspeed, "__version__", "<none>")
        parsed = parse_version(version)
        if parsed is None or parsed[:2] not in supported:
            raise DeepSpeedLayoutError(f"the parameter-swapper patch: deepspeed {version} is not a version it was "
                                       f"checked against ({TESTED_VERSION})")
        cls, init, opt = check_swapper_layout(version)
        targets = [(cls, "swap_in"), (cls, "swappable_tensor"), (init, "_ensure_availability_of_partitioned_params"),
                   (cls, "_configure_aio"), (opt, "__init__")]
        saved = [(c, m, saved_method(c, m)) for c, m in targets]
        orig_swap_in, orig_swappable, ensure, orig_configure, orig_opt_init = (original(c, m, o) for c, m, o in saved)

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
            nvme_path = ds_config.zero_config.offload_param.nvme_path
            _claim_swap_space(nvme_path)
            out = orig_configure(self, ds_config)
            _note_swap_folder(self, nvme_path)
            return out

        def optimizer_swapper_init(self: Any, swap_config: Any, *args: Any, **kwargs: Any) -> None:
            _claim_swap_space(getattr(swap_config, "nvme_path", None))
            orig_opt_init(self, swap_config, *args, **kwargs)
            _note_swap_folder(self, getattr(swap_config, "nvme_path", None))

        patched = {"swap_in": swap_in, "swappable_tensor": swappable_tensor,
                   "_ensure_availability_of_partitioned_params": ensure_availability,
                   "_configure_aio": configure_aio, "__init__": optimizer_swapper_init}
        for c, m, _ in saved:
            install_method(c, m, patched[m])
        _swapper_patch = saved
        log.info("pyinfinity: deepspeed %s parameter swapper patched (a fetch short of buffers takes back those of "
                 "gathered and prefetched partitions, repeated parameters are read once, oversized partitions stay "
                 "in CPU memory, each rank claims its nvme_path)", version)


def unpatch_param_swapper() -> None:
    """Puts DeepSpeed's own parameter swapper back (idempotent); the claims stay (release_claims)."""
    global _swapper_patch
    with _lock:
        if _swapper_patch is not None:
            for c, m, orig in _swapper_patch:
                restore(c, m, orig)
            _swapper_patch = None


def fix_nvme_prefetch() -> None:
    """Applies the parameter-swapper patch on its own (install() applies it too). Kept for
    scripts written before install() did; idempotent; imports deepspeed."""
