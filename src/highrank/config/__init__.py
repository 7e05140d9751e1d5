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
  tar_beta; for ``seq2seq`` (:class:`highrank.models.seq2seq.TransformerSeq2Seq`, d_model =
  d_embed) n_encoder_layers, n_decoder_layers, n_heads, d_ff (unset: 4 d_embed), positions,
  max_len, dropout_input, dropout_attention, dropout_residual, share_embeddings; for
  ``transformer`` (:class:`highrank.models.backbones.transformer.CausalTransformer`, d_model =
  d_embed) n_layers, n_heads, d_ff (unset: 4 d_embed), positions, max_len, dropout_input,
  dropout_attention, dropout_residual.
* ``[head]`` name (a key of :data:`highrank.heads.HEADS`) and, in the same table, that head's
  knobs (``n_components = 15``), checked against :func:`highrank.heads.head_knobs`. The knobs
  the model wires itself (:data:`MODEL_SET_KNOBS`) are not configurable here. A loaded config
  holds every knob, defaults filled in, so the written config records them.
* ``[train]`` batch_size, bptt, max_seq_len_delta, lr, weight_decay, clip, epochs, optimizer
  (``nt-asgd`` | ``et-asgd`` | ``sgd``, see :mod:`highrank.train.asgd`), nonmono, switch_epoch,
  latest_switch_epoch (unset: none), seed, eval_batch_size, test_batch_size, log_every,
  checkpoint_every, checkpoint_minutes, chunk_size (unset: "auto"), max_nonfinite_skips,
  patience (unset: none), patience_min_delta.
  ``seq2seq`` reads max_tokens, label_smoothing, warmup_steps, lr_schedule, adam_beta2,
  eval_every (:mod:`highrank.train.seq2seq`) besides lr, weight_decay, clip, epochs, seed,
  log_every, checkpoint_every, chunk_size, max_nonfinite_skips.
  ``transformer`` reads warmup_steps, lr_schedule, adam_beta2, eval_every, accumulate, bf16
  (:mod:`highrank.train.transformer`) besides the keys every family reads.
* ``[finetune]`` lr, epochs, max_seq_len_delta.
* ``[dynamic_eval]`` lr, epsilon, prior_decay, batch_size, bptt, stats_batch_size (Krause
  et al. 2017).
* ``[decode]`` (``seq2seq``) beam_size, length_penalty, max_len_a, max_len_b
  (:mod:`highrank.evaluate.translation`).
* ``[run]`` out_dir, device.

TOML has no null, so a key whose default is "unset" (None) is written by leaving it out.

Model families: ``model.backbone`` picks the family (the backbone :func:`highrank.models.
build_model` builds and the recipe :mod:`highrank.train` trains it with). Each family declares
the keys only it reads, their ranges and its cross-key checks in its own module of
:mod:`highrank.config.families` (:data:`FAMILIES`); every other key is read by all.
Setting a key of another family is an error naming the key and its families, and a resolved
config (:func:`config_to_dict`, :func:`dump_toml`, checkpoints) holds only the keys of its
family, so it reads back. Growing a family: its module in :mod:`highrank.config.families`, one
line in :data:`FAMILIES`, and its new keys in the section dataclasses (with defaults).

Layout: :mod:`~highrank.config.keys` (ConfigError, the range rules, what a family declares),
:mod:`~highrank.config.families` (the families), :mod:`~highrank.config.schema` (the
dataclasses), :mod:`~highrank.config.loader` (reading, overrides, type and range checks),
:mod:`~highrank.config.toml_writer` (the resolved config as TOML). Every name is importable
from ``highrank.config`` itself.
"""

from highrank.config.families import FAMILIES, applies_to, key_families
from highrank.config.keys import ConfigError, Family
from highrank.config.loader import (
    RULES,
    config_from_dict,
    load_config,
    parse_override,
    rules,
    validate_config,
)
from highrank.config.schema import (
    BACKBONES,
    MODEL_SET_KNOBS,
    SECTIONS,
    SWITCH_POLICIES,
    Config,
    DataConfig,
    DecodeConfig,
    DynamicEvalConfig,
    FinetuneConfig,
    HeadConfig,
    ModelConfig,
    RunConfig,
    TrainConfig,
    section_fields,
)
from highrank.config.toml_writer import config_to_dict, dump_toml, save_config, toml_value

__all__ = [
    "BACKBONES",
    "FAMILIES",
    "MODEL_SET_KNOBS",
    "RULES",
    "SECTIONS",
    "SWITCH_POLICIES",
    "Config",
    "ConfigError",
    "DataConfig",
    "DecodeConfig",
    "DynamicEvalConfig",
    "Family",
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
    "rules",
    "save_config",
    "section_fields",
    "toml_value",
    "validate_config",
]
