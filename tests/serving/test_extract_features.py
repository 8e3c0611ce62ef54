"""extract_features: the reference JSON format, values equal to the model's hidden states."""

import json
import re

import flax.linen as nn
import jax
import numpy as np
import pytest
from conftest import run_python

from bertjax import checkpoint_dir
from bertjax.models import BertConfig, BertForPreTraining, BertModel
from bertjax.serving.extraction import FeatureExtractor, parse_layers, parse_line, run

WORDS = ["the", "quick", "brown", "fox", "jump", "##s", "##ed", "over", "a", "dog", "lazy", ".",
         ",", "un", "##believ", "##able", "story"]
TOKENS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + WORDS
LINES = [
    "The quick brown fox jumps over the lazy dog.",
    "a dog ||| the dogs jumped over a fox",
    "",
    "unbelievable story , " * 12,  # longer than max_seq_length: truncated
    "Qwerty the fox",  # unknown word
]
MAX_SEQ = 16


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    root = tmp_path_factory.mktemp("features")
    (root / "vocab.txt").write_text("".join(t + "\n" for t in TOKENS))
    config = BertConfig(vocab_size=len(TOKENS), hidden_size=32, num_layers=3, num_heads=4,
                        intermediate_size=37, max_position_embeddings=64)
    ids = np.zeros((1, 4), np.int32)
    params = nn.unbox(jax.jit(BertForPreTraining(config).init)(
        jax.random.key(0), ids, ids, ids, ids[:, :1])["params"])
    r = np.random.default_rng(1)  # noise: exercise non-zero biases and non-unit LayerNorms
    params = jax.tree.map(lambda x: np.asarray(x) + 0.1 * r.normal(size=x.shape), params)
    checkpoint_dir.save_pretrained(root / "ckpt", config, params, root / "vocab.txt")
    (root / "input.txt").write_text("\n".join(LINES) + "\n")
    return root


