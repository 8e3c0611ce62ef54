r"""Sentence embeddings: contrastive fine-tuning on (anchor, positive[, negatives]) rows, or
on scored pairs (STS), from your own CSV / TSV / JSONL files.

  python -m bertjax.finetune --config=experiments/embedding.py:pairs \
      --config.init_checkpoint=checkpoints/minilm --workdir=runs/qa_embed \
      --config.data.train=pairs.jsonl --config.data.columns=question,answer \
      --config.data.beir=data/my_beir    # corpus.jsonl, queries.jsonl, qrels/dev.tsv
  python -m bertjax.finetune --config=experiments/embedding.py:scored \
      --config.init_checkpoint=checkpoints/minilm --workdir=runs/sts \
      --config.data.train=sts_train.csv --config.data.validation=sts_dev.csv \
      --config.data.text_a=sentence1 --config.data.text_b=sentence2 --config.data.score=score

`arg` = pairs | scored. pairs: the in-batch-negatives loss (scale 20; every other row's
positive and hard negatives in the global batch are an anchor's negatives, across every
device and host), batch 64, 1 epoch, texts packed several to a row (config.data.pack).
scored: CoSENT (only the order of the scores matters), batch 16, 4 epochs. Pooling: "auto"
takes a converted sentence-transformers model's own (pooling.json), else mean pooling;
max_seq_length 0 its own length, else 128; prompts "auto" its own (encode_query's for the
anchors, encode_document's for the positives and negatives, encode's for scored pairs),
e.g. --config.task.query_prompt="query: " to set one ("" none).
"""

import ml_collections

from experiments.glue import base_config

KINDS = ("pairs", "scored")


def get_config(arg: str = "pairs") -> ml_collections.ConfigDict:
    if arg not in KINDS:
        raise ValueError(f"experiments/embedding.py: unknown kind {arg!r}; choose one of {KINDS}")
    config = base_config()
    config.task.family, config.task.name, config.task.kind = "embedding", arg, arg
    # pooling: auto | mean | cls | max; normalize: auto | true | false; loss: auto (pairs:
    # in_batch; scored: cosent) | cosine (scored, scores in [-1, 1]); symmetric: each
    # positive also ranks its anchor among every anchor. cache_chunk_rows: a batch larger
    # than memory, encoded this many rows at a time with the whole batch's loss and
    # gradients (GradCache; 0: off; it must divide train.batch_size). no_duplicates (pairs):
    # no text twice in a training batch, as sentence-transformers' NO_DUPLICATES sampler (a
    # passage with several questions would be its own copies' false negative).
    # matryoshka_dims: e.g. "384,256,128,64": the loss is also that of each leading slice of
    # the vectors (Matryoshka), so that truncated vectors still rank ("": full size only).
    # query_prompt (anchors, BEIR queries), document_prompt (positives, negatives, the BEIR
    # corpus), prompt (scored / STS pairs): text prepended before tokenizing, as
    # sentence-transformers' trainer prompts= does; "auto" is the init checkpoint's own
    # (bertjax/tasks/embedding/prompts.py), "" none. The export keeps them as its prompts.
    config.task.update(dict(pooling="auto", normalize="auto", loss="auto", scale=20.0,
                            symmetric=False, cache_chunk_rows=0, no_duplicates=True,
                            matryoshka_dims="", prompt="auto", query_prompt="auto",
                            document_prompt="auto"))
    # pack (pairs: on by default): each training batch's texts packed several to a row
    # instead of each row's texts padded to its longest (a question to its passage): the same
    # rows, vectors and losses in fewer tokens (bertjax/tasks/embedding/packed.py; evaluation
    # stays unpacked); not with train.grad_reduce_dtype=bfloat16.
    config.data.update(dict(columns="anchor,positive", text_a="sentence1", text_b="sentence2",
                            score="score", beir="", beir_split="dev", pack=arg == "pairs"))
    config.eval.at_start = True  # the starting checkpoint's score, for comparison
    # Tokens per text: 0 is the init checkpoint's own (a converted sentence-transformers
    # model's max_seq_length), else 128.
    config.max_seq_length = 0
    if arg == "pairs":
        config.train.batch_size, config.train.num_epochs = 64, 1.0
    else:
        config.train.batch_size, config.train.num_epochs = 16, 4.0
    return config
