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
``n_components=3`` is their "MoS + CPR". ``reranker_k1`` / ``reranker_k2`` = 0 drop a stage,
``context_partition`` / ``pointer`` = False drop C / P.

Memory: C and P score each row against the positions of its own sequence only, chunk by chunk
(``heads/sequence.py``: ``chunk x S`` scores per chunk); the authors built ``B x T x T x d``.

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
        # the K softmaxes, and the context partition's counts and sums
        extra = 3 if self.context_partition or self.pointer else 0
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
        for stage, top in (("rerank1", self.reranker_k1), ("rerank2", self.reranker_k2)):
            if top:
                first = self._rerank(first, facets[:, self.facet_index[stage]], top)
        if self.context_partition or self.pointer:
            first = self._context_logits(first, facets, context)
        return torch.stack([first, *logits[1:]], dim=1)

    def _facet_logits(self, facet: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """``f . e_x + b_x`` for the ids ``(N, k)`` of each row, facet ``(N, d)``: ``(N, k)``."""
        scores = torch.einsum("nd,nkd->nk", facet, self.weight[ids].to(facet.dtype))
        return widen(scores) + self.bias[ids]

    def _rerank(self, logits: torch.Tensor, facet: torch.Tensor, top: int) -> torch.Tensor:
        """R: the ``top`` largest logits replaced by the facet's."""
        ids = logits.detach().topk(min(top, self.vocab_size), dim=-1).indices  # (N, k)
        return logits.scatter(1, ids, self._facet_logits(facet, ids).to(logits.dtype))

    def _context_logits(
        self, logits: torch.Tensor, facets: torch.Tensor, context: ContextRows
    ) -> torch.Tensor:
        """C and P over the words of each row's earlier positions (module docstring)."""
        ids, counted = context.earlier()  # (N, S) each
        weights = counted.to(logits.dtype)
        count = torch.zeros_like(logits).scatter_add(1, ids, weights)  # occurrences (N, V)
        occurrences = count.clamp_min(1.0)
        if self.context_partition:
            table = self.weight[context.ids.clamp_min(0)]  # e_{x_j}: (k, S, d_embed)
            scores = context.scores(facets[:, self.facet_index["context"]], table)
            scores = widen(scores) + self.bias[ids]  # (N, S)
            summed = torch.zeros_like(logits).scatter_add(1, ids, scores.to(logits.dtype) * weights)
            logits = torch.where(count > 0, summed / occurrences, logits)
        if self.pointer:
            scores = context.scores(facets[:, self.facet_index["pointer_query"]], context.keys)
            summed = torch.zeros_like(logits).scatter_add(
                1, ids, widen(scores).to(logits.dtype) * weights
            )
            logits = logits + summed / occurrences
        return logits

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
