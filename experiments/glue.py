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

GLUE = ("cola", "sst2", "mrpc", "stsb", "qqp", "mnli", "qnli", "rte", "wnli")


def base_config() -> ml_collections.ConfigDict:
    """Fields shared by every fine-tuning config (experiments/finetune_files.py too)."""
    config = ml_collections.ConfigDict()
    config.seed = 0
    config.init_checkpoint = ""  # a bertjax checkpoint directory (bertjax.load_pretrained)
    config.max_seq_length = 128

    config.task = ml_collections.ConfigDict(dict(family="glue", name="", kind=""))
    # Data: a local directory (official layout) or TFDS; files: see finetune_files.py.
    config.data = ml_collections.ConfigDict(dict(
        dir="", tfds=False, tfds_data_dir="", train="", validation="", test="", text_a="",
        text_b="", label="label", choices="", labels=""))

    # load_pretrained overrides: compute dtype (float32 on CPU whatever is asked) and dropout.
    config.model = ml_collections.ConfigDict(dict(
        dtype="bfloat16", hidden_dropout_prob=0.1, attention_dropout_prob=0.1))

    config.train = ml_collections.ConfigDict(dict(batch_size=32, num_epochs=3.0))
    config.optimizer = ml_collections.ConfigDict(dict(
        name="bert_adamw", learning_rate=2e-5, warmup_proportion=0.1, schedule="reference",
        weight_decay=0.01, b1=0.9, b2=0.999, eps=1e-6, clip_norm=1.0))
    # Evaluation on the dev set(s) every `every_steps` steps (0 = at the end of every epoch);
    # the checkpoint with the best dev metric is kept under workdir/best.
    config.eval = ml_collections.ConfigDict(dict(every_steps=0, batch_size=64))
    config.log_every_steps = 50
    config.min_bucket_length = 16  # length buckets: 16, 32, 64, ..., max_seq_length

    config.mesh = ml_collections.ConfigDict(dict(data=-1, fsdp=1, tensor=1))
    config.logical_axis_rules = (
        ("batch", ("data", "fsdp")), ("vocab", "tensor"), ("embed", "fsdp"), ("mlp", "tensor"),
        ("heads", "tensor"), ("kv", None), ("length", None), ("layers", None),
        ("classes", None), ("embed_out", None),
    )
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
