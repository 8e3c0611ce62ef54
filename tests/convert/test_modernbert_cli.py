"""`python -m bertjax.convert from_hf / to_hf` with ModernBERT: transformers' directories
(ModernBertForMaskedLM, ModernBertModel, a task head's class; a tokenizer.json vocabulary, as
transformers 5 saves one) become bertjax checkpoint directories that load_pretrained reads, and
back, tensor for tensor; a fine-tuning workdir of each family becomes its task's ModernBertFor*
class, whose logits in transformers equal bertjax's for the run's best checkpoint (1e-5), with
the run's labels, pooling and tokenizer."""

import json
import random

import jax.numpy as jnp
import numpy as np
import pytest
from conftest import filler_sentence
from convert_cli import convert_main
from finetune_task import write_task
from modern_checkpoint import VOCAB, write_hf_modern, write_modern_checkpoint
from safetensors.numpy import load_file

from bertjax import checkpoint_dir
from bertjax.convert import modernbert
from bertjax.train.checkpoints import read_params

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

TEXTS = ["filler3 good filler7 filler1", "bad filler2", "filler9 filler4 good good filler0 "
         "filler11 filler12 filler13 filler14 filler15 filler16 filler17 filler18"]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return write_modern_checkpoint(tmp_path_factory.mktemp("modern"))


def _encode(tokenizer, texts, length=32):
    """ids, mask [n, length] of bertjax's tokenizer, right-padded."""
    encodings = [tokenizer.encode(t, max_seq_length=length) for t in texts]
    ids = np.array([e.input_ids for e in encodings], np.int64)
    mask = np.array([e.input_mask for e in encodings], np.int64)
    return ids, mask


def _torch(ids, mask):
    return {"input_ids": torch.tensor(ids), "attention_mask": torch.tensor(mask)}


# ----------------------------------------------------------------------- checkpoint directories


def test_masked_lm_round_trip_through_a_checkpoint_directory(tmp_path, capsys):
    source = write_hf_modern(tmp_path / "hf")
    convert_main(["from_hf", "--input", tmp_path / "hf", "--output", tmp_path / "ckpt"])
    assert "wrote" in capsys.readouterr().out
    config, params, tokenizer = checkpoint_dir.load_pretrained(tmp_path / "ckpt")
    assert config.to_dict()["model_type"] == "modernbert" and config.vocab_size == len(VOCAB)
    _, want = modernbert.read_hf(tmp_path / "hf")
    for path in ("model", "head", "decoder_bias"):
        import jax

        jax.tree.map(np.testing.assert_array_equal, params[path], want[path])
    # The tokenizer.json came along; bertjax's ids are transformers' own.
    hf_tokenizer = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
    for text in TEXTS:
        assert tokenizer.encode(text).input_ids == hf_tokenizer(text)["input_ids"]

    convert_main(["to_hf", "--input", tmp_path / "ckpt", "--output", tmp_path / "out"])
    assert "ModernBertForMaskedLM" in capsys.readouterr().out
    saved = load_file(str(tmp_path / "hf" / "model.safetensors"))
    written = load_file(str(tmp_path / "out" / "model.safetensors"))
    assert written.keys() == saved.keys()
    for name in saved:
        np.testing.assert_array_equal(written[name], saved[name], err_msg=name)
    loaded = transformers.ModernBertForMaskedLM.from_pretrained(tmp_path / "out").eval()
    ids, mask = _encode(tokenizer, TEXTS)
    with torch.no_grad():
        np.testing.assert_array_equal(loaded(**_torch(ids, mask)).logits.numpy(),
                                      source(**_torch(ids, mask)).logits.numpy())
    out_tokenizer = transformers.AutoTokenizer.from_pretrained(tmp_path / "out")
    assert [out_tokenizer(t)["input_ids"] for t in TEXTS] == [
        hf_tokenizer(t)["input_ids"] for t in TEXTS]

    convert_main(["to_hf", "--input", tmp_path / "ckpt", "--output", tmp_path / "enc",
                  "--architecture", "BertModel"])  # a BERT name: its ModernBERT class
    encoder = transformers.AutoModel.from_pretrained(tmp_path / "enc").eval()
    assert type(encoder).__name__ == "ModernBertModel"
    with torch.no_grad():
        np.testing.assert_array_equal(encoder(**_torch(ids, mask)).last_hidden_state.numpy(),
                                      source.model(**_torch(ids, mask)).last_hidden_state.numpy())


