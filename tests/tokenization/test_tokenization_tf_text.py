"""The tensorflow-text backend of the WordPiece fast path: its routing and its exactness.

Large batches send `tf_text_backend.is_safe` texts (ASCII, no control characters, no "[") to
`str.lower()` + tensorflow-text's FastWordpieceTokenizer and everything else to the Python path.
Asserted here: on safe texts, including adversarial ASCII, the backend's ids, offsets and word
ids equal the exact path's; on the hard corpus, routed batch output equals the exact path on
every line; inputs where tensorflow-text differs are not safe.
"""

from __future__ import annotations

import random
import string
import sys

import pytest

pytest.importorskip("tensorflow_text")

from tokenization_corpus import make_corpus, prose_lines  # noqa: E402

from bertjax.tokenization import WordPieceTokenizer, tf_text_backend  # noqa: E402
from bertjax.tokenization.train import train_wordpiece  # noqa: E402

# Non-ASCII input on which tensorflow-text differs from the reference (uncased): the backend
# does no accent stripping; FastBertTokenizer's own normaliser gets final sigma, the Armenian
# ligature "և" and vulgar fractions wrong (issue 3).
DIVERGENT = ["Café NAÏVE", "ΟΔΟΣ ΣΑΣ", "Բարեւ և", "½ ¾ ⅓"]


def adversarial_ascii(n_lines: int = 3000, seed: int = 1) -> list[str]:
    """Safe ASCII lines: prose, every printable character in context, odd whitespace, words of
    99-102 characters (the [UNK] length limit) with and without punctuation, odd casing."""
    r = random.Random(seed)
    prose = [s for s in prose_lines() if tf_text_backend.is_safe(s)]
    printable = string.ascii_letters + string.digits + string.punctuation.replace("[", "")
    lines = [f"a{c}b {c}{c}x {c} X{c}" for c in printable]
    lines += [f"w {'ab' * 50}{'c' * k}, {'Q' * (99 + k)}" for k in range(4)]
    for _ in range(n_lines):
        words = r.choice(prose).replace("[", "(").split(" ")
        for _ in range(r.randrange(0, 4)):
            kind = r.random()
            if kind < 0.3:
                insert = "".join(r.choice(printable) for _ in range(r.randrange(1, 12)))
            elif kind < 0.5:
                n = r.choice([99, 100, 101, 102])
                pool = "abcdeXYZ" if r.random() < 0.5 else printable
                insert = "".join(r.choice(pool) for _ in range(n))
            elif kind < 0.7:
                insert = r.choice(["\t", "\n", "\r", "  ", "\r\n", " \t "]).join(
                    [r.choice(words), r.choice(words)])
            elif kind < 0.85:
                insert = "".join(c.upper() if r.random() < 0.5 else c for c in r.choice(words))
            else:
                insert = r.choice(words) + r.choice(string.punctuation.replace("[", ""))
            words.insert(r.randrange(len(words) + 1), insert)
        lines.append(r.choice(["", " ", "\t"]) + " ".join(words) + r.choice(["", " ", "\n"]))
    return lines + ["", " ", "\t\n\r "]


@pytest.fixture(scope="module")
def corpus():
    return make_corpus()


@pytest.fixture(scope="module", params=[True, False], ids=["uncased", "cased"])
def vocab_and_case(request, corpus):
    return train_wordpiece(corpus[:2500], 4000, lowercase=request.param), request.param


def _fresh(vocab_and_case, min_batch):
    vocab, lower = vocab_and_case
    tok = WordPieceTokenizer(vocab, lower)
    tok.tf_text_min_batch = min_batch
    tok.tf_text_after_chars = 0  # no start-up cost to pay first
    return tok


def test_safe_ascii_matches_exact_path(vocab_and_case):
    tok = _fresh(vocab_and_case, 1)
    lines = adversarial_ascii()
    assert all(map(tf_text_backend.is_safe, lines))
    assert any(len(w) == 100 for s in lines for w in s.split())
    assert any(len(w) == 101 for s in lines for w in s.split())
    backend = tf_text_backend.build(tok._inv_vocab, tok.do_lower_case)
    exact = [tok.pieces_exact(s) for s in lines]
    assert backend.tokenize(lines) == [p.ids for p in exact]
    assert backend.tokenize(lines, tok._inv_vocab) == [p.tokens for p in exact]
    for line, got, p in zip(lines, backend.pieces(lines), exact):
        assert (got.tokens, got.ids, got.offsets, got.word_ids) == \
            (p.tokens, p.ids, p.offsets, p.word_ids), repr(line)
    assert sum(p.tokens.count("[UNK]") for p in exact) > 0  # the limit was exercised


def test_routed_batches_equal_exact_path_on_hard_corpus(vocab_and_case, corpus, monkeypatch):
    tok = _fresh(vocab_and_case, 1)
    sent: list[str] = []
    original = tf_text_backend.FastWordpieceBackend.tokenize

    def spy(self, texts, table=None):
        sent.extend(texts)
        return original(self, texts, table)

    monkeypatch.setattr(tf_text_backend.FastWordpieceBackend, "tokenize", spy)
    exact = [tok.pieces_exact(s) for s in corpus]
    assert tok.tokenize_to_ids_batch(corpus) == [p.ids for p in exact]
    assert tok.tokenize_batch(corpus) == [p.tokens for p in exact]
    # Exactly the safe texts went to tensorflow-text, and the corpus has both kinds.
    assert sent == [s for s in corpus if tf_text_backend.is_safe(s)] * 2
    assert 0 < len(sent) // 2 < len(corpus)
    for enc, p in zip(tok.encode_batch(corpus), exact):
        assert (enc.tokens[1:-1], enc.input_ids[1:-1], enc.offsets[1:-1],
                enc.word_ids[1:-1]) == (p.tokens, p.ids, p.offsets, p.word_ids)
    assert tok._tf_text  # the backend really was used


