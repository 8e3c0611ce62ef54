"""Embedding fine-tuning from a converted sentence-transformers model applies its prompts as
sentence-transformers' trainer does with prompts= (the query prompt on the anchors and BEIR
queries, the document prompt on the positives, negatives and the BEIR corpus, the default
prompt on scored pairs; config.task.query_prompt / document_prompt / prompt override) and its
do_lower_case; the finished run's export writes them back, so that SentenceTransformer(export)
encodes as bertjax does."""

import json
from pathlib import Path

import embedding_data as data
import numpy as np
import pytest
from conftest import run_python

from bertjax import tasks
from bertjax.models.embedding import Prompts
from bertjax.tasks.embedding.prompts import configured
from bertjax.tasks.embedding.readers import TextsExample
from experiments import embedding

OWN = {"query": "word0 word1 ", "passage": "word2 "}  # the converted model's, default passage


def prompted_checkpoint(root: Path, lower_case: bool = True, include_prompt: bool = True
                        ) -> str:
    """A tiny checkpoint whose conversion.json says what from_hf keeps of a sentence-
    transformers model: prompts OWN (default "passage"), do_lower_case and the pooling's
    include_prompt."""
    ckpt = data.tiny_checkpoint(root)
    record = {"pooling": {"mode": "mean", "normalize": True, "include_prompt": include_prompt},
              "max_seq_length": 32, "prompts": OWN, "default_prompt_name": "passage",
              "do_lower_case": lower_case}
    (Path(ckpt) / "conversion.json").write_text(json.dumps({"sentence_transformers": record}))
    (Path(ckpt) / "pooling.json").write_text(json.dumps(record["pooling"]))
    return ckpt


def config_for(tmp_path, kind="pairs", include_prompt=True, **data_fields):
    config = embedding.get_config(kind)
    config.init_checkpoint = prompted_checkpoint(tmp_path, include_prompt=include_prompt)
    config.max_seq_length = 0  # the checkpoint's own: 32
    config.train.batch_size = config.eval.batch_size = 16
    config.data.update(data_fields)
    return config


def test_configured_prompts_name_what_the_config_sets():
    own = Prompts(OWN, "passage")
    assert configured(own) == own
    set_ = configured(own, prompt="word2 ", query="", document="word3 ")
    assert set_ == Prompts({**OWN, "query": "", "document": "word3 "}, "passage")
    assert configured(own, prompt="word3 ", document="word3 ").default_name == "document"
    assert configured(own, prompt="word9 ") == Prompts({**OWN, "default": "word9 "}, "default")
    assert configured(own, prompt="").default_name is None


def test_the_init_checkpoints_prompts_apply_per_column_unless_the_config_says(tmp_path):
    """encode_query's prompt on the anchors, encode_document's ("document": none here) on the
    positives and negatives, encode's (the default, "passage") on both texts of a scored pair;
    each config field overrides its own."""
    config = config_for(tmp_path)
    task = tasks.get_task(config)
    assert task.column_prompts("pairs", 3) == ("word0 word1 ", "", "")
    assert task.column_prompts("scored", 2) == ("word2 ", "word2 ")
    config.task.query_prompt, config.task.document_prompt = "", "word3 "
    task = tasks.get_task(config)
    assert task.column_prompts("pairs", 3) == ("", "word3 ", "word3 ")
    assert task.column_prompts("scored", 2) == ("word2 ", "word2 ")
    assert task.state()["prompts"] == {**OWN, "query": "", "document": "word3 "}
    assert task.state()["default_prompt_name"] == "passage" and task.state()["lower_case"]


def test_read_prepends_the_prompts_and_encode_lower_cases(tmp_path):
    from bertjax.tokenization import load_tokenizer

    config = config_for(tmp_path, train=data.write_pairs(tmp_path / "p.jsonl", 8),
                        columns="query,passage", beir=data.write_beir(tmp_path / "beir"),
                        validation=data.write_scored(tmp_path / "d.csv", 6))
    config.task.document_prompt = "word3 "
    task = tasks.get_task(config)
    splits = task.read(config)
    rows = [json.loads(line) for line in (tmp_path / "p.jsonl").read_text().splitlines()]
    assert [e.texts for e in splits.train] == [
        ("word0 word1 " + r["query"], "word3 " + r["passage"]) for r in rows]
    assert all(e.texts[0].startswith("word2 ") and e.texts[1].startswith("word2 ")
               for e in splits.dev["sts"])
    retrieval = splits.dev["retrieval"]
    queries = len(retrieval.retrieval.queries)
    assert all(e.texts[0].startswith("word0 word1 ") for e in retrieval[:queries])
    assert all(e.texts[0].startswith("word3 ") for e in retrieval[queries:])
    cased = load_tokenizer(config.init_checkpoint, do_lower_case=False)
    upper, lower = (task.encode(cased, [TextsExample("x", (t,))], 32).sequences[0]
                    for t in ("WORD1 TOPIC2", "word1 topic2"))
    np.testing.assert_array_equal(upper, lower)  # do_lower_case: the text, before the tokenizer


