"""Pretrained weights streamed from a safetensors checkpoint straight into the engine's tiers.

``WeightLoader`` is the engine's materializer: the partitioner calls it once per module, just
before flattening that module's parameters, and it gives the module's meta parameters real CPU
storage holding the checkpoint's values (read tensor by tensor through ``safetensors.safe_open``,
converted to the parameter's dtype). Only the files holding that module's tensors are mapped, and
only while it is read, so host memory holds about one module's weights at a time.

Everything that can be checked without reading tensor data (files present and complete, names,
shapes, missing and unexpected keys) is checked when the loader is built, before the engine
writes anything to its swap directories. ``build_empty_model(path)`` builds the architecture
from a model directory's ``config.json`` (transformers, local files only) without materialising
it; ``pyinfinity.from_pretrained`` (in ``engine``, above this module) builds and loads it.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import errno
import json
import logging
import math
import os
import re
import shutil
import struct
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Union

import torch
from torch import nn

log = logging.getLogger(__name__)

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
# files that make a directory loadable by transformers' AutoTokenizer (copied by export)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                   "vocab.json", "merges.txt", "vocab.txt", "added_tokens.json", "generation_config.json",
                   "spiece.model", "sentencepiece.bpe.model")

IDENTITY_SAMPLE = 1 << 20  # bytes of each safetensors file a version-3 checkpoint's base identity sampled

_ST_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
              "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
              "BOOL": torch.bool}


def _malloc_trim() -> Callable[[], None]:
    """glibc's ``malloc_trim(0)``: hands the heap's free pages back to the OS. Without it, freed
    module-sized buffers below glibc's (adaptive, up to 32 MiB) mmap threshold stay in the RSS and
    a load's RSS grows with the checkpoint. A no-op off glibc."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        trim = libc.malloc_trim
    except (OSError, AttributeError):
        return lambda: None
    trim.argtypes = [ctypes.c_size_t]

    def run() -> None:
        trim(0)  # returns whether memory was released: either way there is nothing to do

    return run


class WeightsError(ValueError):
    """A checkpoint that cannot be loaded into the model (the message names the file and key)."""


@dataclass(frozen=True)
class TensorInfo:
    """One tensor of a safetensors file, from its header (no data read)."""

    file: str  # absolute path
    key: str
    dtype: torch.dtype
    shape: tuple[int, ...]


def read_header(path: str) -> dict[str, TensorInfo]:
    """Parses a safetensors file's header and checks it whole before anything is read or written:
    every entry's dtype and shape, its byte range the size that dtype and shape need, the ranges
    in order without gaps or overlaps, and the file exactly as long as the header says (a
    truncated download, an edited header or bytes appended fail here, naming the file and key)."""
    try:
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            raw = f.read(8)
            if len(raw) < 8:
                raise WeightsError(f"{path}: {size} bytes, too short for a safetensors header (truncated?)")
            (n,) = struct.unpack("<Q", raw)
            if n > size - 8:
                raise WeightsError(f"{path}: header claims {n} bytes but the file has {size} (truncated?)")
            header = json.loads(f.read(n))
    except FileNotFoundError:
        raise
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise WeightsError(f"{path}: not a safetensors file (its header is not JSON: {exc})") from exc
    if not isinstance(header, dict):
        raise WeightsError(f"{path}: not a safetensors file (its header is a JSON {type(header).__name__}, not an object)")
    out: dict[str, TensorInfo] = {}
    spans: list[tuple[int, int, str]] = []
    for key, meta in header.items():
        if key == "__metadata__":
            continue
        try:
            dtype = _ST_DTYPES[meta["dtype"]]
            shape = tuple(_nonneg_int(s) for s in meta["shape"])
            lo, hi = (_nonneg_int(v) for v in meta["data_offsets"])
        except (KeyError, TypeError, ValueError) as exc:
            raise WeightsError(f"{path}: tensor {key!r} has an unreadable header entry {meta!r}") from exc
        need = math.prod(shape) * dtype.itemsize
        if hi - lo != need:
            raise WeightsError(f"{path}: tensor {key!r} ({meta['dtype']}, shape {list(shape)}) needs {need} bytes, its "
                               f"data_offsets [{lo}, {hi}) hold {hi - lo}: the header was changed or the file is damaged")
        spans.append((lo, hi, key))
        out[key] = TensorInfo(path, key, dtype, shape)
    end = 0
    for lo, hi, key in sorted(spans):
        if lo != end:
            what = f"overlaps the tensor before it (which ends at {end})" if lo < end else f"leaves bytes [{end}, {lo}) unused"
            raise WeightsError(f"{path}: tensor {key!r}: data_offsets [{lo}, {hi}) {what}: the header was changed or "
                               "the file is damaged")
        end = hi
    if 8 + n + end > size:
        raise WeightsError(f"{path}: the header describes {8 + n + end} bytes but the file has {size} "
                           "(truncated: copy or download it again)")
    if 8 + n + end < size:
        raise WeightsError(f"{path}: the file has {size} bytes, {size - 8 - n - end} more than the {8 + n + end} its "
                           "header describes (bytes appended, or the header was changed): copy or download it again")
    return out


