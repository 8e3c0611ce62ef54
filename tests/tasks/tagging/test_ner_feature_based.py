"""The feature-based approach (paper Table 7): the cache holds the right layers (checked
against extract_features), the six combinations have the expected shapes, training never runs
or changes the encoder and later runs read the cache, and a tiny tagger reaches F1 ≥ 0.95."""

import numpy as np
import pytest
import tagging_data as td

from bertjax.models.tagging import FeatureBasedTagger, combine_layers
from bertjax.tasks.tagging import schemes
from bertjax.tasks.tagging.feature_based import VARIANTS, variant_layers


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("fb")
    checkpoint = td.write_checkpoint(root, num_layers=4)
    for name, seed, n in (("eng.train", 0, 300), ("eng.testa", 1, 80), ("eng.testb", 2, 40)):
        data = [(w, schemes.convert(t, "iob2", "iob1")) for w, t in td.dataset(seed, n)]
        td.write_conll(root / name, data, docs_every=10)
    return root, checkpoint


def make_config(root, checkpoint, variant, **fb):
    from experiments.ner_feature_based import get_config

    config = get_config(variant)
    config.init_checkpoint, config.data.dir = checkpoint, str(root)
    config.max_seq_length, config.data.stride, config.min_bucket_length = 32, 8, 32
    config.train.batch_size, config.eval.batch_size = 16, 32
    config.log_every_steps = 1000
    config.feature_based.cache_dir = str(root / "cache")
    config.feature_based.lstm_units = 32
    config.feature_based.update(fb)
    return config


@pytest.mark.slow
def test_variants_take_the_right_layers():
    assert [variant_layers(v, 12) for v in VARIANTS] == [
        ([0], "single"), ([11], "single"), ([12], "single"), ([9, 10, 11, 12], "weighted"),
        ([9, 10, 11, 12], "concat"), (list(range(13)), "weighted")]
    x = np.random.default_rng(0).normal(size=(2, 5, 4, 8)).astype(np.float32)
    assert combine_layers(x, "single").shape == (2, 5, 8)
    np.testing.assert_array_equal(combine_layers(x, "concat")[:, :, 8:16], x[:, :, 1])
    mixed = combine_layers(x, "weighted", np.zeros(4, np.float32), np.float32(2.0))
    np.testing.assert_allclose(mixed, 2.0 * x.mean(axis=2), rtol=1e-5, atol=1e-6)
    import flax.linen as nn
    import jax

    for variant in VARIANTS:  # the model's input width per combination
        layers, mode = variant_layers(variant, 4)
        model = FeatureBasedTagger(7, len(layers), mode, lstm_units=6)
        features = np.zeros((2, 5, len(layers), 8), np.float32)
        params = model.init(jax.random.key(0), features, np.ones((2, 5), np.int32))["params"]
        params = nn.unbox(params)  # the BiLSTM's params carry logical axis names
        width = 8 * len(layers) if mode == "concat" else 8
        assert params["lstm_0_forward"]["ii"]["kernel"].shape == (width, 6)
        assert model.apply({"params": params}, features, np.ones((2, 5))).shape == (2, 5, 7)
        assert "bert" not in params


@pytest.mark.slow
def test_cache_holds_the_encoder_layers_of_extract_features(data_dir):
    import jax

    from bertjax.checkpoint_dir import load_pretrained
    from bertjax.models import BertModel
    from bertjax.serving.extraction import FeatureExtractor
    from bertjax.tasks import FineTuningJob, get_task

    root, checkpoint = data_dir
    config = make_config(root, checkpoint, "weighted_sum_all", cache_dtype="float32",
                         cache_dir=str(root / "cache32"))
    config.data.document_context = False  # rows = [CLS] sentence [SEP], as extract_features
    task = get_task(config)
    job = FineTuningJob(task, config, log=lambda *_: None)
    model_config, params, tokenizer = load_pretrained(checkpoint)
    extractor = FeatureExtractor(model_config, params, tokenizer, [0, 1, 2, 3], 32, 8)
    sentences = job.splits.dev["dev"][:6]
    features = job.dev_features["dev"]
    reference = list(extractor(" ".join(s.words) for s in sentences))
    ids = np.zeros((len(sentences), 32), np.int32)
    for row in range(len(sentences)):
        assert features.sentence[row] == row and len(features.input_ids[row]) <= 30
        n = len(features.input_ids[row])
        for k in range(4):  # extract_features' layer k is hidden_states[k + 1]
            values = np.array([t["layers"][k]["values"] for t in reference[row]["features"]])
            np.testing.assert_allclose(features.cache.read(k + 1, row), values[1:1 + n],
                                       atol=2e-6)
        ids[row, :n + 2] = [tokenizer.cls_id, *features.input_ids[row], tokenizer.sep_id]
    # The embedding output (hidden_states[0]), which extract_features does not address.
    out = jax.jit(BertModel(model_config).apply, static_argnames="return_all_layers")(
        {"params": params["bert"]}, ids, 0 * ids, (ids > 0).astype(np.int32),
        return_all_layers=True)
    for row in range(len(sentences)):
        n = len(features.input_ids[row])
        np.testing.assert_allclose(features.cache.read(0, row),
                                   np.asarray(out["hidden_states"][0, row, 1:n + 1]), atol=1e-5)
    for variant in VARIANTS:  # every variant's batch: its layers, in order
        task.layers, task.mode = variant_layers(variant, 4)
        batch = next(task.batches(features, 8, shuffle=False))
        assert batch["features"].shape == (8, 32, len(task.layers), 32)
        r = batch["example_index"][0]
        n = len(features.input_ids[r])
        for k, layer in enumerate(task.layers):
            np.testing.assert_array_equal(batch["features"][0, :n, k],
                                          features.cache.read(layer, r))
        assert not batch["features"][0, n:].any()


