"""The pipeline tests' stand-in tokenizer and synthetic corpora: a WordPiece-like vocabulary
(stand_in_tokenizer; pieces are whitespace-separated, "##x" continues a word) and its special
ids, documents of stand-in words (synthetic_text_documents) tokenized or written as a reference
corpus file, and the masking helpers (stand_in_masking_config, masking_corpus, and
check_masking_statistics, the checks shared by static and dynamic masking); used by
test_data_pipeline.py, test_data_pipeline_tf.py and test_packed_input.py."""

from __future__ import annotations

import numpy as np

from data_pipeline import instances, masking

PAD, UNK, CLS, SEP, MASK = range(5)
SPECIAL = (PAD, UNK, CLS, SEP, MASK)


class StandInTokenizer:
    """Implements the part of the bertjax.tokenization contract the pipeline uses."""

    def __init__(self, tokens: list[str]):
        self.tokens = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *tokens]
        self.vocab = {t: i for i, t in enumerate(self.tokens)}
        self.vocab_size = len(self.tokens)
        self.pad_id, self.unk_id, self.cls_id, self.sep_id, self.mask_id = SPECIAL
        self.special_ids = frozenset(SPECIAL)

    def tokenize(self, text):
        return [t if t in self.vocab else "[UNK]" for t in text.split()]

    def tokenize_batch(self, texts):
        return [self.tokenize(t) for t in texts]

    def convert_tokens_to_ids(self, tokens):
        return [self.vocab[t] for t in tokens]

    def convert_ids_to_tokens(self, ids):
        return [self.tokens[i] for i in ids]

    def is_continuation(self, token):
        return token.startswith("##")


WORDS = [f"w{i}" for i in range(300)]
PIECES = [f"##p{i}" for i in range(60)]


def stand_in_tokenizer() -> StandInTokenizer:
    return StandInTokenizer(WORDS + PIECES)


def synthetic_text_documents(num_docs: int, seed: int, sentences=(8, 40), words=(4, 16),
                             multi_piece: float = 0.3) -> list[list[str]]:
    """Documents of sentences of stand-in words; a fraction of words has 1-3 "##" pieces."""
    rng = np.random.default_rng(seed)
    docs = []
    for _ in range(num_docs):
        doc = []
        for _ in range(rng.integers(*sentences)):
            out = []
            for _ in range(rng.integers(*words)):
                out.append(WORDS[rng.integers(len(WORDS))])
                if rng.random() < multi_piece:
                    tails = rng.integers(len(PIECES), size=rng.integers(1, 4))
                    out.extend(PIECES[j] for j in tails)
            doc.append(" ".join(out))
        docs.append(doc)
    return docs


def tokenized(docs, tok):
    return [[np.array(tok.convert_tokens_to_ids(tok.tokenize(s)), np.int32) for s in d]
            for d in docs]


def write_reference(path, docs):
    path.write_text("\n\n".join("\n".join(d) for d in docs) + "\n")
    return str(path)


def stand_in_masking_config(tok, whole_word, max_predictions=20):
    return masking.MaskingConfig.from_tokenizer(tok, max_predictions=max_predictions,
                                                whole_word=whole_word)


def word_spans(ids, cfg):
    """Independent word segmentation: lists of positions, by reading tokens one at a time."""
    spans, special, cont = [], cfg.special_table(), cfg.continuation_table()
    for i, t in enumerate(ids):
        if special[t]:
            continue
        if cont[t] and spans and spans[-1][-1] == i - 1:
            spans[-1].append(i)
        else:
            spans.append([i])
    return spans


def check_masking_statistics(originals, results, cfg, real_lengths):
    """Shared checks for static and dynamic masking.

    originals / results: lists of [n] arrays (real tokens only) before / after masking;
    positions/labels per sequence in `results` as (masked_ids, positions, labels).
    """
    total_tokens = total_pred = n_mask = n_same = 0
    special = cfg.special_table()
    for ids, (out, pos, lab), n in zip(originals, results, real_lengths):
        budget = int(masking.num_to_predict(n, cfg.masked_lm_prob, cfg.max_predictions))
        assert len(pos) <= budget
        if not cfg.whole_word:
            assert len(pos) == budget
        assert (np.diff(pos) > 0).all() and (pos < n).all()  # sorted, unique, real tokens
        assert not special[ids[pos]].any()  # [CLS]/[SEP] and other specials never chosen
        np.testing.assert_array_equal(lab, ids[pos])
        untouched = np.setdiff1d(np.arange(n), pos)
        np.testing.assert_array_equal(out[untouched], ids[untouched])
        assert not special[out[pos][out[pos] != cfg.mask_id]].any()  # random ids not special
        if cfg.whole_word:
            chosen = set(pos.tolist())
            for span in word_spans(ids, cfg):
                assert chosen.issuperset(span) or chosen.isdisjoint(span), span
                if chosen.issuperset(span):  # one decision per word
                    assert len(set((out[span] == cfg.mask_id).tolist())) == 1
            assert len(pos) >= budget - 3  # greedy fills up to the longest word's pieces
        total_tokens += n
        total_pred += len(pos)
        n_mask += int((out[pos] == cfg.mask_id).sum())
        n_same += int((out[pos] == ids[pos]).sum())
    frac = total_pred / total_tokens
    assert abs(frac - cfg.masked_lm_prob) < 0.005 + 0.01 * cfg.whole_word, frac
    p_mask, p_same = n_mask / total_pred, n_same / total_pred
    p_random = 1 - p_mask - p_same
    assert abs(p_mask - 0.8) < 0.02 and abs(p_same - 0.1) < 0.02 and abs(p_random - 0.1) < 0.02
    assert total_tokens >= 100_000


def masking_corpus(seed=0, num_docs=250):
    tok = stand_in_tokenizer()
    docs = tokenized(synthetic_text_documents(num_docs, seed), tok)
    cfg = instances.PairConfig(128, 0.1, 1, 100)
    out = list(instances.generate_instances(docs, cfg, CLS, SEP, np.random.default_rng(seed)))
    return tok, [i.tokens for i in out]
