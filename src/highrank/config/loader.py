"""Reading a config: defaults, then a TOML file, then ``section.key=value`` overrides, each
value type-checked, range-checked and the head's knobs checked by building the head on the
``meta`` device; every problem a :class:`~highrank.config.schema.ConfigError` naming the key,
the value, where it came from (file and line, or the override) and what was expected.
"""

from __future__ import annotations

import os
import re
import tomllib
import typing
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from highrank.config import families
from highrank.config.families import applies_to, key_families
from highrank.config.keys import (
    DEVICE,
    NON_EMPTY,
    NON_NEGATIVE,
    NON_NEGATIVE_FINITE,
    POSITIVE,
    POSITIVE_FINITE,
    SEED,
    ConfigError,
    Rule,
    one_of,
)
from highrank.config.schema import (
    BACKBONES,
    MODEL_SET_KNOBS,
    SECTIONS,
    Config,
    HeadConfig,
    section_fields,
)
from highrank.config.toml_writer import toml_value
from highrank.data import MODES
from highrank.heads import HEADS, build_head, head_knobs
from highrank.util.checks import is_number
from highrank.util.paths import config_file_problem

# ---- loading --------------------------------------------------------------------------------

# Raw values per section, as read (before type checks), and where each dotted key came from.
_Values = dict[str, dict[str, Any]]
_Origins = dict[str, str]


def load_config(path: str | os.PathLike | None = None, overrides: Sequence[str] = ()) -> Config:
    """Defaults, then the TOML file at ``path`` (if any), then ``overrides``; validated."""
    data: dict[str, Any] = {}
    lines: dict[str, int] = {}
    source = "<defaults>"
    if path is not None:
        source = str(path)
        text = _read_text(Path(path))
        data = _parse_toml(text, source)
        lines = _key_lines(text)
    return _resolve(data, overrides, source, lines)


def config_from_dict(
    data: Mapping[str, Any], overrides: Sequence[str] = (), *, source: str = "<dict>"
) -> Config:
    """Like :func:`load_config` for an already parsed TOML-shaped mapping (e.g. from a
    checkpoint); ``source`` names it in error messages."""
    return _resolve(data, overrides, source, {})


def _resolve(
    data: Mapping[str, Any], overrides: Sequence[str], source: str, lines: dict[str, int]
) -> Config:
    values: _Values = {}
    origins: _Origins = {}
    _merge_file(values, origins, data, source, lines)
    for text in overrides:
        _apply_override(values, origins, text)
    config = _build(values, origins)
    validate_config(config, origins)
    _check_family_keys(config.model.backbone, origins)
    return config


