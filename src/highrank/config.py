"""Experiment configuration: dataclasses are the schema, TOML files are experiments.

``load_config(path, overrides)`` starts from the defaults below, merges a TOML file onto them,
then applies ``section.key=value`` overrides (a leading ``--`` is accepted), in that order, so
an override beats the file. Override values are read as TOML literals (``train.lr=20``,
``model.tie_weights=false``, ``head.name="mos"``) and otherwise as plain strings
(``head.name=mos``); a string field keeps the text as typed (``run.out_dir=2024``).

Everything is checked: an unknown section or key, a value of the wrong type (an int is
accepted for a float, a bool never for a number) or out of range is a :class:`ConfigError`
naming the dotted key, the value, where it came from (file and line, or the override) and what
was expected. A run writes its resolved config with :func:`dump_toml` / :func:`save_config`;
``load_config`` reads it back equal.

Sections and keys (defaults: AWD-LSTM with a softmax head on Penn Treebank, Merity et al. 2018;
the MoS values of Yang et al. 2018 are in the docstrings):

* ``[data]`` dir, mode (``word`` | ``char``), cache_dir (unset: the user cache, ~/.cache/highrank) —
  :func:`highrank.data.load_corpus`; for ``awd-lstm`` and ``transformer`` memmap, max_vocab,
  batching (``stream`` | ``sentences``) — :func:`highrank.data.streaming.load_stream_corpus`; for
  ``seq2seq`` (a parallel corpus, :mod:`highrank.mt.bitext`)
  src_lang, tgt_lang, subword_type, subword_vocab_size, subword_joint (:mod:`highrank.mt.subwords`).
* ``[model]`` backbone (the model family: ``awd-lstm`` | ``seq2seq`` | ``transformer``), d_embed,
  tie_weights, and
  the keys of the family: for ``awd-lstm`` d_hidden, n_layers, d_last (unset: d_embed),
  dropout_embedding, dropout_input, dropout_hidden, dropout_output, weight_drop, ar_alpha,
  tar_beta; for ``seq2seq`` (:class:`highrank.backbones.seq2seq.TransformerSeq2Seq`, d_model =
  d_embed) n_encoder_layers, n_decoder_layers, n_heads, d_ff (unset: 4 d_embed), positions,
  max_len, dropout_input, dropout_attention, dropout_residual, share_embeddings; for
  ``transformer`` (:class:`highrank.backbones.transformer.CausalTransformer`, d_model =
  d_embed) n_layers, n_heads, d_ff (unset: 4 d_embed), positions, max_len, dropout_input,
  dropout_attention, dropout_residual.
* ``[head]`` name (a key of :data:`highrank.heads.HEADS`) and, in the same table, that head's
  knobs (``n_components = 15``), checked against :func:`highrank.heads.head_knobs`. The knobs
  the model wires itself (:data:`MODEL_SET_KNOBS`) are not configurable here. A loaded config
  holds every knob, defaults filled in, so the written config records them.
* ``[train]`` batch_size, bptt, max_seq_len_delta, lr, weight_decay, clip, epochs, optimizer
  (``nt-asgd`` | ``et-asgd`` | ``sgd``, see :mod:`highrank.train.asgd`), nonmono, switch_epoch,
  seed, eval_batch_size, test_batch_size, log_every, checkpoint_every, checkpoint_minutes,
  chunk_size (unset: "auto"), max_nonfinite_skips.
  ``seq2seq`` reads max_tokens, label_smoothing, warmup_steps, lr_schedule, adam_beta2,
  eval_every (:mod:`highrank.train.seq2seq`) besides lr, weight_decay, clip, epochs, seed,
  log_every, checkpoint_every, chunk_size, max_nonfinite_skips.
  ``transformer`` reads warmup_steps, lr_schedule, adam_beta2, eval_every, accumulate, bf16
  (:mod:`highrank.train.transformer`) besides the keys every family reads.
* ``[finetune]`` lr, epochs, max_seq_len_delta.
* ``[dynamic_eval]`` lr, epsilon, prior_decay, batch_size, bptt, stats_batch_size (Krause
  et al. 2017).
* ``[decode]`` (``seq2seq``) beam_size, length_penalty, max_len_a, max_len_b
  (:mod:`highrank.mt.translation`).
* ``[run]`` out_dir, device.

TOML has no null, so a key whose default is "unset" (None) is written by leaving it out.

Model families: ``model.backbone`` picks the family (the backbone :func:`highrank.model.
build_model` builds and the recipe :mod:`highrank.train` trains it with). Keys that only some
families read are listed per family in :data:`FAMILY_KEYS`; every other key is read by all.
Setting a key of another family is an error naming the key and its families, and a resolved
config (:func:`config_to_dict`, :func:`dump_toml`, checkpoints) holds only the keys of its
family, so it reads back. Growing a family: add its name to :data:`BACKBONES`, its keys to the
section dataclasses (with defaults) and their names to ``FAMILY_KEYS[name]``.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
import tomllib
import typing
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from highrank.data import MODES
from highrank.data.streaming import BATCHINGS
from highrank.heads import HEADS, head_knobs

BACKBONES = ("awd-lstm", "seq2seq", "transformer")  # model.backbone: the model families
# train.optimizer: the SGD -> ASGD switch policies of highrank.train.asgd (which reads them here)
SWITCH_POLICIES = ("nt-asgd", "et-asgd", "sgd")
# Family -> section -> the keys of that section only this family (and any other family listing
# them too) reads; a key listed for no family is read by every family.
STREAM_DATA_KEYS = ("memmap", "max_vocab", "batching")  # the stream LMs' corpus on disk
FAMILY_KEYS: dict[str, dict[str, tuple[str, ...]]] = {
    "awd-lstm": {
        "data": STREAM_DATA_KEYS,
        "model": (
            "d_hidden",
            "n_layers",
            "d_last",
            "dropout_embedding",
            "dropout_input",
            "dropout_hidden",
            "dropout_output",
            "weight_drop",
            "ar_alpha",
            "tar_beta",
        ),
        "train": ("max_seq_len_delta", "optimizer", "nonmono", "switch_epoch"),
        "finetune": ("max_seq_len_delta",),
    },
    "seq2seq": {
        "data": ("src_lang", "tgt_lang", "subword_type", "subword_vocab_size", "subword_joint"),
        "model": (
            "n_encoder_layers",
            "n_decoder_layers",
            "n_heads",
            "d_ff",
            "positions",
            "max_len",
            "dropout_input",
            "dropout_attention",
            "dropout_residual",
            "share_embeddings",
        ),
        "train": (
            "max_tokens",
            "label_smoothing",
            "warmup_steps",
            "lr_schedule",
            "adam_beta2",
            "eval_every",
        ),
        "decode": ("beam_size", "length_penalty", "max_len_a", "max_len_b"),
    },
    "transformer": {
        "data": STREAM_DATA_KEYS,
        "model": (
            "n_layers",
            "n_heads",
            "d_ff",
            "positions",
            "max_len",
            "dropout_input",
            "dropout_attention",
            "dropout_residual",
        ),
        "train": (
            "warmup_steps",
            "lr_schedule",
            "adam_beta2",
            "eval_every",
            "accumulate",
            "bf16",
        ),
    },
}
# Head constructor arguments that the model sets from [model], not the user from [head].
MODEL_SET_KNOBS = ("d_embed", "tied_weight", "dropout_time_dim")


class ConfigError(ValueError):
    """Bad configuration: the message names the dotted key, the value, its source and the fix."""


# ---- schema ---------------------------------------------------------------------------------


@dataclass
class DataConfig:
    """The corpus: a directory with train.txt, valid.txt, test.txt (see :mod:`highrank.data`).

    Attributes:
        dir: corpus directory.
        mode: ``"word"`` (whitespace tokens) or ``"char"`` (characters).
        cache_dir: where token-id caches go; None (unset): the user cache (~/.cache/highrank).
        src_lang, tgt_lang: (``seq2seq``) the file suffixes of the two sides of a parallel
            corpus, ``{train,valid,test}.<lang>`` (:mod:`highrank.mt.bitext`).
        subword_type: (``seq2seq``) SentencePiece ``"bpe"`` or ``"unigram"``, learned on the
            train split only (:mod:`highrank.mt.subwords`).
        subword_vocab_size: (``seq2seq``) pieces per vocabulary, the four specials included.
        subword_joint: (``seq2seq``) one vocabulary for both languages.
        memmap: (``awd-lstm``, ``transformer``) read the corpus through
            :func:`highrank.data.streaming.load_stream_corpus`: vocabulary in one streaming pass,
            token ids in a memory-mapped cache file, a split may be a folder of shards
            (``train/``), for corpora that do not fit in memory. Same ids and batches as the
            in-memory loader (false).
        max_vocab: (``awd-lstm``, ``transformer``; needs memmap) keep ``<eos>`` and the
            most frequent other tokens, max_vocab in all with ``<unk>``, which the rest map to
            (the 1B-Word recipe's 100K); None (unset): every train token.
        batching: (``awd-lstm``, ``transformer``) ``"stream"``: the training text in order,
            as B contiguous columns; ``"sentences"`` (needs memmap): the training sentences
            (lines) shuffled before each epoch by a generator seeded with (train.seed,
            epoch), then packed into that stream (the 1B-Word recipe).
    """

    dir: str = "data/ptb"
    mode: str = "word"
    cache_dir: str | None = None
    src_lang: str = "en"
    tgt_lang: str = "de"
    subword_type: str = "bpe"
    subword_vocab_size: int = 8000
    subword_joint: bool = True
    memmap: bool = False
    max_vocab: int | None = None
    batching: str = "stream"


@dataclass
class ModelConfig:
    """The AWD-LSTM backbone (Merity et al., 2018; PTB values; WT2: dropout_input 0.65,
    dropout_hidden 0.2; MoS PTB: d_embed 280, d_hidden 960, d_last 620, dropout_hidden 0.225).

    Attributes:
        backbone: the model family, ``"awd-lstm"`` (see :data:`FAMILY_KEYS`).
        d_embed: embedding size (the tied decoder's size).
        d_hidden: hidden size of the inner LSTM layers.
        n_layers: number of stacked single-layer LSTMs.
        d_last: output size of the last LSTM; None (unset): d_embed.
        tie_weights: share the embedding matrix with the head's decoder.
        dropout_embedding: ``dropoute``, whole embedding rows dropped.
        dropout_input: ``dropouti``, locked dropout on the embeddings.
        dropout_hidden: ``dropouth``, locked dropout between LSTM layers.
        dropout_output: ``dropout``, locked dropout on the last layer's output.
        weight_drop: ``wdrop``, DropConnect on the hidden-to-hidden matrices.
        ar_alpha: activation regularisation weight (alpha).
        tar_beta: temporal activation regularisation weight (beta).

    The ``seq2seq`` family (Vaswani et al. 2017; defaults: their base model; d_model is
    d_embed, and tie_weights ties the head's decoder to the target embedding):

    Attributes:
        n_encoder_layers, n_decoder_layers: Transformer blocks in each stack.
        n_heads: attention heads (d_embed must be a multiple).
        d_ff: feed-forward width; None (unset): 4 d_embed.
        positions: ``"sinusoidal"``, ``"learned"`` or ``"rotary"``.
        max_len: longest sentence in tokens (the learned position table; longer training
            pairs are dropped).
        dropout_input: (``seq2seq``) dropout on the scaled embeddings plus positions, as
            ``dropouti`` is on the AWD-LSTM's embedding output.
        dropout_attention: dropout on the attention weights.
        dropout_residual: dropout on each block's output before the residual sum.
        share_embeddings: one embedding matrix for source and target (needs
            data.subword_joint).

    The ``transformer`` family (:class:`highrank.backbones.transformer.CausalTransformer`,
    a decoder-only LM; d_model is d_embed, tie_weights ties the head's decoder to the
    token embedding) reads n_layers (blocks), n_heads, d_ff, positions, max_len (the
    learned position table: at least train.bptt), dropout_input, dropout_attention and
    dropout_residual as above.
    """

    backbone: str = "awd-lstm"
    d_embed: int = 400
    d_hidden: int = 1150
    n_layers: int = 3
    d_last: int | None = None
    tie_weights: bool = True
    dropout_embedding: float = 0.1
    dropout_input: float = 0.4
    dropout_hidden: float = 0.25
    dropout_output: float = 0.4
    weight_drop: float = 0.5
    ar_alpha: float = 2.0
    tar_beta: float = 1.0
    n_encoder_layers: int = 6
    n_decoder_layers: int = 6
    n_heads: int = 8
    d_ff: int | None = None
    positions: str = "sinusoidal"
    max_len: int = 256
    dropout_attention: float = 0.0
    dropout_residual: float = 0.1
    share_embeddings: bool = True


@dataclass
class HeadConfig:
    """The output head: ``name`` in :data:`highrank.heads.HEADS` and its keyword knobs.

    In TOML the knobs sit beside the name: ``[head]`` ``name = "mos"`` ``n_components = 15``.
    ``build_head(name, d_in=..., vocab_size=..., **knobs, <model-set knobs>)`` builds it.
    """

    name: str = "softmax"
    knobs: dict[str, Any] = field(default_factory=dict)


@dataclass
class TrainConfig:
    """Training (Merity et al., 2018, PTB; MoS PTB: batch_size 12, lr 20, epochs 1000).

    Attributes:
        batch_size: training batch size B.
        bptt: base sequence length of variable BPTT.
        max_seq_len_delta: a sampled sequence length is capped at bptt + this (MoS: 40 PTB,
            20 WT2).
        lr: SGD learning rate (scaled per step by seq_len / bptt).
        weight_decay: L2 weight decay on all parameters.
        clip: gradient-norm clip; 0: no clipping.
        epochs: maximum number of epochs.
        optimizer: SGD -> ASGD policy, ``"nt-asgd"``, ``"et-asgd"`` or ``"sgd"``.
        nonmono: n of the non-monotone trigger (also the finetune stop rule).
        switch_epoch: the epoch after which ``et-asgd`` switches (rank study: 200).
        seed: random seed.
        eval_batch_size: validation batch size.
        test_batch_size: test batch size.
        log_every: log every this many training steps.
        checkpoint_every: save checkpoints/last.pt every this many training steps (it is
            also saved at every epoch end and when a run stops at its step limit or on SIGINT /
            SIGTERM); changes nothing that is computed, so a resumed run may change it.
        checkpoint_minutes: also save last.pt once this many minutes of wall time have passed
            since the last save (checked after each step); 0: by steps only. Like
            checkpoint_every it changes nothing computed.
        chunk_size: tokens per chunk of the head loss; None (unset): "auto", chunks of about
            2**21 logits (see OutputHead.loss).
        max_nonfinite_skips: steps with a non-finite loss or gradient that may be skipped
            before the run stops with an error.

    The ``seq2seq`` family (:mod:`highrank.train.seq2seq`; lr is the peak learning rate):

    Attributes:
        max_tokens: a batch holds at most this many padded tokens on its longer side
            (fairseq ``--max-tokens``).
        label_smoothing: epsilon of the label-smoothed loss (Szegedy et al. 2016).
        warmup_steps: updates of linear warm-up from 0 to lr.
        lr_schedule: after the warm-up, ``"inverse-sqrt"`` (lr sqrt(warmup / step), Vaswani
            et al. 2017 eq. 3) or ``"cosine"`` (to 0 at the last update of train.epochs).
        adam_beta2: AdamW's beta2 (beta1 0.9, epsilon 1e-9: Vaswani et al. 2017).
        eval_every: updates between validations besides every epoch end; None (unset): at
            epoch ends only.

    The ``transformer`` family (:mod:`highrank.train.transformer`; lr is the peak learning
    rate, bptt the window length) reads warmup_steps, lr_schedule, adam_beta2 and
    eval_every as above (AdamW epsilon 1e-8), and:

    Attributes:
        accumulate: windows (micro-batches of batch_size x bptt tokens) per update.
        bf16: run the forward passes of training under bfloat16 autocast (weights,
            gradients and optimizer state stay float32; validation is float32).
    """

    batch_size: int = 20
    bptt: int = 70
    max_seq_len_delta: int = 40
    lr: float = 30.0
    weight_decay: float = 1.2e-6
    clip: float = 0.25
    epochs: int = 500
    optimizer: str = "nt-asgd"
    nonmono: int = 5
    switch_epoch: int = 200
    seed: int = 141
    eval_batch_size: int = 10
    test_batch_size: int = 1
    log_every: int = 200
    checkpoint_every: int = 1000
    checkpoint_minutes: float = 10.0
    chunk_size: int | None = None
    max_nonfinite_skips: int = 10
    max_tokens: int = 4096
    label_smoothing: float = 0.1
    warmup_steps: int = 4000
    lr_schedule: str = "inverse-sqrt"
    adam_beta2: float = 0.98
    eval_every: int | None = None
    accumulate: int = 1
    bf16: bool = False


@dataclass
class FinetuneConfig:
    """Finetuning: averaged SGD restarted from the best checkpoint, stopped by the
    non-monotone rule (AWD-LSTM: lr 30; MoS: lr 25 PTB / 20 WT2).

    Attributes:
        lr: learning rate.
        epochs: maximum number of epochs; 0: no finetuning.
        max_seq_len_delta: a sampled window is capped at train.bptt + this while finetuning:
            10 as salesforce/awd-lstm-lm ``finetune.py``; the MoS ``finetune.py`` caps at
            bptt + its max_seq_len_delta instead (40), so MoS recipes set 40 to follow it.
    """

    lr: float = 30.0
    epochs: int = 500
    max_seq_len_delta: int = 10


@dataclass
class DynamicEvalConfig:
    """Dynamic evaluation (Krause et al., 2017, as shipped with MoS; PTB values; WT2:
    epsilon 0.002, prior_decay 0.02).

    Attributes:
        lr: eta, the adaptation step size.
        epsilon: added to the RMS gradient statistic.
        prior_decay: lambda, the decay rate towards the trained parameters.
        batch_size: evaluation batch size.
        bptt: segment length: score a segment, then adapt.
        stats_batch_size: batch size for the gradient statistics on the training set.
    """

    lr: float = 0.002
    epsilon: float = 0.001
    prior_decay: float = 0.075
    batch_size: int = 1
    bptt: int = 5
    stats_batch_size: int = 100


@dataclass
class DecodeConfig:
    """Decoding a translation model (``seq2seq``; :mod:`highrank.mt.decoding`).

    Attributes:
        beam_size: hypotheses kept per sentence; 1 is greedy search's output.
        length_penalty: alpha of GNMT's ((5 + |y|) / 6) ** alpha (Wu et al. 2016); 0: none.
        max_len_a, max_len_b: at most ``a * (longest source of the batch) + b`` tokens are
            generated (fairseq ``--max-len-a/b``), and never beyond model.max_len.
    """

    beam_size: int = 5
    length_penalty: float = 1.0
    max_len_a: float = 1.5
    max_len_b: int = 10


@dataclass
class RunConfig:
    """Where and on what a run happens.

    Attributes:
        out_dir: run directory (checkpoints, logs, the resolved config).
        device: ``"auto"`` (CUDA when available), ``"cpu"``, ``"cuda"``, ``"cuda:N"``, ``"mps"``.
    """

    out_dir: str = "runs/default"
    device: str = "auto"


@dataclass
class Config:
    """A whole experiment; each field is one TOML table."""

    data: DataConfig = field(default_factory=DataConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    head: HeadConfig = field(default_factory=HeadConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    finetune: FinetuneConfig = field(default_factory=FinetuneConfig)
    dynamic_eval: DynamicEvalConfig = field(default_factory=DynamicEvalConfig)
    decode: DecodeConfig = field(default_factory=DecodeConfig)
    run: RunConfig = field(default_factory=RunConfig)


# Section name -> its dataclass, in file order.
SECTIONS: dict[str, type] = typing.get_type_hints(Config)


def _section_fields(section: str) -> dict[str, Any]:
    """Key -> type hint of a section (the head's keys are its name plus free knobs)."""
    hints = typing.get_type_hints(SECTIONS[section])
    return {"name": str} if section == "head" else hints


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
    fields = _section_fields(section)
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
    expected = _section_fields(section).get(key)
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
    if base is float and _is_number(value):
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


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


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


# ---- model families ---------------------------------------------------------------------------


def key_families(dotted: str) -> tuple[str, ...]:
    """The families that read ``section.key``; () when every family reads it."""
    section, key = dotted.split(".", 1)
    return tuple(f for f, keys in FAMILY_KEYS.items() if key in keys.get(section, ()))


def applies_to(dotted: str, family: str) -> bool:
    """Whether backbone ``family`` reads the key ``section.key``."""
    families = key_families(dotted)
    return not families or family in families


def _check_family_keys(family: str, origins: Mapping[str, str]) -> None:
    """A key given in the file or an override must be one the chosen family reads."""
    for dotted, where in origins.items():
        if "." in dotted and not applies_to(dotted, family):
            owners = ", ".join(repr(f) for f in key_families(dotted))
            raise ConfigError(
                f"{where}: {dotted} is a key of model.backbone = {owners}, but "
                f"model.backbone = {family!r}; remove it (or change model.backbone)"
            )


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


__all__ = [
    "BACKBONES",
    "FAMILY_KEYS",
    "MODEL_SET_KNOBS",
    "SECTIONS",
    "SWITCH_POLICIES",
    "Config",
    "ConfigError",
    "DataConfig",
    "DecodeConfig",
    "DynamicEvalConfig",
    "FinetuneConfig",
    "HeadConfig",
    "ModelConfig",
    "RunConfig",
    "TrainConfig",
    "applies_to",
    "config_from_dict",
    "config_to_dict",
    "dump_toml",
    "key_families",
    "load_config",
    "parse_override",
    "save_config",
    "toml_value",
    "validate_config",
]
