"""Packed no-NSP pre-training input: the segments writer and its command, the tf.data packer,
masking per row, resume.

(That a packed row's outputs equal each example run alone is tests/models/test_model.py's
test_packed_examples_equal_each_example_alone.)
"""

from __future__ import annotations

import collections
import functools
import textwrap

import numpy as np
import pytest
import tensorflow as tf
from pipeline_data import (
    CLS,
    SEP,
    stand_in_tokenizer,
    synthetic_text_documents,
    tokenized,
    write_reference,
)

from data_pipeline import create_segments, metadata, packed_input, packing

RECORD_LEN = 64


@pytest.fixture(scope="module")
def segments(tmp_path_factory):
    """Segments of 60 synthetic documents in 4 shards: (pattern, metadata, tokenized docs)."""
    tmp = tmp_path_factory.mktemp("segments")
    docs = synthetic_text_documents(60, seed=4)
    write_reference(tmp / "corpus.txt", docs)
    cfg = create_segments.SegmentsConfig(input=str(tmp / "corpus.txt"),
                                         output_dir=str(tmp / "out"), max_seq_length=RECORD_LEN,
                                         num_shards=4, shuffle_buffer=50)
    meta = create_segments.create_segments(cfg, stand_in_tokenizer)
    return str(tmp / "out" / "part-*"), meta, tokenized(docs, stand_in_tokenizer())


def test_segments_writer_never_imports_tensorflow_and_workers_match_one_process(tmp_path):
    """The writer's spawned workers load only TF-free modules, and 2 workers write the same
    shards, byte for byte, as 1."""
    from conftest import run_python

    write_reference(tmp_path / "corpus.txt", synthetic_text_documents(30, seed=5))
    script = textwrap.dedent(f"""
        import sys
        from data_pipeline import create_segments
        from pipeline_data import stand_in_tokenizer
        for workers in (1, 2):
            cfg = create_segments.SegmentsConfig(
                input={str(tmp_path / "corpus.txt")!r},
                output_dir={str(tmp_path)!r} + f"/out{{workers}}", max_seq_length=64,
                num_shards=2, num_workers=workers, shuffle_buffer=20)
            assert create_segments.create_segments(cfg, stand_in_tokenizer)["counts"]["instances"]
        assert "tensorflow" not in sys.modules, "TensorFlow imported"
    """)
    result = run_python(["-c", script])
    assert result.returncode == 0, result.stderr[-2000:]
    for shard in ("part-00000-of-00002.tfrecord", "part-00001-of-00002.tfrecord"):
        one = (tmp_path / "out1" / shard).read_bytes()
        assert one and one == (tmp_path / "out2" / shard).read_bytes()


def record_examples(pattern):
    """Independent read of the records: the real tokens of each tf.train.Example."""
    out = []
    for path in sorted(tf.io.gfile.glob(pattern)):
        for raw in tf.data.TFRecordDataset(path).as_numpy_iterator():
            f = tf.train.Example.FromString(raw).features.feature
            n = sum(f["input_mask"].int64_list.value)
            out.append(tuple(f["input_ids"].int64_list.value[:n]))
    return out


def row_examples(rows):
    """Split packed rows (dicts of [seq] arrays) back into examples, checking the layout."""
    out = []
    for row in rows:
        ids = row["packing_ids"]
        real = ids[ids > 0]
        # Examples are contiguous blocks numbered 1, 2, ... from the start, then only padding.
        assert real[0] == 1 and set(np.diff(real).tolist()) <= {0, 1}
        assert (ids[len(real):] == 0).all()
        np.testing.assert_array_equal(row["input_mask"], ids > 0)
        for k in range(1, real.max() + 1):
            out.append(tuple(row["input_ids"][ids == k].tolist()))
    return out


def all_rows(dataset):
    return [dict(zip(b, r)) for b in dataset.batch(512).as_numpy_iterator()
            for r in zip(*b.values())]


# ------------------------------------------------------------------------------- segments


