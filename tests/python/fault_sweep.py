"""A sweep of I/O faults over the background optimizer step: every checkpoint the engine accepts
after a fault must resume with the losses of an uninterrupted run.

One case: a tiny LM with parameters and optimizer state on NVMe and the background step on
(``overlap_step``), eager (units stepped during backward) or clipped (``gradient_clipping``: all
units handed over in ``step()``). It trains 2 steps and saves checkpoint A; then the n-th read or
write piece of steps 3-4 fails with EIO (``fault_injection``) and the first exception is recorded
with the call it surfaced in (forward, backward, step, synchronize). Then, as a user would, the
case saves checkpoint B. A refused save ("partly stepped") counts as held when loading A and
training on gives the uninterrupted run's losses; an accepted save counts as held when a fresh
engine resumed from B gives them. Anything else is silently wrong.

Whole runs of the command line: ``finetune_killed`` SIGKILLs `pyinfinity train --model DIR --data
FILE --save-every 2` mid-run and resumes it (the losses must be the uninterrupted run's, bit for
bit, in fp32); ``changed_base_refused`` resumes a LoRA run over its base with one byte changed at
97% of a shard (past the first MiB) and must be refused.

Background saves (``save_checkpoint(blocking=False)``): ``saves_killed`` SIGKILLs runs that save
(rotated) after every step at random points of those saves and resumes each from ``latest`` (bit
for bit, fp32); ``save_faults`` fails the n-th write of a background save with ENOSPC or EIO (the
failure raised at the wait, ``latest`` left on the previous checkpoint).

CI runs a short form (``tests/python/test_fault_sweep.py``); the long form, every piece::

    python -m tests.python.fault_sweep --long
"""
from __future__ import annotations

import argparse
import collections
import dataclasses
import errno
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from typing import Iterable, Optional

import torch

import pyinfinity
from pyinfinity.swap.faults import fault_injection, faults_injected
from tests.python.conftest import TinyLM

STEPS = 6  # the uninterrupted run's length; the fault window is steps 3-4
MODES = ("eager", "clipped")
OPS = ("read", "write")


@dataclasses.dataclass
class Case:
    mode: str
    op: str
    nth: int
    injected: bool = False  # the seam altered a piece (nth within the window's pieces)
    surfaced: str = "nowhere"  # the call the first exception came out of
    error: str = ""
    save: str = ""  # "accepted" | "refused"
    held: bool = False
    detail: str = ""


def _batches(n: int = STEPS) -> list:
    g = torch.Generator().manual_seed(1)
    return [(torch.randint(0, 48, (2, 8), generator=g), torch.randint(0, 48, (2, 8), generator=g))
            for _ in range(n)]


def _config(swap: str, mode: str) -> dict:
    return {"train_micro_batch_size_per_gpu": 2, "gradient_clipping": 1.0 if mode == "clipped" else 0.0,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01}},
            "zero_optimization": {"stage": 3, "offload_param": {"device": "nvme", "nvme_path": swap, "max_in_cpu": 0},
                                  "offload_optimizer": {"device": "nvme", "nvme_path": swap},
                                  "stage3_param_persistence_threshold": 0, "stage3_prefetch_bucket_size": 1 << 20},
            "pyinfinity": {"device": "cpu", "device_memory": "64MiB", "overlap_step": True}}


def _engine(root: str, mode: str) -> "pyinfinity.Engine":
    torch.manual_seed(0)
    return pyinfinity.initialize(TinyLM(), _config(os.path.join(root, "swap"), mode))


def _train(eng, batches) -> list[float]:
    out = []
    for x, y in batches:
        loss = eng(x, y)
        eng.backward(loss)
        eng.step()
        out.append(loss.item())
    return out


def reference(root: str, mode: str) -> list[float]:
    """The uninterrupted run's losses."""
    with _engine(root, mode) as eng:
        return _train(eng, _batches())


def _resumed(root: str, mode: str, ckpt_dir: str) -> tuple[int, list[float]]:
    with _engine(root, mode) as eng:
        eng.load_checkpoint(ckpt_dir)
        g = eng.global_steps
        return g, _train(eng, _batches()[g:])


