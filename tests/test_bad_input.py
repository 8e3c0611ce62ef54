"""The bad-input suite: every mistake a user can make is refused before any work, in one line
naming the file, field, flag or line at fault, with exit status 1, no traceback, and every file
that existed before left byte-identical (nothing half-written, no workdir created).

Cases run in-process through each command's own error path (`cli.report_errors` around the
function the command's main calls: validation, a reader, a converter); a few run the real
command lines to prove that path. Grouped by area: config, corpus (data creation), vocab,
tfrecords (TFRecords and their metadata), finetune_files, checkpoints (and convert), workdir.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import sys

import numpy as np
import pytest
from conftest import run_python

from bertjax import cli
from bertjax.tasks import checks as finetuning_checks
from bertjax.tasks.pretraining import checks as pretraining_checks

WORDS = "the a cat dog sat on mat ran far and it was big small red blue".split()
SPECIAL = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
VOCAB = SPECIAL + WORDS + ["##s", ".", ","]
SEQ = 32  # the data's max_seq_length (phase 1 of the test config)

# ------------------------------------------------------------------------------ the tmp world


def _write(path, text: str | bytes) -> str:
    path = str(path)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "wb") as f:
        f.write(text.encode() if isinstance(text, str) else text)
    return path


def _corpus(n_docs: int = 20, seed: int = 0) -> str:
    rng = np.random.default_rng(seed)
    docs = []
    for _ in range(n_docs):
        sentences = [" ".join(rng.choice(WORDS, rng.integers(4, 10))) + " ."
                     for _ in range(rng.integers(3, 8))]
        docs.append("\n".join(sentences))
    return "\n\n".join(docs) + "\n"


def _create(root, name: str, vocab: str, masking: str = "dynamic") -> str:
    from data_pipeline import create_pretraining_data as cpd

    cfg = cpd.CreateConfig(input=os.path.join(root, "corpus.txt"), output_dir=os.path.join(
        root, name), max_seq_length=SEQ, max_predictions_per_seq=5, dupe_factor=1,
        masking=masking, shuffle_buffer=10)
    cpd.create_pretraining_data(cfg, functools.partial(cpd.load_tokenizer, vocab, None),
                                vocab=vocab)
    return os.path.join(root, name, "*.tfrecord")


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """Good inputs of every kind, made once by the real writers; cases copy what they spoil."""
    root = str(tmp_path_factory.mktemp("world"))
    vocab = _write(f"{root}/vocab.txt", "\n".join(VOCAB) + "\n")
    other_vocab = _write(f"{root}/other/vocab.txt", "\n".join(VOCAB[:5] + VOCAB[5:][::-1]) + "\n")
    _write(f"{root}/corpus.txt", _corpus())
    data = _create(root, "data", vocab)
    static = _create(root, "static", vocab, masking="static")

    from bertjax import checkpoint_dir
    from bertjax.models import BertConfig

    model = BertConfig(vocab_size=len(VOCAB), hidden_size=8, num_layers=1, num_heads=2,
                       intermediate_size=16, max_position_embeddings=64)
    params = checkpoint_dir.init_groups(model, ["bert", "bert/pooler", "mlm", "nsp"], 0)
    checkpoint_dir.save_pretrained(f"{root}/ckpt", model, params, vocab)
    _write(f"{root}/files/train.csv", "text,label\nthe cat sat,pos\nthe dog ran,neg\n")
    _write(f"{root}/files/dev.csv", "text,label\na red cat,pos\na big dog,neg\n")
    return dict(root=root, vocab=vocab, other_vocab=other_vocab, data=data, static=static,
                ckpt=f"{root}/ckpt", model=model, params=params)


def snapshot(root: str) -> dict[str, str]:
    """Every file's sha256 and every directory under `root`."""
    state = {}
    for directory, dirs, files in os.walk(root):
        for name in dirs:
            state[os.path.relpath(os.path.join(directory, name), root)] = "dir"
        for name in files:
            path = os.path.join(directory, name)
            with open(path, "rb") as f:
                state[os.path.relpath(path, root)] = hashlib.sha256(f.read()).hexdigest()
    return state


def expect_error(fn, root: str, *needles: str, known=()) -> str:
    """Runs `fn` as a command does (cli.report_errors): one `error:` line naming `needles`,
    exit status 1, files under `root` unchanged. Returns the line."""
    before = snapshot(root)
    with pytest.raises(SystemExit) as info:
        cli.report_errors(fn, known=known)
    message = info.value.code
    assert isinstance(message, str), f"exit status {message!r}, not 1 with a message"
    assert len(message.splitlines()) == 1 and message.startswith("error: "), message
    assert "Traceback" not in message
    for needle in needles:
        assert needle in message, (needle, message)
    assert snapshot(root) == before, "files changed"
    return message


# ------------------------------------------------------------------------------ configs


def pretrain_config(world, **overrides):
    config = cli.load_config("experiments/pretrain.py:tiny")
    base = {"train.num_train_steps": 10, "train.batch_size": 2, "phases.phase1.data": "synthetic",
            "phases.phase2.data": "synthetic", "phases.phase1.seq_len": SEQ,
            "phases.phase1.max_predictions": 5, "phases.phase2.seq_len": 64,
            "phases.phase2.max_predictions": 10}
    config.update_from_flattened_dict({**base, **overrides})
    return config


def finetune_config(world, kind="classification", **overrides):
    config = cli.load_config(f"experiments/finetune_files.py:{kind}")
    base = {"init_checkpoint": world["ckpt"], "data.train": f"{world['root']}/files/train.csv",
            "data.validation": f"{world['root']}/files/dev.csv", "max_seq_length": 32,
            "train.batch_size": 2}
    config.update_from_flattened_dict({**base, **overrides})
    return config


