"""data_pipeline with TensorFlow: dynamic masking, TFRecords, the tf.data reader, the CLI."""

from __future__ import annotations

import glob
import json
import os

import numpy as np
import pytest
import tensorflow as tf
import tensorflow_datasets as tfds
from pipeline_data import (
    CLS,
    SEP,
    check_masking_statistics,
    masking_corpus,
    stand_in_masking_config,
    stand_in_tokenizer,
    synthetic_text_documents,
    write_reference,
)

from data_pipeline import corpus, instances, masking, metadata, pretraining_input, tfrecords
from data_pipeline import create_pretraining_data as cpd

REFERENCE_FEATURES = {
    "input_ids": (tf.int64, 128), "input_mask": (tf.int64, 128), "segment_ids": (tf.int64, 128),
    "masked_lm_positions": (tf.int64, 20), "masked_lm_ids": (tf.int64, 20),
    "masked_lm_weights": (tf.float32, 20), "next_sentence_labels": (tf.int64, 1),
}


def pad_batch(seqs, seq_len=128):
    ids = np.zeros((len(seqs), seq_len), np.int32)
    mask = np.zeros_like(ids)
    for i, s in enumerate(seqs):
        ids[i, :len(s)] = s
        mask[i, :len(s)] = 1
    return ids, mask


@pytest.mark.parametrize("whole_word", [False, True])
def test_dynamic_masking_statistics(whole_word):
    tok, seqs = masking_corpus(seed=1)
    cfg = stand_in_masking_config(tok, whole_word)
    ids, mask = pad_batch(seqs)
    out = {k: v.numpy() for k, v in masking.mask_batch_tf(ids, mask, cfg, [7, 0]).items()}
    results, lengths = [], mask.sum(1)
    for i, n in enumerate(lengths):
        valid = out["masked_lm_weights"][i] > 0
        assert (out["input_ids"][i, n:] == 0).all()  # padding untouched and never chosen
        results.append((out["input_ids"][i, :n], out["masked_lm_positions"][i][valid],
                        out["masked_lm_ids"][i][valid]))
        assert not valid[valid.sum():].any()  # real predictions first, then padding
    check_masking_statistics([s for s in seqs], results, cfg, lengths)


def test_whole_word_greedy_matches_a_sequential_walk():
    """The vectorised greedy rule against the reference's word-by-word loop."""
    rng = np.random.default_rng(5)
    batch, words, max_predictions = 200, 48, 20
    lengths = rng.choice([1, 1, 1, 2, 3, 4, 6], size=(batch, words)).astype(np.int32)
    lengths[np.arange(words) >= rng.integers(0, words + 1, batch)[:, None]] = 0  # absent
    keys = np.stack([rng.permutation(words) * 7 + 3 for _ in range(batch)]).astype(np.int32)
    budget = rng.integers(1, max_predictions + 1, batch).astype(np.int32)
    never = np.iinfo(np.int32).max
    got = masking._greedy_take_tf(tf.constant(lengths),
                                  tf.constant(np.where(lengths > 0, keys, never)),
                                  tf.constant(budget), max_predictions, never).numpy()
    for row in range(batch):
        expected, total = np.zeros(words, bool), 0
        for w in np.argsort(keys[row]):
            if lengths[row, w] and total + lengths[row, w] <= budget[row]:
                expected[w] = True
                total += lengths[row, w]
        np.testing.assert_array_equal(got[row], expected, err_msg=f"row {row}")


def test_dynamic_masks_depend_on_the_key_only():
    tok, seqs = masking_corpus(seed=2, num_docs=20)
    cfg = stand_in_masking_config(tok, whole_word=True)
    ids, mask = pad_batch(seqs[:64])
    run = lambda key: masking.mask_batch_tf(ids, mask, cfg, key)["masked_lm_positions"].numpy()
    np.testing.assert_array_equal(run([1, 5]), run([1, 5]))
    assert (run([1, 5]) != run([1, 6])).any(axis=1).mean() > 0.9


def test_tfds_reader_uses_the_real_load_path_with_mock_data():
    texts = [f"Document {i} starts here. It has a second sentence." for i in range(6)]
    seen_splits = []

    def as_dataset(self, split, *args, **kwargs):
        seen_splits.append(str(split))
        return tf.data.Dataset.from_tensor_slices(
            {"title": [f"t{i}" for i in range(6)], "text": texts})

    with tfds.testing.mock_data(as_dataset_fn=as_dataset):
        docs = list(corpus.iter_documents("tfds:wikipedia/20230601.en", shard_index=1,
                                          num_shards=3))
    assert docs == [[f"Document {i} starts here.", "It has a second sentence."] for i in range(6)]
    # Shard 1 of 3 asks TFDS for the second of three even sub-splits of "train".
    assert seen_splits and "split='train', index=1, count=3" in seen_splits[0]


