"""The README as written: its laptop Quick start runs verbatim (slow), and every relative link
of README.md and docs/*.md points at a file, and a section, that exist."""

from __future__ import annotations

import csv
import json
import os
import random
import re
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import ROOT
from news_corpus import write_corpus

QUICKSTART_MARK = "<!-- quickstart -->"
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def quickstart_block(text: str) -> str:
    """The fenced bash block right after the README's `<!-- quickstart -->` mark."""
    assert text.count(QUICKSTART_MARK) == 1, f"README.md needs one {QUICKSTART_MARK} mark"
    after = text.split(QUICKSTART_MARK, 1)[1]
    match = re.match(r"\s*```bash\n(.*?)\n```", after, re.S)
    assert match, f"no ```bash block right after {QUICKSTART_MARK}"
    return match.group(1)


def write_reviews(directory: Path, seed: int = 0) -> dict[str, int]:
    """reviews/{train,dev}.csv with `text,label`: news-like sentences (the corpus's words),
    pos when a team won, neg when it lost."""
    r = random.Random(seed)
    teams = ("team", "club", "side", "player", "coach")
    rows = {}
    directory.mkdir()
    for split, n in (("train", 160), ("dev", 40)):
        with open(directory / f"{split}.csv", "w", newline="") as f:
            writer = csv.writer(f)
            writer.writerow(["text", "label"])
            for _ in range(n):
                label = r.choice(("pos", "neg"))
                verb = "won" if label == "pos" else "lost"
                writer.writerow([f"the {r.choice(teams)} {verb} the match on "
                                 f"{r.choice(('monday', 'friday', 'sunday'))} .", label])
        rows[split] = n
    return rows


@pytest.mark.slow
def test_readme_quickstart_runs_as_written(tmp_path):
    block = quickstart_block((ROOT / "README.md").read_text())
    (tmp_path / "corpus").mkdir()
    write_corpus(tmp_path / "corpus" / "news.txt", num_docs=60)
    rows = write_reviews(tmp_path / "reviews")
    # The configs are given by their path in the checkout (experiments/...).
    (tmp_path / "experiments").symlink_to(ROOT / "experiments")
    env = dict(os.environ,
               PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
               PYTHONPATH=str(ROOT), JAX_PLATFORMS=os.environ.get("JAX_PLATFORMS", "cpu"))
    proc = subprocess.run(["bash", "-c", "set -euo pipefail\n" + block], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]

    assert (tmp_path / "data" / "vocab" / "vocab.txt").stat().st_size > 0
    tfrecords = {p.parent.name for p in tmp_path.glob("data/*/*.tfrecord")}
    assert {"train_64", "train_256", "heldout_64", "heldout_256"} <= tfrecords, tfrecords
    run = tmp_path / "runs" / "pretrain"
    assert (run / "export" / "config.json").exists()
    evals = [json.loads(line) for line in (run / "metrics.jsonl").open()]
    held_out = {r["seq_len"] for r in evals if r["split"] == "eval"}
    assert held_out == {64, 256}, held_out  # both phases evaluated on the held-out pairs
    results = json.loads((tmp_path / "runs" / "reviews" / "results.json").read_text())
    assert "accuracy" in results["best"], results
    predictions = (tmp_path / "runs" / "reviews" / "predictions.jsonl").read_text().splitlines()
    assert len(predictions) == rows["dev"]
    assert {json.loads(p)["label"] for p in predictions} <= {"pos", "neg"}


# Links: [text](target), outside code; GitHub's heading anchors.
LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")


def prose(text: str) -> str:
    """The text without fenced code blocks and inline code spans."""
    text = re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)
    return re.sub(r"`[^`\n]*`", "", text)


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces to hyphens."""
    heading = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading.strip())  # a link's text
    heading = heading.lower().replace("`", "")
    heading = re.sub(r"[^\w\- ]", "", heading)
    return heading.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    found, seen = set(), {}
    for line in re.sub(r"^```.*?^```", "", path.read_text(), flags=re.S | re.M).splitlines():
        match = re.match(r"#{1,6}\s+(.*?)\s*#*\s*$", line)
        if match:
            base = slug(match.group(1))
            count = seen.get(base, 0)
            seen[base] = count + 1
            found.add(base if count == 0 else f"{base}-{count}")
    return found


def test_readme_and_docs_links_resolve():
    assert len(DOCS) > 1
    broken = []
    for doc in DOCS:
        for target in LINK.findall(prose(doc.read_text())):
            if re.match(r"[a-z]+:", target):  # https:, mailto:
                continue
            path, _, anchor = target.partition("#")
            file = (doc.parent / path).resolve() if path else doc
            if not file.exists():
                broken.append(f"{doc.relative_to(ROOT)}: {target} (no such file)")
            elif anchor and file.suffix == ".md" and anchor not in anchors(file):
                broken.append(f"{doc.relative_to(ROOT)}: {target} (no such section)")
    assert not broken, "\n".join(broken)


def test_slug_is_githubs():
    assert slug("Speed on CPU (`make bench`)") == "speed-on-cpu-make-bench"
    assert slug("Will it fit on a TPU slice? Ahead-of-time compiles on any machine") == \
        "will-it-fit-on-a-tpu-slice-ahead-of-time-compiles-on-any-machine"
    assert slug("Model options (`config.model.*`)") == "model-options-configmodel"
    assert slug("The rule for contributors: collectives on every host, files from host 0") == \
        "the-rule-for-contributors-collectives-on-every-host-files-from-host-0"