def run_case(root: str, mode: str, op: str, nth: int, ref: list[float]) -> Case:
    case = Case(mode, op, nth)
    batches = _batches()
    a_dir, b_dir = os.path.join(root, "a"), os.path.join(root, "b")
    eng = _engine(root, mode)
    try:
        _train(eng, batches[:2])
        eng.save_checkpoint(a_dir)
        before = faults_injected()
        where = "forward"
        try:
            with fault_injection(op=op, nth=nth, action="errno", value=errno.EIO):
                for x, y in batches[2:4]:
                    where = "forward"
                    loss = eng(x, y)
                    where = "backward"
                    eng.backward(loss)
                    where = "step"
                    eng.step()
                where = "synchronize"
                eng.synchronize()
        except Exception as exc:  # noqa: BLE001 - recorded: where it surfaced is the point
            case.surfaced, case.error = where, f"{type(exc).__name__}: {exc}"[:200]
        case.injected = faults_injected() > before
        try:
            eng.save_checkpoint(b_dir)
            case.save = "accepted"
        except RuntimeError as exc:
            if "partly stepped" not in str(exc):
                raise
            case.save = "refused"
        if case.save == "refused":  # recovery: the last good checkpoint, then train on
            eng.load_checkpoint(a_dir)
            got = _train(eng, batches[2:])
            case.held = got == ref[2:]
            case.detail = "" if case.held else f"after loading A: {got} != {ref[2:]}"
    finally:
        eng.close()
    if case.save == "accepted":
        g, got = _resumed(root, mode, b_dir)
        case.held = got == ref[g:]
        case.detail = "" if case.held else f"resumed from step {g}: {got} != {ref[g:]}"
    return case


def sweep(root: str, nths: Iterable[int], modes: Iterable[str] = MODES, ops: Iterable[str] = OPS,
          stop_when_clean: bool = True) -> list[Case]:
    """Runs the cases (each in a fresh directory under ``root``); with ``stop_when_clean``, a
    (mode, op) stops at the first n whose fault was not injected (past the window's pieces)."""
    out: list[Case] = []
    for mode in modes:
        ref = reference(os.path.join(root, f"ref-{mode}"), mode)
        for op in ops:
            for nth in nths:
                d = tempfile.mkdtemp(dir=root)
                try:
                    case = run_case(d, mode, op, nth, ref)
                finally:
                    shutil.rmtree(d, ignore_errors=True)
                out.append(case)
                if stop_when_clean and not case.injected:
                    break
    return out


REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "pyinfinity", *args]


def _env() -> dict:
    return {**os.environ, "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", "")}


def finetune_killed(root: str, steps: int = 8, lora: Optional[int] = None) -> tuple[bool, str]:
    """Fine-tunes a small model directory ``steps`` steps uninterrupted, then again with
    --save-every 2, SIGKILLed once its step-2 checkpoint is in place, then --resume: (held, what
    happened). Held: the resumed run's losses are the uninterrupted run's, bit for bit."""
    import json

    from tests.python.pretrained_dirs import CORPUS, make_model_dir

    model = make_model_dir(os.path.join(root, "model"))
    data = os.path.join(root, "data.txt")
    with open(data, "w") as f:
        f.write(CORPUS * 2)
    run = ["train", "--model", model, "--data", data, "--steps", str(steps), "--seq", "16", "--batch", "2",
           "--device", "cpu", "--dtype", "fp32", "--offload", "nvme", "--nvme", os.path.join(root, "swap"),
           "--no-progress", *(["--lora", str(lora)] if lora else [])]

    def losses(name: str) -> dict[int, str]:
        with open(os.path.join(root, name)) as f:
            return {s["step"]: repr(s["loss"]) for s in json.load(f)["steps"]}

    ref = subprocess.run(_cli(*run, "--json", os.path.join(root, "ref.json")), capture_output=True, text=True,
                         timeout=600, cwd=REPO, env=_env())
    if ref.returncode:
        return False, f"uninterrupted run failed: {ref.stderr[-2000:]}"
    ckpt = os.path.join(root, "ckpt")
    proc = subprocess.Popen(_cli(*run, "--save", ckpt, "--save-every", "2"), stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True, cwd=REPO, env=_env())
    try:
        latest = os.path.join(ckpt, "latest")
        deadline = time.monotonic() + 600
        while proc.poll() is None and time.monotonic() < deadline:
            if os.path.isfile(latest):
                proc.send_signal(signal.SIGKILL)
                break
            time.sleep(0.002)
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    err = proc.stderr.read()
    proc.stderr.close()
    if proc.returncode != -signal.SIGKILL:
        return False, f"the run was not killed mid-run (exit status {proc.returncode}): {err[-2000:]}"
    with open(os.path.join(ckpt, "latest")) as f:
        tag = f.read().strip()
    res = subprocess.run(_cli(*run, "--resume", ckpt, "--json", os.path.join(root, "res.json")),
                         capture_output=True, text=True, timeout=600, cwd=REPO, env=_env())
    if res.returncode:
        return False, f"--resume {tag} failed: {res.stderr[-2000:]}"
    want, got = losses("ref.json"), losses("res.json")
    start = int(tag[len("global_step"):]) + 1
    if not got or min(got) != start or got != {k: v for k, v in want.items() if k >= start}:
        return False, f"resumed from {tag}: {got} != {want}"
    return True, f"killed with {tag} saved, resumed steps {start}-{steps} bit-exact"


