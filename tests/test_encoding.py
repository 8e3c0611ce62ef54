"""Every reader of users' text files decodes through bertjax.paths: a byte that is not of the
file's encoding stops with one line naming file, line, byte and column (not a
UnicodeDecodeError traceback), and where an encoding option exists (config.data.encoding,
predict --encoding, extract_features --encoding) the same Latin-1 file reads as written."""

from __future__ import annotations

import json
import os

import pytest
from conftest import KEYWORD_VOCAB, run_python, write_tiny_checkpoint

from bertjax import cli, paths
from bertjax.errors import ConfigError, DataError
from bertjax.tasks import checks as finetuning_checks

CAFE = "café"


def latin1(tmp_path, name: str, text: str) -> str:
    """`text` written in Latin-1 (its "é" the single byte 0xe9, not UTF-8)."""
    path = str(tmp_path / name)
    with open(path, "wb") as f:
        f.write(text.encode("latin-1"))
    return path


def lines(*records: dict) -> str:
    """JSON lines, non-ASCII characters as they are (for latin1())."""
    return "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records)


def one_line(fn, path: str, line: int, error=DataError) -> str:
    """fn() raises `error` with one line naming `path`, `line`, the byte and the fix."""
    with pytest.raises(error) as info:
        fn()
    message = str(info.value)
    assert len(message.splitlines()) == 1, message
    assert message.startswith(f"{path}:{line}: invalid UTF-8 (byte 0xe9 at column "), message
    assert "save the file as UTF-8" in message
    return message


# ------------------------------------------------------------------------------ paths itself


def test_the_message_names_file_line_byte_column_and_the_option(tmp_path):
    path = latin1(tmp_path, "a.csv", f"text,label\nthe cat,pos\nun {CAFE} noir,neg\n")
    message = one_line(lambda: list(paths.open_text(path, newline="")), path, 3)
    assert message == (
        f"{path}:3: invalid UTF-8 (byte 0xe9 at column 7); save the file as UTF-8 or give its "
        "encoding, e.g. --config.data.encoding=latin-1 (predict: --encoding=latin-1)")
    # Every entry point says the same.
    assert one_line(lambda: paths.read_text(path), path, 3) == message
    assert one_line(lambda: list(paths.text_lines(path)), path, 3) == message
    assert one_line(lambda: paths.check_text(path), path, 3) == message
    assert paths.read_text(path, "latin-1").splitlines()[2] == f"un {CAFE} noir,neg"


def test_a_bad_byte_after_the_first_block_and_a_cut_last_character(tmp_path):
    """The text layer decodes 8 KiB blocks; the line is still the right one. A multi-byte
    character cut by the end of the file is named at its line and column."""
    path = latin1(tmp_path, "big.txt", "x\n" * 20_000 + f"{CAFE}\n")
    one_line(lambda: list(paths.open_text(path)), path, 20_001)
    cut = str(tmp_path / "cut.txt")
    with open(cut, "wb") as f:
        f.write(b"ok\nab\xc3")
    with pytest.raises(DataError, match=r"cut\.txt:2: invalid UTF-8 \(byte 0xc3 at column 3\)"):
        list(paths.open_text(cut))
    with pytest.raises(DataError, match=r"cut\.txt:2: invalid UTF-8 \(byte 0xc3 at column 3\)"):
        list(paths.text_lines(cut))


def test_utf8_drops_a_bom_and_an_unknown_encoding_names_its_field(tmp_path):
    path = str(tmp_path / "bom.csv")
    with open(path, "wb") as f:
        f.write("\ufefftext\nnaïve\n".encode())
    assert list(paths.open_text(path)) == ["text\n", "naïve\n"]
    with pytest.raises(ConfigError, match=r"config\.data\.encoding='latin-9x' is not an "):
        paths.check_encoding("latin-9x", "config.data.encoding")


# ------------------------------------------------------------------------------ fine-tuning


@pytest.mark.parametrize("ext,text,line", [
    ("csv", f"text,label\nthe cat,pos\n{CAFE},neg\n", 3),
    ("tsv", f"text\tlabel\nthe cat\tpos\n{CAFE}\tneg\n", 3),
    ("jsonl", lines({"text": "the cat", "label": "pos"}, {"text": CAFE, "label": "neg"}), 2),
])
def test_classification_files(tmp_path, ext, text, line):
    from bertjax.tasks.classification import readers

    path = latin1(tmp_path, f"train.{ext}", text)
    read = lambda **kw: readers.read_file(  # noqa: E731
        path, "classification", text_a="text", labels=("neg", "pos"), **kw)
    one_line(read, path, line)
    one_line(lambda: readers.infer_labels(path, "label"), path, line)
    examples = read(encoding="latin-1")
    assert examples[1].text_a == CAFE
    assert readers.infer_labels(path, "label", "latin-1") == ("neg", "pos")


