"""Softmax-CPR (Chang, Yao, Gon, Yu & McCallum, "Revisiting the Architectures like Pointer
Networks to Efficiently Improve the Next Word Distribution, Summarization Factuality, and
Beyond", Findings of ACL 2023, Sec. 3; the authors' code: iesl/Softmax-CPR,
``GPT2RerankHeadLMModel`` in ``modeling_gpt2.py``, configurations in ``bin/LM/main.sh``).

The softmax's logits ``z = E f_V(q_t) + b`` (q_t the multi-input state of MFS, ``mfs.py``;
``f`` facets, linear maps of q_t) are replaced on *dynamic partitions* of the vocabulary,
each by its own facet, so a few words can be scored apart from the global bottleneck:

R, reranker partition. The top-k1 ids of the current logits take the logits of a second facet,
then the top-k2 of the logits so obtained those of a third:

    z_x <- f_R1(q_t) . e_x + b_x   for x in top_k1(z);   then   z_x <- f_R2(q_t) . e_x + b_x
    for x in top_k2(z)        (k1 = 100, k2 = 20; a gather of k rows of E, not a V-wide product)

C, context partition. The words at positions before t in the context (x_j, j < t) take the
logits of their own facet:    z_x <- f_C(q_t) . e_x + b_x

P, pointer. A learned score between the current position and each earlier one, added to the
logit of the word there, averaged over the word's occurrences:

    z_x <- z_x + mean_{j < t, x_j = x}  f_PQ(q_t) . f_PK(q_j)

(the authors' code also averages the context partition's scores over occurrences, which are
equal; "earlier" is j < t as there: the current input token is not a candidate.)

The partitions are applied in that order (R, then C and P: a context word among the top k
takes C's logit). With ``n_components`` K > 1 this softmax is the first of a Mixture of
Softmaxes whose others are one facet each, mixed by a gate over q_t, in log space (the
authors formed log(p + 1e-8)):  log p = logsumexp_k(log pi_k + log_softmax(z_k)).

Defaults: the paper's strongest single-softmax configuration, "Softmax + CPR:20,100 + Mi"
(K = 1, C, P, R with k1 = 100, k2 = 20, MFS's inputs: 3 layers, 2 previous positions);
``n_components=3`` is their "MoS + CPR". ``reranker_k1`` / ``reranker_k2`` = 0 drop a stage
(with k1 = 0 the remaining stage reranks the top k2 of the softmax's own logits), counts above
V are read as V; ``context_partition`` / ``pointer`` = False drop C / P.

Memory: C and P score each row against the positions of its own sequence only, chunk by chunk
(``heads/sequence.py``: ``chunk x S`` scores per chunk); the authors built ``B x T x T x d``.
Cost: besides the K V-wide products, one ``top_{k1+k2}`` per row (the second stage's top k2 lie
among the first stage's k1 and the next k2), one gather of E's rows for R's candidates and C's
words together, and a V-wide copy per reranker stage and one for C and P, whose per-word
means are found by sorting each row's context (``WordGroups``), not over V.

Warm start (``start_at_base``): the softmax, C and R facets at [I, 0] (each reads g_t alone, as
the replaced softmax: C and R then assign the logits they replace), the pointer's query facet
at 0 and its key facet at [I, 0], so the score is 0 and its gradient with respect to the query
facet is not (the authors set both near 0: 1e-10 I); the head starts at the base
distribution exactly. The head reads ``("hidden", "layers", "context_ids")``.
"""

from __future__ import annotations

import torch
from torch import nn

from highrank.heads.functional import widen
from highrank.heads.mfs import read_through_multi_input
from highrank.heads.sequence import (
    ContextRows,
    Facets,
    SequenceHead,
    gate_log_prior,
    mixture_log_prob,
    mixture_loss,
)
from highrank.util.checks import check_bool, check_positive_int


