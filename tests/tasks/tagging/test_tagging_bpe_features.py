"""Token classification with a ByteLevel BPE tokenizer.json (ModernBERT's kind, trained here):
a sentence's pieces are those of its words as one text (later words with "Ġ", the first
without, as the tokenizers library gives them), each word's label sits on its first piece and
every other piece is unscored (weight 0), word boundaries agree with the tokenizers library's
own word_ids(), over windows and document context; and a short fine-tuning run of a tiny
ModernBERT carrying the tokenizer.json that learns."""

import modern_checkpoint
import numpy as np
import pytest
import tagging_data as td

from bertjax.tasks.tagging import features as token_features
from bertjax.tasks.tagging.readers import Sentence

SPACE = "\u0120"  # "Ġ"
LABELS = {t: i for i, t in enumerate(["O", *(f"{p}-{t}" for t in td.TYPES for p in "BI")])}

# CoNLL-style sentences whose every word is one pre-token of the ByteLevel pre-tokenizer
# (letters only, or punctuation only): dataset words and tokenizers words then coincide.
PLAIN = [
    (["Photosynthesis", "converts", "light", "in", "Zürich", "."],
     ["B-ORG", "O", "O", "O", "B-LOC", "O"]),
    (["Tom", "went", "to", "Paris", ",", "and", "the", "café", "closed", "!"],
     ["B-PER", "O", "O", "B-LOC", "O", "O", "O", "O", "O", "O"]),
    (["Beijing", "University", "(", "北京大学", ")", "was", "founded"],
     ["B-ORG", "I-ORG", "O", "B-ORG", "O", "O", "O"]),
    (["riverbank"], ["O"]),
    (["The", "quick", "brown", "fox", "jumps", "over", "the", "lazy", "dog"],
     ["O"] * 9),
]
# Words of several pre-tokens or pieces (digits, hyphens, apostrophes, emoji).
MIXED = [
    (["perb1s", "peri2ing", "w12", "didn't", "well-known", "😀", "€100", "3.14"],
     ["B-PER", "I-PER", "O", "O", "O", "O", "O", "O"]),
    (["New", "York's", "mayor", "said", ":", "\"We", "will", "rebuild.\""],
     ["B-LOC", "I-LOC", "O", "O", "O", "O", "O", "O"]),
]


@pytest.fixture(scope="module")
def tokenizer():
    return modern_checkpoint.bpe_tokenizer()


