"""Shared test settings: small heads that exercise every code path quickly."""

from __future__ import annotations

import pytest
import torch

# Knobs that keep each head small while exercising its distinctive paths: several mixture
# components, both frequent and gate-shared Mixtape ids, and few PLIF pieces.
SMALL_KNOBS: dict[str, dict] = {
    "softmax": {},
    "moc": {"n_components": 3},
    "mos": {"n_components": 3},
    "mixtape": {"gate_dim": 4, "frequent_fraction": 0.3},
    "sigsoftmax": {},
    "gss": {},
    "plif": {"n_pieces": 1000},
    "mlp_softmax": {"mlp_width": 7},
}

# Knobs that switch on every source of training-time randomness a head has.
STOCHASTIC_KNOBS: dict[str, dict] = {
    "moc": {"latent_dropout": 0.3},
    "mos": {"latent_dropout": 0.3},
    "mixtape": {"gate_noise": 0.1, "gate_dropout": 0.2, "component_dropout": 0.2},
    "mlp_softmax": {"latent_dropout": 0.3},
}


@pytest.fixture(autouse=True)
def _seeded_single_thread():
    """Every test starts from seed 0 on one thread: test tensors are too small to gain from
    more, and one thread keeps the suite fast and reproducible on a busy machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def make_head():
    """``make_head(name, d_in=12, vocab_size=50, **knobs)``: a small head of the named kind."""
    from highrank.heads import build_head

    def make(name: str, *, d_in: int = 12, vocab_size: int = 50, stochastic=False, **knobs):
        merged = {**SMALL_KNOBS[name], **(STOCHASTIC_KNOBS.get(name, {}) if stochastic else {})}
        merged.update(knobs)
        return build_head(name, d_in=d_in, vocab_size=vocab_size, **merged)

    return make