def test_glue_and_swag_files(tmp_path):
    from bertjax.tasks.classification import readers

    sst2 = readers.glue_task("sst2")
    path = latin1(tmp_path, "train.tsv", f"sentence\tlabel\nit is fine\t1\n{CAFE}\t0\n")
    one_line(lambda: readers.read_glue_file(path, sst2, True), path, 3)
    assert readers.read_glue_file(path, sst2, True, "latin-1")[1].text_a == CAFE
    header = "fold-ind,sent1,sent2,ending0,ending1,ending2,ending3,label\n"
    swag = latin1(tmp_path, "train.csv", header + f"1,{CAFE},he,a,b,c,d,0\n")
    one_line(lambda: readers.read_swag_file(swag, True), swag, 2)
    assert readers.read_swag_file(swag, True, "latin-1")[0].context == CAFE


def test_tagging_files(tmp_path):
    from bertjax.tasks.tagging import readers

    conll = latin1(tmp_path, "train.conll", f"the O\ncat B-X\n\n{CAFE} B-X\n")
    one_line(lambda: readers.read_columns(conll, scheme="iob2"), conll, 4)
    one_line(lambda: readers.has_tags(conll, "conll"), conll, 4)
    sentences = readers.read_columns(conll, scheme="iob2", encoding="latin-1")
    assert sentences[1].words == (CAFE,)
    jsonl = latin1(tmp_path, "train.jsonl", lines({"tokens": ["the"], "tags": ["O"]},
                                                  {"tokens": [CAFE], "tags": ["B-X"]}))
    one_line(lambda: readers.read_jsonl(jsonl), jsonl, 2)
    assert readers.read_jsonl(jsonl, encoding="latin-1")[1].words == (CAFE,)


def test_squad_files(tmp_path):
    from bertjax.tasks.squad import readers

    data = {"data": [{"title": "t", "paragraphs": [{"context": f"un {CAFE}", "qas": [
        {"id": "q1", "question": "what?", "answers": [{"text": CAFE, "answer_start": 3}]}]}]}]}
    path = latin1(tmp_path, "train.json", json.dumps(data, ensure_ascii=False, indent=1))
    line = json.dumps(data, ensure_ascii=False, indent=1).split(CAFE)[0].count("\n") + 1
    one_line(lambda: readers.read_squad_json(path), path, line)
    assert readers.read_squad_json(path, encoding="latin-1")[0].context == f"un {CAFE}"
    questions = latin1(tmp_path, "q.jsonl", lines({"question": "q", "context": "c"},
                                                  {"question": CAFE, "context": "c"}))
    one_line(lambda: readers.read_questions_jsonl(questions), questions, 2)
    assert readers.read_questions_jsonl(questions, encoding="latin-1")[1].question == CAFE


def test_config_data_encoding_reaches_the_readers_and_is_validated(tmp_path):
    """config.data.encoding is in every fine-tuning config, read by each family's task."""
    from bertjax.tasks import get_task

    for name in ("experiments/glue.py:mrpc", "experiments/finetune_files.py:classification",
                 "experiments/ner.py:files", "experiments/squad.py:files"):
        assert cli.load_config(name).data.encoding == "utf-8", name
    train = latin1(tmp_path, "train.csv", f"text,label\n{CAFE},pos\nthe cat,neg\n")
    config = cli.load_config("experiments/finetune_files.py:classification")
    config.data.train = config.data.validation = train
    one_line(lambda: get_task(config).read(config), train, 2)
    config.data.encoding = "latin-1"
    assert get_task(config).read(config).train[0].text_a == CAFE

    conll = latin1(tmp_path, "train.conll", f"{CAFE} B-X\n")
    labels = latin1(tmp_path, "labels.txt", "O\nB-X\nI-X\n")
    config = cli.load_config("experiments/ner.py:files")
    config.data.train = config.data.validation = conll
    one_line(lambda: get_task(config).read(config), conll, 1)
    config.data.encoding, config.data.labels = "latin-1", labels
    assert get_task(config).read(config).train[0].words == (CAFE,)

    squad = latin1(tmp_path, "s.json", json.dumps({"data": [{"title": "t", "paragraphs": [{
        "context": CAFE, "qas": [{"id": "1", "question": "q", "answers": [
            {"text": CAFE, "answer_start": 0}]}]}]}]}, ensure_ascii=False))
    config = cli.load_config("experiments/squad.py:files")
    config.data.train = config.data.validation = squad
    one_line(lambda: get_task(config).read(config), squad, 1)
    config.data.encoding = "latin-1"
    assert get_task(config).read(config).train[0].context == CAFE

    config.data.encoding = "latin-9x"
    with pytest.raises(ConfigError, match=r"^config\.data\.encoding='latin-9x' is not an"):
        finetuning_checks.check(config, None)


