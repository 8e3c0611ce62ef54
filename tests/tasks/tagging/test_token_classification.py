"""Token classification: first-sub-token features across windows and document context, the
masked loss and the metric blind to other sub-tokens, and a tiny CoNLL-2003-layout run through
`python -m bertjax.finetune --config=experiments/ner.py:conll2003`."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import tagging_data as td
from conftest import run_python

from bertjax.tasks.tagging import features as token_features
from bertjax.tasks.tagging import schemes
from bertjax.tasks.tagging.readers import Sentence
from bertjax.tasks.tagging.task import token_loss


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return td.write_checkpoint(tmp_path_factory.mktemp("tiny_tagger"))


@pytest.fixture(scope="module")
def tokenizer(checkpoint):
    from bertjax.checkpoint_dir import load_pretrained

    return load_pretrained(checkpoint)[2]


def sentences(seed, n, docs_every=4, **kw):
    return [Sentence(tuple(w), tuple(t), f"gen:{i}", i // docs_every)
            for i, (w, t) in enumerate(td.dataset(seed, n, **kw))]


LABELS = {t: i for i, t in enumerate(["O", *(f"{p}-{t}" for t in td.TYPES for p in "BI")])}


@pytest.mark.parametrize("max_len,stride,context", [
    (12, 4, False),  # most sentences need several windows
    (12, 3, True),
    (40, 10, True),  # sentences fit: neighbours fill the rest
    (64, 64, False),
])
def test_every_word_predicted_once_from_its_first_sub_token(tokenizer, max_len, stride,
                                                            context):
    data = sentences(0, 60, min_len=1, max_len=25)
    features = token_features.encode(tokenizer, data, LABELS, max_len, stride, context)
    seen = [np.zeros(len(s.words), int) for s in data]
    for row in range(len(features)):
        s = data[features.sentence[row]]
        ids, words, labels = (features.input_ids[row], features.word_index[row],
                              features.label_ids[row])
        assert len(ids) <= max_len and ids[0] == tokenizer.cls_id and ids[-1] == tokenizer.sep_id
        for position in np.flatnonzero(words >= 0):
            w = words[position]
            seen[features.sentence[row]][w] += 1
            first_piece = tokenizer.convert_tokens_to_ids(tokenizer.tokenize(s.words[w]))[0]
            assert ids[position] == first_piece
            assert labels[position] == LABELS[s.tags[w]]
        assert np.all((labels >= 0) == (words >= 0))  # nothing else carries a label
    assert all(np.all(c == 1) for c in seen)
    # The reassembly reads each word at its position: gold round-trips exactly.
    gold = token_features.sentence_predictions(features, features.label_ids)
    assert [list(g) for g in gold] == [[LABELS[t] for t in s.tags] for s in data]
    if not context:
        assert len(features) > len(data) or max_len == 64  # windows were needed


def test_document_context_is_the_neighbours_of_the_same_document(tokenizer):
    data = sentences(1, 12, docs_every=4, min_len=3, max_len=6)
    features = token_features.encode(tokenizer, data, LABELS, 40, 10, True)
    pieces = [[p for w in s.words for p in tokenizer.convert_tokens_to_ids(
        tokenizer.tokenize(w))] for s in data]
    assert len(features) == len(data)
    for row, s in enumerate(data):
        ids = list(features.input_ids[row][1:-1])
        doc = [i for i, x in enumerate(data) if x.document == s.document]
        stream = [p for i in doc for p in pieces[i]]  # the document's pieces in order
        start = sum(len(pieces[i]) for i in doc if i < row)
        own = np.flatnonzero(features.word_index[row] >= 0)
        left = own[0] - 1  # pieces before the sentence's first word
        # The row is a contiguous stretch of the document around the sentence.
        assert ids == stream[start - left:start - left + len(ids)]
        assert len(ids) == min(38, len(stream))
        right = len(ids) - left - len(pieces[row])
        if left and right:  # room split about evenly when both sides have text
            assert abs(left - right) <= 1 or start - left == 0 or \
                start + len(pieces[row]) + right == len(stream)


def test_loss_and_metric_ignore_other_sub_tokens(tokenizer):
    data = sentences(2, 16, min_len=4, max_len=10)
    features = token_features.encode(tokenizer, data, LABELS, 32, 8, True)
    batch = next(token_features.batches(features, 16, (32,), shuffle=False))
    rng = np.random.default_rng(0)
    logits = rng.normal(size=batch["input_ids"].shape + (len(LABELS),)).astype(np.float32)
    loss, _ = token_loss(jnp.asarray(logits), batch["label_ids"], batch["label_weights"])
    # NumPy reference: mean NLL over the scored positions only.
    logp = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    nll = -np.take_along_axis(logp, batch["label_ids"][..., None], -1)[..., 0]
    w = batch["label_weights"]
    np.testing.assert_allclose(loss, (nll * w).sum() / w.sum(), rtol=1e-5)
    other = (w == 0)
    assert other[batch["input_mask"] == 1].sum() > w.sum()  # sub-tokens, context, specials
    perturbed = np.where(other[..., None], rng.normal(size=logits.shape) * 50, logits)
    loss2, _ = token_loss(jnp.asarray(perturbed), batch["label_ids"], batch["label_weights"])
    assert float(loss2) == float(loss)
    grad = jax.grad(lambda x: token_loss(x, batch["label_ids"], batch["label_weights"])[0])(
        jnp.asarray(logits))
    assert np.all(np.asarray(grad)[other] == 0)
    # Metric: predictions at unscored positions change nothing.
    predicted = [np.asarray(r) for r in features.label_ids]
    noisy = [np.where(features.word_index[r] >= 0, p, rng.integers(0, len(LABELS), len(p)))
             for r, p in enumerate(predicted)]
    assert [list(x) for x in token_features.sentence_predictions(features, noisy)] == [
        list(x) for x in token_features.sentence_predictions(features, predicted)]


@pytest.mark.slow
def test_conll2003_layout_end_to_end_cli(checkpoint, tmp_path):
    """IOB1 files with -DOCSTART-, windows (stride) and document context on, through the CLI:
    dev entity F1 ≥ 0.95, predictions/test.conll readable by conlleval."""
    for name, seed, n in (("eng.train", 0, 320), ("eng.testa", 1, 80), ("eng.testb", 2, 60)):
        data = [(w, schemes.convert(t, "iob2", "iob1")) for w, t in td.dataset(seed, n)]
        td.write_conll(tmp_path / name, data, docs_every=10)
    workdir = tmp_path / "run"
    result = run_python([
        "-m", "bertjax.finetune", "--config=experiments/ner.py:conll2003",
        f"--config.init_checkpoint={checkpoint}", f"--workdir={workdir}",
        f"--config.data.dir={tmp_path}", "--config.train.batch_size=16",
        "--config.train.num_epochs=3", "--config.optimizer.learning_rate=1e-3",
        # A few dozen steps, set for the reference's uncorrected Adam (larger early steps).
        "--config.optimizer.name=bert_adamw", "--config.optimizer.schedule=reference",
        "--config.max_seq_length=32", "--config.data.stride=8", "--config.log_every_steps=100",
        "--config.min_bucket_length=32", "--config.eval.batch_size=32",  # one shape: 2 compiles
    ], timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    results = json.loads((workdir / "results.json").read_text())
    print("ner dev", results["best"])
    assert results["primary_metric"] == "f1" and results["best"]["f1"] >= 0.95
    assert {"LOC_f1", "ORG_f1", "PER_f1", "accuracy"} <= set(results["best"])
    assert "overall" in result.stdout and "PER" in result.stdout  # the per-type table
    blocks = (workdir / "predictions" / "test.conll").read_text().strip("\n").split("\n\n")
    gold = [(w, schemes.convert(t, "iob2", "iob2")) for w, t in td.dataset(2, 60)]
    assert len(blocks) == len(gold)
    rows = [[line.split(" ") for line in b.split("\n")] for b in blocks]
    assert [[r[0] for r in b] for b in rows] == [w for w, _ in gold]
    assert [[r[1] for r in b] for b in rows] == [t for _, t in gold]  # IOB2 gold
    from bertjax.tasks.tagging.metrics import entity_scores

    test_f1 = entity_scores([[r[1] for r in b] for b in rows],
                            [[r[2] for r in b] for b in rows])["overall"]["f1"]
    assert test_f1 >= 0.95


def test_bad_file_is_one_error_line_from_the_cli(checkpoint, tmp_path):
    (tmp_path / "train.conll").write_text("a O\nb B-PER\n\nc I-PER\n\n")
    (tmp_path / "dev.conll").write_text("a O\n\n")
    result = run_python([
        "-m", "bertjax.finetune", "--config=experiments/ner.py:files",
        f"--config.init_checkpoint={checkpoint}", f"--workdir={tmp_path / 'run'}",
        "--config.max_seq_length=32", f"--config.data.train={tmp_path / 'train.conll'}",
        f"--config.data.validation={tmp_path / 'dev.conll'}"], timeout=120)
    assert result.returncode != 0
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert lines == [f"error: {tmp_path / 'train.conll'}:4: tag 'I-PER' after the sentence "
                     "start breaks the iob2 scheme (expected 'B-PER'); set the scheme the "
                     "file uses"], result.stderr[-2000:]


@pytest.mark.parametrize("layout", ["conll", "jsonl"])
def test_document_context_only_inside_documents_the_file_marks(tokenizer, tmp_path, layout):
    """A file without document marks (unrelated sentences, e.g. tweets) is encoded one
    sentence a row, [CLS] sentence [SEP], under the default document_context; marks (one
    -DOCSTART- on top, a JSONL "document" field) make a document, whose rows read across."""
    from bertjax.tasks.tagging import readers
    from experiments.ner import data_config

    assert data_config().document_context  # the default stays on (the paper's setting)
    data = td.dataset(5, 10, min_len=2, max_len=5)
    plain, marked = tmp_path / f"plain.{layout}", tmp_path / f"marked.{layout}"
    if layout == "conll":
        td.write_conll(plain, data)
        td.write_conll(marked, data, docs_every=len(data))  # one -DOCSTART- on top
    else:
        for path, doc in ((plain, None), (marked, "d")):
            path.write_text("".join(json.dumps({"tokens": w, "tags": t, **(
                {"document": doc} if doc else {})}) + "\n" for w, t in data))
    pieces = [len(tokenizer.tokenize(" ".join(w))) for w, _ in data]
    alone = readers.read_file(str(plain), scheme="iob2", first_document=3)
    assert [s.document for s in alone] == list(range(3, 3 + len(data)))
    rows = token_features.encode(tokenizer, alone, LABELS, 64, 64, True)
    assert [len(r) for r in rows.input_ids] == [n + 2 for n in pieces]  # nothing but itself
    together = readers.read_file(str(marked), scheme="iob2")
    assert {s.document for s in together} == {0}
    rows = token_features.encode(tokenizer, together, LABELS, 64, 64, True)
    assert [len(r) for r in rows.input_ids] == [min(64, sum(pieces) + 2)] * len(data)


def test_sentences_alone_are_the_rows_transformers_builds(tmp_path):
    """Unmarked sentences (tweets): bertjax's rows are `[CLS] sentence [SEP]` with the same
    ids as transformers' fast tokenizer on the words, labels on the same first sub-tokens."""
    import transformers

    from bertjax.tokenization.loading import load_tokenizer

    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "@", "#", ":", "/", ".", "!",
             "user", "new", "york", "http", "t", "co", "##s", "##ing", "rock", "caf", "##e",
             "go", "to", "lol"]
    (tmp_path / "vocab.txt").write_text("\n".join(vocab) + "\n")
    words = [["@user", "goes", "to", "New", "York", "!"],
             ["Rocking", "#NewYork", "http://t.co", "lol", "😀"],
             ["café", "rocks", "..."]]
    tags = [["O", "O", "O", "B-LOC", "I-LOC", "O"], ["O", "B-LOC", "O", "O", "O"],
            ["B-ORG", "O", "O"]]
    ids = {"O": 0, "B-LOC": 1, "I-LOC": 2, "B-ORG": 3}
    alone = [Sentence(tuple(w), tuple(t), f"t:{i}", i) for i, (w, t) in
             enumerate(zip(words, tags))]
    ours = token_features.encode(load_tokenizer(str(tmp_path / "vocab.txt"),
                                                do_lower_case=True),
                                 alone, ids, max_seq_length=64, stride=32,
                                 document_context=True)
    reference = transformers.BertTokenizerFast(str(tmp_path / "vocab.txt"), do_lower_case=True)
    for row, (w, t) in enumerate(zip(words, tags)):
        enc = reference(w, is_split_into_words=True)
        assert ours.input_ids[row].tolist() == enc["input_ids"]
        word_ids = enc.word_ids()
        firsts = [p for p, k in enumerate(word_ids)
                  if k is not None and (p == 0 or word_ids[p - 1] != k)]
        assert np.flatnonzero(ours.label_ids[row] >= 0).tolist() == firsts
        assert ours.label_ids[row][firsts].tolist() == [ids[x] for x in t]
