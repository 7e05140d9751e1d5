"""TRL's fused LM-head protocol, answered by a highrank head (``HighrankForCausalLM``).

TRL's trainers (SFT, DPO, KTO, GRPO, RLOO: trl 1.16) call ``add_fused_lm_head(model, ...)``,
which replaces ``model.forward`` by a function that, called with ``fused_lm_head=True``, runs
the body and scores its hidden states with ``model.get_output_embeddings().weight`` as a plain
softmax layer, returning per-token fields (``log_probs``, ``entropy``, ``is_top1``, ...) from
which the trainer computes its loss and metrics. A highrank head is no such layer, and
``get_output_embeddings()`` returns None on purpose (so that nothing trains or resizes it as
one), so that replacement would crash.

``HighrankForCausalLM`` therefore keeps its own forward when TRL tries to replace it
(``trl_fused_settings`` recognises TRL's function and reads its settings), and its forward
answers ``fused_lm_head=True`` itself with ``fused_output``: the same fields, computed from
the head's own distribution, ``chunk_tokens`` tokens at a time so that no (tokens x V)
tensor is built (each chunk is recomputed in backward, as the heads' per-token losses are).
One dropout draw serves the loss and the metrics, so ``mean_token_accuracy`` and ``entropy``
describe the distribution that was trained.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch.utils.checkpoint import checkpoint
from transformers.utils import ModelOutput

from highrank.heads import OutputHead
from highrank.heads.kernels.chunking import chunk_masks, chunk_slices

# The function add_fused_lm_head installs, by its code's qualified name (functools.wraps gives
# it our forward's name and module, so those cannot tell it apart).
TRL_FUSED_FORWARD = "add_fused_lm_head.<locals>._fused_forward"
# The per-token fields of TRL's FusedCausalLMOutput, each of which fused_output can compute.
FIELDS = ("log_probs", "entropy", "log_sum_sq_probs", "mean_logits", "is_top1")


@dataclass
class FusedCausalLMOutput(ModelOutput):
    """The fields of TRL's ``FusedCausalLMOutput`` (same names and meanings; every per-token
    field is 0 where the label is -100, ``label_mask`` says where it is not)."""

    loss: torch.Tensor | None = None
    log_probs: torch.Tensor | None = None
    entropy: torch.Tensor | None = None
    log_sum_sq_probs: torch.Tensor | None = None
    mean_logits: torch.Tensor | None = None
    is_top1: torch.Tensor | None = None
    label_mask: torch.Tensor | None = None
    aux_loss: torch.Tensor | None = None


def trl_fused_settings(forward: object) -> dict | None:
    """TRL's settings (``temperature``, ``outputs``, ``cast_lm_head_to_fp32``) if ``forward``
    is the function ``trl``'s ``add_fused_lm_head`` installs, else None; a setting a highrank
    head cannot honour is one clear error (at trainer construction, not mid-training)."""
    function = getattr(forward, "__func__", forward)
    code = getattr(function, "__code__", None)
    if code is None or code.co_qualname != TRL_FUSED_FORWARD:
        return None
    captured = inspect.getclosurevars(function).nonlocals
    settings = {
        "temperature": float(captured.get("temperature", 1.0)),
        "outputs": tuple(captured.get("outputs", ("log_probs",))),
        "cast_lm_head_to_fp32": bool(captured.get("cast_lm_head_to_fp32", False)),
    }
    if settings["temperature"] != 1.0:
        raise ValueError(
            f"TRL asks for log-probabilities at temperature {settings['temperature']:g}; a "
            "highrank head scores its own distribution (temperature 1.0) only"
        )
    unknown = sorted(set(settings["outputs"]) - set(FIELDS))
    if unknown:
        raise ValueError(f"TRL asks for fused fields {unknown} that highrank does not know")
    return settings


def fused_output(
    head: OutputHead,
    hidden: torch.Tensor,
    labels: torch.Tensor | None,
    *,
    shift_labels: torch.Tensor | None,
    num_items_in_batch: torch.Tensor | int | None,
    chunk_tokens: int,
    raw_logits: Callable[[torch.Tensor], torch.Tensor] | None = None,
    outputs: tuple[str, ...] = FIELDS,
) -> FusedCausalLMOutput:
    """TRL's fused fields for hidden states ``(B, T, d)`` and next-token labels (shifted as
    transformers shifts them, or ``shift_labels`` as given), from the head's log-probs.

    ``outputs`` names the fields to compute (``log_probs`` always; the others are None unless
    named, as in TRL). ``mean_logits`` is the mean over V of ``raw_logits(rows)`` for heads
    that have raw logits (what ``generate`` hands the logits processors), else of the
    log-probabilities.
    """
    wanted = [name for name in FIELDS if name in outputs or name == "log_probs"]
    if shift_labels is None:
        hidden, targets = hidden[:, :-1], labels[:, 1:]
    else:
        targets = shift_labels
    label_mask = targets != -100
    valid = label_mask.reshape(-1)
    rows = head._flatten_hidden(hidden)[valid]  # only the scored positions, as TRL on GPUs
    target_rows = targets.reshape(-1)[valid]
    # One dropout draw (locked over time, as in training) for the whole batch.
    masks = tuple(m[valid] if m is not None else None for m in head._draw_masks(hidden))

    def statistics(h: torch.Tensor, target: torch.Tensor, *chunk: torch.Tensor | None):
        log_p = head._log_prob_rows(h, *chunk)  # (n, V), float32, normalised
        return torch.stack([_field(name, log_p, target, h, raw_logits) for name in wanted])

    pieces = [hidden.new_zeros((len(wanted), 0), dtype=torch.float32)]
    for part in chunk_slices(rows.shape[0], chunk_tokens):
        args = (rows[part], target_rows[part], *chunk_masks(masks, part))
        if torch.is_grad_enabled():  # recomputed in backward, RNG state replayed
            pieces.append(checkpoint(statistics, *args, use_reentrant=False))
        else:
            pieces.append(statistics(*args))
    per_token = torch.cat(pieces, dim=1)
    if per_token.shape[1] == 0:  # nothing scored: keep the loss on the graph for backward
        per_token = per_token + hidden.sum() * 0.0
    # Every field 0 where the label is ignored; masked_scatter keeps the graph, as in TRL.
    zeros = label_mask.new_zeros(label_mask.shape, dtype=torch.float32)
    fields = {
        name: zeros.masked_scatter(label_mask, values)
        for name, values in zip(wanted, per_token, strict=True)
    }
    if "is_top1" in fields:
        fields["is_top1"] = fields["is_top1"].bool()
    count = label_mask.sum().clamp(min=1) if num_items_in_batch is None else num_items_in_batch
    loss = -fields["log_probs"].sum() / count
    return FusedCausalLMOutput(loss=loss, label_mask=label_mask, **fields)


def _field(name, log_p, target, h, raw_logits) -> torch.Tensor:
    """One of TRL's per-token fields ``(n,)`` from the log-probabilities ``(n, V)``."""
    if name == "log_probs":
        return log_p.gather(1, target[:, None]).squeeze(1)
    if name == "entropy":
        return -(log_p.exp() * log_p).sum(-1)
    if name == "log_sum_sq_probs":  # log sum_v p_v^2, without gradient as in TRL
        return torch.logsumexp(2 * log_p, dim=-1).detach()
    if name == "mean_logits":
        return (log_p if raw_logits is None else raw_logits(h)).mean(-1).detach()
    return (log_p.argmax(-1) == target).float()  # is_top1
