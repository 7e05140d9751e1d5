"""Multi-Facet Softmax (Chang & McCallum, "Softmax Bottleneck Makes Language Models Unable to
Represent Multi-mode Word Distributions", ACL 2022, Sec. 4; the authors' code:
iesl/Softmax-CPR, ``GPT2MoSLMHeadModel`` in ``modeling_gpt2_multi.py``).

A softmax's single hidden state cannot be close to the embeddings of several next words that
lie apart with other words between them; MFS gives the output layer more than one query
("facets"), from more than one input:

Multiple input hidden states (Mi). The last L layers at the current and W previous positions
(L = 3, W = 2: nine vectors) pass through one linear layer and a GELU, beside the top one:

    q_t = [ g_t ; GELU(L^h [l_L(t) ; l_L(t-1) ; ... ; l_1(t-W)]) ]       (2 d_in)

(positions before the start of the context count as zero vectors). One departure from the
paper, the knob ``normalize_inputs`` (default on): each of the nine vectors entering L^h is
RMS-normalised, ``l / sqrt(mean(l^2) + 1e-6)``, no parameters. The authors read GPT-2's raw
residual stream and fine-tuned at lr 1e-5; the lower layers of a current LM carry massive
activations (SmolLM2-135M's last three: |l| up to 23,808 and RMS 66, 40 and 1.9, the top one
after its final norm), which make L^h's output, and with it the first Adam steps on the
facets' zero columns, blow up: warm-started CPR at lr 1e-4 reached a training loss of 74 in
two steps (SmolLM2's own is about 3). ``normalize_inputs=False`` is the paper's Mi.

Facets. Each is a linear projection of q_t scored against the one shared output embedding E:
``f_i(q) = W_i q + c_i``, logits ``E f_i(q) + b``.

Multiple partitions (MP). The vocabulary is split into J partitions, word x in partition
``x mod J`` (the authors' interleaved split), and the first softmax gives each partition its
own facet: ``z_{1,x} = f_{x mod J}(q_t) . e_x + b_x``, one V-wide product in all.

Mixture (MoS). K softmaxes, the first the partitioned one and the others one facet each, mixed
by a gate over q_t, in log space (the authors' code formed log(p + 1e-8); not here):

    log p(x | c_t) = logsumexp_k( log pi_k(q_t) + log_softmax(z_k)_x ),  pi = softmax(G q_t + a)

Defaults are the paper's GPT-2 configuration: K = 3 softmaxes, J = 4 partitions, L = 3 layers,
W = 2 previous positions. ``multi_input=False`` reads the top layer alone (q_t = g_t).

Warm start (``start_at_base``, as the authors start from GPT-2): every facet at [I, 0] (it
reads g_t alone, as the replaced softmax), so every partition and every softmax is that
softmax and so is any mixture of them; L^h and the gate keep their random initialisation,
so the facets' zero columns get gradients from the first step.

The head reads ``("hidden", "layers")``: see ``heads/sequence.py`` for the layers it reads.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from highrank.heads.functional import linear, widen
from highrank.heads.sequence import (
    Facets,
    SequenceHead,
    check_time_dim,
    gate_log_prior,
    mixture_log_prob,
    mixture_loss,
    shift_right,
)
from highrank.util.checks import check_bool, check_positive_int

RMS_EPS = 1e-6  # normalize_inputs: l / sqrt(mean(l^2) + RMS_EPS)


class MultiInput(nn.Module):
    """Mi: ``q_t = [g_t ; GELU(L^h [l_L(t) ; l_L(t-1) ; ... ; l_1(t-W)])]`` (module docstring),
    or ``q_t = g_t`` when ``enabled`` is False. ``layers``: L tensors ``(B, S, d_in)``, top
    last (its values are g); returns ``(B, S, width)``."""

    def __init__(self, d_in: int, n_layers: int, window: int, *, enabled: bool = True,
                 normalize: bool = True) -> None:
        super().__init__()
        self.n_layers, self.window, self.enabled = n_layers, window, enabled
        self.normalize = normalize
        self.width = 2 * d_in if enabled else d_in
        self.mlp = nn.Linear(d_in * n_layers * (window + 1), d_in) if enabled else None

    def rows(self, layers: Sequence[torch.Tensor], length: int) -> torch.Tensor:
        """q of the last ``length`` positions only, ``(B, length, width)``: Mi over their
        windows (the W positions before them), not over a whole generation's context."""
        start = max(0, layers[-1].shape[1] - length - self.window)
        q = self([layer[:, start:] for layer in layers])
        return q[:, q.shape[1] - length :]

    def forward(self, layers: Sequence[torch.Tensor]) -> torch.Tensor:
        top = layers[-1]
        if self.mlp is None:
            return top
        # from the top layer down, each at t, t-1, ..., t-W (the authors' order)
        steps = range(self.window + 1)
        if self.normalize:  # each vector over its d_in features (module docstring)
            layers = [layer * torch.rsqrt(layer.pow(2).mean(-1, keepdim=True) + RMS_EPS)
                      for layer in layers]
        parts = [shift_right(layer, k) for layer in reversed(layers) for k in steps]
        mixed = F.gelu(self.mlp(torch.cat(parts, dim=-1)), approximate="tanh")
        return torch.cat([top, mixed.to(top.dtype)], dim=-1)


