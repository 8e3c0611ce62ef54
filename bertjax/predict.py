r"""Use a trained model: predictions of a finished fine-tuning run on new rows, or the
masked-word predictions of a pre-trained checkpoint.

  python -m bertjax.predict --workdir=runs/mrpc --input=new.tsv --output=preds.jsonl \
      [--text_a=sentence1 --text_b=sentence2] [--batch_size=64]
  python -m bertjax.predict --workdir=runs/squad1 --input=questions.jsonl --output=answers.jsonl
  python -m bertjax.predict --workdir=runs/ner --input=new.conll --output=tagged.conll
  python -m bertjax.predict --export=hf/mrpc --input=new.tsv --output=preds.jsonl  # to_hf DIR
  python -m bertjax.predict --workdir=runs/mrpc --dry_run [--topology=v5e-8] [--batch_size=256]
  python -m bertjax.predict fill_mask --checkpoint=runs/demo/export \
      "the capital of france is [MASK]." [--top_k=5]
  python -m bertjax.predict embed --checkpoint=checkpoints/minilm --input=texts.jsonl \
      --output=vectors.npy [--text_a=text --id=id] [--chunk_rows=100000]
  python -m bertjax.predict search --workdir=runs/qa_embed --corpus=passages.jsonl \
      --queries=questions.jsonl --output=hits.jsonl [--top_k=10]

--input: .csv / .tsv / .jsonl rows (classification, regression, multiple choice; field flags
as the users'-files configs, default the run's config.data), SQuAD-layout .json or .jsonl
{question, context[, id]} (SQuAD), CoNLL columns or .jsonl {tokens} (tagging); UTF-8 unless
--encoding names another (default: the run's config.data.encoding). --output: one
JSON record a line in input order (classification: {id, label, probabilities}; regression:
{id, score}; multiple choice: {id, choice, scores}; SQuAD: {id, answer, start, end, score,
nbest[, null_odds, threshold]}; tagging: {id, tokens, tags}), or for tagging a `.conll` file
(`word tag`, `word gold tag` when the input has tags). An input with gold labels also prints
the task's metrics. --chunk_rows=N streams the input N rows at a time (a corpus larger than
memory: CSV / TSV / JSONL rows, SQuAD .json read incrementally, CoNLL / JSONL tagging files cut
where a document starts; bitwise the same output, no metrics). On a pod slice (--distributed)
every process computes its share of each batch and process 0 writes. On a machine with no
accelerator the CPU is split into one JAX device per core (at most 4; --cpu_devices), whole
batches on each in turn: bitwise the predictions of one device, sooner.

embed and search take an embedding run (--workdir, --export) or any bertjax checkpoint
directory (--checkpoint: a converted sentence-transformers model pools as it did, another BERT
by the mean of its tokens; --pooling / --normalize override). embed writes the vectors as a
float32 .npy [rows, hidden] and their ids beside it (NAME.ids.jsonl, one JSON string a line;
the --id column, else the row number). search embeds --corpus and --queries (the same
--text_a / --id columns) and writes, per query, {id, hits: [{id, score}]}, the --top_k corpus
rows of highest cosine, by exact search.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from absl import flags

from bertjax import cli

FIELD_FLAGS = ("text_a", "text_b", "label", "choices", "id", "question", "context",
               "tokens_key", "tags_key")


def define_flags() -> None:
    # Defined only when run as a program: modules imported together (e.g. by pytest) must not
    # compete for absl's global flag names.
    flags.DEFINE_string("workdir", None, "A finished fine-tuning workdir.")
    flags.DEFINE_string("export", None, "Instead of --workdir: its transformers export "
                        "(python -m bertjax.convert to_hf --input=WORKDIR --output=DIR).")
    flags.DEFINE_string("input", None, "Rows to predict: .csv | .tsv | .jsonl | .json | .conll.")
    flags.DEFINE_string("output", None, "Predictions: .jsonl (or .conll for tagging).")
    flags.DEFINE_integer("batch_size", None, "Rows per global batch at 128 tokens and longer, "
                         "2, 4, ... times as many at 64, 32, ... (default: the rows of the run's "
                         "evaluations, which reproduces its predictions bitwise: "
                         "config.eval.batch_size, on a CPU at most 8).")
    flags.DEFINE_string("dtype", None, "Compute dtype (default: the run's).")
    flags.DEFINE_integer("chunk_rows", 0, "Stream the input this many rows at a time "
                         "(memory independent of its size; the same output, no metrics): "
                         ".csv, .tsv, .jsonl, SQuAD .json, CoNLL; 0: the whole file.")
    for name in FIELD_FLAGS:
        flags.DEFINE_string(name, None, f"Input field {name} (default: the run's config.data).")
    flags.DEFINE_enum("format", None, ["auto", "conll", "jsonl"], "Tagging input format.")
    flags.DEFINE_string("encoding", None, "The input's text encoding, e.g. latin-1, cp1252 "
                        "(default: the run's config.data.encoding, else utf-8).")
    flags.DEFINE_integer("token_column", None, "Tagging CoNLL input: the word column.")
    flags.DEFINE_integer("tag_column", None, "Tagging CoNLL input: the gold tag column.")
    flags.DEFINE_bool("dry_run", False, "With --workdir: compile the predict step for each "
                      "batch shape and print per-device memory, FLOPs (and with --topology "
                      "step time and sequences/s per chip); read no checkpoint, no input.")
    flags.DEFINE_string("topology", None, "With --dry_run: compile for this Cloud TPU slice "
                        "with the TPU compiler, on any machine (e.g. v5e-8, v5p-32).")
    cli.define_cpu_devices_flag()
    cli.define_compilation_cache_flag()
    flags.DEFINE_string("checkpoint", None, "fill_mask, embed, search: a bertjax checkpoint "
                        "directory.")
    flags.DEFINE_integer("top_k", None, "fill_mask: candidates per [MASK] (default 5); "
                         "search: hits per query (default 10).")
    flags.DEFINE_integer("max_seq_length", None, "fill_mask, and embed / search with "
                         "--checkpoint: tokens per text (default: the model's own, a "
                         "converted sentence-transformers model's max_seq_length, else 128).")
    flags.DEFINE_enum("pooling", None, ["mean", "cls", "max"], "embed, search with "
                      "--checkpoint: pooling (default: the checkpoint's pooling.json, else mean).")
    flags.DEFINE_bool("normalize", None, "embed, search with --checkpoint: unit-length vectors "
                      "(default: the checkpoint's pooling.json, else no).")
    flags.DEFINE_string("corpus", None, "search: the texts searched (.csv | .tsv | .jsonl).")
    flags.DEFINE_string("queries", None, "search: the query texts (.csv | .tsv | .jsonl).")
    cli.define_distributed_flags()


def fill_mask(texts: Sequence[str]) -> None:
    f = flags.FLAGS
    if not f.checkpoint:
        sys.exit("error: fill_mask: --checkpoint is required")
    if not texts:
        sys.exit('error: fill_mask: give one or more texts with [MASK], e.g. "the capital of '
                 'france is [MASK]."')
    top_k = 5 if f.top_k is None else f.top_k
    if top_k < 1:
        sys.exit(f"error: --top_k={top_k} must be positive")
    from bertjax.serving.fill_mask import FillMask
    from bertjax.train import multihost

    filler = FillMask.from_checkpoint(f.checkpoint, f.max_seq_length or 128, dtype=f.dtype)
    results = filler(list(texts), top_k=top_k)  # every process: the batches are collective
    if not multihost.is_main():
        return
    for text, masks in zip(texts, results):
        print(text)
        for mask in masks:
            shown = ", ".join(f"{c['word']} {c['probability']:.3f}" for c in mask["candidates"])
            print(f"  [MASK] at token {mask['position']}: {shown}")


def embedder():
    """The Embedder of --workdir, --export or --checkpoint (exactly one)."""
    from bertjax.models.embedding import Pooling
    from bertjax.serving.embedder import Embedder

    f = flags.FLAGS
    sources = [name for name in ("workdir", "export", "checkpoint") if f[name].value]
    if len(sources) != 1:
        sys.exit("error: give one of --workdir (an embedding run), --export (its convert to_hf "
                 "directory) or --checkpoint (a bertjax checkpoint directory)")
    devices = cli.turn_devices()
    if f.checkpoint:
        pooling = None
        if f.pooling is not None or f.normalize is not None:
            from bertjax.checkpoint_dir import load_pooling

            stored = load_pooling(f.checkpoint) or Pooling()
            pooling = Pooling(f.pooling or stored.mode,
                              stored.normalize if f.normalize is None else f.normalize)
        return Embedder.from_checkpoint(f.checkpoint, f.max_seq_length, pooling, f.batch_size,
                                        f.dtype, devices)
    if f.pooling is not None or f.normalize is not None:
        sys.exit("error: --pooling / --normalize apply to --checkpoint; a run pools as it "
                 "was trained")
    if f.workdir:
        return Embedder.from_workdir(f.workdir, f.batch_size, f.dtype, devices)
    return Embedder.from_export(f.export, f.batch_size, f.dtype, devices)


def text_fields() -> dict:
    f = flags.FLAGS
    return {"text_a": f.text_a, "id": f.id, "encoding": f.encoding}


def embed(args: Sequence[str]) -> None:
    from bertjax import paths
    from bertjax.serving.embedder import VectorFile, check_vectors_path, ids_path
    from bertjax.train import multihost

    f = flags.FLAGS
    if args:
        sys.exit(f"error: embed: unexpected arguments {list(args)}; give --input=FILE")
    for name in ("input", "output"):
        if not f[name].value:
            sys.exit(f"error: embed: --{name} is required")
    if f.chunk_rows < 0:
        sys.exit(f"error: --chunk_rows={f.chunk_rows} must be 0 or positive")
    check_vectors_path(f.output)  # before the model is loaded
    if not paths.exists(f.input):
        sys.exit(f"error: --input={f.input}: no such file")
    model = embedder()
    out = multihost.write_from_main(lambda: VectorFile(f.output))
    try:
        for ids, vectors in model.embed_file(f.input, text_fields(), f.chunk_rows):
            multihost.write_from_main(lambda ids=ids, vectors=vectors: out.write(ids, vectors))
    except BaseException:
        if out is not None:
            out.abort()
        raise
    multihost.write_from_main(out.close if out is not None else lambda: None)
    if multihost.is_main():
        print(f"wrote {out.rows} vectors [{out.rows}, {out.hidden}] to {f.output}, their ids "
              f"to {ids_path(f.output)} ({model.pooling.mode} pooling"
              f"{', normalised' if model.pooling.normalize else ''}; "
              f"{model.engine.trained.workdir})")


def search(args: Sequence[str]) -> None:
    import numpy as np

    from bertjax import paths
    from bertjax.tasks.chunks import dump
    from bertjax.train import multihost

    f = flags.FLAGS
    if args:
        sys.exit(f"error: search: unexpected arguments {list(args)}; give --queries=FILE")
    for name in ("corpus", "queries", "output"):
        if not f[name].value:
            sys.exit(f"error: search: --{name} is required")
    top_k = 10 if f.top_k is None else f.top_k
    if top_k < 1:
        sys.exit(f"error: --top_k={top_k} must be positive")
    for name in ("corpus", "queries"):  # before the model loads and the corpus is embedded
        if not paths.exists(f[name].value):
            sys.exit(f"error: --{name}={f[name].value}: no such file")
    model = embedder()

    def embedded(path):
        ids, vectors = [], []
        for chunk_ids, chunk in model.embed_file(path, text_fields(), f.chunk_rows):
            ids += chunk_ids
            vectors.append(chunk)
        return ids, np.concatenate(vectors)

    # The queries first: a bad queries file stops the run before the (larger) corpus is embedded.
    query_ids, queries = embedded(f.queries)
    corpus_ids, corpus = embedded(f.corpus)
    scores, rows = model.search(queries, corpus, top_k)

    def write():
        with paths.open(f.output, "w", encoding="utf-8") as out:
            for q, query in enumerate(query_ids):
                hits = [{"id": corpus_ids[r], "score": round(float(s), 6)}
                        for s, r in zip(scores[q], rows[q])]
                out.write(dump({"id": query, "hits": hits}) + "\n")

    multihost.write_from_main(write)
    if multihost.is_main():
        print(f"wrote the top {min(top_k, len(corpus_ids))} of {len(corpus_ids)} corpus rows "
              f"for {len(query_ids)} queries to {f.output}")


def dry_run() -> None:
    from bertjax.aot.inference import inference_costs, inference_table

    f = flags.FLAGS
    if not f.workdir:
        sys.exit("error: --dry_run needs --workdir (a finished fine-tuning run)")
    costs, chips, header = inference_costs(f.workdir, f.topology, f.batch_size, f.dtype)
    print(header)
    for line in inference_table(costs, chips):
        print(line)


def predict() -> None:
    from bertjax.serving.predictor import Predictor
    from bertjax.tasks.chunks import dump
    from bertjax.train import multihost

    f = flags.FLAGS
    if f.dry_run:
        return dry_run()
    if f.topology:
        sys.exit("error: --topology needs --dry_run")
    if bool(f.workdir) == bool(f.export):
        sys.exit("error: give one of --workdir (a finished fine-tuning run) or --export (its "
                 "convert to_hf directory)")
    for name in ("input", "output"):
        if not f[name].value:
            sys.exit(f"error: --{name} is required")
    fields = {name: f[name].value for name in FIELD_FLAGS + ("format", "token_column",
                                                             "tag_column", "encoding")}
    devices = cli.turn_devices()
    predictor = (Predictor.from_workdir(f.workdir, f.batch_size, f.dtype, devices) if f.workdir
                 else Predictor.from_export(f.export, f.batch_size, f.dtype, devices))
    conll = f.output.endswith(".conll")
    if conll and not hasattr(predictor.task, "conll_text"):
        sys.exit(f"error: --output={f.output}: a .conll output is for tagging runs; use .jsonl")

    def text(examples, records, labelled) -> str:
        if conll:
            gold = [list(s.tags) for s in examples] if labelled else None
            return predictor.task.conll_text(examples, gold, [r["tags"] for r in records])
        return "".join(dump(r) + "\n" for r in records)

    def append(examples, records, labelled, mode="a"):
        from bertjax import paths

        with paths.open(f.output, mode, encoding="utf-8") as out:
            if records:
                out.write(text(examples, records, labelled))

    metrics = None
    if f.chunk_rows:
        multihost.write_from_main(lambda: append([], [], False, "w"))  # empty, then appended
        count = predictor.predict_stream(f.input, append, fields, f.chunk_rows)
    else:
        examples, records, metrics = predictor.predict_file(f.input, fields)
        multihost.write_from_main(lambda: append(examples, records, metrics is not None, "w"))
        count = len(records)
    if multihost.is_main():
        where = f"; {len(devices)} CPU devices, whole batches in turn" if devices else ""
        print(f"wrote {count} predictions to {f.output} (best step "
              f"{predictor.trained.step} of {f.workdir or f.export}; "
              f"{predictor.last_padding}{where})")
        if metrics is not None:
            print("metrics: " + ", ".join(f"{k} {v:.4f}" for k, v in metrics.items()))


def main(argv: Sequence[str]) -> None:
    cli.initialize_distributed()  # before anything touches a JAX backend
    if not flags.FLAGS.dry_run:  # a dry run's TPU programs cannot be read back on this host
        cli.use_compilation_cache()
    commands = {"fill_mask": fill_mask, "embed": embed, "search": search}
    if len(argv) > 1 and argv[1] in commands:
        return commands[argv[1]](argv[2:])
    if len(argv) > 1:
        sys.exit(f"error: unexpected arguments {argv[1:]}; flags are --name=value (or a "
                 f"command: {' | '.join(commands)})")
    return predict()


if __name__ == "__main__":
    cli.run(main, define_flags)
