"""SQuAD: readers, window features (round trip through the offsets, stride, max context),
post-processing against a brute force over all (start, end) pairs, text recovery from the
original characters, the official EM/F1 and v2.0 threshold on hand-computed fixtures, the
head/loss, and bad input as one line each."""

import itertools
import json
import random

import numpy as np
import pytest

from bertjax.errors import ConfigError, DataError
from bertjax.tasks.squad import features as squad_features
from bertjax.tasks.squad import metrics as sm
from bertjax.tasks.squad import readers
from bertjax.tasks.squad.postprocess import final_predictions, postprocess
from bertjax.tasks.squad.task import span_loss
from bertjax.tokenization import WordPieceTokenizer

WORDS = [f"w{i}" for i in range(60)]
VOCAB = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *WORDS, "##x", "cafe", "don", "'", "t",
         ".", ",", "(", ")", "-", "!", "北", "京", "大", "学", "naive", "zu", "##rich"]


@pytest.fixture(scope="module")
def tokenizer():
    return WordPieceTokenizer(VOCAB, do_lower_case=True)


def generated_examples(n=40, seed=0):
    """Long contexts of w-words (some split into two pieces "wN" "##x"); answers are runs of
    whole words; questions of 2-12 tokens (some over max_query_length)."""
    rng = random.Random(seed)
    examples = []
    for q in range(n):
        words = [rng.choice(WORDS) + ("x" if rng.random() < 0.2 else "")
                 for _ in range(rng.randint(5, 120))]
        seps = [rng.choice([" ", " ", "  ", "\n"]) for _ in words]
        context = "".join(w + s for w, s in zip(words, seps)).rstrip()
        first = rng.randrange(len(words))
        last = min(len(words) - 1, first + rng.randint(0, 4))
        start = sum(len(w) + len(s) for w, s in zip(words[:first], seps[:first]))
        end = sum(len(w) + len(s) for w, s in zip(words[:last + 1], seps[:last + 1])) - len(
            seps[last])
        question = " ".join(rng.choice(WORDS) for _ in range(rng.randint(2, 12)))
        examples.append(readers.SquadExample(f"q{q}", question, context,
                                           [(context[start:end], start)]))
    return examples


def brute_force_max_context(starts, lengths, num_tokens):
    """The reference's _check_is_max_context, token by token."""
    best = []
    for p in range(num_tokens):
        scores = []
        for w, (s, n) in enumerate(zip(starts, lengths)):
            if s <= p < s + n:
                scores.append((min(p - s, s + n - 1 - p) + 0.01 * n, -w))
        best.append(-max(scores)[1])
    return best


def test_feature_round_trip_stride_and_max_context(tokenizer):
    examples = generated_examples()
    seq, stride, max_query = 32, 7, 6
    features = squad_features.convert(tokenizer, examples, max_seq_length=seq, doc_stride=stride,
                             max_query_length=max_query, training=True)
    assert features.input_ids.shape == (len(features), seq)
    for e, example in enumerate(examples):
        windows = np.flatnonzero(features.example_index == e)
        q_len = min(len(tokenizer.tokenize(example.question)), max_query)
        spans = features.contexts[features.context_index[e]]
        n_tokens = len(spans)
        window = seq - q_len - 3
        starts = features.doc_start[windows]
        lengths = features.doc_length[windows]
        # Stride: starts 0, s, 2s, ... until a window reaches the end; contiguous coverage.
        assert list(starts) == [stride * k for k in range(len(windows))]
        assert starts[-1] + lengths[-1] == n_tokens
        assert all(n == min(window, n_tokens - s) for s, n in zip(starts, lengths))
        if len(windows) > 1:
            assert starts[-2] + lengths[-2] < n_tokens
        owner = brute_force_max_context(starts, lengths, n_tokens)
        text, start_char = example.answers[0]
        covered = [p for p in range(n_tokens) if spans[p][1] > start_char
                   and spans[p][0] < start_char + len(text)]
        for k, w in enumerate(windows):
            ids = features.input_ids[w]
            assert ids[0] == tokenizer.cls_id and ids[q_len + 1] == tokenizer.sep_id
            assert features.doc_offset[w] == q_len + 2
            assert ids[q_len + 2 + lengths[k]] == tokenizer.sep_id
            assert features.segment_ids[w, q_len + 2:q_len + 3 + lengths[k]].all()
            assert not features.segment_ids[w, :q_len + 2].any()
            flags = features.max_context[w, q_len + 2:q_len + 2 + lengths[k]]
            assert list(flags) == [owner[starts[k] + i] == k for i in range(lengths[k])]
            assert not features.max_context[w, :q_len + 2].any()
            s, t = features.start_positions[w], features.end_positions[w]
            inside = covered[0] >= starts[k] and covered[-1] < starts[k] + lengths[k]
            if inside:  # the token span gives back exactly the answer's characters
                token_spans = features.token_spans(w)
                assert example.context[token_spans[s][0]:token_spans[t][1]] == text
                assert token_spans[s][0] == start_char
            else:
                assert s == t == 0
    # Every answer is learnable from at least one window; some windows point at [CLS].
    assert len(set(features.example_index[features.start_positions > 0])) == len(examples)
    assert (features.start_positions == 0).any()