def _pretrain_checks(config, workdir):
    """The pre-training command's path up to training: the config completed, then checked."""
    pretraining_checks.check(config, workdir, pretraining_checks.resolve(config))


def _pretrain(world, workdir="run", **overrides):
    config = pretrain_config(world, **overrides)
    return lambda: _pretrain_checks(config, os.path.join(world["root"], workdir))


def _finetune(world, workdir="ft", kind="classification", **overrides):
    """The fine-tuning command's path up to training: validation, then the job's reading of
    the files (before the model is loaded or anything is written)."""
    from bertjax.tasks import get_task

    config = finetune_config(world, kind, **overrides)

    def run():
        finetuning_checks.check(config, os.path.join(world["root"], workdir))
        get_task(config).read(config)

    return run


def test_the_good_inputs_pass(world):
    """The cases below spoil one thing each: the unspoiled inputs are accepted."""
    _pretrain_checks(pretrain_config(world), f"{world['root']}/run")
    _pretrain_checks(pretrain_config(world, **{"phases.phase1.data": world["data"],
                                               "vocab": world["vocab"]}), f"{world['root']}/run")
    _pretrain_checks(pretrain_config(world, **{
        "phases.phase1.data": world["static"], "masking.dynamic": False}), f"{world['root']}/run")
    _finetune(world)()
    assert not os.path.exists(f"{world['root']}/run")  # validation writes nothing


# ------------------------------------------------------------------------------ the cases
# (area, id, make(world, tmp) -> (fn, known), needles); tmp: a fresh directory for the case.

P1 = "phases.phase1"
CASES = []


def case(area, name, *needles, known=(), marks=()):
    def register(make):
        CASES.append(pytest.param(area, make, needles, known, id=f"{area}-{name}", marks=marks))
        return make
    return register


def pre(area, name, *needles, **overrides):
    """A pre-training case: the tiny config with `overrides` (dotted keys)."""
    CASES.append(pytest.param(area, lambda w, t: _pretrain(w, **overrides), needles, (),
                              id=f"{area}-{name}"))


# config: ranges, presets, phases
pre("config", "num_layers_0", "model.num_layers=0", **{"model.num_layers": 0})
pre("config", "hidden_0", "model.hidden_size=0", **{"model.hidden_size": 0})
pre("config", "heads_indivisible", "model.hidden_size=128", "model.num_heads=3",
    **{"model.num_heads": 3})
pre("config", "vocab_negative", "model.vocab_size=-1", **{"model.vocab_size": -1})
pre("config", "intermediate_0", "model.intermediate_size=0", **{"model.intermediate_size": 0})
pre("config", "positions_0", "model.max_position_embeddings=0",
    **{"model.max_position_embeddings": 0})
pre("config", "dropout_1.5", "model.hidden_dropout_prob=1.5", **{"model.hidden_dropout_prob": 1.5})
pre("config", "activation", "model.hidden_act='swish'", **{"model.hidden_act": "swish"})
pre("config", "dtype", "model.param_dtype='int8'", **{"model.param_dtype": "int8"})
pre("config", "fraction_1.5", "config.phases.phase1.fraction=1.5", **{f"{P1}.fraction": 1.5})
pre("config", "fraction_0", "config.phases.phase1.fraction=0.0", **{f"{P1}.fraction": 0.0})
pre("config", "fraction_negative", "config.phases.phase1.fraction=-0.5",
    **{f"{P1}.fraction": -0.5})
pre("config", "steps_negative", "config.phases.phase1.steps=-3", **{f"{P1}.steps": -3})
pre("config", "steps_overrun", "config.phases.phase1 ends at step 20",
    "num_train_steps=10", **{f"{P1}.steps": 20})
pre("config", "total_negative", "config.train.num_train_steps=-1",
    **{"train.num_train_steps": -1})
pre("config", "seq_len_over_positions", "config.phases.phase2.seq_len=1024",
    "max_position_embeddings=512", **{"phases.phase2.seq_len": 1024})
pre("config", "seq_len_0", "config.phases.phase1.seq_len=0", **{f"{P1}.seq_len": 0})
pre("config", "predictions_over_seq_len", "config.phases.phase1.max_predictions=40",
    **{f"{P1}.max_predictions": 40})
pre("config", "predictions_0", "config.phases.phase1.max_predictions=0",
    **{f"{P1}.max_predictions": 0})
pre("config", "batch_0", "config.train.batch_size=0", **{"train.batch_size": 0})
pre("config", "batch_negative", "config.train.batch_size=-4", **{"train.batch_size": -4})
pre("config", "accum_0", "config.train.grad_accum_steps=0", **{"train.grad_accum_steps": 0})
pre("config", "accum_indivisible", "config.train.batch_size=6",
    "config.train.grad_accum_steps=4", **{"train.batch_size": 6, "train.grad_accum_steps": 4})
pre("config", "lr_negative", "config.optimizer.learning_rate=-0.0001",
    **{"optimizer.learning_rate": -1e-4})
pre("config", "optimizer_name", "config.optimizer.name='sgd'", **{"optimizer.name": "sgd"})
pre("config", "warmup_negative", "config.optimizer.warmup_steps=-1",
    **{"optimizer.warmup_steps": -1})
pre("config", "checkpoint_every_0", "config.checkpoint.every_steps=0",
    **{"checkpoint.every_steps": 0})
pre("config", "keep_0", "config.checkpoint.max_to_keep=0", **{"checkpoint.max_to_keep": 0})
pre("config", "log_every_0", "config.log_every_steps=0", **{"log_every_steps": 0})
pre("config", "mlm_prob_1.5", "config.masking.masked_lm_prob=1.5",
    **{"masking.masked_lm_prob": 1.5})
pre("config", "packing_with_nsp", "config.packing.enabled=True",
    "config.train.nsp_weight=0.0", **{"packing.enabled": True})
