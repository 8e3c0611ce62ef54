"""GLUE / SWAG / user-file readers on fixtures written here in the exact official layouts, the
TFDS path on mock data, bad input errors, length bucketing and submission files."""

import csv
import json
import os

import numpy as np
import pytest

from bertjax.errors import DataError
from bertjax.tasks.classification import readers
from bertjax.tasks.classification.submission import write_submission
from data_pipeline import finetune_data


def write(path, lines):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        f.write("".join(line + "\n" for line in lines))


def tsv(*fields):
    return "\t".join(fields)


# The official layouts (download_glue_data.py), two rows each; texts with bare quotes, as real.
def write_glue(root):
    g = os.path.join(root, "glue_data")
    write(f"{g}/CoLA/train.tsv", [tsv("gj04", "1", "", "Our friends won't buy this analysis."),
                                  tsv("gj04", "0", "*", 'They drank the pub "dry".')])
    write(f"{g}/CoLA/dev.tsv", [tsv("gj04", "0", "*", "The more we study verbs.")])
    write(f"{g}/CoLA/test.tsv", [tsv("index", "sentence"), tsv("0", "Bill whistled past.")])
    write(f"{g}/SST-2/train.tsv", [tsv("sentence", "label"), tsv("hide new secretions ", "0"),
                                   tsv("that loves its characters ", "1")])
    write(f"{g}/SST-2/dev.tsv", [tsv("sentence", "label"), tsv("it 's a charming trip .", "1")])
    write(f"{g}/SST-2/test.tsv", [tsv("index", "sentence"), tsv("0", "uneasy mishmash .")])
    mrpc = tsv("\ufeffQuality", "#1 ID", "#2 ID", "#1 String", "#2 String")
    write(f"{g}/MRPC/train.tsv", [mrpc, tsv("1", "702876", "702977", 'Amrozi said "x" .',
                                            "Referring to him , he said .")])
    write(f"{g}/MRPC/dev.tsv", [mrpc, tsv("0", "1", "2", "He said .", "She said .")])
    write(f"{g}/MRPC/test.tsv", [tsv("index", "#1 ID", "#2 ID", "#1 String", "#2 String"),
                                 tsv("0", "1089874", "1089925", "PCCW 's chief .", "Mr Wong .")])
    sts = ["index", "genre", "filename", "year", "old_index", "source1", "source2", "sentence1",
           "sentence2"]
    write(f"{g}/STS-B/train.tsv", [tsv(*sts, "score"), tsv("0", "main-captions", "MSRvid",
                                   "2012test", "0001", "none", "none", "A plane is taking off.",
                                   "An air plane is taking off.", "5.000")])
    write(f"{g}/STS-B/dev.tsv", [tsv(*sts, "score"), tsv("0", "g", "f", "y", "1", "n", "n",
                                                         "A man.", "A cat.", "0.250")])
    write(f"{g}/STS-B/test.tsv", [tsv(*sts), tsv("0", "g", "f", "y", "1", "n", "n", "A.", "B.")])
    qqp = tsv("id", "qid1", "qid2", "question1", "question2", "is_duplicate")
    write(f"{g}/QQP/train.tsv", [qqp, tsv("133273", "213221", "213222", "How is it?",
                                          "How was it?", "1"),
                                 tsv("402555", "536040", "How do I?"),  # a malformed row
                                 tsv("1", "2", "3", "Why?", "Why not?", "0")])
    write(f"{g}/QQP/dev.tsv", [qqp, tsv("1", "2", "3", "Why?", "Why not?", "0")])
    write(f"{g}/QQP/test.tsv", [tsv("id", "question1", "question2"), tsv("0", "A?", "B?")])
    mnli_cols = ["index", "promptID", "pairID", "genre", "sentence1_binary_parse",
                 "sentence2_binary_parse", "sentence1_parse", "sentence2_parse", "sentence1",
                 "sentence2"]
    parses = ["( ( x ) )", "( ( y ) )", "(ROOT x)", "(ROOT y)"]
    write(f"{g}/MNLI/train.tsv", [tsv(*mnli_cols, "label1", "gold_label"),
                                  tsv("0", "31193", "31193n", "government", *parses,
                                      "Conceptually cream skimming.", "Product and geography.",
                                      "neutral", "neutral")])
    for name, gold in (("dev_matched", "contradiction"), ("dev_mismatched", "entailment")):
        write(f"{g}/MNLI/{name}.tsv", [
            tsv(*mnli_cols, "label1", "label2", "label3", "label4", "label5", "gold_label"),
            tsv("0", "1", "1n", "fiction", *parses, "The new rights.", "Everyone loves it.",
                gold, gold, gold, gold, gold, gold)])
    for name in ("test_matched", "test_mismatched"):
        write(f"{g}/MNLI/{name}.tsv", [tsv(*mnli_cols), tsv("0", "1", "1n", "fiction", *parses,
                                                            "Hi.", "Bye."),
                                       tsv("1", "2", "2n", "fiction", *parses, "A.", "B.")])
    for task, a, b, labels in (("QNLI", "question", "sentence", ("entailment", "not_entailment")),
                               ("RTE", "sentence1", "sentence2", ("not_entailment", "entailment")),
                               ("WNLI", "sentence1", "sentence2", ("1", "0"))):
        write(f"{g}/{task}/train.tsv", [tsv("index", a, b, "label"),
                                        tsv("0", "What?", "This.", labels[0]),
                                        tsv("1", "Who?", "Them.", labels[1])])
        write(f"{g}/{task}/dev.tsv", [tsv("index", a, b, "label"), tsv("0", "X?", "Y.",
                                                                       labels[0])])
        write(f"{g}/{task}/test.tsv", [tsv("index", a, b), tsv("0", "P?", "Q.")])
    return g


