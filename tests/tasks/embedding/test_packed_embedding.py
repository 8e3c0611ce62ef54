"""Packed embedding training (config.data.pack, bertjax/tasks/embedding/packed.py): a packed
batch holds the same rows as the unpacked one and gives each text the same vector, the same
loss and the same gradients (float32, a partial last batch with filler rows and a batch of
one pair included); it computes fewer tokens on a skewed length mix; a short fine-tuning run
has the unpacked run's losses; what packing cannot take is refused in one line."""

import dataclasses
import json

import embedding_data as data
import jax
import numpy as np
import pytest
from packed_models import VOCAB, assert_trees_close, bert_config, loss_fn, modern_config

from bertjax import tasks
from bertjax.errors import ConfigError
from bertjax.tasks import checks
from bertjax.tasks.embedding import packed
from bertjax.tasks.embedding.task import EmbeddingFeatures, EmbeddingTask
from experiments import embedding

SEQ = 32
TOL = dict(rtol=1e-5, atol=1e-5)


def random_features(n, columns=2, seed=0, short=(3, 8), long=(10, SEQ)):
    """n rows of `columns` texts `[CLS] ... [SEP]`: a short anchor, longer others (padded to
    the row's longest, as EmbeddingTask.encode gives them); scores in [0, 5]."""
    rng = np.random.default_rng(seed)
    sequences = []
    for _ in range(n):
        lengths = [int(rng.integers(*short))] + [int(rng.integers(*long))
                                                 for _ in range(columns - 1)]
        row = np.zeros((columns, 3, max(lengths)), np.int32)
        for c, length in enumerate(lengths):
            ids = rng.integers(5, VOCAB, length)
            ids[0], ids[-1] = 2, 3
            row[c, 0, :length], row[c, 2, :length] = ids, 1
        sequences.append(row)
    return EmbeddingFeatures(sequences, rng.uniform(0, 5, n).astype(np.float32), True)


def make_task(pack=True, kind="pairs", columns=2, batch=8, seq=SEQ, accum=1, **task_fields):
    config = embedding.get_config(kind)
    config.data.pack, config.max_seq_length, config.train.batch_size = pack, seq, batch
    config.train.grad_accum_steps = accum
    config.task.update({"pooling": "mean", "normalize": "false", **task_fields})
    task = EmbeddingTask(config)
    task.buckets, task.columns = task.bucket_lengths(seq), columns  # what encode / read set
    return task


def model_and_params(task, make_config=bert_config):
    model = task.model(make_config())
    params = jax.jit(model.init)(jax.random.key(1), *task.init_inputs())["params"]
    return model, jax.tree.map(np.asarray, params)


def epochs(task, features, batch, seed=0):
    return list(task.batches(features, batch, shuffle=True, seed=seed))


def first_and_last(task, plain, features, seed=0):
    """(packed, unpacked) pairs of an epoch's first and last batches (8 rows: one of them
    partial, with filler rows): one compile each keeps the tests short."""
    pairs = list(zip(epochs(task, features, 8, seed), epochs(plain, features, 8, seed)))
    return [pairs[0], pairs[-1]]


@pytest.mark.parametrize("pooling,normalize,make_config", [
    ("mean", "false", bert_config), ("cls", "true", bert_config), ("max", "true", bert_config),
    ("mean", "true", modern_config)])
def test_each_text_gets_the_vector_it_gets_alone_in_a_row(pooling, normalize, make_config):
    features = random_features(21, columns=3)
    fields = dict(pooling=pooling, normalize=normalize)
    task, plain = make_task(columns=3, **fields), make_task(False, columns=3, **fields)
    model, params = model_and_params(task, make_config)
    outputs = jax.jit(lambda params, batch: task.outputs(model, params, batch))
    for packed_batch, padded in first_and_last(task, plain, features):
        np.testing.assert_array_equal(packed_batch["example_index"], padded["example_index"])
        assert packed_batch["input_ids"].ndim == 2  # [rows, length]
        assert (packed_batch["packing_ids"].max(axis=1) > 1).any(), "a text a row"
        real = padded["weights"] > 0
        np.testing.assert_allclose(np.asarray(outputs(params, packed_batch))[real],
                                   np.asarray(outputs(params, padded))[real], **TOL)


