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
  python -m bertjax.predict mine --checkpoint=checkpoints/minilm --pairs=train.jsonl \
      --output=mined.jsonl [--corpus=more.jsonl] [--num_negatives=3] [--relative_margin=0.05]
  python -m bertjax.predict rerank --workdir=runs/rerank --input=candidates.jsonl \
      --output=reranked.jsonl [--top_k=10]

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
rows of highest cosine, by exact search. Prompts apply as sentence-transformers applies them:
embed prepends the model's default prompt (encode's; --prompt_name=NAME: one of its prompts,
--prompt=TEXT: that text, "" none), search the model's "query" prompt to the queries and its
"document" prompt to the corpus (encode_query / encode_document's; --query_prompt_name,
--query_prompt, --corpus_prompt_name, --corpus_prompt say otherwise).

mine (the same models) adds hard negatives to (anchor, positive) rows: --pairs, columns
--text_a / --text_b (default anchor, positive). Per anchor, the --num_negatives texts nearest
to it by exact search (sharded over every device) among the positives and the --corpus
file's `text` column, each text once, but not its positives or itself, none above --max_score
or within --margin / --relative_margin of its lowest positive score, after the first
--range_min, among the first --range_max (sentence-transformers' mine_hard_negatives; the
anchors take the model's query prompt, the texts its document prompt). It writes the rows
with columns negative_1 .. negative_N (.jsonl / .csv / .tsv as --output), what the pairs
config reads; the rows of an anchor left with too few negatives are dropped.

rerank takes a reranking run (--workdir, --export) or a checkpoint directory converted from a
sentence-transformers CrossEncoder (--checkpoint; --max_seq_length overrides its own). --input:
JSONL, one query a line, {"id", "query", "candidates": [{"id", "text", "relevant"}, ...]} ("id"s
optional: row and position numbers; a candidate may be its text alone; "relevant" optional,
bertjax/tasks/reranking/readers.py). It writes, per line, {id, candidates: [{id, score}]} best
first (--top_k: the first k), each score as CrossEncoder.predict gives it (the model's
activation of its logit); an input with "relevant" judgements also prints nDCG@10 and MRR@10,
reranked and in the input's order.
"""

from __future__ import annotations

import functools
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
    flags.DEFINE_string("checkpoint", None, "fill_mask, embed, search, mine, rerank: a bertjax "
                        "checkpoint directory.")
    flags.DEFINE_integer("top_k", None, "fill_mask: candidates per [MASK] (default 5); "
                         "search: hits per query (default 10); rerank: candidates kept per "
                         "query (default all).")
    flags.DEFINE_integer("max_seq_length", None, "fill_mask, and embed / search / rerank with "
                         "--checkpoint: tokens per text, a pair for rerank (default: the "
                         "model's own, a converted sentence-transformers model's "
                         "max_seq_length, else 128).")
    flags.DEFINE_enum("pooling", None, ["mean", "cls", "max"], "embed, search with "
                      "--checkpoint: pooling (default: the checkpoint's pooling.json, else mean).")
    flags.DEFINE_bool("normalize", None, "embed, search with --checkpoint: unit-length vectors "
                      "(default: the checkpoint's pooling.json, else no).")
    flags.DEFINE_string("corpus", None, "search: the texts searched (.csv | .tsv | .jsonl).")
    flags.DEFINE_string("queries", None, "search: the query texts (.csv | .tsv | .jsonl).")
    flags.DEFINE_string("pairs", None, "mine: (anchor, positive) rows (.csv | .tsv | .jsonl; "
                        "columns --text_a, --text_b, default anchor, positive); --corpus: "
                        "more texts to search (column text).")
    flags.DEFINE_integer("num_negatives", 3, "mine: hard negatives a row.")
    flags.DEFINE_integer("range_min", 0, "mine: skip this many of the nearest candidates left.")
    flags.DEFINE_integer("range_max", None, "mine: candidates among this many nearest texts "
                         "(the anchor's positives aside; default range_min + num_negatives, "
                         "10 a negative with a margin or --max_score).")
    flags.DEFINE_float("margin", None, "mine: drop candidates scoring above the anchor's "
                       "lowest positive score minus this.")
    flags.DEFINE_float("relative_margin", None, "mine: drop candidates scoring above positive "
                       "- |positive| * this (0.05 is NV-Retriever's TopK-PercPos 95%).")
    flags.DEFINE_float("max_score", None, "mine: drop candidates scoring above this.")
    flags.DEFINE_string("prompt_name", None, "embed: the model's prompt of this name before "
                        "each text (default: its default prompt, as sentence-transformers' "
                        "encode).")
    flags.DEFINE_string("prompt", None, "embed: this text before each text, instead of the "
                        "model's prompts (\"\": none).")
    for side, role in (("query", "query"), ("corpus", "document")):
        flags.DEFINE_string(f"{side}_prompt_name", None, f"search, mine (anchors are its "
                            f"queries): the model's prompt of this name before each {side} text "
                            f"(default: its \"{role}\" prompt, as encode_{role}).")
        flags.DEFINE_string(f"{side}_prompt", None, f"search, mine: this text before each "
                            f"{side} text, instead of the model's prompts (\"\": none).")
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
                              stored.normalize if f.normalize is None else f.normalize,
                              stored.include_prompt)
        return Embedder.from_checkpoint(f.checkpoint, f.max_seq_length, pooling, f.batch_size,
                                        f.dtype, devices)
    if f.pooling is not None or f.normalize is not None:
        sys.exit("error: --pooling / --normalize apply to --checkpoint; a run pools as it "
                 "was trained")
    if f.workdir:
        return Embedder.from_workdir(f.workdir, f.batch_size, f.dtype, devices)
    return Embedder.from_export(f.export, f.batch_size, f.dtype, devices)


# Each command's prompt flags (--NAME_name: one of the model's prompts, --NAME: the text).
PROMPT_FLAGS = {"embed": ("prompt",), "search": ("query_prompt", "corpus_prompt"),
                "mine": ("query_prompt", "corpus_prompt")}  # mine: anchors are its queries


def check_prompt_flags(command: str) -> None:
    """Before the model loads: no other command's prompt flag, no name and text together."""
    f = flags.FLAGS
    for other, names in PROMPT_FLAGS.items():
        given = [f"--{n}{end}" for n in names for end in ("_name", "")
                 if n not in PROMPT_FLAGS[command] and f[n + end].value is not None]
        if given:
            sys.exit(f"error: {command}: {given[0]} is a flag of {other}")
    for flag in PROMPT_FLAGS[command]:
        if f[flag + "_name"].value is not None and f[flag].value is not None:
            sys.exit(f"error: give --{flag}_name or --{flag}, not both")


def prompt_text(model, flag: str, role: str | None) -> str:
    """The text to prepend to each text: --FLAG, else the model's prompt --FLAG_name, else
    the model's own for `role` (None: its default prompt), as sentence-transformers."""
    f = flags.FLAGS
    return model.prompts.text(f[flag + "_name"].value, f[flag].value, role,
                              where=f"--{flag}_name")


def check_arguments(command: str, args: Sequence[str], usage: str,
                    required: Sequence[str]) -> None:
    """A subcommand's command line before anything loads: no stray arguments, every required
    flag given (one `error:` line)."""
    f = flags.FLAGS
    if args:
        sys.exit(f"error: {command}: unexpected arguments {list(args)}; give {usage}")
    for name in required:
        if not f[name].value:
            sys.exit(f"error: {command}: --{name} is required")


def check_files(*names: str) -> None:
    """The input files of flags `names` (those given) exist, before the model loads."""
    from bertjax import paths

    f = flags.FLAGS
    for name in names:
        if f[name].value and not paths.exists(f[name].value):
            sys.exit(f"error: --{name}={f[name].value}: no such file")


def text_fields() -> dict:
    f = flags.FLAGS
    return {"text_a": f.text_a, "id": f.id, "encoding": f.encoding}


def embed(args: Sequence[str]) -> None:
    from bertjax.serving.embedder import VectorFile, check_vectors_path, ids_path
    from bertjax.train import multihost

    f = flags.FLAGS
    check_arguments("embed", args, "--input=FILE", ("input", "output"))
    if f.chunk_rows < 0:
        sys.exit(f"error: --chunk_rows={f.chunk_rows} must be 0 or positive")
    check_vectors_path(f.output)  # before the model is loaded
    check_prompt_flags("embed")
    check_files("input")
    model = embedder()
    prompt = prompt_text(model, "prompt", None)
    out = multihost.write_from_main(lambda: VectorFile(f.output))
    try:
        for ids, vectors in model.embed_file(f.input, text_fields(), f.chunk_rows, prompt):
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
              f"{f'prompt {prompt!r}; ' if prompt else ''}{model.engine.trained.workdir})")


