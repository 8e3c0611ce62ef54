r"""Convert BERT checkpoints to and from bertjax checkpoint directories.

  python -m bertjax.convert from_tf --checkpoint uncased_L-12_H-768_A-12/bert_model.ckpt \
      --config uncased_L-12_H-768_A-12/bert_config.json \
      --vocab uncased_L-12_H-768_A-12/vocab.txt --output checkpoints/bert_base_uncased
  python -m bertjax.convert from_hf --input hf/bert-base-uncased --output checkpoints/base
  python -m bertjax.convert from_hf --input st/all-MiniLM-L6-v2 --output checkpoints/minilm
  python -m bertjax.convert from_hf --input st/modernbert-embed --output checkpoints/membed
  python -m bertjax.convert to_hf --input checkpoints/base --output hf/base \
      [--architecture BertForPreTraining|BertForMaskedLM|BertModel]
  python -m bertjax.convert to_hf --input checkpoints/minilm --output st/minilm
  python -m bertjax.convert to_hf --input runs/mrpc --output hf/mrpc   # a fine-tuning workdir

A fine-tuning workdir is written as its task's transformers class (BertForSequenceClassification
with the label names, BertForMultipleChoice, BertForTokenClassification,
BertForQuestionAnswering) from its best checkpoint, or with --architecture=BertModel as the
fine-tuned encoder alone; the task's class also gets bertjax_task.json (the run's config and
task state), so `python -m bertjax.predict --export=DIR` / `bertjax.Predictor.from_export(DIR)`
predict with it.

A ModernBERT (config.json model_type "modernbert") goes both ways too: from_hf reads
transformers' ModernBertModel / ModernBertForMaskedLM / ModernBertFor* directory (a task head's
classifier is skipped and listed; its `head` kept as the MLM prediction head, as transformers
itself would load it) with its vocab.txt or tokenizer.json; to_hf writes a checkpoint directory
as ModernBertForMaskedLM (--architecture=ModernBertModel: the encoder alone) and a fine-tuning
workdir as its ModernBertForSequenceClassification / TokenClassification / QuestionAnswering /
MultipleChoice (num_labels, id2label, classifier_pooling, classifier_dropout) or, for an
embedding run, a ModernBertModel with the sentence-transformers modules.

A sentence-transformers directory (modules.json: a BERT or ModernBERT Transformer, a mean |
cls | max Pooling, an optional Normalize) is read by from_hf as its Transformer's weights (a
ModernBERT's with its vocab.txt or tokenizer.json) plus the pooling, kept as pooling.json
beside them (`BertForEmbedding(config, pooling)`, `Embedder.from_checkpoint` and `predict embed
--checkpoint` compute its vectors; its max_seq_length, prompts, default prompt name and
do_lower_case are reported and kept in conversion.json, where they apply as
sentence-transformers applies them). to_hf writes a checkpoint directory that has pooling.json
as a BertModel (a ModernBERT's: ModernBertModel) with the sentence-transformers modules and
those settings, so that `SentenceTransformer(DIR)` loads it. Other modules (Dense, ...) stop
with one line.

A sentence-transformers CrossEncoder directory (a BertForSequenceClassification with one label;
convert/cross_encoder.py) is read by from_hf as its BERT plus its classifier, kept as
classifier.npz beside the weights, its activation (sigmoid | identity) and max length in
conversion.json (`bertjax.Reranker.from_checkpoint` and `predict rerank --checkpoint` score
with them, the reranking family fine-tunes from them). to_hf writes such a directory, or a
reranking run, as a BertForSequenceClassification with the CrossEncoder files, so that
`CrossEncoder(DIR)` loads it.

from_tf and from_hf also take --do_lower_case/--nodo_lower_case, --seed and --overwrite;
to_hf takes --dtype and --overwrite. Every source tensor is either converted or listed as
skipped (optimizer state, tied copies, buffers, task heads); heads the source lacks are
initialised and listed. Any mismatch stops with one line naming the tensor.
"""

from __future__ import annotations

import collections
import json
from collections.abc import Sequence

import numpy as np
from absl import flags
from etils import epath

from bertjax import checkpoint_dir, cli
from bertjax.convert import cross_encoder, sentence_transformers
from bertjax.convert.mapping import ConversionError
from bertjax.models import ModelConfig
from bertjax.models import architecture as architecture_of
from bertjax.models.embedding import POOLING_FILE, Pooling, Prompts
from bertjax.train import multihost

