"""Packed token tagging (config.data.pack with the token_classification family): a packed batch
gives every token's logits, the loss, its metrics and the gradients of the same sentence rows
one a row (BERT and a ModernBERT, float32), accumulated micro-batches included; the packed
head has the unpacked head's parameters; each epoch shows every row once, its tokens and
labels where they belong, in fixed shapes; a packed CoNLL run's dev F1 is the unpacked run's
(evaluation unpacked, each word read back from its own row)."""

import dataclasses
import json

import jax
import numpy as np
import pytest
import tagging_data as td
from packed_models import VOCAB, assert_trees_close, bert_config, loss_fn, modern_config

from bertjax.errors import ConfigError
from bertjax.models.tagging import BertForTokenClassification
from bertjax.tasks import checks
from bertjax.tasks.tagging import features as token_features
from bertjax.tasks.tagging.features import TokenFeatures
from bertjax.tasks.tagging.task import TokenClassificationTask
from bertjax.train import step as step_lib
from data_pipeline import packed_finetune

SEQ, BATCH = 32, 8
LABELS = ("O", "B-PER", "I-PER", "B-LOC", "I-LOC")


def random_features(n=41, seed=0, short=3):
    """n rows `[CLS] ... [SEP]` of random lengths in [short, SEQ]; about 60% of their inner
    positions scored (a label id), the rest -1 (other sub-tokens, context)."""
    rng = np.random.default_rng(seed)
    ids, labels = [], []
    for _ in range(n):
        length = int(rng.integers(short, SEQ + 1))
        row = rng.integers(5, VOCAB, length).astype(np.int32)
        row[0], row[-1] = 2, 3
        gold = np.where(rng.random(length) < 0.6, rng.integers(0, len(LABELS), length), -1)
        gold[0] = gold[-1] = -1
        ids.append(row)
        labels.append(gold.astype(np.int32))
    return TokenFeatures(ids, [np.full_like(g, -1) for g in labels], labels, np.arange(n),
                         np.ones(n, np.int64), np.zeros((n, 2), np.int64))


def make_task(pack=True, accum=1, batch=BATCH):
    from experiments.ner import get_config

    config = get_config("files")
    config.data.pack, config.max_seq_length = pack, SEQ
    config.train.batch_size, config.train.grad_accum_steps = batch, accum
    task = TokenClassificationTask(config)
    task._declare(LABELS)
    task.buckets, task.max_seq_length = task.bucket_lengths(SEQ), SEQ  # what encode sets
    return task


def packed_and_unpacked(task, features, batch=BATCH, seed=3):
    """The first packed batch of an epoch, and the same rows one a row (padded to SEQ)."""
    shape = task.packing_shape(features, batch)
    rows = packed_finetune.plan_packed(features.lengths, shape, seed=seed)[0]
    packed = token_features.make_packed_batch(features, rows, shape)
    order = np.array([i for row in rows for i in row])
    unpacked = token_features.make_batch(features, SEQ, order, len(order))
    return packed, unpacked


def models_and_params(name):
    """(the head, given packed or unpacked rows, and its parameters)."""
    config = {"bert": bert_config, "modern": modern_config}[name]()
    model = BertForTokenClassification(config, len(LABELS))
    ids = np.zeros((1, 8), np.int32)
    params = jax.jit(model.init)(jax.random.key(1), ids, ids, ids)["params"]
    return model, model, jax.tree.map(np.asarray, params)


def placed_slices(batch):
    """(row, start, end, example) of every example of a packed batch."""
    index, starts = batch["example_index"], batch["example_starts"]
    for row, slot in zip(*np.nonzero(index >= 0)):
        start = int(starts[row, slot])
        end = start + int((batch["packing_ids"][row] == slot + 1).sum())
        yield row, start, end, int(index[row, slot])


