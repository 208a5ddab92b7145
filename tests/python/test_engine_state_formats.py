"""The engine with a compressed optimizer state (``pyinfinity.optimizer_state: "8bit"``, DeepSpeed's
bf16 master and moments): a small Llama trains on the CPU and NVMe tiers alike, the 8-bit state
costs about half the fp32 one, units stepped on the device give the CPU step's bits, and
``memory_report`` shows the compressed bytes (docs/optimizer_state.md)."""
from __future__ import annotations

import pytest
import torch

import pyinfinity

transformers = pytest.importorskip("transformers")

STATE_KEYS = {"8bit": {"pyinfinity": {"optimizer_state": "8bit"}},
              "bf16": {"bf16": {"enabled": True, "bf16_master_weights_and_grads": True,
                                "bf16_optimizer_states": True}},
              "fp32": {}}


def llama(hidden: int = 64, layers: int = 2, vocab: int = 256, dtype: torch.dtype = torch.float32, seed: int = 0):
    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden,
                                   num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=4,
                                   max_position_embeddings=64)
    return transformers.LlamaForCausalLM(cfg).to(dtype)


def config(engine_config, fmt: str, tier: str = "cpu", **pyinf) -> dict:
    cfg = engine_config(tier)
    cfg["optimizer"]["params"]["lr"] = 3e-3
    for key, value in STATE_KEYS[fmt].items():
        cfg[key] = {**cfg.get(key, {}), **value}
    cfg["pyinfinity"] = {**cfg["pyinfinity"], "device_memory": "256MiB", **pyinf}
    return cfg


def batches(n: int, vocab: int = 256, seq: int = 32):
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, vocab, (2, seq), generator=g)  # one batch, repeated: the loss must fall
    return [x] * n


def train(eng, data) -> list[float]:
    losses = []
    for x in data:
        loss = eng(input_ids=x, labels=x).loss
        eng.backward(loss)
        eng.step()
        losses.append(loss.item())
    return losses


def trained(eng) -> list[torch.Tensor]:
    return [eng.state.trained_values(sh).clone() for sh in eng.partition.shards]


@pytest.mark.parametrize("fmt", ["8bit", "bf16"])
def test_a_small_llama_trains_with_a_compressed_state_on_both_tiers(fmt, engine_config):
    """The loss falls; the state on NVMe (moved in its compressed form) trains bit for bit like the
    state in RAM; the format is the one asked for, and the report counts its homes."""
    dtype = torch.bfloat16 if fmt == "bf16" else torch.float32
    got = {}
    for tier in ("cpu", "nvme"):
        with pyinfinity.initialize(llama(dtype=dtype), config(engine_config, fmt, tier)) as eng:
            assert eng.optimizer.format.name == fmt
            losses = train(eng, batches(12))
            report = eng.memory_report().optimizer
            assert set(report) == {"cpu" if tier == "cpu" else "nvme"}
            assert sum(report.values()) == sum(eng.optimizer.format.nbytes(st.numel) for st in eng.optimizer.states)
            got[tier] = (losses, trained(eng))
    losses = got["cpu"][0]
    assert losses[-1] < 0.8 * losses[0], losses
    assert got["nvme"][0] == losses
    assert all(torch.equal(a, b) for a, b in zip(got["cpu"][1], got["nvme"][1]))


def test_the_8bit_state_costs_at_most_055_of_fp32s(engine_config):
    """A model of more than a million parameters: the optimizer's bytes (memory_report) with the
    8-bit state are at most 0.55 of the fp32 state's."""
    total = {}
    for fmt in ("fp32", "8bit"):
        model = llama(hidden=192, layers=2, vocab=1024)
        assert sum(p.numel() for p in model.parameters()) >= 1_000_000
        with pyinfinity.initialize(model, config(engine_config, fmt)) as eng:
            total[fmt] = sum(eng.memory_report().optimizer.values())
    assert total["8bit"] <= 0.55 * total["fp32"], total


