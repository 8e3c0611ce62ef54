"""Every fine-tuning family from a ModernBERT checkpoint directory, through the job the BERT
runs use (`bertjax.tasks.train_and_evaluate`): a tiny random ModernBERT (modern_checkpoint.py)
fine-tuned a few steps per family learns (its loss falls, its dev metric rises above chance)
and writes its outputs and an export record naming transformers' ModernBertFor* class, and
the finished run predicts its dev file as the run scored it (`Predictor` and, for two
families, `python -m bertjax.predict`); the job starts from the checkpoint's encoder and MLM
prediction head, as transformers' from_pretrained does; config.model's BERT dropout fields
become a ModernBERT's, and the head options a ModernBERT cannot take are named."""

import json
import random

import embedding_data
import numpy as np
import pytest
import squad_data
import tagging_data as td
from conftest import filler_sentence, run_python
from finetune_task import train_losses, write_task
from modern_checkpoint import write_modern_checkpoint

from bertjax import checkpoint_dir
from bertjax.errors import ConfigError
from bertjax.tasks import base, checks, get_task, train_and_evaluate


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return write_modern_checkpoint(tmp_path_factory.mktemp("modern"))


def files_config(kind, checkpoint, **data):
    from experiments.finetune_files import get_config

    config = get_config(kind)
    config.init_checkpoint = checkpoint
    config.max_seq_length = 32
    config.min_bucket_length = 32  # one bucket: fewer compiles
    config.train.batch_size = 16
    config.eval.batch_size = 32
    config.optimizer.learning_rate = 1e-3
    config.log_every_steps = 1
    for key, value in data.items():
        config.data[key] = value
    return config


def export_record(workdir):
    return json.loads((workdir / "export.json").read_text())


def assert_learns(workdir, steps=4):
    """The mean loss of the last `steps` steps is below that of the first `steps`."""
    losses = train_losses(str(workdir))
    ordered = [losses[s] for s in sorted(losses)]
    assert np.mean(ordered[-steps:]) < np.mean(ordered[:steps]), ordered


def assert_predicts_as_scored(workdir, dev, summary):
    """`Predictor.from_workdir`'s metrics on the dev file are the run's best dev metrics (the
    best checkpoint, the same batches and compiled function); returns its records."""
    from bertjax import Predictor

    records, metrics = Predictor.from_workdir(str(workdir)).predict_file(dev)[1:]
    best = {k: v for k, v in summary["best"].items() if k != "epoch"}
    assert metrics == pytest.approx(best, abs=1e-9)
    return records


def predict_command(workdir, dev, out):
    result = run_python(["-m", "bertjax.predict", f"--workdir={workdir}", f"--input={dev}",
                         f"--output={out}"])
    assert result.returncode == 0, result.stderr[-3000:]
    return out


# ------------------------------------------------------------------------- config and start


def test_bert_dropout_fields_become_modernbert_ones():
    from modern_checkpoint import modern_config

    from bertjax.models import BertConfig

    bert, modern = BertConfig(), modern_config()
    fields = {"dtype": "auto", "hidden_dropout_prob": 0.1, "attention_dropout_prob": 0.2}
    assert base.model_overrides(fields, bert) == fields
    assert base.model_overrides(fields, modern) == {
        "dtype": "auto", "embedding_dropout": 0.1, "mlp_dropout": 0.1, "attention_dropout": 0.2}
    # A ModernBERT field given itself wins over the translation.
    assert base.model_overrides({**fields, "mlp_dropout": 0.0}, modern)["mlp_dropout"] == 0
    with pytest.raises(ConfigError, match="config.model.type_vocab_size: a ModernBERT"):
        base.model_overrides({"type_vocab_size": 2}, modern)
    with pytest.raises(ConfigError, match="config.model.mlp_dropout: a BERT"):
        base.model_overrides({"mlp_dropout": 0.1}, bert)


