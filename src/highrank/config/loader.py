"""Reading a config: defaults, then a TOML file, then ``section.key=value`` overrides, each
value type-checked, range-checked and the head's knobs checked by building the head on the
``meta`` device; every problem a :class:`~highrank.config.schema.ConfigError` naming the key,
the value, where it came from (file and line, or the override) and what was expected.
"""

from __future__ import annotations

import math
import os
import re
import tomllib
import typing
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from highrank.config.schema import (
    BACKBONES,
    MODEL_SET_KNOBS,
    SECTIONS,
    SWITCH_POLICIES,
    Config,
    ConfigError,
    HeadConfig,
    applies_to,
    key_families,
    section_fields,
)
from highrank.config.toml_writer import toml_value
from highrank.data import MODES
from highrank.data.streaming import BATCHINGS
from highrank.heads import HEADS, head_knobs
from highrank.util.checks import is_number

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
    except FileNotFoundError:
        raise ConfigError(f"config file {str(path)!r} not found") from None
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
    if isinstance(value, base) and not (base is int and isinstance(value, bool)):
        return value
    hint = "; booleans are not numbers" if isinstance(value, bool) and base in (int, float) else ""
    if base is float:
        hint = hint or " (an int is accepted)"
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


def _origin(origins: Mapping[str, str], dotted: str) -> str:
    return origins.get(dotted, "default")


# ---- value constraints ------------------------------------------------------------------------

_Rule = tuple[Callable[[Any], bool], str]


def _positive_int(v: Any) -> bool:
    return v > 0


def _non_negative(v: Any) -> bool:
    return v >= 0


def _positive_finite(v: Any) -> bool:
    return math.isfinite(v) and v > 0


def _non_negative_finite(v: Any) -> bool:
    return math.isfinite(v) and v >= 0


def _probability(v: Any) -> bool:
    return 0 <= v < 1


def _one_of(choices: Sequence[str]) -> _Rule:
    return (lambda v: v in choices), "one of: " + ", ".join(repr(c) for c in choices)


POSITIVE: _Rule = (_positive_int, "> 0")
NON_NEGATIVE: _Rule = (_non_negative, ">= 0")
POSITIVE_FINITE: _Rule = (_positive_finite, "a finite number > 0")
NON_NEGATIVE_FINITE: _Rule = (_non_negative_finite, "a finite number >= 0")
PROBABILITY: _Rule = (_probability, "a probability in [0, 1)")
NON_EMPTY: _Rule = (bool, "a non-empty string")
DEVICE: _Rule = (
    lambda v: re.fullmatch(r"auto|cpu|mps|cuda(:\d+)?", v) is not None,
    "'auto', 'cpu', 'cuda', 'cuda:N' or 'mps'",
)
SEED: _Rule = (lambda v: 0 <= v < 2**32, "an int in [0, 2**32)")
LANGUAGE: _Rule = (
    lambda v: re.fullmatch(r"[A-Za-z0-9_\-]+", v) is not None,
    "a language suffix such as 'en' (letters, digits, '_' or '-'; the split files' extension)",
)