@pytest.mark.parametrize("fmt", ["8bit", "bf16"])
def test_units_stepped_on_the_device_give_the_cpu_steps_bits(fmt, engine_config, monkeypatch):
    """Units whose state lives on the compute device (the CPU device here), and every unit under
    the streamed step (``optimizer_step_device: "device"``), are stepped by the format's torch
    step, which computes the one-pass kernel's bits: the same losses and weights.
    (Every shard quantised: an fp32 shard's device step is torch's fused kernel, whose bits differ
    from the one-pass kernel's, as for the fp32 state.)"""
    import pyinfinity.config_values

    monkeypatch.setattr(pyinfinity.config_values, "MIN_QUANTIZED_NUMEL", 1)
    dtype = torch.bfloat16 if fmt == "bf16" else torch.float32
    got = []
    for dev_bytes, where in (("0", "cpu"), ("256KiB", "cpu"), ("0", "device")):
        cfg = config(engine_config, fmt, resident_bytes="64MiB", device_optimizer_bytes=dev_bytes,
                     optimizer_step_device=where)
        with pyinfinity.initialize(llama(dtype=dtype), cfg) as eng:
            assert (eng.optimizer.step_device is not None) == (where == "device")
            stepped_there = [sh for sh in eng.partition.shards if sh.device_step]
            assert bool(stepped_there) == (dev_bytes != "0")
            if stepped_there:
                fmt_ = eng.optimizer.format
                assert all(fmt_.nbytes(sh.numel) < 12 * sh.numel for sh in stepped_there if sh.numel >= 64)
                assert eng.memory_report().optimizer.get("device", 0) > 0
            got.append((train(eng, batches(6)), trained(eng)))
    for other in got[1:]:
        assert other[0] == got[0][0]
        assert all(torch.equal(a, b) for a, b in zip(other[1], got[0][1]))


def test_the_host_ram_check_charges_the_formats_bytes(engine_config):
    """A host-memory budget between the two needs: the fp32 state (12 bytes a parameter) is refused
    with the bytes it needs, the 8-bit state (about 6) fits; the report names the format."""
    from pyinfinity.swap.ownership import CapacityError

    model = llama(hidden=192, layers=2, vocab=1024)
    n = sum(p.numel() for p in model.parameters())
    budget = int(4 * n + 9 * n)  # the fp32 weights and 9 bytes a parameter of state
    with pytest.raises(CapacityError, match="optimizer states") as ei:
        pyinfinity.initialize(model, config(engine_config, "fp32", host_memory=budget))
    assert "pyinfinity.host_memory" in str(ei.value)
    with pyinfinity.initialize(model, config(engine_config, "8bit", host_memory=budget)) as eng:
        report = eng.memory_report()
        assert report.optimizer_state == "8bit" and "(8bit state)" in report.table()
        assert sum(report.optimizer.values()) < 6.2 * n


# ----------------------------------------------------------------------------- checkpoints


def _meta(ckpt) -> dict:
    import json
    import os

    with open(os.path.join(ckpt, "meta.json")) as f:
        return json.load(f)


def _drop_format_record(ckpt) -> None:
    """Makes ``ckpt`` look like a checkpoint written before the formats (no optimizer_state key)."""
    import json
    import os

    from pyinfinity import checkpoint

    meta = _meta(ckpt)
    del meta["optimizer_state"]
    raw = json.dumps(meta).encode()
    with open(os.path.join(ckpt, "meta.json"), "wb") as f:
        f.write(raw)
    path = os.path.join(ckpt, checkpoint.CHECKSUMS_NAME)
    with open(path) as f:
        sums = json.load(f)
    sums["files"]["meta.json"] = {"nbytes": len(raw), "crc32c": checkpoint._crc32c_bytes(raw)}
    with open(path, "w") as f:
        json.dump(sums, f)


@pytest.mark.parametrize("fmt, tier", [("8bit", "cpu"), ("8bit", "nvme"), ("bf16", "nvme")])
def test_a_checkpoint_resumes_exactly_within_a_format(fmt, tier, engine_config, tmp_path):
    """The state is saved as it is (its compressed bytes, the format recorded) and a resume trains
    on bit for bit like the run that went on."""
    dtype = torch.bfloat16 if fmt == "bf16" else torch.float32
    data = batches(6)
    with pyinfinity.initialize(llama(dtype=dtype), config(engine_config, fmt, tier)) as eng:
        train(eng, data[:3])
        ckpt = eng.save_checkpoint(str(tmp_path / "ckpt"))
        state_bytes = sum(eng.memory_report().optimizer.values())
        want = (train(eng, data[3:]), trained(eng))
    meta = _meta(ckpt)
    assert meta["optimizer_state"] == fmt
    assert sum(e["nbytes"] for e in meta["entries"] if e["kind"] == "optim") == state_bytes
    with pyinfinity.initialize(llama(dtype=dtype, seed=5), config(engine_config, fmt, tier)) as eng:
        eng.load_checkpoint(str(tmp_path / "ckpt"))
        got = (train(eng, data[3:]), trained(eng))
    assert got[0] == want[0]
    assert all(torch.equal(a, b) for a, b in zip(got[1], want[1]))


