"""pyinfinity's stand-ins for DeepSpeed's ``async_io`` and ``pin_memory`` ops behave as DeepSpeed
0.19.8's bindings do (method names, overloads, keyword names, return values, one process-wide
pinned-tensor registry), and size_nvme_offload() sizes DeepSpeed's swap knobs. In process; nothing
here imports deepspeed except the source comparison (which reads its files only)."""
from __future__ import annotations

import importlib.util
import logging
import os
from pathlib import Path
from typing import Any, Dict

import pytest
import torch

from pyinfinity.aio import LOCKED_TENSORS, AioHandle, PinHandle
from pyinfinity.integrations import deepspeed as pids

HIDDEN = 1024


def _ds_root() -> Path:
    spec = importlib.util.find_spec("deepspeed")
    if spec is None or not spec.origin:
        pytest.skip("deepspeed is not installed")
    return Path(spec.origin).parent


# -- the three differences found with DeepSpeed's own aio tests -------------------------------------
def test_free_of_a_foreign_tensor_returns_false_like_deepspeed() -> None:
    h = AioHandle()
    t = h.new_cpu_locked_tensor(1000, torch.empty(0, dtype=torch.float16))
    assert h.free_cpu_locked_tensor(torch.empty(10)) is False       # never allocated here
    assert h.free_cpu_locked_tensor(t[10:]) is False                 # a view: not an allocation's base
    assert h.free_cpu_locked_tensor(t) is True
    assert h.free_cpu_locked_tensor(t) is False                      # a second free


@pytest.mark.parametrize("method", ["async_pwrite", "sync_pwrite", "async_pread", "sync_pread"])
def test_descriptor_by_keyword_fd(tmp_path: Path, method: str) -> None:
    h = AioHandle(block_size=65536, queue_depth=4)
    t = torch.arange(10_000, dtype=torch.int32)
    path = tmp_path / "f.swp"
    if "pread" in method:
        path.write_bytes(t.numpy().tobytes())
        buf = torch.empty_like(t)
    else:
        buf = t
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        r = getattr(h, method)(buf, fd=fd, file_offset=0)
        done = h.wait() if method.startswith("async") else r
        assert (r, done) == ((0, 1) if method.startswith("async") else (1, 1))
    finally:
        os.close(fd)
    assert path.read_bytes() == t.numpy().tobytes() and torch.equal(buf, t)


def test_fd_and_filename_together_or_neither_is_an_error(tmp_path: Path) -> None:
    h = AioHandle()
    t = torch.zeros(16)
    with pytest.raises(TypeError, match="not both"):
        h.async_pwrite(t, str(tmp_path / "x"), fd=1)
    with pytest.raises(TypeError, match="missing the file"):
        h.async_pwrite(t)
    with pytest.raises(TypeError, match="fd: expected an int"):
        h.async_pwrite(t, fd="3")


def test_one_registry_behind_the_pin_op_and_every_aio_handle() -> None:
    pin, aio_a, aio_b = pids.pin_op.pin_handle(), pids.aio_op.aio_handle(), AioHandle()
    before = len(LOCKED_TENSORS)
    t = pin.new_cpu_locked_tensor(4096, torch.empty(0, dtype=torch.bfloat16))
    u = aio_a.new_cpu_locked_tensor(num_elem=100, example_tenosr=torch.empty(0))  # DeepSpeed's keyword (sic)
    assert t.dtype == torch.bfloat16 and t.numel() == 4096 and len(LOCKED_TENSORS) == before + 2
    for h in (pin, aio_a, aio_b):
        assert h.is_pinned(t) and h.is_pinned(t[100:200]) and h.is_pinned(u)
        assert not h.is_pinned(torch.empty(10))
    assert aio_b.free_cpu_locked_tensor(t) is True                   # the pin op's tensor, freed by an aio handle
    assert not pin.is_pinned(t) and pin.free_cpu_locked_tensor(locked_tensor=t) is False
    assert pin.free_cpu_locked_tensor_by_ptr(u.data_ptr()) is True    # an aio handle's, freed by address
    assert pin.free_cpu_locked_tensor_by_ptr(u.data_ptr()) is False
    assert len(LOCKED_TENSORS) == before


