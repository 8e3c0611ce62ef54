"""bertjax.fidelity's embedding family: the ROPES pairs and BEIR dev set (built from a
generated stand-in of the source), what the harness reads of bertjax's log, and (slow) one
quick run of both sides end to end."""

import hashlib
import json
import subprocess
import sys

import pytest

from bertjax.fidelity import data, reference_embedding
from bertjax.fidelity.__main__ import _digest_path, starting_scores
from bertjax.tasks.embedding.readers import read_beir, read_texts


def write_ropes(directory, situations=40, split="train"):
    """Articles of 2 paragraphs "background\\nsituation", 1-3 questions each; situation p of
    `split` is unique ("<split> story <p> ...")."""
    articles = []
    for a in range(situations // 2):
        paragraphs = []
        for p in (2 * a, 2 * a + 1):
            qas = [{"id": f"{split}-q{p}-{i}", "question": f"what did team{p} do {i}?",
                    "answers": [{"text": "won", "answer_start": 0}]}
                   for i in range(1 + p % 3)]
            paragraphs.append({"context": f"background {a} shared\n{split} story {p}: team{p} "
                                          "won the match.", "qas": qas})
        articles.append({"title": f"a{a}", "paragraphs": paragraphs})
    directory.mkdir(parents=True, exist_ok=True)
    (directory / f"{split}.json").write_text(json.dumps({"version": "1.1", "data": articles}))


def test_ropes_retrieval_pairs_and_beir_dev_share_no_situation(tmp_path):
    write_ropes(tmp_path / "ropes", 40, "train")
    write_ropes(tmp_path / "ropes", 12, "dev")
    files = data.ropes_retrieval(tmp_path / "ropes", tmp_path / "out", data.Sizes(20, 8))
    rows = [json.loads(line) for line in open(files["train"])]
    assert len(rows) == 20
    passages = [r["passage"] for r in rows]
    assert len(set(passages)) == 20  # one question per situation: no false negative
    for r in rows:  # the question is one of its situation's own
        p = r["passage"].split(":")[0].split()[-1]
        assert r["id"].startswith(f"train-q{p}-") and f"team{p} " in r["question"]
        assert "background" not in r["passage"]

    # bertjax's readers take the files as they are.
    examples = read_texts(files["train"], ("question", "passage"))
    assert [e.texts for e in examples] == [(r["question"], r["passage"]) for r in rows]
    beir = read_beir(files["beir"], "dev")
    assert len(beir.queries) == 8
    corpus = set(beir.corpus.values())
    # Every dev situation, then 8 distractors: train situations that no row uses.
    dev_situations = {t for t in corpus if t.startswith("dev story")}
    distractors = corpus - dev_situations
    assert len(dev_situations) == 12 and len(distractors) == 8
    assert not distractors & set(passages) and all(t.startswith("train story") for t in
                                                   distractors)
    for qid, judged in beir.qrels.items():
        [(doc, relevance)] = judged.items()
        p = qid.split("-")[1][1:]
        assert relevance == 1 and beir.corpus[doc].startswith(f"dev story {p}:")
        assert beir.queries[qid].startswith(f"what did team{p} do")

    # The sentence-transformers side reads the same set.
    queries, corpus_st, relevant = reference_embedding.read_beir(files["beir"])
    assert queries == beir.queries and corpus_st == beir.corpus
    assert relevant == {q: set(judged) for q, judged in beir.qrels.items()}

    # Seeded: the same files again.
    data.ropes_retrieval(tmp_path / "ropes", tmp_path / "again", data.Sizes(20, 8))
    for name in ("train.jsonl", "beir/corpus.jsonl", "beir/queries.jsonl",
                 "beir/qrels/dev.tsv"):
        assert (tmp_path / "again" / name).read_text() == (tmp_path / "out" / name).read_text()
    with pytest.raises(data.DataError, match="fewer than"):
        data.ropes_retrieval(tmp_path / "ropes", tmp_path / "big", data.Sizes(35, 8))


def test_starting_scores_come_from_the_eval_before_training_line():
    log = ("I1128 step line\nI1128 04:39:09 loop.py:366] eval before training (the starting "
           'checkpoint): {"ndcg@10": 0.6687, "mrr@10": 0.5983, "epoch": 0.0}\n'
           'eval at step 25: {"ndcg@10": 0.72, "epoch": 1.0}\n')
    assert starting_scores(log) == {"ndcg@10": 0.6687, "mrr@10": 0.5983}
    assert starting_scores("no such line") == {}


def test_reference_cache_digest_reads_a_directorys_files(tmp_path):
    def digest(path):
        h = hashlib.sha256()
        _digest_path(h, path)
        return h.hexdigest()

    (tmp_path / "beir" / "qrels").mkdir(parents=True)
    (tmp_path / "beir" / "corpus.jsonl").write_text("a")
    (tmp_path / "beir" / "qrels" / "dev.tsv").write_text("b")
    before = digest(tmp_path / "beir")
    (tmp_path / "beir" / "qrels" / "dev.tsv").write_text("c")
    assert digest(tmp_path / "beir") != before
    assert digest(tmp_path / "beir" / "corpus.jsonl") == hashlib.sha256(b"a").hexdigest()
    assert digest(tmp_path / "absent") == hashlib.sha256().hexdigest()


def write_sentence_transformers_model(path, words):
    """A small BERT as a sentence-transformers directory: mean pooling, then Normalize."""
    import transformers

    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *sorted(set(words))]
    path.mkdir()
    (path / "vocab.txt").write_text("\n".join(vocab) + "\n")
    config = transformers.BertConfig(vocab_size=len(vocab), hidden_size=32,
                                     num_hidden_layers=2, num_attention_heads=2,
                                     intermediate_size=64, max_position_embeddings=128)
    transformers.BertModel(config).save_pretrained(path)
    transformers.BertTokenizerFast(str(path / "vocab.txt"), do_lower_case=True
                                   ).save_pretrained(path)
    modules = [{"idx": 0, "name": "0", "path": "",
                "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling",
                "type": "sentence_transformers.models.Pooling"},
               {"idx": 2, "name": "2", "path": "2_Normalize",
                "type": "sentence_transformers.models.Normalize"}]
    (path / "modules.json").write_text(json.dumps(modules))
    (path / "sentence_bert_config.json").write_text(json.dumps(
        {"max_seq_length": 64, "do_lower_case": False}))
    (path / "1_Pooling").mkdir()
    (path / "1_Pooling" / "config.json").write_text(json.dumps(
        {"word_embedding_dimension": 32, "pooling_mode_cls_token": False,
         "pooling_mode_mean_tokens": True, "pooling_mode_max_tokens": False,
         "pooling_mode_mean_sqrt_len_tokens": False}))


