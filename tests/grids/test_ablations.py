"""The paper's ablations (Sec. 5, App. C): the left-to-right objective, the masking mixes of
Table 8, the "+ BiLSTM" head, and the `bertjax.ablations` runner."""

import json

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest
from ablation_data import write_test_data

from bertjax.checkpoint_dir import load_pretrained
from bertjax.errors import ConfigError
from bertjax.models import BertConfig, BertForPreTraining
from bertjax.tasks import pretraining
from bertjax.tasks.pretraining import rules
from bertjax.train import configs
from data_pipeline import masking

TINY = dict(vocab_size=97, hidden_size=32, num_layers=2, num_heads=2, intermediate_size=64,
            max_position_embeddings=64, hidden_dropout_prob=0.0, attention_dropout_prob=0.0)


def packed_batch(rng, batch=2, seq=16, vocab=97):
    """Unmasked packed rows: two examples per row, then padding."""
    ids = rng.integers(5, vocab, (batch, seq)).astype(np.int32)
    packing = np.zeros((batch, seq), np.int32)
    packing[:, :7], packing[:, 7:13] = 1, 2
    mask = (packing > 0).astype(np.int32)
    ids = ids * mask
    return {"input_ids": ids, "input_mask": mask, "segment_ids": np.zeros_like(ids),
            "packing_ids": packing}


def ltr_job_config(**model):
    config = ml_collections.ConfigDict(dict(
        objective="ltr", model=dict(TINY, **model),
        train=dict(nsp_weight=1.0), masking=dict(mask=0.8, same=0.1, random=0.1)))
    return config


# ------------------------------------------------------------------------------------ LTR


def test_ltr_pretraining_outputs_at_earlier_positions_ignore_later_tokens():
    config = ltr_job_config()
    assert rules.packing_enabled(config) and rules.objective(config) == "ltr"
    model = BertForPreTraining(BertConfig(**TINY, causal=True))
    params = pretraining.init_params(model, jax.random.PRNGKey(0))
    batch = packed_batch(np.random.default_rng(0))
    batch = dict(batch, **pretraining.next_token_targets(jax.tree.map(jnp.asarray, batch)))

    @jax.jit
    def logits(b):
        return pretraining.model_outputs(model, params, b, packed=True)["mlm_logits"]

    base = np.asarray(logits(batch))
    for j in (1, 5, 9, 12):
        changed = dict(batch, input_ids=batch["input_ids"].copy())
        changed["input_ids"][:, j] = (changed["input_ids"][:, j] + 7) % 97
        out = np.asarray(logits(changed))
        # Position p's logits predict token p + 1 from tokens 0..p.
        np.testing.assert_array_equal(out[:, :j], base[:, :j])
        assert np.abs(out[:, j:] - base[:, j:]).max() > 1e-4  # the change is seen from j on


@pytest.mark.slow
@pytest.mark.extended
def test_ltr_loss_equals_numpy_next_token_cross_entropy():
    config = ltr_job_config(dtype="float64", param_dtype="float64")
    jax.config.update("jax_enable_x64", True)
    try:
        model = BertForPreTraining(configs.resolve_model_config(
            dict(config.model, causal=True)))
        params = pretraining.init_params(model, jax.random.PRNGKey(1))
        batch = jax.tree.map(jnp.asarray, packed_batch(np.random.default_rng(1)))
        loss, metrics = pretraining.loss_fn(params, batch, None, model=model, nsp_weight=1.0,
                                            packed=True, ltr=True)
        # Reference: logits at every position, then NumPy float64 next-token NLL within each
        # packed example.
        seq = batch["input_ids"].shape[1]
        every = jnp.broadcast_to(jnp.arange(seq), batch["input_ids"].shape)
        logits = np.asarray(model.apply({"params": params}, batch["input_ids"],
                                        batch["segment_ids"], batch["input_mask"], every,
                                        packing_ids=batch["packing_ids"])["mlm_logits"],
                            np.float64)
    finally:
        jax.config.update("jax_enable_x64", False)
    ids, packing = np.asarray(batch["input_ids"]), np.asarray(batch["packing_ids"])
    nll = []
    for b in range(ids.shape[0]):
        for p in range(seq - 1):
            if packing[b, p] > 0 and packing[b, p + 1] == packing[b, p]:
                row = logits[b, p] - logits[b, p].max()
                log_probs = row - np.log(np.exp(row).sum())
                nll.append(-log_probs[ids[b, p + 1]])
    assert len(nll) == 2 * (6 + 5)  # examples of 7 and 6 tokens: 6 + 5 targets a row
    expected = np.sum(nll) / (len(nll) + 1e-5)  # the reference's denominator
    # The loss is summed in float32 (pretraining_loss), the logits are float64.
    np.testing.assert_allclose(float(loss), expected, rtol=1e-6)
    np.testing.assert_allclose(float(metrics["mlm_loss"]), expected, rtol=1e-6)


