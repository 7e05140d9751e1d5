"""Writing a config: the TOML-shaped dict of a :class:`~highrank.config.schema.Config` (only
the keys its model family reads) and TOML text that :func:`highrank.config.load_config` reads
back equal. TOML has no null, so a key whose value is unset (None) is left out.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from highrank.config.families import applies_to
from highrank.config.keys import ConfigError
from highrank.config.schema import SECTIONS, Config

# ---- writing ----------------------------------------------------------------------------------


def config_to_dict(config: Config) -> dict[str, dict[str, Any]]:
    """The TOML-shaped dict of ``config``: one table per section, head knobs beside the name,
    only the keys its model family reads. Unset keys (None) are kept; :func:`dump_toml` leaves
    them out."""
    result: dict[str, dict[str, Any]] = {}
    family = config.model.backbone
    for section in SECTIONS:
        value = getattr(config, section)
        if section == "head":
            result[section] = {"name": value.name, **value.knobs}
        else:
            table = dataclasses.asdict(value)
            result[section] = {
                k: v for k, v in table.items() if applies_to(f"{section}.{k}", family)
            }
    return result


def dump_toml(config: Config) -> str:
    """``config`` as TOML text that :func:`load_config` reads back equal."""
    out = ["# highrank experiment config (resolved)"]
    for section, table in config_to_dict(config).items():
        out += ["", *_toml_table(section, table)]
    return "\n".join(out) + "\n"


def save_config(config: Config, path: str | os.PathLike) -> None:
    """Write ``config`` as TOML to ``path`` (the run directory's resolved config)."""
    Path(path).write_text(dump_toml(config), encoding="utf-8")


def _toml_table(name: str, table: Mapping[str, Any]) -> list[str]:
    """``[name]`` with its scalar keys, then nested tables as ``[name.sub]``."""
    lines = [f"[{name}]"]
    nested = []
    for key, value in table.items():
        if value is None:
            continue
        if isinstance(value, Mapping):
            nested.append((key, value))
        else:
            lines.append(f"{_toml_key(key)} = {toml_value(value)}")
    for key, value in nested:
        lines += ["", *_toml_table(f"{name}.{_toml_key(key)}", value)]
    return lines


def _toml_key(key: str) -> str:
    return key if re.fullmatch(r"[A-Za-z0-9_-]+", key) else _toml_string(key)


def toml_value(value: Any) -> str:
    """One TOML literal: str, int, float, bool and lists of them."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        return _toml_float(value)
    if isinstance(value, str):
        return _toml_string(value)
    if isinstance(value, list | tuple):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    raise ConfigError(f"cannot write {value!r} ({type(value).__name__}) as a TOML value")


def _toml_float(value: float) -> str:
    if math.isnan(value):
        return "nan"
    if math.isinf(value):
        return "inf" if value > 0 else "-inf"
    return repr(value)  # shortest exact repr: '30.0', '1.2e-06' are valid TOML floats


def _toml_string(text: str) -> str:
    """A TOML basic string; control characters (and DEL) escaped as TOML requires."""
    escaped = []
    for char in text:
        if char in '"\\':
            escaped.append("\\" + char)
        elif char in _SHORT_ESCAPES:
            escaped.append(_SHORT_ESCAPES[char])
        elif ord(char) < 0x20 or ord(char) == 0x7F:
            escaped.append(f"\\u{ord(char):04x}")
        else:
            escaped.append(char)
    return '"' + "".join(escaped) + '"'


_SHORT_ESCAPES = {"\b": "\\b", "\t": "\\t", "\n": "\\n", "\f": "\\f", "\r": "\\r"}


__all__ = ["config_to_dict", "dump_toml", "save_config", "toml_value"]