# ------------------------------------------------------------------- creation + reading


def create(tmp_path, name="out", docs=None, **overrides):
    docs = docs if docs is not None else synthetic_text_documents(120, seed=0)
    corpus_path = tmp_path / "corpus.txt"
    if not corpus_path.exists():
        write_reference(corpus_path, docs)
    settings = dict(input=str(corpus_path), output_dir=str(tmp_path / name), dupe_factor=2,
                    num_shards=4, masking="static", pool_size=30, shuffle_buffer=100)
    settings.update(overrides)
    cfg = cpd.CreateConfig(**settings)
    return cfg, cpd.create_pretraining_data(cfg, stand_in_tokenizer)


def read_records(path):
    """Independent parse: tf.train.Example protos → dict of name → (kind, list)."""
    out = []
    for raw in tf.data.TFRecordDataset(path).as_numpy_iterator():
        ex = tf.train.Example.FromString(raw)
        out.append({k: (f.WhichOneof("kind"), list(getattr(f, f.WhichOneof("kind")).value))
                    for k, f in ex.features.feature.items()})
    return out


def all_batches(pattern, **kwargs):
    kwargs = dict(seq_len=128, max_predictions=20, batch_size=1, shuffle=False, repeat=False,
                  **kwargs)
    return list(pretraining_input.InputIterator(pretraining_input.make_dataset(pattern, **kwargs)))


def test_static_records_round_trip_exactly(tmp_path, monkeypatch):
    monkeypatch.setattr(cpd, "WRITE_BATCH", 16)  # several write batches per shard
    cfg, meta = create(tmp_path)
    tok = stand_in_tokenizer()
    files = sorted(glob.glob(str(tmp_path / "out" / tfrecords.SHARD_PATTERN)))
    assert [os.path.basename(f) for f in files] == [f"part-0000{i}-of-00004.tfrecord"
                                                    for i in range(4)]
    assert not glob.glob(str(tmp_path / "out" / "*.tmp"))
    # Expected instances, recomputed in memory with the same per-shard random streams.
    mcfg = cfg.masking_config(tok)
    for shard, path in enumerate(files):
        pair_rng, shuffle_rng, mask_rng = cpd.shard_rngs(cfg, shard)
        docs = cpd.tokenize_documents(corpus.iter_documents(cfg.input, "reference", shard, 4),
                                      tok, dict.fromkeys(["documents", "text_bytes", "sentences",
                                                          "tokens"], 0))
        expected = list(instances.shuffle_buffer(instances.generate_instances(
            docs, cfg.pair_config(), CLS, SEP, pair_rng), cfg.shuffle_buffer, shuffle_rng))
        records = read_records(path)
        assert len(records) == len(expected) == meta["shards"][os.path.basename(path)]
        # Masks are drawn cpd.WRITE_BATCH instances at a time from the shard's mask stream.
        masks = []
        for start in range(0, len(expected), cpd.WRITE_BATCH):
            chunk = expected[start:start + cpd.WRITE_BATCH]
            (ids, _), lengths = pad_batch([i.tokens for i in chunk]), [len(i.tokens) for i in chunk]
            out, pos, lab, cnt = masking.mask_batch(ids, lengths, mcfg, mask_rng)
            masks += [(o[:n], p[:c], lb[:c]) for o, p, lb, c, n in zip(out, pos, lab, cnt, lengths)]
        for rec, inst, (masked, pos, lab) in zip(records, expected, masks):
            assert {k: (v[0], len(v[1])) for k, v in rec.items()} == {
                k: ("float_list" if d == tf.float32 else "int64_list", n)
                for k, (d, n) in REFERENCE_FEATURES.items()}
            n, k = len(inst.tokens), len(pos)
            assert rec["input_ids"][1] == masked.tolist() + [0] * (128 - n)
            assert rec["input_mask"][1] == [1] * n + [0] * (128 - n)
            assert rec["segment_ids"][1] == inst.segment_ids.tolist() + [0] * (128 - n)
            assert rec["masked_lm_positions"][1] == pos.tolist() + [0] * (20 - k)
            assert rec["masked_lm_ids"][1] == lab.tolist() + [0] * (20 - k)
            assert rec["masked_lm_weights"][1] == [1.0] * k + [0.0] * (20 - k)
            assert rec["next_sentence_labels"][1] == [int(inst.is_random_next)]
    # ... and the tf.data reader returns the same values, with the trainer's dtypes/shapes.
    batches = all_batches(str(tmp_path / "out" / "part-00000-*"))
    records = read_records(files[0])
    assert len(batches) == len(records)
    for b, rec in zip(batches, records):
        assert {k: (v.dtype, v.shape) for k, v in b.items()} == {
            k: (np.float32 if d == tf.float32 else np.int32, (1,) if k == "next_sentence_labels"
                else (1, n)) for k, (d, n) in REFERENCE_FEATURES.items()}
        for k, v in b.items():
            np.testing.assert_array_equal(v.reshape(-1), rec[k][1])
    counts = meta["counts"]
    assert counts["instances"] == sum(meta["shards"].values())
    assert abs(counts["not_next"] / counts["instances"] - 0.5) < 0.05
    assert meta["vocab_hash"] == metadata.vocab_hash(tok.tokens)


