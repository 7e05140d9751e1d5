"""``highrank train CONFIG --init-from RUN``: a new run whose model starts as a trained
softmax run's, with its head switched to any head that can start at that softmax.

Everything but the head (embedding, backbone) is copied from ``RUN``'s best checkpoint (its
evaluation weights: ASGD averages after the switch); the new head takes the softmax's decoder
E, bias b and projection, and ``start_at_base`` sets its own parameters so that, at step 0,
it computes exactly the softmax run's distribution (``highrank.heads.residual``). The PTB
comparison then reads "softmax for N epochs, then the head switched for M" against "softmax
for N + M", at equal total budget.
"""

from __future__ import annotations

import dataclasses
import os

import torch

from highrank.config import Config, ConfigError
from highrank.heads import Softmax, base_init_knobs, head_knobs
from highrank.models import load_run
from highrank.runs.checkpoint import CheckpointError


def with_base_init(config: Config) -> Config:
    """``config`` with the head knobs that let its head start at a softmax (recorded in the
    run's config.toml), or a ConfigError saying why the head cannot."""
    defaults = head_knobs(config.head.name)
    # A resolved config lists every knob; only those set away from their default can clash.
    chosen = {k: v for k, v in config.head.knobs.items() if defaults.get(k) != v}
    try:
        knobs = {**config.head.knobs, **base_init_knobs(config.head.name, chosen)}
    except ValueError as error:
        raise ConfigError(f"--init-from: {error}") from None
    return dataclasses.replace(config, head=dataclasses.replace(config.head, knobs=knobs))


@torch.no_grad()
def init_from_run(model: torch.nn.Module, run_dir: str | os.PathLike, vocab) -> None:
    """Copy ``run_dir``'s trained softmax model into ``model`` and start its head there."""
    source, _, source_vocab = load_run(run_dir, "best")
    if not isinstance(source.head, Softmax):
        raise CheckpointError(
            f"--init-from {run_dir}: its head is {type(source.head).__name__}; a warm start "
            "switches a trained softmax run's head, so give a run with head.name = 'softmax'"
        )
    if source_vocab != vocab:
        raise CheckpointError(
            f"--init-from {run_dir}: its vocabulary ({len(source_vocab)} tokens) differs from "
            f"this run's corpus ({len(vocab)}); use the corpus it was trained on"
        )
    _copy_body(model, source, run_dir)
    head = model.head
    if not any(p is head.weight for p in model.backbone.parameters()):  # untied: its own E
        head.weight.copy_(source.head.weight)
    head.bias.copy_(source.head.bias)
    head.start_at_base(source.head.projection)


def _copy_body(model, source, run_dir) -> None:
    """Every tensor outside the head, by name and shape (one error listing what differs)."""
    target = {k: v for k, v in model.state_dict().items() if not k.startswith("head.")}
    given = {k: v for k, v in source.state_dict().items() if not k.startswith("head.")}
    wrong = sorted(set(target) ^ set(given)) + sorted(
        f"{k} {tuple(given[k].shape)} vs {tuple(v.shape)}"
        for k, v in target.items() if k in given and given[k].shape != v.shape
    )
    if wrong:
        raise CheckpointError(
            f"--init-from {run_dir}: its model differs from this config's outside the head "
            f"({'; '.join(wrong[:6])}); use the softmax run's model settings, changing only "
            "[head]"
        )
    model.load_state_dict(given, strict=False)