def check_window(value: object) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ValueError(f"input_window must be an integer >= 0; got {value!r}")
    return value


def read_through_multi_input(head: nn.Module, d_in: int, *, input_layers: int,
                             input_window: int, multi_input: bool, normalize_inputs: bool,
                             time_dim: int | None) -> None:
    """Give ``head`` (MFS, and CPR, which reads its inputs the same way) its knobs of what it
    reads, checked, and its Mi (``head.inputs``): ``multi_input``, ``input_layers`` (1 without
    Mi), ``input_window``, ``normalize_inputs`` and ``time_dim``."""
    head.multi_input = check_bool("multi_input", multi_input)
    head.input_layers = check_positive_int("input_layers", input_layers) if multi_input else 1
    head.input_window = check_window(input_window)
    head.normalize_inputs = check_bool("normalize_inputs", normalize_inputs)
    head.time_dim = check_time_dim(time_dim)
    head.inputs = MultiInput(d_in, head.input_layers, head.input_window, enabled=multi_input,
                             normalize=normalize_inputs)


class MultiFacetSoftmax(SequenceHead):
    """MFS output layer (module docstring).

    Args:
        n_components: K, softmaxes in the mixture (paper: 3); 1 is the partitioned softmax.
        n_partitions: J, partitions of the first softmax's vocabulary (paper: 4); 1: none.
        input_layers: L, the last layers read (paper: 3).
        input_window: W, previous positions read of each (paper: 2).
        multi_input: read the layers through Mi (q = [g ; GELU(L^h ...)]); False: q = g.
        normalize_inputs: RMS-normalise each vector entering L^h (module docstring; False:
            the paper's raw layers).
        time_dim: the time axis of hidden's leading shape (None: the last, before the
            features; 0 for time-major ``(T, B, d)``).
        d_in, vocab_size, d_embed, tied_weight: as :class:`highrank.heads.base.OutputHead`.
    """

    reads = ("hidden", "layers")

    def __init__(
        self,
        d_in: int,
        vocab_size: int,
        *,
        d_embed: int | None = None,
        tied_weight: nn.Parameter | None = None,
        n_components: int = 3,
        n_partitions: int = 4,
        input_layers: int = 3,
        input_window: int = 2,
        multi_input: bool = True,
        normalize_inputs: bool = True,
        time_dim: int | None = None,
    ) -> None:
        super().__init__(d_in, vocab_size, d_embed=d_embed, tied_weight=tied_weight)
        self.n_components = check_positive_int("n_components", n_components)
        self.n_partitions = check_positive_int("n_partitions", n_partitions)
        if self.n_partitions > vocab_size:
            raise ValueError(f"n_partitions={n_partitions} exceeds the vocabulary ({vocab_size})")
        read_through_multi_input(self, d_in, input_layers=input_layers,
                                 input_window=input_window, multi_input=multi_input,
                                 normalize_inputs=normalize_inputs, time_dim=time_dim)
        # J facets for the partitioned softmax, then one for each other softmax
        self.facets = Facets(self.inputs.width, self.d_embed, n_partitions + n_components - 1)
        self.gate = nn.Linear(self.inputs.width, n_components) if n_components > 1 else None

    def start_at_base(self, projection: nn.Linear | None = None) -> None:
        for i in range(self.facets.n):
            self.facets.start(i, self.d_in, projection)

    def logits_per_token(self) -> int:
        return self.n_components * self.vocab_size

    def _sequence_rows(self, hidden, layers, ids):
        q = self.inputs.rows(layers, hidden.shape[1])  # hidden's positions: (B, T, width)
        return q.reshape(-1, self.inputs.width), ()

    def component_logits(self, q: torch.Tensor) -> torch.Tensor:
        """``(N, K, V)``: the partitioned softmax's logits, then the other softmaxes'."""
        facets = self.facets(q)  # (N, J + K - 1, d_embed)
        first = self._partitioned_logits(facets[:, : self.n_partitions])
        rest = [self._decoder_logits(facets[:, j]) for j in range(self.n_partitions, self.facets.n)]
        return torch.stack([first, *rest], dim=1)

    def _partitioned_logits(self, facets: torch.Tensor) -> torch.Tensor:
        """``z_x = f_{x mod J}(q) . e_x + b_x``: facets ``(N, J, d_embed)`` -> ``(N, V)``."""
        parts = self.n_partitions
        if parts == 1:
            return self._decoder_logits(facets[:, 0])
        logits = None
        for j in range(parts):
            piece = widen(linear(facets[:, j], self.weight[j::parts], self.bias[j::parts]))
            if logits is None:
                logits = piece.new_empty(piece.shape[0], self.vocab_size)
            logits[:, j::parts] = piece
        return logits

    def _log_prob_rows(self, q: torch.Tensor) -> torch.Tensor:
        return mixture_log_prob(gate_log_prior(self.gate, q), self.component_logits(q))

    def _loss_rows(self, q, target, *, label_smoothing):
        logits = self.component_logits(q)
        return mixture_loss(gate_log_prior(self.gate, q), logits, target, label_smoothing)

    def extra_repr(self) -> str:
        return (
            f"{super().extra_repr()}, n_components={self.n_components}, "
            f"n_partitions={self.n_partitions}, input_layers={self.input_layers}, "
            f"input_window={self.input_window}, multi_input={self.multi_input}, "
            f"normalize_inputs={self.normalize_inputs}"
        )
