"""SQuAD windows with a ByteLevel BPE tokenizer.json (ModernBERT's kind, trained here): every
answer comes back from its window's token offsets (first words without "Ġ", answers next to
punctuation, accents, CJK and emoji, long contexts over several windows, v2.0's unanswerable
questions), the same features from one and from two worker processes, the ids, segments and
offsets transformers' fast tokenizer gives the question/context pair, and a short fine-tuning
run of a tiny ModernBERT carrying the tokenizer.json that learns."""

import random

import modern_checkpoint
import numpy as np
import pytest

from bertjax.tasks.squad import features as squad_features
from bertjax.tasks.squad import readers
from bertjax.tasks.squad.metrics import normalize_answer

FIELDS = ("input_ids", "segment_ids", "input_mask", "start_positions", "end_positions",
          "example_index", "doc_start", "doc_offset", "doc_length", "max_context",
          "context_index")


@pytest.fixture(scope="module")
def tokenizer():
    return modern_checkpoint.bpe_tokenizer()


def example(qid, context, answer, occurrence=0, question="who is it ?", shift=0):
    """A question on `context` whose answer is the `occurrence`-th `answer` in it (shift:
    answer_start moved left by that many characters, the text with it)."""
    start = -1
    for _ in range(occurrence + 1):
        start = context.index(answer, start + 1)
    start -= shift
    text = context[start:start + len(answer) + shift]
    return readers.SquadExample(qid, question, context, [(text, start)])


HAND = [
    # The context's first word (no "Ġ"), one piece and several.
    ("Photosynthesis converts light energy into chemical energy.", "Photosynthesis"),
    ("Tom went to Paris in 1905, and he didn't come back.", "Tom"),
    ("Tom went to Paris in 1905, and he didn't come back.", "Tom went"),
    # Next to punctuation with no space: before "," / "." / ")", after "(" / "-".
    ("Tom went to Paris in 1905, and he didn't come back.", "1905"),
    ("Tom went to Paris in 1905, and he didn't come back.", "back"),
    ("They waited (about) twenty years.", "about"),
    ("The café is well-known in Zürich.", "known"),
    ("The café is well-known in Zürich.", "Zürich"),
    ("The café is well-known in Zürich.", "café"),
    ("New York's mayor said: \"We will rebuild.\"", "New York"),
    ("New York's mayor said: \"We will rebuild.\"", "We will rebuild."),
    # Non-ASCII: several byte pieces per character, a lone "Ġ" piece before a word.
    ("Beijing University (北京大学) was founded in 1898.", "北京大学"),
    ("Emoji 😀 and symbols like €100 appear.", "😀"),
    ("Emoji 😀 and symbols like €100 appear.", "€100"),
    # Whitespace runs and newlines around the answer.
    ("Paris  is   the\ncapital of\n\nFrance.", "the\ncapital"),
    ("Paris  is   the\ncapital of\n\nFrance.", "France"),
    # The whole context.
    ("first3 middle1 last2", "first3 middle1 last2"),
]


def hand_examples():
    out = [example(f"h{i}", c, a) for i, (c, a) in enumerate(HAND)]
    # answer_start on the space before the word (annotators' off-by-one): text " Paris".
    out.append(example("lead", "Tom went to Paris in 1905.", "Paris", shift=1))
    return out


def generated_examples(n, seed, impossible_rate=0.0):
    """squad_data's layout (filler words, one run of name words as the answer, anywhere in
    the context, at its start too), long enough for several windows, with punctuation."""
    rng = random.Random(seed)
    out = []
    for q in range(n):
        words = [rng.choice(squad_data_fillers()) for _ in range(rng.randint(3, 60))]
        answer = [rng.choice(["first1", "first2", "Paris", "Zürich"]), rng.choice(
            ["middle1", "(about)", "1905,"]), rng.choice(["last2", "last3."])]
        at = rng.choice([0, rng.randint(0, len(words))])
        impossible = rng.random() < impossible_rate
        if not impossible:
            words[at:at] = answer
        seps = [rng.choice([" ", " ", " ", "  ", "\n"]) for _ in words]
        context = "".join(w + s for w, s in zip(words, seps)).rstrip()
        question = " ".join(["who", "is", *rng.sample(squad_data_fillers(), 2), "?"])
        if impossible:
            out.append(readers.SquadExample(f"g{q}", question, context, [], True))
            continue
        start = sum(len(w) + len(s) for w, s in zip(words[:at], seps[:at]))
        text = "".join(w + s for w, s in zip(answer, seps[at:at + 3])).rstrip()
        out.append(readers.SquadExample(f"g{q}", question, context, [(text, start)]))
    return out


def squad_data_fillers():
    import squad_data

    return [*squad_data.FILLERS[:12], "Tom's", "well-known", "café", "北京", "😀", "don't"]


def recovered(features, w):
    spans = features.token_spans(w)
    context = features.examples[features.example_index[w]].context
    return context[spans[features.start_positions[w], 0]:spans[features.end_positions[w], 1]]


