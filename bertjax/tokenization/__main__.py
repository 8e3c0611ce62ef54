r"""Command line for tokenization.

  python -m bertjax.tokenization train --input 'corpus/*.txt' --vocab_size 30522 \
      --model_type wordpiece|sentencepiece|bpe [--sp_type unigram|bpe] [--lowercase] --output DIR
  # bpe: a ByteLevel BPE tokenizer.json (ModernBERT's kind; the `tokenizers` library)
  python -m bertjax.tokenization tokenize --vocab PATH [--do_lower_case|--nodo_lower_case] \
      --input FILE --output FILE          # one JSON line {"tokens": [...], "ids": [...]}

Every bad input stops with one line naming the file or flag.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Sequence

from absl import flags

from bertjax import cli, paths

BATCH = 4096  # lines tokenized per tokenize_batch call


def define_flags() -> None:
    # Defined only when run as a program: modules imported together (e.g. by pytest) must not
    # compete for absl's global flag names.
    flags.DEFINE_multi_string("input", None, "train: glob(s) of UTF-8 text files, "
                              "comma-separated or repeated; tokenize: the text file.")
    flags.DEFINE_string("output", None, "train: directory to write; tokenize: JSON lines file.")
    flags.DEFINE_integer("vocab_size", None, "train: entries in the vocabulary.")
    flags.DEFINE_enum("model_type", "wordpiece", ["wordpiece", "sentencepiece", "bpe"],
                      "train: the vocabulary type (bpe: a ByteLevel BPE tokenizer.json).")
    flags.DEFINE_enum("sp_type", "unigram", ["unigram", "bpe"],
                      "train: SentencePiece algorithm.")
    flags.DEFINE_bool("lowercase", False, "train: an uncased vocabulary.")
    flags.DEFINE_string("vocab", None, "tokenize: vocab.txt, *.model or a directory.")
    flags.DEFINE_bool("do_lower_case", None, "tokenize: default: the vocabulary's "
                      "tokenizer_config.json.")
    flags.DEFINE_bool("no_do_lower_case", False,
                      "tokenize: --nodo_lower_case, as earlier versions spelt it.")


def _train(args) -> str:
    from bertjax.tokenization import train
    from bertjax.tokenization.loading import load_tokenizer

    if args.vocab_size <= 0:
        raise train.TrainError(f"--vocab_size must be positive, got {args.vocab_size}")
    lines = train.read_lines(train.expand_inputs(args.input))
    paths.makedirs(args.output, "--output")
    if args.model_type == "wordpiece":
        vocab = train.train_wordpiece(lines, args.vocab_size, lowercase=args.lowercase)
        from bertjax.tokenization.wordpiece import WordPieceTokenizer

        path = WordPieceTokenizer(vocab, args.lowercase, source="<trained>").save(args.output)
    elif args.model_type == "bpe":
        from bertjax.tokenization.bpe import TokenizersTokenizer, train_bpe

        trained = train_bpe(lines, args.vocab_size, lowercase=args.lowercase)
        path = TokenizersTokenizer(trained.to_str(), source="<trained>").save(args.output)
    else:
        from bertjax.tokenization.sentencepiece_tokenizer import SentencePieceTokenizer

        proto = train.train_sentencepiece(lines, args.vocab_size, args.sp_type, args.lowercase)
        path = SentencePieceTokenizer(proto, args.lowercase, source="<trained>").save(args.output)
    tok = load_tokenizer(args.output)
    return f"wrote {path} ({tok.vocab_size} entries, do_lower_case={tok.do_lower_case})"


def _tokenize(args) -> str:
    from bertjax.tokenization.loading import load_tokenizer

    if len(args.input) != 1:
        raise ValueError(f"--input: tokenize reads one file, got {len(args.input)}")
    if args.no_do_lower_case:
        if args.do_lower_case:
            raise ValueError("--no_do_lower_case: not allowed with --do_lower_case")
        args.do_lower_case = False
    tok = load_tokenizer(args.vocab, args.do_lower_case)
    input_file = args.input[0]
    lines = paths.text_lines(input_file, error=ValueError, hint=None)
    try:
        first = next(lines, None)  # opens the file
    except OSError as e:
        raise ValueError(f"--input {input_file}: {e.strerror}") from None
    n = 0
    with paths.open(args.output, "w", encoding="utf-8") as dst:
        batch: list[str] = []

        def flush():
            for tokens in tok.tokenize_batch(batch):
                ids = tok.convert_tokens_to_ids(tokens)
                dst.write(json.dumps({"tokens": tokens, "ids": ids}, ensure_ascii=False) + "\n")
            batch.clear()

        for number, line in itertools.chain([first] if first else [], lines):
            n = number
            batch.append(line.rstrip("\r\n"))
            if len(batch) >= BATCH:
                flush()
        flush()
    return f"wrote {n} lines to {args.output}"


# command → (function, required flags, optional flags)
COMMANDS = {
    "train": (_train, ("input", "vocab_size", "output"), ("model_type", "sp_type", "lowercase")),
    "tokenize": (_tokenize, ("vocab", "input", "output"), ("do_lower_case", "no_do_lower_case")),
}


def main(argv: Sequence[str]) -> None:
    """app.run's main: argv is [program, command], the flags are parsed."""
    function, args = cli.command_args(argv, COMMANDS)
    # VocabError and TrainError are DataErrors; a ValueError is a flag out of range.
    message = cli.report_errors(lambda: function(args), known=(ValueError,))
    if message:
        print(message)


if __name__ == "__main__":
    define_flags()
    cli.run(main)