# Dotted key -> rule; None values (unset optional keys) are not checked.
RULES: dict[str, _Rule] = {
    "data.dir": NON_EMPTY,
    "data.mode": _one_of(MODES),
    "data.cache_dir": NON_EMPTY,
    "data.src_lang": LANGUAGE,
    "data.tgt_lang": LANGUAGE,
    "data.subword_type": _one_of(("bpe", "unigram")),
    "data.subword_vocab_size": (lambda v: v > 4, "> 4 (the four special pieces and more)"),
    "data.max_vocab": (lambda v: v >= 2, ">= 2 (<eos> and <unk> at least)"),
    "data.batching": _one_of(BATCHINGS),
    "model.backbone": _one_of(BACKBONES),
    **{
        f"model.{k}": POSITIVE
        for k in (
            "d_embed",
            "d_hidden",
            "n_layers",
            "d_last",
            "n_encoder_layers",
            "n_decoder_layers",
            "n_heads",
            "d_ff",
        )
    },
    "model.positions": _one_of(("sinusoidal", "learned", "rotary")),
    "model.max_len": (lambda v: v >= 2, ">= 2"),
    "model.dropout_attention": PROBABILITY,
    "model.dropout_residual": PROBABILITY,
    **{
        f"model.{k}": PROBABILITY
        for k in (
            "dropout_embedding",
            "dropout_input",
            "dropout_hidden",
            "dropout_output",
            "weight_drop",
        )
    },
    "model.ar_alpha": NON_NEGATIVE_FINITE,
    "model.tar_beta": NON_NEGATIVE_FINITE,
    **{
        f"train.{k}": POSITIVE
        for k in (
            "batch_size",
            "bptt",
            "epochs",
            "nonmono",
            "switch_epoch",
            "eval_batch_size",
            "test_batch_size",
            "log_every",
            "checkpoint_every",
            "chunk_size",
            "max_tokens",
            "eval_every",
        )
    },
    "train.label_smoothing": PROBABILITY,
    "train.warmup_steps": NON_NEGATIVE,
    "train.lr_schedule": _one_of(("inverse-sqrt", "cosine")),
    "train.adam_beta2": PROBABILITY,
    "train.accumulate": POSITIVE,
    "decode.beam_size": POSITIVE,
    "decode.length_penalty": NON_NEGATIVE_FINITE,
    "decode.max_len_a": NON_NEGATIVE_FINITE,
    "decode.max_len_b": POSITIVE,
    "train.max_seq_len_delta": NON_NEGATIVE,
    "train.max_nonfinite_skips": NON_NEGATIVE,
    "train.checkpoint_minutes": NON_NEGATIVE_FINITE,
    "train.lr": POSITIVE_FINITE,
    "train.weight_decay": NON_NEGATIVE_FINITE,
    "train.clip": NON_NEGATIVE_FINITE,
    "train.optimizer": _one_of(SWITCH_POLICIES),
    "train.seed": SEED,
    "finetune.lr": POSITIVE_FINITE,
    "finetune.epochs": NON_NEGATIVE,
    "finetune.max_seq_len_delta": NON_NEGATIVE,
    "dynamic_eval.lr": POSITIVE_FINITE,
    "dynamic_eval.epsilon": POSITIVE_FINITE,
    "dynamic_eval.prior_decay": NON_NEGATIVE_FINITE,
    **{f"dynamic_eval.{k}": POSITIVE for k in ("batch_size", "bptt", "stats_batch_size")},
    "run.out_dir": NON_EMPTY,
    "run.device": DEVICE,
}


def validate_config(config: Config, origins: Mapping[str, str] | None = None) -> None:
    """Check the head's name and knobs, value ranges and cross-key rules (also for a Config
    built in code); ``origins`` maps dotted keys to their source for the messages."""
    origins = dict(origins or {})
    _build_head({"name": config.head.name, **config.head.knobs}, origins)
    for dotted, (accepts, expected) in RULES.items():
        section, key = dotted.split(".")
        value = getattr(getattr(config, section), key)
        if value is not None and not accepts(value):
            raise ConfigError(
                f"{_origin(origins, dotted)}: {dotted} = {_show(value)} is out of range; "
                f"expected {expected}"
            )
    _validate_head_values(config, origins)
    _validate_switch_epoch(config, origins)
    _validate_streaming(config, origins)
    if config.model.backbone == "seq2seq":
        _validate_seq2seq(config, origins)
    if config.model.backbone == "transformer":
        _validate_transformer(config, origins)


def _validate_head_values(config: Config, origins: Mapping[str, str]) -> None:
    """The head's own checks of its knobs' values (n_components > 0, dropouts in [0, 1),
    PLIF low < high, ...), run now by building the head on the ``meta`` device (nothing is
    allocated; the vocabulary is not known yet, so a placeholder size stands in), and reported
    as a ConfigError naming the key, its value and where it was set."""
    name, knobs = config.head.name, dict(config.head.knobs)
    error = _head_error(name, knobs, config.model.d_embed)
    if error is None:
        return
    defaults = _configurable_knobs(name)
    alone = [k for k in knobs if _head_error(name, {k: knobs[k]}, config.model.d_embed)]
    culprits = alone[:1] or [k for k in knobs if knobs[k] != defaults.get(k)] or list(knobs)
    shown = ", ".join(f"head.{k} = {_show(knobs[k])}" for k in culprits)
    where = _origin(origins, f"head.{culprits[0]}") if culprits else "default"
    verb = "is" if len(culprits) == 1 else "are"
    raise ConfigError(f"{where}: {shown} {verb} out of range; {error}")