def check_answers(tokenizer, features):
    """Every window holding the whole answer points at it and its offsets give the gold text;
    every other window (and every window of an unanswerable question) points at [CLS]."""
    for e, ex in enumerate(features.examples):
        windows = np.flatnonzero(features.example_index == e)
        if ex.is_impossible:
            assert np.all(features.start_positions[windows] == 0)
            assert np.all(features.end_positions[windows] == 0)
            continue
        text, start = ex.answers[0]
        spans = features.contexts[features.context_index[e]]
        # The answer's tokens over the whole context: those overlapping its characters.
        overlap = np.flatnonzero((spans[:, 1] > start) & (spans[:, 0] < start + len(text)))
        held = 0
        for w in windows:
            lo, n = features.doc_start[w], features.doc_length[w]
            inside = lo <= overlap[0] and overlap[-1] < lo + n
            if not inside:
                assert features.start_positions[w] == features.end_positions[w] == 0
                continue
            held += 1
            assert 0 < features.start_positions[w] <= features.end_positions[w]
            got = recovered(features, w)
            # SQuAD's normalisation; exactly the characters where tokens end where the answer
            # does (a piece like '."' can hold the answer's last character and the next).
            assert normalize_answer(got) == normalize_answer(text), (ex.qas_id, got, text)
            lo_char = start + len(text) - len(text.lstrip())
            hi_char = start + len(text.rstrip())
            if spans[overlap[0], 0] == lo_char and spans[overlap[-1], 1] == hi_char:
                assert got == text.strip(), (ex.qas_id, got, text)
        assert held or overlap[-1] - overlap[0] >= features.doc_length[windows].max() - 1


@pytest.mark.parametrize("seq,stride", [(64, 16), (24, 5), (20, 1)])
def test_hand_answers_come_back_from_the_offsets(tokenizer, seq, stride):
    examples = hand_examples()
    features = squad_features.convert(tokenizer, examples, max_seq_length=seq,
                                      doc_stride=stride, max_query_length=8, training=True)
    check_answers(tokenizer, features)
    # Every hand answer is short enough to be held by some window.
    for e in range(len(examples)):
        windows = np.flatnonzero(features.example_index == e)
        assert features.start_positions[windows].max() > 0, examples[e].qas_id
    if seq == 24:
        assert len(features) > 2 * len(examples)  # long contexts took several windows


def test_first_word_and_lone_space_pieces(tokenizer):
    """The first context word is a piece without "Ġ" (as transformers' tokenizer gives it);
    answers starting there or after a lone "Ġ" piece (an empty span) start at the word."""
    examples = hand_examples()
    features = squad_features.convert(tokenizer, examples, max_seq_length=64, doc_stride=16,
                                      max_query_length=8, training=True)
    first = features.input_ids[0, features.doc_offset[0]]
    assert not tokenizer.convert_ids_to_tokens([first])[0].startswith("\u0120")
    assert features.start_positions[0] == features.doc_offset[0]
    for e in range(len(examples)):
        spans = features.contexts[features.context_index[e]]
        assert np.all(np.diff(spans[:, 0]) >= 0) and np.all(np.diff(spans[:, 1]) >= 0)
    # A lone "Ġ" piece (before "Par" / "北"...) is never an answer's first token.
    for w in range(len(features)):
        s = features.start_positions[w]
        if s:
            token = tokenizer.convert_ids_to_tokens([features.input_ids[w, s]])[0]
            assert token != "\u0120", examples[features.example_index[w]].qas_id


@pytest.mark.parametrize("impossible_rate", [0.0, 0.3])
def test_generated_answers_come_back_over_windows(tokenizer, impossible_rate):
    examples = generated_examples(80, seed=3, impossible_rate=impossible_rate)
    features = squad_features.convert(tokenizer, examples, max_seq_length=40, doc_stride=9,
                                      max_query_length=10, training=True)
    assert len(features) > 2 * len(examples)
    check_answers(tokenizer, features)
    assert any(ex.answers and ex.answers[0][1] == 0 for ex in examples)  # at the very start


def test_answer_inside_a_piece_gets_the_covering_pieces(tokenizer):
    """An answer that starts or ends inside a token is read as the whole tokens covering it
    (as the reference's offsets do); SQuAD's F1 then counts the overlap."""
    ex = example("in", "Tom went to Paris in 1905.", "ari")
    features = squad_features.convert(tokenizer, [ex], max_seq_length=32, doc_stride=8,
                                      max_query_length=8, training=True)
    got = recovered(features, 0)
    assert "ari" in got and got in "Paris"


def test_two_workers_give_the_same_features(tokenizer, monkeypatch):
    monkeypatch.setattr(squad_features, "PARALLEL_MIN_EXAMPLES", 0)
    examples = [e for e in generated_examples(60, seed=5, impossible_rate=0.2) + hand_examples()
                for _ in range(2)]
    kwargs = dict(max_seq_length=40, doc_stride=9, max_query_length=8, training=True)
    assert squad_features._worker_tokenizer(tokenizer)[0] == "pickle"  # sent, not skipped
    serial = squad_features.convert(tokenizer, examples, **kwargs)
    parallel = squad_features.convert(tokenizer, examples, num_workers=2, **kwargs)
    for field in FIELDS:
        np.testing.assert_array_equal(getattr(parallel, field), getattr(serial, field), field)
    assert len(parallel.contexts) == len(serial.contexts)
    assert all(np.array_equal(a, b) for a, b in zip(parallel.contexts, serial.contexts))
    check_answers(tokenizer, parallel)


