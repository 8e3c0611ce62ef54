"""Real-looking English text for pre-training runs: write_corpus writes documents of 6-14
template sentences, each document about one topic (sport, business, politics, tech), which a
tiny BERT can learn; used by the demo's end-to-end test (tests/e2e/test_pretrain_end_to_end.py),
the README Quick start test and the packed pre-training runs (write_segments) of
tests/train/test_trainer.py and tests/tasks/pretraining/test_modern_pretraining.py."""

import random
import re

TOPICS = {
    "sport": ("team", "coach", "match", "season", "league", "goal", "player", "stadium"),
    "business": ("market", "company", "profit", "shares", "bank", "economy", "firm", "deal"),
    "politics": ("minister", "election", "party", "vote", "government", "policy", "law", "mp"),
    "tech": ("software", "phone", "users", "network", "computer", "device", "web", "data"),
}
VERBS = ("said", "expects", "reported", "announced", "wants", "rejected", "won", "lost", "made")
ADJECTIVES = ("new", "big", "former", "british", "strong", "weak", "last", "major", "local")
TEMPLATES = (
    "the {adj} {n1} {verb} the {n2} on {day} .",
    "a {n1} {verb} that the {n2} will {verb2} {number} {n3} .",
    "\"we {verb} the {n1},\" the {adj} {n2} said .",
    "the {n1} and the {n2} {verb} a {adj} {n3} in {month} .",
)
DAYS = ("monday", "tuesday", "friday", "sunday")
MONTHS = ("january", "march", "june", "october")


def write_corpus(path, num_docs=400, seed=0):
    """Documents of 6-14 sentences, each about one topic: learnable, English-looking text."""
    r = random.Random(seed)
    with open(path, "w") as f:
        for _ in range(num_docs):
            words = TOPICS[r.choice(sorted(TOPICS))]
            for _ in range(r.randint(6, 14)):
                f.write(r.choice(TEMPLATES).format(
                    adj=r.choice(ADJECTIVES), n1=r.choice(words), n2=r.choice(words),
                    n3=r.choice(words), verb=r.choice(VERBS), verb2=r.choice(("win", "lose")),
                    day=r.choice(DAYS), month=r.choice(MONTHS), number=r.randint(2, 99)) + "\n")
            f.write("\n")


SPECIALS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]


def write_segments(root, num_docs=150, max_seq_length=32, extra_args=()):
    """root/corpus.txt (write_corpus), root/vocab.txt (the specials and every word and
    punctuation mark of the lower-cased corpus) and root/segments, the packed pre-training
    shards of `python -m data_pipeline.create_segments` (2 shards); returns (the segments
    directory, the vocabulary's size, the command's stdout)."""
    from conftest import run_python

    write_corpus(root / "corpus.txt", num_docs=num_docs)
    text = (root / "corpus.txt").read_text().lower()
    words = sorted(set(re.findall(r"\w+|[^\w\s]", text)))
    (root / "vocab.txt").write_text("\n".join(SPECIALS + words) + "\n")
    data = root / "segments"
    proc = run_python(["-m", "data_pipeline.create_segments", f"--input={root / 'corpus.txt'}",
                       f"--vocab={root / 'vocab.txt'}", f"--output_dir={data}",
                       f"--max_seq_length={max_seq_length}", "--num_shards=2", *extra_args])
    assert proc.returncode == 0, proc.stderr[-3000:]
    return data, len(SPECIALS) + len(words), proc.stdout
