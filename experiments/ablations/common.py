"""What the ablation grids share: the pre-training recipe and the fine-tuning tasks of each
scale (`python -m bertjax.ablations <table> --scale=...`).

Scales: paper (BERT-base, the paper's recipe, for a pod slice; data paths set with --set),
small (a 4-layer 256-wide model on the demo corpus), demo (the `make demo` model and data and
the demo tasks), test (a tiny model for the test suite, which sets its data paths).
"""

import ml_collections

from bertjax.models import BertConfig
from experiments import (
    finetune_rotten_tomatoes,
    glue,
    ner,
    ner_feature_based,
    pretrain,
    pretrain_demo,
    squad,
)

SCALES = ("paper", "small", "demo", "test")

# The paper's fine-tuning search (Sec. A.3): lr picked on dev, batch 32, 3 epochs.
PAPER_LEARNING_RATES = (5e-5, 4e-5, 3e-5, 2e-5)
DEMO_DATA_HINT = "run `make demo` (it writes data/demo/)"


def check_scale(scale: str, table: str) -> str:
    if scale not in SCALES:
        raise ValueError(f"experiments/ablations/{table}.py: unknown scale {scale!r}; choose "
                         f"one of {SCALES}")
    return scale


def grid(table: str, title: str, scale: str) -> ml_collections.ConfigDict:
    """The fields every grid has; the table's file adds pretrainings, rows and columns."""
    config = ml_collections.ConfigDict()
    config.table = table
    config.title = title
    config.scale = scale
    # Seeds: small scale pre-trains once per seed; paper and demo scales pre-train each variant
    # once and the seeds are fine-tuning restarts (the paper averages 5 in Table 6). Demo runs
    # one seed so that a table takes about an hour on 2 CPU cores; --seeds=0,1,2 gives
    # mean ± std over three fine-tuning restarts at 3x the fine-tuning time.
    config.seeds = [0, 1, 2] if scale == "small" else [0]
    config.pretrain_per_seed = scale == "small"
    config.pretrain = pretraining(scale)
    config.data_hint = "set the data paths with --set" if scale == "paper" else DEMO_DATA_HINT
    config.export_steps = []  # pre-training steps exported for fine-tuning (the steps grid)
    # Columns from held-out pre-training evaluation at the row's step: [dict(name=..., metric=...,
    # optional scale= (x100 for a percentage), seq_len= (only evaluations at that length))].
    config.pretrain_columns = []
    config.paper = {}  # row name → {column: the paper's number}
    config.row_header = "Variant"
    return config


def pretraining(scale: str) -> ml_collections.ConfigDict:
    """The pre-training recipe of a scale (experiments/pretrain.py fields)."""
    if scale == "paper":
        # BERT-base: batch 256, 1M steps (90% at 128 tokens, then 512), Adam lr 1e-4 with
        # 10k warmup steps and linear decay, weight decay 0.01, dropout 0.1.
        return pretrain.get_config("base")
    config = pretrain_demo.get_config("tiny")
    if scale == "small":
        config.model.update(BertConfig.from_preset("mini").to_dict(),
                            vocab_size=config.model.vocab_size, dtype="float32")
        config.train.batch_size = 64
        config.train.num_train_steps = 4000
        config.optimizer.learning_rate = 5e-4
        config.optimizer.warmup_steps = 400
        config.checkpoint.every_steps = 1000
        config.eval.every_steps = 2000
    if scale == "test":
        config.model.update(num_layers=1, hidden_size=32, num_heads=2, intermediate_size=64,
                            max_position_embeddings=64)
        config.train.batch_size = 4
        config.train.num_train_steps = 4
        # One phase (phase 2 gets no steps): one compiled train step per cell.
        config.phases.phase1.update(data="", eval_data="", seq_len=32, max_predictions=5,
                                    fraction=1.0)
        config.phases.phase2.update(data="", eval_data="", seq_len=32, max_predictions=5)
        config.optimizer.warmup_steps = 1
        config.checkpoint.every_steps = 4  # one save: at the end
        config.checkpoint.async_save = False
        config.eval.every_steps = 4
        config.eval.num_batches = 1
        config.log_every_steps = 1
        config.vocab = ""
    return config


