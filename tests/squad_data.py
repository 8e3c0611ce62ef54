"""A generated extractive QA set for the SQuAD tests: VOCAB (conftest's filler words, the
name words FIRST, MIDDLE, LAST, and the question words) and generate, which writes a
SQuAD-format file whose answer is the context's one run of name words (absent from the
unanswerable contexts of a v2.0-style set); used by tests/e2e/test_squad_e2e.py, the SQuAD
prediction tests of tests/serving/ and the multi-host SQuAD job."""

import json
import random

from conftest import FILLERS

# An answer is "first<i> [middle<j>]* last<k>": its ends are learnable from the tokens alone.
FIRST, MIDDLE, LAST = ([f"{kind}{i}" for i in range(6)] for kind in ("first", "middle", "last"))
VOCAB = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *FILLERS, *FIRST, *MIDDLE, *LAST, "who",
         "is", "it", "?"]


def generate(path, n, seed, impossible_rate=0.0):
    """SQuAD-format file: two questions per context; the answer is the name run (2-4
    words), which unanswerable contexts lack."""
    rng = random.Random(seed)
    paragraphs = []
    for p in range(n // 2):
        words = [rng.choice(FILLERS) for _ in range(rng.randint(10, 70))]
        impossible = rng.random() < impossible_rate
        answer = [] if impossible else [rng.choice(FIRST), *rng.sample(MIDDLE, rng.randint(
            0, 2)), rng.choice(LAST)]
        at = rng.randint(0, len(words))
        words[at:at] = answer
        context = " ".join(words)
        start = len(" ".join(words[:at])) + (1 if at else 0)
        text = " ".join(answer)
        qas = []
        for q in range(2):
            question = " ".join(["who", "is", "it", *rng.sample(FILLERS, rng.randint(0, 3)),
                                 "?"])
            qa = {"id": f"{seed}-{p}-{q}", "question": question,
                  "answers": [] if impossible else [{"text": text, "answer_start": start}]}
            if impossible_rate:
                qa["is_impossible"] = impossible
            qas.append(qa)
        paragraphs.append({"context": context, "qas": qas})
    path.write_text(json.dumps({"version": "test", "data": [{"title": "gen",
                                                             "paragraphs": paragraphs}]}))
    return str(path)