def search(args: Sequence[str]) -> None:
    import numpy as np

    from bertjax import paths
    from bertjax.tasks.chunks import dump
    from bertjax.train import multihost

    f = flags.FLAGS
    check_arguments("search", args, "--queries=FILE", ("corpus", "queries", "output"))
    top_k = 10 if f.top_k is None else f.top_k
    if top_k < 1:
        sys.exit(f"error: --top_k={top_k} must be positive")
    check_prompt_flags("search")
    check_files("corpus", "queries")  # before the model loads and the corpus is embedded
    model = embedder()
    query_prompt = prompt_text(model, "query_prompt", "query")
    corpus_prompt = prompt_text(model, "corpus_prompt", "document")

    def embedded(path, prompt):
        ids, vectors = [], []
        for chunk_ids, chunk in model.embed_file(path, text_fields(), f.chunk_rows, prompt):
            ids += chunk_ids
            vectors.append(chunk)
        return ids, np.concatenate(vectors)

    # The queries first: a bad queries file stops the run before the (larger) corpus is embedded.
    query_ids, queries = embedded(f.queries, query_prompt)
    corpus_ids, corpus = embedded(f.corpus, corpus_prompt)
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


def mine(args: Sequence[str]) -> None:
    import jax
    import numpy as np
    from jax.sharding import Mesh

    from bertjax import paths
    from bertjax.tasks.embedding import mining
    from bertjax.train import multihost

    f = flags.FLAGS
    check_arguments("mine", args, "--pairs=FILE", ("pairs", "output"))
    if f.top_k is not None:
        sys.exit("error: mine: --top_k is search's; --range_max sets how deep mine searches")
    if f.chunk_rows < 0:
        sys.exit(f"error: --chunk_rows={f.chunk_rows} must be 0 or positive")
    # Before the model loads: the settings, the output's format, the files.
    mining.check_settings(f.num_negatives, f.range_min, f.range_max)
    mining.check_output(f.output)
    check_files("pairs", "corpus")
    encoding = paths.check_encoding(f.encoding or paths.DEFAULT_ENCODING, "--encoding")
    check_prompt_flags("mine")
    model = embedder()
    anchor_prompt = prompt_text(model, "query_prompt", "query")
    corpus_prompt = prompt_text(model, "corpus_prompt", "document")
    summary = mining.mine_file(
        functools.partial(model, prompt=anchor_prompt), f.pairs, f.output, f.num_negatives,
        corpus_path=f.corpus, anchor_column=f.text_a or "anchor",
        positive_column=f.text_b or "positive", encoding=encoding,
        embed_corpus=functools.partial(model, prompt=corpus_prompt), embed_rows=f.chunk_rows,
        range_min=f.range_min, range_max=f.range_max, margin=f.margin,
        relative_margin=f.relative_margin, max_score=f.max_score,
        mesh=Mesh(np.array(jax.devices()), ("corpus",)))
    if multihost.is_main():
        print(summary.line(f.output))


