"""Fine-tuning data: text and JSON lines tokenised with the model's tokenizer, packed, shuffled
with a seed, held out, its position saved and restored; the `train --model --data` CLI end to
end (fine-tune, eval, save/resume continuing with the same batches and losses, export), and bad
data files as errors naming file and line."""
from __future__ import annotations

import json
import os
import sys

import pytest
import torch

from pyinfinity.data import DataError, TextData, load_tokenizer, tokenize_file

sys.path.insert(0, os.path.dirname(__file__))
from pretrained_dirs import CORPUS, make_model_dir, save_tokenizer  # noqa: E402


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("tok")
    save_tokenizer(str(d))
    return str(d)


def test_text_and_jsonl_pack_shuffle_hold_out(tok_dir, tmp_path):
    tok = load_tokenizer(tok_dir)
    txt = tmp_path / "a.txt"
    txt.write_text(CORPUS)
    ids = tokenize_file(str(txt), tok)
    assert tok.decode(ids.tolist()) == CORPUS  # byte-level: lossless
    data = TextData.from_file(str(txt), tok, 32, eval_fraction=0.1, seed=3)
    n = ids.numel() // 32
    assert data.train.shape[0] + data.eval.shape[0] == n and data.eval.shape[0] == round(n * 0.1)
    blocks = {tuple(b.tolist()) for b in ids[:n * 32].view(n, 32)}
    got = [tuple(b.tolist()) for b in torch.cat([data.train, data.eval])]
    assert set(got) == blocks and len(got) == n  # a partition of the packed blocks
    # the order: seeded, each epoch a permutation of the train blocks
    first = torch.cat([data.next_batch(4) for _ in range(data.train.shape[0] // 4)])
    assert len({tuple(b.tolist()) for b in first}) == first.shape[0]
    again = TextData.from_file(str(txt), tok, 32, eval_fraction=0.1, seed=3)
    assert torch.equal(again.next_batch(4), first[:4])
    other = TextData.from_file(str(txt), tok, 32, eval_fraction=0.1, seed=4)
    assert not torch.equal(other.next_batch(8), first[:8])

    jl = tmp_path / "b.jsonl"
    docs = [CORPUS[i:i + 500] for i in range(0, 5000, 500)]
    jl.write_text("\n".join(json.dumps({"body": d, "n": i}) for i, d in enumerate(docs)) + "\n\n")
    ids = tokenize_file(str(jl), tok, field="body")
    assert int((ids == tok.eos_token_id).sum()) == len(docs)  # each document ends with EOS


def test_position_save_restore_gives_the_same_batches(tok_dir, tmp_path):
    tok = load_tokenizer(tok_dir)
    txt = tmp_path / "a.txt"
    txt.write_text(CORPUS)
    a = TextData.from_file(str(txt), tok, 16, seed=1)
    for _ in range(7):  # past an epoch boundary on the way
        a.next_batch(a.train.shape[0] // 3)
    state = json.loads(json.dumps(a.state_dict()))  # survives a checkpoint's JSON
    b = TextData.from_file(str(txt), tok, 16, seed=1)
    b.load_state_dict(state)
    assert a.epoch >= 2
    for _ in range(5):
        assert torch.equal(a.next_batch(5), b.next_batch(5))
    c = TextData.from_file(str(txt), tok, 32, seed=1)
    with pytest.raises(DataError, match="resume with the same --data"):
        c.load_state_dict(state, origin="ckpt/global_step3")


@pytest.mark.parametrize("content, name, match", [
    ("", "empty.txt", r"empty.txt: no text in it"),
    ("\n\n", "blank.jsonl", r"blank.jsonl: no text in it"),
    ('{"text": "hello"}\n{"body": "x"}\n', "nofield.jsonl", r"nofield.jsonl:2: no 'text' field \(found \['body'\]\)"),
    ('{"text": "hello"}\n{"text": \n', "torn.jsonl", r"torn.jsonl:2: not valid JSON"),
    ('{"text": 5}\n', "num.jsonl", r"num.jsonl:1: field 'text' is int"),
    ("ab", "short.txt", r"short.txt: \d+ tokens, fewer than one block"),
])
def test_bad_data_files(content, name, match, tok_dir, tmp_path):
    p = tmp_path / name
    p.write_text(content)
    with pytest.raises(DataError, match=match):
        TextData.from_file(str(p), load_tokenizer(tok_dir), 64)


# ----------------------------------------------------------------------------------- CLI


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_model_dir(str(tmp_path_factory.mktemp("m") / "llama"), "llama")


def _train(*argv: str) -> dict:
    from pyinfinity.cli import main

    out = argv[argv.index("--json") + 1]
    assert main(["train", "--no-progress", "--device", "cpu", "--batch", "2", "--seq", "32", "--warmup", "2",
                 "--lr", "1e-3", *argv]) == 0
    return json.load(open(out))


def test_cli_finetune_eval_save_resume_export(model_dir, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps({"text": CORPUS[i:i + 400]}) + "\n" for i in range(0, len(CORPUS), 400)))
    common = ["--model", model_dir, "--data", str(data), "--steps", "6", "--offload", "nvme",
              "--nvme", str(tmp_path / "swap")]
    full = _train(*common, "--eval-every", "3", "--json", str(tmp_path / "full.json"),
                  "--export", str(tmp_path / "out"))
    s = full["summary"]
    assert s["steps"] == 6 and [e["step"] for e in s["evals"]] == [3, 6]
    assert s["last_loss"] < s["first_loss"] and s["evals"][1]["loss"] < s["evals"][0]["loss"]
    assert s["load_seconds"] > 0 and s["peak_rss_load"] > 0 and s["tokens_per_s"] > 0
    assert s["weights_missing"] == [] and s["weights_unexpected"] == []
    AutoModelForCausalLM.from_pretrained(str(tmp_path / "out"), local_files_only=True)
    AutoTokenizer.from_pretrained(str(tmp_path / "out"), local_files_only=True)
    # 3 steps, save; resume for the other 3: the same batches, so the same losses
    first = _train(*common, "--stop-after", "3", "--save", str(tmp_path / "ck"), "--json", str(tmp_path / "a.json"))
    rest = _train(*common, "--resume", str(tmp_path / "ck"), "--json", str(tmp_path / "b.json"))
    losses = [r["loss"] for r in first["steps"]] + [r["loss"] for r in rest["steps"]]
    assert [r["step"] for r in rest["steps"]] == [4, 5, 6]
    torch.testing.assert_close(torch.tensor(losses), torch.tensor([r["loss"] for r in full["steps"]]), rtol=1e-6,
                               atol=0)


def test_cli_bad_data_fails_before_anything_is_written(model_dir, tmp_path, capsys):
    from pyinfinity.cli import main

    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "fine"}\n{"content": "no text field"}\n')
    swap = tmp_path / "swap"
    rc = main(["train", "--no-progress", "--device", "cpu", "--model", model_dir, "--data", str(bad), "--offload",
               "nvme", "--nvme", str(swap)])
    assert rc == 2  # a user's mistake: one line on stderr, exit status 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "bad.jsonl:2: no 'text' field" in err[0], err
    assert not swap.exists() or not any(swap.rglob("*"))
    assert main(["train", "--device", "cpu", "--model", model_dir]) == 2
    assert "--model and --data go together" in capsys.readouterr().err


# ----------------------------------------------------------------------------- long lines


def test_a_long_line_is_tokenised_in_pieces_cut_at_spaces_with_the_ids_of_the_whole(tok_dir, tmp_path, monkeypatch,
                                                                                    caplog):
    """One line of text (no newline) is cut into pieces where the byte-level pre-tokenizer starts
    a word, the pieces tokenised in batched calls: the ids are those of the line tokenised whole
    (double spaces, tabs, punctuation, digits and non-ASCII letters across the cuts), for plain
    text and for a JSON-lines document (its special tokens once, around the whole); progress is
    logged while it runs."""
    from pyinfinity import data

    tok = load_tokenizer(tok_dir)
    line = (CORPUS.replace("\n", " ") + "  double\tspace, déjà vu 12 345 !! ") * 3
    monkeypatch.setattr(data, "PIECE_CHARS", 97)
    monkeypatch.setattr(data, "BATCH_CHARS", 4096)
    monkeypatch.setattr(data, "PROGRESS_S", 0.0, raising=False)
    assert len(data.split_at_spaces(line)) > 100 and "".join(data.split_at_spaces(line)) == line
    txt = tmp_path / "long.txt"
    txt.write_text(line)
    with caplog.at_level("INFO", logger="pyinfinity.data"):
        ids = tokenize_file(str(txt), tok)
    assert ids.tolist() == tok(line, add_special_tokens=False)["input_ids"]
    progress = [r.message for r in caplog.records if "tokenising" in r.message]
    assert len(progress) > 3 and "long.txt" in progress[0] and " MB" in progress[0], progress
    jl = tmp_path / "long.jsonl"
    jl.write_text(json.dumps({"text": line}) + "\n")
    want = tok(line, add_special_tokens=True)["input_ids"]
    assert tokenize_file(str(jl), tok).tolist() == want + ([tok.eos_token_id] if want[-1] != tok.eos_token_id else [])


def test_a_stretch_without_a_cut_point_stays_whole():
    from pyinfinity.data import split_at_spaces

    assert split_at_spaces("x" * 50 + " y", 10) == ["x" * 50, " y"]
    assert split_at_spaces("a  b" * 20, 5)[0].startswith("a  ba")  # never inside a run of spaces
    assert split_at_spaces("z" * 40, 10) == ["z" * 40]


@pytest.mark.parametrize("kind, needle", [("directory", "is a directory"), ("dev_zero", "is a character device"),
                                          ("fifo", "is a named pipe (FIFO)")])
def test_cli_data_that_is_not_a_regular_file_says_what_it_is(kind, needle, model_dir, tmp_path):
    import subprocess
    import sys as _sys

    path = {"directory": str(tmp_path), "dev_zero": "/dev/zero", "fifo": str(tmp_path / "pipe")}[kind]
    if kind == "fifo":
        os.mkfifo(path)
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    p = subprocess.run([_sys.executable, "-m", "pyinfinity", "train", "--device", "cpu", "--model", model_dir,
                        "--data", path], capture_output=True, text=True, timeout=300,
                       env={**os.environ, "PYTHONPATH": repo + os.pathsep + os.environ.get("PYTHONPATH", "")})
    last = p.stderr.strip().splitlines()[-1]
    assert p.returncode == 2 and "Traceback" not in p.stderr, p.stderr[-2000:]
    assert last.startswith("pyinfinity train: error: --data: " + path) and needle in last, last
