"""Jobs for the shared training loop (bertjax/train/loop.py): pre-training (pretraining.py) and
the fine-tuning task families, each a plug-in of tasks/base.py — data, features, head, loss,
predictions, metrics and output files. Never imports TensorFlow (data_pipeline is imported
lazily, when a task reads its files).

A new family subclasses `Task` in its own module and registers its `config.task.family`
names in FAMILIES.
"""

from bertjax.errors import ConfigError
from bertjax.tasks.base import FineTuningJob, Splits, Task
from bertjax.tasks.classification import (
    BertForSequenceClassification,
    SequenceTask,
    classification_loss,
    regression_loss,
)
from bertjax.tasks.multiple_choice import BertForMultipleChoice, multiple_choice_loss

# config.task.family → "module:Task class" (imported when used).
FAMILIES: dict[str, str] = {
    "glue": "bertjax.tasks.classification:SequenceTask",
    "swag": "bertjax.tasks.classification:SequenceTask",
    "files": "bertjax.tasks.classification:SequenceTask",
    "squad": "bertjax.tasks.squad:SquadTask",
    "token_classification": "bertjax.tasks.tagging.task:TokenClassificationTask",
    "feature_based": "bertjax.tasks.tagging.feature_based:FeatureBasedTask",
}


def get_task(config) -> Task:
    """The task plug-in for config.task.family, built from the config."""
    import importlib

    family = config.task.family
    if family not in FAMILIES:
        raise ConfigError(f"config.task.family={family!r} is not one of {' | '.join(FAMILIES)}")
    module, name = FAMILIES[family].split(":")
    return getattr(importlib.import_module(module), name)(config)


__all__ = [
    "FAMILIES",
    "BertForMultipleChoice",
    "BertForSequenceClassification",
    "FineTuningJob",
    "SequenceTask",
    "Splits",
    "Task",
    "classification_loss",
    "get_task",
    "multiple_choice_loss",
    "regression_loss",
]
