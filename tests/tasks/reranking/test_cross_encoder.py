"""sentence-transformers CrossEncoder directories in and out: from_hf keeps the classifier, the
activation (CrossEncoder's default sigmoid, or the configured identity) and the max length;
`Reranker.from_checkpoint` then scores and ranks as CrossEncoder.predict / rank within 1e-5;
to_hf writes it back as a CrossEncoder of the same scores; the reranking family starts from
the converted classifier; `predict rerank` writes each query's candidates reordered; what
bertjax cannot compute the same way stops with one line."""

import json
import shutil

import cross_encoders as ce
import numpy as np
import pytest
import reranking_data as data
from conftest import run_python
from convert_cli import convert_main

from bertjax import Reranker, checkpoint_dir, tasks
from bertjax.errors import CheckpointError
from experiments import reranking


@pytest.fixture(scope="module", params=[None, "identity"], ids=["default", "identity"])
def converted(request, tmp_path_factory):
    """(CrossEncoder directory, its conversion, the activation CrossEncoder applies)."""
    root = tmp_path_factory.mktemp(f"ce_{request.param}")
    return (*convert(root, request.param), request.param or "sigmoid")


def convert(root, activation=None):
    """(a tiny CrossEncoder saved under root, its bertjax checkpoint directory)."""
    source = ce.save_cross_encoder(root, activation)
    convert_main(["from_hf", "--input", source, "--output", root / "ckpt"])
    return source, root / "ckpt"


def test_scores_and_rankings_match_cross_encoder(converted):
    source, checkpoint, activation = converted
    reference = ce.reference(source)
    assert type(reference.activation_fn).__name__.lower() == activation
    ours = Reranker.from_checkpoint(str(checkpoint))
    assert ours.activation == activation and ours.engine.max_seq_length == ce.MAX_LENGTH
    np.testing.assert_allclose(ours.score(ce.PAIRS), reference.predict(ce.PAIRS), atol=1e-5)
    query, passages = ce.PAIRS[0][0], [p for _, p in ce.PAIRS]
    theirs = reference.rank(query, passages)
    ranked = ours.rank(query, passages, top_k=3)
    assert [r["corpus_id"] for r in ranked] == [r["corpus_id"] for r in theirs[:3]]
    np.testing.assert_allclose([r["score"] for r in ranked], [r["score"] for r in theirs[:3]],
                               atol=1e-5)


def test_to_hf_writes_the_cross_encoder_back(converted, tmp_path, capsys):
    source, checkpoint, activation = converted
    convert_main(["to_hf", "--input", checkpoint, "--output", tmp_path / "back"])
    assert f"CrossEncoder, {activation} activation at predict, max_length={ce.MAX_LENGTH}" in \
        capsys.readouterr().out
    back = ce.reference(tmp_path / "back")
    assert type(back.activation_fn).__name__.lower() == activation
    assert back.max_seq_length == ce.MAX_LENGTH
    np.testing.assert_allclose(back.predict(ce.PAIRS), ce.reference(source).predict(ce.PAIRS),
                               atol=1e-6)


def test_the_reranking_family_starts_from_the_converted_classifier(converted):
    _, checkpoint, activation = converted
    config = reranking.get_config("labelled")
    config.init_checkpoint = str(checkpoint)
    tasks.own_max_seq_length(config)
    assert config.max_seq_length == ce.MAX_LENGTH  # 0: the CrossEncoder's own
    task = tasks.get_task(config)
    assert task.activation == activation
    model_config, params, _ = checkpoint_dir.load_pretrained(checkpoint)
    start = task.initial_params(model_config, params)
    np.testing.assert_array_equal(start["classifier"]["kernel"],
                                  checkpoint_dir.load_classifier(checkpoint)["kernel"])
    assert sorted(start) == ["bert", "classifier"] and task.own_classifier