SENTENCE_TRANSFORMERS = checkpoint_dir.SENTENCE_TRANSFORMERS
GROUP_NAMES = {
    "bert/pooler": "the pooler (bert/pooler)",
    "mlm": "the masked-LM head (mlm: cls/predictions)",
    "nsp": "the next-sentence head (nsp: cls/seq_relationship)",
    "head": "the MLM prediction head (head: dense, activation, norm)",
    "decoder_bias": "the MLM decoder's bias (decoder_bias)",
}


def define_flags() -> None:
    # Defined only when run as a program: modules imported together (e.g. by pytest) must not
    # compete for absl's global flag names.
    flags.DEFINE_string("checkpoint", None, "from_tf: PATH/bert_model.ckpt (the prefix).")
    flags.DEFINE_string("config", None, "from_tf: PATH/bert_config.json.")
    flags.DEFINE_string("vocab", None, "from_tf: PATH/vocab.txt; from_hf: default INPUT/vocab.txt.")
    flags.DEFINE_string("input", None, "from_hf: directory with config.json and weights; "
                        "to_hf: bertjax checkpoint directory or fine-tuning workdir.")
    flags.DEFINE_string("output", None, "Directory to write (from_*: a bertjax checkpoint, "
                        "to_hf: a Hugging Face directory).")
    flags.DEFINE_bool("do_lower_case", None, "from_*: default: the source's "
                      "tokenizer_config.json, else inferred from the vocabulary (upper-case "
                      "tokens: cased).")
    flags.DEFINE_integer("seed", 0, "from_*: seed for heads the source lacks (they are listed).")
    flags.DEFINE_bool("overwrite", False, "Replace the weights already in --output.")
    flags.DEFINE_enum("architecture", None,
                      ["BertForPreTraining", "BertForMaskedLM", "BertModel",
                       "ModernBertForMaskedLM", "ModernBertModel"], "to_hf: the model "
                      "class to write (default: BertForPreTraining, a ModernBERT's "
                      "ModernBertForMaskedLM; a checkpoint with pooling.json: BertModel; a "
                      "fine-tuning workdir: its task's class). A BERT name given for a "
                      "ModernBERT means its ModernBERT class.")
    flags.DEFINE_enum("dtype", "float32", ["float32", "bfloat16", "float16", "float64"],
                      "to_hf: dtype of the written weights.")


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
              f"{epath.Path(output) / checkpoint_dir.CONVERSION_FILE}")


def _count(params) -> tuple[int, int]:
    import jax

    leaves = jax.tree.leaves(params)
    return sum(int(np.size(x)) for x in leaves), len(leaves)


def _vocab_file(vocab: str, flag: str) -> epath.Path:
    """The vocabulary file, checked to exist before any weights are read. Its size is checked
    against the weights later (by save_pretrained), once the weights have been checked against
    the config, so a mismatch message blames the right file."""
    try:
        return checkpoint_dir.vocab_path(vocab)
    except ConversionError as e:
        raise ConversionError(f"{flag}: {e}") from e


def _import(args, config: ModelConfig, params, vocab, source: str, skipped, notes,
            do_lower_case: bool | None = None, sentence_model=None, classifier=None) -> None:
    # save_pretrained initialises (and reports) the head groups the source lacks.
    # sentence_model: a SentenceTransformer's settings (with its pooling), or a CrossEncoder's
    # (with its `classifier`).
    provenance = {"source": source, "skipped": skipped, "notes": notes}
    if sentence_model is not None:
        provenance[SENTENCE_TRANSFORMERS] = sentence_model.record()
    pooling = getattr(sentence_model, "pooling", None)
    if do_lower_case is None:
        do_lower_case = args.do_lower_case
    summary = checkpoint_dir.save_pretrained(
        args.output, config, params, vocab, do_lower_case=do_lower_case,
        provenance=provenance, seed=args.seed, overwrite=args.overwrite,
    )

    def write_heads():  # pooling.json and classifier.npz, or none: stale ones would mislead
        path = epath.Path(args.output) / POOLING_FILE
        if pooling is not None:
            path.write_text(json.dumps(pooling.to_dict(), indent=2) + "\n")
        elif path.exists():
            path.unlink()
        checkpoint_dir.save_classifier(args.output, classifier)

    multihost.write_from_main(write_heads)
    converted_params, converted_tensors = _count((params, classifier))
    _report(summary, args.output, converted_params, converted_tensors)
    if classifier is not None:
        print(f"cross-encoder: {sentence_model.activation} activation at predict "
              f"(max_seq_length={sentence_model.max_seq_length}); wrote its classifier to "
              f"{epath.Path(args.output) / checkpoint_dir.CLASSIFIER_FILE}")
    if pooling is not None:
        print(f"pooling: {_describe(sentence_model.pooling)} "
              f"(max_seq_length={sentence_model.max_seq_length}); wrote "
              f"{epath.Path(args.output) / POOLING_FILE}")
        if any(sentence_model.prompts.texts.values()):
            print(f"prompts: {_describe_prompts(sentence_model.prompts)}; kept in "
                  f"{epath.Path(args.output) / checkpoint_dir.CONVERSION_FILE}")


