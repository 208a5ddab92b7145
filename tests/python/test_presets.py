"""One model-preset table (``pyinfinity.presets``) behind `train --model-size`, `plan --model-size`
and `bench train --sizes`."""
from __future__ import annotations

import argparse

import pytest

from pyinfinity.presets import ALIASES, NAMES, PRESETS, preset

SHAPE = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads")


def _choices(parser: argparse.ArgumentParser, dest: str) -> list:
    return next(a.choices for a in parser._actions if a.dest == dest)


def test_train_plan_and_bench_accept_the_same_names():
    from pyinfinity.bench.train_matrix import model_fields
    from pyinfinity.cli.plan import add_parser
    from pyinfinity.cli.train_args import add_arguments

    train = argparse.ArgumentParser()
    add_arguments(train)
    sub = argparse.ArgumentParser().add_subparsers()
    add_parser(sub, "plan placement and sizing")
    assert list(_choices(train, "model_size")) == list(NAMES)
    assert list(_choices(sub.choices["plan"], "model_size")) == list(NAMES)
    for name in NAMES:
        assert {k: model_fields(name, 16)[k] for k in SHAPE} == {k: preset(name)[k] for k in SHAPE}


@pytest.mark.parametrize("name", ["micro", "tiny", "3b", "2.7b", "8b", "70b"])
def test_train_builds_the_presets_shape_on_its_byte_vocabulary(name):
    from pyinfinity.cli.train import VOCAB, llama_config
    from pyinfinity.cli.train_args import add_arguments

    p = argparse.ArgumentParser()
    add_arguments(p)
    cfg = llama_config(p.parse_args(["--model-size", name]))
    assert {k: getattr(cfg, k) for k in SHAPE} == {k: PRESETS[name][k] for k in SHAPE}
    assert cfg.vocab_size == VOCAB
    rope = getattr(cfg, "rope_parameters", None) or {"rope_theta": cfg.rope_theta}  # transformers 5 / 4
    assert rope["rope_theta"] == PRESETS[name].get("rope_theta", 10000.0)


def test_the_names_the_two_old_tables_disagreed_on_have_one_meaning_each():
    """`tiny` is train's (hidden 128, 4 layers), bench's smaller one is `micro`; `3b` is OpenLLaMA-3B's
    (bench's), train's 32-layer one is `2.7b`."""
    assert {k: PRESETS["tiny"][k] for k in SHAPE} == dict(zip(SHAPE, (128, 344, 4, 4, 4)))
    assert {k: PRESETS["micro"][k] for k in SHAPE} == dict(zip(SHAPE, (64, 172, 2, 4, 4)))
    assert {k: PRESETS["3b"][k] for k in SHAPE} == dict(zip(SHAPE, (3200, 8640, 26, 32, 32)))
    assert {k: PRESETS["2.7b"][k] for k in SHAPE} == dict(zip(SHAPE, (2560, 6912, 32, 32, 32)))


def test_8b_is_llama_3_8b():
    from pyinfinity.plan.sizes import llama_sizes

    f = preset("8b")
    assert (f["vocab_size"], f["hidden_size"], f["intermediate_size"], f["num_hidden_layers"],
            f["num_attention_heads"], f["num_key_value_heads"], f["rope_theta"]) == (
        128256, 4096, 14336, 32, 32, 8, 500000.0)
    assert llama_sizes(dict(f, model_type="llama")).numel == 8_030_261_248  # Llama-3-8B's count


def test_an_alias_is_its_preset_and_an_unknown_name_lists_the_choices():
    for alias, name in ALIASES.items():
        assert preset(alias) == PRESETS[name]
    f = preset("7b")
    f["hidden_size"] = 1
    assert PRESETS["7b"]["hidden_size"] == 4096  # a copy
    with pytest.raises(KeyError, match="unknown model size 'huge'; choose from micro, tiny"):
        preset("huge")