@pytest.mark.parametrize("cls_name, initialised, skipped", [
    ("ModernBertModel", ["head", "decoder_bias"], 0),
    ("ModernBertForSequenceClassification", ["decoder_bias"], 2),
])
def test_encoder_and_task_head_sources_are_completed_and_reported(tmp_path, capsys, cls_name,
                                                                  initialised, skipped):
    write_hf_modern(tmp_path / "hf", cls_name)
    convert_main(["from_hf", "--input", tmp_path / "hf", "--output", tmp_path / "ckpt"])
    out = capsys.readouterr().out
    conversion = json.loads((tmp_path / "ckpt" / "conversion.json").read_text())
    assert conversion["initialised"] == initialised
    assert len(conversion["skipped"]) == skipped
    assert ("initialised (not in the source): the MLM decoder's bias" in out)
    if skipped:
        assert "classifier.weight" in conversion["skipped"]
    config, params, _ = checkpoint_dir.load_pretrained(tmp_path / "ckpt")
    assert config.vocab_size == len(VOCAB) and set(params) == {"model", "head",
                                                                "decoder_bias"}


def test_a_bad_modernbert_source_is_one_line(tmp_path):
    write_hf_modern(tmp_path / "hf")
    values = json.loads((tmp_path / "hf" / "config.json").read_text())
    (tmp_path / "hf" / "config.json").write_text(json.dumps({**values, "mlp_bias": True}))
    with pytest.raises(SystemExit) as caught:
        convert_main(["from_hf", "--input", tmp_path / "hf", "--output", tmp_path / "ckpt"])
    assert str(caught.value).startswith("error: --input ") and "\n" not in str(caught.value)
    assert "mlp_bias=True is not supported" in str(caught.value)
    assert not (tmp_path / "ckpt").exists()


# ----------------------------------------------------------------------- fine-tuning workdirs


def _files_config(kind, checkpoint, **data):
    from experiments.finetune_files import get_config

    config = get_config(kind)
    config.init_checkpoint = checkpoint
    config.max_seq_length = config.min_bucket_length = 32
    config.train.batch_size, config.eval.batch_size = 16, 32
    config.train.num_epochs = 1
    config.optimizer.learning_rate = 1e-3
    config.log_every_steps = 1000
    config.checkpoint.async_save = False
    config.data.update(data)
    return config


def _train(config, workdir):
    from bertjax.tasks import train_and_evaluate

    train_and_evaluate(config, str(workdir), log=lambda *_: None)
    return workdir


def _best_params(workdir):
    return read_params(str(workdir), json.loads((workdir / "results.json").read_text())[
        "best_step"])


def _bertjax_outputs(workdir, ids, mask):
    """The run's task module on its best checkpoint."""
    from bertjax.serving.runs import load_workdir

    trained = load_workdir(str(workdir))
    model = trained.task.model(trained.model_config)
    return model.apply({"params": _best_params(workdir)}, jnp.asarray(ids), None,
                       jnp.asarray(mask))


@pytest.fixture(scope="module")
def classification_run(tmp_path_factory):
    """A classifier fine-tuned from transformers' ModernBertForMaskedLM converted by from_hf
    (a tokenizer.json vocabulary, as transformers 5 saves one)."""
    root = tmp_path_factory.mktemp("cls")
    write_hf_modern(root / "hf")
    convert_main(["from_hf", "--input", root / "hf", "--output", root / "ckpt"])
    write_task(root)
    config = _files_config("classification", str(root / "ckpt"),
                           train=str(root / "train.jsonl"),
                           validation=str(root / "dev.jsonl"), labels="0,1")
    config.task.classifier_pooling = "mean"
    return _train(config, root / "run")


def test_a_fine_tuned_classifier_is_transformers_with_its_logits(classification_run, tmp_path):
    convert_main(["to_hf", "--input", classification_run, "--output", tmp_path / "hf"])
    hf_config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert hf_config["architectures"] == ["ModernBertForSequenceClassification"]
    assert hf_config["id2label"] == {"0": "0", "1": "1"}
    assert (hf_config["classifier_pooling"], hf_config["classifier_dropout"]) == ("mean", 0.1)
    model = transformers.AutoModelForSequenceClassification.from_pretrained(
        tmp_path / "hf").eval()
    assert type(model).__name__ == "ModernBertForSequenceClassification"
    tokenizer = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
    from bertjax.serving.runs import load_workdir

    assert json.loads((classification_run / "export.json").read_text())["vocab"] == (
        "tokenizer.json")
    ours_tokenizer = load_workdir(str(classification_run)).tokenizer
    assert [tokenizer(t)["input_ids"] for t in TEXTS] == [
        ours_tokenizer.encode(t).input_ids for t in TEXTS]
    batch = tokenizer(TEXTS, padding="max_length", max_length=32, return_tensors="pt")
    ours = _bertjax_outputs(classification_run, batch["input_ids"].numpy(),
                            batch["attention_mask"].numpy())
    with torch.no_grad():
        theirs = model(**batch).logits.numpy()
    np.testing.assert_allclose(np.asarray(ours), theirs, rtol=0, atol=1e-5)
    # The export predicts by itself as the run does.
    from bertjax import Predictor

    exported = Predictor.from_export(str(tmp_path / "hf"))(TEXTS)
    run = Predictor.from_workdir(str(classification_run))(TEXTS)
    for a, b in zip(exported, run):
        assert a["label"] == b["label"]
        np.testing.assert_allclose(list(a["probabilities"].values()),
                                   list(b["probabilities"].values()), atol=1e-5)


