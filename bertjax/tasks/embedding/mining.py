"""Hard negatives for (anchor, positive) training pairs: for each anchor, the corpus texts
nearest to it that are neither its positives nor (by a margin) as near as they are, the
semantics of sentence-transformers' `mine_hard_negatives` (sampling "top", output "n-tuple"),
found by exact search on device (metrics.search: the corpus a chunk at a time, optionally
sharded over a mesh; never a [anchors, corpus] matrix).

    mined = mine_hard_negatives(anchor_vectors, corpus_vectors, positives, num_negatives=3,
                                relative_margin=0.05)
    summary = mine_file(embedder, "pairs.jsonl", "mined.jsonl", num_negatives=3)

For each anchor: its top hits over the corpus, best first (ties: the lower corpus row); less
its positives and its own text; the first `range_max` of those; less the candidates scoring
above max_score or within a margin of the anchor's lowest positive score (margin: above
positive - margin; relative_margin: above positive - |positive| * relative_margin, which is
positive * (1 - relative_margin) for a positive score above 0); less the first `range_min`
of the rest; then the first `num_negatives`. The search goes only as deep as that needs:
range_max (default range_min + num_negatives, ten times the negatives when a filter is set)
plus the most rows any anchor excludes.

The file form reads the pairs (and an optional corpus file), embeds each distinct text once,
and writes one row per input row: anchor, positive, negative_1 .. negative_n, the columns the
`pairs` config reads (config.data.columns=anchor,positive,negative_1,...). A row whose anchor
has fewer than num_negatives negatives left is dropped, as sentence-transformers drops it.
"""

from __future__ import annotations

import csv
import dataclasses
from collections.abc import Callable, Sequence

import numpy as np
from etils import epath
from jax.sharding import Mesh

from bertjax import paths
from bertjax.errors import ConfigError, DataError
from bertjax.tasks.chunks import dump
from bertjax.tasks.classification import readers as table
from bertjax.tasks.embedding import metrics
from bertjax.train import multihost

OUTPUT_SUFFIXES = (".jsonl", ".csv", ".tsv")
Embed = Callable[[list[str]], np.ndarray]  # texts → vectors [len(texts), hidden]
PARTIAL = ".partial"


@dataclasses.dataclass
class Mined:
    """negatives [anchors, num_negatives] int64: corpus rows, best first, -1 past an anchor's
    last; scores [anchors, num_negatives] float32, -inf past the last; positive_scores
    [anchors] float64: each anchor's lowest positive score, what the margins compare with."""

    negatives: np.ndarray
    scores: np.ndarray
    positive_scores: np.ndarray

    @property
    def complete(self) -> np.ndarray:
        """[anchors] bool: the anchors with num_negatives negatives."""
        return (self.negatives >= 0).all(axis=1)


def check_settings(num_negatives: int, range_min: int = 0, range_max: int | None = None
                   ) -> None:
    if num_negatives < 1:
        raise ConfigError(f"num_negatives={num_negatives} must be 1 or more")
    if range_min < 0:
        raise ConfigError(f"range_min={range_min} must be 0 or more")
    if range_max is not None and range_max < range_min + num_negatives:
        raise ConfigError(f"range_max={range_max} leaves fewer than num_negatives="
                          f"{num_negatives} candidates after range_min={range_min}")


def candidate_window(num_negatives: int, range_min: int, range_max: int | None,
                     filtered: bool) -> int:
    """How many of an anchor's nearest texts (its excluded rows aside) are candidates:
    range_max, by default just enough; a filter may drop candidates, the default window then
    holds ten a negative, as sentence-transformers'."""
    if range_max is not None:
        return range_max
    return range_min + num_negatives * (10 if filtered else 1)


def pair_scores(vectors_a, vectors_b, similarity: str = "cosine") -> np.ndarray:
    """vectors_a, vectors_b [n, hidden] → the similarity of each row pair [n], in float64."""
    if similarity == "cosine":
        return metrics.pair_cosines(vectors_a, vectors_b)
    return np.sum(np.asarray(vectors_a, np.float64) * np.asarray(vectors_b, np.float64), axis=1)


