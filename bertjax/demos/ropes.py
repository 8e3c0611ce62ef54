r"""ROPES (Reasoning Over Paragraph Effects in Situations; CC BY 4.0 per its authors) as
extractive QA in the SQuAD v1.1 layout: the demo data of `make squad_demo`.

Source: the Natural Instructions re-packaging inside the `bigbench` 1.0.0 sdist,
`bigbench/benchmark_tasks/natural_instructions/subtask061_ropes_answer_generation/task.json`
(6,500 examples); only that member is read from the archive.

  python -m bertjax.demos.ropes --source=data/bigbench-1.0.0.tar.gz --output_dir=data/ropes

Conversion: each input is split at its "Background Paragraph:", "Story:" and "Question:"
labels; context = background, a newline, then the story; the source's trailing period is
removed from the answer, which is then located as a whole-word exact match, first in the story,
else in the background. Examples whose answer is not in the context, or only inside a longer
word, are dropped. Questions on one context form a paragraph; paragraphs sharing a background
form an article (title `ropes_bg_` + SHA-1 of the background, 10 hex digits); a question's id
is the SHA-1 of its input (24 hex digits). Split by paragraph: the first 8 hex digits of the
context's SHA-256, as an integer, mod 100 < 15 go to dev. Writes train.json and dev.json
(4,866 and 804 questions).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import tarfile

from absl import flags

from bertjax.errors import DataError

MEMBER = ("bigbench-1.0.0/bigbench/benchmark_tasks/natural_instructions/"
          "subtask061_ropes_answer_generation/task.json")
_LABELS = re.compile(r"^Background Paragraph:(.*)\nStory:(.*)\nQuestion:(.*)$", re.DOTALL)


def read_task(source: str) -> list[dict]:
    """The task's examples ({"input", "target"}), from the sdist or an extracted task.json."""
    if not os.path.exists(source):
        raise DataError(f"{source}: no such file")
    if source.endswith(".json"):
        with open(source, encoding="utf-8") as f:
            return json.load(f)["examples"]
    with tarfile.open(source, "r:gz") as archive:
        try:
            member = archive.extractfile(MEMBER)
        except KeyError as e:
            raise DataError(f"{source}: no member {MEMBER}") from e
        return json.loads(member.read().decode("utf-8"))["examples"]


def locate(answer: str, text: str) -> int:
    """Start of the first whole-word occurrence of `answer` in `text`, or -1."""
    match = re.search(r"(?<!\w)" + re.escape(answer) + r"(?!\w)", text)
    return match.start() if match else -1


def convert_example(example: dict) -> tuple[str, str, str, dict] | None:
    """(background, story, context, qa) or None when the answer cannot be located."""
    match = _LABELS.match(example["input"])
    if match is None:
        raise DataError(f"{MEMBER}: an input without the Background/Story/Question labels: "
                        f"{example['input'][:60]!r}")
    background, story, question = (part.strip() for part in match.groups())
    answer = example["target"][0] if isinstance(example["target"], list) else example["target"]
    answer = answer.strip().removesuffix(".")
    context = background + "\n" + story
    at = locate(answer, story)
    at = len(background) + 1 + at if at >= 0 else locate(answer, background)
    if not answer or at < 0:
        return None
    qid = hashlib.sha1(example["input"].encode("utf-8")).hexdigest()[:24]
    return background, story, context, {"id": qid, "question": question,
                                        "answers": [{"text": answer, "answer_start": at}]}


def is_dev(context: str) -> bool:
    return int(hashlib.sha256(context.encode("utf-8")).hexdigest()[:8], 16) % 100 < 15


def convert(examples: list[dict]) -> dict[str, dict]:
    """{"train": squad dict, "dev": squad dict}; articles and paragraphs in first-seen order."""
    splits: dict[str, dict[str, dict[str, list]]] = {"train": {}, "dev": {}}
    for example in examples:
        converted = convert_example(example)
        if converted is None:
            continue
        background, _, context, qa = converted
        title = "ropes_bg_" + hashlib.sha1(background.encode("utf-8")).hexdigest()[:10]
        article = splits["dev" if is_dev(context) else "train"].setdefault(title, {})
        article.setdefault(context, []).append(qa)
    return {name: {"version": "ropes-v1.1-format", "data": [
        {"title": title, "paragraphs": [{"context": c, "qas": qas} for c, qas in paras.items()]}
        for title, paras in articles.items()]} for name, articles in splits.items()}


_SOURCE = flags.DEFINE_string("source", None, "bigbench-1.0.0.tar.gz (or its task.json)")
_OUTPUT = flags.DEFINE_string("output_dir", "data/ropes", "where train.json, dev.json go")


def main(argv):
    del argv
    from bertjax import cli

    source = cli.require(_SOURCE.value, "--source", "data/bigbench-1.0.0.tar.gz")
    splits = convert(read_task(source))
    os.makedirs(_OUTPUT.value, exist_ok=True)
    for name, data in splits.items():
        path = os.path.join(_OUTPUT.value, f"{name}.json")
        with open(path + ".tmp", "w", encoding="utf-8") as f:
            json.dump(data, f, ensure_ascii=False)
        os.replace(path + ".tmp", path)  # whole file or nothing
        count = sum(len(p["qas"]) for a in data["data"] for p in a["paragraphs"])
        print(f"wrote {path}: {count} questions")


if __name__ == "__main__":
    from bertjax import cli

    cli.run(main)