def read_jsonl(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_values_are_the_hidden_states_of_the_requested_layers(checkpoint, tmp_path):
    out = tmp_path / "out.jsonl"
    assert run(str(checkpoint / "ckpt"), str(checkpoint / "input.txt"), str(out),
               layers="-1,-3,1", max_seq_length=MAX_SEQ, batch_size=2) == len(LINES)
    examples = read_jsonl(out)
    config, params, tokenizer = checkpoint_dir.load_pretrained(checkpoint / "ckpt")
    assert [e["linex_index"] for e in examples] == list(range(len(LINES)))
    # Reference: the un-jitted model on all examples at once, encoded by the tokenizer itself.
    pairs = [parse_line(line) for line in LINES]
    encodings = [tokenizer.encode(a, b, max_seq_length=MAX_SEQ) for a, b in pairs]
    hidden = np.asarray(BertModel(config).apply(
        {"params": params["bert"]}, *(np.array([getattr(e, field) for e in encodings])
                                      for field in ("input_ids", "segment_ids", "input_mask")),
        return_all_layers=True)["hidden_states"])  # [L + 1, batch, seq, hidden]
    for row, (enc, example) in enumerate(zip(encodings, examples)):
        assert sorted(example) == ["features", "linex_index"]
        n = sum(enc.input_mask)
        assert [f["token"] for f in example["features"]] == enc.tokens[:n]
        for position, feature in enumerate(example["features"]):
            assert sorted(feature) == ["layers", "token"]
            assert [layer["index"] for layer in feature["layers"]] == [-1, -3, 1]
            for layer in feature["layers"]:
                # layer i (or i - L) is the output of encoder layer i: hidden_states[i + 1].
                expected = hidden[layer["index"] % config.num_layers + 1, row, position]
                assert len(layer["values"]) == config.hidden_size
                np.testing.assert_allclose(layer["values"], expected, atol=2e-5)
    tokens = [[f["token"] for f in e["features"]] for e in examples]
    assert tokens[1][:5] == ["[CLS]", "a", "dog", "[SEP]", "the"] and tokens[1][-1] == "[SEP]"
    assert len(tokens[3]) == MAX_SEQ
    assert tokens[2] == ["[CLS]", "[SEP]"]
    assert tokens[4][:2] == ["[CLS]", "[UNK]"]


def test_batches_share_one_compiled_function_per_length_bucket(checkpoint):
    config, params, tokenizer = checkpoint_dir.load_pretrained(checkpoint / "ckpt")
    layers = parse_layers("-1,-2", config.num_layers)
    small = FeatureExtractor(config, params, tokenizer, layers, 32, batch_size=2)
    whole = FeatureExtractor(config, params, tokenizer, layers, 32, batch_size=len(LINES))
    lines = LINES * 3  # buckets 16 and 32, batches of two, a bucket's last one padded
    in_batches_of_two = list(small(lines))
    assert small.compute._cache_size() == 2  # one compilation per bucket length
    lengths = [len(e["features"]) for e in in_batches_of_two]
    assert {n <= 16 for n in lengths} == {True, False}
    # Only the bucket lengths are computed, not max_seq_length for every line.
    assert small.tokens["real"] == sum(lengths)
    short = sum(n <= 16 for n in lengths)
    batches = {16: -(-short // 2), 32: -(-(len(lengths) - short) // 2)}  # ceil
    assert small.tokens["computed"] == sum(2 * length * n for length, n in batches.items())
    assert [e["linex_index"] for e in in_batches_of_two] == list(range(len(lines)))
    for a, b in zip(in_batches_of_two, whole(lines), strict=True):
        assert a["linex_index"] == b["linex_index"]
        for fa, fb in zip(a["features"], b["features"], strict=True):
            assert fa["token"] == fb["token"]
            for la, lb in zip(fa["layers"], fb["layers"], strict=True):
                np.testing.assert_allclose(la["values"], lb["values"], atol=1e-5)


def test_cli_writes_the_same_file(checkpoint, tmp_path):
    """The command, its CPU split into 3 devices taking whole batches in turn, writes the file
    of one device in this process."""
    out = tmp_path / "cli.jsonl"
    lines = (LINES * 4)[:-1]  # 19 lines: batches of 4 in buckets 16 and 32, over 3 devices
    (tmp_path / "in.txt").write_text("\n".join(lines) + "\n")
    result = run_python(["-m", "bertjax.extract_features", f"--checkpoint={checkpoint / 'ckpt'}",
                         f"--input_file={tmp_path / 'in.txt'}", f"--output_file={out}",
                         "--layers=-1", "--max_seq_length=32", "--batch_size=4",
                         "--cpu_devices=3"], timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    assert f"wrote {len(lines)} examples to {out} (3 CPU devices, whole batches in turn)" in \
        result.stdout
    expected = tmp_path / "api.jsonl"
    run(str(checkpoint / "ckpt"), str(tmp_path / "in.txt"), str(expected), layers="-1",
        max_seq_length=32, batch_size=4)
    assert out.read_bytes() == expected.read_bytes()


@pytest.mark.parametrize("args,env,expected", [
    (["--cpu_devices=0"], {}, "--cpu_devices=0 must be positive"),
    (["--cpu_devices=2", "--distributed"], {}, "--cpu_devices is for one process"),
    (["--batch_size=3"], {"JAX_NUM_CPU_DEVICES": "2"},  # sharded over a 2-device mesh
     "--batch_size=3 does not divide evenly over the 2 data-parallel devices"),
])
def test_cli_device_flags_are_checked(checkpoint, tmp_path, args, env, expected):
    out = tmp_path / "out.jsonl"
    result = run_python(["-m", "bertjax.extract_features", f"--checkpoint={checkpoint / 'ckpt'}",
                         f"--input_file={checkpoint / 'input.txt'}", f"--output_file={out}",
                         "--layers=-1", "--max_seq_length=16", *args], env=env, timeout=120)
    assert result.returncode == 1
    (line,) = result.stderr.splitlines()
    assert line.startswith(f"error: {expected}"), line
    assert not out.exists()


@pytest.mark.parametrize("kwargs,expected", [
    (dict(layers="3"), "--layers=3: layer 3 does not exist in a 3-layer model (use -3..2)"),
    (dict(layers="-1,x"), "--layers='-1,x' must be comma-separated integers"),
    (dict(layers="-1", max_seq_length=65), "--max_seq_length=65 exceeds the model's "
                              "max_position_embeddings=64"),
])
def test_bad_flags_are_named(checkpoint, tmp_path, kwargs, expected):
    with pytest.raises(ValueError, match="^" + re.escape(expected)):
        run(str(checkpoint / "ckpt"), str(checkpoint / "input.txt"), str(tmp_path / "o.jsonl"),
            **kwargs)


def test_parse_line_follows_the_reference():
    assert parse_line("  just one text \n") == ("just one text", None)
    assert parse_line("a ||| b") == ("a", "b")
    assert parse_line("a ||| b ||| c") == ("a ||| b", "c")  # greedy, as the reference regex
    assert parse_line("a|||b") == ("a|||b", None)