@pytest.mark.parametrize("whole_sentences", [True, False])
def test_segments_cover_each_document_once_in_order(whole_sentences):
    tok = stand_in_tokenizer()
    docs = tokenized(synthetic_text_documents(30, seed=1, words=(4, 40)), tok)
    max_tokens = 30  # some sentences are longer: they are split
    for doc in docs:
        out = packing.segments_from_document(doc, max_tokens, whole_sentences)
        np.testing.assert_array_equal(np.concatenate(out), np.concatenate(doc))
        assert all(0 < len(s) <= max_tokens for s in out)
        cuts = np.cumsum([len(s) for s in out])[:-1]
        if not whole_sentences:
            assert all(len(s) == max_tokens for s in out[:-1])
            continue
        ends = set(np.cumsum([len(s) for s in doc]).tolist())
        starts = np.cumsum([0] + [len(s) for s in doc])
        for i, cut in enumerate(cuts.tolist()):
            if cut in ends:  # at a sentence end: the next sentence did not fit as well
                nxt = int(np.searchsorted(starts, cut, side="right")) - 1
                assert len(out[i]) + len(doc[nxt]) > max_tokens
            else:  # inside a sentence: only a sentence longer than max_tokens is cut
                sentence = int(np.searchsorted(starts, cut, side="right")) - 1
                assert len(doc[sentence]) > max_tokens


def test_segments_data_are_whole_documents_once(segments):
    pattern, meta, docs = segments
    examples = record_examples(pattern)
    assert len(examples) == meta["counts"]["instances"]
    assert all(e[0] == CLS and e[-1] == SEP and len(e) <= RECORD_LEN for e in examples)
    body = collections.Counter(t for e in examples for t in e[1:-1])
    assert body == collections.Counter(t for d in docs for s in d for t in s.tolist())
    assert meta["masking"] == "dynamic" and meta["max_seq_length"] == RECORD_LEN
    # The metadata carries what dynamic masking needs (no tokenizer at training time).
    cfg = packed_input.masking_from_metadata(pattern, max_predictions=10)
    assert cfg.vocab_size == stand_in_tokenizer().vocab_size and cfg.mask_id == 4


# -------------------------------------------------------------------------------- packing


@pytest.mark.parametrize("num_open_rows,max_examples,block_size,width",
                         [(1, None, 300, 32), (3, 2, 64, 32), (8, None, 37, 20)])
def test_tf_packer_makes_the_rows_of_the_numpy_packer_per_block(num_open_rows, max_examples,
                                                                 block_size, width):
    """Each block of examples packs as `packing.pack_examples` packs that block alone."""
    rng = np.random.default_rng(num_open_rows)
    seq_len = 32
    examples = []
    for _ in range(300):
        n = int(rng.integers(0, width + 1)) if rng.random() < 0.05 else int(rng.integers(1, width))
        examples.append({"input_ids": rng.integers(5, 100, n),
                         "segment_ids": (np.arange(n) >= rng.integers(0, n + 1)).astype(int)})
    pad = lambda x: np.pad(np.asarray(x, np.int32), (0, width - len(x)))  # [width] each
    ids = np.stack([pad(e["input_ids"]) for e in examples])
    segments = np.stack([pad(e["segment_ids"]) for e in examples])
    lengths = np.array([len(e["input_ids"]) for e in examples], np.int32)
    got = []
    for start in range(0, len(examples), block_size):  # the blocks of `packed_rows`
        block = slice(start, start + block_size)
        rows = packed_input.pack_block(tf.constant(ids[block]), tf.constant(segments[block]),
                                       tf.constant(lengths[block]), seq_len, num_open_rows,
                                       max_examples)
        got += [dict(zip(rows, r)) for r in zip(*(v.numpy() for v in rows.values()))]
    want = []
    for start in range(0, len(examples), block_size):  # empty examples are dropped
        block = [e for e in examples[start:start + block_size] if len(e["input_ids"])]
        want += packing.pack_examples(block, seq_len, num_open_rows=num_open_rows,
                                      max_examples_per_row=max_examples or seq_len)
    assert len(got) == len(want)
    for g, w in zip(got, want):
        for k in ("input_ids", "segment_ids", "packing_ids", "input_mask"):
            np.testing.assert_array_equal(g[k], w[k], err_msg=k)


