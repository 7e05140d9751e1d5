"""The ``transformer`` family's config (the decoder-only LM
:class:`highrank.models.backbones.transformer.CausalTransformer`, trained by
:mod:`highrank.train.transformer`): the keys only it reads, their ranges and cross-checks."""

from __future__ import annotations

from typing import Any

from highrank.config.families.stream import STREAM_DATA, check_stream_data
from highrank.config.keys import (
    ANY,
    NON_NEGATIVE,
    POSITIVE,
    PROBABILITY,
    ConfigError,
    Family,
    Show,
    Where,
    one_of,
)

POSITIONS = ("sinusoidal", "learned", "rotary")  # model.positions (also seq2seq's)
LR_SCHEDULES = ("inverse-sqrt", "cosine")  # train.lr_schedule (also seq2seq's)
# [model] keys of the Transformer blocks, read by both transformer families.
BLOCK_MODEL_KEYS = {
    "n_heads": POSITIVE,
    "d_ff": POSITIVE,
    "positions": one_of(POSITIONS),
    "max_len": (lambda v: v >= 2, ">= 2"),
    "dropout_input": PROBABILITY,
    "dropout_attention": PROBABILITY,
    "dropout_residual": PROBABILITY,
}
# [train] keys of the warmed-up AdamW recipes, read by both transformer families.
ADAMW_TRAIN_KEYS = {
    "warmup_steps": NON_NEGATIVE,
    "lr_schedule": one_of(LR_SCHEDULES),
    "adam_beta2": PROBABILITY,
    "eval_every": POSITIVE,
}


def check_heads(config: Any, where: Where, show: Show) -> None:
    """model.n_heads divides model.d_embed (d_model)."""
    model = config.model
    if model.d_embed % model.n_heads:
        raise ConfigError(
            f"{where('model.n_heads')}: model.n_heads = {model.n_heads} does not "
            f"divide model.d_embed = {model.d_embed}; expected a divisor"
        )


def check_transformer(config: Any, where: Where, show: Show) -> None:
    """Cross-key rules of a decoder-only Transformer LM config."""
    check_stream_data(config, where, show)
    model, train = config.model, config.train
    check_heads(config, where, show)
    if model.positions == "rotary" and (model.d_embed // model.n_heads) % 2:
        raise ConfigError(
            f"{where('model.positions')}: rotary positions rotate pairs of "
            f"features, but d_embed / n_heads = {model.d_embed // model.n_heads} is odd"
        )
    if model.positions == "learned" and model.max_len < train.bptt:
        raise ConfigError(
            f"{where('model.max_len')}: model.max_len = {model.max_len} is shorter "
            f"than the windows (train.bptt = {train.bptt}) the learned positions must cover; "
            f"expected max_len >= bptt"
        )


TRANSFORMER = Family(
    name="transformer",
    keys={
        "data": STREAM_DATA,
        "model": {"n_layers": POSITIVE, **BLOCK_MODEL_KEYS},
        # the recipe's (highrank.train.transformer)
        "train": {**ADAMW_TRAIN_KEYS, "accumulate": POSITIVE, "bf16": ANY},
    },
    check=check_transformer,
    head_layers=lambda config: (
        config.model.n_layers + 1,
        "model.n_layers + 1: its blocks' outputs and the embedding",
    ),
)

__all__ = [
    "ADAMW_TRAIN_KEYS",
    "BLOCK_MODEL_KEYS",
    "LR_SCHEDULES",
    "POSITIONS",
    "TRANSFORMER",
    "check_heads",
    "check_transformer",
]
