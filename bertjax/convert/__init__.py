"""Checkpoint interop: Google's TF1 checkpoints and Hugging Face BERT in, Hugging Face out.

    python -m bertjax.convert from_tf --checkpoint PATH/bert_model.ckpt \
        --config PATH/bert_config.json --vocab PATH/vocab.txt --output DIR
    python -m bertjax.convert from_hf --input HF_DIR --output DIR
    python -m bertjax.convert to_hf --input DIR --output HF_DIR

DIR is a bertjax checkpoint directory, written and read by `bertjax.checkpoint_dir` (which never
imports this package); load it with `bertjax.load_pretrained(DIR)`. `mapping` holds the one
table of tensor names and layouts. Nothing here imports TensorFlow or torch at import time.
"""

from bertjax.convert.mapping import ConversionError

__all__ = ["ConversionError"]