def test_reads_a_reference_schema_record_written_by_hand(tmp_path):
    rng = np.random.default_rng(0)
    expected = []
    with tf.io.TFRecordWriter(str(tmp_path / "ref.tfrecord")) as w:
        for _ in range(6):
            values = {k: (rng.random(n).astype(np.float32) if d == tf.float32
                          else rng.integers(0, 1000, n))
                      for k, (d, n) in REFERENCE_FEATURES.items()}
            feats = {k: tf.train.Feature(float_list=tf.train.FloatList(value=v)) if v.dtype ==
                     np.float32 else tf.train.Feature(int64_list=tf.train.Int64List(value=v))
                     for k, v in values.items()}
            w.write(tf.train.Example(features=tf.train.Features(feature=feats)).SerializeToString())
            expected.append(values)
    batches = list(pretraining_input.InputIterator(pretraining_input.make_dataset(
        str(tmp_path / "ref.tfrecord"), seq_len=128, max_predictions=20, batch_size=3,
        shuffle=False, repeat=False)))
    assert len(batches) == 2
    for k in REFERENCE_FEATURES:
        got = np.concatenate([b[k] for b in batches]).reshape(6, -1)
        np.testing.assert_array_equal(got, np.stack([e[k] for e in expected]).reshape(6, -1))


def test_creation_is_deterministic_and_independent_of_workers(tmp_path):
    create(tmp_path, "a", num_shards=2)
    create(tmp_path, "b", num_shards=2, num_workers=2)  # two spawned processes
    create(tmp_path, "c", num_shards=2, random_seed=1)
    read = lambda d: [open(f, "rb").read() for f in sorted(glob.glob(str(tmp_path / d / "part*")))]
    assert read("a") == read("b")
    assert read("a") != read("c")


@pytest.mark.parametrize("masking_mode", ["static", "dynamic", "static re-masked"])
def test_hosts_rows_are_the_one_process_batches_on_any_host_count(tmp_path, masking_mode):
    """The global order: on 2 or 4 processes, each takes its rows of the batches one process
    reads (shuffled, masked on the fly), so their rows side by side are those batches."""
    create(tmp_path, num_shards=3, dupe_factor=1,
           masking="static" if masking_mode.startswith("static") else "dynamic")
    pattern = str(tmp_path / "out" / "part-*")
    mcfg = (None if masking_mode == "static"
            else pretraining_input.masking_from_metadata(pattern, max_predictions=20))

    def batches(process_index=0, process_count=1, n=6):
        reader = pretraining_input.InputIterator(pretraining_input.make_dataset(
            pattern, seq_len=128, max_predictions=20, batch_size=8, seed=5, shuffle=True,
            repeat=True, masking=mcfg, process_index=process_index,
            process_count=process_count, shuffle_buffer=50))
        return [next(reader) for _ in range(n)]

    one = batches()
    for count in (2, 4):
        shares = [batches(i, count) for i in range(count)]
        for step, want in enumerate(one):
            for key, value in want.items():
                assert shares[0][step][key].shape[0] == 8 // count
                got = np.concatenate([share[step][key] for share in shares])
                np.testing.assert_array_equal(got, value, err_msg=f"{count} {step} {key}")
    with pytest.raises(ValueError, match="batch size 8 is not divisible by 3 processes"):
        batches(0, 3)


