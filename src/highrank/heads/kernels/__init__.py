"""The heads' kernels: faster ways to compute what a head's paper file computes.

A head's file (``softmax.py``, ``mos.py``, ``mixtape.py``, ...) holds its equations and its
*reference path*: ``_log_prob_rows`` and ``_loss_rows``, plain differentiable tensor code.
What is here computes the same values with less memory or time, and is taken by default:

* ``chunking.py``: ``chunk_size`` for every head (gradients computed in the forward pass, or
  checkpointing), the one chunk policy of ``chunk_size="auto"`` (``auto_chunk_tokens``), and
  ``chunked_loss_sum``, which runs a head's fused loss (``OutputHead.loss_kernel``) or the
  generic chunks;
* ``fused.py``: one factory that makes a loss computed with its gradients in the forward pass
  differentiable, eagerly and as one custom operator under torch.compile;
* ``mixture_ce.py``: the fused loss of a mixture of softmaxes over one decoder (softmax, MoC,
  the MLP softmax: K = 1; MoS); ``mixtape_ce.py``: Mixtape's;
* ``mixture_nll.py``: a mixture's NLL from its components' logits with a hand-written
  backward (MFS, MoS + CPR, whose components are not one decoder's);
* ``in_place.py``: inference without gradients, overwriting intermediates (the single-softmax
  heads' normalisation, MoS's mixing, Mixtape's logit assembly);
* ``paths.py``: ``reference_paths()``, the one way to ask for the reference paths instead.
"""

from __future__ import annotations

from highrank.heads.kernels.chunking import (
    AUTO_CHUNK_ELEMENTS,
    CUDA_AUTO_CHUNK_ELEMENTS,
    GENERIC_AUTO_CHUNK_TOKENS,
    LossKernel,
    auto_chunk_tokens,
)
from highrank.heads.kernels.paths import fast_paths, reference_paths

__all__ = [
    "AUTO_CHUNK_ELEMENTS",
    "CUDA_AUTO_CHUNK_ELEMENTS",
    "GENERIC_AUTO_CHUNK_TOKENS",
    "LossKernel",
    "auto_chunk_tokens",
    "fast_paths",
    "reference_paths",
]
