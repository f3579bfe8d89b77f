"""From `serve run` arguments (or a Serve config's `args`) to the config tree `AppConfig`
validates: a YAML file first, then dotted keys over it."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml


def args_tree(args: Mapping[str, Any] | None) -> dict[str, Any]:
    """The nested tree of `args`. `config=path.yaml` loads a file first, other keys override
    it; keys may be dotted (`prefill.num_replicas=2`); JSON-looking strings (`{...}`,
    `[...]`) are parsed. Mappings given in `args` are copied, never changed."""
    args = dict(args or {})
    tree: dict[str, Any] = {}
    config_file = args.pop("config", None)
    if config_file:
        loaded = yaml.safe_load(Path(config_file).read_text()) or {}
        if not isinstance(loaded, dict):
            raise ValueError(f"{config_file}: expected a mapping at the top level")
        tree.update(loaded)
    for key, value in args.items():
        if isinstance(value, str) and value[:1] in "{[":
            value = yaml.safe_load(value)
        node = tree
        *parents, leaf = key.split(".")
        for part in parents:
            child = node.get(part, {})
            if not isinstance(child, dict):
                raise ValueError(f"argument {key!r} nests under a non-mapping value")
            node[part] = dict(child)
            node = node[part]
        node[leaf] = value
    return tree
