"""Jobs for the shared training loop (bertjax/train/loop.py): pre-training (pretraining.py) and
the fine-tuning task families, each a plug-in of tasks/base.py — data, features, head, loss,
predictions, metrics and output files. Never imports TensorFlow (data_pipeline is imported
lazily, when a task reads its files).

A new family subclasses `Task` in its own module and registers its `config.task.family`
names in FAMILIES.
"""

from bertjax.errors import ConfigError
from bertjax.models.classification import BertForMultipleChoice, BertForSequenceClassification
from bertjax.tasks.base import FineTuningJob, Splits, Task
from bertjax.tasks.classification.task import SequenceTask, classification_loss, regression_loss

# config.task.family → "module:Task class" (imported when used).
FAMILIES: dict[str, str] = {
    "glue": "bertjax.tasks.classification.task:SequenceTask",
    "swag": "bertjax.tasks.classification.task:SequenceTask",
    "files": "bertjax.tasks.classification.task:SequenceTask",
    "squad": "bertjax.tasks.squad.task:SquadTask",
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
    "regression_loss",
]