def test_first_fit_places_examples_in_disjoint_spans_of_open_rows():
    rng = np.random.default_rng(7)
    seq_len, open_rows = 50, 3
    lengths = rng.integers(1, seq_len + 1, 400)
    row, offset, number, rows = packed_input.first_fit(lengths, seq_len, open_rows, 4)
    assert row.max() + 1 == rows and set(row.tolist()) == set(range(rows))
    for r in range(rows):
        mine = np.flatnonzero(row == r)  # in arrival order
        np.testing.assert_array_equal(number[mine], np.arange(1, len(mine) + 1))
        np.testing.assert_array_equal(offset[mine], np.cumsum(lengths[mine]) - lengths[mine])
        assert lengths[mine].sum() <= seq_len and len(mine) <= 4
    # Streaming: an example only joins one of the `open_rows` newest rows opened before it.
    newest = np.maximum.accumulate(row)
    assert (row > newest - open_rows).all()


@pytest.mark.parametrize("seq_len,block_size", [(RECORD_LEN, 1024), (4 * RECORD_LEN, 1024),
                                                 (4 * RECORD_LEN, 30)])
def test_packed_rows_hold_every_example_once(segments, seq_len, block_size):
    import jax.numpy as jnp

    from bertjax.models.kernels.attention import positions_from_packing

    pattern, _, _ = segments
    rows = all_rows(packed_input.packed_rows(pattern, seq_len=seq_len, shuffle=False,
                                             repeat=False, block_size=block_size))
    assert all(r["input_ids"].shape == (seq_len,) for r in rows)
    assert sorted(row_examples(rows)) == sorted(record_examples(pattern))
    ids = np.stack([r["packing_ids"] for r in rows])
    positions = np.asarray(positions_from_packing(jnp.asarray(ids)))
    for row, pos in zip(ids, positions):
        for k in range(1, row.max() + 1):  # the model's positions restart at every example
            np.testing.assert_array_equal(pos[row == k], np.arange((row == k).sum()))
    assert (np.stack([r["segment_ids"] for r in rows]) == 0).all()  # single segments


def test_padding_fraction_falls(segments):
    pattern, _, _ = segments
    examples = record_examples(pattern)
    tokens = sum(len(e) for e in examples)
    for seq_len in (RECORD_LEN, 4 * RECORD_LEN):
        stats = packed_input.padding_stats(pattern, seq_len=seq_len)
        assert stats.examples == len(examples) and stats.tokens == tokens
        assert stats.padding_before == pytest.approx(1 - tokens / (len(examples) * seq_len))
        assert stats.padding_after == pytest.approx(1 - tokens / (stats.rows * seq_len))
        assert stats.padding_after < stats.padding_before
    # 64-token examples in 256-token rows; the last open rows are flushed part-full.
    assert stats.padding_after < 0.1 < 0.6 < stats.padding_before


def test_masking_per_row_and_batch_spec(segments):
    from bertjax.tasks.pretraining import batch_spec

    pattern, _, _ = segments
    cfg = packed_input.masking_from_metadata(pattern, max_predictions=40)
    kwargs = dict(seq_len=2 * RECORD_LEN, shuffle=False, repeat=False)
    plain = all_rows(packed_input.packed_rows(pattern, **kwargs))
    batches = list(packed_input.InputIterator(packed_input.make_packed_dataset(
        pattern, batch_size=4, masking=cfg, **kwargs)))
    assert len(batches) == len(plain) // 4
    spec = batch_spec(4, 2 * RECORD_LEN, 40, packed=True)
    assert {k: (v.shape, v.dtype) for k, v in batches[0].items()} == {
        k: (v.shape, np.dtype(v.dtype)) for k, v in spec.items()}
    special = cfg.special_table()
    chosen = real = 0
    for i, batch in enumerate(batches):
        for j in range(4):
            original, row = plain[4 * i + j]["input_ids"], {k: v[j] for k, v in batch.items()}
            for k in ("packing_ids", "input_mask", "segment_ids"):
                np.testing.assert_array_equal(row[k], plain[4 * i + j][k])
            valid = row["masked_lm_weights"] > 0
            pos = row["masked_lm_positions"][valid]
            assert (row["input_mask"][pos] == 1).all() and not special[original[pos]].any()
            np.testing.assert_array_equal(row["masked_lm_ids"][valid], original[pos])
            untouched = np.setdiff1d(np.arange(len(original)), pos)
            np.testing.assert_array_equal(row["input_ids"][untouched], original[untouched])
            chosen += valid.sum()
            real += row["input_mask"].sum()
    # 15% of each row's real tokens ([CLS]/[SEP] included in the count, as the reference).
    assert abs(chosen / real - 0.15) < 0.01