@pytest.mark.parametrize("name", ["bert", "modern"])
def test_a_packed_batch_scores_every_token_as_its_row_alone(name):
    task, unpacked_task = make_task(), make_task(pack=False)
    features = random_features()
    packed, unpacked = packed_and_unpacked(task, features)
    assert (packed["packing_ids"].max(axis=1) > 1).any(), "no row holds several examples"
    model, alone, params = models_and_params(name)
    logits_packed = np.asarray(task.outputs(model, params, packed))  # [rows, SEQ, labels]
    logits_alone = np.asarray(unpacked_task.outputs(alone, params, unpacked))
    position = {int(i): r for r, i in enumerate(unpacked["example_index"])}
    for row, start, end, i in placed_slices(packed):
        np.testing.assert_allclose(logits_packed[row, start:end],
                                   logits_alone[position[i], :end - start],
                                   rtol=1e-5, atol=1e-6)
    # The loss over the scored tokens, its metrics and its gradients: the unpacked rows'.
    (loss_p, metrics_p), grads_p = jax.value_and_grad(loss_fn(task, model), has_aux=True)(
        params, packed, None)
    (loss_u, metrics_u), grads_u = jax.value_and_grad(
        loss_fn(unpacked_task, alone), has_aux=True)(params, unpacked, None)
    grad_diff = max(float(np.abs(np.asarray(a) - np.asarray(b)).max())
                    for a, b in zip(jax.tree.leaves(grads_p), jax.tree.leaves(grads_u)))
    print(f"{name}: packed vs unpacked loss {float(loss_p):.6f} vs {float(loss_u):.6f} "
          f"(|diff| {abs(float(loss_p) - float(loss_u)):.1e}), max |grad diff| {grad_diff:.1e}")
    np.testing.assert_allclose(loss_p, loss_u, rtol=1e-5, atol=1e-6)
    assert_trees_close(metrics_p, metrics_u, rtol=1e-5, atol=1e-6)
    assert_trees_close(grads_p, grads_u, rtol=1e-5, atol=1e-6)


def test_accumulated_packed_micro_batches_are_the_whole_batch():
    """Two micro-batches of packed rows (uneven scored tokens each) sum to the global batch,
    as one row each: the global denominators count the scored tokens."""
    task, unpacked_task = make_task(accum=2), make_task(pack=False)
    features = random_features(seed=4)
    packed, unpacked = packed_and_unpacked(task, features)
    assert packed["input_ids"].shape[0] % 2 == 0
    model, alone, params = models_and_params("bert")
    key = jax.random.key(0)  # the model's dropout rates are 0: the same values as without
    grads_p, metrics_p = step_lib.gradients(params, packed, key, loss_fn=loss_fn(task, model),
                                            grad_accum_steps=2, denominators=task.denominators)
    grads_u, metrics_u = step_lib.gradients(params, unpacked, key,
                                            loss_fn=loss_fn(unpacked_task, alone))
    np.testing.assert_allclose(metrics_p["loss"], metrics_u["loss"], rtol=1e-5, atol=1e-6)
    assert_trees_close(grads_p, grads_u, rtol=1e-5, atol=1e-6)


def test_every_row_once_an_epoch_with_its_tokens_and_labels_in_fixed_shapes():
    task = make_task()
    features = random_features(n=101, seed=2)
    spec = task.train_batch_spec(features, BATCH, SEQ)
    assert task.train_rows(features, BATCH) == task.packing_shape(features, BATCH).rows < BATCH
    epochs = []
    for seed in (0, 1):
        batches = list(task.batches(features, BATCH, shuffle=True, seed=seed))
        assert len(batches) == task.num_batches(features, BATCH) or seed  # seed 0 counted
        seen = []
        for batch in batches:
            assert {k: (v.shape, v.dtype) for k, v in batch.items()} == {
                k: (s.shape, s.dtype) for k, s in spec.items()}
            placed = list(placed_slices(batch))
            assert len(placed) <= BATCH  # batch_size counts examples
            covered = np.zeros_like(batch["input_mask"])
            for row, start, end, i in placed:
                gold = features.label_ids[i]
                np.testing.assert_array_equal(batch["input_ids"][row, start:end],
                                              features.input_ids[i])
                np.testing.assert_array_equal(batch["label_ids"][row, start:end],
                                              np.maximum(gold, 0))
                np.testing.assert_array_equal(batch["label_weights"][row, start:end], gold >= 0)
                covered[row, start:end] += 1
                seen.append(i)
            # The examples tile each row from its start; nothing is scored outside them.
            np.testing.assert_array_equal(covered, batch["input_mask"])
            assert (batch["label_weights"][covered == 0] == 0).all()
        assert sorted(seen) == list(range(len(features)))
        epochs.append(seen)
    assert epochs[0] != epochs[1]  # another epoch, another order
    # Evaluation stays unpacked: one row a sentence window, each word read from its row.
    assert "packing_ids" not in next(iter(task.batches(features, BATCH, shuffle=False)))


