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
    # two layers, two previous positions; a mixture of 2, the first over 3 partitions
    "mfs": {"n_components": 2, "n_partitions": 3, "input_layers": 2},
    # C, P and both reranker stages, with fewer candidates than the 50 ids
    "cpr": {"reranker_k1": 10, "reranker_k2": 4, "input_layers": 2},
}

# Knobs that switch on every source of training-time randomness a head has.
STOCHASTIC_KNOBS: dict[str, dict] = {
    "moc": {"latent_dropout": 0.3},
    "mos": {"latent_dropout": 0.3},
    "mixtape": {"gate_noise": 0.1, "gate_dropout": 0.2, "component_dropout": 0.2},
    "mlp_softmax": {"latent_dropout": 0.3},
}


def head_inputs(head, hidden: torch.Tensor) -> dict:
    """What ``head`` reads besides ``hidden`` (``head.reads``), made from ``hidden`` for the
    tests: its last ``input_layers`` layers (scaled, rolled copies of ``hidden`` below it, so
    gradients reach ``hidden`` through them too) and the context's ids (small, so words
    repeat; -1 marks padding), over hidden's positions, time axis the last leading one. The
    same ``hidden`` gives the same inputs, without touching the global random stream."""
    inputs: dict = {}
    if "layers" in head.reads:
        below = [0.5**k * hidden.roll(k, dims=-1) for k in range(head.input_layers - 1, 0, -1)]
        inputs["layers"] = (*below, hidden)
    if "context_ids" in head.reads:
        shape = hidden.shape[:-1]
        if hidden.device.type == "meta":
            inputs["context_ids"] = torch.zeros(shape, dtype=torch.long, device="meta")
        else:
            generator = torch.Generator().manual_seed(17)
            ids = torch.randint(-1, 8, shape, generator=generator)
            inputs["context_ids"] = ids.to(hidden.device)
    return inputs


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
