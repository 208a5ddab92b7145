"""DeepSpeed ZeRO-3 on two ranks (gloo, DeepSpeed's CPU accelerator) with parameters and optimizer
states on NVMe through pyinfinity, both ranks sharing one ``nvme_path``: each rank's swap files are
its own, the ranks of one job each hold their claim on the folder while a second job pointed at it is
refused, and the losses equal the same two-rank run with offload to CPU.

The ranks are separate interpreters (the training worker of test_deepspeed_integration.py), with
bounded timeouts: a hung rank is killed and reported, never waited for.
"""
from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Dict, List

import pytest

from tests.python import test_deepspeed_integration as ds

WORLD = 2
TIMEOUT_S = 180
STEPS = 3  # enough for the loss to move twice; the ranks share 2 cores in CI


def start_job(tmp: Path, name: str, world: int, nvme: Path, **cfg: Any) -> List[subprocess.Popen]:
    """One DeepSpeed job of `world` ranks (one process each) on the shared folder `nvme`."""
    d = tmp / name
    d.mkdir(parents=True)
    nvme.mkdir(parents=True, exist_ok=True)
    spec = {"backend": "pyinfinity", "offload": "nvme", "pipeline_read": False, "pipeline_write": False,
            "fast_init": False, "via": "install", "steps": ds.STEPS, "model": "mlp", **cfg,
            "nvme": str(nvme), "out": str(d / "result.json")}
    (d / "cfg.json").write_text(json.dumps(spec))
    port = str(ds._free_port())
    procs = []
    for rank in range(world):
        env = ds._env({"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world),
                       "LOCAL_SIZE": str(world), "MASTER_PORT": port})
        with open(d / f"log.rank{rank}.txt", "w") as log:
            procs.append(subprocess.Popen([sys.executable, ds.__file__, "--worker", str(d / "cfg.json")],
                                          cwd=str(ds.ROOT), env=env, stdout=log, stderr=subprocess.STDOUT))
    return procs


def finish_job(procs: List[subprocess.Popen], tmp: Path, name: str, timeout: float = TIMEOUT_S) -> Dict[str, Any]:
    """{"ranks": [result per rank]} or {"error": logs}; every process is gone on return."""
    d, deadline, codes = tmp / name, time.monotonic() + timeout, []
    for p in procs:
        try:
            codes.append(p.wait(timeout=max(1.0, deadline - time.monotonic())))
        except subprocess.TimeoutExpired:
            codes.append("timeout")
    for p in procs:  # a rank left waiting on a dead peer
        if p.poll() is None:
            p.kill()
            p.wait()
    if any(c != 0 for c in codes):
        logs = "\n".join(f"--- rank {r} ({c}):\n{(d / f'log.rank{r}.txt').read_text()[-4000:]}"
                         for r, c in enumerate(codes))
        return {"error": logs}
    return {"ranks": [json.loads((d / f"result.rank{r}.json").read_text()) for r in range(len(procs))]}


def wait_for(path: Path, procs: List[subprocess.Popen], timeout: float = TIMEOUT_S) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        if time.monotonic() > deadline or any(p.poll() not in (None, 0) for p in procs):
            return
        time.sleep(0.1)


@pytest.fixture(scope="module")
def jobs(tmp_path_factory: pytest.TempPathFactory, ds_importable: None) -> Dict[str, Dict[str, Any]]:
    tmp = tmp_path_factory.mktemp("ranks")
    shared = tmp / "shared_nvme"
    release = tmp / "release"
    out: Dict[str, Dict[str, Any]] = {}
    nvme = start_job(tmp, "nvme", WORLD, shared, steps=STEPS, hold_until=str(release))
    try:
        wait_for(tmp / "nvme" / f"result.rank{WORLD - 1}.json", nvme)
        wait_for(tmp / "nvme" / "result.rank0.json", nvme)
        # a second job on the same folder while the first holds it (it must not start)
        out["second"] = finish_job(start_job(tmp, "second", 1, shared), tmp, "second", timeout=120)
    finally:
        release.touch()
        out["nvme"] = finish_job(nvme, tmp, "nvme")
    out["cpu"] = finish_job(start_job(tmp, "cpu", WORLD, tmp / "shared_cpu", backend="deepspeed", offload="cpu", steps=STEPS),
                            tmp, "cpu")
    out["nvme_path"] = {"path": str(shared)}
    return out


@pytest.fixture(scope="module")
def ds_importable() -> None:
    r = ds.run_snippet("import deepspeed")
    if r.returncode != 0:
        pytest.skip(f"deepspeed is not importable: {r.stderr.strip().splitlines()[-1:]}")


def ranks(jobs: Dict[str, Dict[str, Any]], name: str) -> List[Dict[str, Any]]:
    if "error" in jobs[name]:
        pytest.fail(jobs[name]["error"])
    return jobs[name]["ranks"]


def test_losses_equal_the_two_rank_cpu_offload_run(jobs: Dict[str, Dict[str, Any]]) -> None:
    nvme, cpu = ranks(jobs, "nvme"), ranks(jobs, "cpu")
    assert len(set(cpu[0]["losses"])) == STEPS
    for rank in range(WORLD):
        assert nvme[rank]["losses"] == cpu[rank]["losses"], rank  # float.hex: every bit


def test_each_rank_swaps_its_own_files_through_pyinfinity(jobs: Dict[str, Dict[str, Any]]) -> None:
    nvme = ranks(jobs, "nvme")
    written = [set(r["stats"]["files_written"]) for r in nvme]
    assert written[0] and written[1] and not written[0] & written[1]  # no file written by both ranks
    for rank, r in enumerate(nvme):
        mine = written[rank]
        assert all(f"/rank{rank}/" in f for f in mine), sorted(mine)
        assert any("bfloat16params" in f for f in mine) and any("exp_avg" in f for f in mine)
        assert mine <= set(r["stats"]["files_read"])
        # both ranks list the shared folder: every swap file there was written by one of them
        assert set(r["swap_files"]) <= written[0] | written[1]
        assert f"pyinfinity-rank{rank}/pyinfinity.lock" in r["claim_files"]


def test_a_second_job_on_the_same_folder_is_refused(jobs: Dict[str, Dict[str, Any]]) -> None:
    err = jobs["second"].get("error", "")
    assert "SwapDirBusyError" in err and "pyinfinity-rank0" in err and "in use by pid" in err, err[-3000:]
    ranks(jobs, "nvme")  # and the first job, whose folder it was, finished its training untouched


def test_claims_are_gone_after_the_job(jobs: Dict[str, Dict[str, Any]]) -> None:
    ranks(jobs, "nvme")
    left = [p.name for p in Path(jobs["nvme_path"]["path"]).glob("pyinfinity-rank*/*")]
    assert left == [], left
