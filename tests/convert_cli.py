"""`python -m bertjax.convert ARGS` in the test process: the CLI's own flags and main, without a
TensorFlow/JAX start-up per call."""

from absl import flags

from bertjax.cli import parse_flags
from bertjax.convert import __main__ as cli


def convert_main(args):
    if "checkpoint" not in flags.FLAGS:
        cli.define_flags()
    flags.FLAGS.unparse_flags()  # no value left over from an earlier call
    cli.main(parse_flags(["bertjax.convert", *map(str, args)]))