def test_every_glue_task_reads_its_official_layout(tmp_path):
    root = write_glue(str(tmp_path))
    data = {name: readers.read_glue(root, readers.glue_task(name)) for name in readers.GLUE_TASKS}
    cola = data["cola"]
    assert [(e.text_a, e.label) for e in cola["train"]] == [
        ("Our friends won't buy this analysis.", 1), ('They drank the pub "dry".', 0)]
    assert cola["CoLA"][0].text_a == "Bill whistled past." and cola["CoLA"][0].label is None
    assert data["sst2"]["dev"][0].text_b is None and data["sst2"]["dev"][0].label == 1
    mrpc = data["mrpc"]["train"][0]  # BOM in the header, bare quotes in the text
    assert (mrpc.text_a, mrpc.text_b, mrpc.label) == ('Amrozi said "x" .',
                                                      "Referring to him , he said .", 1)
    assert data["mrpc"]["MRPC"][0].text_b == "Mr Wong ."
    assert data["stsb"]["train"][0].label == 5.0 and data["stsb"]["dev"][0].label == 0.25
    assert data["stsb"]["STS-B"][0].text_b == "B."
    assert [e.label for e in data["qqp"]["train"]] == [1, 0]  # the malformed row is skipped
    assert data["qqp"]["QQP"][0].text_a == "A?"
    mnli = data["mnli"]
    labels = readers.glue_task("mnli").labels
    assert labels[mnli["train"][0].label] == "neutral"
    assert labels[mnli["matched"][0].label] == "contradiction"
    assert labels[mnli["mismatched"][0].label] == "entailment"
    assert [e.index for e in mnli["MNLI-mm"]] == ["0", "1"]
    assert mnli["MNLI-m"][1].text_a == "A." and mnli["MNLI-m"][1].text_b == "B."
    for name in ("qnli", "rte"):
        task = readers.glue_task(name)
        assert {task.labels[e.label] for e in data[name]["train"]} == {"entailment",
                                                                      "not_entailment"}
    assert [e.label for e in data["wnli"]["train"]] == [1, 0]
    assert readers.glue_task("mnli").primary_metric == "matched_accuracy"
    assert readers.glue_task("cola").primary_metric == "matthews_corrcoef"


def test_bad_glue_rows_name_file_and_line(tmp_path):
    path = str(tmp_path / "SST-2" / "train.tsv")
    write(path, [tsv("sentence", "label"), tsv("good", "1"), tsv("bad", "2")])
    with pytest.raises(DataError, match=r"train.tsv:3: label '2' is not one of"):
        readers.read_glue_file(path, readers.glue_task("sst2"), True)
    write(path, [tsv("sentence", "label"), tsv("   ", "1")])
    with pytest.raises(DataError, match=r"train.tsv:2: empty text in column 'sentence'"):
        readers.read_glue_file(path, readers.glue_task("sst2"), True)
    write(path, [tsv("sentence", "label"), "just text"])
    with pytest.raises(DataError, match=r"train.tsv:2: missing column 'label'"):
        readers.read_glue_file(path, readers.glue_task("sst2"), True)


