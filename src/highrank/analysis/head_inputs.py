"""The inputs of an output layer over a text, with the targets: what the saturation and
gradient-bottleneck instruments read (they need the hidden states the head is applied to,
not only its log-prob rows).

* a trained run: :func:`iter_run_head_inputs`, the head's input ``g`` of each context of a
  split exactly as :func:`~highrank.analysis.contexts.iter_contexts` reads it (evaluation
  mode, state carried, ``batch_size`` 1: context ``i`` ends at stream position ``i``);
* a Hugging Face causal LM: :func:`iter_causal_lm_head_inputs`, the input of its output
  embedding (``lm_head``, captured by a forward pre-hook, so whatever final norm the model
  applies is included; for a highrank head attached by ``integrations.hf``, the body's last
  hidden state, which is what that head reads) on the text read in windows as
  :mod:`~highrank.analysis.hf_contexts` reads it (row ``i`` the context ending at token ``i``).

Both yield ``(hidden (b, d) float32, targets (b,) int64)`` blocks on the CPU, at most
``max_contexts`` rows in all.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from highrank.analysis.contexts import RunSplit, iter_contexts
from highrank.analysis.hf_contexts import HFInputError, TextContexts, count_text_contexts
from highrank.util.progress import progress_bar

HeadInputs = tuple[torch.Tensor, torch.Tensor]  # hidden (b, d) float32, targets (b,) int64


def iter_run_head_inputs(
    split: RunSplit, *, max_contexts: int | None = None, progress: bool = False
) -> Iterator[HeadInputs]:
    """The head inputs of a loaded run split (``batch_size`` 1, the run's own segment length)."""
    for block in iter_contexts(
        split.model,
        split.ids,
        bptt=split.bptt,
        max_contexts=max_contexts,
        progress=progress,
        name=split.source,
    ):
        yield block.hidden.float().cpu(), block.targets


def highrank_head(model: Any) -> nn.Module | None:
    """The highrank head of a model built by :func:`highrank.integrations.hf.attach_head`
    (``model.head``, fed ``model.model(...).last_hidden_state``), or None."""
    head = getattr(model, "head", None)
    return head if head is not None and hasattr(head, "log_prob") else None


def output_linear(model: Any, name: str) -> nn.Linear:
    """The ``lm_head`` of a transformers causal LM: a plain linear layer (V x d), or one
    clear error naming the model and what it has instead."""
    linear = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if not isinstance(linear, nn.Linear):
        kind = "no output embedding" if linear is None else f"a {type(linear).__name__}"
        raise HFInputError(
            f"{name}: the model's output layer is {kind}, neither a linear lm_head (V x d) "
            "nor a highrank head; this instrument reads the output layer and its input"
        )
    return linear


def output_layer(model: Any, name: str) -> nn.Module:
    """What a causal LM's next-token distribution is computed by: its highrank head
    (:func:`highrank_head`), else its linear ``lm_head`` (:func:`output_linear`)."""
    head = highrank_head(model)
    if head is not None:
        check_reads_rows(head, name)
    return head or output_linear(model, name)


def check_reads_rows(head: nn.Module, name: str) -> None:
    """One clear error for a head that reads more than a row of hidden states (MFS, CPR:
    ``head.reads``), which the instruments on head inputs cannot give it."""
    reads = tuple(getattr(head, "reads", ("hidden",)))
    if reads != ("hidden",):
        raise HFInputError(
            f"{name}: its {type(head).__name__} head reads {', '.join(reads)}; this instrument "
            "reads the output layer's input as rows of hidden states alone"
        )


@torch.no_grad()
def iter_causal_lm_head_inputs(
    loaded: TextContexts, *, max_contexts: int | None = None, progress: bool = False
) -> Iterator[HeadInputs]:
    """The inputs of the output layer of a loaded causal LM on its text, window by window
    (one window per forward pass, no cache, BOS as the text contexts were loaded): the
    ``lm_head``'s input, or a highrank head's (the body's last hidden state)."""
    model, ids = loaded.model, loaded.ids
    captured: list[torch.Tensor] = []
    if highrank_head(model) is not None:  # HighrankForCausalLM: the body alone gives h
        check_reads_rows(model.head, loaded.name)
        body = model.model
        hook = body.register_forward_hook(
            lambda module, args, output: captured.append(output.last_hidden_state)
        )
        model = body
    else:
        linear = output_linear(model, loaded.name)
        hook = linear.register_forward_pre_hook(lambda module, args: captured.append(args[0]))
    n_rows = count_text_contexts(ids.numel(), max_contexts)
    device = next(model.parameters()).device
    try:
        with progress_bar(total=n_rows, desc="contexts", unit="ctx", disable=not progress) as bar:
            for start in range(0, n_rows, loaded.window):
                end = min(start + loaded.window, n_rows)
                tokens = ids[start:end]
                hidden = _window_hidden(model, tokens, loaded.bos_token_id, device, captured)
                yield hidden, ids[start + 1 : end + 1]
                bar.update(end - start)
    finally:
        hook.remove()


def _window_hidden(model, tokens, bos_token_id, device, captured) -> torch.Tensor:
    """``(L, d)`` float32 inputs of the lm_head for one window of ``L`` tokens."""
    inputs = tokens[None]  # (1, L)
    if bos_token_id is not None:
        inputs = torch.cat([torch.tensor([[int(bos_token_id)]]), inputs], dim=1)  # (1, 1 + L)
    captured.clear()
    model(input_ids=inputs.to(device), use_cache=False)
    if len(captured) != 1:
        raise HFInputError(
            f"the output layer was called {len(captured)} times in one forward pass; expected once"
        )
    hidden = captured[0][0]  # (1 [+1], d) ... (L [+1], d)
    if bos_token_id is not None:
        hidden = hidden[1:]  # the BOS position's prediction is not a row
    if hidden.shape[0] != tokens.numel():
        raise HFInputError(
            f"the output layer saw {hidden.shape[0]} positions for a window of {tokens.numel()} "
            "tokens; expected one per token (a model that keeps only the last logits?)"
        )
    return hidden.float().cpu()