@pytest.mark.slow
@pytest.mark.extended
def test_every_fine_tuned_family_is_its_transformers_class(checkpoint, tmp_path):
    """Token classification, QA and multiple choice runs exported: transformers' logits equal
    the run's best checkpoint's (1e-5) on the export's own tokenizer's rows."""
    import squad_data
    import tagging_data as td

    from experiments.ner import get_config as ner_config
    from experiments.squad import get_config as squad_config

    rng = random.Random(3)
    runs = {}
    td.write_conll(tmp_path / "ner.conll", td.dataset(1, 48), docs_every=4)
    config = ner_config("files")
    config.init_checkpoint = checkpoint
    config.data.train = config.data.validation = str(tmp_path / "ner.conll")
    config.data.scheme, config.data.token_column = "iob2", 0
    config.max_seq_length = config.min_bucket_length = 32
    config.train.batch_size, config.eval.batch_size, config.train.num_epochs = 16, 32, 1
    config.log_every_steps = 1000
    runs["ModernBertForTokenClassification"] = _train(config, tmp_path / "ner")

    config = squad_config("v2")
    config.init_checkpoint = checkpoint
    config.data.train = config.data.validation = squad_data.generate(
        tmp_path / "qa.json", 40, seed=1, impossible_rate=0.3)
    config.max_seq_length, config.task.doc_stride, config.task.max_query_length = 64, 16, 10
    config.train.batch_size, config.eval.batch_size, config.train.num_epochs = 32, 32, 1
    config.log_every_steps = 1000
    runs["ModernBertForQuestionAnswering"] = _train(config, tmp_path / "qa")

    with open(tmp_path / "mc.jsonl", "w") as f:
        for _ in range(32):
            answer = rng.randrange(3)
            f.write(json.dumps({"context": filler_sentence(rng), "answer": answer, **{
                c: filler_sentence(rng, "good" if i == answer else "bad")
                for i, c in enumerate("abc")}}) + "\n")
    config = _files_config("multiple_choice", checkpoint, train=str(tmp_path / "mc.jsonl"),
                           validation=str(tmp_path / "mc.jsonl"), text_a="context",
                           choices="a,b,c", label="answer")
    runs["ModernBertForMultipleChoice"] = _train(config, tmp_path / "mc")

    ids = np.array([[2] + [5 + (7 * i + j) % 30 for j in range(20)] + [3] + [0] * 10
                    for i in range(3)])
    mask = (ids != 0).astype(np.int64)
    for cls_name, workdir in runs.items():
        out = tmp_path / f"hf_{cls_name}"
        convert_main(["to_hf", "--input", workdir, "--output", out])
        hf_config = json.loads((out / "config.json").read_text())
        assert hf_config["architectures"] == [cls_name]
        model = getattr(transformers, cls_name).from_pretrained(out).eval()
        if cls_name == "ModernBertForMultipleChoice":
            mc_ids, mc_mask = ids[None], mask[None]  # one question, three choices
            ours = _bertjax_outputs(workdir, mc_ids, mc_mask)
            with torch.no_grad():
                theirs = model(**_torch(mc_ids, mc_mask)).logits.numpy()
            np.testing.assert_allclose(np.asarray(ours), theirs, atol=1e-5)
            continue
        ours = _bertjax_outputs(workdir, ids, mask)
        with torch.no_grad():
            result = model(**_torch(ids, mask))
        real = mask.astype(bool)
        if cls_name == "ModernBertForTokenClassification":
            assert len(hf_config["id2label"]) == model.config.num_labels > 3
            np.testing.assert_allclose(np.asarray(ours)[real], result.logits.numpy()[real],
                                       atol=1e-5)
        else:
            assert "null_score_diff_threshold" in hf_config
            for mine, theirs in zip(ours, (result.start_logits, result.end_logits)):
                np.testing.assert_allclose(np.asarray(mine)[real], theirs.numpy()[real],
                                           atol=1e-5)
