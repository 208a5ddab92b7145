"""The optimizer-state formats' loss parity (examples/optimizer_state_parity.py) at a CI size on the
CPU: the same model, data, seed and schedule with the fp32, 8bit and bf16 states and a second fp32
seed; the issue's CI targets checked on what was measured, and the checks shown to catch a format
that is silently fp32 or a run that does not learn."""
from __future__ import annotations

import copy
import importlib.util
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _example():
    spec = importlib.util.spec_from_file_location(
        "optimizer_state_parity", os.path.join(ROOT, "examples", "optimizer_state_parity.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def parity():
    ex = _example()
    opts = ex.parser().parse_args(["--steps", "40", "--seq", "64", "--batch", "8", "--last", "10", "--warmup", "5",
                                   "--corpus-bytes", "1MB", "--no-deepspeed"])
    lines: list[str] = []
    return ex, ex.run_parity(opts, lines.append), lines


def test_the_formats_train_to_fp32_s_loss_with_half_its_bytes(parity):
    ex, result, lines = parity
    runs = result["runs"]
    assert set(runs) == {"fp32", "8bit", "bf16", "fp32-seed1"} and result["skipped"] == {ex.DEEPSPEED_RUN: "--no-deepspeed"}
    assert all(len(r["losses"]) == 40 for r in runs.values())
    assert [runs[n]["format"] for n in ("fp32", "8bit", "bf16")] == ["fp32", "8bit", "bf16"]
    # the same model and data: the seed-0 runs start from one loss
    assert runs["fp32"]["losses"][0] == runs["8bit"]["losses"][0] == runs["bf16"]["losses"][0]
    assert runs["fp32-seed1"]["losses"][0] != runs["fp32"]["losses"][0]
    assert ex.target_failures(result) == []
    # the seed-0 runs see the same batches: paired, 8bit stays within the target's 2% floor however large
    # the seed-to-seed gap of a short run is
    assert abs(runs["8bit"]["gap_to_fp32"]) <= 0.02
    print("\n" + ex.table(result, 10))  # bf16's gap, reported (-s shows it)
    assert runs["bf16"]["optimizer_bytes"] <= 0.55 * runs["fp32"]["optimizer_bytes"]
    assert any(line.startswith("8bit: step 40/40") for line in lines)  # progress


def test_the_targets_catch_a_format_that_is_silently_fp32_or_a_run_that_does_not_learn(parity):
    ex, result, _ = parity
    silent = copy.deepcopy(result)
    silent["runs"]["8bit"]["optimizer_bytes"] = silent["runs"]["fp32"]["optimizer_bytes"]
    assert any("8bit's optimizer state" in f for f in ex.target_failures(silent))
    flat = copy.deepcopy(result)
    flat["runs"]["fp32"]["final_loss"] = 0.9 * flat["runs"]["fp32"]["first_loss"]
    assert any("less than 20%" in f for f in ex.target_failures(flat))
    off = copy.deepcopy(result)
    off["seed_gap"] = 0.005
    off["runs"]["8bit"]["gap_to_fp32"] = 0.03
    assert any("8bit's final loss is +3.00% off" in f for f in ex.target_failures(off))
    stuck = copy.deepcopy(result)
    stuck["runs"]["bf16"]["final_loss"] = stuck["runs"]["bf16"]["first_loss"]
    assert any("bf16's loss did not fall" in f for f in ex.target_failures(stuck))


def test_the_table_json_and_plot_of_a_result(parity, tmp_path):
    import json

    ex, result, _ = parity
    text = ex.table(result, 10)
    assert text.splitlines()[0].split()[:3] == ["run", "format", "seed"]
    assert [line.split()[0] for line in text.splitlines()[1:5]] == ["fp32", "8bit", "bf16", "fp32-seed1"]
    assert "fp32 seed-to-seed gap" in text and "skipped deepspeed-bf16: --no-deepspeed" in text
    assert json.loads(json.dumps(result))["runs"]["8bit"]["losses"] == result["runs"]["8bit"]["losses"]
    pytest.importorskip("matplotlib")
    ex.plot(result, str(tmp_path / "p.png"))
    assert (tmp_path / "p.png").stat().st_size > 10_000