def test_ltr_checkpoint_fine_tunes_with_causal_attention(tmp_path):
    from bertjax.checkpoint_dir import save_pretrained
    from bertjax.models.squad import BertForQuestionAnswering
    from bertjax.tasks.base import load_pretrained_model

    vocab = tmp_path / "vocab.txt"
    vocab.write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
                               + [f"w{i}" for i in range(92)]) + "\n")
    model_cfg = BertConfig(**TINY, causal=True)
    params = pretraining.init_params(BertForPreTraining(model_cfg), jax.random.PRNGKey(2))
    save_pretrained(tmp_path / "export", model_cfg, params, str(vocab))
    # A fine-tuning config as experiments/squad.py writes it (config.model overrides).
    config = ml_collections.ConfigDict(dict(
        init_checkpoint=str(tmp_path / "export"),
        model=dict(dtype="auto", hidden_dropout_prob=0.1, attention_dropout_prob=0.1)))
    loaded_cfg, loaded, _ = load_pretrained_model(config)
    assert loaded_cfg.causal
    qa = BertForQuestionAnswering(loaded_cfg)
    qa_params = qa.init(jax.random.PRNGKey(3), *(jnp.zeros((1, 8), jnp.int32),) * 3)["params"]
    qa_params = dict(qa_params, bert=loaded["bert"])
    batch = packed_batch(np.random.default_rng(3))
    args = (batch["segment_ids"], batch["input_mask"])
    start, end = qa.apply({"params": qa_params}, batch["input_ids"], *args)
    for j in (2, 8):
        ids = batch["input_ids"].copy()
        ids[:, j] = (ids[:, j] + 11) % 97
        start2, end2 = qa.apply({"params": qa_params}, ids, *args)
        np.testing.assert_array_equal(np.asarray(start2)[:, :j], np.asarray(start)[:, :j])
        np.testing.assert_array_equal(np.asarray(end2)[:, :j], np.asarray(end)[:, :j])
        assert np.abs(np.asarray(start2)[:, j] - np.asarray(start)[:, j]).max() > 1e-6


def test_ltr_classifier_pools_the_last_real_token():
    """A causal model's [CLS] sees only itself, so a classifier on it could not read the
    sentence; the pooled vector comes from the last real token instead, which sees it all."""
    from bertjax.models import BertModel
    from bertjax.models.classification import BertForSequenceClassification

    cfg = BertConfig(**TINY, causal=True)
    rng = np.random.default_rng(4)
    ids = rng.integers(5, 97, (3, 12)).astype(np.int32)
    mask = np.ones_like(ids)
    mask[0, 7:] = 0  # one padded row: its last real token is at 6
    segments = np.zeros_like(ids)
    bert = BertModel(cfg)
    params = bert.init(jax.random.PRNGKey(5), ids, segments, mask)["params"]
    out = bert.apply({"params": params}, ids, segments, mask)
    last = np.array([6, 11, 11])
    tokens = np.asarray(out["sequence_output"])[np.arange(3), last]
    dense = params["pooler"]["dense"]
    kernel, bias = (np.asarray(nn.unbox(dense[k])) for k in ("kernel", "bias"))
    np.testing.assert_allclose(np.asarray(out["pooled_output"]), np.tanh(tokens @ kernel + bias),
                               rtol=1e-5, atol=1e-6)
    # The classifier now depends on a word in the middle of the sentence.
    model = BertForSequenceClassification(cfg, num_labels=2)
    cls_params = model.init(jax.random.PRNGKey(6), ids, segments, mask)["params"]
    logits = np.asarray(model.apply({"params": cls_params}, ids, segments, mask))
    changed = ids.copy()
    changed[:, 3] = (changed[:, 3] + 11) % 97
    logits2 = np.asarray(model.apply({"params": cls_params}, changed, segments, mask))
    assert np.abs(logits2 - logits).min() > 1e-6