def test_a_checkpoint_of_another_format_is_refused_unless_converted(engine_config, tmp_path):
    """8bit into fp32 and fp32 into 8bit: a one-line CheckpointError naming both formats and the
    way to convert; with convert_optimizer_state=True the masters carry over exactly (both keep
    fp32 masters), the moments through fp32, and training goes on close to the unconverted run."""
    from pyinfinity.checkpoint import CheckpointError

    data = batches(6)
    for src, dst in (("8bit", "fp32"), ("fp32", "8bit")):
        save_dir = str(tmp_path / f"ckpt-{src}")
        with pyinfinity.initialize(llama(), config(engine_config, src)) as eng:
            train(eng, data[:3])
            eng.save_checkpoint(save_dir)
            saved = trained(eng)
            went_on = train(eng, data[3:])
        with pyinfinity.initialize(llama(seed=5), config(engine_config, dst)) as eng:
            with pytest.raises(CheckpointError) as ei:
                eng.load_checkpoint(save_dir)
            msg = str(ei.value)
            assert "\n" not in msg and f"the {src} optimizer state" in msg and f"the {dst} one" in msg
            assert "convert_optimizer_state=True" in msg and "--resume-convert" in msg
            eng.load_checkpoint(save_dir, convert_optimizer_state=True)
            assert eng.global_steps == 3
            assert all(torch.equal(a, b) for a, b in zip(trained(eng), saved))
            losses = train(eng, data[3:])
        assert losses[0] == went_on[0]  # the same weights: the same first loss
        assert losses[-1] == pytest.approx(went_on[-1], rel=0.05)


def test_a_checkpoint_without_a_recorded_format_is_fp32(engine_config, tmp_path):
    """Checkpoints written before the formats hold the fp32 state: they load into an fp32 engine
    and, like any fp32 checkpoint, into a bf16 one only converted (the master rounded to bf16)."""
    from pyinfinity.checkpoint import CheckpointError

    bf16 = dict(dtype=torch.bfloat16)
    with pyinfinity.initialize(llama(**bf16), config(engine_config, "fp32")) as eng:
        train(eng, batches(2))
        ckpt = eng.save_checkpoint(str(tmp_path / "ckpt"))
        saved = trained(eng)
    _drop_format_record(ckpt)
    with pyinfinity.initialize(llama(seed=5, **bf16), config(engine_config, "fp32")) as eng:
        eng.load_checkpoint(str(tmp_path / "ckpt"))
        assert all(torch.equal(a, b) for a, b in zip(trained(eng), saved))
    with pyinfinity.initialize(llama(seed=5, **bf16), config(engine_config, "bf16")) as eng:
        with pytest.raises(CheckpointError, match="holds the fp32 optimizer state, this engine keeps the bf16 one"):
            eng.load_checkpoint(str(tmp_path / "ckpt"))
        eng.load_checkpoint(str(tmp_path / "ckpt"), convert_optimizer_state=True)
        got = trained(eng)
        assert all(torch.equal(a.float(), b.bfloat16().float()) for a, b in zip(got, saved))
        train(eng, batches(2))


@pytest.mark.parametrize("fmt", ["8bit", "bf16"])
def test_export_writes_the_masters_of_a_compressed_state(fmt, engine_config, tmp_path):
    """export() reads the masters through the format: the exported model computes the engine's
    loss on the next batch."""
    dtype = torch.bfloat16 if fmt == "bf16" else torch.float32
    x = batches(1)[0]
    with pyinfinity.initialize(llama(dtype=dtype), config(engine_config, fmt)) as eng:
        train(eng, batches(3))
        eng.export(str(tmp_path / "out"))
        eng.eval()
        with torch.no_grad():
            want = eng(input_ids=x, labels=x).loss.item()
    model = transformers.LlamaForCausalLM.from_pretrained(str(tmp_path / "out"), torch_dtype=dtype)
    with torch.no_grad():
        got = model(input_ids=x, labels=x).loss.item()
    assert got == pytest.approx(want, rel=1e-4)