@pytest.mark.parametrize("n,columns,kind,fields", [
    (37, 2, "pairs", {"pooling": "cls"}),  # the last batch: 5 pairs and 3 filler rows
    # The last batch: one row (with a hard negative).
    (9, 3, "pairs", {"symmetric": True, "pooling": "max", "normalize": "true"}),
    (20, 2, "scored", {"matryoshka_dims": "16"}),  # CoSENT of 8, 8 and 4 pairs
])
def test_the_loss_and_gradients_are_the_unpacked_steps(n, columns, kind, fields):
    features = random_features(n, columns, seed=n)
    task = make_task(kind=kind, columns=columns, **fields)
    plain = make_task(False, kind=kind, columns=columns, **fields)
    model, params = model_and_params(task)
    grad = jax.jit(jax.value_and_grad(loss_fn(task, model), has_aux=True))
    batches = first_and_last(task, plain, features, seed=1)
    assert min(b["weights"].sum() for b, _ in batches) == n % 8
    for packed_batch, padded in batches:
        (loss_p, metrics_p), grads_p = grad(params, packed_batch, None)
        (loss_u, metrics_u), grads_u = grad(params, padded, None)
        np.testing.assert_allclose(loss_p, loss_u, **TOL)
        assert_trees_close(metrics_p, metrics_u, **TOL)
        # Within 1e-5 of each gradient's largest entry: CoSENT's scale of 20 makes entries of
        # about 1, whose float32 sums differ in the last digits with the order of the terms.
        for g_p, g_u in zip(jax.tree.leaves(grads_p), jax.tree.leaves(grads_u)):
            np.testing.assert_allclose(g_p, g_u, rtol=0,
                                       atol=1e-5 * max(1.0, float(np.abs(g_u).max())))


@pytest.mark.parametrize("accum,chunk_rows", [(2, 0), (1, 4), (2, 2)])
def test_micro_batches_and_cached_chunks_are_the_unpacked_steps(accum, chunk_rows):
    """The step's parts (2 micro-batches, chunks of 4 rows, 2 micro-batches of 2 chunks of 2
    rows) each hold their own texts' packed rows: the gradients of the unpacked step."""
    from bertjax.train import step as step_lib

    features = random_features(13, seed=5)  # batches of 8 and 5 pairs
    fields = dict(accum=accum, cache_chunk_rows=chunk_rows)
    task, plain = make_task(**fields), make_task(False, **fields)
    assert task.packing_groups(8) == {(2, 0): 2, (1, 4): 2, (2, 2): 4}[accum, chunk_rows]
    model, params = model_and_params(task)
    key = jax.random.key(0)  # the model's dropout rates are 0: any key gives the same values

    def gradients(task, batch):
        return jax.jit(lambda params, batch: step_lib.gradients(
            params, batch, key, loss_fn=loss_fn(task, model), grad_accum_steps=accum,
            denominators=task.denominators))(params, batch)

    (packed_batch, padded), = first_and_last(task, plain, features)[1:]  # 5 pairs, 3 fillers
    grads_p, metrics_p = gradients(task, packed_batch)
    grads_u, metrics_u = gradients(plain, padded)
    assert_trees_close(metrics_p, metrics_u, **TOL)
    assert_trees_close(grads_p, grads_u, **TOL)
    # The whole batch at once (its groups gathered together): the same vectors.
    outputs = jax.jit(lambda params, batch: task.outputs(model, params, batch))
    real = padded["weights"] > 0
    np.testing.assert_allclose(np.asarray(outputs(params, packed_batch))[real],
                               np.asarray(outputs(params, padded))[real], **TOL)


def test_an_epoch_is_the_unpacked_epoch_in_fewer_tokens_and_few_shapes():
    """16-token questions and ~200-token passages at 256: the same rows in the same order
    (no duplicates, filler rows), each text once, under half the tokens of the padded
    batches."""
    features = random_features(100, short=(12, 20), long=(150, 250))
    task, plain = make_task(batch=32, seq=256), make_task(False, batch=32, seq=256)
    for seed in (0, 1):
        packed_batches, padded = epochs(task, features, 32, seed), epochs(plain, features, 32,
                                                                          seed)
        assert len(packed_batches) == len(padded) == task.num_batches(features, 32)
        for p, u in zip(packed_batches, padded):
            for key in ("example_index", "weights", "labels"):
                np.testing.assert_array_equal(p[key], u[key])
            real = p["text_slots"][p["weights"] > 0]
            assert sorted(real.ravel()) == sorted(set(real.ravel()))  # a slot a text
            assert p["input_mask"].sum() == u["input_mask"].sum()
        packed_tokens = sum(b["input_ids"].size for b in packed_batches)
        padded_tokens = sum(b["input_ids"].size for b in padded)
        assert packed_tokens < padded_tokens / 2, (packed_tokens, padded_tokens)
        assert len({b["input_ids"].shape for b in packed_batches}) <= 3
    spec = task.train_batch_spec(features, 32, 256)
    assert spec["input_ids"].shape == (max(b["input_ids"].shape[0] for b in epochs(
        task, features, 32)), 256) and spec["text_slots"].shape == (32, 2)
    assert "packed 2 text(s) of 32 rows a step into" in task.describe(features)