def test_known_divergences_are_routed_away(vocab_and_case):
    tok = _fresh(vocab_and_case, 1)
    for text in DIVERGENT:
        assert not tf_text_backend.is_safe(text)
    if tok.do_lower_case:  # the divergences are real: the routing is needed
        import tensorflow as tf
        import tensorflow_text as tf_text

        backend = tf_text_backend.build(tok._inv_vocab, True)
        assert backend.tokenize(DIVERGENT[:1], tok._inv_vocab) != [tok.tokenize_exact(
            DIVERGENT[0])]
        fast_bert = tf_text.FastBertTokenizer(tok._inv_vocab, token_out_type=tf.int32,
                                              lower_case_nfd_strip_accents=True)
        for text in DIVERGENT[1:]:
            ids = fast_bert.tokenize(tf.constant([text])).to_list()[0]
            assert ids != tok.pieces_exact(text).ids, text
    lines = DIVERGENT + ["plain ascii text."] * 3
    assert tok.tokenize_batch(lines) == [tok.tokenize_exact(s) for s in lines]


@pytest.mark.parametrize("text", [
    "a\x00b", "tab\x0bbed", "x\x1fy", "del\x7f", "[MASK] word", "[not special]", "café",
    "\u00a0nbsp", b"bytes", "ΟΔΟΣ",
])
def test_unsafe_inputs(text):
    assert not tf_text_backend.is_safe(text)


def test_safe_inputs():
    for text in ["Hello, World!\t(x) {y} $5^2 ~a`b|c\\d", "", "\r\n", "x" * 500]:
        assert tf_text_backend.is_safe(text)


def test_small_or_disabled_batches_stay_on_python(vocab_and_case, monkeypatch):
    lines = ["Some plain text, 1.", "more"] * 10
    tok = _fresh(vocab_and_case, 21)
    want = [tok.tokenize_exact(s) for s in lines]
    assert tok.tokenize_batch(lines) == want and tok._tf_text is False  # below the threshold
    tok.tf_text_min_batch = None
    assert tok.tokenize_batch(lines * 100) == want * 100 and tok._tf_text is False
    tok.tf_text_min_batch = 1
    monkeypatch.setenv("BERTJAX_TF_TEXT", "0")
    tf_text_backend.available.cache_clear()
    try:
        assert tok.tokenize_batch(lines) == want and tok._tf_text is False
    finally:
        monkeypatch.delenv("BERTJAX_TF_TEXT")
        tf_text_backend.available.cache_clear()
    assert tf_text_backend.available()


def test_backend_build_failure_falls_back_with_a_warning(vocab_and_case, monkeypatch):
    def broken(*args):
        raise RuntimeError("no kernel")

    monkeypatch.setattr(tf_text_backend, "FastWordpieceBackend", broken)
    tok = _fresh(vocab_and_case, 1)
    lines = ["Plain text.", "Other words here"]
    with pytest.warns(RuntimeWarning, match="no kernel"):
        got = tok.tokenize_to_ids_batch(lines)
    assert got == [tok.pieces_exact(s).ids for s in lines]
    assert tok._tf_text is None and tok.tokenize_batch(lines) == [tok.tokenize_exact(s)
                                                                    for s in lines]


def test_the_backend_starts_once_the_text_pays_for_it(vocab_and_case, monkeypatch):
    """Batches of enough safe texts use tensorflow-text only once the tokenizer's safe
    characters (earlier batches' and the batch's own) reach tf_text_after_chars; by default
    that is what starting it costs, more when TensorFlow is not yet imported."""
    lines = ["Some plain text, 1.", "more"] * 10  # 230 safe characters
    want = [WordPieceTokenizer(*vocab_and_case).tokenize_exact(s) for s in lines]
    tok = _fresh(vocab_and_case, 20)
    tok.tf_text_after_chars = 500
    assert tok.tokenize_batch(lines[:10]) == want[:10] and tok._tf_text is False  # few texts
    assert tok.tokenize_batch(lines) == want and tok._tf_text is False  # 345 characters
    assert tok.tokenize_batch(lines) == want and tok._tf_text  # 575: started
    tok = _fresh(vocab_and_case, 20)
    tok.tf_text_after_chars = None
    for _ in range(3):
        assert tok.tokenize_batch(lines * 40) == want * 40
    assert tok._tf_text is False  # 27,600 characters pay for no start-up
    monkeypatch.setitem(sys.modules, "tensorflow", sys.modules.get("tensorflow"))
    assert tf_text_backend.start_chars() == tf_text_backend.START_CHARS_IMPORTED
    monkeypatch.delitem(sys.modules, "tensorflow")
    assert tf_text_backend.start_chars() == tf_text_backend.START_CHARS
    assert tf_text_backend.START_CHARS > tf_text_backend.START_CHARS_IMPORTED > 27_600