def test_tfds_path_on_mock_data():
    import tensorflow_datasets as tfds

    task = readers.glue_task("mnli")
    with tfds.testing.mock_data(num_examples=6):
        splits = readers.read_glue_tfds(task)
    assert set(splits) == {"train", "matched", "mismatched", "MNLI-m", "MNLI-mm"}
    assert all(len(v) == 6 for v in splits.values())
    assert all(0 <= e.label < 3 for e in splits["matched"])
    assert all(e.label is None and e.text_b for e in splits["MNLI-m"])
    indices = [int(e.index) for e in splits["MNLI-m"]]
    assert indices == sorted(indices)
    with tfds.testing.mock_data(num_examples=4):
        stsb = readers.read_glue_tfds(readers.glue_task("stsb"))
    assert all(isinstance(e.label, float) for e in stsb["train"])


def test_swag_official_csv(tmp_path):
    header = ["", "video-id", "fold-ind", "startphrase", "sent1", "sent2", "gold-source",
              "ending0", "ending1", "ending2", "ending3", "label"]
    row = ["0", "lsmdc3001", "17", "Students lower their eyes. Someone", "Students lower "
           "their eyes nervously.", "She", "gold", "pats her shoulder.", 'says "no", then.',
           "smiles.", "leaves.", "2"]
    for name, cols, r in (("train.csv", header, row), ("val.csv", header, row),
                          ("test.csv", header[:-1], row[:-1])):
        with open(tmp_path / name, "w", newline="") as f:
            csv.writer(f).writerows([cols, r])
    swag = readers.read_swag(str(tmp_path))
    example = swag["train"][0]
    assert example.context == "Students lower their eyes nervously."
    assert example.endings == ("She pats her shoulder.", 'She says "no", then.', "She smiles.",
                               "She leaves.")
    assert example.label == 2 and swag["test"][0].label is None


def test_user_files_csv_tsv_jsonl_and_errors(tmp_path):
    rows = [{"review": "great film", "topic": "movies", "stars": "pos"},
            {"review": "dull, slow", "topic": "movies", "stars": "neg"}]
    with open(tmp_path / "a.csv", "w", newline="") as f:
        w = csv.DictWriter(f, ["review", "topic", "stars"])
        w.writeheader()
        w.writerows(rows)
    write(str(tmp_path / "a.tsv"), ["review\ttopic\tstars"] +
          [tsv(r["review"], r["topic"], r["stars"]) for r in rows])
    write(str(tmp_path / "a.jsonl"), [json.dumps(r) for r in rows])
    for ext in ("csv", "tsv", "jsonl"):
        path = str(tmp_path / f"a.{ext}")
        labels = readers.infer_labels(path, "stars")
        assert labels == ("neg", "pos")
        examples = readers.read_file(path, "classification", text_a="review", text_b="topic",
                                  label="stars", labels=labels)
        assert [(e.text_a, e.text_b, e.label) for e in examples] == [
            ("great film", "movies", 1), ("dull, slow", "movies", 0)]
    write(str(tmp_path / "bad.jsonl"), [json.dumps(rows[0]), json.dumps({"review": "x"})])
    with pytest.raises(DataError, match=r"bad.jsonl:2: no column 'stars' \(config.data.label, "
                       r"predict --label\); the file's columns: review"):
        readers.read_file(str(tmp_path / "bad.jsonl"), "classification", text_a="review",
                       label="stars", labels=("neg", "pos"))
    write(str(tmp_path / "bad.csv"), ["review,stars", "fine,pos", ",neg"])
    with pytest.raises(DataError, match=r"bad.csv:3: empty text in column 'review'"):
        readers.read_file(str(tmp_path / "bad.csv"), "classification", text_a="review",
                       label="stars", labels=("neg", "pos"))
    write(str(tmp_path / "bad.tsv"), ["review\tstars", "fine\tpos", "fine\tmeh", "short"])
    with pytest.raises(DataError, match=r"bad.tsv:3: label 'meh' is not one of"):
        readers.read_file(str(tmp_path / "bad.tsv"), "classification", text_a="review",
                       label="stars", labels=("neg", "pos"))
    write(str(tmp_path / "short.tsv"), ["review\tstars", "short"])
    with pytest.raises(DataError, match=r"short.tsv:2: missing column 'stars'"):
        readers.read_file(str(tmp_path / "short.tsv"), "regression", text_a="review",
                       label="stars")
    write(str(tmp_path / "mc.jsonl"), [json.dumps({"q": "2+2", "a": "4", "b": "5", "y": 0})])
    mc = readers.read_file(str(tmp_path / "mc.jsonl"), "multiple_choice", text_a="q",
                        choices=("a", "b"), label="y")
    assert mc[0].endings == ("4", "5") and mc[0].label == 0


