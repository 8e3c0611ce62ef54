"""from_tf: a TF1 checkpoint written here with the reference names and shapes converts, and the
bertjax forward on it equals an independent float64 NumPy forward that reads the TF names."""

import json

import jax
import numpy as np
import pytest
from convert_cli import convert_main

from bertjax import checkpoint_dir
from bertjax.models import BertForPreTraining, BertModel

L, H, A, FFN, V, P, T = 2, 32, 4, 37, 100, 64, 2


def reference_variables(seed=0, num_layers=L, hidden=H, inter=FFN, vocab=V):
    """name → random float32 array, with the names and shapes google-research/bert creates."""
    rng = np.random.default_rng(seed)
    shapes = {
        "bert/embeddings/word_embeddings": (vocab, hidden),
        "bert/embeddings/token_type_embeddings": (T, hidden),
        "bert/embeddings/position_embeddings": (P, hidden),
        "bert/embeddings/LayerNorm/gamma": (hidden,),
        "bert/embeddings/LayerNorm/beta": (hidden,),
    }
    for i in range(num_layers):
        p = f"bert/encoder/layer_{i}/"
        for n in ("query", "key", "value"):
            shapes[p + f"attention/self/{n}/kernel"] = (hidden, hidden)
            shapes[p + f"attention/self/{n}/bias"] = (hidden,)
        shapes[p + "attention/output/dense/kernel"] = (hidden, hidden)
        shapes[p + "attention/output/dense/bias"] = (hidden,)
        shapes[p + "attention/output/LayerNorm/gamma"] = (hidden,)
        shapes[p + "attention/output/LayerNorm/beta"] = (hidden,)
        shapes[p + "intermediate/dense/kernel"] = (hidden, inter)
        shapes[p + "intermediate/dense/bias"] = (inter,)
        shapes[p + "output/dense/kernel"] = (inter, hidden)
        shapes[p + "output/dense/bias"] = (hidden,)
        shapes[p + "output/LayerNorm/gamma"] = (hidden,)
        shapes[p + "output/LayerNorm/beta"] = (hidden,)
    shapes.update({
        "bert/pooler/dense/kernel": (hidden, hidden),
        "bert/pooler/dense/bias": (hidden,),
        "cls/predictions/transform/dense/kernel": (hidden, hidden),
        "cls/predictions/transform/dense/bias": (hidden,),
        "cls/predictions/transform/LayerNorm/gamma": (hidden,),
        "cls/predictions/transform/LayerNorm/beta": (hidden,),
        "cls/predictions/output_bias": (vocab,),
        "cls/seq_relationship/output_weights": (2, hidden),  # [out, in] in the reference
        "cls/seq_relationship/output_bias": (2,),
    })
    out = {}
    for name, shape in shapes.items():
        scale = 0.3 if name.endswith(("kernel", "output_weights")) else 0.1
        value = rng.normal(0.0, scale, shape)
        if name.endswith("gamma"):
            value += 1.0
        out[name] = value.astype(np.float32)
    return out


def write_tf1_checkpoint(directory, variables, vocab=V, config_overrides=None):
    """bert_model.ckpt (tf.compat.v1 Saver), bert_config.json and vocab.txt in `directory`."""
    import tensorflow as tf

    tf.config.set_visible_devices([], "GPU")
    graph = tf.Graph()
    with graph.as_default():
        for name, value in variables.items():
            tf.compat.v1.get_variable(name, initializer=tf.constant(value))
        saver = tf.compat.v1.train.Saver()
        with tf.compat.v1.Session(graph=graph) as session:
            session.run(tf.compat.v1.global_variables_initializer())
            saver.save(session, str(directory / "bert_model.ckpt"))
    config = {"vocab_size": V, "hidden_size": H, "num_hidden_layers": L,
              "num_attention_heads": A, "intermediate_size": FFN, "hidden_act": "gelu",
              "hidden_dropout_prob": 0.1, "attention_probs_dropout_prob": 0.1,
              "max_position_embeddings": P, "type_vocab_size": T, "initializer_range": 0.02,
              **(config_overrides or {})}
    (directory / "bert_config.json").write_text(json.dumps(config))
    tokens = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + [f"w{i}" for i in range(vocab - 5)]
    (directory / "vocab.txt").write_text("\n".join(tokens) + "\n")
    return directory


def from_tf_args(src, out, *extra):
    return ["from_tf", "--checkpoint", str(src / "bert_model.ckpt"),
            "--config", str(src / "bert_config.json"), "--vocab", str(src / "vocab.txt"),
            "--output", str(out), *extra]


# ---------------------------------------------------------------------------------------------
# Independent float64 forward pass over the TF variable names (google-research/bert semantics:
# tanh-approximated GELU, post-LN, additive -10000 attention mask).


