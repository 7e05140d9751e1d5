"""What a head that reads more than the last hidden state gets inside a transformers model.

Multi-Facet Softmax and Softmax-CPR (``OutputHead.reads``) read the last ``input_layers``
layers of the body (its ``hidden_states``, the top one the final hidden state) and the
context's token ids (``input_ids``), over the whole context: with a key-value cache, the
positions of earlier calls too.

The cache holds those: each forward that uses a cache keeps the context's layers and ids on
the cache object (``HISTORY``), and the next call puts them before its own positions, so a
generation step sees exactly what a recomputation of the whole sequence would (tested: greedy
``generate`` with the cache gives the tokens and scores of ``use_cache=False``). Beam search
reorders them with the cache (``reorder``); a cache cropped by assisted decoding is cut to
its length; a cache whose positions the head has not seen (filled by another model or by a
forward of this one without the cache) is refused in one line.

Positions a 2-D attention mask leaves out (left padding in a batch) read as positions before
the context's start: their ids are -1, which no partition counts, and their layers zeros,
which Mi's window reads before the start. A padded prompt so gets the distribution of the
same prompt alone (tested, with the dynamic and the static cache: ``generate`` hands the
forward its 2-D mask, ``GENERATION_MASK``, or ``NO_PADDING`` where it was given none). A mask of
another shape cannot say which positions are padding and is refused; so are packed sequences
(position ids that restart within a row), whose contexts these heads would read across the
boundary.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from highrank.heads import OutputHead

# The attribute of a transformers Cache object that keeps the head's context so far:
# (layers (B, L, S, d), ids (B, S)).
HISTORY = "_highrank_head_context"
# The forward keyword under which generate's 2-D attention mask reaches the head (transformers
# may hand the body a 4-D one, e.g. with a static cache).
GENERATION_MASK = "_highrank_attention_mask_2d"
# Its value where generate was given no mask: no position is padding, whatever mask
# transformers makes for the body (a static cache's 4-D one).
NO_PADDING = "no padding"


def reads_more(head: OutputHead) -> bool:
    """Whether ``head`` reads more than the last hidden state."""
    return head.reads != ("hidden",)


def layers_read(head: OutputHead) -> int:
    return head.input_layers if "layers" in head.reads else 0


def layers_given(model_config) -> int | None:
    """How many ``hidden_states`` a model of ``model_config`` gives: its embeddings' output
    and each block's (``num_hidden_layers`` + 1); None where the config does not say."""
    text_config = (
        model_config.get_text_config() if hasattr(model_config, "get_text_config") else model_config
    )
    blocks = getattr(text_config, "num_hidden_layers", None)
    return blocks + 1 if isinstance(blocks, int) else None


def check_layers_given(head: OutputHead, model_config, *, fix: str = "pass input_layers=") -> None:
    """Refuse, in one line with its fix, a head that reads more layers than a model of
    ``model_config`` gives (``layers_given``)."""
    wanted, given = layers_read(head), layers_given(model_config)
    if given is None or wanted <= given:
        return
    raise ValueError(
        f"{type(head).__name__} reads the last {wanted} layers but this model gives {given} "
        f"(its embeddings' output and each of its {given - 1} blocks'): {fix}{given} or fewer"
    )


def head_inputs(
    head: OutputHead,
    hidden: torch.Tensor,
    hidden_states: tuple[torch.Tensor, ...] | None,
    input_ids: torch.Tensor | None,
    attention_mask: torch.Tensor | None,
    cache,
) -> tuple[torch.Tensor, dict]:
    """``hidden (B, T, d)`` with its padded positions zeroed and the inputs ``head`` reads
    besides it (module docstring), over the context so far; ``cache`` (the body's, already
    holding this call's positions, or None) gets the context for the next call. The top layer
    a head reads ends with ``hidden`` (``SequenceHead``), so the two are zeroed alike."""
    name = type(head).__name__
    count = max(layers_read(head), 1)
    if count > 1 and (hidden_states is None or len(hidden_states) < count):
        have = "none" if hidden_states is None else len(hidden_states)
        raise ValueError(f"{name} reads the last {count} layers; the body gave {have}")
    top = [] if count == 1 else list(hidden_states[len(hidden_states) - count : -1])
    layers = torch.stack([*(h.to(hidden.dtype) for h in top), hidden], dim=1)  # (B, L, T, d)
    kept = _kept(name, attention_mask, hidden)
    if kept is not None:  # a padded position reads as one before the start: zeros (Mi's window)
        layers = _zeroed(layers, kept[:, None])
        hidden = layers[:, -1]
    ids = _current_ids(name, head, hidden, input_ids, kept)
    layers, ids = _with_history(name, layers, ids, cache, hidden.shape[1])
    inputs: dict = {}
    if "layers" in head.reads:
        inputs["layers"] = tuple(layers.unbind(1))
    if "context_ids" in head.reads:
        inputs["context_ids"] = ids
    return hidden, inputs


