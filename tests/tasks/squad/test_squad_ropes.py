"""The ROPES demo-data converter (bertjax/demos/ropes.py) on a small task.json in the source's
layout: labels split, trailing period removed, whole-word location (story first, then
background), drops, paragraphs/articles, ids, and the output readable by the SQuAD reader."""

import hashlib
import json
import subprocess
import sys

from bertjax.demos import ropes
from bertjax.tasks.squad import readers

BG = "Warm air rises. Cold air sinks."
EXAMPLES = [
    {"input": f"Background Paragraph: {BG} \nStory: Town A is warm. Town B is cold. \n"
              "Question: Which town has rising air?", "target": ["Town A."]},
    {"input": f"Background Paragraph: {BG} \nStory: Town A is warm. Town B is cold. \n"
              "Question: Does cold air rise or sink?", "target": ["sink"]},  # "sinks" only
    {"input": f"Background Paragraph: {BG} \nStory: Town A is warm. Town B is cold. \n"
              "Question: What does cold air do?", "target": ["Cold air sinks."]},  # background
    {"input": f"Background Paragraph: {BG} \nStory: Lake C is calm. \n"
              "Question: more or less?", "target": ["more"]},  # not in the context
]


def test_ropes_conversion(tmp_path):
    source = tmp_path / "task.json"
    source.write_text(json.dumps({"examples": EXAMPLES}))
    result = subprocess.run([sys.executable, "-m", "bertjax.demos.ropes", f"--source={source}",
                             f"--output_dir={tmp_path / 'out'}"], capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    context = BG + "\nTown A is warm. Town B is cold."
    split = "dev" if ropes.is_dev(context) else "train"
    examples = readers.read_squad_json(str(tmp_path / "out" / f"{split}.json"))
    assert [(e.question, e.answers) for e in examples] == [
        ("Which town has rising air?", [("Town A", len(BG) + 1)]),
        ("What does cold air do?", [("Cold air sinks", BG.index("Cold"))])]
    assert examples[0].context == context
    assert examples[0].qas_id == hashlib.sha1(EXAMPLES[0]["input"].encode()).hexdigest()[:24]
    data = json.loads((tmp_path / "out" / f"{split}.json").read_text())
    assert data["data"][0]["title"] == "ropes_bg_" + hashlib.sha1(BG.encode()).hexdigest()[:10]