pre("config", "packing_synthetic", "config.phases.phase1.data=synthetic cannot be packed",
    **{"packing.enabled": True, "train.nsp_weight": 0.0})
pre("config", "phase2_data_empty", "config.phases.phase2.data is empty",
    **{"phases.phase2.data": ""})
pre("config", "phase2_pattern_late", "config.phases.phase2.data: no files match",
    **{"phases.phase2.data": "/nonexistent/seq512/*.tfrecord"})
pre("config", "eval_pattern", "config.phases.phase1.eval_data: no files match",
    **{f"{P1}.eval_data": "/nonexistent/eval-*.tfrecord"})


@case("config", "finetune_batch_0", "config.train.batch_size=0")
def _(w, t):
    return _finetune(w, **{"train.batch_size": 0})


@case("config", "finetune_epochs_0", "config.train.num_epochs=0")
def _(w, t):
    return _finetune(w, **{"train.num_epochs": 0.0})


@case("config", "finetune_warmup", "config.optimizer.warmup_proportion=1.5")
def _(w, t):
    return _finetune(w, **{"optimizer.warmup_proportion": 1.5})


@case("config", "finetune_seq_over_positions", "config.max_seq_length=128", "64 positions")
def _(w, t):
    return _finetune(w, **{"max_seq_length": 128})


@case("config", "finetune_dropout_1", "model.hidden_dropout_prob=1.0")
def _(w, t):
    return _finetune(w, **{"model.hidden_dropout_prob": 1.0})


@case("config", "finetune_no_checkpoint", "config.init_checkpoint is empty")
def _(w, t):
    return _finetune(w, **{"init_checkpoint": ""})


# corpus: creating pre-training data


def _create_main(w, t, **flags):
    from data_pipeline import create_pretraining_data as cpd

    values = dict(input=f"{w['root']}/corpus.txt", output_dir=f"{t}/out", vocab=w["vocab"],
                  input_format="reference", max_seq_length=SEQ, max_predictions_per_seq=5,
                  masked_lm_prob=0.15, short_seq_prob=0.1, dupe_factor=1,
                  do_whole_word_mask=False, random_seed=1, masking="dynamic", num_shards=1,
                  num_workers=1, task_index=0, num_tasks=1, pool_size=10, shuffle_buffer=10,
                  do_lower_case=None, mask_prob=0.8, same_prob=0.1, random_prob=0.1)
    values.update(flags)
    import types

    return lambda: cpd.main(types.SimpleNamespace(**values))


def corpus_case(name, *needles, files=None, **flags):
    def make(w, t):
        for rel, text in (files or {}).items():
            _write(f"{t}/{rel}", text)
        return _create_main(w, t, **{k: v.format(t=t) if isinstance(v, str) else v
                                     for k, v in flags.items()})
    CASES.append(pytest.param("corpus", make, needles, (ValueError,), id=f"corpus-{name}"))


corpus_case("output_dir_a_file", "--output_dir=", "/taken: a file is in the way",
            files={"taken": "x"}, output_dir="{t}/taken")
corpus_case("empty_corpus", "empty.txt: no documents", "nothing written",
            files={"empty.txt": ""}, input="{t}/empty.txt")
corpus_case("blank_lines_only", "blank.txt: no documents", files={"blank.txt": "\n\n  \n"},
            input="{t}/blank.txt")
corpus_case("missing_input", "nope.txt: no such input file", input="{t}/nope.txt")
corpus_case("bad_utf8", "bad.txt:2: invalid UTF-8", files={"bad.txt": b"the cat\n\xff\xfe\n"},
            input="{t}/bad.txt")
corpus_case("bad_jsonl", "c.jsonl:2: invalid JSON", files={"c.jsonl": '{"text": "a"}\n{no\n'},
            input="{t}/c.jsonl", input_format="jsonl")
corpus_case("jsonl_no_text", "c.jsonl:1: expected an object with a string 'text'",
            files={"c.jsonl": '{"body": "the cat"}\n'}, input="{t}/c.jsonl", input_format="jsonl")
corpus_case("one_long_line", "line.txt: only 1 document(s) in 1 file(s) (the first of",
            "unusable for sentence pairs",
            "expected one sentence per line, blank lines between documents",
            files={"line.txt": " ".join(["the cat sat on the mat ."] * 125_000)},
            input="{t}/line.txt")
corpus_case("predictions_over_length", "--max_predictions_per_seq", max_predictions_per_seq=64)
corpus_case("shards_0", "--num_shards must be >= 1", num_shards=0)
corpus_case("missing_vocab", "--vocab: no such file or directory", vocab="{t}/nope/vocab.txt")
corpus_case("masking_mode", "--masking must be 'static' or 'dynamic'", masking="random")
corpus_case("masking_mix", "--mask_prob + --same_prob + --random_prob = 0.9 + 0.1 + 0.1 = 1.1",
            mask_prob=0.9)


@case("corpus", "segments_empty_corpus", "empty.txt: no documents", known=(ValueError,))
def _(w, t):
    from data_pipeline import create_segments

    _write(f"{t}/empty.txt", "")
    cfg = create_segments.SegmentsConfig(input=f"{t}/empty.txt", output_dir=f"{t}/out",
                                         max_seq_length=SEQ)
    from data_pipeline import create_pretraining_data as cpd

    return lambda: create_segments.create_segments(
        cfg, functools.partial(cpd.load_tokenizer, w["vocab"], None))


# vocab: config.vocab, tokenizer files


def vocab_case(name, *needles, files=None, vocab="{t}/vocab.txt", **overrides):
    def make(w, t):
        for rel, text in (files or {}).items():
            _write(f"{t}/{rel}", text)
        return _pretrain(w, vocab=vocab.format(t=t, root=w["root"]), **overrides)
    CASES.append(pytest.param("vocab", make, needles, (), id=f"vocab-{name}"))