def test_window_starts_reference_loop():
    for n, window, stride in itertools.product(range(0, 40), (1, 5, 9), (1, 3, 5)):
        if stride > window:
            continue
        starts, s = [], 0
        while True:  # run_squad.py's loop
            starts.append(s)
            if s + min(n - s, window) >= n:
                break
            s += min(min(n - s, window), stride)
        assert list(squad_features.window_starts(n, window, stride)) == starts, (n, window, stride)


def brute_force_nbest(features, start, end, e, n_best, max_len, version_2):
    """All (window, start, end) pairs by plain loops; best distinct texts."""
    example = features.examples[e]
    candidates, null = [], None
    for w in np.flatnonzero(features.example_index == e):
        spans = features.token_spans(w)
        for i in range(start.shape[1]):
            for j in range(i, min(i + max_len, start.shape[1])):
                if spans[i][0] < 0 or spans[j][0] < 0 or not features.max_context[w, i]:
                    continue
                text = example.context[spans[i][0]:spans[j][1]]
                candidates.append((start[w, i] + end[w, j], text))
        score = start[w, 0] + end[w, 0]
        null = score if null is None else min(null, score)
    candidates.sort(key=lambda c: -c[0])
    out, seen = [], set()
    for score, text in candidates:
        if text not in seen:
            seen.add(text)
            out.append((score, text))
    out = out[:n_best]
    if version_2:
        with_null = sorted(out + [(null, "")], key=lambda c: -c[0])[:n_best]
        if all(t for _, t in with_null):
            with_null.append((null, ""))
        return out, null, with_null
    return out, null, out


@pytest.mark.parametrize("version_2", [False, True])
def test_postprocess_equals_brute_force(tokenizer, version_2):
    examples = generated_examples(12, seed=3)
    # Repeated words make equal texts at different places: n-best keeps distinct texts.
    examples.append(readers.SquadExample("rep", "w1", "w1 w2 w1 w2 w1 w2 w1 w2",
                                       [("w2", 3)]))
    features = squad_features.convert(tokenizer, examples, max_seq_length=24, doc_stride=5,
                             max_query_length=4, training=True)
    rng = np.random.default_rng(0)
    start = rng.normal(size=features.input_ids.shape)
    end = rng.normal(size=features.input_ids.shape)
    n_best, max_len = 7, 4
    answers = postprocess(features, start, end, n_best_size=n_best, max_answer_length=max_len,
                          version_2=version_2)
    for e, example in enumerate(examples):
        non_null, null, nbest = brute_force_nbest(features, start, end, e, n_best, max_len,
                                                  version_2)
        got = answers[example.qas_id]
        assert [x["text"] for x in got.nbest] == [t for _, t in nbest]
        scores = [x["start_logit"] + x["end_logit"] for x in got.nbest]
        np.testing.assert_allclose(scores, [s for s, _ in nbest], rtol=1e-12)
        assert got.best_text == non_null[0][1]
        np.testing.assert_allclose(got.null_score, null)
        np.testing.assert_allclose(sum(x["probability"] for x in got.nbest), 1.0)


def test_text_recovery_keeps_original_characters(tokenizer):
    # Accents (stripped by the tokenizer), an apostrophe, CJK, extra and odd whitespace,
    # punctuation glued to words: the answer comes back as the context spells it.
    context = "Le  Café\u00a0 (don't)  北京大学 visited   ZüRich!  naïve,w1-w2."
    cases = ["Café", "(don't)", "don't", "北京大学", "京大", "ZüRich", "naïve,w1-w2",
             "Café\u00a0 (don't)  北京", "visited   ZüRich!"]
    examples = [readers.SquadExample(f"t{i}", "w1", context, [(a, context.index(a))])
                for i, a in enumerate(cases)]
    features = squad_features.convert(tokenizer, examples, max_seq_length=64, doc_stride=16,
                             max_query_length=4, training=True)
    start = np.zeros(features.input_ids.shape)
    end = np.zeros(features.input_ids.shape)
    for w in range(len(features)):
        start[w, features.start_positions[w]] = end[w, features.end_positions[w]] = 10.0
    answers = postprocess(features, start, end)
    assert [answers[f"t{i}"].best_text for i in range(len(cases))] == cases