def test_head_options_a_model_cannot_take_are_named(checkpoint, tmp_path):
    config = files_config("classification", checkpoint)
    config.task.bilstm_units = 8
    with pytest.raises(ConfigError, match="config.task.bilstm_units=8: the \\+ BiLSTM head"):
        checks.check(config, str(tmp_path / "run"))
    config.task.bilstm_units = 0
    config.task.classifier_dropout = 1.5
    with pytest.raises(ConfigError, match="config.task.classifier_dropout=1.5"):
        checks.check(config, str(tmp_path / "run"))
    config.task.classifier_dropout = 0.0
    config.model.scan_layers = True
    with pytest.raises(ConfigError, match="config.model.scan_layers: a ModernBERT"):
        checks.check(config, str(tmp_path / "run"))
    from conftest import KEYWORD_VOCAB, write_tiny_checkpoint

    bert = files_config("classification", write_tiny_checkpoint(tmp_path, KEYWORD_VOCAB))
    bert.task.classifier_pooling = "mean"
    with pytest.raises(ConfigError, match="classifier_pooling='mean': a BERT's heads pool with "
                                          "cls"):
        checks.check(bert, str(tmp_path / "run"))


@pytest.mark.parametrize("family", ["classification", "embedding"])
def test_the_job_starts_from_the_encoder_and_the_mlm_prediction_head(checkpoint, tmp_path,
                                                                     family):
    """transformers' ModernBertFor*.from_pretrained of a ModernBertForMaskedLM checkpoint loads
    its `head` by name: the job does too (the embedding family pools the encoder alone)."""
    if family == "embedding":
        from experiments.embedding import get_config

        config = get_config("pairs")
        config.init_checkpoint = checkpoint
        config.data.train = embedding_data.write_pairs(tmp_path / "p.jsonl", 8)
        config.data.columns = "query,passage"
        config.data.beir = embedding_data.write_beir(tmp_path / "beir")
        config.max_seq_length = 32
    else:
        write_task(tmp_path)
        config = files_config("classification", checkpoint, train=str(tmp_path / "train.jsonl"),
                              validation=str(tmp_path / "dev.jsonl"))
    job = base.FineTuningJob(get_task(config), config, log=lambda *_: None)
    # config.model's hidden_dropout_prob, translated.
    assert job.model_config.mlp_dropout == config.model.hidden_dropout_prob
    loaded = job.pretrained_params()
    stored = checkpoint_dir.load_pretrained(checkpoint)[1]
    want = {"model"} if family == "embedding" else {"model", "head"}
    assert set(loaded) == want
    import jax

    for group in want:
        jax.tree.map(np.testing.assert_array_equal, loaded[group], stored[group])
    shapes = jax.eval_shape(job.init_params, jax.random.key(0))
    assert set(shapes) == (want if family == "embedding" else want | {"classifier"})


def test_a_dry_run_counts_modernbert_flops(checkpoint, tmp_path):
    from bertjax.models.modernbert import flops as modern_flops
    from bertjax.tasks import dry_run_job

    write_task(tmp_path)
    config = files_config("classification", checkpoint, train=str(tmp_path / "train.jsonl"),
                          validation=str(tmp_path / "dev.jsonl"))
    job = dry_run_job(config, log=lambda *_: None)
    assert job.stages[0].flops_per_example == 3.0 * modern_flops.forward_flops(
        job.model_config, 32, 0)


# ------------------------------------------------------------------------- the families


def test_classification_learns_and_exports_the_modernbert_class(checkpoint, tmp_path):
    write_task(tmp_path)
    config = files_config("classification", checkpoint, train=str(tmp_path / "train.jsonl"),
                          validation=str(tmp_path / "dev.jsonl"),
                          test=str(tmp_path / "test.jsonl"))
    config.train.num_epochs = 3
    config.eval.every_steps = 6
    config.task.classifier_pooling = "mean"
    summary = train_and_evaluate(config, str(tmp_path / "run"), log=lambda *_: None)
    assert_learns(tmp_path / "run")
    assert summary["primary_metric"] == "accuracy"
    assert summary["best"]["accuracy"] >= 0.75, summary["best"]  # half are "good"
    assert (tmp_path / "run" / "submission" / "test.tsv").read_text().count("\n") == 25
    record = export_record(tmp_path / "run")
    assert record["architecture"] == "ModernBertForSequenceClassification"
    assert record["model"]["model_type"] == "modernbert"
    assert record["extra_config"] == {"classifier_pooling": "mean", "classifier_dropout": 0.1}
    assert record["labels"] == ["0", "1"] and record["vocab"] == "vocab.txt"
    dev = str(tmp_path / "dev.jsonl")
    records = assert_predicts_as_scored(tmp_path / "run", dev, summary)
    out = predict_command(tmp_path / "run", dev, tmp_path / "predicted.jsonl")
    written = [json.loads(x) for x in out.read_text().splitlines()]
    assert [r["label"] for r in written] == [r["label"] for r in records]


