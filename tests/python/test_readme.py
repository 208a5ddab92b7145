"""README's Python examples run as printed: the code blocks that call ``pyinfinity.initialize`` or
``pyinfinity.from_pretrained`` are read from README.md (a change there is tested here) and run in
order, in one namespace, in a temporary working directory. Only three things are substituted: the
``LlamaConfig(...)`` arguments (a tiny model), the ``nvme_path`` values (temporary directories) and
``loader`` (a few random token batches, on the CPU as a DataLoader gives them). The model
directory ``from_pretrained`` names is created there, a tiny Llama. On the CPU in CI; on CUDA
under the ``gpu`` marker (``pyinfinity.device`` left as printed, so "auto" picks the GPU)."""
from __future__ import annotations

import os
import re

import pytest
import torch

from tests.python.pretrained_dirs import make_model_dir

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
README = os.path.join(ROOT, "README.md")
TINY_LLAMA = ("hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, "
              "num_key_value_heads=2, vocab_size=256, max_position_embeddings=256")
VOCAB, SEQ, BATCHES = 256, 32, 3
NVME_PATH = r"([\"']nvme_path[\"']\s*:\s*)(\[[^\]]*\]|[\"'][^\"']*[\"'])"  # "nvme_path": "D" or [...]


def python_blocks(text: str) -> list[str]:
    return [m.group(1) for m in re.finditer(r"^```python[^\n]*\n(.*?)^```", text, re.S | re.M)]


def training_blocks() -> list[str]:
    with open(README, encoding="utf-8") as f:
        blocks = [b for b in python_blocks(f.read())
                  if re.search(r"pyinfinity\.(initialize|from_pretrained)\(", b)]
    assert blocks, "README.md has no Python block calling pyinfinity.initialize / from_pretrained"
    return blocks


def _call_end(src: str, open_paren: int) -> int:
    """Index just past the parenthesis that closes the one at ``open_paren``."""
    depth = 0
    for i in range(open_paren, len(src)):
        depth += {"(": 1, ")": -1}.get(src[i], 0)
        if depth == 0:
            return i + 1
    raise AssertionError(f"unbalanced parentheses after {src[open_paren - 20:open_paren + 20]!r}")


def substitute(src: str, swap_dirs: dict[str, str]) -> str:
    """The three substitutions the test may make (see the module docstring)."""
    out, pos = [], 0
    for m in re.finditer(r"\bLlamaConfig\(", src):
        end = _call_end(src, m.end() - 1)
        out += [src[pos:m.start()], f"LlamaConfig({TINY_LLAMA})"]
        pos = end
    src = "".join(out) + src[pos:]

    def paths(m: re.Match) -> str:
        def one(q: re.Match) -> str:
            d = swap_dirs[q.group(2)]
            return f"{q.group(1)}{d}{q.group(1)}"
        return m.group(1) + re.sub(r"([\"'])([^\"']*)\1", one, m.group(2))
    src = re.sub(NVME_PATH, paths, src)
    # a loader the README defines itself (e.g. over the user's dataset) becomes the test's batches
    out, pos = [], 0
    for m in re.finditer(r"^([ \t]*)loader\s*=", src, re.M):
        end = src.find("\n", m.end())
        end = len(src) if end < 0 else end
        line = src[m.start():end]
        if line.count("(") > line.count(")"):
            end = _call_end(src, m.start() + line.index("("))
            end = src.find("\n", end) if src.find("\n", end) >= 0 else len(src)
        out += [src[pos:m.start()], f"{m.group(1)}loader = _test_loader"]
        pos = end
    return "".join(out) + src[pos:]


class RandomBatches:
    """``loader``: a few random token batches of the config's micro-batch size, on the CPU."""

    def __init__(self, ns: dict) -> None:
        self.ns = ns

    def __iter__(self):
        g = torch.Generator().manual_seed(0)
        micro = int(self.ns.get("config", {}).get("train_micro_batch_size_per_gpu", 2))
        for _ in range(BATCHES):
            yield torch.randint(0, VOCAB, (micro, SEQ), generator=g)

    def __len__(self) -> int:
        return BATCHES


def test_the_substitutions_touch_only_what_they_may():
    src = ('cfg = {"offload_param": {"device": "nvme", "nvme_path": "/mnt/a"},\n'
           '       "offload_optimizer": {"nvme_path": ["/mnt/a", "/mnt/b"]}}\n'
           'model = M(LlamaConfig(hidden_size=4096, rope_scaling=dict(type="linear")))\n'
           'loader = DataLoader(ds,\n    batch_size=4)\nfor batch in loader:\n    pass\n')
    dirs = {"/mnt/a": "/t/0", "/mnt/b": "/t/1"}
    out = substitute(src, dirs)
    assert '"nvme_path": "/t/0"' in out and '"nvme_path": ["/t/0", "/t/1"]' in out
    assert f"M(LlamaConfig({TINY_LLAMA}))" in out
    assert "loader = _test_loader\nfor batch in loader:\n    pass\n" in out
    assert "DataLoader" not in out and "4096" not in out


