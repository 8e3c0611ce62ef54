"""SQuAD predictions in length buckets (data_pipeline.finetune_data's prediction plan): a
window's batch shape depends on its own length, not max_seq_length. On a tiny random model
and a generated SQuAD v2.0 file, the answers equal those of every window padded to
max_seq_length (logits within float tolerance; texts, offsets and n-best texts equal)."""

import json

import jax
import numpy as np
import pytest
from conftest import FILLERS
from squad_data import VOCAB, generate

MAX_LEN = 128


def _predictor(tmp_path, min_bucket_length):
    """A Predictor of a random tiny BertForQuestionAnswering (v2.0)."""
    import flax.linen as nn

    from bertjax import Predictor
    from bertjax.models import BertConfig
    from bertjax.serving.runs import TrainedModel
    from bertjax.tasks import get_task
    from bertjax.tokenization import load_tokenizer
    from experiments.squad import get_config

    config = get_config("v2")
    config.max_seq_length, config.min_bucket_length = MAX_LEN, min_bucket_length
    config.task.doc_stride, config.task.max_query_length = 32, 16
    config.eval.batch_size = 4  # few rows a bucket: little filler
    task = get_task(config)
    task.restore({"version_2": True, "threshold": 0.0})
    # A wide initialisation: logits spread enough that float noise cannot reorder answers.
    model_config = BertConfig(vocab_size=len(VOCAB), hidden_size=32, num_layers=2, num_heads=4,
                              intermediate_size=64, max_position_embeddings=MAX_LEN,
                              initializer_range=0.2)
    params = task.model(model_config).init(jax.random.key(0), *task.init_inputs())["params"]
    vocab = tmp_path / "vocab.txt"
    vocab.write_text("\n".join(VOCAB) + "\n")
    return Predictor(TrainedModel(str(tmp_path), config, task, model_config,
                                  jax.device_get(nn.unbox(params)),
                                  load_tokenizer(str(vocab)), 0))


def test_squad_buckets_equal_padding_to_max_seq_length(tmp_path):
    from bertjax.serving.engine import padding_line
    from bertjax.tasks.squad.postprocess import postprocess
    from data_pipeline.finetune_data import bucket_lengths, prediction_buckets

    path = generate(tmp_path / "dev.json", 40, seed=3, impossible_rate=0.3)
    data = json.loads(open(path).read())
    for paragraph in data["data"][0]["paragraphs"][:2]:  # several windows (answers kept)
        paragraph["context"] += " " + " ".join(FILLERS[i % len(FILLERS)] for i in range(150))
    open(path, "w").write(json.dumps(data))
    bucketed, padded = _predictor(tmp_path, 16), _predictor(tmp_path, MAX_LEN)
    examples = bucketed.task.read_inputs(path, {})[0]
    features, ours, tokens = bucketed.engine.run(examples)
    _, theirs, full = padded.engine.run(examples)
    bucketed.task.release(examples)
    padded.task.release(examples)
    lengths = features.input_mask.sum(axis=1)
    assert len(features) > len(examples)  # long contexts: several windows

    shapes = {b["input_ids"].shape for b in bucketed.task.batches(features, 4, shuffle=False)}
    assert len(shapes) > 2 and min(n for _, n in shapes) < MAX_LEN // 2, shapes
    assert {b["input_ids"].shape for b in padded.task.batches(features, 4, shuffle=False)} \
        == {(4, MAX_LEN)}
    assert tokens["real"] == full["real"] and tokens["computed"] < full["computed"]
    grid = prediction_buckets(bucket_lengths(MAX_LEN, 16))
    for name in ("start_logits", "end_logits"):  # a window's logits ignore its padding
        for w, n in enumerate(lengths):
            assert len(ours[name][w]) == next(b for b in grid if b >= n)
            np.testing.assert_allclose(ours[name][w][:n], theirs[name][w][:n], atol=1e-5)

    # Positions past a window's own tokens are never an answer, however large their logits.
    def loud(rows):
        return [np.where(np.arange(MAX_LEN) < n, np.pad(r, (0, MAX_LEN - len(r))), 1e4)
                for r, n in zip(rows, lengths)]

    assert postprocess(features, loud(ours["start_logits"]), loud(ours["end_logits"]),
                       version_2=True) == postprocess(
        features, ours["start_logits"], ours["end_logits"], version_2=True)

    # v2.0: a threshold between two questions' null odds, half of them abstaining; distinct
    # odds (questions asked twice share theirs), so that no question sits on the threshold.
    odds = sorted({round(a.null_odds, 4) for a in postprocess(
        features, ours["start_logits"], ours["end_logits"], version_2=True).values()})
    middle = len(odds) // 2
    bucketed.task.threshold = padded.task.threshold = (odds[middle - 1] + odds[middle]) / 2
    records, metrics = bucketed.predict_file(path)[1:]
    reference, reference_metrics = padded.predict_file(path)[1:]
    assert bucketed.last_padding == padding_line(tokens)  # the buckets' waste
    assert {r["answer"] for r in records} > {""}  # answers and abstentions
    for r, ref in zip(records, reference, strict=True):
        assert (r["id"], r["answer"], r["start"], r["end"]) == (
            ref["id"], ref["answer"], ref["start"], ref["end"])
        assert r["null_odds"] == pytest.approx(ref["null_odds"], abs=1e-4)
        assert r["score"] == (None if ref["score"] is None else
                              pytest.approx(ref["score"], abs=1e-4))
        assert [(e["text"], e["start"], e["end"]) for e in r["nbest"]] == [
            (e["text"], e["start"], e["end"]) for e in ref["nbest"]]
        for key in ("probability", "start_logit", "end_logit"):
            np.testing.assert_allclose([e[key] for e in r["nbest"]],
                                       [e[key] for e in ref["nbest"]], atol=1e-4)
    for key in ("exact", "f1", "HasAns_f1", "NoAns_f1"):
        assert metrics[key] == reference_metrics[key]
    # A question read alone gets the bitwise record it has among all the others.
    first = examples[0]
    alone = bucketed([(first.question, first.context)])[0]
    assert alone["nbest"] == records[0]["nbest"] and alone["answer"] == records[0]["answer"]
