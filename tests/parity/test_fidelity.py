"""bertjax.fidelity: the families' files (built from generated stand-ins of the real sources),
the verdict, and (slow) one quick run of both sides end to end."""

import json
import random
import subprocess
import sys

import pytest

from bertjax.fidelity import data, reference
from bertjax.fidelity.verdict import compare, fails, summary, welch_p

WORDS = [f"word{i}" for i in range(40)]


def write_corpus(path, articles=60, seed=0):
    """Articles of 4-8 sentences; sentence k of article a is unique ("a{a}s{k} ...")."""
    rng = random.Random(seed)
    blocks = []
    for a in range(articles):
        blocks.append("\n".join(f"a{a}s{k} " + " ".join(rng.choices(WORDS, k=6))
                                for k in range(rng.randint(4, 8))))
    path.write_text("\n\n".join(blocks) + "\n")
    return path


def test_sentence_pairs_follow_or_come_from_another_article(tmp_path):
    corpus = write_corpus(tmp_path / "corpus.txt")
    where = {}  # sentence -> (article, index)
    for a, doc in enumerate(data.articles(corpus)):
        for k, s in enumerate(doc):
            where[s] = (a, k)
    files = data.sentence_pairs(corpus, tmp_path / "pairs", data.Sizes(300, 100))
    articles_of = {}
    for split, path in files.items():
        records = [json.loads(x) for x in open(path)]
        assert len(records) == (300 if split == "train" else 100)
        for r in records:
            (a1, k1), (a2, k2) = where[r["first"]], where[r["second"]]
            assert (r["label"] == "next") == (a1 == a2 and k2 == k1 + 1)
            assert r["label"] == "next" or a1 != a2
            articles_of.setdefault(split, set()).add(a1)
        assert 0.35 < sum(r["label"] == "next" for r in records) / len(records) < 0.65
    assert not articles_of["train"] & articles_of["dev"]  # no article on both sides

    files = data.sentence_pairs(corpus, tmp_path / "choices", data.Sizes(50, 20), choices=4)
    for r in map(json.loads, open(files["train"])):
        a, k = where[r["context"]]
        following = [e for e in range(4) if where[r[f"ending{e}"]] == (a, k + 1)]
        assert following == [r["label"]]
        assert all(where[r[f"ending{e}"]][0] != a for e in range(4) if e != r["label"])


def write_squad(path, paragraphs=30):
    """Paragraphs "background ... \nstory ...: alpha<p> beat beta<p>.", 3 questions each whose
    answer is alpha<p> (in the situation) and one whose answer is in the background."""
    out = []
    for p in range(paragraphs):
        prefix = f"background {p} of group{p % 5}\nstory {p}: "
        answer = {"text": f"alpha{p}", "answer_start": len(prefix)}
        out.append({"context": prefix + f"alpha{p} beat beta{p}.", "qas": [
            {"id": f"q{p}_bg", "question": "which group?",
             "answers": [{"text": f"group{p % 5}", "answer_start": prefix.index("group")}]},
            *({"id": f"q{p}_{i}", "question": f"who won {i}?", "answers": [answer]}
              for i in range(3))]})
    path.write_text(json.dumps({"version": "1.1", "data": [{"title": "t", "paragraphs": out}]}))


def test_ropes_v2_moves_every_third_question_to_a_context_without_its_answer(tmp_path):
    for split in ("train", "dev"):
        write_squad(tmp_path / f"{split}.json")
    files = data.ropes(tmp_path, tmp_path / "v2", data.Sizes(60, 30), version_2=True)
    questions = [(p["context"], q) for article in json.load(open(files["train"]))["data"]
                 for p in article["paragraphs"] for q in p["qas"]]
    assert len(questions) == 60
    # The situations alone: no background, so no question answered there.
    assert all(c.startswith("story") and not q["id"].endswith("_bg") for c, q in questions)
    impossible = [(c, q) for c, q in questions if q["is_impossible"]]
    assert len(impossible) == 20
    for context, qa in questions:
        if qa["is_impossible"]:
            assert qa["answers"] == []
            owner = qa["id"].split("_")[0][1:]
            assert f"alpha{owner}" not in context
        else:
            answer = qa["answers"][0]
            start = answer["answer_start"]
            assert context[start:start + len(answer["text"])] == answer["text"]
    v1 = data.ropes(tmp_path, tmp_path / "v1", data.Sizes(60, 30), version_2=False)
    assert not any("is_impossible" in q for a in json.load(open(v1["dev"]))["data"]
                   for p in a["paragraphs"] for q in p["qas"])


