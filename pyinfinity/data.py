"""Fine-tuning data: a text file or JSON lines, tokenised with the model's own tokenizer, packed
into fixed-length blocks, shuffled with a seed, with a held-out split for an eval loss.

The training order is a pure function of (seed, epoch), so the position in it (``state_dict``)
is two integers: saved with a checkpoint and restored, a resumed run sees the same batches.
"""
from __future__ import annotations

import itertools
import json
import logging
import os
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Iterator, Optional, Union

if TYPE_CHECKING:  # torch loads when data is read: --data's checks answer without it
    import torch

log = logging.getLogger(__name__)

JSONL_SUFFIXES = (".jsonl", ".json", ".ndjson")
TEXT_CHUNK_CHARS = 1 << 20  # plain text is read in line-aligned chunks of about this many characters
PIECE_CHARS = 1 << 14  # a document is tokenised in pieces of about this many characters, cut at spaces
BATCH_CHARS = 1 << 18  # pieces handed to the tokenizer in one batched call
PROGRESS_S = 2.0  # tokenising a file logs its progress this often


class DataError(ValueError):
    """Data that cannot be used (the message names the file, and the line where there is one)."""


def load_tokenizer(model_dir: Union[str, os.PathLike]) -> Any:
    """The model directory's own tokenizer (transformers' AutoTokenizer; local files only)."""
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(os.fspath(model_dir), local_files_only=True)
    except (OSError, ValueError) as exc:
        raise DataError(f"{model_dir}: no usable tokenizer files (tokenizer.json / tokenizer_config.json): "
                        f"{exc}") from exc
    tok.model_max_length = 1 << 62  # documents are packed into blocks here, never fed whole
    return tok


def _text_lines(path: str) -> Iterator[tuple[int, str]]:
    """(line number, line) of a UTF-8 file; bytes that are not UTF-8 are a DataError naming the
    file, line and byte offset (a binary file given as text data fails at its first bad byte)."""
    offset = 0
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, 1):
            try:
                line = raw.decode("utf-8").replace("\r\n", "\n")  # as text mode reads it
            except UnicodeDecodeError as exc:
                raise DataError(f"{path}:{lineno}: not UTF-8 text (byte 0x{raw[exc.start]:02x} at offset "
                                f"{offset + exc.start}); --data takes a UTF-8 text file or JSON lines: convert it "
                                "(e.g. iconv -f LATIN1 -t UTF-8) or give the text, not a binary file") from None
            offset += len(raw)
            yield lineno, line


def check_data_file(path: str) -> None:
    """DataError unless ``path`` is a regular file (a directory, a device such as /dev/zero, or a
    named pipe is said to be one: reading it would fail late, never end, or block)."""
    import stat

    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        raise DataError(f"--data: {path}: no such file") from None
    kinds = ((stat.S_ISDIR, "a directory (give a text or JSON-lines file in it)"),
             (stat.S_ISFIFO, "a named pipe (FIFO), not a regular file: the data is read whole and measured first; "
                             "write it to a file"),
             (stat.S_ISCHR, "a character device, not a regular file"),
             (stat.S_ISBLK, "a block device, not a regular file"),
             (stat.S_ISSOCK, "a socket, not a regular file"))
    for test, what in kinds:
        if test(mode):
            raise DataError(f"--data: {path} is {what}")
    if not stat.S_ISREG(mode):
        raise DataError(f"--data: {path} is not a regular file")


def read_documents(path: Union[str, os.PathLike], field: str = "text") -> Iterator[str]:
    """The documents of ``path``: one per line of a JSON-lines file (its ``field``), or the
    text file in line-aligned chunks. Errors name the file and line."""
    path = os.fspath(path)
    if path.endswith(JSONL_SUFFIXES):
        for lineno, line in _text_lines(path):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as exc:
                raise DataError(f"{path}:{lineno}: not valid JSON ({exc.msg})") from exc
            if not isinstance(rec, dict) or field not in rec:
                have = sorted(rec) if isinstance(rec, dict) else type(rec).__name__
                raise DataError(f"{path}:{lineno}: no {field!r} field (found {have}); pass the field that holds "
                                "the text with --data-field")
            text = rec[field]
            if not isinstance(text, str):
                raise DataError(f"{path}:{lineno}: field {field!r} is {type(text).__name__}, not a string")
            yield text
        return
    chunk: list[str] = []
    n = 0
    for _lineno, line in _text_lines(path):
        chunk.append(line)
        n += len(line)
        if n >= TEXT_CHUNK_CHARS:
            yield "".join(chunk)
            chunk, n = [], 0
    if chunk:
        yield "".join(chunk)