def test_hosts_take_their_rows_of_the_same_global_batch():
    features = random_features(n=60, seed=5)
    shape = packed_finetune.packing_shape(features.lengths, BATCH, SEQ, granule=2)
    rows = packed_finetune.plan_packed(features.lengths, shape, seed=0)[1]
    whole = token_features.make_packed_batch(features, rows, shape)
    parts = [token_features.make_packed_batch(features, rows, shape, i, 2) for i in (0, 1)]
    for key, value in whole.items():
        np.testing.assert_array_equal(np.concatenate([p[key] for p in parts]), value)


def test_tagging_packs_but_not_with_the_bilstm_head():
    from experiments.ner import get_config

    config = get_config("conll2003")
    assert config.data.pack is False  # the shipped config does not pack
    config.data.pack = True
    checks.check_packing(config, bert_config())
    checks.check_packing(config, modern_config())
    # A causal BERT packs too: each token's score reads only its own example's earlier tokens.
    checks.check_packing(config, dataclasses.replace(bert_config(), causal=True))
    config.task.bilstm_units = 8
    with pytest.raises(ConfigError, match="BiLSTM") as error:
        checks.check_packing(config, bert_config())
    assert ("packs config.task.kind classification, pairs, regression, scored, tagging only"
            in str(error.value))


def _padding(line):
    """The packed log line's (unpacked %, packed %)."""
    before, after = line.split("padding ")[1].split(" of the train tokens")[0].split(" → ")
    return float(before.rstrip("%")), float(after.rstrip("%"))


@pytest.mark.slow
def test_a_packed_ner_run_scores_the_dev_set_as_the_unpacked_run(tmp_path):
    """The same CoNLL files, settings and seed, packed and not: the packed run computes far
    fewer padding tokens and its dev entity F1 is within 0.03 of the unpacked run's; its
    predictions file holds every dev word once, in order."""
    from conftest import write_tiny_checkpoint

    from bertjax.tasks import train_and_evaluate
    from experiments.ner import get_config

    for name, seed, n in (("train.conll", 0, 320), ("dev.conll", 1, 80)):
        td.write_conll(tmp_path / name, td.dataset(seed, n))  # no -DOCSTART-: sentences alone
    (tmp_path / "ckpt").mkdir()
    checkpoint = write_tiny_checkpoint(tmp_path / "ckpt", td.VOCAB)
    summaries, lines = {}, {}
    for pack in (False, True):
        config = get_config("files")
        config.init_checkpoint = checkpoint
        config.data.update(train=str(tmp_path / "train.conll"),
                           validation=str(tmp_path / "dev.conll"), pack=pack)
        config.max_seq_length, config.train.batch_size, config.train.num_epochs = 64, 16, 3
        config.optimizer.learning_rate, config.log_every_steps = 1e-3, 100
        config.optimizer.name, config.optimizer.schedule = "bert_adamw", "reference"
        config.eval.batch_size = 32
        log = []
        workdir = tmp_path / ("packed" if pack else "unpacked")
        summaries[pack] = train_and_evaluate(config, str(workdir), log=log.append)
        lines[pack] = next(x for x in log if x.startswith("Task "))
    unpacked_padding, packed_padding = _padding(lines[True])
    f1 = {pack: summaries[pack]["best"]["f1"] for pack in (False, True)}
    print(f"padding {unpacked_padding}% unpacked → {packed_padding}% packed; dev F1 "
          f"{f1[False]:.4f} unpacked, {f1[True]:.4f} packed; steps "
          f"{summaries[False]['total_steps']} / {summaries[True]['total_steps']}")
    assert "packed 320 examples into" in lines[True], lines[True]
    assert packed_padding < unpacked_padding / 2, lines[True]
    assert f1[False] >= 0.9 and abs(f1[True] - f1[False]) <= 0.03, f1
    blocks = (tmp_path / "packed" / "predictions" / "dev.conll").read_text().strip().split(
        "\n\n")
    assert [[line.split(" ")[0] for line in b.split("\n")] for b in blocks] == [
        w for w, _ in td.dataset(1, 80)]
    assert json.loads((tmp_path / "packed" / "results.json").read_text())["best"]["f1"] == f1[
        True]
