"""Vocabulary training: WordPiece (own trainer) and SentencePiece (unigram/BPE, via sentencepiece).

WordPiece: words are counted after exactly the normalisation the tokenizer applies (BERT's
BasicTokenizer, cased or uncased); every character seen at least `min_char_count` times (the
`max_alphabet` most frequent) enters the vocabulary both as a word start "x" and as a
continuation "##x"; then, as in byte-pair encoding, the most frequent adjacent pair of pieces
inside words is merged into a new piece, repeatedly, until `vocab_size` entries (or no pair
occurs twice). Google's own WordPiece trainer (likelihood-based) was never released; frequency
merges give a vocabulary of the same form that greedy longest-match tokenization uses as is.
The vocabulary starts with [PAD] [UNK] [CLS] [SEP] [MASK] (ids 0-4).
"""

from __future__ import annotations

import collections
import heapq
import io
import re
from collections.abc import Iterable, Iterator

from bertjax import paths
from bertjax.errors import DataError
from bertjax.tokenization import normalization as norm
from bertjax.tokenization.base import SPECIAL_TOKENS
from bertjax.tokenization.wordpiece import MAX_INPUT_CHARS_PER_WORD as MAX_WORD_CHARS

# Bad training input; the message names the file or option.
TrainError = DataError


def expand_inputs(patterns: Iterable[str]) -> list[str]:
    """Files matching comma-separated glob patterns; an unmatched pattern is an error."""
    files: list[str] = []
    for pattern in patterns:
        for part in pattern.split(","):
            if not part:
                continue
            matched = paths.glob(part)
            if not matched:
                raise TrainError(f"--input: no file matches {part!r}")
            files.extend(f for f in matched if paths.isfile(f))
    if not files:
        raise TrainError("--input: no input files")
    return files


def read_lines(files: Iterable[str]) -> Iterator[str]:
    """Lines of UTF-8 text files; invalid UTF-8 is an error naming the file and line."""
    for path in files:
        for _, line in paths.text_lines(path, error=TrainError, hint=None):
            yield line


def count_words(lines: Iterable[str], lowercase: bool) -> collections.Counter:
    """Counts of BasicTokenizer words (the tokenizer's own normalisation)."""
    drop, split, cjk = norm.bulk_patterns()
    word_re = re.compile(f"{cjk.pattern}|[^{split.pattern[1:-1]}{cjk.pattern[1:-1]}]+")
    raw = collections.Counter()
    for line in lines:
        raw.update(word_re.findall(drop.sub("", line)))
    words = collections.Counter()
    for word, count in raw.items():
        spans = [(i, i + 1) for i in range(len(word))]
        for basic, _ in norm.normalize_whitespace_token(word, spans, lowercase):
            words[basic] += count
    return words


def _merge(a: str, b: str) -> str:
    return a + b[2:]


def train_wordpiece(
    lines: Iterable[str],
    vocab_size: int,
    lowercase: bool = True,
    max_alphabet: int = 1000,
    min_char_count: int = 2,
) -> list[str]:
    """A WordPiece vocabulary (tokens in id order) of at most `vocab_size` entries: the
    special tokens, the alphabet (each character alone and as a continuation), then the most
    frequent adjacent pieces merged, most frequent first."""
    n_special = len(SPECIAL_TOKENS)
    if vocab_size <= n_special:
        raise TrainError(f"--vocab_size must exceed {n_special} (the special tokens)")
    words = count_words(lines, lowercase)
    if not words:
        raise TrainError("--input: the input files contain no words")
    vocab = _alphabet_vocab(words, vocab_size, max_alphabet, min_char_count)
    seqs, weights = _piece_runs(words, set(vocab))
    return _merge_pairs(seqs, weights, vocab, vocab_size)


def _alphabet_vocab(words: collections.Counter, vocab_size: int, max_alphabet: int,
                    min_char_count: int) -> list[str]:
    """The special tokens, then the most frequent characters (at least `min_char_count`
    occurrences, at most `max_alphabet`), each alone and as a "##" continuation."""
    chars = collections.Counter()
    for word, count in words.items():
        for ch in word:
            chars[ch] += count
    alphabet = [c for c, n in chars.most_common(max_alphabet) if n >= min_char_count]
    alphabet.sort(key=lambda c: (-chars[c], c))
    vocab = list(SPECIAL_TOKENS)
    for c in alphabet:
        if len(vocab) + 2 > vocab_size:
            break
        vocab += [c, "##" + c]
    return vocab


