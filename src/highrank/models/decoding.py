"""Greedy and beam search for encoder-decoder models whose decoder ends in a highrank head.

The model (:class:`highrank.models.seq2seq.TransformerSeq2Seq`, or anything with the same
four members, :class:`IncrementalDecoder`) is decoded incrementally: the source is encoded
once, and each step feeds one token per hypothesis with the keys and values of the earlier
ones cached. Next-token log-probabilities are ``model.head.log_prob``, so every head decodes.
Sentences are decoded side by side in one batch; the model runs in eval mode without
gradients (each module's training flag is restored afterwards).

Conventions, shared by both searches:

* Decoding starts from ``bos_id``; a hypothesis ends with ``eos_id``. At most ``max_len``
  tokens are generated per sentence, EOS included; at the last step only EOS is allowed (as
  fairseq does), so every hypothesis ends with EOS. ``pad_id`` and ``bos_id`` (unless it is
  also the EOS) are never generated.
* ``log_prob`` of a hypothesis is ``log P(y | x) = sum_t log p(y_t | y_<t, x)`` over its
  tokens, EOS included, with the head's log-probabilities as they are (not renormalised after
  banning tokens). Returned ``tokens`` exclude BOS and EOS.
* Beam search ranks finished hypotheses by GNMT's length-normalised score (Wu et al. 2016,
  "Google's Neural Machine Translation System", eq. 14, the penalty Vaswani et al. 2017 used
  with alpha = 0.6)::

      score(y) = log P(y | x) / lp(y),    lp(y) = ((5 + |y|) / (5 + 1)) ** alpha

  where ``|y|`` counts the tokens *including* EOS; alpha = 0 ranks by log P(y | x) alone.
  (fairseq's ``--lenpen`` is a different formula, ``log P / |y| ** alpha``.)
* Beam search follows fairseq's ``SequenceGenerator`` schedule. Each of the ``k`` live
  hypotheses of a sentence is extended by every token; of the ``k x V`` extensions, ranked by
  cumulative log P, the best ``2k`` are taken. An EOS extension among the first ``k`` of them
  finishes a hypothesis; the best ``k`` non-EOS extensions are the next live hypotheses.
  A sentence is done when it has ``k`` finished hypotheses (or at ``max_len``). Hence beam
  size 1 returns exactly the greedy output, and a beam at least as large as the number of
  possible prefixes searches exhaustively.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import NamedTuple, Protocol

import torch
from torch import nn

from highrank.util.checks import check_finite, check_positive_int


class Hypothesis(NamedTuple):
    """One decoded sentence."""

    tokens: list[int]  # without BOS and EOS
    log_prob: float  # log P(tokens + EOS | source)
    score: float  # log_prob / lp(len(tokens) + 1): the ranking key of beam search


class IncrementalDecoder(Protocol):
    """What the searches need (``TransformerSeq2Seq`` has it): ``head.log_prob`` of the
    hidden states; a state with ``select(index)`` that picks batch rows."""

    head: nn.Module

    def encode(self, src: torch.Tensor): ...

    def start_decoding(self, memory): ...

    def decode_step(self, tgt: torch.Tensor, state): ...


def length_penalty(length: int, alpha: float) -> float:
    """GNMT's ``lp(y) = ((5 + |y|) / 6) ** alpha`` (Wu et al. 2016, eq. 14), |y| with EOS."""
    return ((5.0 + length) / 6.0) ** alpha


# ---- greedy search ------------------------------------------------------------------------


def greedy_search(
    model: IncrementalDecoder,
    src: torch.Tensor,
    *,
    bos_id: int,
    eos_id: int,
    pad_id: int,
    max_len: int,
) -> list[Hypothesis]:
    """The most probable next token at every step, for each sentence of ``src (B, S)``
    (right-padded with ``pad_id``). ``score`` equals ``log_prob`` (no length penalty)."""
    check_positive_int("max_len", max_len)
    batch = src.shape[0]
    with _inference(model):
        state = model.start_decoding(model.encode(src))
        last = src.new_full((batch, 1), bos_id)  # (B, 1): the token fed next
        done = torch.zeros(batch, dtype=torch.bool, device=src.device)
        total = torch.zeros(batch, dtype=torch.float64, device=src.device)
        steps: list[torch.Tensor] = []
        for step in range(max_len):
            log_p, state = _next_log_probs(
                model, last, state, step, max_len, bos_id, eos_id, pad_id
            )
            best_log_p, best = log_p.max(dim=1)  # (B,)
            total += torch.where(done, 0.0, best_log_p.double())
            token = torch.where(done, pad_id, best)  # finished sentences are fed padding
            steps.append(token)
            done |= token == eos_id
            if bool(done.all()):
                break
            last = token[:, None]
    generated = torch.stack(steps, dim=1).tolist()  # (B, steps)
    return [
        Hypothesis(row[: row.index(eos_id)], float(log_p), float(log_p))
        for row, log_p in zip(generated, total.tolist(), strict=True)
    ]