def reranker():
    """The Reranker of --workdir, --export or --checkpoint (exactly one)."""
    from bertjax.serving.reranker import Reranker

    f = flags.FLAGS
    sources = [name for name in ("workdir", "export", "checkpoint") if f[name].value]
    if len(sources) != 1:
        sys.exit("error: rerank: give one of --workdir (a reranking run), --export (its convert "
                 "to_hf directory) or --checkpoint (a converted CrossEncoder)")
    devices = cli.turn_devices()
    if f.checkpoint:
        return Reranker.from_checkpoint(f.checkpoint, f.max_seq_length, f.batch_size, f.dtype,
                                        devices)
    if f.max_seq_length is not None:
        sys.exit("error: --max_seq_length applies to --checkpoint; a run reads pairs at its own")
    if f.workdir:
        return Reranker.from_workdir(f.workdir, f.batch_size, f.dtype, devices)
    return Reranker.from_export(f.export, f.batch_size, f.dtype, devices)


def rerank(args: Sequence[str]) -> None:
    from bertjax import paths
    from bertjax.tasks.chunks import dump
    from bertjax.train import multihost

    f = flags.FLAGS
    check_arguments("rerank", args, "--input=FILE", ("input", "output"))
    if f.top_k is not None and f.top_k < 1:
        sys.exit(f"error: --top_k={f.top_k} must be positive")
    check_files("input")  # before the model loads
    encoding = paths.check_encoding(f.encoding or paths.DEFAULT_ENCODING, "--encoding")
    model = reranker()
    records, metrics, before = model.rerank_file(f.input, f.top_k, encoding)

    def write():
        with paths.open(f.output, "w", encoding="utf-8") as out:
            out.write("".join(dump(r) + "\n" for r in records))

    multihost.write_from_main(write)
    if multihost.is_main():
        pairs = sum(len(r["candidates"]) for r in records) if f.top_k is None else None
        print(f"wrote {len(records)} reranked candidate lists"
              f"{f' ({pairs} pairs)' if pairs is not None else ''} to {f.output} "
              f"({model.activation} activation; {model.engine.trained.workdir})")
        if metrics is not None:
            print("metrics: " + ", ".join(f"{k} {v:.4f} (input order {before[k]:.4f})"
                                          for k, v in metrics.items()))


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
    commands = {"fill_mask": fill_mask, "embed": embed, "search": search, "mine": mine,
                "rerank": rerank}
    if len(argv) > 1 and argv[1] in commands:
        return commands[argv[1]](argv[2:])
    if len(argv) > 1:
        sys.exit(f"error: unexpected arguments {argv[1:]}; flags are --name=value (or a "
                 f"command: {' | '.join(commands)})")
    return predict()


if __name__ == "__main__":
    cli.run(main, define_flags)