def _padded(rows: Sequence[Sequence[int]]) -> np.ndarray:
    """Lists of corpus rows → [len(rows), longest] int64, padded with -1."""
    out = np.full((len(rows), max((len(r) for r in rows), default=0)), -1, np.int64)
    for i, r in enumerate(rows):
        out[i, :len(r)] = r
    return out


def _kept(scores, positive_scores, margin, relative_margin, max_score) -> np.ndarray:
    """scores [anchors, hits] → [anchors, hits] bool: the candidates no filter drops (the
    comparisons of sentence-transformers', in float64)."""
    scores = scores.astype(np.float64)
    positive = positive_scores[:, None]
    keep = np.ones(scores.shape, bool)
    if margin is not None:
        keep &= ~(scores + margin > positive)
    if relative_margin is not None:
        keep &= ~(scores > positive - np.abs(positive) * relative_margin)
    if max_score is not None:
        keep &= ~(scores > max_score)
    return keep


def mine_hard_negatives(anchor_vectors, corpus_vectors, positives: Sequence[Sequence[int]],
                        num_negatives: int = 3, *, range_min: int = 0,
                        range_max: int | None = None, margin: float | None = None,
                        relative_margin: float | None = None, max_score: float | None = None,
                        exclude: Sequence[Sequence[int]] | None = None,
                        similarity: str = "cosine", chunk_rows: int = 16384,
                        query_rows: int = 1024, mesh: Mesh | None = None) -> Mined:
    """The hard negatives of each anchor (module docstring).

    anchor_vectors [anchors, hidden], corpus_vectors [n, hidden]; positives: per anchor, the
    corpus rows of its positives (one or more), never negatives, their lowest score the
    margins' reference; exclude: per anchor, more corpus rows never returned (e.g. the anchor's
    own text). chunk_rows, query_rows, mesh: metrics.search's."""
    check_settings(num_negatives, range_min, range_max)
    anchor_vectors = np.asarray(anchor_vectors, np.float32)
    corpus_vectors = np.asarray(corpus_vectors, np.float32)
    if len(positives) != len(anchor_vectors) or (exclude is not None
                                                 and len(exclude) != len(anchor_vectors)):
        raise ValueError(f"positives ({len(positives)}) and exclude must have a list per "
                         f"anchor ({len(anchor_vectors)})")
    if any(not p for p in positives):
        raise ValueError(f"anchor {next(i for i, p in enumerate(positives) if not p)} has no "
                         "positive")
    excluded = [list(p) + list(e) for p, e in zip(positives, exclude or [[]] * len(positives))]
    if bad := [r for rows in excluded for r in rows if not 0 <= r < len(corpus_vectors)]:
        raise ValueError(f"corpus row {bad[0]} is not one of the corpus's "
                         f"{len(corpus_vectors)} rows")
    excluded = _padded(excluded)

    # Margins count from the lowest score of an anchor's positives (its hardest one).
    anchor_of = np.repeat(np.arange(len(positives)), [len(p) for p in positives])
    per_pair = pair_scores(anchor_vectors[anchor_of],
                           corpus_vectors[[r for rows in positives for r in rows]], similarity)
    positive_scores = np.full(len(positives), np.inf)
    np.minimum.at(positive_scores, anchor_of, per_pair)

    filtered = any(x is not None for x in (margin, relative_margin, max_score))
    window = candidate_window(num_negatives, range_min, range_max, filtered)
    # Deep enough for the window once an anchor's excluded rows are taken out of its hits.
    scores, hits = metrics.search(anchor_vectors, corpus_vectors, window + excluded.shape[1],
                                  similarity, chunk_rows, query_rows, mesh)
    candidate = ~(hits[:, :, None] == excluded[:, None, :]).any(axis=2)
    candidate &= np.cumsum(candidate, axis=1) <= window
    keep = candidate & _kept(scores, positive_scores, margin, relative_margin, max_score)
    # Skip the first range_min kept candidates, take the next num_negatives.
    rank = np.cumsum(keep, axis=1) - range_min
    chosen = keep & (rank >= 1) & (rank <= num_negatives)
    negatives = np.full((len(anchor_vectors), num_negatives), -1, np.int64)
    negative_scores = np.full((len(anchor_vectors), num_negatives), -np.inf, np.float32)
    anchor, position = np.nonzero(chosen)
    negatives[anchor, rank[chosen] - 1] = hits[anchor, position]
    negative_scores[anchor, rank[chosen] - 1] = scores[anchor, position]
    return Mined(negatives, negative_scores, positive_scores)


