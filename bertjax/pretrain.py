r"""Pre-train BERT.

  python -m bertjax.pretrain --config=experiments/pretrain.py:base --workdir=gs://bucket/run
  python -m bertjax.pretrain --config=experiments/pretrain.py:large --dry_run
"""

from __future__ import annotations

import sys

from absl import app, flags
from ml_collections import config_flags

from bertjax.cli import parse_flags
from bertjax.models.config import ConfigError

_CONFIG = config_flags.DEFINE_config_file("config", None, "Experiment config file.")
_WORKDIR = flags.DEFINE_string("workdir", None, "Directory (local or gs://) for the run.")
_DRY_RUN = flags.DEFINE_bool(
    "dry_run", False, "Print parameters, FLOPs and per-device memory of the train step; exit."
)


def main(argv):
    del argv
    config = _CONFIG.value
    if config is None:
        sys.exit("error: --config is required, e.g. --config=experiments/pretrain.py:base")
    try:
        if _DRY_RUN.value:
            from bertjax.train import dry_run

            dry_run.run(config)
            return
        sys.exit(
            "error: the pre-training loop is not available yet in this version; "
            "use --dry_run to inspect a configuration"
        )
    except ConfigError as e:
        sys.exit(f"error: {e}")


if __name__ == "__main__":
    app.run(main, flags_parser=parse_flags)