_PLACEHOLDER_VOCAB = 10_000  # the knobs' checks do not depend on the vocabulary size


def _head_error(name: str, knobs: Mapping[str, Any], d_embed: int) -> str | None:
    """The head constructor's complaint about ``knobs`` (None when it accepts them). Boolean
    knobs are type-checked already and left at False: weight normalisation's first use costs
    seconds of imports."""
    import torch

    from highrank.heads import build_head

    knobs = {k: (False if isinstance(v, bool) else v) for k, v in knobs.items()}
    try:
        with torch.device("meta"):
            build_head(name, d_in=d_embed, vocab_size=_PLACEHOLDER_VOCAB, d_embed=d_embed, **knobs)
    except (ValueError, TypeError) as error:
        return str(error)
    return None


def _validate_switch_epoch(config: Config, origins: Mapping[str, str]) -> None:
    train = config.train
    if train.optimizer == "et-asgd" and train.switch_epoch >= train.epochs:
        raise ConfigError(
            f"{_origin(origins, 'train.switch_epoch')}: train.switch_epoch = "
            f"{train.switch_epoch} with train.epochs = {train.epochs}: et-asgd switches after "
            f"epoch switch_epoch, so it would never average; lower train.switch_epoch or raise "
            f"train.epochs"
        )


def _validate_streaming(config: Config, origins: Mapping[str, str]) -> None:
    """data.max_vocab and sentence batching are features of the memory-mapped loader."""
    data = config.data
    if not applies_to("data.memmap", config.model.backbone):
        return  # seq2seq: its family check names the key instead
    for dotted, used in (
        ("data.max_vocab", data.max_vocab is not None),
        ("data.batching", data.batching == "sentences"),
    ):
        if used and not data.memmap:
            value = getattr(data, dotted.split(".")[1])
            raise ConfigError(
                f"{_origin(origins, dotted)}: {dotted} = {_show(value)} needs the memory-mapped "
                f"corpus loader, but data.memmap = false; set data.memmap = true"
            )


def _validate_seq2seq(config: Config, origins: Mapping[str, str]) -> None:
    """Cross-key rules of a translation config."""
    data, model = config.data, config.model
    if data.src_lang == data.tgt_lang:
        raise ConfigError(
            f"{_origin(origins, 'data.tgt_lang')}: data.tgt_lang = {_show(data.tgt_lang)} is also "
            f"data.src_lang; expected two languages"
        )
    if model.d_embed % model.n_heads:
        raise ConfigError(
            f"{_origin(origins, 'model.n_heads')}: model.n_heads = {model.n_heads} does not "
            f"divide model.d_embed = {model.d_embed}; expected a divisor"
        )
    if model.share_embeddings and not data.subword_joint:
        raise ConfigError(
            f"{_origin(origins, 'model.share_embeddings')}: model.share_embeddings = true needs "
            f"one joint vocabulary, but data.subword_joint = false; set one of them"
        )


def _validate_transformer(config: Config, origins: Mapping[str, str]) -> None:
    """Cross-key rules of a decoder-only Transformer LM config."""
    model, train = config.model, config.train
    if model.d_embed % model.n_heads:
        raise ConfigError(
            f"{_origin(origins, 'model.n_heads')}: model.n_heads = {model.n_heads} does not "
            f"divide model.d_embed = {model.d_embed}; expected a divisor"
        )
    if model.positions == "rotary" and (model.d_embed // model.n_heads) % 2:
        raise ConfigError(
            f"{_origin(origins, 'model.positions')}: rotary positions rotate pairs of "
            f"features, but d_embed / n_heads = {model.d_embed // model.n_heads} is odd"
        )
    if model.positions == "learned" and model.max_len < train.bptt:
        raise ConfigError(
            f"{_origin(origins, 'model.max_len')}: model.max_len = {model.max_len} is shorter "
            f"than the windows (train.bptt = {train.bptt}) the learned positions must cover; "
            f"expected max_len >= bptt"
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


__all__ = ["RULES", "config_from_dict", "load_config", "parse_override", "validate_config"]
