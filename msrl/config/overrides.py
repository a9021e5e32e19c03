"""Dotted overrides (``key.sub=value``, values read as YAML) and reading a config file without
validating it."""

from __future__ import annotations

import pathlib
from typing import Any, Mapping, Sequence

import yaml

from msrl.errors import ConfigError

__all__ = ["parse_overrides", "apply_overrides", "set_values", "read_config"]


def parse_overrides(overrides: Sequence[str]) -> list[tuple[list[str], Any]]:
    """Parses ``key.sub=value`` strings (values read as YAML: ``3``, ``true``, ``[64, 64]``).

    Raises:
        ConfigError: an override without ``=``, with an empty key part, or an unreadable value.
    """
    out = []
    for o in overrides:
        key, sep, raw = o.partition("=")
        if not sep or not key or any(not part for part in key.split(".")):
            raise ConfigError(f"bad override {o!r}: expected key.sub=value (e.g. train.total_env_steps=100000)")
        try:
            value = yaml.safe_load(raw) if raw else None
        except yaml.YAMLError as e:
            raise ConfigError(f"bad override {o!r}: the value is not valid YAML ({e})") from None
        out.append((key.split("."), value))
    return out


def apply_overrides(raw: Mapping[str, Any], overrides: Sequence[str]) -> dict[str, Any]:
    """Returns a copy of ``raw`` with dotted overrides set (validation happens later).

    Raises:
        ConfigError: a malformed override, or one that descends into a plain value.
    """
    return set_values(raw, parse_overrides(overrides))


def set_values(raw: Mapping[str, Any], values: Sequence[tuple[list[str], Any]]) -> dict[str, Any]:
    """Returns a copy of ``raw`` with each ``(key path, value)`` set (validation happens later).

    Raises:
        ConfigError: a path that descends into a plain value.
    """
    import copy

    data = copy.deepcopy(dict(raw))
    for path, value in values:
        node = data
        for i, part in enumerate(path[:-1]):
            nxt = node.get(part)
            if nxt is None:
                nxt = node[part] = {}
            if not isinstance(nxt, dict):
                where = ".".join(path[: i + 1])
                raise ConfigError(f"bad override {'.'.join(path)}={value!r}: {where!r} is a value, not a section")
            node = nxt
        node[path[-1]] = value
    return data


def read_config(path: str | pathlib.Path, overrides: Sequence[str] = ()) -> dict[str, Any]:
    """Reads a config file and applies dotted overrides, without validating it (nothing is
    imported: the ``msrl`` command reads what its process start-up depends on from it).

    Raises:
        ConfigError: unreadable file, invalid YAML, a top level that is not a mapping, or a
            malformed override.
    """
    p = pathlib.Path(path)
    try:
        text = p.read_text()
    except OSError as e:
        raise ConfigError(f"cannot read config {str(p)!r}: {e.strerror}") from None
    try:
        raw = yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise ConfigError(f"{p}: invalid YAML: {e}") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{p}: the top level must be a mapping of keys, got {type(raw).__name__}")
    return apply_overrides(raw, overrides)