# ---------------------------------------------------------------------------------------------
# Official metrics, by hand


def test_normalisation_and_scores_by_hand():
    assert sm.normalize_answer("The  Cat's, an Apple!") == "cats apple"
    assert sm.normalize_answer("theatre") == "theatre"  # articles only as whole words
    assert sm.exact_match("the Eiffel tower.", "Eiffel Tower") == 1.0
    # pred "in the city of paris" → [in, city, of, paris]; gold "paris city" → [paris, city]
    # common 2: precision 2/4, recall 2/2, F1 = 2·0.5·1/1.5 = 2/3
    assert sm.f1_score("in the city of paris", "paris city") == pytest.approx(2 / 3)
    assert sm.f1_score("x b b", "b b c") == pytest.approx(2 / 3)  # counted with multiplicity
    assert sm.f1_score("a b b", "b b c") == pytest.approx(0.8)  # "a" is an article: p 1, r 2/3
    assert sm.f1_score("", "") == 1.0 and sm.f1_score("x", "") == 0.0
    assert sm.f1_score("the", "a") == 1.0  # both normalise to empty


def test_v1_metrics_max_over_golds_by_hand():
    golds = {"a": ["Denver Broncos", "The Broncos"], "b": ["1905"], "c": ["blue whale"]}
    preds = {"a": "broncos", "b": "in 1905", "c": "whale shark"}
    # a: EM 0, F1 max(2·0.5·1/1.5, 1) = 1 ("broncos" vs "broncos"): EM with "The Broncos" = 1
    # b: EM 0, F1 = 2·(1/2)·1/(1.5) = 2/3; c: EM 0, F1 = 0.5
    result = sm.evaluate(preds, golds)
    assert result["exact_match"] == pytest.approx(100 / 3)
    assert result["f1"] == pytest.approx(100 * (1 + 2 / 3 + 0.5) / 3)
    assert sm.evaluate({}, golds) == {"exact_match": 0.0, "f1": 0.0}


def test_v2_metrics_and_threshold_by_hand():
    golds = {"h1": ["Paris"], "h2": ["red fox"], "n1": [], "n2": []}
    non_null = {"h1": "Paris", "h2": "fox", "n1": "blue", "n2": "green"}
    # null_odds ascending: h1 (-3), n1 (-1), h2 (0.5), n2 (2)
    odds = {"h1": -3.0, "n1": -1.0, "h2": 0.5, "n2": 2.0}
    # threshold 0: h1, n1 answered; h2, n2 null → EM: h1 1, n1 0, h2 0, n2 1 → 50
    preds = final_predictions(
        {q: type("A", (), {"null_odds": odds[q], "best_text": non_null[q]})()
         for q in golds}, True, 0.0)
    assert preds == {"h1": "Paris", "h2": "", "n1": "blue", "n2": ""}
    result = sm.evaluate(preds, golds, True, non_null, odds)
    assert result["exact"] == pytest.approx(50.0) and result["f1"] == pytest.approx(50.0)
    assert result["HasAns_exact"] == pytest.approx(50.0)
    assert result["NoAns_exact"] == pytest.approx(50.0)
    # The search: all null = 2 (n1, n2); +h1 (1) = 3 at -3; +n1 (-1) = 2; +h2: EM 0 → 2,
    # F1 of "fox" vs "red fox" = 2/3 → 2.667 (< 3); +n2 (-1). Best: 3/4 at threshold -3.
    assert result["best_exact"] == pytest.approx(75.0)
    assert result["best_exact_thresh"] == -3.0
    assert result["best_f1"] == pytest.approx(75.0)
    assert result["best_f1_thresh"] == -3.0
    # Make h2's answer right: +h2 = 1 → 3 at 0.5 does not beat 3 (strictly greater needed)...
    non_null["h2"] = "red fox"
    result = sm.evaluate(preds, golds, True, non_null, odds)
    assert result["best_f1"] == pytest.approx(75.0) and result["best_f1_thresh"] == -3.0
    # ... but without n1's wrong answer in between it does: 4/4 at 0.5.
    odds["n1"] = 1.0
    result = sm.evaluate(preds, golds, True, non_null, odds)
    assert result["best_f1"] == pytest.approx(100.0) and result["best_f1_thresh"] == 0.5
    # No has-answer questions at all: nothing beats all-null, threshold stays 0.
    assert sm.best_threshold({"n": "x"}, {"n": 0.0}, {"n": -5.0}, {"n": False}) == (100.0, 0.0)