def as_sentences(pairs, docs_every=1):
    return [Sentence(tuple(w), tuple(t), f"s:{i}", i // docs_every)
            for i, (w, t) in enumerate(pairs)]


def generated(seed, n, docs_every=4, **kw):
    return as_sentences(td.dataset(seed, n, **kw), docs_every)


def reference(tokenizer, words):
    """The tokenizers library on the words as one text: (ids, offsets, word_ids)."""
    enc = tokenizer.backend.encode(" ".join(words), add_special_tokens=False)
    return enc.ids, enc.offsets, enc.word_ids


def first_pieces(words, offsets):
    """Each word's first piece: the first whose span (the tokenizers library's, with the
    space a "Ġ" piece carries) reaches into the word or the space before it."""
    starts = np.cumsum([0] + [len(w) + 1 for w in words[:-1]])
    return [next(p for p, (_, e) in enumerate(offsets) if e > b - (w > 0))
            for w, b in enumerate(starts)]


def test_pieces_are_the_sentence_texts_with_labels_on_first_pieces(tokenizer):
    data = as_sentences(PLAIN + MIXED)
    features = token_features.encode(tokenizer, data, LABELS, 128, 64, False)
    assert len(features) == len(data)
    for row, s in enumerate(data):
        ids, offsets, _ = reference(tokenizer, s.words)
        assert features.input_ids[row].tolist() == [tokenizer.cls_id, *ids, tokenizer.sep_id]
        firsts = [1 + p for p in first_pieces(s.words, offsets)]
        labels, words = features.label_ids[row], features.word_index[row]
        assert np.flatnonzero(labels >= 0).tolist() == firsts
        assert labels[firsts].tolist() == [LABELS[t] for t in s.tags]
        assert words[firsts].tolist() == list(range(len(s.words)))
        assert np.all(words[labels < 0] == -1)
        tokens = tokenizer.convert_ids_to_tokens(features.input_ids[row][firsts])
        # The sentence's first word has no "Ġ" (no prefix space); every later one has it
        # (alone, as a lone "Ġ" piece, before a word of bytes the merges did not join).
        assert not tokens[0].startswith(SPACE)
        assert all(t.startswith(SPACE) for t in tokens[1:]), tokens


def test_word_boundaries_are_the_tokenizers_word_ids(tokenizer):
    """Where dataset words are pre-tokens, the scored positions are exactly where the
    tokenizers library's word_ids() start a word; elsewhere they are a subset of them."""
    plain = as_sentences(PLAIN)
    mixed = as_sentences(MIXED) + generated(0, 30)
    for data, exact in ((plain, True), (mixed, False)):
        features = token_features.encode(tokenizer, data, LABELS, 128, 64, False)
        for row, s in enumerate(data):
            _, _, word_ids = reference(tokenizer, s.words)
            starts = {1 + p for p, k in enumerate(word_ids) if p == 0 or word_ids[p - 1] != k}
            ours = set(np.flatnonzero(features.word_index[row] >= 0).tolist())
            if exact:
                assert ours == starts, s.words
            else:
                assert ours <= starts, s.words
        if not exact:  # the mixed words really do span several tokenizers words
            assert sum(len(r) for r in features.input_ids) > sum(
                len(s.words) for s in data) + 2 * len(data)


@pytest.mark.parametrize("max_len,stride,context", [
    (12, 4, False),  # most sentences need several windows
    (12, 3, True),
    (40, 10, True),  # sentences fit: neighbours fill the rest
])
def test_every_word_scored_once_on_its_first_piece(tokenizer, max_len, stride, context):
    data = generated(1, 40, min_len=1, max_len=20) + as_sentences(PLAIN + MIXED)
    features = token_features.encode(tokenizer, data, LABELS, max_len, stride, context)
    own = {}
    for s, sentence in enumerate(data):
        ids, offsets, _ = reference(tokenizer, sentence.words)
        own[s] = ids, first_pieces(sentence.words, offsets)
    seen = [np.zeros(len(s.words), int) for s in data]
    for row in range(len(features)):
        s = features.sentence[row]
        ids, words, labels = (features.input_ids[row], features.word_index[row],
                              features.label_ids[row])
        assert len(ids) <= max_len and ids[0] == tokenizer.cls_id and ids[-1] == tokenizer.sep_id
        lo, hi = features.own[row]
        sentence_ids, firsts = own[s]
        for position in np.flatnonzero(words >= 0):
            w = words[position]
            seen[s][w] += 1
            assert lo <= position < hi
            assert ids[position] == sentence_ids[firsts[w]]
            assert labels[position] == LABELS[data[s].tags[w]]
        assert np.all((labels >= 0) == (words >= 0))
    assert all(np.all(c == 1) for c in seen)
    gold = token_features.sentence_predictions(features, features.label_ids)
    assert [list(g) for g in gold] == [[LABELS[t] for t in s.tags] for s in data]
    # In the batches, every unscored position (other pieces, context, specials, padding)
    # weighs 0.
    for batch in token_features.batches(features, 8, (max_len,), shuffle=False):
        rows = batch["example_index"]
        for r, i in enumerate(rows):
            if i < 0:
                assert batch["label_weights"][r].sum() == 0
                continue
            scored = np.zeros(batch["input_ids"].shape[1], bool)
            scored[:len(features.word_index[i])] = features.word_index[i] >= 0
            assert np.array_equal(batch["label_weights"][r] > 0, scored)


def test_an_empty_word_keeps_a_position(tokenizer):
    """An empty word (two spaces in the sentence's text) is scored at a piece of its own: the
    lone space piece ByteLevel BPE gives it (a tokenizer that gives nothing: [UNK])."""
    data = as_sentences([(["Tom", "", "went"], ["B-PER", "O", "O"])])
    features = token_features.encode(tokenizer, data, LABELS, 32, 16, False)
    ids, words = features.input_ids[0], features.word_index[0]
    positions = np.flatnonzero(words >= 0)
    assert words[positions].tolist() == [0, 1, 2]
    assert ids[1:-1].tolist() == reference(tokenizer, ["Tom", "", "went"])[0]
    assert features.label_ids[0][positions].tolist() == [LABELS["B-PER"], 0, 0]


@pytest.mark.slow
def test_token_classification_with_a_bpe_modernbert_learns(tmp_path):
    """A tiny random ModernBERT whose checkpoint carries the tokenizer.json, fine-tuned on
    tagging_data's generated entities: the loss falls."""
    from finetune_task import train_losses

    from bertjax.tasks import train_and_evaluate
    from experiments.ner import get_config

    checkpoint = modern_checkpoint.write_modern_bpe_checkpoint(tmp_path)
    paths = {}
    for name, seed, n in (("train", 1, 160), ("dev", 2, 32)):
        paths[name] = str(tmp_path / f"{name}.conll")
        td.write_conll(tmp_path / f"{name}.conll", td.dataset(seed, n), docs_every=4)
    config = get_config("files")
    config.init_checkpoint = checkpoint
    config.data.train, config.data.validation = paths["train"], paths["dev"]
    config.data.scheme, config.data.token_column = "iob2", 0
    config.max_seq_length, config.train.batch_size, config.eval.batch_size = 48, 16, 32
    config.min_bucket_length = 48
    config.train.num_epochs, config.log_every_steps = 4, 1
    config.optimizer.learning_rate = 1e-3
    summary = train_and_evaluate(config, str(tmp_path / "run"), log=lambda *_: None)
    losses = train_losses(str(tmp_path / "run"))
    ordered = [losses[s] for s in sorted(losses)]
    assert np.mean(ordered[-4:]) < np.mean(ordered[:4]), ordered
    assert summary["primary_metric"] == "f1"