def test_older_layouts_and_plain_classifiers(tmp_path):
    """sentence-transformers 4 / 5 kept the activation in config.json, without modules.json;
    a transformers sequence classifier that is no CrossEncoder converts as before (its head
    skipped, no classifier.npz)."""
    source = ce.save_cross_encoder(tmp_path)
    old = tmp_path / "old"
    shutil.copytree(source, old)
    for name in ("modules.json", "sentence_bert_config.json",
                 "config_sentence_transformers.json"):
        (old / name).unlink()
    config = json.loads((old / "config.json").read_text())
    config["sentence_transformers"] = {"activation_fn": "torch.nn.modules.linear.Identity"}
    (old / "config.json").write_text(json.dumps(config))
    convert_main(["from_hf", "--input", old, "--output", tmp_path / "old_ckpt"])
    assert Reranker.from_checkpoint(str(tmp_path / "old_ckpt")).activation == "identity"
    assert type(ce.reference(old).activation_fn).__name__ == "Identity"
    convert_main(["from_hf", "--input", tmp_path / "hf", "--output", tmp_path / "plain"])
    assert checkpoint_dir.load_classifier(tmp_path / "plain") is None
    with pytest.raises(CheckpointError, match="plain: no cross-encoder head "
                                              r"\(classifier.npz\): convert a"):
        Reranker.from_checkpoint(str(tmp_path / "plain"))


def test_what_bertjax_cannot_compute_the_same_way_is_one_line(tmp_path):
    two = ce.save_cross_encoder(tmp_path / "two", num_labels=2)
    with pytest.raises(SystemExit, match=r"^error: --input \S+two/ce: the classifier has 2 "
                                         "outputs; a reranker scores a pair with one$"):
        convert_main(["from_hf", "--input", two, "--output", tmp_path / "out"])
    source = ce.save_cross_encoder(tmp_path / "tanh")
    path = source / "config_sentence_transformers.json"
    path.write_text(json.dumps({**json.loads(path.read_text()),
                                "activation_fn": "torch.nn.modules.activation.Tanh"}))
    with pytest.raises(SystemExit, match=r"config_sentence_transformers.json: activation "
                                         r"'torch.nn.modules.activation.Tanh' is not supported"):
        convert_main(["from_hf", "--input", source, "--output", tmp_path / "out"])


@pytest.mark.slow
def test_predict_rerank_writes_each_querys_candidates_reordered(tmp_path):
    source, checkpoint = convert(tmp_path)
    candidates = data.write_candidates(tmp_path / "c.jsonl", 4)
    out = tmp_path / "reranked.jsonl"
    result = run_python(["-m", "bertjax.predict", "rerank", f"--checkpoint={checkpoint}",
                         f"--input={candidates}", f"--output={out}", "--top_k=3"])
    assert result.returncode == 0, result.stderr[-3000:]
    assert "wrote 4 reranked candidate lists" in result.stdout
    assert "metrics: ndcg@10" in result.stdout and "(input order" in result.stdout
    reference = ce.reference(source)
    for line, record in zip(open(candidates), map(json.loads, open(out))):
        row = json.loads(line)
        theirs = reference.rank(row["query"], [c["text"] for c in row["candidates"]], top_k=3)
        assert record["id"] == row["id"]
        assert [c["id"] for c in record["candidates"]] == [
            row["candidates"][t["corpus_id"]]["id"] for t in theirs]
        np.testing.assert_allclose([c["score"] for c in record["candidates"]],
                                   [t["score"] for t in theirs], atol=1e-5)
    empty = data.write_jsonl(tmp_path / "e.jsonl", [{"query": "q", "candidates": []}])
    result = run_python(["-m", "bertjax.predict", "rerank", f"--checkpoint={checkpoint}",
                         f"--input={empty}", f"--output={out}"])
    assert result.returncode == 1
    assert result.stderr.strip().splitlines()[-1] == (
        f"error: {empty}:1: \"candidates\" is empty; give the passages to rerank")