def changed_base_refused(root: str) -> tuple[bool, str]:
    """Trains LoRA adapters 2 steps over a small model directory (shards of a few MiB) and saves,
    flips one byte at 97% of its largest shard, then --resume: (held, what happened). Held: the
    resume is refused in one line (exit status 2) naming the changed base."""
    from tests.python.pretrained_dirs import CORPUS, make_model_dir

    model = make_model_dir(os.path.join(root, "model"), hidden=256, shard="3MB")
    data = os.path.join(root, "data.txt")
    with open(data, "w") as f:
        f.write(CORPUS * 2)
    ckpt = os.path.join(root, "ckpt")
    run = ["train", "--model", model, "--data", data, "--lora", "4", "--steps", "3", "--seq", "16", "--batch", "2",
           "--device", "cpu", "--offload", "cpu", "--no-progress"]
    first = subprocess.run(_cli(*run, "--stop-after", "2", "--save", ckpt), capture_output=True, text=True,
                           timeout=600, cwd=REPO, env=_env())
    if first.returncode:
        return False, f"the first run failed: {first.stderr[-2000:]}"
    shard = max((os.path.join(model, n) for n in os.listdir(model) if n.endswith(".safetensors")),
                key=os.path.getsize)
    at = int(os.path.getsize(shard) * 0.97)
    with open(shard, "r+b") as f:
        f.seek(at)
        b = f.read(1)
        f.seek(at)
        f.write(bytes([b[0] ^ 0x10]))
    res = subprocess.run(_cli(*run, "--resume", ckpt), capture_output=True, text=True, timeout=600, cwd=REPO,
                         env=_env())
    last = (res.stderr.strip().splitlines() or [""])[-1]
    if res.returncode != 2 or "Traceback" in res.stderr or "other base weights" not in last:
        return False, f"--resume over a base changed at byte {at} of {shard}: exit {res.returncode}: {last}"
    return True, f"refused: {last}"


# ----------------------------------------------------------------------------------- background saves