@pytest.mark.gpu
def test_torch_pinned_buffers_count_as_pinned() -> None:
    if not torch.cuda.is_available():
        pytest.skip("torch pins memory only with a CUDA device")
    assert AioHandle().is_pinned(torch.empty(10, pin_memory=True))


# -- the rest of the surface ----------------------------------------------------------------------------
def test_pread_pwrite_take_validate_and_async_as_deepspeed(tmp_path: Path) -> None:
    h = AioHandle()
    t = torch.arange(3000, dtype=torch.float32)
    p = str(tmp_path / "v")
    assert h.pwrite(t, p, False, False) == 1                          # sync: operations completed
    assert h.pwrite(buffer=t, filename=p, validate=True, **{"async": True}, file_offset=0) == 0
    assert h.wait() == 1
    u = torch.empty_like(t)
    assert h.pread(u, p, True, **{"async": False}) == 1 and torch.equal(t, u)
    with pytest.raises(TypeError, match=r"missing required arguments \['async'\]"):
        h.pread(u, p, True)
    with pytest.raises(TypeError, match="validate"):
        h.read(u, p)
    assert h.read(u, p, True) == 0 and h.write(t, p, False) == 0    # DeepSpeed's read/write return 0
    assert h.wait() == 0                                              # nothing pending


def test_constructor_keywords_and_getters() -> None:
    h = pids.aio_op.aio_handle(block_size=4096, queue_depth=2, single_submit=True, overlap_events=True,
                               intra_op_parallelism=2)
    assert (h.get_block_size(), h.get_queue_depth(), h.get_single_submit(), h.get_overlap_events(),
            h.get_intra_op_parallelism(), h.get_alignment()) == (4096, 2, True, True, 2, 1024)


def test_binding_surface_parser_reads_overloads_and_keywords() -> None:
    src = '''py::class_<x_t>(m, "x")
        .def(py::init<int>(), "a"_a = 1)
        .def("f", &x_t::f, "buffer"_a, "filename"_a, "file_offset"_a = 0)
        .def("f", &x_t::g, "buffer"_a, "fd"_a, "file_offset"_a = 0)
        .def("wait", &x_t::wait);'''
    assert pids.binding_surface(src, "x_t") == {"f": [["buffer", "filename", "file_offset"],
                                                       ["buffer", "fd", "file_offset"]], "wait": [[]]}
    assert pids.binding_surface(src, "y_t") is None

    class Lacking:
        def f(self, buffer: Any, filename: Any, file_offset: int = 0) -> None:
            pass

    problems = pids.surface_differences(pids.binding_surface(src, "x_t"), Lacking)
    assert any("does not take ['fd']" in p for p in problems) and any("lacks wait()" in p for p in problems)


@pytest.mark.parametrize("rel,cpp_class,attr", pids.BINDING_SOURCES)
def test_every_deepspeed_binding_is_accepted(rel: str, cpp_class: str, attr: str) -> None:
    """Every method, overload and keyword name DeepSpeed's installed pybind sources bind."""
    src = _ds_root() / rel
    if not src.is_file():
        pytest.skip(f"deepspeed's {rel} is not installed")
    surface = pids.binding_surface(src.read_text(), cpp_class)
    assert surface and "async_pwrite" in surface or attr == "pin_handle"
    op = pids.aio_op if attr == "aio_handle" else pids.pin_op
    assert pids.surface_differences(surface, getattr(op, attr)) == []
    if attr == "aio_handle":
        assert ["buffer", "fd", "file_offset"] in surface["async_pwrite"]  # the overload this fixed
    else:
        assert isinstance(op.pin_handle(), PinHandle)


# -- size_nvme_offload ---------------------------------------------------------------------------------
def _config(**param: Any) -> Dict[str, Any]:
    return {"bf16": {"enabled": True},
            "zero_optimization": {"stage": 3, "offload_param": {"device": "nvme", "nvme_path": "/x", **param},
                                  "offload_optimizer": {"device": "nvme", "nvme_path": "/x"}}}


