"""A tiny pre-training setup for train-step tests, in the test process and in the Python
subprocesses of tests/train/test_train_step.py (multi-device meshes): tiny_config (the tiny
experiment config, one float32 layer, vocab 64), make_step (its initial train state and
jitted train step on a mesh) and synthetic_batch (a random pre-training batch)."""

import jax
import numpy as np

from bertjax.models import BertConfig, BertForPreTraining
from bertjax.tasks import pretraining
from bertjax.train import sharding as sharding_lib
from bertjax.train import step as step_lib
from bertjax.train.optimizer import make_optimizer
from experiments import pretrain as pretrain_experiment


def synthetic_batch(cfg, batch_size, seq_len, max_predictions, seed=0):
    r = np.random.default_rng(seed)
    ids = r.integers(5, cfg.vocab_size, (batch_size, seq_len)).astype(np.int32)
    positions = np.stack([r.choice(np.arange(1, seq_len), max_predictions, replace=False)
                          for _ in range(batch_size)]).astype(np.int32)
    return {
        "input_ids": ids,
        "input_mask": np.ones_like(ids),
        "segment_ids": np.repeat((np.arange(seq_len)[None] >= seq_len // 2), batch_size, 0)
        .astype(np.int32),
        "masked_lm_positions": positions,
        "masked_lm_ids": np.take_along_axis(ids, positions, 1),
        "masked_lm_weights": np.ones(positions.shape, np.float32),
        "next_sentence_labels": r.integers(0, 2, batch_size).astype(np.int32),
    }


def make_step(config, mesh=None, grad_accum_steps=1):
    cfg = BertConfig.from_dict(config.model)
    model = BertForPreTraining(cfg)
    tx, schedule = make_optimizer(config.optimizer, config.train.num_train_steps)
    mesh = mesh or sharding_lib.make_mesh(config.mesh)
    init, loss = pretraining.step_fns(model)
    _, state_sharding = step_lib.state_shardings(init, tx, mesh, config.logical_axis_rules)
    state = step_lib.create_train_state(init, tx, jax.random.key(0), state_sharding)
    step = step_lib.jit_train_step(loss, tx, schedule, state_sharding,
                                   sharding_lib.batch_sharding(mesh, config.logical_axis_rules),
                                   grad_accum_steps=grad_accum_steps,
                                   rules=config.logical_axis_rules)
    return state, step


def tiny_config(**model_overrides):
    config = pretrain_experiment.get_config("tiny")
    config.model.update(dict(dtype="float32", num_layers=1, vocab_size=64), **model_overrides)
    config.optimizer.warmup_steps = 2
    config.optimizer.learning_rate = 5e-3
    config.train.num_train_steps = 100
    return config
