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
from ml_collections import config_flags

from bertjax import cli, validate


def main(argv):
    del argv
    config = cli.require(_CONFIG.value, "--config", "experiments/pretrain.py:base")

    from bertjax.tasks.pretraining import PretrainingJob, make_input_fn
    from bertjax.train import dry_run, loop

    def make_job(config):
        return PretrainingJob(config, make_input_fn(config))

    # The model's vocabulary size comes from config.vocab unless given on the command line
    # (a different one is refused), in the dry run too: it fixes the embedding's rows.
    given = "model.vocab_size" in config_flags.get_override_values(flags.FLAGS["config"])
    taken = validate.vocab_size(config, given)
    if taken:
        print(f"config.model.vocab_size={taken}: the entries of config.vocab={config.vocab}",
              flush=True)
    if flags.FLAGS.dry_run:
        validate.pretraining(config, workdir=None, vocab_size_given=given)
    if dry_run.from_flags(make_job, config):
        return
    cli.require(_WORKDIR.value, "--workdir", "runs/base (or gs://bucket/run)")
    # Config, every phase's data, vocab, init checkpoint and workdir: before any step or
    # file write (a bad phase-2 pattern must not surface after all of phase 1).
    validate.pretraining(config, _WORKDIR.value, vocab_size_given=given)
    cli.initialize_distributed(config)  # before anything touches a JAX backend
    cli.use_compilation_cache()
    summary = loop.train(make_job(config), config, _WORKDIR.value,
                         log=functools.partial(print, flush=True))
    print(f"Training {summary['status']}.", flush=True)


if __name__ == "__main__":
    from bertjax.train import dry_run as dry_run_flags

    _CONFIG, _WORKDIR = cli.define_job_flags("experiments/pretrain.py:base")
    dry_run_flags.define_flags("the config's data")
    cli.run(main)