def test_a_pooling_without_the_prompt_starts_each_text_after_its_own(tmp_path):
    """include_prompt false: every batch (training, STS and retrieval dev) gives each text the
    positions of its prompt ([CLS] included; 0 for none, and for filler rows); packed
    training is refused in one line."""
    from bertjax.errors import ConfigError
    from bertjax.tasks import checks
    from bertjax.tokenization import load_tokenizer

    config = config_for(tmp_path, include_prompt=False,
                        train=data.write_pairs(tmp_path / "p.jsonl", 12),
                        columns="query,passage", beir=data.write_beir(tmp_path / "beir"),
                        validation=data.write_scored(tmp_path / "d.csv", 6))
    config.max_seq_length = 32
    with pytest.raises(ConfigError, match="leaves the prompt out .*set config.data.pack=False$"):
        checks.check_packing(config, None)
    config.data.pack = False
    task = tasks.get_task(config)
    assert not task.pooling.include_prompt and "(not pooled)" in task.describe(
        task.encode(load_tokenizer(config.init_checkpoint), task.read(config).train, 32))
    splits = task.read(config)
    tokenizer = load_tokenizer(config.init_checkpoint)
    want = {"train": [3, 0], "sts": [2, 2]}  # [CLS] word0 word1 | none; [CLS] word2 (both)
    for name, examples in (("train", splits.train), *splits.dev.items()):
        features = task.encode(tokenizer, examples, 32)
        batches = list(task.batches(features, 8, shuffle=name == "train", seed=0))
        assert all(b["pool_from"].shape == b["input_ids"].shape[:2] for b in batches)
        for batch in batches:
            real = batch["example_index"] >= 0
            if name == "retrieval":  # the queries' prompt, then the corpus's (none)
                queries = len(splits.dev["retrieval"].retrieval.queries)
                np.testing.assert_array_equal(
                    batch["pool_from"][real, 0],
                    np.where(batch["example_index"][real] < queries, 3, 0))
            else:
                assert (batch["pool_from"][real] == want[name]).all()
            assert (batch["pool_from"][~real] == 0).all()
    spec = task.batch_spec(8, 32)
    assert spec["pool_from"].shape == (8, 2)


@pytest.mark.slow
@pytest.mark.parametrize("include_prompt", [True, pytest.param(False, marks=pytest.mark.extended)])
def test_the_finished_runs_export_carries_its_prompts_to_sentence_transformers(include_prompt,
                                                                               tmp_path):
    """A short run (query prompt set in the config), exported by to_hf: SentenceTransformer's
    encode / encode_query / encode_document equal the run's Embedder within 1e-5 (a pooling
    without the prompt too, trained unpacked)."""
    from sentence_transformers import SentenceTransformer

    from bertjax.serving.embedder import Embedder

    config = config_for(tmp_path, include_prompt=include_prompt,
                        train=data.write_pairs(tmp_path / "p.jsonl", 32),
                        columns="query,passage", beir=data.write_beir(tmp_path / "beir"))
    config.task.query_prompt = "topic1 "
    config.train.num_epochs = 1
    config.data.pack = include_prompt
    summary = tasks.train_and_evaluate(config, str(tmp_path / "run"), log=lambda *_: None)
    assert summary["status"] == "done"
    result = run_python(["-m", "bertjax.convert", "to_hf", f"--input={tmp_path / 'run'}",
                         f"--output={tmp_path / 'st'}"])
    assert result.returncode == 0, result.stderr[-3000:]
    written = json.loads((tmp_path / "st" / "config_sentence_transformers.json").read_text())
    assert written["prompts"] == {**OWN, "query": "topic1 ", "document": ""}
    assert written["default_prompt_name"] == "passage"
    sbert = json.loads((tmp_path / "st" / "sentence_bert_config.json").read_text())
    assert sbert == {"max_seq_length": 32, "do_lower_case": True}
    texts = ["TOPIC3 word1 word7", "word2 topic11 word5 word9 word1", "topic0"]
    ours = Embedder.from_workdir(str(tmp_path / "run"))
    theirs = SentenceTransformer(str(tmp_path / "st"), device="cpu")
    for mine, reference in ((ours(texts), theirs.encode(texts)),
                            (ours.embed_queries(texts), theirs.encode_query(texts)),
                            (ours.embed_documents(texts), theirs.encode_document(texts)),
                            (ours(texts, prompt_name="query"),
                             theirs.encode(texts, prompt_name="query"))):
        np.testing.assert_allclose(mine, reference, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(Embedder.from_export(str(tmp_path / "st")).embed_queries(texts),
                               theirs.encode_query(texts), rtol=1e-5, atol=1e-5)
