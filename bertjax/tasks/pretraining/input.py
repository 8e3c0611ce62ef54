"""Pre-training input for the trainer: each phase's TFRecords (or "synthetic") read in one
global order, of which each process takes its rows; plain or packed rows, masked on the fly
when the data carries its metadata (data_pipeline/pretraining_input.py, packed_input.py)."""

from __future__ import annotations

import jax

from bertjax.errors import ConfigError
from bertjax.tasks.pretraining import rules
from bertjax.train.synthetic import SyntheticInput
from data_pipeline import masking as masking_lib


def masking_mix(config) -> tuple[float, float, float]:
    """(mask, same, random) shares of config.masking (default 0.8 / 0.1 / 0.1), each in [0, 1]
    and summing to 1."""
    masking = config.get("masking") or {}
    names = ("mask", "same", "random")
    mix = tuple(masking.get(name, default) for name, default in zip(names, masking_lib.DEFAULT_MIX))
    return masking_lib.check_mix(mix, names=tuple(f"config.masking.{n}" for n in names))


def make_input_fn(config):
    """Returns make_input(phase, batch_size, split="train") for the trainer: this process's
    rows of global batches of `batch_size`, in an order that does not depend on the number of
    processes."""
    packed = rules.packing_enabled(config)
    mix = masking_mix(config)

    def make_input(phase, batch_size, split="train"):
        pattern = phase.data if split == "train" else phase.eval_data
        field = "data" if split == "train" else "eval_data"
        if pattern == "synthetic" and packed:
            raise ConfigError(
                f"config.phases.{phase.name}.{field}=synthetic cannot be packed; give unmasked "
                "TFRecords (python -m data_pipeline.create_segments) or "
                "config.packing.enabled=False"
            )
        if pattern == "synthetic":
            return SyntheticInput(
                batch_size, phase.seq_len, phase.max_predictions,
                config.model.vocab_size, seed=config.seed + (split == "eval"),
                process_index=jax.process_index(), process_count=jax.process_count(),
            )
        if not pattern:
            raise ConfigError(
                f"config.phases.{phase.name}.{'data' if split == 'train' else 'eval_data'} is "
                "empty; give a TFRecord file pattern (or 'synthetic')"
            )
        # TensorFlow (tf.data) only once a phase's records are read.
        from data_pipeline import metadata, pretraining_input

        if packed:
            return _packed_input(config, phase, field, pattern, batch_size, split)

        # Data written by create_pretraining_data carries metadata (vocab size, [MASK], special
        # ids, word continuations) and is masked on the fly; data without it (e.g. prepared for
        # google-research/bert) is read as the static pre-masked records it is.
        masking = None
        if config.masking.dynamic and metadata.read(pattern) is not None:
            masking = pretraining_input.masking_from_metadata(
                pattern, max_predictions=phase.max_predictions,
                masked_lm_prob=config.masking.masked_lm_prob,
                whole_word=config.masking.whole_word, mix=mix,
            )
        try:
            dataset = pretraining_input.make_dataset(
                pattern, seq_len=phase.seq_len, max_predictions=phase.max_predictions,
                batch_size=batch_size, seed=config.seed, shuffle=split == "train",
                repeat=True, process_index=jax.process_index(),
                process_count=jax.process_count(), masking=masking,
            )
        except ValueError as e:  # the data pipeline's messages name the file and field
            raise ConfigError(f"config.phases.{phase.name}: {e}") from None
        return pretraining_input.InputIterator(dataset)

    return make_input


def _packed_input(config, phase, field, pattern, batch_size, split):
    """Masked batches of packed rows (data_pipeline/packed_input.py) for one phase; unmasked
    for the left-to-right LM (config.objective="ltr")."""
    from data_pipeline import packed_input

    ltr = rules.objective(config) == "ltr"
    if not config.masking.dynamic and not ltr:
        raise ConfigError("packed rows (config.objective=mlm or config.packing.enabled=True) "
                          "need config.masking.dynamic=True (rows are masked after packing)")
    try:
        masking = None if ltr else packed_input.masking_from_metadata(
            pattern, max_predictions=phase.max_predictions,
            masked_lm_prob=config.masking.masked_lm_prob, whole_word=config.masking.whole_word,
            mix=masking_mix(config))
        dataset = packed_input.make_packed_dataset(
            pattern, seq_len=phase.seq_len, batch_size=batch_size, masking=masking,
            seed=config.seed, shuffle=split == "train", repeat=True,
            process_index=jax.process_index(), process_count=jax.process_count(),
            num_open_rows=int(config.packing.get("num_open_rows", 8)),
            block_size=int(config.packing.get("block_size", 1024)),
        )
    except ValueError as e:  # the data pipeline's messages name the file and field
        raise ConfigError(f"config.phases.{phase.name}.{field}: {e}") from None
    return packed_input.InputIterator(dataset)