class _ToyTokenizer:
    """Whitespace tokens → ids; enough of the tokenizer contract for feature tests."""

    def encode_batch(self, texts_a, texts_b=None, max_seq_length=None):
        from types import SimpleNamespace

        out = []
        for i, a in enumerate(texts_a):
            b = texts_b[i].split() if texts_b else None
            a = a.split()
            budget = max_seq_length - (3 if b is not None else 2)
            while len(a) + len(b or []) > budget:  # trim the longer side first
                (a if len(a) >= len(b or []) else b).pop()
            ids = [2] + [10 + len(t) for t in a] + [3]
            seg = [0] * len(ids)
            if b is not None:
                ids += [10 + len(t) for t in b] + [3]
                seg += [1] * (len(b) + 1)
            n = len(ids)
            pad = max_seq_length - n
            out.append(SimpleNamespace(input_ids=ids + [0] * pad, segment_ids=seg + [0] * pad,
                                       input_mask=[1] * n + [0] * pad))
        return out


def test_training_batches_cover_every_example_and_group_by_length_wastes_little():
    rng = np.random.default_rng(0)
    # GLUE-like lengths: most sentences short, a long tail (some truncated at 128).
    lengths = np.clip(rng.lognormal(3.0, 0.8, 2000).astype(int), 1, 200)
    examples = [finetune_data.Example(str(i), " ".join(["w"] * int(n)), None,
                                      int(rng.integers(0, 2)))
                for i, n in enumerate(lengths)]
    features = finetune_data.encode(_ToyTokenizer(), examples, max_seq_length=128)
    assert features.lengths.max() <= 128
    buckets = finetune_data.bucket_lengths(128)
    assert buckets == (16, 32, 64, 128)
    for group in (False, True):
        seen, spreads = [], []
        for batch in finetune_data.batches(features, 32, buckets, shuffle=True, seed=1,
                                           group_by_length=group):
            real = batch["example_index"] >= 0
            seen += list(batch["example_index"][real])
            length = batch["input_ids"].shape[1]
            rows = batch["input_mask"].sum(1)[real]
            # The smallest length that holds the batch's longest example: of the buckets when
            # grouped, of the finer grid for uniform draws.
            lengths = buckets if group else finetune_data.prediction_buckets(buckets)
            assert rows.max() <= length and length in lengths
            assert length == lengths[0] or rows.max() > lengths[lengths.index(length) - 1]
            spreads.append(np.unique(finetune_data.assign_buckets(rows, buckets)).size)
            np.testing.assert_array_equal(batch["weights"], real.astype(np.float32))
            np.testing.assert_array_equal(batch["labels"][real], features.labels[batch[
                "example_index"][real]])
        assert sorted(seen) == list(range(2000))  # every example exactly once per epoch
        if group:  # one bucket a batch, but for the leftovers carried into the next bucket
            assert sum(s > 1 for s in spreads) <= len(buckets) - 1
        else:  # uniform draws: batches of one permutation, batches mix the lengths
            order = np.random.default_rng(1).permutation(2000)
            batches = {tuple(order[i:i + 32]) for i in range(0, 2000, 32)}
            drawn = finetune_data.plan_batches(features, 32, buckets, shuffle=True, seed=1)
            assert {tuple(rows) for _, rows in drawn} == batches
            assert np.mean(spreads) > 2
    grouped, _ = finetune_data.padding_fraction(features, 32, buckets, group_by_length=True)
    drawn, used = finetune_data.padding_fraction(features, 32, buckets)
    longest = [features.lengths[rows].max() for _, rows in
               finetune_data.plan_batches(features, 32, buckets, shuffle=True)]
    coarse = 1 - features.lengths.sum() / (  # the same draws padded to the buckets only
        32 * np.asarray(buckets)[finetune_data.assign_buckets(np.array(longest), buckets)].sum())
    fixed, _ = finetune_data.padding_fraction(features, 32, (128,))
    assert len(used) <= 6  # the longest rows of uniform draws hit a few lengths of the grid
    assert grouped < 0.5 * fixed and drawn < coarse <= fixed, (grouped, drawn, coarse, fixed)


