"""Gradient accumulation is one big batch (bertjax/train/step.py, `denominators`).

Each case is a batch whose k = 4 strided micro-batches carry different numbers of real
predictions / labels / filler rows. One step with grad_accum_steps=4 must give the loss, every
metric, the gradient and the updated params of grad_accum_steps=1 on the same batch; the 1 / k
mean of micro-batch means (the rule for jobs without denominators) must not. Without
accumulation the losses are bit for bit the formulas the losses had before denominators.
"""

import functools

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
import pytest

from bertjax.models import BertConfig, BertForPreTraining, pretraining_loss
from bertjax.tasks import base
from bertjax.tasks.classification.task import SequenceTask, classification_loss
from bertjax.tasks.pretraining import objective
from bertjax.tasks.squad.task import SquadTask, span_loss
from bertjax.tasks.tagging.feature_based import FeatureBasedTask
from bertjax.tasks.tagging.task import TokenClassificationTask, token_loss
from bertjax.train import sharding as sharding_lib
from bertjax.train import step as step_lib
from experiments import pretrain as pretrain_experiment

BATCH, SEQ, PREDICTIONS, K = 8, 12, 4, 4


def model_config(**overrides) -> BertConfig:
    return BertConfig.from_preset("tiny", num_layers=1, vocab_size=64, dtype="float32",
                                  hidden_size=32, num_heads=2, intermediate_size=64,
                                  max_position_embeddings=16,
                                  hidden_dropout_prob=0.0, attention_dropout_prob=0.0,
                                  **overrides)


def recording(tx):
    """`tx` that also keeps the step's gradient in its state (read back as opt_state[0])."""

    def update(grads, state, params=None):
        updates, inner = tx.update(grads, state[1], params)
        return updates, (grads, inner)

    return optax.GradientTransformation(
        lambda params: (jax.tree.map(jnp.zeros_like, params), tx.init(params)), update)


def run_steps(init_params, loss_fn, runs):
    """[(gradient, metrics, updated params)] of one step from the same state for each
    (denominators, grad_accum_steps, batch) of `runs`. The optimizer is SGD: the updated params
    are linear in the gradient (Adam's first step is about lr · sign(g), which a rounding of a
    near-zero gradient element flips)."""
    config = pretrain_experiment.get_config("tiny")
    schedule = optax.constant_schedule(1e-2)
    tx = recording(optax.sgd(schedule))
    mesh = sharding_lib.make_mesh({"data": 1, "fsdp": 1, "tensor": 1}, jax.devices()[:1])
    rules = config.logical_axis_rules
    _, state_sharding = step_lib.state_shardings(init_params, tx, mesh, rules)
    state = step_lib.create_train_state(init_params, tx, jax.random.key(0), state_sharding)
    out = []
    for denominators, grad_accum_steps, batch in runs:
        step = step_lib.jit_train_step(loss_fn, tx, schedule, state_sharding,
                                       sharding_lib.batch_sharding(mesh, rules),
                                       grad_accum_steps, denominators)
        new, metrics = step(jax.tree.map(jnp.copy, state), batch)  # the state is donated
        out.append((jax.device_get(new.opt_state[0]), jax.device_get(metrics),
                    jax.device_get(new.params)))
    return out


def relative_difference(a, b) -> float:
    """|a - b| / |b| over all leaves of two trees (float64 global norms)."""
    diff = sum(float(np.sum((np.asarray(x, np.float64) - np.asarray(y, np.float64)) ** 2))
               for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True))
    norm = sum(float(np.sum(np.asarray(y, np.float64) ** 2)) for y in jax.tree.leaves(b))
    return (diff / norm) ** 0.5


def assert_trees_close(a, b, rtol=1e-5):
    """Element by element within rtol, with an absolute floor of rtol × the largest |b|: a
    gradient that is zero in exact arithmetic (the attention key bias) is rounding noise."""
    scale = max(float(np.max(np.abs(y))) for y in jax.tree.leaves(b))
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_allclose(x, y, rtol=rtol, atol=rtol * scale)


