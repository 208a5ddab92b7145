"""Shared fixtures. Tests that mount filesystems need root with CAP_SYS_ADMIN (as in CI)."""
from __future__ import annotations

import contextlib
import os
import subprocess
import tempfile

import pytest
import torch


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a CUDA device (the GPU suite, `make test-gpu`: "
                                       "pytest -m gpu); skipped without one")


def pytest_collection_modifyitems(config, items):
    """Tests marked ``gpu`` are skipped, with the reason, where torch sees no CUDA device."""
    if torch.cuda.is_available():
        return
    why = ("this torch is built without CUDA" if torch.version.cuda is None
           else "no CUDA device is visible")
    skip = pytest.mark.skip(reason=f"gpu: needs a CUDA device ({why})")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


LARGE_TEMP_FILE = 1 << 20  # bytes: larger files a test leaves under pytest's temp root are removed after it


def remove_large_files(root: str) -> None:
    """Deletes the files over LARGE_TEMP_FILE under ``root`` (swap files, data files, images): pytest
    keeps its last three temp roots, which would otherwise hold gigabytes. Small files (configs,
    logs, JSON results) stay for a look after a failure."""
    for dirpath, _dirs, files in os.walk(root):
        for name in files:
            path = os.path.join(dirpath, name)
            try:
                if os.lstat(path).st_size > LARGE_TEMP_FILE:
                    os.unlink(path)
            except OSError:
                pass  # a read-only mount, a file gone meanwhile


@pytest.fixture(autouse=True)
def _drop_large_temp_files(request):
    """After each test: its tmp_path's large files (see remove_large_files)."""
    yield
    tmp = request.node.funcargs.get("tmp_path") if hasattr(request.node, "funcargs") else None
    if tmp is not None:
        remove_large_files(str(tmp))


@pytest.fixture(scope="session", autouse=True)
def _drop_large_session_files(tmp_path_factory):
    """At the end of the session: what module- and session-scoped fixtures left (tmp_path_factory)."""
    yield
    remove_large_files(str(tmp_path_factory.getbasetemp()))