def test_iterator_restore_continues_exactly(tmp_path):
    create(tmp_path, masking="dynamic", dupe_factor=1)
    pattern = str(tmp_path / "out" / "part-*")
    mcfg = pretraining_input.masking_from_metadata(pattern, max_predictions=20)
    make = lambda: pretraining_input.InputIterator(pretraining_input.make_dataset(
        pattern, seq_len=128, max_predictions=20, batch_size=8, seed=3, masking=mcfg,
        shuffle_buffer=64))
    it = make()
    for _ in range(7):
        next(it)
    it.save(str(tmp_path / "ckpt" / "it"))
    expected = [next(it) for _ in range(40)]  # runs past an epoch boundary
    resumed = make()
    resumed.restore(str(tmp_path / "ckpt" / "it"))
    for want in expected:
        got = next(resumed)
        for k in want:
            np.testing.assert_array_equal(got[k], want[k])
    fresh = next(make())
    assert not np.array_equal(fresh["input_ids"], expected[0]["input_ids"])


@pytest.mark.slow
@pytest.mark.extended
def test_dynamic_masking_is_fresh_every_epoch(tmp_path):
    cfg, meta = create(tmp_path, masking="dynamic", dupe_factor=1, num_shards=1)
    n = meta["counts"]["instances"]
    pattern = str(tmp_path / "out" / "part-*")
    with pytest.raises(ValueError, match=r"metadata\.json: masking is 'dynamic'"):
        pretraining_input.make_dataset(pattern, seq_len=128, max_predictions=20, batch_size=1)
    mcfg = pretraining_input.masking_from_metadata(pattern, max_predictions=20)
    assert mcfg == cfg.masking_config(stand_in_tokenizer())
    np.testing.assert_array_equal(mcfg.continuation,
                                  masking.continuation_flags(stand_in_tokenizer()))
    ds = pretraining_input.make_dataset(pattern, seq_len=128, max_predictions=20, batch_size=1,
                                        shuffle=False, repeat=True, masking=mcfg)
    rows = [b for _, b in zip(range(2 * n), pretraining_input.InputIterator(ds))]
    epoch1, epoch2 = rows[:n], rows[n:]
    unmasked = lambda b: pretraining_input._unmask(b).numpy()
    differ = 0
    for a, b in zip(epoch1, epoch2):
        np.testing.assert_array_equal(unmasked(a), unmasked(b))  # same example
        differ += not np.array_equal(a["masked_lm_positions"], b["masked_lm_positions"])
    assert differ > 0.9 * n
    # Pairs do not depend on the masking mode: static records unmask to the dynamic ones.
    create(tmp_path, "static", dupe_factor=1, num_shards=1)
    static = all_batches(str(tmp_path / "static" / "part-*"))
    assert len(static) == n
    for s, d in zip(static, epoch1):
        np.testing.assert_array_equal(unmasked(s), unmasked(d))
    # Static records can be re-masked dynamically too (restored to their ids first).
    remasked = all_batches(str(tmp_path / "static" / "part-*"), masking=mcfg)
    for r, s in zip(remasked, static):
        np.testing.assert_array_equal(unmasked(r), unmasked(s))
    assert np.mean([(r["masked_lm_positions"] != s["masked_lm_positions"]).any()
                    for r, s in zip(remasked, static)]) > 0.9


def test_metadata_mismatch_fails_with_one_clear_line(tmp_path):
    create(tmp_path, num_shards=1, dupe_factor=1)
    with pytest.raises(ValueError, match=r"out/metadata\.json: max_seq_length is 128 but the "
                                         r"reader was asked for seq_len=512$"):
        pretraining_input.make_dataset(str(tmp_path / "out" / "part-*"), seq_len=512,
                                       max_predictions=20, batch_size=1)
    with pytest.raises(ValueError, match="no files match"):
        pretraining_input.make_dataset(str(tmp_path / "nothing*"), seq_len=128,
                                       max_predictions=20, batch_size=1)


def test_bad_inputs(tmp_path):
    (tmp_path / "empty.txt").write_text("")
    with pytest.raises(ValueError, match=r"empty\.txt: no documents in 1 file\(s\)"):
        create(tmp_path, input=str(tmp_path / "empty.txt"), num_shards=1)
    assert not (tmp_path / "out").exists()  # refused before any shard was written
    one = [[f"w{i} w{i + 1} w{i + 2}"] for i in range(40)]  # one-sentence documents
    one_path = write_reference(tmp_path / "one.txt", one)
    _, meta = create(tmp_path, "one", input=one_path, num_shards=1)
    assert meta["counts"]["instances"] > 0  # split into A/B or paired with another document
    (tmp_path / "bad.txt").write_bytes(b"w1 w2\n\xc3\x28\n")
    with pytest.raises(corpus.CorpusError, match=r"bad\.txt:2: invalid UTF-8"):
        create(tmp_path, "bad", input=str(tmp_path / "bad.txt"), num_shards=1)
    assert not glob.glob(str(tmp_path / "bad" / "*"))  # no partial shard, no metadata


