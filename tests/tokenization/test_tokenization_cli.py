"""`python -m bertjax.tokenization train|tokenize`, end to end in subprocesses."""

from __future__ import annotations

import importlib.util
import json

import pytest
from conftest import run_python
from tokenization_corpus import make_corpus

from bertjax.tokenization import SPECIAL_TOKENS, load_tokenizer

CLI = ["-m", "bertjax.tokenization"]


@pytest.fixture(scope="module")
def corpus_files(tmp_path_factory):
    root = tmp_path_factory.mktemp("corpus")
    lines = make_corpus(1200, seed=7)
    for i in range(2):
        (root / f"part{i}.txt").write_text("\n".join(lines[i::2]) + "\n", encoding="utf-8")
    return root, lines


def _one_line_error(result, *needles):
    assert result.returncode != 0
    err = result.stderr.strip()
    assert err.startswith("error:") and "\n" not in err, err
    for needle in needles:
        assert needle in err, err


def test_train_wordpiece_then_tokenize(corpus_files, tmp_path):
    root, lines = corpus_files
    out = tmp_path / "wp"
    result = run_python([*CLI, "train", "--input", str(root / "part*.txt"), "--vocab_size",
                         "1500", "--model_type", "wordpiece", "--lowercase", "--output",
                         str(out)])
    assert result.returncode == 0, result.stderr
    vocab = (out / "vocab.txt").read_text(encoding="utf-8").split("\n")[:-1]
    assert vocab[:5] == list(SPECIAL_TOKENS) and len(vocab) == len(set(vocab)) <= 1500
    assert json.loads((out / "tokenizer_config.json").read_text()) == {
        "type": "wordpiece", "do_lower_case": True}

    text = tmp_path / "in.txt"
    sample = [line for line in lines[:300] if "\n" not in line and "\r" not in line
              and "\x0b" not in line and "\x0c" not in line and "\x1c" not in line
              and "\x85" not in line and "\u2028" not in line]
    text.write_text("\n".join(sample) + "\n", encoding="utf-8")
    tok = load_tokenizer(str(out))
    unk = 0
    for flag, lower in (("--do_lower_case", True), ("--no_do_lower_case", False)):
        result = run_python([*CLI, "tokenize", "--vocab", str(out / "vocab.txt"), flag,
                             "--input", str(text), "--output", str(tmp_path / "out.jsonl")])
        assert result.returncode == 0, result.stderr
        rows = [json.loads(r) for r in (tmp_path / "out.jsonl").read_text().splitlines()]
        assert len(rows) == len(sample)
        tok = load_tokenizer(str(out), do_lower_case=lower)
        for line, row in zip(sample, rows):
            assert row["tokens"] == tok.tokenize(line)
            assert row["ids"] == tok.convert_tokens_to_ids(row["tokens"])
            unk += row["ids"].count(tok.unk_id) if lower else 0
    # The vocabulary was trained on this very text: few words are unknown.
    assert unk < 0.05 * sum(len(tok.tokenize(s)) for s in sample)


def test_train_sentencepiece_then_tokenize(corpus_files, tmp_path):
    root, lines = corpus_files
    out = tmp_path / "sp"
    result = run_python([*CLI, "train", "--input", f"{root}/part0.txt,{root}/part1.txt",
                         "--vocab_size", "600", "--model_type", "sentencepiece", "--sp_type",
                         "bpe", "--output", str(out)])
    assert result.returncode == 0, result.stderr
    tok = load_tokenizer(str(out))
    assert tok.vocab_size <= 600 and tok.convert_ids_to_tokens(range(5)) == list(SPECIAL_TOKENS)
    text = tmp_path / "in.txt"
    text.write_text("The [MASK] sat on the mat.\nplain\n", encoding="utf-8")
    result = run_python([*CLI, "tokenize", "--vocab", str(out), "--input", str(text),
                         "--output", str(tmp_path / "o.jsonl")])
    assert result.returncode == 0, result.stderr
    rows = [json.loads(r) for r in (tmp_path / "o.jsonl").read_text().splitlines()]
    assert "[MASK]" in rows[0]["tokens"] and tok.mask_id in rows[0]["ids"]
    assert rows[1]["tokens"] == tok.tokenize("plain")


