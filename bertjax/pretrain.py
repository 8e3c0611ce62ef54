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

from bertjax import cli


def main(argv):
    del argv
    config = cli.require(_CONFIG.value, "--config", "experiments/pretrain.py:base")
    from bertjax.aot import dry_run
    from bertjax.tasks import pretraining
    from bertjax.tasks.pretraining import checks

    log = functools.partial(print, flush=True)
    # The model's vocabulary size comes from config.vocab unless given on the command line
    # (a different one is refused), in the dry run too: it fixes the embedding's rows.
    given = "model.vocab_size" in config_flags.get_override_values(flags.FLAGS["config"])
    if flags.FLAGS.dry_run:
        checks.check(config, None, checks.resolve(config, given, log))
    if dry_run.from_flags(pretraining.make_job, config):
        return
    workdir = cli.require(_WORKDIR.value, "--workdir", "runs/base (or gs://bucket/run)")
    cli.initialize_distributed(config)  # before anything touches a JAX backend
    cli.use_compilation_cache()
    summary = pretraining.train(config, workdir, vocab_size_given=given, log=log)
    print(f"Training {summary['status']}.", flush=True)


if __name__ == "__main__":
    _CONFIG, _WORKDIR = cli.define_job_flags("experiments/pretrain.py:base")
    cli.define_dry_run_flags("the config's data")
    cli.run(main)