vocab_case("missing", "config.vocab=", "no such vocabulary file")
vocab_case("empty_file", "vocab.txt: vocabulary file is empty", files={"vocab.txt": ""})
vocab_case("duplicate", "duplicate vocabulary entry 'a' at lines 7 and 8",
           files={"vocab.txt": "\n".join(SPECIAL + ["the", "a", "a"]) + "\n"})
vocab_case("not_utf8", "vocab.txt: invalid UTF-8", files={"vocab.txt": b"[PAD]\n\xff\xfe\n"})
vocab_case("no_specials", "vocabulary lacks special token(s)", files={"vocab.txt": "a\nb\n"})
vocab_case("dir_without_vocab", "no vocab.txt or *.model", files={"d/readme": "x"},
           vocab="{t}/d")
vocab_case("tokenizer_config_json", "tokenizer_config.json: unreadable tokenizer config",
           files={"d/vocab.txt": "\n".join(VOCAB), "d/tokenizer_config.json": "{oops"},
           vocab="{t}/d")
vocab_case("unknown_model_type", "field 'type' must be one of wordpiece, sentencepiece",
           files={"d/vocab.txt": "\n".join(VOCAB), "d/tokenizer_config.json": '{"type": "bpe"}'},
           vocab="{t}/d")
vocab_case("bigger_than_model", "config.model.vocab_size=10", vocab="{root}/vocab.txt",
           **{"model.vocab_size": 10})


@case("vocab", "other_vocab_than_data", "vocab_hash differs", "metadata.json")
def _(w, t):
    return _pretrain(w, vocab=w["other_vocab"], **{f"{P1}.data": w["data"]})


vocab_case("sentencepiece_garbage", "x.model: not a SentencePiece model",
           files={"x.model": "garbage"}, vocab="{t}/x.model")


# tfrecords: shards and metadata


def _copy_data(w, t, name="data") -> str:
    import shutil

    shutil.copytree(os.path.dirname(w[name]), f"{t}/data")
    return f"{t}/data/*.tfrecord"


def record_case(name, *needles, spoil=None, source="data", **overrides):
    def make(w, t):
        pattern = _copy_data(w, t, source)
        if spoil:
            spoil(t)
        return _pretrain(w, **{f"{P1}.data": pattern, **overrides})
    CASES.append(pytest.param("tfrecords", make, needles, (), id=f"tfrecords-{name}"))


def _meta(t, edit):
    path = f"{t}/data/metadata.json"
    meta = json.load(open(path))
    edit(meta)
    _write(path, json.dumps(meta))


record_case("empty_shard", "part-00001-of-00002.tfrecord: empty TFRecord file (0 bytes",
            spoil=lambda t: _write(f"{t}/data/part-00001-of-00002.tfrecord", b""))
record_case("metadata_not_json", "metadata.json: invalid JSON",
            spoil=lambda t: _write(f"{t}/data/metadata.json", "{not json"))
record_case("metadata_list", "metadata.json: expected a JSON object",
            spoil=lambda t: _write(f"{t}/data/metadata.json", "[1, 2]"))
record_case("metadata_binary", "metadata.json: invalid JSON",
            spoil=lambda t: _write(f"{t}/data/metadata.json", b"\xff\x00\x01"))
record_case("seq_len_differs", "max_seq_length is 32",
            "config.phases.phase1.seq_len=64",
            **{f"{P1}.seq_len": 64, "phases.phase2.seq_len": 128})
record_case("model_vocab_smaller_than_data", f"vocabulary has {len(VOCAB)} ids",
            "config.model.vocab_size=12", **{"model.vocab_size": 12})
record_case("dynamic_data_static_reader", "masking is 'dynamic'",
            "config.masking.dynamic=False", **{"masking.dynamic": False})
record_case("static_predictions_differ", "max_predictions_per_seq is 5",
            "config.phases.phase1.max_predictions=4", source="static",
            **{"masking.dynamic": False, f"{P1}.max_predictions": 4})
record_case("not_a_tfrecord", "part-00000-of-00001.tfrecord: not a TFRecord file",
            spoil=lambda t: [os.remove(f"{t}/data/metadata.json"),
                             _write(f"{t}/data/part-00000-of-00001.tfrecord", "hello")])
record_case("packed_without_metadata", "no metadata*.json",
            spoil=lambda t: os.remove(f"{t}/data/metadata.json"),
            **{"packing.enabled": True, "train.nsp_weight": 0.0})


def _write_records(path, features_list):
    from data_pipeline import tfrecords

    os.makedirs(os.path.dirname(path), exist_ok=True)
    with tfrecords.ShardWriter(path) as writer:
        for features in features_list:
            writer.write(tfrecords.serialize_example(features))


@case("tfrecords", "wrong_schema", "lack the feature(s) input_mask, segment_ids")
def _(w, t):
    _write_records(f"{t}/ft/part-0.tfrecord", [{"input_ids": np.arange(SEQ),
                                                "label_ids": np.array([1])}])
    return _pretrain(w, **{f"{P1}.data": f"{t}/ft/*.tfrecord"})


@case("tfrecords", "reference_ids_over_vocab", "token id 99 is outside config.model.vocab_size=50")
def _(w, t):
    from data_pipeline import tfrecords

    ids = np.arange(SEQ) % 20
    ids[3] = 99
    features = tfrecords.pad_example(ids, np.zeros(SEQ, np.int32), False, SEQ,
                                     (np.array([1, 2]), np.array([5, 6])), 5)
    _write_records(f"{t}/ref/part-0.tfrecord", [features])
    return _pretrain(w, **{f"{P1}.data": f"{t}/ref/*.tfrecord", "model.vocab_size": 50})


@case("tfrecords", "reference_length_differs", "input_ids has 32 positions",
      "config.phases.phase2.seq_len=64")