def test_prediction_plan_shapes_depend_on_a_row_only():
    rng = np.random.default_rng(0)
    lengths = np.clip(rng.lognormal(3.0, 0.8, 700).astype(int), 2, 128)
    buckets = finetune_data.prediction_buckets((16, 32, 64, 128))
    assert buckets == (16, 24, 32, 40, 48, 56, 64, 80, 96, 112, 128)
    assert finetune_data.prediction_buckets((384,)) == (384,)

    def shapes(part, offset=0):  # example → (rows, length) of its batch
        plan = finetune_data.prediction_plan(lengths[part], 8, (16, 32, 64, 128))
        return {offset + i: (rows, length) for length, rows, indices in plan for i in indices}

    whole = shapes(slice(None))
    assert sorted(whole) == list(range(700))  # every example exactly once
    for i, (rows, length) in whole.items():
        # The smallest length of the grid that holds it; rows x length about 8 x 128 tokens.
        assert length == min(b for b in buckets if b >= lengths[i])
        assert rows % 8 == 0 and 8 * 128 // 2 < rows * length <= 8 * 128
    # Any split of the rows (a file streamed in chunks) puts every row in the same shape.
    for first in (0, 7, 350):
        part = shapes(slice(first, first + 93), first)
        assert all(whole[i] == shape for i, shape in part.items())


def test_prediction_rows_fill_short_batches_to_the_tokens_of_128_token_rows():
    """Whatever max_seq_length: a short batch holds about the tokens of 8 rows of 128, and
    rows of 128 tokens or more come 8 a batch (at 384 more rows would mostly be filler)."""
    for longest in (64, 128, 384, 512):
        grid = finetune_data.prediction_buckets(finetune_data.bucket_lengths(longest, 16))
        for length in grid:
            rows = finetune_data.prediction_rows(8, length, longest)
            target = min(longest, 128)
            if length * 2 > target:
                assert rows == 8, (longest, length)
            else:
                assert rows % 8 == 0 and target * 8 // 2 < rows * length <= target * 8


def test_multiple_choice_features_and_host_slices():
    examples = [finetune_data.ChoiceExample(str(i), "a b c", ("x", "y y", "z z z", "w"), i % 4)
                for i in range(8)]
    features = finetune_data.encode(_ToyTokenizer(), examples, max_seq_length=16)
    full = finetune_data.make_batch(features, 16, np.arange(8), 8)
    assert full["input_ids"].shape == (8, 4, 16)
    np.testing.assert_array_equal(full["input_mask"][0].sum(-1), [7, 8, 9, 7])
    np.testing.assert_array_equal(full["segment_ids"][0, 2, 5:8], [1, 1, 1])
    halves = [finetune_data.make_batch(features, 16, np.arange(8), 8, p, 2) for p in (0, 1)]
    np.testing.assert_array_equal(np.concatenate([h["input_ids"] for h in halves]),
                                  full["input_ids"])


def test_submission_files(tmp_path):
    path = write_submission(str(tmp_path), "MNLI-m", ["0", "1", "2"], np.array([2, 0, 1]),
                            readers.glue_task("mnli").labels)
    assert os.path.basename(path) == "MNLI-m.tsv"
    with open(path) as f:
        assert f.read().split("\n") == ["index\tprediction", "0\tcontradiction",
                                        "1\tentailment", "2\tneutral", ""]
    path = write_submission(str(tmp_path), "STS-B", ["0", "1"], np.array([-0.4, 5.6]), ())
    with open(path) as f:
        rows = list(csv.reader(f, delimiter="\t"))
    assert rows == [["index", "prediction"], ["0", "0.000"], ["1", "5.000"]]
