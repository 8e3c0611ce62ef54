"""Entity F1 against seqeval (default = conlleval chunks, strict IOB2 / BIOES), tag-scheme
conversions, and bad tagged input as one line naming file and line."""

import json
import random
import warnings

import numpy as np
import pytest

from bertjax.errors import DataError
from bertjax.tasks.tagging import readers
from bertjax.tasks.tagging.metrics import entity_scores
from bertjax.tasks.tagging.schemes import (
    chunks,
    convert,
    encode_chunks,
    scheme_error,
    strict_chunks,
)

TYPES = ("PER", "LOC", "MISC")


def random_tags(rng, n, prefixes):
    return [rng.choice(["O"] * 2 + [f"{p}-{t}" for p in prefixes for t in TYPES])
            for _ in range(n)]


def corrupt(rng, tags, prefixes):
    return [t if rng.random() < 0.6 else random_tags(rng, 1, prefixes)[0] for t in tags]


def seqeval_scores(gold, predicted, **kw):
    from seqeval.metrics import f1_score, precision_score, recall_score

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # seqeval warns on 0/0; both sides give 0 there
        overall = [f(gold, predicted, **kw) for f in (precision_score, recall_score, f1_score)]
        per_type = f1_score(gold, predicted, average=None, **kw)
    return overall, per_type


@pytest.mark.parametrize("prefixes,strict", [
    ("BI", None),  # IOB1 / IOB2 tags, conlleval's chunks (I- after O starts a chunk)
    ("BIES", None),  # BIOES tags, the same rules extended to E- / S-
    ("BI", "iob2"),  # seqeval mode="strict", scheme=IOB2
    ("BIES", "bioes"),  # mode="strict", scheme=IOBES
])
def test_entity_scores_equal_seqeval(prefixes, strict):
    from seqeval.scheme import IOB2, IOBES

    rng = random.Random(len(prefixes) + (strict is not None))
    kw = {} if strict is None else {"mode": "strict",
                                    "scheme": IOB2 if strict == "iob2" else IOBES}
    sequences = 0
    for _ in range(250):  # 250 corpora of 1..16 sentences: ≥ 2,000 sequences
        gold = [random_tags(rng, rng.randint(1, 15), prefixes)
                for _ in range(rng.randint(1, 16))]
        predicted = [corrupt(rng, g, prefixes) for g in gold]
        sequences += len(gold)
        ours = entity_scores(gold, predicted, strict_scheme=strict)
        (precision, recall, f1), per_type = seqeval_scores(gold, predicted, **kw)
        assert ours["overall"]["precision"] == pytest.approx(precision, abs=1e-12)
        assert ours["overall"]["recall"] == pytest.approx(recall, abs=1e-12)
        assert ours["overall"]["f1"] == pytest.approx(f1, abs=1e-12)
        # seqeval's per-type F1s are in sorted type order, for the types of either side.
        types = sorted(k for k in ours if k != "overall"
                       and (ours[k]["gold"] or ours[k]["predicted"]))
        if strict is None:
            np.testing.assert_allclose([ours[t]["f1"] for t in types], per_type, atol=1e-12)
    assert sequences >= 2000


def test_conlleval_chunk_rules():
    # An I- tag after O (or after another type) starts a chunk, as conlleval counts IOB1.
    assert chunks(["O", "I-PER", "I-PER", "I-LOC", "B-LOC", "O"]) == [
        ("PER", 1, 3), ("LOC", 3, 4), ("LOC", 4, 5)]
    assert chunks(["B-PER", "E-PER", "S-LOC", "I-LOC"]) == [
        ("PER", 0, 2), ("LOC", 2, 3), ("LOC", 3, 4)]
    # Strict IOB2 drops the dangling I-; strict BIOES drops B- without E-.
    assert strict_chunks(["O", "I-PER", "B-LOC", "I-LOC"], "iob2") == [("LOC", 2, 4)]
    assert strict_chunks(["B-PER", "I-PER", "O", "S-LOC"], "bioes") == [("LOC", 3, 4)]


def random_chunks(rng, n):
    """Non-overlapping chunks over n words, adjacent ones included."""
    out, i = [], 0
    while i < n:
        if rng.random() < 0.5:
            end = min(n, i + rng.randint(1, 4))
            out.append((rng.choice(TYPES), i, end))
            i = end
        else:
            i += 1
    return out


def test_tag_scheme_conversions_round_trip():
    rng = random.Random(0)
    schemes = ("iob1", "iob2", "bioes")
    for _ in range(2000):
        n = rng.randint(1, 14)
        spans = random_chunks(rng, n)
        encoded = {s: encode_chunks(n, spans, s) for s in schemes}
        for source in schemes:
            assert scheme_error(encoded[source], source) is None
            assert chunks(encoded[source]) == spans  # conlleval reads every scheme's chunks
            for target in schemes:
                there = convert(encoded[source], source, target)
                assert there == encoded[target]
                assert convert(there, target, source) == encoded[source]