def _describe_prompts(prompts) -> str:
    named = ", ".join(f"{name} {text!r}" for name, text in prompts.texts.items())
    return f"{named} (default: {prompts.default_name or 'none'})"


def _describe(pooling) -> str:
    return pooling.mode + (", normalized" if pooling.normalize else "")


def from_tf(args) -> None:
    from bertjax.convert import tf_checkpoint

    config = tf_checkpoint.read_config(args.config)
    vocab = _vocab_file(args.vocab, "--vocab")
    params, skipped = tf_checkpoint.read_tf_checkpoint(args.checkpoint, config)
    notes = []
    if json.loads(epath.Path(args.config).read_text()).get("hidden_act", "gelu") == "gelu":
        notes.append("bert_config.json hidden_act='gelu' is the tanh approximation in Google's "
                     "code, so model.hidden_act='gelu_tanh'")
    _import(args, config, params, vocab, f"TF checkpoint {args.checkpoint}", skipped, notes)


def from_hf(args) -> None:
    """A transformers directory of any architecture with a conversion module (config.json's
    model_type: bert, modernbert), with its vocabulary: --vocab, else the directory's
    vocab.txt / *.model / tokenizer.json."""
    directory = epath.Path(args.input)
    if not directory.is_dir():
        raise ConversionError(f"--input {directory} is not a directory")
    if cross_encoder.is_cross_encoder(directory):
        return _from_cross_encoder(args, directory)
    if sentence_transformers.is_sentence_transformers(directory):
        return _from_sentence_transformers(args, directory)
    record = _hf_architecture(directory)
    vocab = _vocab_file(args.vocab or str(directory), "--vocab" if args.vocab else "--input")
    config, params, skipped = _conversion(record, directory).read_model(directory)
    notes = [] if record.name == "bert" else [f"vocabulary: {vocab}"]
    _import(args, config, params, vocab, f"Hugging Face {directory}", skipped, notes)


def _hf_architecture(directory: epath.Path):
    """The record of config.json's model_type (a BERT's where it has none or none readable:
    its reader then names the problem; transformers' BERT says "bert")."""
    from bertjax.models import ARCHITECTURES

    try:
        model_type = json.loads((directory / "config.json").read_text()).get("model_type")
    except (OSError, ValueError, AttributeError):
        model_type = None
    return ARCHITECTURES.get(model_type, ARCHITECTURES["bert"])


def _from_sentence_transformers(args, directory: epath.Path) -> None:
    """The Transformer module's BERT or ModernBERT, as from_hf converts it, and the pooling
    (pooling.json)."""
    import tempfile

    found = sentence_transformers.read_directory(directory)
    notes = _lower_case_note(found)
    read = _st_modern if found.model_type == "modernbert" else _st_bert
    with tempfile.TemporaryDirectory() as scratch:
        config, params, vocab, skipped, do_lower_case = read(args, found, notes,
                                                             epath.Path(scratch))
        _import(args, config, params, vocab, f"sentence-transformers {directory}", skipped,
                notes, do_lower_case=do_lower_case, sentence_model=found)


