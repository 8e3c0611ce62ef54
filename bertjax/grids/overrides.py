"""Setting a grid's config fields from text, one way for both grids: `--set=a.b.c=value` of
`python -m bertjax.ablations` and the `--grid` values of `python -m bertjax.finetune_grid`,
each typed like the field it replaces (`bertjax.cli.typed_like`: booleans true/false/1/0,
numbers, strings as given, lists and dicts as JSON); and the nested dicts that a grid merges
into its base configs (a pre-training variant, a row's fine-tuning changes)."""

from __future__ import annotations

from typing import Any

from bertjax import cli
from bertjax.errors import ConfigError


def find_field(config, path: str) -> tuple[Any, str] | None:
    """(the group holding it, its name) of the dotted config field `path`; None if the config
    has no such field."""
    *parents, leaf = path.split(".")
    node = config
    for part in parents:
        if not hasattr(node, "keys") or part not in node:
            return None
        node = node[part]
    if not hasattr(node, "keys") or leaf not in node:
        return None
    return node, leaf


def set_from_text(node, leaf: str, text: str, where: str) -> None:
    """Sets `node[leaf]` from `text`, typed like its current value; a bad value is a
    ConfigError starting with `where`."""
    node[leaf] = cli.typed_like(node[leaf], text, where)


def apply_set(config, item: str) -> None:
    """--set=a.b.c=value: sets that field of the grid config, typed like it (JSON for lists)."""
    key, sep, text = item.partition("=")
    if not sep:
        raise ConfigError(f"--set={item}: expected key=value")
    field = find_field(config, key)
    if field is None:
        raise ConfigError(f"--set={item}: the grid config has no field {key!r}")
    set_from_text(*field, text, f"--set={item}: ")


def merge(config, overrides: dict) -> Any:
    """A copy of `config` with nested `overrides` ({"model": {"num_layers": 3}}) set."""
    config = config.copy_and_resolve_references()
    _merge_into(config, overrides, "")
    return config


def _merge_into(node, overrides: dict, prefix: str) -> None:
    for key, value in overrides.items():
        if key not in node:
            raise ConfigError(f"grid override {prefix}{key}: no such config field")
        if isinstance(value, dict) or hasattr(value, "items"):
            _merge_into(node[key], dict(value), f"{prefix}{key}.")
        else:
            node[key] = value