def random_bytes(n: int, seed: int = 0) -> torch.Tensor:
    """n random bytes (never zeros-only), reproducible."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g)


@contextlib.contextmanager
def mounted(fstype: str, options: str, source: str = ""):
    """Mounts a fresh filesystem of `fstype` (from `source`, default none) on a temp dir;
    unmounts and removes it after."""
    if os.geteuid() != 0:
        pytest.skip("mounting needs root")
    d = tempfile.mkdtemp(prefix=f"pyinf-{fstype}-")
    rc = subprocess.run(["mount", "-t", fstype, "-o", options, source or fstype, d],
                        capture_output=True, text=True)
    if rc.returncode != 0:
        os.rmdir(d)
        pytest.fail(f"mount -t {fstype} failed: {rc.stderr.strip()}")
    try:
        yield d
    finally:
        subprocess.run(["umount", "-l", d], check=False)
        os.rmdir(d)


@pytest.fixture
def tmpfs_dir():
    """A 64 MiB tmpfs (O_DIRECT only on Linux >= 6.6)."""
    with mounted("tmpfs", "size=64m") as d:
        yield d


@pytest.fixture
def nodirect_dir():
    """A ramfs: a filesystem without O_DIRECT on every kernel."""
    with mounted("ramfs", "mode=755") as d:
        yield d


@pytest.fixture
def tiny_tmpfs_dir():
    """A 1 MiB tmpfs, to make a real ENOSPC."""
    with mounted("tmpfs", "size=1m") as d:
        yield d


@pytest.fixture
def small_ext4_dir(tmp_path):
    """A 32 MiB ext4 filesystem on a loop device (O_DIRECT works there, unlike some tmpfs)."""
    if os.geteuid() != 0:
        pytest.skip("mounting needs root")
    img = tmp_path / "ext4.img"
    with open(img, "wb") as f:
        f.truncate(32 << 20)
    rc = subprocess.run(["mkfs.ext4", "-q", "-F", str(img)], capture_output=True, text=True)
    if rc.returncode != 0:
        pytest.fail(f"mkfs.ext4 failed: {rc.stderr.strip()}")
    with mounted("ext4", "loop", str(img)) as d:
        yield d


@pytest.fixture
def readonly_dir(tmp_path):
    """A read-only mount (root ignores permission bits, so chmod would not do)."""
    with mounted("tmpfs", "size=1m") as d:
        with open(os.path.join(d, "existing.bin"), "wb") as f:
            f.write(b"x" * 8192)
        subprocess.run(["mount", "-o", "remount,ro", d], check=True)
        yield d


# ---------------------------------------------------------------------------------------------
# Training-engine fixtures (tests/python/test_engine.py, test_zero_*.py, test_example.py)


class _TinyBlock(torch.nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.norm = torch.nn.LayerNorm(d)
        self.up = torch.nn.Linear(d, 2 * d)
        self.down = torch.nn.Linear(2 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.nn.functional.gelu(self.up(self.norm(x))))


class TinyLM(torch.nn.Module):
    """A small transformer-like LM: embedding, residual MLP blocks, tied output head."""

    def __init__(self, vocab: int = 48, d: int = 24, layers: int = 3, tie: bool = True) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, d)
        self.blocks = torch.nn.ModuleList([_TinyBlock(d) for _ in range(layers)])
        self.norm = torch.nn.LayerNorm(d)
        self.head = torch.nn.Linear(d, vocab, bias=False)
        if tie:
            self.head.weight = self.embed.weight

    def forward(self, x: torch.Tensor, y: torch.Tensor | None = None) -> torch.Tensor:
        h = self.embed(x)
        for b in self.blocks:
            h = b(h)
        logits = self.head(self.norm(h))
        if y is None:
            return logits
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten())


@pytest.fixture
def tiny_lm():
    """Factory of TinyLM models (seeded: the same seed gives the same initial weights)."""
    def make(seed: int = 0, **kw) -> TinyLM:
        torch.manual_seed(seed)
        return TinyLM(**kw)
    return make


def sigint_default() -> None:
    """A subprocess's ``preexec_fn`` for tests that send it SIGINT: a runner started in the
    background by a non-interactive shell (``make test &``, nohup) ignores SIGINT, its children
    inherit that, and Python then installs no KeyboardInterrupt handler."""
    import signal

    signal.signal(signal.SIGINT, signal.SIG_DFL)


def train_steps(eng, batches) -> list[float]:
    """One forward, backward and step() of ``eng`` per (x, y) batch; the losses as floats."""
    losses = []
    for x, y in batches:
        loss = eng(x, y)
        eng.backward(loss)
        eng.step()
        losses.append(loss.item())
    return losses


def engine_state(eng) -> dict:
    """Every shard's [master | exp_avg | exp_avg_sq], step count and parameter home, as a
    checkpoint sees them (after the background step, with device-stepped units brought home)."""
    eng.state.quiesce("reading the training state")
    out = {}
    for st, flat in eng.optimizer.iter_states(write_back=False):
        out[f"optim.{st.shard.index}"] = flat.clone()
        out[f"step.{st.shard.index}"] = torch.tensor(st.step)
    for sh in eng.partition.shards:
        out[f"param.{sh.index}"] = eng.state.param_values(sh).clone()
    return out


@pytest.fixture
def lm_batches():
    """Factory of reproducible (x, y) token batches for TinyLM."""
    def make(n: int, batch: int = 2, seq: int = 8, vocab: int = 48, seed: int = 1):
        g = torch.Generator().manual_seed(seed)
        return [(torch.randint(0, vocab, (batch, seq), generator=g),
                 torch.randint(0, vocab, (batch, seq), generator=g)) for _ in range(n)]
    return make


@pytest.fixture
def engine_config(tmp_path):
    """Factory of engine configs: tier "cpu" or "nvme" (swap under tmp_path), fp32, CPU device."""
    def make(tier: str = "cpu", **over) -> dict:
        swap = str(tmp_path / "swap")
        cfg = {
            "train_micro_batch_size_per_gpu": 2,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01}},
            "zero_optimization": {
                "stage": 3,
                "offload_param": {"device": tier, "nvme_path": swap, "max_in_cpu": 0},
                "offload_optimizer": {"device": tier, "nvme_path": swap},
                "stage3_param_persistence_threshold": 0,
                "stage3_prefetch_bucket_size": 1 << 20,
            },
            "pyinfinity": {"device": "cpu", "device_memory": "64MiB"},
        }
        for k, v in over.items():
            if isinstance(v, dict) and isinstance(cfg.get(k), dict):
                cfg[k] = {**cfg[k], **v}
            else:
                cfg[k] = v
        return cfg
    return make