# ------------------------------------------------------------------------- masking mixes

TABLE8_MIXES = [(0.8, 0.1, 0.1), (1.0, 0.0, 0.0), (0.8, 0.0, 0.2), (0.8, 0.2, 0.0),
                (0.0, 0.2, 0.8), (0.0, 0.0, 1.0)]
VOCAB = 5000  # random replacements hit the original token 1 in ~5000 times


def mix_config(mix):
    return masking.MaskingConfig(max_predictions=128, vocab_size=VOCAB, mask_id=4,
                                 special_ids=(0, 1, 2, 3, 4), masked_lm_prob=0.5, mix=mix)


def observed_shares(original, masked, positions, weights, mask_id):
    """(MASK, SAME, RANDOM) shares of the predicted positions, and how many there were."""
    rows = np.nonzero(weights > 0)
    pos = positions[rows]
    before, after = original[rows[0], pos], masked[rows[0], pos]
    n = len(pos)
    return (np.sum(after == mask_id) / n, np.sum(after == before) / n,
            np.sum((after != mask_id) & (after != before)) / n), n


@pytest.mark.parametrize("mix", TABLE8_MIXES, ids=lambda m: "/".join(f"{x:.0%}" for x in m))
def test_masking_mix_shares_static_and_dynamic(mix):
    import tensorflow as tf

    cfg = mix_config(mix)
    rng = np.random.default_rng(0)
    ids = rng.integers(5, VOCAB, (1000, 256)).astype(np.int32)
    lengths = np.full(1000, 256)
    out, positions, _, counts = masking.mask_batch(ids, lengths, cfg, rng)
    weights = (np.arange(128) < counts[:, None]).astype(np.float32)
    static, n = observed_shares(ids, out, positions, weights, cfg.mask_id)
    assert n >= 100_000
    np.testing.assert_allclose(static, mix, atol=0.01)

    batch = masking.mask_batch_tf(tf.constant(ids), tf.ones_like(tf.constant(ids)), cfg,
                                  tf.constant([7, 0], tf.int64))
    dynamic, n = observed_shares(ids, batch["input_ids"].numpy(),
                                 batch["masked_lm_positions"].numpy(),
                                 batch["masked_lm_weights"].numpy(), cfg.mask_id)
    assert n >= 100_000
    np.testing.assert_allclose(dynamic, mix, atol=0.01)


def test_masking_mix_is_validated():
    config = ml_collections.ConfigDict(dict(masking=dict(mask=0.8, same=0.1, random=0.2)))
    with pytest.raises(ConfigError, match=r"config.masking.mask \+ config.masking.same \+ "
                       r"config.masking.random = 0.8 \+ 0.1 \+ 0.2 = 1.1, not 1"):
        pretraining.masking_mix(config)
    config.masking.update(mask=1.2, same=-0.1, random=-0.1)
    with pytest.raises(ConfigError, match=r"config.masking.mask=1.2 is not in \[0, 1\]"):
        pretraining.masking_mix(config)
    with pytest.raises(ConfigError, match=r"mask \+ same \+ random = 0.5 \+ 0.5 \+ 0.5 = 1.5"):
        masking.MaskingConfig(max_predictions=2, vocab_size=10, mask_id=4, special_ids=(0,),
                              mix=(0.5, 0.5, 0.5))
    with pytest.raises(ConfigError, match="config.objective='gpt'"):
        rules.objective(ml_collections.ConfigDict(dict(objective="gpt")))


# -------------------------------------------------------------------------------- + BiLSTM