# ---------------------------------------------------------------------------------------------
# Files


def _text(record: dict, column: str, path: str, line: int, flag: str) -> str:
    if record.get(column) is None:
        raise DataError(f"{path}:{line}: no column {column!r} ({flag}); the file's columns: "
                        f"{', '.join(map(str, record))}")
    return table.nonempty_text(str(record[column]), column, path, line)


def read_pairs(path: str, anchor_column: str = "anchor", positive_column: str = "positive",
               encoding: str = paths.DEFAULT_ENCODING) -> list[tuple[str, str]]:
    """(anchor, positive) texts of each row of a .csv / .tsv / .jsonl file."""
    pairs = [(_text(record, anchor_column, path, line, "--text_a, the anchors' column"),
              _text(record, positive_column, path, line, "--text_b, the positives' column"))
             for line, record in table.records(path, encoding)]
    if not pairs:
        raise DataError(f"{path}: no rows")
    return pairs


def read_corpus(path: str, column: str = "text", encoding: str = paths.DEFAULT_ENCODING
                ) -> list[str]:
    """The texts of column `column` of a .csv / .tsv / .jsonl file."""
    return [_text(record, column, path, line, "the --corpus file's texts")
            for line, record in table.records(path, encoding)]


def check_output(path: str) -> None:
    if not path.lower().endswith(OUTPUT_SUFFIXES):
        raise ConfigError(f"--output={path}: mined rows are written to a "
                          f"{' / '.join(OUTPUT_SUFFIXES)} file")


def write_rows(path: str, columns: Sequence[str], rows: Sequence[Sequence[str]]) -> None:
    """`rows` under the header `columns`, as a .jsonl / .csv / .tsv file by its suffix; under
    a temporary name until complete, so that a failed run leaves no partial file."""
    check_output(path)
    with paths.open(path + PARTIAL, "w", encoding="utf-8", newline="") as out:
        if path.lower().endswith(".jsonl"):
            out.writelines(dump(dict(zip(columns, row))) + "\n" for row in rows)
        else:
            writer = csv.writer(out, delimiter="\t" if path.lower().endswith(".tsv") else ",")
            writer.writerow(columns)
            writer.writerows(rows)
    epath.Path(path + PARTIAL).replace(path)


@dataclasses.dataclass
class Summary:
    """What `mine_pairs` wrote, for its one-line report."""

    rows: int  # rows written
    input_rows: int
    anchors: int  # distinct anchors
    dropped: int  # distinct anchors with too few negatives (their rows not written)
    corpus: int  # distinct texts searched
    positive_score: float  # mean over the rows written
    negative_score: float  # mean over their negatives
    columns: tuple[str, ...]

    def line(self, output: str) -> str:
        return (f"wrote {self.rows} of {self.input_rows} rows to {output} "
                f"({len(self.columns) - 2} negatives each, from {self.corpus} distinct texts); "
                f"{self.dropped} of {self.anchors} anchors dropped (too few negatives left); "
                f"mean score: positive {self.positive_score:.4f}, negative "
                f"{self.negative_score:.4f}; train with --config.data.columns="
                f"{','.join(self.columns)}")