@pytest.mark.slow
@pytest.mark.extended
def test_training_reads_the_cache_and_leaves_the_encoder_unchanged(data_dir, tmp_path):
    import jax

    from bertjax.checkpoint_dir import load_pretrained
    from bertjax.tasks import FineTuningJob, get_task
    from bertjax.train import loop

    root, checkpoint = data_dir
    before = load_pretrained(checkpoint)[1]["bert"]
    config = make_config(root, checkpoint, "last", cache_dir=str(tmp_path / "cache"))
    config.train.num_epochs = 10
    config.optimizer.learning_rate = 1e-2
    config.eval.every_steps = 95  # every 5 epochs of 19 steps
    task = get_task(config)
    job = FineTuningJob(task, config, log=lambda *_: None)
    first_pass = task.encoder_batches
    assert first_pass > 0
    summary = loop.train(job, config, str(tmp_path / "run"), log=lambda *_: None)
    print("feature-based dev", summary["best"])
    assert summary["best"]["f1"] >= 0.95
    assert task.encoder_batches == first_pass  # every epoch and evaluation read the cache
    # The trained state holds no encoder, so the optimizer cannot have changed it ...
    abstract = jax.eval_shape(job.init_params, jax.random.key(0))
    assert set(abstract) == {"lstm_0_forward", "lstm_0_backward", "lstm_1_forward",
                             "lstm_1_backward", "classifier"}
    # ... and the checkpoint the features came from is bitwise what it was.
    after = load_pretrained(checkpoint)[1]["bert"]
    for a, b in zip(jax.tree.leaves(before), jax.tree.leaves(after)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    # A second run over the same data and encoder computes nothing: it reads the cache.
    again = get_task(make_config(root, checkpoint, "concat_last_four",
                                 cache_dir=str(tmp_path / "cache"), cache_layers="1,2"))
    FineTuningJob(again, make_config(root, checkpoint, "concat_last_four",
                                     cache_dir=str(tmp_path / "cache")), log=lambda *_: None)
    assert again.encoder_batches > 0  # layers 1..3 were not cached yet ...
    third = get_task(make_config(root, checkpoint, "weighted_sum_last_four",
                                 cache_dir=str(tmp_path / "cache")))
    FineTuningJob(third, make_config(root, checkpoint, "weighted_sum_last_four",
                                     cache_dir=str(tmp_path / "cache")), log=lambda *_: None)
    assert third.encoder_batches == 0  # ... now every layer it needs is


def test_steps_are_counted_without_building_batches(data_dir, tmp_path, monkeypatch):
    """The job counts an epoch's steps from the batch plan: no batch (and so no cache read)
    is built for it, and the count is the number of batches an epoch yields."""
    from bertjax.tasks import FineTuningJob, get_task
    from bertjax.tasks.tagging.feature_based import FeatureBasedTask

    root, checkpoint = data_dir
    built = []
    original = FeatureBasedTask._batch
    monkeypatch.setattr(FeatureBasedTask, "_batch",
                        lambda self, *a, **k: built.append(1) or original(self, *a, **k))
    config = make_config(root, checkpoint, "last", cache_dir=str(tmp_path / "cache"))
    task = get_task(config)
    job = FineTuningJob(task, config, log=lambda *_: None)
    assert built == []
    epoch = list(task.batches(job.train_features, config.train.batch_size, shuffle=True,
                              seed=3))
    assert job.steps_per_epoch == len(epoch) == len(built) > 1
