"""ByteLevel BPE `tokenizer.json` (ModernBERT style) through bertjax's Tokenizer interface.

A small BPE is trained here (`train_bpe`) on generated sentences with non-ASCII words.
Reference: transformers' `PreTrainedTokenizerFast` over the same tokenizer.json with the BERT
`[CLS] $A [SEP] $B:1 [SEP]:1` TemplateProcessing post-processor and 'longest_first'
truncation; and the `tokenizers` library's own pieces and decoder."""

from __future__ import annotations

import json
import random

import pytest
from tokenization_corpus import make_corpus

from bertjax.tokenization import SPECIAL_TOKENS, VocabError, load_tokenizer
from bertjax.tokenization.base import truncate_pair
from bertjax.tokenization.bpe import TokenizersTokenizer, train_bpe, truncate_pair_tokenizers

WORDS = ("the a of model token text word piece naïve café résumé Zoë straße São Paulo Dvořák "
         "Ωmega λόγος Привет мир 北京 日本語 한국어 😀 fine-tuning don't it's (x) 3.14 1,000 "
         "encoder decoder attention layer head vocabulary byte pair").split()
PUNCT = (".", "!", "?", ",", ";", "")


def sentences(n: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        words = rng.choices(WORDS, k=rng.randint(1, 18))
        if rng.random() < 0.3:
            words[0] = words[0].capitalize()
        out.append(" ".join(words) + rng.choice(PUNCT))
    return out


@pytest.fixture(scope="module")
def trained():
    return train_bpe(sentences(400, seed=1), 420)


@pytest.fixture(scope="module")
def tok(trained):
    return TokenizersTokenizer(trained.to_str(), source="<trained>")


@pytest.fixture(scope="module")
def hf(trained):
    transformers = pytest.importorskip("transformers")
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=trained.__class__.from_str(trained.to_str()),
        cls_token="[CLS]", sep_token="[SEP]", mask_token="[MASK]", pad_token="[PAD]",
        unk_token="[UNK]")


@pytest.fixture(scope="module")
def texts():
    """Fresh sentences and the shared corpus's hard lines (odd spaces, controls, literal
    special tokens, emoji, scripts)."""
    return sentences(60, seed=2) + make_corpus(80, seed=7) + ["", " ", "  leading  spaces  "]


def test_special_tokens_and_vocab(tok, trained):
    assert tok.convert_ids_to_tokens([tok.pad_id, tok.unk_id, tok.cls_id, tok.sep_id,
                                      tok.mask_id]) == list(SPECIAL_TOKENS)
    assert tok.vocab == trained.get_vocab(with_added_tokens=True)
    assert tok.vocab_size == trained.get_vocab_size() <= 420
    assert not tok.do_lower_case
    assert "Ġthe" in tok.vocab


def test_pieces_are_the_libraries(tok, trained, texts):
    for text in texts:
        ref = trained.encode(text, add_special_tokens=False)
        assert tok.tokenize(text) == ref.tokens
    assert tok.tokenize_batch(texts) == [trained.encode(t, add_special_tokens=False).tokens
                                         for t in texts]
    assert tok.tokenize_to_ids_batch(texts) == [
        tok.convert_tokens_to_ids(t) for t in tok.tokenize_batch(texts)]


