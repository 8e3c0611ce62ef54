"""`python -m bertjax.benchmarks.accelerator`: its rows' FLOPs, batches and attention paths,
and (slow) the whole command end to end on this machine's CPU beside transformers."""

import json

import numpy as np
import pytest
from conftest import run_python

from bertjax.benchmarks import accelerator
from bertjax.models import BertConfig
from bertjax.models.bert.flops import forward_flops
from bertjax.models.kernels.attention import attention_path
from bertjax.train.flops import peak_flops_per_device, train_flops_per_sequence


def test_row_flops_are_the_training_cores():
    cfg = BertConfig.from_preset("base")
    pretrain, finetune, predict = (r for r in accelerator.ROWS if r.kind != "pretrain" or
                                   r.seq_len == 512)
    assert accelerator.model_flops(pretrain, cfg) == train_flops_per_sequence(cfg, 512, 80)
    forward = forward_flops(cfg, 128, 0, pooled_only=True)
    assert accelerator.model_flops(finetune, cfg) == 3 * forward
    assert accelerator.model_flops(predict, cfg) == forward


@pytest.mark.parametrize("kind", ["NVIDIA H100 80GB HBM3", "NVIDIA H100 PCIe", "NVIDIA H200",
                                  "NVIDIA L40S", "NVIDIA L4", "TPU v5 lite", "cpu"])
def test_peaks_match_the_longest_device_kind_key(kind):
    expected = {"NVIDIA H100 80GB HBM3": 989, "NVIDIA H100 PCIe": 756, "NVIDIA H200": 989,
                "NVIDIA L40S": 362, "NVIDIA L4": 121, "TPU v5 lite": 197, "cpu": None}[kind]
    peak = peak_flops_per_device(kind)
    assert peak == (expected and expected * 1e12)


def test_batches_are_the_rows_shapes_with_masked_positions_inside_the_row():
    cfg = BertConfig.from_preset("tiny")
    for row in accelerator.ROWS:
        batch = accelerator.batch_of(row, cfg, 3)
        assert batch["input_ids"].shape == (3, row.seq_len)
        assert batch["input_ids"].max() < cfg.vocab_size
        if row.kind == "pretrain":
            positions = batch["masked_lm_positions"]
            assert positions.shape == (3, row.predictions)
            assert (np.diff(positions, axis=1) > 0).all() and positions.min() >= 1
            np.testing.assert_array_equal(
                np.take_along_axis(batch["input_ids"], positions, 1), batch["masked_lm_ids"])
        else:
            assert set(batch["labels"]) <= set(range(accelerator.LABELS))


def test_attention_path_names_what_auto_runs():
    cfg = BertConfig.from_preset("tiny", attention_dropout_prob=0.1)
    assert attention_path(cfg, True, "gpu") == "einsum (dropout)"
    assert attention_path(cfg, False, "gpu") == "xla fused"
    assert attention_path(cfg, False, "cpu") == "einsum, heads first"
    no_dropout = BertConfig.from_preset("tiny", attention_dropout_prob=0.0)
    # On a TPU the flash kernels, where they take the heads (2 of 64 fill a tile; 3 do not).
    assert attention_path(no_dropout, True, "tpu") == "flash (Pallas TPU)"
    assert attention_path(cfg, True, "tpu") == "flash (Pallas TPU)"
    odd = BertConfig(hidden_size=192, num_heads=3, attention_dropout_prob=0.0)
    assert attention_path(odd, True, "tpu") == "xla fused"
    explicit = BertConfig.from_preset("tiny", attention_impl="cudnn", attention_dropout_prob=0.0)
    assert attention_path(explicit, False, "gpu") == "cudnn"
    kernels = BertConfig.from_preset("tiny", attention_impl="flash")
    assert attention_path(kernels, True, "gpu") == "flash (Pallas GPU)"
    assert attention_path(kernels, True, "tpu") == "flash (Pallas TPU)"


# The command with TensorFlow made unimportable, as on a GPU image that has none.
# The command with TensorFlow made unimportable (None in sys.modules: `import` fails, and
# importlib.util.find_spec says absent), as on a GPU image that has none.
WITHOUT_TENSORFLOW = """
import runpy, sys

for name in ("tensorflow", "tensorflow_text", "tensorflow_datasets"):
    sys.modules[name] = None
sys.argv = ["accelerator"] + sys.argv[1:]
runpy.run_module("bertjax.benchmarks.accelerator", run_name="__main__")
"""


@pytest.mark.slow
@pytest.mark.extended
def test_the_command_runs_every_row_beside_transformers_without_tensorflow(tmp_path):
    """--quick on the tiny preset, one timed step, TensorFlow unimportable: every row measured
    on both sides, the Markdown and JSON tables written, MFU left out on a CPU (no known
    peak)."""
    done = run_python(["-c", WITHOUT_TENSORFLOW, "--quick", "--models=tiny", "--steps=1",
                       f"--output={tmp_path}"], timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    record = json.loads((tmp_path / "accelerator.json").read_text())
    rows = record["rows"]
    assert [r["row"] for r in rows] == [r.name for r in accelerator.ROWS]
    for r, batch in zip(rows, accelerator.CPU_BATCHES, strict=True):
        assert r["batch"] == batch and r["torch_batch"] == batch
        assert r["seq_per_s"] > 0 and r["torch_seq_per_s"] > 0 and r["device_gib"] > 0
        assert r["mfu"] is None
    table = (tmp_path / "accelerator.md").read_text()
    assert table.count("| tiny |") == len(accelerator.ROWS) and "x |" in table
