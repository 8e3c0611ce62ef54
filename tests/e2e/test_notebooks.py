"""The Colab notebooks in notebooks/, executed top to bottom on the CPU at toy size with
nbclient (offline: a corpus from the standard library's docstrings, a random Hugging Face
BERT, inline sentiment sentences), so that they never rot."""

from __future__ import annotations

import json
import statistics

import nbformat
import pytest
from conftest import ROOT
from nbclient import NotebookClient

NOTEBOOKS = ROOT / "notebooks"


def execute(name: str, workdir, monkeypatch) -> nbformat.NotebookNode:
    notebook = nbformat.read(NOTEBOOKS / name, as_version=4)
    nbformat.validate(notebook)
    # Stored without outputs: what users open is the code, not a stale run.
    for cell in notebook.cells:
        if cell.cell_type == "code":
            assert cell.outputs == [] and cell.execution_count is None, cell.source[:60]
    monkeypatch.setenv("BERTJAX_NOTEBOOK_SIZE", "toy")
    monkeypatch.setenv("BERTJAX_NOTEBOOK_DIR", str(workdir))
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")
    client = NotebookClient(notebook, timeout=600, kernel_name="python3",
                            resources={"metadata": {"path": str(NOTEBOOKS)}})
    client.execute()  # raises CellExecutionError, with the cell and traceback, on any error
    return notebook


def outputs(notebook, kind: str) -> list:
    return [out for cell in notebook.cells if cell.cell_type == "code"
            for out in cell.outputs if out.output_type == kind]


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore")
@pytest.mark.extended
def test_pretrain_notebook(tmp_path, monkeypatch):
    notebook = execute("pretrain_tiny_bert.ipynb", tmp_path, monkeypatch)
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").open()]
    losses = [r["loss"] for r in records if r["split"] == "train"]
    assert len(losses) >= 20
    # It learned: the last steps' loss is below the first steps' (a random start is ~ln V).
    assert statistics.mean(losses[-5:]) < statistics.mean(losses[:5]) - 0.1, losses
    assert (tmp_path / "run" / "export" / "config.json").exists()
    # The loss plot was drawn, and the exported model filled in a masked word.
    assert any("image/png" in out.data for out in outputs(notebook, "display_data"))
    printed = "".join(out.text for out in outputs(notebook, "stream"))
    assert "Return a new [MASK] with the same elements. -> [" in printed


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore")
@pytest.mark.extended
def test_finetune_notebook(tmp_path, monkeypatch):
    execute("finetune_sentiment.ipynb", tmp_path, monkeypatch)
    summary = json.loads((tmp_path / "summary.json").read_text())
    # Converted weights reproduce the Hugging Face model they came from.
    assert summary["hf_difference"] < 1e-4
    assert summary["tokens"][0] == "[CLS]" and summary["tokens"][-1] == "[SEP]"
    assert summary["hidden"] == 64
    # Fine-tuning learned the sentiment words beyond the majority class.
    assert summary["dev_accuracy"] > summary["majority"]
    assert (tmp_path / "run" / "results.json").exists()
