"""Tiny float32 models and comparisons for the packed fine-tuning tests (config.data.pack:
tests/tasks/classification/test_packed.py, tests/tasks/tagging/test_packed_tagging.py)."""

import jax
import numpy as np

from bertjax.models import BertConfig
from bertjax.models.modernbert import ModernConfig
from bertjax.tasks import base

VOCAB = 64


def bert_config():
    return BertConfig(vocab_size=VOCAB, hidden_size=32, num_layers=2, num_heads=4,
                      intermediate_size=64, max_position_embeddings=64,
                      hidden_dropout_prob=0.0, attention_dropout_prob=0.0)


def modern_config():
    # A local window shorter than the rows: the local layers' masks meet the packing too.
    return ModernConfig(vocab_size=VOCAB, hidden_size=32, num_layers=3, num_heads=2,
                        intermediate_size=48, local_attention=8, pad_token_id=0,
                        max_position_embeddings=64)


def loss_fn(task, model):
    """The fine-tuning job's loss of `task` over `model` (bertjax/tasks/base.py)."""
    return lambda params, batch, rng, denominators=None: base._loss(
        params, batch, rng, denominators, task=task, model=model)


def assert_trees_close(a, b, rtol, atol):
    for (path, x), y in zip(jax.tree_util.tree_leaves_with_path(a), jax.tree.leaves(b)):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=rtol, atol=atol,
                                   err_msg=jax.tree_util.keystr(path))