def split_at_spaces(text: str, size: Optional[int] = None) -> list[str]:
    """``text`` in pieces of about ``size`` characters (default ``PIECE_CHARS``; a stretch without a
    cut point stays whole),
    each cut just before a space that follows a non-space and precedes a non-space: where
    byte-level BPE's and Metaspace's pre-tokenizers start a new word, so tokenising the pieces one
    by one gives the ids of the whole (``_pieces_are_exact`` checks the tokenizer agrees)."""
    size = PIECE_CHARS if size is None else size
    out: list[str] = []
    start, n = 0, len(text)
    while n - start > size:
        cut = text.find(" ", start + size)
        while cut != -1 and (text[cut - 1].isspace() or cut + 1 >= n or text[cut + 1].isspace()):
            cut = text.find(" ", cut + 1)
        if cut == -1:
            break
        out.append(text[start:cut])
        start = cut
    out.append(text[start:])
    return out


def _pieces_are_exact(tokenizer: Any) -> bool:
    """Whether this tokenizer gives a text's ids when fed the text's ``split_at_spaces`` pieces (a
    normalizer that prepends to every sequence, for one, does not)."""
    probe = "The cat,  sat on\n the mat;\tit's 12 345 d\u00e9j\u00e0 vu!  Yes ."
    whole = tokenizer(probe, add_special_tokens=False)["input_ids"]
    pieces = split_at_spaces(probe, 1)
    return list(itertools.chain.from_iterable(tokenizer(pieces, add_special_tokens=False)["input_ids"])) == whole


def _special_ids(tokenizer: Any) -> tuple[list[int], list[int]]:
    """The ids the tokenizer puts before and after a sequence when it adds its special tokens."""
    bare = tokenizer("x", add_special_tokens=False)["input_ids"]
    full = tokenizer("x", add_special_tokens=True)["input_ids"]
    for i in range(len(full) - len(bare) + 1):
        if full[i:i + len(bare)] == bare:
            return full[:i], full[i + len(bare):]
    return [], []


def tokenize_file(path: Union[str, os.PathLike], tokenizer: Any, field: str = "text") -> torch.Tensor:
    """All documents of ``path`` as one 1-D int64 tensor of token ids, each JSON-lines document
    with the tokenizer's special tokens and followed by its EOS token (when it has one).

    Documents are cut into pieces at spaces (``split_at_spaces``: a line of many MB among them)
    and the pieces tokenised in batched calls; a tokenizer for which pieces would give other ids
    gets each document whole. Progress is logged every ``PROGRESS_S`` seconds."""
    import torch

    path = os.fspath(path)
    check_data_file(path)
    jsonl = path.endswith(JSONL_SUFFIXES)
    eos = tokenizer.eos_token_id
    exact = _pieces_are_exact(tokenizer)
    if not exact:
        log.warning("data: %s: this tokenizer gives other ids for text cut at spaces: each document is tokenised "
                    "whole (slow for very long lines)", path)
    before, after = _special_ids(tokenizer) if jsonl else ([], [])
    total = os.path.getsize(path)
    parts: list[torch.Tensor] = []
    docs, done_chars, t_start = 0, 0, time.monotonic()
    t_log = t_start + PROGRESS_S
    batch: list[tuple[str, bool]] = []  # (piece, whether it ends its document) waiting for the tokenizer
    batch_chars = 0
    current: list[int] = []  # the ids of the document being tokenised

    def flush() -> None:
        nonlocal batch, batch_chars, current, t_log
        if not batch:
            return
        ids = tokenizer([p for p, _ in batch], add_special_tokens=False)["input_ids"]
        for piece_ids, (_, last) in zip(ids, batch):
            current.extend(piece_ids)
            if not last:
                continue
            doc = before + current + after if jsonl else current
            if jsonl and eos is not None and (not doc or doc[-1] != eos):
                doc.append(eos)
            if doc:
                parts.append(torch.tensor(doc, dtype=torch.int64))
            current = []
        batch, batch_chars = [], 0
        now = time.monotonic()
        if now >= t_log:
            t_log = now + PROGRESS_S
            log.info("data: tokenising %s: %.1f of %.1f MB (%.0f s)", path, done_chars / 1e6, total / 1e6,
                     now - t_start)

    for doc in read_documents(path, field):
        pieces = split_at_spaces(doc) if exact else [doc]
        for i, piece in enumerate(pieces):
            batch.append((piece, i == len(pieces) - 1))
            batch_chars += len(piece)
            done_chars += len(piece)
            if batch_chars >= BATCH_CHARS:
                flush()
        docs += 1
    flush()
    if not parts:
        raise DataError(f"{path}: no text in it ({docs} documents, 0 tokens)")
    return torch.cat(parts)