def _(w, t):
    from data_pipeline import tfrecords

    features = tfrecords.pad_example(np.arange(10), np.zeros(10, np.int32), False, SEQ,
                                     (np.array([1]), np.array([5])), 10)
    _write_records(f"{t}/ref/part-0.tfrecord", [features])
    return _pretrain(w, **{"phases.phase2.data": f"{t}/ref/*.tfrecord"})


# finetune_files: the fine-tuning readers name file and line


def files_case(name, *needles, train=None, kind="classification", ext="csv", **overrides):
    def make(w, t):
        path = _write(f"{t}/train.{ext}", train) if train is not None else f"{t}/nope.{ext}"
        dev = {"data.validation": path} if kind == "regression" else {}
        return _finetune(w, kind=kind, **{"data.train": path, **dev, **overrides})
    CASES.append(pytest.param("finetune_files", make, needles, (), id=f"finetune_files-{name}"))


files_case("unquoted_comma", "train.csv:3: the row has 3 fields but the header 2",
           "unquoted comma", train="text,label\nthe cat,pos\nthe dog, it ran,neg\n")
files_case("empty_label", "train.csv:3: empty label in column 'label'",
           train="text,label\nthe cat,pos\nthe dog,\n")
files_case("regression_nan", "train.csv:2: regression label 'nan' is not a finite number",
           kind="regression", train="text,label\nthe cat,nan\nthe dog,0.5\n")
files_case("regression_inf", "train.csv:3: regression label 'inf'", kind="regression",
           train="text,label\nthe cat,1\nthe dog,inf\n")
files_case("regression_jsonl_nan", "train.jsonl:1: regression label 'nan'", kind="regression",
           ext="jsonl", train='{"text": "a cat", "label": NaN}\n')
files_case("regression_text", "train.csv:2: regression label 'high' is not a number",
           kind="regression", train="text,label\nthe cat,high\n")
files_case("missing_file", "config.data.train:", "nope.csv does not exist")
files_case("missing_column", "train.csv:2: missing column 'label'", train="text,label\nthe cat\n")
files_case("no_text_column", "train.csv:2: no column 'text' (config.data.text_a, predict "
           "--text_a); the file's columns: sentence, label",
           train="sentence,label\nthe cat,pos\n")
files_case("jsonl_not_json", "train.jsonl:2: invalid JSON", ext="jsonl",
           train='{"text": "a", "label": "pos"}\n{oops\n')
files_case("unknown_extension", "train.txt: unknown file type", ext="txt", train="a\n")
files_case("empty_file", "train.csv: empty file", train="")
files_case("label_not_declared", "train.csv:3: label 'meh' is not one of ['neg', 'pos']",
           train="text,label\nthe cat,pos\nthe dog,meh\n", **{"data.labels": "neg,pos"})
files_case("empty_text", "train.csv:2: empty text in column 'text'", train="text,label\n ,pos\n")
# A Latin-1 file (tests/test_encoding.py: every reader, and config.data.encoding=latin-1).
LATIN1_HINT = "save the file as UTF-8 or give its encoding, e.g. --config.data.encoding=latin-1"
files_case("latin1_csv", "train.csv:3: invalid UTF-8 (byte 0xe9 at column 4)", LATIN1_HINT,
           train="text,label\nthe cat,pos\ncafé,neg\n".encode("latin-1"))
files_case("latin1_jsonl", "train.jsonl:2: invalid UTF-8 (byte 0xe9 at column 14)", LATIN1_HINT,
           ext="jsonl", train='{"text": "a", "label": "pos"}\n{"text": "café", "label": "neg"}\n'
           .encode("latin-1"))


@case("finetune_files", "glue_missing_train", "train.tsv: no such file")
def _(w, t):
    from bertjax.tasks import get_task

    config = cli.load_config("experiments/glue.py:sst2")
    config.init_checkpoint, config.data.dir = w["ckpt"], f"{t}/glue"
    config.max_seq_length = 32
    os.makedirs(f"{t}/glue", exist_ok=True)
    return lambda: (finetuning_checks.check(config, f"{t}/run"), get_task(config).read(config))


@case("finetune_files", "conll_columns", "train.txt:2: 1 columns")
def _(w, t):
    from bertjax.tasks.tagging import readers

    _write(f"{t}/train.txt", "EU B-ORG\nrejects\n")
    return lambda: readers.read_columns(f"{t}/train.txt")


@case("finetune_files", "conll_latin1", "train.txt:2: invalid UTF-8 (byte 0xe9 at column 4)")
def _(w, t):
    from bertjax.tasks.tagging import readers

    _write(f"{t}/train.txt", "EU B-ORG\ncafé O\n".encode("latin-1"))
    return lambda: readers.read_columns(f"{t}/train.txt")


@case("finetune_files", "squad_latin1", "train.json:2: invalid UTF-8 (byte 0xe9 at column")
def _(w, t):
    from bertjax.tasks.squad import readers

    _write(f"{t}/train.json", '{"data": [\n{"title": "café"}]}'.encode("latin-1"))
    return lambda: readers.read_squad_json(f"{t}/train.json")


@case("finetune_files", "squad_not_json", "train.json: not valid JSON")
def _(w, t):
    from bertjax.tasks.squad import readers

    _write(f"{t}/train.json", '{"data": [')
    return lambda: readers.read_squad_json(f"{t}/train.json")


# checkpoints: init checkpoints, convert


def _broken_checkpoint(w, t, config_json: str) -> str:
    import shutil

    shutil.copytree(w["ckpt"], f"{t}/ckpt")
    _write(f"{t}/ckpt/config.json", config_json)
    return f"{t}/ckpt"


@case("checkpoints", "init_missing", "config.init_checkpoint=", "no such directory")
def _(w, t):
    return _pretrain(w, init_checkpoint=f"{t}/nope")