def _piece_runs(words: collections.Counter, known: set[str]) -> tuple[list[list[str]],
                                                                       list[int]]:
    """(words as piece sequences, their counts). Words with characters outside the alphabet
    cannot merge through them, so they are cut into independent runs at those characters;
    runs of one piece (nothing to merge) and words longer than MAX_WORD_CHARS ([UNK] whatever
    the vocabulary) are left out."""
    seqs: list[list[str]] = []
    weights: list[int] = []
    for word, count in words.items():
        if len(word) > MAX_WORD_CHARS:
            continue
        run: list[str] = []
        for i, ch in enumerate(word):
            piece = ch if i == 0 else "##" + ch
            if piece in known:
                run.append(piece)
                continue
            if len(run) > 1:
                seqs.append(run)
                weights.append(count)
            run = []
        if len(run) > 1:
            seqs.append(run)
            weights.append(count)
    return seqs, weights


def _merge_pairs(seqs: list[list[str]], weights: list[int], vocab: list[str],
                 vocab_size: int) -> list[str]:
    """`vocab` grown by merging the most frequent adjacent pair (weighted by word counts) of
    `seqs` until `vocab_size` entries or no pair occurs twice. A heap of pair counts, updated
    only for the words that hold the merged pair (an index of where each pair occurs)."""
    known = set(vocab)
    pair_count: collections.Counter = collections.Counter()
    pair_where: dict[tuple[str, str], set[int]] = collections.defaultdict(set)
    for k, seq in enumerate(seqs):
        for pair in zip(seq, seq[1:]):
            pair_count[pair] += weights[k]
            pair_where[pair].add(k)
    heap = [(-n, pair) for pair, n in pair_count.items()]
    heapq.heapify(heap)
    while len(vocab) < vocab_size and heap:
        neg, pair = heapq.heappop(heap)
        if pair_count.get(pair, 0) != -neg:
            continue  # stale entry; the current count was pushed when it changed
        if -neg < 2:
            break
        new = _merge(*pair)
        if new not in known:
            vocab.append(new)
            known.add(new)
        changed: set[tuple[str, str]] = set()
        for k in pair_where.pop(pair, ()):
            seq, merged = seqs[k], _merged(seqs[k], pair, new)
            if len(merged) == len(seq):
                continue  # stale index entry: the pair left this word in an earlier merge
            seqs[k] = merged
            before = collections.Counter(zip(seq, seq[1:]))
            after = collections.Counter(zip(merged, merged[1:]))
            for p in before.keys() | after.keys():
                delta = after[p] - before[p]
                if delta:
                    pair_count[p] += delta * weights[k]
                    changed.add(p)
                    if delta > 0:
                        pair_where[p].add(k)
        pair_count.pop(pair, None)
        for p in changed - {pair}:
            n = pair_count.get(p, 0)
            if n > 0:
                heapq.heappush(heap, (-n, p))
            else:
                pair_count.pop(p, None)
    return vocab


def _merged(seq: list[str], pair: tuple[str, str], new: str) -> list[str]:
    """`seq` with every non-overlapping occurrence of `pair`, left to right, as `new`."""
    merged, i = [], 0
    while i < len(seq):
        if i + 1 < len(seq) and (seq[i], seq[i + 1]) == pair:
            merged.append(new)
            i += 2
        else:
            merged.append(seq[i])
            i += 1
    return merged


def train_sentencepiece(
    lines: Iterable[str], vocab_size: int, model_type: str = "unigram", lowercase: bool = False
) -> bytes:
    """A serialized SentencePiece model with [PAD]=0, [UNK]=1 and [CLS] [SEP] [MASK] as
    user-defined symbols (never split). `lowercase`: trained on lowercased text, to be used
    with do_lower_case=True."""
    import sentencepiece as spm

    if model_type not in ("unigram", "bpe"):
        raise TrainError(f"--model_type: SentencePiece type must be unigram or bpe, "
                         f"got {model_type!r}")
    sentences = [s for s in (line.strip() for line in lines) if s]
    if not sentences:
        raise TrainError("--input: the input files contain no text")
    if lowercase:
        sentences = [s.lower() for s in sentences]
    model = io.BytesIO()
    try:
        spm.SentencePieceTrainer.train(
            sentence_iterator=iter(sentences),
            model_writer=model,
            vocab_size=vocab_size,
            model_type=model_type,
            pad_id=0, unk_id=1, bos_id=-1, eos_id=-1,
            pad_piece="[PAD]", unk_piece="[UNK]",
            user_defined_symbols=["[CLS]", "[SEP]", "[MASK]"],
            hard_vocab_limit=False,
            minloglevel=2,
        )
    except RuntimeError as e:
        raise TrainError(f"sentencepiece training failed: {' '.join(str(e).split())}") from None
    return model.getvalue()