def test_truncation_rule_is_the_libraries():
    """`truncate_pair_tokenizers` against `tokenizers`' own 'longest_first', every small case."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors

    words = {"[UNK]": 0, "[CLS]": 1, "[SEP]": 2, "a": 3, "b": 4}
    ref = Tokenizer(models.WordLevel(words, unk_token="[UNK]"))
    ref.pre_tokenizer = pre_tokenizers.Whitespace()
    ref.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1",
        special_tokens=[("[CLS]", 1), ("[SEP]", 2)])
    google_differs = 0
    for budget in range(10):
        ref.enable_truncation(budget + 3, strategy="longest_first")
        for n_a in range(12):
            for n_b in range(12):
                enc = ref.encode(" ".join("a" * n_a), " ".join("b" * n_b))
                kept = (enc.ids.count(3), enc.ids.count(4))
                assert truncate_pair_tokenizers(n_a, n_b, budget) == kept, (n_a, n_b, budget)
                google_differs += truncate_pair(n_a, n_b, budget) != kept
    assert google_differs > 0  # why the BPE tokenizer does not use base.truncate_pair


@pytest.mark.parametrize("max_len", [None, 3, 5, 8, 9, 17, 64])
def test_pairs_match_transformers(tok, hf, texts, max_len):
    rng = random.Random(max_len or 0)
    firsts = texts[:70]
    # (transformers reads an empty text_pair as no pair: "" is not offered as B)
    seconds = [rng.choice([None, *filter(None, texts)]) for _ in firsts]
    ours = tok.encode_batch(firsts, seconds, max_seq_length=max_len)
    for a, b, enc in zip(firsts, seconds, ours):
        kwargs = {} if max_len is None else dict(truncation="longest_first",
                                                  max_length=max_len, padding="max_length")
        ref = hf(a, b, return_token_type_ids=True, **kwargs)
        assert enc.input_ids == ref["input_ids"], (a, b)
        assert enc.segment_ids == ref["token_type_ids"], (a, b)
        assert enc.input_mask == ref["attention_mask"], (a, b)
        assert tok.encode(a, b, max_seq_length=max_len) == enc
        if max_len is not None:
            assert len(enc) == max_len


def test_offsets_map_back_to_the_text(tok, trained, texts):
    inverse = {c: b for b, c in _bytes_to_unicode().items()}
    for a in texts:
        b = a[::-1]
        enc = tok.encode(a, b)
        for token, span, seq in zip(enc.tokens, enc.offsets, enc.sequence_ids):
            if seq is None:
                assert span is None
                continue
            text = (a, b)[seq]
            start, end = span
            assert 0 <= start <= end <= len(text)
            raw = bytes(inverse[c] for c in token) if token not in SPECIAL_TOKENS else \
                token.encode()
            try:
                piece = raw.decode("utf-8")
            except UnicodeDecodeError:  # part of a multi-byte character: inside its span
                if start == end:  # a whitespace character, trimmed away
                    assert text[start - 1:start + 1].strip() != text[start - 1:start + 1]
                else:
                    assert raw.strip() in text[start:end].encode("utf-8")
                continue
            assert text[start:end] == piece.strip(), (text, token, span)
        starts = [s[0] for s, q in zip(enc.offsets, enc.sequence_ids) if q == 0]
        assert starts == sorted(starts)


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte → printable character table (what ByteLevel pieces are spelt in)."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
            *range(ord("®"), ord("ÿ") + 1)]
    table, extra = {}, 0
    for byte in range(256):
        if byte in keep:
            table[byte] = chr(byte)
        else:
            table[byte] = chr(256 + extra)
            extra += 1
    return table


def test_word_ids_and_continuation(tok, trained):
    text = "Hello wörld, naïve tokenization"
    enc = tok.encode(text)
    ref = trained.encode(text, add_special_tokens=False).word_ids
    ours = enc.word_ids[1:-1]
    assert [ours[i] == ours[i - 1] for i in range(1, len(ours))] == \
        [ref[i] == ref[i - 1] for i in range(1, len(ref))]
    assert ours[0] == 0 and enc.word_ids[0] is None
    for token in enc.tokens[1:-1]:
        assert tok.is_continuation(token) == (not token.startswith("Ġ"))
    for name in SPECIAL_TOKENS:
        assert not tok.is_continuation(name)
    # Every piece after a word-start piece within one word continues it.
    for i in range(2, len(enc) - 1):
        if enc.word_ids[i] == enc.word_ids[i - 1]:
            assert tok.is_continuation(enc.tokens[i])


def test_decode_round_trips(tok, texts):
    for text in texts:
        if any(s in text for s in SPECIAL_TOKENS):
            continue
        ids = tok.encode(text, max_seq_length=len(text) * 4 + 8).input_ids
        assert tok.decode(ids, skip_special_tokens=True) == text
    ids = tok.encode("a b", "c", max_seq_length=10).input_ids
    assert tok.decode(ids) == "[CLS]a b[SEP]c[SEP]"
    with pytest.raises(ValueError, match="outside the vocabulary"):
        tok.decode([tok.vocab_size])


def test_save_load_and_directory_dispatch(tok, texts, tmp_path):
    path = tok.save(str(tmp_path / "bpe"))
    assert path.endswith("tokenizer.json")
    for loaded in (load_tokenizer(path), load_tokenizer(str(tmp_path / "bpe"))):
        assert isinstance(loaded, TokenizersTokenizer)
        assert loaded.vocab == tok.vocab
        assert loaded.encode_batch(texts, texts[::-1], max_seq_length=24) == \
            tok.encode_batch(texts, texts[::-1], max_seq_length=24)
    # A directory with a vocab.txt too stays WordPiece (today's behaviour).
    (tmp_path / "bpe" / "vocab.txt").write_text("\n".join([*SPECIAL_TOKENS, "a", "##b"]) + "\n")
    assert type(load_tokenizer(str(tmp_path / "bpe"))).__name__ == "WordPieceTokenizer"


def test_lowercasing_follows_the_normalizer(tmp_path):
    trained = train_bpe(sentences(200, seed=3), 330, lowercase=True)
    path = str(tmp_path / "tokenizer.json")
    trained.save(path)
    tok = load_tokenizer(path)
    assert tok.do_lower_case
    assert load_tokenizer(path, do_lower_case=True).do_lower_case
    assert tok.tokenize("Café NAÏVE") == tok.tokenize("café naïve")
    text = "Straße CAFÉ Zoë"
    enc = tok.encode(text)
    for (start, end), i in zip(enc.offsets[1:-1], enc.input_ids[1:-1]):
        piece = tok.decode([i])
        if "\ufffd" not in piece:  # a whole character or more: the lowered original
            assert text[start:end].lower() == piece.strip()
    with pytest.raises(VocabError) as err:
        load_tokenizer(path, do_lower_case=False)
    assert "do_lower_case=False" in str(err.value) and "\n" not in str(err.value)


def test_missing_special_token_is_one_line(trained, tmp_path):
    spec = json.loads(trained.to_str())
    for added in spec["added_tokens"]:
        if added["content"] == "[MASK]":
            added["content"] = "[MSK]"
    vocab = spec["model"]["vocab"]
    vocab["[MSK]"] = vocab.pop("[MASK]")
    path = tmp_path / "tokenizer.json"
    path.write_text(json.dumps(spec))
    with pytest.raises(VocabError) as err:
        load_tokenizer(str(tmp_path))
    message = str(err.value)
    assert str(path) in message and "[MASK]" in message and "\n" not in message
    path.write_text("{not json")
    with pytest.raises(VocabError, match="not a tokenizers tokenizer.json"):
        load_tokenizer(str(path))


def test_roberta_names_are_accepted(trained):
    spec = json.loads(trained.to_str())
    renames = dict(zip(SPECIAL_TOKENS, ("<pad>", "<unk>", "<s>", "</s>", "<mask>")))
    for added in spec["added_tokens"]:
        added["content"] = renames.get(added["content"], added["content"])
    vocab = spec["model"]["vocab"]
    for old, new in renames.items():
        vocab[new] = vocab.pop(old)
    spec["model"]["unk_token"] = "<unk>"
    spec["post_processor"] = None
    tok = TokenizersTokenizer(json.dumps(spec))
    assert (tok.pad_id, tok.unk_id, tok.cls_id, tok.sep_id, tok.mask_id) == (0, 1, 2, 3, 4)
    assert tok.encode("a", "b").tokens[:2] == ["<s>", "a"]
    assert not tok.is_continuation("<mask>")
