"""Generated, learnable tagging data and a tiny checkpoint for the token-classification tests.

Tags follow from the words: each entity type has start words and continuation words, entities
are separated by filler words, and words may carry a WordPiece suffix (##s / ##ing), so most
sentences hold words of two or more sub-tokens.
"""

import random

from conftest import write_tiny_checkpoint

TYPES = ("PER", "LOC", "ORG")
FILLERS = [f"w{i}" for i in range(24)]
STARTS = {t: [f"{t.lower()}b{i}" for i in range(3)] for t in TYPES}
INSIDES = {t: [f"{t.lower()}i{i}" for i in range(3)] for t in TYPES}
SUFFIXES = ("##s", "##ing")
VOCAB = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *FILLERS,
         *(w for t in TYPES for w in STARTS[t] + INSIDES[t]), *SUFFIXES]


def write_checkpoint(root, max_positions=64, num_layers=2) -> str:
    """A tiny random BERT (hidden 32) with VOCAB; returns its directory."""
    return write_tiny_checkpoint(root, VOCAB, max_positions, num_layers)


def _word(rng, word):
    return word + rng.choice(("", "", "s", "ing"))


def sentence(rng, min_len=3, max_len=12):
    """(words, IOB2 tags)."""
    words, tags = [], []
    target = rng.randint(min_len, max_len)
    while len(words) < target:
        if rng.random() < 0.35 and (not tags or tags[-1] == "O"):
            kind = rng.choice(TYPES)
            words.append(_word(rng, rng.choice(STARTS[kind])))
            tags.append(f"B-{kind}")
            for _ in range(rng.choice((0, 0, 1, 2))):
                words.append(_word(rng, rng.choice(INSIDES[kind])))
                tags.append(f"I-{kind}")
        else:
            words.append(_word(rng, rng.choice(FILLERS)))
            tags.append("O")
    return words, tags


def write_conll(path, sentences, docs_every=0, columns=("POS", "CHUNK")):
    """CoNLL-2003 layout: `word POS chunk tag`, -DOCSTART- every `docs_every` sentences."""
    lines = []
    for i, (words, tags) in enumerate(sentences):
        if docs_every and i % docs_every == 0:
            lines += ["-DOCSTART- -X- -X- O", ""]
        lines += [" ".join([w, *columns, t]) for w, t in zip(words, tags)] + [""]
    path.write_text("\n".join(lines) + "\n")


def dataset(seed, n, **kw):
    rng = random.Random(seed)
    return [sentence(rng, **kw) for _ in range(n)]