# ------------------------------------------------------------------ hosts, seeds and resume


def test_hosts_rows_are_the_one_process_batches(segments):
    """Packing runs over the one global stream; each process takes and masks its rows of each
    global batch, so 2 processes' rows side by side are one process's batches."""
    pattern, _, _ = segments
    cfg = packed_input.masking_from_metadata(pattern, max_predictions=20)

    def batches(process_index=0, process_count=1, n=4):
        reader = packed_input.InputIterator(packed_input.make_packed_dataset(
            pattern, seq_len=2 * RECORD_LEN, batch_size=8, masking=cfg, seed=2,
            shuffle_buffer=64, block_size=30, process_index=process_index,
            process_count=process_count))
        return [next(reader) for _ in range(n)]

    one, shares = batches(), [batches(i, 2) for i in range(2)]
    for step, want in enumerate(one):
        for key, value in want.items():
            got = np.concatenate([share[step][key] for share in shares])
            np.testing.assert_array_equal(got, value, err_msg=f"{step} {key}")


@pytest.mark.parametrize("block_size", [1024, 30])
def test_resume_yields_the_batches_of_an_uninterrupted_reader(segments, tmp_path, block_size):
    pattern, meta, _ = segments
    cfg = packed_input.masking_from_metadata(pattern, max_predictions=20)

    def make(seed=3):
        return packed_input.InputIterator(packed_input.make_packed_dataset(
            pattern, seq_len=2 * RECORD_LEN, batch_size=8, masking=cfg, seed=seed,
            shuffle_buffer=64, block_size=block_size))

    it = make()
    for _ in range(5):
        next(it)
    it.save(str(tmp_path / "ckpt" / "it"))
    # As many rows as examples: past the end of the first epoch (several examples per row).
    expected = [next(it) for _ in range(meta["counts"]["instances"] // 8)]
    resumed = make()
    resumed.restore(str(tmp_path / "ckpt" / "it"))
    for want in expected:
        got = next(resumed)
        assert got.keys() == want.keys()
        for k in want:
            np.testing.assert_array_equal(got[k], want[k], err_msg=k)
    # Deterministic for a seed, different for another.
    first = next(make())
    np.testing.assert_array_equal(next(make())["input_ids"], first["input_ids"])
    assert not np.array_equal(next(make(seed=4))["input_ids"], first["input_ids"])


# ---------------------------------------------------------------------------- bad input


def test_bad_input_names_the_file(segments, tmp_path):
    pattern, _, _ = segments
    with pytest.raises(ValueError, match=r"metadata\.json: max_seq_length is 64; records must "
                                         r"fit the packed rows \(seq_len=32\)"):
        packed_input.packed_rows(pattern, seq_len=32)
    (tmp_path / "part-00000-of-00001.tfrecord").write_bytes(b"")
    with pytest.raises(ValueError, match="no metadata"):
        packed_input.packed_rows(str(tmp_path / "part-*"), seq_len=64)
    metadata.write_json_atomic(str(tmp_path / "metadata.json"),
                                {"masking": "static", "max_seq_length": 64})
    with pytest.raises(ValueError, match="metadata.json: masking is 'static'"):
        packed_input.packed_rows(str(tmp_path / "part-*"), seq_len=64)
    for flag in ("num_open_rows", "block_size"):
        with pytest.raises(ValueError, match=f"{flag} must be >= 1, got 0"):
            packed_input.packed_rows(pattern, seq_len=64, **{flag: 0})


def test_pair_data_is_read_as_single_examples(tmp_path):
    """Unmasked NSP pairs of create_pretraining_data pack too (each pair one example)."""
    from data_pipeline import create_pretraining_data as cpd

    write_reference(tmp_path / "corpus.txt", synthetic_text_documents(20, seed=2))
    cfg = cpd.CreateConfig(input=str(tmp_path / "corpus.txt"), output_dir=str(tmp_path / "out"),
                           max_seq_length=64, dupe_factor=1, masking="dynamic", pool_size=10,
                           shuffle_buffer=20)
    cpd.create_pretraining_data(cfg, stand_in_tokenizer)
    pattern = str(tmp_path / "out" / "part-*")
    rows = all_rows(packed_input.packed_rows(pattern, seq_len=128, shuffle=False, repeat=False))
    assert sorted(row_examples(rows)) == sorted(record_examples(pattern))
    # Segment ids of the pairs survive packing (segment 1 = B).
    assert any((r["segment_ids"] == 1).any() for r in rows)


# ------------------------------------------------------------------- the trainer's steps


@pytest.mark.slow
@pytest.mark.extended
def test_packed_eval_step_equals_each_example_in_its_own_row():
    """The trainer's packed step sees each example as if alone (packing_ids reach the model)."""
    import flax.linen as nn
    import jax

    from bertjax.models import BertConfig, BertForPreTraining
    from bertjax.tasks import pretraining

    cfg = BertConfig(vocab_size=120, hidden_size=32, num_layers=1, num_heads=4,
                     intermediate_size=64, max_position_embeddings=64, dtype="float32")
    model = BertForPreTraining(cfg)
    params = nn.unbox(pretraining.init_params(model, jax.random.key(0)))
    rng = np.random.default_rng(0)
    seq_len, preds = 48, 12
    examples = []
    for _ in range(10):
        n = int(rng.integers(4, 30))
        ids = rng.integers(5, cfg.vocab_size, n).astype(np.int32)
        pos = np.sort(rng.choice(n, 3, replace=False)).astype(np.int32)
        examples.append({"input_ids": ids, "segment_ids": (np.arange(n) >= n // 2).astype(int),
                         "masked_lm_positions": pos, "masked_lm_ids": ids[pos]})
    rows = list(packing.pack_examples(examples, seq_len, max_predictions=preds))
    assert len(rows) < len(examples)  # several examples share rows
    packed = {k: np.stack([r[k] for r in rows]) for k in pretraining.batch_spec(
        1, seq_len, preds, packed=True)}
    alone = list(packing.pack_examples(examples, seq_len, max_predictions=preds,
                                       num_open_rows=1, max_examples_per_row=1))
    unpacked = {k: np.stack([r[k] for r in alone]) for k in packed if k != "packing_ids"}
    unpacked["next_sentence_labels"] = np.zeros(len(alone), np.int32)
    eval_sums = functools.partial(pretraining.eval_sums, model=model, nsp_weight=0.0)
    got = eval_sums(params, packed, packed=True)
    want = eval_sums(params, unpacked, packed=False)
    assert "nsp_count" not in got
    for k in ("mlm_loss_sum", "mlm_correct", "mlm_weight"):
        np.testing.assert_allclose(got[k], want[k], rtol=1e-5, err_msg=k)
    # Without packing_ids the examples of a row would see each other: the sums differ.
    leaky = eval_sums(params, {**{k: v for k, v in packed.items() if k != "packing_ids"},
                               "next_sentence_labels": np.zeros(len(rows), np.int32)},
                      packed=False)
    assert abs(float(leaky["mlm_loss_sum"]) - float(want["mlm_loss_sum"])) > 1e-3
