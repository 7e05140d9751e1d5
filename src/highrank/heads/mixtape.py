"""Mixtape (Yang, Luong, Salakhutdinov & Le, "Mixtape: Breaking the Softmax Bottleneck
Efficiently", NeurIPS 2019): mix K = 4 *logits* with token-specific gates, then one softmax.

    h_k = tanh(H_k g + a_k)                    k = 1..4, size d_embed
    l_{k,x} = h_k . w_x                        component logits (w_x: row x of E)
    t_j = tanh(U_j g + c_j)                    j = 1..3, gate features of size gate_dim
    l_{x,j} = v_x . t_j + u_j . g + b_{x,j}    pre-activation priors, frequent tokens x < S
    l_{x,j} = u_j . g                          all other tokens (gate sharing)
    pi_{x,.} = sigmoid_tree(l_{x,.})           4 priors per token, summing to 1
    log p(x | c) = log_softmax_x( sum_k pi_{x,k} l_{k,x} + b_x )

Vector gating (a prior per token) makes the logit matrix high-rank; the sigmoid tree replaces
a K-way softmax per token; gate sharing gives the V - S rare tokens one prior per context, so
their logits are a single matmul with the mixed context sum_k pi_k h_k and no K x V gate tensor
is ever built for them. S = floor(frequent_fraction x V) over frequency-ordered ids.

``residual_contexts=True`` (for starting at a trained softmax; ``heads/residual.py``) uses
h_k = g' + Z_k tanh(H_k g + a_k) with Z_k zero at init: with four equal contexts every
token's logit is sum_k pi_{x,k} (g' . w_x) = g' . w_x, since the tree's priors sum to 1,
whatever the gates, so Mixtape starts as that softmax exactly.

Regularisers of the paper (Sec. 3.4; Sec. 4.1 uses them for language modelling): Gaussian
noise on the pre-activation priors (``gate_noise``), dropout on the gate features t_j
(``gate_dropout``) and on the component contexts h_k (``component_dropout``), and weight
normalisation of U (``gate_weight_norm``) "with a constant scale". Our reading of the last
(the only public Mixtape implementation, ``Mixtape`` in Mesh TensorFlow's
``transformer/vocab_embeddings.py``, is the translation model and has no weight
normalisation to compare with): every row u of U is reparametrised as g u / ||u||
(Salimans & Kingma 2016, ``torch.nn.utils.parametrizations.weight_norm``) with the scale g
held constant, not trained: each row keeps the norm it was initialised with, so the layer
starts as the plain one and only the directions of U are learned.
"""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.nn.utils.parametrizations import weight_norm

from highrank.heads.base import OutputHead
from highrank.heads.dropout import GaussianNoise, HeadDropout
from highrank.heads.functional import apply_mask, linear, sigmoid_tree_mix, widen
from highrank.heads.kernels.in_place import assembles_in_place, mixtape_logits_
from highrank.heads.kernels.mixtape_ce import MIXTAPE_LOSS, VALUES_PER_FREQUENT_ID
from highrank.heads.residual import ResidualContexts
from highrank.util.checks import (
    check_bool,
    check_dropout_time_dim,
    check_positive_int,
    check_probability,
    is_number,
)

N_COMPONENTS = 4  # the sigmoid tree below is written for exactly four components
N_GATES = N_COMPONENTS - 1