# ---- beam search --------------------------------------------------------------------------


def beam_search(
    model: IncrementalDecoder,
    src: torch.Tensor,
    *,
    beam_size: int = 4,
    length_penalty_alpha: float = 0.6,
    bos_id: int,
    eos_id: int,
    pad_id: int,
    max_len: int,
) -> list[list[Hypothesis]]:
    """Beam search (module docstring) for each sentence of ``src (B, S)``: its finished
    hypotheses, at most ``beam_size``, best ``score`` first. Defaults: Vaswani et al. 2017
    (beam 4, alpha 0.6)."""
    k = check_positive_int("beam_size", beam_size)
    alpha = check_finite("length_penalty_alpha", length_penalty_alpha)
    check_positive_int("max_len", max_len)
    batch = src.shape[0]
    sentence_rows = torch.arange(batch, device=src.device)  # (B,)
    with _inference(model):
        memory = model.encode(src)
        # Hypothesis i of sentence b is row b * k + i of every decoder tensor.
        state = model.start_decoding(memory.select(sentence_rows.repeat_interleave(k)))
        prefixes = src.new_full((batch * k, 1), bos_id)  # (B k, t): BOS + tokens so far
        live = torch.full((batch, k), float("-inf"), device=src.device)  # cumulative log P
        live[:, 0] = 0.0  # the k copies of BOS are one hypothesis: keep only the first
        finished: list[list[Hypothesis]] = [[] for _ in range(batch)]
        for step in range(max_len):
            last = prefixes[:, -1:]
            log_p, state = _next_log_probs(
                model, last, state, step, max_len, bos_id, eos_id, pad_id
            )
            vocab = log_p.shape[1]
            extended = (live[:, :, None] + log_p.view(batch, k, vocab)).view(batch, k * vocab)
            scores, index = extended.topk(min(2 * k, k * vocab), dim=1)  # (B, 2k), best first
            parent, token = index // vocab, index % vocab  # (B, 2k) each
            _finish(finished, prefixes, scores, parent, token, k, eos_id, alpha)
            if all(len(hyps) >= k for hyps in finished):
                break
            # The best k extensions that do not end the sentence stay live.
            live, keep = scores.masked_fill(token == eos_id, float("-inf")).topk(k, dim=1)
            rows = (sentence_rows[:, None] * k + parent.gather(1, keep)).flatten()  # (B k,)
            prefixes = torch.cat([prefixes[rows], token.gather(1, keep).reshape(-1, 1)], dim=1)
            state = state.select(rows)
    return [sorted(hyps, key=lambda h: h.score, reverse=True) for hyps in finished]


def _finish(
    finished: list[list[Hypothesis]],
    prefixes: torch.Tensor,
    scores: torch.Tensor,
    parent: torch.Tensor,
    token: torch.Tensor,
    k: int,
    eos_id: int,
    alpha: float,
) -> None:
    """Move EOS extensions among each sentence's first k candidates into ``finished`` (until
    it holds k). scores, parent, token: ``(B, 2k)``; prefixes: ``(B k, t)``."""
    top = slice(0, k)
    ends = (token[:, top] == eos_id) & torch.isfinite(scores[:, top])  # (B, k)
    for b, j in ends.nonzero().tolist():
        if len(finished[b]) >= k:
            continue
        tokens = prefixes[b * k + int(parent[b, j]), 1:].tolist()  # without BOS
        log_p = float(scores[b, j])
        finished[b].append(
            Hypothesis(tokens, log_p, log_p / length_penalty(len(tokens) + 1, alpha))
        )


# ---- shared -------------------------------------------------------------------------------


def _next_log_probs(
    model: IncrementalDecoder,
    last: torch.Tensor,
    state,
    step: int,
    max_len: int,
    bos_id: int,
    eos_id: int,
    pad_id: int,
):
    """Feed ``last (N, 1)``; the head's log-probabilities ``(N, V)`` of the next token, with
    the tokens that may not come next set to -inf, and the new state."""
    hidden, state = model.decode_step(last, state)  # (N, 1, d)
    log_p = model.head.log_prob(hidden[:, -1]).float()  # (N, V)
    if step == max_len - 1:
        eos = log_p[:, eos_id].clone()
        log_p.fill_(float("-inf"))
        log_p[:, eos_id] = eos  # the last step may only end the sentence
    else:
        log_p[:, pad_id] = float("-inf")
        if bos_id != eos_id:
            log_p[:, bos_id] = float("-inf")
    return log_p, state


@contextmanager
def _inference(model: nn.Module) -> Iterator[None]:
    """Eval mode and no gradients; every module's training flag restored afterwards."""
    flags = {module: module.training for module in model.modules()}
    model.eval()
    try:
        with torch.no_grad():
            yield
    finally:
        for module, flag in flags.items():
            module.train(flag)