def _kept(name: str, attention_mask: torch.Tensor | None, hidden: torch.Tensor):
    """``(B, T)`` bool: this call's positions that the 2-D attention mask keeps (False:
    padding); None without a mask. Another mask cannot say which positions are padding."""
    if attention_mask is None:
        return None
    if attention_mask.dim() != 2:
        raise ValueError(
            f"{name} reads which positions are padding from a 2-D attention mask (batch, "
            f"positions); got one of shape {tuple(attention_mask.shape)}: pass the 2-D mask"
        )
    length = hidden.shape[1]
    return attention_mask[:, attention_mask.shape[1] - length :].to(hidden.device).bool()


def _zeroed(states: torch.Tensor, kept: torch.Tensor) -> torch.Tensor:
    """``states (..., T, d)`` with the positions ``kept (..., T)`` leaves out zero (``where``,
    not a product: a non-finite state at a pad must not become nan)."""
    return torch.where(kept[..., None], states, torch.zeros((), dtype=states.dtype,
                                                             device=states.device))


def check_not_packed(name: str, position_ids: torch.Tensor | None, attention_mask) -> None:
    """Refuse packed sequences (TRL's padding-free batches: no attention mask, position ids
    that restart within a row): the head would read its context across their boundaries."""
    if attention_mask is not None or position_ids is None or position_ids.shape[-1] < 2:
        return
    if bool((position_ids[..., 1:] <= position_ids[..., :-1]).any()):
        raise ValueError(
            f"{name} reads its context's layers and tokens, but these rows pack several "
            "sequences (position ids restart within a row): they would read across the "
            "boundaries; give one sequence a row (TRL: SFTConfig(packing=False))"
        )


def _current_ids(name, head, hidden, input_ids, kept) -> torch.Tensor:
    """This call's token ids ``(B, T)``, -1 where ``kept`` is False (padding); zeros for a
    head that reads no ids (kept only for the cache's sake)."""
    batch, length = hidden.shape[:2]
    if "context_ids" not in head.reads:
        return torch.zeros(batch, length, dtype=torch.long, device=hidden.device)
    if input_ids is None:
        raise ValueError(
            f"{name} reads the context's token ids, which inputs_embeds do not carry: call it "
            "(or generate) with input_ids alone"
        )
    ids = input_ids.to(hidden.device).long()
    return ids if kept is None else torch.where(kept, ids, -1)


def _with_history(name, layers, ids, cache, length):
    """``layers (B, L, T, d)`` and ``ids (B, T)`` after the context that ``cache`` keeps of
    its earlier positions; the whole context kept on ``cache`` for the next call."""
    if cache is None:
        return layers, ids
    past = cache.get_seq_length() - length  # the body has added this call's positions
    history = getattr(cache, HISTORY, None)
    if past > 0:
        if history is None or history[1].shape[1] < past or history[1].shape[0] != ids.shape[0]:
            seen = 0 if history is None else history[1].shape[1]
            raise ValueError(
                f"the key-value cache holds {past} positions but {name} saw {seen} of them (it "
                "reads their layers and tokens): generate with this model from the start, or "
                "pass no cache"
            )
        old_layers, old_ids = history
        layers = torch.cat([old_layers[:, :, :past].to(layers.dtype), layers], dim=2)
        ids = torch.cat([old_ids[:, :past], ids], dim=1)
    setattr(cache, HISTORY, (layers.detach(), ids))
    return layers, ids


def reorder(cache, beam_idx: torch.Tensor) -> None:
    """The head's context on ``cache`` follows beam search's reordering of the cache."""
    history = getattr(cache, HISTORY, None)
    if history is not None:
        layers, ids = history
        index = beam_idx.to(ids.device)
        setattr(cache, HISTORY, (layers.index_select(0, index), ids.index_select(0, index)))


def shifted_targets(labels: torch.Tensor, ignore_index: int) -> torch.Tensor:
    """transformers' shift of ``labels (B, T)`` kept at length T: position t scores
    ``labels[:, t + 1]``, the last position nothing (``ignore_index``), so that the rows stay
    aligned with the context the head reads."""
    return F.pad(labels[:, 1:], (0, 1), value=ignore_index)
