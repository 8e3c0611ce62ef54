r"""SQuAD feature conversion speed on a generated set the size of SQuAD v1.1 train (88k
questions over 19k paragraphs of ~140 words, a 30k-piece vocabulary), one process and
`--num_workers` forked ones. TensorFlow-free unless tensorflow-text is installed (the
tokenizer then uses its compiled path for the plain-ASCII batch).

  python -m bertjax.benchmarks.squad_features [--questions=88000] [--num_workers=2]
"""

from __future__ import annotations

import itertools
import random
import time

from absl import flags

_QUESTIONS = flags.DEFINE_integer("questions", 88000, "questions (≈4.6 per paragraph)")
_WORKERS = flags.DEFINE_integer("num_workers", 2, "processes for the parallel run")


def synthetic_squad(questions: int, seed: int = 0):
    """(tokenizer, examples): Zipf-distributed words of 1-2 pieces over a 30k vocabulary,
    paragraphs of 80-200 words, 4-5 questions of 6-15 words per paragraph."""
    from bertjax.tasks.squad.readers import SquadExample
    from bertjax.tokenization import WordPieceTokenizer

    rng = random.Random(seed)
    syllables = [c + v for c in "bcdfghjklmnprstvwz" for v in ("a", "e", "i", "o", "u", "ai")]
    stems = sorted({"".join(rng.choices(syllables, k=rng.randint(1, 3)))
                    for _ in range(20000)})[:15000]
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", ".", ",", "?", *stems,
             *("##" + s for s in stems)]
    tokenizer = WordPieceTokenizer(vocab)
    # Words of one or two pieces, Zipf-distributed like natural text.
    words = [rng.choice(stems) + (rng.choice(stems) if rng.random() < 0.3 else "")
             for _ in range(40000)]
    cumulative = list(itertools.accumulate(1.0 / (rank + 1) for rank in range(len(words))))
    examples = []
    paragraph = 0
    while len(examples) < questions:
        text = rng.choices(words, cum_weights=cumulative, k=rng.randint(80, 200))
        for k in range(9, len(text), 12):
            text[k] += rng.choice([".", ","])
        context = " ".join(text)
        for q in range(rng.choice((4, 5))):
            first = rng.randrange(len(text) - 3)
            answer = " ".join(text[first:first + rng.randint(1, 3)])
            start = len(" ".join(text[:first])) + (1 if first else 0)
            asked = rng.choices(words, cum_weights=cumulative, k=rng.randint(6, 15))
            question = " ".join(asked) + "?"
            examples.append(SquadExample(f"p{paragraph}q{q}", question, context,
                                         [(answer, start)]))
        paragraph += 1
    return tokenizer, examples[:questions]


def main(argv):
    del argv
    from bertjax.tasks.squad import features as squad

    tokenizer, examples = synthetic_squad(_QUESTIONS.value)
    paragraphs = len({e.context for e in examples})
    print(f"SQuAD feature conversion: {len(examples)} questions, {paragraphs} paragraphs, "
          "max_seq_length 384, doc_stride 128, max_query_length 64")
    for workers in sorted({1, _WORKERS.value}):  # noqa: B007
        tokenizer._records.clear()  # noqa: SLF001 - a cold word cache for each run
        tokenizer._token_cache.clear()  # noqa: SLF001
        tokenizer._id_cache.clear()  # noqa: SLF001
        start = time.perf_counter()
        features = squad.convert(tokenizer, examples, training=True, num_workers=workers)
        seconds = time.perf_counter() - start
        print(f"  {workers} process(es): {seconds:6.1f} s  ({len(examples) / seconds:,.0f} "
              f"questions/s, {len(features)} windows)", flush=True)


if __name__ == "__main__":
    from bertjax import cli

    cli.run(main)
