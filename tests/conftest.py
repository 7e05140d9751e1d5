"""Shared test settings: small heads that exercise every code path quickly; the shared data
folder; a tiny corpus, the tiny overrides of each model family and one tiny trained run."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

# ../shared/data relative to the repository root: the benchmark data (PTB, Multi30k, word-sim).
SHARED_DATA = Path(__file__).resolve().parents[2] / "shared" / "data"

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


# ---- a tiny corpus, the tiny overrides of each model family, one tiny trained run -------------

# The 39 words of Miller & Charles (EN-MC-30), so the tiny run covers that benchmark, plus
# three filler words.
MC30_WORDS = (
    "car automobile gem jewel journey voyage boy lad coast shore asylum madhouse magician "
    "wizard midday noon furnace stove food fruit bird cock crane tool implement brother monk "
    "oracle cemetery woodland rooster hill forest graveyard slave chord smile glass string"
).split()
WORDS = [*MC30_WORDS, "the", "a", "of"]
# The training tests' vocabulary (31 types with <eos>).
TRAIN_WORDS = [f"w{i}" for i in range(30)]

# The tiny run's model: a 1-layer AWD-LSTM of a few thousand parameters, untied (the analyses
# read both embeddings); one epoch on the tiny corpus takes well under a second.
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
# The training tests' AWD-LSTM: 2 layers (tied) of a few hundred parameters, ~33 steps per epoch
# on the training corpus, every step logged. No epoch count: a test sets train.epochs, stops at
# max_steps, or takes tiny_awd_lstm's one epoch.
TINY_AWD_LSTM = [
    "model.d_embed=8",
    "model.d_hidden=12",
    "model.n_layers=2",
    "train.batch_size=4",
    "train.bptt=6",
    "train.max_seq_len_delta=3",
    "train.eval_batch_size=2",
    "train.lr=5",
    "train.log_every=1",
]
TINY_AWD_LSTM_1EPOCH = [*TINY_AWD_LSTM, "train.epochs=1"]  # tiny_awd_lstm's settings
# A 2-block Transformer of a few hundred parameters; on the training corpus, 34 windows of 6
# rows per epoch, two per update (17 updates), validation every 3 updates.
TINY_TRANSFORMER = [
    "model.backbone=transformer",
    "model.d_embed=8",
    "model.n_layers=2",
    "model.n_heads=2",
    "model.d_ff=16",
    "model.positions=learned",
    "model.max_len=6",
    "model.dropout_input=0.1",
    "model.dropout_attention=0.1",
    "model.dropout_residual=0.1",
    "train.batch_size=4",
    "train.bptt=6",
    "train.eval_batch_size=2",
    "train.lr=0.01",
    "train.weight_decay=0.1",
    "train.clip=1.0",
    "train.warmup_steps=3",
    "train.lr_schedule=cosine",
    "train.accumulate=2",
    "train.eval_every=3",
    "train.epochs=2",
    "train.log_every=1",
]


def write_corpus(
    folder: Path, seed: int = 0, *, words: list[str] = WORDS, lines: tuple = (60, 10, 10)
) -> Path:
    """train / valid / test of ``lines`` random 3-9 word lines over ``words``: by default the
    tiny corpus (the tiny run's), with ``words=TRAIN_WORDS`` and more lines a training one."""
    rng = random.Random(seed)
    folder.mkdir(parents=True, exist_ok=True)
    for split, count in zip(("train", "valid", "test"), lines, strict=True):
        text = [" ".join(rng.choices(words, k=rng.randint(3, 9))) for _ in range(count)]
        (folder / f"{split}.txt").write_text("\n".join(text) + "\n")
    return folder


def write_train_corpus(folder: Path, seed: int = 0) -> Path:
    """The training tests' corpus: 120 / 30 / 30 lines over :data:`TRAIN_WORDS`. Also the
    corpus tests/fixtures/run-v1 was trained on (seed 0): its figures must never change."""
    return write_corpus(folder, seed, words=TRAIN_WORDS, lines=(120, 30, 30))


def write_splits(folder: Path, train: str, valid: str = "a b\n", test: str = "b a\n") -> Path:
    """A corpus folder of the three given texts, as they are."""
    folder.mkdir(parents=True, exist_ok=True)
    for split, text in {"train": train, "valid": valid, "test": test}.items():
        (folder / f"{split}.txt").write_text(text, encoding="utf-8")
    return folder


def tiny_awd_lstm(corpus: Path, out: Path, *overrides: str):
    """The config of one epoch of :data:`TINY_AWD_LSTM` on ``corpus`` into ``out``
    (``overrides`` after)."""
    from highrank.config import load_config

    settings = [f"data.dir={corpus}", f"run.out_dir={out}", *TINY_AWD_LSTM_1EPOCH]
    return load_config(None, [*settings, *overrides])


def train_tiny_run(root: Path, name: str = "run", *overrides: str, max_steps=None) -> Path:
    """Train the tiny run's model (:data:`TINY`, ``overrides`` after) on the tiny corpus under
    ``root`` (written there unless it is), to ``max_steps`` if given; the run directory."""
    from highrank.config import load_config
    from highrank.train import TrainOptions, train

    corpus = root / "corpus"
    if not corpus.is_dir():
        write_corpus(corpus)
    settings = [f"data.dir={corpus}", f"data.cache_dir={root / 'cache'}"]
    config = load_config(None, [*settings, f"run.out_dir={root / name}", *TINY, *overrides])
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a session fixture runs before the per-test one-thread fixture
    try:
        options = TrainOptions(progress=False, max_steps=max_steps)
        return train(config, options=options).run_dir
    finally:
        torch.set_num_threads(threads)


def _snapshot(folder: Path) -> dict[str, tuple[int, int]]:
    return {str(p.relative_to(folder)): (p.stat().st_size, p.stat().st_mtime_ns)
            for p in sorted(folder.rglob("*"))}  # fmt: skip


@pytest.fixture(scope="session")
def tiny_run(tmp_path_factory) -> Path:
    """The tiny trained run (:data:`TINY` for one epoch on the tiny corpus: untied embeddings,
    vocabulary :data:`WORDS` + <eos>), trained once and shared by the eval, analysis, report
    and resume tests. Read-only: a test that writes into a run (records, a broken config, a
    resumed training) copies it first, ``shutil.copytree(tiny_run, tmp_path / "run")``; the
    session ends in an error if the run or its corpus changed."""
    run = train_tiny_run(tmp_path_factory.mktemp("tiny"))
    folders = (run, run.parent / "corpus")
    before = [_snapshot(folder) for folder in folders]
    yield run
    for folder, then in zip(folders, before, strict=True):
        changed = sorted({name for name, _ in set(then.items()) ^ set(_snapshot(folder).items())})
        if changed:
            pytest.fail(f"a test wrote into the shared {folder} (copy it first): {changed}")


@pytest.fixture(scope="session")
def tiny_corpus(tiny_run) -> Path:
    """The tiny corpus the tiny run was trained on (its ``data.dir``): read-only."""
    return tiny_run.parent / "corpus"