# The kill sweep's process: it imports and then only forks (no thread of its own is started before a
# fork), one child for the uninterrupted run, then per trial one that trains with a background save
# after every step (keep_last=2) and is SIGKILLed at a random point, and one that resumes from latest.
# argv: root, trials, seed. One JSON line per trial on stdout.
_SAVES_KILLED = r"""
import json, os, random, signal, sys, time
import torch
from tests.python import fault_sweep

root, trials, seed, by_reference = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4] == "1"
rng = random.Random(seed)

def child(fn, *args):
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        code = 0
        try:
            torch.set_num_threads(1)
            out = os.fdopen(w, "w", buffering=1)
            fn(out, *args)
        except BaseException as exc:
            print(repr(exc), file=sys.stderr, flush=True)
            code = 1
        os._exit(code)
    os.close(w)
    return pid, os.fdopen(r)

def reference(out, d):
    out.write(json.dumps(fault_sweep.reference(d, "eager")) + "\n")

def saving(out, d):
    with fault_sweep._engine(d, "eager") as eng:
        for i, (x, y) in enumerate(fault_sweep._batches()):
            fault_sweep._train(eng, [(x, y)])
            out.write(f"saving {i + 1}\n")
            eng.save_checkpoint(os.path.join(d, "ckpt"), blocking=False, keep_last=2, by_reference=by_reference)
        out.write("done\n")

def resuming(out, d):
    ckpt = os.path.join(d, "ckpt")
    if not os.path.exists(os.path.join(ckpt, "latest")):  # killed before any save was complete
        out.write(json.dumps([0, fault_sweep.reference(d, "eager")]) + "\n")
        return
    out.write(json.dumps(fault_sweep._resumed(d, "eager", ckpt)) + "\n")

pid, r = child(reference, os.path.join(root, "ref"))
ref = json.loads(r.readline())
os.waitpid(pid, 0)
for t in range(trials):
    d = os.path.join(root, f"t{t}")
    at, delay = rng.randint(1, fault_sweep.STEPS - 1), rng.uniform(0.0, 0.03)
    pid, r = child(saving, d)
    for line in r:
        if line.strip() == f"saving {at}":
            break
    time.sleep(delay)
    ckpt = os.path.join(d, "ckpt")
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    r.close()
    names = os.listdir(ckpt) if os.path.isdir(ckpt) else []
    in_flight = [n for n in names if n.startswith(".") and ".tmp-" in n]
    latest = open(os.path.join(ckpt, "latest")).read().strip() if "latest" in names else None
    version = json.load(open(os.path.join(ckpt, latest, "meta.json")))["version"] if latest else None
    pid, r = child(resuming, d)
    line = r.readline()
    os.waitpid(pid, 0)
    step, got = json.loads(line) if line else (None, None)
    print(json.dumps({"trial": t, "killed_after_save_of": at, "delay_s": round(delay, 4), "in_flight": in_flight,
                      "latest": latest, "version": version, "listing": sorted(names), "resumed_from": step,
                      "held": got is not None and got == ref[step:]}), flush=True)
"""


def saves_killed(root: str, trials: int = 20, seed: int = 0, by_reference: bool = False) -> list[dict]:
    """``trials`` runs, each SIGKILLed at a random point of its background saves (after the save of
    a random step, a random 0-30 ms later), then resumed from ``latest``: one record per trial.
    Held: the resumed losses are the uninterrupted run's, bit for bit (fp32), from the step
    ``latest`` names (which therefore was complete). ``by_reference``: the NVMe optimizer state
    saved by reference (the steps after a save rewrite its shards into fresh slots, rotation
    frees the slots of the checkpoints it removes, the kill leaves the swap file to the next
    start's stale cleanup); else copied into state.bin."""
    import json

    p = subprocess.run([sys.executable, "-c", _SAVES_KILLED, root, str(trials), str(seed), str(int(by_reference))],
                       capture_output=True,
                       text=True, timeout=900, cwd=REPO, env=_env())
    out = [json.loads(line) for line in p.stdout.splitlines() if line.startswith("{")]
    if p.returncode or len(out) != trials:
        raise RuntimeError(f"the kill sweep failed (exit {p.returncode}, {len(out)} of {trials} trials): "
                           f"{p.stderr[-3000:]}")
    return out


