r"""Fine-tuning on a GLUE task (or SWAG) with the paper's hyper-parameters.

  python -m bertjax.finetune --config=experiments/glue.py:mrpc \
      --config.init_checkpoint=checkpoints/bert-base-uncased --workdir=runs/mrpc \
      --config.data.dir=glue_data                 # official layout: glue_data/MRPC/train.tsv ...
  python -m bertjax.finetune --config=experiments/glue.py:mnli --config.data.tfds=true ...
  python -m bertjax.finetune --config=experiments/glue.py:swag --config.data.dir=swagaf/data ...

`arg`: cola, sst2, mrpc, stsb, qqp, mnli, qnli, rte, wnli, or swag. Paper (Sec. 4.1 / A.3):
batch 32, 3 epochs, lr picked on dev from {5e-5, 4e-5, 3e-5, 2e-5}, max_seq_length 128,
dropout 0.1, warmup over the first 10% of steps then linear decay.
"""

import ml_collections

from experiments import common

GLUE = ("cola", "sst2", "mrpc", "stsb", "qqp", "mnli", "qnli", "rte", "wnli")


def base_config() -> ml_collections.ConfigDict:
    """Fields shared by every fine-tuning config (experiments/finetune_files.py too)."""
    config = ml_collections.ConfigDict()
    config.seed = 0
    config.init_checkpoint = ""  # a bertjax checkpoint directory (bertjax.load_pretrained)
    config.max_seq_length = 128

    config.task = ml_collections.ConfigDict(dict(family="glue", name="", kind="",
                                                 **common.modern_head()))
    # Data: a local directory (official layout) or TFDS; files: see finetune_files.py.
    config.data = ml_collections.ConfigDict(dict(
        dir="", tfds=False, tfds_data_dir="", train="", validation="", test="", text_a="",
        text_b="", label="label", choices="", labels="", encoding=common.DATA_ENCODING,
        # pack: training batches of several examples per max_seq_length row instead of one
        # padded example per row (classification and regression only; batch_size still counts
        # examples; evaluation stays unpacked): data_pipeline/packed_finetune.py.
        pack=False))

    # Overrides of the checkpoint's config.json: compute dtype ("auto": bfloat16 on TPU/GPU,
    # float32 on CPU, as in pre-training; an explicit dtype is honoured everywhere) and dropout.
    config.model = ml_collections.ConfigDict(dict(
        dtype="auto", hidden_dropout_prob=0.1, attention_dropout_prob=0.1))

    # grad_reduce_dtype: see experiments/pretrain.py. group_by_length: training batches of one
    # length bucket each (less padding) instead of uniform draws padded to their longest
    # example's bucket (data_pipeline/finetune_data.py: it slows short runs).
    config.train = ml_collections.ConfigDict(dict(batch_size=32, num_epochs=3.0,
                                                  grad_accum_steps=1, grad_reduce_dtype="float32",
                                                  group_by_length=False))
    config.optimizer = common.optimizer(learning_rate=2e-5, name="adamw", schedule="from_peak")
    config.optimizer.warmup_proportion = 0.1
    # Evaluation on the dev set(s) every `every_steps` steps (0 = at the end of every epoch);
    # the checkpoint with the best dev metric is kept, and test predictions come from it.
    # batch_size: rows at 128 tokens and longer; on a CPU at most 8 (prediction_batch_size).
    config.eval = ml_collections.ConfigDict(dict(every_steps=0, batch_size=64))
    config.checkpoint = common.checkpoint(every_steps=1000, max_to_keep=1)
    config.log_every_steps = 50
    config.min_bucket_length = 16  # length buckets: 16, 32, 64, ..., max_seq_length

    config.mesh = common.mesh()
    config.distributed = common.distributed()
    config.profile = common.profile()
    config.logical_axis_rules = common.LOGICAL_AXIS_RULES
    return config


def get_config(arg: str = "mrpc") -> ml_collections.ConfigDict:
    config = base_config()
    task = arg.lower().replace("-", "")
    if task == "swag":
        config.task.family, config.task.name, config.task.kind = "swag", "swag", "multiple_choice"
        config.train.batch_size = 16  # 4 sequences per example
        config.optimizer.learning_rate = 2e-5
        return config
    if task not in GLUE:
        raise ValueError(f"experiments/glue.py: unknown task {arg!r}; choose one of "
                         f"{GLUE + ('swag',)}")
    config.task.name = task
    config.task.kind = "regression" if task == "stsb" else "classification"
    return config