def _mlp(layers: int = 4) -> torch.nn.Module:
    with torch.device("meta"):
        return torch.nn.Sequential(*[torch.nn.Linear(HIDDEN, HIDDEN, bias=False) for _ in range(layers)])


def test_sizing_resolves_absent_and_auto_and_logs(caplog: pytest.LogCaptureFixture) -> None:
    cfg = _config(buffer_size="auto")
    cfg["zero_optimization"]["stage3_max_live_parameters"] = "auto"
    with caplog.at_level(logging.INFO, logger="pyinfinity.integrations.deepspeed"):
        s = pids.size_nvme_offload(cfg, _mlp(), world_size=1)
    param, zero = s.config["zero_optimization"]["offload_param"], s.config["zero_optimization"]
    assert cfg["zero_optimization"]["offload_param"]["buffer_size"] == "auto"  # the input is not changed
    assert (s.swappable_partitions, s.largest_partition_numel) == (4, HIDDEN * HIDDEN)
    assert param["buffer_size"] == HIDDEN * HIDDEN and param["buffer_count"] == 5 and param["max_in_cpu"] == 10 ** 9
    # 5 buffers >= 4 partitions + a fetch's 2? no: 5 < 6, so the limits fit 3 partitions of 1M elements
    assert zero["stage3_max_reuse_distance"] == zero["stage3_max_live_parameters"] == 3 * HIDDEN * HIDDEN
    opt = zero["offload_optimizer"]  # pipelined (left out): 4 buffers x (current, next read, previous write)
    assert opt["pipeline_read"] is opt["pipeline_write"] is True and opt["buffer_count"] == 12
    assert zero["sub_group_size"] == 4 * HIDDEN * HIDDEN // 8
    assert all(isinstance(v, int) for v in (param["buffer_size"], param["buffer_count"], param["max_in_cpu"]))
    assert any("buffer_size: 'auto' -> 1048576" in c for c in s.changes)
    assert [r.getMessage() for r in caplog.records if "size_nvme_offload" in r.getMessage()] and len(s.changes) >= 5


def test_sizing_raises_a_too_small_buffer_size_and_fits_limits_to_few_buffers() -> None:
    s = pids.size_nvme_offload(_config(buffer_size=1000, buffer_count=3, max_in_cpu=0), _mlp(), world_size=2)
    param, zero = s.config["zero_optimization"]["offload_param"], s.config["zero_optimization"]
    assert s.largest_partition_numel == HIDDEN * HIDDEN // 2                   # per rank of 2
    assert param["buffer_size"] == HIDDEN * HIDDEN // 2 and param["buffer_count"] == 3 and param["max_in_cpu"] == 0
    assert zero["stage3_max_reuse_distance"] == HIDDEN * HIDDEN                # 1 partition x 2 ranks


def test_sizing_leaves_enough_buffers_alone_and_other_devices_untouched() -> None:
    s = pids.size_nvme_offload(_config(buffer_size=2e6, buffer_count=8, max_in_cpu=1e9), _mlp())
    zero = s.config["zero_optimization"]
    assert zero["offload_param"]["buffer_size"] == 2000000 and zero["offload_param"]["buffer_count"] == 8
    assert zero["stage3_max_reuse_distance"] == 10 ** 9                        # 8 buffers hold all 4 + a fetch
    cpu = {"zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"}}}
    assert pids.size_nvme_offload(cpu, _mlp()).config == cpu and not pids.size_nvme_offload(cpu, _mlp()).changes


def test_sizing_from_a_transformers_config_and_pinned_budget() -> None:
    transformers = pytest.importorskip("transformers")
    mc = transformers.LlamaConfig(vocab_size=4096, hidden_size=1024, intermediate_size=2048, num_hidden_layers=2,
                                  num_attention_heads=8, num_key_value_heads=8)
    s = pids.size_nvme_offload(_config(), mc, pinned_budget_bytes=40 << 20)
    param = s.config["zero_optimization"]["offload_param"]
    assert s.largest_partition_numel >= 4096 * 1024                            # the embedding
    assert param["buffer_count"] == (40 << 20) // (param["buffer_size"] * 2)