def test_span_loss_is_mean_of_two_cross_entropies():
    rng = np.random.default_rng(0)
    start, end = rng.normal(size=(3, 6)), rng.normal(size=(3, 6))
    pos_s, pos_e = np.array([0, 2, 5]), np.array([1, 2, 5])
    weights = np.array([1.0, 1.0, 0.0])

    def ce(logits, p):
        return -(logits[p] - np.log(np.exp(logits).sum()))

    want = np.mean([(ce(start[r], pos_s[r]) + ce(end[r], pos_e[r])) / 2 for r in range(2)])
    loss, metrics = span_loss(start, end, pos_s, pos_e, weights)
    np.testing.assert_allclose(float(loss), want, rtol=1e-5)
    assert float(metrics["loss"]) == float(loss)


# ---------------------------------------------------------------------------------------------
# Readers and bad input


def squad_json(qas, context="Tom went to Paris in 1905."):
    return {"version": "1.1", "data": [{"title": "t", "paragraphs": [
        {"context": context, "qas": qas}]}]}


def test_reader_v1_and_v2(tmp_path):
    path = tmp_path / "dev.json"
    path.write_text(json.dumps(squad_json([
        {"id": "a", "question": "Where?", "answers": [
            {"text": "Paris", "answer_start": 12}, {"text": "Paris in 1905", "answer_start": 12}]},
        {"id": "b", "question": "Who flew?", "answers": [], "is_impossible": True,
         "plausible_answers": [{"text": "Tom", "answer_start": 0}]},
    ])))
    a, b = readers.read_squad_json(str(path))
    assert a.answers == [("Paris", 12), ("Paris in 1905", 12)] and not a.is_impossible
    assert b.is_impossible and b.answers == [] and a.title == "t"


@pytest.mark.parametrize("content, message", [
    (None, "no such file"),
    ("{not json", "not valid JSON"),
    (squad_json([{"id": "q7", "question": "x", "answers": [
        {"text": "Paris", "answer_start": 3}]}]),
     "question q7: answer 'Paris' does not match the context at answer_start=3"),
    (squad_json([{"id": "q8", "answers": []}]), "question q8: missing field 'question'"),
    (squad_json([{"id": "q9", "question": "x", "answers": []}]),
     "question q9: no answers and is_impossible is not true"),
    (squad_json([{"id": "d", "question": "x", "answers": [{"text": "Tom", "answer_start": 0}]},
                 {"id": "d", "question": "y", "answers": [{"text": "Tom", "answer_start": 0}]}]),
     "question d: id used more than once"),
    ({"version": "x"}, "missing field 'data'"),
])
def test_bad_files_one_line(tmp_path, content, message):
    path = tmp_path / "bad.json"
    if content is not None:
        path.write_text(content if isinstance(content, str) else json.dumps(content))
    with pytest.raises(DataError) as info:
        readers.read_squad_json(str(path))
    text = str(info.value)
    assert "\n" not in text and message in text and str(path) in text


def test_window_limits_are_config_errors(tokenizer):
    example = generated_examples(1)
    with pytest.raises(ConfigError, match="leaves no room for the context"):
        squad_features.convert(tokenizer, example, max_seq_length=66, max_query_length=64)
    with pytest.raises(ConfigError, match="doc_stride=128 must be in"):
        squad_features.convert(tokenizer, example, max_seq_length=128, doc_stride=128,
                      max_query_length=64)


def test_parallel_conversion_equals_serial(tokenizer, monkeypatch):
    monkeypatch.setattr(squad_features, "PARALLEL_MIN_EXAMPLES", 0)
    examples = [e for e in generated_examples(100, seed=5) for _ in range(3)]
    kwargs = dict(max_seq_length=40, doc_stride=9, max_query_length=8, training=True)
    serial = squad_features.convert(tokenizer, examples, **kwargs)
    parallel = squad_features.convert(tokenizer, examples, num_workers=2, **kwargs)
    for field in ("input_ids", "segment_ids", "input_mask", "start_positions", "end_positions",
                  "example_index", "doc_start", "doc_offset", "doc_length", "max_context",
                  "context_index"):
        np.testing.assert_array_equal(getattr(parallel, field), getattr(serial, field), field)
    assert all(np.array_equal(a, b) for a, b in zip(parallel.contexts, serial.contexts))
