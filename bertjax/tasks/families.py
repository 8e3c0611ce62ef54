"""The task families: config.task.family → its Task class, one line each. A new family is a
folder under bertjax/tasks/ and one line here."""

from __future__ import annotations

import importlib

from bertjax.errors import ConfigError

# config.task.family → "module:Task class" (imported when used).
FAMILIES: dict[str, str] = {
    "glue": "bertjax.tasks.classification.task:SequenceTask",
    "swag": "bertjax.tasks.classification.task:SequenceTask",
    "files": "bertjax.tasks.classification.task:SequenceTask",
    "squad": "bertjax.tasks.squad.task:SquadTask",
    "token_classification": "bertjax.tasks.tagging.task:TokenClassificationTask",
    "feature_based": "bertjax.tasks.tagging.feature_based:FeatureBasedTask",
    "embedding": "bertjax.tasks.embedding.task:EmbeddingTask",
    "reranking": "bertjax.tasks.reranking.task:RerankingTask",
}


def task_class(family: str) -> type:
    """The Task class of config.task.family (ConfigError naming the field if unknown)."""
    if family not in FAMILIES:
        raise ConfigError(f"config.task.family={family!r} is not one of {' | '.join(FAMILIES)}")
    module, name = FAMILIES[family].split(":")
    return getattr(importlib.import_module(module), name)


def get_task(config):
    """The task plug-in for config.task.family, built from the config."""
    return task_class(config.task.family)(config)
