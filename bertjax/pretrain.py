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


def main(argv):
    del argv
    config = cli.require(_CONFIG.value, "--config", "experiments/pretrain.py:base")

    from bertjax.tasks.pretraining import PretrainingJob, make_input_fn
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