def _embed(embed: Embed, texts: list[str], rows: int) -> np.ndarray:
    """[len(texts), hidden]: `rows` texts at a time (0: all at once)."""
    rows = rows or len(texts)
    return np.concatenate([embed(texts[i:i + rows]) for i in range(0, len(texts), rows)])


def mine_pairs(embed: Embed, pairs: Sequence[tuple[str, str]], num_negatives: int = 3,
               corpus: Sequence[str] = (), columns: tuple[str, str] = ("anchor", "positive"),
               embed_rows: int = 0, embed_corpus: Embed | None = None, **options
               ) -> tuple[list[tuple[str, ...]], Summary]:
    """The rows (anchor, positive, negative_1 .. negative_n) of the pairs whose anchor has
    num_negatives negatives, in the pairs' order, and their summary.

    embed: the anchors' texts → vectors [rows, hidden] (an Embedder, or its embed_queries);
    embed_corpus: the searched texts' (default: embed; e.g. embed_documents), `embed_rows`
    texts a call (0: all). The searched texts are `corpus` and every positive, each once. An
    anchor's positives are those of all of its rows; its own text is never its negative.
    options: mine_hard_negatives's keywords."""
    texts = list(dict.fromkeys([*corpus, *(p for _, p in pairs)]))
    row_of = {text: i for i, text in enumerate(texts)}
    anchors = list(dict.fromkeys(a for a, _ in pairs))
    anchor_of = {text: i for i, text in enumerate(anchors)}
    positives: list[list[int]] = [[] for _ in anchors]
    for anchor, positive in pairs:
        if row_of[positive] not in positives[anchor_of[anchor]]:
            positives[anchor_of[anchor]].append(row_of[positive])
    own = [[row_of[a]] if a in row_of and row_of[a] not in positives[i] else []
           for i, a in enumerate(anchors)]
    anchor_vectors = _embed(embed, anchors, embed_rows)
    corpus_vectors = _embed(embed_corpus or embed, texts, embed_rows)
    mined = mine_hard_negatives(anchor_vectors, corpus_vectors, positives, num_negatives,
                                exclude=own, **options)

    kept = [(a, p) for a, p in pairs if mined.complete[anchor_of[a]]]
    index = np.array([anchor_of[a] for a, _ in kept], np.int64)
    positive_scores = pair_scores(anchor_vectors[index],
                                  corpus_vectors[[row_of[p] for _, p in kept]],
                                  options.get("similarity", "cosine")) if kept else np.zeros(0)
    rows = [(a, p, *(texts[r] for r in mined.negatives[anchor_of[a]])) for a, p in kept]
    header = (*columns, *(f"negative_{i}" for i in range(1, num_negatives + 1)))
    summary = Summary(len(rows), len(pairs), len(anchors), int((~mined.complete).sum()),
                      len(texts), float(np.mean(positive_scores)) if kept else float("nan"),
                      float(np.mean(mined.scores[index])) if kept else float("nan"), header)
    return rows, summary


def mine_file(embed: Embed, pairs_path: str, output: str, num_negatives: int = 3, *,
              corpus_path: str | None = None, anchor_column: str = "anchor",
              positive_column: str = "positive", corpus_column: str = "text",
              encoding: str = paths.DEFAULT_ENCODING, **options) -> Summary:
    """Reads the pairs file (and the corpus file: its column `corpus_column`), mines
    (`mine_pairs`, whose keywords `options` also takes), and writes the rows to `output`
    (.jsonl / .csv / .tsv; from process 0 only on several hosts); returns the summary."""
    check_output(output)
    check_settings(num_negatives, options.get("range_min", 0), options.get("range_max"))
    pairs = read_pairs(pairs_path, anchor_column, positive_column, encoding)
    corpus = read_corpus(corpus_path, corpus_column, encoding) if corpus_path else []
    rows, summary = mine_pairs(embed, pairs, num_negatives, corpus,
                               (anchor_column, positive_column), **options)
    multihost.write_from_main(lambda: write_rows(output, summary.columns, rows))
    return summary