@pytest.mark.parametrize("seq,stride", [(64, 16), (40, 6)])
def test_windows_are_transformers_overflowing_windows(tokenizer, tmp_path, seq, stride):
    """transformers' fast tokenizer on (question, context) with truncation="only_second" and
    overflowing windows (its stride = overlap = window - doc_stride) gives the same windows:
    ids, segment ids, and the offsets (without the space a "Ġ" piece carries)."""
    import transformers

    path = modern_checkpoint.write_bpe_tokenizer_json(tmp_path / "tokenizer.json")
    hf = transformers.PreTrainedTokenizerFast(tokenizer_file=path)
    examples = hand_examples() + generated_examples(30, seed=7)
    max_query = 20
    features = squad_features.convert(tokenizer, examples, max_seq_length=seq,
                                      doc_stride=stride, max_query_length=max_query,
                                      training=True)
    compared = 0
    for e, ex in enumerate(examples):
        q_len = len(tokenizer.tokenize(ex.question))
        assert q_len <= max_query  # comparable: transformers does not cut the question
        window = seq - q_len - 3
        enc = hf(ex.question, ex.context, truncation="only_second", max_length=seq,
                 stride=window - stride, return_overflowing_tokens=True,
                 return_offsets_mapping=True, return_token_type_ids=True)
        ours = np.flatnonzero(features.example_index == e)
        assert len(enc["input_ids"]) == len(ours), ex.qas_id
        for k, w in enumerate(ours):
            n = int(features.input_mask[w].sum())
            assert features.input_ids[w, :n].tolist() == enc["input_ids"][k]
            assert features.segment_ids[w, :n].tolist() == enc["token_type_ids"][k]
            spans = features.token_spans(w)[:n]
            sequence_ids = enc.sequence_ids(k)
            for p, (b, t) in enumerate(enc["offset_mapping"][k]):
                if sequence_ids[p] != 1:
                    assert spans[p, 0] == -1
                    continue
                while b < t and ex.context[b].isspace():
                    b += 1
                assert (spans[p, 0], spans[p, 1]) == (b, t), (ex.qas_id, p)
            compared += 1
    assert compared > len(examples)


@pytest.mark.slow
def test_squad_with_a_bpe_modernbert_learns(tmp_path):
    """A tiny random ModernBERT whose checkpoint carries the tokenizer.json, fine-tuned a few
    epochs on squad_data's generated SQuAD v2.0 set: the loss falls, and the export is
    transformers' ModernBertForQuestionAnswering with the chosen null threshold (v1.1 runs on
    the WordPiece vocabulary in tests/tasks/test_modern_finetuning.py)."""
    import json

    import squad_data
    from finetune_task import train_losses

    from bertjax.tasks import train_and_evaluate
    from bertjax.tokenization.bpe import TokenizersTokenizer
    from experiments.squad import get_config

    checkpoint = modern_checkpoint.write_modern_bpe_checkpoint(tmp_path)
    config = get_config("v2")
    config.init_checkpoint = checkpoint
    rate = 0.3
    config.data.train = squad_data.generate(tmp_path / "train.json", 200, seed=1,
                                            impossible_rate=rate)
    config.data.validation = squad_data.generate(tmp_path / "dev.json", 40, seed=2,
                                                 impossible_rate=rate)
    config.max_seq_length = 64
    config.task.doc_stride, config.task.max_query_length = 16, 12
    config.train.batch_size, config.eval.batch_size, config.train.num_epochs = 32, 32, 3
    config.optimizer.learning_rate = 1e-3
    config.log_every_steps = 1
    seen = []
    original = squad_features.convert

    def spy(tokenizer, *args, **kwargs):
        seen.append(tokenizer)
        return original(tokenizer, *args, **kwargs)

    squad_features.convert = spy
    try:
        summary = train_and_evaluate(config, str(tmp_path / "run"), log=lambda *_: None)
    finally:
        squad_features.convert = original
    assert seen and all(isinstance(t, TokenizersTokenizer) for t in seen)
    losses = train_losses(str(tmp_path / "run"))
    ordered = [losses[s] for s in sorted(losses)]
    assert np.mean(ordered[-3:]) < np.mean(ordered[:3]), ordered
    assert (tmp_path / "run" / "predictions.json").exists()
    assert summary["primary_metric"] == "best_f1"
    assert (tmp_path / "run" / "null_odds.json").exists()
    record = json.loads((tmp_path / "run" / "export.json").read_text())
    assert record["architecture"] == "ModernBertForQuestionAnswering"
    assert "null_score_diff_threshold" in record["extra_config"]