def micro_sums(values) -> list[float]:
    """Sums of `values` [batch, ...] over the strided micro-batches of step._micro_batches."""
    values = np.asarray(values, np.float64).reshape(BATCH, -1).sum(-1)
    return [float(values[i::K].sum()) for i in range(K)]


# ---------------------------------------------------------------------------------------------
# Batches (micro-batch i = rows i, i + 4)


def token_rows(r, cfg, lengths, shape=(BATCH, SEQ)):
    ids = r.integers(5, cfg.vocab_size, shape).astype(np.int32)
    mask = (np.arange(shape[-1]) < np.asarray(lengths)[..., None]).astype(np.int32)
    return {"input_ids": ids * mask, "input_mask": mask,
            "segment_ids": np.zeros(shape, np.int32)}


LENGTHS = np.array([12, 3, 7, 12, 5, 2, 12, 9])
# Real (weight-1) rows: micro-batches of 2, 1, 1 and 1 real rows.
ROW_WEIGHTS = np.array([1, 1, 1, 1, 1, 0, 0, 0], np.float32)


def pretraining_batch(cfg, r, packed=False, ltr=False):
    batch = token_rows(r, cfg, LENGTHS)
    # 8, 0, 3 and 4 masked-LM predictions in the four micro-batches.
    counts = np.array([4, 0, 1, 3, 4, 0, 2, 1])
    positions = np.stack([r.choice(np.arange(1, SEQ), PREDICTIONS, replace=False)
                          for _ in range(BATCH)]).astype(np.int32)
    batch.update(
        masked_lm_positions=positions,
        masked_lm_ids=np.take_along_axis(batch["input_ids"], positions, 1),
        masked_lm_weights=(np.arange(PREDICTIONS) < counts[:, None]).astype(np.float32),
        next_sentence_labels=r.integers(0, 2, BATCH).astype(np.int32))
    if packed or ltr:
        del batch["next_sentence_labels"]
        split = (np.arange(SEQ) >= 5).astype(np.int32) + 1
        batch["packing_ids"] = (split[None] * batch["input_mask"]).astype(np.int32)
    if ltr:
        for key in ("masked_lm_positions", "masked_lm_ids", "masked_lm_weights"):
            del batch[key]
    return batch


def pretraining_case(packed=False, ltr=False):
    cfg = model_config(causal=ltr)
    batch = pretraining_batch(cfg, np.random.default_rng(0), packed, ltr)
    init, loss = objective.step_fns(BertForPreTraining(cfg), packed=packed, ltr=ltr)
    denominators = functools.partial(objective.loss_denominators, packed=packed, ltr=ltr)
    weights = (objective.next_token_targets(batch)["masked_lm_weights"] if ltr
               else batch["masked_lm_weights"])
    return init, loss, denominators, batch, np.asarray(weights)


def task_config(**task):
    return ml_collections.ConfigDict({
        "task": {"family": "files", "name": "files", "bilstm_units": 0, "label_scheme": "iob2",
                 "version_2": False, "doc_stride": 4, "max_query_length": 4, "n_best_size": 5,
                 "max_answer_length": 5, **task},
        "feature_based": {"variant": "last", "lstm_units": 8, "lstm_layers": 1},
        "min_bucket_length": SEQ, "train": {"batch_size": BATCH}})


def task_case(task, batch, cfg=None, weights=None):
    """(init, loss, denominators, batch, weights) of a fine-tuning task, as FineTuningJob
    builds them."""
    cfg = cfg or model_config()
    model = task.model(cfg)
    init = lambda rng: model.init(rng, *task.init_inputs())["params"]  # noqa: E731
    loss = functools.partial(base._loss, task=task, model=model)
    return init, loss, task.denominators, batch, ROW_WEIGHTS if weights is None else weights


