"""SigSoftmax (Kanai et al., "Sigsoftmax: Reanalysis of the Softmax Bottleneck", NeurIPS 2018).

p(x | c) ∝ exp(z_x) · sigmoid(z_x), z = E g' + b, so in log space
log p = log_softmax(z + log sigmoid(z)) = log_softmax(2 z - softplus(z))  (their Eq. 13).
The output is not restricted to rank d + 2 because log sigmoid is non-linear in z.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from highrank.heads.softmax import PointwiseSoftmax


class SigSoftmax(PointwiseSoftmax):
    """Sigsoftmax output layer; same knobs as :class:`highrank.heads.softmax.Softmax`."""

    BASE_INIT_KNOBS = None
    NO_BASE_INIT = (
        "f(z) = z + log sigmoid(z) has no knob that makes it the identity, so it cannot "
        "start at the base model's distribution (attach it with init='paper', or use gss, "
        "which starts at slope 1)"
    )

    def _start_transform_at_identity(self) -> None:
        raise ValueError(f"SigSoftmax cannot start at the base softmax: {self.NO_BASE_INIT}")

    def transform(self, logits: torch.Tensor) -> torch.Tensor:
        return logits + F.logsigmoid(logits)
