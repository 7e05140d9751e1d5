"""How large a model a config describes, and whether training it fits the device's memory:
counted on the ``meta`` device, before anything is allocated (every run kind checks it)."""

from __future__ import annotations

import torch

from highrank.config import Config, ConfigError
from highrank.models import build_model, count_parameters
from highrank.util.machine import available_memory

# Float32 copies of the parameters training holds at least: weights, gradients, and one of
# optimizer state (ASGD's averages; Adam holds two): activations come on top.
TRAINING_COPIES = 3


def check_model_fits(config: Config, vocab_size: int, device: torch.device) -> int:
    """The parameter count, counted on the ``meta`` device; a ConfigError with the numbers when
    ``TRAINING_COPIES`` float32 copies of it exceed the memory available on ``device``."""
    count = parameter_count(config, vocab_size)
    needed = TRAINING_COPIES * 4 * count
    available = available_memory(device)
    if available is not None and needed > available:
        raise ConfigError(
            f"the model has {count:,} parameters ({_size_keys(config)}, vocabulary "
            f"{vocab_size:,}): training needs at least "
            f"{needed / 2**30:,.1f} GiB "
            f"({TRAINING_COPIES} float32 copies: weights, gradients, optimizer state), but "
            f"{available / 2**30:,.1f} GiB is available on {device}; make the model smaller"
        )
    return count


def _size_keys(config: Config) -> str:
    """The [model] sizes of ``config``'s backbone, as the user sets them."""
    names = {
        "awd-lstm": ("d_embed", "d_hidden", "n_layers"),
        "transformer": ("d_embed", "d_ff", "n_layers"),
        "seq2seq": ("d_embed", "d_ff", "n_encoder_layers", "n_decoder_layers"),
    }.get(config.model.backbone, ("d_embed",))
    return ", ".join(f"model.{name} = {getattr(config.model, name)}" for name in names)


def parameter_count(config: Config, vocab_size: int) -> int:
    """Trainable parameters of the model ``config`` describes, built on the ``meta`` device
    (nothing allocated)."""
    try:
        with torch.device("meta"):
            model = build_model(config, vocab_size)
    except RuntimeError as error:
        if "overflow" not in str(error):
            raise
        # A tensor with more elements than an int64 byte count can hold: no machine has it.
        raise ConfigError(
            f"this model cannot be built: one of its tensors would hold more bytes than any "
            f"machine has ({str(error).splitlines()[0]}); check the sizes under [model] "
            f"({_size_keys(config)})"
        ) from None
    return count_parameters(model)


__all__ = ["TRAINING_COPIES", "available_memory", "check_model_fits", "parameter_count"]