class WordGroups:
    """The positions of each row's context grouped by word, ``ids (N, S)``: ``first (N, S)``
    marks each word's first position in its row, and :meth:`total` sums a value over each
    word's positions. Found by a stable sort of each row (``N S log S``), so nothing is
    ``V`` wide."""

    def __init__(self, ids: torch.Tensor) -> None:
        with torch.no_grad():
            sorted_ids, order = ids.sort(dim=1, stable=True)
            starts = torch.ones_like(sorted_ids, dtype=torch.bool)
            starts[:, 1:] = sorted_ids[:, 1:] != sorted_ids[:, :-1]  # a new word begins
            group = starts.long().cumsum(1) - 1  # each sorted position's word, 0..S-1
            self.group = torch.empty_like(group).scatter_(1, order, group)  # (N, S)
            self.first = torch.empty_like(starts).scatter_(1, order, starts)  # (N, S)

    def total(self, values: torch.Tensor) -> torch.Tensor:
        """``(N, S)``: at each position, the sum of ``values (N, S)`` over its word's
        positions in the row."""
        sums = torch.zeros_like(values).scatter_add(1, self.group, values)
        return sums.gather(1, self.group)


def check_candidates(key: str, value: object) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ValueError(f"{key} must be an integer >= 0 (0 drops the stage); got {value!r}")
    return value