def save_fault_case(root: str, nth: int, code: int, ref: list[float]) -> dict:
    """Saves A (blocking) at step 2, trains step 3, then a background save B whose ``nth`` write
    piece fails with ``code`` (only the checkpoint writes while it is waited for): held when the
    failure is raised at the wait, ``latest`` still names A, no part of B stays and training on
    from A gives the uninterrupted run's losses; or, past B's pieces, when B resumes them. The
    NVMe state is copied (``by_reference=False``): its writes are the ones failed."""
    batches = _batches()
    ckpt = os.path.join(root, "ckpt")
    rec = {"nth": nth, "errno": errno.errorcode[code], "injected": False, "raised": "", "held": False}
    with _engine(root, "eager") as eng:
        _train(eng, batches[:2])
        eng.save_checkpoint(ckpt, by_reference=False)
        _train(eng, batches[2:3])
        eng.synchronize()  # step 3's writes are home: within the window only the save writes
        before = faults_injected()
        try:
            with fault_injection(op="write", nth=nth, action="errno", value=code):
                eng.save_checkpoint(ckpt, blocking=False, keep_last=1, by_reference=False)
                eng.wait_for_checkpoint()
        except OSError as exc:
            rec["raised"] = str(exc)[:200]
        rec["injected"] = faults_injected() > before
        if rec["raised"]:
            with open(os.path.join(ckpt, "latest")) as f:
                latest = f.read().strip()
            clean = sorted(os.listdir(ckpt)) == ["global_step2", "latest"] and latest == "global_step2"
            eng.load_checkpoint(ckpt)
            rec["held"] = clean and rec["injected"] and _train(eng, batches[2:]) == ref[2:]
            return rec
    g, got = _resumed(root, "eager", ckpt)
    rec["held"] = not rec["injected"] and g == 3 and got == ref[3:]
    return rec


def save_faults(root: str, nths: Iterable[int], codes: Iterable[int] = (errno.ENOSPC, errno.EIO)) -> list[dict]:
    """``save_fault_case`` for each errno and n, until n is past the save's write pieces."""
    ref = reference(os.path.join(root, "ref"), "eager")
    out = []
    for code in codes:
        for nth in nths:
            d = tempfile.mkdtemp(dir=root)
            try:
                out.append(save_fault_case(d, nth, code, ref))
            finally:
                shutil.rmtree(d, ignore_errors=True)
            if not out[-1]["injected"]:
                break
    return out


def summary(cases: list[Case]) -> str:
    rows = collections.Counter((c.mode, c.op, c.surfaced, c.save, c.held) for c in cases if c.injected)
    lines = ["mode     op     surfaced in   save      held  cases"]
    for (mode, op, where, save, held), n in sorted(rows.items()):
        lines.append(f"{mode:8s} {op:6s} {where:13s} {save:9s} {str(held):5s} {n}")
    inj = [c for c in cases if c.injected]
    lines.append(f"{len(inj)} cases with a fault injected, {sum(c.held for c in inj)} held")
    return "\n".join(lines)


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--long", action="store_true", help="every piece of the window (default: every 7th)")
    p.add_argument("--max-nth", type=int, default=400)
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.CRITICAL)
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as root:
        cases = sweep(root, range(1, args.max_nth + 1, 1 if args.long else 7))
        killed = saves_killed(tempfile.mkdtemp(dir=root), trials=100 if args.long else 20)
        save_cases = save_faults(tempfile.mkdtemp(dir=root), range(1, 400, 1 if args.long else 3))
        held, what = finetune_killed(tempfile.mkdtemp(dir=root))
        refused, why = changed_base_refused(tempfile.mkdtemp(dir=root))
    print(summary(cases))
    for c in cases:
        if c.injected and not c.held:
            print("NOT HELD:", c)
    print(f"background saves SIGKILLed at random points: {sum(t['held'] for t in killed)} of {len(killed)} "
          f"resumed bit-exact ({sum(bool(t['in_flight']) for t in killed)} killed with a save in flight)")
    print(f"background saves with a failing write: {sum(c['held'] for c in save_cases)} of {len(save_cases)} held")
    print(f"fine-tune killed with --save-every, resumed: {'held' if held else 'NOT HELD'}: {what}")
    print(f"LoRA resume over a base changed at 97% of a shard: {'refused' if refused else 'NOT REFUSED'}: {why}")
    print(f"{time.perf_counter() - t0:.0f} s")
    return 0 if (held and refused and all(c.held for c in cases if c.injected) and all(t["held"] for t in killed)
                 and all(c["held"] for c in save_cases)) else 1


if __name__ == "__main__":
    raise SystemExit(main())