def sequence_case(kind):
    r = np.random.default_rng(1)
    task = SequenceTask(task_config())
    labels = {"classification": ("a", "b", "c"), "regression": (),
              "multiple_choice": ("0", "1")}[kind]
    task._declare(kind, labels, ("accuracy",))
    if kind == "multiple_choice":
        batch = token_rows(r, model_config(), np.stack([LENGTHS, LENGTHS[::-1]], -1),
                           (BATCH, 2, SEQ))
        batch["labels"] = r.integers(0, 2, BATCH).astype(np.int32)
    else:
        batch = token_rows(r, model_config(), LENGTHS)
        batch["labels"] = (r.normal(size=BATCH).astype(np.float32) if kind == "regression"
                           else r.integers(0, 3, BATCH).astype(np.int32))
    batch.update(weights=ROW_WEIGHTS, example_index=np.arange(BATCH, dtype=np.int32))
    return task_case(task, batch)


def squad_case():
    r = np.random.default_rng(2)
    batch = token_rows(r, model_config(), LENGTHS)
    batch.update(start_positions=r.integers(0, SEQ, BATCH).astype(np.int32),
                 end_positions=r.integers(0, SEQ, BATCH).astype(np.int32),
                 weights=ROW_WEIGHTS, example_index=np.arange(BATCH, dtype=np.int32))
    return task_case(SquadTask(task_config()), batch)


LABEL_WEIGHTS = (np.arange(SEQ)[None] < np.arange(1, BATCH + 1)[:, None]).astype(np.float32)


def tagging_case():
    r = np.random.default_rng(3)
    task = TokenClassificationTask(task_config())
    task._declare(("O", "B-X", "I-X"))
    batch = token_rows(r, model_config(), LENGTHS)
    batch.update(label_ids=r.integers(0, 3, (BATCH, SEQ)).astype(np.int32),
                 label_weights=LABEL_WEIGHTS, example_index=np.arange(BATCH, dtype=np.int32))
    return task_case(task, batch, weights=LABEL_WEIGHTS)


def feature_based_case():
    r = np.random.default_rng(4)
    cfg = model_config()
    task = FeatureBasedTask(task_config())
    task.initial_params(cfg, None)
    task._declare(("O", "B-X", "I-X"))
    mask = (np.arange(SEQ)[None] < LENGTHS[:, None]).astype(np.int32)
    batch = {"features": r.normal(size=(BATCH, SEQ, 1, cfg.hidden_size)).astype(np.float32),
             "input_mask": mask,
             "label_ids": r.integers(0, 3, (BATCH, SEQ)).astype(np.int32),
             "label_weights": LABEL_WEIGHTS * mask,
             "example_index": np.arange(BATCH, dtype=np.int32)}
    return task_case(task, batch, cfg, weights=LABEL_WEIGHTS * mask)


CASES = {
    "mlm_nsp": pretraining_case,
    "mlm_packed": functools.partial(pretraining_case, packed=True),
    "ltr": functools.partial(pretraining_case, packed=True, ltr=True),  # ltr rows are packed
    "classification": functools.partial(sequence_case, "classification"),
    "regression": functools.partial(sequence_case, "regression"),
    "multiple_choice": functools.partial(sequence_case, "multiple_choice"),
    "squad": squad_case,
    "tagging": tagging_case,
    "feature_based": feature_based_case,
}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(CASES))
def test_accumulated_step_equals_one_batch(name):
    init, loss, denominators, batch, weights = CASES[name]()
    sums = micro_sums(weights)
    assert len(set(sums)) > 1, sums  # the micro-batches weigh differently
    (one_grads, one_metrics, one_params), (grads, metrics, params), (mean_grads, mean_metrics, _) \
        = run_steps(init, loss, [(denominators, 1, batch), (denominators, K, batch),
                                 (None, K, batch)])
    assert metrics.keys() == one_metrics.keys()
    for key in one_metrics:
        np.testing.assert_allclose(metrics[key], one_metrics[key], rtol=1e-5, atol=1e-7,
                                   err_msg=key)
    print(f"{name}: |g_4 - g_1| / |g_1| = {relative_difference(grads, one_grads):.2e}; "
          f"mean of means {relative_difference(mean_grads, one_grads):.2e}; loss "
          f"{abs(metrics['loss'] / one_metrics['loss'] - 1):.2e}, mean of means "
          f"{abs(mean_metrics['loss'] / one_metrics['loss'] - 1):.2e}")
    assert_trees_close(grads, one_grads)
    for x, y in zip(jax.tree.leaves(params), jax.tree.leaves(one_params), strict=True):
        np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-7)
    # The rule for jobs without denominators, the 1 / k mean of micro-batch means, differs.
    assert relative_difference(mean_grads, one_grads) > 1e-2
    assert abs(mean_metrics["loss"] - one_metrics["loss"]) > 1e-4 * abs(one_metrics["loss"])