@pytest.mark.parametrize("head", ["classification", "squad", "tagging"])
def test_bilstm_head_sits_between_encoder_and_head_with_logical_axes(head):
    from bertjax.models.classification import BertForSequenceClassification
    from bertjax.models.squad import BertForQuestionAnswering
    from bertjax.models.tagging import BertForTokenClassification

    cfg = BertConfig(**TINY)
    model = {"classification": BertForSequenceClassification(cfg, 3, bilstm_units=8),
             "squad": BertForQuestionAnswering(cfg, bilstm_units=8),
             "tagging": BertForTokenClassification(cfg, 5, bilstm_units=8)}[head]
    ids = jnp.ones((2, 12), jnp.int32)
    mask = jnp.asarray(np.arange(12)[None] < np.array([[12], [7]]), jnp.int32)
    boxed = model.init(jax.random.PRNGKey(0), ids, jnp.zeros_like(ids), mask)["params"]
    lstm = boxed["bilstm"]
    assert set(lstm) == {"lstm_0_forward", "lstm_0_backward"}
    specs = jax.tree.leaves(jax.tree.map(lambda x: x.names, lstm,
                                         is_leaf=lambda x: isinstance(x, nn.Partitioned)),
                            is_leaf=lambda x: isinstance(x, tuple))
    assert specs and all(set(names) <= {"lstm_in", "lstm_hidden", "lstm"} for names in specs)
    head_kernel = {"classification": "classifier", "squad": "qa_outputs",
                   "tagging": "classifier"}[head]
    assert nn.unbox(boxed[head_kernel]["kernel"]).shape[0] == 16  # reads the 2 x 8 states
    params = nn.unbox(boxed)

    @jax.jit
    def apply(ids):
        out = model.apply({"params": params}, ids, jnp.zeros_like(ids), mask)
        return out[0] if head == "squad" else out

    out = apply(ids)
    # Row 1 has 7 real tokens: its padding never reaches the (backward) LSTM's real states.
    out2 = apply(ids.at[1, 7:].set(3))
    if head == "classification":
        np.testing.assert_allclose(out2, out, atol=1e-6)
    else:
        np.testing.assert_allclose(out2[1, :7], out[1, :7], atol=1e-6)


# --------------------------------------------------------------------------- the runner


def cell_value(path, metric="accuracy"):
    return json.loads(path.read_text())["best"][metric]