def _nonneg_int(v: Any) -> int:
    if not isinstance(v, int) or isinstance(v, bool) or v < 0:
        raise ValueError(f"{v!r} is not an integer >= 0")
    return v


def checkpoint_tensors(path: Union[str, os.PathLike]) -> dict[str, TensorInfo]:
    """Every tensor of a checkpoint: a ``.safetensors`` file, or a directory with
    ``model.safetensors`` or a sharded ``model.safetensors.index.json``."""
    path = os.path.abspath(os.fspath(path))
    if os.path.isfile(path):
        return read_header(path)
    if not os.path.isdir(path):
        raise FileNotFoundError(f"weights: {path} does not exist")
    index = os.path.join(path, INDEX_FILE)
    if os.path.exists(index):
        try:
            with open(index) as f:
                weight_map = json.load(f)["weight_map"]
        except (OSError, json.JSONDecodeError, KeyError, TypeError) as exc:
            raise WeightsError(f"{index}: not a safetensors index (needs a 'weight_map' object): {exc}") from exc
        if not isinstance(weight_map, dict):
            raise WeightsError(f"{index}: 'weight_map' must map tensor names to file names, got "
                               f"{type(weight_map).__name__}")
        files: dict[str, list[str]] = {}
        for key, fname in weight_map.items():
            if not isinstance(fname, str) or not fname or os.path.basename(fname) != fname:
                raise WeightsError(f"{index}: weight_map[{key!r}] is {fname!r}, not the name of a file in {path}")
            files.setdefault(fname, []).append(key)
        out: dict[str, TensorInfo] = {}
        holder: dict[str, str] = {}  # every tensor of every shard -> its file (one copy each)
        for fname, keys in files.items():
            fpath = os.path.join(path, fname)
            if not os.path.exists(fpath):
                raise FileNotFoundError(errno.ENOENT, f"{fpath}: missing shard of {index} (it holds {len(keys)} "
                                        f"tensors, e.g. {keys[0]!r}); copy the whole checkpoint directory", fpath)
            tensors = read_header(fpath)
            for key in tensors:
                if key in holder:  # loaders disagree on which copy wins: refuse rather than pick one
                    raise WeightsError(f"{path}: tensor {key!r} is in two shards, {holder[key]} and {fname} "
                                       f"({index} names {weight_map.get(key)!r}); remove one copy")
                holder[key] = fname
            for key in keys:
                if key not in tensors:
                    raise WeightsError(f"{index} maps {key!r} to {fname}, which has no such tensor")
                out[key] = tensors[key]
        return out
    single = os.path.join(path, SINGLE_FILE)
    if os.path.exists(single):
        return read_header(single)
    found = sorted(f for f in os.listdir(path) if f.endswith((".bin", ".pt", ".pth", ".safetensors")))
    shards = [f for f in found if f.endswith(".safetensors")]
    raise FileNotFoundError(errno.ENOENT, f"weights: no {SINGLE_FILE} or {INDEX_FILE} in {path}"
                            + (f" (found the shards {shards} without their index: copy {INDEX_FILE} too)" if shards
                               else f" (found {found}; pyinfinity reads safetensors only: save the model with "
                               "save_pretrained(..., safe_serialization=True))" if found else ""), path)