def _from_cross_encoder(args, directory: epath.Path) -> None:
    """A CrossEncoder's BERT as from_hf converts it, its one-label classifier kept
    (classifier.npz) with its activation and max length (conversion.json)."""
    import tempfile

    found = cross_encoder.read_directory(directory)
    notes = list(found.notes)
    with tempfile.TemporaryDirectory() as scratch:
        config, params, vocab, skipped, do_lower_case = _st_bert(
            args, found, notes, epath.Path(scratch), heads=("classifier",))
        head = cross_encoder.classifier(params, f"--input {directory}")
        encoder = {group: tree for group, tree in params.items() if group != "classifier"}
        _import(args, config, encoder, vocab, f"sentence-transformers CrossEncoder {directory}",
                skipped, notes, do_lower_case=do_lower_case, sentence_model=found,
                classifier=head)


def _lower_case_note(found) -> list[str]:
    """sentence-transformers' do_lower_case: the texts, not the tokenizer (whose own casing
    stays, accents included), as sentence-transformers lower-cases them."""
    if not found.do_lower_case:
        return []
    return [f"{found.transformer_directory / sentence_transformers.SBERT_CONFIG_FILE}: "
            "do_lower_case=true lower-cases the texts before the tokenizer; kept in "
            "conversion.json: the Embedder, predict embed / search and embedding fine-tuning "
            "do it too"]


def _st_bert(args, found, notes: list[str], scratch: epath.Path, heads: tuple[str, ...] = ()
             ) -> tuple:
    """(config, params, vocab, skipped, do_lower_case) of a sentence-transformers BERT: its
    vocab.txt, or (transformers 5 saves tokenizer.json alone) the WordPiece vocabulary of its
    tokenizer.json written to `scratch`, lower-cased as its tokenizer_config.json (or its
    normalizer) says; `heads`: its task heads to read too (a CrossEncoder's classifier)."""
    from bertjax.convert import huggingface

    weights = found.transformer_directory
    config = huggingface.read_config(weights)
    do_lower_case = args.do_lower_case
    tokenizer_json = weights / "tokenizer.json"
    if args.vocab:
        vocab = _vocab_file(args.vocab, "--vocab")
    elif (not (weights / checkpoint_dir.VOCAB_FILE).exists()
          and not any(weights.glob("*.model")) and tokenizer_json.exists()):
        tokens = sentence_transformers.wordpiece_vocab(tokenizer_json)
        vocab = scratch / checkpoint_dir.VOCAB_FILE
        vocab.write_text("".join(token + "\n" for token in tokens), encoding="utf-8")
        how = f"vocabulary: the WordPiece tokens of {tokenizer_json}"
        if do_lower_case is None:
            do_lower_case, source = sentence_transformers.tokenizer_lower_case(weights)
            if do_lower_case is not None:
                how += f"; do_lower_case={do_lower_case} from {source}"
        notes.append(how)
    else:
        vocab = _vocab_file(str(weights), "--input")
    params, skipped = huggingface.read_hf_checkpoint(weights, config, heads)
    return config, params, vocab, skipped, do_lower_case


def _st_modern(args, found, notes: list[str], scratch: epath.Path) -> tuple:
    """(config, params, vocab, skipped, do_lower_case) of a sentence-transformers ModernBERT:
    its encoder (as from_hf reads it) and its tokenizer (--vocab, else vocab.txt /
    *.model / tokenizer.json; a tokenizer.json lower-cases by its own normalizer)."""
    del scratch  # the tokenizer.json is kept as it is
    weights = found.transformer_directory
    vocab = _vocab_file(args.vocab or str(weights), "--vocab" if args.vocab else "--input")
    from bertjax.convert import modernbert

    config, params, skipped = modernbert.read_model(weights)
    notes.append(f"vocabulary: {vocab}")
    if not checkpoint_dir.is_tokenizer_json(vocab):
        return config, params, vocab, skipped, args.do_lower_case
    return config, params, vocab, skipped, None  # the tokenizer's normalizer decides