def test_shard_writer_never_leaves_a_partial_shard(tmp_path):
    path = str(tmp_path / "part-00000-of-00001.tfrecord")
    with pytest.raises(RuntimeError), tfrecords.ShardWriter(path) as w:
        w.write(b"x")
        raise RuntimeError("crash")
    assert os.listdir(tmp_path) == []


def test_cli_missing_vocab_is_one_line(tmp_path, project_root):
    from conftest import run_python

    result = run_python(["-m", "data_pipeline.create_pretraining_data", "--input=x",
                         f"--output_dir={tmp_path}", f"--vocab={tmp_path}/nope.txt"])
    assert result.returncode != 0
    assert result.stderr.strip().splitlines() == [
        f"error: --vocab: no such file or directory: {tmp_path}/nope.txt"]


# ------------------------------------------------- end to end with bertjax.tokenization


ENGLISH = [
    ["The cat sat on the mat.", "It was a sunny day in the town.",
     "Children played football in the park.", "Their parents watched from the benches."],
    ["Stock markets rose sharply on Monday.", "Investors welcomed the news from the bank.",
     "The central bank kept interest rates unchanged.", "Analysts expected a cut next year."],
    ["The new film opened to strong reviews.", "Critics praised the lead actress.",
     "Tickets sold out in many cities.", "The director thanked the cast on stage."],
]


def test_cli_end_to_end_with_a_real_vocab(tmp_path):
    tokenization = pytest.importorskip("bertjax.tokenization")
    from conftest import run_python

    words = sorted({w.strip(".,").lower() for d in ENGLISH for s in d for w in s.split()})
    # Split every long word into a head and a "##" tail so whole-word masking has pieces.
    pieces = {w[:4] for w in words} | {"##" + w[4:] for w in words if len(w) > 4}
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", ".", *sorted(pieces)]
    (tmp_path / "vocab.txt").write_text("\n".join(vocab) + "\n")
    docs = ENGLISH * 10  # 30 documents
    write_reference(tmp_path / "corpus.txt", docs)
    result = run_python([
        "-m", "data_pipeline.create_pretraining_data", f"--input={tmp_path}/corpus.txt",
        f"--output_dir={tmp_path}/out", f"--vocab={tmp_path}/vocab.txt", "--max_seq_length=64",
        "--max_predictions_per_seq=10", "--dupe_factor=2", "--do_whole_word_mask",
        "--num_shards=2", "--random_seed=7"])
    assert result.returncode == 0, result.stderr[-2000:]
    assert "instances/s" in result.stdout
    meta = json.loads((tmp_path / "out" / "metadata.json").read_text())
    tok = tokenization.load_tokenizer(str(tmp_path / "vocab.txt"))
    assert meta["vocab_hash"] == metadata.vocab_hash(tok.convert_ids_to_tokens(
        list(range(tok.vocab_size))))
    assert meta["masking"] == "dynamic" and meta["do_whole_word_mask"] is True
    pattern = str(tmp_path / "out" / "part-*")
    mcfg = pretraining_input.masking_from_metadata(pattern, max_predictions=10)
    batches = list(pretraining_input.InputIterator(pretraining_input.make_dataset(
        pattern, seq_len=64, max_predictions=10, batch_size=4, shuffle=False, repeat=False,
        masking=mcfg)))
    assert len(batches) == meta["counts"]["instances"] // 4
    doc_streams = [" " + " ".join(tok.tokenize(" ".join(d))) + " " for d in ENGLISH]
    for b in batches:
        for row in range(4):
            ids = pretraining_input._unmask({k: tf.constant(v) for k, v in b.items()}).numpy()[row]
            tokens = tok.convert_ids_to_tokens(ids[b["input_mask"][row] == 1].tolist())
            assert tokens[0] == "[CLS]" and tokens[-1] == "[SEP]" and "[UNK]" not in tokens
            sep = tokens.index("[SEP]")
            # A and B are each a contiguous run of one document's tokens.
            for segment in (tokens[1:sep], tokens[sep + 1:-1]):
                assert any(" " + " ".join(segment) + " " in s for s in doc_streams), segment
            positions = b["masked_lm_positions"][row][b["masked_lm_weights"][row] > 0]
            chosen = set(positions.tolist())
            for p in chosen:  # whole words: a chosen "##" piece's head is chosen too
                if tok.is_continuation(tokens[p]):
                    assert p - 1 in chosen
