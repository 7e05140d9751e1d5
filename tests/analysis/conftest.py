"""Shared fixtures of the analysis tests: the benchmark data folder and one tiny trained run."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

# ../shared/data relative to the repository root (tests/analysis/conftest.py -> parents[2]).
SHARED_DATA = Path(__file__).resolve().parents[2].parent / "shared" / "data"
WORD_SIM = SHARED_DATA / "word-sim"

# The 39 words of Miller & Charles (EN-MC-30), so a tiny run covers that benchmark, plus
# three filler words.
MC30_WORDS = (
    "car automobile gem jewel journey voyage boy lad coast shore asylum madhouse magician "
    "wizard midday noon furnace stove food fruit bird cock crane tool implement brother monk "
    "oracle cemetery woodland rooster hill forest graveyard slave chord smile glass string"
).split()
WORDS = [*MC30_WORDS, "the", "a", "of"]

# A 1-layer AWD-LSTM of a few thousand parameters; one epoch takes well under a second.
TINY = [
    "model.d_embed=8",
    "model.d_hidden=12",
    "model.n_layers=1",
    "model.tie_weights=false",
    "train.batch_size=4",
    "train.bptt=6",
    "train.max_seq_len_delta=3",
    "train.eval_batch_size=2",
    "train.lr=5",
    "train.epochs=1",
]


def write_corpus(folder: Path, seed: int = 0) -> Path:
    """train / valid / test of random 3-9 word lines over :data:`WORDS`."""
    rng = random.Random(seed)
    folder.mkdir(parents=True, exist_ok=True)
    for split, lines in (("train", 60), ("valid", 10), ("test", 10)):
        text = [" ".join(rng.choices(WORDS, k=rng.randint(3, 9))) for _ in range(lines)]
        (folder / f"{split}.txt").write_text("\n".join(text) + "\n")
    return folder


def train_tiny_run(root: Path, name: str = "run", *overrides: str) -> Path:
    """Train one epoch of the tiny untied model on a corpus under ``root``; the run dir."""
    from highrank.config import load_config
    from highrank.train import TrainOptions, train

    corpus = root / "corpus"
    if not corpus.is_dir():
        write_corpus(corpus)
    settings = [f"data.dir={corpus}", f"data.cache_dir={root / 'cache'}"]
    config = load_config(None, [*settings, f"run.out_dir={root / name}", *TINY, *overrides])
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return train(config, options=TrainOptions(progress=False)).run_dir
    finally:
        torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def tiny_run(tmp_path_factory) -> Path:
    """A trained tiny run directory (untied embeddings, vocabulary :data:`WORDS` + <eos>),
    shared by the tests of a session: treat it as read-only, or copy it."""
    return train_tiny_run(tmp_path_factory.mktemp("tiny"))


@pytest.fixture
def word_sim_dir() -> Path:
    """The shared word-sim benchmark folder; the test is skipped when it is absent."""
    if not WORD_SIM.is_dir():
        pytest.skip(f"word-similarity benchmarks not found at {WORD_SIM}")
    return WORD_SIM