def test_chunks_are_iob2_spans_of_proper_nouns_and_numbers(tmp_path):
    assert data.chunk_tags(["NNP", "NNPS", "VBD", "CD", "CD", "NNP", "DT"]) == [
        "B-NAME", "I-NAME", "O", "B-NUM", "I-NUM", "B-NAME", "O"]
    (tmp_path / "pos").mkdir()
    rng = random.Random(0)
    lines = []
    for s in range(200):
        lines += [f"w{s}_{k}\t{rng.choice(['NNP', 'CD', 'DT', 'NN'])}" for k in range(5)] + [""]
    (tmp_path / "pos" / "train.conll").write_text("\n".join(lines))
    alone = data.chunks(tmp_path / "pos", tmp_path / "a", data.Sizes(10, 5), documents=False)
    marked = data.chunks(tmp_path / "pos", tmp_path / "d", data.Sizes(10, 5), documents=True)
    for split, first in (("train", 0), ("dev", 110)):  # corpus order, 100 left between
        sentences = reference.read_conll(alone[split])
        assert sentences == reference.read_conll(marked[split])  # the mark only
        assert [words[0] for words, _ in sentences] == [
            f"w{s}_0" for s in range(first, first + (10 if split == "train" else 5))]
        assert open(marked[split]).readline().startswith("-DOCSTART-")
        assert not open(alone[split]).read().count("-DOCSTART-")


def test_the_means_are_compared_by_welchs_test_with_a_floor():
    from scipy import stats

    assert summary([1.0, 2.0, 3.0]) == (2.0, 1.0)
    assert compare([0.80, 0.82, 0.78], [0.81, 0.79, 0.83]).verdict == "within"
    # sd 0.02 a side: standard error sqrt(2 * 0.02**2 / 3) = 0.0163, 4 degrees of freedom.
    bound = stats.t.ppf(0.975, 4) * 0.02 * (2 / 3) ** 0.5 + 0.005
    theirs = [0.80, 0.82, 0.78]
    shift = [x - bound - 0.001 for x in theirs]
    assert compare(shift, theirs).verdict == "worse"
    assert compare(theirs, shift).verdict == "better"
    near = [x - bound + 0.001 for x in theirs]
    assert compare(near, theirs).verdict == "leans"  # lower by more than half their sd
    assert compare(near, theirs).means_p > 0.05
    assert stats.ttest_ind(near, theirs).pvalue < 0.05  # the floor keeps it from "worse"
    assert compare([80.0, 80.0, 80.0], [80.4, 80.4, 80.4], 100.0).verdict == "within"
    assert compare([0.5, 0.5], [0.6, 0.6]).verdict == "worse"
    assert compare([0.5], [0.9]).verdict == "n/a (1 seed)"
    # Without the floor, Welch's p is scipy's.
    ours, theirs = [0.61, 0.55, 0.58, 0.66, 0.52], [0.62, 0.60, 0.64, 0.59, 0.63]
    assert welch_p(ours, theirs, 0.0) == pytest.approx(
        stats.ttest_ind(ours, theirs, equal_var=False).pvalue, rel=1e-9)


def test_a_lower_wider_side_is_a_finding_not_within():
    """The tagging row of the previous harness: bertjax 0.216 ± 0.055 against 0.266 ± 0.004
    on 3 seeds was "within" by Welch alone; the variance-ratio test tells the spreads apart."""
    from scipy import stats

    ours, theirs = [0.160, 0.220, 0.268], [0.262, 0.266, 0.270]
    m1, s1 = summary(ours)
    assert (round(m1, 3), round(s1, 3)) == (0.216, 0.054)
    assert welch_p(ours, theirs, 0.005) > 0.05  # the old verdict: within
    c = compare(ours, theirs)
    assert c.verdict == "wider" and fails(c.verdict)
    f = s1 ** 2 / summary(theirs)[1] ** 2
    assert c.variance_p == pytest.approx(2 * stats.f.sf(f, 2, 2), rel=1e-9)
    assert c.levene_p == pytest.approx(stats.levene(ours, theirs, center="median").pvalue)
    assert c.sd_ratio == pytest.approx(s1 / 0.004, rel=1e-6)
    # The same spread on the other side is no failure of bertjax's.
    assert compare(theirs, ours).verdict in ("within", "better")
    # Equal spreads, equal means: within; twice the spread on 5 seeds without proof: leans.
    base = [0.60, 0.62, 0.64, 0.66, 0.68]
    assert compare(base, base).verdict == "within"
    twice = [0.64 + 2.2 * (x - 0.64) for x in base]
    c = compare(twice, base)
    assert c.verdict == "leans" and c.leans == ("spread",) and not fails(c.verdict)
    assert compare([0.64 + 6 * (x - 0.64) for x in base], base).verdict == "wider"