# ------------------------------------------------------------------------------ predict


def _task(config_name: str, state: dict):
    from bertjax.tasks import get_task

    task = get_task(cli.load_config(config_name))
    task.restore(state)
    return task


CLASSIFIER = ("experiments/finetune_files.py:classification",
              {"kind": "classification", "labels": ["neg", "pos"], "metric_names": ["accuracy"]})
TAGGER = ("experiments/ner.py:files", {"labels": ["O", "B-X", "I-X"], "scheme": "iob2"})
READER = ("experiments/squad.py:files", {"version_2": False, "threshold": 0.0})


@pytest.mark.parametrize("family,name,text,line", [
    ("classifier", "new.csv", f"text\nthe cat\n{CAFE}\n", 3),
    ("classifier", "new.tsv", f"text\nthe cat\n{CAFE}\n", 3),
    ("classifier", "new.jsonl", lines({"text": "the cat"}, {"text": CAFE}), 2),
    ("tagger", "new.conll", f"the\n\n{CAFE}\n", 3),
    ("tagger", "new.jsonl", lines({"tokens": ["the"]}, {"tokens": [CAFE]}), 2),
    ("reader", "new.json", '{"data": [{"title": "t", "paragraphs": [\n'
     + lines({"context": CAFE, "qas": [{"id": "1", "question": "q"}]}) + "]}]}\n", 2),
    ("reader", "new.jsonl", lines({"question": "q", "context": "c"},
                                  {"question": "q", "context": CAFE}), 2),
])
def test_predict_inputs_whole_and_streamed(tmp_path, family, name, text, line):
    """What `predict --input` reads: the whole file (task.read_inputs) and, with --chunk_rows,
    the streamed chunks (written in UTF-8, whatever the input's encoding)."""
    task = _task(*{"classifier": CLASSIFIER, "tagger": TAGGER, "reader": READER}[family])
    path = latin1(tmp_path, name, text)
    fields = {"text_a": "text", "label": "label"}
    one_line(lambda: task.read_inputs(path, fields), path, line)
    chunks = str(tmp_path / "chunks")
    os.makedirs(chunks)
    one_line(lambda: list(task.input_chunks(path, 1, fields, chunks)), path, line)

    latin = {**fields, "encoding": "latin-1"}
    examples, _ = task.read_inputs(path, latin)
    streamed = []
    for chunk, _ in task.input_chunks(path, 1, latin, chunks):
        streamed += task.read_inputs(chunk, {**latin, "encoding": "utf-8"})[0]
    for found in (examples, streamed):
        last = found[-1]
        text_of = getattr(last, "text_a", None) or getattr(last, "context", None)
        assert CAFE in (text_of or " ".join(last.words)), last


# ------------------------------------------------------------------------------ other readers


def test_extract_features_input_is_checked_before_the_model_loads(tmp_path):
    from bertjax.serving import extraction

    path = latin1(tmp_path, "in.txt", f"the cat\n{CAFE} ||| noir\n")
    message = one_line(lambda: extraction.run(str(tmp_path / "no_checkpoint"), path,
                                              str(tmp_path / "out.jsonl")), path, 2)
    assert message.endswith("give its encoding, e.g. --encoding=latin-1")
    assert not os.path.exists(tmp_path / "out.jsonl")
    with extraction._open(path, "--input_file", encoding="latin-1") as f:
        assert [x.rstrip("\n") for x in f] == ["the cat", f"{CAFE} ||| noir"]


def test_corpus_and_vocabulary_training_inputs(tmp_path):
    """Pre-training corpora and tokenizer-training text have no encoding option: the same
    line tells the user to save the file as UTF-8."""
    from bertjax.tokenization import train
    from data_pipeline import corpus

    path = latin1(tmp_path, "corpus.txt", f"the cat sat .\n\n{CAFE} noir .\n")
    for fn in (lambda: list(corpus.read_reference(path)), lambda: list(corpus.read_plain(path)),
               lambda: list(train.read_lines([path]))):
        message = one_line(fn, path, 3)
        assert message.endswith("save the file as UTF-8")
    jsonl = latin1(tmp_path, "c.jsonl", lines({"text": "the cat"}, {"text": CAFE}))
    assert one_line(lambda: list(corpus.read_jsonl(jsonl)), jsonl, 2).endswith("as UTF-8")