def task(config, metric: str, column: str, learning_rates, hint: str = "",
         scale: float = 100.0):
    """A fine-tuning column: the task's config, the dev metric reported, the column title,
    the learning rates searched, how to get its data, and the factor that makes the metric a
    percentage (1 for SQuAD's EM / F1, which already are)."""
    if "bilstm_units" not in config.task:
        config.task.bilstm_units = 0  # the "+ BiLSTM" row sets it
    return ml_collections.ConfigDict(dict(config=config, metric=metric, column=column,
                                          learning_rates=list(learning_rates), hint=hint,
                                          scale=scale))


def _test_sized(config):
    """A fine-tuning config cut down for the test scale (seconds, not minutes)."""
    config.train.batch_size = 4
    config.train.num_epochs = 1.0
    config.max_seq_length = 32
    config.min_bucket_length = 32
    config.eval.batch_size = 8
    config.log_every_steps = 1
    config.checkpoint.async_save = False
    return config


def rotten_tomatoes(scale: str):
    config = finetune_rotten_tomatoes.get_config("binary")
    if scale == "test":
        config = _test_sized(config)
    return task(config, "accuracy", "RT (acc)", [config.optimizer.learning_rate],
                "run `make rotten_tomatoes`")


def ropes(scale: str):
    """Extractive QA on ROPES (SQuAD v1.1 layout), as `bertjax.demos.squad_demo` runs it; one epoch
    at demo scale (~4 minutes on 2 CPU cores instead of ~10)."""
    config = squad.get_config("files")
    config.data.train, config.data.validation = "data/ropes/train.json", "data/ropes/dev.json"
    config.max_seq_length = 384
    config.optimizer.learning_rate = 1e-4
    config.model.dtype = "float32"
    if scale == "demo":
        config.train.num_epochs = 1.0
    return task(config, "f1", "ROPES (F1)", [1e-4], "run `make ropes`", scale=1.0)


def _pos_data(config):
    config.data.update(train="data/pos/train.conll", validation="data/pos/dev.conll",
                       scheme="none", labels="data/pos/labels.txt", tag_column=1,
                       document_context=False)
    config.task.label_scheme = "none"
    config.train.num_epochs = 2.0
    config.model.dtype = "float32"
    return config


def pos(scale: str):
    """POS tagging (word<TAB>tag files), as `bertjax.demos.tagging_demo` runs it."""
    config = _pos_data(ner.get_config("files"))
    config.optimizer.learning_rate = 1e-4
    return task(config, "accuracy", "POS (acc)", [1e-4], "run `make pos_data`")


def pos_feature_based(scale: str):
    """The feature-based POS tagger (frozen encoder, its last layer into a BiLSTM)."""
    config = _pos_data(ner_feature_based.get_config("last,files"))
    config.feature_based.lstm_units = 128
    return task(config, "accuracy", "POS feature-based (acc)",
                [config.optimizer.learning_rate], "run `make pos_data`")


def glue_task(name: str, column: str):
    config = glue.get_config(name)
    config.data.dir = "data/glue"
    metric = "matched_accuracy" if name == "mnli" else "accuracy"
    return task(config, metric, column, PAPER_LEARNING_RATES,
                "set tasks.<name>.config.data.dir to the GLUE data")


def squad_v1():
    config = squad.get_config("v1")
    config.data.train = "data/squad/train-v1.1.json"
    config.data.validation = "data/squad/dev-v1.1.json"
    return task(config, "f1", "SQuAD (F1)", PAPER_LEARNING_RATES,
                "set tasks.squad.config.data.train/validation", scale=1.0)


def conll_ner(feature_based: bool):
    if feature_based:
        config = ner_feature_based.get_config("concat_last_four")
        column, rates = "NER feature-based (F1)", [config.optimizer.learning_rate]
    else:
        config = ner.get_config("conll2003")
        column, rates = "NER fine-tune (F1)", PAPER_LEARNING_RATES
    config.data.dir = "data/conll2003"
    return task(config, "f1", column, rates, "set the CoNLL-2003 directory with --set")


def set_tasks(config, **tasks) -> None:
    """config.tasks, and their column order (a ConfigDict sorts its keys)."""
    config.tasks = tasks
    config.task_order = list(tasks)


def set_demo_tasks(config, scale: str, *names: str) -> None:
    """The demo scale's tasks by name (test: Rotten-Tomatoes-style files only)."""
    makers = {"rotten_tomatoes": rotten_tomatoes, "ropes": ropes, "pos": pos,
              "pos_feature_based": pos_feature_based}
    if scale == "test":
        names = ("rotten_tomatoes",)
    set_tasks(config, **{name: makers[name](scale) for name in names})
