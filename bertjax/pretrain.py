r"""Pre-train BERT.

  python -m bertjax.pretrain --config=experiments/pretrain.py:base --workdir=gs://bucket/run \
      --config.phases.phase1.data='gs://bucket/data/seq128/*.tfrecord' \
      --config.phases.phase2.data='gs://bucket/data/seq512/*.tfrecord'
  python -m bertjax.pretrain --config=experiments/pretrain.py:large --dry_run
  python -m bertjax.pretrain --config=experiments/pretrain.py:large --dry_run --topology=v5p-32
  python -m bertjax.pretrain --config=experiments/pretrain.py:large --dry_run --topology=v5p-32 \
      --sweep

Runs resume automatically from the latest checkpoint in --workdir. On a TPU pod slice, start
the same command on every host with --distributed (one process per host).

No-NSP pre-training on packed rows (data from `python -m data_pipeline.create_segments`, or
`create_pretraining_data --masking=dynamic`); --config.objective=ltr for a left-to-right LM:

  python -m bertjax.pretrain --config=experiments/pretrain.py:base --workdir=runs/no_nsp \
      --config.objective=mlm \
      --config.phases.phase1.data='data/segments_128/part-*.tfrecord' \
      --config.phases.phase2.data='data/segments_512/part-*.tfrecord'
"""

from __future__ import annotations

import functools

from absl import flags

from bertjax import cli, validate
from bertjax.errors import ConfigError


def make_input_fn(config):
    """Returns make_input(phase, batch_size, split="train") for the trainer: this process's
    rows of global batches of `batch_size`, in an order that does not depend on the number of
    processes."""
    import jax

    from bertjax.train import configs

    packed = configs.packing_enabled(config)
    mix = configs.masking_mix(config)

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
            from bertjax.train.synthetic import SyntheticInput

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
        from data_pipeline import pretraining_input, tfrecords

        if packed:
            return _packed_input(config, phase, field, pattern, batch_size, split)

        # Data written by create_pretraining_data carries metadata (vocab size, [MASK], special
        # ids, word continuations) and is masked on the fly; data without it (e.g. prepared for
        # google-research/bert) is read as the static pre-masked records it is.
        masking = None
        if config.masking.dynamic and tfrecords.read_metadata(pattern) is not None:
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
    import jax

    from bertjax.train import configs
    from data_pipeline import packed_input

    ltr = configs.objective(config) == "ltr"
    if not config.masking.dynamic and not ltr:
        raise ConfigError("packed rows (config.objective=mlm or config.packing.enabled=True) "
                          "need config.masking.dynamic=True (rows are masked after packing)")
    try:
        masking = None if ltr else packed_input.masking_from_metadata(
            pattern, max_predictions=phase.max_predictions,
            masked_lm_prob=config.masking.masked_lm_prob, whole_word=config.masking.whole_word,
            mix=configs.masking_mix(config))
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


def main(argv):
    del argv
    config = cli.require(_CONFIG.value, "--config", "experiments/pretrain.py:base")

    from bertjax.tasks.pretraining import PretrainingJob
    from bertjax.train import dry_run, loop

    if _DRY_RUN.value:
        validate.pretraining(config, workdir=None)

        def make_job(config):
            return PretrainingJob(config, make_input_fn(config))

        if not dry_run.on_slice(make_job, config, _TOPOLOGY.value, _SWEEP.value,
                                _SWEEP_SECONDS.value):
            dry_run.run(make_job(config), config)
        return
    if _TOPOLOGY.value or _SWEEP.value:
        raise ConfigError("--topology and --sweep need --dry_run")
    cli.require(_WORKDIR.value, "--workdir", "runs/base (or gs://bucket/run)")
    # Config, every phase's data, vocab, init checkpoint and workdir: before any step or
    # file write (a bad phase-2 pattern must not surface after all of phase 1).
    validate.pretraining(config, _WORKDIR.value)
    cli.initialize_distributed()  # before anything touches a JAX backend
    job = PretrainingJob(config, make_input_fn(config))
    summary = loop.train(job, config, _WORKDIR.value, log=functools.partial(print, flush=True))
    print(f"Training {summary['status']}.", flush=True)


if __name__ == "__main__":
    # Flags are defined here, not on import: bertjax.ablations imports this module's
    # make_input_fn next to its own --workdir.
    _CONFIG, _WORKDIR = cli.define_job_flags("experiments/pretrain.py:base")
    _DRY_RUN = flags.DEFINE_bool(
        "dry_run", False, "Print parameters, FLOPs and per-device memory of the train step; exit."
    )
    _TOPOLOGY = flags.DEFINE_string(
        "topology", None, "With --dry_run: compile for this Cloud TPU slice with the TPU "
        "compiler, on any machine (needs the tpu extra): v4-32, v5p-128, v5litepod-16, v6e-64, "
        "v5p:4x4x4.")
    _SWEEP = flags.DEFINE_bool(
        "sweep", False, "With --dry_run --topology: try meshes, batch sizes, remat and scan; "
        "list those that fit, fastest first, with their flags.")
    _SWEEP_SECONDS = flags.DEFINE_integer("sweep_seconds", 600, "Compile-time budget of --sweep.")
    cli.run(main)