def test_train_bpe_then_tokenize(corpus_files, tmp_path):
    """--model_type=bpe writes a tokenizer.json that load_tokenizer and `tokenize` read; its
    pieces are the `tokenizers` library's own."""
    from tokenizers import Tokenizer as HFTokenizer

    root, lines = corpus_files
    out = tmp_path / "bpe"
    result = run_python([*CLI, "train", "--input", f"{root}/part0.txt", "--vocab_size", "600",
                         "--model_type", "bpe", "--lowercase", "--output", str(out)])
    assert result.returncode == 0, result.stderr
    assert "tokenizer.json" in result.stdout and "do_lower_case=True" in result.stdout
    tok = load_tokenizer(str(out))
    assert tok.vocab_size <= 600 and tok.convert_ids_to_tokens(range(5)) == list(SPECIAL_TOKENS)
    reference = HFTokenizer.from_file(str(out / "tokenizer.json"))
    for line in lines[:20]:
        assert tok.tokenize(line) == reference.encode(line, add_special_tokens=False).tokens


@pytest.mark.slow
def test_bad_inputs_give_one_line_errors(tmp_path):
    vocab = tmp_path / "vocab.txt"
    vocab.write_text("\n".join([*SPECIAL_TOKENS, "a", "a"]) + "\n")
    good = tmp_path / "good.txt"
    good.write_text("hello\n")
    bad_utf8 = tmp_path / "bad.txt"
    bad_utf8.write_bytes(b"fine\nbroken \xff here\n")
    missing = str(tmp_path / "nothing*.txt")

    _one_line_error(run_python([*CLI, "train", "--input", missing, "--vocab_size", "100",
                                "--output", str(tmp_path / "o")]), "--input", "nothing*.txt")
    _one_line_error(run_python([*CLI, "train", "--input", str(bad_utf8), "--vocab_size", "100",
                                "--output", str(tmp_path / "o")]), f"{bad_utf8}:2")
    _one_line_error(run_python([*CLI, "train", "--input", str(good), "--vocab_size", "many",
                                "--output", str(tmp_path / "o")]), "--vocab_size")
    _one_line_error(run_python([*CLI, "tokenize", "--vocab", str(vocab), "--input", str(good),
                                "--output", str(tmp_path / "o.jsonl")]), str(vocab), "duplicate")
    vocab.write_text("\n".join(SPECIAL_TOKENS) + "\n")
    _one_line_error(run_python([*CLI, "tokenize", "--vocab", str(vocab), "--input",
                                str(bad_utf8), "--output", str(tmp_path / "o.jsonl")]),
                    f"{bad_utf8}:2")
    _one_line_error(run_python([*CLI, "tokenize", "--vocab", str(vocab), "--input",
                                str(tmp_path / "absent.txt"), "--output",
                                str(tmp_path / "o.jsonl")]), "--input", "absent.txt")
    _one_line_error(run_python([*CLI, "tokenize", "--vocab", str(vocab), "--do_lower_case",
                                "--no_do_lower_case", "--input", str(good), "--output",
                                str(tmp_path / "o.jsonl")]), "--no_do_lower_case")


@pytest.mark.slow
def test_bench_compares_with_hf_on_given_files(corpus_files, tmp_path):
    """The bench on a small ASCII English file with a trained vocabulary: every path counts the
    same tokens as HF and reports 100% identical ids (prose from the stdlib, no network)."""
    from tokenization_corpus import prose_lines

    from bertjax.tokenization.train import train_wordpiece

    lines = [s for s in prose_lines() if s.isascii()][:3000]
    text = tmp_path / "en.txt"
    text.write_text("\n".join(lines) + "\n", encoding="utf-8")
    vocab = tmp_path / "vocab.txt"
    vocab.write_text("".join(t + "\n" for t in train_wordpiece(lines, 2000, True)),
                     encoding="utf-8")
    result = run_python(["-m", "bertjax.benchmarks.tokenization", "--input", str(text),
                         "--vocab", str(vocab), "--mb", "0.2", "--exact_mb", "0.05"])
    assert result.returncode == 0, result.stderr
    identical = [s for s in result.stdout.split("\n") if s.startswith("ids identical")]
    assert len(identical) == 4, result.stdout
    assert all("(100.00%)" in s for s in identical[:3]), result.stdout
    rows = [s for s in result.stdout.split("\n") if s.startswith(("HF ", "bertjax fast"))]
    counts = {s[58:].split()[0] for s in rows}
    assert len(rows) == 5 and len(counts) == 1, result.stdout
    if importlib.util.find_spec("tensorflow_text"):  # the routed engine was measured
        assert "ids (tensorflow-text + Python)" in result.stdout
