"""A shard's run-time state (``zero.partition.ShardRun``): its transitions, and that no module but
its own changes it."""
from __future__ import annotations

import ast
import os

import pytest
import torch

from pyinfinity.zero.partition import FlatShard, ParamSlice, ShardRun, ShardState

PKG = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "pyinfinity")


def _shard(trainable=(True, True), kept_resident=False) -> FlatShard:
    slices, offset = [], 0
    for i, t in enumerate(trainable):
        p = torch.nn.Parameter(torch.empty(0), requires_grad=t)
        slices.append(ParamSlice(f"p{i}", p, offset, 3, torch.Size([3]), torch.float32, t))
        offset += 3
    return FlatShard(index=0, module_name="m", dtype=torch.float32, slices=slices, numel=offset,
                     kept_resident=kept_resident)


def test_a_shard_moves_released_inflight_resident_released_and_nothing_else():
    sh = _shard()
    run = sh.run
    assert sh.state == ShardState.RELEASED and sh.buffer is None
    buf = torch.zeros(sh.numel)
    run.fetching(buf)
    assert sh.state == ShardState.INFLIGHT and sh.buffer is buf
    with pytest.raises(RuntimeError, match="from inflight: expected released"):
        run.fetching(buf)
    with pytest.raises(RuntimeError, match="from inflight: expected resident"):
        run.released()
    run.arrived()
    assert sh.state == ShardState.RESIDENT
    with pytest.raises(RuntimeError, match="from resident: expected inflight"):
        run.arrived()
    assert run.released() is buf
    assert sh.state == ShardState.RELEASED and sh.buffer is None


def test_a_units_gradient_is_summed_per_slice_and_complete_when_every_trainable_slice_arrived():
    sh = _shard(trainable=(True, False, True))
    run = sh.run
    assert run.n_trainable == 2 and run.grads_pending
    run.grad_arrived(0, torch.ones(3), None)
    run.grad_arrived(0, torch.ones(3), None)  # the same slice twice (a recompute): summed, counted once
    assert run.grads_pending
    run.grad_arrived(6, torch.full((3,), 2.0), None)
    assert not run.grads_pending
    g = run.take_grad()
    assert torch.equal(g, torch.tensor([2.0, 2, 2, 0, 0, 0, 2, 2, 2]))
    assert run.grad is None and run.grad_handed
    run.end_backward()
    assert run.grads_pending and not run.grad_handed


def test_the_flags_the_parts_read_change_only_through_named_transitions():
    sh = _shard(kept_resident=True)
    assert sh.persistent
    for name in ("state", "persistent", "buffer", "device_step", "grad_on_device"):
        with pytest.raises(AttributeError):
            setattr(sh, name, None)
    sh.run.stop_keeping_resident()
    sh.run.state_to_device()
    sh.run.accumulator_to_device()
    sh.run.home_awaits_step()
    assert not sh.persistent and sh.device_step and sh.grad_on_device and sh.run.home_stale
    sh.run.home_current()
    assert not sh.run.home_stale
    with pytest.raises(AttributeError):  # a misspelt flag is not silently added
        sh.run.home_dirty = True


def _run_state_writes(path: str) -> list[str]:
    """Assignments to a ShardRun field in a module: ``x.run.attr = ...`` (or ``+=``), or ``r.attr = ...``
    where ``r = x.run`` in the same function."""
    tree = ast.parse(open(path).read(), path)
    found = []

    def is_run(node: ast.AST, aliases: set) -> bool:
        return (isinstance(node, ast.Attribute) and node.attr == "run") or (
            isinstance(node, ast.Name) and node.id in aliases)

    for scope in [tree] + [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]:
        aliases = {t.id for n in ast.walk(scope) if isinstance(n, ast.Assign) and is_run(n.value, set())
                   for t in n.targets if isinstance(t, ast.Name)}
        for node in ast.walk(scope):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(
                node, (ast.AugAssign, ast.AnnAssign)) else []
            for t in targets:
                for sub in ast.walk(t):
                    if isinstance(sub, ast.Attribute) and sub.attr in ShardRun.__slots__ and is_run(sub.value, aliases):
                        found.append(f"{os.path.relpath(path, PKG)}:{sub.lineno} .run.{sub.attr}")
    return sorted(set(found))


def test_no_module_but_the_partition_sets_a_shards_run_time_state():
    writes = []
    for root, _, files in os.walk(PKG):
        for f in files:
            if f.endswith(".py") and os.path.join(root, f) != os.path.join(PKG, "zero", "partition.py"):
                writes += _run_state_writes(os.path.join(root, f))
    assert writes == []


def test_the_check_finds_a_planted_write(tmp_path):
    planted = tmp_path / "planted.py"
    planted.write_text("def f(sh):\n    sh.run.users += 1\n    r = sh.run\n    r.home_stale = False\n"
                       "    sh.users = 0\n")  # (not a ShardRun: a FlatShard has no such field)
    assert [w.split()[-1] for w in _run_state_writes(str(planted))] == [".run.users", ".run.home_stale"]
