"""SentencePiece (unigram and BPE) trained here, used through the same Tokenizer interface.

Reference: the sentencepiece library's own `encode` on the same model (ids and surfaces)."""

from __future__ import annotations

import pytest
import sentencepiece as spm
from tokenization_corpus import make_corpus

from bertjax.tokenization import SPECIAL_TOKENS, VocabError, load_tokenizer
from bertjax.tokenization.sentencepiece_tokenizer import SentencePieceTokenizer
from bertjax.tokenization.train import train_sentencepiece


@pytest.fixture(scope="module")
def corpus():
    return make_corpus(1500, seed=5)


@pytest.fixture(scope="module", params=[("unigram", False), ("bpe", True)],
                ids=["unigram-cased", "bpe-uncased"])
def setup(request, corpus):
    model_type, lower = request.param
    proto = train_sentencepiece(corpus[:1000], 800, model_type, lowercase=lower)
    sp = spm.SentencePieceProcessor()
    sp.LoadFromSerializedProto(proto)
    return SentencePieceTokenizer(proto, lower), sp


def _plain(line: str) -> bool:
    """Printable ASCII with single spaces: SentencePiece's normalisation leaves it unchanged."""
    return line.isascii() and line.isprintable() and "  " not in line and "[" not in line \
        and line == line.strip()


def test_special_tokens_have_the_bert_names(setup):
    tok, _ = setup
    names = tok.convert_ids_to_tokens([tok.pad_id, tok.unk_id, tok.cls_id, tok.sep_id,
                                       tok.mask_id])
    assert names == list(SPECIAL_TOKENS)
    assert tok.special_ids == frozenset(range(5)) and tok.vocab_size <= 800


def test_ids_match_sentencepiece_itself(setup, corpus):
    tok, sp = setup
    for line in corpus:
        if "[" in line:
            continue
        want = sp.encode(line.lower() if tok.do_lower_case else line)
        assert tok.encode(line).input_ids[1:-1] == want, repr(line)
    batch = [line for line in corpus if "[" not in line]
    assert tok.tokenize_batch(batch) == [tok.tokenize(t) for t in batch]


def test_offsets_and_word_ids(setup, corpus):
    tok, _ = setup
    checked = 0
    for line in corpus:
        enc = tok.encode(line)
        for i, (t, o) in enumerate(zip(enc.tokens, enc.offsets)):
            if o is None:
                continue
            if i > 1 and enc.word_ids[i - 1] is not None:
                step = enc.word_ids[i] - enc.word_ids[i - 1]
                assert step == (0 if tok.is_continuation(t) else 1), (line, t)
            if _plain(line) and tok.vocab[t] != tok.unk_id:
                span = line[o[0]:o[1]]
                assert (span.lower() if tok.do_lower_case else span) == t.lstrip("\u2581")
                checked += 1
    assert checked > 1000


def test_decode_round_trips_plain_text(setup, corpus):
    tok, _ = setup
    checked = 0
    for line in corpus:
        ids = tok.encode(line, max_seq_length=512).input_ids
        if not _plain(line) or tok.unk_id in ids:
            continue
        assert tok.decode(ids, skip_special_tokens=True) == \
            (line.lower() if tok.do_lower_case else line)
        checked += 1
    assert checked > 100


def test_literal_special_tokens_and_pair_layout(setup):
    tok, _ = setup
    enc = tok.encode("the [MASK] sat", "on [SEP] mat", max_seq_length=24)
    assert enc.input_ids.count(tok.mask_id) == 1 and enc.input_ids.count(tok.sep_id) == 3
    n, k = sum(enc.input_mask), enc.tokens.index("[SEP]")
    assert enc.tokens[0] == "[CLS]" and enc.tokens[n - 1] == "[SEP]"
    assert enc.segment_ids == [0] * (k + 1) + [1] * (n - k - 1) + [0] * (24 - n)
    assert enc.sequence_ids[1:k] == [0] * (k - 1) and enc.sequence_ids[k + 1:n - 1] == \
        [1] * (n - k - 2)
    assert enc.input_ids[n:] == [tok.pad_id] * (24 - n)
    assert not tok.is_continuation("[MASK]")


def test_save_and_load_through_load_tokenizer(setup, tmp_path, corpus):
    tok, _ = setup
    path = tok.save(str(tmp_path))
    for target in (str(tmp_path), path):
        again = load_tokenizer(target)
        assert again.do_lower_case == tok.do_lower_case
        assert again.tokenize_batch(corpus[:200]) == tok.tokenize_batch(corpus[:200])


def test_bad_models_name_the_file(tmp_path):
    garbage = tmp_path / "bad.model"
    garbage.write_bytes(b"not a model")
    with pytest.raises(VocabError, match="not a SentencePiece model") as err:
        load_tokenizer(str(garbage))
    assert str(garbage) in str(err.value)
    (tmp_path / "empty.model").write_bytes(b"")
    with pytest.raises(VocabError, match="empty"):
        load_tokenizer(str(tmp_path / "empty.model"))
    # A model without the BERT special pieces.
    import io

    model = io.BytesIO()
    ascii_lines = [line for line in make_corpus(500) if line.isascii()]
    spm.SentencePieceTrainer.train(sentence_iterator=iter(ascii_lines), model_writer=model,
                                   vocab_size=150, hard_vocab_limit=False, minloglevel=2)
    plain = tmp_path / "plain.model"
    plain.write_bytes(model.getvalue())
    with pytest.raises(VocabError, match=r"lacks piece\(s\) \[CLS\] \[SEP\] \[MASK\]"):
        load_tokenizer(str(plain))