@pytest.mark.slow
@pytest.mark.extended
def test_regression_and_multiple_choice_learn(checkpoint, tmp_path):
    rng = random.Random(1)
    with open(tmp_path / "reg.jsonl", "w") as f:
        for _ in range(160):
            count = rng.randint(0, 3)  # the score is the number of "good"s
            f.write(json.dumps({"text": filler_sentence(rng, "good", count),
                                "score": float(count)}) + "\n")
    config = files_config("regression", checkpoint, train=str(tmp_path / "reg.jsonl"),
                          validation=str(tmp_path / "reg.jsonl"), label="score")
    config.train.num_epochs = 3
    summary = train_and_evaluate(config, str(tmp_path / "reg"), log=lambda *_: None)
    assert_learns(tmp_path / "reg")
    assert summary["best"]["pearson"] > 0.5, summary["best"]
    assert export_record(tmp_path / "reg")["problem_type"] == "regression"
    assert_predicts_as_scored(tmp_path / "reg", str(tmp_path / "reg.jsonl"), summary)

    with open(tmp_path / "mc.jsonl", "w") as f:
        for _ in range(128):
            answer = rng.randrange(3)  # the right ending is the one with "good"
            f.write(json.dumps({"context": filler_sentence(rng), "answer": answer, **{
                c: filler_sentence(rng, "good" if i == answer else "bad")
                for i, c in enumerate("abc")}}) + "\n")
    config = files_config("multiple_choice", checkpoint, train=str(tmp_path / "mc.jsonl"),
                          validation=str(tmp_path / "mc.jsonl"), text_a="context",
                          choices="a,b,c", label="answer")
    config.train.num_epochs = 4
    summary = train_and_evaluate(config, str(tmp_path / "mc"), log=lambda *_: None)
    assert_learns(tmp_path / "mc")
    assert summary["best"]["accuracy"] > 0.5, summary["best"]  # chance is 1/3
    assert export_record(tmp_path / "mc")["architecture"] == "ModernBertForMultipleChoice"
    assert_predicts_as_scored(tmp_path / "mc", str(tmp_path / "mc.jsonl"), summary)


@pytest.mark.slow
def test_token_classification_learns_the_entities(checkpoint, tmp_path):
    from experiments.ner import get_config

    paths = {}
    for name, seed, n in (("train", 1, 160), ("dev", 2, 32)):
        paths[name] = str(tmp_path / f"{name}.conll")
        td.write_conll(tmp_path / f"{name}.conll", td.dataset(seed, n), docs_every=4)
    config = get_config("files")
    config.init_checkpoint = checkpoint
    config.data.train, config.data.validation, config.data.test = (
        paths["train"], paths["dev"], paths["dev"])
    config.data.scheme, config.data.token_column = "iob2", 0
    config.max_seq_length, config.train.batch_size, config.eval.batch_size = 32, 16, 32
    config.min_bucket_length = 32
    config.train.num_epochs, config.log_every_steps = 4, 1
    config.optimizer.learning_rate = 1e-3
    summary = train_and_evaluate(config, str(tmp_path / "run"), log=lambda *_: None)
    assert_learns(tmp_path / "run")
    assert summary["primary_metric"] == "f1" and summary["best"]["f1"] > 0.3, summary["best"]
    assert (tmp_path / "run" / "predictions" / "test.conll").exists()
    record = export_record(tmp_path / "run")
    assert record["architecture"] == "ModernBertForTokenClassification"
    assert {"O", "B-PER", "I-LOC"} <= set(record["labels"])
    # The test file is the dev file: its predictions (the best checkpoint's) are the command's.
    assert_predicts_as_scored(tmp_path / "run", paths["dev"], summary)
    out = predict_command(tmp_path / "run", paths["dev"], tmp_path / "predicted.conll")
    assert out.read_text() == (tmp_path / "run" / "predictions" / "test.conll").read_text()