# ------------------------------------------------------------------------------ the commands


def _latin1_rows(tmp_path, name: str, n: int, labelled: bool = True) -> str:
    rows = [f"filler{1 + i % 3} {'good' if i % 2 else 'bad'} {CAFE}" for i in range(n)]
    return latin1(tmp_path, name, ("text,label\n" if labelled else "text\n") + "".join(
        f"{r},{['neg', 'pos'][i % 2]}\n" if labelled else f"{r}\n" for i, r in enumerate(rows)))


@pytest.mark.slow
def test_finetune_on_a_latin1_csv_is_one_line_on_stderr(tmp_path):
    checkpoint = write_tiny_checkpoint(tmp_path, KEYWORD_VOCAB)
    train = _latin1_rows(tmp_path, "train.csv", 4)
    args = ["-m", "bertjax.finetune", "--config=experiments/finetune_files.py:classification",
            f"--workdir={tmp_path / 'run'}", f"--config.init_checkpoint={checkpoint}",
            f"--config.data.train={train}", f"--config.data.validation={train}",
            "--config.max_seq_length=32", "--config.train.batch_size=2"]
    result = run_python(args)
    assert result.returncode == 1, result.stderr
    assert result.stderr.splitlines() == [
        f"error: {train}:2: invalid UTF-8 (byte 0xe9 at column 16); save the file as UTF-8 or "
        "give its encoding, e.g. --config.data.encoding=latin-1 (predict: --encoding=latin-1)"]
    assert not (tmp_path / "run").exists()


@pytest.mark.slow
@pytest.mark.extended
def test_a_latin1_run_then_predict_with_and_without_the_encoding(tmp_path):
    """config.data.encoding=latin-1 trains on Latin-1 files; predict reads new rows in the
    run's encoding unless --encoding names another, whole or streamed."""
    from bertjax import Predictor
    from bertjax.tasks import train_and_evaluate
    from experiments.finetune_files import get_config

    config = get_config("classification")
    config.init_checkpoint = write_tiny_checkpoint(tmp_path, KEYWORD_VOCAB)
    config.data.train = _latin1_rows(tmp_path, "train.csv", 32)
    config.data.validation = _latin1_rows(tmp_path, "dev.csv", 8)
    config.data.encoding = "latin-1"
    config.max_seq_length, config.train.batch_size, config.eval.batch_size = 32, 8, 8
    config.train.num_epochs, config.log_every_steps = 1, 1000
    train_and_evaluate(config, str(tmp_path / "run"), log=lambda *_: None)

    new = _latin1_rows(tmp_path, "new.csv", 5, labelled=False)
    predictor = Predictor.from_workdir(str(tmp_path / "run"))
    examples, whole, _ = predictor.predict_file(new)  # the run's encoding
    assert examples[0].text_a == f"filler1 bad {CAFE}" and len(whole) == 5
    streamed = []
    predictor.predict_stream(new, lambda e, r, labelled: streamed.extend(r), chunk_rows=2)
    assert streamed == whole
    one_line(lambda: predictor.predict_file(new, {"encoding": "utf-8"}), new, 2)
    with pytest.raises(ConfigError, match=r"^--encoding='klingon' is not an encoding"):
        predictor.predict_file(new, {"encoding": "klingon"})

    out = tmp_path / "preds.jsonl"
    result = run_python(["-m", "bertjax.predict", f"--workdir={tmp_path / 'run'}",
                         f"--input={new}", f"--output={out}", "--encoding=utf-8"])
    assert result.returncode == 1 and result.stderr.splitlines() == [
        f"error: {new}:2: invalid UTF-8 (byte 0xe9 at column 16); save the file as UTF-8 or "
        "give its encoding, e.g. --config.data.encoding=latin-1 (predict: --encoding=latin-1)"
    ], result.stderr
    result = run_python(["-m", "bertjax.predict", f"--workdir={tmp_path / 'run'}",
                         f"--input={new}", f"--output={out}", "--encoding=latin-1",
                         "--chunk_rows=2"])
    assert result.returncode == 0, result.stderr
    assert [json.loads(line) for line in out.read_text().splitlines()] == whole
