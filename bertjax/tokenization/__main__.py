"""Command line for tokenization.

  python -m bertjax.tokenization train --input 'corpus/*.txt' --vocab_size 30522 \
      --model_type wordpiece|sentencepiece [--sp_type unigram|bpe] [--lowercase] --output DIR
  python -m bertjax.tokenization tokenize --vocab PATH [--do_lower_case|--no_do_lower_case] \
      --input FILE --output FILE          # one JSON line {"tokens": [...], "ids": [...]}
  python -m bertjax.tokenization bench [--input 'files*'] [--vocab vocab.txt] [--mb 10]

Every bad input stops with one line naming the file or flag.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

BATCH = 4096  # lines tokenized per tokenize_batch call


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line instead of usage + message
        self.exit(2, f"error: {self.prog}: {message}\n")


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="python -m bertjax.tokenization")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    t = sub.add_parser("train", help="train a WordPiece or SentencePiece vocabulary")
    t.add_argument("--input", action="append", required=True,
                   help="glob(s) of UTF-8 text files, comma-separated or repeated")
    t.add_argument("--vocab_size", type=int, required=True)
    t.add_argument("--model_type", choices=("wordpiece", "sentencepiece"), default="wordpiece")
    t.add_argument("--sp_type", choices=("unigram", "bpe"), default="unigram",
                   help="SentencePiece algorithm")
    t.add_argument("--lowercase", action="store_true", help="uncased vocabulary")
    t.add_argument("--output", required=True, help="directory to write")

    k = sub.add_parser("tokenize", help="tokenize a text file into JSON lines")
    k.add_argument("--vocab", required=True, help="vocab.txt, *.model or a directory")
    case = k.add_mutually_exclusive_group()
    case.add_argument("--do_lower_case", dest="do_lower_case", action="store_true",
                      default=None)
    case.add_argument("--no_do_lower_case", dest="do_lower_case", action="store_false")
    k.add_argument("--input", required=True)
    k.add_argument("--output", required=True)

    b = sub.add_parser("bench", help="tokens/s vs HF tokenizers on one core")
    b.add_argument("--input", action="append", help="text files (default: fetched English)")
    b.add_argument("--vocab", help="vocab.txt (default: one trained on the text)")
    b.add_argument("--mb", type=float, default=10.0, help="megabytes of text to use")
    b.add_argument("--exact_mb", type=float, default=1.0,
                   help="megabytes for the (slow) exact path")
    return parser


def _train(args) -> str:
    from bertjax.tokenization import train
    from bertjax.tokenization.loading import load_tokenizer

    if args.vocab_size <= 0:
        raise train.TrainError(f"--vocab_size must be positive, got {args.vocab_size}")
    lines = train.read_lines(train.expand_inputs(args.input))
    os.makedirs(args.output, exist_ok=True)
    if args.model_type == "wordpiece":
        vocab = train.train_wordpiece(lines, args.vocab_size, lowercase=args.lowercase)
        from bertjax.tokenization.wordpiece import WordPieceTokenizer

        path = WordPieceTokenizer(vocab, args.lowercase, source="<trained>").save(args.output)
    else:
        from bertjax.tokenization.sentencepiece_tokenizer import SentencePieceTokenizer

        proto = train.train_sentencepiece(lines, args.vocab_size, args.sp_type, args.lowercase)
        path = SentencePieceTokenizer(proto, args.lowercase, source="<trained>").save(args.output)
    tok = load_tokenizer(args.output)
    return f"wrote {path} ({tok.vocab_size} entries, do_lower_case={tok.do_lower_case})"


def _tokenize(args) -> str:
    from bertjax.tokenization.loading import load_tokenizer

    tok = load_tokenizer(args.vocab, args.do_lower_case)
    try:
        src = open(args.input, "rb")
    except OSError as e:
        raise ValueError(f"--input {args.input}: {e.strerror}") from None
    n = 0
    with src, open(args.output, "w", encoding="utf-8") as dst:
        batch: list[str] = []

        def flush():
            for tokens in tok.tokenize_batch(batch):
                ids = tok.convert_tokens_to_ids(tokens)
                dst.write(json.dumps({"tokens": tokens, "ids": ids}, ensure_ascii=False) + "\n")
            batch.clear()

        for n, raw in enumerate(src, 1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise ValueError(
                    f"{args.input}:{n}: invalid UTF-8 at byte {e.start} of the line") from None
            batch.append(line.rstrip("\r\n"))
            if len(batch) >= BATCH:
                flush()
        flush()
    return f"wrote {n} lines to {args.output}"


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    from bertjax.tokenization.train import TrainError
    from bertjax.tokenization.wordpiece import VocabError

    try:
        if args.command == "train":
            print(_train(args))
        elif args.command == "tokenize":
            print(_tokenize(args))
        else:
            from bertjax.tokenization import bench

            bench.run(args.input, args.vocab, args.mb, args.exact_mb)
    except (VocabError, TrainError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except OSError as e:
        print(f"error: {e.filename or ''}: {e.strerror}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