@pytest.mark.slow
@pytest.mark.extended
def test_squad_learns_spans(checkpoint, tmp_path):
    """SQuAD v1.1 with the WordPiece vocabulary; v2.0 (its null threshold in the export) runs on
    the BPE tokenizer.json in tests/tasks/squad/test_squad_bpe_features.py."""
    from experiments.squad import get_config

    config = get_config("v1")
    config.init_checkpoint = checkpoint
    config.data.train = squad_data.generate(tmp_path / "train.json", 200, seed=1)
    config.data.validation = squad_data.generate(tmp_path / "dev.json", 40, seed=2)
    config.max_seq_length = 64
    config.task.doc_stride, config.task.max_query_length = 16, 10
    config.train.batch_size, config.eval.batch_size, config.train.num_epochs = 32, 32, 3
    config.optimizer.learning_rate = 1e-3
    config.log_every_steps = 1
    summary = train_and_evaluate(config, str(tmp_path / "run"), log=lambda *_: None)
    assert_learns(tmp_path / "run", steps=3)
    assert summary["primary_metric"] == "f1"
    assert (tmp_path / "run" / "predictions.json").exists()
    assert export_record(tmp_path / "run")["architecture"] == "ModernBertForQuestionAnswering"
    assert_predicts_as_scored(tmp_path / "run", config.data.validation, summary)


@pytest.mark.slow
@pytest.mark.extended
def test_embedding_pairs_raise_ndcg_above_the_starting_checkpoint(checkpoint, tmp_path):
    from experiments.embedding import get_config

    config = get_config("pairs")
    config.init_checkpoint = checkpoint
    config.data.train = embedding_data.write_pairs(tmp_path / "p.jsonl", 320, negatives=1)
    config.data.columns = "query,passage,negative1"
    config.data.beir = embedding_data.write_beir(tmp_path / "beir")
    config.max_seq_length = 32
    config.train.batch_size, config.eval.batch_size, config.train.num_epochs = 32, 32, 3
    config.optimizer.learning_rate = 2e-3
    lines = []
    summary = train_and_evaluate(config, str(tmp_path / "run"), log=lines.append)
    before = json.loads(next(x for x in lines if x.startswith("eval before training"))
                        .split(": ", 1)[1])["ndcg@10"]
    assert summary["best"]["ndcg@10"] > before + 0.1, (before, summary["best"])
    record = export_record(tmp_path / "run")
    assert record["architecture"] == "ModernBertModel" and record["pooling"]["mode"] == "mean"
    # to_hf: a ModernBertModel with the sentence-transformers modules, whose vectors are the
    # run's.
    from convert_cli import convert_main
    from sentence_transformers import SentenceTransformer

    from bertjax.serving.embedder import Embedder

    convert_main(["to_hf", "--input", tmp_path / "run", "--output", tmp_path / "st"])
    texts = ["topic3 word1 word7", "word2 topic11 word5 word9 word1", "topic0"]
    ours = Embedder.from_workdir(str(tmp_path / "run"))(texts)
    theirs = SentenceTransformer(str(tmp_path / "st"), device="cpu").encode(texts)
    np.testing.assert_allclose(ours, theirs, atol=1e-5)
    np.testing.assert_allclose(Embedder.from_export(str(tmp_path / "st"))(texts), ours,
                               atol=1e-5)


@pytest.mark.slow
def test_feature_based_tagging_reads_the_modernbert_layers(checkpoint, tmp_path):
    """The BiLSTM tagger trains on a frozen ModernBERT's cached layers (`heads.hidden_states`,
    which tests/serving/test_modern_serving.py checks against transformers)."""
    from experiments.ner_feature_based import get_config

    td.write_conll(tmp_path / "ner.conll", td.dataset(1, 64), docs_every=4)
    config = get_config("weighted_sum_all,files")  # all three: embeddings, 2 layers
    config.init_checkpoint = checkpoint
    config.data.train = config.data.validation = str(tmp_path / "ner.conll")
    config.data.scheme, config.data.token_column = "iob2", 0
    config.feature_based.cache_dir = str(tmp_path / "cache")
    config.feature_based.lstm_units = 16
    config.max_seq_length = config.min_bucket_length = 32
    config.train.batch_size, config.eval.batch_size, config.train.num_epochs = 16, 32, 3
    config.log_every_steps = 1
    summary = train_and_evaluate(config, str(tmp_path / "run"), log=lambda *_: None)
    assert_learns(tmp_path / "run", steps=3)
    assert summary["primary_metric"] == "f1"
