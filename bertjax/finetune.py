r"""Fine-tune a pre-trained BERT: GLUE, SWAG, or your own files.

  python -m bertjax.finetune --config=experiments/glue.py:mrpc --workdir=runs/mrpc \
      --config.init_checkpoint=checkpoints/bert-base-uncased --config.data.dir=glue_data
  python -m bertjax.finetune --config=experiments/finetune_files.py:classification ...

The same machinery as pre-training: a device mesh from `config.mesh`, parameters sharded by
their logical axis names, the reference optimizer (warmup over 10% of the steps, then linear
decay), a jitted train step with the state donated, `metrics.jsonl` + TensorBoard and the
progress line. The dev metric is computed every epoch (or `eval.every_steps`); the best
checkpoint is kept with orbax under `workdir/best`, and test predictions come from it
(GLUE: leaderboard files `workdir/submission/<TASK>.tsv`). `workdir/results.json` holds the
best dev metrics (read by `bertjax.finetune_grid`).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import sys
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from bertjax.models.config import ConfigError
from bertjax.tasks import (
    BertForMultipleChoice,
    BertForSequenceClassification,
    classification_loss,
    regression_loss,
)
from bertjax.tasks import metrics as metrics_lib
from bertjax.train import sharding as sharding_lib
from bertjax.train.step import TrainState

BEST_DIR = "best"
RESULTS_FILE = "results.json"


# ---------------------------------------------------------------------------------------------
# Task data


@dataclasses.dataclass
class TaskData:
    kind: str  # classification | regression | multiple_choice
    label_names: tuple[str, ...]  # () for regression
    metrics: tuple[str, ...]  # the first one selects the best checkpoint
    primary_metric: str
    train: list
    dev: dict[str, list]  # eval name → examples
    test: dict[str, list]  # submission stem → examples
    glue: bool = False

    @property
    def num_labels(self) -> int:
        return 1 if self.kind in ("regression", "multiple_choice") else len(self.label_names)


def load_task_data(config) -> TaskData:
    """Examples of every split, from config.task / config.data (TensorFlow only for TFDS)."""
    from data_pipeline import glue

    family, data = config.task.family, config.data
    if family == "glue":
        task = glue.get_task(config.task.name)
        if data.tfds:
            splits = glue.read_glue_tfds(task, data.tfds_data_dir or None)
        elif data.dir:
            splits = glue.read_glue(data.dir, task)
        else:
            raise ConfigError("config.data.dir is empty; give the GLUE data directory (official "
                              "layout) or set config.data.tfds=true")
        dev = {s.name: splits[s.name] for s in task.dev}
        test = {s.name: splits[s.name] for s in task.test if s.name in splits}
        return TaskData("regression" if task.regression else "classification", task.labels,
                        task.metrics, task.primary_metric, splits["train"], dev, test, glue=True)
    if family == "swag":
        if not data.dir:
            raise ConfigError("config.data.dir is empty; give the directory holding SWAG's "
                              "train.csv, val.csv (and test.csv)")
        splits = glue.read_swag(data.dir)
        test = {"test": splits["test"]} if "test" in splits else {}
        return TaskData("multiple_choice", ("0", "1", "2", "3"), ("accuracy",), "accuracy",
                        splits["train"], {"dev": splits["dev"]}, test)
    if family != "files":
        raise ConfigError(f"config.task.family={family!r} is not one of glue | swag | files")
    kind = config.task.kind
    for field in ("train", "validation", "text_a"):
        if not data[field]:
            raise ConfigError(f"config.data.{field} is empty")
    choices = tuple(c for c in data.choices.split(",") if c)
    if kind == "multiple_choice" and len(choices) < 2:
        raise ConfigError("config.data.choices must name at least two columns, e.g. a,b,c,d")
    labels = None
    if kind == "classification":
        labels = (tuple(x for x in data.labels.split(",") if x) if data.labels
                  else glue.infer_labels(data.train, data.label))
    read = functools.partial(glue.read_file, kind=kind, text_a=data.text_a, text_b=data.text_b,
                             label=data.label, choices=choices, labels=labels)
    label_names = {"classification": labels, "regression": (),
                   "multiple_choice": tuple(str(i) for i in range(len(choices)))}[kind]
    metric_names = ("pearson", "spearman") if kind == "regression" else ("accuracy",)
    if kind == "classification" and len(labels) == 2:
        metric_names = ("accuracy", "f1", "matthews_corrcoef")
    test = {"test": read(data.test, labelled=False)} if data.test else {}
    return TaskData(kind, tuple(label_names), metric_names, metric_names[0],
                    read(data.train), {"dev": read(data.validation)}, test)


# ---------------------------------------------------------------------------------------------
# Model, state, steps


def make_model(model_cfg, task: TaskData):
    if task.kind == "multiple_choice":
        return BertForMultipleChoice(model_cfg)
    return BertForSequenceClassification(model_cfg, task.num_labels)


def task_loss(task: TaskData) -> Callable:
    return regression_loss if task.kind == "regression" else classification_loss


def _dummy_inputs(task: TaskData):
    shape = (1, 2, 8) if task.kind == "multiple_choice" else (1, 8)
    return jnp.zeros(shape, jnp.int32)


def init_state(model, task, tx, bert_params, rng, mesh, rules) -> tuple[TrainState, TrainState]:
    """The train state in its sharded layout: the head freshly initialised, the encoder from the
    pre-trained checkpoint. Returns (state, its shardings)."""
    import flax.linen as nn
    import optax
    from jax.sharding import PartitionSpec

    ids = _dummy_inputs(task)
    boxed = jax.eval_shape(lambda: model.init(jax.random.key(0), ids, ids, ids))["params"]
    param_specs = nn.get_partition_spec(boxed)
    param_shardings = nn.logical_to_mesh_sharding(param_specs, mesh, sharding_lib.as_rules(rules))

    def build(rng, bert):
        params_rng, dropout_rng = jax.random.split(rng)
        params = nn.unbox(model.init(params_rng, ids, ids, ids)["params"])
        params = dict(params, bert=bert)
        return TrainState(step=jnp.zeros((), jnp.int32), params=params,
                          opt_state=tx.init(params), rng=dropout_rng)

    abstract = jax.eval_shape(build, jax.random.key(0), nn.unbox(boxed)["bert"])
    opt_specs = optax.tree_map_params(
        tx, lambda _, spec: spec, abstract.opt_state, param_specs,
        transform_non_params=lambda _: PartitionSpec(),
        is_leaf=lambda x: isinstance(x, PartitionSpec))
    specs = TrainState(step=PartitionSpec(), params=param_specs, opt_state=opt_specs,
                       rng=PartitionSpec())
    shardings = nn.logical_to_mesh_sharding(specs, mesh, sharding_lib.as_rules(rules))
    _check_encoder(abstract.params["bert"], bert_params)
    bert = jax.device_put(bert_params, param_shardings["bert"])
    state = jax.jit(build, out_shardings=shardings)(rng, bert)
    return state, shardings


def _check_encoder(expected, got) -> None:
    want = jax.tree.map(lambda x: x.shape, expected)
    have = jax.tree.map(np.shape, got)
    if want != have:
        raise ConfigError("config.init_checkpoint: the encoder parameters do not match the "
                          "model built from its config.json")


def train_step(state: TrainState, batch, *, model, tx, schedule, loss_fn):
    """One optimizer step; dropout keys fold in the step (reproducible for a seed)."""
    import optax

    dropout_rng = jax.random.fold_in(state.rng, state.step)

    def compute_loss(params):
        logits = model.apply({"params": params}, batch["input_ids"], batch["segment_ids"],
                             batch["input_mask"], deterministic=False,
                             rngs={"dropout": dropout_rng})
        return loss_fn(logits, batch["labels"], batch["weights"])

    (_, metrics), grads = jax.value_and_grad(compute_loss, has_aux=True)(state.params)
    updates, opt_state = tx.update(grads, state.opt_state, state.params)
    params = optax.apply_updates(state.params, updates)
    metrics = dict(metrics, grad_norm=optax.global_norm(grads),
                   learning_rate=schedule(state.step))
    return state.replace(step=state.step + 1, params=params, opt_state=opt_state), metrics


def predict_fn(model):
    def predict(params, batch):
        logits = model.apply({"params": params}, batch["input_ids"], batch["segment_ids"],
                             batch["input_mask"])
        return logits.astype(jnp.float32)
    return jax.jit(predict)


# ---------------------------------------------------------------------------------------------
# Evaluation


def predict_split(predict, params, features, batch_size, buckets, to_global,
                  regression: bool) -> np.ndarray:
    """Predictions for every example of a split, in example order: class ids or scores [n]."""
    from data_pipeline import finetune_data

    out = None
    for batch in finetune_data.batches(features, batch_size, buckets, shuffle=False,
                                       process_index=jax.process_index(),
                                       process_count=jax.process_count()):
        logits = _to_host(predict(params, to_global(batch)))
        index = _to_host(to_global(batch)["example_index"])
        values = logits.reshape(-1) if regression else logits.argmax(axis=-1)
        if out is None:
            out = np.zeros((len(features),), values.dtype)
        keep = index >= 0
        out[index[keep]] = values[keep]
    return out


def _to_host(x) -> np.ndarray:
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        x = multihost_utils.process_allgather(x, tiled=True)
    return np.asarray(jax.device_get(x))


def evaluate(task: TaskData, predictions: dict[str, np.ndarray],
             labels: dict[str, np.ndarray]) -> dict[str, float]:
    """Task metrics on each dev split; several splits (MNLI) are prefixed with their names."""
    results = {}
    for name, pred in predictions.items():
        prefix = f"{name}_" if len(predictions) > 1 else ""
        results.update(metrics_lib.compute(task.metrics, labels[name], pred, prefix))
    return results


# ---------------------------------------------------------------------------------------------
# The loop


def _resolved_model_overrides(config) -> dict[str, Any]:
    overrides = dict(config.model)
    if jax.default_backend() == "cpu" and overrides.get("dtype") == "bfloat16":
        overrides["dtype"] = "float32"  # bf16 matmuls are emulated (slow) on CPU
    return overrides


def _best_manager(workdir: str, primary: str):
    import orbax.checkpoint as ocp
    from etils import epath

    return ocp.CheckpointManager(
        (epath.Path(workdir) / BEST_DIR).resolve(),
        options=ocp.CheckpointManagerOptions(
            max_to_keep=1, best_fn=lambda m: m[primary], best_mode="max", create=True,
            enable_async_checkpointing=False),
    )


def train_and_evaluate(config, workdir: str, log=print) -> dict[str, Any]:
    """Fine-tunes, evaluates, keeps the best checkpoint, writes test predictions.

    Returns {"best_step", "best": dev metrics of the best checkpoint, "primary_metric", ...}.
    """
    import ml_collections
    import orbax.checkpoint as ocp
    from etils import epath

    from bertjax.pretrained import load_pretrained
    from bertjax.tasks.submission import write_submission
    from bertjax.train import metrics as train_metrics
    from bertjax.train.optimizer import make_optimizer
    from data_pipeline import finetune_data

    workdir_path = epath.Path(workdir)
    workdir_path.mkdir(parents=True, exist_ok=True)
    if jax.process_index() == 0:
        (workdir_path / "config.json").write_text(config.to_json_best_effort(indent=2))
    if not config.init_checkpoint:
        raise ConfigError("config.init_checkpoint is empty; give a bertjax checkpoint directory")
    task = load_task_data(config)
    model_cfg, pretrained, tokenizer = load_pretrained(
        config.init_checkpoint, **_resolved_model_overrides(config))
    max_len = config.max_seq_length
    if max_len > model_cfg.max_position_embeddings:
        raise ConfigError(f"config.max_seq_length={max_len} exceeds the model's "
                          f"{model_cfg.max_position_embeddings} positions")
    regression = task.kind == "regression"
    encode = functools.partial(finetune_data.encode, tokenizer, max_seq_length=max_len,
                               regression=regression)
    train_features = encode(task.train)
    dev_features = {k: encode(v) for k, v in task.dev.items()}
    test_features = {k: encode(v) for k, v in task.test.items()}
    buckets = finetune_data.bucket_lengths(max_len, min(config.min_bucket_length, max_len))
    batch_size, eval_batch = config.train.batch_size, config.eval.batch_size
    padding = finetune_data.padding_fraction(train_features, batch_size, buckets)
    log(f"Task {config.task.name}: {len(task.train)} train, "
        + ", ".join(f"{len(v)} {k}" for k, v in task.dev.items())
        + f" examples; padding is {100 * padding:.1f}% of the train tokens computed "
        f"(buckets {buckets})")

    mesh = sharding_lib.make_mesh(config.mesh)
    rules = config.logical_axis_rules
    data_parallel = mesh.shape["data"] * mesh.shape["fsdp"]
    for name, size in (("train.batch_size", batch_size), ("eval.batch_size", eval_batch)):
        if size % data_parallel or size % jax.process_count():
            raise ConfigError(f"config.{name}={size} does not divide over the {data_parallel} "
                              "data-parallel devices / processes")
    steps_per_epoch = math.ceil(len(train_features) / batch_size)
    total_steps = max(1, int(round(steps_per_epoch * config.train.num_epochs)))
    opt_config = ml_collections.ConfigDict(config.optimizer.to_dict())
    opt_config.warmup_steps = int(config.optimizer.warmup_proportion * total_steps)
    tx, schedule = make_optimizer(opt_config, total_steps)
    model = make_model(model_cfg, task)
    state, state_sharding = init_state(model, task, tx, pretrained["bert"],
                                       jax.random.key(config.seed), mesh, rules)
    del pretrained
    batch_sharding = sharding_lib.batch_sharding(mesh, rules)
    step_fn = jax.jit(
        functools.partial(train_step, model=model, tx=tx, schedule=schedule,
                          loss_fn=task_loss(task)),
        in_shardings=(state_sharding, batch_sharding), out_shardings=(state_sharding, None),
        donate_argnums=(0,))
    predict = predict_fn(model)

    def to_global(batch):
        return {k: jax.make_array_from_process_local_data(batch_sharding, np.asarray(v))
                for k, v in batch.items()}

    def dev_metrics(params):
        predictions = {k: predict_split(predict, params, f, eval_batch, buckets, to_global,
                                     regression)
                       for k, f in dev_features.items()}
        return evaluate(task, predictions, {k: f.labels for k, f in dev_features.items()})

    writer = train_metrics.MetricsWriter(workdir)
    manager = _best_manager(workdir, task.primary_metric)
    eval_every = config.eval.every_steps or steps_per_epoch
    start, step, history = time.time(), 0, []
    try:
        for epoch in range(math.ceil(total_steps / steps_per_epoch)):
            epoch_batches = finetune_data.batches(
                train_features, batch_size, buckets, shuffle=True, seed=config.seed * 1000 + epoch,
                process_index=jax.process_index(), process_count=jax.process_count())
            for batch in epoch_batches:
                if step >= total_steps:
                    break
                state, metrics = step_fn(state, to_global(batch))
                step += 1
                if step % config.log_every_steps == 0 or step == total_steps:
                    host = {k: float(v) for k, v in jax.device_get(metrics).items()}
                    if not math.isfinite(host["loss"]):
                        raise ConfigError(f"loss is {host['loss']} at step {step}; lower "
                                          "config.optimizer.learning_rate")
                    writer.write(step, host)
                    log(train_metrics.progress_line(step, total_steps, host, time.time() - start,
                                                    None))
                if step % eval_every == 0 or step == total_steps:
                    results = dev_metrics(state.params)
                    results["epoch"] = step / steps_per_epoch
                    writer.write(step, results, split="eval")
                    history.append({"step": step, **results})
                    log(f"eval at step {step}: " + json.dumps(
                        {k: round(v, 4) for k, v in results.items()}))
                    manager.save(step, args=ocp.args.Composite(
                        params=ocp.args.StandardSave(state.params),
                        metrics=ocp.args.JsonSave(results)), metrics=results)
        manager.wait_until_finished()
        best_step = manager.best_step()
        best = next(h for h in history if h["step"] == best_step)
        log(f"best {task.primary_metric} {best[task.primary_metric]:.4f} at step {best_step}; "
            f"checkpoint {workdir_path / BEST_DIR / str(best_step)}")

        if test_features:
            target = jax.tree.map(
                lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                state.params, state_sharding.params)
            params = manager.restore(best_step, args=ocp.args.Composite(
                params=ocp.args.StandardRestore(target)))["params"]
            for stem, features in test_features.items():
                pred = predict_split(predict, params, features, eval_batch, buckets, to_global,
                                     regression)
                if jax.process_index() == 0:
                    indices = [e.index for e in task.test[stem]]
                    path = write_submission(str(workdir_path / "submission"), stem, indices,
                                            pred, task.label_names)
                    log(f"wrote {len(indices)} test predictions to {path}")
        summary = {"primary_metric": task.primary_metric, "best_step": best_step,
                   "best": {k: v for k, v in best.items() if k != "step"},
                   "history": history, "total_steps": total_steps}
        if jax.process_index() == 0:
            (workdir_path / RESULTS_FILE).write_text(json.dumps(summary, indent=2) + "\n")
        return summary
    finally:
        manager.close()
        writer.close()


def main(argv):
    del argv
    from absl import flags, logging

    logging.set_verbosity(logging.WARNING)
    config, workdir = flags.FLAGS.config, flags.FLAGS.workdir
    if config is None:
        sys.exit("error: --config is required, e.g. --config=experiments/glue.py:mrpc")
    if not workdir:
        sys.exit("error: --workdir is required")
    from bertjax.convert.mapping import ConversionError
    from data_pipeline.glue import DataError

    try:
        train_and_evaluate(config, workdir)
    except (ConfigError, DataError, ConversionError, FileNotFoundError) as e:
        sys.exit(f"error: {e}")


if __name__ == "__main__":
    from absl import app, flags
    from ml_collections import config_flags

    from bertjax.cli import parse_flags

    config_flags.DEFINE_config_file("config", None, "Fine-tuning config file.")
    flags.DEFINE_string("workdir", None, "Directory for checkpoints, metrics and predictions.")
    app.run(main, flags_parser=parse_flags)
