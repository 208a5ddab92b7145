"""Small transformers model directories made in the test (nothing downloaded): a Llama (untied)
and a GPT-2 (tied embeddings, Conv1D, lm_head absent from the file), each saved as several
safetensors shards, with a byte-level BPE tokenizer trained here on a few KB of text."""
from __future__ import annotations

import inspect
import json
import os

import torch

CORPUS = inspect.getsource(json.decoder) + inspect.getsource(json.encoder)


def save_tokenizer(out: str, vocab: int = 320) -> int:
    """Trains a byte-level BPE on CORPUS and saves it as a transformers tokenizer; returns its size."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=["<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator([CORPUS], trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>")
    fast.save_pretrained(out)
    return len(fast)


def make_model_dir(out: str, family: str = "llama", *, hidden: int = 32, layers: int = 2,
                   shard: str = "40KB", seed: int = 0) -> str:
    """A model directory: config, several safetensors shards, tokenizer. Returns ``out``."""
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    os.makedirs(out, exist_ok=True)
    vocab = save_tokenizer(out)
    torch.manual_seed(seed)
    if family == "llama":
        cfg = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128, bos_token_id=0,
                          eos_token_id=1, tie_word_embeddings=False)
        model = LlamaForCausalLM(cfg)
    elif family == "gpt2":
        cfg = GPT2Config(vocab_size=vocab, n_embd=hidden, n_layer=layers, n_head=4, n_positions=128, bos_token_id=0,
                         eos_token_id=1)
        model = GPT2LMHeadModel(cfg)
    else:
        raise ValueError(family)
    model.save_pretrained(out, max_shard_size=shard, safe_serialization=True)
    return out