@pytest.mark.slow
@pytest.mark.extended
def test_runner_runs_every_cell_resumes_and_tables_the_cells(tmp_path, monkeypatch):
    from jax.experimental.compilation_cache import compilation_cache

    from bertjax.grids import ablations

    sets = write_test_data(tmp_path)
    sets["pretrain.phases.phase1.eval_data"] = ""  # no held-out evaluation: one compile less
    grid = ablations.load_grid("table5", "test", [f"{k}={v}" for k, v in sets.items()])
    # LTR & No NSP: one pre-training, fine-tuned with two seeds (the BiLSTM head is tested
    # above; its compile would double this test's time).
    grid.rows = [grid.rows[2]]
    grid.pretrain_per_seed = False
    workdir = tmp_path / "table5"
    calls = []
    real_cell = ablations.finetune_cell

    def interrupted(config, directory, log):
        if len(calls) == 1:
            raise KeyboardInterrupt  # the grid is stopped in its second fine-tuning cell
        calls.append(directory)
        return real_cell(config, directory, log)

    # As `python -m bertjax.ablations` does: cells of equal shapes compile once.
    compilation_cache.reset_cache()
    jax.config.update("jax_compilation_cache_dir", str(tmp_path / "jax_cache"))
    try:
        monkeypatch.setattr(ablations, "finetune_cell", interrupted)
        with pytest.raises(KeyboardInterrupt):
            ablations.run_table(grid, str(workdir), seeds=[0, 1], log=lambda s: None)
        done = {d: (tmp_path / d / "results.json").stat().st_mtime_ns for d in calls}
        states = ablations.cell_states(grid, str(workdir), seeds=[0, 1])
        assert [(state, what.split()[0], d) for state, what, d in states] == [
            ("done", "pretrain", str(workdir / "pretrain/ltr/seed_0")),
            ("done", "finetune", calls[0]),
            ("to do", "finetune", calls[0].replace("seed_0", "seed_1"))]
        listing = ablations.format_states(states).splitlines()
        assert listing[0].split() == ["done", "pretrain", "ltr", "seed", "0",
                                      str(workdir / "pretrain/ltr/seed_0")]
        assert listing[-1] == "3 cells: 2 done, 1 to do"
        monkeypatch.setattr(ablations, "finetune_cell", real_cell)
        summary = ablations.run_table(grid, str(workdir), seeds=[0, 1], log=lambda s: None)
        # --random_weights on the finished grid: only its cells run.
        ablations.add_random_weights_row(grid)
        random_summary = ablations.run_table(grid, str(workdir), seeds=[0, 1],
                                             log=lambda s: None)
    finally:
        jax.config.update("jax_compilation_cache_dir", None)
        compilation_cache.reset_cache()

    # 1 pre-training + 2 fine-tunings; the interrupted run finished 1 + 1 of them.
    assert summary["status"] == "done"
    assert (summary["ran"], summary["skipped"]) == (1, 2)
    assert len(calls) == 1 and calls[0].endswith("seed_0")
    assert all((tmp_path / d / "results.json").stat().st_mtime_ns == t for d, t in done.items())
    ltr = json.loads((workdir / "pretrain/ltr/seed_0/export/config.json").read_text())
    assert ltr["causal"] is True
    ltr_cell = json.loads((workdir / "finetune/ltr_no_nsp/rotten_tomatoes/lr_0.0003/seed_0/"
                           "run_config.json").read_text())
    assert ltr_cell["init_checkpoint"] == str(workdir / "pretrain/ltr/seed_0/export")

    table = (workdir / "table.md").read_text()
    results = json.loads((workdir / "results.json").read_text())
    for row in results["rows"]:
        cells = workdir / "finetune" / ablations.slug(row["name"]) / "rotten_tomatoes"
        values = [cell_value(cells / "lr_0.0003" / f"seed_{s}" / "results.json")
                  for s in (0, 1)]
        cell = row["cells"]["RT (acc)"]
        assert cell["values"] == values
        assert cell["mean"] == pytest.approx(np.mean(values))
        assert cell["std"] == pytest.approx(np.std(values, ddof=1))
        line = next(x for x in table.splitlines() if x.startswith(f"| {row['name']} |"))
        assert line == (f"| {row['name']} | {100 * np.mean(values):.1f} ± "
                        f"{100 * np.std(values, ddof=1):.1f} |")
    assert (workdir / "loss_curves.png").stat().st_size > 1000

    # The random-weights row: 1 export + 2 fine-tunings ran, the 3 earlier cells were kept,
    # and its model is the grid's at its initial weights: the encoder's kernels have the std
    # of a normal truncated at 2 sigma (0.8796 sigma) and none beyond 2 sigma.
    assert (random_summary["ran"], random_summary["skipped"]) == (3, 3)
    export = workdir / "pretrain" / ablations.RANDOM_WEIGHTS / "seed_0" / "export"
    random_cell = json.loads((workdir / "finetune/random_weights_no_pre_training/"
                              "rotten_tomatoes/lr_0.0003/seed_0/run_config.json").read_text())
    assert random_cell["init_checkpoint"] == str(export)
    _, params, _ = load_pretrained(export)
    kernels = np.concatenate([np.ravel(leaf) for path, leaf in
                              jax.tree_util.tree_leaves_with_path(params["bert"])
                              if "kernel" in jax.tree_util.keystr(path)])
    sigma = grid.pretrain.model.initializer_range
    assert kernels.size > 5000
    assert np.std(kernels) == pytest.approx(0.8796 * sigma, rel=0.03)
    assert np.abs(kernels).max() <= 2 * sigma + 1e-6
    random_results = json.loads((workdir / "results.json").read_text())
    row = random_results["rows"][-1]
    assert row["pretraining"] == ablations.RANDOM_WEIGHTS
    assert row["cells"]["RT (acc)"]["values"] == [
        cell_value(workdir / "finetune/random_weights_no_pre_training/rotten_tomatoes/"
                   f"lr_0.0003/seed_{s}/results.json") for s in (0, 1)]
    assert "| Random weights (no pre-training) |" in (workdir / "table.md").read_text()


def test_pretraining_columns_read_the_evaluation_at_the_rows_step():
    from bertjax.grids.ablations import pretrain_metric

    history = [{"step": 300, "mlm_accuracy": 0.10, "seq_len": 64},
               {"step": 600, "mlm_accuracy": 0.20, "seq_len": 64},
               {"step": 1056, "mlm_accuracy": 0.25, "seq_len": 64},
               {"step": 1100, "mlm_accuracy": 0.15, "seq_len": 256}]
    assert pretrain_metric(history, "mlm_accuracy", 1100) == 0.15  # the final evaluation
    assert pretrain_metric(history, "mlm_accuracy", 1100, seq_len=64) == 0.25
    assert pretrain_metric(history, "mlm_accuracy", 599, seq_len=64) == 0.10
    assert pretrain_metric(history, "mlm_accuracy", 299) is None
    assert pretrain_metric(history, "nsp_accuracy", 1100) is None


