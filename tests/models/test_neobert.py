"""The third architecture, added through the seam alone (bertjax/models/neobert/ and one entry
in ARCHITECTURES): a NeoBERT-style encoder (RMSNorm, SwiGLU, RoPE, pre-norm, no biases). Its
forward pass against a float64 NumPy reference; packed rows equal their examples alone; a
checkpoint directory round trip; every fine-tuning family's job from its checkpoint (the
pooled heads learn; the others run and score); a packed masked-LM pre-training run that learns
and exports; and its train step compiled for a TPU slice."""

import importlib.util
import json
import random

import flax
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import filler_sentence
from finetune_task import train_losses, write_task
from modern_checkpoint import VOCAB

from bertjax import checkpoint_dir
from bertjax.models import ARCHITECTURES, architecture
from bertjax.models.neobert.config import NeoConfig
from bertjax.models.neobert.modules import NeoBertForMaskedLM, NeoBertModel


def tiny(**overrides):
    return NeoConfig.from_preset("neo_tiny", **{"vocab_size": 64, **overrides})


def reference(params, ids, mask, cfg: NeoConfig) -> np.ndarray:
    """NeoBertModel in float64 NumPy (float32 parameters widened), from the definitions:
    RMSNorm, RoPE (rotate-half), softmax attention over real keys, SwiGLU."""
    p = {"/".join(k): np.asarray(v, np.float64)
         for k, v in flax.traverse_util.flatten_dict(params).items()}
    hid, heads, d = cfg.hidden_size, cfg.num_heads, cfg.head_dim
    inter = cfg.intermediate_size

    def rms(x, scale):
        return x / np.sqrt(np.mean(x * x, -1, keepdims=True) + cfg.norm_eps) * scale

    def rope(x):  # [b, s, heads, d]
        inv = cfg.rope_theta ** (-np.arange(0, d, 2) / d)
        angles = np.arange(x.shape[1])[:, None] * np.concatenate([inv, inv])
        cos, sin = np.cos(angles)[None, :, None], np.sin(angles)[None, :, None]
        rotated = np.concatenate([-x[..., d // 2:], x[..., :d // 2]], -1)
        return x * cos + rotated * sin

    x = p["embeddings/embedding"][ids]
    b, s = ids.shape
    for i in range(cfg.num_layers):
        layer = f"layers_{i}"
        h = rms(x, p[f"{layer}/attn_norm/scale"])
        qkv = h @ p[f"{layer}/attn/qkv/kernel"].reshape(hid, 3 * hid)
        q, k, v = (qkv[..., j * hid:(j + 1) * hid].reshape(b, s, heads, d) for j in range(3))
        q, k = rope(q), rope(k)
        scores = np.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(d)
        scores = np.where(mask[:, None, None, :] > 0, scores, -np.inf)
        weights = np.exp(scores - scores.max(-1, keepdims=True))
        weights /= weights.sum(-1, keepdims=True)
        context = np.einsum("bhqk,bkhd->bqhd", weights, v).reshape(b, s, hid)
        x = x + context @ p[f"{layer}/attn/out/kernel"].reshape(hid, hid)
        h = rms(x, p[f"{layer}/mlp_norm/scale"]) @ p[f"{layer}/mlp/w12/kernel"].reshape(
            hid, 2 * inter)
        gate = h[..., :inter]
        x = x + (gate / (1 + np.exp(-gate)) * h[..., inter:]) @ p[f"{layer}/mlp/w3/kernel"]
    return rms(x, p["final_norm/scale"])


@pytest.mark.parametrize("impl", ["einsum", "xla"])
def test_forward_matches_a_float64_reference(impl):
    cfg = tiny(attention_impl=impl)
    rng = np.random.default_rng(0)
    ids = rng.integers(0, 64, (2, 12)).astype(np.int32)
    mask = np.ones((2, 12), np.int32)
    mask[1, 7:] = 0
    params = nn.unbox(NeoBertModel(cfg).init(jax.random.key(0), ids, mask)["params"])
    # Non-trivial norm scales, so a missing or misplaced scale shows.
    params = jax.tree_util.tree_map_with_path(
        lambda path, x: x * (1.0 + 0.5 * jnp.arange(x.shape[-1]) / x.shape[-1])
        if "scale" in str(path[-1]) else x, params)
    ours = np.asarray(NeoBertModel(cfg).apply({"params": params}, ids, mask))
    states = np.asarray(NeoBertModel(cfg).apply({"params": params}, ids, mask,
                                                return_all_layers=True))
    want = reference(params, ids, mask, cfg)  # float64
    real = mask.astype(bool)
    np.testing.assert_allclose(ours[real], want[real], rtol=1e-4, atol=1e-5)
    assert states.shape == (cfg.num_layers + 1, 2, 12, cfg.hidden_size)
    np.testing.assert_array_equal(states[-1], ours)
    # Every parameter has logical axis names; the encoder has no bias.
    boxed = NeoBertForMaskedLM(tiny()).init(jax.random.key(0), ids, mask)["params"]
    leaves = jax.tree.leaves(boxed, is_leaf=lambda x: isinstance(x, nn.LogicallyPartitioned))
    assert all(isinstance(x, nn.LogicallyPartitioned) for x in leaves)
    names = ["/".join(k) for k in flax.traverse_util.flatten_dict(nn.unbox(boxed))]
    assert not [n for n in names if n.endswith("bias") and n != "decoder_bias"], names


def test_a_packed_row_gives_each_example_what_it_gets_alone():
    cfg = tiny()
    rng = np.random.default_rng(1)
    first, second = rng.integers(5, 64, 5), rng.integers(5, 64, 4)
    packed = np.zeros((1, 12), np.int32)
    packed[0, :5], packed[0, 5:9] = first, second
    packing = np.array([[1] * 5 + [2] * 4 + [0] * 3], np.int32)
    mask = (packing > 0).astype(np.int32)
    model = NeoBertModel(cfg)
    params = model.init(jax.random.key(2), packed, mask)["params"]
    together = np.asarray(model.apply({"params": params}, packed, mask, packing_ids=packing))
    for tokens, start in ((first, 0), (second, 5)):
        alone = np.asarray(model.apply({"params": params}, tokens[None].astype(np.int32)))
        np.testing.assert_allclose(together[0, start:start + len(tokens)], alone[0],
                                   rtol=2e-5, atol=2e-5)


def write_checkpoint(root) -> str:
    (root / "vocab.txt").write_text("\n".join(VOCAB) + "\n")
    cfg = tiny(vocab_size=len(VOCAB), max_position_embeddings=512)
    ids = np.zeros((1, 4), np.int32)
    encoder = NeoBertModel(cfg).init(jax.random.key(0), ids, ids)["params"]
    summary = checkpoint_dir.save_pretrained(root / "ckpt", cfg, encoder, root / "vocab.txt")
    assert summary["initialised"] == ["decoder_bias"]  # an encoder alone: the bias is added
    loaded, params, tokenizer = checkpoint_dir.load_pretrained(root / "ckpt")
    assert architecture(loaded) is ARCHITECTURES["neobert"] and loaded == cfg
    assert tokenizer.vocab_size == len(VOCAB)
    flat = flax.traverse_util.flatten_dict(params["model"])
    for key, value in flax.traverse_util.flatten_dict(nn.unbox(encoder)).items():
        np.testing.assert_array_equal(flat[key], np.asarray(value))
    return str(root / "ckpt")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return write_checkpoint(tmp_path_factory.mktemp("neo"))


def files_config(kind, checkpoint, **data):
    from experiments.finetune_files import get_config

    config = get_config(kind)
    config.init_checkpoint = checkpoint
    config.max_seq_length = config.min_bucket_length = 32
    config.train.batch_size, config.eval.batch_size = 16, 32
    config.optimizer.learning_rate = 1e-3
    config.log_every_steps = 1
    config.data.update(data)
    return config


def assert_learns(workdir, steps=4):
    losses = train_losses(str(workdir))
    ordered = [losses[s] for s in sorted(losses)]
    assert np.mean(ordered[-steps:]) < np.mean(ordered[:steps]), ordered


def test_classification_learns_predicts_and_dry_runs(checkpoint, tmp_path):
    from bertjax import Predictor
    from bertjax.models.neobert.architecture import forward_flops
    from bertjax.tasks import dry_run_job, train_and_evaluate

    write_task(tmp_path)
    config = files_config("classification", checkpoint, train=str(tmp_path / "train.jsonl"),
                          validation=str(tmp_path / "dev.jsonl"))
    config.train.num_epochs, config.eval.every_steps = 3, 6
    config.task.classifier_pooling = "mean"
    job = dry_run_job(config, log=lambda *_: None)
    assert job.stages[0].flops_per_example == 3.0 * forward_flops(job.model_config, 32, 0)
    summary = train_and_evaluate(config, str(tmp_path / "run"), log=lambda *_: None)
    assert_learns(tmp_path / "run")
    assert summary["best"]["accuracy"] >= 0.75, summary["best"]  # half are "good"
    record = json.loads((tmp_path / "run" / "export.json").read_text())
    assert record["architecture"] is None and "no transformers class" in record["why"]
    assert record["model"]["model_type"] == "neobert"
    metrics = Predictor.from_workdir(str(tmp_path / "run")).predict_file(
        str(tmp_path / "dev.jsonl"))[2]
    best = {k: v for k, v in summary["best"].items() if k != "epoch"}
    assert metrics == pytest.approx(best, abs=1e-9)


@pytest.mark.slow
@pytest.mark.extended
def test_every_other_family_runs_from_the_checkpoint(checkpoint, tmp_path):
    """Regression, multiple choice, token tagging, SQuAD and embeddings, a few steps each:
    the job trains, the pooled heads learn, and every run scores its dev set."""
    import embedding_data
    import squad_data
    import tagging_data as td

    from bertjax.tasks import train_and_evaluate
    from experiments import embedding, ner, squad

    rng = random.Random(1)
    with open(tmp_path / "reg.jsonl", "w") as f:
        for _ in range(160):
            count = rng.randint(0, 3)
            f.write(json.dumps({"text": filler_sentence(rng, "good", count),
                                "score": float(count)}) + "\n")
    with open(tmp_path / "mc.jsonl", "w") as f:
        for _ in range(96):
            answer = rng.randrange(3)
            f.write(json.dumps({"context": filler_sentence(rng), "answer": answer, **{
                c: filler_sentence(rng, "good" if i == answer else "bad")
                for i, c in enumerate("abc")}}) + "\n")
    reg = files_config("regression", checkpoint, train=str(tmp_path / "reg.jsonl"),
                       validation=str(tmp_path / "reg.jsonl"), label="score")
    mc = files_config("multiple_choice", checkpoint, train=str(tmp_path / "mc.jsonl"),
                      validation=str(tmp_path / "mc.jsonl"), text_a="context",
                      choices="a,b,c", label="answer")
    tagging = ner.get_config("files")
    for name, seed, n in (("train", 1, 96), ("dev", 2, 32)):
        td.write_conll(tmp_path / f"{name}.conll", td.dataset(seed, n), docs_every=4)
    tagging.data.train = tagging.data.validation = str(tmp_path / "train.conll")
    tagging.data.test = str(tmp_path / "dev.conll")
    tagging.data.scheme, tagging.data.token_column = "iob2", 0
    qa = squad.get_config("v1")
    qa.data.train = squad_data.generate(tmp_path / "train.json", 96, seed=1)
    qa.data.validation = squad_data.generate(tmp_path / "dev.json", 24, seed=2)
    qa.task.doc_stride, qa.task.max_query_length = 16, 10
    pairs = embedding.get_config("pairs")
    pairs.data.train = embedding_data.write_pairs(tmp_path / "p.jsonl", 128, negatives=1)
    pairs.data.columns = "query,passage,negative1"
    pairs.data.beir = embedding_data.write_beir(tmp_path / "beir")
    primary = {"reg": "pearson", "mc": "accuracy", "tagging": "f1", "qa": "f1",
               "pairs": "ndcg@10"}
    for name, config in (("reg", reg), ("mc", mc), ("tagging", tagging), ("qa", qa),
                         ("pairs", pairs)):
        config.init_checkpoint = checkpoint
        config.max_seq_length = config.min_bucket_length = 64 if name == "qa" else 32
        config.train.batch_size, config.eval.batch_size = 16, 32
        config.train.num_epochs, config.log_every_steps = 2, 1
        config.optimizer.learning_rate = 1e-3
        summary = train_and_evaluate(config, str(tmp_path / name), log=lambda *_: None)
        assert summary["primary_metric"] == primary[name]
        assert np.isfinite(summary["best"][primary[name]]), (name, summary["best"])
        losses = train_losses(str(tmp_path / name))
        assert all(np.isfinite(v) for v in losses.values()), name
        if name in ("reg", "mc"):
            assert_learns(tmp_path / name, steps=3)


def neo_pretraining_config(data: str, vocab: str):
    """experiments/pretrain.py's packed masked-LM recipe (modern_tiny's phases) with the
    NeoBERT-style model: one short phase per sequence length."""
    from experiments import pretrain

    config = pretrain.get_config("modern_tiny")
    # The presets' vocabulary size: pre-training sets config.vocab's.
    config.model = NeoConfig.from_preset("neo_tiny", max_position_embeddings=512).to_dict()
    config.vocab = vocab
    with config.unlocked():
        for name in list(config.phases):
            if name not in ("phase1a", "phase2"):
                del config.phases[name]
    for name, seq, steps in (("phase1a", 32, 16), ("phase2", 64, 8)):
        phase = config.phases[name]
        phase.update(data=data, eval_data=data, seq_len=seq, max_predictions=seq * 3 // 10 + 2,
                     steps=steps, batch_size=8, global_rope_theta=0.0)
    config.train.num_train_steps = 24
    config.optimizer.update(warmup_steps=4, learning_rate=3e-3, decay_steps=8)
    config.log_every_steps, config.checkpoint.every_steps = 1, 8
    config.eval.update(every_steps=24, num_batches=2)
    return config


@pytest.mark.slow
@pytest.mark.extended
def test_packed_masked_lm_pretraining_learns_and_exports(tmp_path):
    from news_corpus import write_segments

    from bertjax.tasks import pretraining

    data, vocab_size, _ = write_segments(tmp_path)
    config = neo_pretraining_config(f"{data}/part-*", str(tmp_path / "vocab.txt"))
    pretraining.train(config, str(tmp_path / "run"), log=lambda *_: None)
    records = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text()
               .splitlines()]
    losses = [r["loss"] for r in records if r["split"] == "train"]
    assert len(losses) == 24 and np.mean(losses[-6:]) < np.mean(losses[:4]) - 0.5, losses
    loaded, params, tokenizer = checkpoint_dir.load_pretrained(tmp_path / "run" / "export")
    assert architecture(loaded) is ARCHITECTURES["neobert"]
    assert loaded.vocab_size == vocab_size == tokenizer.vocab_size
    assert set(params) == {"model", "decoder_bias"}


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("libtpu") is None, reason="libtpu not installed")
@pytest.mark.extended
def test_its_train_step_compiles_for_a_tpu_slice():
    from bertjax.aot import measure as aot_measure
    from bertjax.aot import topology
    from bertjax.tasks.pretraining import PretrainingJob

    config = neo_pretraining_config("synthetic", "")
    config.vocab = None
    config.train.batch_size = 16
    aot_measure.use_tpu_dtype(config)
    slice_ = topology.parse("v5p-8")
    costs, _ = aot_measure.compile_stages(lambda c: PretrainingJob(c, make_input=None), config,
                                          slice_, topology.devices(slice_), exact=True)
    assert len(costs) == 2 and all(c.fits and c.time > 0 and c.xla_flops > 0 for c in costs)
