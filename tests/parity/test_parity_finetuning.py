"""Fine-tuning parity, short: every family's own batches and loss follow transformers' head
for 20 steps (bertjax.parity.finetuning), and a planted slip in a loss makes its row fail —
padding or ignored sub-tokens counted in the token-classification mean, span losses summed
instead of averaged."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from bertjax.parity import finetuning as ft
from bertjax.tasks.tagging.task import token_loss  # the real one (the slips patch the module)

STEPS = 20


@pytest.fixture(autouse=True)
def one_bucket(monkeypatch):
    # One batch length (64): one compile per side; the 300-step rows keep the buckets.
    monkeypatch.setattr(ft, "MIN_BUCKET_LENGTH", 64)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["classification", "regression", "multiple_choice", "squad",
                                  "tagging"])
def test_family_follows_transformers(kind, tmp_path, monkeypatch):
    # 2e-4 keeps multiple choice's 300-step row out of chaos (ft.LEARNING_RATES); over 20
    # steps it barely moves the loss, 3e-4 does.
    monkeypatch.setitem(ft.LEARNING_RATES, "multiple_choice", 3e-4)
    row = ft.run_family(kind, STEPS, tmp_path)
    assert len(row.ours["loss"]) == len(row.theirs["loss"]) == STEPS
    assert row.max_rel_diff() <= 1e-4, row.max_rel_diff()
    assert row.passed()
    assert row.max_param_diff() <= 1e-3, sorted(row.param_rel_diff.items(),
                                                 key=lambda kv: -kv[1])[:3]
    # The loss moved: the rows compare training, not a frozen model.
    assert abs(np.mean(row.ours["loss"][-5:]) - np.mean(row.ours["loss"][:5])) > 1e-3


def test_shift_invariant_tensors_are_named_apart():
    diffs = {"bert.encoder.layer.0.attention.self.key.bias": 1.5, "qa_outputs.bias": 2.0,
             "bert.encoder.layer.1.output.LayerNorm.bias": 0.9,
             "bert.encoder.layer.0.output.LayerNorm.bias": 1e-5, "qa_outputs.weight": 1e-5}
    kept, note = ft.split_param_diffs("squad", diffs, num_layers=2)
    assert kept == {"bert.encoder.layer.0.output.LayerNorm.bias": 1e-5,
                    "qa_outputs.weight": 1e-5}
    assert "max 2 (qa_outputs.bias)" in note
    kept, _ = ft.split_param_diffs("tagging", diffs, num_layers=2)
    assert set(diffs) - set(kept) == {"bert.encoder.layer.0.attention.self.key.bias"}


def _padding_in_denominator(logits, labels, weights, denominators=None):
    """Slip: the scored positions' NLL summed, divided by every position (padding too)."""
    log_probs = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    nll = -jnp.take_along_axis(log_probs, labels[..., None], -1)[..., 0]
    loss = jnp.sum(nll * weights) / weights.size
    return loss, {"loss": loss}


def _sub_tokens_counted(logits, labels, weights, denominators=None):
    """Slip: every position scored (other sub-tokens, context, specials, padding: label 0)."""
    return token_loss(logits, labels, jnp.ones_like(weights))


@pytest.mark.slow
@pytest.mark.parametrize("slip", [_padding_in_denominator, _sub_tokens_counted])
def test_token_mean_slip_fails_the_row(slip, tmp_path, monkeypatch):
    from bertjax.tasks.tagging import task as tagging_task

    monkeypatch.setattr(tagging_task, "token_loss", slip)
    row = ft.run_family("tagging", STEPS, tmp_path)
    assert not row.passed()
    assert row.max_rel_diff(first=50) > 1e-2  # far outside the 1e-4 tolerance


@pytest.mark.slow
def test_summed_span_loss_fails_the_row(tmp_path, monkeypatch):
    from bertjax.tasks.squad import task as squad_task

    real = squad_task.span_loss

    def summed(start_logits, end_logits, start_positions, end_positions, weights=None,
               denominators=None):
        loss, metrics = real(start_logits, end_logits, start_positions, end_positions, weights,
                             denominators)
        return 2.0 * loss, dict(metrics, loss=2.0 * loss)  # start + end, not their mean

    monkeypatch.setattr(squad_task, "span_loss", summed)
    row = ft.run_family("squad", STEPS, tmp_path)
    assert not row.passed()
    assert row.max_rel_diff(first=1) == pytest.approx(1.0, rel=1e-4)  # twice theirs


@pytest.mark.slow
@pytest.mark.extended
def test_dropout_seeds_agree(tmp_path):
    row = ft.run_dropout(STEPS, tmp_path, seeds=(0, 1, 2, 3))
    assert len(row.ours_seeds) == len(row.theirs_seeds) == 4
    # Dropout is on: seeds give different curves on each side.
    assert len({round(c[5], 6) for c in row.ours_seeds}) == 4
    assert len({round(c[5], 6) for c in row.theirs_seeds}) == 4
    assert row.passed(), row.seed_t()


@pytest.mark.slow
@pytest.mark.extended
def test_dropout_expectation_sees_attention_dropout_left_out(tmp_path, monkeypatch):
    # 3 of the row's 6 batches (half the 2 x 2,400 forward passes): the slip's t is still
    # below -6 on two of them, the same model's within +-1.5 on all.
    monkeypatch.setattr(ft, "DROPOUT_BATCHES", 3)
    row = ft.run_dropout_expectation(300, tmp_path / "same", draws=200)
    assert row.passed(), row.seed_t()
    task, vocab_size, _ = ft.task_batches("classification", tmp_path / "slip", 1)
    rate = ft.DROPOUT_PROBE_RATE
    no_attention = task.model(ft.harness.small_config(
        vocab_size, hidden_dropout_prob=rate, attention_dropout_prob=0.0))
    slip = ft.run_dropout_expectation(300, tmp_path / "slip", draws=200,
                                     our_model=no_attention)
    assert not slip.passed() and min(slip.seed_t()) < -ft.harness.SEED_T, slip.seed_t()


@pytest.mark.parametrize("kind,config", [
    ("classification", "experiments/finetune_files.py:classification"),
    ("regression", "experiments/finetune_files.py:regression"),
    ("multiple_choice", "experiments/finetune_files.py:multiple_choice"),
    ("squad", "experiments/squad.py:v1"), ("tagging", "experiments/ner.py:files")])
def test_row_configs_are_the_experiments_configs(kind, config, tmp_path):
    """The rows build their configs inline (library code does not import experiments/):
    every field they set exists in the experiment's config, task family and kind agree, and
    the tagging row keeps the default document context."""
    import importlib

    path, arg = config.split(":")
    module = path.removesuffix(".py").replace("/", ".")
    reference = importlib.import_module(module).get_config(arg)
    ours = ft._config(kind, tmp_path)
    for group in ("task", "data"):
        assert set(ours[group]) <= set(reference[group]), group
    assert (ours.task.family, ours.task.kind) == (reference.task.family, reference.task.kind)
    if kind == "tagging":
        assert ours.data.document_context == reference.data.document_context
