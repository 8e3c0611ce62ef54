"""data_pipeline without TensorFlow: corpus readers, pair creation, NumPy masking, packing.

Tokenized documents come from a stand-in WordPiece-like vocabulary (pipeline_data.py: pieces are
whitespace-separated; "##x" continues a word), so these tests do not depend on
bertjax.tokenization.
"""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
from pipeline_data import (
    CLS,
    SEP,
    SPECIAL,
    check_masking_statistics,
    masking_corpus,
    stand_in_masking_config,
    stand_in_tokenizer,
    write_reference,
)

from data_pipeline import corpus, instances, masking, packing

# ------------------------------------------------------------------------------------- corpus


def test_split_sentences_keeps_abbreviations_and_initials():
    text = ("Mr. Smith went to Washington. He arrived at 5 p.m. on Monday! Did J. R. Doe "
            "agree? \"Yes,\" he said. (It was 2024.) Done")
    assert corpus.split_sentences(text) == [
        "Mr. Smith went to Washington.", "He arrived at 5 p.m. on Monday!",
        "Did J. R. Doe agree?", "\"Yes,\" he said.", "(It was 2024.)", "Done"]


def test_reference_reader_documents_and_blank_lines(tmp_path):
    path = tmp_path / "c.txt"
    path.write_text("a b.\nc d.\n\n\n\none only.\n\ne f.\ng h.")  # no trailing newline
    assert list(corpus.read_reference(str(path))) == [["a b.", "c d."], ["one only."],
                                                      ["e f.", "g h."]]
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    assert list(corpus.read_reference(str(empty))) == []


def test_invalid_utf8_names_file_and_line(tmp_path):
    path = tmp_path / "bad.txt"
    path.write_bytes(b"fine line\n\xff\xfe broken\n")
    with pytest.raises(corpus.CorpusError, match=r"bad\.txt:2: invalid UTF-8"):
        list(corpus.read_reference(str(path)))


def test_very_long_line_is_split_into_bounded_pieces(tmp_path):
    words = [f"word{i}" for i in range(60_000)]
    path = tmp_path / "long.txt"
    path.write_text(" ".join(words) + "\n")
    (doc,) = corpus.read_reference(str(path))
    assert len(doc) > 1 and max(map(len, doc)) <= corpus.MAX_LINE_CHARS
    assert " ".join(doc).split() == words