def tf_reference_forward(v, ids, segments, mask, positions):
    v = {k: x.astype(np.float64) for k, x in v.items()}

    def ln(x, prefix):
        mean = x.mean(-1, keepdims=True)
        var = ((x - mean) ** 2).mean(-1, keepdims=True)
        return (x - mean) / np.sqrt(var + 1e-12) * v[prefix + "/gamma"] + v[prefix + "/beta"]

    def gelu(x):
        return 0.5 * x * (1.0 + np.tanh(np.sqrt(2 / np.pi) * (x + 0.044715 * x**3)))

    def dense(x, prefix):
        return x @ v[prefix + "/kernel"] + v[prefix + "/bias"]

    batch, seq = ids.shape
    x = (v["bert/embeddings/word_embeddings"][ids]
         + v["bert/embeddings/token_type_embeddings"][segments]
         + v["bert/embeddings/position_embeddings"][:seq][None])
    x = ln(x, "bert/embeddings/LayerNorm")
    adder = (1.0 - mask[:, None, None, :]) * -10000.0
    d = H // A
    for i in range(L):
        p = f"bert/encoder/layer_{i}"

        def heads(t):
            return t.reshape(batch, seq, A, d).transpose(0, 2, 1, 3)

        q, k, val = (heads(dense(x, f"{p}/attention/self/{n}")) for n in ("query", "key", "value"))
        scores = q @ k.transpose(0, 1, 3, 2) / np.sqrt(d) + adder
        probs = np.exp(scores - scores.max(-1, keepdims=True))
        probs /= probs.sum(-1, keepdims=True)
        context = (probs @ val).transpose(0, 2, 1, 3).reshape(batch, seq, H)
        x = ln(dense(context, f"{p}/attention/output/dense") + x, f"{p}/attention/output/LayerNorm")
        h = gelu(dense(x, f"{p}/intermediate/dense"))
        x = ln(dense(h, f"{p}/output/dense") + x, f"{p}/output/LayerNorm")
    pooled = np.tanh(dense(x[:, 0], "bert/pooler/dense"))
    gathered = x[np.arange(batch)[:, None], positions]
    t = ln(gelu(dense(gathered, "cls/predictions/transform/dense")),
           "cls/predictions/transform/LayerNorm")
    mlm = t @ v["bert/embeddings/word_embeddings"].T + v["cls/predictions/output_bias"]
    nsp = (pooled @ v["cls/seq_relationship/output_weights"].T
           + v["cls/seq_relationship/output_bias"])
    return x, pooled, mlm, nsp


# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    src = tmp_path_factory.mktemp("tf")
    variables = reference_variables()
    # A pre-training checkpoint also carries optimizer slots and the step counter.
    extra = {"bert/pooler/dense/kernel/adam_m": np.zeros((H, H), np.float32),
             "bert/pooler/dense/kernel/adam_v": np.zeros((H, H), np.float32),
             "global_step": np.array(7, np.int64)}
    write_tf1_checkpoint(src, {**variables, **extra})
    out = tmp_path_factory.mktemp("bertjax") / "ckpt"
    convert_main(from_tf_args(src, out))
    return variables, out


