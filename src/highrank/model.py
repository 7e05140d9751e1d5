"""Old path kept for compatibility; the code lives in highrank.models (language_model, load)."""

from highrank.models.language_model import (
    MODEL_BUILDERS,
    LanguageModel,
    build_model,
    build_seq2seq,
    check_layers_read,
    count_parameters,
)
from highrank.models.load import load_run, load_run_corpus

__all__ = [
    "MODEL_BUILDERS",
    "LanguageModel",
    "build_model",
    "build_seq2seq",
    "check_layers_read",
    "count_parameters",
    "load_run",
    "load_run_corpus",
]