@case("checkpoints", "init_not_a_checkpoint", "is not a bertjax checkpoint (no params/)")
def _(w, t):
    os.makedirs(f"{t}/empty")
    return _pretrain(w, init_checkpoint=f"{t}/empty")


@case("checkpoints", "init_pretraining_workdir", "is not a bertjax checkpoint (no params/); "
      "it is a pre-training run: its model is", "/run/export")
def _(w, t):
    import shutil

    os.makedirs(f"{t}/run/checkpoints")
    shutil.copytree(w["ckpt"], f"{t}/run/export")
    return _finetune(w, init_checkpoint=f"{t}/run")


@case("checkpoints", "init_other_size", f"model.vocab_size is {len(VOCAB)} there but",
      "config.model.vocab_size=30522")
def _(w, t):
    return _pretrain(w, init_checkpoint=w["ckpt"])


@case("checkpoints", "init_config_malformed", "ckpt/config.json: invalid JSON")
def _(w, t):
    return _pretrain(w, init_checkpoint=_broken_checkpoint(w, t, "{oops"))


@case("checkpoints", "finetune_config_malformed", "ckpt/config.json: invalid JSON")
def _(w, t):
    return _finetune(w, init_checkpoint=_broken_checkpoint(w, t, "{oops"))


@case("checkpoints", "finetune_config_bad_field", "ckpt/config.json: model.num_layers=0")
def _(w, t):
    fields = dict(w["model"].to_dict(), num_layers=0)
    return _finetune(w, init_checkpoint=_broken_checkpoint(w, t, json.dumps(fields)))


def _convert(args):
    from absl import flags

    from bertjax.convert import __main__ as convert

    if "checkpoint" not in flags.FLAGS:
        convert.define_flags()

    def run():
        try:
            convert.main(cli.parse_flags(["bertjax.convert", *map(str, args)]))
        finally:
            flags.FLAGS.unparse_flags()
    return run


def _hf_dir(w, t) -> str:
    from bertjax import checkpoint_dir
    from bertjax.convert import huggingface

    huggingface.write_hf_checkpoint(f"{t}/hf", w["model"], w["params"],
                                    checkpoint_dir.vocab_path(w["ckpt"]), True,
                                    "BertForPreTraining", "float32", False)
    return f"{t}/hf"