def test_iob1_as_distributed_becomes_iob2():
    iob1 = ["I-ORG", "I-ORG", "O", "I-PER", "B-PER", "O", "I-LOC"]
    assert convert(iob1, "iob1", "iob2") == [
        "B-ORG", "I-ORG", "O", "B-PER", "B-PER", "O", "B-LOC"]
    assert convert(iob1, "iob1", "bioes") == [
        "B-ORG", "E-ORG", "O", "S-PER", "S-PER", "O", "S-LOC"]


# ---------------------------------------------------------------------------------------------
# Readers


def test_conll2003_reader_documents_and_columns(tmp_path):
    path = tmp_path / "eng.train"
    path.write_text("-DOCSTART- -X- -X- O\n\nEU NNP B-NP I-ORG\nrejects VBZ B-VP O\n\n"
                    "Peter NNP B-NP I-PER\nBlackburn NNP I-NP I-PER\n\n"
                    "-DOCSTART- -X- -X- O\n\nBRUSSELS NNP B-NP I-LOC\n\n")
    sentences = readers.read_columns(str(path), scheme="iob1", target="iob2")
    assert [s.words for s in sentences] == [("EU", "rejects"), ("Peter", "Blackburn"),
                                            ("BRUSSELS",)]
    assert [s.tags for s in sentences] == [("B-ORG", "O"), ("B-PER", "I-PER"), ("B-LOC",)]
    assert [s.document for s in sentences] == [0, 0, 1]
    assert sentences[1].source == f"{path}:6"
    pos = readers.read_columns(str(path), tag_column=1, scheme="none", target="none")
    assert pos[0].tags == ("NNP", "VBZ")
    assert readers.infer_labels(sentences) == ("O", "B-LOC", "B-ORG", "B-PER", "I-PER")


def test_jsonl_reader(tmp_path):
    path = tmp_path / "train.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in [
        {"tokens": ["a", "b"], "tags": ["S-PER", "O"], "document": 1},
        {"tokens": ["c"], "tags": ["O"], "document": 1},
        {"tokens": ["d", "e"], "tags": ["B-LOC", "E-LOC"], "document": 2}]) + "\n")
    sentences = readers.read_file(str(path), scheme="bioes", target="iob2")
    assert [s.tags for s in sentences] == [("B-PER", "O"), ("O",), ("B-LOC", "I-LOC")]
    assert [s.document for s in sentences] == [0, 0, 1]


@pytest.mark.parametrize("name,text,kwargs,message", [
    ("ragged.conll", "a NN O\nb NN\n\n", {}, "ragged.conll:2: 2 columns"),
    ("scheme.conll", "a O\nb I-PER\n\n", {"scheme": "iob2"},
     "scheme.conll:2: tag 'I-PER' after O breaks the iob2 scheme"),
    ("iob1.conll", "x O\n\na O\nb B-PER\n\n", {"scheme": "iob1"},
     "iob1.conll:4: tag 'B-PER' after O breaks the iob1 scheme"),
    ("prefix.conll", "a O\nb E-PER\n\n", {"scheme": "iob2"},
     "prefix.conll:2: tag 'E-PER' is not a iob2 tag"),
    ("empty.jsonl", '{"tokens": ["a"], "tags": ["O"]}\n{"tokens": [], "tags": []}\n', {},
     "empty.jsonl:2: empty sentence"),
    ("count.jsonl", '{"tokens": ["a", "b"], "tags": ["O"]}\n', {},
     "count.jsonl:1: 2 tokens but 1 tags"),
])
def test_bad_input_is_one_line_naming_file_and_line(tmp_path, name, text, kwargs, message):
    path = tmp_path / name
    path.write_text(text)
    kwargs = {"scheme": "iob2", "target": "iob2", **kwargs}
    with pytest.raises(DataError) as err:
        readers.read_file(str(path), **kwargs)
    assert message in str(err.value) and "\n" not in str(err.value)
    assert str(err.value).startswith(str(path))


def test_unknown_tag_names_file_and_line(tmp_path):
    train, dev = tmp_path / "train.conll", tmp_path / "dev.conll"
    train.write_text("a O\nb B-PER\n\n")
    dev.write_text("a O\n\nb O\nc B-PER\nd B-ORG\n\n")
    labels = readers.infer_labels(readers.read_columns(str(train), scheme="iob2"))
    with pytest.raises(DataError, match=rf"^{dev}:5: unknown tag 'B-ORG'"):
        readers.check_labels(readers.read_columns(str(dev), scheme="iob2"), labels)
