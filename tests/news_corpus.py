"""Real-looking English text for pre-training runs: write_corpus writes documents of 6-14
template sentences, each document about one topic (sport, business, politics, tech), which a
tiny BERT can learn; used by the demo's end-to-end test (tests/e2e/test_pretrain_end_to_end.py),
the README Quick start test and the packed pre-training run of tests/train/test_trainer.py."""

import random

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