def run_readme(tmp_path, monkeypatch) -> dict:
    blocks = training_blocks()
    src = "\n".join(blocks)
    swap_dirs: dict[str, str] = {}
    for m in re.finditer(NVME_PATH, src):
        for p in re.findall(r"[\"']([^\"']*)[\"']", m.group(2)):
            if p not in swap_dirs:
                swap_dirs[p] = str(tmp_path / f"nvme{len(swap_dirs)}")
                os.makedirs(swap_dirs[p])
    monkeypatch.chdir(tmp_path)
    for name in re.findall(r"pyinfinity\.from_pretrained\(\s*[\"']([^\"']+)[\"']", src):
        if not os.path.isdir(tmp_path / name):  # the directory the snippet names (its hidden size: TINY_LLAMA's)
            make_model_dir(str(tmp_path / name), "llama", hidden=64, layers=2)
    ns: dict = {"__name__": "readme"}
    ns["_test_loader"] = RandomBatches(ns)
    if "loader" not in re.findall(r"^[ \t]*(\w+)\s*=", src, re.M):
        ns["loader"] = ns["_test_loader"]
    try:
        for block in blocks:
            exec(compile(substitute(block, swap_dirs), README, "exec"), ns)
    finally:
        eng = ns.get("engine")
        if eng is not None and not getattr(eng, "closed", True):
            eng.close()
    return ns


def check_results(ns: dict, tmp_path, device_type: str) -> None:
    eng = ns["engine"]
    assert eng.device.type == device_type
    loss = ns.get("loss")
    if loss is not None:
        assert torch.isfinite(loss.detach().float()).all()
    src = "\n".join(training_blocks())
    for ckpt in re.findall(r"\.save_checkpoint\(\s*[\"']([^\"']+)", src):
        assert os.listdir(tmp_path / ckpt)
    for out in re.findall(r"\.export\(\s*[\"']([^\"']+)", src):
        from transformers import AutoModelForCausalLM

        exported = AutoModelForCausalLM.from_pretrained(str(tmp_path / out))  # an adapter too: PEFT loads its base
        assert exported.config.hidden_size == 64  # the substituted model, trained and exported


def test_readme_examples_run_on_the_cpu(tmp_path, monkeypatch):
    if torch.cuda.is_available():  # "auto" would pick the GPU: this one is the CPU run
        import pyinfinity.device

        monkeypatch.setattr(pyinfinity.device, "cuda_available", lambda: False)
    check_results(run_readme(tmp_path, monkeypatch), tmp_path, "cpu")


@pytest.mark.gpu
def test_readme_examples_run_on_cuda(tmp_path, monkeypatch):
    ns = run_readme(tmp_path, monkeypatch)
    check_results(ns, tmp_path, "cuda")
    assert ns["engine"].device.index is not None


def first_example() -> str:
    """README's first training block, the one that builds a model under ``init_empty``."""
    blocks = [b for b in training_blocks() if "init_empty" in b]
    assert blocks, "README.md has no training block that builds its model under pyinfinity.init_empty"
    return blocks[0]


def test_the_first_example_as_printed_is_refused_in_one_line_before_it_writes(tmpfs_dir, tmp_path):
    """The first example's model (about 5B parameters, 72 GB of state on disk), its nvme_path values
    pointed at directories of a 64 MiB tmpfs, nothing else changed: ``initialize`` refuses it in
    one line before anything is materialised or written (the swap directories stay empty), in
    seconds, on any machine: its swap alone does not fit the tmpfs."""
    import subprocess
    import sys
    import time

    src = first_example()
    dirs: dict[str, str] = {}
    for m in re.finditer(NVME_PATH, src):
        for p in re.findall(r"[\"']([^\"']*)[\"']", m.group(2)):
            dirs.setdefault(p, os.path.join(tmpfs_dir, f"nvme{len(dirs)}"))
    assert len(dirs) >= 1
    # the nvme_path values alone change: the model, the config and the calls run as printed
    script = re.sub(NVME_PATH, lambda m: m.group(1) + re.sub(r"([\"'])([^\"']*)\1",
                                                           lambda q: f"{q.group(1)}{dirs[q.group(2)]}{q.group(1)}",
                                                           m.group(2)), src)
    t0 = time.monotonic()
    p = subprocess.run([sys.executable, "-c", script], cwd=str(tmp_path), capture_output=True, text=True,
                       timeout=300, env={**os.environ, "PYINFINITY_WAIT_TIMEOUT": "30"})
    took = time.monotonic() - t0
    assert p.returncode != 0, p.stderr[-2000:]
    last = p.stderr.strip().splitlines()[-1]
    # the planner's check of the fixed placement, or the engine's own host-RAM check when this
    # machine's free RAM (the measured budget) is below even the engine's count: both run before a
    # write, and which trips first depends on the RAM free when the test runs
    planner = "PlanError: " in last and "does not fit this machine (nothing was written)" in last
    engine = "CapacityError: " in last and "the model's training state does not fit" in last
    assert planner or engine, p.stderr[-3000:]
    assert ("host RAM: needs" if planner else "host RAM: ") in last, last
    assert took < 120, f"the refusal took {took:.0f} s"
    written = sum(os.path.getsize(os.path.join(r, f)) for r, _, fs in os.walk(tmpfs_dir) for f in fs)
    assert written < 1 << 20, f"{written} bytes written under the swap directories"
    assert "engine ready" not in p.stderr and "step " not in p.stderr
