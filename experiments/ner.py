r"""Token classification: CoNLL-2003 NER (the paper's Sec. 5.3 setting) or your own tagged files.

  python -m bertjax.finetune --config=experiments/ner.py:conll2003 --workdir=runs/ner \
      --config.init_checkpoint=checkpoints/bert-base-cased --config.data.dir=conll2003
      # eng.train / eng.testa / eng.testb (or train.txt / valid.txt / test.txt), IOB1 as
      # distributed; or --config.data.tfds=true for TFDS `conll2003` (IOB2)
  python -m bertjax.finetune --config=experiments/ner.py:files --workdir=runs/tags \
      --config.init_checkpoint=checkpoints/my-bert --config.data.train=train.conll \
      --config.data.validation=dev.conll [--config.data.test=test.conll] \
      [--config.data.tag_column=1 --config.data.scheme=none]     # e.g. word<TAB>POS files

Paper (Sec. 5.3 / A.3): batch 32, 3 epochs, lr from {5e-5, 4e-5, 3e-5, 2e-5} on dev (one
`bertjax.finetune_grid` run), a cased model, document context, first sub-token labelling, no
CRF.

Document context (data.document_context, on by default) reads only inside the documents the
data marks: CoNLL `-DOCSTART-` lines (CoNLL-2003 has them: the paper's setting), a JSONL
"document" field, or a TFDS split (CoNLL-2003 in article order). A file without marks holds
independent sentences (e.g. tweets), each encoded alone as `[CLS] sentence [SEP]`; one
-DOCSTART- line at its top makes the whole file one document.

Files: CoNLL columns (any token / tag column) or JSONL {"tokens": [...], "tags": [...]}; tags
in the file's `scheme` (iob1 | iob2 | bioes | none) are converted to `task.label_scheme`; the
labels are those of the training file unless given (--config.data.labels=O,B-PER,I-PER,...).
"""

import ml_collections

from experiments import common
from experiments.glue import base_config

NAMES = ("conll2003", "files")


def data_config(**overrides) -> ml_collections.ConfigDict:
    """config.data of token classification (experiments/ner_feature_based.py too)."""
    data = dict(
        dir="", tfds=False, tfds_data_dir="",  # conll2003: the directory, or TFDS
        train="", validation="", test="", test_labelled=True,  # files
        format="auto",  # conll | jsonl | auto (by extension)
        token_column=0, tag_column=-1,  # CoNLL columns (-1 = last)
        tokens_key="tokens", tags_key="tags",  # JSONL fields
        scheme="iob2",  # the files' tag scheme: iob1 | iob2 | bioes | none (plain tags)
        labels="",  # comma-separated, or a file of one label a line; "" = the train tags
        document_context=True,  # each sentence with its marked document's neighbours
        stride=64,  # long sentences: windows of max_seq_length - 2 pieces every `stride`
        encoding=common.DATA_ENCODING,  # the files' text encoding
        # pack: training batches of several sentence rows per max_seq_length row (the
        # token_classification family; evaluation stays unpacked): bertjax/tasks/packing.py.
        pack=False,
    )
    data.update(overrides)
    return ml_collections.ConfigDict(data)


def get_config(arg: str = "conll2003") -> ml_collections.ConfigDict:
    if arg not in NAMES:
        raise ValueError(f"experiments/ner.py: unknown config {arg!r}; choose one of {NAMES}")
    config = base_config()
    config.task = ml_collections.ConfigDict(dict(family="token_classification", name=arg,
                                                 kind="tagging", label_scheme="iob2",
                                                 **common.modern_head()))
    config.data = data_config()
    config.optimizer.learning_rate = 5e-5
    config.eval.batch_size = 64
    if arg == "conll2003":
        config.data.scheme = "iob1"  # the files as distributed (TFDS is read as IOB2)
    return config