@pytest.mark.slow
@pytest.mark.extended
def test_quick_embedding_run_trains_both_sides_and_reports_the_start(tmp_path):
    # --quick takes 96 training situations and 48 distractors.
    write_ropes(tmp_path / "data" / "ropes", 160, "train")
    write_ropes(tmp_path / "data" / "ropes", 30, "dev")
    words = ["what", "did", "do", "won", "the", "match", "story", "train", "dev", "?", ":",
             ".", *(f"team{p}" for p in range(160)), *map(str, range(160))]
    write_sentence_transformers_model(tmp_path / "st", words)
    work = tmp_path / "fidelity"
    done = subprocess.run(
        [sys.executable, "-m", "bertjax.fidelity", f"--workdir={work}", "--quick",
         "--families=embedding", f"--model={tmp_path / 'st'}",
         f"--data_dir={tmp_path / 'data'}"], capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    [row] = json.loads((work / "fidelity.json").read_text())
    assert row["family"] == "embedding" and row["metric"] == "ndcg@10"
    assert all(0.0 <= v <= 1.0 for v in row["bertjax"] + row["transformers"])
    results = json.loads((work / "embedding" / "bertjax_0" / "results.json").read_text())
    assert results["best"]["ndcg@10"] == row["bertjax"][0]
    # One model before training: the two sides' scores agree (bertjax logs 4 decimals).
    [ours], [theirs] = row["start"]["bertjax"], row["start"]["transformers"]
    assert abs(ours - theirs) < 1e-3
    assert (work / "model" / "pooling.json").exists()
    assert "starting checkpoint's ndcg@10" in (work / "fidelity.md").read_text()
