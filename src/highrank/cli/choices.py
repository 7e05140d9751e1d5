"""Names and defaults the verbs declare their options from, as plain constants.

Declaring an option must not import the library: ``highrank VERB --help`` and argparse's
errors (``analyze rank --max-contexts -5``) answer in a moment, while importing torch, numpy
and the analyses takes seconds, a minute on a busy machine. Each constant here copies one of
the library's, named beside it; ``tests/cli/test_cli.py`` holds every copy equal to its original,
so a change there fails a test instead of drifting from the help.
"""

from __future__ import annotations

from pathlib import Path

# highrank.heads: tuple(HEADS) and PAPER_HEADS (the seven papers' heads that read hidden states
# alone; mlp_softmax is the rank-bounded capacity control; mfs and cpr also read other layers
# and the context's tokens)
HEAD_NAMES: tuple[str, ...] = (
    "softmax",
    "moc",
    "mos",
    "mixtape",
    "sigsoftmax",
    "gss",
    "plif",
    "mlp_softmax",
    "mfs",
    "cpr",
)
PAPER_HEAD_NAMES: tuple[str, ...] = tuple(
    name for name in HEAD_NAMES if name not in ("mlp_softmax", "mfs", "cpr")
)

# highrank.demo.DemoSettings(): the defaults `highrank demo` shows and uses
DEMO_DEFAULTS: dict[str, object] = {
    "rank": 64,
    "dim": 8,
    "vocab": 256,
    "contexts": 256,
    "heads": PAPER_HEAD_NAMES,
    "steps": 2000,
    "seed": 0,
    "mixtape_frequent_fraction": 1.0,
    "threads": 1,
}

# highrank.bench.heads: tuple(CASES) and DEFAULT_CASES (MFS and CPR run when named)
_BENCHED = ("softmax", "sigsoftmax", "gss", "plif", "moc", "mos", "mixtape", "mfs", "cpr")
BENCH_CASES: tuple[str, ...] = (
    *(label for name in _BENCHED for label in (name, f"{name}-unchunked")),
    "mixtape-no-sharing",
    "mixtape-generic",
)
BENCH_DEFAULT_CASES: tuple[str, ...] = (*_BENCHED[:7], "softmax-unchunked", "mixtape-no-sharing")

# the analyses (highrank.analysis.<module>.<NAME>)
MATRIX_KINDS = ("log_prob", "logits")  # logprob_matrix.MATRIX_KINDS
GRAM_BACKENDS = ("auto", "scipy", "torch")  # rank.GRAM_BACKENDS
BATCH_ELEMENTS = 2**26  # hf_contexts.BATCH_ELEMENTS
KL_PAIRS = 10_000  # kl.DEFAULT_PAIRS
MIN_GAP = 100.0  # hidden_size.DEFAULT_MIN_GAP
GRADIENT_MAX_CONTEXTS = 2048  # gradient_bottleneck.DEFAULT_MAX_TOKENS
SATURATION_MAX_CONTEXTS = 4096  # saturation.DEFAULT_MAX_CONTEXTS
SATURATION_TOP_K = (1, 10, 100)  # saturation.DEFAULT_TOP_K
WORD_SIM_DIR = Path("..") / "shared" / "data" / "word-sim"  # similarity.DEFAULT_DATA_DIR
RADIUS = 100.0  # unargmaxable.DEFAULT_RADIUS
PATIENCE = 10  # unargmaxable.DEFAULT_PATIENCE
GROUP_SEPARATOR = "--"  # significance.SEPARATOR: between the two groups of `highrank compare`

# (constant here, module, its name there): what tests/cli/test_cli.py compares
ORIGINALS: tuple[tuple[str, str, str], ...] = (
    ("HEAD_NAMES", "highrank.heads", "HEADS"),
    ("PAPER_HEAD_NAMES", "highrank.heads", "PAPER_HEADS"),
    ("BENCH_CASES", "highrank.bench.heads", "CASES"),
    ("BENCH_DEFAULT_CASES", "highrank.bench.heads", "DEFAULT_CASES"),
    ("MATRIX_KINDS", "highrank.analysis.logprob_matrix", "MATRIX_KINDS"),
    ("GRAM_BACKENDS", "highrank.analysis.rank", "GRAM_BACKENDS"),
    ("BATCH_ELEMENTS", "highrank.analysis.hf_contexts", "BATCH_ELEMENTS"),
    ("KL_PAIRS", "highrank.analysis.kl", "DEFAULT_PAIRS"),
    ("MIN_GAP", "highrank.analysis.hidden_size", "DEFAULT_MIN_GAP"),
    ("GRADIENT_MAX_CONTEXTS", "highrank.analysis.gradient_bottleneck", "DEFAULT_MAX_TOKENS"),
    ("SATURATION_MAX_CONTEXTS", "highrank.analysis.saturation", "DEFAULT_MAX_CONTEXTS"),
    ("SATURATION_TOP_K", "highrank.analysis.saturation", "DEFAULT_TOP_K"),
    ("WORD_SIM_DIR", "highrank.analysis.similarity", "DEFAULT_DATA_DIR"),
    ("RADIUS", "highrank.analysis.unargmaxable", "DEFAULT_RADIUS"),
    ("PATIENCE", "highrank.analysis.unargmaxable", "DEFAULT_PATIENCE"),
    ("GROUP_SEPARATOR", "highrank.analysis.significance", "SEPARATOR"),
)