@pytest.mark.slow
def test_from_tf_forward_matches_float64_reference(converted):
    variables, out = converted
    config = checkpoint_dir.load_config(out)
    assert config.hidden_act == "gelu_tanh"  # the reference's "gelu" is the tanh form
    params = checkpoint_dir.load_params(out, config)
    r = np.random.default_rng(1)
    ids = r.integers(0, V, (3, 11)).astype(np.int32)
    segments = (np.arange(11)[None] >= np.array([[4], [6], [11]])).astype(np.int32)
    mask = (np.arange(11)[None] < np.array([[11], [8], [5]])).astype(np.int32)
    positions = np.array([[1, 3, 9], [0, 2, 7], [1, 2, 4]], np.int32)
    out_pt = BertForPreTraining(config).apply({"params": params}, ids, segments, mask, positions)
    out_enc = BertModel(config).apply({"params": params["bert"]}, ids, segments, mask)
    ref_seq, ref_pooled, ref_mlm, ref_nsp = tf_reference_forward(
        variables, ids, segments, mask.astype(np.float64), positions)
    real = mask.astype(bool)
    tol = dict(atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(np.asarray(out_enc["sequence_output"])[real], ref_seq[real], **tol)
    np.testing.assert_allclose(out_enc["pooled_output"], ref_pooled, **tol)
    np.testing.assert_allclose(out_pt["mlm_logits"], ref_mlm, **tol)
    np.testing.assert_allclose(out_pt["nsp_logits"], ref_nsp, **tol)


def test_from_tf_lists_skipped_optimizer_state_and_copies_vocab(converted):
    variables, out = converted
    report = json.loads((out / "conversion.json").read_text())
    assert report["initialised"] == []
    assert report["skipped"] == {"bert/pooler/dense/kernel/adam_m": "optimizer state",
                                 "bert/pooler/dense/kernel/adam_v": "optimizer state",
                                 "global_step": "optimizer state"}
    assert (out / "vocab.txt").read_text().split("\n")[:3] == ["[PAD]", "[UNK]", "[CLS]"]
    # "w0".."w94" contain no upper case, so the vocabulary is taken as uncased.
    assert json.loads((out / "tokenizer_config.json").read_text()) == {
        "type": "wordpiece", "do_lower_case": True}
    # Every TF tensor arrived bitwise (the reshapes/transposes are exact).
    params = checkpoint_dir.load_params(out, checkpoint_dir.load_config(out))
    np.testing.assert_array_equal(params["nsp"]["kernel"].T,
                                  variables["cls/seq_relationship/output_weights"])
    np.testing.assert_array_equal(
        params["bert"]["encoder"]["layer_1"]["attention"]["output"]["kernel"].reshape(H, H),
        variables["bert/encoder/layer_1/attention/output/dense/kernel"])


def test_missing_heads_are_initialised_and_listed(tmp_path, capsys):
    variables = {k: v for k, v in reference_variables(seed=3).items()
                 if not k.startswith("cls/seq_relationship")}
    src = tmp_path / "src"
    src.mkdir()
    write_tf1_checkpoint(src, variables)
    out = tmp_path / "out"
    convert_main(from_tf_args(src, out))
    printed = capsys.readouterr().out
    assert "initialised (not in the source): the next-sentence head" in printed
    report = json.loads((out / "conversion.json").read_text())
    assert report["initialised"] == ["nsp"]
    params = checkpoint_dir.load_params(out, checkpoint_dir.load_config(out))
    assert params["nsp"]["kernel"].shape == (H, 2) and np.std(params["nsp"]["kernel"]) > 0
    np.testing.assert_array_equal(params["mlm"]["output_bias"],
                                  variables["cls/predictions/output_bias"])


@pytest.mark.parametrize("case,expected", [
    ("missing", "missing tensor bert/encoder/layer_1/output/dense/bias"),
    ("partial_head", "missing tensor cls/seq_relationship/output_bias"),
    ("config_vocab", "tensor bert/embeddings/word_embeddings has shape (100, 32)"),
    ("config_hidden", "tensor bert/embeddings/word_embeddings has shape (100, 32)"),
    ("vocab_file", "vocab.txt has 99 entries but bert/embeddings/word_embeddings has 100 rows"),
    ("shape", "tensor bert/encoder/layer_0/intermediate/dense/kernel has shape (32, 40)"),
])
def test_bad_tf_checkpoint_fails_with_one_line_naming_the_tensor(tmp_path, case, expected):
    variables = reference_variables(seed=4)
    vocab, overrides = V, {}
    if case == "missing":
        del variables["bert/encoder/layer_1/output/dense/bias"]
    elif case == "partial_head":
        del variables["cls/seq_relationship/output_bias"]
    elif case == "config_vocab":
        overrides = {"vocab_size": V + 8}  # vocab.txt agrees with the weights, not the config
    elif case == "config_hidden":
        overrides = {"hidden_size": 48, "num_attention_heads": 4}
    elif case == "vocab_file":
        vocab = V - 1
    elif case == "shape":
        variables["bert/encoder/layer_0/intermediate/dense/kernel"] = np.zeros((H, 40), np.float32)
    src = tmp_path / "src"
    src.mkdir()
    write_tf1_checkpoint(src, variables, vocab=vocab, config_overrides=overrides)
    with pytest.raises(SystemExit) as exc:
        convert_main(from_tf_args(src, tmp_path / "out"))
    message = str(exc.value)
    assert message.startswith("error: ") and "\n" not in message
    assert expected in message
    assert not (tmp_path / "out" / "params").exists()


@pytest.mark.slow
def test_stored_params_round_trip_through_scan_layout(converted):
    from bertjax.models.layout import stack_layers, unstack_layers

    _, out = converted
    config = checkpoint_dir.load_config(out)
    params = checkpoint_dir.load_params(out, config)
    scanned_config = config.__class__(**{**config.to_dict(), "scan_layers": True})
    scanned = checkpoint_dir.load_params(out, scanned_config)
    assert scanned["bert"]["encoder"]["layers"]["layer"]["attention"]["query"]["kernel"].shape \
        == (L, H, A, H // A)
    ids = np.arange(20, dtype=np.int32).reshape(2, 10) % V
    unrolled_out = BertModel(config).apply({"params": params["bert"]}, ids)
    scanned_out = BertModel(scanned_config).apply({"params": scanned["bert"]}, ids)
    np.testing.assert_allclose(scanned_out["sequence_output"], unrolled_out["sequence_output"],
                               atol=1e-5)
    jax.tree.map(np.testing.assert_array_equal, unstack_layers(stack_layers(params)), params)