@dataclass
class TextData:
    """Token blocks of ``seq`` tokens: ``train`` (shuffled per epoch) and ``eval`` (held out)."""

    train: torch.Tensor  # (n_train, seq) int64
    eval: torch.Tensor  # (n_eval, seq) int64
    seed: int
    source: str  # what the blocks came from (checked on restore)
    epoch: int = 0
    index: int = 0  # next position in this epoch's order

    @classmethod
    def from_file(cls, path: Union[str, os.PathLike], tokenizer: Any, seq: int, *, field: str = "text",
                  eval_fraction: float = 0.05, seed: int = 0) -> "TextData":
        import torch

        if seq < 2:
            raise DataError(f"--seq: {seq} is too short (2 tokens at least)")
        tokens = tokenize_file(path, tokenizer, field)
        n = tokens.numel() // seq
        if n < 1:
            raise DataError(f"{path}: {tokens.numel()} tokens, fewer than one block of --seq {seq}; use a smaller "
                            "--seq or more text")
        blocks = tokens[:n * seq].view(n, seq)
        order = torch.randperm(n, generator=torch.Generator().manual_seed(seed))
        n_eval = min(n - 1, max(1, round(n * eval_fraction))) if eval_fraction > 0 and n > 1 else 0
        held, kept = order[:n_eval], order[n_eval:]
        src = f"{os.path.abspath(os.fspath(path))}:{field}:{seq}:{tokens.numel()}"
        log.info("data: %s: %d tokens -> %d blocks of %d (%d held out for eval)", path, tokens.numel(), n, seq,
                 n_eval)
        return cls(train=blocks[kept.sort().values].clone(), eval=blocks[held.sort().values].clone(), seed=seed,
                   source=src)

    def _order(self, epoch: int) -> torch.Tensor:
        import torch

        return torch.randperm(self.train.shape[0], generator=torch.Generator().manual_seed(self.seed * 1_000_003
                                                                                            + epoch))

    def next_batch(self, batch: int) -> torch.Tensor:
        """The next ``batch`` training blocks (a new shuffled epoch starts when one runs out)."""
        rows = []
        order = self._order(self.epoch)
        while len(rows) < batch:
            if self.index >= order.numel():
                self.epoch, self.index = self.epoch + 1, 0
                order = self._order(self.epoch)
            rows.append(int(order[self.index]))
            self.index += 1
        return self.train[rows]

    def eval_batches(self, batch: int) -> Iterator[torch.Tensor]:
        for i in range(0, self.eval.shape[0], batch):
            yield self.eval[i:i + batch]

    def state_dict(self) -> dict:
        return {"source": self.source, "seed": self.seed, "epoch": self.epoch, "index": self.index}

    def load_state_dict(self, state: dict, origin: Optional[str] = None) -> None:
        """Restores a position saved by ``state_dict``; refuses one taken over other data."""
        where = f"{origin}: " if origin else ""
        if state.get("source") != self.source or state.get("seed") != self.seed:
            raise DataError(f"{where}the checkpoint's data position is for {state.get('source')!r} (seed "
                            f"{state.get('seed')}), not {self.source!r} (seed {self.seed}): resume with the same "
                            "--data, --data-field, --seq and --seed")
        self.epoch, self.index = int(state["epoch"]), int(state["index"])