def test_cells_show_the_value_alone_from_one_run_and_the_spread_from_several():
    from bertjax.grids import stats

    one = dict(n=1, mean=0.7141, std=0.0, scale=100.0, metric="accuracy")
    assert stats.format_cell(one) == "71.4"
    assert stats.format_cell(dict(one, n=3, std=0.0123)) == "71.4 ± 1.2"
    assert stats.format_cell(dict(n=2, mean=5.841, std=0.02, scale=1.0)) == "5.84 ± 0.02"
    assert stats.format_cell(dict(one, n=0)) == "–"


# ------------------------------------------------------------------ the paper's recipe


def test_paper_scale_grids_use_the_papers_hyper_parameters():
    from bertjax.grids import ablations

    for table in ablations.TABLES:
        grid = ablations.load_grid(table, "paper", [])
        pre = grid.pretrain
        # BERT-base (Sec. 3): L=12, H=768, A=12, FFN 3072, dropout 0.1, GELU.
        assert (pre.model.num_layers, pre.model.hidden_size, pre.model.num_heads,
                pre.model.intermediate_size) == (12, 768, 12, 3072)
        assert pre.model.hidden_dropout_prob == pre.model.attention_dropout_prob == 0.1
        assert pre.model.hidden_act == "gelu"
        # Sec. A.2: batch 256, 1M steps, Adam lr 1e-4, b1 0.9, b2 0.999, L2 decay 0.01,
        # warmup 10k steps then linear decay; 90% of the steps at 128 tokens, then 512.
        assert pre.train.batch_size == 256 and pre.train.num_train_steps == 1_000_000
        opt = pre.optimizer
        assert (opt.learning_rate, opt.b1, opt.b2, opt.weight_decay, opt.warmup_steps) == (
            1e-4, 0.9, 0.999, 0.01, 10_000)
        phases = sorted(pre.phases.items())
        assert [(p.seq_len, p.fraction) for _, p in phases] == [(128, 0.9), (512, 0.1)]
        # 15% of the tokens chosen; 80% [MASK], 10% random, 10% unchanged (Sec. 3.1).
        assert pre.masking.masked_lm_prob == 0.15
        assert (pre.masking.mask, pre.masking.same, pre.masking.random) == (0.8, 0.1, 0.1)
        # Fine-tuning (Sec. A.3): batch 32, 3 epochs, lr from {5e-5, 4e-5, 3e-5, 2e-5}.
        for name, task in grid.tasks.items():
            assert task.config.train.batch_size == 32, (table, name)
            assert task.config.train.num_epochs == 3.0 or "feature" in name, (table, name)
            if "feature" not in name:
                assert sorted(task.learning_rates) == [2e-5, 3e-5, 4e-5, 5e-5], (table, name)
    table5 = ablations.load_grid("table5", "paper", [])
    assert list(table5.task_order) == ["mnli", "qnli", "mrpc", "sst2", "squad"]
    assert [r["pretraining"] for r in table5.rows] == ["mlm_nsp", "mlm", "ltr", "ltr"]
    assert {k: v.objective for k, v in table5.pretrainings.items()} == {
        "mlm_nsp": "mlm_nsp", "mlm": "mlm", "ltr": "ltr"}
    assert table5.rows[3]["finetune"] == {"task": {"bilstm_units": 768}}
    assert table5.paper["LTR & No NSP"]["SQuAD (F1)"] == 77.8
    table6 = ablations.load_grid("table6", "paper", [])
    assert [(p.model.num_layers, p.model.hidden_size, p.model.num_heads)
            for p in (table6.pretrainings[r["pretraining"]] for r in table6.rows)] == [
        (3, 768, 12), (6, 768, 3), (6, 768, 12), (12, 768, 12), (12, 1024, 16), (24, 1024, 16)]
    assert [table6.paper[r["name"]]["LM (ppl)"] for r in table6.rows] == [
        5.84, 5.24, 4.68, 3.99, 3.54, 3.23]
    table8 = ablations.load_grid("table8", "paper", [])
    mixes = [table8.pretrainings[r["pretraining"]].masking for r in table8.rows]
    assert [(m.mask, m.same, m.random) for m in mixes] == [
        (0.8, 0.1, 0.1), (1.0, 0.0, 0.0), (0.8, 0.0, 0.2), (0.8, 0.2, 0.0), (0.0, 0.2, 0.8),
        (0.0, 0.0, 1.0)]
    assert table8.tasks.ner_feature_based.config.feature_based.variant == "concat_last_four"
    steps = ablations.load_grid("steps", "paper", [])
    assert list(steps.export_steps) == [200_000, 400_000, 600_000, 800_000]