class Mixtape(OutputHead):
    """Mixtape output layer.

    Args:
        gate_dim: size of the gate features t_j and token gate vectors v_x (<< d_embed).
        frequent_fraction: r; the S = floor(r V) most frequent ids get their own gates
            (paper: 0.1 for language modelling, 0.5 for translation).
        gate_noise: std of Gaussian noise added to the pre-activation priors in training.
        gate_dropout: dropout on the gate features t_j.
        component_dropout: dropout on the component contexts h_k.
        gate_weight_norm: weight-normalise the rows of U (the gate-feature matrices U_j) with
            a constant scale: each row's norm stays at its initial value (module docstring).
        residual_contexts: h_k = g' + Z_k tanh(H_k g + a_k), Z_k = 0 at init, so that
            ``start_at_base`` makes the head a given softmax (module docstring).
        dropout_time_dim: the time axis of ``hidden`` over which dropout masks are shared
            (locked dropout: 0 for AWD-LSTM's time-major ``(T, B, d)``, 1 for batch-first);
            None (default) draws an independent mask for every token.
        d_in, vocab_size, d_embed, tied_weight: as :class:`highrank.heads.base.OutputHead`.
    """

    def __init__(
        self,
        d_in: int,
        vocab_size: int,
        *,
        d_embed: int | None = None,
        tied_weight: nn.Parameter | None = None,
        gate_dim: int = 64,
        frequent_fraction: float = 0.1,
        gate_noise: float = 0.0,
        gate_dropout: float = 0.0,
        component_dropout: float = 0.0,
        gate_weight_norm: bool = False,
        dropout_time_dim: int | None = None,
        residual_contexts: bool = False,
    ) -> None:
        super().__init__(d_in, vocab_size, d_embed=d_embed, tied_weight=tied_weight)
        self.gate_dim = check_positive_int("gate_dim", gate_dim)
        if not is_number(frequent_fraction) or not 0 <= frequent_fraction <= 1:
            raise ValueError(f"frequent_fraction must lie in [0, 1]; got {frequent_fraction!r}")
        # Rounded first so that e.g. 0.29 x 100 = 28.999999999999996 still gives S = 29.
        self.n_frequent = math.floor(round(frequent_fraction * vocab_size, 9))
        # Rates and noise live in nn.Dropout modules, where model.eval() and TRL's dropout
        # switch reach them (heads/dropout.py); the knobs below read and set their p.
        self.gate_noise_layer = GaussianNoise(_check_gate_noise(gate_noise))
        self.gate_dropout_layer = HeadDropout(check_probability("gate_dropout", gate_dropout))
        self.component_dropout_layer = HeadDropout(
            check_probability("component_dropout", component_dropout)
        )
        self.dropout_time_dim = check_dropout_time_dim(dropout_time_dim)

        self.components = nn.Linear(d_in, N_COMPONENTS * self.d_embed)  # H_k, a_k
        self.residual_contexts = check_bool("residual_contexts", residual_contexts)
        self.residual_branch = (
            ResidualContexts(d_in, self.d_embed, N_COMPONENTS, self.d_embed)
            if residual_contexts
            else None
        )
        self.gate_features = nn.Linear(d_in, N_GATES * gate_dim)  # U_j, c_j
        self.context_gate = nn.Linear(d_in, N_GATES, bias=False)  # u_j
        self.token_gate = nn.Parameter(torch.empty(self.n_frequent, gate_dim))  # v_x
        self.token_gate_bias = nn.Parameter(torch.zeros(self.n_frequent, N_GATES))  # b_{x,j}
        nn.init.normal_(self.token_gate, std=gate_dim**-0.5)
        self.gate_weight_norm = check_bool("gate_weight_norm", gate_weight_norm)
        if gate_weight_norm:
            _weight_norm_with_constant_scale(self.gate_features)

    @property
    def gate_noise(self) -> float:
        """Std of the noise on the pre-activation priors: ``gate_noise_layer``'s p."""
        return self.gate_noise_layer.p

    @gate_noise.setter
    def gate_noise(self, value: float) -> None:
        self.gate_noise_layer.p = _check_gate_noise(value)

    @property
    def gate_dropout(self) -> float:
        """Dropout on the gate features: ``gate_dropout_layer``'s p."""
        return self.gate_dropout_layer.p

    @gate_dropout.setter
    def gate_dropout(self, value: float) -> None:
        self.gate_dropout_layer.p = check_probability("gate_dropout", value)

    @property
    def component_dropout(self) -> float:
        """Dropout on the component contexts: ``component_dropout_layer``'s p."""
        return self.component_dropout_layer.p

    @component_dropout.setter
    def component_dropout(self, value: float) -> None:
        self.component_dropout_layer.p = check_probability("component_dropout", value)

    BASE_INIT_KNOBS = {"residual_contexts": True}
    loss_kernel = MIXTAPE_LOSS  # fused chunked cross-entropy (heads/kernels/mixtape_ce.py)

    def start_at_base(self, projection: nn.Linear | None = None) -> None:
        if self.residual_branch is None:
            raise ValueError(
                "Mixtape with the paper's contexts tanh(H_k g + a_k) cannot equal a softmax; "
                "build it with residual_contexts=True (init='base' does)"
            )
        self.residual_branch.start_at_base(projection)

    def _draw_masks(self, hidden: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        return (
            self._dropout_mask(hidden, N_COMPONENTS * self.d_embed, self.component_dropout_layer),
            self._dropout_mask(hidden, N_GATES * self.gate_dim, self.gate_dropout_layer),
        )

    def _gate_noise_std(self) -> float:
        """The noise's std in force: 0 in eval mode or once switched off (p = 0)."""
        return self.gate_noise_layer.std() if self.training else 0.0

    def _noisy(self, pre_activation: torch.Tensor) -> torch.Tensor:
        std = self._gate_noise_std()
        if std == 0.0:
            return pre_activation
        return pre_activation + std * torch.randn_like(pre_activation)

    def tanh_context_inputs(self, g: torch.Tensor) -> torch.Tensor:
        """``H_k g + a_k`` for every k, ``(N, 4 d_embed)`` (``OutputHead``; the gate features'
        tanh units only weigh the contexts, and are not counted)."""
        return self.components(g)

    def _contexts(self, h: torch.Tensor, component_mask: torch.Tensor | None) -> torch.Tensor:
        """The component contexts h_k ``(N, 4, d_embed)``."""
        contexts = apply_mask(torch.tanh(self.components(h)), component_mask)
        contexts = contexts.view(h.shape[0], N_COMPONENTS, self.d_embed)
        if self.residual_branch is not None:
            contexts = self.residual_branch(h, contexts)  # g' + Z_k tanh(H_k g + a_k)
        return contexts

    def _features(self, h: torch.Tensor, gate_mask: torch.Tensor | None) -> torch.Tensor:
        """The gate features t_j ``(N, 3, gate_dim)``."""
        features = apply_mask(torch.tanh(self.gate_features(h)), gate_mask)
        return features.view(h.shape[0], N_GATES, self.gate_dim)

    def _logits_rows(
        self,
        h: torch.Tensor,
        component_mask: torch.Tensor | None,
        gate_mask: torch.Tensor | None,
    ) -> torch.Tensor:
        """Mixed logits ``(N, V)``, at least float32, frequent ids first."""
        n = h.shape[0]
        contexts = self._contexts(h, component_mask)  # (N, 4, d)
        shared_pre = widen(self.context_gate(h)).unsqueeze(-1)  # (N, 3, 1): u_j . g

        # Rare tokens share one prior per context: a single matmul with the mixed context.
        mixed = sigmoid_tree_mix(self._noisy(shared_pre), contexts)  # (N, d)
        if assembles_in_place(self, contexts):  # inference: the same logits, assembled in
            return mixtape_logits_(self, h, contexts, shared_pre, mixed, gate_mask)  # place
        rare = widen(linear(mixed, self.weight[self.n_frequent :]))  # (N, V - S)
        if self.n_frequent == 0:
            return rare + self.bias

        # Frequent tokens: gates and component logits laid out (N, gate or component, S) so
        # that both come from plain matmuls and the tree mixes contiguous rows.
        features = self._features(h, gate_mask).view(n * N_GATES, self.gate_dim)
        token_pre = widen(features @ self.token_gate.t()).view(n, N_GATES, self.n_frequent)
        token_pre = token_pre + shared_pre + self.token_gate_bias.t()  # (N, 3, S)
        frequent_rows = self.weight[: self.n_frequent]
        component_logits = widen(linear(contexts, frequent_rows))  # (N, 4, S)
        frequent = sigmoid_tree_mix(self._noisy(token_pre), component_logits)  # (N, S)
        return torch.cat((frequent, rare), dim=1) + self.bias

    def logits_per_token(self) -> int:
        """The fused loss's V logits, plus 12 values per frequent id at its peak."""
        return self.vocab_size + VALUES_PER_FREQUENT_ID * self.n_frequent

    def extra_repr(self) -> str:
        return (
            f"{super().extra_repr()}, gate_dim={self.gate_dim}, n_frequent={self.n_frequent}, "
            f"gate_noise={self.gate_noise}, gate_dropout={self.gate_dropout}, "
            f"component_dropout={self.component_dropout}, "
            f"gate_weight_norm={self.gate_weight_norm}"
            + (", residual_contexts=True" if self.residual_contexts else "")
        )


def _check_gate_noise(gate_noise: float) -> float:
    if not is_number(gate_noise) or not 0 <= gate_noise < math.inf:
        raise ValueError(f"gate_noise must be a finite number >= 0; got {gate_noise!r}")
    return float(gate_noise)


def _weight_norm_with_constant_scale(linear: nn.Linear) -> None:
    """Reparametrise ``linear.weight`` row by row as g v / ||v|| with g constant.

    ``weight_norm`` (dim 0: one scale per output row) registers g as ``original0`` and v as
    ``original1``, both Parameters, g initialised to the rows' norms. g becomes a buffer of
    the same name: it keeps its value, moves with ``.to()`` and stays in the state dict
    (``gate_features.parametrizations.weight.original0``), but no optimiser sees it.
    """
    weight_norm(linear, name="weight", dim=0)
    parametrization = linear.parametrizations.weight
    scale = parametrization.original0.detach().clone()  # (rows, 1)
    del parametrization.original0
    parametrization.register_buffer("original0", scale)