class SoftmaxCPR(SequenceHead):
    """Softmax + C + P + R output layer (module docstring).

    Args:
        context_partition: C, the context words' logits from their own facet.
        pointer: P, the pointer scores added to the context words' logits.
        reranker_k1: candidates of the first reranker stage (paper: 100); 0: none.
        reranker_k2: candidates of the second stage, from the first's logits (paper: 20).
        n_components: K softmaxes mixed as MoS (the first carries C, P, R); 1: one softmax.
        input_layers, input_window, multi_input, normalize_inputs: MFS's inputs
            (``heads/mfs.py``; ``normalize_inputs``, on by default, departs from the paper).
        time_dim: the time axis of hidden's leading shape (None: the last, before the
            features; 0 for time-major ``(T, B, d)``).
        d_in, vocab_size, d_embed, tied_weight: as :class:`highrank.heads.base.OutputHead`.
    """

    reads = ("hidden", "layers", "context_ids")

    def __init__(
        self,
        d_in: int,
        vocab_size: int,
        *,
        d_embed: int | None = None,
        tied_weight: nn.Parameter | None = None,
        context_partition: bool = True,
        pointer: bool = True,
        reranker_k1: int = 100,
        reranker_k2: int = 20,
        n_components: int = 1,
        input_layers: int = 3,
        input_window: int = 2,
        multi_input: bool = True,
        normalize_inputs: bool = True,
        time_dim: int | None = None,
    ) -> None:
        super().__init__(d_in, vocab_size, d_embed=d_embed, tied_weight=tied_weight)
        self.context_partition = check_bool("context_partition", context_partition)
        self.pointer = check_bool("pointer", pointer)
        self.reranker_k1 = check_candidates("reranker_k1", reranker_k1)
        self.reranker_k2 = check_candidates("reranker_k2", reranker_k2)
        self.n_components = check_positive_int("n_components", n_components)
        read_through_multi_input(self, d_in, input_layers=input_layers,
                                 input_window=input_window, multi_input=multi_input,
                                 normalize_inputs=normalize_inputs, time_dim=time_dim)
        # facets: the K softmaxes', then C, R1, R2, the pointer's query and key, as switched on
        names = [f"softmax{k}" for k in range(n_components)]
        names += ["context"] * self.context_partition
        names += ["rerank1"] * bool(self.reranker_k1) + ["rerank2"] * bool(self.reranker_k2)
        names += ["pointer_query", "pointer_key"] * self.pointer
        self.facet_index = {name: i for i, name in enumerate(names)}
        self.facets = Facets(self.inputs.width, self.d_embed, len(names))
        self.gate = nn.Linear(self.inputs.width, n_components) if n_components > 1 else None

    def start_at_base(self, projection: nn.Linear | None = None) -> None:
        for name, i in self.facet_index.items():
            self.facets.start(i, self.d_in, projection, zero=name == "pointer_query")

    def logits_per_token(self) -> int:
        # the K softmaxes, a copy per reranker stage and one for C and P together
        extra = bool(self.reranker_k1) + bool(self.reranker_k2)
        extra += self.context_partition or self.pointer
        return (self.n_components + extra) * self.vocab_size

    # ---- rows ------------------------------------------------------------------------------

    def _sequence_rows(self, hidden, layers, ids):
        length, context_length = hidden.shape[1], ids.shape[1]
        if self.pointer:  # keys at every position of the context: Mi over all of it
            q = self.inputs(layers)  # (B, S, width)
            keys = self.facets.one(q, self.facet_index["pointer_key"])  # f_PK(q_j): (B, S, d)
            q = q[:, context_length - length :]
        else:  # Mi over the rows' windows only
            q = self.inputs.rows(layers, length)
            keys = q.new_zeros(q.shape[0], context_length, 0)
        context = ContextRows(ids, keys, length=length, history=context_length - length)
        return q.reshape(-1, self.inputs.width), (context,)  # rows (B T, width)

    # ---- the paper's equations ---------------------------------------------------------------

    def component_logits(self, q: torch.Tensor, context: ContextRows) -> torch.Tensor:
        """``(N, K, V)``: the first softmax's logits after R, C and P, then the others'."""
        facets = self.facets(q)  # (N, n_facets, d_embed)
        logits = [self._decoder_logits(facets[:, k]) for k in range(self.n_components)]
        first = logits[0]
        stages = [(self.facet_index[name], min(top, self.vocab_size)) for name, top in
                  (("rerank1", self.reranker_k1), ("rerank2", self.reranker_k2)) if top]
        candidates = first.detach().topk(min(sum(k for _, k in stages), self.vocab_size)) \
            if stages else None
        rows = self._embedding_rows(None if candidates is None else candidates.indices, context)
        if stages:
            first = self._rerank(first, facets, candidates, rows[0], stages)
        if self.context_partition or self.pointer:
            first = self._context_logits(first, facets, context, rows[1])
        return torch.stack([first, *logits[1:]], dim=1)

    def _embedding_rows(self, candidates: torch.Tensor | None, context: ContextRows) -> tuple:
        """``((e_x (N, k, d), b_x (N, k)) of the reranker's candidates, (e_x (k_seq, S, d),
        b_x flat) of the context's words per sequence held)``, gathered in one index of E and
        b (each index costs a V x d gradient in the backward pass); None for a part the head
        does not have."""
        ids = []
        if candidates is not None:
            ids.append(candidates.reshape(-1))
        if self.context_partition:
            ids.append(context.ids.clamp_min(0).reshape(-1))
        if not ids:
            return None, None
        sizes = [part.numel() for part in ids]
        ids = torch.cat(ids) if len(ids) > 1 else ids[0]
        # split, not sliced: a slice's backward pass fills a zero tensor of the whole
        weights = self.weight[ids].split(sizes)  # (n, d_embed) each
        biases = self.bias[ids].split(sizes)
        parts = iter(zip(weights, biases, strict=True))
        reranked = contextual = None
        if candidates is not None:
            weight, bias = next(parts)
            reranked = (weight.view(*candidates.shape, weight.shape[-1]),
                        bias.view(candidates.shape))
        if self.context_partition:
            weight, bias = next(parts)
            contextual = (weight.view(*context.ids.shape, weight.shape[-1]), bias)
        return reranked, contextual

    def _rerank(self, logits, facets, candidates, rows, stages) -> torch.Tensor:
        """R: the top k1 logits replaced by the first facet's, then the top k2 of the logits
        so obtained by the second's. The top k2 after the first stage lie among the top
        k1 + k2 before it (the k1 replaced, or the next k2), so both stages read the same
        ``candidates`` (their ids ``(N, k1 + k2)``, descending) and ``rows``, their e_x, b_x
        (up to ties: among logits exactly equal at the boundary another top k2 may be
        chosen, as top-k itself may choose either)."""
        table, bias = rows
        ids, values = candidates.indices, candidates.values  # (N, k1 + k2)
        stage_facets = facets[:, [index for index, _ in stages]]  # (N, stages, d_embed)
        # every candidate against every stage's facet, one product: (N, k1 + k2, stages)
        all_scores = torch.bmm(table.to(facets.dtype), stage_facets.transpose(1, 2))
        all_scores = (widen(all_scores) + bias[..., None]).to(logits.dtype)
        for stage, (_, top) in enumerate(stages):
            scores = all_scores[..., stage]  # (N, k1 + k2)
            if stage == 0:
                chosen = torch.arange(top, device=ids.device).expand(ids.shape[0], top)
            else:  # the candidates' logits after the first stage decide
                chosen = values.topk(top, dim=-1).indices  # positions among the candidates
            new = scores.gather(1, chosen)
            values = values.scatter(1, chosen, new.detach())
            logits = logits.scatter(1, ids.gather(1, chosen), new)
        return logits

    def _context_logits(
        self, logits: torch.Tensor, facets: torch.Tensor, context: ContextRows,
        rows: tuple[torch.Tensor, torch.Tensor],
    ) -> torch.Tensor:
        """C and P over the words of each row's earlier positions (module docstring).

        Worked out at the ``(N, S)`` context positions, then written into the ``(N, V)``
        logits in one scatter: every position of a word in a row carries that word's value
        (C's logit, or the logit so far, plus the mean of P's scores over its earlier
        occurrences), so repeated writes agree; only a word's first position carries the
        gradient, so the word counts once."""
        ids, counted = context.earlier()  # (N, S) each
        words = WordGroups(ids)
        weights = counted.to(logits.dtype)
        occurrences = words.total(weights)  # earlier occurrences of x_j: (N, S)
        value = logits.gather(1, ids)  # the logit so far of x_j: (N, S)
        if self.context_partition:
            table, bias = rows  # e_{x_j} (k, S, d_embed) per sequence held, b_{x_j} flat
            scores = context.scores(facets[:, self.facet_index["context"]], table)
            # (N, S): b_{x_j} for each row's own sequence; equal over a word's positions
            scores = widen(scores) + bias.view(context.ids.shape)[context.row_seq()]
            value = torch.where(occurrences > 0, scores.to(logits.dtype), value)
        if self.pointer:
            scores = context.scores(facets[:, self.facet_index["pointer_query"]], context.keys)
            summed = words.total(widen(scores).to(logits.dtype) * weights)
            value = value + summed / occurrences.clamp_min(1.0)
        value = torch.where(words.first, value, value.detach())
        return logits.scatter(1, ids, value)

    def _log_prob_rows(self, q: torch.Tensor, context: ContextRows) -> torch.Tensor:
        return mixture_log_prob(gate_log_prior(self.gate, q), self.component_logits(q, context))

    def _loss_rows(self, q, target, context, *, label_smoothing):
        logits = self.component_logits(q, context)
        return mixture_loss(gate_log_prior(self.gate, q), logits, target, label_smoothing)

    def extra_repr(self) -> str:
        parts = [
            "C" * self.context_partition,
            "P" * self.pointer,
            f"R:{self.reranker_k1},{self.reranker_k2}" * bool(self.reranker_k1 or self.reranker_k2),
        ]
        return (
            f"{super().extra_repr()}, partitions={'+'.join(p for p in parts if p) or 'none'}, "
            f"n_components={self.n_components}, input_layers={self.input_layers}, "
            f"input_window={self.input_window}, multi_input={self.multi_input}, "
            f"normalize_inputs={self.normalize_inputs}"
        )