# ---------------------------------------------------------------------------------------------
# Without accumulation: the numbers the losses gave before denominators, bit for bit


def old_pretraining_loss(outputs, batch, nsp_weight=1.0):
    mlm_logits = outputs["mlm_logits"].astype(jnp.float32)
    ids = batch["masked_lm_ids"].astype(jnp.int32)
    weights = batch["masked_lm_weights"].astype(jnp.float32)
    log_probs = jax.nn.log_softmax(mlm_logits, axis=-1)
    mlm_nll = -jnp.take_along_axis(log_probs, ids[..., None], axis=-1)[..., 0]
    weight_sum = jnp.sum(weights)
    mlm_loss = jnp.sum(mlm_nll * weights) / (weight_sum + 1e-5)
    mlm_correct = (jnp.argmax(mlm_logits, axis=-1) == ids).astype(jnp.float32)
    mlm_accuracy = jnp.sum(mlm_correct * weights) / jnp.maximum(weight_sum, 1e-5)
    nsp_logits = outputs["nsp_logits"].astype(jnp.float32)
    labels = batch["next_sentence_labels"].reshape(-1).astype(jnp.int32)
    nsp_log_probs = jax.nn.log_softmax(nsp_logits, axis=-1)
    nsp_loss = -jnp.mean(jnp.take_along_axis(nsp_log_probs, labels[:, None], axis=-1))
    nsp_accuracy = jnp.mean((jnp.argmax(nsp_logits, axis=-1) == labels).astype(jnp.float32))
    loss = mlm_loss + nsp_weight * nsp_loss
    return loss, {"loss": loss, "mlm_loss": mlm_loss, "mlm_accuracy": mlm_accuracy,
                  "nsp_loss": nsp_loss, "nsp_accuracy": nsp_accuracy}


def old_weighted_mean(values, weights):
    weights = weights.astype(jnp.float32)
    return jnp.sum(values * weights) / jnp.maximum(jnp.sum(weights), 1e-6)


def old_classification_loss(logits, labels, weights):
    logits = logits.astype(jnp.float32)
    labels = labels.reshape(-1).astype(jnp.int32)
    nll = -jnp.take_along_axis(jax.nn.log_softmax(logits, -1), labels[:, None], -1)[:, 0]
    correct = (jnp.argmax(logits, axis=-1) == labels).astype(jnp.float32)
    loss = old_weighted_mean(nll, weights)
    return loss, {"loss": loss, "accuracy": old_weighted_mean(correct, weights)}


def old_span_loss(start_logits, end_logits, start_positions, end_positions, weights):
    def nll(logits, positions):
        log_probs = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
        return -jnp.take_along_axis(log_probs, positions[:, None].astype(jnp.int32), -1)[:, 0]

    per_row = 0.5 * (nll(start_logits, start_positions) + nll(end_logits, end_positions))
    weights = weights.astype(jnp.float32)
    total = jnp.maximum(jnp.sum(weights), 1e-6)
    loss = jnp.sum(per_row * weights) / total
    hit = ((jnp.argmax(start_logits, -1) == start_positions)
           & (jnp.argmax(end_logits, -1) == end_positions)).astype(jnp.float32)
    return loss, {"loss": loss, "span_accuracy": jnp.sum(hit * weights) / total}


