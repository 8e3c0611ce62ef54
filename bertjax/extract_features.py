r"""Per-token contextual features from a pre-trained BERT or ModernBERT (the reference
extract_features.py).

  python -m bertjax.extract_features --checkpoint=DIR --input_file=in.txt \
      --output_file=out.jsonl --layers=-1,-2,-3,-4 --max_seq_length=128 [--batch_size=32] \
      [--do_lower_case | --nodo_lower_case] [--cpu_devices=N]

Input: one example a line, `text` or `text_a ||| text_b`; output: one JSON object a line, the
reference format (bertjax/serving/extraction.py). Batches are sharded over every device; on a
multi-host slice every process computes its share of each batch and process 0 writes. On a
machine with no accelerator the CPU is split into one JAX device per core (at most 4;
--cpu_devices), whole batches on each in turn: bitwise the features of one device, sooner.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from absl import flags

from bertjax import cli
from bertjax.errors import BertjaxError


def define_flags() -> None:
    # Defined only when run as a program: modules imported together (e.g. by pytest) must not
    # compete for absl's global flag names.
    flags.DEFINE_string("checkpoint", None, "bertjax checkpoint directory.")
    flags.DEFINE_string("input_file", None, "Text, one `text` or `a ||| b` a line.")
    flags.DEFINE_string("output_file", None, "JSON lines to write.")
    flags.DEFINE_string("layers", "-1,-2,-3,-4", "Encoder layers to output (-1 = last).")
    flags.DEFINE_integer("max_seq_length", 128, "Tokens per example, after WordPiece.")
    flags.DEFINE_integer("batch_size", 32, "Examples per compiled batch.")
    flags.DEFINE_string("encoding", "utf-8", "The input file's text encoding, e.g. latin-1.")
    flags.DEFINE_bool("do_lower_case", None,
                      "Lower-case input; default: the checkpoint's tokenizer_config.json.")
    cli.define_cpu_devices_flag()
    cli.define_compilation_cache_flag()
    cli.define_distributed_flags()


def main(argv: Sequence[str]) -> None:
    del argv
    f = flags.FLAGS
    for name in ("checkpoint", "input_file", "output_file"):
        if f[name].value is None:
            sys.exit(f"error: --{name} is required")
    devices = cli.turn_devices()  # the CPU split (or a clash with --distributed) first
    cli.initialize_distributed()  # before anything touches a JAX backend
    cli.use_compilation_cache()
    from bertjax.serving.extraction import run

    try:
        count = run(f.checkpoint, f.input_file, f.output_file, f.layers, f.max_seq_length,
                    f.batch_size, f.do_lower_case, devices, f.encoding)
    except (BertjaxError, ValueError) as e:  # CheckpointError, ConfigError, DataError; flags
        sys.exit(f"error: {e}")
    if count is not None:  # process 0 (the writer)
        where = f" ({len(devices)} CPU devices, whole batches in turn)" if devices else ""
        print(f"wrote {count} examples to {f.output_file}{where}")


if __name__ == "__main__":
    define_flags()
    cli.run(main)
