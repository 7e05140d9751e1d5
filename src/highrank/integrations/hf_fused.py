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
from highrank.integrations.hf_context import shifted_targets

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
            "highrank head scores its own distribution (temperature 1.0) only: set "
            "temperature=1.0 in the trainer's config (GRPOConfig, RLOOConfig)"
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
    inputs: dict | None = None,
) -> FusedCausalLMOutput:
    """TRL's fused fields for hidden states ``(B, T, d)`` and next-token labels (shifted as
    transformers shifts them, or ``shift_labels`` as given), from the head's log-probs.

    ``outputs`` names the fields to compute (``log_probs`` always; the others are None unless
    named, as in TRL). ``mean_logits`` is the mean over V of ``raw_logits(rows)`` for heads
    that have raw logits (what ``generate`` hands the logits processors), else of the
    log-probabilities. ``inputs``: what a head that reads its context (MFS, CPR) reads besides
    ``hidden``, over all T positions; such a head scores every position of its sequences (its
    rows are not selectable one by one) and the ignored ones are zeroed after.
    """
    wanted = [name for name in FIELDS if name in outputs or name == "log_probs"]
    if inputs:
        return _fused_context_output(
            head, hidden, labels, shift_labels, num_items_in_batch, chunk_tokens, wanted, inputs
        )
    if shift_labels is None:
        hidden, targets = hidden[:, :-1], labels[:, 1:]
    else:
        targets = shift_labels
    label_mask = targets != -100
    valid = label_mask.reshape(-1)
    rows = head._flatten_hidden(hidden)[valid]  # only the scored positions, as TRL on GPUs
    # One dropout draw (locked over time, as in training) for the whole batch.
    masks = tuple(m[valid] if m is not None else None for m in head._draw_masks(hidden))
    per_token = _per_token(head, rows, targets.reshape(-1)[valid], masks, chunk_tokens, wanted,
                           raw_logits)
    if per_token.shape[1] == 0:  # nothing scored: keep the loss on the graph for backward
        per_token = per_token + hidden.sum() * 0.0
    # Every field 0 where the label is ignored; masked_scatter keeps the graph, as in TRL.
    zeros = label_mask.new_zeros(label_mask.shape, dtype=torch.float32)
    fields = {
        name: zeros.masked_scatter(label_mask, values)
        for name, values in zip(wanted, per_token, strict=True)
    }
    return _output(fields, label_mask, num_items_in_batch)


def _fused_context_output(head, hidden, labels, shift_labels, num_items_in_batch, chunk_tokens,
                          wanted, inputs) -> FusedCausalLMOutput:
    """``fused_output`` for a head that reads its context: all B T positions scored (each
    position t on ``labels[:, t + 1]``, the last on nothing), the ignored ones zeroed."""
    targets = shift_labels if shift_labels is not None else shifted_targets(labels, -100)
    rows, masks, order = head._head_rows(hidden, inputs)  # one dropout draw, as in training
    target_rows = order.flatten(targets)
    scored = target_rows != -100
    per_token = _per_token(head, rows, torch.where(scored, target_rows, 0), masks, chunk_tokens,
                           wanted, raw_logits=None)
    fields = {name: order.restore(torch.where(scored, values, 0.0))
              for name, values in zip(wanted, per_token, strict=True)}
    label_mask = targets != -100
    if shift_labels is None:  # transformers' shift: T - 1 positions, as the plain path's
        fields = {name: values[:, :-1] for name, values in fields.items()}
        label_mask = label_mask[:, :-1]
    return _output(fields, label_mask, num_items_in_batch)


def _per_token(head, rows, target_rows, masks, chunk_tokens, wanted, raw_logits) -> torch.Tensor:
    """The ``wanted`` fields of ``rows (n, width)`` and their per-row inputs, ``(F, n)``,
    ``chunk_tokens`` rows at a time (each chunk recomputed in backward)."""

    def statistics(h: torch.Tensor, target: torch.Tensor, *chunk: object):
        log_p = head._log_prob_rows(h, *chunk)  # (n, V), float32, normalised
        return torch.stack([_field(name, log_p, target, h, raw_logits) for name in wanted])

    pieces = [rows.new_zeros((len(wanted), 0), dtype=torch.float32)]
    for part in chunk_slices(rows.shape[0], chunk_tokens):
        args = (rows[part], target_rows[part], *chunk_masks(masks, part))
        if torch.is_grad_enabled():  # recomputed in backward, RNG state replayed
            pieces.append(checkpoint(statistics, *args, use_reentrant=False))
        else:
            pieces.append(statistics(*args))
    return torch.cat(pieces, dim=1)


def _output(fields: dict, label_mask: torch.Tensor, num_items_in_batch) -> FusedCausalLMOutput:
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