def to_hf(args) -> None:
    """A checkpoint directory as BertForPreTraining / a ModernBERT's ModernBertForMaskedLM
    (--architecture: another class; with pooling.json the encoder class and the
    sentence-transformers modules), or a fine-tuning workdir as its task's class."""
    directory = epath.Path(args.input)
    if (directory / "checkpoints").is_dir():
        return _finetuned_to_hf(args, directory)
    config = checkpoint_dir.load_config(directory)
    record = architecture_of(config)
    conversion = _conversion(record, directory)
    pooling = checkpoint_dir.load_pooling(directory)  # a sentence embedding model
    head = checkpoint_dir.load_classifier(directory)  # a converted cross-encoder
    default = (record.encoder_class if pooling is not None
               else record.hf_class("BertForSequenceClassification") if head is not None
               else record.hf_class("BertForPreTraining"))
    architecture = record.hf_class(args.architecture) if args.architecture else default
    reranker = head is not None and architecture == default
    if architecture not in conversion.CHECKPOINT_CLASSES:
        raise ConversionError(f"--architecture={args.architecture}: {record.title} checkpoint "
                              "directory is written as "
                              f"{' or '.join(conversion.CHECKPOINT_CLASSES)}")
    params = checkpoint_dir.load_params(directory, config)  # unrolled: transformers' layout
    if reranker:
        params = {**params, "classifier": head}
    vocab = checkpoint_dir.vocab_path(directory)
    do_lower_case = checkpoint_dir.load_do_lower_case(directory)
    max_seq_length = _sentence_max_seq_length(directory, config)
    # A converted model's own text settings, as it came; read before anything is written.
    prompts, lower_case = (checkpoint_dir.own_prompts(directory),
                           checkpoint_dir.own_lower_case(directory))
    activation = checkpoint_dir.own_activation(directory) or "sigmoid"  # a cross-encoder's

    def write():
        notes = _write_model(args, config, params, vocab, do_lower_case, architecture,
                             config.max_position_embeddings)
        if pooling is not None:
            sentence_transformers.write_modules(args.output, pooling, max_seq_length,
                                                lower_case, config.hidden_size, prompts)
        if reranker:
            cross_encoder.write_modules(args.output, activation, max_seq_length)
        return notes

    notes = multihost.write_from_main(write)
    _wrote(args, architecture, directory, notes)
    _report_sentence_transformers(args, pooling, notes, vocab, max_seq_length)
    _report_cross_encoder(args, activation if reranker else None, notes, max_seq_length)


def _conversion(record, source):
    """The conversion module of an architecture (`Architecture.conversion`): read_export,
    write_model, CHECKPOINT_CLASSES."""
    import importlib

    if record.conversion is None:
        raise ConversionError(f"{source}: {record.title} has no transformers conversion")
    return importlib.import_module(record.conversion)


def _write_model(args, config, params, vocab: epath.Path, do_lower_case: bool,
                 architecture: str, max_length: int, **task_fields) -> list[str]:
    """config.json, the weights (--dtype) and the tokenizer of `architecture` at --output
    (its architecture's conversion module); task_fields: labels, problem_type, extra_config of
    a task head. Returns notes for the user. max_length: the tokenizer's model_max_length."""
    conversion = _conversion(architecture_of(config), args.output)
    return conversion.write_model(args.output, config, params, vocab, do_lower_case,
                                  architecture, max_length, dtype=args.dtype,
                                  overwrite=args.overwrite, **task_fields)


def _report_sentence_transformers(args, pooling: Pooling | None, notes: list[str] | None,
                                  vocab: epath.Path, max_seq_length: int) -> None:
    """The line that says --output is also a sentence-transformers model (on the process that
    wrote it: notes is not None)."""
    if pooling is None or notes is None:
        return
    if checkpoint_dir.is_sentencepiece(vocab):
        print(f"note: wrote the sentence-transformers modules ({_describe(pooling)} "
              "pooling), but SentenceTransformer needs a tokenizer transformers reads")
    else:
        print(f"sentence-transformers: {_describe(pooling)} pooling, "
              f"max_seq_length={max_seq_length}; SentenceTransformer({args.output}) loads it")


def _report_cross_encoder(args, activation: str | None, notes: list[str] | None,
                          max_seq_length: int) -> None:
    """The line that says --output is a sentence-transformers CrossEncoder (on the process
    that wrote it: notes is not None)."""
    if activation is not None and notes is not None:
        print(f"sentence-transformers: CrossEncoder, {activation} activation at predict, "
              f"max_length={max_seq_length}; CrossEncoder({args.output}) loads it")


def _sentence_max_seq_length(directory: epath.Path, config: ModelConfig) -> int:
    """The max_seq_length a converted sentence-transformers model had (conversion.json), else
    the position embeddings' length."""
    own = checkpoint_dir.own_max_seq_length(directory)
    return min(own or config.max_position_embeddings, config.max_position_embeddings)