@dataclass
class LoadReport:
    """What a load did with the checkpoint's keys, as transformers' ``from_pretrained`` reports it."""

    missing: list[str] = field(default_factory=list)  # model keys absent from the file (newly initialised)
    unexpected: list[str] = field(default_factory=list)  # file keys the model has no use for
    loaded: int = 0  # tensors read so far
    bytes_read: int = 0


def _same_values(a: TensorInfo, b: TensorInfo, chunk_bytes: int = 64 << 20) -> bool:
    """Whether two tensors of a checkpoint hold the same values (read a slice at a time)."""
    from safetensors import safe_open

    if a.shape != b.shape:
        return False
    if not a.shape:
        rows, per_row = 1, 1
    else:
        rows, per_row = a.shape[0], max(1, math.prod(a.shape[1:]) * max(a.dtype.itemsize, b.dtype.itemsize))
    step = max(1, chunk_bytes // per_row)
    with safe_open(a.file, framework="pt", device="cpu") as fa, safe_open(b.file, framework="pt", device="cpu") as fb:
        if not a.shape:
            return torch.equal(fa.get_tensor(a.key).double(), fb.get_tensor(b.key).double())
        sa, sb = fa.get_slice(a.key), fb.get_slice(b.key)
        for r in range(0, rows, step):
            x, y = sa[r:r + step], sb[r:r + step]
            if not torch.equal(x.double() if x.dtype != y.dtype else x, y.double() if x.dtype != y.dtype else y):
                return False
    return True


def _tensor_crc32c(t: torch.Tensor) -> int:
    """CRC-32C of a CPU tensor's bytes (the C++ core's, hardware-accelerated where the CPU has it)."""
    from pyinfinity import _C

    if t.numel() == 0:
        return 0
    return int(_C.crc32c(t.contiguous().reshape(-1).view(torch.uint8).numpy()))


def _has_initializer(module: nn.Module, root: Optional[nn.Module]) -> bool:
    return callable(getattr(module, "reset_parameters", None)) or (
        root is not None and callable(getattr(root, "_init_weights", None)))


def _ignored(key: str, patterns: Optional[list[str]]) -> bool:
    return any(re.search(p, key) for p in patterns or [])


class WeightLoader:
    """Materialiser for ``partition_model`` that fills each module's parameters (and persistent
    buffers) from a safetensors checkpoint; see the module docstring."""

    def __init__(self, path: Union[str, os.PathLike], model: nn.Module,
                 key_map: Optional[dict[str, Optional[str]]] = None) -> None:
        """``key_map``: state-dict keys of ``model`` that the checkpoint names otherwise -> its
        name, or None for a tensor the checkpoint does not hold and that keeps its values (the
        LoRA weights and wrapper names of a base model PEFT has wrapped, ``adapters.checkpoint_keys``)."""
        self.path = os.path.abspath(os.fspath(path))
        self.key_map = dict(key_map or {})
        self.tensors = checkpoint_tensors(self.path)
        self.report = LoadReport()
        self._source: dict[int, TensorInfo] = {}  # id(param) -> where its values are
        self._buffer_source: dict[str, TensorInfo] = {}  # qualified buffer name -> where its values are
        self._missing_params: set[int] = set()
        self._loaded: set[int] = set()
        self.checksums: dict[str, int] = {}  # file key -> CRC-32C of the tensor's bytes, taken as it is read
        self._trim = _malloc_trim()
        # module -> qualified name in ``model`` (buffers are named from here: the engine may be given a
        # model that wraps this one, e.g. a PEFT model over the base the checkpoint belongs to)
        self._names = {id(m): n for n, m in model.named_modules()}
        self._check(model)

    def alias(self, param: nn.Parameter, like: nn.Parameter) -> None:
        """``param`` (one the checkpoint was not checked against, e.g. PEFT's trained copy of a
        module) is read from the tensor ``like`` is read from."""
        info = self._source.get(id(like))
        if info is None:
            raise WeightsError(f"{self.path}: no tensor in the checkpoint for the parameter a {tuple(param.shape)} "
                               "copy was made of")
        self._source[id(param)] = info

    @property
    def complete(self) -> bool:
        """Whether every parameter of the model starts from the checkpoint (none newly initialised):
        then its frozen parameters can be read from the checkpoint again instead of being saved."""
        return not self._missing_params

    def identity(self) -> dict:
        """What identifies the checkpoint: its config.json (when the path is a model directory),
        every safetensors file it reads by name, size and the CRC-32 of its first
        ``IDENTITY_SAMPLE`` bytes (what a version-3 checkpoint recorded), and under ``tensors``
        the CRC-32C of every byte of every tensor read, taken while the load streamed it in (so a
        later load compares without reading the checkpoint again)."""
        import zlib

        files = sorted({info.file for info in self.tensors.values()})
        out: dict[str, Any] = {"files": {}}
        for fpath in files:
            with open(fpath, "rb") as f:
                head = f.read(IDENTITY_SAMPLE)
            out["files"][os.path.basename(fpath)] = {"nbytes": os.path.getsize(fpath), "crc32": zlib.crc32(head)}
        out["tensors"] = dict(sorted(self.checksums.items()))
        cfg = os.path.join(self.path, "config.json")
        if os.path.isfile(cfg):
            with open(cfg) as f:
                out["config"] = json.load(f)
        return out

    # -- names and shapes, checked before anything is written ----------------------------------
    def _file_key(self, key: str, prefix: str) -> Optional[str]:
        key = self.key_map.get(key) or key
        if key in self.tensors:
            return key
        if prefix and key.startswith(prefix + ".") and key[len(prefix) + 1:] in self.tensors:
            return key[len(prefix) + 1:]  # a base-model checkpoint (e.g. GPT-2's "h.0..." without "transformer.")
        return None

    def _check(self, model: nn.Module) -> None:
        prefix = getattr(model, "base_model_prefix", "") or ""
        keys_by_param: dict[int, list[str]] = {}
        params: dict[int, torch.Tensor] = {}
        buffers: dict[str, torch.Tensor] = {}
        for key, val in model.state_dict(keep_vars=True).items():
            if key in self.key_map and self.key_map[key] is None:
                continue  # not the checkpoint's (an adapter): keeps its values
            if isinstance(val, nn.Parameter):
                keys_by_param.setdefault(id(val), []).append(key)
                params[id(val)] = val
            else:
                buffers[key] = val
        owners = {id(p): (m, mn) for mn, m in model.named_modules() for p in m._parameters.values()
                  if p is not None}
        used: set[str] = set()
        missing: list[str] = []
        ignore_missing = getattr(model, "_keys_to_ignore_on_load_missing", None)
        ignore_unexpected = getattr(model, "_keys_to_ignore_on_load_unexpected", None)
        for pid, keys in keys_by_param.items():
            found = [(k, fk) for k in keys if (fk := self._file_key(k, prefix)) is not None]
            used.update(fk for _, fk in found)
            p = params[pid]
            if not found:
                module, mname = owners[pid]
                if p.is_meta and not _has_initializer(module, model):
                    raise WeightsError(f"{self.path}: no tensor {keys[0]!r} in the checkpoint, and "
                                       f"{type(module).__name__} ({mname or '<root>'}) has no initializer to "
                                       "start it from; check that the checkpoint belongs to this architecture")
                self._missing_params.add(pid)
                missing.extend(k for k in keys if not _ignored(k, ignore_missing))
                continue
            key, fkey = found[0]
            info = self.tensors[fkey]
            self._check_shape(info, key, tuple(p.shape))
            self._check_dtype(info, p.dtype)
            for other_key, other in found[1:]:  # tied: every copy must at least have the right shape
                self._check_shape(self.tensors[other], other_key, tuple(p.shape))
                if other != fkey and not _same_values(info, self.tensors[other]):
                    self._untie(model, other_key, self.tensors[other], key, p)
            self._source[pid] = info
        for key, b in buffers.items():
            fkey = self._file_key(key, prefix)
            if fkey is None:
                if not _ignored(key, ignore_missing):
                    missing.append(key)
                continue
            used.add(fkey)
            info = self.tensors[fkey]
            self._check_shape(info, key, tuple(b.shape))
            self._buffer_source[key] = info
        if len(self._missing_params) > len(self._source):  # transformers would warn and train mostly noise
            example = next(keys_by_param[pid][0] for pid in keys_by_param if pid in self._missing_params)
            raise WeightsError(f"{self.path}: {len(self._missing_params)} of the {len(keys_by_param)} parameters of "
                               f"{type(model).__name__} (e.g. {example!r}) are not in the checkpoint, whose tensors are "
                               f"named like {next(iter(self.tensors))!r}: the config describes another architecture "
                               "than these weights")
        unexpected = [k for k in self.tensors if k not in used and not _ignored(k, ignore_unexpected)]
        self.report.missing, self.report.unexpected = sorted(missing), sorted(unexpected)
        name = type(model).__name__
        if unexpected:
            log.warning("Some weights of the checkpoint at %s were not used when initializing %s: %s\n"
                        "- expected when the checkpoint was saved from another architecture or task; not "
                        "expected if it should match this model exactly", self.path, name, self.report.unexpected)
        if missing:
            log.warning("Some weights of %s were not initialized from the checkpoint at %s and are newly "
                        "initialized: %s\nYou should probably train this model before using it.", name, self.path,
                        self.report.missing)

    def _untie(self, model: nn.Module, key: str, info: TensorInfo, source_key: str, p: torch.Tensor) -> None:
        """The model ties ``key`` to ``source_key`` but the checkpoint holds both with different
        values: as transformers does, warn and do not tie (``key`` gets its own parameter, loaded
        from its own tensor ``info``)."""
        log.warning("The tied weights mapping and config for this model specifies to tie %s to %s, but both are "
                    "present in the checkpoint at %s with different values, so they are NOT tied. Update the config "
                    "with `tie_word_embeddings=False` to silence this warning.", source_key, key, self.path)
        mname, _, attr = key.rpartition(".")
        module = model.get_submodule(mname)
        own = torch.empty(p.shape, dtype=p.dtype, device="meta") if p.is_meta else p.detach().clone()
        new = nn.Parameter(own, requires_grad=p.requires_grad)
        setattr(module, attr, new)
        tied = getattr(model, "all_tied_weights_keys", None)  # transformers 5: what it would tie again
        if isinstance(tied, dict):
            tied.pop(key, None)
        self._source[id(new)] = info

    def _check_shape(self, info: TensorInfo, key: str, want: tuple[int, ...]) -> None:
        if info.shape != want:
            theirs = "" if key == info.key else f" {key!r}"
            raise WeightsError(f"{info.file}: tensor {info.key!r} has shape {list(info.shape)} but the model's"
                               f"{theirs} is {list(want)}: the config does not match these weights (wrong "
                               "config.json, or weights of another model size)")

    @staticmethod
    def _check_dtype(info: TensorInfo, want: torch.dtype) -> None:
        if want.is_floating_point != info.dtype.is_floating_point:
            raise WeightsError(f"{info.file}: tensor {info.key!r} is {info.dtype}, the model's parameter is {want}")

    # -- the materializer --------------------------------------------------------------------
    def __call__(self, module: nn.Module, root: Optional[nn.Module],
                 replaced: Optional[dict[int, nn.Parameter]] = None) -> None:
        """Gives ``module``'s own parameters real CPU storage holding the checkpoint's values and
        loads its persistent buffers; tied parameters go through ``replaced`` as in
        ``materialize_module``."""
        from pyinfinity.zero.partition import materialize_module

        replaced = {} if replaced is None else replaced
        own = [(n, p) for n, p in module._parameters.items() if p is not None]
        if any(id(p) in self._missing_params and p.is_meta and id(p) not in replaced for _, p in own):
            materialize_module(module, root, replaced)  # the module's own initializer for what the file lacks
        todo: list[tuple[str, nn.Parameter, TensorInfo]] = []
        for name, p in own:
            if id(p) in replaced:  # tied (or just initialised above)
                new = replaced[id(p)]
                module._parameters[name] = new
                if id(p) in self._source and id(p) not in self._loaded:
                    todo.append((name, new, self._source[id(p)]))
                    self._loaded.add(id(p))
                continue
            info = self._source.get(id(p))
            if info is None or id(p) in self._loaded:  # not in the file (keeps its values), or tied and done
                continue
            self._loaded.add(id(p))
            if p.is_meta:
                new = nn.Parameter(torch.empty(p.shape, dtype=p.dtype, device="cpu"), requires_grad=p.requires_grad)
                replaced[id(p)] = new
                module._parameters[name] = new
                todo.append((name, new, info))
            else:
                todo.append((name, p, info))
        mname = self._names.get(id(module), "")
        bufs = []
        for bname, b in module._buffers.items():
            info = self._buffer_source.get(f"{mname}.{bname}" if mname else bname)
            if b is not None and info is not None:
                bufs.append((b, info))
        if todo or bufs:
            self._trim()  # the previous module's buffers, freed after it was placed
            self._read(todo, bufs)

    def _read(self, params: list[tuple[str, nn.Parameter, TensorInfo]],
              buffers: list[tuple[torch.Tensor, TensorInfo]]) -> None:
        from safetensors import SafetensorError, safe_open

        by_file: dict[str, list[tuple[torch.Tensor, TensorInfo]]] = {}
        for _, p, info in params:
            by_file.setdefault(info.file, []).append((p.data, info))
        for b, info in buffers:
            by_file.setdefault(info.file, []).append((b, info))
        for fpath, items in by_file.items():
            try:  # mapped only while this module is read: its pages leave the RSS when closed
                with safe_open(fpath, framework="pt", device="cpu") as f, torch.no_grad():
                    for dst, info in items:
                        src = f.get_tensor(info.key)
                        if info.key not in self.checksums:  # every byte, as read (the base's identity)
                            self.checksums[info.key] = _tensor_crc32c(src)
                        dst.copy_(src.to(dst.device))  # a copy: nothing keeps the mapping alive
                        self.report.loaded += 1
                        self.report.bytes_read += src.numel() * src.element_size()
                        del src
            except (SafetensorError, OSError, RuntimeError) as exc:
                raise WeightsError(f"{fpath}: reading {items[0][1].key!r} failed: {exc}") from exc


def copy_tokenizer_files(src: Union[str, os.PathLike], dst: Union[str, os.PathLike]) -> list[str]:
    """Copies the tokenizer (and generation config) files of model directory ``src`` into ``dst``."""
    src, dst = os.fspath(src), os.fspath(dst)
    if not os.path.isdir(src):
        return []
    out = []
    for name in TOKENIZER_FILES:
        s = os.path.join(src, name)
        if os.path.isfile(s):
            d = os.path.join(dst, name)
            shutil.copyfile(s, d)
            out.append(d)
    return out


def build_empty_model(path: Union[str, os.PathLike], config: Any = None,
                      dtype: Optional[torch.dtype] = None) -> nn.Module:
    """The architecture of the transformers model directory ``path`` (its config.json), built
    under ``init_empty`` (no weights materialised). Nothing is downloaded."""
    import transformers
    from transformers import AutoConfig, AutoModelForCausalLM

    from pyinfinity.zero.partition import init_empty

    path = os.fspath(path)
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise FileNotFoundError(f"{path}: no config.json (a transformers model directory is needed; save one "
                                "with model.save_pretrained(DIR))")
    try:
        mcfg = AutoConfig.from_pretrained(path, local_files_only=True)
    except (ValueError, OSError) as exc:
        raise WeightsError(f"{os.path.join(path, 'config.json')}: {exc}") from exc
    kw = {}
    if dtype is not None:  # transformers 5 renamed from_config's torch_dtype to dtype
        kw["dtype" if int(transformers.__version__.split(".")[0]) >= 5 else "torch_dtype"] = dtype
    with init_empty(config):
        return AutoModelForCausalLM.from_config(mcfg, **kw)


def checkpoint_dtype(path: Union[str, os.PathLike]) -> Optional[torch.dtype]:
    """The dtype a model directory's config.json says its weights are in (``torch_dtype``, or
    ``dtype`` in newer transformers), or None when it says none."""
    try:
        with open(os.path.join(os.fspath(path), "config.json")) as f:
            cfg = json.load(f)
    except (OSError, json.JSONDecodeError):
        return None
    name = cfg.get("dtype") or cfg.get("torch_dtype")
    dtype = getattr(torch, name, None) if isinstance(name, str) else None
    return dtype if isinstance(dtype, torch.dtype) else None