def _read_text(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except (FileNotFoundError, IsADirectoryError):  # the closest names, or "a folder"
        problem = config_file_problem(path) or f"config file {str(path)!r} not found"
        raise ConfigError(problem) from None
    except (OSError, UnicodeDecodeError) as error:
        raise ConfigError(f"cannot read config file {str(path)!r}: {error}") from None


def _parse_toml(text: str, source: str) -> dict[str, Any]:
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as error:
        raise ConfigError(f"{source}: invalid TOML: {error}") from None


def _key_lines(text: str) -> dict[str, int]:
    """Dotted key -> line number (1-based) of its first assignment, for error messages.

    A cheap line scanner (table headers and ``key =`` lines), not a TOML parser: a multi-line
    string that looks like an assignment may mislead it, and then a message names a wrong line.
    """
    lines: dict[str, int] = {}
    table = ""
    for number, line in enumerate(text.splitlines(), start=1):
        header = re.match(r"\s*\[([^\[\]]+)\]\s*(#.*)?$", line)
        if header:
            table = _unquote_dotted(header.group(1))
            lines.setdefault(table, number)
            continue
        assignment = re.match(r"\s*([A-Za-z0-9_\-.\"' ]+?)\s*=", line)
        if assignment:
            key = _unquote_dotted(assignment.group(1))
            lines.setdefault(f"{table}.{key}" if table else key, number)
    return lines


def _unquote_dotted(key: str) -> str:
    return ".".join(part.strip().strip("\"'") for part in key.split("."))


def _file_origin(source: str, lines: dict[str, int], dotted: str) -> str:
    section = dotted.split(".")[0]
    line = lines.get(dotted) or lines.get(section)
    return f"{source}, line {line}" if line else source


def _merge_file(
    values: _Values,
    origins: _Origins,
    data: Mapping[str, Any],
    source: str,
    lines: dict[str, int],
) -> None:
    for section, table in data.items():
        where = _file_origin(source, lines, section)
        _check_section(section, where)
        if not isinstance(table, Mapping):
            raise ConfigError(
                f"{where}: {section!r} must be a table ([{section}]), got {table!r} "
                f"({type(table).__name__})"
            )
        for key, value in table.items():
            dotted = f"{section}.{key}"
            where = _file_origin(source, lines, dotted)
            _check_key(section, key, where)
            values.setdefault(section, {})[key] = value
            origins[dotted] = where


def _check_section(section: str, where: str) -> None:
    if section not in SECTIONS:
        raise ConfigError(
            f"{where}: unknown section {section!r}; valid sections: {', '.join(SECTIONS)}"
        )


def _check_key(section: str, key: str, where: str) -> None:
    """Unknown keys are errors; [head] takes any knob here, checked once the name is final."""
    fields = section_fields(section)
    if section != "head" and key not in fields:
        raise ConfigError(
            f"{where}: unknown key '{section}.{key}'; valid keys in [{section}]: "
            f"{', '.join(fields)}"
        )


# ---- overrides --------------------------------------------------------------------------------


def parse_override(text: str) -> tuple[str, str, str]:
    """``"--section.key=value"`` -> (section, key, value text); a bad shape is a ConfigError."""
    body = text[2:] if text.startswith("--") else text
    if "=" not in body:
        raise ConfigError(
            f"override {text!r} has no '='; write section.key=value, e.g. train.lr=20"
        )
    dotted, value = (part.strip() for part in body.split("=", 1))
    parts = dotted.split(".")
    if len(parts) != 2 or not all(parts):
        raise ConfigError(
            f"override {text!r}: the key {dotted!r} must be section.key, e.g. train.lr=20 "
            f"(sections: {', '.join(SECTIONS)})"
        )
    return parts[0], parts[1], value


def _parse_literal(text: str, expected: Any) -> Any:
    """A TOML literal when ``text`` is one, else the text; string fields keep the text."""
    try:
        value = tomllib.loads(f"value = {text}")["value"]
    except tomllib.TOMLDecodeError:
        return text
    if expected is str and not isinstance(value, str):
        return text
    return value


def _apply_override(values: _Values, origins: _Origins, text: str) -> None:
    section, key, value_text = parse_override(text)
    where = f"override {text!r}"
    _check_section(section, where)
    _check_key(section, key, where)
    expected = section_fields(section).get(key)
    values.setdefault(section, {})[key] = _parse_literal(value_text, expected)
    origins[f"{section}.{key}"] = where


# ---- building and type checks -----------------------------------------------------------------


def _build(values: _Values, origins: _Origins) -> Config:
    sections: dict[str, Any] = {}
    for section, cls in SECTIONS.items():
        given = values.get(section, {})
        if section == "head":
            sections[section] = _build_head(given, origins)
            continue
        hints = typing.get_type_hints(cls)
        kwargs = {
            key: _check_type(f"{section}.{key}", value, hints[key], origins)
            for key, value in given.items()
        }
        sections[section] = cls(**kwargs)
    return Config(**sections)


def _build_head(given: dict[str, Any], origins: _Origins) -> HeadConfig:
    """Check the name, then every knob against that head's signature; fill in the defaults."""
    name = _check_type("head.name", given.get("name", HeadConfig.name), str, origins)
    if name not in HEADS:
        raise ConfigError(
            f"{_origin(origins, 'head.name')}: head.name = {_show(name)} is not a known head; "
            f"choose one of: {', '.join(HEADS)}"
        )
    defaults = _configurable_knobs(name)
    knobs = {key: value for key, value in defaults.items() if value is not None}
    for key, value in given.items():
        if key != "name":
            knobs[key] = _check_knob(name, key, value, defaults, origins)
    return HeadConfig(name=name, knobs=knobs)


def _configurable_knobs(name: str) -> dict[str, Any]:
    return {k: v for k, v in head_knobs(name).items() if k not in MODEL_SET_KNOBS}


def _check_knob(
    name: str, key: str, value: Any, defaults: dict[str, Any], origins: _Origins
) -> Any:
    dotted = f"head.{key}"
    where = _origin(origins, dotted)
    if key in MODEL_SET_KNOBS:
        raise ConfigError(
            f"{where}: {dotted} is set by the model from [model] (d_embed, tie_weights), "
            f"not in [head]; remove it"
        )
    if key not in defaults:
        valid = ", ".join(f"{k} (default {v!r})" for k, v in defaults.items()) or "none"
        raise ConfigError(
            f"{where}: head {name!r} has no knob {key!r}; valid knobs for {name!r}: {valid}"
        )
    default = defaults[key]
    return value if default is None else _check_type(dotted, value, type(default), origins)


def _check_type(dotted: str, value: Any, expected: Any, origins: _Origins) -> Any:
    """``value`` if it has type ``expected`` (int -> float converted); else a ConfigError."""
    options = typing.get_args(expected) if typing.get_origin(expected) is not None else ()
    if type(None) in options:
        if value is None:
            return None
        expected = next(t for t in options if t is not type(None))
    base = typing.get_origin(expected) or expected
    if base is float and is_number(value):
        return float(value)
    if base is int and isinstance(value, int) and not INT64[0] <= value <= INT64[1]:
        raise ConfigError(  # torch's sizes are 64-bit too: beyond, C++ frames, not a message
            f"{_origin(origins, dotted)}: {dotted} = {value} is out of range; TOML integers "
            f"are 64-bit: expected one in [{INT64[0]}, {INT64[1]}]"
        )
    if isinstance(value, base) and not (base is int and isinstance(value, bool)):
        return value
    hint = "; booleans are not numbers" if isinstance(value, bool) and base in (int, float) else ""
    if base is float:
        hint = hint or " (an int is accepted)"
    if base is bool and isinstance(value, str) and value.lower() in ("true", "false"):
        unquoted = value == value.lower()  # "true" in quotes is a string
        hint = f" (TOML booleans are {'unquoted' if unquoted else 'lower case'}: {value.lower()})"
    raise ConfigError(
        f"{_origin(origins, dotted)}: {dotted} = {_show(value)} has type {type(value).__name__}; "
        f"expected {base.__name__}{hint}"
    )


def _show(value: Any) -> str:
    """A value as the user would write it in TOML (``true``, ``"x"``), else its repr."""
    try:
        return toml_value(value)
    except ConfigError:
        return repr(value)


# where a key came from when no file line or override set it
UNSET_ORIGIN = "a default or a value set in code"


def _origin(origins: Mapping[str, str], dotted: str, *others: str) -> str:
    """Where ``dotted`` was set (``FILE:LINE``, ``override 'k=v'``) for an error's start; for
    a rule over several keys, the first of them (``dotted``, then ``others``) that the user set."""
    for key in (dotted, *others):
        if key in origins:
            return origins[key]
    return UNSET_ORIGIN


# ---- value constraints ------------------------------------------------------------------------

# Dotted key -> rule for the keys every family reads; None values (unset optional keys) are not
# checked. The keys of some families only carry the rules their families declare
# (:func:`rules`).
RULES: dict[str, Rule] = {
    "data.dir": NON_EMPTY,
    "data.mode": one_of(MODES),
    "data.cache_dir": NON_EMPTY,
    "model.backbone": one_of(BACKBONES),
    "model.d_embed": POSITIVE,
    **{
        f"train.{k}": POSITIVE
        for k in (
            "batch_size",
            "bptt",
            "epochs",
            "eval_batch_size",
            "test_batch_size",
            "log_every",
            "checkpoint_every",
            "chunk_size",
            "patience",
        )
    },
    "train.max_nonfinite_skips": NON_NEGATIVE,
    "train.patience_min_delta": NON_NEGATIVE_FINITE,
    "train.checkpoint_minutes": NON_NEGATIVE_FINITE,
    "train.lr": POSITIVE_FINITE,
    "train.weight_decay": NON_NEGATIVE_FINITE,
    "train.clip": NON_NEGATIVE_FINITE,
    "train.seed": SEED,
    "finetune.lr": POSITIVE_FINITE,
    "finetune.epochs": NON_NEGATIVE,
    "dynamic_eval.lr": POSITIVE_FINITE,
    "dynamic_eval.epsilon": POSITIVE_FINITE,
    "dynamic_eval.prior_decay": NON_NEGATIVE_FINITE,
    **{f"dynamic_eval.{k}": POSITIVE for k in ("batch_size", "bptt", "stats_batch_size")},
    "run.out_dir": NON_EMPTY,
    "run.device": DEVICE,
}


def rules() -> dict[str, Rule]:
    """Dotted key -> rule for every key with one: :data:`RULES` and the family keys' rules
    (of every family, so a key's range is checked before whether the family reads it), in
    section and field order."""
    found = dict(RULES)
    for family in families.FAMILIES.values():
        for section, keys in family.keys.items():
            for key, rule in keys.items():
                dotted = f"{section}.{key}"
                if rule is None:
                    continue
                if found.setdefault(dotted, rule) is not rule:
                    raise AssertionError(f"families declare two rules for {dotted}")
    order = {
        f"{section}.{key}": (i, j)
        for i, section in enumerate(SECTIONS)
        for j, key in enumerate(section_fields(section))
    }
    return dict(sorted(found.items(), key=lambda item: order[item[0]]))


def validate_config(config: Config, origins: Mapping[str, str] | None = None) -> None:
    """Check the head's name and knobs, value ranges and cross-key rules (also for a Config
    built in code); ``origins`` maps dotted keys to their source for the messages."""
    origins = dict(origins or {})
    _build_head({"name": config.head.name, **config.head.knobs}, origins)
    for dotted, (accepts, expected) in rules().items():
        section, key = dotted.split(".")
        value = getattr(getattr(config, section), key)
        if value is not None and not accepts(value):
            raise ConfigError(
                f"{_origin(origins, dotted)}: {dotted} = {_show(value)} is out of range; "
                f"expected {expected}"
            )
    _validate_head_values(config, origins)
    _validate_switch_epoch(config, origins)
    family = families.FAMILIES[config.model.backbone]
    _validate_head_inputs(config, origins, family)
    family.check(config, lambda dotted: _origin(origins, dotted), _show)


def _validate_head_inputs(config: Config, origins: Mapping[str, str], family) -> None:
    """A head that reads more than hidden states (MFS, CPR: other layers, the context's
    tokens) needs a family that gives them (``Family.head_layers``)."""
    import torch

    name = config.head.name
    if HEADS[name].reads == ("hidden",):
        return
    with torch.device("meta"):
        head = build_head(
            name, d_in=config.model.d_embed, vocab_size=_PLACEHOLDER_VOCAB, **config.head.knobs
        )
    backbone = f"model.backbone = {_show(config.model.backbone)}"
    if family.head_layers is None:
        raise ConfigError(
            f"{_origin(origins, 'head.name')}: head.name = {_show(name)} reads "
            f"{', '.join(head.reads)}, but {backbone} gives a head its hidden states alone; "
            "choose another head"
        )
    given, why = family.head_layers(config)
    if "layers" in head.reads and head.input_layers > given:
        raise ConfigError(
            f"{_origin(origins, 'head.input_layers')}: head.input_layers = "
            f"{head.input_layers} is more layers than {backbone} gives a head ({given}: {why})"
            "; set head.input_layers <= " + f"{given} (or head.multi_input = false)"
        )


def _validate_head_values(config: Config, origins: Mapping[str, str]) -> None:
    """The head's own checks of its knobs' values (n_components > 0, dropouts in [0, 1),
    PLIF low < high, ...), run now by building the head on the ``meta`` device (nothing is
    allocated; the vocabulary is not known yet, so a placeholder size stands in), and reported
    as a ConfigError naming the key, its value and where it was set."""
    name, knobs = config.head.name, dict(config.head.knobs)
    error = _head_error(name, knobs, config.model.d_embed)
    if error is None:
        return
    alone = _head_error(name, {}, config.model.d_embed) if knobs else error
    if alone is not None:  # the head refuses the model's width whatever its knobs
        raise ConfigError(
            f"{_origin(origins, 'model.d_embed')}: model.d_embed = {config.model.d_embed} is "
            f"out of range for head {name!r}; {alone}"
        )
    defaults = _configurable_knobs(name)
    alone = [k for k in knobs if _head_error(name, {k: knobs[k]}, config.model.d_embed)]
    culprits = alone[:1] or [k for k in knobs if knobs[k] != defaults.get(k)] or list(knobs)
    shown = ", ".join(f"head.{k} = {_show(knobs[k])}" for k in culprits)
    where = _origin(origins, f"head.{culprits[0]}") if culprits else UNSET_ORIGIN
    verb = "is" if len(culprits) == 1 else "are"
    raise ConfigError(f"{where}: {shown} {verb} out of range; {error}")


_PLACEHOLDER_VOCAB = 10_000  # the knobs' checks do not depend on the vocabulary size
INT64 = (-(2**63), 2**63 - 1)  # what a TOML integer (and a torch size) can be


def _head_error(name: str, knobs: Mapping[str, Any], d_embed: int) -> str | None:
    """The head constructor's complaint about ``knobs`` (None when it accepts them). Boolean
    knobs are type-checked already and left at False: weight normalisation's first use costs
    seconds of imports."""
    import torch

    knobs = {k: (False if isinstance(v, bool) else v) for k, v in knobs.items()}
    try:
        with torch.device("meta"):
            build_head(name, d_in=d_embed, vocab_size=_PLACEHOLDER_VOCAB, d_embed=d_embed, **knobs)
    except (ValueError, TypeError) as error:
        return str(error)
    except RuntimeError as error:  # a size whose tensor no machine holds (numel overflows)
        reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        return f"one of its tensors would hold more elements than any machine has ({reason})"
    return None


def _validate_switch_epoch(config: Config, origins: Mapping[str, str]) -> None:
    train = config.train
    if train.latest_switch_epoch is not None and train.optimizer != "nt-asgd":
        raise ConfigError(
            f"{_origin(origins, 'train.latest_switch_epoch', 'train.optimizer')}: "
            f"train.latest_switch_epoch bounds "
            f"nt-asgd's switch; train.optimizer is {train.optimizer!r} (use nt-asgd, or unset it)"
        )
    if train.optimizer == "et-asgd" and train.switch_epoch >= train.epochs:
        raise ConfigError(
            f"{_origin(origins, 'train.switch_epoch', 'train.epochs', 'train.optimizer')}: "
            f"train.switch_epoch = "
            f"{train.switch_epoch} with train.epochs = {train.epochs}: et-asgd switches after "
            f"epoch switch_epoch, so it would never average; lower train.switch_epoch or raise "
            f"train.epochs"
        )


def _check_family_keys(family: str, origins: Mapping[str, str]) -> None:
    """A key given in the file or an override must be one the chosen family reads."""
    for dotted, where in origins.items():
        if "." in dotted and not applies_to(dotted, family):
            owners = ", ".join(repr(f) for f in key_families(dotted))
            raise ConfigError(
                f"{where}: {dotted} is a key of model.backbone = {owners}, but "
                f"model.backbone = {family!r}; remove it (or change model.backbone)"
            )


__all__ = [
    "RULES",
    "config_from_dict",
    "load_config",
    "parse_override",
    "rules",
    "validate_config",
]