def _wrote(args, architecture: str, source, notes: list[str] | None) -> None:
    if notes is None:  # not the process that wrote
        return
    print(f"wrote {args.output}: {architecture} ({args.dtype}) from {source}")
    for note in notes:
        print(f"note: {note}")


def _finetuned_to_hf(args, workdir: epath.Path) -> None:
    """A fine-tuning workdir: its best checkpoint (results.json), as export.json describes,
    as its task's class (BertFor* / ModernBertFor*) with the task record, or with
    --architecture=BertModel (ModernBertModel) as the fine-tuned encoder alone; an embedding
    run as the encoder class with the sentence-transformers modules."""
    from bertjax.models import layout
    from bertjax.serving.runs import TASK_FILE, read_finished_run, run_vocab, task_record
    from bertjax.train.checkpoints import read_params

    record, step = read_finished_run(workdir, ConversionError, "--input")
    if record.get("architecture") is None:
        raise ConversionError(f"--input {workdir}: {record.get('why', 'not exportable')}")
    kind = architecture_of(record.get("model") or {})
    encoder = kind.encoder_class
    requested = args.architecture
    architecture = kind.hf_class(requested) if requested else record["architecture"]
    if architecture not in (record["architecture"], encoder):
        raise ConversionError(f"--architecture={args.architecture}: a {record['architecture']} "
                              f"fine-tuning run is written as that class or as {encoder}")
    params = read_params(str(workdir), step)
    if kind.scans_layers:  # transformers' layout is per layer
        config = kind.config_class.from_dict({**record["model"], "scan_layers": False})
        params = layout.to_layout(params, scan_layers=False)
    else:
        config = kind.config_class.from_dict(record["model"])
    task = task_record(workdir, ConversionError, "--input")
    pooling = Pooling.from_dict(record["pooling"]) if record.get("pooling") else None
    max_seq_length = int(task["config"]["max_seq_length"])
    state = task["task"] or {}  # an embedding run's: the prompts it trained with, lower_case
    prompts = Prompts.from_dict(state) if pooling is not None else None
    # A reranking run's CrossEncoder settings, unless only its encoder is written.
    reranker = record.get("cross_encoder") if architecture != encoder else None
    vocab = run_vocab(workdir, record)

    def write():
        notes = _write_model(args, config, params, vocab, record["do_lower_case"], architecture,
                             max_seq_length, labels=record.get("labels", ()),
                             problem_type=record.get("problem_type"),
                             extra_config=record.get("extra_config"))
        # The task record (bertjax.Predictor / Embedder.from_export): a task head's class, or
        # a sentence embedding model (the encoder and its pooling).
        if architecture != encoder or pooling is not None:
            (epath.Path(args.output) / TASK_FILE).write_text(json.dumps(task, indent=2) + "\n")
        if pooling is not None:
            sentence_transformers.write_modules(
                args.output, pooling, max_seq_length, state.get("lower_case") is True,
                config.hidden_size, prompts)
        if reranker:
            cross_encoder.write_modules(args.output, reranker["activation"], max_seq_length)
        return notes

    notes = multihost.write_from_main(write)
    _wrote(args, architecture, f"{workdir} (best step {step})", notes)
    _report_sentence_transformers(args, pooling, notes, epath.Path(vocab), max_seq_length)
    _report_cross_encoder(args, reranker and reranker["activation"], notes, max_seq_length)


# command → (function, required flags, optional flags)
COMMANDS = {
    "from_tf": (from_tf, ("checkpoint", "config", "vocab", "output"),
                ("do_lower_case", "seed", "overwrite")),
    "from_hf": (from_hf, ("input", "output"), ("vocab", "do_lower_case", "seed", "overwrite")),
    "to_hf": (to_hf, ("input", "output"), ("architecture", "dtype", "overwrite")),
}


def main(argv: Sequence[str]) -> None:
    """app.run's main: argv is [program, command], the flags are parsed."""
    function, args = cli.command_args(argv, COMMANDS)
    cli.report_errors(lambda: function(args))  # ConversionError, ConfigError, VocabError


if __name__ == "__main__":
    define_flags()
    cli.run(main)
