"""Google's released TF1 BERT checkpoints (bert_model.ckpt + bert_config.json + vocab.txt).

TensorFlow is used only to read the checkpoint (`tf.train.load_checkpoint`), imported the one
way the project imports it (`bertjax.tf_setup`): every accelerator hidden from it, its
start-up noise held back unless TF_CPP_MIN_LOG_LEVEL=0.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np
from etils import epath

from bertjax import paths
from bertjax.convert.mapping import (
    TF_ACTIVATIONS,
    ConversionError,
    config_from_reference,
    import_tensors,
    reference_specs,
)
from bertjax.models.bert.config import BertConfig

# Variables a pre-training checkpoint carries besides the model: optimizer slots and counters
# (the reference AdamWeightDecayOptimizer names its slots adam_m / adam_v).
_OPTIMIZER_SUFFIXES = ("/adam_m", "/adam_v", "/Adam", "/Adam_1", "/Momentum", "/LAMB",
                       "/LAMB_1", "/ExponentialMovingAverage")
_OPTIMIZER_NAMES = ("global_step", "beta1_power", "beta2_power", "good_steps",
                    "current_loss_scale", "loss_scale", "_CHECKPOINTABLE_OBJECT_GRAPH")


class CheckpointTensors(Mapping):
    """name → tensor of a TF checkpoint, each read only when asked for."""

    def __init__(self, path: str):
        from bertjax.tf_setup import import_tensorflow

        tf = import_tensorflow()  # CPU only, its start-up noise held back
        try:
            self._reader = tf.train.load_checkpoint(path)
        except (ValueError, tf.errors.OpError) as e:
            first_line = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise ConversionError(f"--checkpoint {path}: cannot read a TF checkpoint "
                                  f"({first_line})") from e
        self._shapes = self._reader.get_variable_to_shape_map()

    def __getitem__(self, name: str) -> np.ndarray:
        if name not in self._shapes:
            raise KeyError(name)
        return np.asarray(self._reader.get_tensor(name))

    def __iter__(self) -> Iterator[str]:
        return iter(self._shapes)

    def __len__(self) -> int:
        return len(self._shapes)


def read_config(path: str | epath.Path) -> BertConfig:
    """BertConfig from a reference bert_config.json."""
    path = epath.Path(path)
    if not path.exists():
        raise ConversionError(f"--config {path} does not exist")
    values = paths.read_json_object(path, ConversionError, f"--config {path}")
    return config_from_reference(values, str(path), TF_ACTIVATIONS)


def skip_reason(name: str) -> str:
    if name in _OPTIMIZER_NAMES or name.endswith(_OPTIMIZER_SUFFIXES):
        return "optimizer state"
    return "not a BertForPreTraining parameter"


def read_tf_checkpoint(
    checkpoint: str, config: BertConfig
) -> tuple[dict[str, Any], dict[str, str]]:
    """(params, {skipped variable: why}) from a TF1 checkpoint."""
    tensors = CheckpointTensors(checkpoint)
    if "bert/embeddings/word_embeddings" not in tensors and any(
        ".ATTRIBUTES" in name for name in tensors
    ):
        raise ConversionError(
            f"--checkpoint {checkpoint} is a TF2 object-based checkpoint; only TF1 "
            "name-based BERT checkpoints (bert/embeddings/word_embeddings, ...) are supported"
        )
    params, unused = import_tensors(
        reference_specs(config), tensors, lambda s: s.tf_name, lambda s: s.tf_transposed,
        f"--checkpoint {checkpoint}", config,
    )
    return params, {name: skip_reason(name) for name in unused}