@pytest.mark.parametrize("pack", [True, False])
def test_a_dry_runs_model_flops_count_the_rows_it_computes(pack, tmp_path):
    """MFU's FLOPs a step: packed, every packed row once at its own length (shorter than
    max_seq_length for these short texts, fewer rows than the batch's 16 examples);
    unpacked, each example's 2 columns at max_seq_length."""
    from bertjax.models import architecture

    config = embedding.get_config("pairs")
    config.init_checkpoint = data.tiny_checkpoint(tmp_path)
    config.max_seq_length, config.train.batch_size, config.data.pack = 64, 16, pack
    config.data.update(train=data.write_pairs(tmp_path / "train.jsonl", 48),
                       columns="query,passage", beir=data.write_beir(tmp_path / "beir"))
    job = tasks.dry_run_job(config, log=lambda *_: None)
    stage = job.stages[0]
    rows, length = stage.batch_spec["input_ids"].shape[0], stage.batch_spec["input_ids"].shape[-1]
    assert stage.tokens_per_example == length and (length < 64 if pack else length == 64)
    assert stage.batch_size == 16 and (rows < 16 if pack else rows == 16)
    forward = architecture(job.model_config).forward_flops(job.model_config, length, 0,
                                                           job.task.pooled_only)
    per_step = 3.0 * forward * (rows if pack else 2 * 16)
    np.testing.assert_allclose(stage.flops_per_example * stage.batch_size, per_step, rtol=1e-12)


def test_first_fit_rows_and_rounding():
    packing = packed.TextPacking(length=10, slots=3, granule=2)
    row, slot = packed.first_fit(np.array([3, 8, 2, 2, 2, 5]), packing)
    # Longest first: 8 → row 0; 5 → row 1; 3 → row 1; the 2s: row 0 (full then), row 1
    # (full then), row 2.
    assert row.tolist() == [1, 0, 0, 1, 2, 1] and slot.tolist() == [1, 0, 1, 2, 0, 0]
    assert [packed.round_rows(r, 1) for r in (1, 3, 5, 9, 27, 33)] == [1, 3, 5, 10, 28, 40]
    assert packed.round_rows(3, 2) == 4


def test_settings_packing_cannot_take_are_refused_in_one_line():
    config = embedding.get_config("pairs")
    config.data.pack = True
    config.task.cache_chunk_rows, config.train.grad_accum_steps = 4, 2
    checks.check_packing(config, bert_config())  # pairs pack, in micro-batches and chunks
    config.train.grad_reduce_dtype = "bfloat16"
    with pytest.raises(ConfigError, match=r"config.data.pack=True .*; config.train."
                                          r"grad_reduce_dtype='bfloat16' is not packed yet: "
                                          r"set config.data.pack=False$"):
        checks.check_packing(config, bert_config())
    config.train.grad_reduce_dtype = "float32"
    causal = dataclasses.replace(bert_config(), causal=True)
    checks.check_packing(config, causal)  # mean pooling: every token of each text
    config.task.pooling = "cls"
    with pytest.raises(ConfigError, match="cls pooling of a causal"):
        checks.check_packing(config, causal)


def train_losses(config, workdir) -> tuple[list[float], str]:
    """(the run's train losses, its log)."""
    lines = []
    tasks.train_and_evaluate(config, str(workdir), log=lines.append)
    return [r["loss"] for r in map(json.loads, (workdir / "metrics.jsonl").read_text()
                                   .splitlines()) if r["split"] == "train"], "\n".join(lines)


@pytest.mark.extended
def test_a_packed_fine_tuning_run_has_the_unpacked_runs_losses(tmp_path):
    """Dropout off (its masks follow the layout): 2 epochs of 40 pairs in batches of 16."""
    config = embedding.get_config("pairs")
    config.init_checkpoint = data.tiny_checkpoint(tmp_path)
    config.data.update(train=data.write_pairs(tmp_path / "p.jsonl", 40), columns="query,passage",
                       beir=data.write_beir(tmp_path / "beir"))
    config.max_seq_length, config.train.batch_size, config.eval.batch_size = 32, 16, 32
    config.train.num_epochs, config.log_every_steps, config.eval.at_start = 2, 1, False
    config.model.update(hidden_dropout_prob=0.0, attention_dropout_prob=0.0)
    config.optimizer.learning_rate = 2e-3
    assert config.data.pack  # the shipped pairs config packs
    config.data.pack = False
    padded, _ = train_losses(config, tmp_path / "padded")
    config.data.pack = True
    packed_losses, log = train_losses(config, tmp_path / "packed")
    assert "packed 2 text(s) of 16 rows a step into" in log
    assert len(padded) == len(packed_losses) == 6  # 16, 16 and 8 pairs an epoch
    np.testing.assert_allclose(packed_losses, padded, rtol=1e-4, atol=1e-5)
