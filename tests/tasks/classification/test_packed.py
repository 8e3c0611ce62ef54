"""Packed fine-tuning (config.data.pack, data_pipeline/packed_finetune.py): a packed batch
gives the loss, gradients and per-example logits of the same examples one a row (BERT and a
ModernBERT, float32), accumulated micro-batches included; each epoch shows every example
once, in fixed shapes; a resumed epoch continues with the same batches; the log line compares
the padding with the unpacked batches'; tasks that cannot pack say so in one line."""

import dataclasses

import jax
import numpy as np
import pytest
from finetune_task import write_task
from packed_models import VOCAB, assert_trees_close, bert_config, loss_fn, modern_config

from bertjax.errors import ConfigError
from bertjax.models.classification import BertForSequenceClassification
from bertjax.tasks import base, checks
from bertjax.tasks.classification.task import SequenceTask
from bertjax.train import step as step_lib
from data_pipeline import finetune_data, packed_finetune
from data_pipeline.finetune_data import Features

SEQ, BATCH = 32, 8


def random_features(n=37, kind="classification", seed=0, short=3):
    """n examples `[CLS] ... [SEP] (... [SEP])` of random lengths in [short, SEQ], some pairs
    (segment ids 1 on their second part); 3 classes or a float target."""
    rng = np.random.default_rng(seed)
    sequences = []
    for _ in range(n):
        length = int(rng.integers(short, SEQ + 1))
        ids = rng.integers(5, VOCAB, length).astype(np.int32)
        ids[0], ids[-1] = 2, 3
        segments = np.zeros(length, np.int32)
        if length > 6 and rng.random() < 0.5:
            segments[length // 2:] = 1
        sequences.append(np.stack([ids, segments, np.ones(length, np.int32)])[None])
    labels = (rng.normal(size=n).astype(np.float32) if kind == "regression"
              else rng.integers(0, 3, n).astype(np.int32))
    return Features(sequences, labels, multiple_choice=False)


def make_task(kind="classification", pack=True, accum=1, batch=BATCH):
    from experiments.finetune_files import get_config

    config = get_config(kind)
    config.data.pack, config.max_seq_length = pack, SEQ
    config.train.batch_size, config.train.grad_accum_steps = batch, accum
    task = SequenceTask(config)
    labels = () if kind == "regression" else ("a", "b", "c")
    task._declare(kind, labels, ("pearson",) if kind == "regression" else ("accuracy",))
    task.buckets, task.max_seq_length = task.bucket_lengths(SEQ), SEQ  # what encode sets
    return task


MODELS = {"bert": (bert_config, "cls"), "modern_cls": (modern_config, "cls"),
          "modern_mean": (modern_config, "mean")}


def packed_and_unpacked(task, features, batch=BATCH):
    """The first packed batch of an epoch, and the same examples one a row (padded to SEQ)."""
    shape = task.packing_shape(features, batch)
    rows = packed_finetune.plan_packed(features.lengths, shape, seed=3)[0]
    packed = packed_finetune.make_packed_batch(features, rows, shape)
    order = np.array([i for row in rows for i in row])
    unpacked = finetune_data.make_batch(features, SEQ, order, len(order))
    return packed, unpacked


def model_and_params(task, name, kind):
    make_config, pooling = MODELS[name]
    task.classifier_pooling = pooling
    model = BertForSequenceClassification(make_config(), 1 if kind == "regression" else 3,
                                          classifier_pooling=pooling)
    ids = np.zeros((1, 8), np.int32)
    params = jax.jit(model.init)(jax.random.key(1), ids, ids, ids)["params"]
    return model, jax.tree.map(np.asarray, params)


@pytest.mark.parametrize("name,kind", [("bert", "classification"), ("bert", "regression"),
                                       ("modern_cls", "classification"),
                                       ("modern_mean", "regression")])
def test_a_packed_batch_is_the_same_examples_one_a_row(name, kind):
    task = make_task(kind)
    features = random_features(kind=kind)
    packed, unpacked = packed_and_unpacked(task, features)
    assert (packed["packing_ids"].max(axis=1) > 1).any(), "no row holds several examples"
    model, params = model_and_params(task, name, kind)
    # Each example's logits: the same in its packed row as alone in a row.
    logits_packed = task.outputs(model, params, packed)  # [rows, slots, labels]
    logits_alone = task.outputs(model, params, unpacked)  # [examples, labels]
    real = packed["weights"] > 0  # row by row, slot by slot: the unpacked rows' order
    np.testing.assert_array_equal(packed["example_index"][real], unpacked["example_index"])
    np.testing.assert_allclose(np.asarray(logits_packed)[real], np.asarray(logits_alone),
                               rtol=1e-5, atol=1e-6)
    # The loss over the real examples, and its gradient, as one example a row.
    fn = loss_fn(task, model)
    (loss_p, metrics_p), grads_p = jax.value_and_grad(fn, has_aux=True)(params, packed, None)
    (loss_u, metrics_u), grads_u = jax.value_and_grad(fn, has_aux=True)(params, unpacked, None)
    np.testing.assert_allclose(loss_p, loss_u, rtol=1e-5, atol=1e-6)
    assert_trees_close(metrics_p, metrics_u, rtol=1e-5, atol=1e-6)
    assert_trees_close(grads_p, grads_u, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name", ["bert", "modern_mean"])
def test_accumulated_packed_micro_batches_are_the_whole_batch(name):
    """Two micro-batches of packed rows (uneven examples each) sum to the global batch, as
    one example a row: the global denominators count the real examples."""
    task = make_task(accum=2)
    features = random_features(seed=4)
    packed, unpacked = packed_and_unpacked(task, features)
    assert packed["input_ids"].shape[0] % 2 == 0
    model, params = model_and_params(task, name, "classification")
    fn = loss_fn(task, model)
    key = jax.random.key(0)  # the models' dropout rates are 0: the same values as without
    grads_p, metrics_p = step_lib.gradients(params, packed, key, loss_fn=fn,
                                            grad_accum_steps=2,
                                            denominators=task.denominators)
    grads_u, metrics_u = step_lib.gradients(params, unpacked, key, loss_fn=fn)
    np.testing.assert_allclose(metrics_p["loss"], metrics_u["loss"], rtol=1e-5, atol=1e-6)
    assert_trees_close(grads_p, grads_u, rtol=1e-5, atol=1e-6)


def epoch_examples(batches):
    seen = []
    for batch in batches:
        seen += batch["example_index"][batch["weights"] > 0].tolist()
        assert (batch["example_index"][batch["weights"] == 0] == -1).all()
    return seen


def test_every_example_once_an_epoch_in_fixed_shapes():
    task = make_task()
    features = random_features(n=101, seed=2)
    spec = task.train_batch_spec(features, BATCH, SEQ)
    shape = task.packing_shape(features, BATCH)
    epochs = []
    for seed in (0, 1):
        batches = list(task.batches(features, BATCH, shuffle=True, seed=seed))
        assert len(batches) == task.num_batches(features, BATCH) or seed  # seed 0 counted
        for batch in batches:
            assert {k: (v.shape, v.dtype) for k, v in batch.items()} == {
                k: (s.shape, s.dtype) for k, s in spec.items()}
            assert batch["weights"].sum() <= BATCH  # batch_size counts examples
            # A row's examples sit back to back from its start, each from its [CLS].
            for row in range(shape.rows):
                lengths = features.lengths[batch["example_index"][row][
                    batch["weights"][row] > 0]]
                assert lengths.sum() == batch["input_mask"][row].sum() <= SEQ
                starts = np.cumsum(lengths) - lengths
                np.testing.assert_array_equal(
                    batch["example_starts"][row][:len(lengths)], starts)
                assert (batch["input_ids"][row][starts] == 2).all()
        seen = epoch_examples(batches)
        assert sorted(seen) == list(range(len(features)))
        epochs.append(seen)
    assert epochs[0] != epochs[1]  # another epoch, another order
    assert epoch_examples(task.batches(features, BATCH, shuffle=True, seed=0)) == epochs[0]
    # Evaluation stays unpacked.
    assert "packing_ids" not in next(iter(task.batches(features, BATCH, shuffle=False)))


def test_hosts_take_their_rows_of_the_same_global_batch():
    features = random_features(n=60, seed=5)
    shape = packed_finetune.packing_shape(features.lengths, BATCH, SEQ, granule=2)
    rows = packed_finetune.plan_packed(features.lengths, shape, seed=0)[1]
    whole = packed_finetune.make_packed_batch(features, rows, shape)
    parts = [packed_finetune.make_packed_batch(features, rows, shape, i, 2) for i in (0, 1)]
    for key, value in whole.items():
        np.testing.assert_array_equal(np.concatenate([p[key] for p in parts]), value)


def test_a_resumed_epoch_continues_with_the_same_batches(tmp_path):
    task = make_task()
    features = random_features(n=80, seed=6)
    steps = task.num_batches(features, BATCH)

    def make_input():
        return base.EpochInput(lambda epoch: task.batches(features, BATCH, shuffle=True,
                                                         seed=7 * 1000 + epoch))

    first = make_input()
    taken = steps + 3  # into the second epoch
    for _ in range(taken):
        next(first)
    first.save(str(tmp_path / "input"))
    expected = [next(first) for _ in range(steps)]
    resumed = make_input()
    resumed.restore(str(tmp_path / "input"))
    for a, b in zip(expected, (next(resumed) for _ in range(steps))):
        assert a.keys() == b.keys()
        for key in a:
            np.testing.assert_array_equal(a[key], b[key])


def test_the_log_line_compares_packed_with_bucketed_padding():
    features = random_features(n=120, seed=8)
    task, unpacked = make_task(), make_task(pack=False)
    bucketed = unpacked.describe(features)  # "; padding is X% of the train tokens computed"
    x = bucketed.split("padding is ")[1].split("%")[0]
    line = task.describe(features)
    shape = task.packing_shape(features, BATCH)
    steps = task.num_batches(features, BATCH)
    computed = steps * shape.rows * SEQ
    y = 100 * (1 - features.lengths.sum() / computed)
    assert line.startswith(f"; packed 120 examples into {steps * shape.rows} rows of {SEQ} "), line
    assert f"padding {x}% → {y:.1f}% of the train tokens computed" in line, line
    assert float(f"{y:.1f}") < float(x)


def test_rows_and_slots_follow_the_data():
    lengths = np.array([4, 10, 20, 30] * 20)
    shape = packed_finetune.packing_shape(lengths, 32, 64, granule=4)
    tokens = 32 * lengths.mean() * packed_finetune.ROW_HEADROOM
    assert shape.rows % 4 == 0 and shape.rows >= tokens / 64 and shape.rows - 4 < tokens / 64
    assert shape.slots == 64 // 4 and shape.examples == 32
    # Never more rows than the unpacked batch, whatever the lengths.
    assert packed_finetune.packing_shape(np.full(9, 64), 8, 64).rows == 8


# ------------------------------------------------------------------------- the checks


def pack_config(experiment, arg):
    import importlib

    config = importlib.import_module(f"experiments.{experiment}").get_config(arg)
    config.data.pack = True  # a config that declares no such field gets it here
    return config


@pytest.mark.parametrize("experiment,arg,named", [
    ("finetune_files", "multiple_choice", "kind='multiple_choice'"),
    ("glue", "swag", "family='swag'"),
    ("squad", "v1", "family='squad'"),
    ("ner_feature_based", "concat_last_four", "family='feature_based'"),
])
def test_tasks_that_do_not_pack_refuse_it_in_one_line(experiment, arg, named):
    with pytest.raises(ConfigError) as error:
        checks.check_packing(pack_config(experiment, arg), bert_config())
    message = str(error.value)
    assert "\n" not in message and "config.data.pack" in message and named in message, message


def test_heads_that_do_not_pack_refuse_it():
    config = pack_config("finetune_files", "classification")
    checks.check_packing(config, bert_config())  # classification packs
    checks.check_packing(config, modern_config())
    with pytest.raises(ConfigError, match="causal"):
        checks.check_packing(config, dataclasses.replace(bert_config(), causal=True))
    config.task.bilstm_units = 8
    with pytest.raises(ConfigError, match="BiLSTM"):
        checks.check_packing(config, bert_config())


def test_the_shipped_configs_do_not_pack():
    for experiment, arg in (("glue", "mrpc"), ("finetune_files", "regression"),
                            ("finetune_rotten_tomatoes", "binary")):
        import importlib

        config = importlib.import_module(f"experiments.{experiment}").get_config(arg)
        assert config.data.pack is False


def test_the_job_steps_on_packed_rows_that_split_over_micro_batches(tmp_path):
    """The job's stage: rows (not batch_size examples) a step, its batch spec the shapes of
    every training batch, the rows divisible by the micro-batches."""
    from conftest import KEYWORD_VOCAB, write_tiny_checkpoint

    from bertjax.tasks import dry_run_job
    from experiments.finetune_files import get_config

    write_task(tmp_path)
    (tmp_path / "ckpt").mkdir()
    config = get_config("classification")
    config.init_checkpoint = write_tiny_checkpoint(tmp_path / "ckpt", KEYWORD_VOCAB)
    config.data.update(train=str(tmp_path / "train.jsonl"),
                       validation=str(tmp_path / "dev.jsonl"), pack=True)
    config.max_seq_length, config.train.grad_accum_steps = 32, 2
    job = dry_run_job(config, log=lambda *_: None)
    stage = job.stages[0]
    assert stage.batch_size % 2 == 0 and stage.batch_size < config.train.batch_size
    batches = job._train_input()
    for _ in range(job.steps_per_epoch + 1):
        batch = next(batches)
        assert {k: v.shape for k, v in batch.items()} == {
            k: s.shape for k, s in stage.batch_spec.items()}
        assert batch["input_ids"].shape[0] == stage.batch_size
    assert job.total_steps == 3 * job.steps_per_epoch


@pytest.mark.slow
def test_a_packed_run_learns(tmp_path):
    """A packed run through the job: the log line, the learning, an unpacked evaluation."""
    from conftest import KEYWORD_VOCAB, write_tiny_checkpoint

    from bertjax.tasks import train_and_evaluate
    from experiments.finetune_files import get_config

    write_task(tmp_path)
    config = get_config("classification")
    (tmp_path / "ckpt").mkdir()
    config.init_checkpoint = write_tiny_checkpoint(tmp_path / "ckpt", KEYWORD_VOCAB)
    config.data.update(train=str(tmp_path / "train.jsonl"),
                       validation=str(tmp_path / "dev.jsonl"), pack=True)
    config.max_seq_length, config.min_bucket_length = 32, 32
    # The settings at which the same run unpacked learns the keyword too (1.0 / 0.97 dev).
    config.train.batch_size, config.train.num_epochs = 16, 10
    config.optimizer.learning_rate, config.log_every_steps = 3e-3, 10
    lines = []
    summary = train_and_evaluate(config, str(tmp_path / "run"), log=lines.append)
    assert any("packed 96 examples into" in line for line in lines), lines
    assert summary["best"]["accuracy"] >= 0.75, summary["best"]
    assert summary["total_steps"] == 60  # 16 examples a step: 6 steps an epoch, as unpacked