def old_token_loss(logits, labels, weights):
    logits = logits.astype(jnp.float32)
    log_probs = jax.nn.log_softmax(logits, axis=-1)
    nll = -jnp.take_along_axis(log_probs, labels[..., None].astype(jnp.int32), axis=-1)[..., 0]
    weights = weights.astype(jnp.float32)
    count = jnp.maximum(jnp.sum(weights), 1.0)
    loss = jnp.sum(nll * weights) / count
    correct = (jnp.argmax(logits, axis=-1) == labels).astype(jnp.float32)
    return loss, {"loss": loss, "accuracy": jnp.sum(correct * weights) / count}


def assert_bitwise(new, old, *args):
    for fn in (lambda f: f(*args), lambda f: jax.jit(f)(*args)):  # eager and jitted
        a, b = jax.device_get(fn(new)), jax.device_get(fn(old))
        for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
            np.testing.assert_array_equal(x, y)


def test_losses_without_denominators_are_bitwise_the_old_formulas():
    """Bitwise, but for the MLM loss: its fused cross-entropy (log-sum-exp minus the label's
    logit) rounds differently from log_softmax, within float32 rounding."""
    r = np.random.default_rng(5)
    batch = pretraining_batch(model_config(), r)
    outputs = {"mlm_logits": r.normal(size=(BATCH, PREDICTIONS, 64)).astype(np.float32),
               "nsp_logits": r.normal(size=(BATCH, 2)).astype(np.float32)}
    new, old = (jax.device_get(f(outputs, batch, 0.7)[1])
                for f in (pretraining_loss, old_pretraining_loss))
    for key in old:
        np.testing.assert_allclose(new[key], old[key], rtol=1e-6, err_msg=key)
        if not key.startswith("mlm_loss") and key != "loss":
            np.testing.assert_array_equal(new[key], old[key], err_msg=key)
    logits = r.normal(size=(BATCH, 3)).astype(np.float32)
    labels = r.integers(0, 3, BATCH).astype(np.int32)
    assert_bitwise(classification_loss, old_classification_loss, logits, labels, ROW_WEIGHTS)
    start, end = (r.normal(size=(BATCH, SEQ)).astype(np.float32) for _ in range(2))
    positions = [r.integers(0, SEQ, BATCH).astype(np.int32) for _ in range(2)]
    assert_bitwise(span_loss, old_span_loss, start, end, *positions, ROW_WEIGHTS)
    tags = r.normal(size=(BATCH, SEQ, 3)).astype(np.float32)
    tag_ids = r.integers(0, 3, (BATCH, SEQ)).astype(np.int32)
    assert_bitwise(token_loss, old_token_loss, tags, tag_ids, LABEL_WEIGHTS)


def test_denominators_of_the_whole_batch_make_micro_batch_losses_add_up():
    """The loss functions alone: with the whole batch's denominators, the shares of the four
    micro-batches sum to the whole batch's loss and metrics."""
    r = np.random.default_rng(6)
    batch = pretraining_batch(model_config(), r)
    outputs = {"mlm_logits": r.normal(size=(BATCH, PREDICTIONS, 64)).astype(np.float32),
               "nsp_logits": r.normal(size=(BATCH, 2)).astype(np.float32)}
    whole = objective.loss_denominators(batch, packed=False)
    _, expected = pretraining_loss(outputs, batch)
    rows = [np.arange(BATCH)[i::K] for i in range(K)]
    shares = [pretraining_loss(jax.tree.map(lambda x, i=i: x[i], outputs),
                               jax.tree.map(lambda x, i=i: x[i], batch),
                               denominators=whole)[1] for i in rows]
    means = [pretraining_loss(jax.tree.map(lambda x, i=i: x[i], outputs),
                              jax.tree.map(lambda x, i=i: x[i], batch))[1] for i in rows]
    for key, value in expected.items():
        np.testing.assert_allclose(sum(s[key] for s in shares), value, rtol=1e-6, err_msg=key)
    assert abs(np.mean([m["mlm_loss"] for m in means]) - expected["mlm_loss"]) > 1e-3
