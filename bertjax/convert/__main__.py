r"""Convert BERT checkpoints to and from bertjax checkpoint directories.

  python -m bertjax.convert from_tf --checkpoint uncased_L-12_H-768_A-12/bert_model.ckpt \
      --config uncased_L-12_H-768_A-12/bert_config.json \
      --vocab uncased_L-12_H-768_A-12/vocab.txt --output checkpoints/bert_base_uncased
  python -m bertjax.convert from_hf --input hf/bert-base-uncased --output checkpoints/base
  python -m bertjax.convert to_hf --input checkpoints/base --output hf/base \
      [--architecture BertForPreTraining|BertForMaskedLM|BertModel]

Every source tensor is either converted or listed as skipped (optimizer state, tied copies,
buffers, task heads); heads the source lacks are initialised and listed. Any mismatch stops
with one line naming the tensor.
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
from collections.abc import Sequence

import numpy as np
from etils import epath

from bertjax.convert.mapping import ConversionError
from bertjax.models.config import BertConfig, ConfigError

GROUP_NAMES = {
    "bert/pooler": "the pooler (bert/pooler)",
    "mlm": "the masked-LM head (mlm: cls/predictions)",
    "nsp": "the next-sentence head (nsp: cls/seq_relationship)",
}


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line instead of usage + message
        sys.exit(f"error: {self.prog}: {message}")


def _bool(value: str) -> bool:
    if value.lower() in ("true", "1", "yes"):
        return True
    if value.lower() in ("false", "0", "no"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {value!r}")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="python -m bertjax.convert", description=__doc__,
                     formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)

    def common_import_flags(p):
        p.add_argument("--output", required=True, help="bertjax checkpoint directory to write")
        p.add_argument("--do_lower_case", type=_bool, default=None,
                       help="true/false; default: the source's tokenizer_config.json, else "
                            "inferred from the vocabulary (upper-case tokens → cased)")
        p.add_argument("--seed", type=int, default=0,
                       help="seed for heads the source lacks (they are listed)")
        p.add_argument("--overwrite", action="store_true")

    tf = commands.add_parser("from_tf", help="Google's TF1 checkpoint → bertjax")
    tf.add_argument("--checkpoint", required=True, help="PATH/bert_model.ckpt (the prefix)")
    tf.add_argument("--config", required=True, help="PATH/bert_config.json")
    tf.add_argument("--vocab", required=True, help="PATH/vocab.txt")
    common_import_flags(tf)

    hf = commands.add_parser("from_hf", help="Hugging Face BERT directory → bertjax")
    hf.add_argument("--input", required=True, help="directory with config.json and weights")
    hf.add_argument("--vocab", default=None, help="default: INPUT/vocab.txt")
    common_import_flags(hf)

    out = commands.add_parser("to_hf", help="bertjax → Hugging Face (safetensors)")
    out.add_argument("--input", required=True, help="bertjax checkpoint directory")
    out.add_argument("--output", required=True, help="Hugging Face directory to write")
    out.add_argument("--architecture", default="BertForPreTraining",
                     choices=["BertForPreTraining", "BertForMaskedLM", "BertModel"])
    out.add_argument("--dtype", default="float32",
                     choices=["float32", "bfloat16", "float16", "float64"])
    out.add_argument("--overwrite", action="store_true")
    return parser


def _report(summary: dict, output: str, num_params: int, num_tensors: int) -> None:
    print(f"wrote {output}: {num_tensors} tensors, {num_params:,} parameters from "
          f"{summary['source']}")
    print(f"do_lower_case={summary['do_lower_case']} ({summary['do_lower_case_source']})")
    for note in summary.get("notes", []):
        print(f"note: {note}")
    for group in summary["initialised"]:
        print(f"initialised (not in the source): {GROUP_NAMES[group]}")
    skipped = summary.get("skipped", {})
    if skipped:
        counts = collections.Counter(skipped.values())
        parts = ", ".join(f"{n} {why}" for why, n in sorted(counts.items()))
        print(f"skipped {len(skipped)} source tensors ({parts}); listed in "
              f"{epath.Path(output) / 'conversion.json'}")


def _count(params) -> tuple[int, int]:
    import jax

    leaves = jax.tree.leaves(params)
    return sum(int(np.size(x)) for x in leaves), len(leaves)


def _vocab_file(vocab: str, flag: str) -> epath.Path:
    """The vocabulary file, checked to exist before any weights are read. Its size is checked
    against the weights later (by save_pretrained), once the weights have been checked against
    the config, so a mismatch message blames the right file."""
    from bertjax import pretrained

    try:
        return pretrained.vocab_path(vocab)
    except ConversionError as e:
        raise ConversionError(f"{flag}: {e}") from e


def _import(args, config: BertConfig, params, missing, skipped, vocab, source, notes):
    from bertjax import pretrained

    del missing  # save_pretrained initialises (and reports) the groups the source lacks
    provenance = {"source": source, "skipped": skipped, "notes": notes}
    summary = pretrained.save_pretrained(
        args.output, config, params, vocab, do_lower_case=args.do_lower_case,
        provenance=provenance, seed=args.seed, overwrite=args.overwrite,
    )
    converted_params, converted_tensors = _count(params)
    _report(summary, args.output, converted_params, converted_tensors)


def from_tf(args) -> None:
    from bertjax.convert import tf_checkpoint

    config = tf_checkpoint.read_config(args.config)
    vocab = _vocab_file(args.vocab, "--vocab")
    params, missing, skipped = tf_checkpoint.read_tf_checkpoint(args.checkpoint, config)
    notes = []
    if json.loads(epath.Path(args.config).read_text()).get("hidden_act", "gelu") == "gelu":
        notes.append("bert_config.json hidden_act='gelu' is the tanh approximation in Google's "
                     "code, so model.hidden_act='gelu_tanh'")
    _import(args, config, params, missing, skipped, vocab, f"TF checkpoint {args.checkpoint}",
            notes)


def from_hf(args) -> None:
    from bertjax.convert import huggingface

    directory = epath.Path(args.input)
    if not directory.is_dir():
        raise ConversionError(f"--input {directory} is not a directory")
    config = huggingface.read_config(directory)
    vocab_flag = "--vocab" if args.vocab else "--input"
    vocab = _vocab_file(args.vocab or str(directory), vocab_flag)
    params, missing, skipped = huggingface.read_hf_checkpoint(directory, config)
    _import(args, config, params, missing, skipped, vocab, f"Hugging Face {directory}", [])


def to_hf(args) -> None:
    from bertjax import pretrained
    from bertjax.convert import huggingface

    directory = epath.Path(args.input)
    config = pretrained.load_config(directory)
    config = BertConfig.from_dict({**config.to_dict(), "scan_layers": False})
    params = pretrained.load_params(directory, config)
    vocab = pretrained.vocab_path(directory)
    tokenizer_config_file = directory / pretrained.TOKENIZER_CONFIG_FILE
    do_lower_case = True
    if tokenizer_config_file.exists():
        do_lower_case = json.loads(tokenizer_config_file.read_text()).get("do_lower_case", True)
    notes = huggingface.write_hf_checkpoint(
        args.output, config, params, vocab, do_lower_case, args.architecture, args.dtype,
        args.overwrite,
    )
    print(f"wrote {args.output}: {args.architecture} ({args.dtype}) from {directory}")
    for note in notes:
        print(f"note: {note}")


COMMANDS = {"from_tf": from_tf, "from_hf": from_hf, "to_hf": to_hf}


def main(argv: Sequence[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    try:
        COMMANDS[args.command](args)
    except (ConversionError, ConfigError) as e:
        sys.exit(f"error: {e}")


if __name__ == "__main__":
    main()