def test_jsonl_reader_and_bad_json(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text(json.dumps({"text": "One here. Two there."}) + "\n\n"
                    + json.dumps({"text": "Three."}) + "\n")
    assert list(corpus.read_jsonl(str(path))) == [["One here.", "Two there."], ["Three."]]
    path.write_text('{"text": "ok."}\n{"text": broken}\n')
    with pytest.raises(corpus.CorpusError, match=r"d\.jsonl:2: invalid JSON"):
        list(corpus.read_jsonl(str(path)))


def test_plain_reader_one_document_per_file(tmp_path):
    (tmp_path / "a.txt").write_text("First sentence. Second one!\nA new line.\n")
    (tmp_path / "b.txt").write_text("Other file.")
    docs = list(corpus.iter_documents(str(tmp_path), "plain"))
    assert docs == [["First sentence.", "Second one!", "A new line."], ["Other file."]]


def test_document_shards_partition_the_corpus(tmp_path):
    docs = [[f"doc {i} sentence {j}." for j in range(2)] for i in range(23)]
    write_reference(tmp_path / "a.txt", docs[:10])
    write_reference(tmp_path / "b.txt", docs[10:])
    inputs = str(tmp_path / "*.txt")
    for n in (4, 2):  # more shards than files: by document; otherwise: by file
        shards = [list(corpus.iter_documents(inputs, shard_index=i, num_shards=n))
                  for i in range(n)]
        flat = [d for s in shards for d in s]
        assert sorted(map(tuple, flat)) == sorted(map(tuple, docs))
        assert len(flat) == len(docs)  # disjoint
    assert [len(s) for s in shards] == [10, 13]
    with pytest.raises(corpus.CorpusError, match="missing.txt: no such input file"):
        list(corpus.iter_documents(str(tmp_path / "missing.txt")))


# ------------------------------------------------------------------------------ instances


def positional_corpus(num_docs, seed, sentence_len=(3, 20), sentences=(10, 50)):
    """Every token id is unique (10 + global position): A/B provenance is readable from ids."""
    rng = np.random.default_rng(seed)
    docs, next_id, ranges = [], 10, []
    for _ in range(num_docs):
        doc, start = [], next_id
        for _ in range(rng.integers(*sentences)):
            n = int(rng.integers(*sentence_len))
            doc.append(np.arange(next_id, next_id + n, dtype=np.int32))
            next_id += n
        docs.append(doc)
        ranges.append((start, next_id))
    return docs, ranges


def test_instances_structure_nsp_and_provenance():
    docs, ranges = positional_corpus(400, seed=0)
    cfg = instances.PairConfig(max_seq_length=128, short_seq_prob=0.1, dupe_factor=3,
                               pool_size=50)
    out = list(instances.generate_instances(docs, cfg, CLS, SEP, np.random.default_rng(1)))
    assert len(out) > 4000
    doc_of = lambda t: int(np.searchsorted([r[1] for r in ranges], t, side="right"))
    for inst in out:
        t, seg = inst.tokens, inst.segment_ids
        assert len(t) <= 128 and t[0] == CLS and t[-1] == SEP
        (seps,) = np.nonzero(t == SEP)
        assert len(seps) == 2 and (t == CLS).sum() == 1
        a, b = t[1:seps[0]], t[seps[0] + 1:-1]
        assert len(a) >= 1 and len(b) >= 1
        np.testing.assert_array_equal(seg, np.r_[np.zeros(len(a) + 2), np.ones(len(b) + 1)])
        # Each segment is a contiguous span of one document.
        assert (np.diff(a) == 1).all() and (np.diff(b) == 1).all()
        assert doc_of(a[0]) == inst.a_doc and doc_of(b[0]) == inst.b_doc
        if inst.is_random_next:
            assert inst.b_doc != inst.a_doc
        else:
            assert inst.b_doc == inst.a_doc and b[0] > a[-1]
    not_next = np.mean([i.is_random_next for i in out])
    assert abs(not_next - 0.5) < 0.02, not_next
    # Short targets (short_seq_prob) add instances well below max_seq_length.
    short = lambda insts: np.mean([len(i.tokens) < 64 for i in insts])
    no_short = dataclasses.replace(cfg, short_seq_prob=0.0)
    baseline = list(instances.generate_instances(docs, no_short, CLS, SEP,
                                                 np.random.default_rng(1)))
    assert short(out) > short(baseline) + 0.03
    assert np.mean([len(i.tokens) == 128 for i in baseline]) > 0.5
    # Every document is used dupe_factor times as A's source.
    counts = np.bincount([i.a_doc for i in out], minlength=len(docs))
    assert (counts >= cfg.dupe_factor).all()


def test_truncation_trims_longer_side_from_both_ends():
    rng = np.random.default_rng(0)
    fronts = backs = 0
    for _ in range(200):
        a_front, a_back, b_front, b_back = instances.truncation(100, 30, 60, rng)
        assert a_front + a_back == 70 and b_front == b_back == 0  # A: 30 contiguous tokens left
        fronts += a_front > 0
        backs += a_back > 0
    assert fronts > 150 and backs > 150  # both ends are trimmed


def test_truncation_totals_follow_the_reference_loop():
    """Per-segment totals against a literal run of the reference's one-token-at-a-time loop."""
    rng = np.random.default_rng(1)
    for _ in range(3000):
        len_a, len_b = (int(x) for x in rng.integers(0, 200, 2))
        limit = int(rng.integers(1, 260))
        a, b = len_a, len_b
        while a + b > limit:
            if a > b:
                a -= 1
            else:
                b -= 1
        af, ab, bf, bb = instances.truncation(len_a, len_b, limit, rng)
        assert min(af, ab, bf, bb) >= 0
        assert (len_a - af - ab, len_b - bf - bb) == (a, b), (len_a, len_b, limit)


def test_random_draws_are_uniform_and_binomial():
    draws = instances.RandomDraws(np.random.default_rng(2), block=1000)
    ints = np.array([draws.integers(3, 10) for _ in range(70_000)])
    np.testing.assert_allclose(np.bincount(ints, minlength=10)[3:] / len(ints), 1 / 7, atol=0.005)
    assert ints.min() == 3 and ints.max() == 9
    for n in (1, 37, 64, 150):  # within one word, exactly one word, several words
        heads = np.array([draws.heads(n) for _ in range(20_000)])
        assert heads.min() >= 0 and heads.max() <= n
        assert abs(heads.mean() - n / 2) < 0.05 * np.sqrt(n) + 0.01
        assert abs(heads.var() - n / 4) < 0.06 * n / 4


def test_generation_is_deterministic_per_seed():
    docs, _ = positional_corpus(60, seed=3)
    cfg = instances.PairConfig(64, 0.1, 2, 10)
    run = lambda s: [(i.tokens.tolist(), i.is_random_next) for i in
                     instances.generate_instances(docs, cfg, CLS, SEP, np.random.default_rng(s))]
    assert run(5) == run(5)
    assert run(5) != run(6)


def test_streaming_holds_a_bounded_document_pool():
    docs, _ = positional_corpus(300, seed=4)
    consumed = 0

    def stream():
        nonlocal consumed
        for d in docs:
            consumed += 1
            yield d

    cfg = instances.PairConfig(128, 0.1, 1, pool_size=20)
    finished = set()
    for inst in instances.generate_instances(stream(), cfg, CLS, SEP, np.random.default_rng(0)):
        finished.add(inst.a_doc)
        # Documents read but not yet fully used never exceed the pool (+ the one in hand).
        assert consumed - (len(finished) - 1) <= cfg.pool_size + 1
    assert consumed == len(docs)


def test_single_document_shard_makes_no_notnext():
    docs, _ = positional_corpus(1, seed=5)
    out = list(instances.generate_instances(docs, instances.PairConfig(64, 0.0, 2, 10), CLS,
                                            SEP, np.random.default_rng(0)))
    assert out and not any(i.is_random_next for i in out)


# -------------------------------------------------------------------------------- masking


def test_num_to_predict_matches_python_round():
    n = np.arange(0, 600)
    for p, mp in [(0.15, 20), (0.15, 80), (0.2, 76)]:
        expected = [min(mp, max(1, int(round(k * p)))) for k in n]
        np.testing.assert_array_equal(masking.num_to_predict(n, p, mp), expected)


@pytest.mark.parametrize("whole_word", [False, True])
def test_static_masking_statistics(whole_word):
    tok, seqs = masking_corpus()
    cfg = stand_in_masking_config(tok, whole_word)
    rng = np.random.default_rng(1)
    results = []
    for s in seqs:  # one sequence at a time: batches of one, no padding
        out, positions, labels, counts = masking.mask_batch(s[None], [len(s)], cfg, rng)
        results.append((out[0], positions[0, :counts[0]], labels[0, :counts[0]]))
    check_masking_statistics(seqs, results, cfg, [len(s) for s in seqs])


@pytest.mark.parametrize("whole_word", [False, True])
def test_static_batch_masking_statistics_and_padding(whole_word):
    tok, seqs = masking_corpus(seed=3)
    cfg = stand_in_masking_config(tok, whole_word)
    ids = np.full((len(seqs), 128), 7, np.int32)  # padding a non-special id: must stay put
    for i, s in enumerate(seqs):
        ids[i, :len(s)] = s
    lengths = np.array([len(s) for s in seqs])
    out, pos, lab, counts = masking.mask_batch(ids, lengths, cfg, np.random.default_rng(4))
    assert pos.shape == lab.shape == (len(seqs), 20) and out.shape == ids.shape
    results = []
    for i, n in enumerate(lengths):
        k = counts[i]
        assert (out[i, n:] == 7).all() and (pos[i, k:] == 0).all() and (lab[i, k:] == 0).all()
        results.append((out[i, :n], pos[i, :k], lab[i, :k]))
    check_masking_statistics(seqs, results, cfg, lengths)


def test_numpy_greedy_matches_a_sequential_walk():
    rng = np.random.default_rng(6)
    sorted_len = rng.choice([0, 1, 1, 1, 2, 3, 5], size=(300, 40))
    budget = rng.integers(1, 21, 300)
    got = masking._greedy_take_rows(sorted_len, budget)
    for row in range(300):
        total, expected = 0, []
        for n in sorted_len[row]:
            expected.append(bool(n) and total + n <= budget[row])
            total += n if expected[-1] else 0
        assert got[row].tolist() == expected, row


def test_flags_round_trip():
    flags = np.random.default_rng(0).random(30_523) < 0.2
    np.testing.assert_array_equal(masking.decode_flags(masking.encode_flags(flags), 30_523), flags)


def test_whole_word_needs_continuation_flags():
    with pytest.raises(ValueError, match="continuation"):
        masking.MaskingConfig(20, 100, 4, SPECIAL, whole_word=True)


# -------------------------------------------------------------------------------- packing


def test_packing_keeps_examples_separate_and_reduces_padding():
    rng = np.random.default_rng(0)
    examples = []
    for i in range(500):
        n = int(rng.integers(5, 60))
        ids = rng.integers(5, 1000, n).astype(np.int32)
        pos = np.sort(rng.choice(n, min(n, 3), replace=False)).astype(np.int32)
        examples.append({"input_ids": ids, "segment_ids": (np.arange(n) > n // 2).astype(np.int32),
                         "masked_lm_positions": pos, "masked_lm_ids": ids[pos], "label": i})
    stats = packing.PackingStats(128)
    rows = list(packing.pack_examples(examples, 128, max_predictions=20,
                                      example_features=("label",), stats=stats))
    seen = []
    for row in rows:
        assert len(row["input_ids"]) == 128
        ids = row["packing_ids"]
        assert (row["input_mask"] == (ids > 0)).all()
        # Examples are contiguous blocks numbered 1, 2, ... followed by padding only.
        real = ids[ids > 0]
        assert (np.diff(real) >= 0).all() and (np.diff(real) <= 1).all() and real[0] == 1
        assert (ids[len(real):] == 0).all()
        pred = row["masked_lm_weights"] > 0
        np.testing.assert_array_equal(row["input_ids"][row["masked_lm_positions"][pred]],
                                      row["masked_lm_ids"][pred])
        for k in range(1, real.max() + 1):
            block = np.flatnonzero(ids == k)
            ex = examples[row["label"][k - 1]]
            np.testing.assert_array_equal(row["input_ids"][block], ex["input_ids"])
            np.testing.assert_array_equal(row["segment_ids"][block], ex["segment_ids"])
            np.testing.assert_array_equal(row["position_ids"][block], np.arange(len(block)))
            in_block = pred & np.isin(row["masked_lm_positions"], block)
            np.testing.assert_array_equal(row["masked_lm_positions"][in_block] - block[0],
                                          ex["masked_lm_positions"])
            seen.append(row["label"][k - 1])
        assert row["example_weights"].sum() == real.max()
    assert sorted(seen) == list(range(500))  # every example exactly once
    tokens = sum(len(e["input_ids"]) for e in examples)
    assert stats.rows == len(rows)
    assert stats.padding_before == pytest.approx(1 - tokens / (500 * 128))
    assert stats.padding_after == pytest.approx(1 - tokens / (len(rows) * 128))
    assert stats.padding_after < 0.1 < 0.5 < stats.padding_before
    with pytest.raises(ValueError, match="129 tokens"):
        list(packing.pack_examples([{"input_ids": np.zeros(129)}], 128))


# ------------------------------------------------------------------------------- metadata


def test_metadata_written_read_back_and_checked(tmp_path):
    from bertjax.errors import DataError
    from data_pipeline import metadata

    tok = stand_in_tokenizer()
    meta = {"masking": "dynamic", "max_seq_length": 64, "masked_lm_prob": 0.2,
            "do_whole_word_mask": True, **metadata.tokenizer_fields(tok)}
    assert metadata.write(str(tmp_path), meta) == str(tmp_path / "metadata.json")
    pattern = str(tmp_path / "part-*")
    assert metadata.read(pattern) == (str(tmp_path / "metadata.json"), meta)
    assert metadata.read(str(tmp_path / "none" / "part-*")) is None
    assert metadata.file_name(1, 3) == "metadata-00001-of-00003.json"
    # What the readers need comes from the file alone: the masking config of the tokenizer.
    cfg = metadata.masking_from_metadata(pattern, max_predictions=10)
    assert cfg == masking.MaskingConfig.from_tokenizer(tok, max_predictions=10,
                                                       masked_lm_prob=0.2, whole_word=True)
    np.testing.assert_array_equal(cfg.continuation, masking.continuation_flags(tok))
    assert metadata.check_packing(pattern, 128, cfg) == 64
    assert metadata.check_pretraining(pattern, 64, 10, cfg) is False  # unmasked records
    # Bad files stop with a DataError naming the file and the field.
    with pytest.raises(DataError, match=r"metadata\.json: max_seq_length is 64 but the reader "
                                        r"was asked for seq_len=128"):
        metadata.check_pretraining(pattern, 128, 10, cfg)
    del meta["mask_id"]
    metadata.write(str(tmp_path), meta)
    with pytest.raises(DataError, match=r"metadata\.json: missing field 'mask_id'"):
        metadata.masking_from_metadata(pattern, max_predictions=10)
    (tmp_path / "metadata.json").write_text("{")
    with pytest.raises(DataError, match=r"metadata\.json: invalid JSON"):
        metadata.read(pattern)