def write_hf_model(path, words):
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


@pytest.mark.slow
def test_quick_run_trains_both_sides_and_writes_the_report(tmp_path):
    src = tmp_path / "data"
    (src / "rotten_tomatoes").mkdir(parents=True)
    (src / "pos").mkdir()
    rng = random.Random(0)
    for split in ("train", "dev"):
        rows = [{"id": str(i), "text": " ".join(rng.choices(WORDS, k=6)),
                 "label": i % 2, "score": float(i % 2)} for i in range(120)]
        (src / "rotten_tomatoes" / f"{split}.jsonl").write_text(
            "".join(json.dumps(r) + "\n" for r in rows))
    lines = []
    for _ in range(300):
        lines += [f"{w}\t{rng.choice(['NNP', 'CD', 'NN'])}" for w in rng.choices(WORDS, k=5)]
        lines.append("")
    (src / "pos" / "train.conll").write_text("\n".join(lines))
    write_hf_model(tmp_path / "hf", WORDS)
    work = tmp_path / "fidelity"
    done = subprocess.run(
        [sys.executable, "-m", "bertjax.fidelity", f"--workdir={work}", "--quick",
         "--families=classification,tagging", f"--model={tmp_path / 'hf'}",
         f"--data_dir={src}"], capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    rows = json.loads((work / "fidelity.json").read_text())
    assert [r["family"] for r in rows] == ["classification", "tagging"]
    for row in rows:
        assert len(row["bertjax"]) == len(row["transformers"]) == 1
        assert all(0.0 <= v <= 1.0 for v in row["bertjax"] + row["transformers"])
        assert row["verdict"] == "n/a (1 seed)"
        # bertjax's own command ran: its results on the same files.
        results = json.loads((work / row["family"] / "bertjax_0" / "results.json").read_text())
        assert results["best"][row["metric"]] == row["bertjax"][0]
    assert "| classification" in (work / "fidelity.md").read_text()


def test_every_familys_settings_pass_bertjaxs_checks():
    """The settings each side is given are ones bertjax's command accepts (a SQuAD window must
    hold the doc stride after the longest question)."""
    from bertjax.fidelity.__main__ import FAMILIES, _family_config
    from bertjax.tasks.squad.features import check_limits
    from experiments.squad import get_config as squad_config

    task = squad_config("files").task
    for family in FAMILIES.values():
        for quick in (False, True):
            sizes, settings = _family_config(family, quick)
            assert sizes.train > sizes.dev > 0 and settings["epochs"] >= 1
            if "doc_stride" in settings:
                check_limits(settings["max_seq_length"], settings["doc_stride"],
                             task.max_query_length)


def test_tweets_split_by_a_hash_of_each_tweet_whatever_the_file_order(tmp_path):
    (tmp_path / "wnut").mkdir()
    tweets = [[(f"w{t}_{k}", "B-person" if k == 1 else "O") for k in range(4)]
              for t in range(200)]

    def write(order):
        blocks = ["\n".join(f"{w}\t{tag}" for w, tag in tweets[t]) for t in order]
        (tmp_path / "wnut" / "ner.txt").write_text("\n\t\n".join(blocks) + "\n\t\n")

    write(range(200))
    files = data.tweets(tmp_path / "wnut", tmp_path / "a", data.Sizes(150, 30))
    sides = {split: reference.read_conll(path) for split, path in files.items()}
    assert not {tuple(w) for w, _ in sides["train"]} & {tuple(w) for w, _ in sides["dev"]}
    assert 20 <= len(sides["dev"]) <= 30 and len(sides["train"]) == 150
    assert all(tags[1] == "B-person" for split in sides.values() for _, tags in split)
    write(reversed(range(200)))  # another order: the same tweets on each side
    again = data.tweets(tmp_path / "wnut", tmp_path / "b", data.Sizes(1000, 1000))
    dev = {tuple(w) for w, _ in reference.read_conll(again["dev"])}
    assert {tuple(w) for w, _ in sides["dev"]} <= dev
    assert not open(files["train"]).read().count("-DOCSTART-")