@case("checkpoints", "truncated_safetensors", "hf/model.safetensors: unreadable safetensors")
def _(w, t):
    hf = _hf_dir(w, t)
    data = open(f"{hf}/model.safetensors", "rb").read()
    _write(f"{hf}/model.safetensors", data[: len(data) // 2])
    return _convert(["from_hf", f"--input={hf}", f"--output={t}/out"])


@case("checkpoints", "hf_config_malformed", "hf/config.json: invalid JSON")
def _(w, t):
    hf = _hf_dir(w, t)
    _write(f"{hf}/config.json", "{")
    return _convert(["from_hf", f"--input={hf}", f"--output={t}/out"])


@case("checkpoints", "to_hf_config_malformed", "ckpt/config.json: invalid JSON")
def _(w, t):
    return _convert(["to_hf", f"--input={_broken_checkpoint(w, t, '[')}",
                     f"--output={t}/out"])


@case("checkpoints", "extract_features_output_dir", "--output_file=", "no such directory",
      known=(ValueError,))
def _(w, t):
    from bertjax.serving import extraction as extract_features

    _write(f"{t}/in.txt", "the cat\n")
    return lambda: extract_features.run(w["ckpt"], f"{t}/in.txt", f"{t}/missing/out.jsonl")


def _truncated_checkpoint(w, t) -> str:
    """A copy of the checkpoint whose parameter data file is cut in half (a copy or a disk
    that failed)."""
    import shutil

    shutil.copytree(w["ckpt"], f"{t}/ckpt")
    (data,) = [os.path.join(f"{t}/ckpt/params/d", n) for n in os.listdir(f"{t}/ckpt/params/d")]
    with open(data, "rb+") as f:
        f.truncate(os.path.getsize(data) // 2)
    return f"{t}/ckpt"


TRUNCATED = ("ckpt/params is unreadable or incomplete (", "ckpt/params/d/",
             "write or convert the checkpoint again")


@case("checkpoints", "to_hf_truncated_params", *TRUNCATED)
def _(w, t):
    return _convert(["to_hf", f"--input={_truncated_checkpoint(w, t)}", f"--output={t}/out"])


@case("checkpoints", "extract_features_truncated_params", *TRUNCATED)
def _(w, t):
    from bertjax.serving import extraction

    _write(f"{t}/in.txt", "the cat\n")
    checkpoint = _truncated_checkpoint(w, t)
    return lambda: extraction.run(checkpoint, f"{t}/in.txt", f"{t}/out.jsonl")


@case("checkpoints", "finetune_init_truncated_params", *TRUNCATED)
def _(w, t):
    from bertjax.tasks.base import load_pretrained_model

    config = finetune_config(w, init_checkpoint=_truncated_checkpoint(w, t))
    return lambda: load_pretrained_model(config)


# workdir


@case("workdir", "is_a_file", "--workdir=", "is a file, not a directory")
def _(w, t):
    _write(f"{t}/run", "not a directory")
    return lambda: _pretrain_checks(pretrain_config(w), f"{t}/run")


@case("workdir", "parent_is_a_file", "--workdir=", "is a file, not a directory")
def _(w, t):
    _write(f"{t}/file", "x")
    return lambda: _pretrain_checks(pretrain_config(w), f"{t}/file/run")


@case("workdir", "finetune_is_a_file", "--workdir=", "is a file, not a directory")
def _(w, t):
    _write(f"{t}/ft", "x")
    config = finetune_config(w)
    return lambda: finetuning_checks.check(config, f"{t}/ft")


@case("workdir", "read_only", "is not writable", marks=pytest.mark.skipif(
    os.geteuid() == 0, reason="root may write to read-only directories"))
def _(w, t):
    os.makedirs(f"{t}/ro")
    os.chmod(f"{t}/ro", 0o555)
    return lambda: _pretrain_checks(pretrain_config(w), f"{t}/ro/run")


@pytest.mark.parametrize("area,make,needles,known", CASES)
def test_bad_input_is_one_line_before_any_work(world, tmp_path, capsys, area, make, needles,
                                               known):
    fn = make(world, str(tmp_path))
    expect_error(fn, os.path.dirname(world["root"]), *needles, known=known)
    captured = capsys.readouterr()
    assert "Traceback" not in captured.out + captured.err


def test_the_suite_covers_every_area_with_60_cases():
    areas = {}
    for p in CASES:
        areas[p.values[0]] = areas.get(p.values[0], 0) + 1
    assert len(CASES) >= 60 and set(areas) == {
        "config", "corpus", "vocab", "tfrecords", "finetune_files", "checkpoints", "workdir"}


# ------------------------------------------------------------------------------ warnings


def test_a_one_line_document_is_warned_with_the_share_used(tmp_path, caplog):
    from data_pipeline import create_pretraining_data as cpd

    vocab = _write(f"{tmp_path}/vocab.txt", "\n".join(VOCAB) + "\n")
    words = np.random.default_rng(0).choice(WORDS, 2000)
    _write(f"{tmp_path}/one_line.txt", " ".join(words) + "\n\nthe cat sat .\nit ran .\n")
    cfg = cpd.CreateConfig(input=f"{tmp_path}/one_line.txt", output_dir=f"{tmp_path}/out",
                           max_seq_length=SEQ, max_predictions_per_seq=5, dupe_factor=2)
    meta = cpd.create_pretraining_data(cfg, functools.partial(cpd.load_tokenizer, vocab, None))
    assert meta["counts"]["long_sentences"] == 1
    assert meta["counts"]["long_sentence_tokens"] == 2000
    line = cpd.warn_partial_use(cfg, meta["counts"])
    # Each pass (32 - 3) tokens of the 2000: 1.4%; the sentence is 2000 of 2006 corpus tokens.
    assert (f"each of the 2 passes (--dupe_factor) uses at most {(SEQ - 3) / 2000:.1%} of "
            "their 2000 tokens") in line
    assert "(99.7% of the corpus)" in line
    assert "2000 on average (a document on a single line?" in line  # far past an instance
    assert line in caplog.text


def test_truncated_fine_tuning_texts_are_counted(world, caplog):
    from bertjax.tokenization import load_tokenizer
    from data_pipeline import finetune_data
    from data_pipeline.finetune_data import Example

    tokenizer = load_tokenizer(world["vocab"])
    texts = [("the cat", None), ("the cat sat on the mat", None), ("the cat", "sat on it"),
             ("a dog", "ran far and it was big"), ("the cat sat", None)]
    examples = [Example(f"f.csv:{i + 2}", a, b, 0, str(i)) for i, (a, b) in enumerate(texts)]
    # max_seq_length 7: [CLS] + 5 + [SEP] fits 5 words alone, or 4 words of a pair.
    lengths = [len(tokenizer.tokenize(a)) + (len(tokenizer.tokenize(b)) + 1 if b else 0) + 2
               for a, b in texts]
    features = finetune_data.encode(tokenizer, examples, max_seq_length=7)
    assert features.truncated == sum(n > 7 for n in lengths) == 3
    assert "f.csv: 3 of 5 examples (60.0%) are longer than max_seq_length=7" in caplog.text


# ------------------------------------------------------------------------------ the real CLIs


@pytest.mark.slow
def test_the_command_lines_say_one_line_and_write_nothing(tmp_path):
    workdir = tmp_path / "run"
    base = ["-m", "bertjax.pretrain", "--config=experiments/pretrain.py:tiny",
            f"--workdir={workdir}", "--config.phases.phase1.data=synthetic",
            "--config.phases.phase2.data=synthetic"]
    result = run_python([*base, "--config.phases.phase1.fraction=1.5"])
    assert result.returncode == 1 and result.stderr.splitlines() == [
        "error: config.phases.phase1.fraction=1.5 must be in (0, 1]"], result.stderr
    assert not workdir.exists()
    unknown = run_python(["-m", "bertjax.pretrain", "--config=experiments/pretrain.py:nope",
                          f"--workdir={workdir}"])
    assert unknown.returncode == 1 and unknown.stderr.splitlines() == [
        "error: --config=experiments/pretrain.py:nope: unknown model preset 'nope'; choose one "
        "of ['base', 'large', 'medium', 'mini', 'small', 'tiny'] (--help lists the flags)"]
    # --verbose (or BERTJAX_TRACEBACK=1) shows where it came from instead.
    verbose = run_python([*base, "--config.model.num_layers=0"],
                         env={"BERTJAX_TRACEBACK": "1"})
    assert verbose.returncode == 1 and "Traceback" in verbose.stderr
    assert "ConfigError: model.num_layers=0" in verbose.stderr
    assert not workdir.exists()
    # --distributed where no cluster can be detected (this machine): what to pass instead.
    alone = run_python([*base, "--distributed"])
    lines = alone.stderr.splitlines()
    assert alone.returncode == 1 and len(lines) == 1, alone.stderr
    assert lines[0].startswith("error: --distributed: ") and lines[0].endswith(
        "(no cluster was detected here; give --coordinator_address, --num_processes and "
        "--process_id)")
    assert not workdir.exists()


def test_create_pretraining_data_command_refuses_an_empty_corpus(tmp_path):
    _write(f"{tmp_path}/empty.txt", "")
    vocab = _write(f"{tmp_path}/vocab.txt", "\n".join(VOCAB) + "\n")
    result = run_python(["-m", "data_pipeline.create_pretraining_data",
                         f"--input={tmp_path}/empty.txt", f"--output_dir={tmp_path}/out",
                         f"--vocab={vocab}"])
    assert result.returncode == 1
    assert result.stderr.splitlines() == [
        f"error: {tmp_path}/empty.txt: no documents in 1 file(s) (empty corpus?); nothing "
        "written"]
    assert not (tmp_path / "out").exists()


def test_a_failed_demo_step_is_one_line_naming_the_step(capsys):
    # The step prints its own `error:` line; the demo adds one naming the step, no traceback.
    with pytest.raises(cli.BertjaxError) as raised:
        cli.run_command([sys.executable, "-c", "import sys; sys.exit(3)"])
    assert str(raised.value) == "the step above failed (exit 3): -c 'import sys; sys.exit(3)'"
    assert "$ " in capsys.readouterr().out
    cli.run_command([sys.executable, "-c", "pass"])  # a step that succeeds returns quietly


def test_a_demo_whose_step_fails_ends_in_one_line(tmp_path):
    # cli.run reports every command's known errors, so the demo driver needs no handler.
    corpus = _write(f"{tmp_path}/corpus.txt", "One line here.\nAnother one.\n\nA second doc.\n")
    result = run_python(["-m", "bertjax.demos.pretraining_demo", f"--corpus={corpus}",
                         "--vocab_size=0", f"--data_dir={tmp_path}/data",
                         f"--workdir={tmp_path}/run",
                         "--finetune_data="])
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr
    assert result.stderr.splitlines()[-2:] == [
        "error: --vocab_size must be positive, got 0",
        "error: the step above failed (exit 1): -m bertjax.tokenization"], result.stderr
    assert not (tmp_path / "run").exists()


# A command (cli.run) whose checkpoint save fails with EFBIG (a file size limit, as a full disk
# fails with ENOSPC), while orbax's asynchronous save threads are still running.
FAILED_SAVE_COMMAND = """
import resource, signal, sys
import regression_job as rj
from bertjax import cli
from bertjax.train import checkpoints

original_save = checkpoints.Checkpointer.save


def save_on_a_full_disk(self, step, *args, **kwargs):
    if step == 4:
        self.wait()  # step 2 complete
        resource.setrlimit(resource.RLIMIT_FSIZE, (8192, resource.RLIM_INFINITY))
    return original_save(self, step, *args, **kwargs)


def main(argv):
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # EFBIG, not a kill
    checkpoints.Checkpointer.save = save_on_a_full_disk
    rj.run(argv[1], 4, pad=64)


cli.run(main)
"""


@pytest.mark.slow
def test_a_failed_save_and_a_truncated_checkpoint_end_in_exactly_one_line(world, tmp_path):
    """The error line is all of stderr: no traceback from threads still running while the
    process shuts down (asynchronous saves, orbax's and asyncio's finalisers)."""
    result = run_python(["-c", FAILED_SAVE_COMMAND, str(tmp_path / "run")])
    assert result.returncode == 1, result.stderr[-3000:]
    (line,) = result.stderr.splitlines()
    assert line.startswith(f"error: saving checkpoint step 4 to {tmp_path / 'run'}"), line
    assert "step 2 is intact" in line
    # Step 4 stays an orbax temporary directory, never a checkpoint.
    assert [n for n in os.listdir(tmp_path / "run" / "checkpoints") if "tmp" not in n] == ["2"]

    checkpoint = _truncated_checkpoint(world, str(tmp_path))
    _write(f"{tmp_path}/in.txt", "the cat\n")
    for args in (["-m", "bertjax.convert", "to_hf", f"--input={checkpoint}",
                  f"--output={tmp_path}/hf"],
                 ["-m", "bertjax.extract_features", f"--checkpoint={checkpoint}",
                  f"--input_file={tmp_path}/in.txt", f"--output_file={tmp_path}/out.jsonl"]):
        result = run_python(args)
        assert result.returncode == 1
        (line,) = result.stderr.splitlines()
        assert line.startswith(f"error: {checkpoint}/params is unreadable or incomplete"), line
    assert not os.path.exists(f"{tmp_path}/hf") and not os.path.exists(f"{tmp_path}/out.jsonl")


# Reports a library makes of its own background failures (a logged exception, a thread's, one
# ignored in a finalizer), as a failed checkpoint read's abandoned reads make them under load.
LIBRARY_REPORTS_COMMAND = """
import logging, threading
from bertjax import cli


class Finalized:
    def __del__(self):
        raise RuntimeError("Event loop is gone")


def main(argv):
    try:
        raise ValueError("late read")
    except ValueError:
        logging.getLogger("somelib").exception("read %s failed", "d/4c77")
    thread = threading.Thread(target=lambda: 1 / 0, name="reader")
    thread.start()
    thread.join()
    Finalized()
    print("done")


cli.run(main)
"""


@pytest.mark.parametrize("verbose", [False, True])
def test_library_background_failures_are_one_line_each_unless_verbose(verbose):
    result = run_python(["-c", LIBRARY_REPORTS_COMMAND],
                        env={"BERTJAX_TRACEBACK": "1" if verbose else "0"})
    assert result.returncode == 0 and result.stdout == "done\n", result.stderr
    tracebacks = result.stderr.count("Traceback (most recent call last)")
    if verbose:
        assert tracebacks == 3, result.stderr
        return
    lines = result.stderr.splitlines()
    assert tracebacks == 0 and len(lines) == 3, lines
    assert lines[0].endswith("read d/4c77 failed (ValueError: late read)"), lines
    assert lines[1:] == ["warning: reader: ZeroDivisionError: division by zero",
                         "warning: ignored RuntimeError: Event loop is gone"], lines
