"""The model presets: named Llama shapes that `train --model-size`, `plan --model-size` and
`bench train --sizes` all take from this one table.

Each preset is the LlamaConfig fields of one model. ``train`` on its built-in corpus replaces the
vocabulary by its byte-level one (260 tokens) and keeps the rest; ``plan`` and ``bench train``
use the fields as they are.

Where the `train` and `bench train` tables of earlier releases disagreed on a name, one
definition wins and the other has a new name:

* ``tiny`` is `train`'s (hidden 128, 4 layers, 4 heads, intermediate 344): `train`'s default,
  the model a first run trains. `bench train`'s smaller one (hidden 64, 2 layers, vocabulary
  1024) is ``micro``.
* ``3b`` is `bench train`'s (OpenLLaMA-3B's shape: hidden 3200, 26 layers, intermediate 8640),
  the one its recorded results measured. `train`'s (hidden 2560, 32 layers, intermediate 6912)
  is ``2.7b``.

Every other name meant one shape in both tables (``125m``, ``7b``, ``13b``, ``20b``, ``30b``,
``70b``) or was in one of them only, and keeps it; every command now accepts every name.
``ALIASES`` maps the model families' own names to their preset.
"""
from __future__ import annotations

from typing import Any

# what every preset has unless it says otherwise (the LLaMA-1/2 family's)
_LLAMA: dict[str, Any] = dict(vocab_size=32000, max_position_embeddings=2048, rms_norm_eps=1e-5,
                              tie_word_embeddings=False)
SMALL_VOCAB = 1024  # the vocabulary of the shapes below 125m outside `train` (its corpus has its own)


def _llama(hidden: int, intermediate: int, layers: int, heads: int, kv_heads: int, **fields: Any) -> dict[str, Any]:
    """LlamaConfig fields of one shape; the others as ``_LLAMA`` unless ``fields`` sets them."""
    return dict(_LLAMA, **fields, hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers,
                num_attention_heads=heads, num_key_value_heads=kv_heads)


# name -> LlamaConfig fields (hidden, intermediate, layers, attention heads, KV heads, ...)
PRESETS: dict[str, dict[str, Any]] = {
    "micro": _llama(64, 172, 2, 4, 4, vocab_size=SMALL_VOCAB),
    "tiny": _llama(128, 344, 4, 4, 4, vocab_size=SMALL_VOCAB),
    "small": _llama(256, 688, 8, 8, 8, vocab_size=SMALL_VOCAB),
    "medium": _llama(512, 1376, 12, 8, 8, vocab_size=SMALL_VOCAB),
    "125m": _llama(768, 2048, 12, 12, 12),
    "350m": _llama(1024, 2816, 24, 16, 16),
    "1b": _llama(2048, 5504, 16, 16, 16),
    "1.1b": _llama(2048, 5632, 22, 32, 4),  # TinyLlama-1.1B's shape
    "2.7b": _llama(2560, 6912, 32, 32, 32),
    "3b": _llama(3200, 8640, 26, 32, 32),  # OpenLLaMA-3B's shape
    "5b": _llama(4096, 11008, 24, 32, 32),
    "7b": _llama(4096, 11008, 32, 32, 32),  # LLaMA-7B / Llama-2-7B
    "8b": _llama(4096, 14336, 32, 32, 8, vocab_size=128256, max_position_embeddings=8192,
                 rope_theta=500000.0),  # Llama-3-8B
    "10b": _llama(4608, 12288, 40, 36, 36),
    "13b": _llama(5120, 13824, 40, 40, 40),  # LLaMA-13B / Llama-2-13B
    "20b": _llama(6144, 16384, 44, 48, 48),  # between 13B and LLaMA-30B: 20.3B parameters
    "30b": _llama(6656, 17920, 60, 52, 52),  # LLaMA-30B's shape (the original LLaMA release)
    "70b": _llama(8192, 28672, 80, 64, 8),  # Llama-2-70B's shape (grouped-query attention: 8 KV heads)
}

# another name -> the preset it means
ALIASES: dict[str, str] = {
    "tinyllama-1.1b": "1.1b",
    "open-llama-3b": "3b",
    "llama-2-7b": "7b",
    "llama-3-8b": "8b",
    "llama-2-13b": "13b",
    "llama-30b": "30b",
    "llama-2-70b": "70b",
}

NAMES: tuple[str, ...] = tuple(PRESETS) + tuple(ALIASES)  # what the commands accept


def preset(name: str) -> dict[str, Any]:
    """A copy of the LlamaConfig fields of preset ``name`` (or of an alias); KeyError naming the
    choices for another name."""
    key = ALIASES.get(name, name)
    if key not in PRESETS:
        raise KeyError(f"unknown model size {name!r}; choose from {', '.join(NAMES)}")
    return dict(PRESETS[key])


__all__ = ["ALIASES", "NAMES", "PRESETS", "SMALL_VOCAB", "preset"]