def test_sizing_rejects_a_non_number() -> None:
    with pytest.raises(ValueError, match="buffer_count"):
        pids.size_nvme_offload(_config(buffer_count="many"), _mlp())


def _optimizer_on_nvme(**opt: Any) -> Dict[str, Any]:
    return {"bf16": {"enabled": True},
            "zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"},
                                  "offload_optimizer": {"device": "nvme", "nvme_path": "/x", **opt}}}


def test_pipelined_sizing_pins_no_more_than_deepspeeds_plain_swapper_for_a_large_model() -> None:
    """8.6B parameters: an eighth would be over DeepSpeed's 1e9 sub-group, and 12 buffers of 1e9
    fp32 would pin 48 GB where the plain swapper pins 4 x 1e9 x 4 bytes = 16 GB: the sub-groups
    are made smaller instead."""
    with torch.device("meta"):
        big = torch.nn.Sequential(*[torch.nn.Linear(32768, 32768, bias=False) for _ in range(8)])
    s = pids.size_nvme_offload(_optimizer_on_nvme(), big, world_size=1)
    zero = s.config["zero_optimization"]
    count, sub = zero["offload_optimizer"]["buffer_count"], zero["sub_group_size"]
    assert count == 12 and sub == 4 * 10 ** 9 // 12
    assert count * sub * 4 <= 4 * 10 ** 9 * 4
    assert any("no more than DeepSpeed's plain swapper" in c for c in s.changes)


def test_sizing_turns_the_pipelined_optimizer_swapper_on_with_params_in_cpu_memory() -> None:
    s = pids.size_nvme_offload(_optimizer_on_nvme(), _mlp(16))
    zero = s.config["zero_optimization"]
    opt = zero["offload_optimizer"]
    assert opt["pipeline_read"] is opt["pipeline_write"] is True and opt["buffer_count"] == 12
    assert zero["sub_group_size"] == 2 * HIDDEN * HIDDEN and zero["offload_param"] == {"device": "cpu"}
    assert [c.split(":")[0] for c in s.changes] == ["offload_optimizer.pipeline_read", "offload_optimizer.pipeline_write",
                                                    "offload_optimizer.buffer_count", "zero_optimization.sub_group_size"]
    assert all("(" in c and c.endswith(")") for c in s.changes)  # each with its reason


def test_sizing_leaves_the_users_pipeline_choice_and_fits_its_buffers() -> None:
    off = pids.size_nvme_offload(_optimizer_on_nvme(pipeline_read=False), _mlp())
    opt = off.config["zero_optimization"]["offload_optimizer"]
    assert opt == {"device": "nvme", "nvme_path": "/x", "pipeline_read": False, "buffer_count": 4}
    assert "sub_group_size" not in off.config["zero_optimization"]
    # 4 buffers given: too few to pipeline, so it stays off and the count stays
    few = pids.size_nvme_offload(_optimizer_on_nvme(buffer_count=4), _mlp())
    assert few.config == _optimizer_on_nvme(buffer_count=4) and not few.changes
    # pipelining asked for with DeepSpeed's 4 buffers: DeepSpeed asserts, so the count is raised
    on = pids.size_nvme_offload(_optimizer_on_nvme(pipeline_read=True, buffer_count=4), _mlp())
    opt = on.config["zero_optimization"]["offload_optimizer"]
    assert opt["buffer_count"] == 8 and "pipeline_write" not in opt
    assert any("buffer_count: 4 -> 8 (below what DeepSpeed asserts on" in c for c in on.changes), on.changes
    given = pids.size_nvme_offload({**_optimizer_on_nvme(), "zero_optimization": {
        **_optimizer_on_nvme()["zero_optimization"], "sub_group_size": 1e7}}, _mlp())
    assert given.config["zero_optimization"]["sub_group_size"] == 1e7
