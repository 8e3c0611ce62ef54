"""SQuAD window features, as the reference `run_squad.py` builds them, from the tokenizer's
character offsets.

Examples are questions (`readers.SquadExample`); features are windows (`SquadFeatures`): each
window is `[CLS] question [SEP] context piece [SEP]`, the question truncated to
`max_query_length` tokens, and successive context pieces start `doc_stride` tokens apart until
one reaches the context's end. A context token seen by several windows has its "max context" in
the window where min(tokens left of it, tokens right of it) + 0.01 · window length is largest
(the reference's rule); only there may an answer start.

Answers are mapped through character offsets, never through re-tokenised answer text: the
first context token whose span ends after the answer's first non-space character and the last
one that starts before the end of its last. Offsets exclude the whitespace a piece carries
(ByteLevel BPE's "Ġ"), so any tokenizer's pieces map the same way: WordPiece, SentencePiece,
a tokenizer.json (ModernBERT's, whose context starts with a word without "Ġ"). Training
windows that do not hold the whole answer (and v2.0's unanswerable questions) point at [CLS]
(position 0).

Conversion is vectorised: every distinct context is tokenized once (questions share them;
SQuAD train has 88k questions over 19k paragraphs), in one batch call (the tokenizer's
compiled tensorflow-text path for plain-ASCII batches), and windows, token ids and max-context
flags are NumPy arrays. `num_workers > 1` splits the examples over spawned processes, each
with its own copy of the tokenizer (any kind).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from bertjax.errors import ConfigError, DataError
from bertjax.tasks.squad.readers import SquadExample


@dataclasses.dataclass
class SquadFeatures:
    """Windows of a split. n = number of windows, seq = max_seq_length. All int32 unless said.

    input_ids, segment_ids, input_mask: [n, seq]
    start_positions, end_positions: [n] answer token positions in the window (0 = [CLS])
    example_index: [n] the question (index into `examples`) each window belongs to
    doc_start: [n] the window's first context token (index into its context's tokens)
    doc_offset: [n] the position of that token in the window (question length + 2)
    doc_length: [n] context tokens in the window
    max_context: [n, seq] bool, the token has its max context in this window
    contexts: per distinct context, its token character spans [tokens, 2] (end exclusive)
    context_index: [len(examples)] which context each question reads
    """

    examples: list[SquadExample]
    input_ids: np.ndarray
    segment_ids: np.ndarray
    input_mask: np.ndarray
    start_positions: np.ndarray
    end_positions: np.ndarray
    example_index: np.ndarray
    doc_start: np.ndarray
    doc_offset: np.ndarray
    doc_length: np.ndarray
    max_context: np.ndarray
    contexts: list[np.ndarray]
    context_index: np.ndarray

    def __len__(self) -> int:
        return len(self.example_index)

    def token_spans(self, i: int) -> np.ndarray:
        """[seq, 2] character span in the context of each token of window i; -1 outside the
        context (special tokens, question, padding)."""
        seq = self.input_ids.shape[1]
        spans = np.full((seq, 2), -1, np.int64)
        offset, start, length = self.doc_offset[i], self.doc_start[i], self.doc_length[i]
        spans[offset:offset + length] = self.contexts[self.context_index[
            self.example_index[i]]][start:start + length]
        return spans


def window_starts(num_tokens: int, window: int, stride: int) -> np.ndarray:
    """First context token of each window (the reference's loop): a window every `stride`
    tokens until one reaches the end; the last one may be shorter. [num_windows]."""
    if num_tokens <= window:
        return np.zeros(1, np.int64)
    last = -(-(num_tokens - window) // stride)  # ceil: windows after the first
    return np.arange(last + 1, dtype=np.int64) * stride


def max_context_window(num_tokens: int, starts: np.ndarray, window: int) -> np.ndarray:
    """[num_tokens] index of the window in which each context token has its max context:
    score = min(left, right) + 0.01 · length; the first window wins ties (as the reference)."""
    lengths = np.minimum(window, num_tokens - starts)  # [W]
    pos = np.arange(num_tokens)[None, :]  # [1, T]
    left = pos - starts[:, None]
    right = starts[:, None] + lengths[:, None] - 1 - pos
    inside = (left >= 0) & (right >= 0)
    score = np.where(inside, np.minimum(left, right) + 0.01 * lengths[:, None], -np.inf)
    return np.argmax(score, axis=0)


def answer_token_span(spans: np.ndarray, start_char: int, end_char: int) -> tuple[int, int]:
    """(first, last) context token covering characters [start_char, end_char).

    spans: [tokens, 2] character spans (end exclusive), sorted. (-1, -1) when no token
    overlaps the answer (e.g. an answer of whitespace only)."""
    first = int(np.searchsorted(spans[:, 1], start_char, side="right"))
    last = int(np.searchsorted(spans[:, 0], end_char, side="left")) - 1
    if first >= len(spans) or last < first:
        return -1, -1
    return first, last


def check_limits(max_seq_length: int, doc_stride: int, max_query_length: int) -> int:
    """Context tokens per window; a ConfigError names a combination that cannot work."""
    window = max_seq_length - max_query_length - 3
    if window < 1:
        raise ConfigError(f"config.max_seq_length={max_seq_length} leaves no room for the "
                          f"context after a {max_query_length}-token question "
                          "(config.task.max_query_length) and 3 special tokens")
    if not 0 < doc_stride <= window:
        raise ConfigError(f"config.task.doc_stride={doc_stride} must be in [1, {window}] "
                          f"(the context tokens of a window) or windows would skip tokens")
    return window


# Below this many questions, starting worker processes costs more than it saves.
PARALLEL_MIN_EXAMPLES = 2000


def _pieces(tokenizer, texts: list[str]):
    return tokenizer._pieces_batch(texts)  # noqa: SLF001 - the batch path with offsets


def convert(tokenizer, examples: Sequence[SquadExample], max_seq_length: int = 384,
            doc_stride: int = 128, max_query_length: int = 64, training: bool = False,
            num_workers: int = 1) -> SquadFeatures:
    """Window features of `examples` (see SquadFeatures). training: answer positions of the
    first answer (else positions are 0)."""
    check_limits(max_seq_length, doc_stride, max_query_length)
    examples = list(examples)
    if not examples:
        raise DataError("no SQuAD questions to convert")
    if num_workers > 1 and len(examples) >= PARALLEL_MIN_EXAMPLES:
        return _convert_parallel(tokenizer, examples, max_seq_length, doc_stride,
                                 max_query_length, training, num_workers)
    context_ids: dict[str, int] = {}
    for e in examples:
        context_ids.setdefault(e.context, len(context_ids))
    context_texts = list(context_ids)
    context_pieces = _pieces(tokenizer, context_texts)
    question_pieces = _pieces(tokenizer, [e.question for e in examples])
    contexts = [np.asarray(p.offsets, np.int64).reshape(-1, 2) for p in context_pieces]
    context_tokens = [np.asarray(p.ids, np.int32) for p in context_pieces]
    context_index = np.array([context_ids[e.context] for e in examples], np.int32)
    cls, sep, pad = tokenizer.cls_id, tokenizer.sep_id, tokenizer.pad_id

    rows: dict[str, list] = {k: [] for k in ("ids", "len_q", "example", "start", "length",
                                             "max_ctx", "pos")}
    for i, (example, q) in enumerate(zip(examples, question_pieces)):
        q_ids = q.ids[:max_query_length]
        c = context_index[i]
        ids, spans = context_tokens[c], contexts[c]
        window = max_seq_length - len(q_ids) - 3
        starts = window_starts(len(ids), window, doc_stride)
        best = max_context_window(len(ids), starts, window)
        answer = (-1, -1)
        if training and not example.is_impossible and example.answers:
            text, start_char = example.answers[0]
            # Without the answer's own leading/trailing whitespace: an answer_start on the
            # space before a word starts at the word, not at a piece that holds only the
            # space (ByteLevel BPE's lone "Ġ", an empty span there).
            answer = answer_token_span(spans, start_char + len(text) - len(text.lstrip()),
                                       start_char + len(text.rstrip()))
        head = np.array([cls, *q_ids, sep], np.int32)
        for w, start in enumerate(starts):
            length = int(min(window, len(ids) - start))
            rows["ids"].append(np.concatenate([head, ids[start:start + length], [sep]]))
            rows["len_q"].append(len(q_ids))
            rows["example"].append(i)
            rows["start"].append(start)
            rows["length"].append(length)
            rows["max_ctx"].append(best[start:start + length] == w)
            inside = answer[0] >= start and answer[1] < start + length and answer[0] >= 0
            offset = len(q_ids) + 2
            rows["pos"].append((answer[0] - start + offset, answer[1] - start + offset)
                               if inside else (0, 0))
    n = len(rows["ids"])
    input_ids = np.full((n, max_seq_length), pad, np.int32)
    segment_ids = np.zeros((n, max_seq_length), np.int32)
    input_mask = np.zeros((n, max_seq_length), np.int32)
    max_context = np.zeros((n, max_seq_length), bool)
    doc_offset = np.array(rows["len_q"], np.int32) + 2
    for r, ids in enumerate(rows["ids"]):
        input_ids[r, :len(ids)] = ids
        input_mask[r, :len(ids)] = 1
        segment_ids[r, doc_offset[r]:len(ids)] = 1
        max_context[r, doc_offset[r]:doc_offset[r] + rows["length"][r]] = rows["max_ctx"][r]
    positions = np.array(rows["pos"], np.int32).reshape(n, 2)
    return SquadFeatures(examples, input_ids, segment_ids, input_mask, positions[:, 0],
                         positions[:, 1], np.array(rows["example"], np.int32),
                         np.array(rows["start"], np.int32), doc_offset,
                         np.array(rows["length"], np.int32), max_context, contexts,
                         context_index)


def concatenate(parts: list[SquadFeatures]) -> SquadFeatures:
    """Features of consecutive example chunks as one (indices shifted)."""
    n_examples = np.cumsum([0] + [len(p.examples) for p in parts])
    n_contexts = np.cumsum([0] + [len(p.contexts) for p in parts])
    cat = np.concatenate
    return SquadFeatures(
        [e for p in parts for e in p.examples],
        *(cat([getattr(p, k) for p in parts]) for k in (
            "input_ids", "segment_ids", "input_mask", "start_positions", "end_positions")),
        cat([p.example_index + n_examples[j] for j, p in enumerate(parts)]),
        *(cat([getattr(p, k) for p in parts]) for k in (
            "doc_start", "doc_offset", "doc_length", "max_context")),
        [c for p in parts for c in p.contexts],
        cat([p.context_index + n_contexts[j] for j, p in enumerate(parts)]))


_WORKER: tuple = ()  # (tokenizer, convert kwargs) of a worker process


def _worker_tokenizer(tokenizer):
    """What a spawned worker rebuilds the tokenizer from: WordPiece from its vocabulary (the
    pure-Python path: no TensorFlow start-up per worker), any other tokenizer pickled (a
    tokenizer.json's `TokenizersTokenizer` carries its JSON); None if it cannot be sent."""
    import pickle

    from bertjax.tokenization import WordPieceTokenizer

    if isinstance(tokenizer, WordPieceTokenizer):
        return ("wordpiece", tokenizer.convert_ids_to_tokens(range(tokenizer.vocab_size)),
                tokenizer.do_lower_case)
    try:
        return ("pickle", pickle.dumps(tokenizer))
    except Exception:  # noqa: BLE001 - an unpicklable backend: convert in this process
        return None


def _init_worker(recipe: tuple, kwargs: dict) -> None:
    import pickle

    from bertjax.tokenization import WordPieceTokenizer

    global _WORKER
    if recipe[0] == "wordpiece":
        tokenizer = WordPieceTokenizer(recipe[1], recipe[2])
        tokenizer.tf_text_min_batch = None  # pure Python: no TensorFlow start-up per worker
    else:
        tokenizer = pickle.loads(recipe[1])
    _WORKER = (tokenizer, kwargs)


def _worker(chunk: list[SquadExample]) -> SquadFeatures:
    tokenizer, kwargs = _WORKER
    return convert(tokenizer, chunk, num_workers=1, **kwargs)


def _convert_parallel(tokenizer, examples, max_seq_length, doc_stride, max_query_length,
                      training, num_workers) -> SquadFeatures:
    """convert() over `num_workers` spawned processes, on chunks cut at context boundaries
    (SQuAD files list a paragraph's questions together, so contexts stay tokenized once).
    Spawned, not forked: the parent may hold JAX's or TensorFlow's threads, and a fork of
    them can deadlock. Each worker rebuilds the tokenizer (`_worker_tokenizer`); one that
    cannot be sent to a process is used here, in one process."""
    import multiprocessing

    kwargs = dict(max_seq_length=max_seq_length, doc_stride=doc_stride,
                  max_query_length=max_query_length, training=training)
    recipe = _worker_tokenizer(tokenizer)
    if recipe is None:
        return convert(tokenizer, examples, num_workers=1, **kwargs)
    bounds = [0]
    for k in range(1, num_workers):
        cut = len(examples) * k // num_workers
        while 0 < cut < len(examples) and examples[cut].context == examples[cut - 1].context:
            cut += 1
        bounds.append(max(cut, bounds[-1]))
    bounds.append(len(examples))
    chunks = [examples[a:b] for a, b in zip(bounds, bounds[1:]) if b > a]
    with multiprocessing.get_context("spawn").Pool(
            len(chunks), _init_worker, (recipe, kwargs)) as pool:
        parts = pool.map(_worker, chunks)
    return concatenate(parts)
